"""``python -m specdec_rt tune MODEL``: the table (or one JSON document), the cache it keeps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.export

ROOT = Path(__file__).resolve().parents[2]


def tune(folder, cache: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECDEC_RT_CACHE": str(cache), "SPECDEC_RT_TUNE_DIR": ""}
    return subprocess.run(
        [sys.executable, "-m", "specdec_rt", "tune", str(folder), "--threads", "1", "--slots", "2", *flags],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )


def test_tune_prints_the_table_then_reads_it_back(tiny_llama, tmp_path):
    first = tune(tiny_llama, tmp_path)
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert lines[0].split()[:4] == ["precision", "draft", "tok/s", "1"] and "tok/s at 2" in lines[0]
    configs = [tuple(line.split()[:2]) for line in lines[1:6]]
    assert configs == [
        ("float32", "ngram+q4"),
        ("float32", "ngram"),
        ("float32", "none"),
        ("int4", "ngram"),
        ("int4", "none"),
    ]
    assert sum("<-" in line for line in lines[1:6]) == 1
    assert lines[0].split()[-4:] == ["chat", "code", "extract", "chosen"]  # one stream's tok/s per category
    assert lines[6].startswith("(per category: tok/s with one stream @ acceptance, 96 tokens an answer")
    assert (
        "chosen:" in first.stdout and "(measured now;" in first.stdout and "greedy output is exact to" in first.stdout
    )
    assert "[tune] round 1: 5 configurations" in first.stderr and "[tune] chose" in first.stderr

    again = tune(tiny_llama, tmp_path)
    assert again.returncode == 0 and "cached from an earlier run" in again.stdout, again.stderr
    assert "[tune] round" not in again.stderr
    assert again.stdout.splitlines()[:6] == lines[:6]  # the very table


def test_tune_json_and_force(tiny_llama, tmp_path):
    (tmp_path / "tune").mkdir()
    forced = tune(tiny_llama, tmp_path, "--json", "--force")
    assert forced.returncode == 0, forced.stderr
    doc = json.loads(forced.stdout)  # stdout is one JSON document, progress went to stderr
    assert doc["choice"]["chosen_by"] == "tuned" and doc["rows"][doc["chosen"]]["exact"] is True
    assert doc["key"]["slots"] == 2 and doc["key"]["threads"] == 1 and "isa" in doc["key"]
    assert Path(doc["cache"]).parent == tmp_path / "tune" and Path(doc["cache"]).is_file()
    assert json.loads(Path(doc["cache"]).read_text())["rows"] == doc["rows"]


@pytest.mark.parametrize("flags", [("--slots", "0"), ("--threads", "999"), ("--provider", "tpu")])
def test_tune_refuses_bad_flags_in_one_line(tiny_llama, tmp_path, flags):
    proc = tune(tiny_llama, tmp_path, *flags)
    assert proc.returncode == 2 and flags[0] in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_tune_names_a_missing_model(tmp_path):
    proc = tune(tmp_path / "nowhere", tmp_path)
    assert proc.returncode == 1 and "nowhere" in proc.stderr and "Traceback" not in proc.stderr
