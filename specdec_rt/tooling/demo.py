"""The main job: ``python -m specdec_rt demo``.

Builds the default model on first use (``python -m export``, with its progress), streams one
speculative generation to the terminal, then decodes a few chat prompts with plain and with
speculative decoding, interleaved, and prints tokens/s, the speedup, acceptance, mean accepted
length and whether the outputs matched token for token.
"""

from __future__ import annotations

import statistics
import sys
import time
from argparse import Namespace
from typing import TYPE_CHECKING, cast

from ..engine.loading import ensure_built, load_engine

if TYPE_CHECKING:
    from ..ort import OrtModel

__all__ = ["run_demo", "DEMO_PROMPTS"]

DEMO_PROMPTS = [
    "What are three tips for staying focused while studying?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "Give me a short packing list for a weekend hiking trip.",
]


def _say(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


async def run_demo(args: Namespace) -> int:
    ensure_built(args.model, allow_build=not args.no_build, say=_say)
    t0 = time.perf_counter()
    engine = await load_engine(args)
    _say(
        f"loaded {engine.manifest.name} with draft {engine.draft_name!r} in {time.perf_counter() - t0:.1f} s "
        f"({cast('OrtModel', engine.target).session.get_providers()[0]}, exact to: {engine.manifest.exact_to})"
    )
    n = args.max_new_tokens
    async with engine:
        await engine.generate("Hello", max_new_tokens=4, mode="ar")  # warm-up (first-call allocations)
        await engine.generate("Hello", max_new_tokens=4)
        chat = [{"role": "user", "content": DEMO_PROMPTS[0]}]
        print(f"\n>>> {DEMO_PROMPTS[0]}\n", flush=True)
        stats = None
        async for ev in engine.stream(chat, max_new_tokens=n):
            print(ev.text, end="", flush=True)
            stats = ev.stats or stats
        assert stats is not None  # the stream's last event carries them
        print(
            f"\n\n[spec] {stats.new_tokens} tokens at {stats.tokens_per_s:.1f} tok/s, "
            f"acceptance {stats.acceptance_rate:.2f}, mean accepted {stats.mean_accepted:.2f}\n"
        )

        rows = []
        print(
            f"{'prompt':<34} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>8} "
            f"{'accept':>7} {'mean acc':>8} {'identical':>9}"
        )
        for prompt in DEMO_PROMPTS:
            chat = [{"role": "user", "content": prompt}]
            ar = await engine.generate(chat, max_new_tokens=n, mode="ar")
            sp = await engine.generate(chat, max_new_tokens=n, mode="spec")
            same = ar.token_ids == sp.token_ids
            speedup = sp.stats.tokens_per_s / ar.stats.tokens_per_s
            rows.append((speedup, same, sp.stats))
            print(
                f"{prompt[:33]:<34} {ar.stats.tokens_per_s:>11.1f} {sp.stats.tokens_per_s:>10.1f} "
                f"{speedup:>7.2f}x {sp.stats.acceptance_rate:>7.2f} {sp.stats.mean_accepted:>8.2f} "
                f"{'yes' if same else 'NO':>9}"
            )
        med = statistics.median(r[0] for r in rows)
        all_same = all(r[1] for r in rows)
        print(
            f"\nmedian speedup of speculative over plain decoding: {med:.2f}x "
            f"(greedy outputs identical: {'yes' if all_same else 'NO'})"
        )
    return 0 if all_same else 1
