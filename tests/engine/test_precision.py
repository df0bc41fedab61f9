"""Engine.load(precision=...): a pinned precision loads that model as the target, "auto" measures
once and then reads the tune cache, and the choice is visible (Engine.choice).

The tiny Llama export (conftest ``tiny_llama``) has a float32 target and an int4 quantized copy
among its drafts (draft-q4), so it offers float32 and int4.
"""

from __future__ import annotations

import dataclasses
import json
import os

import anyio
import numpy as np
import pytest

from specdec_rt import Engine
from specdec_rt.engine import tune
from specdec_rt.engine.factory import as_target, home_manifest, target_candidates
from specdec_rt.engine.tune_cache import (
    MAX_CACHE_BYTES,
    TUNE_VERSION,
    CategoryRate,
    TuneResult,
    TuneRow,
    cache_path,
    read_cached,
    tune_key,
    write_cached,
)
from specdec_rt.errors import InvalidInputError
from specdec_rt.ort import OrtModel


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A tune cache of the test's own (the models are given by folder: nothing else moves)."""
    monkeypatch.setenv("SPECDEC_RT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECDEC_RT_TUNE_DIR")  # (the session's, conftest): <cache>/tune, as users have it
    return tmp_path / "cache" / "tune"


def load(folder, **kw):
    async def go():
        engine = await Engine.load(folder, threads=1, slots=2, warmup=False, **kw)
        await engine.aclose()
        return engine

    return anyio.run(go)


def test_the_tune_dir_variable_moves_the_files(tmp_path, monkeypatch):
    from specdec_rt.engine.tune_cache import cache_path

    monkeypatch.setenv("SPECDEC_RT_TUNE_DIR", str(tmp_path / "elsewhere"))
    assert cache_path({"model": "m"}).parent == tmp_path / "elsewhere"
    monkeypatch.delenv("SPECDEC_RT_TUNE_DIR")
    monkeypatch.setenv("SPECDEC_RT_CACHE", str(tmp_path / "c"))
    assert cache_path({"model": "m"}).parent == tmp_path / "c" / "tune"


def test_the_folder_offers_its_target_and_the_quantized_copy(tiny_llama):
    found = target_candidates(home_manifest(tiny_llama))
    assert [(c.precision, c.activations, c.draft_name) for c in found] == [
        ("float32", "float32", None),
        ("int4", "int8", "q4"),
    ]
    assert found[1].manifest.role == "target" and found[1].manifest.name == found[0].manifest.name
    assert found[1].exact_to == "greedy output is exact to the int4 target (int4 weights, int8 activations)"


def test_exported_is_the_default_and_says_so(tiny_llama):
    engine = load(tiny_llama)
    assert engine.target.manifest.folder == tiny_llama
    c = engine.choice
    assert (c.precision, c.draft, c.chosen_by) == ("float32", "ngram+q4", "exported")
    assert c.exact_to == "greedy output is exact to the float32 target"


def test_a_pinned_precision_loads_that_model_as_the_target(tiny_llama):
    """The promoted draft runs as a target (a quantized target's exactness measures on), and
    its logits are that model's own, not the float32 target's."""
    engine = load(tiny_llama, precision="int4")
    target = engine.target
    assert target.manifest.folder == tiny_llama / "draft-q4" and target.manifest.role == "target"
    assert target.lone_twice  # what a quantized *target* does; a draft would not
    assert engine.name == home_manifest(tiny_llama).name
    assert (engine.choice.precision, engine.choice.draft, engine.choice.chosen_by) == ("int4", "ngram", "pinned")
    assert "int4 target" in engine.choice.describe() and "pinned" in engine.choice.describe()

    ids = np.arange(3, 12, dtype=np.int64)  # [9] a prefill: the same path in any role

    def logits(folder):
        model = OrtModel(folder, max_length=32, slots=1, threads=1)
        s = model.start()
        try:
            return s.run_sync(ids, 3, 0)  # [3, V]
        finally:
            s.close()
            model.close()

    own, float32 = logits(tiny_llama / "draft-q4"), logits(tiny_llama)
    target = OrtModel(target.manifest, max_length=32, slots=1, threads=1)  # the manifest the engine loaded
    s = target.start()
    got = s.run_sync(ids, 3, 0)
    s.close()
    np.testing.assert_array_equal(got, own)
    assert not np.array_equal(got, float32)


