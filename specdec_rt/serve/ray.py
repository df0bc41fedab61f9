"""Replicas of the OpenAI-compatible server on Ray Serve (the optional extra ``ray``).

    python -m specdec_rt serve --ray --replicas 2 --model smollm2-135m --port 8000
    serve run specdec_rt.serve.ray:build model=smollm2-135m replicas=2 cpus_per_replica=1

Each replica owns one :class:`~specdec_rt.Engine` behind the very app ``python -m specdec_rt
serve`` runs (:func:`~specdec_rt.serve.app.create_app`, built on the replica through
``serve.ingress`` with a builder): same routes, errors, streaming and ``/metrics`` (per replica);
responses name the replica (and node) that answered in an ``x-specdec-replica`` header.
The app's lifespan loads the engine before the replica takes traffic and closes it when the
replica stops. ONNX Runtime gets as many threads as CPUs Ray reserved for the replica
(``cpus_per_replica``; otherwise it would size its pool to the whole host and replicas would
fight for the cores). ``max_ongoing_requests`` is the replica's ``slots``, so requests beyond
what a replica batches wait in Ray's router (``max_queued`` of them); past that, Ray's proxy
refuses them at once with 429 and ``Retry-After``, as the single-process server does (its body is
Ray's plain-text message, not the OpenAI error object).

Model folders must exist at the same path on every node (build them into the image or a shared
volume); the CLI builds a missing recipe on the head node before deploying.

A local Ray (:func:`start_local_ray`, what ``serve --ray`` starts without ``--ray-address``)
listens on 127.0.0.1 only: every Ray process of it, checked by :func:`listening_sockets`
(docs/serving.md, "Ray on loopback").

Ray is imported only when a function here runs.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import InvalidInputError, SpecDecError
from .options import ServeOptions

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "RayOptions",
    "deployment_app",
    "build",
    "replica_threads",
    "replica_states",
    "LOCAL_RAY_ENV",
    "start_local_ray",
    "Listener",
    "listening_sockets",
    "on_head_node",
    "proxy_address",
]

APP_NAME = "specdec"

# Set before ``import ray``: Ray reads them once, when its constants module is imported.
# ``ray.init(_node_ip_address="127.0.0.1")`` alone is not enough on Linux: ray.init passes it
# through ``services.resolve_ip_for_localhost``, which swaps a loopback address for the machine's
# (``get_node_ip_address``), unless Ray runs as a single-machine instance: the mode Ray uses on
# macOS and Windows, which ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` selects on Linux too. The node
# address then stays 127.0.0.1, and every Ray process binds to it: the GCS, raylet and worker gRPC
# servers (Ray's C++ GrpcServer listens on loopback when the node address is), the dashboard
# agent's HTTP, gRPC and metrics ports, the runtime-env agent, the autoscaler monitor's and the
# dashboard head's Prometheus ports (each ``get_localhost_ip() if is_localhost(node_ip)``).
LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@dataclass(frozen=True)
class RayOptions(ServeOptions):
    """What a replica serves (:class:`~specdec_rt.serve.options.ServeOptions`), and how many
    replicas. ``replicas``: a number or ``"auto"`` (Ray's autoscaling; ``autoscaling`` overrides
    its config: ``min_replicas``, ``max_replicas``, ``target_ongoing_requests``, ...).
    ``threads``: ONNX Runtime threads (default: the CPUs Ray reserved for the replica).
    ``api_keys`` empty: a replica takes the keys in its own ``$SPECDEC_API_KEY``, e.g. from a
    Kubernetes Secret; ``allowed_hosts`` None: any Host. ``precision="auto"``: each replica reads
    the tune cache; where it holds nothing yet, the first replica of a node measures and its
    siblings wait for it (the tune file's lock) and read what it stored."""

    replicas: int | str = 1
    cpus_per_replica: float = 1.0
    autoscaling: dict[str, Any] | None = None
    max_replicas_per_node: int | None = None

    def __post_init__(self) -> None:
        if self.replicas != "auto" and (not isinstance(self.replicas, int) or self.replicas < 1):
            raise InvalidInputError(f"replicas must be a positive integer or 'auto', got {self.replicas!r}")
        if not self.cpus_per_replica > 0:
            raise InvalidInputError(f"cpus_per_replica > 0 needed, got {self.cpus_per_replica!r}")
        super().__post_init__()


def replica_threads(default: float) -> int:
    """ONNX Runtime threads for this process: the CPUs Ray assigned to it (at least 1)."""
    try:
        import ray

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", default)  # type: ignore[no-untyped-call, unused-ignore]  # Ray's
    except Exception:  # noqa: BLE001 - not in a Ray worker
        cpus = default
    return max(1, int(cpus))


def _replica_app(opts: RayOptions) -> Starlette:
    """The ASGI app of one replica (runs on the replica)."""
    from ..engine.engine import Engine
    from .app import create_app
    from .guard import keys_from_env

    threads = opts.threads or replica_threads(opts.cpus_per_replica)

    async def load() -> Engine:
        from ..engine.factory import use_global_thread_pool

        use_global_thread_pool(threads)  # the replica's process is ours: one pool for all its models
        return await Engine.load(opts.model, **opts.engine_options(threads))

    name = opts.model_name or os.path.basename(str(opts.model).rstrip("/"))
    app = create_app(
        load, opts.app_config(model_name=name, api_keys=opts.api_keys or keys_from_env(), wait_for_load=True)
    )
    app.add_middleware(_ReplicaHeader, replica=_replica_id())
    return app


def _replica_id() -> str:
    """``<replica>@<node>`` on a Ray replica, else the process id."""
    try:
        import ray
        from ray import serve

        replica = serve.get_replica_context().replica_id.unique_id
        return f"{replica}@{ray.get_runtime_context().get_node_id()[:12]}"
    except Exception:  # noqa: BLE001 - not on a replica (tests call the builder directly)
        return f"pid-{os.getpid()}"


class _ReplicaHeader:
    """Adds ``x-specdec-replica`` (which replica answered) to every HTTP response."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app, self.header = app, (b"x-specdec-replica", replica.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, tagged)


def deployment_app(opts: RayOptions) -> Any:
    """A Ray Serve application (``serve.run`` it, or return it from a builder)."""
    from ray import serve

    def build_asgi() -> Starlette:  # a plain function: Ray calls it on each replica
        return _replica_app(opts)

    @serve.ingress(build_asgi)
    class SpecDecReplica:
        """One Engine per replica; unhealthy once its server is not ready (Ray replaces it)."""

        app: Any  # the replica's ASGI app, set by serve.ingress

        def __init__(self) -> None:  # runs on the replica before Ray starts its own servers there
            _replica_grpc_on_loopback()

        async def check_health(self) -> None:
            state = self.app.state.serving.state
            if state not in ("ready", "draining"):
                raise RuntimeError(f"replica not ready: {state}")

    options: dict[str, Any] = {
        "name": "SpecDecReplica",
        "max_ongoing_requests": opts.slots,
        "max_queued_requests": opts.max_queued,
        "backpressure_config": {"status_code": 429, "retry_after_s": 1},  # the single server's overload answer
        "ray_actor_options": {"num_cpus": opts.cpus_per_replica},
        "health_check_period_s": 10,
        "graceful_shutdown_timeout_s": 30,
    }
    if opts.max_replicas_per_node is not None:
        options["max_replicas_per_node"] = opts.max_replicas_per_node
    if opts.autoscaling is not None:
        options["autoscaling_config"] = dict(opts.autoscaling)
    else:
        options["num_replicas"] = opts.replicas
    return serve.deployment(**options)(SpecDecReplica).bind()  # (the decorator's form: what ray's types say)


def build(args: dict[str, Any]) -> Any:
    """Application builder for ``serve run specdec_rt.serve.ray:build key=value ...`` and RayService
    configs (``import_path: specdec_rt.serve.ray:build``, ``args: {...}``): keys are
    :class:`RayOptions` fields; values may be strings (``replicas=2``, ``prefix_cache=false``)."""
    known = {f.name: f for f in fields(RayOptions)}
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise InvalidInputError(f"unknown option(s) {unknown}; known: {sorted(known)}")
    if "model" not in args:
        raise InvalidInputError("the 'model' option is required (a built recipe name or an export folder)")
    parsed = {}
    for k, v in args.items():
        try:
            parsed[k] = _parse(k, v)
        except ValueError as exc:  # int("many"), bad JSON, ...
            raise InvalidInputError(f"option {k}={v!r}: {exc}") from None
    return deployment_app(RayOptions(**parsed))


def _parse(key: str, value: Any) -> Any:
    if not isinstance(value, str):
        return value
    if key in (
        "slots",
        "max_queued",
        "max_body_bytes",
        "default_max_tokens",
        "max_length",
        "threads",
        "prefix_cache_bytes",
        "max_replicas_per_node",
    ):
        return int(value)
    if key in ("request_timeout", "cpus_per_replica"):
        return float(value)
    if key == "replicas":
        return value if value == "auto" else int(value)
    if key in ("prefix_cache", "shared_weights"):
        return value.lower() in ("1", "true", "yes", "on")
    if key in ("api_keys", "allowed_hosts", "allowed_origins"):  # comma separated
        return tuple(v.strip() for v in value.split(",") if v.strip())
    if key == "autoscaling":
        import json

        return json.loads(value)
    return value


def replica_states() -> dict[str, int]:
    """Replicas of the deployment per state (``{"RUNNING": 2}``), from the connected Ray."""
    from ray import serve

    app = serve.status().applications.get(APP_NAME)
    if app is None:
        return {}
    return {str(k): int(v) for d in app.deployments.values() for k, v in d.replica_states.items()}


def on_head_node() -> bool:
    """Whether this driver runs on the head node of the connected Ray cluster. Ray Serve 2.60
    runs its HTTP proxies on the node of its controller, which must be the head node, and on the
    nodes that hold replicas (``ray/serve/_private/controller.py``, ``_update_proxy_nodes``): so
    only on the head node is a proxy sure to run beside the driver."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    return any(
        node.get("NodeID") == here and "node:__internal_head__" in node.get("Resources", {})
        for node in ray.nodes()  # type: ignore[no-untyped-call, unused-ignore]  # Ray's
    )


