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

llama.cpp's other formats lie on such grids too, with steps that the min and max do not give
(a block need not use its extreme codes):

    Q4_K sub-block of 32:  W = (d sc) c - dmin m,  c in [0, 16)   -> "q4_k": 4 bits + offsets
    Q5_0 block of 32:      W = d (c - 16),         c in [0, 32)   -> "sym8": 8-bit symmetric codes
    Q6_K sub-block of 16:  W = d sc (c - 32),      c in [0, 64)   -> "sym8_16": 8 bits, block 16
    any of these, mixed:   a fused weight (q, k, v)                -> "affine8_16": 8 bits + offsets

There the step is found as the smallest gap between a block's distinct values divided by a
small integer (1..32: the codes a block uses need not include neighbours), the largest such step
that puts every weight on the grid within the same tolerance. Q4_K_M files (Qwen2.5's) are
Q4_K and Q6_K; the Qwen2.5 0.5B file also has Q5_0 and Q8_0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import numpy.typing as npt

from .quant import QuantizedWeight, QuantSpec, _pack_nibbles, dequantize

__all__ = ["GridWeight", "find_grid", "grid_dequantize"]

TOLERANCE = 1e-3  # of a grid step: dequantized sources are on the grid to float32 rounding
ULPS = 8  # ... and what the kernel computes with is within this many ulps of a block's largest weight


@dataclass(frozen=True)
class GridWeight:
    """A weight found on a quantization grid: symmetric MatMulNBits codes + block offsets."""

    form: str  # "q4_1" | "q8_0" | "q4_k" | "sym8" | "sym8_16" | "affine8_16" (the source grid it matches)
    bits: int
    q: QuantizedWeight  # zero_points None: the kernel's default 2^(bits-1)
    offsets: np.ndarray | None  # float32 [n_blocks, N]; None: no offset (symmetric forms)
    block_size: int = 32


def _blocks(weight: np.ndarray, bs: int) -> np.ndarray | None:
    k, n = weight.shape
    if k % bs:
        return None
    return np.ascontiguousarray(weight.T, dtype=np.float32).reshape(n, k // bs, bs)  # [N, nb, bs]


MAX_DIVISOR = 32  # a block's step is its smallest gap (or magnitude) divided by at most this

#: fits(step [b], where [b] block indices) -> bool [b]: whether those blocks lie on those steps
Fits = Callable[[npt.NDArray[np.float64], npt.NDArray[np.intp]], npt.NDArray[np.bool_]]
#: detect(weight [K, n], blocks [n, nb, bs]) -> the weight on one form's grid, or None
Detect = Callable[[np.ndarray, np.ndarray], "GridWeight | None"]


def _steps(smallest: np.ndarray, fits: Fits, divisors: int = MAX_DIVISOR) -> np.ndarray | None:
    """Per block, the largest step ``smallest / m`` (m = 1..divisors) for which
    ``fits(step [b], where [b] block indices) -> bool [b]`` holds; None if some block has none.
    Each try looks only at the blocks still without a step."""
    flat = smallest.reshape(-1)
    step = np.full(flat.shape, np.nan, dtype=np.float64)
    todo = np.arange(flat.size)
    for m in range(1, divisors + 1):
        if todo.size == 0:
            break
        cand = flat[todo] / m
        ok = fits(cand, todo)
        step[todo[ok]] = cand[ok]
        todo = todo[~ok]
    return None if todo.size else step.reshape(smallest.shape)


def _on_steps(values: np.ndarray, step: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Codes ``rint(values / step)`` and whether every value of a block is within TOLERANCE of
    a step of them (``values`` [..., bs], ``step`` [...])."""
    with np.errstate(invalid="ignore", divide="ignore"):
        codes = np.rint(values / step[..., None])
        off = np.abs(codes * step[..., None] - values).max(axis=-1) / step
    return codes, np.nan_to_num(off, nan=np.inf) <= TOLERANCE


def _affine(blocks: np.ndarray, k: int, bits: int, spanning: bool = False) -> GridWeight | None:
    """Affine blocks ``W = d c + m``: symmetric codes + a float offset per block. ``spanning``:
    Q4_1's blocks, whose codes span [0, 16), so (max - min) / 15 is the step; else blocks whose
    codes need not (Q4_K at 4 bits; at 8 bits any of these forms, e.g. a fused weight whose
    columns come from Q4_K and Q6_K tensors), the step from the smallest gap."""
    top = (1 << bits) - 1
    half = 1 << (bits - 1)
    lo, hi = blocks.min(axis=2), blocks.max(axis=2)  # [N, nb]
    span = (hi - lo).astype(np.float64)
    if spanning:
        smallest = span / top
    else:
        gaps = np.diff(np.sort(blocks, axis=2), axis=2).astype(np.float64)  # [N, nb, bs - 1]
        gaps[gaps <= span[..., None] * 1e-6] = np.inf  # equal values (to float rounding) are one value
        smallest = gaps.min(axis=2)
    flat = ~np.isfinite(smallest) | (
        span == 0
    )  # a constant block: code `half` (zero weight part), the value in the offset
    smallest[flat] = 1.0
    shifted = (blocks - lo[..., None]).astype(np.float64).reshape(-1, blocks.shape[2])  # [blocks, bs]
    flat_rows = flat.reshape(-1)

    def fits(step: npt.NDArray[np.float64], where: npt.NDArray[np.intp]) -> npt.NDArray[np.bool_]:
        codes, ok = _on_steps(shifted[where], step)
        fit: npt.NDArray[np.bool_] = ok & (codes.max(axis=-1) <= top) | flat_rows[where]
        return fit

    step = _steps(smallest, fits, 1 if spanning else MAX_DIVISOR)
    if step is None:
        return None
    step[flat] = 1.0
    codes, _ = _on_steps(shifted.reshape(blocks.shape), step)
    # code `centre` is the kernel's zero point: the offset is the block's middle value, not a
    # point far outside it whose float32 rounding would cost several ulps of every weight
    centre = np.full(step.shape, half, dtype=np.float64) if bits == 4 else np.floor((codes.max(axis=2) + 1) / 2)
    codes = codes + (half - centre)[..., None]  # [N, nb, bs] in 0 .. top
    codes[flat] = float(half)
    offsets = np.where(flat, lo, lo + centre * step).T.astype(np.float32)  # [nb, N]
    codes = codes.astype(np.uint8)
    q = QuantizedWeight(_pack_nibbles(codes) if bits == 4 else codes, step.astype(np.float32), None, k, blocks.shape[0])
    bs = blocks.shape[2]
    form = ("q4_1" if spanning else "q4_k") if bits == 4 else "affine8" + ("" if bs == 32 else f"_{bs}")
    return GridWeight(form, bits, q, np.ascontiguousarray(offsets), bs)


def _sym8(blocks: np.ndarray, k: int, bs: int, spanning: bool = False) -> GridWeight | None:
    """Symmetric blocks ``W = d c`` with integer c in [-127, 127]: 8-bit MatMulNBits codes
    ``c + 128``. ``spanning``: Q8_0's blocks, whose step is max|w| / 127 (our int8 form); else any
    d (Q5_0, Q6_K), from the smallest magnitude."""
    mags = np.abs(blocks).astype(np.float64)  # [N, nb, bs]
    if spanning:
        smallest = mags.max(axis=2) / 127
        smallest[smallest == 0] = np.inf
    else:
        nonzero = np.where(mags > mags.max(axis=2, keepdims=True) * 1e-6, mags, np.inf)
        smallest = nonzero.min(axis=2)
    zero = ~np.isfinite(smallest)  # an all-zero block
    smallest[zero] = 1.0
    values = blocks.astype(np.float64).reshape(-1, blocks.shape[2])  # [blocks, bs]
    zero_rows = zero.reshape(-1)

    def fits(step: npt.NDArray[np.float64], where: npt.NDArray[np.intp]) -> npt.NDArray[np.bool_]:
        codes, ok = _on_steps(values[where], step)
        fit: npt.NDArray[np.bool_] = ok & (np.abs(codes).max(axis=-1) <= 127) | zero_rows[where]
        return fit

    step = _steps(smallest, fits, 1 if spanning else MAX_DIVISOR)
    if step is None:
        return None
    step[zero] = 1.0
    codes, _ = _on_steps(values.reshape(blocks.shape), step)
    codes[zero] = 0.0
    q = QuantizedWeight((codes + 128).astype(np.uint8), step.astype(np.float32), None, k, blocks.shape[0])
    form = "q8_0" if spanning else "sym8" if bs == 32 else f"sym8_{bs}"
    return GridWeight(form, 8, q, None, bs)


PROBE_COLUMNS = 64  # a form is tried on this many output columns first (a miss is then cheap)
CHUNK_ELEMENTS = 1 << 23  # ... then on the whole weight about this many weights at a time (memory bounded)


def _detectors(block_size: int) -> list[tuple[str, int, Detect]]:
    """(form, block size, detect(weight [K, n], blocks [n, nb, bs]) -> GridWeight | None), in order."""
    sym = "sym8" if block_size == 32 else f"sym8_{block_size}"
    return [
        ("q8_0", block_size, lambda w, b: _sym8(b, w.shape[0], block_size, spanning=True)),
        ("q4_1", block_size, lambda w, b: _affine(b, w.shape[0], 4, spanning=True)),
        ("q4_k", block_size, lambda w, b: _affine(b, w.shape[0], 4)),
        (sym, block_size, lambda w, b: _sym8(b, w.shape[0], block_size)),
        ("sym8_16", 16, lambda w, b: _sym8(b, w.shape[0], 16)),
        ("affine8_16", 16, lambda w, b: _affine(b, w.shape[0], 8)),
    ]


def find_grid(weight: np.ndarray, block_size: int = 32, forms: tuple[str, ...] | None = None) -> GridWeight | None:
    """``weight`` float32 [K, N] (the right operand of ``x @ W``) as Q8_0 or Q4_1 blocks along
    K, else as Q4_K's affine 4-bit or a symmetric 8-bit grid (Q5_0) in the same blocks, else as
    symmetric 8-bit blocks of 16 (Q6_K), else as affine 8-bit blocks of 16 (columns from several
    of these forms); None when it lies on no grid (or K is not a multiple of the block). One
    form for the whole weight: the first that every block fits (of ``forms``; None: any)."""
    n = weight.shape[1]
    if not np.isfinite(weight).all():  # NaN / inf compare false everywhere: on no grid, whatever a test says
        return None
    for form, bs, detect in _detectors(block_size):
        if bs > block_size or (forms is not None and form not in forms):
            continue

        def on(cols: slice, bs: int = bs, detect: Detect = detect) -> GridWeight | None:
            part = np.ascontiguousarray(weight[:, cols])
            blocks = _blocks(part, bs)
            found = None if blocks is None else detect(part, blocks)
            if found is not None and not (
                np.isfinite(found.q.scales).all() and (found.offsets is None or np.isfinite(found.offsets).all())
            ):
                return None  # a float32 overflow (weights near its limit): not carried over
            return found if found is None or _faithful(part, found) else None

        if on(slice(0, PROBE_COLUMNS)) is None:
            continue
        parts: list[GridWeight] = []
        cols = max(1, CHUNK_ELEMENTS // max(1, weight.shape[0]))
        for start in range(0, n, cols):
            part = on(slice(start, start + cols))
            if part is None or (parts and part.form != parts[0].form):
                break
            parts.append(part)
        else:
            return _joined(parts)
    return None


def _faithful(weight: np.ndarray, g: GridWeight) -> bool:
    """Weights that share a code in a block are equal. A source's blocks compute each weight
    from its code and the block's scale(s) alone, so equal codes give bit-equal weights; the
    tolerance (a fraction of a step) alone would let a block with one huge outlier put every
    small weight on code 0 of a huge step: "found", and not carried over at all."""
    back = _blocks(grid_dequantize(g), g.block_size)  # [n, nb, bs] what the kernel computes with
    orig = _blocks(weight, g.block_size)
    if back is None or orig is None:  # K is not a multiple of the block: never on a grid
        return False
    # and every weight within a few float32 ulps of its block's largest (the tolerance of a
    # fraction of a step let a weight sitting alone on its code be 1e-3 of a step off)
    bound = ULPS * np.finfo(np.float32).eps * np.abs(orig).max(axis=2)  # [n, nb]
    if not (np.abs(back - orig).max(axis=2) <= bound).all():
        return False
    order = np.argsort(back, axis=2, kind="stable")
    b, o = np.take_along_axis(back, order, axis=2), np.take_along_axis(orig, order, axis=2)
    same = np.diff(b, axis=2) == 0  # [n, nb, bs - 1] neighbours on one code
    return bool((np.diff(o, axis=2)[same] == 0).all())


def _joined(parts: list[GridWeight]) -> GridWeight:
    """One weight from column chunks of the same form."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    q = QuantizedWeight(
        np.concatenate([p.q.packed for p in parts]),
        np.concatenate([p.q.scales for p in parts]),
        None,
        first.q.k,
        sum(p.q.n for p in parts),
    )
    offsets = (
        None if first.offsets is None else np.ascontiguousarray(np.concatenate([p.offsets for p in parts], axis=1))
    )
    return GridWeight(first.form, first.bits, q, offsets, first.block_size)


def grid_dequantize(g: GridWeight) -> np.ndarray:
    """float32 [K, N]: exactly the weight MatMulNBits (+ offsets) computes with."""
    w = dequantize(g.q, QuantSpec(bits=g.bits, symmetric=True))  # [K, N], the kernel's zero point
    if g.offsets is not None:
        w = w + np.repeat(g.offsets, w.shape[0] // g.offsets.shape[0], axis=0)  # [K, N]: o per block
    return np.ascontiguousarray(w, dtype=np.float32)
