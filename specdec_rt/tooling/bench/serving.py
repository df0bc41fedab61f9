"""``python -m specdec_rt bench --serve --llama-cpp BIN_DIR``: our server against llama-server.

Both servers are started here as a user would start them, on free loopback ports, and driven by
the official ``openai`` client (``AsyncOpenAI``, streaming chat completions, temperature 0):

* ours: ``python -m specdec_rt serve --model M --slots S --port P`` (S = the highest
  concurrency level; ``--draft`` / ``--threads`` / ``--max-length`` / ``--provider`` pass through
  when given, the server's defaults otherwise);
* llama-server from ``BIN_DIR``: ``-m GGUF -np S -c S*CTX -t T -tb T --jinja`` (CTX: our
  per-request KV capacity, ``--max-length`` or 4096 capped at the model's positions; T: our
  thread count), the GGUF being the model's source GGUF requantized to Q8_0 with
  llama-quantize (cached; :func:`~specdec_rt.tooling.bench.llamacpp.resolve_ggufs`), or
  ``--llama-gguf FILE``. ``--jinja`` makes it apply the GGUF's chat template.

At each ``--concurrency`` level (default 1,4,8) both servers get the same ``--requests`` requests
(default 16) from that many closed-loop clients; the servers take turns (ours first at the first
level, llama-server first at the next, ...) so machine drift falls on both. Every request is the
held-out chat prompt ``i mod n`` with a tag ``[c-i]`` before its last user message, so no prompt
is answered twice by one server (no cache hit within or across levels) and both servers get the
same messages. One unmeasured warm-up request per server comes first; it also shows whether both
send ``stream_options.include_usage``'s usage chunk: if both do, completion tokens are the
servers' counts; otherwise both are counted by the model's tokenizer on the text.

Per server and level: tokens/s (completion tokens / wall time of the level), TTFT p50/p90,
inter-token latency p50/p90/p99 (gaps between content chunks, pooled), e2e p50 (the load test's
:func:`~specdec_rt.tooling.loadtest_report.summarize_phase`); per level ours/llama-server for
tokens/s and TTFT p50, and how many answers are the same text on both. Also what our server said
at start-up and its ``GET /v1/models``. Writes ``serve.json``, ``serve.md`` and ``serve.png``
(tokens/s and TTFT p50 against requests in flight) in ``--out``. Both servers are stopped at the
end, on an error and on Ctrl-C; on Linux they also die with this process.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import InvalidInputError, SpecDecError
from ..loadtest import LoadTestError, ServerProcess, _free_port, api_key
from ..loadtest_report import ERROR, OK, REJECTED, RequestSample, percentile, plot, summarize_phase
from ..prompt_files import read_prompt_file
from ..reports import write_report
from .args import SERVE_LEVELS, bench_args, parse_levels
from .runner import log, machine_info

if TYPE_CHECKING:
    import openai

    from ...ort.manifest import Manifest
    from ...text.codec import TextCodec

__all__ = [
    "run_serving_bench",
    "tag_messages",
    "summarize_level",
    "compare_levels",
    "format_serving_table",
    "format_serving_markdown",
    "OURS",
    "LLAMA",
]

OURS, LLAMA = "ours", "llama-server"
DEFAULT_REQUESTS = 16
DEFAULT_CTX = 4096  # our per-request KV capacity when --max-length is not given
STARTUP_TIMEOUT_S = 600.0  # a first start may build the model
REQUEST_TIMEOUT_S = 300.0
STARTUP_LOG_LINES = 60  # of our server's output kept in the report

LlamaCommand = Callable[[int], list[str]]  # port -> the llama-server command line


# ----------------------------------------------------------------------------------- pure parts
def tag_messages(messages: list[dict[str, Any]], tag: str) -> list[dict[str, Any]]:
    """A copy of ``messages`` whose last user message starts with ``tag`` (so every request is a
    new prompt); :class:`InvalidInputError` when there is no user message with text."""
    out = [dict(m) for m in messages]
    for m in reversed(out):
        if m.get("role") == "user":
            content = m.get("content")
            if isinstance(content, str):
                m["content"] = f"{tag} {content}"
            elif isinstance(content, list):
                m["content"] = [{"type": "text", "text": tag}, *content]
            else:
                break
            return out
    raise InvalidInputError(f"a prompt has no user message to tag: {messages!r:.200}")


def level_requests(prompts: list[list[dict[str, Any]]], level: int, count: int) -> list[list[dict[str, Any]]]:
    """The ``count`` requests of one level: prompt ``i mod n`` tagged ``[level-i]``."""
    return [tag_messages(prompts[i % len(prompts)], f"[{level}-{i + 1}]") for i in range(count)]


def summarize_level(samples: list[RequestSample], wall_s: float, level: int, server: str) -> dict[str, Any]:
    """The load test's phase summary plus the p90s of TTFT and inter-token latency."""
    p = summarize_phase(samples, wall_s, level, server)
    ok = [s for s in samples if s.status == OK]

    def ms(xs: list[float], q: float) -> float | None:
        v = percentile(xs, q)
        return None if v is None else round(v * 1e3, 3)

    p["ttft_p90_ms"] = ms([s.ttft for s in ok if s.ttft is not None], 90)
    p["itl_p90_ms"] = ms([g for s in ok for g in s.itl], 90)
    return p


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def compare_levels(
    phases: list[dict[str, Any]], texts: dict[tuple[str, int], list[str | None]]
) -> list[dict[str, Any]]:
    """Per level where both servers ran: ours / llama-server for tokens/s and TTFT p50, and how
    many requests both answered (``compared``) with the same text (``identical``). ``texts``:
    ``(server, level) -> text per request`` (None for a failed request)."""
    by = {(p["mode"], p["concurrency"]): p for p in phases}
    out = []
    for level in sorted({p["concurrency"] for p in phases}):
        a, b = by.get((OURS, level)), by.get((LLAMA, level))
        if a is None or b is None:
            continue
        pairs = [
            (x, y)
            for x, y in zip(texts.get((OURS, level), []), texts.get((LLAMA, level), []))
            if x is not None and y is not None
        ]
        out.append(
            {
                "concurrency": level,
                "tokens_per_s_ratio": _ratio(a["tokens_per_s"], b["tokens_per_s"]),
                "ttft_p50_ratio": _ratio(a["ttft_p50_ms"], b["ttft_p50_ms"]),
                "identical": sum(x == y for x, y in pairs),
                "compared": len(pairs),
            }
        )
    return out


