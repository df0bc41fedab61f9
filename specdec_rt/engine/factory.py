"""The engine's factory: an export folder and a draft spec (``"ngram+q8"``, a folder, ``"none"``)
to ONNX Runtime models, a drafter, a text codec and one step loop for them all.

The only module above :mod:`specdec_rt.ort` that knows it (tests/test_layers.py): the Engine
itself runs any :class:`~specdec_rt.speculation.protocols.LanguageModel`. Shared by
:class:`~specdec_rt.engine.engine.Engine.load`, the benchmarks and ``export train-draft``'s
evaluation, so a draft spec means the same everywhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

from ..batching import BatchExecutor
from ..drafters import CombinedDrafter, NgramDrafter
from ..errors import InvalidInputError, ModelLoadError
from ..kvcache.prefix import DEFAULT_BUDGET_BYTES
from ..manifest_schema import MANIFEST
from ..ort import (
    Manifest,
    OrtDraftInferrer,
    OrtModel,
    OrtTargetVerifier,
    RuntimeModel,
    default_threads,
    load_manifest,
    open_model,
    resolve_model_dir,
    use_global_thread_pool,
)
from ..ort.eagle import EagleDrafter
from ..ort.manifest import cache_root
from ..ort.setup import ISA_FLAGS, cpu_facts
from ..policy.config import SpecConfig
from ..speculation.adapters import ModelDrafter
from ..speculation.protocols import DraftInferrer, TargetVerifier
from ..text.codec import TextCodec
from ..text.vocab_match import vocabulary_mismatch
from .precision import PINNED_PRECISIONS
from .served import DEFAULT_CONSUMER_TIMEOUT, DEFAULT_SLOTS

__all__ = [
    "DEFAULT_DRAFT",
    "LoadOptions",
    "DEFAULT_LOAD",
    "PINNED_PRECISIONS",
    "TargetCandidate",
    "target_candidates",
    "pick_target",
    "cheaper_drafts",
    "draft_costs",
    "home_manifest",
    "runtime_facts",
    "cache_root",
    "as_target",
    "resolve_draft_spec",
    "model_drafter",
    "make_drafter",
    "engine_models",
    "EngineParts",
    "build_parts",
    "resolve_model_dir",
    "use_global_thread_pool",
    "ISA_FLAGS",
    "cpu_facts",
]  # cache_root, resolve_model_dir, use_global_thread_pool, ISA_FLAGS, cpu_facts: ort's, for the layers above

# The drafter when Engine.load gets draft=None: n-gram lookup plus the recipe's first draft
# (docs/decisions/0008-default-draft-q8.md).
DEFAULT_DRAFT = "ngram+model"


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How :meth:`Engine.load <specdec_rt.engine.engine.Engine.load>` loads an export folder:
    its keywords, with the library's defaults (:data:`DEFAULT_LOAD`). Checked when loaded
    (``check_load_args`` and the engine's own checks), not here."""

    draft: str | os.PathLike[str] | None = None  # None: DEFAULT_DRAFT
    max_length: int | None = None
    threads: int | None = None
    provider: str = "auto"
    slots: int = DEFAULT_SLOTS
    spec_config: SpecConfig | None = None
    prefix_cache: bool = True
    prefix_cache_bytes: int = DEFAULT_BUDGET_BYTES
    warmup: bool = True
    consumer_timeout: float | None = DEFAULT_CONSUMER_TIMEOUT
    precision: str = "exported"
    shared_weights: bool = True  # map a prepacked copy of each graph (ort.prepack): processes share it

    @property
    def cache_bytes(self) -> int:
        """The prefix cache's KV budget over all models: 0 when the cache is off."""
        return self.prefix_cache_bytes if self.prefix_cache else 0


DEFAULT_LOAD = LoadOptions()  #: the defaults of Engine.load's keywords


# MatMulNBits accuracy levels: the type activations are quantized to in the CPU kernel
_ACTIVATIONS = {0: "float32", 1: "float32", 2: "float16", 3: "bfloat16", 4: "int8"}
DRAFT_COST_RATIO = 0.5  # a promoted target's default draft reads at most half its weight bytes


def _model_shape(m: Manifest) -> tuple[int, ...]:
    """What a quantized copy of the same model shares with it."""
    return (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, m.vocab_size)


