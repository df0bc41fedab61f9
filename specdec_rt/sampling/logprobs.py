"""Log-probabilities of emitted tokens, as OpenAI's ``logprobs`` reports them (pure NumPy).

What is reported is the **target** model's own distribution ``p`` at each emitted position,
``log_softmax(logits)``, before temperature, top-k and top-p (vLLM's default, "raw logprobs"), so
the numbers do not depend on how a token was chosen: speculative and plain decoding report the
same values for the same tokens (to float rounding), and so does any drafter.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..checks import check_int

__all__ = ["TokenLogprob", "token_logprobs", "check_top_logprobs", "json_logprob", "MAX_TOP_LOGPROBS"]

MAX_TOP_LOGPROBS = 20  # alternatives per token, as in OpenAI's API


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target, and the most likely tokens there."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first (ties: lower id)


def check_top_logprobs(top: object, name: str = "logprobs") -> int | None:
    """``None`` (off) or an int in ``0..MAX_TOP_LOGPROBS``; anything else is an InvalidInputError
    naming the argument ``name``."""
    checked = check_int(top, name, 0, MAX_TOP_LOGPROBS, optional=True)
    return None if checked is None else int(checked)


def token_logprobs(logits: np.ndarray, ids: np.ndarray, top: int = 0) -> tuple[TokenLogprob, ...]:
    """Row ``i`` of ``logits`` ``[n, V]`` is the target's distribution where ``ids[i]`` ``[n]``
    was emitted: its log-probability there, and the ``top`` most likely tokens with theirs (ties:
    the lower ids). All rows at once: one log-softmax, the top ``top`` by one ``argpartition``."""
    rows = np.asarray(logits)  # [n, V]
    n = rows.shape[0]
    m = rows.max(axis=-1, keepdims=True)  # [n, 1]
    shifted = rows - m
    np.exp(shifted, out=shifted)
    lse = m[:, 0].astype(np.float64) + np.log(shifted.sum(axis=-1, dtype=np.float64))  # [n], summed in float64
    chosen = (rows[np.arange(n), np.asarray(ids, dtype=np.int64)].astype(np.float64) - lse).tolist()  # [n]
    if not top:
        return tuple(TokenLogprob(v) for v in chosen)
    picked, exact = _top(rows, top)  # [n, k] ids, most likely first; [n]
    values = (np.take_along_axis(rows, picked, axis=-1).astype(np.float64) - lse[:, None]).tolist()  # [n, k]
    return tuple(
        TokenLogprob(v, tuple(zip(b, w)) if ok else _top_of_row(rows[i], top, float(lse[i])))
        for i, (v, b, w, ok) in enumerate(zip(chosen, picked.tolist(), values, exact.tolist()))
    )


def _top(rows: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's ``top`` largest entries' ids ``[n, min(top, V)]``, largest first, ties to the
    lower id; and ``[n]`` whether that holds for the row (not where NaNs are in the way:
    :func:`_top_of_row` does those rows). The candidates: entries at least the least of the
    maxima of ``top`` disjoint blocks (``top`` distinct entries reach it, so every one of the
    ``top`` largest, ties included, does), a few dozen a row, sorted; ``argpartition`` of whole
    rows costs 20 times as much."""
    n, size = rows.shape
    if top >= size:
        picked = np.broadcast_to(np.arange(size), (n, size))
        order = np.lexsort((picked, -rows), axis=-1)  # value descending, then id ascending
        return np.take_along_axis(picked, order, axis=-1), ~np.isnan(rows).any(axis=-1)
    blocks = rows[:, : size // top * top].reshape(n, top, -1).max(axis=-1)  # [n, top]
    where, ids = np.nonzero(rows >= blocks.min(axis=-1, keepdims=True))  # the candidates, row by row
    order = np.lexsort((ids, -rows[where, ids], where))  # by row, then value descending, then id
    where, ids = where[order], ids[order]
    counts = np.bincount(where, minlength=n)  # [n]: >= top, unless a NaN made the bound NaN
    exact = counts >= top
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])  # [n]: each row's first candidate
    at = np.minimum(first[:, None] + np.arange(top), max(where.size - 1, 0))  # [n, top]
    picked = ids[at] if where.size else np.zeros((n, top), dtype=np.int64)
    return np.where(exact[:, None], picked, 0), exact


def _top_of_row(row: np.ndarray, top: int, lse: float) -> tuple[tuple[int, float], ...]:
    """One row's ``top`` most likely tokens, with their log-probabilities (``lse``: the row's
    log-sum-exp): all above the ``top``-th value, then the lowest ids of those equal to it."""
    kth = row[np.argpartition(-row, top - 1)[top - 1]] if top < row.size else row.min()  # the top-th value
    above = np.flatnonzero(row > kth)  # [< top]: all of them make it
    tied = np.flatnonzero(row == kth)[: top - above.size]  # ids ascending: the lowest ties
    cand = sorted(np.concatenate([above, tied]).tolist(), key=lambda j: (-row[j], j))
    return tuple((j, float(row[j]) - lse) for j in cand)


def json_logprob(logprob: float) -> float:
    """A log-probability JSON can carry (it has no -Infinity or NaN): a token the model rules out,
    or a broken model's NaN, becomes -9999.0, as vLLM reports it."""
    return float(logprob) if logprob >= -9999.0 else -9999.0
