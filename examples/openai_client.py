"""Talk to ``python -m specdec_rt serve`` with the official ``openai`` client (pip install openai).

    python examples/openai_client.py                          # starts a server on a free port, then asks it
    python examples/openai_client.py --model /path/to/export  # ... on another model
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1   # a server already running

Chat and plain completions, whole and streamed (with the usage chunk), the extra ``mode``
parameter (``"spec"`` or ``"ar"``), and an error as the client sees it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import queue
import re
import subprocess
import sys
import threading
import time
import urllib.request

import openai


@contextlib.contextmanager
def local_server(model: str, timeout: float = 300.0):
    """Start ``python -m specdec_rt serve --port 0``; yields its ``/v1`` base URL once ``/health``
    says ready; SIGTERM (a graceful drain) when done."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdec_rt", "serve", "--model", model, "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
    )
    found: queue.Queue = queue.Queue()
    last = collections.deque(maxlen=20)

    def read_stderr() -> None:  # the server logs one line per request: keep its pipe drained
        for line in proc.stderr:  # "specdec_rt serve: listening on http://127.0.0.1:PORT ..."
            last.append(line)
            if m := re.search(r"listening on (http://\S+:\d+)", line):
                found.put(m.group(1))
        found.put(None)

    threading.Thread(target=read_stderr, daemon=True).start()
    try:
        url = found.get()
        if url is None:
            raise SystemExit(f"the server did not start (exit status {proc.wait()}):\n{''.join(last)}")
        deadline = time.monotonic() + timeout
        while not _ready(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not become ready:\n{''.join(last)}")
            time.sleep(0.1)
        yield f"{url}/v1"
    finally:
        proc.terminate()  # SIGTERM: the server finishes what runs, then exits 0
        proc.wait(timeout=60)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:  # not listening yet, or 503 while loading
        return False


def demo(base_url: str, max_tokens: int = 48) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="unused")
    model = client.models.list().data[0].id
    print(f"model: {model}")

    messages = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    print(f"chat ({r.choices[0].finish_reason}, {r.usage.completion_tokens} tokens):")
    print(r.choices[0].message.content + "\n")

    print("chat, streamed: ", end="", flush=True)
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        elif chunk.usage:  # the last chunk: no choices, the usage
            print(f"\n[usage: {chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion]")

    t = client.completions.create(
        model=model, prompt="def fib(n):", max_tokens=max_tokens, temperature=0, extra_body={"mode": "ar"}
    )  # plain decoding: the same greedy text
    print(f"completion (mode ar): {t.choices[0].text!r}")
    print("completion, streamed: ", end="")
    for chunk in client.completions.create(
        model=model, prompt="def fib(n):", max_tokens=max_tokens, temperature=0.7, seed=1, stream=True
    ):
        print(chunk.choices[0].text, end="", flush=True)
    print()

    try:
        client.chat.completions.create(model=model, messages=messages, temperature=-1)
    except openai.BadRequestError as exc:
        print(f"error: HTTP {exc.status_code}, param={exc.param!r}: {exc.message}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default=None, help="a running server's /v1 URL (default: start one)")
    ap.add_argument("--model", default="smollm2-135m", help="the model the started server loads")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    if args.base_url:
        demo(args.base_url, args.max_tokens)
    else:
        with local_server(args.model) as url:
            demo(url, args.max_tokens)


if __name__ == "__main__":
    main()
