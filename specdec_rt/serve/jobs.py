"""One completion request from body to last byte: admission, the engine stream, the deadline,
client disconnects, metrics and the per-request log event.

The engine stream is always closed (``aclose``, shielded from cancellation) when the response
ends, however it ends, so the request's KV slots are released at once; a client that disconnects
cancels its generation (streaming or not) without waiting for the next token to be sent. A
streamed response whose client takes no chunk for ``consumer_timeout`` seconds (it stopped
reading, and the connection's buffers are full) ends the same way: its slots are freed at once.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import json.scanner
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from ..engine.served import ServedEngine, ServedStream
from ..engine.stream import StreamEvent
from ..errors import ConsumerTimeoutError, ContextLengthError, EngineClosedError, InvalidInputError, SpecDecError
from ..logs import get_logger
from .protocol import (
    MAX_PROMPT_TOKENS,
    APIError,
    GenParams,
    Kind,
    check_prompt_logprob_work,
    engine_error,
    parse_request,
)
from .replies import LogprobsFormat, Reply, call_filter, calls_in, json_bytes, release_stepwise, sse
from .state import Serving

__all__ = ["completions", "error_response"]

if TYPE_CHECKING:
    from ..engine.engine import Prompt

log = get_logger("specdec_rt.serve")
CUT_GRACE_S = 1.0  # a stalled stream's error event: how long the connection may take to accept it
REJECT_REASONS = {400: "invalid", 413: "too_large", 415: "media_type", 429: "overloaded"}
INLINE_BODY_BYTES = 64 << 10  # bodies up to this size are parsed on the event loop, larger ones in a thread
INLINE_REPLY_ENTRIES = 4096  # whole replies with up to this many log-probability entries are built on the loop


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The body's bytes; 415 unless it is declared ``application/json`` (a parameter such as
    ``charset`` aside: a cross-site page can POST ``text/plain`` without a preflight, never
    JSON); 413 past ``limit`` bytes, told by Content-Length or found while reading."""
    media_type = request.headers.get("content-type")
    if media_type is None or media_type.partition(";")[0].strip().lower() != "application/json":
        got = "no Content-Type" if media_type is None else f"Content-Type {media_type[:100]!r}"
        raise APIError(415, f"the request body must be application/json, got {got}", code="unsupported_media_type")
    too_large = APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


def load_json(body: bytes, *, stepwise: bool = False) -> Any:
    """``body`` as JSON, or a 400 saying why it is not. ``stepwise``: with :mod:`json`'s
    reference scanner, Python code between values, so a thread parsing a big body gives the GIL
    up every few milliseconds (its C scanner holds it throughout: up to ~0.1 s for 1 MiB of
    numbers or keys, far more with the collector's passes), at 4-5 times its CPU."""
    try:
        if not stepwise:
            return json.loads(body)
        decoder = json.JSONDecoder()
        decoder.scan_once = json.scanner.py_make_scanner(decoder)  # type: ignore[attr-defined]  # typeshed omits json.scanner's py_make_scanner
        return decoder.decode(body.decode(json.detect_encoding(body), "surrogatepass"))
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # e.g. 100,000 nested brackets
        raise APIError(400, "the request body is not valid JSON: nested too deeply", code="invalid_json") from None


async def parse_body(serving: Serving, kind: Kind, body: bytes) -> GenParams:
    """The request in ``body``, checked, with at most the server's capacity of prompts. Past
    :data:`INLINE_BODY_BYTES`: in a worker thread, while the event loop only waits, parsed
    stepwise (:func:`load_json`) with the cyclic garbage collector paused (:func:`gc_paused`),
    and the parsed JSON freed there too."""
    stepwise = len(body) > INLINE_BODY_BYTES

    def parse() -> GenParams | APIError:
        with gc_paused() if stepwise else contextlib.nullcontext():
            try:
                return parse_request(
                    kind,
                    load_json(body, stepwise=stepwise),
                    max_prompts=serving.slots + serving.max_queued,
                    max_prompt_tokens=MAX_PROMPT_TOKENS,
                )
            except APIError as err:  # a copy: the error's traceback holds the frames that hold the body
                return err.copy()

    got = await anyio.to_thread.run_sync(parse) if stepwise else parse()
    if isinstance(got, APIError):
        raise got
    return got