def test_a_draft_folder_loaded_as_the_model_is_a_target(tiny_llama):
    """``--model .../draft-q4``: the folder says ``role: draft``, but it is the engine's target,
    so it gets a quantized target's exactness measures (without them greedy speculation left
    plain decoding on Gemma 3's int8 copy)."""
    engine = load(tiny_llama / "draft-q4", draft="ngram")
    assert engine.target.manifest.role == "target" and engine.target.lone_twice
    assert engine.choice.exact_to == "greedy output is exact to the int4 target (int4 weights, int8 activations)"
    m = home_manifest(tiny_llama)
    assert as_target(m) is m


def test_an_explicit_draft_wins(tiny_llama):
    assert load(tiny_llama, precision="int4", draft="none").choice.draft == "none"


@pytest.mark.parametrize(
    ("precision", "named"),
    [
        ("fp8", "'fp8'"),
        ("INT8", "'INT8'"),
        (8, "8"),
        ("int8", "no int8 target in this folder; it offers float32 (exported), int4"),
    ],
)
def test_a_precision_the_folder_lacks_is_named(tiny_llama, precision, named):
    with pytest.raises(InvalidInputError, match="precision|int8") as info:
        load(tiny_llama, precision=precision)
    assert named in str(info.value)


# ---------------------------------------------------------------------- auto and the cache
def fake_rows() -> list[TuneRow]:
    return [
        TuneRow("float32", "ngram+q4", 100.0, 200.0, 2, 0.8, True),
        TuneRow("float32", "none", 90.0, 150.0, 2, 0.0, True),
        TuneRow("int4", "ngram", 300.0, 500.0, 2, 0.6, False, "differs from plain decoding on prompt 1"),
        TuneRow("int4", "none", 120.0, 260.0, 2, 0.0, True),
    ]