def _f(v: float | None, fmt: str, unit: str = "") -> str:
    return "-" if v is None else format(v, fmt) + unit


_COLUMNS = (
    ("tokens_per_s", "tok/s", ".1f", ""),
    ("ttft_p50_ms", "TTFT p50", ".0f", " ms"),
    ("ttft_p90_ms", "TTFT p90", ".0f", " ms"),
    ("itl_p50_ms", "ITL p50", ".1f", " ms"),
    ("itl_p90_ms", "ITL p90", ".1f", " ms"),
    ("itl_p99_ms", "ITL p99", ".1f", " ms"),
    ("e2e_p50_ms", "e2e p50", ".0f", " ms"),
    ("tokens_per_chunk", "tok/chunk", ".2f", ""),
)


def format_serving_table(report: dict[str, Any]) -> str:
    """Plain text: one row per (level, server), then the ratios per level."""
    head = f"{'conc':>4} {'server':<12} {'ok/err':>7} " + " ".join(f"{c[1]:>9}" for c in _COLUMNS)
    rows = [head]
    for p in report["phases"]:
        cells = " ".join(f"{_f(p[k], fmt, unit.strip()):>9}" for k, _, fmt, unit in _COLUMNS)
        rows.append(f"{p['concurrency']:>4} {p['mode']:<12} {p['ok']:>3}/{p['errors'] + p['rejected_429']:<3} {cells}")
    for c in report["comparison"]:
        rows.append(
            f"{c['concurrency']} in flight: ours / llama-server tokens/s = {_f(c['tokens_per_s_ratio'], '.2f', 'x')}, "
            f"TTFT p50 = {_f(c['ttft_p50_ratio'], '.2f', 'x')}; same text {c['identical']}/{c['compared']}"
        )
    return "\n".join(rows)


