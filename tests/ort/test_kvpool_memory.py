"""The KV pool commits memory as it is written: a slot's pages become resident as its positions
fill, not when the pool is reserved nor when a model loads (counted page by page with mincore)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

import numpy as np
import pytest

from specdec_rt.ort.kvpool import KVPool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore(2) on Linux")
PAGE = mmap.PAGESIZE


def resident_pages(array: np.ndarray) -> int:
    """Pages of ``array`` (page-aligned, as the pool's buffers are) resident now."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    start = array.ctypes.data
    assert start % PAGE == 0
    pages = -(-array.nbytes // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * PAGE), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec)


def present_pages(array: np.ndarray) -> int:
    """Pages of ``array`` present in memory, from the page table (``/proc/self/pagemap`` bit 63)."""
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(array.ctypes.data // PAGE * 8)
        entries = np.frombuffer(pagemap.read(-(-array.nbytes // PAGE) * 8), dtype=np.uint64)
    return int(np.count_nonzero(entries >> np.uint64(63)))


def test_a_reserved_pool_holds_no_memory_and_a_slot_grows_with_its_positions():
    pool = KVPool(2, 2, 64, 2, max_len=4095, device="cpu")  # 4 arrays of 2 slots x 2 heads x 2 MiB
    arrays = pool.host_arrays()
    assert sum(resident_pages(a) for a in arrays) == 0
    for a in arrays:
        a[0, :, :100] = 1.0  # slot 0: 100 positions, each head's rows a contiguous run
    per_head = -(-100 * 64 * 4 // PAGE)  # 7 pages
    assert [resident_pages(a[0]) for a in arrays] == [2 * per_head] * 4
    assert [resident_pages(a[1]) for a in arrays] == [0] * 4


@pytest.mark.export
def test_loading_a_model_commits_no_slot(tiny_llama):
    from specdec_rt.ort.model import OrtModel

    model = OrtModel(tiny_llama, max_length=512, slots=2, threads=1)
    arrays = model.open_pool().host_arrays()
    heads = arrays[0].shape[1]
    slot_pages = -(-arrays[0][0].nbytes // PAGE)  # 16 pages: a whole slot of one layer's keys
    # the load-time probe wrote (and zeroed) its first 16 positions: one page of each head, no more
    assert all(resident_pages(a[0]) <= heads for a in arrays), [resident_pages(a[0]) for a in arrays]
    assert slot_pages >= 4 * heads
    session = model.start()
    session.run_sync(np.arange(3, 303) % model.vocab_size, 1, 0)
    assert all(resident_pages(a[session.slot]) >= 300 * a.shape[1] * a.shape[3] * 4 // PAGE for a in arrays)
    session.close()
    model.close()


def test_resident_bytes_reads_the_pages_written_and_given_back():
    pool = KVPool(2, 2, 64, 2, max_len=4095, device="cpu")
    arrays = pool.host_arrays()
    assert pool.resident_bytes() == 0
    assert pool.reserved_bytes == pool.token_bytes * 4096 * 2 == sum(a.nbytes for a in arrays)
    for a in arrays:
        a[1, :, :320] = 1.0  # 20 whole pages of each head's rows
    # mincore and the page table (pagemap) agree, page for page
    assert pool.resident_bytes() == sum(present_pages(a) for a in arrays) * PAGE
    assert pool.resident_bytes() == 320 * pool.token_bytes
    pool.discard(1, 0, 320)
    assert pool.resident_bytes() == sum(present_pages(a) for a in arrays) * PAGE == 0


@pytest.mark.export
def test_kv_usage_counts_the_positions_of_open_sessions(tiny_llama):
    from specdec_rt.ort.model import OrtModel

    model = OrtModel(tiny_llama, max_length=512, slots=2, threads=1, prefix_cache_bytes=0)
    m = model.manifest
    position = m.num_layers * 2 * m.num_kv_heads * m.head_dim * 4
    usage = model.kv_usage(resident=True)
    assert usage.position_bytes == position and usage.reserved_bytes == position * 513 * 2
    assert usage.positions == usage.used_bytes == 0 and usage.resident_bytes <= usage.reserved_bytes
    first, second = model.start(), model.start()
    first.run_sync(np.arange(3, 203) % model.vocab_size, 1, 0)
    second.run_sync(np.arange(3, 53) % model.vocab_size, 1, 0)
    usage = model.kv_usage(resident=True)
    assert usage.positions == 250 and usage.used_bytes == 250 * position
    assert usage.resident_bytes >= usage.used_bytes
    assert model.kv_usage().resident_bytes is None  # measured only when asked
    first.close()
    assert model.kv_usage().positions == 50
    second.close()
    assert model.kv_usage().used_bytes == 0
    model.close()
    assert model.kv_usage() is None
