"""Speculation inside a batch (packed target calls): which rounds draft, and with what.

Costs are given (a fake step loop), so each test pins one decision of the cost model: a draft
model whose batched steps cost most of a target step is not used in a batch; drafts that cost
nothing are verified in the batch's call when their acceptance pays for the extra positions; a
cheap draft model drafts for the whole batch; nothing unmeasured is assumed to pay.
"""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from specdec_rt.drafters import CombinedDrafter, NgramDrafter
from specdec_rt.policy.acceptance import AcceptanceEWMA, CostModel
from specdec_rt.policy.config import SpecConfig
from specdec_rt.policy.request import RequestPolicy
from specdec_rt.speculation.context import RequestContext
from specdec_rt.speculation.protocols import DraftInferrer

STEP_8 = 0.044  # seconds of a batched plain step of 8 rows (SmolLM2, measured)
PER_POSITION = 0.0017  # seconds per extra position in a batched call (measured)


def _costs(draft_step: float | None, measured: bool = True) -> CostModel:
    def step(rows: int, positions: int | None = None) -> float | None:
        if not measured:
            return None
        positions = positions or rows
        return STEP_8 * rows / 8 + PER_POSITION * (positions - rows)

    return CostModel(
        SpecConfig(),
        batch_step_s=step,
        batched_verify=True,
        draft_step_s=(lambda rows: draft_step) if draft_step is not None else None,
    )


def _policy(costs: CostModel, acceptance: float, cheap_drafts: bool, cheap: float | None = None) -> RequestPolicy:
    # every round here may draft with the model (the first round's deferred draft prefill: tests/spec)
    config = SpecConfig(defer_draft_prefill=False)
    p = RequestPolicy(config, "spec", AcceptanceEWMA.start(0.1, acceptance, prior_weight=100.0), costs)
    p.cheap_drafts = cheap_drafts
    if cheap is not None:  # the free drafts' own acceptance (observed so far)
        p.cheap_ewma = AcceptanceEWMA.start(0.1, cheap, prior_weight=100.0)
    return p


def test_an_expensive_draft_model_does_not_draft_in_a_batch():
    p = _policy(_costs(draft_step=0.035), acceptance=0.7, cheap_drafts=False)
    assert p.draft_length(48, batch=8) == 0
    assert p.draft_length(48, batch=1) > 0  # alone it still speculates


def test_free_drafts_with_good_acceptance_are_verified_in_the_batch_call():
    p = _policy(_costs(draft_step=0.035), acceptance=0.7, cheap_drafts=True, cheap=0.9)
    k = p.draft_length(48, batch=8)
    assert k > 0 and p.cheap
    # ... but not when they are rarely right (the extra positions would cost more than they give)
    p = _policy(_costs(draft_step=0.035), acceptance=0.7, cheap_drafts=True, cheap=0.2)
    assert p.draft_length(48, batch=8) == 0 and not p.cheap
    # their acceptance is their own: rounds of free drafts move it, not the request's
    p = _policy(_costs(draft_step=0.035), acceptance=0.7, cheap_drafts=True, cheap=0.9)
    assert p.draft_length(48, batch=8) > 0 and p.cheap
    for _ in range(30):
        p.observe(0, 3, 0, t_draft=0.0, t_verify=0.04, alone=False)
    assert p.cheap_ewma.value < 0.3 and p.ewma.value == pytest.approx(0.7)
    assert p.draft_length(48, batch=8) == 0


def test_a_cheap_draft_model_drafts_for_the_whole_batch():
    p = _policy(_costs(draft_step=0.002), acceptance=0.8, cheap_drafts=True)
    assert p.draft_length(48, batch=8) > 0
    assert not p.cheap  # the model's drafts beat n-gram matches here


def test_unmeasured_batch_costs_predict_no_gain():
    p = _policy(_costs(draft_step=0.002, measured=False), acceptance=0.9, cheap_drafts=True)
    assert p.draft_length(48, batch=8) == 0


