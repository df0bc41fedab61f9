"""``bench``'s flags checked together, before any model is built or loaded: a value out of range,
flags that do not go together, or an ``--out`` that cannot be written is a one-line error at
once, not a traceback after the run (which would lose its results)."""

from __future__ import annotations

from pathlib import Path

from ...errors import InvalidInputError

__all__ = ["check_bench_args", "parse_levels", "parse_sizes", "split_list"]

SERVE_LEVELS = "1,4,8"  # --serve's default --concurrency


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


def _check_prefill(args) -> None:
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


def _check_serve(args) -> None:
    """``--serve`` starts our server and llama-server and drives them over HTTP: it needs
    ``--llama-cpp`` and takes none of the in-process benchmarks' flags."""
    if not args.llama_cpp:
        raise InvalidInputError("--serve needs --llama-cpp BIN_DIR (the folder with llama-server)")
    if args.prefix_cache or getattr(args, "prefill", False):
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


def check_bench_args(args) -> None:
    """Raise :class:`InvalidInputError` naming the first bad flag (see the module docstring)."""
    prefill = getattr(args, "prefill", False)
    serve = getattr(args, "serve", False)
    side_by_side = not args.prefix_cache and not args.concurrency and not prefill and not serve
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
    if serve:
        _check_serve(args)
    elif getattr(args, "requests", None) is not None:
        raise InvalidInputError("--requests goes with --serve")
    if prefill:
        _check_prefill(args)
    elif getattr(args, "lengths", None) is not None or getattr(args, "rows", None) is not None:
        raise InvalidInputError("--lengths / --rows go with --prefill")
    if args.repeats is None:
        args.repeats = 5 if prefill else 1
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
    args.modes = split_list(args.modes, "--modes")
    args.categories = split_list(args.categories, "--categories")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise InvalidInputError(f"--out {out} is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidInputError(f"--out {out}: cannot create the folder ({exc.strerror or exc})") from None