_gc_lock = threading.Lock()
_gc_pauses = 0  # gc_paused blocks running now
_gc_was_enabled = False  # whether the collector ran before the first of them


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside (in any thread), for work that makes and frees many
    containers: a 1 MiB body holds 255,000 lists, whose allocations set off full collections of
    every object of the process, and a collection holds the GIL throughout, so the event loop's
    thread stops with it. Nested and concurrent pauses are counted; the last one to end restores
    the collector as the first one found it."""
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


async def completions(request: Request, kind: Kind) -> Response | EventStream:
    """``POST /v1/chat/completions`` (``kind="chat"``) and ``POST /v1/completions``."""
    serving: Serving = request.app.state.serving
    arrived = perf_counter()
    params = await _admit(request, serving, kind)
    if isinstance(params, Response):
        return params
    streams: list[ServedStream | None] = []
    admitted = len(params.streams)
    try:  # from here on the request is admitted: Job.close releases it
        await _open_streams(serving, params, streams, arrived)
    except (InvalidInputError, EngineClosedError, SpecDecError, APIError, TimeoutError) as exc:
        await _close_all(streams)
        serving.release(admitted)
        return _refuse_admitted(serving, _refusal(exc, params, serving.request_timeout))
    except BaseException:
        await _close_all(streams)
        serving.release(admitted)
        raise
    job = Job(serving, params, streams, arrived)
    if params.stream:
        return EventStream(job)
    return await job.respond_whole(request.receive)


async def _admit(request: Request, serving: Serving, kind: Kind) -> GenParams | Response:
    """The request's checked parameters, admitted (its slots counted); else the response that
    refuses it."""
    try:
        serving.check_open()
        params = await parse_body(serving, kind, await read_body(request, serving.max_body_bytes))
        if params.scores_prompt:  # token ids: counted now; texts: once encoded (_open_streams)
            known = sum(len(prompt) for prompt in params.prompts if isinstance(prompt, list))
            check_prompt_logprob_work(params, known, serving.max_prompt_logprob_work)
        serving.admit(params.n, len(params.prompts) or 1)
        return params
    except APIError as err:
        serving.metrics.rejected.labels(REJECT_REASONS.get(err.status, err.code)).inc()
        return error_response(err)
    except ClientDisconnect:
        return Response(status_code=499)  # nobody is there to read it


async def _open_streams(
    serving: Serving, params: GenParams, streams: list[ServedStream | None], arrived: float
) -> None:
    """Open an admitted request's engine streams into ``streams`` (None: a choice opened once
    its prompt is scored, see Job.start), under the request's deadline, which runs from its
    arrival: templating and tokenizing count."""
    timeout = serving.request_timeout
    scored = 0  # prompt tokens to score (echo with logprobs), each prompt once
    with anyio.fail_after(max(0.0, arrived + timeout - perf_counter()) if timeout else None):
        for prompt, choice in params.streams:
            if params.scores_prompt and choice > 0:
                streams.append(None)
                continue
            stream = await _open(serving, params, prompt, choice)
            streams.append(stream)
            if params.scores_prompt and choice == 0:  # its prompt's length is known now, before its scoring
                scored += _prompt_tokens(stream, prompt)
                check_prompt_logprob_work(params, scored, serving.max_prompt_logprob_work)


def _refusal(exc: Exception, params: GenParams, timeout: float | None) -> APIError:
    """The error answer of an admitted request whose streams failed to open."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidInputError):
        return engine_error(exc, params)
    if isinstance(exc, EngineClosedError):
        return APIError(503, str(exc), type="service_unavailable", code="draining")
    if isinstance(exc, SpecDecError):  # InferenceError: the tokenizer failed; the engine goes on
        return APIError(500, str(exc), type="server_error", code="inference_error")
    return APIError(504, f"the request took longer than {timeout or 0:g} s", type="timeout", code="request_timeout")


