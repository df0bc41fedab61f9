"""A fast GGUF header reader: scalar metadata, the token list and types, tensor extents.

`gguf.GGUFReader` materializes every array (a Qwen vocabulary: 150k tokens + merges) as numpy
views and takes seconds to a minute; checking a file's architecture, special tokens and that no
tensor runs past the end of the file needs only the header (merges are skipped).
Layout (GGUF v2/v3, little-endian):

    "GGUF" u32 version, u64 n_tensors, u64 n_kv
    n_kv x (string key, u32 type, value)          arrays: u32 item type, u64 count, items
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml type, u64 offset)
    padding to `general.alignment` (default 32), then tensor data (offsets relative to it)

The file is untrusted: every count and length is checked against the bytes left in the file
before anything is allocated or looped over, and `check_model` compares the architecture's
metadata (block count, embedding width, heads, vocabulary) with the tensor index and estimates
the memory the export needs against the machine's before any weights are loaded.
"""

from __future__ import annotations

import math
import os
import re
import struct
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, BinaryIO

from specdec_rt.manifest_schema import MAX_TOKEN_ID

from .errors import CorruptSourceError, InsufficientMemoryError

__all__ = ["GGUFInfo", "GGUFArray", "read_gguf_info", "check_model", "machine_memory", "export_memory_estimate"]

MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 256  # tensor names (llama.cpp: 64)
MAX_ALIGNMENT = 1 << 16
# architecture metadata bounds (inclusive), checked before anything is sized from them
GGUF_LIMITS = {
    "block_count": (1, 1024),
    "embedding_length": (1, 1 << 16),
    "feed_forward_length": (1, 1 << 20),
    "attention.head_count": (1, 1024),
    "attention.head_count_kv": (1, 1024),
    "context_length": (2, 1 << 24),
}
MAX_VOCAB = MAX_TOKEN_ID  # a vocabulary's ids must be ids a manifest may hold
# optional float metadata that must be finite and > 0 when present
POSITIVE_FLOATS = ("attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.scaling.factor")

# arrays kept in full (all others are skipped): the token list and the token types
_KEEP_ARRAYS = {"tokenizer.ggml.tokens", "tokenizer.ggml.token_type"}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types of special / added tokens
# value type -> struct format of one scalar (8 = string, 9 = array handled apart)
_ITEM_LEAST = {8: 8, 9: 12}  # bytes at least of a string (its length) and an array (type, count) item
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass(frozen=True)
class GGUFArray:
    """An array value, skipped: only its item type and length are kept."""

    item_type: int
    count: int


@dataclass(frozen=True)
class GGUFInfo:
    """Scalar metadata (strings, numbers, bools) and where the tensor data ends."""

    metadata: dict[str, Any]
    n_tensors: int
    data_end: int  # byte offset just past the last tensor
    file_size: int
    tensors: dict[str, tuple[tuple[int, ...], int]] = field(
        default_factory=dict
    )  # name -> (dims (ggml order: fastest first), type)
    offsets: dict[str, int] = field(default_factory=dict)  # name -> offset of its data from `data_start`
    data_start: int = 0  # byte offset of the tensor data

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture"))

    @property
    def vocab_size(self) -> int | None:
        """`<arch>.vocab_size`, else the length of the token list."""
        explicit = self.metadata.get(f"{self.architecture}.vocab_size")
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        size = explicit or (len(tokens) if tokens is not None else None)
        return int(size) if size is not None else None

    def special_tokens(self) -> list[str]:
        """Tokens typed CONTROL or USER_DEFINED (e.g. Qwen's `<|fim_prefix|>`)."""
        tokens = self.metadata.get("tokenizer.ggml.tokens") or []
        types = self.metadata.get("tokenizer.ggml.token_type")
        if types is None:
            return []
        return [tokens[i] for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)]


