"""Acceptance of a draft measured through the runtime (ONNX Runtime target + the draft, the
real scheduler, greedy) on held-out prompts: per depth and mean accepted length."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specdec_rt.ort.manifest import Manifest
    from specdec_rt.speculation.scheduler import SpecDecScheduler
    from specdec_rt.types import Stats

__all__ = ["measure_acceptance", "depth_table"]


def depth_table(position_drafted: list[int], position_accepted: list[int]) -> list[float]:
    """Conditional acceptance at depth i: accepted at i / accepted at i-1 (drafted at i)."""
    out: list[float] = []
    for i, (d, a) in enumerate(zip(position_drafted, position_accepted)):
        prev = position_accepted[i - 1] if i else d
        out.append(a / prev if prev and d else float("nan"))
    return out


Prompt = str | list[dict[str, Any]]  # plain text or chat messages


def measure_acceptance(
    target_dir: Path,
    draft_dir: Path,
    prompts: list[Prompt],
    *,
    k: int = 4,
    max_new_tokens: int = 64,
    threads: int | None = None,
) -> dict[str, Any]:
    """Run every prompt with a fixed draft length ``k`` (no fallback) and return
    ``{"per_depth": [k], "mean_accepted": float, "tokens_per_call": float, "acceptance": float,
    "exact": bool}``; ``exact`` compares the output with plain greedy decoding."""
    import anyio

    from specdec_rt.ort import load_manifest
    from specdec_rt.text.codec import TextCodec

    manifest = load_manifest(target_dir)
    codec = TextCodec.from_manifest(manifest)
    spec, plain = _schedulers(manifest, load_manifest(draft_dir), k=k, threads=threads)

    async def main() -> tuple[Stats, bool]:
        return await _run_prompts(spec, plain, [codec.encode_prompt(p) for p in prompts], max_new_tokens)

    total, exact = anyio.run(main)
    return _summary(total, exact, k=k, prompts=len(prompts))


def _schedulers(
    target_manifest: Manifest, draft_manifest: Manifest, *, k: int, threads: int | None
) -> tuple[SpecDecScheduler, SpecDecScheduler]:
    """(speculative scheduler with the draft at fixed length ``k``, plain greedy scheduler),
    both over one ONNX Runtime target."""
    from specdec_rt.engine.factory import model_drafter
    from specdec_rt.ort import OrtModel, OrtTargetVerifier
    from specdec_rt.policy.config import SpecConfig
    from specdec_rt.speculation.scheduler import SpecDecScheduler

    target = OrtModel(target_manifest, threads=threads, slots=1, max_length=2048)
    drafter = model_drafter(target_manifest, draft_manifest, threads=threads, slots=1, max_length=2048)
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
    eos = target_manifest.eos_ids
    spec = SpecDecScheduler(drafter, verifier, cfg, eos_ids=eos)
    plain = SpecDecScheduler(None, OrtTargetVerifier(target), cfg, eos_ids=eos)
    return spec, plain


async def _run_prompts(
    spec: SpecDecScheduler, plain: SpecDecScheduler, prompt_ids: list[list[int]], max_new_tokens: int
) -> tuple[Stats, bool]:
    """Merged speculative stats over all prompts, and whether every output equals plain greedy."""
    from specdec_rt.types import Stats

    total, exact = Stats(), True
    for ids in prompt_ids:
        drafted = await spec.run(ids, max_new_tokens, mode="spec")
        greedy = await plain.run(ids, max_new_tokens, mode="ar")
        exact &= drafted.token_ids == greedy.token_ids
        total.merge(drafted.stats)
    return total, exact


def _summary(total: Stats, exact: bool, *, k: int, prompts: int) -> dict[str, Any]:
    per_depth = depth_table(total.position_drafted, total.position_accepted)
    calls = total.rounds + total.ar_steps
    return {
        "per_depth": [round(x, 4) for x in per_depth[:k]],
        "acceptance": round(total.accepted / max(total.drafted, 1), 4),
        "mean_accepted": round(total.accepted / max(total.rounds, 1), 3),
        "tokens_per_call": round(total.new_tokens / max(calls, 1), 3),
        "prompts": prompts,
        "k": k,
        "exact": bool(exact),
    }
