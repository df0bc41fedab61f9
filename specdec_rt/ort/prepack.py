"""Prepacked copies of ONNX graphs: ONNX Runtime's packed weights in a file that every process
loading the same export maps.

At load, ONNX Runtime packs the constant weights of MatMul and MatMulNBits into its kernels'
layout, in private memory: every process on one export holds a copy of its own. A *prepacked
copy* is the graph as ONNX Runtime optimized it on this machine, written with those packed
weights in its external data (``session.save_external_prepacked_constant_initializers``). A
session on the copy maps the packed weights from the file instead of packing them again, so the
processes share their pages (docs/memory.md).

Copies live in ``<cache>/prepacked/<folder>-<hash>/`` (``$SPECDEC_RT_PREPACK_DIR`` names another
folder for them), one folder per key: the source graph (its path, its SHA-256, and the size,
modification time, change time and inode of it and of its external data files), ONNX Runtime's
version, the optimization level, the CPU's model and instruction sets, and
:data:`PREPACK_VERSION`. A copy is built once per key, in a temporary folder that is synced and
then renamed into place, under a lock so that processes starting together build it once. At most
:data:`MAX_COPIES` copies and :data:`MAX_TOTAL_BYTES` are kept (the least recently used go
first), and none is built where the disk would keep less than :data:`MIN_FREE_BYTES` free.

The cache is untrusted input. A copy is loaded only if its folder and files belong to this user,
are no links, are writable by no one else, are exactly the three expected files, and its record
(``copy.json``, bounded) holds this key, the graph's SHA-256 and the data file's size,
modification time, change time and inode as they are now; ONNX Runtime itself refuses external
data outside the graph's folder. A copy that fails a check is removed (with a warning) and built
again. A cache that cannot be read or written costs memory, never the load: the model then
loads from its own graph.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..logs import get_logger
from ..manifest_schema import STAMP_STAT
from .manifest import cache_root, read_regular
from .setup import cpu_facts

try:
    import fcntl
except ImportError:  # (Windows: no flock; processes starting together may each build the copy)
    fcntl = None  # type: ignore[assignment]  # the module or None, tested before use

__all__ = [
    "PREPACK_VERSION",
    "PREPACK_DIR_ENV",
    "MIN_SOURCE_BYTES",
    "PrepackedCopy",
    "prepack_dir",
    "prepack_key",
    "copy_folder",
    "prepacked_copy",
    "discard_copy",
]

log = get_logger("specdec_rt")

PREPACK_VERSION = 1  # the copies' layout and record: a change builds every copy again
PREPACK_DIR_ENV = "SPECDEC_RT_PREPACK_DIR"  # the copies' own folder (tests point it at a temporary one)
MIN_SOURCE_BYTES = 16 << 20  # a graph whose files are smaller loads as it is: a copy would share little
MIN_ORT = (1, 21)  # the first ONNX Runtime that writes packed weights to a file and maps them back
MAX_COPIES = 8
MAX_TOTAL_BYTES = 64 << 30
MIN_FREE_BYTES = 2 << 30  # what the disk keeps free after a copy is written
SPACE_FACTOR = 3  # a copy is budgeted at this many times its source's bytes (int8 SmolLM2: 1.6x)
LOCK_WAIT_S = 600.0  # how long a load waits for another process building the same copy
STALE_S = 3600.0  # a temporary folder older than this was left by a process that died
GRAPH, DATA, RECORD = "model.onnx", "model.onnx.data", "copy.json"
MAX_RECORD_BYTES = 64 * 1024
MAX_GRAPH_BYTES = 1 << 30  # the copy's graph holds only the initializers under 1 KiB
_SAVE_OPTIONS = {
    "session.optimized_model_external_initializers_file_name": DATA,
    "session.optimized_model_external_initializers_min_size_in_bytes": "1024",
    "session.save_external_prepacked_constant_initializers": "1",
}
_CPU = ["CPUExecutionProvider"]

if sys.platform == "win32":  # no such flags there
    _NOFOLLOW = _NONBLOCK = _CLOEXEC = 0
else:
    _NOFOLLOW, _NONBLOCK, _CLOEXEC = os.O_NOFOLLOW, os.O_NONBLOCK, os.O_CLOEXEC


@dataclass(frozen=True)
class PrepackedCopy:
    """A prepacked copy ready to load: its ``graph`` file, and whether this call ``built`` it."""

    graph: Path
    built: bool


def prepack_dir() -> Path:
    """Where the copies live: ``$SPECDEC_RT_PREPACK_DIR``, else ``<cache>/prepacked``."""
    folder = os.environ.get(PREPACK_DIR_ENV)
    return Path(folder).expanduser() if folder else cache_root() / "prepacked"


def source_files(onnx_file: Path) -> list[Path]:
    """The graph and its external data: the regular files of its folder named after it
    (``model.onnx.data``), in name order after the graph."""
    found = [onnx_file]
    with os.scandir(onnx_file.parent) as entries:
        for entry in sorted(entries, key=lambda item: item.name):
            named = entry.name.startswith(onnx_file.name) and entry.name != onnx_file.name
            if named and entry.is_file():
                found.append(Path(entry.path))
    return found


def _sha256(path: Path, limit: int, *, follow: bool = True) -> str:
    return hashlib.sha256(read_regular(path, limit, follow=follow)).hexdigest()


def _identity(path: Path, *, follow: bool = False) -> list[int]:
    """A file's size, modification time, change time and inode (of a link itself unless
    ``follow``)."""
    st = os.stat(path, follow_symlinks=follow)
    return [int(getattr(st, field)) for field in STAMP_STAT]


def prepack_key(onnx_file: Path, *, level: str) -> dict[str, Any]:
    """Everything a copy of ``onnx_file`` depends on (see the module's docstring); ``level``:
    the graph optimization level its sessions run with."""
    import onnxruntime as ort

    return {
        "prepack_version": PREPACK_VERSION,
        "onnxruntime": ort.__version__,
        "optimization": level,
        **cpu_facts(),
        "source": str(onnx_file.resolve()),
        "graph_sha256": _sha256(onnx_file, MAX_GRAPH_BYTES),
        "files": {path.name: _identity(path, follow=True) for path in source_files(onnx_file)},
    }


def copy_folder(key: dict[str, Any]) -> Path:
    """``<prepack_dir>/<the source's folder>-<hash of the key>``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(str(key.get("source", "model"))).parent.name)[:60].strip(".-")
    return prepack_dir() / f"{slug or 'model'}-{digest}"


def prepacked_copy(onnx_file: Path, *, ort: Any, options: Callable[[], Any]) -> PrepackedCopy | None:
    """``onnx_file``'s prepacked copy, built first when there is none or the one there is
    refused; None when there is none to have (a graph under :data:`MIN_SOURCE_BYTES`, an ONNX
    Runtime older than :data:`MIN_ORT`; with a warning: a cache that cannot be written, a disk
    nearly full, another process building it for longer than :data:`LOCK_WAIT_S`, ONNX Runtime
    failing to write it): then load ``onnx_file`` itself. ``options``: a new ``SessionOptions``
    as the model's sessions get them (threads, optimization level); the copy is written and
    loaded on the CPU."""
    try:
        if sum(path.stat().st_size for path in source_files(onnx_file)) < MIN_SOURCE_BYTES or not _maps_packed(ort):
            return None
        key = prepack_key(onnx_file, level=str(options().graph_optimization_level))
        folder = copy_folder(key)
        if _refusal(folder, key) is None:
            _touch(folder)
            return PrepackedCopy(folder / GRAPH, built=False)
        with _BuildLock(folder) as held:
            if not held:
                raise OSError(errno.EBUSY, f"another process has been building it for over {LOCK_WAIT_S:.0f} s")
            return _build_under_lock(onnx_file, folder, key, ort=ort, options=options)
    except (OSError, ValueError) as exc:
        log.warning("prepack.unavailable", graph=str(onnx_file), error=f"{type(exc).__name__}: {exc}"[:300])
        return None


def _maps_packed(ort: Any) -> bool:
    """Whether this ONNX Runtime writes packed weights to a file and maps them back (older ones
    ignore the option: a copy would share nothing)."""
    found = re.match(r"(\d+)\.(\d+)", str(getattr(ort, "__version__", "")))
    return found is not None and (int(found[1]), int(found[2])) >= MIN_ORT


def _build_under_lock(
    onnx_file: Path, folder: Path, key: dict[str, Any], *, ort: Any, options: Callable[[], Any]
) -> PrepackedCopy:
    """The copy as another process may have built it meanwhile, else built now (a refused one
    removed first)."""
    refusal = _refusal(folder, key)
    if refusal is None:
        _touch(folder)
        return PrepackedCopy(folder / GRAPH, built=False)
    if os.path.lexists(folder):
        discard_copy(folder, refusal)
    started = time.perf_counter()
    _build(onnx_file, folder, key, ort=ort, options=options)
    log.info("prepack.built", graph=str(onnx_file), copy=str(folder), seconds=round(time.perf_counter() - started, 2))
    _prune(folder.parent, keep=folder)
    return PrepackedCopy(folder / GRAPH, built=True)


def discard_copy(folder: Path, reason: str) -> None:
    """Remove a refused copy (with a warning naming ``reason``); a link is removed, never
    followed. Sessions that mapped its files keep them."""
    log.warning("prepack.copy_refused", copy=str(folder), reason=reason[:300])
    _remove(folder)


# ---------------------------------------------------------------------- checking a copy
def _refusal(folder: Path, key: dict[str, Any]) -> str | None:
    """Why the copy in ``folder`` may not be loaded (``"absent"`` when there is none); None
    when it may."""
    if not os.path.lexists(folder):
        return "absent"
    try:
        _check_private(folder, directory=True)
        names = _first_names(folder, 4)
        if names != sorted((GRAPH, DATA, RECORD)):
            return f"holds {names[:6]}, not exactly {GRAPH}, {DATA} and {RECORD}"
        for name in names:
            _check_private(folder / name, directory=False)
        record = json.loads(read_regular(folder / RECORD, MAX_RECORD_BYTES, follow=False).decode("utf-8"))
        if not isinstance(record, dict) or record.get("version") != PREPACK_VERSION:
            return f"{RECORD} is not a version {PREPACK_VERSION} record"
        if record.get("key") != json.loads(json.dumps(key)):  # (the key as JSON has it)
            return "built for another graph, machine or setting"
        if _sha256(folder / GRAPH, MAX_GRAPH_BYTES, follow=False) != record.get("graph_sha256"):
            return f"{GRAPH} is not the graph that was built"
        if _identity(folder / DATA) != record.get("data"):
            return f"{DATA} is not the file that was built (size, times or inode differ)"
    except (OSError, ValueError, RecursionError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _first_names(folder: Path, most: int) -> list[str]:
    """The names of at most ``most`` entries of ``folder``, sorted (a planted folder may hold
    many)."""
    names = []
    with os.scandir(folder) as entries:
        for entry in entries:
            names.append(entry.name)
            if len(names) >= most:
                break
    return sorted(names)


def _check_private(path: Path, *, directory: bool) -> None:
    """``path`` is a folder (``directory``) or a regular file, not a link, owned by this user and
    writable by no one else; a ``ValueError`` says what it is instead."""
    st = os.lstat(path)
    kind = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    if not kind:
        raise ValueError(f"{path.name}: not a {'folder' if directory else 'regular file'} (a link?)")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise ValueError(f"{path.name}: owned by another user")
    if st.st_mode & 0o022:
        raise ValueError(f"{path.name}: writable by others")


def _touch(folder: Path) -> None:
    """Mark the copy used now (its record's modification time orders the pruning)."""
    with contextlib.suppress(OSError):
        os.utime(folder / RECORD, follow_symlinks=False)


# ---------------------------------------------------------------------- building a copy
def _build(onnx_file: Path, folder: Path, key: dict[str, Any], *, ort: Any, options: Callable[[], Any]) -> None:
    """Have ONNX Runtime write the copy into a temporary folder beside ``folder``, check and
    sync it, record it, and rename the folder into place."""
    root = folder.parent
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_space(root, sum(path.stat().st_size for path in source_files(onnx_file)))
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))  # mode 0o700
    try:
        _write_copy(onnx_file, tmp, ort=ort, options=options)
        record = {
            "version": PREPACK_VERSION,
            "key": key,
            "graph_sha256": _sha256(tmp / GRAPH, MAX_GRAPH_BYTES),
            "data": _identity(tmp / DATA),
        }
        fd = os.open(tmp / RECORD, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(record, out)
            out.flush()
            os.fsync(out.fileno())
        _fsync_dir(tmp)
        os.rename(tmp, folder)  # (the lock keeps others from building it; a folder there was removed)
        _fsync_dir(root)
    finally:
        if os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _write_copy(onnx_file: Path, into: Path, *, ort: Any, options: Callable[[], Any]) -> None:
    """A session on ``onnx_file`` that writes its optimized graph and prepacked weights into
    ``into``; the two files synced and made private (mode 0o600)."""
    so = options()
    so.optimized_model_filepath = str(into / GRAPH)
    for name, value in _SAVE_OPTIONS.items():
        so.add_session_config_entry(name, value)
    try:
        session = ort.InferenceSession(str(onnx_file), so, providers=_CPU)
    except Exception as exc:  # noqa: BLE001 - ORT raises its own hierarchy
        raise OSError(f"ONNX Runtime could not write the copy: {str(exc)[:200]}") from exc
    del session  # (its own packed weights, private memory, go with it)
    written = sorted(os.listdir(into))
    if written != sorted((GRAPH, DATA)):
        raise OSError(f"ONNX Runtime wrote {written[:6]}, not {GRAPH} and {DATA}")
    for name in (GRAPH, DATA):
        os.chmod(into / name, 0o600)
        fd = os.open(into / name, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_dir(folder: Path) -> None:
    if sys.platform == "win32":
        return
    fd = os.open(folder, os.O_RDONLY | _CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_space(root: Path, source_bytes: int) -> None:
    """An ``OSError`` unless the disk keeps :data:`MIN_FREE_BYTES` free after a copy of
    :data:`SPACE_FACTOR` times ``source_bytes``."""
    free = shutil.disk_usage(root).free
    need = SPACE_FACTOR * source_bytes + MIN_FREE_BYTES
    if free < need:
        raise OSError(errno.ENOSPC, f"{free >> 20} MiB free in {root}, a copy needs {need >> 20} MiB")


def _remove(path: Path) -> None:
    """Remove a folder of the cache (renamed aside first, so no one loads it half removed), or
    a link or file placed there; best effort."""
    with contextlib.suppress(OSError):
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)
            return
        aside = Path(tempfile.mkdtemp(prefix=".trash-", dir=path.parent)) / path.name
        os.rename(path, aside)
        shutil.rmtree(aside.parent, ignore_errors=True)


def _prune(root: Path, keep: Path) -> None:
    """Keep the :data:`MAX_COPIES` most recently used copies within :data:`MAX_TOTAL_BYTES`
    (``keep`` always), and remove what dead processes left (temporary folders, locks of copies
    gone)."""
    copies: list[tuple[float, int, Path]] = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            path = Path(entry.path)
            if entry.name.startswith((".build-", ".trash-")) and _older_than(path, STALE_S):
                _remove(path)
            elif not entry.name.startswith(".") and entry.is_dir(follow_symlinks=False) and path != keep:
                copies.append((_last_used(path), _bytes(path), path))
    total = _bytes(keep)
    for rank, (_, size, path) in enumerate(sorted(copies, reverse=True)):
        total += size
        if rank + 1 >= MAX_COPIES or total > MAX_TOTAL_BYTES:
            _remove(path)
            _drop_lock(path)


def _older_than(path: Path, seconds: float) -> bool:
    try:
        return time.time() - os.lstat(path).st_mtime > seconds
    except OSError:
        return False


def _last_used(folder: Path) -> float:
    try:
        return os.lstat(folder / RECORD).st_mtime
    except OSError:
        return 0.0


def _bytes(folder: Path) -> int:
    total = 0
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for entry in entries:
            total += entry.stat(follow_symlinks=False).st_size
    return total


# ---------------------------------------------------------------------- one builder at a time
def _lock_path(folder: Path) -> Path:
    return folder.parent / f".{folder.name}.lock"


def _drop_lock(folder: Path) -> None:
    """Remove a pruned copy's lock file unless a process holds it."""
    if fcntl is None:
        return
    with contextlib.suppress(OSError):
        fd = os.open(_lock_path(folder), os.O_RDWR | _NOFOLLOW | _NONBLOCK | _CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(_lock_path(folder))
        finally:
            os.close(fd)


class _BuildLock:
    """``fcntl.flock`` on ``.<copy>.lock`` beside the copy (created mode 0o600, never through a
    link), waited for up to :data:`LOCK_WAIT_S`; entering says whether it is held (always True
    where there is no flock). The kernel releases it when its holder exits, killed or not."""

    def __init__(self, folder: Path, wait_s: float | None = None) -> None:
        self.path = _lock_path(folder)
        self.wait_s = LOCK_WAIT_S if wait_s is None else wait_s
        self._fd: int | None = None

    def __enter__(self) -> bool:
        if fcntl is None:
            return True
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | _NOFOLLOW | _NONBLOCK | _CLOEXEC, 0o600)
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or device placed there
            os.close(fd)
            raise OSError(errno.EINVAL, f"{self.path}: not a regular file")
        self._fd = fd
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            if fcntl is not None:
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
