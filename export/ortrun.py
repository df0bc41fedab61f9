"""Run an exported graph the way the runtime does: shared, preallocated KV buffers + IO binding.

This is the reference for the calling convention in `docs/manifest.md`; validation and the
measurements in `docs/export.md` use it. Only the logits are read back
(`io.get_outputs()[0].numpy()`); the KV buffers are numpy arrays that ONNX Runtime writes into.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

__all__ = ["KVSession", "open_session", "session_options"]


def session_options(threads: int | None = None) -> ort.SessionOptions:
    """Full graph optimization, quiet logs, `threads` intra-op threads (None: ORT default)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    return so


def open_session(path: Path, so: ort.SessionOptions) -> ort.InferenceSession:
    """A CPU session; in a process whose ONNX Runtime runs on one global thread pool (the
    runtime's CLI and server set one up), on that pool (ONNX Runtime refuses a session with
    its own threads there)."""
    try:
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - only this one error is retried
        if "global thread pool" not in str(exc):
            raise
        so.use_per_session_threads = False
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


class KVSession:
    """One sequence (batch 1) on an exported model with in-place KV caches.

    `forward(ids, past_len, rows)` feeds `S = len(ids)` new tokens at positions
    `past_len .. past_len + S - 1` and returns logits `[len(rows), V]` for the chosen rows
    (indices into the S new positions). Rolling back is passing a smaller `past_len`.
    With `bind_hidden`, `self.hidden_states` [S, H] holds the last call's final-norm output.
    """

    def __init__(self, model_dir: Path, manifest: dict, max_len: int, threads: int | None = None,
                 bind_hidden: bool = False):
        arch, names = manifest["architecture"], manifest["onnx"]
        if max_len > arch["max_positions"]:
            raise ValueError(f"max_len {max_len} > max_positions {arch['max_positions']}")
        self.session = open_session(Path(model_dir) / names["file"], session_options(threads))
        self.max_len = max_len
        self.inputs, self.outputs = names["inputs"], names["outputs"]
        shape = (1, arch["num_kv_heads"], max_len, arch["head_dim"])  # BNSH
        self.io = self.session.io_binding()
        self.bind_hidden = bind_hidden
        self.hidden_states = None
        self._logits_pos = 2 * arch["num_layers"]  # get_outputs() lists outputs in binding order
        self.buffers = []  # keep the numpy memory alive as long as the binding
        kvn = names["kv"]
        for layer in range(arch["num_layers"]):
            for past, present in (("past_key", "present_key"), ("past_value", "present_value")):
                buf = np.zeros(shape, dtype=np.float32)
                value = ort.OrtValue.ortvalue_from_numpy(buf)
                self.io.bind_ortvalue_input(kvn[past].format(layer=layer), value)
                self.io.bind_ortvalue_output(kvn[present].format(layer=layer), value)
                self.buffers.append((buf, value))

    def forward(self, ids, past_len: int, rows=None) -> np.ndarray:
        """Logits float32 [R, V] for `ids` int [S] on top of `past_len` cached tokens."""
        ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)  # [1, S]
        s = ids.shape[1]
        total = past_len + s
        if total > self.max_len:
            raise ValueError(f"sequence of {total} tokens exceeds the cache ({self.max_len})")
        rows = np.arange(s) if rows is None else np.asarray(rows)
        feeds = {
            "input_ids": ids,
            "seqlens_k": np.array([total - 1], dtype=np.int32),  # [B]
            "total_sequence_length": np.array(total, dtype=np.int32),  # scalar
            "logits_index": rows.astype(np.int64),  # [R]
            "position_ids": np.arange(past_len, total, dtype=np.int64)[None],  # [1, S]
            # packed graphs, one row: the layout is the identity
            "query_seqlens": np.array([s], dtype=np.int32),  # [1]
            "pad_index": np.arange(s, dtype=np.int64),  # [S]
            "pack_index": np.arange(s, dtype=np.int64),  # [S]
            "padded_shape": np.array([1, s, -1], dtype=np.int64),  # [3]
            "attention_bias": np.zeros((1, 1, s, total), dtype=np.float32),  # no tree: causal only
        }
        for role, value in feeds.items():
            name = self.inputs.get(role)
            if name:
                self.io.bind_cpu_input(name, value)
        # rebound every call: a bound output keeps the shape of its last run's value
        self.io.bind_output(self.outputs["logits"], "cpu")
        if self.bind_hidden:
            self.io.bind_output(self.outputs["hidden"], "cpu")
        self.session.run_with_iobinding(self.io)
        outputs = self.io.get_outputs()
        if self.bind_hidden:
            self.hidden_states = outputs[self._logits_pos + 1].numpy()[0]  # [S, H]
        return outputs[self._logits_pos].numpy()[0]  # [R, V]
