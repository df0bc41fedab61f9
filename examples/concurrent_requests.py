"""Many requests at once on one Engine: timeouts, cancellation, a bad request, a heartbeat.

    python examples/concurrent_requests.py [--model smollm2-135m]

Shows that the event loop stays responsive (the heartbeat keeps ticking), that a request that
times out or fails does not disturb the others, and that their outputs equal what each request
gives alone.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from specdec_rt import Engine, SpecDecError

PROMPTS = ["Name three fruits.", "What is 2 + 2?", "Write a haiku about the sea.", "Say hello in French."]


async def main(model: str) -> None:
    async with await Engine.load(model, slots=2) as engine:
        alone = {p: (await engine.generate([{"role": "user", "content": p}], max_new_tokens=32)).text for p in PROMPTS}
        ticks, longest, last = 0, 0.0, time.perf_counter()

        async def heartbeat():
            nonlocal ticks, longest, last
            while True:
                await asyncio.sleep(0.01)
                now = time.perf_counter()
                ticks, longest, last = ticks + 1, max(longest, now - last), now

        async def one(p):
            return (await engine.generate([{"role": "user", "content": p}], max_new_tokens=32)).text

        beat = asyncio.create_task(heartbeat())
        results = await asyncio.gather(
            *(one(p) for p in PROMPTS),
            asyncio.wait_for(one("Tell me a very long story."), timeout=0.05),  # times out
            engine.generate("x", max_new_tokens=0),  # bad request
            return_exceptions=True,
        )
        beat.cancel()
        for p, r in zip(PROMPTS, results):
            print(f"{p!r}: {'same as alone' if r == alone[p] else 'DIFFERENT'}")
        print(
            f"timed out: {type(results[-2]).__name__}; bad request: {type(results[-1]).__name__} "
            f"(a SpecDecError: {isinstance(results[-1], SpecDecError)})"
        )
        print(f"heartbeat: {ticks} ticks, longest gap {longest * 1e3:.0f} ms")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    asyncio.run(main(ap.parse_args().model))
