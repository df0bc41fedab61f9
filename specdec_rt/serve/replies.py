"""The OpenAI wire format's responses: whole bodies, streamed chunks, usage, log-probability
objects and server-sent events (pure functions and plain data, like :mod:`.protocol`)."""

from __future__ import annotations

import codecs
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from ..engine.served import ReportsSpeculation, ServedEngine
from ..request.checks import stop_prefix_len
from ..sampling.logprobs import TokenLogprob, json_logprob
from ..text.tools import CALL_OPEN, parse_tool_calls
from .protocol import GenParams, Kind

__all__ = [
    "Reply",
    "LogprobsFormat",
    "CallFilter",
    "call_filter",
    "calls_in",
    "models_body",
    "usage_body",
    "sse",
    "json_bytes",
]


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

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(
        self,
        text: str,
        finish_reason: str | None = None,
        *,
        first: bool = False,
        index: int = 0,
        logprobs: dict[str, Any] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        empty: bool = False,
    ) -> dict[str, Any]:
        """A streamed chunk of choice ``index``; a choice's first chat chunk carries ``"role": "assistant"``;
        ``logprobs``: the chunk's tokens' (a :class:`LogprobsFormat` body); ``tool_calls``: whole
        calls, each with its ``index`` among the choice's calls."""
        if self.kind == "chat":
            delta: dict[str, object] = {"role": "assistant", "content": text} if first else {"content": text}
            if tool_calls:
                delta = {"tool_calls": [{"index": j, **call} for j, call in enumerate(tool_calls)]}
            elif empty:  # a finish after calls: no content at all (a client would add "" to None)
                delta = {}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        return {**out, "usage": None} if self.include_usage else out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        """The last chunk when ``stream_options.include_usage`` is set: no choices, the usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage_body(prompt_tokens, completion_tokens, cached_tokens)}

    def response(
        self,
        text: str | Sequence[str | None],
        finish_reason: str | list[str],
        prompt_tokens: int,
        completion_tokens: int,
        *,
        cached_tokens: int = 0,
        logprobs: list[dict[str, Any] | None] | None = None,
        tool_calls: list[list[dict[str, Any]]] | None = None,
    ) -> dict[str, Any]:
        """The whole (non-streamed) response: one choice per text (``n`` of them: lists);
        ``logprobs``: one :class:`LogprobsFormat` body per choice, when asked; ``tool_calls``:
        each choice's calls (a choice with some: its text is the content around them, None
        when there is none, and ``finish_reason`` ``"tool_calls"`` unless the limit cut it)."""
        texts = [text] if isinstance(text, str) else text
        finishes = [finish_reason] * len(texts) if isinstance(finish_reason, str) else finish_reason
        lps = logprobs or [None] * len(texts)
        calls = tool_calls or [[] for _ in texts]
        if self.kind == "chat":
            choices = []
            for i, (t, f, lp, c) in enumerate(zip(texts, finishes, lps, calls)):
                message: dict[str, object] = {"role": "assistant", "content": t}
                if c:
                    message["tool_calls"] = c
                choices.append(
                    {
                        "index": i,
                        "message": message,
                        "logprobs": lp,
                        "finish_reason": "tool_calls" if c and f == "stop" else f,
                    }
                )
            head = self._head("chat.completion")
        else:
            choices = [
                {"index": i, "text": t, "logprobs": lp, "finish_reason": f}
                for i, (t, f, lp) in enumerate(zip(texts, finishes, lps))
            ]
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

    def __init__(
        self,
        kind: Kind,
        token_bytes: Callable[[int], bytes],
        choices: int = 1,
        special: Callable[[int], bool] | None = None,
    ) -> None:
        self.kind, self._bytes, self._special = kind, token_bytes, special or (lambda t: False)
        self._offset = [0] * choices  # characters of each choice's text so far
        self._utf8 = [codecs.getincrementaldecoder("utf-8")("replace") for _ in range(choices)]

    def _piece(self, token: int) -> tuple[str, bytes]:
        b = self._bytes(token)
        try:
            return b.decode("utf-8"), b
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b), b

    def body(
        self,
        token_ids: Sequence[int],
        entries: Sequence[TokenLogprob | None],
        choice: int = 0,
        *,
        part_ends: bool = False,
        before: tuple[Sequence[int], Sequence[TokenLogprob | None]] | None = None,
    ) -> dict[str, Any]:
        """The logprobs object of ``token_ids`` (an entry of None, an echoed prompt's first token
        in completions: ``null`` value and alternatives, as OpenAI's). ``part_ends``: the text of
        these tokens was decoded apart from what follows (an echoed prompt: a character it leaves
        incomplete is U+FFFD there), so the offsets after them count that way too. ``before``:
        such a part's ``(ids, entries)`` first, in the same object."""
        if before is not None:
            ids, lps = before
            head, tail = self.body(ids, lps, choice, part_ends=True), self.body(token_ids, entries, choice)
            return {k: head[k] + tail[k] for k in head}
        out = self._body(token_ids, entries, choice)
        if part_ends:  # the incomplete character left at the end, as the decoded text shows it
            self._offset[choice] += len(self._utf8[choice].decode(b"", final=True))
            self._utf8[choice].reset()
        return out

    def prompt(
        self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None], choices: Sequence[int]
    ) -> dict[str, Any]:
        """The logprobs object of an echoed prompt that ``choices`` share (nothing before it in
        any of them), made once: :meth:`body` with ``part_ends`` for each of them."""
        first, *rest = choices
        out = self.body(token_ids, entries, first, part_ends=True)
        for j in rest:
            self._offset[j] = self._offset[first]
            self._utf8[j].reset()
        return out

    def _body(self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None], choice: int) -> dict[str, Any]:
        if self.kind == "chat":
            content = []
            for t, e in zip(token_ids, entries):
                assert e is not None  # None: an echoed prompt's first token, in completions alone
                text, b = self._piece(t)
                alts = [
                    {"token": s, "logprob": json_logprob(lp), "bytes": list(tb)}
                    for s, tb, lp in ((*self._piece(j), lp) for j, lp in e.top)
                ]
                content.append(
                    {"token": text, "logprob": json_logprob(e.logprob), "bytes": list(b), "top_logprobs": alts}
                )
            return {"content": content, "refusal": None}
        tokens: list[str] = []
        offsets: list[int] = []
        tops: list[dict[str, float] | None] = []
        for t, e in zip(token_ids, entries):
            text, b = self._piece(t)
            tokens.append(text)
            if self._special(t):
                offsets.append(self._offset[choice])
                advance = 0
            else:  # the characters this token completes (a partial one: none yet)
                decoder = self._utf8[choice]
                pending = decoder.getstate()[0]  # bytes of a character begun before this token
                out = decoder.decode(b)
                # a token that does not continue that character: it became U+FFFD, before this one
                own = codecs.getincrementaldecoder("utf-8")("replace").decode(b) if pending else out
                offsets.append(self._offset[choice] + (len(out) - len(own) if out.endswith(own) else 0))
                advance = len(out)
            self._offset[choice] += advance
            if e is None:  # nothing before it to condition on
                tops.append(None)
                continue
            top = {self._piece(j)[0]: json_logprob(lp) for j, lp in e.top}
            top[text] = json_logprob(e.logprob)  # the chosen token's own value, whatever shares its name
            tops.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": [None if e is None else json_logprob(e.logprob) for e in entries],
            "top_logprobs": tops,
            "text_offset": offsets,
        }


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage block; ``prompt_tokens_details.cached_tokens``: prompt tokens the prefix
    cache supplied."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def models_body(model: str, created: int, engine: ServedEngine | None = None) -> dict[str, Any]:
    """``/v1/models``: the one model, with what the engine runs once it is loaded (``precision``,
    ``draft``, ``exact_to``, ``chosen_by``: :class:`~specdec_rt.engine.precision.PrecisionChoice`)
    and, from an engine that reports them, ``speculation``: its drafter, the measured draft and
    verify costs in plain target steps and the acceptance per draft depth
    (:class:`~specdec_rt.policy.figures.SpeculationFigures`)."""
    entry: dict[str, Any] = {"id": model, "object": "model", "created": created, "owned_by": "specdec-rt"}
    if engine is not None and engine.choice is not None:
        entry.update(engine.choice.as_dict())
    if isinstance(engine, ReportsSpeculation):
        figures = engine.speculation_figures()
        if figures is not None:
            entry["speculation"] = figures
    return {"object": "list", "data": [entry]}


