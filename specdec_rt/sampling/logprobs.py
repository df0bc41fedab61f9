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
    was emitted: its log-probability there, and the ``top`` most likely tokens with theirs."""
    rows = np.asarray(logits)  # [n, V]
    m = rows.max(axis=-1, keepdims=True)  # [n, 1]
    lse = m[:, 0].astype(np.float64) + np.log(np.exp(rows - m).sum(axis=-1, dtype=np.float64))  # [n], summed in float64
    out = []
    for i, t in enumerate(np.asarray(ids).tolist()):
        best: tuple[tuple[int, float], ...] = ()
        if top:
            row = rows[i]
            kth = row[np.argpartition(-row, top - 1)[top - 1]] if top < row.size else row.min()  # the top-th value
            above = np.flatnonzero(row > kth)  # [< top]: all of them make it
            tied = np.flatnonzero(row == kth)[: top - above.size]  # ids ascending: the lowest ties
            cand = sorted(np.concatenate([above, tied]).tolist(), key=lambda j: (-row[j], j))
            best = tuple((j, float(row[j]) - float(lse[i])) for j in cand)
        out.append(TokenLogprob(float(rows[i, t]) - float(lse[i]), best))
    return tuple(out)


def json_logprob(logprob: float) -> float:
    """A log-probability JSON can carry (it has no -Infinity or NaN): a token the model rules out,
    or a broken model's NaN, becomes -9999.0, as vLLM reports it."""
    return float(logprob) if logprob >= -9999.0 else -9999.0
