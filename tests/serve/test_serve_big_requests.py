"""Big requests never stall the server (issue 43, parts 2 and 3): a 1 MiB body is parsed off the
event loop and its prompts counted before any is looked at; ``echo`` with ``logprobs`` scores
each prompt once however many choices share it, within a work budget, and its big reply is built
off the loop."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from loop_lag import bound, compare  # noqa: E402
from serve_util import client, run  # noqa: E402

from specdec_rt.serve import create_app  # noqa: E402

pytestmark = pytest.mark.export

JSON = {"content-type": "application/json"}


@pytest.mark.parametrize("item", [b'"a"', b"[1]"], ids=["strings", "token-lists"])
def test_a_1_mib_body_of_tiny_prompts_is_refused_without_stalling_the_loop(tiny_llama, item):
    body = b'{"max_tokens":1,"prompt":[' + b",".join([item] * 255_000) + b"]}"
    assert len(body) <= 1 << 20  # under the default body limit: it is parsed

    async def check(engine):
        app = create_app(engine)
        serving = app.state.serving
        async with client(app) as c:

            async def attack():
                return await c.post("/v1/completions", content=body, headers=JSON)

            async def control():
                return await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1})

            await control()  # the first request starts the engine's own watchdog and warms up
            a, ctl = await compare(attack, control)
        err = a.out.json()["error"]
        assert a.out.status_code == 400 and err["param"] == "prompt", a.out.text
        limit = serving.slots + serving.max_queued
        assert "255000 prompts" in err["message"] and f"at most {limit}" in err["message"]
        assert a.worst <= bound(ctl), f"attack {a.ms()}, control {ctl.ms()}"
        assert a.busy < 0.05, a.ms()  # the loop's own CPU: it only waited for the parse

    run(check, tiny_llama)


def test_prompts_and_their_token_ids_are_counted_before_they_are_read():
    from specdec_rt.serve.protocol import APIError, parse_request

    for prompt, want in (
        ([object()] * 25, "prompt holds 25 prompts, more than one request may hold (at most 24)"),  # not looked at
        ([1] * 101, "prompt holds 101 token ids, more than one request may hold (at most 100)"),
        ([[1] * 60, "x", [2] * 41], "prompt holds 101 token ids in all, more than one request may hold (at most 100)"),
    ):
        with pytest.raises(APIError) as err:
            parse_request("completion", {"prompt": prompt}, max_prompts=24, max_prompt_tokens=100)
        assert str(err.value) == want and err.value.param == "prompt" and err.value.status == 400
    ok = parse_request("completion", {"prompt": [[1] * 50, "x", [2] * 50]}, max_prompts=3, max_prompt_tokens=100)
    assert len(ok.prompts) == 3


TEXT = "The quick brown fox jumps over the lazy dog, and then it runs back home again."


def _counting(monkeypatch) -> list:
    """Count the engine's prompt scoring passes (one per engine request that asks for them)."""
    from specdec_rt.engine import engine as engine_module

    calls: list = []
    score = engine_module.prompt_logprobs_of

    async def counted(model, ids, top=0):
        calls.append(len(ids))
        return await score(model, ids, top)

    monkeypatch.setattr(engine_module, "prompt_logprobs_of", counted)
    return calls


def _prompt_part(lp: dict, n: int) -> dict:
    return {k: v[:n] for k, v in lp.items()}


