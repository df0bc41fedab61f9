"""The scheduler on toy models: lossless (greedy and sampled), budgets, stops, errors, cancellation."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec_rt import (
    ContextLengthError,
    DraftInferrer,
    DraftToken,
    InferenceError,
    InvalidInputError,
    ModelDrafter,
    ModelVerifier,
    RequestContext,
    SamplingParams,
    SpecConfig,
    SpecDecScheduler,
    TargetVerifier,
    Verdict,
)
from specdec_rt.drafters import NgramDrafter
from specdec_rt.testing import FaultyModel, ToyLM, check_greedy_lossless, toy_pair, toy_scheduler

STATIC = SpecConfig(measure_costs=False)  # toy models: costs from config, not from timing


def run(coro):
    return anyio.run(lambda: coro)


# ----------------------------------------------------------------------------- greedy exactness
@settings(max_examples=60, derandomize=True, deadline=None)
@given(
    seed=st.integers(0, 1000),
    vocab=st.integers(2, 12),
    distance=st.sampled_from([0.0, 0.2, 0.5, 0.8, 1.0]),
    prompt=st.lists(st.integers(0, 1), min_size=1, max_size=6),
    max_new=st.integers(1, 40),
    k_max=st.integers(1, 8),
)
def test_greedy_spec_equals_ar_for_any_draft(seed, vocab, distance, prompt, max_new, k_max):
    target, draft = toy_pair(vocab, seed=seed, distance=distance)
    config = SpecConfig(k_min=1, k_init=1, k_max=k_max, measure_costs=False)
    sched = SpecDecScheduler(ModelDrafter(draft), ModelVerifier(target), config)

    async def main():
        ar = await sched.run(prompt, max_new, mode="ar")
        spec = await sched.run(prompt, max_new)
        assert spec.token_ids == ar.token_ids
        assert len(spec.token_ids) == max_new  # exactly max_new_tokens (no stop ids here)
        assert spec.stats.new_tokens == max_new and spec.finish_reason == "length"

    run(main())


def test_check_greedy_lossless_helper_catches_a_broken_verifier():
    target, draft = toy_pair(6, distance=0.5)

    class OffByOne(ModelVerifier):  # emits the wrong recovered token
        async def verify_and_accept(self, ctx, drafts):
            v = await super().verify_and_accept(ctx, drafts)
            if drafts:
                v.tokens[-1] = (v.tokens[-1] + 1) % 6
            return v

    run(check_greedy_lossless(ModelDrafter(draft), ModelVerifier(target), [[1, 2]], 20))
    with pytest.raises(AssertionError, match="spec"):
        run(check_greedy_lossless(ModelDrafter(draft), OffByOne(target), [[1, 2]], 20))


# ----------------------------------------------------------------------------- budgets and stops
def test_stop_id_in_the_middle_of_an_accepted_block():
    sched, target, _ = toy_scheduler(distance=0.0, vocab_size=8, config=STATIC)  # perfect draft
    lengths = []

    class Recording(ModelVerifier):
        async def verify_and_accept(self, ctx, drafts):
            v = await super().verify_and_accept(ctx, drafts)
            lengths.append(len(v.tokens))
            return v

    sched.verifier = Recording(target)

    async def main():
        ar = (await sched.run([3, 1], 40, mode="ar")).token_ids
        stop = ar[6]
        cut = ar.index(stop) + 1
        lengths.clear()
        events = [ev async for ev in sched.stream([3, 1], 40, stop_ids=[stop])]
        out = [t for ev in events for t in ev.token_ids]
        assert out == ar[:cut]  # ends with the stop id, nothing after it
        assert events[-1].finished == "stop"
        assert sum(lengths) > cut  # the target had emitted tokens beyond the stop: they were cut

    run(main())


def test_eos_ids_of_the_scheduler_stop_generation():
    target, draft = toy_pair(8, distance=0.3)
    plain = SpecDecScheduler(ModelDrafter(draft), ModelVerifier(target), STATIC)
    ar = run(plain.run([2], 30, mode="ar")).token_ids
    eos = ar[4]
    sched = SpecDecScheduler(ModelDrafter(draft), ModelVerifier(target), STATIC, eos_ids=[eos])
    res = run(sched.run([2], 30))
    assert res.token_ids == ar[: ar.index(eos) + 1] and res.finish_reason == "stop"


# ----------------------------------------------------------------------------- fallback
class OracleDrafter(ModelDrafter):
    """Drafts the target's own greedy tokens (perfect) or, while ``wrong(ctx)``, a token the
    target never picks greedily (always rejected)."""

    def __init__(self, target: ToyLM, wrong):
        super().__init__(target)
        self.target, self.wrong = target, wrong

    async def generate_draft(self, ctx, k):
        ids = list(ctx.tokens)
        out = []
        for _ in range(k):
            best = int(np.argmax(self.target.logits_at(np.array(ids))[-1]))
            tok = (best + 1) % self.target.vocab_size if self.wrong(ctx) else best
            out.append(DraftToken(tok))
            ids.append(tok)
        return out


def test_always_wrong_draft_falls_back_within_configured_rounds():
    target = ToyLM(8, seed=4)
    config = SpecConfig(zero_rounds=3, measure_costs=False, probe_every=1000, probe_max_every=1000)
    sched = SpecDecScheduler(OracleDrafter(target, lambda ctx: True), ModelVerifier(target), config)
    res = run(sched.run([1], 50))
    first = res.stats.fallbacks[0]
    assert first.to == "ar" and first.reason in ("zero_rounds", "ewma")
    assert res.stats.rounds <= 3  # at most 3 speculative rounds before plain decoding
    assert res.stats.ar_steps == 50 - res.stats.rounds


def test_draft_that_becomes_good_again_brings_speculation_back_without_flapping():
    target = ToyLM(8, seed=5)
    config = SpecConfig(measure_costs=False, probe_every=8)
    drafter = OracleDrafter(target, lambda ctx: ctx.generated.size < 40)
    sched = SpecDecScheduler(drafter, ModelVerifier(target), config)
    res = run(sched.run([1], 300))
    switches = [(f.to, f.reason) for f in res.stats.fallbacks]
    assert switches[0][0] == "ar" and switches[1] == ("spec", "probe_ok")
    assert len(switches) == 2  # back to speculation once, and it stays
    assert res.stats.fallbacks[1].at <= 40 + 2 * 32  # within two probe intervals of recovering
    assert res.stats.tokens_per_target_call > 2.5


def test_hysteresis_keeps_a_borderline_draft_from_flapping():
    target, draft = toy_pair(8, seed=11, distance=0.55)
    sched = SpecDecScheduler(ModelDrafter(draft), ModelVerifier(target), STATIC)
    res = run(sched.run([1, 2], 400))
    assert len(res.stats.fallbacks) <= 3


# ----------------------------------------------------------------------------- errors and input
@pytest.mark.parametrize(
    "args,kwargs,exc,msg",
    [
        (([], 5), {}, InvalidInputError, "prompt"),
        (([1], 0), {}, InvalidInputError, "max_new_tokens"),
        (([1], 5), {"mode": "beam"}, InvalidInputError, "mode"),
        (([1] * 4090, 10), {}, ContextLengthError, "4090 tokens"),
        (([-1], 5), {}, InvalidInputError, "non-negative"),
        (([1, 2, 8, 3], 5), {}, InvalidInputError, r"token id 8 is outside the model's vocabulary \(ids 0\.\.7\)"),
    ],
)
def test_bad_input_fails_before_any_model_call(args, kwargs, exc, msg):
    sched, target, draft = toy_scheduler(config=STATIC)
    with pytest.raises(exc, match=msg):
        run(sched.run(*args, **kwargs))
    assert target.calls == 0 and draft.calls == 0


def test_model_failure_fails_that_request_only_and_releases_state():
    target, draft = toy_pair(8, distance=0.3)
    faulty_t, faulty_d = FaultyModel(target, fail_on=3), FaultyModel(draft, fail_on=-1)
    sched = SpecDecScheduler(ModelDrafter(faulty_d), ModelVerifier(faulty_t), STATIC)
    with pytest.raises(InferenceError, match="injected failure"):
        run(sched.run([1, 2], 40))
    assert faulty_t.open_sessions == 0 and faulty_d.open_sessions == 0
    ok = run(sched.run([1, 2], 40))  # the next request works and is still exact
    ar = run(SpecDecScheduler(None, ModelVerifier(target)).run([1, 2], 40, mode="ar"))
    assert ok.token_ids == ar.token_ids


def test_spec_mode_without_a_drafter_is_a_clear_error():
    sched = SpecDecScheduler(None, ModelVerifier(ToyLM()))
    with pytest.raises(InvalidInputError, match="needs a drafter"):
        sched.stream([1], 4)


# ----------------------------------------------------------------------------- cancellation
def _tracked():
    target, draft = toy_pair(8, distance=0.2)
    t, d = FaultyModel(target, -1), FaultyModel(draft, -1)

    class SlowDrafter(ModelDrafter):
        async def generate_draft(self, ctx, k):
            await anyio.sleep(0.002)
            return await super().generate_draft(ctx, k)

    return SpecDecScheduler(SlowDrafter(d), ModelVerifier(t), STATIC), t, d


def test_cancel_mid_request_releases_state_and_keeps_scheduler_usable():
    sched, t, d = _tracked()
    seen = []

    async def main():
        async def consume():
            async for ev in sched.stream([1, 2], 200):
                seen.extend(ev.token_ids)

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await anyio.sleep(0.02)
            tg.cancel_scope.cancel()
        assert 0 < len(seen) < 200
        assert t.open_sessions == 0 and d.open_sessions == 0
        again = await sched.run([1, 2], 200)
        ar = await sched.run([1, 2], 200, mode="ar")
        assert again.token_ids == ar.token_ids and again.token_ids[: len(seen)] == seen

    run(main())


def test_timeout_and_early_close_release_state():
    sched, t, d = _tracked()

    async def main():
        with anyio.move_on_after(0.01) as scope:
            await sched.run([3], 300)
        assert scope.cancelled_caught
        assert t.open_sessions == 0 and d.open_sessions == 0
        stream = sched.stream([3], 300)
        async for _ in stream:
            break
        await stream.aclose()
        assert stream.stats.finish_reason == "cancelled"
        assert t.open_sessions == 0 and d.open_sessions == 0

    run(main())


# ----------------------------------------------------------------------------- concurrency, stats
def test_concurrent_requests_match_sequential():
    sched, _, _ = toy_scheduler(distance=0.3, vocab_size=10, config=STATIC)
    prompts = [[i, (i * 7) % 10] for i in range(8)]

    async def main():
        expected = [(await sched.run(p, 30, mode="ar")).token_ids for p in prompts]
        got = [None] * len(prompts)

        async def one(i):
            got[i] = (await sched.run(prompts[i], 30)).token_ids

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        assert got == expected

    run(main())


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    sched, _, _ = toy_scheduler(distance=0.4, vocab_size=10)  # measured costs: must not matter
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    a = run(sched.run([1], 60, p)).token_ids
    b = run(sched.run([1], 60, p)).token_ids
    c = run(sched.run([1], 60, SamplingParams(temperature=1.0, top_p=0.9, seed=8))).token_ids
    assert a == b and a != c


def test_stats_are_consistent():
    sched, target, _ = toy_scheduler(distance=0.2, vocab_size=8, config=STATIC)
    calls0 = target.calls
    res = run(sched.run([1, 2, 3], 100))
    s = res.stats
    assert s.new_tokens == 100 == len(res.token_ids)
    assert s.rounds + s.ar_steps == target.calls - calls0  # one target call per round
    assert s.accepted <= s.drafted and 0 <= s.acceptance_rate <= 1
    assert s.new_tokens == s.accepted + s.rounds + s.ar_steps  # each call adds accepted + 1
    assert s.position_drafted[0] == s.rounds
    assert all(0 <= a <= 1 for a in s.per_position_acceptance)
    assert s.to_dict()["tokens_per_target_call"] == pytest.approx(100 / (s.rounds + s.ar_steps))
    assert sched.totals.new_tokens >= 100


def test_long_prompt_short_answer_decodes_plainly_when_the_draft_prefill_costs_more():
    from specdec_rt.policy.acceptance import AcceptanceEWMA, CostModel
    from specdec_rt.policy.request import RequestPolicy

    # measured (SmolLM2-like): target step 25 ms, verify slope 1.25 ms/position, int8 draft step
    # 12 ms, draft prefill 3.5 ms per prompt token; acceptance 0.9 -> best speedup ~1.33x
    def policy(prompt):
        costs = CostModel(SpecConfig(), draft_token_s=0.012, verify_s={0: 0.025, 4: 0.030}, draft_prefill_s=0.0035)
        return RequestPolicy(SpecConfig(), "spec", AcceptanceEWMA.start(0.1, 0.9), costs, prompt_tokens=prompt)

    long = policy(250)  # 0.875 s of draft prefill > ~0.4 s saved over 64 tokens
    event = long.start(64)
    assert event is not None and event.reason == "prefill" and event.to == "ar"
    assert all(long.draft_length(64 - i) == 0 for i in range(63))  # and no probes later
    short = policy(30)  # 0.105 s of prefill: speculation pays
    assert short.start(64) is None
    # the first round is the target's prefill alone (the first token waits for no draft), the next drafts
    assert short.draft_length(64) == 0 and short.draft_length(63, at=1) > 0
    assert policy(250).start(1000) is None  # a long answer amortizes the prefill
    unmeasured = RequestPolicy(
        SpecConfig(), "spec", AcceptanceEWMA.start(0.1, 0.9), CostModel(SpecConfig()), prompt_tokens=5000
    )
    assert unmeasured.start(8) is None  # nothing measured yet: speculate and learn


def test_a_drafter_with_free_drafts_keeps_speculating_with_those_when_the_prefill_does_not_pay():
    from specdec_rt.policy.acceptance import AcceptanceEWMA, CostModel
    from specdec_rt.policy.request import RequestPolicy

    costs = CostModel(SpecConfig(), draft_token_s=0.012, verify_s={0: 0.025, 4: 0.030}, draft_prefill_s=0.0035)
    p = RequestPolicy(SpecConfig(), "spec", AcceptanceEWMA.start(0.1, 0.9), costs, prompt_tokens=250)
    p.cheap_drafts = True  # n-gram matches: they need no prefill
    event = p.start(64)
    assert event is not None and event.reason == "prefill_free_drafts" and event.to == "spec"
    k = p.draft_length(64)
    assert k > 0 and p.cheap  # free drafts only: the drafter never calls its model
    p.observe(0, k, k, t_draft=0.0001, t_verify=0.03, timed=False)  # its first round read no prompt: no prefill sample
    p.observe(1, k, k, t_draft=0.0001, t_verify=0.03)  # a free round alone: its verify is measured, not its draft cost
    assert costs.draft_token_s == 0.012 and costs.draft_prefill_s == 0.0035 and not costs.prefill_samples
    for i in range(30):  # matches that keep missing: their own acceptance says stop
        k = p.draft_length(60)
        p.observe(i + 1, k, 0, t_draft=0.0, t_verify=0.03)
    assert p.draft_length(50) == 0 and not p.cheap and p.speculating and p.cheap_ewma.value < 0.2
    # in a batch the model does not draft for it either (it never read the prompt)
    q = RequestPolicy(
        SpecConfig(),
        "spec",
        AcceptanceEWMA.start(0.1, 0.9),
        CostModel(
            SpecConfig(),
            draft_token_s=0.001,
            verify_s={0: 0.025, 4: 0.026},
            draft_prefill_s=0.0035,
            batch_step_s=lambda rows, positions=None: 0.03 * rows,
            batched_verify=True,
            draft_step_s=lambda rows: 0.001,
        ),
        prompt_tokens=5000,
    )
    q.cheap_drafts = True
    assert q.start(8) is not None and q.free_only
    for at in range(5):
        if q.draft_length(8 - at, batch=4, at=at):
            assert q.cheap


def test_one_slow_first_prefill_is_outvoted_by_the_next_measurements():
    """A cold engine's first draft prefill also pays for allocations; the estimate is a median
    of recent rounds, so two ordinary ones undo it (an EWMA kept it for dozens of requests)."""
    from specdec_rt.policy.acceptance import CostModel

    costs = CostModel(SpecConfig(), draft_token_s=0.012, verify_s={0: 0.025, 4: 0.030})
    costs.observe_prefill(40, 4, 40 * 0.050 + 3 * 0.012)  # 50 ms a token: cold
    assert costs.draft_prefill_s == pytest.approx(0.050)
    for _ in range(2):
        costs.observe_prefill(40, 4, 40 * 0.002 + 3 * 0.012)  # 2 ms a token
    assert costs.draft_prefill_s == pytest.approx(0.002)


def test_prefill_rule_is_never_a_standing_verdict():
    """A plain request measures nothing, so the prefill rule must let some requests speculate,
    or one bad estimate would switch speculation off for every later request."""
    from specdec_rt.policy.acceptance import PREFILL_EXPLORE_EVERY, AcceptanceEWMA, CostModel
    from specdec_rt.policy.request import RequestPolicy

    costs = CostModel(
        SpecConfig(),
        draft_token_s=0.012,
        verify_s={0: 0.025, 4: 0.030},
        draft_prefill_s=0.0035,
        prefill_samples=[0.0035] * 3,
    )
    verdicts = [
        RequestPolicy(SpecConfig(), "spec", AcceptanceEWMA.start(0.1, 0.9), costs, prompt_tokens=250).start(64)
        for _ in range(3 * PREFILL_EXPLORE_EVERY)
    ]
    explored = [i for i, v in enumerate(verdicts) if v is None]
    assert explored == [PREFILL_EXPLORE_EVERY - 1, 2 * PREFILL_EXPLORE_EVERY - 1, 3 * PREFILL_EXPLORE_EVERY - 1]
    # on fewer than 3 measurements, every second request explores
    few = CostModel(SpecConfig(), draft_token_s=0.012, verify_s={0: 0.025, 4: 0.030}, draft_prefill_s=0.0035)
    verdicts = [
        RequestPolicy(SpecConfig(), "spec", AcceptanceEWMA.start(0.1, 0.9), few, prompt_tokens=250).start(64)
        for _ in range(6)
    ]
    assert [i for i, v in enumerate(verdicts) if v is None] == [1, 3, 5]
    # when no draft length pays at all (here: acceptance 0.1), the prefill rule abstains and the
    # per-round cost rule (which probes) decides
    slow = CostModel(SpecConfig(), draft_token_s=0.012, verify_s={0: 0.025, 4: 0.030}, draft_prefill_s=0.0035)
    low = RequestPolicy(SpecConfig(), "spec", AcceptanceEWMA.start(0.1, 0.1), slow, prompt_tokens=250)
    assert low.start(64) is None and slow.prefill_skips == 0


def test_plain_rounds_are_measured_after_the_first_round():
    """A plain target step alone is the unit of every cost: ``ar`` requests measure it (every
    round after the first, which holds the prefill), as do a speculative request's plain rounds
    before it ever drafted. Before, a round counted only once some round had drafted, so a
    warm-up's plain request (and every ``ar`` request) measured nothing."""
    target = ToyLM(8, seed=4)
    sched = SpecDecScheduler(ModelDrafter(ToyLM(8, seed=5)), ModelVerifier(target), SpecConfig())
    run(sched.run([1, 2, 3], 1, mode="ar"))
    assert not sched.costs.verify_s  # one round: the prefill, not a step
    run(sched.run([1, 2, 3], 6, mode="ar"))
    assert list(sched.costs.verify_s) == [0] and sched.costs.draft_token_s is None


