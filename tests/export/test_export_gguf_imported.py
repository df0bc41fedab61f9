"""GGUF files of the families transformers cannot load (export.gguf_import), written as
llama.cpp's converter writes them (gguf_convert), quantized (Q4_0 layers, Q8_0 embedding):
the float export decodes exactly as the PyTorch model of the same weights, and an int4 export
carries the file's own blocks over."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("gguf")

from gguf_convert import ARCHES, write_llama_cpp_gguf  # noqa: E402

from export.manifest import read_manifest  # noqa: E402
from export.pipeline import Request, run  # noqa: E402
from export.ui import Reporter  # noqa: E402
from export.validate import KVSession  # noqa: E402

pytestmark = pytest.mark.export

PROMPT, NEW = 12, 28
# the int4 graph's MatMuls of 2 layers on the file's grids: Q4_0 layers (found as 4-bit codes
# with a step, "q4_k"), the Q8_0 LM head; q/k/v fused in one MatMul. QMoE requantizes the
# experts (2 per layer) and the float32 routers (and Qwen2-MoE's shared-expert gate) are
# quantized as any float weight: the graph has no grids for them
_DENSE = {"q4_k": 2 * 4, "q8_0": 1}  # qkv, o, up, down
_GATED = {"q4_k": 2 * 5, "q8_0": 1}  # qkv, o, gate, up, down
EXPECTED_FORMS = {
    "gemma": _GATED,
    "phi": _DENSE,
    "gpt2": _DENSE,
    "starcoder2": _DENSE,
    "olmo2": _GATED,
    "granite": _GATED,
    "gpt_neox": _DENSE,
    "falcon": _DENSE,
    "bloom": _DENSE,
    "mpt": _DENSE,
    "qwen2_moe": {"q4_k": 2 * 5, "q8_0": 1, "requantized": 2 * (2 + 1 + 1)},  # shared expert on grids
    "qwen3_moe": {"q4_k": 2 * 2, "q8_0": 1, "requantized": 2 * (2 + 1)},
}


def _greedy(model, prompt: list[int], count: int) -> list[int]:
    import torch

    seq = list(prompt)
    with torch.no_grad():
        while len(seq) < len(prompt) + count:  # each step from scratch
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


def _engine_tokens(out, prompt: list[int], count: int) -> list[list[int]]:
    from specdec_rt import Engine

    async def main():
        async with await Engine.load(out, draft="ngram", warmup=False) as engine:
            return [
                (await engine.generate(prompt, max_new_tokens=count, mode=mode, ignore_eos=True)).token_ids
                for mode in ("ar", "spec")
            ]

    return asyncio.run(main())


@pytest.mark.parametrize("family", list(ARCHES))
def test_a_llama_cpp_gguf_exports_exactly_and_keeps_its_blocks(tmp_path, family):
    import torch
    from transformers import AutoModelForCausalLM

    src = write_llama_cpp_gguf(tmp_path / f"{family}.gguf", family, quantized=True)
    original = AutoModelForCausalLM.from_pretrained(tmp_path / f"{family}-hf", attn_implementation="eager").eval()
    out = tmp_path / "out"
    run(Request(src=str(src), out=out, threads=1), Reporter(quiet=True))
    manifest = read_manifest(out)
    assert manifest["source"]["kind"] == "gguf" and manifest["validation"]["greedy_agreement"] == 1.0
    ids = np.random.default_rng(1).integers(3, 384, 20)
    with torch.no_grad():
        want_logits = original(torch.tensor(ids[None])).logits[0].numpy()
    np.testing.assert_allclose(KVSession(out, manifest, max_len=64).forward(ids, 0), want_logits, atol=1e-4)
    prompt = [int(t) for t in ids[:PROMPT]]
    want = _greedy(original, prompt, NEW)
    assert _engine_tokens(out, prompt, NEW) == [want, want]
    quant = tmp_path / "int4"
    run(Request(src=str(src), out=quant, threads=1, quantize="int4", validate=False), Reporter(quiet=True))
    forms = read_manifest(quant)["onnx"]["weight_forms"]
    assert forms == EXPECTED_FORMS[family]


def test_the_imported_families_keys_are_bounded_before_loading(tmp_path):
    """Hostile values of the keys these files are read by fail in the header check, naming the key."""
    from gguf_bytes import patch_kv

    from export.errors import CorruptSourceError, UnsupportedModelError
    from export.source import open_source

    bad = tmp_path / "bad.gguf"
    cases = {
        "qwen3_moe": [
            ("qwen3moe.expert_count", 1 << 20, CorruptSourceError, "expert_count"),
            (
                "qwen3moe.expert_used_count",
                5,
                CorruptSourceError,
                "expert_used_count = 5 is not an integer from 1 to 4",
            ),
            ("qwen3moe.attention.key_length", 48, UnsupportedModelError, "key length 48 and value length 32 differ"),
        ],
        "granite": [
            ("granite.attention.scale", float("nan"), CorruptSourceError, "attention.scale"),
            ("granite.logit_scale", -1.5, CorruptSourceError, "logit_scale"),
        ],
        "gpt_neox": [("gptneox.rope.dimension_count", 9, CorruptSourceError, "rope.dimension_count")],
        "falcon": [("falcon.attention.head_count_kv", 2, UnsupportedModelError, "new_decoder_architecture")],
        "bloom": [
            ("bloom.attention.head_count_kv", 2, UnsupportedModelError, "BLOOM has a KV head per head"),
            ("bloom.feed_forward_length", 128, CorruptSourceError, r"blk\.0\.ffn_up\.weight is \[64, 256\]"),
            ("bloom.context_length", 1 << 31, CorruptSourceError, "context_length"),
            ("bloom.attention.layer_norm_epsilon", -1.0, CorruptSourceError, "layer_norm_epsilon"),
        ],
        "mpt": [
            ("mpt.attention.max_alibi_bias", 4.0, UnsupportedModelError, "alibi_bias_max 8 only"),
            ("mpt.attention.max_alibi_bias", 0.0, UnsupportedModelError, "MPT without ALiBi"),
            ("mpt.attention.max_alibi_bias", float("inf"), CorruptSourceError, "max_alibi_bias = inf"),
            ("mpt.attention.clamp_kqv", float("nan"), CorruptSourceError, "clamp_kqv = nan"),
            ("mpt.attention.clamp_kqv", -0.3, CorruptSourceError, "clamp_kqv"),
            ("mpt.feed_forward_length", 192, CorruptSourceError, r"blk\.0\.ffn_up\.weight is \[96, 384\]"),
            ("mpt.context_length", 1 << 31, CorruptSourceError, "context_length"),
            ("mpt.attention.layer_norm_epsilon", float("nan"), CorruptSourceError, "layer_norm_epsilon"),
        ],
    }
    for family, patches in cases.items():
        data = write_llama_cpp_gguf(tmp_path / f"{family}.gguf", family).read_bytes()
        for key, value, error, fragment in patches:
            bad.write_bytes(patch_kv(data, key, value))
            with pytest.raises(error, match=fragment):
                open_source(bad)


def _rewritten(src, out, arch: str, *, drop: str | None = None, extra: dict | None = None, keys: dict | None = None):
    """``src`` written again to ``out`` without the tensor ``drop``, with the tensors ``extra``
    added (or put in place of one of the same name), and the metadata ``keys`` set (an int as
    uint32, a float as float32) or, where None, left out."""
    import gguf

    extra, keys = extra or {}, keys or {}
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if not field.name.startswith(("GGUF.", "general.architecture")) and field.name not in keys:
            writer.add_key_value(
                field.name, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None
            )
    for key, value in keys.items():
        if type(value) is int:
            writer.add_uint32(key, value)
        elif value is not None:
            writer.add_float32(key, value)
    for tensor in reader.tensors:
        if tensor.name != drop and tensor.name not in extra:
            writer.add_tensor(tensor.name, np.array(tensor.data))
    for name, value in extra.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_a_tensor_without_a_place_or_a_parameter_without_a_tensor_is_refused(tmp_path):
    """A file with a tensor the model has no parameter for would compute something else; one
    without a parameter's tensor would leave it random: both refused when loading."""
    from export.errors import CorruptSourceError, UnsupportedModelError
    from export.source import open_source

    src = write_llama_cpp_gguf(tmp_path / "olmo2.gguf", "olmo2")
    for extra, drop, error, fragment in (
        ("blk.0.attn_norm.weight", None, UnsupportedModelError, "blk.0.attn_norm.weight has no place"),
        (None, "blk.1.attn_k_norm.weight", CorruptSourceError, "has no tensor for 1 parameters"),
    ):
        added = {extra: np.ones(64, dtype=np.float32)} if extra else None
        edited = _rewritten(src, tmp_path / "edited.gguf", "olmo2", drop=drop, extra=added)
        with pytest.raises(error, match=fragment):
            open_source(edited).load_model()


