"""One request's stream of :class:`~specdec_rt.engine.StreamEvent`: what the caller iterates,
and how dropping it cancels the request's task (its KV slots are freed on the next event-loop
pass, without waiting for a garbage collection)."""

from __future__ import annotations

import asyncio
import weakref

import anyio

from .errors import EngineClosedError

__all__ = ["EngineStream"]


class EngineStream:
    """One request's :class:`StreamEvent` iterator. The request runs in its own task; closing
    this (``aclose()``, ``async with``, or dropping the last reference, e.g. ``break`` out of
    ``async for``) cancels it and frees its slots on the next event-loop pass."""

    def __init__(self, receive, engine) -> None:  # engine: the Engine it belongs to
        self._receive, self._engine = receive, engine
        self._ready = _Ready()
        self._task: asyncio.Task | None = None
        self._finalizer = None

    def _attach(self, task: asyncio.Task) -> None:
        self._task = task
        self._finalizer = weakref.finalize(self, _cancel_soon, task.get_loop(), task, self._receive)
        self._finalizer.atexit = False

    async def ready(self) -> None:
        """Wait until the prompt is encoded and the request checked (before any model work);
        raises what that found (``InvalidInputError``, ``ContextLengthError``). Optional: the
        first iteration raises the same. A server awaits it to answer 400 before streaming."""
        await self._ready.wait()

    def __aiter__(self) -> "EngineStream":
        return self

    async def __anext__(self):  # -> StreamEvent
        try:
            item = await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            if self._finalizer.alive and self._engine._closed and self._task.cancelled():
                raise EngineClosedError("the engine was closed while this request ran") from None
            raise StopAsyncIteration from None
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self) -> None:
        """End the request now (its slots are freed on the next event-loop pass)."""
        self._finalizer()

    async def __aenter__(self) -> "EngineStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class _Ready:
    """Set once a request's prompt was checked: with None, or with the error it raised."""

    def __init__(self) -> None:
        self._event, self._error = asyncio.Event(), None

    def set(self, error: Exception | None) -> None:
        self._error = error
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
        if self._error is not None:
            raise self._error


def _cancel_soon(loop, task: asyncio.Task, receive) -> None:
    """Cancel a request's task from wherever its stream was dropped (thread-safe)."""
    receive.close()
    if not task.done() and not loop.is_closed():
        loop.call_soon_threadsafe(task.cancel)
