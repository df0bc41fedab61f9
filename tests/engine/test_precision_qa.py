"""Issue 37's public contracts as a user meets them: ``Engine.load(precision=...)`` with values
the folder lacks or that are no precision at all, ``"auto"`` from two engines at once and from
tune files that are not what they should be (a choice the folder does not offer, a FIFO, a
folder, a link), the exactness of a quantized target (greedy ``spec`` == ``ar``, token ids),
``/v1/models`` against ``Engine.choice``, and ``python -m specdec_rt tune --json``.

tiny_llama (conftest) offers float32 (its own) and int4 (draft-q4); ``quantized`` below is a
tiny Llama exported as an int8 target with an int4 copy as its draft.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from specdec_rt import Engine
from specdec_rt.cli import main as cli_main
from specdec_rt.engine import tune
from specdec_rt.engine.factory import home_manifest
from specdec_rt.engine.tune_cache import TuneResult, TuneRow, cache_path, tune_key
from specdec_rt.errors import InvalidInputError

ROOT = Path(__file__).resolve().parents[2]
LOAD = {"threads": 1, "slots": 2, "warmup": False}


@pytest.fixture
def tune_dir(tmp_path, monkeypatch) -> Path:
    """This test's own tune files."""
    folder = tmp_path / "tune"
    monkeypatch.setenv("SPECDEC_RT_TUNE_DIR", str(folder))
    return folder


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> Path:
    from tiny_models import export_tiny

    return export_tiny(tmp_path_factory.mktemp("qa-int8"), "llama", draft="int4", quantize="int8")


def rows() -> list[TuneRow]:
    return [
        TuneRow("float32", "ngram+q4", 100.0, 200.0, 2, 0.8, True),
        TuneRow("float32", "ngram", 90.0, 150.0, 2, 0.5, True),
        TuneRow("float32", "none", 80.0, 140.0, 2, 0.0, True),
        TuneRow("int4", "ngram", 120.0, 260.0, 2, 0.6, True),
        TuneRow("int4", "none", 110.0, 250.0, 2, 0.0, True),
    ]


