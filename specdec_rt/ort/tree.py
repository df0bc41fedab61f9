"""How new positions reach attention: the packed layout of rows, tree verification in one ONNX
Runtime call, and KV compaction after it (CPU).

A packed graph of exporter 0.3+ takes ``position_ids`` ``[1, N]`` and an additive
``attention_bias`` ``[1, 1, S, total]`` into every GroupQueryAttention (tested on ONNX Runtime
1.32's CPU kernel: batch 1, several new positions with a past). A draft tree of S nodes goes in
as S new positions after the ``past`` committed tokens, parents before children:

    node i:  token x_i, parent p_i (-1: the last committed token), depth d_i = d_{p_i} + 1
    position_ids[i]    = past + d_i - 1                      rotary sees the node's real position
    bias[i, j]         = 0 for j < past and for j = past + a, a an ancestor of i or i itself;
                         the float32 minimum otherwise       each node sees the committed tokens
                                                             and its own path only

so each node's logits are those of its path fed as a chain (bit for bit in the tests). Its KV
lands at ``past + i``; ``compact`` then moves the accepted path's entries to consecutive
positions ``past, past + 1, ...`` in place, a few rows per layer (the rotary was already applied
with the path's positions, so a plain copy is right), and the rest is beyond the length: rolled
back like any rejected draft. A chain (p_i = i - 1) is the ordinary causal verify.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from numpy.typing import ArrayLike

from ..errors import InferenceError
from ..sampling.tree import depths_of

__all__ = ["packed_layout", "depths", "tree_feeds", "compact_rows"]

MASKED = np.finfo(np.float32).min  # added to a score: exp() of it is 0


def depths(parents: ArrayLike) -> np.ndarray:
    """``[S]`` depth of each node (1 for a child of the committed tokens), checking that
    ``parents[i]`` is -1 or an earlier node."""
    parents = np.asarray(parents, dtype=np.int64)
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise InferenceError(f"tree node {i} has parent {int(p)}: it must be -1 or an earlier node")
    return depths_of(parents)


def tree_feeds(parents: ArrayLike, past: int, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(position_ids [1, S], attention_bias [1, 1, W, past + W])`` for a tree of S nodes after
    ``past`` committed tokens (W = ``width`` >= S, attention's padded row; S by default).
    ``parents=None``: a chain (causal order alone)."""
    if parents is None:
        raise InferenceError("tree_feeds needs the parents of the nodes")
    depth = depths(parents)  # [S]
    s = depth.size
    w = s if width is None else width
    bias = np.zeros((1, 1, w, past + w), dtype=np.float32)  # [1, 1, W, total]
    bias[0, 0, :s, past:] = MASKED
    parents = np.asarray(parents, dtype=np.int64)
    for i in range(s):
        a = i
        while a >= 0:  # itself and its ancestors
            bias[0, 0, i, past + a] = 0.0
            a = int(parents[a])
    return (past + depth - 1)[None], bias


def compact_rows(buffers: Iterable[np.ndarray], slot: int, past: int, keep: ArrayLike) -> None:
    """Move KV positions ``past + keep[j]`` to ``past + j`` (``keep`` increasing) in every
    ``[slots, kv, max_len + 1, d]`` array of ``buffers``, for ``slot``."""
    keep = np.asarray(keep, dtype=np.int64)
    if keep.size and (np.any(np.diff(keep) <= 0) or keep[0] < 0):
        raise InferenceError(f"compaction needs increasing node indices, got {keep.tolist()}")
    moved = np.flatnonzero(keep != np.arange(keep.size))
    if not moved.size:
        return  # the path is already in place (a chain's accepted prefix)
    src, dst = past + keep[moved], past + moved
    for array in buffers:
        array[slot, :, dst] = array[slot, :, src]  # fancy index: a copy, then the write


def packed_layout(news: np.ndarray, lone_twice: bool | np.ndarray = False) -> tuple[np.ndarray, ...]:
    """The inputs that lay packed positions out as rows for attention, for ``news`` ``[B]`` new
    positions per row: ``(query_seqlens [B], pad_index [B*S], pack_index [N], padded_shape [3])``
    with S the longest row; padding points at position 0 (attention ignores it). ``lone_twice``
    (for every row, or ``[B]`` per row): a row of one position goes to attention as two copies of it (``query_seqlens`` 2; see
    :class:`~specdec_rt.ort.model.OrtModel`), so a caller's ``seqlens_k`` is ``past + query_seqlens - 1``."""
    queries = np.where((news == 1) & lone_twice, 2, news)  # [B] query rows attention computes
    rows, width = news.size, max(1, int(queries.max()))
    starts = np.cumsum(news) - news  # [B]
    pad = np.zeros((rows, width), dtype=np.int64)  # [B, S]
    pack = np.empty(int(news.sum()), dtype=np.int64)  # [N]
    for r in np.flatnonzero(news):
        q = int(news[r])
        pad[r, : queries[r]] = starts[r] + np.minimum(np.arange(queries[r]), q - 1)
        pack[starts[r] : starts[r] + q] = r * width + np.arange(q)
    return queries.astype(np.int32), pad.reshape(-1), pack, np.array([rows, width, -1], dtype=np.int64)
