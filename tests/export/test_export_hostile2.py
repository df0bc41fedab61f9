"""Hostile inputs to `python -m export`, second round: an --out folder with someone else's
manifest.json (never deleted), manifests that are devices / FIFOs / bombs, invalid numbers in
configs and GGUF metadata, very short contexts, non-finite logits, multi-line library errors,
and hostile trained-head .npz files. Each is one line from the exporter's error root."""

from __future__ import annotations

import io
import json
import math
import os
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("gguf")

from gguf_bytes import patch_kv, write_model_gguf  # noqa: E402

from export.cli import main  # noqa: E402
from export.errors import (  # noqa: E402
    CorruptSourceError,
    ExportError,
    UnsupportedModelError,
    ValidationError,
    one_line,
    one_line_errors,
)
from export.manifest import MAX_MANIFEST_BYTES, is_export_manifest, read_manifest, write_manifest  # noqa: E402

pytestmark = pytest.mark.export


def _one_line(capsys, argv, code, *fragments) -> str:
    assert main(argv) == code
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert lines and lines[-1].startswith("export: error: "), captured.err
    assert [line for line in lines if line.startswith("export: error: ")] == lines[-1:]
    assert "internal error" not in lines[-1], lines[-1]
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]
    return lines[-1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tiny_models import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "c", "llama", layers=1, max_positions=64)


# ---- 1. an --out folder that is not ours is never replaced ----------------------------------


def _webapp(folder: Path, manifest) -> dict[Path, bytes]:
    (folder / "src").mkdir(parents=True)
    files = {
        folder / "manifest.json": json.dumps(manifest).encode(),
        folder / "src" / "app.js": b"console.log('hi')\n",
        folder / "NOTES.md": b"my notes\n",
    }
    for path, data in files.items():
        path.write_bytes(data)
    return files


@pytest.mark.parametrize(
    "manifest",
    [
        {"name": "My App", "short_name": "app", "start_url": "/", "display": "standalone"},
        {"schema_version": 1, "files": {}, "build": {}},  # ours have an exporter version and more
        {"schema_version": 1, "name": "x", "role": "target", "architecture": {}, "files": {}, "build": {"exporter": 3}},
        [1, 2, 3],
    ],
)
def test_a_web_app_with_a_manifest_json_is_not_deleted(capsys, tmp_path, ckpt, manifest):
    """Was: any folder whose manifest.json parsed as JSON was renamed and rmtree'd."""
    out = tmp_path / "victim" / "webapp"
    files = _webapp(out, manifest)
    for force in ([], ["--force"]):
        _one_line(capsys, [str(ckpt), "--out", str(out), "--no-validate", *force], 2, str(out), "not an export folder")
        assert {p: p.read_bytes() for p in files} == files
        assert sorted(p.name for p in out.parent.iterdir()) == ["webapp"]


def test_is_export_manifest_matches_what_the_exporter_writes():
    ours = {
        "schema_version": 1,
        "name": "m",
        "role": "target",
        "architecture": {},
        "files": {},
        "build": {"exporter": "0.4.0"},
    }
    assert is_export_manifest(ours)
    assert is_export_manifest({**ours, "role": "draft", "kind": "eagle"})
    for bad in (
        {**ours, "schema_version": True},
        {**ours, "schema_version": 99},
        {**ours, "role": "app"},
        {**ours, "files": []},
        {**ours, "build": None},
        {k: v for k, v in ours.items() if k != "architecture"},
        None,
        "x",
    ):
        assert not is_export_manifest(bad), bad


