"""A model folder whose graph was built through optimum (``"builder": "optimum"``), run by ONNX
Runtime behind the same :class:`~specdec_rt.speculation.protocols.LanguageModel` Protocol as
:class:`~specdec_rt.ort.model.OrtModel`.

Such a graph takes ``input_ids`` ``[1, S]``, ``attention_mask`` ``[1, past + S]``, (``position_ids``
``[1, S]``) and each layer's past key and value ``[1, kv_heads, past, head_dim]``, and returns the
logits of every new position ``[1, S, V]`` and each layer's present key and value
``[1, kv_heads, past + S, head_dim]`` (the past with the new positions appended: a new tensor each
call, :data:`~specdec_rt.manifest_schema.CONCAT_KV_LAYOUT`).

A session keeps the presents of its last call where ONNX Runtime put them (IO binding: OrtValues,
never copied to numpy) and binds them as the next call's past. Several new positions in one call
verify a chain of drafts; a rollback to ``n`` positions slices the first ``n`` of every layer's
KV before the next call (one copy, only after a rejection). What such a model lacks is declared in
its :class:`ModelCaps`, all False: no batched steps (each request's calls run alone, one at a
time), no packed rows of different lengths, no batched prefill, no prefix cache, no draft trees,
no hidden states (no EAGLE draft on it).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..batching import BatchExecutor
from ..batching.executor import BatchedModel, BatchedSession
from ..errors import ContextLengthError, InferenceError, ModelLoadError
from ..manifest_schema import KV_ROLES, MANIFEST
from ..speculation.protocols import CacheSession, LanguageModel, ModelCaps
from .manifest import Manifest, load_manifest
from .setup import _configure_threads, default_threads, pick_providers

__all__ = ["ConcatKVModel", "ConcatKVSession"]

DEFAULT_MAX_LENGTH = 4096
PAST_ROLES = KV_ROLES[:2]  # past_key, past_value: the graph's inputs
PRESENT_ROLES = KV_ROLES[2:]  # present_key, present_value: its outputs, in the same order


class ConcatKVModel(LanguageModel, BatchedModel):
    """A ``"builder": "optimum"`` export folder, run by ONNX Runtime (see the module docstring).

    Takes :class:`~specdec_rt.ort.model.OrtModel`'s options, so the engine's factory builds either
    the same way; those about a shared KV pool do not apply and are ignored (``prefix_cache_bytes``,
    ``cache_entries``, ``block``, ``shared_weights``: no prefix cache, no prepacked copy).

    Args:
        folder: An export folder built through optimum, or its loaded manifest.
        max_length: The longest sequence a session holds (default min(4096, the model's
            max positions); more than the model's positions is capped).
        slots: Sessions open at once (each holds its own KV).
        threads: Intra-op threads (default: usable CPUs).
        provider: ``"auto"`` | ``"cpu"`` | ``"cuda"``.
        alone: No other model runs beside it (its threads may keep spinning between runs).
        executor: The step loop its calls run on (default: one of its own).
        **ignored: OrtModel's options that a graph without a shared KV pool has no use for.

    Raises:
        ModelLoadError: A manifest that is not an optimum build, a graph that lacks what the
            manifest names, a capacity under 2 or ``slots`` under 1.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str] | Manifest,
        *,
        max_length: int | None = None,
        slots: int = 4,
        threads: int | None = None,
        provider: str = "auto",
        alone: bool = False,
        executor: BatchExecutor | None = None,
        **ignored: Any,
    ) -> None:
        import onnxruntime as ort

        self.manifest = m = folder if isinstance(folder, Manifest) else load_manifest(folder)
        if m.builder != "optimum":
            raise ModelLoadError(f"{m.folder / MANIFEST}: builder {m.builder!r}; ConcatKVModel runs optimum builds")
        if slots < 1:
            raise ModelLoadError(f"slots must be >= 1, got {slots!r}")
        self.name, self.vocab_size, self.slots = m.name, m.vocab_size, slots
        self.max_length = min(max_length or DEFAULT_MAX_LENGTH, m.max_positions)
        if self.max_length < 2:
            raise ModelLoadError(f"max_length must be >= 2, got {max_length!r}")
        so = ort.SessionOptions()
        self.threads = _configure_threads(so, threads or default_threads(), alone)
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3
        try:
            self.session: Any = ort.InferenceSession(str(m.onnx_file), so, providers=pick_providers(provider, ort))
        except Exception as exc:  # noqa: BLE001 - ORT raises its own hierarchy
            raise ModelLoadError(f"{m.onnx_file}: ONNX Runtime cannot load it: {exc}") from exc
        self.device = "cuda" if self.session.get_providers()[0] == "CUDAExecutionProvider" else "cpu"
        self.positions = check_concat_graph(m, self.session)
        self.executor = executor or BatchExecutor()
        self.prepacked = None  # no prepacked copy (OrtModel's attribute, for reports)
        self.caps = ModelCaps()  # a plain model: see the module docstring
        self.calls = 0
        self._open: set[int] = set()  # id() of the sessions open now
        self._ort = ort

    @property
    def caches_prefixes(self) -> bool:
        """No prefix cache (the engine's factory asks every model)."""
        return False

    def start(self, prefix: np.ndarray | None = None, *, batch_invariant: bool = False) -> ConcatKVSession:
        """A session for one request (``prefix`` is ignored: no prefix cache; every call of one
        session takes one path, so ``batch_invariant`` holds already).

        Raises:
            InferenceError: The model is closed, or ``slots`` sessions are open already.
        """
        if self.session is None:
            raise InferenceError(f"model {self.name} is closed")
        if len(self._open) >= self.slots:
            raise InferenceError(f"model {self.name}: all {self.slots} slots are in use")
        session = ConcatKVSession(self)
        self._open.add(id(session))
        return session

    def close(self) -> None:
        """Drop the ONNX Runtime session (idempotent); open sessions fail their next call."""
        self.session = None
        self._open.clear()

    def empty_past(self) -> list[Any]:
        """Every layer's past key and value with no positions, as OrtValues ``[1, kv, 0, d]``."""
        m = self.manifest
        shape = (1, m.num_kv_heads, 0, m.head_dim)
        return [
            self._ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype=np.float32), self.device, 0)
            for _ in range(2 * m.num_layers)
        ]

    def sliced(self, kv: list[Any], keep: int) -> list[Any]:
        """The first ``keep`` positions of every KV tensor ``kv`` (OrtValues), as new OrtValues."""
        ort = self._ort
        return [
            ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value.numpy()[:, :, :keep]), self.device, 0)
            for value in kv
        ]

    def run(self, ids: npt.NDArray[np.int64], past: int, kv: list[Any]) -> tuple[npt.NDArray[np.float32], list[Any]]:
        """One call: ``ids`` [S] after the ``past`` positions held by ``kv`` (OrtValues, key then
        value per layer). Returns the logits of the S positions [S, V] and the presents."""
        session = self.session
        if session is None:
            raise InferenceError(f"model {self.name} is closed")
        m, size = self.manifest, int(ids.size)
        io = session.io_binding()
        io.bind_cpu_input(m.inputs["input_ids"], ids.reshape(1, size))
        io.bind_cpu_input(m.inputs["attention_mask"], np.ones((1, past + size), dtype=np.int64))
        if self.positions:
            io.bind_cpu_input(m.inputs["position_ids"], np.arange(past, past + size, dtype=np.int64)[None])
        for layer in range(m.num_layers):
            for which, role in enumerate(PAST_ROLES):
                io.bind_ortvalue_input(m.kv_name(role, layer), kv[2 * layer + which])
        io.bind_output(m.outputs["logits"], "cpu")
        for layer in range(m.num_layers):
            for role in PRESENT_ROLES:
                io.bind_output(m.kv_name(role, layer), self.device)
        try:
            session.run_with_iobinding(io)
        except Exception as exc:  # noqa: BLE001 - map ORT's errors at the boundary
            raise InferenceError(f"ONNX Runtime failed in {self.name} ({size} positions after {past}): {exc}") from exc
        self.calls += 1
        outputs = io.get_outputs()
        logits: npt.NDArray[np.float32] = outputs[0].numpy()[0]  # [S, V]
        return logits, list(outputs[1:])

    def release(self, session: ConcatKVSession) -> None:
        """Forget a closed session (its slot is free again)."""
        self._open.discard(id(session))

    def run_batch_sync(self, sessions: Sequence[BatchedSession], ids: np.ndarray, pasts: np.ndarray) -> np.ndarray:
        """Never called: ``caps.batched_steps`` is False."""
        raise InferenceError(f"{self.name} (built through optimum) runs no batched steps")

    def run_rows_sync(
        self, sessions: Sequence[BatchedSession], feeds: Sequence[np.ndarray], wants: Sequence[int]
    ) -> list[np.ndarray]:
        """Never called: ``caps.ragged`` is False."""
        raise InferenceError(f"{self.name} (built through optimum) runs no packed rows")

    def run_prefill_batch_sync(self, sessions: Sequence[BatchedSession], prompts: Sequence[np.ndarray]) -> np.ndarray:
        """Never called: ``caps.batched_prefill`` is False."""
        raise InferenceError(f"{self.name} (built through optimum) runs no batched prefill")


