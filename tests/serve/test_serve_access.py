"""Who may use the server (issue 35, items 2 and 3): API keys, the Host it answers to, the web
origins whose pages may call it, and JSON-only bodies. In process (httpx's ASGI transport) for
the details, then ``python -m specdec_rt serve`` listening on 127.0.0.1 for what a client, a
browser and an attacker's page would do."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from serve_util import PROMPT, ServeProcess, metric, metric_values, start_serve  # noqa: E402

from specdec_rt.engine.served import ServedEngine  # noqa: E402
from specdec_rt.errors import InvalidInputError  # noqa: E402
from specdec_rt.serve import create_app  # noqa: E402
from specdec_rt.serve.guard import Access, host_names, keys_from_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KEY1, KEY2 = "sk-first-0123456789abcdef", "sk-second-fedcba9876543210"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


class NoEngine(ServedEngine):
    """An engine that must never be asked to generate (every request here stops before)."""

    def stream(self, *args, **kwargs):
        raise AssertionError("a refused request reached the engine")


def _app(**access):
    return create_app(NoEngine(), slots=1, model_name="m", **access)


def _client(app, base_url: str = "http://127.0.0.1:8000"):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url=base_url)


def _bearer(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


# ---------------------------------------------------------------- the rules, checked
@pytest.mark.parametrize(
    "kwargs,named",
    [
        ({"api_keys": ["good", ""]}, "API key #2 must be a non-empty string"),
        ({"api_keys": ["sk secret"]}, "API key #1 has a character"),
        ({"api_keys": ["sk-\u00e9t\u00e9"]}, "API key #1 has a character"),
        ({"api_keys": "sk-one-string"}, "a list of keys"),
        (
            {"allowed_hosts": ["api.example:8000"]},
            "'api.example:8000' is not a host name, an IP address, '*.domain' or '*' (give it without a port)",
        ),
        ({"allowed_hosts": ["http://api.example"]}, "'http://api.example' is not a host name"),
        ({"allowed_hosts": ["a*.example"]}, "'a*.example' is not a host name"),
        ({"allowed_origins": ["http://a.example/"]}, "'http://a.example/' is not an origin"),
        ({"allowed_origins": ["a.example"]}, "'a.example' is not an origin"),
        ({"allowed_origins": ["http://a.example/app?x=1"]}, "is not an origin"),
    ],
)
def test_bad_access_rules_are_refused_naming_the_value_but_never_a_key(kwargs, named):
    with pytest.raises(InvalidInputError) as info:
        _app(**kwargs)
    assert named in str(info.value)
    assert "secret" not in str(info.value) and "t\u00e9" not in str(info.value)


def test_rules_are_normalised():
    access = Access.checked(
        ["k", "k", "j"], ["API.Example.", "::1", "[::1]", "10.0.0.5", "*.svc.local"], ["HTTP://A.example:3000"]
    )
    assert access.api_keys == ("k", "j")
    assert access.allowed_hosts == ("api.example", "[::1]", "10.0.0.5", "*.svc.local")
    assert access.allowed_origins == ("http://a.example:3000",)
    assert KEY1 not in repr(Access.checked([KEY1]))  # an Access in a log line shows no key


@pytest.mark.parametrize(
    "bind,extra,names",
    [
        ("127.0.0.1", [], ("127.0.0.1", "localhost", "[::1]")),
        ("localhost", ["api.example"], ("127.0.0.1", "localhost", "[::1]", "api.example")),
        ("::1", [], ("127.0.0.1", "localhost", "[::1]")),
        ("127.0.0.2", [], ("127.0.0.1", "localhost", "[::1]", "127.0.0.2")),
        ("0.0.0.0", ["api.example"], ("127.0.0.1", "localhost", "[::1]", "api.example")),
        ("10.0.0.5", [], ("10.0.0.5",)),
        ("10.0.0.5", ["*"], None),
    ],
)
def test_host_names_a_server_answers_to(bind, extra, names):
    assert host_names(bind, extra) == names


def test_keys_from_the_environment():
    assert keys_from_env({"SPECDEC_API_KEY": f" {KEY1}, ,{KEY2},"}) == [KEY1, KEY2]
    assert keys_from_env({"SPECDEC_API_KEY": ""}) == [] and keys_from_env({}) == []


# ---------------------------------------------------------------- in process
def test_api_keys_on_every_route_but_health():
    app = _app(api_keys=[KEY1, KEY2])

    async def check():
        async with _client(app) as c:
            health = await c.get("/health")
            missing = [await c.get(p) for p in ("/v1/models", "/v1/models/m", "/metrics", "/nowhere")]
            missing.append(await c.post("/v1/chat/completions", json=CHAT))
            wrong = await c.get("/v1/models", headers=_bearer(KEY1 + "x"))
            basic = await c.get("/v1/models", headers={"authorization": f"Basic {KEY1}"})
            empty = await c.get("/v1/models", headers={"authorization": "Bearer "})
            ok1 = await c.get("/v1/models", headers=_bearer(KEY1))
            ok2 = await c.get("/v1/models", headers={"authorization": f"bearer   {KEY2}"})
            bad_body = await c.post("/v1/chat/completions", json={}, headers=_bearer(KEY2))  # past the key: 400
            values = metric_values((await c.get("/metrics", headers=_bearer(KEY1))).text)
        assert health.status_code == 200
        for r in [*missing, wrong, basic, empty]:
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"
            assert KEY1 not in r.text and KEY2 not in r.text
        assert "no API key" in missing[0].json()["error"]["message"]
        assert wrong.json()["error"]["message"] == "incorrect API key provided"
        assert ok1.status_code == ok2.status_code == 200 and ok1.json()["data"][0]["id"] == "m"
        assert bad_body.status_code == 400 and bad_body.json()["error"]["param"] == "messages"
        assert metric(values, "specdec_requests_rejected_total", reason="auth") == 8

    anyio.run(check)


def test_no_keys_no_check():
    async def check():
        async with _client(_app()) as c:
            assert (await c.get("/v1/models")).status_code == 200

    anyio.run(check)


@pytest.mark.parametrize(
    "content_type,status",
    [
        (None, 415),
        ("text/plain", 415),
        ("text/plain;charset=UTF-8", 415),
        ("application/x-www-form-urlencoded", 415),
        ("multipart/form-data; boundary=x", 415),
        ("application/jsonp", 415),
        ("application/json", 400),
        ("Application/JSON; charset=utf-8", 400),
    ],
)
def test_json_routes_take_application_json_only(content_type, status):
    """A page can POST the three CORS-safelisted types without a preflight; JSON it cannot. The
    body ``{}`` lacks ``messages``: a 400 shows it got past the media type."""
    app = _app()

    async def check():
        headers = {} if content_type is None else {"content-type": content_type}
        async with _client(app) as c:
            rs = [await c.post(p, content=b"{}", headers=headers) for p in ("/v1/chat/completions", "/v1/completions")]
            values = metric_values((await c.get("/metrics")).text)
        for r in rs:
            assert r.status_code == status, r.text
            if status == 415:
                assert r.json()["error"]["code"] == "unsupported_media_type"
                assert (repr(content_type) if content_type else "no Content-Type") in r.json()["error"]["message"]
        assert metric(values, "specdec_requests_rejected_total", reason="media_type") == (2 if status == 415 else 0)

    anyio.run(check)


@pytest.mark.parametrize(
    "host,ok",
    [
        ("127.0.0.1", True),
        ("127.0.0.1:8000", True),
        ("localhost:1", True),
        ("LOCALHOST", True),
        ("[::1]:8000", True),
        ("[::1]", True),
        ("api.example", True),
        ("x.svc.local:80", True),
        ("attacker.example:8011", False),
        ("127.0.0.1.attacker.example", False),
        ("svc.local", False),
        ("localhost.", False),
        ("::1", False),
        ("", False),
        ("127.0.0.1:8000@evil", False),
    ],
)
def test_a_foreign_host_is_421(host, ok):
    app = _app(allowed_hosts=host_names("127.0.0.1", ["api.example", "*.svc.local"]))

    async def check():
        async with _client(app) as c:
            r = await c.get("/health", headers={"host": host})
            values = metric_values((await c.get("/metrics")).text)
        assert r.status_code == (200 if ok else 421), r.text
        if not ok:
            assert r.json()["error"]["code"] == "misdirected_request" and "localhost" in r.json()["error"]["message"]
        assert metric(values, "specdec_requests_rejected_total", reason="host") == (0 if ok else 1)

    anyio.run(check)


def test_a_foreign_origin_is_403_before_the_key_and_the_body():
    """What issue 35 found answered 200: text/plain, Origin evil, Host attacker; each part alone
    is refused too, and a request from the server's own origin is not cross-site."""
    app = _app(api_keys=[KEY1], allowed_hosts=host_names("127.0.0.1"))

    async def check():
        async with _client(app) as c:
            attack = await c.post(
                "/v1/completions",
                content=b'{"prompt": "x"}',
                headers={
                    "content-type": "text/plain",
                    "origin": "http://evil.example",
                    "host": "attacker.example:8011",
                },
            )
            evil = await c.post(
                "/v1/completions", json={"prompt": "x"}, headers={**_bearer(KEY1), "origin": "http://evil.example"}
            )
            null = await c.get("/v1/models", headers={**_bearer(KEY1), "origin": "null"})
            preflight = await c.options(
                "/v1/completions", headers={"origin": "http://evil.example", "access-control-request-method": "POST"}
            )
            own = await c.get("/v1/models", headers={**_bearer(KEY1), "origin": "http://127.0.0.1:8000"})
            other_port = await c.get("/v1/models", headers={**_bearer(KEY1), "origin": "http://127.0.0.1:3000"})
            values = metric_values((await c.get("/metrics", headers=_bearer(KEY1))).text)
        assert attack.status_code == 421
        for r in (evil, null, preflight, other_port):
            assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", r.text
            assert "access-control-allow-origin" not in r.headers
        assert own.status_code == 200
        assert metric(values, "specdec_requests_rejected_total", reason="origin") == 4

    anyio.run(check)


