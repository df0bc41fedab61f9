"""``python -m specdec_rt bench --prefill``: prompt-processing (prefill) speed and batched decode
steps, ours beside llama.cpp's ``llama-bench``.

**Prefill, ours**: one request at a time feeds a fresh random prompt of each ``--lengths`` length
to a target (``OrtModel.start`` + ``extend``: the path a request's first call takes, through the
executor's pieces), with the prefix cache off and no draft, so the target's prefill is all that
runs; tokens/s = length / seconds. The targets: the model's own (float32 for the SmolLM2 recipe)
and its quantized sibling recipes ``<name>-q8`` / ``<name>-q4`` where they are built (else its
drafts named ``q8`` / ``q4``, the same graphs in a draft's folder). **Theirs**: ``llama-bench -m
GGUF -p L1,L2,.. -n 0 -t T -r 1 -o json`` on the F32 / Q8_0 / Q4_1 files
(:func:`~specdec_rt.tooling.bench.llamacpp.resolve_ggufs`). Every shape is run once untimed
first (its first call allocates; llama-bench warms up too). Then rounds: each round runs every
length on every target of ours (lengths in a rotating order), then llama-bench once per GGUF;
medians and bests over the rounds, and ours / theirs per pair (``f32``/``f32``, ``q8``/``q8_0``,
``q4``/``q4_1``): the median of the rounds' ratios, and best / best (on a shared machine the best
round is the least disturbed one).

**Batched decode steps** (``--rows``, default 1,4,8): ours, one single-token step for each of
``B`` requests in flight after a ``STEP_CONTEXT``-token prompt each, in one call (the packed
rows path, ``run_rows_sync``; one row: the plain step); theirs, ``llama-bench -p 0 -n 32 -d
STEP_CONTEXT`` for one row and, where it is built, ``llama-batched-bench -npp STEP_CONTEXT
-ntg 32 -npl 1,4,8`` for several.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import InvalidInputError, SpecDecError
from ...ort import default_threads
from ..reports import write_report
from .args import parse_sizes
from .runner import log, machine_info

if TYPE_CHECKING:
    from ...ort import OrtModel
    from ...ort.manifest import Manifest

__all__ = [
    "DEFAULT_LENGTHS",
    "DEFAULT_ROWS",
    "parse_sizes",
    "parse_llama_bench",
    "parse_batched_bench",
    "our_targets",
    "pair_label",
    "our_prefill",
    "our_steps",
    "run_prefill",
    "format_prefill",
]

DEFAULT_LENGTHS = "64,256,1024"
DEFAULT_ROWS = "1,4,8"
STEP_CONTEXT = 128  # prompt tokens each row holds before the timed decode steps
STEP_TOKENS = 32  # llama.cpp's timed decode steps per row (-n / -ntg)
STEP_REPS = 10  # our timed steps per row count and round (median)


def parse_llama_bench(text: str) -> list[dict[str, Any]]:
    """``llama-bench -o json``'s tests: per test ``n_prompt``, ``n_gen``, ``n_depth``,
    ``n_threads``, ``model_type``, and ``tokens_per_s`` (the median of its ``samples_ts``)."""
    try:
        tests = json.loads(text)
    except json.JSONDecodeError:
        tests = None
    if not isinstance(tests, list) or not tests:
        raise SpecDecError(f"llama-bench printed no JSON list of tests: {text[-400:]!r}")
    out = []
    for t in tests:
        try:
            samples = [float(x) for x in t.get("samples_ts") or [t["avg_ts"]]]
            out.append(
                {
                    "n_prompt": int(t["n_prompt"]),
                    "n_gen": int(t["n_gen"]),
                    "n_depth": int(t.get("n_depth", 0)),
                    "n_threads": int(t["n_threads"]),
                    "model_type": str(t.get("model_type", "")),
                    "tokens_per_s": statistics.median(samples),
                    "samples_ts": samples,
                }
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise SpecDecError(f"llama-bench test without {exc}: {json.dumps(t)[:400]}") from None
    return out


def parse_batched_bench(text: str) -> list[dict[str, Any]]:
    """``llama-batched-bench --output-format jsonl``'s lines: per line ``rows`` (``pl``), the
    timed decode steps per row (``tg``) and ``step_ms`` (``t_tg`` / ``tg``)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            d = json.loads(line)
            out.append({"rows": int(d["pl"]), "tg": int(d["tg"]), "step_ms": float(d["t_tg"]) / int(d["tg"]) * 1e3})
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, ZeroDivisionError):
            raise SpecDecError(f"llama-batched-bench line not understood: {line[:400]!r}") from None
    if not out:
        raise SpecDecError(f"llama-batched-bench printed no JSON lines: {text[-400:]!r}")
    return out


