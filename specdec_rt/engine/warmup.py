"""Warming an Engine up before it serves: a few short requests alone, then forgotten except
what they measured."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from ..errors import SpecDecError
from ..logs import get_logger

__all__ = ["WARMUP_REQUESTS", "WARMUP_TOKENS", "WARMUP_PROMPT_TOKENS", "warm_up"]

if TYPE_CHECKING:
    from .engine import Engine

log = get_logger("specdec_rt.engine.warmup")

WARMUP_REQUESTS = 2  # the first measures the draft's steps, the second its prefill (it needs the steps)
WARMUP_TOKENS = 16
WARMUP_PROMPT_TOKENS = 64  # the last tokens of a rendered prompt the warm-up runs (real ones: ~20 to 40)
TOUCH_TOKENS = 8  # the requests before them: one whose times are forgotten, one plain (the base step)
# general chat, in no prompt set of the benchmarks or the demo
WARMUP_PROMPTS = ("Describe the water cycle for a ten-year-old.", "List a few ways to reuse glass jars at home.")


async def warm_up(engine: Engine, requests: int = WARMUP_REQUESTS, max_new_tokens: int = WARMUP_TOKENS) -> None:
    """Run ``requests`` short requests on ``engine`` one after another (``mode="spec"`` when it
    has a drafter), then forget them, except what they measured; before them two shorter ones:
    a touch whose times are forgotten, and a plain request.

    Why: ONNX Runtime's first calls pay for allocations and thread start, which a user's first
    request would otherwise pay; and the cost model measures the draft's step, its prefill and
    the verify call *alone*, which the batch policy predicts from. A server whose requests always
    share a batch would otherwise never measure them, and its batches would never speculate.
    The touch's times are dropped (a cold start's draft steps cost ~1.5x); the plain request
    measures a target step alone, the unit of every cost (docs/decisions/0005-warm-up-alone.md).

    Kept: the measured costs and the shared acceptance EWMA (evidence about this draft and
    target, a better prior than the configured default). Not kept: prefix-cache entries (the
    cache is off meanwhile) and the scheduler's totals. The prompts are fixed general chat,
    rendered with the model's chat template when it has one (as plain text if that fails), cut
    to their last :data:`WARMUP_PROMPT_TOKENS` tokens: a template that writes pages around
    every conversation must not turn the warm-up into minutes of prefill.

    A failure is logged (``engine.warmup_failed``) and ends the warm-up, never the load: it is a
    request's failure (a chat template that refuses, a model that fails on some input), and a
    user's requests must meet it as their own, with the engine still there for the next one."""
    if requests <= 0:
        return
    caches = [m.prefix_cache for m in engine.models if m.caps.caches_prefixes and m.prefix_cache is not None]
    totals = copy.deepcopy(engine.scheduler.totals)  # merged into in place
    chat = engine.codec.chat_template is not None
    limit = engine.scheduler.max_length
    tokens = max(1, min(max_new_tokens, limit // 2) if limit else max_new_tokens)
    for c in caches:
        c.enabled = False
    try:
        for i in range(-2, requests):  # -2: the touch, -1: a plain request
            error = await _warm_request(engine, i, tokens=tokens if i >= 0 else min(tokens, TOUCH_TOKENS), chat=chat)
            if error is not None:  # failed as chat and as plain text
                log.warning("engine.warmup_failed", error=f"{type(error).__name__}: {error}"[:300])
                return
    finally:
        for c in caches:
            c.enabled = True
        engine.scheduler.totals = totals


async def _warm_request(engine: Engine, i: int, *, tokens: int, chat: bool) -> SpecDecError | None:
    """Warm-up request ``i`` (-2: the touch, whose times are forgotten; -1: plain decoding),
    as chat (with a chat template), else as plain text; None once one ran, else the error."""
    error: SpecDecError | None = None
    text = WARMUP_PROMPTS[i % len(WARMUP_PROMPTS)]
    mode = "ar" if i == -1 or engine.drafter is None else "spec"
    prompts: list[Any] = [[{"role": "user", "content": text}]] if chat else []
    for prompt in [*prompts, text]:
        try:
            ids = await anyio.to_thread.run_sync(engine.prompt_encoder.encode, prompt)
            await engine.generate(
                [int(t) for t in ids[-WARMUP_PROMPT_TOKENS:]], tokens, mode=mode, truncate_prompt=True
            )
            if i == -2:
                engine.scheduler.costs.forget_times()
            return None
        except SpecDecError as exc:
            error = exc
    return error
