"""Replicas on Ray Serve: the replica app without a cluster, then one loopback cluster started
by ``python -m specdec_rt serve --ray`` (2 replicas of a tiny model)."""

from __future__ import annotations

import asyncio
import importlib.util
import ipaddress
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import httpx
import pytest
from serve_util import free_port, metric, metric_values, sse_data

from specdec_rt.engine.engine import Engine
from specdec_rt.errors import InvalidInputError

pytest.importorskip("ray.serve")
pytestmark = pytest.mark.export

CHAT = [{"role": "user", "content": "Write a Python function."}]
HEADER_TIMEOUT = 2.0  # the fixture's --header-timeout
SLACK = 4.0  # seconds a loaded 2-core machine may add to a deadline


def test_the_replica_app_is_the_server_app_without_a_cluster(tiny_llama):
    """The builder Ray calls on each replica: the same app and greedy output as a plain Engine,
    the engine loaded before startup returns, a replica header on every response."""
    from specdec_rt.serve.ray import RayOptions, _replica_app

    async def main():
        async with await Engine.load(tiny_llama, slots=2) as engine:
            want = await engine.generate(CHAT, 10)
        app = _replica_app(RayOptions(model=str(tiny_llama), slots=2, threads=1))
        async with app.router.lifespan_context(app):
            assert app.state.serving.state == "ready"  # loaded before the replica takes traffic
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
                r = await c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 10, "temperature": 0})
                bad = await c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": -1})
        assert r.json()["choices"][0]["message"]["content"] == want.text
        assert r.headers["x-specdec-replica"] and bad.status_code == 400

    anyio.run(main)


