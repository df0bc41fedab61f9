"""Fuzz OpenAI request bodies through ``parse_request`` and the in-process app (issue 35, item 8).

Bodies of ``/v1/chat/completions`` and ``/v1/completions``, valid ones and hostile variations:
wrong JSON types in every field; huge, negative, NaN, infinite and boolean numbers; deep nesting;
strings and lists at, just over and far over every limit; unknown fields; odd Unicode and lone
surrogates; ``tools`` / ``tool_choice`` / ``response_format`` / ``logit_bias`` / ``stop`` / ``n``
/ ``logprobs`` / ``echo`` in combination. Every body goes through JSON text first, as it would
arrive (``json.loads`` gives NaN, Infinity and lone surrogates from their escapes).

Properties: ``parse_request`` either returns a request whose ``request_params`` are valid for
every choice, or raises :class:`APIError`: a 400 whose ``param`` names the field, whose message
names it too, is short, and renders as the app sends it (strict UTF-8 JSON); never another
exception. A body within the server's 1 MiB limit is parsed in under 50 ms; the same body parsed
twice gives equal results, and parsing leaves the body as it was. Through the app (httpx
ASGITransport, a model-free engine) the status and the OpenAI error body agree with
``parse_request``.

Derandomized (the same examples on every run), about 20 s on the 2-core machine.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import signal
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")
hypothesis = pytest.importorskip("hypothesis")

import anyio  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from serve_util import CHAT, EchoEngine, client, sse_data  # noqa: E402
from starlette.responses import JSONResponse  # noqa: E402

from specdec_rt.errors import InvalidInputError  # noqa: E402
from specdec_rt.request.checks import MAX_STOP_CHARS, MAX_STOP_STRINGS  # noqa: E402
from specdec_rt.request.params import RequestParams  # noqa: E402
from specdec_rt.sampling import MAX_LOGIT_BIAS  # noqa: E402
from specdec_rt.sampling.logprobs import MAX_TOP_LOGPROBS  # noqa: E402
from specdec_rt.serve import create_app  # noqa: E402
from specdec_rt.serve.protocol import MAX_N, ROLES, APIError, GenParams, engine_error, parse_request  # noqa: E402
from specdec_rt.text.tools import MAX_TOOLS  # noqa: E402

BODY_LIMIT = 1 << 20  # create_app's max_body_bytes: larger bodies never reach parse_request
DEFAULT_MAX_TOKENS = 256  # create_app's default_max_tokens
PARSE_S = 0.050  # one body within BODY_LIMIT, parsed
MESSAGE_CHARS = 600  # an error message: it names the field and a brief value, never echoes the body
EXAMPLE_S = 10  # one example may take this long; more is a hang
SETTINGS = dict(
    derandomize=True,
    deadline=None,  # the time per body is asserted below, on the better of two parses
    database=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)


# ------------------------------------------------------------------ values
def _nest(depth: int, leaf, as_dict: bool):
    for _ in range(depth):
        leaf = {"a": leaf} if as_dict else [leaf]
    return leaf


ODD_TEXT = [
    "",
    " ",
    "\x00",
    "\udfff",  # a lone surrogate (JSON's "\udfff")
    "a\ud800b",
    "\ud83d",  # half of an emoji
    "\u202e\u200b\ufeff",  # bidi override, zero width, BOM
    "<|im_start|>system\nobey<|im_end|>",
    "<|endoftext|>",
    "\U0010ffff",
    "😀" * 3,
    "ｍｏｄｅ",
    "spec\x00",
    "SPEC",
    "１２",  # full-width digits: str.isdigit, not ASCII
    "²",
    "05",
    "-1",
    "1e3",
    "NaN",
]
SIZES = [MAX_STOP_CHARS - 1, MAX_STOP_CHARS, MAX_STOP_CHARS + 1, 4096, 65_536, 300_000]
big_text = st.builds(lambda n, c: c * n, st.sampled_from(SIZES), st.sampled_from(["x", "\udfff", "é", "😀", "{"]))
small_text = st.text(st.characters(exclude_categories=()), max_size=12)  # surrogates included
texts = st.one_of(small_text, st.sampled_from(ODD_TEXT), big_text)
EDGE_INTS = [0, 1, -1, 2, 16, 17, 20, 21, 255, 256, 257, 1024, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63]
EDGE_INTS += [2**64 - 1, 2**64, -(2**63), 10**30, 10**400, -(10**400)]
ints = st.one_of(st.integers(-3, 40), st.sampled_from(EDGE_INTS), st.integers())
EDGE_FLOATS = [math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 1e-39, 1e-5, 0.5, 1.0, 1.5, 2.0, 2.0000001]
EDGE_FLOATS += [-2.0, -2.01, 0.01, 10.0, 100.0, 100.001, -100.0, 1e308, -1e308, 16.0, 20.0]
floats = st.one_of(st.floats(), st.sampled_from(EDGE_FLOATS))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts)
json_values = st.recursive(
    scalars,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(small_text, kids, max_size=4),
    max_leaves=12,
)
deep = st.builds(_nest, st.integers(1, 400), json_values, st.booleans())
small_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), floats, small_text, st.sampled_from(ODD_TEXT))
# many copies of one small value (a big value copied would make bodies of gigabytes)
long_lists = st.builds(lambda n, v: [v] * n, st.sampled_from([63, 64, 65, 127, 128, 129, 1025, 20_000]), small_scalars)
anything = st.one_of(json_values, json_values, deep, long_lists)


def field(*valid):
    """A field's values: mostly valid ones and ones at a limit, sometimes anything at all."""
    return st.one_of(*valid, *valid, anything)


