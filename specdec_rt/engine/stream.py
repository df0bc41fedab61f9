"""One request's stream of :class:`StreamEvent`: what the caller iterates, and how dropping it
cancels the request's task (its KV slots are freed on the next event-loop pass, without waiting
for a garbage collection); and :class:`EngineResult`, a whole generation."""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from ..errors import EngineClosedError
from ..types import FinishReason, Stats, TokenLogprob

if TYPE_CHECKING:
    from ..request.params import RequestParams
    from .engine import Engine

__all__ = ["EngineResult", "EngineStream", "StreamEvent"]


@dataclass
class EngineResult:
    """A finished generation (:meth:`Engine.generate <specdec_rt.engine.engine.Engine.generate>`).

    Attributes:
        text: The answer (special tokens skipped).
        token_ids: The generated ids (prompt excluded).
        stats: The request's counters (``tokens_per_s``, ``acceptance_rate``, ``mean_accepted``,
            ``mode``, ...).
        prompt_tokens: The prompt's length in tokens.
        logprobs: One per token id, when asked (``logprobs=``).
        prompt_token_ids: With ``prompt_logprobs=``: the prompt's token ids.
        prompt_logprobs: With ``prompt_logprobs=``: each prompt token's log-probability after the
            ones before it (the first: None).
        tool_calls: With ``tools``: the calls in ``text`` (OpenAI's shape: ``id``, ``type``,
            ``function.name``, ``function.arguments`` as a JSON string), maybe none; ``text``
            stays the whole answer.
    """

    text: str
    token_ids: list[int]
    stats: Stats
    prompt_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked (``logprobs=``)
    #: with ``prompt_logprobs=``: the prompt's token ids and each one's log-probability after the
    #: ones before it (the first: None)
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    #: with ``tools``: the calls in ``text`` (OpenAI's shape: ``id``, ``type``, ``function.name``,
    #: ``function.arguments`` as a JSON string), maybe none; ``text`` stays the whole answer
    tool_calls: list[dict[str, Any]] | None = None

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.stats.finish_reason


@dataclass(frozen=True)
class StreamEvent:
    """New text and the token ids that became final with it (one event of
    :meth:`Engine.stream <specdec_rt.engine.engine.Engine.stream>`).

    Attributes:
        text: New text (never a broken UTF-8 character; may be empty while one is incomplete).
        token_ids: The ids that became final with it.
        finished: Why the request ended, on the last event.
        stats: The request's counters, on the last event.
        logprobs: One per token id, when asked (``logprobs=``).
        prompt_token_ids: With ``prompt_logprobs=``: on the first event (no text, no tokens), the
            prompt's token ids.
        prompt_logprobs: With ``prompt_logprobs=``: on the first event, their log-probabilities
            (the first: None).
    """

    text: str
    token_ids: tuple[int, ...]
    finished: FinishReason | None = None
    stats: Stats | None = field(default=None, repr=False)  # on the last event
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token id, when asked (``logprobs=``)
    #: ``prompt_logprobs=``: the first event (no text, no tokens) carries the prompt's token ids
    #: and their log-probabilities (the first: None)
    prompt_token_ids: tuple[int, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


class EngineStream:
    """One request's :class:`StreamEvent` iterator. The request runs in its own task; closing
    this (``aclose()``, ``async with``, or dropping the last reference, e.g. ``break`` out of
    ``async for``) cancels it and frees its slots on the next event-loop pass. A stream kept but
    not read ends its request after the engine's ``consumer_timeout`` (see
    :class:`~specdec_rt.engine.engine.Engine`): its waiting events can still be taken, then it
    raises :class:`~specdec_rt.errors.ConsumerTimeoutError`. ``params``: the request's checked
    :class:`~specdec_rt.request.params.RequestParams`."""

    def __init__(
        self,
        receive: MemoryObjectReceiveStream[StreamEvent | Exception],
        engine: Engine,
        params: RequestParams,
    ) -> None:
        self._receive, self._engine, self.params = receive, engine, params
        self._ready = _Ready()
        self._task: asyncio.Task[Any] | None = None
        self._finalizer: weakref.finalize[..., EngineStream] | None = None  # cancels the task (set by _attach, with it)

    def _attach(self, task: asyncio.Task[Any]) -> None:
        self._task = task
        self._finalizer = finalizer = weakref.finalize(self, _cancel_soon, task.get_loop(), task, self._receive)
        finalizer.atexit = False

    async def ready(self) -> None:
        """Wait until the prompt is encoded and the request checked (before any model work);
        raises what that found (``InvalidInputError``, ``ContextLengthError``). Optional: the
        first iteration raises the same. A server awaits it to answer 400 before streaming."""
        await self._ready.wait()

    @property
    def prompt_tokens(self) -> int | None:
        """The prompt's length in tokens once :meth:`ready` returned (None before)."""
        return self._ready.prompt_tokens

    def __aiter__(self) -> "EngineStream":
        return self

    async def __anext__(self) -> StreamEvent:
        try:
            item = await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            finalizer, task = self._finalizer, self._task
            if (
                finalizer is not None
                and finalizer.alive
                and self._engine._closed
                and task is not None
                and task.cancelled()
            ):
                raise EngineClosedError("the engine was closed while this request ran") from None
            if self._ready.ended is not None and self._finalizer is not None and self._finalizer.alive:
                raise self._ready.ended from None  # its consumer took no event for consumer_timeout s
            raise StopAsyncIteration from None
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self) -> None:
        """End the request now (its slots are freed on the next event-loop pass)."""
        if self._finalizer is not None:  # (None: no task was attached, nothing runs)
            self._finalizer()

    async def __aenter__(self) -> "EngineStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class _Ready:
    """Set once a request's prompt was checked: with None, or with the error it raised. Also
    holds ``ended``: the error that ended the request when its consumer stopped taking events
    (none could be queued then), raised once the events before it are taken."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._error: Exception | None = None
        self.ended: Exception | None = None
        self.prompt_tokens: int | None = None

    def set(self, error: Exception | None, prompt_tokens: int | None = None) -> None:
        self._error, self.prompt_tokens = error, prompt_tokens
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
        if self._error is not None:
            raise self._error


def _cancel_soon(
    loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any], receive: MemoryObjectReceiveStream[Any]
) -> None:
    """Cancel a request's task from wherever its stream was dropped (thread-safe)."""
    receive.close()
    if not task.done() and not loop.is_closed():
        loop.call_soon_threadsafe(task.cancel)