def test_options_from_serve_run_key_values(tiny_llama):
    from specdec_rt.serve.ray import RayOptions, _parse, build

    with pytest.raises(InvalidInputError, match="unknown option"):
        build({"model": "m", "replica": "2"})
    with pytest.raises(InvalidInputError, match="'model' option is required"):
        build({"replicas": "2"})
    with pytest.raises(InvalidInputError, match="replicas"):
        RayOptions(model="m", replicas=0)
    with pytest.raises(InvalidInputError, match="option slots='many'"):
        build({"model": "m", "slots": "many"})
    with pytest.raises(InvalidInputError, match="option autoscaling="):
        build({"model": "m", "autoscaling": "{max: 4"})
    cli = subprocess.run(
        [sys.executable, "-m", "specdec_rt", "serve", "--ray", "--cpus-per-replica", "0", "--model", str(tiny_llama)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 2 and "--cpus-per-replica: must be > 0, got 0" in cli.stderr
    assert [
        _parse(k, v)
        for k, v in (
            ("replicas", "auto"),
            ("replicas", "3"),
            ("prefix_cache", "false"),
            ("cpus_per_replica", "0.5"),
            ("autoscaling", '{"max_replicas": 4}'),
        )
    ] == ["auto", 3, False, 0.5, {"max_replicas": 4}]
    assert build({"model": str(tiny_llama), "replicas": "2"}) is not None  # an application, not run


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def ray_server(tiny_llama):
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specdec_rt",
            "serve",
            "--ray",
            "--replicas",
            "2",
            "--cpus-per-replica",
            "1",
            "--slots",
            "2",
            "--max-queued",
            "2",
            "--model",
            str(tiny_llama),
            "--port",
            str(port),
            "--header-timeout",
            str(HEADER_TIMEOUT),
            "--precision",  # the folder's own target: answers are compared with Engine.load's default
            "exported",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    deadline = time.time() + 240
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        if "listening on" in line:
            break
    assert any("listening on" in x for x in lines), "".join(lines)[-3000:]
    yield f"http://127.0.0.1:{port}", proc, lines
    if proc.poll() is None:
        proc.kill()


def test_two_replicas_serve_like_the_engine(ray_server, tiny_llama):
    url, proc, lines = ray_server
    assert "2 running" in lines[-1]  # Ray reports two running replicas

    async def main():
        async with await Engine.load(tiny_llama, slots=2) as engine:
            want_chat = (await engine.generate(CHAT, 12)).text
            want_text = (await engine.generate("def add(a, b):", 30)).text

        async def post(c, path, body):  # a polite client: waits out a 429's Retry-After
            for _ in range(30):
                r = await c.post(path, json=body)
                if r.status_code != 429:
                    return r
                await asyncio.sleep(float(r.headers.get("retry-after", 1)))
            return r

        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            rs = await asyncio.gather(
                *[
                    post(c, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 12, "temperature": 0})
                    for _ in range(8)
                ]
            )
            assert all(r.status_code == 200 for r in rs)
            assert {r.json()["choices"][0]["message"]["content"] for r in rs} == {want_chat}
            assert len({r.headers["x-specdec-replica"] for r in rs}) == 2  # both replicas served
            bad = await c.post("/v1/completions", json={"prompt": "x", "temperature": "hot"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
            # streaming: chunks arrive spread over time (one event per token in mode "ar"), [DONE] last
            times, body = [], []
            async with c.stream(
                "POST",
                "/v1/completions",
                json={"prompt": "def add(a, b):", "max_tokens": 300, "temperature": 0, "stream": True, "mode": "ar"},
            ) as r:
                t0 = time.perf_counter()
                async for chunk in r.aiter_text():
                    times.append(time.perf_counter() - t0)
                    body.append(chunk)
            events = sse_data("".join(body))
            assert events[-1] == "[DONE]" and "".join(e["choices"][0]["text"] for e in events[:-1]).startswith(
                want_text
            )
            assert len(times) > 10 and times[0] < 0.5 * times[-1], times[:3] + times[-3:]  # not buffered
            # a client that leaves mid-stream; every request after it succeeds
            async with c.stream(
                "POST", "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 200, "stream": True}
            ) as r:
                async for _ in r.aiter_text():
                    break
            after = await asyncio.gather(
                *[
                    post(c, "/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 30, "temperature": 0})
                    for _ in range(4)
                ]
            )
            assert [r.json()["choices"][0]["text"] for r in after] == [want_text] * 4
            # overload: 2 replicas x 2 slots + 2 queued in Ray's router; a burst of 16 long ones
            burst = await asyncio.gather(
                *[
                    c.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 300, "mode": "ar"})
                    for _ in range(16)
                ]
            )
            codes = [r.status_code for r in burst]
            assert set(codes) <= {200, 429} and codes.count(429) >= 6 and codes.count(200) >= 2, codes
            assert all(r.headers.get("retry-after") for r in burst if r.status_code == 429)

    anyio.run(main)


def _read_until_closed(s: socket.socket, limit: float, drip: bytes = b"") -> tuple[bytes, float]:
    """What the server sends on ``s`` until it closes it (a reset counts), and when, in seconds
    (``inf``: still open after ``limit``); ``drip`` is sent every 0.25 s meanwhile."""
    start, got = time.monotonic(), b""
    while time.monotonic() - start < limit:
        if select.select([s], [], [], 0.25)[0]:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return got, time.monotonic() - start
            got += chunk
        elif drip:
            try:
                s.sendall(drip)
            except OSError:
                pass  # the next recv says so
    return got, float("inf")


def test_the_connection_limits_hold_under_ray(ray_server):
    """Through the real port: partial headers get a 408 at --header-timeout (was: open as long
    as the client liked, Ray's proxy has no deadline), 150 header lines a 431 (was: passed to
    the replica); Ray's own proxy listens on loopback at another port."""
    url, proc, lines = ray_server
    port = int(url.rsplit(":", 1)[1])
    relay = re.search(r"relaying to Ray Serve's proxy on ([\d.]+):(\d+)", lines[-1])
    assert relay and relay[1] == "127.0.0.1" and int(relay[2]) != port, lines[-1]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        got, closed = _read_until_closed(s, HEADER_TIMEOUT + SLACK, drip=b"a")
    assert HEADER_TIMEOUT * 0.9 <= closed <= HEADER_TIMEOUT + SLACK, closed
    assert got.startswith(b"HTTP/1.1 408 ") and b"--header-timeout" in got, got
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(150))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + many + b"\r\n")
        got, closed = _read_until_closed(s, 10)
    assert got.startswith(b"HTTP/1.1 431 ") and b"--max-headers" in got, got[:300]
    # Ray's proxy itself, straight: still answers (the front is what clients reach)
    r = httpx.get(f"http://127.0.0.1:{relay[2]}/v1/models", timeout=30)
    assert r.status_code == 200 and r.headers["x-specdec-replica"]
    # Ray's proxy answers /-/routes itself, no replica asked; the front does not relay it
    assert httpx.get(f"http://127.0.0.1:{relay[2]}/-/routes", timeout=30).json() == {"/": "specdec"}
    assert httpx.get(f"{url}/-/routes", timeout=30).status_code == 404


