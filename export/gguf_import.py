"""GGUF files of the families transformers 4.57 cannot load, read into their Hugging Face model.

transformers' GGUF loader knows neither these architectures' config keys nor (for `phi2`,
`gptneox`) their Hugging Face names. Here each file is read as llama.cpp reads it: the config
from the header by llama.cpp's rules (a key it does not write takes llama.cpp's default, not
the Hugging Face config's), the tensors by gguf-py's name map (what llama.cpp's converter
wrote each parameter as), undoing the converter's rearrangements:

| GGUF arch | model_type | the converter wrote | read back |
|---|---|---|---|
| `gemma` | gemma | norms as 1 + w, no LM head (tied) | w - 1 |
| `phi2` | phi | q/k/v apart (older files: fused `attn_qkv`), `rope.dimension_count` | `attn_qkv` split; `partial_rotary_factor` |
| `gpt2` | gpt2 | Conv1D weights transposed, the embedding again as `output` | transposed back; `output` as an untied LM head |
| `starcoder2` | starcoder2 | LayerNorms, biases where the model has them; no window (llama.cpp slides none) | `use_bias` from the tensors |
| `olmo2` | olmo2 | q/k norms over the whole projections, norms after attention and MLP | as is |
| `granite` | granite | q/k rows permuted (Llama's converter); multipliers as `*_scale` (only when set) | rows un-permuted; a missing attention scale is llama.cpp's 1/sqrt(head) |
| `gptneox` | gpt_neox | fused q/k/v regrouped from per head to q, k, v | regrouped per head; `rotary_pct`, `use_parallel_residual` |
| `falcon` | falcon | fused q/k/v (one KV head: as Falcon 7B keeps them) | multi-query; grouped KV heads (40B, 180B) refused |
| `bloom` | bloom | names without `transformer.`, fused q/k/v regrouped as GPT-NeoX's, context = `seq_length` or the width | regrouped per head; ALiBi (no key: llama.cpp's bias 8 is BLOOM's) |
| `mpt` | mpt | q/k/v rows of `Wqkv` as they are, `attention.clamp_kqv` (clip_qkv, when set), `attention.max_alibi_bias` | as is; the clamp; ALiBi with bias 8 only (transformers' MPT's); no biases, q/k norms or position table |
| `qwen2moe` | qwen2_moe | experts stacked `ffn_*_exps [E, ...]`, shared expert and its gate | one expert per slice; top k weights not renormalised (llama.cpp) |
| `qwen3moe` | qwen3_moe | experts stacked, `attention.key_length` | one expert per slice; top k weights renormalised (llama.cpp) |

The quantized blocks survive: every rearrangement moves whole rows (each row of a matrix is
its own run of blocks along the input dimension), so a dequantized weight stays on its grid
(`export.grid`). Every parameter of the model must come from a tensor of the file and every
tensor of the file must be used: a leftover would mean a model that computes something else.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .errors import CorruptSourceError, UnsupportedModelError
from .gguf_meta import GGUFInfo, read_gguf_info

__all__ = ["IMPORTED_FAMILIES", "imported_config", "load_imported_model", "load_imported_tokenizer"]

Array = npt.NDArray[np.float32]
Config = dict[str, Any]
MAX_EXPERTS = 1024
MAX_WIDTH = 1 << 20
LLAMA_ROPE_BASE = 10000.0  # llama.cpp's rope.freq_base without the key
FALCON_CONTEXT = 2048  # what the converter writes (not in Falcon's config.json)
MPT_ALIBI_BIAS = 8.0  # the only alibi_bias_max transformers' MPT builds its slopes with
IGNORED = ("rope_freqs.weight",)  # precomputed tables the Hugging Face model derives itself


@dataclass(frozen=True, kw_only=True)
class ImportedFamily:
    """How one llama.cpp architecture reads into a Hugging Face model."""

    model_type: str
    config: Callable[[GGUFInfo, Path], Config]
    tensors: Callable[[dict[str, Array], Config], None] | None = None  # undo the converter, in place
    prefix: str = ""  # what the converter strips from the parameters' names before gguf-py's map


def _key(info: GGUFInfo, key: str) -> Any:
    return info.metadata.get(f"{info.architecture}.{key}")


def _count(info: GGUFInfo, path: Path, key: str, *, bounds: tuple[int, int], default: int | None = None) -> int:
    value = _key(info, key)
    if value is None and default is not None:
        return default
    low, high = bounds
    if type(value) is not int or not low <= value <= high:
        raise CorruptSourceError(
            f"GGUF {path}: {info.architecture}.{key} = {value!r} is not an integer from {low} to {high}"
        )
    return value


def _positive(info: GGUFInfo, path: Path, key: str, default: float) -> float:
    value = _key(info, key)
    if value is None:
        return default
    if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
        raise CorruptSourceError(f"GGUF {path}: {info.architecture}.{key} = {value!r} is not a finite number > 0")
    # a float32 key as the shortest decimal it stores (1e-05, not 9.999999747378752e-06)
    return float(str(np.float32(value))) if type(value) is float else float(value)


def _dims(info: GGUFInfo, name: str) -> tuple[int, ...] | None:
    got = info.tensors.get(name)
    return tuple(got[0]) if got is not None else None


def _common(info: GGUFInfo, path: Path) -> Config:
    """What every family reads the same way (`check_model` has bounded the integers)."""
    meta = info.metadata
    heads = _key(info, "attention.head_count")
    embed = _dims(info, "token_embd.weight") or (0, 0)
    out: Config = {
        "vocab_size": embed[1],
        "hidden_size": _key(info, "embedding_length"),
        "num_hidden_layers": _key(info, "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _key(info, "attention.head_count_kv") or heads,
        "intermediate_size": _key(info, "feed_forward_length"),
        "max_position_embeddings": _key(info, "context_length") or FALCON_CONTEXT,
        "rope_theta": _positive(info, path, "rope.freq_base", LLAMA_ROPE_BASE),
        "tie_word_embeddings": "output.weight" not in info.tensors,
    }
    for attr, key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        value = meta.get(f"tokenizer.ggml.{key}")
        out[attr] = value if type(value) is int and 0 <= value < out["vocab_size"] else None
    _refuse_scaling(info, path)
    return out


def _refuse_scaling(info: GGUFInfo, path: Path) -> None:
    kind = _key(info, "rope.scaling.type")
    if kind not in (None, "none"):
        raise UnsupportedModelError(
            f"GGUF {path}: {info.architecture}.rope.scaling.type = {str(kind)[:40]!r} is not supported "
            f"for {info.architecture} GGUF files"
        )


def _rms(info: GGUFInfo, path: Path) -> float:
    return _positive(info, path, "attention.layer_norm_rms_epsilon", 1e-6)


def _layer_norm(info: GGUFInfo, path: Path) -> float:
    return _positive(info, path, "attention.layer_norm_epsilon", 1e-5)


def _head_size(info: GGUFInfo, path: Path, common: Config) -> int:
    """`attention.key_length` (= value length), else hidden / heads."""
    default = common["hidden_size"] // common["num_attention_heads"]
    key = _count(info, path, "attention.key_length", bounds=(1, 1024), default=default)
    value = _count(info, path, "attention.value_length", bounds=(1, 1024), default=key)
    if value != key:
        raise UnsupportedModelError(f"GGUF {path}: key length {key} and value length {value} differ")
    return key


def _rotary_fraction(info: GGUFInfo, path: Path, head: int) -> float:
    dims = _count(info, path, "rope.dimension_count", bounds=(2, head), default=head)
    if dims % 2:
        raise CorruptSourceError(f"GGUF {path}: {info.architecture}.rope.dimension_count = {dims} is odd")
    return dims / head


def _gemma(info: GGUFInfo, path: Path) -> Config:
    common = _common(info, path)
    return {**common, "head_dim": _head_size(info, path, common), "rms_norm_eps": _rms(info, path)}


def _phi2(info: GGUFInfo, path: Path) -> Config:
    common = _common(info, path)
    head = common["hidden_size"] // common["num_attention_heads"]
    return {
        **common,
        "layer_norm_eps": _layer_norm(info, path),
        "partial_rotary_factor": _rotary_fraction(info, path, head),
        "qk_layernorm": False,
    }


def _gpt2(info: GGUFInfo, path: Path) -> Config:
    common = _common(info, path)
    positions = _dims(info, "position_embd.weight")
    if positions is None or positions[0] != common["hidden_size"]:
        raise CorruptSourceError(f"GGUF {path}: position_embd.weight is {positions}, not [embedding length, positions]")
    return {
        **common,
        "n_inner": common["intermediate_size"],
        "n_positions": positions[1],
        "layer_norm_epsilon": _layer_norm(info, path),
    }


def _starcoder2(info: GGUFInfo, path: Path) -> Config:
    common = _common(info, path)
    return {
        **common,
        "norm_epsilon": _layer_norm(info, path),
        "use_bias": "blk.0.ffn_up.bias" in info.tensors,
        "sliding_window": None,  # llama.cpp's StarCoder2 graph slides no window
    }


def _olmo2(info: GGUFInfo, path: Path) -> Config:
    return {**_common(info, path), "rms_norm_eps": _rms(info, path), "attention_bias": False}


def _granite(info: GGUFInfo, path: Path) -> Config:
    common = _common(info, path)
    head = common["hidden_size"] // common["num_attention_heads"]
    return {
        **common,
        "rms_norm_eps": _rms(info, path),
        # llama.cpp: 1/sqrt(head) without attention.scale, 1 without the other three
        "attention_multiplier": _positive(info, path, "attention.scale", 1 / math.sqrt(head)),
        "embedding_multiplier": _positive(info, path, "embedding_scale", 1.0),
        "residual_multiplier": _positive(info, path, "residual_scale", 1.0),
        "logits_scaling": _positive(info, path, "logit_scale", 1.0),
    }


def _gptneox(info: GGUFInfo, path: Path) -> Config:
    common = _common(info, path)
    head = common["hidden_size"] // common["num_attention_heads"]
    parallel = _key(info, "use_parallel_residual")
    return {
        **common,
        "layer_norm_eps": _layer_norm(info, path),
        "rotary_pct": _rotary_fraction(info, path, head),
        "rotary_emb_base": common["rope_theta"],
        "use_parallel_residual": True if parallel is None else bool(parallel),
    }


def _falcon(info: GGUFInfo, path: Path) -> Config:
    common = _common(info, path)
    if common["num_key_value_heads"] != 1:
        raise UnsupportedModelError(
            f"GGUF {path}: falcon.attention.head_count_kv = {common['num_key_value_heads']}: Falcon's grouped "
            "KV heads (new_decoder_architecture, 40B / 180B) are not supported"
        )
    return {
        **common,
        "layer_norm_epsilon": _layer_norm(info, path),
        "ffn_hidden_size": common["intermediate_size"],
        "multi_query": True,
        "new_decoder_architecture": False,
        "parallel_attn": True,
        "alibi": False,
        "bias": "blk.0.attn_qkv.bias" in info.tensors,
    }


def _check_bloom_shapes(info: GGUFInfo, path: Path, hidden: int, layers: int) -> None:
    """The embeddings' norm and every layer's attention and MLP matrices as BLOOM's, from the
    header: a fused q/k/v of another size could not be regrouped by heads."""
    expected: dict[str, tuple[int, ...]] = {"token_embd_norm.weight": (hidden,)}
    for layer in range(layers):
        for kind, shape in (
            ("attn_qkv.weight", (hidden, 3 * hidden)),
            ("attn_qkv.bias", (3 * hidden,)),
            ("attn_output.weight", (hidden, hidden)),
            ("ffn_up.weight", (hidden, 4 * hidden)),
            ("ffn_down.weight", (4 * hidden, hidden)),
        ):
            expected[f"blk.{layer}.{kind}"] = shape
    for name, dims in expected.items():
        got = _dims(info, name)
        if got != dims:
            raise CorruptSourceError(
                f"GGUF {path}: {name} is {list(got) if got else 'missing'}, BLOOM's is {list(dims)}"
            )


def _bloom(info: GGUFInfo, path: Path) -> Config:
    """BLOOM: one KV head a head, an MLP of 4 x the width, q/k/v fused, ALiBi (llama.cpp's bias
    8 for every bloom file, BLOOM's slopes); no rotary."""
    common = _common(info, path)
    hidden, heads = common["hidden_size"], common["num_attention_heads"]
    if common["num_key_value_heads"] != heads:
        raise UnsupportedModelError(
            f"GGUF {path}: bloom.attention.head_count_kv = {common['num_key_value_heads']} is not "
            f"bloom.attention.head_count = {heads}: BLOOM has a KV head per head"
        )
    if common["intermediate_size"] != 4 * hidden:
        raise UnsupportedModelError(
            f"GGUF {path}: bloom.feed_forward_length = {common['intermediate_size']} is not BLOOM's 4 x {hidden}"
        )
    _check_bloom_shapes(info, path, hidden, common["num_hidden_layers"])
    return {
        "vocab_size": common["vocab_size"],
        "hidden_size": hidden,
        "num_hidden_layers": common["num_hidden_layers"],  # BloomConfig's n_layer, n_head
        "num_attention_heads": heads,
        "layer_norm_epsilon": _layer_norm(info, path),
        "apply_residual_connection_post_layernorm": False,  # llama.cpp adds the un-normed input
        "max_position_embeddings": common["max_position_embeddings"],
        "tie_word_embeddings": common["tie_word_embeddings"],
        **{k: common[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
    }


def _mpt_layer_shapes(hidden: int, layers: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of an MPT file as transformers' MPT has it (no biases, no q/k norms, no
    position table), by name, in ggml order; `output.weight` apart (an untied head)."""
    expected: dict[str, tuple[int, ...]] = {"output_norm.weight": (hidden,)}
    for layer in range(layers):
        for kind, shape in (
            ("attn_norm.weight", (hidden,)),
            ("attn_qkv.weight", (hidden, 3 * hidden)),
            ("attn_output.weight", (hidden, hidden)),
            ("ffn_norm.weight", (hidden,)),
            ("ffn_up.weight", (hidden, 4 * hidden)),
            ("ffn_down.weight", (4 * hidden, hidden)),
        ):
            expected[f"blk.{layer}.{kind}"] = shape
    return expected


def _check_mpt_tensors(info: GGUFInfo, path: Path, hidden: int, layers: int) -> None:
    """Each layer's matrices and norms as MPT's, from the header, and no tensor llama.cpp's MPT
    graph takes but transformers' MPT lacks (biases, q/k norms, a position table, AWQ scales)."""
    expected = _mpt_layer_shapes(hidden, layers)
    for name, dims in expected.items():
        got = _dims(info, name)
        if got != dims:
            raise CorruptSourceError(f"GGUF {path}: {name} is {list(got) if got else 'missing'}, MPT's is {list(dims)}")
    extra = sorted(set(info.tensors) - set(expected) - {"token_embd.weight", "output.weight"})
    if extra:
        raise UnsupportedModelError(
            f"GGUF {path}: tensor {extra[0]} has no place in an mpt model (transformers' MPT has no biases, "
            f"q/k norms or position table; {len(extra)} such tensors)"
        )


def _mpt_alibi(info: GGUFInfo, path: Path) -> None:
    """llama.cpp's MPT graph takes its ALiBi slopes from `attention.max_alibi_bias` (0: none, a
    learned position table); transformers' MPT always builds them with 8, the same slopes."""
    bias = _key(info, "attention.max_alibi_bias")
    if type(bias) not in (int, float) or not math.isfinite(bias):
        raise CorruptSourceError(f"GGUF {path}: mpt.attention.max_alibi_bias = {bias!r} is not a finite number")
    if bias == 0:
        raise UnsupportedModelError(
            f"GGUF {path}: mpt.attention.max_alibi_bias = {bias!r}: MPT without ALiBi (a learned position "
            "table) is not supported"
        )
    if bias != MPT_ALIBI_BIAS:
        raise UnsupportedModelError(
            f"GGUF {path}: mpt.attention.max_alibi_bias = {bias!r}: transformers' MPT has ALiBi with "
            f"alibi_bias_max {MPT_ALIBI_BIAS:g} only"
        )


def _mpt(info: GGUFInfo, path: Path) -> Config:
    """MPT: one KV head a head, an MLP of 4 x the width, q/k/v rows fused as transformers'
    `Wqkv` keeps them, ALiBi (bias 8), q/k/v clamped by `attention.clamp_kqv`, 1/sqrt(head)."""
    common = _common(info, path)
    hidden, heads = common["hidden_size"], common["num_attention_heads"]
    if common["num_key_value_heads"] != heads:
        raise UnsupportedModelError(
            f"GGUF {path}: mpt.attention.head_count_kv = {common['num_key_value_heads']} is not "
            f"mpt.attention.head_count = {heads}: transformers' MPT has a KV head per head"
        )
    if common["intermediate_size"] != 4 * hidden:
        raise UnsupportedModelError(
            f"GGUF {path}: mpt.feed_forward_length = {common['intermediate_size']} is not MPT's 4 x {hidden}"
        )
    _mpt_alibi(info, path)
    clamp = _positive(info, path, "attention.clamp_kqv", 0.0) or None  # llama.cpp: no clamp without the key
    _check_mpt_tensors(info, path, hidden, common["num_hidden_layers"])
    return {
        "vocab_size": common["vocab_size"],
        "d_model": hidden,
        "n_heads": heads,
        "n_layers": common["num_hidden_layers"],
        "expansion_ratio": 4,
        "max_seq_len": common["max_position_embeddings"],
        "layer_norm_epsilon": _layer_norm(info, path),
        "attn_config": {"clip_qkv": clamp, "softmax_scale": None, "alibi": True, "alibi_bias_max": 8},
        "no_bias": True,
        "tie_word_embeddings": common["tie_word_embeddings"],
        **{k: common[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
    }


def _experts(info: GGUFInfo, path: Path) -> Config:
    count = _count(info, path, "expert_count", bounds=(1, MAX_EXPERTS))
    return {
        "num_experts": count,
        "num_experts_per_tok": _count(info, path, "expert_used_count", bounds=(1, count)),
        "moe_intermediate_size": _count(info, path, "expert_feed_forward_length", bounds=(1, MAX_WIDTH)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "use_sliding_window": False,
        "rms_norm_eps": _rms(info, path),
    }


def _qwen2moe(info: GGUFInfo, path: Path) -> Config:
    shared = _count(info, path, "expert_shared_feed_forward_length", bounds=(1, MAX_WIDTH))
    return {
        **_common(info, path),
        **_experts(info, path),
        "shared_expert_intermediate_size": shared,
        "qkv_bias": "blk.0.attn_q.bias" in info.tensors,
        "norm_topk_prob": False,  # llama.cpp's Qwen2-MoE graph: the softmax weights as they are
    }


def _qwen3moe(info: GGUFInfo, path: Path) -> Config:
    common = _common(info, path)
    return {
        **common,
        **_experts(info, path),
        "head_dim": _head_size(info, path, common),
        "attention_bias": False,
        "norm_topk_prob": True,  # llama.cpp's Qwen3-MoE graph renormalises the top k weights
    }


def _layers(tensors: dict[str, Array], suffix: str) -> list[str]:
    return sorted(name for name in tensors if name.startswith("blk.") and name.endswith(suffix))


def _unnorm(tensors: dict[str, Array], config: Config) -> None:
    """Gemma: the converter wrote every norm as 1 + w."""
    for name in [n for n in tensors if n.endswith("norm.weight")]:
        tensors[name] = tensors[name] - np.float32(1)


def _unpermute_rows(weight: Array, heads: int) -> Array:
    """Llama's converter interleaved each head's two rotary halves; back to halves."""
    halves = weight.reshape(heads, weight.shape[0] // heads // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(halves.swapaxes(1, 2).reshape(weight.shape), dtype=np.float32)


def _unpermute(tensors: dict[str, Array], config: Config) -> None:
    for kind, heads in (("attn_q", config["num_attention_heads"]), ("attn_k", config["num_key_value_heads"])):
        for name in _layers(tensors, f".{kind}.weight"):
            tensors[name] = _unpermute_rows(tensors[name], heads)


def _split_qkv(tensors: dict[str, Array], config: Config) -> None:
    """Phi-2 files converted from the original layout: q, k, v rows in one tensor."""
    head = config["hidden_size"] // config["num_attention_heads"]
    sizes = [config["num_attention_heads"] * head, config["num_key_value_heads"] * head]
    for name in _layers(tensors, ".attn_qkv.weight") + _layers(tensors, ".attn_qkv.bias"):
        fused = tensors.pop(name)
        parts = np.split(fused, [sizes[0], sizes[0] + sizes[1]])
        for kind, part in zip(("attn_q", "attn_k", "attn_v"), parts):
            tensors[name.replace("attn_qkv", kind)] = part


def _transpose_conv1d(tensors: dict[str, Array], config: Config) -> None:
    """GPT-2: the converter transposed Conv1D's [in, out] weights."""
    for kind in ("attn_qkv", "attn_output", "ffn_up", "ffn_down"):
        for name in _layers(tensors, f".{kind}.weight"):
            tensors[name] = np.ascontiguousarray(tensors[name].T)


def _regroup_qkv(tensors: dict[str, Array], config: Config) -> None:
    """GPT-NeoX, BLOOM: the converter moved q, k, v of every head into three runs; back per head."""
    heads = config["num_attention_heads"]
    for name in _layers(tensors, ".attn_qkv.weight") + _layers(tensors, ".attn_qkv.bias"):
        fused = tensors[name]
        rest = fused.shape[1:]
        tensors[name] = fused.reshape(3, heads, -1, *rest).swapaxes(0, 1).reshape(fused.shape)


FAMILIES: dict[str, ImportedFamily] = {
    "gemma": ImportedFamily(model_type="gemma", config=_gemma, tensors=_unnorm),
    "phi2": ImportedFamily(model_type="phi", config=_phi2, tensors=_split_qkv),
    "gpt2": ImportedFamily(model_type="gpt2", config=_gpt2, tensors=_transpose_conv1d),
    "starcoder2": ImportedFamily(model_type="starcoder2", config=_starcoder2),
    "olmo2": ImportedFamily(model_type="olmo2", config=_olmo2),
    "granite": ImportedFamily(model_type="granite", config=_granite, tensors=_unpermute),
    "gptneox": ImportedFamily(model_type="gpt_neox", config=_gptneox, tensors=_regroup_qkv),
    "falcon": ImportedFamily(model_type="falcon", config=_falcon),
    "bloom": ImportedFamily(model_type="bloom", config=_bloom, tensors=_regroup_qkv, prefix="transformer."),
    "mpt": ImportedFamily(model_type="mpt", config=_mpt),
    "qwen2moe": ImportedFamily(model_type="qwen2_moe", config=_qwen2moe),
    "qwen3moe": ImportedFamily(model_type="qwen3_moe", config=_qwen3moe),
}
IMPORTED_FAMILIES = tuple(FAMILIES)


def imported_config(info: GGUFInfo, path: Path) -> tuple[str, Config]:
    """(model_type, config values) of an imported family's file, read and bounded."""
    family = FAMILIES[info.architecture]
    return family.model_type, family.config(info, Path(path))


def _read_tensors(path: Path) -> dict[str, Array]:
    """Every tensor of the file, dequantized to float32 in numpy order ([out, in] for a matrix)."""
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(str(path))
    return {t.name: np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32) for t in reader.tensors}


def _gguf_names(model: Any, arch: str) -> dict[str, tuple[str, int | None]]:
    """Hugging Face parameter -> (GGUF tensor, expert index or None), by gguf-py's name map
    (of the name as the converter gave it to the map: BLOOM's without `transformer.`)."""
    import gguf

    prefix = FAMILIES[arch].prefix
    arch_id = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    name_map = gguf.get_tensor_name_map(arch_id, model.config.num_hidden_layers)
    out: dict[str, tuple[str, int | None]] = {}
    for hf_name in model.state_dict():
        base, suffix = hf_name.rsplit(".", 1)
        expert = re.search(r"\.experts\.(\d+)\.", base)
        generic = re.sub(r"\.experts\.\d+\.", ".experts.", base.removeprefix(prefix))
        gguf_name = name_map.get_name(generic)
        if gguf_name is not None:
            out[hf_name] = (f"{gguf_name}.{suffix}", int(expert.group(1)) if expert else None)
    return out


def _fill(model: Any, tensors: dict[str, Array], path: Path, arch: str) -> None:
    """Copy every tensor into its parameter; refuse a parameter without one or a tensor unused."""
    import torch

    state = model.state_dict()
    names = _gguf_names(model, arch)
    if model.config.tie_word_embeddings:  # the head is the embedding: no tensor of its own
        names = {k: v for k, v in names.items() if v[0] != "output.weight"}
        state = {k: v for k, v in state.items() if k != "lm_head.weight" and k != "embed_out.weight"}
    used: set[str] = set()
    missing = [k for k in state if k not in names or names[k][0] not in tensors]
    if missing:
        raise CorruptSourceError(f"{path} has no tensor for {len(missing)} parameters, e.g. {missing[0]}")
    loaded: dict[str, Any] = {}
    for hf_name, (gguf_name, expert) in names.items():
        value = tensors[gguf_name] if expert is None else tensors[gguf_name][expert]
        want = tuple(state[hf_name].shape)
        if value.size != math.prod(want):
            raise CorruptSourceError(f"GGUF {path}: {gguf_name} is {list(value.shape)}, {hf_name} needs {list(want)}")
        loaded[hf_name] = torch.from_numpy(np.array(value, dtype=np.float32).reshape(want))
        used.add(gguf_name)
    unused = sorted(set(tensors) - used - set(IGNORED))
    if unused:
        raise UnsupportedModelError(
            f"GGUF {path}: tensor {unused[0]} has no place in a {arch} model ({len(unused)} unused)"
        )
    model.load_state_dict(loaded, strict=False)


def load_imported_model(path: Path) -> Any:
    """The float32 PyTorch model of an imported family's GGUF file (see the module's table)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    info = read_gguf_info(path)
    family = FAMILIES[info.architecture]
    model_type, values = imported_config(info, path)
    config = AutoConfig.for_model(model_type, **values)
    model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]  # transformers is untyped
        config, dtype=torch.float32, attn_implementation="eager"
    )
    tensors = _read_tensors(path)
    if family.tensors is not None:
        family.tensors(tensors, values)
    _fill(model, tensors, path, info.architecture)
    if values["tie_word_embeddings"]:
        model.tie_weights()
    return model.eval()


def load_imported_tokenizer(path: Path) -> Any:
    """The file's vocabulary as a fast tokenizer: a byte-level BPE one (`gpt2`) as GPT-2's
    converter builds it, a SentencePiece one (`llama`: Gemma's) as SentencePiece segments it."""
    from transformers import PreTrainedTokenizerFast
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from .gguf_families import register_gguf_families, vocabulary_converter

    register_gguf_families()
    parsed = load_gguf_checkpoint(str(path), return_tensors=False)  # type: ignore[no-untyped-call]  # transformers is untyped
    converter = vocabulary_converter(parsed["tokenizer"])
    settings = {k: v for k, v in parsed["tokenizer_config"].items() if k == "chat_template"}
    fast = converter.converted()
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers is untyped
        tokenizer_object=fast, **settings, **converter.additional_kwargs
    )
