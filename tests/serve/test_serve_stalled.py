"""Stalled readers through the real server (issue 35, item 6) and the free-slot gauge (item 7):
a client that stops reading a stream loses it after ``consumer_timeout`` and its slot goes to
the next request; a slow reader that keeps taking chunks is not cut; ``specdec_kv_slots_free``
follows the requests that hold a slot."""

from __future__ import annotations

import json
import socket
import time

import anyio
import pytest

pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from serve_util import metric, metric_values, running_server  # noqa: E402

from specdec_rt import Engine  # noqa: E402
from specdec_rt.serve import create_app  # noqa: E402

pytestmark = pytest.mark.export

# big chunks (20 alternatives a token, ~1.5 kB of JSON each) for as many tokens as the tiny
# model's context holds: far more than a connection's buffers take from a client that stops reading
BIG = {
    "messages": [{"role": "user", "content": "Hi"}],
    "max_tokens": 400,
    "ignore_eos": True,
    "logprobs": True,
    "top_logprobs": 20,
    "stream": True,
    "temperature": 0,
    "mode": "ar",
}


def small_buffer_server(app, sndbuf: int = 16384):
    """serve_util.running_server with a small fixed send buffer: the kernel would otherwise grow
    it to megabytes on loopback, more than the tiny model's whole answer. Yields the base URL."""
    return running_server(app, sndbuf=sndbuf)