def _machine_line(machine: dict[str, Any]) -> str:
    """``AMD EPYC, 2 CPUs (avx2, avx512_vnni, ...)``: the CPU every figure depends on."""
    isa = ", ".join(machine.get("isa") or []) or "flags unknown"
    return f"{machine.get('cpu') or machine.get('processor') or 'unknown CPU'}, {machine.get('cpus', '?')} CPUs ({isa})"


def format_serving_markdown(report: dict[str, Any]) -> str:
    """Markdown: the settings, what each server loaded, one row per (level, server), the ratios."""
    s, srv = report["settings"], report["servers"]
    ours, llama = srv.get(OURS, {}), srv.get(LLAMA, {})
    lines = [
        f"Serving benchmark: `{report['model']}` on our server vs llama-server "
        f"({llama.get('gguf') or 'command given'}), {s['requests']} requests per level, "
        f"max_tokens {s['max_new_tokens']}, greedy, {s['n_prompts']} prompts ({s['prompts']}), "
        f"{s['threads']} threads each; completion tokens from {s['token_count']}.",
        "",
        f"Machine: {_machine_line(report.get('machine') or {})}.",
        "",
        f"Our server: `{' '.join(ours.get('cmd', []))}`; GET /v1/models: "
        f"{', '.join(m.get('id', '?') for m in (ours.get('models') or {}).get('data', [])) or '-'}.",
    ]
    said = ours.get("startup_log") or []
    if said:
        lines += ["", "It said at start-up:", "", *[f"    {x}" for x in said]]
    lines += [
        "",
        "| in flight | server | ok / failed | " + " | ".join(c[1] for c in _COLUMNS) + " |",
        "|---" * (3 + len(_COLUMNS)) + "|",
    ]
    for p in report["phases"]:
        cells = " | ".join(_f(p[k], fmt, unit) for k, _, fmt, unit in _COLUMNS)
        lines.append(f"| {p['concurrency']} | {p['mode']} | {p['ok']} / {p['errors'] + p['rejected_429']} | {cells} |")
    lines += [
        "",
        "| in flight | ours / llama-server tokens/s | ours / llama-server TTFT p50 | same text |",
        "|---|---|---|---|",
    ]
    for c in report["comparison"]:
        lines.append(
            f"| {c['concurrency']} | {_f(c['tokens_per_s_ratio'], '.2f', 'x')} | "
            f"{_f(c['ttft_p50_ratio'], '.2f', 'x')} | {c['identical']} / {c['compared']} |"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- the servers
class _Server(ServerProcess):
    """A server process on a free loopback port (the load test's :class:`ServerProcess`, with any
    command line): ``start``, ``wait_ready`` (``GET /health``), ``stop`` (SIGTERM, then SIGKILL)."""

    def __init__(self, name: str, command: LlamaCommand, log_path: Path, avoid: int | None = None) -> None:
        self.name = name
        self.port = _free_port()
        while self.port == avoid:
            self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = command(self.port)
        self.log_path = log_path
        self.proc = None

    def start(self) -> None:
        log(f"starting {self.name}: {' '.join(self.cmd)} (output in {self.log_path})")
        self._spawn()

    async def ready(self, timeout_s: float) -> float:
        try:
            took = await self.wait_ready(timeout_s)
        except LoadTestError as exc:
            raise SpecDecError(f"{self.name}: {exc}") from None
        log(f"{self.name} ready at {self.url} after {took:.1f} s")
        return took

    def lines(self) -> list[str]:
        try:
            return self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []


def _our_command(args: argparse.Namespace, slots: int) -> LlamaCommand:
    extra: list[str] = []
    for flag, value in (
        ("--draft", args.draft),
        ("--threads", args.threads),
        ("--max-length", args.max_length),
        ("--provider", None if args.provider == "auto" else args.provider),
    ):
        if value is not None:
            extra += [flag, str(value)]
    model = args.model

    def command(port: int) -> list[str]:
        return [sys.executable, "-m", "specdec_rt", "serve", "--model", str(model), "--slots", str(slots),
                "--port", str(port), *extra]  # fmt: skip

    return command


def llama_server_command(binary: Path, gguf: Path, *, slots: int, ctx: int, threads: int) -> LlamaCommand:
    """llama-server with ``slots`` parallel slots of ``ctx`` tokens each, ``threads`` threads for
    generation and batches, the GGUF's chat template (``--jinja``), on 127.0.0.1."""

    def command(port: int) -> list[str]:
        return [str(binary), "-m", str(gguf), "-np", str(slots), "-c", str(slots * ctx), "-t", str(threads),
                "-tb", str(threads), "--port", str(port), "--host", "127.0.0.1", "--jinja"]  # fmt: skip

    return command


def _llama_gguf(args: argparse.Namespace, manifest: Manifest) -> Path:
    from .llamacpp import find_tools, resolve_ggufs

    if args.llama_gguf:
        files = resolve_ggufs(args.llama_gguf, {}, manifest, log)
        if len(files) != 1:
            raise InvalidInputError(f"--serve takes one --llama-gguf file, got {len(files)}: {args.llama_gguf}")
        return next(iter(files.values()))
    ggufs = resolve_ggufs(None, find_tools(args.llama_cpp), manifest, log)
    if "q8_0" not in ggufs:
        raise SpecDecError(f"no Q8_0 GGUF was made from the model's source GGUF (have {sorted(ggufs)})")
    return ggufs["q8_0"]


def _find_server(bin_dir: str) -> Path:
    d = Path(bin_dir).expanduser()
    if not d.is_dir():
        raise SpecDecError(f"--llama-cpp {bin_dir}: no such folder (scripts/build-llama-cpp prints the bin folder)")
    binary = d / "llama-server"
    if not binary.is_file():
        raise SpecDecError(f"--llama-cpp {bin_dir}: no llama-server there (scripts/build-llama-cpp builds it)")
    return binary


# ----------------------------------------------------------------------------------- the client
async def one_chat(
    client: Any,  # openai.AsyncOpenAI: its create() overloads want the messages as its TypedDicts
    model: str,
    messages: list[dict[str, Any]],
    *,
    max_tokens: int,
    include_usage: bool,
    server: str,
) -> tuple[RequestSample, str | None]:
    """One streaming chat completion, timed chunk by chunk: the sample and the text (None when
    the request failed)."""
    import openai

    s = RequestSample(server)
    parts: list[str] = []
    t0 = time.perf_counter()
    last = None
    try:
        extra = {"stream_options": {"include_usage": True}} if include_usage else {}
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True, **extra
        )
        async for chunk in stream:
            now = time.perf_counter() - t0
            if chunk.usage is not None:
                s.completion_tokens, s.usage_reported = chunk.usage.completion_tokens, True
            for choice in chunk.choices:
                text = choice.delta.content if choice.delta is not None else None
                if text:
                    parts.append(text)
                    s.chunks += 1
                    if s.ttft is None:
                        s.ttft = now
                    elif last is not None:
                        s.itl.append(now - last)
                    last = now
        s.e2e = time.perf_counter() - t0
        s.status = OK
        return s, "".join(parts)
    except openai.RateLimitError as exc:
        s.status, s.error = REJECTED, f"HTTP 429: {exc.message}"
    except openai.APIStatusError as exc:
        s.status, s.error = ERROR, f"HTTP {exc.status_code}: {exc.message}"
    except Exception as exc:  # noqa: BLE001 - a stream cut off mid-way raises its HTTP library's errors
        cause = f" ({type(exc.__cause__).__name__}: {exc.__cause__})" if exc.__cause__ is not None else ""
        s.status, s.error = ERROR, f"{type(exc).__name__}: {exc}{cause}"
    s.e2e = time.perf_counter() - t0
    return s, None


