"""``precision="auto"`` across processes: the tune file's lock (:class:`TuneLock`, ``fcntl.flock``
beside the tune file). Two processes started at once measure once, the other waits and reads the
stored choice; a lock whose holder is killed is free at once; a link planted as the lock file is
not followed (that process measures on its own and says so), nor is a wait past its bound.

tiny_llama (conftest) offers float32 (its own) and int4 (draft-q4); its manifest's name is
``llama-onnx``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import pytest

from specdec_rt import Engine
from specdec_rt.engine import tune, tune_cache
from specdec_rt.engine.factory import home_manifest
from specdec_rt.engine.tune_cache import TuneLock, TuneResult, TuneRow, lock_path, tune_key, write_cached

pytestmark = pytest.mark.skipif(tune_cache.fcntl is None, reason="no fcntl.flock on this platform")

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {"threads": 1, "slots": 2}

# a process that imports what `tune` needs, says "ready", waits for the start file, then runs
# `python -m specdec_rt tune MODEL --slots 2 --threads 1 --json`: two of them start measuring at once
AT_ONCE = """
import sys, time
from pathlib import Path
import specdec_rt.engine.engine, specdec_rt.engine.tune, specdec_rt.tooling.tune
from specdec_rt.cli import main
print("ready", file=sys.stderr, flush=True)
start, deadline = Path(sys.argv[2]), time.monotonic() + 120
while not start.exists() and time.monotonic() < deadline:
    time.sleep(0.005)
sys.exit(main(["tune", sys.argv[1], "--slots", "2", "--threads", "1", "--json"]))
"""

# a process that takes the lock for the model's key and then measures for ten minutes
HOLDS = """
import sys, anyio
from specdec_rt import Engine
from specdec_rt.engine import tune

async def forever(folder, load, **kw):
    print("measuring", flush=True)
    await anyio.sleep(600)

tune.measure = forever
anyio.run(lambda: tune.choose(sys.argv[1], Engine.load, threads=1, slots=2))
"""


@pytest.fixture
def tune_dir(tmp_path, monkeypatch) -> Path:
    """This test's own tune files."""
    folder = tmp_path / "tune"
    monkeypatch.setenv("SPECDEC_RT_TUNE_DIR", str(folder))
    return folder


@pytest.fixture
def warnings() -> list[str]:
    """The tune logger's warnings (its own handler: the CLI's logging stops propagation)."""
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logger, handler = logging.getLogger("specdec_rt.engine.tune"), Keep(logging.WARNING)
    logger.addHandler(handler)
    yield said
    logger.removeHandler(handler)


def _env(tune_dir: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "SPECDEC_RT_TUNE_DIR": str(tune_dir)}


def _key(folder) -> dict:
    return tune_key(home_manifest(folder), provider="auto", **SETTINGS)


