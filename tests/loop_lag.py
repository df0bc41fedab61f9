"""Measuring event-loop stalls in tests that hold on a loaded 2-core machine.

A wall-clock bar alone fails when other processes take the cores. So every stall test measures
the attack and a control (ordinary work of the same kind) in the same test, with the engine's
own watchdog (:class:`~specdec_rt.engine.loop_watch.LoopWatch`), and compares:

- ``lag``: how late the loop woke, wall clock: attack <= max(floor, factor x control);
- ``busy``: CPU the loop's thread spent between two wakes (what work on the loop costs, whatever
  the machine's load): the attack's worst under a bound.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from specdec_rt.engine.loop_watch import LoopWatch

FLOOR_S = 0.100  # the bar: max(100 ms, 3x the control's worst)
FACTOR = 3.0


@dataclass
class Lag:
    worst: float  #: seconds, wall clock
    busy: float  #: seconds of the loop thread's CPU between two wakes, worst
    out: Any  #: what the work returned, or the exception it raised

    def ms(self) -> str:
        return f"lag {self.worst * 1000:.0f} ms, busy {self.busy * 1000:.0f} ms"


async def measure(work: Callable[[], Awaitable[Any]], interval: float = 0.005) -> Lag:
    """Run ``work()`` beside a fresh watchdog; its worst lag, worst busy stretch, and outcome."""
    watch = LoopWatch(interval=interval)
    task = asyncio.get_running_loop().create_task(watch.run())
    await asyncio.sleep(0.02)
    watch.reset()
    try:
        out: Any = await work()
    except Exception as exc:  # noqa: BLE001 - returned for the test to check
        out = exc
    await asyncio.sleep(0.01)  # one more wake, after the work's last step
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return Lag(watch.stats.worst_lag, watch.stats.worst_busy, out)


def bound(control: Lag, floor: float = FLOOR_S, factor: float = FACTOR) -> float:
    """The most an attack's worst lag may be, given the control's."""
    return max(floor, factor * control.worst)


async def compare(
    attack: Callable[[], Awaitable[Any]],
    control: Callable[[], Awaitable[Any]],
    *,
    tries: int = 3,
    floor: float = FLOOR_S,
    factor: float = FACTOR,
) -> tuple[Lag, Lag]:
    """Measure ``control`` then ``attack``, up to ``tries`` times until the attack's worst lag is
    within :func:`bound` of the control measured just before it (a busy machine's scheduler adds
    its own delays to either). Returns the last pair; the caller asserts."""
    for _ in range(tries):
        c = await measure(control)
        a = await measure(attack)
        if a.worst <= bound(c, floor, factor):
            break
    return a, c