async def run_level(
    client: openai.AsyncOpenAI,
    model: str,
    server: str,
    level: int,
    *,
    requests: list[list[dict[str, Any]]],
    max_tokens: int,
    include_usage: bool,
) -> tuple[list[RequestSample], list[str | None], float]:
    """``level`` closed-loop clients through ``requests`` in order: samples and texts per request
    (in request order) and the level's wall time."""
    import anyio

    samples: list[RequestSample | None] = [None] * len(requests)
    texts: list[str | None] = [None] * len(requests)
    it = iter(range(len(requests)))

    async def worker() -> None:
        for i in it:  # one shared iterator: each client takes the next request when it is free
            samples[i], texts[i] = await one_chat(
                client, model, requests[i], max_tokens=max_tokens, include_usage=include_usage, server=server
            )

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(min(level, len(requests))):
            tg.start_soon(worker)
    wall = time.perf_counter() - t0
    return [s for s in samples if s is not None], texts, wall


# ----------------------------------------------------------------------------------- the run
def run_serving_bench(args: argparse.Namespace, llama_command: LlamaCommand | None = None) -> int:
    """The benchmark (module docstring). ``llama_command``: the command line that stands in for
    llama-server (port -> argv); by default llama-server from ``args.llama_cpp``."""
    import anyio

    try:
        import openai  # noqa: F401
    except ImportError:
        raise SpecDecError(
            "bench --serve drives both servers with the openai client: pip install -e '.[bench]'"
        ) from None
    return anyio.run(_main, args, llama_command)


