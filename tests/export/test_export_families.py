"""The families past Llama / Mistral / Qwen2, each exact to PyTorch: Qwen3 (per-head q/k norms,
head_dim apart from hidden / heads), Phi-3 and Phi-4-mini (fused qkv and gate/up, partial rotary,
LongRoPE), SmolLM3 (layers without rotary), Gemma 2 (soft-capping, sandwich norms, GeGLU, a
sliding window on every other layer) and Gemma 3 (q/k norms, a local rotary base for its sliding
layers, a scaled global one), with windows of 8 positions, far shorter than prompt + answer, and
Llama 3's rope scaling beside them, and the options that change a family's blocks (OPT-350M's
projected embeddings and post-norm layers, the q/k LayerNorms of StableLM, Phi-2 and Cohere,
Falcon-40B's grouped q/k/v and Falcon 2's single norm), Cohere 2 and the ALiBi models (BLOOM,
both ways of taking its residuals; MPT; Falcon-RW) on 3 layers of hidden 96 over 6 heads (2 KV
heads). Each is a tiny random checkpoint built here from a transformers config (seeded, no download), exported with
its int8 quantized copy as the draft, then:

- its logits over 48 positions (prefill, a decode, a rejected verify, chunks on the cache) equal
  PyTorch's, and differ from those of the same weights *without* each of the family's
  differences (so the tiny model is sensitive to what the graph must get right: a graph that
  ignored it would fail);
- greedy decoding through the Engine, ``ar`` and ``spec`` (the q8 draft, n-gram lookup), equals
  PyTorch's greedy tokens over a prompt and answer of 48 positions.

A windowed family (and an ALiBi one) also runs packed batches of concurrent requests,
prefix-cache hits past the window, and verifies chains only (no trees: see
``specdec_rt.ort.model``); BLOOM decodes exactly with an int4 draft too.

Then the refusals: Gemma 1 (not yet), mixture-of-experts, multimodal and state-space families fail
before any work with one line naming the family and the supported ones."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_models import build_tiny_checkpoint  # noqa: E402

from export.errors import UnsupportedModelError  # noqa: E402
from export.manifest import read_manifest  # noqa: E402
from export.model_spec import SUPPORTED_FAMILIES, ModelSpec  # noqa: E402
from export.pipeline import Request, run  # noqa: E402
from export.ui import Reporter  # noqa: E402
from export.validate import KVSession  # noqa: E402

pytestmark = pytest.mark.export

VOCAB = 384
POSITIONS = 48  # prompt + answer: past the 16 / 32 positions of small rotary periods
ATOL = 1e-4  # float32 graph against float32 PyTorch (the tiny models' logits are ~1-4)
_LONGROPE = {
    "type": "longrope",
    "short_factor": [1.0 + 0.05 * i for i in range(24)],
    "long_factor": [2.0 + 0.5 * i for i in range(24)],
}

WINDOW = 8  # the Gemma cases' sliding window: prompt + answer run 6 windows past it
WIDE = 128  # a window as long as the context
SIX_HEADS = dict(layers=3, hidden=96, heads=6, kv_heads=2, intermediate=192)  # head 16
# name: (family, build options, what differs from Llama: a config change or a module swap that
# undoes it in PyTorch, for the sensitivity check; a tuple of them: each must matter)
CASES = {
    "qwen3": ("qwen3", dict(head_dim=32), "qk_norm"),  # head 32 != hidden 64 / 4 heads
    "qwen3-head24": ("qwen3", dict(head_dim=24, kv_heads=1), "qk_norm"),  # padded to 32 after the norm
    "phi3": ("phi3", dict(), {"partial_rotary_factor": 1.0}),  # head 16, 12 rotated: padded
    "phi4-mini": (
        "phi3",
        dict(
            hidden=128, heads=2, kv_heads=1, rope_scaling=_LONGROPE, original_max_position_embeddings=128
        ),  # head 64, 48 rotated
        {"partial_rotary_factor": 1.0, "rope_scaling": None},
    ),
    "smollm3": (
        "smollm3",
        dict(layers=4, no_rope_layers=[1, 1, 1, 0]),  # as released: every 4th
        {"no_rope_layers": [1, 1, 1, 1]},
    ),
    "llama3": (
        "llama",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        ),
        {"rope_scaling": None},
    ),
    "gemma2": (
        "gemma2",
        dict(window=WINDOW, attn_logit_softcapping=1.0, final_logit_softcapping=3.0),  # caps that matter here
        (
            {"sliding_window": 4096},
            {"attn_logit_softcapping": None},
            {"final_logit_softcapping": None},
            {"query_pre_attn_scalar": 16},  # 1 / sqrt(head_dim)
        ),
    ),
    "gemma3": (
        "gemma3_text",
        dict(
            window=WINDOW,
            layers=3,  # local, local, global
            rope_scaling={"rope_type": "linear", "factor": 8.0},  # the global layers' (as in 4B+)
        ),
        ({"sliding_window": 4096}, {"rope_local_base_freq": 1e6}, {"rope_scaling": None}, "qk_norm"),
    ),
    # a window that covers the whole exported context (the released 270M's 512 at <= 512 positions):
    # no layer is masked, yet the sliding layers still turn by rope_local_base_freq (the global
    # rope_theta, 1e6, in the undo: what the graph gave them before the fix)
    "gemma3-wide-window": (
        "gemma3_text",
        dict(window=WIDE, max_positions=WIDE, layers=3, rope_scaling={"rope_type": "linear", "factor": 8.0}),
        ({"rope_local_base_freq": 1e6}, {"rope_scaling": None}, "qk_norm"),
    ),
    # the families built from export.families' blocks
    "gemma": ("gemma", dict(layers=3), ("plain_norms", {"hidden_act": "relu"})),  # (1 + w) norms, x sqrt(H), GeGLU
    "granite": (
        "granite",
        dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=3.0),
        (
            {"embedding_multiplier": 1.0},
            {"residual_multiplier": 1.0},
            {"attention_multiplier": 0.25},
            {"logits_scaling": 1.0},
        ),
    ),
    "olmo2": ("olmo2", dict(layers=3), "qk_norm"),  # norms after attention and the MLP only, q/k norms over all heads
    "stablelm": (  # LayerNorm, partial rotary, q/k/v biases
        "stablelm",
        dict(partial_rotary_factor=0.5, use_qkv_bias=True),
        {"partial_rotary_factor": 1.0},
    ),
    "stablelm-parallel": (  # attention and the MLP read the same norm
        "stablelm",
        dict(partial_rotary_factor=0.25, use_parallel_residual=True),
        {"partial_rotary_factor": 1.0},
    ),
    "phi": (  # Phi-2: parallel attention / MLP on one LayerNorm, partial rotary, biases, gelu_new
        "phi",
        dict(partial_rotary_factor=0.5, hidden_act="gelu_new"),
        ({"partial_rotary_factor": 1.0}, {"hidden_act": "relu"}),
    ),
    "starcoder2": (  # LayerNorm with bias, biases everywhere, the tanh GELU, a sliding window
        "starcoder2",
        dict(window=WINDOW, layers=3),
        ({"sliding_window": 4096}, {"hidden_act": "relu"}),
    ),
    "gpt_neox": (  # q/k/v fused per head, parallel residual with two norms, rotary_pct
        "gpt_neox",
        dict(kv_heads=4, rotary_pct=0.5),
        ({"rotary_pct": 1.0, "partial_rotary_factor": 1.0}, {"use_parallel_residual": False}),
    ),
    "nemotron": (  # LayerNorm1P, relu^2, partial rotary, biases
        "nemotron",
        dict(partial_rotary_factor=0.5, attention_bias=True, mlp_bias=True),
        ("plain_norms", {"partial_rotary_factor": 1.0}, {"hidden_act": "relu"}),
    ),
    "gpt_bigcode": (  # learned absolute positions, multi-query attention, LayerNorm, biases
        "gpt_bigcode",
        dict(multi_query=True, activation_function="gelu_pytorch_tanh"),
        ("positions", {"activation_function": "relu"}),
    ),
    "gpt_bigcode-mha": ("gpt_bigcode", dict(multi_query=False), "positions"),  # q, k, v per head
    "opt": ("opt", dict(activation_function="relu"), ("positions", {"activation_function": "gelu"})),
    "gptj": (  # interleaved partial rotary (8 of 16), parallel attention / MLP, LM head bias
        "gptj",
        dict(rotary_dim=8, activation_function="gelu_new"),
        ({"rotary_dim": 16}, {"activation_function": "relu"}),
    ),
    "falcon": (  # Falcon-7B's layout: multi-query, parallel attention / MLP on one LayerNorm
        "falcon",
        dict(multi_query=True, parallel_attn=True, bias=False),
        ({"activation": "relu"},),
    ),
    "falcon-mha": (  # q, k, v per head, sequential layers with biases
        "falcon",
        dict(multi_query=False, parallel_attn=False, bias=True),
        ({"activation": "relu"},),
    ),
    "gpt2": ("gpt2", dict(activation_function="gelu_new"), ("positions", {"activation_function": "relu"})),
    "cohere": (  # LayerNorm without bias, parallel attention / MLP, interleaved rotary, logit_scale
        "cohere",
        dict(logit_scale=0.5),
        ({"logit_scale": 1.0}, "halves_rotary"),
    ),
    "olmo": ("olmo", dict(clip_qkv=0.3), ({"clip_qkv": None},)),  # LayerNorm without weights, q/k/v clamped
    "glm": (  # interleaved partial rotary (8 of 16), fused gate_up_proj, q/k/v biases
        "glm",
        dict(partial_rotary_factor=0.5, attention_bias=True),
        ({"partial_rotary_factor": 1.0},),
    ),
    "glm4": (  # GLM's attention, Gemma 2's sandwich of norms
        "glm4",
        dict(partial_rotary_factor=0.5, attention_bias=True),
        ({"partial_rotary_factor": 1.0},),
    ),
    "olmo3": (  # OLMo 2's layout, windows on layer_types' sliding layers, which turn unscaled
        "olmo3",
        dict(
            window=WINDOW,
            layers=3,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_scaling={"rope_type": "linear", "factor": 8.0},
        ),
        ({"sliding_window": 4096}, {"rope_scaling": None}, "qk_norm"),
    ),
    "exaone4": (  # norms after attention and the MLP, per-head q/k norms, windows, no rotary on global layers
        "exaone4",
        dict(window=WINDOW, layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
        ({"sliding_window": 4096}, "qk_norm"),
    ),
    "arcee": ("arcee", dict(hidden_act="relu2"), ({"hidden_act": "relu"},)),
    "seed_oss": ("seed_oss", dict(attention_bias=True, attention_out_bias=True), ({"rope_theta": 10.0},)),
    "helium": ("helium", dict(attention_bias=True), ("halves_rotary",)),
    "ministral": (  # windows on the layers layer_types marks
        "ministral",
        dict(window=WINDOW, layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
        ({"sliding_window": 4096},),
    ),
    # the variants of 3 layers, hidden 96 over 6 heads (2 KV heads where the family has them)
    "ernie4_5": (  # GLM's interleaved rotary, biases on every projection, heads of 24 (padded to 32)
        "ernie4_5",
        dict(SIX_HEADS, head_dim=24, use_bias=True),
        ("halves_rotary", {"use_bias": False}),
    ),
    "opt-350m": (  # embeddings of 48 projected in and out, each layer's norms after its adds
        "opt",
        dict(SIX_HEADS, kv_heads=6, word_embed_proj_dim=48, do_layer_norm_before=False),
        ("positions", {"do_layer_norm_before": True}),
    ),
    "stablelm-qk-layernorm": (  # a LayerNorm of each q and k head, one a head; partial rotary: padded heads
        "stablelm",
        dict(SIX_HEADS, partial_rotary_factor=0.25, qk_layernorm=True, use_parallel_residual=True),
        ({"qk_layernorm": False}, {"partial_rotary_factor": 1.0}),
    ),
    "phi-qk-layernorm": (  # one LayerNorm (weight, bias) shared by the q heads, one by the k heads
        "phi",
        dict(SIX_HEADS, partial_rotary_factor=0.5, qk_layernorm=True),
        ({"qk_layernorm": False}, {"partial_rotary_factor": 1.0}),
    ),
    "cohere-qk-norm": (  # Command R+: a LayerNorm of each q and k head, one a head
        "cohere",
        dict(SIX_HEADS, use_qk_norm=True, logit_scale=0.5),
        ({"use_qk_norm": False}, "halves_rotary"),
    ),
    "falcon-40b": (  # new_decoder_architecture: grouped q/k/v, ln_attn and ln_mlp
        "falcon",
        dict(SIX_HEADS, new_decoder_architecture=True, num_kv_heads=2, parallel_attn=True, bias=False),
        ({"num_ln_in_parallel_attn": 1}, {"activation": "relu"}),
    ),
    "falcon2": (  # new_decoder_architecture with one LayerNorm (num_ln_in_parallel_attn 1), biases
        "falcon",
        dict(SIX_HEADS, new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1, bias=True),
        ({"activation": "relu"},),
    ),
    "cohere2": (  # windows on layer_types' sliding layers, the only ones that turn
        "cohere2",
        dict(
            SIX_HEADS,
            window=WINDOW,
            logit_scale=0.5,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        ),
        ({"sliding_window": 4096}, "halves_rotary", {"logit_scale": 1.0}),
    ),
    # ALiBi (6 heads: the slopes of a head count that is not a power of 2), the embeddings'
    # LayerNorm, q/k/v per head, biases, the tanh GELU; the residuals after the norms or before
    "bloom": (
        "bloom",
        dict(SIX_HEADS),
        ("no_alibi", "no_embed_norm", {"apply_residual_connection_post_layernorm": True}),
    ),
    "bloom-normed-residual": (
        "bloom",
        dict(SIX_HEADS, apply_residual_connection_post_layernorm=True),
        ("no_alibi", {"apply_residual_connection_post_layernorm": False}),
    ),
    # Falcon-RW: BLOOM's ALiBi rounded to bfloat16 and added before the scale, q, k, v per head, biases
    "falcon-rw": (
        "falcon",
        dict(SIX_HEADS, multi_query=False, parallel_attn=False, bias=True, alibi=True),
        ("no_alibi", {"activation": "relu"}),
    ),
    # ALiBi by the distance back to the key, q/k/v rows clamped, its own softmax_scale, LayerNorms
    # without bias, the exact GELU, no biases
    "mpt": (
        "mpt",
        dict(SIX_HEADS, attn_config={"clip_qkv": 0.3, "softmax_scale": 0.2}),
        ("no_alibi", "no_clip", "default_scale"),
    ),
    # mixtures of experts: 4 experts, top 2 (tests/tiny_models.py), routed per position
    "mixtral": ("mixtral", dict(layers=3), ({"num_experts_per_tok": 1},)),  # renormalised over the top k
    "qwen2_moe": (  # a shared expert behind a sigmoid gate; layer 1 a dense MLP (mlp_only_layers)
        "qwen2_moe",
        dict(layers=3, shared_expert_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[1]),
        ({"norm_topk_prob": False}, {"num_experts_per_tok": 1}, "no_shared_expert"),
    ),
    "qwen3_moe": (  # experts on every other layer (decoder_sparse_step 2), per-head q/k norms
        "qwen3_moe",
        dict(layers=3, head_dim=16, norm_topk_prob=True, decoder_sparse_step=2),
        ({"norm_topk_prob": False}, {"num_experts_per_tok": 1}, "qk_norm"),
    ),
    "qwen3_moe-unnormed": (  # the top k weights as the softmax left them (the default)
        "qwen3_moe",
        dict(layers=3, head_dim=16, norm_topk_prob=False),
        ({"norm_topk_prob": True},),
    ),
    "olmoe": ("olmoe", dict(layers=3, norm_topk_prob=True), ({"norm_topk_prob": False}, "qk_norm")),
    "granitemoe": (  # softmax over the top k logits, Granite's multipliers
        "granitemoe",
        dict(layers=3, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=3.0),
        ({"num_experts_per_tok": 1}, {"residual_multiplier": 1.0}, {"logits_scaling": 1.0}),
    ),
    # experts picked by softmax + a correction bias, with biases (use_bias: the LM head's too),
    # 2 ungated shared experts (one MLP of 2 x 64), layer 0 a dense MLP (moe_layer_start_index 1)
    "ernie4_5_moe": (
        "ernie4_5_moe",
        dict(SIX_HEADS, use_bias=True),
        ("no_correction_bias", "no_shared_expert", {"num_experts_per_tok": 1}, {"use_bias": False}),
    ),
    # attention sinks, biases, windows on every other layer, experts with biases and the clamped
    # SwiGLU (their gate / up weights x 10 so that the clamp at 7 binds)
    "gpt_oss": (
        "gpt_oss",
        dict(layers=3, head_dim=16, window=WINDOW),
        ({"sliding_window": 4096}, "no_sinks", "no_swiglu_limit", {"num_experts_per_tok": 1}),
    ),
    # DeepSeek-V3: latent attention (q through q_lora_rank 48, kv through kv_lora_rank 32; of each
    # of 6 heads 8 rotary, 16 unrotated, a value of 12), 4 experts in 2 groups of which 1 is kept,
    # top 2 by biased sigmoid scores, x 2.5, a shared expert, layer 0 dense (tests/tiny_models.py)
    "deepseek_v3": (
        "deepseek_v3",
        dict(SIX_HEADS, kv_heads=6),
        (
            {"rope_interleave": False},
            {"topk_group": 2},
            {"routed_scaling_factor": 1.0},
            "no_score_bias",
            "no_shared_expert",
        ),
    ),
    "deepseek_v3-q-proj": (  # a plain q_proj, halves rotary, the top k unnormed, YaRN's mscale, biases
        "deepseek_v3",
        dict(
            SIX_HEADS,
            kv_heads=6,
            q_lora_rank=None,
            rope_interleave=False,
            norm_topk_prob=False,
            attention_bias=True,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        ),
        ({"rope_interleave": True}, {"norm_topk_prob": True}, {"rope_scaling": None}),
    ),
}
_EXPORTS: dict[str, tuple[Path, Path]] = {}


def _alibi(case: str) -> bool:
    """Whether a case's model has ALiBi position biases (BLOOM, MPT, Falcon-RW)."""
    family, options, _ = CASES[case]
    return family in ("bloom", "mpt") or bool(options.get("alibi"))


