"""Turn any :class:`~specdec_rt.speculation.protocols.LanguageModel` into a drafter or a verifier.

The KV bookkeeping of speculative decoding lives here, once, for every backend:

* The target's cache holds every committed token but the last; a verify call feeds the missing
  tokens (the last committed one, or the whole prompt on the first call) plus the k drafts, and
  reads the logits of the last k+1 positions: ``p_0 .. p_k``.
* The draft's cache is brought back in step the same way: after a partial acceptance it rolls
  back to the longest prefix it shares with the committed tokens and feeds only the 1-2 tokens it
  has not seen (never the whole context again).
* Rejected positions are forgotten by ``rollback`` (a length change); nothing is copied.
"""

from __future__ import annotations

from time import perf_counter
from typing import Any, Callable, Sequence

import numpy as np

from ..checks import brief_repr
from ..errors import ContextLengthError, InferenceError, InvalidInputError
from ..policy.confidence import confidence
from ..sampling import biased, greedy_accept, greedy_ids, rejection_sample, sample, warp
from ..sampling.logprobs import token_logprobs
from ..sampling.tree import DraftTree, chain_length, greedy_tree_accept, tree_accept, tree_parents
from ..types import DraftToken, Verdict
from .context import RequestContext
from .protocols import CacheSession, DraftInferrer, LanguageModel, TargetVerifier

__all__ = [
    "SyncedSession",
    "ModelDrafter",
    "ModelVerifier",
    "TargetHidden",
    "TARGET_HIDDEN",
    "softmax",
    "with_siblings",
]

TARGET_HIDDEN = "target_hidden"  # RequestContext state key of the verifier's TargetHidden
TREE_TAIL_MAX = 8  # a tree goes after at most this many uncommitted tokens (not after a prompt)
SIBLING_RANKS = 3  # a model draft's tree ranks the draft's 3 best alternatives at every depth

Sampler = Callable[[np.ndarray, np.ndarray, np.ndarray, np.random.Generator], np.ndarray]


class SyncedSession:
    """A :class:`CacheSession` plus the ids it holds, kept consistent with committed tokens."""

    def __init__(
        self,
        session: CacheSession,
        capacity: int,
        tokens: np.ndarray | None = None,
        vocab_size: int | None = None,
        *,
        model_vocab: int | None = None,
    ) -> None:
        self.session = session
        self.vocab_size = vocab_size  # the logits' width every call must have (None: unchecked)
        # a model narrower than ``vocab_size`` (a draft of a padded target): ids past its own are
        # fed as id 0, its logits widened with -inf (never proposed)
        self.model_vocab = model_vocab
        self.ids = np.zeros(capacity, dtype=np.int64)  # [capacity] ids whose KV the cache holds
        self._matched = 0  # ids[:_matched] are known to equal committed tokens (which never change)
        if session.length:  # a prefix cache hit: the first `length` of `tokens` are cached
            assert tokens is not None  # (a session starts from a hit only on tokens)
            self.ids[: session.length] = tokens[: session.length]
            self._matched = session.length

    def pending(self, tokens: np.ndarray) -> np.ndarray:
        """Roll back to the longest cached prefix of ``tokens`` (keeping at least the last token
        uncached, so there is always something to feed) and return the tokens to feed next."""
        n = self.session.length
        m = min(n, tokens.size - 1)
        lo = min(self._matched, m)
        diff = np.flatnonzero(self.ids[lo:m] != tokens[lo:m])
        if diff.size:
            m = lo + int(diff[0])
        if m < n:
            self.session.rollback(m)
        self._matched = m
        return tokens[m:]

    async def extend(self, ids: np.ndarray, logits_rows: int, **extra: Any) -> Any:  # the backend's return
        """Feed ``ids`` ``[S]``; logits of the last ``logits_rows`` positions ``[rows, V]``
        (``extra``: backend options such as ``hidden=True``, which returns ``(logits, hidden)``)."""
        n = self.session.length
        if n + ids.size > self.ids.size:
            raise ContextLengthError(
                f"sequence of {n + ids.size} tokens exceeds the model's maximum length of {self.ids.size}"
            )
        self.ids[n : n + ids.size] = ids  # before the call: a cancelled call may still have written them
        self._matched = min(self._matched, n)
        narrow = self.model_vocab
        fed = ids if narrow is None else np.where(ids < narrow, ids, 0)
        out = await self.session.extend(fed, logits_rows, **extra)
        logits = out[0] if isinstance(out, tuple) else out
        width = self.vocab_size if narrow is None else narrow
        if width is not None and (np.ndim(logits) != 2 or np.shape(logits) != (logits_rows, width)):
            raise InferenceError(
                f"the model returned logits of shape {np.shape(logits)} for {logits_rows} rows "
                f"of its vocabulary of {width}"
            )
        if narrow is None or self.vocab_size is None or narrow == self.vocab_size:
            return out
        wide = np.full((logits_rows, self.vocab_size), -np.inf, dtype=np.asarray(logits).dtype)
        wide[:, :narrow] = logits
        return (wide, *out[1:]) if isinstance(out, tuple) else wide

    def accept_tree(self, start: int, keep: np.ndarray) -> None:
        """After a tree call that started at ``start``: keep positions ``start + keep`` (the
        accepted path), moved to ``start ..`` (see :meth:`OrtSession.accept_tree`)."""
        self.session.accept_tree(start, keep)
        self.ids[start : start + keep.size] = self.ids[start + keep]
        self._matched = min(self._matched, start)

    def close(self) -> None:
        self.session.close()


