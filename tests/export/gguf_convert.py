"""Tiny random checkpoints written as GGUF files the way llama.cpp's converter writes them
(convert_hf_to_gguf.py: its keys, gguf-py's tensor names and its rearrangements), for the
families `export.gguf_import` reads: the test of each exports the file and compares with the
PyTorch model of the same weights.

    path = write_llama_cpp_gguf(tmp_path / "granite.gguf", "granite", quantized=True)
    # the checkpoint it came from (weights on the file's grids when quantized): tmp_path / "granite-hf"

What the converter does per family (and what is mimicked here):

- every family: the tensors named by gguf-py's name map for the architecture; a tied LM head
  not written (GPT-2: the embedding written again as `output`)
- gemma: norms written as 1 + w; key / value length = head_dim
- phi2, gpt2, falcon: feed_forward_length = 4 x hidden (the converter's constant: the models
  here have that width); phi2 `rope.dimension_count` = partial rotary x hidden // heads
- gpt2: Conv1D weights transposed to [out, in]
- granite: q/k rows permuted per head (Llama's converter), the multipliers as `*_scale` keys
- gptneox: fused q/k/v regrouped from per head to all q, all k, all v
- falcon: context 2048, one KV head for a multi-query model, q/k/v kept (its transform is the
  identity for one KV head)
- qwen2moe / qwen3moe: experts stacked as `ffn_*_exps` [E, out, in], expert counts and widths
- bloom: names mapped without `transformer.`; fused q/k/v regrouped as GPT-NeoX's; context
  `seq_length` or the width, feed_forward_length 4 x hidden, head_count_kv = head_count
- mpt: names as gguf-py maps them, tensors as they are (q, k, v rows of `Wqkv`); context
  `max_seq_len`, feed_forward_length 4 x hidden, no head_count_kv (MPT configs name none),
  layer_norm_epsilon 1e-5, `attention.clamp_kqv` where `clip_qkv` is set, `attention.max_alibi_bias`

``quantized``: the layers' matrices as Q4_0, the embedding / LM head as Q8_0; the checkpoint
is rounded onto those grids first (the rounding moves with whole rows, so it is the same on
either side of the converter's rearrangements), so the file holds exactly its weights.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

ARCHES = {
    "gemma": "gemma",
    "phi": "phi2",
    "gpt2": "gpt2",
    "starcoder2": "starcoder2",
    "olmo2": "olmo2",
    "granite": "granite",
    "gpt_neox": "gptneox",
    "falcon": "falcon",
    "bloom": "bloom",
    "mpt": "mpt",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
}
HIDDEN = 64
# the options that make each tiny model one llama.cpp's converter writes faithfully
OPTIONS: dict[str, dict[str, Any]] = {
    "gemma": {},
    "phi": {"intermediate": 4 * HIDDEN, "kv_heads": 4, "partial_rotary_factor": 0.5},
    "gpt2": {"intermediate": 4 * HIDDEN, "kv_heads": 4},
    "starcoder2": {"window": None},
    "olmo2": {},
    "granite": {
        "embedding_multiplier": 2.0,
        "attention_multiplier": 0.2,
        "residual_multiplier": 0.5,
        "logits_scaling": 1.5,
    },
    "gpt_neox": {"kv_heads": 4, "rotary_pct": 0.5},
    "falcon": {"intermediate": 4 * HIDDEN},
    "bloom": {"intermediate": 4 * HIDDEN, "kv_heads": 4},
    # six heads (head 16): llama.cpp's ALiBi slopes for a head count not a power of two
    "mpt": {"hidden": 96, "heads": 6, "kv_heads": 6, "intermediate": 384, "attn_config": {"clip_qkv": 0.3}},
    "qwen2_moe": {"shared_expert_intermediate_size": 64, "moe_intermediate_size": 64},
    "qwen3_moe": {"moe_intermediate_size": 64, "norm_topk_prob": True, "head_dim": 32},  # head apart from 64 / 4
}
_Q4 = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_Q4_RE = re.compile(rf"blk\.\d+\.({'|'.join(_Q4)})(_exps|_shexp)?\.weight")
_CONV1D = re.compile(r"blk\.\d+\.(attn_qkv|attn_output|ffn_up|ffn_down)\.weight")


def write_llama_cpp_gguf(
    path: Path, family: str, *, quantized: bool = False, seed: int = 0, fused_qkv: bool = False
) -> Path:
    """Build a tiny `family` checkpoint beside ``path`` (`<stem>-hf`) and write it as llama.cpp's
    converter would; see the module's docstring. ``fused_qkv`` (Phi-2): one `attn_qkv`, as files
    converted from Phi-2's original layout (`mixer.Wqkv`) have."""
    import gguf
    import torch
    from tiny_models import build_tiny_checkpoint
    from transformers import AutoModelForCausalLM

    path = Path(path)
    ckpt = build_tiny_checkpoint(path.with_name(path.stem + "-hf"), family, seed=seed, **OPTIONS[family])
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    names = _names(model, ARCHES[family])
    if quantized:
        with torch.no_grad():
            _round_onto_grids(model, names, family)
        model.save_pretrained(ckpt)
    writer = gguf.GGUFWriter(str(path), ARCHES[family])
    writer.add_name(f"tiny-{family}")
    _metadata(writer, family, model.config)
    _vocabulary(writer, ckpt, family, model.config.vocab_size)
    tensors = _converted(model, names, family)
    if fused_qkv:
        tensors = _fuse_qkv(tensors)
    for name, weight in tensors.items():
        _add(writer, name, weight, quantized)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _names(model: Any, arch: str) -> dict[str, tuple[str, int | None]]:
    """HF parameter -> (GGUF tensor, expert index): gguf-py's map, as the converter names them."""
    import gguf

    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(arch_id, model.config.num_hidden_layers)
    out = {}
    for hf_name in model.state_dict():
        base, suffix = hf_name.rsplit(".", 1)
        if arch == "bloom":  # BloomModel.modify_tensors: re.sub(r"transformer\.", "", name)
            base = base.removeprefix("transformer.")
        expert = re.search(r"\.experts\.(\d+)\.", base)
        mapped = name_map.get_name(re.sub(r"\.experts\.\d+\.", ".experts.", base))
        if mapped is None:
            if hf_name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            raise ValueError(f"gguf-py has no {arch} name for {hf_name}")
        out[hf_name] = (f"{mapped}.{suffix}", int(expert.group(1)) if expert else None)
    if model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)  # a tied head is not in the checkpoint's files
    return out


