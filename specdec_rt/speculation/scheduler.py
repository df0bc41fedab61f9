"""``SpecDecScheduler``: draft, verify, accept, update stats.

Drafter and verifier read the whole committed sequence (not a window of its last tokens), a
rejection resamples from ``norm(max(0, p - q))`` (not from ``p``: that keeps the target's
distribution), and a fully accepted round also emits the target's bonus token.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, AsyncGenerator, Iterable, Sequence

import numpy as np

from ..checks import brief_repr, check_bool, check_int, is_int
from ..errors import InferenceError, InvalidInputError, SpecDecError
from ..logs import get_logger
from ..policy.acceptance import AcceptanceEWMA, CostModel
from ..policy.confidence import ChainStop, ConfidenceRates
from ..policy.config import SpecConfig
from ..policy.request import RequestPolicy
from ..policy.tree import TreePolicy, TreeRates
from ..sampling import SamplingParams
from ..sampling.constraints import Constraint
from ..sampling.logprobs import TokenLogprob
from ..sampling.tree import chain_length, tree_depth, tree_parents
from ..types import DraftToken, FallbackEvent, GenerationResult, Mode, Stats, TokenEvent, Verdict
from .context import DraftPlan, RequestContext
from .protocols import BatchCosts, DraftInferrer, TargetVerifier, check_implements

__all__ = ["SpecDecScheduler", "RequestStream"]

log = get_logger("specdec_rt.speculation.scheduler")


class SpecDecScheduler:
    """Runs requests with speculative decoding (``mode="spec"``) or plain decoding (``"ar"``).

    One scheduler serves any number of concurrent requests (each ``stream``/``run`` call is one
    request with its own :class:`RequestContext`). Acceptance is tracked per request and across
    requests: a new request starts from the shared EWMA and the measured costs, except a seeded
    request, which starts from the configured defaults and ignores timings so that its output
    depends only on its seed.

    Cancellation: cancelling the task that iterates :meth:`stream` (or awaits :meth:`run`), or
    closing the iterator early, takes effect at the next model call boundary (a call already
    running in a worker thread finishes first and its result is dropped). Committed tokens are
    exactly those already yielded; the request's model state is released; the scheduler and its
    models stay usable for other requests.
    """

    def __init__(
        self,
        drafter: DraftInferrer | None,
        verifier: TargetVerifier,
        config: SpecConfig | None = None,
        *,
        eos_ids: Iterable[int] = (),
        batch: BatchCosts | None = None,
    ) -> None:
        """A scheduler over a drafter and a verifier, each checked against its Protocol.

        Args:
            drafter: Proposes the drafts (``None``: ``mode="ar"`` only).
            verifier: Checks them with the target and accepts by rejection sampling.
            config: The speculation policy (default: ``SpecConfig()``).
            eos_ids: Ids that end a request.
            batch: The costs of the batch its requests share (an Engine's step loop), or
                ``None``: costs come from its own rounds.

        Raises:
            InvalidInputError: ``drafter`` or ``verifier`` lacks a member of its Protocol.
        """
        if drafter is not None:
            check_implements(drafter, DraftInferrer, "drafter")
        check_implements(verifier, TargetVerifier, "verifier")
        self.drafter = drafter
        self.verifier = verifier
        self.config = config or SpecConfig()
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        self.shared_ewma = AcceptanceEWMA.start(self.config.alpha, self.config.initial_acceptance)
        self.costs = CostModel(
            self.config,
            measure=self.config.measure_costs,
            batched_verify=verifier.batched_verify,
            batch_step_s=batch.target_step if batch else None,
            draft_step_s=batch.draft_step if batch else None,
            batch_shapes=batch.target_shapes if batch else None,
        )
        self.totals = Stats(mode="total")
        self.running = 0  # requests in their loop now: the batch their model calls share
        # a request alone may draft a tree: its main chain plus up to `tree_nodes` other nodes,
        # when the verifier takes trees (ONNX Runtime targets of exporter 0.3+, float32, CPU)
        self.trees = verifier.trees
        self.tree_nodes = self.config.tree_nodes
        self.tree_rates = TreeRates(self.config.alpha)  # realized speed of tree vs chain rounds
        self.confidence_rates = ConfidenceRates()  # acceptance of model drafts by their confidence
        self.batch = batch  # the batch its requests share (an Engine's), or None

    def _admitted(self) -> int:
        return self.batch.admitted() if self.batch is not None else 0

    @property
    def max_length(self) -> int | None:
        """Longest sequence (prompt + generated) both models can hold, if they say (``None``:
        no limit; anything but a positive integer is an :class:`InferenceError` naming it)."""
        lengths = []
        for role, model in (("verifier", self.verifier), ("drafter", self.drafter)):
            m = None if model is None else model.max_length
            if m is None:
                continue
            check_int(m, f"the {role}'s max_length", 1, what="None or a positive integer", error=InferenceError)
            lengths.append(int(m))
        return min(lengths) if lengths else None

    def stream(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        max_new_tokens: int,
        params: SamplingParams | None = None,
        *,
        mode: Mode = "spec",
        stop_ids: Iterable[int] = (),
        rng: np.random.Generator | None = None,
        logprobs: int | None = None,
        constraint: Constraint | None = None,
        ignore_eos: bool = False,
    ) -> "RequestStream":
        """Start a request; an async iterator of :class:`TokenEvent` as tokens become final.

        Arguments are checked here, before any model work. Generation stops after exactly
        ``max_new_tokens`` tokens or at the first EOS / stop id (emitted; nothing after it is).

        Args:
            prompt_ids: The prompt's token ids.
            max_new_tokens: Tokens to generate at most.
            params: Sampling parameters (default: greedy).
            mode: ``"spec"`` (speculative; needs a drafter) or ``"ar"`` (plain decoding).
            stop_ids: Ids that end the request, besides the EOS ids.
            rng: The sampling generator (default: from ``params.seed``).
            logprobs: ``n``: every event also carries its tokens' log-probabilities under the target,
                each with the ``n`` (0..20) most likely there (:mod:`specdec_rt.sampling.logprobs`).
            constraint: Which tokens may come next (:mod:`specdec_rt.sampling.constraints`), draft and target alike.
            ignore_eos: An EOS id does not end the request (``stop_ids`` still do).

        Returns:
            The request's stream of events.

        Raises:
            InvalidInputError: A bad value, ``mode="spec"`` without a drafter, ``logprobs`` the verifier lacks.
            ContextLengthError: The prompt plus ``max_new_tokens`` does not fit the models.
        """
        ends = self._ends(mode, logprobs, ignore_eos=ignore_eos, stop_ids=stop_ids)
        ctx = RequestContext(
            prompt_ids,
            max_new_tokens,
            params,
            ends,
            max_length=self.max_length,
            rng=rng,
            vocab_size=self.verifier.vocab_size,
            logprobs=logprobs,
            constraint=constraint,
        )
        return self._open(ctx, mode)

    def _ends(self, mode: Mode, logprobs: int | None, *, ignore_eos: bool, stop_ids: Iterable[int]) -> set[int]:
        """The ids that end the request (the EOS ids unless ``ignore_eos``, and ``stop_ids``), once
        the models are checked to serve it: a drafter for ``mode="spec"``, a verifier that reports
        log-probabilities for ``logprobs`` (else an :class:`InvalidInputError`)."""
        if mode == "spec" and self.drafter is None:
            raise InvalidInputError("mode 'spec' needs a drafter; this scheduler has none (use mode='ar')")
        if logprobs is not None and not self.verifier.reports_logprobs:
            raise InvalidInputError(
                f"logprobs: this verifier ({type(self.verifier).__name__}) does not report "
                "log-probabilities (its reports_logprobs is False)"
            )
        return (set() if check_bool(ignore_eos, "ignore_eos") else set(self.eos_ids)) | set(stop_ids)

    def _open(self, ctx: RequestContext, mode: Mode) -> RequestStream:
        """The request's stream over its loop, with its policy, tree policy and tree rates (a
        seeded request's decisions depend on its seed alone, never on timings)."""
        seeded = ctx.params.seed is not None and not ctx.params.greedy
        tree = TreePolicy(self.tree_nodes if self.trees and mode == "spec" else 0, self.config.alpha)
        rates = self.tree_rates if self.config.measure_costs and not seeded else None  # timings decide?
        return RequestStream(self._loop(ctx, self._policy(ctx, mode, seeded), tree, rates), ctx)

    def _policy(self, ctx: RequestContext, mode: Mode, seeded: bool) -> RequestPolicy:
        """The request's policy: it starts from the shared acceptance EWMA and the measured costs,
        or, ``seeded``, from the configured defaults with no timings (its output depends only on
        its seed); the draft's prefill it prices is what the drafter's caches lack of the prompt."""
        ewma = (
            AcceptanceEWMA.start(self.config.alpha, self.config.initial_acceptance)
            if seeded
            else self.shared_ewma.copy()
        )
        costs = CostModel(self.config, measure=False) if seeded else self.costs
        cached = self.drafter.cached_prefix if self.drafter is not None and mode == "spec" and not seeded else None
        policy = RequestPolicy(
            self.config,
            mode,
            ewma,
            costs,
            shared=self.shared_ewma,
            prompt_tokens=ctx.prompt_len - (cached(ctx.tokens) if cached else 0),
        )
        policy.cheap_drafts = self.drafter is not None and self.drafter.cheap_drafts
        return policy

    async def run(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        max_new_tokens: int,
        params: SamplingParams | None = None,
        **kwargs: Any,
    ) -> GenerationResult:
        """The whole request: generated ids and stats.

        Args:
            prompt_ids: The prompt's token ids.
            max_new_tokens: Tokens to generate at most.
            params: Sampling parameters (default: greedy).
            **kwargs: :meth:`stream`'s keywords.

        Returns:
            The generated ids and the request's stats.

        Raises:
            InvalidInputError: As :meth:`stream`.
            ContextLengthError: As :meth:`stream`.
            InferenceError: A model call failed.
        """
        it = self.stream(prompt_ids, max_new_tokens, params, **kwargs)
        async with contextlib.aclosing(it):
            async for _ in it:
                pass
        return GenerationResult(it.token_ids, it.stats)

    async def _loop(
        self, ctx: RequestContext, policy: RequestPolicy, tree: TreePolicy, rates: TreeRates | None
    ) -> AsyncGenerator[TokenEvent, None]:
        """The request's rounds, each one draft call and one verify call, until it is done."""
        ctx.stats.mode = policy.mode
        run = _Run(ctx, policy, tree, rates, started=perf_counter())
        self.running += 1
        try:
            if (switch := policy.start(ctx.max_new_tokens)) is not None:
                ctx.stats.fallbacks.append(switch)  # the draft's prefill would cost more than it saves
            while not ctx.done:
                rnd = self.choose(run)  # 1. choose k: how many tokens to draft (0: a plain target step)
                await self.draft(ctx, rnd)  # 2. draft k: proposals continuing the committed tokens
                await self.verify(ctx, rnd)  # 3. verify once: one target call over the drafts + 1 position
                self.accept(ctx, rnd)  # 4. accept: commit what rejection sampling kept, and the target's token
                switch = self.observe(run, rnd)  # 5. update the acceptance tracker (and costs, stats)
                if switch is not None:
                    self.fall_back(ctx.stats, switch)  # 6. fall back when acceptance stays low (or resume)
                yield self.emit(run, rnd)  # 7. emit: these tokens are final
        except SpecDecError:
            ctx.finish_reason = "error"
            raise
        except Exception as exc:  # a plug-in model failed: one error root for callers
            ctx.finish_reason = "error"
            raise InferenceError(f"model call failed: {type(exc).__name__}: {exc}") from exc
        except BaseException:  # cancelled, or the consumer closed the iterator
            ctx.finish_reason = ctx.finish_reason or "cancelled"
            raise
        finally:
            self.running -= 1
            self._finish(run)

    def choose(self, run: _Run) -> Round:
        """Step 1: the round's draft length for this request's acceptance and the batch its
        calls share with the others, its shape (a chain, or a tree), and where a chain stops."""
        ctx, policy = run.ctx, run.policy
        batch = max(self.running, self._admitted())
        length = policy.draft_length(ctx.remaining, batch, ctx.generated.size)
        alone = batch == 1 or run.rates is None
        depth, nodes = self._tree_shape(ctx, run.tree, policy, length, alone=alone, rates=run.rates)
        plan = DraftPlan(
            tree_nodes=nodes,
            chain_stop=self._chain_stop(ctx, policy, depth=depth, nodes=nodes, batch=batch),
            cheap_drafts=policy.cheap,  # only drafts that cost nothing (a batch, or no draft prefill)
        )
        return Round(k=depth, batch=batch, plan=plan)

    async def draft(self, ctx: RequestContext, rnd: Round) -> None:
        """Step 2: up to ``k`` proposals continuing the committed tokens (a tree: up to ``k`` deep,
        plus its nodes), from the drafter the round's plan is handed to as ``ctx.plan``."""
        rnd.started = perf_counter()
        ctx.plan = rnd.plan
        if rnd.k:
            assert self.drafter is not None  # k > 0 in mode "spec" alone, which stream() checks has one
            proposed = await self.drafter.generate_draft(ctx, rnd.k)
            rnd.drafts = _drafts_checked(proposed, rnd.k + rnd.plan.tree_nodes, ctx)
        rnd.depth, rnd.chain = tree_depth(rnd.drafts), chain_length(rnd.drafts)
        rnd.drafted = perf_counter()

    async def verify(self, ctx: RequestContext, rnd: Round) -> None:
        """Step 3: one target call over the drafts plus one position (a tree: in one call too);
        the verifier accepts a prefix of them by rejection sampling and adds one target token."""
        verdict = await self.verifier.verify_and_accept(ctx, rnd.drafts)
        rnd.verdict = _checked(verdict, rnd.drafts, ctx.vocab_size, ctx.logprobs is not None)
        rnd.verified = perf_counter()

    def accept(self, ctx: RequestContext, rnd: Round) -> None:
        """Step 4: commit what the target kept, cut at the budget and at a stop id."""
        rnd.at = ctx.generated.size
        rnd.emitted = ctx.commit(rnd.outcome.tokens)

    def observe(self, run: _Run, rnd: Round) -> FallbackEvent | None:
        """Step 5: the round feeds the request's policy (acceptance EWMA, costs, next draft
        length), its stats, the chain-stop and tree rates; returns the mode switch it caused."""
        policy, stats, accepted = run.policy, run.ctx.stats, rnd.outcome.accepted
        # costs leave out the prefills: the target's in the first round, a drafter's in its first
        timed = run.seen and (run.model_drafted or not rnd.drafts)
        switch = policy.observe(
            rnd.at,
            rnd.depth,
            accepted,
            t_draft=rnd.draft_s,
            t_verify=rnd.verify_s,
            timed=timed,
            alone=rnd.batch == 1 == max(self.running, self._admitted()),
            batch=rnd.batch,
            verified=len(rnd.drafts),
            steps=rnd.plan.draft_steps,
        )
        ewma = policy.ewma.value if rnd.drafts or stats.rounds else None
        stats.observe_round(
            rnd.depth, accepted, rnd.emitted.size, t_draft=rnd.draft_s, t_verify=rnd.verify_s, ewma=ewma
        )
        if rnd.plan.chain_stop is not None:
            rnd.plan.chain_stop.observe(accepted)  # model drafts by confidence: accepted?
        nodes = len(rnd.drafts) - rnd.chain
        took_tree = any(i >= rnd.chain for i in rnd.outcome.path or ())  # the path left the main chain
        stats.observe_tree(nodes, took_tree)
        run.tree.observe(nodes, took_tree)
        if run.rates is not None and timed and rnd.drafts and rnd.batch == 1:  # realized speed, alone
            run.rates.observe(nodes > 0, rnd.emitted.size, rnd.verified - rnd.started)
        # (free drafts read no prompt: the model's first round still prefills, untimed)
        run.seen, run.model_drafted = True, run.model_drafted or (bool(rnd.drafts) and not policy.cheap)
        return switch

    def fall_back(self, stats: Stats, switch: FallbackEvent) -> None:
        """Step 6: record a switch the policy made: to plain decoding when acceptance stayed low
        (or speculation would not pay), back to speculation when a probe found it pays again."""
        stats.fallbacks.append(switch)
        log.info("speculation.switch", to=switch.to, reason=switch.reason, at=switch.at, ewma=round(switch.ewma, 3))

    def emit(self, run: _Run, rnd: Round) -> TokenEvent:
        """Step 7: the round's committed tokens as an event (the first sets the time to first token)."""
        ctx, verdict = run.ctx, rnd.outcome
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "round",
                k=rnd.depth,
                nodes=len(rnd.drafts),
                accepted=verdict.accepted,
                emitted=rnd.emitted.size,
                ewma=round(run.policy.ewma.value, 3),
                t_draft=rnd.draft_s,
                t_verify=rnd.verify_s,
            )
        if ctx.stats.time_to_first_token is None:
            ctx.stats.time_to_first_token = perf_counter() - run.started
        logprobs = verdict.logprobs if ctx.logprobs is not None else None  # (_checked: one a token)
        return TokenEvent(
            token_ids=tuple(rnd.emitted.tolist()),
            index=rnd.at,
            drafted=rnd.depth,
            accepted=verdict.accepted,
            finished=ctx.finish_reason,
            logprobs=logprobs[: rnd.emitted.size] if logprobs is not None else None,
        )

    def _finish(self, run: _Run) -> None:
        """The request ended, however it ended: its stats into the totals, its model state released
        (a round cut short is not measured)."""
        ctx, stats = run.ctx, run.ctx.stats
        run.policy.close()
        stats.finish_reason = ctx.finish_reason
        stats.time_total = perf_counter() - run.started
        self.totals.merge(stats)
        if self.drafter is not None:
            self.drafter.release(ctx)
        self.verifier.release(ctx)
        log.info(
            "request.end",
            mode=stats.mode,
            new_tokens=stats.new_tokens,
            finish=stats.finish_reason,
            acceptance=round(stats.acceptance_rate, 3),
            tokens_per_s=round(stats.tokens_per_s, 2),
        )

    def _chain_stop(
        self, ctx: RequestContext, policy: RequestPolicy, *, depth: int, nodes: int, batch: int
    ) -> ChainStop | None:
        """A request alone that drafts a chain with the draft model stops it where one more draft
        would not pay at the rates measured for its confidences (confidence.py). Not in a batch
        (its costs are the batch's), not in trees, probes or cheap rounds, and not for a seeded
        sampled request (its schedule must not depend on other requests)."""
        if (
            not self.config.confidence_stop
            or depth < 2
            or batch > 1
            or nodes
            or policy.cheap
            or not policy.speculating
            or (ctx.params.seed is not None and not ctx.params.greedy)
        ):
            return None
        draft_cost, verify_cost = policy.costs.relative()
        acceptance = policy.ewma.value
        speedup = policy.costs.speedup(acceptance, depth)
        return ChainStop(
            self.confidence_rates, acceptance, (draft_cost + verify_cost) * speedup / max(acceptance, 1e-3)
        )

    def _tree_shape(
        self,
        ctx: RequestContext,
        tree: TreePolicy,
        policy: RequestPolicy,
        k: int,
        *,
        alone: bool,
        rates: TreeRates | None,
    ) -> tuple[int, int]:
        """``(depth, nodes)`` for a round the policy gave ``k`` drafts: the chain, or a tree of
        ``nodes`` beyond a main chain of ``depth <= k``, the depth whose tree the cost model
        rates best (drafts deep in a chain that are seldom right may be worth less than nodes
        beside a shorter one), within the room the models have left."""
        if not k or not tree.max_nodes:  # trees off (the default): no cost estimates per round
            return k, 0
        costs, acceptance = policy.costs, policy.ewma.value
        rated = {  # a tree on depth j
            j: costs.speedup(acceptance, j, nodes=tree.max_nodes, hit_rate=tree.hit_rate) for j in range(1, k + 1)
        }
        depth = max(rated, key=rated.__getitem__)
        nodes = tree.nodes(alone, rated[depth] > costs.speedup(acceptance, k), rates)
        room = self.max_length - ctx.tokens.size - depth if self.max_length else nodes
        nodes = max(0, min(nodes, room))
        return (depth, nodes) if nodes else (k, 0)


