"""Which drafter an engine gets: draft specs (``"ngram+q8"``, a folder, ``"none"``) to drafters.

Shared by :class:`~specdec_rt.engine.engine.Engine`, the benchmarks and ``export train-draft``'s
evaluation, so a draft spec means the same everywhere.
"""

from __future__ import annotations

from pathlib import Path

from ..drafters.lookup import CombinedDrafter, NgramDrafter
from ..errors import ModelLoadError
from ..ort import OrtDraftInferrer, OrtModel, load_manifest
from ..spec.protocols import DraftInferrer

__all__ = ["DEFAULT_DRAFT", "resolve_draft_spec", "model_drafter", "make_drafter", "engine_models"]

# The drafter when Engine.load gets draft=None: n-gram lookup plus the recipe's first draft
# (docs/decisions/0008-default-draft-q8.md).
DEFAULT_DRAFT = "ngram+model"


def resolve_draft_spec(m, spec: str | None) -> str:
    """The concrete draft spec for a manifest: ``None`` means ``DEFAULT_DRAFT``, and ``"model"``
    the manifest's first draft (or, when it lists none, n-gram lookup alone)."""
    spec = DEFAULT_DRAFT if spec is None else str(spec)
    combined = spec.startswith("ngram+")
    model_spec = spec[len("ngram+"):] if combined else spec
    if model_spec in ("", "model"):
        if not m.drafts:
            return "ngram"
        model_spec = m.drafts[0]["name"]
    return f"ngram+{model_spec}" if combined else model_spec


def model_drafter(m, dm, **opts) -> DraftInferrer:
    """The drafter for draft folder ``dm`` of target ``m`` (both manifests): an
    :class:`~specdec_rt.ort.eagle.EagleDrafter` for ``"kind": "eagle"``, else a draft model run by
    ONNX Runtime. Checks that it shares the target's tokenizer and vocabulary. ``opts``:
    :class:`OrtModel` options."""
    if m.tokenizer_sha256 and dm.tokenizer_sha256 and dm.tokenizer_sha256 != m.tokenizer_sha256:
        raise ModelLoadError(f"{dm.folder}: its tokenizer differs from the target's ({m.folder}); "
                             "a draft must share the target's vocabulary")
    if dm.raw.get("kind") == "eagle":
        from ..ort.eagle import EagleDrafter

        # the head is fed the target's hidden states and never starts from a cached prefix: the
        # target's cache keeps those states instead
        drafter = EagleDrafter(OrtModel(dm, **{**opts, "prefix_cache_bytes": 0}))  # checks its vocabulary map
        if drafter.target_vocab_size != m.vocab_size:
            raise ModelLoadError(f"{dm.folder}: drafts for a vocabulary of {drafter.target_vocab_size}, "
                                 f"the target has {m.vocab_size}")
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
    model_spec = spec[len("ngram+"):] if combined else spec
    path = Path(model_spec).expanduser()
    named = any(d.get("name") == model_spec for d in m.drafts)  # the manifest's name wins over ./<name>
    if not named and (path / "manifest.json").is_file():
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


def engine_models(target, drafter) -> list[OrtModel]:
    """The ONNX Runtime models of an engine: the target, a draft model, a combined drafter's."""
    found = []
    for model in (target, getattr(drafter, "model", None), getattr(getattr(drafter, "model", None), "model", None)):
        if isinstance(model, OrtModel) and model not in found:
            found.append(model)
    return found
