"""Packed graphs: the rows of a batched call, several new positions each, in one ONNX Runtime call.

A batched verify must give every row the logits it gets alone, leave the slots between the rows
as they were, and cost its real positions (the MatMuls run on packed positions). An export from
before packed rows (or from exporter 0.2, packed rows without positions and an attention bias)
is refused at load with one line that says to rebuild it with python -m export.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from export.graph import TREE_ROLES
from specdec_rt import Engine
from specdec_rt.errors import ModelLoadError
from specdec_rt.ort.manifest import PACKED_ROLES
from specdec_rt.ort.model import OrtModel, _packed_layout
from specdec_rt.policy.config import SpecConfig


def _kv(model: OrtModel, slot: int) -> list[np.ndarray]:
    return [buf.array[slot].copy() for pair in model.pool._buffers for buf in pair]


def _alone(folder: Path, prefix: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Logits of every position of ``new`` after ``prefix``, one row, in a fresh model."""
    model = OrtModel(folder, max_length=64, slots=1, threads=1)
    s = model.start()
    s.run_sync(prefix, 1, 0)
    return s.run_sync(new, new.size, prefix.size)  # [S, V]


def test_layout_is_a_permutation_of_the_real_positions():
    news = np.array([3, 0, 1, 2])
    q, pad, pack, shape = _packed_layout(news)
    assert q.tolist() == [3, 0, 1, 2] and shape.tolist() == [4, 3, -1]
    rows = pad.reshape(4, 3)
    assert rows[0].tolist() == [0, 1, 2] and rows[2, 0] == 3 and rows[3, :2].tolist() == [4, 5]
    assert sorted(pad[pack].tolist()) == list(range(6))  # pack then pad: every packed position once
    assert pad[pack].tolist() == list(range(6))


def test_rows_of_several_positions_equal_each_row_alone(tiny_llama):
    model = OrtModel(tiny_llama, max_length=64, slots=4, threads=1)
    assert model.ragged
    rng = np.random.default_rng(3)
    toks = rng.integers(3, model.vocab_size, size=(4, 30))
    s = [model.start() for _ in range(4)]
    # prompts of different lengths in one call, slot 1 in between feeding nothing
    model.run_rows_sync([s[0], s[2], s[3]], [toks[0, :9], toks[2, :4], toks[3, :17]], [1, 1, 1])
    model.run_rows_sync([s[1]], [toks[1, :6]], [1])
    before = _kv(model, 1)
    # a verify of 3 positions, a plain step and a 5-position verify, session order != slot order
    feeds = [toks[3, 17:22], toks[0, 9:10], toks[2, 4:7]]
    out = model.run_rows_sync([s[3], s[0], s[2]], feeds, [5, 1, 2])
    assert [x.shape[0] for x in out] == [5, 1, 2]
    assert [x.length for x in s] == [10, 6, 7, 22]
    for got, row, past, feed, want in zip(out, (3, 0, 2), (17, 9, 4), feeds, (5, 1, 2)):
        ref = _alone(tiny_llama, toks[row, :past], feed)[-want:]
        np.testing.assert_allclose(got, ref, atol=1e-4)
        assert (got.argmax(-1) == ref.argmax(-1)).all()
    assert all(np.array_equal(a, b) for a, b in zip(before, _kv(model, 1)))  # untouched