def test_marginal_cost_comes_from_the_measured_calls():
    costs = _costs(draft_step=None)
    assert costs.batch_call_s(8, 12) == pytest.approx(STEP_8 + 4 * PER_POSITION)
    assert costs.cheap_speedup(1.0, 2, 8) == pytest.approx(3 * (STEP_8 / 8) / (STEP_8 / 8 + 2 * PER_POSITION))


def test_cheap_rounds_of_a_combined_drafter_never_call_its_model():
    class Refuses(DraftInferrer):
        async def generate_draft(self, ctx, k):
            raise AssertionError("the draft model was called in a cheap round")

        def release(self, ctx):
            pass

    drafter = CombinedDrafter(NgramDrafter(), Refuses())
    repeated = np.array([5, 6, 7, 8, 9, 5, 6, 7], dtype=np.int64)  # "5 6 7" seen before: "8 9" follows
    ctx = RequestContext(repeated, 8)
    ctx.cheap_drafts = True
    drafts = anyio.run(drafter.generate_draft, ctx, 3)
    assert [d.id for d in drafts] == [8, 9, 5]
    ctx = RequestContext(np.array([1, 2, 3, 4], dtype=np.int64), 8)  # no match: no drafts, no model call
    ctx.cheap_drafts = True
    assert anyio.run(drafter.generate_draft, ctx, 3) == []


def test_a_draft_that_missed_the_answer_catches_up_only_when_it_pays_in_the_batch():
    costs = _costs(draft_step=0.002)
    costs.draft_prefill_s = 0.002  # seconds per token the draft reads (measured alone)
    p = _policy(costs, acceptance=0.8, cheap_drafts=False)
    p._drafted_at = -40  # it never drafted: it lacks a 40-token prompt and what was generated
    assert p.draft_length(4, batch=8, at=30) == 0  # 70 tokens to read for 4 left: no
    assert p.draft_length(400, batch=8, at=30) > 0  # for 400 left: yes


def test_model_drafts_that_did_not_pay_in_a_batch_stop():
    """Predicted to pay, measured not to: after the first probe of plain rounds (one whole round
    of the batch), the batch decodes plainly."""
    from specdec_rt.policy.arms import ARM_FIRST_PROBE

    p = _policy(_costs(draft_step=0.002), acceptance=0.8, cheap_drafts=False)
    at, kinds = 10, []
    p._drafted_at = at
    for _ in range((ARM_FIRST_PROBE + 2) * 8):
        k = p.draft_length(48, batch=8, at=at)
        kinds.append(k > 0)
        if k:  # each model-draft round took 3 plain steps' time for 2 tokens
            p.observe(at, k, 1, t_draft=0.066, t_verify=0.066, alone=False, batch=8)
            at += 2
        else:
            p.observe(at, 0, 0, t_draft=0.0, t_verify=0.044, alone=False, batch=8)
            at += 1
    assert kinds[0] and not any(kinds[-8:])
    assert p.costs.batch_arms[8].plain > p.costs.batch_arms[8].drafts


def test_a_round_that_first_fed_the_draft_what_it_missed_is_not_measured():
    p = _policy(_costs(draft_step=0.002), acceptance=0.8, cheap_drafts=False)
    p._drafted_at = -40  # the draft lacks a 40-token prompt: this round's time is mostly catching up
    assert p.draft_length(400, batch=8, at=10) > 0
    p.observe(10, 3, 3, t_draft=0.2, t_verify=0.066, alone=False, batch=8)
    assert 8 not in p.costs.batch_arms  # catching up is priced apart (catchup_pays_batch)
    assert p.draft_length(400, batch=8, at=14) > 0  # caught up: this round counts
    p.observe(14, 3, 3, t_draft=0.006, t_verify=0.066, alone=False, batch=8)
    assert p.costs.batch_arms[8].draft_rates == [pytest.approx(4 / 0.072)]
    first = _policy(_costs(draft_step=0.002), acceptance=0.8, cheap_drafts=False)
    assert first.draft_length(400, batch=8) > 0
    first.observe(0, 3, 0, t_draft=0.3, t_verify=0.066, timed=False, alone=False, batch=8)  # with the prompt's prefills
    assert 8 not in first.costs.batch_arms


