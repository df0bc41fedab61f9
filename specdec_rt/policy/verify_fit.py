"""What a verify call over k drafts costs, fitted from measured seconds: pure math, no state.

Measured verify costs are concave in k: the first draft costs most (one position goes through
matrix-vector kernels, two or more through matrix-matrix ones; SmolLM2 fp32: 11.3 ms plain,
13.9 / 14.9 / 16.0 / 16.9 / 17.7 ms over 1-5 drafts). So :func:`fit_line` takes ``s`` as the
least-squares slope of the verifies measured over k >= 1 (when they span at least 2) and ``j``
as the jump from a plain step to that line: ``v(k) = 1 + j + s*k`` plain steps. A line through
the plain step and the longest verify (an earlier model) overstated the slope, so every longer
chain looked dearer than it is and requests kept to short ones (measured only what they chose).

A line misses the steps of CPU matrix kernels (rows in blocks); each measured length's own
cost was tried instead and not kept (docs/decisions/0006-verify-cost-fit.md).
"""

from __future__ import annotations

__all__ = ["fit_line"]

Line = tuple[float | None, float, float]  # (base seconds of a plain step or None, j, s)


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
        slope_s = max(0.0, sum((k - mk) * (v - mv) for k, v in points.items()) / sum((k - mk) ** 2 for k in points))
        at_zero = max(1e-9, mv - slope_s * mk)  # the line's value at k = 0
        base = plain if plain is not None else at_zero
        return base, max(0.0, at_zero / base - 1.0), slope_s / base
    k0 = min(points)
    base = plain if plain is not None else points[k0] / (1.0 + s_default * k0)
    return base, max(0.0, points[k0] / base - 1.0 - s_default * k0), s_default
