"""Careless and hostile Engine arguments (issue 11, items 5 and 6): temperatures too small to
divide by, rows that are not distributions, and wrong types. Every bad argument is an
``InvalidInputError`` naming the field: the cheap checks raise from ``Engine.stream`` itself,
before the request's task starts; what only encoding finds (a lone surrogate) from
``EngineStream.ready()`` and the first iteration, still before any model work."""

from __future__ import annotations

import warnings

import anyio
import numpy as np
import pytest

from specdec_rt import CacheSession, InvalidInputError, LanguageModel, SpecConfig
from specdec_rt.engine.engine import MAX_STOP_STRINGS, Engine
from specdec_rt.engine.factory import engine_models as _models
from specdec_rt.request.checks import MAX_STOP_CHARS
from specdec_rt.sampling import MIN_TEMPERATURE, SamplingParams, sample, warp

PROMPT = "def add(a, b):"


def _engine(folder, **kw):
    return Engine.load(folder, draft="q4", spec_config=SpecConfig(measure_costs=False), **kw)


def _assert_idle(engine):
    assert engine.running == 0 and engine.waiting == 0
    assert [m.pool.free for m in _models(engine.target, engine.drafter)] == [engine.slots] * 2


# ----------------------------------------------------------------------------- item 5: sampling level
@pytest.mark.parametrize("t", [1e-300, 5e-324, 1e-40, 1e-6, MIN_TEMPERATURE * 0.999])
def test_temperatures_below_the_threshold_are_greedy(t):
    params = SamplingParams(temperature=t)
    assert params.greedy and params.temperature == t  # the value is kept, greedy applies
    logits = np.array([[3.0, 7.5, 7.5, -2.0], [100.0, 99.0, -1e30, 0.0]], dtype=np.float32)
    assert warp(logits, params).tolist() == warp(logits, SamplingParams()).tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]


def test_threshold_and_above_sample():
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy
    rng = np.random.default_rng(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow / invalid-value warnings either
        for t in (MIN_TEMPERATURE, 1e-4, 0.7, 1e30, 1e300):
            for dtype in (np.float16, np.float32, np.float64):
                logits = np.array([[3.0, 7.5, 7.49, -np.inf], [-60000, 60000, 0, 1]], dtype=dtype)
                p = warp(logits, SamplingParams(temperature=t, top_k=3))
                assert np.isfinite(p).all() and np.allclose(p.sum(-1), 1, atol=1e-3), (t, dtype, p)
                assert p[0, 3] == 0  # a masked token stays impossible at any temperature
                assert sample(p[0], rng) in (0, 1, 2)


def test_huge_logits_and_masks_never_give_nan():
    """Dividing first made inf - inf = NaN (logits near the float32 limit) and -inf / inf = NaN
    (a masked row at a temperature beyond float32, as EAGLE's full-vocabulary rows are)."""
    big = np.finfo(np.float32).max
    rows = np.array([[big, -big, 0.0, 1.0], [-np.inf, 2.0, -np.inf, 1.0]], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for t in (MIN_TEMPERATURE, 1.0, 1e300):
            p = warp(rows, SamplingParams(temperature=t))
            assert np.isfinite(p).all() and p[1, 0] == p[1, 2] == 0, (t, p)
    p = warp(rows, SamplingParams(temperature=1e300))
    np.testing.assert_allclose(p[1], [0, 0.5, 0, 0.5])  # beyond float32: uniform over the support


@pytest.mark.parametrize(
    "row,what",
    [
        ([0.1, np.nan, 0.5], "row 1"),
        ([np.inf, 0.0, 1.0], "row 1"),
        ([-np.inf, -np.inf, -np.inf], "row 1"),
    ],
)
def test_warp_refuses_rows_that_are_not_distributions(row, what):
    logits = np.array([[0.0, 1.0, 2.0], row], dtype=np.float32)
    for t in (0.0, 1e-300, 0.8):  # greedy too: argmax must not pick a NaN
        with pytest.raises(InvalidInputError, match=f"logits {what} holds NaN or \\+inf, or no finite value"):
            warp(logits, SamplingParams(temperature=t))
    with pytest.raises(InvalidInputError, match="logits row holds NaN"):
        warp(np.array(row, dtype=np.float64), SamplingParams(temperature=0.8))


@pytest.mark.parametrize(
    "probs,what",
    [
        ([0.2, np.nan, 0.8], "NaN or inf"),
        ([np.nan] * 3, "NaN or inf"),
        ([0.0, np.inf, 1.0], "NaN or inf"),
        ([0.5, -0.25, 0.75], "negative"),
        ([0.0, 0.0, 0.0], "sums to 0"),
        ([], "non-empty"),
    ],
)
def test_sample_never_picks_from_a_row_that_is_not_a_distribution(probs, what):
    """Before: a NaN row returned the last id, [0.5, -0.25, 0.75] returned an id anyway."""
    with pytest.raises(InvalidInputError, match=what):
        sample(np.array(probs, dtype=np.float32), np.random.default_rng(0))


def test_sample_sums_integer_weights_without_wrapping_around():
    """An int64 cumulative sum of [2**62, 2**62] wrapped to a negative total ("sums to 0")."""
    rng = np.random.default_rng(0)
    assert {sample(np.array([2**62, 2**62]), rng) for _ in range(64)} == {0, 1}
    assert {sample(np.array([0, 3, 0], dtype=np.uint8), rng) for _ in range(16)} == {1}


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": 10**400}, "temperature"),
        ({"temperature": 10**30 * 10**300}, "temperature"),
        ({"temperature": np.float64("nan")}, "temperature"),
        ({"temperature": np.bool_(True)}, "temperature"),
        ({"top_p": 10**400}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_p": "0.5"}, "top_p"),
    ],
)
def test_sampling_params_refuse_what_is_not_a_finite_number(kwargs, field):
    """``temperature=10**400`` raised numpy's TypeError."""
    with pytest.raises(InvalidInputError, match=f"^{field} must"):
        SamplingParams(**kwargs)
    SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.5), top_k=np.int64(3), seed=np.uint64(5))