class SlowMeasure:
    """Stands in for tune.measure: takes a while (as a real one does), counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, folder, load, **kw) -> TuneResult:
        self.calls += 1
        await anyio.sleep(0.3)
        table = rows()
        return TuneResult(table, tune.pick(table), rounds=1, seconds=0.3)


async def _choice(folder, **kw):
    async with await Engine.load(folder, **{**LOAD, **kw}) as engine:
        return engine.choice, engine


# ---------------------------------------------------------------------- values
@pytest.mark.parametrize("value", ["INT8", "", None, 8, " int8", "Auto", b"int8", ["int8"], "fp16"])
def test_a_value_that_is_no_precision_is_named_before_anything_loads(value, tmp_path):
    """Refused by its value alone: the folder need not even exist."""
    with pytest.raises(InvalidInputError, match=r"^precision must be one of auto, exported, float32") as info:
        anyio.run(lambda: Engine.load(tmp_path / "no-such-model", precision=value))
    assert repr(value) in str(info.value)


@pytest.mark.parametrize(
    ("model", "precision", "offers"),
    [
        ("tiny", "int8", "float32 (exported), int4"),
        ("quantized", "float32", "int8 (exported), int4"),
    ],
)
def test_each_precision_a_folder_lacks_is_named_with_what_it_offers(tiny_llama, quantized, model, precision, offers):
    folder = tiny_llama if model == "tiny" else quantized
    with pytest.raises(InvalidInputError) as info:
        anyio.run(lambda: Engine.load(folder, precision=precision, **LOAD))
    assert str(info.value) == f"{folder}: no {precision} target in this folder; it offers {offers}"


# ---------------------------------------------------------------------- auto: at once, and untrusted files
def test_engines_loaded_with_auto_at_once_measure_once(tiny_llama, tune_dir, monkeypatch):
    """Two engines of one model loaded at once (asyncio.gather) do not measure side by side
    (each would slow the other, and they could choose differently): the second waits and
    reads what the first stored."""
    fake = SlowMeasure()
    monkeypatch.setattr(tune, "measure", fake)

    async def both():
        return await asyncio.gather(*[_choice(tiny_llama, precision="auto") for _ in range(3)])

    got = anyio.run(both)
    assert fake.calls == 1
    assert sorted(c.chosen_by for c, _ in got) == ["cached", "cached", "tuned"]
    assert len({(c.precision, c.draft) for c, _ in got}) == 1
    assert len(list(tune_dir.glob("*.json"))) == 1


@pytest.mark.parametrize(
    ("precision", "draft"),
    [
        ("float32", "q9"),  # a draft the folder does not list
        ("float32", "ngram+q9"),
        ("float32", "model"),  # a name the file may not use: not a configuration tune measures
        ("float32", "OTHER"),  # a folder elsewhere, loaded as the draft had it been followed
        ("float32", "ngram+OTHER"),
        ("int4", "ngram+q4"),  # the target itself as its own draft: never measured
    ],
)
def test_a_tuned_choice_the_folder_does_not_offer_is_measured_again(
    tiny_llama, quantized, tune_dir, monkeypatch, precision, draft
):
    """The tune file is untrusted input: a choice in it that is not one of the folder's
    configurations is measured again (a warning says why), never loaded as it says."""
    key = tune_key(home_manifest(tiny_llama), threads=1, slots=2, provider="auto")
    table = rows()
    table[0] = TuneRow(precision, draft.replace("OTHER", str(quantized / "draft-q4")), 999.0, 999.0, 2, 0.9, True)
    path = cache_path(key)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(TuneResult(table, 0, 1, 0.5, key=key).as_dict()))
    fake = SlowMeasure()
    monkeypatch.setattr(tune, "measure", fake)
    choice, engine = anyio.run(lambda: _choice(tiny_llama, precision="auto"))
    assert fake.calls == 1 and choice.chosen_by == "tuned"
    assert (choice.precision, choice.draft) == ("int4", "ngram")  # the fake table's winner, stored again
    assert json.loads(path.read_text())["chosen"] == 3
    assert all(m.manifest.folder.is_relative_to(tiny_llama) for m in engine.models)


@pytest.mark.parametrize("kind", ["fifo", "folder", "link to /dev/zero", "huge", "truncated"])
def test_a_tune_file_that_is_no_file_is_measured_again_without_hanging(tiny_llama, tune_dir, monkeypatch, kind):
    key = tune_key(home_manifest(tiny_llama), threads=1, slots=2, provider="auto")
    path = cache_path(key)
    path.parent.mkdir(parents=True)
    if kind == "fifo":
        os.mkfifo(path)  # (opened for reading with no writer, a blocking open would wait forever)
    elif kind == "folder":
        path.mkdir()
    elif kind == "huge":
        with open(path, "wb") as f:
            f.truncate(1 << 30)  # sparse: 1 GiB that must not be read
    elif kind == "truncated":  # a write cut short: the first half of a valid file
        whole = json.dumps(TuneResult(rows(), 0, 1, 0.5, key=key).as_dict())
        path.write_text(whole[: len(whole) // 2])
    else:
        path.symlink_to("/dev/zero")
    fake = SlowMeasure()
    monkeypatch.setattr(tune, "measure", fake)

    async def bounded():
        with anyio.fail_after(60):
            return await _choice(tiny_llama, precision="auto")

    choice, _ = anyio.run(bounded)
    assert fake.calls == 1 and (choice.precision, choice.chosen_by) == ("int4", "tuned")
    if kind in ("fifo", "huge", "truncated"):
        assert path.is_file() and json.loads(path.read_text())["chosen"] == 3  # replaced by the result
    elif kind == "folder":
        assert path.is_dir()  # not writable there: measured each time, still no crash
    else:
        assert not path.is_symlink() and json.loads(path.read_text())["chosen"] == 3  # the link, not its target


# ---------------------------------------------------------------------- exactness and what is shown
PROMPTS = [[5, 9, 13, 17, 21], [40, 41, 42, 40, 41, 42, 40, 41], [100, 7, 100, 7, 100], [3] * 12]


@pytest.mark.parametrize(("model", "precision"), [("quantized", "int8"), ("quantized", "int4"), ("tiny", "int4")])
def test_greedy_spec_equals_plain_decoding_on_a_pinned_quantized_target(tiny_llama, quantized, model, precision):
    """Token-id prompts, one at a time and batched: greedy speculative output is exactly the
    chosen target's own plain decoding, as ``exact_to`` says."""
    folder = quantized if model == "quantized" else tiny_llama

    async def go():
        async with await Engine.load(folder, precision=precision, threads=1, slots=4) as engine:
            plain = [await engine.generate(p, 24, mode="ar", ignore_eos=True) for p in PROMPTS]
            alone = [await engine.generate(p, 24, mode="spec", ignore_eos=True) for p in PROMPTS]
            batched = await asyncio.gather(*[engine.generate(p, 24, mode="spec", ignore_eos=True) for p in PROMPTS])
            return engine.choice, plain, alone, batched

    choice, plain, alone, batched = anyio.run(go)
    assert choice.precision == precision and choice.chosen_by == "pinned"
    assert f"exact to the {precision} target" in choice.exact_to
    assert all(len(r.token_ids) == 24 for r in plain)
    assert [r.token_ids for r in alone] == [r.token_ids for r in plain]
    assert [r.token_ids for r in batched] == [r.token_ids for r in plain]
    assert sum(r.stats.drafted for r in alone) > 0  # it did speculate


