"""Tool calling: the tools rendered by a template that takes them, calls parsed out of the answer
(Hermes-style ``<tool_call>`` blocks), ``tool_choice`` "required" / a named function held to by a
grammar (exact under speculation), the OpenAI wire shapes, streamed and not."""

from __future__ import annotations

import json

import pytest
from tiny_models import with_chat_template

from specdec_rt import InvalidInputError
from specdec_rt.serve.replies import CallFilter
from specdec_rt.text.tools import call_grammar, check_tool_choice, check_tools, parse_tool_calls, supports_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

# a small Hermes-style template (the format Qwen2.5's uses): tools in the system turn, calls as
# <tool_call> blocks, tool answers as a user turn
HERMES = """{%- if tools %}<|im_start|>system
Tools:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}{%- for m in messages %}{%- if m.role == "tool" %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% elif m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>
{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


# ---------------------------------------------------------------- pure parts
def test_parse_tool_calls():
    text = (
        'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content == "Sure." and [c["function"]["name"] for c in calls] == ["add", "get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    for kept in (
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"name": "add", "arguments": {"a"',  # cut short
        '<tool_call>["add"]</tool_call>',
        "no calls at all",
    ):
        assert parse_tool_calls(kept) == (kept.strip(), [])


def test_call_filter_holds_back_calls_even_split_across_pieces():
    f = CallFilter()
    pieces = ["Let me check", ". <tool", '_call>{"name": "add", ', '"arguments": {"a": 1, "b": 2}}</tool_call>']
    out = "".join(f.push(p) for p in pieces)
    rest, calls = f.finish()
    assert out == "Let me check. " and rest == "" and calls[0]["function"]["name"] == "add"
    g = CallFilter()
    assert g.push("a <tool") == "a " and g.push("box>") == "<toolbox>"  # not a call after all
    assert g.finish() == ("", [])
    h = CallFilter()
    assert h.push("<tool_call>{broken") == "" and h.finish() == ("<tool_call>{broken", [])  # kept as content


@pytest.mark.parametrize(
    "tools, needle",
    [
        ("x", "tools must be a list"),
        ([{"type": "function"}], "tools[0]"),
        ([{"type": "function", "function": {"name": "a b"}}], "tools[0]"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "parameters must be a JSON schema"),
        ([ADD, ADD], "named twice"),
        ([ADD] * 129, "at most 128"),
    ],
)
def test_bad_tools_are_named(tools, needle):
    with pytest.raises(InvalidInputError, match="tools") as err:
        check_tools(tools)
    assert needle in str(err.value)


def test_tool_choice():
    assert check_tool_choice(None, []) == "none" and check_tool_choice(None, [ADD]) == "auto"
    named = {"type": "function", "function": {"name": "add"}}
    assert check_tool_choice(named, [ADD]) == named
    for bad in ({"type": "function", "function": {"name": "sub"}}, "sometimes", 3):
        with pytest.raises(InvalidInputError, match="tool_choice"):
            check_tool_choice(bad, [ADD])
    with pytest.raises(InvalidInputError, match="needs tools"):
        check_tool_choice("required", [])
    with pytest.raises(InvalidInputError, match="an int of"):  # described without its 5,000 digits
        check_tool_choice(10**5000, [ADD])
    assert supports_tools(HERMES) and not supports_tools("{{ messages }}") and not supports_tools(None)
    assert "call: call0\n" in call_grammar([ADD, WEATHER], named)  # the named one only
    assert "call: call0 | call1\n" in call_grammar([ADD, WEATHER], "required")


def test_a_tag_the_tokenizer_marks_special_is_decoded_as_text(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from specdec_rt.text.codec import TextCodec

    tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<tool_call>", "<|im_end|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    codec = TextCodec(tmp_path / "tokenizer.json")
    call, end = codec.tokenizer.token_to_id("<tool_call>"), codec.tokenizer.token_to_id("<|im_end|>")
    assert not codec.is_special(call) and codec.is_special(end)
    assert "<tool_call>" in codec.decode([0, call, 0]) and "<|im_end|>" not in codec.decode([0, end])


# ---------------------------------------------------------------- a tiny model with the template
@pytest.fixture(scope="module")
def tool_model(tiny_llama, tmp_path_factory):
    return with_chat_template(tiny_llama, tmp_path_factory.mktemp("tools") / "model", HERMES)


@pytest.mark.export
def test_named_and_required_calls_are_exact_and_follow_the_schema(tool_model):
    pytest.importorskip("llguidance")
    from serve_util import run

    async def check(engine):
        named = {"type": "function", "function": {"name": "get_weather"}}
        got = {m: await engine.generate(ASK, 160, mode=m, tools=[WEATHER], tool_choice=named) for m in ("ar", "spec")}
        assert got["ar"].token_ids == got["spec"].token_ids  # speculation exact under the call grammar
        (call,) = got["spec"].tool_calls
        args = json.loads(call["function"]["arguments"])
        assert call["function"]["name"] == "get_weather" and isinstance(args["city"], str) and args["unit"] in "cf"
        assert got["spec"].finish_reason == "stop"
        req = await engine.generate(ASK, 160, tools=[ADD], tool_choice="required", temperature=1.0, seed=3)
        assert [c["function"]["name"] for c in req.tool_calls] == ["add"]
        auto = await engine.generate(ASK, 8, tools=[ADD])  # a random model: maybe no call, never an error
        assert auto.tool_calls is not None
        assert (await engine.generate(ASK, 8)).tool_calls is None  # no tools asked for

    run(check, tool_model)


@pytest.mark.export
def test_tools_rendered_and_history_with_calls(tool_model):
    from serve_util import run

    async def check(engine):
        codec = engine.codec
        text = codec.decode(codec.encode_prompt(ASK, tools=[WEATHER]))
        assert '"get_weather"' in text and "What is the weather" in text
        history = ASK + [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "14 C, cloudy"},
        ]
        text = codec.decode(codec.encode_prompt(history, tools=[WEATHER]))
        assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}' in text
        assert "<tool_response>14 C, cloudy</tool_response>" in text
        bad = [dict(WEATHER, function=dict(WEATHER["function"], description="x<|im_end|>y"))]
        for prompt, tools, choice, needle in (
            (ASK, bad, None, "special token"),
            ("plain text", [ADD], None, "chat messages"),
            (ASK, [ADD], "required", "cannot both"),
        ):
            with pytest.raises(InvalidInputError, match=needle):
                kw = {"response_format": {"type": "json_object"}} if needle == "cannot both" else {}
                await engine.generate(prompt, 4, tools=tools, tool_choice=choice, **kw)

    run(check, tool_model)


@pytest.mark.export
def test_a_template_without_tools_refuses_them(tiny_llama):
    from serve_util import run

    async def check(engine):
        with pytest.raises(InvalidInputError, match="does not render tools"):
            await engine.generate(ASK, 4, tools=[ADD])
        assert len((await engine.generate(ASK, 4, tools=[ADD], tool_choice="none")).token_ids) == 4

    run(check, tiny_llama)


@pytest.mark.export
def test_tool_calls_through_the_server_and_the_openai_client(tool_model):
    pytest.importorskip("llguidance")
    openai = pytest.importorskip("openai")
    from serve_util import client, run, running_server, sse_data

    from specdec_rt.serve import create_app

    named = {"type": "function", "function": {"name": "add"}}
    body = {"messages": ASK, "max_tokens": 160, "temperature": 0, "tools": [ADD], "tool_choice": named}

    async def check(engine):
        async with client(create_app(engine)) as c:
            whole = (await c.post("/v1/chat/completions", json=body)).json()
            streamed = sse_data((await c.post("/v1/chat/completions", json={**body, "stream": True})).text)
            bad = [
                await c.post("/v1/chat/completions", json={**body, **extra})
                for extra in (
                    {"tools": [{"type": "function"}]},
                    {"tool_choice": "maybe"},
                    {"functions": [{"name": "f"}]},
                )
            ]
        (choice,) = whole["choices"]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "add" and set(json.loads(call["function"]["arguments"])) == {"a", "b"}
        chunks = [e for e in streamed if e != "[DONE]"]
        deltas = [e["choices"][0]["delta"] for e in chunks]
        (streamed_calls,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
        assert streamed_calls[0]["index"] == 0 and streamed_calls[0]["function"] == call["function"]
        assert [e["choices"][0]["finish_reason"] for e in chunks if e["choices"][0]["finish_reason"]] == ["tool_calls"]
        assert [r.status_code for r in bad] == [400, 400, 400]
        assert [r.json()["error"]["param"] for r in bad] == ["tools", "tool_choice", "functions"]
        async with running_server(create_app(engine, model_name="tiny")) as url:
            api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            r = await api.chat.completions.create(
                model="tiny", messages=ASK, max_tokens=160, temperature=0, tools=[ADD], tool_choice=named
            )
            assert r.choices[0].message.tool_calls[0].function.name == "add"
            assert r.choices[0].finish_reason == "tool_calls"

    run(check, tool_model)


# ---------------------------------------------------------------- found by QA
def test_parse_edge_cases_from_review():
    deep = "<tool_call>" + "[" * 1000 + "]" * 1000 + "</tool_call>"
    assert parse_tool_calls(deep) == (deep, [])  # was: RecursionError out of json.loads
    content, (call,) = parse_tool_calls(
        '<tool_call>\n{"name": "t", "arguments": {"s": "a</tool_call>b"}}\n</tool_call>'
    )
    assert json.loads(call["function"]["arguments"]) == {"s": "a</tool_call>b"}  # was: cut at the inner tag
    _, (call,) = parse_tool_calls('<tool_call>{"name": "w", "parameters": {"city": "Oslo"}}</tool_call>')
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}  # was: arguments dropped
    unknown = '<tool_call>{"name": "zzz", "arguments": {}}</tool_call>'
    assert parse_tool_calls(unknown, names=["add"]) == (unknown, [])
    for bad_args in ('"not json"', "[1, 2]", "7"):
        text = '<tool_call>{"name": "add", "arguments": ' + bad_args + "}</tool_call>"
        assert parse_tool_calls(text) == (text, [])
    with pytest.raises(InvalidInputError, match="JSON schema of an object"):
        check_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}])


def test_streamed_and_whole_answers_split_the_same_way():
    from specdec_rt.serve.protocol import GenParams
    from specdec_rt.serve.replies import call_filter, calls_in

    p = GenParams("chat", [], tools=[ADD], tool_choice="auto")
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    for pieces in (
        ["Sure.", " <to", "ol_c", call[len("<tool_c") :], " after"],
        ["Hi ", call, "\n", call],
        ["  ", call, "  "],
        ["no call", " here"],
    ):
        whole = calls_in(p, "".join(pieces))
        f = call_filter(p)
        sent = "".join(f.push(x) for x in pieces)
        rest, calls = f.finish()
        streamed = (sent + rest) or (None if calls else "")
        assert (streamed, len(calls)) == (whole[0], len(whole[1]))
    assert calls_in(p, "  " + call)[0] is None  # blank beside a call: no content
    p.parallel_tool_calls = False
    assert len(calls_in(p, call + call)[1]) == 1


@pytest.mark.export
def test_refs_none_stop_and_histories(tool_model, tiny_llama):
    pytest.importorskip("llguidance")
    from serve_util import run

    ref_tool = {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"$ref": "#/$defs/City"}},
                "required": ["city"],
                "additionalProperties": False,
                "$defs": {"City": {"type": "string", "enum": ["Oslo", "Lima"]}},
            },
        },
    }
    named = {"type": "function", "function": {"name": "weather"}}

    async def check(engine):
        r = await engine.generate(ASK, 120, tools=[ref_tool], tool_choice=named)  # was: '$defs' not found
        assert json.loads(r.tool_calls[0]["function"]["arguments"])["city"] in ("Oslo", "Lima")
        with pytest.raises(InvalidInputError, match="stop cannot go with"):
            await engine.generate(ASK, 8, tools=[ref_tool], tool_choice=named, stop=["\n"])
        none = await engine.generate(ASK, 4, mode="ar", tools=[ADD], tool_choice="none")
        plain = await engine.generate(ASK, 4, mode="ar")
        assert none.tool_calls is None and none.stats.prompt_tokens > plain.stats.prompt_tokens  # rendered, not parsed

    run(check, tool_model)

    async def unsupported(engine):
        history = ASK + [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}],
            }
        ]
        with pytest.raises(InvalidInputError, match=r"messages\[1\].tool_calls"):
            await engine.generate(history, 4)  # was: the calls silently dropped from the prompt

    run(unsupported, tiny_llama)


@pytest.mark.export
def test_tool_fields_the_server_refuses(tool_model):
    from serve_util import client, run

    from specdec_rt.serve import create_app

    async def check(engine):
        async with client(create_app(engine)) as c:
            rs = [
                await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "tools": [ADD]}),
                await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "tool_choice": "required"}),
                await c.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, "tools": {}}),
                await c.post(
                    "/v1/chat/completions",
                    json={"messages": ASK, "max_tokens": 2, "tools": [ADD], "parallel_tool_calls": "yes"},
                ),
            ]
        assert [r.status_code for r in rs] == [400] * 4
        assert [r.json()["error"]["param"] for r in rs] == ["tools", "tool_choice", "tools", "parallel_tool_calls"]

    run(check, tool_model)


def test_second_review_edge_cases():
    _, (call,) = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"s": "\\ud800"}}</tool_call>')
    assert json.loads(call["function"]["arguments"]) == {"s": "\ud800"}  # was: a 500 (unencodable UTF-8)
    call["function"]["arguments"].encode("utf-8")
    nan = '<tool_call>{"name": "add", "arguments": {"x": NaN}}</tool_call>'
    assert parse_tool_calls(nan) == (nan, [])  # was: "NaN" in arguments, not JSON a client can read
    cyclic = {"type": "object"}
    cyclic["properties"] = {"a": cyclic}
    for params, needle in (
        ({"type": "object", "x-guidance": "lenient"}, "x-guidance"),
        ({"type": "object", "properties": {"a": {"enum": {1, 2}}}}, "not JSON"),
        (cyclic, "not JSON"),
    ):
        with pytest.raises(InvalidInputError, match=needle):
            check_tools([{"type": "function", "function": {"name": "f", "parameters": params}}])


@pytest.mark.export
def test_second_review_engine_and_server(tool_model):
    pytest.importorskip("llguidance")
    from serve_util import client, run

    from specdec_rt.serve import create_app

    loop = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}

    async def check(engine):
        for mode in ("ar", "spec"):  # was: 200 and an error event when streaming, a 400 otherwise
            with pytest.raises(InvalidInputError, match="tool_choice: the grammar stopped"):
                await engine.generate(ASK, 8, mode=mode, tools=[loop], tool_choice="required")
        deep = ASK + [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "add", "arguments": "[" * 100 + "]" * 100}}
                ],
            }
        ]
        with pytest.raises(InvalidInputError, match=r"messages\[1\].tool_calls is nested"):  # was: blamed on tools
            await engine.generate(deep, 4, tools=[ADD])
        async with client(create_app(engine)) as c:
            rs = [
                await c.post(
                    "/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, "parallel_tool_calls": "maybe"}
                ),
                await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "parallel_tool_calls": "maybe"}),
                await c.post(
                    "/v1/chat/completions",
                    json={"messages": ASK, "max_tokens": 8, "stream": True, "tools": [loop], "tool_choice": "required"},
                ),
            ]
        assert [r.status_code for r in rs] == [400, 400, 400]
        assert [r.json()["error"]["param"] for r in rs] == ["parallel_tool_calls", "parallel_tool_calls", "tool_choice"]

    run(check, tool_model)
