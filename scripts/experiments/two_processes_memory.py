"""Two engine processes on one export: the memory the second adds, with and without the shared
(prepacked, memory-mapped) weights of ``Engine.load(shared_weights=...)``
(docs/lab-notes/2026-12-07-memory.md, docs/memory.md).

Per round and setting ("private": ``shared_weights=False``, "shared": ``True``; the order
alternates per round): process A loads the model (its default draft unless ``--draft``), decodes
``--tokens`` greedy tokens of a chat request twice (past end-of-sequence; the first's first token
timed, and the second's ms per token after its first) and waits; its memory is read from
``/proc/PID/smaps_rollup`` while it is alone. Then process B does the same with A alive, and both
are read. "Second adds" is B's private memory (USS: Private_Clean + Private_Dirty, the pages no
other process maps) over A's resident memory alone: what a second server costs the machine. Load
seconds and ms per token are each process's own. Before the rounds, one process loads with
``shared_weights=True`` so the copies exist (its load time, which builds them, is reported apart).

The copies go to ``--prepack-dir`` (default: a temporary folder, removed at the end), so the
user's cache is left alone. Linux only (smaps_rollup).

``--serve``: the processes are servers (``python -m specdec_rt serve --precision exported``),
ready when ``/health`` answers; one chat completion of ``--tokens`` is timed over HTTP (ms per
token over the whole request).

    .venv/bin/python scripts/experiments/two_processes_memory.py [--model smollm2-135m-q8]
        [--draft none] [--tokens 32] [--rounds 2] [--threads 1] [--serve] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle."}]
FIELDS = ("Rss", "Pss", "Private_Clean", "Private_Dirty", "Shared_Clean", "Anonymous")


def smaps(pid: int) -> dict[str, int]:
    """The process's ``smaps_rollup`` figures of :data:`FIELDS`, in KiB."""
    found = {}
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in FIELDS:
                found[name] = int(rest.split()[0])
    return found


# ---------------------------------------------------------------------- the child: one engine
async def child(args: argparse.Namespace) -> None:
    """Load, decode twice, report one JSON line on stdout, then wait for stdin to close."""
    from specdec_rt import Engine

    started = time.perf_counter()
    engine = await Engine.load(
        args.model,
        draft=args.draft,
        threads=args.threads,
        slots=1,
        warmup=False,
        shared_weights=args.shared == "1",
    )
    load_s = time.perf_counter() - started
    options: dict[str, Any] = dict(max_new_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    first = await engine.generate(PROMPT, **options)  # (the prompt new to the prefix cache)
    result = await engine.generate(PROMPT, **options)
    stats = result.stats
    decode_s = stats.time_total - stats.time_to_first_token
    report = {
        "load_s": round(load_s, 3),
        "ms_per_token": round(1000 * decode_s / max(1, stats.new_tokens - 1), 2),
        "ttft_ms": round(1000 * first.stats.time_to_first_token, 1),
        "tokens": list(result.token_ids),
        "prepacked": [str(getattr(m, "prepacked", None)) for m in engine.models],
    }
    print(json.dumps(report), flush=True)
    sys.stdin.read()  # until the parent closes it
    await engine.aclose()


# ---------------------------------------------------------------------- the parent
class Child:
    """A child process running :func:`child`; ``report`` once it has loaded and decoded."""

    def __init__(self, args: argparse.Namespace, shared: bool) -> None:
        cmd = [sys.executable, __file__, "--child", "--shared", "1" if shared else "0", "--model", args.model]
        cmd += ["--tokens", str(args.tokens), "--threads", str(args.threads)]
        cmd += ["--draft", args.draft] if args.draft else []
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            raise SystemExit(f"child exited with {self.proc.wait()}")
        self.report: dict[str, Any] = json.loads(line)

    def memory(self) -> dict[str, int]:
        return smaps(self.proc.pid)

    def stop(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerChild(Child):
    """``python -m specdec_rt serve`` on a free port (``--precision exported``): ready once
    ``/health`` answers 200; then one greedy completion of ``--tokens`` is timed (after one
    untimed), and ``report`` holds what :func:`child` reports (the text for the tokens)."""

    def __init__(self, args: argparse.Namespace, shared: bool) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "specdec_rt", "serve", "--model", args.model, "--port", str(self.port)]
        cmd += ["--precision", "exported", "--threads", str(args.threads), "--no-build"]
        cmd += ["--shared-weights" if shared else "--no-shared-weights"]
        cmd += ["--draft", args.draft] if args.draft else []
        started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while self._get("/health") != 200:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited with {self.proc.returncode}")
            time.sleep(0.05)
        load_s = time.perf_counter() - started
        self._complete(args.tokens)
        started = time.perf_counter()
        text, tokens = self._complete(args.tokens)
        ms = 1000 * (time.perf_counter() - started) / max(1, tokens)
        self.report = {"load_s": round(load_s, 3), "ms_per_token": round(ms, 2), "ttft_ms": 0.0}
        self.report.update(tokens=[text], prepacked=[])

    def _get(self, path: str) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as reply:
                return int(reply.status)
        except (OSError, urllib.error.HTTPError):
            return 0

    def _complete(self, tokens: int) -> tuple[str, int]:
        body = {"model": "m", "messages": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/chat/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=600) as reply:
            answer = json.loads(reply.read())
        return answer["choices"][0]["message"]["content"], int(answer["usage"]["completion_tokens"])

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)


