"""Every threshold of adaptive speculation in one frozen dataclass (the rules that read them:
:mod:`specdec_rt.policy.acceptance` and :mod:`specdec_rt.policy.request`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..checks import is_int
from ..errors import InvalidInputError

__all__ = ["SpecConfig"]


@dataclass(frozen=True)
class SpecConfig:
    """Every threshold of adaptive speculation, each with a default and all configurable.

    Attributes:
        alpha: EWMA weight of the newest round.
        initial_acceptance: The acceptance EWMA before anything was observed.
        k_init: Draft length when ``adapt_k`` is off.
        k_min: The shortest draft length ``adapt_k`` chooses.
        k_max: The longest.
        adapt_k: Choose each round's draft length from the acceptance and the measured costs.
        fallback_below: Plain decoding when the acceptance EWMA falls below this.
        zero_rounds: Plain decoding after this many rounds in a row accepted nothing.
        min_speedup: Plain decoding when no draft length is predicted to gain this much.
        resume_above: A probe resumes speculation only at an acceptance of at least this (>=
            ``fallback_below``: hysteresis).
        resume_speedup: The predicted gain a probe needs to resume speculation; in a batch,
            plain batched steps are left only for this clear a gain.
        probe_every: Plain steps between probes of speculation after a fallback.
        probe_backoff: A probe that does not resume multiplies the wait by this.
        probe_max_every: The longest wait between probes.
        draft_cost: Default cost of a draft token, in target steps, until measured.
        verify_cost_per_token: Default extra cost per verified position, likewise.
        measure_costs: False: always use the two defaults above (toy models, tests).
        tree_nodes: Drafts beyond the main chain a request alone may add (a draft tree, 0..16).
        confidence_stop: A request alone stops a model chain where the draft is unsure.
        defer_draft_prefill: The first round verifies free drafts only (n-gram matches, or
            none): a request's first token never waits for the draft model's prefill, which its
            next round does.

    Raises:
        InvalidInputError: A value out of range or an inconsistent pair, naming the field.
    """

    alpha: float = 0.1  # EWMA weight of the newest round
    initial_acceptance: float = 0.7  # EWMA before anything was observed
    k_init: int = 4  # draft length when adapt_k is off
    k_min: int = 1
    k_max: int = 8
    adapt_k: bool = True
    fallback_below: float = 0.4
    zero_rounds: int = 3
    min_speedup: float = 1.0
    resume_above: float = 0.6
    resume_speedup: float = 1.1
    probe_every: int = 16
    probe_backoff: float = 2.0
    probe_max_every: int = 256
    draft_cost: float = 0.1  # default cost of a draft token, in target steps, until measured
    verify_cost_per_token: float = 0.05  # default extra cost per verified position, likewise
    measure_costs: bool = True  # False: always use the two defaults above (toy models, tests)
    tree_nodes: int = 0  # drafts beyond the main chain a request alone may add (a draft tree)
    confidence_stop: bool = False  # a request alone stops a model chain where the draft is unsure
    # the first round verifies free drafts only (n-gram matches, or none): a request's first token
    # never waits for the draft model's prefill, which its next round does (RequestPolicy)
    defer_draft_prefill: bool = True

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> None:
            raise InvalidInputError(f"SpecConfig.{name}={asdict(self)[name]!r}: {why}")

        if not 0 < self.alpha <= 1:
            bad("alpha", "must be in (0, 1]")
        for name, value in (
            ("initial_acceptance", self.initial_acceptance),
            ("fallback_below", self.fallback_below),
            ("resume_above", self.resume_above),
        ):
            if not 0 <= value <= 1:
                bad(name, "must be in [0, 1]")
        if not 1 <= self.k_min <= self.k_init <= self.k_max:
            bad("k_init", f"need 1 <= k_min ({self.k_min}) <= k_init <= k_max ({self.k_max})")
        if self.resume_above < self.fallback_below:
            bad("resume_above", f"must be >= fallback_below ({self.fallback_below}) for hysteresis")
        if self.zero_rounds < 1 or self.probe_every < 1 or self.probe_max_every < self.probe_every:
            bad("probe_every", "need zero_rounds >= 1, 1 <= probe_every <= probe_max_every")
        if self.probe_backoff < 1:
            bad("probe_backoff", "must be >= 1")
        if not is_int(self.tree_nodes, numpy=False) or not 0 <= self.tree_nodes <= 16:
            bad("tree_nodes", "must be an integer in 0..16")
        if not isinstance(self.confidence_stop, bool):
            bad("confidence_stop", "must be True or False")
        if not isinstance(self.defer_draft_prefill, bool):
            bad("defer_draft_prefill", "must be True or False")
        if self.draft_cost < 0 or self.verify_cost_per_token < 0:
            bad("draft_cost", "costs must be >= 0")
