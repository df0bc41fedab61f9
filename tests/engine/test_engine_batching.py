"""The Engine under concurrency, on tiny exported models: batched ONNX Runtime calls give each
row the logits it gets alone, concurrent requests equal their solo runs, slots come back however
a consumer stops (without a garbage collection), and closing mid-call never crashes."""

from __future__ import annotations

import asyncio
import gc

import anyio
import numpy as np
import pytest

from specdec_rt import EngineClosedError, InvalidInputError, SpecConfig
from specdec_rt.engine.engine import Engine
from specdec_rt.ort import OrtModel

pytestmark = pytest.mark.export

PROMPTS = [
    "def add(a, b):",
    "Hello world! The quick",
    "1, 2, 3,",
    "import os",
    [{"role": "user", "content": "Write a Python function."}],
    "Once upon a time",
]
STATIC = SpecConfig(measure_costs=False)


def test_a_batched_step_gives_every_row_its_solo_logits(tiny_llama):
    """Rows over slots 0..3 with slot 2 taking no part (a gap row gets a dummy token): each
    real row's logits equal the same step run alone, and the gap row's cache is untouched."""
    model = OrtModel(tiny_llama, max_length=64, slots=5)
    prompts = [np.array(p, dtype=np.int64) for p in ([5, 6, 7, 8, 9], [10, 11], [3, 4, 5], [12, 13, 14, 15])]

    async def main():
        sessions = [model.start() for _ in prompts]
        for s, p in zip(sessions, prompts):
            await s.extend(p, 1)
        keys = model.pool._buffers[0][0].array  # layer 0 keys [slots, kv, max_len + 1, d]
        gap = keys[sessions[2].slot, :, :3].copy()
        nxt = np.array([20, 21, 22, 23], dtype=np.int64)
        rows = [0, 1, 3]
        batched = model.run_batch_sync(
            [sessions[i] for i in rows], nxt[rows], np.array([sessions[i].length for i in rows])
        )  # [3, V]
        assert [sessions[i].length for i in rows] == [6, 3, 5]
        assert np.array_equal(keys[sessions[2].slot, :, :3], gap) and sessions[2].length == 3
        for j, i in enumerate(rows):  # the same step alone, from a fresh cache
            alone = model.start()
            want = await alone.extend(np.append(prompts[i], nxt[i]), 1)  # [1, V]
            np.testing.assert_allclose(batched[j], want[0], rtol=0, atol=2e-5)
            assert int(np.argmax(batched[j])) == int(np.argmax(want[0]))
            alone.close()

    asyncio.run(main())


def test_a_lone_query_sent_twice_is_bit_for_bit_the_same_alone_and_batched(tiny_llama):
    """A session whose lone query goes to attention twice (``lone_twice``: what a seeded
    sampled request's sessions do) gets the same logits alone as in a batched call beside a row
    of two new positions (a request catching up after a partial acceptance), whose width sends
    every row by the several-query path. Int8 activations amplify the paths' difference (~0.5
    in the real int8 draft's logits), and a seeded request would draw other tokens. Where the
    model's 4-bit kernels also round a one-row call otherwise (AVX2 without VNNI: measured at
    load, ``lone_differs``), such a session sends its lone position with a copy of it."""
    model = OrtModel(tiny_llama / "draft-q4", max_length=64, slots=4)
    assert not model.lone_twice  # a draft's own rule: a lone query once (cheaper in batches)
    prompts = [np.array(p, dtype=np.int64) for p in ([5, 6, 7, 8, 9], [10, 11, 12], [3, 4, 5, 6, 7, 8, 9, 10])]

    async def main():
        sessions = [model.start() for _ in prompts]
        for s, p in zip(sessions, prompts):
            s.lone_twice, s.pad_lone = True, model.lone_differs  # what adapters do for seeded requests
            await s.extend(p, 1)
        feeds = [np.array(f, dtype=np.int64) for f in ([20], [21, 30], [22])]
        pasts = [s.length for s in sessions]
        batched = model.run_rows_sync(sessions, feeds, [1, 1, 1])  # [[1, V]] x 3
        for j, s in enumerate(sessions):
            s.rollback(pasts[j])
            alone = await s.extend(feeds[j], 1)  # [1, V]: rows 0 and 2 are plain single-token steps
            if feeds[j].size == 1:
                np.testing.assert_array_equal(batched[j][0], alone[0])
            else:  # bit for bit with VNNI; on AVX2 alone ~3e-7 apart (rows of 2+ positions: float rounding)
                np.testing.assert_allclose(batched[j][0], alone[0], rtol=0, atol=1e-5)

    asyncio.run(main())