def _kind(name: str) -> Any:
    import gguf

    if name in ("token_embd.weight", "output.weight"):
        return gguf.GGMLQuantizationType.Q8_0
    if _Q4_RE.fullmatch(name):
        return gguf.GGMLQuantizationType.Q4_0
    return None


def _round_onto_grids(model: Any, names: dict[str, tuple[str, int | None]], family: str) -> None:
    """Each weight the file quantizes, rounded onto its grid along its input dimension."""
    import gguf
    import torch

    params = dict(model.named_parameters())
    for hf_name, (name, _) in names.items():
        kind = _kind(name)
        if kind is None or hf_name not in params:
            continue
        param = params[hf_name]
        weight = param.detach().numpy()
        conv1d = family == "gpt2" and _CONV1D.fullmatch(name)
        rows = weight.T if conv1d else weight
        rounded = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(rows), kind), kind)
        param.copy_(torch.from_numpy(np.ascontiguousarray(rounded.T if conv1d else rounded)))


def _metadata(writer: Any, family: str, cfg: Any) -> None:
    """The converter's set_gguf_parameters for each family."""
    heads, hidden = cfg.num_attention_heads, cfg.hidden_size
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_embedding_length(hidden)
    writer.add_head_count(heads)
    if family in ("phi", "gpt2", "falcon", "bloom", "mpt"):
        writer.add_feed_forward_length(4 * hidden)
    else:
        writer.add_feed_forward_length(cfg.intermediate_size)
    if family == "gpt2":
        writer.add_context_length(cfg.n_positions)
        writer.add_layer_norm_eps(cfg.layer_norm_epsilon)
        return
    if family == "falcon":
        if not cfg.multi_query or cfg.new_decoder_architecture:
            raise ValueError("the converter writes one KV head for Falcon 7B's layout only")
        writer.add_context_length(2048)
        writer.add_tensor_data_layout("jploski")
        writer.add_head_count_kv(1)
        writer.add_layer_norm_eps(cfg.layer_norm_epsilon)
        return
    if family == "bloom":
        writer.add_context_length(getattr(cfg, "seq_length", hidden))  # config.json's seq_length, else the width
        writer.add_head_count_kv(heads)
        writer.add_layer_norm_eps(cfg.layer_norm_epsilon)
        return
    if family == "mpt":
        _mpt(writer, cfg)
        return
    writer.add_context_length(cfg.max_position_embeddings)
    if family == "gpt_neox":
        writer.add_rope_dimension_count(int(cfg.rotary_pct * (hidden // heads)))
        writer.add_parallel_residual(cfg.use_parallel_residual)
        writer.add_layer_norm_eps(cfg.layer_norm_eps)
        return
    writer.add_head_count_kv(cfg.num_key_value_heads)
    if family == "phi":
        writer.add_layer_norm_eps(cfg.layer_norm_eps)
        writer.add_rope_dimension_count(int(cfg.partial_rotary_factor * hidden) // heads)
        writer.add_add_bos_token(False)
        return
    _text_model(writer, family, cfg)


def _mpt(writer: Any, cfg: Any) -> None:
    """MPTModel.set_gguf_parameters: the norm epsilon a constant, the clamp only when set."""
    writer.add_context_length(cfg.max_seq_len)
    writer.add_layer_norm_eps(1e-5)
    if cfg.attn_config.clip_qkv is not None:
        writer.add_clamp_kqv(cfg.attn_config.clip_qkv)
    writer.add_max_alibi_bias(cfg.attn_config.alibi_bias_max if cfg.attn_config.alibi else 0.0)


def _text_model(writer: Any, family: str, cfg: Any) -> None:
    """TextModel's parameters (Gemma's, Llama's for Granite) and the families' own keys."""
    writer.add_rope_freq_base(cfg.rope_theta)
    if family == "starcoder2":
        writer.add_layer_norm_eps(cfg.norm_epsilon)
    else:
        writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if getattr(cfg, "head_dim", None) and family != "granite":  # Granite's converter drops head_dim
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    if family == "granite":
        writer.add_attention_scale(cfg.attention_multiplier)
        writer.add_embedding_scale(cfg.embedding_multiplier)
        writer.add_residual_scale(cfg.residual_multiplier)
        writer.add_logit_scale(cfg.logits_scaling)
    if family in ("qwen2_moe", "qwen3_moe"):
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if family == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def _vocabulary(writer: Any, ckpt: Path, family: str, size: int) -> None:
    """Gemma: a SentencePiece vocabulary (as the real files); the rest: the checkpoint's BPE."""
    import json

    from tiny_models import sentencepiece_vocab
    from transformers import AutoTokenizer

    if family == "gemma":
        tokens, scores, types = sentencepiece_vocab(size)
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_add_bos_token(True)
        return
    spec = json.loads((ckpt / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    listed = {i: t for t, i in vocab.items()}
    specials = {t["content"] for t in spec["added_tokens"]}
    names = [listed.get(i, f"<unused{i}>") for i in range(size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(names)
    writer.add_token_types([3 if t in specials else 1 for t in names])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_pad_token_id(vocab["<|endoftext|>"])
    writer.add_chat_template(AutoTokenizer.from_pretrained(ckpt).chat_template)


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Llama's converter: each head's rotary halves interleaved."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def _one(name: str, weight: np.ndarray, family: str, cfg: Any) -> np.ndarray:
    """The converter's modify_tensors for one tensor."""
    if family == "gemma" and name.endswith("norm.weight"):
        return weight + 1
    if family == "gpt2" and _CONV1D.fullmatch(name):
        return weight.T
    if family == "granite" and re.fullmatch(r"blk\.\d+\.attn_[qk]\.weight", name):
        heads = cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads
        return _permute(weight, heads)
    if family in ("gpt_neox", "bloom") and ".attn_qkv." in name:
        heads = cfg.num_attention_heads
        grouped = weight.reshape(heads, 3, -1, *weight.shape[1:])
        return np.concatenate([grouped[:, i].reshape(-1, *weight.shape[1:]) for i in range(3)])
    if family == "falcon" and ".attn_qkv." in name:
        heads, head = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
        qkv = weight.reshape(1, heads + 2, head, -1)  # one KV group
        q, k, v = qkv[:, :-2], qkv[:, [-2]], qkv[:, [-1]]
        return np.concatenate([part.reshape(-1, weight.shape[1]) for part in (q, k, v)])
    return weight


def _converted(model: Any, names: dict[str, tuple[str, int | None]], family: str) -> dict[str, np.ndarray]:
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, (name, expert) in names.items():
        weight = _one(name, state[hf_name], family, model.config)
        if expert is None:
            out[name] = weight
        else:
            experts.setdefault(name, {})[expert] = weight
    for name, parts in experts.items():  # the converter stacks each layer's experts
        out[name] = np.stack([parts[i] for i in range(len(parts))])
    if family == "gpt2":  # GPT-2's converter writes the (tied) embedding again as the LM head
        out["output.weight"] = out["token_embd.weight"]
    return out


def _fuse_qkv(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, weight in tensors.items():
        if ".attn_q." in name:
            parts = [tensors[name.replace("attn_q", kind)] for kind in ("attn_q", "attn_k", "attn_v")]
            out[name.replace("attn_q", "attn_qkv")] = np.concatenate(parts)
        elif ".attn_k." not in name and ".attn_v." not in name:
            out[name] = weight
    return out


def _add(writer: Any, name: str, weight: np.ndarray, quantized: bool) -> None:
    import gguf

    weight = np.ascontiguousarray(weight, dtype=np.float32)
    kind = _kind(name) if quantized else None
    if kind is None:
        writer.add_tensor(name, weight)
        return
    blocks = gguf.quants.quantize(weight, kind)
    if not np.array_equal(gguf.quants.dequantize(blocks, kind), weight):
        raise ValueError(f"{name} is not on the {kind.name} grid: the checkpoint would differ from the file")
    writer.add_tensor(name, blocks, raw_dtype=kind)
