"""``precision="auto"``: measure which target and draft of an export folder run fastest here.

Which configuration wins depends on the CPU: int8 activations pay on AVX-512 VNNI and AMX, less
on AVX2 alone, and a draft pays only while it is much cheaper than its target. So the choice is
measured on the machine, once, and kept (:mod:`specdec_rt.engine.tune_cache`).

What is measured (:func:`measure`): for each target the folder offers
(:func:`~specdec_rt.engine.factory.target_candidates`), plain decoding (``"none"``), n-gram
lookup (``"ngram"``) and n-gram lookup with the first :data:`MAX_MODEL_DRAFTS` draft models that
read at most half the target's weight bytes (``"ngram+q8"``;
:func:`~specdec_rt.engine.factory.cheaper_drafts`): every engine loaded as ``Engine.load``
would load it (with a shorter warm-up), then :data:`TUNE_PROMPTS` (fixed prompts in three
categories, chat, code and extraction, whatever the model is for: a draft may pay on one
alone; plain text to a model without a chat template, as Gemma 3 270M's base model;
:data:`TUNE_TOKENS` greedy tokens each, as long as real answers, end of sequence ignored) in
rounds, the configurations interleaved within each step of a round (in an order that rotates)
so that a machine that slows down or speeds up meanwhile weighs on all alike. A round:

1. one stream: each configuration generates one prompt of each category alone (end-to-end
   tok/s, per category);
2. several at once: each generates ``min(4, slots)`` prompts of mixed categories at once
   (summed tok/s, as a server's batches run).

The first round measures every configuration. Then rounds go on while the leader's and the
runner-up's scores are not told apart (their ranges over rounds, each widened by
:data:`NOISE`, overlap), the time budget (:data:`TUNE_BUDGET_S`) allows the next and fewer than
:data:`MAX_ROUNDS` ran, measuring only the configurations still in reach of the leader (and
their targets' plain decoding, the reference). A configuration's rates are medians: per
category over rounds, one stream being their geometric mean; its greedy output must equal plain
decoding's of the same target, token for token, on every prompt, one stream and several alike,
or it is disqualified (and reported). The winner (:func:`pick`): the highest score
(:attr:`~specdec_rt.engine.tune_cache.TuneRow.score`: one stream ^ 2/3 x several at once ^ 1/3)
among exact configurations, except that a less precise target must beat a more precise one by
more than :data:`PICK_MARGIN`, and that a draft model which pays on one category stays
(:data:`DRAFT_WIN`, :data:`DRAFT_SLACK`): the per-request acceptance tracker falls back to plain
decoding on requests where it does not pay, so losing a little on the others is the smaller cost.
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from ..errors import SpecDecError
from ..logs import get_logger
from .factory import cheaper_drafts, home_manifest, target_candidates
from .tune_cache import (
    CategoryRate,
    TuneLock,
    TuneResult,
    TuneRow,
    cache_path,
    lock_path,
    read_cached,
    score,
    tune_key,
    write_cached,
)

__all__ = [
    "TUNE_PROMPTS",
    "TUNE_TOKENS",
    "TUNE_BUDGET_S",
    "MAX_MODEL_DRAFTS",
    "DRAFT_WIN",
    "DRAFT_SLACK",
    "Config",
    "Tuned",
    "configs_for",
    "measure",
    "pick",
    "kept_draft",
    "choose",
]

if TYPE_CHECKING:
    from ..ort import Manifest

log = get_logger("specdec_rt.engine.tune")

# (category, prompt): what a server gets (chat), what coder models are for (code, measured for
# every model: nothing in a manifest says what a model is for) and answers that copy from their
# prompt (extraction, where n-gram lookup pays); two of each, in no benchmark prompt set
TUNE_PROMPTS: tuple[tuple[str, str], ...] = (
    ("chat", "Explain how a refrigerator keeps food cold."),
    ("code", "Write a Python function that merges two sorted lists into one sorted list, with a docstring."),
    (
        "extract",
        "Extract the payer, date, amount and payee from this text as JSON: On 14 March 2024 Maria Lopez "
        "paid 1,250 euros to Northwind Traders for office furniture, invoice 2024-117.",
    ),
    ("chat", "What are the pros and cons of working from home?"),
    ("code", "Write a Python class for a stack with push, pop and peek methods that raise when it is empty."),
    (
        "extract",
        "List every city in this paragraph with its country, one per line: The tour starts in Lisbon, "
        "Portugal, crosses to Seville and Madrid in Spain, flies to Lyon, France, and ends in Turin, Italy.",
    ),
)
TUNE_TOKENS = 96  # per answer: a draft's prefill is paid once per request, as long answers amortise it
TUNE_BUDGET_S = 60.0  # measuring, after the loads: rounds past the first stop once the next would pass it
MAX_ROUNDS = 6
NOISE = 0.03  # a score's range over rounds is widened by 3% each way before ranges are compared
TUNE_MAX_LENGTH = 512  # KV per request in the tuning engines: a prompt and its tokens fit
MAX_MODEL_DRAFTS = 1  # draft models measured per target: the manifest's first cheap enough one
AT_ONCE = 4  # requests at once in the "several" measurement (or slots, if fewer)
PICK_MARGIN = 0.05  # a less precise target must score more than 5% above a more precise one
DRAFT_WIN = 0.10  # a draft model "pays" on a category where its one-stream rate beats the pick's by > 10%
DRAFT_SLACK = 0.15  # ... and then is chosen instead if its score is within 15% of the pick's
# waiting for another process's measurement of the same key: its loads (26 s of 89 on a busy
# 2-core machine, the default model, 2026-12-03) and its rounds (one round of the default model
# took up to 4 minutes there), with room for a slower machine or model
LOCK_WAIT_S = 600.0
LOCK_POLL_S = 0.25  # how often a waiting process tries the lock

Say = Callable[[str], None]
Load = Callable[..., Awaitable[Any]]  # Engine.load
Prompts = Sequence[tuple[str, str]]  # (category, text)


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
    one: dict[str, list[float]] = field(default_factory=dict)  # category -> tok/s alone, per prompt run
    many: list[float] = field(default_factory=list)  # tok/s summed, several at once, per round
    drafted: dict[str, int] = field(default_factory=dict)  # per category (one stream); "" several at once
    accepted: dict[str, int] = field(default_factory=dict)
    scores: list[float] = field(default_factory=list)  # the score of each round it ran
    round_one: dict[str, float] = field(default_factory=dict)  # this round's rates, per category
    round_many: float = 0.0
    mismatch: str = ""  # the first prompt whose output left plain decoding's
    failed: str = ""  # why it did not run

    @property
    def ok(self) -> bool:
        return not self.failed and not self.mismatch

    def add(self, kind: str, rate: float, results: Sequence[Any]) -> None:
        """One step's tok/s and drafts; ``kind``: the category alone ("": several at once)."""
        if kind:
            self.one.setdefault(kind, []).append(rate)
            self.round_one[kind] = rate
        else:
            self.many.append(rate)
            self.round_many = rate
        self.drafted[kind] = self.drafted.get(kind, 0) + sum(x.stats.drafted for x in results)
        self.accepted[kind] = self.accepted.get(kind, 0) + sum(x.stats.accepted for x in results)


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


