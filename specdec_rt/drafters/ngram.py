"""N-gram (prompt lookup) drafting: propose what followed the latest earlier occurrence of the
context's last tokens. No model call, deterministic proposals (one-hot ``q``).

Implements :class:`~specdec_rt.speculation.protocols.DraftInferrer`; a model draft is
:class:`~specdec_rt.speculation.adapters.ModelDrafter` (``OrtDraftInferrer`` for exported models).
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from ..errors import InvalidInputError
from ..speculation.context import RequestContext
from ..speculation.protocols import DraftInferrer
from ..types import DraftToken

__all__ = ["NgramDrafter"]

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
        hay = tokens[-self.window :]  # [W]
        for starts in self._matches(hay, n_min):
            if starts.size:
                start = int(starts[-1])  # the latest match
                found: np.ndarray = hay[start : start + k].copy()
                return found
        return np.array(hay[:0])

    def _matches(self, hay: np.ndarray, n_min: int | None) -> Iterator[np.ndarray]:
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
        hay = tokens[-self.window :]  # [W]
        token: list[int] = []  # the trie's nodes: each one's token, parent (-1: the root), depth, matches through it
        parent: list[int] = []
        depth: list[int] = []
        support: list[int] = []
        children: dict[tuple[int, int], int] = {}  # (node (-1: the root), token) -> child node
        deepest = min(k, self.k_max)
        for starts in self._matches(hay, n_min):
            for start in starts[::-1][:TREE_MATCHES].tolist():
                node = -1  # latest match first: the first one is the chain (as propose)
                for t in hay[start : start + deepest].tolist():
                    nxt = children.get((node, t))
                    if nxt is None:
                        nxt = children[(node, t)] = len(token)
                        token.append(t)
                        parent.append(node)
                        depth.append(depth[node] + 1 if node >= 0 else 1)
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
        if ctx.plan.tree_nodes:
            return self.propose_tree(ctx.tokens, k, ctx.plan.tree_nodes)
        return [DraftToken(int(t)) for t in self.propose(ctx.tokens, k)]

    def release(self, ctx: RequestContext) -> None:
        pass  # no per-request state
