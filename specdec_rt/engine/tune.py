"""``precision="auto"``: measure which target and draft of an export folder run fastest here.

Which configuration wins depends on the CPU: int8 activations pay on AVX-512 VNNI and AMX, less
on AVX2 alone, and a draft pays only while it is much cheaper than its target. So the choice is
measured on the machine, once, and kept (:mod:`specdec_rt.engine.tune_cache`).

What is measured (:func:`measure`): for each target the folder offers
(:func:`~specdec_rt.engine.factory.target_candidates`), plain decoding (``"none"``), n-gram
lookup (``"ngram"``) and n-gram lookup with the first :data:`MAX_MODEL_DRAFTS` draft models that
read at most half the target's weight bytes (``"ngram+q8"``;
:func:`~specdec_rt.engine.factory.cheaper_drafts`): every engine loaded as ``Engine.load``
would load it (with a shorter warm-up), then :data:`TUNE_PROMPTS` (fixed chat
prompts; plain text to a model without a chat template, as Gemma 3 270M's base model;
:data:`TUNE_TOKENS` greedy tokens each, end of sequence ignored) in rounds, the
configurations interleaved within each round (in an order that rotates) so that a machine that
slows down or speeds up meanwhile weighs on all alike:

1. one stream: each configuration generates the round's prompt alone (end-to-end tok/s);
2. several at once: each generates ``min(4, slots)`` prompts at once (summed tok/s, as a
   server's batches run).

Rounds go on while the time budget (:data:`TUNE_BUDGET_S`) allows, at least one. A
configuration's rates are the medians over rounds; its greedy output must equal plain decoding's
of the same target, token for token, on every prompt, one stream and several alike, or it is
disqualified (and reported). The winner: the highest geometric mean of the two rates
(:attr:`~specdec_rt.engine.tune_cache.TuneRow.score`) among exact configurations, except that
a less precise target must beat a more precise one by more than :data:`PICK_MARGIN` (:func:`pick`).
"""

from __future__ import annotations

import asyncio
import statistics
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from ..errors import SpecDecError
from ..logs import get_logger
from .factory import cheaper_drafts, home_manifest, target_candidates
from .tune_cache import TuneLock, TuneResult, TuneRow, cache_path, lock_path, read_cached, tune_key, write_cached

__all__ = [
    "TUNE_PROMPTS",
    "TUNE_TOKENS",
    "TUNE_BUDGET_S",
    "MAX_MODEL_DRAFTS",
    "Config",
    "Tuned",
    "configs_for",
    "measure",
    "pick",
    "choose",
]

log = get_logger("specdec_rt.engine.tune")

# general chat (the kind of request a server mostly gets), in no benchmark prompt set
TUNE_PROMPTS = (
    "Explain how a refrigerator keeps food cold.",
    "Give me three ideas for a rainy Sunday afternoon.",
    "Write a short Python function that reverses the words in a sentence.",
    "What are the pros and cons of working from home?",
)
TUNE_TOKENS = 32
TUNE_BUDGET_S = 40.0  # measuring, after the loads: rounds stop once the next would pass it
TUNE_MAX_LENGTH = 512  # KV per request in the tuning engines: a prompt and its tokens fit
MAX_MODEL_DRAFTS = 1  # draft models measured per target: the manifest's first cheap enough one
AT_ONCE = 4  # requests at once in the "several" measurement (or slots, if fewer)
PICK_MARGIN = 0.05  # a less precise target must score more than 5% above a more precise one
# waiting for another process's measurement of the same key: its loads (26 s of 89 on a busy
# 2-core machine, the default model) and TUNE_BUDGET_S, with room for a slower machine or model
LOCK_WAIT_S = 300.0
LOCK_POLL_S = 0.25  # how often a waiting process tries the lock

Say = Callable[[str], None]
Load = Callable[..., Awaitable[Any]]  # Engine.load


@dataclass(frozen=True)
class Config:
    """One configuration: a target ``precision`` and a ``draft`` spec (``"none"``: plain
    decoding, measured as ``mode="ar"`` on the target's n-gram engine, which it equals)."""

    precision: str
    draft: str

    @property
    def engine(self) -> tuple[str, str]:
        """The engine that runs it: (precision, draft spec loaded)."""
        return self.precision, "ngram" if self.draft == "none" else self.draft

    @property
    def mode(self) -> str:
        return "ar" if self.draft == "none" else "spec"