def _scale_experts(ckpt: Path) -> None:
    """GPT-OSS's experts' gate and up weights x 10 (so the SwiGLU's clamp binds), saved back."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(10.0)
    model.save_pretrained(ckpt)


def _bias_router(ckpt: Path) -> None:
    """DeepSeek's routers' e_score_correction_bias (0 as built) set at random, saved back."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                bias = layer.mlp.gate.e_score_correction_bias
                bias.copy_(torch.randn(bias.shape, generator=generator) * 0.1)
    model.save_pretrained(ckpt)


# a case's checkpoint changed after it is built
_TWEAKS = {"gpt_oss": _scale_experts, "deepseek_v3": _bias_router, "deepseek_v3-q-proj": _bias_router}


@contextlib.contextmanager
def _buildable(family: str):
    """transformers 4.57 cannot build StableLM with ``qk_layernorm`` from a config (its weight
    init zeroes the bias of LayerNorms that have none); loading a saved one works. Inside, that
    init leaves a bias-less LayerNorm's bias alone."""
    if family != "stablelm":
        yield
        return
    from transformers.models.stablelm import modeling_stablelm

    cls = modeling_stablelm.StableLmPreTrainedModel
    saved = cls._init_weights

    def init(self, module):
        if getattr(module, "bias", 0) is None and hasattr(module, "normalized_shape"):
            module.weight.data.fill_(1.0)
        else:
            saved(self, module)

    cls._init_weights = init
    try:
        yield
    finally:
        cls._init_weights = saved