def test_a_bloom_file_of_other_shapes_is_refused_naming_the_tensor(tmp_path):
    """BLOOM's fused q/k/v is regrouped by heads: a file whose matrices are not BLOOM's shapes
    (any layer's), or that lacks the embeddings' norm, fails in the header check."""
    from export.errors import CorruptSourceError
    from export.source import open_source

    src = write_llama_cpp_gguf(tmp_path / "bloom.gguf", "bloom")
    for drop, extra, fragment in (
        (None, {"blk.1.attn_qkv.weight": np.ones((128, 64), np.float32)}, r"blk\.1\.attn_qkv\.weight is \[64, 128\]"),
        (None, {"blk.1.attn_output.weight": np.ones((64, 32), np.float32)}, r"blk\.1\.attn_output\.weight is"),
        ("token_embd_norm.weight", None, "token_embd_norm.weight is missing"),
    ):
        edited = _rewritten(src, tmp_path / "edited.gguf", "bloom", drop=drop, extra=extra)
        with pytest.raises(CorruptSourceError, match=fragment):
            open_source(edited)


def test_an_mpt_file_of_other_shapes_or_more_tensors_is_refused_naming_them(tmp_path):
    """transformers' MPT has q, k, v of every head in one matrix, one KV head a head, and no
    biases, q/k norms or position table (llama.cpp's MPT graph takes them where a file has them):
    a file with any of those, or a matrix of another shape in any layer, fails in the header check."""
    from export.errors import CorruptSourceError, UnsupportedModelError
    from export.source import open_source

    src = write_llama_cpp_gguf(tmp_path / "mpt.gguf", "mpt")
    ones, matrix = np.ones(96, np.float32), np.ones((192, 96), np.float32)
    corrupt, unsupported = CorruptSourceError, UnsupportedModelError
    for edit, error, fragment in (
        (
            {"extra": {"blk.1.attn_qkv.weight": matrix}},
            corrupt,
            r"blk\.1\.attn_qkv\.weight is \[96, 192\], MPT's is \[96, 288\]",
        ),
        ({"drop": "blk.1.ffn_norm.weight"}, corrupt, r"blk\.1\.ffn_norm\.weight is missing"),
        ({"extra": {"blk.0.attn_output.bias": ones}}, unsupported, r"blk\.0\.attn_output\.bias has no place in an mpt"),
        ({"extra": {"blk.1.attn_q_norm.weight": ones}}, unsupported, r"blk\.1\.attn_q_norm\.weight has no place"),
        ({"extra": {"position_embd.weight": matrix}}, unsupported, r"position_embd\.weight has no place"),
        ({"keys": {"mpt.attention.head_count_kv": 2}}, unsupported, "a KV head per head"),
        ({"keys": {"mpt.attention.max_alibi_bias": None}}, corrupt, "max_alibi_bias = None"),
    ):
        edited = _rewritten(src, tmp_path / "edited.gguf", "mpt", **edit)
        with pytest.raises(error, match=fragment):
            open_source(edited)