@dataclass
class _Samples:
    one: list[float] = field(default_factory=list)  # tok/s, one stream, per round
    many: list[float] = field(default_factory=list)  # tok/s summed, several at once, per round
    drafted: int = 0
    accepted: int = 0
    mismatch: str = ""  # the first prompt whose output left plain decoding's
    failed: str = ""  # why it did not run


@dataclass(frozen=True)
class Tuned:
    """What :func:`choose` picked: ``precision`` and ``draft`` to load, ``chosen_by``
    (``"tuned"``: measured now, ``"cached"``: read from the tune cache), the ``result``, and
    the tune file it was read from or stored in (None: it could not be written)."""

    precision: str
    draft: str
    chosen_by: str
    result: TuneResult
    path: Path | None = None


def configs_for(home) -> list[Config]:
    """The configurations to measure for the folder whose manifest is ``home`` (see the module's
    docstring): per target, ``none``, ``ngram`` and ``ngram+<draft>`` for its cheaper drafts."""
    found = []
    for c in target_candidates(home):
        drafts = cheaper_drafts(home, c, every=False)
        found += [Config(c.precision, f"ngram+{n}") for n in drafts[:MAX_MODEL_DRAFTS]]
        found += [Config(c.precision, "ngram"), Config(c.precision, "none")]
    return found


def _stderr_or_log(say: Say | None) -> Say:
    return say if say is not None else lambda text: log.info("tune.progress", message=text)


