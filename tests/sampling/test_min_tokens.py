"""``min_tokens`` and ``ignore_eos`` (vLLM's options, which load-testing tools send): no EOS before
``min_tokens`` tokens, held by the same scoring hook as a constraint (so draft and target agree,
and speculation stays exact), and an EOS that does not end the answer."""

from __future__ import annotations

import itertools

import anyio
import numpy as np
import pytest

from specdec_rt import InvalidInputError, ModelDrafter, ModelVerifier, SamplingParams, SpecConfig, SpecDecScheduler
from specdec_rt.sampling import warp
from specdec_rt.sampling.constraints import Constraint, MinTokens
from specdec_rt.testing import chi_square_pvalue, toy_pair, toy_scheduler

ALWAYS = dict(measure_costs=False, adapt_k=False, fallback_below=0.0, zero_rounds=10**6, min_speedup=0.0)


def _eos_prone(vocab: int, seed: int):
    """A toy pair and an EOS id that greedy decoding reaches early from prompt [1, 2]."""
    target, draft = toy_pair(vocab, seed=seed, distance=0.3)
    sched = SpecDecScheduler(ModelDrafter(draft), ModelVerifier(target), SpecConfig(k_init=4, **ALWAYS))
    free = anyio.run(lambda: sched.run([1, 2], 40, mode="ar")).token_ids
    return target, draft, free[3]  # the 4th token, as EOS: free decoding ends there


def _run(sched, n, min_tokens=0, ignore_eos=False, mode="spec", params=None, rng=None, prompt=(1, 2)):
    eos = next(iter(sched.eos_ids))
    c = MinTokens(min_tokens, [eos], 12 if params is None else sched.verifier.model.vocab_size) if min_tokens else None
    return anyio.run(
        lambda: sched.run(
            list(prompt), n, params or SamplingParams(), mode=mode, constraint=c, ignore_eos=ignore_eos, rng=rng
        )
    )


@pytest.mark.parametrize("tree_nodes", [0, 3])
def test_greedy_min_tokens_and_ignore_eos_equal_plain_decoding(tree_nodes):
    target, draft, eos = _eos_prone(12, 6)
    sched = SpecDecScheduler(
        ModelDrafter(draft), ModelVerifier(target), SpecConfig(k_init=5, tree_nodes=tree_nodes, **ALWAYS), eos_ids=[eos]
    )
    free = _run(sched, 30, mode="ar")
    assert free.token_ids[-1] == eos and len(free.token_ids) == 4 and free.stats.finish_reason == "stop"
    # min_tokens: plain decoding by hand, EOS masked while fewer than 10 tokens are out
    seq = [1, 2]
    while len(seq) - 2 < 30:
        row = target.logits_at(np.array(seq))[-1].copy()
        if len(seq) - 2 < 10:
            row[eos] = -np.inf
        seq.append(int(np.argmax(row)))
        if seq[-1] == eos:
            break
    want = seq[2:]
    assert eos not in want[:10] and want != free.token_ids
    assert _run(sched, 30, min_tokens=10, mode="ar").token_ids == want
    assert _run(sched, 30, min_tokens=10).token_ids == want
    # ignore_eos: the EOS is emitted and decoding goes on to the budget, in both modes
    plain = _run(sched, 30, ignore_eos=True, mode="ar")
    assert plain.token_ids[:4] == free.token_ids and len(plain.token_ids) == 30
    assert plain.stats.finish_reason == "length"
    assert _run(sched, 30, ignore_eos=True).token_ids == plain.token_ids
    assert sched.totals.accepted > 5


def test_batched_min_tokens_rows_each_equal_their_own_plain_run():
    sched, target, _ = toy_scheduler(0.3, vocab_size=12, seed=6, batched=True, config=SpecConfig(**ALWAYS))
    eos = _eos_prone(12, 6)[2]
    sched.eos_ids = frozenset([eos])
    asks = [(0, False), (5, False), (12, False), (0, True)]
    alone = [_run(sched, 20, m, i, mode="ar").token_ids for m, i in asks]

    async def together():
        out = [None] * len(asks)

        async def one(j):
            m, i = asks[j]
            c = MinTokens(m, [eos], 12) if m else None
            out[j] = (await sched.run([1, 2], 20, SamplingParams(), constraint=c, ignore_eos=i)).token_ids

        async with anyio.create_task_group() as tg:
            for j in range(len(asks)):
                tg.start_soon(one, j)
        return out

    assert anyio.run(together) == alone
    assert alone[0][-1] == eos and len(alone[0]) == 4 and eos not in alone[1][:5] + alone[2][:12]
    assert alone[1] != alone[0] and alone[3][:4] == alone[0] and len(alone[3]) == 20


