"""``--scale-dtype float16``: a quantized graph stores its scales and block offsets in float16 and
casts them to float32 (folded when the session loads), so its logits are those of the float32
graph whose scales and offsets are rounded to float16."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from export.quant import QuantSpec, stored_scales


def test_stored_scales_round_to_float16_only_where_every_value_survives():
    spec = QuantSpec(bits=4, scale_dtype="float16")
    scales = np.array([[1e-3, 0.5], [2.0, 3e-2]], dtype=np.float32)
    half = stored_scales(scales, spec)
    assert half.dtype == np.float16 and np.allclose(half, scales, rtol=2.0**-11)
    assert stored_scales(scales, QuantSpec(bits=4)).dtype == np.float32  # the default keeps float32
    tiny = scales.copy()
    tiny[0, 0] = 1e-6  # below float16's smallest normal: its precision would drop
    assert stored_scales(tiny, spec).dtype == np.float32
    huge = scales.copy()
    huge[1, 1] = 1e5  # overflows float16
    assert stored_scales(huge, spec).dtype == np.float32
    assert stored_scales(huge, spec, offsets=True).dtype == np.float32
    offsets = np.array([[1e-9, -0.25]], dtype=np.float32)  # an offset near 0 costs no precision that matters
    assert stored_scales(offsets, spec, offsets=True).dtype == np.float16


def _export(src, out, scale_dtype):
    from export.pipeline import Request, run
    from export.ui import Reporter

    request = Request(src=str(src), out=out, validate=True, threads=1, quantize="int4", scale_dtype=scale_dtype)
    run(request, Reporter(quiet=True))
    return json.loads((out / "manifest.json").read_text())


def _logits(folder, toks):
    from specdec_rt.ort.model import OrtModel

    session = OrtModel(folder, max_length=64, slots=1, threads=1).start()
    return session.run_sync(toks, len(toks), 0)  # [T, V]


def _scale_tensors(folder):
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    return {t.name: t.data_type for t in model.graph.initializer if t.name.endswith(("scales", "offsets", "_f16"))}


@pytest.mark.parametrize("family", ["llama"])
def test_float16_scales_of_a_q4_1_q8_0_gguf_halve_their_bytes(tmp_path, family):
    from tiny_models import build_tiny_gguf

    src = build_tiny_gguf(tmp_path / "tiny.gguf", family, quantized=True)  # Q4_1 layers, Q8_0 embedding
    full = _export(src, tmp_path / "f32", None)
    half = _export(src, tmp_path / "f16", "float16")
    assert "scale_dtype" not in full["onnx"]["quantization"]
    assert half["onnx"]["quantization"]["scale_dtype"] == "float16"
    assert "float16" in half["exact_to"] and "float16" not in full["exact_to"]
    stored = _scale_tensors(tmp_path / "f16")
    assert stored and all(name.endswith("_f16") for name in stored)
    assert set(stored.values()) == {onnx.TensorProto.FLOAT16}
    assert half["onnx"]["scale_dtypes"] == {"float16": len(stored)}
    assert set(_scale_tensors(tmp_path / "f32").values()) == {onnx.TensorProto.FLOAT}
    scale_bytes = sum(
        t.float_data.__len__() or _external_length(t)
        for t in onnx.load(str(tmp_path / "f32" / "model.onnx"), load_external_data=False).graph.initializer
        if t.name.endswith(("scales", "offsets"))
    )
    f32_data = (tmp_path / "f32" / "model.onnx.data").stat().st_size
    f16_data = (tmp_path / "f16" / "model.onnx.data").stat().st_size
    assert f16_data <= f32_data - scale_bytes // 2 + 4096  # half the scale bytes (alignment aside)

    toks = np.random.default_rng(8).integers(3, 300, size=24)
    got, before = _logits(tmp_path / "f16", toks), _logits(tmp_path / "f32", toks)
    # Q8_0's and Q4_1's scales are float16 in the file, Q4_1's offsets m + 8 d are rounded
    assert np.abs(got - before).max() <= 1e-3 * np.abs(before).max()
    assert (got.argmax(-1) == before.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q4_1", "Q8_0"])
def test_a_float16_linear_computes_the_weight_with_rounded_scales(tmp_path, kind):
    """One ``x @ w`` on a source grid with float16 scales: the kernel computes with the grid's
    weight whose scales and offsets are rounded to float16 (float activations: exact math)."""
    import dataclasses

    import gguf
    from linear_graph import linear_session

    from export.grid import find_grid, grid_dequantize

    q = gguf.GGMLQuantizationType
    w = _k_quant(q[kind]) if kind in ("Q4_K", "Q6_K") else _on_grid(q[kind])
    spec = QuantSpec(bits=4, accuracy_level=0, source_grid=True, scale_dtype="float16")
    sess, g = linear_session(tmp_path, w, spec)
    assert sum(g.scale_dtypes.values()) == (2 if kind in ("Q4_K", "Q4_1") else 1)  # scales (+ offsets)

    grid = find_grid(w)
    rounded = dataclasses.replace(
        grid,
        q=dataclasses.replace(grid.q, scales=grid.q.scales.astype(np.float16).astype(np.float32)),
        offsets=None if grid.offsets is None else grid.offsets.astype(np.float16).astype(np.float32),
    )
    ref = grid_dequantize(rounded)
    x = np.random.default_rng(4).standard_normal((1, 5, w.shape[0])).astype(np.float32)
    want = x @ ref
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    moved = np.abs(ref - w).max()
    if kind == "Q8_0":  # a float16 d per block: nothing to round
        assert moved == 0
    else:  # Q4_K's and Q6_K's d * sc need up to 17 bits, Q4_1's offset m + 8 d more than 11:
        # rounded, each weight by at most 2^-11 of its scale part and of its offset
        assert 0 < moved <= 2.0**-11 * 3 * np.abs(w).max()


def _on_grid(kind, k=96, n=40, seed=0):
    """A float32 [K, N] weight as a GGUF file holds it: quantized rows of K, dequantized."""
    import gguf

    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return gguf.quants.dequantize(gguf.quants.quantize(w, kind), kind).astype(np.float32).T.copy()


def _k_quant(kind, k=256, n=24, seed=0):
    """A float32 [K, N] weight dequantized from random K-quant blocks (random codes and scales,
    sane d / dmin), as tests/export/test_export_grid.py builds them."""
    import gguf

    rng = np.random.default_rng(seed)
    per, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(n, k // per, size), dtype=np.uint8)
    d = rng.uniform(1e-3, 4e-3, size=raw.shape[:2]).astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    if kind == gguf.GGMLQuantizationType.Q4_K:  # d, dmin, 12 bytes of 6-bit scales and mins, 128 of 4-bit codes
        raw[..., 0:2], raw[..., 2:4] = d, d
    else:  # Q6_K: 128 + 64 bytes of 6-bit codes, 16 int8 scales, d
        raw[..., 208:210] = d
    return gguf.quants.dequantize(raw.reshape(n, -1), kind).astype(np.float32).T.copy()


def _external_length(tensor):
    return next((int(e.value) for e in tensor.external_data if e.key == "length"), len(tensor.raw_data))


def test_an_unknown_scale_dtype_is_a_usage_error_naming_it(tmp_path):
    from export.errors import UsageError
    from export.pipeline import Request, run
    from export.ui import Reporter

    with pytest.raises(UsageError, match="'bfloat16'"):
        run(Request(src=str(tmp_path), out=tmp_path / "out", scale_dtype="bfloat16"), Reporter(quiet=True))


def test_the_build_key_names_a_float16_scale_dtype_only():
    """An export built before the option keeps its key (no rebuild); float16 is another build."""
    from export.pipeline import Job

    def key(scale_dtype, quantize="int4"):
        return Job(name="t", role="target", subdir="", ref=None, quantize=quantize, scale_dtype=scale_dtype).build_key()

    assert "scale_dtype" not in key("float32")["quantize"]
    assert key("float16")["quantize"]["scale_dtype"] == "float16"
    assert key("float16", quantize=None)["quantize"] is None  # float32 weights: nothing to store


@pytest.mark.parametrize("value,ok", [("float16", True), (None, True), ("bf16", False), (16, False)])
def test_a_recipe_may_name_a_scale_dtype(tmp_path, value, ok):
    from pathlib import Path

    from export.errors import ExportError
    from export.recipes import load_recipe

    recipe = json.loads((Path(__file__).parents[2] / "models/qwen2.5-coder-1.5b-q4/recipe.json").read_text())
    recipe.setdefault("export", {})["scale_dtype"] = value
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(recipe))
    if ok:
        assert load_recipe(path)["export"]["scale_dtype"] == value
    else:
        with pytest.raises(ExportError, match="export.scale_dtype"):
            load_recipe(path)
