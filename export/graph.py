"""Emit a compact, fused ONNX graph for a decoder (Llama and the families of
``export.families``, each a combination of this graph's blocks: norms, layer layouts, MLPs,
biases, rotary or learned positions, multipliers; ``export.model_spec``) straight from its weights.

The graph is what onnxruntime-genai's model builder would write, ~12 nodes a layer:

    x = Gather(embed, input_ids)                                        # [1, N, H]: packed
    per layer i:
      h, res = SkipSimplifiedLayerNormalization(mlp_out, res, ln_in_i)  # RMSNorm + residual add
      qkv    = MatMul(h, W_qkv) (+ bias: Qwen2, Llama attention_bias)    # [1, N, (nh + 2 kv) * d]
      rows   = Reshape(Gather(qkv, pad_index), padded_shape)            # [B, S, ...] right-padded
      a, present_k, present_v = GroupQueryAttention(rows, past_k, past_v, seqlens_k,
                                  total_sequence_length, cos, sin, query_seqlens)  # rotary inside
      a      = Gather(Reshape(a, [1, -1, 0]), pack_index)               # [1, N, nh * d]
      h, res = SkipSimplifiedLayerNormalization(MatMul(a, W_o) (+ b_o), res, ln_post_i)
      mlp_out = MatMul(SiLU(MatMul(h, W_gate)) * MatMul(h, W_up), W_down)
    hidden_states = SkipSimplifiedLayerNormalization(mlp_out, res, final_norm)   # [1, N, H]
    logits = MatMul(Gather(hidden_states, logits_index, axis=1), W_head)         # [1, R, V]

**Families** (read from transformers' modelling code): Qwen3 norms each query and key head
(RMSNorm, before rotary: ``Split`` / per-head ``SimplifiedLayerNormalization`` / ``Concat`` after
the qkv MatMul); Phi-3 fuses qkv and gate/up (``layout.split_fused`` reads them as the graph's
q/k/v and gate/up) and may rotate only the first part of each head (``partial_rotary_factor``:
GroupQueryAttention's rotary turns the first ``2 * cos_cache`` columns and passes the rest);
SmolLM3 has layers without rotary (``do_rotary=0``, no tables). Gemma 2 and 3 scale the
embeddings by sqrt(hidden) (a ``Mul`` in float32, as transformers does), norm with ``1 + w``,
norm attention's and the MLP's outputs too (``post_attention_layernorm``,
``pre_feedforward_layernorm`` then ``post_feedforward_layernorm`` around the MLP), use the tanh
GELU in a GeGLU, scale attention by ``query_pre_attn_scalar ** -0.5``; Gemma 2 soft-caps
attention scores (GroupQueryAttention's ``softcap``) and the logits (``tanh(x / c) * c`` after
the LM head); Gemma 3 norms each query and key head as Qwen3 does and turns its sliding layers by
their own rotary base (``cos_cache_local`` / ``sin_cache_local``).

**Sliding windows.** A layer with a window of w (Mistral, Phi-3, Qwen2 / Qwen3 / SmolLM3 with
``use_sliding_window``, Gemma's sliding layers) has GroupQueryAttention's
``local_window_size = w``: each query sees w keys, itself and the w - 1 positions before it, by its
position in the cache, as transformers' sliding mask does (tested past the window); the cache keeps every position (a
global layer beside it sees all of them), so rollback and the prefix cache are unchanged. A
tree's nodes sit in the cache past their real positions, so a windowed model verifies chains
(``architecture.sliding_window`` in the manifest tells the runtime).

**ALiBi.** BLOOM and MPT have no rotary: every layer's GroupQueryAttention takes one bias, the
runtime's ``attention_bias`` plus each head's slope times the key's cache slot (MPT: less the
query's position), built once from the bias's width (``_alibi_bias``). A tree's nodes sit in the
cache past their positions, so such a model verifies chains too (``architecture.alibi``).

**Packed positions.** The new positions of all the rows of a call (B requests, N positions in
all) come as one row: the MatMuls, which are nearly all the work, run on the N real positions;
only attention sees them as B right-padded rows of S (``query_seqlens`` ``[B]`` tells it each
row's real positions: padding is neither attended to nor cached). A batch of verifies of
different lengths then costs what its positions cost, not B x the longest, and ``logits_index``
picks any of the N positions. For one row the layout is the identity.

`past_key_values.{i}.*` and `present.{i}.*` are meant to be bound to one preallocated buffer
`[B, kv, max_len, d]` (GroupQueryAttention then appends in place). The LM head is always its own
`[H, V]` initializer, also for tied embeddings, so MatMulNBits quantization covers it.
With a `QuantSpec`, every MatMul becomes `com.microsoft.MatMulNBits`, and the embedding's Gather a
`com.microsoft.GatherBlockQuantized` of quantized blocks (tied: the LM head's own, stored once;
``export.embedding.quantize_embedding``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper

from specdec_rt.manifest_schema import IO_NAMES, KV_DTYPES, PACKED_ROLES, TREE_ROLES  # the names the manifest gives

from .alibi import alibi_slopes
from .embedding import EMBED_TABLE, quantize_embedding
from .errors import UnsupportedModelError
from .grid import find_grid
from .layout import check_weights, gqa_inputs, pad_heads, rename, rotary_width, split_fused
from .mla import grouped_router, latent_attention
from .model_spec import ModelSpec
from .quant import QuantSpec, quantize, stored_scales
from .weights import ExternalDataWriter

__all__ = [
    "IO_NAMES",
    "build_onnx",
    "rotary_tables",
    "decoder_io",
    "gqa_inputs",
    "save_graph",
    "PACKED_ROLES",
    "TREE_ROLES",
]

OPSET = 21
MS = "com.microsoft"


Array = npt.NDArray[Any]


def rotary_tables(model: Any, spec: ModelSpec, module: Any = None) -> tuple[Array, Array]:
    """cos, sin float32 [max_positions, width / 2] from the model's own rotary module, ``width``
    the graph's rotated dimensions of a head (all of it, or Phi-3's partial part: padded to
    ``layout.rotary_width``).

    Calling the HF module covers every rope-scaling variant (llama3, yarn, dynamic at its
    initial length, LongRoPE's short factors) and its attention scaling. HF tables are
    `cat(f, f)` (non-interleaved), over the rotated dimensions only. ``module``: another rotary
    module of the model (Gemma 3's ``rotary_emb_local``).
    """
    half = spec.rotary // 2
    if spec.rotary_interleaved and getattr(_decoder(model), "rotary_emb", None) is not None:
        cos, sin = _interleaved_angles(_module_tables(_decoder(model).rotary_emb, spec), spec)
    elif spec.rotary_interleaved:  # GPT-J: its attention's own table, [P, rotary] = cat(sin, cos)
        table = model.base_model.h[0].attn.embed_positions[: spec.max_positions].float().numpy()
        if table.shape != (spec.max_positions, spec.rotary):
            raise UnsupportedModelError(f"unsupported rotary table of shape {table.shape} for {spec.rotary} dimensions")
        cos, sin = table[:, half:], table[:, :half]
    else:
        cos, sin = _halves_angles(_module_tables(_rotary_module(model) if module is None else module, spec), spec)
    pad = rotary_width(spec.own_head_dim, spec.rotary) // 2 - half  # padded dimensions turn by angle 0
    cos = np.pad(cos, ((0, 0), (0, pad)), constant_values=1.0)
    sin = np.pad(sin, ((0, 0), (0, pad)), constant_values=0.0)
    return np.ascontiguousarray(cos), np.ascontiguousarray(sin)


def _module_tables(rot: Any, spec: ModelSpec) -> tuple[Array, Array]:
    """A transformers rotary module's cos and sin ``[P, d]`` at positions 0 .. P - 1."""
    import torch

    with torch.no_grad():
        pos = torch.arange(spec.max_positions, dtype=torch.long)[None]  # [1, P]
        cos, sin = rot(torch.zeros(1, dtype=torch.float32), pos)  # [1, P, d] each
    return cos[0].float().numpy(), sin[0].float().numpy()


def _interleaved_angles(tables: tuple[Array, Array], spec: ModelSpec) -> tuple[Array, Array]:
    """One column per turned pair ``[P, rotary / 2]`` of an interleaved family's tables
    (Cohere's: each angle twice in a row; GLM's: Llama's ``cat(f, f)``, paired by its apply)."""
    cos, sin = tables
    half = spec.rotary // 2
    if cos.shape[-1] != spec.rotary:
        raise UnsupportedModelError(f"unsupported interleaved rotary table of {cos.shape[-1]} dimensions")
    if np.array_equal(cos[:, ::2], cos[:, 1::2]):
        return cos[:, ::2], sin[:, ::2]
    if np.array_equal(cos[:, :half], cos[:, half:]):
        return cos[:, :half], sin[:, :half]
    raise UnsupportedModelError("unsupported rotary table: neither interleaved nor halves")


def _halves_angles(tables: tuple[Array, Array], spec: ModelSpec) -> tuple[Array, Array]:
    """One column per turned pair ``[P, rotary / 2]`` of Llama-style tables ``cat(f, f)`` (or
    GPT-OSS's module, which gives each angle once)."""
    cos, sin = tables
    half = spec.rotary // 2
    if cos.shape[-1] == half:
        return cos, sin
    if cos.shape[-1] != spec.rotary or not np.array_equal(cos[:, :half], cos[:, half:]):
        raise UnsupportedModelError(
            f"unsupported rotary layout (partial or interleaved): a table of "
            f"{cos.shape[-1]} dimensions for {spec.rotary} rotated ones"
        )
    return cos[:, :half], sin[:, :half]


def _decoder(model: Any) -> Any:
    """The decoder stack holding the rotary modules: ``model.model`` (Llama and most), else the
    base model (GPT-NeoX's ``gpt_neox``)."""
    inner = getattr(model, "model", None)
    rotary = inner is not None and (hasattr(inner, "rotary_emb") or hasattr(inner, "rotary_embs"))
    return inner if rotary else model.base_model


def _rotary_module(model: Any, local: bool = False) -> Any:
    """The rotary module of the global layers, or (``local``) of the sliding ones: Gemma 3's
    ``rotary_emb_local``, OLMo 3's ``rotary_embs['sliding_attention']``."""
    decoder = _decoder(model)
    embs = getattr(decoder, "rotary_embs", None)
    if embs is not None:  # one module per attention type
        return embs["sliding_attention" if local else "full_attention"]
    return decoder.rotary_emb_local if local else decoder.rotary_emb


class _Graph:
    """Accumulates nodes and initializers; every MatMul goes through `linear`."""

    def __init__(self, data: ExternalDataWriter, quant: QuantSpec | None, eps: float):
        self.eps = eps
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []
        self.data = data
        self.quant = quant
        self.grids: dict[str, int] = {}  # weights kept on their source's grid, by form
        self.scale_dtypes: dict[str, int] = {}  # scale and offset tensors by stored element type
        self._block_sums: dict[tuple[str, int], str] = {}  # (input, block size) -> its sums over blocks (offsets)
        self.kv_dtype = "float32"  # the KV cache's, and so GroupQueryAttention's, element type

    def to_kv(self, x: str, name: str) -> str:
        """Float32 ``x`` as attention's element type (a ``Cast`` for a float16 cache)."""
        if self.kv_dtype == "float32":
            return x
        return self.node("Cast", [x], [f"{name}/as_kv"], f"{name}/ToKV", to=TensorProto.FLOAT16)[0]

    def from_kv(self, x: str, name: str) -> str:
        """Attention's output ``x`` back in float32."""
        if self.kv_dtype == "float32":
            return x
        return self.node("Cast", [x], [f"{name}/from_kv"], f"{name}/FromKV", to=TensorProto.FLOAT)[0]

    def kv_init(self, name: str, array: Array) -> str:
        """An initializer attention reads (rotary tables, sinks), in attention's element type."""
        return self.init(name, array.astype(np.float16) if self.kv_dtype == "float16" else array)

    def node(
        self, op: str, inputs: list[str], outputs: list[str], name: str, *, domain: str = "", **attrs: Any
    ) -> list[str]:
        """Add one node ``op`` (attributes ``attrs``); returns its output names."""
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain, **attrs))
        return outputs

    def unpack(self, x: str, name: str) -> str:
        """Packed positions ``[1, N, D]`` to right-padded rows ``[B, S, D]`` (``pad_index``
        ``[B*S]``: the packed position of each padded one; padding may point anywhere, since
        GroupQueryAttention neither attends to nor caches it)."""
        rows = self.node("Gather", [x, "pad_index"], [f"{name}/padded"], f"{name}/Unpack", axis=1)[0]
        return self.node("Reshape", [rows, "padded_shape"], [f"{name}/rows_in"], f"{name}/UnpackReshape")[0]

    def pack(self, x: str, name: str) -> str:
        """Right-padded rows ``[B, S, D]`` back to packed positions ``[1, N, D]`` (``pack_index``
        ``[N]``: the padded position of each packed one)."""
        if "flat_shape" not in {t.name for t in self.inits}:
            self.inits.append(helper.make_tensor("flat_shape", TensorProto.INT64, [3], [1, -1, 0]))
        flat = self.node("Reshape", [x, "flat_shape"], [f"{name}/flat"], f"{name}/PackReshape")[0]
        return self.node("Gather", [flat, "pack_index"], [f"{name}/output"], f"{name}/Pack", axis=1)[0]

    def position_rows(self) -> str:
        """``position_ids`` ``[1, N]`` (packed) laid out as attention's rows ``[B, S]``."""
        rows = self.node("Gather", ["position_ids", "pad_index"], ["/positions/padded"], "/positions/Unpack", axis=1)[
            0
        ]  # [1, B*S]
        lo, hi = (
            self.init("/positions/lo", np.array([0], dtype=np.int64)),
            self.init("/positions/hi", np.array([2], dtype=np.int64)),
        )
        shape = self.node("Slice", ["padded_shape", lo, hi], ["/positions/shape"], "/positions/Shape")[0]
        return self.node("Reshape", [rows, shape], ["position_rows"], "/positions/Rows")[0]

    def init(self, name: str, array: Array) -> str:
        """Add an initializer named after its node path (`layers.0/attn/qkv.weight`)."""
        name = name.lstrip("/")
        self.inits.append(self.data.add(name, array))
        return name

    def scales_init(self, name: str, values: Array, *, offsets: bool = False) -> str:
        """A weight's float32 scales (or ``offsets``: block offsets) ``name``, stored as
        ``quant.scale_dtype`` asks (``export.quant.stored_scales``): a float16 initializer
        ``name_f16`` and a ``Cast`` to float32 named ``name``, which ONNX Runtime folds when the
        session loads."""
        spec = self.quant if self.quant is not None else QuantSpec(bits=8)
        stored = stored_scales(values, spec, offsets=offsets)
        kind = str(stored.dtype)
        if spec.scale_dtype != "float32":
            self.scale_dtypes[kind] = self.scale_dtypes.get(kind, 0) + 1
        if stored.dtype == np.float32:
            return self.init(name, stored)
        half = self.init(f"{name}_f16", stored)
        return self.node("Cast", [half], [name.lstrip("/")], f"{name.lstrip('/')}/Cast", to=TensorProto.FLOAT)[0]

    def linear(self, x: str, w: Array, name: str, bias: Array | None = None, *, out: str | None = None) -> str:
        """`x @ w (+ bias)` for `w` float32 [K, N]; MatMulNBits when quantizing."""
        final = out or f"{name}/output"
        product = f"{name}/matmul" if bias is not None else final
        if self.quant is None:
            self.node("MatMul", [x, self.init(f"{name}.weight", w)], [product], f"{name}/MatMul")
        else:
            self.quantized_linear(x, w, name, self.quant, out=product)
        if bias is None:
            return product
        return self.node("Add", [product, self.init(f"{name}.bias", bias)], [final], f"{name}/Add")[0]

    def quantized_linear(self, x: str, w: Array, name: str, quant: QuantSpec, *, out: str) -> None:
        """``x @ w`` as MatMulNBits: on the source's grid where ``w`` lies on one (plus the sum
        over each block of x times the block's offset, where the grid has offsets), else
        requantized by ``quant``."""
        grid = find_grid(w, quant.block_size, quant.grids) if quant.source_grid else None
        form = grid.form if grid else "requantized"
        self.grids[form] = self.grids.get(form, 0) + 1
        q, bits = (grid.q, grid.bits) if grid else (quantize(w, quant), quant.bits)
        ins = [x, self.init(f"{name}.weight_q", q.packed), self.scales_init(f"{name}.scales", q.scales)]
        if q.zero_points is not None:  # symmetric: none (the kernel's default, 2^(bits-1))
            ins.append(self.init(f"{name}.zero_points", q.zero_points))
        offsets = grid.offsets if grid is not None else None
        bs = grid.block_size if grid else quant.block_size
        self.node(
            "MatMulNBits",
            ins,
            [f"{name}/codes" if offsets is not None else out],
            f"{name}/MatMulNBits",
            domain=MS,
            K=q.k,
            N=q.n,
            bits=bits,
            block_size=bs,
            accuracy_level=quant.accuracy_level,
        )
        if offsets is not None:  # + sum over each block of x, times the block's offset
            part = self.node(
                "MatMul",
                [self.block_sums(x, q.k, bs), self.scales_init(f"{name}.offsets", offsets, offsets=True)],
                [f"{name}/offset"],
                f"{name}/Offsets",
            )[0]
            self.node("Add", [f"{name}/codes", part], [out], f"{name}/AddOffsets")

    def block_sums(self, x: str, k: int, bs: int) -> str:
        """``x [1, N, K]`` summed over each block of ``bs`` along K: ``[1, N, K / bs]`` (once per
        input and block size)."""
        key = (x, bs)
        if key not in self._block_sums:
            tag = x if self.quant is not None and bs == self.quant.block_size else f"{x}/b{bs}"
            shape = self.init(f"{tag}/block_shape", np.array([0, 0, k // bs, bs], dtype=np.int64))
            rows = self.node("Reshape", [x, shape], [f"{tag}/blocks"], f"{tag}/Blocks")[0]
            axes = self.init(f"{tag}/block_axis", np.array([-1], dtype=np.int64))
            self._block_sums[key] = self.node(
                "ReduceSum", [rows, axes], [f"{tag}/block_sums"], f"{tag}/BlockSums", keepdims=0
            )[0]
        return self._block_sums[key]

    def layer_norm(
        self, x: str, skip: str | None, w: Array, *, bias: Array | None, name: str, out: str | None = None
    ) -> tuple[str, str]:
        """LayerNorm(x + skip) * w (+ bias); returns (normed, x + skip)."""
        eps, out = self.eps, out or f"{name}/output"
        ins = [self.init(f"{name}.weight", w)] + ([self.init(f"{name}.bias", bias)] if bias is not None else [])
        if skip is None:
            return self.node("LayerNormalization", [x, *ins], [out], name, axis=-1, epsilon=eps, stash_type=1)[0], x
        out, _, _, summed = self.node(
            "SkipLayerNormalization",
            [x, skip, *ins],
            [out, "", "", f"{name}/sum"],
            name,
            domain=MS,
            epsilon=eps,
        )
        return out, summed

    def rms_norm(self, x: str, skip: str | None, w: Array, name: str, *, out: str | None = None) -> tuple[str, str]:
        """RMSNorm(x + skip) * w; returns (normed, x + skip)."""
        eps, out = self.eps, out or f"{name}/output"
        weight = self.init(f"{name}.weight", w)
        if skip is None:
            return self.node(
                "SimplifiedLayerNormalization", [x, weight], [out], name, axis=-1, epsilon=eps, stash_type=1
            )[0], x
        out, _, _, summed = self.node(
            "SkipSimplifiedLayerNormalization",
            [x, skip, weight],
            [out, "", "", f"{name}/sum"],
            name,
            domain=MS,
            epsilon=eps,
        )
        return out, summed


def _np(t: Any) -> Array:
    """A torch tensor as a float32 numpy array."""
    array: Array = t.detach().float().numpy()
    return array


def build_onnx(
    model: Any,
    spec: ModelSpec,
    out_dir: Path,
    quant: QuantSpec | None = None,
    *,
    on_layer: Callable[[int], None] | None = None,
    kv_dtype: str = "float32",
) -> dict[str, Any]:
    """Write `model.onnx` + `model.onnx.data` into `out_dir`; returns {"nodes": n, ...}.

    `model` is a transformers causal LM of a supported family (``ModelSpec.family``) in
    float32. `on_layer(i)` is called after each layer (progress bars). ``kv_dtype``
    ``"float16"``: the KV cache and attention itself in float16 (see :func:`_attention_dtype`).
    """
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    if kv_dtype != "float32" and (spec.latent is not None or spec.alibi):
        what = "ALiBi's biases grow with the position, past float16's" if spec.alibi else "latent attention's cache is"
        raise UnsupportedModelError(f"--kv-dtype {kv_dtype}: {what} float32 only")
    sd = _graph_weights(model, spec)
    out_dir = Path(out_dir)
    with ExternalDataWriter(out_dir / "model.onnx.data") as data:
        graph = _Graph(data, quant, spec.rms_eps)
        graph.kv_dtype = kv_dtype
        if spec.rotary_positions:
            _rotary_inits(graph, model, spec)
        graph.position_rows()  # [B, S] for attention, from the packed [1, N]
        bias = _alibi_bias(graph, alibi_slopes(model, spec.num_heads), spec) if spec.alibi else "attention_bias"
        bias = graph.to_kv(bias, "/attention_bias")
        blocks = _Blocks(graph, sd, spec, attention_bias=bias)
        stream, res = blocks.embed(), None  # stream: the branch output to add; res: the running residual
        for i in range(spec.num_layers):
            stream, res = blocks.layer(i, stream, res)
            if on_layer:
                on_layer(i)
        embedding = blocks.lm_head(stream, res)
    inputs, outputs = decoder_io(
        spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.vocab_size, hidden=spec.hidden_size, kv_dtype=kv_dtype
    )
    stats = save_graph(graph, "decoder", inputs, outputs, path=out_dir / "model.onnx", producer="specdec-rt export")
    return stats | ({"embedding": embedding} if embedding else {})


def _graph_weights(model: Any, spec: ModelSpec) -> dict[str, Any]:
    """The model's tensors under Llama's names, fused q/k/v and gate/up split, per-head norms
    stacked, checked against what the graph has a place for."""
    sd = split_fused(rename(model.state_dict(), spec), spec)
    sd = _stack_head_norms(sd)
    check_weights(sd, spec)
    return sd


def _stack_head_norms(sd: dict[str, Any]) -> dict[str, Any]:
    """StableLM's per-head LayerNorms (``q_norm.norms.{h}.weight``, one module a head) as one
    ``q_norm.weight`` ``[heads, own]``, as Cohere stores its own."""
    stems = sorted({k.split(".norms.")[0] for k in sd if ".norms." in k and k.endswith(".weight")})
    if not stems:
        return sd
    import torch

    out = dict(sd)
    for stem in stems:
        heads = sorted(int(k[len(stem) + 7 :].split(".")[0]) for k in sd if k.startswith(stem + ".norms."))
        if heads != list(range(len(heads))) or any(f"{stem}.norms.{h}.bias" in sd for h in heads):
            continue  # check_weights names what the graph has no place for
        out[stem + ".weight"] = torch.stack([out.pop(f"{stem}.norms.{h}.weight") for h in heads])
    return out


def _alibi_bias(graph: _Graph, slopes: Array, spec: ModelSpec) -> str:
    """The attention bias every layer takes with ALiBi: the runtime's ``attention_bias``
    ``[1, 1, S, T]`` (causal zeros or a mask) plus each head's slope times each key's cache slot
    (``absolute``, BLOOM's: ``[1, H, 1, T]``; ``bfloat16``, Falcon-RW's: the slots, the slopes and
    their products rounded to bfloat16, then times attention's scale, as transformers adds them
    before it), or times the slot less the query's position (``relative``, MPT's: ``[B, H, S, T]``,
    at most 0, the same in a call of any length), summed ``[1 or B, H, S, T]``. A slot is the
    key's position in a chain (the only calls such a model takes). Float32 products of whole
    numbers, as transformers' ALiBi tensors."""
    keys = _alibi_keys(graph, spec.alibi)
    heads = graph.init("/alibi/slopes", slopes.astype(np.float32).reshape(1, -1, 1, 1))
    per_head = graph.node("Mul", [heads, keys], ["/alibi/per_head"], "/alibi/Slopes")[0]
    if spec.alibi == "bfloat16":
        per_head = _bfloat16(graph, per_head, "/alibi/per_head")
        scale = spec.attn_scale or 1.0 / math.sqrt(spec.own_head_dim)
        factor = graph.init("/alibi/scale", np.array(scale, dtype=np.float32))
        per_head = graph.node("Mul", [per_head, factor], ["/alibi/scaled"], "/alibi/Scale")[0]
    return graph.node("Add", ["attention_bias", per_head], ["/alibi/bias"], "/alibi/Bias")[0]


def _alibi_keys(graph: _Graph, kind: str) -> str:
    """Each key's cache slot 0 .. T - 1 as float32 ``[T]`` (T: the width of the runtime's
    ``attention_bias``), rounded to bfloat16 (``bfloat16``), or less each query's position
    (``relative``: ``[B, 1, S, T]``, from ``position_rows``)."""
    shape = graph.node("Shape", ["attention_bias"], ["/alibi/bias_shape"], "/alibi/BiasShape")[0]
    last = graph.init("/alibi/last_axis", np.array(3, dtype=np.int64))
    total = graph.node("Gather", [shape, last], ["/alibi/total"], "/alibi/Total", axis=0)[0]  # scalar T
    zero, one = graph.init("/alibi/zero", np.array(0, np.int64)), graph.init("/alibi/one", np.array(1, np.int64))
    slots = graph.node("Range", [zero, total, one], ["/alibi/slots"], "/alibi/Slots")[0]  # [T]
    keys = graph.node("Cast", [slots], ["/alibi/keys"], "/alibi/Keys", to=TensorProto.FLOAT)[0]
    if kind == "bfloat16":
        return _bfloat16(graph, keys, "/alibi/keys")
    if kind != "relative":
        return keys
    rows = graph.node("Cast", ["position_rows"], ["/alibi/queries"], "/alibi/Queries", to=TensorProto.FLOAT)[0]
    axes = graph.init("/alibi/query_axes", np.array([1, 3], dtype=np.int64))
    queries = graph.node("Unsqueeze", [rows, axes], ["/alibi/query_rows"], "/alibi/QueryRows")[0]  # [B, 1, S, 1]
    return graph.node("Sub", [keys, queries], ["/alibi/distances"], "/alibi/Distances")[0]


def _bfloat16(graph: _Graph, x: str, name: str) -> str:
    """``x`` (float32) rounded to bfloat16 and back."""
    rounded = graph.node("Cast", [x], [f"{name}_bf16"], f"{name}/ToBfloat16", to=TensorProto.BFLOAT16)[0]
    return graph.node("Cast", [rounded], [f"{name}_rounded"], f"{name}/FromBfloat16", to=TensorProto.FLOAT)[0]


def _rotary_inits(graph: _Graph, model: Any, spec: ModelSpec) -> None:
    """The rotary tables ``cos_cache`` / ``sin_cache`` ``[P, d / 2]`` and, where sliding layers
    turn by their own module (Gemma 3's ``rope_local_base_freq``, OLMo 3's unscaled one),
    ``cos_cache_local`` / ``sin_cache_local``."""
    cos, sin = rotary_tables(model, spec)
    graph.kv_init("cos_cache", cos)
    graph.kv_init("sin_cache", sin)
    if spec.local_rope:
        cos, sin = rotary_tables(model, spec, _rotary_module(model, local=True))
        graph.kv_init("cos_cache_local", cos)
        graph.kv_init("sin_cache_local", sin)


class _Blocks:
    """The per-layer building blocks a family combines (``export.families``), on one graph."""

    def __init__(self, graph: _Graph, sd: dict[str, Any], spec: ModelSpec, *, attention_bias: str = "attention_bias"):
        self.g, self.sd, self.spec = graph, sd, spec
        self.attention_bias = attention_bias  # what attention adds to its scores (ALiBi's sum, or the input)

    def weight(self, key: str) -> Array:
        """``<key>.weight`` as float32, ``[in, out]`` (a MatMul's right side)."""
        w: Array = _np(self.sd[key + ".weight"]).T
        return w

    def bias(self, key: str) -> Array | None:
        """``<key>.bias`` when the checkpoint has one (check_weights allowed it)."""
        b = self.sd.get(key + ".bias")
        return None if b is None else _np(b)

    def embed(self) -> str:
        """The input embeddings ``[1, N, H]``: the token rows (projected in: OPT-350M), times the
        family's scale (Gemma: sqrt(hidden), rounded to float32 as transformers does), normed
        (BLOOM), plus the learned position rows (``position_ids`` + offset)."""
        graph, spec = self.g, self.spec
        words = _np(self.sd["model.embed_tokens.weight"])  # quantized: written by quantize_embedding
        table = graph.init(EMBED_TABLE, words) if graph.quant is None else EMBED_TABLE
        x_embed = graph.node("Gather", [table, "input_ids"], ["/embed/output"], "/embed/Gather")[0]
        if spec.embed_dim:
            x_embed = graph.linear(x_embed, self.weight("model.project_in"), "/embed/project_in")
        if spec.embed_scale:
            scale = graph.init("/embed/scale", np.array(spec.embed_scale, dtype=np.float32))
            x_embed = graph.node("Mul", [x_embed, scale], ["/embed/scaled"], "/embed/Scale")[0]
        if spec.embed_norm:
            x_embed, _ = self.norm(x_embed, None, "model.embed_norm", "/embed_norm")
        if not spec.learned_positions:
            return x_embed
        rows = "position_ids"
        if spec.position_offset:
            off = graph.init("/embed_positions/offset", np.array(spec.position_offset, dtype=np.int64))
            rows = graph.node("Add", [rows, off], ["/embed_positions/rows"], "/embed_positions/Offset")[0]
        positions = graph.init("embed_positions.weight", _np(self.sd["model.embed_positions.weight"]))
        pos = graph.node("Gather", [positions, rows], ["/embed_positions/output"], "/embed_positions/Gather")[0]
        return graph.node("Add", [x_embed, pos], ["/embed/positioned"], "/embed/AddPositions")[0]

    def layer(self, i: int, stream: str, res: str | None) -> tuple[str, str | None]:
        """Layer ``i`` in the family's layout, from the branch output still to add (``stream``)
        and the running residual; returns the same pair after it."""
        key, name, layout = f"model.layers.{i}.", f"/layers.{i}", self.spec.layout
        if layout in ("post", "post_ln"):  # attention reads the residual itself
            normed = res = self.add(stream, res, f"{name}/attn_residual")
        else:
            normed, res = self.norm(stream, res, key + "input_layernorm", f"{name}/input_layernorm")
            if layout == "pre_normed":  # BLOOM: the normed input is the residual
                res = normed
        attended = self.attention(normed, i)
        if layout in ("parallel", "parallel2"):  # the MLP reads the layer's input too; one add
            if layout == "parallel2":  # GPT-NeoX, Falcon's ln_mlp: its own norm of the input
                normed, _ = self.norm(res, None, key + "post_attention_layernorm", f"{name}/post_attention_layernorm")
            mlp_out = self.ffn(normed, i, key + "mlp.", f"{name}/mlp")
            both = self.g.node("Add", [attended, mlp_out], [f"{name}/branches"], f"{name}/Branches")[0]
            return self.scaled(both, f"{name}/branch"), res
        if layout == "post_ln":  # OPT-350M: LayerNorm(x + attention), LayerNorm(h + MLP)
            normed, _ = self.norm(attended, res, key + "input_layernorm", f"{name}/input_layernorm")
            mlp_out = self.ffn(normed, i, key + "mlp.", f"{name}/mlp")
            out, _ = self.norm(mlp_out, normed, key + "post_attention_layernorm", f"{name}/post_attention_layernorm")
            return out, None
        return self.sequential(i, self.scaled(attended, f"{name}/attn"), res)

    def sequential(self, i: int, attended: str, res: str) -> tuple[str, str | None]:
        """The rest of a layer whose MLP follows attention: the output added (``pre``; the sum's
        norm the residual: ``pre_normed``), or normed then added (``sandwich``: normed again for
        the MLP; ``post``), then the MLP."""
        key, name, layout = f"model.layers.{i}.", f"/layers.{i}", self.spec.layout
        if layout in ("pre", "pre_normed"):
            normed, res = self.norm(attended, res, key + "post_attention_layernorm", f"{name}/post_attention_layernorm")
            res = normed if layout == "pre_normed" else res
        else:
            attended, _ = self.norm(
                attended, None, key + "post_attention_layernorm", f"{name}/post_attention_layernorm"
            )
            if layout == "sandwich":
                normed, res = self.norm(
                    attended, res, key + "pre_feedforward_layernorm", f"{name}/pre_feedforward_layernorm"
                )
            else:
                normed = res = self.add(attended, res, f"{name}/mlp_residual")
        stream = self.ffn(normed, i, key + "mlp.", f"{name}/mlp")
        if layout in ("sandwich", "post"):
            stream, _ = self.norm(stream, None, key + "post_feedforward_layernorm", f"{name}/mlp/post_norm")
        return self.scaled(stream, f"{name}/mlp"), res

    def attention(self, normed: str, i: int) -> str:
        """Layer ``i``'s attention on ``normed`` ``[1, N, H]``: the fused q/k/v projection (heads
        padded, clamped, normed), GroupQueryAttention over the rows, the output projection."""
        graph, spec, name, att = self.g, self.spec, f"/layers.{i}", f"model.layers.{i}.self_attn."
        if spec.latent is not None:  # DeepSeek's multi-head latent attention (export.mla)
            return latent_attention(self, normed, i)
        qkv = self.qkv(normed, att, f"{name}/attn")
        rotary = i not in spec.nope_layers and spec.rotary_positions  # SmolLM3: some layers have none
        window = spec.windows[i] if spec.windows else 0  # 0: every earlier position
        softcap = {"softcap": spec.attn_softcap} if spec.attn_softcap else {}
        rows_in = graph.to_kv(graph.unpack(qkv, f"{name}/attn"), f"{name}/attn")
        ins = gqa_inputs(rows_in, i, rotary=rotary, local=i in spec.local_rope_layers)
        ins[10] = self.attention_bias  # ALiBi: the runtime's bias plus the slopes' [1 or B, H, S, T]
        if spec.sinks:  # GPT-OSS: exp(sink) of each head joins its softmax's denominator
            ins[11] = graph.kv_init(f"{name}/attn/head_sink", _np(self.sd[att + "sinks"]))
        rows = graph.node(
            "GroupQueryAttention",
            ins,
            [f"{name}/attn/rows", f"present.{i}.key", f"present.{i}.value"],
            f"{name}/attn/GroupQueryAttention",
            domain=MS,
            num_heads=spec.num_heads,
            kv_num_heads=spec.num_kv_heads,
            scale=spec.attn_scale or 1.0 / math.sqrt(spec.own_head_dim),
            do_rotary=int(rotary),
            rotary_interleaved=int(spec.rotary_interleaved),
            local_window_size=window if window else -1,  # itself and the window - 1 before it
            **softcap,
        )[0]
        packed = graph.pack(graph.from_kv(rows, f"{name}/attn"), f"{name}/attn")  # [1, N, nh d]
        w_o = self.padded(_np(self.sd[att + "o_proj.weight"]), spec.num_heads, spec.head_dim).T  # zero rows for padding
        return graph.linear(packed, w_o, f"{name}/attn/o_proj", self.bias(att + "o_proj"))

    def padded(self, w: Array, heads: int, size: int) -> Array:
        """``layout.pad_heads`` of ``w``'s last axis (``heads`` model heads) to heads of ``size``."""
        spec = self.spec
        return pad_heads(w, heads, spec.own_head_dim, size, rotary=spec.rotary, interleaved=spec.rotary_interleaved)

    def qkv(self, h: str, att: str, name: str) -> str:
        """q, k and v of ``h`` in one MatMul ``[1, N, (nh + 2 kv) d]`` (q and k left unpadded
        where they are normed first: the norm pads them), clamped (OLMo), q and k normed."""
        graph, spec = self.g, self.spec
        heads = {"q": spec.num_heads, "k": spec.num_kv_heads, "v": spec.num_kv_heads}
        normed = spec.qk_norm or spec.qk_norm_full
        size = {p: spec.own_head_dim if normed and p != "v" else spec.head_dim for p in "qkv"}
        w_qkv = np.concatenate([self.padded(self.weight(att + f"{p}_proj"), heads[p], size[p]) for p in "qkv"], 1)
        b_qkv = None
        if att + "q_proj.bias" in self.sd:
            b_qkv = np.concatenate(
                [self.padded(_np(self.sd[att + f"{p}_proj.bias"]), heads[p], size[p]) for p in "qkv"]
            )
        qkv = graph.linear(h, w_qkv, f"{name}/qkv", b_qkv)
        del w_qkv
        if spec.clip_qkv:  # OLMo: q, k and v clamped (padding stays 0)
            lo = graph.init(f"{name}/clip_lo", np.array(-spec.clip_qkv, dtype=np.float32))
            hi = graph.init(f"{name}/clip_hi", np.array(spec.clip_qkv, dtype=np.float32))
            qkv = graph.node("Clip", [qkv, lo, hi], [f"{name}/clipped"], f"{name}/Clip")[0]
        return _norm_heads(graph, qkv, self.sd, att=att, spec=spec, name=name) if normed else qkv

    def lm_head(self, stream: str, res: str | None) -> dict[str, object] | None:
        """``hidden_states`` (the last branch added, the final norm: none after ``post_ln``
        layers) and ``logits`` of the rows ``logits_index`` picks (projected out: OPT-350M),
        times ``logit_scale`` (Cohere), over ``logits_scaling`` (Granite), soft-capped (Gemma 2)."""
        graph, spec = self.g, self.spec
        if spec.layout == "post_ln":
            graph.node("Identity", [stream], ["hidden_states"], "/norm/Identity")
        else:
            self.norm(stream, res, "model.norm", "/norm", out="hidden_states")
        picked = graph.node("Gather", ["hidden_states", "logits_index"], ["/lm_head/rows"], "/lm_head/Gather", axis=1)[
            0
        ]
        if spec.embed_dim:
            picked = graph.linear(picked, self.weight("model.project_out"), "/lm_head/project_out")
        head = self.sd.get("lm_head.weight", self.sd["model.embed_tokens.weight"])
        steps = [(op, by) for op, by in (("Mul", spec.logits_scale), ("Div", spec.logits_divisor)) if by]
        cap = spec.final_softcap
        last = not (steps or cap)
        logits = graph.linear(picked, _np(head).T, "/lm_head", self.bias("lm_head"), out="logits" if last else None)
        for j, (op, by) in enumerate(steps):
            const = graph.init(f"/lm_head/{op.lower()}_by", np.array(by, dtype=np.float32))
            out = "logits" if j == len(steps) - 1 and not cap else f"/lm_head/{op.lower()}"
            logits = graph.node(op, [logits, const], [out], f"/lm_head/{op}")[0]
        if cap:  # Gemma 2: tanh(logits / cap) * cap
            limit = graph.init("/lm_head/softcap", np.array(cap, dtype=np.float32))
            scaled = graph.node("Div", [logits, limit], ["/lm_head/capped"], "/lm_head/SoftcapDiv")[0]
            bent = graph.node("Tanh", [scaled], ["/lm_head/tanh"], "/lm_head/Tanh")[0]
            graph.node("Mul", [bent, limit], ["logits"], "/lm_head/SoftcapMul")
        if graph.quant is None:
            return None
        return quantize_embedding(graph, _np(self.sd["model.embed_tokens.weight"]), _np(head))

    def norm(self, x: str, skip: str | None, key: str, name: str, out: str | None = None) -> tuple[str, str]:
        """The family's norm (``<key>.weight`` + its offset, LayerNorm's bias) of ``x + skip``;
        returns (normed, x + skip)."""
        w = _np(self.sd[key + ".weight"]) if self.spec.norm_weights else np.ones(self.spec.hidden_size, np.float32)
        if self.spec.norm_offset:
            w = w + np.float32(self.spec.norm_offset)
        if self.spec.norm == "layer":
            return self.g.layer_norm(x, skip, w, bias=self.bias(key), name=name, out=out)
        return self.g.rms_norm(x, skip, w, name, out=out)

    def add(self, x: str, res: str | None, name: str) -> str:
        """``x + res`` (``x`` alone before the first residual)."""
        return x if res is None else self.g.node("Add", [x, res], [f"{name}/sum"], f"{name}/Add")[0]

    def scaled(self, x: str, name: str) -> str:
        """A branch times the residual multiplier before its add (Granite), else itself."""
        if not self.spec.residual_scale:
            return x
        m = self.g.init(f"{name}/residual_scale", np.array(self.spec.residual_scale, dtype=np.float32))
        return self.g.node("Mul", [x, m], [f"{name}/scaled"], f"{name}/ResidualScale")[0]

    def ffn(self, h: str, layer: int, key: str, m: str) -> str:
        """The layer's feed-forward block: its experts (``spec.moe_layers``) or its MLP."""
        return self.moe(h, key, m) if layer in self.spec.moe_layers else self.mlp(h, key, m)

    def moe(self, h: str, key: str, m: str) -> str:
        """A mixture of experts on ``h`` ``[1, N, H]``, each position routed on its own (a
        verify's k + 1 positions, a batch's rows alike), as ONNX Runtime's ``com.microsoft.MoE``:
        the router's logits in, the softmax over the experts, the top k (renormalised over the k
        when ``spec.norm_topk``; Granite-MoE's softmax over the top k logits is the same), each
        chosen expert's SwiGLU (``swiglu_fusion=1``: gate and up rows interleaved, ``alpha`` 1 and
        ``beta`` 0: ``silu(gate) * up``), weighed and summed; a step reads the k active experts,
        not all E. ERNIE 4.5 picks the experts by the probabilities plus a correction bias
        (``biased_choice``). Plus a shared expert behind its sigmoid gate (Qwen2-MoE), or shared
        experts added as they are (ERNIE 4.5; DeepSeek, after its grouped sigmoid router:
        ``export.mla``)."""
        graph, sd, spec = self.g, self.sd, self.spec
        if spec.act != "silu":
            raise UnsupportedModelError(f"unsupported experts' activation {spec.act}: need silu")
        hidden = spec.hidden_size
        shape = graph.init(f"{m}/rows_shape", np.array([-1, hidden], dtype=np.int64))
        rows = graph.node("Reshape", [h, shape], [f"{m}/x"], f"{m}/Rows")[0]  # [N, H]
        logits = graph.linear(rows, _np(sd[key + "gate.weight"]).T, f"{m}/router", self.bias(key + "gate"))  # [N, E]
        factor = ""
        if spec.grouped is not None:  # DeepSeek's grouped sigmoid router (export.mla)
            bias = _np(sd[key + "gate.e_score_correction_bias"])
            logits, factor = grouped_router(graph, logits, bias, spec=spec, name=f"{m}/router")
        elif spec.router == "softmax_biased":
            logits = self.biased_choice(logits, key, m)
        routed = self.experts(rows, logits, key, m)
        if factor:  # the op's weights sum to 1: times routed_scaling_factor (and the scores' sum)
            routed = graph.node("Mul", [routed, factor], [f"{m}/experts_scaled"], f"{m}/RoutedScale")[0]
        packed = graph.init(f"{m}/packed_shape", np.array([1, -1, hidden], dtype=np.int64))
        out = graph.node("Reshape", [routed, packed], [f"{m}/experts_out"], f"{m}/Packed")[0]  # [1, N, H]
        if not spec.shared_expert_size:
            return out
        shared = self.mlp(h, key + "shared_expert.", f"{m}/shared_expert")
        if not spec.shared_gate:  # DeepSeek's, ERNIE 4.5's: added as they are
            return graph.node("Add", [out, shared], [f"{m}/output"], f"{m}/AddShared")[0]
        gate_w = _np(sd[key + "shared_expert_gate.weight"]).T  # [H, 1]
        opened = graph.node(
            "Sigmoid", [graph.linear(h, gate_w, f"{m}/shared_gate")], [f"{m}/shared_open"], f"{m}/SharedGate"
        )
        shared = graph.node("Mul", [opened[0], shared], [f"{m}/shared"], f"{m}/SharedMul")[0]
        return graph.node("Add", [out, shared], [f"{m}/output"], f"{m}/AddShared")[0]

    def biased_choice(self, logits: str, key: str, m: str) -> str:
        """ERNIE 4.5's choice as logits for MoE's softmax and top k: the top k of
        ``softmax(logits) + e_score_correction_bias`` keep their logits, every other expert gets
        -inf, so MoE picks exactly those k and its softmax weighs them by their probabilities
        renormalised over the k (``moe_norm_min``, the floor of that sum, left out: 1e-12 as
        released, it binds only where the k probabilities sum below it)."""
        graph, spec = self.g, self.spec
        correction = _np(self.sd[key + "moe_statics.e_score_correction_bias"]).reshape(spec.num_experts)
        probs = graph.node("Softmax", [logits], [f"{m}/router_probs"], f"{m}/RouterSoftmax", axis=-1)[0]
        scores = graph.node(
            "Add", [probs, graph.init(f"{m}/e_score_correction_bias", correction)], [f"{m}/scores"], f"{m}/Correct"
        )[0]
        top = graph.init(f"{m}/top_k", np.array([spec.experts_per_token], dtype=np.int64))
        chosen = graph.node("TopK", [scores, top], [f"{m}/top_scores", f"{m}/chosen"], f"{m}/TopK", axis=-1)[1]
        kept = graph.node("GatherElements", [logits, chosen], [f"{m}/chosen_logits"], f"{m}/Kept", axis=-1)[0]
        shape = graph.node("Shape", [logits], [f"{m}/logits_shape"], f"{m}/LogitsShape")[0]
        floor = helper.make_tensor("value", TensorProto.FLOAT, [1], [-np.inf])
        unchosen = graph.node("ConstantOfShape", [shape], [f"{m}/unchosen"], f"{m}/Unchosen", value=floor)[0]
        choice = f"{m}/choice_logits"
        graph.node("ScatterElements", [unchosen, chosen, kept], [choice], f"{m}/Choice", axis=-1)
        return choice

    def expert_weights(self, key: str, m: str) -> tuple[Array, Array, str, str]:
        """The layer's experts as MoE takes them: fc1 ``[E, 2W, H]`` (rows gate_0, up_0, gate_1,
        ...), fc2 ``[E, H, W]``, and the names of their biases (``""``: none; GPT-OSS has them)."""
        graph, sd, spec = self.g, self.sd, self.spec
        width = spec.expert_size
        if key + "experts.fc1.weight" in sd:  # GPT-OSS: [E, H, 2W], gate and up columns interleaved
            fc1 = np.ascontiguousarray(_np(sd[key + "experts.fc1.weight"]).transpose(0, 2, 1))
            fc2 = np.ascontiguousarray(_np(sd[key + "experts.fc2.weight"]).transpose(0, 2, 1))
            b1 = graph.init(f"{m}/experts.fc1.bias", _np(sd[key + "experts.fc1.bias"]))
            b2 = graph.init(f"{m}/experts.fc2.bias", _np(sd[key + "experts.fc2.bias"]))
        else:
            gate_up, down = _stacked_experts(sd, key, spec)  # [E, H, 2W] (gate | up), [E, W, H]
            fc1 = np.stack([gate_up[..., :width], gate_up[..., width:]], axis=-1).reshape(gate_up.shape)
            del gate_up
            fc1 = np.ascontiguousarray(fc1.transpose(0, 2, 1))
            fc2 = np.ascontiguousarray(down.transpose(0, 2, 1))
            b1 = b2 = ""
            if key + "experts.0.gate_proj.bias" in sd:  # ERNIE 4.5's use_bias: fc1's as its rows
                gate_up_b, down_b = _stacked_expert_biases(sd, key, spec)
                b1 = graph.init(f"{m}/experts.fc1.bias", gate_up_b)
                b2 = graph.init(f"{m}/experts.fc2.bias", down_b)
        want = (spec.num_experts, 2 * width, spec.hidden_size), (spec.num_experts, spec.hidden_size, width)
        if (fc1.shape, fc2.shape) != want:
            raise UnsupportedModelError(f"unsupported experts of {key}: {fc1.shape} and {fc2.shape}, need {want}")
        return fc1, fc2, b1, b2

    def experts(self, rows: str, logits: str, key: str, m: str) -> str:
        """The MoE node on ``rows`` ``[N, H]`` routed by ``logits`` ``[N, E]``: ``MoE`` in float32,
        or ``QMoE`` with MatMulNBits' blocks when quantizing and each expert's widths are whole
        blocks."""
        graph, spec = self.g, self.spec
        fc1, fc2, b1, b2 = self.expert_weights(key, m)
        alpha, beta, limit = spec.swiglu or (1.0, 0.0, 0.0)
        attrs: dict[str, Any] = {
            "k": spec.experts_per_token,
            "activation_type": "swiglu",
            "swiglu_fusion": 1,
            "activation_alpha": alpha,
            "activation_beta": beta,
            "normalize_routing_weights": int(spec.norm_topk or spec.router != "softmax_topk"),
        }
        if limit:  # GPT-OSS: gate <= limit, -limit <= up <= limit
            attrs["swiglu_limit"] = limit
        quant = graph.quant
        if quant is None or spec.hidden_size % quant.block_size or spec.expert_size % quant.block_size:
            ins = [rows, logits, graph.init(f"{m}/experts.fc1", fc1), b1, graph.init(f"{m}/experts.fc2", fc2), b2]
            return graph.node("MoE", ins, [f"{m}/experts_rows"], f"{m}/MoE", domain=MS, **attrs)[0]
        fc1_q = _quantized_experts(graph, fc1, f"{m}/experts.fc1")
        fc2_q = _quantized_experts(graph, fc2, f"{m}/experts.fc2")
        del fc1, fc2
        ins = [rows, logits, fc1_q[0], fc1_q[1], b1, fc2_q[0], fc2_q[1], b2]
        if fc1_q[2]:  # asymmetric: the zero points are QMoE's 12th and 13th inputs
            ins += ["", "", "", fc1_q[2], fc2_q[2]]
        graph.grids["requantized"] = graph.grids.get("requantized", 0) + 2
        attrs.update(expert_weight_bits=quant.bits, block_size=quant.block_size, accuracy_level=quant.accuracy_level)
        return graph.node("QMoE", ins, [f"{m}/experts_rows"], f"{m}/QMoE", domain=MS, **attrs)[0]

    def mlp(self, h: str, key: str, m: str) -> str:
        """``down(act(gate(h)) * up(h))``, or ``down(act(up(h)))`` for a plain MLP, with biases
        where the checkpoint has them."""
        graph, sd = self.g, self.sd
        gate = None
        if self.spec.gated:
            gate = graph.linear(h, _np(sd[key + "gate_proj.weight"]).T, f"{m}/gate_proj", self.bias(key + "gate_proj"))
        up = graph.linear(h, _np(sd[key + "up_proj.weight"]).T, f"{m}/up_proj", self.bias(key + "up_proj"))
        act = self.activation(gate if gate is not None else up, m)
        if gate is not None:
            act = graph.node("Mul", [act, up], [f"{m}/act"], f"{m}/Mul")[0]
        return graph.linear(act, _np(sd[key + "down_proj.weight"]).T, f"{m}/down_proj", self.bias(key + "down_proj"))

    def activation(self, x: str, m: str) -> str:
        graph, kind = self.g, self.spec.act
        if kind == "silu":
            sig = graph.node("Sigmoid", [x], [f"{m}/sigmoid"], f"{m}/Sigmoid")[0]
            return graph.node("Mul", [x, sig], [f"{m}/silu"], f"{m}/SiLU")[0]  # ORT: QuickGelu
        if kind in ("gelu", "gelu_tanh"):  # erf, or the tanh approximation (gelu_new, gelu_pytorch_tanh)
            extra = {"approximate": "tanh"} if kind == "gelu_tanh" else {}
            return graph.node("Gelu", [x], [f"{m}/gelu"], f"{m}/Gelu", **extra)[0]
        r = graph.node("Relu", [x], [f"{m}/relu"], f"{m}/Relu")[0]
        if kind == "relu":
            return r
        return graph.node("Mul", [r, r], [f"{m}/relu2"], f"{m}/Square")[0]  # relu2


def _stacked_experts(sd: dict[str, Any], key: str, spec: ModelSpec) -> tuple[Array, Array]:
    """A layer's experts as two stacks: gate | up ``[E, H, 2W]`` and down ``[E, W, H]``, from
    one module per expert (``experts.{j}.gate_proj`` ...) or stacked ones (Granite-MoE's
    ``[E, 2W, H]`` gate then up, ``[E, H, W]``)."""
    if key + "experts.gate_up_proj.weight" in sd:
        gate_up = _np(sd[key + "experts.gate_up_proj.weight"]).transpose(0, 2, 1)
        down = _np(sd[key + "experts.down_proj.weight"]).transpose(0, 2, 1)
    else:
        e = key + "experts."
        gate_up = np.stack(
            [
                np.concatenate([_np(sd[f"{e}{j}.{n}_proj.weight"]).T for n in ("gate", "up")], 1)
                for j in range(spec.num_experts)
            ]
        )
        down = np.stack([_np(sd[f"{e}{j}.down_proj.weight"]).T for j in range(spec.num_experts)])
    want = (
        (spec.num_experts, spec.hidden_size, 2 * spec.expert_size),
        (spec.num_experts, spec.expert_size, spec.hidden_size),
    )
    if (gate_up.shape, down.shape) != want:
        raise UnsupportedModelError(
            f"unsupported experts of {key}: gate/up {gate_up.shape} and down {down.shape}, need {want[0]} and {want[1]}"
        )
    return np.ascontiguousarray(gate_up), np.ascontiguousarray(down)


def _stacked_expert_biases(sd: dict[str, Any], key: str, spec: ModelSpec) -> tuple[Array, Array]:
    """The biases of a layer's experts (one module per expert) as MoE takes them: fc1's
    ``[E, 2W]`` (gate_0, up_0, gate_1, ...: fc1's rows) and fc2's ``[E, H]``."""
    e = key + "experts."
    gate = np.stack([_np(sd[f"{e}{j}.gate_proj.bias"]) for j in range(spec.num_experts)])
    up = np.stack([_np(sd[f"{e}{j}.up_proj.bias"]) for j in range(spec.num_experts)])
    down = np.stack([_np(sd[f"{e}{j}.down_proj.bias"]) for j in range(spec.num_experts)])
    gate_up = np.stack([gate, up], axis=-1).reshape(spec.num_experts, 2 * spec.expert_size)
    return gate_up, down


def _quantized_experts(graph: _Graph, w: Array, name: str) -> tuple[str, str, str]:
    """Stacked expert matrices ``[E, N, K]`` (``y = W x``) quantized as MatMulNBits does each
    (``export.quant``): QMoE's codes ``[E, N, K * bits / 8]``, scales ``[E, N, K / block]`` and
    zero points (``""`` when symmetric) initializers."""
    assert graph.quant is not None
    qs = [quantize(np.ascontiguousarray(w[e].T), graph.quant) for e in range(w.shape[0])]
    codes = graph.init(f"{name}.weight_q", np.stack([q.packed.reshape(q.n, -1) for q in qs]))
    scales = graph.init(f"{name}.scales", np.stack([q.scales.reshape(q.n, -1) for q in qs]).astype(np.float32))
    zeros = ""
    if qs[0].zero_points is not None:
        zeros = graph.init(f"{name}.zero_points", np.stack([np.asarray(q.zero_points).reshape(q.n, -1) for q in qs]))
    return codes, scales, zeros


def _norm_heads(graph: _Graph, qkv: str, sd: dict[str, Any], *, att: str, spec: ModelSpec, name: str) -> str:
    """The norms of queries and keys before rotary (``q_norm``, ``k_norm``) on the fused
    projection ``[1, N, (nh + kv) own + kv d]``: each head (Qwen3's RMSNorm, Gemma 3's with
    ``1 + w``; a LayerNorm: StableLM, Phi-2, Cohere) or the whole projection (OLMo 2), split,
    normed and padded to the graph's head size, joined again ``[1, N, (nh + 2 kv) d]``."""
    own, d, nh, kv = spec.own_head_dim, spec.head_dim, spec.num_heads, spec.num_kv_heads
    sizes = graph.init(f"{name}/qkv_split", np.array([nh * own, kv * own, kv * d], dtype=np.int64))
    q, k, v = graph.node("Split", [qkv, sizes], [f"{name}/q", f"{name}/k", f"{name}/v"], f"{name}/Split", axis=-1)
    normed = []
    for x, part, heads in ((q, "q", nh), (k, "k", kv)):
        w, b = _np(sd[f"{att}{part}_norm.weight"]), sd.get(f"{att}{part}_norm.bias")
        if spec.norm_offset:
            w = w + np.float32(spec.norm_offset)
        bias = None if b is None else _np(b)
        normed.append(_head_norm(graph, x, w, heads=heads, spec=spec, name=f"{name}/{part}_norm", bias=bias))
    return graph.node("Concat", [*normed, v], [f"{name}/qkv_normed"], f"{name}/Concat", axis=-1)[0]


def _head_norm(
    graph: _Graph, x: str, w: Array, *, heads: int, spec: ModelSpec, name: str, bias: Array | None = None
) -> str:
    """The norm of each head of ``x`` ``[1, N, heads * own]`` (RMSNorm: Qwen3; LayerNorm with
    a weight and bias ``[own]`` shared by the heads, or ``[heads, own]`` one a head), or of all of
    it (``spec.qk_norm_full``: OLMo 2's, weight ``[heads * own]``), as ``[1, N, heads * padded]``
    in the layout of ``layout.pad_heads`` (the padding, a MatMul by a 0/1 matrix: every output
    is one input times 1, exactly)."""
    own, padded, full = spec.own_head_dim, spec.head_dim, spec.qk_norm_full
    if full:
        x, _ = graph.rms_norm(x, None, w, name)
        if padded == own:
            return x
    shape = graph.init(f"{name}/head_shape", np.array([0, 0, heads, own], dtype=np.int64))
    out = graph.node("Reshape", [x, shape], [f"{name}/heads"], f"{name}/Heads")[0]
    if spec.qk_layer_norm:
        out = _head_layer_norm(graph, out, w, name=name, bias=bias)
    elif not full:
        out = graph.rms_norm(out, None, w, name)[0]
    if padded != own:
        eye = np.eye(own, dtype=np.float32)
        scatter = pad_heads(eye, 1, own, padded, rotary=spec.rotary, interleaved=spec.rotary_interleaved)
        out = graph.node("MatMul", [out, graph.init(f"{name}/pad", scatter)], [f"{name}/padded"], f"{name}/Pad")[0]
    flat = graph.init(f"{name}/flat_shape", np.array([0, 0, heads * padded], dtype=np.int64))
    return graph.node("Reshape", [out, flat], [f"{name}/flat"], f"{name}/Flat")[0]


def _head_layer_norm(graph: _Graph, rows: str, w: Array, *, name: str, bias: Array | None) -> str:
    """LayerNorm over the last axis of ``rows`` ``[1, N, heads, own]``: one op with a weight
    (and bias) ``[own]``; with one a head (``[heads, own]``), a LayerNorm without, then times
    the weights (plus the biases)."""
    if w.ndim == 1:
        return graph.layer_norm(rows, None, w, bias=bias, name=name)[0]
    normed = graph.layer_norm(rows, None, np.ones(w.shape[-1], np.float32), bias=None, name=name)[0]
    out = graph.node(
        "Mul", [normed, graph.init(f"{name}/head_weights", w)], [f"{name}/weighted"], f"{name}/HeadWeights"
    )[0]
    if bias is None:
        return out
    return graph.node("Add", [out, graph.init(f"{name}/head_biases", bias)], [f"{name}/biased"], f"{name}/HeadBiases")[
        0
    ]


def decoder_io(
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    vocab: int,
    *,
    hidden: int,
    extra_inputs: tuple[onnx.ValueInfoProto, ...] = (),
    packed: bool = True,
    kv_dtype: str = "float32",
) -> tuple[list[onnx.ValueInfoProto], list[onnx.ValueInfoProto]]:
    """The graph inputs / outputs every decoder graph of this exporter has (the manifest's
    names), plus ``extra_inputs`` (value infos). ``packed``: the positions of all rows come
    packed in one row (``input_ids`` ``[1, N]``, ``logits_index`` over the N), with the
    ``PACKED_INPUTS`` that lay them out as rows for attention. ``kv_dtype``: the KV's type."""
    f32, i64, i32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32
    kv_type = TensorProto.FLOAT16 if kv_dtype == "float16" else f32
    vi = helper.make_tensor_value_info
    kv_shape: list[str | int | None] = ["batch_size", kv_heads, "max_cache_length", head_dim]
    inputs = [
        vi("input_ids", i64, ["batch_size", "sequence_length"]),
        *extra_inputs,
        vi("seqlens_k", i32, ["batch_size"]),
        vi("total_sequence_length", i32, []),
        vi("logits_index", i64, ["num_logits"]),
    ]
    if packed:
        inputs += [
            vi("query_seqlens", i32, ["rows"]),
            vi("pad_index", i64, ["padded_positions"]),
            vi("pack_index", i64, ["sequence_length"]),
            vi("padded_shape", i64, [3]),
            vi("position_ids", i64, [1, "sequence_length"]),
            vi("attention_bias", f32, [1, 1, "padded_width", "total_length"]),
        ]
    outputs = [
        vi("logits", f32, ["batch_size", "num_logits", vocab]),
        vi("hidden_states", f32, ["batch_size", "sequence_length", hidden]),
    ]
    for i in range(num_layers):
        for kind in ("key", "value"):
            inputs.append(vi(f"past_key_values.{i}.{kind}", kv_type, kv_shape))
            outputs.append(vi(f"present.{i}.{kind}", kv_type, kv_shape))
    return inputs, outputs


def save_graph(
    graph: _Graph,
    name: str,
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    *,
    path: Path,
    producer: str,
) -> dict[str, Any]:
    """Write the accumulated graph as ``path`` (opset 21 + com.microsoft); returns its stats."""
    built = helper.make_graph(graph.nodes, name, inputs, outputs, initializer=graph.inits)
    proto = helper.make_model(
        built, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)], producer_name=producer
    )
    proto.ir_version = 10
    onnx.save_model(proto, str(path))
    stats: dict[str, Any] = {"nodes": len(graph.nodes), "weights_bytes": graph.data.bytes_written}
    if graph.grids:  # MatMulNBits weights by form: "q4_1" / "q8_0" kept on the source's grid
        stats["weight_forms"] = dict(sorted(graph.grids.items()))
    if graph.scale_dtypes:  # with a float16 scale_dtype: the scale and offset tensors by stored type
        stats["scale_dtypes"] = dict(sorted(graph.scale_dtypes.items()))
    return stats
