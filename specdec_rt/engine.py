"""``Engine``: the five-line API over exported models.

    engine = await Engine.load("smollm2-135m")            # a built recipe name or an export folder
    result = await engine.generate("Hello", max_new_tokens=64)
    print(result.text, result.stats.tokens_per_s, result.stats.acceptance_rate)
    async for ev in engine.stream([{"role": "user", "content": "Hi"}]): print(ev.text, end="")
    await engine.aclose()                                  # or: async with await Engine.load(...)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Sequence

import anyio

from .acceptance import SpecConfig
from .errors import EngineClosedError, InvalidInputError, ModelLoadError
from .drafters import CombinedDrafter, NgramDrafter
from .ort import OrtDraftInferrer, OrtModel, OrtTargetVerifier, load_manifest, resolve_model_dir
from .protocols import DraftInferrer
from .sampling import SamplingParams
from .scheduler import SpecDecScheduler
from .text import TextCodec
from .types import FinishReason, Mode, Stats

__all__ = ["Engine", "EngineResult", "StreamEvent"]

Prompt = str | Sequence[dict]

# The drafter when Engine.load gets draft=None (see docs/benchmarks.md for why).
DEFAULT_DRAFT = "ngram+model"


@dataclass
class EngineResult:
    """A finished generation: ``text`` (special tokens skipped), ``token_ids`` (prompt excluded),
    ``stats`` (``tokens_per_s``, ``acceptance_rate``, ``mean_accepted``, ``mode``, ...)."""

    text: str
    token_ids: list[int]
    stats: Stats
    prompt_tokens: int = 0

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.stats.finish_reason


@dataclass(frozen=True)
class StreamEvent:
    """New text (never a broken UTF-8 character; may be empty while one is incomplete) and the
    token ids that became final with it. ``finished`` is set on the last event."""

    text: str
    token_ids: tuple[int, ...]
    finished: FinishReason | None = None
    stats: Stats | None = field(default=None, repr=False)  # on the last event


class Engine:
    """Speculative decoding over an exported target (and draft), for async services.

    Requests may run concurrently (up to ``slots`` at once; more wait their turn); model calls run
    in worker threads, so the event loop stays responsive. A failed request raises a
    :class:`~specdec_rt.errors.SpecDecError`, releases its KV slots and leaves the engine usable.
    Cancelling a request (task cancel, timeout, breaking out of ``stream``) takes effect after the
    model call in flight, if any, and releases its slots.
    """

    def __init__(self, target: OrtModel, drafter: DraftInferrer | None, codec: TextCodec,
                 config: SpecConfig | None = None, *, slots: int = 4, draft_name: str | None = None) -> None:
        self.target, self.drafter, self.codec = target, drafter, codec
        self.manifest = target.manifest
        self.draft_name = draft_name
        verifier = OrtTargetVerifier(target, share_hidden=bool(getattr(drafter, "needs_target_hidden", False)))
        self.scheduler = SpecDecScheduler(drafter, verifier, config,
                                          eos_ids=self.manifest.eos_ids)
        self._slots = anyio.Semaphore(slots)
        self._closed = False

    # ------------------------------------------------------------------ loading
    @classmethod
    async def load(cls, name_or_path: str | os.PathLike, draft: str | os.PathLike | None = None, *,
                   max_length: int | None = None, threads: int | None = None, provider: str = "auto",
                   slots: int = 4, spec_config: SpecConfig | None = None) -> "Engine":
        """Load a built recipe (``"smollm2-135m"``) or an export folder.

        ``draft``: ``None`` for the default (``DEFAULT_DRAFT``: n-gram lookup, else the manifest's
        first draft model), ``"none"``, ``"ngram"``, a draft model (a name from the manifest such as
        ``"q4"``, ``"model"`` for the first, or a folder), or ``"ngram+<draft model>"``.
        A recipe that is not built raises :class:`~specdec_rt.errors.ModelNotBuiltError` naming
        the command that builds it.
        """
        return await anyio.to_thread.run_sync(
            lambda: cls._load(name_or_path, draft, max_length, threads, provider, slots, spec_config))

    @classmethod
    def _load(cls, name_or_path, draft, max_length, threads, provider, slots, spec_config) -> "Engine":
        folder = resolve_model_dir(name_or_path)
        m = load_manifest(folder)
        opts = dict(max_length=max_length, threads=threads, provider=provider, slots=slots)
        target = OrtModel(m, **opts)
        drafter, draft_name = _make_drafter(m, draft, opts)
        return cls(target, drafter, TextCodec.from_manifest(m), spec_config, slots=slots, draft_name=draft_name)

    # ------------------------------------------------------------------ generation
    async def generate(self, prompt: Prompt, max_new_tokens: int = 256, temperature: float = 0.0,
                       top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                       mode: Mode = "spec", stop: str | Sequence[str] | None = None,
                       truncate_prompt: bool = False) -> EngineResult:
        """Generate a completion. ``prompt``: a string, or chat messages
        ``[{"role": ..., "content": ...}]`` rendered with the model's chat template.
        ``mode``: ``"spec"`` (speculative) or ``"ar"`` (plain). ``stop``: strings that end the
        generation (the text is cut before the stop string). ``truncate_prompt``: keep only the
        last tokens that fit instead of raising ``ContextLengthError``."""
        parts, ids, stats = [], [], None
        async for ev in self.stream(prompt, max_new_tokens, temperature, top_k, top_p, seed, mode,
                                    stop, truncate_prompt):
            parts.append(ev.text)
            ids.extend(ev.token_ids)
            stats = ev.stats or stats
        return EngineResult("".join(parts), ids, stats, stats.prompt_tokens if stats else 0)

    def stream(self, prompt: Prompt, max_new_tokens: int = 256, temperature: float = 0.0,
               top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
               mode: Mode = "spec", stop: str | Sequence[str] | None = None,
               truncate_prompt: bool = False) -> AsyncIterator[StreamEvent]:
        """Like :meth:`generate`, as an async iterator of :class:`StreamEvent`. Arguments are
        checked here, before any model work."""
        if self._closed:
            raise EngineClosedError("this engine is closed")
        if mode == "spec" and self.drafter is None:
            raise InvalidInputError("this engine has no draft model: load it with draft=... or use mode='ar'")
        params = SamplingParams(temperature, top_k, top_p, seed)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise InvalidInputError(f"stop must be a non-empty string or a list of them, got {stop!r}")
        ids = self.codec.encode_prompt(prompt)
        limit = self.scheduler.max_length or len(ids) + max_new_tokens
        if truncate_prompt and isinstance(max_new_tokens, int) and len(ids) + max_new_tokens > limit:
            ids = ids[-max(1, limit - max_new_tokens):]
        request = self.scheduler.stream(ids, max_new_tokens, params, mode=mode)  # validates now
        return self._events(request, stops)

    async def _events(self, request, stops: list[str]) -> AsyncIterator[StreamEvent]:
        decoder, text = self.codec.decoder(), ""
        async with self._slots:
            try:
                async for ev in request:
                    delta = decoder.push(ev.token_ids)
                    finished = ev.finished
                    if finished:
                        delta += decoder.flush()
                    text += delta
                    cut = _find_stop(text, stops, len(text) - len(delta))
                    if cut is not None:  # end at a stop string: emit the text before it
                        delta = delta[: max(0, len(delta) - (len(text) - cut))]
                        request.context.finish_reason = request.stats.finish_reason = finished = "stop"
                    yield StreamEvent(delta, ev.token_ids, finished, request.stats if finished else None)
                    if cut is not None:
                        break
            finally:
                await request.aclose()  # releases the request's KV slots, however it ended

    # ------------------------------------------------------------------ lifecycle
    async def aclose(self) -> None:
        """Release the models (ONNX Runtime sessions and KV pools). Later calls raise
        :class:`EngineClosedError`; a request still running fails with an ``InferenceError``."""
        self._closed = True
        for model in (self.target, getattr(self.drafter, "model", None),
                      getattr(getattr(self.drafter, "model", None), "model", None)):
            if isinstance(model, OrtModel):  # the target, a draft model, a combined drafter's model
                model.close()

    async def __aenter__(self) -> "Engine":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


def _find_stop(text: str, stops: list[str], new_from: int) -> int | None:
    """Index where the earliest stop string starts, if one ends in the new text."""
    hits = [i for s in stops if (i := text.find(s, max(0, new_from - len(s) + 1))) >= 0]
    return min(hits) if hits else None


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
    :class:`~specdec_rt.eagle.EagleDrafter` for ``"kind": "eagle"``, else a draft model run by
    ONNX Runtime. Checks that it shares the target's tokenizer and vocabulary. ``opts``:
    :class:`OrtModel` options."""
    if m.tokenizer_sha256 and dm.tokenizer_sha256 and dm.tokenizer_sha256 != m.tokenizer_sha256:
        raise ModelLoadError(f"{dm.folder}: its tokenizer differs from the target's ({m.folder}); "
                             "a draft must share the target's vocabulary")
    if dm.raw.get("kind") == "eagle":
        from .eagle import EagleDrafter

        drafter = EagleDrafter(OrtModel(dm, **opts))  # reads and checks its vocabulary map
        if drafter.target_vocab_size != m.vocab_size:
            raise ModelLoadError(f"{dm.folder}: drafts for a vocabulary of {drafter.target_vocab_size}, "
                                 f"the target has {m.vocab_size}")
        return drafter
    if dm.vocab_size != m.vocab_size:
        raise ModelLoadError(f"{dm.folder}: vocab_size {dm.vocab_size} != the target's {m.vocab_size}")
    return OrtDraftInferrer(OrtModel(dm, **opts))


def _make_drafter(m, spec: str, opts: dict) -> tuple[DraftInferrer | None, str | None]:
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
    draft_dir = path if (path / "manifest.json").is_file() else m.draft_dir(model_spec)
    dm = load_manifest(draft_dir)
    model = model_drafter(m, dm, **opts)
    if combined:
        return CombinedDrafter(NgramDrafter(), model), f"ngram+{dm.name}"
    return model, dm.name
