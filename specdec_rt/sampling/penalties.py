"""Repetition penalties (OpenAI's ``presence_penalty`` / ``frequency_penalty``, and the
``repetition_penalty`` of Hugging Face and vLLM), as pure NumPy on the rows of one model call.

A penalty depends on the tokens before the position it scores, so each row of a verify call gets
its own: row i of a chain scores the position after the committed tokens and the first i drafts;
a tree's row scores the position after its node's path. With ``n(t)`` the count of token t among
the *generated* tokens before the position (the prompt excluded, as in OpenAI's API and vLLM):

    logit[t] -= frequency_penalty * n(t) + presence_penalty * (n(t) > 0)

and for every token t of the prompt or of those generated tokens (vLLM's rule):

    logit[t] = logit[t] / repetition_penalty  if logit[t] > 0  else  logit[t] * repetition_penalty

Penalties come before the logit bias, temperature, top-k and top-p. Draft and target apply them
alike; exactness holds for the penalized target distribution, position by position.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from . import SamplingParams

__all__ = ["penalized"]


def penalized(
    logits: np.ndarray,
    params: SamplingParams,
    prompt: np.ndarray,
    generated: np.ndarray,
    *,
    before: Sequence[Iterable[int]],
) -> np.ndarray:
    """``logits`` ``[n, V]`` with the request's penalties applied (the same array when it has
    none). Row i's generated tokens are ``generated`` ``[G]`` then ``before[i]`` (the drafts
    between the committed tokens and row i's position); ``prompt`` ``[P]`` counts for
    ``repetition_penalty`` only."""
    if not params.penalized:
        return logits
    out = np.array(logits, dtype=np.result_type(logits.dtype, np.float32))  # [n, V], a copy
    v = out.shape[-1]
    gen = np.asarray(generated, dtype=np.int64)
    base = np.bincount(gen[gen < v], minlength=v)  # [V] counts of committed generated tokens
    seen_prompt = np.zeros(v, dtype=bool)  # [V]
    p = np.asarray(prompt, dtype=np.int64)
    seen_prompt[p[p < v]] = True
    for i, path in enumerate(before):
        counts = base.copy()
        extra = np.asarray(path, dtype=np.int64)
        np.add.at(counts, extra[extra < v], 1)
        row = out[i]
        if params.repetition_penalty != 1.0:
            hit = seen_prompt | (counts > 0)  # [V]
            r = row.dtype.type(params.repetition_penalty)
            row[hit] = np.where(row[hit] > 0, row[hit] / r, row[hit] * r)
        if params.frequency_penalty or params.presence_penalty:
            row -= (params.frequency_penalty * counts + params.presence_penalty * (counts > 0)).astype(row.dtype)
    return out
