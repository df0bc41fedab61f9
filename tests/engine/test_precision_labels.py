"""What a load says it runs, as QA found it misleading: a draft the caller gave under
``precision="auto"`` is not called tuned; a draft given as a folder is named as given, not by its
manifest's name (``q4``, which reads as the model's own); ``tune ""`` names the empty value.

tiny_llama (conftest) offers float32 (its own) and int4 (draft-q4, named ``q4``).
"""

from __future__ import annotations

import anyio
import pytest

from specdec_rt import Engine
from specdec_rt.cli import main as cli_main
from specdec_rt.engine import tune
from specdec_rt.engine.precision import PrecisionChoice
from specdec_rt.engine.tune_cache import TuneResult, TuneRow

LOAD = {"threads": 1, "slots": 2, "warmup": False}
INT4 = "greedy output is exact to the int4 target"


@pytest.fixture
def tuned_int4(tmp_path, monkeypatch):
    """A tune that picks the int4 target with plain decoding, in this test's own tune folder."""
    monkeypatch.setenv("SPECDEC_RT_TUNE_DIR", str(tmp_path / "tune"))

    async def measure(folder, load, **kw) -> TuneResult:
        rows = [
            TuneRow("float32", "ngram", 50.0, 80.0, 2, 0.5, True),
            TuneRow("int4", "none", 90.0, 150.0, 2, 0.0, True),
        ]
        return TuneResult(rows, tune.pick(rows), rounds=1)

    monkeypatch.setattr(tune, "measure", measure)


def _choice(folder, **kw) -> PrecisionChoice:
    async def go():
        async with await Engine.load(folder, **{**LOAD, **kw}) as engine:
            return engine.choice

    return anyio.run(go)


def test_auto_with_a_draft_given_says_the_draft_was_asked_for(tiny_llama, tuned_int4):
    own = _choice(tiny_llama, precision="auto")
    assert (own.precision, own.draft, own.chosen_by) == ("int4", "none", "tuned")
    assert own.describe().startswith("int4 target, draft none (tuned on this machine); " + INT4), own.describe()
    asked = _choice(tiny_llama, precision="auto", draft="ngram")
    assert (asked.precision, asked.draft, asked.chosen_by) == ("int4", "ngram", "cached")
    assert asked.describe().startswith(
        "int4 target (tuned on this machine earlier), draft ngram (asked for); " + INT4
    ), asked.describe()
    assert asked.as_dict() == {"precision": "int4", "draft": "ngram", "chosen_by": "cached", "exact_to": asked.exact_to}


def test_a_pinned_precision_with_a_draft_reads_as_before(tiny_llama):
    choice = _choice(tiny_llama, precision="int4", draft="ngram")
    assert choice.describe().startswith("int4 target, draft ngram (pinned); " + INT4), choice.describe()


@pytest.mark.parametrize("prefix", ["", "ngram+"])
def test_a_draft_given_as_a_folder_is_named_as_given(tiny_llama, prefix):
    folder = str(tiny_llama / "draft-q4")
    assert _choice(tiny_llama, draft=prefix + folder).draft == prefix + folder
    assert _choice(tiny_llama, draft=prefix + "q4").draft == prefix + "q4"  # the manifest's own, by its name


@pytest.mark.parametrize("value", ["", "  "])
def test_tune_names_an_empty_model(value, capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(["tune", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument model: must be a recipe name or an export folder, got {value!r}" in err, err
    assert "manifest.json" not in err
