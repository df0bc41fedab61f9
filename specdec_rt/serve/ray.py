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

Ray is imported only when a function here runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import InvalidInputError
from ..kvcache.prefix import DEFAULT_BUDGET_BYTES

__all__ = ["RayOptions", "deployment_app", "build", "replica_threads", "replica_states"]

APP_NAME = "specdec"


@dataclass(frozen=True)
class RayOptions:
    """What a replica serves, and how many replicas. ``replicas``: a number or ``"auto"`` (Ray's
    autoscaling; ``autoscaling`` overrides its config: ``min_replicas``, ``max_replicas``,
    ``target_ongoing_requests``, ...). ``threads``: ONNX Runtime threads (default: the CPUs Ray
    reserved for the replica). ``api_keys``, ``allowed_hosts``, ``allowed_origins``: as for
    :func:`~specdec_rt.serve.app.create_app` (``api_keys`` empty: a replica takes the keys in its
    own ``$SPECDEC_API_KEY``, e.g. from a Kubernetes Secret; ``allowed_hosts`` None: any Host)."""

    model: str
    draft: str | None = None
    slots: int = 8
    max_queued: int = 16
    request_timeout: float | None = 600.0
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 256
    max_length: int | None = None
    provider: str = "auto"
    prefix_cache: bool = True
    prefix_cache_bytes: int = DEFAULT_BUDGET_BYTES
    model_name: str | None = None
    threads: int | None = None
    replicas: int | str = 1
    cpus_per_replica: float = 1.0
    autoscaling: dict | None = None
    max_replicas_per_node: int | None = None
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # never in a log line
    allowed_hosts: tuple[str, ...] | None = None
    allowed_origins: tuple[str, ...] = ()
    consumer_timeout: float | None = 30.0  # as for create_app and Engine.load

    def __post_init__(self) -> None:
        if self.replicas != "auto" and (not isinstance(self.replicas, int) or self.replicas < 1):
            raise InvalidInputError(f"replicas must be a positive integer or 'auto', got {self.replicas!r}")
        if not self.cpus_per_replica > 0 or self.slots < 1 or self.max_queued < 0:
            raise InvalidInputError(
                f"cpus_per_replica > 0, slots >= 1 and max_queued >= 0 needed, got "
                f"{self.cpus_per_replica!r}, {self.slots!r}, {self.max_queued!r}"
            )
        from .guard import Access

        Access.checked(
            self.api_keys, self.allowed_hosts, self.allowed_origins
        )  # a bad one fails here, not on a replica


def replica_threads(default: float) -> int:
    """ONNX Runtime threads for this process: the CPUs Ray assigned to it (at least 1)."""
    try:
        import ray

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", default)
    except Exception:  # noqa: BLE001 - not in a Ray worker
        cpus = default
    return max(1, int(cpus))


def _replica_app(opts: RayOptions):
    """The ASGI app of one replica (runs on the replica)."""
    from ..engine.engine import Engine
    from .app import create_app
    from .guard import keys_from_env

    threads = opts.threads or replica_threads(opts.cpus_per_replica)

    async def load() -> Engine:
        from ..engine.factory import use_global_thread_pool

        use_global_thread_pool(threads)  # the replica's process is ours: one pool for all its models
        return await Engine.load(
            opts.model,
            draft=opts.draft,
            threads=threads,
            max_length=opts.max_length,
            provider=opts.provider,
            slots=opts.slots,
            prefix_cache=opts.prefix_cache,
            prefix_cache_bytes=opts.prefix_cache_bytes,
            consumer_timeout=opts.consumer_timeout,
        )

    name = opts.model_name or os.path.basename(str(opts.model).rstrip("/"))
    app = create_app(
        load,
        slots=opts.slots,
        max_queued=opts.max_queued,
        model_name=name,
        request_timeout=opts.request_timeout,
        max_body_bytes=opts.max_body_bytes,
        default_max_tokens=opts.default_max_tokens,
        wait_for_load=True,
        api_keys=opts.api_keys or keys_from_env(),
        allowed_hosts=opts.allowed_hosts,
        allowed_origins=opts.allowed_origins,
        consumer_timeout=opts.consumer_timeout,
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

    def __init__(self, app, replica: str) -> None:
        self.app, self.header = app, (b"x-specdec-replica", replica.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, tagged)


def deployment_app(opts: RayOptions):
    """A Ray Serve application (``serve.run`` it, or return it from a builder)."""
    from ray import serve

    def build_asgi():  # a plain function: Ray calls it on each replica
        return _replica_app(opts)

    @serve.ingress(build_asgi)
    class SpecDecReplica:
        """One Engine per replica; unhealthy once its server is not ready (Ray replaces it)."""

        app: Any  # the replica's ASGI app, set by serve.ingress

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


def build(args: dict) -> Any:
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
    if key == "prefix_cache":
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