# ----------------------------------------------------------------------------- item 5: engine level
@pytest.mark.parametrize("mode", ["ar", "spec"])
def test_tiny_temperatures_give_the_greedy_output(tiny_llama, mode):
    """``temperature=1e-300``: "ar" returned garbage and "spec" failed after model work."""

    async def main():
        async with await _engine(tiny_llama) as engine:
            want = (await engine.generate(PROMPT, max_new_tokens=12, mode=mode)).token_ids
            for t in (1e-300, 5e-324, 1e-38, 1e-7, MIN_TEMPERATURE / 2):
                got = await engine.generate(PROMPT, max_new_tokens=12, mode=mode, temperature=t, seed=1)
                assert got.token_ids == want, t
            _assert_idle(engine)

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        anyio.run(main)


@pytest.mark.parametrize("mode", ["ar", "spec"])
def test_small_and_huge_temperatures_sample_valid_tokens(tiny_llama, mode):
    async def main():
        async with await _engine(tiny_llama) as engine:
            v = engine.target.vocab_size
            for t in (MIN_TEMPERATURE, 1e-4, 1e30, 1e300, 10**30):
                r = await engine.generate(PROMPT, max_new_tokens=8, mode=mode, temperature=t, seed=3)
                assert len(r.token_ids) == 8 and all(0 <= i < v for i in r.token_ids), (t, r.token_ids)
            _assert_idle(engine)

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        anyio.run(main)


# ----------------------------------------------------------------------------- item 6: types
SURROGATE = "\ud800"


class BadRepr:
    def __repr__(self):
        raise RuntimeError("no repr")


