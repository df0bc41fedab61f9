"""`python -m export train-draft` end to end on a tiny random model, resume, the reduced
vocabulary, and the EAGLE head's training forward against its incremental (inference) forward."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import anyio
import numpy as np
import pytest

from specdec_rt import SamplingParams, SpecConfig
from specdec_rt.engine.engine import Engine
from specdec_rt.errors import ModelLoadError

pytestmark = pytest.mark.export

TINY = [
    "--tokens",
    "2500",
    "--prompts",
    "128",
    "--batch",
    "32",
    "--max-new",
    "24",
    "--val-prompts",
    "32",
    "--epochs",
    "3",
    "--depth",
    "3",
    "--eval-prompts",
    "4",
    "--threads",
    "1",
    "--vocab-size",
    "200",
    "-q",
]
PROMPTS = [
    "def add(a, b):",
    "Hello world! The quick",
    [{"role": "user", "content": "Write a Python function."}],
    [{"role": "user", "content": "What is 12 times 7?"}],
]


def _train(target: Path, out: Path, *extra: str) -> int:
    from export.cli import main

    return main(["train-draft", "--target", str(target), "--out", str(out), *TINY, *extra])


@pytest.fixture(scope="module")
def trained(tiny_llama, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("eagle") / "run"
    assert _train(tiny_llama, out) == 0
    return out


def test_train_draft_end_to_end(trained, tiny_llama):
    report = json.loads((trained / "report.json").read_text())
    assert report["status"] == "done"
    assert report["onnx_max_abs_diff"] < 1e-3
    acc = report["acceptance"]
    assert acc["exact"] and len(acc["per_depth"]) == 4
    # a random tiny model's greedy text is learnable: far above chance (1 / 200)
    assert report["training"]["best_val_top1"] > 0.3
    assert acc["per_depth"][0] > 0.3
    curve = report["curve"]
    assert [c["tokens"] for c in curve] == sorted(c["tokens"] for c in curve) and len(curve[0]["val"]) == 3
    m = json.loads((trained / "draft" / "manifest.json").read_text())
    assert m["kind"] == "eagle" and m["role"] == "draft" and m["onnx"]["inputs"]["features"] == "features"
    assert (trained / "curve.png").stat().st_size > 1000
    head = trained / "head.npz"
    assert report["head_file"]["bytes"] == head.stat().st_size
    from export.tokenizer import sha256_file

    assert report["head_file"]["sha256"] == sha256_file(head) == m["source"]["sha256"]


def test_eagle_draft_is_lossless_and_drafts(trained, tiny_llama):
    async def main():
        cfg = SpecConfig(measure_costs=False)
        async with await Engine.load(tiny_llama, draft=str(trained / "draft"), spec_config=cfg) as eng:
            assert eng.scheduler.verifier.share_hidden
            accepted = 0
            for prompt in PROMPTS:
                ar = await eng.generate(prompt, max_new_tokens=40, mode="ar")
                spec = await eng.generate(prompt, max_new_tokens=40)
                assert spec.token_ids == ar.token_ids, prompt
                assert spec.stats.rounds > 0
                accepted += spec.stats.accepted
            assert accepted > 0
            # combined with n-gram lookup too
        async with await Engine.load(tiny_llama, draft="ngram+" + str(trained / "draft"), spec_config=cfg) as eng:
            assert eng.scheduler.verifier.share_hidden
            for prompt in PROMPTS:
                ar = await eng.generate(prompt, max_new_tokens=40, mode="ar")
                assert (await eng.generate(prompt, max_new_tokens=40)).token_ids == ar.token_ids

    anyio.run(main)


def test_reduced_vocabulary_maps_back_exactly(trained, tiny_llama):
    """Sampled drafts carry full-vocabulary ids from the map, and q is zero outside it."""
    from specdec_rt.ort import OrtModel
    from specdec_rt.ort.eagle import EagleDrafter
    from specdec_rt.sampling import rejection_sample
    from specdec_rt.speculation.adapters import ModelVerifier
    from specdec_rt.speculation.scheduler import SpecDecScheduler

    seen = []

    def recording(draft_ids, q, p, rng):
        seen.append((draft_ids.copy(), q.copy()))
        return rejection_sample(draft_ids, q, p, rng)

    drafter = EagleDrafter(trained / "draft", slots=1)
    vocab = drafter.vocab
    assert vocab.size == 200 and np.all(np.diff(vocab) > 0)
    verifier = ModelVerifier(OrtModel(tiny_llama, slots=1), sampler=recording, share_hidden=True)
    sched = SpecDecScheduler(drafter, verifier, SpecConfig(measure_costs=False, adapt_k=False, fallback_below=0.0))
    params = SamplingParams(temperature=0.9, seed=3)
    out = anyio.run(lambda: sched.run([5, 6, 7, 8], 30, params))
    assert len(out.token_ids) == 30 and seen
    outside = np.ones(drafter.target_vocab_size, bool)
    outside[vocab] = False
    for ids, q in seen:
        assert np.isin(ids, vocab).all()
        assert np.allclose(q.sum(-1), 1.0) and not q[:, outside].any()
        assert np.all(q[np.arange(len(ids)), ids] > 0)


def test_bad_vocabulary_map_is_a_load_error(trained, tmp_path):
    from specdec_rt.ort.eagle import EagleDrafter

    bad = tmp_path / "draft"
    shutil.copytree(trained / "draft", bad)
    v = np.load(bad / "vocab.npy")
    np.save(bad / "vocab.npy", v[::-1])  # same size, not sorted
    with pytest.raises(ModelLoadError, match="vocab.npy"):
        EagleDrafter(bad)


def test_recipe_head_is_hash_checked_and_assembled(trained, tiny_llama, tmp_path):
    """A recipe's shipped head (``drafts: [{"name", "head", "sha256"}]``) is assembled with the
    freshly built target, and only if its sha256 matches the pin."""
    from export.errors import HashMismatchError
    from export.pipeline import Job, Request, _Builder
    from export.tokenizer import sha256_file
    from export.ui import Reporter

    staging = tmp_path / "target"
    shutil.copytree(tiny_llama, staging, ignore=shutil.ignore_patterns("draft-*"))
    head = trained / "head.npz"
    builder = _Builder(Request(src="x"), "tiny", None, Reporter(quiet=True), build={})
    eagle = {"name": "eagle", "role": "draft", "subdir": "draft-eagle", "ref": None, "quantize": None}
    bad = Job(**eagle, head={"path": head, "sha256": "0" * 64})
    with pytest.raises(HashMismatchError, match="head.npz"):
        builder.trained_head(bad, staging)
    good = Job(**eagle, head={"path": head, "sha256": sha256_file(head)})
    builder.trained_head(good, staging)
    m = json.loads((staging / "draft-eagle" / "manifest.json").read_text())
    assert m["kind"] == "eagle" and m["source"]["sha256"] == sha256_file(head)

    async def main():
        async with await Engine.load(
            staging, draft=str(staging / "draft-eagle"), spec_config=SpecConfig(measure_costs=False)
        ) as eng:
            ar = await eng.generate(PROMPTS[0], max_new_tokens=30, mode="ar")
            spec = await eng.generate(PROMPTS[0], max_new_tokens=30)
            assert spec.token_ids == ar.token_ids and spec.stats.drafted > 0

    anyio.run(main)


def test_resume_after_a_stop(tiny_llama, tmp_path):
    out = tmp_path / "run"
    assert _train(tiny_llama, out, "--time-budget", "0") == 3  # stopped during data generation
    assert json.loads((out / "report.json").read_text())["status"] == "stopped"
    assert _train(tiny_llama, out) == 2  # a run is there: --resume or another --out
    assert _train(tiny_llama, out, "--resume", "--max-new", "20") == 2  # settings must match
    assert _train(tiny_llama, out, "--resume") == 0
    assert json.loads((out / "report.json").read_text())["acceptance"]["exact"]


def test_stopped_training_resumes_to_the_same_weights(trained, tiny_llama, tmp_path):
    import torch

    from export.draft.data import load_shards
    from export.draft.run import _new_head
    from export.draft.train import TrainConfig, make_batches, train
    from specdec_rt.ort.manifest import load_manifest

    tm = load_manifest(tiny_llama)
    vocab = np.load(trained / "work" / "vocab.npy")
    tb = make_batches(load_shards(trained / "work" / "data" / "train"), vocab, 2048, tm.vocab_size)
    vb = make_batches(load_shards(trained / "work" / "data" / "val"), vocab, 2048, tm.vocab_size)
    cfg = TrainConfig(depth=2, epochs=2, eval_every=3)
    torch.set_num_threads(1)

    def run(work, stops):
        head, _ = _new_head(tiny_llama, tm, vocab)
        for stop_after in stops:
            calls = iter(range(10**6))
            train(
                head,
                tb,
                vb,
                cfg,
                work=work,
                should_stop=(lambda: next(calls) >= stop_after) if stop_after else None,
                log=lambda s: None,
            )
            head, _ = _new_head(tiny_llama, tm, vocab)  # a new process would start from scratch
        head.load_state_dict(torch.load(work / "ckpt.pt", weights_only=True)["head"])
        return head.state_dict()

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    once = run(tmp_path / "a", [None])
    twice = run(tmp_path / "b", [4, None])
    for k in once:
        assert torch.equal(once[k], twice[k]), k
    curve = json.loads((tmp_path / "b" / "curve.json").read_text())
    assert curve == json.loads((tmp_path / "a" / "curve.json").read_text())


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_unrolled_training_matches_incremental_drafting(depth):
    """Depth s of the training forward sees exactly what drafting step s sees: a cache of true
    features up to j-s+1, then the head's own predictions."""
    import torch

    from export.draft.eagle import EagleHead, HeadConfig

    torch.manual_seed(0)
    cfg = HeadConfig(32, 4, 2, 8, 48, 1e-5, 20)
    V, T = 50, 12
    emb = torch.randn(V, 32)
    pos = torch.arange(64)[:, None] * (1e-2 * torch.arange(1, 5))[None]
    head = EagleHead(cfg, emb, emb[:20], torch.cos(pos), sin=torch.sin(pos))
    for p in head.parameters():
        p.data += 0.1 * torch.randn_like(p)
    tokens = torch.randint(0, V, (1, T))
    feats = torch.randn(1, T - 1, 32)
    outs = head.unrolled(tokens, feats, depth)
    for j in range(depth - 1, T - 1):
        true_len = j - depth + 2  # positions 0 .. j-s+1 hold true features
        g, past = head.step(tokens[0, 1 : true_len + 1], feats[0, :true_len], None, 0)
        guess = g[-1:]
        for t in range(true_len, j + 1):
            g, past = head.step(tokens[0, t + 1 : t + 2], guess, past, t)
            guess = g
        if depth == 1:
            guess = head.step(tokens[0, 1 : j + 2], feats[0, : j + 1], None, 0)[0][-1:]
        assert torch.allclose(guess[0], outs[depth - 1][0, j], atol=1e-5), (depth, j)


