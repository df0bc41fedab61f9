"""RequestParams: every field a request may set, checked once, with the engine's messages."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from specdec_rt import InvalidInputError, RequestParams, SamplingParams
from specdec_rt.request.checks import MAX_STOP_CHARS, MAX_STOP_STRINGS
from specdec_rt.request.params import FIELDS

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]

# field -> values it refuses (each error must start with the field's name)
BAD = {
    "max_new_tokens": [None, True, 0, -1, 1.5, "4", float("nan"), [4], np.int64(4), np.float64(4), -(10**5000)],
    "temperature": [None, True, "0.5", float("nan"), float("inf"), -1, -1e-300, 10**400, [0.5], np.bool_(True)],
    "top_k": [True, 0, -1, 1.5, "4", float("inf"), [4]],
    "top_p": [True, 0, -0.5, 1.5, "0.5", float("nan"), 10**400],
    "seed": [True, -1, 1.5, "4", -(10**30), [4]],
    "mode": [True, 5, "SPEC", "", ["spec"], np.array(["spec", "ar"])],
    "stop": [
        5,
        True,
        [""],
        "",
        [5],
        ["a", None],
        {"a": 1},
        b"x",
        ["\ud800"],
        ["x"] * (MAX_STOP_STRINGS + 1),
        ["y" * (MAX_STOP_CHARS + 1)],
    ],
    "truncate_prompt": [None, 1, 0, "yes", [True], np.bool_(True)],
    "logprobs": [True, -1, 21, 1.5, "2", [2]],
    "logit_bias": ["x", 5, {-1: 1.0}, {True: 1.0}, {1: 101}, {1: float("nan")}, {1: "1"}, [(1, 2, 3)]],
    "presence_penalty": ["0", True, 2.5, -2.5, float("nan")],
    "frequency_penalty": ["0", True, 2.5, -2.5, float("inf")],
    "repetition_penalty": ["1", True, 0, 0.001, 11, float("nan")],
    "prompt_logprobs": [True, -1, 21, 1.5, "0"],
    "response_format": [
        "json",
        5,
        {"type": "xml"},
        {"type": "json_schema", "json_schema": 5},
        {"type": "json_schema", "json_schema": {"schema": []}},
    ],
    "tools": ["x", 5, [{"type": "function"}], [{"type": "function", "function": {"name": "a b"}}], TOOLS * 2],
    "tool_choice": ["sometimes", 5, {"type": "function", "function": {"name": "nope"}}, "required"],
    "min_tokens": [True, -1, 1.5, "2", 257, np.int64(2)],
    "ignore_eos": [None, 1, "yes", np.bool_(False)],
}


def test_the_table_covers_every_field():
    assert set(BAD) == set(FIELDS)


@pytest.mark.parametrize(
    "name,value",
    [(n, v) for n, values in BAD.items() for v in values],
    ids=lambda x: x if isinstance(x, str) and len(x) < 20 else "v",
)
def test_a_bad_value_names_its_field(name, value):
    with pytest.raises(InvalidInputError) as info:
        RequestParams(**{name: value})
    message = str(info.value)
    assert message.startswith(name) and len(message) < 300, message


def test_cross_field_rules():
    with pytest.raises(InvalidInputError, match=r"^min_tokens must be an integer from 0 to max_new_tokens \(8\)"):
        RequestParams(max_new_tokens=8, min_tokens=9)
    assert RequestParams(max_new_tokens=8, min_tokens=8).min_tokens == 8
    with pytest.raises(InvalidInputError, match="^tool_choice names function 'sub'"):
        RequestParams(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "sub"}})


def test_defaults_and_canonical_forms():
    p = RequestParams()
    assert (p.max_new_tokens, p.temperature, p.mode, p.stop, p.tools, p.tool_choice) == (256, 0.0, None, (), (), None)
    assert not p.calls_tools and p.json_schema is None and p.sampling_params() == SamplingParams()
    q = RequestParams(
        stop="END",
        presence_penalty=None,
        frequency_penalty=None,
        repetition_penalty=None,
        logprobs=np.int64(3),
        prompt_logprobs=np.int8(0),
        tools=TOOLS,
    )
    assert q.stop == ("END",) and RequestParams(stop=["a", "b"]).stop == ("a", "b")
    assert (q.presence_penalty, q.frequency_penalty, q.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (q.logprobs, q.prompt_logprobs) == (3, 0) and type(q.logprobs) is int
    assert q.tools == tuple(TOOLS) and q.calls_tools and q.effective_tool_choice == "auto"
    assert not RequestParams(tools=TOOLS, tool_choice="none").calls_tools
    assert RequestParams(response_format={"type": "json_object"}).json_schema == {"type": "object"}
    assert RequestParams(response_format={"type": "text"}).json_schema is None


def test_sampling_params_is_the_one_mapping():
    p = RequestParams(
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        seed=3,
        logit_bias={7: -100, 2: 1.5},
        presence_penalty=0.5,
        frequency_penalty=-1,
        repetition_penalty=1.2,
    )
    assert p.sampling_params() == SamplingParams(0.7, 5, 0.9, 3, {2: 1.5, 7: -100}, 0.5, -1, 1.2)
    assert p.sampling_params().logit_bias == ((2, 1.5), (7, -100.0)) and p.sampling_params().penalized


def test_frozen_and_equal_by_value():
    p = RequestParams(max_new_tokens=8, stop="x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_new_tokens = 9
    assert p == RequestParams(max_new_tokens=8, stop=["x"]) and p != RequestParams(max_new_tokens=9, stop="x")


def test_overrides_win_and_are_checked():
    base = RequestParams(max_new_tokens=20, temperature=0.7, seed=1, stop="x")
    p = RequestParams.of(base, max_new_tokens=5, temperature=0.0)
    assert (p.max_new_tokens, p.temperature, p.seed, p.stop) == (5, 0.0, 1, ("x",))
    assert (base.max_new_tokens, base.temperature) == (20, 0.7)  # the original is unchanged
    assert base.replace(seed=2) == RequestParams(max_new_tokens=20, temperature=0.7, seed=2, stop="x")
    assert RequestParams.of(base) is base and RequestParams.of(None, top_k=3) == RequestParams(top_k=3)
    with pytest.raises(InvalidInputError, match="^top_p must be"):
        base.replace(top_p=2)
    with pytest.raises(InvalidInputError, match="^min_tokens must be"):  # checked against the new budget
        RequestParams(max_new_tokens=20, min_tokens=10).replace(max_new_tokens=5)


def test_unknown_keywords_are_named():
    with pytest.raises(InvalidInputError, match="^unknown request parameter 'max_tokens'; known: max_new_tokens"):
        RequestParams.of(None, max_tokens=5)
    with pytest.raises(InvalidInputError, match="^unknown request parameters '_sampling', 'n'"):
        RequestParams.of(RequestParams(), n=2, _sampling=None)
    with pytest.raises(InvalidInputError, match="^params must be a RequestParams or None, got"):
        RequestParams.of({"max_new_tokens": 5})


def test_logit_bias_is_copied_and_survives_replace():
    """The object keeps its own checked copy: a caller's later change to its dict changes nothing,
    and replace() (the server caps max_new_tokens that way) re-checks the copy."""
    bias = {1: 5.0}
    p = RequestParams(logit_bias=bias)
    bias[1], bias[2] = 999.0, "x"
    assert p.logit_bias == {1: 5.0} and p.sampling_params().logit_bias == ((1, 5.0),)
    q = p.replace(max_new_tokens=5)
    assert q.logit_bias == {1: 5.0} and q.max_new_tokens == 5


def test_with_mode_resolves_the_mode_without_checking_again(monkeypatch):
    """What an engine resolves ``mode=None`` to: equal to ``replace(mode=...)``, the checked
    values carried over (a large schema is not checked a second time), a bad mode refused."""
    import specdec_rt.request.params as params_module

    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    p = RequestParams(
        max_new_tokens=9,
        temperature=0.5,
        seed=4,
        stop="END",
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    )
    calls = []
    real = params_module.check_response_format
    monkeypatch.setattr(params_module, "check_response_format", lambda f: calls.append(f) or real(f))
    for mode in ("spec", "ar"):
        got = p.with_mode(mode)
        assert got.mode == mode and p.mode is None
        assert got == dataclasses.replace(p, mode=mode) and got.json_schema == p.json_schema
        assert got.sampling_params() == p.sampling_params()
    assert len(calls) == 2  # the two replace() calls above, none for with_mode
    for bad in (None, "SPEC", 1):
        with pytest.raises(InvalidInputError, match="mode must be"):
            p.with_mode(bad)
