"""``python -m specdec_rt loadtest``: concurrent streaming clients against an OpenAI-compatible
server on this machine (``python -m specdec_rt serve``, or one started here with ``--model``).

For each concurrency level c, and for each mode at that level in turn (``spec`` then ``ar``, so
both see the same machine noise), c closed-loop clients each send ``POST /v1/chat/completions``
(``stream: true``, the extra body field ``"mode"``) and send the next request as soon as the last
one finished, until the level's request count or time is used up. Per request: time to the first
content chunk (TTFT), the gaps between consecutive content chunks (ITL), end-to-end latency and
the completion tokens of the usage chunk; per (c, mode): tokens/s, percentiles, ok/429/errors
(see :mod:`specdec_rt.tooling.loadtest_report`).

Traffic goes to loopback addresses only (127.0.0.0/8, localhost, ::1); every loop is bounded in
requests and in time. Progress on stderr, the table (or one JSON document with ``--json``) on
stdout, and ``loadtest.json``, ``loadtest.md`` and ``loadtest.png`` in ``--out``.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ..engine.loading import DEFAULT_MODEL, ensure_built
from ..errors import InvalidInputError, SpecDecError
from ..serve.protocol import MAX_TEMPERATURE
from .loadtest_report import OK, REJECTED, RequestSample, format_markdown, format_table, plot, speedups, summarize_phase
from .prompt_files import read_prompt_file
from .reports import write_report
from .sse_client import SSEEvent, SSEParser, interpret, one_request  # noqa: F401 - the client, re-exported

if TYPE_CHECKING:
    import httpx

__all__ = ["add_arguments", "run_loadtest", "check_loopback", "SSEParser", "read_prompts", "LoadTestError"]

MAX_REQUESTS_PER_PHASE = 100_000  # the count bound of a --duration phase
RETRY_AFTER_CAP_S = 5.0  # a 429's Retry-After is honoured up to this


class LoadTestError(SpecDecError):
    """A load-test setting is wrong or the server could not be reached or started."""


def _log(msg: str) -> None:
    print(f"[loadtest] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------- loopback only
def check_loopback(url: str) -> str:
    """``url`` without a trailing slash if its host is a loopback address (127.0.0.0/8,
    ``localhost``, ``::1``); :class:`LoadTestError` otherwise. No name is resolved."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise LoadTestError(f"--url {url!r}: need http://HOST:PORT with a loopback host (e.g. http://127.0.0.1:8000)")
    host = parts.hostname
    if host.lower() != "localhost":
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            ip = None
        mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
        if ip is None or not (ip.is_loopback if mapped is None else mapped.is_loopback):
            raise LoadTestError(
                f"--url {url!r}: the load test only sends traffic to this machine's loopback "
                f"addresses (127.0.0.0/8, localhost, ::1), not to {host!r}"
            )
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise LoadTestError(f"--url {url!r}: {exc}") from None
    return url.rstrip("/")


# ----------------------------------------------------------------------------------- SSE parsing
def read_prompts(path: str | None = None) -> list[list[dict[str, Any]]]:
    """Chat messages per prompt, from the bench's JSONL format (``{"messages": [...]}`` or
    ``{"prompt": "..."}``, sent as one user message; :func:`~specdec_rt.tooling.prompt_files.read_prompt_file`
    checks it); the built-in bench prompts by default."""
    try:
        rows = read_prompt_file(path)
    except InvalidInputError as exc:
        raise LoadTestError(f"--prompts {exc}") from None
    return [r["text"] if isinstance(r["text"], list) else [{"role": "user", "content": r["text"]}] for r in rows]


# ----------------------------------------------------------------------------------- one request
class _Budget:
    """Closed-loop request slots: at most ``count`` requests, none started after ``deadline``."""

    def __init__(self, count: int, seconds: float) -> None:
        self.left, self.deadline, self.issued = count, time.monotonic() + seconds, 0

    def take(self) -> int | None:
        if self.left <= 0 or time.monotonic() >= self.deadline:
            return None
        self.left -= 1
        self.issued += 1
        return self.issued - 1


