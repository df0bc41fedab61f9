"""Data-scaling curve for the EAGLE head: train on the first N shards of a train-draft run's data
(same settings as the full run), then measure acceptance on held-out prompts through the runtime.

    python scripts/experiments/draft_scaling.py RUN_DIR N [N ...]      # e.g. 10 20 (of 41 shards)

Writes RUN_DIR/scaling-<N>/ (checkpoints, head, draft, report.json). Used for the
"how much more data" curve in docs/train-draft.md.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from export.draft.assemble import assemble_draft, save_head
from export.draft.data import load_shards
from export.draft.evaluate import measure_acceptance
from export.draft.run import _eval_prompts, _new_head, _weights
from export.draft.train import TrainConfig, make_batches, reduced_vocab, train
from specdec_rt.ort.manifest import load_manifest


def main(run: Path, sizes: list[int]) -> None:
    settings = json.loads((run / "work" / "run.json").read_text())["request"]
    target = Path(json.loads((run / "report.json").read_text())["target"])
    tm = load_manifest(target)
    all_train = load_shards(run / "work" / "data" / "train")
    val = load_shards(run / "work" / "data" / "val")
    torch.set_num_threads(2)
    for n in sizes:
        out = run / f"scaling-{n}"
        out.mkdir(exist_ok=True)
        shards = all_train[:n]
        vocab = reduced_vocab(shards, int(settings["vocab_size"]), list(tm.eos_ids))
        head, cfg = _new_head(target, tm, vocab)
        tb = make_batches(shards, vocab, int(settings["batch_tokens"]), tm.vocab_size)
        vb = make_batches(val, vocab, int(settings["batch_tokens"]), tm.vocab_size)
        tcfg = TrainConfig(
            depth=int(settings["depth"]),
            lr=float(settings["lr"]),
            epochs=4.0,
            batch_tokens=int(settings["batch_tokens"]),
        )
        t0 = time.monotonic()
        summary = train(head, tb, vb, tcfg, work=out, should_stop=None, log=lambda s: print(f"[{n}] {s}", flush=True))
        head.load_state_dict(torch.load(out / "best.pt", weights_only=True), strict=False)
        hf = save_head(out / "head.npz", _weights(head), vocab, {**cfg.to_dict(), "target_vocab_size": tm.vocab_size})
        draft = out / "draft"
        if draft.exists():
            import shutil

            shutil.rmtree(draft)
        assemble_draft(target, hf, draft)
        acc = measure_acceptance(target, draft, _eval_prompts(14), k=4, max_new_tokens=64, threads=2)
        rep = {
            "shards": n,
            "answer_tokens": sum(s.answer_tokens for s in shards),
            "train_seconds": round(time.monotonic() - t0),
            "val_top1": summary["curve"][-1]["val"],
            "heldout": acc,
        }
        (out / "report.json").write_text(json.dumps(rep, indent=1))
        print(json.dumps(rep), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), [int(x) for x in sys.argv[2:]])