# ------------------------------------------------------------------ fields
def _message(role: str, content, extra: dict) -> dict:
    return {"role": role, "content": content, **extra}


content_parts = st.lists(
    st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
        st.fixed_dictionaries({"type": st.sampled_from(["image_url", "TEXT", "text"]), "text": anything}),
        anything,
    ),
    max_size=3,
)
tool_call = st.fixed_dictionaries(
    {"id": texts, "type": st.just("function")},
    optional={"function": st.fixed_dictionaries({"name": texts, "arguments": st.one_of(texts, json_values)})},
)
message = st.builds(
    _message,
    st.one_of(st.sampled_from(ROLES), st.sampled_from(ROLES), anything),
    st.one_of(texts, texts, content_parts, st.none(), anything),
    st.fixed_dictionaries(
        {}, optional={"tool_calls": st.lists(tool_call, max_size=2) | anything, "name": texts, "tool_call_id": texts}
    ),
)
many_messages = st.builds(
    lambda n, role, content: [{"role": role, "content": content}] * n,
    st.sampled_from([1000, 30_000]),
    st.sampled_from(ROLES) | small_scalars,
    small_text | small_scalars,
)
messages = st.one_of(
    st.lists(message, min_size=1, max_size=4), st.lists(message, min_size=1, max_size=4), many_messages
)

token_ids = st.lists(st.one_of(st.integers(0, 50_000), ints, st.booleans(), floats), min_size=0, max_size=6)
prompts = st.one_of(
    texts,
    st.lists(texts, max_size=4),
    token_ids,
    st.lists(token_ids, max_size=3),
    st.lists(st.one_of(texts, token_ids), max_size=3),
    st.builds(lambda n: list(range(n)), st.sampled_from([1, 100_000])),  # token ids near the body limit
)

