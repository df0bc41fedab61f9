"""Could an n-gram table built from the target's own answers be a free draft on chat?

    python scripts/experiments/static_ngram.py smollm2-135m --precision int8

Prompt lookup (``NgramDrafter``) proposes only what the context already holds: on chat its
acceptance is 2-4%. A *static* table (llama.cpp's ``--lookup-cache-static``) is built once from
a corpus; here the corpus is the target's own greedy answers to the shipped general prompts
(``prompts.jsonl``, ``chat_general.jsonl``, ``code_general.jsonl``), and it is scored on the
held-out ones (``chat_heldout.jsonl``, ``code_heldout.jsonl``), which it never saw.

1. The target (``Engine``, plain decoding, the precision asked) answers every prompt greedily.
2. Tables of the next token after the last 1..``--n-max`` tokens (counts), longest match first.
3. For each held-out answer, replayed as speculation would see it: at each position propose up
   to ``k`` tokens while the table's top token holds at least ``conf`` of its context's count,
   accept the prefix the target's answer agrees with, advance by accepted + 1. The cost of a call
   over n positions is ``--costs`` (relative to one position; measure them with
   ``scripts/experiments/verify_cost.py``). Prints tokens per step-equivalent: the speed-up over
   plain decoding a free draft with that table would give at best (no scheduler overhead).
   ``dynamic``: the table also learns each held-out answer after it (a server's cache over
   requests).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
from importlib import resources

import numpy as np

from specdec_rt import Engine

BUILD = ("prompts.jsonl", "chat_general.jsonl", "code_general.jsonl")
HELD_OUT = ("chat_heldout.jsonl", "code_heldout.jsonl")

Table = list[dict[tuple[int, ...], collections.Counter]]  # [n] context of n tokens -> next-token counts


def _prompts(files: tuple[str, ...]) -> list:
    data = resources.files("specdec_rt.tooling").joinpath("data")
    return [json.loads(line)["messages"] for f in files for line in data.joinpath(f).read_text().splitlines()]


async def _answers(model: str, precision: str, prompts: list, tokens: int) -> list[list[int]]:
    engine = await Engine.load(model, draft="none", precision=precision)
    out = []
    for i, p in enumerate(prompts):
        out.append((await engine.generate(p, max_new_tokens=tokens, mode="ar")).token_ids)
        print(f"[static-ngram] answered {i + 1}/{len(prompts)}", flush=True)
    return out


def _learn(table: Table, seq: list[int], n_max: int) -> None:
    for i in range(1, len(seq)):
        for n in range(1, min(n_max, i) + 1):
            table[n].setdefault(tuple(seq[i - n : i]), collections.Counter())[seq[i]] += 1


def _propose(table: Table, ctx: list[int], n_max: int, conf: float) -> int | None:
    for n in range(min(n_max, len(ctx)), 0, -1):
        counts = table[n].get(tuple(ctx[-n:]))
        if counts:  # the longest context seen decides
            token, count = counts.most_common(1)[0]
            return token if count / sum(counts.values()) >= conf else None
    return None


def replay(
    build: list[list[int]], held: list[list[int]], n_max: int, k: int, *, conf: float, costs: list[float], dynamic: bool
) -> float:
    """Tokens per step-equivalent over the held-out answers (see the module docstring)."""
    table: Table = [{} for _ in range(n_max + 1)]
    for seq in build:
        _learn(table, seq, n_max)
    tokens = cost = 0.0
    for seq in held:
        i = 1
        while i < len(seq):
            proposal: list[int] = []
            while len(proposal) < k:
                token = _propose(table, seq[:i] + proposal, n_max, conf)
                if token is None:
                    break
                proposal.append(token)
            accepted = 0
            for j, token in enumerate(proposal):
                if i + j >= len(seq) or seq[i + j] != token:
                    break
                accepted += 1
            tokens += accepted + 1
            cost += costs[len(proposal)]
            i += accepted + 1
        if dynamic:
            _learn(table, seq, n_max)
    return tokens / cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--precision", default="int8")
    ap.add_argument("--tokens", type=int, default=192, help="answer tokens per build prompt (held out: 128)")
    ap.add_argument("--n-max", type=int, default=3)
    ap.add_argument("--costs", default="1.0,1.10,1.23,1.35,1.52", help="cost of a call over 1, 2, ... positions (vs 1)")
    a = ap.parse_args()
    costs = [float(x) for x in a.costs.split(",")]
    build = asyncio.run(_answers(a.model, a.precision, _prompts(BUILD), a.tokens))
    held = asyncio.run(_answers(a.model, a.precision, _prompts(HELD_OUT), 128))
    print(f"corpus {sum(map(len, build))} answer tokens; held out {sum(map(len, held))}")
    print("dynamic conf " + " ".join(f"{'k=' + str(k):>6}" for k in range(1, len(costs))))
    for dynamic in (False, True):
        for conf in (0.0, 0.3, 0.5, 0.7):
            row = [replay(build, held, a.n_max, k, conf=conf, costs=costs, dynamic=dynamic) for k in range(1, len(costs))]
            print(f"{dynamic!s:>7} {conf:4.1f} " + " ".join(f"{x:6.3f}" for x in row))
    table: Table = [{} for _ in range(a.n_max + 1)]
    for seq in build:
        _learn(table, seq, a.n_max)
    hits = [_propose(table, seq[:i], a.n_max, 0.0) == seq[i] for seq in held for i in range(1, len(seq))]
    print(f"top-1 agreement of the table with the target's next token: {np.mean(hits):.3f}")


if __name__ == "__main__":
    main()
