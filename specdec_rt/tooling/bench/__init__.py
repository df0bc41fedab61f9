"""``python -m specdec_rt bench``: our modes and the Hugging Face baselines, side by side.

Order of work: load our models; micro-benchmarks (verify width, context length, memory,
bandwidth) while only our models are in memory; then every prompt through every mode,
interleaved; medians and ratios; ``<out>/bench.json`` and ``<out>/bench.png``.
Hugging Face modes need torch + transformers (``hf_*``) and optimum-onnx (``optimum_ar``); a mode
whose package is missing is skipped with a note. ``--llama-cpp BIN_DIR`` adds llama.cpp's runs as
``llamacpp_<quant>`` modes and a side-by-side table (``llamacpp.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from ...engine.memory import peak_resident_bytes
from ...errors import InvalidInputError
from ...ort import default_threads
from ..reports import write_report
from .args import bench_args, split_list
from .micro import loaded_memory, memory_bandwidth_gbs, request_memory, step_costs, weight_bytes
from .report import format_markdown, format_memory, format_micro, format_table, plot, plot_acceptance, summarize
from .runner import (
    HF_MODES,
    Runner,
    Sample,
    build_our_modes,
    load_prompts,
    log,
    machine_info,
    run_modes,
)

if TYPE_CHECKING:
    from ...ort.manifest import Manifest
    from ...text.codec import TextCodec
    from .hf import BaselineResult

__all__ = ["run_bench"]


def run_bench(args: argparse.Namespace) -> int:
    return anyio.run(_bench, bench_args(args))


async def _bench(args: argparse.Namespace) -> int:
    from ...engine.loading import ensure_built
    from ...ort.manifest import cache_root, load_manifest
    from ...text.codec import TextCodec

    _check_llama_flags(args)  # a wrong folder fails before any model is built or loaded
    folder = ensure_built(args.model, say=log)
    threads = args.threads or default_threads()
    max_length = args.max_length or 4096
    codec = TextCodec.from_manifest(load_manifest(folder))  # the prompts are checked before the models load
    prompts = load_prompts(codec, args.prompts, _categories(args), args.limit)
    t0 = time.perf_counter()
    ours, ctx = build_our_modes(folder, threads, max_length, args.add_draft or ())
    manifest = ctx["manifest"]
    drafts = len(manifest.drafts) + len(args.add_draft or ())
    log(f"loaded {manifest.name} and {drafts} draft(s) in {time.perf_counter() - t0:.1f} s; {threads} threads")
    memory = loaded_memory(ctx, say=log)
    wanted = _wanted_modes(args, ours)
    report: dict[str, Any] = {
        "model": ctx["info"],
        "machine": machine_info(threads),
        "settings": {
            "max_new_tokens": args.max_new_tokens,
            "prompts": len(prompts),
            "repeats": args.repeats,
            "prompt_file": args.prompts or "built-in",
            "decoding": "greedy",
        },
        "skipped": {},
        "memory": memory,
    }
    if args.micro:  # before any PyTorch model is loaded, so memory is ours alone
        report["micro"] = await _micro(ctx, manifest, max_length)
    modes: dict[str, Runner] = {k: v for k, v in ours.items() if k in wanted}
    hf_wanted = [w for w in wanted if w in HF_MODES]
    if hf_wanted:
        cache_dir = cache_root() / "bench"
        modes.update(_hf_modes(hf_wanted, ctx, threads=threads, cache_dir=cache_dir, skipped=report["skipped"]))
    if args.llama_cpp:
        modes.update(_llama_modes(args, report, codec=codec, manifest=manifest, threads=threads, ctx_size=max_length))
    samples = await run_modes(modes, prompts, args.max_new_tokens, args.repeats)
    report.update(summarize(samples))
    memory["peak_rss_mb"] = peak_resident_bytes() / 2**20  # every mode run in this process included
    markdown, table = format_markdown(report), format_table(report)
    if args.llama_cpp:
        llama_tables = _llama_results(report, samples, codec)
        markdown, table = markdown + llama_tables, table + llama_tables
    if "hf_assisted" in modes:
        assisted = modes["hf_assisted"]
        report["model"]["hf_assistant"] = assisted.kind if isinstance(assisted, _HFRunner) else None
    title = f"{manifest.name}: {len(prompts)} prompts, {args.max_new_tokens} new tokens"
    _write(args, report, samples, title=title, markdown=markdown, table=table)
    return 0


def _categories(args: argparse.Namespace) -> set[str] | None:
    """``--categories`` as a set (None: all); a caller's Namespace may hold a list already."""
    given = split_list(args.categories, "--categories") if isinstance(args.categories, str) else args.categories
    return set(given or ()) or None


def _check_llama_flags(args: argparse.Namespace) -> None:
    """``--llama-cpp``'s folder has llama.cpp's tools; ``--llama-gguf`` / ``--llama-draft`` need it."""
    if args.llama_cpp:
        from .llamacpp import find_tools

        find_tools(args.llama_cpp)
    elif args.llama_gguf or args.llama_draft:
        raise InvalidInputError("--llama-gguf / --llama-draft need --llama-cpp BIN_DIR")


