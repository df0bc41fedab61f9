"""Which of an export folder's targets an Engine runs, and how that was chosen.

An export folder may hold its target in several precisions: its own (float32, or a quantized
recipe's int8 / int4) and quantized copies of it among its drafts, which a load may promote to
target (:func:`~specdec_rt.engine.factory.target_candidates`). Each is exact in its own right:
greedy speculative output equals that model's own plain decoding, so choosing one changes what
the output is exact *to*, never whether it is. ``Engine.load(precision=...)``:

* ``"exported"`` (the library default): the folder's own target, as exported;
* ``"float32"`` / ``"int8"`` / ``"int4"``: that one, pinned (an error names what the folder offers);
* ``"auto"`` (``serve``'s default): the fastest on this machine, measured once and cached
  (:mod:`specdec_rt.engine.tune`; docs/decisions/0012-precision-auto.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checks import brief_repr
from ..errors import InvalidInputError

__all__ = ["PINNED_PRECISIONS", "PRECISIONS", "CHOSEN_BY", "PrecisionChoice", "check_precision"]

PINNED_PRECISIONS = ("float32", "int8", "int4")  # weights a folder's targets may have, to pin one
PRECISIONS = ("auto", "exported", *PINNED_PRECISIONS)
#: how a choice came about: measured now, read from the tune cache, asked for, the folder's own
CHOSEN_BY = ("tuned", "cached", "pinned", "exported")


def check_precision(precision) -> str:
    """``precision`` if it is one of :data:`PRECISIONS`; else an InvalidInputError naming it."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise InvalidInputError(f"precision must be one of {', '.join(PRECISIONS)}, got {brief_repr(precision)}")
    return precision


@dataclass(frozen=True)
class PrecisionChoice:
    """What an Engine runs: its target's ``precision`` (``"float32"``, ``"int8"``, ...), its
    ``draft`` (the draft spec it loaded: ``"ngram+q8"``, ``"ngram"``, ``"none"``), ``chosen_by``
    (one of :data:`CHOSEN_BY`) and ``exact_to``, in words ("greedy output is exact to the int8
    target (int8 weights, int8 activations)"). ``draft_asked``: the draft was the caller's, not
    the tuned one (``precision="auto"`` with ``draft=``): ``chosen_by`` tells of the target only."""

    precision: str
    draft: str
    chosen_by: str
    exact_to: str
    draft_asked: bool = False

    def as_dict(self) -> dict[str, str]:
        """The fields, for JSON (``/v1/models`` entries carry them)."""
        return {
            "precision": self.precision,
            "draft": self.draft,
            "chosen_by": self.chosen_by,
            "exact_to": self.exact_to,
        }

    def describe(self) -> str:
        """One line: ``int8 target, draft ngram+q4 (tuned on this machine); greedy output is ...``
        (``int8 target (tuned on this machine), draft q4 (asked for); ...`` when the draft was
        the caller's)."""
        how = {
            "tuned": "tuned on this machine",
            "cached": "tuned on this machine earlier",
            "pinned": "pinned",
            "exported": "as exported",
        }.get(self.chosen_by, self.chosen_by)
        if self.draft_asked and self.chosen_by in ("tuned", "cached"):
            return f"{self.precision} target ({how}), draft {self.draft} (asked for); {self.exact_to}"
        return f"{self.precision} target, draft {self.draft} ({how}); {self.exact_to}"
