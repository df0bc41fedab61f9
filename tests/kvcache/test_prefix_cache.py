"""The prefix cache: bookkeeping (hits, LRU, budget), and exactness on toy models (property test
over random interleavings; the toy checks every call's slot holds exactly its tokens)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec_rt.errors import InvalidInputError
from specdec_rt.kvcache import prefix as pc
from specdec_rt.kvcache.prefix import PrefixCache
from specdec_rt.sampling import SamplingParams
from specdec_rt.testing import toy_scheduler


class Moves:
    """Records the cache's data moves on an ids "pool" (so tests can check what lands where)."""

    def __init__(self, slots: int, length: int = 64) -> None:
        self.store = np.full((slots, length), -1, dtype=np.int64)
        self.log: list[tuple] = []

    def copy(self, src, dst, start, stop):
        self.log.append(("copy", src, dst, start, stop))
        self.store[dst, start:stop] = self.store[src, start:stop]

    def discard(self, slot, start, stop):
        self.log.append(("discard", slot, start, stop))
        self.store[slot, start:stop] = -1


def cache(running=2, entries=2, budget=100, block=4):
    moves = Moves(running + entries)
    c = PrefixCache(
        running, entries, block=block, budget_bytes=budget, token_bytes=1, copy=moves.copy, discard=moves.discard
    )
    return c, moves


def finish(c: PrefixCache, slot: int, ids, moves: Moves) -> None:
    """A request in ``slot`` wrote ``ids`` and ended; its KV is copied out (idle time)."""
    moves.store[slot, : len(ids)] = ids
    c.release(slot, np.array(ids))
    while (stash := c.next_stash()) is not None:
        stash.finish()


def test_the_next_turn_takes_its_own_slot_in_place():
    c, moves = cache()
    conv = list(range(20))
    slot, _ = c.acquire(np.array(conv))
    moves.store[slot, :20] = conv
    c.release(slot, np.array(conv))
    slot2, hit = c.acquire(np.array(conv + [30, 31]))
    assert slot2 == slot and hit.length == 20 and hit.owner is None
    assert not [m for m in moves.log if m[0] == "copy"]  # no copy: the data never left the slot
    assert c.hit_tokens == 20 and c.queries == 2


def test_a_kept_entry_is_copied_into_another_slot_and_the_match_is_exact():
    c, moves = cache()
    a = list(range(16))
    finish(c, c.acquire(np.array(a))[0], a, moves)
    assert [e.tolist() for e in c.entries()] == [a]
    other = [50 + i for i in range(12)]
    s_other, _ = c.acquire(np.array(other))  # takes the free slot without a residue to copy
    s, hit = c.acquire(np.array(a[:10] + [99]))  # shares 10 tokens: 2 whole blocks + 2 tokens
    c.apply()
    assert hit.length == 10 and s != s_other
    assert moves.store[s, :10].tolist() == a[:10]
    assert c.free == 0


def test_no_hit_below_one_block_and_the_last_token_is_always_fed():
    c, moves = cache(block=4)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    finish(c, c.acquire(np.array(a))[0], a, moves)
    assert c.acquire(np.array([1, 2, 3, 9]))[1] is None  # 3 tokens in common: less than a block
    _, hit = c.acquire(np.array(a))
    assert hit.length == len(a) - 1


