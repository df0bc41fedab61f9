"""Tree acceptance keeps the target's distribution: in closed form per node, and over sequences.

The closed-form tests average :func:`node_outcomes` (the exact probabilities the sampler draws
from) over every way the children can be drawn and require the first emitted token to be
distributed exactly as ``p``. The same checks catch deliberately broken variants: no residual
update after a rejection, and children drawn without replacement but carrying their true ``q``.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec_rt.errors import InvalidInputError
from specdec_rt.sampling import greedy_accept
from specdec_rt.sampling import tree as tree_sampling
from specdec_rt.sampling.tree import DraftTree, chain, greedy_tree_accept, node_outcomes, tree_accept
from specdec_rt.testing import chi_square_pvalue


def _dist(rng, v, zeros=True):
    x = rng.random(v) ** 3
    if zeros and v > 2:
        x[rng.integers(v)] = 0.0  # a token one side cannot produce
    return x / x.sum()


def _first_token(outcomes, p, qs, draws) -> np.ndarray:
    """Distribution of the token that leaves a node: average over ``draws`` ((tokens, prob))."""
    out = np.zeros_like(p)
    for tokens, prob in draws:
        accept, emit = outcomes(p, np.array(tokens), qs)
        for x, a in zip(tokens, accept):
            out[x] += prob * a
        out += prob * emit
    return out


def _independent_draws(qs):
    v = qs[0].size
    for tokens in itertools.product(range(v), repeat=len(qs)):
        yield tokens, float(np.prod([q[x] for q, x in zip(qs, tokens)]))


def _broken_no_residual(r, tokens, qs):
    """A mutant: after a rejection the next child is tried against the same r."""
    r = np.asarray(r, dtype=np.float64)
    accept, left = np.zeros(len(tokens)), 1.0
    for i, (x, q) in enumerate(zip(tokens, qs)):
        a = min(1.0, r[x] / q[x]) if q[x] > 0 else 0.0
        accept[i] = left * a
        left *= 1.0 - a
    residual = np.maximum(r - qs[-1], 0.0) if len(qs) else r
    return accept, left * (residual / residual.sum() if residual.sum() > 0 else r)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), v=st.integers(2, 5), m=st.integers(1, 3))
def test_first_token_is_exactly_p_for_children_drawn_independently(seed, v, m):
    rng = np.random.default_rng(seed)
    p = _dist(rng, v)
    qs = [_dist(rng, v) for _ in range(m)]  # each child from its own q
    got = _first_token(node_outcomes, p, qs, _independent_draws(qs))
    np.testing.assert_allclose(got, p, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), v=st.integers(2, 6), m=st.integers(1, 4))
def test_first_token_is_exactly_p_for_fixed_candidates(seed, v, m):
    rng = np.random.default_rng(seed)
    p = _dist(rng, v)
    tokens = rng.choice(v, size=min(m, v), replace=False)  # top-k style: distinct, chosen in advance
    qs = [np.eye(v)[x] for x in tokens]  # deterministic: one-hot rows
    got = _first_token(node_outcomes, p, qs, [(tuple(tokens), 1.0)])
    np.testing.assert_allclose(got, p, atol=1e-12)


def test_the_closed_form_check_catches_a_sampler_without_the_residual_update():
    rng = np.random.default_rng(5)
    caught = 0
    for _ in range(20):
        p, qs = _dist(rng, 4), [_dist(rng, 4) for _ in range(2)]
        got = _first_token(_broken_no_residual, p, qs, _independent_draws(qs))
        caught += not np.allclose(got, p, atol=1e-6)
    assert caught >= 15


def test_children_drawn_without_replacement_must_carry_one_hot_rows():
    """Two distinct children drawn from one q without replacement: their true q makes the walk
    biased (the second draw depends on the first); one-hot rows keep it exact."""
    rng = np.random.default_rng(11)
    p, q = _dist(rng, 4, zeros=False), _dist(rng, 4, zeros=False)
    draws = [((a, b), q[a] * q[b] / (1 - q[a])) for a in range(4) for b in range(4) if a != b]
    biased = _first_token(node_outcomes, p, [q, q], draws)
    assert not np.allclose(biased, p, atol=1e-6)
    exact = np.zeros(4)
    for tokens, prob in draws:
        exact += prob * _first_token(node_outcomes, p, [np.eye(4)[x] for x in tokens], [(tokens, 1.0)])
    np.testing.assert_allclose(exact, p, atol=1e-12)


# ---------------------------------------------------------------- whole sequences, Monte Carlo
V, LENGTH = 3, 2


def _tables():
    """Order-1 target and draft, ``[V, V]`` = P(next | last); the draft prefers what the target
    does not, so a broken walk shows (the mutant's first token is off by 0.2)."""
    target = np.array([[0.6, 0.3, 0.1], [0.1, 0.6, 0.3], [0.3, 0.1, 0.6]])
    return target, target[:, ::-1].copy()


def _generate(target, draft, start, rng, outcomes) -> tuple:
    """LENGTH tokens after ``start`` by tree rounds: 2 root children, each with 1 child, drawn
    independently from the draft; the walk's exact outcome probabilities from ``outcomes``."""
    seq = []
    while len(seq) < LENGTH:
        last = seq[-1] if seq else start
        a, b = (int(rng.choice(V, p=draft[last])) for _ in range(2))
        c, d = int(rng.choice(V, p=draft[a])), int(rng.choice(V, p=draft[b]))
        tree = DraftTree([a, b, c, d], [-1, -1, 0, 1], np.stack([draft[last], draft[last], draft[a], draft[b]]))
        p = np.stack([target[last], target[a], target[b], target[c], target[d]])
        saved = tree_sampling.node_outcomes
        tree_sampling.node_outcomes = outcomes
        try:
            _, emitted = tree_accept(tree, p, rng)
        finally:
            tree_sampling.node_outcomes = saved
        seq.extend(int(t) for t in emitted)
    return tuple(seq[:LENGTH])


@pytest.mark.parametrize("outcomes,exact", [(node_outcomes, True), (_broken_no_residual, False)])
def test_sampled_sequences_follow_the_target(outcomes, exact):
    target, draft = _tables()
    start, n = 0, 6000
    rng = np.random.default_rng(12)
    counts: dict = {}
    for _ in range(n):
        s = _generate(target, draft, start, rng, outcomes)
        counts[s] = counts.get(s, 0) + 1
    expected = {
        seq: float(target[start, seq[0]] * target[seq[0], seq[1]]) for seq in itertools.product(range(V), repeat=LENGTH)
    }
    pvalue = chi_square_pvalue(counts, expected)
    assert (pvalue > 1e-3) if exact else (pvalue < 1e-6), pvalue


# ---------------------------------------------------------------- greedy, chains, bad input
def test_greedy_walk_follows_the_argmax_through_the_tree():
    tree = DraftTree([5, 7, 1, 2, 9], [-1, -1, 1, 1, 3])  # root -> 5, 7; 7 -> 1, 2; 2 -> 9
    # target argmax: after root 7, after node 0 (5) 0, after 7: 2, after 1: 3, after 2: 9, after 9: 4
    path, tokens = greedy_tree_accept(tree, np.array([7, 0, 2, 3, 9, 4]))
    assert path.tolist() == [1, 3, 4] and tokens.tolist() == [7, 2, 9, 4]
    path, tokens = greedy_tree_accept(tree, np.array([6, 0, 2, 3, 9, 4]))
    assert path.tolist() == [] and tokens.tolist() == [6]


@settings(max_examples=50, deadline=None)
@given(draft=st.lists(st.integers(0, 4), min_size=1, max_size=6), target=st.data())
def test_a_chain_is_the_chain_acceptance(draft, target):
    t = target.draw(st.lists(st.integers(0, 4), min_size=len(draft) + 1, max_size=len(draft) + 1))
    _, tokens = greedy_tree_accept(chain(draft), np.array(t))
    assert tokens.tolist() == greedy_accept(np.array(draft), np.array(t)).tolist()


def test_depth_is_the_position_after_the_committed_tokens():
    assert DraftTree([1, 2, 3, 4], [-1, 0, -1, 1]).depth().tolist() == [1, 2, 1, 3]


@pytest.mark.parametrize(
    "tokens,parents,msg",
    [
        ([1, 2], [-1, 1], "node 1's parent 1"),  # a node cannot be its own parent
        ([1, 2], [-1, -2], "node 1's parent -2"),
        ([1, 2], [-1], "must match"),
    ],
)
def test_bad_trees_are_named(tokens, parents, msg):
    with pytest.raises(InvalidInputError, match=msg):
        DraftTree(tokens, parents)


def test_target_rows_must_fit_the_tree():
    with pytest.raises(InvalidInputError, match=r"\[n \+ 1, V\] = \[3, V\]"):
        tree_accept(DraftTree([1, 2], [-1, 0]), np.ones((2, 4)) / 4, np.random.default_rng(0))


@pytest.mark.parametrize(
    "tree,p,msg",
    [
        (DraftTree([0, 4], [-1, -1]), np.full((3, 4), 0.25), r"tokens\[1\] = 4 is out of range for vocabulary size 4"),
        (DraftTree([0, -1], [-1, -1]), np.full((3, 4), 0.25), r"tokens\[1\] = -1"),
        (DraftTree([0], [-1], np.full((1, 3), 1 / 3)), np.full((2, 4), 0.25), r"q must have shape \[n, V\] = \[1, 4\]"),
        (DraftTree([0], [-1], np.array([[np.nan, 0.5, 0.25, 0.25]])), np.full((2, 4), 0.25), "q row 0 contains NaN"),
        (DraftTree([0], [-1], np.array([[5.0, 0, 0, 0]])), np.full((2, 4), 0.25), "q row 0 sums to 5"),
        (DraftTree([0], [-1]), np.array([[0.9, 0.6, -0.5, 0.0], [0.25] * 4]), "p row 0 has negative"),
        (DraftTree([0], [-1]), np.full((2, 4), 0.75), "p row 0 sums to 3"),
    ],
)
def test_bad_tree_inputs_are_named_not_sampled_from(tree, p, msg):
    with pytest.raises(InvalidInputError, match=msg):
        tree_accept(tree, p, np.random.default_rng(0))


def test_float_tokens_and_negative_greedy_ids_are_refused():
    with pytest.raises(InvalidInputError, match="tokens must be integers"):
        DraftTree([1.5], [-1])
    with pytest.raises(InvalidInputError, match=r"target_ids\[1\] = -1"):
        greedy_tree_accept(DraftTree([1], [-1]), np.array([1, -1]))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), v=st.integers(2, 5), m=st.integers(1, 3))
def test_a_child_its_own_q_could_not_draw_leaves_the_first_token_exactly_p(seed, v, m):
    """A fixed child whose q gives its token no probability (a drafter's contract broken) is a
    certain rejection; followed by children drawn from their q, the token is still exactly p."""
    rng = np.random.default_rng(seed)
    p = _dist(rng, v)
    bad_q = _dist(rng, v, zeros=False)
    bad_q[0], bad_q[1] = 0.0, bad_q[0] + bad_q[1]  # token 0 cannot come from it
    qs = [_dist(rng, v) for _ in range(m)]
    draws = (((0, *t), prob) for t, prob in _independent_draws(qs))
    np.testing.assert_allclose(_first_token(node_outcomes, p, [bad_q, *qs], draws), p, atol=1e-12)