class TargetHidden:
    """The target's last hidden state per position, as the verifier saw it (EAGLE drafts read it).

    ``rows[j]`` [H] is the target's normalised hidden state after reading token j. Rows below
    ``len(ctx.tokens) - 1`` belong to committed tokens and never change; rows past that may hold
    rejected drafts' states until they are overwritten.
    """

    def __init__(self, capacity: int, hidden_size: int, session: CacheSession | None = None) -> None:
        kept = session.hidden_rows(hidden_size) if session is not None else None  # per slot (prefix cache)
        self.rows = kept if kept is not None else np.zeros((capacity, hidden_size), dtype=np.float32)  # [capacity, H]

    def write(self, start: int, hidden: np.ndarray) -> None:
        self.rows[start : start + hidden.shape[0]] = hidden


class _ModelUser:
    """Shared plumbing: one SyncedSession per request, stored in the request context."""

    def __init__(self, model: LanguageModel) -> None:
        self.model = model
        self.vocab_size: int | None = model.vocab_size  # (None in the Protocols: no limit)
        self.max_length: int | None = model.max_length
        self.model_vocab: int | None = None  # set by `widen`: the model's own, narrower width

    def _session(self, ctx: RequestContext) -> SyncedSession:
        # a seeded sampled request's output must depend on its seed alone (greedy output does
        # not move: tested), so its logits must not depend on the calls it shares: it computes
        # its prompt itself (cached KV equals a fresh prefill only to float rounding, another
        # call shape), and its session is batch-invariant (see LanguageModel.start)
        seeded = ctx.params.seed is not None and not ctx.params.greedy
        return ctx.state(self, lambda: self._start(ctx.tokens, cached=not seeded, same_path=seeded))

    def _start(self, tokens: np.ndarray, cached: bool = True, same_path: bool = False) -> SyncedSession:
        """A model with a prefix cache (``caps.caches_prefixes``) starts from what it holds of
        ``tokens`` (unless ``cached=False``); any other starts empty. ``same_path``: the session
        must be batch-invariant (:meth:`LanguageModel.start`)."""
        narrow = self.model_vocab
        if cached and self.model.caps.caches_prefixes:
            return SyncedSession(
                self.model.start(tokens, batch_invariant=same_path),
                self.model.max_length,
                tokens,
                self.vocab_size,
                model_vocab=narrow,
            )
        return SyncedSession(
            self.model.start(batch_invariant=same_path),
            self.model.max_length,
            vocab_size=self.vocab_size,
            model_vocab=narrow,
        )

    def widen(self, vocab_size: int) -> None:
        """Serve a target whose vocabulary of ``vocab_size`` ids is wider than the model's: the
        logits get ``-inf`` past the model's ids (never proposed) and target ids the model lacks
        are fed as id 0 (what follows them is still verified by the target)."""
        own = self.model.vocab_size
        if own is None or vocab_size < own:
            raise InvalidInputError(f"cannot widen a vocabulary of {own} ids to {vocab_size}")
        self.model_vocab, self.vocab_size = own, vocab_size

    def release(self, ctx: RequestContext) -> None:
        s = ctx.pop_state(self)
        if s is not None:
            s.close()


