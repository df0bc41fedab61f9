"""``Engine.generate(prompt, params=None, **overrides)`` and ``stream``: a RequestParams, its
fields as keywords (the older form), or both (keywords win); the results are the same."""

from __future__ import annotations

import anyio
import pytest

from specdec_rt import InvalidInputError, RequestParams, SpecConfig
from specdec_rt.engine.engine import Engine

pytestmark = pytest.mark.export

PROMPT = "def add(a, b):"
CHAT = [{"role": "user", "content": "Write a Python function."}]
KWARGS = [  # each: the same request as keywords and as a RequestParams
    dict(max_new_tokens=10),
    dict(max_new_tokens=12, temperature=0.8, top_k=20, top_p=0.9, seed=7, logprobs=2),
    dict(max_new_tokens=12, mode="ar", stop=["("], logit_bias={5: -100, 9: 3}, repetition_penalty=1.3),
    dict(
        max_new_tokens=8,
        temperature=0.6,
        seed=2,
        presence_penalty=0.5,
        frequency_penalty=0.4,
        prompt_logprobs=1,
        min_tokens=4,
        ignore_eos=True,
        truncate_prompt=True,
    ),
]


def _engine(folder):
    return Engine.load(folder, draft="q4", spec_config=SpecConfig(measure_costs=False), warmup=False)


def _same(a, b) -> bool:
    return (a.text, a.token_ids, a.logprobs, a.prompt_logprobs, a.finish_reason, a.stats.mode) == (
        b.text,
        b.token_ids,
        b.logprobs,
        b.prompt_logprobs,
        b.finish_reason,
        b.stats.mode,
    )


async def _streamed(stream) -> list:
    async with stream as events:
        return [(ev.text, ev.token_ids, ev.finished, ev.logprobs) async for ev in events]


def test_keywords_and_params_give_the_same_results(tiny_llama):
    async def main():
        async with await _engine(tiny_llama) as engine:
            for kw in KWARGS:
                params = RequestParams(**kw)
                old = await engine.generate(PROMPT, **kw)
                assert _same(await engine.generate(PROMPT, params), old), kw
                assert _same(await engine.generate(PROMPT, params=params), old), kw
                rest = {k: v for k, v in kw.items() if k != "max_new_tokens"}
                assert _same(await engine.generate(PROMPT, kw["max_new_tokens"], **rest), old), kw  # the README's form
                by_keywords = engine.stream(PROMPT, **kw)
                # the request's checked parameters, on its stream (no mode: the engine's own)
                assert by_keywords.params == (params if params.mode else params.replace(mode="spec"))
                assert await _streamed(engine.stream(PROMPT, params)) == await _streamed(by_keywords)
            assert engine.running == 0 and not engine._tasks

    anyio.run(main)


def test_keywords_override_params(tiny_llama):
    async def main():
        async with await _engine(tiny_llama) as engine:
            sampled = RequestParams(max_new_tokens=20, temperature=0.9, seed=3, stop=["zzz"])
            greedy = await engine.generate(CHAT, max_new_tokens=6, stop=["zzz"])
            got = await engine.generate(CHAT, sampled, max_new_tokens=6, temperature=0.0)
            assert _same(got, greedy) and len(got.token_ids) == 6
            again = await engine.generate(CHAT, sampled)  # the params themselves are unchanged
            assert len(again.token_ids) <= 20 and sampled.temperature == 0.9
            assert _same(again, await engine.generate(CHAT, max_new_tokens=20, temperature=0.9, seed=3, stop="zzz"))

    anyio.run(main)


TOOLS = [{"type": "function", "function": {"name": "f"}}]


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        ((), dict(max_tokens=5), "^unknown request parameter 'max_tokens'"),
        ((RequestParams(),), dict(n=2, best_of=1), "^unknown request parameters 'best_of', 'n'"),
        ((5,), dict(max_new_tokens=6), "^max_new_tokens is given twice"),
        (("5",), {}, "^params must be a RequestParams"),
        (({"max_new_tokens": 5},), {}, "^params must be a RequestParams"),
        ((0,), {}, "^max_new_tokens must be a positive integer, got 0"),
        ((2.5,), {}, "^max_new_tokens must be a positive integer, got 2.5"),
        ((RequestParams(max_new_tokens=8),), dict(min_tokens=9), "^min_tokens must be"),
        ((RequestParams(tools=TOOLS),), {}, "^tools go with chat messages"),
    ],
)
def test_bad_calls_raise_before_any_work(tiny_llama, args, kwargs, match):
    async def main():
        async with await _engine(tiny_llama) as engine:
            calls = engine.target.calls
            with pytest.raises(InvalidInputError, match=match):
                engine.stream(PROMPT, *args, **kwargs)  # at once: no task, no thread
            with pytest.raises(InvalidInputError, match=match):
                await engine.generate(PROMPT, *args, **kwargs)
            assert not engine._tasks and engine.target.calls == calls

    anyio.run(main)
