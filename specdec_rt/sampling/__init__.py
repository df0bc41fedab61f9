"""Pure sampling math: logits -> probabilities, and lossless speculative rejection sampling.

Notation, used everywhere in specdec-rt (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding"):

* ``p`` is the **target** model's distribution, ``q`` the **draft** model's distribution.
* ``k`` draft tokens ``x_1..x_k`` were proposed; ``p_i`` / ``q_i`` are the distributions at the
  position of ``x_{i+1}`` (0-based rows), so ``p`` has one more row than ``q``: ``p_k`` is the
  target's distribution after all k drafts.

Rejection sampling keeps ``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))``. At the first
rejection it emits one **recovered** token drawn from ``norm(max(0, p_i - q_i))``; if every draft
is accepted it emits one **bonus** token drawn from ``p_k``. Either way the emitted tokens are
distributed exactly as if they had been sampled from ``p`` one by one.

Everything here is NumPy on plain arrays: no I/O, no model, no global state. Randomness comes in
as a ``numpy.random.Generator`` so callers decide seeding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..checks import brief_repr, check_int, check_number, is_int, is_number
from ..errors import InvalidInputError

__all__ = [
    "SamplingParams",
    "warp",
    "greedy_ids",
    "sample",
    "uniforms",
    "rejection_sample",
    "greedy_accept",
    "ROW_SUM_TOLERANCE",
    "MIN_TEMPERATURE",
    "biased",
    "MAX_LOGIT_BIAS",
    "MIN_REPETITION_PENALTY",
]

# A probability row may deviate from 1 by this much (float32 softmax over 150k entries stays
# well inside it; anything larger is a bug upstream, not rounding).
ROW_SUM_TOLERANCE = 1e-3

# Temperatures in (0, MIN_TEMPERATURE) are greedy (see SamplingParams): below it, a logit 1e-3
# under the maximum gets a weight under exp(-100) ~ 4e-44 (zero or subnormal in float32), so only
# tokens tied with the maximum to float32 noise could still be drawn. vLLM uses the same cut-off.
MIN_TEMPERATURE = 1e-5

# Top-p first looks among this many most likely tokens and sorts the whole row only if they do not
# hold top_p of the mass (a full argsort of a 49k row costs ~2 ms; a partition ~0.3 ms).
_TOP_P_CANDIDATES = 512


@dataclass(frozen=True)
class SamplingParams:
    """How logits become a distribution. The same warping is applied to draft and target, so
    speculative decoding is exact with respect to the *warped* target distribution.

    ``temperature == 0`` means greedy: a one-hot row at the argmax (the lowest id wins ties).
    So does any temperature below :data:`MIN_TEMPERATURE` (``1e-5``, as in vLLM): at such a
    temperature a logit only 1e-3 under the maximum gets a weight below ``exp(-100)``, zero or
    subnormal in float32, so sampling could differ from greedy only among tokens tied with the
    maximum to float32 noise; greedy decides those ties by the lowest id, deterministically, and
    takes the exact-match fast path. (Dividing float32 logits by ``1e-300`` itself would give
    inf and NaN.) ``temperature`` keeps the value given; :attr:`greedy` says which applies.
    Any finite temperature above that samples; one beyond float32's range (> 3.4e38) acts as
    3.4e38, which is uniform over the tokens top-k/top-p keep.
    ``top_k`` keeps the k most likely tokens (ties with the k-th are kept), ``top_p`` the smallest
    set of most likely tokens holding at least that much mass (ties at the boundary are kept).
    ``seed`` makes a request reproducible (see ``SpecDecScheduler``). ``logit_bias``: ``{token id:
    bias}`` (a bias from -100 to 100, at most :data:`MAX_LOGIT_BIAS` entries; a dict is kept as
    sorted pairs) added to the logits before everything else, greedy included (OpenAI's
    ``logit_bias``: -100 bans a token, +100 all but forces it). Draft and target are biased alike;
    exactness holds for the biased target distribution. ``presence_penalty``,
    ``frequency_penalty`` and ``repetition_penalty`` (off: 0, 0, 1) depend on the tokens before
    each position: :mod:`specdec_rt.sampling.penalties` applies them, before the bias.

    :attr:`penalized` says whether any penalty is on.

    Attributes:
        temperature: 0 (or below :data:`MIN_TEMPERATURE`): greedy; above: samples.
        top_k: Keep the k most likely tokens (``None``: all).
        top_p: Keep the smallest set of most likely tokens holding this much mass (``None``:
            all).
        seed: Makes a request reproducible.
        logit_bias: ``((id, bias), ...)`` by id (a dict is taken too).
        presence_penalty: -2..2 (0: off).
        frequency_penalty: -2..2 (0: off).
        repetition_penalty: 0.01..10 (1: off).

    Raises:
        InvalidInputError: A bad value (wrong types, bools, NaN, inf, negative, ``top_p``
            outside (0, 1]), naming the field.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] | None = None  # ((id, bias), ...) by id; a dict is taken too
    presence_penalty: float = 0.0  # -2..2; these three: see specdec_rt.sampling.penalties
    frequency_penalty: float = 0.0  # -2..2
    repetition_penalty: float = 1.0  # 0.01..10; 1: off

    def __post_init__(self) -> None:
        object.__setattr__(self, "logit_bias", _check_bias(self.logit_bias))
        for name, value in (("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)):
            check_number(value, name, -2.0, 2.0)
        check_number(self.repetition_penalty, "repetition_penalty", MIN_REPETITION_PENALTY, 10.0)
        check_number(self.temperature, "temperature", 0.0)
        check_int(self.top_k, "top_k", 1, optional=True, what="a positive integer or None")
        check_number(self.top_p, "top_p", 0.0, 1.0, lo_open=True, optional=True)
        check_int(self.seed, "seed", 0, optional=True, what="a non-negative integer or None")

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        """Temperature 0, or below :data:`MIN_TEMPERATURE`: the argmax, no sampling."""
        return self.temperature < MIN_TEMPERATURE


MAX_LOGIT_BIAS = 1024  # token ids a request may bias
# dividing a float32 logit by less would overflow to +inf for large logits (1e-39 did): a
# repetition penalty amplifies at most 100x
MIN_REPETITION_PENALTY = 0.01
MAX_BIAS = 100.0  # |bias|, as in OpenAI's API


def _check_bias(bias: object) -> tuple[tuple[int, float], ...] | None:
    """``None``/empty -> None; a dict (or pairs) of non-negative int ids -> finite biases in
    [-100, 100] -> sorted ``((id, bias), ...)``; else :class:`InvalidInputError` naming the entry."""
    if bias is None:
        return None
    pairs = list(bias.items()) if isinstance(bias, dict) else bias
    if not isinstance(pairs, (list, tuple)) or len(pairs) > MAX_LOGIT_BIAS:
        raise InvalidInputError(
            f"logit_bias must be a dict of at most {MAX_LOGIT_BIAS} token ids to biases, got {brief_repr(bias)}"
        )
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise InvalidInputError(f"logit_bias entries must be (token id, bias) pairs, got {brief_repr(pair)}")
        tid, b = pair
        if not is_int(tid) or not 0 <= tid < 2**31:
            raise InvalidInputError(
                f"logit_bias token ids must be non-negative integers below 2**31, got {brief_repr(tid)}"
            )
        if not is_number(b) or abs(float(b)) > MAX_BIAS:
            raise InvalidInputError(
                f"logit_bias of token {int(tid)} must be a number from -100 to 100, got {brief_repr(b)}"
            )
        out[int(tid)] = float(b)
    return tuple(sorted(out.items())) or None


def biased(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """``logits`` ``[..., V]`` plus the request's ``logit_bias`` (the same array when it has none)."""
    if not params.logit_bias:
        return logits
    ids = np.fromiter((t for t, _ in params.logit_bias), dtype=np.int64)  # [n]
    if ids[-1] >= logits.shape[-1]:
        raise InvalidInputError(
            f"logit_bias token id {int(ids[-1])} is outside the vocabulary (ids 0..{logits.shape[-1] - 1})"
        )
    out = np.array(logits, dtype=np.result_type(logits.dtype, np.float32))  # a copy: the caller's rows stay raw
    out[..., ids] += np.fromiter((b for _, b in params.logit_bias), dtype=np.float64).astype(out.dtype)
    return out


def greedy_ids(logits: np.ndarray, params: SamplingParams | None = None) -> np.ndarray:
    """The argmax of each row of ``logits`` ``[..., V]`` plus the logit bias of ``params`` (none:
    the logits as they are; the lowest id wins ties): ``[...]`` ids. A row whose maximum is NaN
    or +inf, or that has no finite value, is :class:`InvalidInputError`, as in :func:`warp`
    (``np.argmax`` would pick a NaN, or id 0 of a row of -inf, and greedy decoding would go on
    with it). One look at each chosen value."""
    z = np.asarray(logits) if params is None else biased(np.asarray(logits), params)
    ids: np.ndarray = np.argmax(z, axis=-1)  # [...]
    top = np.take_along_axis(z, ids[..., None], axis=-1)[..., 0]  # [...] NaN if the row holds one
    if not np.isfinite(top).all():
        raise InvalidInputError(
            f"logits {_row_name(~np.isfinite(top))} holds NaN or +inf, or no finite value: no token to choose"
        )
    return ids


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Logits ``[..., V]`` -> probabilities ``[..., V]`` (same float dtype; float64 stays float64).

    The logit bias, then temperature, then top-k, then softmax, then top-p, as Hugging Face
    ``generate`` orders them. If dividing by the temperature overflows, each row is shifted by its
    maximum first, so the scaled logits are <= 0 (an overflow is -inf, a weight of 0) and every row
    keeps its maximum at weight 1: no temperature turns finite logits into NaN.

    Args:
        logits: The model's logits ``[..., V]``.
        params: The bias, temperature, top-k and top-p to apply.

    Returns:
        The probabilities ``[..., V]``.

    Raises:
        InvalidInputError: An empty last axis, or a row with NaN, +inf or no finite logit, named.
    """
    z = np.asarray(logits)
    if not np.issubdtype(z.dtype, np.floating):
        z = z.astype(np.float64)
    z = biased(z, params)
    if z.ndim == 0 or z.shape[-1] == 0:
        raise InvalidInputError(f"logits must have a non-empty last axis, got shape {z.shape}")
    top = np.max(z, axis=-1, keepdims=True)  # [..., 1]; NaN if the row holds one
    if not np.isfinite(top).all():
        raise InvalidInputError(
            f"logits {_row_name(~np.isfinite(top[..., 0]))} holds NaN or +inf, or no "
            "finite value: not a distribution to sample from"
        )
    if params.greedy:
        out = np.zeros_like(z)  # [..., V]
        np.put_along_axis(out, np.argmax(z, axis=-1)[..., None], 1.0, axis=-1)
        return out
    t = z.dtype.type(min(float(params.temperature), float(np.finfo(z.dtype).max)))  # > 0, finite
    with np.errstate(over="ignore"):
        scaled = z / t  # [..., V]
        peak = np.max(scaled, axis=-1, keepdims=True)  # top-k keeps it: the softmax's shift
        if not np.isfinite(peak).all():  # a row overflowed (inf - inf would be NaN): shift first
            scaled, peak = (z - top) / t, 0.0  # <= 0, exactly 0 at the maximum; overflow -> -inf
    if params.top_k is not None and params.top_k < scaled.shape[-1]:
        # k-th largest value per row; everything strictly below it is dropped
        kth = -np.partition(-scaled, params.top_k - 1, axis=-1)[..., params.top_k - 1 : params.top_k]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    with np.errstate(over="ignore"):
        probs: np.ndarray = np.exp(scaled - peak)  # an overflow below the peak is -inf: weight 0
    probs /= probs.sum(axis=-1, keepdims=True)  # each sum >= 1 (the maximum's weight)
    if params.top_p is not None and params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    return probs


def _row_name(bad: np.ndarray) -> str:
    """'row 3' (or 'row (0, 3)') for the first True of ``bad``, or '' for a single row."""
    if bad.ndim == 0:
        return "row"
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    return f"row {where[0] if len(where) == 1 else where}"


def _top_p(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Keep, per row, the smallest set of most likely tokens whose mass reaches ``top_p``."""
    flat = probs.reshape(-1, probs.shape[-1])  # [rows, V]
    out = np.empty_like(flat)
    v = flat.shape[-1]
    for r, row in enumerate(flat):
        c = min(v, _TOP_P_CANDIDATES)
        top = row if c == v else row[np.argpartition(-row, c - 1)[:c]]  # [c], unsorted
        top = np.sort(top)[::-1]  # [c], descending
        cum = np.cumsum(top)
        if cum[-1] < top_p * (1 - 1e-7) and c < v:  # the candidates do not hold enough mass
            top = np.sort(row)[::-1]
            cum = np.cumsum(top)
        # first index whose cumulative mass reaches top_p; its probability is the cut-off
        m = min(int(np.searchsorted(cum, top_p * (1 - 1e-7))), len(top) - 1)
        kept = np.where(row >= top[m], row, 0.0)
        out[r] = kept / kept.sum()
    return out.reshape(probs.shape)


def uniforms(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` uniform draws in [0, 1): the only source of randomness in this module."""
    draw = getattr(rng, "random", None)
    if not callable(draw):
        raise InvalidInputError(f"rng must be a numpy.random.Generator, got {brief_repr(rng)}")
    draws: np.ndarray = draw(n)
    return draws


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token id drawn from the distribution ``probs`` ``[V]`` (need not be normalized).

    Inverse-CDF with one uniform; tokens of probability 0 are never returned. Nothing is ever
    picked from NaN.

    Args:
        probs: The weights ``[V]``.
        rng: The generator the uniform comes from.

    Returns:
        The drawn token id.

    Raises:
        InvalidInputError: A row that is not a distribution (not 1-D, empty, NaN, inf, negative
            entries, all zero), saying which.
    """
    probs = np.asarray(probs)
    if probs.ndim != 1 or probs.size == 0:
        raise InvalidInputError(f"probs must be a non-empty row [V], got shape {probs.shape}")
    if probs.dtype.kind in "iu":  # integer weights: summed as floats (an int64 sum wraps around)
        probs = probs.astype(np.float64)
    cdf = np.cumsum(probs)  # [V]
    total = cdf[-1]  # NaN if any entry is NaN, inf if one is inf
    if not np.isfinite(total) or total <= 0 or probs.min() < 0:
        what = (
            "holds NaN or inf" if not np.isfinite(total) else "has negative entries" if probs.min() < 0 else "sums to 0"
        )
        raise InvalidInputError(f"probs row {what}: not a distribution to sample from")
    u = uniforms(rng, 1)[0] * total
    return int(min(np.searchsorted(cdf, u, side="right"), len(cdf) - 1))


def rejection_sample(
    draft_ids: np.ndarray,  # [k] int, the drafted tokens x_1..x_k
    q: np.ndarray,  # [k, V] draft distributions the drafts were drawn from
    p: np.ndarray,  # [k+1, V] target distributions at the same positions, plus one
    rng: np.random.Generator,
) -> np.ndarray:  # [n+1] int: accepted prefix of draft_ids (n tokens), then one more
    """Speculative rejection sampling (the module docstring states the math).

    Greedy decoding is this same call with one-hot ``p`` and ``q``; it then reduces to exact token
    matching (see :func:`greedy_accept`, the fast path with the same result).

    A draft token with ``q_i(x_i) = 0`` (impossible if it was drawn from ``q``) is rejected with
    certainty, which says nothing about ``p``: the token then comes from ``p_n`` itself, not from
    the residual (whose lemma assumes ``x_n ~ q_n``), so the output is still distributed as ``p``.
    Rows are taken as given: exactness is to rows that sum to 1 (within ``ROW_SUM_TOLERANCE``
    they are accepted, not renormalised).

    Args:
        draft_ids: The drafted tokens ``x_1..x_k`` ``[k]``.
        q: The draft distributions the drafts were drawn from ``[k, V]``.
        p: The target distributions at the same positions, plus one ``[k+1, V]``.
        rng: The generator of the acceptance tests and the resampled token.

    Returns:
        The accepted prefix of ``draft_ids`` followed by exactly one token ``[n+1]``: the
        recovered token resampled from ``norm(max(0, p_n - q_n))`` at the first rejection ``n``,
        or the bonus token from ``p_k`` when all ``k`` drafts were accepted. Length 1..k+1.

    Raises:
        InvalidInputError: (a ``ValueError``) naming the problem: k = 0, shapes that do not fit,
            ids out of range, NaN/inf or negative entries, rows not summing to 1.
    """
    draft_ids, q, p = _check(draft_ids, q, p)
    k = draft_ids.shape[0]
    rows = np.arange(k)
    p_x = p[rows, draft_ids]  # [k] p_i(x_i)
    q_x = q[rows, draft_ids]  # [k] q_i(x_i)
    u = uniforms(rng, k)  # [k]
    # accept x_i  <=>  u_i < p_i(x_i) / q_i(x_i), written without dividing; q_i(x_i) = 0 rejects
    accepted = (q_x > 0) & (u * q_x < p_x)  # [k] bool
    n = k if accepted.all() else int(np.argmin(accepted))  # index of the first rejection
    if n == k or q_x[n] == 0:
        last = sample(p[n], rng)  # bonus token (every draft accepted), or after a certain rejection
    else:
        residual = np.maximum(p[n] - q[n], 0.0)  # [V] unnormalized norm(max(0, p_n - q_n))
        # all zero only if p_n == q_n, where a rejection has probability 0 (float rounding aside)
        last = sample(residual if residual.sum() > 0 else p[n], rng)
    return np.append(draft_ids[:n], np.int64(last)).astype(np.int64)


def greedy_accept(
    draft_ids: np.ndarray,  # [k] int
    target_ids: np.ndarray,  # [k+1] int, argmax of p at each position
) -> np.ndarray:  # [n+1] int
    """Exact-match acceptance: :func:`rejection_sample` with one-hot ``p`` and ``q``, without
    building ``[k, V]`` one-hot arrays. Accepts drafts while they equal the target's argmax, then
    emits the target's token at the first mismatch (or the bonus after k matches).

    Args:
        draft_ids: The drafted tokens ``[k]``.
        target_ids: The target's argmax at each position ``[k+1]``.

    Returns:
        The accepted drafts followed by the target's token ``[n+1]``.

    Raises:
        InvalidInputError: Ids that are not a 1-D integer array, a negative id, or ``target_ids``
            not of shape ``[k+1]``.
    """
    draft_ids, target_ids = np.asarray(draft_ids), np.asarray(target_ids)
    for name, ids in (("draft_ids", draft_ids), ("target_ids", target_ids)):
        if ids.ndim != 1 or not (np.issubdtype(ids.dtype, np.integer) or ids.size == 0):
            raise InvalidInputError(f"{name} must be a 1-D integer array, got dtype {ids.dtype} shape {ids.shape}")
        if ids.size and ids.min() < 0:
            raise InvalidInputError(f"{name} holds the negative token id {int(ids.min())}")
    draft_ids, target_ids = draft_ids.astype(np.int64), target_ids.astype(np.int64)
    if target_ids.shape != (draft_ids.shape[0] + 1,):
        raise InvalidInputError(
            f"target_ids must have shape [k+1] = [{draft_ids.shape[0] + 1}], got {target_ids.shape}"
        )
    mismatch = draft_ids != target_ids[:-1]  # [k]
    n = int(np.argmax(mismatch)) if mismatch.any() else draft_ids.shape[0]
    return np.append(draft_ids[:n], target_ids[n])


def check_rows(name: str, a: np.ndarray) -> None:
    """``a`` ``[rows, V]`` holds probability rows: float, finite, non-negative, each summing to 1
    within ``ROW_SUM_TOLERANCE``; else :class:`InvalidInputError` naming ``name`` and the row."""
    if not np.issubdtype(a.dtype, np.floating):
        raise InvalidInputError(f"{name} must be a float array, got dtype {a.dtype}")
    if not np.all(np.isfinite(a)):
        r = int(np.argwhere(~np.isfinite(a))[0][0])
        raise InvalidInputError(f"{name} row {r} contains NaN or inf")
    if (a < 0).any():
        r = int(np.argwhere(a < 0)[0][0])
        raise InvalidInputError(f"{name} row {r} has negative probabilities")
    sums = a.sum(axis=1)
    bad = np.abs(sums - 1.0) > ROW_SUM_TOLERANCE
    if bad.any():
        r = int(np.argmax(bad))
        raise InvalidInputError(f"{name} row {r} sums to {sums[r]:.6g}, not 1 (tolerance {ROW_SUM_TOLERANCE})")


def _check(draft_ids: np.ndarray, q: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    draft_ids = np.asarray(draft_ids)
    q = np.asarray(q)
    p = np.asarray(p)
    if draft_ids.ndim != 1 or not np.issubdtype(draft_ids.dtype, np.integer):
        raise InvalidInputError(
            f"draft_ids must be a 1-D integer array [k], got dtype {draft_ids.dtype} shape {draft_ids.shape}"
        )
    k = draft_ids.shape[0]
    if k == 0:
        raise InvalidInputError("draft_ids is empty (k = 0): there is nothing to verify")
    if p.ndim != 2 or p.shape[0] != k + 1 or p.shape[1] == 0:
        raise InvalidInputError(f"p must have shape [k+1, V] = [{k + 1}, V], got {p.shape}")
    v = p.shape[1]
    if q.shape != (k, v):
        raise InvalidInputError(f"q must have shape [k, V] = [{k}, {v}], got {q.shape}")
    check_rows("q", q)
    check_rows("p", p)
    if draft_ids.min() < 0 or draft_ids.max() >= v:
        bad_id = int(draft_ids[(draft_ids < 0) | (draft_ids >= v)][0])
        raise InvalidInputError(f"draft id {bad_id} is out of range for vocabulary size {v}")
    return draft_ids.astype(np.int64), q, p