# (argument, value, the field the error must name); checked in Engine.stream itself
CHEAP = [
    *[
        ("max_new_tokens", v, "max_new_tokens")
        for v in (None, True, 1.5, "4", float("nan"), float("inf"), -1, 0, [4], {"a": 1}, np.float64(4))
    ],
    *[
        ("temperature", v, "temperature")
        for v in (None, True, "0.5", float("nan"), float("inf"), -1, -1e-300, 10**400, [0.5], {"a": 1})
    ],
    *[("top_k", v, "top_k") for v in (True, 1.5, "4", float("nan"), float("inf"), -1, 0, [4], {"a": 1})],
    *[("top_p", v, "top_p") for v in (True, "0.5", float("nan"), float("inf"), -1, 0, 1.5, 10**30, 10**400, [0.5])],
    *[("seed", v, "seed") for v in (True, 1.5, "4", float("nan"), float("inf"), -1, -(10**30), [4], {"a": 1})],
    *[("mode", v, "mode") for v in (True, 5, ["spec"], {"a": 1}, "SPEC", "", float("nan"), np.array(["spec", "ar"]))],
    *[
        ("stop", v, "stop")
        for v in (
            5,
            True,
            1.5,
            {"a": 1},
            {"a"},
            b"x",
            [5],
            ["a", None],
            [""],
            "",
            [["a"]],
            float("nan"),
            [SURROGATE],
            "ok" + SURROGATE,
            ["x"] * (MAX_STOP_STRINGS + 1),
            ["ok", "y" * (MAX_STOP_CHARS + 1)],
        )
    ],
    *[("truncate_prompt", v, "truncate_prompt") for v in (None, 1, 0, "yes", [True], {"a": 1}, float("nan"))],
    *[("prompt", v, "prompt") for v in (None, True, 5, 1.5, b"x", {"role": "user", "content": "hi"}, np.array(["hi"]))],
    # values that are costly or impossible to print: the message describes them briefly
    ("seed", -(10**5000), "seed"),
    ("max_new_tokens", -(10**5000), "max_new_tokens"),
    ("top_k", [0] * 10**6, "top_k"),
    ("temperature", "x" * 10**7, "temperature"),
    ("mode", "x" * 10**7, "mode"),
    ("stop", ["x"] * 10**6, "stop holds"),
    ("truncate_prompt", BadRepr(), "truncate_prompt"),
    ("stop", [BadRepr()], "stop"),
    ("prompt", BadRepr(), "prompt"),
    ("prompt", "x" * 1001, "prompt has 1001 characters"),
    ("prompt", [{"role": "", "content": ""}] * 2000, "prompt has 2000 messages"),  # each message counts one
]

# (prompt, the field) that only encoding finds: raised by ready() and by the first iteration
ENCODED = [
    (SURROGATE, "prompt is not valid Unicode"),
    ("abc\udfffdef", "prompt is not valid Unicode text: a lone surrogate '\\\\udfff' at index 3"),
    ([{"role": "user", "content": "hi " + SURROGATE}], "messages\\[0\\].content is not valid Unicode"),
    (
        [{"role": "user", "content": "ok"}, {"role": "user", "content": "<|im_end|>" + SURROGATE}],
        "messages\\[1\\].content is not valid Unicode",
    ),  # the plain-text path for special-token text
    ([{"role": SURROGATE, "content": "hi"}], "messages\\[0\\].role is not valid Unicode"),
    ([{"role": -(10**5000), "content": "x" * 500}], "messages\\[0\\] must be a dict .* got a dict$"),
    ([], "chat messages must be a non-empty list"),
    ([None], "messages\\[0\\] must be a dict"),
    ([{"role": "user"}], "messages\\[0\\] must be a dict"),
    ([{"role": "user", "content": 5}], "messages\\[0\\]"),
    (["hi"], "messages\\[0\\] must be a dict"),
    ([{"role": None, "content": "hi"}], "messages\\[0\\]"),
]


