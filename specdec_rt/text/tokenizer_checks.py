"""How much a tokenizer (untrusted: it comes from the model folder) can expand text, checked
when it is loaded (docs/security.md, "Model folders").

A ``tokenizer.json`` is a pipeline the folder writes: a normalizer whose ``Replace`` writes a
thousand characters for each ``a`` it reads turns a 100k-character prompt into 25M tokens and
gigabytes before anything can refuse it. :func:`expansion` bounds, from the components' own
settings, how many tokens one character of text can become, and names the component that sets
that bound; :func:`check_tokenizer` refuses a tokenizer whose bound is over
:data:`MAX_TOKENS_PER_CHAR_BOUND` (before any text is encoded with it), then encodes
:data:`PROBE_TEXT` and refuses one that writes more than :data:`MAX_PROBE_TOKENS_PER_CHAR` tokens a
character of it. The codec then refuses, before encoding, a text whose characters times the
bound exceed :data:`MAX_ENCODE_TOKENS`, and with a Unicode normalizer (which writes up to 18
characters for one, counted 1 in the bound) a text whose normalized characters times the rest of
the bound do.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import struct
from dataclasses import dataclass
from typing import Any

from ..errors import ModelLoadError

__all__ = [
    "PASS_THROUGH",
    "Expansion",
    "expansion",
    "check_tokenizer",
    "PROBE_TEXT",
    "MAX_TOKENS_PER_CHAR_BOUND",
    "MAX_PROBE_TOKENS_PER_CHAR",
    "MAX_ADDED_CHARS",
    "MAX_ENCODE_TOKENS",
]

# a character is at most 4 UTF-8 bytes, so at most 4 tokens for a byte-level or byte-fallback
# tokenizer: real tokenizers' bound is 4 (8 with a Metaspace that marks every word)
MAX_TOKENS_PER_CHAR_BOUND = 64
MAX_PROBE_TOKENS_PER_CHAR = 8  # tokens a character of PROBE_TEXT may become (real ones: 0.2 to 3)
MAX_ADDED_CHARS = 1024  # characters a normalizer may add to every text (Prepend)
MAX_ENCODE_TOKENS = 4_000_000  # characters x bound of one text: refused before encoding past this
# prose, code, digits, punctuation, accents, CJK, emoji and a ligature that NFKC writes as 18
# characters: what prompts hold
PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG!\n"
    "def add(a, b):\n    return a + b  # 0123456789 {}[]()<>=+-*/%&|^~`'\"\\;:,.?!@#$_\t\n"
    "Café, naïve, résumé, Ærøskøbing, Straße, İstanbul, ﬁne. Привет мир. Γειά σου κόσμε. "
    "مرحبا بالعالم. नमस्ते दुनिया. 你好，世界。こんにちは世界。안녕하세요 세계. "
    "🙂🚀👩‍💻 ﷺ ﷽ ① ㎏ ｆｕｌｌｗｉｄｔｈ   spaces   and\r\nnewlines\n\n"
) * 4

_BYTES_PER_CHAR = 4  # UTF-8
_UNICODE_EXPANSION = 18  # the most characters NFKC writes for one (U+FDFA)
# what a native library's call lets through as it is; any other BaseException it raises (the
# tokenizers library's PanicException, a Rust panic) is a failure of that library, mapped to ours
PASS_THROUGH = (KeyboardInterrupt, SystemExit, GeneratorExit, asyncio.CancelledError)


@dataclass(frozen=True)
class Expansion:
    """At most ``per_char`` tokens for each character of a text, plus ``added`` characters'
    worth for the text as a whole; ``by``: the component that sets the bound (``"model"`` when
    no other step expands text)."""

    per_char: float
    added: int
    by: str
    #: the normalizer holds a Unicode normalization or a SentencePiece character map, counted 1
    #: in ``per_char`` though it writes up to 18 characters for one (U+FDFA): a text's bound is
    #: then its normalized characters times ``per_normalized_char``
    normalizes: bool = False
    #: tokens a character the normalizer wrote can become (the pre-tokenizer's and model's bound)
    per_normalized_char: float = 0.0

    def tokens(self, chars: int) -> float:
        """At most how many tokens a text of ``chars`` characters can become."""
        return (chars + self.added) * self.per_char


def _state(component: Any) -> Any:
    """A tokenizers component's settings, as its JSON (None for an absent one)."""
    if component is None:
        return None
    return json.loads(component.__getstate__())