def _export(case: str, tmp_path_factory) -> tuple[Path, Path]:
    """(export folder with its q8 draft, checkpoint folder) of ``case``, built once a module."""
    if case not in _EXPORTS:
        family, options, _ = CASES[case]
        tmp = tmp_path_factory.mktemp(case)
        with _buildable(family):
            ckpt = build_tiny_checkpoint(tmp / "ckpt", family, seed=7, vocab=VOCAB, **options)
        if case in _TWEAKS:
            _TWEAKS[case](ckpt)
        out = tmp / "onnx"
        run(Request(src=str(ckpt), out=out, draft_quant="int8", threads=1), Reporter(quiet=True))
        _EXPORTS[case] = out, ckpt
    return _EXPORTS[case]


@pytest.fixture(scope="module", params=list(CASES))
def exported(request, tmp_path_factory) -> tuple[str, Path, Path]:
    """(case, export folder with its q8 draft, checkpoint folder)."""
    return (request.param, *_export(request.param, tmp_path_factory))


def _model(ckpt: Path, **config):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(ckpt)
    for key, value in config.items():
        setattr(cfg, key, value)
    # eager: transformers' SDPA path leaves out Gemma 2's attention soft-capping; but Falcon-RW's
    # eager path adds ALiBi twice (its causal mask carries it too): SDPA adds it once, as trained
    attn = "sdpa" if cfg.model_type == "falcon" and getattr(cfg, "alibi", False) else "eager"
    return AutoModelForCausalLM.from_pretrained(ckpt, config=cfg, dtype=torch.float32, attn_implementation=attn).eval()


