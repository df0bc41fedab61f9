"""What the server needs from an engine: :class:`ServedEngine`, and the stream it returns,
:class:`ServedStream`. An :class:`~specdec_rt.engine.engine.Engine` is one; so is any object that
has these members, and a class that subclasses the Protocol gets the optional ones as do-nothing
defaults (no counters, no loop watchdog), as the model-level Protocols of
:mod:`specdec_rt.speculation.protocols` do. The app checks an engine with
:func:`~specdec_rt.speculation.protocols.check_implements` when it gets one, and reads nothing else.

The defaults an engine serves with live here too, so that the server and its command line read
them without importing the engine itself.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, MutableSequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .loop_watch import LoopWatch
from .stream import StreamEvent

if TYPE_CHECKING:
    from ..policy.figures import SpeculationFigures
    from ..request.params import RequestParams
    from .engine import Prompt
    from .precision import PrecisionChoice

__all__ = [
    "DEFAULT_SLOTS",
    "DEFAULT_CONSUMER_TIMEOUT",
    "ServedEngine",
    "ServedStream",
    "EventIterator",
    "ReportsSpeculation",
]

DEFAULT_SLOTS = 8  # requests batched at once; a slot's KV memory is committed only as it is used
#: seconds a request waits for its consumer to take an event (its buffer full) before it ends
DEFAULT_CONSUMER_TIMEOUT = 30.0


@runtime_checkable
class ServedStream(Protocol):
    """One request's :class:`~specdec_rt.engine.stream.StreamEvent` iterator, as the server reads
    it (:class:`~specdec_rt.engine.stream.EngineStream` is one). Optional: :meth:`ready` (the
    default: ready at once, errors come with the events) and :attr:`prompt_tokens`."""

    @property
    def prompt_tokens(self) -> int | None:
        """The prompt's length in tokens once :meth:`ready` returned (``None``: not told)."""
        return None

    async def ready(self) -> None:
        """Wait until the request is checked, and raise what that found (a server answers 400
        before streaming)."""
        return None

    def __aiter__(self) -> AsyncIterator[StreamEvent]: ...

    async def __anext__(self) -> StreamEvent: ...

    async def aclose(self) -> None:
        """End the request now and free what it holds. Idempotent."""
        ...


@runtime_checkable
class ServedEngine(Protocol):
    """What the OpenAI-compatible server (:mod:`specdec_rt.serve`) needs from an engine.

    Required: :meth:`stream` and :meth:`token_bytes`. Optional, with defaults: ``slots`` (requests
    generating at once; the app's default), ``name`` (the model's name in replies), ``choice``
    (what it runs, for ``/v1/models``), the counters ``running`` / ``waiting`` /
    ``prefix_cache`` (``None``: the server counts admitted requests itself), ``batch_listeners``
    (callables told each batched target call's rows; ``None``: no batch sizes in ``/metrics``),
    ``loop_watch`` / :meth:`watch_loop` (the event loop's lag in ``/metrics``), and :meth:`aclose`.
    """

    slots: int = DEFAULT_SLOTS
    name: str = "specdec-rt"
    choice: PrecisionChoice | None = None

    def stream(self, prompt: Prompt, params: RequestParams | None = None, **overrides: Any) -> ServedStream:
        """One request's events (bad arguments raise here or from the stream's ``ready``)."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token id stands for (log-probabilities, echoed token-id prompts)."""
        ...

    def is_special_token(self, token_id: int) -> bool:
        """Whether a token id is a special token, which text leaves out."""
        return False

    @property
    def running(self) -> int | None:
        """Requests holding a slot now (``None``: not counted)."""
        return None

    @property
    def waiting(self) -> int | None:
        """Requests waiting for a slot now (``None``: not counted)."""
        return None

    @property
    def prefix_cache(self) -> dict[str, Any] | None:
        """The prefix cache's counts, ``bytes`` among them (``None``: no prefix cache)."""
        return None

    @property
    def batch_listeners(self) -> MutableSequence[Callable[[int], None]] | None:
        """Callables ``f(rows)`` told about every batched target call (``None``: none told)."""
        return None

    @property
    def loop_watch(self) -> LoopWatch | None:
        """The event loop's watchdog (``None``: none)."""
        return None

    def watch_loop(self) -> LoopWatch | None:
        """Start :attr:`loop_watch` on the running event loop, if there is one."""
        return None

    async def aclose(self) -> None:
        """Release what it holds (called by a server that loaded it, at shutdown)."""
        return None


@runtime_checkable
class ReportsSpeculation(Protocol):
    """An engine that tells what its speculation measured (an :class:`~specdec_rt.engine.engine.Engine`
    does): the server then shows the measured costs in ``/metrics`` and ``/v1/models``, and labels
    the per-depth draft counters with its drafter. Optional: an engine without it shows neither."""

    def speculation_figures(self) -> SpeculationFigures | None:
        """The drafter, its measured costs and the acceptance per draft depth so far (``None``:
        no drafter)."""
        ...


class EventIterator(ServedStream):
    """A :class:`ServedStream` over an async generator of events (an engine of your own, a test
    fake): ready at once, its errors come with the events, its prompt length untold."""

    def __init__(self, events: AsyncGenerator[StreamEvent, None]) -> None:
        self._events = events

    def __aiter__(self) -> EventIterator:
        return self

    async def __anext__(self) -> StreamEvent:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        await self._events.aclose()


if TYPE_CHECKING:

    def _an_engine_is_served(engine: Engine) -> ServedEngine:  # mypy checks that Engine implements it
        return engine

    from .engine import Engine
