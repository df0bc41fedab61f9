"""ALiBi's per-head slopes (BLOOM, MPT), read from the model's own code.

ALiBi adds ``slope_h x position(key)`` to each head's attention scores, with no rotary and no
position table: softmax is unchanged by a constant over a query's keys, so BLOOM's bias by the
key's absolute position and MPT's by its distance back from the last key (``slope_h x (key -
last)``, at most 0) both equal the paper's ``-slope_h x (query - key)``. The graph adds it to the
attention bias the runtime feeds (``export.graph``), by cache slot (MPT's: the slot less the
query's position): a slot is its position for a chain, not for a tree's nodes, so such a model
verifies chains only.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import numpy.typing as npt

from .errors import UnsupportedModelError

__all__ = ["alibi_slopes"]


def alibi_slopes(model: Any, heads: int) -> npt.NDArray[np.float32]:
    """Each head's slope ``[heads]`` float32, as the model's code computes it: BLOOM's
    ``build_alibi_tensor`` (``2^(-8 k / n)`` for the largest power of two n up to the head count,
    the odd powers of ``2^(-4 / n)`` for the rest: its bias at position 1 of an unpadded row), or
    MPT's ``build_mpt_alibi_tensor`` as its forward calls it (``alibi_bias_max`` 8: minus its
    bias at the first of two keys)."""
    import torch

    module = importlib.import_module(type(model).__module__)
    with torch.no_grad():
        if hasattr(module, "build_mpt_alibi_tensor"):
            bias = model.base_model.build_mpt_alibi_tensor(heads, 2).float()  # [heads, 1, 2]: -slope, 0
            first, slopes_t = bias.reshape(heads, 2)[:, 1], -bias.reshape(heads, 2)[:, 0]
        elif hasattr(module, "build_alibi_tensor"):
            bias = module.build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), heads, torch.float32)  # 0, slope
            first, slopes_t = bias.reshape(heads, 2)[:, 0], bias.reshape(heads, 2)[:, 1]
        else:
            raise UnsupportedModelError(f"unsupported ALiBi model {type(model).__name__}: no ALiBi tensor builder")
    slopes: npt.NDArray[np.float32] = slopes_t.numpy().astype(np.float32)
    if first.abs().max().item() != 0.0 or not np.all(slopes > 0):
        raise UnsupportedModelError(f"unsupported ALiBi slopes {slopes.tolist()}: need positive slopes")
    return slopes
