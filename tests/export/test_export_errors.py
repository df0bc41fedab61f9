"""Every anticipated failure of `python -m export` is one line, `export: error: <reason>`,
with exit code 1 (2 for usage), and happens before any heavy work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_models import build_tiny_checkpoint  # noqa: E402

from export.cli import main  # noqa: E402

pytestmark = pytest.mark.export


def _fails(capsys, argv, *fragments, code=1) -> str:
    assert main(argv) == code
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()  # progress lines may precede the error
    errors = [line for line in lines if line.startswith("export: error: ")]
    assert captured.out == ""
    assert errors == lines[-1:], captured.err
    for fragment in fragments:
        assert fragment in errors[0]
    return errors[0]


def write_gguf(path: Path, arch: str = "llama") -> Path:
    """A small but well-formed GGUF (one float tensor), enough for header checks."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.ones((16, 256), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_missing_path(capsys, tmp_path):
    _fails(capsys, [str(tmp_path / "nope")], "no such file, folder or recipe", "smollm2-135m")


def test_folder_without_config(capsys, tmp_path):
    _fails(capsys, [str(tmp_path)], "no config.json")


def test_not_a_gguf(capsys, tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 definitely a zip")
    _fails(capsys, [str(bad), "--out", str(tmp_path / "o")], "not a GGUF file")


@pytest.mark.parametrize("keep", [10, 200, -100])  # inside the header, the metadata, the data
def test_truncated_gguf(capsys, tmp_path, keep):
    good = write_gguf(tmp_path / "good.gguf")
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep])
    line = _fails(capsys, [str(cut), "--out", str(tmp_path / "o")], "GGUF")
    assert "truncated" in line or "corrupt" in line
    assert not (tmp_path / "o").exists()


def test_unsupported_gguf_architecture(capsys, tmp_path):
    src = write_gguf(tmp_path / "xglm.gguf", arch="xglm")
    _fails(
        capsys,
        [str(src), "--out", str(tmp_path / "o")],
        "unsupported architecture xglm; supported: llama, qwen2, qwen3, phi3, smollm3, gemma2, gemma3",
    )


@pytest.mark.parametrize("arch", ["stablelm", "gptj"])
def test_a_gguf_of_a_family_only_folders_export_says_so(capsys, tmp_path, arch):
    src = write_gguf(tmp_path / f"{arch}.gguf", arch=arch)
    _fails(
        capsys,
        [str(src), "--out", str(tmp_path / "o")],
        f"unsupported architecture {arch} (GGUF files of {arch}: not yet; its checkpoint folders export); supported: llama",
    )


def test_unsupported_checkpoint_architecture(capsys, tmp_path):
    from transformers import XGLMConfig, XGLMForCausalLM

    config = XGLMConfig(num_layers=2, d_model=32, attention_heads=2, ffn_dim=64, vocab_size=100)
    XGLMForCausalLM(config).save_pretrained(tmp_path / "xglm")
    _fails(
        capsys,
        [str(tmp_path / "xglm"), "--out", str(tmp_path / "o")],
        "unsupported architecture xglm; supported: llama, mistral, qwen2",
    )


def test_tokenizer_mismatch_fails_before_loading_weights(capsys, tmp_path, monkeypatch):
    from export.source import Source

    target = build_tiny_checkpoint(tmp_path / "t", "qwen2")
    draft = build_tiny_checkpoint(tmp_path / "d", "qwen2", seed=1, tokenizer_seed=1)

    def no_weights(self):
        raise AssertionError("weights were loaded before the tokenizer check")

    monkeypatch.setattr(Source, "load_model", no_weights)
    _fails(
        capsys,
        [str(target), "--draft", str(draft), "--out", str(tmp_path / "o")],
        "draft tokenizer differs from the target's",
    )
    assert not (tmp_path / "o").exists()


def test_draft_vocab_size_mismatch(capsys, tmp_path):
    target = build_tiny_checkpoint(tmp_path / "t", "llama")
    draft = build_tiny_checkpoint(tmp_path / "d", "llama", vocab=400)
    _fails(capsys, [str(target), "--draft", str(draft), "--out", str(tmp_path / "o")], "vocabulary size 400")


def test_tokenizer_larger_than_the_vocabulary(capsys, tmp_path, monkeypatch):
    """Ids past the embedding would fail at run time (ONNX Runtime's Gather): refused at export,
    before the weights load."""
    from export.source import Source

    ckpt = build_tiny_checkpoint(tmp_path / "c", "llama", vocab=300)

    def no_weights(self):
        raise AssertionError("weights were loaded before the vocabulary check")

    monkeypatch.setattr(Source, "load_model", no_weights)
    err = _fails(capsys, [str(ckpt), "--out", str(tmp_path / "o")], "but the model's vocabulary only 300")
    assert "tokenizer has 3" in err and not (tmp_path / "o").exists()


def test_refuses_to_replace_an_unrelated_folder(capsys, tmp_path):
    ckpt = build_tiny_checkpoint(tmp_path / "c", "llama")
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "precious.txt").write_text("keep me")
    _fails(capsys, [str(ckpt), "--out", str(tmp_path / "o")], "not an export folder", code=2)
    assert (tmp_path / "o" / "precious.txt").read_text() == "keep me"


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["x", "--quantize", "int3"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2


def test_entry_point_exit_code_and_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "export", str(tmp_path / "missing")], capture_output=True, text=True, cwd=tmp_path
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"export: error: no such file, folder or recipe: {tmp_path / 'missing'} (recipes: {', '.join(_recipes())})"
    ]


def _recipes() -> list[str]:
    from export.recipes import list_recipes

    return list_recipes()


@pytest.mark.parametrize("argv", [["--nope"], ["train-draft", "--nope"]])
def test_export_usage_errors_are_one_line(argv, capsys):
    from export.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1 and "error:" in err, err
