"""``python -m specdec_rt``: ``demo``, ``generate``, ``bench``, ``serve``, ``tune`` and ``loadtest``.

``--json`` prints exactly one JSON document on stdout; progress and logs go to stderr.
Errors print one line ``specdec_rt: error: ...`` on stderr and exit with status 1; usage errors
(an unknown flag, a bad value) one line too, with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import TYPE_CHECKING, Any, NoReturn

import anyio

from .engine.loading import DEFAULT_MODEL, load_engine
from .errors import InvalidInputError, SpecDecError
from .logs import configure_cli_logging
from .sampling.constraints import MAX_SCHEMA_CHARS, check_response_format
from .sampling.logprobs import check_top_logprobs, json_logprob
from .serve.cli import add_serve_parser, run_serve
from .tooling.bench.args import add_bench_arguments
from .tooling.loadtest import add_arguments as add_loadtest_arguments
from .tooling.loadtest import run_loadtest
from .tooling.tune import add_tune_arguments

if TYPE_CHECKING:
    from .engine.engine import Engine
    from .sampling.logprobs import TokenLogprob
    from .types import Stats

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    configure_cli_logging(logging.WARNING - 10 * min(args.verbose, 2))
    if args.command != "loadtest":  # the load test is an HTTP client: no model in this process
        from .ort import use_global_thread_pool

        use_global_thread_pool(args.threads)  # we own this process: one ONNX Runtime pool for all models
    try:
        return _run(args)
    except SpecDecError as exc:
        print(f"specdec_rt: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("specdec_rt: interrupted", file=sys.stderr)
        return 130


def _build_parser() -> argparse.ArgumentParser:
    """The command line: one subcommand per task, each with its own flags."""
    parser = _OneLineParser(prog="python -m specdec_rt", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log to stderr (-vv: per round)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(sub)
    demo = sub.add_parser("demo", help="the main job: build the default model if needed, stream, compare")
    _model_args(demo)
    _shared_weights_arg(demo)
    demo.add_argument("--max-new-tokens", type=int, default=96)
    demo.add_argument("--no-build", action="store_true", help="fail instead of building a missing model")
    bench = sub.add_parser("bench", help="side-by-side benchmark (see docs/benchmarks.md)")
    _model_args(bench)
    add_bench_arguments(bench)
    _model_args(add_serve_parser(sub))  # the OpenAI-compatible server: specdec_rt/serve, docs/serving.md
    tune = sub.add_parser(
        "tune", help="measure which precision and draft of a model run fastest here (serve's --precision auto)"
    )
    add_tune_arguments(tune, _count)
    add_loadtest_arguments(
        sub.add_parser(
            "loadtest", help="concurrent streaming clients against the server on loopback (docs/benchmarks.md)"
        )
    )
    return parser


def _add_generate_parser(sub: argparse._SubParsersAction[_OneLineParser]) -> None:
    gen = sub.add_parser("generate", help="generate text with speculative (or plain) decoding")
    _model_args(gen)
    _shared_weights_arg(gen)
    gen.add_argument("--prompt", required=True, help="the prompt text (a user message with --chat)")
    gen.add_argument("--chat", action="store_true", help="render the prompt with the chat template")
    gen.add_argument(
        "--mode",
        choices=["spec", "ar"],
        default=None,
        help="speculative or plain decoding (default: spec; ar with --draft none)",
    )
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    shape = gen.add_mutually_exclusive_group()
    shape.add_argument(
        "--json-object",
        action="store_true",
        help="the answer is a JSON object (constrained decoding, exact under speculation)",
    )
    shape.add_argument(
        "--json-schema",
        default=None,
        metavar="FILE",
        help="the answer follows the JSON schema in FILE (constrained decoding)",
    )
    gen.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="with --json: each token's log-probability and its N (0-20) most likely alternatives",
    )


def _run(args: argparse.Namespace) -> int:
    """Run the parsed command; its exit status."""
    if args.command == "loadtest":
        return run_loadtest(args)
    if args.command == "generate":
        return anyio.run(_generate, args)
    if args.command == "demo":
        from .tooling.demo import run_demo

        return anyio.run(run_demo, args)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "tune":
        from .tooling.tune import run_tune

        return run_tune(args)
    return _run_bench(args)


def _run_bench(args: argparse.Namespace) -> int:
    """``bench``: the flags pick one benchmark; they are checked before any model loads."""
    from .tooling.bench.agreement import check_agreement_args

    if check_agreement_args(args):  # a benchmark of its own, with its own flags' checks
        from .tooling.bench.agreement import run_agreement

        return run_agreement(args)
    from .tooling.bench.args import check_bench_args

    check_bench_args(args)  # before any model is loaded: a bad flag costs nothing
    if args.serve:
        from .tooling.bench.serving import run_serving_bench

        return run_serving_bench(args)
    if args.prefill:
        from .tooling.bench.prefill import run_prefill

        return run_prefill(args)
    if args.prefix_cache:
        from .tooling.bench.prefix import run_prefix

        return run_prefix(args)
    if args.concurrency:
        from .tooling.bench.concurrency import run_concurrency

        return run_concurrency(args)
    from .tooling.bench import run_bench

    return run_bench(args)


class _OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr (exit 2); subcommands inherit it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _count(text: str) -> int:
    """An integer from 1 to 256: ``--threads`` (ONNX Runtime's bound) and ``tune --slots`` (the
    Engine's)."""
    try:
        value = int(text)
    except ValueError:  # (argparse would name this function)
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to 256, got {text!r}") from None
    if not 1 <= value <= 256:
        raise argparse.ArgumentTypeError(f"must be from 1 to 256, got {value}")
    return value


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"recipe name or export folder (default {DEFAULT_MODEL})")
    p.add_argument(
        "--draft",
        default=None,
        help="draft: a name from the manifest (e.g. q8), a folder, 'ngram', "
        "'ngram+<draft>' or 'none' (default: the engine's)",
    )
    p.add_argument("--threads", type=_count, default=None, help="ONNX Runtime intra-op threads per model (1-256)")
    p.add_argument("--max-length", type=int, default=None, help="KV cache capacity per request")
    p.add_argument("--provider", default="auto", choices=["auto", "cpu", "cuda"])


