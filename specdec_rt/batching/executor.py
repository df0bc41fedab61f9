"""The step loop that batches model calls across requests (continuous batching).

Every request runs its own scheduler loop (:mod:`specdec_rt.speculation.scheduler`: choose k, draft, verify,
commit, observe, emit), and every model call it makes ends here, in one :class:`BatchExecutor`
per engine. Each iteration of the executor's loop:

1. **gather**: let every request that is ready submit its next call (the event loop runs until
   no new call arrives, or until every running request has one in, ``clients``), so the rows of
   concurrent requests meet in one iteration;
2. **batch**: per model, every call of at most ``RAGGED_MAX`` new positions (plain decoding
   rows, draft steps, verifies over k+1 positions) becomes **one** call over the requests' KV
   slots: ``run_rows_sync`` for a model whose graph is packed (``caps.ragged``: several
   positions per row, each row costing its real positions), else ``run_batch_sync`` for the
   single-token steps. Longer calls (the rest of a long prompt) run one request at a time, cut
   into chunks of ``chunk`` positions while other rows wait, so a new prompt never stalls the
   batch for more than one chunk; the first prompts of requests that arrive together are
   prefilled in one call (``run_prefill_batch_sync``). While a *lead* model (a draft model,
   ``lead``) has calls, the other models' calls wait for the next iteration, so the rows of a
   batch draft together, then verify together;
3. **run**: one call at a time, in a worker thread (one call already uses every core; a request
   alone runs its short single-token steps on the loop's thread, ``INLINE_MAX_S``), then
   resolve the callers' futures and record the call's cost (seconds per rows and positions).

Requests join and leave between iterations. Exports from before packing cannot take several
positions per row with a past (ONNX Runtime's CPU GroupQueryAttention needs ``query_seqlens``
for that), so their verifies run one request at a time.

A model takes part through the Protocols below, :class:`BatchedSession` and
:class:`BatchedModel`: synchronous methods run in the worker thread, and the flags of its
:class:`~specdec_rt.speculation.protocols.ModelCaps` say which batched forms it offers. Every batched
method sets each session's ``length`` as soon as its KV entries are written (also per chunk), so
a batched call can tell which positions of every slot are free to scribble on.

Cancellation: a caller cancelled while its call waits is dropped from the queue; a call already
running finishes and its result is discarded (the session's cache then holds positions its owner
never saw, which the next call rolls back), and a session closed meanwhile clears its IO binding
only when that call has returned (:meth:`BatchExecutor.after_call`). :meth:`aclose` stops the
loop after the call in flight, so model buffers are never freed under a running call; waiting
callers get ``EngineClosedError``.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Callable, Protocol, Sequence, cast, runtime_checkable

import anyio
import numpy as np

from ..errors import EngineClosedError, InferenceError, SpecDecError
from ..logs import get_logger
from ..speculation.protocols import ModelCaps, check_implements

__all__ = ["BatchExecutor", "BatchedModel", "BatchedSession"]

log = get_logger("specdec_rt.batching.executor")

GATHER_PASSES = 32  # most event-loop passes spent gathering calls before a batch is cut
GATHER_STABLE = 4  # ... and it is cut after this many passes in a row brought no new call
COST_SAMPLES = 16  # batched step times kept per batch size
ALONE_CHUNKS = 2  # with nobody waiting, a long call is fed ALONE_CHUNKS * chunk positions at a time
RAGGED_MAX = 16  # most new positions of a call batched with other rows (more: run alone, in chunks)
# A request alone runs its single-token steps that measured at most this many seconds on the
# event loop's own thread, saving the hand-over to the worker (docs/decisions/0004-inline-small-steps.md)
INLINE_MAX_S = 0.015

#: a model call's work, run in the worker thread: one result a call (None: not finished yet)
_Job = Callable[[], "list[Any]"]


class BatchedModel(Protocol):
    """What the step loop calls on a model, in its worker thread. ``caps`` says which of these
    exist (a method whose flag is False is never called, and need not be written)."""

    caps: ModelCaps

    def run_batch_sync(self, sessions: Sequence["BatchedSession"], ids: np.ndarray, pasts: np.ndarray) -> np.ndarray:
        """``caps.batched_steps``: one new token per session, ``ids`` [B] after ``pasts`` [B]
        cached tokens; logits [B, V]."""
        raise NotImplementedError

    def run_rows_sync(
        self, sessions: Sequence["BatchedSession"], feeds: Sequence[np.ndarray], wants: Sequence[int]
    ) -> list[np.ndarray]:
        """``caps.ragged``: ``feeds[i]`` [S_i] new tokens for session i in one call; the logits of
        the last ``wants[i]`` of each, ``[B][wants_i, V]``."""
        raise NotImplementedError

    def can_prefill_together(self, sessions: Sequence["BatchedSession"]) -> bool:
        """``caps.batched_prefill``: whether these sessions' first prompts fit one call."""
        return False

    def run_prefill_batch_sync(self, sessions: Sequence["BatchedSession"], prompts: Sequence[np.ndarray]) -> np.ndarray:
        """``caps.batched_prefill``: first prompts [B][S_i] in one call; last logits [B, V]."""
        raise NotImplementedError


