"""Attacks that stalled the event loop (issue 43), against `python -m specdec_rt serve` on a real
model, beside a control: /health's worst latency during each attack and during an ordinary n=4
chat request, each attack's status and time to its answer, and the server's resident memory.

    .venv/bin/python scripts/experiments/loop_stalls.py [--model DIR] [--only a,b] [--out FILE]

Each attack runs against a server started for it (model-folder attacks need their own folder: a
hard-linked copy of --model with the template or tokenizer changed). Prints one JSON document.
The bar: /health's worst <= max(100 ms, 3x its worst beside the control), status < 500.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
PATTERN_SCHEMA = {"type": "string", "pattern": "^(a{500}){500}$"}
PUNYCODE_TEMPLATE = "{% for m in messages %}{{ m['content'].encode('punycode') }}{% endfor %}"
CJK = "".join(chr(0x4E00 + i) for i in range(10_000))  # 10k distinct CJK characters


class Poller:
    """GET /health every 10 ms in a thread; the worst latency and the server's peak RSS."""

    def __init__(self, url: str, pid: int) -> None:
        self.url, self.pid = url, pid
        self.worst, self.samples, self.peak_rss, self.failures = 0.0, 0, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Poller":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with httpx.Client(timeout=60) as c:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    c.get(self.url + "/health")
                except httpx.HTTPError:
                    self.failures += 1
                self.worst = max(self.worst, time.perf_counter() - t0)
                self.samples += 1
                self.peak_rss = max(self.peak_rss, rss(self.pid))
                time.sleep(0.01)


def rss(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    m = re.search(r"VmRSS:\s+(\d+) kB", text)
    return int(m.group(1)) * 1024 if m else 0


def start(model: Path, *flags: str) -> tuple[subprocess.Popen, str, list[str]]:
    cmd = [sys.executable, "-m", "specdec_rt", "serve", "--model", str(model), "--port", "0",
           "--precision", "exported", "--slots", "8", *flags]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True).start()
    deadline = time.monotonic() + 300
    url = ""
    while time.monotonic() < deadline and proc.poll() is None:
        m = re.search(r"listening on (http://[\d.]+:\d+)", "".join(lines))
        if m:
            url = m.group(1)
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    return proc, url, lines
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    proc.kill()
    return proc, "", lines


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def post(url: str, path: str, body: object, timeout: float = 120) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    try:
        r = httpx.post(url + path, content=json.dumps(body, separators=(",", ":")).encode(), headers={"content-type": "application/json"},
                       timeout=timeout)  # fmt: skip
        return r.status_code, r.text[:300], time.perf_counter() - t0
    except httpx.HTTPError as exc:
        return -1, f"{type(exc).__name__}: {exc}", time.perf_counter() - t0


def raw(url: str, request: bytes, timeout: float = 10) -> tuple[int, str, float]:
    host, port = url.removeprefix("http://").split(":")
    t0 = time.perf_counter()
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(request)
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
                if b"\r\n\r\n" in data and len(data) > 200:
                    break
        except TimeoutError:
            pass
    m = re.match(rb"HTTP/1\.1 (\d+)", data)
    return (int(m.group(1)) if m else -1), data[:300].decode("latin-1"), time.perf_counter() - t0


def control(url: str) -> tuple[int, str, float]:
    """An ordinary n=4 request (a completion: a model folder's own template is an attack here)."""
    return post(url, "/v1/completions", {"prompt": "Three rivers in Europe are", "n": 4, "max_tokens": 32})


