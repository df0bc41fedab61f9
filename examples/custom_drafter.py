"""Write your own drafter and prove it lossless with the library's own checks.

A drafter is anything with ``generate_draft(ctx, k)`` and ``release(ctx)``: here, a "repeat the
last bigram" heuristic. ``check_greedy_lossless`` runs it against plain decoding on toy models
(no ONNX needed); the same object works with a real target via ``SpecDecScheduler``.

    python examples/custom_drafter.py
"""

from __future__ import annotations

import asyncio

from specdec_rt import DraftInferrer, DraftToken, ModelVerifier, SamplingParams, SpecConfig, SpecDecScheduler
from specdec_rt.testing import ToyLM, check_greedy_lossless


class EchoDrafter(DraftInferrer):
    """Proposes the token that followed the previous occurrence of the last token, repeatedly."""

    async def generate_draft(self, ctx, k):
        tokens = list(ctx.tokens)
        out = []
        for _ in range(k):
            last = tokens[-1]
            earlier = [i for i in range(len(tokens) - 1) if tokens[i] == last]
            if not earlier:
                break
            nxt = tokens[earlier[-1] + 1]
            out.append(DraftToken(int(nxt)))  # deterministic proposal: q is one-hot
            tokens.append(nxt)
        return out

    def release(self, ctx):
        pass  # no per-request state


async def main() -> None:
    target = ToyLM(vocab_size=6, seed=3)
    await check_greedy_lossless(EchoDrafter(), ModelVerifier(target), [[1, 2, 3], [0, 0]], max_new_tokens=64)
    print("greedy output identical to plain decoding: ok")
    sched = SpecDecScheduler(EchoDrafter(), ModelVerifier(target), SpecConfig(measure_costs=False))
    r = await sched.run([1, 2, 3], 64, SamplingParams(temperature=0.8, seed=7))
    print(
        f"sampled: {r.token_ids[:16]}... acceptance {r.stats.acceptance_rate:.2f}, "
        f"{r.stats.tokens_per_target_call:.2f} tokens per target call"
    )


if __name__ == "__main__":
    asyncio.run(main())
