"""``python -m specdec_rt serve``: the OpenAI-compatible server on uvicorn.

Only argparse at import time: ``specdec_rt.cli`` imports this module for every command, and
Starlette / uvicorn (the ``serve`` extra) are needed only when the server runs.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..engine.served import DEFAULT_CONSUMER_TIMEOUT, DEFAULT_SLOTS
from ..errors import SpecDecError
from ..kvcache.prefix import DEFAULT_BUDGET_BYTES
from .options import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUED,
    DEFAULT_MAX_TOKENS,
    DEFAULT_REQUEST_TIMEOUT,
    ConnectionLimits,
)
from .protocol import DEFAULT_PROMPT_LOGPROB_WORK
from .ray import RayOptions  # (Ray itself is imported only by serve --ray)

if TYPE_CHECKING:
    from ..engine.engine import Engine
    from .guard import Access

__all__ = ["add_serve_parser", "run_serve"]

DRAIN_GRACE_S = 5.0  # after --drain-timeout, time to send the 503s before uvicorn cuts connections
DEFAULT_DRAIN_TIMEOUT = 30.0  # the CLI's; an embedded app's default is none (AppConfig.drain_timeout)
CONNECTION_DEFAULTS = ConnectionLimits()  # the connection flags' defaults
# how long a thread that wants the GIL waits before the holder must give it up (Python's default:
# 5 ms): the event loop takes the GIL back at every wake, so a worker thread running Python code
# (big replies' JSON, log-probability tables) delays each of its wakes by up to this much
SWITCH_INTERVAL_S = 0.001


def add_serve_parser(sub: Any) -> argparse.ArgumentParser:  # sub: argparse's subparsers action
    """Add the ``serve`` subcommand to ``sub`` (argparse subparsers); returns its parser, to
    which the caller adds the shared model options (``--model``, ``--draft``, ``--threads``, ...)."""
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (needs the 'serve' extra)",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models, "
        "/health and /metrics (see docs/serving.md).",
    )
    assert isinstance(p, argparse.ArgumentParser)
    _add_listen_flags(p)
    _add_admission_flags(p)
    _add_request_limit_flags(p)
    _add_model_flags(p)
    _add_access_flags(p)
    conn = p.add_argument_group("connection limits (docs/serving.md, 'Connection limits')")
    _add_framing_flags(conn)
    _add_connection_flags(conn)
    _add_ray_flags(p)
    return p


def _add_listen_flags(p: argparse.ArgumentParser) -> None:
    """Where the server listens: ``--host``, ``--port``."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="port (default 8000; 0 picks a free one)")


def _add_admission_flags(p: argparse.ArgumentParser) -> None:
    """How many requests run and wait, and for how long: ``--slots`` to ``--drain-timeout``."""
    p.add_argument(
        "--slots",
        type=_positive,
        default=DEFAULT_SLOTS,
        help="requests generating (and batched) at once (default %(default)s)",
    )
    p.add_argument(
        "--max-queued",
        type=_non_negative,
        default=DEFAULT_MAX_QUEUED,
        help="requests waiting for a slot before new ones get 429 (default %(default)s)",
    )
    p.add_argument(
        "--request-timeout",
        type=_seconds,
        default=DEFAULT_REQUEST_TIMEOUT,
        help="seconds a request may take, queueing included (default %(default)g; 0: none)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=_positive,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body; larger ones get 413 (default %(default)s bytes)",
    )
    p.add_argument(
        "--drain-timeout",
        type=_seconds,
        default=DEFAULT_DRAIN_TIMEOUT,
        help="on SIGTERM, seconds to let admitted requests finish; those left then get a 503 "
        "(a stream: an error event) (default %(default)g)",
    )


