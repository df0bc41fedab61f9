"""One completion request from body to last byte: admission, the engine stream, the deadline,
client disconnects, metrics and the per-request log event.

The engine stream is always closed (``aclose``, shielded from cancellation) when the response
ends, however it ends, so the request's KV slots are released at once; a client that disconnects
cancels its generation (streaming or not) without waiting for the next token to be sent.
"""

from __future__ import annotations

import json
from time import perf_counter
from typing import Any

import anyio
import anyio.lowlevel
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from ..errors import ContextLengthError, EngineClosedError, InvalidInputError, SpecDecError
from ..logs import get_logger
from .protocol import APIError, GenParams, Kind, Reply, engine_error, parse_request, sse
from .state import Serving

__all__ = ["completions", "error_response"]

log = get_logger("specdec_rt.serve")
REJECT_REASONS = {400: "invalid", 413: "too_large", 429: "overloaded"}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON; 413 past ``limit`` bytes, told by Content-Length or found while reading."""
    too_large = APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    try:
        return json.loads(body)
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # e.g. 100,000 nested brackets
        raise APIError(400, "the request body is not valid JSON: nested too deeply", code="invalid_json") from None


async def completions(request: Request, kind: Kind) -> Any:
    """``POST /v1/chat/completions`` (``kind="chat"``) and ``POST /v1/completions``."""
    serving: Serving = request.app.state.serving
    arrived = perf_counter()
    try:
        serving.check_open()
        params = parse_request(kind, await read_json(request, serving.max_body_bytes))
        serving.admit()
    except APIError as err:
        serving.metrics.rejected.labels(REJECT_REASONS.get(err.status, err.code)).inc()
        return error_response(err)
    except ClientDisconnect:
        return Response(status_code=499)  # nobody is there to read it
    stream = None
    try:  # from here on the request is admitted: Job.close releases it
        stream = await _open(serving, params)
    except (InvalidInputError, EngineClosedError) as exc:
        if stream is not None:
            await stream.aclose()
        serving.release()
        err = (engine_error(exc, params) if isinstance(exc, InvalidInputError) else
               APIError(503, str(exc), type="service_unavailable", code="draining"))
        serving.metrics.rejected.labels("invalid" if err.status == 400 else "draining").inc()
        return error_response(err)
    except BaseException:
        if stream is not None:
            await stream.aclose()
        serving.release()
        raise
    job = Job(serving, params, stream, arrived)
    if params.stream:
        return EventStream(job)
    return await job.respond_whole(request.receive)


async def _open(serving: Serving, params: GenParams):
    """The engine stream of an admitted request, its prompt encoded and checked (a 400 comes
    before streaming; a stream that fails is closed here). A request that names no token limit
    gets the server's default, capped to the room its prompt leaves in the context (as OpenAI's
    API does)."""
    kwargs = params.engine_kwargs(serving.default_max_tokens)
    for capped in (False, True):
        stream = serving.engine.stream(params.prompt, **kwargs)
        if not hasattr(stream, "ready"):  # not an EngineStream: it checks as it goes
            return stream
        try:
            await stream.ready()
            return stream
        except ContextLengthError as exc:
            await stream.aclose()
            room = (exc.max_length or 0) - (exc.prompt_tokens or 0)
            if capped or params.max_tokens is not None or exc.max_length is None:
                raise
            if room < 1:  # the client named no limit: say what is too long, not the server's default
                raise ContextLengthError(f"prompt of {exc.prompt_tokens} tokens leaves no room for an answer in "
                                         f"the model's maximum length of {exc.max_length} tokens",
                                         exc.prompt_tokens, exc.max_length) from None
            kwargs["max_new_tokens"] = room
        except BaseException:
            await stream.aclose()
            raise


class Job:
    """An admitted request and its engine stream."""

    def __init__(self, serving: Serving, params: GenParams, stream, arrived: float) -> None:
        self.serving, self.params, self.stream, self.arrived = serving, params, stream, arrived
        self.reply = Reply(params.kind, serving.model_name or "specdec-rt", include_usage=params.include_usage)
        timeout = serving.request_timeout
        self.deadline = arrived + timeout if timeout else None
        self.tokens, self.stats, self.finish = 0, None, None
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.outcome: str | None = None  # cancelled | timeout | error, when it did not finish
        self.done = False  # the response is complete: a disconnect now is not a cancel
        self.closed = False
        self.expired = False  # the server's drain deadline passed (expire)
        self._scope: anyio.CancelScope | None = None  # around the wait for the engine's next event
        serving.jobs.add(self)

    async def next_event(self):
        """The engine's next event (``None`` after the last), under the request's deadline.
        Raises :class:`APIError` for a timeout (504), a model failure (500), or the server's drain
        deadline (503, :meth:`expire`)."""
        if self.expired:
            raise self._shut_down()
        ev = None
        try:
            with anyio.CancelScope() as self._scope:
                if self.deadline is None:
                    ev = await self.stream.__anext__()
                else:
                    with anyio.fail_after(max(0.0, self.deadline - perf_counter())):
                        ev = await self.stream.__anext__()
        except StopAsyncIteration:
            return None
        except TimeoutError:
            self.outcome = "timeout"
            raise APIError(504, f"the request took longer than {self.serving.request_timeout:g} s",
                           type="timeout", code="request_timeout") from None
        except EngineClosedError as exc:
            self.outcome = "error"
            raise APIError(503, str(exc), type="service_unavailable", code="draining") from None
        except SpecDecError as exc:  # InferenceError: the model failed; the engine goes on
            self.outcome = "error"
            raise APIError(500, str(exc), type="server_error", code="inference_error") from None
        finally:
            self._scope = None
        if ev is None:  # expire() cancelled the wait
            raise self._shut_down()
        self._observe(ev, perf_counter())
        return ev

    def expire(self) -> None:
        """The server's drain deadline passed: the request ends with a 503 ``draining`` error (a
        stream: one error event) at its next engine event, or at once if it is waiting for one."""
        self.expired = True
        if self._scope is not None:
            self._scope.cancel()

    def _shut_down(self) -> APIError:
        self.outcome = "shutdown"
        return APIError(503, f"the server stopped before this request finished (its drain timeout of "
                             f"{self.serving.drain_timeout:g} s passed)", type="service_unavailable", code="draining")

    def _observe(self, ev, now: float) -> None:
        m = self.serving.metrics
        if ev.token_ids:
            self.tokens += len(ev.token_ids)
            m.generation_tokens.inc(len(ev.token_ids))
            if self.first_at is None:
                self.first_at = now
                m.ttft.observe(now - self.arrived)
        if self.last_at is not None:
            m.itl.observe(now - self.last_at)
        self.last_at = now
        if ev.finished:
            self.finish = ev.finished if ev.finished in ("stop", "length") else "stop"
            self.stats = ev.stats
            if ev.stats is not None:
                m.observe_stats(ev.stats, cached=self.serving.caching)
            m.success.labels(self.finish).inc()
            m.e2e.observe(now - self.arrived)

    async def close(self) -> None:
        """Close the engine stream (releases its KV slots), un-admit, count and log. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.serving.jobs.discard(self)
        with anyio.CancelScope(shield=True):
            try:
                await self.stream.aclose()
            finally:
                self.serving.release()
        if self.finish is None:
            self.outcome = self.outcome or "cancelled"
            self.serving.metrics.aborted.labels(self.outcome).inc()
        s = self.stats
        end = perf_counter()
        log.info("request", id=self.reply.id, kind=self.params.kind, mode=s.mode if s else self.params.mode,
                 stream=self.params.stream, prompt_tokens=s.prompt_tokens if s else None,
                 cached_tokens=s.cached_prompt_tokens if s else None,
                 completion_tokens=self.tokens, acceptance=round(s.acceptance_rate, 3) if s else None,
                 finish=self.finish or self.outcome,
                 ttft=round(self.first_at - self.arrived, 4) if self.first_at else None,
                 e2e=round(end - self.arrived, 4))

    def usage(self) -> tuple[int, int, int]:
        s = self.stats
        return (s.prompt_tokens if s else 0), self.tokens, (s.cached_prompt_tokens if s else 0)

    async def respond_whole(self, receive) -> Response:
        """The non-streamed response; a disconnect meanwhile cancels the generation."""
        response: Response = Response(status_code=499)  # kept if the client went away
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch, receive, tg.cancel_scope)
                parts = []
                try:
                    while (ev := await self.next_event()) is not None:
                        parts.append(ev.text)
                    body = self.reply.response("".join(parts), self.finish or "stop", *self.usage())
                    response = JSONResponse(body)
                except APIError as err:
                    response = error_response(err)
                self.done = True
                tg.cancel_scope.cancel()
        finally:
            await self.close()
        return response

    async def _watch(self, receive, scope: anyio.CancelScope) -> None:
        """Cancel ``scope`` when the client disconnects (the body was read already)."""
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self.done:
            self.outcome = "cancelled"
            scope.cancel()


