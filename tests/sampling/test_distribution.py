"""Sampled speculative decoding preserves the target's distribution over whole sequences.

A toy target over 4 tokens generates 3-token continuations: 64 possible sequences whose exact
probabilities are known (``sequence_distribution``). Speculative samples are checked against them
with a chi-square test at fixed seeds. The same test is run on deliberately broken samplers to
prove it has the power to catch them.
"""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from specdec_rt import ModelDrafter, ModelVerifier, SamplingParams, SpecConfig, SpecDecScheduler
from specdec_rt.sampling import rejection_sample, sample
from specdec_rt.testing import chi_square_pvalue, sequence_counts, sequence_distribution, toy_pair

VOCAB, LENGTH, PROMPT, N = 4, 3, [1, 2], 6000
CONFIG = SpecConfig(
    measure_costs=False,
    k_min=2,
    k_init=2,
    k_max=2,
    adapt_k=False,
    fallback_below=0.0,
    zero_rounds=10**6,
    min_speedup=0.0,
)  # always speculate


def collect(sampler, params: SamplingParams, n: int = N, mode: str = "spec", seed: int = 0) -> dict:
    target, draft = toy_pair(VOCAB, seed=3, distance=0.7)
    sched = SpecDecScheduler(ModelDrafter(draft), ModelVerifier(target, sampler=sampler), CONFIG)
    return anyio.run(
        lambda: sequence_counts(sched, PROMPT, LENGTH, params, n=n, rng=np.random.default_rng(seed), mode=mode)
    )


def expected(params: SamplingParams) -> dict:
    target, _ = toy_pair(VOCAB, seed=3, distance=0.7)
    return sequence_distribution(target, PROMPT, LENGTH, params)


# ----------------------------------------------------------------------------- broken samplers
def _split(ids, q, p, rng):
    k = len(ids)
    u = rng.random(k)
    p_x, q_x = p[np.arange(k), ids], q[np.arange(k), ids]
    return k, u, p_x, q_x


def no_residual(ids, q, p, rng):
    """The Go sketch's bug: after a rejection, resample from p instead of norm(max(0, p - q))."""
    k, u, p_x, q_x = _split(ids, q, p, rng)
    ok = u * q_x < p_x
    n = k if ok.all() else int(np.argmin(ok))
    return np.append(ids[:n], sample(p[min(n, k)], rng)).astype(np.int64)


def bonus_from_wrong_row(ids, q, p, rng):
    """Off by one: the bonus token drawn from p_{k-1} instead of p_k."""
    out = rejection_sample(ids, q, p, rng)
    if len(out) == len(ids) + 1:
        out[-1] = sample(p[len(ids) - 1], rng)
    return out


def inverted_ratio(ids, q, p, rng):
    """Accept with min(1, q/p) instead of min(1, p/q)."""
    k, u, p_x, q_x = _split(ids, q, p, rng)
    ok = u * p_x < q_x
    n = k if ok.all() else int(np.argmin(ok))
    res = np.maximum(p[n] - q[n], 0) if n < k else p[k]
    return np.append(ids[:n], sample(res if res.sum() > 0 else p[n], rng)).astype(np.int64)


def no_bonus(ids, q, p, rng):
    """Forgets the bonus token after full acceptance (lossless, but wastes a target call)."""
    out = rejection_sample(ids, q, p, rng)
    return out[:-1] if len(out) == len(ids) + 1 else out


PARAMS = {
    "t=1": SamplingParams(temperature=1.0),
    "t=0.7,top_k=3": SamplingParams(temperature=0.7, top_k=3),
    "t=1.3,top_p=0.8": SamplingParams(temperature=1.3, top_p=0.8),
}


@pytest.mark.parametrize("name", PARAMS)
def test_spec_sampling_matches_exact_sequence_distribution(name):
    params = PARAMS[name]
    assert chi_square_pvalue(collect(rejection_sample, params), expected(params)) > 1e-3


def test_plain_sampling_matches_too():  # the harness itself is right
    params = PARAMS["t=1"]
    assert chi_square_pvalue(collect(rejection_sample, params, mode="ar"), expected(params)) > 1e-3


@pytest.mark.parametrize("mutant", [no_residual, bonus_from_wrong_row, inverted_ratio])
def test_broken_samplers_are_caught(mutant):
    params = PARAMS["t=1"]
    assert chi_square_pvalue(collect(mutant, params), expected(params)) < 1e-6


def test_missing_bonus_is_caught_by_tokens_per_call():
    """Dropping the bonus token keeps the distribution (the next round drafts that position) but
    wastes work: with a perfect draft every round must emit k + 1 tokens."""
    target, draft = toy_pair(VOCAB, seed=3, distance=0.0)
    per_call = {}
    for sampler in (rejection_sample, no_bonus):
        sched = SpecDecScheduler(ModelDrafter(draft), ModelVerifier(target, sampler=sampler), CONFIG)
        res = anyio.run(lambda: sched.run(PROMPT, 60, SamplingParams(temperature=1.0, seed=1)))
        per_call[sampler] = res.stats.tokens_per_target_call
    # k = 2 drafts + the bonus, every round after the first (the target's prefill alone): 60 / 21
    assert per_call[rejection_sample] > 2.85
    assert per_call[no_bonus] <= 2.0