def test_an_mpt_file_clamps_qkv_by_its_clamp_kqv(tmp_path):
    """The tiny checkpoint's `clip_qkv` (0.3) clamps: its file, read with `attention.clamp_kqv`,
    is the checkpoint bit for bit; without the key (llama.cpp: no clamp) another model."""
    import torch
    from transformers import AutoModelForCausalLM

    from export.source import open_source

    src = write_llama_cpp_gguf(tmp_path / "mpt.gguf", "mpt")
    original = AutoModelForCausalLM.from_pretrained(tmp_path / "mpt-hf", attn_implementation="eager").eval()
    unclamped = _rewritten(src, tmp_path / "unclamped.gguf", "mpt", keys={"mpt.attention.clamp_kqv": None})
    ids = torch.tensor([list(range(5, 37))])
    with torch.no_grad():
        want = original(ids).logits
        assert torch.equal(open_source(src).load_model()(ids).logits, want)
        loaded = open_source(unclamped).load_model()
        assert loaded.config.attn_config.clip_qkv is None
        assert (loaded(ids).logits - want).abs().max() > 1e-2


@pytest.mark.parametrize("family", ["bloom", "mpt"])
def test_a_file_with_its_embedding_again_as_output_loads_an_untied_head(tmp_path, family):
    """Older llama.cpp converters wrote BLOOM's and MPT's embedding again as `output`: read as an
    untied LM head holding the same values, the model computes what the checkpoint's does."""
    import torch
    from transformers import AutoModelForCausalLM

    from export.source import open_source

    src = write_llama_cpp_gguf(tmp_path / f"{family}.gguf", family)
    original = AutoModelForCausalLM.from_pretrained(tmp_path / f"{family}-hf", attn_implementation="eager").eval()
    embedding = original.get_input_embeddings().weight.detach().numpy()
    edited = _rewritten(src, tmp_path / "edited.gguf", family, extra={"output.weight": embedding})
    loaded = open_source(edited).load_model()
    assert loaded.config.tie_word_embeddings is False
    assert loaded.config.num_hidden_layers == original.config.num_hidden_layers
    head = loaded.get_output_embeddings().weight
    assert head is not loaded.get_input_embeddings().weight and torch.equal(head, torch.from_numpy(embedding))
    ids = torch.tensor([list(range(5, 37))])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, original(ids).logits)