def _refuse_admitted(serving: Serving, refusal: APIError) -> JSONResponse:
    """Count and log a refusal after admission, and answer it."""
    if refusal.status in (500, 504):  # admitted, ended before its first token
        serving.metrics.aborted.labels("error" if refusal.status == 500 else "timeout").inc()
        log.warning("request.failed", status=refusal.status, error=refusal.message[:300])
    else:
        serving.metrics.rejected.labels("invalid" if refusal.status == 400 else "draining").inc()
    return error_response(refusal)


async def _close_all(streams: list[Any]) -> None:
    with anyio.CancelScope(shield=True):
        for stream in streams:
            if stream is not None:  # (None: a choice not opened yet, see Job.start)
                await stream.aclose()


def _prompt_tokens(stream: ServedStream, prompt: Prompt) -> int:
    """The length of an opened stream's prompt (an engine stream tells it once ready; token ids:
    their count; else, for engines that do not tell, 0)."""
    tokens = stream.prompt_tokens
    if tokens is not None:
        return tokens
    return len(prompt) if isinstance(prompt, list) else 0


async def _open(serving: Serving, params: GenParams, prompt: Prompt, choice: int = 0) -> ServedStream:
    """The engine stream of choice ``choice`` of ``prompt`` of an admitted request, encoded and
    checked (a 400 comes before streaming; a stream that fails is closed here). A request that
    names no token limit gets the server's default, capped to the room its prompt leaves in the
    context (as OpenAI's API does). Echo with logprobs: the prompt's first choice alone scores
    it, for all of them (:meth:`Job.scorer`)."""
    request = params.request_params(serving.default_max_tokens, choice, score_prompt=choice == 0)
    for capped in (False, True):
        stream = serving.engine.stream(prompt, request)
        try:
            await stream.ready()
            return stream
        except ContextLengthError as exc:
            await stream.aclose()
            room = (exc.max_length or 0) - (exc.prompt_tokens or 0)
            if capped or params.max_tokens is not None or exc.max_length is None:
                raise
            if room < 1:  # the client named no limit: say what is too long, not the server's default
                raise ContextLengthError(
                    f"prompt of {exc.prompt_tokens} tokens leaves no room for an answer in "
                    f"the model's maximum length of {exc.max_length} tokens",
                    exc.prompt_tokens,
                    exc.max_length,
                ) from None
            request = request.replace(max_new_tokens=room)
        except BaseException:
            await stream.aclose()
            raise
    raise AssertionError("unreachable: the capped try returns or raises")


def _text_of(engine: ServedEngine, prompt: str | Sequence[int]) -> str:
    """A prompt as echoed (completions'): a string as it is; token ids as the text they stand
    for (special tokens left out, as generated text leaves them)."""
    if isinstance(prompt, str):
        return prompt
    return b"".join(b"" if engine.is_special_token(t) else engine.token_bytes(t) for t in prompt).decode(
        "utf-8", errors="replace"
    )


