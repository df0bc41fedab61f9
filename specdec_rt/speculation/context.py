"""One request's committed state, shared by the scheduler, its drafter and its verifier."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterable, TypeVar

import numpy as np

from ..checks import brief_repr, check_int, positional_keywords
from ..errors import ContextLengthError, InvalidInputError
from ..policy.confidence import ChainStop
from ..sampling import SamplingParams
from ..sampling.constraints import GRAMMAR_THREADS, Constraint, constrained, masked, masks_of
from ..sampling.logprobs import check_top_logprobs
from ..sampling.penalties import penalized
from ..types import FinishReason, Stats

__all__ = ["DraftPlan", "RequestContext", "Scorer", "Scoring"]

S = TypeVar("S")

#: what :meth:`RequestContext.scoring` yields: the model's rows ``[n, V]`` in, the request's scores out
Scorer = Callable[[np.ndarray], Awaitable[np.ndarray]]


@dataclass
class DraftPlan:
    """What the scheduler asks of the drafter in one round (set as ``ctx.plan`` before its
    ``generate_draft``), and what a model drafter reports back about its steps."""

    #: nodes the drafter may add beside its chain (a draft tree; 0: a chain)
    tree_nodes: int = 0
    #: where a model drafter should stop its chain (confidence.py), or None
    chain_stop: ChainStop | None = None
    #: propose only what costs nothing to draft (n-gram matches): the request shares a batch,
    #: or the draft model sits it out (see RequestPolicy)
    cheap_drafts: bool = False
    #: the draft model's single-token steps after its first call, and their seconds (set by model
    #: drafters that time them; the first call may read a prompt or what the draft missed, so only
    #: these measure a draft step alone)
    draft_steps: tuple[int, float] = (0, 0.0)


class RequestContext:
    """One request's state: what it has committed so far, and per-model state.

    ``tokens`` is the whole sequence (prompt + generated tokens that are final); only
    :meth:`commit` appends to it, after a verification completed, so a cancelled round leaves it
    as it was. Models keep their per-request state (KV cache sessions) in :meth:`state`, keyed by
    the model object, and must tolerate caches that ran ahead of ``tokens``.

    Args:
        prompt_ids: The prompt's token ids.
        max_new_tokens: Tokens the request may generate.
        params: Sampling parameters (default: ``SamplingParams()``, greedy).
        stop_ids: Ids that end the request (the id itself is kept).
        *legacy: The keywords below by position, in their order (deprecated: a
            ``DeprecationWarning`` names them).
        max_length: The models' longest sequence (``None``: no limit).
        rng: The sampling generator (default: seeded with ``params.seed``).
        vocab_size: The models' vocabulary (``None``: ids are not checked against it).
        logprobs: ``None``: no log-probabilities; ``n``: each emitted token's, with the
            ``n`` most likely alternatives.
        constraint: Which tokens may come next (a response format), or ``None``.

    Raises:
        InvalidInputError: An empty prompt, an id that is negative or outside the
            vocabulary, a bad ``max_new_tokens``, ``logprobs`` or ``logit_bias`` id, an
            option given both by position and by keyword, or too many positional arguments.
        ContextLengthError: The prompt plus ``max_new_tokens`` exceeds ``max_length``.
    """

    def __init__(
        self,
        prompt_ids: Iterable[int],
        max_new_tokens: int,
        params: SamplingParams | None = None,
        stop_ids: Iterable[int] = (),
        *legacy: Any,
        max_length: int | None = None,
        rng: np.random.Generator | None = None,
        vocab_size: int | None = None,
        logprobs: int | None = None,
        constraint: Constraint | None = None,
    ) -> None:
        """A request's context, its arguments checked."""
        if legacy:  # the form before the keywords: max_length, rng, vocab_size, logprobs, constraint
            max_length, rng, vocab_size, logprobs, constraint = _legacy_args(
                legacy, max_length=max_length, rng=rng, vocab_size=vocab_size, logprobs=logprobs, constraint=constraint
            )
        prompt = _prompt_array(prompt_ids, vocab_size)
        check_int(max_new_tokens, "max_new_tokens", 1)
        if max_length is not None and prompt.size + max_new_tokens > max_length:
            raise ContextLengthError(
                f"prompt of {prompt.size} tokens + max_new_tokens={brief_repr(max_new_tokens)} exceeds the "
                f"model's maximum length of {max_length} tokens",
                int(prompt.size),
                int(max_length),
            )
        self.params = params or SamplingParams()
        if vocab_size is not None and self.params.logit_bias and self.params.logit_bias[-1][0] >= vocab_size:
            raise InvalidInputError(
                f"logit_bias token id {self.params.logit_bias[-1][0]} is outside the model's "
                f"vocabulary (ids 0..{vocab_size - 1})"
            )
        #: None: no log-probabilities; n: each emitted token's, with the n most likely alternatives
        self.logprobs = check_top_logprobs(logprobs)
        #: which tokens may come next (constraints.py: a response format), or None
        self.constraint = constraint
        self.rng = rng if rng is not None else np.random.default_rng(self.params.seed)
        self.prompt_len = int(prompt.size)
        self.vocab_size = vocab_size  # None: unknown (a plug-in verifier without one)
        self.max_new_tokens = int(max_new_tokens)
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self._buf = np.zeros(self.prompt_len + self.max_new_tokens, dtype=np.int64)  # [capacity]
        self._buf[: self.prompt_len] = prompt
        self._n = self.prompt_len
        self.finish_reason: FinishReason | None = None
        self.stats = Stats(prompt_tokens=self.prompt_len)
        self._state: dict[Any, Any] = {}
        #: what the scheduler asks of the drafter in the round under way (a fresh plan each round)
        self.plan = DraftPlan()

    # The current round's plan, read and set through the context as well (drafters and tests
    # written against these names): ``ctx.tree_nodes`` is ``ctx.plan.tree_nodes``, and so on.
    @property
    def tree_nodes(self) -> int:
        """This round: nodes a drafter may add to its chain (``plan.tree_nodes``)."""
        return self.plan.tree_nodes

    @tree_nodes.setter
    def tree_nodes(self, nodes: int) -> None:
        self.plan.tree_nodes = nodes

    @property
    def chain_stop(self) -> ChainStop | None:
        """This round: where a model drafter should stop its chain, or None (``plan.chain_stop``)."""
        return self.plan.chain_stop

    @chain_stop.setter
    def chain_stop(self, stop: ChainStop | None) -> None:
        self.plan.chain_stop = stop

    @property
    def cheap_drafts(self) -> bool:
        """This round: propose only drafts that cost nothing (``plan.cheap_drafts``)."""
        return self.plan.cheap_drafts

    @cheap_drafts.setter
    def cheap_drafts(self, cheap: bool) -> None:
        self.plan.cheap_drafts = cheap

    @property
    def draft_steps(self) -> tuple[int, float]:
        """This round: the draft model's steps after its first call, and their seconds (``plan.draft_steps``)."""
        return self.plan.draft_steps

    @draft_steps.setter
    def draft_steps(self, steps: tuple[int, float]) -> None:
        self.plan.draft_steps = steps

    @property
    def tokens(self) -> np.ndarray:
        """Committed tokens, prompt included, ``[n]`` int64 (a read-only view)."""
        view = self._buf[: self._n]
        view.flags.writeable = False
        return view

    @property
    def generated(self) -> np.ndarray:
        """Committed tokens after the prompt ``[n - prompt_len]``."""
        return self.tokens[self.prompt_len :]

    @property
    def remaining(self) -> int:
        """How many more tokens may be generated."""
        return 0 if self.done else self.prompt_len + self.max_new_tokens - self._n

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def commit(self, ids: np.ndarray) -> np.ndarray:
        """Append verified tokens, cut at the token budget and after the first stop id (the stop
        id itself is kept, nothing after it). Returns what was appended."""
        room = self.prompt_len + self.max_new_tokens - self._n
        ids = np.asarray(ids, dtype=np.int64)[: max(room, 0)]
        if self.stop_ids:
            # a round commits a few ids: a set lookup each beats np.isin's setup (every step, every request)
            hit = next((i for i, t in enumerate(ids.tolist()) if t in self.stop_ids), None)
            if hit is not None:
                ids = ids[: hit + 1]
                self.finish_reason = "stop"
        if self.constraint is not None and ids.size:
            self.constraint.commit(ids)
            if self.constraint.spent:  # it rules nothing more: its inner one goes on
                self.constraint = self.constraint.inner
        self._buf[self._n : self._n + ids.size] = ids
        self._n += ids.size
        if self.finish_reason is None and self._n == self._buf.size:
            self.finish_reason = "length"
        return ids

    def penalized(self, logits: np.ndarray, before: Sequence[Iterable[int]]) -> np.ndarray:
        """Rows ``[n, V]`` with this request's repetition penalties (:mod:`specdec_rt.sampling.penalties`;
        the same array when it has none); ``before[i]``: the uncommitted tokens (drafts) between
        the committed ones and row i's position."""
        if not self.params.penalized:
            return logits
        return penalized(logits, self.params, self.tokens[: self.prompt_len], self.generated, before=before)

    @property
    def adjusts(self) -> bool:
        """Whether :meth:`scores` changes the model's rows (penalties or a constraint)."""
        return self.params.penalized or self.constraint is not None

    def scores(self, logits: np.ndarray, before: Sequence[Iterable[int]]) -> np.ndarray:
        """Rows ``[n, V]`` as this request scores them: the repetition penalties
        (:meth:`penalized`), then the constraint's disallowed tokens at -inf
        (:func:`~specdec_rt.sampling.constraints.constrained`); the same array when neither applies."""
        rows = self.penalized(logits, before)
        return rows if self.constraint is None else constrained(rows, self.constraint, before)

    def scoring(self, before: Sequence[Iterable[int]]) -> "Scoring":
        """:meth:`scores` of the rows after ``before``, for a model call made inside the block::

            async with ctx.scoring(paths) as score:
                scores = await score(await session.extend(ids, len(paths)))

        A constraint that is ``off_loop`` (a grammar) computes its masks in a grammar thread,
        started here, while the model runs: the event loop only awaits them."""
        return Scoring(self, before)

    def state(self, owner: object, factory: Callable[[], S]) -> S:
        """Per-request state of ``owner`` (e.g. a KV cache session), created on first use."""
        try:
            found: S = self._state[owner]
            return found
        except KeyError:
            value = self._state[owner] = factory()
            return value

    def peek_state(self, owner: object) -> Any:
        """``owner``'s state, or None if it has made none (nothing is created)."""
        return self._state.get(owner)

    def pop_state(self, owner: object) -> Any:
        """Remove and return ``owner``'s state (None if it never made any)."""
        return self._state.pop(owner, None)