def test_free_drafts_do_not_displace_model_drafts_that_pay():
    # n-gram matches turn up only now and then: preferring them would leave most rounds plain
    p = _policy(_costs(draft_step=0.002), acceptance=0.8, cheap_drafts=True, cheap=0.99)
    assert p.draft_length(48, batch=8) > 0 and not p.cheap


@pytest.mark.parametrize("seed", range(20))
def test_the_nearest_longer_call_is_found_by_bisection_as_by_scanning(seed):
    rng = np.random.default_rng(seed)
    table = {(8, int(n)): float(rng.uniform(0.04, 0.1)) for n in rng.choice(np.arange(8, 80), 6, replace=False)}
    table[(8, 8)] = 0.044

    def step(rows, positions=None):
        return table.get((rows, positions or rows))

    scan = CostModel(SpecConfig(), batch_step_s=step, batched_verify=True)
    fast = CostModel(
        SpecConfig(),
        batch_step_s=step,
        batched_verify=True,
        batch_shapes=lambda rows: sorted(n for r, n in table if r == rows),
    )
    for positions in range(8, 90):
        assert fast.batch_call_s(8, positions) == scan.batch_call_s(8, positions)


def _measured_arms(plain: float, drafts: float, batch: int = 4) -> RequestPolicy:
    """A policy whose batch of ``batch`` saw plain rounds at ``plain`` and model-draft rounds at
    ``drafts`` tokens per second (per request)."""
    p = _policy(_costs(draft_step=0.002), acceptance=0.8, cheap_drafts=False)
    from specdec_rt.policy.arms import ARM_MIN_SAMPLES

    for i in range(ARM_MIN_SAMPLES):
        p._drafted_at = 10 + 4 * i
        p.observe(10 + 4 * i, 0, 0, t_draft=0.0, t_verify=1.0 / plain, alone=False, batch=batch)
        p.observe(11 + 4 * i, 3, 2, t_draft=0.01, t_verify=3.0 / drafts - 0.01, alone=False, batch=batch)
    return p


def test_a_batch_takes_the_kind_of_round_measured_faster():
    # predicted to pay (acceptance 0.8, a cheap draft) but measured slower than plain rounds
    p = _measured_arms(plain=30.0, drafts=20.0)
    assert p.costs.batch_arms[4].measured
    assert p.draft_length(48, batch=4, at=14) == 0
    # and the other way round: drafts measured faster are used
    p = _measured_arms(plain=20.0, drafts=30.0)
    assert p.draft_length(48, batch=4, at=14) > 0
    # within the margin, plain rounds stay (no gain worth a round's risk)
    p = _measured_arms(plain=30.0, drafts=30.0 * 1.01)
    assert p.draft_length(48, batch=4, at=14) == 0