class Job:
    """An admitted request and its engine streams, one per choice (``n``; usually one)."""

    def __init__(self, serving: Serving, params: GenParams, streams: list[Any], arrived: float) -> None:
        self.serving, self.params, self.streams, self.arrived = serving, params, streams, arrived
        self.reply = Reply(params.kind, serving.model_name or "specdec-rt", include_usage=params.include_usage)
        self.logprobs = (
            None
            if params.logprobs is None
            # the format, when the request asked for them
            else LogprobsFormat(params.kind, serving.engine.token_bytes, len(streams), serving.engine.is_special_token)
        )
        #: what each choice's text starts with: its prompt with ``echo`` (token ids: their text)
        texts = [
            _text_of(serving.engine, prompt) if params.echo else "" for prompt in params.prompts or [params.prompt]
        ]
        self.echo = [text for text in texts for _ in range(params.n)]
        timeout = serving.request_timeout
        self.deadline = arrived + timeout if timeout else None
        n = len(streams)
        self.tokens: list[int] = [0] * n  # per choice
        self.stats: list[Any] = [None] * n  # ... its Stats, once finished
        self.finish: list[str | None] = [None] * n  # ... its finish reason
        self.first_at: float | None = None
        self.last_at: list[float | None] = [None] * n
        # cancelled | timeout | consumer_timeout | error | shutdown, when it did not finish
        self.outcome: str | None = None
        self.done = False  # the response is complete: a disconnect now is not a cancel
        self.closed = False
        self.expired = False  # the server's drain deadline passed (expire)
        self._scope: anyio.CancelScope | None = None  # around the wait for the engine's next event
        # n > 1: the receiving end the choices' pumps send (i, event, error) to
        self._events: MemoryObjectReceiveStream[_Pumped] | None = None
        serving.jobs.add(self)

    def scorer(self, i: int) -> int:
        """The stream whose events carry stream ``i``'s prompt log-probabilities (echo with
        logprobs): its prompt's first choice, which scores the prompt for all of them."""
        return i - i % self.params.n if self.params.scores_prompt else i

    def group(self, i: int) -> range:
        """The streams that share stream ``i``'s scored prompt (``i`` alone without one)."""
        first = self.scorer(i)
        return range(first, first + self.params.n) if self.params.scores_prompt else range(i, i + 1)

    def start(self, tg: anyio.abc.TaskGroup) -> None:
        """With several choices: one task per engine stream, in ``tg`` (the response's task
        group, cancelled when the response ends), feeding :meth:`next_event`. Echo with
        logprobs: a prompt's other choices open once its first one has ended, so that they start
        from the prompt's KV in the prefix cache, the target's (which the scoring left there) and
        a draft model's (which the first choice's speculation computed) alike: opened as soon as
        the prompt is scored, each would prefill the draft model on the whole prompt again."""
        if len(self.streams) > 1:
            send: MemoryObjectSendStream[_Pumped]
            send, self._events = anyio.create_memory_object_stream(0)
            scored = {i: anyio.Event() for i in range(len(self.streams)) if self.scorer(i) == i}
            with send:
                for i in range(len(self.streams)):
                    tg.start_soon(self._pump, i, send.clone(), scored[self.scorer(i)])

    async def _pump(self, i: int, send: MemoryObjectSendStream[_Pumped], scored: anyio.Event) -> None:
        """Hand stream ``i``'s events on; ``scored``: set when its prompt's scorer ends (``i``
        itself, or the choice stream ``i`` waits for before it opens)."""
        async with send:
            try:
                if self.streams[i] is None:
                    await scored.wait()
                    prompt, choice = self.params.streams[i]
                    stream = await _open(self.serving, self.params, prompt, choice)
                    if self.closed:  # ended meanwhile (a stalled client's stream): not to be kept
                        await _close_all([stream])
                        return
                    self.streams[i] = stream
                try:
                    async for ev in self.streams[i]:
                        await send.send((i, ev, None))
                finally:
                    scored.set()
            except SpecDecError as exc:
                await send.send((i, None, exc))

    async def _next(self) -> tuple[int, StreamEvent] | None:
        """``(choice, event)`` from whichever stream has one, or ``None`` after the last."""
        if self._events is None:
            try:
                return 0, await self.streams[0].__anext__()
            except StopAsyncIteration:
                return None
        try:
            i, ev, exc = await self._events.receive()
        except anyio.EndOfStream:
            return None
        if exc is not None:
            raise exc
        assert ev is not None  # (an event or an error)
        return i, ev

    async def next_event(self) -> tuple[int, StreamEvent] | None:
        """The engines' next ``(choice, event)`` (``None`` after the last), under the request's
        deadline. Raises :class:`APIError` for a timeout (504), a model failure (500), or the
        server's drain deadline (503, :meth:`expire`)."""
        if self.expired:
            raise self._shut_down()
        got = cancelled = None
        try:
            with anyio.CancelScope() as self._scope:
                cancelled = True
                if self.deadline is None:
                    got = await self._next()
                else:
                    with anyio.fail_after(max(0.0, self.deadline - perf_counter())):
                        got = await self._next()
                cancelled = False
        except TimeoutError:
            self.outcome = "timeout"
            raise APIError(
                504,
                f"the request took longer than {self.serving.request_timeout:g} s",
                type="timeout",
                code="request_timeout",
            ) from None
        except ConsumerTimeoutError as exc:  # the engine's own limit: this server took no event for that long
            self.outcome = "consumer_timeout"
            raise APIError(408, str(exc), type="timeout", code="consumer_timeout") from None
        except EngineClosedError as exc:
            self.outcome = "error"
            raise APIError(503, str(exc), type="service_unavailable", code="draining") from None
        except InvalidInputError as exc:  # found while generating: a response format's grammar that gives up
            self.outcome = "error"
            raise engine_error(exc, self.params) from None
        except SpecDecError as exc:  # InferenceError: the model failed; the engine goes on
            self.outcome = "error"
            raise APIError(500, str(exc), type="server_error", code="inference_error") from None
        finally:
            self._scope = None
        if cancelled:  # expire() cancelled the wait
            raise self._shut_down()
        if got is not None:
            self._observe(got[0], got[1], perf_counter())
        return got

    def expire(self) -> None:
        """The server's drain deadline passed: the request ends with a 503 ``draining`` error (a
        stream: one error event) at its next engine event, or at once if it is waiting for one."""
        self.expired = True
        if self._scope is not None:
            self._scope.cancel()

    def _shut_down(self) -> APIError:
        self.outcome = "shutdown"
        return APIError(
            503,
            f"the server stopped before this request finished (its drain timeout of "
            f"{self.serving.drain_timeout:g} s passed)",
            type="service_unavailable",
            code="draining",
        )

    def _observe(self, i: int, ev: StreamEvent, now: float) -> None:
        if ev.prompt_logprobs is not None:  # the echoed prompt's: nothing generated
            return
        m = self.serving.metrics
        if ev.token_ids:
            self.tokens[i] += len(ev.token_ids)
            m.generation_tokens.inc(len(ev.token_ids))
            if self.first_at is None:
                self.first_at = now
                m.ttft.observe(now - self.arrived)
        last = self.last_at[i]
        if last is not None:
            m.itl.observe(now - last)
        self.last_at[i] = now
        if ev.finished:
            self.finish[i] = ev.finished if ev.finished in ("stop", "length") else "stop"
            self.stats[i] = ev.stats
            if ev.stats is not None:
                m.observe_stats(ev.stats)
            m.success.labels(self.finish[i]).inc()
            if all(self.finish):
                m.e2e.observe(now - self.arrived)

    async def close(self) -> None:
        """Close the engine streams (releases their KV slots), un-admit, count and log. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.serving.jobs.discard(self)
        try:
            await _close_all(self.streams)  # shielded: a cancelled response still frees its slots
        finally:
            self.serving.release(len(self.streams))
        if not all(self.finish):
            self.outcome = self.outcome or "cancelled"
            self.serving.metrics.aborted.labels(self.outcome).inc()
        s = self.stats[0]
        end = perf_counter()
        log.info(
            "request",
            id=self.reply.id,
            kind=self.params.kind,
            mode=s.mode if s else self.params.mode,
            stream=self.params.stream,
            n=len(self.streams),
            prompt_tokens=s.prompt_tokens if s else None,
            cached_tokens=s.cached_prompt_tokens if s else None,
            completion_tokens=sum(self.tokens),
            acceptance=round(s.acceptance_rate, 3) if s else None,
            finish=(self.finish[0] if len(self.finish) == 1 else self.finish) if all(self.finish) else self.outcome,
            ttft=round(self.first_at - self.arrived, 4) if self.first_at else None,
            e2e=round(end - self.arrived, 4),
        )

    def usage(self) -> tuple[int, int, int]:
        """(prompt tokens, completion tokens of all choices, cached prompt tokens): each prompt
        counts once, as in OpenAI's usage, whatever ``n``."""
        n, prompt, cached = self.params.n, 0, 0
        for first in range(0, len(self.stats), n):  # a prompt's n choices are neighbours
            s = next((x for x in self.stats[first : first + n] if x is not None), None)
            prompt, cached = prompt + (s.prompt_tokens if s else 0), cached + (s.cached_prompt_tokens if s else 0)
        return prompt, sum(self.tokens), cached

    async def respond_whole(self, receive: Receive) -> Response:
        """The non-streamed response; a disconnect meanwhile cancels the generation."""
        response: Response = Response(status_code=499)  # kept if the client went away
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch, receive, tg.cancel_scope)
                self.start(tg)
                collected = _Collected.of(self.echo)
                try:
                    while (got := await self.next_event()) is not None:
                        collected.add(*got)
                    big = self._entries(collected.ids, collected.echoed) > INLINE_REPLY_ENTRIES
                    build = functools.partial(self._whole, collected, stepwise=big)
                    response = Response(
                        await anyio.to_thread.run_sync(build) if big else build(), media_type="application/json"
                    )
                except APIError as err:
                    response = error_response(err)
                self.done = True
                tg.cancel_scope.cancel()
        finally:
            await self.close()
        return response

    def _entries(self, ids: list[list[int]], echoed: list[Any]) -> int:
        """The log-probability entries of the whole reply (0 without logprobs)."""
        if self.params.logprobs is None:
            return 0
        tokens = sum(map(len, ids)) + sum(
            len(echoed[self.scorer(i)][0]) for i in range(len(ids)) if echoed[self.scorer(i)]
        )
        return tokens * (1 + self.params.logprobs)

    def _whole(self, collected: _Collected, *, stepwise: bool) -> bytes:
        """The non-streamed response's body: each prompt's scored tokens formatted once for all
        its choices (``collected.echoed``: the prompt ids and log-probabilities on each scoring stream).
        ``stepwise`` (a big reply, built in a worker thread): encoded by :func:`json_bytes`
        stepwise, the cyclic collector paused meanwhile (:func:`gc_paused`: a reply's hundreds of
        thousands of dicts set off full collections, each holding the GIL throughout)."""
        with gc_paused() if stepwise else contextlib.nullcontext():
            return self._whole_body(collected, stepwise)

    def _whole_body(self, collected: _Collected, stepwise: bool) -> bytes:
        parts, ids, lps, echoed = collected.parts, collected.ids, collected.lps, collected.echoed
        lp: list[dict[str, Any] | None] | None = None
        heads: dict[int, dict[str, Any]] = {}
        if self.logprobs is not None:
            heads = {
                i: self.logprobs.prompt(echoed[i][0], echoed[i][1], self.group(i))
                for i in range(len(ids))
                if echoed[i] is not None
            }
            lp = []
            for i, (t, e) in enumerate(zip(ids, lps)):
                tail, head = self.logprobs.body(t, e, i), heads.get(self.scorer(i))
                lp.append(tail if head is None else {k: head[k] + tail[k] for k in head})
        texts = ["".join(p) for p in parts]
        calls = [calls_in(self.params, t) if self.params.calls_tools else (t, []) for t in texts]
        prompt, completion, cached = self.usage()
        body = self.reply.response(
            [content for content, _ in calls],
            [f or "stop" for f in self.finish],
            prompt,
            completion,
            cached_tokens=cached,
            logprobs=lp,
            tool_calls=[c for _, c in calls],
        )
        out = json_bytes(body, stepwise=stepwise)
        if stepwise:  # (freed whole, its tree would hold the GIL for as long as it takes)
            release_stepwise([body, lp, heads])
        return out

    async def _watch(self, receive: Receive, scope: anyio.CancelScope) -> None:
        """Cancel ``scope`` when the client disconnects (the body was read already)."""
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self.done:
            self.outcome = "cancelled"
            scope.cancel()