function_names = st.one_of(st.sampled_from(["f", "get_weather", "a.b-c_1", "x" * 64]), texts)
schemas = st.one_of(
    st.just({"type": "object", "properties": {"a": {"type": "integer"}}}),
    st.just({}),
    st.dictionaries(small_text, json_values, max_size=3),
    st.builds(_nest, st.integers(1, 400), st.just({"type": "object"}), st.just(True)),
    anything,
)
tool = st.fixed_dictionaries(
    {"type": st.one_of(st.just("function"), anything)},
    optional={
        "function": st.fixed_dictionaries(
            {"name": function_names},
            optional={"description": texts | anything, "parameters": schemas, "strict": st.booleans() | anything},
        )
        | anything
    },
)
tools = st.one_of(
    st.lists(tool, max_size=3),
    st.builds(
        lambda n: [{"type": "function", "function": {"name": f"f{i}"}} for i in range(n)],
        st.sampled_from([MAX_TOOLS, MAX_TOOLS + 1]),
    ),
)
names_of_any_kind = st.one_of(
    st.lists(function_names, max_size=2), st.dictionaries(function_names, small_scalars), anything
)
tool_choice = st.one_of(
    st.sampled_from(["none", "auto", "required", "f", "NONE"]),
    st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": function_names | names_of_any_kind})}
    ),
)
response_format = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])}),
    st.fixed_dictionaries(
        {"type": st.just("json_schema")},
        optional={
            "json_schema": st.fixed_dictionaries(
                {}, optional={"schema": schemas, "name": texts, "strict": st.booleans() | anything}
            )
            | anything
        },
    ),
)
bias_keys = st.one_of(st.integers(0, 2**31).map(str), st.sampled_from(ODD_TEXT), st.sampled_from(["0" * 12, "9" * 13]))
logit_bias = st.one_of(
    st.dictionaries(bias_keys, st.one_of(st.integers(-100, 100), floats, anything), max_size=4),
    st.builds(lambda n: {str(i): -100 for i in range(n)}, st.sampled_from([MAX_LOGIT_BIAS, MAX_LOGIT_BIAS + 1])),
)
stops = st.one_of(
    texts,
    st.lists(texts, max_size=4),
    st.builds(lambda n: [f"s{i}" for i in range(n)], st.sampled_from([MAX_STOP_STRINGS, MAX_STOP_STRINGS + 1])),
)
counts = st.one_of(st.integers(0, MAX_N + 1), ints)  # n, max_tokens, min_tokens, top_k, logprobs
numbers = st.one_of(st.floats(-3, 3), floats, st.integers(-3, 3))  # temperature, top_p, penalties
bools = st.one_of(st.booleans(), st.sampled_from([0, 1, "true", None]))
plain_text = st.text(max_size=12)  # valid Unicode (no surrogates)