def test_the_load_checks_that_calls_of_2_and_9_positions_round_a_position_alike(tiny_llama):
    """Greedy speculation is exact only if a position's logits do not depend on how many
    positions its call holds; the load measures 2 against 9 (``rows_differ``, a warning if so)."""
    for folder in (tiny_llama, tiny_llama / "draft-q4"):
        model = OrtModel(folder, max_length=64, slots=1)
        assert model.rows_differ is False, folder


def test_a_seeded_sampled_request_sends_its_lone_queries_twice(tiny_llama):
    from specdec_rt.sampling import SamplingParams
    from specdec_rt.speculation.adapters import ModelDrafter
    from specdec_rt.speculation.context import RequestContext

    drafter = ModelDrafter(OrtModel(tiny_llama / "draft-q4", max_length=64, slots=3))
    for params, twice in (
        (SamplingParams(0.8, seed=3), True),
        (SamplingParams(0.8), False),
        (SamplingParams(0.0, seed=3), False),
    ):
        ctx = RequestContext([1, 2, 3], 4, params=params)
        assert drafter._session(ctx).session.lone_twice is twice
        drafter.release(ctx)


def test_seeded_sampled_requests_are_the_same_alone_and_in_a_batch(tiny_llama):
    """docs/architecture.md: a seeded request's output depends only on its seed, never on the
    requests beside it (its schedule ignores the load; its draft and target logits are the
    same in a batch)."""

    async def main():
        async with await Engine.load(tiny_llama, draft="ngram+q4", slots=8) as engine:
            kws = [
                dict(temperature=t, seed=s, top_k=k)
                for t, s, k in ((0.8, 7, None), (1.0, 1, 3), (0.7, 5, None), (1.2, 11, 5))
            ]
            solo = [(await engine.generate(p, 24, **kw)).token_ids for p, kw in zip(PROMPTS, kws)]
            for _ in range(2):
                together = await asyncio.gather(*(engine.generate(p, 24, **kw) for p, kw in zip(PROMPTS, kws)))
                assert [r.token_ids for r in together] == solo

    asyncio.run(main())


@pytest.mark.parametrize("draft", ["q4", "ngram+q4"])
def test_concurrent_requests_equal_their_solo_runs_and_really_batch(tiny_llama, draft):
    async def main():
        async with await Engine.load(tiny_llama, draft=draft, slots=8, spec_config=STATIC) as engine:
            sizes: list[int] = []
            engine.batch_listeners.append(sizes.append)
            for mode in ("ar", "spec"):
                solo = [(await engine.generate(p, 24, mode=mode)).token_ids for p in PROMPTS]
                sizes.clear()
                both = await asyncio.gather(*[engine.generate(p, 24, mode=m) for p in PROMPTS for m in ("ar", "spec")])
                assert [r.token_ids for r in both[::2]] == solo if mode == "ar" else True
                assert [r.token_ids for r in both[1::2]] == [r.token_ids for r in both[::2]]
                assert max(sizes) > 1  # several requests' rows in one target call
            assert engine.target.pool.free == engine.slots and engine.running == 0

    asyncio.run(main())


def test_measured_costs_turn_speculation_down_as_the_batch_grows(tiny_llama):
    async def main():
        async with await Engine.load(tiny_llama, draft="q4", slots=8) as engine:
            for p in PROMPTS:  # alone: measures the draft and verify costs
                await engine.generate(p, 16)
            for _ in range(3):
                res = await asyncio.gather(*[engine.generate(p, 16, mode="spec") for p in PROMPTS])
            solo = [(await engine.generate(p, 16, mode="ar")).token_ids for p in PROMPTS]
            assert [r.token_ids for r in res] == solo
            assert engine.executor.step_seconds(engine.target, 6) is not None
            assert sum(r.stats.ar_steps for r in res) > 0  # plain batched steps under load

    asyncio.run(main())


