"""Deterministic toy language models and checks, for our tests and for yours.

* :class:`ToyLM` is a fixed random Markov model over a small vocabulary: the logits of the next
  token depend on the last ``order`` tokens. It implements
  :class:`~specdec_rt.speculation.protocols.LanguageModel`, so ``ModelDrafter(ToyLM(...))`` and
  ``ModelVerifier(ToyLM(...))`` run the real scheduler with no ONNX.
* :func:`toy_pair` builds a target and a draft whose distance is a knob (0: the same model).
* :func:`sequence_distribution` computes the exact distribution of whole generated sequences of a
  toy target, so sampling can be checked against it with :func:`chi_square_pvalue`.
* :func:`check_greedy_lossless` runs any drafter against any verifier and asserts greedy
  speculative output equals greedy plain output: use it on your own drafter.
* :func:`rejection_cases` (needs ``hypothesis``) generates valid ``(draft_ids, q, p)`` inputs.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import os
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, ParamSpec, Sequence, TypeVar

import anyio
import numpy as np

from .batching import BatchExecutor
from .checks import positional_keywords
from .kvcache.cached_start import CachedStart
from .kvcache.prefix import Hit, PrefixCache
from .policy.config import SpecConfig
from .sampling import SamplingParams, warp
from .sampling.penalties import penalized
from .speculation.adapters import ModelDrafter, ModelVerifier
from .speculation.protocols import CacheSession, DraftInferrer, LanguageModel, ModelCaps, TargetVerifier
from .speculation.scheduler import SpecDecScheduler

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

    from .engine.engine import Engine
    from .text.codec import TextCodec

__all__ = [
    "ToyLM",
    "ToySession",
    "PlainLM",
    "FaultyModel",
    "toy_codec",
    "toy_engine",
    "toy_pair",
    "toy_scheduler",
    "sequence_distribution",
    "sequence_counts",
    "chi_square_pvalue",
    "check_greedy_lossless",
    "rejection_cases",
]


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _once_positional(count: int) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Accept the first ``count`` keyword-only options by position too, as before they became
    keyword-only, with a DeprecationWarning naming them (removed in 0.3)."""

    def wrap(func: Callable[_P, _R]) -> Callable[_P, _R]:
        params = inspect.signature(func).parameters.values()
        positional = sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        legacy = [p.name for p in params if p.kind is p.KEYWORD_ONLY][:count]

        @functools.wraps(func)
        def call(*args: Any, **kwargs: Any) -> Any:
            extra = args[positional:]
            if not extra or len(extra) > len(legacy):
                return func(*args, **kwargs)
            named = positional_keywords(func.__qualname__, legacy, extra, kwargs, error=TypeError, stacklevel=2)
            return func(*args[:positional], **named, **kwargs)

        return call

    return wrap


