"""The KV pool of an :class:`~specdec_rt.ort.model.OrtModel`: preallocated, slot by slot.

Per layer one key and one value buffer ``[slots, kv_heads, max_len + 1, head_dim]``; a request
owns one slot, and each layer's past/present KV is bound to that slot's slice, so attention
appends in place (no copy per step; rollback is a length change). Slots ``0 .. running-1`` hold
running requests (a batched call binds ``[B, ...]`` consecutive slots as they are); the slots
above hold prefix-cache entries (:mod:`specdec_rt.kvcache.prefix`), which moves data between slots
with :meth:`KVPool.copy` and frees it with :meth:`KVPool.discard`.

On CPU the buffers are private anonymous memory maps of 4 KiB pages (no transparent huge pages:
a slot's rows are runs of ~1 MB, so a 2 MB page would commit memory nobody writes, and resident
memory would no longer follow what the cache holds). Pages are committed only when written (the
first write of an unused slot is slow: 0.2 s per 1,000 positions of SmolLM2 measured in the engine
process, 9 ms once written; hence the cache's copies run in idle time), and
``discard`` gives an evicted entry's pages back to the operating system (``MADV_DONTNEED``), so
resident memory follows what the cache holds, not its capacity. With CUDA they are device
OrtValues allocated up front, and the prefix cache is off (ONNX Runtime's Python API has no
device-to-device copy; a copy through the host would cost more than it saves).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import InferenceError, ModelLoadError
from ..kvcache.prefix import Hit, PrefixCache
from ..types import KVUsage

__all__ = ["KVPool", "KVUsage"]

PAGE = mmap.PAGESIZE


@functools.cache
def _mincore() -> Callable[[ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p], int] | None:
    """The C library's ``mincore`` (None where there is none: Windows)."""
    try:
        mincore = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).mincore
    except (OSError, AttributeError, TypeError):
        return None
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    mincore.restype = ctypes.c_int
    return mincore