@dataclass
class _Plan:
    """What both servers are given: the levels, requests per level, prompts and shared settings."""

    levels: list[int]
    count: int
    prompts: list[list[dict[str, Any]]]
    folder: Path
    manifest: Manifest
    threads: int
    slots: int
    ctx: int  # per-slot context
    max_tokens: int


@dataclass
class _Results:
    """What the run measured: phases, every request, texts per (server, level), the servers'
    turns per level, their ``GET /v1/models``, our server's start-up lines, how tokens were counted."""

    phases: list[dict[str, Any]] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    texts: dict[tuple[str, int], list[str | None]] = field(default_factory=dict)
    order: list[list[str]] = field(default_factory=list)
    info: dict[str, dict[str, Any]] = field(default_factory=dict)
    said: list[str] = field(default_factory=list)
    token_count: str = ""


def _plan(args: argparse.Namespace, llama_command: LlamaCommand | None) -> tuple[_Plan, Path | None]:
    """The run's plan, and llama-server's binary (None when ``llama_command`` stands in for it);
    a wrong ``--llama-cpp`` folder fails before the model is built."""
    from ...engine.loading import ensure_built
    from ...ort import default_threads
    from ...ort.manifest import load_manifest

    bench_args(args)
    levels = parse_levels(args.concurrency or SERVE_LEVELS)  # (check_bench_args reads it the same way)
    rows = read_prompt_file(args.prompts, "data/chat_heldout.jsonl")
    prompts = [r["text"] if isinstance(r["text"], list) else [{"role": "user", "content": r["text"]}] for r in rows]
    binary = _find_server(args.llama_cpp) if llama_command is None else None
    folder = ensure_built(args.model, say=log)
    manifest = load_manifest(folder)
    plan = _Plan(
        levels=levels,
        count=args.requests or DEFAULT_REQUESTS,
        prompts=prompts[: args.limit] if args.limit else prompts,
        folder=folder,
        manifest=manifest,
        threads=args.threads or default_threads(),
        slots=max(levels),
        ctx=min(args.max_length or DEFAULT_CTX, manifest.raw["architecture"]["max_positions"]),
        max_tokens=args.max_new_tokens,
    )
    return plan, binary


