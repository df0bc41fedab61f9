"""``create_app``: the Starlette app of the OpenAI-compatible server.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics``. Errors, including 404 and 405, carry the OpenAI error body.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..engine.served import ServedEngine
from .guard import Access, access_middleware
from .jobs import EventStream, completions, error_response
from .options import AppConfig
from .protocol import APIError, error_body
from .replies import models_body
from .state import Loader, Serving

__all__ = ["create_app", "begin_drain"]


def create_app(engine_or_loader: ServedEngine | Loader, config: AppConfig | None = None, **options: Any) -> Starlette:
    """The ASGI app.

    ``app.state.serving`` holds the state; :func:`begin_drain` starts a graceful shutdown. The
    JSON routes take ``application/json`` only (415).

    Args:
        engine_or_loader: A loaded engine (an :class:`~specdec_rt.Engine`, or any
            :class:`~specdec_rt.engine.served.ServedEngine`; the app is ready at once and never
            closes it), or an async callable that returns one: the app's lifespan loads it in
            the background at startup (``/health`` and the completion routes answer 503 until
            then) and closes it at shutdown.
        config: The app's options (:class:`~specdec_rt.serve.options.AppConfig`: slots, queue,
            timeouts, limits, access; default: ``AppConfig()``).
        **options: Its fields by keyword, over ``config``
            (``create_app(engine, slots=4, api_keys=[...])``).

    Returns:
        The Starlette app.

    Raises:
        TypeError: An unknown option (named).
        InvalidInputError: A bad option value, or an engine that lacks a member the server
            needs.
    """
    config = replace(config or AppConfig(), **options)  # an unknown keyword: TypeError naming it
    access = Access.checked(config.api_keys, config.allowed_hosts, config.allowed_origins)
    serving = Serving(engine_or_loader, config)
    routes = _Routes(serving)
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", routes.chat, methods=["POST"]),
            Route("/v1/completions", routes.completion, methods=["POST"]),
            Route("/v1/models", routes.models, methods=["GET"]),
            Route("/v1/models/{model:path}", routes.model, methods=["GET"]),
            Route("/health", routes.health, methods=["GET"]),
            Route("/metrics", routes.metrics, methods=["GET"]),
        ],
        lifespan=_lifespan(serving, wait_for_load=config.wait_for_load),
        middleware=access_middleware(access, lambda reason: serving.metrics.rejected.labels(reason).inc()),
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
    )
    app.state.serving = serving
    app.state.access = access  # the checked rules (their repr leaves the keys out)
    return app


class _Routes:
    """The app's endpoints over one :class:`~specdec_rt.serve.state.Serving`."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.created = int(time.time())

    async def chat(self, request: Request) -> Response | EventStream:
        return await completions(request, "chat")

    async def completion(self, request: Request) -> Response | EventStream:
        return await completions(request, "completion")

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse(models_body(self.serving.model_name or "specdec-rt", self.created, self.serving.loaded))

    async def model(self, request: Request) -> JSONResponse:
        name = self.serving.model_name or "specdec-rt"
        if request.path_params["model"] != name:
            return error_response(
                APIError(
                    404,
                    f"the model {request.path_params['model']!r} does not exist (this server has {name!r})",
                    code="model_not_found",
                    param="model",
                )
            )
        return JSONResponse(models_body(name, self.created, self.serving.loaded)["data"][0])

    async def health(self, request: Request) -> JSONResponse:
        serving = self.serving
        return JSONResponse(
            {
                "status": "ok" if serving.state == "ready" else serving.state,
                "model": serving.model_name,
                "admitted": serving.admitted,
            },
            status_code=200 if serving.state == "ready" else 503,
        )

    async def metrics(self, request: Request) -> Response:
        metrics = self.serving.metrics
        await anyio.to_thread.run_sync(metrics.memory.refresh)  # reads /proc/self/smaps: off the loop
        body, content_type = metrics.render(request.headers.get("accept"))
        return Response(body, headers={"content-type": content_type})


def _lifespan(serving: Serving, *, wait_for_load: bool) -> Callable[[Starlette], AbstractAsyncContextManager[None]]:
    """The app's lifespan: load the engine (first, with ``wait_for_load``; else in the
    background while the server listens), then at shutdown drain and close it."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if wait_for_load and serving.state == "loading":
            await serving.load()
            _check_loaded(serving)
        serving.start_watch()
        async with anyio.create_task_group() as tg:
            tg.start_soon(serving.end_jobs_after_drain)
            if serving.state == "loading":
                tg.start_soon(serving.load)  # the server listens meanwhile: /health says loading
            try:
                yield
            finally:
                serving.begin_drain()
                tg.cancel_scope.cancel()  # a load still running is abandoned
        await serving.shutdown()

    return lifespan


def _check_loaded(serving: Serving) -> None:
    """A RuntimeError (the server does not start) when the model did not load."""
    if serving.state != "ready":
        raise RuntimeError(f"the model did not load (state {serving.state!r}); see the log")


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)  # registered for HTTPException alone (starlette types it Exception)
    err = APIError(
        exc.status_code,
        str(exc.detail),
        code="not_found" if exc.status_code == 404 else None,
        headers=dict(exc.headers or {}),
    )  # e.g. a 405's Allow
    return error_response(err)


async def _server_error(request: Request, exc: Exception) -> Response:
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), status_code=500)


def begin_drain(app: Starlette) -> None:
    """Stop taking requests (503, ``/health`` 503); admitted ones finish. The CLI calls this on
    SIGTERM, before uvicorn waits for the running requests and runs the lifespan shutdown."""
    app.state.serving.begin_drain()
