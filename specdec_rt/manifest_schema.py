"""The manifest schema: every constant the exporter and the runtime must agree on, defined once.

``python -m export`` writes ``manifest.json`` beside the ONNX files; the runtime
(:mod:`specdec_rt.ort.manifest`) reads and checks it. Both import their schema from here and
nowhere else (docs/manifest.md describes the fields): the version, the size limits, the input and
output roles with their ONNX names, and the added tokens a folder's tokenizer keeps as text.

Why a root module and not ``specdec_rt/ort/schema.py``: this module imports nothing (the standard
library aside, not even numpy), so the exporter can read the schema without loading the ONNX
Runtime backend (``specdec_rt/ort/__init__`` imports the scheduler's adapters, the batching loop
and the KV pool), and the text layer, which lies below ``ort`` in the layer order
(tests/test_layers.py), can import :data:`TEXT_TAGS` from it. It sits in the lowest layer, with
``errors`` and ``logs``.
"""

from __future__ import annotations

__all__ = [
    "CACHE_ENV",
    "SCHEMA_VERSION",
    "MANIFEST",
    "STAMP",
    "STAMP_STAT",
    "MAX_MANIFEST_BYTES",
    "MAX_TEMPLATE_CHARS",
    "MAX_NAME_CHARS",
    "MAX_PATH_CHARS",
    "MAX_FILES",
    "MAX_EOS_IDS",
    "MAX_DRAFTS",
    "LIMITS",
    "MAX_TOKEN_ID",
    "MODEL_ROLES",
    "KV_LAYOUT",
    "CONCAT_KV_LAYOUT",
    "BUILDERS",
    "CONCAT_INPUTS",
    "KV_ROLES",
    "KV_DTYPES",
    "REQUIRED_INPUTS",
    "PACKED_ROLES",
    "TREE_ROLES",
    "IO_NAMES",
    "TEXT_TAGS",
]

# The format this exporter writes and this runtime reads (docs/manifest.md). A change that an
# older runtime would misread bumps it; the runtime refuses any other version.
SCHEMA_VERSION = 1

# The variable naming the folder built models live in (<root>/models/<recipe-name>/), for the
# exporter that builds them and the runtime that finds them by name. (The rule around it,
# ``cache_root``, is a function in each: this module holds constants alone.)
CACHE_ENV = "SPECDEC_RT_CACHE"

MANIFEST = "manifest.json"  # written last: a folder without it is incomplete
STAMP = ".specdec-verified.json"  # the runtime's record of verified sha256: [*STAMP_STAT, sha256] per file
# The os.stat fields a STAMP entry records before the file's sha256; a file whose fields differ is
# hashed again. The inode's change time is the kernel's clock at the file's last change, its
# mtime's restoring (os.utime) included, and no user can set it back; the inode number changes
# when the file is replaced. So a file changed, then given its old size and mtime, is rehashed.
STAMP_STAT = ("st_size", "st_mtime_ns", "st_ctime_ns", "st_ino")

# The largest legitimate manifest is its chat template plus a few kB: the rest (architecture,
# ONNX names, a files table of about six entries, drafts, the build and validation records) is
# 4.5 kB for smollm2-135m. A template is at most MAX_TEMPLATE_CHARS characters, and JSON takes at
# most 6 bytes for one (a control character as \u0001; non-ASCII is 2-4 bytes of UTF-8, a quote
# or newline 2), so a manifest with a template at that bound is at most 1.5 MiB + a few kB
# (real templates are 0.4-20 kB). 4 MiB leaves 2.5x over that worst case, and bounds what an
# untrusted folder can make either side parse (~20 ms of json.loads). The verification stamp
# (STAMP) is read under the same bound.
MAX_MANIFEST_BYTES = 4 << 20
MAX_TEMPLATE_CHARS = 256 << 10  # tokenizer.chat_template: jinja2 source
MAX_NAME_CHARS = 256  # ONNX input/output names and KV name templates
MAX_PATH_CHARS = 1024  # a relative path the manifest names (files, tokenizer, drafts)
MAX_FILES = 4096  # entries of "files"
MAX_EOS_IDS = 64  # special_tokens.eos
MAX_DRAFTS = 64  # entries of "drafts"

