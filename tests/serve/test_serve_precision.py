"""``serve --precision``: the choice of target and draft is in the load line and in /v1/models;
``auto`` (the default) measures once and stores the result, which ``tune`` then reads."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from serve_util import client, start_serve  # noqa: E402

from specdec_rt import Engine  # noqa: E402
from specdec_rt.serve import create_app  # noqa: E402

pytestmark = pytest.mark.export

ROOT = Path(__file__).resolve().parents[2]
INT4 = "greedy output is exact to the int4 target (int4 weights, int8 activations)"


def test_v1_models_carries_the_choice(tiny_llama):
    async def go():
        async with await Engine.load(tiny_llama, precision="int4", threads=1, slots=1, warmup=False) as engine:
            async with client(create_app(engine, model_name="tiny")) as c:
                listed = (await c.get("/v1/models")).json()["data"]
                one = (await c.get("/v1/models/tiny")).json()
        return listed, one

    listed, one = anyio.run(go)
    want = {"precision": "int4", "draft": "ngram", "chosen_by": "pinned", "exact_to": INT4}
    assert len(listed) == 1 and listed[0]["id"] == "tiny" and {k: listed[0][k] for k in want} == want
    assert one == listed[0]


async def _models_when_ready(url: str) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        for _ in range(1200):
            try:
                if (await c.get("/health")).status_code == 200:
                    return (await c.get("/v1/models")).json()["data"][0]
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError("not ready within a minute")


def test_the_load_line_says_what_runs(tiny_llama):
    run = start_serve(tiny_llama, "--precision", "int4", "--served-model-name", "tiny")
    try:
        entry = anyio.run(_models_when_ready, run.url)
        log = run.stop()
    finally:
        run.kill()
    assert f"specdec_rt serve: loaded tiny: int4 target, draft ngram (pinned); {INT4}" in log, log
    assert entry["precision"] == "int4" and entry["chosen_by"] == "pinned"


def test_auto_is_the_default_tunes_once_and_tune_reads_it(tiny_llama, tmp_path):
    """``serve`` without --precision measures (its progress on stderr) and stores the choice;
    ``tune`` with the same settings then shows it from the cache."""
    cache = tmp_path / "cache"
    run = start_serve(
        tiny_llama, "--precision", "auto", env={"SPECDEC_RT_CACHE": str(cache), "SPECDEC_RT_TUNE_DIR": None}
    )  # serve's default
    try:
        entry = anyio.run(_models_when_ready, run.url)
        log = run.stop()
    finally:
        run.kill()
    assert entry["chosen_by"] == "tuned" and entry["precision"] in ("float32", "int4"), entry
    assert "tuning llama-onnx on this machine" in log and "(tuned on this machine)" in log, log
    assert len(list((cache / "tune").glob("*.json"))) == 1

    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECDEC_RT_CACHE": str(cache), "SPECDEC_RT_TUNE_DIR": ""}
    tune = subprocess.run(
        [sys.executable, "-m", "specdec_rt", "tune", str(tiny_llama), "--slots", "1", "--threads", "1", "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert tune.returncode == 0, tune.stderr
    doc = json.loads(tune.stdout)
    assert doc["choice"]["chosen_by"] == "cached" and doc["choice"]["exact_to"] == entry["exact_to"]
    assert (doc["choice"]["precision"], doc["choice"]["draft"]) == (entry["precision"], entry["draft"])
    assert doc["rows"][doc["chosen"]]["exact"] is True


def test_serve_refuses_an_unknown_precision_before_loading(tiny_llama):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "specdec_rt", "serve", "--model", str(tiny_llama), "--precision", "fp8"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 2 and "--precision" in proc.stderr and "'fp8'" in proc.stderr, proc.stderr
    assert "listening" not in proc.stderr


def test_a_server_without_a_draft_decodes_plainly_unless_asked_to_speculate(tiny_llama):
    """``--precision auto`` may choose plain decoding (draft none): requests that name no mode
    are answered plainly; one that asks for ``spec`` is still refused, naming ``mode``."""
    chat = [{"role": "user", "content": "Hi there"}]

    async def go():
        async with await Engine.load(tiny_llama, draft="none", threads=1, slots=1, warmup=False) as engine:
            want = (await engine.generate(chat, 8, mode="ar")).text
            async with client(create_app(engine)) as c:
                body = {"messages": chat, "max_tokens": 8, "temperature": 0}
                plain = await c.post("/v1/chat/completions", json=body)
                spec = await c.post("/v1/chat/completions", json={**body, "mode": "spec"})
        return want, plain, spec

    want, plain, spec = anyio.run(go)
    assert plain.status_code == 200 and plain.json()["choices"][0]["message"]["content"] == want
    assert spec.status_code == 400 and spec.json()["error"]["param"] == "mode"
