"""Big requests never stall the server (issue 43, parts 2 and 3): a 1 MiB body is parsed off the
event loop and its prompts counted before any is looked at; ``echo`` with ``logprobs`` scores
each prompt once however many choices share it, within a work budget, and its big reply is built
off the loop."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from loop_lag import bound, compare  # noqa: E402
from serve_util import client, run  # noqa: E402

from specdec_rt.serve import create_app  # noqa: E402

pytestmark = pytest.mark.export

JSON = {"content-type": "application/json"}


@pytest.mark.parametrize("item", [b'"a"', b"[1]"], ids=["strings", "token-lists"])
def test_a_1_mib_body_of_tiny_prompts_is_refused_without_stalling_the_loop(tiny_llama, item):
    body = b'{"max_tokens":1,"prompt":[' + b",".join([item] * 255_000) + b"]}"
    assert len(body) <= 1 << 20  # under the default body limit: it is parsed

    async def check(engine):
        app = create_app(engine)
        serving = app.state.serving
        async with client(app) as c:

            async def attack():
                return await c.post("/v1/completions", content=body, headers=JSON)

            async def control():
                return await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1})

            await control()  # the first request starts the engine's own watchdog and warms up
            a, ctl = await compare(attack, control)
        err = a.out.json()["error"]
        assert a.out.status_code == 400 and err["param"] == "prompt", a.out.text
        limit = serving.slots + serving.max_queued
        assert "255000 prompts" in err["message"] and f"at most {limit}" in err["message"]
        assert a.worst <= bound(ctl), f"attack {a.ms()}, control {ctl.ms()}"
        assert a.busy < 0.05, a.ms()  # the loop's own CPU: it only waited for the parse

    run(check, tiny_llama)


def test_prompts_and_their_token_ids_are_counted_before_they_are_read():
    from specdec_rt.serve.protocol import APIError, parse_request

    for prompt, want in (
        ([object()] * 25, "prompt holds 25 prompts, more than one request may hold (at most 24)"),  # not looked at
        ([1] * 101, "prompt holds 101 token ids, more than one request may hold (at most 100)"),
        ([[1] * 60, "x", [2] * 41], "prompt holds 101 token ids in all, more than one request may hold (at most 100)"),
    ):
        with pytest.raises(APIError) as err:
            parse_request("completion", {"prompt": prompt}, max_prompts=24, max_prompt_tokens=100)
        assert str(err.value) == want and err.value.param == "prompt" and err.value.status == 400
    ok = parse_request("completion", {"prompt": [[1] * 50, "x", [2] * 50]}, max_prompts=3, max_prompt_tokens=100)
    assert len(ok.prompts) == 3
