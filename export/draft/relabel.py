"""Features and labels from another export of the target: the same token sequences read by an
ONNX Runtime model (a quantized copy, typically), one teacher-forced forward per sequence.

The data stage keeps, per position j, the float32 PyTorch target's h_j and top-k distribution of
x_{j+1}. A head that drafts for an int8 or int4 target reads that target's features at run time
and is accepted against that target's choices, so training can read those instead:
:func:`relabel_shards` recomputes ``feats``, ``topk_ids`` and ``topk_p`` of every sequence with
the export in ``model_dir`` and keeps the tokens (the answers stay the float32 target's).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ..errors import UsageError
from .data import TOPK, Shard, save_shard, shard_path

if TYPE_CHECKING:
    from specdec_rt.ort import OrtModel

__all__ = ["open_features_model", "relabel_shard", "relabel_shards", "top_k_np"]


def top_k_np(logits: npt.NDArray[np.float32], k: int) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.float16]]:
    """logits [S, V] -> (ids int32 [S, k], probs float16 [S, k]) of softmax(logits), best first."""
    z = logits.astype(np.float32) - logits.max(-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(-1, keepdims=True)
    ids = np.argpartition(-p, k - 1, axis=-1)[:, :k]
    vals = np.take_along_axis(p, ids, -1)
    order = np.argsort(-vals, axis=-1, kind="stable")
    ids, vals = np.take_along_axis(ids, order, -1), np.take_along_axis(vals, order, -1)
    return ids.astype(np.int32), vals.astype(np.float16)


def open_features_model(model_dir: Path, *, max_length: int, threads: int | None) -> OrtModel:
    """The ONNX Runtime model features are read from; it must output ``hidden_states``."""
    from specdec_rt.ort import OrtModel

    model = OrtModel(Path(model_dir), slots=1, max_length=max_length, threads=threads)
    if not model.has_hidden:
        model.close()
        raise UsageError(f"--features-from {model_dir}: the model has no hidden_states output")
    return model


def relabel_shard(model: OrtModel, shard: Shard, *, topk: int = TOPK) -> Shard:
    """``shard`` with every sequence's features and top-k labels read by ``model`` (one forward
    over tokens 0..T-2 each); tokens, offsets and prompt lengths unchanged."""
    feats, ids, probs = [], [], []
    for tokens, _, old_feats, _, _ in shard.sequences():
        session = model.start()
        try:
            logits, hidden = session.run_sync(tokens[:-1].astype(np.int64), len(tokens) - 1, 0, hidden=True)
        finally:
            session.close()
        if hidden.shape != old_feats.shape:
            raise ValueError(f"features of shape {hidden.shape}, the shard has {old_feats.shape}")
        feats.append(np.asarray(hidden, np.float32).astype(np.float16))
        top_ids, top_p = top_k_np(np.asarray(logits, np.float32), topk)
        ids.append(top_ids)
        probs.append(top_p)
    return Shard(
        tokens=shard.tokens,
        starts=shard.starts,
        prompt_lens=shard.prompt_lens,
        feats=np.concatenate(feats),
        topk_ids=np.concatenate(ids),
        topk_p=np.concatenate(probs),
    )


def relabel_shards(
    model: OrtModel,
    src: Path,
    dst: Path,
    *,
    deadline: float | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> bool:
    """Write ``dst/shard-NNNNN.npz`` for every shard of ``src`` with ``model``'s features and
    labels; shards already in ``dst`` are kept (resumable). False when ``deadline``
    (time.monotonic) passed before all were written."""
    dst.mkdir(parents=True, exist_ok=True)
    paths = sorted(Path(src).glob("shard-?????.npz"))
    t0, made = time.monotonic(), 0
    for index, path in enumerate(paths):
        out = shard_path(dst, int(path.stem.split("-")[1]))
        if out.exists():
            continue
        if deadline is not None and time.monotonic() > deadline:
            return False
        shard = load_shard_file(path)
        save_shard(out, relabel_shard(model, shard))
        made += shard.feats.shape[0]
        log(
            f"features: {src.name} shard {index + 1}/{len(paths)}, "
            f"{made / max(time.monotonic() - t0, 1e-9):.0f} positions/s"
        )
    return True


def load_shard_file(path: Path) -> Shard:
    """The shard in file ``path``."""
    with np.load(path) as z:
        return Shard(**{k: z[k] for k in Shard.__dataclass_fields__})