def test_allowed_origins_get_cors_answers_and_others_do_not():
    app = _app(api_keys=[KEY1], allowed_origins=["http://a.example"])

    async def check():
        async with _client(app) as c:
            pre = await c.options(
                "/v1/chat/completions",
                headers={
                    "origin": "http://a.example",
                    "access-control-request-method": "POST",
                    "access-control-request-headers": "authorization, content-type, x-stainless-lang",
                },
            )
            r = await c.get("/v1/models", headers={**_bearer(KEY1), "origin": "http://a.example"})
            denied = await c.get("/v1/models", headers={"origin": "http://a.example"})
            other = await c.options(
                "/v1/chat/completions", headers={"origin": "http://b.example", "access-control-request-method": "POST"}
            )
        assert pre.status_code == 200  # answered without a key: a browser sends none on a preflight
        assert pre.headers["access-control-allow-origin"] == "http://a.example"
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert "authorization" in pre.headers["access-control-allow-headers"]
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://a.example"
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "http://a.example"
        assert other.status_code == 403 and "access-control-allow-origin" not in other.headers

    anyio.run(check)


# ---------------------------------------------------------------- a real listening server
def _serve(folder, *args: str, env_keys: str | None = None):
    """``serve`` on 127.0.0.1 with its access log; returns (process, base url, output lines, readers)."""
    run = start_serve(folder, "--access-log", *args, env={"SPECDEC_API_KEY": env_keys})
    return run.proc, run.url, run.lines, run.readers


