"""A prefix cache in front of a KV pool: never prefill the same tokens twice.

The pool has ``running + entries`` slots. Slots ``0 .. running-1`` hold the requests that run (a
batched call covers a contiguous range of them, so they stay packed low); the slots above hold
*entries*: the sequences finished requests left behind (prompt and generated tokens).

* **release**: a finished request's KV (``ids``, the tokens whose keys/values its slot holds) is
  copied into an entry slot. An entry that is a prefix of it (the previous turn of the same
  conversation) is extended in place: only the new positions are copied. Entries are evicted
  least recently used first to stay within ``budget_bytes`` and the number of entry slots; a
  running request's slot is never an entry, so nothing running is evicted.
* **acquire(tokens)**: the longest prefix of ``tokens`` that an entry holds, or that a running
  request's prompt holds (positions its owner committed never change), is copied into the new
  request's slot; only the rest of the prompt is fed. The KV of a position depends only on the
  tokens up to it, so the output is unchanged.

Index: a block of ``block`` tokens is keyed by a hash of *all* tokens up to its end (chained), so
equal keys mean equal prefixes; a hit is then checked and extended token by token (a hash
collision costs a comparison, never a wrong answer).

Threads: bookkeeping runs on the event loop; data moves (``copy``, ``discard``) run in the
model's worker thread. They are queued here and :meth:`PrefixCache.apply` runs them, in order, at
the start of every model call, so a copy reads its source before anything queued later writes
it. A copy from a running request is deferred to the new request's first call
(:meth:`PrefixCache.settle`): it takes what the source has computed by then (a source still
prefilling has less) and the caller feeds the rest. The batch executor lets such a call wait
while its source still has a call in the same step (``waits_for``), so requests that arrive
together with one long shared prompt prefill it once.
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from ..checks import check_int
from ..errors import InferenceError

__all__ = ["PrefixCache", "Hit", "common_prefix", "DEFAULT_BLOCK", "DEFAULT_BUDGET_BYTES"]

DEFAULT_BLOCK = 16  # tokens per indexed block
DEFAULT_BUDGET_BYTES = 1 << 30  # KV bytes all entries of an engine may hold (all its models)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two id arrays."""
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def block_keys(ids: np.ndarray, block: int, n: int) -> list[int]:
    """Keys of the full blocks of ``ids[:n]``: key i hashes every token of blocks 0..i."""
    keys, h = [], 0
    for end in range(block, n + 1, block):
        h = hash((h, ids[end - block : end].tobytes()))
        keys.append(h)
    return keys


class Source(Protocol):
    """A session whose committed prompt may serve others (:class:`~specdec_rt.kvcache.cached_start.CachedStart`)."""

    def stable_length(self) -> int:
        """Positions whose KV is final: committed tokens its owner never rolls back."""
        ...


@dataclass(eq=False)
class Hit:
    """A new session's first ``length`` tokens are cached in ``slot``: its own slot (a residue,
    taken in place), an entry (copy queued), or a running session ``owner`` (copy deferred)."""

    slot: int
    length: int
    owner: Source | None = None


@dataclass(eq=False)
class _Entry:
    ids: np.ndarray  # [n] the tokens whose KV the slot holds
    keys: list[int] = field(default_factory=list)
    used: int = 0  # LRU clock
    ready: bool = True  # an entry being stashed is not a source until its copy is done
    owner: Source | None = None  # a residue: the session that left it


@dataclass(eq=False)
class _Live:
    session: Source
    tokens: np.ndarray  # [n] committed tokens when it started
    keys: list[int] = field(default_factory=list)


class _Stash:
    """Copying a residue into an entry slot, one part (a layer) at a time, in the worker thread,
    so that a model call waits for one part at most."""

    def __init__(self, parts: list[Callable[[], None]], entry: _Entry) -> None:
        self.parts, self.entry, self.cancelled = collections.deque(parts), entry, False

    def step(self) -> bool:
        """Copy one part; False once done (or cancelled)."""
        if self.cancelled or not self.parts:
            return False
        self.parts.popleft()()
        if not self.parts:
            self.entry.ready = True
        return bool(self.parts)

    def finish(self) -> None:
        while self.step():
            pass