class FakeMeasure:
    """Stands in for tune.measure: takes ``seconds`` (a real one takes a while), counts its calls
    (from any thread)."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds, self.calls = seconds, 0

    async def __call__(self, folder, load, **kw) -> TuneResult:
        self.calls += 1
        await anyio.sleep(self.seconds)
        rows = [
            TuneRow("float32", "ngram", 90.0, 150.0, 2, 0.5, True),
            TuneRow("int4", "none", 110.0, 250.0, 2, 0.0, True),
        ]
        return TuneResult(rows, tune.pick(rows), rounds=1, seconds=self.seconds)


def _choose(folder, said: list[str], **kw) -> tune.Tuned:
    return anyio.run(lambda: tune.choose(folder, Engine.load, say=said.append, **SETTINGS, **kw))


# ---------------------------------------------------------------------- two real processes
def test_two_processes_started_at_once_measure_once(tiny_llama, tune_dir, tmp_path):
    """Two `tune` processes released at the same instant: one measures, the other waits for it,
    says so, and reads the same choice from the file it stored (which it does not rewrite)."""
    script, start = tmp_path / "at_once.py", tmp_path / "start"
    script.write_text(AT_ONCE)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tiny_llama), str(start)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(tune_dir),
            cwd=ROOT,
        )
        for _ in range(2)
    ]
    try:
        for p in procs:
            assert p.stderr is not None and p.stderr.readline().strip() == "ready"
        start.touch()
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    docs = [json.loads(out) for out, _ in outs]
    by = {d["choice"]["chosen_by"]: (d, err) for d, (_, err) in zip(docs, outs)}
    assert sorted(by) == ["cached", "tuned"], [d["choice"] for d in docs]
    (measured, said_m), (waited, said_w) = by["tuned"], by["cached"]
    assert said_m.count("[tune] tuning llama-onnx") == 1 and "[tune] tuning" not in said_w, (said_m, said_w)
    assert "[tune] waiting for another process measuring llama-onnx" in said_w, said_w
    assert "[tune] the other process is done after" in said_w and "tune.unlocked" not in said_m + said_w
    assert {**waited["choice"], "chosen_by": "tuned"} == measured["choice"]
    assert waited["rows"] == measured["rows"] and waited["cache"] == measured["cache"]
    files = list(tune_dir.glob("*.json"))
    assert [str(f) for f in files] == [measured["cache"]]
    assert json.loads(files[0].read_text())["rows"] == measured["rows"]
    lock = files[0].with_suffix(".lock")
    assert stat.S_ISREG(lock.lstat().st_mode) and lock.stat().st_mode & 0o077 == 0  # 0o600 (less under a umask)


def test_a_lock_held_by_a_process_that_is_killed_is_free_at_once(tiny_llama, tune_dir, tmp_path):
    """A process killed mid-measurement (SIGKILL: no clean-up of its own) leaves no stale lock:
    the next one measures at once, without waiting."""
    script = tmp_path / "holds.py"
    script.write_text(HOLDS)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tiny_llama)],
        stdout=subprocess.PIPE,
        text=True,
        env=_env(tune_dir),
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "measuring"
        mine = TuneLock(lock_path(_key(tiny_llama)))
        assert mine.try_acquire() is False  # the other process holds it
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert mine.try_acquire() is True and mine.held
    mine.release()
    said: list[str] = []
    fake = FakeMeasure()
    took = time.monotonic()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tune, "measure", fake)
        tuned = _choose(tiny_llama, said, lock_wait_s=120)
    assert tuned.chosen_by == "tuned" and fake.calls == 1
    assert not any("waiting" in line for line in said) and time.monotonic() - took < 60, said


# ---------------------------------------------------------------------- in one process
def test_two_event_loops_on_two_threads_measure_once(tiny_llama, tune_dir, monkeypatch):
    """Each loop has its own asyncio lock; the file's lock (one open file each) still orders them."""
    fake = FakeMeasure(0.5)
    monkeypatch.setattr(tune, "measure", fake)
    got: list[tuple[tune.Tuned, list[str]]] = []

    def run() -> None:
        said: list[str] = []
        got.append((_choose(tiny_llama, said), said))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert fake.calls == 1 and sorted(t.chosen_by for t, _ in got) == ["cached", "tuned"]
    waited = next(said for t, said in got if t.chosen_by == "cached")
    assert any(line.startswith("waiting for another process measuring llama-onnx") for line in waited), waited
    assert len({(t.precision, t.draft) for t, _ in got}) == 1


def test_a_wait_past_its_bound_measures_here_and_says_so(tiny_llama, tune_dir, monkeypatch, warnings):
    fake = FakeMeasure()
    monkeypatch.setattr(tune, "measure", fake)
    held = TuneLock(lock_path(_key(tiny_llama)))
    assert held.try_acquire()
    said: list[str] = []
    took = time.monotonic()
    try:
        tuned = _choose(tiny_llama, said, lock_wait_s=0.6)
    finally:
        held.release()
    assert time.monotonic() - took >= 0.6 and tuned.chosen_by == "tuned" and fake.calls == 1
    assert said[0].startswith("waiting for another process measuring llama-onnx on this machine (at most 1 s; lock "), (
        said
    )
    assert any("tune.unlocked" in w and "waited 1 s for another process measuring llama-onnx" in w for w in warnings)


