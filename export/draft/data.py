"""Self-distillation data: the target answers training prompts (greedy), and every position's
normalised last hidden state and top-k next-token distribution are kept.

Notation: at position j the target reads x_j and gives its feature h_j (the final-norm output,
the LM head's input) and P_j = softmax(logits_j), the distribution of x_{j+1}. A sequence of T
tokens stores h_0..h_{T-2} and P_0..P_{T-2} (the last token is never fed).

Batched greedy generation with left padding writes one shard per batch
(``data/shard-00012.npz``); a run that is stopped resumes at the first missing shard, because the
prompt order is fixed by the seed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Shard", "load_shards", "save_shard", "generate_shards", "shard_path", "top_k"]

TOPK = 8


@dataclass
class Shard:
    """Concatenated sequences. ``tokens`` [N] int32, ``starts`` [S+1] int64 offsets into tokens,
    ``prompt_lens`` [S]; per sequence s of T_s tokens, rows ``starts[s] - s .. starts[s+1] - s - 1``
    of ``feats`` [N-S, H] float16, ``topk_ids`` [N-S, K] int32, ``topk_p`` [N-S, K] float16."""

    tokens: np.ndarray
    starts: np.ndarray
    prompt_lens: np.ndarray
    feats: np.ndarray
    topk_ids: np.ndarray
    topk_p: np.ndarray

    def sequences(self):
        """(tokens [T], prompt_len, feats [T-1, H], topk_ids [T-1, K], topk_p [T-1, K])."""
        for s in range(len(self.prompt_lens)):
            a, b = int(self.starts[s]), int(self.starts[s + 1])
            yield (
                self.tokens[a:b],
                int(self.prompt_lens[s]),
                self.feats[a - s : b - s - 1],
                self.topk_ids[a - s : b - s - 1],
                self.topk_p[a - s : b - s - 1],
            )

    @property
    def answer_tokens(self) -> int:
        return int(self.tokens.size - self.prompt_lens.sum())


def shard_path(data_dir: Path, index: int) -> Path:
    return Path(data_dir) / f"shard-{index:05d}.npz"


def save_shard(path: Path, shard: Shard) -> None:
    """Write ``shard`` to ``path`` atomically (a half-written file never has the final name)."""
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **{k: getattr(shard, k) for k in Shard.__dataclass_fields__})
    tmp.rename(path)


def load_shards(data_dir: Path) -> list[Shard]:
    out = []
    for path in sorted(Path(data_dir).glob("shard-?????.npz")):  # not a half-written .tmp.npz
        with np.load(path) as z:
            out.append(Shard(**{k: z[k] for k in Shard.__dataclass_fields__}))
    return out


def top_k(logits, k: int):
    """logits [..., V] torch -> (ids int32 [..., k], probs float16 [..., k]) of softmax(logits)."""
    import torch

    p = torch.softmax(logits.float(), dim=-1)
    vals, ids = torch.topk(p, k, dim=-1)
    return ids.to(torch.int32).cpu().numpy(), vals.to(torch.float16).cpu().numpy()


def last_hidden(model: Any, **inputs: Any) -> tuple[Any, Any]:
    """The features the shipped head reads: (h [B, S, H], the normalised last hidden state;
    logits [B, S, V])."""
    h = model.model(**inputs).last_hidden_state
    return h, model.lm_head(h)


def _generate_batch(
    model, prompts: list[list[int]], max_new: int, eos: set[int], topk: int, features=last_hidden
) -> Shard:
    """Greedy answers for one batch of prompt ids; features and top-k labels at every position.
    ``features(model, **inputs)`` returns ``(features [B, S, F], logits [B, S, V])`` of a forward
    (:func:`last_hidden`; an experiment may keep more, e.g. several layers)."""
    import torch
    from transformers import DynamicCache

    B, L = len(prompts), max(len(p) for p in prompts)
    pad = next(iter(eos))
    ids = torch.full((B, L), pad, dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, L - len(p) :] = torch.tensor(p)
        mask[b, L - len(p) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    dev = next(model.parameters()).device
    ids, mask, pos = ids.to(dev), mask.to(dev), pos.to(dev)
    cache = DynamicCache()
    feats, tk_ids, tk_p, gen = [], [], [], []
    with torch.inference_mode():
        h, logits = features(
            model, input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True
        )  # [B, L, F], [B, L, V]
        feats.append(h.half().cpu().numpy())
        a, b = top_k(logits, topk)
        tk_ids.append(a), tk_p.append(b)
        nxt = logits[:, -1].argmax(-1)  # [B]
        done = torch.zeros(B, dtype=torch.bool)
        last = pos[:, -1]
        for step in range(max_new):
            gen.append(nxt.cpu().numpy().copy())
            done |= torch.tensor([int(t) in eos for t in nxt.tolist()])
            if bool(done.all()) or step == max_new - 1:
                break
            mask = torch.cat([mask, torch.ones((B, 1), dtype=torch.long, device=dev)], dim=1)
            last = last + 1
            h, logits = features(
                model,
                input_ids=nxt[:, None],
                attention_mask=mask,
                position_ids=last[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            feats.append(h.half().cpu().numpy())
            a, b = top_k(logits, topk)
            tk_ids.append(a), tk_p.append(b)
            nxt = logits[:, -1].argmax(-1)
    feats = np.concatenate(feats, axis=1)  # [B, L + steps, H]
    tk_ids, tk_p = np.concatenate(tk_ids, axis=1), np.concatenate(tk_p, axis=1)
    gen = np.stack(gen, axis=1)  # [B, n]
    toks, starts, plens, f, ti, tp = [], [0], [], [], [], []
    for b, p in enumerate(prompts):
        ans = gen[b].tolist()
        stop = next((i + 1 for i, t in enumerate(ans) if t in eos), len(ans))
        seq = list(p) + ans[:stop]
        rows = slice(L - len(p), L - len(p) + len(seq) - 1)  # positions 0..T-2 of this sequence
        toks += seq
        starts.append(len(toks))
        plens.append(len(p))
        f.append(feats[b, rows]), ti.append(tk_ids[b, rows]), tp.append(tk_p[b, rows])
    return Shard(
        tokens=np.array(toks, np.int32),
        starts=np.array(starts, np.int64),
        prompt_lens=np.array(plens, np.int32),
        feats=np.concatenate(f),
        topk_ids=np.concatenate(ti),
        topk_p=np.concatenate(tp),
    )


def generate_shards(
    model,
    prompt_ids: list[list[int]],
    data_dir: Path,
    *,
    batch: int,
    max_new: int,
    eos: set[int],
    tokens_goal: int,
    deadline: float | None,
    log,
) -> int:
    """Write shards until ``tokens_goal`` answer tokens exist, the prompts run out, or the
    ``deadline`` (time.monotonic) passes. Returns the answer tokens on disk. Resumable."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    have = sum(s.answer_tokens for s in load_shards(data_dir))
    n_batches = (len(prompt_ids) + batch - 1) // batch
    t0, cpu0, made = time.monotonic(), time.process_time(), 0
    for i in range(n_batches):
        path = shard_path(data_dir, i)
        if path.exists():
            continue
        if have >= tokens_goal:
            break
        if deadline is not None and time.monotonic() > deadline:
            log("data: time budget reached")
            break
        shard = _generate_batch(model, prompt_ids[i * batch : (i + 1) * batch], max_new, eos, TOPK)
        save_shard(path, shard)
        have += shard.answer_tokens
        made += shard.answer_tokens
        rate = made / (time.monotonic() - t0)
        eta = (tokens_goal - have) / rate if rate else float("inf")
        log(
            f"data: shard {i + 1}/{n_batches}, {have:,}/{tokens_goal:,} answer tokens, "
            f"{rate:.0f} tok/s ({made / max(time.process_time() - cpu0, 1e-9):.0f} per CPU-second), "
            f"ETA {eta / 60:.1f} min"
        )
    return have
