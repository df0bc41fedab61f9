"""The OpenAI wire format: request parsing and validation, and error bodies (responses and
chunks: :mod:`specdec_rt.serve.replies`).

Pure functions and plain data (no I/O, no Starlette), so every rule here is testable alone.
Unknown OpenAI parameters are ignored; a known one of the wrong type or range, or one this
server cannot honour set to anything but its "off" value (tools), is an
:class:`APIError` (400) whose ``param`` names it.
"""

from __future__ import annotations

import math
import operator
import re
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from itertools import accumulate, chain, compress, repeat
from typing import Any, Literal

from ..checks import brief_repr, is_int, is_number
from ..errors import ContextLengthError, InvalidInputError
from ..request.checks import check_stop
from ..request.params import RequestParams
from ..sampling import MAX_LOGIT_BIAS, SamplingParams
from ..sampling.constraints import check_response_format
from ..sampling.logprobs import MAX_TOP_LOGPROBS
from ..text.tools import check_tool_choice, checked_tools
from ..types import Mode

__all__ = [
    "APIError",
    "GenParams",
    "parse_request",
    "engine_error",
    "error_body",
    "Kind",
    "check_prompt_logprob_work",
    "prompt_logprob_work",
]

Kind = Literal["chat", "completion"]
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]; the Engine itself takes any finite value
MAX_SEED = 2**64 - 1  # a seed is a 64-bit integer, as in OpenAI's API
MAX_N = 16  # choices per request (each one an engine request, batched with the others)
MAX_PROMPT_TOKENS = 1 << 17  # the server's limit on token ids in a request's prompts, all of them together
#: the server's default budget of echoed prompt log-probability entries a request
#: (prompt tokens x (1 + logprobs) x n; see check_prompt_logprob_work)
DEFAULT_PROMPT_LOGPROB_WORK = 1 << 20


class APIError(Exception):
    """An error answered with the OpenAI error body ``{"error": {message, type, code, param}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)

    def copy(self) -> APIError:
        """The same error, without this one's traceback and context (nor what their frames hold)."""
        return APIError(
            self.status, self.message, type=self.type, code=self.code, param=self.param, headers=dict(self.headers)
        )


def error_body(message: str, type: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "code": code, "param": param}}


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code=code, param=param)


@dataclass
class GenParams:
    """A validated request: the engine's arguments plus the response options."""

    kind: Kind
    prompt: str | list[dict[str, Any]] | list[int]  # chat: the messages; completions: a text or token ids
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"  # the field the client used, for error messages
    temperature: float = 1.0  # OpenAI's defaults: sampling at temperature 1
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    mode: Mode | None = None  # None: the body named none, the engine's own (plain without a draft)
    stream: bool = False
    include_usage: bool = False
    n: int = 1  # choices
    logprobs: int | None = None  # None: off; n: each token's log-probability and the n most likely
    logit_bias: dict[int, float] | None = None  # token id -> bias (-100..100)
    penalties: dict[str, float] = field(default_factory=dict)  # the ones set: presence/frequency/repetition
    echo: bool = False  # completions: each choice's text starts with the prompt (and its logprobs, when asked)
    prompts: list[Any] = field(default_factory=list)  # completions: every prompt of the request (``prompt`` the first)
    response_format: dict[str, Any] | None = None  # json_object / json_schema (checked); None: text
    tools: Sequence[dict[str, Any]] = ()  # chat: functions the model may call (checked: a CheckedTools)
    tool_choice: str | dict[str, Any] = "none"  # "auto" with tools, unless the request says otherwise
    parallel_tool_calls: bool = True  # False: at most one call an answer (the first)
    min_tokens: int = 0  # vLLM's: no end-of-sequence token before this many
    ignore_eos: bool = False  # vLLM's: go on past end-of-sequence tokens

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may hold tool calls (to parse out of the text)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def scores_prompt(self) -> bool:
        """The prompts' own log-probabilities are asked for (``echo`` with ``logprobs``)."""
        return self.echo and self.logprobs is not None

    @property
    def streams(self) -> list[tuple[Any, int]]:
        """``(prompt, choice)`` of each engine request: ``n`` choices of every prompt, in the
        order of the response's choice indices (prompt i's choice j is index ``i * n + j``)."""
        return [(prompt, j) for prompt in (self.prompts or [self.prompt]) for j in range(self.n)]

    def request_params(self, default_max_tokens: int, choice: int = 0, *, score_prompt: bool = True) -> RequestParams:
        """The engine's parameters for choice ``choice``: the one place OpenAI's fields become a
        :class:`~specdec_rt.request.params.RequestParams`. ``max_tokens`` (or
        ``max_completion_tokens``) is ``max_new_tokens``, else ``default_max_tokens``; with a
        ``seed``, choice i samples with ``seed + i`` (so choices differ, and each is
        reproducible); ``echo`` with ``logprobs`` asks for the prompt's log-probabilities too,
        unless ``score_prompt`` is false (a choice that shares another one's).
        A value the engine refuses raises its :class:`InvalidInputError` (see :func:`engine_error`)."""
        seed = None if self.seed is None else (self.seed + choice) % (MAX_SEED + 1)
        return RequestParams(
            max_new_tokens=self.max_tokens or default_max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=seed,
            mode=self.mode,
            stop=self.stop,
            logprobs=self.logprobs,
            logit_bias=self.logit_bias,
            presence_penalty=self.penalties.get("presence_penalty", 0.0),
            frequency_penalty=self.penalties.get("frequency_penalty", 0.0),
            repetition_penalty=self.penalties.get("repetition_penalty", 1.0),
            prompt_logprobs=self.logprobs if self.echo and score_prompt else None,
            response_format=self.response_format,
            tools=self.tools,
            tool_choice=self.tool_choice if self.tools else None,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
        )