def _raw_request(url: str, body: dict, rcvbuf: int = 4096) -> socket.socket:
    """A streamed request on a plain socket with a small receive buffer, nothing read yet."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: the window stays small
    sock.settimeout(30)
    sock.connect((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s:%s\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (host.encode(), port.encode(), len(data), data)
    )
    return sock


async def _metrics(client) -> dict:
    return metric_values((await client.get("/metrics")).text)


async def _read_to_end(sock: socket.socket, chunk: int = 65536, pause: float = 0.0) -> bytes:
    """Everything the server sends until it closes the connection or ends the chunked body."""

    def read() -> bytes:
        out = bytearray()
        while not out.endswith(b"0\r\n\r\n"):
            got = sock.recv(chunk)
            if not got:
                break
            out += got
            if pause:
                time.sleep(pause)
        return bytes(out)

    return await anyio.to_thread.run_sync(read)


def test_a_client_that_stops_reading_loses_its_stream_and_the_next_request_gets_the_slot(tiny_llama):
    timeout = 1.0

    async def main():
        async with await Engine.load(tiny_llama, slots=1, consumer_timeout=timeout, warmup=False) as engine:
            app = create_app(engine, model_name="tiny", consumer_timeout=timeout)
            async with small_buffer_server(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
                values = await _metrics(client)
                assert metric(values, "specdec_kv_slots_free") == 1
                stalled = _raw_request(url, BIG)
                try:
                    start = time.perf_counter()
                    with anyio.fail_after(20):  # the request ends, its slot is free again
                        while (
                            metric(
                                values := await _metrics(client),
                                "specdec_requests_aborted_total",
                                reason="consumer_timeout",
                            )
                            < 1
                        ):
                            await anyio.sleep(0.05)
                    cut_after = time.perf_counter() - start
                    assert cut_after >= timeout
                    assert metric(values, "specdec_kv_slots_free") == 1
                    assert metric(values, "specdec_requests_running") == 0
                    assert metric(values, "specdec_request_success_total", finished_reason="length") == 0
                    r = await client.post(
                        "/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 4, "mode": "ar"}
                    )
                    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
                    # the client reads again: what was sent before the cut, then the end of the
                    # connection, without the end of the stream
                    with anyio.fail_after(30):
                        raw = await _read_to_end(stalled)
                finally:
                    stalled.close()
                assert raw.startswith(b"HTTP/1.1 200") and b"data: {" in raw
                assert b"[DONE]" not in raw and b'"finish_reason":"length"' not in raw.replace(b" ", b"")
                if raw.endswith(b"0\r\n\r\n"):  # the connection took the error event after all
                    error = json.loads(raw.rsplit(b"data: ", 1)[1].split(b"\n\n")[0])["error"]
                    assert error["code"] == "consumer_timeout" and "took no streamed chunk for 1 s" in error["message"]

    anyio.run(main)


def test_the_engines_own_limit_ends_the_stream_with_an_error_event(tiny_llama):
    """A server without a limit of its own (consumer_timeout=None) over an engine with one: the
    engine ends the stalled request and frees its slot; when the client reads again, it gets
    what was sent, then one error event naming the engine's limit, then the end."""

    async def main():
        async with await Engine.load(tiny_llama, slots=1, consumer_timeout=0.5, warmup=False) as engine:
            app = create_app(engine, model_name="tiny", consumer_timeout=None)
            async with small_buffer_server(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
                sock = _raw_request(url, BIG)
                try:
                    with anyio.fail_after(20):
                        while not engine.running:  # it starts
                            await anyio.sleep(0.01)
                        start = time.perf_counter()
                        while engine.running:  # the engine ends it: its slot is free
                            await anyio.sleep(0.01)
                    assert time.perf_counter() - start >= 0.5
                    assert metric(await _metrics(client), "specdec_kv_slots_free") == 1
                    with anyio.fail_after(30):
                        raw = await _read_to_end(sock)
                finally:
                    sock.close()
                values = await _metrics(client)
        assert raw.endswith(b"0\r\n\r\n") and b"[DONE]" not in raw
        error = json.loads(raw.rsplit(b"data: ", 1)[1].split(b"\n\n")[0])["error"]
        assert error["code"] == "consumer_timeout" and error["type"] == "timeout"
        assert "consumer took no event for 0.5 s (consumer_timeout=0.5)" in error["message"]
        assert metric(values, "specdec_requests_aborted_total", reason="consumer_timeout") == 1

    anyio.run(main)


def test_a_slow_reader_that_keeps_reading_is_not_cut(tiny_llama):
    """The same big stream (~600 kB) read 4 kB at a time, 20 ms apart (~200 kB/s, slower than
    the model writes, so the connection's buffers fill and the server waits for the client),
    with consumer_timeout=2: the whole stream arrives, although it takes longer than that."""
    timeout = 2.0

    async def main():
        async with await Engine.load(tiny_llama, slots=1, consumer_timeout=timeout, warmup=False) as engine:
            app = create_app(engine, model_name="tiny", consumer_timeout=timeout)
            async with small_buffer_server(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
                sock = _raw_request(url, BIG)
                try:
                    start = time.perf_counter()
                    with anyio.fail_after(120):
                        raw = await _read_to_end(sock, chunk=4096, pause=0.02)
                    took = time.perf_counter() - start
                finally:
                    sock.close()
                values = await _metrics(client)
        assert raw.endswith(b"0\r\n\r\n") and b"data: [DONE]" in raw
        assert len(raw) > 400_000 and took > timeout, (len(raw), took)
        assert b'"finish_reason":"length"' in raw.replace(b" ", b"")
        assert metric(values, "specdec_requests_aborted_total", reason="consumer_timeout") == 0
        assert metric(values, "specdec_request_success_total", finished_reason="length") == 1

    anyio.run(main)


def test_kv_slots_free_follows_the_requests_holding_a_slot(tiny_llama):
    """slots=2, scraped through the server while requests run: 2 free; 1 and 0 as streams take
    slots (a third waits for one); still 0 when one ends and the waiting one takes its slot;
    2 once all end; 2 again after a request through the server itself."""
    long = dict(max_new_tokens=200, ignore_eos=True, mode="ar")

    async def main():
        async with await Engine.load(tiny_llama, slots=2, consumer_timeout=None, warmup=False) as engine:
            app = create_app(engine, model_name="tiny")
            async with small_buffer_server(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:

                async def free() -> tuple[float, float]:
                    values = await _metrics(client)
                    return metric(values, "specdec_kv_slots_free"), metric(values, "specdec_requests_waiting")

                seen = [await free()]
                one = engine.stream("def add(a, b):", **long)
                await one.__anext__()  # running, and kept unread: it holds its slot
                seen.append(await free())
                two = engine.stream("def add(a, b):", **long)
                await two.__anext__()
                three = engine.stream("def add(a, b):", **long)
                await anyio.sleep(0.2)  # the third is encoded, and waits for a slot
                seen.append(await free())
                await one.aclose()
                await three.__anext__()  # it got the freed slot
                seen.append(await free())
                await two.aclose()
                await three.aclose()
                await anyio.sleep(0.05)  # (slots are freed on the next event-loop pass)
                seen.append(await free())
                r = await client.post(
                    "/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 4, "mode": "ar"}
                )
                assert r.status_code == 200
                seen.append(await free())
        assert seen == [(2, 0), (1, 0), (0, 1), (0, 0), (2, 0), (2, 0)]

    anyio.run(main)
