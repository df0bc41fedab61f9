"""ALiBi's per-head slopes (BLOOM), read from the model's own code.

ALiBi adds ``slope_h x position(key)`` to each head's attention scores, with no rotary and no
position table: softmax is unchanged by a constant over a query's keys, so BLOOM's bias by the
key's absolute position equals the paper's ``-slope_h x (query - key)``. The graph adds it to the
attention bias the runtime feeds (``export.graph``), by cache slot: a slot is its position for a
chain, not for a tree's nodes, so such a model verifies chains only.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import numpy.typing as npt

from .errors import UnsupportedModelError

__all__ = ["alibi_slopes"]


def alibi_slopes(model: Any, heads: int) -> npt.NDArray[np.float32]:
    """Each head's slope ``[heads]`` float32, as the model's modelling module's
    ``build_alibi_tensor`` computes it (transformers' BLOOM: ``2^(-8 k / n)`` for the nearest
    power of two n below the head count, the odd powers of ``2^(-4 / n)`` for the rest): its bias
    at position 1 of an unpadded row."""
    import torch

    module = importlib.import_module(type(model).__module__)
    build = getattr(module, "build_alibi_tensor", None)
    if build is None:
        raise UnsupportedModelError(f"unsupported ALiBi model {type(model).__name__}: no build_alibi_tensor")
    with torch.no_grad():
        bias = build(torch.ones(1, 2, dtype=torch.long), heads, torch.float32)  # [heads, 1, 2]
    slopes: npt.NDArray[np.float32] = bias.reshape(heads, 2)[:, 1].float().numpy().copy()
    if bias.reshape(heads, 2)[:, 0].abs().max().item() != 0.0 or not np.all(slopes > 0):
        raise UnsupportedModelError(f"unsupported ALiBi slopes {slopes.tolist()}: need a bias of 0 at position 0")
    return slopes
