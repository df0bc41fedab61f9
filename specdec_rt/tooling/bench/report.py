"""Benchmark numbers -> medians, ratios, a table, a JSON document and a PNG chart."""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ...policy.figures import acceptance_by_depth
from ..reports import pyplot, save_figure

if TYPE_CHECKING:
    from ...policy.figures import CostFigures
    from ...types import Stats
    from .runner import Sample

RunIndex = dict[tuple[int, int], "Sample"]  # a mode's runs by (prompt, repeat)

__all__ = ["summarize", "format_table", "plot", "plot_acceptance", "acceptance_by_depth", "median_costs"]


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return 0.0
    i = (len(xs) - 1) * q
    lo, hi = int(i), min(int(i) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def _mode_summary(samples: list[Sample], by_prompt_ar: RunIndex, by_prompt_hf: RunIndex) -> dict[str, Any]:
    tps = [s.tokens_per_s for s in samples]
    out: dict[str, Any] = {
        "tokens_per_s": statistics.median(tps),
        "p25": _q(tps, 0.25),
        "p75": _q(tps, 0.75),
        "n": len(samples),
    }
    for ref_name, ref in (("ar", by_prompt_ar), ("hf_ar", by_prompt_hf)):  # keyed (prompt, repeat)
        ratios = [
            s.tokens_per_s / ref[s.prompt, s.repeat].tokens_per_s
            for s in samples
            if (s.prompt, s.repeat) in ref and ref[s.prompt, s.repeat].tokens_per_s > 0
        ]
        if ratios:
            out[f"speedup_vs_{ref_name}"] = statistics.median(ratios)
    if by_prompt_ar:
        same = [
            s.token_ids == by_prompt_ar[s.prompt, s.repeat].token_ids
            for s in samples
            if (s.prompt, s.repeat) in by_prompt_ar
        ]
        out["identical_to_ar"] = sum(same) / len(same) if same else None
    stats = [s.stats for s in samples if s.stats is not None and s.stats.drafted]
    if stats:
        out.update(_speculation_summary(stats))
    costs = [s.extra["costs"] for s in samples if s.extra and "costs" in s.extra]
    if costs:
        out["costs"] = median_costs(costs)
    return out


def _speculation_summary(stats: list[Stats]) -> dict[str, Any]:
    """A speculative mode's counters over its runs: acceptance, tokens per target call, and the
    acceptance at each draft depth (summed counts, so rates weigh prompts by their rounds)."""
    drafted, accepted = sum(x.drafted for x in stats), sum(x.accepted for x in stats)
    rounds = sum(x.rounds for x in stats)
    calls = sum(x.rounds + x.ar_steps for x in stats)
    by_depth = acceptance_by_depth(stats)
    return {
        "acceptance_rate": accepted / drafted,
        "mean_accepted": accepted / rounds,
        "tokens_per_target_call": sum(x.new_tokens for x in stats) / calls,
        "fallbacks": sum(len(x.fallbacks) for x in stats),
        "per_position_acceptance": [row["rate"] for row in by_depth],
        "acceptance_by_depth": by_depth,
    }


def median_costs(figures: list[CostFigures]) -> dict[str, Any]:
    """The medians over prompts of the costs measured after each (:func:`~specdec_rt.policy.figures.cost_figures`):
    ``draft_cost`` per draft token and ``verify_cost`` / ``verify_measured`` per k, in plain
    target steps; ``plain_step_ms``, ``draft_token_ms``; ``prompts`` and ``measured`` (how many
    prompts' figures were measured rather than the configured defaults)."""

    def median(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    def per_k(key: Literal["verify_cost", "verify_measured"]) -> dict[str, float | None]:
        ks = sorted({k for f in figures for k in f[key]}, key=int)
        return {k: median([f[key].get(k) for f in figures]) for k in ks}

    return {
        "prompts": len(figures),
        "measured": sum(f["measured"] for f in figures),
        "plain_step_ms": median([f["plain_step_ms"] for f in figures]),
        "draft_token_ms": median([f["draft_token_ms"] for f in figures]),
        "draft_cost": median([f["draft_cost"] for f in figures]),
        "verify_cost": per_k("verify_cost"),
        "verify_measured": per_k("verify_measured"),
    }


def summarize(samples: list[Sample]) -> dict[str, Any]:
    """``{"modes": {mode: {...}}, "categories": {category: {mode: {...}}}}`` (medians, ratios)."""
    by_mode: defaultdict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        by_mode[s.mode].append(s)

    def index(
        mode: str, subset: list[Sample]
    ) -> RunIndex:  # a mode's runs by (prompt, repeat): ratios pair runs of one pass
        return {(s.prompt, s.repeat): s for s in subset if s.mode == mode}

    modes = {m: _mode_summary(xs, index("ar", samples), index("hf_ar", samples)) for m, xs in by_mode.items()}
    categories = {}
    for cat in sorted({s.category for s in samples}):
        sub = [s for s in samples if s.category == cat]
        per: defaultdict[str, list[Sample]] = defaultdict(list)
        for s in sub:
            per[s.mode].append(s)
        categories[cat] = {m: _mode_summary(xs, index("ar", sub), index("hf_ar", sub)) for m, xs in per.items()}
    return {"modes": modes, "categories": categories}


def format_table(summary: dict[str, Any]) -> str:
    rows = [
        f"{'mode':<22} {'tok/s':>7} {'p25-p75':>13} {'vs ar':>6} {'vs hf_ar':>8} {'accept':>6} "
        f"{'mean acc':>8} {'tok/call':>8} {'identical':>9}"
    ]
    for m, d in summary["modes"].items():

        def f(key: str, fmt: str, d: dict[str, Any] = d) -> str:
            return format(d[key], fmt) if d.get(key) is not None else "-"

        rows.append(
            f"{m:<22} {d['tokens_per_s']:>7.1f} {d['p25']:>6.1f}-{d['p75']:<6.1f} "
            f"{f('speedup_vs_ar', '.2f'):>6} {f('speedup_vs_hf_ar', '.2f'):>8} "
            f"{f('acceptance_rate', '.2f'):>6} {f('mean_accepted', '.2f'):>8} "
            f"{f('tokens_per_target_call', '.2f'):>8} {f('identical_to_ar', '.0%'):>9}"
        )
    return "\n".join(rows)


def plot(summary: dict[str, Any], path: Path, title: str) -> Path | None:
    """Median tokens/s per mode (bars, p25-p75 whiskers) and per-category speedup over ``ar``."""
    plt = pyplot()
    if plt is None:
        return None
    modes = summary["modes"]
    names = list(modes)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    med = [modes[n]["tokens_per_s"] for n in names]
    err = [[m - modes[n]["p25"] for n, m in zip(names, med)], [modes[n]["p75"] - m for n, m in zip(names, med)]]
    colors = ["#888888" if n.startswith(("hf", "optimum")) else "#1f77b4" if n == "ar" else "#2ca02c" for n in names]
    ax1.bar(names, med, yerr=err, color=colors, capsize=3)
    ax1.set_ylabel("tokens/s (median over prompts)")
    ax1.set_title(title)
    ax1.tick_params(axis="x", rotation=35)
    for lbl in ax1.get_xticklabels():
        lbl.set_ha("right")
    cats = list(summary["categories"])
    spec_modes = [n for n in names if n.startswith("spec")]
    width = 0.8 / max(1, len(spec_modes))
    for j, mname in enumerate(spec_modes):
        vals = [summary["categories"][c].get(mname, {}).get("speedup_vs_ar", 0) for c in cats]
        ax2.bar([i + j * width for i in range(len(cats))], vals, width, label=mname)
    ax2.axhline(1.0, color="black", linewidth=0.8)
    ax2.set_xticks([i + width * (len(spec_modes) - 1) / 2 for i in range(len(cats))], cats)
    ax2.set_ylabel("speedup over our plain decoding (median)")
    ax2.set_title("speculative speedup by prompt category")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_acceptance(samples: list[Sample], path: Path, mode: str = "spec") -> Path | None:
    """Acceptance over time for one speculative mode: the EWMA after each round of every prompt,
    and the acceptance at each draft position (given the earlier ones were accepted)."""
    runs = [s.stats for s in samples if s.mode == mode and s.stats is not None and s.stats.history]
    if not runs:
        return None
    plt = pyplot()
    if plt is None:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for stats in runs:
        ewma = [r.ewma for r in stats.history if r.ewma is not None]
        ax1.plot(range(1, len(ewma) + 1), ewma, alpha=0.35, linewidth=1)
    ax1.axhline(0.4, color="red", linestyle="--", linewidth=0.8, label="fall back below 0.4")
    ax1.axhline(0.6, color="green", linestyle="--", linewidth=0.8, label="resume above 0.6")
    fallbacks = sum(1 for stats in runs for f in stats.fallbacks if f.to == "ar")
    ax1.set_title(f"{mode}: acceptance EWMA per round ({len(runs)} prompts, {fallbacks} fallbacks)")
    ax1.set_xlabel("round")
    ax1.set_ylabel("acceptance EWMA")
    ax1.set_ylim(0, 1.02)
    ax1.legend(fontsize=8)
    depths = acceptance_by_depth(runs)
    ax2.bar([row["depth"] for row in depths], [row["rate"] for row in depths], color="#2ca02c")
    for row in depths:
        ax2.text(row["depth"], row["rate"] + 0.01, str(row["drafted"]), ha="center", fontsize=7)
    ax2.set_xlabel("draft position (numbers: rounds that reached it)")
    ax2.set_ylabel("P(accepted | earlier accepted)")
    ax2.set_ylim(0, 1.05)
    ax2.set_title("acceptance by draft position")
    fig.tight_layout()
    return save_figure(fig, path)


def format_depths(modes: dict[str, Any]) -> str:
    """Acceptance at each draft depth per speculative mode, as a markdown table ("" if none):
    each cell P(accepted | earlier accepted) and its counts, accepted / rounds that tried it."""
    rows = {m: d["acceptance_by_depth"] for m, d in modes.items() if d.get("acceptance_by_depth")}
    if not rows:
        return ""
    deepest = max(row["depth"] for by_depth in rows.values() for row in by_depth)
    lines = [
        "Acceptance at each draft depth: P(accepted | every earlier draft accepted), "
        "accepted / rounds that drafted that deep, summed over prompts.",
        "",
        "| mode | " + " | ".join(f"depth {n}" for n in range(1, deepest + 1)) + " |",
        "|---|" + "---|" * deepest,
    ]
    for mode, by_depth in rows.items():
        cells = {row["depth"]: f"{row['rate']:.2f} ({row['accepted']}/{row['drafted']})" for row in by_depth}
        lines.append(f"| `{mode}` | " + " | ".join(cells.get(n, "-") for n in range(1, deepest + 1)) + " |")
    return "\n".join(lines)


def format_costs(modes: dict[str, Any]) -> str:
    """The measured draft and verify costs per speculative mode, as a markdown table ("" if
    none), with how they were measured."""
    rows = {m: d["costs"] for m, d in modes.items() if d.get("costs")}
    if not rows:
        return ""
    ks = sorted({k for c in rows.values() for k in c["verify_cost"]}, key=int)
    lines = [
        "Costs in plain target steps (one token through the target alone), as the policy measured "
        "them: EWMAs of the draft model's seconds per step and of the verify calls' seconds at each "
        "draft count k, the verify cost fitted as a line in k (measured value in brackets where "
        "that k was run); medians over prompts of the figures after each prompt.",
        "",
        "| mode | plain step | draft token | " + " | ".join(f"verify k={k}" for k in ks) + " | measured |",
        "|---|---|---|" + "---|" * len(ks) + "---|",
    ]

    def number(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    for mode, c in rows.items():
        verify = [
            number(c["verify_cost"].get(k), ".2f")
            + (f" ({c['verify_measured'][k]:.2f})" if c["verify_measured"].get(k) is not None else "")
            for k in ks
        ]
        lines.append(
            f"| `{mode}` | {number(c['plain_step_ms'], '.2f')} ms | {number(c['draft_cost'], '.2f')} "
            f"({number(c['draft_token_ms'], '.2f')} ms) | "
            + " | ".join(verify)
            + f" | {c['measured']}/{c['prompts']} |"
        )
    return "\n".join(lines)


def format_markdown(report: dict[str, Any]) -> str:
    """Markdown tables of a bench report: modes, categories, micro-benchmarks."""
    lines = [
        "| mode | tokens/s (median) | p25-p75 | vs our ar | vs hf_ar | acceptance | mean accepted | tokens per target call | identical to ar |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def f(d: dict[str, Any], key: str, fmt: str) -> str:
        return format(d[key], fmt) if d.get(key) is not None else "-"

    for m, d in report["modes"].items():
        lines.append(
            f"| `{m}` | {d['tokens_per_s']:.1f} | {d['p25']:.1f}-{d['p75']:.1f} | "
            f"{f(d, 'speedup_vs_ar', '.2f')} | {f(d, 'speedup_vs_hf_ar', '.2f')} | "
            f"{f(d, 'acceptance_rate', '.2f')} | {f(d, 'mean_accepted', '.2f')} | "
            f"{f(d, 'tokens_per_target_call', '.2f')} | {f(d, 'identical_to_ar', '.0%')} |"
        )
    depths, costs = format_depths(report["modes"]), format_costs(report["modes"])
    lines += ["", depths] if depths else []
    lines += ["", costs] if costs else []
    spec = [m for m in report["modes"] if m.startswith("spec")]
    if spec and len(report.get("categories", {})) > 1:
        lines += [
            "",
            "| category | " + " | ".join(f"`{m}` vs ar (acceptance, mean accepted)" for m in spec) + " |",
            "|---|" + "---|" * len(spec),
        ]
        for cat, modes in report["categories"].items():
            cells = []
            for m in spec:
                d = modes.get(m, {})
                cells.append(
                    f"{f(d, 'speedup_vs_ar', '.2f')}x ({f(d, 'acceptance_rate', '.2f')}, "
                    f"{f(d, 'mean_accepted', '.2f')})"
                    if d
                    else "-"
                )
            lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    if report.get("memory"):
        lines += ["", format_memory(report["memory"])]
    if report.get("micro"):
        lines += ["", format_micro(report["micro"])]
    return "\n".join(lines)


def format_memory(memory: dict[str, Any]) -> str:
    """The bench process's memory (``report["memory"]``: weights, resident memory, KV pools) as
    a markdown table."""
    lines = ["| memory | value |", "|---|---|"]
    lines.append(
        f"| weight files | {memory.get('weights_mb', 0):.0f} MB on disk; "
        f"{memory.get('weights_mapped_mb', 0):.0f} MB mapped, {memory.get('weights_resident_mb', 0):.0f} MB resident |"
    )
    lines.append(f"| resident memory, models loaded | {memory.get('rss_mb', 0):.0f} MB |")
    if "peak_rss_mb" in memory:
        lines.append(f"| peak resident memory, every mode run | {memory['peak_rss_mb']:.0f} MB |")
    for name, kv in memory.get("kv", {}).items():
        lines.append(
            f"| KV of `{name}` ({kv['role']}) | {kv['bytes_per_position'] / 1024:.1f} KiB per position; "
            f"{kv['reserved_mb']:.0f} MB reserved ({kv['positions_per_slot']} positions per slot) |"
        )
    return "\n".join(lines)


def format_micro(micro: dict[str, Any]) -> str:
    """The micro-benchmarks (step costs, bandwidth, memory) as a markdown table."""
    lines = ["| micro-benchmark | value |", "|---|---|"]
    lines.append(f"| 1-token step @ context {micro['context_short']} | {micro['step_ms_ctx_short']:.1f} ms |")
    wide_ms = micro["call_ms_%d_positions" % micro["verify_width"]]
    lines.append(
        f"| {micro['verify_width']}-position call @ context {micro['context_short']} | "
        f"{wide_ms:.1f} ms (**{micro['verify_width_ratio']:.2f}x** a 1-token step) |"
    )
    lines.append(
        f"| 1-token step @ context {micro['context_long']} | {micro['step_ms_ctx_long']:.1f} ms "
        f"(**{micro['context_ratio']:.2f}x** context {micro['context_short']}) |"
    )
    lines.append(f"| copy bandwidth | {micro['bandwidth_gbs']:.1f} GB/s |")
    lines.append(
        f"| weights read per step / bandwidth | {micro['bandwidth_floor_step_ms']:.1f} ms "
        f"({micro['weight_bytes'] / 1e6:.0f} MB); our step is {micro['ar_step_vs_floor']:.2f}x that |"
    )
    mem = micro.get("memory", {})
    if mem:
        lines.append(
            f"| resident memory of {' + '.join(mem.get('models', []))} + KV, one "
            f"{mem.get('tokens')}-token request (fresh process) | {mem.get('rss_mb', 0):.0f} MB "
            f"(peak {mem.get('peak_rss_mb', 0):.0f} MB) |"
        )
    return "\n".join(lines)
