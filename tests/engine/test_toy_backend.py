"""A backend written against the Protocols alone runs through ``Engine``: no export folder, no
ONNX Runtime, no attribute the Protocols do not declare.

Two backends from ``specdec_rt.testing``: ``PlainLM`` (the required members only: nothing is
batched, cached or verified as a tree) and ``ToyLM`` (every capability it declares in ``caps``:
batched steps and rows, a prefix cache, trees), on one step loop. Both must give greedy
speculative output equal to plain output, and log-probabilities (the target's logits) equal to
the model's own, computed here from its table.
"""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from specdec_rt import InvalidInputError, ModelDrafter, SpecConfig
from specdec_rt.batching import BatchExecutor
from specdec_rt.sampling import SamplingParams, warp
from specdec_rt.speculation.protocols import LanguageModel, ModelCaps
from specdec_rt.testing import PlainLM, ToyLM, toy_engine, toy_pair

V = 12
STATIC = SpecConfig(measure_costs=False, adapt_k=False, k_init=3)  # toy timings must not turn speculation off
PROMPTS = ["w1 w2 w3", "w5 w5 w5 w5 w7", "w0 w11 w3 w9 w1 w2"]


def reference(model: ToyLM, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy decoding straight from the model's table: the tokens and each one's log-probability."""
    ids, lps = list(prompt), []
    for _ in range(n):
        row = model.logits_at(np.array(ids))[-1]  # [V]
        x = int(np.argmax(row))
        lps.append(float(np.log(warp(row, SamplingParams(temperature=1.0))[x])))
        ids.append(x)
    return ids[len(prompt) :], lps


def check(engine, target: ToyLM, mode: str) -> None:
    async def main():
        for text in PROMPTS:
            prompt = engine.codec.encode(text)
            r = await engine.generate(text, max_new_tokens=10, mode=mode, logprobs=0)
            want, lps = reference(target, prompt, 10)
            assert r.token_ids == want, (text, mode)
            got = [t.logprob for t in r.logprobs]
            np.testing.assert_allclose(got, lps, rtol=1e-5, atol=1e-6)  # the target's logits, position by position
            assert r.text == " ".join(f"w{i}" for i in want)

    anyio.run(main)


def test_a_protocol_only_backend_runs_through_the_engine(tmp_path):
    target, draft = toy_pair(V, seed=3, distance=0.3)
    plain_target, plain_draft = PlainLM(target), PlainLM(draft)
    assert plain_target.caps == ModelCaps()  # nothing declared: the plain case
    engine = toy_engine(plain_target, ModelDrafter(plain_draft), tmp_path, config=STATIC, slots=2)
    check(engine, target, "ar")
    check(engine, target, "spec")
    assert engine.scheduler.totals.rounds > 0  # it did speculate
    assert plain_draft.calls > 0
    anyio.run(engine.aclose)


def test_a_backend_with_every_capability_runs_batched_through_the_engine(tmp_path):
    executor = BatchExecutor(chunk=4)
    target, draft = toy_pair(V, seed=5, distance=0.3, executor=executor, prefix_cache_tokens=256)
    assert target.caps.ragged and target.caps.trees and target.caps.caches_prefixes
    engine = toy_engine(
        target, ModelDrafter(draft), tmp_path, config=STATIC, slots=4, executor=executor, models=[target, draft]
    )
    check(engine, target, "spec")

    async def together():  # concurrent requests share batched calls, and each gets its own answer
        out = {}

        async def one(i, text):
            out[i] = (await engine.generate(text, max_new_tokens=12)).token_ids

        async with anyio.create_task_group() as tg:
            for i, text in enumerate(PROMPTS * 2):
                tg.start_soon(one, i, text)
        return out

    before = len(target.batches)
    out = anyio.run(together)
    for i, text in enumerate(PROMPTS * 2):
        assert out[i] == reference(target, engine.codec.encode(text), 12)[0]
    assert any(rows > 1 for rows in target.batches[before:])  # rows of several requests in one call
    assert engine.prefix_cache["enabled"] and engine.prefix_cache["hit_tokens"] > 0  # repeated prompts hit
    anyio.run(engine.aclose)


def test_a_drafter_that_needs_hidden_states_is_refused_by_a_target_without_them(tmp_path):
    target, draft = toy_pair(V)

    class WantsHidden(ModelDrafter):
        needs_target_hidden = True

    with pytest.raises(InvalidInputError, match="caps.hidden_states is False"):
        toy_engine(target, WantsHidden(draft), tmp_path)


def test_an_object_that_is_not_a_drafter_is_named(tmp_path):
    target, _ = toy_pair(V)

    class NotADrafter:
        async def generate_draft(self, ctx, k):
            return []

    with pytest.raises(InvalidInputError, match="does not implement DraftInferrer"):
        toy_engine(target, NotADrafter(), tmp_path)


def test_the_protocols_give_a_plain_model_its_defaults():
    class Bare(LanguageModel):
        vocab_size, max_length = 4, 16

        def start(self, prefix=None, *, batch_invariant=False):
            raise NotImplementedError

    bare = Bare()
    assert bare.caps == ModelCaps() and bare.cached_prefix(np.arange(3)) == 0 and bare.prefix_cache is None
    assert isinstance(bare, LanguageModel)