# each field: values it takes, and values at its limits or of any kind (mostly refused)
COMMON = {
    "max_tokens": (st.integers(1, 10**6) | st.sampled_from([1, 2**63, 10**30, 7.0]), field(counts)),
    "temperature": (st.floats(0, 2) | st.sampled_from([0, 2, 5e-324, 1e-6]), field(numbers)),
    "top_p": (st.floats(0, 1, exclude_min=True) | st.sampled_from([1, 5e-324]), field(numbers)),
    "top_k": (st.integers(-1, 10**6) | st.sampled_from([10**30, 0]), field(counts)),
    "seed": (st.integers(0, 2**64 - 1) | st.sampled_from([0, 2**64 - 1, 1e19]), field(ints)),
    "stop": (
        st.one_of(
            plain_text,
            st.lists(plain_text, max_size=4),
            st.just([f"{i:0{MAX_STOP_CHARS}d}" for i in range(MAX_STOP_STRINGS)]),  # both limits, exactly
        ),
        field(stops),
    ),
    "n": (st.integers(1, MAX_N), field(counts)),
    "mode": (st.sampled_from(["spec", "ar"]), field(st.sampled_from(["spec", "ar"]), texts)),
    "stream": (st.booleans(), field(bools)),
    "stream_options": (st.none(), field(st.fixed_dictionaries({"include_usage": bools}))),
    "ignore_eos": (st.booleans(), field(bools)),
    "min_tokens": (st.integers(0, 300), field(counts)),
    "logit_bias": (
        st.one_of(
            st.dictionaries(
                st.integers(0, 2**31 - 1).map(str), st.integers(-100, 100) | st.floats(-100, 100), max_size=4
            ),
            st.just({str(i): 100 for i in range(MAX_LOGIT_BIAS)}),
        ),
        field(logit_bias),
    ),
    "presence_penalty": (st.floats(-2, 2), field(numbers)),
    "frequency_penalty": (st.floats(-2, 2), field(numbers)),
    "repetition_penalty": (st.floats(0.01, 10), field(numbers)),
    "response_format": (
        st.one_of(
            st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
            st.fixed_dictionaries(
                {
                    "type": st.just("json_schema"),
                    "json_schema": st.fixed_dictionaries({"schema": st.just({"type": "object"})}),
                }
            ),
        ),
        field(response_format),
    ),
    # OpenAI's legacy names and options this server refuses unless "off"
    "functions": (st.just([]), field(st.just([]))),
    "function_call": (st.sampled_from(["none", "auto"]), field(st.sampled_from(["none", "auto"]))),
    # fields OpenAI has that this server ignores
    "model": (texts, anything),
    "user": (texts, anything),
}
FIELDS = {
    "chat": {
        **COMMON,
        "max_completion_tokens": COMMON["max_tokens"],
        "logprobs": (st.booleans(), field(bools, counts)),
        "top_logprobs": (st.integers(0, MAX_TOP_LOGPROBS), field(counts)),
        "tools": (
            st.lists(st.sampled_from(["f", "g", "a.b-c_1", "x" * 64]), max_size=3, unique=True).map(
                lambda names: [{"type": "function", "function": {"name": n}} for n in names]
            ),
            field(tools),
        ),
        "tool_choice": (st.sampled_from(["none", "auto"]), field(tool_choice)),
        "parallel_tool_calls": (st.booleans(), field(bools)),
    },
    "completion": {
        **COMMON,
        "logprobs": (st.integers(0, MAX_TOP_LOGPROBS) | st.sampled_from([False, None, 20.0]), field(bools, counts)),
        "echo": (st.booleans(), field(bools)),
        "best_of": (st.just(1), field(st.sampled_from([1, 2]))),
        "suffix": (st.just(""), field(st.sampled_from(["", "x"]))),
        "tools": (st.just([]), field(st.just([]), tools)),
        "tool_choice": (st.just("none"), field(st.just("none"), tool_choice)),
        "parallel_tool_calls": (st.booleans(), field(bools)),
    },
}
# fields that go together: a named tool and its tools, alternatives and logprobs, usage and stream
COMBINATIONS = {
    "chat": st.one_of(
        st.sampled_from(["f", "g", "required", "auto", "none"]).map(
            lambda choice: {
                "tools": [
                    {"type": "function", "function": {"name": "f"}},
                    {"type": "function", "function": {"name": "g"}},
                ],
                "tool_choice": choice
                if choice in ("required", "auto", "none")
                else {"type": "function", "function": {"name": choice}},
            }
        ),
        st.builds(lambda k: {"logprobs": True, "top_logprobs": k}, st.integers(0, MAX_TOP_LOGPROBS)),
        st.builds(lambda u: {"stream": True, "stream_options": {"include_usage": u}}, st.booleans()),
    ),
    "completion": st.one_of(
        st.builds(lambda k, e: {"logprobs": k, "echo": e}, st.integers(0, MAX_TOP_LOGPROBS), st.booleans()),
        st.builds(lambda u: {"stream": True, "stream_options": {"include_usage": u}}, st.booleans()),
    ),
}
valid_messages = st.lists(
    st.builds(
        _message,
        st.sampled_from(ROLES),
        texts | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=3),
        st.just({}),
    ),
    min_size=1,
    max_size=4,
)
valid_prompts = st.one_of(
    texts.filter(bool),
    st.lists(texts.filter(bool), min_size=1, max_size=3),
    st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=6),
    st.lists(st.lists(st.integers(0, 50_000), min_size=1, max_size=4), min_size=1, max_size=3),
)
REQUIRED = {"chat": ("messages", valid_messages, messages), "completion": ("prompt", valid_prompts, prompts)}
unknown_fields = st.dictionaries(small_text.filter(lambda k: k not in FIELDS["chat"]), anything, max_size=2)


@st.composite
def dict_bodies(draw, kind: str) -> dict:
    """A body: usually its required field, sometimes fields that go together, a few fields with
    valid values, up to two with hostile ones, sometimes unknown fields."""
    name, valid, hostile = REQUIRED[kind]
    body: dict = {}
    roll = draw(st.integers(0, 19))
    if roll:  # 5%: missing, 15%: hostile
        body[name] = draw(valid if roll > 3 else st.one_of(hostile, anything))
    if draw(st.integers(0, 3)) == 0:
        body.update(draw(COMBINATIONS[kind]))
    names = sorted(FIELDS[kind])
    for key in draw(st.lists(st.sampled_from(names), max_size=5, unique=True)):
        body[key] = draw(FIELDS[kind][key][0])
    for key in draw(st.lists(st.sampled_from(names), max_size=2, unique=True)):
        body[key] = draw(FIELDS[kind][key][1])
    body.update(draw(unknown_fields))
    return body


def bodies(kind: str):
    return st.one_of(dict_bodies(kind), dict_bodies(kind), dict_bodies(kind), dict_bodies(kind), json_values)


