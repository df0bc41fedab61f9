"""``python -m specdec_rt bench --concurrency 1,2,4,8``: one Engine, many users at once.

What a service embedding the library sees: ``engine.generate`` calls from ``c`` concurrent
clients (closed loop: each client sends its next prompt when the last one finished), against the
same prompts run one after another. Per level and mode (``spec`` and ``ar`` interleaved at each
level, so both see the same machine): aggregate tokens/s, time to first token, inter-token
latency (time between consecutive stream events of a request), the longest event-loop stall (a
heartbeat task), and whether every output equals the prompt run alone. Repeated ``--repeats``
times; medians. Writes ``concurrency.json``, ``concurrency.md`` and ``concurrency.png``.

``--cold``: what a server that just started sees. Each level of each repeat gets a fresh Engine
(only :meth:`Engine.load`'s own warm-up, none of the bench's) with the prefix cache off, so that
the second mode gets no cache hits from the first; otherwise one Engine, warmed up first (alone
and in a batch of the highest level), serves every level.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..prompt_files import PromptText, read_prompt_file
from ..reports import pyplot, save_figure, write_report
from .args import bench_args, parse_levels
from .runner import log

if TYPE_CHECKING:
    from ...engine.engine import Engine

__all__ = ["run_concurrency"]


def load_texts(path: str | None, limit: int | None) -> list[PromptText]:
    """Prompts as the Engine takes them (text or chat messages); default: general chat. A bad
    file is a one-line error (:func:`~specdec_rt.tooling.prompt_files.read_prompt_file`)."""
    out = [d["text"] for d in read_prompt_file(path, "data/chat_general.jsonl")]
    return out[:limit] if limit else out


async def _heartbeat(stalls: list[float], period: float = 0.01) -> None:
    """Record how late a 10 ms sleep wakes up: the event loop's longest stall."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(period)
        stalls.append(time.perf_counter() - t - period)


async def _one(engine: Engine, prompt: PromptText, n: int, mode: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    ids: list[int] = []
    first, last, gaps = None, None, []
    async with engine.stream(prompt, n, mode=mode) as events:
        async for ev in events:
            now = time.perf_counter()
            if ev.token_ids:
                ids.extend(ev.token_ids)
                if first is None:
                    first = now - t0
                elif last is not None:
                    gaps.append(now - last)
                last = now
    return {"ids": ids, "ttft": first, "gaps": gaps}


async def run_level(engine: Engine, prompts: list[PromptText], n: int, mode: str, *, clients: int) -> dict[str, Any]:
    """All prompts through ``clients`` closed-loop clients; aggregate and per-request numbers."""
    queue = list(enumerate(prompts))[::-1]
    results: dict[int, dict[str, Any]] = {}
    stalls: list[float] = []

    async def client() -> None:
        while queue:
            i, p = queue.pop()
            results[i] = await _one(engine, p, n, mode)

    beat = asyncio.ensure_future(_heartbeat(stalls))
    t0 = time.perf_counter()
    await asyncio.gather(*[client() for _ in range(clients)])
    wall = time.perf_counter() - t0
    beat.cancel()
    rs = [results[i] for i in range(len(prompts))]
    gaps = [g for r in rs for g in r["gaps"]]
    tokens = sum(len(r["ids"]) for r in rs)
    return {
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "ids": [r["ids"] for r in rs],
        "ttft_p50": float(np.percentile([r["ttft"] for r in rs], 50)),
        "itl_p50": float(np.percentile(gaps, 50)) if gaps else None,  # None: one event a request
        "itl_p99": float(np.percentile(gaps, 99)) if gaps else None,
        "max_stall": max(stalls, default=0.0),
    }


async def _concurrency(args: argparse.Namespace) -> int:
    from ...engine.loading import ensure_built

    levels = parse_levels(args.concurrency)
    folder = ensure_built(args.model, say=log)
    prompts = load_texts(args.prompts, args.limit or max(levels))
    bench = _Levels(args, folder, levels, prompts)
    runs = await bench.run()
    summary = summarize(runs, levels)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "settings": {
            "model": str(args.model),
            "draft": bench.draft,
            "prompts": len(prompts),
            "max_new_tokens": bench.n,
            "repeats": args.repeats,
            "levels": levels,
            "cold": bench.cold,
            "prompt_file": args.prompts or "built-in general chat",
        },
        "levels": summary,
    }
    chart = plot(summary, out / "concurrency.png")
    write_report(out, "concurrency", report, format_markdown(summary), as_json=args.json)
    log(f"wrote {out / 'concurrency.json'}, {out / 'concurrency.md'}" + (f", {chart}" if chart else ""))
    return 0


