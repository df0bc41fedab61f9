"""A draft tree verified in one call (exporter 0.3 graphs: position ids + attention bias into
GroupQueryAttention): every node gets the logits of its path fed as a chain (to float rounding:
attention sums the path's keys at other indices), and compacting the accepted path leaves the
cache as that chain would (specdec_rt.ort.tree). Quantized targets verify chains only."""

from __future__ import annotations

import numpy as np
import pytest

from specdec_rt.errors import InferenceError
from specdec_rt.ort.model import OrtModel
from specdec_rt.ort.tree import compact_rows, depths, tree_feeds

pytestmark = pytest.mark.export

# node: 0 1 2 3 4 5 6 ; two branches off the committed tokens (0 and 4), 0 with two children
PARENTS = [-1, 0, 0, 1, -1, 4, 2]


def _path(parents, node):
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import export_tiny

    return export_tiny(tmp_path_factory.mktemp("tree"), "llama")


def test_depths_positions_and_mask():
    assert depths(PARENTS).tolist() == [1, 2, 2, 3, 1, 2, 3]
    pos, bias = tree_feeds(PARENTS, past=5)
    assert pos.tolist() == [[5, 6, 6, 7, 5, 6, 7]]
    seen = bias[0, 0] == 0  # [S, past + S]
    assert seen[:, :5].all()  # everyone sees the committed tokens
    assert [np.flatnonzero(row[5:]).tolist() for row in seen] == [_path(PARENTS, i) for i in range(7)]
    with pytest.raises(InferenceError, match="node 2 has parent 3"):
        depths([-1, 0, 3, 1])


def test_compaction_moves_the_kept_rows_in_place():
    a = np.arange(2 * 1 * 12 * 2, dtype=np.float32).reshape(2, 1, 12, 2)  # [slots, kv, L, d]
    before = a.copy()
    compact_rows([a], 1, 3, [0, 2, 5])
    np.testing.assert_array_equal(a[1, :, 3:6], before[1, :, [3, 5, 8]].transpose(1, 0, 2))
    np.testing.assert_array_equal(a[0], before[0])  # other slots untouched
    np.testing.assert_array_equal(a[1, :, :3], before[1, :, :3])  # the committed prefix too
    with pytest.raises(InferenceError, match="increasing"):
        compact_rows([a], 1, 3, [2, 1])


def test_every_node_gets_the_logits_of_its_path(tiny):
    model = OrtModel(tiny, max_length=64, slots=2, threads=1)
    assert model.tree
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, model.vocab_size, size=9)
    nodes = rng.integers(3, model.vocab_size, size=len(PARENTS))
    s = model.start()
    s.run_sync(prompt, 1, 0)
    tree = s.run_sync(nodes, len(PARENTS), 9, tree=PARENTS)  # [S, V]
    assert s.length == 9  # nothing committed until the path is chosen
    chain = model.start()
    chain.run_sync(prompt, 1, 0)
    for i in range(len(PARENTS)):
        path = _path(PARENTS, i)
        chain.rollback(9)
        want = chain.run_sync(nodes[path], len(path), 9)  # [len(path), V]
        np.testing.assert_allclose(tree[i], want[-1], rtol=0, atol=1e-5)
        assert tree[i].argmax() == want[-1].argmax()


def test_the_accepted_path_decodes_on_as_if_fed_as_a_chain(tiny):
    model = OrtModel(tiny, max_length=64, slots=2, threads=1)
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, model.vocab_size, size=11)
    nodes = rng.integers(3, model.vocab_size, size=len(PARENTS))
    nxt = rng.integers(3, model.vocab_size, size=4)
    path = _path(PARENTS, 6)  # 0 -> 2 -> 6: a path that has to move
    s, chain = model.start(), model.start()
    for sess in (s, chain):
        sess.run_sync(prompt, 1, 0)
    s.run_sync(nodes, 1, 11, tree=PARENTS)
    s.accept_tree(11, path)
    chain.run_sync(nodes[path], 1, 11)
    assert s.length == chain.length == 14
    assert (s._ids[:14] == chain._ids[:14]).all()
    np.testing.assert_allclose(s.run_sync(nxt, 4, 14), chain.run_sync(nxt, 4, 14), rtol=0, atol=1e-5)
    with pytest.raises(InferenceError, match="cache holds 18"):
        s.accept_tree(14, [0])


def test_a_quantized_target_verifies_chains(tmp_path):
    from tiny_models import export_tiny

    model = OrtModel(export_tiny(tmp_path, "llama", quantize="int8"), max_length=64, slots=1, threads=1)
    assert model.biased and not model.tree
    s = model.start()
    s.run_sync(np.arange(3, 9), 1, 0)
    with pytest.raises(InferenceError, match="cannot verify a tree"):
        s.run_sync(np.arange(3, 6), 3, 6, tree=[-1, 0, 0])


def test_a_quantized_model_refuses_a_tree(tiny_llama):
    """Its graph takes the tree inputs, but int8 activations would amplify a tree node's float
    rounding against its chain: it verifies chains."""
    quantized = OrtModel(tiny_llama / "draft-q4", max_length=64, slots=1, threads=1)
    assert quantized.manifest.quantization["accuracy_level"] == 4
    assert quantized.biased and not quantized.tree
    s = quantized.start()
    s.run_sync(np.arange(3, 9), 1, 0)
    with pytest.raises(InferenceError, match="cannot verify a tree"):
        s.run_sync(np.arange(3, 6), 3, 6, tree=[-1, 0, 0])


