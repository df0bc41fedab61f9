"""One request's slot in an :class:`~specdec_rt.ort.model.OrtModel`'s KV pool: single-request
calls (prompt pieces, verifies, tree verifies), tree compaction and rollback. Batched calls over
several sessions are the model's (``run_rows_sync``); both advance ``length``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike

from ..errors import ContextLengthError, InferenceError
from ..kvcache.cached_start import CachedStart
from ..kvcache.prefix import Hit
from ..speculation.protocols import CacheSession
from .manifest import PACKED_ROLES
from .tree import compact_rows, tree_feeds
from .tree import packed_layout as _packed_layout

if TYPE_CHECKING:
    from .model import OrtModel

__all__ = ["OrtSession"]


class OrtSession(CachedStart, CacheSession):
    """One request's slot in the model's KV pool, with its IO binding built once.

    With a prefix-cache ``hit`` it starts at ``length = hit.length``: those first tokens of
    ``tokens`` are (or, from a running source, will be at its first call) in the slot already.
    ``model``: the :class:`~specdec_rt.ort.model.OrtModel` that made it (``OrtModel.start``).
    """

    def __init__(self, model: OrtModel, slot: int, hit: Hit | None = None, tokens: np.ndarray | None = None) -> None:
        self.model, self.slot = model, slot
        m = model.manifest
        self._ids = np.zeros(model.max_length + 1, dtype=np.int64)  # [max_len + 1] ids of the cached positions
        self._length = self._start_from(hit, tokens)
        if hit is not None:  # (a hit comes only for tokens)
            assert tokens is not None
            self._ids[: self._length] = tokens[: self._length]
        self._closed = False
        self._io = model.session.io_binding()
        model._bind_kv(self._io, slot, 1)
        self._names = m.inputs
        self._logits_at = 2 * m.num_layers  # outputs come back in binding order: KV first
        self._hidden_at: int | None = None  # hidden_states, bound on first request
        # [max_len + 1] positions to slice from; the last, for a lone position's copy after the
        # last one (pad_lone), repeats max_len - 1: a position the model has, and the copy is dropped
        self._pos = np.minimum(np.arange(model.max_length + 1), model.max_length - 1).astype(np.int64)
        # a lone query goes to attention twice, by the path of a batch's or a verify's rows: the
        # model's rule (quantized targets), or one request's (a seeded sampled one: adapters)
        self.lone_twice = model.lone_twice
        self.pad_lone = model.pad_lone  # a lone position goes with a copy of it (see OrtModel), likewise
        self._buffers: _StepBuffers | None = None  # a plain step's inputs and logits, bound once
        self._step_bound = False  # ... and bound now (a call of another shape re-binds)

    @property
    def length(self) -> int:
        return self._length

    def hidden_rows(self, size: int) -> np.ndarray:
        """``[max_len + 1, size]`` host rows this slot's hidden states are kept in (they move with
        the prefix cache's copies, so cached positions keep theirs)."""
        return self.model.open_pool().hidden_rows(self.slot, size)

    async def extend(
        self,
        ids: np.ndarray,
        logits_rows: int,
        *,
        features: np.ndarray | None = None,
        hidden: bool = False,
        tree: np.ndarray | None = None,
    ) -> Any:
        """Append ``ids`` [S]; the logits of the last ``logits_rows`` positions [R, V].

        ``features`` [S, H]: the extra per-position input of an EAGLE draft head. ``hidden=True``
        also returns the graph's ``hidden_states`` of the S positions: ``(logits, hidden [S, H])``.
        The call goes through the model's :class:`~specdec_rt.batching.executor.BatchExecutor`, which
        batches it with other requests' single-token steps and advances ``length``.
        ``tree`` [S]: each position's parent (see :mod:`specdec_rt.ort.tree`): one call over a
        draft tree; ``length`` stays put until :meth:`accept_tree`.
        """
        if self._closed:
            raise InferenceError("KV cache session is closed")
        n, s = self._length, int(np.size(ids))
        if not 1 <= logits_rows <= s:
            raise InferenceError(f"logits_rows={logits_rows} must be in 1..{s}")
        if n + s > self.model.max_length:
            raise ContextLengthError(f"{n + s} tokens exceed the KV cache of {self.model.max_length}")
        extra: dict[str, Any] = {"features": features} if features is not None else {}
        if hidden:
            extra["hidden"] = True  # no extras: a single-token step the executor may batch
        if tree is not None:
            extra["tree"] = np.asarray(tree, dtype=np.int64)
        return await self.model.executor.extend(self, np.asarray(ids, dtype=np.int64), logits_rows, **extra)

    @property
    def copy_pending(self) -> bool:
        """It starts from a prefix-cache hit on a request still running, whose KV is copied at
        its first call: a call with a tree (or features) cannot be that first call."""
        return self._deferred is not None

    def run_sync(
        self,
        ids: np.ndarray,
        rows: int,
        past: int,
        *,
        features: np.ndarray | None = None,
        hidden: bool = False,
        tree: np.ndarray | None = None,
    ) -> Any:
        """Feed ``ids`` [S] after ``past`` cached tokens and set ``length`` to ``past + S``
        (in a worker thread: the executor calls it). ``tree``: the parent of each new position
        (see :mod:`specdec_rt.ort.tree`); the length stays ``past`` until :meth:`accept_tree`.
        Returns logits ``[rows, V]`` (with ``hidden``: and the hidden states ``[S, H]``)."""
        session, pool = self._open_call(tree)  # held: close() cannot free them under the call
        pool.cache.apply()  # queued prefix-cache copies first
        wanted = ids.size
        if self._deferred is not None and (features is not None or tree is not None):
            raise InferenceError("a session fed features or a tree cannot start from a prefix-cache hit")
        ids, past = self._settle(pool.cache, ids, past, self._ids)  # a hit on a running source: copy now
        self._ids[past : past + ids.size] = ids
        n, size = past, ids.size
        if size == 1 and self.pad_lone and tree is None and features is None:
            # two positions through the model, the lone one and a copy (see OrtModel.pad_lone)
            out = self.run_sync(np.repeat(ids, 2), 2, n, hidden=hidden)
            self._length = n + 1
            return (out[0][:1], out[1][:1]) if hidden else out[:1]
        if size == 1 and rows == 1 and tree is None and features is None and not hidden and self._hidden_at is None:
            return self._step(session, int(ids[0]), n)
        self._step_bound = False  # the inputs below replace the plain step's
        self._bind_inputs(ids, rows, n, tree)
        self._bind_extras(features, hidden)
        try:
            return self._run_bound(session, pool, n, size, wanted=wanted, hidden=hidden, tree=tree is not None)
        finally:
            del pool

    def _open_call(self, tree: np.ndarray | None) -> tuple[Any, Any]:
        """The model's ONNX Runtime session and KV pool for a call; an InferenceError when the
        session or model is closed, or for a tree the model cannot verify."""
        if self._closed:
            raise InferenceError("KV cache session is closed")
        session, pool = self.model.session, self.model.pool
        if session is None or pool is None:  # (close() drops both)
            raise InferenceError(f"model {self.model.name} is closed")
        if tree is not None and not self.model.tree:
            raise InferenceError(f"model {self.model.name} cannot verify a tree (export 0.3+ on CPU)")
        return session, pool

    def _bind_inputs(self, ids: np.ndarray, rows: int, n: int, tree: np.ndarray | None) -> None:
        """Bind a call's inputs: ``ids`` after ``n`` cached tokens, logits of the last ``rows``."""
        names, io, size = self._names, self._io, ids.size
        io.bind_cpu_input(names["input_ids"], ids[None, :])  # [1, S]
        layout = _packed_layout(np.array([size]), self.lone_twice) if self.model.ragged else None
        q = int(layout[0][0]) if layout is not None else size  # query rows attention computes (see OrtModel)
        positions, bias = tree_feeds(tree, n, q) if tree is not None else (self._pos[None, n : n + size], None)
        if names.get("position_ids"):
            io.bind_cpu_input(names["position_ids"], positions)  # [1, S]
        if self.model.biased:  # no tree: zeros, causal order alone
            io.bind_cpu_input(
                names["attention_bias"], bias if bias is not None else np.zeros((1, 1, q, n + q), dtype=np.float32)
            )  # [1, 1, q, n + q]
        io.bind_cpu_input(names["seqlens_k"], np.array([n + q - 1], dtype=np.int32))  # [1]
        io.bind_cpu_input(names["total_sequence_length"], np.array(n + q, dtype=np.int32))  # scalar
        io.bind_cpu_input(names["logits_index"], self._pos[size - rows : size])  # [R]
        if layout is not None:  # one row: the packed layout is the identity (a lone query twice, see above)
            for role, value in zip(PACKED_ROLES, layout):
                io.bind_cpu_input(names[role], value)

    def _bind_extras(self, features: np.ndarray | None, hidden: bool) -> None:
        """Bind the features input and the outputs: outputs whose shape changes per call are
        re-bound unallocated (ORT allocates them); only the logits (and hidden states) come
        back to the host, the KV buffers stay bound in place."""
        names, io = self._names, self._io
        if features is not None:
            if not names.get("features"):
                raise InferenceError(f"model {self.model.name} takes no features input")
            io.bind_cpu_input(names["features"], np.ascontiguousarray(features, dtype=np.float32)[None])  # [1, S, H]
        io.bind_output(self.model.manifest.outputs["logits"], "cpu")
        if hidden or self._hidden_at is not None:  # once bound, re-bound unallocated every call
            if not self.model.has_hidden:
                raise InferenceError(f"model {self.model.name} has no hidden_states output")
            io.bind_output(self.model.manifest.outputs["hidden"], "cpu")  # [1, S, H], after logits
            self._hidden_at = self._logits_at + 1

    def _run_bound(self, session: Any, pool: Any, n: int, size: int, *, wanted: int, hidden: bool, tree: bool) -> Any:
        """Run the bound call of ``size`` new positions after ``n``; its logits (and the last
        ``wanted`` hidden states, kept in the pool's hidden rows)."""
        try:
            session.run_with_iobinding(self._io)
            self.model.calls += 1
            outs = self._io.get_outputs()
            logits = outs[self._logits_at].numpy()[0]  # [R, V]
            self._length = n if tree else n + size
            if not hidden:
                return logits
            states = outs[self._hidden_at].numpy()[0]  # [S, H]
            if pool.hidden is not None:
                pool.hidden.array[self.slot, n : n + size] = states
            return logits, states[size - wanted :]
        except Exception as exc:  # noqa: BLE001 - map ORT's errors at the boundary
            raise InferenceError(
                f"ONNX Runtime failed in {self.model.name} (past {n}, new {size} tokens): {exc}"
            ) from exc

    def _step(self, session: Any, token: int, n: int) -> np.ndarray:
        """A plain single-token step after ``n`` cached tokens: logits ``[1, V]``. Most calls
        are these, so their inputs and the logits are host buffers bound once (``_StepBuffers``)
        and written in place: a call binds nothing new (an attention bias, whose width grows,
        aside) and creates no output objects."""
        b, io, names = self._buffers, self._io, self._names
        if b is None:
            b = self._buffers = _StepBuffers(self.model, self.lone_twice)
        b.ids[0, 0], b.positions[0, 0], b.seqlens[0], b.total[()] = token, n, n + b.q - 1, n + b.q
        if not self._step_bound:
            for name, value in b.inputs:
                io.bind_ortvalue_input(name, value)
            io.bind_ortvalue_output(self.model.manifest.outputs["logits"], b.logits_value)
            self._step_bound = True
        if b.bias is not None:  # the model is biased; no tree: zeros, causal order alone
            io.bind_cpu_input(names["attention_bias"], b.bias[: b.q * (n + b.q)].reshape(1, 1, b.q, n + b.q))
        try:
            session.run_with_iobinding(io)
        except Exception as exc:  # noqa: BLE001 - map ORT's errors at the boundary
            self._step_bound = False
            raise InferenceError(f"ONNX Runtime failed in {self.model.name} (past {n}, one new token): {exc}") from exc
        self.model.calls += 1
        self._length = n + 1
        logits: np.ndarray = b.logits[0].copy()  # [1, V]: the buffer is the next step's
        return logits

    def accept_tree(self, past: int, keep: ArrayLike) -> None:
        """After a tree call at ``past``: keep the nodes ``keep`` (increasing: the accepted path),
        their KV moved to positions ``past ..`` in place; ``length`` becomes ``past + len(keep)``."""
        if self._length != past:
            raise InferenceError(f"accept_tree at {past}: the cache holds {self._length}")
        pool = self.model.open_pool()
        keep = np.asarray(keep, dtype=np.int64)
        compact_rows(pool.host_arrays(), self.slot, past, keep)
        if pool.hidden is not None:
            rows = pool.hidden.array[self.slot]  # [max_len + 1, H]
            rows[past : past + keep.size] = rows[past + keep]
        self._ids[past : past + keep.size] = self._ids[past + keep]
        self._length = past + keep.size

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise InferenceError(f"cannot roll back to {length}: the cache holds {self._length}")
        self._length = length  # positions >= length are overwritten by the next extend

    def close(self) -> None:
        """No more calls. The slot goes back to the pool now (the next call on it runs after any
        call in flight, and that one writes only past what the slot keeps); the IO binding is
        cleared now, or, while a call of this session runs in the worker thread (its request
        cancelled mid-call), when that call returns: never under a running call."""
        if not self._closed:
            self._closed = True
            if self.model.pool is not None:  # None: the model was closed meanwhile
                if self.model._owners.get(self.slot) is self:
                    del self.model._owners[self.slot]
                self.model.pool.release(self.slot, self._ids[: self.kept_length()])
                self.model.executor.chore(self.model.pool.cache.next_stash)  # copied out while idle
            self.model.executor.after_call(self, self._unbind)

    def _unbind(self) -> None:
        self._io.clear_binding_inputs()
        self._io.clear_binding_outputs()


