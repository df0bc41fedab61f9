"""How a checkpoint's tensors map onto the graph (`export.graph`): heads zero-padded to a size
ONNX Runtime takes, and the tensors the graph has a place for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .errors import UnsupportedModelError

if TYPE_CHECKING:
    from .model_spec import ModelSpec

__all__ = [
    "HEAD_MULTIPLE",
    "LAYOUT_NORMS",
    "pad_heads",
    "check_weights",
    "rename",
    "split_fused",
    "graph_head_dim",
    "head_fields",
    "rotary_width",
    "gqa_inputs",
]

# ONNX Runtime's CPU GroupQueryAttention with rotary takes head sizes that are multiples of 16 only; a model
# whose heads are smaller or odd-sized (tiny test models: hidden 16 over 4 heads) gets zero-padded
# heads (see pad_heads), which change no result: the padded dimensions are 0 in q, k and v
HEAD_MULTIPLE = 16


def rotary_width(own: int, rotary: int) -> int:
    """The rotated dimensions of a graph head: the model's ``rotary`` (all ``own`` or a first part,
    Phi-4-mini's 0.75) padded to a multiple of HEAD_MULTIPLE (GroupQueryAttention takes rotary
    tables of a multiple of 8 columns only)."""
    return -(-rotary // HEAD_MULTIPLE) * HEAD_MULTIPLE


def graph_head_dim(own: int, rotary: int) -> int:
    """The graph's head size for a model head of ``own`` dimensions whose first ``rotary`` turn:
    the padded rotated part, the model's unrotated rest, padded to a multiple of HEAD_MULTIPLE."""
    return -(-(rotary_width(own, rotary) + own - rotary) // HEAD_MULTIPLE) * HEAD_MULTIPLE


def head_fields(
    *, heads: int, kv_heads: int, own: int, rotary: int, padded: int, fused: str = "", position_offset: int = -1
) -> dict[str, Any]:
    """``ModelSpec``'s head fields: ``heads`` query heads over ``kv_heads`` KV heads, each of
    ``own`` model dimensions whose first ``rotary`` turn, in graph heads of ``padded``;
    ``model_head_dim`` and ``rotary_dim`` are 0 where they equal the graph's head size and the
    model's. ``fused``: how a fused q/k/v holds them; ``position_offset``: the learned
    positions' row offset (-1: no learned positions)."""
    return {
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": padded,
        "model_head_dim": own if own != padded else 0,
        "rotary_dim": rotary if rotary != own else 0,
        "fused_qkv": fused,
        "position_offset": position_offset,
    }


def pad_heads(
    w: npt.NDArray[Any], heads: int, own: int, padded: int, *, rotary: int | None = None, interleaved: bool = False
) -> npt.NDArray[Any]:
    """The columns ``[K, heads * own]`` of a q, k or v projection (or a bias, ``[heads * own]``)
    as ``[K, heads * padded]``: each half of each head's rotated part (its first ``rotary``
    dimensions; all of them by default) zero-padded at its end, so that GroupQueryAttention's
    rotary (which pairs dimension i with i + width / 2) still pairs the model's i with
    i + rotary / 2, then the unrotated rest, then zeros; every padded dimension holds 0 (it adds 0
    to q . k, and its 0 in v meets a zero column of o_proj's weight padded the same way).
    ``interleaved`` (GPT-J: pairs 2i, 2i + 1 turn together): the rotated part as it is, zeros to
    the padded rotary width, then the rest."""
    rotary = own if rotary is None else rotary
    if padded == own:
        return w
    lead = w.shape[:-1]
    h = w.reshape(*lead, heads, own)
    out = np.zeros((*lead, heads, padded), dtype=w.dtype)
    half, width = rotary // 2, rotary_width(own, rotary) // 2
    if interleaved:
        out[..., :rotary] = h[..., :rotary]
        out[..., 2 * width : 2 * width + own - rotary] = h[..., rotary:]
        return out.reshape(*lead, heads * padded)
    out[..., :half] = h[..., :half]
    out[..., width : width + half] = h[..., half:rotary]
    out[..., 2 * width : 2 * width + own - rotary] = h[..., rotary:]
    return out.reshape(*lead, heads * padded)


def rename(sd: dict[str, Any], spec: ModelSpec) -> dict[str, Any]:
    """The state dict under Llama's tensor names (``spec.renames``: the family's substring
    replacements, in order; Phi-2's ``dense`` / ``fc1`` / ``fc2``, GPT-NeoX's ``gpt_neox.*``),
    the layers' matrices as nn.Linear's ``[out, in]`` (``spec.conv1d``: GPT-2 stores ``[in, out]``)."""
    if not spec.renames and not spec.conv1d:
        return sd
    out = {}
    for key, value in sd.items():
        for old, new in spec.renames:
            key = key.replace(old, new)
        if spec.conv1d and key.startswith("model.layers.") and key.endswith("_proj.weight") and value.dim() == 2:
            value = value.T
        out[key] = value
    return out


def split_fused(sd: dict[str, Any], spec: ModelSpec) -> dict[str, Any]:
    """The state dict with fused projections as the tensors the graph takes: each layer's
    ``qkv_proj`` as ``q_proj`` / ``k_proj`` / ``v_proj`` (``spec.fused_qkv``: Phi-3's rows q,
    then k, then v; GPT-NeoX's q, k, v of each head in turn, as its ``view(..., heads, 3 * d)``
    reads them; Falcon's ``new_decoder_architecture``: each KV head's group of q heads, then its
    k and v) and ``gate_up_proj`` (rows: gate, then up, as transformers' ``chunk(2)`` reads
    them) as ``gate_proj`` / ``up_proj``. Row slices (GPT-NeoX: a reshape and a copy)."""
    if not any(k.endswith(("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")) for k in sd):
        return sd
    out = dict(sd)
    own = spec.own_head_dim
    q, kv = spec.num_heads * own, spec.num_kv_heads * own
    for key in [k for k in out if k.endswith(("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias"))]:
        fused, (stem, kind) = out.pop(key), key.rsplit("qkv_proj.", 1)
        if fused.shape[0] != q + 2 * kv:
            raise UnsupportedModelError(
                f"unsupported {key} of {fused.shape[0]} rows: need {q + 2 * kv} "
                f"(q, k and v of {spec.num_heads} and 2 x {spec.num_kv_heads} heads)"
            )
        if spec.fused_qkv == "heads":  # [kv, group + 2, own, ...]: each KV head's q heads, then k, v
            group = spec.num_heads // spec.num_kv_heads
            parts = fused.reshape(spec.num_kv_heads, group + 2, own, *fused.shape[1:])
            out[f"{stem}q_proj.{kind}"] = parts[:, :group].reshape(q, *fused.shape[1:])
            out[f"{stem}k_proj.{kind}"] = parts[:, group].reshape(kv, *fused.shape[1:])
            out[f"{stem}v_proj.{kind}"] = parts[:, group + 1].reshape(kv, *fused.shape[1:])
            continue
        for name, lo, hi in (("q", 0, q), ("k", q, q + kv), ("v", q + kv, q + 2 * kv)):
            out[f"{stem}{name}_proj.{kind}"] = fused[lo:hi]
    for key in [k for k in out if k.endswith("mlp.gate_up_proj.weight")]:
        fused, stem, size = out.pop(key), key[: -len("gate_up_proj.weight")], spec.intermediate_size
        if fused.shape[0] != 2 * size:
            raise UnsupportedModelError(f"unsupported {key} of {fused.shape[0]} rows: need 2 x {size}")
        out[stem + "gate_proj.weight"], out[stem + "up_proj.weight"] = fused[:size], fused[size:]
    return out


# multi-head latent attention's tensors in a layer (export.mla); biases with attention_bias
LATENT_WEIGHTS = [
    *(f"self_attn.{n}.weight" for n in ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa")),
    *(f"self_attn.{n}.weight" for n in ("kv_a_layernorm", "kv_b_proj")),
    *(f"self_attn.{n}.bias" for n in ("q_a_proj", "kv_a_proj_with_mqa")),
]
# each layout's norms in a layer (export.families.LAYOUTS)
LAYOUT_NORMS = {
    "pre": ("input_layernorm", "post_attention_layernorm"),
    "sandwich": (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ),
    "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
    "parallel": ("input_layernorm",),
    "parallel2": ("input_layernorm", "post_attention_layernorm"),
    "post_ln": ("input_layernorm", "post_attention_layernorm"),
    "pre_normed": ("input_layernorm", "post_attention_layernorm"),
}


def check_weights(sd: dict[str, Any], spec: ModelSpec) -> None:
    """Refuse a state dict with tensors the graph would not use (e.g. an MLP bias the family
    does not have, a layer's extra norm): the export would be silently wrong, and validation
    would find out only after the whole graph was written."""
    norm_kinds: tuple[str, ...] = ("weight", "bias") if spec.norm == "layer" else ("weight",)
    if not spec.norm_weights:
        norm_kinds = ()
    parts = [f"{n}.{t}" for n in LAYOUT_NORMS[spec.layout] for t in norm_kinds]
    parts += [f"self_attn.{n}_proj.{t}" for n in "qkvo" for t in ("weight", "bias")]
    mlp = ("gate", "up", "down") if spec.gated else ("up", "down")
    parts += [f"mlp.{n}_proj.{t}" for n in mlp for t in (("weight", "bias") if spec.mlp_bias else ("weight",))]
    if spec.qk_norm or spec.qk_norm_full:
        parts += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    if spec.qk_layer_norm:  # LayerNorms of each head: Phi-2's have a bias
        parts += ["self_attn.q_norm.bias", "self_attn.k_norm.bias"]
    moe = [f"mlp.{n}.weight" for n in ("gate", "experts.gate_up_proj", "experts.down_proj")]
    expert_kinds = ("weight", "bias") if spec.mlp_bias else ("weight",)  # ERNIE 4.5's experts: use_bias
    moe += [
        f"mlp.experts.{j}.{n}_proj.{t}"
        for j in range(spec.num_experts)
        for n in ("gate", "up", "down")
        for t in expert_kinds
    ]
    if spec.router == "softmax_biased":  # ERNIE 4.5: the correction bias of the experts' choice
        moe.append("mlp.moe_statics.e_score_correction_bias")
    if spec.swiglu:  # GPT-OSS: stacked experts with biases, a router bias, attention sinks
        moe += [f"mlp.experts.fc{n}.{t}" for n in (1, 2) for t in ("weight", "bias")] + ["mlp.gate.bias"]
        parts.append("self_attn.sinks")
    if spec.shared_expert_size:
        moe += [f"mlp.shared_expert.{n}_proj.{t}" for n in ("gate", "up", "down") for t in expert_kinds]
        if spec.shared_gate:
            moe.append("mlp.shared_expert_gate.weight")
    if spec.grouped is not None:  # DeepSeek's router: its selection bias
        moe.append("mlp.gate.e_score_correction_bias")
    if spec.latent is not None:
        parts += LATENT_WEIGHTS
    known = {f"model.layers.{i}.{part}" for i in range(spec.num_layers) for part in parts}
    known |= {f"model.layers.{i}.{part}" for i in spec.moe_layers for part in moe}
    known |= {"model.embed_tokens.weight", "lm_head.weight", "lm_head.bias"}
    if spec.learned_positions:
        known.add("model.embed_positions.weight")
    if spec.layout != "post_ln":  # post_ln: each layer ends normed, no final norm
        known |= {f"model.norm.{t}" for t in norm_kinds}
    if spec.embed_dim:  # embeddings projected in and out (OPT-350M)
        known |= {"model.project_in.weight", "model.project_out.weight"}
    if spec.embed_norm:  # a LayerNorm of the embeddings (BLOOM)
        known |= {"model.embed_norm.weight", "model.embed_norm.bias"}
    extra = sorted(k for k in sd if k not in known and not k.endswith("rotary_emb.inv_freq"))
    if extra:
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        raise UnsupportedModelError(
            f"unsupported weights {', '.join(extra[:3])}{more}: the graph has no place for them"
        )


def gqa_inputs(qkv: str, layer: int, *, packed: bool = True, rotary: bool = True, local: bool = False) -> list[str]:
    """GroupQueryAttention's inputs: QKV, the layer's KV, the sequence lengths, the rotary
    tables (none for a layer without rotary, ``rotary=False``; a sliding layer's own, ``local``:
    Gemma 3), and for ``packed`` graphs: (10th, 11th) ``position_rows`` ``[B, S]`` and
    ``attention_bias`` ``[1, 1, S, total]`` (a tree mask: each new position sees what the bias
    leaves at 0, besides causal order), and (17th) ``query_seqlens`` ``[B]``, the new positions
    of each row. With it ONNX Runtime's CPU kernel takes several rows of several new positions
    *with* a past in one call (rows right-padded; padding is neither attended to nor written to
    the cache; a row with 0 new positions is left untouched), which a batched verify needs;
    without it, only batch 1."""
    tables = ["", ""] if not rotary else ["cos_cache_local", "sin_cache_local"] if local else ["cos_cache", "sin_cache"]
    return [
        qkv,
        "",
        "",
        f"past_key_values.{layer}.key",
        f"past_key_values.{layer}.value",
        "seqlens_k",
        "total_sequence_length",
        *tables,
        *(["position_rows", "attention_bias"] + [""] * 5 + ["query_seqlens"] if packed else []),
    ]
