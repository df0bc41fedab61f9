"""How a checkpoint's tensors map onto the graph (`export.graph`): heads zero-padded to a size
ONNX Runtime takes, and the tensors the graph has a place for."""

from __future__ import annotations

import numpy as np

from .errors import UnsupportedModelError

__all__ = ["HEAD_MULTIPLE", "pad_heads", "check_weights"]

# ONNX Runtime's CPU GroupQueryAttention with rotary takes head sizes that are multiples of 16 only; a model
# whose heads are smaller or odd-sized (tiny test models: hidden 16 over 4 heads) gets zero-padded
# heads (see pad_heads), which change no result: the padded dimensions are 0 in q, k and v
HEAD_MULTIPLE = 16


def pad_heads(w: np.ndarray, heads: int, own: int, padded: int) -> np.ndarray:
    """The columns ``[K, heads * own]`` of a q, k or v projection (or a bias, ``[heads * own]``)
    as ``[K, heads * padded]``: each half of each head zero-padded at its end, so that
    GroupQueryAttention's rotary (which pairs dimension i with i + padded / 2) still pairs the
    model's i with i + own / 2, and every padded dimension holds 0 (it adds 0 to q . k, and its
    0 in v meets a zero column of o_proj's weight padded the same way)."""
    if padded == own:
        return w
    lead = w.shape[:-1]
    h = w.reshape(*lead, heads, 2, own // 2)
    out = np.zeros((*lead, heads, 2, padded // 2), dtype=w.dtype)
    out[..., : own // 2] = h
    return out.reshape(*lead, heads * padded)


def check_weights(sd, spec) -> None:
    """Refuse a state dict with tensors the graph would not use (e.g. an MLP bias, a layer's
    extra norm): the export would be silently wrong, and validation would find out only after
    the whole graph was written."""
    parts = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    parts += [f"self_attn.{n}_proj.{t}" for n in "qkvo" for t in ("weight", "bias")]
    parts += [f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
    known = {f"model.layers.{i}.{part}" for i in range(spec.num_layers) for part in parts}
    known |= {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    extra = sorted(k for k in sd if k not in known and not k.endswith("rotary_emb.inv_freq"))
    if extra:
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        raise UnsupportedModelError(f"unsupported weights {', '.join(extra[:3])}{more}: the graph has no place for them")
