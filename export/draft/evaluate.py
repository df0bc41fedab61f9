"""Acceptance of a draft measured through the runtime (ONNX Runtime target + the draft, the
real scheduler, greedy) on held-out prompts: per depth and mean accepted length."""

from __future__ import annotations

from pathlib import Path

__all__ = ["measure_acceptance", "depth_table"]


def depth_table(position_drafted: list[int], position_accepted: list[int]) -> list[float]:
    """Conditional acceptance at depth i: accepted at i / accepted at i-1 (drafted at i)."""
    out = []
    for i, (d, a) in enumerate(zip(position_drafted, position_accepted)):
        prev = position_accepted[i - 1] if i else d
        out.append(a / prev if prev and d else float("nan"))
    return out


def measure_acceptance(
    target_dir: Path,
    draft_dir: Path,
    prompts: list,
    *,
    k: int = 4,
    max_new_tokens: int = 64,
    threads: int | None = None,
) -> dict:
    """Run every prompt with a fixed draft length ``k`` (no fallback) and return
    ``{"per_depth": [k], "mean_accepted": float, "tokens_per_call": float, "acceptance": float,
    "exact": bool}``; ``exact`` compares the output with plain greedy decoding."""
    import anyio

    from specdec_rt.engine.factory import model_drafter
    from specdec_rt.ort import OrtModel, OrtTargetVerifier, load_manifest
    from specdec_rt.policy.config import SpecConfig
    from specdec_rt.speculation.scheduler import SpecDecScheduler
    from specdec_rt.text.codec import TextCodec
    from specdec_rt.types import Stats

    m = load_manifest(target_dir)
    codec = TextCodec.from_manifest(m)
    target = OrtModel(m, threads=threads, slots=1, max_length=2048)
    drafter = model_drafter(m, load_manifest(draft_dir), threads=threads, slots=1, max_length=2048)
    verifier = OrtTargetVerifier(target, share_hidden=bool(getattr(drafter, "needs_target_hidden", False)))
    cfg = SpecConfig(
        adapt_k=False,
        k_init=k,
        k_max=max(k, 1),
        fallback_below=0.0,
        zero_rounds=10**9,
        min_speedup=0.0,
        measure_costs=False,
    )
    spec = SpecDecScheduler(drafter, verifier, cfg, eos_ids=m.eos_ids)
    plain = SpecDecScheduler(None, OrtTargetVerifier(target), cfg, eos_ids=m.eos_ids)

    async def main():
        total, exact = Stats(), True
        for p in prompts:
            ids = codec.encode_prompt(p)
            a = await spec.run(ids, max_new_tokens, mode="spec")
            b = await plain.run(ids, max_new_tokens, mode="ar")
            exact &= a.token_ids == b.token_ids
            total.merge(a.stats)
        return total, exact

    total, exact = anyio.run(main)
    per_depth = depth_table(total.position_drafted, total.position_accepted)
    calls = total.rounds + total.ar_steps
    return {
        "per_depth": [round(x, 4) for x in per_depth[:k]],
        "acceptance": round(total.accepted / max(total.drafted, 1), 4),
        "mean_accepted": round(total.accepted / max(total.rounds, 1), 3),
        "tokens_per_call": round(total.new_tokens / max(calls, 1), 3),
        "prompts": len(prompts),
        "k": k,
        "exact": bool(exact),
    }
