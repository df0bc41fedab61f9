"""IncrementalDecoder: the deltas concatenate to a full decode, however the ids are split."""

from __future__ import annotations

import itertools

import pytest

from specdec_rt.text.codec import IncrementalDecoder, TextCodec

tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def byte_fallback_codec(tmp_path_factory):
    """A SentencePiece-style tokenizer (Gemma's, Llama 2's): byte pieces ``<0xNN>`` that its
    decoder reads a run at a time."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, "a": 1, "\u2581b": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    path = tmp_path_factory.mktemp("bf") / "tokenizer.json"
    tok.save(str(path))
    return TextCodec(path)


def byte(b: int) -> int:
    return 3 + b


IDS = {
    "a valid run then an invalid byte": [1, byte(0xC3), byte(0xA9), byte(0xFF), 1, 2],
    "an emoji in four pieces": [2, byte(0xF0), byte(0x9F), byte(0x98), byte(0x80), 2],
    "an incomplete run at the end": [1, byte(0xE2), byte(0x82)],
    "two runs": [byte(0xC3), byte(0xA9), 1, byte(0xE2), byte(0x82), byte(0xAC), byte(0x41)],
}


@pytest.mark.parametrize("name", list(IDS))
def test_any_split_gives_the_full_decode(byte_fallback_codec, name):
    """A run of byte pieces decodes as a whole (an invalid run: one U+FFFD per piece), so a
    delta cut inside it (after a valid prefix) would differ from the full decode."""
    codec, ids = byte_fallback_codec, IDS[name]
    full = codec.decode(ids)
    for k in range(len(ids)):
        for cuts in itertools.combinations(range(1, len(ids)), k):
            d = IncrementalDecoder(codec)
            bounds = [0, *cuts, len(ids)]
            out = "".join(d.push(ids[a:b]) for a, b in itertools.pairwise(bounds)) + d.flush()
            assert out == full, (cuts, out, full)


def test_the_byte_pieces_are_known(byte_fallback_codec):
    assert byte_fallback_codec.is_byte_piece(byte(0xC3)) and not byte_fallback_codec.is_byte_piece(1)
    d = IncrementalDecoder(byte_fallback_codec)
    assert d.push([1, byte(0xC3), byte(0xA9)]) == ""  # "é" waits: the run may go on
    assert d.push([2]) == "aé b"
