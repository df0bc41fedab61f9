"""transformers' Qwen2 GGUF converter adds `<|endoftext|>`, `<|im_start|>` and `<|im_end|>` by
name; the exporter's adds only those the file lists, so a Qwen2 file with other chat markers
(DeepSeek-R1-Distill-Qwen's) keeps every id inside its embedding."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from export.gguf_families import QWEN2_CHAT_SPECIALS, _qwen2_tokenizer  # noqa: E402

ORDINARY = ["a", "b", "c", "ab", "abc"]


def _converted(specials: list[str]):
    tokens = ORDINARY + specials
    return _qwen2_tokenizer({"tokens": tokens, "merges": ["a b", "ab c"], "token_type": [1] * len(tokens)}).converted()


def test_a_qwen_file_keeps_its_three_specials_at_their_ids():
    tok = _converted(list(QWEN2_CHAT_SPECIALS))
    assert tok.get_vocab_size(with_added_tokens=True) == 8
    assert [tok.token_to_id(t) for t in QWEN2_CHAT_SPECIALS] == [5, 6, 7]
    assert tok.encode("ab<|im_start|>c").ids == [3, 6, 2]  # matched whole, as a special token


def test_a_file_without_them_gets_no_id_past_its_vocabulary():
    tok = _converted(["<｜end▁of▁sentence｜>", "<｜User｜>"])
    assert tok.get_vocab_size(with_added_tokens=True) == 7
    assert all(tok.token_to_id(t) is None for t in QWEN2_CHAT_SPECIALS)


def test_the_tokenizer_class_gets_no_endoftext_default_where_the_file_lacks_it():
    tokens = [*ORDINARY, "<｜end▁of▁sentence｜>"]
    converter = _qwen2_tokenizer({"tokens": tokens, "merges": ["a b", "ab c"], "token_type": [1] * 6})
    assert converter.additional_kwargs == {"unk_token": None, "eos_token": None, "pad_token": None}
    qwen = _qwen2_tokenizer({"tokens": ORDINARY + list(QWEN2_CHAT_SPECIALS), "merges": ["a b", "ab c"]})
    assert qwen.additional_kwargs == {}  # a Qwen file: transformers' defaults, as before