def _logits(model, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(ids[None])).logits[0].numpy()  # [T, V]


def _graph_logits(folder: Path, ids: np.ndarray) -> np.ndarray:
    """The graph's logits at every position, in the runtime's call pattern: a prefill of 20,
    a decode, a rejected verify of 5 random tokens (garbage in the cache), then chunks of 9
    and 18 from the rollback point."""
    sess = KVSession(folder, read_manifest(folder), max_len=POSITIONS)
    try:
        got = [sess.forward(ids[:20], 0, rows=range(20)), sess.forward(ids[20:21], 20)]
        sess.forward(np.random.default_rng(1).integers(0, VOCAB, 5), 21, rows=range(5))
        got += [sess.forward(ids[21:30], 21, rows=range(9)), sess.forward(ids[30:], 30, rows=range(18))]
    finally:
        sess.close()
    return np.concatenate(got)


def test_manifest_and_validation(exported):
    case, folder, _ = exported
    m = read_manifest(folder)
    assert m["architecture"]["family"] == CASES[case][0]
    assert m["validation"]["greedy_agreement"] == 1.0 and m["validation"]["max_abs_logit_diff"] < ATOL
    assert m["drafts"] == [{"name": "q8", "path": "draft-q8"}]
    if case == "phi4-mini":  # LongRoPE: capped at the original length, where the short factors hold
        assert m["architecture"]["max_positions"] == 128 and m["architecture"]["head_dim"] == 64
    if case in ("phi3", "qwen3-head24"):  # heads padded: 16 = 12 rotated + 4 -> 16 + 4 -> 32; 24 -> 32
        assert m["architecture"]["head_dim"] == 32
    if case.startswith("deepseek_v3"):  # whole keys cached, one a head: 8 rotated -> 16, + 16 unrotated
        assert (m["architecture"]["head_dim"], m["architecture"]["num_kv_heads"]) == (32, 6)
    if case == "gemma3-wide-window":  # no layer masked: the manifest names no window
        assert m["architecture"]["max_positions"] == WIDE and "sliding_window" not in m["architecture"]
    elif CASES[case][1].get("window"):  # the real context, not the window
        assert m["architecture"]["max_positions"] == 512 and m["architecture"]["sliding_window"] == WINDOW
    else:
        assert "sliding_window" not in m["architecture"]
    assert m["architecture"].get("alibi", False) is _alibi(case)  # chains only


def test_logits_equal_pytorch_and_the_family_difference_matters(exported):
    import torch

    case, folder, ckpt = exported
    ids = np.random.default_rng(5).integers(0, VOCAB, POSITIONS)
    got = _graph_logits(folder, ids)
    ref = _logits(_model(ckpt), ids)
    np.testing.assert_allclose(got, ref, atol=ATOL, rtol=0)
    undos = CASES[case][2]  # the same weights without (each of) the family's difference(s)
    for undo in undos if isinstance(undos, tuple) else (undos,):
        if undo == "qk_norm":
            other = _model(ckpt)
            for layer in other.model.layers:
                layer.self_attn.q_norm = layer.self_attn.k_norm = torch.nn.Identity()
        elif undo == "positions":  # every position embedded as the first one
            other = _model(ckpt)
            with torch.no_grad():
                table = other.transformer.wpe if hasattr(other, "transformer") else other.model.decoder.embed_positions
                table.weight.copy_(table.weight[:1].expand_as(table.weight))
        elif undo == "halves_rotary":  # the family's interleaved rotary as Llama's: halves
            import importlib

            from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

            family = CASES[case][0]
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")

            def halves(q, k, cos, sin, *args, **kwargs):
                if torch.equal(cos[..., ::2], cos[..., 1::2]):  # Cohere's tables: each angle twice
                    cos, sin = torch.cat([cos[..., ::2]] * 2, -1), torch.cat([sin[..., ::2]] * 2, -1)
                return apply_rotary_pos_emb(q, k, cos, sin)

            saved = module.apply_rotary_pos_emb
            module.apply_rotary_pos_emb = halves
            try:
                halves_logits = _logits(_model(ckpt), ids)
            finally:
                module.apply_rotary_pos_emb = saved
            assert np.abs(got - halves_logits).max() > 100 * ATOL, f"{case}: {undo} changes nothing here"
            continue
        elif undo == "no_alibi":  # BLOOM, MPT or Falcon-RW without its position biases
            import importlib

            family = CASES[case][0]
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
            name = "build_mpt_alibi_tensor" if family == "mpt" else "build_alibi_tensor"
            build = getattr(module, name)
            setattr(module, name, lambda *args, **kw: torch.zeros_like(build(*args, **kw)))
            try:
                plain = _logits(_model(ckpt), ids)
            finally:
                setattr(module, name, build)
            assert np.abs(got - plain).max() > 100 * ATOL, f"{case}: {undo} changes nothing here"
            continue
        elif undo in ("no_clip", "default_scale"):  # MPT's q/k/v unclamped, or scaled by 1 / sqrt(head)
            other = _model(ckpt)
            for block in other.transformer.blocks:
                if undo == "no_clip":
                    block.attn.clip_qkv = None
                else:
                    block.attn.softmax_scale = block.attn.head_dim**-0.5
        elif undo == "no_embed_norm":  # BLOOM's embeddings used as they are
            other = _model(ckpt)
            other.transformer.word_embeddings_layernorm = torch.nn.Identity()
        elif undo == "no_sinks":  # GPT-OSS's attention sinks at -inf: nothing joins the softmax
            other = _model(ckpt)
            with torch.no_grad():
                for layer in other.model.layers:
                    layer.self_attn.sinks.fill_(-1e9)
        elif undo == "no_swiglu_limit":  # GPT-OSS's experts unclamped
            other = _model(ckpt)
            for layer in other.model.layers:
                layer.mlp.experts.limit = float("inf")
        elif undo == "no_shared_expert":  # Qwen2-MoE's shared expert (DeepSeek's, ERNIE 4.5's shared experts) left out
            other = _model(ckpt)
            with torch.no_grad():
                for layer in other.model.layers:
                    shared = getattr(layer.mlp, "shared_expert", None) or getattr(layer.mlp, "shared_experts", None)
                    if shared is not None:
                        shared.down_proj.weight.zero_()
                        if shared.down_proj.bias is not None:
                            shared.down_proj.bias.zero_()
        elif undo == "no_score_bias":  # DeepSeek's routers chose by the scores alone
            other = _model(ckpt)
            with torch.no_grad():
                for layer in other.model.layers:
                    if hasattr(layer.mlp, "gate"):
                        layer.mlp.gate.e_score_correction_bias.zero_()
        elif undo == "no_correction_bias":  # ERNIE 4.5's experts picked by their probabilities alone
            other = _model(ckpt)
            with torch.no_grad():
                for layer in other.model.layers:
                    if hasattr(layer.mlp, "moe_statics"):
                        layer.mlp.moe_statics.e_score_correction_bias.zero_()
        elif undo == "plain_norms":  # Gemma's and Nemotron's norms as w, not 1 + w
            other = _model(ckpt)
            with torch.no_grad():
                for name, param in other.named_parameters():
                    if "norm" in name and name.endswith("weight"):
                        param.sub_(1.0)
        else:
            other = _model(ckpt, **undo)
        assert np.abs(got - _logits(other, ids)).max() > 100 * ATOL, f"{case}: {undo} changes nothing here"


