"""Measurements behind docs/export.md: `python -m export.measure OUT_DIR [--threads 2]`.

For an exported folder (and its drafts) prints JSON with:
  * nodes before/after ONNX Runtime's ORT_ENABLE_ALL optimization,
  * rollback: max |diff| between a fresh run and a run after garbage was written past L,
  * step timings (median ms): 1 new token at context 100 and `--long` (2000), 5 new tokens
    at 100,
  * greedy agreement of each draft with the target, teacher-forced on the target's greedy
    continuation of a few prompts.
Timings repeat one call at a fixed past length (rollback makes that legitimate).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from .errors import SourceNotFoundError
from .manifest import read_manifest
from .validate import KVSession

PROMPTS = [
    "<|im_start|>user\nWrite a Python function that returns the n-th Fibonacci number.<|im_end|>\n"
    "<|im_start|>assistant\n",
    "<|im_start|>user\nWhat is the capital of France? Answer in one sentence.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nExplain what a hash map is to a beginner.<|im_end|>\n<|im_start|>assistant\n",
]


def _manifest(folder: Path) -> dict[str, Any]:
    """The folder's manifest; `SourceNotFoundError` when it has no readable one."""
    manifest = read_manifest(folder)
    if manifest is None:
        raise SourceNotFoundError(f"{folder} has no readable manifest.json")
    return manifest


def node_counts(folder: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Nodes in model.onnx, and after ORT_ENABLE_ALL (saved optimized graph)."""
    model = Path(folder) / manifest["onnx"]["file"]
    before = len(onnx.load(str(model), load_external_data=False).graph.node)
    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()  # one thread, full optimization, the optimized graph saved
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3
        so.intra_op_num_threads = 1
        so.optimized_model_filepath = str(Path(tmp) / "opt.onnx")
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "opt.onnx.data")
        ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
        opt = onnx.load(so.optimized_model_filepath, load_external_data=False)
        ops: dict[str, int] = {}
        for n in opt.graph.node:
            ops[n.op_type] = ops.get(n.op_type, 0) + 1
    return {"nodes": before, "nodes_optimized": len(opt.graph.node), "optimized_ops": ops}


def _median_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def step_times(
    folder: Path, manifest: dict[str, Any], threads: int, *, repeat: int = 20, long: int = 2000
) -> dict[str, float]:
    """Median ms for 1 token at past 100 / `long` and 5 tokens at past 100."""
    vocab = manifest["architecture"]["vocab_size"]
    rng = np.random.default_rng(0)
    sess = KVSession(folder, manifest, max_len=long + 100, threads=threads)
    filler = rng.integers(0, vocab, long)
    for start in range(0, long, 500):  # fill the cache in chunks
        sess.forward(filler[start : start + 500], start, rows=[0])
    one, five = rng.integers(0, vocab, 1), rng.integers(0, vocab, 5)
    out = {
        "decode_ms_ctx100": _median_ms(lambda: sess.forward(one, 100), repeat),
        f"decode_ms_ctx{long}": _median_ms(lambda: sess.forward(one, long), repeat),
        "chunk5_ms_ctx100": _median_ms(lambda: sess.forward(five, 100), repeat),
    }
    out[f"ctx{long}_over_ctx100"] = out[f"decode_ms_ctx{long}"] / out["decode_ms_ctx100"]
    out["chunk5_over_1"] = out["chunk5_ms_ctx100"] / out["decode_ms_ctx100"]
    return out


def rollback_check(folder: Path, manifest: dict[str, Any], threads: int) -> float:
    """Max |diff| of logits at past L between a fresh session and one that first wrote
    garbage at L .. L+9 (a rejected verify), then rolled back to L."""
    vocab = manifest["architecture"]["vocab_size"]
    rng = np.random.default_rng(1)
    prefix, new, garbage = (rng.integers(0, vocab, n) for n in (40, 4, 10))
    fresh = KVSession(folder, manifest, max_len=64, threads=threads)
    fresh.forward(prefix, 0, rows=[0])
    want = fresh.forward(new, 40)
    dirty = KVSession(folder, manifest, max_len=64, threads=threads)
    dirty.forward(prefix, 0, rows=[0])
    dirty.forward(garbage, 40)
    got = dirty.forward(new, 40)
    return float(np.abs(got - want).max())


def greedy(sess: KVSession, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation of `prompt` (n tokens) through a KVSession."""
    seq = list(prompt)
    logits = sess.forward(prompt, 0, rows=[len(prompt) - 1])
    for _ in range(n):
        seq.append(int(logits[-1].argmax()))
        logits = sess.forward(seq[-1:], len(seq) - 1)
    return seq


def agreement(target_dir: Path, draft_dir: Path, threads: int, n: int = 40) -> float:
    """Fraction of positions where the draft's argmax equals the target's, on the target's
    greedy continuations of PROMPTS (teacher-forced)."""
    from tokenizers import Tokenizer

    tman, dman = _manifest(target_dir), _manifest(draft_dir)
    tok = Tokenizer.from_file(str(Path(target_dir) / "tokenizer.json"))
    target = KVSession(target_dir, tman, max_len=256, threads=threads)
    draft = KVSession(draft_dir, dman, max_len=256, threads=threads)
    hits = total = 0
    for text in PROMPTS:
        prompt = tok.encode(text, add_special_tokens=False).ids
        seq = greedy(target, prompt, n)
        guess = draft.forward(seq, 0, rows=np.arange(len(prompt) - 1, len(seq) - 1))
        hits += int((guess.argmax(axis=1) == np.array(seq[len(prompt) :])).sum())
        total += n
    return hits / total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m export.measure")
    p.add_argument("folder", type=Path)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--long", type=int, default=2000, help="the long context to time")
    args = p.parse_args(argv)
    target = _manifest(args.folder)
    folders = [(target["name"], args.folder, target)] + [
        (d["name"], args.folder / d["path"], _manifest(args.folder / d["path"])) for d in target.get("drafts", [])
    ]
    report: dict[str, dict[str, Any]] = {}
    for name, folder, man in folders:
        row = {
            **node_counts(folder, man),
            **step_times(folder, man, args.threads, repeat=args.repeat, long=args.long),
            "rollback_max_diff": rollback_check(folder, man, args.threads),
        }
        if folder != args.folder:
            row["greedy_agreement_with_target"] = agreement(args.folder, folder, args.threads)
        report[name] = row
        print(json.dumps({name: row}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