def proxy_address() -> tuple[str, int]:
    """``(host, port)`` Serve's HTTP proxies listen on, from its controller: what ``serve.start``
    asked for, unless Serve already ran on the cluster (its options are then kept)."""
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    if client is None:
        raise SpecDecError("Ray Serve is not running on the connected cluster")
    config = client.http_config
    return str(config.host), int(config.port)


def start_local_ray(temp_dir: str) -> None:
    """Start a one-node Ray whose every process listens on 127.0.0.1 only (no dashboard, state in
    ``temp_dir``), and connect this process to it. ``address="local"``: a new instance even when
    ``$RAY_ADDRESS`` names a running cluster. Best called before ``ray`` is first imported
    (:data:`LOCAL_RAY_ENV`); if Ray was imported earlier and picks the machine's address, it is
    shut down again and this raises :class:`~specdec_rt.errors.SpecDecError`."""
    os.environ.update(LOCAL_RAY_ENV)
    import ray

    ray.init(
        address="local",
        include_dashboard=False,
        dashboard_host="127.0.0.1",  # the minimal head that still runs (usage stats, metrics)
        _temp_dir=temp_dir,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    node_ip = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call, unused-ignore]  # Ray's
    if not _is_loopback(node_ip):
        ray.shutdown()
        raise SpecDecError(
            f"the local Ray took the address {node_ip}, not 127.0.0.1: Ray was imported before "
            f"{sorted(LOCAL_RAY_ENV)} could be set; start it in a fresh process"
        )