def test_engine_greedy_equals_pytorch_ar_and_spec(exported):
    from specdec_rt import Engine

    case, folder, ckpt = exported
    model = _model(ckpt)
    prompt = [int(t) for t in np.random.default_rng(11).integers(3, VOCAB, 16)]
    seq = list(prompt)
    while len(seq) < POSITIONS:  # PyTorch greedy, every step from scratch (no cache to share a bug)
        seq.append(int(_logits(model, np.array(seq))[-1].argmax()))
    want = seq[len(prompt) :]
    n = len(want)

    async def main():
        got = {}
        for draft in ("q8", "ngram"):
            async with await Engine.load(folder, draft=draft, warmup=False) as engine:
                for mode in ("ar", "spec"):
                    result = await engine.generate(prompt, max_new_tokens=n, mode=mode, ignore_eos=True)
                    got[draft, mode] = result.token_ids
        return got

    for (draft, mode), tokens in asyncio.run(main()).items():
        assert tokens == want, f"{case}: {mode} with the {draft} draft left PyTorch's greedy output"


def _greedy(model, prompt: list[int], total: int) -> list[int]:
    """PyTorch's greedy continuation of ``prompt`` to ``total`` positions, every step from scratch."""
    seq = list(prompt)
    while len(seq) < total:
        seq.append(int(_logits(model, np.array(seq))[-1].argmax()))
    return seq[len(prompt) :]


@pytest.mark.parametrize(
    "case", ["gemma2", "gemma3", "starcoder2", "ministral", "gpt_oss", "cohere2", "bloom", "mpt", "falcon-rw"]
)
def test_windowed_models_batch_cache_and_verify_chains_exactly(tmp_path_factory, case):
    """Sliding windows (and ALiBi: BLOOM, MPT) in every path the runtime has: several requests at once
    (packed rows of different lengths past the window, prefill and decode and verifies batched
    together), prefix-cache hits longer than the window, and verification by chains: a tree's
    nodes would sit in the cache past their real positions, where GroupQueryAttention's window
    would cut them wrong (and ALiBi's bias by cache slot would place them wrong), so such a model
    has no tree capability and refuses a tree call."""
    from specdec_rt import Engine
    from specdec_rt.errors import InferenceError
    from specdec_rt.ort import OrtModel

    folder, ckpt = _export(case, tmp_path_factory)
    model = _model(ckpt)
    rng = np.random.default_rng(23)
    prompts = [[int(t) for t in rng.integers(3, VOCAB, n)] for n in (5, 13, 21)]  # within, past, far past 8
    want = [_greedy(model, p, POSITIONS) for p in prompts]
    follow = prompts[2] + want[2][:12]  # its first 33 positions: a prefix-cache hit past the window
    want_follow = _greedy(model, follow, POSITIONS + 4)

    async def main():
        got = {}
        async with await Engine.load(folder, draft="q8", slots=4, warmup=False) as engine:
            for mode in ("ar", "spec"):
                results = await asyncio.gather(
                    *[
                        engine.generate(p, max_new_tokens=len(w), mode=mode, ignore_eos=True)
                        for p, w in zip(prompts, want)
                    ]
                )
                got[mode] = [r.token_ids for r in results]
            hit = await engine.generate(follow, max_new_tokens=len(want_follow), mode="spec", ignore_eos=True)
            got["follow"] = hit.token_ids, hit.stats.cached_prompt_tokens
        return got

    got = asyncio.run(main())
    assert got["ar"] == want and got["spec"] == want, case
    tokens, cached = got["follow"]
    assert tokens == want_follow and cached > WINDOW, (case, cached)

    m = OrtModel(folder, slots=1)
    try:
        alibi = _alibi(case)
        assert m.manifest.alibi is alibi and m.manifest.sliding_window == (0 if alibi else WINDOW)
        assert not m.caps.trees and m.ragged
        s = m.start()
        s.run_sync(np.array(prompts[1], dtype=np.int64), 1, 0)
        with pytest.raises(InferenceError, match="cannot verify a tree"):
            s.run_sync(np.array([5, 6, 7], dtype=np.int64), 3, len(prompts[1]), tree=np.array([-1, 0, -1]))
        s.close()
    finally:
        m.close()


def test_alibi_with_an_int4_draft_decodes_exactly(tmp_path_factory):
    """BLOOM (residuals after the norms) with its int4 copy as the draft: the draft's graph adds
    the same slopes' bias in front of MatMulNBits of 4 bits, and ``spec`` with it, several
    requests at once, gives PyTorch's greedy tokens."""
    from specdec_rt import Engine

    _, ckpt = _export("bloom-normed-residual", tmp_path_factory)
    folder = tmp_path_factory.mktemp("bloom-q4") / "onnx"
    run(Request(src=str(ckpt), out=folder, draft_quant="int4", threads=1), Reporter(quiet=True))
    m = read_manifest(folder)
    assert m["drafts"] == [{"name": "q4", "path": "draft-q4"}]
    assert read_manifest(folder / "draft-q4")["architecture"]["alibi"] is True
    model = _model(ckpt)
    rng = np.random.default_rng(29)
    prompts = [[int(t) for t in rng.integers(3, VOCAB, n)] for n in (7, 16)]
    want = [_greedy(model, p, POSITIONS) for p in prompts]

    async def main():
        async with await Engine.load(folder, draft="q4", slots=2, warmup=False) as engine:
            results = await asyncio.gather(
                *[
                    engine.generate(p, max_new_tokens=len(w), mode="spec", ignore_eos=True)
                    for p, w in zip(prompts, want)
                ]
            )
            return [r.token_ids for r in results]

    assert asyncio.run(main()) == want


