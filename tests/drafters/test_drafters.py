"""N-gram (prompt lookup) and combined drafters: proposals, losslessness, distribution."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from specdec_rt import InvalidInputError, ModelDrafter, ModelVerifier, SamplingParams, SpecConfig, SpecDecScheduler
from specdec_rt.drafters import CombinedDrafter, NgramDrafter
from specdec_rt.testing import (
    ToyLM,
    check_greedy_lossless,
    chi_square_pvalue,
    sequence_counts,
    sequence_distribution,
    toy_pair,
)

CASES = [
    # tokens, k, expected proposal
    ([1, 2, 3, 9, 1, 2], 3, [3, 9, 1]),  # the 2-gram "1 2" occurred before: propose what followed
    ([5, 1, 2, 3, 7, 1, 2, 3, 8, 1, 2, 3], 2, [8, 1]),  # the latest of several matches wins
    ([1, 2, 3, 4], 3, []),  # no repeat: nothing
    ([4, 4, 4], 5, [4]),  # overlapping match; the proposal stops at the end of the context
    ([7, 8, 9, 7, 8], 8, [9, 7, 8]),
]


@pytest.mark.parametrize("tokens,k,expected", CASES)
def test_ngram_proposals(tokens, k, expected):
    assert NgramDrafter(n_max=3).propose(np.array(tokens), k).tolist() == expected


def test_ngram_prefers_longer_matches_and_respects_k_max():
    d = NgramDrafter(n_max=2, k_max=2)
    tokens = np.array([3, 1, 5, 6, 2, 1, 7, 8, 2, 1])  # "2 1" -> 7 (longer) beats "1" -> 7 (same here)
    assert d.propose(tokens, 8).tolist() == [7, 8]
    tokens = np.array([1, 5, 9, 3, 1])  # only the 1-gram "1" matches
    assert NgramDrafter(n_max=3).propose(tokens, 2).tolist() == [5, 9]


@pytest.mark.parametrize("kwargs", [{"n_min": 0}, {"n_min": 3, "n_max": 2}, {"k_max": 0}])
def test_ngram_config_validation(kwargs):
    with pytest.raises(InvalidInputError):
        NgramDrafter(**kwargs)


def test_ngram_and_combined_are_lossless_greedy():
    target, draft = toy_pair(6, seed=2, distance=0.3)  # small vocab: repeats, so n-grams match
    prompts = [[1, 2, 3, 1, 2], [0], [4, 4, 4, 4]]
    anyio.run(check_greedy_lossless, NgramDrafter(), ModelVerifier(target), prompts, 60)
    combined = CombinedDrafter(NgramDrafter(), ModelDrafter(draft))
    anyio.run(check_greedy_lossless, combined, ModelVerifier(target), prompts, 60)
    assert combined.used["ngram"] > 0 and combined.used["model"] > 0


@pytest.mark.parametrize("nodes", [0, 3])  # 3: n-gram trees, several fixed candidates a depth
def test_ngram_sampling_keeps_the_target_distribution(nodes):
    target = ToyLM(4, seed=3)
    config = SpecConfig(
        measure_costs=False,
        k_min=2,
        k_init=2,
        k_max=2,
        adapt_k=False,
        fallback_below=0.0,
        zero_rounds=10**6,
        min_speedup=0.0,
        tree_nodes=nodes,
    )
    sched = SpecDecScheduler(NgramDrafter(n_min=1), ModelVerifier(target), config)
    params = SamplingParams(temperature=1.0)
    prompt = [1, 2, 1]  # "1" repeats: the drafter always has a proposal
    counts = anyio.run(lambda: sequence_counts(sched, prompt, 3, params, n=5000, rng=np.random.default_rng(5)))
    assert chi_square_pvalue(counts, sequence_distribution(target, prompt, 3, params)) > 1e-3
    assert sched.totals.drafted > 0 and (sched.totals.tree_nodes > 0) == (nodes > 0)


# ------------------------------------------------------------------ n-gram draft trees
TREE_CONTEXT = [1, 2, 3, 10, 11, 12, 5, 1, 2, 3, 20, 21, 22, 6, 1, 2, 3, 10, 11, 13, 7, 9, 2, 3, 30, 1, 2, 3]


def test_an_ngram_tree_is_the_chain_plus_where_earlier_matches_went_on():
    from specdec_rt.sampling.tree import DraftTree, chain_length, tree_depth, tree_parents

    d, tokens = NgramDrafter(n_max=3), np.array(TREE_CONTEXT)
    chain = d.propose(tokens, 4).tolist()
    assert [x.id for x in d.propose_tree(tokens, 4, 0)] == chain == [10, 11, 13, 7]
    tree = d.propose_tree(tokens, 4, 3)
    assert [x.id for x in tree[: chain_length(tree)]] == chain and len(tree) == 7
    parents = tree_parents(tree)
    DraftTree([x.id for x in tree], parents)  # a valid tree: parents before children
    # shallowest first: the root's other children ("1 2 3" -> 20, "2 3" -> 30), then 20's child
    assert [(x.id, p) for x, p in zip(tree[4:], parents[4:])] == [(20, -1), (30, -1), (21, 4)]
    full = d.propose_tree(tokens, 4, 16)
    assert tree_depth(full) == 4  # no branch deeper than the chain
    paths = set()
    for i in range(len(full)):  # every node's path is a distinct continuation seen in the context
        path, node = [], i
        while node >= 0:
            path.append(full[node].id)
            node = tree_parents(full)[node]
        paths.add(tuple(path[::-1]))
    assert len(paths) == len(full)
    assert (10, 11, 12, 5) in paths and (20, 21, 22, 6) in paths and (30, 1, 2, 3) in paths
    assert d.propose_tree(np.array([1, 2, 3]), 4, 3) == []  # no match: nothing
    for k, nodes in ((4, -1), (-2, 3)):
        with pytest.raises(InvalidInputError, match=f"k={k}, nodes={nodes}"):
            d.propose_tree(tokens, k, nodes)


def test_ngram_trees_are_lossless_and_pay_where_continuations_differ():
    from specdec_rt.testing import toy_pair as pair

    target, _ = pair(6, seed=2, distance=0.3)
    always = dict(measure_costs=False, adapt_k=False, k_init=4, fallback_below=0.0, zero_rounds=10**6, min_speedup=0.0)
    prompts = [[1, 2, 3, 1, 2], [0], [4, 4, 4, 4], [5, 0, 5, 1, 5, 2, 5]]
    per_call = {}
    for nodes in (0, 4):
        # 1-gram matches of an order-2 target: the latest match is often not where it goes on
        sched = SpecDecScheduler(NgramDrafter(n_max=1), ModelVerifier(target), SpecConfig(tree_nodes=nodes, **always))

        async def main():
            out = []
            for p in prompts:
                spec = await sched.run(p, 60, SamplingParams())
                plain = await sched.run(p, 60, SamplingParams(), mode="ar")
                assert spec.token_ids == plain.token_ids
                out.append(spec.stats)
            return out

        stats = anyio.run(main)
        per_call[nodes] = sum(s.new_tokens for s in stats) / sum(s.rounds + s.ar_steps for s in stats)
        assert (sum(s.tree_nodes for s in stats) > 0) == (nodes > 0)
    assert per_call[4] > 1.3 * per_call[0], per_call  # 1.25 -> 2.12 tokens a target call


def test_the_ngram_tree_distribution_test_catches_a_walk_without_the_residual(monkeypatch):
    from test_tree_spec import _walk_without_residual

    import specdec_rt.speculation.adapters as adapters

    monkeypatch.setattr(adapters, "tree_accept", _walk_without_residual)
    with pytest.raises(AssertionError, match="chi_square_pvalue"):
        test_ngram_sampling_keeps_the_target_distribution(3)


def test_when_the_draft_prefill_does_not_pay_the_combined_drafter_speculates_with_matches_alone():
    target, draft = toy_pair(6, seed=2, distance=0.3)
    combined = CombinedDrafter(NgramDrafter(), ModelDrafter(draft))
    sched = SpecDecScheduler(combined, ModelVerifier(target), SpecConfig())
    prompt = [1, 2, 3, 1, 2, 3, 1, 2, 3, 4, 1, 2, 3] * 4  # long, and full of repeats

    async def main():
        plain = await sched.run(prompt, 30, SamplingParams(), mode="ar")  # measures the toy's plain step
        # measured costs that make the draft's prefill of a long prompt too dear for a short answer
        sched.costs.draft_token_s, sched.costs.verify_s, sched.costs.draft_prefill_s = 0.012, {0: 0.025, 4: 0.030}, 0.05
        spec = await sched.run(prompt, 30, SamplingParams())
        return plain, spec

    before = draft.calls
    plain, spec = anyio.run(main)
    assert spec.token_ids == plain.token_ids
    assert [f.reason for f in spec.stats.fallbacks][:1] == ["prefill_free_drafts"]
    assert spec.stats.drafted > 0 and draft.calls == before  # drafts, and never a draft model call


def test_a_model_drafter_times_its_steps_after_the_first_call():
    """``ctx.draft_steps``: the steps a draft took after its first call (which may read a
    prompt or what the draft missed) and their seconds: what the cost model can trust as a
    draft step's cost in a first round or a probe."""
    from specdec_rt.speculation.context import RequestContext

    _, draft = toy_pair(8, seed=1)
    drafter = ModelDrafter(draft)
    ctx = RequestContext([1, 2, 3, 4, 5, 6], 16)
    drafts = anyio.run(drafter.generate_draft, ctx, 4)
    steps, seconds = ctx.draft_steps
    assert len(drafts) == 4 and steps == 3 and seconds > 0
    anyio.run(drafter.generate_draft, ctx, 1)
    assert ctx.draft_steps == (0, 0.0)  # one call: nothing timed alone (not the last round's)
    drafter.release(ctx)