class ToyLM(LanguageModel):
    """A fixed random order-``order`` Markov LM: ``logits(next | last order tokens)``.

    Counts ``calls`` (forward passes) and ``positions`` (tokens fed) so tests and the toy demo can
    measure speculation in model calls; ``tree_calls`` counts the tree verifies. With a prefix
    cache, every call checks that its slot holds exactly the ids its session was started with and
    fed, so a cache that copies the wrong positions fails loudly.

    Args:
        vocab_size: Tokens in the vocabulary (``V``).
        order: How many last tokens the next token's logits depend on.
        seed: Seed of the random logits table.
        sharpness: Scale of the logits (higher: peakier distributions).
        max_length: The longest sequence a session holds.
        table: The logits ``[V**order, V]``, instead of random ones.
        slots: Sessions that run at once (with a prefix cache: the pool's running slots).
        prefix_cache_tokens: Above 0, a :class:`~specdec_rt.kvcache.prefix.PrefixCache` of this
            budget over the ids (the toy's "KV"), as the ONNX backend has.
        cache_entries: The prefix cache's entry slots (default: ``slots``).
        block: The prefix cache's block size in tokens.
        ragged: The executor may batch calls of several positions (verifies) across requests.
        tree: It verifies a draft tree in one call (``extend(..., tree=parents)``, then
            ``accept_tree``), as ONNX Runtime targets of exporter 0.3+ do.
        executor: A :class:`~specdec_rt.batching.executor.BatchExecutor` its calls go through
            (batched with other requests' calls, as in an Engine); ``None``: each call runs at once.
    """

    @_once_positional(2)
    def __init__(
        self,
        vocab_size: int = 8,
        order: int = 2,
        seed: int = 0,
        sharpness: float = 2.0,
        *,
        max_length: int = 4096,
        table: np.ndarray | None = None,
        slots: int = 16,
        prefix_cache_tokens: int = 0,
        cache_entries: int | None = None,
        block: int = 4,
        ragged: bool = True,
        tree: bool = True,
        executor: BatchExecutor | None = None,
    ) -> None:
        self.vocab_size, self.order, self.max_length = vocab_size, order, max_length
        rng = np.random.default_rng(seed)
        self.table = table if table is not None else rng.normal(size=(vocab_size**order, vocab_size)) * sharpness
        self.calls = 0
        self.positions = 0
        self.batches: list[int] = []  # rows of every batched call (with an executor)
        self.ragged = ragged  # batched calls of several positions per row (a batched verify)
        self.ragged_calls = 0
        self.tree = tree
        self.tree_calls = 0
        self.executor = executor  # a BatchExecutor: calls go through its step loop, batched
        self.prefix_cache: PrefixCache | None = None
        if prefix_cache_tokens:
            entries = slots if cache_entries is None else cache_entries
            self.store = np.full((slots + entries, max_length + 1), -1, dtype=np.int64)  # the pool's "KV"
            self.prefix_cache = PrefixCache(
                slots,
                entries,
                block=block,
                budget_bytes=prefix_cache_tokens,
                token_bytes=1,
                copy=self._copy,
                discard=self._discard,
            )

    @property
    def caches_prefixes(self) -> bool:
        return self.prefix_cache is not None and self.prefix_cache.enabled

    @property
    def caps(self) -> ModelCaps:
        """What it can do (read on every use: tests switch ``ragged`` / ``tree`` off)."""
        return ModelCaps(
            batched_steps=True,
            ragged=self.ragged,
            batched_prefill=True,
            caches_prefixes=self.caches_prefixes,
            trees=self.tree,
        )

    @caps.setter
    def caps(self, value: ModelCaps) -> None:  # LanguageModel declares a plain attribute
        raise AttributeError("ToyLM.caps follows ragged, tree and the prefix cache: set those instead")

    def cached_prefix(self, tokens: np.ndarray) -> int:
        return self.prefix_cache.peek(tokens) if self.prefix_cache is not None else 0

    def _copy(self, src: int, dst: int, start: int, stop: int) -> None:
        self.store[dst, start:stop] = self.store[src, start:stop]

    def _discard(self, slot: int, start: int, stop: int) -> None:
        self.store[slot, start:stop] = -1

    def can_prefill_together(self, sessions: list["ToySession"]) -> bool:
        return True

    def run_prefill_batch_sync(self, sessions: list["ToySession"], prompts: list[np.ndarray]) -> np.ndarray:
        """First prompts of several sessions in one call: each prompt's last logits ``[B, V]``."""
        self.batches.append(len(sessions))
        return np.concatenate([s.run_sync(p, 1, 0) for s, p in zip(sessions, prompts)])

    def run_batch_sync(self, sessions: list["ToySession"], ids: np.ndarray, pasts: np.ndarray) -> np.ndarray:
        """One single-token step of several sessions in one call: logits ``[B, V]``."""
        self.batches.append(len(sessions))
        return np.concatenate([s.run_sync(ids[i : i + 1], 1, int(pasts[i])) for i, s in enumerate(sessions)])

    def run_rows_sync(
        self, sessions: list["ToySession"], feeds: list[np.ndarray], wants: list[int]
    ) -> list[np.ndarray]:
        """Several positions of several sessions in one call (``ragged=True``): session i feeds
        ``feeds[i]`` after its cached tokens; the logits of its last ``wants[i]`` ``[wants[i], V]``."""
        self.batches.append(len(sessions))
        self.ragged_calls += 1
        return [s.run_sync(f, w, s.length) for s, f, w in zip(sessions, feeds, wants)]

    def logits_at(self, ids: np.ndarray) -> np.ndarray:
        """Next-token logits after each prefix ``ids[:i+1]``: ``[len(ids), V]``."""
        ids = np.asarray(ids, dtype=np.int64)
        padded = np.concatenate([np.zeros(self.order - 1, dtype=np.int64), ids])  # left-pad with 0
        ctx = np.zeros(ids.size, dtype=np.int64)
        for j in range(self.order):  # row index = sum of the last `order` tokens in base V
            ctx = ctx * self.vocab_size + padded[j : j + ids.size]
        return self.table[ctx]

    def start(self, prefix: np.ndarray | None = None, *, batch_invariant: bool = False) -> "ToySession":
        """A session; ``prefix`` starts it from the prefix cache. Its logits are the same in any
        call shape, so every session is batch-invariant."""
        if self.prefix_cache is None:
            return ToySession(self)
        tokens = None if prefix is None else np.asarray(prefix, dtype=np.int64)
        slot, hit = self.prefix_cache.acquire(tokens)
        session = ToySession(self, slot, hit, tokens)
        self.prefix_cache.register(slot, session, tokens)
        return session


