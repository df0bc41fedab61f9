"""``SpecDecScheduler``: draft, verify, accept, update stats (a port of the Go scheduler).

Differences from the Go sketch, on purpose: the context is the whole sequence (not the last
``draftLen`` tokens), a rejection resamples from ``norm(max(0, p - q))`` (not from ``p``), and a
fully accepted round also emits the target's bonus token.
"""

from __future__ import annotations

import contextlib
import logging
from time import perf_counter
from typing import AsyncGenerator, Iterable, Sequence

import numpy as np

from ..checks import check_bool, check_int, is_int
from ..errors import InferenceError, InvalidInputError, SpecDecError
from ..logs import get_logger
from ..policy.acceptance import AcceptanceEWMA, CostModel
from ..policy.confidence import ChainStop, ConfidenceRates
from ..policy.config import SpecConfig
from ..policy.request import RequestPolicy
from ..policy.tree import TreePolicy, TreeRates
from ..sampling import SamplingParams, brief_repr
from ..sampling.constraints import Constraint
from ..sampling.logprobs import TokenLogprob
from ..sampling.tree import chain_length, tree_depth, tree_parents
from ..types import DraftToken, GenerationResult, Mode, Stats, TokenEvent, Verdict
from .context import RequestContext
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

        Arguments are checked here, before any model work: a bad value raises
        :class:`~specdec_rt.errors.InvalidInputError` (``ContextLengthError`` if the prompt plus
        ``max_new_tokens`` does not fit). Generation stops after exactly ``max_new_tokens`` tokens
        or at the first EOS / stop id (which is emitted; nothing after it is). ``logprobs=n``:
        every event also carries its tokens' log-probabilities under the target, each with the
        ``n`` (0..20) most likely tokens there (:mod:`specdec_rt.sampling.logprobs`). ``constraint``:
        which tokens may come next (:mod:`specdec_rt.sampling.constraints`), for draft and target alike.
        ``ignore_eos``: an EOS id does not end the request (``stop_ids`` still do).
        """
        if mode == "spec" and self.drafter is None:
            raise InvalidInputError("mode 'spec' needs a drafter; this scheduler has none (use mode='ar')")
        if logprobs is not None and not self.verifier.reports_logprobs:
            raise InvalidInputError(
                f"logprobs: this verifier ({type(self.verifier).__name__}) does not report "
                "log-probabilities (its reports_logprobs is False)"
            )
        ends = (set() if check_bool(ignore_eos, "ignore_eos") else self.eos_ids) | set(stop_ids)
        ctx = RequestContext(
            prompt_ids,
            max_new_tokens,
            params,
            ends,
            self.max_length,
            rng,
            self.verifier.vocab_size,
            logprobs,
            constraint,
        )
        seeded = ctx.params.seed is not None and not ctx.params.greedy
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
            shared=self.shared_ewma,  # the draft's prefill:
            prompt_tokens=ctx.prompt_len - (cached(ctx.tokens) if cached else 0),
        )  # what it lacks
        policy.cheap_drafts = self.drafter is not None and self.drafter.cheap_drafts
        tree = TreePolicy(self.tree_nodes if self.trees and mode == "spec" else 0, self.config.alpha)
        rates = self.tree_rates if self.config.measure_costs and not seeded else None  # timings decide?
        return RequestStream(self._loop(ctx, policy, tree, rates), ctx)

    async def run(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        max_new_tokens: int,
        params: SamplingParams | None = None,
        **kwargs,
    ) -> GenerationResult:
        """The whole request: generated ids and stats (same arguments as :meth:`stream`)."""
        it = self.stream(prompt_ids, max_new_tokens, params, **kwargs)
        async with contextlib.aclosing(it):
            async for _ in it:
                pass
        return GenerationResult(it.token_ids, it.stats)

    async def _loop(
        self, ctx: RequestContext, policy: RequestPolicy, tree: TreePolicy, rates: TreeRates | None
    ) -> AsyncGenerator[TokenEvent, None]:
        stats, seen, drafted = ctx.stats, False, False  # rounds so far; any of them drafted with the model
        stats.mode = policy.mode
        t_start = perf_counter()
        self.running += 1
        try:
            if (switch := policy.start(ctx.max_new_tokens)) is not None:
                stats.fallbacks.append(switch)  # the draft's prefill would cost more than it saves
            while not ctx.done:
                # 1. choose: how many tokens to draft this round (0 = one plain target step), for
                #    this request's acceptance and the batch its calls share with the others
                batch = max(self.running, self._admitted())
                k = policy.draft_length(ctx.remaining, batch, ctx.generated.size)
                ctx.cheap_drafts = policy.cheap  # only drafts that cost nothing (a batch, or no draft prefill)
                k, ctx.tree_nodes = self._tree_shape(ctx, tree, policy, k, batch == 1 or rates is None, rates)
                ctx.chain_stop = self._chain_stop(ctx, policy, k, batch)
                # 2. draft: up to k proposals continuing the committed tokens (a tree: up to k deep)
                t0, ctx.draft_steps = perf_counter(), (0, 0.0)
                drafts: list[DraftToken] = []
                if k:
                    assert self.drafter is not None  # k > 0 in mode "spec" alone, which stream() checks has one
                    drafts = _drafts_checked(await self.drafter.generate_draft(ctx, k), k + ctx.tree_nodes, ctx)
                depth, chain = tree_depth(drafts), chain_length(drafts)
                # 3. verify: one target call over len(drafts) + 1 positions (a tree: in one call too)
                t1 = perf_counter()
                verdict = _checked(
                    await self.verifier.verify_and_accept(ctx, drafts), drafts, ctx.vocab_size, ctx.logprobs is not None
                )
                t2 = perf_counter()
                # 4. commit: append what the target kept, cut at the budget and at a stop id
                at = ctx.generated.size
                new = ctx.commit(verdict.tokens)
                # 5. observe: stats, acceptance EWMA, costs, next draft length, fallback (costs
                #    leave out the prefills: the target's in the first round, a drafter's in its first)
                timed = seen and (drafted or not drafts)
                switch = policy.observe(
                    at,
                    depth,
                    verdict.accepted,
                    t1 - t0,
                    t2 - t1,
                    timed,
                    alone=batch == 1 == max(self.running, self._admitted()),
                    batch=batch,
                    verified=len(drafts),
                    steps=ctx.draft_steps,
                )
                stats.observe_round(
                    depth,
                    verdict.accepted,
                    new.size,
                    t1 - t0,
                    t2 - t1,
                    policy.ewma.value if drafts or stats.rounds else None,
                )
                if ctx.chain_stop is not None:
                    ctx.chain_stop.observe(verdict.accepted)  # model drafts by confidence: accepted?
                took_tree = any(i >= chain for i in verdict.path or ())  # the path left the main chain
                stats.observe_tree(len(drafts) - chain, took_tree)
                tree.observe(len(drafts) - chain, took_tree)
                if rates is not None and timed and drafts and batch == 1:  # realized speed, alone
                    rates.observe(len(drafts) > chain, new.size, t2 - t0)
                # (free drafts read no prompt: the model's first round still prefills, untimed)
                seen, drafted = True, drafted or (bool(drafts) and not policy.cheap)
                if switch is not None:
                    stats.fallbacks.append(switch)
                    log.info(
                        "speculation.switch",
                        to=switch.to,
                        reason=switch.reason,
                        at=switch.at,
                        ewma=round(switch.ewma, 3),
                    )
                if log.isEnabledFor(logging.DEBUG):
                    log.debug(
                        "round",
                        k=depth,
                        nodes=len(drafts),
                        accepted=verdict.accepted,
                        emitted=new.size,
                        ewma=round(policy.ewma.value, 3),
                        t_draft=t1 - t0,
                        t_verify=t2 - t1,
                    )
                # 6. emit: these tokens are final
                if stats.time_to_first_token is None:
                    stats.time_to_first_token = perf_counter() - t_start
                yield TokenEvent(
                    tuple(new.tolist()),
                    at,
                    depth,
                    verdict.accepted,
                    ctx.finish_reason,
                    verdict.logprobs[: new.size] if ctx.logprobs is not None and verdict.logprobs is not None else None,
                )  # (_checked)
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
            policy.close()  # a round cut short is not measured
            stats.finish_reason = ctx.finish_reason
            stats.time_total = perf_counter() - t_start
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

    def _chain_stop(self, ctx: RequestContext, policy: RequestPolicy, k: int, batch: int) -> ChainStop | None:
        """A request alone that drafts a chain with the draft model stops it where one more draft
        would not pay at the rates measured for its confidences (confidence.py). Not in a batch
        (its costs are the batch's), not in trees, probes or cheap rounds, and not for a seeded
        sampled request (its schedule must not depend on other requests)."""
        if (
            not self.config.confidence_stop
            or k < 2
            or batch > 1
            or ctx.tree_nodes
            or policy.cheap
            or not policy.speculating
            or (ctx.params.seed is not None and not ctx.params.greedy)
        ):
            return None
        d, s = policy.costs.relative()
        a = policy.ewma.value
        return ChainStop(self.confidence_rates, a, (d + s) * policy.costs.speedup(a, k) / max(a, 1e-3))

    def _tree_shape(
        self, ctx: RequestContext, tree: TreePolicy, policy: RequestPolicy, k: int, alone: bool, rates: TreeRates | None
    ) -> tuple[int, int]:
        """``(depth, nodes)`` for a round the policy gave ``k`` drafts: the chain, or a tree of
        ``nodes`` beyond a main chain of ``depth <= k``, the depth whose tree the cost model
        rates best (drafts deep in a chain that are seldom right may be worth less than nodes
        beside a shorter one), within the room the models have left."""
        if not k or not tree.max_nodes:  # trees off (the default): no cost estimates per round
            return k, 0
        c, a, n, h = policy.costs, policy.ewma.value, tree.max_nodes, tree.hit_rate
        rated = {j: c.speedup(a, j, nodes=n, hit_rate=h) for j in range(1, k + 1)}  # a tree on depth j
        depth = max(rated, key=rated.__getitem__)
        nodes = tree.nodes(alone, rated[depth] > c.speedup(a, k), rates)
        room = self.max_length - ctx.tokens.size - depth if self.max_length else nodes
        nodes = max(0, min(nodes, room))
        return (depth, nodes) if nodes else (k, 0)


class RequestStream:
    """One request's async iterator of :class:`TokenEvent`; ``stats`` and ``token_ids`` hold
    what it has committed so far (complete once iteration ends). ``aclose()`` ends it early."""

    def __init__(self, agen: AsyncGenerator[TokenEvent, None], ctx: RequestContext) -> None:
        self._agen, self.context = agen, ctx

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> TokenEvent:
        return await self._agen.__anext__()

    async def aclose(self) -> None:
        await self._agen.aclose()

    @property
    def stats(self) -> Stats:
        return self.context.stats

    @property
    def token_ids(self) -> list[int]:
        return self.context.generated.tolist()


def _drafts_checked(drafts, most: int, ctx: RequestContext) -> list[DraftToken]:
    """A plug-in drafter's proposals, at most ``most``: each a :class:`DraftToken` whose id is a
    token of the vocabulary (else an :class:`InferenceError` that names the drafter's mistake,
    not a failure inside the target's call or a verdict blamed on the verifier)."""
    drafts = list(drafts)[:most]
    vocab = ctx.vocab_size
    for i, d in enumerate(drafts):
        if not isinstance(d, DraftToken) or not is_int(d.id):
            raise InferenceError(f"drafter returned {brief_repr(d)} as draft {i}: need a DraftToken with an integer id")
        tid = d.id
        if tid < 0 or (vocab is not None and tid >= vocab):
            raise InferenceError(
                f"drafter proposed token id {tid} (draft {i}), outside the vocabulary "
                f"(ids 0..{'?' if vocab is None else vocab - 1})"
            )
    return drafts


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
