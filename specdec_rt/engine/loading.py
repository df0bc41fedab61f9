"""Locating, building and loading models and engines, for the command-line tools.

One place that ``cli``, ``demo``, ``bench`` and ``loadtest`` import (and that imports none of
them), so the tools do not import each other for these helpers. Heavy modules (ONNX Runtime,
the engine) are imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..errors import ModelNotBuiltError, SpecDecError

if TYPE_CHECKING:
    import argparse

    from .engine import Engine

__all__ = ["DEFAULT_MODEL", "ensure_built", "load_engine"]

DEFAULT_MODEL = "smollm2-135m"


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ensure_built(model: str, allow_build: bool = True, say: Callable[[str], None] = _stderr) -> Path:
    """The model's folder; a recipe that is not built yet is built first with ``python -m
    export`` (its progress on stderr; ``say`` tells the user why it is happening). Raises
    :class:`ModelNotBuiltError` instead when ``allow_build`` is false, and
    :class:`SpecDecError` when the build fails."""
    from .factory import resolve_model_dir

    try:
        return resolve_model_dir(model)
    except ModelNotBuiltError:
        if not allow_build:
            raise
    say(f"model {model!r} is not built yet: building it now (python -m export {model}); this happens once")
    # the exporter prints the folder on stdout: send it to stderr, where a --json caller's stdout
    # stays one JSON document
    proc = subprocess.run([sys.executable, "-m", "export", model], stdout=2)
    if proc.returncode != 0:
        raise SpecDecError(f"building {model!r} failed (python -m export {model} exited {proc.returncode})")
    return resolve_model_dir(model)


async def load_engine(args: argparse.Namespace, draft: str | None = None) -> Engine:
    """An :class:`~specdec_rt.Engine` (one slot) from the CLI's model options (``--model``,
    ``--draft``, ``--threads``, ``--max-length``, ``--provider``, ``--shared-weights``);
    ``draft`` overrides ``args.draft``."""
    from .engine import Engine

    return await Engine.load(
        args.model,
        draft=draft if draft is not None else args.draft,
        threads=args.threads,
        max_length=args.max_length,
        provider=args.provider,
        slots=1,
        shared_weights=args.shared_weights,
    )