def test_greedy_tree_speculation_through_the_engine_equals_plain(tmp_path, monkeypatch):
    from tiny_models import export_tiny, plain_spec_together

    import specdec_rt.speculation.adapters as adapters
    from specdec_rt.policy.config import SpecConfig

    out = export_tiny(tmp_path, "llama", draft="int8")  # a close draft: long accepted paths
    trees = []
    real = adapters.ModelVerifier._verify_tree

    async def spy(self, ctx, drafts, parents):
        verdict = await real(self, ctx, drafts, parents)
        trees.append(verdict.path)
        return verdict

    monkeypatch.setattr(adapters.ModelVerifier, "_verify_tree", spy)
    prompts = ["one two three", "def f(x):\n    return", "Hello world! The", "import numpy"]
    cfg = SpecConfig(measure_costs=False, adapt_k=False, k_init=4, tree_nodes=3, fallback_below=0.0)
    plain, spec, together = plain_spec_together(out, "model", cfg, prompts, 24, slots=2)
    assert spec == plain and together == plain
    assert trees and any(len(p) > 1 for p in trees)  # trees verified, paths several nodes long


def _sequence_probs(model: OrtModel, prompt, length: int, params) -> dict:
    """Exact probability of every ``length``-token continuation under plain sampling (top-k
    rows: only k tokens each)."""
    from specdec_rt.sampling import warp

    rows: dict = {}

    def row(prefix):
        if prefix not in rows:
            s = model.start()
            rows[prefix] = warp(s.run_sync(np.array(list(prompt) + list(prefix)), 1, 0)[0], params)
            s.close()
        return rows[prefix]

    out: dict = {}

    def walk(prefix, p):
        if len(prefix) == length:
            out[prefix] = p
            return
        r = row(prefix)
        for x in np.flatnonzero(r):  # top-k: k tokens
            walk(prefix + (int(x),), p * float(r[x]))

    walk((), 1.0)
    return out


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    from tiny_models import export_tiny

    return export_tiny(tmp_path_factory.mktemp("tree-pair"), "llama", draft="tiny")


def _tree_samples(folder, params, n, seed=0):
    import anyio

    from specdec_rt import SpecConfig, SpecDecScheduler
    from specdec_rt.ort import OrtDraftInferrer, OrtTargetVerifier
    from specdec_rt.testing import sequence_counts

    target = OrtModel(folder, max_length=32, slots=1, threads=1)
    draft = OrtModel(next(folder.glob("draft-*")), max_length=32, slots=1, threads=1)
    config = SpecConfig(
        k_min=2,
        k_init=2,
        k_max=2,
        adapt_k=False,
        tree_nodes=2,
        measure_costs=False,
        fallback_below=0.0,
        zero_rounds=10**6,
        min_speedup=0.0,
    )
    sched = SpecDecScheduler(OrtDraftInferrer(draft), OrtTargetVerifier(target), config)
    counts = anyio.run(lambda: sequence_counts(sched, PROMPT_IDS, 3, params, n=n, rng=np.random.default_rng(seed)))
    return (counts, sched.totals), target


PROMPT_IDS = [5, 17, 42, 9]


def test_tree_sampling_on_an_exported_pair_keeps_the_distribution(tiny_pair, monkeypatch):
    """Temperature 1, top-k 3, sequences of 3 tokens: sampled with draft trees (chain of 2 + 2
    runner-up nodes) against their exact probabilities under plain sampling; then the same test
    with a tree walk that forgets the residual update must fail."""
    from test_tree_spec import _walk_without_residual

    import specdec_rt.speculation.adapters as adapters
    from specdec_rt.sampling import SamplingParams
    from specdec_rt.testing import chi_square_pvalue

    params = SamplingParams(temperature=1.0, top_k=3)
    (counts, totals), target = _tree_samples(tiny_pair, params, 1500)
    assert totals.tree_rounds >= 1500 and totals.tree_hits > 0  # trees verified, siblings taken
    expected = _sequence_probs(target, PROMPT_IDS, 3, params)
    assert chi_square_pvalue(counts, expected) > 1e-3
    monkeypatch.setattr(adapters, "tree_accept", _walk_without_residual)
    (broken, _), _ = _tree_samples(tiny_pair, params, 1500, seed=1)
    assert chi_square_pvalue(broken, expected) < 1e-6


def test_a_plain_step_through_its_bound_buffers_equals_the_same_step_fed_generally(tiny):
    """Single-token steps bind their inputs and logits once (OrtSession._step) and write them in
    place; interleaved with calls of other shapes (which re-bind), every step's logits are those
    of the general path, and the returned logits are the caller's (the next step reuses the buffer)."""
    model = OrtModel(tiny, max_length=64, slots=2, threads=1)
    rng = np.random.default_rng(3)
    ids = rng.integers(3, model.vocab_size, size=20)
    fast, slow = model.start(), model.start()
    fast.run_sync(ids[:5], 1, 0)
    slow.run_sync(ids[:5], 1, 0)
    kept = []
    for i in range(5, 20):
        if i % 4 == 0:  # another shape in between: a two-position call, then rolled back
            fast.run_sync(ids[i - 1 : i + 1], 2, i - 1)
            fast.rollback(i)
        got = fast.run_sync(ids[i : i + 1], 1, i)  # [1, V] via the bound buffers
        kept.append(got)
        # the general path for the same step: feed the previous token again with it, take the last row
        slow.rollback(i - 1)
        want = slow.run_sync(ids[i - 1 : i + 1], 1, i - 1)  # [1, V]
        assert fast.length == slow.length == i + 1
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert not np.shares_memory(kept[0], kept[-1]) and not np.allclose(kept[0], kept[-1])
