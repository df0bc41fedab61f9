"""A stand-in for ``pip download`` in the recipe tests: copies a wheel from a local folder."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path


def fake_pip(registry: Path, calls: list, sandbox: Path | None = None):
    """A ``subprocess.run`` replacement that records each command in ``calls`` and copies the
    wheel named by ``NAME==VERSION`` from ``registry`` to the ``-d`` folder (exit 1 when there is
    none). With ``sandbox``: asserts pip got ``NAME==VERSION`` only and a folder inside it."""

    def run(cmd, capture_output, text, cwd=None):
        calls.append(cmd)
        assert (
            cwd is not None and Path(cwd).resolve() == Path(cmd[cmd.index("-d") + 1]).resolve()
        )  # pip runs in its empty folder
        spec, dest = cmd[cmd.index("-d") - 1], Path(cmd[cmd.index("-d") + 1])
        if sandbox is not None:
            assert re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!_-]+", spec), spec
            assert dest.resolve().is_relative_to(sandbox.resolve())
        found = list(registry.glob(spec.split("==")[0].replace("-", "_") + "-*.whl"))
        if not found:
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution\n")
        shutil.copy(found[0], dest)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run