async def run_phase(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    mode: str,
    *,
    concurrency: int,
    prompts: list[list[dict[str, Any]]],
    max_tokens: int,
    count: int,
    seconds: float,
    timeout_s: float,
    temperature: float = 0.0,
) -> tuple[list[RequestSample], float]:
    """``concurrency`` closed-loop clients until ``count`` requests were sent or ``seconds``
    passed; returns the samples and the phase's wall time. Request i uses prompt i (cycling), so
    each mode at a level sends the same prompt sequence."""
    import anyio

    budget = _Budget(count, seconds)
    samples: list[RequestSample] = []

    async def worker() -> None:
        while (i := budget.take()) is not None:
            body = {
                "model": model,
                "messages": prompts[i % len(prompts)],
                "max_tokens": max_tokens,
                "temperature": temperature,
                "stream": True,
                "stream_options": {"include_usage": True},
                "mode": mode,
            }
            s = await one_request(client, url, body, timeout_s)
            samples.append(s)
            if s.status == REJECTED:  # be a polite client: wait as told (capped, within the phase)
                wait = min(
                    s.retry_after if s.retry_after is not None else 1.0,
                    RETRY_AFTER_CAP_S,
                    max(0.0, budget.deadline - time.monotonic()),
                )
                await anyio.sleep(wait)

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(worker)
    return samples, time.perf_counter() - t0


# ----------------------------------------------------------------------------------- the server
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _die_with_parent() -> None:  # pragma: no cover - runs in the child, between fork and exec
    """Linux: the child gets SIGTERM when this process dies (no orphan after a kill -9)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class ServerProcess:
    """``python -m specdec_rt serve`` on a free loopback port, its output in ``log_path``;
    ``stop()`` sends SIGTERM (SIGKILL after ``grace_s``)."""

    def __init__(self, model: str, *, slots: int, max_queued: int, extra: list[str], log_path: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            sys.executable,
            "-m",
            "specdec_rt",
            "serve",
            "--model",
            model,
            "--port",
            str(self.port),
            "--slots",
            str(slots),
            "--max-queued",
            str(max_queued),
            *extra,
        ]
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        _log(f"starting the server: {shlex.join(self.cmd[1:])} (output in {self.log_path})")
        self._spawn()

    def _spawn(self) -> None:
        """Start ``self.cmd``, its output into ``log_path``; on Linux it dies with this process."""
        self._log_file = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )

    async def wait_ready(self, timeout_s: float) -> float:
        """Poll ``GET /health`` until 200; seconds it took. Fails when the process exits first."""
        import anyio
        import httpx

        proc = self.proc
        if proc is None:
            raise LoadTestError("the server was not started (call start() first)")
        t0 = time.perf_counter()
        async with httpx.AsyncClient(trust_env=False, timeout=2.0) as client:
            while True:
                if proc.poll() is not None:
                    raise LoadTestError(
                        f"the server exited with status {proc.returncode} before it was "
                        f"ready; its last output:\n{self.tail()}"
                    )
                try:
                    if (await client.get(f"{self.url}/health")).status_code == 200:
                        return time.perf_counter() - t0
                except httpx.HTTPError:
                    pass
                if time.perf_counter() - t0 > timeout_s:
                    raise LoadTestError(
                        f"the server was not ready after {timeout_s:g} s (GET /health); its last output:\n{self.tail()}"
                    )
                await anyio.sleep(0.25)

    def tail(self, n: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def stop(self, grace_s: float = 15.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                _log(f"the server did not stop within {grace_s:g} s of SIGTERM: killing it")
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()
        return self.proc.returncode


# ----------------------------------------------------------------------------------- the CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``loadtest`` subcommand's options."""
    _add_server_arguments(p)
    _add_load_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.add_argument(
        "--out",
        default="loadtest-out",
        metavar="DIR",
        help="folder for loadtest.json, .md, .png (default ./loadtest-out)",
    )


def _add_server_arguments(p: argparse.ArgumentParser) -> None:
    """The server under test: ``--url``, or one started here with ``--model`` and its options."""
    target = p.add_mutually_exclusive_group()
    target.add_argument("--url", help="a running server on this machine, e.g. http://127.0.0.1:8000")
    target.add_argument(
        "--model",
        help="start `python -m specdec_rt serve --model MODEL` on a free loopback "
        "port for the test (built first if it is a recipe)",
    )
    p.add_argument(
        "--served-model",
        default=None,
        metavar="NAME",
        help="the requests' 'model' field (default: the first of the server's /v1/models)",
    )
    p.add_argument(
        "--api-key",
        metavar="KEY",
        help="send `Authorization: Bearer KEY` (default: the first key in $SPECDEC_API_KEY, which a "
        "server started with --model also reads)",
    )
    p.add_argument(
        "--slots", type=int, default=None, help="with --model: the server's --slots (default: the highest concurrency)"
    )
    p.add_argument(
        "--max-queued",
        type=int,
        default=None,
        help="with --model: the server's --max-queued (default: the highest concurrency)",
    )
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARGS",
        help="with --model: more server options, e.g. --server-arg='--draft none' (repeatable)",
    )
    p.add_argument(
        "--startup-timeout", type=float, default=300.0, metavar="S", help="seconds to wait for the server's /health"
    )