class _Levels:
    """Every level (0: one after another) in both modes, ``--repeats`` times, on one warmed-up
    Engine or (``--cold``) a fresh one per level and repeat; ``draft``: the engines' draft."""

    def __init__(self, args: argparse.Namespace, folder: Path, levels: list[int], prompts: list[PromptText]) -> None:
        self.args, self.folder, self.levels, self.prompts = args, folder, levels, prompts
        self.n: int = args.max_new_tokens
        self.cold = bool(args.cold)
        self.draft: str | None = None
        self.runs: dict[str, list[dict[str, Any]]] = {}

    async def load(self, prefix_cache: bool = True) -> Engine:
        from ...engine.engine import Engine

        args = self.args
        engine = await Engine.load(
            self.folder,
            draft=args.draft,
            threads=args.threads,
            max_length=args.max_length,
            provider=args.provider,
            slots=max(self.levels),
            prefix_cache=prefix_cache,
        )
        self.draft = self.draft or engine.draft_name
        return engine

    async def run(self) -> dict[str, list[dict[str, Any]]]:
        """``"<level>/<mode>" ->`` the runs of that level and mode."""
        engine = None if self.cold else await self.load()
        try:
            await self._warm_up(engine)
            t_start = time.perf_counter()
            order = [0] + self.levels
            for rep in range(self.args.repeats):
                # odd repeats run the levels and modes backwards: a machine that drifts (shared, noisy)
                # then biases neither end of the ratios the bars name (c=8 against one after another)
                for level in order if rep % 2 == 0 else order[::-1]:
                    await self._level(engine, level, rep, t_start)
        finally:
            if engine is not None:
                await engine.aclose()
        return self.runs

    async def _warm_up(self, engine: Engine | None) -> None:
        """The shared engine: each prompt shape alone, then every batch size in both modes."""
        prompts, tokens, levels = self.prompts, self.n, self.levels
        if engine is None:
            log(
                f"{len(prompts)} prompts x {tokens} tokens, concurrency {levels}: a fresh engine per level and "
                "repeat (only Engine.load's own warm-up), prefix cache off"
            )
            return
        log(f"{len(prompts)} prompts x {tokens} tokens, concurrency {levels}, draft {engine.draft_name}; warming up")
        for prompt in prompts[:4]:  # alone, on these prompts: their shapes and arena (Engine.load measured the costs)
            await engine.generate(prompt, tokens)
        for mode in ("spec", "ar"):  # batched: every batch size's shapes, and its step costs
            await asyncio.gather(*[engine.generate(prompt, tokens, mode=mode) for prompt in prompts[: max(levels)]])

    async def _level(self, engine: Engine | None, level: int, rep: int, t_start: float) -> None:
        """Level ``c`` in both modes (backwards on odd repeats), on ``engine`` or a fresh one."""
        fresh = await self.load(prefix_cache=False) if engine is None else None
        try:
            for mode in ("spec", "ar") if rep % 2 == 0 else ("ar", "spec"):
                runner = fresh or engine
                assert runner is not None
                result = await run_level(runner, self.prompts, self.n, mode, clients=max(1, level))
                self.runs.setdefault(f"{level}/{mode}", []).append(result)
                log(
                    f"repeat {rep + 1}/{self.args.repeats} {'sequential' if level == 0 else f'c={level}'} {mode}: "
                    f"{result['tokens_per_s']:.1f} tok/s ({time.perf_counter() - t_start:.0f} s)"
                )
        finally:
            if fresh is not None:
                await fresh.aclose()