@runtime_checkable
class BatchedSession(Protocol):
    """One request's slot as the step loop runs it. ``settled``: False while its cache is not yet
    what ``length`` says (a prefix copy under way): its calls then run alone. ``waits_for``: the
    session whose prompt it copies at its first call, while that one has not computed it."""

    model: BatchedModel
    settled: bool = True
    waits_for: "BatchedSession | None" = None

    @property
    def length(self) -> int:
        """Tokens whose KV entries the cache holds."""
        ...

    def run_sync(self, ids: np.ndarray, rows: int, past: int, **extra: Any) -> Any:
        """Feed ``ids`` [S] after ``past`` cached tokens; the logits of the last ``rows``."""
        ...


@dataclass(eq=False)
class _Call:
    session: BatchedSession
    ids: np.ndarray  # [S] int64
    rows: int  # logits rows wanted (of the last positions)
    extra: dict[str, Any]
    future: asyncio.Future[Any]  # the logits (or logits and hidden states) of the call
    done: int = 0  # positions already fed (chunked calls)
    hidden: list[np.ndarray] = field(default_factory=list)  # hidden states of fed chunks, when asked for

    @property
    def model(self) -> BatchedModel:
        return self.session.model

    @property
    def fresh(self) -> bool:
        """A first prompt (nothing cached yet) that may be prefilled with other first prompts."""
        return (
            self.session.length == 0
            and self.done == 0
            and self.ids.size > 1
            and self.rows == 1
            and not self.extra
            and self.model.caps.batched_prefill
        )

    @property
    def batchable(self) -> bool:
        return (
            self.ids.size == 1
            and self.rows == 1
            and not self.extra
            and self.session.settled
            and self.model.caps.batched_steps
        )

    @property
    def raggable(self) -> bool:
        """A few new positions (a verify, a draft catching up) that a ragged model (one that
        takes new positions per row) runs in one call with other rows."""
        return (
            1 < self.ids.size <= RAGGED_MAX
            and self.done == 0
            and not self.extra
            and not self.fresh
            and self.session.settled
            and self.model.caps.ragged
        )

    @property
    def source(self) -> BatchedSession | None:
        """The running session whose prompt this one copies at its first call, while that
        session has not computed it yet."""
        return self.session.waits_for


