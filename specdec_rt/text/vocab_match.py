"""Whether a draft model's token ids mean what the target's mean.

A draft never tokenizes text: it reads the target's token ids and proposes ids the target then
verifies, so speculation stays exact whatever it proposes. What decides whether a draft can
serve a target is therefore the meaning of ids, not the tokenizer file's bytes:

* the two tokenizers are of the same model type with the same merges;
* every id the draft has, the target has too;
* an id whose text differs between the two is an added (special) token in one of them: chat
  markers such as ``<|im_start|>`` against ``<｜User｜>`` at the same id; the ordinary tokens
  (the text pieces) are the same at every id.

The target may have more ids than the draft (a vocabulary padded to a multiple of 128, or added
tokens the draft lacks); the draft then never proposes them. Tokenizers that differ in any
ordinary token are different tokenizers and are refused.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["vocabulary_mismatch"]


def _ids(spec: dict[str, Any]) -> tuple[dict[int, str], set[int]]:
    """(id -> text over the model's vocabulary and the added tokens, the added tokens' ids)."""
    vocab = (spec.get("model") or {}).get("vocab") or {}
    table = {int(token_id): str(text) for text, token_id in vocab.items()} if isinstance(vocab, dict) else {}
    added = {int(t["id"]): str(t["content"]) for t in spec.get("added_tokens") or []}
    table.update(added)
    return table, set(added)


def vocabulary_mismatch(target_json: str, draft_json: str) -> str | None:
    """None when a draft with tokenizer ``draft_json`` may serve a target with tokenizer
    ``target_json`` (both ``tokenizer.json`` texts; the rule is the module's), else the first
    difference, in words."""
    target, draft = json.loads(target_json), json.loads(draft_json)
    target_model, draft_model = target.get("model") or {}, draft.get("model") or {}
    if target_model.get("type") != draft_model.get("type"):
        return f"tokenizer model {draft_model.get('type')!r}, the target's is {target_model.get('type')!r}"
    if target_model.get("merges") != draft_model.get("merges"):
        return "the merges differ"
    target_ids, target_added = _ids(target)
    draft_ids, draft_added = _ids(draft)
    missing = sorted(set(draft_ids) - set(target_ids))
    if missing:
        return f"the draft's token id {missing[0]} is not in the target's vocabulary"
    for token_id in sorted(draft_ids):
        special = token_id in target_added or token_id in draft_added
        if draft_ids[token_id] != target_ids[token_id] and not special:
            return f"token {token_id} is {draft_ids[token_id]!r} for the draft, {target_ids[token_id]!r} for the target"
    return None
