"""MatMulNBits forms on the CPU: time and session memory of one weight, one form per process.

    python scripts/experiments/matmulnbits_forms.py '{"bits": 4, "bs": 32, "t1": "f16", "zp": "none"}'

Keys: bits (4 | 8), bs (block size), t1 ("f32" | "f16": the type of A, the scales and the
output), zp ("none" | "u8": packed uint8 zero points | "float": zero points of type T1), K, N
(default 1536 x 8960, a Qwen2.5 1.5B MLP projection), acc (accuracy level, default 4), reps,
cfg (session config entries). Prints one JSON line: the RSS the session creation added, and the
best of 3 x reps calls for 1 and 4 rows. Used for the 2026-12-07 Qwen memory note.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS"))


def build(cfg: dict) -> onnx.ModelProto:
    k, n, bits, bs = cfg.get("K", 1536), cfg.get("N", 8960), cfg["bits"], cfg["bs"]
    blocks = k // bs
    rng = np.random.default_rng(0)
    dtype = np.float16 if cfg["t1"] == "f16" else np.float32
    codes = rng.integers(0, 256, size=(n, blocks, bs * bits // 8), dtype=np.uint8)
    scales = (rng.random((n, blocks)) * 0.01 + 0.001).astype(dtype)
    inits = [numpy_helper.from_array(codes, "B"), numpy_helper.from_array(scales, "S")]
    if cfg["zp"] == "u8":
        packed = rng.integers(0, 256, size=(n, (blocks * bits + 7) // 8), dtype=np.uint8)
        inits.append(numpy_helper.from_array(packed, "Z"))
    elif cfg["zp"] == "float":
        inits.append(numpy_helper.from_array((rng.random((n, blocks)) * (1 << bits)).astype(dtype), "Z"))
    elem = TensorProto.FLOAT16 if cfg["t1"] == "f16" else TensorProto.FLOAT
    node = helper.make_node(
        "MatMulNBits",
        ["A"] + [t.name for t in inits],
        ["Y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=bits,
        block_size=bs,
        accuracy_level=cfg.get("acc", 4),
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("A", elem, ["M", k])],
        [helper.make_tensor_value_info("Y", elem, ["M", n])],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    return model


def main() -> None:
    cfg = json.loads(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.onnx")
        onnx.save(build(cfg), path, save_as_external_data=True, location="m.onnx.data")
        options = ort.SessionOptions()
        options.intra_op_num_threads = 2
        for key, value in cfg.get("cfg", {}).items():
            options.add_session_config_entry(key, value)
        before = rss_mib()
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        added = rss_mib() - before
        dtype = np.float16 if cfg["t1"] == "f16" else np.float32
        out: dict[str, float] = {}
        for rows in (1, 4):
            x = np.random.default_rng(1).standard_normal((rows, cfg.get("K", 1536))).astype(dtype)
            for _ in range(5):
                session.run(None, {"A": x})
            reps, best = cfg.get("reps", 200), []
            for _ in range(3):
                start = time.perf_counter()
                for _ in range(reps):
                    session.run(None, {"A": x})
                best.append((time.perf_counter() - start) / reps * 1e6)
            out[f"rows{rows}_us"] = round(min(best), 1)
    print(json.dumps({**cfg, "session_rss_added_mib": round(added, 1), **out}))


if __name__ == "__main__":
    main()
