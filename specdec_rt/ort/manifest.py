"""Read an export folder's ``manifest.json`` (format: docs/manifest.md) and check it.

The runtime takes every shape and ONNX name from the manifest. A folder that is missing files, or
whose manifest disagrees with its ONNX graph, fails here with the path and the mismatch.

A model folder is untrusted input (docs/security.md): every path the manifest names must resolve
inside the folder (symlinks included), every number is bounded before it sizes anything, the KV
name templates may use only ``{layer}``, and anything malformed is a ``ModelLoadError`` that
reveals nothing about files outside the folder. The sha256 of every listed file is verified once
per folder: a stamp file (``.specdec-verified.json``: size, mtime, inode change time, inode
number and sha256 per file) records a successful check, and a file any of whose recorded fields
changed is hashed again (a change with the old mtime restored too: the change time moves).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import string
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError, ModelNotBuiltError
from ..manifest_schema import (
    BUILDERS,
    CACHE_ENV,
    CONCAT_INPUTS,
    CONCAT_KV_LAYOUT,
    KV_DTYPES,
    KV_LAYOUT,
    KV_ROLES,
    LIMITS,
    MANIFEST,
    MAX_DRAFTS,
    MAX_EOS_IDS,
    MAX_FILES,
    MAX_MANIFEST_BYTES,
    MAX_NAME_CHARS,
    MAX_PATH_CHARS,
    MAX_TEMPLATE_CHARS,
    MAX_TOKEN_ID,
    PACKED_ROLES,
    REQUIRED_INPUTS,
    SCHEMA_VERSION,
    STAMP,
    STAMP_STAT,
    TREE_ROLES,
)

__all__ = [
    "Manifest",
    "load_manifest",
    "check_manifest",
    "resolve_model_dir",
    "cache_root",
    "SCHEMA_VERSION",
    "STAMP",
    "LIMITS",
    "KV_ROLES",
    "PACKED_ROLES",
    "inside",
]


def inside(folder: Path, rel: Any, what: str, manifest: Path | None = None) -> Path:
    """``folder / rel`` for a relative path that resolves (symlinks followed) inside ``folder``;
    else ``ModelLoadError``. The message names the manifest and the field, never anything about
    the file outside (whether it exists, its size)."""
    where = manifest or Path(folder) / MANIFEST
    if not isinstance(rel, str) or not rel or len(rel) > MAX_PATH_CHARS or "\0" in rel:
        raise ModelLoadError(f"{where}: {what} must be a relative path inside the model folder, got {_short(rel)}")
    base = Path(folder).resolve()
    try:
        real = (base / rel).resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a name too long
        raise ModelLoadError(f"{where}: {what} {_short(rel)} cannot be resolved") from None
    if real == base or not real.is_relative_to(base):
        raise ModelLoadError(f"{where}: {what} {_short(rel)} points outside the model folder")
    return Path(folder) / rel


def _is_file(p: Path) -> bool:
    """A regular file there; False too where the name cannot even be looked up (a component
    longer than the file system allows: ``is_file`` raises ``ENAMETOOLONG`` for that)."""
    try:
        return p.is_file()
    except OSError:
        return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def cache_root() -> Path:
    """Where ``python -m export`` puts built recipes (the same rule as ``export.paths``):
    ``$SPECDEC_RT_CACHE``, else ``$XDG_CACHE_HOME/specdec-rt``, else ``~/.cache/specdec-rt``."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "specdec-rt"


def resolve_model_dir(name_or_path: str | os.PathLike[str]) -> Path:
    """A folder holding ``manifest.json``: the path itself, or a built recipe by name."""
    path = Path(name_or_path).expanduser()
    if (path / MANIFEST).is_file():
        return path
    text = str(name_or_path)
    if path.exists():
        raise ModelLoadError(
            f"{path}: no manifest.json in this folder (build it with: python -m export SRC --out {path})"
        )
    if os.sep in text or text.startswith("."):
        raise ModelLoadError(f"{path}: no such model folder")
    built = cache_root() / "models" / text
    if (built / MANIFEST).is_file():
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
    quantization: dict[str, Any] | None
    drafts: tuple[dict[str, Any], ...]
    exact_to: str | None
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)
    # the longest window of the graph's sliding layers (0: none); such a model verifies chains
    sliding_window: int = 0
    # ALiBi position biases (BLOOM): added by cache slot, so such a model verifies chains too
    alibi: bool = False
    # the KV cache's element type (onnx.kv.dtype, one of KV_DTYPES)
    kv_dtype: str = "float32"
    # what built the graph (one of BUILDERS): "native" (export.graph: a shared KV pool, packed
    # rows, trees) or "optimum" (past in, present out: specdec_rt.ort.concat_kv runs it)
    builder: str = "native"

    def kv_name(self, role: str, layer: int) -> str:
        """ONNX name of ``past_key`` / ``past_value`` / ``present_key`` / ``present_value``."""
        return str(self.kv[role]).format(layer=layer)

    def path(self, rel: Any, what: str) -> Path:
        """A file the manifest names (``rel``), checked to lie inside the folder."""
        return inside(self.folder, rel, what)

    def draft_dir(self, name: str | None = None) -> Path | None:
        """Folder of a draft listed in this manifest (the first one if ``name`` is None)."""
        if not self.drafts:
            return None
        if name is None:
            return self.path(self.drafts[0]["path"], "drafts[0].path")
        for i, d in enumerate(self.drafts):
            if d.get("name") == name:
                return self.path(d["path"], f"drafts[{i}].path")
        names = [d.get("name") for d in self.drafts]
        raise ModelLoadError(f"{self.folder}: no draft named {name!r}; this model has {names}")


