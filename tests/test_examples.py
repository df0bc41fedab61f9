"""The examples run: a custom drafter checked lossless, and the HTTP service on a tiny model."""

from __future__ import annotations

import asyncio
import json
import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_custom_drafter_example(capsys):
    runpy.run_path(str(EXAMPLES / "custom_drafter.py"), run_name="__main__")
    assert "identical to plain decoding: ok" in capsys.readouterr().out


async def _post(port: int, path: str, payload: dict) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps(payload).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    data = await reader.read()
    writer.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), rest


@pytest.mark.export
def test_http_service_example(tiny_llama):
    sys.path.insert(0, str(EXAMPLES))
    try:
        import http_service
    finally:
        sys.path.pop(0)

    async def main():
        port_box: asyncio.Future = asyncio.get_running_loop().create_future()
        server = asyncio.create_task(http_service.serve(str(tiny_llama), port=0, ready=port_box.set_result))
        port = await port_box
        try:
            ok = _post(port, "/generate", {"prompt": "def add(a, b):", "max_new_tokens": 10})
            bad = _post(port, "/generate", {"prompt": "hi", "max_new_tokens": -1})
            streamed = _post(port, "/stream", {"prompt": "Hello", "chat": True, "max_new_tokens": 10})
            (s1, b1), (s2, b2), (s3, b3) = await asyncio.gather(ok, bad, streamed)
            assert s1 == 200 and len(json.loads(b1)["token_ids"]) == 10
            assert s2 == 400 and "max_new_tokens" in json.loads(b2)["error"]
            assert s3 == 200 and b3.rstrip().endswith(b"data: [DONE]")
            again = await _post(port, "/generate", {"prompt": "def add(a, b):", "max_new_tokens": 10})
            assert again == (s1, b1) or json.loads(again[1])["token_ids"] == json.loads(b1)["token_ids"]
        finally:
            server.cancel()

    asyncio.run(main())
