"""Teacher-forced corpus data against self-generated answers: throughput on this machine, and
the corpus shards built into a `train-draft` work folder (which `train-draft --corpus` resumes).

    python scripts/experiments/corpus_throughput.py --out ~/.cache/specdec-rt/train-draft/smollm2-135m-corpus \
        --sources all --positions 1000000 --minutes 40

1. collects the corpus (``OUT/work/corpus``: windows + per-source record), as ``train-draft
   --corpus SOURCES --corpus-tokens N`` does;
2. times one batch of greedy answers (``--answer-batch`` prompts x ``--answer-tokens`` tokens,
   the data stage's code) and one teacher-forced shard, back to back, wall and process CPU time;
3. writes teacher-forced shards into ``OUT/work/data/corpus`` until ``--positions`` or
   ``--minutes``; the log line of each shard has positions/s and positions per CPU-second.
Prints a JSON summary (also ``OUT/throughput.json``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def _timed(fn):
    t0, c0 = time.monotonic(), time.process_time()
    out = fn()
    return out, time.monotonic() - t0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sources", default="all")
    ap.add_argument("--positions", type=int, default=1_000_000)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--per-shard", type=int, default=32)
    ap.add_argument("--answer-batch", type=int, default=16)
    ap.add_argument("--answer-tokens", type=int, default=64)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    deadline = time.monotonic() + 60 * args.minutes

    import torch

    from export.draft.corpus import (
        CorpusSpec,
        build_corpus,
        corpus_shards,
        load_corpus,
        parse_sources,
        save_corpus,
        teacher_forced,
    )
    from export.draft.data import _generate_batch
    from export.draft.run import TrainDraftRequest, _load_torch, _prompts, _target_dirs
    from export.ui import Reporter
    from specdec_rt.ort.manifest import load_manifest
    from specdec_rt.text.codec import TextCodec

    torch.set_num_threads(args.threads)
    ui = Reporter()
    req = TrainDraftRequest(target=args.target, prompts=args.answer_batch)
    folder, source = _target_dirs(req, ui)
    tm = load_manifest(folder)
    codec = TextCodec.from_manifest(tm)
    work = args.out.expanduser() / "work"
    corpus = load_corpus(work / "corpus")
    if corpus is None:
        spec = CorpusSpec(
            sources=tuple(parse_sources(args.sources)), window=args.window, max_tokens_per_source=args.positions
        )
        corpus, wall, cpu = _timed(lambda: build_corpus(spec, codec.encode))
        save_corpus(work / "corpus", corpus)
        ui.log(f"corpus: collected {len(corpus):,} windows, {corpus.positions:,} positions in {wall:.0f} s")
    summary: dict = {"sources": json.loads((work / "corpus" / "sources.json").read_text())}
    model, wall, _ = _timed(lambda: _load_torch(source))
    ui.log(f"target loaded in {wall:.0f} s")
    train_ids, _ = _prompts(req, codec)
    eos = set(tm.eos_ids) or {0}
    shard, wall, cpu = _timed(
        lambda: _generate_batch(model, train_ids[: args.answer_batch], args.answer_tokens, eos, topk=8)
    )
    summary["answers"] = {"tokens": shard.answer_tokens, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}
    ui.log(
        f"answers: {shard.answer_tokens} tokens, {shard.answer_tokens / wall:.0f}/s, {shard.answer_tokens / cpu:.0f} per CPU-s"
    )
    wins = [corpus.window(i) for i in range(min(8, len(corpus)))]
    shard, wall, cpu = _timed(lambda: teacher_forced(model, wins))
    summary["teacher_forced"] = {"positions": shard.answer_tokens, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}
    ui.log(
        f"teacher forced: {shard.answer_tokens} positions, {shard.answer_tokens / wall:.0f}/s, {shard.answer_tokens / cpu:.0f} per CPU-s"
    )
    (args.out.expanduser() / "throughput.json").write_text(json.dumps(summary, indent=1))
    (have, wall, cpu) = _timed(
        lambda: corpus_shards(
            model,
            corpus,
            work / "data" / "corpus",
            per_shard=args.per_shard,
            positions_goal=min(args.positions, corpus.positions),
            deadline=deadline,
            log=ui.log,
        )
    )
    summary["built"] = {"positions_on_disk": have, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}
    (args.out.expanduser() / "throughput.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "sources"}))


if __name__ == "__main__":
    main()
