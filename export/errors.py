"""One error root for `python -m export`.

Every failure the exporter anticipates is an `ExportError` subclass whose message is one line
that tells the user what went wrong. The CLI prints it as `export: error: <message>` and exits
with the class's `exit_code`. Library errors (torch, onnx, zipfile, OSError) are mapped onto
these at the boundary with `raise ... from exc`, so the cause stays in the traceback for `-v`.
"""

from __future__ import annotations

__all__ = [
    "ExportError",
    "UsageError",
    "SourceNotFoundError",
    "CorruptSourceError",
    "UnsupportedModelError",
    "TokenizerMismatchError",
    "HashMismatchError",
    "FetchError",
    "DiskFullError",
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


class ValidationError(ExportError):
    """The exported ONNX model disagrees with the PyTorch model beyond tolerance."""


class InterruptedExportError(ExportError):
    """The export was interrupted (Ctrl-C); nothing was left behind."""

    exit_code = 130
