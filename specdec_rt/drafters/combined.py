"""A drafter of drafters: n-gram proposals when they are likely to do as well as a model draft,
the model draft otherwise (per request, by measured acceptance)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..speculation.context import RequestContext
from ..speculation.protocols import DraftInferrer
from ..types import DraftToken
from .ngram import NgramDrafter

__all__ = ["CombinedDrafter"]


class CombinedDrafter(DraftInferrer):
    """N-gram proposals when they are likely to do at least as well as the model, the model
    draft otherwise.

    The n-gram side is used only for a match of at least ``min_match`` tokens that continues for
    at least ``min_tokens`` tokens (in chat a 1-2 token match is a poor guess: acceptance 0.42
    with 1-grams against 0.91 for an int8 draft), and only while its per-request acceptance is at
    least the model's (both tracked with an EWMA of weight ``alpha``, read off the committed tokens
    at the next call: no feedback hook needed). N-gram proposals are free, so ties go to them. The
    model's cache catches up by itself the next time it is used.
    """

    def __init__(
        self, ngram: NgramDrafter, model: DraftInferrer, *, min_match: int = 3, min_tokens: int = 2, alpha: float = 0.3
    ) -> None:
        self.ngram, self.model, self.min_match, self.min_tokens = ngram, model, min_match, min_tokens
        self.alpha = alpha
        self.max_length = model.max_length
        self.used = {"ngram": 0, "model": 0}  # rounds served by each (all requests)
        self.needs_target_hidden = model.needs_target_hidden
        self.cheap_drafts = True  # honours ctx.plan.cheap_drafts: n-gram proposals only

    def cached_prefix(self, tokens: np.ndarray) -> int:
        """What the model drafter's prefix cache holds of ``tokens`` (its prefill is the rest)."""
        return self.model.cached_prefix(tokens)

    async def generate_draft(self, ctx: RequestContext, k: int) -> Sequence[DraftToken]:
        st = ctx.state(self, _CombinedState)
        st.score(ctx.tokens, self.alpha)
        n_min = max(self.ngram.n_min, self.min_match)
        plan = ctx.plan
        if plan.tree_nodes:  # a tree: its chain is propose's, plus where earlier matches went on differently
            ngram = self.ngram.propose_tree(ctx.tokens, k, plan.tree_nodes, n_min=n_min)
        else:
            ngram = [DraftToken(int(t)) for t in self.ngram.propose(ctx.tokens, k, n_min=n_min)]
        chain = sum(d.parent is None for d in ngram)  # the proposal's chain comes first
        # sharing a batch (plan.cheap_drafts): the long n-gram match only, maybe none, never the model
        if plan.cheap_drafts or (chain >= min(self.min_tokens, k) and st.acceptance["ngram"] >= st.acceptance["model"]):
            source, drafts = "ngram", ngram
        else:
            source, drafts = "model", list(await self.model.generate_draft(ctx, k))
        self.used[source] += 1
        st.last = (source, ctx.tokens.size, [d.id for d in drafts if d.parent is None])  # the chain
        return drafts

    def release(self, ctx: RequestContext) -> None:
        ctx.pop_state(self)
        self.model.release(ctx)


class _CombinedState:
    """Per-request acceptance of each source, scored when the next round starts."""

    def __init__(self) -> None:
        self.acceptance = {"ngram": 0.8, "model": 0.8}  # optimistic start: both get tried
        self.last: tuple[str, int, list[int]] | None = None

    def score(self, tokens: np.ndarray, alpha: float) -> None:
        if self.last is None:
            return
        source, at, ids = self.last
        self.last = None
        if not ids:
            return
        committed = tokens[at : at + len(ids)]
        accepted = int(np.argmin(np.append(committed == ids[: committed.size], False)))
        tried = min(len(ids), accepted + 1)  # per-token acceptance, as the scheduler's EWMA
        rate = accepted / tried
        self.acceptance[source] += alpha * (rate - self.acceptance[source])
