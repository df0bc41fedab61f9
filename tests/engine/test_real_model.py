"""The runtime on the real default model (SmolLM2-135M-Instruct): exactness and the main job."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import anyio
import pytest

from specdec_rt import SpecConfig
from specdec_rt.engine.engine import Engine

pytestmark = [pytest.mark.slow, pytest.mark.export]

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that reverses a list."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three primary colors."},
    ],
    [{"role": "user", "content": "Summarize: The cat sat on the mat. The cat was happy on the mat."}],
    "The three laws of thermodynamics are",
    "def fibonacci(n):",
]


@pytest.mark.parametrize("draft", [None, "q8", "q4", "ngram"])
def test_greedy_speculative_equals_plain(default_model, draft):
    async def main():  # static costs: the test is about exactness, so speculation must run
        config = SpecConfig(measure_costs=False)
        async with await Engine.load(default_model, draft=draft, slots=1, spec_config=config) as engine:
            spec_rounds = 0
            for prompt in PROMPTS:
                ar = await engine.generate(prompt, max_new_tokens=48, mode="ar")
                spec = await engine.generate(prompt, max_new_tokens=48)
                assert spec.token_ids == ar.token_ids, (draft, prompt)
                assert spec.text == ar.text
                spec_rounds += spec.stats.rounds
            assert spec_rounds > 0  # speculation actually ran

    anyio.run(main)


@pytest.mark.parametrize("recipe", ["smollm2-135m-q8", "smollm2-135m-q4"])
def test_greedy_speculative_equals_plain_for_the_quantized_targets(default_model, recipe):
    """Exact to the quantized model, on this CPU whatever its kernels do with a lone position
    (on CPUs without VNNI the int4 target's lone steps round otherwise: ``OrtModel.pad_lone``).
    The default model's int4 copy drafts: it agrees often, so most positions go through verifies."""
    from export.cli import main
    from export.paths import model_dir

    assert main([recipe, "-q"]) == 0

    async def main_():
        config = SpecConfig(measure_costs=False)
        async with await Engine.load(
            model_dir(recipe), draft=str(default_model / "draft-q4"), slots=1, spec_config=config
        ) as engine:
            accepted = 0
            for prompt in PROMPTS[:4]:
                ar = await engine.generate(prompt, max_new_tokens=48, mode="ar")
                spec = await engine.generate(prompt, max_new_tokens=48)
                assert spec.token_ids == ar.token_ids, (recipe, prompt)
                accepted += spec.stats.accepted
            assert accepted > 40  # verifies of several positions decided most tokens

    anyio.run(main_)


def test_chat_answer_is_sensible_and_sampling_reproducible(default_model):
    async def main():
        async with await Engine.load(default_model, slots=1) as engine:
            r = await engine.generate(PROMPTS[0], max_new_tokens=24)
            assert "Paris" in r.text and r.finish_reason in ("stop", "length")
            kw = dict(max_new_tokens=32, temperature=0.8, top_p=0.95, seed=1234)
            a, b = await engine.generate(PROMPTS[1], **kw), await engine.generate(PROMPTS[1], **kw)
            assert a.token_ids == b.token_ids and a.stats.drafted > 0

    anyio.run(main)


def test_seeded_sampling_is_the_same_beside_other_requests(default_model):
    """A seeded sampled request gives the same tokens alone and batched with others (its draft's
    logits must not depend on the batch: the int8 draft's lone query takes the batched path)."""

    async def main():
        async with await Engine.load(default_model) as engine:
            kws = [
                dict(temperature=0.8, seed=7),
                dict(temperature=0.8, seed=1),
                dict(temperature=0.7, top_p=0.9, seed=5),
            ]
            prompts = ["Once upon a time", "def fib(n):", PROMPTS[1]]
            solo = [(await engine.generate(p, 32, **kw)).token_ids for p, kw in zip(prompts, kws)]
            together = await asyncio.gather(*(engine.generate(p, 32, **kw) for p, kw in zip(prompts, kws)))
            assert [r.token_ids for r in together] == solo

    anyio.run(main)


def test_json_schema_answers_parse_and_speculation_stays_exact(default_model):
    pytest.importorskip("llguidance")
    import json

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    ask = [{"role": "user", "content": "Make up a person. Reply in JSON with a name and an age."}]

    async def main():
        async with await Engine.load(default_model) as engine:
            got = {m: await engine.generate(ask, 64, mode=m, response_format=rf) for m in ("ar", "spec")}
            assert got["spec"].token_ids == got["ar"].token_ids and got["spec"].stats.accepted > 0
            person = json.loads(got["spec"].text)
            assert got["spec"].finish_reason == "stop" and isinstance(person["name"], str)
            assert isinstance(person["age"], int)
            sampled = await engine.generate(ask, 64, temperature=0.9, seed=2, response_format=rf)
            assert set(json.loads(sampled.text)) >= {"name", "age"}

    anyio.run(main)


def test_demo_main_job(default_model):
    proc = subprocess.run(
        [sys.executable, "-m", "specdec_rt", "demo", "--max-new-tokens", "24", "--no-build"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "median speedup of speculative over plain decoding" in proc.stdout
    assert "greedy outputs identical: yes" in proc.stdout