class FakeMeasure:
    """Stands in for tune.measure: counts its calls and returns a fixed table."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, folder, load, **kw) -> TuneResult:
        self.calls += 1
        rows = fake_rows()
        return TuneResult(rows, tune.pick(rows), rounds=1, seconds=0.1)


def test_pick_takes_the_best_exact_row():
    rows = fake_rows()
    # int4 ngram scores highest but is not exact; int4 none: sqrt(120 * 260) = 176.6 > 141.4
    assert tune.pick(rows) == 3
    assert tune.pick([TuneRow("int8", "none", 1, 1, 1, 0, False)]) is None
    tie = [TuneRow("float32", "none", 4, 4, 1, 0, True), TuneRow("int8", "none", 4, 4, 1, 0, True)]
    assert tune.pick(tie) == 0  # the folder's own target first
    near = [
        TuneRow("float32", "ngram", 9, 9, 1, 0, True),
        TuneRow("float32", "none", 9.6, 9.6, 1, 0, True),
        TuneRow("int8", "none", 10, 10, 1, 0, True),
        TuneRow("int4", "none", 10.4, 10.4, 1, 0, False),  # the fastest, not exact
    ]
    assert tune.pick(near) == 1  # int8 is < 5% faster than float32's best: float32, its faster row
    near[2] = TuneRow("int8", "none", 10.2, 10.2, 1, 0, True)
    assert tune.pick(near) == 2  # > 5%: int8


def test_auto_measures_once_then_reads_the_cache(tiny_llama, cache, monkeypatch):
    fake = FakeMeasure()
    monkeypatch.setattr(tune, "measure", fake)
    first = load(tiny_llama, precision="auto")
    assert fake.calls == 1
    assert (first.choice.precision, first.choice.draft, first.choice.chosen_by) == ("int4", "none", "tuned")
    assert first.target.manifest.folder == tiny_llama / "draft-q4" and first.drafter is None
    files = list(cache.glob("*.json"))
    assert len(files) == 1
    stored = json.loads(files[0].read_text())
    assert stored["chosen"] == 3 and stored["key"]["slots"] == 2 and stored["key"]["threads"] == 1

    again = load(tiny_llama, precision="auto")
    assert fake.calls == 1 and again.choice.chosen_by == "cached" and again.choice.precision == "int4"

    mixed = load(tiny_llama, precision="auto", draft="ngram")  # an explicit draft wins over the tuned one
    assert (mixed.choice.precision, mixed.choice.draft, fake.calls) == ("int4", "ngram", 1)


def test_a_changed_key_measures_again(tiny_llama, cache, monkeypatch):
    fake = FakeMeasure()
    monkeypatch.setattr(tune, "measure", fake)
    load(tiny_llama, precision="auto")
    anyio.run(lambda: tune.choose(tiny_llama, Engine.load, threads=1, slots=3))  # another slot count: another key
    assert fake.calls == 2 and len(list(cache.glob("*.json"))) == 2
    home = home_manifest(tiny_llama)
    key = tune_key(home, threads=1, slots=2, provider="auto")
    stamp = key["model_stamp"]
    manifest = tiny_llama / "draft-q4" / "model.onnx"
    st = manifest.stat()
    os.utime(manifest, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a draft's graph rewritten
    try:
        assert tune_key(home, threads=1, slots=2, provider="auto")["model_stamp"] != stamp
        load(tiny_llama, precision="auto")
        assert fake.calls == 3
    finally:
        os.utime(manifest, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"[]",
        b'{"version": 1, "rows": "many"}',
        b"\xff\xfe",
        b"x" * (MAX_CACHE_BYTES + 1),
    ],
)
def test_a_corrupt_cache_file_is_measured_again(tiny_llama, cache, monkeypatch, content):
    fake = FakeMeasure()
    monkeypatch.setattr(tune, "measure", fake)
    load(tiny_llama, precision="auto")
    (path,) = cache.glob("*.json")
    path.write_bytes(content)
    assert load(tiny_llama, precision="auto").choice.chosen_by == "tuned"
    assert fake.calls == 2
    assert json.loads(path.read_text())["chosen"] == 3  # stored again


def valid(key) -> dict:
    rows = fake_rows()
    rows[0] = dataclasses.replace(
        rows[0], categories=(CategoryRate("chat", 90.0, 0.7), CategoryRate("code", 111.1, 0.9))
    )
    result = TuneResult(rows, 3, 1, 0.5, key=key, tokens=96)
    return result.as_dict()


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d.update(version=TUNE_VERSION + 1),
        lambda d: d.update(version=2),  # measured by the 32-token chat procedure: measured again
        lambda d: d.update(chosen=2),  # a row that is not exact
        lambda d: d.update(chosen=9),
        lambda d: d.update(chosen=True),
        lambda d: d["rows"][0].update(tok_s_1=float("nan")),
        lambda d: d["rows"][0].update(tok_s_1=-1),
        lambda d: d["rows"][0].update(acceptance=1.5),
        lambda d: d["rows"][0].update(draft="\x1b[2J"),
        lambda d: d["rows"][0].update(precision="x" * 100),
        lambda d: d["rows"][0].update(concurrency=0),
        lambda d: d.update(rows=[]),
        lambda d: d.update(rows=d["rows"] * 20),
        lambda d: d["key"].update(cpu="another CPU"),
        lambda d: d.update(tokens=-1),
        lambda d: d.update(tokens=1e9),
        lambda d: d.pop("tokens"),
        lambda d: d["rows"][0].update(categories={"chat": 1}),
        lambda d: d["rows"][0].pop("categories"),
        lambda d: d["rows"][0]["categories"].append(dict(d["rows"][0]["categories"][0])),  # a name twice
        lambda d: d["rows"][0]["categories"][0].update(category="Chat\x1b"),
        lambda d: d["rows"][0]["categories"][0].update(tok_s_1=float("inf")),
        lambda d: d["rows"][0]["categories"][0].update(acceptance=2),
        lambda d: d["rows"][0]["categories"][0].update(extra=1),
        lambda d: d["rows"][0].update(
            categories=[{"category": f"c{i}", "tok_s_1": 1, "acceptance": 0} for i in range(9)]
        ),
    ],
)
def test_the_cache_file_is_checked_field_by_field(tiny_llama, cache, change):
    key = tune_key(home_manifest(tiny_llama), threads=1, slots=2, provider="auto")
    raw = valid(key)
    path = cache_path(key)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(raw))
    assert read_cached(key) is not None  # the unchanged file is read
    change(raw)
    path.write_text(json.dumps(raw, allow_nan=True))
    assert read_cached(key) is None


def test_a_cache_file_that_is_a_link_is_not_followed(tiny_llama, cache, tmp_path):
    key = tune_key(home_manifest(tiny_llama), threads=1, slots=2, provider="auto")
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps(valid(key)))
    path = cache_path(key)
    path.parent.mkdir(parents=True)
    path.symlink_to(elsewhere)
    assert read_cached(key) is None
    assert write_cached(key, TuneResult.from_dict(valid(key))) == path and not path.is_symlink()
    assert read_cached(key) is not None


def test_the_real_measurement_on_a_tiny_model(tiny_llama):
    """Every configuration runs, its greedy output checked against plain decoding's."""
    configs = tune.configs_for(home_manifest(tiny_llama))
    assert [(c.precision, c.draft) for c in configs] == [
        ("float32", "ngram+q4"),
        ("float32", "ngram"),
        ("float32", "none"),
        ("int4", "ngram"),
        ("int4", "none"),
    ]
    said: list[str] = []
    result = anyio.run(
        lambda: tune.measure(
            tiny_llama, Engine.load, threads=1, slots=2, tokens=8, prompts=tune.TUNE_PROMPTS[:2], say=said.append
        )
    )
    assert [(r.precision, r.draft) for r in result.rows] == [(c.precision, c.draft) for c in configs]
    assert all(r.exact and r.tok_s_1 > 0 and r.tok_s_c > 0 and r.concurrency == 2 for r in result.rows), result.rows
    assert result.rows[0].acceptance > 0 and result.rows[2].acceptance == 0
    assert result.chosen == tune.pick(result.rows) and result.rounds >= 1
    assert any(line.startswith("round 1: 5 configurations") for line in said)
    assert [c.category for c in result.rows[0].categories] == ["chat", "code"]


