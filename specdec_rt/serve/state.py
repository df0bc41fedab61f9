"""The server's state: the engine (or its loader), admission control, draining, metrics.

A request is *admitted* once it passed validation and until its response is over; at most
``slots + max_queued`` are admitted at once, the next one is refused with 429 before any engine
call. ``slots`` of them generate (the engine's own limit); the rest wait for a slot.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableSequence
from typing import Any, Literal

import anyio

from ..engine.memory import ModelKV, engine_kv, engine_weight_files, engine_weights_bytes
from ..engine.served import DEFAULT_SLOTS, ServedEngine
from ..logs import get_logger
from ..speculation.protocols import check_implements
from .metrics import Metrics
from .options import AppConfig
from .protocol import APIError

__all__ = ["Serving"]

State = Literal["loading", "ready", "draining", "failed"]
Loader = Callable[[], Awaitable[ServedEngine]]
log = get_logger("specdec_rt.serve")


class Serving:
    """What the routes share. ``engine_or_loader``: a loaded engine (a
    :class:`~specdec_rt.engine.served.ServedEngine`, such as an :class:`~specdec_rt.Engine`; ready
    at once; the caller keeps ownership), or an async callable returning one (loaded at startup
    by the app's lifespan, closed at shutdown). ``config``: the app's options."""

    def __init__(self, engine_or_loader: ServedEngine | Loader, config: AppConfig) -> None:
        self.config = config
        self.slots = config.slots or DEFAULT_SLOTS  # config.slots None: the engine's, once attached
        self.max_queued = config.max_queued
        self.request_timeout, self.max_body_bytes = config.request_timeout, config.max_body_bytes
        self.default_max_tokens, self.retry_after = config.default_max_tokens, config.retry_after
        self.drain_timeout = config.drain_timeout
        self.max_prompt_logprob_work = config.max_prompt_logprob_work  # None: no limit
        self.consumer_timeout = config.consumer_timeout or None  # a streamed chunk the client does not take
        self.admitted = 0
        self.jobs: set[Any] = set()  # the admitted requests' Jobs, ended with a 503 past the drain deadline
        self._draining: anyio.Event | None = None  # made by end_jobs_after_drain, on the loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine: ServedEngine | None = None
        self.loader: Loader | None = None
        self.state: State = "loading"
        self.on_load_error: Callable[[BaseException], None] | None = None  # the CLI exits on it
        self.metrics = Metrics(self._running, self._waiting, self._cache_bytes, self._slots_free, kv=self._kv)
        self._listening: MutableSequence[Callable[[int], None]] | None = None
        self.model_name = config.model_name
        if callable(engine_or_loader) and not isinstance(engine_or_loader, ServedEngine):
            self.loader = engine_or_loader
        else:
            self._attach(engine_or_loader)
            self.state = "ready"

    @property
    def engine(self) -> ServedEngine:
        """The engine; only once ready (the routes check :meth:`check_open` first)."""
        if self._engine is None:
            raise RuntimeError("the engine is not loaded yet")
        return self._engine

    @property
    def loaded(self) -> ServedEngine | None:
        """The engine, or None while it loads (or after its load failed)."""
        return self._engine

    # ------------------------------------------------------------------ engine
    def _attach(self, engine: object) -> None:
        check_implements(engine, ServedEngine, "engine given to create_app")
        assert isinstance(engine, ServedEngine)  # (for type checkers: check_implements raised otherwise)
        self._engine = engine
        if self.config.slots is None:
            self.slots = engine.slots
        self.model_name = self.model_name or engine.name
        self.metrics.weights_bytes.set(engine_weights_bytes(engine))
        self.metrics.memory.weight_files = engine_weight_files(engine)
        listeners = engine.batch_listeners  # one call per batched target call
        if listeners is not None:
            listeners.append(self.metrics.observe_batch)
            self._listening = listeners
        watch = engine.loop_watch  # the event loop's lag, into /metrics
        if watch is not None and self.metrics.observe_loop not in watch.listeners:
            watch.listeners.append(self.metrics.observe_loop)
        self.start_watch()
        self.metrics.costs.attach(engine)  # the cost gauges read its measurements when scraped

    def start_watch(self) -> None:
        """Start the engine's event-loop watchdog, if it has one and a loop runs here."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop yet: the lifespan calls this again
        if self._engine is not None:
            self._engine.watch_loop()

    async def load(self) -> None:
        """Load the engine (lifespan startup); a failure is logged and handed to ``on_load_error``."""
        if self.loader is None:  # made with a loaded engine: ready already
            return
        try:
            self._attach(await self.loader())
        except Exception as exc:  # noqa: BLE001 - reported, and /health says failed
            self.state = "failed"
            log.error("model.load_failed", error=f"{type(exc).__name__}: {exc}")
            if self.on_load_error is not None:
                self.on_load_error(exc)
            return
        if self.state == "loading":
            self.state = "ready"
        log.info("model.ready", model=self.model_name)

    async def shutdown(self) -> None:
        """Lifespan shutdown: stop counting batches; close the engine if this server loaded it."""
        self.begin_drain()
        if self._listening is not None and self.metrics.observe_batch in self._listening:
            self._listening.remove(self.metrics.observe_batch)
        if self.loader is not None and self._engine is not None:
            await self._engine.aclose()

    def begin_drain(self) -> None:
        """From now on new requests get 503 and ``/health`` 503; admitted ones run to the end, or
        for ``drain_timeout`` seconds (:meth:`end_jobs_after_drain`). Safe from a signal handler."""
        if self.state in ("loading", "ready"):
            self.state = "draining"
            log.info("server.draining", admitted=self.admitted)
            if self._loop is not None and self._draining is not None:  # wakes the loop, from a signal handler too
                self._loop.call_soon_threadsafe(self._draining.set)

    async def end_jobs_after_drain(self) -> None:
        """Run by the app's lifespan: once draining, wait ``drain_timeout`` seconds, then end every
        request still admitted with a 503 ``draining`` error (a stream: one error event), so that
        none is cut off without an answer when the server stops."""
        self._draining = anyio.Event()
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:  # not on asyncio: nothing to wake
            self._loop = None
        if self.state == "draining":
            self._draining.set()
        await self._draining.wait()
        if self.drain_timeout is None:
            return
        await anyio.sleep(self.drain_timeout)
        if self.jobs:
            log.info("server.drain_timeout", ending=len(self.jobs))
        for job in list(self.jobs):
            job.expire()

    # ------------------------------------------------------------------ admission
    def check_open(self) -> None:
        if self.state == "ready":
            return
        message = {
            "loading": "the model is loading; retry shortly",
            "draining": "the server is shutting down",
            "failed": "the model failed to load",
        }[self.state]
        headers = {"Retry-After": str(self.retry_after)} if self.state == "loading" else None
        raise APIError(503, message, type="service_unavailable", code=self.state, headers=headers)

    def admit(self, n: int = 1, prompts: int = 1) -> None:
        """Count one more request in (``n * prompts`` engine requests: ``n`` choices of each of
        its prompts), or raise 429 (with ``Retry-After``) when they do not fit; 400 when they
        never could (past the capacity)."""
        capacity = self.slots + self.max_queued
        what, n = (f"n={n} choices" if prompts == 1 else f"n={n} choices of {prompts} prompts"), n * prompts
        if n > capacity:
            raise APIError(
                400,
                f"{what} exceed this server's capacity of {capacity} requests "
                f"({self.slots} running + {self.max_queued} queued)",
                param="n" if prompts == 1 else "prompt",
                code="invalid_value",
            )
        if self.admitted + n > capacity:
            raise APIError(
                429,
                f"the server is at capacity ({self.slots} running + {self.max_queued} queued requests); retry later",
                type="rate_limit_error",
                code="overloaded",
                headers={"Retry-After": str(self.retry_after)},
            )
        self.admitted += n

    def release(self, n: int = 1) -> None:
        self.admitted -= n

    def _running(self) -> float:
        n = None if self._engine is None else self._engine.running
        return min(self.admitted, self.slots) if n is None else n

    def _slots_free(self) -> float:
        """The engine's slots minus the requests holding one (an engine that does not count
        ``running``: the server's own count of them)."""
        slots = self.slots if self._engine is None else self._engine.slots
        return max(0, slots - self._running())

    def _cache_bytes(self) -> float:
        info = None if self._engine is None else self._engine.prefix_cache
        return 0.0 if info is None else float(info["bytes"])

    def _kv(self, resident: bool) -> list[ModelKV]:
        """The engine's KV pools (with ``resident``, their committed bytes: from any thread)."""
        engine = self._engine
        return [] if engine is None else engine_kv(engine, resident=resident)

    def _waiting(self) -> float:
        n = None if self._engine is None else self._engine.waiting
        return max(0, self.admitted - self.slots) if n is None else n
