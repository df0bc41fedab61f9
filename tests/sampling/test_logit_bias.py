"""``logit_bias`` (OpenAI's): a per-token bias added to the logits before temperature, top-k,
top-p and greedy's argmax, for draft and target alike. Greedy speculative output stays the
biased plain output token for token (chains, trees, batches); sampled sequences keep the biased
target's distribution (chi-square); bad values are refused by name."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from specdec_rt import InvalidInputError, ModelDrafter, ModelVerifier, SamplingParams, SpecConfig, SpecDecScheduler
from specdec_rt.sampling import MAX_LOGIT_BIAS, biased, warp
from specdec_rt.testing import (
    chi_square_pvalue,
    run_together,
    sequence_counts,
    sequence_distribution,
    toy_pair,
    toy_scheduler,
)

ALWAYS = dict(measure_costs=False, adapt_k=False, fallback_below=0.0, zero_rounds=10**6, min_speedup=0.0)


@pytest.mark.parametrize(
    "bad, needle",
    [
        ({-1: 1.0}, "non-negative integers"),
        ({True: 1.0}, "non-negative integers"),
        ({"3": 1.0}, "non-negative"),
        ({3: 101}, "from -100 to 100"),
        ({3: float("nan")}, "from -100 to 100"),
        ({3: "1"}, "from -100 to 100"),
        ({i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}, "at most"),
        ("x", "must be a dict"),
        ([(1, 2, 3)], "pairs"),
        ({2**63: 1.0}, "below 2\\*\\*31"),
    ],
)
def test_bad_biases_are_refused_by_name(bad, needle):
    with pytest.raises(InvalidInputError, match=needle):
        SamplingParams(logit_bias=bad)


def test_warp_adds_the_bias_first_and_leaves_the_callers_rows_alone():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 10)).astype(np.float32)  # [3, V]
    keep = logits.copy()
    params = SamplingParams(temperature=0.8, top_k=5, logit_bias={2: 3.0, 7: -100})
    shifted = logits.copy()
    shifted[:, 2] += 3.0
    shifted[:, 7] -= 100.0
    assert np.allclose(warp(logits, params), warp(shifted, SamplingParams(temperature=0.8, top_k=5)))
    assert (warp(logits, params)[:, 7] == 0).all() and np.array_equal(logits, keep)
    greedy = warp(logits, SamplingParams(logit_bias={int(np.argmin(logits[0])): 100}))
    assert greedy[0].argmax() == np.argmin(logits[0])  # +100 wins the argmax
    assert biased(logits, SamplingParams()) is logits  # no bias: no copy
    with pytest.raises(InvalidInputError, match="logit_bias token id 10 is outside the vocabulary"):
        biased(logits, SamplingParams(logit_bias={10: 1}))


def _run(sched, prompt, n, params, mode="spec"):
    return anyio.run(lambda: sched.run(prompt, n, params, mode=mode)).token_ids


@pytest.mark.parametrize("tree_nodes", [0, 2])
def test_greedy_speculation_equals_biased_plain_decoding(tree_nodes):
    target, draft = toy_pair(16, seed=4, distance=0.5)
    sched = SpecDecScheduler(
        ModelDrafter(draft), ModelVerifier(target), SpecConfig(k_init=4, tree_nodes=tree_nodes, **ALWAYS)
    )
    prompt = [2, 7, 1]
    plain = _run(sched, prompt, 30, SamplingParams(), "ar")
    ban = {plain[0]: -100.0, plain[3]: -100.0}  # the plain output's tokens, banned
    params = SamplingParams(logit_bias=ban)
    want = _run(sched, prompt, 30, params, "ar")
    assert want != plain and not set(ban) & set(want)
    assert _run(sched, prompt, 30, params) == want
    assert sched.totals.accepted > 0
    boost = SamplingParams(logit_bias={5: 100.0})
    assert _run(sched, prompt, 10, boost) == _run(sched, prompt, 10, boost, "ar") == [5] * 10


def test_batched_requests_with_different_biases_each_equal_their_own_plain_run():
    sched, _, _ = toy_scheduler(0.5, vocab_size=16, seed=5, batched=True, config=SpecConfig(**ALWAYS))
    prompts = [[1, 2], [3, 4, 5], [6], [7, 8, 9]]
    params = [SamplingParams(logit_bias={i: -100.0, i + 5: 4.0}) for i in range(len(prompts))]
    alone = [_run(sched, p, 20, q, "ar") for p, q in zip(prompts, params)]

    assert anyio.run(run_together, sched, prompts, 20, params) == alone


def test_sampling_keeps_the_biased_target_distribution():
    vocab, length, prompt, n = 4, 3, [1, 2], 6000
    target, draft = toy_pair(vocab, seed=3, distance=0.7)
    params = SamplingParams(temperature=1.0, logit_bias={0: 1.5, 2: -2.0})
    sched = SpecDecScheduler(ModelDrafter(draft), ModelVerifier(target), SpecConfig(k_init=2, **ALWAYS))
    counts = anyio.run(lambda: sequence_counts(sched, prompt, length, params, n=n, rng=np.random.default_rng(11)))
    expected = sequence_distribution(target, prompt, length, params)
    assert chi_square_pvalue(counts, expected) > 1e-3
    unbiased = sequence_distribution(target, prompt, length, SamplingParams(temperature=1.0))
    assert chi_square_pvalue(counts, unbiased) < 1e-6  # the bias moved the distribution, measurably


def test_ids_past_the_vocabulary_are_refused_before_any_model_call():
    target, draft = toy_pair(8)
    sched = SpecDecScheduler(ModelDrafter(draft), ModelVerifier(target))
    with pytest.raises(InvalidInputError, match="logit_bias token id 8 is outside the model's vocabulary"):
        sched.stream([1, 2], 4, SamplingParams(logit_bias={8: 1.0}))


def test_log_probabilities_stay_the_models_own():
    target, draft = toy_pair(16, seed=2)
    sched = SpecDecScheduler(ModelDrafter(draft), ModelVerifier(target), SpecConfig(**ALWAYS))

    async def lps(params):
        out = []
        async for ev in sched.stream([1, 2], 6, params, logprobs=0, mode="ar"):
            out += [(t, e.logprob) for t, e in zip(ev.token_ids, ev.logprobs)]
        return out

    plain = anyio.run(lps, SamplingParams())
    nudged = anyio.run(lps, SamplingParams(logit_bias={plain[1][0]: 0.01}))  # same tokens, tiny bias
    assert [t for t, _ in nudged] == [t for t, _ in plain]
    assert [lp for _, lp in nudged] == pytest.approx([lp for _, lp in plain], abs=1e-9)
