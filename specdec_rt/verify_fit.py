"""What a verify call over k drafts costs, fitted from measured seconds: pure math, no state.

Measured verify costs are concave in k: the first draft costs most (one position goes through
matrix-vector kernels, two or more through matrix-matrix ones; SmolLM2 fp32: 11.3 ms plain,
13.9 / 14.9 / 16.0 / 16.9 / 17.7 ms over 1-5 drafts). So :func:`fit_line` takes ``s`` as the
least-squares slope of the verifies measured over k >= 1 (when they span at least 2) and ``j``
as the jump from a plain step to that line: ``v(k) = 1 + j + s*k`` plain steps. A line through
the plain step and the longest verify (an earlier model) overstated the slope, so every longer
chain looked dearer than it is and requests kept to short ones (measured only what they chose).

A line misses steps: CPU matrix kernels take rows in blocks (MLAS's AVX2 kernel 6 at a time),
so on Qwen2.5-Coder-1.5B fp32 (AVX2) 6 positions cost 1.22 plain steps and 7 cost 1.55, where
the line said 1.34 and 1.41 and 1 round in 4 verified 7 positions. :func:`measured_steps`
keeps each measured length's own cost, weighed by its calls (up to ``VERIFY_TRUST``) against
the line (weight ``VERIFY_PRIOR``), then made nondecreasing in k by weighted
pool-adjacent-violators: one stalled call at a rarely drafted length (the machine is shared)
neither rules that length out nor, averaged with its neighbours, makes them look dear.
:func:`verify_cost` reads a length off both.
"""

from __future__ import annotations

__all__ = ["fit_line", "measured_steps", "verify_cost", "VERIFY_TRUST", "VERIFY_PRIOR"]

VERIFY_TRUST = 10  # verify calls of one length after which its measurement is trusted in full
VERIFY_PRIOR = 2.0  # calls' worth of weight the fitted line keeps at a measured length

Line = tuple  # (base seconds of a plain step or None, j, s)


def fit_line(verify_s: dict[int, float], s_default: float) -> Line:
    """``(base, j, s)`` from seconds per verify over k drafts (``verify_s[0]``: a plain step):
    ``base`` None while nothing is measured; one length (or adjacent ones) measured: the
    configured slope ``s_default``, the rest a jump."""
    points = {k: v for k, v in verify_s.items() if k > 0}
    plain = verify_s.get(0)
    if not points:
        return plain, 0.0, s_default
    if len(points) >= 2 and max(points) - min(points) >= 2:  # least squares over k >= 1
        n = len(points)
        mk, mv = sum(points) / n, sum(points.values()) / n
        slope_s = max(0.0, sum((k - mk) * (v - mv) for k, v in points.items())
                      / sum((k - mk) ** 2 for k in points))
        at_zero = max(1e-9, mv - slope_s * mk)  # the line's value at k = 0
        base = plain if plain is not None else at_zero
        return base, max(0.0, at_zero / base - 1.0), slope_s / base
    k0 = min(points)
    base = plain if plain is not None else points[k0] / (1.0 + s_default * k0)
    return base, max(0.0, points[k0] / base - 1.0 - s_default * k0), s_default


def measured_steps(verify_s: dict[int, float], verify_n: dict[int, int], line: Line) -> dict[int, float]:
    """Measured lengths k >= 1 -> cost in plain steps, nondecreasing in k (empty without a
    base). A length missing from ``verify_n`` counts as trusted (``VERIFY_TRUST`` calls)."""
    base, j, s = line
    blocks: list[list] = []  # [weighted sum, weight, ks]
    for k in sorted(k for k in verify_s if k > 0) if base else ():
        w = min(verify_n.get(k, VERIFY_TRUST), VERIFY_TRUST)
        v = (w * verify_s[k] / base + VERIFY_PRIOR * (1.0 + j + s * k)) / (w + VERIFY_PRIOR)
        blocks.append([v * w, w, [k]])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            top = blocks.pop()
            blocks[-1] = [blocks[-1][0] + top[0], blocks[-1][1] + top[1], blocks[-1][2] + top[2]]
    return {k: max(1.0, total / w) for total, w, ks in blocks for k in ks}


def verify_cost(k: int, line: Line, steps: dict[int, float]) -> float:
    """A verify over ``k`` drafts in plain steps: 1 for k = 0; a measured length's fitted cost;
    elsewhere the line ``1 + j + s*k``, kept between the measured lengths around k."""
    if k <= 0:
        return 1.0
    if k in steps:
        return steps[k]
    _, j, s = line
    below = [v for m, v in steps.items() if m < k]
    above = [v for m, v in steps.items() if m > k]
    lo, hi = (max(below) if below else 1.0), (min(above) if above else float("inf"))
    return min(max(1.0 + j + s * k, lo), hi) if lo <= hi else lo