class _HostBuffer:
    """A zero-filled array of ``dtype`` in an anonymous memory map (pages committed on write)."""

    def __init__(self, shape: tuple[int, ...], dtype: npt.DTypeLike = np.float32) -> None:
        self.itemsize = np.dtype(dtype).itemsize
        nbytes = int(np.prod(shape)) * self.itemsize
        private = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
        # private: MADV_DONTNEED then frees the pages (a shared map would keep them in memory)
        try:
            self.map = mmap.mmap(-1, max(nbytes, 1), flags=private) if private else mmap.mmap(-1, max(nbytes, 1))
        except (OSError, OverflowError, MemoryError) as exc:  # the manifest's shapes x max_length x slots
            raise ModelLoadError(
                f"cannot reserve {nbytes / 2**30:.1f} GiB for a KV buffer of shape {list(shape)} "
                f"({type(exc).__name__}: {exc}); lower max_length or slots"
            ) from None
        if hasattr(mmap, "MADV_NOHUGEPAGE"):  # a slot's rows are ~1 MB runs: 2 MB pages would
            self.map.madvise(mmap.MADV_NOHUGEPAGE)  # commit (and zero) memory nobody writes
        # typed: numpy's stubs give reshape(tuple[int, ...]) the shape type of a 0-d array
        self.array: np.ndarray = np.frombuffer(self.map, dtype=dtype, count=int(np.prod(shape))).reshape(shape)

    def resident_bytes(self) -> int | None:
        """Bytes of the map's pages in memory now (``mincore(2)``, a few milliseconds per GiB
        reserved; None where it is not available). Safe from any thread."""
        mincore = _mincore()
        if mincore is None:
            return None
        pages = np.zeros(-(-self.array.nbytes // PAGE), dtype=np.uint8)
        address, length = ctypes.c_void_p(self.array.ctypes.data), ctypes.c_size_t(self.array.nbytes)
        if mincore(address, length, pages.ctypes.data_as(ctypes.c_void_p)) != 0:
            return None
        return int(np.count_nonzero(pages & 1)) * PAGE  # bit 0: the page is in memory

    def release(self, start: int, stop: int) -> None:
        """Give the whole pages inside bytes ``start .. stop-1`` back (they read as zeros)."""
        lo, hi = -(-start // PAGE) * PAGE, stop // PAGE * PAGE
        if hi > lo and hasattr(mmap, "MADV_DONTNEED"):
            self.map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


class KVPool:
    """Key and value buffers for ``running + entries`` slots, per layer
    ``[slots, kv_heads, max_len + 1, d]`` of ``dtype`` (the manifest's ``onnx.kv.dtype``:
    float16 halves every byte count), and the slot bookkeeping (``cache``).

    Position ``max_len`` of every slot is scratch: a batched call writes the dummy token of a row
    that takes no part in it there when the row's cache is full (see ``OrtModel.run_batch_sync``).
    Running slots are handed out lowest first, so the rows of a batch sit close together.
    """

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        running: int,
        *,
        max_len: int,
        device: str,
        ort: Any = None,
        entries: int = 0,
        budget_bytes: int = 0,
        block: int = 64,
        dtype: str = "float32",
    ) -> None:
        entries = entries if device == "cpu" else 0  # CUDA: no prefix cache (see above)
        slots = running + entries
        self.shape = (slots, kv_heads, max_len + 1, head_dim)
        self.device = device
        self.dtype = np.dtype(dtype)
        size = self.dtype.itemsize
        self.slot_bytes = int(np.prod(self.shape[1:])) * size
        self.token_bytes = layers * 2 * kv_heads * head_dim * size  # one position, every layer, K and V
        self._buffers = []  # [layer] -> (key, value)
        for _ in range(layers):
            if device == "cpu":
                pair = (_HostBuffer(self.shape, self.dtype), _HostBuffer(self.shape, self.dtype))
            else:
                pair = tuple(
                    ort.OrtValue.ortvalue_from_shape_and_type(self.shape, self.dtype.type, "cuda", 0) for _ in range(2)
                )
            self._buffers.append(pair)
        self.hidden: _HostBuffer | None = None  # [slots, max_len + 1, H] target hidden states, if kept
        self.cache = PrefixCache(
            running,
            entries,
            block=block,
            budget_bytes=budget_bytes,
            token_bytes=self.token_bytes,
            copy=self.copy,
            copy_parts=self.copy_parts,
            discard=self.discard,
        )

    @property
    def reserved_per_slot(self) -> int:
        """Bytes one slot reserves, every layer's K and V (committed only as positions are written)."""
        return self.token_bytes * self.shape[2]

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the key and value buffers, every slot (running and prefix-cache ones)."""
        return self.reserved_per_slot * self.shape[0]

    def resident_bytes(self) -> int | None:
        """Bytes of the key and value buffers in memory now: the pages written so far on the CPU
        (None where ``mincore`` is not available), everything on CUDA (allocated up front)."""
        if self.device != "cpu":
            return self.reserved_bytes
        total = 0
        for pair in self._buffers:
            for buf in pair:
                resident = buf.resident_bytes() if isinstance(buf, _HostBuffer) else None
                if resident is None:
                    return None
                total += resident
        return total

    def pointer(self, layer: int, which: int, slot: int) -> int:
        """Address of ``slot``'s ``[1, kv_heads, max_len + 1, d]`` slice (which: 0 key, 1 value);
        ``[B, ...]`` from there covers slots ``slot .. slot + B - 1``."""
        buf = self._buffers[layer][which]
        base = buf.array.ctypes.data if isinstance(buf, _HostBuffer) else buf.data_ptr()
        return base + slot * self.slot_bytes

    def host_arrays(self) -> list[np.ndarray]:
        """Every layer's key and value array ``[slots, kv_heads, max_len + 1, d]`` (CPU only)."""
        if self.device != "cpu":
            raise InferenceError("the KV cache is not on the host")
        return [buf.array for pair in self._buffers for buf in pair]

    def hidden_rows(self, slot: int, size: int) -> np.ndarray:
        """``[max_len + 1, size]``: the hidden states kept for ``slot`` (allocated on first use,
        moved with the KV by the prefix cache)."""
        if self.hidden is None:
            self.hidden = _HostBuffer((self.shape[0], self.shape[2], size))
        rows: np.ndarray = self.hidden.array[slot]
        return rows

    def copy(self, src: int, dst: int, start: int, stop: int) -> None:
        """Copy positions ``start .. stop-1`` of slot ``src`` into slot ``dst`` (worker thread)."""
        for part in self.copy_parts(src, dst, start, stop):
            part()

    def copy_parts(self, src: int, dst: int, start: int, stop: int) -> list[Callable[[], None]]:
        """The same copy as one callable per layer (and one for the hidden states)."""

        def layer(pair: tuple[Any, ...]) -> Callable[[], None]:
            def run() -> None:
                for buf in pair:
                    buf.array[dst, :, start:stop] = buf.array[src, :, start:stop]

            return run

        def hidden() -> None:
            if self.hidden is not None:
                self.hidden.array[dst, start:stop] = self.hidden.array[src, start:stop]

        return [layer(pair) for pair in self._buffers] + [hidden] if stop > start else []

    def discard(self, slot: int, start: int, stop: int) -> None:
        """Give the memory of positions ``start .. stop-1`` of ``slot`` back (worker thread)."""
        position = self.shape[3] * self.dtype.itemsize  # bytes per position of one kv head
        rows = self.shape[2] * position  # bytes per kv head
        for pair in self._buffers:
            for buf in pair:
                if isinstance(buf, _HostBuffer):
                    for head in range(self.shape[1]):
                        base = (slot * self.shape[1] + head) * rows
                        buf.release(base + start * position, base + stop * position)
        if self.hidden is not None:
            row = self.hidden.array.shape[2] * 4
            base = slot * self.shape[2] * row
            self.hidden.release(base + start * row, base + stop * row)

    def acquire(self, tokens: np.ndarray | None = None) -> tuple[int, Hit | None]:
        """A running slot and the prefix-cache hit for ``tokens`` (see ``PrefixCache.acquire``)."""
        return self.cache.acquire(tokens)

    def release(self, slot: int, ids: np.ndarray) -> None:
        self.cache.release(slot, ids)

    @property
    def free(self) -> int:
        """Running slots nobody holds."""
        return self.cache.free