class ToySession(CachedStart, CacheSession):
    """The toy model's 'KV cache': the ids fed so far (rollback truncates, nothing recomputed);
    with a prefix cache, a row of the model's ``store`` (``truth`` keeps what it should hold)."""

    def __init__(self, model: ToyLM, slot: int = -1, hit: Hit | None = None, tokens: np.ndarray | None = None) -> None:
        self.model, self.slot = model, slot
        self.truth = np.zeros(model.max_length + 1, dtype=np.int64)  # [max_len + 1] ids it was given
        self._ids = model.store[slot] if slot >= 0 else self.truth
        self._length = self._start_from(hit, tokens)  # tokens its cache holds
        if self._length:  # a hit on the prompt's first tokens
            assert tokens is not None
            self.truth[: self._length] = tokens[: self._length]
        self.closed = False

    @property
    def length(self) -> int:
        return self._length

    async def extend(self, ids: np.ndarray, logits_rows: int, tree: np.ndarray | None = None) -> np.ndarray:
        if self.closed:
            raise RuntimeError("session is closed")
        ids = np.asarray(ids, dtype=np.int64)
        extra = {} if tree is None else {"tree": np.asarray(tree, dtype=np.int64)}
        if self.model.executor is not None:
            out: np.ndarray = await self.model.executor.extend(self, ids, logits_rows, **extra)
            return out
        return self.run_sync(ids, logits_rows, self._length, **extra)

    def run_sync(self, ids: np.ndarray, logits_rows: int, past: int, tree: np.ndarray | None = None) -> np.ndarray:
        """Feed ``ids`` [S] after ``past`` cached tokens (the executor's entry point); ``tree``
        [S]: each position's parent (-1: the cached tokens), and ``length`` stays ``past``."""
        cache = self.model.prefix_cache
        if cache is not None:
            cache.apply()
            ids, past = self._settle(cache, ids, past, self.truth)
            if not np.array_equal(self._ids[:past], self.truth[:past]):
                bad = int(np.flatnonzero(self._ids[:past] != self.truth[:past])[0])
                raise AssertionError(f"prefix cache corrupted slot {self.slot} at position {bad}")
            self.truth[past : past + ids.size] = ids
        self._length = past
        self._ids[self._length : self._length + ids.size] = ids
        self.model.calls += 1
        self.model.positions += ids.size
        if tree is not None:  # each node sees the cached tokens and its own path
            if not self.model.tree:
                raise RuntimeError("this toy model verifies chains only")
            self.model.tree_calls += 1
            rows = []
            for j in range(ids.size - logits_rows, ids.size):
                path, a = [], j
                while a >= 0:
                    path.append(int(ids[a]))
                    a = int(tree[a])
                ctx = np.concatenate([self._ids[max(0, past - self.model.order) : past], path[::-1]])
                rows.append(self.model.logits_at(ctx)[-1])
            return np.stack(rows)  # [rows, V]
        self._length += ids.size
        start = max(0, self._length - self.model.order + 1 - logits_rows)  # context the rows need
        logits = self.model.logits_at(self._ids[start : self._length])
        return logits[-logits_rows:]

    def accept_tree(self, start: int, keep: np.ndarray) -> None:
        """Keep the tree positions ``start + keep`` as ``start ..`` (the accepted path)."""
        if self._length != start:
            raise ValueError(f"accept_tree at {start}: the cache holds {self._length}")
        keep = np.asarray(keep, dtype=np.int64)
        self._ids[start : start + keep.size] = self._ids[start + keep]
        if self.model.prefix_cache is not None:
            self.truth[start : start + keep.size] = self.truth[start + keep]
        self._length = start + keep.size

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self._length}")
        self._length = length

    def close(self) -> None:
        cache = self.model.prefix_cache
        if not self.closed and cache is not None:
            cache.release(self.slot, self.truth[: self.kept_length()])
            if self.model.executor is not None:
                self.model.executor.chore(cache.next_stash)  # copied into an entry while idle
            else:
                while (stash := cache.next_stash()) is not None:
                    stash.finish()
        self.closed = True


