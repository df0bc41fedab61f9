"""Does the draft know when it is about to be wrong? Draft confidence against agreement with
the target, and what stopping a chain at low confidence would buy (offline, greedy).

    python scripts/experiments/draft_confidence.py qwen2.5-coder-1.5b 0.5b-q4 \
        --prompts specdec_rt/tooling/data/code_general.jsonl --d 0.1 --s 0.05 --jump 0
    python scripts/experiments/draft_confidence.py smollm2-135m q8 \
        --prompts specdec_rt/tooling/data/chat_general.jsonl --d 0.55 --s 0.085 --jump 0.1

1. The target answers each prompt greedily (``--max-new-tokens``); the draft then reads the
   prompt and the answer in one call (teacher-forced), which gives, at every answer position,
   the draft's argmax, its probability c (the confidence) and its logit gap to the runner-up.
   Greedy acceptance stops at the first disagreement, so a chain's accepted prefix is exactly
   what teacher forcing sees.
2. Agreement by confidence bucket and by logit-gap bucket.
3. Rounds replayed along each answer: a round drafts up to ``k`` tokens and, with a floor tau,
   stops after the token whose cumulative confidence c_1 ... c_i falls below tau; it yields its
   accepted drafts + 1 and costs ``1 + jump + s * k' + d * k'`` target steps for k' drafts
   (docs/architecture.md's cost model; ``--d``, ``--s``, ``--jump`` as measured by ``bench``
   and scripts/experiments/verify_cost.py). Printed: tokens per target-step unit, per k and tau.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from specdec_rt.engine.loading import ensure_built
from specdec_rt.ort.manifest import load_manifest
from specdec_rt.ort.model import OrtModel
from specdec_rt.text.codec import TextCodec


def teacher_forced(target: OrtModel, draft: OrtModel, codec, eos, *, messages, n_new: int):
    """(confidence [n], logit gap [n], agrees [n]) of the draft at the target's greedy answer."""
    ids = np.array(codec.encode_prompt(messages), dtype=np.int64)
    s = target.start()
    logits, out = s.run_sync(ids, 1, 0), []
    for _ in range(n_new):
        out.append(int(np.argmax(logits[-1])))
        if out[-1] in eos:
            break
        logits = s.run_sync(np.array(out[-1:], np.int64), 1, s.length)
    s.close()
    full = np.concatenate([ids, np.array(out, np.int64)])
    d = draft.start()
    dl = d.run_sync(full[:-1], len(out), 0)  # [n, V]: the draft's logits for each answer token
    d.close()
    q = np.exp(dl - dl.max(-1, keepdims=True))
    q /= q.sum(-1, keepdims=True)
    top2 = np.sort(dl, -1)[:, -2:]
    return q.max(-1), top2[:, 1] - top2[:, 0], q.argmax(-1) == np.array(out)


def replay(conf, agree, k: int, tau: float, *, d: float, s: float, jump: float) -> float:
    """Tokens per target-step unit of rounds with at most k drafts and the floor tau."""
    tokens = cost = 0.0
    for c, a in zip(conf, agree):
        j = 0
        while j < len(a):
            reach, n = 1.0, 0
            while n < k and j + n < len(a):
                reach *= c[j + n]
                n += 1
                if reach < tau:
                    break
            acc = 0
            while acc < n and a[j + acc]:
                acc += 1
            tokens += acc + 1
            cost += (1 + jump + s * n if n else 1.0) + d * n
            j += acc + 1
    return tokens / cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("draft", help="a draft name from the model's manifest")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--d", type=float, required=True, help="a draft step, in target steps")
    ap.add_argument("--s", type=float, required=True, help="one more verified position, in target steps")
    ap.add_argument("--jump", type=float, default=0.0, help="a verify's fixed extra cost, in target steps")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    folder = ensure_built(a.model)
    m = load_manifest(folder)
    path = next(x["path"] for x in m.raw.get("drafts", []) if x["name"] == a.draft)
    target = OrtModel(folder, max_length=1024, threads=a.threads)
    draft = OrtModel(m.path(path, "drafts.path"), max_length=1024, threads=a.threads)
    codec, eos = TextCodec.from_manifest(m), set(m.eos_ids)
    rows = [json.loads(x) for x in open(a.prompts) if x.strip()]
    conf, gap, agree = zip(*(teacher_forced(target, draft, codec, eos, messages=r["messages"], n_new=a.max_new_tokens)
                             for r in rows))
    c, g, y = np.concatenate(conf), np.concatenate(gap), np.concatenate(agree)
    print(f"{len(rows)} answers, {y.size} positions, draft agrees with the target on {y.mean():.3f}")
    for name, v, edges in (("confidence", c, (0, .3, .5, .7, .9, .97, 1.01)),
                           ("logit gap", g, (0, .05, .1, .2, .5, 1, np.inf))):
        for lo, hi in zip(edges, edges[1:]):
            sel = (v >= lo) & (v < hi)
            print(f"{name} [{lo:g}, {hi:g}): {sel.sum():4d} positions, agreement "
                  f"{y[sel].mean() if sel.any() else float('nan'):.3f}")
    taus = (0, .1, .2, .3, .4, .5, .7)
    print("tokens per target-step unit; k = most drafts a round, tau = the confidence floor")
    print("k   " + " ".join(f"tau={t:<4g}" for t in taus))
    for k in (4, 6, 8, 12):
        print(f"{k:<3} " + " ".join(f"{replay(conf, agree, k, t, d=a.d, s=a.s, jump=a.jump):8.3f}" for t in taus))


if __name__ == "__main__":
    main()
