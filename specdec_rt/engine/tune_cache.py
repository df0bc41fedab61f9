"""What ``precision="auto"`` measured, and the file that keeps it per machine and model.

One small JSON file per key in ``<cache>/tune/`` (``$SPECDEC_RT_CACHE``, else
``$XDG_CACHE_HOME/specdec-rt``, else ``~/.cache/specdec-rt``; ``$SPECDEC_RT_TUNE_DIR`` names
another folder for them). The key is everything the winner
depends on: the CPU (model name and the instruction sets the kernels pick from: AVX2, AVX-512,
VNNI, AMX, ...), ONNX Runtime's version and providers, the model folder (a hash of its and its
drafts' ``manifest.json`` and their files' sizes and modification times), threads, slots, the
provider asked for and the measurement's own version. Any change is another key: measured again.

The file is untrusted input: read only if it is a regular file of at most
:data:`MAX_CACHE_BYTES`, every field checked (types, bounds, the key equal to this machine's);
anything else is ignored, with a warning, and measured again, never a crash. Writes are atomic
(a temporary file renamed over the old one) and best effort (a read-only cache only costs a
measurement per start).

Processes that read, else measure and store, one key at once (two ``serve``, a ``serve`` and a
``tune``, Ray Serve replicas on one node) take turns with :class:`TuneLock`: ``fcntl.flock`` on
``<model>-<hash>.lock`` beside the tune file (opened without following a link, mode 0o600). The
kernel releases it when its holder exits, killed or not.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import stat
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    import fcntl
except ImportError:  # (Windows: no flock; each process measures on its own, and says so)
    fcntl = None  # type: ignore[assignment]  # the module or None, tested before use

from ..logs import get_logger
from ..manifest_schema import MANIFEST
from .factory import ISA_FLAGS, cache_root, cpu_facts, runtime_facts

if TYPE_CHECKING:
    from ..ort import Manifest

__all__ = [
    "TUNE_VERSION",
    "MAX_CACHE_BYTES",
    "CategoryRate",
    "TuneRow",
    "TuneResult",
    "tune_key",
    "cache_path",
    "read_cached",
    "write_cached",
    "lock_path",
    "TuneLock",
    "ISA_FLAGS",
    "cpu_facts",
]  # the last two: ort.setup's, where the tune key and the prepacked copies' key read them

log = get_logger("specdec_rt.engine.tune")

TUNE_VERSION = 3  # the measurement's procedure and rule: a change re-measures every cached choice
MAX_CACHE_BYTES = 64 * 1024
MAX_ROWS = 64
MAX_CATEGORIES = 8  # prompt categories per row
MAX_TOKENS = 4096  # the answer length a file may say was measured
ONE_STREAM_WEIGHT = 2 / 3  # the score's exponent of the one-stream rate (the latency case); 1/3 for several at once
MAX_CACHE_FILES = 64  # results kept in the folder (the oldest go first)
_TEXT = re.compile(r"^[\x20-\x7e]*$")  # printable ASCII: what the file may say in a string field
_CATEGORY = re.compile(r"^[a-z][a-z0-9_-]{0,15}$")  # a prompt category's name ("chat", "code", ...)


@dataclass(frozen=True)
class CategoryRate:
    """One prompt category of one configuration: the median end-to-end tokens/s with one stream
    (``tok_s_1``) over its prompts and rounds, and the mean ``acceptance`` of its drafts there."""

    category: str
    tok_s_1: float
    acceptance: float


@dataclass(frozen=True)
class TuneRow:
    """One configuration measured: target ``precision``, ``draft`` spec (``"none"``: plain
    decoding), medians of end-to-end tokens/s with one stream (``tok_s_1``) and summed over
    ``concurrency`` streams at once (``tok_s_c``), mean ``acceptance`` of its drafts, whether its
    greedy speculative output equalled plain decoding's on every prompt (``exact``), a ``note``
    (why it was left out) and the one-stream rate per prompt category (``categories``; then
    ``tok_s_1`` is their geometric mean: each category weighs alike)."""

    precision: str
    draft: str
    tok_s_1: float
    tok_s_c: float
    concurrency: int
    acceptance: float
    exact: bool
    note: str = ""
    categories: tuple[CategoryRate, ...] = ()

    @property
    def score(self) -> float:
        """The choice's measure: a geometric mean of the two rates weighted 2 to 1, one stream
        (the latency a user waits through) counting twice a server's batches."""
        return score(self.tok_s_1, self.tok_s_c)

    def category(self, name: str) -> CategoryRate | None:
        """Its rate on the category ``name``, if measured."""
        return next((c for c in self.categories if c.category == name), None)


