"""The tuner measures what users run (issue 47): answers long enough to amortise a draft's
prefill, prompts of several categories (code among them, whatever the model is for), rounds
until the leaders are told apart, and a draft model that pays on one category is kept.

The engines here are fakes whose costs the test sets, on a clock of the test's own (the tuner's
``time.perf_counter``; requests at once overlap on it as on a machine with room for them), so
the timings are exact on any machine, however loaded: plain
decoding costs ``T`` a token; a model draft costs a prefill of ``PREFILL`` tokens' time, then
``0.4 T`` a token on code (it agrees with its target there) and ``0.95 T`` elsewhere. So it
loses on 32-token answers everywhere, and wins on code past ~50 tokens: the real Qwen2.5-Coder
1.5B + 0.5B pair's shape, where the old tuner (4 chat prompts x 32 tokens) turned off a draft
that gives 1.59x on code.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from types import SimpleNamespace

import anyio
import pytest

from specdec_rt.engine import tune
from specdec_rt.engine.tune_cache import CategoryRate, TuneResult, TuneRow

T = 0.001  # seconds a token of plain decoding
PREFILL = 30  # a model draft's prefill, in tokens of plain decoding's time


class Clock:
    """Virtual seconds: each request ends at its start plus its cost."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(tune, "time", SimpleNamespace(perf_counter=c.perf_counter, monotonic=time.monotonic))
    return c


def category_of(prompt) -> str:
    text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    return "code" if "Python" in text else "other"


class FakeEngine:
    """An engine of the tuner's interface whose time per request the test sets (see the module)."""

    def __init__(self, precision: str, draft: str, costs, clock: Clock) -> None:
        self.precision, self.draft, self.costs, self.clock = precision, draft, costs, clock
        self.codec = SimpleNamespace(chat_template="{{ messages }}")
        self.asked: list[int] = []  # max_new_tokens of each request

    async def warm_up(self, requests: int, tokens: int) -> None:
        pass

    async def aclose(self) -> None:
        pass

    async def generate(self, prompt, *, max_new_tokens: int, mode: str, **kw):
        self.asked.append(max_new_tokens)
        draft = self.draft if mode == "spec" else "none"
        start = self.clock.now
        await asyncio.sleep(0)  # the other requests of a batch start meanwhile, at the same time
        cost = self.costs(self.precision, draft, category_of(prompt), max_new_tokens)
        self.clock.now = max(self.clock.now, start + cost)
        seed = zlib.crc32(repr(prompt).encode())
        ids = [(seed + i) % 97 for i in range(max_new_tokens)]  # the same for every configuration
        drafted = 0 if draft == "none" else max_new_tokens
        accepted = int(drafted * (0.9 if category_of(prompt) == "code" else 0.3))
        return SimpleNamespace(
            token_ids=ids, stats=SimpleNamespace(new_tokens=max_new_tokens, drafted=drafted, accepted=accepted)
        )


def coder_costs(precision: str, draft: str, category: str, n: int) -> float:
    """Seconds for ``n`` tokens: float32 the faster target; its q4 draft pays on code past ~50 tokens."""
    slow = 1.0 if precision == "float32" else 1.6
    if draft == "none":
        return n * T * slow
    if draft == "ngram":
        return n * T * slow * 1.02
    return (PREFILL + n * (0.4 if category == "code" else 0.95)) * T * slow


def fake_load(costs, made: list[FakeEngine], clock: Clock):
    async def load(folder, *, draft: str, precision: str, **kw) -> FakeEngine:
        made.append(FakeEngine(precision, draft, costs, clock))
        return made[-1]

    return load


def rows_by_config(result: TuneResult) -> dict[tuple[str, str], TuneRow]:
    return {(r.precision, r.draft): r for r in result.rows}


