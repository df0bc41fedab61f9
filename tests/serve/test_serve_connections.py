"""Connection limits on a real listening server (``python -m specdec_rt serve`` on loopback, a
tiny model, short deadlines): partial headers and slow bodies are cut off within their
deadlines, connections beyond the cap are refused, idle kept-alive ones are closed, header floods
get 431 (or a closed connection), and the server's memory stays near its baseline.

Before (QA, issue 35): 100 connections sending partial headers, slow bodies or nothing were all
open after 70 s; 105 MiB of headers were answered 200 and the server kept 280 MB more."""

from __future__ import annotations

import argparse
import contextlib
import math
import select
import socket
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("h11")

from serve_util import start_serve  # noqa: E402

pytestmark = pytest.mark.export

HEADER_TIMEOUT, BODY_TIMEOUT, KEEP_ALIVE, MAX_CONNECTIONS = 1.0, 2.0, 1.0, 8
SLACK = 4.0  # seconds a loaded 2-core machine may add to a deadline
HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


@pytest.fixture(scope="module")
def server(tiny_llama):
    """(port, pid) of ``serve`` with short deadlines, stopped with SIGTERM at the end."""
    run = start_serve(tiny_llama, "--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT),
                      "--keep-alive-timeout", str(KEEP_ALIVE), "--max-connections", str(MAX_CONNECTIONS))  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not _answer(run.port, HEALTH).startswith(b"HTTP/1.1 200"):  # until the model is loaded
            assert run.proc.poll() is None and time.monotonic() < deadline, run.log
            time.sleep(0.1)
        yield run.port, run.proc.pid
        log = run.stop()
        assert "Traceback" not in log, log
    finally:
        run.kill()


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _answer(port: int, request: bytes) -> bytes:
    """What the server answers ``request`` on a new connection, until it closes it (b"" if it
    cannot be reached)."""
    try:
        with _connect(port) as s:
            s.sendall(request.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1))
            return _read_until_closed(s, 30)[0]
    except OSError:
        return b""


def _read_until_closed(s: socket.socket, limit: float, drip: bytes = b"", every: float = 0.25) -> tuple[bytes, float]:
    """Read until the server closes ``s`` (or ``limit`` seconds pass: then ``inf``), sending
    ``drip`` every ``every`` seconds meanwhile; returns what it sent and when it closed, in
    seconds from the call. A reset counts as closed."""
    start, got = time.monotonic(), b""
    while time.monotonic() - start < limit:
        readable, _, _ = select.select([s], [], [], every)
        if readable:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                return got, time.monotonic() - start
            if not chunk:
                return got, time.monotonic() - start
            got += chunk
        elif drip:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the next recv says so
                s.sendall(drip)
    return got, math.inf


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def test_partial_headers_are_cut_off_at_the_header_timeout(server):
    """A header byte every 0.25 s, never the blank line: a 408 and closed after the deadline,
    which runs from the connection, not from the latest byte."""
    port, _ = server
    with _connect(port) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        got, closed = _read_until_closed(s, HEADER_TIMEOUT + SLACK, drip=b"a")
    assert HEADER_TIMEOUT * 0.9 <= closed <= HEADER_TIMEOUT + SLACK, closed
    assert got.startswith(b"HTTP/1.1 408 ") and b"--header-timeout" in got, got


def test_a_silent_connection_is_closed_at_the_header_timeout(server):
    port, _ = server
    with _connect(port) as s:
        got, closed = _read_until_closed(s, HEADER_TIMEOUT + SLACK)
    assert HEADER_TIMEOUT * 0.9 <= closed <= HEADER_TIMEOUT + SLACK, closed
    assert got.startswith(b"HTTP/1.1 408 "), got


def test_a_slow_body_is_cut_off_at_the_body_timeout(server):
    """A byte every 0.5 s of a 100-byte body: a 408 from the server (the app never answered)
    once the body deadline passed."""
    port, _ = server
    with _connect(port) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )
        got, closed = _read_until_closed(s, BODY_TIMEOUT + SLACK, drip=b" ", every=0.5)
    assert BODY_TIMEOUT * 0.9 <= closed <= BODY_TIMEOUT + SLACK, closed
    assert got.startswith(b"HTTP/1.1 408 ") and b"--body-timeout" in got, got