class Listener(NamedTuple):
    """A listening TCP socket of a process: ``address`` as the kernel reports it (``0.0.0.0``,
    ``::``, ``::ffff:127.0.0.1``, ...)."""

    pid: int
    process: str
    address: str
    port: int

    @property
    def loopback(self) -> bool:
        return _is_loopback(self.address)


def _is_loopback(address: str) -> bool:
    """127.0.0.0/8, ``::1``, or 127.0.0.0/8 mapped into IPv6 (how a dual-stack socket bound to
    127.0.0.1 shows); ``0.0.0.0`` and ``::`` (every interface) are not."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def listening_sockets(pid: int | None = None, *, use_psutil: bool | None = None) -> list[Listener]:
    """The listening TCP sockets (IPv4 and IPv6) of process ``pid`` (default: this one) and of every
    process below it, sorted. With psutil when it is installed (``use_psutil=None``), else from
    Linux's ``/proc``: ``/proc/net/tcp{,6}`` joined with each process's ``/proc/<pid>/fd`` socket
    inodes. Processes that end or cannot be read meanwhile are skipped."""
    root = os.getpid() if pid is None else pid
    if use_psutil is None:
        import importlib.util

        use_psutil = importlib.util.find_spec("psutil") is not None
    return sorted(_listeners_psutil(root) if use_psutil else _listeners_proc(root))


def _listeners_psutil(root: int) -> list[Listener]:
    import psutil  # type: ignore[import-untyped]  # (no stubs installed)

    try:
        top = psutil.Process(root)
        procs = [top, *top.children(recursive=True)]
    except psutil.Error:
        return []
    out = []
    for proc in procs:
        try:
            conns = proc.net_connections(kind="tcp")
            name = _process_name(proc.pid)
        except (psutil.Error, OSError):
            continue
        out += [Listener(proc.pid, name, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def _listeners_proc(root: int) -> list[Listener]:
    listening: dict[int, tuple[str, int]] = {}  # socket inode -> (address, port)
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:  # no IPv6 in this kernel
            continue
        for row in rows:
            cols = row.split()
            if len(cols) < 10 or cols[3] != "0A":  # 0A: TCP_LISTEN
                continue
            hex_ip, hex_port = cols[1].split(":")
            # each 32-bit word of the address is printed in host (little-endian) byte order
            raw = b"".join(bytes.fromhex(hex_ip[i : i + 8])[::-1] for i in range(0, width, 8))
            listening[int(cols[9])] = (str(ipaddress.ip_address(raw)), int(hex_port, 16))
    out = []
    for pid in [root, *_descendants(root)]:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            name = _process_name(pid)
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and int(link[8:-1]) in listening:
                out.append(Listener(pid, name, *listening[int(link[8:-1])]))
    return out


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.append(child)
                todo.append(child)
    return out


def _process_name(pid: int) -> str:
    """``gcs_server``, ``raylet``, ``monitor.py``, ``ray::ServeReplica:specdec:SpecDecReplica``..."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        args = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    if not args:
        return "?"
    if os.path.basename(args[0]).startswith("python"):
        for prev, arg in zip(args, args[1:]):
            if prev == "-m" or not arg.startswith("-") and prev != "-c":
                return os.path.basename(arg)  # the script (monitor.py, dashboard.py) or the module
        return os.path.basename(args[0])
    return os.path.basename(args[0].split()[0])  # Ray's workers retitle themselves: "ray::IDLE"


