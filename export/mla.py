"""DeepSeek-V3's blocks (``deepseek_v3``, read from its transformers 4.57 modelling code): multi-head
latent attention and the grouped sigmoid router.

**Latent attention.** Queries come from ``q_proj``, or from ``q_b_proj(RMSNorm(q_a_proj(x)))``
when ``q_lora_rank`` is set; ``kv_a_proj_with_mqa(x)`` is a latent of ``kv_lora_rank`` and one
rotary key part ``k_pe`` of ``qk_rope_head_dim`` shared by every head; ``kv_b_proj(RMSNorm(latent))``
gives each head its unrotated key part (``qk_nope_head_dim``) and its value (``v_head_dim``).
Both of those RMSNorms have epsilon 1e-6 (the module's default, not ``rms_norm_eps``). The graph
decompresses the latent and caches whole keys and values, one KV head per query head, in heads of
``head_dim`` (a multiple of 16): the rotary part first (its halves zero-padded as
``layout.pad_heads`` pads them, so GroupQueryAttention's partial rotary turns it), then the
unrotated part, then zeros; a value is its ``v_head_dim`` dimensions then zeros (o_proj's padded
rows are zero). A dot product is invariant under one permutation of both sides, so moving the
rotary part first changes nothing. ``rope_interleave`` (the default) pairs dimensions 2i, 2i + 1:
transformers reorders them to (even, odd) before its halves rotary; the graph reorders the
projection's columns the same way. The softmax scale is ``qk_head_dim ** -0.5``, times
``yarn_get_mscale(factor, mscale_all_dim) ** 2`` when ``rope_scaling`` sets ``mscale_all_dim``.

**Grouped sigmoid router.** ``scores = sigmoid(x W)``; the choice adds ``e_score_correction_bias``
(selection only); the experts fall into ``n_group`` groups, each scored by the sum of its two best
choices; the ``topk_group`` best groups stay and the other experts' choices become 0; the top k of
those are the chosen experts, weighed by their scores (renormalised to sum 1 with
``norm_topk_prob``), times ``routed_scaling_factor``. ONNX Runtime's MoE takes router logits and
applies a softmax over the top k: the graph feeds it ``log(score)`` for the chosen experts and
-1e4 for the others, so the softmax gives ``score / sum(scores of the k)``, and multiplies the
op's output (linear in the weights) by ``routed_scaling_factor`` (times the sum of the k scores
without ``norm_topk_prob``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
from onnx import TensorProto, helper

from .errors import UnsupportedModelError
from .layout import HEAD_MULTIPLE, gqa_inputs, head_fields, pad_heads, rotary_width

if TYPE_CHECKING:
    from .graph import _Blocks, _Graph
    from .model_spec import ModelSpec

__all__ = ["LatentAttention", "GroupedRouting", "latent_heads", "latent_scale", "grouped_routing", "LATENT_EPS"]

Array = npt.NDArray[Any]
LATENT_EPS = 1e-6  # q_a_layernorm's and kv_a_layernorm's epsilon (DeepseekV3RMSNorm's default)
UNCHOSEN = -1e4  # the router logit of an expert left out: its softmax weight is exactly 0


@dataclass(frozen=True, kw_only=True)
class LatentAttention:
    """The sizes of multi-head latent attention's projections (``q_rank`` 0: a plain ``q_proj``)."""

    q_rank: int
    kv_rank: int
    nope: int  # each head's unrotated key part (qk_nope_head_dim)
    rope: int  # the rotary key part, shared by the heads (qk_rope_head_dim)
    value: int  # each head's value (v_head_dim)
    interleaved: bool  # rope_interleave: pairs 2i, 2i + 1 turn together

    @property
    def turned(self) -> int:
        """The graph's columns of the rotary part: ``rope`` padded to GroupQueryAttention's width."""
        return rotary_width(self.rope, self.rope)


@dataclass(frozen=True, kw_only=True)
class GroupedRouting:
    """DeepSeek's router: ``groups`` of experts, the ``top_groups`` best kept, the chosen
    experts' weights times ``scale`` (routed_scaling_factor)."""

    groups: int
    top_groups: int
    scale: float


