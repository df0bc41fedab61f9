"""``create_app``: the Starlette app of the OpenAI-compatible server.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics``. Errors, including 404 and 405, carry the OpenAI error body.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..engine.engine import DEFAULT_CONSUMER_TIMEOUT
from .guard import Access, access_middleware
from .jobs import completions, error_response
from .protocol import DEFAULT_PROMPT_LOGPROB_WORK, APIError, error_body
from .replies import models_body
from .state import Serving

__all__ = ["create_app", "begin_drain"]


def create_app(
    engine_or_loader: Any,
    *,
    slots: int | None = None,
    max_queued: int = 16,
    model_name: str | None = None,
    request_timeout: float | None = 600.0,
    max_body_bytes: int = 1 << 20,
    default_max_tokens: int = 256,
    retry_after: int = 1,
    wait_for_load: bool = False,
    drain_timeout: float | None = None,
    api_keys: Sequence[str] = (),
    allowed_hosts: Sequence[str] | None = None,
    allowed_origins: Sequence[str] = (),
    consumer_timeout: float | None = DEFAULT_CONSUMER_TIMEOUT,
    max_prompt_logprob_work: int | None = DEFAULT_PROMPT_LOGPROB_WORK,
) -> Starlette:
    """The ASGI app.

    ``engine_or_loader``: a loaded :class:`~specdec_rt.Engine` (the app is ready at once and
    never closes it), or an async callable that returns one: the app's lifespan loads it in the
    background at startup (``/health`` and the completion routes answer 503 until then) and
    closes it at shutdown. ``slots``: requests generating at once (default: the engine's
    ``slots``, else 4; give the engine the same number); ``max_queued``: admitted requests
    waiting for a slot; past ``slots + max_queued`` a request gets 429 with ``Retry-After``. ``request_timeout``: seconds per request, queueing
    included (504 after; ``None``: no limit). ``max_body_bytes``: larger bodies get 413.
    ``default_max_tokens``: for requests without ``max_tokens``. ``app.state.serving`` holds the
    state; :func:`begin_drain` starts a graceful shutdown. ``wait_for_load``: the lifespan
    startup returns only once the engine is loaded, and fails if it cannot be (for hosts that
    route to an app only after its startup, such as a Ray Serve replica). ``drain_timeout``:
    seconds admitted requests get once draining began; those still running then end with a 503
    ``draining`` error (a stream: one error event) instead of being cut off (``None``: no limit).
    ``consumer_timeout``: seconds a streamed response may wait for its client to take a chunk
    (default 30): past that the request ends and frees its slot at once, and the client's
    stream ends (with an error event if the connection still takes one); ``None`` or ``0``: no
    limit. Give a loaded engine the same (its own ``consumer_timeout``; the CLI does).
    ``max_prompt_logprob_work``: a completion with ``echo`` and ``logprobs`` may ask for at most
    this many prompt log-probability entries, prompt tokens x (1 + ``logprobs``) x ``n``
    (400 past it, before its prompt is scored; ``None``: no limit).

    Access (:mod:`specdec_rt.serve.guard`): ``api_keys``: every route but ``/health`` needs
    ``Authorization: Bearer <one of them>`` (401 otherwise; none: no key needed).
    ``allowed_hosts``: the ``Host`` names the app answers to, others get 421 (``None``: any, for an
    app behind a proxy that checks them; ``guard.host_names`` gives the CLI's list).
    ``allowed_origins``: web origins whose pages may call the app, with CORS answers; a request
    with any other ``Origin`` gets 403. The JSON routes take ``application/json`` only (415).
    """
    access = Access.checked(api_keys, allowed_hosts, allowed_origins)
    if slots is None:
        slots = getattr(engine_or_loader, "slots", None)
        slots = slots if isinstance(slots, int) else 4
    serving = Serving(
        engine_or_loader,
        slots=slots,
        max_queued=max_queued,
        model_name=model_name,
        request_timeout=request_timeout,
        max_body_bytes=max_body_bytes,
        default_max_tokens=default_max_tokens,
        retry_after=retry_after,
        drain_timeout=drain_timeout,
        consumer_timeout=consumer_timeout,
        max_prompt_logprob_work=max_prompt_logprob_work,
    )
    created = int(time.time())

    async def chat(request: Request) -> Any:
        return await completions(request, "chat")

    async def completion(request: Request) -> Any:
        return await completions(request, "completion")

    async def models(request: Request) -> JSONResponse:
        return JSONResponse(models_body(serving.model_name or "specdec-rt", created, serving.engine))

    async def model(request: Request) -> JSONResponse:
        name = serving.model_name or "specdec-rt"
        if request.path_params["model"] != name:
            return error_response(
                APIError(
                    404,
                    f"the model {request.path_params['model']!r} does not exist (this server has {name!r})",
                    code="model_not_found",
                    param="model",
                )
            )
        return JSONResponse(models_body(name, created, serving.engine)["data"][0])

    async def health(request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "status": "ok" if serving.state == "ready" else serving.state,
                "model": serving.model_name,
                "admitted": serving.admitted,
            },
            status_code=200 if serving.state == "ready" else 503,
        )

    async def metrics(request: Request) -> Response:
        body, content_type = serving.metrics.render(request.headers.get("accept"))
        return Response(body, headers={"content-type": content_type})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        if wait_for_load and serving.state == "loading":
            await serving.load()
            if serving.state != "ready":
                raise RuntimeError(f"the model did not load (state {serving.state!r}); see the log")
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

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)  # registered for HTTPException alone (starlette types it Exception)
        err = APIError(
            exc.status_code,
            str(exc.detail),
            code="not_found" if exc.status_code == 404 else None,
            headers=dict(exc.headers or {}),
        )  # e.g. a 405's Allow
        return error_response(err)

    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), status_code=500)

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completion, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", model, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        lifespan=lifespan,
        middleware=access_middleware(access, lambda reason: serving.metrics.rejected.labels(reason).inc()),
        exception_handlers={HTTPException: http_error, Exception: server_error},
    )
    app.state.serving = serving
    app.state.access = access  # the checked rules (their repr leaves the keys out)
    return app


def begin_drain(app: Starlette) -> None:
    """Stop taking requests (503, ``/health`` 503); admitted ones finish. The CLI calls this on
    SIGTERM, before uvicorn waits for the running requests and runs the lifespan shutdown."""
    app.state.serving.begin_drain()