def _add_load_arguments(p: argparse.ArgumentParser) -> None:
    """The load: levels, modes, requests per phase, what each request asks for, time bounds."""
    bound = p.add_mutually_exclusive_group()
    bound.add_argument(
        "--requests",
        type=int,
        default=None,
        metavar="N",
        help="requests per concurrency level and mode (default 16; 429s count)",
    )
    bound.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="S",
        help="seconds per concurrency level and mode, instead of a request count",
    )
    p.add_argument(
        "--concurrency", default="1,2,4,8", metavar="C,C,...", help="comma-separated client counts (default 1,2,4,8)"
    )
    p.add_argument(
        "--modes", default="spec,ar", metavar="MODE,...", help="comma-separated modes, run in this order per level"
    )
    p.add_argument("--max-tokens", type=int, default=64, metavar="T", help="max_tokens per request (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument(
        "--prompts", default=None, metavar="FILE", help="JSONL prompts, the bench's format (default: built-in)"
    )
    p.add_argument(
        "--warmup", type=int, default=1, metavar="N", help="unmeasured requests per mode before the first level"
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=300.0,
        metavar="S",
        help="with --requests: stop a level's mode after this many seconds anyway (default 300)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="seconds before one request counts as an error (default 120)",
    )


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise LoadTestError(f"--concurrency {text!r}: need positive integers, e.g. 1,2,4,8")
    return levels


def _check(args: argparse.Namespace) -> tuple[list[int], list[str]]:
    levels = _levels(args.concurrency)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("spec", "ar") for m in modes):
        raise LoadTestError(f"--modes {args.modes!r}: choose from spec, ar")
    for name, v in (
        ("requests", args.requests),
        ("duration", args.duration),
        ("max_tokens", args.max_tokens),
        ("time_limit", args.time_limit),
        ("request_timeout", args.request_timeout),
    ):
        if v is not None and v <= 0:
            raise LoadTestError(f"--{name.replace('_', '-')} must be positive, got {v}")
    if args.warmup < 0:
        raise LoadTestError(f"--warmup must be >= 0, got {args.warmup}")
    if not 0 <= args.temperature <= MAX_TEMPERATURE:  # the server's range (OpenAI's); NaN too
        raise LoadTestError(f"--temperature must be in 0..{MAX_TEMPERATURE:g}, got {args.temperature}")
    for name, v in (
        ("duration", args.duration),
        ("time_limit", args.time_limit),
        ("request_timeout", args.request_timeout),
        ("startup_timeout", args.startup_timeout),
    ):
        if v is not None and not math.isfinite(v):
            raise LoadTestError(f"--{name.replace('_', '-')} must be a finite number of seconds, got {v}")
    if args.url:
        args.url = check_loopback(args.url)
        if args.server_arg or args.slots or args.max_queued:
            raise LoadTestError(
                "--slots, --max-queued and --server-arg are for a server started here (--model), not for --url"
            )
    return levels, modes


def api_key(flag: str | None = None) -> str | None:
    """The key the clients send: ``flag`` (``--api-key``), else the first of ``$SPECDEC_API_KEY``
    (the server's own variable, comma separated), else none."""
    if flag:
        return str(flag)
    keys = [k.strip() for k in os.environ.get("SPECDEC_API_KEY", "").split(",") if k.strip()]
    return keys[0] if keys else None


def run_loadtest(args: argparse.Namespace) -> int:
    import anyio

    levels, modes = _check(args)  # before anything is started or imported
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise LoadTestError("the load test needs httpx: pip install -e '.[serve]'") from None
    return anyio.run(_main, args, levels, modes)


