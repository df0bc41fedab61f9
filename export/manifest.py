"""`manifest.json`: the contract with the runtime (see docs/manifest.md), written last.

Besides the documented fields, `build` records what produced the folder (exporter version,
source fingerprint, options) so a second identical export can be a no-op.
"""

from __future__ import annotations

import json
from pathlib import Path

from .graph import IO_NAMES, ModelSpec
from .tokenizer import TokenizerInfo, sha256_file

__all__ = ["SCHEMA_VERSION", "MANIFEST", "build_manifest", "write_manifest", "read_manifest",
           "is_up_to_date", "onnx_section"]

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
STAMP = ".specdec-verified.json"  # the runtime's record of verified sha256 (docs/manifest.md)


def onnx_section(quantization: dict | None) -> dict:
    """The manifest's `onnx` record for graphs from `export.graph`."""
    return {
        "file": "model.onnx",
        "data_file": "model.onnx.data",
        "dtype": "float32",
        "quantization": quantization,
        "inputs": {k: IO_NAMES[k] for k in
                   ("input_ids", "position_ids", "seqlens_k", "total_sequence_length",
                    "logits_index", "query_seqlens", "pad_index", "pack_index", "padded_shape",
                    "attention_bias")},
        "outputs": {"logits": IO_NAMES["logits"], "hidden": IO_NAMES["hidden"]},
        "kv": {"layout": "BNSH", "shared_buffer": True, "dtype": "float32",
               **{k: IO_NAMES[k] for k in ("past_key", "past_value", "present_key",
                                           "present_value")}},
    }


def file_table(folder: Path) -> dict:
    """sha256 and size of every regular file directly in `folder` except the manifest."""
    return {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size}
            for p in sorted(Path(folder).iterdir())
            if p.is_file() and p.name not in (MANIFEST, STAMP)}


def build_manifest(*, name: str, role: str, spec: ModelSpec, tok: TokenizerInfo,
                   folder: Path, quantization: dict | None, exact_to: str, source: dict,
                   build: dict, validation: dict | None, graph: dict,
                   drafts: list[dict] | None = None, draft_of: str | None = None) -> dict:
    """Assemble the manifest for a finished folder (hashes every file in it)."""
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "name": name,
        "role": role,
        "architecture": spec.manifest(),
        "special_tokens": {"bos": tok.bos, "eos": tok.eos, "pad": tok.pad},
        "tokenizer": {"file": "tokenizer.json", "add_bos": tok.add_bos,
                      "chat_template": tok.chat_template,
                      "sha256": sha256_file(Path(folder) / "tokenizer.json")},
        "onnx": {**onnx_section(quantization), "nodes": graph["nodes"],
                 **({"weight_forms": graph["weight_forms"]} if "weight_forms" in graph else {})},
        "drafts": drafts or [],
        "exact_to": exact_to,
        "source": source,
        "validation": validation,
        "build": build,
        "files": file_table(folder),
    }
    if draft_of is not None:
        manifest["draft_of"] = draft_of
    return manifest


def write_manifest(folder: Path, manifest: dict) -> Path:
    """Write `manifest.json` (the last file of a folder), and the runtime's verification stamp
    for the files just hashed into it, so the first load does not hash them again."""
    path = Path(folder) / MANIFEST
    path.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    stamp = {}
    for fname, meta in (manifest.get("files") or {}).items():
        st = (Path(folder) / fname).stat()
        if st.st_size != meta["bytes"]:
            return path  # changed since it was hashed: let the runtime verify it
        stamp[fname] = [st.st_size, st.st_mtime_ns, meta["sha256"]]
    (Path(folder) / STAMP).write_text(json.dumps({"files": stamp}))
    return path


def read_manifest(folder: Path) -> dict | None:
    """The folder's manifest, or None if it has none or it is unreadable."""
    try:
        return json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def is_up_to_date(folder: Path, build: dict) -> bool:
    """True when `folder` was built with exactly `build` and its files (and its drafts'
    files) are all present with their recorded sizes. A manifest that is malformed or names
    a path outside its folder is simply not up to date (it gets rebuilt)."""
    manifest = read_manifest(folder)
    if not isinstance(manifest, dict) or manifest.get("build") != build:
        return False
    root = Path(folder).resolve()
    try:
        folders = [(root, manifest)]
        for draft in manifest.get("drafts", []):
            sub = (root / draft["path"]).resolve()
            if sub == root or not sub.is_relative_to(root):
                return False
            folders.append((sub, read_manifest(sub) or {}))
        for where, man in folders:
            files = man.get("files") if isinstance(man, dict) else None
            if not files:
                return False
            for fname, meta in files.items():
                path = (where / fname).resolve()
                if not path.is_relative_to(where) or not path.is_file() \
                        or path.stat().st_size != meta["bytes"]:
                    return False
    except (KeyError, TypeError, AttributeError, ValueError, OSError):
        return False
    return True
