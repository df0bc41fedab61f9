"""Block-wise weight quantization for ONNX Runtime's `com.microsoft.MatMulNBits`, in numpy.

`MatMulNBits(A, B, scales, zero_points)` computes `A @ W` for `A [..., K]` and a weight
`W [K, N]` stored column-major in blocks of `block_size` along K:

    B            uint8 [N, n_blocks, block_size * bits / 8]   packed codes q in [0, 2^bits)
    scales       float [N, n_blocks]
    zero_points  uint8 [N, ceil(n_blocks * bits / 8)]         packed like B (two per byte at 4 bits)
    W[k, n] ~= (q[n, k] - zero_point[n, k // block_size]) * scale[n, k // block_size]

4-bit codes are packed low nibble first. Quantization is asymmetric (min/max of each block,
with 0 always representable, as ONNX Runtime's own quantizer does): slightly more accurate than
symmetric at the same size. `dequantize` returns exactly what the kernel reconstructs, so tests
and validation can compare against it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
from onnx import NodeProto, TensorProto, helper, numpy_helper

__all__ = [
    "QuantSpec",
    "QuantizedWeight",
    "quantize",
    "dequantize",
    "QUANT_SPECS",
    "DRAFT_GRIDS",
    "quant_spec",
    "quantize_embedding",
    "EMBED_TABLE",
]


@dataclass(frozen=True)
class QuantSpec:
    """How to quantize every MatMul weight: bit width, block size, ORT accuracy level."""

    bits: int
    block_size: int = 32
    accuracy_level: int = 4  # 4 = int8 activations in the CPU kernel (the fast path)
    symmetric: bool = False  # True: scale = max|w| / (2^(bits-1) - 1), no zero points (ORT's default 2^(bits-1))
    source_grid: bool = False  # True: a weight already on a llama.cpp grid keeps it (export.grid)
    grids: tuple[str, ...] | None = None  # with source_grid: the forms kept (None: every one export.grid finds)

    def manifest(self) -> dict[str, object]:
        """The manifest's `onnx.quantization` record."""
        record: dict[str, object] = {
            "method": "MatMulNBits",
            "bits": self.bits,
            "block_size": self.block_size,
            "accuracy_level": self.accuracy_level,
            "symmetric": self.symmetric,
        }
        if self.source_grid:
            record["source_grid"] = True
            if self.grids is not None:
                record["grids"] = list(self.grids)
        return record


# Measured on SmolLM2-135M (2 cores, AVX-512 VNNI; step time vs the float32 graph, and top-1
# agreement with it teacher-forced over 8 chat prompts x 64 tokens):
#   int8 block 32 symmetric 0.44x, 0.971 | asymmetric 0.48x, 0.969 | block 128 sym 0.45x, 0.935
#   int8 accuracy level 0 (float activations) 7.9x slower | per-channel DynamicQuantizeMatMul 0.32x
#   but 0.585 (activations quantized per tensor) | int4 block 32 asymmetric 0.38x, 0.674 |
#   symmetric 0.37x, 0.630 | block 128 sym 0.34x, 0.568. Block 32 with int8 activations per block
#   (accuracy level 4) is the fast path that keeps the model; int8 symmetric is llama.cpp's Q8_0.
#   int4 now keeps a source's own grid where a weight lies on one (SmolLM2's GGUF is Q4_1, its LM
#   head Q8_0): 0.972, the int8 figure; see export.grid. The block 32 asymmetric form is for the rest.
QUANT_SPECS = {"int4": QuantSpec(bits=4, source_grid=True), "int8": QuantSpec(bits=8, symmetric=True)}
# A draft model pays for every bit it reads on every draft step, and its exactness matters only
# through its acceptance: an int4 draft keeps only the grids that cost no more than 4 bits (and
# Q8_0, as before). Qwen2.5-Coder 0.5B (Q5_0 / Q6_K / Q4_K / Q8_0) with every grid kept, 8 bits
# for most weights: a step 1.22x dearer (29.9 against 24.6 ms), acceptance 0.59 against 0.57 on
# the float32 1.5B target, 1.95x against 2.16x its plain decoding (8 coding prompts, 2026-12-02).
DRAFT_GRIDS = ("q8_0", "q4_1", "q4_k")


