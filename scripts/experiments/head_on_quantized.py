"""Acceptance of one trained EAGLE head on the float32 target and on its quantized copies.

    python scripts/experiments/head_on_quantized.py DRAFT_DIR TARGET_DIR [TARGET_DIR ...] \
        [--prompts specdec_rt/tooling/data/chat_heldout.jsonl] [--max-new 96] [--k 4] [--out FILE]

Every target runs the same prompts greedily with the head at a fixed draft length ``k`` (no
fallback) through the runtime, and plain greedy decoding of the same target checks that the
output is unchanged. Prints and writes (``--out``) acceptance per depth and mean accepted per
round for each target. Used for "A head on quantized targets" in docs/train-draft.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from export.draft.evaluate import Prompt, measure_acceptance


def read_prompts(path: Path) -> list[Prompt]:
    """The chat messages of a bench prompt file (one JSON object a line)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row["messages"] for row in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("draft", type=Path)
    ap.add_argument("targets", type=Path, nargs="+")
    ap.add_argument("--prompts", type=Path, default=Path("specdec_rt/tooling/data/chat_heldout.jsonl"))
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    prompts = read_prompts(args.prompts)
    results: list[dict[str, Any]] = []
    for target in args.targets:
        start = time.monotonic()
        acc = measure_acceptance(
            target.expanduser(),
            args.draft.expanduser(),
            prompts,
            k=args.k,
            max_new_tokens=args.max_new,
            threads=args.threads,
        )
        row = {
            "target": str(target),
            "draft": str(args.draft),
            "prompt_file": str(args.prompts),
            "max_new_tokens": args.max_new,
            **acc,
            "seconds": round(time.monotonic() - start, 1),
        }
        print(json.dumps(row), flush=True)
        results.append(row)
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