@dataclass(frozen=True)
class TargetCandidate:
    """A model of an export folder that can serve as its target: the folder's own target, or a
    quantized copy of it listed among its drafts, promoted (loaded as a target: a quantized
    target's exactness measures, ``OrtModel.lone_twice`` / ``pad_lone``, key on ``role``)."""

    precision: str  # "float32", "int8", "int4" (weights)
    activations: str  # what the MatMuls quantize activations to: "float32" unless int8 (accuracy level 4)
    manifest: Manifest  # as loaded for the target: role "target", the folder's name
    draft_name: str | None  # the draft entry it comes from; None: the folder's own target
    weight_bytes: int  # its graph and weight files: what a step reads, the cost order of drafts

    @property
    def exact_to(self) -> str:
        """What greedy output is exact to, in words."""
        if self.precision == "float32" and self.activations == "float32":
            return "greedy output is exact to the float32 target"
        return (
            f"greedy output is exact to the {self.precision} target "
            f"({self.precision} weights, {self.activations} activations)"
        )


def _precision(m: Manifest) -> tuple[str, str]:
    """(weights, activations) of a model from its ``onnx.quantization``."""
    q = m.quantization or {}
    bits = q.get("bits")
    if not q or type(bits) is not int:
        dtype = m.raw.get("onnx", {}).get("dtype")
        kind = dtype if isinstance(dtype, str) and dtype.isidentifier() and len(dtype) < 16 else "float32"
        return kind, kind
    level = q.get("accuracy_level", 0)
    return f"int{bits}", _ACTIVATIONS.get(level if type(level) is int else 0, "float32")


def _weight_bytes(m: Manifest) -> int:
    """Bytes of the graph and its weights: the files the manifest lists as model.onnx*, else the
    graph file's own size."""
    listed = m.raw.get("files") or {}
    sizes = [
        info.get("bytes", 0)
        for name, info in listed.items()
        if isinstance(name, str) and ".onnx" in name and isinstance(info, dict) and type(info.get("bytes")) is int
    ]
    return sum(sizes) if sizes else m.onnx_file.stat().st_size


def target_candidates(home: Manifest) -> list[TargetCandidate]:
    """The folder's own target first, then each draft that is a quantized copy of the same model
    (same architecture and tokenizer; not an EAGLE head) and of a precision not offered yet."""
    found = [_own(home)]
    for d in home.drafts:
        try:
            dm = load_manifest(home.path(d["path"], "drafts.path"))
        except ModelLoadError:
            continue  # a broken draft folder is reported when it is loaded as a draft
        same = _model_shape(dm) == _model_shape(home)
        if dm.raw.get("kind") == "eagle" or not same or not dm.quantization:
            continue
        if home.tokenizer_sha256 and dm.tokenizer_sha256 != home.tokenizer_sha256:
            continue
        weights, acts = _precision(dm)
        if weights in {c.precision for c in found}:
            continue
        promoted = replace(dm, role="target", name=home.name, drafts=())
        found.append(TargetCandidate(weights, acts, promoted, d["name"], _weight_bytes(dm)))
    return found


def as_target(m: Manifest) -> Manifest:
    """``m`` as loaded to serve as a target: a draft folder loaded as the model (``--model
    .../draft-q8``) gets a target's exactness measures too (``OrtModel.lone_twice`` /
    ``pad_lone`` key on ``role``)."""
    return m if m.role == "target" else replace(m, role="target")


def _own(home: Manifest) -> TargetCandidate:
    weights, acts = _precision(home)
    return TargetCandidate(weights, acts, as_target(home), None, _weight_bytes(home))


def pick_target(home: Manifest, precision: str) -> TargetCandidate:
    """The candidate target of ``precision`` (``"exported"``: the folder's own target); else an
    :class:`InvalidInputError` naming the value and what the folder offers."""
    if precision == "exported":
        return _own(home)  # (its drafts' folders are not read for it)
    found = target_candidates(home)
    for c in found:  # (a folder's own target may be of a precision no one pins, float16: tune names it)
        if c.precision == precision:
            return c
    if precision not in PINNED_PRECISIONS:
        raise InvalidInputError(
            f"precision must be 'auto', 'exported' or one of {', '.join(PINNED_PRECISIONS)}, got {precision!r}"
        )
    offered = ", ".join(c.precision + (" (exported)" if c.draft_name is None else "") for c in found)
    raise InvalidInputError(f"{home.folder}: no {precision} target in this folder; it offers {offered}")


def draft_costs(home: Manifest) -> dict[str, int]:
    """Weight bytes of each of the folder's draft models that loads, by name (manifest order)."""
    costs = {}
    for d in home.drafts:
        try:
            costs[d["name"]] = _weight_bytes(load_manifest(home.path(d["path"], "drafts.path")))
        except ModelLoadError:
            continue  # reported when it is loaded as a draft
    return costs