def test_gemma3_window_covering_the_exported_context_keeps_the_local_rope_base(tmp_path):
    """Gemma 3 with a sliding window at least as long as the exported context (the released
    270M's 512 exported at <= 512 positions; here 128 at ``--max-positions 128``, unvalidated so
    the graph itself is checked): no layer is masked, but the sliding layers still turn by
    ``rope_local_base_freq``, not the global ``rope_theta``. Logits and greedy tokens (Engine,
    ``ar`` and ``spec``) equal PyTorch's."""
    from specdec_rt import Engine

    ckpt = build_tiny_checkpoint(tmp_path / "ckpt", "gemma3_text", seed=7, vocab=VOCAB, window=WIDE, layers=3)
    folder = tmp_path / "onnx"
    run(Request(src=str(ckpt), out=folder, max_positions=WIDE, validate=False, threads=1), Reporter(quiet=True))
    arch = read_manifest(folder)["architecture"]
    assert arch["max_positions"] == WIDE and "sliding_window" not in arch
    model = _model(ckpt)
    ids = np.random.default_rng(5).integers(0, VOCAB, POSITIONS)
    got = _graph_logits(folder, ids)
    np.testing.assert_allclose(got, _logits(model, ids), atol=ATOL, rtol=0)
    assert np.abs(got - _logits(_model(ckpt, rope_local_base_freq=1e6), ids)).max() > 100 * ATOL
    prompt = [int(t) for t in np.random.default_rng(11).integers(3, VOCAB, 16)]
    want = _greedy(model, prompt, POSITIONS)

    async def main():
        async with await Engine.load(folder, draft="ngram", warmup=False) as engine:
            return [
                (await engine.generate(prompt, max_new_tokens=len(want), mode=mode, ignore_eos=True)).token_ids
                for mode in ("ar", "spec")
            ]

    assert asyncio.run(main()) == [want, want]


@pytest.mark.parametrize("value", ["8", -1, True, 1 << 40])
def test_a_manifest_sliding_window_is_checked(tmp_path_factory, value):
    """``architecture.sliding_window`` (which turns trees off) is an integer in range, or the
    folder is refused naming it."""
    from specdec_rt.errors import ModelLoadError
    from specdec_rt.ort.manifest import check_manifest

    folder, _ = _export("gemma2", tmp_path_factory)
    raw = json.loads((folder / "manifest.json").read_text())
    assert check_manifest(folder, raw).sliding_window == WINDOW
    raw["architecture"]["sliding_window"] = value
    with pytest.raises(ModelLoadError, match="architecture.sliding_window"):
        check_manifest(folder, raw)


@pytest.mark.parametrize("value", ["true", 1, None])
def test_a_manifest_alibi_flag_is_checked(tmp_path_factory, value):
    """``architecture.alibi`` (which turns trees off) is true or false, or the folder is refused
    naming it."""
    from specdec_rt.errors import ModelLoadError
    from specdec_rt.ort.manifest import check_manifest

    folder, _ = _export("bloom", tmp_path_factory)
    raw = json.loads((folder / "manifest.json").read_text())
    assert check_manifest(folder, raw).alibi is True
    raw["architecture"]["alibi"] = value
    with pytest.raises(ModelLoadError, match="architecture.alibi"):
        check_manifest(folder, raw)


def _refused(capsys, tmp_path, config: dict, *fragments: str) -> str:
    """Export a folder holding only ``config.json``: it must fail on the config alone."""
    from export.cli import main

    src = tmp_path / str(config["model_type"])
    src.mkdir()
    (src / "config.json").write_text(json.dumps(config))
    assert main([str(src), "--out", str(tmp_path / "o")]) == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("export: error: "), captured.err
    for fragment in fragments:
        assert fragment in lines[0]
    assert not (tmp_path / "o").exists()
    return lines[0]


@pytest.mark.parametrize(
    "config,why",
    [
        ({"model_type": "gemma3n", "text_config": {}}, "Gemma 3n: not yet; multimodal"),
        (
            {"model_type": "gemma3", "vision_config": {}, "text_config": {}},
            "Gemma 3 with its vision tower: multimodal; its text model (gemma3_text) exports",
        ),
        ({"model_type": "deepseek_v2", "n_routed_experts": 8}, "mixture of experts"),
        ({"model_type": "dbrx"}, "mixture of experts"),
        ({"model_type": "llava", "vision_config": {}, "text_config": {}}, "multimodal"),
        ({"model_type": "mamba", "state_size": 16}, "state-space layers"),
        ({"model_type": "some_new_thing", "moe_intermediate_size": 64}, "mixture of experts"),
        ({"model_type": "xglm"}, None),
    ],
)
def test_unsupported_families_are_refused_before_any_work(capsys, tmp_path, config, why):
    line = _refused(
        capsys,
        tmp_path,
        config,
        f"unsupported architecture {config['model_type']}",
        "supported: llama, mistral, qwen2, qwen3, phi3, smollm3, gemma2, gemma3_text",
    )
    assert (f"({why})" in line) if why else ("(" not in line)
    assert ", ".join(SUPPORTED_FAMILIES) in line


def test_a_gemma3_gguf_without_its_numbers_fails_naming_the_key(capsys, tmp_path):
    """Gemma 3 GGUFs are read (export.gguf_families); one whose header lacks the architecture's
    numbers fails from the header, naming the first missing key."""
    import gguf

    from export.cli import main

    path = tmp_path / "tiny-gemma3.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.ones((16, 256), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert main([str(path), "--out", str(tmp_path / "o")]) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("export: error: GGUF ") and line.endswith(
        "gemma3.embedding_length = None is not an integer from 1 to 65536"
    )


