"""Memory figures of this process and of the models it loaded: resident memory (now and at its
peak), the bytes of the models' weight files (the ONNX graph and its external data, and the
prepacked copy a model loaded instead) on disk and as mapped into this process, and each model's
KV pool (bytes per position, reserved, held by open requests).

Weight files are memory-mapped where ONNX Runtime can map them, so their bytes count in resident
memory only as pages are read; KV pools are reserved address space whose pages are committed as
positions are written. ``/metrics`` and ``python -m specdec_rt bench`` report these figures
(docs/memory.md).
"""

from __future__ import annotations

import os
import re
import resource
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple, Protocol

from ..types import KVUsage, ReportsKV

__all__ = [
    "resident_bytes",
    "peak_resident_bytes",
    "weight_files",
    "weights_bytes",
    "engine_weights_bytes",
    "Mapped",
    "mapped_bytes",
    "engine_weight_files",
    "models_weight_files",
    "ModelKV",
    "engine_kv",
    "models_kv",
]


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


def _models(engine: object) -> list[_HasManifest]:
    """The models ``engine`` holds (its ``models``; none for an engine without, such as a test double)."""
    models: Iterable[_HasManifest] = getattr(engine, "models", None) or ()
    return list(models)


def _onnx_file(model: object) -> Path | None:
    onnx_file = getattr(getattr(model, "manifest", None), "onnx_file", None)
    return None if onnx_file is None else Path(onnx_file)


def engine_weights_bytes(engine: object) -> int:
    """Bytes of the weight files of every model ``engine`` holds (its ``models``; 0 for an engine
    that has none, such as a test double)."""
    files = [onnx_file for model in _models(engine) if (onnx_file := _onnx_file(model)) is not None]
    return weights_bytes(files)


def engine_weight_files(engine: object) -> list[Path]:
    """The weight files ``engine``'s models may map (:func:`models_weight_files` of its ``models``)."""
    return models_weight_files(_models(engine))


def models_weight_files(models: Iterable[object]) -> list[Path]:
    """The weight files ``models`` may map: each export's own and, where a model loaded a
    prepacked copy (``OrtModel.prepacked``), the copy's."""
    files: list[Path] = []
    for model in models:
        for onnx_file in (_onnx_file(model), getattr(model, "prepacked", None)):
            if onnx_file is not None:
                files.extend(weight_files(Path(onnx_file)))
    return files


class Mapped(NamedTuple):
    """Bytes of some files mapped into this process: ``mapped`` (address space), ``resident``
    (of those, pages in memory now)."""

    mapped: int
    resident: int


def mapped_bytes(files: Iterable[Path]) -> Mapped:
    """How much of ``files`` this process maps, and how much of that is resident (Linux
    ``/proc/self/smaps``; zeros elsewhere)."""
    wanted = sorted({str(path.resolve()) for path in files})
    if not wanted:
        return Mapped(0, 0)
    try:
        with open("/proc/self/smaps", encoding="utf-8", errors="replace") as smaps:
            text = smaps.read()
    except OSError:
        return Mapped(0, 0)
    # a mapping's header (address perms offset dev inode path), then its Size:, ..., Rss: lines
    entry = re.compile(
        r"^\S+ \S+ \S+ \S+ \S+ +(?:" + "|".join(map(re.escape, wanted)) + r")\n"
        r"Size: +(\d+) kB\n(?:\w+: .*\n)*?Rss: +(\d+) kB$",
        re.MULTILINE,
    )
    mapped = resident = 0
    for found in entry.finditer(text):
        mapped, resident = mapped + int(found[1]) * 1024, resident + int(found[2]) * 1024
    return Mapped(mapped, resident)


class ModelKV(NamedTuple):
    """One model's KV pool figures: its ``role`` in the engine (``target`` or ``draft``), its
    ``model`` name and its :class:`~specdec_rt.types.KVUsage`."""

    role: str
    model: str
    usage: KVUsage


def engine_kv(engine: object, resident: bool = False) -> list[ModelKV]:
    """The KV pool figures of ``engine``'s models (:func:`models_kv` of its ``models`` and ``target``)."""
    return models_kv(_models(engine), target=getattr(engine, "target", None), resident=resident)


def models_kv(models: Iterable[object], target: object = None, resident: bool = False) -> list[ModelKV]:
    """The KV pool figures of each of ``models`` that has one (``kv_usage()``, as
    :class:`~specdec_rt.ort.model.OrtModel` has), in order; ``target`` (default: the first such
    model) has the role ``target``, the others ``draft``; ``resident``: with the bytes their
    pages commit (a read of the page table). Closed models are left out."""
    found: list[ModelKV] = []
    for model in models:
        if not isinstance(model, ReportsKV):
            continue
        usage = model.kv_usage(resident=resident)
        if usage is not None:
            role = "target" if model is target or target is None and not found else "draft"
            found.append(ModelKV(role, model.name, usage))
    return found
