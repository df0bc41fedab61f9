"""A slow moment of a shared machine, replayed: does speculation resume afterwards?

    python scripts/experiments/slow_moment.py smollm2-135m --factor 2.0            # draft steps
    python scripts/experiments/slow_moment.py smollm2-135m --factor 3.5 --verify   # verify calls

The default mode's scheduler (as `bench` builds it) answers 3 general chat prompts, then its
measured costs are multiplied by ``--factor``, as if they had been timed in a slow moment (the
draft's steps, or with ``--verify`` every verify call over drafts; the plain step, measured all
along, stays). Then 13 more prompts: per request, tokens/s, rounds that drafted, the draft cost
``d`` and verify slope ``s`` in plain steps, and the mode switches (``ar:cost@9``: plain decoding
from token 9, the costs said drafts do not pay; ``spec:probe_ok@31``: a probe said they do).
Before probes re-measured the costs (the lab note "A slow moment that switched speculation off",
docs/lab-notes/2026-12-01-slow-moment-speculation-off.md), every request after the slow
moment decoded plainly.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from specdec_rt.tooling.bench.runner import build_our_modes, load_prompts
from specdec_rt.ort import load_manifest, resolve_model_dir
from specdec_rt.speculation.scheduler import SpecDecScheduler
from specdec_rt.text.codec import TextCodec


async def run(a: argparse.Namespace) -> None:
    folder = Path(resolve_model_dir(a.model))
    modes, _ = build_our_modes(folder, a.threads, 2048)
    # the scheduler behind bench's `spec` mode (its runner closes over it)
    sched = next(c.cell_contents for c in modes["spec"].__closure__
                 if isinstance(c.cell_contents, SpecDecScheduler))
    prompts = load_prompts(TextCodec.from_manifest(load_manifest(folder)), a.prompts)

    async def request(tag: str, ids: list[int]) -> None:
        t = time.perf_counter()
        res = await sched.run(ids, a.max_new_tokens, mode="spec")
        dt = time.perf_counter() - t
        d, s = sched.costs.relative()
        switches = [f"{f.to}:{f.reason}@{f.at}" for f in res.stats.fallbacks]
        print(f"{tag:>7} {len(res.token_ids) / dt:6.1f} tok/s  rounds {res.stats.rounds:2d}  "
              f"d={d:.3f} s={s:.3f}  {switches}", flush=True)

    for i, p in enumerate(prompts[:3]):
        await request(f"before{i}", p.ids)
    c = sched.costs
    if a.verify:
        c.verify_s = {k: v * (a.factor if k else 1.0) for k, v in c.verify_s.items()}
    else:
        c.draft_token_s *= a.factor
    print(f"-- {'verify calls' if a.verify else 'draft steps'} priced x{a.factor}")
    for i, p in enumerate(prompts[3:16]):
        await request(f"after{i}", p.ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="smollm2-135m", help="recipe name or export folder")
    ap.add_argument("--factor", type=float, default=2.0)
    ap.add_argument("--verify", action="store_true", help="price the verify calls, not the draft steps")
    ap.add_argument("--prompts", default="specdec_rt/tooling/data/chat_general.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