def test_sampling_keeps_the_min_tokens_distribution():
    vocab, length, prompt, n = 4, 3, [1, 2], 6000
    target, draft = toy_pair(vocab, seed=3, distance=0.7)
    params = SamplingParams(temperature=1.0)
    first = warp(target.logits_at(np.array(prompt))[-1:].astype(np.float32), params)[0]  # [V]
    eos = int(np.argmax(first))  # the likeliest first token: masking it changes the law a lot
    assert first[eos] > 0.3
    sched = SpecDecScheduler(
        ModelDrafter(draft), ModelVerifier(target), SpecConfig(k_min=2, k_init=2, k_max=2, **ALWAYS), eos_ids=[eos]
    )
    # exact: EOS masked at the first 2 positions (so an EOS, if any, is the 3rd and last token)
    want: dict = {}
    for seq in itertools.product(range(vocab), repeat=length):
        rows = target.logits_at(np.array(prompt + list(seq[:-1])))[len(prompt) - 1 :].astype(np.float32)  # [3, V]
        rows[:2, eos] = -np.inf
        probs = warp(rows, params)  # [3, V]
        want[seq] = float(np.prod(probs[np.arange(length), list(seq)]))
    rng = np.random.default_rng(5)
    counts: dict = {}
    for _ in range(n):
        c = MinTokens(2, [eos], vocab)
        key = tuple(anyio.run(lambda: sched.run(prompt, length, params, constraint=c, rng=rng)).token_ids)
        counts[key] = counts.get(key, 0) + 1
    assert all(eos not in k[:2] for k in counts)
    assert chi_square_pvalue(counts, want) > 1e-3


def test_min_tokens_mask_and_its_hand_over():
    inner_calls = []

    class Inner(Constraint):
        def allowed(self, before):
            inner_calls.append(list(before))
            return None if 3 in before else np.array([True, True, False, True])

        def commit(self, ids):
            inner_calls.append(("commit", list(ids)))

    c = MinTokens(2, [1, 99], 4, Inner())
    assert c.allowed([]).tolist() == [True, False, False, True]
    assert c.allowed([0]).tolist() == [True, False, False, True]
    assert c.allowed([0, 0]).tolist() == [True, True, False, True]  # past min_tokens: the inner rule alone
    assert c.allowed([3]) is None  # a path the inner constraint rules out stays so
    only_eos = MinTokens(
        5,
        [2],
        3,
        type(
            "Done", (), {"allowed": lambda self, b: np.array([False, False, True]), "commit": lambda self, ids: None}
        )(),
    )
    assert only_eos.allowed([]).tolist() == [False, False, True]  # never forced past the answer's end
    c.commit([0, 0])
    assert c.spent and ("commit", [0, 0]) in inner_calls


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=True), "min_tokens"),
        (dict(min_tokens=1.5), "min_tokens"),
        (dict(min_tokens=9), "min_tokens"),
        (dict(ignore_eos="yes"), "ignore_eos"),
        (dict(ignore_eos=1), "ignore_eos"),
    ],
)
def test_bad_length_options_are_named(tiny_llama, kwargs, name):
    from specdec_rt import Engine

    async def main():
        async with await Engine.load(tiny_llama, slots=1) as engine:
            with pytest.raises(InvalidInputError, match=name):
                engine.stream("hello", max_new_tokens=8, **kwargs)
            return (await engine.generate("hello", max_new_tokens=8, mode="ar")).token_ids

    assert anyio.run(main)  # the engine serves the next request


def test_engine_min_tokens_and_ignore_eos_on_a_tiny_export(tiny_llama):
    from specdec_rt import Engine

    async def main():
        async with await Engine.load(tiny_llama, slots=2) as engine:
            eos = next(iter(engine.scheduler.eos_ids))
            bias = {eos: 30.0}  # EOS first, unless something holds it off
            out = {}
            for mode in ("ar", "spec"):
                free = await engine.generate("hello", 12, mode=mode, logit_bias=bias)
                held = await engine.generate("hello", 12, mode=mode, logit_bias=bias, min_tokens=5)
                on = await engine.generate("hello", 12, mode=mode, logit_bias=bias, ignore_eos=True)
                out[mode] = (free.token_ids, held.token_ids, on.token_ids, on.stats.finish_reason)
            return eos, out

    eos, out = anyio.run(main)
    assert out["spec"] == out["ar"]
    free, held, on, reason = out["ar"]
    assert free == [eos]
    assert eos not in held[:5] and len(held) >= 6 and held[5] == eos
    assert on == [eos] * 12 and reason == "length"


