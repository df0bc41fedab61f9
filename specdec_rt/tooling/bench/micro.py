"""Step-cost micro-benchmarks on the target: verify width, context length, memory, bandwidth.

All ratios are measured side by side (interleaved repetitions, medians), so machine noise hits
both sides alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ...ort.manifest import Manifest
    from ...ort.model import OrtModel
    from ...speculation.protocols import CacheSession

__all__ = ["step_costs", "memory_bandwidth_gbs", "rss_mb", "weight_bytes", "request_memory"]


def rss_mb() -> dict[str, float]:
    """Resident memory of this process now and at its peak (Linux ``/proc``), in MB."""
    out: dict[str, float] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out["rss_mb" if line.startswith("VmRSS") else "peak_rss_mb"] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


def memory_bandwidth_gbs(mb: int = 512, repeats: int = 5) -> float:
    """Copy bandwidth (bytes read + bytes written per second, GB/s), best of ``repeats``."""
    src = np.ones(mb * (1 << 20) // 8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best / 1e9


def weight_bytes(manifest: Manifest) -> int:
    """Bytes of weights a decoding step reads: the ONNX file and its external data, less a
    float32 embedding table (a step reads one row of it; a quantized one is the LM head's or small)."""
    files = manifest.raw.get("files", {})
    total: int = sum(info.get("bytes", 0) for name, info in files.items() if name.startswith(manifest.onnx_file.name))
    quantized_table = manifest.raw.get("onnx", {}).get("embedding", {}).get("op") == "GatherBlockQuantized"
    return total - (0 if quantized_table else manifest.vocab_size * manifest.hidden_size * 4)


def loaded_memory(ctx: dict[str, Any], say: Callable[[str], None] = lambda msg: None) -> dict[str, Any]:
    """This process's memory once the models are loaded, and a line saying so: the weight files'
    MB on disk (``weights_mb``), mapped and resident in this process (``weights_mapped_mb``,
    ``weights_resident_mb``), resident memory (``rss_mb``), and per model (``kv``, by name) its
    role, KV bytes per position, positions per slot and MB its KV pool reserves."""
    from ...engine.memory import mapped_bytes, models_weight_files, resident_bytes, weights_bytes

    models = [ctx["target"], *ctx.get("draft_models", [])]
    mapped = mapped_bytes(models_weight_files(models))
    memory: dict[str, Any] = {
        "weights_mb": weights_bytes([model.manifest.onnx_file for model in models]) / 2**20,
        "weights_mapped_mb": mapped.mapped / 2**20,
        "weights_resident_mb": mapped.resident / 2**20,
        "rss_mb": resident_bytes() / 2**20,
        "kv": _kv_figures(models, target=ctx["target"]),
    }
    kv_reserved = sum(kv["reserved_mb"] for kv in memory["kv"].values())
    say(
        f"weights {memory['weights_mb']:.0f} MB on disk, {memory['weights_resident_mb']:.0f} MB of them "
        f"resident; resident {memory['rss_mb']:.0f} MB once loaded; KV pools reserve {kv_reserved:.0f} MB "
        "(committed as positions are written)"
    )
    return memory


def _kv_figures(models: list[Any], target: object) -> dict[str, dict[str, Any]]:
    """Per model with a KV pool, by name: its role, KV bytes per position, positions per slot
    and MB its pool reserves."""
    from ...engine.memory import models_kv

    figures = {}
    for model in models:
        for role, name, usage in models_kv([model], target=target):
            figures[name] = {
                "role": role,
                "bytes_per_position": usage.position_bytes,
                "positions_per_slot": model.max_length + 1,
                "reserved_mb": usage.reserved_bytes / 2**20,
            }
    return figures


_MEMORY_PROBE = """
import json, sys, anyio
from specdec_rt.ort import OrtModel, OrtTargetVerifier, OrtDraftInferrer, use_global_thread_pool
from specdec_rt.speculation.scheduler import SpecDecScheduler
from specdec_rt.tooling.bench.micro import rss_mb
use_global_thread_pool(int(sys.argv[3]))
folder, draft, n = sys.argv[1], sys.argv[2], 2048
target = OrtModel(folder, max_length=n, slots=1)
n = target.max_length
drafter = OrtDraftInferrer(OrtModel(draft, max_length=n, slots=1)) if draft else None
sched = SpecDecScheduler(drafter, OrtTargetVerifier(target))
prompt = [(7 * i) % target.vocab_size for i in range(n - 48)]
anyio.run(lambda: sched.run(prompt, 48, mode="spec" if drafter else "ar"))
print(json.dumps({"tokens": n, **rss_mb()}))
"""


def request_memory(folder: Path, draft_folder: Path | None, threads: int) -> dict[str, Any]:
    """Resident memory of a fresh process holding the target, one draft and the KV caches of one
    2,048-token request (prefill + 48 generated tokens), in MB."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, str(folder), str(draft_folder or ""), str(threads)],
        capture_output=True,
        text=True,
        check=True,
    )
    memory: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return memory


async def _time(session: CacheSession, ids: np.ndarray, rows: int, back_to: int) -> float:
    t = time.perf_counter()
    await session.extend(ids, rows)
    dt = time.perf_counter() - t
    session.rollback(back_to)
    return dt


async def step_costs(
    model: OrtModel,
    *,
    reps: int = 20,
    short: int = 100,
    long: int = 2000,
    width: int = 5,
    progress: Callable[[str], object] = lambda msg: None,
) -> dict[str, Any]:
    """Median seconds of (a) one call over ``width`` new positions vs one over 1 position at
    context ``short``; (b) a 1-token step at context ``long`` vs ``short``. Interleaved."""
    rng = np.random.default_rng(0)
    vocab = model.vocab_size
    long = min(long, model.max_length - width - 1)
    s_short, s_long = model.start(), model.start()
    try:
        await s_short.extend(rng.integers(0, vocab, short), 1)
        progress(f"prefilling {long} tokens")
        await s_long.extend(rng.integers(0, vocab, long), 1)
        one: list[float] = []
        wide: list[float] = []
        at_long: list[float] = []
        tok1 = rng.integers(0, vocab, 1)
        tokw = rng.integers(0, vocab, width)
        for _ in range(3):  # warm-up
            await _time(s_short, tok1, 1, short)
            await _time(s_short, tokw, width, short)
            await _time(s_long, tok1, 1, long)
        for _ in range(reps):
            one.append(await _time(s_short, tok1, 1, short))
            wide.append(await _time(s_short, tokw, width, short))
            at_long.append(await _time(s_long, tok1, 1, long))
    finally:
        s_short.close()
        s_long.close()
    m1, mw, ml = (statistics.median(x) for x in (one, wide, at_long))
    return {
        "step_ms_ctx_short": 1e3 * m1,
        "context_short": short,
        f"call_ms_{width}_positions": 1e3 * mw,
        "verify_width": width,
        "verify_width_ratio": mw / m1,
        "step_ms_ctx_long": 1e3 * ml,
        "context_long": long,
        "context_ratio": ml / m1,
        "reps": reps,
    }