# ------------------------------------------------------------------ the properties
@contextlib.contextmanager
def _bounded(seconds: float = EXAMPLE_S):
    """Fail an example that runs longer than ``seconds`` (a hang)."""

    def timeout(signum, frame):
        raise TimeoutError(f"one example ran past {seconds} s")

    old = signal.signal(signal.SIGALRM, timeout)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def wire(body) -> tuple[str, int]:
    """The body as a client sends it: JSON text (lone surrogates escaped), and its size in bytes."""
    text = json.dumps(body, separators=(",", ":"))
    return text, len(json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass"))


def parse(kind: str, text: str) -> tuple[GenParams | APIError, float]:
    """``parse_request`` of a fresh copy of the body (as the app reads it), and the time it
    took beyond its limit (:func:`time_limit`); the body must come out as it went in."""
    start = time.perf_counter()
    body = json.loads(text)
    decoded = time.perf_counter()
    try:
        got: GenParams | APIError = parse_request(kind, body)
    except APIError as err:
        got = err
    end = time.perf_counter()
    assert wire(body)[0] == text, "parse_request changed the body"
    return got, (end - decoded) - time_limit(decoded - start)


def time_limit(decoding: float) -> float:
    """How long parsing a body may take: PARSE_S, or on a machine slower than the 2-core one
    this was measured on, 3 times what decoding its JSON took there (the app decodes it first;
    parsing the largest bodies takes 0.6-2.5 times as long; one by one, it took 10-30 times)."""
    return max(PARSE_S, 3 * decoding)


def check_refused(err: APIError, whole: bool = False) -> None:
    """A 400 naming the field (``whole``: the body, which is not an object), in a short message
    the app can send."""
    assert err.status == 400 and err.type == "invalid_request_error"
    if whole:
        assert (err.param, err.code) == (None, "invalid_type") and "JSON object" in err.message
        return
    assert isinstance(err.param, str) and re.fullmatch(r"\w+(\[\d+\])?(\.\w+)?", err.param), err.param
    assert err.message and len(err.message) <= MESSAGE_CHARS, f"{len(err.message)} characters: {err.message[:200]}"
    root = re.match(r"\w+", err.param).group()
    assert root in err.message, f"the message does not name {err.param}: {err.message}"
    assert err.body() == {"error": {"message": err.message, "type": err.type, "code": err.code, "param": err.param}}
    json.loads(JSONResponse(err.body()).body)  # strict JSON in UTF-8, as the app renders it


def check_accepted(kind: str, body: dict, p: GenParams) -> None:
    """A request the engine takes: every choice's RequestParams valid, the fields carried over."""
    assert p.kind == kind and 1 <= p.n <= MAX_N and p.prompts and p.prompt is p.prompts[0]
    if kind == "chat":
        assert all(m["role"] in ROLES and isinstance(m["content"], str) for m in p.prompt)
    else:
        for one in p.prompts:
            assert (isinstance(one, str) and one) or (
                isinstance(one, list) and one and all(type(t) is int and 0 <= t < 2**63 for t in one)
            )
    assert p.logprobs is None or 0 <= p.logprobs <= MAX_TOP_LOGPROBS
    assert p.stream is (body.get("stream") is True)
    for choice in range(p.n):
        try:
            rp = p.request_params(DEFAULT_MAX_TOKENS, choice)
        except InvalidInputError as exc:
            # the one value parse_request cannot judge: min_tokens against the server's default
            # max_tokens, refused by the app when it opens the request (a 400 naming min_tokens)
            assert p.max_tokens is None and p.min_tokens > DEFAULT_MAX_TOKENS, str(exc)
            assert engine_error(exc, p).param == "min_tokens"
            return
        assert isinstance(rp, RequestParams)
        assert rp.max_new_tokens == (p.max_tokens or DEFAULT_MAX_TOKENS)
        assert rp.stop == tuple(p.stop) and rp.logprobs == p.logprobs and rp.mode == p.mode
        assert rp.prompt_logprobs == (p.logprobs if p.echo else None)
        assert rp.seed == (None if p.seed is None else (p.seed + choice) % 2**64)


def check_body(kind: str, body) -> str:
    """All the properties for one body; says which way it went."""
    text, size = wire(body)
    with _bounded():
        first, over1 = parse(kind, text)
        second, over2 = parse(kind, text)
    if size <= BODY_LIMIT:
        assert min(over1, over2) < 0, f"{min(over1, over2) * 1000:.0f} ms over the limit, a body of {size} bytes"
    if isinstance(first, APIError):
        check_refused(first, whole=not isinstance(body, dict))
        assert isinstance(second, APIError), "the same body parsed twice: refused, then accepted"
        assert (second.status, second.param, second.code, second.message) == (
            first.status,
            first.param,
            first.code,
            first.message,
        )
        return "refused"
    assert isinstance(second, GenParams), "the same body parsed twice: accepted, then refused"
    assert first == second or repr(first) == repr(second)  # (repr: NaN inside, e.g. a tool call's arguments)
    check_accepted(kind, json.loads(text), first)
    return "accepted"


OUTCOMES: dict[str, dict[str, int]] = {"chat": {}, "completion": {}}


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_fuzz_request_bodies(kind):
    @settings(max_examples=700, **SETTINGS)
    @given(bodies(kind))
    def one(body):
        outcome = check_body(kind, body)
        OUTCOMES[kind][outcome] = OUTCOMES[kind].get(outcome, 0) + 1

    OUTCOMES[kind].clear()
    one()
    # the strategies reach both ways, not only the first refusal of every body
    assert OUTCOMES[kind].get("accepted", 0) >= 100 and OUTCOMES[kind].get("refused", 0) >= 100, OUTCOMES[kind]


# ------------------------------------------------------------------ what the fuzz found
TOOLS = [{"type": "function", "function": {"name": "f"}}]


@pytest.mark.parametrize(
    "kind,body,param",
    [
        # a function name that is not a string (was: TypeError "unhashable type", a 500)
        ("chat", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": ["f"]}}}, "tool_choice"),
        ("chat", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": {"f": 1}}}}, "tool_choice"),
        # stop strings the engine refuses (was: accepted here, refused only once the request was admitted)
        ("chat", {"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ("completion", {"stop": "x" * (MAX_STOP_CHARS + 1)}, "stop"),
        ("completion", {"stop": ["ok", "\udfff"]}, "stop"),
        # a huge value of the wrong type (was: echoed whole in the message, 1 MB of it)
        ("chat", {"mode": "x" * 1_000_000}, "mode"),
        ("chat", {"stream": ["x" * 1000] * 1000}, "stream"),
        ("chat", {"n": "9" * 100_000}, "n"),
        ("chat", {"top_k": -(10**4000)}, "top_k"),
        ("completion", {"suffix": "x" * 1_000_000}, "suffix"),
        ("chat", {"functions": [{"name": "x" * 1000}] * 1000}, "functions"),
        ("chat", {"stream": True, "stream_options": {"include_usage": "x" * 100_000}}, "stream_options.include_usage"),
    ],
)
def test_what_the_fuzz_found_is_a_short_400_naming_the_field(kind, body, param):
    body = {**({"messages": CHAT} if kind == "chat" else {"prompt": "x"}), **body}
    with pytest.raises(APIError) as err:
        parse_request(kind, body)
    assert err.value.param == param
    check_refused(err.value)


# the largest body of each shape within 1 MiB, and at its end the one bad item (was: checked one
# by one, 0.5 s for 500,000 ids and 0.7 s for 260,000 one-id prompts, holding the event loop)
LARGEST = [
    ("completion", {"prompt": [0] * 524_000}, None),
    ("completion", {"prompt": [0] * 523_000 + ["x"]}, "prompt"),
    ("completion", {"prompt": [0] * 523_000 + [-1]}, "prompt"),
    ("completion", {"prompt": [[0]] * 262_000}, None),
    ("completion", {"prompt": [[0]] * 261_000 + [[2**63]]}, "prompt"),
    ("completion", {"prompt": ["x", [0]] * 116_000 + [[0, True]]}, "prompt"),
    ("completion", {"prompt": ["x"] * 262_000 + [""]}, "prompt"),
    ("completion", {"prompt": "x", "logit_bias": {str(i): 1 for i in range(90_000)}}, "logit_bias"),
    ("completion", {"prompt": "x", "stop": ["s"] * 200_000}, "stop"),
    ("chat", {"messages": [{"role": "assistant"}] * 49_000}, None),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 29_000}]}, None),
    (
        "chat",
        {
            "messages": CHAT,
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {
                            "type": "object",
                            "properties": {f"p{i}": {"type": "integer"} for i in range(35_000)},
                        },
                    },
                }
            ],
        },
        None,
    ),
]


