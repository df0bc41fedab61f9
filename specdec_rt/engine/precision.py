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

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..checks import brief_repr
from ..errors import InvalidInputError

if TYPE_CHECKING:
    from .tune_cache import TuneRow

__all__ = ["PINNED_PRECISIONS", "PRECISIONS", "CHOSEN_BY", "PrecisionChoice", "check_precision"]

PINNED_PRECISIONS = ("float32", "int8", "int4")  # weights a folder's targets may have, to pin one
PRECISIONS = ("auto", "exported", *PINNED_PRECISIONS)
#: how a choice came about: measured now, read from the tune cache, asked for, the folder's own
CHOSEN_BY = ("tuned", "cached", "pinned", "exported")


def check_precision(precision: object) -> str:
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
    the tuned one (``precision="auto"`` with ``draft=``): ``chosen_by`` tells of the target only.
    ``measured``: what the tune measured of this very configuration (tuned or cached, with its
    tuned draft), per prompt category too; None otherwise."""

    precision: str
    draft: str
    chosen_by: str
    exact_to: str
    draft_asked: bool = False
    measured: TuneRow | None = None

    def as_dict(self) -> dict[str, Any]:
        """The fields, for JSON (``/v1/models`` entries carry them); ``measured`` only when
        tuned: ``{"tok_s_1", "tok_s_c", "concurrency", "acceptance", "categories": {name:
        {"tok_s_1", "acceptance"}}}`` (tok/s with one stream, at ``concurrency`` at once, the
        drafts' acceptance; one stream per prompt category)."""
        out: dict[str, Any] = {
            "precision": self.precision,
            "draft": self.draft,
            "chosen_by": self.chosen_by,
            "exact_to": self.exact_to,
        }
        m = self.measured
        if m is not None:
            out["measured"] = {
                "tok_s_1": round(m.tok_s_1, 2),
                "tok_s_c": round(m.tok_s_c, 2),
                "concurrency": m.concurrency,
                "acceptance": round(m.acceptance, 3),
                "categories": {
                    c.category: {"tok_s_1": round(c.tok_s_1, 2), "acceptance": round(c.acceptance, 3)}
                    for c in m.categories
                },
            }
        return out

    def with_measured(self, row: TuneRow) -> PrecisionChoice:
        """This choice with what the tune measured of it."""
        return replace(self, measured=row)

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
