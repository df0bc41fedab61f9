"""The first token waits for no draft model (``SpecConfig.defer_draft_prefill``, on by default):
a speculative request's first round is the target's prefill alone, with free drafts (n-gram
matches) when the drafter has them; the draft model reads the prompt in the next round, while
the first token is on its way. Output stays exact (greedy) and keeps the target's distribution
(sampled); the deferred prefill is still priced as a prefill, never as a catch-up or a step."""

from __future__ import annotations

import contextlib

import anyio
import numpy as np
import pytest

from specdec_rt import ModelDrafter, ModelVerifier, SamplingParams, SpecConfig, SpecDecScheduler
from specdec_rt.batching import BatchExecutor
from specdec_rt.drafters import CombinedDrafter, NgramDrafter
from specdec_rt.policy.acceptance import AcceptanceEWMA, CostModel
from specdec_rt.policy.request import RequestPolicy
from specdec_rt.testing import chi_square_pvalue, sequence_counts, sequence_distribution, toy_engine, toy_pair

STATIC = SpecConfig(measure_costs=False)  # toy models: costs from config, not from timing
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # n-gram matches: free drafts for the first round


def _first_event_calls(sched: SpecDecScheduler, target, draft, prompt, n: int, **kw):
    """``(target calls, draft calls)`` when the first event arrives, and the whole output."""

    async def main():
        seen = None
        ids: list[int] = []
        async for ev in sched.stream(prompt, n, **kw):
            if seen is None:
                seen = (target.calls, draft.calls)
            ids.extend(ev.token_ids)
        return seen, ids

    return anyio.run(main)


@pytest.mark.parametrize("combined", [False, True], ids=["model draft", "ngram+model"])
def test_the_first_token_comes_before_any_draft_model_call(combined):
    target, draft = toy_pair(8, seed=2, distance=0.3)
    drafter = CombinedDrafter(NgramDrafter(), ModelDrafter(draft)) if combined else ModelDrafter(draft)
    sched = SpecDecScheduler(drafter, ModelVerifier(target), STATIC)
    prompt = [5, 4, 6, 0, 7, 1]  # no n-gram match: the first round is plain
    (t_calls, d_calls), ids = _first_event_calls(sched, target, draft, prompt, 24)
    assert (t_calls, d_calls) == (1, 0)  # the target's prefill alone
    assert draft.calls > 0 and sched.totals.rounds > 1  # then the draft caught up and drafted
    plain = anyio.run(lambda: sched.run(prompt, 24, mode="ar"))
    assert ids == plain.token_ids  # greedy: exactly plain decoding's
    # with the deferral off the draft prefills (and drafts) before the first token, as before
    target, draft = toy_pair(8, seed=2, distance=0.3)
    drafter = CombinedDrafter(NgramDrafter(), ModelDrafter(draft)) if combined else ModelDrafter(draft)
    old = SpecDecScheduler(drafter, ModelVerifier(target), SpecConfig(measure_costs=False, defer_draft_prefill=False))
    (t_calls, d_calls), old_ids = _first_event_calls(old, target, draft, [5, 4, 6, 0], 24)
    assert d_calls > 0 and t_calls == 1
    assert old_ids == anyio.run(lambda: old.run([5, 4, 6, 0], 24, mode="ar")).token_ids


def test_the_first_round_verifies_free_drafts_with_the_prefill():
    target, draft = toy_pair(8, seed=2, distance=0.3)
    combined = CombinedDrafter(NgramDrafter(), ModelDrafter(draft))
    sched = SpecDecScheduler(combined, ModelVerifier(target), STATIC)
    stream = sched.stream(PROMPT, 24)

    async def first():
        async with contextlib.aclosing(stream):
            return await stream.__anext__()

    ev = anyio.run(first)
    assert ev.drafted > 0 and draft.calls == 0  # n-gram drafts, verified in the prefill call
    assert combined.used == {"ngram": 1, "model": 0}


class _Noting(ModelDrafter):
    """A model drafter that notes what the request had committed at its first call."""

    committed_at_first_call: int | None = None

    async def generate_draft(self, ctx, k):
        if self.committed_at_first_call is None:
            self.committed_at_first_call = int(ctx.generated.size)
        return await super().generate_draft(ctx, k)


def test_in_an_engine_the_draft_reads_the_prompt_after_the_first_event_is_handed_over(tmp_path):
    ex = BatchExecutor(chunk=4)
    target, draft = toy_pair(12, seed=3, distance=0.3, executor=ex)
    drafter = _Noting(draft)
    engine = toy_engine(target, drafter, tmp_path, config=STATIC, executor=ex, models=[target, draft])
    text = "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w0 w1 w2"

    async def main():
        async with engine:
            first = None
            got: list[int] = []
            async with engine.stream(text, max_new_tokens=16) as events:
                async for ev in events:
                    first = ev.token_ids if first is None and ev.token_ids else first
                    got.extend(ev.token_ids)
            plain = await engine.generate(text, max_new_tokens=16, mode="ar")
            return first, got, plain.token_ids

    first, got, plain = anyio.run(main)
    # the scheduler resumes after a yield only once the engine handed the event over: the
    # draft's first call came after the first token was out
    assert drafter.committed_at_first_call == len(first) >= 1
    assert draft.positions >= 14 + 1  # it read the prompt and the first token then
    assert got == plain  # exact


