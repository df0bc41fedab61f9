"""Tool calling in OpenAI's shape, for chat templates that write calls as Hermes-style
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5 and the many models
trained on that format).

Pure functions, no I/O: the tools' and the messages' checks, the template's view of a message
history with calls in it, the parse of an answer into text and calls, and the grammar that makes
a call certain (``tool_choice`` ``"required"`` or a named function; llguidance's Lark with an
embedded JSON schema per tool, see :mod:`specdec_rt.sampling.constraints`).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Container, Iterable, Iterator
from typing import Any, Sequence

from ..checks import brief_repr
from ..errors import InvalidInputError
from ..sampling.constraints import json_text

__all__ = [
    "check_tools",
    "checked_tools",
    "CheckedTools",
    "check_tool_choice",
    "template_messages",
    "parse_tool_calls",
    "call_grammar",
    "call_schemas",
    "nested_strings",
    "supports_tools",
    "CALL_OPEN",
    "CALL_CLOSE",
    "MAX_TOOLS",
]

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
CALL_WHITESPACE = "[ ]?"  # a call is one line, as the format's own example writes it: {"name": "f", "arguments": {...}}
MAX_TOOL_CALLS = 64  # per assistant message of a history
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI's ``tools``: a list of ``{"type": "function", "function": {"name", "description"?,
    "parameters"? (a JSON schema object), "strict"?}}``, names unique. None or [] -> []."""
    if tools is None:
        return []
    if not isinstance(tools, (list, tuple)) or len(tools) > MAX_TOOLS:
        raise InvalidInputError(f"tools must be a list of at most {MAX_TOOLS} functions, got {brief_repr(tools, 100)}")
    seen = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not NAME.fullmatch(fn["name"]):
            raise InvalidInputError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}} with a "
                f"name of 1-64 letters, digits, '_', '.' or '-', got {brief_repr(tool, 100)}"
            )
        params = fn.get("parameters", {})
        if (
            not isinstance(params, dict)
            or params.get("type", "object") != "object"
            or not isinstance(fn.get("description", ""), str)
            or not isinstance(params.get("x-guidance", {}), dict)
        ):
            raise InvalidInputError(
                f"tools[{i}].function: parameters must be a JSON schema of an object "
                '("type": "object"; x-guidance, if any, an object) and description a string'
            )
        json_text(params, f"tools[{i}].function.parameters")
        if fn["name"] in seen:
            raise InvalidInputError(f"tools[{i}]: function {fn['name']!r} is named twice")
        seen.add(fn["name"])
    return list(tools)


class CheckedTools(tuple[Any, ...]):
    """A ``tools`` list that :func:`check_tools` passed, as a tuple: :func:`checked_tools` takes
    it as it is, so the n choices of one request (and a ``RequestParams.replace``) check a
    large list once, not once each (each check walks every schema: ~15 ms a megabyte). It
    keeps the call grammars built from it (:func:`call_grammar`), for the same reason."""

    grammars: dict[tuple[str, str], str]  #: the call grammars built from these tools, by function

    def __new__(cls, tools: Iterable[dict[str, Any]]) -> CheckedTools:
        self = super().__new__(cls, tools)
        self.grammars = {}
        return self


def checked_tools(tools: Any) -> CheckedTools:
    """``tools`` checked (:func:`check_tools`) as a :class:`CheckedTools`; one already is: as it is."""
    return tools if isinstance(tools, CheckedTools) else CheckedTools(check_tools(tools))


def check_tool_choice(choice: Any, tools: Sequence[dict[str, Any]]) -> str | dict[str, Any]:
    """``"none"`` | ``"auto"`` | ``"required"`` | ``{"type": "function", "function": {"name": X}}``
    with X among ``tools``; None -> ``"auto"`` with tools, ``"none"`` without."""
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise InvalidInputError("tool_choice 'required' needs tools")
        return str(choice)
    name = (
        choice.get("function", {}).get("name")
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
        else None
    )
    if not isinstance(name, str):  # (a list or an object would not even hash)
        raise InvalidInputError(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
            f"{{'name': ...}}}}, got {brief_repr(choice, 100)}"
        )
    if name not in {t["function"]["name"] for t in tools}:
        raise InvalidInputError(f"tool_choice names function {brief_repr(name, 100)}, which tools does not list")
    named: dict[str, Any] = choice
    return named