def _unpack(src: Path, dst: Path) -> Path:
    """A copy of a packed export as an export from before packing: the pack/unpack nodes and the
    packed (and tree) inputs removed, the manifest's roles and file hashes updated."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("draft-*", ".specdec-verified.json"))
    m = onnx.load(str(dst / "model.onnx"), load_external_data=False)
    g = m.graph
    producer = {o: n for n in g.node for o in n.output}
    keep, rename = [], {}
    for n in g.node:
        if n.name.endswith(("/Unpack", "/UnpackReshape", "/PackReshape", "/Pack")) or n.name.startswith("/positions/"):
            continue
        if n.op_type == "GroupQueryAttention":
            del n.input[9:]
            n.input[0] = producer[producer[n.input[0]].input[0]].input[0]  # qkv, before unpacking
            rename[n.name.replace("GroupQueryAttention", "output")] = n.output[0]
        keep.append(n)
    for n in keep:
        for i, name in enumerate(n.input):
            n.input[i] = rename.get(name, name)
    del g.node[:]
    g.node.extend(keep)
    inputs = [i for i in g.input if i.name not in PACKED_ROLES + TREE_ROLES]
    del g.input[:]
    g.input.extend(inputs)
    onnx.save(m, str(dst / "model.onnx"))
    manifest = json.loads((dst / "manifest.json").read_text())
    for role in PACKED_ROLES + TREE_ROLES:
        manifest["onnx"]["inputs"].pop(role)
    manifest["drafts"] = []
    data = (dst / "model.onnx").read_bytes()
    manifest["files"]["model.onnx"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def _without_tree_inputs(src: Path, dst: Path) -> Path:
    """An exporter 0.2 manifest: packed rows, but no positions and no attention bias."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("draft-*", ".specdec-verified.json"))
    manifest = json.loads((dst / "manifest.json").read_text())
    for role in TREE_ROLES:
        manifest["onnx"]["inputs"].pop(role)
    manifest["drafts"] = []
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


@pytest.mark.parametrize(("make", "missing"), [(_unpack, "query_seqlens"), (_without_tree_inputs, "position_ids")])
def test_an_export_from_before_packed_rows_is_refused_in_one_line(tiny_llama, tmp_path, make, missing):
    old = make(tiny_llama, tmp_path / "old")
    with pytest.raises(ModelLoadError) as info:
        OrtModel(old, max_length=64, slots=1, threads=1)
    assert str(info.value) == (
        f"{old / 'manifest.json'}: exported before packed rows (no onnx.inputs.{missing}); "
        "rebuild the folder with: python -m export"
    )
    with pytest.raises(ModelLoadError, match="exported before packed rows"):
        asyncio.run(Engine.load(old, draft="ngram", slots=1))


def test_a_manifest_that_does_not_name_a_graph_input_says_rebuild(tiny_llama, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama, bad, ignore=shutil.ignore_patterns("draft-*", ".specdec-verified.json"))
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["onnx"]["inputs"].pop("pad_index")
    manifest["drafts"] = []
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelLoadError, match="pad_index.*rebuild"):
        OrtModel(bad, max_length=32, slots=1, threads=1)


@pytest.mark.parametrize("draft", ["q4", "ngram+q4"])
def test_concurrent_speculative_requests_verify_in_one_call_and_match_alone(tiny_llama, draft):
    """Costs not measured (every request speculates as if alone): the verifies of concurrent
    requests meet in the step loop and run as one packed call; greedy outputs equal each alone."""
    prompts = [f"prompt number {i} " * (i + 1) for i in range(4)]

    async def go():
        engine = await Engine.load(
            tiny_llama, draft=draft, slots=4, spec_config=SpecConfig(measure_costs=False, adapt_k=False, k_init=3)
        )
        calls, multi = [], []
        engine.executor.listeners.append(lambda model, rows, s: calls.append((model is engine.target, rows)))
        rows_sync = engine.target.run_rows_sync

        def spy(sessions, feeds, wants):  # several rows with a past, one of several positions: verifies
            if len(sessions) > 1 and max(f.size for f in feeds) > 1 and all(x.length for x in sessions):
                multi.append([f.size for f in feeds])
            return rows_sync(sessions, feeds, wants)

        engine.target.run_rows_sync = spy
        try:
            alone = [(await engine.generate(p, 16, mode="spec")).token_ids for p in prompts]
            calls.clear()
            together = await asyncio.gather(*[engine.generate(p, 16, mode="spec") for p in prompts])
            plain = [(await engine.generate(p, 16, mode="ar")).token_ids for p in prompts]
        finally:
            await engine.aclose()
        return alone, [r.token_ids for r in together], plain, calls, multi

    alone, together, plain, calls, multi = asyncio.run(go())
    assert together == alone == plain
    assert any(target and rows > 1 for target, rows in calls)
    assert multi, "no batched call of several positions per row"
