"""The ONNX Runtime backends and the Engine API on tiny exported models."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import time

import anyio
import numpy as np
import pytest

from specdec_rt import (
    ContextLengthError,
    EngineClosedError,
    InferenceError,
    InvalidInputError,
    ModelLoadError,
    ModelNotBuiltError,
    RequestParams,
    SpecConfig,
)
from specdec_rt.engine.engine import Engine
from specdec_rt.ort import OrtModel

pytestmark = pytest.mark.export

PROMPTS = ["def add(a, b):", "Hello world! The quick", [{"role": "user", "content": "Write a Python function."}]]


def assert_greedy_under_pytorch(ckpt, prompt_ids, generated, tol=1e-4):
    """Each generated token is the PyTorch model's argmax given the same prefix (up to ``tol``
    of float noise between ONNX Runtime and PyTorch, where near-ties can flip)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt)
    ids = torch.tensor([list(prompt_ids) + list(generated)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1]  # [n, V] predicting each generated token
    chosen = logits[torch.arange(len(generated)), torch.tensor(generated)]
    assert torch.all(chosen >= logits.max(dim=-1).values - tol), (chosen, logits.max(dim=-1).values)


@pytest.mark.parametrize(
    "fixture,draft",
    [
        ("tiny_llama", None),
        ("tiny_llama", "q4"),
        ("tiny_llama", "ngram"),
        ("tiny_qwen", None),
        ("tiny_qwen", "ngram+model"),
    ],
)
def test_greedy_spec_equals_ar_equals_pytorch(fixture, draft, request):
    folder = request.getfixturevalue(fixture)
    ckpt = folder.parent / folder.name.replace("-onnx", "-ckpt")

    async def main():  # static costs: tiny models' timings must not talk speculation out of running
        async with await Engine.load(folder, draft=draft, spec_config=SpecConfig(measure_costs=False)) as engine:
            for prompt in PROMPTS:
                ar = await engine.generate(prompt, max_new_tokens=30, mode="ar")
                spec = await engine.generate(prompt, max_new_tokens=30)
                assert spec.token_ids == ar.token_ids, prompt
                assert spec.stats.rounds > 0 and spec.stats.mode == "spec"
                assert_greedy_under_pytorch(ckpt, engine.codec.encode_prompt(prompt), ar.token_ids)

    anyio.run(main)


def test_prompt_encoding_matches_transformers(tiny_llama, tiny_qwen):
    from transformers import AutoTokenizer

    for folder in (tiny_llama, tiny_qwen):
        tok = AutoTokenizer.from_pretrained(folder.parent / folder.name.replace("-onnx", "-ckpt"))

        async def main():
            async with await Engine.load(folder, draft="none") as engine:
                for text in ("def add(a, b):", "Hello world!"):
                    assert engine.codec.encode_prompt(text) == tok(text).input_ids
                chat = [{"role": "user", "content": "Hello world!"}]
                want = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
                assert engine.codec.encode_prompt(chat) == list(want)

        anyio.run(main)


def test_a_request_naming_no_mode_takes_the_engines_own(tiny_llama):
    """No mode: speculative with a drafter, plain without one (what ``precision="auto"`` may
    choose); an explicit ``mode="spec"`` on an engine without a drafter is still refused."""

    async def main():
        async with await Engine.load(tiny_llama, draft="none") as plain:
            r = await plain.generate("Hello world", max_new_tokens=6)
            assert r.stats.mode == "ar" and len(r.token_ids) == 6
            assert r.token_ids == (await plain.generate("Hello world", max_new_tokens=6, mode="ar")).token_ids
            with pytest.raises(InvalidInputError, match="no draft model"):
                await plain.generate("Hello world", max_new_tokens=6, mode="spec")
            async with plain.stream("Hello world", RequestParams(max_new_tokens=3)) as events:
                assert [ev async for ev in events][-1].stats.mode == "ar"
        async with await Engine.load(tiny_llama, draft="ngram") as spec:
            assert (await spec.generate("Hello world", max_new_tokens=6)).stats.mode == "spec"

    anyio.run(main)


def test_sampling_reproducible_with_seed(tiny_qwen):
    async def main():
        async with await Engine.load(tiny_qwen) as engine:
            kw = dict(max_new_tokens=25, temperature=0.9, top_p=0.95, seed=11)
            a, b = await engine.generate("Hello", **kw), await engine.generate("Hello", **kw)
            c = await engine.generate("Hello", **{**kw, "seed": 12})
            assert a.token_ids == b.token_ids and a.token_ids != c.token_ids

    anyio.run(main)


def test_stream_text_concatenates_and_never_splits_utf8(tiny_llama):
    async def main():
        async with await Engine.load(tiny_llama) as engine:
            parts, ids = [], []
            async for ev in engine.stream("Hello world", max_new_tokens=40):
                parts.append(ev.text)
                ids.extend(ev.token_ids)
            assert "".join(parts) == engine.codec.decode(ids)
            # a real multi-byte string, fed token by token (byte-level BPE splits characters)
            text = "héllo wörld, 世界 🎉 ok"
            dec = engine.codec.decoder()
            deltas = [dec.push([t]) for t in engine.codec.tokenizer.encode(text, add_special_tokens=False).ids]
            deltas.append(dec.flush())
            assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)

    anyio.run(main)