@pytest.mark.parametrize(
    "family,kw,fragment",
    [
        ("phi3", {"partial_rotary_factor": 0.0}, "partial_rotary_factor 0.0"),
        ("phi3", {"partial_rotary_factor": float("nan")}, "partial_rotary_factor nan"),
        ("phi3", {"partial_rotary_factor": 0.1}, "partial_rotary_factor 0.1 of head size 16"),  # 1 dimension
        ("smollm3", {"no_rope_layers": [1]}, "unsupported no_rope_layers [1]"),  # 2 layers
        ("smollm3", {"no_rope_layers": [1, 2]}, "unsupported no_rope_layers [1, 2]"),
        ("gemma2", {"hidden_activation": "silu"}, "unsupported activation silu; need gelu_pytorch_tanh"),
        ("gemma2", {"final_logit_softcapping": float("nan")}, "unsupported final_logit_softcapping nan"),
        ("gemma2", {"attn_logit_softcapping": -1.0}, "unsupported attn_logit_softcapping -1.0"),
        ("gemma2", {"query_pre_attn_scalar": 0}, "unsupported query_pre_attn_scalar 0"),
        ("gemma2", {"layer_types": ["sliding_attention"]}, "unsupported layer_types ['sliding_attention']"),
        ("gemma3_text", {"use_bidirectional_attention": True}, "unsupported option use_bidirectional_attention"),
        ("gemma3_text", {"rope_local_base_freq": 0.0}, "unsupported rope_local_base_freq 0.0"),
        (  # transformers builds ln_attn / ln_mlp only for parallel layers
            "falcon",
            {"new_decoder_architecture": True, "parallel_attn": False},
            "unsupported option parallel_attn=False: need true",
        ),
        ("opt", {"layer_norm_elementwise_affine": False}, "unsupported option layer_norm_elementwise_affine=False"),
        ("opt", {"word_embed_proj_dim": 0}, "unsupported word_embed_proj_dim 0"),
        ("gpt_neox", {"rotary_pct": 0.01}, "unsupported rotary_pct 0.01 of head size 16"),
        ("granite", {"logits_scaling": 0.0}, "unsupported logits_scaling 0.0"),
        ("nemotron", {"hidden_act": "silu"}, "unsupported activation silu; need relu2"),
        ("mixtral", {"num_experts_per_tok": 9}, "unsupported num_experts_per_tok 9: more than the 8 experts"),
        ("mixtral", {"num_local_experts": 0}, "unsupported num_local_experts 0"),
        ("qwen2_moe", {"use_sliding_window": True}, "unsupported option use_sliding_window=True"),
        ("qwen2_moe", {"decoder_sparse_step": 0}, "unsupported decoder_sparse_step 0"),
        ("qwen3_moe", {"moe_intermediate_size": None}, "unsupported moe_intermediate_size None"),
        ("olmoe", {"clip_qkv": 8.0}, "unsupported option clip_qkv"),
        ("ernie4_5_moe", {"moe_layer_interval": 0}, "unsupported moe_layer_interval 0"),
        ("ernie4_5_moe", {"moe_num_shared_experts": None}, "unsupported moe_num_shared_experts None"),
    ],
)
def test_family_options_the_graph_cannot_express_are_refused(family, kw, fragment):
    from transformers import AutoConfig

    base = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    ModelSpec.from_config(AutoConfig.for_model(family, **base))  # the base is fine
    config = AutoConfig.for_model(family, **base)
    for key, value in kw.items():
        setattr(config, key, value)
    with pytest.raises(UnsupportedModelError) as exc:
        ModelSpec.from_config(config)
    assert fragment in str(exc.value)


@pytest.mark.parametrize(
    "family,kw,layers,nope,rotary,windows",
    [
        ("smollm3", {}, 8, (3, 7), 16, ()),  # transformers' default: no rotary every 4th layer
        ("smollm3", {"use_sliding_window": True, "sliding_window": 24}, 4, (3,), 16, (0, 0, 0, 24)),  # NoPE layer
        ("qwen3", {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 4}, 4, (), 16, ()),
        (
            "qwen3",
            {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1},
            4,
            (),
            16,
            (0,) + (24,) * 3,
        ),
        ("qwen3", {"use_sliding_window": False, "sliding_window": 24, "max_window_layers": 1}, 4, (), 16, ()),
        ("phi3", {"partial_rotary_factor": 0.5}, 2, (), 8, ()),
        ("phi3", {"sliding_window": 24}, 2, (), 16, (24, 24)),
        ("phi3", {"sliding_window": 64}, 2, (), 16, ()),  # no shorter than the context: none
        ("gemma2", {"sliding_window": 24}, 4, (), 16, (24, 0, 24, 0)),  # every other layer
        ("gemma3_text", {"sliding_window": 24}, 7, (), 16, (24,) * 5 + (0, 24)),  # 5 local : 1 global
        # a window covering the context: no mask, the local rotary base stays (spec.local_rope)
        ("gemma3_text", {"sliding_window": 64}, 7, (), 16, ()),
    ],
)
def test_spec_reads_each_family_as_transformers_does(family, kw, layers, nope, rotary, windows):
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        family,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        head_dim=16,
        **kw,
    )
    spec = ModelSpec.from_config(config)  # the whole context: windows are the layers' own
    assert (spec.nope_layers, spec.rotary, spec.max_positions, spec.windows) == (nope, rotary, 64, windows)
    assert spec.qk_norm is (family in ("qwen3", "gemma3_text"))
    assert spec.gemma is family.startswith("gemma") and spec.local_rope is (family == "gemma3_text")
    assert ("sliding_window" in spec.manifest()) is bool(windows)