async def measure(
    folder,
    load: Load,
    *,
    threads: int | None = None,
    slots: int = 8,
    provider: str = "auto",
    max_length: int | None = None,
    budget_s: float = TUNE_BUDGET_S,
    prompts: tuple[str, ...] = TUNE_PROMPTS,
    tokens: int = TUNE_TOKENS,
    say: Say | None = None,
) -> TuneResult:
    """Measure every configuration of ``folder`` (see the module's docstring) and pick the
    winner. ``load``: :meth:`Engine.load <specdec_rt.engine.engine.Engine.load>` (passed in:
    the engine imports this module). ``say``: progress lines (default: the
    ``specdec_rt.engine.tune`` logger, info)."""
    say = _stderr_or_log(say)
    t0 = time.perf_counter()
    home = await anyio.to_thread.run_sync(home_manifest, folder)  # (reads files: off the event loop)
    configs = await anyio.to_thread.run_sync(configs_for, home)
    at_once = max(1, min(AT_ONCE, slots, len(prompts)))
    length = min(max_length or TUNE_MAX_LENGTH, TUNE_MAX_LENGTH)
    tokens = max(1, min(tokens, length // 2))  # a short context keeps room for the prompt
    samples = {c: _Samples() for c in configs}
    engines: dict[tuple[str, str], Any] = {}
    chat: list[Any] = [[{"role": "user", "content": p}] for p in prompts]
    say(
        f"tuning {home.name} on this machine (once per machine, model and settings): "
        f"{len(configs)} configurations, {len({c.engine for c in configs})} engines"
    )
    try:
        for key in dict.fromkeys(c.engine for c in configs):  # one engine per (target, draft loaded)
            try:
                engines[key] = await load(
                    home.folder,
                    draft=key[1],
                    precision=key[0],
                    threads=threads,
                    provider=provider,
                    slots=slots,
                    max_length=length,
                    prefix_cache=False,  # rounds repeat prompts: each must be computed
                    warmup=False,
                )
                await engines[key].warm_up(1, 8)  # a short one: costs go on being measured as it runs
            except SpecDecError as exc:
                for c in configs:
                    if c.engine == key:
                        samples[c].failed = f"did not load: {exc}"[:280]
        live = [c for c in configs if c.engine in engines]
        if any(e.codec.chat_template is None for e in engines.values()):
            chat = list(prompts)  # no chat template (a base model: Gemma 3 270M): the prompts as plain text
        loaded = time.perf_counter()
        say(f"loaded in {loaded - t0:.1f} s; measuring {len(live)} configurations for at most {budget_s:.0f} s")
        rounds = 0
        for r in range(len(prompts)):
            start = time.perf_counter()
            live = [c for c in live if not samples[c].failed]
            order = live[r % len(live) :] + live[: r % len(live)] if live else []
            plain: dict[tuple[str, bool], list] = {}  # (precision, several) -> plain decoding's ids
            for several in (False, True):
                for c in sorted(order, key=lambda c: c.mode != "ar"):  # plain first: the reference
                    group = [chat[(r + i) % len(chat)] for i in range(at_once)] if several else [chat[r]]
                    s = samples[c]
                    if s.failed:
                        continue
                    took = time.perf_counter()
                    try:
                        results = await asyncio.gather(
                            *[
                                engines[c.engine].generate(
                                    g, max_new_tokens=tokens, mode=c.mode, ignore_eos=True, truncate_prompt=True
                                )
                                for g in group
                            ]
                        )
                    except SpecDecError as exc:  # left out, reported; the others go on
                        s.failed = f"failed: {type(exc).__name__}: {exc}"[:280]
                        continue
                    took = time.perf_counter() - took
                    (s.many if several else s.one).append(sum(x.stats.new_tokens for x in results) / took)
                    s.drafted += sum(x.stats.drafted for x in results)
                    s.accepted += sum(x.stats.accepted for x in results)
                    ids = [list(x.token_ids) for x in results]
                    if c.mode == "ar":
                        plain[(c.precision, several)] = ids
                    elif (c.precision, several) not in plain:
                        s.failed = "plain decoding of its target failed: nothing to check it against"
                    elif ids != plain[(c.precision, several)] and not s.mismatch:
                        s.mismatch = f"differs from plain decoding on prompt {r + 1}" + (
                            " (batched)" if several else ""
                        )
            rounds += 1
            spent, each = time.perf_counter() - loaded, time.perf_counter() - start
            say(f"round {rounds}/{len(prompts)} in {each:.1f} s")
            if spent + each > budget_s:
                break
    finally:
        with anyio.CancelScope(shield=True):  # cancelled (a server stopped while tuning): close them still
            for engine in engines.values():
                await engine.aclose()
    rows = [_row(c, samples[c], at_once) for c in configs]
    result = TuneResult(rows, pick(rows), rounds, time.perf_counter() - t0)
    for row in rows:
        if not row.exact:
            say(f"left out: {row.precision} {row.draft}: {row.note}")
    return result


def _row(c: Config, s: _Samples, at_once: int) -> TuneRow:
    ok = bool(s.one) and not s.failed and not s.mismatch
    return TuneRow(
        c.precision,
        c.draft,
        statistics.median(s.one) if s.one else 0.0,
        statistics.median(s.many) if s.many else 0.0,
        at_once,
        s.accepted / s.drafted if s.drafted else 0.0,
        ok,
        s.failed or s.mismatch,
    )


def pick(rows: list[TuneRow]) -> int | None:
    """The index of the winning row, or None when no row is exact: among exact rows, the first
    precision (in the rows' order: the folder's own target first, then its copies as listed)
    whose best score is within :data:`PICK_MARGIN` of the best of all, and its best row (the
    first on a tie). A copy that is barely faster does not displace a more precise target: a
    round or two on a busy machine cannot tell them apart, and the more precise one is closer
    to the float32 weights."""
    exact = [i for i, row in enumerate(rows) if row.exact]
    if not exact:
        return None
    top = max(rows[i].score for i in exact)
    for precision in dict.fromkeys(rows[i].precision for i in exact):
        mine = [i for i in exact if rows[i].precision == precision]
        best = max(mine, key=lambda i: (rows[i].score, -i))
        if rows[best].score >= (1 - PICK_MARGIN) * top:
            return best
    return None  # (unreachable: the top row's precision qualifies)


_LOCKS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Path, asyncio.Lock]]" = weakref.WeakKeyDictionary()


def _lock(path: Path) -> asyncio.Lock:
    """The running event loop's lock for one tune cache file (an asyncio lock serves one loop)."""
    locks = _LOCKS.setdefault(asyncio.get_running_loop(), {})
    return locks.setdefault(path, asyncio.Lock())


