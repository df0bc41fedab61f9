"""Constrained decoding (``response_format``): every row a request scores, draft and target,
has the constraint's disallowed tokens at -inf after its own path, so greedy speculation equals
constrained plain decoding and sampled sequences keep the constrained distribution. A toy
constraint (allowed next tokens by the previous one) for the property checks; llguidance's JSON
grammars on a tiny exported model and through the server."""

from __future__ import annotations

import itertools
import json

import anyio
import numpy as np
import pytest

from specdec_rt import InvalidInputError, ModelDrafter, ModelVerifier, SamplingParams, SpecConfig, SpecDecScheduler
from specdec_rt.errors import InferenceError
from specdec_rt.sampling import warp
from specdec_rt.sampling.constraints import Constraint, check_response_format, constrained
from specdec_rt.speculation.context import RequestContext
from specdec_rt.testing import chi_square_pvalue, toy_pair, toy_scheduler

ALWAYS = dict(measure_costs=False, adapt_k=False, fallback_below=0.0, zero_rounds=10**6, min_speedup=0.0)


class Transitions(Constraint):
    """Toy constraint: token y may follow token x where ``table[x, y]``."""

    def __init__(self, table: np.ndarray, last: int) -> None:
        self.table, self.last, self.committed = table, last, []

    def allowed(self, before):
        prev = self.last
        for t in before:
            if not self.table[prev, t]:
                return None  # the path is ruled out already
            prev = t
        return self.table[prev].copy()

    def commit(self, ids):
        for t in ids:
            assert self.table[self.last, t], "committed a token the constraint rules out"
            self.last = int(t)
            self.committed.append(int(t))


def _table(vocab: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    table = rng.random((vocab, vocab)) < 0.4  # [V, V]
    table[np.arange(vocab), rng.integers(0, vocab, vocab)] = True  # never a dead end
    return table


def _run(sched, prompt, n, params=None, mode="spec", table=None, rng=None):
    c = None if table is None else Transitions(table, prompt[-1])
    out = anyio.run(lambda: sched.run(prompt, n, params or SamplingParams(), mode=mode, constraint=c, rng=rng))
    assert c is None or c.committed == out.token_ids  # every committed token went through the constraint
    return out.token_ids


@pytest.mark.parametrize("tree_nodes", [0, 3])
def test_greedy_speculation_equals_constrained_plain_decoding(tree_nodes):
    target, draft = toy_pair(12, seed=6, distance=0.3)
    table = _table(12, 1)
    sched = SpecDecScheduler(
        ModelDrafter(draft), ModelVerifier(target), SpecConfig(k_init=5, tree_nodes=tree_nodes, **ALWAYS)
    )
    prompt = [3, 3, 1]
    want = _run(sched, prompt, 40, mode="ar", table=table)
    assert want != _run(sched, prompt, 40, mode="ar")  # the constraint changes what greedy decoding says
    assert all(table[a, b] for a, b in zip([prompt[-1]] + want, want))
    # plain decoding by hand: argmax of the masked target row, token by token
    seq = list(prompt)
    for _ in range(40):
        row = target.logits_at(np.array(seq))[-1]
        seq.append(int(np.argmax(np.where(table[seq[-1]], row, -np.inf))))
    assert seq[len(prompt) :] == want
    assert _run(sched, prompt, 40, table=table) == want
    assert sched.totals.accepted > 5  # drafts were accepted under the constraint
    assert (target.tree_calls > 0) == (tree_nodes > 0)


def test_rows_masked_without_their_drafts_are_caught(monkeypatch):
    """A verifier that masks every row as if it came right after the committed tokens (its
    drafts left out) breaks the equality above: the test sees the difference."""
    target, draft = toy_pair(12, seed=6, distance=0.3)
    table = _table(12, 1)
    sched = SpecDecScheduler(ModelDrafter(draft), ModelVerifier(target), SpecConfig(k_init=5, **ALWAYS))
    want = _run(sched, [3, 3, 1], 40, mode="ar", table=table)
    real = RequestContext.scores
    monkeypatch.setattr(RequestContext, "scores", lambda ctx, logits, before: real(ctx, logits, [[] for _ in before]))
    try:  # a token the constraint rules out gets committed, or the tokens differ: either way caught
        got = _run(sched, [3, 3, 1], 40, table=table)
    except InferenceError as exc:
        assert "rules out" in str(exc)
    else:
        assert got != want


def test_batched_requests_with_their_own_constraints_each_equal_their_own_plain_run():
    sched, _, _ = toy_scheduler(0.4, vocab_size=12, seed=7, batched=True, config=SpecConfig(**ALWAYS))
    prompts = [[1, 2], [3, 4, 5], [6], [7, 8, 9]]
    tables = [_table(12, s) for s in range(4)]
    alone = [_run(sched, p, 25, mode="ar", table=t) for p, t in zip(prompts, tables)]

    async def together():
        out = [None] * 4

        async def one(i):
            c = Transitions(tables[i], prompts[i][-1])
            out[i] = (await sched.run(prompts[i], 25, SamplingParams(), constraint=c)).token_ids

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, i)
        return out

    assert anyio.run(together) == alone