def _shared_weights_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shared-weights",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="map a prepacked copy of each model's weights, written once per machine to the cache "
        "(default on; --no-shared-weights: pack them in this process, a lower peak for a lone one)",
    )


async def _generate(args: argparse.Namespace) -> int:
    if args.mode is None:
        args.mode = "ar" if args.draft == "none" else "spec"
    elif args.mode == "spec" and args.draft == "none":
        raise InvalidInputError("--mode spec needs a draft: drop --draft none, or use --mode ar")
    if args.logprobs is not None and not args.json:
        raise InvalidInputError("--logprobs goes with --json (the log-probabilities are part of the JSON document)")
    check_top_logprobs(args.logprobs)  # before a model loads
    response_format = _response_format(args)
    draft = "none" if args.mode == "ar" and args.draft is None else None
    engine = await load_engine(args, draft)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    kwargs = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        mode=args.mode,
        stop=args.stop,
        response_format=response_format,
    )
    async with engine:
        if args.json:
            r = await engine.generate(prompt, **kwargs, logprobs=args.logprobs)
            doc = {"text": r.text, "token_ids": r.token_ids, "stats": stats_json(r.stats)}
            if r.logprobs is not None:
                doc["logprobs"] = [_logprob_json(engine, t, e) for t, e in zip(r.token_ids, r.logprobs)]
            print(json.dumps(doc))
            return 0
        stats = None
        async for ev in engine.stream(prompt, **kwargs):
            sys.stdout.write(ev.text)
            sys.stdout.flush()
            stats = ev.stats or stats
        sys.stdout.write("\n")
        s = stats
        assert s is not None  # the stream's last event carries them
        print(
            f"[{s.mode}] {s.new_tokens} tokens, {s.tokens_per_s:.1f} tok/s, acceptance "
            f"{s.acceptance_rate:.2f}, mean accepted {s.mean_accepted:.2f}, finish {s.finish_reason}",
            file=sys.stderr,
        )
    return 0


def _response_format(args: argparse.Namespace) -> dict[str, Any] | None:
    """``--json-object`` / ``--json-schema FILE`` as a response format, checked before a model loads."""
    if args.json_object:
        return {"type": "json_object"}
    if args.json_schema is None:
        return None
    try:
        with open(args.json_schema, "rb") as f:
            raw = f.read(MAX_SCHEMA_CHARS + 1)
        if len(raw) > MAX_SCHEMA_CHARS:
            raise InvalidInputError(f"--json-schema {args.json_schema}: more than {MAX_SCHEMA_CHARS} bytes")
        schema = json.loads(raw)
    except OSError as exc:
        raise InvalidInputError(f"--json-schema {args.json_schema}: {exc.strerror}") from None
    except (ValueError, RecursionError) as exc:
        raise InvalidInputError(f"--json-schema {args.json_schema}: not JSON ({exc})"[:300]) from None
    rf = {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}
    check_response_format(rf)
    return rf


def _logprob_json(engine: Engine, token: int, entry: TokenLogprob) -> dict[str, Any]:
    """One token's log-probability for the CLI's JSON: ids, texts (U+FFFD where a token holds
    part of a character), values."""

    def text(t: int) -> str:
        return engine.token_bytes(t).decode("utf-8", "replace")

    return {
        "token_id": token,
        "token": text(token),
        "logprob": json_logprob(entry.logprob),
        "top": [{"token_id": j, "token": text(j), "logprob": json_logprob(lp)} for j, lp in entry.top],
    }


def stats_json(stats: Stats) -> dict[str, Any]:
    """The CLI's stats object: the contract keys first, then everything else."""
    d = stats.to_dict()
    head = {k: d.pop(k) for k in ("tokens_per_s", "acceptance_rate", "mean_accepted", "mode")}
    d.pop("fallbacks", None)
    head["fallbacks"] = [{"at": f.at, "to": f.to, "reason": f.reason} for f in stats.fallbacks]
    return {**head, **d}