def long_prompt(tokens: int) -> str:
    words = "the river runs past old stone bridges and quiet towns where people walk at dusk".split()
    return " ".join(words[i % len(words)] + str(i % 97) for i in range(tokens // 2))


def attacks(host: str) -> dict[str, object]:
    json_body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    return {
        "grammar_n8": lambda url: post(url, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "say a"}], "n": 8, "max_tokens": 16,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": PATTERN_SCHEMA}}}),
        "tiny_prompts_1mib": lambda url: post(url, "/v1/completions", {"prompt": ["a"] * 255_000, "max_tokens": 1}),
        "echo_logprobs_n6": lambda url: post(url, "/v1/completions", {
            "prompt": long_prompt(2350), "echo": True, "logprobs": 20, "n": 6, "max_tokens": 8}),
        "cl_te": lambda url: raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode()
                                 + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n" % len(json_body) + json_body),
        "dup_content_type": lambda url: raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode()
                                            + b"\r\nContent-Type: application/json\r\nContent-Type: text/plain"
                                            b"\r\nContent-Length: %d\r\n\r\n" % len(json_body) + json_body),
        "template_punycode": lambda url: post(url, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": CJK}], "max_tokens": 4}),
        "expanding_tokenizer": lambda url: post(url, "/v1/completions", {"prompt": "a" * 100_000, "max_tokens": 1}),
    }  # fmt: skip


def linked_copy(src: Path, dst: Path) -> Path:
    """A copy of an export folder whose files are hard links (the manifest is copied)."""
    for path in src.rglob("*"):
        target = dst / path.relative_to(src)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            if path.name in ("manifest.json", "tokenizer.json") or path.name.startswith("."):
                shutil.copyfile(path, target)
            else:
                os.link(path, target)
    return dst


def with_template(src: Path, dst: Path, template: str) -> Path:
    linked_copy(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["tokenizer"]["chat_template"] = template
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def with_expanding_tokenizer(src: Path, dst: Path) -> Path:
    """Every tokenizer.json of the folder (its drafts' too) with a normalizer that writes 1000
    characters for each "a"."""
    linked_copy(src, dst)
    for path in dst.rglob("tokenizer.json"):
        tok = json.loads(path.read_text())
        tok["normalizer"] = {"type": "Replace", "pattern": {"String": "a"}, "content": "a" * 1000}
        data = json.dumps(tok).encode()
        path.write_bytes(data)
        digest = hashlib.sha256(data).hexdigest()
        manifest_path = path.parent / "manifest.json"
        manifest = json.loads(manifest_path.read_text())
        manifest["files"]["tokenizer.json"] = {"sha256": digest, "bytes": len(data)}
        if "sha256" in manifest["tokenizer"]:
            manifest["tokenizer"]["sha256"] = digest
        manifest_path.write_text(json.dumps(manifest))
    for marker in dst.rglob(".specdec-verified.json"):
        marker.unlink()
    return dst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=Path.home() / ".cache/specdec-rt/models/smollm2-135m")
    ap.add_argument("--only", default="")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    only = {s for s in args.only.split(",") if s}
    tmp = Path(tempfile.mkdtemp(prefix="stalls-"))
    folders = {
        "template_punycode": (lambda: with_template(args.model, tmp / "tpl", PUNYCODE_TEMPLATE), ["--request-timeout", "3"]),
        "expanding_tokenizer": (lambda: with_expanding_tokenizer(args.model, tmp / "tok"), []),
    }  # fmt: skip
    results: dict[str, object] = {"model": str(args.model), "cpu": _cpu(), "attacks": {}}
    try:
        by_server: dict[str, list[str]] = {"default": []}
        for name in attacks("x"):
            if only and name not in only:
                continue
            by_server.setdefault(name if name in folders else "default", []).append(name)
        for server, names in by_server.items():
            if not names:
                continue
            model, flags = (folders[server][0](), folders[server][1]) if server in folders else (args.model, [])
            t_load = time.perf_counter()
            proc, url, lines = start(model, *flags)
            if not url:
                for name in names:
                    results["attacks"][name] = {"load": "failed", "load_s": time.perf_counter() - t_load,
                                                "log": "".join(lines)[-600:]}  # fmt: skip
                continue
            host = url.removeprefix("http://")
            try:
                with Poller(url, proc.pid) as p:
                    c = control(url)
                base = p.worst
                for name in names:
                    rss0 = rss(proc.pid)
                    with Poller(url, proc.pid) as p:
                        status, text, seconds = attacks(host)[name](url)
                    bar = max(0.1, 3 * base)
                    results["attacks"][name] = {
                        "status": status, "seconds": round(seconds, 2), "health_worst_ms": round(p.worst * 1000, 1),
                        "control_health_worst_ms": round(base * 1000, 1), "bar_ms": round(bar * 1000, 1),
                        "health_ok": p.worst <= bar, "health_failures": p.failures,
                        "rss_growth_mb": round((p.peak_rss - rss0) / 2**20, 1), "control_status": c[0],
                        "answer": text[:200],
                    }  # fmt: skip
                    print(name, json.dumps(results["attacks"][name]), file=sys.stderr, flush=True)
            finally:
                stop(proc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    doc = json.dumps(results, indent=1)
    print(doc)
    if args.out:
        args.out.write_text(doc)


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
