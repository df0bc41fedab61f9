"""The embedding table of a quantized export as quantized blocks, gathered by ONNX Runtime's
`com.microsoft.GatherBlockQuantized`: no float32 copy of the table.

`GatherBlockQuantized(data uint8 [V, H * bits / 8], indices, scales [V, H / bs], zero_points)`
returns the rows `(q - zero_point) * scale` in float32: the same blocks, scales and (packed) zero
points as MatMulNBits' `B [V, H / bs, bs * bits / 8]` with K = H and N = V (export.quant), the
same default zero point 2^(bits-1), and the same float arithmetic as `export.quant.dequantize`
(equal to the bit). Only the rank differs (GatherBlockQuantized takes 2-D data, MatMulNBits 3-D),
so a tied table is one run of bytes in the data file read through two initializers of the two
shapes. A source grid with block offsets (Q4_1, Q4_K) adds each row's gathered offsets.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from onnx import NodeProto, TensorProto, helper, numpy_helper

from .grid import find_grid
from .quant import QuantSpec, quantize

__all__ = ["EMBED_TABLE", "quantize_embedding"]

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

    def scales_init(self, name: str, values: np.ndarray, *, offsets: bool = False) -> str: ...


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
    weight = np.ascontiguousarray(table.T)  # [H, V]: K = H, N = V
    grid = find_grid(weight, spec.block_size, spec.grids) if spec.source_grid else None
    bits, block_size = (grid.bits, grid.block_size) if grid else (spec.bits, spec.block_size)
    if not _fits(table.shape[1], block_size):
        return None
    q = grid.q if grid else quantize(weight, spec)
    del weight
    return _Blocks(
        data=g.init("embed_tokens.weight_q", q.packed.reshape(q.n, -1)),
        scales=g.scales_init("embed_tokens.scales", q.scales),
        zero_points=None if q.zero_points is None else g.init("embed_tokens.zero_points", q.zero_points),
        offsets=(
            None
            if grid is None or grid.offsets is None
            else g.scales_init("embed_tokens.offsets", grid.offsets, offsets=True)
        ),
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
