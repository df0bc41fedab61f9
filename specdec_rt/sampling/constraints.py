"""Constrained decoding: which tokens may come next (OpenAI's ``response_format``: any JSON
object, or one a JSON schema describes).

A :class:`Constraint` answers for the position after a request's committed tokens plus a path of
uncommitted ones: a verify row's drafts before it, a tree node's path, the draft's own chain so
far. Every row a request scores, target and draft model alike, gets the disallowed tokens at
-inf before greedy's argmax, temperature, top-k and top-p (:func:`constrained`). (An EAGLE
head drafts over its reduced vocabulary unconstrained, where no allowed token may be left to
it; n-gram drafts are unconstrained too: the target's rows reject what the constraint rules out.) So the target that
speculation must reproduce is the constrained one, and it does, exactly: greedy speculative
output equals constrained plain decoding; sampled output keeps the constrained distribution
(rejection sampling sees constrained ``p`` and ``q``). A row whose path the constraint already
rules out is left as it is: no output passes through it, since the row before gave that path's
token probability 0 (a draft there is rejected, and the walk stops).

Log-probabilities stay the model's own (before the constraint, as before temperature).

A grammar's work may be costly, and is never done on the event loop: it compiles in a grammar
thread (``GRAMMAR_THREADS``, one a core), and a constraint that says so (``off_loop``) has its
masks computed there too, one hand-over for all the rows of a model call, started before the
call so that the two run side by side (:meth:`~specdec_rt.speculation.context.RequestContext.scoring`);
the event loop only awaits (llguidance drops the GIL while it computes). Its CPU time is bounded:
its compilation with its first mask (``COMPILE_BUDGET_S``), then each mask (``MASK_BUDGET_S``);
one that costs more is refused, or ends its request, with an :class:`InvalidInputError` naming
the limit.

:class:`GrammarConstraint` is backed by llguidance (the optional extra ``structured``; the
``serve`` extra has it), the grammar engine vLLM, SGLang and llama.cpp use.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Protocol, Sequence

import numpy as np

from ..checks import brief_repr
from ..errors import InvalidInputError

__all__ = [
    "Constraint",
    "GrammarConstraint",
    "GrammarFactory",
    "MinTokens",
    "constrained",
    "masks_of",
    "masked",
    "MASK_BUDGET_S",
    "COMPILE_BUDGET_S",
    "GRAMMAR_THREADS",
    "FORCED_CHARS",
    "check_response_format",
    "json_text",
    "MAX_SCHEMA_CHARS",
    "JSON_WHITESPACE",
]

MAX_SCHEMA_CHARS = 1 << 20  # a JSON schema's text; grammar size and parse work have llguidance's own limits
# whitespace between JSON tokens: what pretty-printing needs, bounded, so that a model cannot
# loop on newlines forever inside a structure (a random model does, at once; real ones too, at times)
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"
# characters of the text a grammar forces next that are tokenized for llguidance (_TokenTable)
FORCED_CHARS = 1024
# CPU seconds a grammar's compilation and first mask may cost, and each later mask (an ordinary
# JSON schema's cost a few milliseconds, and well under one: docs/security.md, "Grammar masks")
COMPILE_BUDGET_S = 0.25
MASK_BUDGET_S = 0.05
REFUSED_KEPT = 1024  # grammars refused as too costly that are refused again at no cost
#: the worker threads that compile grammars and compute off-loop masks: one a core this process may
#: use, so that grammars alone never take every core from the event loop (more work waits its turn)
GRAMMAR_THREADS = ThreadPoolExecutor(
    max_workers=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
    thread_name_prefix="specdec-grammar",
)


class Constraint(Protocol):
    """What may come next. Called for one request at a time: on the event loop, or, if
    ``off_loop``, :meth:`allowed` in a worker thread while the loop awaits it.

    ``spent``: it rules nothing more (after a :meth:`commit`); the request then keeps ``inner``
    (another constraint, or None) instead. ``off_loop``: its masks may be costly (a grammar's)."""

    spent: bool = False
    inner: "Constraint | None" = None
    off_loop: bool = False

    def allowed(self, before: Sequence[int]) -> np.ndarray | None:
        """``[V]`` bool: the tokens allowed after the committed ones and then ``before``; None
        if ``before`` itself is ruled out (no output can pass through that row)."""
        return None

    def commit(self, ids: np.ndarray) -> None:
        """The request committed ``ids`` ``[n]`` int64 (each one allowed where it stands). A constraint that
        rules nothing more from then on may say so with ``spent`` (True), and the request then
        keeps its ``inner`` constraint (or None) instead (:class:`MinTokens` does)."""


def constrained(scores: np.ndarray, constraint: Constraint, before: Sequence[Iterable[int]]) -> np.ndarray:
    """Rows ``[n, V]`` (a copy) with the tokens ``constraint`` disallows at -inf; ``before[i]``:
    the uncommitted tokens between the committed ones and row ``i``'s position."""
    return masked(scores, masks_of(constraint, before))


def masks_of(constraint: Constraint, before: Sequence[Iterable[int]]) -> list[np.ndarray | None]:
    """``constraint``'s mask ``[V']`` (or None: a path it rules out) after each of ``before``."""
    return [constraint.allowed([int(t) for t in path]) for path in before]


def masked(scores: np.ndarray, masks: Sequence[np.ndarray | None]) -> np.ndarray:
    """Rows ``[n, V]`` (a copy) with what ``masks[i]`` disallows at -inf in row ``i``."""
    out = np.array(scores, dtype=np.float32, copy=True)  # [n, V]
    for i, mask in enumerate(masks):
        if mask is None:
            continue  # an unreachable row: left as it is
        width = min(mask.size, out.shape[1])
        out[i, :width][~mask[:width]] = -np.inf
        out[i, width:] = -np.inf  # ids past the constraint's vocabulary: never allowed
    return out


class GrammarConstraint(Constraint):
    """A llguidance ``LLMatcher`` that follows a request: committed tokens are consumed (before
    the next mask, in its thread); a row's path is consumed, the mask read, and the path rolled
    back. A path's mask is kept until the next commit (a draft model's rows and the target's
    rows after the same drafts ask for the same ones). Each mask may cost ``budget`` seconds of
    CPU (:data:`MASK_BUDGET_S`)."""

    off_loop = True

    def __init__(
        self,
        matcher: Any,
        vocab_size: int,
        eos_ids: Sequence[int] = (),
        *,
        usable: np.ndarray | None = None,
        what: str = "response_format",
        budget: float = MASK_BUDGET_S,
    ) -> None:
        self.matcher, self.vocab_size, self.eos_ids = matcher, vocab_size, frozenset(int(t) for t in eos_ids)
        self.usable = usable  # [V] bool: ids that stand for text (or end it); None: all
        self.what = what  # the request field the grammar came from, for errors
        self.budget = budget
        self._masks: dict[tuple[int, ...], np.ndarray | None] = {}  # path -> its mask, until a commit
        self._pending: list[int] = []  # committed ids not consumed yet

    def allowed(self, before: Sequence[int]) -> np.ndarray | None:
        if self._pending:
            self._consume_pending()
        key = tuple(int(t) for t in before)
        if key not in self._masks:
            self._masks[key] = self._allowed(key)
        return self._masks[key]

    def _allowed(self, before: tuple[int, ...]) -> np.ndarray | None:
        m = self.matcher
        went = m.try_consume_tokens(list(before)) if before else 0
        try:
            # end-of-sequence ids after the grammar's end are not consumed, as in commit (a request
            # that goes on past its end, ignore_eos): that row's mask is a stopped matcher's
            if went < len(before) and not (m.is_stopped() and all(t in self.eos_ids for t in before[went:])):
                return None
            cpu = time.thread_time()  # (llguidance computes a mask in the calling thread)
            bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)  # one bit a token id, little-endian
            cpu = time.thread_time() - cpu
            if m.is_error():  # the grammar engine gave up (a limit, a grammar with no way on): so does the
                # request, whichever row asked (a matcher in error stays so); the input's fault: a 400
                raise InvalidInputError(f"{self.what}: {_stopped(m)}")
            if cpu > self.budget:  # the next one may cost as much: the request ends here, a 400
                raise InvalidInputError(
                    f"{self.what}: the grammar is too costly to follow: one token's mask took "
                    f"{cpu * 1000:.0f} ms of CPU, over the limit of {self.budget * 1000:.0f} ms a token"
                )
            mask = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)  # [V]
            out = mask if self.usable is None else mask & self.usable
            out.flags.writeable = False  # kept, and handed to every row that asks
            return out
        finally:
            if went and not m.is_error():
                m.rollback(went)

    def commit(self, ids: np.ndarray) -> None:
        # consumed by the next allowed(), in the grammar thread: one token can cost milliseconds
        # (a lexer that gives up builds its expressions first)
        self._masks.clear()
        self._pending.extend(int(t) for t in ids)

    def _consume_pending(self) -> None:
        m, pending, self._pending = self.matcher, self._pending, []
        for t in pending:
            if t in self.eos_ids and m.is_stopped():
                continue  # the end, once the grammar is complete (a matcher stops by itself there)
            if not m.consume_token(t):  # every committed token was allowed: the engine gave up here
                raise InvalidInputError(f"{self.what}: at token {t}, {_stopped(m)}")


