"""Log-probabilities of a prompt's own tokens: what the target gives each prompt token after the
ones before it (vLLM's ``prompt_logprobs``; OpenAI completions' ``echo`` with ``logprobs``, which
evaluation harnesses use to score a continuation).

The values are those :mod:`specdec_rt.sampling.logprobs` reports for generated tokens: the model's raw
``log_softmax`` (no temperature, top-k, top-p, bias or penalty). The first token has none
(nothing comes before it): ``None``.
"""

from __future__ import annotations

from typing import Protocol

import anyio
import numpy as np

from .logprobs import TokenLogprob, token_logprobs

__all__ = ["prompt_logprobs", "SCORE_CHUNK"]

SCORE_CHUNK = 64  # prompt positions per call: their logits [64, V] exist one chunk at a time


class _Session(Protocol):
    """What is used here of a backend's cache session (``speculation.protocols.CacheSession``)."""

    async def extend(self, ids: np.ndarray, logits_rows: int) -> np.ndarray: ...

    def close(self) -> None: ...


class ScoredModel(Protocol):
    """What is used here of a backend model (``speculation.protocols.LanguageModel``)."""

    def start(self) -> _Session: ...


async def prompt_logprobs(model: ScoredModel, ids: np.ndarray, top: int = 0) -> list[TokenLogprob | None]:
    """``ids`` ``[L]`` -> ``[None, lp(ids[1] | ids[:1]), ..., lp(ids[L-1] | ids[:L-1])]``, each
    with the ``top`` most likely tokens at its position.

    ``model``: a backend model (``start()`` -> a session with ``extend(ids, logits_rows)``, e.g.
    :class:`~specdec_rt.ort.OrtModel`). One session of it is fed from position 0, ``SCORE_CHUNK``
    positions a call (the last prompt token is never fed: nothing here needs what follows it),
    and closed however this ends (cancelled too: the slot goes back at once). With the prefix
    cache on, what it computed stays cached, so a generation from the same prompt right after
    starts from it instead of computing the prompt again.
    """
    ids = np.asarray(ids, dtype=np.int64)  # [L]
    out: list[TokenLogprob | None] = [None]
    if ids.size < 2:
        return out
    session = model.start()
    try:
        for lo in range(0, ids.size - 1, SCORE_CHUNK):
            hi = min(lo + SCORE_CHUNK, ids.size - 1)
            logits = await session.extend(ids[lo:hi], hi - lo)  # [hi - lo, V]: position j predicts ids[j + 1]
            # ~15 ms for 64 rows of a 49k vocabulary: off the event loop, which other requests need
            out += await anyio.to_thread.run_sync(token_logprobs, np.asarray(logits), ids[lo + 1 : hi + 1], top)
    finally:
        session.close()
    return out