def _same_reply(a, b) -> bool:
    """Equal JSON values, floats equal to 1e-6 (relative)."""
    import math

    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_reply(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_reply(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_echo_with_logprobs_scores_each_prompt_once_for_all_its_choices(tiny_llama, monkeypatch):
    from specdec_rt.serve import jobs

    calls = _counting(monkeypatch)
    body = {"prompt": TEXT, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 3}

    async def check(engine):
        want = await engine.generate(TEXT, 4, logprobs=3, prompt_logprobs=3)
        size = len(want.prompt_token_ids)
        async with client(create_app(engine)) as c:
            calls.clear()
            one = (await c.post("/v1/completions", json=body)).json()
            assert calls == [size]
            calls.clear()
            hits = engine.prefix_cache["hit_tokens"]
            many = (await c.post("/v1/completions", json={**body, "n": 4, "prompt": TEXT.upper()})).json()
            assert calls == [len(engine.codec.encode_prompt(TEXT.upper()))]  # was: one scoring pass per choice
            # the other choices open once it is scored: each starts from the KV its scoring left
            assert engine.prefix_cache["hit_tokens"] - hits == 4 * (calls[0] - 1)
            many = (await c.post("/v1/completions", json={**body, "n": 4})).json()
            inline = jobs.INLINE_REPLY_ENTRIES
            monkeypatch.setattr(jobs, "INLINE_REPLY_ENTRIES", 0)  # built and encoded in a worker thread
            threaded = (await c.post("/v1/completions", json={**body, "n": 4})).json()
            # the same reply, built either way; a generated token's log-probability may move in its
            # last float digits between two runs (speculation verifies in shapes that vary with timing)
            assert _same_reply(threaded["choices"], many["choices"]) and threaded["usage"] == many["usage"]
            monkeypatch.setattr(jobs, "INLINE_REPLY_ENTRIES", inline)
            calls.clear()
            two = (await c.post("/v1/completions", json={**body, "prompt": [TEXT, TEXT[:20]], "n": 3})).json()
            assert len(calls) == 2  # one a prompt
            streamed = (await c.post("/v1/completions", json={**body, "n": 3, "stream": True})).text
        head = _prompt_part(one["choices"][0]["logprobs"], size)  # what each choice computed alone before
        values = [e.logprob for e in want.prompt_logprobs[1:]]
        assert head["token_logprobs"][1:] == pytest.approx(values, abs=1e-4)
        assert len(many["choices"]) == 4
        for choice in many["choices"]:
            assert _prompt_part(choice["logprobs"], size) == head  # the same prompt entries, offsets too
            assert choice["text"].startswith(TEXT)
            assert len(choice["logprobs"]["tokens"]) == size + 4
            assert choice["logprobs"]["text_offset"][size] == len(TEXT)
        assert [_prompt_part(c["logprobs"], size) == head for c in two["choices"]] == [True] * 3 + [False] * 3
        assert two["choices"][3]["text"].startswith(TEXT[:20])
        assert many["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"] == size

        from serve_util import sse_data

        chunks = [e["choices"][0] for e in sse_data(streamed) if e != "[DONE]"]
        for i in range(3):
            mine = [c for c in chunks if c["index"] == i]
            assert mine[0]["text"] == TEXT and _prompt_part(mine[0]["logprobs"], size) == head  # the prompt first
            assert "".join(c["text"] for c in mine) == many["choices"][i]["text"]
            offsets = [o for c in mine for o in c["logprobs"]["text_offset"]]
            assert offsets == many["choices"][i]["logprobs"]["text_offset"]

    run(check, tiny_llama)


def test_prompt_log_probabilities_past_the_work_budget_are_a_400_naming_the_flag(tiny_llama, monkeypatch):
    calls = _counting(monkeypatch)

    async def check(engine):
        size = len(engine.codec.encode_prompt(TEXT))
        budget = size * (1 + 5) * 2  # exactly logprobs=5, n=2 of this prompt
        async with client(create_app(engine, max_prompt_logprob_work=budget)) as c:
            base = {"prompt": TEXT, "max_tokens": 2, "echo": True, "logprobs": 5}
            assert (await c.post("/v1/completions", json={**base, "n": 2})).status_code == 200
            for over in ({"n": 3}, {"n": 2, "logprobs": 6}, {"n": 2, "prompt": [TEXT, "x"]}):
                r = await c.post("/v1/completions", json={**base, **over})
                err = r.json()["error"]
                assert r.status_code == 400 and err["param"] == "logprobs", r.text
                assert "--max-prompt-logprob-work" in err["message"] and str(budget) in err["message"]
                assert "lower logprobs, n or the prompt" in err["message"]
            ids = engine.codec.encode_prompt(TEXT) * 2  # token ids: their count, before any model work
            calls.clear()
            r = await c.post("/v1/completions", json={**base, "prompt": ids, "n": 2})
            assert r.status_code == 400 and "--max-prompt-logprob-work" in r.json()["error"]["message"]
            assert calls == []
            ok = await c.post("/v1/completions", json={**base, "n": 2, "stream": True})
            assert ok.status_code == 200 and "[DONE]" in ok.text  # a refusal breaks nothing
        assert engine.running == 0 and not engine.target._owners

    run(check, tiny_llama)


def test_stepwise_json_reads_what_json_loads_reads():
    import gc
    import json

    from specdec_rt.serve.jobs import gc_paused, load_json
    from specdec_rt.serve.protocol import APIError

    values = [
        {"prompt": ["é😀\u202e", '\\"x"'] * 5000, "temperature": 0.7, "n": 2, "x": [None, True, -1e300, 10**40]},
        {"messages": [{"role": "user", "content": "\ud800 lone"}], "nested": [[[[{}]]]]},
        [1.5, -0.0, "NaN"],
    ]
    for value in values:
        for body in (
            json.dumps(value).encode(),
            json.dumps(value, ensure_ascii=False).encode("utf-16", "surrogatepass"),
        ):
            assert repr(load_json(body, stepwise=True)) == repr(json.loads(body))
    assert load_json(b'{"a": NaN, "b": -Infinity}', stepwise=True).keys() == {"a", "b"}  # as json.loads takes them
    for bad in (b"{not json", b"[" * 100_000, b'{"a": 1} x', b"\xff\xfe\x00"):
        for stepwise in (False, True):
            with pytest.raises(APIError) as err:
                load_json(bad, stepwise=stepwise)
            assert err.value.status == 400 and err.value.code == "invalid_json"

    from starlette.responses import JSONResponse

    from specdec_rt.serve.replies import json_bytes

    reply = {"choices": [{"text": 'é😀\n"', "logprobs": {"top": [{"\u0000": -1.25e-07}]}}], "n": [1, None, True]}
    assert json_bytes(reply, stepwise=True) == json_bytes(reply) == JSONResponse(reply).body

    was = gc.isenabled()
    try:
        gc.enable()
        with gc_paused():
            with gc_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()  # the outer pause still runs
        assert gc.isenabled()
        gc.disable()
        with gc_paused():
            pass
        assert not gc.isenabled()  # as the first pause found it
    finally:
        (gc.enable if was else gc.disable)()


def test_stepwise_json_is_the_same_bytes_in_short_calls():
    """A big reply encoded in a worker thread: the same bytes as one call of the C encoder, and
    no single call of it gets more than STEPWISE_ITEMS items of a list (NaN still refused)."""
    import json
    import random

    from specdec_rt.serve import replies

    rng = random.Random(0)

    def value(depth=0):
        r = rng.random()
        if depth >= 3 or r < 0.3:
            return rng.choice([1, -2.5, 'x\u00e9"\n', None, True, 1e300, "\U0001f642", [], {}])
        if r < 0.6:
            return [value(depth + 1) for _ in range(rng.choice([0, 1, 3, 300]))]
        return {f"k{i}\u00e9": value(depth + 1) for i in range(rng.choice([0, 2, 5, 300]))}

    big = {"choices": [{"logprobs": {"top_logprobs": [{f"t{j}": -1.25 * j for j in range(21)}] * 3400}}] * 3}
    for data in [value() for _ in range(40)] + [big]:
        assert replies.json_bytes(data, stepwise=True) == replies.json_bytes(data)
    calls = []
    encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))

    def counted(v):
        calls.append(len(v) if isinstance(v, (list, dict)) else 1)
        return encoder.encode(v)

    assert "".join(replies._pieces(big, counted)).encode() == replies.json_bytes(big)
    assert max(calls) <= replies.STEPWISE_ITEMS and len(calls) > 3400 * 3 // replies.STEPWISE_ITEMS
    with pytest.raises(ValueError):
        replies.json_bytes([1.0] * 500 + [float("nan")], stepwise=True)


def test_release_stepwise_takes_a_tree_apart():
    from specdec_rt.serve.replies import release_stepwise

    leaf = {"a": 1.0}
    tree = {"x": [leaf, {"y": [1, 2, {"z": leaf}]}], "w": "s"}
    release_stepwise(tree)
    assert tree == {} and leaf == {}
