"""A quantized target (int8 weights, int8 activations per block) is exact to itself: greedy
speculative output equals its greedy plain output, and a position's logits do not depend on how
many positions the call fed (attention computes a lone query twice)."""

from __future__ import annotations

import numpy as np
import pytest

from specdec_rt.ort.model import OrtModel
from specdec_rt.policy.config import SpecConfig

pytestmark = pytest.mark.export


@pytest.fixture(scope="module")
def tiny_int8(tmp_path_factory):
    from tiny_models import export_tiny

    return export_tiny(tmp_path_factory.mktemp("tiny-int8"), "llama", draft="int4", quantize="int8")


def test_manifest_says_what_the_output_is_exact_to(tiny_int8):
    m = OrtModel(tiny_int8, max_length=64, slots=1, threads=1)
    assert m.manifest.quantization["bits"] == 8 and m.manifest.quantization["symmetric"] is True
    assert "exact to the quantized model" in m.manifest.exact_to
    assert m.lone_twice  # float32 targets and drafts compute a lone query once
    draft = OrtModel(tiny_int8 / "draft-q4", max_length=64, slots=1, threads=1)
    assert not draft.lone_twice


def test_a_lone_position_goes_to_attention_twice_and_to_the_matmuls_once():
    from specdec_rt.ort.model import _packed_layout

    queries, pad, pack, shape = _packed_layout(np.array([1, 3, 0, 1]), lone_twice=True)
    assert queries.tolist() == [2, 3, 0, 2]  # attention: each lone query twice
    assert shape.tolist() == [4, 3, -1]
    assert pad.reshape(4, 3)[:, :2].tolist() == [[0, 0], [1, 2], [0, 0], [4, 4]]  # the same packed position
    assert pack.tolist() == [0, 3, 4, 5, 9]  # 5 packed positions: only the first copy comes back
    queries, pad, pack, shape = _packed_layout(np.array([1]))
    assert queries.tolist() == [1] and pad.tolist() == [0] and pack.tolist() == [0]


def test_a_lone_token_gets_the_logits_it_gets_inside_a_verify(tiny_int8):
    model = OrtModel(tiny_int8, max_length=64, slots=3, threads=1)
    toks = np.random.default_rng(2).integers(3, model.vocab_size, size=40)
    s = model.start()
    s.run_sync(toks[:20], 1, 0)
    lone = s.run_sync(toks[20:21], 1, 20)
    assert s.length == 21
    s.rollback(20)
    verify = s.run_sync(toks[20:25], 5, 20)
    np.testing.assert_array_equal(lone[0], verify[0])
    a, b = model.start(), model.start()
    model.run_rows_sync([a, b], [toks[:12], toks[:7]], [1, 1])
    one = model.run_rows_sync([a, b], [toks[12:13], toks[7:10]], [1, 3])
    a.rollback(12)
    b.rollback(7)
    two = model.run_rows_sync([a, b], [toks[12:14], toks[7:8]], [2, 1])
    np.testing.assert_array_equal(one[0][0], two[0][0])
    np.testing.assert_array_equal(one[1][0], two[1][0])
    assert (a.length, b.length) == (14, 8)


@pytest.mark.parametrize("target", ["tiny_int8", "tiny_int4"])
@pytest.mark.parametrize("draft", ["q4", "ngram"])
def test_greedy_speculative_equals_plain_for_the_quantized_target(request, target, draft):
    from tiny_models import plain_spec_together

    prompts = ["one two three", "def f(x):\n    return", "a b a b a b"]
    cfg = SpecConfig(measure_costs=False, adapt_k=False, k_init=3)
    plain, spec, together = plain_spec_together(request.getfixturevalue(target), draft, cfg, prompts, 20, slots=3)
    assert spec == plain and together == plain


@pytest.fixture(scope="module")
def tiny_int4(tmp_path_factory):
    from tiny_models import export_tiny

    return export_tiny(tmp_path_factory.mktemp("tiny-int4"), "llama", draft="int4", quantize="int4")


def test_a_lone_position_whose_matmuls_round_otherwise_goes_with_a_copy(tiny_int4):
    """On CPUs without VNNI, 4-bit MatMulNBits rounds a one-row call otherwise than calls of
    2+ rows, which int8 activations amplify. The model measures at load whether a lone step
    differs from a verify (``pad_lone``); if so a lone position goes with a copy of it after it
    (the copy's KV rolled back), alone or in a batched call, and its logits are a verify's."""
    model = OrtModel(tiny_int4, max_length=64, slots=2, threads=2)
    measured, model.pad_lone = model.pad_lone, False
    assert measured == model._lone_step_differs()  # the probe says what the plain path does
    model.pad_lone = True  # wherever it is needed: bit for bit a verify's logits
    toks = np.random.default_rng(3).integers(3, model.vocab_size, size=30)
    s = model.start()
    s.run_sync(toks[:20], 1, 0)
    lone = s.run_sync(toks[20:21], 1, 20)  # [1, V]
    assert s.length == 21
    s.rollback(20)
    verify = s.run_sync(toks[20:25], 5, 20)  # [5, V]
    np.testing.assert_array_equal(lone[0], verify[0])
    s.rollback(20)
    (rows,) = model.run_rows_sync([s], [toks[20:21]], [1])  # a batched call of one lone row
    np.testing.assert_array_equal(rows[0], verify[0])
    assert s.length == 21 and rows.shape == (1, verify.shape[1])
    s.rollback(20)
    logits, hidden = s.run_sync(toks[20:21], 1, 20, hidden=True)
    assert logits.shape == (1, verify.shape[1]) and hidden.shape[0] == 1 and s.length == 21
    edge = OrtModel(tiny_int4, max_length=21, slots=1, threads=2)  # the lone position is the last one
    edge.pad_lone = True
    e = edge.start()
    e.pad_lone = True
    e.run_sync(toks[:20], 1, 0)
    np.testing.assert_array_equal(e.run_sync(toks[20:21], 1, 20)[0], verify[0])  # its copy: no position 21
    assert e.length == 21
