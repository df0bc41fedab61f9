"""The engine's factory: an export folder and a draft spec (``"ngram+q8"``, a folder, ``"none"``)
to ONNX Runtime models, a drafter, a text codec and one step loop for them all.

The only module above :mod:`specdec_rt.ort` that knows it (tests/test_layers.py): the Engine
itself runs any :class:`~specdec_rt.spec.protocols.LanguageModel`. Shared by
:class:`~specdec_rt.engine.engine.Engine.load`, the benchmarks and ``export train-draft``'s
evaluation, so a draft spec means the same everywhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..batching import BatchExecutor
from ..drafters import CombinedDrafter, NgramDrafter
from ..errors import ModelLoadError
from ..manifest_schema import MANIFEST
from ..ort import (
    Manifest,
    OrtDraftInferrer,
    OrtModel,
    OrtTargetVerifier,
    load_manifest,
    resolve_model_dir,
    use_global_thread_pool,
)
from ..ort.eagle import EagleDrafter
from ..spec.adapters import ModelDrafter
from ..spec.protocols import DraftInferrer, TargetVerifier
from ..text.codec import TextCodec

__all__ = [
    "DEFAULT_DRAFT",
    "resolve_draft_spec",
    "model_drafter",
    "make_drafter",
    "engine_models",
    "EngineParts",
    "build_parts",
    "resolve_model_dir",
    "use_global_thread_pool",
]  # the last two: ort's, for the layers above

# The drafter when Engine.load gets draft=None: n-gram lookup plus the recipe's first draft
# (docs/decisions/0008-default-draft-q8.md).
DEFAULT_DRAFT = "ngram+model"


def resolve_draft_spec(m, spec: str | None) -> str:
    """The concrete draft spec for a manifest: ``None`` means ``DEFAULT_DRAFT``, and ``"model"``
    the manifest's first draft (or, when it lists none, n-gram lookup alone)."""
    spec = DEFAULT_DRAFT if spec is None else str(spec)
    combined = spec.startswith("ngram+")
    model_spec = spec[len("ngram+") :] if combined else spec
    if model_spec in ("", "model"):
        if not m.drafts:
            return "ngram"
        model_spec = m.drafts[0]["name"]
    return f"ngram+{model_spec}" if combined else model_spec


def model_drafter(m, dm, **opts) -> OrtDraftInferrer | EagleDrafter:
    """The drafter for draft folder ``dm`` of target ``m`` (both manifests): an
    :class:`~specdec_rt.ort.eagle.EagleDrafter` for ``"kind": "eagle"``, else a draft model run by
    ONNX Runtime. Checks that it shares the target's tokenizer and vocabulary. ``opts``:
    :class:`OrtModel` options."""
    if m.tokenizer_sha256 and dm.tokenizer_sha256 and dm.tokenizer_sha256 != m.tokenizer_sha256:
        raise ModelLoadError(
            f"{dm.folder}: its tokenizer differs from the target's ({m.folder}); "
            "a draft must share the target's vocabulary"
        )
    if dm.raw.get("kind") == "eagle":
        # the head is fed the target's hidden states and never starts from a cached prefix: the
        # target's cache keeps those states instead
        drafter = EagleDrafter(OrtModel(dm, **{**opts, "prefix_cache_bytes": 0}))  # checks its vocabulary map
        if drafter.target_vocab_size != m.vocab_size:
            raise ModelLoadError(
                f"{dm.folder}: drafts for a vocabulary of {drafter.target_vocab_size}, the target has {m.vocab_size}"
            )
        return drafter
    if dm.vocab_size != m.vocab_size:
        raise ModelLoadError(f"{dm.folder}: vocab_size {dm.vocab_size} != the target's {m.vocab_size}")
    return OrtDraftInferrer(OrtModel(dm, **opts))


def make_drafter(m, spec: str, opts: dict) -> tuple[DraftInferrer | None, str | None]:
    """A drafter from a draft spec: ``"none"``, ``"ngram"``, a model draft (a name from the
    manifest or a folder; ``"model"`` is the manifest's first), or ``"ngram+<model draft>"``."""
    spec = resolve_draft_spec(m, spec)
    if spec == "none":
        return None, None
    if spec == "ngram":
        return NgramDrafter(), "ngram"
    combined = spec.startswith("ngram+")
    model_spec = spec[len("ngram+") :] if combined else spec
    path = Path(model_spec).expanduser()
    named = any(d.get("name") == model_spec for d in m.drafts)  # the manifest's name wins over ./<name>
    if not named and (path / MANIFEST).is_file():
        draft_dir = path
    elif not named and (any(c in model_spec for c in "/\\") or model_spec.startswith(("~", "."))):  # a folder
        raise ModelLoadError(f"{path}: not a draft folder (no manifest.json in it); build one with python -m export")
    else:
        draft_dir = m.draft_dir(model_spec)
    dm = load_manifest(draft_dir)
    model = model_drafter(m, dm, **opts)
    if combined:
        return CombinedDrafter(NgramDrafter(), model), f"ngram+{dm.name}"
    return model, dm.name


def engine_models(target, drafter) -> list:
    """The models of an engine: its target, then the models its drafter runs (a draft model, a
    combined drafter's model, an EAGLE head)."""
    found = [target]
    for part in _drafter_parts(drafter):
        if isinstance(part, (ModelDrafter, EagleDrafter)) and part.model not in found:
            found.append(part.model)
    return found


def _drafter_parts(drafter) -> list:
    if isinstance(drafter, CombinedDrafter):
        return [drafter.ngram, *_drafter_parts(drafter.model)]
    return [] if drafter is None else [drafter]


@dataclass
class EngineParts:
    """What :meth:`Engine.load` builds from an export folder, every model on one step loop."""

    manifest: Manifest
    target: OrtModel
    verifier: TargetVerifier
    drafter: DraftInferrer | None
    draft_name: str | None
    models: list  # [OrtModel]: the target first, then the draft's (closed with the engine)
    executor: BatchExecutor
    codec: TextCodec


def build_parts(
    name_or_path: str | os.PathLike,
    draft,
    *,
    max_length: int | None,
    threads: int | None,
    provider: str,
    slots: int,
    prefix_cache_bytes: int,
) -> EngineParts:
    """Load a built recipe or an export folder with its drafter (``draft``: a draft spec), all
    models built with one :class:`BatchExecutor`; ``prefix_cache_bytes`` is shared among them in
    proportion to their KV bytes per token, so every model caches as many tokens."""
    m = load_manifest(resolve_model_dir(name_or_path))
    executor = BatchExecutor()
    opts: dict[str, Any] = dict(
        max_length=max_length,
        threads=threads,
        provider=provider,
        slots=slots,
        prefix_cache_bytes=prefix_cache_bytes,
        executor=executor,
    )
    alone = resolve_draft_spec(m, draft) in ("ngram", "none")  # no draft model beside the target
    target = OrtModel(m, **opts, alone=alone)
    drafter, draft_name = make_drafter(m, draft, opts)
    models = engine_models(target, drafter)
    caching = [mod for mod in models if mod.caches_prefixes]
    for mod in caching:
        mod.prefix_cache.budget_bytes = (
            prefix_cache_bytes * mod.pool.token_bytes // sum(x.pool.token_bytes for x in caching)
        )
    verifier = OrtTargetVerifier(target, share_hidden=drafter is not None and drafter.needs_target_hidden)
    executor.lead = {id(mod) for mod in models[1:]}  # draft steps first: a batch drafts, then verifies, together
    return EngineParts(m, target, verifier, drafter, draft_name, models, executor, TextCodec.from_manifest(m))