def summarize(runs: dict[str, list[dict[str, Any]]], levels: list[int]) -> list[dict[str, Any]]:
    """Medians per (level, mode) and the ratios the bars name."""

    def median(values: Iterable[float | None]) -> float | None:
        """Of the runs that measured it (a run of one event a request has no ITL)."""
        measured = [x for x in values if x is not None]
        return statistics.median(measured) if measured else None

    med: dict[str, dict[str, Any]] = {
        k: {f: median(r[f] for r in v) for f in ("tokens_per_s", "ttft_p50", "itl_p50", "itl_p99", "max_stall")}
        for k, v in runs.items()
    }
    solo = runs["0/ar"][0]["ids"]
    rows = []
    for c in [0] + levels:
        for mode in ("spec", "ar"):
            k, m = f"{c}/{mode}", med[f"{c}/{mode}"]
            same = min(sum(a == b for a, b in zip(r["ids"], solo)) for r in runs[k])
            prev = med.get(f"{levels[levels.index(c) - 1]}/{mode}") if c in levels[1:] else None
            rows.append(
                {
                    "concurrency": c,
                    "mode": mode,
                    **{f: None if v is None else round(v, 4) for f, v in m.items()},
                    "vs_sequential_spec": round(m["tokens_per_s"] / med["0/spec"]["tokens_per_s"], 3),
                    "vs_sequential_same": round(m["tokens_per_s"] / med[f"0/{mode}"]["tokens_per_s"], 3),
                    "spec_vs_ar": round(med[f"{c}/spec"]["tokens_per_s"] / med[f"{c}/ar"]["tokens_per_s"], 3),
                    "vs_previous_level": round(m["tokens_per_s"] / prev["tokens_per_s"], 3) if prev else None,
                    "identical": f"{same}/{len(solo)}",
                }
            )
    return rows


def format_markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| clients | mode | tok/s | x sequential spec | x sequential same mode | spec/ar | x previous level "
        "| TTFT p50 | ITL p50 | ITL p99 | max loop stall | identical |\n|" + "---|" * 12 + "\n"
    )
    prev = ["" if r["vs_previous_level"] is None else f"{r['vs_previous_level']:.2f}" for r in rows]
    lines = [
        f"| {'one after another' if r['concurrency'] == 0 else r['concurrency']} | {r['mode']} | "
        f"{r['tokens_per_s']:.1f} | {r['vs_sequential_spec']:.2f}x | {r['vs_sequential_same']:.2f}x | "
        f"{r['spec_vs_ar']:.2f} | {prev[i]} | "
        f"{_ms(r['ttft_p50'])} | {_ms(r['itl_p50'])} | {_ms(r['itl_p99'])} | "
        f"{r['max_stall'] * 1000:.0f} ms | {r['identical']} |"
        for i, r in enumerate(rows)
    ]
    return head + "\n".join(lines) + "\n"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Aggregate tokens/s against concurrent clients, one line per mode, sequential as dashes."""
    plt = pyplot()
    if plt is None:
        log("matplotlib is not installed: no chart")
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, color in (("spec", "#2ca02c"), ("ar", "#1f77b4")):
        pts = [(r["concurrency"], r["tokens_per_s"]) for r in rows if r["mode"] == mode and r["concurrency"]]
        ax.plot(*zip(*pts), marker="o", color=color, label=f"{mode}, concurrent")
        seq = next(r["tokens_per_s"] for r in rows if r["mode"] == mode and r["concurrency"] == 0)
        ax.axhline(seq, color=color, linestyle="--", linewidth=0.8, label=f"{mode}, one after another")
    ax.set_xlabel("concurrent clients (engine.generate)")
    ax.set_ylabel("aggregate tokens/s (median)")
    ax.set_title("One Engine, many users: batched across requests")
    ax.set_xticks(sorted({r["concurrency"] for r in rows if r["concurrency"]}))
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def run_concurrency(args: argparse.Namespace) -> int:
    return asyncio.run(_concurrency(bench_args(args)))
