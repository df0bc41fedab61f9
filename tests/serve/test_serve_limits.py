"""The OpenAI-compatible server in process (httpx.ASGITransport) on a tiny model: errors and
limits (400s, 413, 429 overload, drain, load failures, timeouts, model failures) and the
Prometheus metrics. Schemas and parsing are in test_serve.py."""

from __future__ import annotations

import asyncio
import time

import anyio
import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from serve_util import (  # noqa: E402
    CHAT,
    PROMPT,
    FailingEngine,
    RecordingEngine,
    SlowEngine,
    client,
    metric,
    metric_values,
    run,
    sse_data,
)

from specdec_rt import Engine  # noqa: E402
from specdec_rt.engine.served import ServedEngine  # noqa: E402
from specdec_rt.errors import EngineClosedError  # noqa: E402
from specdec_rt.serve import begin_drain, create_app  # noqa: E402


# ---------------------------------------------------------------- errors and limits
@pytest.mark.export
def test_bad_requests_are_400_naming_the_field(tiny_llama):
    async def check(engine):
        cases = [
            ("/v1/chat/completions", {"messages": CHAT, "temperature": "warm"}, "temperature"),
            ("/v1/chat/completions", {"messages": CHAT, "max_tokens": -3}, "max_tokens"),
            ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages[0]"),
            ("/v1/chat/completions", {"messages": CHAT, "n": 30, "stream": True}, "n"),
            ("/v1/completions", {"prompt": PROMPT, "max_tokens": 100_000}, "prompt"),  # the engine's check
            ("/v1/completions", {"prompt": 5}, "prompt"),
        ]
        async with client(create_app(engine)) as c:
            for path, body, param in cases:
                r = await c.post(path, json=body)
                assert r.status_code == 400, (body, r.text)
                err = r.json()["error"]
                assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
            r = await c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
            r = await c.get("/v1/nothing")
            assert r.status_code == 404 and r.json()["error"]["message"]
            values = metric_values((await c.get("/metrics")).text)
        assert metric(values, "specdec_requests_rejected_total", reason="invalid") == len(cases) + 1
        assert metric(values, "specdec_generation_tokens_total") == 0

    run(check, tiny_llama)


@pytest.mark.export
def test_http_edges_deep_json_405_allow_model_route_and_default_token_cap(tiny_llama):
    async def check(engine):
        async with client(create_app(engine, default_max_tokens=1000)) as c:
            r = await c.post(
                "/v1/completions", content=b"[" * 100_000 + b"]" * 100_000, headers={"content-type": "application/json"}
            )
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
            r = await c.get("/v1/chat/completions")
            assert r.status_code == 405 and "POST" in r.headers["allow"] and r.json()["error"]["message"]
            name = (await c.get("/v1/models")).json()["data"][0]["id"]
            r = await c.get(f"/v1/models/{name}")
            assert r.status_code == 200 and r.json()["id"] == name and r.json()["object"] == "model"
            r = await c.get("/v1/models/nope")
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            # no max_tokens: the default (1000) is capped to the room the prompt leaves (64)
            r = await c.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0})
            body = r.json()
            assert r.status_code == 200, body
            room = 64 - body["usage"]["prompt_tokens"]
            assert body["usage"]["completion_tokens"] <= room
            assert body["choices"][0]["finish_reason"] in ("length", "stop")
            r = await c.post("/v1/completions", json={"prompt": "word " * 80})  # no room even for one token
            assert r.status_code == 400 and "leaves no room for an answer" in r.json()["error"]["message"]
            assert "max_tokens" not in r.json()["error"]["message"]  # the client never sent one
            r = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1000})  # asked: 400
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            assert "max_tokens=1000" in r.json()["error"]["message"]
            r = await c.get("/metrics")  # Prometheus text 0.0.4 unless the scraper asks for more
            assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
            r = await c.get("/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
            assert r.headers["content-type"].startswith("application/openmetrics-text") and r.text.endswith("# EOF\n")

    run(check, tiny_llama, max_length=64)


@pytest.mark.export
def test_body_over_the_limit_is_413(tiny_llama):
    async def check(engine):
        app = create_app(engine, max_body_bytes=200)
        big = {"prompt": "x" * 300, "max_tokens": 2}

        async def chunked():  # no Content-Length: the limit is found while reading
            for _ in range(10):
                yield b" " * 50

        async with client(app) as c:
            r = await c.post("/v1/completions", json=big)
            r2 = await c.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
            ok = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert "content-length" not in r2.request.headers and r2.status_code == 413
        assert ok.status_code == 200

    run(check, tiny_llama)


@pytest.mark.export
def test_overload_gets_429_at_once_and_no_model_call(tiny_llama):
    async def check(engine):
        recorder = RecordingEngine(engine)
        app = create_app(recorder, slots=1, max_queued=1)
        async with client(app) as c:

            async def post():
                t0 = time.perf_counter()
                r = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 48, "temperature": 0})
                return r, time.perf_counter() - t0

            results = await asyncio.gather(*[post() for _ in range(6)])
            values = metric_values((await c.get("/metrics")).text)
        codes = sorted(r.status_code for r, _ in results)
        assert codes == [200, 200, 429, 429, 429, 429]
        for r, seconds in results:
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "overloaded"
                assert seconds < 0.1, seconds
        assert len(recorder.stats) == 2  # the rejected ones never reached the engine
        assert metric(values, "specdec_requests_rejected_total", reason="overloaded") == 4
        assert metric(values, "specdec_request_success_total", finished_reason="length") == 2

    run(check, tiny_llama, slots=1)