def test_bad_arguments_name_their_field_before_the_task_starts(tiny_llama):
    """``stop={'a': 1}`` and ``truncate_prompt="yes"`` were accepted, ``temperature=10**400`` raised
    TypeError; the serve layer maps an error to its field by the message's first word."""

    async def main():
        async with await _engine(tiny_llama) as engine:
            engine.max_prompt_chars = 1000
            calls, wrong = engine.target.calls, []
            for arg, value, field in CHEAP:
                kwargs = {"max_new_tokens": 4, arg: value}
                prompt = kwargs.pop("prompt", "hi")
                try:
                    engine.stream(prompt, **kwargs)  # raises here: no task, no thread
                    wrong.append((arg, value, "accepted"))
                except InvalidInputError as exc:
                    if not str(exc).startswith(field) or len(str(exc)) > 200:
                        wrong.append((arg, value, str(exc)))
                except Exception as exc:  # noqa: BLE001 - that is the bug
                    wrong.append((arg, value, repr(exc)))
            assert not wrong, "\n".join(map(str, wrong))
            assert not engine._tasks and engine.target.calls == calls
            assert (await engine.generate("hi", max_new_tokens=4, stop=("zz",), truncate_prompt=True)).token_ids
            _assert_idle(engine)

    anyio.run(main)


@pytest.mark.parametrize("prompt,msg", ENCODED)
def test_encoding_errors_name_the_field_from_ready_and_iteration(tiny_llama, prompt, msg):
    """A lone surrogate raised the tokenizer's ``TypeError: TextInputSequence must be str``."""

    async def main():
        async with await _engine(tiny_llama) as engine:
            calls = engine.target.calls
            for mode in ("spec", "ar"):
                async with engine.stream(prompt, max_new_tokens=4, mode=mode) as s:
                    with pytest.raises(InvalidInputError, match=msg):
                        await s.ready()
                with pytest.raises(InvalidInputError, match=msg):
                    await engine.generate(prompt, max_new_tokens=4, mode=mode)
            assert engine.target.calls == calls  # no model work
            assert (await engine.generate("hi", max_new_tokens=4)).token_ids
            _assert_idle(engine)

    anyio.run(main)


def test_codec_names_the_field(tiny_llama):
    from specdec_rt.ort import load_manifest
    from specdec_rt.text.codec import TextCodec

    codec = TextCodec.from_manifest(load_manifest(tiny_llama))
    with pytest.raises(InvalidInputError, match="^prompt is not valid Unicode text") as info:
        codec.encode("a" + SURROGATE)
    assert isinstance(info.value.__cause__, TypeError)  # the tokenizer's, kept as the cause
    for allow in (False, True):
        with pytest.raises(InvalidInputError, match=r"^messages\[2\]\.content is not valid"):
            codec.encode_prompt(
                [
                    {"role": "user", "content": "a"},
                    {"role": "user", "content": "<|im_end|>"},
                    {"role": "user", "content": "b" + SURROGATE},
                ],
                allow_special=allow,
            )
    # a field the template does not write is never encoded, so it cannot fail
    assert codec.encode_prompt([{"role": "user", "content": "b", "name": SURROGATE}])
    assert codec.encode("caf\u00e9 \U0001f600") == codec.encode("caf\u00e9 \U0001f600")  # valid text is untouched


def test_a_prompt_that_encodes_to_nothing(tiny_qwen):
    """The qwen2 flavour adds no BOS: "" encodes to no ids (the error was about token ids)."""

    async def main():
        async with await Engine.load(tiny_qwen, draft="ngram") as engine:
            with pytest.raises(InvalidInputError, match="^prompt encodes to no tokens"):
                await engine.generate("", max_new_tokens=4)

    anyio.run(main)


def test_huge_numbers(tiny_llama):
    """``max_new_tokens=10**30`` is a ContextLengthError (from ready(), truncating or not); a
    ``top_k`` beyond the vocabulary and a 80-bit seed are valid."""
    from specdec_rt import ContextLengthError

    async def main():
        async with await _engine(tiny_llama) as engine:
            for truncate, msg in (
                (False, "^prompt of .* max_new_tokens=10{30}"),
                (True, "^max_new_tokens=10{30} leaves no room for the prompt"),
            ):
                async with engine.stream("hi", max_new_tokens=10**30, truncate_prompt=truncate) as s:
                    with pytest.raises(ContextLengthError, match=msg):
                        await s.ready()
            a = await engine.generate(PROMPT, max_new_tokens=6, temperature=0.9, top_k=10**30, seed=2**80)
            b = await engine.generate(PROMPT, max_new_tokens=6, temperature=0.9, seed=2**80)
            assert a.token_ids == b.token_ids
            _assert_idle(engine)

    anyio.run(main)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(max_length="abc"), "max_length"),
        (dict(max_length=2.5), "max_length"),
        (dict(max_length=0), "max_length"),
        (dict(threads="x"), "threads"),
        (dict(threads=0), "threads"),
        (dict(threads=-1), "threads"),
        (dict(threads=True), "threads"),
        (dict(threads=3000), "threads"),
        (dict(spec_config="x"), "spec_config"),
        (dict(draft=3), "draft"),
    ],
)
def test_engine_load_names_a_bad_argument(tiny_llama, kwargs, field):
    with pytest.raises(InvalidInputError, match=f"^{field} must be"):
        anyio.run(lambda: Engine.load(tiny_llama, warmup=False, **kwargs))


