"""``bench``'s flags checked together, before any model is built or loaded: a value out of range,
flags that do not go together, or an ``--out`` that cannot be written is a one-line error at
once, not a traceback after the run (which would lose its results)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ...errors import InvalidInputError

__all__ = ["add_bench_arguments", "bench_args", "check_bench_args", "parse_levels", "parse_sizes", "split_list"]

SERVE_LEVELS = "1,4,8"  # --serve's default --concurrency


def add_bench_arguments(bench: argparse.ArgumentParser) -> None:
    """``bench``'s own flags (the caller adds the shared model options), with their defaults."""
    _add_side_by_side_arguments(bench)
    _add_other_benchmarks(bench)
    _add_llama_arguments(bench)
    bench.add_argument("--out", default="bench-out", help="folder for the JSON report and the PNG chart")
    bench.add_argument("--json", action="store_true", help="print one JSON document on stdout")


def _add_side_by_side_arguments(bench: argparse.ArgumentParser) -> None:
    """The side-by-side bench's prompts, modes and runs (the other benchmarks read ``--prompts``,
    ``--max-new-tokens``, ``--limit`` and ``--repeats`` too)."""
    bench.add_argument("--prompts", default=None, help="JSONL file: {'prompt': ...} or {'messages': [...]} per line")
    bench.add_argument("--modes", default=None, help="comma-separated modes (default: all available)")
    bench.add_argument("--max-new-tokens", type=int, default=64)
    bench.add_argument("--categories", default=None, help="comma-separated prompt categories to keep")
    bench.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    bench.add_argument(
        "--repeats", type=int, default=None, help="runs of each prompt per mode (default 1; --prefill: rounds, 5)"
    )
    bench.add_argument(
        "--add-draft",
        action="append",
        metavar="FOLDER",
        help="also benchmark this draft folder (e.g. a train-draft output; repeatable)",
    )
    bench.add_argument("--micro", action="store_true", help="also run the step-cost micro-benchmarks")


def _add_other_benchmarks(bench: argparse.ArgumentParser) -> None:
    """The benchmarks run instead of the side-by-side one, and their own flags."""
    bench.add_argument(
        "--concurrency",
        default=None,
        metavar="LEVELS",
        help="instead: one Engine under concurrent clients, e.g. 1,2,4,8 (spec and ar)",
    )
    bench.add_argument(
        "--cold",
        action="store_true",
        help="--concurrency: a fresh engine per level and repeat, prefix cache off (a server that just started)",
    )
    bench.add_argument(
        "--prefix-cache",
        action="store_true",
        help="instead: time to first token with and without the prefix cache (multi-turn, "
        "shared system prompt, memory pressure)",
    )
    bench.add_argument("--conversations", type=int, default=4, help="--prefix-cache: conversations")
    bench.add_argument("--turns", type=int, default=3, help="--prefix-cache: turns per conversation")
    bench.add_argument(
        "--prefix-concurrency", type=int, default=8, help="--prefix-cache: requests at once sharing a system prompt"
    )
    bench.add_argument(
        "--prefill",
        action="store_true",
        help="instead: prompt-processing tokens/s per prompt length and batched decode steps, "
        "for the model and its quantized targets (with --llama-cpp: beside llama-bench)",
    )
    bench.add_argument(
        "--lengths", default=None, metavar="N,N,..", help="--prefill: prompt lengths in tokens (default 64,256,1024)"
    )
    bench.add_argument(
        "--rows", default=None, metavar="B,B,..", help="--prefill: requests in flight per decode step (default 1,4,8)"
    )


def _add_llama_arguments(bench: argparse.ArgumentParser) -> None:
    """llama.cpp beside us: the side-by-side modes, ``--serve`` and ``--agreement``."""
    bench.add_argument(
        "--llama-cpp",
        default=None,
        metavar="BIN_DIR",
        help="also run llama.cpp (its bin folder; scripts/build-llama-cpp builds it) on every "
        "prompt: llamacpp_<quant> modes and an ours/theirs table",
    )
    bench.add_argument(
        "--llama-gguf",
        default=None,
        metavar="FILES_OR_FOLDER",
        help="--llama-cpp: comma-separated GGUF files or a folder of them (default: the model's "
        "source GGUF and F32 / Q8_0 made from it with llama-quantize)",
    )
    bench.add_argument(
        "--llama-draft",
        default=None,
        metavar="GGUF",
        help="--llama-cpp: also llama.cpp's speculative decoding with this draft GGUF",
    )
    bench.add_argument(
        "--serve",
        action="store_true",
        help="instead: our server against llama-server (needs --llama-cpp), both started here and "
        "driven by the openai client at each --concurrency level (default 1,4,8)",
    )
    bench.add_argument(
        "--requests", type=int, default=None, metavar="N", help="--serve: requests per level and server (default 16)"
    )
    bench.add_argument(
        "--agreement",
        action="store_true",
        help="instead: top-1 agreement and KL of the quantized targets against float32, teacher-forced "
        "over held-out text (with --llama-cpp: llama-perplexity's for its quantizations, same windows)",
    )
    bench.add_argument("--text", default=None, metavar="FILE", help="--agreement: plain text to score")
    bench.add_argument(
        "--window",
        type=int,
        default=None,
        metavar="N",
        help="--agreement: tokens per window (llama-perplexity -c; 512)",
    )


def bench_args(args: argparse.Namespace) -> argparse.Namespace:
    """``args``, given the defaults of :func:`add_bench_arguments`' flags it lacks (in place, and
    returned): a caller that builds its own Namespace (a test, a script) names only the flags it
    sets."""
    parser = argparse.ArgumentParser(add_help=False)
    add_bench_arguments(parser)
    given = vars(args)
    for name, value in vars(parser.parse_args([])).items():
        given.setdefault(name, value)
    return args