class BatchExecutor:
    """Runs the model calls of one engine (all its models), batching across requests.

    ``chunk``: longest piece of a multi-position call run while other rows wait.
    ``listeners``: callables ``f(model, rows, seconds)`` told about every model call.
    """

    def __init__(self, chunk: int = 64) -> None:
        self.chunk = max(1, int(chunk))
        self.listeners: list[Callable[[Any, int, float], None]] = []
        self._pending: list[_Call] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        #: (id(model), rows, positions) -> recent seconds
        self._step_s: dict[tuple[int, int, int], collections.deque[float]] = {}
        self._least: dict[tuple[int, int, int], float] = {}  # ... -> the least of them (asked every round)
        self._shapes: dict[tuple[int, int], list[int]] = {}  # (id(model), rows) -> measured positions, sorted
        self._seen: set[tuple[int, int, int]] = set()
        self._chores: dict[int, Callable[[], Any]] = {}  # idle-time work (see chore)
        self._chore: Any = None  # the piece of idle-time work under way
        self._busy: set[int] = set()  # ids of the sessions whose call runs in the worker thread now
        self._after: list[Callable[[], Any]] = []  # what waits for that call to return (after_call)
        self.calls = 0
        #: ids of the models whose calls go first (draft models): others wait while they have calls
        self.lead: set[int] = set()
        #: how many requests may submit calls now (an Engine's running requests); once that many
        #: calls are in, gathering stops at once (a request alone pays no gathering passes).
        #: None: unknown, gather until no new call arrives
        self.clients: Callable[[], int] | None = None

    # ------------------------------------------------------------------ the callers' side
    async def extend(self, session: object, ids: np.ndarray, rows: int, **extra: Any) -> Any:
        """Feed ``ids`` ``[S]`` to ``session`` and return the logits of the last ``rows``
        positions (``(logits, hidden)`` with ``hidden=True``), batched with other requests."""
        if self._closed:
            raise EngineClosedError("the engine is closed")
        check_implements(session, BatchedSession, "session")  # a plug-in's, named here, not deep in the loop
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._wake is None:  # (the event comes with the task)
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._loop(self._wake), name="specdec-batch-executor")
        checked = cast(BatchedSession, session)  # (check_implements above)
        call = _Call(checked, np.asarray(ids, dtype=np.int64), rows, extra, loop.create_future())
        self._pending.append(call)
        self._wake.set()
        try:
            return await call.future
        finally:
            if not call.future.done():  # cancelled while waiting: leave the queue
                call.future.cancel()
                if call in self._pending:
                    self._pending.remove(call)

    def after_call(self, session: object, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` now, or, while a call of ``session`` runs in the worker thread, as soon
        as that call returns (on the event loop). A session that closes (its request cancelled
        mid-call) clears its IO binding this way, never under a running call."""
        if id(session) in self._busy:
            self._after.append(fn)
        else:
            fn()

    def chore(self, fn: Callable[[], Any]) -> None:
        """Idle-time work: while no call waits, ``fn()`` (on the event loop) returns a job with
        ``step() -> bool`` (more to do), whose steps run in the worker thread, one at a time,
        until it is done or a call arrives; then ``fn`` is asked again, until it returns None.
        (The prefix cache copies finished requests' KV out this way, a layer per step, so the
        next request's first token does not wait for it.)"""
        self._chores[id(fn)] = fn
        if self._wake is not None:
            self._wake.set()

    async def _idle_work(self) -> bool:
        """One step of idle-time work; False if there is none."""
        while self._chore is None:
            if not self._chores:
                return False
            key = next(iter(self._chores))
            self._chore = self._chores[key]()
            if self._chore is None:
                del self._chores[key]
        try:
            more = await anyio.to_thread.run_sync(self._chore.step)
        except Exception as exc:  # noqa: BLE001 - idle work is an optimisation: log it, go on
            log.warning("executor.chore_failed", error=f"{type(exc).__name__}: {exc}")
            more = False
        if not more:
            self._chore = None
        return True

    def step_seconds(self, model: object, rows: int, positions: int | None = None) -> float | None:
        """Measured seconds of one batched call of ``rows`` rows and ``positions`` new positions
        in all (default ``rows``: a single-token step), None if not measured yet: the least of the
        recent samples, since timing noise on a shared machine only adds."""
        return self._least.get((id(model), rows, positions or rows))

    def record(self, model: object, rows: int, positions: int, seconds: float) -> None:
        """One batched call's cost, seconds for ``rows`` rows and ``positions`` new positions in all."""
        key = (id(model), rows, positions)
        self._seen.add(key)
        recent = self._step_s.get(key)
        if recent is None:
            recent = self._step_s[key] = collections.deque(maxlen=COST_SAMPLES)
            bisect.insort(self._shapes.setdefault(key[:2], []), positions)
        recent.append(seconds)
        self._least[key] = min(recent)

    def measured_positions(self, model: object, rows: int) -> list[int]:
        """The position counts (sorted) of the batched calls of ``rows`` rows measured so far."""
        return self._shapes.get((id(model), rows), [])

    async def aclose(self) -> None:
        """Stop after the call in flight; calls still waiting fail with ``EngineClosedError``."""
        self._closed = True
        for call in self._pending:
            if not call.future.done():
                call.future.set_exception(EngineClosedError("the engine was closed"))
        self._pending.clear()
        task, wake = self._task, self._wake
        if task is not None and wake is not None and not task.done() and task.get_loop() is asyncio.get_running_loop():
            wake.set()  # (a task of an event loop that has ended runs no call)
            with anyio.CancelScope(shield=True):
                await asyncio.wait([task])

    # ------------------------------------------------------------------ the loop
    async def _loop(self, wake: asyncio.Event) -> None:
        """Run the queued calls until closed; ``wake`` is set when a call is queued."""
        while not self._closed:
            if not self._pending:
                if await self._idle_work():
                    continue
                wake.clear()
                await wake.wait()
                continue
            await self._gather()  # 1. gather: every request that is ready submits its call
            calls, later = self._take()
            groups, prompts, singles = self._group(calls)  # 2. batch
            # 3. run: one call at a time in a worker thread, results out as soon as they exist
            for group in groups.values():
                await self._run(group, self._batch_job)
            for group in prompts.values():  # new requests' prompts (their first pieces) together
                await self._run(group, self._prefill_job)
            for call in singles:
                await self._run([call], lambda calls: self._single_job(calls[0]))
            # 4. every call taken is answered, or (a long one, part fed) waits for the next turn
            self._pending.extend(c for c in calls + later if not c.future.done() and c not in self._pending)

    async def _gather(self) -> None:
        """Let every request that is ready submit its call before the batch is cut (a request
        needs a few event-loop passes from its last result to its next call)."""
        seen, stable = len(self._pending), 0
        for _ in range(GATHER_PASSES):
            if self.clients is not None and seen >= self.clients():
                break  # every request that could submit a call has
            await asyncio.sleep(0)
            stable = stable + 1 if len(self._pending) == seen else 0
            seen = len(self._pending)
            if stable == GATHER_STABLE:
                break

    def _take(self) -> tuple[list[_Call], list[_Call]]:
        """``(calls to run now, calls held back)`` from the queue, which is left empty but for
        the calls that wait their turn. Draft steps first: while a lead (draft) model has steps
        to take, the others' calls wait, so the rows of a batch draft together and then verify
        together in one call (a draft's long prefill alone holds nobody up). A call that copies
        a prefix from a request still computing it waits for that call (held back)."""
        calls = [c for c in self._pending if not c.future.done()]
        self._pending.clear()
        steps = [c for c in calls if id(c.model) in self.lead and (c.batchable or c.raggable)]
        if steps and not all(id(c.model) in self.lead for c in calls):
            self._pending.extend(c for c in calls if id(c.model) not in self.lead)
            calls = [c for c in calls if id(c.model) in self.lead]
        busy = {id(c.session) for c in calls}
        later = [c for c in calls if c.source is not None and id(c.source) in busy]
        return [c for c in calls if c not in later], later

    def _group(self, calls: list[_Call]) -> tuple[dict[int, list[_Call]], dict[int, list[_Call]], list[_Call]]:
        """``(steps, prompts, singles)``: single-token steps by model (one batched call each),
        new requests' prompts that a model can prefill together, by model, and the other
        multi-position calls, one at a time."""
        groups: dict[int, list[_Call]] = {}
        for call in calls:
            if call.batchable or call.raggable:
                groups.setdefault(id(call.model), []).append(call)
        singles = [c for c in calls if not (c.batchable or c.raggable)]
        prompts: dict[int, list[_Call]] = {}
        for call in singles:
            if call.fresh:
                prompts.setdefault(id(call.model), []).append(call)
        prompts = {
            key: group
            for key, group in prompts.items()
            if len(group) > 1 and group[0].model.can_prefill_together([c.session for c in group])
        }
        together = {id(c) for group in prompts.values() for c in group}
        return groups, prompts, [c for c in singles if id(c) not in together]

    async def _run(self, calls: list[_Call], make_job: Callable[[list[_Call]], _Job]) -> None:
        calls = [c for c in calls if not c.future.done()]  # a caller cancelled meanwhile is skipped
        if self._closed or not calls:
            return
        model = calls[0].model
        inline = (
            len(calls) == 1
            and calls[0].ids.size == 1
            and self.clients is not None
            and self.clients() <= 1
            and (self.step_seconds(model, 1) or 1.0) <= INLINE_MAX_S
        )
        t0 = perf_counter()
        try:
            job = make_job(calls)
            if inline:  # on this thread: nothing can close a session meanwhile
                results = job()
            else:
                self._busy = {id(c.session) for c in calls}
                try:
                    results = await anyio.to_thread.run_sync(job)
                finally:
                    self._busy, after, self._after = set(), self._after, []
                    for fn in after:  # sessions closed while their call ran
                        fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the callers
            if isinstance(exc, asyncio.CancelledError):
                raise
            err = exc if isinstance(exc, SpecDecError) else InferenceError(f"model call failed: {exc}")
            for c in calls:
                if not c.future.done():
                    c.future.set_exception(err)
            return
        seconds = perf_counter() - t0
        self.calls += 1
        if len(calls) > 1 or calls[0].batchable or calls[0].raggable:
            key = (id(model), len(calls), sum(c.ids.size for c in calls))
            if key not in self._seen:  # the first call of a shape allocates: not its cost
                self._seen.add(key)
            else:
                self.record(model, len(calls), key[2], seconds)
        for f in self.listeners:
            f(model, len(calls), seconds)
        for c, r in zip(calls, results):
            if r is not None and not c.future.done():
                c.future.set_result(r)

    def _batch_job(self, group: list[_Call]) -> _Job:
        def job() -> list[Any]:  # in the worker thread
            sessions = [c.session for c in group]
            if len(group) == 1:
                c = group[0]
                return [c.session.run_sync(c.ids, c.rows, c.session.length)]
            if any(c.ids.size > 1 for c in group):  # a ragged model: rows of several positions
                return group[0].model.run_rows_sync(sessions, [c.ids for c in group], [c.rows for c in group])
            pasts = np.array([s.length for s in sessions], dtype=np.int64)  # [B]
            ids = np.array([int(c.ids[0]) for c in group], dtype=np.int64)  # [B]
            logits = group[0].model.run_batch_sync(sessions, ids, pasts)  # [B, V]
            return [logits[i : i + 1] for i in range(len(group))]  # [1, V] each

        return job

    def _prefill_job(self, group: list[_Call]) -> _Job:
        def job() -> list[Any]:  # in the worker thread
            size = ALONE_CHUNKS * self.chunk  # per row: what is left goes on as single calls
            ends = [c.ids.size if c.ids.size <= size + 1 else size for c in group]
            logits = group[0].model.run_prefill_batch_sync(
                [c.session for c in group], [c.ids[:e] for c, e in zip(group, ends)]
            )  # [B, V]
            for c, e in zip(group, ends):
                c.done = e
            return [logits[i : i + 1] if e == c.ids.size else None for i, (c, e) in enumerate(zip(group, ends))]

        return job

    def _single_job(self, c: _Call) -> _Job:
        def job() -> list[Any]:  # in the worker thread
            s, n = c.session, c.ids.size
            while c.done < n:
                # while other calls wait, feed at most `chunk` positions and give them a turn;
                # alone, bigger pieces (checked between pieces: a newcomer waits one piece at most)
                size = self.chunk if self._pending else ALONE_CHUNKS * self.chunk
                end = n if n - c.done <= size + c.rows else c.done + size
                extra = dict(c.extra)
                if extra.get("features") is not None:
                    extra["features"] = extra["features"][c.done : end]
                out = s.run_sync(c.ids[c.done : end], c.rows if end == n else 1, s.length, **extra)
                c.done = end
                if extra.get("hidden"):
                    logits, hidden = out
                    c.hidden.append(hidden)
                    out = (logits, np.concatenate(c.hidden) if len(c.hidden) > 1 else hidden)
                if end < n and self._pending:
                    return [None]  # to be continued in the next iteration
            return [out]

        return job