def supports_tools(template: str | None) -> bool:
    """Whether a chat template renders ``tools`` and writes calls as ``<tool_call>`` blocks."""
    return template is not None and "tools" in template and CALL_OPEN in template


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history as chat templates expect it (Hugging Face's convention): an assistant
    message's ``tool_calls`` checked, each call's ``arguments`` (a JSON string in OpenAI's API)
    given as the object it holds; ``content`` None -> ``""``. Other messages as they are."""
    out = []
    for i, msg in enumerate(messages):
        calls = msg.get("tool_calls") if isinstance(msg, dict) else None
        if calls is None:
            out.append(msg)
            continue
        if not isinstance(calls, (list, tuple)) or len(calls) > MAX_TOOL_CALLS:
            raise InvalidInputError(f"messages[{i}].tool_calls must be a list of at most {MAX_TOOL_CALLS} calls")
        shaped = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if (
                not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str)
                or not isinstance(fn.get("arguments", "{}"), (str, dict))
            ):
                raise InvalidInputError(
                    f"messages[{i}].tool_calls[{j}] must be {{'id': ..., 'type': 'function', "
                    f"'function': {{'name': ..., 'arguments': '<JSON>'}}}}, got {brief_repr(call, 100)}"
                )
            args = fn.get("arguments", "{}")
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    pass  # a template gets the string as it was
            shaped.append({**call, "function": {**fn, "arguments": args}})
        out.append({**msg, "content": msg.get("content") or "", "tool_calls": shaped})
    return out


def nested_strings(value: Any, name: str = "tools", depth: int = 0) -> Iterator[str]:
    """Every string inside ``value`` (dict keys and values, list items), depth-first; a structure
    deeper than 64 levels is an :class:`InvalidInputError` naming ``name`` (templates would
    recurse into it)."""
    if depth > 64:
        raise InvalidInputError(f"{name} is nested more than 64 levels deep")
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str):
                yield k
            yield from nested_strings(v, name, depth + 1)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from nested_strings(v, name, depth + 1)


def parse_tool_calls(text: str, names: Sequence[str] | None = None) -> tuple[str, list[dict[str, Any]]]:
    """An answer -> ``(content, calls)``: every ``<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>`` block whose body is such a JSON object (``"parameters"`` is read as
    ``"arguments"``, as some models write it; arguments may be an object or a JSON string of
    one) becomes an OpenAI tool call (``id``, ``"type": "function"``, ``function.name``,
    ``function.arguments`` as a JSON string); with ``names``, only calls to those functions. The
    body is read as JSON up to its end, so a string in it may hold ``</tool_call>``. The text
    around the calls, stripped, is the content. A block that does not parse, or one left open
    (the answer cut by its token limit), stays in the content as it was."""
    calls, kept, at, pos = [], [], 0, 0
    while (start := text.find(CALL_OPEN, pos)) >= 0:
        pos = start + len(CALL_OPEN)
        call, end = _call_at(text, pos, names)
        if call is None:
            continue  # not a call: it stays text
        calls.append(call)
        kept.append(text[at:start])
        at = pos = end
    kept.append(text[at:])
    return "".join(kept).strip(), calls


def _call_at(text: str, pos: int, names: Container[str] | None) -> tuple[dict[str, Any] | None, int]:
    """The call whose JSON body starts at or after ``pos`` (whitespace first), and where its
    ``</tool_call>`` ends; ``(None, pos)`` if there is none."""
    body_at = len(text) - len(text[pos:].lstrip())
    try:
        body, end = json.JSONDecoder().raw_decode(text, body_at)
    except (ValueError, RecursionError):  # not JSON, or nested past Python's recursion limit
        return None, pos
    close = len(text) - len(text[end:].lstrip())
    if not text.startswith(CALL_CLOSE, close) or not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None, pos
    args = body.get("arguments", body.get("parameters", {}))
    if isinstance(args, str):  # a JSON string of the object
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            args = None
    if not isinstance(args, dict) or (names is not None and body["name"] not in names):
        return None, pos
    try:  # strict JSON (no NaN or Infinity), UTF-8 where it can be (a lone surrogate stays escaped)
        arguments = json.dumps(args, ensure_ascii=False, allow_nan=False)
        arguments.encode("utf-8")
    except UnicodeEncodeError:
        arguments = json.dumps(args, allow_nan=False)
    except ValueError:  # NaN or Infinity: not JSON a client could read
        return None, pos
    return (
        {
            "id": "call_" + uuid.uuid4().hex[:24],
            "type": "function",
            "function": {"name": body["name"], "arguments": arguments},
        },
        close + len(CALL_CLOSE),
    )


def _forced(tools: Sequence[dict[str, Any]], choice: str | dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """``(name, parameters schema)`` of each function a call forced by ``choice`` may name."""
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    names = [choice["function"]["name"]] if isinstance(choice, dict) else list(params)
    return [(n, params[n]) for n in names]


def call_schemas(tools: Sequence[dict[str, Any]], choice: str | dict[str, Any]) -> list[dict[str, Any]]:
    """The ``parameters`` schemas a call forced by ``choice`` may follow (checked on their own
    before a request runs, so a schema the grammar engine gives up on is refused up front)."""
    return [schema for _, schema in _forced(tools, choice)]


def call_grammar(tools: Sequence[dict[str, Any]], choice: str | dict[str, Any]) -> str:
    """A Lark grammar (llguidance's, with ``%json``) for an answer that is exactly one call:
    ``<tool_call>\n{"name": "N", "arguments": {...}}\n</tool_call>``, N the named function or any
    of ``tools``, its arguments following the function's ``parameters`` schema (embedded whole,
    so its own ``$ref``s resolve inside it), on one line. A :class:`CheckedTools` keeps each
    grammar built from it: the n choices of a request build theirs once."""
    key = ("call_grammar", choice if isinstance(choice, str) else choice["function"]["name"])
    kept: dict[tuple[str, str], str] = tools.grammars if isinstance(tools, CheckedTools) else {}
    if key not in kept:
        kept[key] = _call_grammar(tools, choice)
    return kept[key]


def _call_grammar(tools: Sequence[dict[str, Any]], choice: str | dict[str, Any]) -> str:
    forced = _forced(tools, choice)
    rules = [f"call: {' | '.join(f'call{i}' for i in range(len(forced)))}"]
    for i, (name, params) in enumerate(forced):
        head = json.dumps('{"name": ' + json.dumps(name) + ', "arguments": ')
        schema = {**params, "x-guidance": {**params.get("x-guidance", {}), "whitespace_pattern": CALL_WHITESPACE}}
        rules += [f'call{i}: {head} args{i} "}}"', f"args{i}: %json {json.dumps(schema)}"]
    return (
        f"start: {json.dumps(CALL_OPEN + chr(10))} call {json.dumps(chr(10) + CALL_CLOSE)}\n" + "\n".join(rules) + "\n"
    )
