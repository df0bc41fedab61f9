"""A request's tools through the server: checked once however many choices it has (n), and
its call grammar built once (each walks every schema, ~15 ms a megabyte of tools, on the event
loop: n=8 with a large list held the loop ~0.2 s before)."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from serve_util import CHAT, client, run  # noqa: E402
from tiny_models import with_chat_template  # noqa: E402

from specdec_rt.errors import InvalidInputError  # noqa: E402
from specdec_rt.request.params import RequestParams  # noqa: E402
from specdec_rt.serve import create_app  # noqa: E402
from specdec_rt.serve.protocol import APIError, parse_request  # noqa: E402

# the least a template needs to take tools: it renders them, and calls are <tool_call> blocks
TEMPLATE = (
    "{%- if tools %}Tools: {{ tools | tojson }} (call as <tool_call>...</tool_call>)\n{% endif %}"
    "{%- for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{%- if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.fixture(scope="module")
def tool_model(tiny_llama, tmp_path_factory):
    """tiny_llama with a chat template that renders tools."""
    return with_chat_template(tiny_llama, tmp_path_factory.mktemp("tools") / "model", TEMPLATE)


def _count_tool_checks(monkeypatch) -> list:
    """A spy on every ``check_tools`` a request can reach: the size of each non-empty list checked."""
    import specdec_rt.request.params
    import specdec_rt.serve.protocol
    import specdec_rt.text.tools as tools_module

    calls: list = []
    real = tools_module.check_tools

    def spy(tools):
        if tools:
            calls.append(len(tools))
        return real(tools)

    for module in (tools_module, specdec_rt.request.params, specdec_rt.serve.protocol):
        monkeypatch.setattr(module, "check_tools", spy, raising=False)
    return calls


TOOLS = [
    {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": {}}}}
    for i in range(3)
]


def test_n_choices_check_their_tools_once(monkeypatch):
    """A request's tools are checked once, however many choices it has (each check walks every
    schema, ~15 ms a megabyte on the event loop): the choices' RequestParams, and a replace of
    one, take the checked list as it is. A bad list is still refused, naming the tool."""
    calls = _count_tool_checks(monkeypatch)
    p = parse_request("chat", {"messages": CHAT, "tools": TOOLS, "n": 4, "seed": 3})
    choices = [p.request_params(16, i) for i in range(4)]
    assert [c.replace(mode="ar").mode for c in choices] == ["ar"] * 4
    assert calls == [3]
    assert all(c.tools == tuple(TOOLS) and c.calls_tools for c in choices)
    assert [c.seed for c in choices] == [3, 4, 5, 6]
    assert RequestParams(tools=list(TOOLS)).tools == tuple(TOOLS) and calls == [3, 3]  # a new list: checked
    with pytest.raises(InvalidInputError, match=r"^tools\[1\]"):
        RequestParams(tools=[TOOLS[0], {"type": "function", "function": {"name": "a b"}}])
    with pytest.raises(APIError) as err:
        parse_request("chat", {"messages": CHAT, "tools": [*TOOLS, TOOLS[0]], "n": 4})
    assert err.value.param == "tools" and "named twice" in err.value.message


@pytest.mark.export
@pytest.mark.parametrize(
    "stream,tool_choice",
    [(False, "none"), (True, "auto"), (False, "required"), (True, {"type": "function", "function": {"name": "f1"}})],
)
def test_n_choices_through_the_app_check_their_tools_once(tool_model, monkeypatch, stream, tool_choice):
    """Through the app and the engine, with and without a draft (without: each choice's
    parameters are replaced with mode="ar"): an n=4 request with tools checks them once, and
    with "required" builds its call grammar once (~16 ms a megabyte of tools, on the loop)."""
    import specdec_rt.text.tools as tools_module

    calls = _count_tool_checks(monkeypatch)
    grammars: list = []
    build = tools_module._call_grammar
    monkeypatch.setattr(tools_module, "_call_grammar", lambda *a: grammars.append(a[1]) or build(*a))

    async def check(engine):
        app = create_app(engine, slots=4)
        body = {"messages": CHAT, "tools": TOOLS, "tool_choice": tool_choice, "n": 4, "max_tokens": 3}
        body["stream"] = stream
        async with client(app) as c:
            r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        if not stream:
            assert sorted(ch["index"] for ch in r.json()["choices"]) == [0, 1, 2, 3]

    for draft in ({}, {"draft": "none"}):
        calls.clear(), grammars.clear()
        run(check, tool_model, **draft)
        assert calls == [3], draft
        assert grammars == ([tool_choice] if tool_choice not in ("none", "auto") else []), draft
