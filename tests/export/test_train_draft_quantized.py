"""An EAGLE head on a quantized copy of its target: the float32-trained head drafts losslessly
for the int8 and int4 copies, and `train-draft --features-from` trains on the copy's own hidden
states and labels (read by ONNX Runtime)."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import numpy as np
import pytest

from specdec_rt import SpecConfig
from specdec_rt.engine.engine import Engine

pytestmark = pytest.mark.export

TINY = [
    "--tokens",
    "1500",
    "--prompts",
    "96",
    "--batch",
    "32",
    "--max-new",
    "24",
    "--val-prompts",
    "32",
    "--epochs",
    "2",
    "--depth",
    "2",
    "--eval-prompts",
    "4",
    "--threads",
    "1",
    "--vocab-size",
    "200",
    "-q",
]
PROMPTS = ["def add(a, b):", [{"role": "user", "content": "What is 12 times 7?"}]]


def _train(target: Path, out: Path, *extra: str) -> int:
    from export.cli import main

    return main(["train-draft", "--target", str(target), "--out", str(out), *TINY, *extra])


@pytest.fixture(scope="module")
def tiny_int8(tmp_path_factory) -> Path:
    """The same tiny random Llama as ``tiny_llama`` (same seed), exported with an int8 copy."""
    from tiny_models import export_tiny

    return export_tiny(tmp_path_factory.mktemp("tiny-llama-q8"), "llama", draft="int8") / "draft-q8"


@pytest.fixture(scope="module")
def head_fp32(tiny_llama, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("eagle-fp32") / "run"
    assert _train(tiny_llama, out) == 0
    return out


@pytest.fixture(scope="module")
def head_q4(tiny_llama, tmp_path_factory) -> Path:
    """The same run, features and labels read by the int4 copy."""
    out = tmp_path_factory.mktemp("eagle-q4") / "run"
    assert _train(tiny_llama, out, "--features-from", str(tiny_llama / "draft-q4")) == 0
    return out


def _greedy_is_plain(target: Path, draft: Path) -> int:
    """Greedy output of ``target`` with ``draft`` equals its plain decoding; returns the drafts
    accepted."""

    async def main() -> int:
        accepted = 0
        async with await Engine.load(target, draft=str(draft), spec_config=SpecConfig(measure_costs=False)) as eng:
            assert eng.scheduler.verifier.share_hidden
            for prompt in PROMPTS:
                ar = await eng.generate(prompt, max_new_tokens=32, mode="ar")
                spec = await eng.generate(prompt, max_new_tokens=32)
                assert spec.token_ids == ar.token_ids, prompt
                accepted += spec.stats.accepted
        return accepted

    return anyio.run(main)


@pytest.mark.parametrize("copy", ["int8", "int4"])
def test_float32_head_is_lossless_on_the_quantized_copy(copy, head_fp32, tiny_llama, tiny_int8):
    from export.draft.evaluate import measure_acceptance

    target = tiny_int8 if copy == "int8" else tiny_llama / "draft-q4"
    assert _greedy_is_plain(target, head_fp32 / "draft") > 0
    acc = measure_acceptance(target, head_fp32 / "draft", PROMPTS, k=3, max_new_tokens=24, threads=1)
    assert acc["exact"] and acc["per_depth"][0] > 0.2


def test_features_from_reads_the_copy_and_validates_on_it(head_q4, head_fp32, tiny_llama):
    from export.draft.data import load_shards

    report = json.loads((head_q4 / "report.json").read_text())
    q4 = str(tiny_llama / "draft-q4")
    assert report["status"] == "done" and report["features_from"] == q4
    assert report["acceptance"]["target"] == q4 and report["acceptance"]["exact"]
    assert report["training"]["best_val_top1"] > 0.3
    fp32 = load_shards(head_fp32 / "work" / "data" / "train")
    q4_sh = load_shards(head_q4 / "work" / "features" / "train")
    assert len(q4_sh) == len(fp32) > 0
    for a, b in zip(fp32, q4_sh):
        assert np.array_equal(a.tokens, b.tokens) and b.feats.shape == a.feats.shape
        assert not np.array_equal(a.feats, b.feats)  # int4 weights: other features
        rel = np.linalg.norm(b.feats - a.feats.astype(np.float32), axis=-1) / np.linalg.norm(a.feats, axis=-1)
        assert float(rel.mean()) < 0.5
    assert _greedy_is_plain(tiny_llama / "draft-q4", head_q4 / "draft") > 0


def test_relabel_with_the_float32_export_reproduces_pytorch(head_fp32, tiny_llama):
    """Features and top-k read by the float32 ONNX target equal what PyTorch stored."""
    from export.draft.data import load_shards
    from export.draft.relabel import open_features_model, relabel_shard

    shard = load_shards(head_fp32 / "work" / "data" / "val")[0]
    model = open_features_model(tiny_llama, max_length=256, threads=1)
    try:
        again = relabel_shard(model, shard)
    finally:
        model.close()
    assert np.array_equal(again.tokens, shard.tokens) and again.feats.shape == shard.feats.shape
    np.testing.assert_allclose(again.feats.astype(np.float32), shard.feats.astype(np.float32), atol=2e-2, rtol=2e-2)
    assert (again.topk_ids[:, 0] == shard.topk_ids[:, 0]).mean() > 0.99
    np.testing.assert_allclose(again.topk_p.astype(np.float32), shard.topk_p.astype(np.float32), atol=2e-2)


def test_features_from_must_be_a_copy_of_the_target(tiny_llama, tiny_qwen, tmp_path, capsys):
    nowhere = tmp_path / "nowhere"
    assert _train(tiny_llama, tmp_path / "run", "--features-from", str(nowhere)) == 2
    assert f"--features-from {nowhere}" in capsys.readouterr().err
    assert _train(tiny_llama, tmp_path / "run2", "--features-from", str(tiny_qwen)) == 2
    err = capsys.readouterr().err
    assert f"--features-from {tiny_qwen}: not a copy of the target (different tokenizer" in err