def configs_for(home: Manifest) -> list[Config]:
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
    folder: str | os.PathLike[str],
    load: Load,
    *,
    threads: int | None = None,
    slots: int = 8,
    provider: str = "auto",
    max_length: int | None = None,
    budget_s: float = TUNE_BUDGET_S,
    prompts: Prompts = TUNE_PROMPTS,
    tokens: int = TUNE_TOKENS,
    say: Say | None = None,
) -> TuneResult:
    """Measure every configuration of ``folder`` (see the module's docstring) and pick the
    winner. ``load``: :meth:`Engine.load <specdec_rt.engine.engine.Engine.load>` (passed in:
    the engine imports this module). ``prompts``: ``(category, text)`` pairs. ``say``: progress
    lines (default: the ``specdec_rt.engine.tune`` logger, info)."""
    say = _stderr_or_log(say)
    t0 = time.perf_counter()
    home = await anyio.to_thread.run_sync(home_manifest, folder)  # (reads files: off the event loop)
    configs = await anyio.to_thread.run_sync(configs_for, home)
    plan = _Plan.of(prompts, slots=slots, max_length=max_length, tokens=tokens)
    bench = _Bench(configs, plan)
    say(
        f"tuning {home.name} on this machine (once per machine, model and settings): "
        f"{len(configs)} configurations, {len({c.engine for c in configs})} engines, "
        f"{len(plan.kinds)} prompt categories, {plan.tokens} tokens an answer"
    )
    try:
        await bench.load(home.folder, load, threads=threads, slots=slots, provider=provider)
        loaded = time.perf_counter()
        say(f"loaded in {loaded - t0:.1f} s; measuring for at most {budget_s:.0f} s after the first round")
        rounds = await bench.rounds(loaded + budget_s, say)
    finally:
        with anyio.CancelScope(shield=True):  # cancelled (a server stopped while tuning): close them still
            await bench.aclose()
    rows = [_row(c, bench.samples[c], plan.at_once, plan.kinds) for c in configs]
    result = TuneResult(
        rows=rows, chosen=pick(rows), rounds=rounds, seconds=time.perf_counter() - t0, tokens=plan.tokens
    )
    for row in rows:
        if not row.exact:
            say(f"left out: {row.precision} {row.draft}: {row.note}")
    return result