def _constrained_distribution(target, prompt, length, table, params):
    out = {}
    for seq in itertools.product(range(target.vocab_size), repeat=length):
        path = list(prompt) + list(seq)
        rows = target.logits_at(np.array(path[:-1]))[len(prompt) - 1 :]  # [length, V]
        rows = np.where(table[np.array(path[len(prompt) - 1 : -1])], rows, -np.inf)  # row j: after path[:j]
        probs = warp(rows.astype(np.float32), params)  # [length, V]
        out[seq] = float(np.prod(probs[np.arange(length), list(seq)]))
    return out


@pytest.mark.parametrize("tree_nodes", [0, 2])
def test_sampling_keeps_the_constrained_distribution(tree_nodes):
    vocab, length, prompt, n = 5, 3, [1, 2], 6000
    target, draft = toy_pair(vocab, seed=3, distance=0.7)
    table = _table(vocab, 4)
    params = SamplingParams(temperature=1.0)
    sched = SpecDecScheduler(
        ModelDrafter(draft),
        ModelVerifier(target),
        SpecConfig(k_min=2, k_init=2, k_max=2, tree_nodes=tree_nodes, **ALWAYS),
    )
    rng = np.random.default_rng(12)
    counts: dict = {}
    for _ in range(n):
        key = tuple(_run(sched, prompt, length, params, table=table, rng=rng))
        counts[key] = counts.get(key, 0) + 1
    assert (target.tree_calls > 0) == (tree_nodes > 0)
    want = _constrained_distribution(target, prompt, length, table, params)
    assert chi_square_pvalue(counts, want) > 1e-3
    free = _constrained_distribution(target, prompt, length, np.ones_like(table), params)
    assert chi_square_pvalue(counts, free) < 1e-6  # the constraint moved it, measurably


def test_constrained_rows_are_a_copy_and_unreachable_rows_stay():
    logits = np.arange(12, dtype=np.float32).reshape(2, 6)  # [2, V]
    table = np.zeros((6, 6), dtype=bool)
    table[5, [0, 2]] = True
    table[0, 1] = True
    out = constrained(logits, Transitions(table, 5), [[], [3]])  # row 1: after 3, which 5 rules out
    assert out[0].tolist() == [0, -np.inf, 2, -np.inf, -np.inf, -np.inf]
    assert out[1].tolist() == logits[1].tolist() and logits[0, 1] == 1  # untouched, and no write-through


