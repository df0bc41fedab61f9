"""The front of ``serve --ray``: this process's uvicorn, with the connection limits, relaying
every request to Ray Serve's proxy on loopback.

Ray Serve's proxy runs its own uvicorn (httptools), configured inside Ray
(``ray/serve/_private/http_util.py``, ``start_asgi_http_server``) with no hook for another
protocol class, so :mod:`~specdec_rt.serve.connections`' limits (header and body deadlines,
header size and count, the connection cap, keep-alive) cannot reach it. ``serve --ray`` therefore
binds Ray's proxy to 127.0.0.1 on an internal port and listens on ``--host:--port`` itself, with
the very uvicorn options of the single-process server; :func:`create_front` is the app there.
A request of two meanings (a repeated single-valued header, ``Content-Length`` beside
``Transfer-Encoding``: :func:`~specdec_rt.serve.guard.framing_error`) is a 400 there, from the
connection, or from the relay itself under another server; no WebSocket is taken.

Each request (any method, path, query string and body) goes to ``upstream`` with the same
method and headers (``Host`` included, so the replica's Host check sees what the client sent;
none goes up empty, never as the upstream's address), less the hop-by-hop ones (``Connection``
and the headers it names but ``Host``, ``Keep-Alive``, ``Transfer-Encoding``, ``TE``,
``Trailer``, ``Upgrade``, ``Proxy-*``) and the client's ``X-Forwarded-For`` / ``-Proto``: the front sends its own
(the client's address and scheme as it sees them), which Ray's proxy trusts from 127.0.0.1. The
request target must be a path: it only ever replaces the path and query of ``upstream``, so no
request makes the front connect anywhere else (a target such as ``%2F@host/``, which uvicorn
routes as ``/@host/``, is a 400). Ray's proxy's own routes (``/-/routes``, ``/-/healthz``: no
key, no Host check) are a 404 here. Nothing else is added (no httpx defaults, no cookies: the
client keeps none). The body streams up as it arrives; the response streams back chunk by chunk
(an SSE stream token by token), its status and headers passed through less the hop-by-hop ones
and ``Date`` / ``Server`` (this server writes its own). Upstream unreachable or failing before
its response starts: a 502 with the OpenAI error body.

Cancellation: a client that goes away (uvicorn's ``http.disconnect``), whether it is still
waiting for the response to start or reading its stream, cancels the relay and closes the
upstream connection; Ray's proxy sees that disconnect and cancels the replica's request, which
frees its slot as a disconnect does on the single-process server.
"""

from __future__ import annotations

import contextlib
import http.cookiejar
import json
import logging
from collections.abc import AsyncIterator

import anyio
import httpx
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ..errors import InvalidInputError
from .guard import framing_error
from .protocol import error_body

__all__ = ["create_front", "HOP_BY_HOP"]

log = logging.getLogger("specdec_rt.serve")

# RFC 9110 section 7.6.1, and the Proxy-* headers (matched by prefix)
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade"})
_FORWARDED = frozenset({b"x-forwarded-for", b"x-forwarded-proto"})  # what uvicorn's proxy_headers reads
_OWN = frozenset({b"date", b"server"})  # the front's uvicorn writes these
# paths Ray's proxy answers itself (ray/serve/_private/proxy_request_response.py), before any
# replica's key or Host check: not relayed
RAY_OWN_ROUTES = frozenset({"/-/routes", "/-/healthz"})
CONNECT_TIMEOUT_S = 10.0  # to reach the proxy; a response may take as long as --request-timeout allows


