"""The benchmark CLI on a tiny model: one JSON document, every requested mode, a chart."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specdec_rt.tooling.bench.report import format_memory, format_micro

pytestmark = pytest.mark.export


def test_bench_json_and_chart(tiny_llama, tmp_path):
    out = tmp_path / "bench"
    cmd = [
        sys.executable,
        "-m",
        "specdec_rt",
        "bench",
        "--model",
        str(tiny_llama),
        "--limit",
        "2",
        "--max-new-tokens",
        "8",
        "--micro",
        "--json",
        "--out",
        str(out),
        "--modes",
        "ar,spec,spec_ngram,spec_q4,hf_ar",
    ]
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
    # the same micro-benchmarks read as a table (the terminal's, without --json; and bench.md's)
    table = format_micro(micro)
    assert table.startswith("| micro-benchmark | value |") and "{" not in table
    assert f"{micro['step_ms_ctx_short']:.1f} ms" in table and table in (out / "bench.md").read_text()


def test_bench_rejects_unknown_modes(tiny_llama, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdec_rt",
            "bench",
            "--model",
            str(tiny_llama),
            "--modes",
            "ar,warp_speed",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "warp_speed" in proc.stderr


def test_bench_concurrency_json_table_and_chart(tiny_llama, tmp_path):
    out = tmp_path / "conc"
    cmd = [
        sys.executable,
        "-m",
        "specdec_rt",
        "bench",
        "--concurrency",
        "1,2",
        "--model",
        str(tiny_llama),
        "--draft",
        "q4",
        "--max-new-tokens",
        "6",
        "--repeats",
        "1",
        "--json",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)  # one JSON document; progress on stderr
    rows = {(r["concurrency"], r["mode"]): r for r in doc["levels"]}
    assert set(rows) == {(c, m) for c in (0, 1, 2) for m in ("spec", "ar")}
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and r["identical"] == "2/2"  # every output equals its solo run
        assert (r["itl_p50"] is None or r["itl_p99"] >= r["itl_p50"] >= 0) and r["max_stall"] >= 0
    assert rows[(0, "spec")]["vs_sequential_spec"] == 1.0 and rows[(2, "ar")]["vs_previous_level"] is not None
    assert "| clients |" in (out / "concurrency.md").read_text()
    assert json.loads((out / "concurrency.json").read_text())["levels"] == doc["levels"]
    assert doc["settings"]["draft"] and doc["settings"]["cold"] is False


def test_bench_concurrency_cold_uses_a_fresh_engine_per_level(tiny_llama, tmp_path, monkeypatch):
    """``--cold``: every level of every repeat on a new Engine with the prefix cache off."""
    import argparse

    from specdec_rt.engine.engine import Engine
    from specdec_rt.tooling.bench import concurrency

    loads, real = [], Engine.load.__func__

    async def load(cls, *a, **kw):
        loads.append(kw.get("prefix_cache"))
        return await real(cls, *a, **kw)

    monkeypatch.setattr(Engine, "load", classmethod(load))
    args = argparse.Namespace(
        concurrency="1,2",
        model=str(tiny_llama),
        draft="q4",
        threads=None,
        max_length=None,
        provider="cpu",
        prompts=None,
        limit=None,
        max_new_tokens=4,
        repeats=2,
        out=str(tmp_path / "cold"),
        json=False,
        cold=True,
    )
    assert concurrency.run_concurrency(args) == 0
    assert loads == [False] * 6  # 3 levels (one after another, 1, 2) x 2 repeats
    doc = json.loads((tmp_path / "cold" / "concurrency.json").read_text())
    assert doc["settings"]["cold"] is True and doc["settings"]["draft"]
    assert all(r["identical"] == "2/2" for r in doc["levels"])


def test_bench_prefix_cache_json_table_and_chart(tiny_llama, tmp_path):
    out = tmp_path / "prefix"
    cmd = [
        sys.executable,
        "-m",
        "specdec_rt",
        "bench",
        "--prefix-cache",
        "--model",
        str(tiny_llama),
        "--draft",
        "q4",
        "--max-new-tokens",
        "6",
        "--conversations",
        "1",
        "--turns",
        "2",
        "--prefix-concurrency",
        "3",
        "--repeats",
        "1",
        "--json",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    turns, shared, mem = doc["multi_turn"], doc["shared_system_prompt"], doc["memory_pressure"]
    assert turns["identical"] and shared["identical"]  # greedy: the cache changes no token
    assert turns["cached_tokens_p50"][0] == 0 and turns["cached_tokens_p50"][1] > 50  # turn 2 reuses turn 1
    assert len(turns["ttft_p50"]["cache"]) == 2 and shared["concurrency"] == 3
    assert mem["within_budget"] and mem["peak_bytes"] <= mem["budget_bytes"] and mem["evictions"] > 0
    assert "| turn |" in (out / "prefix.md").read_text() and json.loads((out / "prefix.json").read_text()) == doc


@pytest.mark.parametrize("name", ["prompts.jsonl", "chat_general.jsonl", "code_general.jsonl"])
def test_shipped_prompt_sets_load_through_the_bench_reader(name):
    """Every prompt set in the package is what ``bench --prompts`` reads: one chat or prompt per
    line with a category, each turned into token ids (here by a stand-in codec)."""
    from importlib import resources

    from specdec_rt.tooling.bench.runner import load_prompts

    class Codec:  # what load_prompts needs of a TextCodec
        def encode_prompt(self, prompt):
            text = prompt if isinstance(prompt, str) else " ".join(m["content"] for m in prompt)
            return [len(w) for w in text.split()]

    path = resources.files("specdec_rt.tooling").joinpath("data", name)
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    prompts = load_prompts(Codec(), str(path))
    assert len(prompts) == len(lines) >= 8
    assert all("category" in d for d in lines) and all(len(p.ids) >= 5 for p in prompts)


BAD_FLAGS = [  # (extra arguments, what the one-line error must say); none of them loads a model
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--limit", "-1"], "--limit must be >= 1"),
    (["--concurrency", "a,b"], "--concurrency needs positive integers"),
    (["--concurrency", "0"], "--concurrency needs positive integers"),
    (["--concurrency", "1", "--prefix-cache"], "two different benchmarks"),
    (["--cold"], "--cold goes with"),
    (["--concurrency", "1", "--modes", "ar"], "--modes / --categories / --micro go with"),
    (["--draft", "none"], "--draft goes with --concurrency"),
    (["--modes", ""], "--modes must be a comma-separated"),
    (["--prefix-cache", "--turns", "0"], "--turns must be >= 1"),
]


@pytest.mark.parametrize("extra,message", BAD_FLAGS)
def test_bad_bench_flags_fail_at_once_in_one_line(tmp_path, extra, message):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdec_rt",
            "bench",
            "--model",
            str(tmp_path / "no-model"),
            "--out",
            str(tmp_path / "out"),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_an_out_path_that_is_a_file_fails_before_the_run(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    proc = subprocess.run(
        [sys.executable, "-m", "specdec_rt", "bench", "--model", str(tmp_path / "no-model"), "--out", str(afile)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "is a file, not a folder" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "content,message",
    [
        (b'["a"]\n', ":1: need a JSON object"),
        (b'{"prompt": null}\n', ":1: need a JSON object"),
        (b'{"messages": []}\n', ":1: need a JSON object"),
        (b'{"messages": "hello"}\n', ":1: need a JSON object"),
        (b'{"prompt": "ok"}\n{oops\n', ":2: not JSON"),
        (b"", "no prompts in it"),
        (b"\xff\xfe\x00bad", "cannot read"),
    ],
)
def test_a_bad_prompt_file_is_one_line_naming_the_line(tmp_path, content, message):
    from specdec_rt.errors import InvalidInputError
    from specdec_rt.tooling.bench.concurrency import load_texts
    from specdec_rt.tooling.loadtest import LoadTestError, read_prompts
    from specdec_rt.tooling.prompt_files import read_prompt_file

    path = tmp_path / "p.jsonl"
    path.write_bytes(content)
    for read in (
        lambda: read_prompt_file(str(path)),
        lambda: load_texts(str(path), None),
        lambda: read_prompts(str(path)),
    ):  # the bench, --concurrency / --prefix-cache, loadtest
        with pytest.raises((InvalidInputError, LoadTestError), match=message):
            read()
    with pytest.raises(InvalidInputError, match="cannot read"):
        read_prompt_file(str(tmp_path / "missing.jsonl"))


def test_a_prompt_file_may_hold_text_parts(tmp_path):
    from specdec_rt.tooling.prompt_files import label, read_prompt_file

    path = tmp_path / "parts.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}\n')
    rows = read_prompt_file(str(path))
    assert len(rows) == 1 and label(rows[0]["text"]) == "hi"


def test_ratios_pair_the_runs_of_one_repeat():
    """With --repeats 2 every mode's ratio to ``ar`` pairs runs of the same pass: ``ar`` against
    itself is exactly 1, and a mode twice as fast in each pass is exactly 2 (the first pass
    slower than the second, as a drifting machine would have it)."""
    from specdec_rt.tooling.bench.report import summarize
    from specdec_rt.tooling.bench.runner import Sample

    samples = []
    for r, secs in ((0, 2.0), (1, 1.0)):
        for p in (0, 1):
            samples += [
                Sample(mode="ar", prompt=p, category="chat", token_ids=[1] * 10, seconds=secs, repeat=r),
                Sample(mode="spec", prompt=p, category="chat", token_ids=[1] * 10, seconds=secs / 2, repeat=r),
            ]
    modes = summarize(samples)["modes"]
    assert modes["ar"]["speedup_vs_ar"] == 1.0 and modes["spec"]["speedup_vs_ar"] == 2.0
    assert modes["spec"]["identical_to_ar"] == 1.0


def test_a_bench_report_gives_acceptance_per_depth_from_the_stats_and_the_measured_costs():
    """On the toy pair: each depth's acceptance in the report is the sum of the runs' own
    ``Stats`` counts (depth 1 is tried once per round; every accepted draft sits at one depth),
    the costs are the scheduler's measurements after each prompt (medians), and bench.md shows
    both."""
    import anyio

    from specdec_rt.policy.config import SpecConfig
    from specdec_rt.speculation.adapters import ModelVerifier
    from specdec_rt.speculation.scheduler import SpecDecScheduler
    from specdec_rt.testing import toy_scheduler
    from specdec_rt.tooling.bench.report import format_markdown, summarize
    from specdec_rt.tooling.bench.runner import Prompt, _SchedulerRunner, run_modes

    # a toy draft costs what its target does: speculation must not fall back, nor shorten its
    # drafts to one token, for its measured cost alone
    keep_drafting = SpecConfig(min_speedup=0.0, fallback_below=0.0, zero_rounds=1000, k_min=2)
    spec, target, _ = toy_scheduler(0.2, 16, 3, keep_drafting)
    modes = {
        "ar": _SchedulerRunner(SpecDecScheduler(None, ModelVerifier(target)), "ar"),
        "spec": _SchedulerRunner(spec, "spec"),
    }
    prompts = [Prompt("chat", [1, 2, 3], "a"), Prompt("code", [4, 5, 6, 7], "b"), Prompt("chat", [2, 9], "c")]
    samples = anyio.run(run_modes, modes, prompts, 40)
    report = summarize(samples)
    stats = [s.stats for s in samples if s.mode == "spec" and s.stats is not None]
    rows = report["modes"]["spec"]["acceptance_by_depth"]
    assert len(stats) == 3 and len(rows) >= 2
    for row in rows:
        index = row["depth"] - 1
        drafted = sum(x.position_drafted[index] for x in stats if index < len(x.position_drafted))
        accepted = sum(x.position_accepted[index] for x in stats if index < len(x.position_accepted))
        assert (row["drafted"], row["accepted"]) == (drafted, accepted) and drafted > 0
        assert row["rate"] == accepted / drafted
    assert rows[0]["drafted"] == sum(x.rounds for x in stats)
    assert sum(row["accepted"] for row in rows) == sum(x.accepted for x in stats)
    assert "acceptance_by_depth" not in report["modes"]["ar"] and "costs" not in report["modes"]["ar"]

    costs = report["modes"]["spec"]["costs"]
    drafting = sum(1 for x in stats if x.drafted)  # a request that drafted nothing reports no costs
    assert costs["prompts"] == drafting >= 1 and costs["draft_cost"] > 0 and costs["plain_step_ms"] > 0
    assert list(costs["verify_cost"]) == [str(k) for k in range(1, spec.config.k_max + 1)]
    assert all(costs["verify_cost"][k] >= 1.0 for k in costs["verify_cost"]) and costs["verify_measured"]
    final = spec.costs  # the last prompt's figures are the scheduler's now: the medians lie within reach
    assert costs["draft_token_ms"] > 0 and final.draft_token_s is not None

    markdown = format_markdown(report)
    first = rows[0]
    assert f"| `spec` | {first['rate']:.2f} ({first['accepted']}/{first['drafted']}) |" in markdown
    assert "verify k=1" in markdown and f"{costs['draft_cost']:.2f} (" in markdown


def test_a_level_without_gaps_has_no_inter_token_latency():
    """A request that streams one event has no gap to measure: ITL is None ("-"), not 0 ms."""
    from specdec_rt.tooling.bench.concurrency import format_markdown, summarize

    def run(itl):
        return {
            "tokens_per_s": 10.0,
            "ttft_p50": 0.1,
            "itl_p50": itl,
            "itl_p99": itl,
            "max_stall": 0.0,
            "ids": [[1, 2]],
        }

    runs = {f"{c}/{m}": [run(None if m == "spec" else 0.02)] for c in (0, 1) for m in ("spec", "ar")}
    rows = summarize(runs, [1])
    assert {r["mode"]: r["itl_p50"] for r in rows if r["concurrency"] == 1} == {"spec": None, "ar": 0.02}
    table = format_markdown(rows)
    assert "| - | - |" in table and "| 20 ms | 20 ms |" in table


def test_the_warm_up_forgets_the_times_of_a_schedulers_first_request():
    """Our schedulers' first request pays for first calls (allocations, thread start): as in
    Engine.load's warm-up its times are forgotten and a second request measures warm costs;
    runners without a scheduler (llama.cpp, Hugging Face) warm up once."""
    import anyio

    from specdec_rt.tooling.bench.runner import Prompt, _SchedulerRunner, run_modes

    calls, forgotten = [], []

    class Costs:
        def forget_times(self):
            forgotten.append(len(calls))

    class Scheduler:  # what _SchedulerRunner reads of a SpecDecScheduler
        costs = Costs()

        async def run(self, ids, n, mode):
            calls.append(("spec", n))
            return type("Result", (), {"token_ids": list(ids[:1]) * n, "stats": None})()

    def make(name, scheduler):
        if scheduler:
            return _SchedulerRunner(Scheduler(), "spec")

        async def run(ids, n):
            calls.append((name, n))
            return list(ids[:1]) * n, 0.01, None

        return run

    modes = {"spec": make("spec", True), "hf_ar": make("hf_ar", False)}
    samples = anyio.run(run_modes, modes, [Prompt("chat", [5, 6], "p")], 16)
    assert calls[:3] == [("spec", 8), ("spec", 8), ("hf_ar", 8)] and forgotten == [1]
    assert len(samples) == 2 and all(s.token_ids == [5] * 16 for s in samples)


def test_bench_reports_weights_resident_memory_and_kv(tiny_llama, tmp_path):
    """``memory`` in bench.json: weights on disk / mapped / resident, RSS, and per model its role,
    KV bytes per position and what its pool reserves; bench.md shows them as a table."""
    from specdec_rt.ort.manifest import load_manifest

    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "specdec_rt", "bench", "--model", str(tiny_llama), "--limit", "1"]
    cmd += ["--max-new-tokens", "4", "--max-length", "256", "--modes", "ar,spec_q4", "--json", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    memory = json.loads(proc.stdout)["memory"]
    files = [tiny_llama / "model.onnx", tiny_llama / "model.onnx.data"]
    files += [tiny_llama / "draft-q4" / "model.onnx", tiny_llama / "draft-q4" / "model.onnx.data"]
    assert memory["weights_mb"] == pytest.approx(sum(f.stat().st_size for f in files) / 2**20)
    assert 0 <= memory["weights_resident_mb"] <= memory["weights_mapped_mb"]
    assert memory["peak_rss_mb"] >= memory["rss_mb"] > 0
    manifests = {"target": load_manifest(tiny_llama), "draft": load_manifest(tiny_llama / "draft-q4")}
    assert sorted(kv["role"] for kv in memory["kv"].values()) == ["draft", "target"]
    for name, kv in memory["kv"].items():
        m = manifests[kv["role"]]
        assert name == m.name
        assert kv["bytes_per_position"] == m.num_layers * 2 * m.num_kv_heads * m.head_dim * 4  # float32 KV
        assert kv["positions_per_slot"] == 257
        slots = kv["reserved_mb"] * 2**20 / (kv["bytes_per_position"] * 257)
        assert slots == int(slots) >= 2  # bench's two running slots (and any prefix-cache slots)
    table = format_memory(memory)
    assert table in (out / "bench.md").read_text()
    assert f"{memory['kv'][manifests['target'].name]['reserved_mb']:.0f} MB reserved" in table
