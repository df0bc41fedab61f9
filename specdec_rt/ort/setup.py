"""Setting up an ONNX Runtime session for a model folder: threads, providers, the CPU facts its
kernels depend on, and the check that the graph has what its manifest names."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError
from ..manifest_schema import MANIFEST
from .manifest import PACKED_ROLES, Manifest

__all__ = ["default_threads", "pick_providers", "use_global_thread_pool", "check_graph", "ISA_FLAGS", "cpu_facts"]


def default_threads() -> int:
    """Intra-op threads: the CPUs this process may use (2 on a 2-core machine)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def pick_providers(provider: str, ort: Any) -> list[str]:
    """``"auto"``: CUDA when onnxruntime-gpu sees a GPU, else CPU; or ``"cpu"`` / ``"cuda"``."""
    available = ort.get_available_providers()
    if provider == "cpu":
        return ["CPUExecutionProvider"]
    if provider == "cuda":
        if "CUDAExecutionProvider" not in available:
            raise ModelLoadError(
                f"provider 'cuda' asked for, but ONNX Runtime offers only {available} "
                "(install the gpu extra: onnxruntime-gpu)"
            )
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if provider != "auto":
        raise ModelLoadError(f"unknown provider {provider!r}; use 'auto', 'cpu' or 'cuda'")
    return (
        ["CUDAExecutionProvider", "CPUExecutionProvider"]
        if "CUDAExecutionProvider" in available
        else ["CPUExecutionProvider"]
    )


# the CPU features ONNX Runtime's MLAS kernels choose between (x86 and Arm)
ISA_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "asimd",
    "asimddp",
    "i8mm",
    "sve",
    "bf16",
)


def cpu_facts() -> dict[str, Any]:
    """The CPU's model name and the instruction-set flags of :data:`ISA_FLAGS` it has (Linux:
    from /proc/cpuinfo; elsewhere what :mod:`platform` says, and no flags)."""
    name, flags = platform.processor() or platform.machine(), set()
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read(1 << 20)  # the first CPUs' entries say it all
        for line in text.splitlines():
            label, _, value = line.partition(":")
            label = label.strip().lower()
            if label in ("model name", "hardware", "cpu model") and name in (platform.processor(), platform.machine()):
                name = value.strip()
            elif label in ("flags", "features"):
                flags |= set(value.split())
    return {"cpu": name[:200], "machine": platform.machine(), "isa": sorted(flags & set(ISA_FLAGS))}


_GLOBAL_POOL: dict[str, int] = {"threads": 0}


def use_global_thread_pool(threads: int | None = None) -> bool:
    """Run every ONNX Runtime session of this process on one shared thread pool.

    Call it once, before any ONNX Runtime session exists (the CLI does). It is faster when draft
    and target alternate: with a pool per session, one pool's idle threads spin while the other
    pool works (docs/decisions/0003-thread-pools.md). (The per-session default now spins during
    runs only, which removes the fight; see ``_configure_threads``.)
    Not the default because ONNX Runtime then requires every session in the process, including
    other libraries', to set ``use_per_session_threads = False``. Returns False if ONNX Runtime
    was already initialised (then nothing changes).
    """
    import onnxruntime as ort

    if _GLOBAL_POOL["threads"]:
        return True
    threads = threads or default_threads()
    try:
        ort.set_global_thread_pool_sizes(threads, 1)
    except Exception:  # noqa: BLE001 - the ONNX Runtime environment exists already
        return False
    _GLOBAL_POOL["threads"] = threads
    return True


def _configure_threads(so: Any, threads: int, alone: bool = False) -> int:
    """The shared pool if :func:`use_global_thread_pool` set one up; else a pool per session
    whose threads spin while a run dispatches its nodes (waking a sleeping thread for each of a
    graph's ~500 small nodes costs more than the nodes) and, unless the model is ``alone`` in
    its engine (no draft model beside it), stop spinning when the run ends: two pools spinning
    between runs fight for the cores (above), and so do they with the Python thread
    (docs/decisions/0003-thread-pools.md)."""
    if _GLOBAL_POOL["threads"]:
        so.use_per_session_threads = False
        return _GLOBAL_POOL["threads"]
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "1")
    if not alone:
        so.add_session_config_entry("session.force_spinning_stop", "1")
    return threads


def check_graph(m: Manifest, session: Any) -> None:
    """The ONNX graph has every input/output the manifest names, with compatible shapes."""
    ins = {i.name: i for i in session.get_inputs()}
    outs = {o.name: o for o in session.get_outputs()}
    path = Path(m.folder) / MANIFEST
    wanted = [
        (m.inputs[r], ins, "input")
        for r in ("input_ids", "seqlens_k", "total_sequence_length", "logits_index", *PACKED_ROLES)
        if m.inputs.get(r)
    ]
    wanted += [(m.outputs["logits"], outs, "output")]
    for layer in range(m.num_layers):
        wanted += [
            (m.kv_name("past_key", layer), ins, "input"),
            (m.kv_name("past_value", layer), ins, "input"),
            (m.kv_name("present_key", layer), outs, "output"),
            (m.kv_name("present_value", layer), outs, "output"),
        ]
    for name, table, kind in wanted:
        if name not in table:
            raise ModelLoadError(f"{path}: names {kind} {name!r}, which {m.onnx_file.name} does not have")
    named = {v for v in m.inputs.values() if v} | {
        m.kv_name(r, i) for r in ("past_key", "past_value") for i in range(m.num_layers)
    }
    unnamed = sorted(n for n in ins if n not in named and not n.startswith("past_key_values."))
    if unnamed:
        raise ModelLoadError(
            f"{path}: {m.onnx_file.name} takes input {unnamed[0]!r}, which the manifest does not "
            "name (a manifest from another export: rebuild the model with python -m export)"
        )
    extra = [
        n
        for n in ins
        if n.startswith("past_key_values.") and not (n.split(".")[1].isdigit() and int(n.split(".")[1]) < m.num_layers)
    ]
    if extra:
        raise ModelLoadError(f"{path}: num_layers={m.num_layers} but the graph has {extra[0]!r}")
    kv = ins[m.kv_name("past_key", 0)].shape  # [B, kv_heads, max_len, head_dim]
    if len(kv) != 4 or kv[1] != m.num_kv_heads or kv[3] != m.head_dim:
        raise ModelLoadError(
            f"{path}: KV shape [B, {m.num_kv_heads}, max_len, {m.head_dim}] expected, the graph has {kv}"
        )
    vocab = outs[m.outputs["logits"]].shape[-1]
    if isinstance(vocab, int) and vocab != m.vocab_size:
        raise ModelLoadError(f"{path}: vocab_size={m.vocab_size} but the graph's logits have {vocab}")
