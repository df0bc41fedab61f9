"""``bench --serve``: its flags, the per-level numbers on synthetic samples, and the whole driver
against two real servers (our server on a tiny model, and a second one standing in for
llama-server)."""

from __future__ import annotations

import argparse
import json
import re
import socket
import sys
from pathlib import Path

import pytest

from specdec_rt.cli import main
from specdec_rt.errors import SpecDecError
from specdec_rt.tooling.bench.serving import (
    LLAMA,
    OURS,
    compare_levels,
    format_serving_markdown,
    format_serving_table,
    level_requests,
    llama_server_command,
    run_serving_bench,
    summarize_level,
    tag_messages,
)
from specdec_rt.tooling.loadtest_report import RequestSample

# ----------------------------------------------------------------------------------- flags


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--serve"], "--serve needs --llama-cpp BIN_DIR"),
        (["--serve", "--llama-cpp", "X", "--modes", "ar"], "--modes does not go with --serve"),
        (["--serve", "--llama-cpp", "X", "--micro"], "--micro does not go with --serve"),
        (["--serve", "--llama-cpp", "X", "--cold"], "--cold does not go with --serve"),
        (["--serve", "--llama-cpp", "X", "--repeats", "3"], "--repeats does not go with --serve"),
        (["--serve", "--llama-cpp", "X", "--prefix-cache"], "--serve is a benchmark of its own"),
        (["--serve", "--llama-cpp", "X", "--requests", "0"], "--requests must be >= 1, got 0"),
        (["--serve", "--llama-cpp", "X", "--concurrency", "0,2"], "--concurrency needs positive integers"),
        (["--serve", "--llama-cpp", "X", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--requests", "4"], "--requests goes with --serve"),
    ],
)
def test_bad_flag_combinations_are_one_line_errors(flags, message, capsys, tmp_path):
    code = main(["bench", *flags, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("\n") == 1 and err.startswith("specdec_rt: error: ") and message in err, err


def test_a_folder_without_llama_server_is_named_before_any_model_is_built(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_RT_CACHE", str(tmp_path / "cache"))  # nothing may get built
    (tmp_path / "bin").mkdir()
    for folder, message in ((tmp_path / "nope", "no such folder"), (tmp_path / "bin", "no llama-server there")):
        code = main(["bench", "--serve", "--llama-cpp", str(folder), "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert code == 1 and message in err and str(folder) in err, err
    assert not (tmp_path / "cache").exists()


# ----------------------------------------------------------------------------------- pure parts


def test_tags_make_every_request_of_every_level_a_new_prompt():
    prompts = [
        [{"role": "user", "content": "a"}],
        [{"role": "system", "content": "s"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "x"}],
    ]
    one, four = level_requests(prompts, 1, 3), level_requests(prompts, 4, 3)
    assert [r[-1]["content"] for r in one] == ["[1-1] a", "x", "[1-3] a"]
    assert one[1][1]["content"] == "[1-2] b" and one[1][0]["content"] == "s"  # the last user message only
    flat = [json.dumps(r) for r in one + four]
    assert len(set(flat)) == len(flat)  # nothing repeats within or across levels
    assert prompts[0][0]["content"] == "a"  # the prompts themselves are untouched
    parts = tag_messages([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "[2-1]")
    assert parts[0]["content"][0] == {"type": "text", "text": "[2-1]"}
    with pytest.raises(SpecDecError, match="no user message"):
        tag_messages([{"role": "system", "content": "s"}], "[1-1]")


def _ok(server, ttft, itl, e2e, *, tokens):
    return RequestSample(server, "ok", ttft=ttft, itl=list(itl), e2e=e2e, completion_tokens=tokens, chunks=len(itl) + 1)


def test_level_summary_adds_p90s_to_the_load_test_summary():
    samples = [
        _ok(OURS, 0.1, [0.01, 0.02, 0.03, 0.04], 0.2, tokens=10),
        _ok(OURS, 0.3, [0.05], 0.4, tokens=6),
        RequestSample(OURS, "error", e2e=0.1, error="HTTP 500: boom"),
    ]
    p = summarize_level(samples, 2.0, 4, OURS)
    assert (p["concurrency"], p["mode"], p["ok"], p["errors"]) == (4, OURS, 2, 1)
    assert p["tokens_per_s"] == pytest.approx(8.0)  # 16 tokens of the ok requests / 2 s
    assert p["ttft_p50_ms"] == pytest.approx(200.0) and p["ttft_p90_ms"] == pytest.approx(280.0)
    assert p["itl_p50_ms"] == pytest.approx(30.0)  # pooled gaps 10..50 ms
    assert p["itl_p90_ms"] == pytest.approx(46.0) and p["itl_p99_ms"] == pytest.approx(49.6)
    assert p["e2e_p50_ms"] == pytest.approx(300.0)


def test_ratios_and_identical_counts_per_level():
    phases = [
        {"concurrency": 1, "mode": OURS, "tokens_per_s": 30.0, "ttft_p50_ms": 50.0},
        {"concurrency": 1, "mode": LLAMA, "tokens_per_s": 20.0, "ttft_p50_ms": 100.0},
        {"concurrency": 4, "mode": LLAMA, "tokens_per_s": 40.0, "ttft_p50_ms": None},
        {"concurrency": 4, "mode": OURS, "tokens_per_s": 60.0, "ttft_p50_ms": 80.0},
        {"concurrency": 8, "mode": OURS, "tokens_per_s": 70.0, "ttft_p50_ms": 90.0},  # llama-server missing
    ]
    texts = {
        (OURS, 1): ["a", "b", None],
        (LLAMA, 1): ["a", "c", "x"],
        (OURS, 4): ["a", "b", "c"],
        (LLAMA, 4): ["a", "b", "c"],
    }
    c1, c4 = compare_levels(phases, texts)
    assert c1 == {"concurrency": 1, "tokens_per_s_ratio": 1.5, "ttft_p50_ratio": 0.5, "identical": 1, "compared": 2}
    assert c4 == {"concurrency": 4, "tokens_per_s_ratio": 1.5, "ttft_p50_ratio": None, "identical": 3, "compared": 3}


def test_table_and_markdown_show_every_phase_and_ratio():
    phases = [summarize_level([_ok(name, 0.1, [0.02], 0.3, tokens=4)], 1.0, 2, name) for name in (OURS, LLAMA)]
    report = {
        "model": "tiny",
        "settings": {
            "requests": 1,
            "max_new_tokens": 4,
            "n_prompts": 1,
            "prompts": "p.jsonl",
            "threads": 2,
            "token_count": "the servers' usage chunks",
        },
        "servers": {
            OURS: {"cmd": ["-m", "specdec_rt", "serve"], "models": {"data": [{"id": "tiny"}]}, "startup_log": ["hi"]},
            LLAMA: {"gguf": "/m/x.Q8_0.gguf"},
        },
        "phases": phases,
        "comparison": compare_levels(phases, {(OURS, 2): ["a"], (LLAMA, 2): ["a"]}),
    }
    table, md = format_serving_table(report), format_serving_markdown(report)
    assert re.search(r"^\s+2 ours .* 4\.0 .*100ms", table, re.M) and re.search(r"^\s+2 llama-server ", table, re.M)
    assert "2 in flight: ours / llama-server tokens/s = 1.00x, TTFT p50 = 1.00x; same text 1/1" in table
    assert "| 2 | 1.00x | 1.00x | 1 / 1 |" in md and "x.Q8_0.gguf" in md and "    hi" in md


def test_llama_server_command_line():
    cmd = llama_server_command(Path("/b/llama-server"), Path("/m/x.gguf"), slots=8, ctx=4096, threads=2)(5555)
    assert cmd[0] == "/b/llama-server" and "--jinja" in cmd
    pairs = dict(zip(cmd[1::2], cmd[2::2]))
    assert pairs["-np"] == "8" and pairs["-c"] == str(8 * 4096) and pairs["-t"] == pairs["-tb"] == "2"
    assert pairs["--port"] == "5555" and cmd[cmd.index("--host") + 1] == "127.0.0.1"


# ----------------------------------------------------------------------------------- end to end


def _needs_the_server():
    for mod in ("httpx", "starlette", "uvicorn", "prometheus_client", "openai"):
        pytest.importorskip(mod)


def _args(model: Path, out: Path, **kw) -> argparse.Namespace:
    base = dict(
        model=str(model),
        draft="q4",  # --draft wins over the draft --precision auto tunes (on a random model: none)
        threads=1,
        max_length=512,
        provider="auto",
        llama_cpp="(stand-in)",
        llama_gguf=None,
        concurrency="1,2",
        requests=3,
        max_new_tokens=8,
        prompts=None,
        limit=None,
        out=str(out),
        json=True,
    )
    return argparse.Namespace(**{**base, **kw})


def _stand_in(model: Path):
    """Our own server in llama-server's place: one more process, the same model and flags."""

    def command(port: int) -> list[str]:
        return [sys.executable, "-m", "specdec_rt", "serve", "--model", str(model), "--slots", "2",
                "--port", str(port), "--threads", "1", "--max-length", "512", "--draft", "q4"]  # fmt: skip

    return command


def test_end_to_end_against_two_real_servers(tiny_llama, capsys, tmp_path):
    _needs_the_server()
    out = tmp_path / "serve"
    code = run_serving_bench(_args(tiny_llama, out), llama_command=_stand_in(tiny_llama))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert [(p["concurrency"], p["mode"]) for p in report["phases"]] == [
        (1, OURS),
        (1, LLAMA),
        (2, LLAMA),
        (2, OURS),
    ]  # the servers take turns going first
    assert report["order"] == [[OURS, LLAMA], [LLAMA, OURS]]
    for p in report["phases"]:
        assert (p["requests"], p["ok"], p["errors"], p["usage_missing"]) == (3, 3, 0, 0), p
        assert 0 < p["completion_tokens"] <= 3 * 8 and p["tokens_per_s"] > 0 and p["ttft_p50_ms"] > 0
        assert p["ttft_p90_ms"] >= p["ttft_p50_ms"]
    assert report["settings"]["token_count"] == "the servers' usage chunks"
    log = report["requests_log"]
    prompts = {(r["server"], r["concurrency"], r["request"]): r for r in log}
    assert len(prompts) == 12
    for c in report["comparison"]:
        same = sum(
            prompts[OURS, c["concurrency"], i]["text"] == prompts[LLAMA, c["concurrency"], i]["text"] for i in range(3)
        )
        assert (c["identical"], c["compared"]) == (same, 3)
        expected = [p for p in report["phases"] if p["concurrency"] == c["concurrency"]]
        by = {p["mode"]: p for p in expected}
        # both phases' rates and the ratio are rounded to 3 decimals: slow rates move the ratio
        ratio = by[OURS]["tokens_per_s"] / by[LLAMA]["tokens_per_s"]
        assert c["tokens_per_s_ratio"] == pytest.approx(ratio, rel=1e-3, abs=2e-3)
    ours = report["servers"][OURS]
    assert ours["cmd"][:5] == ["-m", "specdec_rt", "serve", "--model", str(tiny_llama)]
    assert ours["cmd"][ours["cmd"].index("--slots") + 1] == "2"  # the highest level
    assert ours["cmd"][ours["cmd"].index("--draft") + 1] == "q4"  # given flags pass through
    assert ours["models"]["data"][0]["id"] == tiny_llama.name
    assert any("listening on http://127.0.0.1:" in line for line in ours["startup_log"])
    assert ours["exit_status"] == 0 and report["servers"][LLAMA]["exit_status"] == 0
    assert (out / "serve.json").is_file() and (out / "serve.md").is_file()
    assert report["machine"]["cpu"] and f"Machine: {report['machine']['cpu']}" in (out / "serve.md").read_text()
    if report["chart"]:
        assert Path(report["chart"]).stat().st_size > 0


def test_a_server_that_fails_to_start_stops_the_other(tiny_llama, capsys, tmp_path):
    _needs_the_server()
    out = tmp_path / "serve"
    broken = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    with pytest.raises(SpecDecError, match=r"(?s)llama-server: the server exited with status 3.*no model here"):
        run_serving_bench(_args(tiny_llama, out), llama_command=lambda port: broken)
    log = (out / "server-ours.log").read_text()
    port = int(re.search(r"listening on http://127\.0\.0\.1:(\d+)", log).group(1))
    with pytest.raises(OSError):  # ours was stopped: nothing listens there any more
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    assert "servers stopped (exit status: ours 0" in capsys.readouterr().err