_Pumped = tuple[int, "StreamEvent | None", "BaseException | None"]  # (choice, event, or the error that ended it)


@dataclass
class _Collected:
    """What a non-streamed request's streams produced, per stream: its text ``parts`` (the echo
    first), token ``ids``, log-probabilities (``lps``) and, with echo, ``echoed``: (prompt ids,
    their log-probabilities) on a stream that scored its prompt."""

    parts: list[list[str]]
    ids: list[list[int]]
    lps: list[list[Any]]
    echoed: list[Any]

    @classmethod
    def of(cls, echo: Sequence[str]) -> _Collected:
        """Nothing collected yet for streams whose texts start with ``echo``."""
        return cls(
            parts=[[text] for text in echo],
            ids=[[] for _ in echo],
            lps=[[] for _ in echo],
            echoed=[None] * len(echo),
        )

    def add(self, i: int, ev: StreamEvent) -> None:
        """Stream ``i``'s event ``ev``."""
        self.parts[i].append(ev.text)
        if ev.prompt_logprobs is not None:  # echo: the prompt's first
            self.echoed[i] = (ev.prompt_token_ids, ev.prompt_logprobs)
        self.ids[i] += ev.token_ids
        self.lps[i] += ev.logprobs or ()


class EventStream:
    """The streamed response (server-sent events), an ASGI app: one chunk per engine event with
    text, exactly one chunk with a ``finish_reason``, the usage chunk if asked, ``data: [DONE]``.
    An error after the stream started is one ``data: {"error": ...}`` event, then the end. A
    client that takes no chunk for the server's ``consumer_timeout`` seconds is cut off
    (:meth:`_cut`)."""

    headers = [
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"),
    ]

    def __init__(self, job: Job) -> None:
        self.job = job
        self._send: Callable[[dict[str, Any]], Awaitable[None]] | None = None  # set by _events
        self._filters: list[Any] | None = None  # tool calls: one call filter per choice

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        job = self.job
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(job._watch, receive, tg.cancel_scope)
                job.start(tg)

                async def send_or_cancel(message: dict[str, Any]) -> None:
                    try:
                        with anyio.fail_after(job.serving.consumer_timeout):  # None: no limit
                            await send(message)
                    except TimeoutError:
                        await self._cut(send, tg.cancel_scope, started=message["type"] != "http.response.start")
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

    async def _cut(self, send: Send, scope: anyio.CancelScope, started: bool = True) -> None:
        """The client took no chunk for ``consumer_timeout`` seconds (it stopped reading, and the
        connection's buffers are full): end the request and free its slots at once, then send
        an error event and the end of the stream if the connection takes them within
        :data:`CUT_GRACE_S` (a client that stopped reading does not; the server then closes the
        connection once the app returns, so the client sees its stream end without ``[DONE]``)."""
        job = self.job
        job.outcome = job.outcome or "consumer_timeout"
        await job.close()  # frees the slots now; the finally's close is then a no-op
        timeout = job.serving.consumer_timeout or 0
        err = APIError(
            408,
            f"the client took no streamed chunk for {timeout:g} s (the server's consumer_timeout); the request ended",
            type="timeout",
            code="consumer_timeout",
        )
        if started:  # (else the headers were never taken: nothing can follow them)
            with anyio.move_on_after(CUT_GRACE_S), contextlib.suppress(OSError):
                await send({"type": "http.response.body", "body": sse(err.body()), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        scope.cancel()
        await anyio.lowlevel.checkpoint()  # raises the cancellation

    def _echoed(self, i: int, ev: StreamEvent) -> list[bytes]:
        """The first chunk of each choice that shares the prompt stream ``i`` scored: the prompt's
        text and log-probabilities, formatted once (in a worker thread: a long prompt's are big)."""
        job = self.job
        assert job.logprobs is not None  # (prompt log-probabilities come only when asked)
        assert ev.prompt_token_ids is not None and ev.prompt_logprobs is not None  # (the scoring event)
        group = job.group(i)
        lp = job.logprobs.prompt(ev.prompt_token_ids, ev.prompt_logprobs, group)
        return [sse(job.reply.chunk(job.echo[j], index=j, logprobs=lp), stepwise=True) for j in group]

    async def _events(self, send: Callable[[dict[str, Any]], Awaitable[None]]) -> list[bytes]:
        """Send the chunks as the engine produces them; returns what closes the stream."""
        job, reply = self.job, self.job.reply
        self._send = send
        if reply.kind == "chat":  # each choice's role comes at once, before the first token
            for i in range(len(job.streams)):
                await self._emit(reply.chunk("", first=True, index=i))
        elif job.params.echo and job.logprobs is None:  # echo: the prompt first (with logprobs: as they come)
            for i in range(len(job.streams)):
                await self._emit(reply.chunk(job.echo[i], index=i))
        self._filters = [call_filter(job.params) for _ in job.streams] if job.params.calls_tools else None
        try:
            await self._relay()
        except APIError as err:
            return [sse(err.body())]
        tail = [
            sse(reply.chunk("", "stop", index=i))  # never a choice without its finish
            for i, f in enumerate(job.finish)
            if f is None
        ]
        if job.params.include_usage:
            tail.append(sse(reply.usage_chunk(*job.usage())))
        return tail + [sse("[DONE]")]

    async def _emit(self, payload: dict[str, Any]) -> None:
        await self._emit_bytes(sse(payload))

    async def _emit_bytes(self, data: bytes) -> None:
        assert self._send is not None
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def _relay(self) -> None:
        """Each engine event as chunks, in order; a choice whose prompt another one scores: its
        events wait for that prompt's chunk."""
        job = self.job
        held: dict[int, list[StreamEvent]] = {i: [] for i in range(len(job.streams)) if job.scorer(i) != i}
        while (got := await job.next_event()) is not None:
            i, ev = got
            if i in held:
                held[i].append(ev)
            elif ev.prompt_logprobs is not None:  # echo with logprobs
                for data in await anyio.to_thread.run_sync(self._echoed, i, ev):
                    await self._emit_bytes(data)
                for j in job.group(i):
                    for later in held.pop(j, ()):
                        await self._step(j, later)
            else:
                await self._step(i, ev)
        for j, events in held.items():  # (an engine that sent no prompt log-probabilities)
            for ev in events:
                await self._step(j, ev)

    async def _step(self, i: int, ev: StreamEvent) -> None:
        """Choice ``i``'s event as chunks; tool calls are held back and sent whole at the end."""
        job, reply, filters = self.job, self.job.reply, self._filters
        lp = None if job.logprobs is None else job.logprobs.body(ev.token_ids, ev.logprobs or (), i)
        calls: list[dict[str, Any]] = []
        text, finish = ev.text, job.finish[i] if ev.finished else None
        if filters is not None:
            text = filters[i].push(text)
            if ev.finished:
                rest, calls = filters[i].finish()
                text += rest
        if calls:
            if text or (lp is not None and ev.token_ids):
                await self._emit(reply.chunk(text, index=i, logprobs=lp))
            await self._emit(reply.chunk("", index=i, tool_calls=calls))
            await self._emit(reply.chunk("", "tool_calls" if finish == "stop" else finish, index=i, empty=True))
        elif text or ev.finished or (lp is not None and ev.token_ids):
            await self._emit(reply.chunk(text, finish, index=i, logprobs=lp))
