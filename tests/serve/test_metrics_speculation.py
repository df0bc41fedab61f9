"""``/metrics`` counts the drafts at each depth and shows the measured costs of speculation;
``/v1/models`` shows the same figures (toy models, no export)."""

from __future__ import annotations

import anyio
import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from serve_util import client, metric, metric_values  # noqa: E402

from specdec_rt.policy.config import SpecConfig  # noqa: E402
from specdec_rt.serve import create_app  # noqa: E402
from specdec_rt.serve.metrics import Metrics  # noqa: E402
from specdec_rt.speculation.adapters import ModelDrafter  # noqa: E402
from specdec_rt.testing import toy_engine, toy_pair  # noqa: E402
from specdec_rt.types import Stats  # noqa: E402

STATIC = SpecConfig(measure_costs=False, adapt_k=False, k_init=4)  # the default costs, 4 drafts a round
DRAFTED = "specdec_spec_decode_num_drafts_per_depth_total"
ACCEPTED = "specdec_spec_decode_num_accepted_tokens_per_depth_total"


def _engine(tmp_path, config):
    target, draft = toy_pair(12, seed=3, distance=0.3)
    return toy_engine(target, ModelDrafter(draft), tmp_path, config=config, slots=2, draft_name="toy")


def test_the_per_depth_counters_move_by_the_requests_stats_and_the_cost_gauges_show(tmp_path):
    engine = _engine(tmp_path, STATIC)

    async def check():
        async with client(create_app(engine)) as c:
            before = metric_values((await c.get("/metrics")).text)
            for prompt in ("w1 w2 w3", "w5 w5 w5 w5 w7"):
                body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
                assert (await c.post("/v1/completions", json=body)).status_code == 200
            after = metric_values((await c.get("/metrics")).text)
            return before, after, (await c.get("/v1/models")).json()["data"][0]

    before, after, model = anyio.run(check)
    anyio.run(engine.aclose)
    totals = engine.scheduler.totals  # the two requests' Stats, summed
    assert totals.rounds > 0 and len(totals.position_drafted) >= 2

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    for index, (tried, kept) in enumerate(zip(totals.position_drafted, totals.position_accepted)):
        assert delta(DRAFTED, depth=str(index + 1), drafter="toy") == tried
        assert delta(ACCEPTED, depth=str(index + 1), drafter="toy") == kept
    assert delta(DRAFTED, depth="1", drafter="toy") == totals.rounds  # every round drafts depth 1
    assert sum(delta(ACCEPTED, depth=str(d), drafter="toy") for d in range(1, 5)) == totals.accepted
    # nothing measured (measure_costs=False): the configured defaults, flagged as such
    assert metric(after, "specdec_spec_decode_draft_cost_target_steps", drafter="toy") == pytest.approx(0.1)
    for k in range(1, 9):
        want = 1 + STATIC.verify_cost_per_token * k
        assert metric(after, "specdec_spec_decode_verify_cost_target_steps", drafter="toy", k=str(k)) == pytest.approx(
            want
        )
    assert ("specdec_spec_decode_costs_measured", frozenset({("drafter", "toy")})) in after
    assert metric(after, "specdec_spec_decode_costs_measured", drafter="toy") == 0

    figures = model["speculation"]
    assert figures["drafter"] == "toy" and figures["costs"]["draft_cost"] == pytest.approx(0.1)
    rows = figures["acceptance_by_depth"]
    assert [(r["drafted"], r["accepted"]) for r in rows] == list(zip(totals.position_drafted, totals.position_accepted))


def test_measured_costs_reach_the_gauges(tmp_path):
    # toy drafts cost what the target does: keep speculating so that the costs get measured
    engine = _engine(tmp_path, SpecConfig(min_speedup=0.0, fallback_below=0.0, zero_rounds=1000))

    async def check():
        async with client(create_app(engine)) as c:
            body = {"prompt": "w1 w2 w3", "max_tokens": 40, "temperature": 0}
            assert (await c.post("/v1/completions", json=body)).status_code == 200
            return metric_values((await c.get("/metrics")).text)

    values = anyio.run(check)
    anyio.run(engine.aclose)
    costs = engine.scheduler.costs
    assert metric(values, "specdec_spec_decode_costs_measured", drafter="toy") == 1
    draft_cost = metric(values, "specdec_spec_decode_draft_cost_target_steps", drafter="toy")
    assert draft_cost == pytest.approx(costs.relative()[0]) and draft_cost != pytest.approx(0.1)
    assert metric(values, "specdec_spec_decode_verify_cost_target_steps", drafter="toy", k="2") == pytest.approx(
        costs.verify_cost(2)
    )


def test_depths_past_the_label_bound_share_one_label():
    metrics = Metrics(lambda: 0.0, lambda: 0.0)
    metrics.costs.drafter = "d"
    stats = Stats()
    for _ in range(3):
        stats.observe_round(20, 20, 21, t_draft=0.0, t_verify=0.0, ewma=None)
    metrics.observe_stats(stats)
    values = metric_values(metrics.render()[0].decode())
    assert metric(values, DRAFTED, depth="15", drafter="d") == 3
    assert metric(values, DRAFTED, depth="16+", drafter="d") == 3 * 5  # depths 16..20
    assert not any(name == DRAFTED and ("depth", "17") in labels for name, labels in values)
    # no source (an engine without a drafter, or still loading): the gauges exist without samples
    assert not any(name.startswith("specdec_spec_decode_verify_cost") for name, _ in values)