@pytest.mark.parametrize(
    "bad", [{"type": "xml"}, "json", {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": [1]}}]
)
def test_bad_response_formats_are_named(bad):
    with pytest.raises(InvalidInputError, match="response_format"):
        check_response_format(bad)


def test_response_format_shapes():
    assert check_response_format(None) is None and check_response_format({"type": "text"}) is None
    assert check_response_format({"type": "json_object"}) == {"type": "object"}
    schema = {"type": "integer"}
    assert check_response_format({"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}) == schema


# ---------------------------------------------------------------- llguidance on a tiny export
pytest.importorskip("llguidance")


@pytest.mark.export
def test_json_schemas_on_a_tiny_model_exactly_and_to_the_letter(tiny_llama):
    from serve_util import run

    enum = {
        "type": "json_schema",
        "json_schema": {"name": "a", "schema": {"type": "string", "enum": ["yes", "no", "maybe"]}},
    }

    async def check(engine):
        for rf in (enum, {"type": "json_object"}):
            got = {m: await engine.generate("Answer:", 24, mode=m, response_format=rf) for m in ("ar", "spec")}
            assert got["ar"].token_ids == got["spec"].token_ids  # speculation exact for the constrained target
            free = await engine.generate("Answer:", 24, mode="ar")
            assert got["ar"].token_ids != free.token_ids
        # a random model, held to an enum: one of the three strings, then the end (only allowed once complete)
        assert got is not None
        r = await engine.generate("Answer:", 24, mode="spec", response_format=enum)
        assert json.loads(r.text) in ("yes", "no", "maybe") and r.finish_reason == "stop"
        s = await engine.generate("Answer:", 24, temperature=1.0, seed=4, response_format=enum)
        assert json.loads(s.text) in ("yes", "no", "maybe")
        obj = await engine.generate("Answer:", 24, mode="ar", response_format={"type": "json_object"})
        assert obj.text.lstrip().startswith("{")
        with pytest.raises(InvalidInputError, match="response_format"):
            await engine.generate(
                "x", 4, response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}
            )
        assert engine.running == 0 and not engine.target._owners

    run(check, tiny_llama)


@pytest.mark.export
def test_response_format_through_the_server(tiny_llama):
    from serve_util import CHAT, client, run

    from specdec_rt.serve import create_app

    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "string", "enum": ["red", "blue"]}}}

    async def check(engine):
        async with client(create_app(engine)) as c:
            r = await c.post(
                "/v1/chat/completions",
                json={"messages": CHAT, "max_tokens": 16, "temperature": 0, "response_format": rf},
            )
            bad = await c.post(
                "/v1/chat/completions",
                json={
                    "messages": CHAT,
                    "max_tokens": 4,
                    "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}},
                },
            )
            text = await c.post(
                "/v1/completions", json={"prompt": "x", "max_tokens": 16, "temperature": 0, "response_format": rf}
            )
        assert r.status_code == 200, r.text
        assert json.loads(r.json()["choices"][0]["message"]["content"]) in ("red", "blue")
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        assert json.loads(text.json()["choices"][0]["text"]) in ("red", "blue")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"

    run(check, tiny_llama)


def test_schemas_that_are_not_json_are_named():
    deep = {"type": "string"}
    for _ in range(1000):
        deep = {"type": "array", "items": deep}
    circular = {"type": "object"}
    circular["properties"] = {"a": circular}
    for schema in (deep, circular, {"enum": {1, 2}}):
        with pytest.raises(InvalidInputError, match="response_format's schema is not JSON"):
            check_response_format({"type": "json_schema", "json_schema": {"schema": schema}})


@pytest.mark.export
def test_grammars_that_give_up_are_a_400_in_every_mode_and_an_empty_schema_holds(tiny_llama):
    """Found by QA: a schema with no value ({"$ref": "#"}) left the constraint off after its
    first step (ar ended at once with '', spec failed with a 500); one past llguidance's row limit
    (499 optional properties) was a 500; the server dropped an empty schema {} (falsy)."""
    from serve_util import client, run

    from specdec_rt.serve import create_app

    def rf(schema):
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}

    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(499)}}

    async def check(engine):
        for mode in ("ar", "spec"):
            with pytest.raises(InvalidInputError, match="response_format: the grammar stopped"):
                await engine.generate("x", 8, mode=mode, response_format=rf({"$ref": "#"}))
        want = await engine.generate("Answer:", 12, mode="ar", response_format=rf({}))
        async with client(create_app(engine)) as c:
            empty = await c.post(
                "/v1/completions",
                json={"prompt": "Answer:", "max_tokens": 12, "temperature": 0, "response_format": rf({})},
            )
            r = await c.post(
                "/v1/completions",
                json={"prompt": "Answer:", "max_tokens": 16, "temperature": 0, "response_format": rf(wide)},
            )
            ok = await c.post("/v1/completions", json={"prompt": "Answer:", "max_tokens": 4, "temperature": 0})
        assert empty.json()["choices"][0]["text"] == want.text
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
        assert "<state>" not in r.json()["error"]["message"]  # the first line, not the engine's internals
        assert ok.status_code == 200 and engine.running == 0 and not engine.target._owners

    run(check, tiny_llama)
