"""Model drafts or plain rounds in a batch: decided by measured rounds, not by the prediction.

Predicted costs miss what a batch really does (rows that wait for the longest, the draft's own
batched steps, rows out of phase), so for each batch size :class:`BatchArms` keeps what one
request really got per second in rounds of each kind ("arms", as in a bandit): plain rounds
(the request fed one token, or free n-gram drafts) and model-draft rounds (draft k, verify
k + 1). Both measured, the faster kind is used (drafts by ``ARM_MARGIN``); before that the
prediction decides, and the kind it rules out is probed soon (``ARM_FIRST_PROBE``), so that a
prediction is never a standing verdict.

Rules (the measurements behind each: docs/decisions/0010-batch-arms-measured.md):

* Only rounds in which every request of the batch took the same kind are measured
  (:class:`RoundLedger` tells whether a round overlapped a round of another kind, a prompt's or a
  catch-up round); a mixed round flatters drafts and slanders plain rows.
* A probe is one whole round of the batch taking the other kind. A probe of model drafts after
  plain rounds first lets every draft read what it missed (a round that is not measured), then
  takes the measured round. A periodic probe of drafts measured slower is skipped when the
  catching up would not pay. The probe period doubles while probes confirm the kind in use (up
  to ``ARM_PROBE_MAX``).
* A batch size never measured with model drafts is explored only where drafts are within reach:
  the nearest smaller batch size, at most 2 smaller, measured both kinds and model drafts won
  clearly there (by ``resume_speedup``), or, for 2 requests, speculation pays alone.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

__all__ = ["BatchArms", "RoundLedger", "RoundToken", "ROUND_KINDS"]

ARM_PROBE_EVERY = 24  # rounds (per request of the batch) between probes of the slower kind
ARM_PROBE_MAX = 192  # ... at most, once probes keep confirming the kind in use
ARM_FIRST_PROBE = 4  # rounds (per request) before the first probe of the kind never measured
ARM_SAMPLES = 8  # recent rounds of a kind its rate is the median of
ARM_MIN_SAMPLES = 3  # rounds of a kind before its rate counts
ARM_MARGIN = 1.02  # model drafts in a batch must be this much faster per request than plain rounds

ROUND_KINDS = ("plain", "drafts", "other")  # other: a prompt's round, or a draft catching up
#: a round in a :class:`RoundLedger`: its kind, whether it started alone among the kinds, and
#: how many rounds of each other kind had started by then
RoundToken = tuple[str, bool, tuple[int, ...]]


def _median_of(rates: list[float]) -> float | None:
    return statistics.median(rates) if len(rates) >= ARM_MIN_SAMPLES else None


@dataclass
class BatchArms:
    """Tokens per second of one request in rounds of a batch of one size, per kind of round (the
    median of the last ``ARM_SAMPLES``, counted from ``ARM_MIN_SAMPLES``), and the probe state."""

    plain_rates: list[float] = field(default_factory=list)  # tokens/s of a request, recent plain rounds
    draft_rates: list[float] = field(default_factory=list)  # ... recent model-draft rounds
    rounds: int = 0  # request rounds observed since the last probe
    probing: int = 0  # decisions still to take the probe's kind
    probe_drafts: bool = False  # the kind the probe takes
    period: int = ARM_PROBE_EVERY  # rounds per request between probes (doubles while confirmed)
    last_best: bool | None = None  # the kind in use when the last probe started

    plain: float | None = None  # the median of plain_rates (None: fewer than ARM_MIN_SAMPLES)
    drafts: float | None = None  # ... of draft_rates

    @property
    def measured(self) -> bool:
        return self.plain is not None and self.drafts is not None

    def __post_init__(self) -> None:
        self.plain, self.drafts = _median_of(self.plain_rates), _median_of(self.draft_rates)

    def observe(self, drafting: bool, rate: float) -> None:
        rates = self.draft_rates if drafting else self.plain_rates
        rates.append(rate)
        del rates[:-ARM_SAMPLES]
        self.rounds += 1
        if drafting:
            self.drafts = _median_of(rates)
        else:
            self.plain = _median_of(rates)

    def choose(
        self,
        batch: int,
        predicted: float,
        threshold: float,
        *,
        caught_up: bool = True,
        behind: bool = False,
        explore: bool = True,
    ) -> bool:
        """Model drafts this round? ``predicted``: their predicted gain over plain rounds (drafts
        when >= ``threshold``, and not ``behind``, until both kinds were measured);
        ``caught_up``: this request's draft has read what the target committed (else a probe of
        drafts takes two rounds); ``behind``: its catching up is predicted not to pay (the
        prediction then says plain, and a periodic probe of model drafts measured slower is
        skipped; an exploration of drafts never measured still catches up);
        ``explore``: model drafts never measured at this batch size may be probed."""
        if self.probing:  # the rest of a probe: every request takes it, or nothing is measured
            self.probing -= 1
            return self.probe_drafts
        want = predicted >= threshold and not behind
        if self.plain is None and self.drafts is None:
            return want
        if self.drafts is not None and self.plain is not None:  # both measured
            best, every = self.drafts > self.plain * ARM_MARGIN, self.period
        else:  # one kind measured: the prediction decides; the other kind is probed soon
            best, every = want, ARM_FIRST_PROBE
            if best == (self.drafts is None):
                return best  # the prediction takes the kind not measured: it gets measured now
            if self.drafts is None and not explore:
                return best  # not worth every row's catch-up where drafts are not likely to pay
        if self.rounds < every * batch:
            return best
        probe = not best
        if self.measured:  # probes that keep confirming the kind in use come less often
            same = best == self.last_best
            self.period = min(self.period * 2, ARM_PROBE_MAX) if same else ARM_PROBE_EVERY
            self.last_best = best
            if probe and behind:  # measured slower, and every row's catch-up would not pay: skipped
                self.rounds = 0
                return best
        self.rounds, self.probe_drafts = 0, probe
        self.probing = (2 * batch if probe and not caught_up else batch) - 1
        return probe


class RoundLedger:
    """Which kinds of round run now among the requests that share a batch, so that a round can
    tell whether it overlapped a round of another kind (then its rate is not measured)."""

    def __init__(self) -> None:
        self.active = dict.fromkeys(ROUND_KINDS, 0)
        self.started = dict.fromkeys(ROUND_KINDS, 0)

    def start(self, kind: str) -> RoundToken:
        others = [o for o in ROUND_KINDS if o != kind]
        clean = not any(self.active[o] for o in others)
        self.active[kind] += 1
        self.started[kind] += 1
        return kind, clean, tuple(self.started[o] for o in others)

    def end(self, token: RoundToken) -> bool:
        """End the round ``token`` (from :meth:`start`); True if no round of another kind ran
        during it."""
        kind, clean, seen = token
        self.active[kind] -= 1
        return clean and seen == tuple(self.started[other] for other in ROUND_KINDS if other != kind)