def quant_spec(name: str, role: str = "target") -> QuantSpec:
    """The QuantSpec of ``--quantize`` / ``--draft-quant`` ``name`` for a ``role`` model."""
    spec = QUANT_SPECS[name]
    if role == "draft" and spec.source_grid:
        return replace(spec, grids=DRAFT_GRIDS)
    return spec


@dataclass(frozen=True)
class QuantizedWeight:
    """The three MatMulNBits initializers for one `W [K, N]`."""

    packed: np.ndarray  # uint8 [N, n_blocks, block_size * bits // 8]
    scales: np.ndarray  # float32 [N, n_blocks]
    zero_points: np.ndarray | None  # uint8 [N, ceil(n_blocks * bits / 8)]; None: symmetric
    k: int
    n: int


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Pack 4-bit codes along the last axis (even length), low nibble first."""
    packed: np.ndarray = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return packed


def quantize(weight: np.ndarray, spec: QuantSpec) -> QuantizedWeight:
    """Quantize `weight` float32 [K, N] (the right operand of `x @ W`) block-wise along K."""
    k, n = weight.shape
    bs, bits = spec.block_size, spec.bits
    n_blocks = -(-k // bs)
    qmax = (1 << bits) - 1
    # [N, n_blocks, bs]: column n's K values, zero-padded to whole blocks
    wt = np.zeros((n, n_blocks * bs), dtype=np.float32)
    wt[:, :k] = weight.T
    blocks = wt.reshape(n, n_blocks, bs)
    if spec.symmetric:  # codes - 2^(bits-1) in [-(2^(bits-1) - 1), 2^(bits-1) - 1]
        half = 1 << (bits - 1)
        scales = np.abs(blocks).max(axis=2) / (half - 1)  # [N, n_blocks]
        scales[scales == 0] = 1.0
        zp = np.full(scales.shape, half, dtype=np.uint8)
    else:
        lo = np.minimum(blocks.min(axis=2), 0.0)  # [N, n_blocks]; 0 must stay representable
        hi = np.maximum(blocks.max(axis=2), 0.0)
        scales = (hi - lo) / qmax
        scales[scales == 0] = 1.0
        zp = np.clip(np.rint(-lo / scales), 0, qmax).astype(np.uint8)  # [N, n_blocks]
    codes = np.clip(np.rint(blocks / scales[..., None]) + zp[..., None], 0, qmax).astype(np.uint8)
    if bits == 4:
        packed = _pack_nibbles(codes)  # [N, n_blocks, bs / 2]
        zp_pad = np.zeros((n, n_blocks + (n_blocks & 1)), dtype=np.uint8)
        zp_pad[:, :n_blocks] = zp
        zp_packed = _pack_nibbles(zp_pad)  # [N, ceil(n_blocks / 2)]
    elif bits == 8:
        packed, zp_packed = codes, zp
    else:
        raise ValueError(f"unsupported bit width {bits}")
    return QuantizedWeight(packed, scales.astype(np.float32), None if spec.symmetric else zp_packed, k, n)


def dequantize(q: QuantizedWeight, spec: QuantSpec) -> np.ndarray:
    """Reconstruct float32 [K, N] exactly as the MatMulNBits kernel reads the weight."""
    n, n_blocks, _ = q.packed.shape
    zp: np.ndarray | None = None  # None: symmetric
    if spec.bits == 4:
        codes = np.stack([q.packed & 0x0F, q.packed >> 4], axis=-1).reshape(n, n_blocks, -1)
        if q.zero_points is not None:
            zp = np.stack([q.zero_points & 0x0F, q.zero_points >> 4], axis=-1).reshape(n, -1)
            zp = zp[:, :n_blocks]
    else:
        codes, zp = q.packed, q.zero_points
    if zp is None:  # ORT's default zero point
        zp = np.full((n, n_blocks), 1 << (spec.bits - 1), dtype=np.uint8)
    w = (codes.astype(np.float32) - zp[..., None].astype(np.float32)) * q.scales[..., None]
    return np.ascontiguousarray(w.reshape(n, -1)[:, : q.k].T)  # [K, N]


# -- the embedding table as quantized blocks --------------------------------------------------
#
# com.microsoft.GatherBlockQuantized(data uint8 [V, H * bits / 8], indices, scales [V, H / bs],
# zero_points) returns the rows (q - zero_point) * scale in float32: the same blocks, scales and
# (packed) zero points as MatMulNBits' B [V, H / bs, bs * bits / 8] with K = H and N = V, the
# same default zero point 2^(bits-1), and the same float arithmetic as `dequantize` (equal to the
# bit). Only the rank differs (GatherBlockQuantized takes 2-D data, MatMulNBits 3-D), so a tied
# table is one run of bytes in the data file read through two initializers of the two shapes.

EMBED_TABLE = "embed_tokens.weight"  # the float32 table's name in the graph (the Gather's input)
HEAD_NODE = "/lm_head/MatMulNBits"
HEAD_OFFSETS_NODE = "/lm_head/Offsets"
MS_DOMAIN = "com.microsoft"


class GraphParts(Protocol):
    """What the embedding pass reads and writes of a graph under construction (export.graph)."""

    nodes: list[NodeProto]
    inits: list[TensorProto]
    quant: QuantSpec | None

    def init(self, name: str, array: np.ndarray) -> str: ...


@dataclass(frozen=True, kw_only=True)
class _Blocks:
    """A table's quantized form in the graph: initializer names and the kernel's attributes."""

    data: str  # uint8 [V, H * bits / 8]
    scales: str  # float32 [V, H / block_size]
    zero_points: str | None  # packed as data; None: the default 2^(bits-1)
    offsets: str | None  # float32 [H / block_size, V]: added to each block (source grids), or None
    bits: int
    block_size: int
    tied: bool  # the LM head's blocks
    grid: str | None = None  # the source grid the table lies on (export.grid), if found here

    def record(self) -> dict[str, object]:
        """What the stats (and docs) say of the table."""
        record: dict[str, object] = {"op": "GatherBlockQuantized", "bits": self.bits, "block_size": self.block_size}
        record |= {"zero_points": self.zero_points is not None, "offsets": self.offsets is not None, "tied": self.tied}
        return record | ({"grid": self.grid} if self.grid else {})


def quantize_embedding(g: GraphParts, table: np.ndarray, head: np.ndarray | None) -> dict[str, object]:
    """Replace the graph's ``Gather(embed_tokens.weight, ids)`` with GatherBlockQuantized.

    ``table`` float32 [V, H] is the embedding; ``head`` the LM head's [V, H] rows (None: none).
    When they are equal (tied embeddings) the rows are read from the LM head's own MatMulNBits
    blocks, stored once; else the table is quantized as a MatMulNBits weight would be (its
    source grid kept where it lies on one). A table whose rows do not split into whole blocks
    the kernel takes (a power of two >= 16 dividing H) is written in float32 as before. Call
    after the LM head is built and before the graph is saved; returns what was done.
    """
    index = next(i for i, n in enumerate(g.nodes) if n.op_type == "Gather" and n.input[0] == EMBED_TABLE)
    gather = g.nodes[index]
    tied = head is not None and head.shape == table.shape and (head is table or np.array_equal(head, table))
    blocks = _head_blocks(g, table.shape) if tied else None
    if blocks is None and g.quant is not None:
        blocks = _own_blocks(g, table, g.quant)
    if blocks is None:
        g.init(EMBED_TABLE, table)
        return {"op": "Gather", "dtype": "float32"}
    g.nodes[index : index + 1] = _gather_nodes(g, blocks, ids=gather.input[1], out=gather.output[0])
    return blocks.record()


def _fits(width: int, block_size: int) -> bool:
    """GatherBlockQuantized takes blocks of a power of two >= 16 that divide the row."""
    return block_size >= 16 and block_size & (block_size - 1) == 0 and width % block_size == 0


def _head_blocks(g: GraphParts, shape: tuple[int, ...]) -> _Blocks | None:
    """The LM head's MatMulNBits blocks, the packed codes aliased as [V, H * bits / 8]."""
    node = next((n for n in g.nodes if n.name == HEAD_NODE and n.op_type == "MatMulNBits"), None)
    if node is None:
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    vocab, width = shape
    if (attrs["N"], attrs["K"]) != (vocab, width) or not _fits(width, attrs["block_size"]):
        return None
    return _Blocks(
        data=_alias(g, node.input[1], "lm_head.weight_rows", [vocab, width * attrs["bits"] // 8]),
        scales=node.input[2],
        zero_points=node.input[3] if len(node.input) > 3 and node.input[3] else None,
        offsets=next((n.input[1] for n in g.nodes if n.name == HEAD_OFFSETS_NODE), None),
        bits=attrs["bits"],
        block_size=attrs["block_size"],
        tied=True,
    )


def _alias(g: GraphParts, name: str, alias: str, dims: list[int]) -> str:
    """A second initializer ``alias`` of shape ``dims`` over initializer ``name``'s bytes (the
    same run of the external data file, or a reshaped copy of a small inline tensor)."""
    source = next(t for t in g.inits if t.name == name)
    if source.data_location == TensorProto.EXTERNAL:
        view = copy.deepcopy(source)
        view.name = alias
        del view.dims[:]
        view.dims.extend(dims)
        g.inits.append(view)
        return alias
    return g.init(alias, numpy_helper.to_array(source).reshape(dims))


def _own_blocks(g: GraphParts, table: np.ndarray, spec: QuantSpec) -> _Blocks | None:
    """``table`` quantized as MatMulNBits would quantize the weight ``table.T``, written as the
    embedding's own initializers."""
    from .grid import find_grid  # export.grid builds on this module

    weight = np.ascontiguousarray(table.T)  # [H, V]: K = H, N = V
    grid = find_grid(weight, spec.block_size, spec.grids) if spec.source_grid else None
    bits, block_size = (grid.bits, grid.block_size) if grid else (spec.bits, spec.block_size)
    if not _fits(table.shape[1], block_size):
        return None
    q = grid.q if grid else quantize(weight, spec)
    del weight
    return _Blocks(
        data=g.init("embed_tokens.weight_q", q.packed.reshape(q.n, -1)),
        scales=g.init("embed_tokens.scales", q.scales),
        zero_points=None if q.zero_points is None else g.init("embed_tokens.zero_points", q.zero_points),
        offsets=None if grid is None or grid.offsets is None else g.init("embed_tokens.offsets", grid.offsets),
        bits=bits,
        block_size=block_size,
        tied=False,
        grid=grid.form if grid else None,
    )


def _gather_nodes(g: GraphParts, blocks: _Blocks, *, ids: str, out: str) -> list[NodeProto]:
    """GatherBlockQuantized of ``ids``' rows (``[B, S]``) into ``out`` ``[B, S, H]``, plus each
    block's gathered offset where the blocks have offsets: ``(q - z) * d + o``, the weight that
    MatMulNBits + offsets computes with."""
    inputs = [blocks.data, ids, blocks.scales] + ([blocks.zero_points] if blocks.zero_points else [])
    codes = out if blocks.offsets is None else "/embed/codes"
    attrs = {"bits": blocks.bits, "block_size": blocks.block_size, "gather_axis": 0, "quantize_axis": 1}
    make = helper.make_node
    gather = make("GatherBlockQuantized", inputs, [codes], "/embed/GatherBlockQuantized", domain=MS_DOMAIN)
    gather.attribute.extend(helper.make_attribute(key, value) for key, value in attrs.items())
    nodes = [gather]
    if blocks.offsets is None:
        return nodes
    axis = g.init("/embed/last_axis", np.array([-1], np.int64))
    block_shape = g.init("/embed/block_shape", np.array([0, 0, -1, blocks.block_size], np.int64))
    row_shape = g.init("/embed/row_shape", np.array([0, 0, -1], np.int64))
    return nodes + [
        make("Gather", [blocks.offsets, ids], ["/embed/offsets_t"], "/embed/GatherOffsets", axis=1),  # [nb, B, S]
        make("Unsqueeze", ["/embed/offsets_t", axis], ["/embed/offsets_u"], "/embed/OffsetsAxis"),
        make("Transpose", ["/embed/offsets_u"], ["/embed/offsets"], "/embed/OffsetsRows", perm=[1, 2, 0, 3]),
        make("Reshape", [codes, block_shape], ["/embed/blocks"], "/embed/Blocks"),  # [B, S, nb, bs]
        make("Add", ["/embed/blocks", "/embed/offsets"], ["/embed/shifted"], "/embed/AddOffsets"),
        make("Reshape", ["/embed/shifted", row_shape], [out], "/embed/Rows"),
    ]
