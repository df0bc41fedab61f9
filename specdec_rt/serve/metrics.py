"""Prometheus metrics of one server (its own ``CollectorRegistry``, so several apps can coexist).

Token counters are fed from the engine's per-request :class:`~specdec_rt.types.Stats`, so over any
run their deltas equal the sums of the requests' ``Stats`` (a cancelled request counts the tokens
it streamed; it has no final ``Stats``, so its drafts are not counted).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from ..engine.memory import Mapped, ModelKV, mapped_bytes, peak_resident_bytes
from ..types import Stats
from .speculation_metrics import CostCollector, depth_label

__all__ = ["Metrics"]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class MemoryCollector(Collector):
    """Memory gauges read when scraped: each model's KV pool (``kv(resident)``: bytes per
    position, reserved, held by running requests; labelled by ``role`` and ``model``), and, as
    of the last :meth:`refresh` (run off the event loop), the pools' committed pages and the
    weight files as mapped into this process; the process's peak resident memory. Its resident
    memory now is the process collector's ``process_resident_memory_bytes``."""

    def __init__(self, kv: Callable[[bool], Sequence[ModelKV]]) -> None:
        self.kv = kv
        self.weight_files: list[Path] = []  # set when the engine attaches
        self.weights = Mapped(0, 0)
        self.kv_resident: dict[tuple[str, str], int] = {}  # (role, model) -> bytes

    def refresh(self) -> None:
        """Read how much of the weight files is mapped and resident (``/proc/self/smaps``) and
        what the KV pools commit (``mincore``): tens of milliseconds in a loaded
        process, so the server runs it in a worker thread."""
        self.weights = mapped_bytes(self.weight_files)
        self.kv_resident = {
            (role, model): usage.resident_bytes
            for role, model, usage in self.kv(True)
            if usage.resident_bytes is not None
        }

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["role", "model"]
        families = {
            "position": GaugeMetricFamily(
                "specdec_kv_position_bytes", "KV bytes of one position (every layer's K and V)", labels=labels
            ),
            "reserved": GaugeMetricFamily(
                "specdec_kv_reserved_bytes",
                "KV pool size: every slot at max_length + 1 positions (address space; committed as written)",
                labels=labels,
            ),
            "used": GaugeMetricFamily(
                "specdec_kv_used_bytes",
                "KV bytes of the positions running requests hold (positions x bytes per position)",
                labels=labels,
            ),
        }
        resident = GaugeMetricFamily(
            "specdec_kv_resident_bytes",
            "KV pool pages in memory (a slot keeps what its longest request wrote), as of the scrape",
            labels=labels,
        )
        for role, model, usage in self.kv(False):
            families["position"].add_metric([role, model], usage.position_bytes)
            families["reserved"].add_metric([role, model], usage.reserved_bytes)
            families["used"].add_metric([role, model], usage.used_bytes)
            if (role, model) in self.kv_resident:
                resident.add_metric([role, model], self.kv_resident[role, model])
        yield from families.values()
        yield resident
        yield GaugeMetricFamily(
            "specdec_model_weights_mapped_bytes",
            "Bytes of the weight files (exports' and prepacked copies') mapped into this process",
            value=self.weights.mapped,
        )
        yield GaugeMetricFamily(
            "specdec_model_weights_resident_bytes",
            "Of the mapped weight files, the pages resident in this process",
            value=self.weights.resident,
        )
        yield GaugeMetricFamily(
            "specdec_process_resident_memory_peak_bytes",
            "The most resident memory this process has held (VmHWM)",
            value=peak_resident_bytes(),
        )