def parse_request(
    kind: Kind, body: Any, *, max_prompts: int | None = None, max_prompt_tokens: int | None = None
) -> GenParams:
    """Validate a ``/v1/chat/completions`` (``kind="chat"``) or ``/v1/completions`` body.
    ``max_prompts``: completions' prompts in one request; ``max_prompt_tokens``: token ids in
    its prompts, all together (both counted before any prompt is looked at one by one; None:
    no limit)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_type")
    prompts = [_messages(body)] if kind == "chat" else _prompts(body, max_prompts, max_prompt_tokens)
    p = GenParams(kind, prompts[0], prompts=prompts)
    for read in (_read_length, _read_sampling, _read_choices, _read_streaming, _read_biases, _read_structure):
        read(p, body)
    _unsupported(body, kind)
    return p


def _read_length(p: GenParams, body: dict[str, Any]) -> None:
    """``max_tokens`` (chat: ``max_completion_tokens`` first)."""
    for name in ("max_completion_tokens", "max_tokens") if p.kind == "chat" else ("max_tokens",):
        if body.get(name) is not None:
            p.max_tokens, p.max_tokens_param = _int(body, name, minimum=1), name
            break


def _read_sampling(p: GenParams, body: dict[str, Any]) -> None:
    """``temperature``, ``top_p``, ``top_k`` and ``seed``."""
    if body.get("temperature") is not None:
        p.temperature = _number(body, "temperature", minimum=0.0)
        if p.temperature > MAX_TEMPERATURE:
            raise _bad("temperature", f"temperature must be <= {MAX_TEMPERATURE:g}, got {p.temperature!r}")
    if body.get("top_p") is not None:
        top_p = _number(body, "top_p", minimum=0.0)
        if not 0.0 < top_p <= 1.0:
            raise _bad("top_p", f"top_p must be in (0, 1], got {top_p!r}")
        p.top_p = None if top_p == 1.0 else top_p
    if body.get("top_k") is not None:
        top_k = _int(body, "top_k", minimum=-1)
        p.top_k = top_k if top_k > 0 else None  # 0 and -1 mean "off", as in vLLM
    if body.get("seed") is not None:
        p.seed = _int(body, "seed", minimum=0, maximum=MAX_SEED)


def _read_choices(p: GenParams, body: dict[str, Any]) -> None:
    """``stop``, ``n`` and ``mode``."""
    p.stop = _stop(body.get("stop"))
    if body.get("n") is not None:
        p.n = _int(body, "n", minimum=1, maximum=MAX_N)
    if "mode" in body:
        if body["mode"] not in ("spec", "ar"):
            raise _bad("mode", f"mode must be 'spec' or 'ar', got {brief_repr(body['mode'])}")
        p.mode = body["mode"]


def _read_streaming(p: GenParams, body: dict[str, Any]) -> None:
    """``stream``, ``ignore_eos``, ``min_tokens``, ``stream_options``, the log-probabilities
    and ``echo``."""
    p.stream = _bool(body, "stream")
    p.ignore_eos = _bool(body, "ignore_eos")
    if body.get("min_tokens") is not None:
        p.min_tokens = _int(body, "min_tokens", minimum=0)
        if p.max_tokens is not None and p.min_tokens > p.max_tokens:
            raise _bad("min_tokens", f"min_tokens ({p.min_tokens}) must be <= {p.max_tokens_param} ({p.max_tokens})")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise _bad("stream_options", "stream_options must be an object", "invalid_type")
        if not p.stream:
            raise _bad("stream_options", "stream_options is only allowed when stream is true")
        p.include_usage = _bool(options, "include_usage", param="stream_options.include_usage")
    p.logprobs = _logprobs(body, p.kind)
    if p.kind == "completion":
        p.echo = _bool(body, "echo")


def _read_biases(p: GenParams, body: dict[str, Any]) -> None:
    """``logit_bias`` and the penalties, checked by the engine's own rules (SamplingParams)
    before admission; penalties at their "off" values are not passed on."""
    p.logit_bias = _logit_bias(body.get("logit_bias"))
    for name in PENALTIES:
        if body.get(name) is not None:
            p.penalties[name] = _number(body, name, minimum=-math.inf)
    try:
        checked: dict[str, Any] = {"logit_bias": p.logit_bias, **p.penalties}  # the client's values
        SamplingParams(**checked)
    except InvalidInputError as exc:
        raise engine_error(exc, p) from None
    off = asdict(SamplingParams())
    p.penalties = {k: v for k, v in p.penalties.items() if v != off[k]}  # 0, 0, 1: not passed on


def _read_structure(p: GenParams, body: dict[str, Any]) -> None:
    """``response_format``, and chat's ``tools``, ``tool_choice`` and ``parallel_tool_calls``."""
    if body.get("response_format") is not None:
        try:  # the engine's own check: the shape here, the schema when the request starts (a 400 still)
            p.response_format = (
                body["response_format"] if check_response_format(body["response_format"]) is not None else None
            )  # (an empty schema {} holds the answer to any JSON value)
        except InvalidInputError as exc:
            raise _bad("response_format", str(exc)) from None
    if p.kind != "chat":
        return
    if body.get("tools") is not None or body.get("tool_choice") is not None:
        try:  # the engine's own checks; tools the template cannot render: a 400 when the request starts
            p.tools = checked_tools(body.get("tools"))  # once: each choice's RequestParams takes them as they are
            p.tool_choice = check_tool_choice(body.get("tool_choice"), p.tools)
        except InvalidInputError as exc:
            raise _bad("tool_choice" if str(exc).startswith("tool_choice") else "tools", str(exc)) from None
    p.parallel_tool_calls = body.get("parallel_tool_calls") is None or _bool(body, "parallel_tool_calls")


PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")


def _logprobs(body: dict[str, Any], kind: Kind) -> int | None:
    """Chat: ``logprobs`` (bool) and ``top_logprobs`` (0..20, needs ``logprobs``); completions:
    ``logprobs`` (an int 0..20, the alternatives; ``null`` / ``false``: off)."""
    if kind == "completion":
        if body.get("logprobs") is None or body["logprobs"] is False:
            return None
        return _int(body, "logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS)
    wanted = _bool(body, "logprobs")
    top = None if body.get("top_logprobs") is None else _int(body, "top_logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS)
    if top and not wanted:
        raise _bad("top_logprobs", "top_logprobs needs logprobs to be true")
    return (top or 0) if wanted else None


# options this server cannot honour, and their "off" values (which some clients always send)
UNHONOURED: dict[str, tuple[Any, ...]] = {
    "functions": ([],),
    "function_call": ("none", "auto"),
}  # the legacy names of tools
UNHONOURED_COMPLETION = {
    "best_of": (1,),
    "suffix": ("",),
    "tools": ([],),  # /v1/completions only
    "tool_choice": ("none",),
    "parallel_tool_calls": (True, False),
}  # (tools: chat only)


def _unsupported(body: dict[str, Any], kind: Kind) -> None:
    """Options this server cannot honour are refused rather than silently dropped (a client
    that asks for JSON or a tool call would otherwise get free text). Their "off" values
    (``0``, ``null``, ``{}``, ``"none"``, ...), which some clients always send, pass."""
    options = {**UNHONOURED, **UNHONOURED_COMPLETION} if kind == "completion" else UNHONOURED
    for name, off in options.items():
        if body.get(name) is not None and not any(_same(body[name], x) for x in off):
            raise _bad(
                name, f"{name}={brief_repr(body[name])} is not supported by this server", "unsupported_parameter"
            )


def _same(value: Any, off: Any) -> bool:
    """``value`` is ``off``: numbers by value (``0``, ``0.0`` and ``false`` alike), the rest by type and value."""
    if isinstance(off, (bool, int, float)):
        return isinstance(value, (bool, int, float)) and value == off
    return type(value) is type(off) and value == off


def _logit_bias(bias: Any) -> dict[int, Any] | None:
    """OpenAI's ``logit_bias``: an object of token ids (as strings, JSON's keys) to biases. The
    keys are read here (one token named twice, ``"5"`` and ``"05"``, is refused); the biases and
    the count are SamplingParams' to check, the ids against the vocabulary the engine's."""
    if bias is None or bias == {}:
        return None
    if not isinstance(bias, dict):
        raise _bad("logit_bias", "logit_bias must be an object of token ids to biases", "invalid_type")
    if len(bias) > MAX_LOGIT_BIAS:  # before any key is read (1 MiB of JSON holds ~100,000)
        raise _bad("logit_bias", f"logit_bias has {len(bias)} entries, more than {MAX_LOGIT_BIAS}")
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12):
            raise _bad("logit_bias", f"logit_bias keys must be token ids (non-negative integers), got {key!r}"[:200])
        if int(key) in out:
            raise _bad("logit_bias", f"logit_bias names token {int(key)} twice")
        out[int(key)] = value
    return out


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if messages is None:
        raise _bad("messages", "'messages' is required", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "'messages' must be a non-empty list of {role, content} objects", "invalid_type")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise _bad(f"messages[{i}]", f"messages[{i}] must be an object with a role among {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text parts can be read
            if not all(
                isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str) for c in content
            ):
                raise _bad(f"messages[{i}].content", f"messages[{i}].content: only text content parts are supported")
            content = "".join(c["text"] for c in content)
        elif content is None and m["role"] == "assistant":
            content = ""
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content", f"messages[{i}].content must be a string", "invalid_type")
        role = m["role"]
        msg = {"role": role, "content": content}
        if role == "assistant" and m.get("tool_calls"):  # a call the model made (checked by the engine)
            msg["tool_calls"] = m["tool_calls"]
        elif role == "tool":
            for key in ("tool_call_id", "name"):  # a tool's answer to a call
                if isinstance(m.get(key), str):
                    msg[key] = m[key]
        out.append(msg)
    return out


def _prompts(body: dict[str, Any], max_prompts: int | None, max_tokens: int | None) -> list[str | list[int]]:
    """Completions' ``prompt`` in OpenAI's four forms, as a list: a string, a list of strings, a
    list of token ids, or a list of such lists (ids are checked against the vocabulary by the
    engine). Every prompt non-empty; at most ``max_prompts`` of them and ``max_tokens`` ids in
    all, counted first. The lists are checked in C loops: 1 MiB of JSON holds 500,000 ids or
    260,000 one-id prompts, 0.5-0.7 s on the event loop one by one."""
    prompt = body.get("prompt")
    if prompt is None:
        raise _bad("prompt", "'prompt' is required", "missing_required_parameter")
    if isinstance(prompt, list) and prompt:  # its length first: one prompt of ids, or a list of prompts
        _check_count(prompt, max_prompts, max_tokens)
    types = list(map(type, prompt)) if isinstance(prompt, list) else []
    kinds = _kinds(types)
    if any(issubclass(k, int) and k is not bool for k in kinds):  # an integer in it: token ids, all of them?
        bad = _bad_id(prompt, types, kinds)
        if bad is not None:
            raise _bad(
                "prompt",
                f"prompt[{bad}] = {brief_repr(prompt[bad], 40)} is not a token id (an integer "
                ">= 0), in a prompt of token ids",
            )
        return [prompt]
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
        bad = None if prompt else 0
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
        bad = _bad_prompt(prompt, types, kinds)
    else:
        raise _bad(
            "prompt",
            "'prompt' must be a non-empty string, a list of token ids, or a non-empty list of either",
            "invalid_type",
        )
    if bad is not None:
        raise _bad(
            "prompt",
            f"prompt[{bad}] must be a non-empty string or a non-empty list of token ids (integers >= 0)",
            "invalid_type",
        )
    if list in kinds and max_tokens is not None:
        _check_total(prompts, max_tokens)
    return prompts


def _check_count(prompt: list[Any], max_prompts: int | None, max_tokens: int | None) -> None:
    """A 400 for a list prompt longer than its limit: ``max_tokens`` for one prompt of ids,
    ``max_prompts`` for a list of prompts."""
    ids = is_int(prompt[0], numpy=False)
    count, limit = len(prompt), max_tokens if ids else max_prompts
    if limit is not None and count > limit:
        what = "token ids, more than one request may hold" if ids else "prompts, more than one request may hold"
        raise _bad("prompt", f"prompt holds {count} {what} (at most {limit})")


def _check_total(prompts: list[str | list[int]], max_tokens: int) -> None:
    """A 400 when the prompts of ids hold more than ``max_tokens`` ids in all."""
    total = sum(len(one) for one in prompts if isinstance(one, list))
    if total > max_tokens:
        raise _bad(
            "prompt",
            f"prompt holds {total} token ids in all, more than one request may hold (at most {max_tokens})",
        )


def _kinds(types: list[Any]) -> set[Any]:
    """``set(types)``, the distinct types of a list's items, without a hash per item when they
    are all the same (``count`` matches by identity first: 30 times faster)."""
    return {types[0]} if types and types.count(types[0]) == len(types) else set(types)


def _is_id(token: Any) -> bool:
    return is_int(token, numpy=False) and 0 <= token < 2**63


def _bad_id(items: list[Any], types: list[Any] | None = None, kinds: set[Any] | None = None) -> int | None:
    """The index of an item of ``items`` that is not a token id (an integer >= 0 and < 2**63),
    or None; ``types`` / ``kinds``: the items' types and :func:`_kinds`, when known already."""
    types = list(map(type, items)) if types is None else types
    kinds = _kinds(types) if kinds is None else kinds
    if kinds <= {int}:  # what JSON gives: plain ints, checked by their range
        low, high = min(items, default=0), max(items, default=0)
        return items.index(low) if low < 0 else items.index(high) if high >= 2**63 else None
    others = kinds - {int}
    if all(k is bool or not issubclass(k, int) for k in others):  # not integers: the first of them
        return min(types.index(k) for k in others)
    return next((i for i, t in enumerate(items) if not _is_id(t)), None)  # int subclasses: one by one


def _bad_prompt(prompts: list[Any], types: list[Any], kinds: set[Any]) -> int | None:
    """The index of a prompt that is not a non-empty string or a non-empty list of token ids,
    or None (``types`` / ``kinds`` as for :func:`_bad_id`)."""
    if not kinds <= {str, list}:
        strange = [k for k in kinds if not issubclass(k, (str, list))]
        if strange:
            return min(types.index(k) for k in strange)
        return next((i for i, one in enumerate(prompts) if not _is_prompt(one)), None)  # subclasses
    sizes = list(map(len, prompts))
    if 0 in sizes:
        return sizes.index(0)
    if list not in kinds:
        return None
    where: Sequence[int] = range(len(prompts))  # the index of each list
    if str in kinds:  # strings and lists: the lists' ids
        is_list = list(map(operator.is_, types, repeat(list)))
        bad = _bad_id(list(chain.from_iterable(compress(prompts, is_list))))
        if bad is None:
            return None
        where, sizes = list(compress(range(len(prompts)), is_list)), list(compress(sizes, is_list))
    else:
        bad = _bad_id(list(chain.from_iterable(prompts)))
        if bad is None:
            return None
    return where[bisect_right(list(accumulate(sizes)), bad)]  # the prompt that holds it


def _is_prompt(one: Any) -> bool:
    return (isinstance(one, str) and bool(one)) or (isinstance(one, list) and bool(one) and _bad_id(one) is None)


def _int(body: dict[str, Any], name: str, minimum: int | None = None, maximum: int | None = None) -> int:
    value = body[name]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not is_int(value, numpy=False):
        raise _bad(name, f"{name} must be an integer, got {brief_repr(value)}", "invalid_type")
    if minimum is not None and value < minimum:
        raise _bad(name, f"{name} must be >= {minimum}, got {brief_repr(value)}")
    if maximum is not None and value > maximum:
        raise _bad(name, f"{name} must be <= {maximum}, got {brief_repr(value)}")
    return int(value)


def _number(body: dict[str, Any], name: str, minimum: float) -> float:
    value = body[name]
    if not is_number(value):  # a 400-digit JSON integer is not a float, nor is NaN
        raise _bad(name, f"{name} must be a number, got {brief_repr(value)}", "invalid_type")
    if value < minimum:
        raise _bad(name, f"{name} must be >= {minimum}, got {value}")
    return float(value)


def _bool(body: dict[str, Any], name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(param or name, f"{param or name} must be true or false, got {brief_repr(value)}", "invalid_type")
    return value


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop", "stop must be a string or a list of strings", "invalid_type")
    try:  # the engine's own limits (count, length, valid Unicode), answered before admission
        return check_stop([s for s in stops if s])  # an empty stop string stops nothing
    except InvalidInputError as exc:
        raise _bad("stop", str(exc)) from None


def prompt_logprob_work(p: GenParams, prompt_tokens: int) -> int:
    """What echoing prompts of ``prompt_tokens`` tokens in all with their log-probabilities
    costs: the reply's entries for them, ``prompt_tokens x (1 + logprobs) x n`` (each token's
    own value and its alternatives, in each choice; each prompt is scored once, whatever ``n``)."""
    return prompt_tokens * (1 + (p.logprobs or 0)) * p.n


def check_prompt_logprob_work(p: GenParams, prompt_tokens: int, budget: int | None) -> None:
    """A 400 when :func:`prompt_logprob_work` is over ``budget`` (the server's
    ``--max-prompt-logprob-work``; None: no limit), saying what to lower."""
    work = prompt_logprob_work(p, prompt_tokens)
    if budget is not None and work > budget:
        raise _bad(
            "logprobs",
            f"echo with logprobs={p.logprobs} and n={p.n} on {prompt_tokens} prompt tokens is {work} "
            f"log-probability entries (prompt tokens x (1 + logprobs) x n), more than this server's "
            f"--max-prompt-logprob-work of {budget}: lower logprobs, n or the prompt's length",
        )


def engine_error(exc: InvalidInputError, p: GenParams) -> APIError:
    """A 400 for an error ``Engine.stream`` raised on these arguments, naming the field."""
    prompt_param = "messages" if p.kind == "chat" else "prompt"
    text = str(exc).replace("max_new_tokens", p.max_tokens_param)  # the API's name for it
    if isinstance(exc, ContextLengthError):
        return APIError(400, text, code="context_length_exceeded", param=prompt_param)
    field = re.match(r"(messages\[\d+\](?:\.\w+)?) ", text)
    if field:  # e.g. "messages[0].content is not valid Unicode text"
        return _bad(field.group(1), text)
    for prefix, param in (
        (p.max_tokens_param, p.max_tokens_param),
        ("temperature", "temperature"),
        ("top_k", "top_k"),
        ("top_p", "top_p"),
        ("seed", "seed"),
        ("stop", "stop"),
        ("mode", "mode"),
        ("this engine has no draft", "mode"),
        ("logit_bias", "logit_bias"),
        ("presence_penalty", "presence_penalty"),
        ("frequency_penalty", "frequency_penalty"),
        ("repetition_penalty", "repetition_penalty"),
        ("response_format", "response_format"),
        ("tool_choice", "tool_choice"),
        ("tools", "tools"),
        ("min_tokens", "min_tokens"),
        ("ignore_eos", "ignore_eos"),
    ):
        if text.startswith(prefix):
            return _bad(param, text)
    return _bad(prompt_param, text)  # the prompt or the chat template
