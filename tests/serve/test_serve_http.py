"""The server on real sockets: uvicorn in process with the official openai client, client
disconnects, a cancel storm, log-probabilities. The ``serve`` process is in test_serve_cli.py."""

from __future__ import annotations

import asyncio
import json
import time

import anyio
import pytest

pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from serve_util import CHAT, PROMPT, FailingEngine, SlowEngine, metric, metric_values, running_server  # noqa: E402

from specdec_rt import Engine, InvalidInputError  # noqa: E402
from specdec_rt.serve import create_app  # noqa: E402
from specdec_rt.serve.connections import ConnectionLimits  # noqa: E402

pytestmark = pytest.mark.export


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
                    model="tiny",
                    messages=CHAT,
                    max_completion_tokens=10,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                chunks = [c async for c in stream]
                assert chunks[0].choices[0].delta.role == "assistant"
                assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_chat.text
                assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
                    "length"
                ]
                assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == want_chat.prompt_tokens + 10
                assert len({c.id for c in chunks}) == 1

                t = await client.completions.create(
                    model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"mode": "ar"}
                )
                assert t.object == "text_completion" and t.choices[0].text == want_text.text
                assert t.usage.completion_tokens == 8
                parts = [
                    c
                    async for c in await client.completions.create(
                        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stream=True, extra_body={"mode": "ar"}
                    )
                ]
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
                    await client.completions.create(
                        model="tiny", prompt=PROMPT, max_tokens=20, extra_body={"mode": "ar"}
                    )
                stream = await client.completions.create(
                    model="tiny", prompt=PROMPT, max_tokens=20, stream=True, extra_body={"mode": "ar"}
                )
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

                after = await asyncio.gather(
                    *[
                        c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0})
                        for _ in range(3)
                    ]
                )
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
                # 50 connections from one address: no per-client share (a load test's setting)
                alone = ConnectionLimits(max_connections_per_client=0)
                async with (
                    running_server(app, limits=alone) as url,
                    httpx.AsyncClient(base_url=url, timeout=60) as c,
                ):

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
                r = await client.chat.completions.create(
                    model="tiny", messages=CHAT, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
                )
                content = r.choices[0].logprobs.content
                assert [c.logprob for c in content] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
                assert [c.bytes for c in content] == [list(engine.token_bytes(t)) for t in want.token_ids]
                assert [[t.bytes for t in c.top_logprobs] for c in content] == [
                    [list(engine.token_bytes(j)) for j, _ in e.top] for e in want.logprobs
                ]
                if not set(want.token_ids) & set(engine.manifest.eos_ids):
                    assert (
                        b"".join(bytes(c.bytes) for c in content).decode("utf-8", "replace")
                        == r.choices[0].message.content
                    )

                stream = await client.chat.completions.create(
                    model="tiny",
                    messages=CHAT,
                    max_tokens=12,
                    temperature=0,
                    logprobs=True,
                    top_logprobs=3,
                    stream=True,
                )
                streamed = [
                    e
                    for c in [c async for c in stream]
                    if c.choices and c.choices[0].logprobs
                    for e in c.choices[0].logprobs.content
                ]
                assert [(e.token, e.bytes) for e in streamed] == [(c.token, c.bytes) for c in content]

                t = await client.completions.create(
                    model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2
                )
                text = await engine.generate(PROMPT, 8, logprobs=2)
                lp = t.choices[0].logprobs
                assert lp.token_logprobs == pytest.approx([e.logprob for e in text.logprobs], abs=1e-4)
                text_bytes = b"".join(engine.token_bytes(i) for i in text.token_ids if not engine.is_special_token(i))
                assert text_bytes.decode("utf-8", "replace") == t.choices[0].text
                ends = [
                    len(
                        b"".join(
                            engine.token_bytes(i) for i in text.token_ids[:k] if not engine.is_special_token(i)
                        ).decode("utf-8", "ignore")
                    )
                    for k in range(8)
                ]
                assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(t.choices[0].text)
                if text_bytes.decode("utf-8", "replace") == text_bytes.decode("utf-8", "ignore"):  # no broken bytes
                    assert lp.text_offset == ends  # characters before each token
                assert all(len(top) <= 3 and tok in top for tok, top in zip(lp.tokens, lp.top_logprobs))
                parts = [
                    c
                    async for c in await client.completions.create(
                        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2, stream=True
                    )
                ]
                offsets = [o for c in parts if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
                assert offsets == lp.text_offset

                with pytest.raises(openai.BadRequestError) as err:
                    await client.chat.completions.create(model="tiny", messages=CHAT, top_logprobs=2)
                assert err.value.param == "top_logprobs"

                ban = {
                    str(t): -100 for t in set(want.token_ids[:3])
                }  # logit_bias: the greedy answer's first tokens banned
                banned = await engine.generate(CHAT, 12, mode="ar", logit_bias={int(k): v for k, v in ban.items()})
                assert not set(banned.token_ids) & set(want.token_ids[:3])
                r = await client.chat.completions.create(
                    model="tiny", messages=CHAT, max_tokens=12, temperature=0, logit_bias=ban
                )
                assert r.choices[0].message.content == banned.text  # speculative, through the server
                with pytest.raises(openai.BadRequestError) as err:
                    await client.chat.completions.create(
                        model="tiny", messages=CHAT, logit_bias={str(engine.target.vocab_size): 1}
                    )
                assert err.value.param == "logit_bias" and "outside the model's vocabulary" in err.value.message

                pen = dict(frequency_penalty=1.5, presence_penalty=0.5)  # penalties: spec through the server = ar
                penal = await engine.generate(CHAT, 16, mode="ar", **pen)
                assert penal.token_ids != (await engine.generate(CHAT, 16, mode="ar")).token_ids
                r = await client.chat.completions.create(
                    model="tiny", messages=CHAT, max_tokens=16, temperature=0, **pen
                )
                assert r.choices[0].message.content == penal.text
                t = await client.completions.create(
                    model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"repetition_penalty": 1.3}
                )
                assert t.choices[0].text == (await engine.generate(PROMPT, 8, mode="ar", repetition_penalty=1.3)).text

    anyio.run(main)