def split_list(value: str | None, flag: str) -> list[str] | None:
    """``"a, b"`` -> ``["a", "b"]``; None stays None; an empty list is an error."""
    if value is None:
        return None
    items = [x.strip() for x in value.split(",")]
    if not all(items):
        raise InvalidInputError(f"{flag} must be a comma-separated list of names, got {value!r}")
    return items


def parse_levels(value: str) -> list[int]:
    """``--concurrency "1,2,4"`` -> sorted distinct positive integers."""
    try:
        levels = sorted({int(x) for x in value.split(",")})
    except ValueError:
        levels = []
    if not levels or levels[0] < 1:
        raise InvalidInputError(f"--concurrency needs positive integers separated by commas, got {value!r}")
    return levels


def parse_sizes(value: str, flag: str) -> list[int]:
    """``"64,256,1024"`` -> ``[64, 256, 1024]`` (distinct positive integers, in the given order)."""
    try:
        sizes = [int(x) for x in value.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise InvalidInputError(f"{flag} needs distinct positive integers separated by commas, got {value!r}")
    return sizes


def _check_prefill(args: argparse.Namespace) -> None:
    """``--prefill`` runs targets alone on its own prompts: no other benchmark's flags."""
    if args.prefix_cache or args.concurrency:
        raise InvalidInputError("--prefill is a benchmark of its own: not with --concurrency / --prefix-cache")
    for flag, value in (
        ("--modes", args.modes),
        ("--categories", args.categories),
        ("--prompts", args.prompts),
        ("--limit", args.limit),
        ("--add-draft", args.add_draft),
        ("--llama-draft", args.llama_draft),
    ):
        if value:
            raise InvalidInputError(f"{flag} does not go with --prefill (it runs each target alone on random prompts)")
    if args.micro:
        raise InvalidInputError("--micro does not go with --prefill (it runs each target alone on random prompts)")
    if args.llama_gguf and not args.llama_cpp:
        raise InvalidInputError("--llama-gguf needs --llama-cpp BIN_DIR")
    parse_sizes(args.lengths or "1", "--lengths")
    parse_sizes(args.rows or "1", "--rows")


def _check_serve(args: argparse.Namespace) -> None:
    """``--serve`` starts our server and llama-server and drives them over HTTP: it needs
    ``--llama-cpp`` and takes none of the in-process benchmarks' flags."""
    if not args.llama_cpp:
        raise InvalidInputError("--serve needs --llama-cpp BIN_DIR (the folder with llama-server)")
    if args.prefix_cache or args.prefill:
        raise InvalidInputError("--serve is a benchmark of its own: not with --prefix-cache / --prefill")
    for flag, value in (
        ("--modes", args.modes),
        ("--categories", args.categories),
        ("--micro", args.micro),
        ("--cold", args.cold),
        ("--add-draft", args.add_draft),
        ("--llama-draft", args.llama_draft),
        ("--repeats", args.repeats not in (None, 1)),
    ):
        if value:
            raise InvalidInputError(f"{flag} does not go with --serve (each server runs as it would serve)")
    if args.requests is not None and args.requests < 1:
        raise InvalidInputError(f"--requests must be >= 1, got {args.requests}")
    args.levels = parse_levels(args.concurrency or SERVE_LEVELS)


def check_bench_args(args: argparse.Namespace) -> None:
    """Raise :class:`InvalidInputError` naming the first bad flag (see the module docstring)."""
    bench_args(args)
    for flag, value in (
        ("--repeats", args.repeats),
        ("--max-new-tokens", args.max_new_tokens),
        ("--limit", args.limit),
        ("--conversations", args.conversations),
        ("--turns", args.turns),
        ("--prefix-concurrency", args.prefix_concurrency),
    ):
        if value is not None and value < 1:
            raise InvalidInputError(f"{flag} must be >= 1, got {value}")
    if args.concurrency is not None:
        args.levels = parse_levels(args.concurrency)
    if args.serve:
        _check_serve(args)
    elif args.requests is not None:
        raise InvalidInputError("--requests goes with --serve")
    if args.prefill:
        _check_prefill(args)
    elif args.lengths is not None or args.rows is not None:
        raise InvalidInputError("--lengths / --rows go with --prefill")
    if args.repeats is None:
        args.repeats = 5 if args.prefill else 1
    _check_which_bench(args)
    args.modes = split_list(args.modes, "--modes")
    args.categories = split_list(args.categories, "--categories")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise InvalidInputError(f"--out {out} is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidInputError(f"--out {out}: cannot create the folder ({exc.strerror or exc})") from None


def _check_which_bench(args: argparse.Namespace) -> None:
    """The flags of one benchmark are not given to another."""
    prefill, serve = args.prefill, args.serve
    side_by_side = not args.prefix_cache and not args.concurrency and not prefill and not serve
    if args.llama_cpp and not side_by_side and not prefill and not serve:
        raise InvalidInputError("--llama-cpp goes with the side-by-side bench, not --concurrency / --prefix-cache")
    if args.prefix_cache and args.concurrency:
        raise InvalidInputError("--prefix-cache and --concurrency are two different benchmarks: pick one")
    if args.cold and not args.concurrency:
        raise InvalidInputError("--cold goes with --concurrency")
    if not side_by_side and not prefill and (args.modes is not None or args.categories is not None or args.micro):
        raise InvalidInputError(
            "--modes / --categories / --micro go with the side-by-side bench "
            "(--concurrency and --prefix-cache run spec and ar on their own prompts)"
        )
    if (side_by_side or prefill) and args.draft is not None:
        raise InvalidInputError(
            "--draft goes with --concurrency / --prefix-cache; the side-by-side bench runs "
            "every draft as its own mode (spec_<draft>, see --modes)"
        )