def _add_request_limit_flags(p: argparse.ArgumentParser) -> None:
    """A request's own limits: ``--consumer-timeout``, ``--max-prompt-logprob-work``, ``--default-max-tokens``."""
    p.add_argument(
        "--consumer-timeout",
        type=_seconds,
        default=DEFAULT_CONSUMER_TIMEOUT,
        help="seconds a streamed response may wait for its client to take a chunk (and a request "
        "for its reader); past that it ends and frees its slot (default %(default)g; 0: none)",
    )
    p.add_argument(
        "--max-prompt-logprob-work",
        type=_non_negative,
        default=DEFAULT_PROMPT_LOGPROB_WORK,
        help="a completion with echo and logprobs may ask for this many prompt log-probability "
        "entries, prompt tokens x (1 + logprobs) x n; more get 400 (default %(default)s; 0: no limit)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=_positive,
        default=DEFAULT_MAX_TOKENS,
        help="max_tokens when a request sets none (default %(default)s)",
    )


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """What is served and how it is loaded: the name, the prefix cache, the precision, building."""
    p.add_argument(
        "--served-model-name",
        default=None,
        help="model id in responses and /v1/models (default: the --model value's name)",
    )
    p.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep finished requests' KV and start new ones from the longest cached prefix (default on)",
    )
    p.add_argument(
        "--prefix-cache-bytes",
        type=_non_negative,
        default=DEFAULT_BUDGET_BYTES,
        help=f"KV memory the prefix cache may hold, all models (default {DEFAULT_BUDGET_BYTES})",
    )
    p.add_argument(
        "--precision",
        choices=["auto", "exported", "float32", "int8", "int4"],
        default=None,
        help="which of the model folder's targets runs: 'auto' (default) the fastest exact one "
        "with its draft, measured on this machine on first start (about a minute) and cached "
        "(python -m specdec_rt tune shows the table; processes starting at once measure once); "
        "'exported' the folder's own; or pinned",
    )
    p.add_argument(
        "--shared-weights",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="map a prepacked copy of each model's weights, written once per machine to the cache, so "
        "servers on one model share them (default on; --no-shared-weights: each packs its own)",
    )
    p.add_argument("--no-build", action="store_true", help="fail instead of building a missing recipe")
    p.add_argument("--access-log", action="store_true", help="uvicorn's per-request access log")


def _add_access_flags(p: argparse.ArgumentParser) -> None:
    """Who may call the server: API keys, hosts, origins."""
    access = p.add_argument_group("access (docs/serving.md, 'Access')")
    access.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health (repeat for several "
        "keys; $SPECDEC_API_KEY, comma separated, keeps them out of ps)",
    )
    access.add_argument(
        "--allowed-hosts",
        type=_names,
        default=[],
        metavar="NAMES",
        help="Host names the server answers to besides its own (comma separated; '*': any); "
        "needed with --host 0.0.0.0 or ::",
    )
    access.add_argument(
        "--allowed-origins",
        type=_names,
        default=[],
        metavar="ORIGINS",
        help="web origins (scheme://host[:port], comma separated; '*': any) whose pages may "
        "call the server, with CORS answers (default: none)",
    )


def _add_framing_flags(conn: argparse._ArgumentGroup) -> None:
    """How long and how big a request's head and body may be."""
    conn.add_argument(
        "--header-timeout",
        type=_positive_seconds,
        default=CONNECTION_DEFAULTS.header_timeout,
        help="seconds a client has to send a request's line and headers, from its connection or the "
        "request's first byte; then a 408 and the connection is closed (default %(default)g)",
    )
    conn.add_argument(
        "--body-timeout",
        type=_positive_seconds,
        default=CONNECTION_DEFAULTS.body_timeout,
        help="seconds a client has to send a request's body, from the end of its headers; then a "
        "408 and the connection is closed (default %(default)g)",
    )
    conn.add_argument(
        "--max-header-bytes",
        type=_positive,
        default=CONNECTION_DEFAULTS.max_header_bytes,
        help="largest request line and headers; larger ones get 431 (default %(default)s)",
    )
    conn.add_argument(
        "--max-headers",
        type=_positive,
        default=CONNECTION_DEFAULTS.max_headers,
        help="most header lines in a request; more get 431 (default %(default)s)",
    )


def _add_connection_flags(conn: argparse._ArgumentGroup) -> None:
    """Open connections: how many, per client, their send buffers and idle time."""
    conn.add_argument(
        "--max-connections",
        type=_positive,
        default=CONNECTION_DEFAULTS.max_connections,
        help="open connections, idle ones included; one more gets a 503 and is closed (default %(default)s)",
    )
    conn.add_argument(
        "--max-connections-per-client",
        type=_count,
        default=CONNECTION_DEFAULTS.max_connections_per_client,
        help="open connections from one client address (IPv6: one /64); one more gets a 429 and is "
        "closed (default %(default)s; 0: no limit, e.g. behind a reverse proxy, where every client has the "
        "proxy's address)",
    )
    conn.add_argument(
        "--send-buffer-bytes",
        type=_count,
        default=CONNECTION_DEFAULTS.send_buffer_bytes,
        help="each connection's kernel send buffer: how much of a stream a client that stopped "
        "reading leaves unread before --consumer-timeout starts (default %(default)s; 0: the kernel's, "
        "which grows to megabytes)",
    )
    conn.add_argument(
        "--keep-alive-timeout",
        type=_seconds,
        default=CONNECTION_DEFAULTS.keep_alive_timeout,
        help="seconds a connection may sit idle between requests (default %(default)g; 0: closed after each response)",
    )


