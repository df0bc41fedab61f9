"""Completions' ``prompt`` in OpenAI's four forms (a string, a list of strings, token ids, a list
of token-id lists) and ``Engine.generate`` on token ids."""

from __future__ import annotations

import pytest
from serve_util import client, run, sse_data

from specdec_rt import InvalidInputError
from specdec_rt.serve import create_app

pytestmark = pytest.mark.export

A, B = "def add(a, b):", "The capital of France is"


def test_engine_takes_token_ids_as_they_are(tiny_llama):
    async def check(engine):
        ids = engine.codec.encode_prompt(A)
        text, tokens = await engine.generate(A, 8), await engine.generate(ids, 8)
        assert tokens.token_ids == text.token_ids and tokens.prompt_tokens == len(ids)
        assert (await engine.generate(tuple(ids), 8, mode="ar")).token_ids == text.token_ids
        with pytest.raises(InvalidInputError, match=r"prompt\[1\] = .* not a token id"):
            await engine.generate([ids[0], engine.target.vocab_size], 2)
        with pytest.raises(InvalidInputError, match=r"prompt\[0\]"):
            await engine.generate([-1], 2)

    run(check, tiny_llama)


def test_batched_and_token_id_prompts_give_one_choice_per_prompt_and_n(tiny_llama):
    async def check(engine):
        want = {p: (await engine.generate(p, 6)) for p in (A, B)}
        ids_b = engine.codec.encode_prompt(B)
        async with client(create_app(engine)) as c:
            r = (
                await c.post("/v1/completions", json={"prompt": [A, ids_b], "n": 2, "max_tokens": 6, "temperature": 0})
            ).json()
            one = (
                await c.post("/v1/completions", json={"prompt": ids_b, "max_tokens": 6, "temperature": 0, "echo": True})
            ).json()
            s = (
                await c.post(
                    "/v1/completions",
                    json={
                        "prompt": [[*engine.codec.encode_prompt(A)], B],
                        "max_tokens": 6,
                        "temperature": 0,
                        "stream": True,
                        "stream_options": {"include_usage": True},
                    },
                )
            ).text
        assert [ch["index"] for ch in r["choices"]] == [0, 1, 2, 3]
        assert [ch["text"] for ch in r["choices"]] == [want[A].text] * 2 + [want[B].text] * 2
        assert r["usage"]["prompt_tokens"] == want[A].prompt_tokens + want[B].prompt_tokens  # each prompt once
        assert r["usage"]["completion_tokens"] == 4 * 6
        assert one["choices"][0]["text"] == B + want[B].text  # token ids echoed as their text
        events = sse_data(s)
        chunks, usage = events[:-2], events[-2]
        texts = {0: "", 1: ""}
        for e in chunks:
            for ch in e["choices"]:
                texts[ch["index"]] += ch["text"]
        assert texts == {0: want[A].text, 1: want[B].text}
        assert sorted(ch["index"] for e in chunks for ch in e["choices"] if ch["finish_reason"]) == [0, 1]
        assert usage["usage"]["prompt_tokens"] == want[A].prompt_tokens + want[B].prompt_tokens

    run(check, tiny_llama)


@pytest.mark.parametrize(
    "prompt, needle",
    [
        ([], "non-empty"),
        ([1, "a"], "prompt[1]"),
        ([[1], []], "prompt[1]"),
        ([True], "prompt[0]"),
        ([[1, 2.5]], "prompt[0]"),
        ([10**9], "not a token id"),
        ({"text": "x"}, "non-empty string"),
    ],
)
def test_bad_prompts_are_a_400_naming_prompt(tiny_llama, prompt, needle):
    async def check(engine):
        async with client(create_app(engine)) as c:
            r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "prompt" and needle in err["message"]
        assert engine.running == 0 and not engine.target._owners

    run(check, tiny_llama)


def test_a_batch_past_the_capacity_is_a_400_and_admits_nothing(tiny_llama):
    async def check(engine):
        async with client(create_app(engine, slots=2, max_queued=2)) as c:
            r = await c.post("/v1/completions", json={"prompt": [A, B, A], "n": 2, "max_tokens": 2})
            ok = await c.post("/v1/completions", json={"prompt": [A, B], "n": 2, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert "3 prompts" in r.json()["error"]["message"]
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 4

    run(check, tiny_llama)
