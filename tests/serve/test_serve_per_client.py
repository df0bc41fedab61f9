"""One client cannot take every connection (issue 43, part 8): past ``max_connections_per_client``
connections from one address, its next one gets a 429 and is closed, while another address is
still served; the total cap (``max_connections``, a 503) is unchanged.

Before: only the total cap: one address opening 256 connections locked every other client out."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket

import anyio
import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("h11")

from serve_util import EchoEngine, running_server  # noqa: E402

from specdec_rt.serve import create_app  # noqa: E402
from specdec_rt.serve.connections import ConnectionLimits, client_key  # noqa: E402

HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"


@contextlib.asynccontextmanager
async def _server(limits: ConnectionLimits):
    """Real uvicorn in this event loop on 127.0.0.1 with ``limits``; yields its port."""
    async with running_server(create_app(EchoEngine(), model_name="tiny"), limits=limits) as url:
        yield int(url.rsplit(":", 1)[1])


async def _open(port: int, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes = b"") -> bytes:
    """What the server sends on this connection (after ``request``) until it closes it."""
    if request:
        writer.write(request)
        await writer.drain()
    try:
        with anyio.fail_after(10):
            return await reader.read()
    finally:
        writer.close()


def _can_bind(address: str) -> bool:
    try:
        with socket.socket() as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


needs_second_loopback = pytest.mark.skipif(not _can_bind("127.0.0.2"), reason="no 127.0.0.2 on this machine")


@needs_second_loopback
@pytest.mark.parametrize(
    "limits", [ConnectionLimits(), ConnectionLimits(max_connections=10, max_connections_per_client=4)]
)
def test_one_address_past_its_share_is_refused_and_another_is_served(limits):
    """The defaults (32 of 256) and the flags' values: the share's worth of idle connections
    from 127.0.0.1 are kept, the next from it gets a 429 and is closed, 127.0.0.2 is served."""
    share = limits.max_connections_per_client

    async def main():
        async with _server(limits) as port:
            held = [await _open(port, "127.0.0.1") for _ in range(share)]
            try:
                await asyncio.sleep(0.1)  # every one accepted
                refused = await _answer(*await _open(port, "127.0.0.1"))
                assert refused.startswith(b"HTTP/1.1 429 "), refused[:300]
                error = json.loads(refused.split(b"\r\n\r\n", 1)[1])["error"]
                assert error["code"] == "too_many_connections" and "--max-connections-per-client" in error["message"]
                assert b"connection: close" in refused.lower()
                other = await _answer(*await _open(port, "127.0.0.2"), HEALTH)
                assert other.startswith(b"HTTP/1.1 200 "), other[:300]
                # the held ones still work
                kept = await _answer(*held.pop(), HEALTH)
                assert kept.startswith(b"HTTP/1.1 200 "), kept[:300]
                # one closed: room for one more from 127.0.0.1
                await asyncio.sleep(0.1)
                again = await _answer(*await _open(port, "127.0.0.1"), HEALTH)
                assert again.startswith(b"HTTP/1.1 200 "), again[:300]
            finally:
                for _, writer in held:
                    writer.close()

    anyio.run(main)


@needs_second_loopback
def test_zero_is_no_per_client_limit_and_the_total_cap_still_holds():
    """``max_connections_per_client=0`` (behind a proxy): one address may take all 6; the 7th,
    from anywhere, gets the total cap's 503."""
    limits = ConnectionLimits(max_connections=6, max_connections_per_client=0)

    async def main():
        async with _server(limits) as port:
            held = [await _open(port, "127.0.0.1") for _ in range(6)]
            try:
                await asyncio.sleep(0.1)
                other = await _answer(*await _open(port, "127.0.0.2"), HEALTH)
                assert other.startswith(b"HTTP/1.1 503 "), other[:300]
            finally:
                for _, writer in held:
                    writer.close()

    anyio.run(main)


def test_a_client_is_its_address_or_its_ipv6_64():
    assert client_key("127.0.0.1") == "127.0.0.1"
    assert client_key("::ffff:10.0.0.5") == "10.0.0.5"
    assert client_key("2001:db8:1:2:aaaa::1") == client_key("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"
    assert client_key("2001:db8:1:3::1") != client_key("2001:db8:1:2::1")


def test_the_flag_reaches_the_server():
    from specdec_rt.serve.cli import _uvicorn_config, add_serve_parser

    args = add_serve_parser(argparse.ArgumentParser().add_subparsers()).parse_args(
        ["--max-connections-per-client", "0", "--send-buffer-bytes", "16384"]
    )
    config = _uvicorn_config(args, create_app(EchoEngine(), model_name="tiny"))
    assert config.http.limits.max_connections_per_client == 0
    assert config.http.limits.send_buffer_bytes == 16384
    assert config.ws == "none"
