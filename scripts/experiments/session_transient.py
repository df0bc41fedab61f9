"""Peak and settled memory of one ONNX Runtime session creation, by session option.

    python scripts/experiments/session_transient.py GRAPH.onnx '{"opt": "disable", "cfg": {...}}'

A thread polls /proc/self/smaps_rollup every 2 ms while the session is created; prints one JSON
line: RSS and anonymous memory before, at the peak and 0.2 s after, VmHWM, and the load time.
Options: opt ("disable" | "basic"; default ORT_ENABLE_ALL, as specdec_rt loads), arena (false:
no CPU arena), cfg (session config entries, e.g. session.disable_prepacking). Used for the
2026-12-07 Qwen memory note.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import onnxruntime as ort


def rollup() -> dict[str, float]:
    found: dict[str, float] = {}
    with open("/proc/self/smaps_rollup") as smaps:
        for line in smaps:
            parts = line.split()
            if parts[0] in ("Rss:", "Anonymous:"):
                found[parts[0][:-1]] = int(parts[1]) / 1024
    return found


def main() -> None:
    path, cfg = sys.argv[1], json.loads(sys.argv[2])
    peak = {"Rss": 0.0, "anon_at_peak": 0.0, "anon_max": 0.0}
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            now = rollup()
            if now["Rss"] > peak["Rss"]:
                peak.update(Rss=now["Rss"], anon_at_peak=now["Anonymous"])
            peak["anon_max"] = max(peak["anon_max"], now["Anonymous"])
            time.sleep(0.002)

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.log_severity_level = 3
    options.graph_optimization_level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    }.get(cfg.get("opt", ""), ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    if cfg.get("arena") is False:
        options.enable_cpu_mem_arena = False
    for key, value in cfg.get("cfg", {}).items():
        options.add_session_config_entry(key, value)
    before = rollup()
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    start = time.time()
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    seconds = time.time() - start
    time.sleep(0.2)
    after = rollup()
    done.set()
    poller.join()
    with open("/proc/self/status") as status:
        hwm = next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmHWM"))
    del session
    rounded = {key: round(value) for key, value in peak.items()}
    print(
        json.dumps(
            {
                "cfg": cfg,
                "graph": path,
                "before": before,
                "peak": rounded,
                "after": after,
                "hwm_mib": round(hwm),
                "load_s": round(seconds, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