class MinTokens(Constraint):
    """``min_tokens`` (vLLM's, and other OpenAI-compatible servers'): none of ``stop_ids`` at the
    first ``count`` positions of the answer, on top of ``inner`` (another constraint, or None).
    Where ``inner`` allows nothing else (a grammar that is complete), they stay allowed: an answer
    is never forced past its own end. Once ``count`` tokens are committed it rules nothing
    (``spent``), and the request keeps ``inner`` alone."""

    def __init__(self, count: int, stop_ids: Iterable[int], vocab_size: int, inner: Constraint | None = None) -> None:
        self.count, self.vocab_size, self.inner = int(count), int(vocab_size), inner
        self.stop = np.array(sorted({int(t) for t in stop_ids if 0 <= int(t) < vocab_size}), dtype=np.int64)
        self.committed = 0
        self.spent = self._spent()

    def _spent(self) -> bool:
        return self.committed >= self.count or not self.stop.size

    @property
    def off_loop(self) -> bool:  # type: ignore[override]  # (the inner constraint's masks are its own)
        return self.inner is not None and self.inner.off_loop

    def allowed(self, before: Sequence[int]) -> np.ndarray | None:
        mask = None if self.inner is None else self.inner.allowed(before)  # [V] or None
        if self.inner is not None and mask is None:
            return None  # a path the inner constraint rules out
        out = np.ones(self.vocab_size, dtype=bool) if mask is None else mask.copy()  # [V]
        if self.committed + len(before) < self.count:
            out[self.stop] = False
            if not out.any():  # nothing but the end is left
                out[self.stop] = True if mask is None else mask[self.stop]
        return out

    def commit(self, ids: np.ndarray) -> None:
        self.committed += len(ids)
        self.spent = self._spent()
        if self.inner is not None:
            self.inner.commit(ids)