def _stop(proc, readers) -> None:
    ServeProcess(proc, "", [], readers).stop()


@pytest.mark.export
def test_a_real_server_with_keys_hosts_and_origins(tiny_llama):
    """One key on the command line and one in the environment; a browser at http://a.example
    preflights and then calls; an attacker's page and a rebinding name are refused; the keys
    never reach the log (access log on)."""
    proc, url, lines, readers = _serve(
        tiny_llama, "--api-key", KEY1, "--allowed-origins", "http://a.example", env_keys=KEY2
    )
    port = url.rsplit(":", 1)[1]

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            while (await c.get("/health")).status_code != 200:  # /health needs no key
                await asyncio.sleep(0.05)
            rs = {
                "no key": await c.post("/v1/chat/completions", json=CHAT),
                "wrong key": await c.post("/v1/chat/completions", json=CHAT, headers=_bearer(KEY2[:-1])),
                "key 1": await c.post("/v1/chat/completions", json=CHAT, headers=_bearer(KEY1)),
                "key 2": await c.post(
                    "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers=_bearer(KEY2)
                ),
                "text/plain": await c.post(
                    "/v1/completions",
                    content=b'{"prompt": "x", "max_tokens": 2}',
                    headers={**_bearer(KEY1), "content-type": "text/plain"},
                ),
                "rebinding": await c.post(
                    "/v1/completions",
                    json={"prompt": "x", "max_tokens": 2},
                    headers={**_bearer(KEY1), "host": f"attacker.example:{port}"},
                ),
                "evil page": await c.post(
                    "/v1/completions",
                    json={"prompt": "x", "max_tokens": 2},
                    headers={**_bearer(KEY1), "origin": "http://evil.example"},
                ),
                "localhost": await c.get("/v1/models", headers={**_bearer(KEY1), "host": f"localhost:{port}"}),
            }
            pre = await c.options(
                "/v1/chat/completions",
                headers={
                    "origin": "http://a.example",
                    "access-control-request-method": "POST",
                    "access-control-request-headers": "authorization,content-type",
                },
            )
            cors = await c.post(
                "/v1/chat/completions", json=CHAT, headers={**_bearer(KEY2), "origin": "http://a.example"}
            )
            values = metric_values((await c.get("/metrics", headers=_bearer(KEY1))).text)
            return rs, pre, cors, values

    try:
        rs, pre, cors, values = anyio.run(scenario)
    finally:
        _stop(proc, readers)
    status = {k: r.status_code for k, r in rs.items()}
    assert status == {
        "no key": 401,
        "wrong key": 401,
        "key 1": 200,
        "key 2": 200,
        "text/plain": 415,
        "rebinding": 421,
        "evil page": 403,
        "localhost": 200,
    }, status
    assert rs["no key"].headers["www-authenticate"] == "Bearer"
    assert rs["key 1"].json()["choices"][0]["message"]["role"] == "assistant"
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://a.example"
    assert {"authorization", "content-type"} <= {
        h.strip() for h in pre.headers["access-control-allow-headers"].split(",")
    }
    assert cors.status_code == 200 and cors.headers["access-control-allow-origin"] == "http://a.example"
    assert cors.json()["choices"][0]["message"]["content"] is not None
    for reason, n in (("auth", 2), ("media_type", 1), ("host", 1), ("origin", 1)):
        assert metric(values, "specdec_requests_rejected_total", reason=reason) == n, reason
    log = "".join(lines)
    assert "2 API key(s) required" in log and "http://a.example" in log
    assert '"POST /v1/chat/completions HTTP/1.1" 401' in log  # the access log was on: requests are in it
    assert KEY1 not in log and KEY2 not in log and KEY2[:-1] not in log