def test_a_draft_that_pays_on_code_past_32_tokens_is_kept(tiny_llama, clock):
    """Fails on the tuner that measured 4 chat prompts x 32 tokens: it chose plain decoding."""
    made: list[FakeEngine] = []
    said: list[str] = []
    result = anyio.run(
        lambda: tune.measure(
            tiny_llama, fake_load(coder_costs, made, clock), threads=1, slots=2, budget_s=0, say=said.append
        )
    )
    assert all(n >= 96 for e in made for n in e.asked), "answers as long as real ones"
    rows = rows_by_config(result)
    draft, plain = rows[("float32", "ngram+q4")], rows[("float32", "none")]
    assert [c.category for c in draft.categories] == ["chat", "code", "extract"]
    code, chat = draft.category("code"), draft.category("chat")
    assert code is not None and chat is not None
    assert code.tok_s_1 > 1.2 * plain.category("code").tok_s_1  # type: ignore[union-attr]
    assert chat.tok_s_1 < plain.category("chat").tok_s_1  # type: ignore[union-attr]
    assert code.acceptance == pytest.approx(0.9, abs=0.02) and chat.acceptance == pytest.approx(0.3, abs=0.02)
    assert result.best is not None and (result.best.precision, result.best.draft) == ("float32", "ngram+q4"), (
        result.rows
    )
    assert "kept for its draft" in tune.why_chosen(result) and "on code" in tune.why_chosen(result)


def test_a_draft_that_pays_nowhere_is_not_kept(tiny_llama, clock):
    def costs(precision: str, draft: str, category: str, n: int) -> float:
        return coder_costs(precision, draft, "chat", n)  # no category where it agrees

    result = anyio.run(lambda: tune.measure(tiny_llama, fake_load(costs, [], clock), threads=1, slots=2, budget_s=0))
    assert result.best is not None and result.best.draft in ("none", "ngram") and result.best.precision == "float32"
    assert tune.why_chosen(result) == ""


def test_rounds_stop_once_the_leaders_are_told_apart(tiny_llama, clock):
    """Every configuration far from plain decoding: one round says it all, budget or not."""

    def costs(precision: str, draft: str, category: str, n: int) -> float:
        return n * T * (1.0 if (precision, draft) == ("float32", "none") else 2.0)

    said: list[str] = []
    result = anyio.run(
        lambda: tune.measure(tiny_llama, fake_load(costs, [], clock), threads=1, slots=2, budget_s=60, say=said.append)
    )
    assert result.rounds == 1 and result.best is not None and result.best.draft == "none", said


def test_rounds_go_on_while_the_leaders_overlap_measuring_only_them(tiny_llama, clock):
    """float32's plain decoding and n-gram lookup cost alike: rounds go on (up to MAX_ROUNDS
    within the budget), and only they (not int4, far behind) are measured again."""

    def costs(precision: str, draft: str, category: str, n: int) -> float:
        return n * T * (1.0 if (precision, draft) in (("float32", "none"), ("float32", "ngram")) else 2.5)

    made: list[FakeEngine] = []
    said: list[str] = []
    result = anyio.run(
        lambda: tune.measure(
            tiny_llama, fake_load(costs, made, clock), threads=1, slots=2, budget_s=60, say=said.append
        )
    )
    assert result.rounds == tune.MAX_ROUNDS, said
    assert any("round 2: 2 configurations" in line for line in said), said
    per_engine = {(e.precision, e.draft): len(e.asked) for e in made}
    first_round = len(tune.TUNE_PROMPTS) // 2 + 2  # one prompt a category alone, then 2 at once (per config)
    assert per_engine[("int4", "ngram")] == 2 * first_round  # its two configurations, once each
    assert per_engine[("float32", "ngram")] == 2 * first_round * tune.MAX_ROUNDS


# ---------------------------------------------------------------------- the rule
def row(draft: str, one: float, many: float, cats: dict[str, float], precision: str = "float32") -> TuneRow:
    rates = tuple(CategoryRate(k, v, 0.5) for k, v in cats.items())
    return TuneRow(precision, draft, one, many, 4, 0.5, True, "", rates)