def test_a_phi2_file_of_the_original_layout_splits_its_fused_qkv(tmp_path):
    """Phi-2 files converted from Microsoft's original layout hold q, k, v in one `attn_qkv`."""
    import torch
    from transformers import AutoModelForCausalLM

    from export.source import open_source

    src = write_llama_cpp_gguf(tmp_path / "phi.gguf", "phi", quantized=True, fused_qkv=True)
    original = AutoModelForCausalLM.from_pretrained(tmp_path / "phi-hf", attn_implementation="eager").eval()
    loaded = open_source(src).load_model()
    ids = torch.tensor([list(range(5, 37))])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, original(ids).logits)


@pytest.mark.parametrize("family", ["bloom", "mpt"])
def test_an_f16_file_loads_the_checkpoint_of_its_rounded_weights(tmp_path, family):
    """`--outtype f16`: the converter writes the matrices as F16 and the norms and biases as F32;
    read back, the model is the checkpoint's with its matrices rounded to float16, bit for bit."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    from export.source import open_source

    src = write_llama_cpp_gguf(tmp_path / f"{family}.gguf", family)
    matrices = {
        t.name: np.array(t.data).astype(np.float16) for t in gguf.GGUFReader(str(src)).tensors if t.data.ndim == 2
    }
    edited = _rewritten(src, tmp_path / "f16.gguf", family, extra=matrices)
    assert {t.tensor_type.name for t in gguf.GGUFReader(str(edited)).tensors if t.name in matrices} == {"F16"}
    original = AutoModelForCausalLM.from_pretrained(tmp_path / f"{family}-hf", attn_implementation="eager").eval()
    with torch.no_grad():
        for param in original.parameters():
            if param.ndim == 2:
                param.copy_(param.half().float())
    loaded = open_source(edited).load_model()
    ids = torch.tensor([list(range(5, 37))])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, original(ids).logits)
