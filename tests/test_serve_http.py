"""The server on real sockets: uvicorn in process with the official openai client, client
disconnects, and ``python -m specdec_rt serve`` as a process drained by SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import pytest

pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from serve_util import FailingEngine, SlowEngine, metric, metric_values, running_server, sse_data  # noqa: E402

from specdec_rt import Engine, InvalidInputError  # noqa: E402
from specdec_rt.serve import create_app  # noqa: E402

pytestmark = pytest.mark.export

CHAT = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
PROMPT = "def add(a, b):"
ROOT = Path(__file__).resolve().parent.parent


def test_openai_client_parses_every_response_shape(tiny_llama):
    async def main():
        async with await Engine.load(tiny_llama) as engine:
            want_chat = await engine.generate(CHAT, 10)
            want_text = await engine.generate(PROMPT, 8, mode="ar")
            async with running_server(create_app(engine, model_name="tiny")) as url:
                client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
                models = await client.models.list()
                assert [m.id for m in models.data] == ["tiny"]

                r = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0)
                assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
                assert r.choices[0].message.role == "assistant"
                assert r.choices[0].message.content == want_chat.text
                assert r.choices[0].finish_reason == "length"
                assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want_chat.prompt_tokens, 10)

                stream = await client.chat.completions.create(
                    model="tiny", messages=CHAT, max_completion_tokens=10, temperature=0, stream=True,
                    stream_options={"include_usage": True})
                chunks = [c async for c in stream]
                assert chunks[0].choices[0].delta.role == "assistant"
                assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_chat.text
                assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
                    "length"]
                assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == want_chat.prompt_tokens + 10
                assert len({c.id for c in chunks}) == 1

                t = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                                    extra_body={"mode": "ar"})
                assert t.object == "text_completion" and t.choices[0].text == want_text.text
                assert t.usage.completion_tokens == 8
                parts = [c async for c in await client.completions.create(
                    model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                    extra_body={"mode": "ar"})]
                assert "".join(c.choices[0].text for c in parts) == want_text.text
                assert [c.choices[0].finish_reason for c in parts if c.choices[0].finish_reason] == ["length"]

                with pytest.raises(openai.BadRequestError) as err:
                    await client.chat.completions.create(model="tiny", messages=CHAT, temperature=-1)
                assert err.value.param == "temperature" and err.value.status_code == 400
                with pytest.raises(openai.BadRequestError) as err:
                    await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=100_000)
                assert err.value.code == "context_length_exceeded"

            async with running_server(create_app(FailingEngine(engine, after=1), model_name="tiny")) as url:
                client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
                with pytest.raises(openai.InternalServerError):
                    await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20,
                                                    extra_body={"mode": "ar"})
                stream = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, stream=True,
                                                         extra_body={"mode": "ar"})
                with pytest.raises(openai.APIError, match="injected failure"):
                    async for _ in stream:
                        pass

    anyio.run(main)


def test_client_disconnect_cancels_the_request_and_frees_its_slot(tiny_llama):
    async def main():
        async with await Engine.load(tiny_llama, slots=1) as engine:
            slow = SlowEngine(engine, delay=0.02)  # 200 tokens: 4 s, unless cancelled
            app = create_app(slow, slots=1, max_queued=4)
            long = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0}  # greedy: no early EOS by chance
            async with running_server(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as c:
                t0 = time.perf_counter()
                async with c.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
                    seen = 0
                    async for line in r.aiter_lines():
                        seen += line.startswith("data: ")
                        if seen == 3:
                            break  # leaving the block closes the connection
                await _until(lambda: slow.closed == 1 and app.state.serving.admitted == 0)
                assert time.perf_counter() - t0 < 2.0

                waiting = asyncio.ensure_future(c.post("/v1/completions", json=long))  # not streamed
                await _until(lambda: app.state.serving.admitted == 1)
                await asyncio.sleep(0.1)
                waiting.cancel()  # the client gives up: httpx closes the connection
                await _until(lambda: slow.closed == 2 and app.state.serving.admitted == 0)
                assert time.perf_counter() - t0 < 3.0
                await _until(lambda: getattr(engine, "running", 0) == 0)  # the engine slot too

                after = await asyncio.gather(*[c.post("/v1/completions", json={
                    "prompt": PROMPT, "max_tokens": 5, "temperature": 0}) for _ in range(3)])
                assert [r.status_code for r in after] == [200, 200, 200]
                values = metric_values((await c.get("/metrics")).text)
            assert metric(values, "specdec_requests_aborted_total", reason="cancelled") == 2
            assert metric(values, "specdec_request_success_total", finished_reason="length") == 3
            assert metric(values, "specdec_requests_running") == 0

    anyio.run(main)


def test_a_client_that_leaves_an_n_choice_stream_frees_every_choices_slot(tiny_llama):
    async def main():
        async with await Engine.load(tiny_llama, slots=4) as engine:
            slow = SlowEngine(engine, delay=0.02)  # 200 tokens a choice: 4 s, unless cancelled
            app = create_app(slow, slots=4, max_queued=0)
            body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "n": 3, "stream": True}
            async with running_server(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as c:
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    seen = 0
                    async for line in r.aiter_lines():
                        seen += line.startswith("data: ")
                        if seen == 6:
                            break
                await _until(lambda: slow.closed == 3 and app.state.serving.admitted == 0)
                await _until(lambda: getattr(engine, "running", 0) == 0)
                after = await c.post("/v1/completions", json={**body, "stream": False, "max_tokens": 4, "n": 4})
                assert after.status_code == 200 and len(after.json()["choices"]) == 4
                values = metric_values((await c.get("/metrics")).text)
            assert metric(values, "specdec_requests_aborted_total", reason="cancelled") == 1
            assert metric(values, "specdec_generation_tokens_total") >= 16

    anyio.run(main)


async def _until(cond, timeout: float = 2.0) -> None:
    deadline = time.perf_counter() + timeout
    while not cond():
        assert time.perf_counter() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


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
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "specdec_rt", "serve", "--model", str(folder), "--port", "0",
                             "--slots", "1", "--threads", "1", "--drain-timeout", drain_timeout],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env, cwd=ROOT)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while not (m := re.search(r"listening on (http://[\d.]+:\d+)", "".join(lines))):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)
        url = m.group(1)
        anyio.run(scenario, url, proc)
        assert proc.wait(timeout=60) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=5)
    return "".join(lines)


async def _until_healthy(c) -> None:
    while True:
        try:
            if (await c.get("/health")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.05)


async def _drain_timeout_scenario(url: str, proc: subprocess.Popen) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        await _until_healthy(c)
        started = asyncio.Event()
        body = {"prompt": PROMPT, "max_tokens": 480, "temperature": 0}

        async def streamed() -> list:
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                text = ""
                async for chunk in r.aiter_text():
                    text += chunk
                    started.set()
            return sse_data(text)

        first = asyncio.ensure_future(streamed())
        await started.wait()
        rest = [asyncio.ensure_future(streamed() if i % 2 else c.post("/v1/completions", json=body))
                for i in range(4)]  # queued behind the first: one slot
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
        body = {"prompt": PROMPT, "max_tokens": 480, "temperature": 0, "stream": True}

        async def stream(i: int) -> tuple[list, float]:
            async with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                text = ""
                async for chunk in r.aiter_text():
                    text += chunk
                    started.set()
            return sse_data(text), time.perf_counter()

        tasks = [asyncio.ensure_future(stream(i)) for i in range(3)]  # one slot: they run one by one
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


def test_cancel_storm_leaves_nothing_running_and_survivors_equal_their_solo_outputs(tiny_llama):
    """50 streams on a slots=8 server; half are abandoned at random points (streams closed
    mid-way, non-streaming clients that give up). Afterwards nothing runs, every KV slot is free
    without a garbage collection, and every survivor got exactly its solo greedy output."""
    import gc
    import random

    prompts = [f"{PROMPT} # case {i}" for i in range(50)]

    async def main():
        async with await Engine.load(tiny_llama, draft="q4", slots=8) as engine:
            solo = {p: (await engine.generate(p, max_new_tokens=24)).text for p in set(prompts)}
            app = create_app(engine, slots=8, max_queued=64)
            rng = random.Random(7)
            gc.disable()
            try:
                async with running_server(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as c:
                    async def one(i: int):
                        body = {"prompt": prompts[i], "max_tokens": 24, "temperature": 0}
                        quit_after = rng.randint(1, 10) if i % 2 else None
                        if quit_after is not None and i % 4 == 1:  # a non-streaming client gives up
                            task = asyncio.ensure_future(c.post("/v1/completions", json=body))
                            await asyncio.sleep(0.01 * quit_after)
                            task.cancel()
                            return None
                        text = ""
                        async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                            n = 0
                            async for line in r.aiter_lines():
                                if not line.startswith("data: {"):
                                    continue
                                n += 1
                                if quit_after is not None and n >= quit_after:
                                    return None  # closes the stream mid-way
                                text += json.loads(line[6:])["choices"][0]["text"]
                        return text

                    got = await asyncio.gather(*[one(i) for i in range(50)], return_exceptions=True)
                    await _until(lambda: engine.running == 0 and app.state.serving.admitted == 0, 10)
                    values = metric_values((await c.get("/metrics")).text)
                assert metric(values, "specdec_requests_running") == 0
                assert engine.target.pool.free == engine.slots and engine.drafter.model.pool.free == engine.slots
                assert not any(engine.scheduler.costs.ledger.active.values())  # no round left measuring
            finally:
                gc.enable()
            survivors = [(p, t) for p, t in zip(prompts, got) if isinstance(t, str)]
            assert len(survivors) >= 25 and all(t == solo[p] for p, t in survivors)
            assert (await engine.generate(prompts[0], max_new_tokens=24)).text == solo[prompts[0]]

    anyio.run(main)


def test_log_probabilities_through_the_openai_client_equal_the_engines_in_every_shape(tiny_llama):
    async def main():
        async with await Engine.load(tiny_llama) as engine:
            want = await engine.generate(CHAT, 12, logprobs=3)  # speculative
            plain = await engine.generate(CHAT, 12, mode="ar", logprobs=3)
            assert want.token_ids == plain.token_ids and len(want.logprobs) == 12
            assert [e.logprob for e in want.logprobs] == pytest.approx([e.logprob for e in plain.logprobs], abs=1e-4)
            assert [[j for j, _ in e.top] for e in want.logprobs] == [[j for j, _ in e.top] for e in plain.logprobs]
            assert (await engine.generate(CHAT, 4)).logprobs is None
            for bad in (-1, engine.target.vocab_size, 2**70, True, 1.5, "5"):
                with pytest.raises(InvalidInputError, match="token_id must be an integer in 0.."):
                    engine.token_bytes(bad)
            eos = engine.manifest.eos_ids[0]
            assert engine.is_special_token(eos) and not engine.is_special_token(want.token_ids[0])
            async with running_server(create_app(engine, model_name="tiny")) as url:
                client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
                r = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0,
                                                         logprobs=True, top_logprobs=3)
                content = r.choices[0].logprobs.content
                assert [c.logprob for c in content] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
                assert [c.bytes for c in content] == [list(engine.token_bytes(t)) for t in want.token_ids]
                assert [[t.bytes for t in c.top_logprobs] for c in content] == [
                    [list(engine.token_bytes(j)) for j, _ in e.top] for e in want.logprobs]
                if not set(want.token_ids) & set(engine.manifest.eos_ids):
                    assert b"".join(bytes(c.bytes) for c in content).decode("utf-8", "replace") == r.choices[0].message.content

                stream = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0,
                                                              logprobs=True, top_logprobs=3, stream=True)
                streamed = [e for c in [c async for c in stream] if c.choices and c.choices[0].logprobs
                            for e in c.choices[0].logprobs.content]
                assert [(e.token, e.bytes) for e in streamed] == [(c.token, c.bytes) for c in content]

                t = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
                text = await engine.generate(PROMPT, 8, logprobs=2)
                lp = t.choices[0].logprobs
                assert lp.token_logprobs == pytest.approx([e.logprob for e in text.logprobs], abs=1e-4)
                text_bytes = b"".join(engine.token_bytes(i) for i in text.token_ids if not engine.is_special_token(i))
                assert text_bytes.decode("utf-8", "replace") == t.choices[0].text
                ends = [len(b"".join(engine.token_bytes(i) for i in text.token_ids[:k]
                                     if not engine.is_special_token(i)).decode("utf-8", "ignore")) for k in range(8)]
                assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(t.choices[0].text)
                if text_bytes.decode("utf-8", "replace") == text_bytes.decode("utf-8", "ignore"):  # no broken bytes
                    assert lp.text_offset == ends  # characters before each token
                assert all(len(top) <= 3 and tok in top for tok, top in zip(lp.tokens, lp.top_logprobs))
                parts = [c async for c in await client.completions.create(
                    model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2, stream=True)]
                offsets = [o for c in parts if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
                assert offsets == lp.text_offset

                with pytest.raises(openai.BadRequestError) as err:
                    await client.chat.completions.create(model="tiny", messages=CHAT, top_logprobs=2)
                assert err.value.param == "top_logprobs"

                ban = {str(t): -100 for t in set(want.token_ids[:3])}  # logit_bias: the greedy answer's first tokens banned
                banned = await engine.generate(CHAT, 12, mode="ar", logit_bias={int(k): v for k, v in ban.items()})
                assert not set(banned.token_ids) & set(want.token_ids[:3])
                r = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0,
                                                         logit_bias=ban)
                assert r.choices[0].message.content == banned.text  # speculative, through the server
                with pytest.raises(openai.BadRequestError) as err:
                    await client.chat.completions.create(model="tiny", messages=CHAT,
                                                         logit_bias={str(engine.target.vocab_size): 1})
                assert err.value.param == "logit_bias" and "outside the model's vocabulary" in err.value.message

                pen = dict(frequency_penalty=1.5, presence_penalty=0.5)  # penalties: spec through the server = ar
                penal = await engine.generate(CHAT, 16, mode="ar", **pen)
                assert penal.token_ids != (await engine.generate(CHAT, 16, mode="ar")).token_ids
                r = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=16, temperature=0, **pen)
                assert r.choices[0].message.content == penal.text
                t = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                                    extra_body={"repetition_penalty": 1.3})
                assert t.choices[0].text == (await engine.generate(PROMPT, 8, mode="ar", repetition_penalty=1.3)).text

    anyio.run(main)


@pytest.mark.parametrize("args,named", [(["--port", "70000"], "--port"), (["--port", "-1"], "--port"),
                                        (["--request-timeout", "-1"], "--request-timeout"),
                                        (["--request-timeout", "nan"], "--request-timeout"),
                                        (["--drain-timeout", "-1"], "--drain-timeout"),
                                        (["--drain-timeout", "inf"], "--drain-timeout"),
                                        (["--host", "999.1.1.1"], "--host")])
def test_cli_serve_refuses_bad_flags_in_one_line_before_loading(tiny_llama, args, named):
    """--port 70000 listened on 4464, a negative timeout answered every request 504 or crashed
    the drain, an unresolvable host failed inside uvicorn (QA)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "specdec_rt", "serve", "--model", str(tiny_llama), *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert proc.returncode != 0 and named in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "listening" not in proc.stderr and len(proc.stderr.strip().splitlines()) <= 2


def test_cli_serve_stops_on_sigterm_when_its_stderr_reader_is_gone(tiny_llama):
    """`serve ... | head -1`: printing "stopping" to a closed pipe raised in the signal handler,
    and the server never stopped (QA)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "specdec_rt", "serve", "--model", str(tiny_llama), "--port", "0",
                             "--threads", "1"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, cwd=ROOT)
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
