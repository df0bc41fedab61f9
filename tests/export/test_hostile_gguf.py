"""Issue 11, item 3: a tiny GGUF can claim a huge model. The header's counts are checked
against the bytes in the file, and the architecture metadata against the tensor index and the
machine's memory, before transformers loads anything: one line, in milliseconds."""

from __future__ import annotations

import struct
import time

import pytest

pytest.importorskip("gguf")
pytest.importorskip("onnx")  # export.cli's pipeline imports the graph builder

from gguf_bytes import kv_offset, patch_kv, write_model_gguf  # noqa: E402

from export import gguf_meta  # noqa: E402
from export.cli import main  # noqa: E402
from export.errors import CorruptSourceError, InsufficientMemoryError  # noqa: E402
from export.gguf_meta import check_model, machine_memory, read_gguf_info  # noqa: E402
from export.source import open_source  # noqa: E402

pytestmark = pytest.mark.export


@pytest.fixture
def good(tmp_path):
    return write_model_gguf(tmp_path / "good.gguf")


def _patched(tmp_path, good, key, value, name="bad.gguf"):
    path = tmp_path / name
    path.write_bytes(patch_kv(good.read_bytes(), key, value))
    return path


def _one_line(capsys, path, out, *fragments):
    t0 = time.perf_counter()
    assert main([str(path), "--out", str(out)]) == 1
    assert time.perf_counter() - t0 < 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("export: error: ") and "internal" not in err[0]
    for f in fragments:
        assert f in err[0], err[0]
    assert not out.exists()


def test_consistent_gguf_passes(good):
    assert open_source(good).family == "llama"
    check_model(read_gguf_info(good), good)


def test_tiny_real_gguf_claiming_200000_blocks_fails_fast(tmp_path, capsys):
    """Was: ran for minutes, then died with std::bad_alloc."""
    from tiny_models import build_tiny_gguf

    real = build_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    bad = _patched(tmp_path, real, "llama.block_count", 200000)
    t0 = time.perf_counter()
    with pytest.raises(CorruptSourceError, match="block_count = 200000"):
        open_source(bad)
    assert time.perf_counter() - t0 < 1
    _one_line(capsys, bad, tmp_path / "o", "block_count = 200000")


@pytest.mark.parametrize(
    "key,value,fragment",
    [
        ("llama.block_count", 3, "tensor index has 2 blocks (block 2 is missing)"),
        ("llama.block_count", 1, "tensor index has 2 blocks"),
        ("llama.block_count", 0, "block_count = 0"),
        ("llama.embedding_length", 16, "token_embd.weight"),
        ("llama.embedding_length", 2**31, "embedding_length"),
        ("llama.vocab_size", 99, "vocabulary 99"),
        ("llama.feed_forward_length", 32, "blk.0.ffn_up.weight"),
        ("llama.attention.head_count_kv", 4, "KV heads"),
        ("llama.attention.head_count", 10**6, "head_count"),
        ("tokenizer.ggml.tokens", 17, "GGUF"),
    ],
)
def test_metadata_must_match_the_tensor_index(tmp_path, good, capsys, key, value, fragment):
    bad = _patched(tmp_path, good, key, value)
    with pytest.raises(CorruptSourceError, match="GGUF"):
        open_source(bad)
    _one_line(capsys, bad, tmp_path / "o", fragment)


@pytest.mark.parametrize(
    "key,value",
    [
        ("tokenizer.ggml.token_type", 2**61),  # a kept array: was f.read(2**63) -> OverflowError
        ("tokenizer.ggml.token_type", 2**40),  # was MemoryError
        ("tokenizer.ggml.tokens", 2**62),
        ("general.alignment", 0),  # was ZeroDivisionError
        ("general.alignment", 3),
    ],
)
def test_counts_are_checked_against_the_file(tmp_path, good, capsys, key, value):
    bad = _patched(tmp_path, good, key, value)
    t0 = time.perf_counter()
    with pytest.raises(CorruptSourceError):
        read_gguf_info(bad)
    assert time.perf_counter() - t0 < 1
    _one_line(capsys, bad, tmp_path / "o", "GGUF")


@pytest.mark.parametrize("which", ["n_tensors", "n_kv"])
def test_header_counts_larger_than_the_file(tmp_path, good, which):
    data = bytearray(good.read_bytes())
    struct.pack_into("<Q", data, 8 if which == "n_tensors" else 16, 10**15)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    t0 = time.perf_counter()
    with pytest.raises(CorruptSourceError, match="claims"):
        read_gguf_info(bad)
    assert time.perf_counter() - t0 < 1


def test_too_many_tensor_dimensions(tmp_path, good):
    data = bytearray(good.read_bytes())
    name = b"token_embd.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    struct.pack_into("<I", data, at, 2**31)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(CorruptSourceError, match="dimensions"):
        read_gguf_info(bad)


def test_model_larger_than_the_machine(tmp_path, good, capsys, monkeypatch):
    assert machine_memory() > 0
    monkeypatch.setattr(gguf_meta, "machine_memory", lambda: 1 << 20)
    with pytest.raises(InsufficientMemoryError, match="needs about 1.0 GiB"):
        open_source(good)
    _one_line(capsys, good, tmp_path / "o", "this machine has 0.0 GiB")


def test_kv_offset_finds_the_value(good):
    at, vtype = kv_offset(good.read_bytes(), "llama.block_count")
    assert vtype == 4 and struct.unpack_from("<I", good.read_bytes(), at)[0] == 2
