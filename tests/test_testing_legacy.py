"""The test kit's options that became keyword-only still work by position, with a warning."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from specdec_rt import SamplingParams
from specdec_rt.testing import ToyLM, sequence_counts, toy_pair, toy_scheduler


def test_positional_options_warn_and_mean_the_same():
    with pytest.warns(DeprecationWarning, match="pass max_length by keyword"):
        old = ToyLM(8, 2, 0, 2.0, 64)
    assert old.max_length == ToyLM(8, 2, 0, 2.0, max_length=64).max_length == 64
    with pytest.warns(DeprecationWarning, match="sharpness"):
        target, _ = toy_pair(8, 2, 0, 0.5, 3.0)
    assert np.array_equal(target.table, toy_pair(8, 2, 0, 0.5, sharpness=3.0)[0].table)
    sched, _, _ = toy_scheduler(0.5, 8, 0)
    params = SamplingParams(temperature=1.0)

    async def both() -> tuple[dict, dict]:
        with pytest.warns(DeprecationWarning, match="n, rng"):
            old = await sequence_counts(sched, [1, 2], 3, params, 20, np.random.default_rng(0))
        new = await sequence_counts(sched, [1, 2], 3, params, n=20, rng=np.random.default_rng(0))
        return old, new

    old_counts, new_counts = anyio.run(both)
    assert old_counts == new_counts


def test_an_option_given_twice_or_too_many_positions_is_a_type_error():
    with pytest.raises(TypeError, match="max_length both"):
        ToyLM(8, 2, 0, 2.0, 64, max_length=32)
    with pytest.raises(TypeError):
        toy_pair(8, 2, 0, 0.5, 3.0, "extra")