def test_a_client_that_leaves_through_the_front_cancels_the_replicas_request(ray_server):
    """A stream left after 3 events: the replica that ran it counts one more request
    ``cancelled`` and none running (Ray's proxy saw the front close its connection)."""
    url, _, _ = ray_server

    def cancelled_and_running(c: httpx.Client) -> dict[str, tuple[float, float]]:
        seen: dict[str, tuple[float, float]] = {}
        for _ in range(40):  # Ray routes each scrape to one replica; until both answered
            r = c.get("/metrics")
            values = metric_values(r.text)
            seen[r.headers["x-specdec-replica"]] = (
                metric(values, "specdec_requests_aborted_total", reason="cancelled"),
                metric(values, "specdec_requests_running"),
            )
            if len(seen) == 2:
                break
        assert len(seen) == 2, seen
        return seen

    with httpx.Client(base_url=url, timeout=60) as c:
        before = cancelled_and_running(c)
        body = {"prompt": "Once upon a time", "max_tokens": 300, "stream": True, "mode": "ar", "temperature": 0}
        with c.stream("POST", "/v1/completions", json=body) as r:
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    break  # leaving the block closes the connection
        deadline = time.monotonic() + 15
        while True:
            now = cancelled_and_running(c)
            more = sum(now[k][0] for k in now) - sum(before[k][0] for k in before)
            if more == 1 and all(running == 0 for _, running in now.values()):
                break
            assert time.monotonic() < deadline, (before, now)
            time.sleep(0.3)