def cheaper_drafts(home: Manifest, target: TargetCandidate, every: bool = True) -> list[str]:
    """Names of the folder's draft models (EAGLE heads included) that read at most
    :data:`DRAFT_COST_RATIO` of ``target``'s weight bytes per step, in the manifest's order
    (a draft that costs more rarely pays: its steps eat what acceptance saves). ``every``: for
    the folder's own target, every draft (the recipe's choice, as before)."""
    if target.draft_name is None and every:
        return [d["name"] for d in home.drafts]
    return [
        n
        for n, b in draft_costs(home).items()
        if n != target.draft_name and b <= DRAFT_COST_RATIO * target.weight_bytes
    ]


def home_manifest(name_or_path: str | os.PathLike[str]) -> Manifest:
    """The checked manifest of a built recipe or an export folder."""
    return load_manifest(resolve_model_dir(name_or_path))


def runtime_facts(threads: int | None) -> dict[str, Any]:
    """What a speed measurement depends on besides the CPU and the model: ONNX Runtime's version
    and providers, and the intra-op threads a model gets (the CLI's shared pool has as many)."""
    import onnxruntime as ort

    return {
        "onnxruntime": ort.__version__,
        "providers": list(ort.get_available_providers()),
        "threads": threads or default_threads(),
    }


def resolve_draft_spec(m: Manifest, spec: str | None) -> str:
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


def model_drafter(m: Manifest, dm: Manifest, **opts: Any) -> OrtDraftInferrer | EagleDrafter:
    """The drafter for draft folder ``dm`` of target ``m`` (both manifests): an
    :class:`~specdec_rt.ort.eagle.EagleDrafter` for ``"kind": "eagle"``, else a draft model run by
    ONNX Runtime. Checks that it shares the target's tokenizer and vocabulary. ``opts``:
    :class:`OrtModel` options."""
    if m.tokenizer_sha256 and dm.tokenizer_sha256 and dm.tokenizer_sha256 != m.tokenizer_sha256:
        check_draft_tokenizer(m, dm)
    if dm.raw.get("kind") == "eagle":
        # the head is fed the target's hidden states and never starts from a cached prefix: the
        # target's cache keeps those states instead
        drafter = EagleDrafter(OrtModel(dm, **{**opts, "prefix_cache_bytes": 0}))  # checks its vocabulary map
        if drafter.target_vocab_size != m.vocab_size:
            raise ModelLoadError(
                f"{dm.folder}: drafts for a vocabulary of {drafter.target_vocab_size}, the target has {m.vocab_size}"
            )
        return drafter
    if dm.vocab_size > m.vocab_size:
        raise ModelLoadError(
            f"{dm.folder}: vocab_size {dm.vocab_size} > the target's {m.vocab_size} (it could propose ids the target lacks)"
        )
    model_draft = OrtDraftInferrer(open_model(dm, **opts))
    if dm.vocab_size < m.vocab_size:  # a padded target (e.g. 152064 rows against the draft's 151936)
        model_draft.widen(m.vocab_size)
    return model_draft


def check_draft_tokenizer(m: Manifest, dm: Manifest) -> None:
    """Refuse draft ``dm`` of target ``m`` when its tokenizer file gives an id another meaning
    than the target's (the rule of :mod:`specdec_rt.text.vocab_match`: ordinary tokens and merges
    the same, special tokens' texts may differ)."""
    try:
        why = vocabulary_mismatch(m.tokenizer_file.read_text("utf-8"), dm.tokenizer_file.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError) as exc:
        why = f"unreadable tokenizer.json ({type(exc).__name__}: {str(exc)[:200]})"
    if why is not None:
        raise ModelLoadError(
            f"{dm.folder}: its tokenizer differs from the target's ({m.folder}): {why}; "
            "a draft must share the target's vocabulary"
        )


def make_drafter(m: Manifest, spec: str | None, opts: dict[str, Any]) -> tuple[DraftInferrer | None, str | None]:
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
    label = None  # a folder is named as it was given: its manifest's name ("q4") would read as this folder's own
    if not named and (path / MANIFEST).is_file():
        draft_dir, label = path, model_spec
    elif not named and (any(c in model_spec for c in "/\\") or model_spec.startswith(("~", "."))):  # a folder
        raise ModelLoadError(f"{path}: not a draft folder (no manifest.json in it); build one with python -m export")
    else:
        listed = m.draft_dir(model_spec)
        if listed is None:
            raise ModelLoadError(f"{m.folder}: no draft named {model_spec!r}; this model lists no drafts")
        draft_dir = listed
    dm = load_manifest(draft_dir)
    model = model_drafter(m, dm, **opts)
    label = label or dm.name
    if combined:
        return CombinedDrafter(NgramDrafter(), model), f"ngram+{label}"
    return model, label


