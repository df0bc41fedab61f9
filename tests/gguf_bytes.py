"""Small, well-formed Llama GGUF files built in milliseconds (no torch), and byte patches of
their header, for the hostile-input tests (test_hostile_gguf.py, test_fuzz_files.py)."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

__all__ = ["write_model_gguf", "patch_kv", "kv_offset"]

# GGUF value type -> struct format
_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def write_model_gguf(
    path: Path,
    blocks: int = 2,
    embd: int = 8,
    vocab: int = 16,
    ffn: int = 16,
    heads: int = 2,
    kv_heads: int = 1,
    arch: str = "llama",
) -> Path:
    """A GGUF whose metadata agrees with its tensor index: token list and types, the
    architecture numbers, token_embd/output and two small tensors per block."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_custom_alignment(32)
    w.add_block_count(blocks)
    w.add_context_length(64)
    w.add_embedding_length(embd)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((vocab, embd), dtype=np.float32))
    w.add_tensor("output.weight", rng.standard_normal((vocab, embd), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(embd, dtype=np.float32))
    for i in range(blocks):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(embd, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_up.weight", rng.standard_normal((ffn, embd), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def kv_offset(data: bytes, key: str) -> tuple[int, int]:
    """(offset of the value, its GGUF type) of metadata `key` in a GGUF's bytes."""
    raw = key.encode()
    at = data.index(struct.pack("<Q", len(raw)) + raw) + 8 + len(raw)
    return at + 4, struct.unpack_from("<I", data, at)[0]


def patch_kv(data: bytes, key: str, value) -> bytes:
    """`data` with the scalar metadata `key` set to `value` (same type, same size), or for an
    array, its element count set to `value`."""
    out = bytearray(data)
    at, vtype = kv_offset(data, key)
    if vtype == 9:  # array: item type u32, count u64
        struct.pack_into("<Q", out, at + 4, value)
    else:
        struct.pack_into("<" + _FMT[vtype], out, at, value)
    return bytes(out)
