"""``python -m specdec_rt loadtest``: the aggregation math, SSE parsing on canned byte streams,
the loopback-only rule, and end to end against a small fake OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from contextlib import contextmanager

import pytest

from specdec_rt.cli import main
from specdec_rt.tooling.loadtest import LoadTestError, SSEParser, check_loopback, interpret, read_prompts
from specdec_rt.tooling.loadtest_report import RequestSample, percentile, speedups, summarize_phase

# ----------------------------------------------------------------------------------- aggregation


def test_percentile_matches_numpy_linear_interpolation():
    np = pytest.importorskip("numpy")
    rng = random.Random(0)
    for n in (1, 2, 3, 10, 101):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 1, 25, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input
    assert percentile([1.0, 2.0], 50) == 1.5
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def _ok(ttft, itl, e2e, tokens, *, chunks, mode="spec"):
    return RequestSample(
        mode, "ok", ttft=ttft, itl=list(itl), e2e=e2e, completion_tokens=tokens, chunks=chunks, usage_reported=True
    )


def test_summarize_phase_on_synthetic_samples():
    samples = [
        _ok(0.1, [0.01, 0.02], 0.3, 3, chunks=3),
        _ok(0.2, [0.03], 0.5, 5, chunks=2),
        RequestSample("spec", "429", e2e=0.001, retry_after=1.0),
        RequestSample("spec", "error", e2e=0.05, error="HTTP 500: boom"),
    ]
    p = summarize_phase(samples, wall_s=2.0, concurrency=2, mode="spec")
    assert (p["concurrency"], p["mode"], p["requests"], p["ok"], p["rejected_429"], p["errors"]) == (
        2,
        "spec",
        4,
        2,
        1,
        1,
    )
    assert p["completion_tokens"] == 8
    assert p["tokens_per_s"] == pytest.approx(4.0)  # ok tokens / wall time; failures add nothing
    assert p["requests_per_s"] == pytest.approx(1.0)
    assert p["ttft_p50_ms"] == pytest.approx(150.0)
    assert p["ttft_p99_ms"] == pytest.approx(199.0)
    assert p["itl_p50_ms"] == pytest.approx(20.0)  # pooled gaps [10, 20, 30] ms
    assert p["itl_p99_ms"] == pytest.approx(29.8)
    assert p["e2e_p50_ms"] == pytest.approx(400.0)
    assert p["tpot_p50_ms"] == pytest.approx(87.5)  # (0.2 / 2 + 0.3 / 4) / 2
    assert p["tokens_per_chunk"] == pytest.approx(1.6)
    assert p["error_examples"] == ["HTTP 500: boom"]


def test_summarize_phase_with_nothing_ok():
    p = summarize_phase([RequestSample("ar", "429")], wall_s=0.5, concurrency=1, mode="ar")
    assert p["tokens_per_s"] == 0.0 and p["ok"] == 0 and p["rejected_429"] == 1
    assert p["ttft_p50_ms"] is None and p["itl_p99_ms"] is None and p["tokens_per_chunk"] is None


def test_speedups_pair_modes_per_level():
    phases = [
        {"concurrency": 1, "mode": "spec", "tokens_per_s": 30.0},
        {"concurrency": 1, "mode": "ar", "tokens_per_s": 20.0},
        {"concurrency": 2, "mode": "spec", "tokens_per_s": 50.0},
    ]
    assert speedups(phases) == {1: 1.5}


# ----------------------------------------------------------------------------------- SSE parsing


def _chunk(content=None, role=None, usage=None):
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    obj = {"id": "c1", "object": "chat.completion.chunk", "choices": [] if usage else [{"index": 0, "delta": delta}]}
    if usage:
        obj["usage"] = usage
    return json.dumps(obj, ensure_ascii=False)


STREAM = (
    b": keep-alive\r\n\r\n"
    + f"data: {_chunk('', role='assistant')}\r\n\r\n".encode()
    + f"data: {_chunk('héllo 🙂')}\n\n".encode()  # multi-byte UTF-8 to split
    + f"data: {_chunk(' world')}\r\r".encode()  # CR-only line ends
    + b"event: message\nid: 7\nretry: 100\n"
    + f"data: {_chunk('!')}\n\n".encode()
    + f"data: {_chunk(usage={'prompt_tokens': 3, 'completion_tokens': 7, 'total_tokens': 10})}\n\n".encode()
    + b"data: [DONE]\n\n"
)


def _parse(pieces):
    p = SSEParser()
    events = [ev for piece in pieces for ev in p.feed(piece)]
    return events + p.close()


def test_sse_parser_is_independent_of_how_the_bytes_are_split():
    whole = _parse([STREAM])
    assert [interpret(ev)[0] for ev in whole] == ["chunk"] * 5 + ["done"]
    contents = [interpret(ev)[1][0] for ev in whole[:4]]
    assert contents == ["", "héllo 🙂", " world", "!"]
    assert interpret(whole[4])[1] == ("", {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10})
    for i in range(len(STREAM) + 1):
        assert _parse([STREAM[:i], STREAM[i:]]) == whole, i
    assert _parse([STREAM[i : i + 1] for i in range(len(STREAM))]) == whole
    rng = random.Random(1)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(STREAM)), 6))
        assert _parse([STREAM[a:b] for a, b in zip([0] + cuts, cuts + [len(STREAM)])]) == whole


def test_sse_multiline_data_comments_and_unterminated_event():
    evs = _parse([b"data: a\ndata:b\n: note\n\nevent: ping\n\ndata: tail-without-blank-line"])
    assert [(e.data, e.event) for e in evs] == [("a\nb", "message")]


def test_sse_error_events():
    assert interpret(_parse([b'event: error\ndata: {"message": "boom"}\n\n'])[0]) == ("error", "boom")
    err = b'data: {"error": {"message": "over capacity", "type": "server_error", "code": null}}\n\n'
    assert interpret(_parse([err])[0]) == ("error", "over capacity")
    assert interpret(_parse([b"data: not json\n\n"])[0])[0] == "error"


# ----------------------------------------------------------------------------------- one request


def _mock_client(handler):
    httpx = pytest.importorskip("httpx")
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def _request(handler, timeout=5.0):
    from specdec_rt.tooling.loadtest import one_request

    async def go():
        async with _mock_client(handler) as client:
            return await one_request(client, "http://127.0.0.1:9", {"mode": "spec"}, timeout)

    return asyncio.run(go())


def _streaming(pieces, delay=0.0, status=200):
    import httpx

    async def body():
        for piece in pieces:
            if delay:
                await asyncio.sleep(delay)
            yield piece

    return lambda request: httpx.Response(status, headers={"content-type": "text/event-stream"}, content=body())


def test_one_request_times_a_stream_split_at_odd_places():
    pieces = [STREAM[a : a + 7] for a in range(0, len(STREAM), 7)]
    s = _request(_streaming(pieces, delay=0.002))
    assert s.status == "ok", s.error
    assert (s.completion_tokens, s.chunks, s.usage_reported) == (7, 3, True)  # 3 non-empty content chunks
    assert len(s.itl) == 2 and all(g >= 0 for g in s.itl)
    assert 0 < s.ttft <= s.e2e


def test_one_request_failures_are_samples_not_exceptions():
    import httpx

    no_done = STREAM[: STREAM.index(b"data: [DONE]")]
    assert "[DONE]" in _request(_streaming([no_done])).error
    mid_error = f"data: {_chunk('a')}\n\n".encode() + b'data: {"error": {"message": "engine failed"}}\n\n'
    s = _request(_streaming([mid_error]))
    assert (s.status, s.error) == ("error", "engine failed")
    s = _request(lambda r: httpx.Response(429, headers={"Retry-After": "2"}, json={"error": {"message": "busy"}}))
    assert (s.status, s.retry_after) == ("429", 2.0)
    s = _request(lambda r: httpx.Response(500, json={"error": {"message": "boom", "type": "server_error"}}))
    assert (s.status, s.error) == ("error", "HTTP 500: boom")
    s = _request(_streaming([STREAM[:40], STREAM[40:]], delay=1.0), timeout=0.3)
    assert s.status == "error" and "timed out" in s.error
    # a server that sends no usage: the content chunks stand in for the token count
    plain = b"".join(f"data: {_chunk(t)}\n\n".encode() for t in ("a", "b")) + b"data: [DONE]\n\n"
    s = _request(_streaming([plain]))
    assert (s.status, s.completion_tokens, s.usage_reported) == ("ok", 2, False)


# ----------------------------------------------------------------------------------- loopback only


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8000",
        "http://127.1.2.3:80/",
        "http://localhost:8000",
        "http://LOCALHOST",
        "http://[::1]:8000",
        "https://127.0.0.1",
        "http://[::ffff:127.0.0.1]:80",
    ],
)
def test_loopback_urls_are_accepted(url):
    assert check_loopback(url) == url.rstrip("/")


@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.0.1:8000",
        "http://192.168.1.10",
        "http://172.16.0.1",
        "http://8.8.8.8",
        "http://example.com",
        "http://localhost.example.com",
        "http://127.0.0.1.nip.io",
        "http://0.0.0.0:8000",
        "http://[::]:80",
        "http://[fe80::1]",
        "http://[::ffff:10.0.0.1]",
        "ftp://127.0.0.1",
        "127.0.0.1:8000",
        "http://127.0.0.1:99999",
    ],
)
def test_other_urls_are_refused(url):
    with pytest.raises(LoadTestError):
        check_loopback(url)


def test_cli_refuses_a_remote_url_with_one_line(capsys, tmp_path):
    assert main(["loadtest", "--url", "http://10.1.2.3:8000", "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specdec_rt: error: --url") and "loopback" in err[0]
    assert not (tmp_path / "o").exists()  # refused before anything was done


def test_cli_checks_its_settings(capsys, tmp_path):
    out = ["--out", str(tmp_path / "o")]
    for bad in (
        ["--concurrency", "0,2"],
        ["--modes", "spec,beam"],
        ["--max-tokens", "0"],
        ["--url", "http://127.0.0.1:1", "--slots", "2"],
    ):
        assert main(["loadtest", *bad, *out]) == 1, bad
        assert capsys.readouterr().err.startswith("specdec_rt: error: --")
    assert not (tmp_path / "o").exists()
    with pytest.raises(SystemExit):
        main(["loadtest", "--requests", "3", "--duration", "2", *out])  # one bound or the other


def test_cli_says_when_nothing_answers(capsys, tmp_path):
    pytest.importorskip("httpx")
    with socket.socket() as s:  # a loopback port with no server on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["loadtest", "--url", f"http://127.0.0.1:{port}", "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("specdec_rt: error: cannot reach the server at http://127.0.0.1:")


def test_read_prompts(tmp_path):
    built_in = read_prompts()
    assert len(built_in) >= 10 and all(m[-1]["role"] == "user" for m in built_in)
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n\n{"messages": [{"role": "user", "content": "yo"}]}\n')
    assert read_prompts(str(f)) == [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]]
    f.write_text('{"text": "no"}\n')
    with pytest.raises(LoadTestError, match=":1:"):
        read_prompts(str(f))


# ----------------------------------------------------------------------------------- end to end


@contextmanager
def _serve(app):
    """Run an ASGI app with uvicorn in a thread on a free loopback port."""
    uvicorn = pytest.importorskip("uvicorn")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the fake server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def _fake_openai_server():
    """Streams min(max_tokens, 5) one-token chunks 3 ms apart; every 4th request gets 429, every
    5th other one an error event after its first chunk. Records what it saw."""
    pytest.importorskip("starlette")
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    seen = {"n": 0, "429": 0, "errors": 0, "tokens": 0, "bodies": [], "auth": []}

    async def chat(request):
        body = await request.json()
        seen["auth"].append(request.headers.get("authorization"))
        seen["n"] += 1
        seen["bodies"].append(body)
        n = seen["n"]
        if n % 4 == 0:
            seen["429"] += 1
            return JSONResponse(
                {"error": {"message": "too many requests", "type": "overloaded"}},
                status_code=429,
                headers={"Retry-After": "0"},
            )
        fail = n % 5 == 0
        k = min(body["max_tokens"], 5)
        if fail:
            seen["errors"] += 1
        else:
            seen["tokens"] += k

        async def events():
            yield f"data: {_chunk('', role='assistant')}\n\n".encode()
            for i in range(k):
                await asyncio.sleep(0.003)
                yield f"data: {_chunk(f'tok{i} ')}\n\n".encode()
                if fail:
                    yield b'data: {"error": {"message": "engine failed", "type": "server_error"}}\n\n'
                    return
            yield f"data: {_chunk(usage={'prompt_tokens': 5, 'completion_tokens': k, 'total_tokens': k + 5})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/models", models)])
    return app, seen


PHASE_KEYS = {
    "concurrency",
    "mode",
    "wall_s",
    "requests",
    "ok",
    "rejected_429",
    "errors",
    "completion_tokens",
    "tokens_per_s",
    "requests_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "e2e_p50_ms",
    "tpot_p50_ms",
    "tokens_per_chunk",
    "usage_missing",
    "error_examples",
}


def test_end_to_end_against_a_fake_server(capsys, tmp_path):
    pytest.importorskip("httpx")
    app, seen = _fake_openai_server()
    out = tmp_path / "lt"
    with _serve(app) as url:
        code = main(
            [
                "loadtest",
                "--url",
                url,
                "--requests",
                "6",
                "--concurrency",
                "1,3",
                "--max-tokens",
                "4",
                "--warmup",
                "0",
                "--json",
                "--out",
                str(out),
            ]
        )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)  # exactly one JSON document on stdout
    assert {"settings", "phases", "speedup_spec_vs_ar", "requests", "chart", "model", "server", "total_s"} <= set(
        report
    )
    assert [(p["concurrency"], p["mode"]) for p in report["phases"]] == [(1, "spec"), (1, "ar"), (3, "spec"), (3, "ar")]
    for p in report["phases"]:
        assert set(p) == PHASE_KEYS
        assert p["requests"] == 6 and p["ok"] + p["rejected_429"] + p["errors"] == 6
        assert p["ok"] and p["tokens_per_s"] > 0 and p["ttft_p50_ms"] > 0 and p["itl_p50_ms"] > 0
    phases = report["phases"]
    assert seen["n"] == 24 == sum(p["requests"] for p in phases)
    assert sum(p["rejected_429"] for p in phases) == seen["429"] == 6
    assert sum(p["errors"] for p in phases) == seen["errors"] == 3
    assert sum(p["completion_tokens"] for p in phases) == seen["tokens"] == 15 * 4
    assert set(report["speedup_spec_vs_ar"]) == {"1", "3"}
    assert len(report["requests"]) == 24 and report["settings"]["served_model"] == "fake-model"
    bodies = seen["bodies"]
    assert [b["mode"] for b in bodies[:6]] == ["spec"] * 6 and [b["mode"] for b in bodies[6:12]] == ["ar"] * 6
    assert all(
        b["stream"] is True
        and b["stream_options"] == {"include_usage": True}
        and b["max_tokens"] == 4
        and b["model"] == "fake-model"
        for b in bodies
    )
    assert bodies[0]["messages"] == bodies[6]["messages"]  # both modes send the same prompt sequence
    assert json.loads((out / "loadtest.json").read_text())["phases"] == phases
    assert "| concurrency | mode | tokens/s" in (out / "loadtest.md").read_text()
    assert report["chart"] is None or (out / "loadtest.png").stat().st_size > 0
    assert "[loadtest] [4/4] concurrency 3 ar:" in captured.err and "ETA" in captured.err


@pytest.mark.parametrize("how", ["flag", "env", "none"])
def test_the_clients_send_the_api_key(how, capsys, tmp_path, monkeypatch):
    pytest.importorskip("httpx")
    monkeypatch.setenv("SPECDEC_API_KEY", " , env-key-1, env-key-2") if how == "env" else monkeypatch.delenv(
        "SPECDEC_API_KEY", raising=False
    )
    app, seen = _fake_openai_server()
    flag = ["--api-key", "flag-key"] if how == "flag" else []
    with _serve(app) as url:
        code = main(
            ["loadtest", "--url", url, "--requests", "2", "--concurrency", "1", "--max-tokens", "2"]
            + ["--warmup", "0", "--modes", "ar", "--json", "--out", str(tmp_path / "lt"), *flag]
        )
    assert code == 0, capsys.readouterr().err
    want = {"flag": "Bearer flag-key", "env": "Bearer env-key-1", "none": None}[how]
    assert seen["auth"] and set(seen["auth"]) == {want}


def test_a_server_without_a_draft_is_load_tested_in_ar_only(tiny_llama, capsys, tmp_path):
    """A server whose (tuned or given) draft is none refuses spec requests: the load test reads
    that from /v1/models and runs ar alone, saying so; --modes spec alone is one clear error."""
    _needs_the_server()
    args = ["loadtest", "--model", str(tiny_llama), "--concurrency", "1", "--requests", "2", "--max-tokens", "4"]
    args += ["--server-arg=--draft none --precision exported", "--warmup", "0", "--json", "--out", str(tmp_path / "a")]
    code = main(args)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "spec mode left out" in captured.err
    phases = json.loads(captured.out)["phases"]
    assert [p["mode"] for p in phases] == ["ar"] and phases[0]["ok"] == 2
    code = main([*args[:-2], "--modes", "spec", "--out", str(tmp_path / "b")])
    assert code != 0 and "refuses spec requests" in capsys.readouterr().err


def test_duration_bound_stops_by_itself(capsys, tmp_path):
    pytest.importorskip("httpx")
    app, seen = _fake_openai_server()
    with _serve(app) as url:
        t0 = time.monotonic()
        code = main(
            [
                "loadtest",
                "--url",
                url,
                "--duration",
                "0.3",
                "--concurrency",
                "2",
                "--modes",
                "ar",
                "--max-tokens",
                "2",
                "--warmup",
                "1",
                "--out",
                str(tmp_path / "lt"),
            ]
        )
        took = time.monotonic() - t0
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert took < 10
    table = captured.out.splitlines()
    assert table[0].split()[:3] == ["conc", "mode", "tok/s"] and table[1].split()[:2] == ["2", "ar"]
    assert seen["n"] > 2  # the closed loop kept sending until the time was up


# ----------------------------------------------------------------------------------- the real server


def _needs_the_server():
    for mod in ("httpx", "starlette", "uvicorn", "prometheus_client"):
        pytest.importorskip(mod)
    pytest.importorskip("specdec_rt.serve.app")


def test_model_starts_the_real_server_and_stops_it(tiny_llama, capsys, tmp_path):
    """--model: `python -m specdec_rt serve` on a free loopback port, /health, both modes, SIGTERM."""
    _needs_the_server()
    out = tmp_path / "lt"
    code = main(
        [
            "loadtest",
            "--model",
            str(tiny_llama),
            "--concurrency",
            "1,2",
            "--requests",
            "3",
            "--max-tokens",
            "8",
            "--server-arg=--precision exported",  # its draft, not a tuned choice: both modes run
            "--json",
            "--out",
            str(out),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert [(p["concurrency"], p["mode"]) for p in report["phases"]] == [(1, "spec"), (1, "ar"), (2, "spec"), (2, "ar")]
    for p in report["phases"]:  # slots = max-queued = the highest concurrency: nothing refused
        assert (p["requests"], p["ok"], p["rejected_429"], p["errors"], p["usage_missing"]) == (3, 3, 0, 0, 0), p
        assert 0 < p["completion_tokens"] <= 3 * 8 and p["ttft_p50_ms"] > 0
    assert report["server"]["exit_status"] == 0  # drained and exited on SIGTERM
    assert report["server"]["cmd"][:5] == ["-m", "specdec_rt", "serve", "--model", str(tiny_llama)]
    assert report["settings"]["url"].startswith("http://127.0.0.1:")
    assert "server ready at http://127.0.0.1:" in captured.err and (out / "server.log").stat().st_size > 0


def test_model_server_that_fails_to_start_is_one_error(tiny_llama, capsys, tmp_path):
    _needs_the_server()
    code = main(["loadtest", "--model", str(tiny_llama), "--server-arg=--no-such-option", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1
    assert "specdec_rt: error: the server exited with status 2 before it was ready" in err
    assert "--no-such-option" in err  # its last output, from server.log