def _describe(node: dict[str, Any]) -> str:
    kind = node.get("type")
    if kind == "Replace":
        pattern = node.get("pattern") or {}
        pat = pattern.get("String", pattern.get("Regex", ""))
        content = str(node.get("content", ""))
        return f"Replace({str(pat)[:40]!r} -> {len(content)} characters)"
    return str(kind)


def _normalizer(node: Any) -> tuple[float, int, str | None]:
    """(characters out per character in, characters added, the largest step) of a normalizer.
    Unicode normalization and case mapping count 1: they expand a few code points at most 18-fold
    (a property of Unicode, the same for every model, not something the folder chose); so does
    a SentencePiece character map whose strings are no longer than that."""
    if not isinstance(node, dict):
        return 1.0, 0, None
    kind = node.get("type")
    if kind == "Sequence":
        factor, added, worst, worst_f = 1.0, 0, None, 1.0
        for sub in node.get("normalizers") or []:
            f, a, w = _normalizer(sub)
            factor, added = factor * f, int(added * f) + a
            if f > worst_f or (w is not None and worst is None):
                worst, worst_f = w, max(worst_f, f)
        return factor, added, worst
    if kind == "Replace":
        pattern = node.get("pattern") or {}
        content = len(str(node.get("content", "")))
        if "String" in pattern and len(str(pattern["String"])) > 0:
            factor, added = max(1.0, content / len(str(pattern["String"]))), 0
        else:  # a regex may match one character, or none (then before every character and at the end)
            factor, added = max(1.0, content + 1.0), content
        return factor, added, f"normalizer {_describe(node)}" if factor > 1 else None
    if kind == "Precompiled":  # a SentencePiece character map: Unicode's own, unless it writes more
        longest = _longest_replacement(str(node.get("precompiled_charsmap") or ""))
        factor = 1.0 if longest <= _UNICODE_EXPANSION else float(longest)
        return factor, 0, f"normalizer Precompiled (a replacement of {longest} characters)" if factor > 1 else None
    if kind == "ByteLevel":  # a character per UTF-8 byte
        return float(_BYTES_PER_CHAR), 0, "normalizer ByteLevel"
    if kind == "Prepend":
        added = len(str(node.get("prepend", "")))
        return 1.0, added, f"normalizer Prepend({added} characters)" if added > 1 else None
    return 1.0, 0, None


def _longest_replacement(charsmap: str) -> int:
    """The longest string (in characters) a SentencePiece precompiled character map writes for
    what it matches: its layout is a 4-byte trie size, the trie, then NUL-ended strings."""
    try:
        data = base64.b64decode(charsmap)
        (size,) = struct.unpack_from("<I", data)
    except (binascii.Error, ValueError, struct.error):
        return 0  # the tokenizers library refused it already, or it holds nothing
    return max((len(s.decode("utf-8", "replace")) for s in data[4 + size :].split(b"\0")), default=0)


_UNICODE_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Precompiled"})


def _normalizes(node: Any) -> bool:
    """Whether a normalizer holds a step that may write several characters for one, counted 1
    in its factor (:data:`_UNICODE_NORMALIZERS`)."""
    if not isinstance(node, dict):
        return False
    if node.get("type") == "Sequence":
        return any(_normalizes(sub) for sub in node.get("normalizers") or [])
    return node.get("type") in _UNICODE_NORMALIZERS


