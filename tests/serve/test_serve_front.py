"""The front of ``serve --ray`` (specdec_rt.serve.front) without Ray: relaying to a plain local
Starlette upstream on uvicorn, or to an httpx mock."""

from __future__ import annotations

import asyncio
import json
import time

import anyio
import httpx
import pytest
from serve_util import free_port, running_server
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from specdec_rt.errors import InvalidInputError
from specdec_rt.serve.front import create_front


class Upstream:
    """A Starlette app: ``/echo`` answers what it got; ``/stream`` sends one chunk, then waits for
    ``release`` before the rest; ``closed`` is set when a stream ends, however it ends."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.closed = asyncio.Event()
        self.app = Starlette(
            routes=[
                Route("/{path:path}", self.echo, methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
            ]
        )

    async def echo(self, request: Request):
        if request.url.path == "/stream":
            return StreamingResponse(self.chunks(), media_type="text/event-stream")
        body = await request.body()
        return JSONResponse(
            {
                "method": request.method,
                "path": request.url.path,
                "query": request.url.query,
                "body": body.decode(),
                "headers": [[k, v] for k, v in request.headers.items()],
            },
            status_code=201,
            headers={"x-upstream": "yes", "keep-alive": "timeout=99"},
        )

    async def chunks(self):
        try:
            yield b"data: first\n\n"
            await self.release.wait()
            for i in range(3):
                yield f"data: {i}\n\n".encode()
        finally:
            self.closed.set()


def test_requests_and_responses_pass_through_and_streams_are_not_buffered():
    up = Upstream()

    async def main():
        async with running_server(up.app) as upstream:
            front = create_front(upstream)
            async with running_server(front, lifespan="on") as url, httpx.AsyncClient(base_url=url, timeout=10) as c:
                big = "x" * 300_000  # more than one read: the body streams up
                r = await c.put("/a/b%20c?x=1&y=%2F", content=big, headers={"x-custom": "1", "te": "trailers"})
                assert r.status_code == 201 and r.headers["x-upstream"] == "yes"
                got = r.json()
                assert (got["method"], got["path"], got["query"], got["body"]) == ("PUT", "/a/b c", "x=1&y=%2F", big)
                sent = dict(got["headers"])
                assert sent["x-custom"] == "1" and "te" not in sent
                assert sent["host"] == url.split("//")[1]  # the client's Host, for the replica's check
                assert "keep-alive" not in r.headers  # hop-by-hop: the upstream's is not passed on
                assert r.headers.get_list("server") == ["uvicorn"]  # the front's own, once
                assert (await c.delete("/")).json()["method"] == "DELETE"

                # the first chunk arrives while the upstream still holds the rest
                async with c.stream("GET", "/stream") as s:
                    assert s.headers["content-type"].startswith("text/event-stream")
                    chunks = s.aiter_raw()
                    first = await asyncio.wait_for(chunks.__anext__(), 5)
                    assert first == b"data: first\n\n" and not up.closed.is_set()
                    up.release.set()
                    rest = b"".join([c async for c in chunks])
                assert rest == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"

    anyio.run(main)


def test_a_client_that_leaves_closes_the_upstream_stream():
    """The upstream's generator ends (Ray would cancel the replica's request) soon after the
    client leaves mid-stream, although the upstream would have waited forever."""
    up = Upstream()

    async def main():
        async with running_server(up.app) as upstream:
            async with running_server(create_front(upstream), lifespan="on") as url:
                async with httpx.AsyncClient(base_url=url, timeout=10) as c:
                    async with c.stream("GET", "/stream") as s:
                        async for _ in s.aiter_raw():
                            break  # leaving the block closes the connection
                    t0 = time.perf_counter()
                    await asyncio.wait_for(up.closed.wait(), 5)
                    assert time.perf_counter() - t0 < 2
                    assert (await c.get("/again")).status_code == 201  # the front still serves

    anyio.run(main)


def test_hop_by_hop_headers_are_dropped_both_ways():
    seen: list[httpx.Request] = []

    async def ok():
        yield b"ok"

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(
            200,
            headers=[
                ("x-kept", "1"),
                ("x-listed", "gone"),
                ("connection", "x-listed"),
                ("keep-alive", "timeout=5"),
                ("proxy-authenticate", "Basic"),
                ("trailer", "x-sum"),
                ("upgrade", "h2c"),
                ("date", "Thu, 01 Jan 1970 00:00:00 GMT"),
            ],
            content=ok(),  # a stream (bytes would be read already: the front streams)
        )

    async def main():
        front = create_front("http://127.0.0.1:9", transport=httpx.MockTransport(handler))
        async with front.router.lifespan_context(front):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(front), base_url="http://t") as c:
                r = await c.post(
                    "/v1/x?q=1",
                    content=b"body",
                    headers={
                        "x-mine": "2",
                        "proxy-authorization": "Basic eA==",
                        "connection": "x-private",
                        "x-private": "no",
                        "upgrade": "websocket",
                    },
                )
        assert r.status_code == 200 and r.content == b"ok" and r.headers["x-kept"] == "1"
        for name in ("x-listed", "connection", "keep-alive", "proxy-authenticate", "trailer", "upgrade", "date"):
            assert name not in r.headers, name
        (up,) = seen
        assert str(up.url) == "http://127.0.0.1:9/v1/x?q=1" and up.method == "POST" and up.content == b"body"
        assert up.headers["x-mine"] == "2" and up.headers["host"] == "t"
        for name in ("proxy-authorization", "x-private", "upgrade"):
            assert name not in up.headers, name

    anyio.run(main)


def test_the_relay_itself_refuses_a_request_of_two_meanings():
    """Under a server without the connection limits (here httpx's ASGI transport): a repeated
    single-valued header or a length beside chunked is the relay's own 400; nothing goes up."""
    seen: list[httpx.Request] = []

    async def ok():
        yield b"ok"

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=ok())  # a stream: the front streams

    async def main():
        front = create_front("http://127.0.0.1:9", transport=httpx.MockTransport(handler))
        async with front.router.lifespan_context(front):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(front), base_url="http://t") as c:
                for headers, named in (
                    ([("origin", "http://a"), ("origin", "http://b")], "'Origin'"),
                    ([("transfer-encoding", "chunked")], "Content-Length and Transfer-Encoding"),
                ):
                    r = await c.post("/v1/x", content=b"body", headers=httpx.Headers(headers))
                    assert r.status_code == 400 and named in r.json()["error"]["message"], r.text
                assert (await c.post("/v1/x", content=b"body")).status_code == 200
        assert len(seen) == 1

    anyio.run(main)