def _wanted_modes(args: argparse.Namespace, ours: dict[str, Runner]) -> list[str]:
    """``--modes`` (default: ours and the Hugging Face baselines); an unknown one is an error."""
    modes_arg = split_list(args.modes, "--modes") if isinstance(args.modes, str) else args.modes
    wanted: list[str] = modes_arg or list(ours) + list(HF_MODES)
    unknown = [w for w in wanted if w not in ours and w not in HF_MODES]
    if unknown:
        raise InvalidInputError(f"unknown mode(s) {unknown}; available: {list(ours) + list(HF_MODES)}")
    return wanted


def _llama_modes(
    args: argparse.Namespace,
    report: dict[str, Any],
    *,
    codec: TextCodec,
    manifest: Manifest,
    threads: int,
    ctx_size: int,
) -> dict[str, Runner]:
    """llama.cpp's modes; what they run goes to ``report["llama_cpp"]``."""
    from .llamacpp import llamacpp_modes

    llama, report["llama_cpp"] = llamacpp_modes(
        args.llama_cpp,
        args.llama_gguf,
        args.llama_draft,
        codec,
        threads=threads,
        ctx_size=ctx_size,
        manifest=manifest,
        say=log,
    )
    log(f"llama.cpp modes: {', '.join(llama)}")
    return {name: runner for name, runner in llama.items()}


def _llama_results(report: dict[str, Any], samples: list[Sample], codec: TextCodec) -> str:
    """llama.cpp's side-by-side rows and runs into ``report["llama_cpp"]``; their table."""
    from .llamacpp import format_llamacpp, summarize_llamacpp

    report["llama_cpp"]["rows"] = rows = summarize_llamacpp(samples, codec)
    report["llama_cpp"]["runs"] = [
        {"mode": s.mode, "prompt": s.prompt, **s.extra["llama"]} for s in samples if s.extra and "llama" in s.extra
    ]
    return "\n\n" + format_llamacpp(rows)


def _write(
    args: argparse.Namespace, report: dict[str, Any], samples: list[Sample], *, title: str, markdown: str, table: str
) -> None:
    """The charts, ``bench.json`` and ``bench.md`` in ``--out``; the table (or JSON) on stdout."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    png = plot(report, out / "bench.png", title)
    report["chart"] = str(png) if png else None
    acc_png = plot_acceptance(samples, out / "acceptance.png")
    report["acceptance_chart"] = str(acc_png) if acc_png else None
    write_report(out, "bench", report, markdown, table=table, as_json=args.json)
    if not args.json:
        print("\n" + format_memory(report["memory"]))
        if report.get("micro"):
            print("\n" + format_micro(report["micro"]))
        for mode, why in report["skipped"].items():
            print(f"skipped {mode}: {why}")
    log(f"wrote {', '.join(str(p) for p in (out / 'bench.json', out / 'bench.md', png, acc_png) if p)}")


async def _micro(ctx: dict[str, Any], m: Manifest, max_length: int) -> dict[str, Any]:
    target = ctx["target"]
    log("micro: step costs (verify width 5 vs 1, context 2000 vs 100)")
    costs = await step_costs(target, progress=log, long=min(2000, max_length - 8))
    micro: dict[str, Any] = dict(costs)
    log("micro: memory of target + default draft + KV for one 2,048-token request (a fresh process)")
    draft_dir = m.draft_dir()
    micro["memory"] = request_memory(m.folder, draft_dir, target.threads)
    micro["memory"]["models"] = [m.name] + ([draft_dir.name] if draft_dir else [])
    log("micro: memory bandwidth")
    bw = memory_bandwidth_gbs()
    wbytes = weight_bytes(m)
    ceiling_ms = wbytes / (bw * 1e9) * 1e3
    micro.update(
        bandwidth_gbs=bw,
        weight_bytes=wbytes,
        bandwidth_floor_step_ms=ceiling_ms,
        ar_step_vs_floor=costs["step_ms_ctx_short"] / ceiling_ms,
    )
    return micro


def _hf_modes(
    wanted: list[str], ctx: dict[str, Any], *, threads: int, cache_dir: Path, skipped: dict[str, str]
) -> dict[str, Runner]:
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        for w in wanted:
            skipped[w] = "needs torch + transformers (pip install -e '.[export,bench]')"
        return {}
    from .hf import HFBaselines

    hf = HFBaselines(ctx["manifest"], ctx["draft_manifest"], threads=threads, cache_dir=cache_dir, log=log)
    baselines = {  # one per HF_MODES
        "hf_ar": hf.hf_ar,
        "hf_assisted": hf.hf_assisted,
        "hf_prompt_lookup": hf.hf_prompt_lookup,
        "optimum_ar": hf.optimum_ar,
    }
    modes: dict[str, Runner] = {}
    for w in wanted:
        if w == "optimum_ar" and importlib.util.find_spec("optimum") is None:
            skipped[w] = "needs optimum-onnx (the bench extra)"
            continue
        run = _HFRunner(baselines[w])
        if w == "hf_assisted":
            hf.assistant()
            run.kind = hf.assistant_kind
        modes[w] = run
    return modes


class _HFRunner:
    """A runner (``runner.Runner``) over one Hugging Face baseline ``fn(ids, n) -> (new ids,
    seconds)``; ``kind``: the assistant model's, for ``hf_assisted`` (the report names it)."""

    def __init__(self, fn: Callable[[list[int], int], BaselineResult]) -> None:
        self.fn = fn
        self.kind: str | None = None

    async def __call__(self, ids: list[int], n: int) -> tuple[list[int], float, None]:
        new, secs = self.fn(ids, n)
        return new, secs, None
