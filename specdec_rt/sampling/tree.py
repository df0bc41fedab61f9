"""Lossless acceptance over a *tree* of drafts: several candidates per position, one verify.

Notation as in :mod:`specdec_rt.sampling` (``p`` target, ``q`` draft). A draft tree has ``n``
nodes; node ``i`` holds a token ``tokens[i]``, its parent ``parents[i]`` (``-1``: the root, i.e.
the last committed token) and ``q[i]``, the draft distribution it was drawn from (a one-hot row
for a deterministic choice: a top-k child, an n-gram match). The target, fed the tree with a
tree attention mask, gives ``p[0]`` (after the committed tokens: the distribution of the root's
children) and ``p[i + 1]`` (after node ``i``: the distribution of its children).

**The walk.** Start at the root with ``r = p[root]``. Try the node's children in order; child
``c`` (token ``x``, drawn from ``q_c``) is accepted with probability ``min(1, r(x) / q_c(x))``;
on acceptance move to ``c`` (``r = p[c]``) and start over. On rejection replace ``r`` by the
residual ``norm(max(0, r - q_c))`` and try the next child. When every child was rejected (or
the node has none) emit one token drawn from ``r`` and stop. Greedy is the same walk with
one-hot rows: follow the target's argmax while a child carries it.

**Why the emitted tokens are distributed exactly as the target's (proof sketch).** One step is
the speculative-sampling lemma: if ``x ~ q``, keeping ``x`` with probability ``min(1, r(x)/q(x))``
and otherwise drawing from ``norm(max(0, r - q))`` yields a token distributed as ``r``, since
``P(y) = min(r(y), q(y)) + (1 - sum_z min(r(z), q(z))) * max(0, r(y) - q(y)) / sum_z max(0, r(z) - q(z))``
and ``sum_z min(r, q) + sum_z max(0, r - q) = 1``, so ``P(y) = min(r(y), q(y)) + max(0, r(y) - q(y)) = r(y)``.
Trying the next child instead of drawing from the residual is the same lemma applied to the
residual, provided the next child's token is independent of the rejection (children drawn
independently, or fixed in advance: one-hot ``q``; *not* children drawn from one ``q`` without
replacement with their true ``q``, which is why such children must carry one-hot rows). By
induction over the children, the token that leaves a node is distributed as ``p[node]``; the
next node's distribution is the target's conditional given that token, so whole emitted
sequences are distributed as sampling the target token by token.

Pure NumPy, randomness passed in; :func:`node_outcomes` gives the exact outcome probabilities
that :func:`tree_accept` samples from, so tests check the math in closed form.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np
import numpy.typing as npt

from ..errors import InferenceError, InvalidInputError
from . import check_rows, sample

__all__ = [
    "DraftTree",
    "node_outcomes",
    "tree_accept",
    "greedy_tree_accept",
    "chain",
    "depths_of",
    "tree_parents",
    "chain_length",
    "tree_depth",
    "Linked",
]


class Linked(Protocol):
    """A draft as the tree functions read it (a ``DraftToken``): the index of the draft it
    continues, ``-1`` for the committed tokens, ``None`` for the previous draft."""

    @property
    def parent(self) -> int | None: ...


class DraftTree:
    """``tokens`` ``[n]`` int, ``parents`` ``[n]`` int (``-1`` = root, else an earlier node:
    parents come before children), ``q`` ``[n, V]`` float or None (deterministic: one-hot)."""

    def __init__(self, tokens: npt.ArrayLike, parents: npt.ArrayLike, q: np.ndarray | None = None) -> None:
        for name, ids in (("tokens", tokens), ("parents", parents)):
            a = np.asarray(ids)
            if a.size and not np.issubdtype(a.dtype, np.integer):
                raise InvalidInputError(f"a draft tree's {name} must be integers, got dtype {a.dtype}")
        self.tokens = np.asarray(tokens, dtype=np.int64)  # [n]
        self.parents = np.asarray(parents, dtype=np.int64)  # [n]
        n = self.tokens.size
        if self.tokens.ndim != 1 or self.parents.shape != (n,):
            raise InvalidInputError(
                f"tokens [n] and parents [n] must match, got {self.tokens.shape} and {self.parents.shape}"
            )
        if n and ((self.parents < -1).any() or (self.parents >= np.arange(n)).any()):
            bad = int(np.flatnonzero((self.parents < -1) | (self.parents >= np.arange(n)))[0])
            raise InvalidInputError(f"node {bad}'s parent {int(self.parents[bad])} is not -1 or an earlier node")
        self.q = None if q is None else np.asarray(q)  # [n, V]
        if self.q is not None and self.q.shape[0] != n:
            raise InvalidInputError(f"q must have one row per node ([{n}, V]), got {self.q.shape}")

    def __len__(self) -> int:
        return int(self.tokens.size)

    def children(self, node: int) -> np.ndarray:
        """Nodes whose parent is ``node`` (``-1``: the root's), in order."""
        return np.flatnonzero(self.parents == node)

    def depth(self) -> np.ndarray:
        """``[n]`` depth of each node (root's children: 1): their position ids after the committed tokens."""
        return depths_of(self.parents)

    def q_row(self, node: int, vocab: int) -> np.ndarray:
        if self.q is not None:
            given: np.ndarray = self.q[node]
            return given
        row = np.zeros(vocab)
        row[self.tokens[node]] = 1.0
        return row


def depths_of(parents: Sequence[int] | np.ndarray) -> np.ndarray:
    """``[n]`` depth of each node of a valid ``parents`` (-1 or an earlier node): 1 + its parent's."""
    out = np.empty(len(parents), dtype=np.int64)
    for i, par in enumerate(parents):
        out[i] = 1 if par < 0 else out[par] + 1
    return out


def tree_parents(drafts: Sequence[Linked]) -> list[int]:
    """Each draft's parent index (``-1``: the committed tokens) from ``DraftToken.parent``; a
    chain's are ``i - 1``. A parent that is not earlier is a drafter's bug: ``InferenceError``."""
    parents = [i - 1 if d.parent is None else int(d.parent) for i, d in enumerate(drafts)]
    if any(not -1 <= p < i for i, p in enumerate(parents)):
        raise InferenceError(f"a draft tree's parents must come before their children, got {parents}")
    return parents


def chain_length(drafts: Sequence[Linked]) -> int:
    """How many drafts, from the first, form a chain (a tree's main chain)."""
    return next((i for i, d in enumerate(drafts) if d.parent is not None and d.parent != i - 1), len(drafts))


def tree_depth(drafts: Sequence[Linked]) -> int:
    """The longest path of a draft tree (a chain's length): what one round can accept."""
    return int(depths_of(tree_parents(drafts)).max(initial=0))


def chain(tokens: Sequence[int] | np.ndarray, q: np.ndarray | None = None) -> DraftTree:
    """A chain of drafts as a tree with one branch."""
    n = len(tokens)
    return DraftTree(tokens, np.arange(n) - 1, q)


def node_outcomes(r: np.ndarray, tokens: np.ndarray, qs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Exact probabilities of what happens at one node with target distribution ``r`` ``[V]``
    whose children carry ``tokens`` ``[m]`` drawn from ``qs`` (``m`` rows ``[V]``): ``accept``
    ``[m]`` (child i is the one accepted) and ``emit`` ``[V]`` (all rejected, this token drawn
    from the final residual). ``accept.sum() + emit.sum() == 1``. A child whose own ``q`` gives
    its token no probability (it was not drawn from that ``q``) is rejected and leaves ``r`` as
    it was: the residual's lemma assumes ``x ~ q``, a certain rejection tells nothing."""
    r = np.asarray(r, dtype=np.float64)
    accept = np.zeros(len(tokens))
    left = 1.0  # probability that every child so far was rejected
    for i, (x, q) in enumerate(zip(tokens, qs)):
        qx = float(q[x])
        if qx == 0:  # its q could not have drawn x: a certain rejection, which leaves r as it was
            continue
        a = min(1.0, r[x] / qx)
        accept[i] = left * a
        if a < 1.0:
            residual = np.maximum(r - q, 0.0)
            total = residual.sum()
            r = residual / total if total > 0 else r  # all zero only where r == q (rounding aside)
        left *= 1.0 - a
    return accept, left * r


def tree_accept(tree: DraftTree, p: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Walk ``tree`` against the target rows ``p`` ``[n + 1, V]`` (row 0: after the committed
    tokens; row i + 1: after node i). Returns ``(path, tokens)``: the accepted nodes in order
    ``[a]`` and the emitted tokens ``[a + 1]`` (their tokens, then one drawn at the last node)."""
    p = np.asarray(p)
    if p.ndim != 2 or p.shape[0] != len(tree) + 1 or p.shape[1] == 0:
        raise InvalidInputError(f"p must have shape [n + 1, V] = [{len(tree) + 1}, V], got {p.shape}")
    vocab = p.shape[1]
    _check_tree(tree, p)
    path: list[int] = []
    node = -1
    while True:
        kids = tree.children(node)
        accept, emit = node_outcomes(p[node + 1], tree.tokens[kids], [tree.q_row(c, vocab) for c in kids])
        pick = sample(np.concatenate([accept, emit]), rng)  # one of m children, or a token
        if pick < kids.size:
            node = int(kids[pick])
            path.append(node)
            continue
        last = pick - kids.size
        return np.array(path, dtype=np.int64), np.append(tree.tokens[path], np.int64(last)).astype(np.int64)


def _check_tree(tree: DraftTree, p: np.ndarray) -> None:
    """The tree's tokens are ids in ``[0, V)``, its ``q`` (if any) and ``p`` probability rows:
    else :class:`InvalidInputError` naming the node, row or id (nothing is sampled from garbage)."""
    vocab = p.shape[1]
    check_rows("p", p)
    if tree.q is not None:
        if tree.q.shape != (len(tree), vocab):
            raise InvalidInputError(f"the tree's q must have shape [n, V] = [{len(tree)}, {vocab}], got {tree.q.shape}")
        check_rows("the tree's q", tree.q)
    _check_ids("the tree's tokens", tree.tokens, vocab)


def _check_ids(name: str, ids: np.ndarray, vocab: int | None = None) -> None:
    bad = (ids < 0) if vocab is None else (ids < 0) | (ids >= vocab)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        limit = "" if vocab is None else f" for vocabulary size {vocab}"
        raise InvalidInputError(f"{name}[{i}] = {int(ids[i])} is out of range{limit}")


def greedy_tree_accept(tree: DraftTree, target_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Greedy walk: ``target_ids`` ``[n + 1]`` is the target's argmax at each row of ``p``;
    follow the child that carries it while there is one. Same return as :func:`tree_accept`."""
    target_ids = np.asarray(target_ids)
    if target_ids.shape != (len(tree) + 1,) or not np.issubdtype(target_ids.dtype, np.integer):
        raise InvalidInputError(
            f"target_ids must be integers of shape [n + 1] = [{len(tree) + 1}], got "
            f"dtype {target_ids.dtype} shape {target_ids.shape}"
        )
    _check_ids("target_ids", target_ids)
    _check_ids("the tree's tokens", tree.tokens)
    path: list[int] = []
    node = -1
    while True:
        want = target_ids[node + 1]
        kids = tree.children(node)
        hit = kids[tree.tokens[kids] == want]
        if hit.size == 0:
            return np.array(path, dtype=np.int64), np.append(tree.tokens[path], want).astype(np.int64)
        node = int(hit[0])
        path.append(node)