def test_a_config_that_leaves_plain_decoding_or_fails_is_left_out(tiny_llama):
    """A drafter whose output differs from plain decoding's (here: forged) is disqualified and
    named; one that fails is left out too; the rest are measured and one of them chosen."""
    import dataclasses

    from specdec_rt.errors import InferenceError

    async def load(folder, **kw):
        engine = await Engine.load(folder, **kw)
        generate = engine.generate

        async def forged(prompt, *args, **req):
            r = await generate(prompt, *args, **req)
            if req.get("mode") == "spec" and kw["precision"] == "int4":
                return dataclasses.replace(r, token_ids=[*r.token_ids[:-1], r.token_ids[-1] + 1])
            if req.get("mode") == "spec" and kw["draft"] == "ngram":
                raise InferenceError("the model broke")
            return r

        engine.generate = forged
        return engine

    said: list[str] = []
    result = anyio.run(
        lambda: tune.measure(
            tiny_llama, load, threads=1, slots=2, tokens=6, prompts=tune.TUNE_PROMPTS[:2], say=said.append
        )
    )
    rows = {(r.precision, r.draft): r for r in result.rows}
    assert (
        not rows[("int4", "ngram")].exact and "differs from plain decoding on prompt 1" in rows[("int4", "ngram")].note
    )
    assert not rows[("float32", "ngram")].exact and "the model broke" in rows[("float32", "ngram")].note
    assert rows[("float32", "ngram+q4")].exact and rows[("float32", "none")].exact and rows[("int4", "none")].exact
    assert result.best is not None and result.best.exact
    assert any(line.startswith("left out: int4 ngram: differs") for line in said)
