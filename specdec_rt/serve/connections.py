"""Connection limits below the app: what a client may hold open, and for how long.

uvicorn alone never closes a client that sends its headers or its body slowly, and (with
httptools) takes headers of any size. :func:`limited_protocol` builds uvicorn's h11 protocol with
the missing limits (the choice of h11, and its cost, in docs/decisions/0009-connection-limits.md):

- the request line and headers must arrive within ``header_timeout`` seconds of the connection
  (or of a request's first byte on a kept-alive connection), the body within ``body_timeout``
  seconds of the headers; past either the client gets a 408 and the connection is closed;
- ``max_header_bytes`` bytes of request line and headers (h11 stops buffering there) and
  ``max_headers`` header lines, a 431 past either;
- ``max_connections`` open connections: the next one gets a 503 and is closed at once;
  ``max_connections_per_client`` of them from one client address (an IPv6 client: its /64), the
  next from it a 429 (0: no per-client limit; behind a reverse proxy every client has the
  proxy's address);
- ``keep_alive_timeout`` seconds idle between requests (uvicorn's own timer);
- ``send_buffer_bytes``: each accepted socket's kernel send buffer, fixed, so that a client that
  stops reading a stream blocks the server's writes (and the app's ``consumer_timeout`` starts)
  after that many bytes, not after the megabytes the kernel would otherwise grow it to;
- one request framing (RFC 9112 section 6): a request that repeats ``Host``, ``Content-Length``,
  ``Content-Type``, ``Origin`` or ``Authorization``, or sends both ``Content-Length`` and
  ``Transfer-Encoding``, gets a 400 and the connection is closed;
- no WebSocket upgrades (no route takes one): an ``Upgrade: websocket`` request is served as
  plain HTTP.

Refusals carry the OpenAI error body and ``Connection: close``. Imported only when the server
runs (uvicorn and h11 come with the ``serve`` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import ipaddress
import json
import logging
import socket
from typing import Any

import h11
from h11._receivebuffer import ReceiveBuffer
from uvicorn.protocols.http.h11_impl import H11Protocol

from .guard import framing_error
from .options import ConnectionLimits
from .protocol import error_body

__all__ = ["ConnectionLimits", "client_key", "limited_protocol", "uvicorn_options"]

log = logging.getLogger("uvicorn.error")


def uvicorn_options(limits: ConnectionLimits) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config`` that put ``limits`` in force."""
    return {
        "http": limited_protocol(limits),
        "timeout_keep_alive": limits.keep_alive_timeout,
        "h11_max_incomplete_event_size": limits.max_header_bytes,
        "ws": "none",  # no route takes a WebSocket: an upgrade request is plain HTTP
    }


def client_key(address: str) -> str:
    """Whose connection it is, for ``max_connections_per_client``: the peer's IPv4 address, or
    the /64 of its IPv6 one (one host commonly holds a whole /64); an IPv4-mapped IPv6 address
    counts as the IPv4 one."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address  # a Unix socket's path, or no address: one client
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def limited_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with ``limits`` (pass it as ``uvicorn.Config(http=...)``,
    with :func:`uvicorn_options`' keep-alive and header size)."""

    class Protocol(LimitedH11Protocol):
        pass

    Protocol.limits = limits
    return Protocol


class _HeadBuffer(ReceiveBuffer):
    """h11's receive buffer that keeps the last header block it handed out (the lines as they
    came, before h11 merges a repeated ``Content-Length``). h11 has no public hook for them;
    tests/serve/test_serve_framing.py's ``content-length`` case fails if this one stops working."""

    lines: list[bytearray] | None = None

    def maybe_extract_lines(self) -> list[bytearray] | None:
        lines = super().maybe_extract_lines()
        if lines is not None:
            self.lines = lines
        return lines


class _Connection(h11.Connection):
    """h11's server side that also refuses more than ``max_headers`` header lines and a request
    of more than one framing (:func:`_framing_error`), and keeps the status h11 hints at for what
    it refused (431 for a header block past its size)."""

    def __init__(self, limits: ConnectionLimits) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=limits.max_header_bytes)
        self._receive_buffer = self._head = _HeadBuffer()
        self.max_headers = limits.max_headers
        self.max_header_bytes = limits.max_header_bytes
        self.refusal: tuple[int, str] | None = None  # (status, message) of the last refused request

    def next_event(self) -> Any:
        before = self._head.lines
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            head = self._head.lines
            if head is not before and head is not None and (problem := _framing_error(head)):
                self.refusal = (400, problem)  # (h11 refuses a second Host in its own words)
            elif exc.error_status_hint == 431:  # h11's receive buffer outgrew max_incomplete_event_size
                self.refusal = (
                    431,
                    f"the request line and headers exceed {self.max_header_bytes} bytes (--max-header-bytes)",
                )
            else:
                self.refusal = (exc.error_status_hint, f"invalid HTTP request: {exc}")
            raise
        if isinstance(event, h11.Request) and len(event.headers) > self.max_headers:
            self.refusal = (
                431,
                f"the request has {len(event.headers)} headers, more than {self.max_headers} (--max-headers)",
            )
            raise h11.RemoteProtocolError(self.refusal[1], error_status_hint=431)
        if isinstance(event, h11.Request) and (problem := _framing_error(self._head.lines or [])):
            self.refusal = (400, problem)
            raise h11.RemoteProtocolError(problem, error_status_hint=400)
        return event


