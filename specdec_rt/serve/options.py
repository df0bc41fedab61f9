"""What one server serves and how: the options ``serve`` maps its flags to once, for a server on
this machine and for every Ray Serve replica alike (:class:`~specdec_rt.serve.ray.RayOptions`
adds the replicas)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidInputError
from ..kvcache.prefix import DEFAULT_BUDGET_BYTES
from .protocol import DEFAULT_PROMPT_LOGPROB_WORK

__all__ = ["ServeOptions"]


@dataclass(frozen=True)
class ServeOptions:
    """The engine a server loads (:meth:`engine_options`: :meth:`Engine.load
    <specdec_rt.Engine.load>`'s arguments) and the app around it (:meth:`app_options`:
    :func:`~specdec_rt.serve.app.create_app`'s). ``api_keys``, ``allowed_hosts``,
    ``allowed_origins``: checked here, so a bad one fails before anything starts."""

    model: str
    draft: str | None = None
    slots: int = 8
    max_queued: int = 16
    request_timeout: float | None = 600.0
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 256
    max_length: int | None = None
    provider: str = "auto"
    precision: str = "exported"  # Engine.load's; "auto": measure (or read the tune cache) at load
    prefix_cache: bool = True
    prefix_cache_bytes: int = DEFAULT_BUDGET_BYTES
    model_name: str | None = None
    threads: int | None = None
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # never in a log line
    allowed_hosts: tuple[str, ...] | None = None
    allowed_origins: tuple[str, ...] = ()
    consumer_timeout: float | None = 30.0  # as for create_app and Engine.load
    max_prompt_logprob_work: int | None = DEFAULT_PROMPT_LOGPROB_WORK  # as for create_app

    def __post_init__(self) -> None:
        if self.slots < 1 or self.max_queued < 0:
            raise InvalidInputError(f"slots >= 1 and max_queued >= 0 needed, got {self.slots!r}, {self.max_queued!r}")
        from .guard import Access

        Access.checked(self.api_keys, self.allowed_hosts, self.allowed_origins)

    def engine_options(self, threads: int | None = None) -> dict[str, Any]:
        """Keyword arguments of ``Engine.load(self.model, ...)`` (``threads``: overrides ours)."""
        return dict(
            draft=self.draft,
            threads=threads or self.threads,
            max_length=self.max_length,
            provider=self.provider,
            slots=self.slots,
            prefix_cache=self.prefix_cache,
            prefix_cache_bytes=self.prefix_cache_bytes,
            consumer_timeout=self.consumer_timeout,
            precision=self.precision,
        )

    def app_options(self) -> dict[str, Any]:
        """Keyword arguments of ``create_app(loader, ...)``."""
        return dict(
            slots=self.slots,
            max_queued=self.max_queued,
            model_name=self.model_name,
            request_timeout=self.request_timeout,
            max_body_bytes=self.max_body_bytes,
            default_max_tokens=self.default_max_tokens,
            api_keys=self.api_keys,
            allowed_hosts=self.allowed_hosts,
            allowed_origins=self.allowed_origins,
            consumer_timeout=self.consumer_timeout,
            max_prompt_logprob_work=self.max_prompt_logprob_work,
        )