def score(one: float, several: float) -> float:
    """``one ** (2/3) * several ** (1/3)`` (:data:`ONE_STREAM_WEIGHT`): a configuration's score."""
    return one**ONE_STREAM_WEIGHT * several ** (1 - ONE_STREAM_WEIGHT) if one > 0 and several > 0 else 0.0


@dataclass
class TuneResult:
    """Every configuration measured, and which won (``chosen``: an index into ``rows``, None when
    none was exact); ``rounds`` of ``prompts`` ran, in ``seconds``."""

    rows: list[TuneRow]
    chosen: int | None
    rounds: int = 0
    seconds: float = 0.0
    rule: str = (
        "highest score (tok/s with one stream ^ 2/3 x with several at once ^ 1/3; one stream: geometric "
        "mean over prompt categories) among exact configurations; a less precise target must beat a more "
        "precise one by more than 5%; a draft model that beats the pick by over 10% on a category alone is "
        "kept if its score is within 15% of the pick's"
    )
    key: dict[str, Any] = field(default_factory=dict)
    tokens: int = 0  # greedy tokens per answer measured (0: not said)

    @property
    def best(self) -> TuneRow | None:
        return None if self.chosen is None else self.rows[self.chosen]

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": TUNE_VERSION,
            "key": self.key,
            "rows": [{**asdict(r), "categories": [asdict(c) for c in r.categories]} for r in self.rows],
            "chosen": self.chosen,
            "rounds": self.rounds,
            "seconds": round(self.seconds, 3),
            "tokens": self.tokens,
            "rule": self.rule,
        }

    @classmethod
    def from_dict(cls, raw: Any) -> "TuneResult":
        """A result from its JSON form, every field checked; ``ValueError`` names what is wrong."""
        if not isinstance(raw, dict) or raw.get("version") != TUNE_VERSION:
            raise ValueError(f"not a version {TUNE_VERSION} tune result")
        rows_raw = raw.get("rows")
        if not isinstance(rows_raw, list) or not 0 < len(rows_raw) <= MAX_ROWS:
            raise ValueError(f"rows must be a list of 1 to {MAX_ROWS}")
        rows = [_row(r) for r in rows_raw]
        chosen = raw.get("chosen")
        if chosen is not None and (type(chosen) is not int or not 0 <= chosen < len(rows) or not rows[chosen].exact):
            raise ValueError("chosen must index an exact row")
        rounds, seconds = raw.get("rounds", 0), raw.get("seconds", 0.0)
        if type(rounds) is not int or not 0 <= rounds <= 1000:
            raise ValueError("rounds out of range")
        if not _number(seconds, 1e6):
            raise ValueError("seconds out of range")
        tokens = raw.get("tokens")
        if type(tokens) is not int or not 0 <= tokens <= MAX_TOKENS:
            raise ValueError(f"tokens must be an integer from 0 to {MAX_TOKENS}")
        key = raw.get("key")
        if not isinstance(key, dict):
            raise ValueError("key must be an object")
        rule = _text(raw.get("rule", ""), 400)
        return cls(rows=rows, chosen=chosen, rounds=rounds, seconds=float(seconds), rule=rule, key=key, tokens=tokens)


def _number(value: Any, hi: float) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and 0 <= value <= hi


def _text(value: object, limit: int) -> str:
    if not isinstance(value, str) or len(value) > limit or not _TEXT.match(value):
        raise ValueError(f"a string of at most {limit} printable characters expected, got {str(value)[:40]!r}")
    return value


def _row(raw: object) -> TuneRow:
    if not isinstance(raw, dict):
        raise ValueError("a row must be an object")
    nums = {k: raw.get(k) for k in ("tok_s_1", "tok_s_c", "acceptance")}
    for k, v in nums.items():
        if not _number(v, 1.0 if k == "acceptance" else 1e7):
            raise ValueError(f"row {k} out of range")
    concurrency, exact = raw.get("concurrency"), raw.get("exact")
    if type(concurrency) is not int or not 1 <= concurrency <= 256 or not isinstance(exact, bool):
        raise ValueError("row concurrency or exact malformed")
    return TuneRow(
        precision=_text(raw.get("precision"), 16),
        draft=_text(raw.get("draft"), 200),
        tok_s_1=float(nums["tok_s_1"]),  # type: ignore[arg-type]  # checked above
        tok_s_c=float(nums["tok_s_c"]),  # type: ignore[arg-type]  # checked above
        concurrency=concurrency,
        acceptance=float(nums["acceptance"]),  # type: ignore[arg-type]  # checked above
        exact=exact,
        note=_text(raw.get("note", ""), 300),
        categories=_categories(raw.get("categories")),
    )


