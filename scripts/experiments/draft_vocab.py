"""Would a draft that scores only part of the vocabulary pay? (FR-Spec / EAGLE-3's reduced draft
vocabulary, applied to a model draft.) Step cost against agreement, side by side.

    python scripts/experiments/draft_vocab.py qwen2.5-coder-1.5b 0.5b-q4 \
        --prompts specdec_rt/tooling/data/code_general.jsonl --sizes 16384,32768
    python scripts/experiments/draft_vocab.py smollm2-135m q8 \
        --prompts specdec_rt/tooling/data/chat_general.jsonl --sizes 8192,16384,32768

1. Copies of the draft whose LM head keeps only the first N token ids (a byte-level BPE
   vocabulary is roughly in merge order, i.e. by frequency in the tokenizer's corpus; with the
   first N ids a draft index is the token id, so nothing else changes). Needs ``onnx`` (the
   export extra).
2. One single-token draft step, every copy and the full draft interleaved (``--reps``, medians).
   ``--int4-head``: also a copy whose LM head is requantized from 8 to 4 bits (whole vocabulary).
3. The target answers each prompt greedily; the draft reads prompt and answer in one call
   (teacher-forced): the share of answer tokens inside the first N ids (coverage) and the
   draft's top-1 agreement with the target, full head against each reduced head.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from specdec_rt.engine.loading import ensure_built
from specdec_rt.ort.manifest import load_manifest
from specdec_rt.ort.model import OrtModel
from specdec_rt.text.codec import TextCodec


def save_copy(m, src: Path, dst: Path, vocab_size: int | None = None) -> Path:
    """Write graph ``m`` as a model folder ``dst``: ``src``'s other files, its manifest without
    the graph's hashes (and with ``vocab_size`` when given)."""
    import onnx

    dst.mkdir(parents=True)
    onnx.save(m, str(dst / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    for f in src.iterdir():
        if f.is_file() and f.name not in ("model.onnx", "model.onnx.data", "manifest.json") and not f.name.startswith("."):
            shutil.copy(f, dst / f.name)
    man = json.loads((src / "manifest.json").read_text())
    if vocab_size is not None:
        man["architecture"]["vocab_size"] = vocab_size
    for k in ("model.onnx", "model.onnx.data"):
        man.get("files", {}).pop(k, None)
    (dst / "manifest.json").write_text(json.dumps(man, indent=1))
    return dst


def reduced_copy(src: Path, dst: Path, n: int) -> Path:
    """``src`` with its (MatMulNBits) LM head cut to the first ``n`` rows; manifest says V = n."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(src / "model.onnx"))
    for t in m.graph.initializer:
        if t.name in ("lm_head.weight_q", "lm_head.scales"):
            t.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(t)[:n]), t.name))
    for node in m.graph.node:
        if node.name == "/lm_head/MatMulNBits":
            next(a for a in node.attribute if a.name == "N").i = n
    next(o for o in m.graph.output if o.name == "logits").type.tensor_type.shape.dim[-1].dim_value = n
    return save_copy(m, src, dst, vocab_size=n)


def int4_head_copy(src: Path, dst: Path) -> Path:
    """``src`` with its 8-bit LM head requantized to 4 bits (block 32, asymmetric; the layers as
    they are): a cheaper head over the whole vocabulary."""
    import onnx
    from onnx import helper, numpy_helper

    from export.quant import QuantizedWeight, QuantSpec, dequantize, quantize

    m = onnx.load(str(src / "model.onnx"))
    inits = {t.name: t for t in m.graph.initializer}
    node = next(n for n in m.graph.node if n.name == "/lm_head/MatMulNBits")
    attrs = {a.name: a.i for a in node.attribute}
    packed, scales = (numpy_helper.to_array(inits[k]) for k in ("lm_head.weight_q", "lm_head.scales"))
    zp = numpy_helper.to_array(inits[node.input[3]]) if len(node.input) > 3 and node.input[3] else None
    w = dequantize(QuantizedWeight(packed, scales, zp, attrs["K"], attrs["N"]),
                   QuantSpec(bits=8, symmetric=zp is None))  # [K, N]
    q = quantize(w, QuantSpec(bits=4))
    for name, arr in (("lm_head.weight_q", q.packed), ("lm_head.scales", q.scales)):
        inits[name].CopyFrom(numpy_helper.from_array(arr, name))
    m.graph.initializer.append(numpy_helper.from_array(q.zero_points, "lm_head.zero_points4"))
    del node.input[3:]
    node.input.append("lm_head.zero_points4")
    for a in node.attribute:
        if a.name == "bits":
            a.CopyFrom(helper.make_attribute("bits", 4))
    return save_copy(m, src, dst)


def step_times(models: dict[str, OrtModel], reps: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    runs = {}
    for name, m in models.items():
        s = m.start()
        s.run_sync(rng.integers(100, 8000, size=120).astype(np.int64), 1, 0)
        runs[name] = (s, s.length)
    times = {name: [] for name in models}
    for _ in range(reps):
        for name, (s, base) in runs.items():
            for j in range(4):
                t = time.perf_counter()
                s.run_sync(rng.integers(100, 8000, size=1).astype(np.int64), 1, base + j)
                times[name].append(time.perf_counter() - t)
            s.rollback(base)
    return {name: float(np.median(t)) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target")
    ap.add_argument("draft", help="a draft name of the target's manifest")
    ap.add_argument("--prompts", required=True, help="JSONL with messages")
    ap.add_argument("--sizes", default="16384,32768", help="heads cut to the first N ids ('' for none)")
    ap.add_argument("--int4-head", action="store_true", help="also a copy with its head requantized to 4 bits")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    folder = ensure_built(a.target)
    tm = load_manifest(folder)
    sizes = [int(x) for x in a.sizes.split(",") if x]
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"full": tm.draft_dir(a.draft)}
        for n in sizes:
            paths[f"first {n}"] = reduced_copy(paths["full"], Path(tmp) / str(n), n)
        if a.int4_head:
            paths["int4 head"] = int4_head_copy(paths["full"], Path(tmp) / "int4-head")
        drafts = {k: OrtModel(p, max_length=1024, threads=2) for k, p in paths.items()}
        t = step_times(drafts, a.reps)
        print("draft step: " + ", ".join(f"{k} {v * 1e3:.2f} ms ({v / t['full']:.2f}x)" for k, v in t.items()))
        target, codec = OrtModel(folder, max_length=1024, threads=2), TextCodec.from_manifest(tm)
        eos = set(tm.eos_ids)
        agree = {k: [] for k in drafts}
        answers = []
        for line in Path(a.prompts).read_text().splitlines():
            ids = np.array(codec.encode_prompt(json.loads(line)["messages"]), dtype=np.int64)
            s, out = target.start(), []
            x = int(np.argmax(s.run_sync(ids, 1, 0)[-1]))
            while len(out) < a.max_new_tokens and x not in eos:
                out.append(x)
                x = int(np.argmax(s.run_sync(np.array([x], dtype=np.int64), 1, s.length)[-1]))
            s.close()
            if len(out) < 2:
                continue
            answers += out
            seq = np.concatenate([ids, out])
            for k, d in drafts.items():  # the draft's guess at each answer position
                ds = d.start()
                logits = ds.run_sync(seq[:-1], len(out), 0)  # [len(out), V']
                agree[k] += (np.argmax(logits, -1) == np.array(out)).tolist()
                ds.close()
        answers = np.array(answers)
        for n in sizes:
            print(f"first {n} ids cover {np.mean(answers < n):.3f} of {answers.size} answer tokens")
        print("teacher-forced top-1 agreement: " + ", ".join(f"{k} {np.mean(v):.3f}" for k, v in agree.items()))


if __name__ == "__main__":
    main()
