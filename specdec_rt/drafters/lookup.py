"""Drafters beyond a plain draft model: n-gram / prompt lookup, and a combination of drafters.

Every drafter here implements :class:`~specdec_rt.spec.protocols.DraftInferrer`; a model draft is
:class:`~specdec_rt.spec.adapters.ModelDrafter` (``OrtDraftInferrer`` for exported models).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..spec.context import RequestContext
from ..errors import InvalidInputError
from ..spec.protocols import DraftInferrer
from ..types import DraftToken

__all__ = ["NgramDrafter", "CombinedDrafter"]

TREE_MATCHES = 32  # earlier matches per n-gram length walked for a tree's branches


class NgramDrafter(DraftInferrer):
    """Prompt lookup decoding: find the latest earlier occurrence of the last ``n`` tokens
    (``n`` from ``n_max`` down to ``n_min``) in the prompt and the text generated so far, and
    propose the tokens that followed it. No model call; proposals are deterministic (``q`` is
    one-hot), which keeps rejection sampling exact at any temperature.

    ``window``: only the last ``window`` tokens are searched (bounded cost on long contexts).
    """

    cheap_drafts = True  # every proposal costs nothing: verified inside a batch's call

    def __init__(self, n_max: int = 3, n_min: int = 1, k_max: int = 8, window: int = 4096) -> None:
        if not 1 <= n_min <= n_max:
            raise InvalidInputError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        if k_max < 1 or window < 2:
            raise InvalidInputError(f"k_max={k_max} and window={window} must be >= 1 and >= 2")
        self.n_max, self.n_min, self.k_max, self.window = n_max, n_min, k_max, window

    def propose(self, tokens: np.ndarray, k: int, n_min: int | None = None) -> np.ndarray:
        """Up to ``k`` continuation tokens for ``tokens`` ``[L]`` (empty if no n-gram of at least
        ``n_min`` tokens, default ``self.n_min``, matches)."""
        k = min(k, self.k_max)
        hay = tokens[-self.window:]  # [W]
        for starts in self._matches(hay, n_min):
            if starts.size:
                start = int(starts[-1])  # the latest match
                return hay[start : start + k].copy()
        return hay[:0].copy()

    def _matches(self, hay: np.ndarray, n_min: int | None):
        """For n from ``n_max`` down to ``n_min`` (default ``self.n_min``): where the tokens
        following each earlier occurrence of the last n tokens of ``hay`` ``[W]`` start, oldest
        first (the suffix itself is not an occurrence)."""
        for n in range(min(self.n_max, hay.size - 1), (n_min or self.n_min) - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(hay[:-1], n)  # [W-n, n]
            yield np.flatnonzero((windows == hay[-n:]).all(axis=1)) + n

    def propose_tree(self, tokens: np.ndarray, k: int, nodes: int, n_min: int | None = None) -> list[DraftToken]:
        """:meth:`propose`'s chain plus up to ``nodes`` other nodes: where earlier matches went
        on differently. Matches are taken longest n-gram first, latest first (at most
        ``TREE_MATCHES`` per n) and laid over each other as a trie, as deep as the chain; the
        nodes off the chain are kept shallowest first (they are reached more often), then by
        how many matches lead through them. Every node is a fixed choice (one-hot ``q``),
        which keeps tree rejection sampling exact. The chain comes first, then the other
        nodes, parents before children (see :class:`~specdec_rt.types.DraftToken`)."""
        if k < 0 or nodes < 0:
            raise InvalidInputError(f"propose_tree needs k >= 0 and nodes >= 0, got k={k}, nodes={nodes}")
        hay = tokens[-self.window:]  # [W]
        token, parent, depth, support = [], [], [], []  # the trie's nodes
        children: dict[tuple[int, int], int] = {}  # (node (-1: the root), token) -> child node
        deepest = min(k, self.k_max)
        for starts in self._matches(hay, n_min):
            for start in starts[::-1][:TREE_MATCHES].tolist():
                node = -1  # latest match first: the first one is the chain (as propose)
                for t in hay[start : start + deepest].tolist():
                    nxt = children.get((node, t))
                    if nxt is None:
                        nxt = children[(node, t)] = len(token)
                        token.append(t), parent.append(node), depth.append(depth[node] + 1 if node >= 0 else 1)
                        support.append(0)
                    support[nxt] += 1
                    node = nxt
                if not nodes:
                    return [DraftToken(t) for t in token]
                deepest = max(depth, default=0)  # branches go no deeper than the chain
        chain = max(depth, default=0)  # nodes 0 .. chain - 1, each the previous one's child
        at = {i: i for i in range(chain)}  # trie node -> draft index
        out = [DraftToken(t) for t in token[:chain]]
        for i in sorted(range(chain, len(token)), key=lambda i: (depth[i], -support[i], i)):
            if len(out) == chain + nodes:
                break
            if parent[i] < 0 or parent[i] in at:  # parents before children (a skipped parent: skip)
                at[i] = len(out)
                out.append(DraftToken(token[i], parent=at.get(parent[i], -1)))
        return out

    async def generate_draft(self, ctx: RequestContext, k: int) -> Sequence[DraftToken]:
        if ctx.tree_nodes:
            return self.propose_tree(ctx.tokens, k, ctx.tree_nodes)
        return [DraftToken(int(t)) for t in self.propose(ctx.tokens, k)]

    def release(self, ctx: RequestContext) -> None:
        pass  # no per-request state


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

    def __init__(self, ngram: NgramDrafter, model: DraftInferrer, min_match: int = 3,
                 min_tokens: int = 2, alpha: float = 0.3) -> None:
        self.ngram, self.model, self.min_match, self.min_tokens = ngram, model, min_match, min_tokens
        self.alpha = alpha
        self.max_length = getattr(model, "max_length", None)
        self.used = {"ngram": 0, "model": 0}  # rounds served by each (all requests)
        self.needs_target_hidden = bool(getattr(model, "needs_target_hidden", False))
        self.cheap_drafts = True  # honours ctx.cheap_drafts: n-gram proposals only

    def cached_prefix(self, tokens) -> int:
        """What the model drafter's prefix cache holds of ``tokens`` (its prefill is the rest)."""
        peek = getattr(self.model, "cached_prefix", None)
        return peek(tokens) if peek is not None else 0

    async def generate_draft(self, ctx: RequestContext, k: int) -> Sequence[DraftToken]:
        st = ctx.state(self, _CombinedState)
        st.score(ctx.tokens, self.alpha)
        n_min = max(self.ngram.n_min, self.min_match)
        if ctx.tree_nodes:  # a tree: its chain is propose's, plus where earlier matches went on differently
            ngram = self.ngram.propose_tree(ctx.tokens, k, ctx.tree_nodes, n_min=n_min)
        else:
            ngram = [DraftToken(int(t)) for t in self.ngram.propose(ctx.tokens, k, n_min=n_min)]
        chain = sum(d.parent is None for d in ngram)  # the proposal's chain comes first
        # sharing a batch (ctx.cheap_drafts): the long n-gram match only, maybe none, never the model
        if ctx.cheap_drafts or (chain >= min(self.min_tokens, k)
                                and st.acceptance["ngram"] >= st.acceptance["model"]):
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