def test_slots_come_back_however_the_consumer_stops_without_a_garbage_collection(tiny_llama):
    async def main():
        async with await Engine.load(tiny_llama, draft="q4", slots=4) as engine:
            want = (await engine.generate(PROMPTS[0], 20)).token_ids
            gc.disable()
            try:
                async for _ in engine.stream(PROMPTS[0], 40):  # break, never closing the iterator
                    break
                it = engine.stream(PROMPTS[1], 40)
                await it.__anext__()
                del it  # dropped mid-request

                async def running():  # the request holds its slots (a tiny model's is over in ms)
                    while engine.running == 0:
                        await asyncio.sleep(0)

                task = asyncio.ensure_future(engine.generate(PROMPTS[2], 200))
                await running()
                task.cancel()  # a cancelled consumer
                with pytest.raises(asyncio.CancelledError):
                    await task
                with anyio.CancelScope() as timeout:  # a timeout: its deadline passes mid-request

                    async def expire():
                        await running()
                        timeout.deadline = anyio.current_time()

                    expiry = asyncio.ensure_future(expire())
                    await engine.generate(PROMPTS[3], 200)
                assert timeout.cancelled_caught
                await expiry
                for _ in range(200):
                    if engine.running == 0 and engine.target.pool.free == 4:
                        break
                    await asyncio.sleep(0.005)
                assert engine.running == 0 and engine.waiting == 0
                assert engine.target.pool.free == 4 and engine.drafter.model.pool.free == 4
                # no round of a stopped request stays in the batch's ledger (it would spoil every
                # later round's measurement)
                assert not any(engine.scheduler.costs.ledger.active.values())
            finally:
                gc.enable()
            assert (await engine.generate(PROMPTS[0], 20)).token_ids == want  # and still exact

    asyncio.run(main())


def test_a_slow_consumer_does_not_hold_up_the_others(tiny_llama):
    async def main():
        async with await Engine.load(tiny_llama, draft="none", slots=4) as engine:
            idle = engine.stream(PROMPTS[0], 100, mode="ar")
            await idle.__anext__()  # then never read again
            res = await asyncio.wait_for(asyncio.gather(*[engine.generate(p, 30, mode="ar") for p in PROMPTS[1:4]]), 30)
            assert all(len(r.token_ids) == 30 or r.finish_reason == "stop" for r in res)
            await idle.aclose()

    asyncio.run(main())


def test_aclose_while_calls_run_ends_them_with_engine_closed_and_never_crashes(tiny_llama):
    async def main():
        engine = await Engine.load(tiny_llama, draft="q4", slots=4)
        streams = [engine.stream(p, 200) for p in PROMPTS[:4]]
        for s in streams:
            await s.__anext__()
        await engine.aclose()  # model calls are in flight or queued right now
        for s in streams:
            with pytest.raises(EngineClosedError):
                async for _ in s:
                    pass
        with pytest.raises(EngineClosedError):
            engine.stream(PROMPTS[0], 5)
        assert engine.target.pool is None  # released, after the last call returned

    asyncio.run(main())


def test_prompt_errors_surface_from_ready_before_any_model_work(tiny_llama):
    from specdec_rt import ContextLengthError, InvalidInputError

    async def main():
        async with await Engine.load(tiny_llama, draft="none", max_length=64) as engine:
            calls = engine.target.calls
            s = engine.stream("word " * 500, 10, mode="ar")
            with pytest.raises(ContextLengthError):
                await s.ready()
            with pytest.raises(ContextLengthError):
                await s.__anext__()
            with pytest.raises(InvalidInputError, match="max_prompt_chars"):
                engine.stream("x" * (engine.max_prompt_chars + 1), 10, mode="ar")
            with pytest.raises(InvalidInputError, match="max_new_tokens"):
                engine.stream("x", 0, mode="ar")
            assert engine.target.calls == calls and engine.running == 0

    asyncio.run(main())


def test_first_prompts_of_requests_arriving_together_are_prefilled_in_one_call(tiny_llama):
    model = OrtModel(tiny_llama, max_length=64, slots=4)
    prompts = [np.array(p, dtype=np.int64) for p in ([5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15])]

    async def main():
        sessions = [model.start() for _ in prompts]
        assert model.can_prefill_together(sessions)
        together = model.run_prefill_batch_sync(sessions, prompts)  # [3, V]
        assert [s.length for s in sessions] == [6, 2, 3]
        for j, p in enumerate(prompts):
            alone = model.start()
            np.testing.assert_allclose(together[j], (await alone.extend(p, 1))[0], rtol=0, atol=2e-5)
            alone.close()
        sessions[1].close()  # a free slot in between is fine; an open one with data is not
        fresh = model.start()
        assert fresh.slot == 1 and not model.can_prefill_together([sessions[0], sessions[2]])

    asyncio.run(main())


