"""``python -m specdec_rt bench``: our modes and the Hugging Face baselines, side by side.

Order of work: load our models; micro-benchmarks (verify width, context length, memory,
bandwidth) while only our models are in memory; then every prompt through every mode,
interleaved; medians and ratios; ``<out>/bench.json`` and ``<out>/bench.png``.
Hugging Face modes need torch + transformers (``hf_*``) and optimum-onnx (``optimum_ar``); a mode
whose package is missing is skipped with a note. ``--llama-cpp BIN_DIR`` adds llama.cpp's runs as
``llamacpp_<quant>`` modes and a side-by-side table (``llamacpp.py``).
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import anyio

from ...engine.memory import peak_resident_bytes
from ...errors import InvalidInputError
from ..reports import write_report
from .args import bench_args, split_list
from .micro import loaded_memory, memory_bandwidth_gbs, request_memory, step_costs, weight_bytes
from .report import format_markdown, format_micro, format_table, plot, plot_acceptance, summarize
from .runner import HF_MODES, build_our_modes, default_threads, load_prompts, log, machine_info, run_modes

__all__ = ["run_bench"]


def run_bench(args) -> int:
    return anyio.run(_bench, bench_args(args))


async def _bench(args) -> int:
    from ...engine.loading import ensure_built
    from ...ort.manifest import cache_root, load_manifest
    from ...text.codec import TextCodec

    llama_bin = args.llama_cpp
    if llama_bin:
        from .llamacpp import find_tools

        find_tools(llama_bin)  # a wrong folder fails before any model is built or loaded
    elif args.llama_gguf or args.llama_draft:
        raise InvalidInputError("--llama-gguf / --llama-draft need --llama-cpp BIN_DIR")
    folder = ensure_built(args.model, say=log)
    threads = args.threads or default_threads()
    max_length = args.max_length or 4096
    codec = TextCodec.from_manifest(load_manifest(folder))  # the prompts are checked before the models load
    cats = (
        set(split_list(args.categories, "--categories") or ())
        if isinstance(args.categories, str)
        else set(args.categories or ())
    )
    prompts = load_prompts(codec, args.prompts, cats or None, args.limit)
    t0 = time.perf_counter()
    ours, ctx = build_our_modes(folder, threads, max_length, args.add_draft or ())
    m = ctx["manifest"]
    drafts = len(m.drafts) + len(args.add_draft or ())
    log(f"loaded {m.name} and {drafts} draft(s) in {time.perf_counter() - t0:.1f} s; {threads} threads")
    memory = loaded_memory(ctx, say=log)

    modes_arg = split_list(args.modes, "--modes") if isinstance(args.modes, str) else args.modes
    wanted = modes_arg or list(ours) + list(HF_MODES)
    unknown = [w for w in wanted if w not in ours and w not in HF_MODES]
    if unknown:
        raise InvalidInputError(f"unknown mode(s) {unknown}; available: {list(ours) + list(HF_MODES)}")
    report: dict = {
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
        report["micro"] = await _micro(ctx, m, max_length)

    modes = {k: v for k, v in ours.items() if k in wanted}
    hf_wanted = [w for w in wanted if w in HF_MODES]
    if hf_wanted:
        hf = _hf_modes(hf_wanted, ctx, threads, cache_root() / "bench", report["skipped"])
        modes.update(hf)
    if llama_bin:
        from .llamacpp import llamacpp_modes

        llama, report["llama_cpp"] = llamacpp_modes(
            llama_bin, args.llama_gguf, args.llama_draft, codec, threads, max_length, m, log
        )
        log(f"llama.cpp modes: {', '.join(llama)}")
        modes.update(llama)
    samples = await run_modes(modes, prompts, args.max_new_tokens, args.repeats)
    report.update(summarize(samples))
    memory["peak_rss_mb"] = peak_resident_bytes() / 2**20  # every mode run in this process included
    markdown, table = format_markdown(report), format_table(report)
    if llama_bin:
        from .llamacpp import format_llamacpp, summarize_llamacpp

        report["llama_cpp"]["rows"] = rows = summarize_llamacpp(samples, codec)
        report["llama_cpp"]["runs"] = [
            {"mode": s.mode, "prompt": s.prompt, **s.extra["llama"]} for s in samples if s.extra and "llama" in s.extra
        ]
        markdown += "\n\n" + format_llamacpp(rows)
        table += "\n\n" + format_llamacpp(rows)
    if "hf_assisted" in modes:
        assisted = modes["hf_assisted"]
        report["model"]["hf_assistant"] = assisted.kind if isinstance(assisted, _HFRunner) else None

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    png = plot(report, out / "bench.png", f"{m.name}: {len(prompts)} prompts, {args.max_new_tokens} new tokens")
    report["chart"] = str(png) if png else None
    acc_png = plot_acceptance(samples, out / "acceptance.png")
    report["acceptance_chart"] = str(acc_png) if acc_png else None
    write_report(out, "bench", report, markdown, table, args.json)
    if not args.json:
        if report.get("micro"):
            print("\n" + format_micro(report["micro"]))
        for k, v in report["skipped"].items():
            print(f"skipped {k}: {v}")
    log(f"wrote {', '.join(str(p) for p in (out / 'bench.json', out / 'bench.md', png, acc_png) if p)}")
    return 0


async def _micro(ctx, m, max_length) -> dict:
    target = ctx["target"]
    log("micro: step costs (verify width 5 vs 1, context 2000 vs 100)")
    costs = await step_costs(target, progress=log, long=min(2000, max_length - 8))
    micro = dict(costs)
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


def _hf_modes(wanted, ctx, threads, cache_dir, skipped) -> dict:
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        for w in wanted:
            skipped[w] = "needs torch + transformers (pip install -e '.[export,bench]')"
        return {}
    from .hf import HFBaselines

    hf = HFBaselines(ctx["manifest"], ctx["draft_manifest"], threads, cache_dir, log)
    baselines = {  # one per HF_MODES
        "hf_ar": hf.hf_ar,
        "hf_assisted": hf.hf_assisted,
        "hf_prompt_lookup": hf.hf_prompt_lookup,
        "optimum_ar": hf.optimum_ar,
    }
    modes = {}
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

    def __init__(self, fn) -> None:
        self.fn = fn
        self.kind: str | None = None

    async def __call__(self, ids: list[int], n: int) -> tuple:
        new, secs = self.fn(ids, n)
        return new, secs, None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run_bench(None))
