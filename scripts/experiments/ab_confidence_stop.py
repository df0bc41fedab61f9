"""A/B of ``SpecConfig.confidence_stop`` on one engine: plain decoding, the stop on, the stop
off, interleaved per prompt (the order rotates), greedy; medians of per-prompt ratios to plain.

    python scripts/experiments/ab_confidence_stop.py smollm2-135m specdec_rt/tooling/data/chat_general.jsonl 64
    python scripts/experiments/ab_confidence_stop.py qwen2.5-coder-1.5b specdec_rt/tooling/data/prompts.jsonl 64 code
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time

from specdec_rt import Engine
from specdec_rt.policy.acceptance import SpecConfig
from specdec_rt.engine.loading import ensure_built
from specdec_rt.ort.manifest import load_manifest
from specdec_rt.text.codec import TextCodec

MODES = ("ar", "on", "off")


async def main(model: str, prompt_file: str, n_new: int, category: str | None) -> None:
    engine = await Engine.load(model, prefix_cache=False)
    configs = {"on": SpecConfig(confidence_stop=True), "off": SpecConfig(confidence_stop=False)}
    codec = TextCodec.from_manifest(load_manifest(ensure_built(model)))
    rows = [json.loads(x) for x in open(prompt_file) if x.strip()]
    rows = [r for r in rows if category is None or r.get("category") == category]
    speed = {m: [] for m in MODES}
    counts = {m: {"drafted": 0, "accepted": 0, "target calls": 0} for m in MODES}
    same = 0
    for i, row in enumerate(rows):
        ids, outs = codec.encode_prompt(row["messages"]), {}
        for mode in MODES[i % 3:] + MODES[: i % 3]:
            engine.scheduler.config = configs.get(mode, configs["off"])
            t = time.perf_counter()
            res = await engine.scheduler.run(ids, n_new, mode="ar" if mode == "ar" else "spec")
            speed[mode].append(res.stats.new_tokens / (time.perf_counter() - t))
            outs[mode] = res.token_ids
            c = counts[mode]
            c["drafted"] += res.stats.drafted
            c["accepted"] += res.stats.accepted
            c["target calls"] += res.stats.rounds + res.stats.ar_steps
        same += outs["on"] == outs["off"] == outs["ar"]
        print(i, {m: round(v[-1], 1) for m, v in speed.items()}, flush=True)
    for mode in MODES:
        ratio = statistics.median(a / b for a, b in zip(speed[mode], speed["ar"]))
        print(f"{mode:4s} median {statistics.median(speed[mode]):6.2f} tok/s, x plain {ratio:.3f}, {counts[mode]}")
    print(f"identical to plain decoding: {same}/{len(rows)}")
    await engine.aclose()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None))
