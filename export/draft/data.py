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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Shard", "load_shards", "save_shard", "generate_shards", "shard_path", "top_k"]

TOPK = 8

# one sequence: (tokens [T], prompt_len, feats [T-1, H], topk_ids [T-1, K], topk_p [T-1, K])
Sequence = tuple[npt.NDArray[np.int32], int, npt.NDArray[np.float16], npt.NDArray[np.int32], npt.NDArray[np.float16]]


@dataclass
class Shard:
    """Concatenated sequences. ``tokens`` [N] int32, ``starts`` [S+1] int64 offsets into tokens,
    ``prompt_lens`` [S]; per sequence s of T_s tokens, rows ``starts[s] - s .. starts[s+1] - s - 1``
    of ``feats`` [N-S, H] float16, ``topk_ids`` [N-S, K] int32, ``topk_p`` [N-S, K] float16."""

    tokens: npt.NDArray[np.int32]
    starts: npt.NDArray[np.int64]
    prompt_lens: npt.NDArray[np.int32]
    feats: npt.NDArray[np.float16]
    topk_ids: npt.NDArray[np.int32]
    topk_p: npt.NDArray[np.float16]

    def sequences(self) -> Iterator[Sequence]:
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
    out: list[Shard] = []
    for path in sorted(Path(data_dir).glob("shard-?????.npz")):  # not a half-written .tmp.npz
        with np.load(path) as z:
            out.append(Shard(**{k: z[k] for k in Shard.__dataclass_fields__}))
    return out


def top_k(logits: Any, k: int) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.float16]]:
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


Features = Callable[..., tuple[Any, Any]]  # (model, **forward inputs) -> (features, logits)


def _generate_batch(
    model: Any,
    prompts: list[list[int]],
    max_new: int,
    eos: set[int],
    *,
    topk: int,
    features: Features = last_hidden,
) -> Shard:
    """Greedy answers for one batch of prompt ids; features and top-k labels at every position.
    ``features(model, **inputs)`` returns ``(features [B, S, F], logits [B, S, V])`` of a forward
    (:func:`last_hidden`; an experiment may keep more, e.g. several layers)."""
    steps = _greedy(model, prompts, max_new, eos, topk=topk, features=features)
    return _shard_of(prompts, steps, eos)


@dataclass
class _Steps:
    """What a greedy run kept, one array per forward (concatenated along the sequence axis)."""

    feats: list[npt.NDArray[np.float16]] = field(default_factory=list)  # [B, S, F] each
    topk_ids: list[npt.NDArray[np.int32]] = field(default_factory=list)  # [B, S, K] each
    topk_p: list[npt.NDArray[np.float16]] = field(default_factory=list)  # [B, S, K] each
    generated: list[npt.NDArray[np.int64]] = field(default_factory=list)  # [B] per new token

    def keep(self, h: Any, logits: Any, topk: int) -> Any:
        """Store one forward's features and top-k labels; returns the greedy next tokens [B]."""
        self.feats.append(h.half().cpu().numpy())
        ids, probs = top_k(logits, topk)
        self.topk_ids.append(ids)
        self.topk_p.append(probs)
        return logits[:, -1].argmax(-1)


