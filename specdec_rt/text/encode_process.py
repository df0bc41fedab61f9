"""Big prompts rendered and encoded in a child process, so that no thread of this one holds the
GIL for long on their account (docs/decisions/0011-big-prompts-in-a-process.md).

The tokenizer's Rust code releases the GIL while ``encode_batch`` runs, but turning a big
encoding into Python objects (its ``ids``: a list of ints) and freeing it hold the GIL: about
0.3 us a token together, and a prompt may have 4 tokens a character, so a 1M-character prompt
encoded in a worker thread still stalls the event loop for up to a second. A prompt of
:data:`PROCESS_MIN_CHARS` characters or more is therefore sent to one child Python process that
holds its own copy of the codec (same tokenizer file, checked by its sha256; same template and
options); its ids come back as one int64 array, with no Python object per token on this side.
Smaller prompts are encoded in the calling thread, as before.

The child is started on the first big prompt (about a second) and serves the ones after it, one
at a time; :meth:`PromptEncoder.close` ends it (so does closing this process: it reads its
requests from a pipe and leaves at its end).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..errors import InferenceError, InvalidInputError, ModelLoadError, SpecDecError
from .codec import TextCodec

__all__ = ["PromptEncoder", "PROCESS_MIN_CHARS"]

PROCESS_MIN_CHARS = 16_384  # prompts of at least this many characters are encoded in the child

_ERRORS: dict[str, type[SpecDecError]] = {
    "InvalidInputError": InvalidInputError,
    "ModelLoadError": ModelLoadError,
    "InferenceError": InferenceError,  # the tokenizer panicked
}


def prompt_chars(prompt: Any, tools: Sequence[dict[str, Any]] | None = None) -> int:
    """About how many characters of text ``prompt`` (a string or chat messages) and ``tools``
    hold (strings nested up to 64 levels deep): what decides where the prompt is encoded."""
    total, todo = 0, [(prompt, 0), (tools, 0)]
    while todo:
        value, depth = todo.pop()
        if isinstance(value, str):
            total += len(value)
        elif depth <= 64 and isinstance(value, dict):
            todo.extend((x, depth + 1) for kv in value.items() for x in kv)
        elif depth <= 64 and isinstance(value, (list, tuple)):
            todo.extend((x, depth + 1) for x in value)
    return total


class PromptEncoder:
    """``codec.encode_prompt`` with prompts of ``min_chars`` characters or more (``None``:
    none) encoded by a child process (see the module docstring). Thread-safe; call
    :meth:`encode` from a worker thread, never from the event loop (it waits for the child)."""

    def __init__(self, codec: TextCodec, min_chars: int | None = PROCESS_MIN_CHARS) -> None:
        self.codec, self.min_chars = codec, min_chars
        self._lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None
        self._closed = False

    def encode(
        self, prompt: str | Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[int] | np.ndarray:
        """The prompt's ids: a list (encoded here) or, for a big prompt, a read-only int64 array
        (the same ids, from the child). Errors are the codec's."""
        if self.min_chars is None or prompt_chars(prompt, tools) < self.min_chars:
            return self.codec.encode_prompt(prompt, tools=tools)
        try:
            request = pickle.dumps((prompt, tools), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - objects that cannot be pickled: encoded here, as before
            return self.codec.encode_prompt(prompt, tools=tools)
        with self._lock:
            if self._closed:
                raise InvalidInputError("the prompt encoder is closed")
            child = self._start()
            try:
                _send(child, request)
                return _receive(child)
            except SpecDecError:  # the prompt's (or the model's), as the codec words it
                raise
            except (OSError, EOFError, ValueError) as exc:  # a broken pipe, an answer cut short
                self._stop()
                raise InvalidInputError(
                    f"the prompt could not be encoded: its encoding process ended ({exc or type(exc).__name__})"
                ) from None

    def close(self) -> None:
        """End the child process (if any); later big prompts are refused."""
        self._closed = True
        self._stop()

    def _start(self) -> subprocess.Popen[bytes]:
        if self._child is not None and self._child.poll() is None:
            return self._child
        codec = self.codec
        env = dict(os.environ)  # the child imports specdec_rt from where this process did
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), *filter(None, sys.path)])
        child = subprocess.Popen(
            [sys.executable, "-m", "specdec_rt.text.encode_process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        spec = {
            "tokenizer_file": str(codec.tokenizer_file),
            "sha256": codec.tokenizer_sha256,
            "add_bos": codec.add_bos,
            "bos_id": codec.bos_id,
            "chat_template": codec.chat_template,
            "allow_special_in_content": codec.allow_special_in_content,
            "template_timeout_s": codec.template_timeout_s,
            "template_max_chars": codec.template_max_chars,
            "template_source": codec.template_source,
        }
        try:
            _send(child, pickle.dumps(spec))
            _receive(child)  # an empty answer: ready (or the error that stopped it)
        except BaseException:
            child.kill()
            child.wait()
            raise
        self._child = child
        return child

    def _stop(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            for pipe in (child.stdin, child.stdout):
                if pipe is not None:
                    pipe.close()
            child.kill()
            child.wait()


def _send(child: subprocess.Popen[bytes], data: bytes) -> None:
    assert child.stdin is not None
    child.stdin.write(len(data).to_bytes(8, "little") + data)
    child.stdin.flush()


def _receive(child: subprocess.Popen[bytes]) -> np.ndarray:
    """One answer: a JSON line (``{"n": count}`` or ``{"error": kind, "message": text}``), then
    ``count`` little-endian int64 ids. The child's answers are read as data, never unpickled."""
    assert child.stdout is not None
    line = child.stdout.readline(1 << 16)
    if not line.endswith(b"\n"):
        raise EOFError(f"exit code {child.wait()}")
    head = json.loads(line)
    if "error" in head:
        raise _ERRORS.get(head["error"], InvalidInputError)(str(head["message"]))
    n = int(head["n"])
    data = child.stdout.read(8 * n)
    if len(data) != 8 * n:
        raise EOFError(f"exit code {child.wait()}")
    return np.frombuffer(data, dtype="<i8")


def _serve() -> None:
    """The child: read the codec's spec, then prompts, until the pipe ends; answer each."""
    inp = sys.stdin.buffer
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, never into the answers
    try:  # CPU-bound for seconds: let the serving process (its event loop) go first
        os.nice(10)
    except (AttributeError, OSError):
        pass

    def read() -> Any:
        size = inp.read(8)
        if len(size) < 8:
            raise SystemExit(0)
        return pickle.loads(inp.read(int.from_bytes(size, "little")))  # noqa: S301 - from the parent

    def answer(head: dict[str, Any], body: bytes = b"") -> None:
        out.write(json.dumps(head).encode() + b"\n" + body)
        out.flush()

    def error(exc: BaseException) -> None:
        if isinstance(exc, SpecDecError):  # the codec's errors: InvalidInputError, ModelLoadError, InferenceError
            kind = next((k for k, cls in _ERRORS.items() if isinstance(exc, cls)), "InvalidInputError")
            answer({"error": kind, "message": str(exc)})
        else:  # as Engine._encode words what the codec does not map
            answer(
                {
                    "error": "InvalidInputError",
                    "message": f"prompt cannot be encoded: {type(exc).__name__}: {exc}"[:300],
                }
            )

    spec = read()
    try:
        sha256 = spec.pop("sha256")
        codec = TextCodec(spec.pop("tokenizer_file"), **spec)
        if codec.tokenizer_sha256 != sha256:
            raise ModelLoadError(f"{codec.tokenizer_file} changed since it was loaded; load the model again")
    except Exception as exc:  # noqa: BLE001 - told to the parent
        error(exc)
        return
    answer({"n": 0})
    while True:
        prompt, tools = read()
        try:
            ids = np.asarray(codec.encode_prompt(prompt, tools=tools), dtype="<i8")
        except Exception as exc:  # noqa: BLE001 - told to the parent, as the engine would word it
            error(exc)
            continue
        answer({"n": int(ids.size)}, ids.tobytes())


if __name__ == "__main__":
    _serve()
