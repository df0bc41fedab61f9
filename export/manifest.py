"""`manifest.json`: the contract with the runtime (see docs/manifest.md), written last.

The schema (version, size limit, ONNX names) is `specdec_rt.manifest_schema`, which the
runtime reads too.

Besides the documented fields, `build` records what produced the folder (exporter version,
source fingerprint, options) so a second identical export can be a no-op.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from specdec_rt.manifest_schema import (
    IO_NAMES,
    KV_LAYOUT,
    KV_ROLES,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    MODEL_ROLES,
    PACKED_ROLES,
    REQUIRED_INPUTS,
    SCHEMA_VERSION,
    STAMP,
    STAMP_STAT,
    TREE_ROLES,
)

from .model_spec import ModelSpec
from .tokenizer import TokenizerInfo, sha256_file

__all__ = [
    "SCHEMA_VERSION",
    "MANIFEST",
    "build_manifest",
    "assemble_manifest",
    "write_manifest",
    "read_manifest",
    "is_export_manifest",
    "is_up_to_date",
    "onnx_section",
]


def onnx_section(quantization: dict[str, Any] | None, kv_dtype: str = "float32") -> dict[str, Any]:
    """The manifest's `onnx` record for graphs from `export.graph` (``kv_dtype``: the KV cache's)."""
    return {
        "file": "model.onnx",
        "data_file": "model.onnx.data",
        "dtype": "float32",
        "quantization": quantization,
        "inputs": {k: IO_NAMES[k] for k in (*REQUIRED_INPUTS, *PACKED_ROLES, *TREE_ROLES)},
        "outputs": {"logits": IO_NAMES["logits"], "hidden": IO_NAMES["hidden"]},
        "kv": {"layout": KV_LAYOUT, "shared_buffer": True, "dtype": kv_dtype, **{k: IO_NAMES[k] for k in KV_ROLES}},
    }


def file_table(folder: Path) -> dict[str, dict[str, Any]]:
    """sha256 and size of every regular file directly in `folder` except the manifest."""
    return {
        p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size}
        for p in sorted(Path(folder).iterdir())
        if p.is_file() and p.name not in (MANIFEST, STAMP)
    }


def build_manifest(
    *,
    name: str,
    role: str,
    spec: ModelSpec,
    tok: TokenizerInfo,
    folder: Path,
    quantization: dict[str, Any] | None,
    exact_to: str,
    source: dict[str, Any],
    build: dict[str, Any],
    validation: dict[str, Any] | None,
    graph: dict[str, Any],
    drafts: list[dict[str, Any]] | None = None,
    draft_of: str | None = None,
    kv_dtype: str = "float32",
) -> dict[str, Any]:
    """Assemble the manifest for a finished folder of `export.graph` (hashes every file in it)."""
    onnx = {
        **onnx_section(quantization, kv_dtype),
        "nodes": graph["nodes"],
        **({"weight_forms": graph["weight_forms"]} if "weight_forms" in graph else {}),
        **({"scale_dtypes": graph["scale_dtypes"]} if "scale_dtypes" in graph else {}),
        **({"embedding": graph["embedding"]} if "embedding" in graph else {}),
    }
    return assemble_manifest(
        name=name,
        role=role,
        builder="native",
        architecture=spec.manifest(),
        onnx=onnx,
        tok=tok,
        folder=folder,
        exact_to=exact_to,
        source=source,
        build=build,
        validation=validation,
        drafts=drafts,
        draft_of=draft_of,
    )


def assemble_manifest(
    *,
    name: str,
    role: str,
    builder: str,
    architecture: dict[str, Any],
    onnx: dict[str, Any],
    tok: TokenizerInfo,
    folder: Path,
    exact_to: str,
    source: dict[str, Any],
    build: dict[str, Any],
    validation: dict[str, Any] | None,
    drafts: list[dict[str, Any]] | None = None,
    draft_of: str | None = None,
) -> dict[str, Any]:
    """The manifest of a finished folder whose graph ``builder`` built (one of ``BUILDERS``),
    with its ``architecture`` and ``onnx`` records (hashes every file in it)."""
    manifest: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "name": name,
        "role": role,
        "builder": builder,
        "architecture": architecture,
        "special_tokens": {"bos": tok.bos, "eos": tok.eos, "pad": tok.pad},
        "tokenizer": {
            "file": "tokenizer.json",
            "add_bos": tok.add_bos,
            "chat_template": tok.chat_template,
            "sha256": sha256_file(Path(folder) / "tokenizer.json"),
        },
        "onnx": onnx,
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


def write_manifest(folder: Path, manifest: dict[str, Any]) -> Path:
    """Write `manifest.json` (the last file of a folder), and the runtime's verification stamp
    for the files just hashed into it, so the first load does not hash them again."""
    path = Path(folder) / MANIFEST
    path.write_text(json.dumps(_finite(manifest), indent=2, ensure_ascii=False, allow_nan=False) + "\n")
    stamp: dict[str, list[object]] = {}
    for fname, meta in (manifest.get("files") or {}).items():
        st = (Path(folder) / fname).stat()
        if st.st_size != meta["bytes"]:
            return path  # changed since it was hashed: let the runtime verify it
        stamp[fname] = [*(getattr(st, f) for f in STAMP_STAT), meta["sha256"]]
    (Path(folder) / STAMP).write_text(json.dumps({"files": stamp}))
    return path


def _finite(value: object) -> object:
    """``value`` with every NaN / infinity replaced by None: strict JSON has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _read_small_file(path: Path, limit: int) -> bytes | None:
    """The bytes of ``path`` if it is a regular file (not a symlink, FIFO or device) of at most
    ``limit`` bytes, else None. The file is untrusted: never follow a link, never block on a
    FIFO, never read more than ``limit + 1`` bytes."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        raw = b"".join(chunks)
        return raw if len(raw) <= limit else None
    except OSError:
        return None
    finally:
        os.close(fd)


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The folder's manifest, or None if it has none or it is unreadable: not a regular file
    (a symlink, FIFO, device), over ``MAX_MANIFEST_BYTES``, not JSON, nested too deeply to
    parse, or not a JSON object."""
    raw = _read_small_file(Path(folder) / MANIFEST, MAX_MANIFEST_BYTES)
    if raw is None:
        return None
    try:
        value = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    return value if isinstance(value, dict) else None


