"""The checking helpers every layer uses for a caller's values: strict integers (never a bool),
finite numbers, True-or-False, and a short description of a bad value for the message.

Each ``check_*`` returns the value when it is good and otherwise raises ``error`` (by default
:class:`~specdec_rt.errors.InvalidInputError`) with ``"<name> must be <what>, got <value>"``:
``what`` is built from the bounds (``"a positive integer"``, ``"an integer in 0..20"``,
``"None or an integer >= 2"``) unless the caller words it. The ``is_*`` predicates say the
same without raising, for a caller whose message has another shape. :func:`positional_keywords`
takes keyword-only options a caller still passes by position, with a DeprecationWarning.

The lowest layer beside :mod:`specdec_rt.errors`: it imports nothing else of specdec_rt.
"""

from __future__ import annotations

import math
import reprlib
import warnings
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from .errors import InvalidInputError

__all__ = ["brief_repr", "check_bool", "check_int", "check_number", "is_int", "is_number", "positional_keywords"]


def brief_repr(value: Any, limit: int = 80) -> str:
    """A short repr of a caller's value for an error message, cheap whatever its size (a string
    of 10**8 characters, a list of 10**7 items), never raising (an int of 10**5 digits has no
    str(); a hostile ``__repr__``)."""
    try:
        text = reprlib.repr(value)
    except Exception:  # noqa: BLE001 - any failure to describe it
        bits = value.bit_length() if isinstance(value, int) else None
        text = f"an int of {bits} bits" if bits is not None else f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_int(value: Any, *, numpy: bool = True) -> bool:
    """An integer and not a bool: a Python ``int``, or a NumPy integer unless ``numpy=False``
    (``True``, ``1.0`` and ``np.bool_(True)`` are not)."""
    if isinstance(value, (bool, np.bool_)):
        return False
    return isinstance(value, (int, np.integer) if numpy else int)


def is_number(value: Any) -> bool:
    """A real number (not a bool) that is finite as a float (``10**400``, NaN and inf are not)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _int_words(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f"an integer in {lo}..{hi}"
    if lo == 1:
        return "a positive integer"
    if lo is not None:
        return f"an integer >= {lo}"
    return "an integer" if hi is None else f"an integer <= {hi}"


def check_int(
    value: Any,
    name: str,
    lo: int | None = None,
    hi: int | None = None,
    *,
    optional: bool = False,
    numpy: bool = True,
    what: str | None = None,
    error: type[Exception] = InvalidInputError,
) -> Any:
    """``value`` if it is an integer (see :func:`is_int`) in ``lo..hi`` (either bound may be
    None), or None when ``optional``; else ``error`` naming ``name`` and the value."""
    if value is None and optional:
        return None
    if not is_int(value, numpy=numpy) or (lo is not None and value < lo) or (hi is not None and value > hi):
        words = what or ("None or " if optional else "") + _int_words(lo, hi)
        raise error(f"{name} must be {words}, got {brief_repr(value)}")
    return value


def _number_words(lo: float | None, hi: float | None, lo_open: bool) -> str:
    if lo is not None and hi is not None:
        return f"in ({lo:g}, {hi:g}]" if lo_open else f"a number from {lo:g} to {hi:g}"
    if lo is not None:
        return f"a finite number {'>' if lo_open else '>='} {lo:g}"
    return "a finite number" if hi is None else f"a finite number <= {hi:g}"


def check_number(
    value: Any,
    name: str,
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    optional: bool = False,
    what: str | None = None,
    error: type[Exception] = InvalidInputError,
) -> Any:
    """``value`` if it is a finite real number (see :func:`is_number`) from ``lo`` to ``hi``
    (inclusive; ``lo_open``: above ``lo``), or None when ``optional``; else ``error`` naming
    ``name`` and the value."""
    if value is None and optional:
        return None
    if (
        not is_number(value)
        or (lo is not None and (value <= lo if lo_open else value < lo))
        or (hi is not None and value > hi)
    ):
        words = what or _number_words(lo, hi, lo_open) + (" or None" if optional else "")
        raise error(f"{name} must be {words}, got {brief_repr(value)}")
    return value


def check_bool(value: Any, name: str, *, error: type[Exception] = InvalidInputError) -> bool:
    """``value`` if it is True or False, else ``error`` naming ``name`` (``1``, ``"yes"`` and
    ``np.bool_(True)`` are not)."""
    if not isinstance(value, bool):
        raise error(f"{name} must be True or False, got {brief_repr(value)}")
    return value


def positional_keywords(
    owner: str,
    names: Sequence[str],
    values: Sequence[Any],
    given: Collection[str],
    *,
    error: type[Exception] = InvalidInputError,
    stacklevel: int = 2,
) -> dict[str, Any]:
    """The keyword-only options ``names`` a caller of ``owner`` passed by position (``values``:
    the first of them, in order, as before they became keywords) as keywords, after a
    DeprecationWarning naming them; one also given by keyword (in ``given``) is ``error``.
    ``stacklevel`` is ``warnings.warn``'s, counted from the function that calls this one."""
    named = list(names[: len(values)])
    if twice := [name for name in named if name in given]:
        raise error(f"{owner} got {twice[0]} both by position and by keyword")
    warnings.warn(
        f"{owner}: pass {', '.join(named)} by keyword (positional use is deprecated)",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )
    return dict(zip(named, values))
