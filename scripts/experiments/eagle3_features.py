"""Does the EAGLE head agree with the target more often when it reads several target layers
(EAGLE-3 style) instead of the last one only? Same data, same training, side by side.

    python scripts/experiments/eagle3_features.py --shards 20 --sizes 5,10,20 --seeds 0,1 \
        --variants last-ce,layers                      # ~6 min of data, then ~35 min of training
    python scripts/experiments/eagle3_features.py --plot docs/img/train-draft-eagle3.png

1. data: the target (PyTorch, float32) answers the first ``--shards`` x 64 training prompts of
   ``export/draft/prompts.py`` greedily (as ``train-draft`` does), plus 96 validation prompts
   and the shipped held-out sets (``chat_general``, ``code_general``, the 40 benchmark prompts:
   never trained on). Every position keeps three features: the residual stream after layers
   ``LOW`` and ``MID`` and the normalised last hidden state h (what the shipped head reads).
2. train, one run per variant, the same batches, steps and seed (``export.draft.train``):
   ``last``      the shipped head: reads h, loss CE + 0.2 x smooth-L1(g, h_next)
   ``last-ce``   the same without the feature-regression term
   ``layers``    EAGLE-3 features: fuse = Linear([rms(low), rms(mid), h]) [3H] -> [H] replaces h
                 at depth 1; no regression term (its inputs at depth > 1 are its own outputs)
3. report: top-1 agreement with the target per draft depth (teacher-forced inputs, the head's
   own features from depth 2 on) on the validation and held-out sequences; JSON to OUT.

Resumable: finished shards are kept (``OUT/data``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from export.draft import data as D
from export.draft import train as T
from export.draft.prompts import split_of, training_prompts
from export.draft.run import TrainDraftRequest, _load_torch, _new_head, _target_dirs
from export.ui import Reporter

LOW, MID = 3, 15  # hidden_states indices: the residual stream after the 3rd and 15th of 30 layers


def hidden_features(model, **inputs):
    """The model's forward with every layer's output: (features [B, S, 3H], logits [B, S, V])."""
    out = model.model(**inputs, output_hidden_states=True)
    hs = out.hidden_states  # embeddings, then after every layer; the last one normalised
    h = out.last_hidden_state
    rms = lambda t: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6)  # noqa: E731
    # (normalised here: the residual stream has outliers near 10^4, kept as float16)
    return torch.cat([rms(hs[LOW]), rms(hs[MID]), h], -1), model.lm_head(h)


def make_shards(model, prompts, folder: Path, eos, *, log, batch=64, max_new=128):
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    for i in range(0, len(prompts), batch):
        path = D.shard_path(folder, i // batch)
        if path.exists():
            continue
        sh = D._generate_batch(model, prompts[i:i + batch], max_new, eos, topk=D.TOPK, features=hidden_features)
        np.savez(path.with_suffix(".tmp.npz"), **{k: getattr(sh, k) for k in D.Shard.__dataclass_fields__})
        path.with_suffix(".tmp.npz").rename(path)
        log(f"{folder.name}: shard {i // batch + 1}/{-(-len(prompts) // batch)}, "
            f"{sh.answer_tokens} answer tokens, {time.monotonic() - t0:.0f} s")
    return D.load_shards(folder)


class LayersHead(nn.Module):
    """EAGLE-3 input: fuse([rms(low), rms(mid), h]) -> [H] (the data holds them normalised),
    then the shipped head's layer."""

    def __init__(self, head, H: int):
        super().__init__()
        self.head, self.H = head, H
        self.fuse = nn.Linear(3 * H, H, bias=False)
        with torch.no_grad():  # starts as "take h"
            self.fuse.weight.zero_()
            self.fuse.weight[:, 2 * H:] = torch.eye(H)

    def features(self, x):
        return self.fuse(x)  # [..., 3H] -> [..., H]


