"""Train the EAGLE-style head on self-distillation shards; resumable, time-boxed, with a curve.

Loss at draft depth s and position j (only where x_{j+2} is an answer token):
    CE(P_{j+1} restricted to V' and renormalised, softmax(g^(s)_j W^T)) + FEAT_W * SmoothL1(g^(s)_j, h_{j+1})
weighted by DEPTH_W[s]. P is the target's top-k (soft labels), not just its argmax.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from .data import Sequence, Shard
from .eagle import EagleHead

__all__ = ["TrainConfig", "Batch", "make_batches", "reduced_vocab", "train", "evaluate", "load_checkpoint"]

_Optim = tuple[list[torch.nn.Parameter], torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]
FEAT_W = 0.2
DEPTH_W = (1.0, 0.8, 0.6, 0.5)
# (head, batch, depth) -> per depth (loss, top-1 agreements, positions); see _losses
Losses = Callable[[Any, "Batch", int], list[tuple[Any, int, int]]]


@dataclass
class TrainConfig:
    depth: int = 2
    lr: float = 8e-4
    weight_decay: float = 0.01
    batch_tokens: int = 1024
    epochs: float = 5.0
    warmup: int = 50
    eval_every: int = 100  # optimizer steps
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T] int64 (padded with 0)
    feats: torch.Tensor  # [B, T-1, H] float32
    label_idx: torch.Tensor  # [B, T-1, K] int64 into V' (0 where masked)
    label_p: torch.Tensor  # [B, T-1, K] float32 (0 outside V' / padding), rows sum to 1 or 0
    loss_mask: torch.Tensor  # [B, T-1] bool: position j predicts an answer token x_{j+2}
    n_tokens: int

    def to(self, device: Any) -> "Batch":
        if self.tokens.device == torch.device(device):
            return self
        return Batch(
            tokens=self.tokens.to(device),
            feats=self.feats.to(device),
            label_idx=self.label_idx.to(device),
            label_p=self.label_p.to(device),
            loss_mask=self.loss_mask.to(device),
            n_tokens=self.n_tokens,
        )


def reduced_vocab(
    shards: list[Shard], size: int, always: list[int], *, more: tuple[list[Shard], ...] | list[list[Shard]] = ()
) -> np.ndarray:
    """The ``size`` tokens the target predicts most often (argmax, then answer tokens), plus
    ``always`` (eos); sorted ids [V'] int64 -- index i of the draft's output is token ids[i].

    ``more``: other groups of shards (the corpus) counted with the same total weight as
    ``shards`` each, so a large corpus does not push out the answers' tokens."""
    weights: dict[int, float] = {}
    for group in (shards, *more):
        counts: dict[int, int] = {}
        for sh in group:
            for arr in (sh.topk_ids[:, 0], sh.tokens):
                u, c = np.unique(arr, return_counts=True)
                for a, b in zip(u.tolist(), c.tolist()):
                    counts[a] = counts.get(a, 0) + b
        total = sum(counts.values()) or 1
        for token, n in counts.items():
            weights[token] = weights.get(token, 0.0) + n / total
    ranked = [t for t, _ in sorted(weights.items(), key=lambda kv: (-kv[1], kv[0]))]
    keep = list(dict.fromkeys(list(always) + ranked))[:size]
    return np.array(sorted(keep), dtype=np.int64)


def make_batches(shards: list[Shard], vocab: np.ndarray, batch_tokens: int, full_vocab: int) -> list[Batch]:
    """Length-bucketed batches of whole sequences."""
    lookup = np.full(full_vocab, -1, dtype=np.int64)
    lookup[vocab] = np.arange(vocab.size)
    seqs = [s for sh in shards for s in sh.sequences() if len(s[0]) >= 3]
    seqs.sort(key=lambda s: len(s[0]))
    batches: list[Batch] = []
    cur: list[Sequence] = []
    for s in seqs:
        cur.append(s)
        if len(cur) * len(s[0]) >= batch_tokens:
            batches.append(_collate(cur, lookup))
            cur = []
    if cur:
        batches.append(_collate(cur, lookup))
    return batches


def _collate(seqs: list[Sequence], lookup: npt.NDArray[np.int64]) -> Batch:
    B, T = len(seqs), max(len(s[0]) for s in seqs)
    H, K = seqs[0][2].shape[1], seqs[0][3].shape[1]
    tokens = np.zeros((B, T), np.int64)
    feats = np.zeros((B, T - 1, H), np.float32)
    idx = np.zeros((B, T - 1, K), np.int64)
    p = np.zeros((B, T - 1, K), np.float32)
    mask = np.zeros((B, T - 1), bool)
    n = 0
    for b, (tok, plen, f, ti, tp) in enumerate(seqs):
        t = len(tok)
        tokens[b, :t] = tok
        feats[b, : t - 1] = f
        # position j's label is P_{j+1}: the distribution of x_{j+2}
        li = lookup[ti[1:]]  # [t-2, K]
        lp = np.where(li >= 0, tp[1:].astype(np.float32), 0.0)
        s = lp.sum(-1, keepdims=True)
        lp = np.divide(lp, s, out=np.zeros_like(lp), where=s > 0)
        idx[b, : t - 2] = np.maximum(li, 0)
        p[b, : t - 2] = lp
        j = np.arange(t - 2)
        m = (j + 2 >= plen) & (s[:, 0] > 0)
        mask[b, : t - 2] = m
        n += int(m.sum())
    return Batch(
        tokens=torch.from_numpy(tokens),
        feats=torch.from_numpy(feats),
        label_idx=torch.from_numpy(idx),
        label_p=torch.from_numpy(p),
        loss_mask=torch.from_numpy(mask),
        n_tokens=n,
    )


def _losses(
    head: EagleHead,
    b: Batch,
    depth: int,
    *,
    inputs: Callable[[Any], Any] | None = None,
    target: Callable[[Any], Any] | None = None,
    feat_w: float = FEAT_W,
) -> list[tuple[Any, int, int]]:
    """Per depth: (loss, top-1 agreement count, positions). Top-1: the draft's argmax equals
    the target's argmax (label index 0, the largest soft label). ``inputs`` / ``target`` map
    the batch's features to what the head reads at depth 1 and to the h its guesses are
    regressed on (default: the features themselves; experiments with wider features, e.g.
    EAGLE-3's several layers, pass their own); ``feat_w`` weighs that regression."""
    b = b.to(next(head.parameters()).device)
    h = b.feats if target is None else target(b.feats)  # [B, T-1, H]
    outs = head.unrolled(b.tokens, b.feats if inputs is None else inputs(b.feats), depth)
    feat_next = torch.cat([h[:, 1:], torch.zeros_like(h[:, :1])], 1)  # h_{j+1}
    j = torch.arange(h.shape[1], device=h.device)
    res: list[tuple[Any, int, int]] = []
    for s, g in enumerate(outs, start=1):
        m = b.loss_mask & (j >= s - 1)[None, :]
        gm = g[m]  # [N, H]
        logp = F.log_softmax(head.logits(gm), -1)  # [N, V']
        ce = -(b.label_p[m] * logp.gather(-1, b.label_idx[m])).sum(-1).mean()
        reg = F.smooth_l1_loss(gm, feat_next[m]) if feat_w else 0.0
        top1 = (logp.argmax(-1) == b.label_idx[m][:, 0]).sum()
        res.append((ce + feat_w * reg, int(top1), int(m.sum())))
    return res


@torch.no_grad()
def evaluate(head: EagleHead, batches: list[Batch], depth: int, losses: Losses = _losses) -> list[float]:
    """Top-1 agreement with the target per depth (conditional on the earlier depths being right
    only in that the inputs are the teacher-forced tokens). ``losses``: :func:`_losses` or a
    variant of it (same signature)."""
    head.eval()
    hit, tot = [0] * depth, [0] * depth
    for b in batches:
        for s, (_, h, n) in enumerate(losses(head, b, depth)):
            hit[s] += h
            tot[s] += n
    head.train()
    return [h / max(t, 1) for h, t in zip(hit, tot)]


def _save(path: Path, obj: Any) -> None:
    """Checkpoints hold only tensors, numbers, strings and plain containers (state dicts), so
    `load_checkpoint` can read them with PyTorch's restricted (weights-only) unpickler."""
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, device: Any = "cpu") -> Any:
    """Read `ckpt.pt` / `best.pt` with `weights_only=True`: a crafted file in a work folder
    cannot run code on `--resume` (anything but tensors and plain containers is refused)."""
    import pickle

    from ..errors import CorruptSourceError

    try:
        return torch.load(path, weights_only=True, map_location=device)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CorruptSourceError(
            f"{path}: not a plain tensor checkpoint, refusing to load it "
            f"({first[:200]}); delete it to start that stage over"
        ) from exc