def _prompt_array(prompt_ids: Iterable[int], vocab_size: int | None) -> np.ndarray:
    """The prompt as a 1-D integer array of the vocabulary's ids, else an InvalidInputError."""
    prompt = np.asarray(list(prompt_ids) if not isinstance(prompt_ids, np.ndarray) else prompt_ids)
    if prompt.ndim != 1 or prompt.size == 0:
        raise InvalidInputError(f"prompt must be a non-empty sequence of token ids, got shape {prompt.shape}")
    if not np.issubdtype(prompt.dtype, np.integer) or prompt.min() < 0:
        raise InvalidInputError(f"prompt token ids must be non-negative integers, got {prompt[:8]!r}")
    if vocab_size is not None and prompt.max() >= vocab_size:
        bad = int(prompt[np.argmax(prompt >= vocab_size)])
        raise InvalidInputError(
            f"prompt token id {bad} is outside the model's vocabulary (ids 0..{vocab_size - 1}); "
            "a tokenizer that does not match the model?"
        )
    return prompt


_LEGACY = ("max_length", "rng", "vocab_size", "logprobs", "constraint")


def _legacy_args(legacy: tuple[Any, ...], **given: Any) -> tuple[Any, ...]:
    """``RequestContext``'s arguments after ``stop_ids`` passed by position (deprecated: they are
    keywords): the five in order, a keyword given too or a sixth is an InvalidInputError."""
    if len(legacy) > len(_LEGACY):
        raise InvalidInputError(f"RequestContext takes at most 4 positional arguments, got {4 + len(legacy)}")
    keywords = [name for name, value in given.items() if value is not None]
    named = positional_keywords("RequestContext", _LEGACY, legacy, keywords, stacklevel=3)
    return tuple({**given, **named}[name] for name in _LEGACY)


