"""A stream nobody reads (issue 35, item 6): the request ends after ``consumer_timeout`` and
frees its KV slot; a slow reader under the timeout is not cut; closing still works as before."""

from __future__ import annotations

import time

import anyio
import pytest

from specdec_rt import ConsumerTimeoutError, InvalidInputError, SpecDecError
from specdec_rt.engine.engine import DEFAULT_CONSUMER_TIMEOUT, STREAM_BUFFER, Engine

pytestmark = pytest.mark.export

PROMPT = "def add(a, b):"
LONG = dict(max_new_tokens=200, ignore_eos=True, mode="ar")  # many events, more than the buffer holds


def test_an_unread_stream_frees_its_slot_within_consumer_timeout(tiny_llama):
    """slots=1: the first stream is read once, then kept but not read (``async for ... : break``
    while a variable holds it); the next request gets the slot once consumer_timeout passed, and
    the kept stream yields what was waiting, then raises ConsumerTimeoutError naming the timeout."""
    timeout = 0.5

    async def main():
        async with await Engine.load(tiny_llama, slots=1, consumer_timeout=timeout, warmup=False) as engine:
            assert engine.consumer_timeout == timeout
            kept = engine.stream(PROMPT, **LONG)
            async for _ in kept:
                break  # the variable still holds the stream: it is not dropped, nothing cancels it
            assert engine.running == 1
            start = time.perf_counter()
            with anyio.fail_after(timeout + 10):
                second = await engine.generate(PROMPT, max_new_tokens=4, mode="ar")
            waited = time.perf_counter() - start
            assert second.finish_reason == "length" and len(second.token_ids) == 4
            assert timeout * 0.9 <= waited < timeout + 5, waited  # it waited for the stalled one's slot
            assert engine.running == 0 and engine.waiting == 0
            late = []
            with pytest.raises(ConsumerTimeoutError) as err:
                async for ev in kept:
                    late.append(ev)
            assert 1 <= len(late) <= STREAM_BUFFER + 1 and not any(ev.finished for ev in late)
            assert err.value.timeout == timeout and isinstance(err.value, SpecDecError)
            assert "consumer took no event for 0.5 s (consumer_timeout=0.5)" in str(err.value)
            assert "KV slot was freed" in str(err.value)
            with pytest.raises(ConsumerTimeoutError):  # told again, not a silent end
                await kept.__anext__()
            await kept.aclose()
            with pytest.raises(StopAsyncIteration):  # closed by its owner: a plain end
                await kept.__anext__()

    anyio.run(main)


def test_a_slow_reader_under_the_timeout_is_not_cut(tiny_llama):
    """Each event taken 0.15 s after the last, with consumer_timeout=0.4: all of them arrive,
    although the whole request takes several times the timeout."""

    async def main():
        async with await Engine.load(tiny_llama, slots=1, consumer_timeout=0.4, warmup=False) as engine:
            want = await engine.generate(PROMPT, max_new_tokens=12, mode="ar")
            start, ids, last = time.perf_counter(), [], None
            async with engine.stream(PROMPT, max_new_tokens=12, mode="ar") as events:
                async for ev in events:
                    ids.extend(ev.token_ids)
                    last = ev
                    await anyio.sleep(0.15)
            assert ids == want.token_ids and last.finished == "length"
            assert time.perf_counter() - start > 0.4 * 2  # longer than the timeout, in total

    anyio.run(main)


def test_without_a_consumer_timeout_an_unread_stream_keeps_its_slot_until_closed(tiny_llama):
    async def main():
        for off in (None, 0):
            async with await Engine.load(tiny_llama, slots=1, consumer_timeout=off, warmup=False) as engine:
                assert engine.consumer_timeout is None
                kept = engine.stream(PROMPT, **LONG)
                await kept.__anext__()
                with anyio.move_on_after(1.0) as scope:
                    await engine.generate(PROMPT, max_new_tokens=2, mode="ar")
                assert scope.cancelled_caught and engine.running == 1  # still waiting for the slot
                await kept.aclose()  # closing frees it, as always
                with anyio.fail_after(10):
                    assert len((await engine.generate(PROMPT, max_new_tokens=2, mode="ar")).token_ids) == 2

    anyio.run(main)


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan"), float("inf"), "30", True, [30]])
def test_a_bad_consumer_timeout_is_refused_naming_it(tiny_llama, bad):
    async def main():
        with pytest.raises(InvalidInputError, match="consumer_timeout must be a finite number >= 0 or None, got"):
            await Engine.load(tiny_llama, consumer_timeout=bad, warmup=False)

    anyio.run(main)


def test_the_default_is_30_seconds():
    assert DEFAULT_CONSUMER_TIMEOUT == 30.0
    import inspect

    assert inspect.signature(Engine.load).parameters["consumer_timeout"].default == 30.0
    assert inspect.signature(Engine).parameters["consumer_timeout"].default == 30.0
