"""Plain data passed between the scheduler, the models and the caller (no behaviour but arithmetic)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from .sampling import SamplingParams
from .sampling.logprobs import TokenLogprob

__all__ = [
    "SamplingParams",
    "TokenLogprob",
    "DraftToken",
    "Verdict",
    "TokenEvent",
    "FallbackEvent",
    "RoundRecord",
    "Stats",
    "GenerationResult",
    "Mode",
    "FinishReason",
    "KVUsage",
    "ReportsKV",
]

Mode = Literal["spec", "ar"]
FinishReason = Literal["length", "stop", "cancelled", "error"]


@dataclass(frozen=True)
class DraftToken:
    """One drafted token, and the draft distribution it was drawn from.

    A drafter lists a tree's main chain first (each continuing the one before), then the other
    nodes, so a verifier that takes chains only keeps that prefix.

    Attributes:
        id: The token.
        probs: The draft distribution ``q`` ``[V]`` the token was drawn from. ``None`` means a
            deterministic proposal (greedy drafting, n-gram lookup): ``q`` is one-hot at ``id``,
            which keeps rejection sampling exact without building a ``[V]`` row.
        parent: For a *tree* of drafts, the index of the draft this one continues (``-1``: the
            committed tokens; an earlier index otherwise); ``None`` means the previous draft (a
            chain).
    """

    id: int
    probs: np.ndarray | None = None
    parent: int | None = None

    def q_row(self, vocab_size: int) -> np.ndarray:
        """The draft distribution as a dense row ``[V]``."""
        if self.probs is not None:
            return self.probs
        row = np.zeros(vocab_size)
        row[self.id] = 1.0
        return row


@dataclass(frozen=True)
class Verdict:
    """What one verification emitted.

    Attributes:
        tokens: ``[accepted + 1]``: ``tokens[:accepted]`` are accepted drafts, ``tokens[-1]`` is
            the target's recovered (after a rejection) or bonus (after full acceptance) token.
        accepted: How many drafts were accepted.
        path: For a tree, the indices of the accepted drafts (a path from the committed tokens);
            ``None``: the first ``accepted`` drafts.
        logprobs: When the request asked for them (``ctx.logprobs``): one per token, the
            target's log-probability of it (:mod:`specdec_rt.sampling.logprobs`).
    """

    tokens: np.ndarray  # [accepted + 1] int64
    accepted: int
    path: tuple[int, ...] | None = None
    #: when the request asked for them (``ctx.logprobs``): one per token, the target's
    #: log-probability of it (:mod:`specdec_rt.sampling.logprobs`)
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class TokenEvent:
    """Tokens that became final in one scheduler round, in order.

    Attributes:
        token_ids: The tokens.
        index: Position of ``token_ids[0]`` among the generated tokens.
        drafted: Drafts proposed this round (0: a plain target step).
        accepted: Drafts accepted this round.
        finished: Why the request ended, on its last event.
        logprobs: One per token id, when the request asked for them.
    """

    token_ids: tuple[int, ...]
    index: int  # position of token_ids[0] among the generated tokens
    drafted: int  # drafts proposed this round (0: a plain target step)
    accepted: int  # drafts accepted this round
    finished: FinishReason | None = None  # set on the last event of a request
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token id, when the request asked for them


@dataclass(frozen=True)
class FallbackEvent:
    """A switch between speculation and plain decoding, at generated-token ``at``."""

    at: int
    to: Mode
    reason: str  # "ewma" | "zero_rounds" | "cost" | "prefill" | "prefill_free_drafts" | "probe_ok"
    ewma: float


@dataclass(frozen=True)
class RoundRecord:
    """One scheduler round, for plots of acceptance over time."""

    drafted: int
    accepted: int
    emitted: int
    ewma: float | None


@dataclass
class Stats:
    """Counters of one request (or summed over many). Reporting lives elsewhere."""

    mode: str = "spec"
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt positions the prefix cache supplied (not computed)
    cache_queries: int = 0  # the target's prefix-cache lookups (one per request that looked; none when seeded, or off)
    new_tokens: int = 0
    rounds: int = 0  # speculative rounds: draft k >= 1, then one verify call
    ar_steps: int = 0  # plain target steps (mode "ar", fallback, or no draft available)
    drafted: int = 0
    accepted: int = 0
    tree_rounds: int = 0  # rounds that verified a draft tree (its main chain counts in drafted)
    tree_nodes: int = 0  # nodes those trees had beyond their main chains
    tree_hits: int = 0  # tree rounds whose accepted path left the main chain
    position_drafted: list[int] = field(default_factory=list)  # [k_max] rounds that drafted position i
    position_accepted: list[int] = field(default_factory=list)  # [k_max] ... and accepted it
    fallbacks: list[FallbackEvent] = field(default_factory=list)
    history: list[RoundRecord] = field(default_factory=list)
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_total: float = 0.0
    time_to_first_token: float | None = None  # seconds from the request's start to its first token
    acceptance_ewma: float | None = None
    finish_reason: FinishReason | None = None

    def observe_round(
        self, drafted: int, accepted: int, emitted: int, *, t_draft: float, t_verify: float, ewma: float | None
    ) -> None:
        """Count one round that proposed ``drafted`` tokens and kept ``accepted`` of them."""
        if drafted:
            self.rounds += 1
            self.drafted += drafted
            self.accepted += accepted
            while len(self.position_drafted) < drafted:
                self.position_drafted.append(0)
                self.position_accepted.append(0)
            # position i was tried if every earlier draft was accepted
            for i in range(min(drafted, accepted + 1)):
                self.position_drafted[i] += 1
                self.position_accepted[i] += int(i < accepted)
        else:
            self.ar_steps += 1
        self.new_tokens += emitted
        self.time_draft += t_draft
        self.time_verify += t_verify
        self.acceptance_ewma = ewma
        self.history.append(RoundRecord(drafted, accepted, emitted, ewma))

    def observe_tree(self, nodes: int, hit: bool) -> None:
        """Count a round's tree: ``nodes`` beyond its main chain (0: a chain), ``hit``: the
        accepted path used one of them."""
        if nodes > 0:
            self.tree_rounds += 1
            self.tree_nodes += nodes
            self.tree_hits += int(hit)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafted tokens (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean accepted drafts per speculative round (0..k; the recovered/bonus token excluded)."""
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_target_call(self) -> float:
        """Generated tokens per target forward pass: 1.0 for plain decoding."""
        calls = self.rounds + self.ar_steps
        return self.new_tokens / calls if calls else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """For draft position i: P(accepted | every earlier draft was accepted)."""
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.time_total if self.time_total > 0 else 0.0

    def merge(self, other: "Stats") -> None:
        """Add another request's counters to these (for totals across requests)."""
        self.prompt_tokens += other.prompt_tokens
        self.cached_prompt_tokens += other.cached_prompt_tokens
        self.cache_queries += other.cache_queries
        self.new_tokens += other.new_tokens
        self.rounds += other.rounds
        self.ar_steps += other.ar_steps
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.tree_rounds += other.tree_rounds
        self.tree_nodes += other.tree_nodes
        self.tree_hits += other.tree_hits
        self.time_draft += other.time_draft
        self.time_verify += other.time_verify
        self.time_total += other.time_total
        for mine, theirs in (
            (self.position_drafted, other.position_drafted),
            (self.position_accepted, other.position_accepted),
        ):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v
        self.fallbacks.extend(other.fallbacks)
        self.acceptance_ewma = other.acceptance_ewma

    def to_dict(self, history: bool = False) -> dict[str, Any]:
        """JSON-ready summary (derived rates included; per-round history only if asked)."""
        d = asdict(self)
        if not history:
            d.pop("history")
        d.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted=self.mean_accepted,
            tokens_per_target_call=self.tokens_per_target_call,
            per_position_acceptance=self.per_position_acceptance,
            tokens_per_s=self.tokens_per_s,
        )
        return d


