"""The examples run: a custom drafter checked lossless; the openai client against the server and
an Engine embedded in a Starlette app, on a tiny model."""

from __future__ import annotations

import asyncio
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from specdec_rt import EngineClosedError

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_custom_drafter_example(capsys):
    runpy.run_path(str(EXAMPLES / "custom_drafter.py"), run_name="__main__")
    assert "identical to plain decoding: ok" in capsys.readouterr().out


@pytest.mark.export
def test_openai_client_example(tiny_llama):
    """The example starts `python -m specdec_rt serve` itself and talks to it with the openai client."""
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    root = EXAMPLES.parent
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "openai_client.py"), "--model", str(tiny_llama), "--max-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "chat (length, 8 tokens)" in out and "[usage:" in out and "completion (mode ar):" in out
    assert "error: HTTP 400, param='temperature'" in out


@pytest.mark.export
def test_starlette_embed_example(tiny_llama):
    pytest.importorskip("starlette")
    httpx = pytest.importorskip("httpx")
    app = runpy.run_path(str(EXAMPLES / "starlette_embed.py"))["build_app"](str(tiny_llama))

    async def main():
        async with app.router.lifespan_context(app):
            engine = app.state.engine
            want = await engine.generate("def add(a, b):", 10)
            transport = httpx.ASGITransport(app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
                ok = await c.post("/generate", json={"prompt": "def add(a, b):", "max_new_tokens": 10})
                bad = await c.post("/generate", json={"prompt": "hi", "max_new_tokens": -1})
                room = engine.scheduler.max_length
                long = await c.post("/generate", json={"prompt": "hi " * room, "max_new_tokens": 4})
                over = await c.post("/generate", json={"prompt": "hi", "max_new_tokens": room})
            assert engine.running == 0 and engine.target.pool.free == engine.slots
        assert ok.status_code == 200 and ok.text == want.text
        assert bad.status_code == 400 and "max_new_tokens" in bad.json()["error"]
        for r in (long, over):  # found while encoding: a 400 too, not an empty 200 (QA)
            assert r.status_code == 400 and "maximum length" in r.json()["error"], r.text
        with pytest.raises(EngineClosedError):  # the lifespan closed the engine
            engine.stream("x", 2)

    asyncio.run(main())