def _int(config: Any, key: str, low: int = 1) -> int:
    value = getattr(config, key, None)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UnsupportedModelError(f"unsupported {key} {value!r}: need an integer >= {low}")
    return value


def latent_heads(config: Any) -> dict[str, Any]:
    """``ModelSpec``'s head fields for latent attention: as many KV heads as heads (whole keys
    and values are cached), the graph's head size holding the padded rotary part and the
    unrotated one, or the value, whichever is wider."""
    heads = _int(config, "num_attention_heads")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if kv_heads != heads:
        raise UnsupportedModelError(
            f"unsupported num_key_value_heads {kv_heads!r} with latent attention: need num_attention_heads ({heads})"
        )
    q_rank = 0 if getattr(config, "q_lora_rank", None) is None else _int(config, "q_lora_rank")
    rope = _int(config, "qk_rope_head_dim")
    if rope % 2:
        raise UnsupportedModelError(f"unsupported qk_rope_head_dim {rope}: rotary embeddings need an even one")
    latent = LatentAttention(
        q_rank=q_rank,
        kv_rank=_int(config, "kv_lora_rank"),
        nope=_int(config, "qk_nope_head_dim", low=0),
        rope=rope,
        value=_int(config, "v_head_dim"),
        interleaved=bool(getattr(config, "rope_interleave", False)),
    )
    width = max(latent.turned + latent.nope, latent.value)
    padded = -(-width // HEAD_MULTIPLE) * HEAD_MULTIPLE
    fields = head_fields(heads=heads, kv_heads=heads, own=latent.nope + rope, rotary=rope, padded=padded)
    return {**fields, "latent": latent}


def latent_scale(config: Any) -> float:
    """Attention's softmax scale: ``qk_head_dim ** -0.5``, times the square of YaRN's
    ``mscale_all_dim`` factor when ``rope_scaling`` sets it."""
    scale: float = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict) and scaling.get("mscale_all_dim"):
        factor = float(scaling["factor"])
        mscale = 0.1 * float(scaling["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


def grouped_routing(config: Any, experts: int, top: int) -> GroupedRouting:
    """The router's groups as transformers reads them, refused where its top k would have to
    choose among experts it zeroed (ties the graph cannot break as PyTorch does)."""
    groups = _int(config, "n_group")
    top_groups = _int(config, "topk_group")
    if experts % groups or experts // groups < 2:
        raise UnsupportedModelError(
            f"unsupported n_group {groups} of {experts} experts: need groups of 2 or more experts"
        )
    if top_groups > groups:
        raise UnsupportedModelError(f"unsupported topk_group {top_groups}: more than the {groups} groups (n_group)")
    if top > top_groups * (experts // groups):
        raise UnsupportedModelError(
            f"unsupported num_experts_per_tok {top}: more than the {top_groups * (experts // groups)} experts "
            f"of the topk_group {top_groups} groups"
        )
    scale = getattr(config, "routed_scaling_factor", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise UnsupportedModelError(f"unsupported routed_scaling_factor {scale!r}: need a finite number > 0")
    return GroupedRouting(groups=groups, top_groups=top_groups, scale=float(scale))


# --- the graph


def _floats(t: Any) -> Array:
    """A torch tensor as a float32 numpy array."""
    array: Array = t.detach().float().numpy()
    return array


def _turned(cols: Array, latent: LatentAttention) -> Array:
    """The rotary columns ``[..., rope]`` of one head in the graph's order: (even, odd)
    dimensions first where pairs are interleaved, each half zero-padded to ``turned / 2``."""
    if latent.interleaved:
        cols = np.concatenate([cols[..., 0::2], cols[..., 1::2]], axis=-1)
    return pad_heads(cols, 1, latent.rope, latent.turned)


def _head_parts(w: Array, heads: int, parts: list[tuple[int, int, int]], size: int) -> Array:
    """The columns of ``w`` ``[K, heads * own]`` as ``[K, heads * size]``: each ``(lo, hi, at)``
    puts a head's columns ``lo:hi`` at ``at``; the rest is zeros."""
    per_head = w.reshape(*w.shape[:-1], heads, -1)
    out = np.zeros((*per_head.shape[:-1], size), dtype=np.float32)
    for lo, hi, at in parts:
        out[..., at : at + hi - lo] = per_head[..., lo:hi]
    return out.reshape(*w.shape[:-1], heads * size)


def _query_columns(w: Array, spec: ModelSpec, latent: LatentAttention) -> Array:
    """The query projection's columns (a head: nope, then rope) in the graph's heads: the
    turned rotary part, then the unrotated one, then zeros."""
    heads, size, nope = spec.num_heads, spec.head_dim, latent.nope
    per_head = w.reshape(*w.shape[:-1], heads, nope + latent.rope)
    out = np.zeros((*per_head.shape[:-1], size), dtype=np.float32)
    out[..., : latent.turned] = _turned(per_head[..., nope:], latent)
    out[..., latent.turned : latent.turned + nope] = per_head[..., :nope]
    return out.reshape(*w.shape[:-1], heads * size)


def _rms(graph: _Graph, x: str, w: Array, name: str) -> str:
    """RMSNorm of ``x`` with epsilon ``LATENT_EPS``."""
    weight = graph.init(f"{name}.weight", w)
    return graph.node(
        "SimplifiedLayerNormalization", [x, weight], [f"{name}/output"], name, axis=-1, epsilon=LATENT_EPS, stash_type=1
    )[0]


def _query(blocks: _Blocks, normed: str, att: str, name: str) -> str:
    """The queries ``[1, N, heads * head_dim]`` in the graph's heads."""
    graph, sd, spec = blocks.g, blocks.sd, blocks.spec
    assert spec.latent is not None
    latent = spec.latent
    if not latent.q_rank:
        return graph.linear(normed, _query_columns(blocks.weight(att + "q_proj"), spec, latent), f"{name}/q_proj")
    low = graph.linear(normed, blocks.weight(att + "q_a_proj"), f"{name}/q_a_proj", blocks.bias(att + "q_a_proj"))
    low = _rms(graph, low, _floats(sd[att + "q_a_layernorm.weight"]), f"{name}/q_a_layernorm")
    return graph.linear(low, _query_columns(blocks.weight(att + "q_b_proj"), spec, latent), f"{name}/q_b_proj")


def _keys_values(blocks: _Blocks, normed: str, att: str, name: str) -> tuple[str, str]:
    """Keys and values ``[1, N, heads * head_dim]`` each: the latent and ``k_pe`` in one MatMul,
    the latent normed and decompressed, ``k_pe`` (turned by attention) beside every head's
    unrotated part."""
    graph, sd, spec = blocks.g, blocks.sd, blocks.spec
    assert spec.latent is not None
    latent, heads, size = spec.latent, spec.num_heads, spec.head_dim
    rest, rank = size - latent.turned, latent.kv_rank

    def kv_a(w: Array) -> Array:  # the latent's columns, then k_pe's turned
        return np.concatenate([w[..., :rank], _turned(w[..., rank:], latent)], axis=-1)

    bias = blocks.bias(att + "kv_a_proj_with_mqa")
    w_a = kv_a(blocks.weight(att + "kv_a_proj_with_mqa"))
    both = graph.linear(normed, w_a, f"{name}/kv_a_proj", None if bias is None else kv_a(bias))
    sizes = graph.init(f"{name}/kv_a_split", np.array([rank, latent.turned], dtype=np.int64))
    low, k_pe = graph.node("Split", [both, sizes], [f"{name}/latent", f"{name}/k_pe"], f"{name}/KvASplit", axis=-1)
    low = _rms(graph, low, _floats(sd[att + "kv_a_layernorm.weight"]), f"{name}/kv_a_layernorm")
    w_b = blocks.weight(att + "kv_b_proj")  # [rank, heads * (nope + value)]
    nope_v = latent.nope + latent.value
    w_b = np.concatenate(
        [
            _head_parts(w_b, heads, [(0, latent.nope, 0)], rest),
            _head_parts(w_b, heads, [(latent.nope, nope_v, 0)], size),
        ],
        axis=-1,
    )
    decompressed = graph.linear(low, w_b, f"{name}/kv_b_proj")
    sizes = graph.init(f"{name}/kv_b_split", np.array([heads * rest, heads * size], dtype=np.int64))
    k_nope, values = graph.node(
        "Split", [decompressed, sizes], [f"{name}/k_nope", f"{name}/values"], f"{name}/KvBSplit", axis=-1
    )
    return _whole_keys(graph, k_pe, k_nope, spec=spec, name=name), values


def _whole_keys(graph: _Graph, k_pe: str, k_nope: str, *, spec: ModelSpec, name: str) -> str:
    """Each head's key ``[1, N, heads * head_dim]``: the shared ``k_pe`` ``[1, N, turned]``, then the
    head's own ``k_nope`` part."""
    assert spec.latent is not None
    heads, turned = spec.num_heads, spec.latent.turned

    def shape(tag: str, dims: list[int]) -> str:
        return graph.init(f"{name}/{tag}", np.array(dims, dtype=np.int64))

    shared = graph.node("Reshape", [k_pe, shape("pe_shape", [0, 0, 1, turned])], [f"{name}/pe"], f"{name}/PeHeads")[0]
    shared = graph.node("Expand", [shared, shape("pe_heads", [1, 1, heads, turned])], [f"{name}/pe_all"], f"{name}/Pe")[
        0
    ]
    own_shape = shape("nope_shape", [0, 0, heads, spec.head_dim - turned])
    own = graph.node("Reshape", [k_nope, own_shape], [f"{name}/nope"], f"{name}/NopeHeads")[0]
    keys = graph.node("Concat", [shared, own], [f"{name}/key_heads"], f"{name}/Keys", axis=-1)[0]
    flat = shape("keys_shape", [0, 0, heads * spec.head_dim])
    return graph.node("Reshape", [keys, flat], [f"{name}/keys"], f"{name}/KeysFlat")[0]


def latent_attention(blocks: _Blocks, normed: str, layer: int) -> str:
    """Layer ``layer``'s latent attention on ``normed`` ``[1, N, H]``: queries, whole keys and
    values, GroupQueryAttention (partial rotary on each head's first ``turned`` dimensions), the
    output projection (zero rows for each head's padding past its value)."""
    graph, spec = blocks.g, blocks.spec
    assert spec.latent is not None
    name, att = f"/layers.{layer}/attn", f"model.layers.{layer}.self_attn."
    query = _query(blocks, normed, att, name)
    keys, values = _keys_values(blocks, normed, att, name)
    qkv = graph.node("Concat", [query, keys, values], [f"{name}/qkv"], f"{name}/Qkv", axis=-1)[0]
    rows = graph.node(
        "GroupQueryAttention",
        gqa_inputs(graph.unpack(qkv, name), layer),
        [f"{name}/rows", f"present.{layer}.key", f"present.{layer}.value"],
        f"{name}/GroupQueryAttention",
        domain="com.microsoft",
        num_heads=spec.num_heads,
        kv_num_heads=spec.num_kv_heads,
        scale=spec.attn_scale,
        do_rotary=1,
        rotary_interleaved=0,
    )[0]
    packed = graph.pack(rows, name)
    w_o = _head_parts(blocks.weight(att + "o_proj").T, spec.num_heads, [(0, spec.latent.value, 0)], spec.head_dim)
    return graph.linear(packed, np.ascontiguousarray(w_o.T), f"{name}/o_proj", blocks.bias(att + "o_proj"))


def grouped_router(graph: _Graph, logits: str, bias: Array, *, spec: ModelSpec, name: str) -> tuple[str, str]:
    """From the router's logits ``[N, E]``: the logits MoE takes (``log(score)`` of the chosen
    experts, ``UNCHOSEN`` for the rest) and the factor ``[N, 1]`` or scalar its output is
    multiplied by ("" when it is 1)."""
    assert spec.grouped is not None
    scores = graph.node("Sigmoid", [logits], [f"{name}/scores"], f"{name}/Scores")[0]
    choice = graph.node("Add", [scores, graph.init(f"{name}/score_bias", bias)], [f"{name}/choice"], f"{name}/Bias")[0]
    if spec.grouped.top_groups < spec.grouped.groups:
        choice = _best_groups(graph, choice, spec=spec, name=name)
    top = graph.init(f"{name}/top_k", np.array([spec.experts_per_token], dtype=np.int64))
    _, chosen = graph.node("TopK", [choice, top], [f"{name}/top_choice", f"{name}/chosen"], f"{name}/TopK", axis=-1)
    weights = graph.node("GatherElements", [scores, chosen], [f"{name}/weights"], f"{name}/Weights", axis=1)[0]
    logs = graph.node("Log", [weights], [f"{name}/log_weights"], f"{name}/Log")[0]
    floor = _filled(graph, scores, UNCHOSEN, f"{name}/unchosen")
    routed = graph.node("ScatterElements", [floor, chosen, logs], [f"{name}/routed_logits"], f"{name}/Routed", axis=1)[
        0
    ]
    scale = graph.init(f"{name}/routed_scale", np.array(spec.grouped.scale, dtype=np.float32))
    if spec.norm_topk:
        return routed, "" if spec.grouped.scale == 1.0 else scale
    axis = graph.init(f"{name}/weights_axis", np.array([1], dtype=np.int64))
    total = graph.node("ReduceSum", [weights, axis], [f"{name}/weights_sum"], f"{name}/WeightsSum", keepdims=1)[0]
    return routed, graph.node("Mul", [total, scale], [f"{name}/factor"], f"{name}/Factor")[0]


def _filled(graph: _Graph, like: str, value: float, name: str) -> str:
    """A float32 tensor of ``like``'s shape filled with ``value``."""
    shape = graph.node("Shape", [like], [f"{name}/shape"], f"{name}/Shape")[0]
    fill = helper.make_tensor("value", TensorProto.FLOAT, [1], [value])
    return graph.node("ConstantOfShape", [shape], [f"{name}/filled"], f"{name}/Fill", value=fill)[0]


def _best_groups(graph: _Graph, choice: str, *, spec: ModelSpec, name: str) -> str:
    """``choice`` ``[N, E]`` with the experts outside the ``top_groups`` best groups (a group's
    score: the sum of its two best choices) set to 0."""
    assert spec.grouped is not None
    groups, experts = spec.grouped.groups, spec.num_experts
    shape = graph.init(f"{name}/group_shape", np.array([-1, groups, experts // groups], dtype=np.int64))
    grouped = graph.node("Reshape", [choice, shape], [f"{name}/grouped"], f"{name}/Groups")[0]
    two = graph.init(f"{name}/two", np.array([2], dtype=np.int64))
    best, _ = graph.node(
        "TopK", [grouped, two], [f"{name}/best_two", f"{name}/best_two_at"], f"{name}/BestTwo", axis=-1
    )
    axis = graph.init(f"{name}/group_axis", np.array([-1], dtype=np.int64))
    group_scores = graph.node("ReduceSum", [best, axis], [f"{name}/group_scores"], f"{name}/GroupScores", keepdims=0)[0]
    keep = graph.init(f"{name}/top_groups", np.array([spec.grouped.top_groups], dtype=np.int64))
    _, kept = graph.node(
        "TopK", [group_scores, keep], [f"{name}/kept_scores", f"{name}/kept"], f"{name}/TopGroups", axis=-1
    )
    ones = _filled(graph, kept, 1.0, f"{name}/ones")
    zeros = _filled(graph, group_scores, 0.0, f"{name}/zeros")
    group_mask = graph.node("ScatterElements", [zeros, kept, ones], [f"{name}/group_mask"], f"{name}/GroupMask", axis=1)
    member = np.kron(np.eye(groups, dtype=np.float32), np.ones((1, experts // groups), dtype=np.float32))  # [G, E]
    mask = graph.node(
        "MatMul", [group_mask[0], graph.init(f"{name}/members", member)], [f"{name}/mask"], f"{name}/ExpertMask"
    )[0]
    half = graph.init(f"{name}/half", np.array(0.5, dtype=np.float32))
    inside = graph.node("Greater", [mask, half], [f"{name}/inside"], f"{name}/Inside")[0]
    zero = graph.init(f"{name}/zero", np.array(0.0, dtype=np.float32))
    return graph.node("Where", [inside, choice, zero], [f"{name}/group_choice"], f"{name}/GroupChoice")[0]
