"""``python -m specdec_rt serve`` on a Gemma 3 model exported from its GGUF: a tiny random one
written as llama.cpp writes Gemma 3 270M's file (a BOS added to plain text, 5 local : 1 global
layers with a window of 8, shorter than prompt + answer, no chat template). Completions through
the HTTP API, whole and streamed, while the server speculates with its q8 draft, are
``Engine.generate``'s tokens, the BOS counted as a prompt token; a chat request is refused by name.

The tokens are compared through ``logprobs`` (each token's bytes), and the text too: a random
model emits runs of byte tokens that are not valid UTF-8 (``<0xF8>`` among ``<0x14>``), which
the tokenizer decodes a whole run at a time, so the stream's deltas never cut such a run
(``text.codec.IncrementalDecoder``) and the text does not depend on the speculative rounds."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

pytest.importorskip("torch")
pytest.importorskip("gguf")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from serve_util import metric, metric_values, sse_data, start_serve  # noqa: E402

pytestmark = pytest.mark.export

PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time, in a small village,"]
N = 24


def _piece(b: bytes) -> str:
    """A token as the completions ``logprobs.tokens`` name it (OpenAI's ``bytes:\\x..`` when not UTF-8)."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


def _engine_answers(folder: Path) -> list[dict]:
    """Each prompt, greedy through the Engine alone (no draft): its tokens as named in
    ``logprobs``, its text and its prompt token count."""
    from specdec_rt import Engine

    async def main():
        async with await Engine.load(folder, draft="none", warmup=False) as engine:
            out = []
            for p in PROMPTS:
                r = await engine.generate(p, max_new_tokens=N, mode="ar", ignore_eos=True)
                names = [_piece(engine.token_bytes(t)) for t in r.token_ids]
                out.append({"tokens": names, "text": r.text, "prompt_tokens": r.stats.prompt_tokens})
            return out

    return anyio.run(main)


def test_serve_gemma3_completions_equal_engine_generate(tiny_gemma3):
    from export.manifest import read_manifest

    m = read_manifest(tiny_gemma3)
    assert m["architecture"]["family"] == "gemma3_text" and m["architecture"]["sliding_window"] == 8
    assert m["tokenizer"]["add_bos"] is True and m["tokenizer"].get("chat_template") is None
    want = _engine_answers(tiny_gemma3)
    assert len({tuple(w["tokens"]) for w in want}) == len(PROMPTS)  # the prompts lead apart
    for w in want:
        assert len(w["tokens"]) == N and w["prompt_tokens"] > 1

    run = start_serve(tiny_gemma3, "--draft", "q8")
    try:

        async def scenario():
            async with httpx.AsyncClient(base_url=run.url, timeout=120) as c:
                while (await c.get("/health")).status_code != 200:  # the model loads after the server listens
                    await anyio.sleep(0.05)
                got = []
                for p in PROMPTS:
                    body = {"prompt": p, "max_tokens": N, "temperature": 0, "ignore_eos": True, "logprobs": 0}
                    whole = await c.post("/v1/completions", json=body)
                    assert whole.status_code == 200, whole.text
                    streamed = await c.post("/v1/completions", json={**body, "stream": True})
                    assert streamed.status_code == 200, streamed.text
                    events = sse_data(streamed.text)
                    assert events[-1] == "[DONE]"
                    choices = [e["choices"][0] for e in events[:-1] if e.get("choices")]
                    got.append((whole.json(), choices))
                chat = await c.post(
                    "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
                )
                return got, chat, metric_values((await c.get("/metrics")).text)

        got, chat, metrics = anyio.run(scenario)
    finally:
        run.stop()
    for w, (whole, chunks) in zip(want, got):
        choice = whole["choices"][0]
        assert choice["logprobs"]["tokens"] == w["tokens"]
        assert [t for c in chunks if c.get("logprobs") for t in c["logprobs"]["tokens"]] == w["tokens"]
        usage = whole["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (w["prompt_tokens"], N)  # the BOS counted
        assert choice["finish_reason"] == "length" and chunks[-1]["finish_reason"] == "length"
        assert choice["text"] == w["text"] and "".join(c["text"] for c in chunks) == w["text"]
    assert metric(metrics, "specdec_spec_decode_num_drafts_total") > 0  # the answers went through verifies
    assert chat.status_code == 400 and "no chat template" in chat.json()["error"]["message"]
