"""One error root for `python -m export`.

Every failure the exporter anticipates is an `ExportError` subclass whose message is one line
that tells the user what went wrong. The CLI prints it as `export: error: <message>` and exits
with the class's `exit_code`. Library errors (torch, onnx, zipfile, OSError) are mapped onto
these at the boundary with `raise ... from exc`, so the cause stays in the traceback for `-v`.
`one_line_errors` is that boundary for the command lines (`python -m export`, `train-draft`).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import Callable, NoReturn, TypeVar

__all__ = [
    "one_line_errors",
    "one_line",
    "ExportError",
    "UsageError",
    "SourceNotFoundError",
    "CorruptSourceError",
    "UnsupportedModelError",
    "TokenizerMismatchError",
    "HashMismatchError",
    "FetchError",
    "DiskFullError",
    "InsufficientMemoryError",
    "ValidationError",
    "InterruptedExportError",
]


class ExportError(Exception):
    """Root of every anticipated export failure; `str(err)` is the one-line reason."""

    exit_code = 1


class UsageError(ExportError):
    """The command line itself is wrong (bad option combination)."""

    exit_code = 2


class SourceNotFoundError(ExportError):
    """The source path, file or recipe name does not exist."""


class CorruptSourceError(ExportError):
    """The source exists but cannot be read: a truncated or corrupt GGUF, a broken checkpoint."""


class UnsupportedModelError(ExportError):
    """The architecture (or one of its options) is not one the graph builder can emit."""


class TokenizerMismatchError(ExportError):
    """A draft's tokenizer differs from its target's (vocabulary, merges or special ids)."""


class HashMismatchError(ExportError):
    """A fetched or assembled file does not have the sha256 its recipe pins."""


class FetchError(ExportError):
    """Downloading a recipe's wheels failed (offline, unknown version, pip error)."""


class DiskFullError(ExportError):
    """Writing an output failed because the disk is full."""


class InsufficientMemoryError(ExportError):
    """The model needs more memory to export than this machine has (checked before loading)."""


class ValidationError(ExportError):
    """The exported ONNX model disagrees with the PyTorch model beyond tolerance."""


class InterruptedExportError(ExportError):
    """The export was interrupted (Ctrl-C); nothing was left behind."""

    exit_code = 130


T = TypeVar("T")

MAX_MESSAGE = 600  # characters of a library's message kept in one of ours


def one_line(text: object, limit: int = MAX_MESSAGE) -> str:
    """``text`` (often a library's exception) as one line: whitespace runs (newlines, tabs)
    collapsed to one space, cut to ``limit`` characters."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def one_line_errors(work: Callable[[], T], verbose: bool, interrupted: str = "interrupted") -> tuple[T | None, int]:
    """Run ``work()``; any failure becomes one line on stderr and an exit code (the CLI's
    contract, also for bugs; ``verbose`` adds the traceback). Returns (result, 0) on success."""
    try:
        return work(), 0
    except KeyboardInterrupt:
        print(f"export: error: {interrupted}", file=sys.stderr)
        return None, 130
    except ExportError as exc:
        if verbose:
            traceback.print_exc()
        print(f"export: error: {one_line(exc, sys.maxsize)}", file=sys.stderr)
        return None, exc.exit_code
    except Exception as exc:  # noqa: BLE001 - the one-line contract holds for bugs too
        if verbose:
            traceback.print_exc()
        print(f"export: error: internal error: {type(exc).__name__}: {one_line(exc)} (rerun with -v)", file=sys.stderr)
        return None, 1


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr (exit 2), like every other error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