def test_seeded_requests_stay_reproducible_and_sampling_keeps_the_distribution():
    vocab, length, prompt, n = 4, 3, [1, 2, 1, 2, 1], 6000
    params = SamplingParams(temperature=1.0)
    target, draft = toy_pair(vocab, seed=3, distance=0.7)
    expected = sequence_distribution(target, prompt, length, params)
    config = SpecConfig(measure_costs=False, fallback_below=0.0, zero_rounds=10**6, min_speedup=0.0)
    combined = CombinedDrafter(NgramDrafter(), ModelDrafter(draft), min_match=2)
    sched = SpecDecScheduler(combined, ModelVerifier(target), config)
    counts = anyio.run(lambda: sequence_counts(sched, prompt, length, params, n=n, rng=np.random.default_rng(0)))
    assert chi_square_pvalue(counts, expected) > 1e-3
    assert combined.used["ngram"] >= n and combined.used["model"] > 0  # both kinds of round ran
    seeded = SamplingParams(temperature=0.8, seed=11)
    runs = [anyio.run(lambda: sched.run([1, 2, 3, 1, 2], 20, seeded)).token_ids for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]


# ----------------------------------------------------------------------------- the policy's side
def _costs(**kw) -> CostModel:  # measured, SmolLM2-like: target step 25 ms, int8 draft step 12 ms
    return CostModel(SpecConfig(), draft_token_s=0.012, verify_s={0: 0.025, 4: 0.030}, **kw)


def _policy(costs: CostModel, prompt: int, cheap_drafts: bool = False) -> RequestPolicy:
    p = RequestPolicy(
        SpecConfig(), "spec", AcceptanceEWMA.start(0.1, 0.9, prior_weight=100.0), costs, prompt_tokens=prompt
    )
    p.cheap_drafts = cheap_drafts
    assert p.start(64) is None  # its prefill pays
    return p


def test_the_deferred_prefill_is_the_model_drafts_first_round_not_a_catch_up():
    # alone: a stale plain step would make that round plain, and then the prompt a catch-up
    p = _policy(_costs(draft_prefill_s=0.0035, since_plain=100), 30)
    assert p.draft_length(64) == 0 and not p.cheap
    p.observe(0, 0, 0, t_draft=0.0, t_verify=0.3, timed=False)
    assert p.draft_length(63, at=1) > 0  # the draft reads the prompt and drafts now
    assert p.draft_length(62, at=2) == 0  # (the next round re-measures the plain step)
    # in a batch: unmeasured catch-up costs would call 400 missed tokens "behind"
    q = _policy(_costs(), 400, cheap_drafts=True)
    assert q.draft_length(64, batch=8) > 0 and q.cheap  # free drafts in the prefill's call
    q.observe(0, 2, 0, t_draft=0.0, t_verify=0.3, timed=False, alone=False, batch=8)
    assert q.draft_length(63, batch=8, at=1) > 0 and not q.cheap


def test_the_deferred_prefill_is_measured_as_a_prefill_of_what_the_draft_read():
    costs = _costs()
    p = _policy(costs, 40)
    assert p.draft_length(64) == 0
    p.observe(0, 0, 0, t_draft=0.0, t_verify=0.3, timed=False)
    k = p.draft_length(63, at=1)
    assert k > 1
    steps = (k - 1, 0.012 * (k - 1))
    p.observe(
        1, k, k, t_draft=0.2 + steps[1], t_verify=0.03, timed=False, steps=steps
    )  # read 41 tokens, then k - 1 steps
    assert costs.prefill_samples == [pytest.approx(0.2 / 41)]
    assert costs.verify_s == {0: 0.025, 4: 0.030}  # an untimed round: no verify or step measured as usual


def test_a_scheduler_prices_the_models_first_round_as_a_prefill_after_free_drafts():
    target, draft = toy_pair(8, seed=2, distance=0.3)
    combined = CombinedDrafter(NgramDrafter(), ModelDrafter(draft))
    config = SpecConfig(fallback_below=0.0, zero_rounds=10**6, min_speedup=0.0)
    sched = SpecDecScheduler(combined, ModelVerifier(target), config)
    anyio.run(lambda: sched.run(PROMPT, 24))
    assert combined.used["ngram"] >= 1 and combined.used["model"] >= 1
    assert len(sched.costs.prefill_samples) == 1  # the model's first round: a prefill, not a step