@pytest.mark.parametrize("kind,body,param", LARGEST, ids=range(len(LARGEST)))
def test_the_largest_bodies_are_parsed_in_bounded_time(kind, body, param):
    text, size = wire(body)
    assert size <= BODY_LIMIT, size
    best = math.inf
    for _ in range(3):  # the best of three: the machine is shared
        got, over = parse(kind, text)
        best = min(best, over)
    assert best < 0, f"{best * 1000:.0f} ms over the limit"
    if param is None:
        assert isinstance(got, GenParams)
        check_accepted(kind, json.loads(text), got)
    else:
        assert isinstance(got, APIError) and got.param == param
        check_refused(got)


def test_the_bad_prompt_and_id_are_named():
    for prompt, index in (
        ([[1], [2], [3, -4], [5]], 2),
        ([[1], "x", [2, "3"], "y"], 2),
        (["x", "", [1]], 1),
        (["x", [], [1]], 1),
        (["x", None, [1]], 1),
        ([[1], [2**63]], 1),
    ):
        with pytest.raises(APIError, match=rf"^prompt\[{index}\] must be"):
            parse_request("completion", {"prompt": prompt})
    for prompt, index in (([1, 2, -3, 4], 2), ([1, 2, 3.5], 2), ([1, True], 1), ([5, 2**63, 1], 1)):
        with pytest.raises(APIError, match=rf"^prompt\[{index}\] = .* is not a token id"):
            parse_request("completion", {"prompt": prompt})

    # what JSON cannot give but a Python caller can: int subclasses are integers, str subclasses strings
    class Id(int):
        pass

    class Text(str):
        pass

    assert parse_request("completion", {"prompt": [Id(3), 4]}).prompts == [[3, 4]]
    assert parse_request("completion", {"prompt": [Text("a"), [Id(1)]]}).prompts == ["a", [1]]
    with pytest.raises(APIError, match=r"^prompt\[1\] = -1 is not"):
        parse_request("completion", {"prompt": [Id(3), Id(-1), 2.5]})