async def _main(args: argparse.Namespace, llama_command: LlamaCommand | None) -> int:
    plan, binary = _plan(args, llama_command)
    gguf = None
    if llama_command is None:
        assert binary is not None
        gguf = _llama_gguf(args, plan.manifest)
        llama_command = llama_server_command(binary, gguf, slots=plan.slots, ctx=plan.ctx, threads=plan.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ours = _Server(OURS, _our_command(args, plan.slots), out / "server-ours.log")
    llama = _Server(LLAMA, llama_command, out / "server-llama.log", avoid=ours.port)
    servers = {OURS: ours, LLAMA: llama}
    report: dict[str, Any] = {
        "model": plan.manifest.name,
        "machine": machine_info(plan.threads),
        "settings": _settings(args, plan),
    }
    try:
        results = await _run_servers(servers, plan)
    finally:
        status = {name: srv.stop() if srv.proc is not None else None for name, srv in servers.items()}
        log(f"servers stopped (exit status: ours {status[OURS]}, llama-server {status[LLAMA]})")
    report["settings"]["token_count"] = results.token_count
    report["servers"] = _servers_report(servers, status, results, gguf)
    report["order"] = results.order
    report["phases"] = results.phases
    report["comparison"] = compare_levels(results.phases, results.texts)
    report["requests_log"] = results.records
    png = plot(report, out / "serve.png")
    if png is None:
        log("matplotlib is not installed: no chart (pip install -e '.[bench]')")
    report["chart"] = str(png) if png else None
    write_report(
        out, "serve", report, format_serving_markdown(report), table=format_serving_table(report), as_json=args.json
    )
    log(f"wrote {out / 'serve.json'}, {out / 'serve.md'}" + (f" and {png}" if png else ""))
    return 0 if all(p["ok"] for p in results.phases) else 1


def _settings(args: argparse.Namespace, plan: _Plan) -> dict[str, Any]:
    return {
        "concurrency": plan.levels,
        "requests": plan.count,
        "max_new_tokens": plan.max_tokens,
        "prompts": args.prompts or "built-in chat_heldout.jsonl",
        "n_prompts": len(plan.prompts),
        "threads": plan.threads,
        "slots": plan.slots,
        "per_slot_context": plan.ctx,
        "decoding": "greedy (temperature 0)",
    }


def _servers_report(
    servers: dict[str, _Server], status: dict[str, int | None], results: _Results, gguf: Path | None
) -> dict[str, dict[str, Any]]:
    """Per server: its command line, URL, log, exit status, ``GET /v1/models``; ours: what it
    said at start-up; llama-server: the GGUF and llama.cpp's version."""
    ours, llama = servers[OURS], servers[LLAMA]
    return {
        OURS: {
            "cmd": ours.cmd[1:],
            "url": ours.url,
            "log": str(ours.log_path),
            "exit_status": status[OURS],
            "models": results.info[OURS],
            "startup_log": results.said,
        },
        LLAMA: {
            "cmd": llama.cmd,
            "url": llama.url,
            "log": str(llama.log_path),
            "exit_status": status[LLAMA],
            "models": results.info[LLAMA],
            "gguf": str(gguf) if gguf else None,
            "version": _llama_version(llama.cmd[0]) if gguf else None,
        },
    }


async def _run_servers(servers: dict[str, _Server], plan: _Plan) -> _Results:
    """Start both servers, wait until they are ready, then warm up and measure every level."""
    import openai

    for srv in servers.values():
        srv.start()
    for srv in servers.values():
        await srv.ready(STARTUP_TIMEOUT_S)
    results = _Results(said=servers[OURS].lines()[:STARTUP_LOG_LINES])  # until ready: what it loaded
    key = api_key() or "none"  # (bench --serve has no --api-key: $SPECDEC_API_KEY, as the servers read it)
    # the openai package's own HTTP client (its HTTP library), without proxies from the environment;
    # "Connection: close": a new loopback connection per request, never one the server has just
    # closed for idling (llama-server does after a few seconds: an instant connection error)
    http = openai.DefaultAsyncHttpxClient(trust_env=False, timeout=REQUEST_TIMEOUT_S)
    async with http:
        clients = {
            name: openai.AsyncOpenAI(
                base_url=f"{srv.url}/v1",
                api_key=key,
                max_retries=0,
                timeout=REQUEST_TIMEOUT_S,
                http_client=http,
                default_headers={"Connection": "close"},
            )
            for name, srv in servers.items()
        }
        results.info = {name: await _models(http, srv.url, key) for name, srv in servers.items()}
        driver = _Driver(clients, {name: _first_id(results.info[name]) for name in servers}, plan, results)
        await driver.warm_up()
        for index, level in enumerate(plan.levels):
            turn = [OURS, LLAMA] if index % 2 == 0 else [LLAMA, OURS]
            results.order.append(turn)
            requests = level_requests(plan.prompts, level, plan.count)
            for name in turn:
                await driver.level(name, level, requests)
    return results


class _Driver:
    """Sends the requests to both servers through their clients, into ``results``."""

    def __init__(
        self, clients: dict[str, openai.AsyncOpenAI], served: dict[str, str], plan: _Plan, results: _Results
    ) -> None:
        self.clients, self.served, self.plan, self.results = clients, served, plan, results
        self.include_usage = True
        self.codec: TextCodec | None = None

    async def warm_up(self) -> None:
        """One request per server; whether both send a usage chunk decides how tokens are counted."""
        warm = tag_messages(self.plan.prompts[0], "[warm-up]")
        usage = {}
        for name, client in self.clients.items():
            sample, _ = await one_chat(
                client, self.served[name], warm, max_tokens=self.plan.max_tokens, include_usage=True, server=name
            )
            if sample.status != OK:
                raise SpecDecError(f"{name}: the warm-up request failed: {sample.error}")
            usage[name] = sample.usage_reported
            log(f"warm-up {name}: {sample.e2e or 0:.2f} s, usage chunk {'yes' if sample.usage_reported else 'no'}")
        self.include_usage = all(usage.values())
        self.codec = None if self.include_usage else _codec(self.plan.folder)
        self.results.token_count = (
            "the servers' usage chunks" if self.include_usage else "our tokenizer on the text (a server sent no usage)"
        )

    async def level(self, name: str, level: int, requests: list[list[dict[str, Any]]]) -> None:
        """``requests`` to server ``name`` from ``level`` clients: one phase, its requests, its texts."""
        samples, got, wall = await run_level(
            self.clients[name],
            self.served[name],
            name,
            level,
            requests=requests,
            max_tokens=self.plan.max_tokens,
            include_usage=self.include_usage,
        )
        if self.codec is not None:
            for sample, text in zip(samples, got):
                if text is not None:
                    sample.completion_tokens = len(self.codec.tokenizer.encode(text, add_special_tokens=False).ids)
        phase = summarize_level(samples, wall, level, name)
        self.results.phases.append(phase)
        self.results.texts[name, level] = got
        self.results.records += [
            {"server": name, "concurrency": level, "request": i, **sample.to_dict(), "text": t}
            for i, (sample, t) in enumerate(zip(samples, got))
        ]
        log(
            f"{level} in flight, {name}: {phase['ok']}/{phase['requests']} ok, {phase['tokens_per_s']:.1f} tok/s, "
            f"TTFT p50 {_f(phase['ttft_p50_ms'], '.0f', ' ms')}, ITL p50 {_f(phase['itl_p50_ms'], '.1f', ' ms')}"
            f" ({wall:.1f} s)" + (f"; e.g. {phase['error_examples'][0]}" if phase["error_examples"] else "")
        )


async def _models(http: openai.DefaultAsyncHttpxClient, url: str, key: str) -> dict[str, Any]:
    """``GET /v1/models`` as JSON (``{}`` when it is not JSON)."""
    resp = await http.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})
    try:
        body = resp.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _first_id(models: dict[str, Any]) -> str:
    try:
        return str(models["data"][0]["id"])
    except (KeyError, IndexError, TypeError):
        return "default"


def _codec(folder: Path) -> TextCodec:
    from ...ort.manifest import load_manifest
    from ...text.codec import TextCodec

    return TextCodec.from_manifest(load_manifest(folder))


def _llama_version(binary: str) -> str | None:
    from .llamacpp import _version

    return _version(Path(binary))