def test_server_min_tokens_and_ignore_eos(tiny_llama):
    from serve_util import client, run

    from specdec_rt.serve import create_app

    async def check(engine):
        eos = next(iter(engine.scheduler.eos_ids))
        base = {"prompt": "hello", "max_tokens": 10, "temperature": 0, "logit_bias": {str(eos): 30}}
        async with client(create_app(engine)) as c:
            free = (await c.post("/v1/completions", json=base)).json()
            on = (
                await c.post(
                    "/v1/completions",
                    json={**base, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}},
                )
            ).text
            held = (
                await c.post(
                    "/v1/chat/completions",
                    json={
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 10,
                        "temperature": 0,
                        "logit_bias": {str(eos): 30},
                        "min_tokens": 4,
                        "logprobs": True,
                    },
                )
            ).json()
            bad = [
                await c.post("/v1/completions", json={**base, **extra})
                for extra in (
                    {"min_tokens": 11},
                    {"min_tokens": -1},
                    {"min_tokens": "2"},
                    {"ignore_eos": "true"},
                    {"min_tokens": 300, "max_tokens": None},
                )
            ]
        assert free["usage"]["completion_tokens"] == 1 and free["choices"][0]["finish_reason"] == "stop"
        usage = [e for e in sse_data_all(on) if e.get("usage")][-1]["usage"]
        assert usage["completion_tokens"] == 10
        assert [e["choices"][0]["finish_reason"] for e in sse_data_all(on) if e["choices"]][-1] == "length"
        assert held["usage"]["completion_tokens"] == 5 and held["choices"][0]["finish_reason"] == "stop"
        assert [r.status_code for r in bad] == [400] * 5
        assert [r.json()["error"]["param"] for r in bad] == ["min_tokens"] * 3 + ["ignore_eos", "min_tokens"]
        assert engine.running == 0

    def sse_data_all(text):
        from serve_util import sse_data

        events = sse_data(text)
        assert events[-1] == "[DONE]"
        return events[:-1]

    run(check, tiny_llama)


def test_ignore_eos_past_a_complete_grammar_equals_plain_decoding(tiny_llama):
    """A JSON answer is complete early; with ignore_eos the request goes on, where the grammar allows
    only EOS. Drafts of EOS there are not a path the grammar rules out (it was a 400 in `spec`)."""
    pytest.importorskip("llguidance")
    from specdec_rt import Engine

    async def main():
        out = {}
        async with await Engine.load(tiny_llama, slots=2, spec_config=SpecConfig(k_init=4, **ALWAYS)) as engine:
            eos = next(iter(engine.scheduler.eos_ids))
            for fmt in (
                {"type": "json_object"},
                {
                    "type": "json_schema",
                    "json_schema": {
                        "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
                    },
                },
            ):
                for mode in ("ar", "spec"):
                    r = await engine.generate("abc", 60, mode=mode, response_format=fmt, ignore_eos=True)
                    out[(fmt["type"], mode)] = (r.token_ids, r.stats.finish_reason)
        return eos, out

    eos, out = anyio.run(main)
    for kind in ("json_object", "json_schema"):
        ids, reason = out[(kind, "ar")]
        assert out[(kind, "spec")] == (ids, reason)
        assert reason == "length" and len(ids) == 60 and eos in ids  # complete, then only EOS
        assert set(ids[ids.index(eos) :]) == {eos} and ids.index(eos) < 50


def test_min_tokens_holds_stop_strings_off_as_vllm_does(tiny_llama):
    """A stop string completed by one of the first min_tokens tokens ends nothing (only text of
    later tokens is searched), in either mode, streamed or not. A biased token repeats, so its
    text completes the stop string at every token."""
    from specdec_rt import Engine

    async def main():
        async with await Engine.load(tiny_llama, slots=1) as engine:
            plain = {w: engine.codec.tokenizer.encode(w, add_special_tokens=False).ids for w in (" the", "a", "e")}
            word = next(w for w, ids in plain.items() if len(ids) == 1)
            x = plain[word][0]
            out = {}
            for mode in ("ar", "spec"):
                kw = dict(mode=mode, stop=[word], logit_bias={x: 50.0})
                cut = await engine.generate("hello", 24, **kw)
                held = await engine.generate("hello", 24, min_tokens=4, **kw)
                streamed = []
                async with engine.stream("hello", 24, min_tokens=4, **kw) as events:
                    async for ev in events:
                        streamed.append(ev.text)
                out[mode] = (
                    cut.token_ids,
                    cut.text,
                    held.token_ids,
                    held.text,
                    "".join(streamed),
                    held.stats.finish_reason,
                )
            return x, word, out

    x, word, out = anyio.run(main)
    assert out["spec"] == out["ar"]
    cut_ids, cut_text, held_ids, held_text, streamed, reason = out["ar"]
    assert cut_ids == [x] and cut_text == ""  # the first token completes the stop string
    assert held_ids == [x] * 5 and held_text == word * 4 and streamed == held_text and reason == "stop"