async def _main(args: argparse.Namespace, levels: list[int], modes: list[str]) -> int:
    prompts = read_prompts(args.prompts)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = None
    if not args.url:
        model = args.model or DEFAULT_MODEL
        ensure_built(model, say=_log)  # its progress here, not hidden in the server's log
        server = ServerProcess(
            model,
            slots=args.slots or max(levels),
            max_queued=args.max_queued or max(levels),
            extra=[a for extra in args.server_arg for a in shlex.split(extra)],
            log_path=out / "server.log",
        )
        server.start()
    try:
        if server:
            took = await server.wait_ready(args.startup_timeout)
            _log(f"server ready at {server.url} after {took:.1f} s")
        url = server.url if server else args.url
        report = await _run_levels(url, levels, modes, prompts=prompts, args=args)
    finally:
        if server:
            server_status = server.stop()
            _log(f"server stopped (exit status {server_status})")
    report["settings"]["url"] = url
    report["model"] = args.model
    report["server"] = (
        {"cmd": server.cmd[1:], "log": str(server.log_path), "exit_status": server_status} if server else None
    )
    png = plot(report, out / "loadtest.png")
    if png is None:
        _log("matplotlib is not installed: no chart (pip install matplotlib)")
    report["chart"] = str(png) if png else None
    write_report(out, "loadtest", report, format_markdown(report), table=format_table(report), as_json=args.json)
    _log(f"wrote {out / 'loadtest.json'}, {out / 'loadtest.md'}" + (f" and {png}" if png else ""))
    failed = sum(p["ok"] for p in report["phases"]) == 0
    if failed:
        _log("no request succeeded")
    return 1 if failed else 0


