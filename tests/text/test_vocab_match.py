"""Which draft tokenizers may serve a target: the same ordinary tokens and merges at every id the
draft has; special tokens' texts may differ (R1-Distill-Qwen's chat markers against Qwen2.5's)."""

from __future__ import annotations

import json

from specdec_rt.text.vocab_match import vocabulary_mismatch

ORDINARY = ["a", "b", "c", "ab", "abc"]
MERGES = ["a b", "ab c"]


def _tokenizer(specials: list[str], ordinary: list[str] = ORDINARY, merges: list[str] = MERGES) -> str:
    """A tokenizer.json text: ordinary BPE tokens, then the added (special) tokens."""
    vocab = {text: i for i, text in enumerate(ordinary)}
    added = [{"id": len(ordinary) + i, "content": text, "special": True} for i, text in enumerate(specials)]
    return json.dumps({"model": {"type": "BPE", "vocab": vocab, "merges": merges}, "added_tokens": added})


QWEN = _tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
R1 = _tokenizer(["<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜begin▁of▁sentence｜>"])


def test_the_same_tokenizer_matches():
    assert vocabulary_mismatch(QWEN, QWEN) is None


def test_special_tokens_may_differ_and_the_target_may_have_more_ids():
    assert vocabulary_mismatch(R1, QWEN) is None  # target R1 (4 specials), draft Qwen (3)


def test_a_draft_with_ids_the_target_lacks_is_refused():
    assert vocabulary_mismatch(QWEN, R1) == "the draft's token id 8 is not in the target's vocabulary"


def test_a_different_ordinary_token_is_refused():
    other = _tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], ordinary=["a", "b", "c", "ab", "bc"])
    assert vocabulary_mismatch(QWEN, other) == "token 4 is 'bc' for the draft, 'abc' for the target"


def test_an_ordinary_token_against_a_special_one_is_allowed():
    # GGUF-converted vocabularies list every id in the model's vocabulary; the added list marks
    # the special ones (R1's <think> is user-defined where Qwen2.5 has <|box_start|>)
    target = _tokenizer(["<think>"], ordinary=ORDINARY)
    assert vocabulary_mismatch(target, _tokenizer(["<|box_start|>"])) is None


def test_different_merges_or_models_are_refused():
    assert vocabulary_mismatch(QWEN, _tokenizer(["<|endoftext|>"], merges=["a b"])) == "the merges differ"
    wordlevel = json.dumps({"model": {"type": "WordLevel", "vocab": {"a": 0}}, "added_tokens": []})
    assert vocabulary_mismatch(QWEN, wordlevel) == "tokenizer model 'WordLevel', the target's is 'BPE'"