def load_manifest(folder: str | os.PathLike[str], verify_hashes: bool | str = "once") -> Manifest:
    """Parse and check ``folder/manifest.json``: schema, required fields and their bounds, every
    named path inside the folder, files present with the recorded sizes and sha256.

    ``verify_hashes``: ``"once"`` (default) hashes each listed file unless the folder's stamp
    says it was verified as it is now (:data:`STAMP_STAT`), then updates the stamp; ``"always"``
    (or ``True``) ignores the stamp; ``"never"`` (or ``False``) checks sizes only."""
    folder = Path(folder)
    return check_manifest(folder, _read_json(folder / MANIFEST), verify_hashes)


def check_manifest(
    folder: str | os.PathLike[str], raw: dict[str, Any], verify_hashes: bool | str = "never"
) -> Manifest:
    """The checks of :func:`load_manifest` on a manifest held in memory, ``raw``, for the files
    in ``folder``: the exporter validates a graph through the runtime before it writes
    ``manifest.json``. Errors name ``folder/manifest.json``."""
    named: dict[bool | str, str] = {True: "always", False: "never"}  # the bools' names
    mode = named.get(verify_hashes, verify_hashes)
    if mode not in ("once", "always", "never"):
        raise ValueError(f"verify_hashes must be 'once', 'always' or 'never', got {verify_hashes!r}")
    folder = Path(folder)
    path = folder / MANIFEST
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: must hold a JSON object, not {type(raw).__name__}")
    if raw.get("schema_version") != SCHEMA_VERSION:
        raise ModelLoadError(
            f"{path}: schema_version {_short(raw.get('schema_version'))}, this runtime reads {SCHEMA_VERSION}"
        )
    m = _read_fields(folder, raw, path)
    _check_graph_names(m, path)
    if "draft_vocab" in raw:
        vocab = _obj(raw, "draft_vocab", path)
        inside(folder, vocab.get("file", "vocab.npy"), "draft_vocab.file", path)
        _int(vocab.get("target_vocab_size"), "draft_vocab.target_vocab_size", path, lo=1, hi=LIMITS["vocab_size"][1])
    checked = _check_files(m, raw.get("files") or {}, path)
    if mode != "never":
        _verify_hashes(folder, checked, path, use_stamp=mode == "once")
    return m