def test_eagle_drafts_as_well_from_a_cached_prefix(trained, tiny_llama):
    """The head reads the target's hidden states of every position; with a prefix-cache hit the
    target does not compute the cached ones, so they must come from the cache with the KV: the
    same drafts (same acceptance) as without the cache, and the same output."""

    async def run(cache: bool):
        cfg = SpecConfig(measure_costs=False)
        async with await Engine.load(
            tiny_llama, draft=str(trained / "draft"), spec_config=cfg, prefix_cache=cache, slots=1
        ) as eng:
            out = []
            for prompt in (
                "The quick brown fox jumps over the lazy dog. " * 12,
                [{"role": "user", "content": "Write a Python function. " * 12}],
            ):  # > one block
                await eng.generate(prompt, max_new_tokens=8, mode="ar")  # leaves the prompt cached
                await anyio.sleep(0.3)  # idle: copied into an entry
                await eng.generate("Lorem ipsum dolor sit amet. " * 18, max_new_tokens=2, mode="ar")  # takes the slot
                r = await eng.generate(prompt, max_new_tokens=32)  # copies the entry (KV and hidden)
                out.append((r.token_ids, r.stats.accepted, r.stats.cached_prompt_tokens))
            return out

    plain, cached = anyio.run(run, False), anyio.run(run, True)
    assert [(ids, acc) for ids, acc, _ in cached] == [(ids, acc) for ids, acc, _ in plain]
    assert all(hit > 0 for _, _, hit in cached) and all(hit == 0 for _, _, hit in plain)