def is_export_manifest(manifest: object) -> bool:
    """True when ``manifest`` has the fields every manifest this exporter writes has
    (:func:`build_manifest`, ``export.draft.assemble``): only such a folder may ever be replaced
    by an export. A web app's ``manifest.json`` (or any other JSON) is not one."""
    if not isinstance(manifest, dict):
        return False
    build = manifest.get("build")
    version = manifest.get("schema_version")
    return (
        type(version) is int
        and 1 <= version <= SCHEMA_VERSION
        and manifest.get("role") in MODEL_ROLES
        and isinstance(manifest.get("name"), str)
        and isinstance(manifest.get("architecture"), dict)
        and isinstance(manifest.get("files"), dict)
        and isinstance(build, dict)
        and isinstance(build.get("exporter"), str)
    )


def is_up_to_date(folder: Path, build: dict[str, Any]) -> bool:
    """True when `folder` was built with exactly `build` and its files (and its drafts'
    files) are all present with their recorded sizes. A manifest that is malformed or names
    a path outside its folder is simply not up to date (it gets rebuilt)."""
    manifest = read_manifest(folder)
    if not isinstance(manifest, dict) or manifest.get("build") != build:
        return False
    root = Path(folder).resolve()
    try:
        folders: list[tuple[Path, dict[str, Any]]] = [(root, manifest)]
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
                if not path.is_relative_to(where) or not path.is_file() or path.stat().st_size != meta["bytes"]:
                    return False
    except (KeyError, TypeError, AttributeError, ValueError, OSError):
        return False
    return True