@dataclass
class GenerationResult:
    """A finished request (what ``SpecDecScheduler.run`` returns).

    Attributes:
        token_ids: The generated ids (prompt excluded).
        stats: The request's counters.
    """

    token_ids: list[int]
    stats: Stats

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.stats.finish_reason


@dataclass(frozen=True, kw_only=True)
class KVUsage:
    """A KV pool's figures at one moment: ``position_bytes`` (one position, every layer's K and
    V), ``reserved_bytes`` (the pool's buffers, every slot at ``max_len + 1`` positions, prefix-cache
    slots included) and ``positions`` (the positions the open sessions hold, summed over slots)."""

    position_bytes: int
    reserved_bytes: int
    positions: int
    #: bytes of the buffers in memory now (committed pages), when asked for; None: not measured
    resident_bytes: int | None = None

    @property
    def used_bytes(self) -> int:
        """KV bytes the open sessions hold: ``positions * position_bytes``."""
        return self.positions * self.position_bytes


@runtime_checkable
class ReportsKV(Protocol):
    """A model that reports its KV pool's figures (:class:`~specdec_rt.ort.model.OrtModel` does)."""

    name: str

    def kv_usage(self, resident: bool = False) -> KVUsage | None:
        """The pool's figures now (None once closed); ``resident``: with its committed pages."""
        ...
