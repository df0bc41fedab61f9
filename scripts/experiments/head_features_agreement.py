"""Teacher-forced agreement of a trained EAGLE head when its features come from the float32
target or from a quantized copy: the run's validation answers are read by each target (ONNX
Runtime, one forward per sequence), and the head's top-1 agreement with that target's own
argmax is measured per depth, as train-draft's validation does.

    python scripts/experiments/head_features_agreement.py RUN_DIR TARGET_DIR [TARGET_DIR ...] \
        [--depth 3] [--cache DIR] [--out FILE]

RUN_DIR is a train-draft output folder (head.npz, work/vocab.npy, work/data/val) and is only
read; the relabelled shards go to --cache. Used for "A head on quantized targets" in
docs/train-draft.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from export.draft.data import Shard, load_shards
from export.draft.relabel import open_features_model, relabel_shards
from export.draft.run import _load_weights, _new_head
from export.draft.train import evaluate, make_batches
from specdec_rt.ort.manifest import load_manifest


def compare(base: list[Shard], other: list[Shard]) -> dict[str, float]:
    """How far ``other``'s features and argmax are from ``base``'s (same tokens)."""
    fa = np.concatenate([s.feats for s in base]).astype(np.float32)
    fb = np.concatenate([s.feats for s in other]).astype(np.float32)
    ta = np.concatenate([s.topk_ids[:, 0] for s in base])
    tb = np.concatenate([s.topk_ids[:, 0] for s in other])
    rel = np.linalg.norm(fb - fa, axis=-1) / np.maximum(np.linalg.norm(fa, axis=-1), 1e-6)
    return {
        "feature_rel_err_mean": round(float(rel.mean()), 4),
        "feature_rel_err_p99": round(float(np.quantile(rel, 0.99)), 4),
        "argmax_same": round(float((ta == tb).mean()), 4),
        "positions": int(ta.size),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("run", type=Path)
    ap.add_argument("targets", type=Path, nargs="+")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/headq/relabel"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    run = args.run.expanduser()
    target0 = Path(json.loads((run / "report.json").read_text())["target"])
    tm = load_manifest(target0)
    vocab = np.load(run / "work" / "vocab.npy")
    head, _ = _new_head(target0, tm, vocab)
    _load_weights(head, run / "head.npz")
    stored = load_shards(run / "work" / "data" / "val")
    rows: list[dict[str, Any]] = []
    first: list[Shard] | None = None
    for target in args.targets:
        target = target.expanduser()
        dst = args.cache / target.name / "val"
        model = open_features_model(target, max_length=2048, threads=args.threads)
        relabel_shards(model, run / "work" / "data" / "val", dst, log=print)
        model.close()
        shards = load_shards(dst)
        first = first or shards
        batches = make_batches(shards, vocab, 1024, tm.vocab_size)
        top1 = evaluate(head, batches, args.depth)
        row = {
            "target": str(target),
            "val_top1": [round(x, 4) for x in top1],
            "vs_stored_pytorch": compare(stored, shards),
            "vs_first_target": compare(first, shards),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
        if args.out:
            args.out.write_text(json.dumps(rows, indent=1))
    stored_top1 = evaluate(head, make_batches(stored, vocab, 1024, tm.vocab_size), args.depth)
    print(json.dumps({"target": "stored (PyTorch float32)", "val_top1": [round(x, 4) for x in stored_top1]}))


if __name__ == "__main__":
    main()