class EventStream:
    """The streamed response (server-sent events), an ASGI app: one chunk per engine event with
    text, exactly one chunk with a ``finish_reason``, the usage chunk if asked, ``data: [DONE]``.
    An error after the stream started is one ``data: {"error": ...}`` event, then the end."""

    headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]

    def __init__(self, job: Job) -> None:
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        job = self.job
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(job._watch, receive, tg.cancel_scope)

                async def send_or_cancel(message: dict) -> None:
                    try:
                        await send(message)
                    except OSError:  # a server that reports the vanished client by raising
                        job.outcome = job.outcome or "cancelled"
                        tg.cancel_scope.cancel()
                        await anyio.lowlevel.checkpoint()  # raises the cancellation

                await send_or_cancel({"type": "http.response.start", "status": 200, "headers": self.headers})
                for data in await self._events(send_or_cancel):
                    await send_or_cancel({"type": "http.response.body", "body": data, "more_body": True})
                job.done = True
                await send_or_cancel({"type": "http.response.body", "body": b"", "more_body": False})
                tg.cancel_scope.cancel()
        finally:
            await job.close()

    async def _events(self, send) -> list[bytes]:
        """Send the chunks as the engine produces them; returns what closes the stream."""
        job, reply = self.job, self.job.reply

        async def emit(payload: dict) -> None:
            await send({"type": "http.response.body", "body": sse(payload), "more_body": True})

        first = reply.kind == "chat"
        if first:  # the role comes at once, before the first token
            await emit(reply.chunk("", first=True))
        try:
            while (ev := await job.next_event()) is not None:
                if ev.text or ev.finished:
                    await emit(reply.chunk(ev.text, job.finish if ev.finished else None))
        except APIError as err:
            return [sse(err.body())]
        tail = [] if job.finish else [sse(reply.chunk("", "stop"))]  # never a stream without its finish
        if job.params.include_usage:
            tail.append(sse(reply.usage_chunk(*job.usage())))
        return tail + [sse("[DONE]")]
