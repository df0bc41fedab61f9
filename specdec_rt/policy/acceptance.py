"""What speculation is worth: acceptance EWMA and measured costs (the rules that use them, draft
length and fallback, are :mod:`specdec_rt.policy.request`).

Plain data, no I/O. The quantities:

* ``a``, the **acceptance EWMA**: the probability that a draft token is accepted given that every
  earlier one in its round was, estimated from rounds with exponential weights (decay ``alpha``
  per round). A round that drafted k and accepted n counts n successes in ``n + (1 if n < k)``
  trials, which is the maximum-likelihood estimate for geometric acceptance, whatever k was.
* **costs**, in units of one plain target step: ``d`` per draft token and ``v(k) = 1 + j + s*k``
  for one verify call over k >= 1 drafts (``j``: what the first draft costs beyond the slope,
  since measured verify costs are concave in k). Measured (EWMA of seconds) unless the request is
  seeded, then the configured defaults, so that a seeded request's schedule never depends on the
  wall clock.
* The expected tokens per round with k drafts is ``E(a, k) = 1 + a + ... + a^k`` and the predicted
  speedup over plain decoding ``E(a, k) / (k*d + v(k))``. The draft length is its argmax over
  ``k_min..k_max``.

Fallback to plain decoding happens when ``a < fallback_below``, after ``zero_rounds`` rounds that
accepted nothing, or when no k is predicted to pay (``speedup < min_speedup``); a whole request
decodes plainly when the draft's prefill of its prompt is predicted to cost more than
speculating over ``max_new_tokens`` saves (measured prefill cost per prompt token). While falling back,
a probe round speculates every ``probe_every`` plain tokens (backing off after failed probes); it
resumes only if ``a >= resume_above`` and the speedup is predicted, a gap (hysteresis) that keeps a
request from flapping between the modes. A probe's measurements replace the cost estimates it
re-tests (a slow moment's price would otherwise outlive it: nothing else drafts meanwhile).
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from .arms import BatchArms, RoundLedger
from .config import SpecConfig
from .verify_fit import Line, fit_line

__all__ = ["AcceptanceEWMA", "BatchArms", "CostModel", "expected_tokens"]


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens emitted by one round of k drafts at acceptance a: 1 + a + ... + a^k."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass
class AcceptanceEWMA:
    """Exponentially weighted estimate of the per-token acceptance probability.

    The ratio of two decayed sums (accepted drafts over tried drafts), each decayed by
    ``1 - alpha`` per round: an EWMA in which a round that tried more drafts carries more weight.
    The prior counts as ``prior_weight`` tried drafts.
    """

    alpha: float = 0.1
    hits: float = 2.8  # decayed accepted drafts
    trials: float = 4.0  # decayed drafts that were tried

    @classmethod
    def start(cls, alpha: float, value: float, prior_weight: float = 4.0) -> "AcceptanceEWMA":
        return cls(alpha, value * prior_weight, prior_weight)

    @property
    def value(self) -> float:
        return self.hits / self.trials if self.trials > 0 else 0.0

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        tried = accepted + (1 if accepted < drafted else 0)
        self.hits = (1 - self.alpha) * self.hits + accepted
        self.trials = (1 - self.alpha) * self.trials + tried

    def soften(self, factor: float = 0.25) -> None:
        """Keep the estimate but weigh it less, so the next observations move it faster."""
        self.hits *= factor
        self.trials *= factor

    def copy(self) -> "AcceptanceEWMA":
        return AcceptanceEWMA(self.alpha, self.hits, self.trials)


DRAFT_BATCH_MARGIN = 1.5  # a draft's batched step, estimated from its step alone, is taken this much dearer
CHEAP_PRIOR = 0.5  # acceptance assumed for free drafts (n-gram matches) in a batch, until observed
CATCHUP_FREE = 4  # a draft this few tokens behind catches up in its next call at no extra cost
CATCHUP_BLIND = 4  # unmeasured: a draft catches up on at most this many tokens per token left
PREFILL_EXPLORE_EVERY = 8  # after this many prefill skips in a row, one request speculates anyway
PREFILL_SAMPLES = 8  # draft prefill measurements the estimate is the median of
PLAIN_REFRESH_EVERY = 48  # rounds alone without a plain step, after which one round is plain


class TargetStepSeconds(Protocol):
    """Seconds of one batched target call of ``rows`` rows feeding ``positions`` new positions in
    all (default: one each), ``None`` where never measured (``BatchCosts.target_step``)."""

    def __call__(self, rows: int, positions: int | None = None, /) -> float | None: ...


@dataclass
class CostModel:
    """Measured seconds per draft token and per verify call (EWMAs), as costs relative to one
    plain target step. Unmeasured quantities use the configured defaults; ``measure=False`` keeps
    the defaults forever (seeded requests)."""

    config: SpecConfig = field(default_factory=SpecConfig)
    measure: bool = True
    draft_token_s: float | None = None
    verify_s: dict[int, float] = field(default_factory=dict)  # drafts k -> seconds per verify call
    draft_prefill_s: float | None = None  # seconds per prompt token of the draft's prefill
    prefill_skips: int = 0  # requests in a row decoded plainly by the prefill rule
    prefill_samples: list[float] = field(default_factory=list)  # recent draft prefill seconds per token
    # seconds of one batched target call of B rows and N new positions in all, (B, N) -> seconds
    # (measured by the step loop; None: unknown)
    batch_step_s: TargetStepSeconds | None = None
    batch_shapes: Callable[[int], Sequence[int]] | None = None  # rows -> measured positions, sorted
    batched_verify: bool = False  # the target verifies the rows of a batch in one call
    draft_step_s: Callable[[int], float | None] | None = None  # batched draft model step of B rows
    batch_arms: dict[int, BatchArms] = field(default_factory=dict)  # batch -> measured kinds of round
    ledger: RoundLedger = field(default_factory=RoundLedger)  # kinds of round running now (their purity)
    _line: Line | None = field(default=None, repr=False, compare=False)  # _verify_line, until verify_s changes
    since_plain: int = 0  # rounds alone timed since the last plain step was (the unit of every cost)

    def __setattr__(self, name: str, value: object) -> None:
        if name == "verify_s":  # a new dict of measurements: the fitted line goes with the old one
            object.__setattr__(self, "_line", None)
        object.__setattr__(self, name, value)

    def observe(
        self,
        drafted: int,
        t_draft: float,
        t_verify: float,
        *,
        model_drafts: bool = True,
        verified: int | None = None,
        fresh: bool = False,
    ) -> None:
        """A round alone: ``drafted`` drafts deep, its verify call over ``verified`` drafts (a
        tree's nodes; default ``drafted``), and (``model_drafts``: the drafts came from the
        drafter's own steps, not only free n-gram matches) their cost per depth. ``fresh``: a
        probe, which re-tests the costs that may have stopped speculation: every length's verify
        cost is rescaled to what this one measured (shape kept, level refreshed)."""
        if not self.measure:
            return
        if drafted and model_drafts:
            self.draft_token_s = self._ewma(self.draft_token_s, t_draft / drafted)
        n = drafted if verified is None else verified
        base = self._verify_line()[0] if fresh and n and t_verify > 0 else None  # the fit: a probe's only
        if base is not None:
            r = t_verify / (base * self.verify_cost(n))
            self.verify_s = {j: v * r if j else v for j, v in self.verify_s.items()}
            self.verify_s[n] = t_verify
        elif n == 0:  # the unit: a sample after a long gap counts as that many rounds' worth
            gap = self.since_plain + 1
            self.verify_s[0] = self._ewma(self.verify_s.get(0), t_verify, 1.0 - (1.0 - self.config.alpha) ** gap)
        else:
            self.verify_s[n] = self._ewma(self.verify_s.get(n), t_verify)
        self.since_plain = 0 if n == 0 else self.since_plain + 1
        self._line = None

    def plain_stale(self) -> bool:
        """A round alone should be plain: none was for ``PLAIN_REFRESH_EVERY`` rounds, so the plain
        step, the unit of every cost, may be the machine's speed of long ago (a request that always
        drafts never measures it; seen: 19.1 ms kept while steps took ~26 ms, so drafts read 0.72
        of a step instead of ~0.5 and the prefill rule sent a request to n-gram drafts). One plain
        round in 48 costs ~0.2% of a speculating request's speed."""
        return self.measure and self.since_plain >= PLAIN_REFRESH_EVERY

    def observe_steps(self, steps: int, seconds: float, fresh: bool = False) -> None:
        """``steps`` draft steps took ``seconds``, timed apart from a first call that read a
        prompt or tokens the draft had missed (a first round, a probe, a catch-up). ``fresh``: a
        probe's, which replaces the estimate (an EWMA would keep a slow moment's price for
        dozens of probes: nothing else drafts meanwhile)."""
        if not self.measure or steps <= 0 or seconds <= 0:
            return
        per = seconds / steps
        self.draft_token_s = per if fresh else self._ewma(self.draft_token_s, per)

    def forget_times(self) -> None:
        """Drop every measured time alone (an engine's first request, which paid for its start)."""
        self.draft_token_s = self.draft_prefill_s = None
        self.verify_s, self.prefill_samples = {}, []

    def observe_prefill(
        self, prompt_tokens: int, drafted: int, t_draft: float, steps: tuple[int, float] = (0, 0.0)
    ) -> None:
        """A first round: the draft prefilled ``prompt_tokens`` then took ``drafted - 1`` steps
        (``steps``: their count and seconds if timed; else priced at the estimate). The estimate
        is the median of the last ``PREFILL_SAMPLES`` such rounds, not an EWMA: a first prefill
        that also paid for allocations (a cold engine) would otherwise keep requests from
        speculating, and so from measuring again, for dozens of requests."""
        if not self.measure or not drafted or prompt_tokens <= 0:
            return
        timed = steps[0] == drafted - 1 > 0
        if timed:
            self.observe_steps(*steps)
        if self.draft_token_s is None:
            return
        rest = steps[1] if timed else (drafted - 1) * self.draft_token_s
        per = max(0.0, t_draft - rest) / prompt_tokens
        self.prefill_samples = (self.prefill_samples + [per])[-PREFILL_SAMPLES:]
        self.draft_prefill_s = statistics.median(self.prefill_samples)

    def _ewma(self, old: float | None, new: float, weight: float | None = None) -> float:
        w = self.config.alpha if weight is None else weight
        return new if old is None else old + w * (new - old)

    def _verify_line(self) -> tuple[float | None, float, float]:
        """``(base, j, s)``: seconds of one plain target step (None if unmeasured) and the cost
        of a verify over k >= 1 drafts, ``1 + j + s*k`` plain steps (:func:`~specdec_rt.policy.verify_fit.fit_line`)."""
        if self._line is None:
            self._line = fit_line(self.verify_s, self.config.verify_cost_per_token)
        return self._line

    def _base_and_slope(self) -> tuple[float | None, float]:
        """Seconds of one plain target step (None if unmeasured) and the relative verify slope."""
        base, _, s = self._verify_line()
        return base, s

    def plain_step_s(self) -> float | None:
        """Seconds of one plain target step, the unit of every relative cost: measured, else
        the verify line's value at k = 0 (None while no target call was timed)."""
        return self._base_and_slope()[0]

    def relative(self) -> tuple[float, float]:
        """``(d, s)``: draft-token cost and verify slope, in units of one plain target step."""
        base, s = self._base_and_slope()
        d = self.config.draft_cost
        if base is not None and self.draft_token_s is not None:
            d = self.draft_token_s / base
        return d, s

    def verify_cost(self, k: int) -> float:
        """A verify call over ``k`` drafts (``k + 1`` positions), in plain target steps:
        ``1 + j + s*k`` (1 for k = 0)."""
        if k <= 0:
            return 1.0
        _, j, s = self._verify_line()
        return 1.0 + j + s * k

    def prefill_pays(self, prompt_tokens: int, new_tokens: int, a: float, k: int) -> bool:
        """Whether speculating over ``new_tokens`` saves more time than the draft needs to
        prefill the prompt (True until both are measured).

        Never a standing verdict: a request decoded plainly measures nothing, so after
        ``PREFILL_EXPLORE_EVERY`` skips in a row one request speculates anyway and refreshes the
        estimates (without this, one noisy measurement could switch speculation off for good).
        And when speculation does not pay at all (speedup <= 1) this rule abstains: the per-round
        cost rule decides, and it probes.
        """
        base, _ = self._base_and_slope()
        if not self.measure or base is None or self.draft_prefill_s is None:
            return True
        speedup = self.speedup(a, k)
        if speedup <= 1.0:
            return True
        saved = new_tokens * base * (1.0 - 1.0 / speedup)
        if saved > prompt_tokens * self.draft_prefill_s:
            return True
        self.prefill_skips += 1
        # explore sooner while the estimate rests on fewer than 3 measurements
        if self.prefill_skips >= (PREFILL_EXPLORE_EVERY if len(self.prefill_samples) >= 3 else 2):
            self.prefill_skips = 0
            return True
        return False

    def catchup_pays(self, lag: int, new_tokens: int, a: float, k: int) -> bool:
        """Whether speculating over ``new_tokens`` saves more than feeding the draft the ``lag``
        tokens it has not seen (after plain steps in a batch). Until both are measured: when the
        lag is at most ``CATCHUP_BLIND`` tokens per token left (a draft that missed a whole
        prompt and answer is not fed them for the last few tokens of a request)."""
        base, _ = self._base_and_slope()
        if not self.measure or base is None or self.draft_prefill_s is None:
            return lag <= CATCHUP_BLIND * new_tokens
        speedup = self.speedup(a, k)
        return speedup > 1.0 and new_tokens * base * (1.0 - 1.0 / speedup) > lag * self.draft_prefill_s

    def _plain_batch_s(self, batch: int) -> float | None:
        """``c(B, B)``: seconds of a plain batched step of ``batch`` rows (None: unknown)."""
        return self.batch_step_s(batch, batch) if self.batch_step_s is not None else None

    def observe_arm(self, batch: int, drafting: bool, tokens: int, seconds: float) -> None:
        """A round of one request in a batch of ``batch``: its tokens per second, per kind of
        round (plain, model drafts; the median of recent rounds), which :meth:`batch_drafts`
        compares."""
        if self.measure and seconds > 0:
            arms = self.batch_arms.setdefault(batch, BatchArms())
            arms.observe(drafting, tokens / seconds)

    def batch_drafts(
        self, batch: int, gain: float, *, caught_up: bool = True, behind: bool = False, alone_gain: float = 0.0
    ) -> bool:
        """Whether a request in a batch of ``batch`` drafts with the model this round: the kind
        of round measured faster at this batch size, or the prediction (``gain`` >=
        ``resume_speedup``, not ``behind``) until both kinds were measured; see
        :class:`~specdec_rt.policy.arms.BatchArms`. ``alone_gain``: the predicted speedup of this
        request alone (whether 2 requests explore model drafts)."""
        threshold = self.config.resume_speedup
        arms = self.batch_arms.get(batch)
        if arms is None:
            return gain >= threshold and not behind
        explore = self._explore(batch, alone_gain)
        return arms.choose(batch, gain, threshold, caught_up=caught_up, behind=behind, explore=explore)

    def _explore(self, batch: int, alone_gain: float) -> bool:
        """Model drafts never measured at ``batch`` are within reach: they won clearly (by
        ``resume_speedup``) at the nearest smaller batch size that measured both kinds, if it is
        at most 2 smaller (a win at 4 said little about 8: exploring there cost 7-14% of a short
        run), or (2 requests) they pay alone."""
        if batch == 2:
            return alone_gain >= self.config.resume_speedup
        for b in range(batch - 1, max(1, batch - 3), -1):
            arms = self.batch_arms.get(b)
            if arms is not None and arms.drafts is not None and arms.plain is not None:  # both measured
                return arms.drafts > arms.plain * self.config.resume_speedup  # a clear win, not noise
        return False

    def catchup_pays_batch(self, lag: int, new_tokens: int, gain: float, batch: int) -> bool:
        """In a batch: model drafts at ``gain`` over plain batched steps save ``new_tokens`` x
        ``c(B, B)`` x ``(1 - 1/gain)``; first every row's draft reads what it missed (``lag``
        tokens each, one row after another while the batch waits). Unmeasured: the blind rule."""
        c1 = self._plain_batch_s(batch)
        if c1 is None or self.draft_prefill_s is None or gain <= 1.0:
            return gain > 1.0 and lag <= CATCHUP_BLIND * new_tokens
        return new_tokens * c1 * (1.0 - 1.0 / gain) > batch * lag * self.draft_prefill_s

    def speedup(self, a: float, k: int, *, free: bool = False, nodes: int = 0, hit_rate: float = 0.0) -> float:
        """Predicted tokens/s of k-draft rounds relative to plain decoding (``free``: drafts
        that cost nothing to make, n-gram matches; ``nodes``: a tree's nodes beyond its k-long
        main chain, verified in the same call, each on the accepted path at ``hit_rate``)."""
        d, _ = self.relative()
        return (expected_tokens(a, k) + nodes * hit_rate) / ((0.0 if free else k * d) + self.verify_cost(k + nodes))

    def batch_speedup(self, a: float, k: int, batch: int) -> float:
        """Predicted tokens/s of the whole batch when this request drafts k, relative to all
        ``batch`` requests taking one plain step together.

        A drafting request leaves the batched step (the others take theirs, ``c(B-1)``) and pays
        its own k draft steps and verify call: ``(B - 1 + E(a, k)) / (c(B-1) + k*d + v(k))``
        against ``B / c(B)``, in seconds. For B = 1 this is :meth:`speedup`. Unknown costs
        (never measured at this batch size) predict no gain: the request then decodes plainly
        in the batch, which measures ``c(B)``.
        """
        if batch <= 1 or self.batch_step_s is None or not self.measure:
            return self.speedup(a, k)
        if self.batched_verify:
            return self._batched_speedup(a, k, batch)
        base, _ = self._base_and_slope()
        c_b, c_rest = self.batch_step_s(batch), self.batch_step_s(batch - 1)
        if base is None or self.draft_token_s is None or c_b is None or c_rest is None:
            return 0.0
        c_rest = min(c_rest, c_b)  # fewer rows never cost more (a noisy measurement must not say so)
        t_spec = c_rest + k * self.draft_token_s + base * self.verify_cost(k)
        return (batch - 1 + expected_tokens(a, k)) / t_spec * (c_b / batch)

    def _batched_speedup(self, a: float, k: int, batch: int) -> float:
        """Every request of the batch drafting k with the draft model (their draft steps run
        together, before the target's calls; their verifies are one call of B rows and B(k+1)
        positions) against all taking plain steps: ``E(a, k) c(B, B) / (k d(B) + c(B, B(k+1)))``.
        ``d(B)``: the draft model's measured batched step, else its step alone scaled as the
        target's step scales from 1 to B rows, with a margin. Unknown costs: no gain predicted (plain steps
        measure ``c(B, B)``; requests alone measure the draft)."""
        c1 = self._plain_batch_s(batch)
        if c1 is None:
            return 0.0
        d = self.draft_step_s(batch) if self.draft_step_s is not None else None
        alone = self._plain_batch_s(1) or self._base_and_slope()[0]  # a plain step alone, else a verify's base
        if d is None and self.draft_token_s is not None and alone:
            # a draft step grows with rows at least as the target's does (quantized drafts grow
            # faster: int8 SmolLM2 0.62 of the target alone, 0.79 at 8 rows): unmeasured, a margin
            d = self.draft_token_s * c1 / alone * DRAFT_BATCH_MARGIN
        if d is None:  # never measured: exploring would cost the draft's prefill of every prompt
            return 0.0
        # measured rounds decide whether to draft (batch_drafts, BatchArms); this picks k, and
        # whether to draft until the rounds of both kinds were measured
        return expected_tokens(a, k) * c1 / (k * d + self.batch_call_s(batch, batch * (k + 1)))

    def cheap_speedup(self, a: float, k: int, batch: int) -> float:
        """This request verifying k drafts that cost nothing to make (n-gram matches) inside the
        batch's call, against its plain step there: its share of a plain batched step is
        ``c(B, B) / B``; the k extra positions add ``k m`` (``m``: the marginal cost of one more
        position in a batched call, measured). ``E(a, k) (c/B) / (c/B + k m)``."""
        c1 = self._plain_batch_s(batch)
        if c1 is None:
            return 0.0
        share = c1 / batch
        m = (self.batch_call_s(batch, batch + k) - c1) / k
        return expected_tokens(a, k) * share / (share + k * m)

    def batch_call_s(self, batch: int, positions: int) -> float:
        """Seconds of a batched target call of ``batch`` rows and ``positions`` positions: the
        measurement, else a line through ``c(B, B)`` and the nearest longer measured call, else
        the slope of a verify alone (measured, else the default)."""
        step = self.batch_step_s
        c1 = step(batch, batch) if step is not None else None
        # the callers measured c(B, B) first (cheap_speedup, _batched_speedup)
        assert step is not None and c1 is not None, f"batch_call_s({batch}, ...) before c(B, B) was measured"
        t = step(batch, positions)
        if t is not None or positions <= batch:
            return max(t if t is not None else c1, c1)
        if self.batch_shapes is not None:  # asked for every k of every request every round: no scan
            shapes = self.batch_shapes(batch)
            i = bisect.bisect_left(shapes, positions)
            longer = shapes[i] if i < len(shapes) and shapes[i] < positions + 4 * batch else None
        else:
            longer = next((n for n in range(positions, positions + 4 * batch) if step(batch, n) is not None), None)
        t_longer = step(batch, longer) if longer is not None else None
        if longer is not None and t_longer is not None:
            return c1 + max(0.0, t_longer - c1) * (positions - batch) / (longer - batch)
        base, s = self._base_and_slope()
        per = (base if base is not None else c1 / batch) * s  # seconds per extra position
        return c1 + per * (positions - batch)
