"""Weights already on a GGUF grid (Q4_1 / Q8_0, and Q4_K / Q5_0 / Q6_K) keep it in the int4
export (export.grid): found from the float weights alone, carried over exactly, and computed
exactly by MatMulNBits plus the block offsets; anything else is requantized as before."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
gguf = pytest.importorskip("gguf")

from linear_graph import linear_session  # noqa: E402

from export.grid import find_grid, grid_dequantize  # noqa: E402
from export.quant import QuantSpec  # noqa: E402

pytestmark = pytest.mark.export
Q = gguf.GGMLQuantizationType


def _on_grid(kind, k=96, n=40, seed=0):
    """A float32 [K, N] weight as a GGUF file holds it: quantized rows of K, dequantized."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return gguf.quants.dequantize(gguf.quants.quantize(w, kind), kind).astype(np.float32).T.copy()


def _k_quant(kind, k=256, n=24, seed=0):
    """A float32 [K, N] weight dequantized from random K-quant blocks (gguf-py quantizes no
    K-quants, but its dequantization is llama.cpp's): random codes and scales, sane d / dmin."""
    rng = np.random.default_rng(seed)
    per, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(n, k // per, size), dtype=np.uint8)
    d = rng.uniform(1e-3, 4e-3, size=raw.shape[:2]).astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    if kind == Q.Q4_K:  # d, dmin, 12 bytes of 6-bit scales and mins, 128 of 4-bit codes
        raw[..., 0:2], raw[..., 2:4] = d, d
    else:  # Q6_K: 128 + 64 bytes of 6-bit codes, 16 int8 scales, d
        raw[..., 208:210] = d
    return gguf.quants.dequantize(raw.reshape(n, -1), kind).astype(np.float32).T.copy()


@pytest.mark.parametrize(
    "kind,form,bits,block",
    [
        (Q.Q4_1, "q4_1", 4, 32),
        (Q.Q8_0, "q8_0", 8, 32),
        (Q.Q5_0, "sym8", 8, 32),
        (Q.Q4_K, "q4_k", 4, 32),
        (Q.Q6_K, "sym8_16", 8, 16),
    ],
)
def test_a_gguf_grid_is_found_and_carried_over_exactly(kind, form, bits, block):
    w = _k_quant(kind) if kind in (Q.Q4_K, Q.Q6_K) else _on_grid(kind)
    g = find_grid(w)
    assert g is not None and (g.form, g.bits, g.block_size) == (form, bits, block)
    np.testing.assert_allclose(grid_dequantize(g), w, rtol=0, atol=1e-6 * np.abs(w).max())


def test_a_fused_weight_of_several_grids_keeps_them_on_8_bits():
    """q, k and v fused in one MatMul from Q4_K and Q6_K tensors: one affine 8-bit grid of 16."""
    w = np.concatenate([_k_quant(Q.Q4_K, n=40), _k_quant(Q.Q4_K, n=8, seed=1), _k_quant(Q.Q6_K, n=8, seed=2)], axis=1)
    g = find_grid(w)
    assert g is not None and (g.form, g.bits, g.block_size) == ("affine8_16", 8, 16)
    np.testing.assert_allclose(grid_dequantize(g), w, rtol=0, atol=1e-6 * np.abs(w).max())


def test_wide_weights_are_read_in_column_chunks_of_one_form(monkeypatch):
    import export.grid as grid

    monkeypatch.setattr(grid, "CHUNK_ELEMENTS", 16 * 256)  # 16 columns of K = 256
    w = _k_quant(Q.Q4_K, n=40)
    g = find_grid(w)
    assert g is not None and g.form == "q4_k" and g.q.n == 40 and g.offsets.shape == (256 // 32, 40)
    np.testing.assert_allclose(grid_dequantize(g), w, rtol=0, atol=1e-6 * np.abs(w).max())
    w[:, 35] = _k_quant(Q.Q6_K, n=40, seed=3)[:, 35]  # a later chunk off the 4-bit grid: 8 bits for all
    g = find_grid(w)
    assert g is not None and g.form == "affine8_16" and g.q.n == 40
    np.testing.assert_allclose(grid_dequantize(g), w, rtol=0, atol=1e-6 * np.abs(w).max())


def test_off_grid_weights_are_not_taken_for_a_grid():
    rng = np.random.default_rng(1)
    assert find_grid(rng.standard_normal((64, 8)).astype(np.float32)) is None
    assert find_grid(_on_grid(Q.Q4_1, k=64)[:40]) is None  # K not a multiple of any block
    w48 = _on_grid(Q.Q4_1, k=64)[:48]  # a multiple of 16: its halves of Q4_1 blocks, 8 bits
    g = find_grid(w48)
    assert g is not None and (g.form, g.block_size) == ("affine8_16", 16)
    np.testing.assert_allclose(grid_dequantize(g), w48, rtol=0, atol=1e-6 * np.abs(w48).max())
    w = _on_grid(Q.Q4_1)
    # one weight off its block's grid by an irrational part of a step (a rational part m/n would
    # put it on the finer grid of step/n, which 8 bits hold exactly: found, and rightly so)
    w[5, 3] += (5**0.5 - 1) / 4 * np.ptp(w[:32, 3]) / 15
    assert find_grid(w) is None


def test_constant_blocks_stay_exact():
    w = _on_grid(Q.Q4_1, k=64, n=8)
    w[:32, 2] = 0.0
    w[32:, 5] = -0.25
    g = find_grid(w)
    assert g is not None and g.form == "q4_1"
    np.testing.assert_array_equal(grid_dequantize(g)[:32, 2], 0.0)
    np.testing.assert_allclose(grid_dequantize(g), w, atol=1e-7)


def _linear_session(tmp_path, w, accuracy_level):
    """``x @ w`` as `_Graph.linear` emits it for an int4 spec that keeps source grids."""
    sess, g = linear_session(tmp_path, w, QuantSpec(bits=4, accuracy_level=accuracy_level, source_grid=True))
    return sess, g.grids


@pytest.mark.parametrize(
    "kind,form",
    [
        (Q.Q4_1, "q4_1"),
        (Q.Q8_0, "q8_0"),
        (Q.Q5_0, "sym8"),
        (Q.Q4_K, "q4_k"),
        (Q.Q6_K, "sym8_16"),
        ("mixed", "affine8_16"),
    ],
)
def test_the_kernel_with_offsets_computes_the_source_weight(tmp_path, kind, form):
    if kind == "mixed":
        w = np.concatenate([_k_quant(Q.Q4_K, n=24, seed=3), _k_quant(Q.Q6_K, n=24, seed=4)], axis=1)
    else:
        w = _k_quant(kind, seed=3) if kind in (Q.Q4_K, Q.Q6_K) else _on_grid(kind, k=256, n=48, seed=3)
    x = np.random.default_rng(4).standard_normal((1, 5, w.shape[0])).astype(np.float32)
    sess, forms = _linear_session(tmp_path, w, accuracy_level=0)  # float activations: exact math
    assert forms == {form: 1}
    want = x @ w
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_the_fast_path_is_close_and_off_grid_weights_are_requantized(tmp_path):
    w = _on_grid(Q.Q4_1, k=128, n=48, seed=5)
    x = np.random.default_rng(6).standard_normal((1, 3, 128)).astype(np.float32)
    sess, _ = _linear_session(tmp_path, w, accuracy_level=4)  # int8 activations per block
    want = x @ w
    assert np.abs(sess.run(None, {"x": x})[0] - want).max() <= 0.02 * np.abs(want).max()
    off = np.random.default_rng(7).standard_normal((128, 48)).astype(np.float32)
    (tmp_path / "off").mkdir()
    _, forms = _linear_session(tmp_path / "off", off, accuracy_level=4)
    assert forms == {"requantized": 1}


def test_an_int4_export_of_a_quantized_gguf_keeps_its_grids(tmp_path):
    from tiny_models import build_tiny_gguf

    from export.pipeline import Request, run
    from export.ui import Reporter
    from specdec_rt.ort.model import OrtModel

    src = build_tiny_gguf(tmp_path / "tiny.gguf", "llama", quantized=True)
    outs = {}
    for quant in (None, "int4"):
        out = outs[quant] = tmp_path / f"out-{quant}"
        run(Request(src=str(src), out=out, validate=True, threads=1, quantize=quant), Reporter(quiet=True))
    manifest = json.loads((outs["int4"] / "manifest.json").read_text())
    assert manifest["onnx"]["weight_forms"] == {"q4_1": 2 * 5, "q8_0": 1}  # qkv, o, gate, up, down
    assert manifest["onnx"]["quantization"]["source_grid"] is True
    assert "own grid" in manifest["exact_to"]
    toks = np.random.default_rng(8).integers(3, 300, size=24)
    logits = []
    for out in outs.values():
        s = OrtModel(out, max_length=64, slots=1, threads=1).start()
        logits.append(s.run_sync(toks, 24, 0))  # [24, V]
    ref, got = logits
    assert np.abs(got - ref).max() <= 0.05 * np.abs(ref).max()  # only the activations' int8 rounding
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_an_int4_draft_keeps_only_the_grids_that_cost_no_more_than_before():
    """A draft reads its weights on every step: Q5_0 / Q6_K kept on 8 bits made the Qwen 0.5B
    draft 1.22x dearer a step for +0.02 acceptance, so a draft keeps Q8_0 / Q4_1 / Q4_K only."""
    from export.quant import DRAFT_GRIDS, quant_spec

    draft, target = quant_spec("int4", "draft"), quant_spec("int4")
    assert draft.grids == DRAFT_GRIDS and target.grids is None and draft.manifest()["grids"] == list(DRAFT_GRIDS)
    assert draft.manifest() != target.manifest()  # a build key that tells them apart
    assert quant_spec("int8", "draft") == quant_spec("int8")
    assert find_grid(_on_grid(Q.Q5_0), forms=DRAFT_GRIDS) is None  # requantized to 4 bits instead
    assert find_grid(_k_quant(Q.Q6_K), forms=DRAFT_GRIDS) is None
    assert find_grid(_k_quant(Q.Q4_K), forms=DRAFT_GRIDS).form == "q4_k"
    assert find_grid(_on_grid(Q.Q8_0), forms=DRAFT_GRIDS).form == "q8_0"


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 3e38])
def test_a_weight_with_a_non_finite_value_or_an_overflowing_grid_is_on_no_grid(bad):
    """NaN compares false with any tolerance, so a NaN weight passed the Q8_0 test with NaN
    scales; a weight near float32's limit overflowed its offsets. Neither is carried over."""
    w = _on_grid(Q.Q4_1, k=64, n=8)
    w[3, 2] = bad
    with np.errstate(all="ignore"):
        assert find_grid(w) is None


def test_a_block_with_one_huge_outlier_is_not_taken_for_a_coarse_grid():
    """Within a tolerance of a fraction of a step, one outlier of 1e30 made a block's step so
    coarse that every small weight sat on code 0: "found", and all of them lost. Weights that
    share a code must be equal, as a source's blocks make them."""
    w = _on_grid(Q.Q8_0, k=64, n=8)
    for outlier in (1e30, 1e6, 100.0):
        w2 = w.copy()
        w2[3, 2] = outlier
        assert find_grid(w2) is None


@pytest.mark.parametrize("kind", [Q.Q4_1, Q.Q5_0])
def test_a_weight_a_little_off_its_grid_is_not_carried_over(kind):
    """A weight alone on its code, moved by 9e-4 of a step (inside the detection's tolerance of
    a fraction of a step), was "found" and the difference dropped: what the kernel computes with
    must be within a few float32 ulps of every weight."""
    w = _on_grid(kind, k=64, n=8)
    block = w[:32, 1]
    codes, counts = np.unique(block, return_counts=True)
    alone = int(np.flatnonzero(block == codes[counts == 1][0])[0])
    step = np.diff(codes).min()
    w[alone, 1] += np.float32(9e-4) * step
    assert find_grid(w) is None
