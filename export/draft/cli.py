"""Command line: `python -m export train-draft --target M [--out DIR] ...` (see `run.py`)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..errors import OneLineParser, one_line_errors
from ..ui import Reporter
from .run import TrainDraftRequest, run_train_draft

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    R = TrainDraftRequest  # the defaults live there (and the training ones in TrainConfig)
    p = OneLineParser(
        prog="python -m export train-draft",
        description="Train an EAGLE-style draft head for a built float32 target by "
        "self-distillation, export it as an ONNX draft folder and measure its acceptance. "
        "Resumable: rerun with --resume after --time-budget stops it.",
    )
    p.add_argument("--target", required=True, help="recipe name or export folder of the target")
    p.add_argument("--out", type=Path, help="output folder (default: beside the target, <name>-eagle)")
    p.add_argument(
        "--arch",
        default="eagle",
        choices=["eagle"],
        help="draft architecture: an EAGLE head over the target's hidden states",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=R.tokens,
        metavar="N",
        help=f"target-generated answer tokens to train on (default {R.tokens})",
    )
    p.add_argument(
        "--time-budget", type=float, metavar="MINUTES", help="stop cleanly (checkpointed) after this many minutes"
    )
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--source", help="the target's PyTorch checkpoint or GGUF (default: its manifest's)")
    p.add_argument("--epochs", type=float, default=R.epochs)
    p.add_argument("--depth", type=int, default=R.depth, help="draft steps unrolled in training (HASS-style)")
    p.add_argument("--batch-tokens", type=int, default=R.batch_tokens, help="tokens per optimizer step")
    p.add_argument("--eval-every", type=int, default=R.eval_every, help="optimizer steps between validations")
    p.add_argument("--vocab-size", type=int, default=R.vocab_size, help="reduced output vocabulary")
    p.add_argument("--batch", type=int, default=R.batch, help="prompts per generation batch")
    p.add_argument("--max-new", type=int, default=R.max_new, help="answer tokens per prompt at most")
    p.add_argument("--prompts", type=int, metavar="N", help="use only the first N training prompts")
    p.add_argument("--val-prompts", type=int, default=R.val_prompts)
    p.add_argument("--eval-prompts", type=int, default=R.eval_prompts, help="held-out prompts for acceptance")
    p.add_argument("--lr", type=float, default=R.lr)
    p.add_argument("--threads", type=int)
    p.add_argument("--device", default="auto", help="PyTorch device: auto (cuda if present), cpu, cuda")
    p.add_argument("-q", "--quiet", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true")
    _add_corpus_args(p)
    return p


def _add_corpus_args(p: argparse.ArgumentParser) -> None:
    """The corpus stage: text already on the machine, read by the target at prefill speed."""
    R = TrainDraftRequest
    p.add_argument(
        "--corpus",
        metavar="SOURCES",
        help="also distil on text already on this machine, read by the target at prefill speed: "
        "comma-separated from python-stdlib, python-docs, man, doc, licenses (or all)",
    )
    p.add_argument(
        "--corpus-tokens",
        type=int,
        default=R.corpus_tokens,
        metavar="N",
        help=f"teacher-forced corpus positions to build (default {R.corpus_tokens})",
    )
    p.add_argument("--corpus-window", type=int, default=R.corpus_window, help="tokens per corpus window")
    p.add_argument(
        "--features-from",
        metavar="MODEL",
        help="train on the hidden states and top-k labels of this quantized copy of the target "
        "(export folder or recipe, e.g. smollm2-135m-q8), read by ONNX Runtime: the head drafts for it",
    )


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    ui = Reporter(quiet=args.quiet)
    req = TrainDraftRequest(
        target=args.target,
        out=args.out,
        arch=args.arch,
        tokens=args.tokens,
        time_budget=args.time_budget,
        resume=args.resume,
        source=args.source,
        epochs=args.epochs,
        depth=args.depth,
        vocab_size=args.vocab_size,
        batch=args.batch,
        max_new=args.max_new,
        prompts=args.prompts,
        val_prompts=args.val_prompts,
        eval_prompts=args.eval_prompts,
        lr=args.lr,
        threads=args.threads,
        batch_tokens=args.batch_tokens,
        eval_every=args.eval_every,
        device=args.device,
        corpus=args.corpus,
        corpus_tokens=args.corpus_tokens,
        corpus_window=args.corpus_window,
        features_from=args.features_from,
    )
    report, code = one_line_errors(
        lambda: run_train_draft(req, ui), args.verbose, "interrupted (checkpoints kept; rerun with --resume)"
    )
    if code or report is None:
        return code
    if report["status"] != "done":
        print(report["why"], file=sys.stderr)
        print(report["out"])
        return 3
    acc = report["acceptance"]
    ui.log(
        f"acceptance by depth {acc['per_depth']}, mean accepted {acc['mean_accepted']} per round "
        f"(k={acc['k']}), exact: {acc['exact']}"
    )
    print(str(Path(report["out"]) / "draft"))
    return 0
