"""The prefix cache in an Engine on a tiny exported model: exact outputs, hits, memory."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from specdec_rt import SpecConfig
from specdec_rt.engine.engine import Engine
from specdec_rt.errors import InvalidInputError
from specdec_rt.kvcache.prefix import common_prefix
from specdec_rt.ort.kvpool import KVPool

pytestmark = pytest.mark.export

STATIC = SpecConfig(measure_costs=False)
HISTORY = " ".join(f"Fact {i}: the number {i} is {'even' if i % 2 == 0 else 'odd'}." for i in range(14))


def turns(reply: str) -> tuple[list, list]:
    first = [{"role": "user", "content": HISTORY + " Which facts are about even numbers?"}]
    return first, first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And odd?"}]


@pytest.mark.parametrize("draft", ["none", "draft-q4", "ngram"])
def test_second_turn_starts_from_the_first_and_says_the_same(tiny_llama, draft):
    async def conversation(engine, mode):
        first, _ = turns("")
        r1 = await engine.generate(first, 12, mode=mode)
        _, second = turns(r1.text)
        return r1, await engine.generate(second, 16, mode=mode)

    async def main():
        spec = draft if draft != "draft-q4" else str(tiny_llama / "draft-q4")
        mode = "ar" if draft == "none" else "spec"
        async with await Engine.load(tiny_llama, draft=spec, spec_config=STATIC, prefix_cache=False) as plain:
            want1, want2 = await conversation(plain, mode)
            assert plain.prefix_cache == {
                "enabled": False,
                "queries": 0,
                "hit_tokens": 0,
                "entries": 0,
                "evictions": 0,
                "bytes": 0,
            }
        async with await Engine.load(tiny_llama, draft=spec, spec_config=STATIC) as engine:
            got1, got2 = await conversation(engine, mode)
            assert (got1.token_ids, got2.token_ids) == (want1.token_ids, want2.token_ids)
            assert got1.stats.cached_prompt_tokens == 0
            assert got1.prompt_tokens - 1 <= got2.stats.cached_prompt_tokens < got2.prompt_tokens
            info = engine.prefix_cache
            assert info["queries"] == 2 and info["hit_tokens"] == got2.stats.cached_prompt_tokens
            await asyncio.sleep(0.2)  # idle: the finished requests' KV is copied into entries
            assert engine.prefix_cache["entries"] >= 1 and 0 < engine.prefix_cache["bytes"] <= 1 << 30
            again = await engine.generate(turns(got1.text)[1], 16, mode=mode)  # from an entry now
            assert again.token_ids == want2.token_ids and again.stats.cached_prompt_tokens > 0

    asyncio.run(main())


def test_concurrent_requests_sharing_a_long_prompt(tiny_llama):
    """Cold cache, four at once: the first computes the shared prompt, the others copy it (their
    calls wait for it); a second wave hits entries. Outputs equal runs without the cache."""
    prompts = [f"{HISTORY} Question {k}: which fact mentions {k}?" for k in range(4)]

    async def main():
        async with await Engine.load(tiny_llama, draft="ngram", spec_config=STATIC, prefix_cache=False) as plain:
            want = [(await plain.generate(p, 10)).token_ids for p in prompts]
        async with await Engine.load(tiny_llama, draft="ngram", spec_config=STATIC, slots=4) as engine:
            for wave in range(2):
                got = await asyncio.gather(*[engine.generate(p, 10) for p in prompts])
                assert [g.token_ids for g in got] == want
                hits = sorted(g.stats.cached_prompt_tokens for g in got)
                ids = [np.array(engine.codec.encode_prompt(p)) for p in prompts]
                shared = min(common_prefix(ids[0], x) for x in ids[1:])  # all but the question
                assert all(h >= shared for h in (hits[1:] if wave == 0 else hits)), hits
                await asyncio.sleep(0.2)
            assert engine.target.pool.free == 4 and engine.running == 0

    asyncio.run(main())


def test_draft_trees_of_requests_that_copy_a_running_prompt_wait_for_the_copy(tiny_llama):
    """Trees drafted in a batch (costs not measured) by requests whose prompt is being copied
    from a request still running: their first verify goes as a chain (a tree's call cannot
    start from a pending copy; it used to fail with an InferenceError). Outputs equal no cache."""
    prompts = ["You are a helpful assistant. " * 4 + f"Write a Python function. {k}" for k in range(4)]
    trees = SpecConfig(tree_nodes=3, measure_costs=False)

    async def main():
        async with await Engine.load(tiny_llama, draft="q4", spec_config=trees, prefix_cache=False) as plain:
            want = [(await plain.generate(p, 16)).token_ids for p in prompts]
        async with await Engine.load(tiny_llama, draft="q4", spec_config=trees, slots=8) as engine:
            got = await asyncio.gather(*[engine.generate(p, 16) for p in prompts])
        assert [g.token_ids for g in got] == want
        assert sum(g.stats.cached_prompt_tokens for g in got) > 0

    asyncio.run(main())


def test_rotating_conversations_stay_within_the_budget(tiny_llama):
    """Room for about two conversations, six rotating: the cache never holds more than its
    budget, evicts, and every answer equals the one without a cache."""
    convs = [f"Conversation {k}. " + HISTORY[k * 40 :] for k in range(6)]

    async def main():
        async with await Engine.load(tiny_llama, draft="none", prefix_cache=False) as plain:
            want = [(await plain.generate(c, 6, mode="ar")).token_ids for c in convs]
            per_token = plain.target.pool.token_bytes
            longest = max(len(plain.codec.encode_prompt(c)) for c in convs) + 6
        budget = 2 * longest * per_token
        async with await Engine.load(tiny_llama, draft="none", prefix_cache_bytes=budget, slots=2) as engine:
            for rnd in range(3):
                for c, w in zip(convs, want):
                    assert (await engine.generate(c, 6, mode="ar")).token_ids == w
                    await asyncio.sleep(0.05)
                    assert engine.prefix_cache["bytes"] <= budget
            assert engine.prefix_cache["evictions"] > 0 and engine.prefix_cache["entries"] < len(convs)

    asyncio.run(main())


def test_bad_prefix_cache_arguments(tiny_llama):
    async def main():
        for kwargs, msg in (
            ({"prefix_cache": "yes"}, "prefix_cache must"),
            ({"prefix_cache_bytes": -5}, "prefix_cache_bytes"),
            ({"prefix_cache_bytes": 1.5}, "prefix_cache_bytes"),
        ):
            with pytest.raises(InvalidInputError, match=msg):
                await Engine.load(tiny_llama, **kwargs)

    asyncio.run(main())


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_DONTNEED"), reason="needs madvise")
def test_an_evicted_entry_gives_its_memory_back():
    pool = KVPool(
        layers=4, kv_heads=4, head_dim=64, running=1, max_len=8192, device="cpu", entries=1, budget_bytes=1 << 30
    )
    n = 6000  # 4 layers x K,V x 4 heads x 64 x 4 bytes = 8 KiB per position: ~47 MiB
    for layer in pool._buffers:
        for buf in layer:
            buf.array[0, :, :n] = 1.0
    before = _rss()
    pool.copy(0, 1, 0, n)
    grown = _rss() - before
    assert grown > 0.8 * n * pool.token_bytes
    pool.discard(1, 0, n)
    assert _rss() - before < 0.1 * n * pool.token_bytes
    assert np.all(pool._buffers[0][0].array[1, :, 32 : n - 32] == 0)  # whole pages discarded read as zeros


def test_a_batched_step_leaves_what_a_free_slot_keeps_alone(tiny_llama):
    """Slots 0..2 prefilled; the middle session ends and its slot keeps its KV for the cache.
    A batched step of the other two spans that slot: its gap row must not write over what it
    keeps (the tokenizer's first token is id 0, the dummy's id, so this is checked on the KV)."""
    from specdec_rt.ort import OrtModel

    model = OrtModel(tiny_llama, max_length=256, slots=3, prefix_cache_bytes=1 << 26)
    prompts = [(np.arange(80) * (k + 3)) % 250 + 2 for k in range(3)]  # [80] each, no id 0

    async def main():
        sessions = [model.start(p) for p in prompts]
        for s, p in zip(sessions, prompts):
            await s.extend(p, 1)
        middle = sessions[1].slot
        assert middle not in (sessions[0].slot, sessions[2].slot)
        sessions[1].close()
        assert model.prefix_cache.kept(middle) == 80
        keys = model.pool._buffers[0][0].array  # layer 0 keys [slots, kv, max_len + 1, d]
        before = keys[middle, :, :80].copy()
        model.run_batch_sync([sessions[0], sessions[2]], np.array([7, 9]), np.array([80, 80]))
        assert np.array_equal(keys[middle, :, :80], before)
        assert not model.can_prefill_together([sessions[0], sessions[2]])  # that would write it too

    asyncio.run(main())
    model.close()


def test_the_chat_templates_shared_turn_is_not_prefilled_again(tiny_llama):
    """Every chat request to a model starts with the same tokens: its system turn (SmolLM2's
    template adds ~24 tokens of it to every chat). Short questions share only those, so the
    default block must be short enough to find them. The second request starts from them
    (cached, exactly), and says what it says without the cache."""
    from specdec_rt.kvcache.prefix import DEFAULT_BLOCK

    system = {"role": "system", "content": "You are a helpful AI assistant named Tiny, trained by us."}
    chats = [[system, {"role": "user", "content": q}] for q in ("Name a color.", "Why is the sky blue?")]

    async def main():
        async with await Engine.load(tiny_llama, draft="ngram", spec_config=STATIC, prefix_cache=False) as plain:
            want = [(await plain.generate(c, 12)).token_ids for c in chats]
        async with await Engine.load(tiny_llama, draft="ngram", spec_config=STATIC) as engine:
            ids = [np.array(engine.codec.encode_prompt(c)) for c in chats]
            shared = common_prefix(ids[0], ids[1])
            assert shared >= DEFAULT_BLOCK, (shared, DEFAULT_BLOCK)  # the premise: a block's worth
            got = [await engine.generate(c, 12) for c in chats]
            assert [g.token_ids for g in got] == want
            assert got[0].stats.cached_prompt_tokens == 0 and got[1].stats.cached_prompt_tokens == shared

    asyncio.run(main())


def test_the_cache_is_looked_up_on_the_event_loop_only(tiny_llama, monkeypatch):
    """The cache's bookkeeping belongs to the event loop's thread: a lookup from the worker
    thread that encodes prompts raced with releases ("Set changed size during iteration")."""
    import threading

    from specdec_rt.kvcache.prefix import PrefixCache

    threads = []
    lookup = PrefixCache._lookup

    def recorded(self, tokens):
        threads.append(threading.get_ident())
        return lookup(self, tokens)

    monkeypatch.setattr(PrefixCache, "_lookup", recorded)

    async def main():
        loop_thread = threading.get_ident()
        async with await Engine.load(tiny_llama, draft=str(tiny_llama / "draft-q4"), spec_config=STATIC) as engine:
            prompts = [f"{HISTORY} Question {k}?" for k in range(4)]
            await asyncio.gather(*[engine.generate(p, 6) for p in prompts])
            await asyncio.gather(*[engine.generate(p, 6) for p in prompts])  # hits now
        assert threads and set(threads) == {loop_thread}

    asyncio.run(main())