@pytest.mark.export
@pytest.mark.parametrize(
    "args,env,named",
    [
        (["--host", "0.0.0.0"], None, "--allowed-hosts"),
        (["--allowed-hosts", "api.example:80"], None, "--allowed-hosts: allowed host 'api.example:80'"),
        (["--allowed-origins", "http://a.example/"], None, "--allowed-origins: allowed origin 'http://a.example/'"),
        (["--api-key", "sk ok"], None, "--api-key / $SPECDEC_API_KEY: API key #1 has a character"),
        ([], f"{KEY1},bad key", "--api-key / $SPECDEC_API_KEY: API key #2 has a character"),
    ],
)
def test_cli_refuses_bad_access_flags_in_one_line_before_loading(tiny_llama, args, env, named):
    environ = {**os.environ, "PYTHONPATH": str(ROOT)}
    environ.pop("SPECDEC_API_KEY", None)
    if env is not None:
        environ["SPECDEC_API_KEY"] = env
    proc = subprocess.run(
        [sys.executable, "-m", "specdec_rt", "serve", "--model", str(tiny_llama), *args],
        capture_output=True,
        text=True,
        env=environ,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 2 and named in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "listening" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert KEY1 not in proc.stderr and "sk ok" not in proc.stderr and "bad key" not in proc.stderr


def test_ray_replicas_get_the_rules_and_read_their_own_environment(monkeypatch, tmp_path):
    """RayOptions carry the rules to each replica's app (no cluster needed to build one); a replica
    given no keys takes those in its own $SPECDEC_API_KEY (a Kubernetes Secret); bad rules fail
    when the options are made, not on a replica; the options' repr shows no key."""
    from specdec_rt.serve.ray import RayOptions, _parse, _replica_app

    monkeypatch.setenv("SPECDEC_API_KEY", KEY2)
    opts = RayOptions(
        model=str(tmp_path),
        threads=1,
        api_keys=_parse("api_keys", f"{KEY1}, "),
        allowed_hosts=_parse("allowed_hosts", "127.0.0.1,api.example"),
    )
    from_env = RayOptions(model=str(tmp_path), threads=1)
    assert KEY1 not in repr(opts) and opts.allowed_hosts == ("127.0.0.1", "api.example")
    with pytest.raises(InvalidInputError, match="allowed origin 'http://a.example/'"):
        RayOptions(model="m", allowed_origins=("http://a.example/",))

    async def check():  # the engine is never loaded: the checks come before any route
        async with _client(_replica_app(opts)) as c:
            rs = [await c.get("/v1/models", headers=h) for h in ({}, _bearer(KEY2), _bearer(KEY1))]
            foreign = await c.get("/v1/models", headers={**_bearer(KEY1), "host": "evil.example"})
        async with _client(_replica_app(from_env)) as c:
            env_rs = [await c.get("/v1/models", headers=h) for h in ({}, _bearer(KEY2))]
        assert [r.status_code for r in rs] == [401, 401, 200] and foreign.status_code == 421
        assert [r.status_code for r in env_rs] == [401, 200]
        assert all(r.headers["x-specdec-replica"] for r in [*rs, *env_rs])

    anyio.run(check)
