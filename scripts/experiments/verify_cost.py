"""What a target call over n new positions costs, relative to a plain step (n = 1), per model.

    python scripts/experiments/verify_cost.py smollm2-135m smollm2-135m-q8 --reps 9

One request's KV cache with a 120-token random prompt; each call feeds n random tokens after it
and is rolled back. Models and positions are interleaved, so a drifting machine moves every
column alike. Prints medians (ms) and the ratio to n = 1 of the same model: the verify cost
``v(k)`` of a chain of k = n - 1 drafts (docs/architecture.md's cost model).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from specdec_rt.engine.loading import ensure_built
from specdec_rt.ort.model import OrtModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="recipe names or export folders")
    ap.add_argument("--positions", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    ns = [int(x) for x in a.positions.split(",")]
    rng = np.random.default_rng(0)
    runs = {}
    for name in a.models:
        m = OrtModel(ensure_built(name), max_length=512, threads=a.threads)
        s = m.start()
        s.run_sync(rng.integers(100, 20000, size=120).astype(np.int64), 1, 0)
        runs[name] = (m, s, s.length)
    times = {(name, n): [] for name in a.models for n in ns}
    for _ in range(a.reps):
        for n in ns:
            for name, (_, s, base) in runs.items():
                ids = rng.integers(100, 20000, size=n).astype(np.int64)
                t = time.perf_counter()
                s.run_sync(ids, n, base)
                times[(name, n)].append(time.perf_counter() - t)
                s.rollback(base)
    print("positions " + " ".join(f"{n:>12}" for n in ns))
    for name in a.models:
        one = np.median(times[(name, 1)])
        row = [f"{np.median(times[(name, n)]) * 1e3:5.2f} {np.median(times[(name, n)]) / one:4.2f}x" for n in ns]
        print(f"{name}: " + " ".join(f"{c:>12}" for c in row))


if __name__ == "__main__":
    main()
