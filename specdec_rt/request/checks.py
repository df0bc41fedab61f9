"""The cheap checks of a request's arguments (before any encoding or model work) and of an
engine's load arguments, and finding stop strings in the text as it grows."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..checks import brief_repr, check_bool, check_int
from ..errors import InvalidInputError
from ..policy.config import SpecConfig
from ..text.codec import IncrementalDecoder
from ..text.tools import call_grammar, call_schemas, supports_tools
from ..types import FinishReason

__all__ = [
    "MAX_STOP_STRINGS",
    "MAX_STOP_CHARS",
    "check_stop",
    "check_prompt_size",
    "find_stop",
    "stop_prefix_len",
    "cut_at_stop",
    "token_id_prompt",
    "RequestShape",
    "tool_shape",
    "check_load_args",
    "check_length_options",
]

MAX_THREADS = 256  # ONNX Runtime intra-op threads: more only spin
MAX_STOP_STRINGS = 64  # each event searches for every stop string (OpenAI allows 4)
MAX_STOP_CHARS = 256  # per stop string: a stream holds back up to this much text (stop_prefix_len)


def check_stop(stop: object) -> list[str]:
    """``stop`` as a list: None, a string or a list/tuple of non-empty strings of valid Unicode."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if isinstance(stops, (list, tuple)) and len(stops) > MAX_STOP_STRINGS:
        raise InvalidInputError(f"stop holds {len(stops)} strings, more than {MAX_STOP_STRINGS}")
    if not isinstance(stops, (list, tuple)) or any(not isinstance(s, str) or not s for s in stops):
        raise InvalidInputError(f"stop must be a non-empty string or a list of them, got {brief_repr(stop)}")
    for i, s in enumerate(stops):
        if len(s) > MAX_STOP_CHARS:
            raise InvalidInputError(f"stop[{i}] has {len(s)} characters, more than {MAX_STOP_CHARS}")
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidInputError(
                f"stop[{i}] is not valid Unicode text (a lone surrogate): {brief_repr(s)}"
            ) from None
    return list(stops)


def check_prompt_size(prompt: object, limit: int) -> None:
    """The cheap checks of a prompt: its type, and at most ``limit`` characters of text (each
    chat message counts one more, so a list of millions of empty messages is refused at once)."""
    if isinstance(prompt, str):
        size = len(prompt)
    elif isinstance(prompt, (list, tuple)):
        if len(prompt) > limit:
            raise InvalidInputError(f"prompt has {len(prompt)} messages, more than max_prompt_chars={limit}")
        size = len(prompt) + sum(_text_size(v) for m in prompt if isinstance(m, dict) for v in m.values())
    else:
        raise InvalidInputError(
            f"prompt must be a string, a list of chat messages or a list of token ids, got {type(prompt).__name__}"
        )
    if size > limit:
        raise InvalidInputError(f"prompt has {size} characters, more than max_prompt_chars={limit}")


def token_id_prompt(prompt: object, vocab_size: int) -> list[int] | None:
    """A prompt given as token ids (a non-empty list or tuple of integers): the ids, each checked
    to be in ``0..vocab_size - 1``; None for text and chat messages."""
    if not (
        isinstance(prompt, (list, tuple))
        and prompt
        and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt)
    ):
        return None
    for i, t in enumerate(prompt):
        if not 0 <= t < vocab_size:
            raise InvalidInputError(
                f"prompt[{i}] = {brief_repr(t)} is not a token id of this model (0..{vocab_size - 1})"
            )
    return [int(t) for t in prompt]


