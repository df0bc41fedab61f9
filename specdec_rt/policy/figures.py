"""The costs a :class:`~specdec_rt.policy.acceptance.CostModel` decides with, as figures to report
(the bench's JSON and markdown, the server's ``/metrics`` and ``/v1/models``).

Both are in units of one plain target step (one token through the target alone):

* ``draft_cost``: one draft token, the EWMA of the draft model's seconds per step in rounds run
  alone (its prefill of a prompt and first catch-up calls timed apart), over the plain step;
* ``verify_cost[k]``: one verify call over k drafts (k + 1 positions), the fitted line
  ``1 + j + s*k`` through the EWMAs of the verify calls measured at each k
  (:func:`~specdec_rt.policy.verify_fit.fit_line`); ``verify_measured[k]``: the measured EWMA at
  that k itself, where one was measured.

Until something is measured the configured defaults stand (``measured`` False).

And the acceptance at each draft depth, from :class:`~specdec_rt.types.Stats` counts
(:func:`acceptance_by_depth`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import TypedDict

from ..types import Stats
from .acceptance import CostModel

__all__ = ["CostFigures", "DepthRow", "SpeculationFigures", "acceptance_by_depth", "cost_figures"]


class CostFigures(TypedDict):
    """Measured costs of speculation; every cost in plain target steps, keys of the per-k maps
    are k as text (JSON's)."""

    measured: bool  # a draft token and a verify call were timed (else: the configured defaults)
    plain_step_ms: float | None  # the unit: one plain target step (measured, else the fit's), ms
    draft_token_ms: float | None  # one draft token, ms (None: never timed)
    draft_cost: float  # one draft token, in plain target steps
    verify_cost: dict[str, float]  # k -> the fitted cost of a verify over k drafts, k = 1..k_max
    verify_measured: dict[str, float]  # k -> the measured verify over k drafts, where measured


def cost_figures(costs: CostModel, k_max: int) -> CostFigures:
    """``costs`` now, with the fitted verify cost at every k from 1 to ``k_max``."""
    base = costs.plain_step_s()
    draft_cost, _ = costs.relative()
    measured_verify = {k: v for k, v in costs.verify_s.items() if k > 0}
    return {
        "measured": base is not None and costs.draft_token_s is not None and bool(measured_verify),
        "plain_step_ms": None if base is None else base * 1e3,
        "draft_token_ms": None if costs.draft_token_s is None else costs.draft_token_s * 1e3,
        "draft_cost": draft_cost,
        "verify_cost": {str(k): costs.verify_cost(k) for k in range(1, k_max + 1)},
        "verify_measured": {} if base is None else {str(k): v / base for k, v in sorted(measured_verify.items())},
    }


class DepthRow(TypedDict):
    """Draft depth ``depth`` (1: a round's first draft) over some requests: ``drafted`` rounds
    tried it (every earlier draft accepted), ``accepted`` kept it; ``rate`` = accepted / drafted,
    which is P(accepted | every earlier draft accepted)."""

    depth: int
    drafted: int
    accepted: int
    rate: float


def acceptance_by_depth(stats: list[Stats]) -> list[DepthRow]:
    """Each depth's counts summed over ``stats`` (``Stats.position_drafted`` /
    ``position_accepted``); depths that no round tried are left out."""
    drafted: defaultdict[int, int] = defaultdict(int)
    accepted: defaultdict[int, int] = defaultdict(int)
    for x in stats:
        for index, (tried, kept) in enumerate(zip(x.position_drafted, x.position_accepted)):
            drafted[index] += tried
            accepted[index] += kept
    return [
        {
            "depth": index + 1,
            "drafted": drafted[index],
            "accepted": accepted[index],
            "rate": accepted[index] / drafted[index],
        }
        for index in sorted(drafted)
        if drafted[index]
    ]


class SpeculationFigures(TypedDict):
    """What an engine's speculation measured since it started: ``drafter`` (its draft spec),
    ``costs`` now and ``acceptance_by_depth`` over its finished requests."""

    drafter: str
    costs: CostFigures
    acceptance_by_depth: list[DepthRow]
