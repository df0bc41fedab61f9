"""A grammar's masks never stall the event loop (issue 43, docs/security.md "Loop stalls"): a
``response_format`` whose every mask costs a tenth of a second (``"pattern": "^(a{500}){500}$"``)
asked by 8 requests at once. Was: each mask computed on the loop, ``/health`` 390-450 ms late
for the whole run. Now the masks are computed in worker threads (llguidance drops the GIL
there) and a mask over the per-token CPU budget ends its request with a 400 naming the limit."""

from __future__ import annotations

import time

import anyio
import pytest
from loop_lag import bound, compare

from specdec_rt import InvalidInputError

pytest.importorskip("llguidance")


def _rf(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


COSTLY = _rf({"type": "string", "pattern": "^(a{500}){500}$"})
ORDINARY = _rf({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}})
N = 8  # as n=8 does: 8 requests, each with its own grammar


@pytest.mark.export
@pytest.mark.parametrize("mode", ["ar", "spec"])
def test_costly_grammar_masks_never_stall_the_event_loop(tiny_llama, mode):
    from serve_util import run

    async def many(rf: dict) -> list:
        out: list = [None] * N

        async def one(i: int) -> None:
            try:
                out[i] = await engine.generate("Answer:", 12, mode=mode, response_format=rf)
            except InvalidInputError as exc:
                out[i] = exc

        async with anyio.create_task_group() as tg:
            for i in range(N):
                tg.start_soon(one, i)
        return out

    async def check(e):
        nonlocal engine
        engine = e
        await engine.generate("Answer:", 4, mode=mode, response_format=ORDINARY)  # the tokenizer table, once
        attack, control = await compare(lambda: many(COSTLY), lambda: many(ORDINARY))
        assert not isinstance(control.out, Exception) and all(not isinstance(r, Exception) for r in control.out)
        assert not isinstance(attack.out, Exception), attack.out
        for r in attack.out:  # refused at its first costly mask, the limit named; or followed to the end
            assert not isinstance(r, Exception) or "ms of CPU, over the limit of" in str(r), r
        assert attack.worst <= bound(control), (attack.ms(), control.ms())
        assert attack.busy < 0.05, (attack.ms(), control.ms())  # the loop's own CPU between two wakes
        assert engine.running == 0 and not engine.target._owners
        after = await engine.generate("Answer:", 12, mode=mode, response_format=ORDINARY)  # the next one is fine
        assert after.text.lstrip().startswith("{")

    engine = None
    run(check, tiny_llama)


def _bytes_factory():
    """Grammars over a vocabulary of the 256 bytes (and an end id, 256)."""
    from specdec_rt.sampling.constraints import GrammarFactory

    return GrammarFactory(
        lambda i: bytes([i]) if i < 256 else b"", lambda i: i == 256, lambda t: list(t.encode()), 257, [256]
    )


def test_a_grammar_over_the_budgets_is_a_400_naming_the_limit():
    """The costly pattern's compilation costs about 1 s of CPU on this vocabulary (0.4 s on
    SmolLM2's): refused, and refused again at no cost. A mask over its budget (held to a
    nanosecond here) ends the request."""
    from specdec_rt.sampling.constraints import COMPILE_BUDGET_S, MASK_BUDGET_S

    factory = _bytes_factory()
    for _ in range(2):  # the second time (n choices, a client that asks again) at no cost
        cpu = time.thread_time()
        with pytest.raises(
            InvalidInputError,
            match=rf"response_format: .* ms of CPU, over the limit of {COMPILE_BUDGET_S * 1000:.0f} ms$",
        ):
            factory.build(COSTLY["json_schema"]["schema"])
    assert time.thread_time() - cpu < 0.01
    g = _bytes_factory().build({"type": "string", "pattern": "^(a{20}){20}$"})
    assert g.off_loop and g.budget == MASK_BUDGET_S
    g.budget = 1e-9
    with pytest.raises(InvalidInputError, match=r"response_format: .* ms of CPU, over the limit of 0 ms a token"):
        g.allowed([ord('"'), ord("a")])
