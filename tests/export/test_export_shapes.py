"""Model shapes beyond the defaults: head sizes ONNX Runtime's GroupQueryAttention does not take
(with rotary: multiples of 16 only), as tiny test models have them (hidden 16 over 4 heads), which
the exporter zero-pads (`export.layout.pad_heads`) without changing any result; and Mistral, which
is Llama's graph with its sliding window on every layer (the whole context exported)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_models import build_tiny_checkpoint  # noqa: E402

from export.errors import UnsupportedModelError  # noqa: E402
from export.layout import HEAD_MULTIPLE, check_weights, pad_heads  # noqa: E402
from export.model_spec import ModelSpec  # noqa: E402
from export.pipeline import Request, run  # noqa: E402
from export.ui import Reporter  # noqa: E402

pytestmark = pytest.mark.export


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Non-interleaved rotary as GroupQueryAttention applies it: dimension i pairs with
    i + d/2. x [heads, d], cos/sin [d/2]."""
    a, b = np.split(x, 2, axis=-1)
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


@pytest.mark.parametrize("own", [4, 8, 12, 20])
def test_padded_heads_keep_every_attention_product(own):
    rng = np.random.default_rng(own)
    heads, hidden, d = 3, 10, -(-own // HEAD_MULTIPLE) * HEAD_MULTIPLE
    wq, wk, wv = (rng.normal(size=(hidden, heads * own)) for _ in range(3))  # [K, heads * own]
    wo = rng.normal(size=(hidden, heads * own))  # o_proj.weight [H, heads * own]
    x = rng.normal(size=(2, hidden))  # two positions
    angles = rng.uniform(0, 6, size=(2, own // 2))
    cos, sin = np.cos(angles), np.sin(angles)
    cos_p = np.pad(cos, ((0, 0), (0, (d - own) // 2)), constant_values=1.0)
    sin_p = np.pad(sin, ((0, 0), (0, (d - own) // 2)), constant_values=0.0)

    def attention(q_w, k_w, v_w, o_w, size, c, s):
        q = (x @ q_w).reshape(2, heads, size)
        k = (x @ k_w).reshape(2, heads, size)
        v = (x @ v_w).reshape(2, heads, size)
        q = np.stack([_rotate(q[j], c[j], s[j]) for j in range(2)])
        k = np.stack([_rotate(k[j], c[j], s[j]) for j in range(2)])
        scores = np.einsum("ihd,jhd->hij", q, k) / np.sqrt(own)  # the model's scale either way
        out = np.einsum("hij,jhd->ihd", scores, v).reshape(2, heads * size)
        return scores, out @ o_w.T  # [heads, 2, 2], [2, H]

    s0, y0 = attention(wq, wk, wv, wo, own, cos, sin)
    s1, y1 = attention(*(pad_heads(w, heads, own, d) for w in (wq, wk, wv, wo)), d, cos_p, sin_p)
    np.testing.assert_allclose(s1, s0, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(y1, y0, rtol=1e-12, atol=1e-12)
    bias = rng.normal(size=heads * own)
    assert pad_heads(bias, heads, own, d).shape == (heads * d,)


@pytest.mark.parametrize(
    "family,shape,padded",
    [
        ("llama", dict(hidden=16, heads=4, kv_heads=4, intermediate=40), 16),  # head 4: transformers' tiny-random style
        ("qwen2", dict(hidden=40, heads=2, kv_heads=1, intermediate=72), 32),  # head 20, with q/k/v biases
        ("llama", dict(attention_bias=True), 16),  # q/k/v and o_proj biases (o_proj's was dropped)
        ("llama", dict(layers=1, kv_heads=1, head_dim=32), 32),  # one layer, one KV head, head_dim set
        (
            "llama",
            dict(
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 128,
                }
            ),
            16,
        ),
        ("qwen2", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}), 16),
    ],
)
def test_odd_shapes_export_exactly_and_decode_as_plain(tmp_path, family, shape, padded):
    from specdec_rt import Engine

    ckpt = build_tiny_checkpoint(tmp_path / "ckpt", family, **shape)
    out = tmp_path / "onnx"
    run(Request(src=str(ckpt), out=out, draft_quant="int8", threads=1), Reporter(quiet=True))
    m = json.loads((out / "manifest.json").read_text())
    assert m["architecture"]["head_dim"] == padded  # the KV cache's head size
    v = m["validation"]  # the ONNX graph against PyTorch, in the export
    assert v["greedy_agreement"] == 1.0 and v["max_abs_logit_diff"] < 1e-4

    prompts = ("hello world", "the quick brown fox jumps", "def f(x): return x")

    async def main():
        async with await Engine.load(out, draft="ngram+model", warmup=False) as engine:
            plain = [(await engine.generate(p, max_new_tokens=24, mode="ar")).token_ids for p in prompts]
            for p, ids in zip(prompts, plain):
                assert (await engine.generate(p, max_new_tokens=24, mode="spec")).token_ids == ids and ids
            together = await asyncio.gather(*[engine.generate(p, max_new_tokens=24) for p in prompts])
            assert [r.token_ids for r in together] == plain  # batched rows of padded heads too

    asyncio.run(main())


@pytest.mark.parametrize("window", [None, 16])
def test_mistral_exports_as_llama_with_its_window(tmp_path, window):
    """Mistral is Llama's graph; a sliding window shorter than its positions windows every layer
    (GroupQueryAttention's local_window_size) and the export keeps the whole context: validation
    and decoding run past the window."""
    from specdec_rt import Engine

    ckpt = build_tiny_checkpoint(tmp_path / "ckpt", "mistral", window=window)
    out = tmp_path / "onnx"
    run(Request(src=str(ckpt), out=out, draft_quant="int4", threads=1), Reporter(quiet=True))
    m = json.loads((out / "manifest.json").read_text())
    assert m["architecture"]["family"] == "mistral" and m["architecture"]["max_positions"] == 512
    assert m["architecture"].get("sliding_window") == window
    assert m["validation"]["greedy_agreement"] == 1.0 and m["validation"]["max_abs_logit_diff"] < 1e-4

    async def main():
        async with await Engine.load(out, draft="ngram+model", warmup=False) as engine:
            plain = await engine.generate("the quick brown fox jumps", max_new_tokens=24, mode="ar", ignore_eos=True)
            spec = await engine.generate("the quick brown fox jumps", max_new_tokens=24, mode="spec", ignore_eos=True)
            assert spec.token_ids == plain.token_ids and len(plain.token_ids) == 24

    asyncio.run(main())


@pytest.mark.parametrize(
    "family,options,max_positions,positions",
    [
        ("llama", {}, 24, 24),  # --max-positions below the validation's usual 60 tokens
        ("mistral", dict(window=16), 24, 24),  # a window shorter than that context
        (
            "llama",
            dict(
                rope_scaling={
                    "rope_type": "longrope",
                    "short_factor": [1.0] * 8,
                    "long_factor": [1, 1.5, 2, 3, 4, 6, 8, 16],
                },
                original_max_position_embeddings=64,
            ),
            None,
            64,
        ),  # LongRoPE: capped, short factors
    ],
)
def test_short_contexts_export_validated_and_exact(tmp_path, family, options, max_positions, positions):
    """Validation fits its prompt and continuation in the context; a LongRoPE model stops at its
    original length, where transformers itself uses the short factors for every position."""
    from specdec_rt import Engine

    ckpt = build_tiny_checkpoint(tmp_path / "ckpt", family, **options)
    out = tmp_path / "onnx"
    run(
        Request(src=str(ckpt), out=out, max_positions=max_positions, draft_quant="int8", threads=1),
        Reporter(quiet=True),
    )
    m = json.loads((out / "manifest.json").read_text())
    assert m["architecture"]["max_positions"] == positions
    assert m["validation"]["greedy_agreement"] == 1.0 and m["validation"]["max_abs_logit_diff"] < 1e-4
    assert m["validation"]["rows"] > 4

    async def main():
        async with await Engine.load(out, draft="ngram+model", warmup=False) as engine:
            plain = await engine.generate("the fox", max_new_tokens=4, mode="ar")  # within 16 tokens
            spec = await engine.generate("the fox", max_new_tokens=4, mode="spec")
            assert spec.token_ids == plain.token_ids and len(plain.token_ids) > 0

    asyncio.run(main())


def test_swish_is_silu_and_other_activations_are_refused():
    from transformers import LlamaConfig

    base = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    assert ModelSpec.from_config(LlamaConfig(**base, hidden_act="swish")).family == "llama"
    with pytest.raises(UnsupportedModelError, match="unsupported activation gelu"):
        ModelSpec.from_config(LlamaConfig(**base, hidden_act="gelu"))


def test_weights_the_graph_has_no_place_for_are_refused():
    spec = ModelSpec("llama", 1, 8, 2, 2, 16, 16, 10, 32, 1e-5)
    names = [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.o_proj.bias",
        "model.rotary_emb.inv_freq",
    ]
    check_weights(dict.fromkeys(names), spec)
    with pytest.raises(UnsupportedModelError, match="unsupported weights model.layers.0.mlp.up_proj.bias"):
        check_weights(dict.fromkeys(names + ["model.layers.0.mlp.up_proj.bias"]), spec)