def sse(data: dict[str, Any] | str, *, stepwise: bool = False) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line (``stepwise``: see :func:`json_bytes`)."""
    if isinstance(data, str):
        return f"data: {data}\n\n".encode()
    if not stepwise:
        encoder = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
        return f"data: {encoder.encode(data)}\n\n".encode()
    return b"data: " + json_bytes(data, stepwise=True, allow_nan=True) + b"\n\n"


def release_stepwise(tree: Any) -> None:
    """Take a big JSON-like ``tree`` apart one container at a time, so that dropping it frees
    nothing big at once: freeing a tree of a million objects is one C call that holds the GIL
    throughout (~0.1 s) while the event loop waits for it. Destroys the tree: every dict in it is
    emptied (so nothing else may hold one of its containers)."""
    stack = [tree]
    while stack:
        node = stack.pop()  # the previous node is freed here: its children are on the stack
        if isinstance(node, dict):
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
            node.clear()
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))


STEPWISE_ITEMS = 256  # list items the C encoder writes in one call: well under a millisecond of GIL


def json_bytes(data: Any, *, stepwise: bool = False, allow_nan: bool = False) -> bytes:
    """``data`` as compact UTF-8 JSON, as Starlette's ``JSONResponse`` renders it. ``stepwise``:
    for a big reply encoded in a worker thread: the C encoder writes small values whole and long
    lists :data:`STEPWISE_ITEMS` items at a time, so the thread gives the GIL up between calls
    (one call for the whole reply, or the pure-Python encoder's many small steps under a busy
    machine's scheduler, held the event loop up to ~0.1 s); the same bytes."""
    encoder = json.JSONEncoder(ensure_ascii=False, allow_nan=allow_nan, separators=(",", ":"))
    if not stepwise:
        return encoder.encode(data).encode()
    return "".join(_pieces(data, encoder.encode)).encode()


def _bulky(value: Any) -> bool:
    """Whether ``value`` is too big for one call of the C encoder: a long list or dict, or one
    holding containers."""
    if isinstance(value, dict):
        return len(value) > STEPWISE_ITEMS or any(isinstance(v, (dict, list)) for v in value.values())
    if isinstance(value, list):
        return len(value) > STEPWISE_ITEMS or any(isinstance(v, (dict, list)) and _bulky(v) for v in value)
    return False


def _pieces(value: Any, encode: Callable[[Any], str]) -> Iterator[str]:
    """``value``'s JSON text in pieces, each from one short call of ``encode``."""
    if isinstance(value, dict) and _bulky(value) and all(isinstance(k, str) for k in value):
        yield "{"
        for n, (key, item) in enumerate(value.items()):
            yield ("," if n else "") + encode(key) + ":"
            yield from _pieces(item, encode)
        yield "}"
    elif isinstance(value, list) and _bulky(value):
        yield "["
        for lo in range(0, len(value), STEPWISE_ITEMS):
            part = value[lo : lo + STEPWISE_ITEMS]
            if lo:
                yield ","
            if any(isinstance(v, (dict, list)) and _bulky(v) for v in part):
                for n, item in enumerate(part):
                    if n:
                        yield ","
                    yield from _pieces(item, encode)
            else:
                yield encode(part)[1:-1]
        yield "]"
    else:
        yield encode(value)


class CallFilter:
    """One choice's text with its tool calls held back, streamed or not (the same split either
    way): text goes out as it comes, less a tail that may start a ``<tool_call>``, and less
    leading blank text (content beside calls is None when it is blank); from a call on, the rest
    waits for the end, where it is parsed (:func:`~specdec_rt.text.tools.parse_tool_calls`, calls to
    ``names`` only; the first only unless ``parallel``) into calls and any content left."""

    def __init__(self, names: Sequence[str] | None = None, parallel: bool = True) -> None:
        self.names, self.parallel = names, parallel
        self.held, self.calling = "", False
        self.blank: str | None = ""  # leading whitespace not yet sent (None: text went out)

    def push(self, text: str) -> str:
        """What of ``text`` can go out now."""
        if self.calling:
            self.held += text
            return ""
        buf, self.held = self.held + text, ""
        at = buf.find(CALL_OPEN)
        if at >= 0:
            self.calling, self.held = True, buf[at:]
            return self._out(buf[:at])
        keep = stop_prefix_len(buf, [CALL_OPEN])  # a tail that may start a call
        self.held = buf[len(buf) - keep :]
        return self._out(buf[: len(buf) - keep])

    def _out(self, text: str) -> str:
        if self.blank is not None and not text.strip():  # nothing but whitespace so far: hold it
            self.blank += text
            return ""
        text, self.blank = (self.blank or "") + text, None
        return text

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(the content still held, the calls) at the end of the choice."""
        blank = self.blank or ""
        if not self.calling:
            return blank + self.held, []
        content, calls = parse_tool_calls(self.held, self.names)
        calls = calls if self.parallel else calls[:1]
        if not calls:
            return blank + self.held, []
        return (blank + content if content else ""), calls


def call_filter(params: GenParams) -> CallFilter:
    """A :class:`CallFilter` for one choice of a request (a ``GenParams`` with tools)."""
    return CallFilter([t["function"]["name"] for t in params.tools], params.parallel_tool_calls)


def calls_in(params: GenParams, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer's ``(content, calls)``, split as a stream splits it (:func:`call_filter`)."""
    f = call_filter(params)
    content = f.push(text)
    rest, calls = f.finish()
    return (content + rest) or (None if calls else ""), calls
