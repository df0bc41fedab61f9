"""What the server's ``/metrics`` shows of speculation beyond the token counters: the draft
depth label of the per-depth counters, and :class:`CostCollector`, the measured costs read from
the engine when scraped."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..engine.served import ReportsSpeculation, ServedEngine
from ..policy.figures import CostFigures

__all__ = ["MAX_DEPTH", "CostCollector", "depth_label"]

MAX_DEPTH = 16  # draft depths (and verify lengths k) from here on share one label, "16+"


def depth_label(depth: int) -> str:
    """A draft depth or verify length as a label value: ``"1"`` .. ``"15"``, then ``"16+"``
    (a bounded set, whatever ``k_max`` a server runs with)."""
    return str(depth) if depth < MAX_DEPTH else f"{MAX_DEPTH}+"


class CostCollector(Collector):
    """Gauges of the measured costs of speculation, read from ``source`` when scraped (the
    engine's :class:`~specdec_rt.policy.figures.CostFigures`; None: no drafter, no samples):
    the draft token and the verify call over k drafts, in plain target steps, and whether they
    were measured (0: the configured defaults). ``drafter`` labels them and the per-depth counters."""

    def __init__(self) -> None:
        self.source: Callable[[], CostFigures | None] | None = None
        self.drafter = "default"

    def attach(self, engine: ServedEngine) -> None:
        """Read ``engine``'s costs from now on, if it reports them
        (:class:`~specdec_rt.engine.served.ReportsSpeculation`), and label with its drafter: its
        draft spec (``choice.draft``), else the one it reports, else "default"."""
        self.drafter = engine.choice.draft if engine.choice is not None else "default"
        if isinstance(engine, ReportsSpeculation):
            figures = engine.speculation_figures()
            if figures is not None and engine.choice is None:
                self.drafter = figures["drafter"]
            self.source = lambda: _costs_of(engine)

    def describe(self) -> list[Metric]:
        return self._families(None)

    def collect(self) -> list[Metric]:
        return self._families(self.source() if self.source is not None else None)

    def _families(self, figures: CostFigures | None) -> list[Metric]:
        draft = GaugeMetricFamily(
            "specdec_spec_decode_draft_cost_target_steps",
            "Measured cost of one draft token, in plain target steps",
            labels=["drafter"],
        )
        verify = GaugeMetricFamily(
            "specdec_spec_decode_verify_cost_target_steps",
            "Measured cost of one verify call over k drafts (fitted in k), in plain target steps",
            labels=["drafter", "k"],
        )
        measured = GaugeMetricFamily(
            "specdec_spec_decode_costs_measured",
            "1: the cost gauges are measured; 0: the configured defaults, nothing timed yet",
            labels=["drafter"],
        )
        if figures is not None:
            draft.add_metric([self.drafter], figures["draft_cost"])
            for k, cost in figures["verify_cost"].items():
                if int(k) <= MAX_DEPTH:
                    verify.add_metric([self.drafter, depth_label(int(k))], cost)
            measured.add_metric([self.drafter], float(figures["measured"]))
        return [draft, verify, measured]


def _costs_of(engine: ReportsSpeculation) -> CostFigures | None:
    """The engine's measured costs now (None: it has no drafter)."""
    figures = engine.speculation_figures()
    return None if figures is None else figures["costs"]
