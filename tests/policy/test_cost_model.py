"""The cost of a verify call as a function of its drafts k (``CostModel.verify_cost``), alone.

Measured verify costs are concave in k: a call over 1 draft (2 positions) costs much more than a
plain step, each further draft less. The model is a jump plus a slope fitted to the verifies
measured, so that neither the first draft's jump makes long chains look dear nor short chains
measured alone keep a request from trying longer ones. A tree round's verify is measured by the
positions it took, not by its depth.
"""

from __future__ import annotations

import pytest

from specdec_rt.policy.acceptance import AcceptanceEWMA, CostModel
from specdec_rt.policy.config import SpecConfig
from specdec_rt.policy.request import RequestPolicy

# SmolLM2-135M fp32 alone on a 2-core EPYC (engine, ms): plain step, then verifies over 1-5 drafts
CONCAVE_MS = {0: 11.3, 1: 13.85, 2: 14.91, 3: 15.95, 4: 16.89, 5: 17.74}


def _costs(points_ms: dict[int, float], draft_ms: float = 5.5) -> CostModel:
    return CostModel(SpecConfig(), draft_token_s=draft_ms / 1e3, verify_s={k: v / 1e3 for k, v in points_ms.items()})


def test_concave_verify_costs_are_fitted_at_every_measured_length():
    costs = _costs(CONCAVE_MS)
    for k, ms in CONCAVE_MS.items():
        # a line joining the plain step and the longest verify was 9% low at k = 1, 4% at k = 2
        assert costs.verify_cost(k) == pytest.approx(ms / CONCAVE_MS[0], rel=0.015), k
    # beyond the measurements it goes on with the fitted slope, not the steeper end-to-end one
    end_to_end = (CONCAVE_MS[5] - CONCAVE_MS[0]) / 5 / CONCAVE_MS[0]
    assert costs.relative()[1] < 0.8 * end_to_end
    assert costs.verify_cost(8) < 1 + 8 * end_to_end


def test_one_measured_verify_length_is_a_jump_plus_the_configured_slope():
    """Only k = 1 measured (what a request that kept to short chains saw): its excess over a
    plain step is the first draft's jump, so longer chains are predicted at the configured slope
    and get tried, rather than at a slope of 0.23 steps per draft that ruled them out."""
    config = SpecConfig()
    costs = _costs({0: 11.3, 1: 13.85})
    assert costs.verify_cost(1) == pytest.approx(13.85 / 11.3)
    assert costs.verify_cost(8) - costs.verify_cost(1) == pytest.approx(7 * config.verify_cost_per_token)
    policy = RequestPolicy(config, "spec", AcceptanceEWMA.start(0.1, 0.95, prior_weight=100.0), costs)
    assert policy.best_k()[0] >= 5  # the joined line (slope 0.23) peaked at k = 3


def test_a_new_measurement_refits_the_line():
    costs = _costs({0: 11.3, 1: 13.85})
    before = costs.verify_cost(6)
    for _ in range(60):  # six-draft verifies turn out dear: the fit follows them
        costs.observe(6, 6 * 0.0055, 0.030)
    assert costs.verify_cost(6) > before
    assert costs.verify_cost(6) == pytest.approx(costs.verify_s[6] / 0.0113, rel=0.05)


def test_unmeasured_and_seeded_costs_keep_the_configured_line():
    config = SpecConfig()
    for costs in (CostModel(config), CostModel(config, measure=False)):
        costs.observe(4, 0.02, 0.05)
        assert costs.verify_cost(0) == 1.0
        # measured: one length and no plain step says nothing about the slope or a jump
        assert costs.verify_cost(4) == pytest.approx(1 + 4 * config.verify_cost_per_token)
    seeded = CostModel(config, measure=False)
    assert seeded.relative() == (config.draft_cost, config.verify_cost_per_token)


def test_replacing_the_measurements_refits_the_line():
    costs = _costs({0: 11.3, 1: 13.85})
    assert costs.verify_cost(1) == pytest.approx(13.85 / 11.3)  # fitted (and kept)
    costs.verify_s = {0: 0.0113, 1: 0.0226}
    assert costs.verify_cost(1) == pytest.approx(2.0)