@pytest.mark.parametrize(
    "family,kw",
    [
        ("qwen2_moe", {"decoder_sparse_step": 2, "mlp_only_layers": [3]}),
        ("qwen2_moe", {"decoder_sparse_step": 1, "mlp_only_layers": [0, 4]}),
        ("qwen3_moe", {"decoder_sparse_step": 3}),
        ("mixtral", {}),
        ("granitemoe", {}),
        ("gpt_oss", {}),
        ("ernie4_5_moe", {}),  # from layer 1 (moe_layer_start_index) to the last
        ("ernie4_5_moe", {"moe_layer_start_index": 0, "moe_layer_interval": 2, "moe_layer_end_index": 3}),
    ],
)
def test_spec_reads_the_sparse_layers_as_transformers_builds_them(family, kw):
    """The layers with experts are those transformers gives a router (Qwen-MoE's
    decoder_sparse_step / mlp_only_layers), and the router's numbers are the config's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        family,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        num_experts_per_tok=3,
        **kw,
    )
    model = AutoModelForCausalLM.from_config(config)
    routed = tuple(
        i for i, layer in enumerate(model.model.layers) if not hasattr(getattr(layer, "mlp", None), "up_proj")
    )
    spec = ModelSpec.from_config(config)
    assert spec.moe_layers == routed and spec.experts_per_token == 3
    assert spec.manifest()["num_experts"] == spec.num_experts > 3


@pytest.mark.parametrize("case,quantized", [("mixtral", True), ("qwen2_moe", False), ("ernie4_5_moe", True)])
def test_moe_experts_run_as_one_op_and_drafts_quantize_them(tmp_path_factory, case, quantized):
    """The experts are ONNX Runtime's MoE op in the target (routing inside: a step reads the
    active experts only) and QMoE in the int8 draft, with the MatMuls' blocks, where each
    expert's widths are whole blocks of 32 (mixtral: hidden 64, width 128); otherwise (qwen2_moe's
    width of 48) the draft keeps them in float32, still exact."""
    import onnx

    folder, _ = _export(case, tmp_path_factory)

    def ops(path: Path) -> set[str]:
        return {n.op_type for n in onnx.load(str(path / "model.onnx"), load_external_data=False).graph.node}

    target, draft = ops(folder), ops(folder / "draft-q8")
    assert "MoE" in target and "QMoE" not in target
    assert ("QMoE" in draft) is quantized and ("MoE" in draft) is not quantized
    size = (folder / "model.onnx.data").stat().st_size
    draft_size = (folder / "draft-q8" / "model.onnx.data").stat().st_size
    assert draft_size < (0.4 if quantized else 0.7) * size


@pytest.mark.parametrize(
    "family,kw,want",
    [
        (
            "falcon",
            {"new_decoder_architecture": True, "num_kv_heads": 2, "multi_query": True},
            {"num_kv_heads": 2, "layout": "parallel2", "fused_qkv": "heads"},  # multi_query ignored, as transformers
        ),
        (
            "falcon",
            {"new_decoder_architecture": True, "num_kv_heads": 2, "num_ln_in_parallel_attn": 1},
            {"num_kv_heads": 2, "layout": "parallel", "fused_qkv": "heads"},
        ),
        ("falcon", {"multi_query": True}, {"num_kv_heads": 1, "layout": "parallel", "fused_qkv": "rows"}),
        ("falcon", {"alibi": True, "parallel_attn": False}, {"alibi": "bfloat16", "layout": "pre", "rotary_dim": 0}),
        ("opt", {"do_layer_norm_before": False, "word_embed_proj_dim": 16}, {"layout": "post_ln", "embed_dim": 16}),
        ("opt", {"word_embed_proj_dim": 32}, {"layout": "pre", "embed_dim": 0}),  # as wide as hidden: no projection
        ("stablelm", {"qk_layernorm": True}, {"qk_norm": True, "qk_layer_norm": True}),
        ("stablelm", {}, {"qk_norm": False, "qk_layer_norm": False}),
        ("cohere", {"use_qk_norm": True}, {"qk_norm": True, "qk_layer_norm": True}),
        ("cohere2", {"sliding_window": 24}, {"windows": (24, 24, 24, 0), "nope_layers": (3,)}),
        (  # BLOOM's MLP is 4 x hidden whatever intermediate_size says; its GELU has no config key
            "bloom",
            {"apply_residual_connection_post_layernorm": True},
            {
                "layout": "pre_normed",
                "alibi": "absolute",
                "embed_norm": True,
                "intermediate_size": 128,
                "act": "gelu_tanh",
            },
        ),
        ("bloom", {}, {"layout": "pre", "alibi": "absolute", "num_kv_heads": 4, "fused_qkv": "heads", "rotary_dim": 0}),
        (  # MPT as transformers builds it: 4 x hidden (not expansion_ratio), its options in attn_config
            "mpt",
            {"expansion_ratio": 2, "max_seq_len": 80, "attn_config": {"clip_qkv": 6.0, "softmax_scale": 0.5}},
            {"alibi": "relative", "intermediate_size": 128, "clip_qkv": 6.0, "attn_scale": 0.5, "act": "gelu"},
        ),
        ("mpt", {}, {"alibi": "relative", "clip_qkv": 0.0, "attn_scale": 0.0, "fused_qkv": "rows", "layout": "pre"}),
    ],
)
def test_spec_reads_the_family_variants(family, kw, want):
    """A config option that changes a family's blocks selects its row's variant, as transformers
    builds the model (Falcon's new_decoder_architecture ignores multi_query; Cohere 2's global
    layers, every 4th, neither slide nor turn)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        family,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        **kw,
    )
    spec = ModelSpec.from_config(config)
    assert {key: getattr(spec, key) for key in want} == want


def _deepseek_config(**kw):
    from transformers import AutoConfig

    base = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=2,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=40,
    )
    return AutoConfig.for_model("deepseek_v3", **{**base, **kw})


def test_deepseek_spec_reads_transformers_numbers():
    """DeepSeek-V3's spec as transformers builds the model: experts from layer
    first_k_dense_replace on, attention's softmax scale (YaRN's mscale_all_dim squared), heads
    holding the padded rotary part and the unrotated one, or the value where it is wider."""
    from transformers import AutoModelForCausalLM

    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "mscale_all_dim": 0.7}
    config = _deepseek_config(rope_scaling=yarn)
    model = AutoModelForCausalLM.from_config(config)
    routed = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate"))
    spec = ModelSpec.from_config(config)
    assert spec.moe_layers == routed == (2, 3) and spec.num_experts == 8
    assert spec.attn_scale == pytest.approx(model.model.layers[0].self_attn.scaling, rel=1e-12)
    assert spec.attn_scale != pytest.approx(24**-0.5)
    assert (spec.head_dim, spec.num_kv_heads, spec.rotary) == (48, 2, 8)  # the value of 40, padded
    assert spec.latent is not None and spec.latent.interleaved and spec.latent.q_rank == 16
    assert spec.grouped is not None and (spec.grouped.groups, spec.grouped.top_groups) == (4, 2)
    assert spec.shared_expert_size == 16 and not spec.shared_gate
    assert ModelSpec.from_config(_deepseek_config(v_head_dim=8)).head_dim == 32  # 16 + 16


@pytest.mark.parametrize(
    "kw,fragment",
    [
        ({"num_key_value_heads": 1}, "unsupported num_key_value_heads 1 with latent attention"),
        ({"n_group": 3}, "unsupported n_group 3 of 8 experts"),
        ({"n_group": 8, "topk_group": 4}, "unsupported n_group 8 of 8 experts: need groups of 2 or more"),
        ({"topk_group": 5}, "unsupported topk_group 5: more than the 4 groups"),
        ({"topk_group": 1, "num_experts_per_tok": 3}, "unsupported num_experts_per_tok 3: more than the 2 experts"),
        ({"routed_scaling_factor": 0.0}, "unsupported routed_scaling_factor 0.0"),
        ({"qk_rope_head_dim": 7}, "unsupported qk_rope_head_dim 7"),
        ({"kv_lora_rank": None}, "unsupported kv_lora_rank None"),
    ],
)
def test_deepseek_options_the_graph_cannot_express_are_refused(kw, fragment):
    ModelSpec.from_config(_deepseek_config())  # the base is fine
    with pytest.raises(UnsupportedModelError) as exc:
        ModelSpec.from_config(_deepseek_config(**kw))
    assert fragment in str(exc.value)


@pytest.mark.parametrize("kw,want", [({}, 2048), ({"seq_length": 300}, 300), ({"max_position_embeddings": 96}, 96)])
def test_bloom_context_from_its_config(kw, want):
    """BLOOM's configs name no max_position_embeddings (ALiBi has no table): the context is its
    seq_length where set, else its training context of 2048; --max-positions caps it."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("bloom", vocab_size=64, hidden_size=32, n_layer=2, n_head=4, **kw)
    assert not kw or getattr(config, next(iter(kw))) == want
    assert ModelSpec.from_config(config).max_positions == want
    assert ModelSpec.from_config(config, max_positions=40).max_positions == 40