# architecture numbers: inclusive bounds, checked before anything is sized from them
LIMITS = {
    "num_layers": (1, 1024),
    "hidden_size": (1, 1 << 16),
    "num_heads": (1, 1024),
    "num_kv_heads": (1, 1024),
    "head_dim": (1, 4096),
    "vocab_size": (1, 1 << 22),
    "max_positions": (2, 1 << 22),
}
MAX_TOKEN_ID = 1 << 22  # token ids are 0 .. MAX_TOKEN_ID - 1

MODEL_ROLES = ("target", "draft")  # "role"
KV_LAYOUT = "BNSH"  # onnx.kv.layout: [B, kv_heads, max_len, head_dim], past and present in one buffer
# onnx.kv.layout of a graph built through optimum ("builder": "optimum"): past [B, kv_heads,
# past, head_dim] in, present [B, kv_heads, past + new, head_dim] out, separate tensors (the
# runtime keeps each present and feeds it back as the next call's past)
CONCAT_KV_LAYOUT = "BNSH-concat"
# "builder": what built the folder's graph: this exporter's own graph builder (export.graph, the
# default of a manifest without the field) or optimum-onnx's exporter (export.optimum_path)
BUILDERS = ("native", "optimum")
# onnx.inputs of a graph built through optimum (position_ids may be null: a graph without it)
CONCAT_INPUTS = ("input_ids", "attention_mask")
KV_ROLES = ("past_key", "past_value", "present_key", "present_value")  # onnx.kv name templates
KV_DTYPES = ("float32", "float16")  # onnx.kv.dtype: the cache's element type (float16 halves it)
REQUIRED_INPUTS = ("input_ids", "seqlens_k", "total_sequence_length", "logits_index")  # onnx.inputs of every graph
# Packed rows: all rows' new positions in one row for the MatMuls, laid out as right-padded rows
# for attention only (a batch of verifies pays for its real positions, not the padding)
PACKED_ROLES = ("query_seqlens", "pad_index", "pack_index", "padded_shape")
# ... with each packed position's absolute position and an additive attention bias (a draft tree
# verified in one call). Every language-model graph takes PACKED_ROLES + TREE_ROLES; an EAGLE
# head (an input "features") takes neither.
TREE_ROLES = ("position_ids", "attention_bias")

# role -> the ONNX name the exporter gives it (`{layer}` is filled per layer); the manifest
# repeats these, and the runtime takes every name from the manifest, never from here
IO_NAMES = {
    "input_ids": "input_ids",  # int64 [1, N]
    "position_ids": "position_ids",  # int64 [1, N]: each packed position's absolute position
    "attention_bias": "attention_bias",  # float32 [1, 1, S, total]: zeros, or a tree mask
    "seqlens_k": "seqlens_k",  # int32 [B]: total valid length after the call - 1
    "total_sequence_length": "total_sequence_length",  # int32 scalar
    "logits_index": "logits_index",  # int64 [R]: packed positions that get logits
    "query_seqlens": "query_seqlens",  # int32 [B] new positions per row
    "pad_index": "pad_index",  # int64 [B*S] packed position of each padded one
    "pack_index": "pack_index",  # int64 [N] padded position of each packed one
    "padded_shape": "padded_shape",  # int64 [3] = B, S, -1
    "logits": "logits",  # float32 [B, R, V]
    "hidden": "hidden_states",  # float32 [B, S, H]: final-norm output
    "past_key": "past_key_values.{layer}.key",
    "past_value": "past_key_values.{layer}.value",
    "present_key": "present.{layer}.key",
    "present_value": "present.{layer}.value",
}

# Added tokens that are text the answer holds, not control: a model writes its tool calls with
# them (Qwen2.5's ``<tool_call>``, ``special: false`` in its own tokenizer; a GGUF's tokenizer
# marks every added token special, so decoding would drop them and no call could be parsed).
# The exporter writes them with ``special: false``; the runtime reads them as text (and rewrites
# a folder's tokenizer that marks them special). The same strings as specdec_rt.text.tools'
# CALL_OPEN / CALL_CLOSE (a test holds them equal).
TEXT_TAGS = frozenset({"<tool_call>", "</tool_call>"})