@dataclass
class _Run:
    """One request's way through the loop: what lasts across its rounds besides its context."""

    ctx: RequestContext
    policy: RequestPolicy
    tree: TreePolicy
    rates: TreeRates | None  # the realized speed of tree and chain rounds, when timings decide
    started: float  # perf_counter() when the request's first round began
    seen: bool = False  # a round ran (the first includes the target's prefill)
    model_drafted: bool = False  # a round drafted with the draft model (the first includes its prefill)


@dataclass
class Round:
    """One round of :meth:`SpecDecScheduler._loop`: what was asked, drafted, verified and
    committed, and when each step ended (``perf_counter()`` seconds)."""

    k: int  # drafts asked for (a tree's depth); 0: one plain target step
    batch: int  # requests sharing the model calls when k was chosen
    plan: DraftPlan  # what the drafter was asked (tree nodes, chain stop, cheap drafts), its steps
    drafts: list[DraftToken] = field(default_factory=list)  # the chain first, then a tree's nodes
    depth: int = 0  # the drafts' depth (a chain: their number)
    chain: int = 0  # drafts in the main chain
    verdict: Verdict | None = None  # what the target kept, and its token
    at: int = 0  # generated tokens before this round's
    emitted: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # what it committed
    started: float = 0.0  # the draft step began
    drafted: float = 0.0  # the draft step ended, the verify began
    verified: float = 0.0  # the verify ended

    @property
    def outcome(self) -> Verdict:
        """The verdict (once verified)."""
        assert self.verdict is not None, "the round is not verified yet"
        return self.verdict

    @property
    def draft_s(self) -> float:
        """Seconds the draft step took."""
        return self.drafted - self.started

    @property
    def verify_s(self) -> float:
        """Seconds the verify step took."""
        return self.verified - self.drafted