@pytest.mark.parametrize("where", [None, 123])
def test_engine_load_names_a_bad_model_argument(where):
    with pytest.raises(InvalidInputError, match="^name_or_path must be"):
        anyio.run(lambda: Engine.load(where))


def test_a_draft_folder_without_a_manifest_says_so(tiny_llama, tmp_path):
    from specdec_rt.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="not a draft folder \\(no manifest.json"):
        anyio.run(lambda: Engine.load(tiny_llama, draft=str(tmp_path), warmup=False))


@pytest.mark.parametrize(
    "argv",
    [["bogus"], ["generate", "--bogus-flag"], ["generate", "--prompt", "x", "--threads", "0"], ["bench", "--nope"]],
)
def test_usage_errors_are_one_line_with_status_2(argv, capsys):
    from specdec_rt.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1 and "error:" in err, err


@pytest.mark.parametrize("max_length", [4, 6])
def test_a_short_max_length_loads_and_generates(tiny_llama, max_length):
    """The load's probe of lone and paired positions fits in a short context (2-6 crashed)."""

    async def main():
        async with await Engine.load(tiny_llama, max_length=max_length, warmup=False) as engine:
            r = await engine.generate("hi", max_new_tokens=1, mode="ar")
            assert len(r.token_ids) == 1

    anyio.run(main)


@pytest.mark.export
def test_a_max_new_tokens_past_the_context_is_a_short_context_error(tiny_llama):
    """An int too long for str() (Python's 4,300-digit limit) made the context check's message
    raise ValueError, outside the one error root; now every such message stays short."""
    from specdec_rt.errors import ContextLengthError

    async def main():
        async with await _engine(tiny_llama) as engine:
            for n in (10**5000, 10**300, engine.scheduler.max_length):
                for truncate in (False, True):
                    with pytest.raises(ContextLengthError) as err:
                        await engine.generate(PROMPT, max_new_tokens=n, truncate_prompt=truncate)
                    assert "max_new_tokens=" in str(err.value) and len(str(err.value)) < 200
            _assert_idle(engine)

    anyio.run(main)


@pytest.mark.export
def test_a_max_length_past_the_graph_is_capped_with_a_warning(tiny_llama, caplog):
    """Capped to the manifest's max_positions as before, but no longer silently (QA); a huge
    int is described, not printed (str() of it would raise)."""
    import logging

    from specdec_rt.ort import OrtModel

    with caplog.at_level(logging.WARNING, logger="specdec_rt"):
        for asked in (100_000, 10**5000):
            model = OrtModel(tiny_llama, max_length=asked, slots=1)
            assert model.max_length == model.manifest.max_positions < 100_000
    lines = [r.getMessage() for r in caplog.records if "max_length_capped" in r.getMessage()]
    assert len(lines) == 2 and "asked='100000'" in lines[0] and "bits" in lines[1]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specdec_rt"):
        OrtModel(tiny_llama, max_length=64, slots=1)
    assert not [r for r in caplog.records if "max_length_capped" in r.getMessage()]


