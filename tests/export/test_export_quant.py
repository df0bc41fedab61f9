"""MatMulNBits packing (export.quant) against its numpy dequantization, in ONNX Runtime."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from export.quant import QuantSpec, dequantize, quantize  # noqa: E402

pytestmark = pytest.mark.export


def _run_matmulnbits(x, q, spec: QuantSpec):
    zp = [] if q.zero_points is None else [numpy_helper.from_array(q.zero_points, "z")]  # symmetric: none
    node = helper.make_node(
        "MatMulNBits",
        ["x", "B", "s"] + ["z"] * len(zp),
        ["y"],
        domain="com.microsoft",
        K=q.k,
        N=q.n,
        bits=spec.bits,
        block_size=spec.block_size,
        accuracy_level=spec.accuracy_level,
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", q.k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", q.n])],
        initializer=[numpy_helper.from_array(q.packed, "B"), numpy_helper.from_array(q.scales, "s"), *zp],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k,n", [(64, 48), (100, 40), (96, 33)])  # K not a multiple of 32, odd N
def test_kernel_reads_exactly_the_dequantized_weight(bits, k, n, symmetric):
    # accuracy level 0 keeps activations in float: the kernel must equal x @ dequantize(q)
    rng = np.random.default_rng(bits * 1000 + k)
    spec = QuantSpec(bits=bits, accuracy_level=0, symmetric=symmetric)
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = rng.standard_normal((3, k)).astype(np.float32)
    q = quantize(w, spec)
    want = x @ dequantize(q, spec)
    np.testing.assert_allclose(_run_matmulnbits(x, q, spec), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bits,max_err", [(4, 1 / 15), (8, 1 / 255)])
def test_quantization_error_is_within_half_a_step(bits, max_err):
    rng = np.random.default_rng(bits)
    w = rng.standard_normal((128, 16)).astype(np.float32)
    spec = QuantSpec(bits=bits)
    back = dequantize(quantize(w, spec), spec)
    blocks = w.T.reshape(16, 4, 32)  # per column, per block of 32 along K
    step = np.maximum(blocks.max(2), 0) - np.minimum(blocks.min(2), 0)  # [16, 4]
    err = np.abs(back - w).T.reshape(16, 4, 32).max(2)
    assert np.all(err <= step * max_err * 0.5 + 1e-6)


def test_zero_stays_exact_and_shapes():
    w = np.zeros((64, 8), dtype=np.float32)
    w[3, 2] = 1.5
    for bits, blob in ((4, 16), (8, 32)):
        spec = QuantSpec(bits=bits)
        q = quantize(w, spec)
        assert q.packed.shape == (8, 2, blob) and q.packed.dtype == np.uint8
        assert q.scales.shape == (8, 2)
        back = dequantize(q, spec)
        assert back[0, 0] == 0.0 and abs(back[3, 2] - 1.5) < 1e-6


def test_accuracy_level_4_is_close():
    # the fast CPU path quantizes activations to int8: small, bounded extra error
    rng = np.random.default_rng(7)
    spec = QuantSpec(bits=4, accuracy_level=4)
    w = rng.standard_normal((256, 64)).astype(np.float32)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    q = quantize(w, spec)
    want = x @ dequantize(q, spec)
    got = _run_matmulnbits(x, q, spec)
    assert np.abs(got - want).max() <= 0.02 * np.abs(want).max()