class FaultyModel(LanguageModel):
    """Wraps a model; the ``fail_on``-th forward call (counted across sessions) raises.

    Args:
        model: The model whose sessions it wraps.
        fail_on: Which forward call raises ``RuntimeError`` (1-based).
    """

    def __init__(self, model: LanguageModel, fail_on: int) -> None:
        self.model, self.fail_on, self.calls = model, fail_on, 0
        self.vocab_size, self.max_length = model.vocab_size, model.max_length
        self.open_sessions = 0

    def start(self, prefix: np.ndarray | None = None, *, batch_invariant: bool = False) -> CacheSession:
        inner, outer = self.model.start(batch_invariant=batch_invariant), self
        outer.open_sessions += 1

        class _Session(CacheSession):
            length = property(lambda s: inner.length)
            _closed = False

            async def extend(s, ids: np.ndarray, logits_rows: int) -> np.ndarray:
                outer.calls += 1
                if outer.calls == outer.fail_on:
                    raise RuntimeError(f"injected failure on call {outer.calls}")
                return await inner.extend(ids, logits_rows)

            def rollback(s, length: int) -> None:
                inner.rollback(length)

            def close(s) -> None:
                if not s._closed:
                    s._closed = True
                    outer.open_sessions -= 1
                inner.close()

        return _Session()


class PlainLM(LanguageModel):
    """The smallest backend: the Protocols' required members and nothing else (its ``caps`` are
    the defaults, so nothing is batched, cached or verified as a tree). Its logits are those of
    ``model.logits_at`` (a :class:`ToyLM`), recomputed from the whole context on every call; a
    test that runs it through :class:`~specdec_rt.engine.engine.Engine` shows what a third
    backend must write.

    Args:
        model: The toy model whose logits it returns.
    """

    def __init__(self, model: ToyLM) -> None:
        self.model = model
        self.vocab_size, self.max_length = model.vocab_size, model.max_length
        self.calls = 0

    def start(self, prefix: np.ndarray | None = None, *, batch_invariant: bool = False) -> CacheSession:
        return _PlainSession(self)


class _PlainSession(CacheSession):
    def __init__(self, lm: PlainLM) -> None:
        self.lm, self.ids = lm, np.zeros(0, dtype=np.int64)  # [length] the tokens it holds

    @property
    def length(self) -> int:
        return int(self.ids.size)

    async def extend(self, ids: np.ndarray, logits_rows: int) -> np.ndarray:
        self.lm.calls += 1
        self.ids = np.concatenate([self.ids, np.asarray(ids, dtype=np.int64)])
        return self.lm.model.logits_at(self.ids)[-logits_rows:]  # [rows, V]

    def rollback(self, length: int) -> None:
        self.ids = self.ids[:length]

    def close(self) -> None:
        self.ids = self.ids[:0]


def toy_codec(vocab_size: int, folder: str | os.PathLike[str]) -> TextCodec:
    """A word-level :class:`~specdec_rt.text.codec.TextCodec` over the words ``w0 .. w{V-1}``
    (token i is ``w{i}``; text is words split on spaces).

    Args:
        vocab_size: Words in the vocabulary.
        folder: Where its ``tokenizer.json`` is written.
    """
    from pathlib import Path

    from tokenizers import Tokenizer, models, pre_tokenizers

    from .text.codec import TextCodec

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = Path(folder) / "tokenizer.json"
    tok.save(str(path))
    return TextCodec(path)


def toy_engine(
    target: LanguageModel, drafter: DraftInferrer | None, folder: str | os.PathLike[str], **options: Any
) -> Engine:
    """An :class:`~specdec_rt.engine.engine.Engine` over any backend's models (no export folder).

    Args:
        target: The target model.
        drafter: The drafter (``None``: plain decoding only).
        folder: Where the codec's tokenizer file goes (:func:`toy_codec` over the target's
            vocabulary).
        **options: The Engine's options (``slots``, ``executor``, ``models``, ``eos_ids``,
            ``config``...).
    """
    from .engine.engine import Engine

    config = options.pop("config", None)
    return Engine(target, drafter, toy_codec(target.vocab_size, folder), config, **options)