def test_a_response_length_beside_transfer_encoding_is_not_relayed():
    """Both framings from upstream: the length does not describe what the front relays (the
    chunks, re-framed by its own uvicorn), so it is dropped with Transfer-Encoding."""

    async def ok():
        yield b"ok"

    def handler(request: httpx.Request) -> httpx.Response:
        headers = [("content-length", "999"), ("transfer-encoding", "chunked"), ("x-kept", "1")]
        return httpx.Response(200, headers=headers, content=ok())

    async def main():
        front = create_front("http://127.0.0.1:9", transport=httpx.MockTransport(handler))
        async with front.router.lifespan_context(front):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(front), base_url="http://t") as c:
                r = await c.get("/v1/models")
        assert r.status_code == 200 and r.content == b"ok" and r.headers["x-kept"] == "1"
        assert "content-length" not in r.headers and "transfer-encoding" not in r.headers

    anyio.run(main)


def test_a_body_past_the_limit_is_refused_before_it_is_relayed():
    """``max_body_bytes``: the replicas' 413 comes from the front, told by Content-Length or
    found while relaying a chunked body; Ray's proxy never gets more than the limit."""
    seen: list[bytes] = []

    async def ok():
        yield b"ok"

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.content)
        return httpx.Response(200, content=ok())  # a stream, as the front reads it

    async def chunks(n: int, size: int):
        for _ in range(n):
            yield b"x" * size

    async def main():
        front = create_front("http://127.0.0.1:9", max_body_bytes=1000, transport=httpx.MockTransport(handler))
        async with front.router.lifespan_context(front):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(front), base_url="http://t") as c:
                at_limit = await c.post("/v1/completions", content=b"x" * 1000)
                declared = await c.post("/v1/completions", content=b"x" * 1001)
                streamed = await c.post("/v1/completions", content=chunks(20, 100))  # chunked, 2,000 bytes
        assert at_limit.status_code == 200 and at_limit.content == b"ok"
        for r in (declared, streamed):
            assert r.status_code == 413, r.text
            assert r.json()["error"]["code"] == "request_too_large" and "1000 bytes" in r.json()["error"]["message"]
        assert seen == [b"x" * 1000]  # only the body within the limit went up

    anyio.run(main)