def create_front(
    upstream: str, *, max_body_bytes: int | None = None, transport: httpx.AsyncBaseTransport | None = None
) -> Starlette:
    """The ASGI app that relays every request to ``upstream`` (``http://127.0.0.1:PORT``: Ray
    Serve's proxy). ``max_body_bytes``: a body past it gets the replicas' 413 here, told by
    Content-Length or found while relaying, before Ray's proxy buffers it (None: no limit here).
    ``transport``: httpx's (tests pass a mock). Its lifespan opens and closes the one
    ``httpx.AsyncClient`` it relays with (no proxy from the environment)."""
    url = httpx.URL(upstream)
    if url.scheme not in ("http", "https") or not url.host or url.path not in ("", "/") or url.query:
        raise InvalidInputError(f"upstream must be http://HOST:PORT, got {upstream!r}")
    relay = _Relay(url, max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            trust_env=False,  # an $HTTP_PROXY must not carry loopback traffic elsewhere
            follow_redirects=False,
            cookies=http.cookiejar.CookieJar(http.cookiejar.DefaultCookiePolicy(allowed_domains=[])),  # keeps none
        ) as client:
            relay.client = client
            try:
                yield
            finally:
                relay.client = None

    return Starlette(routes=[Route("/{path:path}", relay)], lifespan=lifespan)


def _kept(headers: list[tuple[bytes, bytes]], drop: frozenset[bytes] = frozenset()) -> list[tuple[bytes, bytes]]:
    """``headers`` less the hop-by-hop ones (and those ``Connection`` names, ``Host`` aside) and
    ``drop``."""
    named = {
        token.strip().lower()
        for name, value in headers
        if name.lower() == b"connection"
        for token in value.split(b",")
        if token.strip()
    } - {b"host"}
    return [
        (name, value)
        for name, value in headers
        if (low := name.lower()) not in HOP_BY_HOP
        and low not in named
        and low not in drop
        and not low.startswith(b"proxy-")
    ]


class _Relay:
    """The one route's ASGI endpoint (see the module docstring)."""

    def __init__(self, url: httpx.URL, max_body_bytes: int | None = None) -> None:
        self.url, self.max_body_bytes = url, max_body_bytes
        self.base = str(url).rstrip("/")
        self.client: httpx.AsyncClient | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.client is None:
            return await _refuse(send, 503, "the front is not running", "server_error")
        try:
            url = self._target(scope)
        except _Refused as refused:
            return await _refuse(send, refused.status, str(refused), refused.code, kind="invalid_request_error")
        headers = list(scope["headers"])
        names = {name.lower() for name, _ in headers}
        limit = self.max_body_bytes
        declared = next((v for n, v in headers if n.lower() == b"content-length"), b"")
        if limit is not None and b"transfer-encoding" not in names and declared.isdigit() and int(declared) > limit:
            return await _too_large(send, limit)
        has_body = bool(names & {b"content-length", b"transfer-encoding"})
        exchange = _Exchange(receive, send, limit, has_body=has_body)
        # a plain Request: the client's defaults (Accept-Encoding, User-Agent, ...) are not added
        up = _upstream_headers(scope, headers, names)
        request = httpx.Request(scope["method"], url, headers=up, content=exchange.body() if has_body else None)
        await exchange.relay(self.client, request, self.base)

    def _target(self, scope: Scope) -> httpx.URL:
        """The upstream URL of the request's target; :class:`_Refused` for bad framing (400), a
        target that is not a path (400), or a route Ray's proxy answers itself (404)."""
        problem = framing_error(scope["headers"])
        if problem is not None:
            raise _Refused(400, problem, "invalid_request")
        path = scope.get("raw_path") or scope["path"].encode()
        query = scope.get("query_string") or b""
        try:
            if not path.startswith(b"/"):  # the rest would be read as the URL's authority
                raise httpx.InvalidURL("the request target is not a path")
            url = self.url.copy_with(raw_path=path + (b"?" + query if query else b""))  # the host stays
        except (httpx.InvalidURL, UnicodeError) as exc:
            message = f"invalid request target {path.decode('latin-1')[:200]!r}: {exc}"
            raise _Refused(400, message, "invalid_request") from None
        if url.path in RAY_OWN_ROUTES:  # as Ray's proxy will read it: decoded, dot segments gone
            raise _Refused(404, f"no route {url.path}", "not_found")
        return url


