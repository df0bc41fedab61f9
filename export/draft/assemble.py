"""Trained head weights (a small ``.npz``) + a built target folder -> an EAGLE draft folder.

The ``.npz`` is what ships in git: the trained tensors in float16 (``HEAD_KEYS``), the reduced
vocabulary ``vocab`` [V'] int32 and the ``config`` (JSON). Everything else the draft graph needs
(the embedding table, LM-head rows, rotary tables) is read from the target's own folder, so the
draft stays a few MB and can never disagree with the target it was trained for.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from .. import __version__
from ..manifest import SCHEMA_VERSION, file_table, onnx_section, write_manifest
from ..graph import PACKED_ROLES, TREE_ROLES
from .graph import HEAD_KEYS, build_head_onnx, target_tensors

__all__ = ["save_head", "load_head", "assemble_draft", "TARGET_TENSORS"]

TARGET_TENSORS = ("embed_tokens.weight", "lm_head.weight", "cos_cache", "sin_cache", "norm.weight")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


def save_head(path: Path, weights: dict[str, np.ndarray], vocab: np.ndarray, config: dict) -> Path:
    """Write the shippable head: float16 weights, vocab map, config."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {k: np.asarray(weights[k], np.float32).astype(np.float16) for k in HEAD_KEYS}
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, vocab=np.asarray(vocab, np.int32),
                        config=np.frombuffer(json.dumps(config, sort_keys=True).encode(), np.uint8),
                        **arrays)
    tmp.replace(path)
    return path


def load_head(path: Path) -> tuple[dict[str, np.ndarray], np.ndarray, dict]:
    """(float32 weights, vocab [V'] int64, config) from :func:`save_head`'s file."""
    with np.load(Path(path)) as z:
        missing = [k for k in (*HEAD_KEYS, "vocab", "config") if k not in z.files]
        if missing:
            raise ValueError(f"{path}: not a trained head (missing {missing})")
        weights = {k: z[k].astype(np.float32) for k in HEAD_KEYS}
        return weights, z["vocab"].astype(np.int64), json.loads(bytes(z["config"]).decode())


def assemble_draft(target_dir: Path, head_file: Path, out_dir: Path, *, name: str = "eagle",
                   source: dict | None = None, validation: dict | None = None) -> dict:
    """Build ``out_dir`` (must not exist) as an EAGLE draft folder; returns its manifest."""
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    weights, vocab, cfg = load_head(head_file)
    tm = json.loads((target_dir / "manifest.json").read_text())
    arch = tm["architecture"]
    if cfg["hidden_size"] != arch["hidden_size"] or vocab.max() >= arch["vocab_size"]:
        raise ValueError(f"{head_file}: trained for hidden size {cfg['hidden_size']} / vocab "
                         f"{cfg.get('target_vocab_size')}, the target {target_dir} has "
                         f"{arch['hidden_size']} / {arch['vocab_size']}")
    t = target_tensors(target_dir, TARGET_TENSORS)
    out_dir.mkdir(parents=True)
    graph = build_head_onnx(weights, cfg, vocab, t["embed_tokens.weight"], t["lm_head.weight"],
                            t["cos_cache"], t["sin_cache"], out_dir)
    np.save(out_dir / "vocab.npy", vocab)
    for fname in TOKENIZER_FILES:
        if (target_dir / fname).is_file():
            shutil.copy2(target_dir / fname, out_dir / fname)
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "name": name,
        "role": "draft",
        "kind": "eagle",
        "architecture": {"family": "eagle", "num_layers": 1, "hidden_size": cfg["hidden_size"],
                         "num_heads": cfg["num_heads"], "num_kv_heads": cfg["num_kv_heads"],
                         "head_dim": cfg["head_dim"], "vocab_size": int(vocab.size),
                         "max_positions": arch["max_positions"]},
        "draft_vocab": {"file": "vocab.npy", "size": int(vocab.size),
                        "target_vocab_size": arch["vocab_size"]},
        "special_tokens": tm["special_tokens"],
        "tokenizer": tm["tokenizer"],
        "onnx": {**tm["onnx"], "quantization": None, "nodes": graph["nodes"],
                 "inputs": {**{k: v for k, v in onnx_section(None)["inputs"].items() if k not in PACKED_ROLES + TREE_ROLES},
                            "features": "features"}},
        "drafts": [],
        "exact_to": "a draft only: speculative output is exact to the target",
        "source": source or {"kind": "trained head", "file": Path(head_file).name},
        "training": cfg.get("training"),
        "validation": validation,
        "build": {"exporter": __version__},
        "draft_of": tm["name"],
    }
    manifest["files"] = file_table(out_dir)
    write_manifest(out_dir, manifest)
    return manifest