class _Drafts(DraftInferrer):
    """A plug-in drafter that proposes ``proposals`` every round."""

    def __init__(self, proposals) -> None:
        self.proposals = proposals

    async def generate_draft(self, ctx, k):
        return self.proposals

    def release(self, ctx) -> None:
        pass


class _Emits(TargetVerifier):
    """A plug-in verifier that rejects every draft and emits ``token`` (its vocabulary: 8)."""

    vocab_size = 8

    def __init__(self, token) -> None:
        self.token = token

    async def verify_and_accept(self, ctx, drafts):
        return Verdict(np.array([self.token]), 0)

    def release(self, ctx) -> None:
        pass


@pytest.mark.parametrize(
    "proposals,msg",
    [
        ([DraftToken(8)], "drafter proposed token id 8 .*outside the vocabulary .ids 0..7"),
        ([DraftToken(-2)], "drafter proposed token id -2"),
        ([3], "drafter returned 3 as draft 0: need a DraftToken"),
        ([DraftToken("3")], "need a DraftToken with an integer id"),
    ],
)
def test_a_plug_in_drafters_bad_proposals_are_named_before_the_target_call(proposals, msg):
    target = ToyLM(8, seed=1)
    sched = SpecDecScheduler(
        _Drafts(proposals), ModelVerifier(target), SpecConfig(adapt_k=False, k_init=2, measure_costs=False)
    )
    with pytest.raises(InferenceError, match=msg):
        anyio.run(lambda: sched.run([1, 2, 3], 4))
    assert target.calls == 1  # refused before the target saw them (its one call: the first round's prefill)


