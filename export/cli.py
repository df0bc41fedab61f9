"""Command line: `python -m export SRC [options]`, and `python -m export train-draft ...`
(a trained EAGLE draft, see `export.draft`).

Progress and logs go to stderr; on success the output folder's path is the only line on
stdout. Failures print one line, `export: error: <reason>`, and exit 1 (2 for usage errors,
130 when interrupted).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import OneLineParser, one_line_errors
from .ui import Reporter, format_bytes, format_table

if TYPE_CHECKING:
    from .pipeline import Result

__all__ = ["main", "summary"]


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m export",
        description="Export a checkpoint folder, .gguf file or recipe (Llama, Mistral, Qwen2/3, Phi-3, "
        "SmolLM3, Gemma 2/3, ...; other causal LMs optimum-onnx exports, such as GPT-Neo and CodeGen, "
        "through optimum: docs/export.md) to ONNX + manifest.json for specdec_rt.",
    )
    p.add_argument("src", nargs="?", help="checkpoint folder, .gguf file, or recipe name")
    p.add_argument("--out", type=Path, help="output folder (default: the cache's models/<name>)")
    p.add_argument("--draft", metavar="SRC", help="export SRC as the draft (same tokenizer)")
    p.add_argument(
        "--draft-quant",
        choices=["int4", "int8"],
        help="quantize the draft (without --draft: a quantized copy of the target)",
    )
    p.add_argument("--quantize", choices=["int4", "int8"], help="quantize the target itself")
    p.add_argument(
        "--kv-dtype",
        choices=["float32", "float16"],
        default="float32",
        help="the KV cache's element type (float16: half the KV memory, attention in float16; "
        "greedy output is then exact to this graph, not the float32 one: docs/memory.md)",
    )
    p.add_argument(
        "--scale-dtype",
        choices=["float32", "float16"],
        help="element type of a quantized graph's stored scales and block offsets (default: the "
        "recipe's, else float32; float16: a smaller file, weights within 2^-11 of each scale: "
        "docs/memory.md)",
    )
    p.add_argument(
        "--max-positions",
        type=int,
        metavar="N",
        help="cap the rotary table / KV length (default: the model's, at most 32768)",
    )
    p.add_argument(
        "--no-validate", dest="validate", action="store_false", help="skip the ONNX Runtime vs PyTorch comparison"
    )
    p.add_argument("--force", action="store_true", help="rebuild even if the output is up to date")
    p.add_argument("--threads", type=int, metavar="N", help="ONNX Runtime threads for validation")
    p.add_argument("--list", action="store_true", help="list the recipes and exit")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.add_argument("-v", "--verbose", action="store_true", help="tracebacks and library logs")
    return p


def summary(result: Result, ui: Reporter) -> str:
    """The end-of-run table: folders, sizes, node counts, validation; then stage timings."""
    rows: list[list[object]] = []
    for _name, folder, man in result.folders:
        files = man["files"]
        val = man.get("validation") or {}
        q = man["onnx"]["quantization"]
        rows.append(
            [
                folder.relative_to(result.out).as_posix() if folder != result.out else ".",
                man["role"],
                man.get("builder", "native"),
                f"int{q['bits']}" if q else "fp32",
                man["onnx"]["nodes"],
                format_bytes(files["model.onnx.data"]["bytes"]),
                format_bytes(sum(f["bytes"] for f in files.values())),
                f"{val['max_abs_logit_diff']:.2e}" if val else "skipped",
                f"{val['greedy_agreement']:.1%}" if val else "-",
            ]
        )
    table = format_table(
        ["folder", "role", "built by", "weights", "nodes", "model.onnx.data", "total", "max|dlogit|", "greedy agree"],
        rows,
    )
    stages = format_table(["stage", "seconds"], [[s, f"{t:.1f}"] for s, t in ui.timings])
    return f"\n{table}\n\n{stages}\n"


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "train-draft":
        from .draft.cli import main as train_draft

        return train_draft(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.verbose:  # before transformers is imported
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if args.list:
        from .recipes import list_recipes

        print("\n".join(list_recipes()))
        return 0
    if not args.src:
        parser.error("SRC is required")
    ui = Reporter(quiet=args.quiet)

    def work() -> Result:
        from .pipeline import Request, run

        return run(
            Request(
                src=args.src,
                out=args.out,
                draft=args.draft,
                draft_quant=args.draft_quant,
                quantize=args.quantize,
                max_positions=args.max_positions,
                validate=args.validate,
                force=args.force,
                threads=args.threads,
                kv_dtype=args.kv_dtype,
                scale_dtype=args.scale_dtype,
            ),
            ui,
        )

    result, code = one_line_errors(work, args.verbose)
    if result is None:
        return code
    if not result.noop and not args.quiet:
        print(summary(result, ui), file=sys.stderr)
    print(result.out)
    return 0
