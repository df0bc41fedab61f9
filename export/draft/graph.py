"""The EAGLE head as an ONNX graph, assembled from the trained weights plus the target's own
(embedding, LM-head rows, rotary tables) read straight from the target's exported folder.

    e       = Cast(Gather(embed_fp16, input_ids))                    # [B, S, H]   e(x_{j+1})
    z       = MatMul(Concat(e, features), W_fc)                      # [B, S, H]   features: h_j
    a       = GroupQueryAttention(SimplifiedLayerNorm(z) W_qkv, past, ...)   # rotary inside
    x, u    = SkipSimplifiedLayerNorm(a W_o, z, ln2)                 # u = z + attn
    g       = SkipSimplifiedLayerNorm(MLP(x), u, norm)               # "hidden_states" [B, S, H]
    logits  = Gather(g, logits_index) W_lm'                          # [B, R, V'] reduced vocab

Same IO conventions as the target graphs (one shared KV buffer per layer, ``logits_index``),
plus the ``features`` input. Needs numpy and onnx only: no PyTorch at assembly time.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper

from ..graph import MS, _Graph, decoder_io, gqa_inputs, save_graph
from ..weights import ExternalDataWriter

__all__ = ["HEAD_KEYS", "build_head_onnx", "target_tensors"]

# trained tensors, torch nn.Linear layout [out, in] (RMSNorm weights [H])
HEAD_KEYS = ("fc", "ln1", "q", "k", "v", "o", "ln2", "gate", "up", "down", "norm")


def target_tensors(folder: Path, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Read initializers from a target's ``model.onnx`` (+ external data) without loading the rest."""
    folder = Path(folder)
    proto = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    out = {}
    for t in proto.graph.initializer:
        if t.name not in names:
            continue
        dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
        if t.data_location == TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            arr = np.fromfile(
                folder / info["location"],
                dtype=dtype,
                count=int(info["length"]) // np.dtype(dtype).itemsize,
                offset=int(info["offset"]),
            )
            out[t.name] = arr.reshape(tuple(t.dims))
        else:
            out[t.name] = onnx.numpy_helper.to_array(t)
    missing = [n for n in names if n not in out]
    if missing:
        raise KeyError(f"{folder / 'model.onnx'} has no initializer {missing[0]!r}")
    return out


def build_head_onnx(
    head: dict[str, np.ndarray],
    cfg: dict[str, Any],
    vocab: npt.NDArray[np.int64],
    *,
    embed: np.ndarray,
    lm_head: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    out_dir: Path,
) -> dict[str, Any]:
    """Write ``model.onnx`` + ``model.onnx.data``. ``head``: HEAD_KEYS -> float arrays;
    ``vocab`` [V'] full ids; ``embed`` [V, H]; ``lm_head`` [H, V] (the target graph's layout)."""
    hidden, kv, head_dim = cfg["hidden_size"], cfg["num_kv_heads"], cfg["head_dim"]
    weights = {k: np.asarray(v, np.float32) for k, v in head.items()}
    out_dir = Path(out_dir)
    with ExternalDataWriter(out_dir / "model.onnx.data") as data:
        graph = _Graph(data, None, cfg["rms_eps"])
        graph.init("cos_cache", cos)
        graph.init("sin_cache", sin)
        fused = _fc(graph, weights, embed)
        attn = _attention(graph, weights, fused, cfg)
        attn_out = graph.linear(attn, weights["o"].T, "/layer/attn/o_proj")
        mlp_in, residual = graph.rms_norm(attn_out, fused, weights["ln2"], "/layer/post_attention_layernorm")
        down = _mlp(graph, weights, mlp_in)
        graph.rms_norm(down, residual, weights["norm"], "/norm", out="hidden_states")
        picked = graph.node("Gather", ["hidden_states", "logits_index"], ["/lm_head/rows"], "/lm_head/Gather", axis=1)[
            0
        ]
        graph.linear(picked, np.ascontiguousarray(lm_head[:, vocab]), "/lm_head", out="logits")

    features = helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch_size", "sequence_length", hidden])
    inputs, outputs = decoder_io(
        1, kv, head_dim, int(vocab.size), hidden=hidden, extra_inputs=(features,), packed=False
    )
    return save_graph(
        graph, "eagle_head", inputs, outputs, path=out_dir / "model.onnx", producer="specdec-rt export train-draft"
    )


def _fc(graph: _Graph, weights: dict[str, np.ndarray], embed: np.ndarray) -> str:
    """z = Concat(e(input_ids), features) W_fc (returned as ``fused``), with the embedding stored as float16."""
    emb16 = graph.node(
        "Gather",
        [graph.init("embed_tokens.weight_fp16", embed.astype(np.float16)), "input_ids"],
        ["/embed/gathered"],
        "/embed/Gather",
    )[0]
    emb = graph.node("Cast", [emb16], ["/embed/output"], "/embed/Cast", to=TensorProto.FLOAT)[0]
    cat = graph.node("Concat", [emb, "features"], ["/fc/input"], "/fc/Concat", axis=-1)[0]
    return graph.linear(cat, weights["fc"].T, "/fc")  # [B, S, H]


def _attention(graph: _Graph, weights: dict[str, np.ndarray], fused: str, cfg: dict[str, Any]) -> str:
    """GroupQueryAttention over the normalised z (rotary inside, KV cache slot 0)."""
    normed, _ = graph.rms_norm(fused, None, weights["ln1"], "/layer/input_layernorm")
    w_qkv = np.concatenate([weights["q"].T, weights["k"].T, weights["v"].T], axis=1)
    qkv = graph.linear(normed, w_qkv, "/layer/attn/qkv")
    return graph.node(
        "GroupQueryAttention",
        gqa_inputs(qkv, 0, packed=False),
        ["/layer/attn/output", "present.0.key", "present.0.value"],
        "/layer/attn/GroupQueryAttention",
        domain=MS,
        num_heads=cfg["num_heads"],
        kv_num_heads=cfg["num_kv_heads"],
        scale=1.0 / math.sqrt(cfg["head_dim"]),
        do_rotary=1,
        rotary_interleaved=0,
        local_window_size=-1,
    )[0]


def _mlp(graph: _Graph, weights: dict[str, np.ndarray], mlp_in: str) -> str:
    """down(silu(gate(x)) * up(x)) for x = ``mlp_in``."""
    gate = graph.linear(mlp_in, weights["gate"].T, "/layer/mlp/gate_proj")
    up = graph.linear(mlp_in, weights["up"].T, "/layer/mlp/up_proj")
    sig = graph.node("Sigmoid", [gate], ["/layer/mlp/sigmoid"], "/layer/mlp/Sigmoid")[0]
    silu = graph.node("Mul", [gate, sig], ["/layer/mlp/silu"], "/layer/mlp/SiLU")[0]
    act = graph.node("Mul", [silu, up], ["/layer/mlp/act"], "/layer/mlp/Mul")[0]
    return graph.linear(act, weights["down"].T, "/layer/mlp/down_proj")