def _add_ray_flags(p: argparse.ArgumentParser) -> None:
    """Replicas on Ray Serve."""
    ray = p.add_argument_group("replicas on Ray Serve (the 'ray' extra; docs/serving.md)")
    ray.add_argument("--ray", action="store_true", help="serve replicas on Ray Serve instead of one process")
    ray.add_argument(
        "--replicas",
        type=_replicas,
        default=RayOptions.replicas,
        help="replicas: a number or 'auto' (default %(default)s)",
    )
    ray.add_argument(
        "--cpus-per-replica",
        type=_positive_float,
        default=RayOptions.cpus_per_replica,
        help="CPUs Ray reserves per replica; its ONNX Runtime threads (default %(default)g)",
    )
    ray.add_argument(
        "--ray-address", default=None, help="join this Ray cluster (default: start a local one on loopback)"
    )


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def _access(args: argparse.Namespace) -> Access:
    """The checked :class:`~specdec_rt.serve.guard.Access` of the flags and ``$SPECDEC_API_KEY``."""
    from .guard import WILDCARD_BINDS, Access, check_api_keys, check_origins, host_names, keys_from_env

    if args.host in WILDCARD_BINDS and not args.allowed_hosts:
        raise SpecDecError(
            f"--host {args.host!r} listens on every address: name the hosts clients reach it as "
            "with --allowed-hosts (e.g. --allowed-hosts api.example,10.0.0.5), or '*' for any"
        )
    try:
        flag = "--api-key / $SPECDEC_API_KEY"
        keys = check_api_keys([*args.api_key, *keys_from_env()])
        flag = "--allowed-hosts"
        hosts = host_names(args.host, args.allowed_hosts)
        flag = "--allowed-origins"
        origins = check_origins(args.allowed_origins)
    except SpecDecError as exc:
        raise SpecDecError(f"{flag}: {exc}") from None
    return Access(api_keys=keys, allowed_hosts=hosts, allowed_origins=origins)


def _say_access(access: Access) -> None:
    keys = f"{len(access.api_keys)} API key(s) required" if access.api_keys else "no API key required"
    hosts = "any Host" if access.allowed_hosts is None else "Host " + ", ".join(access.allowed_hosts)
    origins = ", ".join(access.allowed_origins) or "none"
    _say(f"specdec_rt serve: {keys}; answering {hosts}; web origins allowed: {origins}")


def _say_loaded(name: str, engine: Engine) -> None:
    """The load line: what runs and what its greedy output is exact to."""
    what = engine.choice.describe() if engine.choice is not None else f"draft {engine.draft_name or 'none'}"
    _say(f"specdec_rt serve: loaded {name}: {what}")


def _replicas(text: str) -> int | str:
    if text == "auto":
        return text
    return _positive(text)


def _int(text: str) -> int:
    """``text`` as an integer; argparse's own message would name the converter, not the value."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def _positive(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _count(text: str) -> int:
    """An integer >= 0 (0: off)."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0: off), got {value}")
    return value


