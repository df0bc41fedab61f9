"""A short fine-tune of a trained EAGLE head on a quantized target's features against the same
fine-tune on the float32 features: both start from the run's head.npz, take the same steps over
the run's answer shards, and are scored on the quantized target's validation features and labels.

    python scripts/experiments/head_finetune_features.py RUN_DIR TARGET_DIR [--epochs 1] [--lr 2e-4]

RUN_DIR is a train-draft output folder and is only read; the relabelled shards go to --cache
(the validation ones as head_features_agreement.py writes them). Used for "A head on quantized
targets" in docs/train-draft.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from export.draft.data import load_shards
from export.draft.relabel import open_features_model, relabel_shards
from export.draft.run import _load_weights, _new_head
from export.draft.train import TrainConfig, evaluate, make_batches, train
from specdec_rt.ort.manifest import load_manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("run", type=Path)
    ap.add_argument("target", type=Path)
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/headq/relabel"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    run, target = args.run.expanduser(), args.target.expanduser()
    target0 = Path(json.loads((run / "report.json").read_text())["target"])
    tm = load_manifest(target0)
    vocab = np.load(run / "work" / "vocab.npy")
    model = open_features_model(target, max_length=2048, threads=args.threads)
    for part in ("val", "train"):
        relabel_shards(model, run / "work" / "data" / part, args.cache / target.name / part, log=print)
    model.close()
    val_b = make_batches(load_shards(args.cache / target.name / "val"), vocab, 1024, tm.vocab_size)
    sources = {"float32": run / "work" / "data" / "train", target.name: args.cache / target.name / "train"}
    for name, folder in sources.items():
        head, _ = _new_head(target0, tm, vocab)
        _load_weights(head, run / "head.npz")
        before = evaluate(head, val_b, 3)
        train_b = make_batches(load_shards(folder), vocab, 1024, tm.vocab_size)
        cfg = TrainConfig(depth=2, lr=args.lr, epochs=args.epochs, warmup=5, eval_every=10**6)
        start = time.monotonic()
        with tempfile.TemporaryDirectory() as work:
            summary = train(head, train_b, val_b, cfg, work=Path(work), should_stop=None, log=lambda _: None)
        after = evaluate(head, val_b, 3)
        row = {
            "features": name,
            "steps": summary["step"],
            "seconds": round(time.monotonic() - start),
            "val_top1_before": [round(x, 4) for x in before],
            "val_top1_after": [round(x, 4) for x in after],
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