def test_stop_strings_cut_the_text(tiny_llama):
    async def main():
        async with await Engine.load(tiny_llama) as engine:
            full = await engine.generate("def add(a, b):", max_new_tokens=30, mode="ar")
            stop = full.text[10:13]
            cut = await engine.generate("def add(a, b):", max_new_tokens=30, stop=[stop])
            assert cut.text == full.text[: full.text.index(stop)] and cut.finish_reason == "stop"
            assert engine.target.pool.free == engine.slots  # every slot is back

    anyio.run(main)


def test_a_stop_string_across_tokens_cuts_alike_in_every_mode(tiny_llama):
    """A stop string that starts in one token and ends in a later one: nothing of it is
    streamed (the tail that may start a stop is held back), and a speculative round of several
    tokens keeps the tokens plain decoding keeps (up to the one that completes the stop)."""

    async def main():
        async with await Engine.load(tiny_llama) as engine:
            prompt = "def add(a, b):"
            full = await engine.generate(prompt, max_new_tokens=40, mode="ar")
            pieces = [engine.codec.decode(full.token_ids[:i]) for i in range(len(full.token_ids) + 1)]
            checked = 0
            for i in range(2, len(full.token_ids) - 1):  # stop = last char of token i + first of i+1
                a, b = pieces[i], pieces[i + 1]
                if len(b) <= len(a) or len(a) <= len(pieces[i - 1]) or not b.startswith(a):
                    continue
                stop = a[-1] + b[len(a)]
                if full.text.index(stop) != len(a) - 1:
                    continue  # it occurs earlier
                want_ids = full.token_ids[: i + 1]
                for mode in ("ar", "spec"):
                    async with engine.stream(prompt, max_new_tokens=40, mode=mode, stop=stop) as events:
                        deltas, ids, last = [], [], None
                        async for ev in events:
                            deltas.append(ev.text)
                            ids.extend(ev.token_ids)
                            last = ev
                            assert stop not in "".join(deltas)
                    assert "".join(deltas) == full.text[: len(a) - 1], (mode, stop)
                    assert ids == want_ids and last.stats.new_tokens == len(want_ids), (mode, stop)
                    assert last.finished == "stop"
                checked += 1
                if checked == 3:
                    break
            assert checked >= 1
            assert engine.target.pool.free == engine.slots

    anyio.run(main)


