"""Trained head weights (a small ``.npz``) + a built target folder -> an EAGLE draft folder.

The ``.npz`` is what ships in git: the trained tensors in float16 (``HEAD_KEYS``), the reduced
vocabulary ``vocab`` [V'] int32 and the ``config`` (JSON). Everything else the draft graph needs
(the embedding table, LM-head rows, rotary tables) is read from the target's own folder, so the
draft stays a few MB and can never disagree with the target it was trained for.
"""

from __future__ import annotations

import json
import math
import shutil
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from specdec_rt.manifest_schema import PACKED_ROLES, TREE_ROLES

from .. import __version__
from ..errors import CorruptSourceError, ExportError, UnsupportedModelError, one_line
from ..gguf_meta import MAX_VOCAB
from ..manifest import SCHEMA_VERSION, file_table, onnx_section, write_manifest
from ..tokenizer import TOKENIZER_FILES
from .graph import HEAD_KEYS, build_head_onnx, target_tensors

__all__ = ["save_head", "load_head", "assemble_draft", "TARGET_TENSORS"]

# (shape, dtype) from a .npy header -> (acceptable, what is expected)
Check = Callable[[tuple[int, ...], np.dtype[Any]], tuple[bool, str]]
TARGET_TENSORS = ("embed_tokens.weight", "lm_head.weight", "cos_cache", "sin_cache", "norm.weight")