def test_eagle_greedy_drafts_follow_the_logit_bias_and_penalties(trained):
    """A greedy request with a logit bias drafts the biased argmax (the target's check takes it),
    from the head's vocabulary, not the raw argmax a ban would reject every round."""
    from specdec_rt.ort.eagle import EagleDrafter
    from specdec_rt.speculation.context import RequestContext

    drafter = EagleDrafter(trained / "draft", slots=1)
    logits = np.random.default_rng(0).normal(size=drafter.vocab.size).astype(np.float32)  # [V']
    raw = int(drafter.vocab[np.argmax(logits)])
    plain = RequestContext([1, 2], 4, SamplingParams())
    assert drafter._pick(logits, plain).id == raw
    banned = RequestContext([1, 2], 4, SamplingParams(logit_bias={raw: -100.0}))
    second = int(drafter.vocab[np.argsort(logits)[-2]])
    assert drafter._pick(logits, banned).id == second
    boosted = RequestContext([1, 2], 4, SamplingParams(logit_bias={int(drafter.vocab[0]): 100.0}))
    assert drafter._pick(logits, boosted).id == int(drafter.vocab[0])
    # a penalty counts this round's drafts so far, as the target's check will
    from specdec_rt.types import DraftToken

    gap = float(np.sort(logits)[-1] - np.sort(logits)[-2])
    penal = RequestContext([1, 2], 4, SamplingParams(presence_penalty=min(2.0, gap + 0.5)))
    if gap + 0.5 <= 2.0:
        assert drafter._pick(logits, penal, [DraftToken(raw)]).id == second
    assert drafter._pick(logits, penal).id == raw  # nothing generated yet: no penalty