class ModelDrafter(_ModelUser, DraftInferrer):
    """Draft with a (small) language model: k autoregressive steps from its own cache.

    Args:
        model: The draft model.
    """

    def cached_prefix(self, tokens: np.ndarray) -> int:
        """Tokens of ``tokens`` its model's prefix cache holds: its prefill costs only the rest."""
        return self.model.cached_prefix(tokens)

    async def generate_draft(self, ctx: RequestContext, k: int) -> Sequence[DraftToken]:
        """k autoregressive steps; with ``ctx.plan.tree_nodes`` = n > 0, also n siblings of the chain's
        tokens (a tree; free: the same logits), the most probable under the draft (EAGLE-2's
        rule, within the chain's siblings): a candidate y at depth i scores
        ``q_0(x_0) ... q_{i-1}(x_{i-1}) q_i(y)``, the draft's probability of reaching it, over the
        draft's ``SIBLING_RANKS`` best alternatives at every depth. A sibling is a deterministic
        choice (one-hot ``q``), which keeps tree rejection sampling exact (see
        :mod:`specdec_rt.sampling.tree`)."""
        s = self._session(ctx)
        feed = s.pending(ctx.tokens)  # [1..] tokens the draft cache has not seen
        drafts: list[DraftToken] = []
        candidates: list[tuple[float, int, int]] = []  # (draft probability of the node, depth, token)
        reach = 1.0  # draft probability of the chain so far
        plan = ctx.plan  # this round's: tree nodes, chain stop; the steps' timing goes back in it
        stop = plan.chain_stop  # set: end the chain where the draft is unsure (confidence.py)
        stepped = 0.0  # seconds of the steps after the first call, which reads what the draft missed
        for i in range(k):
            t = perf_counter()
            if ctx.adjusts:  # as the target's check will score this position (its mask meanwhile)
                async with ctx.scoring([[d.id for d in drafts]]) as score:
                    logits = (await score(await s.extend(feed, 1)))[0]  # [V]
            else:
                logits = (await s.extend(feed, 1))[0]  # [V]
            stepped += perf_counter() - t if i else 0.0
            if ctx.params.greedy:
                scores = biased(logits, ctx.params)  # [V] the logits the target's argmax will read
                x = int(greedy_ids(scores))
                drafts.append(DraftToken(x))  # deterministic: q is one-hot at x
                q = softmax(scores) if plan.tree_nodes else None  # [V] only to rank siblings
            else:
                q = warp(logits, ctx.params)  # [V]
                x = sample(q, ctx.rng)
                drafts.append(DraftToken(x, q))
            if stop is not None and not stop.more(confidence(logits) if q is None else float(q[x])) and i + 1 < k:
                break  # one more draft would cost more than it is likely to bring
            if plan.tree_nodes:
                assert q is not None  # (computed for trees in both branches)
                best = np.argpartition(q, -(SIBLING_RANKS + 1))[-(SIBLING_RANKS + 1) :]  # [ranks + 1]
                candidates += [(reach * float(q[y]), i, int(y)) for y in best if y != x and q[y] > 0]
                reach *= float(q[x])
            feed = np.array([x], dtype=np.int64)  # the last draft is never fed: it may be rejected
        plan.draft_steps = (max(len(drafts) - 1, 0), stepped)  # one draft per call
        return with_siblings(drafts, candidates, plan.tree_nodes)