def _pre_tokenizer(node: Any) -> tuple[float, str | None]:
    """(characters out per character in, the largest step) of a pre-tokenizer: ByteLevel writes a
    character per UTF-8 byte, Metaspace may mark each word with one more."""
    if not isinstance(node, dict):
        return 1.0, None
    kind = node.get("type")
    if kind == "Sequence":
        factor, worst, worst_f = 1.0, None, 1.0
        for sub in node.get("pretokenizers") or []:
            f, w = _pre_tokenizer(sub)
            factor *= f
            if f > worst_f:
                worst, worst_f = w, f
        return factor, worst
    if kind == "ByteLevel":
        return float(_BYTES_PER_CHAR), "pre-tokenizer ByteLevel"
    if kind == "Metaspace":
        return 2.0, "pre-tokenizer Metaspace"
    return 1.0, None


def expansion(tokenizer: Any) -> Expansion:
    """The bound of ``tokenizer`` (a ``tokenizers.Tokenizer``), from its components' settings:
    normalizer x pre-tokenizer x model (a model with byte fallback writes a token a byte)."""
    from tokenizers import models

    n_state = _state(tokenizer.normalizer)
    n_factor, added, n_by = _normalizer(n_state)
    p_factor, p_by = _pre_tokenizer(_state(tokenizer.pre_tokenizer))
    model = tokenizer.model
    bytewise = isinstance(model, models.Unigram) or (isinstance(model, models.BPE) and model.byte_fallback)
    m_factor = float(_BYTES_PER_CHAR) if bytewise else 1.0
    per_char = n_factor * p_factor * m_factor
    # the component named: the normalizer's amplifying step first (what a folder may abuse)
    by = n_by if n_factor > 1 or added > 1 else p_by if p_factor > 1 else None
    return Expansion(per_char, added, by or "model", _normalizes(n_state), p_factor * m_factor)


def check_tokenizer(tokenizer: Any, source: str) -> Expansion:
    """``tokenizer``'s :class:`Expansion`, or :class:`ModelLoadError` naming ``source`` (its
    file) and the component when it can expand text past the limits (see the module docstring).
    The probe is encoded only once the bound says it stays small."""
    bound = expansion(tokenizer)
    if bound.per_char > MAX_TOKENS_PER_CHAR_BOUND:
        raise ModelLoadError(
            f"{source}: its {bound.by} can turn one character into up to {bound.per_char:g} tokens, "
            f"more than the {MAX_TOKENS_PER_CHAR_BOUND} a tokenizer may (real ones: 4 or 8); refusing to load it"
        )
    if bound.added > MAX_ADDED_CHARS:
        raise ModelLoadError(
            f"{source}: its {bound.by} adds {bound.added} characters to every text, more than the "
            f"{MAX_ADDED_CHARS} a tokenizer may; refusing to load it"
        )
    try:
        n = len(tokenizer.encode_batch([PROBE_TEXT], add_special_tokens=False)[0].ids)
        normalized = len(tokenizer.normalizer.normalize_str(PROBE_TEXT)) if tokenizer.normalizer else len(PROBE_TEXT)
    except BaseException as exc:  # a panic in its Rust code is a BaseException (PanicException)
        if isinstance(exc, PASS_THROUGH):
            raise
        raise ModelLoadError(
            f"{source}: cannot encode a short sample text ({type(exc).__name__}: {exc})"[:500]
        ) from exc
    per_char = n / len(PROBE_TEXT)
    if per_char > MAX_PROBE_TOKENS_PER_CHAR:
        by = "normalizer" if normalized > 2 * len(PROBE_TEXT) else bound.by  # (the one that may grow text)
        raise ModelLoadError(
            f"{source}: its {by} turns a {len(PROBE_TEXT)}-character sample text into {n} tokens "
            f"({per_char:.1f} a character, more than {MAX_PROBE_TOKENS_PER_CHAR}); refusing to load it"
        )
    return bound
