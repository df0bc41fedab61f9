"""A watchdog of the event loop: how late the loop wakes, and how much of that was the loop's own
work.

Anything that runs on the event loop for one request (parsing a body, rendering a template,
computing a grammar mask) makes every other request wait, ``/health`` included. The watchdog is a
task that sleeps ``interval`` seconds in a loop and records, at each wake:

- ``lag``: how much later than asked it woke (wall clock). This is what every other request
  feels; it also grows when the machine is busy with other processes.
- ``busy``: how much CPU time the loop's thread used between two wakes, beyond the sleep. Work
  done on the loop shows here whatever the machine's load, so tests compare it with a bound.

Stats are data (:class:`LoopLag`); who reports them (``/metrics``' histogram, a test) registers a
listener. Cancelling :meth:`LoopWatch.run` stops the watchdog.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["LoopLag", "LoopWatch", "DEFAULT_INTERVAL_S"]

DEFAULT_INTERVAL_S = 0.005  # short enough to see a 10 ms stall, cheap enough to run always (~0.1% of a core)


@dataclass
class LoopLag:
    """What a :class:`LoopWatch` saw since it started (or since :meth:`reset`), in seconds."""

    samples: int = 0  #: wakes recorded
    worst_lag: float = 0.0  #: the latest wake, past its interval (wall clock)
    worst_busy: float = 0.0  #: the most CPU the loop's thread used between two wakes, past the interval
    total_lag: float = 0.0  #: the sum of every wake's lag


@dataclass
class LoopWatch:
    """Samples the running event loop's lag every ``interval`` seconds while :meth:`run` runs.

    ``listeners``: callables ``f(lag, busy)`` told about every wake (on the loop's thread)."""

    interval: float = DEFAULT_INTERVAL_S
    listeners: list[Callable[[float, float], None]] = field(default_factory=list)
    stats: LoopLag = field(default_factory=LoopLag)
    #: every wake's lag since the last reset, kept for tests (bounded: the newest ``keep``)
    lags: list[float] = field(default_factory=list)
    keep: int = 100_000

    def reset(self) -> LoopLag:
        """Start counting afresh; returns what was counted until now."""
        before, self.stats, self.lags = self.stats, LoopLag(), []
        return before

    async def run(self) -> None:
        """Sample until cancelled."""
        while True:
            wall, cpu = time.perf_counter(), time.thread_time()
            await asyncio.sleep(self.interval)
            lag = max(0.0, time.perf_counter() - wall - self.interval)
            busy = max(0.0, time.thread_time() - cpu - 0.0005)  # the wake itself costs a few microseconds
            self.record(lag, busy)

    def record(self, lag: float, busy: float) -> None:
        """One wake: ``lag`` seconds late, ``busy`` seconds of the loop thread's CPU since the last."""
        s = self.stats
        s.samples += 1
        s.total_lag += lag
        s.worst_lag = max(s.worst_lag, lag)
        s.worst_busy = max(s.worst_busy, busy)
        self.lags.append(lag)
        if len(self.lags) > self.keep:
            del self.lags[: self.keep // 2]
        for listener in self.listeners:
            listener(lag, busy)

    def stalls(self, above: float) -> int:
        """Wakes since the last reset that came more than ``above`` seconds late."""
        return sum(1 for lag in self.lags if lag > above)