def test_lru_eviction_keeps_the_recently_used_and_the_budget():
    c, moves = cache(running=1, entries=3, budget=40, block=4)  # room for 2 conversations of 20
    convs = [[100 * k + i for i in range(20)] for k in range(6)]
    for k, conv in enumerate(convs):
        finish(c, c.acquire(np.array(conv))[0], conv, moves)
        if k >= 1:  # touch conversation 0 each time: it stays while the others rotate
            slot, hit = c.acquire(np.array(convs[0] + [7]))
            c.apply()
            assert hit is not None and hit.length == 20
            c.release(slot, np.array([]))
        assert c.bytes <= 40
        assert sum(e.size for e in c.entries()) <= 40
    kept = [e[0] // 100 for e in c.entries()]
    assert 0 in kept and set(kept) <= {0, 5} and c.evictions >= 4
    # an evicted conversation's memory was discarded (its positions read -1 again)
    for k in range(1, 5):
        assert not any((moves.store[s, :20] == convs[k]).all() for s in range(1, 4))


def test_an_entry_extended_by_the_next_turn_copies_only_the_new_positions():
    c, moves = cache(running=1, entries=2)
    turn1 = list(range(12))
    finish(c, c.acquire(np.array(turn1))[0], turn1, moves)
    other = [90 + i for i in range(8)]
    finish(c, c.acquire(np.array(other))[0], other, moves)  # slot 0 now holds `other`
    slot, hit = c.acquire(np.array(turn1 + [40]))
    c.apply()
    turn2 = turn1 + [40, 41, 42, 43]
    moves.log.clear()
    finish(c, slot, turn2, moves)
    copies = [m for m in moves.log if m[0] == "copy"]
    assert copies and all(m[3] == 12 and m[4] == 16 for m in copies)  # positions 12..15 only
    assert sorted(e.tolist() for e in c.entries()) == sorted([turn2, other])


def test_hash_collisions_cost_a_comparison_not_a_wrong_hit(monkeypatch):
    monkeypatch.setattr(pc, "block_keys", lambda ids, block, n: [0] * (n // block))  # every key equal
    c, moves = cache()
    a = list(range(12))
    finish(c, c.acquire(np.array(a))[0], a, moves)
    _, hit = c.acquire(np.array([5] * 12))
    assert hit is None  # same keys, different tokens: no hit
    _, hit = c.acquire(np.array(a[:8] + [77, 78]))
    assert hit.length == 8


def test_bad_settings_are_refused():
    with pytest.raises(InvalidInputError, match="block"):
        PrefixCache(2, 2, block=0)
    with pytest.raises(InvalidInputError, match="prefix_cache_bytes"):
        PrefixCache(2, 2, budget_bytes=-1)
    assert not PrefixCache(2, 0, copy=lambda *a: None).enabled  # no entry slots: no cache
    assert not PrefixCache(2, 2, budget_bytes=3, block=4, copy=lambda *a: None).enabled  # < one block


# ---------------------------------------------------------------------------- exactness on toys
BASES = [list(np.random.default_rng(k).integers(0, 8, 24)) for k in range(3)]

request = st.tuples(
    st.integers(0, len(BASES) - 1),  # shared prefix
    st.integers(0, 24),  # how much of it
    st.lists(st.integers(0, 7), min_size=1, max_size=8),  # own suffix
    st.integers(0, 4),  # arrival delay (event-loop passes x 4)
    st.booleans(),  # greedy or seeded sampling
    st.one_of(st.none(), st.integers(1, 6)),  # cancelled after that many events
)


async def _run(sched, reqs, n_new=10):
    async def one(i, r):
        base, cut, suffix, delay, greedy, cancel_at = r
        for _ in range(delay * 4):
            await asyncio.sleep(0)
        params = SamplingParams(temperature=0.0 if greedy else 1.0, seed=i)
        stream = sched.stream(BASES[base][:cut] + suffix, n_new, params)
        got = []
        try:
            async for ev in stream:
                got.extend(ev.token_ids)
                if cancel_at is not None and len(got) >= cancel_at:
                    break
        finally:
            await stream.aclose()
        return got, cancel_at is not None

    return await asyncio.gather(*[one(i, r) for i, r in enumerate(reqs)])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(request, min_size=1, max_size=10), st.integers(1, 3), st.integers(0, 2))
def test_cached_runs_equal_uncached_runs(reqs, waves, entries):
    """Random interleavings of requests with shared and diverging prefixes, some cancelled, in
    several waves (later waves hit what earlier ones left): every request's output equals the
    same request on a scheduler without a cache, and no call ever found its slot corrupted."""
    cached, target, draft = toy_scheduler(
        0.4,
        batched=True,
        max_length=64,
        slots=10,
        block=4,
        prefix_cache_tokens=200 if entries else 60,
        cache_entries=entries or 1,
    )
    plain, _, _ = toy_scheduler(0.4, batched=True, max_length=64, slots=10)

    async def main():
        for _ in range(waves):
            ours = await _run(cached, reqs)
            want = await _run(plain, reqs)
            for (got, cancelled), (ref, _) in zip(ours, want):
                n = min(len(got), len(ref))  # a cancelled request stops after an event of any size
                assert got[:n] == ref[:n] and (cancelled or got == ref)
        assert target.prefix_cache.free == 10 and draft.prefix_cache.free == 10
        assert target.prefix_cache.bytes <= target.prefix_cache.budget_bytes

    asyncio.run(main())
    # seeded sampled requests compute their prompts themselves (see adapters._ModelUser._session)
    assert target.prefix_cache.queries > 0 or not any(greedy for *_, greedy, _ in reqs)


def test_requests_arriving_together_prefill_their_shared_prompt_once():
    """Cold cache, four requests with one long shared prompt at once: the later ones copy it from
    the first while it runs (their calls wait for its prefill), and outputs are unchanged."""
    shared = list(np.random.default_rng(5).integers(0, 8, 40))
    prompts = [shared + [k, (k + 3) % 8] for k in range(4)]
    cached, target, _ = toy_scheduler(0.4, batched=True, max_length=80, slots=8, block=4, prefix_cache_tokens=400)
    plain, plain_target, _ = toy_scheduler(0.4, batched=True, max_length=80, slots=8)

    async def main():
        got = await asyncio.gather(*[cached.run(p, 6) for p in prompts])
        want = await asyncio.gather(*[plain.run(p, 6) for p in prompts])
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        return [g.stats.cached_prompt_tokens for g in got]

    hits = asyncio.run(main())
    assert sorted(hits)[0] == 0 and all(h >= 36 for h in sorted(hits)[1:])  # one computed it
    assert target.positions < plain_target.positions - 100  # 3 x ~40 positions never fed


def _halves(moves):
    """copy_parts: a copy in two halves (as the ONNX pool copies a layer at a time)."""
    return lambda src, dst, a, b: [
        lambda: moves.copy(src, dst, a, (a + b) // 2),
        lambda: moves.copy(src, dst, (a + b) // 2, b),
    ]


def _half_copied():
    """One running slot, a finished 16-token conversation in it, its copy into an entry half
    done: ``(cache, moves, slot, conversation, copy under way)``."""
    moves = Moves(3)
    c = PrefixCache(1, 2, block=4, budget_bytes=100, copy=moves.copy, copy_parts=_halves(moves), discard=moves.discard)
    conv = list(range(16))
    slot, _ = c.acquire(np.array(conv))
    moves.store[slot, :16] = conv
    c.release(slot, np.array(conv))
    stash = c.next_stash()
    assert stash.step() and stash.step()  # the queued moves, then the first half
    return c, moves, slot, conv, stash


def test_a_copy_under_way_is_dropped_when_the_next_turn_takes_its_slot():
    c, moves, slot, conv, stash = _half_copied()
    slot2, hit = c.acquire(np.array(conv + [20]))  # the next turn, before the second half
    assert slot2 == slot and hit.length == 16
    assert not stash.step() and c.entries() == []  # cancelled; the half-made entry is gone
    c.apply()
    assert (moves.store[1:, :16] == -1).all()  # and its memory discarded


def test_a_new_owner_of_the_slot_waits_for_the_copy_to_finish():
    c, moves, slot, conv, _ = _half_copied()
    other, hit = c.acquire(np.array([50 + i for i in range(8)]))  # the only slot, another prompt
    assert other == slot and hit is None
    c.apply()  # before the new owner's first call: the rest of the copy
    [entry] = c.entries()
    assert entry.tolist() == conv
    dst = 1 if (moves.store[1, :16] == conv).all() else 2
    assert moves.store[dst, :16].tolist() == conv
    assert c.peek(np.array(conv + [1])) == 16  # and it is a source now


def test_a_residue_is_copied_out_before_a_hit_is_copied_into_its_slot():
    """A finished request's slot is handed to a new request (no free slot without a residue)
    whose hit comes from an entry: the residue's copy into an entry, queued first, must read the
    slot before the hit's copy writes it. (Found by a cancel storm: the stash's leading
    ``apply`` re-entered the queue and ran the hit's copy first, so the new entry held the hit's
    tokens under the residue's ids.)"""
    c, moves = cache(running=1, entries=3, budget=200)
    a, b = list(range(100, 130)), list(range(200, 230))
    finish(c, c.acquire(np.array(a))[0], a, moves)  # entry: a
    slot, _ = c.acquire(np.array(b))
    moves.store[slot, :30] = b
    c.release(slot, np.array(b))  # residue: b, not copied out yet (no idle time)
    s2, hit = c.acquire(np.array(a[:20] + [7]))  # the only slot: b must leave before a lands
    assert s2 == slot and hit is not None and hit.length == 20
    c.apply()
    assert moves.store[s2, :20].tolist() == a[:20]
    held = {tuple(e.tolist()) for e in c.entries()}
    assert tuple(b) in held
    src = next(s for s, e in c._entries.items() if e.ids.tolist() == b)
    assert moves.store[src, :30].tolist() == b  # the entry's data is b's, not a's


def test_copying_out_a_residue_never_evicts_the_entry_a_hit_is_about_to_copy():
    """One running slot, one entry slot. The entry holds a; the running slot keeps b's residue.
    A request sharing a's first 20 tokens gets that slot, so b must be copied out first, and
    the only entry slot to put b in is a's, the least recently used. Evicting it there would
    hand the request b's data under a's ids (found by a cancel storm): b is dropped instead."""
    c, moves = cache(running=1, entries=1, budget=200)
    a, b = list(range(100, 130)), list(range(200, 230))
    finish(c, c.acquire(np.array(a))[0], a, moves)
    slot, _ = c.acquire(np.array(b))
    moves.store[slot, :30] = b
    c.release(slot, np.array(b))
    s2, hit = c.acquire(np.array(a[:20] + [7]))
    assert hit is not None and hit.length == 20
    c.apply()
    assert moves.store[s2, :20].tolist() == a[:20]
    assert [e.tolist() for e in c.entries()] == [a]
