"""One request, one meaning (issue 43, part 6): a request that repeats a single-valued header
(``Host``, ``Content-Length``, ``Content-Type``, ``Origin``, ``Authorization``) or sends
``Content-Length`` beside ``Transfer-Encoding`` is a 400 naming the header, and its connection
is closed, on a real server; the ASGI guard refuses the same under any server; a WebSocket
never reaches the routes, and the lifespan still does.

Before: two ``Content-Type`` (or ``Origin``) headers: the first won and the request was
served; ``Content-Length`` beside ``Transfer-Encoding``: the chunks were read and the request
served; a WebSocket scope passed the guard (its key check included)."""

from __future__ import annotations

import asyncio
import json

import anyio
import httpx
import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("h11")

from serve_util import EchoEngine, client, metric, metric_values, running_server  # noqa: E402

from specdec_rt.serve import create_app  # noqa: E402
from specdec_rt.serve.guard import SiteGuard, framing_error  # noqa: E402

BODY = b'{"prompt": "hi", "max_tokens": 2}'


def _post(*extra: bytes, body: bytes = BODY, length: bool = True) -> bytes:
    head = [b"POST /v1/completions HTTP/1.1", b"Host: 127.0.0.1", b"Content-Type: application/json", *extra]
    if length:
        head.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(head) + b"\r\n\r\n" + body


async def _exchange(url: str, request: bytes, wait: float = 10.0) -> tuple[bytes, bool]:
    """Send ``request`` (no ``Connection: close``); what the server answers within ``wait``
    seconds, and whether it closed the connection by then."""
    host, port = url.split("//")[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    await writer.drain()
    got, closed = b"", False
    try:
        with anyio.move_on_after(wait):
            while chunk := await reader.read(65536):
                got += chunk
            closed = True
    finally:
        writer.close()
    return got, closed


def _error(answer: bytes) -> dict:
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]


@pytest.mark.parametrize(
    "extra, named",
    [
        ((b"Content-Type: text/plain",), "'Content-Type'"),
        ((b"Origin: http://127.0.0.1", b"Origin: http://evil.example"), "'Origin'"),
        ((b"Host: 127.0.0.1",), "'Host'"),  # (h11 refused this one already)
        ((b"Authorization: Bearer a", b"Authorization: Bearer b"), "'Authorization'"),
        ((b"Content-Length: %d" % len(BODY),), "'Content-Length'"),
        ((b"Transfer-Encoding: chunked",), "Content-Length and Transfer-Encoding"),
    ],
    ids=["content-type", "origin", "host", "authorization", "content-length", "length+chunked"],
)
def test_a_request_of_two_meanings_is_a_400_and_its_connection_closes(extra, named):
    engine = EchoEngine()

    async def main():
        app = create_app(engine, model_name="tiny")
        async with running_server(app) as url:
            body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY) if b"Transfer" in extra[0] else BODY
            answer, closed = await _exchange(url, _post(*extra, body=body))
            assert answer.startswith(b"HTTP/1.1 400 "), answer[:300]
            assert closed and b"connection: close" in answer.lower()
            error = _error(answer)
            assert named in error["message"] and error["type"] == "invalid_request_error", error
            # the next connection is served
            ok, _ = await _exchange(url, _post(b"Connection: close"))
            assert ok.startswith(b"HTTP/1.1 200 "), ok[:300]
        assert len(engine.requests) == 1

    anyio.run(main)


def test_a_content_length_list_is_a_400():
    """``Content-Length: N, N``: h11 reads it as N; one length is asked for."""

    async def main():
        async with running_server(create_app(EchoEngine(), model_name="tiny")) as url:
            answer, closed = await _exchange(
                url, _post(b"Content-Length: %d, %d" % (len(BODY), len(BODY)), length=False)
            )
        assert answer.startswith(b"HTTP/1.1 400 ") and closed, answer[:300]
        assert "Content-Length header holds a list" in _error(answer)["message"]

    anyio.run(main)


def test_the_guard_refuses_repeated_headers_under_any_server():
    """Through httpx's ASGI transport (no h11 between): the guard's own 400, counted as a
    ``framing`` refusal; one of each passes."""
    engine = EchoEngine()

    async def main():
        app = create_app(engine, model_name="tiny")
        async with client(app) as c:
            for headers, named in (
                ([("content-type", "application/json"), ("content-type", "text/plain")], "'Content-Type'"),
                ([("origin", "http://test"), ("origin", "http://evil.example")], "'Origin'"),
                ([("authorization", "Bearer a"), ("authorization", "Bearer b")], "'Authorization'"),
                ([("transfer-encoding", "chunked")], "Content-Length and Transfer-Encoding"),
            ):
                r = await c.post("/v1/completions", content=BODY, headers=httpx.Headers(headers))
                assert r.status_code == 400 and named in r.json()["error"]["message"], r.text
            r = await c.post("/v1/completions", content=BODY, headers={"content-type": "application/json"})
            assert r.status_code == 200, r.text
            values = metric_values((await c.get("/metrics")).text)
        assert metric(values, "specdec_requests_rejected_total", reason="framing") == 4
        assert len(engine.requests) == 1

    anyio.run(main)


def test_framing_error_names_the_repeated_header():
    assert framing_error([(b"host", b"a"), (b"content-type", b"x")]) is None
    assert framing_error([(b"accept", b"a"), (b"accept", b"b")]) is None  # a list header may repeat
    assert "2 'Origin' headers" in (framing_error([(b"origin", b"a"), (b"origin", b"a")]) or "")


def test_no_websocket_reaches_the_app_and_the_lifespan_does():
    """A WebSocket scope is closed unaccepted (ASGI: a 403 to the client) before the inner app
    runs; a lifespan scope passes."""
    reached: list[str] = []
    refused: list[str] = []

    async def inner(scope, receive, send):
        reached.append(scope["type"])

    guard = SiteGuard(inner, hosts=("127.0.0.1",), origins=(), refused=refused.append)

    async def main():
        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "websocket.connect"}

        ws = {"type": "websocket", "path": "/v1/models", "headers": [(b"host", b"127.0.0.1")], "query_string": b""}
        await guard(ws, receive, send)
        assert sent == [{"type": "websocket.close", "code": 1008}] and reached == [] and refused == ["framing"]
        await guard({"type": "lifespan"}, receive, send)
        assert reached == ["lifespan"]

    anyio.run(main)


def test_a_websocket_upgrade_is_served_as_plain_http():
    """The server takes no WebSocket upgrade (no route has one): the request is plain HTTP."""

    async def main():
        async with running_server(create_app(EchoEngine(), model_name="tiny")) as url:
            answer, _ = await _exchange(
                url,
                b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade, close\r\nUpgrade: websocket\r\n"
                b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
            )
        assert answer.startswith(b"HTTP/1.1 200 ") and b'"object":"list"' in answer.replace(b" ", b""), answer[:300]

    anyio.run(main)
