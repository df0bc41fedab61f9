"""Log-probabilities of the prompt's own tokens (``prompt_logprobs=``; the server's ``echo``): each
prompt token's value under the target after the tokens before it, computed in chunks, leaving the
generation as it was, the slot free however it ends, and the KV to the prefix cache."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from serve_util import client, run

from specdec_rt import InvalidInputError
from specdec_rt.sampling import prompt_logprobs as scoring
from specdec_rt.sampling.logprobs import token_logprobs
from specdec_rt.serve import create_app

pytestmark = pytest.mark.export

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs back home again."


def _reference(model, ids: list[int], top: int) -> list:
    """Prefix by prefix, each in a fresh session: the last position's row, at the next token."""
    out = [None]
    for j in range(1, len(ids)):
        s = model.start()
        try:
            row = s.run_sync(np.array(ids[:j], dtype=np.int64), 1, 0)  # [1, V]
        finally:
            s.close()
        out += token_logprobs(row, np.array([ids[j]]), top)
    return out


def _same(got, want) -> None:
    assert len(got) == len(want) and got[0] is None and want[0] is None
    assert [e.logprob for e in got[1:]] == pytest.approx([e.logprob for e in want[1:]], abs=1e-4)
    assert [[j for j, _ in e.top] for e in got[1:]] == [[j for j, _ in e.top] for e in want[1:]]


@pytest.mark.parametrize("chunk", [64, 3])
def test_prompt_logprobs_equal_each_prefix_scored_alone(tiny_llama, monkeypatch, chunk):
    monkeypatch.setattr(scoring, "SCORE_CHUNK", chunk)  # 3: many chunk boundaries inside the prompt

    async def check(engine):
        got = await engine.generate(TEXT, 4, prompt_logprobs=3)
        ids = got.prompt_token_ids
        assert ids == engine.codec.encode_prompt(TEXT) and len(ids) > 10
        _same(got.prompt_logprobs, _reference(engine.target, ids, 3))
        assert all(len(e.top) == 3 for e in got.prompt_logprobs[1:])
        assert got.logprobs is None  # only what was asked for
        assert engine.running == 0 and not engine.target._owners  # every slot back

    run(check, tiny_llama)


def test_generation_is_unchanged_and_starts_from_the_scored_prompt(tiny_llama):
    async def check(engine):
        for mode in ("ar", "spec"):
            plain = await engine.generate(TEXT + mode, 10, mode=mode, logprobs=1)
            scored = await engine.generate(TEXT + mode, 10, mode=mode, logprobs=1, prompt_logprobs=0)
            assert scored.token_ids == plain.token_ids and scored.text == plain.text
            assert [e.logprob for e in scored.logprobs] == pytest.approx([e.logprob for e in plain.logprobs], abs=1e-4)
            assert all(e.top == () for e in scored.prompt_logprobs[1:])
        fresh = TEXT.upper()  # nothing cached yet: the scoring pass leaves its KV to the prefix cache
        hits = engine.prefix_cache["hit_tokens"]
        got = await engine.generate(fresh, 4, mode="ar", prompt_logprobs=0)
        assert engine.prefix_cache["hit_tokens"] - hits == len(got.prompt_token_ids) - 1
        assert got.stats.cached_prompt_tokens == 0  # the request computed its prompt itself: no earlier one's

    run(check, tiny_llama)


def test_stream_gives_the_prompt_first_and_one_token_prompts_have_nothing_to_score(tiny_llama):
    async def check(engine):
        events = [ev async for ev in engine.stream(TEXT, 5, prompt_logprobs=1)]
        assert events[0].text == "" and events[0].token_ids == () and events[0].prompt_logprobs[0] is None
        assert all(ev.prompt_logprobs is None for ev in events[1:])
        assert sum(len(ev.token_ids) for ev in events) == 5
        one = engine.codec.decode([engine.codec.encode_prompt("x")[0]])
        got = await engine.generate(one, 2, prompt_logprobs=2)
        assert got.prompt_logprobs == [None] and len(got.prompt_token_ids) == 1

    run(check, tiny_llama)


