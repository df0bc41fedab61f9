"""``Engine``: the five-line API over exported models.

engine = await Engine.load("smollm2-135m")            # a built recipe name or an export folder
result = await engine.generate("Hello", max_new_tokens=64)
print(result.text, result.stats.tokens_per_s, result.stats.acceptance_rate)
async for ev in engine.stream([{"role": "user", "content": "Hi"}]): print(ev.text, end="")
await engine.aclose()                                  # or: async with await Engine.load(...)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence, cast

import anyio
import numpy as np
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..batching import BatchExecutor
from ..checks import brief_repr, check_bool, check_int, check_number
from ..errors import (
    ConsumerTimeoutError,
    ContextLengthError,
    EngineClosedError,
    InferenceError,
    InvalidInputError,
    SpecDecError,
)
from ..kvcache.prefix import PrefixCache
from ..policy.config import SpecConfig
from ..policy.figures import SpeculationFigures, acceptance_by_depth, cost_figures
from ..request.checks import (
    MAX_STOP_STRINGS,  # noqa: F401 - re-exported (the stop-string limit)
    RequestShape,
    check_load_args,
    check_prompt_size,
    cut_at_stop,
    stop_prefix_len,
    token_id_prompt,
    tool_shape,
)
from ..request.params import RequestParams
from ..sampling.constraints import GRAMMAR_THREADS, GrammarFactory, MinTokens
from ..sampling.logprobs import TokenLogprob
from ..sampling.prompt_logprobs import prompt_logprobs as prompt_logprobs_of
from ..speculation.adapters import ModelVerifier
from ..speculation.protocols import BatchCosts, DraftInferrer, LanguageModel, TargetVerifier, check_implements
from ..speculation.scheduler import RequestStream, SpecDecScheduler
from ..text.codec import TextCodec
from ..text.encode_process import PromptEncoder
from ..text.tokenizer_checks import PASS_THROUGH
from ..text.tools import parse_tool_calls
from ..types import Stats
from .factory import DEFAULT_LOAD, LoadOptions, build_parts
from .loop_watch import LoopWatch
from .precision import PrecisionChoice, check_precision
from .served import DEFAULT_CONSUMER_TIMEOUT, DEFAULT_SLOTS
from .stream import EngineResult, EngineStream, StreamEvent, _Ready
from .warmup import WARMUP_REQUESTS, WARMUP_TOKENS, warm_up

if TYPE_CHECKING:
    from .tune_cache import TuneRow

__all__ = ["Engine", "EngineResult", "EngineStream", "StreamEvent"]

Prompt = str | Sequence[dict[str, Any]] | Sequence[int]

MAX_SLOTS = 256
DEFAULT_MAX_PROMPT_CHARS = 1_000_000  # about 250k tokens: more than any context here holds
STREAM_BUFFER = 4  # events a request may run ahead of its consumer before it waits


class Engine:
    """Speculative decoding over an exported target (and draft), for async services.

    One engine serves many concurrent requests: up to ``slots`` run at once (more wait their turn,
    see :attr:`waiting`), and their model calls are batched across requests by one step loop
    (:class:`~specdec_rt.batching.executor.BatchExecutor`) whose calls run in a worker thread, so the event
    loop stays responsive. Each request chooses its own draft length from its acceptance and from
    the measured cost of the batch it runs in (speculation turns down as the batch grows).

    A failed request raises a :class:`~specdec_rt.errors.SpecDecError`, releases its KV slots and
    leaves the engine usable. Cancelling a request (task cancel, timeout, ``break`` out of
    ``stream``, dropping or ``aclose()``-ing the stream) takes effect at once for the caller; its
    model state is released on the next event-loop pass (a model call already running finishes
    first and its result is dropped), without waiting for a garbage collection.

    A stream that is kept but not read (``async for ... : break`` while a variable still holds
    it, a consumer that stops reading) holds its slot for ``consumer_timeout`` seconds at most:
    once the request has :data:`STREAM_BUFFER` events waiting and the consumer takes none of
    them for that long, the request ends, its slot goes to the next request at once, and the
    stream raises :class:`~specdec_rt.errors.ConsumerTimeoutError` after the events already
    waiting. The clock runs only while events wait, so a request waiting for a slot or for a
    slow model is never cut; a consumer is cut only if it takes no event for that long.

    Any backend that implements :class:`~specdec_rt.speculation.protocols.LanguageModel` runs here.

    Args:
        target: The target model.
        drafter: The drafter (``None``: plain decoding only).
        codec: The tokenizer and chat template.
        config: The speculation policy (default: ``SpecConfig()``).
        slots: Requests that run (and are batched) at once.
        draft_name: The draft's name, for callers that show it.
        verifier: Default a :class:`~specdec_rt.speculation.adapters.ModelVerifier` of
            ``target`` (sharing hidden states when the drafter needs them).
        executor: The step loop every model was built with, which batches their calls
            (``None``: a loop of its own, and models that run their calls themselves).
        models: Every model to close with the engine, the target first (default: the target).
        eos_ids: Ids that end a request.
        name: The model's name in replies.
        manifest: The export's manifest, kept for callers that show it.
        consumer_timeout: Seconds a request waits for its consumer to take an event before it
            ends with :class:`~specdec_rt.errors.ConsumerTimeoutError` (see above; ``None`` or
            ``0``: never, a stream nobody reads then holds its slot until it is closed or
            dropped).

    Raises:
        InvalidInputError: ``consumer_timeout`` is not a number >= 0, or ``target`` /
            ``drafter`` lacks a member of its Protocol.
    """

    #: which of the folder's targets and drafts :meth:`load` chose, and how (None: built by hand)
    choice: PrecisionChoice | None = None

    def __init__(
        self,
        target: LanguageModel,
        drafter: DraftInferrer | None,
        codec: TextCodec,
        config: SpecConfig | None = None,
        *,
        slots: int = DEFAULT_SLOTS,
        draft_name: str | None = None,
        verifier: TargetVerifier | None = None,
        executor: BatchExecutor | None = None,
        models: Sequence[LanguageModel] = (),
        eos_ids: Iterable[int] = (),
        name: str | None = None,
        manifest: Any = None,
        consumer_timeout: float | None = DEFAULT_CONSUMER_TIMEOUT,
    ) -> None:
        """An engine over models built already (:meth:`load` builds them from an export folder)."""
        consumer_timeout = check_number(consumer_timeout, "consumer_timeout", 0, optional=True) or None
        eos = tuple(int(t) for t in eos_ids)
        check_implements(target, LanguageModel, "target")
        if drafter is not None:
            check_implements(drafter, DraftInferrer, "drafter")
        self.target, self.drafter, self.codec = target, drafter, codec
        #: encodes prompts; big ones in a child process, off this process's GIL (decision 0011)
        self.prompt_encoder = PromptEncoder(codec)
        self.manifest = manifest
        self.name = name or (manifest.name if manifest is not None else "specdec-rt")
        self.draft_name = draft_name
        self.slots = slots
        self.executor = executor or BatchExecutor()
        self.models = list(models) or [target]
        self.executor.clients = lambda: self.running  # every running request's call in: cut the batch
        #: callables ``f(rows)`` told about every target-model call (rows: requests in the batch)
        self.batch_listeners: list[Callable[[int], None]] = []
        self.executor.listeners.append(self._tell_batch)
        self.scheduler = self._scheduler(config, verifier, eos)
        #: per-request constraints of ``response_format`` (its tokenizer table built on first use)
        self.grammars = GrammarFactory(
            codec.token_bytes,
            codec.is_special,
            lambda text: codec.tokenizer.encode(text, add_special_tokens=False).ids,
            vocab_size=target.vocab_size,
            eos_ids=eos,
        )
        self._slots = anyio.Semaphore(slots)
        self._tasks: set[asyncio.Task[None]] = set()
        self.running: int = 0  #: requests holding a slot
        self.waiting = 0  #: requests waiting for a slot
        self.max_prompt_chars = DEFAULT_MAX_PROMPT_CHARS  #: longer prompts are refused before encoding
        #: seconds a request waits for its consumer to take an event (None: no limit)
        self.consumer_timeout: float | None = consumer_timeout
        self._closed = False
        #: the event loop's lag, sampled while the engine serves (started by its first request)
        self.loop_watch = LoopWatch()
        self._watch_task: asyncio.Task[None] | None = None

    def _scheduler(
        self, config: SpecConfig | None, verifier: TargetVerifier | None, eos_ids: tuple[int, ...]
    ) -> SpecDecScheduler:
        """The scheduler of the engine's requests: ``verifier`` (default: a
        :class:`~specdec_rt.speculation.adapters.ModelVerifier` of the target, sharing hidden
        states when the drafter needs them), costs measured by the engine's step loop."""
        target, drafter = self.target, self.drafter
        if verifier is None:
            verifier = ModelVerifier(target, share_hidden=drafter is not None and drafter.needs_target_hidden)
        drafts = [m for m in self.models if m is not target]
        batch = _MeasuredBatch(self, drafts[0] if drafts else None)
        return SpecDecScheduler(drafter, verifier, config, eos_ids=eos_ids, batch=batch)

    @property
    def prefix_cache(self) -> dict[str, Any]:
        """The prefix cache now: ``enabled``, ``queries`` and ``hit_tokens`` (target lookups and
        prompt tokens they supplied), ``entries``, ``evictions`` and ``bytes`` (KV held, all models)."""
        caches = [m.prefix_cache for m in self.models if m.prefix_cache is not None]
        mine = self.target.prefix_cache or PrefixCache(0, 0)  # none: an empty, disabled one
        return {
            "enabled": mine.enabled,
            "queries": mine.queries,
            "hit_tokens": mine.hit_tokens,
            "entries": sum(len(c.entries()) for c in caches),
            "evictions": sum(c.evictions for c in caches),
            "bytes": sum(c.bytes for c in caches),
        }

    def speculation_figures(self) -> SpeculationFigures | None:
        """The drafter's name, the draft and verify costs the scheduler measured so far (in plain
        target steps) and the acceptance per draft depth over the finished requests; ``None``
        without a drafter. The server's ``/metrics`` and ``/v1/models`` show them."""
        if self.drafter is None:
            return None
        scheduler = self.scheduler
        return {
            "drafter": self.draft_name or "default",
            "costs": cost_figures(scheduler.costs, scheduler.config.k_max),
            "acceptance_by_depth": acceptance_by_depth([scheduler.totals]),
        }

    def _tell_batch(self, model: LanguageModel, rows: int, seconds: float) -> None:
        if model is self.target:
            for f in self.batch_listeners:
                f(rows)

    # ------------------------------------------------------------------ loading
    @classmethod
    async def load(
        cls,
        name_or_path: str | os.PathLike[str],
        draft: str | os.PathLike[str] | None = None,
        *,
        max_length: int | None = DEFAULT_LOAD.max_length,
        threads: int | None = DEFAULT_LOAD.threads,
        provider: str = DEFAULT_LOAD.provider,
        slots: int = DEFAULT_LOAD.slots,
        spec_config: SpecConfig | None = DEFAULT_LOAD.spec_config,
        prefix_cache: bool = DEFAULT_LOAD.prefix_cache,
        prefix_cache_bytes: int = DEFAULT_LOAD.prefix_cache_bytes,
        warmup: bool = DEFAULT_LOAD.warmup,
        consumer_timeout: float | None = DEFAULT_LOAD.consumer_timeout,
        precision: str = DEFAULT_LOAD.precision,
        shared_weights: bool = DEFAULT_LOAD.shared_weights,
    ) -> "Engine":
        """Load a built recipe (``"smollm2-135m"``) or an export folder.

        Args:
            name_or_path: A recipe's name or an export folder.
            draft: ``None`` for the default (``DEFAULT_DRAFT``: n-gram lookup, else the
                manifest's first draft model), ``"none"``, ``"ngram"``, a draft model (a name from
                the manifest such as ``"q4"``, ``"model"`` for the first, or a folder), or
                ``"ngram+<draft model>"``.
            max_length: KV capacity per request, prompt and answer (``None``: 4096), capped at
                the model's positions.
            threads: ONNX Runtime's intra-op threads per model (``None``: the CPUs this process
                may use).
            provider: ``"auto"`` (CUDA when onnxruntime-gpu sees a GPU, else CPU), ``"cpu"`` or
                ``"cuda"``.
            slots: Requests that run (and are batched) at once; KV memory is committed only for
                the positions a request uses.
            spec_config: The speculation policy (default: ``SpecConfig()``).
            prefix_cache: Keep what finished requests computed (prompt and answer) and start new
                requests from the longest cached prefix (:mod:`specdec_rt.kvcache.prefix`; CPU).
            prefix_cache_bytes: The prefix cache's KV memory over all models (least recently
                used entries go first).
            warmup: Build the grammar engine's token table (if llguidance is installed) and run
                :meth:`warm_up` before returning (about a second on the default model).
            consumer_timeout: Seconds (default 30) a request whose consumer takes none of its
                waiting events may wait before it ends with
                :class:`~specdec_rt.errors.ConsumerTimeoutError` and frees its slot (``None`` or
                ``0``: no limit; see :class:`Engine`).
            precision: Which of the folder's targets runs (:mod:`specdec_rt.engine.precision`):
                ``"exported"`` (default: the folder's own), ``"float32"`` / ``"int8"`` /
                ``"int4"`` (a quantized copy among its drafts, loaded as the target; an error
                names what the folder offers), or ``"auto"``: the fastest exact configuration on
                this machine, target and draft, measured on first use (about a minute on the
                default model; progress goes to the ``specdec_rt.engine.tune`` logger at info
                level, which ``serve`` shows on stderr) and cached in
                ``~/.cache/specdec-rt/tune/`` (:mod:`specdec_rt.engine.tune`; engines or
                processes loading the same at once measure once, the others wait and read it);
                an explicit ``draft`` wins over the tuned one. :attr:`choice` says what was
                chosen and how.
            shared_weights: On the CPU, map each model's weights as ONNX Runtime packs them
                from a copy written once per machine (``~/.cache/specdec-rt/prepacked/``), so
                processes on one export share them (docs/memory.md). ``False``: each process
                packs its own, in private memory. The outputs are the same.

        Returns:
            The loaded engine.

        Raises:
            ModelNotBuiltError: A recipe that is not built (the error names the command that
                builds it).
            ModelLoadError: A folder or draft that cannot be loaded (no manifest, a draft
                whose vocabulary differs from the target's, ...).
            InvalidInputError: An option out of range, or a ``precision`` the folder does not
                offer.
        """
        given = locals()  # the keywords: LoadOptions' fields, by name
        options = LoadOptions(**{f.name: given[f.name] for f in fields(LoadOptions)})
        return await cls._from_options(name_or_path, options)

    @classmethod
    async def _from_options(cls, name_or_path: str | os.PathLike[str], options: LoadOptions) -> "Engine":
        """:meth:`load` with its keywords as one :class:`~specdec_rt.engine.factory.LoadOptions`."""
        check_bool(options.warmup, "warmup")
        check_bool(options.shared_weights, "shared_weights")
        check_precision(options.precision)
        tuned = _Tuned()
        if options.precision == "auto":
            options, tuned = await cls._tune(name_or_path, options)
        engine = await anyio.to_thread.run_sync(lambda: cls._load(name_or_path, options, tuned))
        if tuned.measured is not None and engine.choice is not None:
            engine.choice = engine.choice.with_measured(tuned.measured)
        if options.warmup:
            try:
                await anyio.to_thread.run_sync(engine.grammars.prepare)  # (not while serving: it holds the GIL)
                await engine.warm_up()
            except BaseException:
                await engine.aclose()
                raise
        return engine

    @classmethod
    async def _tune(cls, name_or_path: str | os.PathLike[str], options: LoadOptions) -> tuple[LoadOptions, _Tuned]:
        """``precision="auto"``: the tuned precision and draft (an explicit draft wins) as
        options to load, and how they were chosen."""
        from .tune import choose  # (it loads engines of its own)

        _check_load_options(name_or_path, options)  # before a minute of tuning
        tuned = await choose(
            name_or_path,
            cls.load,
            threads=options.threads,
            slots=options.slots,
            provider=options.provider,
            max_length=options.max_length,
        )
        draft_asked = options.draft is not None
        chosen = _Tuned(
            chosen_by=tuned.chosen_by,
            draft_asked=draft_asked,
            measured=None if draft_asked else tuned.result.best,  # (/v1/models shows it)
        )
        draft = options.draft if draft_asked else tuned.draft
        return replace(options, precision=tuned.precision, draft=draft), chosen

    async def warm_up(self, requests: int = WARMUP_REQUESTS, max_new_tokens: int = WARMUP_TOKENS) -> None:
        """Run ``requests`` short requests one after another before serving, then forget them
        except what they measured (see :func:`specdec_rt.engine.warmup.warm_up`, which says why).

        Args:
            requests: How many warm-up requests run.
            max_new_tokens: Tokens each of them generates.
        """
        await warm_up(self, requests, max_new_tokens)

    @classmethod
    def _load(cls, name_or_path: str | os.PathLike[str], options: LoadOptions, tuned: _Tuned) -> "Engine":
        """Build the engine (in a worker thread): its arguments checked before any model is built."""
        _check_load_options(name_or_path, options)
        check_bool(options.prefix_cache, "prefix_cache")
        check_number(options.consumer_timeout, "consumer_timeout", 0, optional=True)
        check_int(options.prefix_cache_bytes, "prefix_cache_bytes", 0, numpy=False)
        parts = build_parts(name_or_path, options)
        engine = cls(
            parts.target,
            parts.drafter,
            parts.codec,
            options.spec_config,
            slots=options.slots,
            draft_name=parts.draft_name,
            verifier=parts.verifier,
            executor=parts.executor,
            models=parts.models,
            eos_ids=parts.manifest.eos_ids,
            manifest=parts.manifest,
            consumer_timeout=options.consumer_timeout,
        )
        pinned = "exported" if options.precision == "exported" else "pinned"
        engine.choice = PrecisionChoice(
            parts.candidate.precision,
            parts.draft_name or "none",
            tuned.chosen_by or pinned,
            parts.candidate.exact_to,
            draft_asked=tuned.draft_asked,
        )
        return engine

    # ------------------------------------------------------------------ generation
    async def generate(
        self, prompt: Prompt, params: RequestParams | int | None = None, **overrides: Any
    ) -> EngineResult:
        """Generate a completion.

        Args:
            prompt: A string, chat messages ``[{"role": ..., "content": ...}]`` rendered with the
                model's chat template (content: a string, or OpenAI-style text parts ``[{"type":
                "text", "text": ...}]``, joined), or token ids (a list of ints, used as they are).
            params: A :class:`~specdec_rt.request.params.RequestParams` (None: the defaults; an
                integer: ``max_new_tokens``, the older form).
            **overrides: Its fields as keywords (``max_new_tokens=64, temperature=0.7, seed=1``),
                which win over ``params``. The fields (sampling, ``mode``, ``stop``,
                log-probabilities, ``response_format``, ``tools``, ``min_tokens``, ...) are
                documented on :class:`~specdec_rt.request.params.RequestParams`.

        Returns:
            The text, its token ids, the request's statistics, and what the request asked for
            (log-probabilities, the prompt's, tool calls).

        Raises:
            InvalidInputError: An unknown keyword (named), a bad parameter, or ``mode="spec"`` on an
                engine without a draft model.
            ContextLengthError: The prompt and ``max_new_tokens`` do not fit the model.
            EngineClosedError: The engine is closed.
            SpecDecError: The request failed (its KV slots are released; the engine stays usable).
        """
        parts: list[str] = []
        ids: list[int] = []
        lps: list[TokenLogprob] = []
        stats: Stats | None = None
        first = StreamEvent("", ())
        async with self.stream(prompt, params, **overrides) as events:
            request = events.params
            async for ev in events:
                first = ev if ev.prompt_logprobs is not None else first
                parts.append(ev.text)
                ids.extend(ev.token_ids)
                lps.extend(ev.logprobs or ())
                stats = ev.stats or stats
        assert stats is not None  # the stream's last event carries them
        return _result(request, first, text="".join(parts), ids=ids, logprobs=lps, stats=stats)

    def stream(self, prompt: Prompt, params: RequestParams | int | None = None, **overrides: Any) -> "EngineStream":
        """Like :meth:`generate`, as an async iterator of :class:`StreamEvent` (also an async
        context manager that closes it).

        Cheap checks run here and raise at once (the parameters, see
        :class:`~specdec_rt.request.params.RequestParams`; a draft model for ``mode="spec"``;
        ``tools`` with chat messages; the prompt's type and size: at most ``max_prompt_chars``
        characters). Rendering the chat template and tokenizing run in a worker thread (a prompt of
        16k characters or more: in a child process, see :attr:`prompt_encoder`), so a huge prompt
        never stalls the event loop; what they find (e.g. ``ContextLengthError``) is raised by
        :meth:`EngineStream.ready` and by the first iteration, still before any model work.

        Args:
            prompt: As :meth:`generate`'s.
            params: As :meth:`generate`'s.
            **overrides: As :meth:`generate`'s.

        Returns:
            The request's stream; the request runs in a task of its own from now on.

        Raises:
            InvalidInputError: A bad parameter or prompt (the checks above).
            EngineClosedError: The engine is closed.
        """
        if self._closed:
            raise EngineClosedError("this engine is closed")
        request = _request_params(params, overrides)
        if request.mode is None:  # the engine's own: speculative when it has a drafter
            request = request.with_mode("ar" if self.drafter is None else "spec")
        elif request.mode == "spec" and self.drafter is None:
            raise InvalidInputError("this engine has no draft model: load it with draft=... or use mode='ar'")
        stops = list(request.stop or ())  # (a tuple of strings once checked)
        shape = self._shape(prompt, request, stops)
        check_prompt_size(prompt, self.max_prompt_chars)
        send: MemoryObjectSendStream[StreamEvent | Exception]
        receive: MemoryObjectReceiveStream[StreamEvent | Exception]
        send, receive = anyio.create_memory_object_stream(STREAM_BUFFER)
        stream = EngineStream(receive, self, request)
        self.watch_loop()
        task = asyncio.get_running_loop().create_task(
            self._produce(stream._ready, prompt, request, stops, send=send, shape=shape)
        )
        stream._attach(task)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return stream

    def _shape(self, prompt: Prompt, request: RequestParams, stops: list[str]) -> RequestShape:
        """What the request asks of its answer beyond sampling (prompt log-probabilities, a JSON
        schema, tools, minimum tokens); a response format and a tool grammar cannot both hold it."""
        shape = RequestShape(
            request.prompt_logprobs,
            request.json_schema,
            *tool_shape(prompt, request.tools, request.effective_tool_choice, stops, template=self.codec.chat_template),
            request.min_tokens,
            request.ignore_eos,
        )
        if shape.schema is not None and shape.lark is not None:
            raise InvalidInputError(
                f"response_format and tool_choice={request.tool_choice!r} cannot both hold the answer"
            )
        return shape

    def _encode(
        self, prompt: Prompt, max_new_tokens: int, truncate_prompt: bool, tools: Sequence[dict[str, Any]] | None = None
    ) -> list[int] | np.ndarray:
        """The prompt's token ids, cut to fit with ``truncate_prompt`` (in a worker thread: a chat
        template may take a while). Starting the scheduler's request is the event loop's: it
        reads the prefix cache, whose bookkeeping only the loop's thread may touch. A big
        prompt's ids come from :attr:`prompt_encoder` as an array, made a list only once they
        fit (one that does not fit stays an array, for the scheduler to refuse by its size)."""
        ids: list[int] | np.ndarray
        try:
            ids = token_id_prompt(prompt, self.target.vocab_size) or self.prompt_encoder.encode(
                cast("str | Sequence[dict[str, Any]]", prompt), tools=tools
            )  # (not token ids: those were taken)
        except SpecDecError:
            raise
        except Exception as exc:  # noqa: BLE001 - the codec maps what it knows; anything else is still the prompt's
            raise InvalidInputError(f"prompt cannot be encoded: {type(exc).__name__}: {exc}"[:300]) from exc
        except PASS_THROUGH:
            raise
        except BaseException as exc:  # a native library's panic: never a request that ends without a word
            raise InferenceError(f"prompt cannot be encoded: {type(exc).__name__}: {exc}"[:300]) from exc
        if len(ids) == 0:
            raise InvalidInputError("prompt encodes to no tokens: give some text")
        limit = self.scheduler.max_length or len(ids) + max_new_tokens
        if truncate_prompt and len(ids) + max_new_tokens > limit:
            if max_new_tokens >= limit:  # no prompt token would be left
                raise ContextLengthError(
                    f"max_new_tokens={brief_repr(max_new_tokens)} leaves no room for the prompt "
                    f"in the model's maximum length of {limit} tokens",
                    len(ids),
                    limit,
                )
            ids = ids[-(limit - max_new_tokens) :]
        if isinstance(ids, np.ndarray) and len(ids) + max_new_tokens <= limit:
            ids = ids.tolist()
        return ids

    def _constraint(self, shape: RequestShape) -> Any:
        """The request's constraint, or None (in a worker thread): its JSON schema's, or its call
        grammar's, whose parameter schemas are compiled on their own first (one the grammar engine
        gives up on is refused now, before anything runs); ``min_tokens`` on top."""
        grammar = None
        if shape.lark is not None:
            for schema in shape.checks:
                self.grammars.build(schema, what="tool_choice")
            grammar = self.grammars.build(lark=shape.lark, what="tool_choice")
        elif shape.schema is not None:
            grammar = self.grammars.build(shape.schema)
        if shape.min_tokens and not shape.ignore_eos:
            return MinTokens(shape.min_tokens, self.scheduler.eos_ids, self.target.vocab_size, grammar)
        return grammar

    async def _produce(
        self,
        ready: _Ready,
        prompt: Prompt,
        params: RequestParams,
        stops: list[str],
        *,
        send: MemoryObjectSendStream[StreamEvent | Exception],
        shape: RequestShape,
    ) -> None:
        """One request, as a task: encode, run, detokenize, cut at stop strings, hand events over."""
        async with send:
            try:
                try:
                    ids, request = await self._start(prompt, params, shape)
                except BaseException as exc:
                    ready.set(exc if isinstance(exc, Exception) else None)
                    raise
                ready.set(None, len(ids))
                await self._take_slot()
                try:
                    if shape.prompt_top is not None:  # the prompt's own tokens first, in the request's slot
                        scored = await prompt_logprobs_of(self.target, np.asarray(ids), shape.prompt_top)
                        scores = StreamEvent("", (), prompt_token_ids=tuple(ids), prompt_logprobs=tuple(scored))
                        await self._hand_over(send, scores)
                    await self._answer(request, _Answer(self.codec.decoder(), stops, shape.min_tokens), send, shape)
                finally:
                    await request.aclose()  # releases the request's KV slots, however it ended
                    self.running -= 1
                    self._slots.release()
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # the consumer went away: nothing to tell
            except ConsumerTimeoutError as exc:  # no room to queue it: raised after the waiting events
                ready.ended = exc
            except Exception as exc:  # noqa: BLE001 - handed to the consumer
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    await send.send(exc)

    async def _start(
        self, prompt: Prompt, params: RequestParams, shape: RequestShape
    ) -> tuple[Sequence[int] | np.ndarray, RequestStream]:
        """Encode the prompt and build its constraint (in worker threads), then start the
        scheduler's request on the loop (it reads the prefix cache); it checks the rest."""
        ids: Sequence[int] | np.ndarray = await anyio.to_thread.run_sync(
            lambda: self._encode(prompt, params.max_new_tokens, params.truncate_prompt, shape.tools)
        )
        compiles = shape.schema is not None or shape.lark is not None  # a grammar: in a grammar thread
        constraint = (
            await asyncio.get_running_loop().run_in_executor(GRAMMAR_THREADS, self._constraint, shape)
            if compiles
            else self._constraint(shape)
        )
        request = self.scheduler.stream(
            ids,
            params.max_new_tokens,
            params.sampling_params(),
            mode="ar" if params.mode == "ar" else "spec",  # (resolved in stream)
            logprobs=params.logprobs,
            constraint=constraint,
            ignore_eos=shape.ignore_eos,
        )
        return ids, request

    async def _take_slot(self) -> None:
        """Wait for a free slot (counted in :attr:`waiting`), then hold it (in :attr:`running`)."""
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1

    async def _answer(
        self,
        request: RequestStream,
        answer: _Answer,
        send: MemoryObjectSendStream[StreamEvent | Exception],
        shape: RequestShape,
    ) -> None:
        """Run the request, handing its events over as text; end at the first stop string."""
        async for ev in request:
            finished = ev.finished
            ids, stopped = answer.push(ev.token_ids, finished is not None)
            if stopped:  # end at a stop string: emit the text before it
                finished = request.context.finish_reason = request.stats.finish_reason = "stop"
                request.stats.new_tokens = answer.kept  # the tokens up to the stop, in every mode
            lps = ev.logprobs[: len(ids)] if ev.logprobs is not None else None
            if finished and shape.prompt_top is not None:  # its own scoring pass computed the
                request.stats.cached_prompt_tokens = 0  # prompt: nothing came from earlier ones
            event = StreamEvent(
                answer.take(finished is not None),
                tuple(ids),
                finished,
                stats=request.stats if finished else None,
                logprobs=lps,
            )
            await self._hand_over(send, event)
            if stopped:
                break

    async def _hand_over(self, send: MemoryObjectSendStream[StreamEvent | Exception], event: StreamEvent) -> None:
        """Queue ``event`` for the consumer; when :data:`STREAM_BUFFER` events wait already,
        wait at most ``consumer_timeout`` seconds for it to take one, then end the request."""
        timeout = self.consumer_timeout
        if timeout is None:
            await send.send(event)
            return
        with anyio.move_on_after(timeout):
            await send.send(event)
            return
        raise ConsumerTimeoutError(
            f"the request ended: its consumer took no event for {timeout:g} s "
            f"(consumer_timeout={timeout:g}) and its KV slot was freed; read the stream "
            "to its end, or close it (aclose(), async with) when done with it",
            timeout,
        )

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token id stands for (its text may be part of a UTF-8 character; a
        special token: its text; an id the model has but the tokenizer lacks: ``b""``)."""
        return self.codec.token_bytes(self._vocab_id(token_id))

    def is_special_token(self, token_id: int) -> bool:
        """Whether a token id is a special token (end of turn, ...), which ``text`` leaves out."""
        return self.codec.is_special(self._vocab_id(token_id))

    def _vocab_id(self, token_id: int) -> int:
        return int(check_int(token_id, "token_id", 0, self.target.vocab_size - 1))

    # ------------------------------------------------------------------ lifecycle
    def watch_loop(self) -> LoopWatch:
        """Start :attr:`loop_watch` on the running event loop (once; requests start it too), and
        return it. It stops when the engine closes."""
        loop = asyncio.get_running_loop()
        task = self._watch_task
        if not self._closed and (task is None or task.done() or task.get_loop() is not loop):
            self._watch_task = loop.create_task(self.loop_watch.run(), name="specdec-loop-watch")
        return self.loop_watch

    async def aclose(self) -> None:
        """Stop the step loop after the model call in flight, end running requests with
        :class:`EngineClosedError`, then release the models (ONNX Runtime sessions and KV pools).

        A second call does nothing. Requests started after it raise :class:`EngineClosedError`.
        """
        if self._closed:
            return
        self._closed = True
        try:
            await self.executor.aclose()  # no model call runs after this
            if self._watch_task is not None and not self._watch_task.done():
                self._watch_task.cancel()
            loop = asyncio.get_running_loop()  # tasks of an event loop that has ended cannot run: left alone
            tasks = [t for t in self._tasks if t.get_loop() is loop and not t.done()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks)
        finally:  # the models are released whatever happened above
            self.prompt_encoder.close()
            for model in self.models:
                model.close()

    async def __aenter__(self) -> "Engine":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class _Answer:
    """A request's answer as text: decoded event by event, and cut at its first stop string
    token by token, as a plain step would see it (see ``cut_at_stop``)."""

    def __init__(self, decoder: Any, stops: list[str], min_tokens: int) -> None:
        self.decoder, self.stops, self.min_tokens = decoder, stops, min_tokens
        self.text = ""  # decoded so far
        self.shown = 0  # characters of it handed over
        self.kept = 0  # tokens kept

    def push(self, ids: Sequence[int], finished: bool) -> tuple[Sequence[int], bool]:
        """Decode one event's ids: (the ids kept, whether a stop string ended the answer)."""
        if self.stops:
            ids, self.text, cut = cut_at_stop(
                self.decoder, self.text, ids, self.stops, finished=finished, done=self.kept, min_tokens=self.min_tokens
            )
        else:
            self.text, cut = self.text + self.decoder.push(ids) + (self.decoder.flush() if finished else ""), None
        self.kept += len(ids)
        if cut is not None:
            self.text = self.text[:cut]
        return ids, cut is not None

    def take(self, finished: bool) -> str:
        """The text not handed over yet, less a tail that may still start a stop string."""
        held = stop_prefix_len(self.text, self.stops, self.shown) if self.stops and not finished else 0
        upto = len(self.text) - held
        new = self.text[self.shown : upto]
        self.shown = max(self.shown, upto)
        return new


