"""What uvicorn's HTTP protocol costs on this app: httptools, h11, and h11 with the connection
limits (specdec_rt/serve/connections.py; decision 0009).

    python scripts/experiments/http_protocols.py --model /path/to/export --seconds 5 --rounds 2

For each protocol in turn (the order rotates per round, so all see the same machine noise) a
server process on a free loopback port, then closed-loop keep-alive clients on raw sockets
(cheaper than an HTTP library, so that the client takes less of the CPU): ``GET /health``, and
``POST /v1/completions`` of 4 greedy tokens. Prints requests/s per protocol and round, and the
medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

KINDS = ("httptools", "h11", "h11+limits")
COMPLETION = json.dumps({"prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0}).encode()


def serve(kind: str, model: str, port: int) -> None:
    """The server process: the app of ``python -m specdec_rt serve`` on ``kind``."""
    import uvicorn

    from specdec_rt import Engine
    from specdec_rt.serve.app import create_app
    from specdec_rt.serve.connections import ConnectionLimits, uvicorn_options

    async def load():
        return await Engine.load(model, threads=1, slots=8)

    app = create_app(load, slots=8, max_queued=64)
    options = uvicorn_options(ConnectionLimits()) if kind == "h11+limits" else {"http": kind}
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, **options)


async def client(port: int, request: bytes, until: float, counts: list[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.perf_counter() < until:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
            )
            await reader.readexactly(length)
            assert head.startswith(b"HTTP/1.1 200"), head
            counts[0] += 1
    finally:
        writer.close()


async def load(port: int, request: bytes, clients: int, seconds: float) -> float:
    counts = [0]
    start = time.perf_counter()
    await asyncio.gather(*(client(port, request, start + seconds, counts) for _ in range(clients)))
    return counts[0] / (time.perf_counter() - start)


def measure(kind: str, model: str, seconds: float, clients: int) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", kind, "--model", model, "--port", str(port)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        health = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
        deadline = time.monotonic() + 120
        while True:  # until the model is loaded
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                    c.sendall(health)
                    if c.recv(100).startswith(b"HTTP/1.1 200"):
                        break
            except OSError:
                pass
            time.sleep(0.2)
        post = (
            b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(COMPLETION)
        ) + COMPLETION
        asyncio.run(load(port, post, 2, 1.0))  # warm-up
        return {
            "health": asyncio.run(load(port, health, clients, seconds)),
            "completions": asyncio.run(load(port, post, clients, seconds)),
        }
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an exported model folder (a tiny one will do)")
    ap.add_argument("--seconds", type=float, default=5.0, help="per protocol, route and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--serve", choices=KINDS, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        serve(a.serve, a.model, a.port)
        return
    results: dict[str, list[dict[str, float]]] = {k: [] for k in KINDS}
    for r in range(a.rounds):
        for kind in KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]:
            results[kind].append(measure(kind, a.model, a.seconds, a.clients))
            print(
                f"round {r + 1} {kind:11s} " + "  ".join(f"{k} {v:7.1f}/s" for k, v in results[kind][-1].items()),
                flush=True,
            )
    for kind, runs in results.items():
        print(f"median {kind:11s} " + "  ".join(f"{k} {statistics.median(x[k] for x in runs):7.1f}/s" for k in runs[0]))


if __name__ == "__main__":
    main()
