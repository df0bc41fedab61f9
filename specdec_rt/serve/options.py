"""What one server serves and how, with the defaults the library and ``serve``'s flags share
(each defined once, here or in :mod:`specdec_rt.engine.served`):

* :class:`AppConfig`: the app around an engine (:func:`~specdec_rt.serve.app.create_app`'s);
* :class:`ConnectionLimits`: what a client may hold open below the app (``serve``'s uvicorn);
* :class:`ServeOptions`: the engine a server loads and its app, the options ``serve`` maps its
  flags to once, for a server on this machine and for every Ray Serve replica alike
  (:class:`~specdec_rt.serve.ray.RayOptions` adds the replicas).

Imported by the command line for its defaults: nothing here needs Starlette or uvicorn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..engine.served import DEFAULT_CONSUMER_TIMEOUT, DEFAULT_SLOTS
from ..errors import InvalidInputError
from ..kvcache.prefix import DEFAULT_BUDGET_BYTES
from .protocol import DEFAULT_PROMPT_LOGPROB_WORK

__all__ = [
    "AppConfig",
    "ConnectionLimits",
    "ServeOptions",
    "DEFAULT_MAX_QUEUED",
    "DEFAULT_REQUEST_TIMEOUT",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_TOKENS",
]

DEFAULT_MAX_QUEUED = 16  # admitted requests waiting for a slot; past slots + these: 429
DEFAULT_REQUEST_TIMEOUT = 600.0  # seconds per request, queueing included
DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_TOKENS = 256  # max_tokens of a request that names none (capped to its context's room)


def _check_seconds(name: str, value: object, *, positive: bool = False, optional: bool = True) -> None:
    """A finite number of seconds, >= 0 (``positive``: > 0); ``optional``: or None."""
    if value is None and optional:
        return
    if not (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value > 0 if positive else value >= 0)
    ):
        what = "None or a finite number" if optional else "a finite number"
        raise InvalidInputError(f"{name} must be {what} of seconds {'>' if positive else '>='} 0, got {value!r}")


def _check_count(name: str, value: object, least: int) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
        off = " (0: off)" if least == 0 else ""
        raise InvalidInputError(f"{name} must be an integer >= {least}{off}, got {value!r}")


@dataclass(frozen=True)
class AppConfig:
    """The app around an engine (:func:`~specdec_rt.serve.app.create_app`; each field is also
    one of its keywords). The counts and timeouts are checked at construction.

    Attributes:
        slots: Requests generating at once (``None``: the engine's ``slots``, once it is loaded;
            give the engine the same number).
        max_queued: Admitted requests waiting for a slot; past ``slots + max_queued`` a request
            gets 429 with ``Retry-After: retry_after``.
        model_name: The model's id in replies (``None``: the engine's ``name``).
        request_timeout: Seconds per request, queueing included (504 after; ``None``: no limit).
        max_body_bytes: Larger bodies get 413.
        default_max_tokens: For requests without ``max_tokens``.
        retry_after: Seconds in the 429's ``Retry-After``.
        wait_for_load: The lifespan startup returns only once the engine is loaded, and fails if
            it cannot be (for hosts that route to an app only after its startup, such as a Ray
            Serve replica).
        drain_timeout: Seconds admitted requests get once draining began; those still running
            then end with a 503 ``draining`` error (a stream: one error event) instead of being
            cut off (``None``: no limit).
        api_keys: Every route but ``/health`` needs ``Authorization: Bearer <one of them>`` (401
            otherwise; none: no key needed). Access is checked by the app
            (:mod:`specdec_rt.serve.guard`).
        allowed_hosts: The ``Host`` names the app answers to, others get 421 (``None``: any,
            for an app behind a proxy that checks them; ``guard.host_names`` gives the CLI's
            list).
        allowed_origins: Web origins whose pages may call the app, with CORS answers; a request
            with any other ``Origin`` gets 403.
        consumer_timeout: Seconds a streamed response may wait for its client to take a chunk:
            past that the request ends and frees its slot at once, and the client's stream ends
            (with an error event if the connection still takes one); ``None`` or ``0``: no
            limit. Give a loaded engine the same (its own ``consumer_timeout``; the CLI does).
        max_prompt_logprob_work: A completion with ``echo`` and ``logprobs`` may ask for at most
            this many prompt log-probability entries, prompt tokens x (1 + ``logprobs``) x ``n``
            (400 past it, before its prompt is scored; ``None``: no limit).

    Raises:
        InvalidInputError: ``slots`` or ``max_queued`` not an integer in range, or a timeout
            that is not a number >= 0.
    """

    slots: int | None = None
    max_queued: int = DEFAULT_MAX_QUEUED
    model_name: str | None = None
    request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    retry_after: int = 1
    wait_for_load: bool = False
    drain_timeout: float | None = None
    api_keys: Sequence[str] = field(default=(), repr=False)  # never in a log line
    allowed_hosts: Sequence[str] | None = None
    allowed_origins: Sequence[str] = ()
    consumer_timeout: float | None = DEFAULT_CONSUMER_TIMEOUT
    max_prompt_logprob_work: int | None = DEFAULT_PROMPT_LOGPROB_WORK

    def __post_init__(self) -> None:
        if self.slots is not None:
            _check_count("slots", self.slots, 1)
        _check_count("max_queued", self.max_queued, 0)
        for name, seconds in (
            ("request_timeout", self.request_timeout),
            ("drain_timeout", self.drain_timeout),
            ("consumer_timeout", self.consumer_timeout),
        ):
            _check_seconds(name, seconds)


@dataclass(frozen=True)
class ConnectionLimits:
    """The limits of one server below its app (the ``serve`` flags of the same names;
    docs/serving.md; :mod:`specdec_rt.serve.connections` puts them in force)."""

    header_timeout: float = 10.0  # seconds to receive the request line and headers
    body_timeout: float = 30.0  # seconds to receive the body, from the end of the headers
    max_header_bytes: int = 65536  # request line and headers, line ends included
    max_headers: int = 100  # header lines in one request
    max_connections: int = 256  # open connections, idle ones included
    keep_alive_timeout: float = 5.0  # seconds a connection may sit idle between requests (0: closed at once)
    max_connections_per_client: int = 32  # open connections from one address (IPv6: one /64); 0: no limit
    send_buffer_bytes: int = 65536  # each accepted socket's SO_SNDBUF (the kernel doubles it); 0: the kernel's

    def __post_init__(self) -> None:
        _check_seconds("header_timeout", self.header_timeout, positive=True, optional=False)
        _check_seconds("body_timeout", self.body_timeout, positive=True, optional=False)
        _check_seconds("keep_alive_timeout", self.keep_alive_timeout, optional=False)
        _check_count("max_header_bytes", self.max_header_bytes, 1)
        _check_count("max_headers", self.max_headers, 1)
        _check_count("max_connections", self.max_connections, 1)
        _check_count("max_connections_per_client", self.max_connections_per_client, 0)
        _check_count("send_buffer_bytes", self.send_buffer_bytes, 0)


@dataclass(frozen=True)
class ServeOptions:
    """The engine a server loads (:meth:`engine_options`: :meth:`Engine.load
    <specdec_rt.Engine.load>`'s arguments) and the app around it (:meth:`app_config`:
    :func:`~specdec_rt.serve.app.create_app`'s :class:`AppConfig`). ``api_keys``, ``allowed_hosts``,
    ``allowed_origins``: checked here, so a bad one fails before anything starts."""

    model: str
    draft: str | None = None
    slots: int = DEFAULT_SLOTS
    max_queued: int = DEFAULT_MAX_QUEUED
    request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_length: int | None = None
    provider: str = "auto"
    precision: str = "exported"  # Engine.load's; "auto": measure (or read the tune cache) at load
    prefix_cache: bool = True
    prefix_cache_bytes: int = DEFAULT_BUDGET_BYTES
    shared_weights: bool = True  # Engine.load's: map each model's prepacked copy
    model_name: str | None = None
    threads: int | None = None
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # never in a log line
    allowed_hosts: tuple[str, ...] | None = None
    allowed_origins: tuple[str, ...] = ()
    consumer_timeout: float | None = DEFAULT_CONSUMER_TIMEOUT  # the app's and the engine's
    max_prompt_logprob_work: int | None = DEFAULT_PROMPT_LOGPROB_WORK  # as for create_app

    def __post_init__(self) -> None:
        if self.slots < 1 or self.max_queued < 0:
            raise InvalidInputError(f"slots >= 1 and max_queued >= 0 needed, got {self.slots!r}, {self.max_queued!r}")
        from .guard import Access

        Access.checked(self.api_keys, self.allowed_hosts, self.allowed_origins)

    def engine_options(self, threads: int | None = None) -> dict[str, Any]:
        """Keyword arguments of ``Engine.load(self.model, ...)`` (``threads``: overrides ours)."""
        return dict(
            draft=self.draft,
            threads=threads or self.threads,
            max_length=self.max_length,
            provider=self.provider,
            slots=self.slots,
            prefix_cache=self.prefix_cache,
            prefix_cache_bytes=self.prefix_cache_bytes,
            consumer_timeout=self.consumer_timeout,
            precision=self.precision,
            shared_weights=self.shared_weights,
        )

    def app_config(self, **overrides: Any) -> AppConfig:
        """The :class:`AppConfig` of ``create_app(loader, config)`` (``overrides``: its fields)."""
        return replace(
            AppConfig(
                slots=self.slots,
                max_queued=self.max_queued,
                model_name=self.model_name,
                request_timeout=self.request_timeout,
                max_body_bytes=self.max_body_bytes,
                default_max_tokens=self.default_max_tokens,
                api_keys=self.api_keys,
                allowed_hosts=self.allowed_hosts,
                allowed_origins=self.allowed_origins,
                consumer_timeout=self.consumer_timeout,
                max_prompt_logprob_work=self.max_prompt_logprob_work,
            ),
            **overrides,
        )