class ConcatKVSession(CacheSession, BatchedSession):
    """One request on a :class:`ConcatKVModel`: the presents of its last call (its KV) and how
    many of their positions are committed (``length``)."""

    def __init__(self, model: ConcatKVModel) -> None:
        self.model: ConcatKVModel = model
        self._kv: list[Any] = model.empty_past()  # OrtValues [1, kv, held, d], key then value per layer
        self._held = 0  # positions in self._kv (rollback leaves more than `length` until the next call)
        self._length = 0
        self._closed = False

    @property
    def length(self) -> int:
        return self._length

    async def extend(self, ids: np.ndarray, logits_rows: int, *args: Any, **extra: Any) -> np.ndarray:
        """Append ``ids`` [S] and return the logits of the last ``logits_rows`` positions [R, V]
        (through the model's step loop, alone: no batched calls). ``extra``: none allowed
        (no trees, no hidden states: the model's caps).

        Raises:
            InferenceError: Closed, a bad ``logits_rows``, or an option the caps do not offer.
            ContextLengthError: The cache would hold more than ``max_length`` positions.
        """
        if self._closed:
            raise InferenceError("KV cache session is closed")
        _refuse_options(self.model.name, args, extra)
        size = int(np.size(ids))
        if not 1 <= logits_rows <= size:
            raise InferenceError(f"logits_rows={logits_rows} must be in 1..{size}")
        if self._length + size > self.model.max_length:
            raise ContextLengthError(f"{self._length + size} tokens exceed the KV cache of {self.model.max_length}")
        logits: np.ndarray = await self.model.executor.extend(self, np.asarray(ids, dtype=np.int64), logits_rows)
        return logits

    def run_sync(self, ids: np.ndarray, rows: int, past: int, **extra: Any) -> Any:
        """Feed ``ids`` [S] after the first ``past`` committed positions (fewer than held: the
        rest are dropped first) and set ``length`` to ``past + S`` (in a worker thread: the
        executor calls it). Returns the logits of the last ``rows`` positions [rows, V].

        Raises:
            InferenceError: Closed, ``past`` beyond what the session holds, or an option
                (``hidden``, ``tree``, ``features``) a graph built through optimum has no output
                or input for.
        """
        if self._closed:
            raise InferenceError("KV cache session is closed")
        _refuse_options(self.model.name, (), extra)
        if not 0 <= past <= self._held:
            raise InferenceError(f"past={past} must be in 0..{self._held} (the positions this session holds)")
        tokens = np.asarray(ids, dtype=np.int64).reshape(-1)  # [S]
        if past + tokens.size > self.model.max_length:
            raise ContextLengthError(f"{past + tokens.size} tokens exceed the KV cache of {self.model.max_length}")
        kv = self._kv if past == self._held else self.model.sliced(self._kv, past)  # a rollback: drop the rest
        logits, self._kv = self.model.run(tokens, past, kv)
        self._held = self._length = past + tokens.size
        return logits[tokens.size - rows :]

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` positions (the rest are dropped at the next call)."""
        if not 0 <= length <= self._length:
            raise InferenceError(f"rollback({length}): the session holds {self._length} positions")
        self._length = length

    def close(self) -> None:
        """Give the KV back (idempotent)."""
        if not self._closed:
            self._closed = True
            self._kv = []
            self._held = self._length = 0
            self.model.release(self)


def _refuse_options(name: str, args: tuple[Any, ...], extra: dict[str, Any]) -> None:
    """An InferenceError naming the options set in ``extra`` (or positional ``args``): a graph
    built through optimum has no tree, hidden-state or feature inputs and outputs."""
    asked = sorted(k for k, v in extra.items() if v is not None and v is not False)
    if args or asked:
        raise InferenceError(f"{name} (built through optimum) takes no {', '.join(asked) or 'options'}")


def check_concat_graph(m: Manifest, session: Any) -> bool:
    """The graph has every input and output the manifest names, its KV tensors of rank 4 with the
    manifest's kv heads and head size (where the graph fixes them); returns whether it takes
    ``position_ids``. A ModelLoadError names the first mismatch."""
    ins = {i.name: i for i in session.get_inputs()}
    outs = {o.name: o for o in session.get_outputs()}
    path = m.folder / MANIFEST
    positions = bool(m.inputs.get("position_ids"))
    wanted = [(m.inputs["input_ids"], ins), (m.inputs["attention_mask"], ins), (m.outputs["logits"], outs)]
    if positions:
        wanted.append((m.inputs["position_ids"], ins))
    for layer in range(m.num_layers):
        wanted += [(m.kv_name(role, layer), ins) for role in PAST_ROLES]
        wanted += [(m.kv_name(role, layer), outs) for role in PRESENT_ROLES]
    for name, table in wanted:
        if name not in table:
            raise ModelLoadError(f"{path}: the graph has no {name!r} (named in the manifest)")
    expected = {1: m.num_kv_heads, 3: m.head_dim}
    for layer in range(m.num_layers):
        shape = ins[m.kv_name("past_key", layer)].shape
        bad = len(shape) != 4 or any(isinstance(shape[d], int) and shape[d] != n for d, n in expected.items())
        if bad:
            raise ModelLoadError(
                f"{path}: the graph's past of layer {layer} has shape {shape}, the manifest says "
                f"[batch, {m.num_kv_heads}, past, {m.head_dim}]"
            )
    extra = sorted(set(ins) - {name for name, table in wanted if table is ins})
    if extra:
        raise ModelLoadError(f"{path}: the graph takes inputs the manifest does not name: {', '.join(extra[:3])}")
    return positions