class _Reader:
    def __init__(self, f: BinaryIO, size: int):
        self.f = f
        self.size = size

    def left(self) -> int:
        return self.size - self.f.tell()

    def claim(self, n: int, what: str) -> None:
        """Refuse a count or length that needs more bytes than the file has left."""
        if n > self.left():
            raise EOFError(f"{what} claims {n} bytes, the file has {max(self.left(), 0)} left")

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        raw = self.f.read(size)
        if len(raw) != size:
            raise EOFError("unexpected end of file in the GGUF header")
        return struct.unpack("<" + fmt, raw)[0]

    def length(self, what: str) -> int:
        """A string's length, checked against the bytes left."""
        size: int = self.unpack("Q")
        if size > 1 << 30:
            raise ValueError(f"implausible string length {size}")
        self.claim(size, what)
        return size

    def string(self) -> str:
        size = self.length("a string")
        raw = self.f.read(size)
        if len(raw) != size:
            raise EOFError("unexpected end of file in the GGUF header")
        return raw.decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        self.f.seek(self.length("a string"), 1)

    def value(self, vtype: int, keep_array: bool = False) -> Any:
        if vtype in _SCALAR:
            return self.unpack(_SCALAR[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:  # arrays are skipped unless kept: only their extent matters
            return self.array(keep_array)
        raise ValueError(f"unknown GGUF value type {vtype}")

    def array(self, keep: bool) -> Any:
        """An array's items (`keep`, strings or scalars), else a `GGUFArray` of its extent."""
        itype, count = self.unpack("I"), self.unpack("Q")
        item = struct.calcsize("<" + _SCALAR[itype]) if itype in _SCALAR else _ITEM_LEAST.get(itype)
        if item is None:
            raise ValueError(f"unknown GGUF array item type {itype}")
        self.claim(count * item, "an array")  # strings: at least their 8-byte length each
        if keep and itype == 8:
            return [self.string() for _ in range(count)]
        if keep and itype in _SCALAR:
            fmt = "<" + _SCALAR[itype]
            raw = self.f.read(count * struct.calcsize(fmt))
            return [v[0] for v in struct.iter_unpack(fmt, raw)]
        if itype in _SCALAR:
            self.f.seek(count * struct.calcsize("<" + _SCALAR[itype]), 1)
        elif itype == 8:
            for _ in range(count):
                self.skip_string()
        else:
            for _ in range(count):
                self.value(itype)
        return GGUFArray(itype, count)


def _read_metadata(reader: _Reader) -> dict[str, Any]:
    count = reader.unpack("Q")
    reader.claim(count * 12, f"{count} metadata entries")  # key length + type, at least
    meta: dict[str, Any] = {}
    for _ in range(count):
        key = reader.string()
        meta[key] = reader.value(reader.unpack("I"), keep_array=key in _KEEP_ARRAYS)
    return meta


def _read_index(reader: _Reader, count: int) -> tuple[dict[str, tuple[tuple[int, ...], int]], dict[str, int], int]:
    """(name -> (dims, type), name -> offset, bytes past the data start the last tensor ends at)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    tensors: dict[str, tuple[tuple[int, ...], int]] = {}
    offsets: dict[str, int] = {}
    end = 0
    for _ in range(count):
        name = reader.string()
        n_dims = reader.unpack("I")
        if n_dims > MAX_DIMS or len(name) > MAX_NAME:
            raise ValueError(f"tensor {name[:64]!r}: {n_dims} dimensions or a name over {MAX_NAME} characters")
        dims = tuple(int(reader.unpack("Q")) for _ in range(n_dims))
        gtype = int(reader.unpack("I"))
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(gtype)]
        offset = int(reader.unpack("Q"))
        end = max(end, offset + math.prod(dims) // block * type_size)
        tensors[name], offsets[name] = (dims, gtype), offset
    return tensors, offsets, end


@lru_cache(maxsize=8)
def _read(path: str, size: int, mtime_ns: int) -> GGUFInfo:
    with open(path, "rb", buffering=1 << 20) as handle:
        reader = _Reader(handle, size)
        if handle.read(4) != b"GGUF":
            raise CorruptSourceError(f"{path} is not a GGUF file (bad magic)")
        version = reader.unpack("I")
        if version not in (2, 3):
            raise CorruptSourceError(f"{path}: unsupported GGUF version {version}")
        n_tensors = reader.unpack("Q")
        reader.claim(n_tensors * 24, f"{n_tensors} tensor entries")  # name length, dims, type, offset
        meta = _read_metadata(reader)
        tensors, offsets, end = _read_index(reader, n_tensors)
        align = meta.get("general.alignment", 32)
        if type(align) is not int or not 1 <= align <= MAX_ALIGNMENT or align & (align - 1):
            raise ValueError(f"general.alignment {align!r} is not a power of two up to {MAX_ALIGNMENT}")
        data_start = -(-handle.tell() // align) * align
    return GGUFInfo(
        metadata=meta,
        n_tensors=n_tensors,
        data_end=data_start + end,
        file_size=size,
        tensors=tensors,
        offsets=offsets,
        data_start=data_start,
    )


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
        raise CorruptSourceError(
            f"truncated GGUF file {path}: tensors need {info.data_end} bytes, the file has {info.file_size}"
        )
    return info


def machine_memory() -> int:
    """Physical memory of this machine in bytes (MemTotal, else sysconf); 0 if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return 0


def export_memory_estimate(info: GGUFInfo) -> int:
    """Bytes the export needs at its peak, roughly: transformers dequantizes every tensor to
    float32 (4 bytes a weight) and holds the model plus loading buffers, about 1.5x the float32
    size, plus ~1 GiB for the libraries (measured: 1.37 GB for smollm2-135m, 9.1 GB for
    qwen2.5-coder-1.5b, see docs/export.md)."""
    n = 0
    for dims, _ in info.tensors.values():
        count = 1
        for d in dims:
            count *= d
        n += count
    return 6 * n + (1 << 30)


def _meta_int(info: GGUFInfo, key: str, path: str | os.PathLike[str]) -> int:
    """A required architecture integer, within `GGUF_LIMITS`."""
    value = _meta_optional_int(info, key, path)
    if value is None:
        lo, hi = GGUF_LIMITS[key]
        raise CorruptSourceError(f"GGUF {path}: {info.architecture}.{key} = None is not an integer from {lo} to {hi}")
    return value


def _meta_optional_int(info: GGUFInfo, key: str, path: str | os.PathLike[str]) -> int | None:
    arch = info.architecture
    value = info.metadata.get(f"{arch}.{key}")
    if value is None:
        return None
    lo, hi = GGUF_LIMITS[key]
    if type(value) is not int or not lo <= value <= hi:
        raise CorruptSourceError(f"GGUF {path}: {arch}.{key} = {value!r} is not an integer from {lo} to {hi}")
    return value


def _meta_positive(info: GGUFInfo, key: str, path: str | os.PathLike[str]) -> None:
    """An optional float (epsilon, rotary base) must be finite and > 0 when present: a NaN or
    negative one only fails deep inside ONNX Runtime, or yields a misleading rotary error."""
    arch = info.architecture
    value = info.metadata.get(f"{arch}.{key}")
    if value is None:
        return
    if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
        raise CorruptSourceError(f"GGUF {path}: {arch}.{key} = {value!r} is not a finite number > 0")


def _check_heads(info: GGUFInfo, path: str | os.PathLike[str], embd: int) -> None:
    """KV heads divide the heads; without a key length, the heads divide the width."""
    arch = info.architecture
    heads = _meta_int(info, "attention.head_count", path)
    kv_heads = _meta_optional_int(info, "attention.head_count_kv", path) or heads
    if kv_heads > heads:
        raise CorruptSourceError(f"GGUF {path}: {heads} heads / {kv_heads} KV heads do not fit embedding length {embd}")
    if heads % kv_heads:
        raise CorruptSourceError(
            f"GGUF {path}: {arch}.attention.head_count = {heads} is not a "
            f"multiple of {arch}.attention.head_count_kv = {kv_heads}"
        )
    if info.metadata.get(f"{arch}.attention.key_length") is None and embd % heads:
        raise CorruptSourceError(
            f"GGUF {path}: {arch}.embedding_length = {embd} is not a multiple of {arch}.attention.head_count = {heads}"
        )


def _check_blocks(info: GGUFInfo, path: str | os.PathLike[str], blocks: int) -> None:
    """The tensor index has exactly blocks 0 .. block_count - 1."""
    found = set()
    for name in info.tensors:
        match = re.fullmatch(r"blk\.(\d{1,7})\..+", name)
        if match:
            found.add(int(match.group(1)))
    if found != set(range(blocks)):
        missing = sorted(set(range(blocks)) - found)
        raise CorruptSourceError(
            f"GGUF {path}: {info.architecture}.block_count = {blocks} but the tensor index has "
            f"{len(found)} blocks" + (f" (block {missing[0]} is missing)" if missing else f" (up to blk.{max(found)})")
        )


def _check_vocabulary(info: GGUFInfo, path: str | os.PathLike[str], embd: int) -> int:
    """The embedding's rows: the vocabulary, which the token list and `vocab_size` must fit."""
    embed = info.tensors.get("token_embd.weight")
    if embed is None or len(embed[0]) != 2 or embed[0][0] != embd:
        raise CorruptSourceError(
            f"GGUF {path}: token_embd.weight {embed[0] if embed else 'missing'} does not match embedding length {embd}"
        )
    vocab = embed[0][1]
    tokens = info.metadata.get("tokenizer.ggml.tokens")
    claimed = info.metadata.get(f"{info.architecture}.vocab_size")
    if (
        not 1 <= vocab <= MAX_VOCAB
        or (claimed is not None and claimed != vocab)
        or (isinstance(tokens, list) and len(tokens) > vocab)
    ):
        raise CorruptSourceError(
            f"GGUF {path}: vocabulary {claimed if claimed is not None else len(tokens or [])} "
            f"does not match token_embd.weight's {vocab} rows"
        )
    return vocab


def _check_shapes(info: GGUFInfo, path: str | os.PathLike[str], *, embd: int, vocab: int, ffn: int) -> None:
    """The LM head, the first block's MLP and norm have the shapes the metadata implies."""
    for name, want in (
        ("output.weight", (embd, vocab)),
        ("blk.0.ffn_up.weight", (embd, 2 * ffn if info.architecture == "phi3" else ffn)),  # Phi-3: gate and up fused
        ("blk.0.attn_norm.weight", (embd,)),
    ):
        got = info.tensors.get(name)
        if got is not None and got[0] != want:
            raise CorruptSourceError(f"GGUF {path}: {name} is {list(got[0])}, the metadata implies {list(want)}")


def check_model(info: GGUFInfo, path: str | os.PathLike[str]) -> None:
    """Compare a GGUF's architecture metadata with its tensor index and its size with this
    machine's memory, before anything is loaded: a header claiming 200000 blocks, a vocabulary
    its embedding does not have, or a model too large to export fails here in milliseconds
    (transformers would otherwise allocate the claimed model and die in `std::bad_alloc`)."""
    blocks = _meta_int(info, "block_count", path)
    embd = _meta_int(info, "embedding_length", path)
    _check_heads(info, path, embd)
    ffn = _meta_int(info, "feed_forward_length", path)
    _meta_optional_int(info, "context_length", path)
    for key in POSITIVE_FLOATS:
        _meta_positive(info, key, path)
    _check_blocks(info, path, blocks)
    _check_shapes(info, path, embd=embd, vocab=_check_vocabulary(info, path, embd), ffn=ffn)
    need, have = export_memory_estimate(info), machine_memory()
    if have and need > have:
        raise InsufficientMemoryError(
            f"exporting {Path(path).name} needs about {need / 2**30:.1f} GiB of memory "
            f"(float32 weights and loading buffers), this machine has {have / 2**30:.1f} GiB"
        )
