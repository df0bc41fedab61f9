"""The load test's numbers: per-request samples -> one summary per (concurrency, mode), and the
table, markdown and chart made from them. Pure functions (the chart imports matplotlib lazily)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from .reports import pyplot, save_figure

__all__ = ["RequestSample", "percentile", "summarize_phase", "speedups", "format_table", "format_markdown", "plot"]

OK, REJECTED, ERROR = "ok", "429", "error"


@dataclass
class RequestSample:
    """One request as the client saw it. Times in seconds from sending the request."""

    mode: str
    status: str = ERROR  # "ok" | "429" | "error"
    ttft: float | None = None  # first content chunk
    itl: list[float] = field(default_factory=list)  # gaps between consecutive content chunks
    e2e: float | None = None  # until [DONE] (or the failure)
    completion_tokens: int = 0  # from the usage chunk (else the content chunks)
    chunks: int = 0  # content chunks received
    usage_reported: bool = False
    retry_after: float | None = None  # a 429's Retry-After, seconds
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "mode": self.mode,
            "status": self.status,
            "ttft_ms": _ms(self.ttft),
            "e2e_ms": _ms(self.e2e),
            "completion_tokens": self.completion_tokens,
            "chunks": self.chunks,
        }
        if self.error:
            d["error"] = self.error
        return d


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between the closest ranks (numpy's
    default); ``None`` for no values."""
    xs = sorted(values)
    if not xs:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize_phase(samples: Sequence[RequestSample], wall_s: float, concurrency: int, mode: str) -> dict[str, Any]:
    """One (concurrency, mode) phase. Throughput counts the completion tokens of successful
    requests over the phase's wall time (first request sent to last response finished); the
    latency percentiles are over successful requests (ITL: over all their chunk gaps, pooled)."""
    ok = [s for s in samples if s.status == OK]
    tokens = sum(s.completion_tokens for s in ok)
    ttft = [s.ttft for s in ok if s.ttft is not None]
    itl = [g for s in ok for g in s.itl]
    e2e = [s.e2e for s in ok if s.e2e is not None]
    # time per output token after the first: (e2e - ttft) / (tokens - 1), per request
    tpot = [
        (s.e2e - s.ttft) / (s.completion_tokens - 1)
        for s in ok
        if s.e2e is not None and s.ttft is not None and s.completion_tokens > 1
    ]

    def ms(xs: list[float], q: float) -> float | None:
        v = percentile(xs, q)
        return None if v is None else round(v * 1e3, 3)

    errors = [s.error for s in samples if s.status == ERROR and s.error]
    return {
        "concurrency": concurrency,
        "mode": mode,
        "wall_s": round(wall_s, 4),
        "requests": len(samples),
        "ok": len(ok),
        "rejected_429": sum(1 for s in samples if s.status == REJECTED),
        "errors": sum(1 for s in samples if s.status == ERROR),
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / wall_s, 3) if wall_s > 0 else 0.0,
        "requests_per_s": round(len(ok) / wall_s, 3) if wall_s > 0 else 0.0,
        "ttft_p50_ms": ms(ttft, 50),
        "ttft_p99_ms": ms(ttft, 99),
        "itl_p50_ms": ms(itl, 50),
        "itl_p99_ms": ms(itl, 99),
        "e2e_p50_ms": ms(e2e, 50),
        "tpot_p50_ms": ms(tpot, 50),
        "tokens_per_chunk": round(tokens / sum(s.chunks for s in ok), 3) if any(s.chunks for s in ok) else None,
        "usage_missing": sum(1 for s in ok if not s.usage_reported),
        "error_examples": sorted(set(errors))[:3],
    }


def speedups(phases: Sequence[dict[str, Any]], num: str = "spec", den: str = "ar") -> dict[int, float]:
    """tokens/s of mode ``num`` over mode ``den`` at each concurrency where both ran."""
    by = {(p["concurrency"], p["mode"]): p["tokens_per_s"] for p in phases}
    return {c: round(by[c, num] / by[c, den], 3) for (c, m) in by if m == num and (c, den) in by and by[c, den] > 0}


