"""The step loop that batches model calls across requests (specdec_rt.batching.executor), on toy models.

Batched runs must change nothing a request sees: greedy rows equal the request run alone, seeded
sampled rows equal the same seed alone, and the sampled distribution is the target's. They must
also really batch (rows > 1 per call), chunk long feeds while others wait, and drop cancelled
callers without disturbing the rest.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec_rt import SamplingParams, SpecConfig
from specdec_rt.errors import EngineClosedError
from specdec_rt.testing import chi_square_pvalue, sequence_distribution, toy_scheduler

STATIC = SpecConfig(measure_costs=False)  # toy timings must not talk speculation out of running


async def _gather(sched, prompts, n, params=None, mode="spec"):
    return await asyncio.gather(*[sched.run(p, n, params, mode=mode) for p in prompts])


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 50),
    distance=st.sampled_from([0.0, 0.3, 0.8]),
    prompts=st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=12), min_size=2, max_size=6),
    n=st.integers(1, 24),
    mode=st.sampled_from(["spec", "ar"]),
)
def test_greedy_batched_rows_equal_each_request_alone(seed, distance, prompts, n, mode):
    solo_sched, _, _ = toy_scheduler(distance, vocab_size=10, seed=seed, config=STATIC)
    sched, target, _ = toy_scheduler(distance, vocab_size=10, seed=seed, config=STATIC, batched=True)

    async def main():
        solo = [await solo_sched.run(p, n, mode=mode) for p in prompts]
        batched = await _gather(sched, prompts, n, mode=mode)
        assert [r.token_ids for r in batched] == [r.token_ids for r in solo]
        assert all(len(r.token_ids) == n for r in batched)

    asyncio.run(main())
    if mode == "ar" and n > 1:
        assert max(target.batches) > 1  # plain rows of concurrent requests met in one call


def test_spec_and_ar_requests_share_batches_and_each_equals_its_solo_run():
    solo_sched, _, _ = toy_scheduler(0.3, vocab_size=10, config=STATIC)
    sched, target, draft = toy_scheduler(0.3, vocab_size=10, config=STATIC, batched=True)
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 1], [2, 2]]
    modes = ["spec", "ar", "spec", "ar", "spec"]

    async def main():
        solo = [await solo_sched.run(p, 30, mode=m) for p, m in zip(prompts, modes)]
        both = await asyncio.gather(*[sched.run(p, 30, mode=m) for p, m in zip(prompts, modes)])
        assert [r.token_ids for r in both] == [r.token_ids for r in solo]
        assert [r.stats.mode for r in both] == modes

    asyncio.run(main())
    assert max(draft.batches) > 1  # draft steps of the speculating requests were batched
    assert target.ragged_calls > 0  # verifies (several positions a row) met in one target call


def test_seeded_sampling_in_a_batch_equals_the_same_seed_alone():
    solo_sched, _, _ = toy_scheduler(0.5, vocab_size=10)
    sched, _, _ = toy_scheduler(0.5, vocab_size=10, batched=True)
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=s) for s in range(6)]

    async def main():
        solo = [await solo_sched.run([1, 2], 25, p) for p in params]
        batched = await asyncio.gather(*[sched.run([1, 2], 25, p) for p in params])
        assert [r.token_ids for r in batched] == [r.token_ids for r in solo]
        assert len({tuple(r.token_ids) for r in batched}) > 1

    asyncio.run(main())


def test_batched_sampling_preserves_the_target_distribution():
    """Many concurrent sampled requests (batched draft steps, per-row verify) against the exact
    distribution of 3-token continuations of the toy target."""
    config = SpecConfig(
        measure_costs=False,
        k_min=2,
        k_init=2,
        k_max=2,
        adapt_k=False,
        fallback_below=0.0,
        zero_rounds=10**6,
        min_speedup=0.0,
    )  # always speculate
    sched, target, draft = toy_scheduler(0.7, vocab_size=4, seed=3, config=config, batched=True)
    params = SamplingParams(temperature=1.0)
    rng = np.random.default_rng(0)

    async def main():
        counts: dict = {}
        for _ in range(75):  # 75 waves of 40 concurrent requests
            res = await asyncio.gather(
                *[sched.run([1, 2], 3, params, rng=np.random.default_rng(rng.integers(2**63))) for _ in range(40)]
            )
            for r in res:
                counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
        return counts

    counts = asyncio.run(main())
    assert max(draft.batches) > 1
    assert chi_square_pvalue(counts, sequence_distribution(target, [1, 2], 3, params)) > 1e-3


def test_long_prompts_are_chunked_while_others_decode_and_outputs_do_not_change(monkeypatch):
    solo_sched, _, _ = toy_scheduler(0.3, vocab_size=10, config=STATIC)
    sched, target, _ = toy_scheduler(0.3, vocab_size=10, config=STATIC, batched=True)  # chunk = 4
    long_prompt = list(np.random.default_rng(1).integers(0, 10, size=40))
    fed: list[int] = []
    real = type(target.start()).run_sync

    def spy(self, ids, rows, past):
        if self.model is target:
            fed.append(len(ids))
        return real(self, ids, rows, past)

    async def main():
        solo = [await solo_sched.run(p, 20, mode="ar") for p in ([1, 2], long_prompt)]
        short = asyncio.ensure_future(sched.run([1, 2], 20, mode="ar"))
        await asyncio.sleep(0)
        long = await sched.run(long_prompt, 20, mode="ar")
        assert [(await short).token_ids, long.token_ids] == [r.token_ids for r in solo]

    monkeypatch.setattr(type(target.start()), "run_sync", spy)
    asyncio.run(main())
    # the prompt went in pieces, never whole: the first with the other new prompt (2 chunks),
    # the rest a chunk at a time while the short request decoded
    assert 40 not in fed and max(fed) <= 2 * 4 and fed.count(4) >= 3


def test_a_cancelled_caller_leaves_the_queue_and_the_others_finish_exactly():
    solo_sched, _, _ = toy_scheduler(0.3, vocab_size=10, config=STATIC)
    sched, target, draft = toy_scheduler(0.3, vocab_size=10, config=STATIC, batched=True)
    prompts = [[1], [2, 3], [4, 5, 6], [7]]

    async def main():
        solo = [await solo_sched.run(p, 30) for p in prompts]
        tasks = [asyncio.ensure_future(sched.run(p, 30)) for p in prompts]
        for _ in range(30):
            await asyncio.sleep(0)
        tasks[1].cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(done[1], asyncio.CancelledError)
        assert [done[i].token_ids for i in (0, 2, 3)] == [solo[i].token_ids for i in (0, 2, 3)]
        assert sched.running == 0

    asyncio.run(main())


def test_closing_the_executor_fails_waiting_calls_with_engine_closed():
    sched, target, _ = toy_scheduler(0.3, vocab_size=10, config=STATIC, batched=True)

    async def main():
        tasks = [asyncio.ensure_future(sched.run([1, 2], 50)) for _ in range(3)]
        for _ in range(10):
            await asyncio.sleep(0)
        await target.executor.aclose()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(d, EngineClosedError) for d in done), done
        with pytest.raises(EngineClosedError):
            await sched.run([1], 3)

    asyncio.run(main())


def test_new_prompts_arriving_while_others_verify_never_strand_a_call():
    """Two first prompts (prefilled together) and a verify-like multi-position call of the same
    model, submitted in one iteration: every call is answered (a stranded one would hang,
    bounded by wait_for) with the logits each gets alone."""
    from specdec_rt.batching.executor import BatchExecutor
    from specdec_rt.testing import ToyLM

    model, ref = ToyLM(10, seed=4, executor=BatchExecutor(chunk=4)), ToyLM(10, seed=4)

    async def main():
        a = model.start()
        await a.extend(np.array([1, 2, 3]), 1)
        b, c = model.start(), model.start()
        feeds = [(a, [4, 5, 6], 3), (b, [7, 8, 9, 1, 2], 1), (c, [3, 3], 1)]
        got = await asyncio.wait_for(asyncio.gather(*[s.extend(np.array(f), r) for s, f, r in feeds]), 10)
        want = [
            ref.logits_at(np.array([1, 2, 3, 4, 5, 6]))[-3:],
            ref.logits_at(np.array([7, 8, 9, 1, 2]))[-1:],
            ref.logits_at(np.array([3, 3]))[-1:],
        ]
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        assert 2 in model.batches  # the two first prompts went in one call

    asyncio.run(main())


def test_batch_cost_model_predictions_and_robustness():
    """The batch rule: with a cheap batch, drafting alone in it does not pay; a noisy sample that
    says fewer rows cost more is not believed; unmeasured batch sizes predict no gain."""
    from specdec_rt.policy.acceptance import CostModel

    steps = {1: 0.030, 7: 0.050, 8: 0.054}
    costs = CostModel(SpecConfig(), batch_step_s=steps.get)
    costs.draft_token_s, costs.verify_s = 0.010, {0: 0.030, 4: 0.036}
    alone = costs.batch_speedup(0.8, 4, 1)
    assert alone == costs.speedup(0.8, 4) > 1.2  # alone: the usual rule
    assert costs.batch_speedup(0.8, 4, 8) < 1.0  # 8 rows: the batched plain step wins
    assert costs.batch_speedup(0.8, 4, 3) == 0.0  # never measured at 3 or 2 rows
    steps[7] = 0.5  # a slow sample at 7 rows
    assert costs.batch_speedup(0.8, 4, 8) < 1.0


def test_the_first_call_of_a_batch_size_is_not_a_cost_sample():
    sched, target, _ = toy_scheduler(0.3, vocab_size=10, config=STATIC, batched=True)

    async def main():
        await asyncio.gather(*[sched.run([i], 1, mode="ar") for i in range(3)])  # one 3-row step
        assert target.executor.step_seconds(target, 3) is None
        await asyncio.gather(*[sched.run([i], 3, mode="ar") for i in range(3)])
        assert target.executor.step_seconds(target, 3) is not None

    asyncio.run(main())


def test_the_cost_table_keeps_the_least_sample_and_the_measured_shapes_in_order():
    from specdec_rt.batching.executor import COST_SAMPLES, BatchExecutor

    ex, model = BatchExecutor(), object()
    for positions, seconds in [(24, 0.07), (8, 0.05), (16, 0.06), (8, 0.04), (8, 0.045)]:
        ex.record(model, 8, positions, seconds)
    assert ex.measured_positions(model, 8) == [8, 16, 24]
    assert ex.step_seconds(model, 8) == 0.04 and ex.step_seconds(model, 8, 24) == 0.07
    assert ex.step_seconds(model, 4) is None and ex.measured_positions(model, 4) == []
    for _ in range(COST_SAMPLES):  # the least of the *recent* samples: an old fast one ages out
        ex.record(model, 8, 8, 0.05)
    assert ex.step_seconds(model, 8) == 0.05
