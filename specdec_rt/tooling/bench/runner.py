"""The side-by-side benchmark: every mode on every prompt, interleaved, medians and ratios."""

from __future__ import annotations

import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Sequence

from ...drafters import CombinedDrafter, NgramDrafter
from ...engine.factory import as_target, model_drafter, resolve_draft_spec
from ...errors import InvalidInputError
from ...ort import OrtModel, OrtTargetVerifier, default_threads, load_manifest, resolve_model_dir
from ...policy.config import SpecConfig
from ...policy.figures import cost_figures
from ...speculation.protocols import DraftInferrer
from ...speculation.scheduler import SpecDecScheduler
from ...text.codec import TextCodec
from ...types import Stats
from ..prompt_files import label, read_prompt_file

if TYPE_CHECKING:
    from ...ort import OrtDraftInferrer
    from ...ort.eagle import EagleDrafter
    from ...ort.manifest import Manifest

__all__ = ["Prompt", "Sample", "load_prompts", "build_our_modes", "run_modes"]

HF_MODES = ("hf_ar", "hf_assisted", "hf_prompt_lookup", "optimum_ar")


@dataclass
class Prompt:
    category: str
    ids: list[int]
    label: str


@dataclass(kw_only=True)
class Sample:
    mode: str
    prompt: int
    category: str
    token_ids: list[int]
    seconds: float
    stats: Stats | None = None
    extra: dict[str, Any] | None = None  # a runner's own details; ``extra["tokens"]``: the count it made
    repeat: int = 0  # which pass over the prompts (ratios pair the modes' runs of one pass)

    @property
    def tokens_per_s(self) -> float:
        n = self.extra["tokens"] if self.extra and "tokens" in self.extra else len(self.token_ids)
        return n / self.seconds if self.seconds > 0 else 0.0


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def load_prompts(
    codec: TextCodec, path: str | None, categories: set[str] | None = None, limit: int | None = None
) -> list[Prompt]:
    """The built-in prompts, or a JSONL file (:func:`read_prompt_file`), encoded; ``categories``
    keeps those (an unknown one is an error listing the file's)."""
    rows = read_prompt_file(path)
    if categories and not categories & {r["category"] for r in rows}:
        raise InvalidInputError(
            f"no prompts of categories {sorted(categories)}; the file has {sorted({r['category'] for r in rows})}"
        )
    out = []
    for r in rows:
        if categories and r["category"] not in categories:
            continue
        out.append(Prompt(r["category"], codec.encode_prompt(r["text"]), label(r["text"]).replace("\n", " ")[:48]))
    return out[:limit] if limit else out


# -> (ids, seconds, stats) or (ids, seconds, stats, extra): see Sample.extra (llama.cpp runs)
Runner = Callable[[list[int], int], Awaitable[tuple[Any, ...]]]


BENCH_TREE_NODES = 3  # the tree modes: main chain + the draft's runner-up at the first 3 depths


def build_our_modes(
    folder: Path, threads: int, max_length: int | None, extra_drafts: Sequence[str | Path] = ()
) -> tuple[dict[str, Runner], dict[str, Any]]:
    """Our modes over one shared target: ``ar``, ``spec`` (the engine's default drafter),
    ``spec_ngram``, ``spec_<draft>`` per exported draft (and per folder in ``extra_drafts``, e.g.
    a ``train-draft`` output), ``spec_ngram+<draft>`` for the first draft and for EAGLE drafts;
    with a target that verifies trees, ``spec_tree`` and ``spec_<draft>_tree`` (draft trees)."""
    manifest = as_target(load_manifest(folder))  # a draft folder as the model is a target here
    alone = not manifest.drafts and not extra_drafts  # no draft model beside it, as in an Engine
    target = OrtModel(manifest, max_length=max_length, threads=threads, slots=2, alone=alone)
    verifier = OrtTargetVerifier(target)
    sharing = OrtTargetVerifier(target, share_hidden=True)  # same model; for EAGLE drafts only
    drafts = _draft_models(folder, manifest, extra_drafts, max_length=max_length, threads=threads)
    drafters: dict[str, DraftInferrer] = {"ngram": NgramDrafter()}
    drafters.update(drafts)
    for index, (name, draft) in enumerate(drafts.items()):
        if index == 0 or draft.needs_target_hidden:
            drafters[f"ngram+{name}"] = CombinedDrafter(NgramDrafter(), draft)
    default = resolve_draft_spec(manifest, None)

    def runner(drafter: DraftInferrer | None, config: SpecConfig | None = None) -> _SchedulerRunner:
        chosen = sharing if drafter is not None and drafter.needs_target_hidden else verifier
        mode = "ar" if drafter is None else "spec"
        return _SchedulerRunner(SpecDecScheduler(drafter, chosen, config, eos_ids=manifest.eos_ids), mode)

    modes: dict[str, Runner] = {"ar": runner(None), "spec": runner(drafters[default])}
    modes.update({f"spec_{name}": runner(drafter) for name, drafter in drafters.items()})
    if target.tree:  # the same drafters with draft trees (each model draft's runner-up as siblings)
        trees = SpecConfig(tree_nodes=BENCH_TREE_NODES)
        for name in dict.fromkeys([default, *drafts, *(n for n in drafters if n.startswith("ngram+"))]):
            if name == "ngram":
                continue
            modes["spec_tree" if name == default else f"spec_{name}_tree"] = runner(drafters[name], trees)
    info = {
        "target": manifest.name,
        "exact_to": manifest.exact_to,
        "default_drafter": default,
        "drafts": {n: draft.model.manifest.raw.get("onnx", {}).get("quantization") for n, draft in drafts.items()},
        "threads": threads,
        "provider": target.device,
    }
    return modes, {
        "manifest": manifest,
        "target": target,
        "info": info,
        "draft_models": [draft.model for draft in drafts.values()],
        "draft_manifest": next(
            (draft.model.manifest for draft in drafts.values() if not draft.needs_target_hidden), None
        ),
    }


