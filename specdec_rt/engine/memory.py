"""Memory figures of this process and of the models it loaded: resident memory (now and at its
peak) and the bytes of the models' weight files (the ONNX graph and its external data).

Weight files are memory-mapped where ONNX Runtime can map them, so their bytes count in resident
memory only as pages are read; ``/metrics`` (``specdec_model_weights_bytes`` beside
``process_resident_memory_bytes``) and ``python -m specdec_rt bench`` report both (docs/memory.md).
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

__all__ = ["resident_bytes", "peak_resident_bytes", "weight_files", "weights_bytes", "engine_weights_bytes"]


class _HasManifest(Protocol):
    """A loaded model (``OrtModel``): its manifest names its ONNX file."""

    @property
    def manifest(self) -> object: ...


def _status_kib(field: str) -> int | None:
    """A ``/proc/self/status`` figure in KiB (``VmRSS``, ``VmHWM``), None off Linux."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def peak_resident_bytes() -> int:
    """The most resident memory this process has held (``VmHWM``; ``ru_maxrss`` elsewhere)."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # macOS: bytes; Linux, BSD: KiB


def resident_bytes() -> int:
    """Resident memory of this process now (``VmRSS``; the peak where the OS gives no more)."""
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else peak_resident_bytes()


def weight_files(onnx_file: Path) -> list[Path]:
    """``onnx_file`` and the external-data file beside it (``model.onnx.data`` as the exporter
    writes it, or ``model.onnx_data``), those of them that exist."""
    onnx_file = Path(onnx_file)
    found = [onnx_file, onnx_file.with_name(onnx_file.name + ".data"), onnx_file.with_name(onnx_file.name + "_data")]
    return [path for path in found if path.is_file()]


def weights_bytes(onnx_files: Iterable[Path]) -> int:
    """Bytes on disk of the weight files of ``onnx_files`` (each file counted once)."""
    paths = {path.resolve() for onnx_file in onnx_files for path in weight_files(onnx_file)}
    return sum(os.stat(path).st_size for path in paths)


def engine_weights_bytes(engine: object) -> int:
    """Bytes of the weight files of every model ``engine`` holds (its ``models``; 0 for an engine
    that has none, such as a test double)."""
    models: Iterable[_HasManifest] = getattr(engine, "models", None) or ()
    files = []
    for model in models:
        onnx_file = getattr(getattr(model, "manifest", None), "onnx_file", None)
        if onnx_file is not None:
            files.append(Path(onnx_file))
    return weights_bytes(files)