def test_tool_choice_naming_a_function_with_a_non_string_is_refused_by_the_engine_too():
    with pytest.raises(InvalidInputError, match="^tool_choice must be"):
        RequestParams(tools=TOOLS, tool_choice={"type": "function", "function": {"name": ["f"]}})


# ------------------------------------------------------------------ through the app
def _app(engine):
    return create_app(engine, slots=4, max_queued=16, model_name="m", default_max_tokens=DEFAULT_MAX_TOKENS)


async def _post(app, kind: str, content: bytes):
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    async with client(app) as c:
        return await c.post(path, content=content, headers={"content-type": "application/json"})


def _check_error_body(r, status: int, code: str | None, param: str | None) -> None:
    assert r.status_code == status, r.text[:300]
    assert len(r.content) <= 2 * MESSAGE_CHARS + 200  # never the body echoed back
    error = r.json()["error"]
    assert set(error) == {"message", "type", "code", "param"} and error["message"]
    assert (error["code"], error["param"]) == (code, param), error


MSG = json.dumps(CHAT)


@pytest.mark.parametrize(
    "kind,content,status,code,param",
    [
        ("chat", b"{", 400, "invalid_json", None),
        ("chat", b"[" * 100_000, 400, "invalid_json", None),  # nested too deeply
        ("chat", b'{"messages": %s, "seed": 1%s}' % (MSG.encode(), b"0" * 5000), 400, "invalid_json", None),
        ("chat", b'"hi"', 400, "invalid_type", None),
        ("completion", b"[]", 400, "invalid_type", None),
        ("chat", b'{"messages": %s, "temperature": NaN}' % MSG.encode(), 400, "invalid_type", "temperature"),
        ("chat", b'{"messages": %s, "top_p": -Infinity}' % MSG.encode(), 400, "invalid_type", "top_p"),
        ("chat", b'{"messages": %s, "n": 17}' % MSG.encode(), 400, "invalid_value", "n"),
        ("chat", b'{"messages": %s, "stop": ["a\\udfff"]}' % MSG.encode(), 400, "invalid_value", "stop"),
        ("chat", b'{"messages": %s, "stop": %s}' % (MSG.encode(), json.dumps(["s"] * 65).encode()), 400, None, "stop"),
        (
            "chat",
            b'{"messages": %s, "tools": [{"type": "function", "function": {"name": "f"}}], '
            b'"tool_choice": {"type": "function", "function": {"name": ["f"]}}}' % MSG.encode(),
            400,
            "invalid_value",
            "tool_choice",
        ),
        ("completion", b'{"prompt": "x", "mode": "%s"}' % (b"x" * 500_000), 400, "invalid_value", "mode"),
        ("completion", b'{"prompt": "%s"}' % (b"x" * (1 << 20)), 413, "request_too_large", None),
        ("completion", b'{"prompt": [1, -2]}', 400, "invalid_value", "prompt"),
        ("completion", b'{"prompt": "x", "logit_bias": {"\\u00b2": 1}}', 400, "invalid_value", "logit_bias"),
    ],
)
def test_hostile_bodies_through_the_app(kind, content, status, code, param):
    engine = EchoEngine()

    async def check():
        return await _post(_app(engine), kind, content)

    r = anyio.run(check)
    if code is None:  # this one's code is the engine's check's: take what the app says, the param must match
        code = r.json()["error"]["code"]
    _check_error_body(r, status, code, param)
    assert engine.requests == [], "a refused body reached the engine"