def test_an_earlier_export_is_still_replaced(tmp_path):
    from export.pipeline import _check_out

    out = tmp_path / "o"
    out.mkdir()
    (out / "manifest.json").write_text(
        json.dumps(
            {
                "schema_version": 1,
                "name": "m",
                "role": "target",
                "architecture": {},
                "files": {},
                "build": {"exporter": "0.1"},
            }
        )
    )
    _check_out(out)  # no error: an export folder may be rebuilt
    _check_out(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    _check_out(tmp_path / "empty")


# ---- 2. read_manifest reads a small regular file only ----------------------------------------


@pytest.mark.parametrize("kind", ["devzero", "fifo", "symlink", "huge", "deep", "binary", "list"])
def test_read_manifest_refuses_hostile_files(tmp_path, kind):
    folder = tmp_path / "o"
    folder.mkdir()
    path = folder / "manifest.json"
    if kind == "devzero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)  # opening it for reading would block forever without O_NONBLOCK
    elif kind == "symlink":
        (tmp_path / "elsewhere.json").write_text('{"schema_version": 1}')
        path.symlink_to(tmp_path / "elsewhere.json")
    elif kind == "huge":
        path.write_text('{"a": "' + "x" * MAX_MANIFEST_BYTES + '"}')
    elif kind == "deep":
        path.write_text("[" * 100000 + "]" * 100000)
    elif kind == "binary":
        path.write_bytes(b"\xff\xfe{}")
    else:
        path.write_text("[1]")
    assert read_manifest(folder) is None


@pytest.mark.parametrize("kind", ["devzero", "deep"])
def test_out_with_a_hostile_manifest_is_one_line(capsys, tmp_path, ckpt, kind):
    """Was: internal error: MemoryError / RecursionError."""
    out = tmp_path / "o"
    out.mkdir()
    if kind == "devzero":
        (out / "manifest.json").symlink_to("/dev/zero")
    else:
        (out / "manifest.json").write_text('{"a":' * 100000 + "1" + "}" * 100000)
    _one_line(capsys, [str(ckpt), "--out", str(out), "--no-validate"], 2, "not an export folder")
    assert (out / "manifest.json").is_symlink() or (out / "manifest.json").stat().st_size > 100000


def test_write_manifest_never_writes_nan(tmp_path):
    write_manifest(tmp_path, {"validation": {"logit_correlation": float("nan"), "x": [float("inf"), 1.5]}, "files": {}})
    text = (tmp_path / "manifest.json").read_text()
    assert json.loads(text, parse_constant=lambda c: pytest.fail(c))["validation"] == {
        "logit_correlation": None,
        "x": [None, 1.5],
    }


# ---- 3. invalid numbers in configs and GGUF metadata -----------------------------------------


def _config(**kw):
    from transformers import LlamaConfig

    base = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaConfig(**{**base, **kw})


@pytest.mark.parametrize(
    "kw,fragment",
    [
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps nan"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps -1.0"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps 0.0"),
        ({"rope_theta": float("nan")}, "rope_theta nan"),
        ({"rope_theta": 0.0}, "rope_theta 0.0"),
        ({"rope_theta": -10000.0}, "rope_theta -10000.0"),
        ({"num_key_value_heads": 3}, "num_key_value_heads 3"),
        ({"max_position_embeddings": 1}, "context of 1 positions"),
    ],
)
def test_config_numbers_are_checked(kw, fragment):
    pytest.importorskip("transformers")
    from export.model_spec import ModelSpec

    ModelSpec.from_config(_config())  # the base is fine
    with pytest.raises(UnsupportedModelError) as exc:
        ModelSpec.from_config(_config(**kw))
    assert fragment in str(exc.value)


def _float_gguf(path: Path, eps: float = 1e-5, rope: float = 10000.0) -> Path:
    """write_model_gguf's file plus an RMSNorm epsilon and a rotary base."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(rope)
    w.add_layer_norm_rms_eps(eps)
    w.add_vocab_size(16)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(16)])
    w.add_token_types([1] * 16)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((16, 8), dtype=np.float32))
    for i in range(2):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    "key,value",
    [
        ("llama.attention.layer_norm_rms_epsilon", float("nan")),
        ("llama.attention.layer_norm_rms_epsilon", -1.0),
        ("llama.rope.freq_base", float("nan")),
        ("llama.rope.freq_base", 0.0),
        ("llama.rope.freq_base", -10000.0),
    ],
)
def test_gguf_float_metadata_is_checked(capsys, tmp_path, key, value):
    from export.source import open_source

    good = _float_gguf(tmp_path / "good.gguf")
    open_source(good)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(patch_kv(good.read_bytes(), key, value))
    with pytest.raises(CorruptSourceError, match=f"{key} = {value!r}"):
        open_source(bad)
    _one_line(capsys, [str(bad), "--out", str(tmp_path / "o")], 1, key)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "patches,fragment",
    [
        ({"llama.attention.head_count": 3}, "embedding_length = 8 is not a multiple of llama.attention.head_count = 3"),
        (
            {"llama.attention.head_count": 4, "llama.attention.head_count_kv": 3},
            "head_count = 4 is not a multiple of llama.attention.head_count_kv = 3",
        ),
        ({"llama.context_length": 1}, "context_length = 1"),
    ],
)
def test_gguf_head_counts_and_context(capsys, tmp_path, patches, fragment):
    data = write_model_gguf(tmp_path / "good.gguf").read_bytes()
    for key, value in patches.items():
        data = patch_kv(data, key, value)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data)
    _one_line(capsys, [str(bad), "--out", str(tmp_path / "o")], 1, fragment)


# ---- 4. very short contexts ------------------------------------------------------------------


@pytest.mark.parametrize("positions", [2, 3, 5, 8])
def test_very_short_contexts_validate(tmp_path, ckpt, positions):
    """Was: ValueError: sequence of N tokens exceeds the cache (M) from the rejected verify."""
    from export.pipeline import Request, run
    from export.ui import Reporter

    out = tmp_path / "o"
    result = run(Request(src=str(ckpt), out=out, max_positions=positions, threads=1), Reporter(quiet=True))
    m = read_manifest(result.out)
    assert m["architecture"]["max_positions"] == positions
    assert m["validation"]["rows"] >= 2


@pytest.mark.parametrize("positions", ["1", "0", "-3"])
def test_max_positions_below_two_is_a_usage_error(capsys, tmp_path, ckpt, positions):
    _one_line(
        capsys,
        [str(ckpt), "--out", str(tmp_path / "o"), "--max-positions", positions],
        2,
        "--max-positions must be an integer of at least 2",
    )
    assert not (tmp_path / "o").exists()


# ---- 5. non-finite or absurd logits fail validation; no NaN in a manifest --------------------


class _FakeSession:
    """Stands in for KVSession: returns `table[pos:pos + n]` (the rows asked for)."""

    table: np.ndarray

    def __init__(self, model_dir, manifest, max_len, threads=None):
        self.max_len = max_len

    def forward(self, ids, pos, rows=None):
        assert pos + len(ids) <= self.max_len, "sequence exceeds the cache"
        out = self.table[pos : pos + len(ids)]
        return out if rows is None else out[rows]

    def close(self):
        self.closed = True


def _validate(monkeypatch, tmp_path, got, ref, **kw):
    from export import validate

    monkeypatch.setattr(validate, "KVSession", _FakeSession)
    _FakeSession.table = got
    manifest = {"architecture": {"vocab_size": ref.shape[1], "max_positions": len(ref)}}
    return validate.validate_graph(tmp_path, manifest, np.arange(len(ref)), ref, prompt_len=4, **kw)


def test_validation_fails_on_nan_onnx_logits(monkeypatch, tmp_path):
    """Was: ValueError: zero-size array to reduction operation maximum (NaN rows dropped)."""
    ref = np.random.default_rng(0).standard_normal((10, 16)).astype(np.float32)
    got = np.full_like(ref, np.nan)
    with pytest.raises(ValidationError, match="ONNX logits are not finite"):
        _validate(monkeypatch, tmp_path, got, ref)
    report = _validate(monkeypatch, tmp_path, got, ref, raise_on_fail=False)
    assert not report.passed
    json.dumps(report.manifest(), allow_nan=False)


def test_validation_fails_on_absurd_logits(monkeypatch, tmp_path):
    """Was: the misaligned GGUF passed with logits ~1e37 and "logit_correlation": NaN."""
    ref = (np.random.default_rng(0).standard_normal((10, 16)) * 1e37).astype(np.float32)
    with pytest.raises(ValidationError, match="magnitude"):
        _validate(monkeypatch, tmp_path, ref.copy(), ref)
    report = _validate(monkeypatch, tmp_path, ref.copy(), ref, raise_on_fail=False)
    record = report.manifest()
    json.dumps(record, allow_nan=False)
    assert math.isfinite(record["logit_correlation"])


def test_validation_short_cache_skips_the_garbage_verify(monkeypatch, tmp_path):
    ref = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)
    report = _validate(monkeypatch, tmp_path, ref.copy(), ref)
    assert report.passed and report.rows == 5


# ---- 6. library errors become one line -------------------------------------------------------


def test_multi_line_library_errors_become_one_line(monkeypatch, tmp_path, capsys):
    pytest.importorskip("transformers")
    import transformers

    from export.source import Source

    def boom(*a, **k):
        raise RuntimeError("Error(s) in loading state_dict for Linear:\n\tsize mismatch for weight")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", boom)
    src = Source(
        kind="folder", folder=tmp_path, gguf_file=None, family="llama", label="x"
    )  # a GGUF would be read before the loader runs
    with pytest.raises(CorruptSourceError) as exc:
        src.load_model()
    assert "\n" not in str(exc.value) and "Linear: size mismatch" in str(exc.value)

    def work():
        raise CorruptSourceError("two\nlines")

    assert one_line_errors(work, False) == (None, 1)
    assert capsys.readouterr().err == "export: error: two lines\n"
    assert one_line("a\n\tb" + "x" * 1000, 20) == "a b" + "x" * 14 + "..."


# ---- 7. hostile trained-head .npz files ------------------------------------------------------

CFG = {
    "hidden_size": 8,
    "num_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 4,
    "intermediate_size": 16,
    "rms_eps": 1e-5,
    "draft_vocab": 10,
    "target_vocab_size": 32,
}


def _head_arrays(cfg=CFG) -> dict[str, np.ndarray]:
    from export.draft.assemble import _head_shapes

    rng = np.random.default_rng(0)
    arrays = {k: rng.standard_normal(s).astype(np.float16) for k, s in _head_shapes(cfg).items()}
    arrays["vocab"] = np.arange(10, dtype=np.int32)
    arrays["config"] = np.frombuffer(json.dumps(cfg).encode(), np.uint8)
    return arrays


def _write_npz(path: Path, arrays: dict, members: dict[str, bytes] | None = None) -> Path:
    buf = io.BytesIO()
    np.savez(buf, **arrays, allow_pickle=True) if any(a.dtype.hasobject for a in arrays.values()) else np.savez(
        buf, **arrays
    )
    items = {}
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        for name in z.namelist():
            items[name] = z.read(name)
    items.update(members or {})
    with zipfile.ZipFile(path, "w") as z:
        for name, data in items.items():
            z.writestr(name, data)
    return path


def _npy_header(shape, descr="<f2") -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue()


def test_a_valid_head_round_trips(tmp_path):
    from export.draft.assemble import load_head, save_head

    arrays = _head_arrays()
    weights = {k: arrays[k].astype(np.float32) for k in arrays if k not in ("vocab", "config")}
    path = save_head(tmp_path / "head.npz", weights, arrays["vocab"], CFG)
    got, vocab, cfg = load_head(path)
    assert cfg == CFG and vocab.dtype == np.int64 and vocab.tolist() == list(range(10))
    for k, w in weights.items():
        assert got[k].dtype == np.float32 and np.array_equal(got[k], w)


def _hostile(case: str, path: Path) -> Path:
    arrays = _head_arrays()
    members = {}
    if case == "missing_key":
        del arrays["gate"]
    elif case == "empty_vocab":
        arrays["vocab"] = np.zeros(0, np.int32)
    elif case == "negative_vocab":
        arrays["vocab"] = np.array([3, -1], np.int32)
    elif case == "config_not_json":
        arrays["config"] = np.frombuffer(b"\xff\xfe", np.uint8)
    elif case == "config_deep":
        arrays["config"] = np.frombuffer(b"[" * 100000 + b"]" * 100000, np.uint8)
    elif case == "config_no_hidden":
        arrays["config"] = np.frombuffer(json.dumps({**CFG, "hidden_size": None}).encode(), np.uint8)
    elif case == "config_nan_eps":
        arrays["config"] = np.frombuffer(
            b'{"hidden_size": 8, "num_heads": 2, "num_kv_heads": 1, '
            b'"head_dim": 4, "intermediate_size": 16, "rms_eps": NaN}',
            np.uint8,
        )
    elif case == "object_array":
        arrays["fc"] = np.array([{"a": 1}], dtype=object)
    elif case == "wrong_shape":
        arrays["q"] = np.zeros((4, 4), np.float16)
    elif case == "int_weights":
        arrays["q"] = np.zeros((8, 8), np.int64)
    elif case == "huge_header":  # claims 2**40 float32s, holds 64 bytes
        members["fc.npy"] = _npy_header((1 << 40,), "<f4") + b"\0" * 64
    elif case == "huge_matching_config":  # a config sized for a 4 TiB head
        cfg = {**CFG, "hidden_size": 1 << 16, "intermediate_size": 1 << 20}
        arrays["config"] = np.frombuffer(json.dumps(cfg).encode(), np.uint8)
    elif case == "short_member":  # the right header, half the data
        members["fc.npy"] = _npy_header((8, 16)) + b"\0" * 128
    elif case == "not_a_zip":
        path.write_bytes(b"\x93NUMPY garbage")
        return path
    return _write_npz(path, arrays, members)


@pytest.mark.parametrize(
    "case,fragment",
    [
        ("missing_key", "no 'gate' array"),
        ("empty_vocab", "'vocab' is <i4 [0]"),
        ("negative_vocab", "negative token id -1"),
        ("config_not_json", "'config' is not JSON"),
        ("config_deep", "'config' is not JSON (maximum recursion"),
        ("config_no_hidden", "config hidden_size = None"),
        ("config_nan_eps", "config rms_eps = nan"),
        ("object_array", "'fc' is |O [1]"),
        ("wrong_shape", "'q' is <f2 [4, 4], expected float16 [8, 8]"),
        ("int_weights", "'q' is <i8 [8, 8]"),
        ("huge_header", "'fc' is <f4 [1099511627776]"),
        ("huge_matching_config", "more than"),
        ("short_member", "'fc' declares [8, 16] (256 bytes) but its zip member holds 128"),
        ("not_a_zip", "not a readable trained head"),
    ],
)
def test_hostile_heads_are_one_clear_error(tmp_path, case, fragment):
    """Was: KeyError, ValueError, UnicodeDecodeError, MemoryError 'Unable to allocate 4.00 TiB'."""
    import resource

    from export.draft.assemble import assemble_draft

    path = _hostile(case, tmp_path / "head.npz")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CorruptSourceError) as exc:
        assemble_draft(tmp_path / "no-target", path, tmp_path / "draft")
    msg = str(exc.value)
    assert isinstance(exc.value, ExportError) and "\n" not in msg
    assert str(path) in msg and fragment in msg, msg
    assert not (tmp_path / "draft").exists()
    grew_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert sys.platform != "linux" or grew_mb < 200
