"""A hostile model folder cannot stall the server or answer without a word (docs/security.md,
"Model folders"; issue 43, parts 4 and 5).

- A chat template that calls ``str.encode('punycode')`` on long messages only (so it loads) is
  refused at once with a 400 naming the method, and the event loop does not stall (was: ~11 s
  of rendering past a 3 s ``request_timeout``).
- ``request_timeout`` runs from the request's arrival: a template that renders for its whole
  deadline meets a 0.5 s timeout with a 504 at 0.5 s (was: a 400 after the template's deadline).
- A tokenizer that panics is a 500 with a message, and the next request is served (was: HTTP 200
  with empty text).
- A template that writes a 30k-character literal loads quickly: the warm-up prefills at most
  64 of its tokens (was: the whole context, minutes on the default model).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import pytest
from loop_lag import compare
from serve_util import CHAT, client, run
from tiny_models import CHATML_TEMPLATE, with_chat_template

from specdec_rt.serve.app import create_app

pytestmark = pytest.mark.export

CJK = "".join(chr(0x4E00 + i) for i in range(10_000))  # 10k distinct characters
# ChatML, but long messages go through punycode: the short conversation checked at load passes
PUNY_LONG = (
    "{% for m in messages %}{% if m['content']|length > 1000 %}{{ m['content'].encode('punycode') }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# ChatML, but a message that says "slow" loops until the template's deadline
SLOW_ON_ASK = (
    "{% if messages[-1]['content'] == 'slow' %}{% for i in range(99999) %}{% for j in range(99999) %}"
    "{% endfor %}{% endfor %}{% endif %}" + CHATML_TEMPLATE
)


def _chat(content: str) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0}


def test_punycode_template_is_refused_fast_and_does_not_stall_the_loop(tiny_qwen, tmp_path):
    folder = with_chat_template(tiny_qwen, tmp_path / "puny", PUNY_LONG)
    timeout = 3.0

    async def check(engine):
        app = create_app(engine, slots=1, request_timeout=timeout)
        async with client(app) as c:
            spent: list[float] = []

            async def attack():
                t0 = time.perf_counter()
                r = await c.post("/v1/chat/completions", json=_chat(CJK))
                spent.append(time.perf_counter() - t0)
                return r

            a, ctl = await compare(attack, lambda: c.post("/v1/chat/completions", json={"messages": CHAT}))
            assert ctl.out.status_code == 200
            assert a.out.status_code == 400 and "used str.encode" in a.out.json()["error"]["message"], a.out.text
            assert max(spent) < timeout + 3.0, spent  # was: ~11 s of rendering, then the answer
            assert a.worst <= max(0.1, 3 * ctl.worst), (a.ms(), ctl.ms())
            assert a.busy < 0.05, a.ms()
            again = await c.post("/v1/chat/completions", json={"messages": CHAT})
            assert again.status_code == 200

    run(check, folder)


def test_request_timeout_counts_templating(tiny_qwen, tmp_path, monkeypatch):
    """The template renders for its whole deadline (4 s here); a 0.5 s request timeout answers
    504 well before that (was: the timeout started after templating: a 400 after the template's
    deadline)."""
    import anyio

    import specdec_rt.text.codec as codec

    monkeypatch.setattr(codec, "TEMPLATE_MAX_STEPS", 10**9)  # the deadline ends it, not the steps
    folder = with_chat_template(tiny_qwen, tmp_path / "slow", SLOW_ON_ASK)

    async def check(engine):
        engine.codec.template_timeout_s = 4.0
        app = create_app(engine, slots=1, request_timeout=0.5)
        async with client(app) as c:
            t0 = time.perf_counter()
            r = await c.post("/v1/chat/completions", json=_chat("slow"))
            elapsed = time.perf_counter() - t0
            assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout", r.text
            assert elapsed < 0.5 + 2.0, elapsed  # the template alone runs 4 s
            streamed = await c.post("/v1/chat/completions", json={**_chat("slow"), "stream": True})
            assert streamed.status_code == 504
            metrics = (await c.get("/metrics")).text
            assert 'specdec_requests_aborted_total{reason="timeout"} 2.0' in metrics
            await anyio.sleep(max(0.0, t0 + 2 * 4.0 - time.perf_counter()))  # the abandoned renderings end
            assert (await c.post("/v1/chat/completions", json=_chat("hi"))).status_code == 200

    run(check, folder)


def _with_tokenizer(src: Path, dst: Path, edit) -> Path:
    """A copy of the export ``src`` whose tokenizer.json is ``edit(doc)`` (its hash updated)."""
    shutil.copytree(src, dst)
    doc = json.loads((dst / "tokenizer.json").read_text())
    edit(doc)
    data = json.dumps(doc).encode()
    (dst / "tokenizer.json").write_bytes(data)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["files"]["tokenizer.json"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def test_tokenizer_panic_is_a_500_with_a_message(tiny_qwen, tmp_path, caplog):
    def panic_on_a_run_of_a(doc):  # the regex gives up on 40 'a' then 'b': the library panics
        split = {"type": "Split", "pattern": {"Regex": "(a+)+$"}, "behavior": "Isolated", "invert": False}
        doc["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, doc["pre_tokenizer"]]}

    folder = _with_tokenizer(tiny_qwen, tmp_path / "panic", panic_on_a_run_of_a)

    async def check(engine):
        app = create_app(engine, slots=1)
        body = {"prompt": "a" * 40 + "b", "max_tokens": 2}
        async with client(app) as c:
            whole = await c.post("/v1/completions", json=body)
            streamed = await c.post("/v1/completions", json={**body, "stream": True})
            fine = await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        for r in (whole, streamed):
            assert r.status_code == 500, r.text  # was: 200 with empty text
            assert "tokenizer failed while encoding the prompt: PanicException" in r.json()["error"]["message"]
        assert fine.status_code == 200

    run(check, folder)
    failed = [r for r in caplog.records if "request.failed" in r.getMessage()]
    assert len(failed) == 2 and "PanicException" in failed[0].getMessage()


def test_expanding_tokenizer_is_refused_at_load(tiny_qwen, tmp_path):
    from specdec_rt import Engine
    from specdec_rt.errors import ModelLoadError

    def thousandfold(doc):
        doc["normalizer"] = {"type": "Replace", "pattern": {"String": "a"}, "content": "a" * 1000}

    folder = _with_tokenizer(tiny_qwen, tmp_path / "expand", thousandfold)

    async def load():
        await Engine.load(folder)

    import anyio

    with pytest.raises(ModelLoadError, match=r"normalizer Replace\('a' -> 1000 characters\)"):
        anyio.run(load)


def test_long_template_literal_does_not_stretch_the_warm_up(tmp_path, monkeypatch):
    """A template that writes 30k characters around every conversation: the warm-up runs the
    last 64 tokens of it (was: the whole context, 4k tokens, each of its four requests)."""
    from tiny_models import build_tiny_checkpoint

    from export.pipeline import Request
    from export.pipeline import run as export
    from export.ui import Reporter
    from specdec_rt.speculation.scheduler import SpecDecScheduler

    ckpt = build_tiny_checkpoint(tmp_path / "ckpt", "qwen2", max_positions=8192)
    out = tmp_path / "onnx"
    export(Request(src=str(ckpt), out=out, validate=False, threads=1), Reporter(quiet=True))
    folder = with_chat_template(out, tmp_path / "literal", "{{ '" + "x" * 30_000 + "' }}" + CHATML_TEMPLATE)
    lengths: list[int] = []
    stream = SpecDecScheduler.stream

    def spy(self, ids, *args, **kwargs):
        lengths.append(len(ids))
        return stream(self, ids, *args, **kwargs)

    monkeypatch.setattr(SpecDecScheduler, "stream", spy)

    async def check(engine):
        return engine.scheduler.max_length

    assert run(check, folder) >= 4096  # room for the whole literal
    assert lengths and max(lengths) <= 64, lengths  # was: 4080 each