def test_an_idle_kept_alive_connection_is_closed_at_the_keep_alive_timeout(server):
    port, _ = server
    with _connect(port) as s:
        got = b""
        for n in (1, 2):  # the same connection serves two requests, then sits idle
            s.sendall(HEALTH)
            while got.count(b"HTTP/1.1 200 ") < n or not got.endswith(b"}"):
                got += s.recv(65536)
        rest, closed = _read_until_closed(s, KEEP_ALIVE + SLACK)
    assert closed <= KEEP_ALIVE + SLACK, closed
    assert rest == b"", rest  # closed without an answer (no 408: it sent nothing)


def test_connections_beyond_the_cap_are_refused_until_some_close(server):
    """MAX_CONNECTIONS silent connections held open: one more gets a 503 and is closed at once;
    after the header timeout has closed the silent ones, a new connection is served."""
    port, _ = server
    held = [_connect(port) for _ in range(MAX_CONNECTIONS)]
    try:
        with _connect(port) as extra:
            got, _ = _read_until_closed(extra, HEADER_TIMEOUT + SLACK)
        assert got.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in got, got
        for s in held:  # the silent ones: each closed by the header deadline
            assert _read_until_closed(s, HEADER_TIMEOUT + SLACK)[1] <= HEADER_TIMEOUT + SLACK
    finally:
        for s in held:
            s.close()
    assert _answer(port, HEALTH).startswith(b"HTTP/1.1 200 ")


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param(b"".join(b"X-Filler-%d: %s\r\n" % (i, b"a" * 1000) for i in range(1048)), id="1MiB-of-headers"),
        pytest.param(b"X-Big: " + b"a" * (1 << 20) + b"\r\n", id="one-1MiB-header"),
        pytest.param(b"".join(b"X-H%d: v\r\n" % i for i in range(150)), id="150-headers"),
    ],
)
def test_header_floods_are_refused(server, headers):
    """431 (or a connection closed while the client still sends); the server answers on."""
    port, _ = server
    got = _answer(port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + headers + b"\r\n")
    assert got == b"" or got.startswith(b"HTTP/1.1 431 "), got[:200]
    if len(headers) < 65536:  # a small request is read whole: its 431 cannot be lost to a reset
        assert got.startswith(b"HTTP/1.1 431 ") and b"--max-headers" in got, got
    assert _answer(port, HEALTH).startswith(b"HTTP/1.1 200 ")


def test_memory_returns_near_its_baseline_after_floods_and_slow_clients(server):
    """24 header floods of 1 MiB (8 at once) and 8 partial-header connections: the server's RSS
    ends within 24 MiB of where it started (105 MiB of headers once kept 280 MB)."""
    port, pid = server
    for _ in range(3):
        _answer(port, HEALTH)
    baseline = _rss_kib(pid)
    line = b"X-Filler: " + b"a" * 1014 + b"\r\n"  # 1 KiB

    def send_flood() -> None:
        with contextlib.suppress(OSError), _connect(port) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            for _ in range(1024):  # 1 MiB, or until the server closes the connection
                s.sendall(line)
            _read_until_closed(s, 10)

    for _ in range(3):
        threads = [threading.Thread(target=send_flood) for _ in range(MAX_CONNECTIONS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    slow = [_connect(port) for _ in range(MAX_CONNECTIONS)]
    for s in slow:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: aaaa")
    for s in slow:
        _read_until_closed(s, HEADER_TIMEOUT + SLACK)
        s.close()
    assert _answer(port, HEALTH).startswith(b"HTTP/1.1 200 ")
    grown = _rss_kib(pid) - baseline
    assert grown < 24 * 1024, f"RSS grew by {grown} KiB"


def test_the_flags_default_to_the_limits_defaults_and_bad_limits_are_named():
    from specdec_rt.errors import InvalidInputError
    from specdec_rt.serve.cli import add_serve_parser
    from specdec_rt.serve.connections import ConnectionLimits

    args = add_serve_parser(argparse.ArgumentParser().add_subparsers()).parse_args([])
    defaults = ConnectionLimits()
    for name in (
        "header_timeout",
        "body_timeout",
        "max_header_bytes",
        "max_headers",
        "max_connections",
        "keep_alive_timeout",
        "max_connections_per_client",
        "send_buffer_bytes",
    ):
        assert getattr(args, name) == getattr(defaults, name), name
    for bad in (
        {"header_timeout": 0},
        {"body_timeout": math.inf},
        {"max_headers": 0},
        {"max_connections": True},
        {"keep_alive_timeout": -1.0},
        {"max_connections_per_client": -1},
        {"send_buffer_bytes": 1.5},
    ):
        with pytest.raises(InvalidInputError, match=next(iter(bad))):
            ConnectionLimits(**bad)