@dataclass(frozen=True)
class _Plan:
    """What a measurement runs: ``prompts`` and their categories (``kinds``, in order, and
    ``of_kind``: each one's prompt indices), requests ``at_once`` in the several-at-once step,
    greedy ``tokens`` an answer and the engines' ``max_length``."""

    prompts: Prompts
    kinds: list[str]
    of_kind: dict[str, list[int]]
    at_once: int
    tokens: int
    length: int

    @classmethod
    def of(cls, prompts: Prompts, *, slots: int, max_length: int | None, tokens: int) -> _Plan:
        kinds = list(dict.fromkeys(kind for kind, _ in prompts))
        length = min(max_length or TUNE_MAX_LENGTH, TUNE_MAX_LENGTH)
        return cls(
            prompts=prompts,
            kinds=kinds,
            of_kind={k: [i for i, (kind, _) in enumerate(prompts) if kind == k] for k in kinds},
            at_once=max(1, min(AT_ONCE, slots, len(prompts))),
            tokens=max(1, min(tokens, length // 2)),  # a short context keeps room for the prompt
            length=length,
        )

    def steps(self, round_no: int) -> list[tuple[str, tuple[int, ...]]]:
        """Round ``round_no``'s steps: ``(category, prompt indices)``, one prompt of each
        category alone, then ``("", at_once prompts)`` together (the prompts rotate by round)."""
        steps = [(k, (self.of_kind[k][round_no % len(self.of_kind[k])],)) for k in self.kinds]
        together = tuple((round_no * self.at_once + i) % len(self.prompts) for i in range(self.at_once))
        return [*steps, ("", together)]


class _Bench:
    """The engines of one measurement (one per target and draft loaded) and what each
    configuration measured on them."""

    def __init__(self, configs: list[Config], plan: _Plan) -> None:
        self.configs, self.plan = configs, plan
        self.samples = {c: _Samples() for c in configs}
        self.engines: dict[tuple[str, str], Any] = {}
        self.chat: list[Any] = [[{"role": "user", "content": text}] for _, text in plan.prompts]
        #: plain decoding's ids, by (precision, prompts, several at once): the reference
        self.plain: dict[tuple[str, tuple[int, ...], bool], list[list[int]]] = {}

    async def load(self, folder: Path, load: Load, *, threads: int | None, slots: int, provider: str) -> None:
        """Load every engine as ``Engine.load`` would (a short warm-up); one that fails leaves
        its configurations out, with why."""
        for key in dict.fromkeys(c.engine for c in self.configs):
            try:
                self.engines[key] = await load(
                    folder,
                    draft=key[1],
                    precision=key[0],
                    threads=threads,
                    provider=provider,
                    slots=slots,
                    max_length=self.plan.length,
                    prefix_cache=False,  # rounds repeat prompts: each must be computed
                    warmup=False,
                )
                await self.engines[key].warm_up(1, 8)  # a short one: costs go on being measured as it runs
            except SpecDecError as exc:
                for c in self.configs:
                    if c.engine == key:
                        self.samples[c].failed = f"did not load: {exc}"[:280]
        if any(e.codec.chat_template is None for e in self.engines.values()):
            self.chat = [text for _, text in self.plan.prompts]  # no chat template (Gemma 3 270M): plain text

    async def rounds(self, deadline: float, say: Say) -> int:
        """Measure rounds until the leader is told apart, :data:`MAX_ROUNDS` ran or the next
        round would end past ``deadline`` (a ``perf_counter`` time); the rounds run."""
        rounds, live = 0, [c for c in self.configs if c.engine in self.engines]
        while live:
            start = time.perf_counter()
            order = live[rounds % len(live) :] + live[: rounds % len(live)]
            await self.round(order, rounds)
            rounds += 1
            each = time.perf_counter() - start
            say(f"round {rounds}: {len(order)} configurations in {each:.1f} s")
            following = _contenders(self.configs, self.samples, self.plan.kinds, self.plan.at_once)
            if not following:
                break  # told apart (or nothing left to tell apart)
            if rounds >= MAX_ROUNDS or time.perf_counter() + each * len(following) / len(order) > deadline:
                say(f"stopping with {len(following)} configurations not yet told apart: budget or rounds spent")
                break
            live = following
        return rounds

    async def round(self, order: list[Config], round_no: int) -> None:
        """One round of ``order``'s configurations, interleaved within each step, plain
        decoding first (the reference); then each one's score for the round."""
        for kind, picked in self.plan.steps(round_no):
            for config in sorted(order, key=lambda c: c.mode != "ar"):
                if self.samples[config].ok:
                    await self.run(config, kind, picked)
        for config in order:
            sample = self.samples[config]
            if sample.ok and len(sample.round_one) == len(self.plan.kinds) and sample.round_many:
                sample.scores.append(score(_geomean(list(sample.round_one.values())), sample.round_many))
            sample.round_one, sample.round_many = {}, 0.0

    async def run(self, c: Config, kind: str, picked: tuple[int, ...]) -> None:
        """``c`` on the prompts ``picked`` at once; ``kind``: their category ("": several at once)."""
        sample = self.samples[c]
        took = time.perf_counter()
        try:
            results = await asyncio.gather(
                *[
                    self.engines[c.engine].generate(
                        self.chat[i],
                        max_new_tokens=self.plan.tokens,
                        mode=c.mode,
                        ignore_eos=True,
                        truncate_prompt=True,
                    )
                    for i in picked
                ]
            )
        except SpecDecError as exc:  # left out, reported; the others go on
            sample.failed = f"failed: {type(exc).__name__}: {exc}"[:280]
            return
        sample.add(kind, sum(x.stats.new_tokens for x in results) / (time.perf_counter() - took), results)
        self.check(c, kind, picked, [list(x.token_ids) for x in results])

    def check(self, c: Config, kind: str, picked: tuple[int, ...], ids: list[list[int]]) -> None:
        """Keep plain decoding's output as the reference; mark a configuration whose output
        differs from it."""
        sample, ref = self.samples[c], (c.precision, picked, not kind)
        if c.mode == "ar":
            self.plain[ref] = ids
        elif ref not in self.plain:
            sample.failed = "plain decoding of its target failed: nothing to check it against"
        elif ids != self.plain[ref] and not sample.mismatch:
            sample.mismatch = f"differs from plain decoding on prompt {picked[0] + 1}" + ("" if kind else " (batched)")

    async def aclose(self) -> None:
        for engine in self.engines.values():
            await engine.aclose()


def _geomean(values: Sequence[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values and min(values) > 0 else 0.0


def _contenders(configs: list[Config], samples: dict[Config, _Samples], kinds: list[str], at_once: int) -> list[Config]:
    """The configurations the next round measures: none when the leader's score range (over
    rounds, widened by :data:`NOISE`) is clear of every other's; else the leader, those whose
    ranges reach it, and their targets' plain decoding (the reference their output is checked
    against)."""
    ranked = sorted(
        (c for c in configs if samples[c].ok and samples[c].scores),
        key=lambda c: -_row(c, samples[c], at_once, kinds).score,
    )
    if len(ranked) < 2:
        return []
    floor = min(samples[ranked[0]].scores) * (1 - NOISE)
    close = [c for c in ranked[1:] if max(samples[c].scores) * (1 + NOISE) >= floor]
    if not close:
        return []
    keep = {ranked[0], *close}
    keep |= {Config(c.precision, "none") for c in keep}
    return [c for c in configs if c in keep and samples[c].ok]


def _row(c: Config, s: _Samples, at_once: int, kinds: list[str]) -> TuneRow:
    ok = all(s.one.get(k) for k in kinds) and bool(s.many) and s.ok
    categories = tuple(
        CategoryRate(k, statistics.median(s.one[k]), s.accepted.get(k, 0) / s.drafted[k] if s.drafted.get(k) else 0.0)
        for k in kinds
        if s.one.get(k)
    )
    drafted, accepted = sum(s.drafted.values()), sum(s.accepted.values())
    return TuneRow(
        precision=c.precision,
        draft=c.draft,
        tok_s_1=_geomean([r.tok_s_1 for r in categories]) if len(categories) == len(kinds) else 0.0,
        tok_s_c=statistics.median(s.many) if s.many else 0.0,
        concurrency=at_once,
        acceptance=accepted / drafted if drafted else 0.0,
        exact=ok,
        note=s.failed or s.mismatch,
        categories=categories,
    )


def pick(rows: list[TuneRow]) -> int | None:
    """The index of the winning row, or None when no row is exact: among exact rows, the first
    precision (in the rows' order: the folder's own target first, then its copies as listed)
    whose best score is within :data:`PICK_MARGIN` of the best of all, and its best row (the
    first on a tie). A copy that is barely faster does not displace a more precise target: a
    round or two on a busy machine cannot tell them apart, and the more precise one is closer
    to the float32 weights. Then :func:`kept_draft` may keep a draft model of that precision."""
    exact = [i for i, row in enumerate(rows) if row.exact]
    if not exact:
        return None
    top = max(rows[i].score for i in exact)
    for precision in dict.fromkeys(rows[i].precision for i in exact):
        mine = [i for i in exact if rows[i].precision == precision]
        best = max(mine, key=lambda i: (rows[i].score, -i))
        if rows[best].score >= (1 - PICK_MARGIN) * top:
            kept = kept_draft(rows, best)
            return best if kept is None else kept[0]
    return None  # (unreachable: the top row's precision qualifies)


def has_model_draft(row: TuneRow) -> bool:
    """Whether ``row`` drafts with a model (``ngram+q8``), not n-gram lookup alone or nothing."""
    return row.draft not in ("none", "ngram")


def kept_draft(rows: list[TuneRow], best: int) -> tuple[int, str, float] | None:
    """The draft rule: when the best row ``best`` drafts with no model, an exact row of its
    precision that does, whose one-stream rate beats ``best``'s by more than :data:`DRAFT_WIN`
    on at least one prompt category and whose score is at least ``1 - DRAFT_SLACK`` times
    ``best``'s, is chosen instead (the highest scoring such row): ``(its index, the category
    where it gains most, that gain as a ratio)``; None when there is none. The per-request
    acceptance tracker falls back to plain decoding on requests where the draft does not pay,
    so it costs little on the categories where it loses, while on the one where it wins (code,
    for a coder model) it is what users would run."""
    if has_model_draft(rows[best]):
        return None
    found: list[tuple[int, str, float]] = []
    for i, row in enumerate(rows):
        if not (row.exact and row.precision == rows[best].precision and has_model_draft(row)):
            continue
        if row.score < (1 - DRAFT_SLACK) * rows[best].score:
            continue
        gains = []
        for mine in row.categories:
            theirs = rows[best].category(mine.category)
            if theirs is not None and theirs.tok_s_1 > 0:
                gains.append((mine.tok_s_1 / theirs.tok_s_1, mine.category))
        if gains and max(gains)[0] > 1 + DRAFT_WIN:
            gain, kind = max(gains)
            found.append((i, kind, gain))
    return max(found, key=lambda f: (rows[f[0]].score, -f[0])) if found else None


def why_chosen(result: TuneResult) -> str:
    """``"; kept for its draft: 1.41x on code"`` when the draft rule chose the winner, else ``""``."""
    rows, chosen = result.rows, result.chosen
    if chosen is None or not has_model_draft(rows[chosen]):
        return ""
    mine = [i for i, r in enumerate(rows) if r.exact and r.precision == rows[chosen].precision]
    best = max(mine, key=lambda i: (rows[i].score, -i))
    kept = kept_draft(rows, best) if best != chosen else None
    return (
        ""
        if kept is None
        else f"; kept for its draft: {kept[2]:.2f}x on {kept[1]}, score {rows[chosen].score / rows[best].score:.2f}x"
    )


_LOCKS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Path, asyncio.Lock]]" = weakref.WeakKeyDictionary()


def _lock(path: Path) -> asyncio.Lock:
    """The running event loop's lock for one tune cache file (an asyncio lock serves one loop)."""
    locks = _LOCKS.setdefault(asyncio.get_running_loop(), {})
    return locks.setdefault(path, asyncio.Lock())


async def choose(
    name_or_path: str | os.PathLike[str],
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

    def look() -> tuple[Manifest, dict[str, Any], set[tuple[str, str]]]:  # (reads files: off the event loop)
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
            return await _read_or_measure(
                home, key, measurable, load, force=force, say=say, unlocked=unlocked, settings=settings
            )
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
    home: Manifest,
    key: dict[str, Any],
    measurable: set[tuple[str, str]],
    load: Load,
    *,
    force: bool,
    say: Say | None,
    unlocked: str,
    settings: dict[str, Any],
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
        f"{best.tok_s_c:.1f} tok/s at {best.concurrency} at once{why_chosen(result)}"
        + (f" (kept in {path})" if path else "")
    )
    return Tuned(best.precision, best.draft, "tuned", result, path)
