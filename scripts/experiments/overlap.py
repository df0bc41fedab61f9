"""Does overlapping draft and verify pay on 2 cores? Wall time of one round: 4 draft steps + a
5-position verify, sequential on 2 threads (shared pool) vs concurrent on 1 thread each."""
import sys, time, statistics, threading, numpy as np
import onnxruntime as ort
mode = sys.argv[1]
if mode == "sequential":
    ort.set_global_thread_pool_sizes(2, 1)
from specdec_rt.ort import setup as mm
if mode == "sequential":
    mm._GLOBAL_POOL["threads"] = 2
import anyio
from specdec_rt.ort import OrtModel
root = "/root/.cache/specdec-rt/models/smollm2-135m"
async def main():
    th = 2 if mode == "sequential" else 1
    t = OrtModel(root, slots=1, threads=th); d = OrtModel(root + "/draft-" + sys.argv[2], slots=1, threads=th)
    st, sd = t.start(), d.start()
    await st.extend(np.arange(100, 300), 1); await sd.extend(np.arange(100, 300), 1)
    def verify():
        st._run(np.arange(5, 10), 5); 
    def draft():
        for j in range(4): sd._run(np.arange(5 + j, 6 + j), 1); sd._length += 1
        sd._length = 200
    xs = []
    for _ in range(15):
        t0 = time.perf_counter()
        if mode == "sequential":
            draft(); verify()
        else:
            a = threading.Thread(target=verify); b = threading.Thread(target=draft)
            a.start(); b.start(); a.join(); b.join()
        xs.append(time.perf_counter() - t0)
    print(mode, sys.argv[2], "round ms", round(statistics.median(xs) * 1e3, 1))
anyio.run(main)