class _FixedSession(CacheSession):
    """A CacheSession whose every call returns ``fn(rows)`` (a broken model's logits)."""

    def __init__(self, fn) -> None:
        self.n, self.fn = 0, fn

    @property
    def length(self) -> int:
        return self.n

    async def extend(self, ids, rows):
        self.n += len(ids)
        return self.fn(rows)

    def rollback(self, length: int) -> None:
        self.n = length

    def close(self) -> None:
        pass


class _FixedModel(LanguageModel):
    vocab_size, max_length = 8, 100

    def __init__(self, fn) -> None:
        self.fn = fn

    def start(self, prefix=None, *, batch_invariant=False):
        return _FixedSession(self.fn)


BROKEN = {
    "NaN": lambda r: np.full((r, 8), np.nan, np.float32),
    "+inf": lambda r: np.full((r, 8), np.inf, np.float32),
    "all -inf": lambda r: np.full((r, 8), -np.inf, np.float32),
}
MISSHAPEN = {
    "too narrow": lambda r: np.zeros((r, 5), np.float32),
    "too wide": lambda r: np.zeros((r, 11), np.float32),
    "one row for several": lambda r: np.zeros((1, 8), np.float32),
    "1-D": lambda r: np.zeros(8, np.float32),
}


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize(
    ("role", "what"),
    [
        (role, what)
        for role in ("target", "draft")
        for what in list(BROKEN) + list(MISSHAPEN)
        if (role, what) != ("draft", "one row for several")
    ],
)  # a draft step asks one row
def test_a_model_whose_logits_are_broken_fails_the_request_in_greedy_decoding_too(greedy, role, what):
    """Greedy decoding took np.argmax of NaN logits (id 0, or the NaN's) and went on; a row of
    the wrong width passed unchecked (QA). Every such call now fails with the error root."""
    from specdec_rt import InferenceError, ModelDrafter, ModelVerifier, SpecDecScheduler
    from specdec_rt.testing import ToyLM

    broken = _FixedModel({**BROKEN, **MISSHAPEN}[what])
    target, draft = (broken, ToyLM(8, seed=1)) if role == "target" else (ToyLM(8, seed=3), broken)
    params = SamplingParams() if greedy else SamplingParams(temperature=0.7, seed=1)
    scheduler = SpecDecScheduler(ModelDrafter(draft), ModelVerifier(target), SpecConfig(measure_costs=False))
    error = InferenceError if what in MISSHAPEN else InvalidInputError
    with pytest.raises(error, match="logits"):
        anyio.run(lambda: scheduler.run([1, 2, 3], 6, params, mode="spec"))
    if role == "target" and what != "one row for several":  # a plain step asks for one row
        with pytest.raises(error, match="logits"):
            anyio.run(lambda: scheduler.run([1, 2, 3], 6, params, mode="ar"))


@pytest.mark.parametrize("bad", ["10", 0, -3, True, 2.5])
def test_a_plug_in_model_with_a_bad_max_length_is_named(bad):
    from specdec_rt import InferenceError, ModelVerifier, SpecDecScheduler
    from specdec_rt.testing import ToyLM

    verifier = ModelVerifier(ToyLM(8, seed=1))
    verifier.max_length = bad
    scheduler = SpecDecScheduler(None, verifier, SpecConfig(measure_costs=False))
    with pytest.raises(InferenceError, match="verifier's max_length"):
        anyio.run(lambda: scheduler.run([1, 2, 3], 4, mode="ar"))


def test_a_verifiers_log_probabilities_must_be_token_logprobs():
    from specdec_rt import InferenceError, ModelVerifier, SpecDecScheduler
    from specdec_rt.testing import ToyLM

    class Junk(ModelVerifier):
        async def verify_and_accept(self, ctx, drafts):
            import dataclasses

            verdict = await super().verify_and_accept(ctx, drafts)
            return dataclasses.replace(verdict, logprobs=("junk",) * len(verdict.tokens))

    scheduler = SpecDecScheduler(None, Junk(ToyLM(8, seed=1)), SpecConfig(measure_costs=False))
    with pytest.raises(InferenceError, match="TokenLogprob"):
        anyio.run(lambda: scheduler.run([1, 2, 3], 4, mode="ar", logprobs=0))
