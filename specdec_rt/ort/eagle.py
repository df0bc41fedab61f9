"""EAGLE-style drafting: a one-layer head that reads the target's own hidden states.

Notation: h_j is the target's normalised last hidden state after token x_j (the verifier shares
it, see :class:`~specdec_rt.speculation.adapters.TargetHidden`); the head at position j reads
``(x_{j+1}, h_j)`` and returns ``g_j`` (its guess of h_{j+1}) and logits over a reduced
vocabulary V' for x_{j+2}. Drafting continues from its own guesses: ``(d_1, g)``, ``(d_2, g')``...

The head's KV cache holds only positions computed from true features (``true_len`` of them);
drafted positions are rolled back at the next call (a length change), and the positions that
the target has since verified are fed once, in one call. The first round of a request has no
target features yet, so it drafts nothing (that round is the target's prefill anyway).
Draft ids map back to the target's ids through ``vocab`` [V'] exactly; in sampling mode the
draft's q is zero outside V', which rejection sampling handles (those tokens are never proposed).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from ..errors import ModelLoadError
from ..sampling import greedy_ids, sample, warp
from ..speculation.adapters import SIBLING_RANKS, TARGET_HIDDEN, softmax, with_siblings
from ..speculation.context import RequestContext
from ..speculation.protocols import DraftInferrer
from ..types import DraftToken
from .manifest import LIMITS, Manifest
from .model import OrtModel

__all__ = ["EagleDrafter", "load_vocab_map"]


def load_vocab_map(m: Manifest) -> tuple[np.ndarray, int]:
    """``(vocab [V'] int64, target_vocab_size)`` of an EAGLE draft folder, checked.

    The file is untrusted: it must lie inside the folder, and its ``.npy`` header (read first,
    without loading anything) must describe a 1-D integer array of exactly ``vocab_size``
    entries; no pickles, no npz, no floats, no header that claims more than it holds."""
    info = m.raw.get("draft_vocab") or {}
    if not isinstance(info, dict):
        raise ModelLoadError(f"{m.folder / 'manifest.json'}: draft_vocab must be an object")
    path = m.path(info.get("file", "vocab.npy"), "draft_vocab.file")
    full = info.get("target_vocab_size", 0)
    if type(full) is not int or not 0 < full <= LIMITS["vocab_size"][1]:
        raise ModelLoadError(
            f"{m.folder / 'manifest.json'}: draft_vocab.target_vocab_size must be "
            f"an integer from 1 to {LIMITS['vocab_size'][1]}, got {full!r}"
        )
    fmt = np.lib.format
    try:
        with open(path, "rb") as f:
            version = fmt.read_magic(f)
            if version not in ((1, 0), (2, 0), (3, 0)):
                raise ValueError(f"unsupported .npy version {version}")
            read_header = {(1, 0): fmt.read_array_header_1_0}.get(version, fmt.read_array_header_2_0)
            shape, fortran, dtype = read_header(f)
            if dtype.kind not in "iu" or dtype.hasobject or len(shape) != 1 or shape[0] != m.vocab_size:
                raise ValueError(f"holds {dtype} {list(shape)}, expected an integer array [{m.vocab_size}]")
            f.seek(0)
            vocab = np.asarray(fmt.read_array(f, allow_pickle=False)).astype(np.int64)
    except (OSError, ValueError, EOFError) as exc:
        raise ModelLoadError(f"{path}: cannot read the draft vocabulary map ({exc})") from exc
    if (
        vocab.ndim != 1
        or vocab.size != m.vocab_size
        or vocab.size == 0
        or np.any(np.diff(vocab) <= 0)
        or vocab[0] < 0
        or vocab[-1] >= full
    ):
        raise ModelLoadError(f"{path}: must hold {m.vocab_size} sorted distinct ids below target_vocab_size={full}")
    return vocab, full


class _HeadState:
    def __init__(self, session: Any) -> None:
        self.session = session
        self.true_len = 0  # head positions computed from committed tokens and true features


class EagleDrafter(DraftInferrer):
    """Drafts with an EAGLE head folder from ``python -m export train-draft``.

    The target's verifier must share its hidden states (``share_hidden=True``; the Engine sets
    it because this class sets ``needs_target_hidden``).
    """

    needs_target_hidden = True

    def __init__(self, model: OrtModel | str | os.PathLike[str] | Manifest, **options: Any) -> None:
        if not isinstance(model, OrtModel):
            model = OrtModel(model, **options)
        if model.manifest.raw.get("kind") != "eagle" or not model.manifest.inputs.get("features"):
            raise ModelLoadError(
                f"{model.manifest.folder}: not an EAGLE draft head (kind 'eagle' with a features input)"
            )
        self.model = model
        self.vocab, self.target_vocab_size = load_vocab_map(model.manifest)
        self.max_length = model.max_length
        self.name = model.name

    async def generate_draft(self, ctx: RequestContext, k: int) -> Sequence[DraftToken]:
        feats = ctx.peek_state(TARGET_HIDDEN)
        n = ctx.tokens.size  # committed tokens x_0 .. x_{n-1}; the target has read all but the last
        st = ctx.state(self, lambda: _HeadState(self.model.start()))
        if feats is None or k <= 0 or st.true_len >= n - 1:
            return []  # first round (no target features yet), or nothing new to read
        s = st.session
        s.rollback(st.true_len)  # forget the drafted positions of the last round
        ids = ctx.tokens[st.true_len + 1 : n]  # [S] x_{j+1}
        h = feats.rows[st.true_len : n - 1]  # [S, H] h_j, true features
        logits, g = await s.extend(ids, 1, features=h, hidden=True)  # [1, V'], [S, H]
        st.true_len = n - 1
        drafts: list[DraftToken] = []
        nodes = ctx.plan.tree_nodes
        candidates: list[tuple[float, int, int]] = []  # (head probability of reaching the node, depth, id)
        reach = 1.0  # head probability of the chain so far
        while True:
            drafts.append(self._pick(logits[0], ctx, drafts))
            if nodes:
                reach = self._siblings(logits[0], drafts[-1].id, depth=len(drafts) - 1, reach=reach, into=candidates)
            if len(drafts) == k:
                break
            x = np.array([drafts[-1].id], dtype=np.int64)
            logits, g = await s.extend(x, 1, features=g[-1:], hidden=True)  # its own guess of h
        return with_siblings(drafts, candidates, nodes)

    def _siblings(
        self, logits: np.ndarray, chain_id: int, *, depth: int, reach: float, into: list[tuple[float, int, int]]
    ) -> float:
        """The head's ``SIBLING_RANKS`` best alternatives to the chain's token at ``depth``, scored
        by the head's probability of reaching them (EAGLE-2's rule), appended to ``into``.
        Returns the chain's reach one level deeper. logits [V']."""
        q = softmax(logits)  # [V']
        ranks = min(SIBLING_RANKS + 1, q.size)
        best = np.argpartition(q, -ranks)[-ranks:]  # [ranks] in V'
        into += [(reach * float(q[j]), depth, int(self.vocab[j])) for j in best if self.vocab[j] != chain_id]
        at = np.searchsorted(self.vocab, chain_id)  # the chain's token in V' (absent: penalties moved it)
        inside = at < self.vocab.size and self.vocab[at] == chain_id
        return reach * float(q[at]) if inside else 0.0

    def _pick(self, logits: np.ndarray, ctx: RequestContext, drafts: Sequence[DraftToken] = ()) -> DraftToken:
        """logits [V'] -> a draft token with a full-vocabulary id (and q when sampling), after
        ``drafts`` (this round's so far: the penalties count them, as the target's check will)."""
        p = ctx.params
        if p.greedy and not p.logit_bias and not p.penalized:
            return DraftToken(int(self.vocab[int(greedy_ids(logits))]))
        full = np.full(self.target_vocab_size, -np.inf, dtype=np.float32)  # [V]
        full[self.vocab] = logits
        if p.penalized:
            full = ctx.penalized(full[None], [[d.id for d in drafts]])[0]
        q = warp(full, ctx.params)  # [V], zero outside V' (biased as the target will be)
        if ctx.params.greedy:  # a logit bias: the argmax the target's check will take
            return DraftToken(int(np.argmax(q)))
        return DraftToken(sample(q, ctx.rng), q)

    def release(self, ctx: RequestContext) -> None:
        st = ctx.pop_state(self)
        if st is not None:
            st.session.close()