def _draft_models(
    folder: Path, manifest: Manifest, extra_drafts: Sequence[str | Path], *, max_length: int | None, threads: int
) -> dict[str, OrtDraftInferrer | EagleDrafter]:
    """The drafters of the folder's draft models and of ``extra_drafts``, by name."""
    manifests = [load_manifest(folder / draft["path"]) for draft in manifest.drafts]
    manifests += [load_manifest(Path(p)) for p in extra_drafts]
    return {dm.name: model_drafter(manifest, dm, max_length=max_length, threads=threads, slots=2) for dm in manifests}


class _SchedulerRunner:
    """A :data:`Runner` over one of our schedulers in ``mode``; ``scheduler``: run_modes' warm-up
    forgets the times of its first request."""

    def __init__(self, scheduler: SpecDecScheduler, mode: str) -> None:
        self.scheduler, self.mode = scheduler, mode

    async def __call__(self, ids: list[int], n: int) -> tuple[Any, ...]:
        t = time.perf_counter()
        res = await self.scheduler.run(ids, n, mode=self.mode)
        seconds = time.perf_counter() - t
        if res.stats is None or not res.stats.drafted:
            return res.token_ids, seconds, res.stats
        # the costs the scheduler measured so far, this request's rounds included
        costs = cost_figures(self.scheduler.costs, self.scheduler.config.k_max)
        return res.token_ids, seconds, res.stats, {"costs": costs}


async def run_modes(modes: dict[str, Runner], prompts: list[Prompt], n: int, repeats: int = 1) -> list[Sample]:
    """Each prompt through every mode, the mode order rotated per prompt so that no mode always
    runs first (warm caches) or last; one warm-up run per mode first (two for our schedulers: the
    first one's times, which paid for first calls, are forgotten)."""
    names = list(modes)
    for name in names:  # warm-up: allocations, thread pools, cost measurements
        await modes[name](prompts[0].ids, min(8, n))
        runner = modes[name]
        if isinstance(runner, _SchedulerRunner):  # that first request paid for first calls: its times
            runner.scheduler.costs.forget_times()  # are not the costs (as in Engine.load's warm-up)
            await modes[name](prompts[0].ids, min(8, n))
    samples = []
    total = len(prompts) * len(names) * repeats
    done = 0
    for r in range(repeats):
        for i, p in enumerate(prompts):
            shift = (i + r) % len(names)
            for name in names[shift:] + names[:shift]:
                ids, secs, stats, *extra = await modes[name](p.ids, n)
                samples.append(
                    Sample(
                        mode=name,
                        prompt=i,
                        category=p.category,
                        token_ids=ids,
                        seconds=secs,
                        stats=stats,
                        extra=extra[0] if extra else None,
                        repeat=r,
                    )
                )
                done += 1
                log(
                    f"{done}/{total} [{p.category}] {p.label!r:.40} {name}: "
                    f"{samples[-1].tokens_per_s:.1f} tok/s"
                    + (f", acceptance {stats.acceptance_rate:.2f}" if stats and stats.drafted else "")
                )
    return samples


def machine_info(threads: int) -> dict[str, Any]:
    """What a report's figures depend on: the CPU (model name and the instruction-set flags
    kernels choose from: every table names its machine), the platform, the threads."""
    from ...engine.tune_cache import cpu_facts

    facts = cpu_facts()
    return {
        "cpu": facts["cpu"],
        "isa": facts["isa"],
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "threads": threads,
        "cpus": default_threads(),
    }


__all__ += ["HF_MODES", "machine_info", "resolve_model_dir", "log"]