@_once_positional(1)
def toy_pair(
    vocab_size: int = 8, order: int = 2, seed: int = 0, distance: float = 0.5, *, sharpness: float = 2.0, **options: Any
) -> tuple[ToyLM, ToyLM]:
    """A target and a draft whose logits are ``(1-distance)*target + distance*noise``.

    Args:
        vocab_size: Tokens in the vocabulary.
        order: The models' Markov order.
        seed: Seed of the target's logits and of the noise.
        distance: How far the draft is from the target (0: the same model).
        sharpness: Scale of the logits.
        **options: More :class:`ToyLM` options for both (``max_length``, ``prefix_cache_tokens``, ...).

    Returns:
        ``(target, draft)``.
    """
    target = ToyLM(vocab_size, order, seed, sharpness, **options)
    noise = np.random.default_rng(seed + 10_007).normal(size=target.table.shape) * sharpness
    draft = ToyLM(vocab_size, order, table=(1 - distance) * target.table + distance * noise, **options)
    return target, draft


@_once_positional(2)
def toy_scheduler(
    distance: float = 0.5,
    vocab_size: int = 8,
    seed: int = 0,
    config: SpecConfig | None = None,
    *,
    eos_ids: Iterable[int] = (),
    batched: bool = False,
    **options: Any,
) -> tuple[SpecDecScheduler, ToyLM, ToyLM]:
    """A scheduler over a :func:`toy_pair`.

    Args:
        distance: How far the draft is from the target (0: the same model).
        vocab_size: Tokens in the vocabulary.
        seed: Seed of the models.
        config: The scheduler's speculation policy (default: ``SpecConfig()``).
        eos_ids: Tokens that end a request.
        batched: Run every model call through one
            :class:`~specdec_rt.batching.executor.BatchExecutor`, as an Engine does (concurrent
            requests' single-token steps become batched calls; long feeds are chunked).
        **options: :class:`ToyLM` options for both models (e.g. ``prefix_cache_tokens=...``).

    Returns:
        ``(scheduler, target, draft)``.
    """
    if batched:  # one step loop for both, as in an Engine
        options["executor"] = BatchExecutor(chunk=4)
    target, draft = toy_pair(vocab_size, seed=seed, distance=distance, **options)
    return SpecDecScheduler(ModelDrafter(draft), ModelVerifier(target), config, eos_ids=eos_ids), target, draft


def sequence_distribution(
    model: ToyLM, prompt: Sequence[int], length: int, params: SamplingParams
) -> dict[tuple[int, ...], float]:
    """Exact probability of every generated sequence of ``length`` tokens (no stop ids).

    Args:
        model: The target.
        prompt: The prompt's ids.
        length: Tokens generated.
        params: The sampling parameters (temperature, top-k/p, penalties) applied to each step.

    Returns:
        Sequence -> probability, over all ``V**length`` sequences.
    """
    out: dict[tuple[int, ...], float] = {}
    for seq in itertools.product(range(model.vocab_size), repeat=length):
        ids = np.array(list(prompt) + list(seq))
        rows = model.logits_at(ids[:-1])[len(prompt) - 1 :]  # [length, V]
        rows = penalized(
            rows, params, np.asarray(prompt), np.zeros(0, dtype=np.int64), before=[seq[:j] for j in range(length)]
        )
        probs = warp(rows, params)  # [length, V]
        out[seq] = float(np.prod(probs[np.arange(length), list(seq)]))
    return out