def test_a_probe_that_first_catches_up_feeds_its_verify_not_its_draft_time():
    """A probe after plain steps drafts only once the draft read the tokens it missed: that
    reading is not a draft token's cost. Counted as one (the old rule), a probe after 16 plain
    tokens made drafts look ~1.5x dearer, the request did not resume, and the next probe was
    dearer still: a cold demo decoded at 0.94x plain while accepting every probe's drafts."""
    config = SpecConfig()
    costs = CostModel(config, draft_token_s=0.011, verify_s={0: 0.024, 4: 0.030})
    policy = RequestPolicy(config, "spec", AcceptanceEWMA.start(0.1, 0.9, prior_weight=100.0), costs)
    policy.speculating, policy._drafted_at = False, 0  # fell back at token 0
    for at in range(config.probe_every):
        assert policy.draft_length(100, 1, at + 1) == 0
        policy.observe(at + 1, 0, 0, t_draft=0.0, t_verify=0.024)
    at = config.probe_every + 1
    k = policy.draft_length(100, 1, at)
    assert k >= config.k_init
    policy.observe(at, k, k, t_draft=k * 0.011 + 0.060, t_verify=0.030)  # the draft read 17 tokens first: +60 ms
    assert costs.draft_token_s == pytest.approx(0.011) and costs.verify_s[k] == pytest.approx(0.030)
    assert policy.speculating  # resumed: the probe's drafts were all accepted and pay
    k = policy.draft_length(100, 1, at + k + 1)
    policy.observe(at + k + 1, k, k, t_draft=k * 0.013, t_verify=0.030)  # caught up: a draft cost again
    assert costs.draft_token_s > 0.011


def _fell_back_for_cost(config: SpecConfig, draft_s: float) -> tuple[RequestPolicy, CostModel]:
    """A request that stopped speculating at token 0 with drafts priced at ``draft_s`` a step
    (plain step 24 ms), then decoded ``probe_every`` tokens plainly: its next round probes."""
    costs = CostModel(config, draft_token_s=draft_s, verify_s={0: 0.024, 4: 0.030})
    policy = RequestPolicy(config, "spec", AcceptanceEWMA.start(0.1, 0.9, prior_weight=100.0), costs)
    policy.speculating, policy._drafted_at = False, 0
    for at in range(config.probe_every):
        assert policy.draft_length(100, 1, at + 1) == 0
        policy.observe(at + 1, 0, 0, t_draft=0.0, t_verify=0.024)
    return policy, costs


def test_a_probe_remeasures_the_draft_steps_that_a_slow_moment_priced_too_high():
    """A slow moment of a shared machine priced draft steps at ~2x (0.022 s against a 0.024 s
    plain step): no draft length paid, and a probe, which times only its verify (its draft first
    read the tokens it missed), resumed on those stale costs never. The SmolLM2 pair then
    decoded plainly for good (13 requests in a row in a replay; one bench run decoded 20 prompts
    plainly while the tree mode beside it kept drafting). The probe now times the draft's steps
    after that first call, and that measurement replaces the estimate."""
    config = SpecConfig()
    policy, costs = _fell_back_for_cost(config, 0.022)
    assert policy.best_k()[1] < config.resume_speedup  # the stale price: drafts do not pay
    at = config.probe_every + 1
    k = policy.draft_length(100, 1, at)
    assert k >= 2
    steps = (k - 1, (k - 1) * 0.010)  # the steps after the catch-up call: 10 ms each
    policy.observe(at, k, k, t_draft=0.060 + steps[1], t_verify=0.030, steps=steps)
    assert costs.draft_token_s == pytest.approx(0.010)
    assert policy.speculating  # resumed
    # without the steps' times (a drafter that does not time them) the probe cannot tell
    policy, costs = _fell_back_for_cost(config, 0.022)
    k = policy.draft_length(100, 1, at)
    policy.observe(at, k, k, t_draft=0.060 + (k - 1) * 0.010, t_verify=0.030)
    assert costs.draft_token_s == pytest.approx(0.022) and not policy.speculating


def test_a_probe_refreshes_the_level_of_every_verify_cost_and_keeps_their_shape():
    """Verifies priced at ~3x by a slow moment (the plain step, measured all along, is back to
    24 ms): no draft length pays. The probe's verify, measured at its length, rescales every
    length's (a verify at the lengths no round drafts would otherwise never be re-measured)."""
    config = SpecConfig()
    stale = {0: 0.024, 2: 3 * 0.027, 4: 3 * 0.030, 6: 3 * 0.033}
    costs = CostModel(config, draft_token_s=0.010, verify_s=dict(stale))
    policy = RequestPolicy(config, "spec", AcceptanceEWMA.start(0.1, 0.9, prior_weight=100.0), costs)
    policy.speculating, policy._drafted_at = False, 0
    assert policy.best_k()[1] < config.resume_speedup
    for at in range(config.probe_every):
        policy.draft_length(100, 1, at + 1)
        policy.observe(at + 1, 0, 0, t_draft=0.0, t_verify=0.024)
    at = config.probe_every + 1
    k = policy.draft_length(100, 1, at)
    true = 0.024 + 0.0015 * k  # what a verify of k drafts costs now
    policy.observe(at, k, k, t_draft=0.060 + (k - 1) * 0.010, t_verify=true, steps=(k - 1, (k - 1) * 0.010))
    assert costs.verify_s[k] == pytest.approx(true) and costs.verify_s[0] == pytest.approx(0.024)
    others = [j for j in stale if j and j != k]
    ratios = {j: costs.verify_s[j] / stale[j] for j in others}
    assert all(r == pytest.approx(ratios[others[0]]) and r < 0.5 for r in ratios.values())  # one scale
    assert policy.speculating  # resumed