def _left_padded(prompts: list[list[int]], pad: int) -> tuple[Any, Any, Any]:
    """(input ids, attention mask, position ids), each [B, L], prompts aligned to the right."""
    import torch

    batch, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((batch, width), pad, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


def _greedy(
    model: Any, prompts: list[list[int]], max_new: int, eos: set[int], *, topk: int, features: Features
) -> _Steps:
    """Prefill the batch, then decode greedily until every row hit ``eos`` or ``max_new``."""
    import torch
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    ids, mask, pos = (t.to(dev) for t in _left_padded(prompts, next(iter(eos))))
    batch = ids.shape[0]
    cache = DynamicCache()
    steps = _Steps()
    with torch.inference_mode():
        feats, logits = features(
            model, input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True
        )  # [B, L, F], [B, L, V]
        nxt = steps.keep(feats, logits, topk)  # [B]
        done = torch.zeros(batch, dtype=torch.bool)
        last = pos[:, -1]
        for step in range(max_new):
            steps.generated.append(nxt.cpu().numpy().copy())
            done |= torch.tensor([int(t) in eos for t in nxt.tolist()])
            if bool(done.all()) or step == max_new - 1:
                break
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=torch.long, device=dev)], dim=1)
            last = last + 1
            feats, logits = features(
                model,
                input_ids=nxt[:, None],
                attention_mask=mask,
                position_ids=last[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            nxt = steps.keep(feats, logits, topk)
    return steps


def _shard_of(prompts: list[list[int]], steps: _Steps, eos: set[int]) -> Shard:
    """Cut each row at its first ``eos`` and pack the rows' positions 0..T-2 into one shard."""
    width = max(len(p) for p in prompts)
    feats = np.concatenate(steps.feats, axis=1)  # [B, L + steps, H]
    tk_ids, tk_p = np.concatenate(steps.topk_ids, axis=1), np.concatenate(steps.topk_p, axis=1)
    gen = np.stack(steps.generated, axis=1)  # [B, n]
    toks: list[int] = []
    starts, plens = [0], []
    rows_f, rows_ti, rows_tp = [], [], []
    for row, prompt in enumerate(prompts):
        ans = gen[row].tolist()
        stop = next((i + 1 for i, t in enumerate(ans) if t in eos), len(ans))
        seq = list(prompt) + ans[:stop]
        rows = slice(width - len(prompt), width - len(prompt) + len(seq) - 1)  # positions 0..T-2
        toks += seq
        starts.append(len(toks))
        plens.append(len(prompt))
        rows_f.append(feats[row, rows])
        rows_ti.append(tk_ids[row, rows])
        rows_tp.append(tk_p[row, rows])
    return Shard(
        tokens=np.array(toks, np.int32),
        starts=np.array(starts, np.int64),
        prompt_lens=np.array(plens, np.int32),
        feats=np.concatenate(rows_f),
        topk_ids=np.concatenate(rows_ti),
        topk_p=np.concatenate(rows_tp),
    )


def generate_shards(
    model: Any,
    prompt_ids: list[list[int]],
    data_dir: Path,
    *,
    batch: int,
    max_new: int,
    eos: set[int],
    tokens_goal: int,
    deadline: float | None,
    log: Callable[[str], None],
) -> int:
    """Write shards until ``tokens_goal`` answer tokens exist, the prompts run out, or the
    ``deadline`` (time.monotonic) passes. Returns the answer tokens on disk. Resumable."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    have = sum(s.answer_tokens for s in load_shards(data_dir))
    n_batches = (len(prompt_ids) + batch - 1) // batch
    t0, cpu0, made, shards_made = time.monotonic(), time.process_time(), 0, 0
    for i in range(n_batches):
        path = shard_path(data_dir, i)
        if path.exists():
            continue
        if have >= tokens_goal:
            break
        if deadline is not None and time.monotonic() > deadline:
            log("data: time budget reached")
            break
        shard = _generate_batch(model, prompt_ids[i * batch : (i + 1) * batch], max_new, eos, topk=TOPK)
        save_shard(path, shard)
        have += shard.answer_tokens
        made, shards_made = made + shard.answer_tokens, shards_made + 1
        elapsed = time.monotonic() - t0
        rate = made / elapsed
        shards_left = sum(not shard_path(data_dir, j).exists() for j in range(i + 1, n_batches))
        eta = min((tokens_goal - have) / rate if rate else float("inf"), shards_left * elapsed / shards_made)
        goal = "all prompts" if tokens_goal >= 10**12 else f"{tokens_goal:,}"
        log(
            f"data: shard {i + 1}/{n_batches}, {have:,}/{goal} answer tokens, "
            f"{rate:.0f} tok/s ({made / max(time.process_time() - cpu0, 1e-9):.0f} per CPU-second), "
            f"ETA {eta / 60:.1f} min"
        )
    return have
