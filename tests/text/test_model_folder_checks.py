"""A hostile model folder (docs/security.md, "Model folders"): its tokenizer and chat template
are checked when it is loaded, and cannot run away on a request.

- A tokenizer whose normalizer expands text (``Replace`` writing 1000 ``a`` for each ``a``) is
  refused at load, naming the component (was: 5,000 characters became 5M tokens, 9 s, +840 MB).
- One that expands less is loaded, and a prompt whose characters times its bound are too many
  is refused before it is encoded.
- A tokenizer that panics (its regex gives up) is an InferenceError, and the codec still works
  after it (was: PanicException, a BaseException nothing caught).
- A chat template may not call ``str.encode`` (punycode of 10k distinct characters: ~10 s in one
  call the deadline cannot stop); a template that cannot render a short conversation within its
  bounds is refused at load, naming it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specdec_rt.errors import InferenceError, InvalidInputError, ModelLoadError
from specdec_rt.text.codec import TextCodec
from specdec_rt.text.tokenizer_checks import MAX_ENCODE_TOKENS, PROBE_TEXT, expansion

REPO = Path(__file__).resolve().parents[2]
CJK = "".join(chr(0x4E00 + i) for i in range(10_000))  # 10k distinct characters
PUNYCODE = "{% for m in messages %}{{ m['content'].encode('punycode') }}{% endfor %}"


def hostile_tokenizer(folder: Path, dst: Path, kind: str) -> Path:
    """A copy of ``folder``'s tokenizer.json at ``dst``: ``replace<N>`` (a normalizer writing N
    ``a`` for each ``a``) or ``panic`` (a Split whose regex gives up on 40 ``a`` then ``b``: the
    tokenizers library panics)."""
    doc = json.loads((folder / "tokenizer.json").read_text())
    if kind.startswith("replace"):
        doc["normalizer"] = {"type": "Replace", "pattern": {"String": "a"}, "content": "a" * int(kind[7:])}
    elif kind == "panic":
        split = {"type": "Split", "pattern": {"Regex": "(a+)+$"}, "behavior": "Isolated", "invert": False}
        doc["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, doc["pre_tokenizer"]]}
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "tokenizer.json").write_text(json.dumps(doc))
    return dst / "tokenizer.json"


def test_real_tokenizers_pass_with_the_byte_bound(tiny_llama, tiny_qwen):
    for folder in (tiny_llama, tiny_qwen):
        codec = TextCodec(folder / "tokenizer.json")
        assert codec.expansion.per_char == 4  # byte-level: a character is at most 4 tokens
        assert len(codec.encode(PROBE_TEXT)) < 4 * len(PROBE_TEXT)


def test_expanding_normalizer_is_refused_at_load_naming_it(tiny_qwen, tmp_path):
    path = hostile_tokenizer(tiny_qwen, tmp_path, "replace1000")
    t0 = time.perf_counter()
    with pytest.raises(ModelLoadError, match=r"tokenizer.json: its normalizer Replace\('a' -> 1000 characters\)"):
        TextCodec(path)
    assert time.perf_counter() - t0 < 2.0


def test_a_sequence_of_small_expansions_multiplies(tiny_qwen, tmp_path):
    doc = json.loads((tiny_qwen / "tokenizer.json").read_text())
    step = {"type": "Replace", "pattern": {"String": "a"}, "content": "aaaa"}
    doc["normalizer"] = {"type": "Sequence", "normalizers": [step] * 6}  # 4096-fold in all
    (tmp_path / "tokenizer.json").write_text(json.dumps(doc))
    with pytest.raises(ModelLoadError, match="normalizer Replace"):
        TextCodec(tmp_path / "tokenizer.json")


def test_probe_refuses_what_the_settings_do_not_show(tiny_qwen, monkeypatch):
    """The sample text is encoded at load too: a tokenizer that writes more tokens a character
    than the limit is refused, naming the step the bound points at."""
    import specdec_rt.text.tokenizer_checks as checks

    monkeypatch.setattr(checks, "MAX_PROBE_TOKENS_PER_CHAR", 0.05)
    with pytest.raises(ModelLoadError, match="pre-tokenizer ByteLevel turns a .*-character sample text into"):
        TextCodec(tiny_qwen / "tokenizer.json")


def _peak_rss_growth(code: str) -> tuple[float, str]:
    """Run ``code`` (which prints its outcome) in a fresh interpreter; (MB its peak memory grew
    by while it ran, what it printed)."""
    wrapped = (
        "import resource, sys\n"
        "def rss(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024\n"
        "from specdec_rt.text.codec import TextCodec\n"
        "before = rss()\n" + code + "\nprint('MB', rss() - before)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", wrapped], capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(REPO)}
    ).stdout
    return float(out.rsplit("MB ", 1)[1]), out


def test_expanding_tokenizer_refuses_a_long_prompt_before_encoding_it(tiny_qwen, tmp_path):
    """A 10-fold Replace loads (bound 40 tokens a character); 200k characters of 'a' could be 8M
    tokens: refused before encoding, fast and without memory (was: 2M tokens, ~0.4 GB)."""
    path = hostile_tokenizer(tiny_qwen, tmp_path, "replace10")
    codec = TextCodec(path)
    assert codec.expansion.per_char == 40 and "Replace" in codec.expansion.by
    n = MAX_ENCODE_TOKENS // 40 * 2
    t0 = time.perf_counter()
    with pytest.raises(InvalidInputError, match=f"has {n} characters of text.*set by its normalizer Replace"):
        codec.encode("a" * n)
    assert time.perf_counter() - t0 < 1.0
    grew, out = _peak_rss_growth(
        f"c = TextCodec({str(path)!r})\n"
        f"try:\n    print(len(c.encode('a' * {n})))\nexcept Exception as e:\n    print(type(e).__name__)"
    )
    assert "InvalidInputError" in out and grew < 200, out
    assert len(codec.encode("a" * 1000)) == 10_000  # shorter prompts still encode as the tokenizer says


def test_tokenizer_panic_is_an_inference_error_and_the_codec_goes_on(tiny_qwen, tmp_path):
    codec = TextCodec(hostile_tokenizer(tiny_qwen, tmp_path, "panic"))
    with pytest.raises(InferenceError, match="tokenizer failed while encoding the prompt: PanicException"):
        codec.encode("a" * 40 + "b")
    assert codec.encode("hello world")  # the tokenizer still works


def test_template_may_not_call_a_codec(tiny_qwen):
    codec = TextCodec(tiny_qwen / "tokenizer.json", chat_template=PUNYCODE)
    t0 = time.perf_counter()
    with pytest.raises(InvalidInputError, match=r"used str.encode, which chat templates may not call"):
        codec.encode_prompt([{"role": "user", "content": CJK}])
    assert time.perf_counter() - t0 < 1.0  # was: ~10 s in one punycode call


@pytest.mark.parametrize("method", ["encode('idna')", "strip().encode()", "__class__", "maketrans('a', 'b')"])
def test_template_methods_outside_the_allow_list_are_refused(tiny_qwen, method):
    template = "{{ messages[0]['content']." + method + " }}"
    codec = TextCodec(tiny_qwen / "tokenizer.json", chat_template=template)
    with pytest.raises(InvalidInputError, match=r"used str\.\w+, which chat templates may not"):
        codec.render_chat([{"role": "user", "content": "hi"}])


def test_templates_over_budget_fail_at_load_and_refused_methods_per_request(tiny_qwen, tmp_path):
    from tiny_models import with_chat_template

    from specdec_rt.ort.manifest import load_manifest

    folder = with_chat_template(tiny_qwen, tmp_path / "puny", PUNYCODE)
    codec = TextCodec.from_manifest(load_manifest(folder))  # a refused method costs nothing: it loads
    with pytest.raises(InvalidInputError, match=r"chat template in .*puny/manifest.json used str.encode"):
        codec.encode_prompt([{"role": "user", "content": "hi"}])
    slow = with_chat_template(
        tiny_qwen, tmp_path / "slow", "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    )
    with pytest.raises(ModelLoadError, match=r"chat template in .*slow/manifest.json ran"):
        TextCodec.from_manifest(load_manifest(slow))
    # one that refuses the sample conversation itself is left to the requests
    picky = with_chat_template(tiny_qwen, tmp_path / "picky", "{{ raise_exception('no system messages') }}")
    TextCodec.from_manifest(load_manifest(picky))
    # one that refuses a system message is checked on the conversation without it
    no_system = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    )
    with pytest.raises(ModelLoadError, match=r"ran .* \(on a short conversation of 3 messages\)"):
        TextCodec.from_manifest(load_manifest(with_chat_template(tiny_qwen, tmp_path / "nosys", no_system)))


def test_expansion_of_real_normalizers_is_one():
    """Unicode normalization, and Llama's Prepend + Replace(' ' -> '▁'): no amplification."""
    from tokenizers import Tokenizer, models, normalizers

    tok = Tokenizer(models.WordLevel({"a": 0}, unk_token="a"))
    tok.normalizer = normalizers.Sequence(
        [normalizers.NFKC(), normalizers.Prepend("▁"), normalizers.Replace(" ", "▁"), normalizers.Lowercase()]
    )
    bound = expansion(tok)
    assert (bound.per_char, bound.added) == (1, 1)


