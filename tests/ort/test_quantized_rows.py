"""Row determinism of quantized targets (int8 and int4 MatMulNBits weights, int8 activations per
block): a row's logits do not depend on what else is in its call or on how many positions it is
fed with, bit for bit. That is what makes greedy speculation exact to a quantized target, and a
request's output the same alone and beside others.

What ``test_quantized_target.py`` already checks (a lone position against the first of a verify,
the first row of a packed call, greedy tokens) is widened here to every position and every row:
(a) the Engine's greedy ``spec`` and ``ar`` agree token for token *and* in each step's reported
log-probabilities (top 20 too), alone and with the requests run together; (b) each row of a
packed call of several requests (prompts, plain steps, verifies of different widths) equals that
row run alone; (c) a verify chain of k positions equals the same positions fed one at a time
(later positions attending to the KV the lone calls wrote)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from specdec_rt.ort.model import OrtModel
from specdec_rt.policy.config import SpecConfig

pytestmark = pytest.mark.export

QUANTS = ("int8", "int4")


@pytest.fixture(scope="module", params=QUANTS)
def quantized(request, tmp_path_factory):
    """A tiny Llama exported as an int8 or int4 target, with an int4 copy as its draft."""
    from tiny_models import export_tiny

    q = request.param
    return q, export_tiny(tmp_path_factory.mktemp(f"rows-{q}"), "llama", draft="int4", quantize=q)


def _model(folder, **kw) -> OrtModel:
    model = OrtModel(folder, max_length=128, threads=2, **kw)
    assert model.lone_twice and model.manifest.quantization["accuracy_level"] == 4
    return model


def test_greedy_spec_reports_the_same_tokens_and_logprobs_as_plain_decoding(quantized):
    from specdec_rt import Engine

    q, folder = quantized
    prompts = ["one two three", "def f(x):\n    return", "a b a b a b", "Hello world! The quick"]
    config = SpecConfig(measure_costs=False, adapt_k=False, k_init=4)

    async def main():
        accepted = 0
        for draft in ("q4", "ngram"):
            async with await Engine.load(folder, draft=draft, slots=4, spec_config=config) as engine:
                kw = dict(max_new_tokens=24, logprobs=20)
                plain = [await engine.generate(p, mode="ar", **kw) for p in prompts]
                spec = [await engine.generate(p, mode="spec", **kw) for p in prompts]
                together = await asyncio.gather(*(engine.generate(p, mode="spec", **kw) for p in prompts))
                for a, s, t, p in zip(plain, spec, together, prompts):
                    assert s.token_ids == a.token_ids == t.token_ids, (q, draft, p)
                    assert len(a.logprobs) == len(a.token_ids) and len(a.logprobs[0].top) == 20
                    # float equality: every step's distribution is the same bits in all three
                    assert s.logprobs == a.logprobs and t.logprobs == a.logprobs, (q, draft, p)
                accepted += sum(s.stats.accepted for s in spec + list(together))
        assert accepted > 20  # verifies of several positions decided many of the tokens

    asyncio.run(main())


def test_each_row_of_a_packed_call_equals_that_row_run_alone(quantized):
    q, folder = quantized
    model = _model(folder, slots=4)
    toks = np.random.default_rng(5).integers(3, model.vocab_size, size=(4, 40))
    lens = [9, 4, 17, 6]
    rows = [model.start() for _ in lens]
    # the prompts of four requests in one call (all their positions' logits), then a plain step,
    # two verifies of different widths and a row of two positions in another
    prompts = model.run_rows_sync(rows, [toks[i, :n] for i, n in enumerate(lens)], lens)
    feeds = [toks[0, 9:10], toks[1, 4:9], toks[2, 17:20], toks[3, 6:8]]
    steps = model.run_rows_sync(rows, feeds, [f.size for f in feeds])
    for i, (n, f) in enumerate(zip(lens, feeds)):
        rows[i].close()
        alone = model.start()
        whole = alone.run_sync(toks[i, : n + f.size], n + f.size, 0)  # [n + S, V]: the row in one call of its own
        np.testing.assert_array_equal(prompts[i], whole[:n], err_msg=f"{q}: row {i}'s prompt")
        np.testing.assert_array_equal(steps[i], whole[n:], err_msg=f"{q}: row {i}'s step")
        alone.rollback(n)
        np.testing.assert_array_equal(alone.run_sync(f, f.size, n), steps[i])  # after its own prompt call
        alone.close()


@pytest.mark.parametrize("k", [2, 5, 9, 17])
def test_a_verify_chain_equals_its_positions_fed_one_at_a_time(quantized, k):
    q, folder = quantized
    model = _model(folder, slots=1)
    toks = np.random.default_rng(k).integers(3, model.vocab_size, size=12 + k)
    s = model.start()
    s.run_sync(toks[:12], 1, 0)
    chain = s.run_sync(toks[12:], k, 12)  # [k, V]
    s.rollback(12)
    one = np.concatenate([s.run_sync(toks[12 + i : 13 + i], 1, 12 + i) for i in range(k)])  # [k, V]
    assert s.length == 12 + k
    np.testing.assert_array_equal(chain, one, err_msg=f"{q}: chain of {k}")
    s.rollback(12)  # and a chain after the lone calls' KV: the cache holds the same bits either way
    np.testing.assert_array_equal(s.run_sync(toks[12:], k, 12), chain)