def _categories(raw: object) -> tuple[CategoryRate, ...]:
    if not isinstance(raw, list) or len(raw) > MAX_CATEGORIES:
        raise ValueError(f"row categories must be a list of at most {MAX_CATEGORIES}")
    found: list[CategoryRate] = []
    for item in raw:
        if not isinstance(item, dict) or set(item) != {"category", "tok_s_1", "acceptance"}:
            raise ValueError("a row category must be an object of category, tok_s_1 and acceptance")
        name, rate, acceptance = item["category"], item["tok_s_1"], item["acceptance"]
        if not isinstance(name, str) or not _CATEGORY.match(name) or any(c.category == name for c in found):
            raise ValueError(f"a row category's name must be a distinct short lowercase word, got {str(name)[:40]!r}")
        if not _number(rate, 1e7) or not _number(acceptance, 1.0):
            raise ValueError(f"row category {name} out of range")
        found.append(CategoryRate(name, float(rate), float(acceptance)))
    return tuple(found)


# ---------------------------------------------------------------------- the key
def model_stamp(home: Manifest) -> str:
    """A hash of the folder's and its drafts' ``manifest.json`` and of each listed file's size
    and modification time: a rebuilt or edited model is another key."""
    h = hashlib.sha256()
    folders = [Path(home.folder)] + [Path(home.folder) / d["path"] for d in home.drafts]
    for folder in folders:
        try:
            manifest = folder / MANIFEST
            h.update(str(folder.name).encode() + b"\0" + manifest.read_bytes()[: 1 << 22])
            raw = json.loads(manifest.read_text(encoding="utf-8"))
            files = raw.get("files") if isinstance(raw, dict) else None
            for name in sorted(files) if isinstance(files, dict) else ():
                st = (folder / name).stat()
                h.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        except (OSError, ValueError):
            h.update(b"unreadable\0")  # loading it would fail anyway; the key still differs
    return h.hexdigest()


def tune_key(home: Manifest, *, threads: int | None, slots: int, provider: str) -> dict[str, Any]:
    """Everything a measurement's winner depends on (see the module's docstring)."""
    return {
        "tune_version": TUNE_VERSION,
        **cpu_facts(),
        **runtime_facts(threads),
        "provider": provider,
        "slots": slots,
        "model": home.name,
        "model_stamp": model_stamp(home),
    }


TUNE_DIR_ENV = "SPECDEC_RT_TUNE_DIR"  # the tune files' own folder (tests point it at a temporary one)


