"""Repetition penalties (``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``):
each verified position is scored after its own tokens (committed ones plus the drafts before it,
or its tree path), so greedy speculation equals penalized plain decoding and sampled sequences
keep the penalized target's distribution; the formula is checked against a hand computation."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from specdec_rt import InvalidInputError, ModelDrafter, ModelVerifier, SamplingParams, SpecConfig, SpecDecScheduler
from specdec_rt.sampling.penalties import penalized
from specdec_rt.speculation.context import RequestContext
from specdec_rt.testing import (
    chi_square_pvalue,
    run_together,
    sequence_counts,
    sequence_distribution,
    toy_pair,
    toy_scheduler,
)

ALWAYS = dict(measure_costs=False, adapt_k=False, fallback_below=0.0, zero_rounds=10**6, min_speedup=0.0)


def test_the_formula_by_hand():
    logits = np.array([[2.0, -1.0, 0.5, 3.0, 1.0]] * 2, dtype=np.float32)  # [2, V]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    out = penalized(logits, params, prompt=np.array([0]), generated=np.array([1, 1]), before=[[], [3, 3]])
    # row 0: token 0 seen in the prompt (2 / 2); token 1 generated twice (-1 * 2 - 0.25 * 2 - 0.5)
    assert out[0].tolist() == [1.0, -3.0, 0.5, 3.0, 1.0]
    # row 1: also token 3 twice among the drafts before it (3 / 2 - 0.25 * 2 - 0.5)
    assert out[1].tolist() == [1.0, -3.0, 0.5, 0.5, 1.0]
    assert (
        penalized(logits, SamplingParams(), np.array([0]), np.array([1]), before=[[], []]) is logits
    )  # off: untouched


@pytest.mark.parametrize(
    "field, bad",
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("frequency_penalty", "1"),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 11),
        ("presence_penalty", True),
        ("repetition_penalty", float("nan")),
        ("repetition_penalty", 1e-39),
        ("repetition_penalty", 0.005),
    ],
)
def test_bad_values_are_refused_by_name(field, bad):
    with pytest.raises(InvalidInputError, match=field):
        SamplingParams(**{field: bad})


def _run(sched, prompt, n, params, mode="spec"):
    return anyio.run(lambda: sched.run(prompt, n, params, mode=mode)).token_ids


PARAMS = [
    SamplingParams(frequency_penalty=1.5),
    SamplingParams(presence_penalty=2.0),
    SamplingParams(repetition_penalty=3.0),
    SamplingParams(presence_penalty=-1.0, frequency_penalty=0.7, repetition_penalty=1.5),
]


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("tree_nodes", [0, 3])
def test_greedy_speculation_equals_penalized_plain_decoding(params, tree_nodes):
    target, draft = toy_pair(12, seed=6, distance=0.3)
    sched = SpecDecScheduler(
        ModelDrafter(draft), ModelVerifier(target), SpecConfig(k_init=5, tree_nodes=tree_nodes, **ALWAYS)
    )
    prompt = [3, 3, 1]
    plain = _run(sched, prompt, 40, SamplingParams(), "ar")
    want = _run(sched, prompt, 40, params, "ar")
    assert want != plain  # the penalty changes what greedy decoding says
    assert _run(sched, prompt, 40, params) == want
    assert sched.totals.accepted > 20  # drafts were accepted, under the penalty too
    assert (target.tree_calls > 0) == (tree_nodes > 0)  # trees were verified when asked


def test_rows_scored_without_their_drafts_are_caught(monkeypatch):
    """A verifier that scores every row after the committed tokens only (the drafts before it
    left out) breaks the equality above: the test sees the difference."""
    target, draft = toy_pair(12, seed=6, distance=0.3)
    params = PARAMS[0]
    sched = SpecDecScheduler(ModelDrafter(draft), ModelVerifier(target), SpecConfig(k_init=5, **ALWAYS))
    want = _run(sched, [3, 3, 1], 40, params, "ar")
    real = RequestContext.penalized
    monkeypatch.setattr(
        RequestContext, "penalized", lambda ctx, logits, before: real(ctx, logits, [[] for _ in before])
    )
    assert _run(sched, [3, 3, 1], 40, params) != want


def test_batched_requests_with_different_penalties_each_equal_their_own_plain_run():
    sched, _, _ = toy_scheduler(0.4, vocab_size=12, seed=7, batched=True, config=SpecConfig(**ALWAYS))
    prompts = [[1, 2], [3, 4, 5], [6], [7, 8, 9]]
    alone = [_run(sched, p, 25, q, "ar") for p, q in zip(prompts, PARAMS)]

    assert anyio.run(run_together, sched, prompts, 25, PARAMS) == alone


@pytest.mark.parametrize("tree_nodes", [0, 2])
def test_sampling_keeps_the_penalized_distribution(tree_nodes):
    vocab, length, prompt, n = 4, 3, [1, 2], 6000
    target, draft = toy_pair(vocab, seed=3, distance=0.7)
    params = SamplingParams(temperature=1.0, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.5)
    sched = SpecDecScheduler(
        ModelDrafter(draft),
        ModelVerifier(target),
        SpecConfig(k_min=2, k_init=2, k_max=2, tree_nodes=tree_nodes, **ALWAYS),
    )
    counts = anyio.run(lambda: sequence_counts(sched, prompt, length, params, n=n, rng=np.random.default_rng(12)))
    assert (target.tree_calls > 0) == (tree_nodes > 0)
    assert chi_square_pvalue(counts, sequence_distribution(target, prompt, length, params)) > 1e-3
    plain = sequence_distribution(target, prompt, length, SamplingParams(temperature=1.0))
    assert chi_square_pvalue(counts, plain) < 1e-6  # the penalties moved it, measurably


def test_the_smallest_repetition_penalty_keeps_float32_logits_finite():
    logits = np.array([[3.0e36, -3.0e36, 1.0]], dtype=np.float32)  # [1, V]: extreme but finite
    out = penalized(
        logits, SamplingParams(repetition_penalty=0.01), np.array([0, 1]), np.zeros(0, np.int64), before=[[]]
    )
    assert np.isfinite(out).all() and out[0, 0] > 0 > out[0, 1]