def test_a_request_that_always_drafts_re_measures_the_plain_step_now_and_then():
    """The plain step is the unit of every cost, and only a plain round measures it: a request
    that always drafts kept the one of long ago while the machine's speed moved (19.1 ms kept
    while steps took ~26 ms: drafts read 0.72 of a step instead of ~0.5). Every
    ``PLAIN_REFRESH_EVERY`` rounds alone one round is plain, and a sample after such a gap
    counts for the rounds it stood for."""
    from specdec_rt.policy.acceptance import PLAIN_REFRESH_EVERY

    config = SpecConfig()
    costs = CostModel(config, draft_token_s=0.013, verify_s={0: 0.0191, 4: 0.033})
    policy = RequestPolicy(config, "spec", AcceptanceEWMA.start(0.1, 0.95, prior_weight=100.0), costs)
    at, plain = 1, []
    for _ in range(2 * PLAIN_REFRESH_EVERY + 2):
        k = policy.draft_length(10_000, 1, at)
        if k == 0:
            plain.append(at)
            policy.observe(at, 0, 0, t_draft=0.0, t_verify=0.026)  # the machine is slower now
            at += 1
        else:
            policy.observe(at, k, k, t_draft=k * 0.013, t_verify=0.033 + 0.002 * (k - 4))
            at += k + 1
    assert len(plain) == 2  # one plain round in PLAIN_REFRESH_EVERY + 1
    assert costs.verify_s[0] == pytest.approx(0.026, rel=0.01)  # not 0.0191 + 10% of the gap
    stale = 1.0 - (1.0 - config.alpha) ** (PLAIN_REFRESH_EVERY + 1)
    assert stale > 0.99
    costs.observe(0, 0.0, 0.030)  # back to back: an ordinary EWMA step
    assert costs.verify_s[0] == pytest.approx(0.026 + config.alpha * 0.004, rel=0.01)
    seeded = CostModel(config, measure=False)
    seeded.since_plain = 10 * PLAIN_REFRESH_EVERY
    assert not seeded.plain_stale()  # a seeded request's schedule never depends on timings


def test_a_first_round_times_its_prefill_apart_from_its_steps():
    """A request's first round: the draft's prompt, then steps. With the steps timed, the
    prefill is what is left and the steps are a draft-cost sample (an EWMA: not a probe)."""
    config = SpecConfig()
    costs = CostModel(config, draft_token_s=0.020, verify_s={0: 0.024, 4: 0.030})
    costs.observe_prefill(50, 4, 0.100 + 3 * 0.010, steps=(3, 0.030))
    assert costs.draft_prefill_s == pytest.approx(0.100 / 50)
    assert costs.draft_token_s == pytest.approx(0.020 + config.alpha * (0.010 - 0.020))
    untimed = CostModel(config, draft_token_s=0.020, verify_s={0: 0.024})
    untimed.observe_prefill(50, 4, 0.100 + 3 * 0.010)  # steps priced at the estimate
    assert untimed.draft_prefill_s == pytest.approx((0.130 - 3 * 0.020) / 50)
    assert untimed.draft_token_s == pytest.approx(0.020)


def test_a_tree_round_is_measured_by_the_nodes_its_verify_took():
    config = SpecConfig()
    costs = CostModel(config, draft_token_s=0.02, verify_s={0: 0.2})
    policy = RequestPolicy(config, "spec", AcceptanceEWMA.start(0.1, 0.8, prior_weight=100.0), costs)
    policy.observe(1, 3, 2, t_draft=3 * 0.02, t_verify=0.33, verified=6)  # 3 deep, 6 nodes: 7 positions
    assert set(costs.verify_s) == {0, 6} and costs.verify_s[6] == pytest.approx(0.33)
    assert costs.draft_token_s == pytest.approx(0.02)  # per depth: the alternatives came with the chain