def json_text(value: Any, what: str) -> str:
    """``value`` as strict JSON text (no NaN or Infinity), or an :class:`InvalidInputError`
    naming ``what`` (a set, a cycle, 1,000 levels deep: what a Python caller can pass)."""
    try:
        return json.dumps(value, allow_nan=False)
    except (ValueError, TypeError, RecursionError) as exc:
        raise InvalidInputError(f"{what} is not JSON: {type(exc).__name__}: {exc}"[:300]) from None


def _stopped(matcher: Any) -> str:  # an llguidance LLMatcher
    """The grammar engine's error, its first line (what follows is its internal state)."""
    first: str = (matcher.get_error() or "stopped").strip().splitlines()[0]
    return f"the grammar stopped: {first[:300]}"


def check_response_format(response_format: Any) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` checked: None or ``{"type": "text"}`` (no constraint),
    ``{"type": "json_object"}``, or ``{"type": "json_schema", "json_schema": {"schema": {...},
    "name": ..., "strict": ...}}``. Returns the JSON schema to follow, or None."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or response_format.get("type") not in (
        "text",
        "json_object",
        "json_schema",
    ):
        raise InvalidInputError(
            "response_format must be {'type': 'text' | 'json_object' | 'json_schema', ...}, "
            f"got {brief_repr(response_format, 120)}"
        )
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise InvalidInputError(
            f"response_format json_schema must be an object with a 'schema' object, got {brief_repr(spec, 120)}"
        )
    schema: dict[str, Any] = spec.get("schema", {})
    if len(json_text(schema, "response_format's schema")) > MAX_SCHEMA_CHARS:
        raise InvalidInputError(f"response_format's schema is longer than {MAX_SCHEMA_CHARS} characters")
    return schema


class GrammarFactory:
    """Makes a :class:`GrammarConstraint` per request for one model's tokenizer. The llguidance
    tokenizer (every token's bytes) is built once, at the first request that needs it (~0.1 s
    for a 49k vocabulary). ``token_bytes(id)``, ``is_special(id)`` and ``encode(text)`` (the
    plain tokenization of a piece of text: no BOS or other added tokens) come from the engine's
    codec; ``eos_ids``: the tokens that end a generation (allowed once the grammar is complete)."""

    def __init__(
        self,
        token_bytes: Callable[[int], bytes],
        is_special: Callable[[int], bool],
        encode: Callable[[str], list[int]],
        *,
        vocab_size: int,
        eos_ids: Sequence[int],
    ) -> None:
        self._bytes, self._special, self._encode = token_bytes, is_special, encode
        self.vocab_size, self.eos_ids = vocab_size, [int(t) for t in eos_ids]
        self._tokenizer: Any = None  # an llguidance LLTokenizer, once built
        self._usable: np.ndarray | None = None
        #: sha256 of a grammar refused as too costly -> why (the newest REFUSED_KEPT), shared by
        #: the grammar threads
        self._refused: dict[bytes, str] = {}
        self._lock = threading.Lock()
        self._building = threading.Lock()  # held while the tokenizer is built

    def _llg(self) -> Any:  # the llguidance module
        try:
            import llguidance
        except ImportError:
            raise InvalidInputError(
                "response_format needs llguidance: pip install 'specdec-rt[structured]' (the serve extra has it)"
            ) from None
        return llguidance

    def prepare(self) -> bool:
        """Build the grammar engine's token table now (in a worker thread, at load), if
        llguidance is installed and the model has an end token: its build holds the GIL for
        ~0.1-0.4 s on a 49k vocabulary, a stall the first ``response_format`` request would
        otherwise cause while the server serves others. Whether it is built."""
        try:
            self.tokenizer()
        except InvalidInputError:  # no llguidance, or no end token: requests say so themselves
            return False
        return True

    def tokenizer(self) -> Any:
        """The llguidance tokenizer of this model's vocabulary, built at the first call."""
        if self._tokenizer is None:
            with self._building:  # once, however many grammar threads need it first at once
                if self._tokenizer is None:
                    self._build_tokenizer()
        return self._tokenizer

    def _build_tokenizer(self) -> None:
        llg = self._llg()
        if not self.eos_ids:
            raise InvalidInputError("response_format: this model names no end-of-sequence token to end the output")
        table = _TokenTable(self._bytes, self._special, self._encode, vocab_size=self.vocab_size, eos=self.eos_ids[0])
        tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(table), n_vocab=self.vocab_size, eos_token=self.eos_ids)
        # ids with no bytes (past the tokenizer's vocabulary) would fit any grammar anywhere,
        # adding nothing: a model could emit them forever; they are never allowed
        usable = np.array([bool(b) for b in table.tokens], dtype=bool)  # [V]
        usable[[t for t in self.eos_ids if t < self.vocab_size]] = True
        self._usable, self._tokenizer = usable, tokenizer  # (the tokenizer last: it says both are there)

    def build(
        self, schema: dict[str, Any] | None = None, lark: str | None = None, what: str = "response_format"
    ) -> GrammarConstraint:
        """A fresh constraint for a request that must follow a JSON ``schema`` or a ``lark``
        grammar (llguidance's dialect; in a worker thread: a big one takes a while to compile).
        One llguidance cannot compile is an :class:`InvalidInputError` naming ``what``."""
        llg = self._llg()
        try:
            grammar = (
                lark
                if schema is None
                else llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_pattern": JSON_WHITESPACE})
            )
        except (ValueError, TypeError, RecursionError) as exc:
            raise InvalidInputError(f"{what}: the grammar engine cannot read this schema: {exc}"[:300]) from None
        key = hashlib.sha256(str(grammar).encode()).digest()
        with self._lock:
            refused = self._refused.get(key)
        if refused is not None:  # (n choices, or a client that asks again: refused at no cost)
            raise InvalidInputError(f"{what}: {refused}")
        tokenizer = self.tokenizer()  # (sets _usable the first time)
        cpu = time.thread_time()
        matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if not matcher.is_error():
            matcher.compute_bitmask()  # the first step: a grammar with no way on, or past a limit, shows here
        cpu = time.thread_time() - cpu
        if matcher.is_error():
            raise InvalidInputError(f"{what}: {_stopped(matcher)}")
        if cpu > COMPILE_BUDGET_S:  # (llguidance's own limits let its first step cost seconds)
            why = (
                f"the grammar is too costly to follow: compiling it took {cpu * 1000:.0f} ms of CPU, "
                f"over the limit of {COMPILE_BUDGET_S * 1000:.0f} ms"
            )
            with self._lock:
                self._refused[key] = why
                while len(self._refused) > REFUSED_KEPT:
                    del self._refused[next(iter(self._refused))]  # the oldest
            raise InvalidInputError(f"{what}: {why}")
        return GrammarConstraint(matcher, self.vocab_size, self.eos_ids, usable=self._usable, what=what)


class _TokenTable:
    """What ``llguidance.TokenizerWrapper`` reads: every token id's bytes, the special ones, and
    a way to encode text (from the engine's codec, so the two never disagree).

    llguidance encodes, at every mask, the text the grammar forces next (all of it: a quarter
    of a million characters for ``^(a{500}){500}$``), in this thread, holding the GIL, and reads
    only the first tokens: the first ``FORCED_CHARS`` characters are encoded."""

    def __init__(
        self,
        token_bytes: Callable[[int], bytes],
        is_special: Callable[[int], bool],
        encode: Callable[[str], list[int]],
        *,
        vocab_size: int,
        eos: int,
    ) -> None:
        self.eos_token_id, self.bos_token_id = eos, None
        self.tokens = [token_bytes(i) for i in range(vocab_size)]
        self.special_token_ids = [i for i in range(vocab_size) if is_special(i)]
        self._encode = encode

    def __call__(self, text: str | bytes | Sequence[int]) -> list[int]:
        if not isinstance(text, str):  # (a character takes at most 4 bytes: a cut one falls past the end)
            text = bytes(text[: 4 * FORCED_CHARS]).decode("utf-8", "replace")
        return self._encode(text[:FORCED_CHARS])