def _read_fields(folder: Path, raw: dict[str, Any], path: Path) -> Manifest:
    """The manifest's fields, each checked for its type and bounds."""
    arch = _obj(raw, "architecture", path)
    onnx_ = _obj(raw, "onnx", path)
    tok = _obj(raw, "tokenizer", path)
    special = _obj(raw, "special_tokens", path, default={})
    nums = {k: _int(arch.get(k), f"architecture.{k}", path, lo=lo, hi=hi) for k, (lo, hi) in LIMITS.items()}
    if nums["num_kv_heads"] > nums["num_heads"]:
        raise ModelLoadError(f"{path}: num_kv_heads={nums['num_kv_heads']} exceeds num_heads={nums['num_heads']}")
    eos = special.get("eos")
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if len(eos) > MAX_EOS_IDS:
        raise ModelLoadError(f"{path}: special_tokens.eos lists {len(eos)} ids (at most {MAX_EOS_IDS})")
    bos = special.get("bos")
    kv = _obj(onnx_, "kv", path)
    return Manifest(
        folder=folder,
        name=_printable(_str(raw.get("name", folder.name), "name", path), "name", path),
        role=_str(raw.get("role", "target"), "role", path),
        **nums,
        bos_id=None if bos is None else _int(bos, "special_tokens.bos", path, lo=0, hi=MAX_TOKEN_ID - 1),
        eos_ids=tuple(_int(e, "special_tokens.eos", path, lo=0, hi=MAX_TOKEN_ID - 1) for e in eos),
        tokenizer_file=inside(folder, tok.get("file"), "tokenizer.file", path),
        tokenizer_sha256=_opt_str(tok.get("sha256"), "tokenizer.sha256", path, 128),
        add_bos=_bool(tok.get("add_bos", False), "tokenizer.add_bos", path),
        chat_template=_opt_str(tok.get("chat_template"), "tokenizer.chat_template", path, MAX_TEMPLATE_CHARS),
        onnx_file=inside(folder, onnx_.get("file"), "onnx.file", path),
        inputs=_names(onnx_, "inputs", path),
        outputs=_names(onnx_, "outputs", path),
        kv=dict(kv),
        quantization=onnx_.get("quantization") if isinstance(onnx_.get("quantization"), dict) else None,
        drafts=_drafts(folder, raw.get("drafts"), path),
        exact_to=raw.get("exact_to"),
        raw=raw,
        sliding_window=_int(
            arch.get("sliding_window", 0), "architecture.sliding_window", path, lo=0, hi=LIMITS["max_positions"][1]
        ),
        alibi=_bool(arch.get("alibi", False), "architecture.alibi", path),
        kv_dtype=_kv_dtype(kv.get("dtype", "float32"), path),
        builder=_builder(raw.get("builder", "native"), path),
    )


def _builder(value: Any, path: Path) -> str:
    """``builder``, one of :data:`BUILDERS` (a manifest without it: ``"native"``)."""
    if not isinstance(value, str) or value not in BUILDERS:
        raise ModelLoadError(f"{path}: builder {_short(value)} is not one of {', '.join(BUILDERS)}")
    return value


def _kv_dtype(value: Any, path: Path) -> str:
    """``onnx.kv.dtype``, one of :data:`KV_DTYPES`."""
    if not isinstance(value, str) or value not in KV_DTYPES:
        raise ModelLoadError(f"{path}: onnx.kv.dtype {_short(value)} is not one of {', '.join(KV_DTYPES)}")
    return value


def _check_graph_names(m: Manifest, path: Path) -> None:
    """The graph's input, output and KV names that the runtime needs."""
    if m.builder == "optimum":
        _check_concat_names(m, path)
        return
    for role in REQUIRED_INPUTS:
        if not m.inputs.get(role):
            raise ModelLoadError(f"{path}: onnx.inputs.{role} is missing")
    _check_packed(m.inputs, path)
    if not m.outputs.get("logits"):
        raise ModelLoadError(f"{path}: onnx.outputs.logits is missing")
    if m.kv.get("layout") != KV_LAYOUT or m.kv.get("shared_buffer") is not True:
        raise ModelLoadError(
            f"{path}: KV layout {_short(m.kv.get('layout'))} shared={_short(m.kv.get('shared_buffer'))}; "
            f"this runtime needs {KV_LAYOUT} with a shared past/present buffer"
        )
    _check_kv_names(m, path)


def _check_kv_names(m: Manifest, path: Path) -> None:
    """The four KV name templates: each valid, all different."""
    for role in KV_ROLES:
        _check_kv_template(m.kv.get(role), f"onnx.kv.{role}", path)
    if len({m.kv[r] for r in KV_ROLES}) != len(KV_ROLES):
        raise ModelLoadError(f"{path}: onnx.kv names must differ from one another")


def _check_concat_names(m: Manifest, path: Path) -> None:
    """The names of a graph built through optimum: ``CONCAT_INPUTS`` (``position_ids`` optional),
    logits, and separate past / present KV tensors (:data:`CONCAT_KV_LAYOUT`, float32)."""
    for role in CONCAT_INPUTS:
        if not m.inputs.get(role):
            raise ModelLoadError(f"{path}: onnx.inputs.{role} is missing (a graph built through optimum)")
    if not m.outputs.get("logits"):
        raise ModelLoadError(f"{path}: onnx.outputs.logits is missing")
    if m.kv.get("layout") != CONCAT_KV_LAYOUT or m.kv.get("shared_buffer") is not False:
        raise ModelLoadError(
            f"{path}: KV layout {_short(m.kv.get('layout'))} shared={_short(m.kv.get('shared_buffer'))}; "
            f"a graph built through optimum has {CONCAT_KV_LAYOUT} with separate past and present tensors"
        )
    if m.kv_dtype != "float32" or m.quantization is not None:
        raise ModelLoadError(f"{path}: a graph built through optimum is float32 (onnx.kv.dtype, onnx.quantization)")
    _check_kv_names(m, path)