@_once_positional(3)
async def sequence_counts(
    sched: SpecDecScheduler,
    prompt: Sequence[int],
    length: int,
    params: SamplingParams,
    *,
    n: int,
    rng: np.random.Generator,
    mode: str = "spec",
) -> dict[tuple[int, ...], int]:
    """How often each generated sequence came up in ``n`` sampled runs of ``sched``.

    Args:
        sched: The scheduler to run.
        prompt: The prompt's ids.
        length: Tokens generated per run.
        params: The sampling parameters.
        n: Runs.
        rng: The random generator every run draws from.
        mode: ``"spec"`` or ``"ar"``.

    Returns:
        Sequence -> count, to compare with :func:`sequence_distribution` by
        :func:`chi_square_pvalue`.
    """
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(n):
        key = tuple((await sched.run(prompt, length, params, mode=mode, rng=rng)).token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


@_once_positional(1)
async def run_together(
    sched: SpecDecScheduler,
    prompts: Sequence[Sequence[int]],
    n: int,
    params: Sequence[SamplingParams],
    *,
    mode: str = "spec",
) -> list[list[int]]:
    """The generated ids of ``prompts`` run at once (one task each: a batched scheduler batches
    their calls), to compare with each run alone.

    Args:
        sched: The scheduler to run.
        prompts: The prompts' ids.
        n: Tokens generated per request.
        params: Each request's sampling parameters (request i: ``params[i]``).
        mode: ``"spec"`` or ``"ar"``.
    """
    out: list[list[int]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        out[i] = (await sched.run(prompts[i], n, params[i], mode=mode)).token_ids

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return out


def chi_square_pvalue(
    counts: Mapping[tuple[int, ...], int], expected: Mapping[tuple[int, ...], float], min_expected: float = 5.0
) -> float:
    """Goodness-of-fit p-value of observed ``counts`` against ``expected`` probabilities.

    An observed outcome of probability 0 gives p = 0.

    Args:
        counts: Outcome -> times seen (:func:`sequence_counts`).
        expected: Outcome -> probability (:func:`sequence_distribution`).
        min_expected: Outcomes expected fewer times than this are pooled into one bin.
    """
    n = sum(counts.values())
    if any(expected.get(k, 0.0) == 0.0 for k, c in counts.items() if c):
        return 0.0
    stat, dof, pool_obs, pool_exp = 0.0, -1, 0.0, 0.0
    for key, prob in expected.items():
        e, o = prob * n, counts.get(key, 0)
        if e < min_expected:
            pool_obs, pool_exp = pool_obs + o, pool_exp + e
            continue
        stat += (o - e) ** 2 / e
        dof += 1
    if pool_exp > 0:
        stat += (pool_obs - pool_exp) ** 2 / pool_exp
        dof += 1
    return _chi2_sf(stat, max(dof, 1))


def _chi2_sf(x: float, dof: int) -> float:
    """P(X > x) for X ~ chi-square(dof): the regularized upper incomplete gamma Q(dof/2, x/2)."""
    a, z = dof / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    if z < a + 1:  # series for P(a, z)
        term = total = 1.0 / a
        for n in range(1, 1000):
            term *= z / (a + n)
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(-z + a * math.log(z) - math.lgamma(a)))
    b, c, d = z + 1 - a, 1e300, 1 / (z + 1 - a)  # continued fraction for Q(a, z) (Lentz)
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return min(1.0, math.exp(-z + a * math.log(z) - math.lgamma(a)) * h)


@_once_positional(1)
async def check_greedy_lossless(
    drafter: DraftInferrer,
    verifier: TargetVerifier,
    prompts: Iterable[Sequence[int]],
    max_new_tokens: int = 32,
    *,
    eos_ids: Iterable[int] = (),
) -> None:
    """Assert that greedy speculative decoding with ``drafter`` reproduces greedy plain decoding
    with ``verifier`` token for token on every prompt.

    Args:
        drafter: The drafter under test.
        verifier: The target's verifier.
        prompts: The prompts' ids.
        max_new_tokens: Tokens generated per prompt.
        eos_ids: Tokens that end a request.

    Raises:
        AssertionError: A prompt whose outputs differ, named with both outputs.
    """
    sched = SpecDecScheduler(drafter, verifier, eos_ids=eos_ids)
    for prompt in prompts:
        ar = await sched.run(prompt, max_new_tokens, mode="ar")
        spec = await sched.run(prompt, max_new_tokens, mode="spec")
        if spec.token_ids != ar.token_ids:
            raise AssertionError(f"prompt {list(prompt)}: spec {spec.token_ids} != ar {ar.token_ids}")


def rejection_cases(max_k: int = 6, max_vocab: int = 8) -> SearchStrategy[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Hypothesis strategy of valid ``(draft_ids [k], q [k, V], p [k+1, V])`` with each draft id
    drawn from the support of its q row (as a real drafter would). Needs ``hypothesis``.

    Args:
        max_k: The most drafts ``k``.
        max_vocab: The largest vocabulary ``V``.
    """
    from hypothesis import strategies as st

    @st.composite
    def cases(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        k = draw(st.integers(1, max_k))
        v = draw(st.integers(1, max_vocab))
        weights = st.lists(st.one_of(st.just(0.0), st.floats(0.01, 10.0)), min_size=v, max_size=v)

        def row() -> np.ndarray:
            weight = np.array(draw(weights.filter(lambda w: sum(w) > 0)))
            normalized: np.ndarray = weight / weight.sum()
            return normalized

        q = np.stack([row() for _ in range(k)])
        p = np.stack([row() for _ in range(k + 1)])
        ids = np.array([draw(st.sampled_from(np.flatnonzero(q[i]).tolist())) for i in range(k)])
        return ids, q, p

    return cases()
