"""Stop a draft chain where the draft is unsure, at acceptance rates measured per confidence.

Notation as everywhere: p = target, q = draft. A drafted token's *confidence* is c = q(x), the
draft's probability of the token it proposes (greedy: its largest probability). How often a
draft of confidence c is accepted is measured per bucket of c (:data:`EDGES`) over every
verified draft: the drafts before the first rejection are successes, the rejected one a failure,
the ones after it no evidence. A smaller model's confidence tracks its acceptance (the Qwen2.5
0.5B draft: 0.58 at c < 0.3, 1.00 at c >= 0.97); a quantized copy of the target is accepted at
almost any c (its low c is a close call it still gets right), so its rates stay high and its
chains as long as before. Off by default: it did not pay on the shipped pairs
(docs/decisions/0007-confidence-stop-off.md).

The rule (a marginal rate): after its i-th token a chain survives whole with probability
``S_i = r(c_1) ... r(c_i)`` (r: the measured rate of a confidence). One more draft costs
``d + s`` target steps (a draft step and a verified position) and adds ``S_i * a`` tokens on
average (a: the request's acceptance). It pays while that is at least what the round yields per
step, the policy's predicted speedup R: ``S_i * a >= (d + s) * R``, so the drafter stops once
``S_i < floor = (d + s) * R / a``.

Exactness: where a chain stops depends only on the draft's own probabilities and on earlier
rounds, never on this round's target outputs, so greedy output and the sampled distribution
are those of any chain length. A seeded sampled request does not use it: its schedule must not
depend on other requests, and the rates are shared.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["EDGES", "ConfidenceRates", "ChainStop", "confidence"]

EDGES = np.array([0.3, 0.5, 0.7, 0.9, 0.97])  # upper edges of the confidence buckets (6 buckets)


def confidence(logits: np.ndarray) -> float:
    """The largest probability of ``softmax(logits)`` ``[V]``: a greedy draft's confidence."""
    return float(1.0 / np.exp(logits - logits.max()).sum())


class ConfidenceRates:
    """Acceptance per confidence bucket: decayed sums of successes and trials (each observation
    decays its bucket by ``1 - alpha``), read against a prior worth ``prior_weight`` trials at
    the caller's acceptance. Shared by a scheduler's requests."""

    def __init__(self, alpha: float = 0.05, prior_weight: float = 4.0) -> None:
        self.alpha, self.prior_weight = alpha, prior_weight
        self.hits = np.zeros(EDGES.size + 1)  # [buckets]
        self.trials = np.zeros(EDGES.size + 1)  # [buckets]

    @staticmethod
    def bucket(c: float) -> int:
        return int(np.searchsorted(EDGES, c, side="right"))

    def rate(self, c: float, prior: float) -> float:
        """The measured acceptance of a draft of confidence ``c`` (``prior`` where unmeasured)."""
        b = self.bucket(c)
        return float((self.hits[b] + self.prior_weight * prior) / (self.trials[b] + self.prior_weight))

    def observe(self, confs: Sequence[float], accepted: int) -> None:
        """A verified chain: ``confs`` of its drafts in order, the first ``accepted`` accepted."""
        for i, c in enumerate(confs[: accepted + 1]):
            b = self.bucket(c)
            self.hits[b] = self.hits[b] * (1.0 - self.alpha) + (i < accepted)
            self.trials[b] = self.trials[b] * (1.0 - self.alpha) + 1.0


class ChainStop:
    """One round's stopping rule, handed to the drafter as ``ctx.plan.chain_stop``: call
    :meth:`more` with the confidence of every token proposed; stop drafting when it says so."""

    def __init__(self, rates: ConfidenceRates, acceptance: float, floor: float) -> None:
        self.rates, self.acceptance, self.floor = rates, acceptance, floor
        self.survival = 1.0
        self.confs: list[float] = []  # of the tokens proposed this round, in order

    def more(self, c: float) -> bool:
        """Record the confidence of the token just proposed; whether another draft pays."""
        self.confs.append(c)
        self.survival *= self.rates.rate(c, self.acceptance)
        return self.survival >= self.floor

    def observe(self, accepted: int) -> None:
        """After the verify: the round's outcome feeds the shared rates."""
        self.rates.observe(self.confs, accepted)