def _f(v: float | None, fmt: str, unit: str = "") -> str:
    return "-" if v is None else format(v, fmt) + unit


def format_table(report: dict[str, Any]) -> str:
    """The plain-text result table (stdout)."""
    rows = [
        f"{'conc':>4} {'mode':<5} {'tok/s':>8} {'req/s':>6} {'ok':>5} {'429':>5} {'err':>4} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'e2e p50':>9}"
    ]
    for p in report["phases"]:
        rows.append(
            f"{p['concurrency']:>4} {p['mode']:<5} {p['tokens_per_s']:>8.1f} {p['requests_per_s']:>6.2f} "
            f"{p['ok']:>5} {p['rejected_429']:>5} {p['errors']:>4} "
            f"{_f(p['ttft_p50_ms'], '.0f', 'ms'):>9} {_f(p['ttft_p99_ms'], '.0f', 'ms'):>9} "
            f"{_f(p['itl_p50_ms'], '.1f', 'ms'):>8} {_f(p['itl_p99_ms'], '.1f', 'ms'):>8} "
            f"{_f(p['e2e_p50_ms'], '.0f', 'ms'):>9}"
        )
    for c, s in report.get("speedup_spec_vs_ar", {}).items():
        rows.append(f"concurrency {c}: spec / ar tokens/s = {s:.2f}x")
    return "\n".join(rows)


def format_markdown(report: dict[str, Any]) -> str:
    """Markdown: the settings line and one table row per (concurrency, mode)."""
    s = report["settings"]
    bound = f"{s['duration']:g} s" if s.get("duration") else f"{s['requests']} requests"
    lines = [
        f"Load test: {report.get('model') or s['url']}, {bound} per level and mode, "
        f"max_tokens {s['max_tokens']}, {s['n_prompts']} prompts ({s['prompts']}), greedy.",
        "",
        "| concurrency | mode | tokens/s | requests ok / 429 / errors | TTFT p50 | TTFT p99 | "
        "ITL p50 | ITL p99 | e2e p50 | tokens per chunk |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in report["phases"]:
        lines.append(
            f"| {p['concurrency']} | `{p['mode']}` | {p['tokens_per_s']:.1f} | "
            f"{p['ok']} / {p['rejected_429']} / {p['errors']} | {_f(p['ttft_p50_ms'], '.0f', ' ms')} | "
            f"{_f(p['ttft_p99_ms'], '.0f', ' ms')} | {_f(p['itl_p50_ms'], '.1f', ' ms')} | "
            f"{_f(p['itl_p99_ms'], '.1f', ' ms')} | {_f(p['e2e_p50_ms'], '.0f', ' ms')} | "
            f"{_f(p['tokens_per_chunk'], '.2f')} |"
        )
    sp = report.get("speedup_spec_vs_ar") or {}
    if sp:
        lines += ["", "spec / ar tokens/s: " + ", ".join(f"{v:.2f}x at {c}" for c, v in sp.items())]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> Path | None:
    """tokens/s vs concurrency (one line per mode) and TTFT p50 vs concurrency; ``None`` (and no
    file) when matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        return None
    phases = report["phases"]
    modes = list(dict.fromkeys(p["mode"] for p in phases))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for m in modes:
        pts = sorted((p["concurrency"], p["tokens_per_s"], p["ttft_p50_ms"]) for p in phases if p["mode"] == m)
        ax1.plot([x[0] for x in pts], [x[1] for x in pts], marker="o", label=m)
        ttft = [(x[0], x[2]) for x in pts if x[2] is not None]
        ax2.plot([x[0] for x in ttft], [x[1] for x in ttft], marker="o", label=m)
    levels = sorted({p["concurrency"] for p in phases})
    for ax, ylabel in ((ax1, "tokens/s (all clients)"), (ax2, "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    ax1.set_title(f"throughput: {report.get('model') or report['settings']['url']}")
    ax2.set_title("time to first token")
    fig.tight_layout()
    return save_figure(fig, path)
