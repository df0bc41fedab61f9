"""Keep a quantized source's own grid: MatMulNBits weights equal to the dequantized source.

A GGUF source is already quantized: SmolLM2's file stores every layer MatMul as Q4_1 blocks
(``w = d * c + m``, c in [0, 16), d and m per 32 weights along K) and the tied embedding as Q8_0
(``w = d * c``, c in [-127, 127]). transformers dequantizes them to float32, and quantizing
*that* again on another grid adds a second rounding on top of the first: our generic int4
(min/max with 0 representable, integer zero points) agreed with the float32 model on only 67%
of greedy tokens. Found on its own grid, a weight is carried over exactly:

    Q4_1 block:  W[k, n] = (c - 8) * d + o        o = m + 8 d          (o: one float per block)
    Q8_0 block:  W[k, n] = c * d                                       (8-bit symmetric codes)

MatMulNBits computes the ``(c - 8) * d`` part (symmetric: its default zero point); the offsets
add ``sum_{k in block} x_k * o_block``, i.e. ``ReduceSum(x in blocks of 32) @ O`` with
``O [K / 32, N]`` in float32, one extra float per 32 weights. The grid is found from the float
weights alone (per block: the min is the offset, (max - min) / 15 the step, every weight within
1e-3 of a step of the grid), so any source whose weights lie on such a grid keeps it; a weight
that does not is quantized as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .quant import QuantizedWeight, QuantSpec, _pack_nibbles, dequantize, quantize

__all__ = ["GridWeight", "find_grid", "grid_dequantize"]

TOLERANCE = 1e-3  # of a grid step: dequantized sources are on the grid to float32 rounding


@dataclass(frozen=True)
class GridWeight:
    """A weight found on a quantization grid: symmetric MatMulNBits codes + block offsets."""

    form: str  # "q4_1" | "q8_0" (the source grid it matches)
    bits: int
    q: QuantizedWeight  # zero_points None: the kernel's default 2^(bits-1)
    offsets: np.ndarray | None  # float32 [n_blocks, N]; None: no offset (Q8_0)


def _blocks(weight: np.ndarray, bs: int) -> np.ndarray | None:
    k, n = weight.shape
    if k % bs:
        return None
    return np.ascontiguousarray(weight.T, dtype=np.float32).reshape(n, k // bs, bs)  # [N, nb, bs]


def _q8_0(weight: np.ndarray, blocks: np.ndarray, bs: int) -> GridWeight | None:
    """Q8_0 is our int8 symmetric form (``max|w| / 127`` per block): quantize, keep if lossless."""
    spec = QuantSpec(bits=8, block_size=bs, symmetric=True)
    q = quantize(weight, spec)
    back = dequantize(q, spec).T.reshape(blocks.shape)  # [N, nb, bs]
    if (np.abs(back - blocks).max(axis=2) / q.scales).max() > TOLERANCE:
        return None
    return GridWeight("q8_0", 8, q, None)


def _q4_1(blocks: np.ndarray, k: int) -> GridWeight | None:
    lo, hi = blocks.min(axis=2), blocks.max(axis=2)  # [N, nb]
    step = (hi - lo) / 15
    flat = step == 0  # a constant block: code 8 (zero weight part), the value in the offset
    step[flat] = 1.0
    codes = np.rint((blocks - lo[..., None]) / step[..., None])
    codes[flat] = 8.0
    back = (codes - 8) * step[..., None] + (lo + 8 * step)[..., None]
    back[flat] = lo[flat][:, None]
    if (np.abs(back - blocks).max(axis=2) / step).max() > TOLERANCE:
        return None
    offsets = np.where(flat, lo, lo + 8 * step).T.astype(np.float32)  # [nb, N]
    q = QuantizedWeight(_pack_nibbles(codes.astype(np.uint8)), step.astype(np.float32), None,
                        k, blocks.shape[0])
    return GridWeight("q4_1", 4, q, np.ascontiguousarray(offsets))


def find_grid(weight: np.ndarray, block_size: int = 32) -> GridWeight | None:
    """``weight`` float32 [K, N] (the right operand of ``x @ W``) as Q8_0 or Q4_1 blocks along
    K, or None when it lies on neither grid (or K is not a multiple of the block)."""
    blocks = _blocks(weight, block_size)
    if blocks is None:
        return None
    k = weight.shape[0]
    return _q8_0(weight, blocks, block_size) or _q4_1(blocks, k)


def grid_dequantize(g: GridWeight) -> np.ndarray:
    """float32 [K, N]: exactly the weight MatMulNBits (+ offsets) computes with."""
    w = dequantize(g.q, QuantSpec(bits=g.bits, symmetric=True))  # [K, N], the kernel's zero point
    if g.offsets is not None:
        w = w + np.repeat(g.offsets, w.shape[0] // g.offsets.shape[0], axis=0)  # [K, N]: o per block
    return np.ascontiguousarray(w, dtype=np.float32)