def _optimizer(head: EagleHead, cfg: TrainConfig, total: int) -> _Optim:
    """AdamW over the trainable weights; linear warm-up, then a cosine down to 5% at ``total``."""
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda i: min(1.0, (i + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * min(i, total) / total)) * 0.95 + 0.05,
    )
    return params, opt, sched


def _step(head: EagleHead, b: Batch, *, depth: int, optim: _Optim, losses: Losses) -> Any:
    """One optimizer step on the depth-weighted loss (gradients clipped to norm 1)."""
    params, opt, sched = optim
    loss: Any = sum(DEPTH_W[s] * part for s, (part, _, _) in enumerate(losses(head, b, depth)))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    sched.step()
    return loss


class _State(TypedDict):
    """Training progress, saved in every checkpoint."""

    step: int
    tokens: int
    best: float
    curve: list[dict[str, Any]]


@dataclass
class _Trainer:
    """One training run's fixed inputs and its progress; writes ``work/ckpt.pt``, ``best.pt``
    and ``curve.json``."""

    head: EagleHead
    optim: _Optim
    cfg: TrainConfig
    work: Path
    losses: Losses
    log: Callable[[str], None]
    total: int
    steps_per_epoch: int
    state: _State = field(default_factory=lambda: _State(step=0, tokens=0, best=-1.0, curve=[]))

    def resume(self) -> None:
        """Load ``work/ckpt.pt`` (weights, optimizer, schedule, progress) when it exists."""
        ck = self.work / "ckpt.pt"
        if not ck.exists():
            return
        _, opt, sched = self.optim
        saved = load_checkpoint(ck, next(self.head.parameters()).device)
        self.head.load_state_dict(saved["head"], strict=False)
        opt.load_state_dict(saved["opt"])
        sched.load_state_dict(saved["sched"])
        self.state = saved["state"]
        self.log(f"train: resumed at step {self.state['step']}/{self.total}")

    def checkpoint(self) -> None:
        _, opt, sched = self.optim
        _save(
            self.work / "ckpt.pt",
            {"head": self.head.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "state": self.state},
        )

    def validate(self, val_b: list[Batch]) -> list[float]:
        """Add a curve point; a new best depth-1 agreement replaces ``best.pt``."""
        state = self.state
        val = evaluate(self.head, val_b, self.cfg.depth, self.losses)
        state["curve"].append({"step": state["step"], "tokens": state["tokens"], "val": val})
        (self.work / "curve.json").write_text(json.dumps(state["curve"], indent=1))
        if val[0] > state["best"]:
            state["best"] = val[0]
            _save(self.work / "best.pt", self.head.state_dict())
        return val

    def run(self, train_b: list[Batch], val_b: list[Batch], should_stop: Callable[[], bool] | None) -> str:
        """Step until ``total`` (returns "done") or ``should_stop()`` (returns "time budget");
        validates and checkpoints every ``eval_every`` steps."""
        state, per_epoch = self.state, self.steps_per_epoch
        rng = np.random.default_rng(self.cfg.seed)
        orders = [rng.permutation(per_epoch) for _ in range(int(math.ceil(self.cfg.epochs)) + 1)]
        t0, step0 = time.monotonic(), state["step"]
        self.head.train()
        while state["step"] < self.total:
            if should_stop is not None and should_stop():
                return "time budget"
            index = state["step"]
            batch = train_b[orders[index // per_epoch][index % per_epoch]]
            loss = _step(self.head, batch, depth=self.cfg.depth, optim=self.optim, losses=self.losses)
            state["step"] += 1
            state["tokens"] += batch.n_tokens
            if state["step"] % self.cfg.eval_every == 0 or state["step"] == self.total:
                val = self.validate(val_b)
                done = state["step"] - step0
                eta = (self.total - state["step"]) * (time.monotonic() - t0) / max(done, 1)
                self.log(
                    f"train: step {state['step']}/{self.total} (epoch {state['step'] / per_epoch:.2f}), "
                    f"loss {loss.item():.3f}, val top-1 by depth "
                    + " ".join(f"{v:.3f}" for v in val)
                    + f", ETA {eta / 60:.1f} min"
                )
                self.checkpoint()
        return "done"


def train(
    head: EagleHead,
    train_b: list[Batch],
    val_b: list[Batch],
    cfg: TrainConfig,
    *,
    work: Path,
    should_stop: Callable[[], bool] | None,
    log: Callable[[str], None],
    losses: Losses = _losses,
) -> dict[str, Any]:
    """Train (resuming from ``work/ckpt.pt``); keeps ``work/best.pt`` (best validation depth-1
    agreement) and ``work/curve.json`` ([{tokens, step, val: [per depth]}]). ``should_stop()`` is
    asked before every step (a time budget); stopping writes a checkpoint. Deterministic: a run
    stopped and resumed ends with the same weights as one that never stopped. ``losses``: see
    :func:`evaluate`."""
    torch.manual_seed(cfg.seed)
    steps_per_epoch = len(train_b)
    total = max(1, int(cfg.epochs * steps_per_epoch))
    trainer = _Trainer(
        head=head,
        optim=_optimizer(head, cfg, total),
        cfg=cfg,
        work=work,
        losses=losses,
        log=log,
        total=total,
        steps_per_epoch=steps_per_epoch,
    )
    trainer.resume()
    stopped = trainer.run(train_b, val_b, should_stop)
    state = trainer.state
    if stopped == "done" and (not state["curve"] or state["curve"][-1]["step"] != state["step"]):
        trainer.validate(val_b)  # (a stop does not validate: the curve and best.pt stay those of one run)
    trainer.checkpoint()
    return {
        "stopped": stopped,
        "step": state["step"],
        "total_steps": total,
        "tokens": state["tokens"],
        "best_val_top1": state["best"],
        "curve": state["curve"],
    }
