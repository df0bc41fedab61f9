"""The OpenAI wire format: request parsing and validation, response / chunk / error bodies.

Pure functions and plain data (no I/O, no Starlette), so every rule here is testable alone.
Unknown OpenAI parameters are ignored; a known one of the wrong type or range, or one this
server cannot honour set to anything but its "off" value (tools, JSON mode), is an
:class:`APIError` (400) whose ``param`` names it.
"""

from __future__ import annotations

import codecs
import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

from ..errors import ContextLengthError, InvalidInputError
from ..logprobs import MAX_TOP_LOGPROBS, TokenLogprob, json_logprob
from ..sampling import SamplingParams, brief_repr

__all__ = ["APIError", "GenParams", "Reply", "LogprobsFormat", "parse_request", "engine_error", "error_body",
           "models_body", "usage_body", "sse"]

Kind = Literal["chat", "completion"]
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]; the Engine itself takes any finite value
MAX_SEED = 2**64 - 1  # a seed is a 64-bit integer, as in OpenAI's API
MAX_N = 16  # choices per request (each one an engine request, batched with the others)


class APIError(Exception):
    """An error answered with the OpenAI error body ``{"error": {message, type, code, param}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(message: str, type: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "code": code, "param": param}}


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code=code, param=param)


@dataclass
class GenParams:
    """A validated request: the engine's arguments plus the response options."""

    kind: Kind
    prompt: str | list[dict]
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"  # the field the client used, for error messages
    temperature: float = 1.0  # OpenAI's defaults: sampling at temperature 1
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    mode: str = "spec"
    stream: bool = False
    include_usage: bool = False
    n: int = 1  # choices
    logprobs: int | None = None  # None: off; n: each token's log-probability and the n most likely
    logit_bias: dict[int, float] | None = None  # token id -> bias (-100..100)
    penalties: dict[str, float] = field(default_factory=dict)  # the ones set: presence/frequency/repetition
    echo: bool = False  # completions: each choice's text starts with the prompt (and its logprobs, when asked)
    prompts: list = field(default_factory=list)  # completions: every prompt of the request (``prompt`` the first)

    @property
    def streams(self) -> list[tuple[Any, int]]:
        """``(prompt, choice)`` of each engine request: ``n`` choices of every prompt, in the
        order of the response's choice indices (prompt i's choice j is index ``i * n + j``)."""
        return [(prompt, j) for prompt in (self.prompts or [self.prompt]) for j in range(self.n)]

    def engine_kwargs(self, default_max_tokens: int, choice: int = 0) -> dict:
        """Keyword arguments for ``Engine.stream`` (after the prompt) of choice ``choice``: with
        a ``seed``, choice i samples with ``seed + i`` (so choices differ, and each is reproducible)."""
        seed = None if self.seed is None else (self.seed + choice) % (MAX_SEED + 1)
        return dict(max_new_tokens=self.max_tokens or default_max_tokens, temperature=self.temperature,
                    top_k=self.top_k, top_p=self.top_p, seed=seed, mode=self.mode,
                    stop=self.stop or None, **({} if self.logprobs is None else {"logprobs": self.logprobs}),
                    **({} if self.logit_bias is None else {"logit_bias": self.logit_bias}), **self.penalties,
                    **({"prompt_logprobs": self.logprobs} if self.echo and self.logprobs is not None else {}))


