"""Prepacked copies (specdec_rt.ort.prepack): the same outputs as the export's own graph, built
once and mapped after, and a copy in the cache that was tampered with is refused and built again."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import numpy as np
import pytest

from specdec_rt import Engine
from specdec_rt.ort import OrtModel, prepack
from specdec_rt.ort.prepack import DATA, GRAPH, RECORD, copy_folder, prepack_key

PROMPT = np.array([5, 17, 42, 8, 99, 3, 64, 21], dtype=np.int64)


@pytest.fixture()
def every_graph(monkeypatch, tmp_path):
    """Copies of the tiny models too (they are under the size a copy is made for), in a folder
    of this test's own."""
    monkeypatch.setattr(prepack, "MIN_SOURCE_BYTES", 0)
    monkeypatch.setattr(prepack, "MIN_FREE_BYTES", 0)
    monkeypatch.setenv(prepack.PREPACK_DIR_ENV, str(tmp_path / "prepacked"))
    return tmp_path / "prepacked"


def greedy_logits(model: OrtModel, steps: int = 6) -> np.ndarray:
    """The last row of logits after the prompt and after each of ``steps`` greedy tokens."""
    session = model.start()
    try:
        rows = [session.run_sync(PROMPT, 1, 0)[-1]]
        for i in range(steps):
            token = np.array([int(rows[-1].argmax())], dtype=np.int64)
            rows.append(session.run_sync(token, 1, PROMPT.size + i)[-1])
        return np.stack(rows)
    finally:
        session.close()


def load(folder: Path, shared: bool) -> OrtModel:
    return OrtModel(folder, max_length=64, slots=1, threads=1, shared_weights=shared)


def the_copy(folder: Path) -> Path:
    model_file = folder / "model.onnx"
    level = "GraphOptimizationLevel.ORT_ENABLE_ALL"
    return copy_folder(prepack_key(model_file, level=level))


@pytest.mark.parametrize("which", ["target", "draft-q4"])
def test_the_copy_gives_the_same_logits(tiny_llama, every_graph, which):
    folder = tiny_llama if which == "target" else tiny_llama / "draft-q4"
    plain = load(folder, False)
    assert plain.prepacked is None
    expected = greedy_logits(plain)
    built = load(folder, True)
    assert built.prepacked is not None and built.prepacked.parent == the_copy(folder)
    assert built.prepacked.parent.parent == every_graph
    data = built.prepacked.parent / DATA
    first = os.stat(data)
    again = load(folder, True)  # found, not built again
    assert again.prepacked == built.prepacked and os.stat(data).st_ino == first.st_ino
    assert np.array_equal(greedy_logits(built), expected)
    assert np.array_equal(greedy_logits(again), expected)


def test_engine_greedy_tokens_are_the_same(tiny_llama, every_graph):
    async def tokens(shared: bool) -> list[int]:
        engine = await Engine.load(tiny_llama, draft="q4", slots=1, warmup=False, shared_weights=shared)
        try:
            assert all((m.prepacked is not None) == shared for m in engine.models)
            result = await engine.generate("hello there", max_new_tokens=24, temperature=0.0, seed=0)
            return list(result.token_ids)
        finally:
            await engine.aclose()

    assert asyncio.run(tokens(True)) == asyncio.run(tokens(False))


def test_small_graphs_and_old_runtimes_load_as_they_are(tiny_llama, monkeypatch, tmp_path):
    monkeypatch.setenv(prepack.PREPACK_DIR_ENV, str(tmp_path / "prepacked"))
    model = load(tiny_llama, True)  # under MIN_SOURCE_BYTES: no copy made
    assert model.prepacked is None and not (tmp_path / "prepacked").exists()
    monkeypatch.setattr(prepack, "MIN_SOURCE_BYTES", 0)
    monkeypatch.setattr(prepack, "MIN_ORT", (99, 0))  # an ONNX Runtime that would not map packed weights
    assert load(tiny_llama, True).prepacked is None and not (tmp_path / "prepacked").exists()


def _garble_data(copy: Path) -> None:
    with open(copy / DATA, "r+b") as f:  # the same size, other bytes
        f.seek(0)
        f.write(os.urandom(4096))


def _planted_data(copy: Path) -> None:
    elsewhere = copy.parent / "elsewhere.data"
    os.replace(copy / DATA, elsewhere)
    os.symlink(elsewhere, copy / DATA)


def _forged_key(copy: Path) -> None:
    record = json.loads((copy / RECORD).read_text())
    record["key"]["onnxruntime"] = "0.0.1"
    (copy / RECORD).write_text(json.dumps(record))


