"""A fast GGUF header reader: scalar metadata, the token list and types, tensor extents.

`gguf.GGUFReader` materializes every array (a Qwen vocabulary: 150k tokens + merges) as numpy
views and takes seconds to a minute; checking a file's architecture, special tokens and that no
tensor runs past the end of the file needs only the header (merges are skipped).
Layout (GGUF v2/v3, little-endian):

    "GGUF" u32 version, u64 n_tensors, u64 n_kv
    n_kv x (string key, u32 type, value)          arrays: u32 item type, u64 count, items
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml type, u64 offset)
    padding to `general.alignment` (default 32), then tensor data (offsets relative to it)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .errors import CorruptSourceError

__all__ = ["GGUFInfo", "GGUFArray", "read_gguf_info"]

# arrays kept in full (all others are skipped): the token list and the token types
_KEEP_ARRAYS = {"tokenizer.ggml.tokens", "tokenizer.ggml.token_type"}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types of special / added tokens
# value type -> struct format of one scalar (8 = string, 9 = array handled apart)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}


@dataclass(frozen=True)
class GGUFArray:
    """An array value, skipped: only its item type and length are kept."""

    item_type: int
    count: int


@dataclass(frozen=True)
class GGUFInfo:
    """Scalar metadata (strings, numbers, bools) and where the tensor data ends."""

    metadata: dict
    n_tensors: int
    data_end: int  # byte offset just past the last tensor
    file_size: int

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture"))

    @property
    def vocab_size(self) -> int | None:
        """`<arch>.vocab_size`, else the length of the token list."""
        explicit = self.metadata.get(f"{self.architecture}.vocab_size")
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        return explicit or (len(tokens) if tokens is not None else None)

    def special_tokens(self) -> list[str]:
        """Tokens typed CONTROL or USER_DEFINED (e.g. Qwen's `<|fim_prefix|>`)."""
        tokens = self.metadata.get("tokenizer.ggml.tokens") or []
        types = self.metadata.get("tokenizer.ggml.token_type")
        if types is None:
            return []
        return [tokens[i] for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)]


class _Reader:
    def __init__(self, f):
        self.f = f

    def unpack(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        raw = self.f.read(size)
        if len(raw) != size:
            raise EOFError("unexpected end of file in the GGUF header")
        return struct.unpack("<" + fmt, raw)[0]

    def string(self, keep: bool = True):
        n = self.unpack("Q")
        if n > 1 << 30:
            raise ValueError(f"implausible string length {n}")
        if not keep:
            self.f.seek(n, 1)
            return None
        raw = self.f.read(n)
        if len(raw) != n:
            raise EOFError("unexpected end of file in the GGUF header")
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, keep_array: bool = False):
        if vtype in _SCALAR:
            return self.unpack(_SCALAR[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:  # arrays are skipped unless kept: only their extent matters
            itype, count = self.unpack("I"), self.unpack("Q")
            if keep_array and itype == 8:
                return [self.string() for _ in range(count)]
            if keep_array and itype in _SCALAR:
                fmt = "<" + _SCALAR[itype]
                raw = self.f.read(count * struct.calcsize(fmt))
                return [v[0] for v in struct.iter_unpack(fmt, raw)]
            skipped = GGUFArray(itype, count)
            if itype in _SCALAR:
                self.f.seek(count * struct.calcsize("<" + _SCALAR[itype]), 1)
            elif itype == 8:
                for _ in range(count):
                    self.string(keep=False)
            else:
                for _ in range(count):
                    self.value(itype)
            return skipped
        raise ValueError(f"unknown GGUF value type {vtype}")


@lru_cache(maxsize=8)
def _read(path: str, size: int, mtime_ns: int) -> GGUFInfo:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb", buffering=1 << 20) as f:
        r = _Reader(f)
        if f.read(4) != b"GGUF":
            raise CorruptSourceError(f"{path} is not a GGUF file (bad magic)")
        version = r.unpack("I")
        if version not in (2, 3):
            raise CorruptSourceError(f"{path}: unsupported GGUF version {version}")
        n_tensors, n_kv = r.unpack("Q"), r.unpack("Q")
        meta = {}
        for _ in range(n_kv):
            key = r.string()
            meta[key] = r.value(r.unpack("I"), keep_array=key in _KEEP_ARRAYS)
        extents = []
        for _ in range(n_tensors):
            r.string(keep=False)
            dims = [r.unpack("Q") for _ in range(r.unpack("I"))]
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(r.unpack("I"))]
            n = 1
            for d in dims:
                n *= d
            extents.append(r.unpack("Q") + n // block * type_size)
        align = int(meta.get("general.alignment") or 32)
        data_start = -(-f.tell() // align) * align
    return GGUFInfo(meta, n_tensors, data_start + max(extents, default=0), size)


def read_gguf_info(path: Path) -> GGUFInfo:
    """Parse `path`'s header (cached per size + mtime); `CorruptSourceError` when the header
    is unreadable or a tensor lies past the end of the file (a truncated download)."""
    path = Path(path)
    st = path.stat()
    try:
        info = _read(str(path), st.st_size, st.st_mtime_ns)
    except CorruptSourceError:
        raise
    except (EOFError, ValueError, KeyError, struct.error, UnicodeDecodeError) as exc:
        raise CorruptSourceError(f"corrupt or truncated GGUF file {path}: {exc}") from exc
    if info.n_tensors == 0 or info.data_end > info.file_size:
        raise CorruptSourceError(f"truncated GGUF file {path}: tensors need {info.data_end} "
                                 f"bytes, the file has {info.file_size}")
    return info
