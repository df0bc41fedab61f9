"""ONNX Runtime language model with preallocated, IO-bound KV caches.

Memory layout: per layer one key and one value buffer ``[slots, kv_heads, max_len, head_dim]``
(the pool). A request owns one slot. Each layer's ``past_key_values.i.*`` input and
``present.i.*`` output are bound to the same slot slice, so GroupQueryAttention appends the new
positions in place: no cache copy per step, and rollback is a length change. The pool is laid out
by slot so that a later batched target call can bind ``[B, ...]`` consecutive slots unchanged.

Only the logits come back to the host (``io.get_outputs()[i].numpy()``); the KV buffers stay where
they are (host memory on CPU, device memory with CUDA).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..batching import BatchExecutor
from ..checks import brief_repr
from ..errors import InferenceError, ModelLoadError
from ..kvcache.prefix import DEFAULT_BLOCK, PrefixCache
from ..logs import get_logger
from ..speculation.protocols import LanguageModel, ModelCaps
from .kvpool import KVPool, KVUsage
from .manifest import PACKED_ROLES, Manifest, load_manifest
from .prepack import discard_copy, prepacked_copy
from .session import OrtSession
from .setup import _configure_threads, check_graph, default_threads, pick_providers, use_global_thread_pool
from .tree import packed_layout as _packed_layout

__all__ = ["OrtModel", "OrtSession", "KVPool", "default_threads", "pick_providers", "use_global_thread_pool"]

DEFAULT_MAX_LENGTH = 4096
MIN_CACHE_ENTRIES = 16  # prefix-cache entry slots (address space only until used; the byte budget bounds memory)


class OrtModel(LanguageModel):
    """A model folder from ``python -m export``, run by ONNX Runtime.

    Calls run in a worker thread, one at a time on the model's
    :class:`~specdec_rt.batching.executor.BatchExecutor`, which batches the single-token steps of
    concurrent requests.

    Args:
        folder: An export folder, or its loaded manifest.
        max_length: KV capacity per request (default min(4096, the model's max positions);
            more than the graph holds is capped, with a warning).
        slots: Concurrent requests.
        threads: Intra-op threads (default: usable CPUs; ignored after
            :func:`use_global_thread_pool`).
        provider: ``"auto"`` | ``"cpu"`` | ``"cuda"``.
        prefix_cache_bytes: Above 0: keep what finished requests computed in
            ``cache_entries`` extra slots (:mod:`specdec_rt.kvcache.prefix`, CPU only), in at
            most this many bytes; ``start(prefix)`` begins with the longest cached prefix.
        cache_entries: The prefix cache's slots (default max(slots, 16)).
        block: Tokens per indexed block of the prefix cache.
        alone: No other model runs beside it (no draft model), so its threads keep spinning
            between runs (see ``ort.setup._configure_threads``).
        executor: The step loop its calls run on (an Engine shares one between its models;
            default: one of its own).
        shared_weights: On the CPU, load the graph's prepacked copy (:mod:`specdec_rt.ort.prepack`,
            built on first use): ONNX Runtime maps its packed weights from a file, so processes
            on one export share them; :attr:`prepacked` names the copy loaded (None: the
            export's own graph, its packed weights in private memory).

    Raises:
        ModelLoadError: A manifest that fails its checks, a graph ONNX Runtime cannot load,
            a capacity under 2 or ``slots`` under 1.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str] | Manifest,
        *,
        max_length: int | None = None,
        slots: int = 4,
        threads: int | None = None,
        provider: str = "auto",
        prefix_cache_bytes: int = 0,
        cache_entries: int | None = None,
        block: int = DEFAULT_BLOCK,
        alone: bool = False,
        executor: BatchExecutor | None = None,
        shared_weights: bool = False,
    ) -> None:
        """Load the folder's graph and commit its KV pool."""
        import onnxruntime as ort

        self.manifest = m = folder if isinstance(folder, Manifest) else load_manifest(folder)
        self.name, self.vocab_size = m.name, m.vocab_size
        self.max_length = self._checked_length(max_length, slots)
        self.session: Any = self._open_session(ort, threads, alone=alone, provider=provider, shared=shared_weights)
        self._choose_paths()  # (the graph checked first; sets the device)
        entries = max(slots, MIN_CACHE_ENTRIES) if cache_entries is None else cache_entries
        self.pool: KVPool | None = self._new_pool(
            ort, slots, entries=entries if prefix_cache_bytes else 0, budget_bytes=prefix_cache_bytes, block=block
        )
        self.prefix_cache: PrefixCache = self.pool.cache  # slot bookkeeping; .enabled: it keeps prefixes
        self.executor = executor or BatchExecutor()  # an Engine's factory gives all its models one
        self._owners: dict[int, OrtSession] = {}  # slot -> the open session that holds it
        self._batch_io: dict[tuple[int, int], Any] = {}  # (first slot, rows) -> ORT IO binding
        self.calls = 0  # model calls run
        self._measure_rounding()
        self.caps = ModelCaps(
            batched_steps=True,
            ragged=self.ragged,
            batched_prefill=True,
            caches_prefixes=self.prefix_cache.enabled,
            trees=self.tree,
            hidden_states=self.has_hidden,
        )

    def _checked_length(self, max_length: int | None, slots: int) -> int:
        """The KV capacity per request: ``max_length`` capped at the graph's positions (with a
        warning); a ModelLoadError for a capacity under 2 or ``slots`` under 1."""
        m = self.manifest
        length = min(max_length or DEFAULT_MAX_LENGTH, m.max_positions)
        if max_length and max_length > m.max_positions:  # asked for more than the graph holds
            get_logger("specdec_rt").warning(
                "model.max_length_capped", model=m.name, asked=brief_repr(max_length), max_length=m.max_positions
            )
        if length < 2:
            raise ModelLoadError(f"max_length must be >= 2, got {max_length!r}")
        if slots < 1:
            raise ModelLoadError(f"slots must be >= 1, got {slots!r}")
        return length

    def _open_session(self, ort: Any, threads: int | None, *, alone: bool, provider: str, shared: bool) -> Any:
        """The ONNX Runtime session of the model's graph, or of its prepacked copy when
        ``shared`` and on the CPU (sets :attr:`threads` and :attr:`prepacked`)."""
        m = self.manifest
        providers = pick_providers(provider, ort)
        self.prepacked: Path | None = None  # the prepacked copy loaded (_open_copy)

        def options() -> Any:
            so = ort.SessionOptions()
            self.threads = _configure_threads(so, threads or default_threads(), alone)
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            so.log_severity_level = 3
            return so

        if shared and providers == ["CPUExecutionProvider"]:
            copy = prepacked_copy(m.onnx_file, ort=ort, options=options)
            session = None if copy is None else self._open_copy(ort, copy.graph, options())
            if session is not None:
                return session
        try:
            return ort.InferenceSession(str(m.onnx_file), options(), providers=providers)
        except Exception as exc:  # noqa: BLE001 - ORT raises its own hierarchy
            raise ModelLoadError(f"{m.onnx_file}: ONNX Runtime cannot load it: {exc}") from exc

    def _open_copy(self, ort: Any, graph: Path, options: Any) -> Any:
        """A session on the prepacked copy ``graph``, checked against the manifest; None (the
        copy removed, with a warning) when ONNX Runtime cannot load it or it fails the check."""
        try:
            session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
            check_graph(self.manifest, session)
        except Exception as exc:  # noqa: BLE001 - ORT raises its own hierarchy; ModelLoadError from the check
            discard_copy(graph.parent, f"{type(exc).__name__}: {exc}")
            return None
        self.prepacked = graph
        return session

    def _choose_paths(self) -> None:
        """Check the graph against the manifest, then choose which kernel paths the model's
        calls take, from its graph and device (set here: where its session runs)."""
        m = self.manifest
        self.device = "cuda" if self.session.get_providers()[0] == "CUDAExecutionProvider" else "cpu"
        check_graph(m, self.session)
        self.has_hidden = bool(m.outputs.get("hidden")) and m.outputs["hidden"] in {
            o.name for o in self.session.get_outputs()
        }
        # packed rows: several rows of several new positions with a past in one call (a batched
        # verify), costing their real positions. Every language model's graph has them (a folder
        # exported before them is refused at load, ort.manifest); an EAGLE head has none (its calls
        # carry features and go alone)
        self.ragged = all(m.inputs.get(r) for r in PACKED_ROLES)
        # A quantized target gives attention a lone query twice (the copy's KV rolled back), so
        # plain steps take the path verifies take (docs/decisions/0001-lone-query-twice.md)
        quantized = (m.quantization or {}).get("accuracy_level", 0) not in (0, 1)
        self.lone_twice = quantized and m.role == "target" and self.ragged
        # packed graphs take an attention bias on every call (zeros but for a tree, see ort.tree).
        # Trees need the KV on the host to compact it (CUDA verifies chains), and a tree node's
        # logits equal its path's as a chain only to float rounding (~1e-6: attention sums the
        # path's keys at other indices), which int8 activations would amplify: quantized targets
        # verify chains too. So do models with sliding windows: GroupQueryAttention windows a query by
        # its index in the cache, and a tree's nodes sit there past their real positions; and
        # ALiBi models, whose graph biases each key by its index in the cache
        self.biased = self.ragged  # with positions: both checked at load with the packed inputs
        chains_only = bool(m.sliding_window) or m.alibi
        self.tree = self.ragged and self.device == "cpu" and not quantized and not chains_only

    def _measure_rounding(self) -> None:
        """Measured at load: where a lone position's logits differ from its logits in a
        2-position call (``lone_differs``), a quantized target pads it with a copy
        (``pad_lone``); longer calls that differ (``rows_differ``) get a warning
        (docs/decisions/0002-pad-lone-positions.md)."""
        self.pad_lone = False  # the probe's own session copies it
        self.rows_differ = False
        self.lone_differs = self.ragged and self.device == "cpu" and self._lone_step_differs()
        self.pad_lone = self.lone_twice and self.lone_differs

    def _lone_step_differs(self) -> bool:
        """Whether a lone position's logits (its query twice in attention) differ from its
        logits inside a 2-position call; sets ``rows_differ`` if a 9-position call's first two
        rows differ from the 2-position call's."""
        past = min(6, self.max_length - 2)  # a short context (max_length 3..7) probes after fewer tokens
        if past < 1:
            return False  # max_length 2: one prompt token and one step, nothing to compare
        s = self.start()
        s.lone_twice = True
        try:
            ids = np.arange(1, 16, dtype=np.int64) % self.manifest.vocab_size  # [15]
            s.run_sync(ids[:past], 1, 0)
            lone = s.run_sync(ids[past : past + 1], 1, past)  # [1, V]
            s.rollback(past)
            pair = s.run_sync(ids[past : past + 2], 2, past)  # [2, V]
            if self.max_length >= past + 9:
                s.rollback(past)
                nine = s.run_sync(ids[past : past + 9], 9, past)  # [9, V]
                self.rows_differ = not np.array_equal(nine[:2], pair)
                if self.rows_differ:
                    get_logger("specdec_rt").warning(
                        "model.rows_differ",
                        model=self.name,
                        note="this CPU's kernels round a position differently in calls of 2 and 9 positions: "
                        "greedy speculative output may leave plain decoding's on near-ties",
                    )
            return not np.array_equal(lone[0], pair[0])
        finally:
            s.rollback(0)  # nothing for the prefix cache to keep, and the slot's KV as it was:
            for array in self.open_pool().host_arrays():  # only the positions written, so the rest
                array[s.slot, :, : ids.size + 1] = 0  # of the slot stays uncommitted (ort.kvpool)
            s.close()

    @property
    def caches_prefixes(self) -> bool:
        return self.pool is not None and self.pool.cache.enabled

    def open_pool(self) -> KVPool:
        """The KV pool; an ``InferenceError`` once the model is closed."""
        if self.pool is None:
            raise InferenceError(f"model {self.name} is closed")
        return self.pool

    def kv_usage(self, resident: bool = False) -> KVUsage | None:
        """The KV pool's bytes per position, bytes reserved and positions the open sessions hold
        now, and with ``resident`` the bytes its pages commit (None once closed). Safe from any
        thread: it reads a snapshot of the sessions and the page table."""
        pool = self.pool
        if pool is None:
            return None
        sessions = list(self._owners.values())  # one C-level copy: no resize can interleave
        return KVUsage(
            position_bytes=pool.token_bytes,
            reserved_bytes=pool.reserved_bytes,
            positions=sum(session.length for session in sessions),
            resident_bytes=pool.resident_bytes() if resident else None,
        )

    def cached_prefix(self, tokens: np.ndarray) -> int:
        """Tokens of ``tokens`` [T] the prefix cache holds now (0 with the cache off)."""
        return self.prefix_cache.peek(tokens)

    def start(self, prefix: np.ndarray | None = None, *, batch_invariant: bool = False) -> "OrtSession":
        """A session for one request. ``prefix``: its committed tokens; with the prefix cache on,
        the session starts with the longest cached prefix of them (``length`` > 0).
        ``batch_invariant``: a lone position goes by the path of a batch's rows (its query twice
        in attention, ``lone_twice``; with a copy of it where this CPU's MatMuls round a lone
        position otherwise, ``pad_lone``), so its logits do not depend on its call's shape."""
        if self.session is None:
            raise InferenceError(f"model {self.name} is closed")
        pool = self.open_pool()
        tokens = None if prefix is None else np.asarray(prefix, dtype=np.int64)
        slot, hit = pool.acquire(tokens)
        session = OrtSession(self, slot, hit, tokens)
        if batch_invariant and self.ragged:
            session.lone_twice, session.pad_lone = True, self.lone_differs
        self._owners[slot] = session
        pool.cache.register(slot, session, tokens)
        return session

    def close(self) -> None:
        """Drop the ONNX Runtime session and the KV pool (idempotent). A call already running
        keeps them alive until it returns; a session still open fails its next call with an
        ``InferenceError``."""
        self.session = None
        self.pool = None
        self._batch_io.clear()
        self._owners.clear()

    def _new_pool(self, ort: Any, slots: int, *, entries: int, budget_bytes: int, block: int) -> KVPool:
        """The KV pool of ``slots`` running slots and ``entries`` prefix-cache slots, in the
        manifest's ``onnx.kv.dtype``; logs its element type and bytes (``model.kv_pool``)."""
        m = self.manifest
        pool = KVPool(
            layers=m.num_layers,
            kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            running=slots,
            max_len=self.max_length,
            device=self.device,
            ort=ort,
            entries=entries,
            budget_bytes=budget_bytes,
            block=block,
            dtype=m.kv_dtype,
        )
        get_logger("specdec_rt").info(
            "model.kv_pool",
            model=self.name,
            dtype=self.manifest.kv_dtype,
            slots=slots,
            bytes_per_token=pool.token_bytes,
            bytes_per_slot=pool.reserved_per_slot,
        )
        return pool

    def _bind_kv(self, io: Any, first_slot: int, rows: int) -> None:
        """Bind every layer's past and present KV to the same ``[rows, kv, max_len + 1, d]``
        slice of the pool, starting at ``first_slot``: appends happen in place."""
        m, pool = self.manifest, self.open_pool()
        shape = [rows, *pool.shape[1:]]
        for layer in range(m.num_layers):
            for which, (past, present) in enumerate((("past_key", "present_key"), ("past_value", "present_value"))):
                where = {
                    "device_type": self.device,
                    "device_id": 0,
                    "element_type": pool.dtype.type,
                    "shape": shape,
                    "buffer_ptr": pool.pointer(layer, which, first_slot),
                }
                io.bind_input(m.kv_name(past, layer), **where)
                io.bind_output(m.kv_name(present, layer), **where)

    def _span(self, sessions: Sequence[OrtSession]) -> tuple[int, int, np.ndarray]:
        """``(first slot, rows, row of each session)`` of the slots a batched call covers."""
        slots = [s.slot for s in sessions]
        lo = min(slots)
        return lo, max(slots) - lo + 1, np.array(slots, dtype=np.int64) - lo

    def _run_rows(
        self,
        lo: int,
        feed: np.ndarray,
        positions: np.ndarray,
        seqlens: np.ndarray,
        *,
        logits_index: np.ndarray,
        what: str,
        layout: tuple[np.ndarray, ...] | None = None,
    ) -> np.ndarray:
        """One call over the contiguous slots ``lo .. lo + rows - 1`` (in a worker thread):
        ``feed`` / ``positions`` ``[rows, S]`` (packed graphs: ``[1, N]``, with ``layout``, see
        :func:`_packed_layout`), ``seqlens`` ``[rows]`` (total length - 1 per row), logits of
        positions ``logits_index`` ``[R]``. Returns logits ``[rows, R, V]`` (packed: ``[1, R, V]``)."""
        session, pool = self.session, self.pool  # held for the call: close() cannot free them under it
        if session is None or pool is None:  # (close() drops both)
            raise InferenceError(f"model {self.name} is closed")
        pool.cache.apply()  # queued prefix-cache copies first: they may read what this call writes
        rows = seqlens.shape[0]
        io = self._batch_io.get((lo, rows))
        if io is None:  # KV bound once per slot range
            io = self._batch_io[(lo, rows)] = session.io_binding()
            self._bind_kv(io, lo, rows)
        names = self.manifest.inputs
        io.bind_cpu_input(names["input_ids"], feed)
        if names.get("position_ids"):
            io.bind_cpu_input(names["position_ids"], positions)
        io.bind_cpu_input(names["seqlens_k"], seqlens.astype(np.int32))
        io.bind_cpu_input(names["total_sequence_length"], np.array(int(seqlens.max()) + 1, dtype=np.int32))
        io.bind_cpu_input(names["logits_index"], logits_index)
        if layout is not None:
            for role, value in zip(PACKED_ROLES, layout):
                io.bind_cpu_input(names[role], value)
            if self.biased:  # no tree: causal order alone
                width, total = int(layout[3][1]), int(seqlens.max()) + 1
                io.bind_cpu_input(names["attention_bias"], np.zeros((1, 1, width, total), dtype=np.float32))
        io.bind_output(self.manifest.outputs["logits"], "cpu")
        try:
            session.run_with_iobinding(io)
            self.calls += 1
            logits: np.ndarray = io.get_outputs()[2 * self.manifest.num_layers].numpy()  # [rows, R, V]
            return logits
        except Exception as exc:  # noqa: BLE001 - map ORT's errors at the boundary
            raise InferenceError(
                f"ONNX Runtime failed in {self.name} ({what} over slots {lo}..{lo + rows - 1}): {exc}"
            ) from exc
        finally:
            del pool

    def run_batch_sync(self, sessions: list["OrtSession"], ids: np.ndarray, pasts: np.ndarray) -> np.ndarray:
        """One single-token step for several sessions in one call (in a worker thread): session
        i feeds ``ids[i]`` after its first ``pasts[i]`` cached tokens. Returns logits ``[B, V]``.

        The call covers the contiguous slots from the lowest to the highest of the sessions;
        a slot in between that takes no part feeds a dummy token at its own cache length (a
        position its owner has not committed, past what a free slot keeps for the prefix cache,
        or the scratch position), whose output is dropped.
        """
        if self.ragged:  # rows in between feed nothing
            return np.concatenate(self.run_rows_sync(sessions, [np.asarray([x]) for x in ids], [1] * len(sessions)))
        lo, rows, at = self._span(sessions)
        past = np.zeros(rows, dtype=np.int64)  # [rows] cached tokens per slot
        for slot in range(lo, lo + rows):  # a free slot may keep a finished request's KV: after it
            owner = self._owners.get(slot)
            past[slot - lo] = owner.length if owner is not None else self.prefix_cache.kept(slot)
        feed = np.zeros((rows, 1), dtype=np.int64)  # [rows, 1]
        feed[at, 0] = ids
        past[at] = pasts
        logits = self._run_rows(
            lo,
            feed,
            past[:, None],
            past,
            logits_index=np.zeros(1, dtype=np.int64),
            what=f"a step of {len(sessions)} rows",
        )  # [rows, 1, V]
        for s, p, x in zip(sessions, pasts, ids):
            s._ids[p] = x
            s._length = int(p) + 1
        step: np.ndarray = logits[at, 0]  # [B, V]
        return step

    def _overflowing(self, sessions: list["OrtSession"], feeds: list[np.ndarray]) -> set[int]:
        """Rows of a call of several that attention's padded layout would write past the end of
        their slot: each row is padded to the call's widest (``S`` query positions after its
        ``length``), and a slot holds ``max_len + 1`` (a request near its context limit, batched
        with a longer verify). Empty for a call of one row (its own width always fits)."""
        if len(sessions) < 2:
            return set()
        queries = [
            2 if np.size(f) == 1 and s.lone_twice else np.size(f) for s, f in zip(sessions, feeds)
        ]  # what packed_layout gives attention per row
        width = max(queries)
        return {i for i, s in enumerate(sessions) if s.length + width > self.open_pool().shape[2]}

    def run_rows_sync(
        self, sessions: list["OrtSession"], feeds: list[np.ndarray], wants: list[int]
    ) -> list[np.ndarray]:
        """Several new positions for each of several sessions in one call (packed graphs only;
        in a worker thread): session i feeds ``feeds[i]`` ``[S_i]`` after its ``length`` cached
        tokens and gets the logits of its last ``wants[i]`` positions ``[wants[i], V]``.

        The positions go packed (the MatMuls see only real positions); attention sees right-
        padded rows, and the slots in between that take no part feed nothing (0 new positions)
        and keep their cache as it is.
        """
        if len(sessions) == 1 and np.size(feeds[0]) == 1 and sessions[0].pad_lone:  # a lone position: see pad_lone
            return [sessions[0].run_sync(np.asarray(feeds[0], dtype=np.int64), 1, sessions[0].length)]
        apart = self._overflowing(sessions, feeds)
        if apart:  # rows near the end of their slot go alone (a call's padding would not fit there)
            return self._run_apart(sessions, feeds, wants, apart)
        lo, rows, at = self._span(sessions)
        pasts = [s.length for s in sessions]
        news = np.zeros(rows, dtype=np.int64)  # [rows] new positions per slot
        news[at] = [f.size for f in feeds]
        past = np.zeros(rows, dtype=np.int64)  # [rows] cached tokens per slot (0 for rows in between)
        past[at] = pasts
        starts = np.cumsum(news) - news  # [rows] first packed position of each row
        index = np.concatenate(
            [starts[r] + np.arange(f.size - w, f.size) for r, f, w in zip(at, feeds, wants)]
        )  # [R] packed positions wanted
        order = np.argsort(at, kind="stable")  # feeds in slot order, as the packing lays them out
        feed = np.concatenate([np.asarray(feeds[i], dtype=np.int64) for i in order])[None]  # [1, N]
        positions = np.concatenate([past[r] + np.arange(news[r]) for r in range(rows)])[None]  # [1, N]
        twice = np.zeros(rows, dtype=bool)  # [rows] which rows' lone query goes twice
        twice[at] = [s.lone_twice for s in sessions]
        layout = _packed_layout(news, twice)
        seqlens = np.maximum(past + layout[0] - 1, 0)  # [rows] a row feeding nothing: untouched
        logits = self._run_rows(
            lo,
            feed,
            positions,
            seqlens,
            logits_index=index,
            what=f"{len(sessions)} rows, {feed.shape[1]} positions",
            layout=layout,
        )[0]  # [R, V]
        return _commit_rows(sessions, feeds, wants, logits)

    def _run_apart(
        self, sessions: list["OrtSession"], feeds: list[np.ndarray], wants: list[int], apart: set[int]
    ) -> list[np.ndarray]:
        """:meth:`run_rows_sync` with the rows ``apart`` each in a call of its own, the others
        together."""
        got: dict[int, np.ndarray] = {}  # row -> its logits
        keep = [i for i in range(len(sessions)) if i not in apart]
        for group in ([keep] if keep else []) + [[i] for i in apart]:
            part = self.run_rows_sync(
                [sessions[i] for i in group], [feeds[i] for i in group], [wants[i] for i in group]
            )
            got.update(zip(group, part))
        return [got[i] for i in range(len(sessions))]

    def can_prefill_together(self, sessions: list["OrtSession"]) -> bool:
        """A batched first-prompt call writes positions 0.. of every slot it covers: only when
        no other open session holds a slot in between, and no free one keeps a finished
        request's KV for the prefix cache."""
        lo, rows, _ = self._span(sessions)
        mine = {s.slot for s in sessions}
        return all(
            slot in mine or (slot not in self._owners and not self.prefix_cache.kept(slot))
            for slot in range(lo, lo + rows)
        )

    def run_prefill_batch_sync(self, sessions: list["OrtSession"], prompts: list[np.ndarray]) -> np.ndarray:
        """The first prompts of several sessions in one call (GroupQueryAttention takes several
        rows of several positions when nothing is cached): rows right-padded to the longest,
        each row's length in ``seqlens_k``. Returns each prompt's last logits ``[B, V]``."""
        if self.ragged:
            return np.concatenate(self.run_rows_sync(sessions, prompts, [1] * len(sessions)))
        lo, rows, at = self._span(sessions)
        lengths = np.ones(rows, dtype=np.int64)  # a free slot in between: one dummy position
        lengths[at] = [p.size for p in prompts]
        feed = np.zeros((rows, int(lengths.max())), dtype=np.int64)  # [rows, S]
        for r, p in zip(at, prompts):
            feed[r, : p.size] = p
        last = sorted({int(n) - 1 for n in lengths[at]})  # [R] positions whose logits are needed
        positions = np.tile(np.arange(feed.shape[1]), (rows, 1))  # [rows, S]
        logits = self._run_rows(
            lo,
            feed,
            positions,
            lengths - 1,
            logits_index=np.array(last, dtype=np.int64),
            what=f"a prefill of {len(sessions)} prompts",
        )  # [rows, R, V]
        for s, p in zip(sessions, prompts):
            s._ids[: p.size] = p
            s._length = p.size
        return logits[at, [last.index(p.size - 1) for p in prompts]]  # [B, V]


def _commit_rows(
    sessions: list["OrtSession"], feeds: list[np.ndarray], wants: list[int], logits: np.ndarray
) -> list[np.ndarray]:
    """Record each session's fed ids after its past, and split a packed call's logits ``[R, V]``
    into each session's last ``wants[i]`` positions."""
    out: list[np.ndarray] = []
    at_row = 0
    for session, feed, want in zip(sessions, feeds, wants):
        past = session.length
        session._ids[past : past + feed.size] = feed
        session._length = past + feed.size
        out.append(logits[at_row : at_row + want])  # [want, V]
        at_row += want
    return out