def engine_models(target: RuntimeModel, drafter: DraftInferrer | None) -> list[RuntimeModel]:
    """The models of an engine: its target, then the models its drafter runs (a draft model, a
    combined drafter's model, an EAGLE head), all ONNX Runtime models as the factory builds them."""
    found = [target]
    for part in _drafter_parts(drafter):
        if isinstance(part, (ModelDrafter, EagleDrafter)) and part.model not in found:
            found.append(cast(RuntimeModel, part.model))
    return found


def _drafter_parts(drafter: DraftInferrer | None) -> list[DraftInferrer]:
    if isinstance(drafter, CombinedDrafter):
        return [drafter.ngram, *_drafter_parts(drafter.model)]
    return [] if drafter is None else [drafter]


@dataclass
class EngineParts:
    """What :meth:`Engine.load` builds from an export folder, every model on one step loop."""

    manifest: Manifest  # the target's (a promoted draft's: under the folder's name)
    target: RuntimeModel  # a ConcatKVModel for a folder built through optimum
    verifier: TargetVerifier
    drafter: DraftInferrer | None
    draft_name: str | None
    models: list[Any]  # [OrtModel]: the target first, then the draft's (closed with the engine)
    executor: BatchExecutor
    codec: TextCodec
    candidate: TargetCandidate  # which of the folder's targets was loaded


def build_parts(name_or_path: str | os.PathLike[str], options: LoadOptions) -> EngineParts:
    """Load a built recipe or an export folder with its drafter (``options.draft``: a draft
    spec), all models built with one :class:`BatchExecutor`; the prefix cache's budget is shared
    among them in proportion to their KV bytes per token, so every model caches as many tokens.

    ``options.precision``: ``"exported"`` (the folder's own target) or a pinned one (``"int8"``,
    ...): a quantized copy among the folder's drafts, loaded as the target (:func:`pick_target`).
    Its default draft is the folder's first draft that is cheaper than it (else n-gram lookup);
    draft names still resolve among all the folder's drafts."""
    home = load_manifest(resolve_model_dir(name_or_path))
    candidate = pick_target(home, options.precision)
    draft = None if options.draft is None else str(options.draft)
    if candidate.draft_name is not None:  # "model" means the first cheaper draft
        draft = resolve_draft_spec(replace(home, drafts=_named(home, cheaper_drafts(home, candidate))), draft)
    executor = BatchExecutor()
    opts: dict[str, Any] = dict(
        max_length=options.max_length,
        threads=options.threads,
        provider=options.provider,
        slots=options.slots,
        prefix_cache_bytes=options.cache_bytes,
        executor=executor,
        shared_weights=options.shared_weights,
    )
    alone = resolve_draft_spec(home, draft) in ("ngram", "none")  # no draft model beside the target
    target = open_model(candidate.manifest, **opts, alone=alone)  # by the manifest's builder
    drafter, draft_name = make_drafter(home, draft, opts)  # (a promoted target shares home's vocabulary)
    models = engine_models(target, drafter)
    _share_cache_budget(models, options.cache_bytes)
    verifier = OrtTargetVerifier(target, share_hidden=drafter is not None and drafter.needs_target_hidden)
    executor.lead = {id(mod) for mod in models[1:]}  # draft steps first: a batch drafts, then verifies, together
    return EngineParts(
        manifest=candidate.manifest,
        target=target,
        verifier=verifier,
        drafter=drafter,
        draft_name=draft_name,
        models=models,
        executor=executor,
        codec=TextCodec.from_manifest(home),
        candidate=candidate,
    )


def _share_cache_budget(models: list[RuntimeModel], budget: int) -> None:
    """Split ``budget`` bytes among the models that cache prefixes, in proportion to their KV
    bytes per token (a ConcatKVModel caches none)."""
    caching = [mod for mod in models if isinstance(mod, OrtModel) and mod.caches_prefixes]
    for mod in caching:
        per_token = sum(x.open_pool().token_bytes for x in caching)
        mod.prefix_cache.budget_bytes = budget * mod.open_pool().token_bytes // per_token


def _named(home: Manifest, names: list[str]) -> tuple[dict[str, Any], ...]:
    return tuple(d for d in home.drafts if d["name"] in names)