class RequestStream:
    """One request's async iterator of :class:`TokenEvent`; ``stats`` and ``token_ids`` hold
    what it has committed so far (complete once iteration ends). ``aclose()`` ends it early.

    Attributes:
        context: The request's :class:`RequestContext`.
    """

    def __init__(self, agen: AsyncGenerator[TokenEvent, None], ctx: RequestContext) -> None:
        self._agen, self.context = agen, ctx

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> TokenEvent:
        return await self._agen.__anext__()

    async def aclose(self) -> None:
        """End the request early: its model state is released; committed tokens stay."""
        await self._agen.aclose()

    @property
    def stats(self) -> Stats:
        """The request's counters so far."""
        return self.context.stats

    @property
    def token_ids(self) -> list[int]:
        """The tokens generated so far (prompt excluded)."""
        ids: list[int] = self.context.generated.tolist()
        return ids


def _drafts_checked(drafts: Iterable[object], most: int, ctx: RequestContext) -> list[DraftToken]:
    """A plug-in drafter's proposals, at most ``most``: each a :class:`DraftToken` whose id is a
    token of the vocabulary (else an :class:`InferenceError` that names the drafter's mistake,
    not a failure inside the target's call or a verdict blamed on the verifier)."""
    checked: list[DraftToken] = []
    vocab = ctx.vocab_size
    for index, draft in enumerate(list(drafts)[:most]):
        if not isinstance(draft, DraftToken) or not is_int(draft.id):
            why = "need a DraftToken with an integer id"
            raise InferenceError(f"drafter returned {brief_repr(draft)} as draft {index}: {why}")
        if draft.id < 0 or (vocab is not None and draft.id >= vocab):
            raise InferenceError(
                f"drafter proposed token id {draft.id} (draft {index}), outside the vocabulary "
                f"(ids 0..{'?' if vocab is None else vocab - 1})"
            )
        checked.append(draft)
    return checked