async def _served_entry(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    """The first entry of ``GET /v1/models`` (``id``, and from our server ``draft``,
    ``precision``...), else ``{}``; :class:`LoadTestError` when nothing answers at ``url``."""
    import httpx

    try:
        resp = await client.get(f"{url}/v1/models")
    except httpx.TransportError as exc:
        raise LoadTestError(
            f"cannot reach the server at {url}: {type(exc).__name__}: {exc} "
            "(start it with: python -m specdec_rt serve, or use --model)"
        ) from None
    try:
        entry = resp.json()["data"][0] if resp.status_code == 200 else {}
    except (ValueError, KeyError, IndexError, TypeError):
        return {}
    return entry if isinstance(entry, dict) else {}


def _modes_for(modes: list[str], entry: dict[str, Any]) -> list[str]:
    """``modes`` less ``spec`` when the server says it runs no draft (``draft: "none"``: what
    ``serve``'s tuning may choose, or ``--draft none``), which refuses spec requests."""
    if entry.get("draft") != "none" or "spec" not in modes:
        return modes
    left = [m for m in modes if m != "spec"]
    if not left:
        raise LoadTestError(
            "the server runs no draft (GET /v1/models says draft 'none'), so it refuses spec requests; "
            "start it with a draft (serve --precision exported, or --draft ...) or pass --modes ar"
        )
    _log("the server runs no draft (GET /v1/models: draft 'none'): spec mode left out")
    return left


@dataclass(frozen=True)
class _Target:
    """Where the phases send their requests: the client, the server's URL, the served model name
    and the prompts, with the request settings of ``args``."""

    client: httpx.AsyncClient
    url: str
    served: str
    prompts: list[list[dict[str, Any]]]
    args: argparse.Namespace

    async def phase(
        self, mode: str, *, concurrency: int, count: int, seconds: float
    ) -> tuple[list[RequestSample], float]:
        """:func:`run_phase` against this target."""
        return await run_phase(
            self.client,
            self.url,
            self.served,
            mode,
            concurrency=concurrency,
            prompts=self.prompts,
            max_tokens=self.args.max_tokens,
            count=count,
            seconds=seconds,
            timeout_s=self.args.request_timeout,
            temperature=self.args.temperature,
        )


def _client(args: argparse.Namespace, clients: int) -> httpx.AsyncClient:
    """An HTTP client for ``clients`` concurrent streams, with ``--api-key``'s header. No proxy
    from the environment (``trust_env=False``); redirects are not followed (loopback only)."""
    import httpx

    limits = httpx.Limits(max_connections=clients + 2, max_keepalive_connections=clients + 2)
    timeout = httpx.Timeout(args.request_timeout, connect=10.0)
    headers = {"Authorization": f"Bearer {key}"} if (key := api_key(args.api_key)) else None
    return httpx.AsyncClient(trust_env=False, limits=limits, timeout=timeout, headers=headers)


async def _run_levels(
    url: str, levels: list[int], modes: list[str], *, prompts: list[list[dict[str, Any]]], args: argparse.Namespace
) -> dict[str, Any]:
    """The warm-up, then every (level, mode) phase; the report less what :func:`_main` adds."""
    count = args.requests or (MAX_REQUESTS_PER_PHASE if args.duration else 16)
    seconds = args.duration or args.time_limit
    t_start = time.perf_counter()
    async with _client(args, max(levels)) as client:
        entry = await _served_entry(client, url)
        served = args.served_model or str(entry.get("id") or "default")
        target = _Target(client=client, url=url, served=served, prompts=prompts, args=args)
        modes = _modes_for(modes, entry)
        await _warm_up(target, modes, seconds)
        todo = [(c, m) for c in levels for m in modes]
        phases, requests = await _measure(target, todo, count=count, seconds=seconds)
    return {
        "settings": _settings(target, levels, modes, count=count, seconds=seconds),
        "phases": phases,
        "speedup_spec_vs_ar": speedups(phases),
        "total_s": round(time.perf_counter() - t_start, 3),
        "requests": requests,
    }


async def _warm_up(target: _Target, modes: list[str], seconds: float) -> None:
    """``--warmup`` unmeasured requests per mode, one client."""
    args = target.args
    for mode in modes if args.warmup else ():
        budget = min(seconds, args.request_timeout * args.warmup)
        samples, _ = await target.phase(mode, concurrency=1, count=args.warmup, seconds=budget)
        bad = [s for s in samples if s.status != OK]
        _log(
            f"warm-up {mode}: {len(samples) - len(bad)}/{len(samples)} ok"
            + (f" ({bad[0].error or 'HTTP 429'})" if bad else "")
        )


async def _measure(
    target: _Target, todo: list[tuple[int, str]], *, count: int, seconds: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each (concurrency, mode) phase of ``todo`` in turn: the phase summaries and every request."""
    phases: list[dict[str, Any]] = []
    requests: list[dict[str, Any]] = []
    e2e_by_mode: dict[str, float] = {}
    for done, (clients, mode) in enumerate(todo, 1):
        samples, wall = await target.phase(mode, concurrency=clients, count=count, seconds=seconds)
        phase = summarize_phase(samples, wall, clients, mode)
        phases.append(phase)
        requests += [{"concurrency": clients, **s.to_dict()} for s in samples]
        if phase["e2e_p50_ms"] is not None:
            e2e_by_mode[mode] = phase["e2e_p50_ms"] / 1e3
        eta = _eta(todo[done:], target.args, count, e2e_by_mode)
        _log(
            f"[{done}/{len(todo)}] concurrency {clients} {mode}: {_phase_line(phase)} ({wall:.1f} s); ETA {eta}"
            + (f"; e.g. {phase['error_examples'][0]}" if phase["error_examples"] else "")
        )
    return phases, requests


def _phase_line(phase: dict[str, Any]) -> str:
    """A phase's counts, tokens/s and p50 latencies for the progress line."""
    return (
        f"{phase['ok']} ok, {phase['rejected_429']} 429, {phase['errors']} errors, "
        f"{phase['tokens_per_s']:.1f} tok/s, TTFT p50 {_fmt_ms(phase['ttft_p50_ms'])}, "
        f"ITL p50 {_fmt_ms(phase['itl_p50_ms'])}"
    )


def _settings(target: _Target, levels: list[int], modes: list[str], *, count: int, seconds: float) -> dict[str, Any]:
    """The report's settings."""
    args = target.args
    return {
        "concurrency": levels,
        "modes": modes,
        "requests": None if args.duration else count,
        "duration": args.duration,
        "requests_per_phase_bound": count,
        "seconds_per_phase_bound": seconds,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "prompts": args.prompts or "built-in",
        "n_prompts": len(target.prompts),
        "warmup": args.warmup,
        "request_timeout_s": args.request_timeout,
        "served_model": target.served,
    }


def _fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} ms"


def _eta(rest: list[tuple[int, str]], args: argparse.Namespace, count: int, e2e_by_mode: dict[str, float]) -> str:
    """Time left: --duration per phase, or ceil(requests / clients) x the last p50 end-to-end
    latency of that mode (latency grows with load, so this is a lower bound)."""
    if not rest:
        return "0 s"
    if args.duration:
        secs = args.duration * len(rest)
    elif e2e_by_mode:  # a mode not measured yet: the mean of the others
        guess = sum(e2e_by_mode.values()) / len(e2e_by_mode)
        secs = sum(min(math.ceil(count / c) * e2e_by_mode.get(m, guess), args.time_limit) for c, m in rest)
    else:
        return "?"
    return f"{secs / 60:.0f} min" if secs >= 120 else f"{secs:.0f} s"