@pytest.mark.export
def test_drain_refuses_new_requests_and_finishes_running_ones(tiny_llama):
    async def check(engine):
        slow = SlowEngine(engine, delay=0.01)
        app = create_app(slow, slots=2)
        async with client(app) as c:
            running = asyncio.ensure_future(
                c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 30, "temperature": 0})
            )  # greedy: no early EOS
            while app.state.serving.admitted == 0:
                await asyncio.sleep(0.005)
            assert (await c.get("/health")).status_code == 200
            begin_drain(app)
            health = await c.get("/health")
            refused = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert not running.done()
            done = await running
        assert health.status_code == 503 and health.json()["status"] == "draining"
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 30
        assert slow.closed == 1 and app.state.serving.admitted == 0

    run(check, tiny_llama)


@pytest.mark.export
def test_past_the_drain_timeout_admitted_requests_end_with_a_503_not_a_cut_connection(tiny_llama):
    async def check(engine):
        slow = SlowEngine(engine, delay=0.05)  # 60 tokens: ~3 s each; one slot, so one waits
        app = create_app(slow, slots=1, drain_timeout=0.3)
        async with app.router.lifespan_context(app), client(app) as c:
            body = {"prompt": PROMPT, "max_tokens": 60, "temperature": 0}
            whole = asyncio.ensure_future(c.post("/v1/completions", json=body))
            streamed = asyncio.ensure_future(c.post("/v1/completions", json={**body, "stream": True}))
            await _admitted(app, 2)
            began = time.perf_counter()
            begin_drain(app)
            whole, streamed = await whole, await streamed
            took = time.perf_counter() - began
            values = metric_values((await c.get("/metrics")).text)
        assert took < 2.0, took  # ended at the deadline, not after 60 tokens each
        assert whole.status_code == 503 and whole.json()["error"]["code"] == "draining"
        assert "drain timeout" in whole.json()["error"]["message"]
        events = sse_data(streamed.text)
        assert streamed.status_code == 200 and events[-1]["error"]["code"] == "draining"
        assert "[DONE]" not in events
        assert metric(values, "specdec_requests_aborted_total", reason="shutdown") == 2
        assert slow.closed == 2 and app.state.serving.admitted == 0 and not app.state.serving.jobs

    run(check, tiny_llama)


async def _admitted(app, n: int) -> None:
    deadline = time.perf_counter() + 10
    while app.state.serving.admitted < n:
        assert time.perf_counter() < deadline
        await asyncio.sleep(0.005)


