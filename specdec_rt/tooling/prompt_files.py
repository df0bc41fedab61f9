"""Prompt files of the benchmarks and the load test (JSONL), read and checked: a file written by
anyone, so a bad line is a one-line error naming the file and line, never a traceback."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import InvalidInputError

__all__ = ["read_prompt_file", "label", "PromptText"]

PromptText = str | list[dict[str, Any]]  # a prompt: text, or chat messages


def read_prompt_file(path: str | None, default: str = "data/prompts.jsonl") -> list[dict[str, Any]]:
    """``[{"text": str | messages, "category": str}]`` from a JSONL file of ``{"prompt": ...}`` /
    ``{"messages": [...]}`` lines (optional ``"category"``), or the packaged ``default``. A file
    that cannot be read, a line that is not such an object, or a file with no prompt is a
    one-line :class:`InvalidInputError` naming the file and line."""
    where = path or f"built-in {default}"
    try:
        raw = (
            Path(path).read_text(encoding="utf-8")
            if path
            else resources.files("specdec_rt.tooling").joinpath(default).read_text(encoding="utf-8")
        )
    except (OSError, UnicodeDecodeError) as exc:
        why = (exc.strerror if isinstance(exc, OSError) else None) or exc
        raise InvalidInputError(f"{where}: cannot read the prompts ({why})") from None
    out = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except RecursionError:
            raise InvalidInputError(f"{where}:{n}: not JSON (nested too deeply)") from None
        except ValueError as exc:
            raise InvalidInputError(f"{where}:{n}: not JSON ({exc})") from None
        text = (d["messages"] if "messages" in d else d.get("prompt")) if isinstance(d, dict) else None
        chat = (
            isinstance(text, list)
            and text
            and all(  # content: a string or text parts (the Engine checks them)
                isinstance(m, dict) and isinstance(m.get("content"), (str, list)) for m in text
            )
        )
        if not (chat or (isinstance(text, str) and text and "messages" not in d)):
            raise InvalidInputError(
                f"{where}:{n}: need a JSON object with a non-empty 'prompt' string or a "
                "'messages' list of {role, content}"
            )
        out.append({"text": text, "category": str(d.get("category", "custom"))})
    if not out:
        raise InvalidInputError(f"{where}: no prompts in it")
    return out


def label(text: PromptText) -> str:
    """A prompt's text for progress lines: the string, or the last message's text."""
    if isinstance(text, str):
        return text
    content = text[-1].get("content", "")
    return (
        content
        if isinstance(content, str)
        else " ".join(c.get("text", "") for c in content if isinstance(c, dict) and isinstance(c.get("text"), str))
    )
