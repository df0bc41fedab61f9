"""A client that stops reading a stream loses its slot after ``consumer_timeout`` whatever the
kernel's buffer defaults (issue 43, part 7): each accepted socket's send buffer is fixed
(``--send-buffer-bytes``, 64 KiB), so the server's writes block after a few hundred kB and the
timer starts then.

Before: the kernel grew a loopback connection's send buffer to megabytes (``tcp_wmem``'s
maximum, 4 MiB here), all of which a stream filled before its writes blocked; a real model at
its usual rate fills that in minutes (QA: the slot was held ~120 s with ``--consumer-timeout
5``)."""

from __future__ import annotations

import json
import socket
import time

import anyio
import pytest

pytest.importorskip("uvicorn")

from serve_util import EchoEngine, metric, metric_values, running_server  # noqa: E402

from specdec_rt.engine.stream import StreamEvent  # noqa: E402
from specdec_rt.serve import create_app  # noqa: E402
from specdec_rt.serve.connections import ConnectionLimits  # noqa: E402

TIMEOUT = 1.0  # the server's consumer_timeout
CHUNK = 8192  # characters of text an event
EVERY = 0.01  # seconds between events: ~800 kB/s, slower than loopback, like a model
SLACK = 2.0  # seconds a loaded machine may add (before: 5 s more here)


class FloodEngine(EchoEngine):
    """A model-free engine whose every stream is ``CHUNK`` characters an event, one every
    ``EVERY`` seconds, for up to ``events`` events; ``sent``: characters handed to the server,
    ``closed_at``: when a stream was closed (its slot freed), however it ended."""

    def __init__(self, events: int = 4000) -> None:
        super().__init__()
        self.events = events
        self.sent = 0
        self.closed_at: float | None = None
        self.last_event = 0.0  # when the server took the latest event

    def stream(self, prompt, params=None, /, **overrides):
        self.requests.append((prompt, params))
        return self._flood()

    async def _flood(self):
        try:
            for i in range(self.events):
                await anyio.sleep(EVERY)
                self.sent += CHUNK
                self.last_event = time.perf_counter()
                yield StreamEvent("x" * CHUNK, (), finished="length" if i == self.events - 1 else None)
        finally:
            self.closed_at = time.perf_counter()


def _stalled_request(url: str) -> socket.socket:
    """A streamed request on a plain socket with the kernel's buffer defaults, never read."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    body = json.dumps({"prompt": "hi", "max_tokens": 4000, "stream": True}).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    return sock


def test_a_client_that_stops_reading_loses_its_slot_within_the_consumer_timeout():
    """The stream is cut (``consumer_timeout``) and its slot freed within ``TIMEOUT`` + 1 s (+
    ``SLACK``) of the request, after less than 1 MiB was written for a client that reads none
    (was: ~4 MiB and ~6 s here, minutes at a real model's rate)."""
    engine = FloodEngine()
    assert ConnectionLimits().send_buffer_bytes == 65536

    async def main():
        app = create_app(engine, model_name="tiny", consumer_timeout=TIMEOUT)
        async with running_server(app) as url:
            sock = _stalled_request(url)
            start = time.perf_counter()
            try:
                with anyio.fail_after(60):
                    while engine.closed_at is None:
                        await anyio.sleep(0.02)
                held = engine.closed_at - start
                sock.settimeout(5)
                sock.recv(1)  # (the server did write to it)
            finally:
                sock.close()
            with anyio.fail_after(10):  # the app finishes its cut
                while metric(values := await _metrics(url), "specdec_requests_running") > 0:
                    await anyio.sleep(0.05)
        assert metric(values, "specdec_requests_aborted_total", reason="consumer_timeout") == 1
        assert engine.sent < (1 << 20), f"{engine.sent} bytes written before the writes blocked"
        assert TIMEOUT <= held <= TIMEOUT + 1.0 + SLACK, f"the slot was held {held:.2f} s"
        # once the writes blocked, the timer ran: the slot went within TIMEOUT + 1 s of the last event
        assert engine.closed_at - engine.last_event <= TIMEOUT + 1.0

    anyio.run(main)


def test_the_send_buffer_can_be_left_to_the_kernel():
    """``send_buffer_bytes=0``: the kernel's own (the flag's 0); a negative one is refused."""
    assert ConnectionLimits(send_buffer_bytes=0).send_buffer_bytes == 0
    with pytest.raises(Exception, match="send_buffer_bytes must be an integer >= 0"):
        ConnectionLimits(send_buffer_bytes=-1)


async def _metrics(url: str) -> dict:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        return metric_values((await c.get("/metrics")).text)