def test_v1_models_says_what_engine_choice_says(tiny_llama, quantized, tune_dir, monkeypatch):
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from serve_util import client

    from specdec_rt.serve import create_app

    monkeypatch.setattr(tune, "measure", SlowMeasure())

    async def entry(folder, **kw):
        async with await Engine.load(folder, **{**LOAD, **kw}) as engine:
            async with client(create_app(engine, model_name="m")) as c:
                listed = (await c.get("/v1/models")).json()["data"]
            return engine.choice, listed

    for folder, kw in [
        (tiny_llama, {}),
        (tiny_llama, {"precision": "int4"}),
        (quantized, {"precision": "int4", "draft": "none"}),
        (tiny_llama, {"precision": "auto"}),  # tuned
        (tiny_llama, {"precision": "auto"}),  # cached
    ]:
        choice, listed = anyio.run(lambda: entry(folder, **kw))
        assert len(listed) == 1 and listed[0]["id"] == "m"
        assert {k: listed[0][k] for k in choice.as_dict()} == choice.as_dict()
        assert ("measured" in listed[0]) == (choice.chosen_by in ("tuned", "cached"))
    assert choice.chosen_by == "cached"


# ---------------------------------------------------------------------- the tune command
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--slots", "abc"], "argument --slots: must be an integer from 1 to 256, got 'abc'"),
        (["--slots", "0"], "argument --slots: must be from 1 to 256, got 0"),
        (["--threads", "1.5"], "argument --threads: must be an integer from 1 to 256, got '1.5'"),
        (["--provider", "CPU"], "argument --provider: invalid choice: 'CPU'"),
    ],
)
def test_tune_names_a_bad_flag(args, says, capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(["tune", "smollm2-135m", *args])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "_slots" not in err and "_threads" not in err, err


def test_tune_json_is_one_document_with_the_documented_fields(quantized, tune_dir):
    """stdout is the JSON alone (progress goes to stderr); its choice is its chosen row; a
    second run reads the cache, ``--force`` measures again."""

    def tune_json(*extra, folder=tune_dir):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECDEC_RT_TUNE_DIR": str(folder)}
        cmd = [sys.executable, "-m", "specdec_rt", "tune", str(quantized), "--slots", "2", "--threads", "1", "--json"]
        proc = subprocess.run([*cmd, *extra], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout), proc.stderr

    first, said = tune_json()
    assert set(first) == {
        "model",
        "folder",
        "choice",
        "key",
        "rows",
        "chosen",
        "rounds",
        "seconds",
        "rule",
        "tokens",
        "cache",
    }
    assert "[tune] tuning llama-onnx" in said and "[tune] chose " in said
    choice, best = first["choice"], first["rows"][first["chosen"]]
    assert set(choice) == {"precision", "draft", "chosen_by", "exact_to"} and choice["chosen_by"] == "tuned"
    assert (choice["precision"], choice["draft"]) == (best["precision"], best["draft"]) and best["exact"]
    assert f"exact to the {choice['precision']} target" in choice["exact_to"]
    assert {(r["precision"], r["draft"]) for r in first["rows"]} == {
        (c.precision, c.draft) for c in tune.configs_for(home_manifest(quantized))
    }
    assert first["key"]["slots"] == 2 and first["key"]["threads"] == 1 and first["rounds"] >= 1
    assert Path(first["cache"]).parent == tune_dir and Path(first["cache"]).is_file()
    cached, _ = tune_json()
    assert cached["choice"] == {**choice, "chosen_by": "cached"} and cached["rows"] == first["rows"]
    forced, said = tune_json("--force")
    assert forced["choice"]["chosen_by"] == "tuned" and "[tune] tuning" in said
    assert cached["cache"] == forced["cache"] == first["cache"]
    (tune_dir.parent / "a-file").write_text("")  # a tune folder that cannot be: nothing is stored
    unstored, said = tune_json(folder=tune_dir.parent / "a-file")
    assert unstored["cache"] is None and unstored["choice"]["chosen_by"] == "tuned"
    assert "tune.cache_unwritable" in said