def _replica_grpc_on_loopback() -> bool:
    """On a node whose address is loopback, bind the replica's inter-deployment gRPC server to
    127.0.0.1. Ray Serve 2.60 starts it on ``"[::]:0"`` (every interface), a fixed address in
    ``ray/serve/_private/replica.py`` (``_on_initialized``) with no setting: so this wraps the
    ``add_port_to_grpc_server`` that module calls. Callers reach a replica at its node's address,
    here 127.0.0.1, so nothing else changes. Elsewhere (a node with a routable address), and
    if a later Ray no longer has that function, this does nothing and returns False; the CLI
    then names the port at start-up (``serve --ray``'s check of its sockets)."""
    try:
        import ray
        from ray.serve._private import replica as ray_replica
    except ImportError:
        return False
    original = getattr(ray_replica, "add_port_to_grpc_server", None)
    if original is None or not _is_loopback(ray.util.get_node_ip_address()):  # type: ignore[no-untyped-call, unused-ignore]  # Ray: unannotated
        return False
    if getattr(original, "specdec_loopback", False):
        return True

    def on_loopback(server: Any, address: str) -> Any:
        if address.startswith(("[::]:", "0.0.0.0:")):
            address = "127.0.0.1:" + address.rsplit(":", 1)[1]
        return original(server, address)

    on_loopback.specdec_loopback = True  # type: ignore[attr-defined]  # a mark on the function object
    ray_replica.add_port_to_grpc_server = on_loopback  # type: ignore[attr-defined, unused-ignore]  # Ray's private module
    return True
