"""Helpers for the server tests: engine wrappers (public Engine API only), SSE and Prometheus
parsing, an in-process uvicorn on a free port, and ``python -m specdec_rt serve`` as a process."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio


class WrappedEngine:
    """Delegates to an Engine; subclasses change the event stream. Has no ``running`` /
    ``waiting`` / ``batch_listeners``, so the server counts requests itself."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.slots = engine.slots if isinstance(getattr(engine, "slots", None), int) else None
        self.manifest = engine.manifest

    @property
    def prefix_cache(self) -> dict:
        return self.engine.prefix_cache

    def stream(self, *args, **kwargs):
        inner = self.engine.stream(*args, **kwargs)  # bad arguments raise here, synchronously
        return self._events(inner)

    async def _events(self, inner):
        try:
            async for ev in inner:
                yield ev
        finally:
            await inner.aclose()


class EchoEngine:
    """A model-free engine for tests of what the server does before and around the model: each
    request's stream is one event (``text``, no token ids, finish ``"length"``); ``requests``
    keeps every ``(prompt, RequestParams)`` the server passed to ``stream``."""

    def __init__(self, text: str = "ok", slots: int = 4) -> None:
        self.text, self.slots = text, slots
        self.requests: list = []

    def stream(self, prompt, params=None, /, **overrides):
        self.requests.append((prompt, params))
        return self._events()

    async def _events(self):
        from specdec_rt.engine.stream import StreamEvent

        yield StreamEvent(self.text, (), finished="length")

    def token_bytes(self, token: int) -> bytes:  # echo of token-id prompts, logprobs
        return b"t"

    def is_special_token(self, token: int) -> bool:
        return False


class SlowEngine(WrappedEngine):
    """Each event comes ``delay`` seconds late (a slow model, deterministically)."""

    def __init__(self, engine, delay: float) -> None:
        super().__init__(engine)
        self.delay = delay
        self.closed = 0  # streams closed, however they ended

    async def _events(self, inner):
        try:
            async for ev in inner:
                await anyio.sleep(self.delay)
                yield ev
        finally:
            self.closed += 1
            await inner.aclose()


class RecordingEngine(WrappedEngine):
    """Keeps the final ``Stats`` of every request that finished."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.stats = []

    async def _events(self, inner):
        try:
            async for ev in inner:
                if ev.stats is not None:
                    self.stats.append(ev.stats)
                yield ev
        finally:
            await inner.aclose()


class FailingEngine(WrappedEngine):
    """The model fails (``InferenceError``) after ``after`` events."""

    def __init__(self, engine, after: int = 1) -> None:
        super().__init__(engine)
        self.after = after

    async def _events(self, inner):
        from specdec_rt.errors import InferenceError

        try:
            n = 0
            async for ev in inner:
                if n == self.after:
                    raise InferenceError("model call failed: RuntimeError: injected failure")
                n += 1
                yield ev
        finally:
            await inner.aclose()


def sse_data(text: str) -> list:
    """The ``data:`` payloads of an SSE body: JSON objects, and the string ``"[DONE]"``."""
    out = []
    for block in text.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metric_values(text: str) -> dict:
    """Prometheus text -> {(sample name, frozenset(labels)): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def metric(values: dict, name: str, **labels) -> float:
    return values.get((name, frozenset(labels.items())), 0.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def running_server(app, lifespan: str = "off", sndbuf: int | None = None, limits=None):
    """Real uvicorn in this event loop, with ``serve``'s connection limits (``limits``, a
    ``ConnectionLimits``; default: their defaults); yields its base URL. ``sndbuf``: the
    accepted sockets' send buffer (``send_buffer_bytes`` of the default limits), so a client
    that stops reading blocks the server soon."""
    import uvicorn

    from specdec_rt.serve.connections import ConnectionLimits, uvicorn_options

    if limits is None:
        limits = ConnectionLimits() if sndbuf is None else ConnectionLimits(send_buffer_bytes=sndbuf)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, lifespan=lifespan, log_level="warning", access_log=False, **uvicorn_options(limits))
    )
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        sock.close()


CHAT = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
PROMPT = "def add(a, b):"


def client(app):
    """An httpx client that calls the ASGI ``app`` in process."""
    import httpx

    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test", timeout=30)


def run(fn, folder, **load):
    """Run ``fn(engine)`` with a freshly loaded engine."""
    from specdec_rt import Engine

    async def main():
        async with await Engine.load(folder, **load) as engine:
            return await fn(engine)

    return anyio.run(main)


# ---------------------------------------------------------------- `python -m specdec_rt serve` as a process
REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class ServeProcess:
    """A ``python -m specdec_rt serve`` process on 127.0.0.1 and what it has printed so far."""

    proc: subprocess.Popen
    url: str  # http://127.0.0.1:PORT, from its "listening on" line
    lines: list[str]
    readers: list[threading.Thread]

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def stop(self) -> str:
        """SIGTERM, which must drain and exit 0; then (whatever happened) no process is left.
        Returns the log."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
            assert self.proc.wait(timeout=60) == 0, self.log
        finally:
            self.kill()
        return self.log

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for t in self.readers:
            t.join(timeout=5)


def start_serve(folder, *flags: str, env: dict | None = None, timeout: float = 60.0) -> ServeProcess:
    """``serve --model folder`` on a free loopback port with one slot, one thread and the
    folder's own target (``--precision exported``: no tuning at start; ``flags`` add to or
    override those), its stdout and stderr read into ``lines``; returns once it says
    where it listens (the model may still be loading: ask /health). ``env``: variables to set
    (a value of None removes one)."""
    environ = {**os.environ, "PYTHONPATH": str(REPO)}
    for key, value in (env or {}).items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value
    cmd = [sys.executable, "-m", "specdec_rt", "serve", "--model", str(folder), "--port", "0", "--slots", "1",
           "--threads", "1", "--precision", "exported", *flags]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=environ, cwd=REPO)
    lines: list[str] = []
    readers = [threading.Thread(target=lambda s=s: lines.extend(s), daemon=True) for s in (proc.stderr, proc.stdout)]
    for t in readers:
        t.start()
    run = ServeProcess(proc, "", lines, readers)
    deadline = time.monotonic() + timeout
    while not (m := re.search(r"listening on (http://[\d.]+:\d+)", run.log)):
        if proc.poll() is not None or time.monotonic() > deadline:
            run.kill()
            raise AssertionError(run.log)
        time.sleep(0.05)
    run.url = m.group(1)
    return run