@dataclass(frozen=True)
class _Tuned:
    """How ``precision="auto"`` chose (all unset: it did not run)."""

    chosen_by: str | None = None  # "tuned" or "cached"
    draft_asked: bool = False  # the caller's draft was loaded, not the tuned one
    measured: TuneRow | None = None  # what the tune measured of the configuration loaded


def _check_load_options(name_or_path: object, options: LoadOptions) -> None:
    """The options checked first, before a file is read (the rest are checked by the load)."""
    check_load_args(
        name_or_path,
        options.draft,
        max_length=options.max_length,
        threads=options.threads,
        spec_config=options.spec_config,
    )
    check_int(options.slots, "slots", 1, MAX_SLOTS, numpy=False)


class _MeasuredBatch(BatchCosts):
    """The :class:`BatchCosts` of an engine: what its step loop measured of its target's and
    draft's batched calls, and how many requests it has admitted."""

    def __init__(self, engine: Engine, draft: LanguageModel | None) -> None:
        self.engine, self.draft = engine, draft

    def target_step(self, rows: int, positions: int | None = None) -> float | None:
        return self.engine.executor.step_seconds(self.engine.target, rows, positions)

    def draft_step(self, rows: int) -> float | None:
        return self.engine.executor.step_seconds(self.draft, rows) if self.draft is not None else None

    def target_shapes(self, rows: int) -> list[int]:
        return self.engine.executor.measured_positions(self.engine.target, rows)

    def admitted(self) -> int:
        return min(len(self.engine._tasks), self.engine.slots)


