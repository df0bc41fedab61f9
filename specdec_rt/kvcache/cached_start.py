"""The session side of a prefix-cache hit (:mod:`specdec_rt.kvcache.prefix`), shared by the
backends' sessions (ONNX Runtime's and the toy models')."""

from __future__ import annotations

import numpy as np

from .prefix import Hit, PrefixCache, Source

__all__ = ["CachedStart"]


class CachedStart:
    """Session-side state of a prefix-cache hit, shared by the backends' sessions.

    A session that starts from a hit has ``length = hit.length`` at once; a hit on a running
    source is copied at its first call (:meth:`_settle`, in the worker thread), which may feed
    the positions the source had not computed yet. ``slot``, ``_length`` and the cache come from
    the session class.
    """

    slot: int
    _length: int

    def _start_from(self, hit: Hit | None, tokens: np.ndarray | None) -> int:
        self._deferred = hit if hit is not None and hit.owner is not None else None
        self._start = tokens.size if tokens is not None else 0
        self.cache_queried = tokens is not None  #: the cache was looked up (a model passes tokens only when it caches)
        self.cached_tokens = hit.length if hit is not None and self._deferred is None else 0  #: not computed
        return hit.length if hit is not None else 0

    @property
    def settled(self) -> bool:
        """False until a deferred copy is done (the first call may then feed more positions)."""
        return self._deferred is None

    @property
    def waits_for(self) -> Source | None:
        """The running session whose prompt this one will copy, while it has not computed it."""
        hit = self._deferred
        if hit is None or hit.owner is None or hit.owner.stable_length() >= hit.length:
            return None
        return hit.owner

    def stable_length(self) -> int:
        """Positions whose KV is final (committed tokens its owner never rolls back), as a
        source for others. The last token committed at start may be re-fed: it does not count."""
        return 0 if self._deferred is not None else min(self._length, self._start - 1)

    def kept_length(self) -> int:
        """Positions worth keeping when the session ends (none if a deferred copy never came)."""
        return 0 if self._deferred is not None else self._length

    def _settle(self, cache: PrefixCache, ids: np.ndarray, past: int, known: np.ndarray) -> tuple[np.ndarray, int]:
        """Before the first call: copy a deferred hit; ``(ids, past)`` to feed instead (the
        positions not copied are fed from ``known``, the ids the session was started with)."""
        if self._deferred is None:
            return ids, past
        got = cache.settle(self._deferred, self.slot)
        self._deferred, self.cached_tokens = None, got
        return np.concatenate([known[got:past], ids]), got
