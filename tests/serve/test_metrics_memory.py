"""``/metrics`` reports the server process's resident memory and the bytes of the loaded models'
weight files (specdec_rt.engine.memory)."""

from __future__ import annotations

import mmap
import sys

import anyio
import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from serve_util import EchoEngine, client, metric, metric_values, run  # noqa: E402

from specdec_rt.engine.memory import (  # noqa: E402
    engine_weights_bytes,
    mapped_bytes,
    peak_resident_bytes,
    resident_bytes,
    weight_files,
)
from specdec_rt.serve import create_app  # noqa: E402


def test_resident_memory_is_read_and_the_peak_is_no_lower():
    now = resident_bytes()
    # 64 MiB of fresh pages from the kernel, each touched: resident. (A bytearray may reuse memory
    # the allocator kept from earlier tests, already resident, and leave RSS where it was.)
    block = mmap.mmap(-1, 64 << 20)
    try:
        block[::4096] = b"\1" * len(block[::4096])
        assert resident_bytes() >= now + (48 << 20)
        assert peak_resident_bytes() >= resident_bytes() > 0
    finally:
        block.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps")
def test_mapped_bytes_counts_a_files_mapping_and_its_resident_pages(tmp_path):
    path = tmp_path / "model.onnx.data"
    path.write_bytes(b"\1" * (64 * mmap.PAGESIZE))
    assert mapped_bytes([path]) == (0, 0)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
        assert mapped_bytes([path]).mapped == 64 * mmap.PAGESIZE
        sum(view[i * mmap.PAGESIZE] for i in range(16))  # 16 pages read
        assert 16 * mmap.PAGESIZE <= mapped_bytes([path]).resident <= 64 * mmap.PAGESIZE
    assert mapped_bytes([path]) == (0, 0) and mapped_bytes([]) == (0, 0)


@pytest.mark.export
def test_metrics_report_resident_memory_and_the_weights_of_target_and_draft(tiny_llama):
    files = weight_files(tiny_llama / "model.onnx") + weight_files(tiny_llama / "draft-q4" / "model.onnx")
    assert [f.name for f in files] == ["model.onnx", "model.onnx.data"] * 2
    want = sum(f.stat().st_size for f in files)

    async def check(engine):
        assert engine_weights_bytes(engine) == want
        async with client(create_app(engine)) as c:
            values = metric_values((await c.get("/metrics")).text)
        assert metric(values, "specdec_model_weights_bytes") == want
        assert metric(values, "process_resident_memory_bytes") >= 0.5 * resident_bytes() > 0

    run(check, tiny_llama, draft="q4")


def test_an_engine_without_models_reports_no_weights():
    async def check():
        async with client(create_app(EchoEngine())) as c:
            values = metric_values((await c.get("/metrics")).text)
        assert metric(values, "specdec_model_weights_bytes") == 0
        assert metric(values, "process_resident_memory_bytes") > 0

    import anyio

    anyio.run(check)


def _kv_bytes_per_position(folder) -> int:
    """Every layer's K and V for one position, from the manifest (float32 KV)."""
    from specdec_rt.ort.manifest import load_manifest

    m = load_manifest(folder)
    assert m.kv_dtype == "float32"
    return m.num_layers * 2 * m.num_kv_heads * m.head_dim * 4


@pytest.mark.export
def test_kv_gauges_follow_a_running_request(tiny_llama):
    """Reserved = bytes per position x (max_length + 1) x slots; in use = bytes per position x the
    positions the request holds while it streams, 0 once it ended; resident pages cover them."""
    from specdec_rt.engine.engine import STREAM_BUFFER

    slots, max_length, new = 2, 128, 64
    roles = {"target": _kv_bytes_per_position(tiny_llama), "draft": _kv_bytes_per_position(tiny_llama / "draft-q4")}

    async def check(engine):
        names = {"target": engine.target.name, "draft": engine.models[1].name}
        async with client(create_app(engine)) as c:

            async def scrape(name, role):
                values = metric_values((await c.get("/metrics")).text)
                return metric(values, name, role=role, model=names[role])

            for role, position in roles.items():
                assert await scrape("specdec_kv_position_bytes", role) == position
                assert await scrape("specdec_kv_reserved_bytes", role) == position * (max_length + 1) * slots
                assert await scrape("specdec_kv_used_bytes", role) == 0
            # the request runs at most STREAM_BUFFER events ahead of this reader: at its first
            # events it still holds its slots
            stream = engine.stream("the KV of one request", max_new_tokens=new, ignore_eos=True)
            used, resident, draft_used = [], [], []
            async for _event in stream:
                used.append(await scrape("specdec_kv_used_bytes", "target"))
                resident.append(await scrape("specdec_kv_resident_bytes", "target"))
                draft_used.append(await scrape("specdec_kv_used_bytes", "draft"))
            prompt, position = stream.prompt_tokens, roles["target"]
            assert prompt and len(used) > STREAM_BUFFER + 1, used
            assert used[0] > 0 and draft_used[0] > 0
            for held, pages in zip(used, resident):
                assert held % position == 0 and held // position in range(prompt, prompt + new + 1) or held == 0
                assert pages >= held  # committed pages cover the positions held
            for role in roles:
                for _ in range(50):  # the request's sessions close once its stream ends
                    if await scrape("specdec_kv_used_bytes", role) == 0:
                        break
                    await anyio.sleep(0.02)
                assert await scrape("specdec_kv_used_bytes", role) == 0
            assert await scrape("specdec_kv_resident_bytes", "target") >= max(used)  # the slot keeps its pages

    run(check, tiny_llama, draft="q4", slots=slots, max_length=max_length, prefix_cache=False, warmup=False)


@pytest.mark.export
def test_weights_mapped_and_the_peak_resident_memory_are_reported(tiny_llama):
    async def check(engine):
        async with client(create_app(engine)) as c:
            values = metric_values((await c.get("/metrics")).text)
        on_disk = metric(values, "specdec_model_weights_bytes")
        mapped = metric(values, "specdec_model_weights_mapped_bytes")
        assert 0 <= metric(values, "specdec_model_weights_resident_bytes") <= mapped
        assert mapped <= 2 * on_disk + (1 << 20)  # the export's files (and no more than a copy's)
        peak = metric(values, "specdec_process_resident_memory_peak_bytes")
        assert peak >= metric(values, "process_resident_memory_bytes") > 0

    run(check, tiny_llama, draft="q4")
