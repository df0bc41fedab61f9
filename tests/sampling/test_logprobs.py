"""Log-probabilities of emitted tokens (``logprobs=n``): the target's own distribution at every
emitted position, the same whichever way the token was chosen (plain step, accepted draft,
recovered or bonus token, tree node), batched or alone, and checked where they come in."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from specdec_rt import (
    InvalidInputError,
    ModelDrafter,
    ModelVerifier,
    SamplingParams,
    SpecConfig,
    SpecDecScheduler,
    TargetVerifier,
)
from specdec_rt.errors import InferenceError
from specdec_rt.sampling.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, token_logprobs
from specdec_rt.testing import toy_pair
from specdec_rt.types import Verdict

ALWAYS = dict(measure_costs=False, adapt_k=False, fallback_below=0.0, zero_rounds=10**6, min_speedup=0.0)


def _log_softmax(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64)
    return row - row.max() - np.log(np.exp(row - row.max()).sum())


def test_token_logprobs_is_log_softmax_with_the_top_tokens_in_order():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 50)).astype(np.float32) * 4  # [3, V]
    logits[1, [7, 9]] = logits[1].max() + 1  # a tie at the top: the lower id first
    ids = np.array([4, 9, 49])
    out = token_logprobs(logits, ids, top=5)
    for i, t in enumerate(ids):
        ref = _log_softmax(logits[i])
        assert out[i].logprob == pytest.approx(ref[t], abs=1e-6)
        want = sorted(range(50), key=lambda j: (-ref[j], j))[:5]
        assert [j for j, _ in out[i].top] == want
        assert [lp for _, lp in out[i].top] == pytest.approx([ref[j] for j in want], abs=1e-6)
    assert [j for j, _ in out[1].top[:2]] == [7, 9]
    assert token_logprobs(logits, ids, top=0)[0].top == ()
    assert len(token_logprobs(logits, ids, top=50)[2].top) == 50  # the whole vocabulary


def _run(sched, prompt, n, top, **kw):
    return anyio.run(lambda: _collect(sched, prompt, n, top, **kw))


async def _collect(sched, prompt, n, top, **kw):
    ids, lps = [], []
    async for ev in sched.stream(prompt, n, logprobs=top, **kw):
        assert ev.logprobs is not None and len(ev.logprobs) == len(ev.token_ids)
        ids += ev.token_ids
        lps += ev.logprobs
    return ids, lps


def _expected(target, prompt, ids, top):
    rows = target.logits_at(np.array(list(prompt) + ids))[len(prompt) - 1 : -1]  # [n, V]: where each was chosen
    return token_logprobs(rows, np.array(ids), top)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, top_k=3, seed=5)])
@pytest.mark.parametrize("tree_nodes", [0, 2])
def test_every_emitted_token_carries_the_targets_logprob(params, tree_nodes):
    target, draft = toy_pair(16, seed=3, distance=0.3)  # close enough that drafts are accepted (and scored)
    prompt = [1, 5, 2]
    for mode in ("ar", "spec"):
        cfg = SpecConfig(k_init=4, tree_nodes=tree_nodes, **ALWAYS)
        sched = SpecDecScheduler(ModelDrafter(draft), ModelVerifier(target), cfg)
        ids, lps = _run(sched, prompt, 40, 3, params=params, mode=mode)
        assert len(ids) == 40
        want = _expected(target, prompt, ids, 3)
        assert [x.logprob for x in lps] == pytest.approx([x.logprob for x in want], abs=1e-6)
        assert [[j for j, _ in x.top] for x in lps] == [[j for j, _ in x.top] for x in want]
        if mode == "spec":
            assert sched.totals.accepted > 0  # accepted drafts were scored too
    # warping does not move them: the model's own distribution, not the sampled one
    assert all(x.logprob <= 0 for x in lps)


def test_logprobs_stop_with_the_tokens_at_a_stop_id_and_at_the_budget():
    target, draft = toy_pair(16, seed=1, distance=0.3)
    sched = SpecDecScheduler(ModelDrafter(draft), ModelVerifier(target), SpecConfig(k_init=6, **ALWAYS))
    ids, _ = _run(sched, [3, 4], 30, 0)
    stop = ids[7]
    ids2, lps2 = _run(sched, [3, 4], 30, 0, stop_ids=[stop])
    assert ids2 == ids[: ids.index(stop) + 1] and len(lps2) == len(ids2)
    ids3, lps3 = _run(sched, [3, 4], 5, 0)
    assert len(ids3) == len(lps3) == 5


def test_off_by_default_and_bad_values_are_refused_by_name():
    target, draft = toy_pair(8)
    sched = SpecDecScheduler(ModelDrafter(draft), ModelVerifier(target))

    async def events():
        return [ev async for ev in sched.stream([1, 2], 5)]

    assert all(ev.logprobs is None for ev in anyio.run(events))
    for bad in (-1, MAX_TOP_LOGPROBS + 1, 2.0, True, "3"):
        with pytest.raises(InvalidInputError, match="logprobs must be None or an integer"):
            sched.stream([1, 2], 5, logprobs=bad)


def test_a_verifier_that_cannot_report_them_is_named_and_one_that_drops_them_fails_the_request():
    target, draft = toy_pair(8)

    class Plain(TargetVerifier):  # a plug-in verifier: reports_logprobs left at its default (False)
        vocab_size = 8

        def __init__(self):
            self.inner = ModelVerifier(target)

        async def verify_and_accept(self, ctx, drafts):
            v = await self.inner.verify_and_accept(ctx, drafts)
            return Verdict(v.tokens, v.accepted, v.path)  # the log-probabilities dropped

        def release(self, ctx):
            self.inner.release(ctx)

    with pytest.raises(InvalidInputError, match=r"logprobs: this verifier \(Plain\) does not report"):
        SpecDecScheduler(ModelDrafter(draft), Plain()).stream([1, 2], 5, logprobs=0)
    Plain.reports_logprobs = True  # says it does, but does not
    sched = SpecDecScheduler(ModelDrafter(draft), Plain())
    with pytest.raises(InferenceError, match="verifier returned None log-probabilities for"):
        _run(sched, [1, 2], 5, 0)
    ids, _ = _run(SpecDecScheduler(ModelDrafter(draft), ModelVerifier(target)), [1, 2], 5, 0)
    assert len(ids) == 5  # nothing else broke


def test_batched_requests_report_what_each_would_alone():
    from specdec_rt.testing import toy_scheduler

    sched, target, _ = toy_scheduler(0.5, vocab_size=16, seed=2, batched=True, config=SpecConfig(**ALWAYS))
    prompts = [[1, 2], [3, 4, 5], [6], [7, 8, 9, 10]]

    async def all_at_once():
        out = [None] * len(prompts)

        async def one(i):
            out[i] = await _collect(sched, prompts[i], 20, 2, mode="spec" if i % 2 else "ar")

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        return out

    for prompt, (ids, lps) in zip(prompts, anyio.run(all_at_once)):
        want = _expected(target, prompt, ids, 2)
        assert [x.logprob for x in lps] == pytest.approx([x.logprob for x in want], abs=1e-6)
        assert all(isinstance(x, TokenLogprob) and len(x.top) == 2 for x in lps)


def test_large_ties_still_go_to_the_lowest_ids():
    flat = np.zeros((1, 1000), dtype=np.float32)  # [1, V]: every token tied
    assert [j for j, _ in token_logprobs(flat, np.array([3]), 5)[0].top] == [0, 1, 2, 3, 4]
    flat[0, 500] = 1.0
    assert [j for j, _ in token_logprobs(flat, np.array([3]), 3)[0].top] == [500, 0, 1]


def test_the_servers_format_names_partial_characters_and_counts_offsets_in_characters():
    from specdec_rt.serve.replies import LogprobsFormat

    pieces = {1: b"\xe2\x80", 2: b"\x99", 3: b"a", 4: b"\xe2", 5: b"<|im_end|>", 6: "é".encode()}
    fmt = LogprobsFormat("completion", pieces.__getitem__, 1, special=lambda t: t == 5)
    e = TokenLogprob  # the chosen token and its alternatives, some sharing no name
    ids = [1, 2, 3, 6, 5]
    entries = [
        e(-0.5, ((4, -0.1), (1, -0.5), (3, -2.0))),
        e(-0.2, ()),
        e(-float("inf"), ((3, -float("inf")),)),
        e(float("nan"), ()),
        e(-1.0, ()),
    ]
    body = fmt.body(ids[:2], entries[:2])  # two chunks: offsets go on across them
    body2 = fmt.body(ids[2:], entries[2:])
    assert body["tokens"] + body2["tokens"] == ["bytes:\\xe2\\x80", "bytes:\\x99", "a", "é", "<|im_end|>"]
    assert body["text_offset"] + body2["text_offset"] == [0, 0, 1, 2, 3]  # the text is "’aé"
    assert body["top_logprobs"][0] == {"bytes:\\xe2": -0.1, "bytes:\\xe2\\x80": -0.5, "a": -2.0}
    assert body2["token_logprobs"] == [-9999.0, -9999.0, -1.0]  # JSON has no -Infinity or NaN
    chat = LogprobsFormat("chat", pieces.__getitem__).body(ids[:1], entries[:1])["content"][0]
    assert chat["token"] == "bytes:\\xe2\\x80" and chat["bytes"] == [0xE2, 0x80]
    assert [t["bytes"] for t in chat["top_logprobs"]] == [[0xE2], [0xE2, 0x80], [0x61]]
