"""Warming an Engine up before it serves: a few short requests alone, then forgotten except
what they measured."""

from __future__ import annotations

import copy

from .drafting import engine_models

__all__ = ["WARMUP_REQUESTS", "WARMUP_TOKENS", "warm_up"]

WARMUP_REQUESTS = 2  # the first measures the draft's steps, the second its prefill (it needs the steps)
WARMUP_TOKENS = 16
# general chat, in no prompt set of the benchmarks or the demo
WARMUP_PROMPTS = ("Describe the water cycle for a ten-year-old.",
                  "List a few ways to reuse glass jars at home.")


async def warm_up(engine, requests: int = WARMUP_REQUESTS, max_new_tokens: int = WARMUP_TOKENS) -> None:
    """Run ``requests`` short requests on ``engine`` one after another (``mode="spec"`` when it
    has a drafter), then forget them, except what they measured.

    Why: ONNX Runtime's first calls pay for allocations and thread start, which a user's first
    request would otherwise pay; and the cost model measures the draft's step, its prefill and
    the verify call *alone*, which the batch policy predicts from. A server whose requests always
    share a batch would otherwise never measure them, and its batches would never speculate
    (a cold engine, 2 requests at once on the default pair: plain rounds only, 0.99x ``ar``
    against 1.12x warmed up; docs/benchmarks.md). Kept: the measured costs and the shared
    acceptance EWMA (evidence about this draft and target, a better prior than the configured
    default). Not kept: prefix-cache entries (the cache is off meanwhile) and the scheduler's
    totals. The prompts are fixed general chat, rendered with the model's chat template when it
    has one, cut to fit a short context."""
    models = [m for m in engine_models(engine.target, engine.drafter) if getattr(m, "pool", None) is not None]
    caches = [m.prefix_cache for m in models if m.prefix_cache.enabled]
    totals = copy.deepcopy(engine.scheduler.totals)  # merged into in place
    chat = engine.codec.chat_template is not None
    limit = engine.scheduler.max_length
    tokens = max(1, min(max_new_tokens, limit // 2) if limit else max_new_tokens)
    mode = "spec" if engine.drafter is not None else "ar"
    for c in caches:
        c.enabled = False
    try:
        for i in range(requests):
            text = WARMUP_PROMPTS[i % len(WARMUP_PROMPTS)]
            prompt = [{"role": "user", "content": text}] if chat else text
            await engine.generate(prompt, tokens, mode=mode, truncate_prompt=True)
    finally:
        for c in caches:
            c.enabled = True
        engine.scheduler.totals = totals