def test_an_unreachable_upstream_is_a_502_with_the_openai_error_body():
    async def main():
        async with running_server(create_front(f"http://127.0.0.1:{free_port()}"), lifespan="on") as url:
            async with httpx.AsyncClient(base_url=url, timeout=10) as c:
                r = await c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 502
        err = r.json()["error"]
        assert err["code"] == "bad_gateway" and "ConnectError" in err["message"] and err["type"] == "server_error"

    anyio.run(main)


def test_the_upstream_must_be_a_base_url():
    for bad in ("127.0.0.1:8000", "http://h:1/v1", "ftp://h:1", "http://h:1/?a=1"):
        with pytest.raises(InvalidInputError, match="upstream must be"):
            create_front(bad)


async def _raw(url: str, request: bytes) -> bytes:
    """Send ``request`` as is to the server at ``url``; what it answers until it closes."""
    host, port = url.split("//")[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


def test_no_request_target_makes_the_front_connect_elsewhere():
    """A target that is no path (it starts with ``%2F``, which uvicorn decodes to ``/`` for
    routing) was pasted after ``http://HOST:PORT`` and became the URL's authority: ``GET
    %2F@127.0.0.1:PORT/x`` made the front fetch another server's page for any client (was: 200
    with the other server's body). Such targets are 400 now; ``//host/x`` stays a path."""
    up = Upstream()
    contacted: list[bytes] = []

    async def decoy_handler(reader, writer):
        contacted.append(await reader.read(200))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\ndecoy")
        writer.close()

    async def main():
        decoy = await asyncio.start_server(decoy_handler, "127.0.0.1", 0)
        other = f"127.0.0.1:{decoy.sockets[0].getsockname()[1]}"
        async with decoy, running_server(up.app) as upstream:
            async with running_server(create_front(upstream), lifespan="on") as url:
                for target in (f"%2F@{other}/x", f"%2f%2f{other}/x", f"%2F%2F@{other}/x", f"%2F:1@{other}/x"):
                    got = await _raw(url, f"GET {target} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n".encode())
                    assert got.startswith(b"HTTP/1.1 400 ") and b"invalid_request" in got, (target, got[:300])
                got = await _raw(url, f"GET http://{other}/x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n".encode())
                assert got.startswith(b"HTTP/1.1 404 "), got[:300]  # absolute form: no route, as in one process
                async with httpx.AsyncClient(base_url=url, timeout=10) as c:  # a path like a host is a path
                    got = await _raw(url, f"GET //{other}/x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n".encode())
                    assert got.startswith(b"HTTP/1.1 201 ") and f'"path":"//{other}/x"'.encode() in got, got[:300]
                    assert (await c.get("/still/serving")).status_code == 201
        assert contacted == []

    anyio.run(main)


def test_a_request_of_two_framings_is_refused_at_the_front():
    """``Content-Length`` beside ``Transfer-Encoding: chunked`` (RFC 9112 section 6.3), and a
    repeated single-valued header: the front's connection refuses them with a 400 and closes,
    and nothing reaches the upstream (was: the chunks relayed, the length dropped; the
    duplicate relayed as it came)."""
    up = Upstream()
    seen: list[str] = []
    inner = up.app

    async def counting(scope, receive, send):
        if scope["type"] == "http":
            seen.append(scope["path"])
        await inner(scope, receive, send)

    async def main():
        async with running_server(counting) as upstream:
            async with running_server(create_front(upstream), lifespan="on") as url:
                for request, header in (
                    (b"POST /both HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n"
                     b"\r\n3\r\nabc\r\n0\r\n\r\n", "Transfer-Encoding"),
                    (b"POST /dup HTTP/1.1\r\nHost: a\r\nContent-Type: text/plain\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}", "'Content-Type'"),
                ):  # fmt: skip
                    got = await _raw(url, request)  # no Connection: close: the server closes
                    assert got.startswith(b"HTTP/1.1 400 "), got[:400]
                    assert b"connection: close" in got.lower() and header.encode() in got
                assert seen == []
                r = await _raw(url, b"GET /fine HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
                assert r.startswith(b"HTTP/1.1 201 ") and seen == ["/fine"]

    anyio.run(main)


def test_the_upstream_sees_the_clients_host_and_no_forged_forwarding():
    """``Host`` goes up as the client sent it, even when ``Connection`` names it (was: dropped,
    and httpx put the upstream's own loopback address in its place, which passes a Host check),
    and none at all (HTTP/1.0) goes up empty, not as the upstream's address. ``X-Forwarded-For``
    and ``-Proto`` are the front's own (the client's address and scheme as the front sees them),
    not the client's claims (was: passed on, and Ray's proxy trusts them from 127.0.0.1, the
    front's address). httpx adds no headers of its own and keeps no cookies (was: a cookie one
    client got went up with every later client's request)."""
    up = Upstream()

    async def main():
        async with running_server(up.app) as upstream:
            async with running_server(create_front(upstream), lifespan="on") as url:
                got = await _raw(url, b"GET /h HTTP/1.1\r\nHost: evil.example\r\nConnection: close, host\r\n\r\n")
                seen = dict(json.loads(got.split(b"\r\n\r\n", 1)[1])["headers"])
                assert seen["host"] == "evil.example", seen
                got = await _raw(url, b"GET /h HTTP/1.0\r\n\r\n")
                seen = dict(json.loads(got.split(b"\r\n\r\n", 1)[1])["headers"])
                assert seen.get("host", "") == "", seen
                assert "accept-encoding" not in seen and "user-agent" not in seen  # no httpx defaults

    anyio.run(main)

    # a client elsewhere (uvicorn trusts X-Forwarded-* from loopback only: there the front's own
    # uvicorn already put them in the scope), claiming loopback; and a cookie the upstream sets
    # is not sent with the next client's request
    seen: list[httpx.Request] = []

    async def ok():
        yield b"ok"

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, headers={"set-cookie": "session=alice; Path=/"}, content=ok())

    async def remote():
        front = create_front("http://127.0.0.1:9", transport=httpx.MockTransport(handler))
        async with front.router.lifespan_context(front):
            transport = httpx.ASGITransport(front, client=("203.0.113.7", 4444))
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                forged = {"x-forwarded-for": "127.0.0.1", "x-forwarded-proto": "https"}
                assert (await c.get("/a", headers=forged)).headers["set-cookie"] == "session=alice; Path=/"
                c.cookies.clear()
                await c.get("/b")

    anyio.run(remote)
    first, second = seen
    assert first.headers.get_list("x-forwarded-for") == ["203.0.113.7"]
    assert first.headers.get_list("x-forwarded-proto") == ["http"]
    assert "cookie" not in second.headers


def test_ray_proxys_own_routes_are_not_relayed():
    """Ray's proxy answers ``/-/routes`` and ``/-/healthz`` itself, before any replica's key or
    Host check (was: through the front, the application's routes for anyone, with --api-key
    too). The front answers them 404, however the path spells them; other paths still go up."""
    up = Upstream()

    async def main():
        async with running_server(up.app) as upstream:
            async with running_server(create_front(upstream), lifespan="on") as url:
                for target in ("/-/routes", "/-/healthz", "/%2D/healthz", "/v1/../-/routes", "/-%2Froutes"):
                    got = await _raw(url, f"GET {target} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n".encode())
                    assert got.startswith(b"HTTP/1.1 404 ") and b'"not_found"' in got, (target, got[:300])
                async with httpx.AsyncClient(base_url=url, timeout=10) as c:
                    assert (await c.get("/-/other")).status_code == 201
                    assert (await c.get("/health")).status_code == 201

    anyio.run(main)
