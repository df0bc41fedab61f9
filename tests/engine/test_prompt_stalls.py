"""The largest accepted prompt never stalls the event loop (docs/security.md, "Big prompts";
docs/decisions/0011-big-prompts-in-a-process.md): the engine's loop watchdog sees at most
max(100 ms, 3x) the worst lag of an ordinary short request measured in the same test (a control,
so that the test holds on a loaded machine; tests/loop_lag.py). Was: 0.5-2 s, the tokenizer's ids
and the freeing of its encoding holding the GIL. Big prompts are encoded by a child process; their
ids and errors are those of the codec here."""

from __future__ import annotations

import shutil

import anyio
import numpy as np
import pytest
from loop_lag import bound, compare

from specdec_rt.engine import Engine
from specdec_rt.errors import ContextLengthError, InvalidInputError, ModelLoadError
from specdec_rt.text.codec import TextCodec
from specdec_rt.text.encode_process import PROCESS_MIN_CHARS, PromptEncoder

N = 996_000  # under the 1M characters of max_prompt_chars


BIG = {
    # plain text: refused by the context length, after a full encoding (708k tokens)
    "plain": (("The quick brown fox jumps over the lazy dog. " * (N // 45 + 1))[:N], {}),
    # a chat prompt full of special-token text: rendering, the first encoding, the re-encoding
    # of the text between control tokens as plain text (950k tokens); the last ones kept
    "chat-special": (
        [{"role": "user", "content": ("hi <|im_end|> </s> <s> " * (N // 22 + 1))[: N - 10]}],
        {"truncate_prompt": True},
    ),
}


@pytest.mark.parametrize("name", list(BIG))
def test_the_largest_accepted_prompt_never_stalls_the_event_loop(tiny_llama, name):
    prompt, kw = BIG[name]

    async def main():
        async with await Engine.load(tiny_llama, draft="none", max_length=512) as engine:
            attack, control = await compare(
                lambda: engine.generate(prompt, max_new_tokens=1, mode="ar", **kw),
                lambda: engine.generate("The quick brown fox", max_new_tokens=1, mode="ar"),
            )
            out = attack.out
            if name == "plain":
                assert isinstance(out, ContextLengthError), out
                assert "prompt of 708268 tokens + max_new_tokens=1 exceeds the model's maximum length of 512" in str(
                    out
                )
            else:
                assert not isinstance(out, Exception), out
                assert out.stats.prompt_tokens == 511
            assert attack.worst <= bound(control), (attack.ms(), control.ms())

    anyio.run(main)


def test_big_prompts_encode_as_in_a_thread(tiny_llama):
    """Ids and errors from the child are the codec's own, for every kind of prompt."""
    codec = TextCodec.from_manifest(_manifest(tiny_llama))
    encoder = PromptEncoder(codec)
    n = PROCESS_MIN_CHARS
    text = ("héllo wörld 🙂 <s> </s> " * (n // 20 + 1))[: n + 5]
    prompts = [
        text,
        [{"role": "user", "content": text}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": text}]}],
    ]
    try:
        for prompt in prompts:
            got = encoder.encode(prompt)
            assert isinstance(got, np.ndarray) and got.dtype == np.int64  # it went to the child
            assert got.tolist() == codec.encode_prompt(prompt)
        small = encoder.encode("hello")
        assert isinstance(small, list) and small == codec.encode_prompt("hello")  # encoded here
        for bad in (
            [{"role": "user", "content": text + "\ud800"}],
            [{"role": "user", "content": text}, {"content": "no role"}],
            text + "\udfff",
        ):
            with pytest.raises(InvalidInputError) as here:
                codec.encode_prompt(bad)
            with pytest.raises(type(here.value)) as there:
                encoder.encode(bad)
            assert str(there.value) == str(here.value)
        assert encoder.encode(text).tolist() == codec.encode_prompt(text)  # still serving after errors
    finally:
        encoder.close()
    with pytest.raises(InvalidInputError, match="closed"):
        encoder.encode(text)


def test_a_tokenizer_file_changed_since_load_is_refused_by_the_child(tiny_llama, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(tiny_llama, folder)
    codec = TextCodec(folder / "tokenizer.json")
    (folder / "tokenizer.json").write_text((folder / "tokenizer.json").read_text().replace('"<s>"', '"<x>"'))
    encoder = PromptEncoder(codec)
    try:
        with pytest.raises(ModelLoadError, match="changed since it was loaded"):
            encoder.encode("x" * PROCESS_MIN_CHARS)
    finally:
        encoder.close()


def _manifest(folder):
    from specdec_rt.ort.manifest import load_manifest

    return load_manifest(folder)
