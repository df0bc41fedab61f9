"""Tree speculation end to end on toy models: a request alone drafts its main chain plus the
draft's runner-up at the first depths (``SpecConfig.tree_nodes``), the target verifies the tree
in one call and walks it (specdec_rt.sampling.tree). Greedy output equals plain decoding;
sampled sequences keep the target's distribution (chi-square), and the same test catches a tree
walk without the residual update."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

import specdec_rt.speculation.adapters as adapters
from specdec_rt import ModelDrafter, ModelVerifier, SamplingParams, SpecConfig, SpecDecScheduler
from specdec_rt.errors import InferenceError
from specdec_rt.sampling import sample
from specdec_rt.sampling.tree import DraftTree, tree_depth, tree_parents
from specdec_rt.speculation.scheduler import _checked
from specdec_rt.testing import chi_square_pvalue, sequence_counts, sequence_distribution, toy_pair
from specdec_rt.types import DraftToken, Verdict

VOCAB, LENGTH, PROMPT, N = 4, 3, [1, 2], 6000
ALWAYS = dict(
    measure_costs=False,
    adapt_k=False,
    fallback_below=0.0,
    zero_rounds=10**6,
    min_speedup=0.0,
    defer_draft_prefill=False,
)  # every round drafts, the first one too


def _run(target, draft, config, prompt, n, params=None, mode="spec", rng=None):
    sched = SpecDecScheduler(ModelDrafter(draft), ModelVerifier(target), config)
    return anyio.run(lambda: sched.run(prompt, n, params or SamplingParams(), mode=mode, rng=rng))


def test_tree_shapes_and_verdict_checks():
    chain = [DraftToken(5), DraftToken(6), DraftToken(7)]
    tree = chain + [DraftToken(8, parent=-1), DraftToken(9, parent=0)]
    assert tree_parents(chain) == [-1, 0, 1] and tree_parents(tree) == [-1, 0, 1, -1, 0]
    assert tree_depth(chain) == 3 and tree_depth(tree) == 3 and tree_depth([]) == 0
    ok = Verdict(np.array([5, 9, 1]), 2, path=(0, 4))
    assert _checked(ok, tree) is ok
    for bad in (
        Verdict(np.array([5, 8, 1]), 2, path=(0, 3)),  # 3 is not a child of 0
        Verdict(np.array([5, 7, 1]), 2, path=(0, 4)),  # token is not node 4's
        Verdict(np.array([9, 1]), 1),
    ):  # no path: a prefix, and drafts[0] is 5
        with pytest.raises(InferenceError, match="inconsistent verdict"):
            _checked(bad, tree)
    with pytest.raises(InferenceError, match="parents must come before"):
        tree_parents([DraftToken(1, parent=1)])


@pytest.mark.parametrize("seed", range(6))
def test_greedy_tree_speculation_equals_plain_decoding(seed):
    target, draft = toy_pair(16, seed=seed, distance=0.8)
    prompt = list(np.random.default_rng(seed).integers(0, 16, size=5))
    plain = _run(target, draft, SpecConfig(**ALWAYS), prompt, 40, mode="ar").token_ids
    for nodes in (0, 1, 3):
        cfg = SpecConfig(k_init=4, tree_nodes=nodes, **ALWAYS)
        before = target.tree_calls
        res = _run(target, draft, cfg, prompt, 40)
        assert res.token_ids == plain
        assert (target.tree_calls > before) == (nodes > 0)


def test_the_runner_up_pays_when_the_draft_is_off():
    target, draft = toy_pair(16, seed=4, distance=0.6)  # deterministic: 1.09 -> 1.87 tokens a call
    per_call = {}
    for nodes in (0, 3):
        res = _run(target, draft, SpecConfig(k_init=3, tree_nodes=nodes, **ALWAYS), [3, 1, 4], 200)
        per_call[nodes] = res.stats.tokens_per_target_call
    assert per_call[3] > per_call[0] * 1.1  # rejected chain tokens often had the runner-up right


def test_a_target_that_takes_chains_only_verifies_the_main_chain():
    chains_only, draft = toy_pair(16, seed=2, distance=0.8, tree=False)
    res = _run(chains_only, draft, SpecConfig(k_init=4, tree_nodes=3, **ALWAYS), [1, 2, 3], 30)
    plain = _run(chains_only, draft, SpecConfig(**ALWAYS), [1, 2, 3], 30, mode="ar")
    assert res.token_ids == plain.token_ids and chains_only.tree_calls == 0


def _collect(params, config, n=N, seed=0):
    target, draft = toy_pair(VOCAB, seed=3, distance=0.7)
    sched = SpecDecScheduler(ModelDrafter(draft), ModelVerifier(target), config)
    return anyio.run(
        lambda: sequence_counts(sched, PROMPT, LENGTH, params, n=n, rng=np.random.default_rng(seed))
    ), target


TREE = SpecConfig(k_min=2, k_init=2, k_max=2, tree_nodes=2, **ALWAYS)


def test_tree_sampling_keeps_the_sequence_distribution():
    params = SamplingParams(temperature=1.0)
    counts, target = _collect(params, TREE)
    assert target.tree_calls > N  # trees were verified (several rounds per sequence)
    target, _ = toy_pair(VOCAB, seed=3, distance=0.7)
    assert chi_square_pvalue(counts, sequence_distribution(target, PROMPT, LENGTH, params)) > 1e-3


def _walk_without_residual(tree: DraftTree, p, rng):
    """A broken tree walk: after a rejected child, the next child is judged against p itself,
    not against norm(max(0, p - q)); when all fail, the token is drawn from p."""
    path, node = [], -1
    while True:
        r = p[node + 1]
        for c in tree.children(node):
            q = tree.q_row(c, p.shape[1])
            x = tree.tokens[c]
            if rng.random() * q[x] < r[x]:
                node = int(c)
                path.append(node)
                break
        else:
            return np.array(path, dtype=np.int64), np.append(tree.tokens[path], sample(r, rng)).astype(np.int64)


def test_the_same_test_catches_a_walk_without_the_residual(monkeypatch):
    monkeypatch.setattr(adapters, "tree_accept", _walk_without_residual)
    params = SamplingParams(temperature=1.0)
    counts, _ = _collect(params, TREE)
    target, _ = toy_pair(VOCAB, seed=3, distance=0.7)
    assert chi_square_pvalue(counts, sequence_distribution(target, PROMPT, LENGTH, params)) < 1e-6


def test_trees_never_outgrow_the_models_length():
    """Near the end of a model's context the tree nodes shrink to the room that is left: the
    request still finishes, same output."""
    target, draft = toy_pair(16, seed=3, distance=0.6, max_length=24)
    prompt = [1, 2, 3, 4]
    plain = _run(target, draft, SpecConfig(**ALWAYS), prompt, 20, mode="ar").token_ids
    res = _run(target, draft, SpecConfig(k_init=4, tree_nodes=8, **ALWAYS), prompt, 20)
    assert res.token_ids == plain and len(plain) == 20


def test_realized_rates_switch_trees_off_when_their_rounds_are_slower():
    from specdec_rt.policy.tree import TREE_PROBE_EVERY, TreePolicy, TreeRates

    rates = TreeRates(alpha=0.5)
    policy = TreePolicy(nodes=3, alpha=0.1)
    assert rates.pays() is None
    assert policy.nodes(True, model_pays=True, rates=rates) == 3  # the cost model's rule
    assert policy.nodes(False, True, rates) == 0  # in a batch: chains
    rates.observe(True, 10, 1.0)
    rates.observe(False, 12, 1.0)
    assert rates.pays() is False
    offered = [policy.nodes(True, True, rates) for _ in range(2 * TREE_PROBE_EVERY)]
    assert offered.count(3) == 2  # only the probes
    rates.observe(True, 20, 1.0)
    assert rates.pays() is True
    assert policy.nodes(True, True, rates) == 3


def test_a_kind_of_round_seldom_measured_is_not_held_to_its_first_round():
    """Chains measured by probes only: their first round (cold, 39 tok/s) must not outweigh the
    next ones (55 tok/s) for ~10 probes, or slower trees (50 tok/s) stay on."""
    from specdec_rt.policy.tree import TreeRates

    rates = TreeRates(alpha=0.1)
    rates.observe(False, 39, 1.0)
    for _ in range(20):
        rates.observe(True, 50, 1.0)
    for _ in range(3):
        rates.observe(False, 55, 1.0)
    assert rates.chain == pytest.approx((39 + 3 * 55) / 4) and rates.pays() is False
    for _ in range(20):  # past 1 / alpha rounds: an EWMA, so the machine's drift is followed
        rates.observe(False, 45, 1.0)
    assert 45 < rates.chain < 46.5 and rates.pays() is True


def test_short_requests_still_probe_the_other_kind_of_round():
    from specdec_rt.policy.tree import TREE_PROBE_EVERY, TreePolicy, TreeRates

    rates = TreeRates(alpha=0.5)
    rates.observe(True, 10, 1.0)
    rates.observe(False, 12, 1.0)  # trees measured slower
    offered = []
    for _ in range(2 * TREE_PROBE_EVERY // 4):  # requests of 4 rounds, each its own policy
        policy = TreePolicy(nodes=3, alpha=0.1)
        offered += [policy.nodes(True, True, rates) for _ in range(4)]
    assert offered.count(3) == 2  # the shared clock probes trees every 16 rounds


@pytest.mark.parametrize("bad", [-1, 17, 2.5, True])
def test_a_bad_tree_size_is_refused_by_name(bad):
    from specdec_rt.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=r"SpecConfig\.tree_nodes=" + repr(bad).replace(".", r"\.")):
        SpecConfig(tree_nodes=bad)


def test_a_model_drafts_siblings_go_where_the_draft_is_least_sure():
    """EAGLE-2's rule: a sibling's score is the draft's probability of reaching it. The draft is
    sure of its first token (0.97) and torn at the second (0.6 / 0.35): the one sibling a round
    may add is the second depth's alternative, not the first depth's 1%-runner-up."""
    import anyio

    from specdec_rt.speculation.adapters import ModelDrafter
    from specdec_rt.speculation.context import RequestContext
    from specdec_rt.testing import ToyLM

    def row(probs: dict) -> np.ndarray:  # logits with these probabilities, the rest ~0
        p = np.full(6, 1e-4)
        p[list(probs)] = list(probs.values())
        return np.log(p / p.sum())

    table = np.stack(
        [
            row({1: 0.97, 2: 0.012, 3: 0.008}),  # after 0: surely 1
            row({2: 0.6, 3: 0.35}),  # after 1: 2, or 3
            row({4: 0.9}),
            row({4: 0.9}),
            row({0: 0.9}),
            row({0: 0.9}),
        ]
    )  # after 2: 4
    drafter = ModelDrafter(ToyLM(vocab_size=6, order=1, table=table))
    for nodes, want in [(1, [(3, 0)]), (2, [(3, 0), (2, -1)])]:
        ctx = RequestContext(np.array([0], dtype=np.int64), 8)
        ctx.tree_nodes = nodes
        drafts = anyio.run(drafter.generate_draft, ctx, 3)
        assert [d.id for d in drafts[:3]] == [1, 2, 4]
        assert sorted((d.id, d.parent) for d in drafts[3:]) == sorted(want)
        drafter.release(ctx)


def test_a_tree_round_takes_the_depth_the_cost_model_rates_best():
    """The policy chose a chain of 5; a tree of 3 nodes is rated over each depth of its main
    chain: when drafts deep in the chain are seldom right (0.6) and nodes often (0.5), the tree
    goes on a chain of 3; when the chain is mostly right (0.9), on all 5; nodes never taken:
    the chain alone."""
    from types import SimpleNamespace

    from specdec_rt.policy.acceptance import AcceptanceEWMA, CostModel
    from specdec_rt.policy.tree import TreePolicy

    target, draft = toy_pair(16, seed=0, distance=0.8)
    sched = SpecDecScheduler(ModelDrafter(draft), ModelVerifier(target), SpecConfig(tree_nodes=3))
    ctx = SimpleNamespace(tokens=np.zeros(10, dtype=np.int64))
    costs = CostModel(SpecConfig(), draft_token_s=0.004, verify_s={k: (200.0 + 6.0 * k) / 1e3 for k in range(9)})
    for a, hit_rate, want in ((0.6, 0.5, (3, 3)), (0.9, 0.5, (5, 3)), (0.9, 0.0, (5, 0))):
        policy = SimpleNamespace(costs=costs, ewma=AcceptanceEWMA.start(0.1, a, prior_weight=100.0))
        tree = TreePolicy(nodes=3, alpha=0.1)
        tree.hit_rate = hit_rate
        assert sched._tree_shape(ctx, tree, policy, 5, alone=True, rates=None) == want, (a, hit_rate)