def _label(manifest: Manifest) -> str:
    q = manifest.quantization
    return f"q{q.get('bits', '')}" if q else manifest.raw.get("onnx", {}).get("dtype", "float32").replace("float", "f")


def our_targets(folder: Path) -> dict[str, Path]:
    """``label -> folder``: the model (``f32``) and its quantized forms (``q8``, ``q4``): sibling
    recipes ``<name>-q8`` / ``<name>-q4`` in the cache where built, else its drafts of those names."""
    from ...ort.manifest import cache_root, load_manifest

    m = load_manifest(folder)
    out = {_label(m): Path(folder)}
    for q in ("q8", "q4"):
        sibling = cache_root() / "models" / f"{m.name}-{q}"
        names = {d.get("name") for d in m.drafts}
        if (sibling / "manifest.json").is_file():
            out.setdefault(_label(load_manifest(sibling)), sibling)
        elif q in names:
            d = m.draft_dir(q)
            assert d is not None
            out.setdefault(_label(load_manifest(d)), d)
    return out


def pair_label(ours: str, theirs: list[str]) -> str | None:
    """The llama.cpp file a target of ours is compared with: the same label, or ours + ``_``
    (``q8`` -> ``q8_0``, ``q4`` -> ``q4_1``)."""
    return next((t for t in theirs if t == ours), None) or next((t for t in theirs if t.startswith(ours + "_")), None)


async def _prefill_once(model: OrtModel, length: int, rng: np.random.Generator) -> float:
    s = model.start()
    try:
        ids = rng.integers(3, model.vocab_size, length)
        t = time.perf_counter()
        await s.extend(ids, 1)
        return time.perf_counter() - t
    finally:
        s.close()


async def our_prefill(
    models: dict[str, Any], lengths: list[int], rng: np.random.Generator, rnd: int
) -> dict[tuple[str, int], float]:
    """One round: seconds of one prefill per (label, length), the lengths rotated by ``rnd``."""
    order = lengths[rnd % len(lengths) :] + lengths[: rnd % len(lengths)]
    return {(label, n): await _prefill_once(m, n, rng) for n in order for label, m in models.items()}


async def our_steps(
    model: OrtModel, rows: list[int], rng: np.random.Generator, reps: int = STEP_REPS
) -> dict[int, float]:
    """Median seconds of one decode step of ``B`` rows in one call, per ``B`` in ``rows``; each
    row holds a ``STEP_CONTEXT``-token prompt, rolled back to it after every step."""
    sessions = [model.start() for _ in range(max(rows))]
    try:
        for s in sessions:
            await s.extend(rng.integers(3, model.vocab_size, STEP_CONTEXT), 1)
        times: dict[int, list[float]] = {b: [] for b in rows}
        for rep in range(reps + 1):  # the first: untimed (a new shape allocates)
            for b in rows:
                feeds = [rng.integers(3, model.vocab_size, 1) for _ in range(b)]
                t = time.perf_counter()
                if b == 1:
                    sessions[0].run_sync(feeds[0], 1, STEP_CONTEXT)
                else:
                    model.run_rows_sync(sessions[:b], feeds, [1] * b)
                if rep:
                    times[b].append(time.perf_counter() - t)
                for s in sessions[:b]:
                    s.rollback(STEP_CONTEXT)
        return {b: statistics.median(x) for b, x in times.items()}
    finally:
        for s in sessions:
            s.rollback(0)
            s.close()