def one_pair(args: argparse.Namespace, shared: bool) -> dict[str, Any]:
    """A alone, then B beside A: their memory (MiB), load seconds and ms per token."""
    kind = ServerChild if args.serve else Child
    first = kind(args, shared)
    try:
        alone = first.memory()
        second = kind(args, shared)
        try:
            both = (first.memory(), second.memory())
        finally:
            second.stop()
    finally:
        first.stop()
    uss = both[1]["Private_Clean"] + both[1]["Private_Dirty"]
    return {
        "setting": "shared" if shared else "private",
        "first_alone_mb": {k: v // 1024 for k, v in alone.items()},
        "first_mb": {k: v // 1024 for k, v in both[0].items()},
        "second_mb": {k: v // 1024 for k, v in both[1].items()},
        "second_uss_mb": uss // 1024,
        "second_adds": round(uss / alone["Rss"], 4),
        "load_s": [first.report["load_s"], second.report["load_s"]],
        "ms_per_token": [first.report["ms_per_token"], second.report["ms_per_token"]],
        "ttft_ms": [first.report["ttft_ms"], second.report["ttft_ms"]],
        "tokens": first.report["tokens"],
        "same_tokens": first.report["tokens"] == second.report["tokens"],
        "prepacked": first.report["prepacked"],
    }


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per setting, and whether every process decoded the same tokens."""
    out: dict[str, Any] = {}
    for setting in ("private", "shared"):
        mine = [r for r in rows if r["setting"] == setting]
        out[setting] = {
            "first_alone_rss_mb": statistics.median(r["first_alone_mb"]["Rss"] for r in mine),
            "second_rss_mb": statistics.median(r["second_mb"]["Rss"] for r in mine),
            "second_pss_mb": statistics.median(r["second_mb"]["Pss"] for r in mine),
            "second_uss_mb": statistics.median(r["second_uss_mb"] for r in mine),
            "second_adds": statistics.median(r["second_adds"] for r in mine),
            "load_s": statistics.median(x for r in mine for x in r["load_s"]),
            "ms_per_token": statistics.median(x for r in mine for x in r["ms_per_token"]),
            "ttft_ms": statistics.median(x for r in mine for x in r["ttft_ms"]),
        }
    out["same_tokens"] = len({tuple(r["tokens"]) for r in rows}) == 1 and all(r["same_tokens"] for r in rows)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    build = (ServerChild if args.serve else Child)(args, True)  # writes the copies (or finds them)
    build_s = time.perf_counter() - started
    build_report = build.report
    build.stop()
    rows = []
    for i in range(args.rounds):
        for shared in (False, True) if i % 2 == 0 else (True, False):
            rows.append(one_pair(args, shared))
            keys = ("setting", "second_adds", "load_s", "ms_per_token", "ttft_ms")
            print(json.dumps({k: rows[-1][k] for k in keys}), flush=True)
    return {
        "model": args.model,
        "processes": "serve" if args.serve else "engine",
        "draft": args.draft,
        "threads": args.threads,
        "tokens": args.tokens,
        "first_shared_load_s": build_report["load_s"],
        "first_shared_process_s": round(build_s, 2),
        "summary": summary(rows),
        "rows": rows,
    }


def table(result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = [
        "| weights | first alone RSS | second: RSS, PSS, USS | second adds | load s | ms/token | first token ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for setting in ("private", "shared"):
        r = s[setting]
        lines.append(
            f"| {setting} | {r['first_alone_rss_mb']:.0f} MB | {r['second_rss_mb']:.0f}, {r['second_pss_mb']:.0f}, "
            f"{r['second_uss_mb']:.0f} MB | {100 * r['second_adds']:.1f}% | {r['load_s']:.2f} | {r['ms_per_token']:.1f} | {r['ttft_ms']:.0f} |"
        )
    lines.append(f"\nsame greedy tokens in every process: {s['same_tokens']}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-q8")
    p.add_argument("--draft", default=None, help="Engine.load's draft (default: the model's default)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prepack-dir", default=None, help="where the copies go (default: a temporary folder)")
    p.add_argument("--serve", action="store_true", help="server processes (python -m specdec_rt serve), not engines")
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shared", default="1", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        asyncio.run(child(args))
        return
    with tempfile.TemporaryDirectory(prefix="prepacked-") as tmp:
        os.environ["SPECDEC_RT_PREPACK_DIR"] = args.prepack_dir or tmp  # (the children inherit it)
        result = run(args)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