@pytest.mark.parametrize("why", ["read-only folder", "a folder at the lock's name"])
def test_a_cached_choice_needs_no_lock(tiny_llama, tune_dir, monkeypatch, warnings, why):
    """Where no lock can be made (a read-only tune folder holding a stored choice, as a baked
    image has) the choice is read, with no warning; measuring there (force) says why it is
    without the lock."""
    fake = FakeMeasure()
    monkeypatch.setattr(tune, "measure", fake)
    _choose(tiny_llama, [])
    lock = lock_path(_key(tiny_llama))
    lock.unlink()
    if why == "read-only folder":
        tune_dir.chmod(0o500)
        error = "PermissionError"
    else:
        lock.mkdir()
        error = "IsADirectoryError"
    if why == "read-only folder" and os.access(tune_dir, os.W_OK):  # root writes there anyway:
        real_open = tune_cache.os.open  # the lock file cannot be created, as for any other user

        def read_only(path, flags, *args):
            if Path(path) == lock and flags & os.O_CREAT:
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real_open(path, flags, *args)

        monkeypatch.setattr(tune_cache.os, "open", read_only)
    try:
        assert _choose(tiny_llama, []).chosen_by == "cached"
        assert fake.calls == 1 and not any("tune.unlocked" in w for w in warnings), warnings
        assert _choose(tiny_llama, [], force=True).chosen_by == "tuned" and fake.calls == 2
        assert any("tune.unlocked" in w and error in w for w in warnings), warnings
    finally:
        tune_dir.chmod(0o700)


# ---------------------------------------------------------------------- the untrusted folder
@pytest.mark.parametrize("victim", ["absent", "a file"])
def test_a_link_planted_as_the_lock_file_is_not_followed(tiny_llama, tune_dir, tmp_path, monkeypatch, warnings, victim):
    """The tune folder is untrusted: a link there is neither created through nor locked; that
    process measures on its own, with a warning naming why."""
    fake = FakeMeasure()
    monkeypatch.setattr(tune, "measure", fake)
    target = tmp_path / "victim"
    if victim == "a file":
        target.write_text("keep")
        target.chmod(0o644)
    link = lock_path(_key(tiny_llama))
    link.parent.mkdir(parents=True)
    link.symlink_to(target)
    with pytest.raises(OSError):
        TuneLock(link).try_acquire()
    tuned = _choose(tiny_llama, [])
    assert tuned.chosen_by == "tuned" and fake.calls == 1
    assert link.is_symlink() and os.readlink(link) == str(target)
    if victim == "absent":
        assert not target.exists()
    else:
        assert target.read_text() == "keep" and stat.S_IMODE(target.stat().st_mode) == 0o644
    assert any("tune.unlocked" in w and "OSError" in w and str(link) in w for w in warnings), warnings


def test_a_fifo_planted_as_the_lock_file_is_refused_without_hanging(tiny_llama, tune_dir):
    path = lock_path(_key(tiny_llama))
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    with pytest.raises(OSError, match="not a regular file"):
        TuneLock(path).try_acquire()


def test_pruning_removes_the_lock_files_of_pruned_results_unless_held(tune_dir, monkeypatch):
    """Old results go (MAX_CACHE_FILES); so do their lock files, except one a process holds."""
    monkeypatch.setattr(tune_cache, "MAX_CACHE_FILES", 2)
    keys = [{"model": f"m{i}"} for i in range(4)]
    held = None
    for i, key in enumerate(keys):
        lock = TuneLock(lock_path(key))
        assert lock.try_acquire()
        write_cached(key, TuneResult([TuneRow("float32", "none", 1.0, 1.0, 1, 0.0, True)], 0))
        os.utime(tune_cache.cache_path(key), (1000 + i, 1000 + i))  # oldest first, by mtime
        if i == 0:
            held = lock  # still held when the others prune it
        else:
            lock.release()
    assert held is not None
    left = sorted(p.name for p in tune_dir.iterdir())
    assert left == sorted(
        [lock_path(keys[0]).name, *(f(k).name for k in keys[2:] for f in (lock_path, tune_cache.cache_path))]
    )
    held.release()
