"""A tokenizer whose normalizer is Unicode's (NFKC) writes up to 18 characters for one (U+FDFA),
counted 1 in its bound: a prompt of such characters is refused before it is encoded (issue 43,
QA; was: a byte-level tokenizer's bound of 4 tokens a character, 33 written, so a 1 MiB body
could become ~11M tokens where the limit is 4M)."""

from __future__ import annotations

import json

import pytest

import specdec_rt.text.codec as codec_module
from specdec_rt.errors import InvalidInputError
from specdec_rt.text.codec import TextCodec


def test_unicode_normalization_counts_in_the_bound_of_a_text(tiny_qwen, tmp_path, monkeypatch):
    doc = json.loads((tiny_qwen / "tokenizer.json").read_text())
    doc["normalizer"] = {"type": "NFKC"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(doc))
    codec = TextCodec(tmp_path / "tokenizer.json")
    assert codec.expansion.per_char == 4  # byte-level, as before: NFKC counts 1 there
    limit = 40_000
    monkeypatch.setattr(codec_module, "MAX_ENCODE_TOKENS", limit)
    n = limit // 4 // 2  # half the limit by the characters' count
    with pytest.raises(InvalidInputError, match=rf"has {n} characters of text, {18 * n} once .* normalized them"):
        codec.encode("\ufdfa" * n)  # was: encoded, into ~33 tokens a character
    assert len(codec.encode("hello " * (n // 6))) > 0  # ordinary text of that length still encodes
    assert len(codec.encode("\ufdfa" * 10)) > 18 * 10  # and a few such characters
