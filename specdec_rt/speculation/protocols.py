"""The interfaces the scheduler talks to (``DraftInferrer`` / ``TargetVerifier``), and the per-request model state underneath them.

Two levels:

* **Speculation level** (what ``SpecDecScheduler`` calls): a :class:`DraftInferrer` proposes k
  tokens for a request, a :class:`TargetVerifier` checks them in one target call and says what to
  emit. Both read the request's committed tokens (the *whole* context) from the
  :class:`~specdec_rt.speculation.context.RequestContext` and keep their per-request state in it, so one
  drafter/verifier instance serves many concurrent requests.
* **Model level** (what a backend implements): a :class:`LanguageModel` starts one
  :class:`CacheSession` per request, a KV cache with ``extend`` / ``rollback`` / ``close``.
  :class:`~specdec_rt.speculation.adapters.ModelDrafter` and :class:`~specdec_rt.speculation.adapters.ModelVerifier` turn
  any ``LanguageModel`` into a drafter or a verifier; a backend never implements speculation.

What each side may rely on is declared here, never probed: a backend states what its model can do
in a frozen :class:`ModelCaps` (``model.caps``), and the optional members of every Protocol have
do-nothing defaults, so a class that subclasses the Protocol and overrides nothing is a plain
model (one request's calls one at a time, no prefix cache, no trees). A third backend plugs in by
implementing these Protocols alone (:class:`specdec_rt.testing.ToyLM` is one, run through
:class:`~specdec_rt.engine.engine.Engine` in tests/engine/test_toy_backend.py).

All methods that run a model are ``async``: backends run model calls off the event loop.
Cancellation: a cancelled ``generate_draft`` / ``verify_and_accept`` / ``extend`` leaves the
committed tokens untouched; a session's cache may then hold extra positions, which the next call
rolls back (that is why sessions sync against the committed tokens on every call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Sequence, runtime_checkable

import numpy as np

from ..checks import brief_repr
from ..errors import InvalidInputError
from ..kvcache.prefix import PrefixCache
from ..types import DraftToken, Verdict

if TYPE_CHECKING:
    from .context import RequestContext

__all__ = [
    "DraftInferrer",
    "TargetVerifier",
    "LanguageModel",
    "CacheSession",
    "ModelCaps",
    "BatchCosts",
    "check_implements",
]


@dataclass(frozen=True)
class ModelCaps:
    """What a :class:`LanguageModel` can do, declared once by its backend (``model.caps``).

    The adapters and the batched step loop (:mod:`specdec_rt.batching`) read these flags and
    nothing else; the defaults describe a plain model. A flag set promises the matching methods
    of :class:`specdec_rt.batching.executor.BatchedModel`.
    """

    batched_steps: bool = False  # run_batch_sync: one single-token step for many sessions, one call
    ragged: bool = False  # run_rows_sync: several new positions per session in one call (packed rows)
    batched_prefill: bool = False  # can_prefill_together / run_prefill_batch_sync: first prompts together
    caches_prefixes: bool = False  # start(prefix) resumes from the longest cached prefix of it
    trees: bool = False  # extend(..., tree=parents): a draft tree verified in one call (accept_tree after)
    hidden_states: bool = False  # extend(..., hidden=True) also returns the last hidden states [S, H]


@runtime_checkable
class DraftInferrer(Protocol):
    """Proposes draft tokens for a request.

    The declared attributes' defaults hold for a drafter that sets nothing.

    Attributes:
        max_length: The longest sequence it can hold (``None``: no limit).
        cheap_drafts: It can propose drafts that cost nothing (n-gram matches) when
            ``ctx.plan.cheap_drafts`` asks for them only.
        needs_target_hidden: It reads the target's hidden states (EAGLE), so the verifier must
            share them.
    """

    max_length: int | None = None
    cheap_drafts: bool = False
    needs_target_hidden: bool = False

    async def generate_draft(self, ctx: "RequestContext", k: int) -> Sequence[DraftToken]:
        """Up to ``k`` tokens that continue ``ctx.tokens``; fewer (even none) is allowed.

        Args:
            ctx: The request: its committed tokens, its per-model state, and ``ctx.plan``
                (:class:`~specdec_rt.speculation.context.DraftPlan`): what this round asks beyond
                ``k`` (tree nodes, where to stop a chain, cheap drafts only).
            k: The most tokens the main chain may have.

        Returns:
            The drafts, each a :class:`~specdec_rt.types.DraftToken` with the distribution it was
            drawn from (a tree's nodes name their parents).
        """
        ...

    def release(self, ctx: "RequestContext") -> None:
        """Free this request's state (called once when the request ends, however it ends).

        Args:
            ctx: The request that ended.
        """

    def cached_prefix(self, tokens: np.ndarray) -> int:
        """How many of ``tokens`` its caches already hold (its prefill costs only the rest).

        Args:
            tokens: A request's committed tokens ``[T]``.

        Returns:
            The length of the prefix held.
        """
        return 0


@runtime_checkable
class TargetVerifier(Protocol):
    """Checks a request's drafts with the target in one call.

    Attributes:
        max_length: The longest sequence it can hold (``None``: no limit).
        vocab_size: The logits' width (``None``: not checked).
        reports_logprobs: When ``ctx.logprobs`` is not None, its verdicts carry one
            :class:`~specdec_rt.sampling.logprobs.TokenLogprob` a token (requests that ask for
            them need it).
        trees: It verifies a draft tree (drafts with parents) in one call.
        batched_verify: Verifies of concurrent requests share one batched call (so a verify
            costs a batch its real positions only).
    """

    max_length: int | None = None
    vocab_size: int | None = None
    reports_logprobs: bool = False

    @property
    def trees(self) -> bool:
        """It verifies a draft tree in one call (read-only: a class attribute or a property)."""
        return False

    @property
    def batched_verify(self) -> bool:
        """Its verifies share one batched call with other requests' (read-only, likewise)."""
        return False

    async def verify_and_accept(self, ctx: "RequestContext", drafts: Sequence[DraftToken]) -> Verdict:
        """Score ``ctx.tokens + drafts`` and return the accepted prefix plus one target token.

        With no drafts this is one plain decoding step (a verdict of one token).

        Args:
            ctx: The request: its committed tokens, sampling parameters and per-model state.
            drafts: The drafter's proposals (a chain, or a tree when :attr:`trees`).

        Returns:
            The verdict: the tokens to commit (the accepted drafts, then the target's token),
            how many drafts were accepted, and the log-probabilities when the request asks.
        """
        ...

    def release(self, ctx: "RequestContext") -> None:
        """Free this request's state (called once when the request ends, however it ends).

        Args:
            ctx: The request that ended.
        """


@runtime_checkable
class CacheSession(Protocol):
    """One request's model state: the KV entries of the first ``length`` tokens fed to it.

    Attributes:
        cached_tokens: The prompt positions a prefix cache supplied at start (reported in
            stats).
        cache_queried: Whether a cache was asked at all (reported in stats).
        copy_pending: Its start copies a prompt another session has not computed yet (such a
            session takes no tree call until it has).
    """

    cached_tokens: int = 0
    cache_queried: bool = False

    @property
    def copy_pending(self) -> bool:
        """Its start copies a prompt another session has not computed yet (read-only)."""
        return False

    @property
    def length(self) -> int:
        """Number of tokens whose keys/values the cache holds."""
        ...

    async def extend(self, ids: np.ndarray, logits_rows: int, *args: Any, **extra: Any) -> np.ndarray:
        """Append ``ids`` (prefill is the first extend) and return the logits of the last
        ``logits_rows`` of them. Never copies the cached entries.

        (``*args: Any, **extra: Any`` leave the rest of the signature to each backend, as its
        caps say: a plain model's ``extend(ids, logits_rows)`` implements it.)

        Args:
            ids: The tokens to feed ``[S]``.
            logits_rows: How many of the last positions' logits to return.
            *args: Nothing the scheduler passes; a backend's own.
            **extra: Only what the model's caps allow: ``hidden=True`` (``hidden_states``),
                ``tree=parents`` (``trees``).

        Returns:
            The logits ``[logits_rows, V]``; with ``hidden=True``, ``(logits, hidden [S, H])``.
        """
        ...

    def rollback(self, length: int) -> None:
        """Forget every position from ``length`` on. O(1): the next extend overwrites them.

        Args:
            length: The positions to keep.
        """
        ...

    def close(self) -> None:
        """Give the cache back. Idempotent."""
        ...

    def accept_tree(self, start: int, keep: np.ndarray) -> None:
        """After a tree call from ``start`` (models with ``caps.trees``): keep positions
        ``start + keep``, moved to ``start ..``.

        Args:
            start: The first position the tree call fed.
            keep: The accepted path's offsets from ``start`` ``[n]``.

        Raises:
            NotImplementedError: The default: a model without ``caps.trees``.
        """
        name = type(self).__name__  # (more than a bare raise: a default, not an abstract method, to type checkers)
        raise NotImplementedError(f"{name} verifies no trees (its model's caps.trees is False)")

    def hidden_rows(self, size: int) -> np.ndarray | None:
        """Where this request's target hidden states live, if the backend keeps them per slot
        (so a prefix-cache hit keeps them too).

        Args:
            size: The hidden width.

        Returns:
            The rows ``[max_length, size]``, or ``None`` (the default): anywhere.
        """
        return None


@runtime_checkable
class LanguageModel(Protocol):
    """A causal LM with a KV cache: ``vocab_size``, ``max_length``, ``caps`` and ``start()``.

    Attributes:
        vocab_size: The logits' width.
        max_length: The longest sequence a session can hold.
        caps: What it can do (:class:`ModelCaps`; default: a plain model).
        prefix_cache: The :class:`~specdec_rt.kvcache.prefix.PrefixCache` of a model with
            ``caps.caches_prefixes`` (an Engine reports its counts and turns it off while
            warming up).
    """

    vocab_size: int
    max_length: int
    caps: ModelCaps = ModelCaps()
    prefix_cache: PrefixCache | None = None  # with caps.caches_prefixes: its bookkeeping (stats, budget)

    def start(self, prefix: np.ndarray | None = None, *, batch_invariant: bool = False) -> CacheSession:
        """A fresh cache session for one request.

        Args:
            prefix: Its committed tokens ``[T]``, for a model with ``caps.caches_prefixes`` (the
                session then starts with ``length`` of them cached; any other model ignores it
                and starts empty).
            batch_invariant: This session's logits must not depend on which other sessions
                share its calls, nor on how many positions a call feeds (a seeded sampled
                request); a backend whose kernels round differently by call shape keeps such a
                session on one path.

        Returns:
            The session.
        """
        ...

    def cached_prefix(self, tokens: np.ndarray) -> int:
        """How many of ``tokens`` its prefix cache holds now (0 without one); changes nothing.

        Args:
            tokens: A request's tokens ``[T]``.

        Returns:
            The length of the cached prefix.
        """
        return 0

    def close(self) -> None:
        """Release what it holds (sessions still open fail their next call). Idempotent."""
        return None  # a default (a body of a docstring alone is abstract to type checkers)


class BatchCosts(Protocol):
    """The measured costs of the batch a request runs in, as the scheduler's cost model reads
    them (an Engine's step loop provides them; a scheduler without one measures nothing).

    Seconds are the least of recent measurements, ``None`` where that shape was never measured.
    """

    def target_step(self, rows: int, positions: int | None = None) -> float | None:
        """A batched target call of ``rows`` requests feeding ``positions`` positions in all
        (default: one each)."""
        ...

    def draft_step(self, rows: int) -> float | None:
        """A batched draft-model step of ``rows`` requests (``None``: no draft model)."""
        return None

    def target_shapes(self, rows: int) -> Sequence[int]:
        """The ``positions`` measured for target calls of ``rows`` requests, sorted."""
        return ()

    def admitted(self) -> int:
        """Requests admitted to run now: about to share the batch, even if not yet in it."""
        return 0


def check_implements(obj: object, protocol: type, role: str) -> None:
    """``obj`` has every member ``protocol`` declares (its optional ones come with subclassing),
    else an :class:`~specdec_rt.errors.InvalidInputError` naming ``role`` and the first missing."""
    if isinstance(obj, protocol):
        return
    declared = {name for name in vars(protocol) if not name.startswith("_")} | set(protocol.__annotations__)
    members = [m for m in declared if not hasattr(obj, m)]
    raise InvalidInputError(
        f"the {role} {brief_repr(obj)} does not implement {protocol.__name__}: it lacks "
        f"{', '.join(sorted(members)) or 'a member'} (subclass {protocol.__name__}: its "
        "optional members have defaults)"
    )
