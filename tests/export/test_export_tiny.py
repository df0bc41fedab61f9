"""Export tiny random Llama/Qwen2 checkpoints, validate them, and check the manifest contract:
shared-buffer calls, rollback, tokenizer parity with the runtime's recipe, idempotency,
atomicity and disk-full handling."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_models import build_tiny_checkpoint, export_tiny  # noqa: E402

from export.errors import DiskFullError  # noqa: E402
from export.manifest import read_manifest  # noqa: E402
from export.pipeline import Request, run  # noqa: E402
from export.tokenizer import SAMPLE_TEXTS, sha256_file  # noqa: E402
from export.ui import Reporter  # noqa: E402
from export.validate import KVSession  # noqa: E402

pytestmark = pytest.mark.export


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def exported(request, tmp_path_factory) -> Path:
    """Each family exported once, with an int4 quantized-copy draft."""
    return export_tiny(tmp_path_factory.mktemp(request.param), request.param, draft="int4")


def test_manifest_describes_the_folder(exported):
    m = read_manifest(exported)
    arch = m["architecture"]
    assert m["schema_version"] == 1 and m["role"] == "target"
    assert arch == {
        "family": arch["family"],
        "num_layers": 2,
        "hidden_size": 64,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
        "vocab_size": 384,
        "max_positions": 512,
    }
    assert m["onnx"]["inputs"]["position_ids"] == "position_ids"  # exporter 0.3: packed [1, N]
    assert m["onnx"]["inputs"]["attention_bias"] == "attention_bias"  # zeros, or a tree mask
    assert m["onnx"]["kv"]["shared_buffer"] is True and m["onnx"]["kv"]["layout"] == "BNSH"
    assert m["onnx"]["quantization"] is None
    for name, meta in m["files"].items():
        assert sha256_file(exported / name) == meta["sha256"]
        assert (exported / name).stat().st_size == meta["bytes"]
    assert {
        "model.onnx",
        "model.onnx.data",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= set(m["files"])
    assert m["tokenizer"]["sha256"] == m["files"]["tokenizer.json"]["sha256"]
    assert m["drafts"] == [{"name": "q4", "path": "draft-q4"}]
    v = m["validation"]
    assert v["greedy_agreement"] == 1.0 and v["max_abs_logit_diff"] < 1e-4


def test_graph_interface_names(exported):
    import onnx

    m = read_manifest(exported)
    g = onnx.load(str(exported / "model.onnx"), load_external_data=False).graph
    inputs = {i.name: i for i in g.input}
    assert list(inputs)[:4] == ["input_ids", "seqlens_k", "total_sequence_length", "logits_index"]
    past = {f"past_key_values.{i}.{kind}" for i in range(2) for kind in ("key", "value")}
    assert past <= set(inputs)
    assert [o.name for o in g.output][:2] == ["logits", "hidden_states"]
    head = next(t for t in g.initializer if t.name == "lm_head.weight")
    assert list(head.dims) == [64, 384]  # materialized [H, V], also for tied embeddings
    ops = {n.op_type for n in g.node}
    assert {"GroupQueryAttention", "SkipSimplifiedLayerNormalization"} <= ops
    assert m["onnx"]["nodes"] == len(g.node)


def test_quantized_draft(exported):
    import onnx

    d = read_manifest(exported / "draft-q4")
    assert d["role"] == "draft" and d["draft_of"] == read_manifest(exported)["name"]
    assert d["onnx"]["quantization"]["bits"] == 4
    assert d["tokenizer"]["sha256"] == read_manifest(exported)["tokenizer"]["sha256"]
    g = onnx.load(str(exported / "draft-q4" / "model.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in g.node]
    assert "MatMul" not in ops and ops.count("MatMulNBits") == 2 * 5 + 1  # incl. the LM head
    assert "quantized" in d["exact_to"]
    assert d["validation"]["logit_correlation"] > 0.5


def test_shared_buffer_rollback_is_exact(exported):
    """Garbage written beyond L, then a call with past length L == a fresh run."""
    m = read_manifest(exported)
    rng = np.random.default_rng(3)
    prefix, new, garbage = (rng.integers(0, 384, n) for n in (20, 3, 6))
    fresh = KVSession(exported, m, max_len=40)
    fresh.forward(prefix, 0)
    want = fresh.forward(new, 20)
    dirty = KVSession(exported, m, max_len=40)
    dirty.forward(prefix, 0)
    dirty.forward(garbage, 20)  # a rejected verify writes positions 20..25
    dirty.forward(garbage[:2], 26)  # and more beyond
    np.testing.assert_array_equal(dirty.forward(new, 20), want)
    # the runtime's KV pool really is the cache: positions >= 23 of the slot hold garbage
    key = dirty.model.pool.host_arrays()[0]  # layer 0's keys [slots, kv_heads, max_len + 1, d]
    assert np.abs(key[dirty.session.slot, :, 23:28]).sum() > 0


def test_chunk_matches_pytorch_and_selects_rows(exported):
    import torch
    from transformers import AutoModelForCausalLM

    family = read_manifest(exported)["architecture"]["family"]
    model = AutoModelForCausalLM.from_pretrained(exported.parent / f"{family}-ckpt").eval()
    ids = np.random.default_rng(5).integers(0, 384, 30)
    with torch.no_grad():
        ref = model(torch.tensor(ids[None])).logits[0].numpy()  # [30, V]
        hidden = model.model(torch.tensor(ids[None])).last_hidden_state[0].numpy()  # [30, H]
    sess = KVSession(exported, read_manifest(exported), max_len=32, bind_hidden=True)
    np.testing.assert_allclose(sess.forward(ids[:20], 0, rows=[19]), ref[19:20], atol=1e-4)
    np.testing.assert_allclose(sess.hidden_states, hidden[:20], atol=1e-4)  # every S row
    np.testing.assert_allclose(sess.forward(ids[20:21], 20), ref[20:21], atol=1e-4)
    got = sess.forward(ids[21:30], 21, rows=[0, 4, 8])  # a verify over 9 positions, 3 rows
    np.testing.assert_allclose(got, ref[[21, 25, 29]], atol=1e-4)


def test_runtime_tokenizer_recipe_matches_autotokenizer(exported):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    m = read_manifest(exported)
    fast = Tokenizer.from_file(str(exported / m["tokenizer"]["file"]))
    hf = AutoTokenizer.from_pretrained(str(exported))
    bos = [m["special_tokens"]["bos"]] if m["tokenizer"]["add_bos"] else []
    assert m["tokenizer"]["add_bos"] is (m["architecture"]["family"] == "llama")
    for text in SAMPLE_TEXTS:
        assert bos + fast.encode(text, add_special_tokens=False).ids == hf(text)["input_ids"]
    chat = [{"role": "user", "content": "hi there"}]
    rendered = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert m["tokenizer"]["chat_template"] == hf.chat_template
    assert fast.encode(rendered, add_special_tokens=False).ids == hf.apply_chat_template(
        chat, tokenize=True, add_generation_prompt=True
    )
    gen = json.loads((exported / "generation_config.json").read_text())
    eos = gen["eos_token_id"]
    assert (eos if isinstance(eos, list) else [eos]) == m["special_tokens"]["eos"]


def test_own_draft_and_idempotency(tmp_path):
    out = export_tiny(tmp_path, "qwen2", draft="tiny")
    m = read_manifest(out)
    assert m["drafts"] == [{"name": "qwen2-draft", "path": "draft-qwen2-draft"}]
    d = read_manifest(out / "draft-qwen2-draft")
    assert d["architecture"]["num_layers"] == 1 and d["validation"]["greedy_agreement"] == 1.0
    stamp = (out / "model.onnx.data").stat().st_mtime_ns
    req = Request(src=str(tmp_path / "qwen2-ckpt"), out=out, draft=str(tmp_path / "qwen2-draft"), threads=1)
    assert run(req, Reporter(quiet=True)).noop  # second run: nothing to do
    assert (out / "model.onnx.data").stat().st_mtime_ns == stamp
    req.force = True
    assert not run(req, Reporter(quiet=True)).noop
    assert (out / "model.onnx.data").stat().st_mtime_ns != stamp
    req.force, req.draft = False, None  # different options: rebuilt, draft gone
    assert not run(req, Reporter(quiet=True)).noop
    assert read_manifest(out)["drafts"] == [] and not (out / "draft-qwen2-draft").exists()


def test_quantized_target_and_no_validate(tmp_path):
    out = export_tiny(tmp_path, "llama", quantize="int8", validate=False)
    m = read_manifest(out)
    assert m["onnx"]["quantization"]["bits"] == 8 and m["validation"] is None
    assert "exact to the quantized model" in m["exact_to"]
    assert run(
        Request(src=str(tmp_path / "llama-ckpt"), out=out, quantize="int8", validate=False), Reporter(quiet=True)
    ).noop
    # asking for validation now rebuilds (the folder was never validated)
    assert not run(
        Request(src=str(tmp_path / "llama-ckpt"), out=out, quantize="int8", threads=1), Reporter(quiet=True)
    ).noop
    assert read_manifest(out)["validation"]["logit_correlation"] > 0.5


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name)


def test_failure_mid_export_leaves_nothing(tmp_path, monkeypatch):
    import export.pipeline as pipeline

    ckpt = build_tiny_checkpoint(tmp_path / "ckpt", "llama")
    out = tmp_path / "out"

    def boom(*args, **kwargs):
        raise RuntimeError("simulated crash during validation")

    monkeypatch.setattr(pipeline, "validate_graph", boom)
    with pytest.raises(RuntimeError):
        run(Request(src=str(ckpt), out=out), Reporter(quiet=True))
    assert not out.exists() and _leftovers(tmp_path) == []
    # an existing good export survives a failed --force rebuild untouched
    monkeypatch.undo()
    run(Request(src=str(ckpt), out=out, threads=1), Reporter(quiet=True))
    before = read_manifest(out)
    monkeypatch.setattr(pipeline, "validate_graph", boom)
    with pytest.raises(RuntimeError):
        run(Request(src=str(ckpt), out=out, force=True), Reporter(quiet=True))
    assert read_manifest(out) == before and _leftovers(tmp_path) == []


def test_interrupt_is_atomic_too(tmp_path, monkeypatch):
    import export.pipeline as pipeline
    from export.errors import InterruptedExportError

    ckpt = build_tiny_checkpoint(tmp_path / "ckpt", "qwen2")

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "save_tokenizer", interrupt)
    with pytest.raises(InterruptedExportError):
        run(Request(src=str(ckpt), out=tmp_path / "out"), Reporter(quiet=True))
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_disk_full_is_reported(tmp_path, monkeypatch):
    from export import weights

    ckpt = build_tiny_checkpoint(tmp_path / "ckpt", "llama")
    real_add = weights.ExternalDataWriter.add

    def add(self, name, array):
        if self.bytes_written > 100_000:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_add(self, name, array)

    monkeypatch.setattr(weights.ExternalDataWriter, "add", add)
    with pytest.raises(DiskFullError, match="disk full"):
        run(Request(src=str(ckpt), out=tmp_path / "out"), Reporter(quiet=True))
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_export_in_a_process_whose_onnx_runtime_has_a_global_thread_pool(tmp_path):
    """The runtime's CLI and server run ONNX Runtime on one global pool; an export (validation
    sessions) in such a process used to fail ("use_per_session_threads must be false")."""
    import subprocess
    import sys

    code = (
        "import sys; sys.path.insert(0, 'tests')\n"
        "from specdec_rt.ort.setup import use_global_thread_pool\n"
        "assert use_global_thread_pool(1)\n"
        "from pathlib import Path\nfrom tiny_models import export_tiny\n"
        f"print(export_tiny(Path({str(tmp_path)!r}), 'llama'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "llama-onnx" / "manifest.json").is_file()
