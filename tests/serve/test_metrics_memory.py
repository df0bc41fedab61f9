"""``/metrics`` reports the server process's resident memory and the bytes of the loaded models'
weight files (specdec_rt.engine.memory)."""

from __future__ import annotations

import mmap

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from serve_util import EchoEngine, client, metric, metric_values, run  # noqa: E402

from specdec_rt.engine.memory import (  # noqa: E402
    engine_weights_bytes,
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