@pytest.mark.parametrize(
    "token,msg",
    [
        (19, "emitted token id 19, outside the vocabulary .ids 0..7"),
        (-5, "emitted token id -5"),
        (1.7, "need a Verdict with integer tokens"),
    ],
)
def test_a_plug_in_verifiers_token_outside_the_vocabulary_is_an_error_not_output(token, msg):
    sched = SpecDecScheduler(_Drafts([DraftToken(1)]), _Emits(token), SpecConfig(measure_costs=False))
    for mode in ("spec", "ar"):
        with pytest.raises(InferenceError, match=msg):
            anyio.run(lambda: sched.run([1, 2, 3], 4, mode=mode))


def test_request_context_options_after_stop_ids_are_keywords_and_the_old_positional_form_warns():
    """``max_length`` and the options after it are keywords; passed by position they still work,
    with a DeprecationWarning, and a value given both ways is an error naming it."""
    with pytest.raises(ContextLengthError):
        RequestContext([1, 2, 3], 4, None, (), max_length=6)
    with pytest.warns(DeprecationWarning, match="max_length, rng, vocab_size by keyword"):
        ctx = RequestContext([1, 2, 3], 4, None, (), 8, None, 50)
    assert ctx.vocab_size == 50 and ctx.max_new_tokens == 4
    with pytest.warns(DeprecationWarning), pytest.raises(ContextLengthError):
        RequestContext([1, 2, 3], 4, None, (), 6)
    with pytest.raises(InvalidInputError, match="vocab_size both by position and by keyword"):
        RequestContext([1, 2, 3], 4, None, (), None, None, 50, vocab_size=50)


def test_each_round_hands_the_drafter_a_fresh_plan_the_context_reads_through():
    """``ctx.plan`` is the round's: what a drafter set in one round (its timed steps) is not
    there in the next, and ``ctx.tree_nodes`` and the like read and write the plan."""
    seen = []

    class Recording(NgramDrafter):
        async def generate_draft(self, ctx, k):
            seen.append((ctx.plan, ctx.plan.draft_steps))
            ctx.plan.draft_steps = (1, 0.5)
            return await super().generate_draft(ctx, k)

    target, _ = toy_pair(16, seed=3)
    sched = SpecDecScheduler(
        Recording(n_max=1), ModelVerifier(target), SpecConfig(k_init=2, adapt_k=False, measure_costs=False)
    )
    anyio.run(sched.run, [1, 2, 1, 2, 1, 2], 12)
    assert len(seen) >= 2 and len({id(plan) for plan, _ in seen}) == len(seen)
    assert all(steps == (0, 0.0) for _, steps in seen)
    ctx = RequestContext([1, 2], 4)
    ctx.tree_nodes, ctx.cheap_drafts = 3, True
    assert (ctx.plan.tree_nodes, ctx.plan.cheap_drafts, ctx.draft_steps) == (3, True, (0, 0.0))