def _framing_error(lines: list[bytearray]) -> str | None:
    """:func:`~specdec_rt.serve.guard.framing_error` of a request head as received (its request
    line, then its header lines), and a list in ``Content-Length``: h11 merges ``5, 5`` and a
    repeated equal length into one before the app sees the headers."""
    headers = []
    for line in lines[1:]:
        name, _, value = bytes(line).partition(b":")
        headers.append((name.strip().lower(), value))
        if headers[-1][0] == b"content-length" and b"," in value:
            return "the Content-Length header holds a list; send one length"
    return framing_error(headers)


class LimitedH11Protocol(H11Protocol):
    """One client connection: uvicorn's h11 protocol plus a read deadline (``_wait``: what it
    waits for, ``"headers"`` or ``"body"``) and the connection cap. :func:`limited_protocol`
    makes a subclass with its ``limits``."""

    limits = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = self._checked = _Connection(self.limits)
        self._wait: str | None = None  # the read deadline running: "headers", "body" or none
        self.client_key = ""  # client_key() of the peer, once connected
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # asyncio hands a Transport here
        super().connection_made(transport)
        self.client_key = client_key(self.client[0]) if self.client else ""
        limits = self.limits
        if limits.send_buffer_bytes:
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                with contextlib.suppress(OSError):  # a peer already gone: nothing to bound
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, limits.send_buffer_bytes)
        if len(self.connections) > limits.max_connections:  # this one included
            log.warning("refused a connection: %d open (--max-connections)", len(self.connections) - 1)
            self._refuse(
                503,
                f"the server has {limits.max_connections} connections open (--max-connections); try again later",
                "too_many_connections",
            )
            return
        if limits.max_connections_per_client and self.client_key:
            mine = sum(
                1 for c in self.connections if isinstance(c, LimitedH11Protocol) and c.client_key == self.client_key
            )
            if mine > limits.max_connections_per_client:  # this one included
                log.warning(
                    "refused a connection from %s: %d open from it (--max-connections-per-client)",
                    self.client_key,
                    mine - 1,
                )
                self._refuse(
                    429,
                    f"this client has {limits.max_connections_per_client} connections open "
                    "(--max-connections-per-client); close one or try again later",
                    "too_many_connections",
                )
                return
        self._watch(arrived=True)  # a client that connects and says nothing has header_timeout too

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch(arrived=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # starts the keep-alive timer; parses pipelined requests
        self._watch(arrived=False)

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_deadline(None)
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn calls this when h11 refuses what the client sent (``_Connection.refusal``)."""
        status, message = self._checked.refusal or (400, msg)
        self._refuse(status, message, "request_header_fields_too_large" if status == 431 else "invalid_request")

    def _watch(self, arrived: bool) -> None:
        """Run the deadline that fits where the client's request is (h11's ``their_state``):
        headers while it is IDLE and has sent something (or just connected), the body while it
        is SEND_BODY, none once the request is in (the app's ``--request-timeout`` rules then)
        or while the connection is idle between requests (the keep-alive timer rules then)."""
        if self.transport.is_closing():
            self._set_deadline(None)
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            wait = "headers" if arrived or self._wait == "headers" else None
        elif state is h11.SEND_BODY:
            wait = "body"
        else:
            wait = None
        self._set_deadline(wait)

    def _set_deadline(self, wait: str | None) -> None:
        if wait == self._wait:
            return  # a deadline runs from the first byte of its part, not from the latest
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._wait = wait
        if wait is not None:
            seconds = self.limits.header_timeout if wait == "headers" else self.limits.body_timeout
            self._deadline = self.loop.call_later(seconds, self._expired, wait, seconds)

    def _expired(self, wait: str, seconds: float) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        flag = "--header-timeout" if wait == "headers" else "--body-timeout"
        log.warning("closed a connection: its request %s did not arrive within %g s (%s)", wait, seconds, flag)
        # a body's deadline may pass after the app answered early (a 413): then only close
        answer = wait == "headers" or self.cycle is None or not self.cycle.response_started
        self._refuse(
            408, f"the request {wait} did not arrive within {seconds:g} s ({flag})", "request_timeout", answer=answer
        )

    def _refuse(self, status: int, message: str, code: str, answer: bool = True) -> None:
        """Answer ``status`` with an OpenAI error body (unless a response is under way, or
        ``answer`` is false) and close the connection; the app, if running, sees a disconnect."""
        cycle = self.cycle
        if answer and (cycle is None or cycle.response_complete or not cycle.response_started):
            body = json.dumps(error_body(message, "invalid_request_error", code)).encode()
            head = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n".encode()]
            head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
            head.append(
                b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
            )
            self.transport.write(b"".join(head) + body)
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's sends are dropped; its receive() says disconnect
            cycle.message_event.set()
        self._set_deadline(None)
        self.transport.close()