def test_load_warms_up_alone_and_keeps_only_what_it_measured(tiny_llama):
    """``Engine.load`` runs short requests alone first: the draft's step, its prefill and the
    verify call are measured (the batch policy predicts from them; a server whose requests always
    share a batch would never measure them), while the prefix cache, the totals and every later
    output are as on an engine loaded with ``warmup=False``."""

    async def main():
        async with (
            await Engine.load(tiny_llama, draft="q4") as warm,
            await Engine.load(tiny_llama, draft="q4", warmup=False) as cold,
        ):
            c, c0 = warm.scheduler.costs, cold.scheduler.costs
            assert c.draft_token_s is not None and c.verify_s and c.draft_prefill_s is not None
            assert c0.draft_token_s is None and not c0.verify_s and c0.draft_prefill_s is None
            assert warm.scheduler.totals.new_tokens == 0 and warm.running == 0
            cache = warm.prefix_cache
            assert cache["enabled"] and cache["entries"] == 0 and cache["queries"] == 0
            for prompt in PROMPTS[:3]:
                a, b = await warm.generate(prompt, 12), await cold.generate(prompt, 12)
                assert a.token_ids == b.token_ids
            assert warm.prefix_cache["queries"] == 3
        with pytest.raises(InvalidInputError, match="warmup"):
            await Engine.load(tiny_llama, warmup="yes")

    anyio.run(main)


def test_warm_up_forgets_the_times_of_its_first_request(tiny_llama):
    """The first request of a warm-up pays for the engine's start (pages of the models read from
    disk, allocations): what it measured is dropped before the measured requests run, the first
    of them plain (a target step alone is the unit of every cost)."""
    from specdec_rt.engine.warmup import WARMUP_REQUESTS, warm_up

    async def main():
        async with await Engine.load(tiny_llama, draft="q4", warmup=False) as engine:
            costs, real, seen, forgotten = engine.scheduler.costs, engine.generate, [], []
            forget = costs.forget_times

            async def spy(prompt, *a, **kw):
                seen.append(costs.draft_token_s)
                return await real(prompt, *a, **kw)

            def spy_forget():
                forgotten.append((costs.draft_token_s, dict(costs.verify_s)))
                forget()

            engine.generate, costs.forget_times = spy, spy_forget
            await warm_up(engine)
            assert len(seen) == WARMUP_REQUESTS + 2 and len(forgotten) == 1
            assert forgotten[0][0] is not None and forgotten[0][1]  # the touch measured, then forgot
            assert seen[:2] == [None, None] and costs.draft_token_s is not None
            assert 0 in costs.verify_s  # the plain request measured a target step alone

    anyio.run(main)


def test_a_failing_warm_up_never_fails_the_load(tiny_llama):
    """Warm-up requests that fail (a chat template that refuses, a model failing on some input)
    end the warm-up with a logged warning, not the load: the engine stays usable."""
    from specdec_rt import InferenceError
    from specdec_rt.engine.warmup import warm_up

    async def main():
        async with await Engine.load(tiny_llama, draft="q4", warmup=False) as engine:
            real, calls = engine.generate, []
            encode = engine.prompt_encoder.encode

            def chat_refused(prompt, *a, **kw):  # (the warm-up encodes its prompts, then runs their ids)
                calls.append(type(prompt).__name__)
                if not isinstance(prompt, str):
                    raise InvalidInputError("chat template refused")
                return encode(prompt, *a, **kw)

            engine.prompt_encoder.encode = chat_refused
            await warm_up(engine)  # messages refused: warmed up with the plain text instead
            assert calls == ["list", "str"] * 4 and engine.scheduler.costs.draft_token_s is not None
            engine.prompt_encoder.encode = encode

            async def broken(prompt, *a, **kw):
                calls.append("broken")
                raise InferenceError("simulated model failure")

            engine.generate, calls[:] = broken, []
            await warm_up(engine)  # gives up at the first request that fails both ways
            assert calls == ["broken", "broken"]
            assert engine.prefix_cache["enabled"] and engine.scheduler.totals.new_tokens == 0
            engine.generate = real
            assert len((await engine.generate(PROMPTS[0], 8)).token_ids) == 8

    anyio.run(main)


