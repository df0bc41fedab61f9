"""Time to first token at 1 in flight, before and after ``SpecConfig.defer_draft_prefill``,
side by side in one process (docs/lab-notes/2026-12-03-ttft.md).

Two engines on the same model (prefix cache on, as served; every prompt is new to each): "before"
with the deferral off (the draft prefills and drafts before the first token), "after" with the
default. Each prompt runs on both, one request at a time, the order alternating per prompt. Per
request: TTFT (``Engine.stream`` called -> first event with tokens), end-to-end tokens/s, and the
model calls before the first event (the step loop's listener: target and draft seconds). Apart,
per prompt: chat rendering, tokenization, the prefix-cache lookup, the first sample and the SSE
framing of one chunk. Medians printed as a Markdown table.

    .venv/bin/python scripts/experiments/ttft.py [--model smollm2-135m] [--tokens 64] [--repeat 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path
from time import perf_counter

import numpy as np

from specdec_rt import Engine, SpecConfig
from specdec_rt.sampling import greedy_ids
from specdec_rt.serve.replies import Reply, sse

DATA = Path(__file__).resolve().parents[2] / "specdec_rt" / "tooling" / "data"


def prompts(n: int) -> list[list[dict]]:
    rows = []
    for name in ("chat_heldout.jsonl", "chat_general.jsonl"):
        rows += [json.loads(line)["messages"] for line in (DATA / name).read_text().splitlines() if line.strip()]
    return rows[:n]


def ms(xs: list[float]) -> float:
    return 1000 * statistics.median(xs)


async def one(engine: Engine, calls: list, messages, tokens: int) -> dict:
    draft = engine.models[1] if len(engine.models) > 1 else None
    calls.clear()
    t0 = perf_counter()
    ttft, n, before, stats = None, 0, [], None
    async with engine.stream(messages, max_new_tokens=tokens, temperature=0.0) as events:
        async for ev in events:
            if ttft is None and ev.token_ids:
                ttft, before = perf_counter() - t0, list(calls)
            n += len(ev.token_ids)
            stats = ev.stats or stats
    e2e = perf_counter() - t0
    assert stats is not None
    return {
        "target_calls": sum(m is engine.target for m, _, _ in calls),
        "model_s": sum(s for _, _, s in calls),
        "per_call": stats.tokens_per_target_call,
        "ttft": ttft,
        "tok_s": n / e2e,
        "tokens": n,
        "target_s": sum(s for m, _, s in before if m is engine.target),
        "draft_s": sum(s for m, _, s in before if m is draft),
        "draft_calls": sum(m is draft for m, _, _ in before),
    }


def components(engine: Engine, messages) -> dict:
    codec = engine.codec
    t0 = perf_counter()
    text = codec.render_chat(messages)
    t1 = perf_counter()
    ids = codec.encode_prompt(messages)  # (renders again: tokenization is the difference)
    t2 = perf_counter()
    engine.target.cached_prefix(np.asarray(ids))
    t3 = perf_counter()
    row = np.random.default_rng(0).normal(size=(1, engine.target.vocab_size)).astype(np.float32)
    t4 = perf_counter()
    greedy_ids(row)
    t5 = perf_counter()
    reply = Reply("chat", engine.name)
    sse(reply.chunk("Hello", first=True))
    t6 = perf_counter()
    return {
        "render": t1 - t0,
        "tokenize": max(0.0, (t2 - t1) - (t1 - t0)),
        "lookup": t3 - t2,
        "sample": t5 - t4,
        "sse": t6 - t5,
        "prompt_tokens": len(ids),
        "chars": len(text),
    }


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=1, help="passes over the prompts (each new to the engines)")
    args = ap.parse_args()
    engines: dict[str, Engine] = {}
    calls: dict[str, list] = {}
    for name, defer in (("before", False), ("after", True)):
        engines[name] = await Engine.load(args.model, spec_config=SpecConfig(defer_draft_prefill=defer))
        calls[name] = []
        engines[name].executor.listeners.append(lambda m, rows, s, c=calls[name]: c.append((m, rows, s)))
    res: dict[str, list[dict]] = {"before": [], "after": []}
    comp = []
    ps = prompts(args.prompts)
    for r in range(args.repeat):
        for i, msgs in enumerate(ps):
            if r:  # a new prompt for the prefix cache: a different last line
                msgs = [*msgs[:-1], {**msgs[-1], "content": f"{msgs[-1]['content']} (take {r + 1})"}]
            order = ("before", "after") if (i + r) % 2 == 0 else ("after", "before")
            for name in order:
                res[name].append(await one(engines[name], calls[name], msgs, args.tokens))
            comp.append(components(engines["after"], msgs))
    print(f"| per request (median of {len(res['after'])}) | before | after | after / before |")
    print("|---|---|---|---|")
    for key, label in (
        ("ttft", "TTFT, ms"),
        ("target_s", "target calls before the first token, ms"),
        ("draft_s", "draft calls before the first token, ms"),
    ):
        b, a = ms([x[key] for x in res["before"]]), ms([x[key] for x in res["after"]])
        print(f"| {label} | {b:.1f} | {a:.1f} | {a / b:.2f}x |" if b else f"| {label} | {b:.1f} | {a:.1f} | |")
    ratios = [a["ttft"] / b["ttft"] for a, b in zip(res["after"], res["before"])]
    print(f"| TTFT after / before, per prompt (median) | | | {statistics.median(ratios):.2f}x |")
    tb = statistics.median(x["tok_s"] for x in res["before"])
    ta = statistics.median(x["tok_s"] for x in res["after"])
    tr = statistics.median(a["tok_s"] / b["tok_s"] for a, b in zip(res["after"], res["before"]))
    print(f"| end-to-end tok/s ({args.tokens} tokens) | {tb:.1f} | {ta:.1f} | {tr:.2f}x (per prompt) |")
    for key, label in (
        ("target_calls", "target calls per request"),
        ("per_call", "tokens per target call"),
        ("model_s", "model seconds per request (all calls)"),
    ):
        b, a = (statistics.median(x[key] for x in res[k]) for k in ("before", "after"))
        print(f"| {label} | {b:.2f} | {a:.2f} | {a / b:.2f}x |")
    print(
        f"| draft calls before the first token | {statistics.median(x['draft_calls'] for x in res['before'])}"
        f" | {statistics.median(x['draft_calls'] for x in res['after'])} | |"
    )
    print()
    print("| component (median) | ms |")
    print("|---|---|")
    for key in ("render", "tokenize", "lookup", "sample", "sse"):
        print(f"| {key} | {ms([c[key] for c in comp]):.3f} |")
    print(f"| prompt tokens | {statistics.median(c['prompt_tokens'] for c in comp)} |")
    for e in engines.values():
        await e.aclose()


if __name__ == "__main__":
    asyncio.run(main())
