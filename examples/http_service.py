"""A small async HTTP service around the Engine, with nothing but the standard library.

    python examples/http_service.py --model smollm2-135m --port 8000
    curl -s localhost:8000/generate -d '{"prompt": "Hi!", "chat": true, "max_new_tokens": 32}'
    curl -sN localhost:8000/stream -d '{"prompt": "def fib(n):", "max_new_tokens": 48}'

POST /generate -> one JSON document {"text", "token_ids", "stats"}.
POST /stream   -> server-sent events, one `data: {"text": ...}` per chunk, then `data: [DONE]`.
A bad request gets 400 with the error message; a model failure 500; neither affects other
requests. A client that disconnects mid-stream cancels its request (its KV slots are freed).
"""

from __future__ import annotations

import argparse
import asyncio
import json

from specdec_rt import Engine, InvalidInputError, SpecDecError

GEN_KEYS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "mode", "stop")


async def read_request(reader: asyncio.StreamReader) -> tuple[str, str, dict]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
    body = await reader.readexactly(int(headers.get("content-length", 0)))
    return method, path, json.loads(body or b"{}")


def response(status: str, payload: dict) -> bytes:
    body = json.dumps(payload).encode()
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


def arguments(req: dict) -> tuple[object, dict]:
    if not isinstance(req.get("prompt"), str):
        raise InvalidInputError("body needs a string 'prompt'")
    prompt = [{"role": "user", "content": req["prompt"]}] if req.get("chat") else req["prompt"]
    return prompt, {k: req[k] for k in GEN_KEYS if k in req}


def make_handler(engine: Engine):
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, path, req = await read_request(reader)
            prompt, kwargs = arguments(req)
            if method == "POST" and path == "/generate":
                r = await engine.generate(prompt, **kwargs)
                writer.write(response("200 OK", {"text": r.text, "token_ids": r.token_ids,
                                                 "stats": {"tokens_per_s": r.stats.tokens_per_s,
                                                           "acceptance_rate": r.stats.acceptance_rate,
                                                           "mean_accepted": r.stats.mean_accepted,
                                                           "mode": r.stats.mode}}))
            elif method == "POST" and path == "/stream":
                stream = engine.stream(prompt, **kwargs)  # bad arguments raise here, before any output
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
                async for ev in stream:
                    writer.write(f"data: {json.dumps({'text': ev.text})}\n\n".encode())
                    await writer.drain()  # a vanished client raises here and cancels the request
                writer.write(b"data: [DONE]\n\n")
            else:
                writer.write(response("404 Not Found", {"error": f"no route {method} {path}"}))
        except (InvalidInputError, ValueError, KeyError) as exc:
            writer.write(response("400 Bad Request", {"error": str(exc)}))
        except SpecDecError as exc:
            writer.write(response("500 Internal Server Error", {"error": str(exc)}))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            try:
                await writer.drain()
                writer.close()
            except ConnectionError:
                pass

    return handle


async def serve(model: str, host: str = "127.0.0.1", port: int = 8000, ready=None, **load) -> None:
    async with await Engine.load(model, **load) as engine:
        server = await asyncio.start_server(make_handler(engine), host, port)
        if ready is not None:
            ready(server.sockets[0].getsockname()[1])
        async with server:
            await server.serve_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    a = ap.parse_args()
    asyncio.run(serve(a.model, a.host, a.port, ready=lambda p: print(f"listening on {a.host}:{p}")))
