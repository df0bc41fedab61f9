"""Issue 11, item 2: a model folder is untrusted input. Every path its manifest names resolves
inside the folder (symlinks included) and errors say nothing about files outside; numbers and
KV name templates are bounded before use; malformed manifests and vocabulary maps are
`ModelLoadError`s; sha256 entries are verified once per folder (a stamp)."""

from __future__ import annotations

import io
import json
import os
import shutil
import time
import zipfile

import numpy as np
import pytest

from specdec_rt.errors import ModelLoadError
from specdec_rt.manifest_schema import STAMP_STAT
from specdec_rt.ort import manifest as manifest_mod
from specdec_rt.ort.eagle import load_vocab_map
from specdec_rt.ort.manifest import STAMP, load_manifest


@pytest.fixture
def model(tiny_llama, tmp_path):
    """A private copy of the tiny target (no drafts), an outside folder with a secret file."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder, ignore=shutil.ignore_patterns("draft-*"))
    secret = tmp_path / "outside" / "secret.bin"
    secret.parent.mkdir()
    secret.write_bytes(b"s" * 12345)
    man = json.loads((folder / "manifest.json").read_text())
    man["drafts"] = []

    def write(m=None):
        (folder / "manifest.json").write_text(json.dumps(man if m is None else m))
        return folder

    write()
    return {"folder": folder, "man": man, "write": write, "secret": secret}


def _fails(folder, *fragments) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_manifest(folder)
    msg = str(info.value)
    for f in fragments:
        assert f in msg, msg
    return msg


# ------------------------------------------------------------------ paths stay inside the folder
@pytest.mark.parametrize("field", ["tokenizer", "onnx"])
@pytest.mark.parametrize("kind", ["absolute", "dotdot"])
def test_named_files_must_be_inside_the_folder(model, field, kind):
    """Was: an absolute or ../ tokenizer.file / onnx.file was read from anywhere."""
    rel = str(model["secret"]) if kind == "absolute" else "../outside/secret.bin"
    model["man"][field]["file"] = rel
    msg = _fails(model["write"](), f"{field}.file", "points outside the model folder")
    assert "12345" not in msg


@pytest.mark.parametrize("rel", ["../outside/secret.bin", "ABS", "sub/../../outside/secret.bin"])
def test_files_entries_outside_reveal_nothing(model, rel):
    """Was: a files entry for a file outside was stat()ed and its size shown in the error."""
    rel = str(model["secret"]) if rel == "ABS" else rel
    model["man"]["files"][rel] = {"bytes": 1, "sha256": "0" * 64}
    msg = _fails(model["write"](), "files entry", "points outside")
    assert "12345" not in msg and "bytes" not in msg


@pytest.mark.parametrize("where", ["files", "tokenizer"])
def test_a_name_too_long_for_the_file_system_is_a_load_error(model, where):
    """Was: ``OSError: [Errno 36] File name too long`` out of ``Path.is_file`` (found by the
    manifest fuzz), outside the error root; now a ModelLoadError whose message stays short."""
    name = "x" * 300
    if where == "files":
        model["man"]["files"][name] = {"bytes": 1}
    else:
        model["man"]["tokenizer"]["file"] = name
    msg = _fails(model["write"](), "missing")
    assert len(msg) < 400


def test_symlink_out_of_the_folder_is_refused(model):
    folder = model["folder"]
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").symlink_to(model["secret"])
    msg = _fails(folder, "points outside")
    assert "12345" not in msg


def test_symlink_loop_is_a_load_error(model):
    folder = model["folder"]
    (folder / "loop").symlink_to(folder / "loop")
    model["man"]["tokenizer"]["file"] = "loop"
    _fails(model["write"](), "tokenizer.file")


@pytest.mark.parametrize("path", ["..", "../outside", "/tmp", ".", 7, None])
def test_draft_paths_must_be_inside_the_folder(model, path):
    model["man"]["drafts"] = [{"name": "evil", "path": path}]
    _fails(model["write"](), "drafts[0].path")


def test_draft_dir_is_checked_again(model):
    """A Manifest built by hand (not through load_manifest) is checked when a draft is picked."""
    m = load_manifest(model["folder"])
    hacked = m.__class__(**{**m.__dict__, "drafts": ({"name": "x", "path": "../outside"},)})
    with pytest.raises(ModelLoadError, match="points outside"):
        hacked.draft_dir("x")


def test_draft_vocab_file_outside(model):
    model["man"]["draft_vocab"] = {"file": "../outside/secret.bin", "target_vocab_size": 384}
    _fails(model["write"](), "draft_vocab.file", "points outside")


# ------------------------------------------------------------------ numbers and templates bounded
@pytest.mark.parametrize(
    "key,value",
    [
        ("num_layers", 10**9),
        ("num_layers", 0),
        ("num_layers", -1),
        ("num_layers", 2.0),
        ("num_layers", True),
        ("num_layers", "2"),
        ("hidden_size", 10**12),
        ("num_heads", 10**6),
        ("head_dim", 10**9),
        ("vocab_size", 10**13),
        ("max_positions", 10**15),
        ("num_kv_heads", 5),
    ],
)
def test_architecture_numbers_are_bounded(model, key, value):
    """Was: num_layers 10**9 loaded, then sized KV buffers and loops from it."""
    model["man"]["architecture"][key] = value
    _fails(model["write"](), "architecture" if key != "num_kv_heads" else "num_kv_heads")


@pytest.mark.parametrize(
    "template",
    [
        "{layer:>300000000}",
        "past.{layer!r}",
        "{",
        "}{",
        "{0}",
        "{}",
        "{layer.__class__}",
        "{layer[0]}",
        "{other}",
        "no-field",
        "x" * 1000,
        5,
        None,
        "{layer}{layer:{layer}}",
    ],
)
def test_kv_name_templates_are_checked(model, template):
    """Was: `{layer:>300000000}` built a 300 MB name per layer; `{` raised ValueError later."""
    model["man"]["onnx"]["kv"]["past_key"] = template
    t0 = time.perf_counter()
    _fails(model["write"](), "onnx.kv.past_key")
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "FLOAT16", 2, None, ["float16"]])
def test_kv_dtype_outside_the_known_ones_is_refused_naming_it(model, dtype):
    model["man"]["onnx"]["kv"]["dtype"] = dtype
    _fails(model["write"](), f"onnx.kv.dtype {dtype!r}")


@pytest.mark.parametrize("text", ["[]", "null", "3", '"manifest"', "[" * 100000, "{bad json", "\xff\xfe"])
def test_manifest_that_is_not_an_object(model, text):
    """Was: AttributeError ('list' object has no attribute 'get')."""
    (model["folder"] / "manifest.json").write_text(text, encoding="latin-1")
    _fails(model["folder"], "manifest.json")


@pytest.mark.parametrize(
    "mutate",
    [
        lambda m: m.update(architecture=[]),
        lambda m: m.update(onnx="x"),
        lambda m: m.update(tokenizer=None),
        lambda m: m.update(special_tokens=[1]),
        lambda m: m["special_tokens"].update(eos=["2"]),
        lambda m: m["special_tokens"].update(bos=-1),
        lambda m: m["special_tokens"].update(eos=list(range(1000))),
        lambda m: m["onnx"].update(inputs=["input_ids"]),
        lambda m: m["onnx"].update(kv=[]),
        lambda m: m["onnx"]["inputs"].update(input_ids=7),
        lambda m: m.update(files=[1]),
        lambda m: m["files"].update({"model.onnx": "x"}),
        lambda m: m.update(drafts="draft-q4"),
        lambda m: m.update(drafts=["draft-q4"]),
        lambda m: m["tokenizer"].update(chat_template=5),
        lambda m: m["files"]["model.onnx"].update(bytes="7997"),
        lambda m: m.update(name=["x"]),
    ],
)
def test_malformed_fields_are_load_errors(model, mutate):
    """Was: AttributeError / TypeError from deep inside the loader."""
    mutate(model["man"])
    _fails(model["write"]())


def test_manifest_size_is_bounded(model):
    path = model["folder"] / "manifest.json"
    with path.open("a") as f:
        f.truncate(manifest_mod.MAX_MANIFEST_BYTES + 1)
    _fails(model["folder"], "larger than")


# ------------------------------------------------------------------ the vocabulary map of EAGLE drafts
def _eagle(model, data: bytes | None = None, arr=None):
    model["man"]["draft_vocab"] = {"file": "vocab.npy", "size": 384, "target_vocab_size": 384}
    path = model["folder"] / "vocab.npy"
    if arr is not None:
        np.save(path, arr)
    else:
        path.write_bytes(data)
    return load_manifest(model["write"](), verify_hashes="never")


def test_valid_vocab_map_loads(model):
    vocab, full = load_vocab_map(_eagle(model, arr=np.arange(384)))
    assert full == 384 and vocab.dtype == np.int64 and vocab.size == 384


def _npy_header(shape, descr="<i8") -> bytes:
    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, {"descr": descr, "fortran_order": False, "shape": shape})
    return f.getvalue()


@pytest.mark.parametrize("case", ["npz", "float", "huge", "pickle", "2d", "short", "text", "empty"])
def test_bad_vocab_maps_are_load_errors(model, case):
    """Was: npz -> AttributeError, float -> accepted, 10**13 entries -> MemoryError."""
    if case == "npz":
        f = io.BytesIO()
        np.savez(f, vocab=np.arange(384))
        m = _eagle(model, f.getvalue())
    elif case == "float":
        m = _eagle(model, arr=np.arange(384, dtype=np.float64))
    elif case == "huge":
        m = _eagle(model, _npy_header((10**13,)) + b"\0" * 64)
    elif case == "pickle":
        m = _eagle(model, arr=np.array([object()] * 384, dtype=object))
    elif case == "2d":
        m = _eagle(model, arr=np.arange(384).reshape(1, 384))
    elif case == "short":
        m = _eagle(model, _npy_header((384,)) + b"\0" * 64)
    elif case == "text":
        m = _eagle(model, b"hello")
    else:
        m = _eagle(model, b"")
    with pytest.raises(ModelLoadError, match="vocab.npy"):
        load_vocab_map(m)


def test_npz_is_never_unzipped(model, monkeypatch):
    f = io.BytesIO()
    np.savez(f, vocab=np.arange(384))
    m = _eagle(model, f.getvalue())
    monkeypatch.setattr(zipfile, "ZipFile", lambda *a, **k: pytest.fail("opened the zip"))
    with pytest.raises(ModelLoadError):
        load_vocab_map(m)


# ------------------------------------------------------------------ sha256, verified once
def test_sha256_mismatch_is_a_load_error_naming_the_file(model):
    """Was: sha256 entries were never checked by default (a same-size replacement loaded)."""
    data = model["folder"] / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 1
    data.write_bytes(bytes(raw))
    _fails(model["folder"], "model.onnx.data", "sha256")


def test_hashes_are_verified_once_per_folder(model, monkeypatch):
    folder = model["folder"]
    (folder / STAMP).unlink(missing_ok=True)
    hashed = []
    real = manifest_mod._sha256
    monkeypatch.setattr(manifest_mod, "_sha256", lambda p: hashed.append(p.name) or real(p))
    load_manifest(folder)
    assert sorted(hashed) == sorted(model["man"]["files"]) and (folder / STAMP).is_file()
    hashed.clear()
    load_manifest(folder)
    assert hashed == []  # the stamp says nothing changed
    os.utime(folder / "tokenizer.json")  # touched: that one file is hashed again
    load_manifest(folder)
    assert hashed == ["tokenizer.json"]
    hashed.clear()
    load_manifest(folder, verify_hashes="always")
    assert len(hashed) == len(model["man"]["files"])


def test_a_same_size_change_with_its_mtime_restored_is_found(model):
    """Was: the stamp keyed a file by [size, mtime_ns, sha256], so bytes changed in place (the
    same size, the same inode) with the old mtime put back by os.utime loaded unverified. The
    inode's change time, which the kernel sets at every change and no user can set back, is
    part of the key now."""
    folder = model["folder"]
    load_manifest(folder)  # verified: the stamp records every file as it is now
    data = folder / "model.onnx.data"
    before = data.stat()
    time.sleep(0.05)  # (file times come from a coarse clock: a tick of a few ms)
    with data.open("r+b") as f:  # in place: the same inode and size
        f.seek(100)
        byte = f.read(1)[0]
        f.seek(100)
        f.write(bytes([byte ^ 1]))
    os.utime(data, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = data.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
    assert after.st_ctime_ns != before.st_ctime_ns
    _fails(folder, "model.onnx.data", "sha256", "does not match")


def test_a_file_replaced_by_another_with_its_size_and_mtime_is_found(model):
    """The same bytes changed in a copy renamed over the file, with the old mtime: a new inode."""
    folder = model["folder"]
    load_manifest(folder)
    data = folder / "model.onnx.data"
    before = data.stat()
    raw = bytearray(data.read_bytes())
    raw[100] ^= 1
    (folder / "swap").write_bytes(bytes(raw))
    os.utime(folder / "swap", ns=(before.st_atime_ns, before.st_mtime_ns))
    os.replace(folder / "swap", data)
    assert (data.stat().st_size, data.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    _fails(folder, "model.onnx.data", "sha256", "does not match")


def test_a_forged_stamp_does_not_hide_a_size_change(model):
    folder = model["folder"]
    with (folder / "model.onnx.data").open("ab") as f:
        f.write(b"x")
    _fails(folder, "model.onnx.data", "bytes")


def test_read_only_folder_still_loads(model, monkeypatch):
    (model["folder"] / STAMP).unlink(missing_ok=True)

    def no_write(*a, **k):
        raise PermissionError("read-only")

    monkeypatch.setattr(manifest_mod.tempfile, "mkstemp", no_write)
    load_manifest(model["folder"])  # verified, stamp not written
    assert not (model["folder"] / STAMP).exists()


def test_the_stamp_is_never_written_through_a_link_nor_read_from_one(model):
    """A stamp planted as a link to a file outside: not read (its hashes are not trusted), and
    the new stamp replaces the link instead of writing through it."""
    folder, secret = model["folder"], model["secret"]
    (folder / STAMP).unlink(missing_ok=True)
    (folder / STAMP).symlink_to(secret)
    before = secret.read_bytes()
    load_manifest(folder)
    assert secret.read_bytes() == before
    assert not (folder / STAMP).is_symlink() and json.loads((folder / STAMP).read_text())["files"]
    assert not list(folder.glob(f"{STAMP}.*"))  # no temporary file left


def test_a_fifo_or_a_device_as_manifest_or_stamp_neither_blocks_nor_is_read(model):
    folder = model["folder"]
    (folder / STAMP).unlink(missing_ok=True)
    os.mkfifo(folder / STAMP)  # a stamp that would block a reader: ignored
    load_manifest(folder)
    (folder / "manifest.json").unlink()
    os.mkfifo(folder / "manifest.json")
    _fails(folder, "manifest.json", "not a regular file")
    (folder / "manifest.json").unlink()
    (folder / "manifest.json").symlink_to("/dev/zero")
    _fails(folder, "manifest.json", "outside the model folder")


def test_a_manifest_name_with_control_characters_and_a_string_add_bos_are_refused(model):
    _fails(model["write"]({**model["man"], "name": "evil\x1b[2J"}), "name must be printable")
    man = json.loads(json.dumps(model["man"]))
    man["tokenizer"]["add_bos"] = "false"
    _fails(model["write"](man), "tokenizer.add_bos must be true or false")


def test_export_writes_the_stamp(tiny_llama):
    """The exporter just hashed every file: its stamp spares the first load the rehash."""
    stamp = json.loads((tiny_llama / STAMP).read_text())["files"]
    man = json.loads((tiny_llama / "manifest.json").read_text())
    assert set(stamp) == set(man["files"])
    assert all(stamp[k][-1] == man["files"][k]["sha256"] for k in stamp)
    assert all(len(stamp[k]) == len(STAMP_STAT) + 1 for k in stamp)  # [*STAMP_STAT, sha256]


def test_an_oversized_tokenizer_is_refused_before_it_is_parsed(model, monkeypatch):
    """A hostile folder's tokenizer.json could be any size (its sha256 pinned by the same
    hostile manifest): it is sized before the tokenizers library reads it."""
    import specdec_rt.text.codec as text
    from specdec_rt.text.codec import TextCodec

    m = load_manifest(model["folder"])
    TextCodec.from_manifest(m)  # the real one loads
    monkeypatch.setattr(text, "MAX_TOKENIZER_BYTES", m.tokenizer_file.stat().st_size - 1)
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: \d+ bytes, more than"):
        TextCodec.from_manifest(m)


def test_a_kv_buffer_the_machine_cannot_hold_is_a_load_error():
    from specdec_rt.ort.kvpool import _HostBuffer

    with pytest.raises(ModelLoadError, match="cannot reserve .* GiB for a KV buffer"):
        _HostBuffer((1 << 20, 1 << 20, 1 << 20))


def test_a_folder_in_the_working_directory_does_not_shadow_the_manifests_draft(tiny_llama, tmp_path, monkeypatch):
    from specdec_rt.engine.factory import make_drafter

    m = load_manifest(tiny_llama)
    shutil.copytree(tiny_llama, tmp_path / "q4", ignore=shutil.ignore_patterns("draft-*"))  # ./q4: a target copy
    monkeypatch.chdir(tmp_path)
    drafter, name = make_drafter(m, "q4", {"slots": 1})
    assert name == load_manifest(m.draft_dir("q4")).name and drafter.model.manifest.role != "target"


def test_the_benchmarks_source_stays_in_the_download_cache(model, monkeypatch, tmp_path):
    from specdec_rt.ort.manifest import load_manifest as load
    from specdec_rt.tooling.bench.hf import _slug, _source_of

    monkeypatch.setenv("SPECDEC_RT_CACHE", str(tmp_path / "cache"))
    man = {**model["man"], "source": {"kind": "recipe", "file": "../../outside/secret.bin"}}
    with pytest.raises(ModelLoadError, match="source.file .* points outside"):
        _source_of(load(model["write"](man)))
    assert _slug("x/../../evil") == "x_.._.._evil" and _slug("..") == "model"
