"""The OpenAI-compatible server in process (httpx.ASGITransport) on a tiny model: request
parsing and validation, response and chunk schemas, n choices. Errors, limits, overload, drain,
timeouts, failures and metrics are in test_serve_limits.py; real sockets, the openai client and
the CLI process in test_serve_http.py."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from serve_util import CHAT, PROMPT, client, run, sse_data  # noqa: E402

from specdec_rt.errors import ContextLengthError, InvalidInputError  # noqa: E402
from specdec_rt.request.params import RequestParams  # noqa: E402
from specdec_rt.serve import create_app  # noqa: E402
from specdec_rt.serve.protocol import APIError, engine_error, parse_request  # noqa: E402


# ---------------------------------------------------------------- parsing (no model)
@pytest.mark.parametrize(
    "kind,body,param",
    [
        ("chat", {"messages": CHAT, "temperature": "hot"}, "temperature"),
        ("chat", {"messages": CHAT, "temperature": -0.5}, "temperature"),
        ("chat", {"messages": CHAT, "max_tokens": 0}, "max_tokens"),
        ("chat", {"messages": CHAT, "max_tokens": "5"}, "max_tokens"),
        ("chat", {"messages": CHAT, "max_completion_tokens": 2.5}, "max_completion_tokens"),
        ("chat", {}, "messages"),
        ("chat", {"messages": "hi"}, "messages"),
        ("chat", {"messages": []}, "messages"),
        ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0]"),
        ("chat", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ("chat", {"messages": CHAT, "n": 0}, "n"),
        ("chat", {"messages": CHAT, "n": 17}, "n"),
        ("chat", {"messages": CHAT, "top_p": 0}, "top_p"),
        ("chat", {"messages": CHAT, "top_k": 1.5}, "top_k"),
        ("chat", {"messages": CHAT, "seed": -1}, "seed"),
        ("chat", {"messages": CHAT, "seed": 2**64}, "seed"),
        ("chat", {"messages": CHAT, "top_k": -5}, "top_k"),
        ("chat", {"messages": CHAT, "stop": 7}, "stop"),
        ("chat", {"messages": CHAT, "stop": ["a", None]}, "stop"),
        ("chat", {"messages": CHAT, "mode": "turbo"}, "mode"),
        ("chat", {"messages": CHAT, "stream": "yes"}, "stream"),
        (
            "chat",
            {"messages": CHAT, "stream": True, "stream_options": {"include_usage": 1}},
            "stream_options.include_usage",
        ),
        ("chat", {"messages": CHAT, "stream_options": {"include_usage": True}}, "stream_options"),  # not streaming
        ("chat", {"messages": CHAT, "temperature": 2.5}, "temperature"),  # OpenAI's range is [0, 2]
        ("chat", {"messages": CHAT, "logprobs": 1}, "logprobs"),
        ("chat", {"messages": CHAT, "top_logprobs": 3}, "top_logprobs"),  # needs logprobs: true
        ("chat", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"messages": CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("completion", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("completion", {"prompt": "x", "logprobs": True}, "logprobs"),
        ("completion", {"prompt": "x", "logprobs": "2"}, "logprobs"),
        ("completion", {"prompt": "x", "echo": "yes"}, "echo"),
        # options that would change what comes back are refused, not silently dropped
        ("chat", {"messages": CHAT, "presence_penalty": 2.5}, "presence_penalty"),
        ("chat", {"messages": CHAT, "frequency_penalty": -2.01}, "frequency_penalty"),
        ("chat", {"messages": CHAT, "frequency_penalty": "1"}, "frequency_penalty"),
        ("chat", {"messages": CHAT, "repetition_penalty": 0}, "repetition_penalty"),
        ("completion", {"prompt": "x", "repetition_penalty": 11}, "repetition_penalty"),
        ("chat", {"messages": CHAT, "repetition_penalty": 1e-39}, "repetition_penalty"),
        ("chat", {"messages": CHAT, "presence_penalty": 10**400}, "presence_penalty"),  # not a float: a 500 before
        ("chat", {"messages": CHAT, "temperature": -(10**400)}, "temperature"),
        ("chat", {"messages": CHAT, "logit_bias": {"1": 101}}, "logit_bias"),
        ("chat", {"messages": CHAT, "logit_bias": {"x": 2}}, "logit_bias"),
        ("chat", {"messages": CHAT, "logit_bias": {"-1": 2}}, "logit_bias"),
        ("chat", {"messages": CHAT, "logit_bias": {"1": "2"}}, "logit_bias"),
        ("chat", {"messages": CHAT, "logit_bias": {"1": True}}, "logit_bias"),
        ("completion", {"prompt": "x", "logit_bias": [1, 2]}, "logit_bias"),
        ("completion", {"prompt": "x", "logit_bias": {"5": 1, "05": -1}}, "logit_bias"),  # one token twice
        ("chat", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ("chat", {"messages": CHAT, "tools": [], "tool_choice": "required"}, "tool_choice"),
        ("chat", {"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
        ("chat", {"messages": CHAT, "response_format": {"type": "xml"}}, "response_format"),
        (
            "chat",
            {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": []}}},
            "response_format",
        ),
        ("completion", {"prompt": "x", "suffix": "end"}, "suffix"),
        ("completion", {"prompt": [1, -2, 3]}, "prompt"),  # token ids: integers >= 0
        ("completion", {"prompt": ""}, "prompt"),
        ("completion", {"max_tokens": 4}, "prompt"),
    ],
)
def test_parse_names_the_bad_field(kind, body, param):
    with pytest.raises(APIError) as err:
        parse_request(kind, body)
    assert err.value.status == 400 and err.value.param == param
    assert err.value.body()["error"]["param"] == param and err.value.body()["error"]["message"]


def test_parse_defaults_and_ignores_unknown_fields():
    p = parse_request(
        "chat",
        {
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "user", "content": "hi"},
            ],
            "user": "u",
            "model": "x",
            "metadata": {"a": 1},
            # the "off" values of options this server cannot honour pass
            "logit_bias": {},
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "tools": [],
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "stop": "END",
            "top_k": -1,
            "top_p": 1,
            "max_completion_tokens": 7,
            "n": 1,
        },
    )
    assert p.prompt == [{"role": "system", "content": "ab"}, {"role": "user", "content": "hi"}]
    assert p.request_params(99) == RequestParams(max_new_tokens=7, temperature=1.0, stop="END")
    q = parse_request("completion", {"prompt": ["only one"], "temperature": 0})
    assert q.prompt == "only one" and q.request_params(99).max_new_tokens == 99 and q.temperature == 0.0
    seeded = parse_request("completion", {"prompt": "x", "seed": 2**64 - 1, "n": 2})
    assert [seeded.request_params(9, i).seed for i in range(2)] == [2**64 - 1, 0]  # seed + choice, 64 bits


def test_engine_errors_map_to_fields():
    chat = parse_request("chat", {"messages": CHAT, "max_completion_tokens": 3})
    assert engine_error(ContextLengthError("prompt of 9 tokens ..."), chat).param == "messages"
    assert engine_error(ContextLengthError("x"), chat).code == "context_length_exceeded"
    assert engine_error(InvalidInputError("max_new_tokens must be ..."), chat).param == "max_completion_tokens"
    assert engine_error(InvalidInputError("top_p must be in (0, 1]"), chat).param == "top_p"
    assert engine_error(InvalidInputError("chat template rejected the messages"), chat).param == "messages"
    bad = engine_error(InvalidInputError("messages[1].content is not valid Unicode text: ..."), chat)
    assert bad.param == "messages[1].content"
    long = engine_error(ContextLengthError("prompt of 9 tokens + max_new_tokens=3 exceeds ..."), chat)
    assert "max_completion_tokens=3" in long.message and "max_new_tokens" not in long.message
    assert parse_request("chat", {"messages": CHAT, "logprobs": False, "top_logprobs": 0}).logprobs is None
    assert parse_request("chat", {"messages": CHAT, "logprobs": True}).logprobs == 0
    assert parse_request("chat", {"messages": CHAT, "logprobs": True, "top_logprobs": 5}).logprobs == 5
    assert parse_request("completion", {"prompt": "x", "logprobs": 3}).logprobs == 3
    assert parse_request("completion", {"prompt": "x", "logprobs": None}).logprobs is None
    assert parse_request("chat", {"messages": CHAT}).request_params(16).logprobs is None
    assert parse_request("chat", {"messages": CHAT, "logit_bias": {"5": -100, "7": 2.5}}).request_params(
        16
    ).sampling_params().logit_bias == ((5, -100.0), (7, 2.5))
    assert parse_request("chat", {"messages": CHAT, "logit_bias": {}}).request_params(16).logit_bias is None
    rp = parse_request(
        "chat", {"messages": CHAT, "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2}
    ).request_params(16)
    assert (rp.presence_penalty, rp.frequency_penalty, rp.repetition_penalty) == (0.5, -1.0, 1.2)
    off = parse_request("chat", {"messages": CHAT, "presence_penalty": 0, "repetition_penalty": 1}).request_params(16)
    assert not off.sampling_params().penalized
    echo = parse_request("completion", {"prompt": "x", "echo": True, "logprobs": 2}).request_params(16)
    assert (echo.logprobs, echo.prompt_logprobs) == (2, 2)
    tools = [{"type": "function", "function": {"name": "f"}}]
    called = parse_request("chat", {"messages": CHAT, "tools": tools, "min_tokens": 2, "ignore_eos": True})
    rp = called.request_params(16)
    assert (rp.tools, rp.tool_choice, rp.calls_tools, rp.min_tokens, rp.ignore_eos) == (
        tuple(tools),
        "auto",
        True,
        2,
        True,
    )
    with pytest.raises(InvalidInputError, match="^min_tokens"):  # above the server's default token limit
        parse_request("chat", {"messages": CHAT, "min_tokens": 20}).request_params(16)
    assert engine_error(InvalidInputError("logit_bias token id 9 is outside ..."), chat).param == "logit_bias"


# ---------------------------------------------------------------- responses
@pytest.mark.export
def test_non_streaming_schemas_and_greedy_output_equal_engine_generate(tiny_llama):
    async def check(engine):
        async with client(create_app(engine)) as c:
            r = await c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 12, "temperature": 0})
            c2 = await c.post(
                "/v1/completions", json={"prompt": PROMPT, "max_tokens": 9, "temperature": 0, "mode": "ar"}
            )
            models = (await c.get("/v1/models")).json()
        want_chat = await engine.generate(CHAT, 12)
        want_text = await engine.generate(PROMPT, 9, mode="ar")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
        assert isinstance(body["created"], int) and body["model"] == models["data"][0]["id"]
        (choice,) = body["choices"]
        assert choice["message"] == {"role": "assistant", "content": want_chat.text}
        assert choice["finish_reason"] == "length"
        assert body["usage"] == {
            "prompt_tokens": want_chat.prompt_tokens,
            "completion_tokens": 12,
            "total_tokens": want_chat.prompt_tokens + 12,
            "prompt_tokens_details": {"cached_tokens": 0},
        }  # the first request
        body = c2.json()
        assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
        assert body["choices"][0]["text"] == want_text.text and body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 9
        assert models["object"] == "list" and models["data"][0]["object"] == "model"

    run(check, tiny_llama)


@pytest.mark.export
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_streaming_chunks(tiny_llama, kind):
    async def check(engine):
        path, field = (
            ("/v1/chat/completions", {"messages": CHAT}) if kind == "chat" else ("/v1/completions", {"prompt": PROMPT})
        )
        async with client(create_app(engine)) as c:
            r = await c.post(
                path,
                json={
                    **field,
                    "max_tokens": 16,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
            plain = await c.post(path, json={**field, "max_tokens": 4, "stream": True, "seed": 3})
        want = await engine.generate(CHAT if kind == "chat" else PROMPT, 16)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_data(r.text)
        assert events[-1] == "[DONE]"
        chunks, usage = events[:-2], events[-2]
        cached = usage["usage"].pop("prompt_tokens_details")["cached_tokens"]
        assert usage["choices"] == [] and usage["usage"] == {
            "prompt_tokens": want.prompt_tokens,
            "completion_tokens": 16,
            "total_tokens": want.prompt_tokens + 16,
        }
        assert isinstance(cached, int) and 0 <= cached < want.prompt_tokens
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        assert {(e["id"], e["object"], e["model"], e["created"]) for e in events[:-1]} == {
            (chunks[0]["id"], obj, chunks[0]["model"], chunks[0]["created"])
        }
        assert chunks[0]["id"].startswith("chatcmpl-" if kind == "chat" else "cmpl-")
        finishes = [e["choices"][0]["finish_reason"] for e in chunks]
        assert [f for f in finishes if f is not None] == ["length"]
        assert all("usage" in e and e["usage"] is None for e in chunks)  # null until the usage chunk
        assert all("usage" not in e for e in sse_data(plain.text)[:-1])  # not asked for: absent
        if kind == "chat":
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            assert all("role" not in e["choices"][0]["delta"] for e in chunks[1:])
            text = "".join(e["choices"][0]["delta"]["content"] for e in chunks)
        else:
            text = "".join(e["choices"][0]["text"] for e in chunks)
        assert text == want.text
        plain_events = sse_data(plain.text)  # no usage chunk unless asked
        assert plain_events[-1] == "[DONE]" and all(e["choices"] for e in plain_events[:-1])
        assert sum(e["choices"][0]["finish_reason"] is not None for e in plain_events[:-1]) == 1

    run(check, tiny_llama)


@pytest.mark.export
def test_stop_string_ends_with_stop(tiny_llama):
    async def check(engine):
        full = (await engine.generate(PROMPT, 12, mode="ar")).text
        stop = full[3:5]  # the tiny model's text: a stop string it reaches
        assert len(stop) == 2
        async with client(create_app(engine)) as c:
            r = await c.post(
                "/v1/completions",
                json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "mode": "ar", "stop": [stop]},
            )
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["text"] == full[: full.index(stop)]

    run(check, tiny_llama)


@pytest.mark.export
@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_are_n_engine_requests_with_seeds_seed_plus_i(tiny_llama, stream):
    """n choices run batched, as n engine requests: with a seed, choice i is exactly what one
    request with seed + i says; usage counts the prompt once and every choice's tokens; a
    stream carries each choice's role first and exactly one finish per choice."""

    async def check(engine):
        app = create_app(engine, slots=4, max_queued=2)
        body = {"messages": CHAT, "max_tokens": 8, "temperature": 0.9, "seed": 11, "n": 3, "stream": stream}
        async with client(app) as c:
            r = await c.post(
                "/v1/chat/completions", json={**body, **({"stream_options": {"include_usage": True}} if stream else {})}
            )
            too_many = await c.post("/v1/chat/completions", json={**body, "n": 7})  # > 4 + 2: never fits
        want = [await engine.generate(CHAT, 8, temperature=0.9, seed=11 + i) for i in range(3)]
        assert r.status_code == 200, r.text
        if stream:
            events = sse_data(r.text)
            assert events[-1] == "[DONE]"
            usage = events[-2]["usage"]
            chunks = [e["choices"][0] for e in events[:-2]]
            texts = {i: "".join(c["delta"].get("content", "") for c in chunks if c["index"] == i) for i in range(3)}
            for i in range(3):
                mine = [c for c in chunks if c["index"] == i]
                assert mine[0]["delta"].get("role") == "assistant"
                assert len([c["finish_reason"] for c in mine if c["finish_reason"]]) == 1
        else:
            usage = r.json()["usage"]
            texts = {c["index"]: c["message"]["content"] for c in r.json()["choices"]}
        assert [texts[i] for i in range(3)] == [w.text for w in want]
        assert len({w.text for w in want}) > 1  # the seeds differ, so do the choices
        assert usage["completion_tokens"] == sum(len(w.token_ids) for w in want)
        assert usage["prompt_tokens"] == want[0].prompt_tokens
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
        assert app.state.serving.admitted == 0

    run(check, tiny_llama)
