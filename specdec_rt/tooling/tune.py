"""``python -m specdec_rt tune MODEL``: measure which target precision and draft run fastest on
this machine (what ``serve``'s default ``--precision auto`` picks), print the table, keep it.

The measurement and the cache are :mod:`specdec_rt.engine.tune` and
:mod:`specdec_rt.engine.tune_cache`; this is their command line. Without ``--force`` a result
already cached for this machine, model and settings is shown as it is.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    from ..engine.tune import Tuned
    from ..engine.tune_cache import TuneResult

__all__ = ["add_tune_arguments", "run_tune", "format_table"]


def add_tune_arguments(p: argparse.ArgumentParser, count_type: Callable[[str], int]) -> None:
    """The ``tune`` subcommand's arguments (``count_type``: the CLI's integer from 1 to 256, for
    ``--threads`` and ``--slots``)."""
    from ..engine.loading import DEFAULT_MODEL

    p.add_argument(
        "model",
        nargs="?",
        type=_model,
        default=DEFAULT_MODEL,
        help=f"recipe name or export folder (default {DEFAULT_MODEL})",
    )
    p.add_argument("--slots", type=count_type, default=8, help="slots the server will run with (default 8, serve's)")
    p.add_argument("--threads", type=count_type, default=None, help="ONNX Runtime intra-op threads (default: all CPUs)")
    p.add_argument("--provider", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--force", action="store_true", help="measure again even if a result is cached")
    p.add_argument("--no-build", action="store_true", help="fail instead of building a missing recipe")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")


def _model(text: str) -> str:
    if not text.strip():  # (Path("") is ".": it would be named as the current folder)
        raise argparse.ArgumentTypeError(f"must be a recipe name or an export folder, got {text!r}")
    return text


def _say(text: str) -> None:
    print(f"[tune] {text}", file=sys.stderr, flush=True)


def format_table(result: TuneResult) -> str:
    """The result as a text table: configuration, tok/s with one stream and at several at once,
    acceptance, exact, one stream's tok/s per prompt category (with the drafts' acceptance
    there), and the chosen row marked."""
    c = result.rows[0].concurrency if result.rows else 1
    kinds = list(dict.fromkeys(k.category for row in result.rows for k in row.categories))
    lines = [
        f"{'precision':<10} {'draft':<14} {'tok/s 1 stream':>14} {f'tok/s at {c}':>11} {'acceptance':>10} "
        f"{'exact':>5}  " + "".join(f"{k:>12}" for k in kinds) + ("  " if kinds else "") + "chosen"
    ]
    for i, row in enumerate(result.rows):
        cells = []
        for k in kinds:
            mine = row.category(k)
            cell = "-" if mine is None else f"{mine.tok_s_1:.1f}"
            if mine is not None and row.draft != "none":
                cell += f" @{mine.acceptance:.2f}"
            cells.append(f"{cell:>12}")
        lines.append(
            f"{row.precision:<10} {row.draft:<14} {row.tok_s_1:>14.1f} {row.tok_s_c:>11.1f} "
            f"{row.acceptance if row.draft not in ('none',) else 0:>10.2f} {'yes' if row.exact else 'NO':>5}  "
            + "".join(cells)
            + ("  " if kinds else "")
            + ("<-" if i == result.chosen else "")
            + (f" {row.note}" if row.note else "")
        )
    if kinds:
        lines.append(
            f"(per category: tok/s with one stream @ acceptance, {result.tokens or '?'} tokens an answer; "
            "tok/s 1 stream: their geometric mean)"
        )
    return "\n".join(lines)


def run_tune(args: argparse.Namespace) -> int:
    """Measure (or show the cached result), print the table (``--json``: one document)."""
    from ..engine.engine import Engine
    from ..engine.factory import home_manifest, pick_target
    from ..engine.loading import ensure_built
    from ..engine.tune import choose, why_chosen

    folder = ensure_built(args.model, allow_build=not args.no_build, say=_say)

    async def go() -> Tuned:
        return await choose(
            folder,
            Engine.load,
            threads=args.threads,
            slots=args.slots,
            provider=args.provider,
            force=args.force,
            say=_say,
        )

    tuned = anyio.run(go)
    result = tuned.result
    exact_to = pick_target(home_manifest(folder), tuned.precision).exact_to
    if args.json:
        doc = {
            "model": str(args.model),
            "folder": str(folder),
            "choice": {
                "precision": tuned.precision,
                "draft": tuned.draft,
                "chosen_by": tuned.chosen_by,
                "exact_to": exact_to,
            },
            **{k: v for k, v in result.as_dict().items() if k != "version"},  # "chosen": the row's index
            "cache": None if tuned.path is None else str(tuned.path),  # None: it could not be stored
        }
        print(json.dumps(doc, indent=1))
        return 0
    print(format_table(result))
    how = "measured now" if tuned.chosen_by == "tuned" else "cached from an earlier run (--force measures again)"
    print(
        f"\nchosen: {tuned.precision} target, draft {tuned.draft} ({how}; {result.rounds} round(s), "
        f"{result.seconds:.0f} s{why_chosen(result)})\nrule: {result.rule}\n{exact_to}"
    )
    return 0
