"""Families no native graph takes, built through optimum-onnx (export.optimum_path) and run by
specdec_rt.ort.ConcatKVModel: GPT-Neo (every other layer local, a window of 8 the tests run past)
and CodeGen (partial rotary), tiny random checkpoints.

Each folder's manifest says ``"builder": "optimum"``; its logits match PyTorch's over 40
positions fed in the runtime's call pattern; speculative rounds with rejections (rollbacks) give
plain decoding's logits; greedy ``ar`` and ``spec`` (n-gram drafts, a draft model built through
optimum too) give PyTorch's greedy tokens; what it lacks (ModelCaps) is refused cleanly."""

from __future__ import annotations

import asyncio
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("optimum.exporters.onnx")

from tiny_models import OPTIMUM_FAMILIES, build_tiny_checkpoint  # noqa: E402

pytestmark = pytest.mark.export

LOGIT_TOL = 1e-4


class Built:
    """An export through optimum: its folder, the checkpoint's PyTorch model, the export's log."""

    def __init__(self, folder: Path, ckpt: Path, log: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.folder, self.ckpt, self.log = folder, ckpt, log
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()

    def logits(self, ids: np.ndarray) -> np.ndarray:
        """PyTorch's logits of every position of ``ids`` [T] (no cache): [T, V]."""
        with self.torch.no_grad():
            return self.model(self.torch.tensor(ids[None])).logits[0].numpy()

    def greedy(self, ids: list[int], n: int) -> list[int]:
        """PyTorch's greedy continuation of ``ids`` by ``n`` tokens (end-of-sequence ignored)."""
        seq = list(ids)
        for _ in range(n):
            seq.append(int(self.logits(np.array(seq))[-1].argmax()))
        return seq[len(ids) :]


def _export(tmp: Path, family: str, **request: object) -> tuple[Path, str]:
    from export.pipeline import Request, run
    from export.ui import Reporter

    ckpt = build_tiny_checkpoint(tmp / f"{family}-ckpt", family, seed=0)
    stream = io.StringIO()
    out = tmp / f"{family}-onnx"
    result = run(Request(src=str(ckpt), out=out, threads=1, **request), Reporter(stream=stream))
    from export.cli import summary

    return out, stream.getvalue() + summary(result, Reporter(quiet=True))


@pytest.fixture(scope="module", params=OPTIMUM_FAMILIES)
def built(request, tmp_path_factory) -> Built:
    tmp = tmp_path_factory.mktemp(request.param)
    out, log = _export(tmp, request.param)
    return Built(out, tmp / f"{request.param}-ckpt", log)


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def _run(coro):
    return asyncio.run(coro)


def test_the_manifest_and_the_log_say_optimum_built_it(built):
    m = _manifest(built.folder)
    assert m["builder"] == "optimum"
    assert m["architecture"]["family"] in OPTIMUM_FAMILIES
    assert m["onnx"]["kv"]["layout"] == "BNSH-concat" and m["onnx"]["kv"]["shared_buffer"] is False
    assert set(m["files"]) >= {"model.onnx", "model.onnx.data", "tokenizer.json"}
    assert m["validation"]["max_abs_logit_diff"] < LOGIT_TOL and m["validation"]["greedy_agreement"] == 1.0
    assert "its graph is built through optimum-onnx" in built.log
    assert "optimum" in built.log.split("built by")[1].splitlines()[2]  # the summary's row


def test_a_second_identical_export_is_a_no_op_on_the_command_line(built, capsys):
    from export.cli import main

    assert main([str(built.ckpt), "--out", str(built.folder), "--threads", "1"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(built.folder)
    assert "is up to date" in captured.err


def test_a_native_export_says_native(tiny_llama):
    assert _manifest(tiny_llama)["builder"] == "native"


def test_logits_match_pytorch_over_40_positions_in_the_runtimes_call_pattern(built):
    from specdec_rt.ort import ConcatKVModel

    ids = np.random.default_rng(3).integers(0, 384, 40).astype(np.int64)
    want = built.logits(ids)
    model = ConcatKVModel(built.folder, max_length=64, slots=1, threads=1, provider="cpu")
    s = model.start()
    got, pos = [], 0
    for size in (5, 1, 1, 3, 1, 7, 2, 20):  # past the GPT-Neo window of 8 on its local layer
        got.append(s.run_sync(ids[pos : pos + size], size, pos))
        pos += size
    s.close()
    diff = np.abs(np.concatenate(got) - want).max()
    assert diff < LOGIT_TOL, diff


def test_rejected_rounds_roll_back_to_plain_decodings_logits(built):
    from specdec_rt.ort import ConcatKVModel

    rng = np.random.default_rng(4)
    ids = rng.integers(0, 384, 30).astype(np.int64)
    model = ConcatKVModel(built.folder, max_length=64, slots=2, threads=1, provider="cpu")
    plain = model.start()
    want = plain.run_sync(ids, ids.size, 0)  # [30, V]
    spec = model.start()
    got = [spec.run_sync(ids[:6], 6, 0)]
    pos = 6
    while pos < ids.size:  # a round: 4 drafts of which 1 is right, then a rejected tail rolled back
        drafts = np.concatenate([ids[pos : pos + 1], rng.integers(0, 384, 3)])
        rows = spec.run_sync(drafts, drafts.size, pos)
        got.append(rows[:1])
        spec.rollback(pos + 1)
        pos += 1
    assert spec.length == ids.size
    assert np.abs(np.concatenate(got) - want).max() < 1e-5
    plain.close()
    spec.close()


def test_greedy_ar_and_spec_give_pytorchs_tokens(built):
    from specdec_rt import Engine

    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]  # repeats: the n-gram drafter proposes
    want = built.greedy(prompt, 24)

    async def go():
        async with await Engine.load(built.folder, draft="ngram", slots=2, threads=1) as engine:
            ar = await engine.generate(prompt, 24, mode="ar", ignore_eos=True)
            spec = await engine.generate(prompt, 24, mode="spec", ignore_eos=True)
            together = await asyncio.gather(
                *[engine.generate(prompt, 24, mode="spec", ignore_eos=True) for _ in range(3)]
            )
            return ar, spec, together

    ar, spec, together = _run(go())
    assert ar.token_ids == want
    assert spec.token_ids == want
    assert spec.stats.drafted > 0
    assert all(r.token_ids == want for r in together)  # concurrent requests, one call at a time


def test_the_generate_command_agrees_in_both_modes(built, capsys, monkeypatch):
    import specdec_rt.ort
    from specdec_rt.cli import main

    # the CLI owns its process and sets ONNX Runtime's global thread pool, which would bind every
    # later session of this test process (plain ones then fail): keep per-session pools here
    monkeypatch.setattr(specdec_rt.ort, "use_global_thread_pool", lambda threads=None: False)
    docs = {}
    for mode, draft in (("ar", "none"), ("spec", "ngram")):
        argv = ["generate", "--model", str(built.folder), "--draft", draft, "--mode", mode, "--threads", "1"]
        assert main([*argv, "--prompt", "ab ab ab ab ab", "--max-new-tokens", "16", "--json"]) == 0
        docs[mode] = json.loads(capsys.readouterr().out)
    assert docs["spec"]["token_ids"] == docs["ar"]["token_ids"] and len(docs["ar"]["token_ids"]) >= 1


def test_caps_declare_what_it_lacks_and_calls_past_them_are_refused(built):
    from specdec_rt.errors import InferenceError, InvalidInputError
    from specdec_rt.ort import ConcatKVModel, OrtTargetVerifier
    from specdec_rt.speculation.protocols import ModelCaps

    model = ConcatKVModel(built.folder, max_length=32, slots=1, threads=1, provider="cpu")
    assert model.caps == ModelCaps()  # no batched steps, packed rows, prefix cache, trees, hidden states
    s = model.start()
    with pytest.raises(InferenceError, match="all 1 slots"):
        model.start()
    with pytest.raises(InferenceError, match="tree"):
        s.run_sync(np.array([1, 2]), 2, 0, tree=np.array([-1, 0]))
    with pytest.raises(InferenceError, match="past=3"):
        s.run_sync(np.array([1]), 1, 3)
    with pytest.raises(InvalidInputError, match="hidden"):
        OrtTargetVerifier(model, share_hidden=True)
    s.close()
    model.close()


def test_options_only_the_native_builder_has_are_refused_by_name(tmp_path):
    from export.errors import UsageError
    from export.pipeline import Request, run
    from export.ui import Reporter

    ckpt = build_tiny_checkpoint(tmp_path / "ckpt", "gpt_neo")
    for option in ({"quantize": "int8"}, {"draft_quant": "int4"}, {"kv_dtype": "float16"}):
        with pytest.raises(UsageError, match="gpt_neo is built through optimum"):
            run(Request(src=str(ckpt), out=tmp_path / "o", **option), Reporter(quiet=True))
        assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("family", "why"), [("gemma3", "multimodal"), ("bart", "encoder-decoder"), ("mbart", "encoder-decoder")]
)
def test_families_optimum_exports_but_the_runtime_has_no_place_for_stay_refused(tmp_path, capsys, family, why):
    from transformers import AutoConfig

    from export.cli import main

    src = tmp_path / family
    src.mkdir()
    (src / "config.json").write_text(json.dumps(AutoConfig.for_model(family).to_dict()))
    assert main([str(src), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert f"unsupported architecture {family} (" in err and why in err


def test_a_draft_model_built_through_optimum_drafts_exactly(tmp_path):
    from specdec_rt import Engine

    target = build_tiny_checkpoint(tmp_path / "t", "gpt_neo", seed=0)
    draft = build_tiny_checkpoint(tmp_path / "d", "gpt_neo", seed=1, layers=1)
    from export.pipeline import Request, run
    from export.ui import Reporter

    out = tmp_path / "onnx"
    run(Request(src=str(target), out=out, draft=str(draft), threads=1), Reporter(quiet=True))
    m = _manifest(out)
    sub = out / m["drafts"][0]["path"]
    assert _manifest(sub)["builder"] == "optimum" and _manifest(sub)["role"] == "draft"
    prompt = [9, 10, 11, 12, 13, 9, 10, 11]

    async def go():
        async with await Engine.load(out, draft=m["drafts"][0]["name"], slots=1, threads=1) as engine:
            ar = await engine.generate(prompt, 20, mode="ar", ignore_eos=True)
            spec = await engine.generate(prompt, 20, mode="spec", ignore_eos=True)
            return ar, spec

    ar, spec = _run(go())
    assert spec.token_ids == ar.token_ids
    assert spec.stats.drafted > spec.stats.accepted  # rejections: the draft rolled back


def test_a_hostile_optimum_manifest_is_refused_at_load(built, tmp_path):
    from specdec_rt.errors import ModelLoadError
    from specdec_rt.ort import load_manifest

    cases = {
        "builder": lambda m: m.update(builder="bogus"),
        "KV layout": lambda m: m["onnx"]["kv"].update(layout="BNSH", shared_buffer=True),
        "attention_mask": lambda m: m["onnx"]["inputs"].pop("attention_mask"),
        "float32": lambda m: m["onnx"]["kv"].update(dtype="float16"),
        "outside": lambda m: m["onnx"].update(file="../model.onnx"),
    }
    for i, (what, change) in enumerate(cases.items()):
        folder = tmp_path / str(i)
        shutil.copytree(built.folder, folder)
        m = _manifest(folder)
        change(m)
        (folder / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(ModelLoadError, match=what):
            load_manifest(folder, verify_hashes="never")


@pytest.mark.parametrize("layout", ["embedded", "one data file"])
def test_optimums_graph_is_placed_as_model_onnx_and_its_data_file(tmp_path, layout):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from export.optimum_path import DATA, GRAPH, place_graph

    weight = np.arange(64, dtype=np.float32).reshape(8, 8)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
        [numpy_helper.from_array(weight, "w")],
    )
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    if layout == "embedded":
        onnx.save_model(model, str(work / GRAPH))
    else:  # as optimum writes a model over 2 GB
        onnx.save_model(
            model, str(work / GRAPH), save_as_external_data=True, location="model.onnx_data", size_threshold=0
        )
    place_graph(work, out)
    assert sorted(p.name for p in out.iterdir()) == [GRAPH, DATA]
    stored = onnx.load(str(out / GRAPH), load_external_data=False).graph.initializer[0]
    assert {e.key: e.value for e in stored.external_data}["location"] == DATA
    loaded = onnx.load(str(out / GRAPH)).graph.initializer[0]  # (ONNX Runtime may hold a global pool here)
    assert np.array_equal(numpy_helper.to_array(loaded), weight)
