"""``RequestParams``: everything one request may set, checked once (like vLLM's ``SamplingParams``).

    params = RequestParams(max_new_tokens=64, temperature=0.7, seed=1)
    await engine.generate("Hello", params)                    # or the same as keywords
    await engine.generate("Hello", params, temperature=0.0)   # keywords override fields

What only the engine or the prompt can tell (a draft model for ``mode="spec"``, tools with a
plain-text prompt, the prompt's size and the context length) is checked by
:meth:`~specdec_rt.engine.engine.Engine.stream`; everything else here, on construction.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..checks import brief_repr, check_bool, check_int
from ..errors import InvalidInputError
from ..sampling import SamplingParams
from ..sampling.constraints import check_response_format
from ..sampling.logprobs import check_top_logprobs
from ..text.tools import check_tool_choice, checked_tools
from ..types import Mode
from .checks import check_length_options, check_stop

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "RequestParams"]

DEFAULT_MAX_NEW_TOKENS = 256


@dataclass(frozen=True)
class RequestParams:
    """One request's parameters, checked when the object is made (or :meth:`replace`-d).

    Attributes:
        max_new_tokens: At most this many tokens are generated (a positive integer).
        temperature: Sampling temperature (:class:`~specdec_rt.sampling.SamplingParams`); 0 is
            greedy.
        top_k: Keep the k most likely tokens.
        top_p: Keep the smallest set of most likely tokens holding this much mass.
        seed: Makes a sampled request reproducible.
        mode: ``"spec"`` (speculative) or ``"ar"`` (plain decoding); the same output either
            way. ``None`` (the default): the engine's own, ``"spec"`` when it has a drafter (a
            draft model or n-gram lookup) and ``"ar"`` when it has none (``draft="none"``, or
            what ``precision="auto"`` chose); ``"spec"`` on an engine without a drafter is an
            error.
        stop: Strings that end the generation (the text is cut before the stop string;
            ``token_ids`` end with the token that completes it, in either mode; a stream holds
            back text that may start one). A string or a sequence of them; kept as a tuple.
        truncate_prompt: Keep only the last prompt tokens that fit instead of raising
            ``ContextLengthError``.
        logprobs: ``n`` (0..20): each token's log-probability under the target model (before
            temperature, top-k, top-p; the same in either mode) with the ``n`` most likely
            tokens there (:class:`~specdec_rt.sampling.logprobs.TokenLogprob`).
        logit_bias: ``{token id: bias}`` (-100 to 100) added to the logits before temperature,
            top-k, top-p and greedy's argmax (-100 bans a token), in either mode; the reported
            log-probabilities stay the model's own.
        presence_penalty: -2 to 2 (OpenAI's; None: 0); with the next two, discourages tokens
            already generated (:mod:`specdec_rt.sampling.penalties`); speculation stays exact
            for the penalized target.
        frequency_penalty: -2 to 2 (OpenAI's; None: 0).
        repetition_penalty: 0.01 to 10 (1 or None is off).
        prompt_logprobs: ``n`` (0..20): also each prompt token's log-probability after the ones
            before it, with the ``n`` most likely tokens there
            (``EngineResult.prompt_logprobs``; the first token has none); one more pass of the
            target over the prompt, whose KV the prefix cache then hands to the generation
            (:mod:`specdec_rt.sampling.prompt_logprobs`).
        response_format: OpenAI's, ``{"type": "json_object"}`` or ``{"type": "json_schema",
            "json_schema": {"schema": {...}}}``: only tokens that keep the output on its way to
            such JSON are chosen, by draft and target alike, and the end-of-sequence token only
            once it is complete (:mod:`specdec_rt.sampling.constraints`; needs the
            ``structured`` extra).
        tools: OpenAI's function list (with chat messages and a template that renders them;
            kept as a tuple): the calls in the answer are ``EngineResult.tool_calls``
            (:mod:`specdec_rt.text.tools`).
        tool_choice: ``"auto"``, ``"none"``, ``"required"`` or a named function, held to by a
            grammar (None: ``"auto"`` with tools).
        min_tokens: No end-of-sequence token before that many tokens (draft and target alike),
            nor a stop string completed by one of them (0 to ``max_new_tokens``).
        ignore_eos: Go on past end-of-sequence tokens, up to ``max_new_tokens`` or a stop
            string (vLLM's rules and options, which load-testing tools send).

    Raises:
        InvalidInputError: A bad value, naming the field.
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    mode: Mode | None = None
    stop: str | Sequence[str] | None = ()
    truncate_prompt: bool = False
    logprobs: int | None = None
    logit_bias: Mapping[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    prompt_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: Sequence[dict[str, Any]] | None = ()
    tool_choice: str | dict[str, Any] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    #: the sampler's view (:meth:`sampling_params`), built with the checks
    _sampling: SamplingParams = field(init=False, repr=False, compare=False)
    #: the JSON schema ``response_format`` holds the answer to (None: free text)
    _schema: dict[str, Any] | None = field(init=False, repr=False, compare=False)
    #: ``tool_choice`` as it applies (None resolved against ``tools``)
    _choice: str | dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        put = object.__setattr__  # frozen: the checked (canonical) values go in this way
        if self.mode is not None and (not isinstance(self.mode, str) or self.mode not in ("spec", "ar")):
            raise InvalidInputError(f"mode must be 'spec', 'ar' or None, got {brief_repr(self.mode)}")
        check_int(self.max_new_tokens, "max_new_tokens", 1, numpy=False)
        for name, value, off in (
            ("presence_penalty", self.presence_penalty, 0.0),
            ("frequency_penalty", self.frequency_penalty, 0.0),
            ("repetition_penalty", self.repetition_penalty, 1.0),
        ):
            put(self, name, off if value is None else value)
        bias: Any = self.logit_bias  # a dict[str, Any] or pairs: SamplingParams keeps them as sorted pairs
        put(
            self,
            "_sampling",
            SamplingParams(
                temperature=self.temperature,
                top_k=self.top_k,
                top_p=self.top_p,
                seed=self.seed,
                logit_bias=bias,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
            ),
        )
        # keep no reference to the caller's dict[str, Any]: what the sampler uses is what this object shows
        sampled_bias = self._sampling.logit_bias
        put(self, "logit_bias", None if sampled_bias is None else dict(sampled_bias))
        put(self, "logprobs", check_top_logprobs(self.logprobs))
        put(self, "prompt_logprobs", check_top_logprobs(self.prompt_logprobs, "prompt_logprobs"))
        put(self, "stop", tuple(check_stop(self.stop)))
        put(self, "_schema", check_response_format(self.response_format))
        tools = checked_tools(self.tools)  # (checked once: the same list again is not)
        put(self, "tools", tools)
        put(self, "_choice", check_tool_choice(self.tool_choice, tools))
        check_length_options(self.min_tokens, self.ignore_eos, self.max_new_tokens)
        check_bool(self.truncate_prompt, "truncate_prompt")

    @classmethod
    def of(cls, params: RequestParams | None = None, /, **overrides: Any) -> RequestParams:
        """``params`` (None: the defaults) with ``overrides`` (field names) in place of its
        values, checked; an unknown name is an :class:`InvalidInputError` naming it."""
        if params is not None and not isinstance(params, RequestParams):
            raise InvalidInputError(f"params must be a RequestParams or None, got {brief_repr(params)}")
        unknown = sorted(set(overrides) - set(FIELDS))
        if unknown:
            raise InvalidInputError(
                f"unknown request parameter{'s' * (len(unknown) > 1)} "
                f"{', '.join(map(repr, unknown))}; known: {', '.join(FIELDS)}"
            )
        if params is None:
            return cls(**overrides)
        return dataclasses.replace(params, **overrides) if overrides else params

    def replace(self, **overrides: Any) -> RequestParams:
        """A copy with ``overrides`` in place of these values (checked like a new one)."""
        return RequestParams.of(self, **overrides)

    def with_mode(self, mode: Mode) -> RequestParams:
        """A copy whose ``mode`` is ``mode`` (``"spec"`` or ``"ar"``), the rest as checked already:
        what an engine resolves ``mode=None`` to, without checking large tools or schemas again."""
        if mode not in ("spec", "ar"):
            raise InvalidInputError(f"mode must be 'spec' or 'ar', got {brief_repr(mode)}")
        resolved = copy.copy(self)  # (no __post_init__: the checked values are carried over)
        object.__setattr__(resolved, "mode", mode)
        return resolved

    def sampling_params(self) -> SamplingParams:
        """The sampler's view of this request (temperature, top-k, top-p, seed, logit bias and
        penalties), as the scheduler takes it: the one mapping from these fields to it."""
        return self._sampling

    @property
    def json_schema(self) -> dict[str, Any] | None:
        """The JSON schema ``response_format`` holds the answer to, or None (free text)."""
        return self._schema

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may hold tool calls (``tools`` given, ``tool_choice`` not ``"none"``)."""
        return bool(self.tools) and self._choice != "none"

    @property
    def effective_tool_choice(self) -> str | dict[str, Any]:
        """``tool_choice`` as it applies: None means ``"auto"`` with tools, ``"none"`` without."""
        return self._choice


#: the fields a request may set, in order (the keywords ``Engine.generate`` / ``stream`` take)
FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RequestParams) if f.init)