def _garbage_record(copy: Path) -> None:
    (copy / RECORD).write_bytes(b"\x00{not json" * 10)


def _extra_file(copy: Path) -> None:
    (copy / "model.onnx.data.1").write_bytes(b"x")


def _shared_mode(copy: Path) -> None:
    os.chmod(copy / GRAPH, 0o666)


def _other_graph(copy: Path) -> None:
    graph = (copy / GRAPH).read_bytes()
    (copy / GRAPH).write_bytes(graph[:-1] + bytes([graph[-1] ^ 1]))


def _linked_folder(copy: Path) -> None:
    real = copy.parent / "real-copy"
    os.replace(copy, real)
    os.symlink(real, copy)


@pytest.mark.parametrize(
    "tamper",
    [
        _garble_data,
        _planted_data,
        _forged_key,
        _garbage_record,
        _extra_file,
        _shared_mode,
        _other_graph,
        _linked_folder,
    ],
)
def test_a_tampered_copy_is_refused_and_built_again(tiny_llama, every_graph, tamper):
    folder = tiny_llama / "draft-q4"
    expected = greedy_logits(load(folder, False))
    copy = load(folder, True).prepacked
    assert copy is not None
    tamper(copy.parent)
    model = load(folder, True)
    assert model.prepacked == copy  # built again in its place
    assert os.path.isdir(copy.parent) and not os.path.islink(copy.parent)
    assert (
        prepack._refusal(copy.parent, prepack_key(folder / "model.onnx", level="GraphOptimizationLevel.ORT_ENABLE_ALL"))
        is None
    )
    assert np.array_equal(greedy_logits(model), expected)


def test_a_copy_onnx_runtime_cannot_load_is_removed(tiny_llama, every_graph, monkeypatch):
    folder = tiny_llama / "draft-q4"
    expected = greedy_logits(load(folder, False))
    copy = load(folder, True).prepacked
    assert copy is not None
    monkeypatch.setattr(prepack, "_refusal", lambda folder, key: None)  # every check passes
    copy.write_bytes(b"not a graph")  # but ONNX Runtime cannot parse it
    model = load(folder, True)
    assert model.prepacked is None and not copy.parent.exists()  # the export's own graph, the copy gone
    assert np.array_equal(greedy_logits(model), expected)


def test_an_unwritable_cache_costs_only_the_copy(tiny_llama, every_graph, monkeypatch):
    every_graph.parent.mkdir(exist_ok=True)
    every_graph.write_text("a file where the folder would be")
    model = load(tiny_llama, True)
    assert model.prepacked is None
    monkeypatch.setattr(prepack, "MIN_FREE_BYTES", 1 << 60)  # a disk too full
    every_graph.unlink()
    assert load(tiny_llama, True).prepacked is None
    assert not any(p.is_dir() and not p.name.startswith(".") for p in every_graph.iterdir())


def test_copies_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(prepack, "MAX_COPIES", 3)
    old = []
    for i in range(5):
        copy = tmp_path / f"m-{i}"
        copy.mkdir()
        (copy / RECORD).write_text("{}")
        (copy / DATA).write_bytes(b"x" * 100)
        os.utime(copy / RECORD, (1000 + i, 1000 + i))
        old.append(copy)
    stale = tmp_path / ".build-dead"
    stale.mkdir()
    os.utime(stale, (1, 1))
    fresh = tmp_path / ".build-alive"
    fresh.mkdir()
    prepack._prune(tmp_path, keep=old[0])  # the oldest, just used
    assert sorted(p.name for p in tmp_path.iterdir()) == [".build-alive", "m-0", "m-3", "m-4"]
    monkeypatch.setattr(prepack, "MAX_TOTAL_BYTES", 250)
    prepack._prune(tmp_path, keep=old[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == [".build-alive", "m-0", "m-4"]


def test_shared_weights_must_be_a_bool(tiny_llama):
    from specdec_rt.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="shared_weights"):
        asyncio.run(Engine.load(tiny_llama, shared_weights="yes"))


def test_a_load_waits_for_the_process_building_the_copy(tiny_llama, every_graph, monkeypatch):
    folder = tiny_llama / "draft-q4"
    monkeypatch.setattr(prepack, "LOCK_WAIT_S", 0.3)
    with prepack._BuildLock(the_copy(folder)) as held:  # another builder (flock: per open file)
        assert held
        assert load(folder, True).prepacked is None  # waited 0.3 s, then loaded the export's graph
    assert load(folder, True).prepacked == the_copy(folder) / GRAPH  # the lock free: built