def _on_loopback(address: str) -> bool:
    """In 127.0.0.0/8 (also as an IPv4-mapped IPv6 address), or ``::1``."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if isinstance(ip, ipaddress.IPv4Address):
        return ip in ipaddress.ip_network("127.0.0.0/8")
    return ip == ipaddress.ip_address("::1")


def test_listening_sockets_of_a_process_tree_from_proc_and_psutil():
    """A child listening on every interface (IPv4, IPv6) and on loopback: /proc and psutil see the
    same four sockets, and only the loopback ones count as loopback."""
    from specdec_rt.serve.ray import listening_sockets

    code = (
        "import socket, sys, time\n"
        "ss = []\n"
        "for fam, host in ((socket.AF_INET, '0.0.0.0'), (socket.AF_INET6, '::'),"
        " (socket.AF_INET, '127.0.0.2'), (socket.AF_INET6, '::1')):\n"
        "    s = socket.socket(fam); s.bind((host, 0)); s.listen(); ss.append(s)\n"
        "print(' '.join(str(s.getsockname()[1]) for s in ss), flush=True)\n"
        "time.sleep(30)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        ports = [int(p) for p in child.stdout.readline().split()]
        found = listening_sockets(use_psutil=False)  # this process and its children
        mine = {(s.address, s.port, s.loopback) for s in found if s.pid == child.pid}
        assert mine == {
            ("0.0.0.0", ports[0], False),
            ("::", ports[1], False),
            ("127.0.0.2", ports[2], True),
            ("::1", ports[3], True),
        }
        assert all(s.process == "python" for s in found if s.pid == child.pid)
        if importlib.util.find_spec("psutil"):
            assert {
                (s.address, s.port, s.loopback) for s in listening_sockets(use_psutil=True) if s.pid == child.pid
            } == mine
        assert not [s for s in listening_sockets(child.pid) if s.pid != child.pid]  # only below the root
    finally:
        child.kill()
        child.wait()


def test_every_ray_process_listens_on_loopback_only(ray_server):
    """The whole process tree of ``serve --ray`` (Ray's GCS, raylet, agents, autoscaler monitor,
    dashboard head, workers, Serve's controller, proxy and replicas): every listening TCP socket
    on 127.0.0.0/8 (was: the GCS, raylet, agents, monitor and workers on 0.0.0.0 / ::, the
    agents also on the machine's address), and no start-up warning about one."""
    from specdec_rt.serve.ray import listening_sockets

    url, proc, lines = ray_server
    port = int(url.rsplit(":", 1)[1])
    found = listening_sockets(proc.pid, use_psutil=False)  # /proc/net/tcp{,6} and /proc/<pid>/fd
    names = {s.process for s in found}
    assert {"gcs_server", "raylet"} <= names, names  # (the monitor's fixed port 44217 may be taken)
    replicas = [s.pid for s in found if s.process.startswith("ray::ServeReplica")]
    # two replicas, each with its worker's gRPC port and Serve's inter-deployment gRPC server
    assert len(set(replicas)) == 2 and all(replicas.count(p) >= 2 for p in replicas), found
    assert ("127.0.0.1", port) in {(s.address, s.port) for s in found}  # the CLI's front (its uvicorn)
    assert len(found) >= 10, found
    outside = [s for s in found if not _on_loopback(s.address)]
    assert not outside, outside
    if importlib.util.find_spec("psutil"):
        again = listening_sockets(proc.pid, use_psutil=True)
        assert not [s for s in again if not _on_loopback(s.address)], again
        assert {(s.pid, s.port) for s in found} & {(s.pid, s.port) for s in again}
    assert not [x for x in lines if "beyond loopback" in x]


def test_sigterm_removes_the_deployment_and_every_process(ray_server):
    url, proc, _ = ray_server
    below = _descendants(proc.pid)
    assert below  # Ray's processes
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    deadline = time.time() + 30
    while time.time() < deadline and any(_alive(p) for p in below):
        time.sleep(0.5)
    assert not [p for p in below if _alive(p)]
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=2)


def test_replicas_on_two_nodes_and_losing_one(tiny_llama, monkeypatch):
    """Two raylets on this machine: one replica per node; after a node is removed, requests
    succeed again (the client retries while Ray notices)."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from specdec_rt.serve.ray import APP_NAME, RayOptions, deployment_app

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    temp = tempfile.mkdtemp(prefix="sdray-")  # short: Ray's socket paths must fit in 107 bytes
    os.makedirs(os.path.join(temp, "ray"))
    monkeypatch.setenv("RAY_TMPDIR", temp)  # all of this cluster's state goes there
    # (the nodes use this machine's address: a driver joining a cluster pinned to 127.0.0.1 is
    # sent to the machine's address and never finds its control store)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    port = free_port()
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(
            deployment_app(RayOptions(model=str(tiny_llama), replicas=2, slots=2, max_replicas_per_node=1)),
            name=APP_NAME,
            route_prefix="/",
            blocking=False,
        )
        body = {"messages": CHAT, "max_tokens": 8, "temperature": 0}
        url = f"http://127.0.0.1:{port}/v1/chat/completions"

        async def burst(n):  # at once: a replica takes `slots` at a time, the rest go to the other
            async with httpx.AsyncClient(timeout=60) as ac:
                return await asyncio.gather(*[ac.post(url, json=body) for _ in range(n)])

        with httpx.Client(timeout=30) as c:
            rs = anyio.run(burst, 8)
            assert all(r.status_code == 200 for r in rs)
            want = rs[0].json()["choices"][0]["message"]["content"]
            seen = {r.headers["x-specdec-replica"] for r in rs}
            assert len({x.split("@")[1] for x in seen}) == 2, (seen, serve.status())  # two nodes
            cluster.remove_node(nodes[0])
            ok, deadline = 0, time.time() + 120
            while ok < 6 and time.time() < deadline:  # a client that retries
                try:
                    r = c.post(url, json=body)
                    ok = ok + 1 if r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want else 0
                except httpx.HTTPError:
                    ok = 0
                if not ok:
                    time.sleep(1)
            assert ok == 6, "requests did not succeed again after a node was removed"
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def test_replicas_starting_together_with_auto_measure_once(tiny_llama, tmp_path):
    """``serve --ray`` defaults to ``--precision auto``: of two replicas starting at once on this
    node, one measures and the other waits for it (the tune file's lock) and reads its choice."""
    tune_dir, port = tmp_path / "tune", free_port()
    cmd = [sys.executable, "-m", "specdec_rt", "serve", "--ray", "--replicas", "2", "--cpus-per-replica", "1"]
    proc = subprocess.Popen(
        [*cmd, "--slots", "2", "--model", str(tiny_llama), "--port", str(port)],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "SPECDEC_RT_TUNE_DIR": str(tune_dir)},
    )
    try:
        lines: list[str] = []
        deadline = time.time() + 300
        while time.time() < deadline and not any("listening on" in x for x in lines):
            line = proc.stderr.readline() if proc.stderr else ""
            if not line and proc.poll() is not None:
                break
            lines.append(line)
        assert any("listening on" in x for x in lines), "".join(lines)[-3000:]
        seen: dict[str, dict] = {}
        with httpx.Client(timeout=30) as c:
            for _ in range(60):
                r = c.get(f"http://127.0.0.1:{port}/v1/models")
                assert r.status_code == 200, r.text
                seen[r.headers["x-specdec-replica"]] = r.json()["data"][0]
                if len(seen) == 2:
                    break
        assert len(seen) == 2, seen
        entries = list(seen.values())
        assert sorted(e["chosen_by"] for e in entries) == ["cached", "tuned"], entries
        assert len({(e["precision"], e["draft"]) for e in entries}) == 1, entries
        assert len(list(tune_dir.glob("*.json"))) == 1 and len(list(tune_dir.glob("*.lock"))) == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
