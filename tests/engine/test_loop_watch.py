"""The event loop's watchdog (specdec_rt/engine/loop_watch.py): it sees a stall as lag, work on
the loop as busy CPU time (whatever other processes do), and the server exports it in /metrics."""

from __future__ import annotations

import asyncio
import threading
import time

import anyio
import pytest
from serve_util import client, metric, metric_values, run

from specdec_rt.engine.loop_watch import LoopWatch


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_stall_shows_as_lag_and_work_on_the_loop_as_busy_time():
    async def main():
        watch = LoopWatch()
        task = asyncio.get_running_loop().create_task(watch.run())
        await asyncio.sleep(0.05)
        watch.reset()
        time.sleep(0.15)  # the loop blocked without working (as when another thread holds the GIL)
        await asyncio.sleep(0.02)
        blocked = watch.reset()
        _spin(0.08)  # the loop working for one request
        await asyncio.sleep(0.02)
        worked = watch.reset()
        # a worker thread that spins keeps its CPU off the loop thread's count
        await anyio.to_thread.run_sync(_spin, 0.08)
        await asyncio.sleep(0.02)
        beside = watch.reset()
        task.cancel()
        return blocked, worked, beside, watch

    blocked, worked, beside, watch = asyncio.run(main())
    assert blocked.worst_lag >= 0.14 and blocked.worst_busy < 0.05, blocked
    assert worked.worst_lag >= 0.07 and worked.worst_busy >= 0.06, worked
    assert beside.worst_busy < 0.04, beside
    assert blocked.samples > 0 and watch.stats.samples == 0


def test_stalls_counts_wakes_later_than_a_bound():
    watch = LoopWatch()
    for lag in (0.001, 0.2, 0.03, 0.5):
        watch.record(lag, 0.0)
    assert watch.stalls(0.1) == 2 and watch.stalls(0.01) == 3
    assert watch.stats.worst_lag == 0.5 and watch.stats.samples == 4
    seen = []
    watch.listeners.append(lambda lag, busy: seen.append((lag, busy)))
    watch.record(0.002, 0.001)
    assert seen == [(0.002, 0.001)]


@pytest.mark.export
def test_the_server_exports_the_loop_lag(tiny_llama):
    from specdec_rt.serve.app import create_app

    async def check(engine):
        app = create_app(engine, slots=2)
        async with app.router.lifespan_context(app), client(app) as c:
            r = await c.post("/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 4})
            assert r.status_code == 200
            await asyncio.sleep(0.05)
            threading.Event().wait(0.12)  # a stall the watchdog must see
            await asyncio.sleep(0.05)
            values = metric_values((await c.get("/metrics")).text)
        assert metric(values, "specdec_event_loop_lag_seconds_count") > 5
        assert metric(values, "specdec_event_loop_lag_worst_seconds") >= 0.1
        assert metric(values, "specdec_event_loop_lag_seconds_bucket", le="0.1") < metric(
            values, "specdec_event_loop_lag_seconds_bucket", le="+Inf"
        )
        engine.watch_loop()
        assert engine._watch_task is not None and not engine._watch_task.done()
        return engine

    engine = run(check, tiny_llama, draft="none")
    assert engine._watch_task is None or engine._watch_task.done()  # closed with the engine