class PrefixCache:
    """Slot bookkeeping of one model's KV pool, with a prefix cache (``enabled``) or without.

    ``copy(src, dst, start, stop)`` moves the data of positions ``start .. stop-1``;
    ``copy_parts(...)`` (optional) returns the same move as a list of smaller callables;
    ``discard(slot, start, stop)`` frees memory. All run in the worker thread. ``token_bytes``
    is the memory one cached position takes; ``budget_bytes`` bounds what entries hold.
    """

    def __init__(
        self,
        running: int,
        entries: int = 0,
        *,
        block: int = DEFAULT_BLOCK,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        token_bytes: int = 1,
        copy: Callable[[int, int, int, int], None] | None = None,
        copy_parts: Callable[[int, int, int, int], list[Callable[[], None]]] | None = None,
        discard: Callable[[int, int, int], None] | None = None,
    ) -> None:
        check_int(block, "prefix cache block size", 1, numpy=False)
        check_int(budget_bytes, "prefix_cache_bytes", 0, numpy=False)
        self.running, self.block = running, block
        self.enabled = entries > 0 and budget_bytes >= block * token_bytes and copy is not None
        self.budget_bytes, self.token_bytes = budget_bytes, token_bytes
        # a disabled cache never copies (no hits, no entries): nothing calls _copy then
        self._copy: Callable[[int, int, int, int], None] = copy if copy is not None else _copies_nothing
        self._discard = discard
        self._copy_parts = copy_parts or (lambda *a: [lambda: self._copy(*a)])
        self._free = list(range(running))  # running slots nobody holds
        self._spare = list(range(running, running + entries)) if self.enabled else []  # empty entry slots
        self._entries: dict[int, _Entry] = {}  # entry slot -> what it holds
        self._residue: dict[int, _Entry] = {}  # free running slot -> what its last owner left in it
        self._stashes: dict[int, _Stash] = {}  # free running slot -> its copy into an entry, under way
        self._live: dict[int, _Live] = {}  # running slot -> its session, a possible source
        self._index: dict[int, set[int]] = {}  # block key -> slots (entries, residues, live) holding it
        self._ops: collections.deque[Callable[[], None]] = (
            collections.deque()
        )  # data moves for the worker thread, in order
        self._applying = False  # apply() is running them (see apply)
        self._pinned: int | None = None  # an entry a hit is about to copy: not evicted meanwhile
        self._clock = 0
        self.queries = 0  # lookups made (requests that could have hit)
        self.hit_tokens = 0  # tokens taken or copied instead of computed
        self.evictions = 0

    # ------------------------------------------------------------------ event-loop side
    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def cached_tokens(self) -> int:
        return sum(e.ids.size for e in self._entries.values())

    @property
    def bytes(self) -> int:
        """KV memory the entries hold now (at most ``budget_bytes``)."""
        return self.cached_tokens * self.token_bytes

    @property
    def _budget_tokens(self) -> int:
        return self.budget_bytes // max(1, self.token_bytes)

    def entries(self) -> list[np.ndarray]:
        """The cached sequences, least recently used first (for tests and reports)."""
        return [e.ids for e in sorted(self._entries.values(), key=lambda e: e.used)]

    def acquire(self, tokens: np.ndarray | None = None) -> tuple[int, Hit | None]:
        """A running slot for a new session, and what of ``tokens`` (the committed tokens when
        it starts; all but the last may be cached) is cached for it."""
        if not self._free:
            raise InferenceError(f"all {self.running} KV cache slots are in use (raise slots=)")
        hit = None
        if tokens is not None and self.enabled:
            self.queries += 1
            hit = self._lookup(np.asarray(tokens, dtype=np.int64))
        if hit is not None and hit.slot in self._residue:  # its own last slot: take it in place
            slot = hit.slot
            stash = self._stashes.pop(slot, None)
            if stash is not None and not stash.entry.ready:  # nobody can read the half-made entry
                stash.cancelled = True
                dst = next((s for s, e in self._entries.items() if e is stash.entry), None)
                if dst is not None:
                    self._evict(dst)
        else:  # lowest first (batches stay packed), but not one whose residue is still to copy

            def done(free: int) -> bool:
                return free not in self._residue or (free in self._stashes and self._stashes[free].entry.ready)

            slot = min(self._free, key=lambda s: (not done(s), s))
            # what it held is copied out before the new session writes; that copy may need an
            # entry slot, but never the hit's own (its copy into this slot comes after)
            self._pinned = hit.slot if hit is not None else None
            try:
                self._stash_now(slot)
            finally:
                self._pinned = None
        self._free.remove(slot)
        self._drop_residue(slot)
        if hit is not None:
            self.hit_tokens += hit.length if hit.owner is None else 0
            if hit.slot in self._entries:
                self._ops.append(functools.partial(self._copy, hit.slot, slot, 0, hit.length))
                self._entries[hit.slot].used = self._tick()
        return slot, hit

    def kept(self, slot: int) -> int:
        """Positions a free running slot keeps for the cache (its last owner's KV); 0 if none."""
        e = self._residue.get(slot)
        return e.ids.size if e is not None else 0

    def peek(self, tokens: np.ndarray) -> int:
        """How many of ``tokens`` a session started now would find cached (nothing changes)."""
        if not self.enabled:
            return 0
        hit = self._lookup(np.asarray(tokens, dtype=np.int64))
        return hit.length if hit is not None else 0

    def register(self, slot: int, session: Source, tokens: np.ndarray | None) -> None:
        """``session`` now holds ``slot``; its first ``tokens`` (committed) may serve as a source."""
        if not self.enabled or tokens is None or tokens.size <= self.block:
            return
        tokens = np.array(tokens, dtype=np.int64)
        live = _Live(session, tokens, block_keys(tokens, self.block, tokens.size - 1))
        self._live[slot] = live
        self._add_keys(slot, live.keys)

    def release(self, slot: int, ids: np.ndarray) -> None:
        """The session holding ``slot`` ended; the slot holds the KV of ``ids``. They stay there
        (a residue the next turn may take in place) until :meth:`next_stash` or a new owner of
        the slot copies them into an entry."""
        live = self._live.pop(slot, None)
        if live is not None:
            self._drop_keys(slot, live.keys)
        self._free.append(slot)
        n = min(int(ids.size), self._budget_tokens)
        if self.enabled and n >= self.block:
            ids = np.array(ids[:n], dtype=np.int64)
            self._residue[slot] = e = _Entry(
                ids, block_keys(ids, self.block, n), self._tick(), owner=live.session if live is not None else None
            )
            self._add_keys(slot, e.keys)

    def next_stash(self) -> _Stash | None:
        """Start copying the oldest residue not yet copied into an entry (the executor runs its
        parts while no call waits); None when there is none."""
        for slot in sorted((s for s in self._residue if s not in self._stashes), key=lambda s: self._residue[s].used):
            stash = self._start_stash(slot)
            if stash is not None:
                return stash
            self._stashes[slot] = _Stash([], _Entry(np.zeros(0, dtype=np.int64)))  # nothing to copy
        return None

    def clear(self) -> None:
        """Forget every entry (their memory is discarded by the next :meth:`apply`)."""
        for s in list(self._entries):
            if self._entries[s].ready:
                self._evict(s)

    # ------------------------------------------------------------------ worker-thread side
    def apply(self) -> None:
        """Run the queued data moves, in order (in the worker thread, before a model call).

        Not re-entrant: a residue's copy into an entry starts by applying what was queued
        before it (its entry slot may be the source of a pending hit copy); when that copy
        itself runs from this queue, everything queued before it has run, and what was queued
        after it (a hit copied into the slot it reads) must wait until it is done."""
        if self._applying:
            return
        self._applying = True
        try:
            while self._ops:
                self._ops.popleft()()
        finally:
            self._applying = False

    def settle(self, hit: Hit, slot: int) -> int:
        """Copy a deferred hit from its running source into ``slot`` now (worker thread), as far
        as the source has computed it and still holds it; returns the positions copied."""
        live, left = self._live.get(hit.slot), self._residue.get(hit.slot)
        if live is not None and live.session is hit.owner:
            n = max(0, min(hit.length, int(live.session.stable_length())))
        elif left is not None and left.owner is hit.owner:  # the source ended; its slot is untouched
            n = min(hit.length, left.ids.size)
        else:
            return 0  # the source ended and its slot holds another request
        if n > 0:
            self._copy(hit.slot, slot, 0, n)
            self.hit_tokens += n
        return n

    # ------------------------------------------------------------------ internals
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _lookup(self, tokens: np.ndarray) -> Hit | None:
        limit = tokens.size - 1  # the last token is always fed: its logits are needed
        candidates: set[int] = set()
        for key in block_keys(tokens, self.block, limit):
            slots = self._index.get(key)
            if not slots:
                break
            candidates = slots
        best, rank = None, None
        for s in candidates:
            e = self._entries.get(s) or self._residue.get(s)
            if e is not None and not e.ready:
                continue
            held = e.ids if e is not None else self._live[s].tokens[:-1]
            m = min(common_prefix(held, tokens), limit)
            r = (m, s in self._residue, e is not None)  # longest; then no copy; then data ready
            if rank is None or r > rank:
                best, rank = Hit(s, m, None if e is not None else self._live[s].session), r
        return best if best is not None and best.length >= self.block else None

    def _stash_now(self, slot: int) -> None:
        """``slot`` gets a new owner: its residue's copy must be done before the owner writes."""
        stash = self._stashes.pop(slot, None)
        if stash is None and slot in self._residue:
            stash = self._start_stash(slot)
            self._stashes.pop(slot, None)
        if stash is not None:
            self._ops.append(stash.finish)

    def _start_stash(self, slot: int) -> _Stash | None:
        e = self._residue[slot]
        ids, n, keys = e.ids, e.ids.size, e.keys
        for s in self._index.get(keys[-1], ()):  # already held whole: nothing to copy
            held = self._entries.get(s)
            if held is not None and held.ids.size >= n and common_prefix(held.ids, ids) == n:
                held.used = max(held.used, e.used)
                return None
        start, dst = 0, None
        for key in reversed(keys):  # an entry that ids extends (an earlier turn): extend it in place
            for s in self._index.get(key, ()):
                held = self._entries.get(s)
                if (
                    held is not None
                    and held.ready
                    and held.ids.size <= n
                    and common_prefix(held.ids, ids) == held.ids.size
                ):
                    dst, start = s, held.ids.size
                    break
            if dst is not None:
                break
        if dst is not None:
            self._drop_keys(dst, self._entries.pop(dst).keys)
        budget = self._budget_tokens
        while True:
            ready = [s for s, x in self._entries.items() if x.ready and s != self._pinned]
            if not ready or (dst is not None or self._spare) and self.cached_tokens + n <= budget:
                break
            lru = min(ready, key=lambda s: self._entries[s].used)
            if dst is None and not self._spare:  # reuse its slot: only the tail past n is discarded
                self._evict(lru, keep=n)
                dst = self._spare.pop()
            else:
                self._evict(lru)
        if self.cached_tokens + n > budget or dst is None and not self._spare:
            if dst is not None:  # the entry it would have extended or reused is gone: free its slot
                self._spare.append(dst)
                if self._discard is not None:
                    self._ops.append(functools.partial(self._discard, dst, 0, n))
            return None
        if dst is None:
            dst = self._spare.pop(0)
        entry = _Entry(ids, keys, e.used, ready=False)
        self._entries[dst] = entry
        self._add_keys(dst, keys)
        stash = _Stash([self.apply, *self._copy_parts(slot, dst, start, n)], entry)
        self._stashes[slot] = stash
        return stash

    def _drop_residue(self, slot: int) -> None:
        e = self._residue.pop(slot, None)
        if e is not None:
            self._drop_keys(slot, e.keys)

    def _evict(self, s: int, keep: int = 0) -> None:
        e = self._entries.pop(s)
        self._drop_keys(s, e.keys)
        self.evictions += e.ready
        if self._discard is not None and e.ids.size > keep:
            self._ops.append(functools.partial(self._discard, s, keep, e.ids.size))
        self._spare.append(s)

    def _add_keys(self, slot: int, keys: list[int]) -> None:
        for k in keys:
            self._index.setdefault(k, set()).add(slot)

    def _drop_keys(self, slot: int, keys: list[int]) -> None:
        for k in keys:
            held = self._index.get(k)
            if held is not None:
                held.discard(slot)
                if not held:
                    del self._index[k]


def _copies_nothing(src: int, dst: int, start: int, stop: int) -> None:
    raise InferenceError("a prefix cache made without copy() copies nothing")