def cache_path(key: dict[str, Any]) -> Path:
    """``<cache>/tune/<model>-<hash of the key>.json`` (``$SPECDEC_RT_TUNE_DIR`` instead of
    ``<cache>/tune`` when set)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", str(key.get("model", "model")))[:60].strip(".-") or "model"
    folder = os.environ.get(TUNE_DIR_ENV)
    return (Path(folder).expanduser() if folder else cache_root() / "tune") / f"{slug}-{digest}.json"


def read_cached(key: dict[str, Any]) -> TuneResult | None:
    """The cached result for ``key``, or None: absent, unreadable, malformed, or for another key
    (a warning says which and the caller measures again)."""
    path = cache_path(key)
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("tune.cache_unreadable", path=str(path), error=f"{type(exc).__name__}: {exc}"[:200])
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_CACHE_BYTES:
                raise ValueError(f"not a regular file of at most {MAX_CACHE_BYTES} bytes")
            data = f.read(MAX_CACHE_BYTES + 1)
        if len(data) > MAX_CACHE_BYTES:
            raise ValueError(f"larger than {MAX_CACHE_BYTES} bytes")
        result = TuneResult.from_dict(json.loads(data.decode("utf-8")))
        if result.key != json.loads(json.dumps(key)):  # (the key as JSON has it)
            raise ValueError("measured for another machine, model or setting")
        return result
    except (OSError, ValueError, RecursionError) as exc:
        log.warning("tune.cache_ignored", path=str(path), error=f"{type(exc).__name__}: {exc}"[:200])
        return None


def _prune(folder: Path, keep: Path) -> None:
    """Keep the :data:`MAX_CACHE_FILES` newest results: keys of folders rebuilt or deleted
    (a test's temporary models) would otherwise pile up."""
    with contextlib.suppress(OSError):
        files = sorted(
            (p for p in folder.glob("*.json") if p.is_file() and not p.is_symlink() and p != keep),
            key=lambda p: p.stat().st_mtime,
        )
        for old in files[: max(0, len(files) + 1 - MAX_CACHE_FILES)]:
            with contextlib.suppress(OSError):
                old.unlink()
                _drop_lock(old.with_suffix(LOCK_SUFFIX))


def _drop_lock(path: Path) -> None:
    """Remove a pruned result's lock file unless a process holds it (one that opened it and locks
    it later sees it gone: :meth:`TuneLock.try_acquire` opens it again)."""
    if fcntl is None:
        return
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDWR | _NOFOLLOW | _NONBLOCK | _CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _names(path, fd):
                path.unlink()
        finally:
            os.close(fd)


def write_cached(key: dict[str, Any], result: TuneResult) -> Path | None:
    """Store ``result`` under ``key`` (atomically); the path, or None when it cannot be written."""
    path = cache_path(key)
    result.key = key
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tune-", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(result.as_dict(), f, indent=1)
        os.replace(tmp, path)
        tmp = None
        _prune(path.parent, keep=path)
        return path
    except OSError as exc:
        log.warning("tune.cache_unwritable", path=str(path), error=f"{type(exc).__name__}: {exc}"[:200])
        return None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


# ---------------------------------------------------------------------- one process at a time
LOCK_SUFFIX = ".lock"
if sys.platform == "win32":  # no such flags there
    _NOFOLLOW = _NONBLOCK = _CLOEXEC = 0
else:
    _NOFOLLOW, _NONBLOCK, _CLOEXEC = os.O_NOFOLLOW, os.O_NONBLOCK, os.O_CLOEXEC


def lock_path(key: dict[str, Any]) -> Path:
    """The lock file of ``key``'s tune file: beside it, ``<model>-<hash>.lock``."""
    return cache_path(key).with_suffix(LOCK_SUFFIX)


def _names(path: Path, fd: int) -> bool:
    """Whether ``path`` (not followed) is still the file open as ``fd``."""
    try:
        st, mine = os.stat(path, follow_symlinks=False), os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


class TuneLock:
    """An exclusive lock across processes on one tune file: ``fcntl.flock`` on the file at
    ``path`` (:func:`lock_path`), created if absent (mode 0o600), never through a link.

    flock locks an open file description: two of them conflict whether they are in two processes
    or in one (two event loops on two threads each open their own), and the kernel drops the lock
    when its holder closes it or exits, killed or not. Not re-entrant: one object, one holder.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd: int | None = None
        self.held = False

    def try_acquire(self) -> bool:
        """Take the lock if it is free: True once held, False while another holds it. Raises
        :class:`OSError` when it cannot be taken here: no ``fcntl`` on this platform, a folder
        that cannot be created or written, a link or something else than a regular file there,
        a file system without flock."""
        if fcntl is None:
            raise OSError(errno.ENOSYS, "no fcntl.flock on this platform")
        if self.held:
            return True
        for _ in range(3):  # (the file pruned and made again between open and lock: try the new one)
            if self._fd is None:
                self._fd = self._open()
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            except OSError:
                self.release()
                raise
            if _names(self.path, self._fd):  # a lock on a file removed meanwhile would lock nothing
                self.held = True
                return True
            self.release()
        return False

    def _open(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT | _NOFOLLOW | _NONBLOCK | _CLOEXEC
        fd = os.open(self.path, flags, 0o600)  # a link: ELOOP (the folder is untrusted)
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or device placed there
            os.close(fd)
            raise OSError(errno.EINVAL, f"{self.path}: not a regular file")
        return fd

    def release(self) -> None:
        """Let go of the lock (and the file); nothing when not held."""
        fd, self._fd, self.held = self._fd, None, False
        if fd is not None:
            with contextlib.suppress(OSError):
                if fcntl is not None:
                    fcntl.flock(fd, fcntl.LOCK_UN)  # (before close: a forked child's copy would keep it)
            os.close(fd)
