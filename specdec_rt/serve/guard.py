"""Who may use the server: the name it is reached as (``Host``), the web page a request comes
from (``Origin``) and the API key it carries.

:func:`access_middleware` puts three ASGI layers in front of the routes, outermost first:

1. :class:`SiteGuard`: only HTTP requests pass (a WebSocket is closed unaccepted, any other
   scope but ``lifespan`` dropped); a request that repeats one of :data:`SINGLE_HEADERS` (the
   first copy is what one reader sees, the last what another does) or sends ``Content-Length``
   beside ``Transfer-Encoding`` is refused with 400 (the server's connections refuse both
   before this: :mod:`~specdec_rt.serve.connections`; this holds under any other server);
   a ``Host`` that is not one of the server's names is refused with 421
   (DNS rebinding: a page on ``attacker.example``, whose name the attacker points at 127.0.0.1,
   sends ``Host: attacker.example``; Starlette's ``TrustedHostMiddleware`` decides the match);
   an ``Origin`` that is neither allowed nor the server's own is refused with 403 (any page the
   user opens can make the browser POST here: a "simple" request needs no preflight).
2. Starlette's ``CORSMiddleware``, only when origins are allowed: it answers their preflights
   (``OPTIONS`` with ``Access-Control-Request-Method``) and adds ``Access-Control-Allow-Origin``.
3. :class:`BearerAuth`, only when there are API keys: every route but ``/health`` needs
   ``Authorization: Bearer <key>`` (401 otherwise), compared in constant time with every key.

Refusals carry the OpenAI error body and are counted by ``refused(reason)`` (the app counts
them in ``specdec_requests_rejected_total``: ``framing``, ``host``, ``origin``, ``auth``). No key is ever
logged or echoed. The JSON routes' ``Content-Type`` (415) is checked where the body is read
(:mod:`specdec_rt.serve.jobs`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..checks import brief_repr
from ..errors import InvalidInputError
from .protocol import error_body

__all__ = [
    "Access",
    "access_middleware",
    "check_api_keys",
    "check_hosts",
    "check_origins",
    "host_names",
    "keys_from_env",
    "API_KEY_ENV",
    "LOOPBACK_NAMES",
    "SINGLE_HEADERS",
    "framing_error",
]

API_KEY_ENV = "SPECDEC_API_KEY"  # comma separated; keeps the keys out of `ps`
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")  # any port
OPEN_PATHS = frozenset({"/health"})  # answered without a key (load balancers, probes)
WILDCARD_BINDS = ("0.0.0.0", "::", "")
# headers a request may carry once (lower case: as written in messages)
SINGLE_HEADERS = {
    b"host": "Host",
    b"content-length": "Content-Length",
    b"content-type": "Content-Type",
    b"origin": "Origin",
    b"authorization": "Authorization",
}
_HOST_NAME = re.compile(r"(\*\.)?[a-z0-9_]([a-z0-9_-]{0,62})(\.[a-z0-9_]([a-z0-9_-]{0,62}))*\.?")

Refused = Callable[[str], None]


@dataclass(frozen=True)
class Access:
    """The access rules, checked. ``api_keys``: keys a request may carry (none: no key needed).
    ``allowed_hosts``: the ``Host`` names the server answers to (``None``: any, no check).
    ``allowed_origins``: web origins (``scheme://host[:port]``, or ``*``) whose pages may call it."""

    api_keys: tuple[str, ...] = field(default=(), repr=False)  # never in a log line
    allowed_hosts: tuple[str, ...] | None = None
    allowed_origins: tuple[str, ...] = ()

    @classmethod
    def checked(
        cls,
        api_keys: Iterable[str] = (),
        allowed_hosts: Iterable[str] | None = None,
        allowed_origins: Iterable[str] = (),
    ) -> Access:
        """Each value checked (an :class:`~specdec_rt.errors.InvalidInputError` names a bad host
        or origin, and a bad key by its position only) and normalised (lower case, IPv6 in brackets)."""
        return cls(
            check_api_keys(api_keys),
            None if allowed_hosts is None else check_hosts(allowed_hosts),
            check_origins(allowed_origins),
        )


def check_api_keys(keys: Iterable[str]) -> tuple[str, ...]:
    if isinstance(keys, str):
        raise InvalidInputError("api_keys must be a list of keys, not one string")
    out: list[str] = []
    for i, key in enumerate(keys, 1):
        if not isinstance(key, str) or not key:
            raise InvalidInputError(f"API key #{i} must be a non-empty string")
        if not all(0x21 <= ord(c) <= 0x7E for c in key):  # never the key itself in the message
            raise InvalidInputError(
                f"API key #{i} has a character that cannot be sent in an Authorization "
                "header: keys are visible ASCII, without spaces"
            )
        if key not in out:
            out.append(key)
    return tuple(out)


def check_hosts(names: Iterable[str]) -> tuple[str, ...]:
    """Host names, IP addresses (IPv6 with or without brackets), ``*.domain`` or ``*``; no port."""
    if isinstance(names, str):
        raise InvalidInputError("allowed_hosts must be a list of host names, not one string")
    out: list[str] = []
    for name in names:
        host = _host(name)
        if host not in out:
            out.append(host)
    return tuple(out)


def _host(name: Any) -> str:
    if not isinstance(name, str):
        raise InvalidInputError(f"an allowed host must be a string, got {brief_repr(name)}")
    text = name.strip().lower()
    if text == "*":
        return text
    address = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        ip = ipaddress.ip_address(address)
        return f"[{ip}]" if ip.version == 6 else str(ip)
    except ValueError:
        pass
    if _HOST_NAME.fullmatch(text) and len(text) <= 253:
        return text.rstrip(".")
    hint = " (give it without a port)" if re.fullmatch(r".+:\d+", text) else ""
    raise InvalidInputError(
        f"allowed host {brief_repr(name)} is not a host name, an IP address, '*.domain' or '*'{hint}"
    )


def check_origins(origins: Iterable[str]) -> tuple[str, ...]:
    """Web origins as browsers send them: ``scheme://host[:port]``, nothing after; or ``*``."""
    if isinstance(origins, str):
        raise InvalidInputError("allowed_origins must be a list of origins, not one string")
    out: list[str] = []
    for origin in origins:
        if not isinstance(origin, str):
            raise InvalidInputError(f"an allowed origin must be a string, got {brief_repr(origin)}")
        text = origin.strip().lower()
        if text != "*":
            parts = urlsplit(text)
            if not (parts.scheme and parts.netloc) or text != f"{parts.scheme}://{parts.netloc}":
                raise InvalidInputError(
                    f"allowed origin {brief_repr(origin)} is not an origin: scheme://host[:port] "
                    "with nothing after it (no path, not even '/'), e.g. 'http://app.example', "
                    "or '*'"
                )
        if text not in out:
            out.append(text)
    return tuple(out)


def keys_from_env(environ: Mapping[str, str] | None = None) -> list[str]:
    """The API keys in ``$SPECDEC_API_KEY`` (comma separated; blanks ignored)."""
    value = (os.environ if environ is None else environ).get(API_KEY_ENV, "")
    return [k.strip() for k in value.split(",") if k.strip()]


def is_loopback(bind_host: str) -> bool:
    if bind_host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(bind_host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_names(bind_host: str, allowed_hosts: Sequence[str] = ()) -> tuple[str, ...] | None:
    """The ``Host`` names a server listening on ``bind_host`` answers to: the loopback names when it
    listens on loopback (or on every address), the address itself when it is another one, and
    ``allowed_hosts``; ``None`` (no check) when they include ``*``."""
    extra = check_hosts(allowed_hosts)
    if "*" in extra:
        return None
    own: tuple[str, ...]
    if bind_host in WILDCARD_BINDS or is_loopback(bind_host):
        own = LOOPBACK_NAMES + ((_host(bind_host),) if is_loopback(bind_host) else ())
    else:
        own = (_host(bind_host),)
    return check_hosts((*own, *extra))


def _refuse(
    status: int, message: str, code: str, *, type: str = "invalid_request_error", headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, type, code), status_code=status, headers=headers)


async def _mark_passed(scope: Scope, receive: Receive, send: Send) -> None:
    scope["specdec.host_ok"] = True


async def _drop(message: Message) -> None:
    pass


async def _nothing() -> Message:
    return {"type": "http.disconnect"}


def framing_error(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """Why a request with these headers (ASGI's: lower-case names) means two things to two
    readers, or None: one of :data:`SINGLE_HEADERS` repeated, or ``Content-Length`` beside
    ``Transfer-Encoding`` (RFC 9112 section 6.3)."""
    seen: dict[bytes, int] = {}
    for name, _ in headers:
        seen[name] = seen.get(name, 0) + 1
    for name, count in seen.items():
        if count > 1 and name in SINGLE_HEADERS:
            return f"the request has {count} '{SINGLE_HEADERS[name]}' headers; send it once"
    if b"content-length" in seen and b"transfer-encoding" in seen:
        return "the request has both Content-Length and Transfer-Encoding (RFC 9112 section 6.3); send one"
    return None


class SiteGuard:
    """Refuses every scope but HTTP and lifespan, a request of two framings (400), a foreign
    ``Host`` (421) and a foreign ``Origin`` (403), before anything else runs."""

    def __init__(self, app: ASGIApp, hosts: tuple[str, ...] | None, origins: tuple[str, ...], refused: Refused) -> None:
        self.app, self.hosts, self.refused = app, hosts, refused
        self.any_origin, self.origins = "*" in origins, frozenset(origins)
        # Starlette's matcher (IPv6 brackets, ports, '*.domain'); its own plain-text answer is not used
        self.trusted = None if hosts is None else TrustedHostMiddleware(_mark_passed, list(hosts), www_redirect=False)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":  # no route takes one: closed before it is accepted (a 403)
            self.refused("framing")
            return await send({"type": "websocket.close", "code": 1008})
        if scope["type"] != "http":
            return None
        problem = framing_error(scope["headers"])
        if problem is not None:
            self.refused("framing")
            return await _refuse(400, problem, "invalid_request")(scope, receive, send)
        headers = Headers(scope=scope)
        host = headers.get("host")
        if self.trusted is not None:
            probe = dict(scope)
            await self.trusted(probe, _nothing, _drop)
            if not probe.get("specdec.host_ok"):
                self.refused("host")
                return await _refuse(
                    421,
                    f"this server does not answer to the Host {brief_repr(host)}; it answers "
                    f"to {', '.join(self.hosts or ())} (serve --allowed-hosts adds names)",
                    "misdirected_request",
                )(scope, receive, send)
        origin = headers.get("origin")
        if origin is not None and not self._origin_ok(origin, host):
            self.refused("origin")
            return await _refuse(
                403,
                f"requests from web pages of the origin {brief_repr(origin)} are not "
                "allowed (serve --allowed-origins allows origins)",
                "origin_not_allowed",
            )(scope, receive, send)
        await self.app(scope, receive, send)

    def _origin_ok(self, origin: str, host: str | None) -> bool:
        origin = origin.lower()
        if self.any_origin or origin in self.origins:
            return True
        # the server's own origin (a checked Host: never a rebinding name): not cross-site
        return (
            self.hosts is not None
            and host is not None
            and origin in (f"http://{host.lower()}", f"https://{host.lower()}")
        )


class BearerAuth:
    """Every route but ``/health`` needs ``Authorization: Bearer <one of the keys>``; else 401 with
    ``WWW-Authenticate: Bearer``. Both sides are hashed (SHA-256) and compared with
    :func:`hmac.compare_digest` against every key, so the time taken says nothing about the keys."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...], refused: Refused) -> None:
        if not keys:
            raise InvalidInputError("BearerAuth needs at least one key")
        self.app, self.refused = app, refused
        self.digests = [hashlib.sha256(k.encode("ascii")).digest() for k in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _route_path(scope) in OPEN_PATHS:
            return await self.app(scope, receive, send)
        token = _bearer(Headers(scope=scope).get("authorization"))
        if token is None:
            message = "no API key: send it as the header 'Authorization: Bearer <key>'"
        else:
            given = hashlib.sha256(token.encode("latin-1")).digest()
            ok = False
            for digest in self.digests:  # every key, no early exit
                ok |= hmac.compare_digest(given, digest)
            if ok:
                return await self.app(scope, receive, send)
            message = "incorrect API key provided"
        self.refused("auth")
        await _refuse(401, message, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)


def _bearer(value: str | None) -> str | None:
    """The token of ``Bearer <token>`` (the scheme in any case), else None."""
    if value is None:
        return None
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _route_path(scope: Scope) -> str:
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def access_middleware(access: Access, refused: Refused) -> list[Middleware]:
    """The layers :class:`Access` asks for, outermost first (``Starlette(middleware=...)``)."""
    layers = [Middleware(SiteGuard, hosts=access.allowed_hosts, origins=access.allowed_origins, refused=refused)]
    if access.allowed_origins:
        layers.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(access.allowed_origins),
                allow_methods=["GET", "POST"],
                allow_headers=["*"],
                allow_private_network=True,  # a listed public page may call a local server
                expose_headers=["Retry-After", "x-specdec-replica"],
            )
        )
    if access.api_keys:
        layers.append(Middleware(BearerAuth, keys=access.api_keys, refused=refused))
    return layers
