"""The pure sampling math: warping, rejection sampling, and proofs that it preserves p."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec_rt.errors import InvalidInputError
from specdec_rt.sampling import SamplingParams, greedy_accept, rejection_sample, sample, warp
from specdec_rt.testing import chi_square_pvalue, rejection_cases


def onehot(ids, v):
    out = np.zeros((len(ids), v))
    out[np.arange(len(ids)), ids] = 1.0
    return out


def first_token_distribution(q0: np.ndarray, p0: np.ndarray) -> np.ndarray:
    """Closed form P(first emitted token = x) for one draft x ~ q0 (the k = 1 case and the first
    position of any k): accept with min(1, p/q), else draw from norm(max(0, p - q))."""
    accept = np.minimum(p0, q0)  # P(draft = x and accepted) = q(x) * min(1, p(x)/q(x))
    residual = np.maximum(p0 - q0, 0.0)
    rejected_mass = 1.0 - accept.sum()
    return accept + (rejected_mass * residual / residual.sum() if residual.sum() > 0 else 0.0)


# ----------------------------------------------------------------------------- table tests
V = 5
CASES = [
    # name, draft ids, target argmax per position (k+1), expected emitted tokens
    ("perfect match + bonus", [1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4]),
    ("early mismatch", [1, 2, 3], [1, 0, 3, 4], [1, 0]),
    ("all rejected", [1, 2, 3], [4, 4, 4, 4], [4]),
    ("single draft accepted", [2], [2, 0], [2, 0]),
    ("last draft rejected", [1, 2], [1, 2, 3][:2] + [0], [1, 2, 0]),
]


@pytest.mark.parametrize("name,draft,target,expected", CASES, ids=[c[0] for c in CASES])
def test_table_one_hot(name, draft, target, expected):
    rng = np.random.default_rng(0)
    got = rejection_sample(np.array(draft), onehot(draft, V), onehot(target, V), rng)
    assert got.tolist() == expected
    assert greedy_accept(np.array(draft), np.array(target)).tolist() == expected


def test_rejected_token_resamples_from_residual_only():
    # p and q share token 0; a rejection of draft token 1 must never emit token 1 again
    q = np.array([[0.0, 1.0, 0.0]])
    p = np.array([[0.5, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3]])
    rng = np.random.default_rng(1)
    outs = [tuple(rejection_sample(np.array([1]), q, p, rng)) for _ in range(2000)]
    rejected = [o for o in outs if len(o) == 1]
    assert rejected and all(o[0] in (0, 2) for o in rejected)  # residual is max(0, p - q) = [.5, 0, .25]
    assert abs(len(rejected) / len(outs) - 0.75) < 0.05  # accept prob = p(1)/q(1) = 0.25


def test_draft_with_zero_q_is_rejected_cleanly():
    q = np.array([[1.0, 0.0]])  # the drafted token 1 has q = 0: cannot come from q
    p = np.array([[0.0, 1.0], [0.5, 0.5]])
    with np.errstate(all="raise"):  # no division by zero anywhere
        out = rejection_sample(np.array([1]), q, p, np.random.default_rng(0))
    assert out.tolist() == [1]  # rejected: one token from p_0 = [0, 1]


def test_a_draft_its_own_q_could_not_draw_still_leaves_the_output_distributed_as_p():
    """q_0(x_0) = 0: a certain rejection, which says nothing about p; the token must come from p_0,
    not from the residual max(0, p_0 - q_0) = [0.5, 0] (which would always emit the rejected 0)."""
    q = np.array([[0.0, 1.0]])
    p = np.array([[0.5, 0.5], [0.5, 0.5]])
    rng = np.random.default_rng(3)
    firsts = [int(rejection_sample(np.array([0]), q, p, rng)[0]) for _ in range(4000)]
    assert 0.46 < firsts.count(0) / 4000 < 0.54


BAD = [
    ("k = 0", np.array([], dtype=int), np.zeros((0, 3)), np.full((1, 3), 1 / 3), "empty"),
    ("p rows", np.array([0]), np.full((1, 3), 1 / 3), np.full((1, 3), 1 / 3), r"p must have shape \[k\+1"),
    ("q shape", np.array([0]), np.full((2, 3), 1 / 3), np.full((2, 3), 1 / 3), "q must have shape"),
    ("NaN", np.array([0]), np.array([[np.nan, 0.5, 0.5]]), np.full((2, 3), 1 / 3), "NaN"),
    ("negative", np.array([0]), np.array([[1.5, -0.5, 0.0]]), np.full((2, 3), 1 / 3), "negative"),
    ("row sum", np.array([0]), np.full((1, 3), 0.5), np.full((2, 3), 1 / 3), "sums to 1.5"),
    ("id range", np.array([3]), np.full((1, 3), 1 / 3), np.full((2, 3), 1 / 3), "draft id 3"),
    ("id dtype", np.array([0.0]), np.full((1, 3), 1 / 3), np.full((2, 3), 1 / 3), "integer"),
    ("no generator", np.array([0]), np.full((1, 3), 1 / 3), np.full((2, 3), 1 / 3), "rng must be"),
]


@pytest.mark.parametrize("name,ids,q,p,msg", BAD, ids=[b[0] for b in BAD])
def test_invalid_input_names_the_problem(name, ids, q, p, msg):
    with pytest.raises(ValueError, match=msg) as info:
        rejection_sample(ids, q, p, None if name == "no generator" else np.random.default_rng(0))
    assert isinstance(info.value, InvalidInputError)


# ----------------------------------------------------------------------------- invariants
@settings(max_examples=300, derandomize=True, deadline=None)
@given(case=rejection_cases(), seed=st.integers(0, 2**32 - 1))
def test_invariants(case, seed):
    ids, q, p = case
    out = rejection_sample(ids, q, p, np.random.default_rng(seed))
    k, v = len(ids), p.shape[1]
    assert 1 <= len(out) <= k + 1  # accepted prefix plus exactly one token
    assert out[:-1].tolist() == ids[: len(out) - 1].tolist()  # a prefix of the drafts
    assert 0 <= out.min() and out.max() < v
    if len(out) <= k:  # a recovered token has positive residual mass (or p == q there)
        n = len(out) - 1
        residual = np.maximum(p[n] - q[n], 0)
        assert residual[out[-1]] > 0 or (residual.sum() == 0 and p[n][out[-1]] > 0)
    else:  # the bonus token comes from p_k's support
        assert p[k][out[-1]] > 0
    again = rejection_sample(ids, q, p, np.random.default_rng(seed))
    assert again.tolist() == out.tolist()  # same seed, same output


@settings(max_examples=200, derandomize=True, deadline=None)
@given(k=st.integers(1, 6), v=st.integers(2, 8), data=st.data())
def test_greedy_is_exact_matching(k, v, data):
    draft = np.array(data.draw(st.lists(st.integers(0, v - 1), min_size=k, max_size=k)))
    target = np.array(data.draw(st.lists(st.integers(0, v - 1), min_size=k + 1, max_size=k + 1)))
    via_sampler = rejection_sample(draft, onehot(draft, v), onehot(target, v), np.random.default_rng(0))
    assert via_sampler.tolist() == greedy_accept(draft, target).tolist()


# ----------------------------------------------------------------------------- distribution
@settings(max_examples=300, derandomize=True, deadline=None)
@given(case=rejection_cases(max_k=1))
def test_first_token_distribution_is_p_closed_form(case):
    _, q, p = case
    np.testing.assert_allclose(first_token_distribution(q[0], p[0]), p[0], atol=1e-12)


MONTE_CARLO = [
    # q0, p0: a draft far from the target, one that misses target tokens, one that over-covers
    ([0.7, 0.1, 0.1, 0.1], [0.1, 0.2, 0.3, 0.4]),
    ([0.0, 0.5, 0.5, 0.0], [0.4, 0.1, 0.1, 0.4]),
    ([0.25, 0.25, 0.25, 0.25], [0.9, 0.05, 0.05, 0.0]),
]


@pytest.mark.parametrize("q0,p0", MONTE_CARLO)
def test_first_token_distribution_monte_carlo(q0, p0):
    """The implementation, sampled 20,000 times at a fixed seed, matches p_0 (chi-square)."""
    rng = np.random.default_rng(1234)
    q = np.array([q0, q0])  # k = 2: the first emitted token is still distributed as p_0
    p = np.array([p0, p0, p0])
    counts: dict = {}
    for _ in range(20_000):
        x = sample(q[0], rng)
        y = sample(q[1], rng)
        first = int(rejection_sample(np.array([x, y]), q, p, rng)[0])
        counts[(first,)] = counts.get((first,), 0) + 1
    expected = {(i,): pr for i, pr in enumerate(p0)}
    assert chi_square_pvalue(counts, expected) > 1e-3
    # and the same test rejects the draft's own distribution (it has the power to fail)
    assert chi_square_pvalue(counts, {(i,): pr for i, pr in enumerate(q0)}) < 1e-6


# ----------------------------------------------------------------------------- warping
def reference_warp(logits, t, top_k, top_p):
    """Slow, obvious implementation (full sorts) to compare against."""
    z = np.asarray(logits, dtype=np.float64) / t
    if top_k is not None:
        kth = np.sort(z)[::-1][min(top_k, len(z)) - 1]
        z = np.where(z < kth, -np.inf, z)
    pr = np.exp(z - z.max())
    pr /= pr.sum()
    if top_p is not None and top_p < 1.0:  # 1.0 keeps every token (no cut, not a cut at 1 - 1e-7)
        order = np.argsort(-pr, kind="stable")
        cum = np.cumsum(pr[order])
        m = int(np.searchsorted(cum, top_p * (1 - 1e-7)))
        cut = pr[order][min(m, len(pr) - 1)]
        pr = np.where(pr >= cut, pr, 0.0)
        pr /= pr.sum()
    return pr


@settings(max_examples=200, derandomize=True, deadline=None)
@given(
    logits=st.lists(st.floats(-20, 20), min_size=1, max_size=700),
    t=st.floats(0.05, 3.0),
    top_k=st.one_of(st.none(), st.integers(1, 50)),
    top_p=st.one_of(st.none(), st.floats(0.05, 1.0)),
)
def test_warp_matches_reference(logits, t, top_k, top_p):
    params = SamplingParams(temperature=t, top_k=top_k, top_p=top_p)
    got = warp(np.array(logits), params)
    np.testing.assert_allclose(got, reference_warp(logits, t, top_k, top_p), atol=1e-9)
    assert abs(got.sum() - 1) < 1e-9


def test_greedy_warp_is_one_hot_lowest_id_on_ties():
    out = warp(np.array([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0]]), SamplingParams())
    assert out.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": -3}, "seed"),
    ],
)
def test_sampling_params_validation(kwargs, msg):
    with pytest.raises(InvalidInputError, match=msg):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "draft,target,msg",
    [
        ([1.7], [1, 2], "draft_ids must be a 1-D integer array"),
        ([1], [1.0, 2.0], "target_ids must be a 1-D integer array"),
        ([-1], [1, 2], "negative token id -1"),
    ],
)
def test_greedy_accept_refuses_ids_that_are_not_token_ids(draft, target, msg):
    with pytest.raises(InvalidInputError, match=msg):
        greedy_accept(np.array(draft), np.array(target))
