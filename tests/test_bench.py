"""The benchmark CLI on a tiny model: one JSON document, every requested mode, a chart."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.export


def test_bench_json_and_chart(tiny_llama, tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "specdec_rt", "bench", "--model", str(tiny_llama), "--limit", "2",
           "--max-new-tokens", "8", "--micro", "--json", "--out", str(out),
           "--modes", "ar,spec,spec_ngram,spec_q4,hf_ar"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)  # exactly one JSON document; progress went to stderr
    assert "[bench]" in proc.stderr
    assert set(doc["modes"]) == {"ar", "spec", "spec_ngram", "spec_q4", "hf_ar"}
    for mode, d in doc["modes"].items():
        assert d["tokens_per_s"] > 0 and d["n"] == 2
        assert d["identical_to_ar"] == 1.0, mode  # greedy: every mode reproduces plain decoding
    assert doc["modes"]["spec_q4"]["acceptance_rate"] > 0
    assert "speedup_vs_hf_ar" in doc["modes"]["ar"]
    micro = doc["micro"]
    for key in ("verify_width_ratio", "context_ratio", "bandwidth_gbs", "ar_step_vs_floor", "memory"):
        assert key in micro
    assert (out / "bench.json").is_file()
    if doc["chart"]:
        assert (out / "bench.png").stat().st_size > 1000


def test_bench_rejects_unknown_modes(tiny_llama, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "specdec_rt", "bench", "--model", str(tiny_llama),
                           "--modes", "ar,warp_speed", "--out", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode != 0 and "warp_speed" in proc.stderr