def _result(
    request: RequestParams,
    first: StreamEvent,
    *,
    text: str,
    ids: list[int],
    logprobs: list[TokenLogprob],
    stats: Stats,
) -> EngineResult:
    """:meth:`Engine.generate`'s result from its stream's events: ``first`` is the event with the
    prompt's log-probabilities (when asked); tool calls are parsed from ``text`` when the request
    has tools."""
    return EngineResult(
        text=text,
        token_ids=ids,
        stats=stats,
        prompt_tokens=stats.prompt_tokens,
        logprobs=logprobs if request.logprobs is not None else None,
        prompt_token_ids=None if first.prompt_token_ids is None else list(first.prompt_token_ids),
        prompt_logprobs=None if first.prompt_logprobs is None else list(first.prompt_logprobs),
        tool_calls=(
            parse_tool_calls(text, [t["function"]["name"] for t in request.tools or ()])[1]
            if request.calls_tools
            else None
        ),
    )


def _request_params(params: object, overrides: dict[str, Any]) -> RequestParams:
    """``generate`` / ``stream``'s parameters as one checked :class:`RequestParams`: ``params``
    (None, a RequestParams, or ``max_new_tokens`` as a number, the older positional form) with
    the keyword ``overrides`` on top."""
    if params is None or isinstance(params, RequestParams):
        return RequestParams.of(params, **overrides)
    if not isinstance(params, (int, float, np.number)):
        raise InvalidInputError(
            f"params must be a RequestParams (or max_new_tokens, an integer), got {brief_repr(params)}"
        )
    if "max_new_tokens" in overrides:
        raise InvalidInputError("max_new_tokens is given twice: as the second argument and as a keyword")
    return RequestParams.of(None, max_new_tokens=params, **overrides)
