"""A native library that fails with a BaseException that is not an Exception (the tokenizers
library's PanicException) while a prompt is encoded ends that request with an InferenceError,
never a request that ends without a word (was: the request's task died; ``generate`` failed
on its own assertion, a server answered 200 with empty text). Interrupts pass through."""

from __future__ import annotations

import anyio
import pytest

from specdec_rt import Engine
from specdec_rt.errors import InferenceError


class _Panic(BaseException):
    """Stands in for pyo3's PanicException."""


def test_a_panic_while_encoding_is_an_inference_error_and_the_engine_goes_on(tiny_llama):
    async def main():
        async with await Engine.load(tiny_llama, warmup=False) as engine:
            encode = engine.prompt_encoder.encode

            def panics(prompt, tools=None):
                raise _Panic("native code gave up")

            engine.prompt_encoder.encode = panics
            with pytest.raises(InferenceError, match="prompt cannot be encoded: _Panic: native code gave up"):
                await engine.generate("hello", 4)
            engine.prompt_encoder.encode = encode
            assert len((await engine.generate("hello", 4)).token_ids) == 4

    anyio.run(main)