def test_eagle_trees_are_lossless_and_the_head_reads_the_path_states(trained, tiny_llama):
    """A head tree (the head's runner-up tokens beside its chain, verified in one call): greedy
    output and log-probabilities equal plain decoding, and after tree rounds the hidden states
    the head reads are the target's own for the committed tokens (the accepted path's,
    compacted), as one forward over them computes."""
    from specdec_rt.ort import OrtModel
    from specdec_rt.ort.eagle import EagleDrafter
    from specdec_rt.speculation.adapters import TARGET_HIDDEN, ModelVerifier
    from specdec_rt.speculation.scheduler import SpecDecScheduler

    seen: list[tuple[np.ndarray, np.ndarray]] = []

    class Recording(EagleDrafter):
        async def generate_draft(self, ctx, k):
            feats = ctx.peek_state(TARGET_HIDDEN)
            if feats is not None:  # rows h_0 .. h_{n-2}: after each committed token but the last
                seen.append((ctx.tokens.copy(), feats.rows[: ctx.tokens.size - 1].copy()))
            return await super().generate_draft(ctx, k)

    target = OrtModel(tiny_llama, slots=2)
    assert target.caps.trees
    cfg = SpecConfig(
        k_init=3, tree_nodes=3, measure_costs=False, adapt_k=False, fallback_below=0.0, min_speedup=0.0
    )  # every round a tree
    sched = SpecDecScheduler(Recording(trained / "draft", slots=1), ModelVerifier(target, share_hidden=True), cfg)
    plain = SpecDecScheduler(None, ModelVerifier(target), SpecConfig(measure_costs=False))
    for prompt in ([5, 6, 7, 8, 9], [11, 3, 3, 40, 2, 17]):
        tree = anyio.run(lambda: sched.run(prompt, 32, SamplingParams()))
        ar = anyio.run(lambda: plain.run(prompt, 32, SamplingParams(), mode="ar"))
        assert tree.token_ids == ar.token_ids
        assert tree.stats.tree_nodes > 0 and tree.stats.accepted > 0
    assert len(seen) > 4

    async def engine_runs() -> None:  # the same through the Engine, log-probabilities too
        async with await Engine.load(tiny_llama, draft=str(trained / "draft"), spec_config=cfg) as eng:
            for prompt in PROMPTS:
                ar = await eng.generate(prompt, max_new_tokens=32, mode="ar", logprobs=2)
                spec = await eng.generate(prompt, max_new_tokens=32, logprobs=2)
                assert spec.token_ids == ar.token_ids, prompt
                assert np.allclose([t.logprob for t in spec.logprobs], [t.logprob for t in ar.logprobs], atol=1e-4)
                assert spec.stats.tree_nodes > 0

    anyio.run(engine_runs)

    async def states(tokens: np.ndarray) -> np.ndarray:
        s = target.start()
        try:
            _, hidden = await s.extend(tokens[:-1], 1, hidden=True)  # [n - 1, H]
            return np.asarray(hidden)
        finally:
            s.close()

    for tokens, rows in seen:
        assert np.allclose(rows, anyio.run(states, tokens), atol=1e-4), tokens.size


def test_reduced_vocabulary_weighs_the_answers_as_much_as_a_larger_corpus():
    """A corpus ten times the answers does not push the answers' own tokens out of V'."""
    from types import SimpleNamespace

    from export.draft.train import reduced_vocab

    def shard(tokens):
        ids = np.asarray(tokens, dtype=np.int64)
        return SimpleNamespace(tokens=ids, topk_ids=ids[:, None])

    answers = [shard([1, 2, 3] * 10)]  # 30 positions over 3 tokens
    corpus = [shard(list(range(10, 20)) * 30)]  # 300 positions, 10 tokens, each as frequent as an answer token
    pooled = reduced_vocab(answers + corpus, 6, [0])
    assert not {1, 2, 3} & set(pooled.tolist())  # pooled: each corpus token counts 60, an answer token 20
    weighed = reduced_vocab(answers, 6, [0], more=[corpus])
    assert {0, 1, 2, 3} <= set(weighed.tolist()) and weighed.size == 6
