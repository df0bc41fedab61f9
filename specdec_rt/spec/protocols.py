"""The interfaces the scheduler talks to (a port of the Go design's ``DraftInferrer`` /
``TargetVerifier``), and the per-request model state underneath them.

Two levels:

* **Speculation level** (what ``SpecDecScheduler`` calls): a :class:`DraftInferrer` proposes k
  tokens for a request, a :class:`TargetVerifier` checks them in one target call and says what to
  emit. Both read the request's committed tokens (the *whole* context) from the
  :class:`~specdec_rt.spec.context.RequestContext` and keep their per-request state in it, so one
  drafter/verifier instance serves many concurrent requests.
* **Model level** (what a backend implements): a :class:`LanguageModel` starts one
  :class:`CacheSession` per request, a KV cache with ``extend`` / ``rollback`` / ``close``.
  :class:`~specdec_rt.spec.adapters.ModelDrafter` and :class:`~specdec_rt.spec.adapters.ModelVerifier` turn
  any ``LanguageModel`` into a drafter or a verifier; a backend never implements speculation.

All methods that run a model are ``async``: backends run model calls off the event loop.
Cancellation: a cancelled ``generate_draft`` / ``verify_and_accept`` / ``extend`` leaves the
committed tokens untouched; a session's cache may then hold extra positions, which the next call
rolls back (that is why sessions sync against the committed tokens on every call).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

import numpy as np

from ..types import DraftToken, Verdict

if TYPE_CHECKING:
    from .context import RequestContext

__all__ = ["DraftInferrer", "TargetVerifier", "LanguageModel", "CacheSession"]


@runtime_checkable
class DraftInferrer(Protocol):
    """Proposes draft tokens (Go: ``GenerateDraft(ctx, k) []DraftToken``).

    Optional attribute ``max_length`` (int): the longest sequence it can hold.
    """

    async def generate_draft(self, ctx: "RequestContext", k: int) -> Sequence[DraftToken]:
        """Up to ``k`` tokens that continue ``ctx.tokens``; fewer (even none) is allowed."""
        ...

    def release(self, ctx: "RequestContext") -> None:
        """Free this request's state (called once when the request ends, however it ends)."""


@runtime_checkable
class TargetVerifier(Protocol):
    """Checks drafts with the target in one call (Go: ``VerifyAndAccept(ctx, drafts)``).

    Optional attribute ``max_length`` (int): the longest sequence it can hold. Optional attribute
    ``reports_logprobs = True``: when ``ctx.logprobs`` is not None, its verdicts carry one
    :class:`~specdec_rt.sampling.logprobs.TokenLogprob` a token (requests asking for them need it).
    """

    async def verify_and_accept(self, ctx: "RequestContext", drafts: Sequence[DraftToken]) -> Verdict:
        """Score ``ctx.tokens + drafts`` and return the accepted prefix plus one target token.

        With no drafts this is one plain decoding step (a verdict of one token).
        """
        ...

    def release(self, ctx: "RequestContext") -> None:
        """Free this request's state (called once when the request ends, however it ends)."""


@runtime_checkable
class CacheSession(Protocol):
    """One request's model state: the KV entries of the first ``length`` tokens fed to it."""

    @property
    def length(self) -> int:
        """Number of tokens whose keys/values the cache holds."""
        ...

    async def extend(self, ids: np.ndarray, logits_rows: int) -> np.ndarray:
        """Append ``ids`` ``[S]`` (prefill is the first extend) and return the logits of the last
        ``logits_rows`` of them, ``[logits_rows, V]``. Never copies the cached entries."""
        ...

    def rollback(self, length: int) -> None:
        """Forget every position from ``length`` on. O(1): the next extend overwrites them."""
        ...

    def close(self) -> None:
        """Give the cache back. Idempotent."""
        ...


@runtime_checkable
class LanguageModel(Protocol):
    """A causal LM with a KV cache: ``vocab_size``, ``max_length`` and ``start()``."""

    vocab_size: int
    max_length: int

    def start(self) -> CacheSession:
        """A fresh, empty cache session for one request."""
        ...