def variant_losses(variant: str):
    """``export.draft.train._losses`` for a variant, on features [.., 3H] = [low, mid, h]."""
    def last(f):
        return f[..., 2 * (f.shape[-1] // 3):]  # h, what the shipped head reads

    if variant == "layers":  # the fused layers replace h at depth 1; no regression
        return lambda model, b, depth: T._losses(model.head, b, depth, inputs=model.features, feat_w=0.0)
    feat_w = T.FEAT_W if variant == "last" else 0.0
    return lambda model, b, depth: T._losses(model, b, depth, inputs=last, target=last, feat_w=feat_w)


def run_variant(variant, make_head, train_b, evals, *, cfg, log):
    """One training run (``export.draft.train.train``, in a scratch folder), then agreement on
    every evaluation set."""
    torch.manual_seed(cfg.seed)
    model = make_head()
    losses = variant_losses(variant)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as work:
        summary = T.train(model, train_b, evals["val"], cfg, work=Path(work), should_stop=None,
                          log=lambda msg: log(f"{variant}: {msg}"), losses=losses)
    out = {"train_s": round(time.monotonic() - t0, 1),
           "curve": [{**c, "val": np.round(c["val"], 4).tolist()} for c in summary["curve"]],
           "params": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    for name, bs in evals.items():
        out[name] = np.round(T.evaluate(model, bs, cfg.depth, losses), 4).tolist()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--out", type=Path, default=Path("~/.cache/specdec-rt/eagle3-exp"))
    ap.add_argument("--shards", type=int, default=10)
    ap.add_argument("--epochs", type=float, default=4.0)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--variants", default="last,last-ce,layers")
    ap.add_argument("--sizes", default="", help="also train on the first N shards, e.g. 5,10 (data scaling)")
    ap.add_argument("--seeds", default="0", help="training seeds, e.g. 0,1 (run-to-run noise)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plot", type=Path, help="only draw the report's runs into this PNG")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ui = Reporter()
    log = ui.log
    out = a.out.expanduser()
    if a.plot:
        return plot(json.loads((out / "report.json").read_text()), a.plot)
    folder, source = _target_dirs(TrainDraftRequest(target=a.target), ui)
    from specdec_rt.ort.manifest import load_manifest
    from specdec_rt.text.codec import TextCodec
    import importlib.resources

    tm = load_manifest(folder)
    codec = TextCodec.from_manifest(tm)
    enc = lambda m: codec.encode_prompt(m)  # noqa: E731
    allp = training_prompts(0)
    train_p = [enc([{"role": "user", "content": p}]) for p in allp if split_of(p) == "train"][: 64 * a.shards]
    val_p = [enc([{"role": "user", "content": p}]) for p in allp if split_of(p) == "val"][:96]
    held = []
    for name in ("chat_general.jsonl", "code_general.jsonl", "prompts.jsonl"):
        text = importlib.resources.files("specdec_rt.tooling.data").joinpath(name).read_text()
        held += [enc(json.loads(x)["messages"]) for x in text.splitlines() if x.strip()]
    eos = set(tm.eos_ids) or {0}
    model = None
    sets = {}
    for name, prompts in (("val", val_p), ("held_out", held), ("train", train_p)):
        if len(list((out / "data" / name).glob("shard-?????.npz"))) < -(-len(prompts) // 64):
            model = model or _load_torch(source)
            log(f"data: {name}, {len(prompts)} prompts")
        sets[name] = make_shards(model, prompts, out / "data" / name, eos, log=log) if model else \
            D.load_shards(out / "data" / name)
    del model
    sizes = sorted({int(x) for x in a.sizes.split(",") if x} | {a.shards})
    H = tm.hidden_size
    report = {"layers": [LOW, MID, "last"], "runs": {},
              "held_out_sequences": sum(len(s.prompt_lens) for s in sets["held_out"])}
    path = out / "report.json"
    if path.exists():
        report["runs"] = json.loads(path.read_text()).get("runs", {})
    for n in sizes:
        shards = sets["train"][:n]
        vocab = T.reduced_vocab(shards, 8192, list(tm.eos_ids))
        mk = lambda s: T.make_batches(s, vocab, 1024, tm.vocab_size)  # noqa: E731
        train_b, evals = mk(shards), {"val": mk(sets["val"]), "held_out": mk(sets["held_out"])}
        for seed in (int(x) for x in a.seeds.split(",")):
            cfg = T.TrainConfig(depth=a.depth, epochs=a.epochs, seed=seed)
            for v in a.variants.split(","):
                key = f"{v}/{n} shards/seed {seed}"
                if key in report["runs"]:
                    continue
                make = (lambda: LayersHead(_new_head(folder, tm, vocab)[0], H)) if v == "layers" else \
                    (lambda: _new_head(folder, tm, vocab)[0])
                r = run_variant(v, make, train_b, evals, cfg=cfg, log=log)
                r["answer_tokens"] = sum(s.answer_tokens for s in shards)
                report["runs"][key] = r
                log(f"{key}: " + json.dumps({k: x for k, x in r.items() if k != "curve"}))
                path.write_text(json.dumps(report, indent=1))


def plot(report: dict, path: Path) -> None:
    """Depth-1 agreement (validation and held-out) against answer tokens, a line per variant:
    the mean over seeds, each seed a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=False)
    names = {"last": "last layer (shipped)", "last-ce": "last layer, CE only",
             "layers": f"after layers {report['layers'][0]} and {report['layers'][1]}, and the last "
                       "(EAGLE-3 style)"}
    for ax, split in zip(axes, ("val", "held_out")):
        for v in ("last-ce", "layers"):
            pts = {}
            for key, r in report["runs"].items():
                if key.split("/")[0] == v:
                    pts.setdefault(r["answer_tokens"], []).append(r[split][0])
            xs = sorted(pts)
            line = ax.plot([x / 1e3 for x in xs], [np.mean(pts[x]) for x in xs], marker="o", label=names[v])
            for x in xs:
                ax.scatter([x / 1e3] * len(pts[x]), pts[x], s=10, color=line[0].get_color(), alpha=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xticks([x / 1e3 for x in xs], [f"{x / 1e3:.0f}" for x in xs])
        ax.minorticks_off()
        ax.set_xlabel("target-generated answer tokens (thousands)")
        ax.set_title({"val": "validation (training templates)",
                      "held_out": f"held-out prompts ({report['held_out_sequences']} sequences)"}[split])
        ax.set_ylabel("depth-1 top-1 agreement with the target")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(path)


if __name__ == "__main__":
    main()
