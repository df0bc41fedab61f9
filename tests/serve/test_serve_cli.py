"""``python -m specdec_rt serve`` as a process: SIGTERM drains it (exit 0), past the drain timeout
the requests left get 503s, bad flags are refused in one line, and a stderr whose reader has gone
does not keep it from stopping."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from serve_util import PROMPT, metric, metric_values, sse_data, start_serve  # noqa: E402

pytestmark = pytest.mark.export

ROOT = Path(__file__).resolve().parents[2]


def test_cli_serve_drains_on_sigterm_and_exits_0(tiny_llama):
    log = _serve_then_sigterm(tiny_llama, "60", _drain_scenario)
    assert "draining" in log and log.count("event='request'") >= 3


def test_cli_serve_past_its_drain_timeout_answers_what_is_left_with_503s(tiny_llama):
    """Requests still admitted when --drain-timeout ends get an OpenAI error body (a stream: an
    error event), not a connection cut by uvicorn; the process still exits 0, no traceback."""
    log = _serve_then_sigterm(tiny_llama, "0.3", _drain_timeout_scenario)
    assert "Traceback" not in log and "Exception in ASGI" not in log, log
    assert "drain_timeout" in log


def _serve_then_sigterm(folder, drain_timeout: str, scenario) -> str:
    """Run ``serve`` on ``folder`` with one slot, ``scenario(url, proc)`` (which sends SIGTERM),
    check the exit status 0; returns the process's log."""
    run = start_serve(folder, "--drain-timeout", drain_timeout)
    try:
        anyio.run(scenario, run.url, run.proc)
        return run.stop()
    finally:
        run.kill()


async def _until_healthy(c) -> None:
    while True:
        try:
            if (await c.get("/health")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.05)


async def _streamed(c, body: dict, started: asyncio.Event) -> list:
    """A streamed completion's SSE events; ``started`` is set at its first bytes."""
    async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        text = ""
        async for chunk in r.aiter_text():
            text += chunk
            started.set()
    return sse_data(text)


async def _drain_timeout_scenario(url: str, proc: subprocess.Popen) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        await _until_healthy(c)
        started = asyncio.Event()
        body = {"prompt": PROMPT, "max_tokens": 480, "temperature": 0}
        first = asyncio.ensure_future(_streamed(c, body, started))
        await started.wait()
        rest = [
            asyncio.ensure_future(_streamed(c, body, started) if i % 2 else c.post("/v1/completions", json=body))
            for i in range(4)
        ]  # queued behind the first: one slot
        await asyncio.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        results = [await first] + [await t for t in rest]
    ended = 0
    for r in results:
        if isinstance(r, list):  # a stream: complete, or one error event and no [DONE]
            assert r[-1] == "[DONE]" or (r[-1]["error"]["code"] == "draining" and "[DONE]" not in r), r[-3:]
            ended += r[-1] != "[DONE]"
        else:
            assert r.status_code in (200, 503), r.text
            assert r.status_code == 200 or r.json()["error"]["code"] == "draining"
            ended += r.status_code == 503
    assert ended >= 3  # at most two of five finish in 0.3 s


async def _until_admitted(c, n: int) -> None:
    """Until the server holds ``n`` requests (running or waiting)."""
    while True:
        values = metric_values((await c.get("/metrics")).text)
        if metric(values, "specdec_requests_running") + metric(values, "specdec_requests_waiting") >= n:
            return
        await asyncio.sleep(0.02)


async def _drain_scenario(url: str, proc: subprocess.Popen) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        await _until_healthy(c)
        started = asyncio.Event()
        body = {"prompt": PROMPT, "max_tokens": 480, "temperature": 0}

        async def stream() -> tuple[list, float]:
            return await _streamed(c, body, started), time.perf_counter()

        tasks = [asyncio.ensure_future(stream()) for _ in range(3)]  # one slot: they run one by one
        await started.wait()
        await _until_admitted(c, 3)  # on a busy machine the last ones may not be in yet
        sigterm_at = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.05)
        try:  # a new request while draining: refused (503, or no longer accepted at all)
            r = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert r.status_code == 503
        except httpx.TransportError:
            pass
        results = await asyncio.gather(*tasks)
    assert max(t for _, t in results) > sigterm_at  # they were in flight at SIGTERM
    for events, _ in results:
        assert events[-1] == "[DONE]"
        finishes = [e["choices"][0]["finish_reason"] for e in events[:-1]]
        assert [f for f in finishes if f] == ["length"]


@pytest.mark.parametrize(
    "args,named",
    [
        (["--port", "70000"], "--port"),
        (["--port", "-1"], "--port"),
        (["--request-timeout", "-1"], "--request-timeout"),
        (["--request-timeout", "nan"], "--request-timeout"),
        (["--drain-timeout", "-1"], "--drain-timeout"),
        (["--drain-timeout", "inf"], "--drain-timeout"),
        (["--host", "999.1.1.1"], "--host"),
        (["--header-timeout", "0"], "--header-timeout"),
        (["--body-timeout", "inf"], "--body-timeout"),
        (["--max-header-bytes", "0"], "--max-header-bytes"),
        (["--max-headers", "-5"], "--max-headers"),
        (["--max-connections", "0"], "--max-connections"),
        (["--keep-alive-timeout", "-1"], "--keep-alive-timeout"),
        (["--slots", "abc"], "'abc'"),
        (["--port", "x80"], "'x80'"),
        (["--header-timeout", "soon"], "'soon'"),
        (["--replicas", "two"], "'two'"),
    ],
)
def test_cli_serve_refuses_bad_flags_in_one_line_before_loading(tiny_llama, args, named):
    """--port 70000 listened on 4464, a negative timeout answered every request 504 or crashed
    the drain, an unresolvable host failed inside uvicorn (QA)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "specdec_rt", "serve", "--model", str(tiny_llama), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode != 0 and named in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "listening" not in proc.stderr and len(proc.stderr.strip().splitlines()) <= 2
    assert "invalid _" not in proc.stderr  # argparse naming our converter, not the value


def test_cli_serve_stops_on_sigterm_when_its_stderr_reader_is_gone(tiny_llama):
    """`serve ... | head -1`: printing "stopping" to a closed pipe raised in the signal handler,
    and the server never stopped (QA)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdec_rt", "serve", "--model", str(tiny_llama), "--port", "0", "--threads", "1"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env=env,
        cwd=ROOT,
    )
    try:
        first = proc.stderr.readline()
        assert b"listening" in first, first
        proc.stderr.close()  # the reader goes away
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