class Metrics:
    """The server's metrics. ``running`` / ``waiting`` / ``slots_free`` / ``kv`` are read when scraped."""

    def __init__(
        self,
        running: Callable[[], float],
        waiting: Callable[[], float],
        cache_bytes: Callable[[], float] = lambda: 0.0,
        slots_free: Callable[[], float] = lambda: 0.0,
        *,
        kv: Callable[[bool], Sequence[ModelKV]] = lambda resident: [],
    ) -> None:
        self.registry = r = CollectorRegistry()
        self._worst_lag = 0.0
        self.running = Gauge("specdec_requests_running", "Requests generating (holding an engine slot)", registry=r)
        self.running.set_function(running)
        self.waiting = Gauge("specdec_requests_waiting", "Admitted requests waiting for an engine slot", registry=r)
        self.waiting.set_function(waiting)
        self.slots_free = Gauge(
            "specdec_kv_slots_free", "The engine's KV slots free now (slots minus requests holding one)", registry=r
        )
        self.slots_free.set_function(slots_free)
        self.generation_tokens = Counter("specdec_generation_tokens", "Generated tokens", registry=r)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self._speculation_metrics(r)
        self.success = Counter("specdec_request_success", "Requests that finished", ["finished_reason"], registry=r)
        self.rejected = Counter(
            "specdec_requests_rejected",
            "Requests refused before generation (auth, framing, host, origin: on any route)",
            ["reason"],
            registry=r,
        )
        self.aborted = Counter(
            "specdec_requests_aborted", "Requests ended early after admission", ["reason"], registry=r
        )
        self._cache_metrics(r, cache_bytes)
        self.loop_lag_worst = Gauge(
            "specdec_event_loop_lag_worst_seconds", "The worst event-loop lag since the server started", registry=r
        )
        self._histograms(r)
        self.weights_bytes = self._memory_gauges(r)
        self.memory = MemoryCollector(kv)
        r.register(self.memory)
        self._show_reasons()

    def _cache_metrics(self, registry: CollectorRegistry, cache_bytes: Callable[[], float]) -> None:
        """The prefix cache's counters and the bytes it holds (``cache_bytes``, read when scraped)."""
        self.cache_hit_tokens = Counter(
            "specdec_prefix_cache_hit_tokens",
            "Prompt tokens the prefix cache supplied (not computed)",
            registry=registry,
        )
        self.cache_queries = Counter(
            "specdec_prefix_cache_queries",
            "Requests that looked their prompt up in the prefix cache",
            registry=registry,
        )
        self.cache_bytes = Gauge("specdec_prefix_cache_bytes", "KV memory the prefix cache holds", registry=registry)
        self.cache_bytes.set_function(cache_bytes)

    def _histograms(self, registry: CollectorRegistry) -> None:
        """The latency, batch-size and event-loop-lag histograms."""
        self.ttft = Histogram(
            "specdec_time_to_first_token_seconds",
            "Arrival to the first generated token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "specdec_inter_token_latency_seconds",
            "Time between consecutive streamed events of a request",
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "specdec_e2e_request_latency_seconds", "Arrival to the last token", buckets=E2E_BUCKETS, registry=registry
        )
        self.batch_size = Histogram(
            "specdec_batch_size", "Rows in one batched target-model call", buckets=BATCH_BUCKETS, registry=registry
        )
        self.loop_lag = Histogram(
            "specdec_event_loop_lag_seconds",
            "How late the event loop woke its watchdog (every request waits as long)",
            buckets=LOOP_LAG_BUCKETS,
            registry=registry,
        )

    def _show_reasons(self) -> None:
        """Create every known label of the counters, so a scrape shows each one at 0."""
        for reason in ("stop", "length"):
            self.success.labels(reason)
        for reason in (
            "invalid",
            "too_large",
            "media_type",
            "overloaded",
            "loading",
            "draining",
            "auth",
            "framing",
            "host",
            "origin",
        ):
            self.rejected.labels(reason)
        for reason in ("cancelled", "timeout", "consumer_timeout", "error", "shutdown"):
            self.aborted.labels(reason)

    def _speculation_metrics(self, registry: CollectorRegistry) -> None:
        """The drafts' counters, in all and per draft depth, and the measured costs (read from
        the engine when scraped)."""
        self.drafts = Counter(
            "specdec_spec_decode_num_drafts",
            "Speculative rounds (a draft of k >= 1 tokens, then one verify call)",
            registry=registry,
        )
        self.draft_tokens = Counter("specdec_spec_decode_num_draft_tokens", "Drafted tokens", registry=registry)
        self.accepted_tokens = Counter(
            "specdec_spec_decode_num_accepted_tokens", "Drafted tokens the target accepted", registry=registry
        )
        self.depth_drafted = Counter(
            "specdec_spec_decode_num_drafts_per_depth",
            "Rounds that drafted at this depth, every earlier draft accepted (depth 1: every round)",
            ["depth", "drafter"],
            registry=registry,
        )
        self.depth_accepted = Counter(
            "specdec_spec_decode_num_accepted_tokens_per_depth",
            "Drafts the target accepted at this depth; over the drafts there: P(accepted | earlier accepted)",
            ["depth", "drafter"],
            registry=registry,
        )
        self.costs = CostCollector()
        registry.register(self.costs)

    @staticmethod
    def _memory_gauges(registry: CollectorRegistry) -> Gauge:
        """The process's figures (``process_resident_memory_bytes`` ..., from Linux /proc) and the
        loaded models' weight bytes on disk (set when the engine attaches); returns the latter."""
        ProcessCollector(registry=registry)
        return Gauge(
            "specdec_model_weights_bytes",
            "Bytes of the loaded models' weight files (ONNX graph + external data)",
            registry=registry,
        )

    def observe_batch(self, rows: int) -> None:
        """A ``batch_listeners`` callback (may be called from the engine's worker threads)."""
        self.batch_size.observe(rows)

    def observe_loop(self, lag: float, busy: float) -> None:
        """A :class:`~specdec_rt.engine.loop_watch.LoopWatch` listener: one wake, ``lag`` seconds late."""
        self.loop_lag.observe(lag)
        if lag > self._worst_lag:
            self._worst_lag = lag
            self.loop_lag_worst.set(lag)

    def observe_stats(self, stats: Stats) -> None:
        """A finished request's :class:`~specdec_rt.types.Stats` (its tokens were counted as they
        came; ``cache_queries``: it looked its prompt up in the prefix cache)."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cache_queries.inc(stats.cache_queries)
        self.cache_hit_tokens.inc(stats.cached_prompt_tokens)
        self.drafts.inc(stats.rounds)
        self.draft_tokens.inc(stats.drafted)
        self.accepted_tokens.inc(stats.accepted)
        drafter = self.costs.drafter
        for index, (tried, kept) in enumerate(zip(stats.position_drafted, stats.position_accepted)):
            if tried:
                depth = depth_label(index + 1)
                self.depth_drafted.labels(depth, drafter).inc(tried)
                self.depth_accepted.labels(depth, drafter).inc(kept)

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """(body, content type) in the format the scraper's ``Accept`` header asks for:
        Prometheus text 0.0.4 by default (what every Prometheus reads), OpenMetrics on request."""
        encode, content_type = choose_encoder(accept or "")
        return encode(self.registry), content_type