def save_head(path: Path, weights: dict[str, np.ndarray], vocab: np.ndarray, config: dict[str, Any]) -> Path:
    """Write the shippable head: float16 weights, vocab map, config."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, Any] = {k: np.asarray(weights[k], np.float32).astype(np.float16) for k in HEAD_KEYS}
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(
        tmp,
        vocab=np.asarray(vocab, np.int32),
        config=np.frombuffer(json.dumps(config, sort_keys=True).encode(), np.uint8),
        **arrays,
    )
    tmp.replace(path)
    return path


def load_head(path: Path) -> tuple[dict[str, npt.NDArray[np.float32]], npt.NDArray[np.int64], dict[str, Any]]:
    """(float32 weights, vocab [V'] int64, config) from :func:`save_head`'s file.

    The file is untrusted (a recipe ships it): it is read as a zip of ``.npy`` members, never
    with pickle; the config comes first and fixes every weight's shape, and each member's
    ``.npy`` header (shape, dtype) and its declared size in the zip are checked against those
    bounds before its data is read. Every failure is a `CorruptSourceError` naming the file
    and the array."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as archive:
            cfg = _read_config(archive, path)
            vocab = _read_vocab(archive, path, cfg)
            weights = _read_weights(archive, path, cfg)
    except ExportError:
        raise
    except (
        zipfile.BadZipFile,
        zlib.error,
        OSError,
        EOFError,
        ValueError,
        KeyError,
        NotImplementedError,
        RuntimeError,
    ) as exc:
        raise CorruptSourceError(f"{path}: not a readable trained head ({one_line(exc)})") from exc
    return weights, vocab, cfg


def _read_config(z: zipfile.ZipFile, path: Path) -> dict[str, Any]:
    """The ``config`` member: bounded uint8 JSON bytes, checked by :func:`_head_config`."""
    raw = _read_member(
        z,
        path,
        "config",
        lambda shape, dt: (
            len(shape) == 1 and shape[0] <= MAX_CONFIG_BYTES and dt == np.uint8,
            f"uint8 [<= {MAX_CONFIG_BYTES}]",
        ),
    )
    return _head_config(path, raw.tobytes())


def _read_vocab(z: zipfile.ZipFile, path: Path, cfg: dict[str, Any]) -> npt.NDArray[np.int64]:
    """The ``vocab`` member as int64 ids, non-negative and as many as the config's ``draft_vocab``."""
    vocab = _read_member(
        z,
        path,
        "vocab",
        lambda shape, dt: (
            len(shape) == 1 and 1 <= shape[0] <= MAX_VOCAB and dt.kind in "iu" and dt.itemsize <= 8,
            f"integer [1..{MAX_VOCAB}]",
        ),
    ).astype(np.int64)
    if vocab.min() < 0:
        raise CorruptSourceError(f"{path}: 'vocab' holds a negative token id {vocab.min()}")
    if cfg.get("draft_vocab") is not None and cfg["draft_vocab"] != vocab.size:
        raise CorruptSourceError(f"{path}: config draft_vocab {cfg['draft_vocab']!r} but 'vocab' has {vocab.size} ids")
    return vocab


def _read_weights(z: zipfile.ZipFile, path: Path, cfg: dict[str, Any]) -> dict[str, npt.NDArray[np.float32]]:
    """Every ``HEAD_KEYS`` member as float32, each of exactly the shape the config implies."""
    shapes = _head_shapes(cfg)
    total = sum(math.prod(s) for s in shapes.values())
    if total > MAX_HEAD_ELEMENTS:
        raise CorruptSourceError(f"{path}: its config implies {total} weights, more than {MAX_HEAD_ELEMENTS}")
    weights: dict[str, npt.NDArray[np.float32]] = {}
    for key in HEAD_KEYS:
        weights[key] = _read_member(z, path, key, _float_of_shape(shapes[key])).astype(np.float32)
    return weights


def _float_of_shape(want: tuple[int, ...]) -> Check:
    """A member check: float16 or float32 of exactly the shape ``want``."""

    def check(shape: tuple[int, ...], dt: np.dtype[Any]) -> tuple[bool, str]:
        return tuple(shape) == want and dt in (np.float16, np.float32), f"float16 {list(want)}"

    return check


MAX_CONFIG_BYTES = 1 << 20
MAX_HEAD_ELEMENTS = 1 << 30  # all weights together (a 7B model's head: ~2.5e8)
_CONFIG_INTS = {
    "hidden_size": 1 << 16,
    "num_heads": 1024,
    "num_kv_heads": 1024,
    "head_dim": 1024,
    "intermediate_size": 1 << 20,
}


def _read_member(z: zipfile.ZipFile, path: Path, key: str, check: Check) -> np.ndarray:
    """Array ``key`` of the zip ``z``: its .npy header is read first and ``check(shape, dtype)``
    -> (ok, what is expected) must pass, and the zip must declare exactly the bytes the header
    implies, before the data is read."""
    name = f"{key}.npy"
    try:
        info = z.getinfo(name)
    except KeyError:
        raise CorruptSourceError(f"{path}: not a trained head (no {key!r} array)") from None
    with z.open(info) as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise CorruptSourceError(f"{path}: {key!r} has unsupported .npy version {version}")
        ok, expected = check(shape, dtype) if not dtype.hasobject else (False, "")
        if not ok:
            raise CorruptSourceError(
                f"{path}: {key!r} is {dtype.str} {list(shape)}, expected {expected or 'numbers, not objects'}"
            )
        nbytes = math.prod(shape) * dtype.itemsize
        if info.file_size != f.tell() + nbytes:
            raise CorruptSourceError(
                f"{path}: {key!r} declares {list(shape)} ({nbytes} bytes) "
                f"but its zip member holds {info.file_size - f.tell()}"
            )
        data = f.read(nbytes)
        if len(data) != nbytes or f.read(1):
            raise CorruptSourceError(f"{path}: {key!r} is truncated")
    arr = np.frombuffer(data, dtype=dtype)
    return arr.reshape(shape[::-1]).T if fortran else arr.reshape(shape)


def _head_config(path: Path, raw: bytes) -> dict[str, Any]:
    """The head's JSON config, with the numbers the graph is sized from checked."""
    try:
        cfg = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise CorruptSourceError(f"{path}: 'config' is not JSON ({one_line(exc, 120)})") from None
    if not isinstance(cfg, dict):
        raise CorruptSourceError(f"{path}: 'config' is not a JSON object")
    for key, hi in _CONFIG_INTS.items():
        value = cfg.get(key)
        if type(value) is not int or not 1 <= value <= hi:
            raise CorruptSourceError(f"{path}: config {key} = {value!r} is not an integer from 1 to {hi}")
    eps = cfg.get("rms_eps")
    if not isinstance(eps, int | float) or type(eps) is bool or not math.isfinite(eps) or eps <= 0:
        raise CorruptSourceError(f"{path}: config rms_eps = {eps!r} is not a finite number > 0")
    if cfg["num_heads"] % cfg["num_kv_heads"] or cfg["head_dim"] % 2:
        raise CorruptSourceError(
            f"{path}: config num_heads {cfg['num_heads']} / num_kv_heads "
            f"{cfg['num_kv_heads']} / head_dim {cfg['head_dim']} do not fit "
            "(need a multiple and an even head size)"
        )
    return cfg


def _head_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Each trained tensor's shape (nn.Linear layout [out, in]) from the config."""
    H, F = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_heads"] * cfg["head_dim"], cfg["num_kv_heads"] * cfg["head_dim"]
    return {
        "fc": (H, 2 * H),
        "ln1": (H,),
        "q": (q, H),
        "k": (kv, H),
        "v": (kv, H),
        "o": (H, q),
        "ln2": (H,),
        "gate": (F, H),
        "up": (F, H),
        "down": (H, F),
        "norm": (H,),
    }


def assemble_draft(
    target_dir: Path,
    head_file: Path,
    out_dir: Path,
    *,
    name: str = "eagle",
    source: dict[str, Any] | None = None,
    validation: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Build ``out_dir`` (must not exist) as an EAGLE draft folder; returns its manifest."""
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    weights, vocab, cfg = load_head(head_file)
    tm = json.loads((target_dir / "manifest.json").read_text())
    _check_fits(head_file, cfg, vocab, target_dir=target_dir, arch=tm["architecture"])
    tensors = target_tensors(target_dir, TARGET_TENSORS)
    out_dir.mkdir(parents=True)
    graph = build_head_onnx(
        weights,
        cfg,
        vocab,
        embed=tensors["embed_tokens.weight"],
        lm_head=tensors["lm_head.weight"],
        cos=tensors["cos_cache"].astype(np.float32),  # float16 in a target with a float16 KV
        sin=tensors["sin_cache"].astype(np.float32),
        out_dir=out_dir,
    )
    np.save(out_dir / "vocab.npy", vocab)
    for fname in TOKENIZER_FILES:
        if (target_dir / fname).is_file():
            shutil.copy2(target_dir / fname, out_dir / fname)
    manifest = _draft_manifest(tm, cfg, vocab, name=name, graph=graph)
    manifest["source"] = source or {"kind": "trained head", "file": Path(head_file).name}
    manifest["training"] = cfg.get("training")
    manifest["validation"] = validation
    manifest["build"] = {"exporter": __version__}
    manifest["draft_of"] = tm["name"]
    manifest["files"] = file_table(out_dir)
    write_manifest(out_dir, manifest)
    return manifest


def _check_fits(
    head_file: Path, cfg: dict[str, Any], vocab: npt.NDArray[np.int64], *, target_dir: Path, arch: dict[str, Any]
) -> None:
    """The head must have the target's hidden and head sizes and only ids of its vocabulary."""
    if (
        cfg["hidden_size"] != arch["hidden_size"]
        or cfg["head_dim"] != arch["head_dim"]
        or vocab.max() >= arch["vocab_size"]
    ):
        raise UnsupportedModelError(
            f"{head_file}: trained for hidden size {cfg['hidden_size']} / head size "
            f"{cfg['head_dim']} / vocab {cfg.get('target_vocab_size')!r} (largest id "
            f"{vocab.max()}), the target {target_dir} has {arch['hidden_size']} / "
            f"{arch['head_dim']} / {arch['vocab_size']}"
        )


def _draft_manifest(
    tm: dict[str, Any], cfg: dict[str, Any], vocab: npt.NDArray[np.int64], *, name: str, graph: dict[str, Any]
) -> dict[str, Any]:
    """The draft folder's manifest up to ``drafts``/``exact_to``; the caller adds provenance and files."""
    arch = tm["architecture"]
    return {
        "schema_version": SCHEMA_VERSION,
        "name": name,
        "role": "draft",
        "builder": "native",
        "kind": "eagle",
        "architecture": {
            "family": "eagle",
            "num_layers": 1,
            "hidden_size": cfg["hidden_size"],
            "num_heads": cfg["num_heads"],
            "num_kv_heads": cfg["num_kv_heads"],
            "head_dim": cfg["head_dim"],
            "vocab_size": int(vocab.size),
            "max_positions": arch["max_positions"],
        },
        "draft_vocab": {"file": "vocab.npy", "size": int(vocab.size), "target_vocab_size": arch["vocab_size"]},
        "special_tokens": tm["special_tokens"],
        "tokenizer": tm["tokenizer"],
        "onnx": {
            **tm["onnx"],
            "quantization": None,
            "nodes": graph["nodes"],
            "inputs": {
                **{k: v for k, v in onnx_section(None)["inputs"].items() if k not in PACKED_ROLES + TREE_ROLES},
                "features": "features",
            },
        },
        "drafts": [],
        "exact_to": "a draft only: speculative output is exact to the target",
    }