def test_the_draft_rule():
    plain = row("none", 10.0, 30.0, {"chat": 10.0, "code": 10.0, "extract": 10.0})
    draft = row("ngram+q8", 9.0, 27.0, {"chat": 8.4, "code": 11.5, "extract": 8.0})  # 10% below, +15% on code
    assert tune.pick([draft, plain]) == 0
    assert tune.kept_draft([draft, plain], 1) == (0, "code", pytest.approx(1.15))
    little = row("ngram+q8", 9.0, 27.0, {"chat": 8.4, "code": 10.8, "extract": 8.0})  # +8%: no category won
    assert tune.pick([little, plain]) == 1
    far = row("ngram+q8", 8.0, 24.0, {"chat": 6.0, "code": 14.0, "extract": 6.0})  # 20% below: too far
    assert tune.pick([far, plain]) == 1
    ngram = row("ngram", 10.0, 30.0, {"chat": 10.0, "code": 10.0, "extract": 13.0})  # n-gram alone: no draft model
    assert tune.pick([ngram, plain]) == 0  # (its tie with plain goes to the first row, as before)
    other = row("ngram+q8", 9.0, 27.0, {"chat": 8.4, "code": 11.5, "extract": 8.0}, precision="int8")
    assert tune.pick([plain, other]) == 0  # a draft of another target does not count
    assert tune.pick([row("ngram+q8", 12.0, 30.0, {"code": 12.0}), plain]) == 0  # the best anyway


def test_one_stream_weighs_twice():
    alone = row("none", 20.0, 10.0, {})  # 20^(2/3) 10^(1/3) = 15.9
    batched = row("none", 10.0, 20.0, {})  # 12.6
    assert alone.score == pytest.approx(20 ** (2 / 3) * 10 ** (1 / 3)) and alone.score > batched.score
    assert tune.pick([batched, alone]) == 1


# ---------------------------------------------------------------------- what is shown
def test_v1_models_shows_the_chosen_configuration_per_category(tiny_llama, tmp_path, monkeypatch):
    """``precision="auto"``: Engine.choice (and so /v1/models) carries what the tune measured of
    the configuration it runs, per category; read back from the tune file alike."""
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from serve_util import client

    from specdec_rt import Engine
    from specdec_rt.serve import create_app

    monkeypatch.setenv("SPECDEC_RT_TUNE_DIR", str(tmp_path / "tune"))
    table = [
        row("ngram+q4", 9.0, 27.0, {"chat": 8.4, "code": 11.5, "extract": 8.0}),
        row("none", 10.0, 30.0, {"chat": 10.0, "code": 10.0, "extract": 10.0}),
    ]

    async def measure(folder, load, **kw) -> TuneResult:
        return TuneResult(table, tune.pick(table), rounds=1, tokens=96)

    monkeypatch.setattr(tune, "measure", measure)

    async def listed():
        async with await Engine.load(tiny_llama, precision="auto", threads=1, slots=2, warmup=False) as engine:
            async with client(create_app(engine, model_name="m")) as c:
                return engine.choice, (await c.get("/v1/models")).json()["data"][0]

    for how in ("tuned", "cached"):
        choice, entry = anyio.run(listed)
        assert (choice.draft, choice.chosen_by) == ("ngram+q4", how)
        assert entry["measured"]["categories"]["code"] == {"tok_s_1": 11.5, "acceptance": 0.5}
        assert list(entry["measured"]["categories"]) == ["chat", "code", "extract"]
        assert entry["measured"]["tok_s_1"] == 9.0 and entry["measured"]["concurrency"] == 4
    asked = anyio.run(lambda: Engine.load(tiny_llama, precision="auto", draft="none", threads=1, slots=2, warmup=False))
    assert asked.choice.measured is None and "measured" not in asked.choice.as_dict()  # not what was measured
    anyio.run(asked.aclose)