def parse_request(kind: Kind, body: Any) -> GenParams:
    """Validate a ``/v1/chat/completions`` (``kind="chat"``) or ``/v1/completions`` body."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_type")
    prompts = [_messages(body)] if kind == "chat" else _prompts(body)
    p = GenParams(kind, prompts[0], prompts=prompts)
    for name in ("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",):
        if body.get(name) is not None:
            p.max_tokens, p.max_tokens_param = _int(body, name, minimum=1), name
            break
    if body.get("temperature") is not None:
        p.temperature = _number(body, "temperature", minimum=0.0)
        if p.temperature > MAX_TEMPERATURE:
            raise _bad("temperature", f"temperature must be <= {MAX_TEMPERATURE:g}, got {p.temperature!r}")
    if body.get("top_p") is not None:
        p.top_p = _number(body, "top_p", minimum=0.0)
        if not 0.0 < p.top_p <= 1.0:
            raise _bad("top_p", f"top_p must be in (0, 1], got {p.top_p!r}")
        p.top_p = None if p.top_p == 1.0 else p.top_p
    if body.get("top_k") is not None:
        top_k = _int(body, "top_k", minimum=-1)
        p.top_k = top_k if top_k > 0 else None  # 0 and -1 mean "off", as in vLLM
    if body.get("seed") is not None:
        p.seed = _int(body, "seed", minimum=0, maximum=MAX_SEED)
    p.stop = _stop(body.get("stop"))
    if body.get("n") is not None:
        p.n = _int(body, "n", minimum=1, maximum=MAX_N)
    mode = body.get("mode", "spec")
    if mode not in ("spec", "ar"):
        raise _bad("mode", f"mode must be 'spec' or 'ar', got {mode!r}")
    p.mode = mode
    p.stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise _bad("stream_options", "stream_options must be an object", "invalid_type")
        if not p.stream:
            raise _bad("stream_options", "stream_options is only allowed when stream is true")
        p.include_usage = _bool(options, "include_usage", param="stream_options.include_usage")
    p.logprobs = _logprobs(body, kind)
    if kind == "completion":
        p.echo = _bool(body, "echo")
    p.logit_bias = _logit_bias(body.get("logit_bias"))
    for name in PENALTIES:
        if body.get(name) is not None:
            p.penalties[name] = _number(body, name, minimum=-math.inf)
    try:  # their ranges are the engine's own checks (SamplingParams), answered before admission
        SamplingParams(logit_bias=p.logit_bias, **p.penalties)
    except InvalidInputError as exc:
        raise engine_error(exc, p) from None
    off = SamplingParams()
    p.penalties = {k: v for k, v in p.penalties.items() if v != getattr(off, k)}  # 0, 0, 1: not passed on
    _unsupported(body, kind)
    return p


PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")


def _logprobs(body: dict, kind: Kind) -> int | None:
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
UNHONOURED = {"tools": ([],), "functions": ([],), "tool_choice": ("none", "auto"),
              "function_call": ("none", "auto"), "response_format": ({"type": "text"},)}
UNHONOURED_COMPLETION = {"best_of": (1,), "suffix": ("",)}  # /v1/completions only


def _unsupported(body: dict, kind: Kind) -> None:
    """Options this server cannot honour are refused rather than silently dropped (a client
    that asks for JSON or a tool call would otherwise get free text). Their "off" values
    (``0``, ``null``, ``{}``, ``"none"``, ...), which some clients always send, pass."""
    options = {**UNHONOURED, **UNHONOURED_COMPLETION} if kind == "completion" else UNHONOURED
    for name, off in options.items():
        if body.get(name) is not None and not any(_same(body[name], x) for x in off):
            raise _bad(name, f"{name}={body[name]!r} is not supported by this server", "unsupported_parameter")


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
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12):
            raise _bad("logit_bias", f"logit_bias keys must be token ids (non-negative integers), got {key!r}"[:200])
        if int(key) in out:
            raise _bad("logit_bias", f"logit_bias names token {int(key)} twice")
        out[int(key)] = value
    return out


def _messages(body: dict) -> list[dict]:
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
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in content):
                raise _bad(f"messages[{i}].content", "only text content parts are supported")
            content = "".join(c["text"] for c in content)
        elif content is None and m["role"] == "assistant":
            content = ""
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content", f"messages[{i}].content must be a string", "invalid_type")
        out.append({"role": m["role"], "content": content})
    return out


def _prompts(body: dict) -> list[str | list[int]]:
    """Completions' ``prompt`` in OpenAI's four forms, as a list: a string, a list of strings, a
    list of token ids, or a list of such lists (ids are checked against the vocabulary by the
    engine). Every prompt non-empty."""
    prompt = body.get("prompt")
    if prompt is None:
        raise _bad("prompt", "'prompt' is required", "missing_required_parameter")
    if isinstance(prompt, list) and any(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = next((i for i, t in enumerate(prompt) if not _is_id(t)), None)  # token ids, all of them?
        if bad is not None:
            raise _bad("prompt", f"prompt[{bad}] = {json.dumps(prompt[bad])[:40]} is not a token id (an integer "
                                 ">= 0), in a prompt of token ids")
        prompts = [prompt]
    elif isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        raise _bad("prompt", "'prompt' must be a non-empty string, a list of token ids, or a non-empty list of "
                             "either", "invalid_type")
    for i, one in enumerate(prompts):
        if not ((isinstance(one, str) and one) or (isinstance(one, list) and one and all(_is_id(t) for t in one))):
            raise _bad("prompt", f"prompt[{i}] must be a non-empty string or a non-empty list of token ids "
                                 "(integers >= 0)", "invalid_type")
    return prompts


def _is_id(token: Any) -> bool:
    return isinstance(token, int) and not isinstance(token, bool) and 0 <= token < 2**63


def _int(body: dict, name: str, minimum: int | None = None, maximum: int | None = None) -> int:
    value = body[name]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"{name} must be an integer, got {value!r}", "invalid_type")
    if minimum is not None and value < minimum:
        raise _bad(name, f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise _bad(name, f"{name} must be <= {maximum}, got {value}")
    return value


def _number(body: dict, name: str, minimum: float) -> float:
    value = body[name]
    try:  # a 400-digit JSON integer is not a float (OverflowError), nor is NaN
        finite = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(float(value))
    except OverflowError:
        finite = False
    if not finite:
        raise _bad(name, f"{name} must be a number, got {brief_repr(value)}", "invalid_type")
    if value < minimum:
        raise _bad(name, f"{name} must be >= {minimum}, got {value}")
    return float(value)


def _bool(body: dict, name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(param or name, f"{param or name} must be true or false, got {value!r}", "invalid_type")
    return value


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop", "stop must be a string or a list of strings", "invalid_type")
    return [s for s in stops if s]  # an empty stop string stops nothing


def engine_error(exc: InvalidInputError, p: GenParams) -> APIError:
    """A 400 for an error ``Engine.stream`` raised on these arguments, naming the field."""
    prompt_param = "messages" if p.kind == "chat" else "prompt"
    text = str(exc).replace("max_new_tokens", p.max_tokens_param)  # the API's name for it
    if isinstance(exc, ContextLengthError):
        return APIError(400, text, code="context_length_exceeded", param=prompt_param)
    field = re.match(r"(messages\[\d+\](?:\.\w+)?) ", text)
    if field:  # e.g. "messages[0].content is not valid Unicode text"
        return _bad(field.group(1), text)
    for prefix, param in ((p.max_tokens_param, p.max_tokens_param), ("temperature", "temperature"),
                          ("top_k", "top_k"), ("top_p", "top_p"), ("seed", "seed"), ("stop", "stop"),
                          ("mode", "mode"), ("this engine has no draft", "mode"), ("logit_bias", "logit_bias"),
                          ("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty"),
                          ("repetition_penalty", "repetition_penalty")):
        if text.startswith(prefix):
            return _bad(param, text)
    return _bad(prompt_param, text)  # the prompt or the chat template


@dataclass
class Reply:
    """Formats one request's response: chunks while streaming, one object otherwise."""

    kind: Kind
    model: str
    id: str = ""
    created: int = 0
    include_usage: bool = False  # every chunk but the last carries "usage": null, as OpenAI's do

    def __post_init__(self) -> None:
        self.id = self.id or ("chatcmpl-" if self.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = self.created or int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False, index: int = 0,
              logprobs: dict | None = None) -> dict:
        """A streamed chunk of choice ``index``; a choice's first chat chunk carries ``"role": "assistant"``;
        ``logprobs``: the chunk's tokens' (a :class:`LogprobsFormat` body)."""
        if self.kind == "chat":
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        return {**out, "usage": None} if self.include_usage else out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
        """The last chunk when ``stream_options.include_usage`` is set: no choices, the usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage_body(prompt_tokens, completion_tokens, cached_tokens)}

    def response(self, text: str | list[str], finish_reason: str | list[str], prompt_tokens: int,
                 completion_tokens: int, cached_tokens: int = 0, logprobs: list[dict | None] | None = None) -> dict:
        """The whole (non-streamed) response: one choice per text (``n`` of them: lists);
        ``logprobs``: one :class:`LogprobsFormat` body per choice, when asked."""
        texts = [text] if isinstance(text, str) else text
        finishes = [finish_reason] * len(texts) if isinstance(finish_reason, str) else finish_reason
        lps = logprobs or [None] * len(texts)
        if self.kind == "chat":
            choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": lp,
                        "finish_reason": f} for i, (t, f, lp) in enumerate(zip(texts, finishes, lps))]
            head = self._head("chat.completion")
        else:
            choices = [{"index": i, "text": t, "logprobs": lp, "finish_reason": f}
                       for i, (t, f, lp) in enumerate(zip(texts, finishes, lps))]
            head = self._head("text_completion")
        return {**head, "choices": choices, "usage": usage_body(prompt_tokens, completion_tokens, cached_tokens)}


class LogprobsFormat:
    """One request's ``logprobs`` objects in OpenAI's two shapes: chat, ``{"content": [{token,
    logprob, bytes, top_logprobs}]}``; completions, parallel lists ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (``{token: logprob}``, the chosen token among them, with its own value) and
    ``text_offset`` (characters of the choice's text before each token, counted across chunks;
    special tokens add none, as the text leaves them out). ``token_bytes`` gives a token id's
    bytes, ``special`` whether it is a special token. A token that is not whole UTF-8 (part of a
    character) is named as OpenAI names it, ``"bytes:\\xe2\\x80"``, so distinct tokens never
    share a ``top_logprobs`` key; ``bytes`` are exact either way."""

    def __init__(self, kind: Kind, token_bytes: Callable[[int], bytes], choices: int = 1,
                 special: Callable[[int], bool] | None = None) -> None:
        self.kind, self._bytes, self._special = kind, token_bytes, special or (lambda t: False)
        self._offset = [0] * choices  # characters of each choice's text so far
        self._utf8 = [codecs.getincrementaldecoder("utf-8")("replace") for _ in range(choices)]

    def _piece(self, token: int) -> tuple[str, bytes]:
        b = self._bytes(token)
        try:
            return b.decode("utf-8"), b
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b), b

    def body(self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None], choice: int = 0) -> dict:
        """The logprobs object of ``token_ids`` (an entry of None, an echoed prompt's first token
        in completions: ``null`` value and alternatives, as OpenAI's)."""
        if self.kind == "chat":
            content = []
            for t, e in zip(token_ids, entries):
                text, b = self._piece(t)
                top = [{"token": s, "logprob": json_logprob(lp), "bytes": list(tb)}
                       for s, tb, lp in ((*self._piece(j), lp) for j, lp in e.top)]
                content.append({"token": text, "logprob": json_logprob(e.logprob), "bytes": list(b), "top_logprobs": top})
            return {"content": content, "refusal": None}
        tokens, offsets, tops = [], [], []
        for t, e in zip(token_ids, entries):
            text, b = self._piece(t)
            tokens.append(text)
            offsets.append(self._offset[choice])
            if not self._special(t):  # the characters this token completes (a partial one: none yet)
                self._offset[choice] += len(self._utf8[choice].decode(b))
            if e is None:  # nothing before it to condition on
                tops.append(None)
                continue
            top = {self._piece(j)[0]: json_logprob(lp) for j, lp in e.top}
            top[text] = json_logprob(e.logprob)  # the chosen token's own value, whatever shares its name
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [None if e is None else json_logprob(e.logprob) for e in entries],
                "top_logprobs": tops, "text_offset": offsets}


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage block; ``prompt_tokens_details.cached_tokens``: prompt tokens the prefix
    cache supplied."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def models_body(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                        "owned_by": "specdec-rt"}]}


def sse(data: dict | str) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"data: {text}\n\n".encode()