def test_the_slower_kind_is_probed_for_one_whole_round_of_the_batch():
    from specdec_rt.policy.arms import ARM_PROBE_EVERY

    batch = 4
    p = _measured_arms(plain=30.0, drafts=20.0, batch=batch)
    arms = p.costs.batch_arms[batch]
    choices = []
    period = ARM_PROBE_EVERY * batch
    for i in range(2 * period + period // 2):
        choices.append(p.costs.batch_drafts(batch, gain=2.0))
        arms.observe(choices[-1], 30.0 if not choices[-1] else 20.0)
    probes = [i for i, c in enumerate(choices) if c]
    assert len(probes) == 2 * batch  # one round of the batch (all its requests) per period
    for start in probes[::batch]:  # consecutive: the whole round drafts
        assert choices[start : start + batch] == [True] * batch
    assert probes[batch] - probes[0] == period
    # a probe that found drafts faster now turns the batch to drafts
    for _ in range(8):
        arms.observe(True, 60.0)
    assert p.costs.batch_drafts(batch, gain=0.0)


def test_probes_that_confirm_the_kind_in_use_come_less_often():
    from specdec_rt.policy.arms import ARM_MIN_SAMPLES, ARM_PROBE_EVERY, ARM_PROBE_MAX, BatchArms

    batch, arms = 2, BatchArms()
    for _ in range(ARM_MIN_SAMPLES):
        arms.observe(False, 30.0)
        arms.observe(True, 20.0)
    starts, last = [], None
    for i in range(40 * ARM_PROBE_MAX):
        d = arms.choose(batch, 2.0, 1.1)
        if d and not last:
            starts.append(i)
        last = d
        arms.observe(d, 20.0 if d else 30.0)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(starts) >= 5 and gaps == sorted(gaps) and gaps[0] < gaps[-1]
    assert arms.period == ARM_PROBE_MAX and ARM_PROBE_EVERY < ARM_PROBE_MAX
    # a probe that changes the verdict starts the period over
    for _ in range(8):
        arms.observe(True, 60.0)
    arms.rounds = arms.period * batch
    assert not arms.choose(batch, 2.0, 1.1)  # drafts now best: the probe takes plain
    assert arms.period == ARM_PROBE_EVERY


def test_a_probe_of_model_drafts_lets_the_drafts_catch_up_first():
    """After plain rounds every draft lags: the probe's first round is a catch-up (not
    measured), so the probe lasts two rounds of the batch."""
    from specdec_rt.policy.arms import ARM_MIN_SAMPLES, BatchArms

    batch, arms = 4, BatchArms()
    for _ in range(ARM_MIN_SAMPLES):
        arms.observe(False, 30.0)
        arms.observe(True, 20.0)
    arms.rounds = arms.period * batch
    choices = [arms.choose(batch, 2.0, 1.1, caught_up=False) for _ in range(3 * batch)]
    assert choices == [True] * (2 * batch) + [False] * batch


def test_the_kind_never_measured_is_probed_soon_and_then_decides():
    """Predicted to pay, a batch drafts, so only the drafts arm gets measured: without an early
    probe nothing would ever measure plain rounds and the prediction would stand for good."""
    from specdec_rt.policy.arms import ARM_FIRST_PROBE, ARM_MIN_SAMPLES, BatchArms

    batch, arms = 4, BatchArms()
    assert arms.choose(batch, 2.0, 1.1) and not arms.choose(batch, 1.0, 1.1)  # nothing measured
    choices = []
    for _ in range(ARM_FIRST_PROBE * batch + batch):
        choices.append(arms.choose(batch, 2.0, 1.1))
        arms.observe(choices[-1], 20.0 if choices[-1] else 30.0)
    first = choices.index(False)
    assert first == ARM_FIRST_PROBE * batch and choices[first:] == [False] * batch  # one whole round
    assert arms.measured and not arms.choose(batch, 2.0, 1.1)  # plain measured faster: plain now
    # the other way: predicted not to pay, plain measured only, drafts probed as soon
    for explore in (True, False):
        arms = BatchArms()
        for _ in range(ARM_FIRST_PROBE * batch):
            assert not arms.choose(batch, 1.0, 1.1, explore=explore)
            arms.observe(False, 30.0)
        # ... unless drafts are not within reach (exploring costs every row's catch-up)
        assert [arms.choose(batch, 1.0, 1.1, explore=explore) for _ in range(batch)] == [explore] * batch
    # a kind counts only from ARM_MIN_SAMPLES rounds, at their median: one odd round decides nothing
    arms = BatchArms()
    for rate in [5.0] + [40.0] * (ARM_MIN_SAMPLES - 1):
        assert arms.drafts is None
        arms.observe(True, rate)
    assert arms.drafts == 40.0


def test_model_drafts_are_explored_only_where_they_are_within_reach():
    """Where drafts lost at a smaller batch they are not explored at a larger one (a batch only
    makes plain rows cheaper), nor from a win more than 2 requests smaller; 2 requests explore
    them when speculation pays alone."""
    from specdec_rt.policy.arms import ARM_MIN_SAMPLES, BatchArms

    costs = _costs(draft_step=0.002)

    def arms(plain, drafts):
        a = BatchArms()
        for _ in range(ARM_MIN_SAMPLES):
            a.observe(False, plain)
            a.observe(True, drafts)
        return a

    assert costs._explore(2, alone_gain=1.5) and not costs._explore(2, alone_gain=1.0)
    assert not costs._explore(4, alone_gain=1.5)  # nothing measured below 4
    costs.batch_arms[2] = arms(plain=50.0, drafts=70.0)
    assert costs._explore(3, 1.0) and costs._explore(4, 1.0)
    assert not costs._explore(5, 1.0) and not costs._explore(8, 1.0)  # a win at 2 says little about 8
    costs.batch_arms[3] = arms(plain=50.0, drafts=45.0)  # the nearest smaller one decides
    assert not costs._explore(4, 1.5) and not costs._explore(5, 1.5)
    costs.batch_arms[3] = BatchArms(draft_rates=[45.0] * ARM_MIN_SAMPLES)  # 3 not measured in full: 2 decides
    assert costs._explore(4, 1.0)
    costs.batch_arms[4] = arms(plain=40.0, drafts=48.0)
    assert costs._explore(6, 1.0) and not costs._explore(7, 1.0) and not costs._explore(8, 1.0)
    costs.batch_arms[4] = arms(plain=40.0, drafts=41.0)  # a win within noise: not enough
    assert not costs._explore(6, 1.0)
    costs.batch_arms[6] = arms(plain=30.0, drafts=36.0)
    assert costs._explore(8, 1.0)


def test_a_periodic_probe_of_slower_drafts_is_skipped_when_catching_up_would_not_pay():
    from specdec_rt.policy.arms import ARM_MIN_SAMPLES, ARM_PROBE_EVERY, BatchArms

    batch, arms = 8, BatchArms()
    for _ in range(ARM_MIN_SAMPLES):
        arms.observe(False, 40.0)
        arms.observe(True, 30.0)
    arms.rounds = ARM_PROBE_EVERY * batch
    assert not arms.choose(batch, 0.9, 1.1, caught_up=False, behind=True)
    assert arms.rounds == 0 and not arms.probing and arms.period > ARM_PROBE_EVERY or arms.last_best is False
    arms.rounds = arms.period * batch  # when catching up pays, the probe takes place (two rounds)
    assert all(arms.choose(batch, 0.9, 1.1, caught_up=False, behind=False) for _ in range(2 * batch))


def test_only_rounds_that_no_other_kind_of_round_overlapped_are_measured():
    """In a mixed round plain rows wait for the drafting rows' draft steps and drafting rows
    share their verify with cheap plain rows: both rates would be wrong."""
    from specdec_rt.policy.arms import BatchArms, RoundLedger

    ledger = RoundLedger()
    a, b = ledger.start("plain"), ledger.start("plain")
    assert ledger.end(a) and ledger.end(b)  # the same kind side by side: pure
    a = ledger.start("plain")
    d = ledger.start("drafts")  # starts while a plain round runs
    assert not ledger.end(a) and not ledger.end(d)
    a = ledger.start("plain")
    ledger.end(ledger.start("other"))  # a prompt's round came and went meanwhile
    assert not ledger.end(a)
    assert ledger.end(ledger.start("drafts"))  # nothing left running: pure again
    # through the policy: two requests of one batch, one drafting while the other is plain
    costs = _costs(draft_step=0.002)
    p, q = (_policy(costs, acceptance=0.8, cheap_drafts=False) for _ in range(2))
    p._drafted_at = q._drafted_at = 10
    costs.batch_arms[4] = arms = BatchArms(probing=1, probe_drafts=False)  # the next decision: plain
    assert q.draft_length(48, batch=4, at=10) == 0 and p.draft_length(48, batch=4, at=10) > 0
    q.observe(10, 0, 0, t_draft=0.0, t_verify=0.02, alone=False, batch=4)
    p.observe(10, 3, 2, t_draft=0.01, t_verify=0.02, alone=False, batch=4)
    assert not arms.plain_rates and not arms.draft_rates
    assert p.draft_length(48, batch=4, at=13) > 0
    p.observe(13, 3, 2, t_draft=0.01, t_verify=0.02, alone=False, batch=4)
    assert arms.draft_rates == [pytest.approx(3 / 0.03)]


def test_arms_are_per_batch_size_and_untouched_by_the_prompt_round_and_catch_up():
    p = _policy(_costs(draft_step=0.002), acceptance=0.8, cheap_drafts=False)
    p.observe(0, 0, 0, t_draft=0.0, t_verify=0.5, timed=False, alone=False, batch=4)  # the prompt's round
    assert 4 not in p.costs.batch_arms
    p._drafted_at = -40  # the draft lacks 40 tokens: its next round is a catch-up
    assert p.draft_length(400, batch=4, at=10) > 0
    p.observe(10, 3, 3, t_draft=0.2, t_verify=0.066, alone=False, batch=4)
    assert 4 not in p.costs.batch_arms
    p.observe(14, 0, 0, t_draft=0.0, t_verify=0.03, alone=False, batch=4)
    assert p.costs.batch_arms[4].plain_rates == [pytest.approx(1 / 0.03)] and 8 not in p.costs.batch_arms
    never = _policy(_costs(draft_step=0.002), acceptance=0.8, cheap_drafts=False)
    never.observe(
        5, 0, 0, t_draft=0.0, t_verify=0.03, timed=False, alone=False, batch=2
    )  # it never drafted: plain rounds count
    assert never.costs.batch_arms[2].plain_rates == [pytest.approx(1 / 0.03)]
    alone = _policy(_costs(draft_step=0.002), acceptance=0.8, cheap_drafts=False)
    alone.observe(14, 0, 0, t_draft=0.0, t_verify=0.03)  # a request alone has no arms: its costs are its own
    assert not alone.costs.batch_arms


def test_plain_requests_in_the_batch_spoil_no_measurement():
    """``mode="ar"`` rows are plain beside either kind of round: a speculative row's rounds
    beside them are still measured (only their prompt's round, a prefill, is not)."""
    costs = _costs(draft_step=0.002)
    p = _policy(costs, acceptance=0.8, cheap_drafts=False)
    ar = RequestPolicy(SpecConfig(), "ar", AcceptanceEWMA.start(0.1, 0.8), costs)
    p._drafted_at = 10
    assert ar.draft_length(48, batch=2, at=0) == 0  # the ar row's prompt round
    assert p.draft_length(48, batch=2, at=10) > 0
    p.observe(10, 3, 2, t_draft=0.01, t_verify=0.02, alone=False, batch=2)
    ar.observe(0, 0, 0, t_draft=0.0, t_verify=0.1, timed=False, alone=False, batch=2)
    assert 2 not in costs.batch_arms  # overlapped a prefill
    assert ar.draft_length(48, batch=2, at=1) == 0 and p.draft_length(48, batch=2, at=13) > 0
    p.observe(13, 3, 2, t_draft=0.01, t_verify=0.02, alone=False, batch=2)
    ar.observe(1, 0, 0, t_draft=0.0, t_verify=0.02, alone=False, batch=2)
    assert costs.batch_arms[2].draft_rates == [pytest.approx(3 / 0.03)] and not costs.batch_arms[2].plain_rates
