"""Model sources: a Hugging Face checkpoint folder or a GGUF file (recipes resolve to one).

Cheap checks come first (path exists, GGUF header and tensor extents, architecture name), so a
wrong source fails in milliseconds, before any weights are read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CorruptSourceError, ExportError, SourceNotFoundError, one_line
from .gguf_families import gguf_config_overrides, register_gguf_families
from .gguf_import import IMPORTED_FAMILIES, imported_config, load_imported_model
from .gguf_meta import check_model, read_gguf_info
from .model_spec import GGUF_FAMILIES, SUPPORTED_FAMILIES, unsupported_architecture

__all__ = ["Source", "open_source"]


@dataclass(kw_only=True)
class Source:
    """A resolved model source. `folder` (+ `gguf_file`) is what transformers loads."""

    kind: str  # "folder" | "gguf"
    folder: Path
    gguf_file: str | None
    family: str
    label: str  # default output name
    record: dict[str, Any] = field(default_factory=dict)  # the manifest's `source`
    builder: str = "native"  # what builds its graph: "native" (export.graph) or "optimum" (export.optimum_path)

    @property
    def path(self) -> Path:
        return self.folder / self.gguf_file if self.gguf_file else self.folder

    def fingerprint(self) -> dict[str, Any]:
        """What decides whether an existing output is still up to date."""
        if "sha256" in self.record:
            return {"sha256": self.record["sha256"]}
        files = [self.path] if self.gguf_file else sorted(p for p in self.folder.iterdir() if p.is_file())
        return {"files": {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files}}

    def vocab_size(self) -> int | None:
        """The logits width, read cheaply (config.json or the GGUF header)."""
        if self.gguf_file:
            return read_gguf_info(self.path).vocab_size
        vocab: int | None = json.loads((self.folder / "config.json").read_text()).get("vocab_size")
        return vocab

    def load_model(self) -> Any:
        """The float32 PyTorch model (GGUF tensors are dequantized by transformers)."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        kwargs: dict[str, Any] = {}
        try:
            if self.gguf_file and self.family in IMPORTED_FAMILIES:  # transformers cannot load these
                return load_imported_model(self.path)
            if self.gguf_file:  # the config values transformers' GGUF table misses (export.gguf_families)
                register_gguf_families()
                overrides = gguf_config_overrides(read_gguf_info(self.path), self.path)
                if overrides:
                    config = AutoConfig.from_pretrained(str(self.folder), gguf_file=self.gguf_file)
                    for key, value in overrides.items():
                        setattr(config, key, value)
                    kwargs["config"] = config
            loaded: Any = AutoModelForCausalLM.from_pretrained(
                str(self.folder), gguf_file=self.gguf_file, dtype=torch.float32, output_loading_info=True, **kwargs
            )  # (model, loading info)
            model, loading = loaded
        except ExportError:
            raise
        except Exception as exc:  # noqa: BLE001 - loader errors are source errors
            raise CorruptSourceError(f"cannot load the model from {self.path}: {one_line(exc)}") from exc
        missing = [k for k in loading.get("missing_keys", ()) if k != "lm_head.weight" or not _tied(model)]
        if self.gguf_file and missing:  # transformers would leave them at their random initialization
            raise CorruptSourceError(f"{self.path} has no tensor for {len(missing)} parameters, e.g. {missing[0]}")
        if getattr(model.config, "attn_logit_softcapping", None):  # Gemma 2: SDPA would skip the soft-capping
            model.set_attn_implementation("eager")
        return model.eval()

    def load_tokenizer(self) -> Any:
        """The fast tokenizer, special tokens fixed (see `export.tokenizer`)."""
        from .tokenizer import load_tokenizer

        return load_tokenizer(self.folder, self.gguf_file)


def _tied(model: Any) -> bool:
    return bool(getattr(model.config, "tie_word_embeddings", False))


def open_source(src: str | os.PathLike[str], record: dict[str, Any] | None = None) -> Source:
    """Resolve a folder or `.gguf` path; check it exists, is readable, and is supported."""
    path = Path(src).expanduser()
    settings: dict[str, Any] | None = None  # config.json of a checkpoint folder
    if not path.exists():
        raise SourceNotFoundError(f"no such file or folder: {path}")
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise SourceNotFoundError(f"{path} is not a Hugging Face checkpoint (no config.json)")
        try:
            settings = json.loads(config.read_text())
            family = settings.get("model_type")
        except (OSError, ValueError, AttributeError) as exc:  # AttributeError: JSON, not an object
            raise CorruptSourceError(f"unreadable {config}: {one_line(exc)}") from exc
        kind, folder, gguf_file = "folder", path.resolve(), None
        default_record = {"kind": "folder", "path": str(folder)}
    elif path.suffix.lower() == ".gguf":
        info = read_gguf_info(path)  # raises on corrupt or truncated files
        family = info.architecture
        if family in GGUF_FAMILIES:  # metadata vs tensor index, memory: before loading
            check_model(info, path)
            gguf_config_overrides(info, path)  # the family's own keys, bounded and checked
            if family in IMPORTED_FAMILIES:
                imported_config(info, path)
        kind, folder, gguf_file = "gguf", path.resolve().parent, path.name
        default_record = {"kind": "gguf", "path": str(path.resolve())}
    else:
        raise SourceNotFoundError(f"{path} is neither a checkpoint folder nor a .gguf file")
    supported = GGUF_FAMILIES if gguf_file else SUPPORTED_FAMILIES
    builder = "native"
    if family not in supported:
        from .optimum_families import optimum_builds

        if gguf_file or not optimum_builds(family, settings):
            raise unsupported_architecture(family, supported, settings)
        builder = "optimum"
    label = path.stem if gguf_file else path.name
    return Source(
        kind=kind,
        folder=folder,
        gguf_file=gguf_file,
        family=str(family),  # (one of `supported`, or a model_type optimum_builds checked)
        label=label,
        record=record or default_record,
        builder=builder,
    )