def _positive_float(text: str) -> float:
    value = _float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _say(message: str) -> None:
    """A line on stderr; a reader that has gone away (``serve ... | head -1``) must not keep the
    server from starting or stopping."""
    try:
        print(message, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _port(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in 0..65535, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    value = _float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text}")
    return value


def _seconds(text: str) -> float:
    value = _float(text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def _options(args: argparse.Namespace, access: Access, folder: Path) -> dict[str, Any]:
    """The flags as :class:`~specdec_rt.serve.options.ServeOptions` fields (the precision aside:
    each caller passes it), one mapping for the local server and the replicas."""

    return dict(
        model=str(folder),
        draft=args.draft,
        slots=args.slots,
        max_queued=args.max_queued,
        request_timeout=args.request_timeout or None,
        max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.default_max_tokens,
        max_length=args.max_length,
        provider=args.provider,
        prefix_cache=args.prefix_cache,
        prefix_cache_bytes=args.prefix_cache_bytes,
        shared_weights=args.shared_weights,
        threads=args.threads,
        model_name=args.served_model_name or Path(str(args.model)).name,
        consumer_timeout=args.consumer_timeout or None,
        max_prompt_logprob_work=args.max_prompt_logprob_work or None,
        api_keys=access.api_keys,
        allowed_hosts=access.allowed_hosts,
        allowed_origins=access.allowed_origins,
    )


def run_serve(args: argparse.Namespace) -> int:
    """Load the model (in the background: ``/health`` answers 503 meanwhile), serve until SIGTERM
    or SIGINT, then drain: new requests get 503, running ones get ``--drain-timeout`` seconds to
    finish, the engine is closed, and the exit status is 0. A model that fails to load exits 1.
    ``--ray``: replicas on Ray Serve instead (:func:`run_ray_serve`)."""
    try:  # an address that cannot be listened on is named before the model loads
        socket.getaddrinfo(args.host or None, args.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        _say(f"specdec_rt: error: --host {args.host!r} is not an address to listen on: {exc}")
        return 1
    try:
        access = _access(args)
    except SpecDecError as exc:
        _say(f"specdec_rt: error: {exc}")
        return 2
    if args.ray:
        return run_ray_serve(args, access)
    try:
        import uvicorn  # noqa: F401 - the 'serve' extra, checked before the model loads

        from .app import create_app
        from .options import ServeOptions
    except ImportError as exc:
        _say(f"specdec_rt: error: serve needs the 'serve' extra (pip install 'specdec-rt[serve]'): {exc}")
        return 1

    from ..engine.engine import Engine
    from ..engine.loading import ensure_built

    folder = ensure_built(args.model, allow_build=not args.no_build)  # a missing model fails here, at once
    opts = ServeOptions(**_options(args, access, folder), precision=args.precision or "auto")

    async def load() -> Engine:
        engine = await Engine.load(opts.model, **opts.engine_options())
        _say_loaded(opts.model_name or opts.model, engine)
        return engine

    logging.getLogger("specdec_rt.serve").setLevel(logging.INFO)  # one event per request on stderr
    logging.getLogger("specdec_rt.engine.tune").setLevel(logging.INFO)  # --precision auto's progress
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    app = create_app(load, opts.app_config(drain_timeout=args.drain_timeout))
    server = _draining_server(_uvicorn_config(args, app), app)
    app.state.serving.on_load_error = server.stop_after_load_error
    _run_ignoring_signals(server)
    return 1 if server.load_failed else 0


def _run_ignoring_signals(server: Any) -> None:
    """Run uvicorn's ``server``. uvicorn re-raises the signal that stopped it once it is done; a
    handler that ignores it makes a drained shutdown exit 0 (what a process manager expects
    after SIGTERM)."""
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _uvicorn_config(args: argparse.Namespace, app: Any) -> Any:
    """uvicorn's Config for ``app`` on ``--host``/``--port`` with the connection limits, the
    drain timeout and the access log of the flags: the single-process server's, and the front of
    ``serve --ray`` (:mod:`~specdec_rt.serve.front`)."""
    import uvicorn

    from .connections import uvicorn_options

    limits = ConnectionLimits(
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        max_header_bytes=args.max_header_bytes,
        max_headers=args.max_headers,
        max_connections=args.max_connections,
        keep_alive_timeout=args.keep_alive_timeout,
        max_connections_per_client=args.max_connections_per_client,
        send_buffer_bytes=args.send_buffer_bytes,
    )
    # past --drain-timeout the app ends what still runs with a 503 / an error event; uvicorn's own
    # limit, which cuts connections off, only backs that up
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        lifespan="on",
        access_log=args.access_log,
        log_level="warning",
        timeout_graceful_shutdown=args.drain_timeout + DRAIN_GRACE_S,
        **uvicorn_options(limits),
    )
    if args.access_log:  # uvicorn set its access logger to log_level (warning), which hides every line
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    return config


def _ignore(sig: int, frame: Any) -> None:
    pass


def _draining_server(config: Any, app: Any) -> Any:
    """uvicorn's server that tells the app to drain (503 for new requests, /health 503) as soon as
    a stop signal arrives, and says where it listens on stderr (uvicorn is imported here)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        load_failed = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit:
                _say("specdec_rt serve: stopping: draining running requests")
            app.state.serving.begin_drain()
            super().handle_exit(sig, frame)

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            for server in self.servers:
                for sock in server.sockets:
                    host, port = sock.getsockname()[:2]
                    _say(
                        f"specdec_rt serve: listening on http://{host}:{port} (GET /health is 200 "
                        "once the model is loaded)"
                    )
            _say_access(app.state.access)  # after the line that says where (`serve | head -1` reads that)

        def stop_after_load_error(self, exc: BaseException) -> None:
            _say(f"specdec_rt: error: {exc}")
            self.load_failed = True
            self.should_exit = True

    return DrainingServer(config)


def run_ray_serve(args: argparse.Namespace, access: Access) -> int:
    """``serve --ray``: start a local Ray instance on loopback (no dashboard, no usage stats, state
    in a temporary folder) or join ``--ray-address``, deploy the replicas, and serve them on
    ``--host``/``--port`` from this process's uvicorn, with the connection limits of the
    single-process server: its app (:mod:`~specdec_rt.serve.front`) relays every request to Ray
    Serve's proxy, bound to 127.0.0.1 on an internal port. On SIGTERM / SIGINT it stops taking
    requests, lets the running ones finish (``--drain-timeout``), deletes the deployment and
    stops what it started (exit 0)."""
    if not args.ray_address:  # before Ray is imported: it reads these once
        from .ray import LOCAL_RAY_ENV

        os.environ.update(LOCAL_RAY_ENV)
    try:
        import ray
        import uvicorn  # noqa: F401 - the 'ray' extra holds it: checked before anything starts
        from ray import serve

        from .front import create_front  # noqa: F401 - (the same)
    except ImportError as exc:
        _say(f"specdec_rt: error: serve --ray needs the 'ray' extra (pip install 'specdec-rt[ray]'): {exc}")
        return 1

    from ..engine.loading import ensure_built

    folder = ensure_built(args.model, allow_build=not args.no_build)
    opts = RayOptions(
        **_options(args, access, folder),
        # auto as without --ray: replicas starting together on one node take turns on the tune
        # file's lock, so the first measures (its siblings wait, loading nothing) and the rest read it
        precision=args.precision or "auto",
        replicas=args.replicas,
        cpus_per_replica=args.cpus_per_replica,
    )
    run = _RayRun(args, ray, serve)  # a busy port fails here, before Ray starts
    _say_access(access)
    try:
        run.serve(opts)
    finally:
        run.close()
    return 0


class _RayRun:
    """One ``serve --ray`` run: the listening socket, Ray (joined or started), Serve's proxy,
    the deployment and the front server relaying to it; :meth:`close` stops what it started."""

    def __init__(self, args: argparse.Namespace, ray: Any, serve: Any) -> None:
        self.args, self.ray, self.serve_api = args, ray, serve
        self.listener: socket.socket | None = _listen(args.host, args.port)
        self.port: int = self.listener.getsockname()[1]
        # a Ray Client driver (ray://...) runs off the cluster: no proxy of Serve's on its loopback
        self.front = not str(args.ray_address or "").startswith("ray://")
        self.stop = threading.Event()
        self.previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        self.temp: str | None = None
        self.server: Any = None
        self.thread: threading.Thread | None = None

    def serve(self, opts: RayOptions) -> None:
        """Start Ray and the deployment, serve until a stop signal, then drain."""
        from .ray import APP_NAME, deployment_app, on_head_node, replica_states

        args = self.args
        self._start_ray()
        for sig in self.previous:  # after ray.init, which installs handlers of its own
            signal.signal(sig, lambda *_: self.stop.set())
        if self.front and args.ray_address and not on_head_node():
            self.front = False
        upstream = self._start_proxy()
        _say(f"specdec_rt serve: deploying {args.replicas} replica(s) on Ray")
        self.serve_api.run(deployment_app(opts), name=APP_NAME, route_prefix="/", blocking=False)
        states = ", ".join(f"{n} {k.lower()}" for k, n in replica_states().items())
        if not args.ray_address:  # a port Ray has no setting for would show here (not --host's own)
            self._warn_open_ports()
        how = "no connection limits" if upstream is None else self._start_front(*upstream)
        _say(
            f"specdec_rt serve: listening on http://{_url_host(args.host)}:{self.port} (Ray Serve replicas: "
            f"{states}; the models are loaded; {how})"
        )
        while not self.stop.wait(0.5):
            pass
        if self.server is not None and self.thread is not None:
            _say("specdec_rt serve: stopping: draining running requests")
            self.server.should_exit = True  # no new connections; the running requests get --drain-timeout
            self.thread.join(args.drain_timeout + 2 * DRAIN_GRACE_S)
        _say("specdec_rt serve: stopping: deleting the deployment")

    def _start_ray(self) -> None:
        """Join ``--ray-address``, or start a local Ray with every process on 127.0.0.1."""
        from .ray import start_local_ray

        address = self.args.ray_address
        try:
            if address:
                self.ray.init(address=address, log_to_driver=False)
            else:
                os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
                self.temp = tempfile.mkdtemp(prefix="specdec-ray-")
                start_local_ray(self.temp)  # every Ray process on 127.0.0.1 (docs/serving.md, "Ray on loopback")
        except Exception as exc:  # noqa: BLE001 - Ray raises many kinds
            where = f"join Ray at --ray-address {address!r}" if address else "start a local Ray"
            raise SpecDecError(f"cannot {where}: {type(exc).__name__}: {exc}") from None

    def _start_proxy(self) -> tuple[str, int] | None:
        """Start Serve's proxy: on loopback behind the front (its ``(host, port)``), or, with no
        front, on ``--host``/``--port`` itself (None: no connection limits)."""
        from .ray import proxy_address

        if not self.front:
            assert self.listener is not None
            self.listener.close()  # Ray's proxy takes the port
            self.listener = None
            _say(
                "specdec_rt serve: warning: the connection limits are not in force: this process is not "
                "on the Ray cluster's head node (or joins through ray://), so no Ray Serve proxy is sure "
                "to run beside it; Ray's proxy listens on --host/--port itself (docs/serving.md, "
                "'Connection limits')"
            )
            self.serve_api.start(http_options={"host": self.args.host, "port": self.port})
            return None
        with socket.socket() as probe:  # Ray's proxy: loopback only, on every node that has one
            probe.bind(("127.0.0.1", 0))
            internal = probe.getsockname()[1]
        self.serve_api.start(proxy_location="EveryNode", http_options={"host": "127.0.0.1", "port": internal})
        proxy_host, internal = proxy_address()  # a Serve already running on the cluster keeps its own
        if proxy_host not in ("127.0.0.1", "localhost"):
            _say(
                f"specdec_rt serve: warning: Serve already runs on this cluster, its proxy on "
                f"{proxy_host}:{internal}, which clients may reach without the connection limits"
            )
        return (proxy_host if proxy_host not in ("0.0.0.0", "::", "localhost") else "127.0.0.1"), internal

    def _warn_open_ports(self) -> None:
        """Warn of a Ray process listening beyond loopback on a port other than ours."""
        from .ray import listening_sockets

        for sock in listening_sockets():
            if not sock.loopback and sock.port != self.port:
                _say(
                    f"specdec_rt serve: warning: Ray's {sock.process} (pid {sock.pid}) listens on "
                    f"{sock.address} port {sock.port}, beyond loopback; Ray has no setting for it "
                    "(docs/serving.md, 'Ray on a cluster')"
                )

    def _start_front(self, upstream: str, internal: int) -> str:
        """Run the front server on the listening socket, in a thread, relaying to Serve's proxy
        at ``upstream:internal``; what it does, in words, once it has started."""
        import uvicorn

        from .front import create_front

        app = create_front(f"http://{_url_host(upstream)}:{internal}", max_body_bytes=self.args.max_body_bytes)
        self.server = server = uvicorn.Server(_uvicorn_config(self.args, app))
        self.thread = thread = threading.Thread(
            target=server.run, kwargs={"sockets": [self.listener]}, name="specdec-front", daemon=True
        )
        thread.start()
        while not server.started:
            if not thread.is_alive():
                raise SpecDecError("the front server did not start (its error is above)")
            time.sleep(0.05)
        return f"connection limits on; relaying to Ray Serve's proxy on {upstream}:{internal}"

    def close(self) -> None:
        """Stop the front, delete the deployment, stop what this run started, restore the
        signal handlers."""
        from .ray import APP_NAME

        if self.server is not None and self.thread is not None and self.thread.is_alive():
            self.server.should_exit = True
            self.thread.join(2 * DRAIN_GRACE_S)
        if self.listener is not None:
            self.listener.close()
        try:
            if self.ray.is_initialized():
                self.serve_api.delete(APP_NAME)
                if not self.args.ray_address:
                    self.serve_api.shutdown()
        finally:
            self.ray.shutdown()
            for sig, handler in self.previous.items():
                signal.signal(sig, handler)
            if self.temp is not None:
                shutil.rmtree(self.temp, ignore_errors=True)


def _listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (0: a free one), not yet listening (uvicorn
    listens on it once the replicas are up; until then a client is refused at once)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SpecDecError(f"cannot listen on --host {host!r} --port {port}: {exc}") from None
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