def _text_size(value: object) -> int:
    """Characters of a message field: a string, or the text parts of a content list (each part
    counts one more, so a million empty parts is refused too)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return len(value) + sum(len(c["text"]) for c in value if isinstance(c, dict) and isinstance(c.get("text"), str))
    return 0


def find_stop(text: str, stops: list[str], new_from: int) -> int | None:
    """Index where the earliest stop string starts, if one ends in the new text."""
    hits = [i for s in stops if (i := text.find(s, max(0, new_from - len(s) + 1))) >= 0]
    return min(hits) if hits else None


def stop_prefix_len(text: str, stops: list[str], since: int = 0) -> int:
    """Length of the longest tail of ``text[since:]`` that is the start of a stop string (not a
    whole one): text a stream must hold back, since the next tokens may complete the stop."""
    room, best = len(text) - since, 0
    if room <= 0:
        return 0
    last = text[-1]
    for s in stops:  # the candidates k are where s[k - 1] is the text's last character, longest first
        k = min(len(s) - 1, room)
        while k > best:
            k = s.rfind(last, 0, k) + 1
            if k > best and text.endswith(s[:k]):
                best = k
            k -= 1
    return best


def cut_at_stop(
    decoder: IncrementalDecoder,
    text: str,
    ids: Sequence[int],
    stops: list[str],
    *,
    finished: FinishReason | bool | None,
    done: int = 0,
    min_tokens: int = 0,
) -> tuple[list[int], str, int | None]:
    """Feed one event's ids to ``decoder`` one at a time, stopping at the first token whose
    text completes a stop string. Returns (the ids kept, the text so far, where the earliest
    stop string starts or None). Token by token, a speculative round of several tokens cuts
    where plain decoding (one token an event) would: same text, same token count. ``done``:
    tokens before this event; a token that makes ``min_tokens`` or fewer completes no stop
    string (vLLM's rule: only text from later tokens is searched)."""
    for j, token in enumerate(ids):
        before = len(text)
        text += decoder.push([token])
        if done + j + 1 > min_tokens and (cut := find_stop(text, stops, before)) is not None:
            return list(ids[: j + 1]), text, cut
    if finished:  # a character the last token left incomplete
        before = len(text)
        text += decoder.flush()
        if done + len(ids) > min_tokens and (cut := find_stop(text, stops, before)) is not None:
            return list(ids), text, cut
    return list(ids), text, None


@dataclass(frozen=True)
class RequestShape:
    """What a request asks beyond sampling: its prompt's log-probabilities (``prompt_top``),
    a JSON ``schema`` or a ``lark`` grammar to hold the answer to, ``tools`` to render."""

    prompt_top: int | None = None
    schema: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    lark: str | None = None
    checks: tuple[dict[str, Any], ...] = ()  # JSON schemas the lark grammar embeds, each compiled on its own first
    min_tokens: int = 0  # no end-of-sequence token before this many tokens
    ignore_eos: bool = False  # end-of-sequence tokens do not end the answer


def check_length_options(min_tokens: object, ignore_eos: object, max_new_tokens: int) -> tuple[int, bool]:
    """``(min_tokens, ignore_eos)`` checked: an integer from 0 to ``max_new_tokens``, a bool."""
    count: int = check_int(
        min_tokens,
        "min_tokens",
        0,
        max_new_tokens,
        numpy=False,
        what=f"an integer from 0 to max_new_tokens ({brief_repr(max_new_tokens)})",
    )
    return count, check_bool(ignore_eos, "ignore_eos")


def tool_shape(
    prompt: object,
    tools: Sequence[dict[str, Any]] | None,
    choice: str | dict[str, Any],
    stops: list[str],
    *,
    template: str | None,
) -> tuple[list[dict[str, Any]] | None, str | None, tuple[dict[str, Any], ...]]:
    """(the tools to render, a call grammar) from ``tools`` / ``choice`` (checked already, e.g.
    by :class:`~specdec_rt.request.params.RequestParams`; ``choice`` None resolved) for this
    prompt. With ``"none"`` the tools are still rendered where the ``template`` can (the model
    knows them, as OpenAI's does, and calls none); ``"required"`` / a named function: the call
    grammar, which no stop string may cut, and the ``parameters`` schemas it holds the call to
    (each checked on its own before the request runs). Returns ``(tools, grammar, schemas)``."""
    if not tools:
        return None, None, ()
    if isinstance(prompt, str) or token_id_prompt(prompt, 2**63) is not None:
        raise InvalidInputError("tools go with chat messages, not a plain-text or token-id prompt")
    if choice in ("none", "auto"):
        return (list(tools) if choice == "auto" or supports_tools(template) else None), None, ()
    if stops:
        raise InvalidInputError(f"stop cannot go with tool_choice={choice!r}: a stop string could cut the call")
    # (``tools`` as given: a CheckedTools keeps its call grammar for the request's other choices)
    return list(tools), call_grammar(tools, choice), tuple(call_schemas(tools, choice))


def check_load_args(
    name_or_path: object, draft: object, *, max_length: object, threads: object, spec_config: object
) -> None:
    """Engine.load's arguments of the wrong type or range, named (before any file is read)."""
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path):
        raise InvalidInputError(f"name_or_path must be a recipe name or a folder, got {brief_repr(name_or_path)}")
    if draft is not None and not isinstance(draft, (str, os.PathLike)):
        raise InvalidInputError(f"draft must be None, a draft spec or a folder, got {brief_repr(draft)}")
    check_int(max_length, "max_length", 2, optional=True, numpy=False)
    check_int(threads, "threads", 1, MAX_THREADS, optional=True, numpy=False)
    if spec_config is not None and not isinstance(spec_config, SpecConfig):
        raise InvalidInputError(f"spec_config must be a SpecConfig or None, got {brief_repr(spec_config)}")