def _upstream_headers(scope: Scope, headers: list[tuple[bytes, bytes]], names: set[bytes]) -> list[tuple[bytes, bytes]]:
    """The headers relayed: the client's end-to-end ones, its Host (an empty one if it sent
    none), and X-Forwarded-For / -Proto of this connection (the client's own are dropped)."""
    up = _kept(headers, _FORWARDED)
    if b"host" not in names:
        up.append((b"host", b""))  # not the upstream's address: that would pass a Host check
    if scope.get("client"):
        up.append((b"x-forwarded-for", scope["client"][0].encode()))
    up.append((b"x-forwarded-proto", scope.get("scheme", "http").encode()))
    return up


class _Refused(Exception):
    """A request the front answers itself with an error (``status``, ``code``)."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class _Exchange:
    """One request relayed: its body streamed up (at most ``limit`` bytes), the response
    streamed back, and the client's going away (a disconnect) cancelling the relay."""

    def __init__(self, receive: Receive, send: Send, limit: int | None, *, has_body: bool) -> None:
        self.receive, self.send, self.limit = receive, send, limit
        self.body_done = anyio.Event()
        self.scope = anyio.CancelScope()  # cancelled when the client goes away
        self.started = False  # the response's head was sent
        if not has_body:
            self.body_done.set()  # nothing to relay; receive() is the disconnect watch's alone

    async def body(self) -> AsyncIterator[bytes]:
        """The request's body, chunk by chunk; :class:`_Gone` on a disconnect, :class:`_TooLarge`
        past the limit."""
        seen = 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.scope.cancel()
                raise _Gone
            chunk = message.get("body", b"")
            seen += len(chunk)
            if self.limit is not None and seen > self.limit:
                raise _TooLarge
            yield chunk
            if not message.get("more_body", False):
                break
        self.body_done.set()

    async def watch(self) -> None:
        """Once the body is read: cancel the relay when the client goes away."""
        await self.body_done.wait()
        while (await self.receive())["type"] != "http.disconnect":
            pass
        self.scope.cancel()

    async def relay(self, client: httpx.AsyncClient, request: httpx.Request, base: str) -> None:
        """Send ``request`` upstream and its response back; a failure before the response
        started is a 502 (after: the client sees a cut stream)."""
        response: httpx.Response | None = None
        with self.scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.watch)
                try:
                    response = await client.send(request, stream=True)
                    await self._pass_on(response)
                except _Gone:
                    pass
                except _TooLarge:  # (raised through httpx's send, before any response)
                    self.body_done.set()  # the disconnect watch may read now
                    await _too_large(self.send, self.limit or 0)
                except (httpx.HTTPError, OSError) as exc:
                    if not self.started:  # else the response ends unfinished: the client sees a cut stream
                        log.warning("front: the Ray proxy at %s failed: %s: %s", base, type(exc).__name__, exc)
                        message = f"the replicas' proxy did not answer: {type(exc).__name__}"
                        await _refuse(self.send, 502, message, "bad_gateway")
                finally:
                    if response is not None:
                        with anyio.CancelScope(shield=True):
                            await response.aclose()  # mid-stream: Ray sees the disconnect and cancels
                    tg.cancel_scope.cancel()

    async def _pass_on(self, response: httpx.Response) -> None:
        """The response's head and body, as they come."""
        # a length beside Transfer-Encoding does not frame what is relayed
        drop = _OWN | ({b"content-length"} if "transfer-encoding" in response.headers else set())
        head = {
            "type": "http.response.start",
            "status": response.status_code,
            "headers": _kept(response.headers.raw, drop),
        }
        await self.send(head)
        self.started = True
        async for chunk in response.aiter_raw():
            if chunk:
                await self.send({"type": "http.response.body", "body": chunk, "more_body": True})
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})


class _Gone(Exception):
    """The client went away while its body was being relayed."""


class _TooLarge(Exception):
    """The body being relayed passed ``max_body_bytes``."""


async def _too_large(send: Send, limit: int) -> None:
    """The 413 the replicas give (serve/jobs.py ``read_body``)."""
    await _refuse(
        send, 413, f"the request body exceeds {limit} bytes", "request_too_large", kind="invalid_request_error"
    )


async def _refuse(send: Send, status: int, message: str, code: str, *, kind: str = "server_error") -> None:
    body = json.dumps(error_body(message, kind, code)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