def _checked(
    verdict: Verdict, drafts: Sequence[DraftToken], vocab: int | None = None, logprobs: bool = False
) -> Verdict:
    """A plug-in verifier's verdict must keep a path of the drafts (a prefix of a chain) and add
    exactly one token, a token of the vocabulary (and, when asked, one log-probability a token)."""
    if not isinstance(verdict, Verdict) or not np.issubdtype(np.asarray(verdict.tokens).dtype, np.integer):
        raise InferenceError(f"verifier returned {brief_repr(verdict)}: need a Verdict with integer tokens")
    n = verdict.accepted
    path = tuple(range(n)) if verdict.path is None else tuple(int(i) for i in verdict.path)
    parents = tree_parents(drafts)
    ok = (
        0 <= n <= len(drafts)
        and len(verdict.tokens) == n + 1
        and len(path) == n
        and all(
            0 <= path[i] < len(drafts)
            and parents[path[i]] == (path[i - 1] if i else -1)
            and int(verdict.tokens[i]) == drafts[path[i]].id
            for i in range(n)
        )
    )
    if not ok:
        raise InferenceError(
            f"verifier returned an inconsistent verdict: accepted={n}, tokens={list(verdict.tokens)}, "
            f"path={verdict.path}, drafts={[d.id for d in drafts]}"
        )
    last = int(verdict.tokens[-1])
    if last < 0 or (vocab is not None and last >= vocab):
        raise InferenceError(
            f"verifier emitted token id {last}, outside the vocabulary (ids 0..{'?' if vocab is None else vocab - 1})"
        )
    if logprobs and (verdict.logprobs is None or len(verdict.logprobs) != len(verdict.tokens)):
        got = None if verdict.logprobs is None else len(verdict.logprobs)
        raise InferenceError(f"verifier returned {got} log-probabilities for {len(verdict.tokens)} tokens")
    if logprobs and not all(isinstance(x, TokenLogprob) for x in verdict.logprobs or ()):  # (None: raised above)
        raise InferenceError(f"verifier returned log-probabilities {brief_repr(verdict.logprobs)}: need TokenLogprob")
    return verdict