class _Panic(BaseException):
    """Stands in for the tokenizers library's PanicException (a BaseException)."""


class _PanickingTokenizer:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def decode(self, *args, **kwargs):
        raise self.exc

    def encode_batch(self, *args, **kwargs):
        raise self.exc


def test_a_native_panic_while_decoding_is_an_inference_error_but_an_interrupt_is_not(tiny_qwen):
    codec = TextCodec(tiny_qwen / "tokenizer.json")
    real = codec.tokenizer
    codec.tokenizer = _PanickingTokenizer(_Panic("decoder gave up"))
    with pytest.raises(InferenceError, match="failed while decoding the answer: _Panic: decoder gave up"):
        codec.decoder().push([1, 2])
    for passes in (KeyboardInterrupt(), SystemExit(1)):
        codec.tokenizer = _PanickingTokenizer(passes)
        with pytest.raises(type(passes)):
            codec.decode([1])
        with pytest.raises(type(passes)):
            codec.encode("hi")
    codec.tokenizer = real
    assert codec.decode(codec.encode("hello")) == "hello"


def _charsmap(key: int, replacement: str) -> str:
    """A SentencePiece precompiled character map (a darts-clone trie, then NUL-ended strings)
    that writes ``replacement`` for the byte ``key``."""
    import base64
    import struct

    units = [0] * 512
    units[key] = (0x100 << 10) | (1 << 8) | key  # the key's node: its label, a leaf, offset 0x100
    units[key ^ 0x100] = 1 << 31  # the leaf: string 0
    trie = struct.pack(f"<{len(units)}I", *units)
    return base64.b64encode(struct.pack("<I", len(trie)) + trie + replacement.encode() + b"\0").decode()


def test_a_precompiled_character_map_that_expands_is_refused(tiny_qwen, tmp_path):
    """A SentencePiece map writing 1000 characters for 'a' (the tokenizers library applies it:
    checked here) is refused at load; one within Unicode's own 18 loads."""
    from tokenizers import Tokenizer

    doc = json.loads((tiny_qwen / "tokenizer.json").read_text())
    doc["normalizer"] = {"type": "Precompiled", "precompiled_charsmap": _charsmap(0x61, "b" * 1000)}
    assert len(Tokenizer.from_str(json.dumps(doc)).normalizer.normalize_str("xay")) == 1002
    (tmp_path / "tokenizer.json").write_text(json.dumps(doc))
    with pytest.raises(ModelLoadError, match=r"normalizer Precompiled \(a replacement of 1000 characters\)"):
        TextCodec(tmp_path / "tokenizer.json")
    doc["normalizer"]["precompiled_charsmap"] = _charsmap(0x61, "b" * 18)
    (tmp_path / "tokenizer.json").write_text(json.dumps(doc))
    assert TextCodec(tmp_path / "tokenizer.json").expansion.per_char == 4
