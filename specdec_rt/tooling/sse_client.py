"""A streaming OpenAI-API client for the load test: server-sent events parsed incrementally,
one request timed chunk by chunk (TTFT, inter-chunk gaps, end-to-end, usage), errors and 429s
classified. Used by :mod:`specdec_rt.tooling.loadtest`; needs ``httpx`` (the ``serve`` extra)."""

from __future__ import annotations

import codecs
import json
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .loadtest_report import ERROR, OK, REJECTED, RequestSample

__all__ = ["SSEEvent", "SSEParser", "interpret", "one_request"]

if TYPE_CHECKING:
    import httpx


@dataclass
class SSEEvent:
    data: str
    event: str = "message"


class SSEParser:
    """Incremental server-sent-events parser: ``feed(bytes)`` returns the events completed by
    these bytes. Input may be split anywhere (inside a line, a CRLF or a UTF-8 character)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""
        self._data: list[str] = []
        self._event = ""

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        self._buf += self._decoder.decode(chunk)
        return self._lines()

    def close(self) -> list[SSEEvent]:
        """The end of the stream: a last line without its newline still counts; an event not
        closed by a blank line is dropped (the SSE rules)."""
        self._buf += self._decoder.decode(b"", final=True)
        out = self._lines()
        if self._buf:
            self._line(self._buf)
            self._buf = ""
        return out

    def _lines(self) -> list[SSEEvent]:
        out: list[SSEEvent] = []
        while True:
            i = min((j for j in (self._buf.find("\r"), self._buf.find("\n")) if j >= 0), default=-1)
            if i < 0:
                return out
            if self._buf[i] == "\r":
                if i + 1 == len(self._buf):  # a CR at the end: wait to see whether LF follows
                    return out
                end = i + 2 if self._buf[i + 1] == "\n" else i + 1
            else:
                end = i + 1
            line, self._buf = self._buf[:i], self._buf[end:]
            ev = self._line(line)
            if ev is not None:
                out.append(ev)

    def _line(self, line: str) -> SSEEvent | None:
        if not line:  # blank line: dispatch
            if not self._data:
                self._event = ""
                return None
            ev = SSEEvent("\n".join(self._data), self._event or "message")
            self._data, self._event = [], ""
            return ev
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        return None


def interpret(ev: SSEEvent) -> tuple[str, object]:
    """An OpenAI-style stream event as ``("done", None)``, ``("error", message)``,
    ``("chunk", (content, usage))``: ``content`` is the delta text ('' for role-only or
    finish chunks), ``usage`` the usage object or None."""
    if ev.data.strip() == "[DONE]":
        return "done", None
    try:
        obj = json.loads(ev.data)
    except ValueError:
        return "error", f"not JSON in the stream: {ev.data[:80]!r}"
    if ev.event == "error" or (isinstance(obj, dict) and obj.get("error")):
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        msg = err.get("message", err) if isinstance(err, dict) else err
        return "error", str(msg)
    if not isinstance(obj, dict):
        return "error", f"unexpected event: {ev.data[:80]!r}"
    content = "".join((c.get("delta") or {}).get("content") or "" for c in obj.get("choices") or ())
    return "chunk", (content, obj.get("usage"))


# ----------------------------------------------------------------------------------- prompts


def _retry_after(value: str | None) -> float | None:
    try:
        v = float(value) if value is not None else None
    except ValueError:
        return None
    return v if v is not None and math.isfinite(v) and v >= 0 else None


class _Recorder:
    """Times one stream's events into its sample: the first content chunk (TTFT), the gaps
    between content chunks, the usage chunk's completion tokens; ``done`` after ``[DONE]``."""

    def __init__(self, sample: RequestSample, t0: float) -> None:
        self.sample, self.t0 = sample, t0
        self.last: float | None = None
        self.done = False

    def on_event(self, ev: SSEEvent, now: float) -> None:
        kind, val = interpret(ev)
        if kind == "done":
            self.done = True
            return
        if kind == "error":
            raise _StreamError(str(val))
        assert isinstance(val, tuple)  # a chunk's (content, usage)
        content, usage = val
        sample = self.sample
        if content:
            sample.chunks += 1
            if self.last is None:
                sample.ttft = now - self.t0
            else:
                sample.itl.append(now - self.last)
            self.last = now
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            sample.completion_tokens = int(usage["completion_tokens"])
            sample.usage_reported = True


async def _read_stream(resp: httpx.Response, recorder: _Recorder) -> None:
    """Feed the response's events to ``recorder`` until ``data: [DONE]``; :class:`_StreamError`
    when the stream ends without it."""
    parser = SSEParser()
    async for raw in resp.aiter_bytes():
        now = time.perf_counter()
        for ev in parser.feed(raw):
            recorder.on_event(ev, now)
        if recorder.done:
            return
    for ev in parser.close():
        recorder.on_event(ev, time.perf_counter())
    if not recorder.done:
        raise _StreamError("the stream ended without data: [DONE]")


async def one_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], timeout_s: float) -> RequestSample:
    """Send one streaming chat completion and time it; never raises for HTTP or stream failures
    (they become an ``error`` sample); bounded by ``timeout_s``."""
    import anyio
    import httpx

    sample = RequestSample(mode=body.get("mode", "?"))
    t0 = time.perf_counter()
    try:
        with anyio.fail_after(timeout_s):
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
                if resp.status_code == 429:
                    await resp.aread()
                    sample.status, sample.retry_after = REJECTED, _retry_after(resp.headers.get("retry-after"))
                    sample.e2e = time.perf_counter() - t0
                    return sample
                if resp.status_code != 200:
                    text = (await resp.aread()).decode("utf-8", "replace")
                    raise _StreamError(f"HTTP {resp.status_code}: {_error_message(text)}")
                await _read_stream(resp, _Recorder(sample, t0))
        sample.e2e = time.perf_counter() - t0
        if not sample.usage_reported:
            sample.completion_tokens = sample.chunks  # a server without usage: one token per chunk, a guess
        sample.status = OK
    except _StreamError as exc:
        sample.status, sample.error, sample.e2e = ERROR, str(exc)[:200], time.perf_counter() - t0
    except TimeoutError:
        sample.status, sample.error, sample.e2e = ERROR, f"timed out after {timeout_s:g} s", time.perf_counter() - t0
    except httpx.HTTPError as exc:
        sample.status, sample.error, sample.e2e = ERROR, f"{type(exc).__name__}: {exc}"[:200], time.perf_counter() - t0
    return sample


class _StreamError(Exception):
    pass


def _error_message(text: str) -> str:
    try:
        err = json.loads(text).get("error")
        return str(err.get("message", err) if isinstance(err, dict) else err)[:160]
    except (ValueError, AttributeError):
        return text.strip()[:160]


# ----------------------------------------------------------------------------------- one phase