@pytest.mark.export
def test_loader_lifespan_loading_then_ready_then_closed(tiny_llama):
    async def check():
        gate = anyio.Event()
        loaded = []

        async def loader():
            await gate.wait()
            engine = await Engine.load(tiny_llama)
            loaded.append(engine)
            return engine

        app = create_app(loader, slots=2, model_name="tiny")
        async with app.router.lifespan_context(app), client(app) as c:
            health = await c.get("/health")
            refused = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            models = (await c.get("/v1/models")).json()
            gate.set()
            while (await c.get("/health")).status_code != 200:
                await asyncio.sleep(0.01)
            ok = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert health.status_code == 503 and health.json()["status"] == "loading"
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "loading"
        assert refused.headers["retry-after"] == "1"
        assert models["data"][0]["id"] == "tiny" and ok.json()["model"] == "tiny"
        assert ok.status_code == 200
        with pytest.raises(EngineClosedError):  # the app loaded it, so the app closed it
            loaded[0].stream(PROMPT, 2)

    anyio.run(check)


@pytest.mark.export
def test_timeout_is_504_or_a_stream_error_event(tiny_llama):
    async def check(engine):
        app = create_app(SlowEngine(engine, delay=0.05), slots=2, request_timeout=0.3)
        body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0}  # greedy: no early EOS by chance
        async with client(app) as c:
            whole = await c.post("/v1/completions", json=body)
            streamed = await c.post("/v1/completions", json={**body, "stream": True})
            values = metric_values((await c.get("/metrics")).text)
        assert whole.status_code == 504 and whole.json()["error"]["code"] == "request_timeout"
        events = sse_data(streamed.text)
        assert streamed.status_code == 200 and "[DONE]" not in events
        assert events[-1]["error"]["code"] == "request_timeout"
        assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
        assert metric(values, "specdec_requests_aborted_total", reason="timeout") == 2
        assert app.state.serving.admitted == 0 and metric(values, "specdec_requests_running") == 0

    run(check, tiny_llama)


@pytest.mark.export
def test_model_failure_is_500_or_a_stream_error_event_and_the_server_goes_on(tiny_llama):
    async def check(engine):
        app = create_app(FailingEngine(engine, after=2), slots=2)
        body = {"prompt": PROMPT, "max_tokens": 30, "mode": "ar", "temperature": 0}  # greedy: no early EOS
        async with client(app) as c:
            whole = await c.post("/v1/completions", json=body)
            streamed = await c.post("/v1/completions", json={**body, "stream": True})
        assert whole.status_code == 500
        assert whole.json()["error"]["type"] == "server_error" and "injected" in whole.json()["error"]["message"]
        events = sse_data(streamed.text)
        assert events[-1]["error"]["code"] == "inference_error" and "[DONE]" not in events
        async with client(create_app(engine)) as c:  # the engine itself is fine
            assert (await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})).status_code == 200

    run(check, tiny_llama)