def _check_files(m: Manifest, files: Any, path: Path) -> dict[str, Any]:
    """The listed ``files`` (inside the folder, of the recorded sizes; by name, what
    :func:`_verify_hashes` needs), and the graph and tokenizer present."""
    if not isinstance(files, dict) or len(files) > MAX_FILES:
        raise ModelLoadError(f"{path}: files must be an object of at most {MAX_FILES} entries")
    checked = {}
    for fname, info in files.items():
        checked[fname] = _check_file(inside(m.folder, fname, "files entry", path), info, path)
    for file in (m.onnx_file, m.tokenizer_file):
        if not _is_file(file):
            raise ModelLoadError(f"{path}: {_short(file.name)} is missing (listed in the manifest)")
    return checked


def _check_packed(inputs: dict[str, Any], path: Path) -> None:
    """Every language-model graph takes packed rows with positions and an attention bias
    (``PACKED_ROLES`` + ``TREE_ROLES``, exporter 0.3 and later); an EAGLE head (an input
    ``features``) takes none of them. A folder exported before packed rows is refused here, the
    one place the runtime knows such exports existed: the backend serves packed graphs alone."""
    if inputs.get("features"):
        return
    missing = [role for role in PACKED_ROLES + TREE_ROLES if not inputs.get(role)]
    if missing:
        raise ModelLoadError(
            f"{path}: exported before packed rows (no onnx.inputs.{missing[0]}); "
            "rebuild the folder with: python -m export"
        )


if sys.platform == "win32":  # no such flags there
    _NONBLOCK = _NOFOLLOW = 0
else:
    _NONBLOCK, _NOFOLLOW = os.O_NONBLOCK, os.O_NOFOLLOW


