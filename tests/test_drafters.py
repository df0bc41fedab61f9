"""N-gram (prompt lookup) and combined drafters: proposals, losslessness, distribution."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from specdec_rt import InvalidInputError, ModelDrafter, ModelVerifier, SamplingParams, SpecConfig, SpecDecScheduler
from specdec_rt.drafters import CombinedDrafter, NgramDrafter
from specdec_rt.testing import ToyLM, check_greedy_lossless, chi_square_pvalue, sequence_distribution, toy_pair

CASES = [
    # tokens, k, expected proposal
    ([1, 2, 3, 9, 1, 2], 3, [3, 9, 1]),  # the 2-gram "1 2" occurred before: propose what followed
    ([5, 1, 2, 3, 7, 1, 2, 3, 8, 1, 2, 3], 2, [8, 1]),  # the latest of several matches wins
    ([1, 2, 3, 4], 3, []),  # no repeat: nothing
    ([4, 4, 4], 5, [4]),  # overlapping match; the proposal stops at the end of the context
    ([7, 8, 9, 7, 8], 8, [9, 7, 8]),
]


@pytest.mark.parametrize("tokens,k,expected", CASES)
def test_ngram_proposals(tokens, k, expected):
    assert NgramDrafter(n_max=3).propose(np.array(tokens), k).tolist() == expected


def test_ngram_prefers_longer_matches_and_respects_k_max():
    d = NgramDrafter(n_max=2, k_max=2)
    tokens = np.array([3, 1, 5, 6, 2, 1, 7, 8, 2, 1])  # "2 1" -> 7 (longer) beats "1" -> 7 (same here)
    assert d.propose(tokens, 8).tolist() == [7, 8]
    tokens = np.array([1, 5, 9, 3, 1])  # only the 1-gram "1" matches
    assert NgramDrafter(n_max=3).propose(tokens, 2).tolist() == [5, 9]


@pytest.mark.parametrize("kwargs", [{"n_min": 0}, {"n_min": 3, "n_max": 2}, {"k_max": 0}])
def test_ngram_config_validation(kwargs):
    with pytest.raises(InvalidInputError):
        NgramDrafter(**kwargs)


def test_ngram_and_combined_are_lossless_greedy():
    target, draft = toy_pair(6, seed=2, distance=0.3)  # small vocab: repeats, so n-grams match
    prompts = [[1, 2, 3, 1, 2], [0], [4, 4, 4, 4]]
    anyio.run(check_greedy_lossless, NgramDrafter(), ModelVerifier(target), prompts, 60)
    combined = CombinedDrafter(NgramDrafter(), ModelDrafter(draft))
    anyio.run(check_greedy_lossless, combined, ModelVerifier(target), prompts, 60)
    assert combined.used["ngram"] > 0 and combined.used["model"] > 0


def test_ngram_sampling_keeps_the_target_distribution():
    target = ToyLM(4, seed=3)
    config = SpecConfig(measure_costs=False, k_min=2, k_init=2, k_max=2, adapt_k=False,
                        fallback_below=0.0, zero_rounds=10**6, min_speedup=0.0)
    sched = SpecDecScheduler(NgramDrafter(n_min=1), ModelVerifier(target), config)
    params, rng, counts = SamplingParams(temperature=1.0), np.random.default_rng(5), {}
    prompt = [1, 2, 1]  # "1" repeats: the drafter always has a proposal

    async def main():
        for _ in range(5000):
            key = tuple((await sched.run(prompt, 3, params, rng=rng)).token_ids)
            counts[key] = counts.get(key, 0) + 1

    anyio.run(main)
    assert chi_square_pvalue(counts, sequence_distribution(target, prompt, 3, params)) > 1e-3
    assert sched.totals.drafted > 0
