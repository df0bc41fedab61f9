"""One request's speculation state machine: draft length, fallback, probing, and its choices
inside a batch. The quantities it decides from (acceptance EWMA, costs, the predicted speedup) and
the fallback rules are stated in :mod:`specdec_rt.policy.acceptance`. Plain rules, no I/O.
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..errors import InvalidInputError
from ..types import FallbackEvent, Mode
from .acceptance import CATCHUP_FREE, CHEAP_PRIOR, AcceptanceEWMA, CostModel
from .arms import RoundToken
from .config import SpecConfig

__all__ = ["RequestPolicy"]


class RequestPolicy:
    """One request's speculation state machine: draft length, fallback, probing."""

    def __init__(
        self,
        config: SpecConfig,
        mode: Mode,
        ewma: AcceptanceEWMA,
        costs: CostModel,
        *,
        shared: AcceptanceEWMA | None = None,
        prompt_tokens: int = 0,
    ) -> None:
        if mode not in ("spec", "ar"):
            raise InvalidInputError(f"mode must be 'spec' or 'ar', got {mode!r}")
        self.config, self.mode, self.ewma, self.costs, self.shared = config, mode, ewma, costs, shared
        self.prompt_tokens = prompt_tokens
        self.speculating = mode == "spec"
        self._probes = True  # False: this request never speculates again
        self._zero = 0  # consecutive rounds that accepted nothing
        self._probing = False
        self._plain_since_probe = 0
        self._probe_every = config.probe_every
        self._drafted_at = -prompt_tokens  # generated tokens when the draft model last drafted (it has read
        # up to there); before its first draft it lacks the prompt too (what its prefix cache lacks)
        self.cheap_drafts = False  # the drafter can propose drafts that cost nothing (n-gram matches)
        self.cheap = False  # this round: only such drafts (set by draft_length)
        self.cheap_ewma = AcceptanceEWMA.start(config.alpha, CHEAP_PRIOR)  # their acceptance, apart
        self._lag = 0  # this round: tokens the draft model had to read before drafting
        self.free_only = False  # the draft model never drafts for this request (its prefill would not pay)
        self._deferred = False  # the first round left the draft's prefill to the next (defer_draft_prefill)
        self._round: RoundToken | None = None  # this round's entry in the batch's RoundLedger

    def best_k(self, batch: int = 1, cheap: bool = False) -> tuple[int, float]:
        """The draft length with the highest predicted speedup, and that speedup, for a request
        alone (``batch=1``) or sharing each step with ``batch - 1`` others (``cheap``: with
        drafts that cost nothing to make, verified in the batch's call)."""
        c, a = self.config, (self.cheap_ewma if cheap else self.ewma).value
        ks = [c.k_init] if not c.adapt_k else range(c.k_min, c.k_max + 1)
        if cheap and batch == 1:  # alone: the verify call's extra positions are all they cost
            return _peak(ks, lambda k: self.costs.speedup(a, k, free=True))
        rate = self.costs.cheap_speedup if cheap else self.costs.batch_speedup
        return _peak(ks, lambda k: rate(a, k, batch))

    def start(self, new_tokens: int) -> FallbackEvent | None:
        """Before the first round: if the draft's prefill of the prompt would cost more than
        speculation can save (long prompt, short answer), the draft model sits this request out:
        it speculates with free drafts only (n-gram matches, which need no prefill) when the
        drafter has them, else decodes plainly throughout."""
        a = self.ewma.value
        if self.speculating and not self.costs.prefill_pays(self.prompt_tokens, new_tokens, a, self.best_k()[0]):
            if self.cheap_drafts:
                self.free_only = True
                return FallbackEvent(0, "spec", "prefill_free_drafts", a)
            self.speculating = self._probes = False
            return FallbackEvent(0, "ar", "prefill", a)
        return None

    def draft_length(self, remaining: int, batch: int = 1, at: int = 0) -> int:
        """Drafts for the next round (see :meth:`_draft_length`); the round is entered in the
        batch's :class:`~specdec_rt.policy.arms.RoundLedger` until :meth:`observe` (or :meth:`close`)."""
        k = self._draft_length(remaining, batch, at)
        self.close()
        if self.mode == "ar" and at > 0:
            return k  # always plain: the same beside either kind, so it spoils neither's measurement
        model = bool(k) and not self.cheap
        kind = "other" if at == 0 or (model and self._lag > CATCHUP_FREE) else "drafts" if model else "plain"
        self._round = self.costs.ledger.start(kind)
        return k

    def close(self) -> None:
        """End the round in progress, unmeasured (the request stops: cancelled, failed, done)."""
        if self._round is not None:
            self.costs.ledger.end(self._round)
            self._round = None

    def _draft_length(self, remaining: int, batch: int = 1, at: int = 0) -> int:
        """Drafts for the next round (0 = one plain target step). ``remaining``: tokens still
        allowed, so a round never drafts past the budget (it emits at most k+1). ``batch``:
        requests running now; when drafting would slow the batch down, this round is plain
        (speculation turns down smoothly as the batch grows; no fallback is recorded, since
        that is the load's doing, not the draft's). ``at``: tokens generated so far; after plain
        steps in a batch the draft must first read what it missed, which must pay too."""
        self.cheap = False
        # the draft model's first round, whose prefill start() decided pays: the first round, or
        # the one after it when that left the prefill to it (defer_draft_prefill)
        first, self._deferred = at == 0 or self._deferred, False
        if self.mode == "ar" or remaining <= 1:
            return 0
        if not self.costs.measure:
            batch = 1  # a seeded request's schedule (so its output) never depends on the load
        # what the draft must read before drafting (not a draft cost); the first round's prefill: start() decided
        self._lag = lag = at - self._drafted_at if at else 0
        if at == 0 and self.speculating and not self.free_only and self.config.defer_draft_prefill:
            return self._deferred_prefill(remaining, batch)
        if not self.speculating:
            if batch > 1 or not self._probes or self._plain_since_probe < self._probe_every:
                return 0
            self._probing = True  # a probe drafts at least k_init tokens: one round, enough evidence
            return min(max(self.best_k()[0], self.config.k_init), remaining - 1)
        if batch > 1:
            in_batch = self._batch_drafts(remaining, batch, caught_up=first or lag <= CATCHUP_FREE, lag=lag)
            if in_batch is not None:
                return in_batch
        elif not self.free_only:
            if not first and self.costs.plain_stale():  # re-measure the unit of every cost (CostModel.plain_stale)
                return 0
            k = self.best_k()[0]
            if not first and lag > CATCHUP_FREE and not self.costs.catchup_pays(lag, remaining, self.ewma.value, k):
                return 0
            return min(k, remaining - 1)
        # no model drafts (in a batch, or alone when the draft's prefill would not pay): free
        # drafts, when a match turns up, verified in the call, if their acceptance pays their positions
        k, gain = self.best_k(batch, cheap=True)
        if gain < self.config.resume_speedup:
            return 0
        self.cheap = True
        return min(k, remaining - 1)

    def _deferred_prefill(self, remaining: int, batch: int) -> int:
        """The first round when the first token must not wait for the draft model's prefill:
        it verifies free drafts (when the drafter has them) with the target's prefill; the
        draft reads the prompt in the next round, while the first token is on its way."""
        self._deferred = True
        if not self.cheap_drafts:
            return 0
        length = self.best_k(batch, cheap=True)[0]  # (no gain rule: beside a prefill, positions are ~free)
        self.cheap = True
        return min(length, remaining - 1)

    def _batch_drafts(self, remaining: int, batch: int, *, caught_up: bool, lag: int) -> int | None:
        """In a batch, plain batched steps are left only for a clear gain (``resume_speedup``,
        hysteresis): model drafts when that kind of round was measured faster (else predicted
        so); ``None``: no model drafts, but free ones may pay (the caller's rule); 0: plain."""
        length, gain = self.best_k(batch)
        behind = not caught_up and not self.costs.catchup_pays_batch(lag, remaining, gain, batch)
        alone = self.best_k()[1] if batch == 2 else 0.0  # 2 requests explore drafts if they pay alone
        if not self.free_only and self.costs.batch_drafts(
            batch, gain, caught_up=caught_up, behind=behind, alone_gain=alone
        ):
            return min(length, remaining - 1)
        return None if self.cheap_drafts and self.costs.batched_verify else 0

    def observe(
        self,
        at: int,
        drafted: int,
        accepted: int,
        *,
        t_draft: float,
        t_verify: float,
        timed: bool = True,
        alone: bool = True,
        batch: int = 1,
        verified: int | None = None,
        steps: tuple[int, float] = (0, 0.0),
    ) -> FallbackEvent | None:
        """Feed one finished round; returns the mode switch it caused, if any. ``timed=False``
        marks a round that included a prefill (a request's first round; the first that drafted):
        its times are kept out of the per-step costs (the draft's is used for its prefill cost
        instead). A draft that first read tokens it had missed (a probe after plain steps, a
        catch-up) adds its verify call to the costs, not its draft time. ``alone=False``: other
        requests (``batch`` in all) shared the round's calls, so its times are not this request's
        costs (the step loop measures the batched calls), only this request's tokens per second
        in that kind of round (:class:`BatchArms`). ``verified``: the drafts the verify call took
        (a tree's nodes; default ``drafted``, its depth). ``steps``: the draft model's steps
        after its first call and their seconds (``DraftPlan.draft_steps``), which measure a
        draft step in a round whose draft time as a whole does not (a first round, a probe, a
        catch-up)."""
        if alone:
            self._measure_alone(
                drafted, t_draft=t_draft, t_verify=t_verify, timed=timed, verified=verified, steps=steps
            )
        pure = self.costs.ledger.end(self._round) if self._round is not None else True
        self._round = None
        if not alone and pure and self.mode == "spec" and at > 0:  # no other kind of round ran meanwhile
            model = bool(drafted) and not self.cheap
            if not model or (timed and self._lag <= CATCHUP_FREE):  # not the prompt's, nor a catch-up
                self.costs.observe_arm(batch, model, accepted + 1 if drafted else 1, t_draft + t_verify)
        return self._track(at, drafted, accepted)

    def _measure_alone(
        self,
        drafted: int,
        *,
        t_draft: float,
        t_verify: float,
        timed: bool,
        verified: int | None,
        steps: tuple[int, float],
    ) -> None:
        """A round this request ran alone: its times are its costs (see :meth:`observe`)."""
        if timed:  # a draft that first read what it missed (a probe, a catch-up): its verify
            caught_up = self._lag <= CATCHUP_FREE  # and its steps after that first call
            self.costs.observe(
                drafted,
                t_draft,
                t_verify,
                model_drafts=not self.cheap and caught_up,
                verified=verified,
                fresh=self._probing,
            )
            if not caught_up and not self.cheap:
                self.costs.observe_steps(*steps, fresh=self._probing)
        elif not self.cheap:  # free drafts read no prompt: no prefill to measure
            # what the draft read first: the prompt, and what was committed since (a deferred prefill)
            self.costs.observe_prefill(max(self.prompt_tokens, self._lag), drafted, t_draft, steps)

    def _track(self, at: int, drafted: int, accepted: int) -> FallbackEvent | None:
        """The round's acceptance into the EWMAs; the mode switch it causes, if any."""
        if self.cheap:  # free drafts in a batch: their own acceptance; they never switch modes
            self.cheap_ewma.observe(drafted, accepted)
            return None
        if drafted == 0:
            self._plain_since_probe += 1
            return None
        self._drafted_at = at + accepted + 1  # the draft model read up to what this round committed
        self.ewma.observe(drafted, accepted)
        if self.shared is not None:
            self.shared.observe(drafted, accepted)
        self._zero = self._zero + 1 if accepted == 0 else 0
        return self._end_probe(at) if self._probing else self._fall_back(at)

    def _end_probe(self, at: int) -> FallbackEvent | None:
        """After a probe's round: speculation resumes when it pays again, else the next probe
        waits longer (``probe_backoff``, up to ``probe_max_every`` plain steps)."""
        config, acceptance = self.config, self.ewma.value
        self._probing, self._plain_since_probe = False, 0
        if acceptance >= config.resume_above and self.best_k()[1] >= config.resume_speedup:
            self.speculating, self._zero, self._probe_every = True, 0, config.probe_every
            return FallbackEvent(at, "spec", "probe_ok", acceptance)
        self._probe_every = min(int(self._probe_every * config.probe_backoff), config.probe_max_every)
        return None

    def _fall_back(self, at: int) -> FallbackEvent | None:
        """Plain decoding from here when acceptance stays low (``fallback_below``), when
        ``zero_rounds`` rounds in a row accepted nothing, or when speculation no longer pays."""
        config, acceptance = self.config, self.ewma.value
        reason = (
            "ewma"
            if acceptance < config.fallback_below
            else "zero_rounds"
            if self._zero >= config.zero_rounds
            else "cost"
            if self.best_k()[1] < config.min_speedup
            else None
        )
        if reason is None:
            return None
        self.speculating, self._plain_since_probe, self._probe_every = False, 0, config.probe_every
        self.ewma.soften()  # let the probes' evidence count (hysteresis still needs resume_above)
        return FallbackEvent(at, "ar", reason, acceptance)


def _peak(ks: Sequence[int], speedup: Callable[[int], float]) -> tuple[int, float]:
    """``(k, speedup(k))`` at the highest speedup over the increasing ``ks``, scanning up to the
    first decrease: ``E(a, k)`` grows ever slower while a round's cost grows with k, so the
    predicted speedup rises to one peak and falls (asked for every request every round: a
    batch of 8 spent ~2% of its time here scanning every k)."""
    best: tuple[int, float] | None = None
    prev: float | None = None
    for k in ks:
        v = speedup(k)
        if best is None or v > best[1]:
            best = (k, v)
        elif prev is not None and v < prev:
            break
        prev = v
    assert best is not None, "no k to choose from"  # SpecConfig checks k_min <= k_max
    return best
