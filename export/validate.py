"""Compare an exported graph with the PyTorch model it came from, the way the runtime calls it.

Reference: PyTorch greedily continues a prompt, then one uncached forward over the whole
sequence gives reference logits at every position. The ONNX graph replays the same tokens
through the runtime itself (``specdec_rt.ort``: its session set-up, graph check and shared KV
buffers; :class:`KVSession`) in its call pattern:

    prefill P tokens (all rows) -> 3 single-token decodes -> a rejected 5-token "verify" of
    random tokens (garbage written into the cache) -> 4-token chunks from the rollback point
    (the first overwrites the garbage) -> the last chunk asks for its last row only.

Reported: max |logit difference|, greedy agreement (argmax equal) over every compared row.
Every compared logit, ONNX and PyTorch, must be finite and at most `MAX_LOGIT` in magnitude
(misread weights give ~1e37), or validation fails; the manifest never gets a NaN.
float32 graphs must match to `FP32_RTOL` of the logit scale with every confident argmax equal.
Quantized graphs differ by design (int4 moves SmolLM2's logits by ~10); they must give finite
logits whose rows correlate with the float32 ones (mean Pearson r >= `QUANT_MIN_CORRELATION`):
a sanity floor that catches a broken graph (r ~ 0), not a bound on quantization error.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from specdec_rt.manifest_schema import SCHEMA_VERSION

from .errors import ValidationError

__all__ = ["KVSession", "ValidationReport", "reference_logits", "validate_graph", "FP32_RTOL"]

FP32_RTOL = 1e-3  # max |diff| allowed, relative to max(1, max |reference logit|)
QUANT_MIN_CORRELATION = 0.5  # quantized graphs: broken packing gives r ~ 0, int4 SmolLM2 ~0.9
NEW_TOKENS = 12
MAX_LOGIT = 1e6  # |logit| of real models stays in the hundreds; 1e37 means misread weights
_PROMPT = (
    "<|im_start|>user\nWrite a Python function that checks whether a number is prime, "
    "and explain it briefly.<|im_end|>\n<|im_start|>assistant\n"
)


class KVSession:
    """One sequence (batch 1) on an exported graph, run by the runtime itself: the model the
    manifest's ``builder`` calls for (:func:`~specdec_rt.ort.open_model`: a graph built through
    optimum runs as a :class:`~specdec_rt.ort.ConcatKVModel`), an :class:`~specdec_rt.ort.OrtModel` of one slot (its session set-up, the check that the graph
    has what the manifest names, its KV pool bound as shared past/present buffers) and that
    slot's :class:`~specdec_rt.ort.OrtSession` calls.

    ``manifest``: the manifest's fields as a dict (before ``manifest.json`` is written, at least
    ``architecture`` and ``onnx``); the runtime checks them as it checks a folder it loads.
    ``forward(ids, past_len, rows)`` feeds ``S = len(ids)`` new tokens at positions
    ``past_len .. past_len + S - 1`` and returns logits ``[len(rows), V]`` for the chosen rows
    (indices into the S new positions). Rolling back is passing a smaller ``past_len``.
    With ``bind_hidden``, ``self.hidden_states`` [S, H] holds the last call's final-norm output.
    """

    def __init__(
        self,
        model_dir: Path,
        manifest: dict[str, Any],
        max_len: int,
        *,
        threads: int | None = None,
        bind_hidden: bool = False,
    ) -> None:
        from specdec_rt.ort import open_model
        from specdec_rt.ort.manifest import check_manifest

        arch = manifest["architecture"]
        if max_len > arch["max_positions"]:
            raise ValueError(f"max_len {max_len} > max_positions {arch['max_positions']}")
        fields = {"schema_version": SCHEMA_VERSION, "tokenizer": {"file": "tokenizer.json"}, **manifest}
        self.model = open_model(
            check_manifest(model_dir, fields), max_length=max_len, slots=1, threads=threads, provider="cpu"
        )
        self.session = self.model.start()
        self.max_len = self.model.max_length
        self.bind_hidden = bind_hidden
        self.hidden_states: npt.NDArray[np.float32] | None = None

    def forward(
        self, ids: npt.ArrayLike, past_len: int, rows: Sequence[int] | npt.NDArray[np.integer[Any]] | None = None
    ) -> npt.NDArray[np.float32]:
        """Logits float32 [R, V] for ``ids`` int [S] on top of ``past_len`` cached tokens."""
        tokens = np.asarray(ids, dtype=np.int64).reshape(-1)  # [S]
        count = tokens.size
        if past_len + count > self.max_len:
            raise ValueError(f"sequence of {past_len + count} tokens exceeds the cache ({self.max_len})")
        picked = np.arange(count) if rows is None else np.asarray(rows, dtype=np.int64)  # [R]
        first = int(picked.min())  # the runtime returns the logits of the last count - first positions
        out = self.session.run_sync(tokens, count - first, past_len, hidden=self.bind_hidden)
        if self.bind_hidden:
            out, self.hidden_states = out  # [count - first, V], [S, H]
        logits: npt.NDArray[np.float32] = out[picked - first]  # [R, V]
        return logits

    def close(self) -> None:
        self.session.close()
        self.model.close()


@dataclass(frozen=True, kw_only=True)
class ValidationReport:
    """The figures the summary table and the manifest record."""

    rows: int
    max_abs_diff: float
    logit_scale: float
    greedy_agreement: float
    correlation: float
    reference: str
    passed: bool

    def manifest(self) -> dict[str, Any]:
        """The manifest's `validation` record (strict JSON: a non-finite figure is null)."""

        def num(value: float, digits: int) -> float | None:
            return round(float(value), digits) if math.isfinite(value) else None

        return {
            "rows": self.rows,
            "max_abs_logit_diff": num(self.max_abs_diff, 7),
            "logit_scale": num(self.logit_scale, 3),
            "greedy_agreement": num(self.greedy_agreement, 4),
            "logit_correlation": num(self.correlation, 5),
            "reference": self.reference,
        }


