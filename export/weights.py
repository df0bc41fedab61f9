"""Streaming writer for ONNX external data (`model.onnx.data`).

Weights go straight from the PyTorch tensors to the data file one at a time, so exporting a
6 GB model needs the model plus one tensor of extra memory, never a second full copy inside a
protobuf. Each tensor starts at a page-aligned offset so ONNX Runtime can map it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import helper, numpy_helper

__all__ = ["ExternalDataWriter"]

_ALIGN = 4096  # page size: aligned tensors can be memory-mapped
_INLINE_BYTES = 1024  # smaller tensors stay inside model.onnx


class ExternalDataWriter:
    """Appends tensors to one external-data file and returns their `TensorProto` stubs."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.location = self.path.name  # relative to model.onnx, as ONNX requires
        self._file = open(self.path, "wb")
        self._offset = 0
        self.bytes_written = 0

    def add(self, name: str, array: npt.NDArray[Any]) -> onnx.TensorProto:
        """Write `array` (C-contiguous copy if needed) and return its initializer."""
        array = np.ascontiguousarray(array)
        if array.nbytes < _INLINE_BYTES:
            return numpy_helper.from_array(array, name)
        pad = (-self._offset) % _ALIGN
        if pad:
            self._file.write(b"\0" * pad)
            self._offset += pad
        self._file.write(array.data.cast("B"))
        tensor = onnx.TensorProto()
        tensor.name = name
        tensor.data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
        tensor.dims.extend(array.shape)
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (
            ("location", self.location),
            ("offset", str(self._offset)),
            ("length", str(array.nbytes)),
        ):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        self._offset += array.nbytes
        self.bytes_written = self._offset
        return tensor

    def close(self) -> None:
        """Flush and close the data file (also on error paths)."""
        if not self._file.closed:
            self._file.flush()
            self._file.close()

    def __enter__(self) -> "ExternalDataWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
