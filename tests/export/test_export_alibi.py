"""The graph's ALiBi block (``export.graph._alibi_bias``) against transformers' own ALiBi tensors,
with 20 heads (slopes that are not powers of two, and the extra slopes of a head count that is
not one) and 300 keys (positions past 256, which bfloat16 rounds): BLOOM's bias is
``build_alibi_tensor``'s, Falcon-RW's its bfloat16 one times attention's scale, MPT's
``build_mpt_alibi_tensor``'s for the last query and the same up to a constant for the others."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from export.alibi import alibi_slopes  # noqa: E402
from export.graph import _alibi_bias, _Graph  # noqa: E402
from export.model_spec import ModelSpec  # noqa: E402
from export.weights import ExternalDataWriter  # noqa: E402

pytestmark = pytest.mark.export

HEADS, KEYS, HEAD = 20, 300, 4  # 20 heads of 4: hidden 80


def _tiny(family: str):
    """A one-layer model of ``family`` with 20 heads (its slopes come from its own code)."""
    import transformers as tf

    if family == "bloom":
        return tf.BloomForCausalLM(tf.BloomConfig(vocab_size=8, hidden_size=80, n_layer=1, n_head=HEADS))
    if family == "falcon":
        config = tf.FalconConfig(vocab_size=8, hidden_size=80, num_hidden_layers=1, num_attention_heads=HEADS)
        config.alibi = True
        return tf.FalconForCausalLM(config)
    return tf.MptForCausalLM(tf.MptConfig(vocab_size=8, d_model=80, n_layers=1, n_heads=HEADS))


def _graph_bias(tmp_path: Path, family: str, kind: str, queries: list[int]) -> np.ndarray:
    """The block's output ``[1 or B, H, S, T]`` for one row of ``queries`` (their positions) over
    ``KEYS`` keys, the runtime's bias all zeros."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    spec = ModelSpec(
        family=family,
        num_layers=1,
        hidden_size=HEADS * HEAD,
        num_heads=HEADS,
        num_kv_heads=HEADS,
        head_dim=16,
        model_head_dim=HEAD,
        intermediate_size=1,
        vocab_size=8,
        max_positions=KEYS,
        rms_eps=1e-5,
        alibi=kind,
    )
    with ExternalDataWriter(tmp_path / "alibi.onnx.data") as data:
        graph = _Graph(data, None, 1e-5)
        out = _alibi_bias(graph, alibi_slopes(_tiny(family), HEADS), spec)
    vi = helper.make_tensor_value_info
    inputs = [
        vi("attention_bias", TensorProto.FLOAT, [1, 1, None, None]),
        vi("position_rows", TensorProto.INT64, [1, None]),
    ]
    body = helper.make_graph(graph.nodes, "alibi", inputs, [vi(out, TensorProto.FLOAT, None)], initializer=graph.inits)
    model = helper.make_model(body, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.save_model(model, str(tmp_path / "alibi.onnx"))
    session = ort.InferenceSession(str(tmp_path / "alibi.onnx"), providers=["CPUExecutionProvider"])
    feeds = {
        "attention_bias": np.zeros((1, 1, len(queries), KEYS), np.float32),
        "position_rows": np.array([queries], np.int64),
    }
    used = {i.name for i in session.get_inputs()}
    result: np.ndarray = session.run(None, {k: v for k, v in feeds.items() if k in used})[0]
    return result


def test_bloom_bias_is_transformers_exactly(tmp_path):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    want = build_alibi_tensor(torch.ones(1, KEYS, dtype=torch.long), HEADS, torch.float32).numpy()  # [H, 1, T]
    got = _graph_bias(tmp_path, "bloom", "absolute", [KEYS - 1])
    assert got.shape == (1, HEADS, 1, KEYS) and np.array_equal(got[0], want)


def test_falcon_rw_bias_is_transformers_bfloat16_one_times_the_scale(tmp_path):
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor

    alibi = build_alibi_tensor(torch.ones(1, KEYS, dtype=torch.long), HEADS, torch.float32)  # bfloat16 values
    want = (alibi * torch.tensor(HEAD**-0.5, dtype=torch.float32)).numpy()
    got = _graph_bias(tmp_path, "falcon", "bfloat16", [KEYS - 1])
    assert np.array_equal(got[0], want)
    unrounded = _graph_bias(tmp_path, "bloom", "absolute", [KEYS - 1])[0] * np.float32(HEAD**-0.5)
    assert not np.array_equal(unrounded, want)  # the rounding matters at these slopes and positions


def test_mpt_bias_is_transformers_for_the_last_query_and_a_shift_for_the_others(tmp_path):
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    want = build_mpt_alibi_tensor(HEADS, KEYS).numpy()  # [H, 1, T]: slope x (j - (T - 1))
    queries = [KEYS - 40, KEYS - 1]
    got = _graph_bias(tmp_path, "mpt", "relative", queries)
    assert got.shape == (1, HEADS, 2, KEYS) and np.array_equal(got[0, :, 1:], want)
    shift = got[0, :, :1] - want  # the earlier query: a constant over its keys (softmax ignores it)
    np.testing.assert_allclose(shift, np.broadcast_to(shift[..., :1], shift.shape), rtol=0, atol=1e-4)
    assert np.all(shift[..., 0] > 0)