def read_regular(path: Path, limit: int, follow: bool = True) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``limit`` bytes: a FIFO or a
    device is refused without blocking on it or reading it (``st_size`` says 0 for them), and at
    most ``limit + 1`` bytes are ever read. ``follow=False``: a symlink is refused too.
    Raises ``OSError`` (``FileNotFoundError`` if absent) or ``ValueError`` (not regular, too big)."""
    flags = os.O_RDONLY | _NONBLOCK | (0 if follow else _NOFOLLOW)
    fd = os.open(path, flags)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size > limit:
            raise ValueError(f"larger than {limit} bytes")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"larger than {limit} bytes")
    return data


def _read_json(path: Path) -> dict[str, Any]:
    """The manifest: a regular file inside its folder, at most ``MAX_MANIFEST_BYTES``, a JSON object."""
    if path.is_symlink():
        inside(path.parent, path.name, MANIFEST, path)  # a link must stay inside the folder
    try:
        raw = json.loads(read_regular(path, MAX_MANIFEST_BYTES).decode("utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: missing") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise ModelLoadError(f"{path}: unreadable ({type(exc).__name__}: {str(exc)[:200]})") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: must hold a JSON object, not {type(raw).__name__}")
    return raw


def _obj(parent: dict[str, Any], key: str, path: Path, default: dict[str, Any] | None = None) -> dict[str, Any]:
    value = parent.get(key, default)
    if value is None and default is not None:
        value = default
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: {key} must be an object, got {_short(value)}")
    return value


def _int(value: Any, what: str, path: Path, *, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise ModelLoadError(f"{path}: {what} must be an integer from {lo} to {hi}, got {_short(value)}")
    return value


def _printable(value: str, what: str, path: Path) -> str:
    """A name shown in terminals and logs: no control characters (escape sequences, newlines)."""
    if not value.isprintable():
        raise ModelLoadError(f"{path}: {what} must be printable text, got {_short(value)}")
    return value


def _bool(value: Any, what: str, path: Path) -> bool:
    if not isinstance(value, bool):
        raise ModelLoadError(f"{path}: {what} must be true or false, got {_short(value)}")
    return value


def _str(value: Any, what: str, path: Path, limit: int = MAX_NAME_CHARS) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise ModelLoadError(f"{path}: {what} must be a string of at most {limit} characters, got {_short(value)}")
    return value


def _opt_str(value: Any, what: str, path: Path, limit: int) -> str | None:
    return None if value is None else _str(value, what, path, limit)


def _names(onnx_: dict[str, Any], key: str, path: Path) -> dict[str, str | None]:
    table = _obj(onnx_, key, path)
    for role, name in table.items():
        if name is not None:
            _str(name, f"onnx.{key}.{role}", path)
    return dict(table)


def _check_kv_template(value: Any, what: str, path: Path) -> None:
    """A KV name template: a bounded string whose only field is ``{layer}``, with no conversion
    or format spec (``{layer:>300000000}`` would build a 300 MB name)."""
    _str(value, what, path)
    try:
        fields = [(f, conv, spec) for _, f, spec, conv in string.Formatter().parse(value) if f is not None]
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {what} {_short(value)} is not a valid name template ({exc})") from None
    if not fields or any(f != "layer" or conv is not None or spec for f, conv, spec in fields):
        raise ModelLoadError(
            f"{path}: {what} {_short(value)} must use the field {{layer}} and no other, "
            "without conversion or format spec"
        )


def _drafts(folder: Path, drafts: Any, path: Path) -> tuple[dict[str, Any], ...]:
    if drafts is None:
        return ()
    if not isinstance(drafts, list) or len(drafts) > MAX_DRAFTS:
        raise ModelLoadError(f"{path}: drafts must be a list of at most {MAX_DRAFTS} entries")
    for i, d in enumerate(drafts):
        if not isinstance(d, dict):
            raise ModelLoadError(f"{path}: drafts[{i}] must be an object, got {_short(d)}")
        _str(d.get("name"), f"drafts[{i}].name", path)
        inside(folder, d.get("path"), f"drafts[{i}].path", path)
    return tuple(drafts)


def _check_file(p: Path, info: Any, manifest: Path) -> tuple[int, str | None]:
    """Size check of one listed file (already confined); returns (size, sha256 or None)."""
    if not isinstance(info, dict):
        raise ModelLoadError(f"{manifest}: files entry for {p.name!r} must be an object")
    want = info.get("sha256")
    if want is not None and not (isinstance(want, str) and len(want) == 64):
        raise ModelLoadError(f"{manifest}: files entry for {p.name!r} has a malformed sha256")
    if "bytes" in info and (type(info["bytes"]) is not int or info["bytes"] < 0):
        raise ModelLoadError(f"{manifest}: files entry for {p.name!r} has a malformed size")
    if not _is_file(p):
        raise ModelLoadError(f"{manifest}: files entry {_short(p.name)} is missing")
    size = p.stat().st_size
    if "bytes" in info and size != info["bytes"]:
        raise ModelLoadError(f"{p}: {size} bytes, the manifest says {_short(info['bytes'])} (truncated or replaced?)")
    return size, want


def _sha256(p: Path) -> str:
    h = hashlib.sha256()
    with p.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_stamp(folder: Path) -> dict[str, Any]:
    """The folder's verification stamp, or ``{}``: a regular file, not a link, bounded."""
    try:
        stamp = json.loads(read_regular(folder / STAMP, MAX_MANIFEST_BYTES, follow=False).decode("utf-8"))
        files = stamp.get("files") if isinstance(stamp, dict) else None
        return files if isinstance(files, dict) else {}
    except (OSError, ValueError, RecursionError):
        return {}


def _verify_hashes(folder: Path, checked: dict[str, Any], manifest: Path, use_stamp: bool) -> None:
    """sha256 of every listed file that has one, skipping those the stamp records as verified
    with their current ``[*STAMP_STAT, sha256]``; a mismatch names the file. Writes the stamp."""
    stamp = _read_stamp(folder) if use_stamp else {}
    record, changed = {}, False
    for fname, (_, want) in checked.items():
        if want is None:
            continue
        p = folder / fname
        st = p.stat()  # before hashing: a change while it is read moves the change time past this
        key = [*(getattr(st, f) for f in STAMP_STAT), want]
        if stamp.get(fname) != key:
            got = _sha256(p)
            if got != want:
                raise ModelLoadError(
                    f"{p}: sha256 {got[:16]}... does not match the manifest's {want[:16]}... "
                    "(corrupt or replaced; rebuild the folder)"
                )
            changed = True
        record[fname] = key
    if changed or (use_stamp and record != stamp):
        tmp = None
        try:  # best effort: a read-only folder is verified again at every load
            # a new file of our own (O_EXCL: never through a link planted under a guessable
            # name), renamed over the stamp (a rename replaces a link, never writes through it)
            fd, tmp = tempfile.mkstemp(prefix=f"{STAMP}.", suffix=".tmp", dir=folder)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps({"files": record}))
            os.replace(tmp, folder / STAMP)
            tmp = None
        except OSError:
            pass
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