def test_stop_prefix_len_holds_back_only_what_may_start_a_stop():
    from specdec_rt.request.checks import stop_prefix_len

    assert stop_prefix_len("hello wor", ["world"]) == 3
    assert stop_prefix_len("hello world", ["world"]) == 0  # a whole stop is not a prefix to hold
    assert stop_prefix_len("abab", ["abc", "b"]) == 2
    assert stop_prefix_len("xyz", ["\n\n"]) == 0
    assert stop_prefix_len("ab\n", ["\n\n", "q"]) == 1
    assert stop_prefix_len("ab\n", ["\n\n"], since=3) == 0  # only text not yet shown
    rng = random.Random(0)
    for _ in range(3000):  # the same as the definition, on random strings of a tiny alphabet
        text = "".join(rng.choice("ab\n") for _ in range(rng.randint(0, 12)))
        stops = ["".join(rng.choice("ab\n") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        since = rng.randint(0, len(text))
        want = max(
            (k for st in stops for k in range(1, min(len(st) - 1, len(text) - since) + 1) if text.endswith(st[:k])),
            default=0,
        )
        assert stop_prefix_len(text, stops, since) == want, (text, stops, since)


def test_prompt_too_long_fails_before_any_work(tiny_llama):
    async def main():
        async with await Engine.load(tiny_llama, max_length=64) as engine:
            calls = engine.target.calls
            with pytest.raises(ContextLengthError, match="exceeds the model's maximum length of 64"):
                await engine.generate("hello " * 80, max_new_tokens=8)
            assert engine.target.calls == calls
            r = await engine.generate("hello " * 80, max_new_tokens=8, truncate_prompt=True)
            assert len(r.token_ids) == 8

    anyio.run(main)


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"mode": "fast"}, "mode"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_arguments_raise_invalid_input(tiny_llama, kwargs, msg):
    async def main():
        async with await Engine.load(tiny_llama) as engine:
            with pytest.raises(InvalidInputError, match=msg):
                await engine.generate("hi", **{"max_new_tokens": 4, **kwargs})
            with pytest.raises(InvalidInputError, match="role"):
                await engine.generate([{"content": "no role"}], max_new_tokens=4)
            assert (await engine.generate("hi", max_new_tokens=4)).token_ids  # still fine

    anyio.run(main)


def test_ort_failure_mid_request_fails_only_that_request(tiny_llama, monkeypatch):
    async def main():
        async with await Engine.load(tiny_llama, draft="q4") as engine:
            want = (await engine.generate("Hello", max_new_tokens=20)).token_ids
            real = engine.target.session.run_with_iobinding
            count = {"n": 0}

            def flaky(io, *a, **k):
                count["n"] += 1
                if count["n"] == 3:
                    raise RuntimeError("simulated ONNX Runtime failure")
                return real(io, *a, **k)

            monkeypatch.setattr(engine.target.session, "run_with_iobinding", flaky)
            with pytest.raises(InferenceError, match="simulated"):
                await engine.generate("Hello", max_new_tokens=20)
            assert engine.target.pool.free == engine.drafter.model.pool.free == engine.slots
            assert (await engine.generate("Hello", max_new_tokens=20)).token_ids == want

    anyio.run(main)


def test_event_loop_stays_responsive(tiny_llama):
    async def main():
        async with await Engine.load(tiny_llama) as engine:
            gaps, last = [], time.perf_counter()

            async def heartbeat():
                nonlocal last
                while True:
                    await anyio.sleep(0.005)
                    now = time.perf_counter()
                    gaps.append(now - last)
                    last = now

            async with anyio.create_task_group() as tg:
                tg.start_soon(heartbeat)
                start, runs = time.perf_counter(), 0
                while runs < 3 or time.perf_counter() - start < 0.3:  # steps may run on the loop's thread
                    await engine.generate("Hello world", max_new_tokens=60)
                    runs += 1
                tg.cancel_scope.cancel()
            assert len(gaps) > 10 and max(gaps) < 0.25

    anyio.run(main)


def test_concurrent_requests_match_sequential(tiny_qwen):
    async def main():
        async with await Engine.load(tiny_qwen, slots=2) as engine:
            prompts = ["a", "def f(x):", "Hello", "import numpy"]
            want = [(await engine.generate(p, max_new_tokens=15)).token_ids for p in prompts]
            got = [None] * 4

            async def one(i):
                got[i] = (await engine.generate(prompts[i], max_new_tokens=15)).token_ids

            async with anyio.create_task_group() as tg:
                for i in range(4):  # 4 requests, 2 slots: two wait their turn
                    tg.start_soon(one, i)
            assert got == want

    anyio.run(main)


def test_kv_is_written_in_place_and_rollback_is_exact(tiny_llama):
    model = OrtModel(tiny_llama, max_length=64, slots=2)

    async def main():
        ids = np.array([0, 5, 9, 13, 40, 41, 42], dtype=np.int64)
        s = model.start()
        ref = await s.extend(ids, 7)  # [7, V] fresh, in one call
        keys = model.pool._buffers[0][0].array  # layer 0 keys [slots, kv, max_len + 1, d]
        assert np.abs(keys[s.slot, :, :7]).sum() > 0 and np.abs(keys[s.slot, :, 7:]).sum() == 0
        s.rollback(3)
        junk = await s.extend(np.array([7, 7, 7, 7, 7], dtype=np.int64), 1)  # overwrite positions 3..7
        s.rollback(3)
        again = await s.extend(ids[3:], 4)  # same tokens again after the rollback
        np.testing.assert_allclose(again, ref[3:], rtol=1e-5, atol=1e-5)
        assert junk.shape == (1, model.vocab_size)
        s.close()
        assert model.pool.free == 2

    anyio.run(main)


def test_load_errors_name_the_path_and_the_mismatch(tiny_llama, tmp_path, monkeypatch):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    (broken / "model.onnx.data").unlink()
    with pytest.raises(ModelLoadError, match="'model.onnx.data' is missing"):
        anyio.run(Engine.load, broken)

    mismatch = tmp_path / "mismatch"
    shutil.copytree(tiny_llama, mismatch)
    m = json.loads((mismatch / "manifest.json").read_text())
    m["architecture"]["num_kv_heads"] = 3
    (mismatch / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ModelLoadError, match=r"mismatch/manifest.json: KV shape \[B, 3"):
        anyio.run(Engine.load, mismatch)

    with pytest.raises(ModelLoadError, match="no such model folder"):
        anyio.run(Engine.load, str(tmp_path / "nowhere" / "x"))
    monkeypatch.setenv("SPECDEC_RT_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelNotBuiltError, match="python -m export smollm2-135m"):
        anyio.run(Engine.load, "smollm2-135m")


def test_closed_engine_refuses(tiny_llama):
    async def main():
        engine = await Engine.load(tiny_llama)
        await engine.aclose()
        with pytest.raises(EngineClosedError):
            await engine.generate("hi", max_new_tokens=2)
        assert engine.target.session is None and engine.drafter.model.model.session is None

    anyio.run(main)


def test_cli_generate_json(tiny_llama):
    cmd = [
        sys.executable,
        "-m",
        "specdec_rt",
        "generate",
        "--model",
        str(tiny_llama),
        "--prompt",
        "def add(a, b):",
        "--max-new-tokens",
        "12",
        "--json",
    ]
    spec = subprocess.run(cmd, capture_output=True, text=True, check=True)
    doc = json.loads(spec.stdout)  # exactly one JSON document on stdout
    assert set(doc) == {"text", "token_ids", "stats"} and len(doc["token_ids"]) == 12
    for key in ("tokens_per_s", "acceptance_rate", "mean_accepted", "mode"):
        assert key in doc["stats"]
    ar = json.loads(subprocess.run(cmd + ["--mode", "ar"], capture_output=True, text=True, check=True).stdout)
    assert ar["token_ids"] == doc["token_ids"] and ar["stats"]["mode"] == "ar"
    bad = subprocess.run(cmd[:-1] + ["--temperature", "-2"], capture_output=True, text=True)
    assert bad.returncode == 1 and "temperature" in bad.stderr and bad.stdout == ""
    plain = json.loads(subprocess.run(cmd + ["--draft", "none"], capture_output=True, text=True, check=True).stdout)
    assert plain["token_ids"] == doc["token_ids"] and plain["stats"]["mode"] == "ar"  # no draft: plain decoding
    bad = subprocess.run(cmd + ["--draft", "none", "--mode", "spec"], capture_output=True, text=True)
    assert bad.returncode == 1 and "--mode ar" in bad.stderr and bad.stdout == ""
    lp = json.loads(subprocess.run(cmd + ["--logprobs", "2"], capture_output=True, text=True, check=True).stdout)
    assert lp["token_ids"] == doc["token_ids"] and [e["token_id"] for e in lp["logprobs"]] == doc["token_ids"]
    assert all(
        len(e["top"]) == 2 and e["top"][0]["logprob"] >= e["top"][1]["logprob"] and e["logprob"] <= 0
        for e in lp["logprobs"]
    )
    assert all(e["logprob"] <= e["top"][0]["logprob"] + 1e-6 for e in lp["logprobs"])  # the most likely is on top
    for extra, needle in (
        (["--logprobs", "21"], "logprobs must be"),
        (["--logprobs", "1"], "--logprobs goes with --json"),
    ):
        args = (cmd if "21" in extra else cmd[:-1]) + extra
        bad = subprocess.run(args, capture_output=True, text=True)
        assert bad.returncode == 1 and needle in bad.stderr and bad.stdout == ""


def test_cli_generate_json_schema(tiny_llama, tmp_path):
    pytest.importorskip("llguidance")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "string", "enum": ["left", "right"]}))
    cmd = [
        sys.executable,
        "-m",
        "specdec_rt",
        "generate",
        "--model",
        str(tiny_llama),
        "--prompt",
        "Go:",
        "--max-new-tokens",
        "16",
        "--json",
        "--json-schema",
        str(schema),
    ]
    doc = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    assert json.loads(doc["text"]) in ("left", "right") and doc["stats"]["finish_reason"] == "stop"
    ar = json.loads(subprocess.run(cmd + ["--mode", "ar"], capture_output=True, text=True, check=True).stdout)
    assert ar["token_ids"] == doc["token_ids"]
    (tmp_path / "bad.json").write_text('{"type":')
    for extra, needle in (
        (["--json-schema", str(tmp_path / "bad.json")], "not JSON"),
        (["--json-schema", str(tmp_path / "none.json")], "No such file"),
        (["--json-object"], "not allowed with argument"),
    ):
        bad = subprocess.run(
            cmd + extra if extra[0] == "--json-object" else cmd[:-2] + extra, capture_output=True, text=True
        )
        assert bad.returncode in (1, 2) and needle in bad.stderr and bad.stdout == ""


@pytest.mark.parametrize("command", ["generate", "demo"])
def test_cli_shared_weights_flag_reaches_the_engine(monkeypatch, command):
    """``--no-shared-weights`` (default on) reaches Engine.load for the commands that load one."""
    from specdec_rt.cli import _build_parser
    from specdec_rt.engine import loading
    from specdec_rt.engine.engine import Engine

    seen = []

    async def fake_load(model, **kw):
        seen.append(kw["shared_weights"])

    monkeypatch.setattr(Engine, "load", staticmethod(fake_load))
    extra = ["--prompt", "x"] if command == "generate" else []
    for flags, want in (([], True), (["--no-shared-weights"], False), (["--shared-weights"], True)):
        args = _build_parser().parse_args([command, "--model", "m", *extra, *flags])
        anyio.run(loading.load_engine, args)
        assert seen[-1] is want, flags