async def choose(
    name_or_path,
    load: Load,
    *,
    threads: int | None = None,
    slots: int = 8,
    provider: str = "auto",
    max_length: int | None = None,
    force: bool = False,
    say: Say | None = None,
    lock_wait_s: float = LOCK_WAIT_S,
) -> Tuned:
    """The fastest exact configuration of a folder on this machine: read from the tune cache
    when it holds one for this key (:func:`~specdec_rt.engine.tune_cache.tune_key`), else
    measured now (:func:`measure`, with ``load``, ``Engine.load``) and stored; ``force``:
    measure even so. A cached choice that is not one of the folder's configurations
    (:func:`configs_for`) is measured again. Calls for one key measure one at a time, in one
    event loop and across processes (:class:`~specdec_rt.engine.tune_cache.TuneLock`): engines
    and servers started at once share one measurement. One that finds another process
    measuring waits (a progress line says so) at most ``lock_wait_s`` seconds, then reads what
    it stored; past that, or where the lock cannot be taken (no ``fcntl``, a read-only folder),
    it measures on its own, with a warning (``tune.unlocked``). Raises
    :class:`SpecDecError` when no configuration could be measured."""

    def look():  # (reads and hashes files: off the event loop)
        home = home_manifest(name_or_path)
        key = tune_key(home, threads=threads, slots=slots, provider=provider)
        return home, key, {(c.precision, c.draft) for c in configs_for(home)}

    home, key, measurable = await anyio.to_thread.run_sync(look)
    # one measurement of a key at a time: engines loaded at once (asyncio.gather) or processes
    # started at once (two servers, a server and `tune`, Ray Serve replicas on one node) would
    # measure side by side, slowing each other, and could each choose differently; the ones that
    # waited read what the first stored. The event loop's lock orders this process's calls; the
    # file's (flock) orders processes, and loops on other threads of this one.
    async with _lock(cache_path(key)):
        across = TuneLock(lock_path(key))
        try:
            unlocked = await _take(across, home.name, say, lock_wait_s)
            settings = {"threads": threads, "slots": slots, "provider": provider, "max_length": max_length}
            return await _read_or_measure(home, key, measurable, load, force, say, unlocked, settings)
        finally:
            across.release()


async def _take(lock: TuneLock, model: str, say: Say | None, wait_s: float) -> str:
    """Hold ``lock``, waiting at most ``wait_s`` while another process holds it: ``""`` once
    held, else why it is not (it cannot be locked here, or the wait ran out)."""
    start, waiting = time.monotonic(), False
    while True:
        try:
            if await anyio.to_thread.run_sync(lock.try_acquire):
                if waiting:
                    _stderr_or_log(say)(f"the other process is done after {time.monotonic() - start:.0f} s")
                return ""
        except OSError as exc:
            return f"cannot lock {lock.path}: {type(exc).__name__}: {exc}"[:300]
        if not waiting:
            waiting = True
            _stderr_or_log(say)(
                f"waiting for another process measuring {model} on this machine (at most {wait_s:.0f} s; "
                f"lock {lock.path})"
            )
        if time.monotonic() - start >= wait_s:
            return f"waited {wait_s:.0f} s for another process measuring {model}, holding {lock.path}"
        await anyio.sleep(LOCK_POLL_S)


async def _read_or_measure(
    home, key, measurable, load: Load, force: bool, say: Say | None, unlocked: str, settings: dict
) -> Tuned:
    """The cached choice for ``key``, else (or ``force``) measured now and stored; ``unlocked``:
    why this process measures without the lock (warned before it does), or ``""``."""
    cached = None if force else await anyio.to_thread.run_sync(read_cached, key)
    # the file is untrusted: only a configuration this folder offers is loaded (a draft
    # named there could be any folder, or one no longer listed)
    if cached is not None and cached.best is not None:
        if (cached.best.precision, cached.best.draft) in measurable:
            return Tuned(cached.best.precision, cached.best.draft, "cached", cached, cache_path(key))
        log.warning(
            "tune.cache_ignored",
            path=str(cache_path(key)),
            error=f"its choice {cached.best.precision} {cached.best.draft!r} is not one this folder offers",
        )
    if unlocked:
        log.warning(
            "tune.unlocked",
            reason=unlocked,
            message=f"measuring {home.name} without the lock: a process measuring it at once would "
            "disturb this measurement and be disturbed by it, and the last to finish stores its choice",
        )
    result = await measure(home.folder, load, say=say, **settings)
    best = result.best
    if best is None:
        raise SpecDecError(f"{home.folder}: no configuration could be measured (see the tune table's notes)")
    path = await anyio.to_thread.run_sync(write_cached, key, result)
    _stderr_or_log(say)(
        f"chose {best.precision} target, draft {best.draft}: {best.tok_s_1:.1f} tok/s alone, "
        f"{best.tok_s_c:.1f} tok/s at {best.concurrency} at once" + (f" (kept in {path})" if path else "")
    )
    return Tuned(best.precision, best.draft, "tuned", result, path)