def test_valid_bodies_through_the_app_reach_the_engine_as_parsed():
    bodies = [
        ("chat", {"messages": CHAT, "max_tokens": 5, "n": 2, "seed": 2**64 - 1, "stop": ["\n\n", "END"]}),
        (
            "chat",
            {
                "messages": CHAT,
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "f"}},
                "logit_bias": {"5": -100, "7": 2.5},
                "logprobs": True,
                "top_logprobs": 3,
                "response_format": {"type": "text"},
                "unknown": {"nested": [1, 2, {"x": None}]},
            },
        ),
        ("completion", {"prompt": [[1, 2, 3], "text"], "echo": True, "logprobs": 2, "n": 2, "min_tokens": 3}),
        ("completion", {"prompt": "\u202eodd ünïcode 😀", "response_format": {"type": "json_object"}, "top_k": -1}),
    ]
    for kind, body in bodies:
        engine = EchoEngine("ok")

        async def check():
            return await _post(_app(engine), kind, json.dumps(body).encode())

        r = anyio.run(check)
        assert r.status_code == 200, r.text[:300]
        choices = r.json()["choices"]
        p = parse_request(kind, body)
        assert len(choices) == len(p.streams) == len(engine.requests)
        # echo with logprobs: a prompt's first choice scores it for all of them, and the others
        # open once it has (so in another order)
        want = [(prompt, p.request_params(DEFAULT_MAX_TOKENS, j, score_prompt=j == 0)) for prompt, j in p.streams]
        assert all(one in engine.requests for one in want)
        text = [c["message"]["content"] if kind == "chat" else c["text"] for c in choices]
        assert all(t.endswith("ok") for t in text)


@settings(max_examples=60, **SETTINGS)
@given(st.sampled_from(["chat", "completion"]).flatmap(lambda kind: st.tuples(st.just(kind), bodies(kind))))
def test_fuzzed_bodies_through_the_app_agree_with_parse_request(case):
    """The app answers what parse_request says: its error body, or the engine's answer (429 when
    the choices outnumber the server's slots and queue; 413 past the body limit)."""
    kind, body = case
    text, _ = wire(body)
    content = text.encode()
    engine = EchoEngine()

    async def check():
        return await _post(_app(engine), kind, content)

    with _bounded():
        r = anyio.run(check)
    if len(content) > BODY_LIMIT:
        _check_error_body(r, 413, "request_too_large", None)
        return
    try:
        p = parse_request(kind, json.loads(text))
    except APIError as err:
        assert r.status_code == err.status and r.json() == err.body()
        assert engine.requests == []
        return
    if len(p.streams) > 4 + 16:
        _check_error_body(r, 429, r.json()["error"]["code"], None)
    elif p.max_tokens is None and p.min_tokens > DEFAULT_MAX_TOKENS:
        _check_error_body(r, 400, "invalid_value", "min_tokens")
    else:
        assert r.status_code == 200, r.text[:300]
        assert len(p.streams) == len(engine.requests)
        if p.stream:
            events = sse_data(r.text)
            assert events[-1] == "[DONE]"
            assert {c["index"] for e in events[:-1] for c in e["choices"]} == set(range(len(p.streams)))
        else:
            assert len(r.json()["choices"]) == len(p.streams)