def prompt_ids(tokenizer: Any, vocab_size: int, max_positions: int | None = None) -> list[int]:
    """A short code/chat prompt as ids (at most 48), padded with fixed ids if it is short; with
    ``max_positions``, short enough to leave room for the greedy continuation (:func:`new_tokens`)."""
    limit = 48 if max_positions is None else max(1, min(48, max_positions - new_tokens(max_positions, 1)))
    ids = [i for i in tokenizer.encode(_PROMPT, add_special_tokens=False) if i < vocab_size][:limit]
    rng = np.random.default_rng(0)
    return ids + [int(x) for x in rng.integers(0, vocab_size, max(0, min(16, limit) - len(ids)))]


def new_tokens(max_positions: int | None, prompt_len: int) -> int:
    """How many tokens the reference continues a prompt of ``prompt_len`` by: ``NEW_TOKENS``, fewer
    in a context of ``max_positions`` too short for them (a quarter of it at most)."""
    if max_positions is None:
        return NEW_TOKENS
    return max(0, min(NEW_TOKENS, max(1, max_positions // 4), max_positions - prompt_len))


def reference_logits(
    model: Any, prompt: list[int], new_tokens: int = NEW_TOKENS
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """Greedy-continue `prompt` in PyTorch; return (ids int64 [T], logits float32 [T, V])."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt], dtype=torch.long)  # [1, P]
        out = model(ids, use_cache=True)
        seq = list(prompt)
        for _ in range(new_tokens):
            nxt = int(out.logits[0, -1].argmax())
            seq.append(nxt)
            out = model(torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
        full = torch.tensor([seq], dtype=torch.long)  # [1, T]
        logits: npt.NDArray[np.float32] = model(full, use_cache=False).logits[0].float().numpy()  # [T, V]
    return np.array(seq, dtype=np.int64), logits


def _replay(
    session: KVSession, ids: npt.NDArray[np.int64], prompt_len: int, vocab: int
) -> Iterator[tuple[int, npt.NDArray[np.float32]]]:
    """Run the runtime's call pattern; yield (position of the first row, logits [R, V] of
    consecutive rows)."""
    total, p = len(ids), prompt_len
    yield 0, session.forward(ids[:p], 0)  # prefill, all rows
    pos = p
    for _ in range(min(3, total - pos)):
        yield pos, session.forward(ids[pos : pos + 1], pos)
        pos += 1
    garbage = np.random.default_rng(1).integers(0, vocab, 5)
    room = min(5, session.max_len - pos)
    if room > 0:  # a rejected verify, where the cache has room for one (short contexts: none)
        session.forward(garbage[:room], pos)
    while pos < total:
        end = min(pos + 4, total)
        if end == total and end - pos > 1:  # last chunk: only its last row
            yield end - 1, session.forward(ids[pos:end], pos, rows=[end - pos - 1])
        else:
            yield pos, session.forward(ids[pos:end], pos)
        pos = end


def validate_graph(
    model_dir: Path,
    manifest: dict[str, Any],
    ids: npt.NDArray[np.int64],
    ref: npt.NDArray[np.float32],
    *,
    prompt_len: int,
    threads: int | None = None,
    quantized: bool = False,
    raise_on_fail: bool = True,
    label: str | None = None,
) -> ValidationReport:
    """Replay `ids` (the first ``prompt_len`` of them the prompt) through the exported graph and
    compare with `ref` [T, V]; a failure names ``label`` (default: the folder's name)."""
    from specdec_rt.errors import SpecDecError

    name = label or model_dir.name
    max_len = min(manifest["architecture"]["max_positions"], len(ids) + 16)
    try:
        session = KVSession(model_dir, manifest, max_len=max_len, threads=threads)
    except SpecDecError as exc:  # the runtime refuses the graph or its manifest
        raise ValidationError(f"validation failed for {name}: the runtime cannot load it: {exc}") from exc
    got = np.zeros_like(ref)
    rows = np.zeros(len(ref), dtype=bool)  # compared rows
    try:
        for start, logits in _replay(session, ids, prompt_len, manifest["architecture"]["vocab_size"]):
            got[start : start + len(logits)] = logits
            rows[start : start + len(logits)] = True
    finally:
        session.close()
    onnx_rows, ref_rows = got[rows].astype(np.float64), ref[rows].astype(np.float64)
    report = _compare(onnx_rows, ref_rows, quantized)
    if raise_on_fail and not report.passed:
        raise _failure(name, onnx_rows, ref_rows, report)
    return report


def _all_finite(got: npt.NDArray[np.float64], want: npt.NDArray[np.float64]) -> bool:
    """There are rows to compare, and every logit of both is finite."""
    return bool(len(got)) and bool(np.isfinite(got).all()) and bool(np.isfinite(want).all())


def _plausible(got: npt.NDArray[np.float64], want: npt.NDArray[np.float64]) -> bool:
    """No (finite) logit of either is beyond ``MAX_LOGIT`` in magnitude."""
    return float(np.abs(want).max()) <= MAX_LOGIT and float(np.abs(got).max()) <= MAX_LOGIT


def _compare(got: npt.NDArray[np.float64], want: npt.NDArray[np.float64], quantized: bool) -> ValidationReport:
    """The figures of the graph's logits ``got`` against the reference's ``want`` [R, V], and
    whether they pass: float32 graphs to ``FP32_RTOL`` with every confident argmax equal,
    quantized ones the correlation floor; any non-finite or implausible logit fails."""
    count = len(got)
    finite = _all_finite(got, want)
    sane = finite and _plausible(got, want)
    if finite:
        diff = float(np.abs(got - want).max())
        scale = float(max(1.0, np.abs(want).max()))
        agree = got.argmax(axis=1) == want.argmax(axis=1)
        top2 = np.sort(want, axis=1)[:, -2:]
        confident = (top2[:, 1] - top2[:, 0]) > 2 * diff  # a near-tie may flip legitimately
        corr = _row_correlation(got, want)
    else:
        diff = scale = float("inf")
        agree, confident = np.zeros(count, dtype=bool), np.ones(count, dtype=bool)
        corr = float("nan")
    if quantized:
        passed = sane and corr >= QUANT_MIN_CORRELATION
        reference = "float32 PyTorch model (quantized graph: correlation floor only)"
    else:
        passed = sane and diff <= FP32_RTOL * scale and bool(agree[confident].all())
        reference = "float32 PyTorch model"
    return ValidationReport(
        rows=count,
        max_abs_diff=diff,
        logit_scale=scale,
        greedy_agreement=float(agree.mean()) if count else 0.0,
        correlation=corr,
        reference=reference,
        passed=passed,
    )


def _failure(
    name: str, got: npt.NDArray[np.float64], want: npt.NDArray[np.float64], report: ValidationReport
) -> ValidationError:
    """Why the comparison of ``got`` with ``want`` failed, naming the folder ``name``."""
    if not _all_finite(got, want):
        which = "ONNX" if len(got) and not np.isfinite(got).all() else "PyTorch reference"
        return ValidationError(
            f"validation failed for {name}: the {which} logits are not finite (NaN or infinity) over {report.rows} rows"
        )
    if not _plausible(got, want):
        return ValidationError(
            f"validation failed for {name}: logits of magnitude "
            f"{max(np.abs(got).max(), np.abs(want).max()):.3g} (over {MAX_LOGIT:.0g}) are not "
            "those of a working model (corrupt or misread weights)"
        )
    return ValidationError(
        f"validation failed for {name}: max |logit diff| {report.max_abs_diff:.3g} "
        f"(scale {report.logit_scale:.3g}), greedy agreement {report.greedy_agreement:.1%}, correlation "
        f"{report.correlation:.3f} over {report.rows} rows"
    )


def _row_correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Mean Pearson correlation of matching rows of a, b [R, V] (float64: no overflow)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    a = a - a.mean(axis=1, keepdims=True)
    b = b - b.mean(axis=1, keepdims=True)
    den = np.sqrt((a * a).sum(axis=1) * (b * b).sum(axis=1))
    return float(np.mean((a * b).sum(axis=1) / np.maximum(den, 1e-30)))
