"""The runtime's draft check on export folders: a draft whose tokenizer file differs from the
target's only in special tokens loads, one with another ordinary token is refused, and a draft
narrower than its target is widened (one wider is refused)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from specdec_rt.engine.factory import check_draft_tokenizer, model_drafter
from specdec_rt.errors import ModelLoadError
from specdec_rt.ort.manifest import load_manifest


def _pair(folder):
    m = load_manifest(folder)
    return m, load_manifest(m.path(m.drafts[0]["path"], "drafts.path"))


def _edited(m, tmp_path, edit):
    doc = json.loads(m.tokenizer_file.read_text())
    edit(doc)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(doc))
    return replace(m, tokenizer_file=path, tokenizer_sha256="0" * 64)


def _rename_special(doc):
    doc["added_tokens"][0]["content"] = "<｜end▁of▁sentence｜>"


def _rename_ordinary(doc):
    vocab = doc["model"]["vocab"]
    special = {t["id"] for t in doc["added_tokens"]}
    text = next(t for t, i in vocab.items() if i not in special and i > 10)
    vocab["zz-not-a-token"] = vocab.pop(text)


def test_special_tokens_may_differ(tiny_qwen, tmp_path):
    m, dm = _pair(tiny_qwen)
    check_draft_tokenizer(m, _edited(dm, tmp_path, _rename_special))  # no error


def test_another_ordinary_token_is_refused(tiny_qwen, tmp_path):
    m, dm = _pair(tiny_qwen)
    with pytest.raises(
        ModelLoadError, match="its tokenizer differs from the target's .*: token .* is 'zz-not-a-token'"
    ):
        model_drafter(m, _edited(dm, tmp_path, _rename_ordinary), threads=1)


def test_a_narrower_draft_is_widened_and_a_wider_one_refused(tiny_qwen):
    m, dm = _pair(tiny_qwen)
    drafter = model_drafter(replace(m, vocab_size=m.vocab_size + 64), dm, threads=1)
    assert (drafter.vocab_size, drafter.model_vocab) == (m.vocab_size + 64, m.vocab_size)
    with pytest.raises(ModelLoadError, match=f"vocab_size {m.vocab_size + 1} > the target's {m.vocab_size}"):
        model_drafter(m, replace(dm, vocab_size=m.vocab_size + 1), threads=1)


def test_a_narrower_draft_exports_and_speculates_exactly(tmp_path):
    """A target whose embedding is padded past the draft's (384 rows against 352, one tokenizer
    of 320 tokens): the export takes the pair, and greedy speculation equals plain decoding."""
    pytest.importorskip("torch")
    import anyio
    from tiny_models import build_tiny_checkpoint

    from export.pipeline import Request, run
    from export.ui import Reporter
    from specdec_rt import Engine, SpecConfig

    target = build_tiny_checkpoint(tmp_path / "t", "qwen2", vocab=384)
    draft = build_tiny_checkpoint(tmp_path / "d", "qwen2", seed=1, vocab=352, layers=1)
    out = tmp_path / "o"
    run(Request(src=str(target), out=out, draft=str(draft), threads=1), Reporter(quiet=True))
    m, dm = _pair(out)
    assert (m.vocab_size, dm.vocab_size) == (384, 352)

    async def main():
        async with await Engine.load(out, draft="model", spec_config=SpecConfig(measure_costs=False)) as engine:
            for prompt in ("def add(a, b):", "Hello world!"):
                ar = await engine.generate(prompt, max_new_tokens=24, mode="ar")
                spec = await engine.generate(prompt, max_new_tokens=24)
                assert spec.token_ids == ar.token_ids and spec.stats.rounds > 0

    anyio.run(main)
