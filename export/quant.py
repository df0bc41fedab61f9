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

from dataclasses import dataclass, replace

import numpy as np

__all__ = [
    "QuantSpec",
    "QuantizedWeight",
    "quantize",
    "dequantize",
    "QUANT_SPECS",
    "DRAFT_GRIDS",
    "SCALE_DTYPES",
    "quant_spec",
    "stored_scales",
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
    scale_dtype: str = "float32"  # "float16": scales and offsets stored in float16 (see `stored_scales`)

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
        if self.scale_dtype != "float32":
            record["scale_dtype"] = self.scale_dtype
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


SCALE_DTYPES = ("float32", "float16")


def quant_spec(name: str, role: str = "target", scale_dtype: str = "float32") -> QuantSpec:
    """The QuantSpec of ``--quantize`` / ``--draft-quant`` ``name`` for a ``role`` model, its
    scales and offsets stored in ``scale_dtype``."""
    spec = replace(QUANT_SPECS[name], scale_dtype=scale_dtype)
    if role == "draft" and spec.source_grid:
        return replace(spec, grids=DRAFT_GRIDS)
    return spec


FLOAT16_SMALLEST_NORMAL = 2.0**-14


def stored_scales(values: np.ndarray, spec: QuantSpec, *, offsets: bool = False) -> np.ndarray:
    """``values`` (a weight's float32 scales, or with ``offsets`` its block offsets) as the
    export stores them: float32, or float16 when ``spec.scale_dtype`` is "float16" and every value
    survives the rounding: finite, and (scales) no nonzero scale below float16's smallest
    normal, where its relative precision would drop. The graph casts a float16 initializer back
    to float32 (folded when the session loads), so the kernels compute with
    ``float32(float16(value))``: MatMulNBits' speed is unchanged, the weights move by at most
    2^-11 of each scale (and offset), and the file holds 16 bits a block instead of 32."""
    values = np.asarray(values, dtype=np.float32)
    if spec.scale_dtype == "float32":
        return values
    with np.errstate(over="ignore"):  # an overflow is an inf, refused below
        half = values.astype(np.float16)
    if not np.isfinite(half).all():
        return values
    if not offsets and ((values != 0) & (np.abs(values) < FLOAT16_SMALLEST_NORMAL)).any():
        return values
    return half


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