def test_a_row_at_the_end_of_its_context_runs_apart_from_a_wider_batch(tiny_llama):
    """A batched call pads every row to its widest; a row near its slot's end (a request asking
    for its whole context) would then write past the slot, and ONNX Runtime failed the whole
    call, every request in it (QA). Such a row now runs on its own, and every output is its
    solo plain output; at the model level, each row's logits are its solo ones."""
    always = SpecConfig(
        k_init=4, adapt_k=False, measure_costs=False, fallback_below=0.0, zero_rounds=10**6, min_speedup=0.0
    )
    length = 48

    async def main():
        async with (
            await Engine.load(tiny_llama, draft="q4", max_length=length, spec_config=always, warmup=False) as engine,
            await Engine.load(tiny_llama, draft="none", max_length=length, warmup=False) as plain,
        ):
            long = "the cat runs fast " * 3
            room = length - len(engine.codec.encode_prompt(long))
            jobs = [(long, room), ("hello", 40), ("a dog", 40)]
            for _ in range(3):
                got = await asyncio.gather(*[engine.generate(p, n) for p, n in jobs])
                want = [await plain.generate(p, n, mode="ar") for p, n in jobs]
                assert [g.token_ids for g in got] == [w.token_ids for w in want]
                assert sum(g.stats.rounds for g in got) > 0

    anyio.run(main)

    model = OrtModel(tiny_llama, max_length=16, slots=2)
    a, b = model.start(), model.start()
    a.run_sync(np.arange(3, 18, dtype=np.int64), 1, 0)  # 15 of 16 positions: room for one more
    b.run_sync(np.arange(3, 6, dtype=np.int64), 1, 0)
    solo = [a.run_sync(np.array([30]), 1, a.length), b.run_sync(np.array([31, 32, 33, 34]), 4, b.length)]
    a.rollback(15)
    b.rollback(3)
    together = model.run_rows_sync([a, b], [np.array([30]), np.array([31, 32, 33, 34])], [1, 4])
    for x, y in zip(together, solo):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
    assert (a.length, b.length) == (16, 7)


def test_a_request_cancelled_mid_call_clears_its_binding_only_when_the_call_returns(tiny_llama, monkeypatch):
    """Cancelling a request while its own call runs in the worker thread closed its session
    there and then: its IO binding was cleared under the running ONNX Runtime call ("Missing
    Input: input_ids", then a segfault or an abort; QA). The binding is now cleared when the call
    returns; the slot goes back to the pool at once (its next call runs after this one)."""
    import threading

    from specdec_rt.ort.session import OrtSession

    entered, proceed = threading.Event(), threading.Event()
    events: list[str] = []
    run_sync, unbind = OrtSession.run_sync, OrtSession._unbind

    held_sessions = []

    def held(self, ids, rows, past, **extra):
        if ids.size > 100:  # the long prompt's call: hold it in flight
            held_sessions.append(self)
            entered.set()
            proceed.wait(10)
            try:
                return run_sync(self, ids, rows, past, **extra)  # (closed by now: it raises)
            finally:
                events.append("call returned")
        return run_sync(self, ids, rows, past, **extra)

    def recorded(self):
        if self in held_sessions:
            events.append("unbind")
        unbind(self)

    monkeypatch.setattr(OrtSession, "run_sync", held)
    monkeypatch.setattr(OrtSession, "_unbind", recorded)

    async def main():
        async with await Engine.load(
            tiny_llama, draft="none", max_length=512, slots=2, warmup=False, prefix_cache=False
        ) as engine:
            pool = engine.target.pool
            task = asyncio.ensure_future(engine.generate("the quick brown fox " * 20, 4, mode="ar"))
            await asyncio.to_thread(entered.wait, 10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(100):  # the request's own task ends (its session closed) meanwhile
                if not engine._tasks and engine.running == 0:
                    break
                await asyncio.sleep(0.01)
            assert not engine._tasks and engine.running == 0 and engine.scheduler.running == 0
            assert pool.free == 2 and events == []  # the slot is back; the binding is not cleared yet
            proceed.set()
            for _ in range(100):
                if "unbind" in events:
                    break
                await asyncio.sleep(0.01)
            assert events == ["call returned", "unbind"]
            want = (await engine.generate("def add(a, b):", 6, mode="ar")).token_ids
            assert len(want) == 6

    anyio.run(main)


def test_aclose_from_another_event_loop_releases_the_models(tiny_llama):
    """Loaded (and warmed up) under one asyncio.run, closed under another: aclose waited on the
    first loop's task and raised 'Event loop is closed', leaving the models open (QA)."""
    engine = asyncio.run(Engine.load(tiny_llama, draft="q4"))
    asyncio.run(engine.generate("def add(a, b):", 4))  # a second loop's requests work too
    asyncio.run(engine.aclose())
    assert engine.target.session is None and engine.target.pool is None
    with pytest.raises(EngineClosedError):
        asyncio.run(engine.generate("def add(a, b):", 4))