@pytest.mark.parametrize("bad", [21, -1, True, 1.5, "2"])
def test_bad_prompt_logprobs_are_named(tiny_llama, bad):
    async def check(engine):
        with pytest.raises(InvalidInputError, match="prompt_logprobs"):
            engine.stream(TEXT, 2, prompt_logprobs=bad)

    run(check, tiny_llama)


def test_cancelled_while_scoring_frees_the_slot(tiny_llama, monkeypatch):
    monkeypatch.setattr(scoring, "SCORE_CHUNK", 2)  # many calls: the cancel lands between or inside them

    async def check(engine):
        for delay in (0.0, 0.005, 0.02):
            task = asyncio.ensure_future(engine.generate(TEXT * 4, 4, prompt_logprobs=5))
            await asyncio.sleep(delay)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(50):  # released on the next event-loop passes, without a GC
                if not engine.target._owners and engine.running == 0:
                    break
                await asyncio.sleep(0.01)
            assert not engine.target._owners and engine.running == 0
        after = await engine.generate(TEXT, 6, mode="ar")
        assert len(after.token_ids) == 6

    run(check, tiny_llama)


def test_echo_in_completions_with_and_without_logprobs(tiny_llama):
    async def check(engine):
        want = await engine.generate(TEXT, 6, logprobs=2, prompt_logprobs=2)
        async with client(create_app(engine)) as c:
            plain = (
                await c.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 6, "temperature": 0, "echo": True})
            ).json()
            scored = (
                await c.post(
                    "/v1/completions",
                    json={"prompt": TEXT, "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 2},
                )
            ).json()
            # an evaluation harness's request: score the prompt, one token generated
            harness = (
                await c.post(
                    "/v1/completions",
                    json={"prompt": [TEXT], "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1},
                )
            ).json()
            streamed = (
                await c.post(
                    "/v1/completions",
                    json={
                        "prompt": TEXT,
                        "max_tokens": 6,
                        "temperature": 0,
                        "echo": True,
                        "logprobs": 2,
                        "stream": True,
                    },
                )
            ).text
            streamed_plain = (
                await c.post(
                    "/v1/completions",
                    json={"prompt": TEXT, "max_tokens": 6, "temperature": 0, "echo": True, "stream": True},
                )
            ).text
            chat = await c.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "echo": True},
            )
        assert plain["choices"][0]["text"] == TEXT + want.text and plain["choices"][0]["logprobs"] is None
        assert plain["usage"]["completion_tokens"] == 6  # the prompt is not counted as completion
        lp = scored["choices"][0]["logprobs"]
        assert scored["choices"][0]["text"] == TEXT + want.text
        n = len(want.prompt_token_ids)
        assert len(lp["tokens"]) == n + 6 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        values = [e.logprob for e in want.prompt_logprobs[1:]] + [e.logprob for e in want.logprobs]
        assert lp["token_logprobs"][1:] == pytest.approx(values, abs=1e-4)
        assert lp["text_offset"][n] == len(TEXT)  # offsets run on across the prompt (a BOS adds no text)
        assert all(len(t) in (2, 3) for t in lp["top_logprobs"][1:])  # 2 alternatives, plus the token itself
        hl = harness["choices"][0]["logprobs"]
        assert len(hl["token_logprobs"]) == n + 1 and hl["token_logprobs"][1:n] == pytest.approx(
            values[: n - 1], abs=1e-4
        )
        from serve_util import sse_data

        chunks = [e for e in sse_data(streamed) if e != "[DONE]"]
        first = chunks[0]["choices"][0]
        assert first["text"] == TEXT and first["logprobs"]["token_logprobs"][0] is None
        assert len(first["logprobs"]["tokens"]) == n and first["finish_reason"] is None
        assert "".join(e["choices"][0]["text"] for e in chunks) == TEXT + want.text
        got = [v for e in chunks for v in e["choices"][0]["logprobs"]["token_logprobs"]]
        assert got[1:] == pytest.approx(values, abs=1e-4)
        plain_chunks = [e for e in sse_data(streamed_plain) if e != "[DONE]"]
        assert plain_chunks[0]["choices"][0]["text"] == TEXT
        assert "".join(e["choices"][0]["text"] for e in plain_chunks) == TEXT + want.text
        assert chat.status_code == 200  # chat has no echo: the field is ignored, as unknown fields are

    run(check, tiny_llama)