def with_siblings(
    drafts: list[DraftToken], candidates: Sequence[tuple[float, int, int]], nodes: int
) -> list[DraftToken]:
    """The chain ``drafts`` plus the ``nodes`` most probable ``candidates`` (probability of
    reaching it, depth, token id) as tree nodes, each a child of the chain's token above it."""
    chosen = sorted(candidates, reverse=True)[:nodes]
    return drafts + [DraftToken(y, parent=i - 1) for _, i, y in sorted(chosen, key=lambda c: c[1])]


def softmax(logits: np.ndarray) -> np.ndarray:
    weights: np.ndarray = np.exp(logits - logits.max())  # [V]
    probs: np.ndarray = weights / weights.sum()
    return probs


class ModelVerifier(_ModelUser, TargetVerifier):
    """Verify with the target model: one call over the k drafts plus one position.

    ``sampler`` is the rejection sampler (the contract of :func:`rejection_sample`); tests swap in
    deliberately broken ones to prove the distribution checks catch them.

    ``share_hidden=True`` also keeps the target's hidden states of the fed positions in the
    request context (:class:`TargetHidden`), for drafters that set ``needs_target_hidden``.
    """

    reports_logprobs = True  # verdicts carry the tokens' log-probabilities when a request asks

    def __init__(self, model: LanguageModel, sampler: Sampler = rejection_sample, share_hidden: bool = False) -> None:
        """A verifier over ``model``.

        Args:
            model: The target.
            sampler: The rejection sampler.
            share_hidden: Keep the target's hidden states for the drafter.

        Raises:
            InvalidInputError: ``share_hidden`` with a target whose ``caps.hidden_states`` is
                False.
        """
        super().__init__(model)
        if share_hidden and not model.caps.hidden_states:
            raise InvalidInputError(
                f"share_hidden: the target {brief_repr(model)} returns no hidden states "
                "(its caps.hidden_states is False)"
            )
        self.sampler = sampler
        self.share_hidden = share_hidden

    def release(self, ctx: RequestContext) -> None:
        ctx.pop_state(TARGET_HIDDEN)  # the hidden states this verifier shared
        super().release(ctx)

    @property
    def batched_verify(self) -> bool:
        """Whether its verifies go into a batched call with other requests' (``caps.ragged``)."""
        return self.model.caps.ragged

    @property
    def trees(self) -> bool:
        """Whether it verifies a draft tree in one call (a model with ``caps.trees``; while
        sharing hidden states, the accepted path's states are shared)."""
        return self.model.caps.trees

    async def verify_and_accept(self, ctx: RequestContext, drafts: Sequence[DraftToken]) -> Verdict:
        chain = chain_length(drafts)
        s = self._session(ctx)
        if chain < len(drafts):
            if self.trees and ctx.tokens.size - s.session.length <= TREE_TAIL_MAX and not s.session.copy_pending:
                return await self._verify_tree(ctx, drafts, tree_parents(drafts))
            drafts = drafts[:chain]  # a tree, but chains only here (or a long tail): its main chain
        first = ctx.stats.rounds + ctx.stats.ar_steps == 0
        k = len(drafts)
        draft_ids = np.fromiter((d.id for d in drafts), dtype=np.int64, count=k)  # [k]
        feed = np.concatenate([s.pending(ctx.tokens), draft_ids])  # [S >= k+1]
        async with ctx.scoring([draft_ids[:i] for i in range(k + 1)]) as score:  # row i after i drafts
            if self.share_hidden:
                start = s.session.length
                logits, hidden = await s.extend(feed, k + 1, hidden=True)  # hidden [S, H]
                self._share_states(ctx, s, start, hidden)
            else:
                logits = await s.extend(feed, k + 1)  # [k+1, V]: p_0 .. p_k before warping
            _note_cached_prompt(ctx, s, first)
            scores = await score(logits)  # [k+1, V]
        if ctx.params.greedy:
            target_ids = greedy_ids(scores, ctx.params)  # [k+1]
            out = greedy_accept(draft_ids, target_ids)
        else:
            p = warp(scores, ctx.params)  # [k+1, V]
            if k == 0:
                out = np.array([sample(p[0], ctx.rng)], dtype=np.int64)
            else:
                out = self.sampler(draft_ids, _q_rows(drafts, p), p, ctx.rng)
        lp = None if ctx.logprobs is None else token_logprobs(logits[: out.size], out, ctx.logprobs)
        return Verdict(tokens=out, accepted=len(out) - 1, logprobs=lp)

    def _share_states(self, ctx: RequestContext, s: SyncedSession, start: int, states: np.ndarray) -> None:
        """The target's hidden states ``[S, H]`` of positions ``start ..``, for the drafter."""
        width = states.shape[-1]
        ctx.state(TARGET_HIDDEN, lambda: TargetHidden(self.model.max_length, width, s.session)).write(start, states)

    async def _verify_tree(self, ctx: RequestContext, drafts: Sequence[DraftToken], parents: list[int]) -> Verdict:
        """One call over the n tree nodes after the uncommitted tail (as a chain), then the tree
        walk of :mod:`specdec_rt.sampling.tree`, then the accepted path compacted in the cache."""
        s = self._session(ctx)
        first = ctx.stats.rounds + ctx.stats.ar_steps == 0
        n = len(drafts)
        tree = DraftTree([d.id for d in drafts], parents)
        tail = s.pending(ctx.tokens)  # [m >= 1]
        m, start = tail.size, s.session.length
        feed = np.concatenate([tail, tree.tokens])  # [m + n]
        links = np.concatenate([np.arange(m) - 1, np.where(tree.parents < 0, m - 1, m + tree.parents)])  # [m + n]
        hidden = None
        async with ctx.scoring([[]] + [_path_tokens(tree, j) for j in range(n)]) as score:  # row 1+j: after node j
            if self.share_hidden:  # logits [n + 1, V]: after the tail, after each node; hidden [m + n, H]
                logits, hidden = await s.extend(feed, n + 1, tree=links, hidden=True)
            else:
                logits = await s.extend(feed, n + 1, tree=links)
            _note_cached_prompt(ctx, s, first)
            scores = await score(logits)
        if ctx.params.greedy:
            path, out = greedy_tree_accept(tree, greedy_ids(scores, ctx.params))
        else:
            p = warp(scores, ctx.params)  # [n + 1, V]
            tree.q = _q_rows(drafts, p)
            path, out = tree_accept(tree, p, ctx.rng)
        keep = np.concatenate([np.arange(m), m + path])  # the tail, then the accepted nodes
        s.accept_tree(start, keep)
        if hidden is not None:  # the committed positions' states, in their new order
            self._share_states(ctx, s, start, hidden[keep])  # [m + accepted, H]
        lp = (
            None if ctx.logprobs is None else token_logprobs(logits[np.concatenate([[0], 1 + path])], out, ctx.logprobs)
        )
        return Verdict(tokens=out, accepted=int(path.size), path=tuple(int(i) for i in path), logprobs=lp)


def _path_tokens(tree: DraftTree, node: int) -> list[int]:
    """The tokens from the committed ones down to ``node`` (its ancestors, then itself)."""
    path = []
    while node >= 0:
        path.append(int(tree.tokens[node]))
        node = int(tree.parents[node])
    return path[::-1]


def _note_cached_prompt(ctx: RequestContext, s: SyncedSession, first: bool) -> None:
    """After a request's first target call: the prompt positions the prefix cache supplied, and
    whether the cache was asked at all."""
    if first:
        ctx.stats.cached_prompt_tokens = int(s.session.cached_tokens)
        ctx.stats.cache_queries = int(s.session.cache_queried)


def _q_rows(drafts: Sequence[DraftToken], p: np.ndarray) -> np.ndarray:
    """The drafts' distributions q as dense rows ``[k, V]`` in ``p``'s dtype."""
    return np.stack([d.q_row(p.shape[-1]) for d in drafts]).astype(p.dtype, copy=False)
