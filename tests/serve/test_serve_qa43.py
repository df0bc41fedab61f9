"""Held-out attacks on issue 43 (QA): inputs the issue's own tests did not try."""

from __future__ import annotations

import time

import anyio
import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")
pytest.importorskip("llguidance")

from serve_util import client, run  # noqa: E402

from specdec_rt.serve import create_app  # noqa: E402

pytestmark = pytest.mark.export


def test_concurrent_first_grammar_requests_build_the_grammar_tokenizer_once(tiny_llama, monkeypatch):
    """The grammar engine's tokenizer (every token's bytes, ~0.1 s of Python for a 49k
    vocabulary) is built once, however many requests need it first at once (was: once per
    grammar thread that got there before the first finished, all of them holding the GIL in
    turn, so the event loop waited ~0.3 s behind 16 of them)."""
    import specdec_rt.sampling.constraints as constraints

    built: list[int] = []
    table = constraints._TokenTable

    class Counted(table):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs) -> None:
            built.append(1)
            time.sleep(0.2)  # (a big vocabulary's table takes a while: the others arrive meanwhile)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(constraints, "_TokenTable", Counted)
    body = {"prompt": "hello", "max_tokens": 2, "response_format": {"type": "json_object"}}

    async def check(engine):
        async with client(create_app(engine)) as c:
            statuses: list[int] = []

            async def one() -> None:
                statuses.append((await c.post("/v1/completions", json=body)).status_code)

            async with anyio.create_task_group() as tg:
                for _ in range(8):
                    tg.start_soon(one)
        assert statuses == [200] * 8
        assert len(built) == 1, f"the grammar tokenizer was built {len(built)} times"

    run(check, tiny_llama)