# ---------------------------------------------------------------- metrics
@pytest.mark.export
def test_metric_deltas_equal_the_sums_of_stats(tiny_llama):
    async def check(engine):
        recorder = RecordingEngine(engine)
        app = create_app(recorder, slots=4)
        long = "Tell me about prefix caches. " * 12  # several blocks: the second request reuses them
        requests = [
            ("/v1/completions", {"prompt": long, "max_tokens": 20, "temperature": 0}),
            ("/v1/completions", {"prompt": long + " And LRU.", "max_tokens": 6, "temperature": 0}),
            ("/v1/completions", {"prompt": "Hello world", "max_tokens": 13, "stream": True, "seed": 1}),
            ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 17, "temperature": 0.8, "seed": 2}),
            ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 11, "mode": "ar", "stream": True, "seed": 3}),
            ("/v1/completions", {"prompt": "import numpy", "max_tokens": 25, "top_k": 5, "seed": 4}),
        ]
        async with client(app) as c:
            before, queries = metric_values((await c.get("/metrics")).text), engine.prefix_cache["queries"]
            await c.post(*requests[0][:1], json=requests[0][1])  # one alone, then the rest at once
            rs = await asyncio.gather(*[c.post(path, json=body) for path, body in requests[1:]])
            after, queries = metric_values((await c.get("/metrics")).text), engine.prefix_cache["queries"] - queries
        assert all(r.status_code == 200 for r in rs)
        stats = recorder.stats
        assert len(stats) == len(requests)

        def delta(name, **labels):
            return metric(after, name, **labels) - metric(before, name, **labels)

        assert delta("specdec_generation_tokens_total") == sum(s.new_tokens for s in stats) > 0
        assert delta("specdec_prompt_tokens_total") == sum(s.prompt_tokens for s in stats)
        assert delta("specdec_spec_decode_num_drafts_total") == sum(s.rounds for s in stats)
        assert delta("specdec_spec_decode_num_draft_tokens_total") == sum(s.drafted for s in stats)
        assert delta("specdec_spec_decode_num_accepted_tokens_total") == sum(s.accepted for s in stats)
        assert sum(s.drafted for s in stats) > 0  # speculation ran, so the draft counters were exercised
        assert (
            delta("specdec_request_success_total", finished_reason="length")
            + delta("specdec_request_success_total", finished_reason="stop")
        ) == len(requests)
        for hist in ("specdec_time_to_first_token_seconds", "specdec_e2e_request_latency_seconds"):
            assert delta(f"{hist}_count") == len(requests)
        assert delta("specdec_inter_token_latency_seconds_count") > 0
        assert metric(after, "specdec_requests_running") == 0 and metric(after, "specdec_requests_waiting") == 0
        assert delta("specdec_prefix_cache_hit_tokens_total") == sum(s.cached_prompt_tokens for s in stats) > 0
        # seeded sampled requests compute their prompts themselves: only the 2 greedy ones look up
        assert delta("specdec_prefix_cache_queries_total") == sum(s.cache_queries for s in stats) == queries == 2
        assert rs[0].json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the long prompt again
        assert metric(after, "specdec_prefix_cache_bytes") == engine.prefix_cache["bytes"]

    run(check, tiny_llama)


@pytest.mark.export
def test_batch_sizes_come_from_the_engine_listeners(tiny_llama):
    async def check(engine):
        app = create_app(engine, slots=4)
        if not isinstance(getattr(engine, "batch_listeners", None), list):
            pytest.skip("this Engine has no batch_listeners")
        async with client(app) as c:
            rs = await asyncio.gather(
                *[c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8}) for _ in range(3)]
            )
            values = metric_values((await c.get("/metrics")).text)
        assert all(r.status_code == 200 for r in rs)
        assert metric(values, "specdec_batch_size_count") > 0
        assert metric(values, "specdec_batch_size_sum") >= metric(values, "specdec_batch_size_count")

    run(check, tiny_llama, slots=4)


def test_batch_listener_is_registered_and_removed_at_shutdown():
    class FakeEngine(ServedEngine):
        batch_listeners: list = []
        running, waiting = 3, 5

        def stream(self, *a, **k):
            raise AssertionError("not called")

    engine = FakeEngine()
    app = create_app(engine, slots=2, model_name="fake")

    async def check():
        async with app.router.lifespan_context(app), client(app) as c:
            assert len(engine.batch_listeners) == 1
            engine.batch_listeners[0](3)
            engine.batch_listeners[0](1)
            values = metric_values((await c.get("/metrics")).text)
        assert engine.batch_listeners == []
        assert metric(values, "specdec_batch_size_count") == 2 and metric(values, "specdec_batch_size_sum") == 4
        assert metric(values, "specdec_requests_running") == 3 and metric(values, "specdec_requests_waiting") == 5

    anyio.run(check)


def test_a_failed_load_is_reported_and_health_says_failed():
    async def loader():
        raise RuntimeError("no such model")

    app = create_app(loader, slots=1, model_name="broken")
    errors = []
    app.state.serving.on_load_error = errors.append

    async def check():
        async with app.router.lifespan_context(app), client(app) as c:
            while not errors:
                await asyncio.sleep(0.01)
            health = await c.get("/health")
            refused = await c.post("/v1/completions", json={"prompt": PROMPT})
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "failed"
        assert str(errors[0]) == "no such model"

    anyio.run(check)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"request_timeout": -1},
        {"request_timeout": float("nan")},
        {"drain_timeout": -0.5},
        {"drain_timeout": float("inf")},
    ],
)
def test_create_app_refuses_timeouts_that_are_not_seconds(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        create_app(lambda: None, **kwargs)
