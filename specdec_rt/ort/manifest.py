"""Read an export folder's ``manifest.json`` (format: docs/manifest.md) and check it.

The runtime takes every shape and ONNX name from the manifest. A folder that is missing files, or
whose manifest disagrees with its ONNX graph, fails here with the path and the mismatch.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError, ModelNotBuiltError

__all__ = ["Manifest", "load_manifest", "resolve_model_dir", "cache_root", "SCHEMA_VERSION"]

SCHEMA_VERSION = 1
CACHE_ENV = "SPECDEC_RT_CACHE"


def cache_root() -> Path:
    """Where ``python -m export`` puts built recipes (the same rule as ``export.paths``):
    ``$SPECDEC_RT_CACHE``, else ``$XDG_CACHE_HOME/specdec-rt``, else ``~/.cache/specdec-rt``."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "specdec-rt"


def resolve_model_dir(name_or_path: str | os.PathLike) -> Path:
    """A folder holding ``manifest.json``: the path itself, or a built recipe by name."""
    path = Path(name_or_path).expanduser()
    if (path / "manifest.json").is_file():
        return path
    text = str(name_or_path)
    if path.exists():
        raise ModelLoadError(f"{path}: no manifest.json in this folder (build it with: python -m export SRC --out {path})")
    if os.sep in text or text.startswith("."):
        raise ModelLoadError(f"{path}: no such model folder")
    built = cache_root() / "models" / text
    if (built / "manifest.json").is_file():
        return built
    raise ModelNotBuiltError(
        f"model {text!r} is not built yet (looked in {built}); build it with: python -m export {text}"
    )


@dataclass(frozen=True)
class Manifest:
    """The parts of ``manifest.json`` the runtime uses, checked."""

    folder: Path
    name: str
    role: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    bos_id: int | None
    eos_ids: tuple[int, ...]
    tokenizer_file: Path
    tokenizer_sha256: str | None
    add_bos: bool
    chat_template: str | None
    onnx_file: Path
    inputs: dict[str, str | None]
    outputs: dict[str, str | None]
    kv: dict[str, Any]
    quantization: dict | None
    drafts: tuple[dict, ...]
    exact_to: str | None
    raw: dict = field(repr=False, compare=False, default_factory=dict)

    def kv_name(self, role: str, layer: int) -> str:
        """ONNX name of ``past_key`` / ``past_value`` / ``present_key`` / ``present_value``."""
        return self.kv[role].format(layer=layer)

    def draft_dir(self, name: str | None = None) -> Path | None:
        """Folder of a draft listed in this manifest (the first one if ``name`` is None)."""
        if not self.drafts:
            return None
        if name is None:
            return self.folder / self.drafts[0]["path"]
        for d in self.drafts:
            if d.get("name") == name:
                return self.folder / d["path"]
        names = [d.get("name") for d in self.drafts]
        raise ModelLoadError(f"{self.folder}: no draft named {name!r}; this model has {names}")


def load_manifest(folder: str | os.PathLike, verify_hashes: bool = False) -> Manifest:
    """Parse and check ``folder/manifest.json``: schema, required fields, files present with the
    recorded sizes (and sha256 when ``verify_hashes``)."""
    folder = Path(folder)
    path = folder / "manifest.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: missing") from None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: unreadable ({exc})") from exc
    if raw.get("schema_version") != SCHEMA_VERSION:
        raise ModelLoadError(f"{path}: schema_version {raw.get('schema_version')!r}, this runtime reads {SCHEMA_VERSION}")
    try:
        arch, onnx_ = raw["architecture"], raw["onnx"]
        tok, special = raw["tokenizer"], raw.get("special_tokens", {})
        eos = special.get("eos") or []
        m = Manifest(
            folder=folder, name=raw.get("name", folder.name), role=raw.get("role", "target"),
            num_layers=int(arch["num_layers"]), hidden_size=int(arch["hidden_size"]),
            num_heads=int(arch["num_heads"]), num_kv_heads=int(arch["num_kv_heads"]),
            head_dim=int(arch["head_dim"]), vocab_size=int(arch["vocab_size"]),
            max_positions=int(arch["max_positions"]),
            bos_id=special.get("bos"), eos_ids=tuple(int(e) for e in (eos if isinstance(eos, list) else [eos])),
            tokenizer_file=folder / tok["file"], tokenizer_sha256=tok.get("sha256"),
            add_bos=bool(tok.get("add_bos", False)), chat_template=tok.get("chat_template"),
            onnx_file=folder / onnx_["file"], inputs=dict(onnx_["inputs"]), outputs=dict(onnx_["outputs"]),
            kv=dict(onnx_["kv"]), quantization=onnx_.get("quantization"),
            drafts=tuple(raw.get("drafts") or ()), exact_to=raw.get("exact_to"), raw=raw,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: malformed manifest ({type(exc).__name__}: {exc})") from exc
    for role in ("input_ids", "seqlens_k", "total_sequence_length", "logits_index"):
        if not m.inputs.get(role):
            raise ModelLoadError(f"{path}: onnx.inputs.{role} is missing")
    if not m.outputs.get("logits"):
        raise ModelLoadError(f"{path}: onnx.outputs.logits is missing")
    if m.kv.get("layout") != "BNSH" or not m.kv.get("shared_buffer"):
        raise ModelLoadError(f"{path}: KV layout {m.kv.get('layout')!r} shared={m.kv.get('shared_buffer')!r}; "
                             "this runtime needs BNSH with a shared past/present buffer")
    for fname, info in (raw.get("files") or {}).items():
        _check_file(folder / fname, info, verify_hashes)
    for p in (m.onnx_file, m.tokenizer_file):
        if not p.is_file():
            raise ModelLoadError(f"{p}: missing (listed in {path})")
    return m


def _check_file(p: Path, info: dict, verify_hash: bool) -> None:
    if not p.is_file():
        raise ModelLoadError(f"{p}: missing (listed in the manifest)")
    size = p.stat().st_size
    if "bytes" in info and size != info["bytes"]:
        raise ModelLoadError(f"{p}: {size} bytes, the manifest says {info['bytes']} (truncated or replaced?)")
    if verify_hash and "sha256" in info:
        h = hashlib.sha256()
        with p.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        if h.hexdigest() != info["sha256"]:
            raise ModelLoadError(f"{p}: sha256 {h.hexdigest()[:16]}... does not match the manifest's {info['sha256'][:16]}...")