def test_the_openai_client_reads_echoed_log_probabilities(tiny_llama):
    openai = pytest.importorskip("openai")
    from serve_util import running_server

    async def check(engine):
        want = await engine.generate(TEXT, 3, logprobs=1, prompt_logprobs=1)
        async with running_server(create_app(engine, model_name="tiny")) as url:
            api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            r = await api.completions.create(
                model="tiny", prompt=TEXT, max_tokens=3, temperature=0, echo=True, logprobs=1
            )
        lp = r.choices[0].logprobs
        assert r.choices[0].text == TEXT + want.text
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(
            [e.logprob for e in want.prompt_logprobs[1:]] + [e.logprob for e in want.logprobs], abs=1e-4
        )

    run(check, tiny_llama)


def test_offsets_after_a_character_left_incomplete():
    """Found by QA: a whole token after bytes that begin a character it does not continue was
    given the offset of the U+FFFD those bytes became, not its own."""
    from specdec_rt.sampling.logprobs import TokenLogprob
    from specdec_rt.serve.replies import LogprobsFormat

    pieces = {0: b"\xf0\x9f", 1: b"z", 2: b"\x8e", 3: b"\xb6"}

    def offsets(ids):
        fmt = LogprobsFormat("completion", pieces.__getitem__)
        return fmt.body(ids, [TokenLogprob(-1.0)] * len(ids))["text_offset"]

    assert offsets([0, 1]) == [0, 1]  # text "\ufffdz": z at 1
    assert offsets([0, 2, 1]) == [0, 0, 1]  # f0 9f 8e, then z
    assert offsets([0, 2, 3, 1]) == [0, 0, 0, 1]  # f0 9f 8e b6 = one character, then z
    assert offsets([0, 0, 1]) == [0, 1, 2]  # a second start: the first became U+FFFD
    assert offsets([1, 1]) == [0, 1]


def _per_row(logits, ids, top):
    """token_logprobs as it was, row by row (the reference the vectorised one must equal)."""
    from specdec_rt.sampling.logprobs import TokenLogprob

    rows = np.asarray(logits)
    m = rows.max(axis=-1, keepdims=True)
    lse = m[:, 0].astype(np.float64) + np.log(np.exp(rows - m).sum(axis=-1, dtype=np.float64))
    out = []
    for i, t in enumerate(np.asarray(ids).tolist()):
        best: tuple = ()
        if top:
            row = rows[i]
            kth = row[np.argpartition(-row, top - 1)[top - 1]] if top < row.size else row.min()
            above = np.flatnonzero(row > kth)
            tied = np.flatnonzero(row == kth)[: top - above.size]
            cand = sorted(np.concatenate([above, tied]).tolist(), key=lambda j: (-row[j], j))
            best = tuple((j, float(row[j]) - float(lse[i])) for j in cand)
        out.append(TokenLogprob(float(rows[i, t]) - float(lse[i]), best))
    return tuple(out)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN rows
def test_vectorised_token_logprobs_equal_the_row_by_row_values_ties_and_nans_too():
    rng = np.random.default_rng(0)
    for trial in range(200):
        n, size = int(rng.integers(1, 12)), int(rng.integers(1, 50))
        x = rng.standard_normal((n, size)).astype(np.float32)
        kind = trial % 5
        if kind == 1:
            x = np.round(x).astype(np.float32)  # ties everywhere
        elif kind == 2:
            x[rng.random((n, size)) < 0.3] = -np.inf
        elif kind == 3:
            x[rng.random((n, size)) < 0.2] = np.nan
        elif kind == 4:
            x[:] = 0.0
        ids = rng.integers(0, size, n)
        for top in (0, 1, 2, 5, 20, size, size + 3):
            assert repr(token_logprobs(x, ids, top)) == repr(_per_row(x, ids, top)), (trial, top)
