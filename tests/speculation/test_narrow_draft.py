"""A draft with fewer ids than its target (a target vocabulary padded past the tokenizer's, as
DeepSeek-R1-Distill-Qwen-7B's 152064 rows against Qwen2.5-0.5B's 151936): widened, it never
proposes the ids it lacks, reads target ids it lacks, and speculation stays exact."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from specdec_rt import (
    InvalidInputError,
    ModelDrafter,
    ModelVerifier,
    RequestContext,
    SamplingParams,
    SpecConfig,
    SpecDecScheduler,
)
from specdec_rt.testing import ToyLM, chi_square_pvalue, sequence_counts, sequence_distribution

WIDE, NARROW = 8, 6
CONFIG = SpecConfig(k_min=1, k_init=3, k_max=4, measure_costs=False, fallback_below=0.0, min_speedup=0.0)


def _pair(seed: int = 0) -> tuple[ToyLM, ToyLM]:
    """A target of WIDE ids and a draft of the first NARROW, with the target's logits over them."""
    target = ToyLM(WIDE, 2, seed)
    rows = [a * WIDE + b for a in range(NARROW) for b in range(NARROW)]  # order 2: context (a, b)
    draft = ToyLM(NARROW, 2, table=target.table[rows, :NARROW])
    return target, draft


def _widened(draft: ToyLM) -> ModelDrafter:
    drafter = ModelDrafter(draft)
    drafter.widen(WIDE)
    return drafter


def test_a_widened_draft_reads_ids_it_lacks_and_proposes_only_its_own():
    _, draft = _pair()
    drafter = _widened(draft)
    ctx = RequestContext([1, 7, 6, 2, 7], 32)  # 6 and 7: target ids the draft has no row for
    drafts = anyio.run(drafter.generate_draft, ctx, 4)
    assert len(drafts) == 4 and all(0 <= d.id < NARROW for d in drafts)
    drafter.release(ctx)
    sampled = RequestContext([1, 7, 6, 2, 7], 32, SamplingParams(temperature=1.0), rng=np.random.default_rng(0))
    for d in anyio.run(drafter.generate_draft, sampled, 4):
        assert d.probs is not None and d.probs.shape == (WIDE,) and not d.probs[NARROW:].any()
    drafter.release(sampled)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_spec_with_a_narrower_draft_equals_ar(seed):
    target, draft = _pair(seed)
    sched = SpecDecScheduler(_widened(draft), ModelVerifier(target), CONFIG)
    prompt = [1, 7, 3, 6]

    async def main():
        ar = await sched.run(prompt, 40, mode="ar")
        spec = await sched.run(prompt, 40)
        assert spec.token_ids == ar.token_ids
        return spec

    spec = anyio.run(main)
    assert spec.stats.drafted > 0 and spec.stats.accepted > 0  # the shared ids do get accepted


def test_sampling_with_a_narrower_draft_keeps_the_target_distribution():
    target, draft = _pair(3)
    sched = SpecDecScheduler(_widened(draft), ModelVerifier(target), CONFIG)
    params = SamplingParams(temperature=1.0)
    prompt = [2, 7]
    counts = anyio.run(lambda: sequence_counts(sched, prompt, 2, params, n=4000, rng=np.random.default_rng(5)))
    assert chi_square_pvalue(counts, sequence_distribution(target, prompt, 2, params)) > 1e-3
    assert any(t >= NARROW for seq in counts for t in seq)  # ids only the target has still come out


def test_a_draft_cannot_be_narrowed():
    _, draft = _pair()
    with pytest.raises(InvalidInputError, match="cannot widen a vocabulary of 6 ids to 4"):
        ModelDrafter(draft).widen(4)