def _run_tool(cmd: list[str], what: str, both: bool = False) -> str:
    """The tool's stdout (``both``: and its stderr, where llama-batched-bench logs its lines)."""
    from .llamacpp import _exit_words, _tail

    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SpecDecError(f"{what} {_exit_words(proc.returncode)}: {_tail(proc.stderr)}")
    return proc.stdout + proc.stderr if both else proc.stdout


def run_prefill(args: argparse.Namespace) -> int:
    import anyio

    return anyio.run(_prefill, args)


async def _prefill(args: argparse.Namespace) -> int:
    from ...engine.loading import ensure_built
    from ...ort import load_manifest

    lengths = parse_sizes(args.lengths or DEFAULT_LENGTHS, "--lengths")
    rows = parse_sizes(args.rows or DEFAULT_ROWS, "--rows")
    tools = _llama_tools(args.llama_cpp) if args.llama_cpp else {}  # a wrong folder fails before any model loads
    folder = ensure_built(args.model, say=log)
    manifest = load_manifest(folder)
    threads = args.threads or default_threads()
    targets = our_targets(folder)
    models = _load_targets(targets, lengths, rows, threads=threads, max_length=args.max_length)
    ggufs: dict[str, Path] = {}
    if tools:
        from .llamacpp import resolve_ggufs

        ggufs = resolve_ggufs(args.llama_gguf, tools, manifest, log)
        log(f"llama.cpp: {', '.join(f'{k} ({v.name})' for k, v in ggufs.items())}")
    rng = np.random.default_rng(0)
    try:
        ours, theirs = await _prefill_rounds(
            models, lengths, rng, rounds=args.repeats, tools=tools, ggufs=ggufs, threads=threads
        )
        steps = await _steps(models, rows, rng, args.repeats)
        llama_steps = _llama_steps(tools, ggufs, rows, threads) if tools else {}
    finally:
        for mdl in models.values():
            await mdl.executor.aclose()
            mdl.close()
    report = {
        "model": {"name": manifest.name, "folder": str(folder), "targets": {k: str(v) for k, v in targets.items()}},
        "machine": machine_info(threads),
        "settings": {
            "lengths": lengths,
            "rounds": args.repeats,
            "rows": rows,
            "step_context": STEP_CONTEXT,
            "path": "OrtModel.start + extend, prefix cache off, no draft, fresh random prompts",
        },
        "prefill": _prefill_rows(models, lengths, list(ggufs), ours=ours, theirs=theirs),
        "steps": _step_rows(models, rows, list(ggufs), steps=steps, llama_steps=llama_steps),
        "llama_cpp": {"gguf": {k: str(v) for k, v in ggufs.items()}, "tools": sorted(tools)} if tools else None,
    }
    table = format_prefill(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_report(out, "prefill", report, table, as_json=args.json)
    log(f"wrote {out / 'prefill.json'}, {out / 'prefill.md'}")
    return 0


def _llama_tools(bin_dir: str) -> dict[str, Path]:
    """llama.cpp's tools in ``bin_dir``: :func:`~.llamacpp.find_tools`' and ``bench``
    (llama-bench, required), ``batched`` (llama-batched-bench, where it is built)."""
    from .llamacpp import find_tools

    tools = find_tools(bin_dir)
    bench = Path(bin_dir).expanduser() / "llama-bench"
    if not bench.is_file():
        raise SpecDecError(f"--llama-cpp {bin_dir}: no llama-bench in it")
    tools["bench"] = bench
    batched = bench.parent / "llama-batched-bench"
    if batched.is_file():
        tools["batched"] = batched
    return tools


def _load_targets(
    targets: dict[str, Path], lengths: list[int], rows: list[int], *, threads: int, max_length: int | None
) -> dict[str, OrtModel]:
    """Each target with KV for the longest prompt (``max_length`` by default) and ``max(rows)`` slots."""
    from ...ort import OrtModel

    max_length = max_length or max(max(lengths), STEP_CONTEXT + 1) + 1
    t0 = time.perf_counter()
    models = {
        label: OrtModel(f, max_length=max_length, slots=max(rows), threads=threads) for label, f in targets.items()
    }
    for mdl in models.values():
        if mdl.max_length < max(lengths):
            raise InvalidInputError(f"--lengths {max(lengths)}: {mdl.name} holds {mdl.max_length} positions")
    log(f"loaded {', '.join(f'{k} ({v.name})' for k, v in models.items())} in {time.perf_counter() - t0:.1f} s")
    return models


async def _prefill_rounds(
    models: dict[str, OrtModel],
    lengths: list[int],
    rng: np.random.Generator,
    *,
    rounds: int,
    tools: dict[str, Path],
    ggufs: dict[str, Path],
    threads: int,
) -> tuple[dict[tuple[str, int], list[float]], dict[tuple[str, int], list[float]]]:
    """Every shape once untimed, then ``rounds`` rounds of ours and llama-bench's per GGUF:
    prefill tokens/s per (label, length), ours and theirs."""
    for mdl in models.values():
        for length in lengths:
            await _prefill_once(mdl, length, rng)
    ours: dict[tuple[str, int], list[float]] = {}
    theirs: dict[tuple[str, int], list[float]] = {}
    for rnd in range(rounds):
        for key, secs in (await our_prefill(models, lengths, rng, rnd)).items():
            ours.setdefault(key, []).append(key[1] / secs)
        for label, path in ggufs.items():
            cmd = [str(tools["bench"]), "-m", str(path), "-p", ",".join(map(str, lengths)), "-n", "0"]
            text = _run_tool([*cmd, "-t", str(threads), "-r", "1", "-o", "json"], "llama-bench")
            for test in parse_llama_bench(text):
                if test["n_gen"] == 0 and test["n_prompt"] in lengths:
                    theirs.setdefault((label, test["n_prompt"]), []).append(test["tokens_per_s"])
        log(f"prefill round {rnd + 1}/{rounds} done")
    return ours, theirs


def _prefill_rows(
    models: dict[str, OrtModel],
    lengths: list[int],
    ggufs: list[str],
    *,
    ours: dict[tuple[str, int], list[float]],
    theirs: dict[tuple[str, int], list[float]],
) -> list[dict[str, Any]]:
    """The report's prefill rows: per target and length, medians, bests and ours / llama.cpp."""
    out = []
    for label in models:
        other = pair_label(label, ggufs)
        for length in lengths:
            got, their = ours[label, length], theirs.get((other, length), []) if other else []
            out.append(
                {
                    "target": label,
                    "model": models[label].name,
                    "prompt_tokens": length,
                    "tokens_per_s": statistics.median(got),
                    "best_tokens_per_s": max(got),
                    "runs": got,
                    "llama_cpp": other,
                    "llama_tokens_per_s": statistics.median(their) if their else None,
                    "llama_best_tokens_per_s": max(their) if their else None,
                    "llama_runs": their,
                    # ratios pair the runs of one round (the same moment of the machine)
                    "ours_vs_llama": statistics.median(a / b for a, b in zip(got, their)) if their else None,
                    "ours_vs_llama_best": max(got) / max(their) if their else None,
                }
            )
    return out


def _step_rows(
    models: dict[str, OrtModel],
    rows: list[int],
    ggufs: list[str],
    *,
    steps: dict[tuple[str, int], float],
    llama_steps: dict[tuple[str, int], float],
) -> list[dict[str, Any]]:
    """The report's decode-step rows: per target and rows in flight, ms a step, ours and llama.cpp's."""
    out = []
    for label in models:
        other = pair_label(label, ggufs)
        for count in rows:
            mine = steps[label, count]
            them = llama_steps.get((other, count)) if other else None
            out.append(
                {
                    "target": label,
                    "rows": count,
                    "step_ms": mine * 1e3,
                    "tokens_per_s": count / mine,
                    "llama_cpp": other,
                    "llama_step_ms": them,
                    "llama_over_ours": them / (mine * 1e3) if them else None,  # > 1: ours is faster
                }
            )
    return out


async def _steps(
    models: dict[str, Any], rows: list[int], rng: np.random.Generator, rounds: int
) -> dict[tuple[str, int], float]:
    """Median step seconds per (label, rows) over ``rounds`` rounds, the targets interleaved."""
    got: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for label, mdl in models.items():
            for b, secs in (await our_steps(mdl, rows, rng)).items():
                got.setdefault((label, b), []).append(secs)
    log("decode steps done")
    return {k: statistics.median(v) for k, v in got.items()}


def _llama_steps(
    tools: dict[str, Any], ggufs: dict[str, Any], rows: list[int], threads: int
) -> dict[tuple[str, int], float]:
    """llama.cpp's decode step in ms per (label, rows): llama-bench for one row, and
    llama-batched-bench (when built) for every row count."""
    out: dict[tuple[str, int], float] = {}
    for label, path in ggufs.items():
        if "batched" in tools:
            text = _run_tool(
                [
                    str(tools["batched"]),
                    "-m",
                    str(path),
                    "-c",
                    str(max(rows) * (STEP_CONTEXT + STEP_TOKENS) + 64),
                    "-npp",
                    str(STEP_CONTEXT),
                    "-ntg",
                    str(STEP_TOKENS),
                    "-npl",
                    ",".join(map(str, rows)),
                    "-t",
                    str(threads),
                    "-tb",
                    str(threads),
                    "--output-format",
                    "jsonl",
                ],
                "llama-batched-bench",
                both=True,
            )
            for r in parse_batched_bench(text):
                out[label, r["rows"]] = r["step_ms"]
        elif 1 in rows:
            text = _run_tool(
                [str(tools["bench"]), "-m", str(path), "-p", "0", "-n", str(STEP_TOKENS), "-d", str(STEP_CONTEXT)]
                + ["-t", str(threads), "-o", "json"],
                "llama-bench",
            )
            for t in parse_llama_bench(text):
                if t["n_gen"] > 0:
                    out[label, 1] = 1e3 / t["tokens_per_s"]
    return out


def format_prefill(report: dict[str, Any]) -> str:
    """Markdown: prefill tokens/s per target and length, ours / llama.cpp; decode steps per rows."""

    def f(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = [
        "| target | prompt tokens | ours tok/s median (best) | llama.cpp | llama.cpp tok/s median (best) "
        "| ours / llama.cpp (median of rounds; best / best) |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["prefill"]:
        lines.append(
            f"| {r['target']} | {r['prompt_tokens']} | {r['tokens_per_s']:.0f} ({r['best_tokens_per_s']:.0f}) | "
            f"{r['llama_cpp'] or '-'} | {f(r['llama_tokens_per_s'], '.0f')} ({f(r['llama_best_tokens_per_s'], '.0f')}) "
            f"| {f(r['ours_vs_llama'], '.2f')}; {f(r['ours_vs_llama_best'], '.2f')} |"
        )
    if report.get("steps"):
        lines += [
            "",
            f"| target | rows in flight | ours ms a step | ours tok/s | llama.cpp ms a step "
            f"| llama.cpp / ours (context {report['settings']['step_context']}) |",
            "|---|---|---|---|---|---|",
        ]
        for r in report["steps"]:
            lines.append(
                f"| {r['target']} | {r['rows']} | {r['step_ms']:.2f} | {r['tokens_per_s']:.0f} | "
                f"{f(r['llama_step_ms'], '.2f')} | {f(r['llama_over_ours'], '.2f')} |"
            )
    return "\n".join(lines)
