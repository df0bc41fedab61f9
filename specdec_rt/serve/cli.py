"""``python -m specdec_rt serve``: the OpenAI-compatible server on uvicorn.

Only argparse at import time: ``specdec_rt.cli`` imports this module for every command, and
Starlette / uvicorn (the ``serve`` extra) are needed only when the server runs.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from ..prefix_cache import DEFAULT_BUDGET_BYTES

__all__ = ["add_serve_parser", "run_serve"]


def add_serve_parser(sub) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand to ``sub`` (argparse subparsers); returns its parser, to
    which the caller adds the shared model options (``--model``, ``--draft``, ``--threads``, ...)."""
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the 'serve' extra)",
                       description="Serve /v1/chat/completions, /v1/completions, /v1/models, "
                                   "/health and /metrics (see docs/serving.md).")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--slots", type=_positive, default=8, help="requests generating (and batched) at once (default 8)")
    p.add_argument("--max-queued", type=_non_negative, default=16,
                   help="requests waiting for a slot before new ones get 429 (default 16)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may take, queueing included (default 600; 0: none)")
    p.add_argument("--max-body-bytes", type=_positive, default=1 << 20,
                   help="largest request body; larger ones get 413 (default 1 MiB)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let running requests finish (default 30)")
    p.add_argument("--default-max-tokens", type=_positive, default=256,
                   help="max_tokens when a request sets none (default 256)")
    p.add_argument("--served-model-name", default=None,
                   help="model id in responses and /v1/models (default: the --model value's name)")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="keep finished requests' KV and start new ones from the longest cached prefix (default on)")
    p.add_argument("--prefix-cache-bytes", type=_non_negative, default=DEFAULT_BUDGET_BYTES,
                   help=f"KV memory the prefix cache may hold, all models (default {DEFAULT_BUDGET_BYTES})")
    p.add_argument("--no-build", action="store_true", help="fail instead of building a missing recipe")
    p.add_argument("--access-log", action="store_true", help="uvicorn's per-request access log")
    return p


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def run_serve(args) -> int:
    """Load the model (in the background: ``/health`` answers 503 meanwhile), serve until SIGTERM
    or SIGINT, then drain: new requests get 503, running ones get ``--drain-timeout`` seconds to
    finish, the engine is closed, and the exit status is 0. A model that fails to load exits 1."""
    try:
        import uvicorn

        from .app import create_app
    except ImportError as exc:
        print(f"specdec_rt: error: serve needs the 'serve' extra (pip install 'specdec-rt[serve]'): {exc}",
              file=sys.stderr)
        return 1
    from pathlib import Path

    from ..engine import Engine
    from ..loading import ensure_built

    folder = ensure_built(args.model, allow_build=not args.no_build)  # a missing model fails here, at once
    name = args.served_model_name or Path(str(args.model)).name

    async def load() -> Engine:
        return await Engine.load(folder, draft=args.draft, threads=args.threads, max_length=args.max_length,
                                 provider=args.provider, slots=args.slots, prefix_cache=args.prefix_cache,
                                 prefix_cache_bytes=args.prefix_cache_bytes)

    logging.getLogger("specdec_rt.serve").setLevel(logging.INFO)  # one event per request on stderr
    app = create_app(load, slots=args.slots, max_queued=args.max_queued, model_name=name,
                     request_timeout=args.request_timeout or None, max_body_bytes=args.max_body_bytes,
                     default_max_tokens=args.default_max_tokens)
    config = uvicorn.Config(app, host=args.host, port=args.port, lifespan="on", access_log=args.access_log,
                            log_level="warning", timeout_graceful_shutdown=args.drain_timeout)
    server = _draining_server(config, app)
    app.state.serving.on_load_error = server.stop_after_load_error
    # uvicorn re-raises the signal that stopped it once it is done; a handler that ignores it makes
    # a drained shutdown exit 0 (what a process manager expects after SIGTERM)
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 1 if server.load_failed else 0


def _ignore(sig, frame) -> None:
    pass


def _draining_server(config, app):
    """uvicorn's server that tells the app to drain (503 for new requests, /health 503) as soon as
    a stop signal arrives, and says where it listens on stderr (uvicorn is imported here)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        load_failed = False

        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                print("specdec_rt serve: stopping: draining running requests", file=sys.stderr, flush=True)
            app.state.serving.begin_drain()
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            for server in self.servers:
                for sock in server.sockets:
                    host, port = sock.getsockname()[:2]
                    print(f"specdec_rt serve: listening on http://{host}:{port} (GET /health is 200 "
                          "once the model is loaded)", file=sys.stderr, flush=True)

        def stop_after_load_error(self, exc: BaseException) -> None:
            print(f"specdec_rt: error: {exc}", file=sys.stderr, flush=True)
            self.load_failed = True
            self.should_exit = True

    return DrainingServer(config)