class Scoring:
    """:meth:`RequestContext.scoring`'s block. The block is left only once the grammar thread is
    done with the constraint (the request's next commit may not overlap it), whatever the model
    call did."""

    def __init__(self, ctx: RequestContext, before: Sequence[Iterable[int]]) -> None:
        self.ctx, self.before = ctx, before
        self.work: Future[list[np.ndarray | None]] | None = None
        constraint = ctx.constraint
        if constraint is not None and constraint.off_loop:
            self.before = paths = [[int(t) for t in path] for path in before]  # (read now)
            self.work = GRAMMAR_THREADS.submit(masks_of, constraint, paths)

    async def __aenter__(self) -> Scorer:
        return self.score

    async def score(self, logits: np.ndarray) -> np.ndarray:
        """The request's scores of the model's rows ``[n, V]``."""
        if self.work is None:
            return self.ctx.scores(logits, self.before)
        work = self.work  # done by now when the model took longer: no hand-over back
        masks = work.result() if work.done() else await asyncio.wrap_future(work)
        return masked(self.ctx.penalized(logits, self.before), masks)

    async def __aexit__(self, *exc: object) -> None:
        work, cancelled = self.work, False
        while work is not None and not work.done():  # the block failed or was cancelled first
            try:
                await asyncio.wrap_future(work)
            except asyncio.CancelledError:
                cancelled = True  # (a running one cannot be: it finishes first)
            except Exception:  # noqa: BLE001 - the block's own exception goes on
                pass
        if work is not None and not work.cancelled():
            work.exception()  # (retrieved: a mask's error after the model's is not logged as lost)
        if cancelled:
            raise asyncio.CancelledError
