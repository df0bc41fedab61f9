"""Weights already on a GGUF grid (Q4_1 / Q8_0) keep it in the int4 export (export.grid): found
from the float weights alone, carried over exactly, and computed exactly by MatMulNBits plus the
block offsets; anything else is requantized as before."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
gguf = pytest.importorskip("gguf")

import onnx  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from export.graph import _Graph  # noqa: E402
from export.grid import find_grid, grid_dequantize  # noqa: E402
from export.quant import QuantSpec  # noqa: E402
from export.weights import ExternalDataWriter  # noqa: E402

pytestmark = pytest.mark.export
Q = gguf.GGMLQuantizationType


def _on_grid(kind, k=96, n=40, seed=0):
    """A float32 [K, N] weight as a GGUF file holds it: quantized rows of K, dequantized."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return gguf.quants.dequantize(gguf.quants.quantize(w, kind), kind).astype(np.float32).T.copy()


@pytest.mark.parametrize("kind,form", [(Q.Q4_1, "q4_1"), (Q.Q8_0, "q8_0")])
def test_a_gguf_grid_is_found_and_carried_over_exactly(kind, form):
    w = _on_grid(kind)
    g = find_grid(w)
    assert g is not None and g.form == form
    np.testing.assert_allclose(grid_dequantize(g), w, rtol=0, atol=1e-6 * np.abs(w).max())


def test_off_grid_weights_are_not_taken_for_a_grid():
    rng = np.random.default_rng(1)
    assert find_grid(rng.standard_normal((64, 8)).astype(np.float32)) is None
    assert find_grid(_on_grid(Q.Q4_1, k=64)[:48]) is None  # K not a multiple of the block
    w = _on_grid(Q.Q4_1)
    w[5, 3] += 0.3 * np.ptp(w[:32, 3]) / 15  # one weight a third of a step off its block's grid
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
    with ExternalDataWriter(tmp_path / "m.onnx.data") as data:
        g = _Graph(data, QuantSpec(bits=4, accuracy_level=accuracy_level, source_grid=True), 1e-6)
        g.linear("x", w, "/lin", out="y")
    graph = helper.make_graph(
        g.nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "N", w.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "N", w.shape[1]])],
        initializer=g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    onnx.save_model(model, str(tmp_path / "m.onnx"))
    return ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]), g.grids


@pytest.mark.parametrize("kind", [Q.Q4_1, Q.Q8_0])
def test_the_kernel_with_offsets_computes_the_source_weight(tmp_path, kind):
    w = _on_grid(kind, k=128, n=48, seed=3)
    x = np.random.default_rng(4).standard_normal((1, 5, 128)).astype(np.float32)
    sess, forms = _linear_session(tmp_path, w, accuracy_level=0)  # float activations: exact math
    assert forms == {"q4_1" if kind == Q.Q4_1 else "q8_0": 1}
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], x @ w, rtol=1e-5, atol=1e-5)


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
    from export.pipeline import Request, run
    from export.ui import Reporter
    from specdec_rt.ort.model import OrtModel
    from tiny_models import build_tiny_gguf

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