class _StepBuffers:
    """Host buffers of a single-token step (``OrtValue`` views of them, bound by reference, so
    writing the arrays changes what the next run reads): ids, position, ``seqlens_k``, the
    total length, the logits index (0), a packed graph's layout of one row (constant), the
    attention bias (zeros; sliced to the call's width) and the logits ``[1, 1, V]``."""

    def __init__(self, model: OrtModel, lone_twice: bool) -> None:
        from onnxruntime import OrtValue

        self.ids = np.zeros((1, 1), dtype=np.int64)  # [1, 1]
        self.positions = np.zeros((1, 1), dtype=np.int64)  # [1, 1]
        self.seqlens = np.zeros(1, dtype=np.int32)  # [1]
        self.total = np.zeros((), dtype=np.int32)  # scalar
        self.index = np.zeros(1, dtype=np.int64)  # [1]
        self.layout = _packed_layout(np.array([1]), lone_twice) if model.ragged else None
        self.q = int(self.layout[0][0]) if self.layout is not None else 1  # query rows attention computes
        # zeros (causal order alone); a contiguous prefix of it is each call's [1, 1, q, n + q]
        self.bias = np.zeros(self.q * (model.max_length + self.q), dtype=np.float32) if model.biased else None
        self.logits = np.zeros((1, 1, _logits_width(model)), dtype=np.float32)  # [1, 1, V]
        self.logits_value = OrtValue.ortvalue_from_numpy(self.logits)
        pairs = [
            ("input_ids", self.ids),
            ("position_ids", self.positions),
            ("seqlens_k", self.seqlens),
            ("total_sequence_length", self.total),
            ("logits_index", self.index),
        ]
        if self.layout is not None:
            pairs += list(zip(PACKED_ROLES, self.layout))
        names = model.manifest.inputs
        #: ``(input name, OrtValue)`` to bind, for the inputs the graph has
        self.inputs = [(names[role], OrtValue.ortvalue_from_numpy(a)) for role, a in pairs if names.get(role)]


def _logits_width(model: OrtModel) -> int:
    """The graph's logits width (a draft head's reduced vocabulary has its own), else the vocabulary."""
    name = model.manifest.outputs["logits"]
    for out in model.session.get_outputs():
        if out.name == name and out.shape and isinstance(out.shape[-1], int):
            return out.shape[-1]
    return model.manifest.vocab_size
