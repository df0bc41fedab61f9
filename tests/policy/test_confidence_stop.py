"""Chains that stop where the draft is unsure (specdec_rt/policy/confidence.py): the rates, the rule,
and that the output stays exactly the target's (greedy tokens, sampled distribution)."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from specdec_rt import InvalidInputError, ModelDrafter, ModelVerifier, SamplingParams, SpecConfig, SpecDecScheduler
from specdec_rt.policy.confidence import ChainStop, ConfidenceRates, confidence
from specdec_rt.sampling import rejection_sample
from specdec_rt.testing import chi_square_pvalue, sequence_counts, sequence_distribution, toy_pair

FORCED = dict(
    measure_costs=False,
    draft_cost=0.4,
    adapt_k=False,
    k_min=1,
    fallback_below=0.0,
    zero_rounds=10**6,
    min_speedup=0.0,
    defer_draft_prefill=False,
)  # always speculate (the first round too), k fixed: only the stop varies


def test_it_is_off_by_default():  # no gain on the shipped pairs (docs/decisions/0007-confidence-stop-off.md)
    assert SpecConfig().confidence_stop is False


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_a_bad_confidence_stop_is_a_named_error(bad):
    with pytest.raises(InvalidInputError, match=r"SpecConfig\.confidence_stop=" + repr(bad)):
        SpecConfig(confidence_stop=bad)


def test_confidence_is_the_largest_probability():
    logits = np.array([2.0, 0.5, -1.0, 2.0 - np.log(3.0)])
    p = np.exp(logits) / np.exp(logits).sum()
    assert confidence(logits) == pytest.approx(p.max())


def test_rates_count_the_drafts_up_to_the_first_rejection():
    r = ConfidenceRates(alpha=0.5, prior_weight=1.0)
    hi, lo, mid = r.bucket(0.99), r.bucket(0.2), r.bucket(0.95)
    assert len({hi, lo, mid}) == 3
    r.observe([0.99, 0.99, 0.2, 0.95], accepted=2)  # two accepted, the third rejected, the 4th unseen
    assert r.trials[hi] == pytest.approx(1.5) and r.hits[hi] == pytest.approx(1.5)  # decayed by 0.5
    assert r.trials[lo] == 1.0 and r.hits[lo] == 0.0
    assert r.trials[mid] == 0.0
    assert r.rate(0.99, prior=0.0) == pytest.approx(1.5 / 2.5)
    assert r.rate(0.2, prior=1.0) == pytest.approx(0.5)
    assert r.rate(0.95, prior=0.7) == pytest.approx(0.7)  # unmeasured: the prior


def test_a_chain_stops_once_its_survival_falls_below_the_floor():
    r = ConfidenceRates(prior_weight=1.0)
    for _ in range(50):
        r.observe([0.99, 0.1], accepted=1)  # sure drafts are right, unsure ones wrong
    stop = ChainStop(r, acceptance=0.8, floor=0.5)
    assert stop.more(0.99) and stop.more(0.98)
    assert not stop.more(0.1)
    assert stop.confs == [0.99, 0.98, 0.1]
    stop.observe(accepted=3)
    assert r.rate(0.1, prior=0.8) > ConfidenceRates(prior_weight=1.0).rate(0.1, prior=0.0)


def _run(stop: bool, distance: float, params: SamplingParams | None = None, k: int = 6):
    target, draft = toy_pair(8, seed=5, distance=distance)
    cfg = SpecConfig(k_init=k, k_max=k, confidence_stop=stop, **FORCED)
    sched = SpecDecScheduler(ModelDrafter(draft), ModelVerifier(target), cfg)
    plain = SpecDecScheduler(None, ModelVerifier(target), cfg)

    async def main():
        outs, plains, drafted, rounds = [], [], 0, 0
        for p in range(12):
            prompt = [p % 8, (3 * p + 1) % 8]
            res = await sched.run(prompt, 48, params)
            outs.append(res.token_ids)
            plains.append((await plain.run(prompt, 48, params, mode="ar")).token_ids)
            drafted, rounds = drafted + res.stats.drafted, rounds + res.stats.rounds
        return outs, plains, drafted, rounds

    return anyio.run(main)


def test_an_unsure_draft_drafts_less_and_the_greedy_output_does_not_change():
    off, plain, drafted_off, rounds_off = _run(False, 0.6)
    on, _, drafted_on, rounds_on = _run(True, 0.6)
    assert on == off == plain
    assert drafted_on < 0.5 * drafted_off  # the wrong drafts mostly not made
    # the cost model's price of the same tokens: a target call (1 + 0.05 per position) + 0.4 a draft
    assert rounds_on + 0.45 * drafted_on < 0.7 * (rounds_off + 0.45 * drafted_off)


def test_a_draft_that_is_always_right_keeps_its_whole_chains():
    _, _, drafted_off, _ = _run(False, 0.0)
    _, _, drafted_on, _ = _run(True, 0.0)
    assert drafted_on >= 0.95 * drafted_off


def test_stopped_chains_keep_the_sampled_distribution(monkeypatch):
    """Stopping depends on the draft alone, so the sequence distribution stays the target's;
    the same harness catches a sampler without the residual, with chains stopping."""
    vocab, length, prompt, n = 4, 3, [1, 2], 6000
    params = SamplingParams(temperature=1.0)
    target, draft = toy_pair(vocab, seed=3, distance=0.7)
    expected = sequence_distribution(target, prompt, length, params)
    stopped = []
    more = ChainStop.more

    def counting(self, c):
        go = more(self, c)
        stopped.append(not go)
        return go

    monkeypatch.setattr(ChainStop, "more", counting)

    def collect(sampler):
        cfg = SpecConfig(k_init=3, k_max=3, confidence_stop=True, **FORCED)
        sched = SpecDecScheduler(ModelDrafter(draft), ModelVerifier(target, sampler=sampler), cfg)
        return anyio.run(lambda: sequence_counts(sched, prompt, length, params, n=n, rng=np.random.default_rng(0)))

    assert chi_square_pvalue(collect(rejection_sample), expected) > 1e-3
    assert sum(stopped) > 0.1 * len(stopped)  # chains did stop early

    def no_residual(ids, q, p, rng):
        out = rejection_sample(ids, q, p, rng)
        n_acc = len(out) - 1
        if n_acc < len(ids):  # resample the rejected position from p, not norm(max(0, p - q))
            out[-1] = rng.choice(p.shape[1], p=p[n_acc] / p[n_acc].sum())
        return out

    assert chi_square_pvalue(collect(no_residual), expected) < 1e-6
