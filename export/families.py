"""Each supported family as a declared combination of the graph's building blocks: one
``Family`` row says only where a family departs from Llama's graph (read from its transformers
4.57 modelling code); ``ModelSpec.from_config`` reads the numbers from the config, and
``export.graph`` emits the blocks. A new dense family is a new row (plus its weight names, when
they are not Llama's).

Building blocks:

- norms: RMSNorm or LayerNorm (with or without bias), weights stored as ``w - offset`` (Gemma's
  ``1 + w``: offset 1);
- layer layouts (``LAYOUTS``): ``pre`` (Llama: norm, attention, add; norm, MLP, add),
  ``post_ln`` (OPT-350M: attention, add, norm; MLP, add, norm; no final norm),
  ``sandwich`` (Gemma 2 / 3: a norm after attention's and the MLP's output too), ``post``
  (OLMo 2: no norm before attention or the MLP, one after each), ``parallel`` (Phi-2: attention
  and the MLP read the same normed input, both added to the residual), ``parallel2`` (GPT-NeoX:
  each reads its own norm of the same input), ``pre_normed`` (BLOOM's
  ``apply_residual_connection_post_layernorm``: Llama's, each residual taken after its norm);
- MLPs gated (``act(gate) * up``) or plain (``act(up)``), biases on any projection, activations
  ``ACTIVATIONS``;
- attention: q/k norms per head (Qwen3; LayerNorm: StableLM, Phi-2, Cohere) or over the whole
  projection (OLMo 2), partial rotary
  (``partial_rotary_factor`` / ``rotary_pct``), a fused q/k/v (rows q, k, v: Phi-3; per head
  q, k, v: GPT-NeoX; per group of heads sharing a KV head, its q heads, k, v: Falcon's
  ``new_decoder_architecture``), an attention scale from the config (``query_pre_attn_scalar ** -0.5``,
  Granite's ``attention_multiplier``), sliding windows (``WINDOW_RULES``);
- mixtures of experts (``moe``): a router picks each token's top k experts (``ROUTERS``), each a
  gated MLP, their outputs weighed by the router's probabilities (renormalised over the k:
  ``norm_topk``), beside a shared expert behind a sigmoid gate (Qwen2-MoE) or ungated (ERNIE
  4.5, whose router picks by the probabilities plus a correction bias), on every layer or
  those ``decoder_sparse_step`` / ``mlp_only_layers`` leave sparse, or a range of them
  (``sparse_range``; the rest a dense MLP); GPT-OSS's
  experts have biases and a clamped SwiGLU (``swiglu``), its attention sinks (``sinks``);
  DeepSeek-V3's grouped sigmoid router, ungated shared experts and first dense layers
  (``dense_first_key``);
- multi-head latent attention (``latent``: DeepSeek-V3's low-rank q and kv projections, ``export.mla``);
- multipliers: the embeddings (x sqrt(hidden): Gemma; ``embedding_multiplier``: Granite), each
  branch before its residual add (``residual_multiplier``), the logits (/ ``logits_scaling``);
- embeddings narrower than the layers, projected in and out (OPT-350M's ``word_embed_proj_dim``),
  or normed (BLOOM's ``word_embeddings_layernorm``);
- positions: rotary, learned absolute rows added to the embeddings, or ALiBi (each head's slope
  times the key's position added to its scores; such a model verifies chains only).

A config option that turns a family into another combination of blocks is a ``Variant`` of its
row (Falcon's ``new_decoder_architecture``, OPT's ``do_layer_norm_before``, StableLM's
``qk_layernorm``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

__all__ = [
    "Family",
    "Variant",
    "FAMILY_TABLE",
    "LAYOUTS",
    "POSITIONS",
    "ACTIVATIONS",
    "WINDOW_RULES",
    "ROUTERS",
    "QK_NORMS",
]

LAYOUTS = ("pre", "sandwich", "post", "parallel", "parallel2", "post_ln", "pre_normed")
# how a family places its tokens: rotary q and k, learned rows added to the embeddings, or ALiBi:
# each head's slope x the key's position (BLOOM; in bfloat16, before the scale: Falcon-RW), or x
# its distance from the query (MPT)
POSITIONS = ("rope", "learned", "alibi", "alibi_relative", "alibi_bf16")
# the norms of queries and keys before rotary: "" none; "head" RMSNorm of each head (Qwen3);
# "full" RMSNorm of the whole projection (OLMo 2); "layer" LayerNorm of each head, its weight
# (and bias) shared by the heads (Phi-2) or one a head (StableLM's, Cohere's)
QK_NORMS = ("", "head", "full", "layer")
# transformers' ACT2FN names the graph emits, by the ONNX form: silu (x * Sigmoid(x)), gelu (erf
# Gelu), gelu_tanh (Gelu approximate="tanh": gelu_new and gelu_pytorch_tanh are the same
# function), relu, relu2 (Relu(x)^2: Nemotron, Primer)
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "relu2": "relu2",
}
# how a family's config says which layers slide: "" none; "all" every layer when sliding_window
# is set; "opt_in" layer_types' sliding layers when use_sliding_window; "layer_types" always
WINDOW_RULES = ("", "all", "opt_in", "layer_types")
# how a router turns its logits into the top k experts' weights: "softmax_topk" (softmax over all
# experts, the k largest: Mixtral, Qwen2 / Qwen3-MoE, OLMoE), "topk_softmax" (the k largest
# logits, softmax over them: Granite-MoE), "sigmoid_grouped" (DeepSeek-V3: sigmoid scores, the best
# groups of experts by their biased scores, the top k of those, weighed by their scores: export.mla),
# "softmax_biased" (softmax over all experts, the k largest of the probabilities plus a per-expert
# correction bias, which picks only: the weights are the chosen probabilities, renormalised:
# ERNIE 4.5's moe_statics.e_score_correction_bias)
ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_grouped", "softmax_biased")


@dataclass(frozen=True)
class Variant:
    """The fields of a family's row that change when every config key of ``when`` has its value
    (``changes``: field name, new value)."""

    when: tuple[tuple[str, object], ...]
    changes: tuple[tuple[str, object], ...]

    def applies(self, config: object) -> bool:
        return all(getattr(config, key, None) == value for key, value in self.when)


@dataclass(frozen=True)
class Family:
    """Where a family departs from Llama's graph (the defaults are Llama's)."""

    name: str  # model_type
    norm: str = "rms"  # "rms" | "layer" (LayerNorm; its bias when the checkpoint has one)
    norm_offset: float = 0.0  # a norm multiplies by weight + offset (Gemma: 1)
    norm_weights: bool = True  # norms have a weight (OLMo 1's LayerNorm has neither weight nor bias)
    # a config key (a sub-config's: "attn_config.clip_qkv"): q, k and v clamped to +-it after their
    # projection (OLMo's clip_qkv)
    clip_key: str = ""
    eps_key: str = "rms_norm_eps"  # the config's norm epsilon
    layout: str = "pre"  # LAYOUTS
    parallel_key: str = ""  # a config flag that turns the layout to `parallel_layout` (when true)
    parallel_layout: str = "parallel"
    gated: bool = True  # the MLP: act(gate) * up, else act(up)
    acts: tuple[str, ...] = ("silu", "swish")  # the activations accepted (ACTIVATIONS keys)
    act_keys: tuple[str, ...] = ("hidden_act",)  # the config keys naming it, first set one wins
    act_default: str = ""  # the activation when no act_keys is set (BLOOM has no key: its tanh GELU)
    mlp_bias_key: str = "mlp_bias"  # a config flag for MLP biases ("*": always; "": never)
    qk_norm: str = ""  # QK_NORMS
    rotary_key: str = ""  # the config's fraction of each head that turns (partial rotary)
    rotary_dims_key: str = ""  # or the config's count of turned dimensions (GPT-J's rotary_dim; None: all)
    rotary_interleaved: bool = False  # pairs 2i, 2i + 1 turn together (GPT-J), not i, i + d / 2
    fused_qkv: str = ""  # "" | "rows" (q, k, v rows: Phi-3) | "heads" (q, k, v per head: GPT-NeoX)
    windows: str = ""  # WINDOW_RULES
    embed_scale: str = ""  # "" | "sqrt_hidden" (Gemma) | a config key (Granite: embedding_multiplier)
    attn_scale: str = ""  # "" (1 / sqrt(head)) | "query_pre_attn_scalar" (^-0.5) | a config key (the scale)
    attn_scale_default: bool = False  # attn_scale's key may be None: 1 / sqrt(head) (MPT's softmax_scale)
    residual_key: str = ""  # a config key: each branch times it before its residual add (Granite)
    logits_key: str = ""  # a config key: the logits divided by it (Granite's logits_scaling)
    logits_scale_key: str = ""  # a config key: the logits times it (Cohere's logit_scale)
    softcaps: bool = False  # Gemma 2: attn_logit_softcapping, final_logit_softcapping
    local_rope: bool = False  # sliding layers turn by their own rotary module (Gemma 3's local base, OLMo 3's)
    nope_layers: bool = False  # SmolLM3: no_rope_layers
    nope_global: bool = False  # EXAONE 4: with a sliding_window, its global layers turn not at all
    causal_key: str = ""  # a config flag that must be false (Gemma 3's use_bidirectional_attention)
    refuse: tuple[str, ...] = ()  # config flags the graph has no block for: refused when true
    require: tuple[str, ...] = ()  # config flags the graph needs true (OPT's do_layer_norm_before)
    # the checkpoint's tensor names as Llama's (substring replacements, in order)
    renames: tuple[tuple[str, str], ...] = ()
    positions: str = "rope"  # POSITIONS: "rope" | "learned" (absolute position rows added to the input) | ALiBi
    position_offset: int = 0  # learned: the table's row of position p is p + offset (OPT: 2)
    kv_key: str = "num_key_value_heads"  # the config's KV heads ("": as many as heads)
    multi_query_key: str = ""  # a config flag for one KV head (GPTBigCode; its c_attn then holds q, k, v rows)
    intermediate_key: str = "intermediate_size"  # the MLP's width (None: 4 x hidden)
    conv1d: bool = False  # the layers' weights stored [in, out] (GPT-2's Conv1D), not nn.Linear's [out, in]
    # mixture of experts: the config key of the expert count ("": a dense model)
    experts_key: str = ""
    expert_width_key: str = "moe_intermediate_size"  # each expert's MLP width
    router: str = "softmax_topk"  # ROUTERS
    norm_topk: str = "norm_topk_prob"  # a config flag: the top k weights renormalised to 1 ("*": always)
    shared_expert_key: str = ""  # a config key: the width of a shared expert behind a sigmoid gate
    sparse_step: bool = False  # decoder_sparse_step / mlp_only_layers pick the sparse layers (Qwen-MoE)
    dense_first_key: str = ""  # a config key: that many first layers have a dense MLP (DeepSeek)
    # a config key: the count of shared experts, one ungated MLP of count x the expert width added
    # to the routed experts' sum (DeepSeek's n_shared_experts, ERNIE 4.5's moe_num_shared_experts; 0: none)
    shared_count_key: str = ""
    # config keys (start, interval, end): layer i has experts when start <= i <= end and
    # (i + 1) % interval == 0 (ERNIE 4.5's moe_layer_start_index / _interval / _end_index)
    sparse_range: tuple[str, str, str] | None = None
    # GPT-OSS: each expert's SwiGLU clamped (gate <= limit, |up| <= limit) as
    # gate * sigmoid(alpha * gate) * (up + beta): (alpha, beta, limit); () plain silu(gate) * up
    swiglu: tuple[float, ...] = ()
    sinks: bool = False  # a learned logit per head joins each softmax (GPT-OSS's attention sinks)
    latent: bool = False  # multi-head latent attention: q, k, v from low-rank projections (DeepSeek, export.mla)
    embed_proj_key: str = ""  # a config key: the embeddings' width, projected in and out when not hidden (OPT)
    embed_norm: bool = False  # a LayerNorm of the embeddings (BLOOM's word_embeddings_layernorm)
    # the config keys of the context, first set one wins; else context_default (ALiBi has no table)
    context_keys: tuple[str, ...] = ("max_position_embeddings",)
    context_default: int = 0
    variants: tuple[Variant, ...] = ()  # the row as a config option changes it, applied in order

    def for_config(self, config: object) -> Family:
        """The row with the changes of each of its variants that applies to ``config``."""
        row = self
        for variant in self.variants:
            if variant.applies(config):
                changes: dict[str, Any] = dict(variant.changes)
                row = replace(row, **changes)
        return row


# Gemma 2: Gemma's norms (1 + w), embeddings x sqrt(hidden), GeGLU with the tanh GELU, a norm after
# attention and the MLP too, the attention scale from query_pre_attn_scalar, soft-capping
_GEMMA2 = Family(
    "gemma2",
    norm_offset=1.0,
    layout="sandwich",
    acts=("gelu_pytorch_tanh",),
    act_keys=("hidden_activation", "hidden_act"),
    windows="layer_types",
    embed_scale="sqrt_hidden",
    attn_scale="query_pre_attn_scalar",
    softcaps=True,
)
_COHERE = Family(
    "cohere",
    norm="layer",
    eps_key="layer_norm_eps",
    layout="parallel",
    rotary_interleaved=True,
    logits_scale_key="logit_scale",
    variants=(Variant((("use_qk_norm", True),), (("qk_norm", "layer"),)),),
)
# BLOOM's and MPT's common ground: ALiBi models (positions set by each row) with LayerNorms
# (layer_norm_epsilon), one KV head a head, a plain MLP of 4 x hidden, an activation no config
# key names (act_default, set by each row)
_ALIBI_LAYER_NORM = Family(
    "",
    kv_key="",
    norm="layer",
    eps_key="layer_norm_epsilon",
    gated=False,
    act_keys=(),
    intermediate_key="",
)
_PHI_NAMES = (
    (".self_attn.dense.", ".self_attn.o_proj."),
    (".mlp.fc1.", ".mlp.up_proj."),
    (".mlp.fc2.", ".mlp.down_proj."),
    ("model.final_layernorm.", "model.norm."),
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
)
_GPT2_NAMES = (  # GPT-2 and GPTBigCode
    ("transformer.wte.", "model.embed_tokens."),
    ("transformer.wpe.", "model.embed_positions."),
    ("transformer.ln_f.", "model.norm."),
    ("transformer.h.", "model.layers."),
    (".ln_1.", ".input_layernorm."),
    (".ln_2.", ".post_attention_layernorm."),
    (".attn.c_attn.", ".self_attn.qkv_proj."),
    (".attn.c_proj.", ".self_attn.o_proj."),
    (".mlp.c_fc.", ".mlp.up_proj."),
    (".mlp.c_proj.", ".mlp.down_proj."),
)
_BLOOM_NAMES = (
    ("transformer.word_embeddings_layernorm.", "model.embed_norm."),
    ("transformer.word_embeddings.", "model.embed_tokens."),
    ("transformer.h.", "model.layers."),
    ("transformer.ln_f.", "model.norm."),
    (".self_attention.query_key_value.", ".self_attn.qkv_proj."),
    (".self_attention.dense.", ".self_attn.o_proj."),
    (".mlp.dense_h_to_4h.", ".mlp.up_proj."),
    (".mlp.dense_4h_to_h.", ".mlp.down_proj."),
)
_MPT_NAMES = (
    ("transformer.wte.", "model.embed_tokens."),
    ("transformer.blocks.", "model.layers."),
    ("transformer.norm_f.", "model.norm."),
    (".norm_1.", ".input_layernorm."),
    (".norm_2.", ".post_attention_layernorm."),
    (".attn.Wqkv.", ".self_attn.qkv_proj."),
    (".attn.out_proj.", ".self_attn.o_proj."),
    (".ffn.", ".mlp."),
)
_NEOX_NAMES = (
    ("gpt_neox.embed_in.", "model.embed_tokens."),
    ("gpt_neox.layers.", "model.layers."),
    ("gpt_neox.final_layer_norm.", "model.norm."),
    (".attention.query_key_value.", ".self_attn.qkv_proj."),
    (".attention.dense.", ".self_attn.o_proj."),
    (".mlp.dense_h_to_4h.", ".mlp.up_proj."),
    (".mlp.dense_4h_to_h.", ".mlp.down_proj."),
    ("embed_out.", "lm_head."),
)

FAMILY_TABLE: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama"),
        Family("mistral", windows="all"),
        Family("qwen2", windows="opt_in"),
        Family("qwen3", qk_norm="head", windows="opt_in"),
        Family("phi3", rotary_key="partial_rotary_factor", fused_qkv="rows", windows="all"),
        Family("smollm3", windows="opt_in", nope_layers=True),
        _GEMMA2,
        replace(
            _GEMMA2,
            name="gemma3_text",
            softcaps=False,
            qk_norm="head",
            local_rope=True,
            causal_key="use_bidirectional_attention",
        ),
        # Gemma 1: Llama's layout with Gemma's norms and GeGLU (transformers 4.57 reads hidden_act);
        # no soft-capping, no windows, 1 / sqrt(head)
        replace(
            _GEMMA2,
            name="gemma",
            layout="pre",
            acts=("gelu_pytorch_tanh", "gelu", "gelu_new"),
            act_keys=("hidden_act",),
            windows="",
            attn_scale="",
            softcaps=False,
        ),
        Family(
            "granite",
            embed_scale="embedding_multiplier",
            attn_scale="attention_multiplier",
            residual_key="residual_multiplier",
            logits_key="logits_scaling",
        ),
        Family("olmo2", layout="post", qk_norm="full"),
        Family(
            "stablelm",
            norm="layer",
            eps_key="layer_norm_eps",
            rotary_key="partial_rotary_factor",
            parallel_key="use_parallel_residual",
            mlp_bias_key="",
            # qk_layernorm: a LayerNorm (no bias) of each head, one a head (q_layernorm.norms.{h})
            renames=(
                (".self_attn.q_layernorm.", ".self_attn.q_norm."),
                (".self_attn.k_layernorm.", ".self_attn.k_norm."),
            ),
            variants=(Variant((("qk_layernorm", True),), (("qk_norm", "layer"),)),),
        ),
        Family(
            "phi",
            norm="layer",
            eps_key="layer_norm_eps",
            layout="parallel",
            gated=False,
            acts=("gelu_new", "gelu", "gelu_pytorch_tanh", "relu"),
            mlp_bias_key="*",
            rotary_key="partial_rotary_factor",
            renames=_PHI_NAMES,  # qk_layernorm: one LayerNorm (weight, bias) shared by the heads
            variants=(Variant((("qk_layernorm", True),), (("qk_norm", "layer"),)),),
        ),
        Family(
            "starcoder2",
            norm="layer",
            eps_key="norm_epsilon",
            gated=False,
            acts=("gelu_pytorch_tanh", "gelu_new", "gelu", "relu"),
            mlp_bias_key="use_bias",
            windows="all",
            renames=((".mlp.c_fc.", ".mlp.up_proj."), (".mlp.c_proj.", ".mlp.down_proj.")),
        ),
        # Nemotron: LayerNorm1P (LayerNorm by 1 + w, with bias), relu^2 in a plain MLP, partial rotary
        Family(
            "nemotron",
            norm="layer",
            norm_offset=1.0,
            eps_key="norm_eps",
            gated=False,
            acts=("relu2",),
            rotary_key="partial_rotary_factor",
        ),
        # GPTBigCode (StarCoder 1, SantaCoder): learned absolute positions, multi-query attention
        Family(
            "gpt_bigcode",
            kv_key="",
            norm="layer",
            eps_key="layer_norm_epsilon",
            gated=False,
            acts=("gelu_pytorch_tanh", "gelu_new", "gelu", "relu"),
            act_keys=("activation_function",),
            mlp_bias_key="*",
            fused_qkv="heads",
            require=("scale_attn_weights",),
            renames=_GPT2_NAMES,
            positions="learned",
            multi_query_key="multi_query",
            intermediate_key="n_inner",
        ),
        # GPT-2: learned absolute positions, Conv1D weights, q/k/v as rows of c_attn
        Family(
            "gpt2",
            kv_key="",
            norm="layer",
            eps_key="layer_norm_epsilon",
            gated=False,
            acts=("gelu_new", "gelu", "gelu_pytorch_tanh", "relu"),
            act_keys=("activation_function",),
            mlp_bias_key="*",
            fused_qkv="rows",
            require=("scale_attn_weights",),
            refuse=("scale_attn_by_inverse_layer_idx", "add_cross_attention"),
            renames=_GPT2_NAMES,
            positions="learned",
            intermediate_key="n_inner",
            conv1d=True,
        ),
        # OPT: learned absolute positions at an offset of 2, LayerNorm, biases, ReLU
        Family(
            "opt",
            kv_key="",
            norm="layer",
            eps_key="",
            gated=False,
            acts=("relu", "gelu", "gelu_new"),
            act_keys=("activation_function",),
            mlp_bias_key="enable_bias",
            refuse=("_remove_final_layer_norm",),
            require=("layer_norm_elementwise_affine",),
            renames=(
                ("model.decoder.embed_tokens.", "model.embed_tokens."),
                ("model.decoder.project_in.", "model.project_in."),
                ("model.decoder.project_out.", "model.project_out."),
                ("model.decoder.embed_positions.", "model.embed_positions."),
                ("model.decoder.final_layer_norm.", "model.norm."),
                ("model.decoder.layers.", "model.layers."),
                (".self_attn.out_proj.", ".self_attn.o_proj."),
                (".self_attn_layer_norm.", ".input_layernorm."),
                (".final_layer_norm.", ".post_attention_layernorm."),
                (".fc1.", ".mlp.up_proj."),
                (".fc2.", ".mlp.down_proj."),
            ),
            positions="learned",
            position_offset=2,
            intermediate_key="ffn_dim",
            embed_proj_key="word_embed_proj_dim",
            # OPT-350M: each layer's norms after its residual adds, no final norm
            variants=(Variant((("do_layer_norm_before", False),), (("layout", "post_ln"),)),),
        ),
        # GPT-J: interleaved partial rotary, attention and MLP in parallel on one LayerNorm
        Family(
            "gptj",
            kv_key="",
            norm="layer",
            eps_key="layer_norm_epsilon",
            layout="parallel",
            gated=False,
            acts=("gelu_new", "gelu", "gelu_pytorch_tanh", "relu"),
            act_keys=("activation_function",),
            mlp_bias_key="*",
            rotary_dims_key="rotary_dim",
            rotary_interleaved=True,
            intermediate_key="n_inner",
            renames=(
                ("transformer.wte.", "model.embed_tokens."),
                ("transformer.ln_f.", "model.norm."),
                ("transformer.h.", "model.layers."),
                (".ln_1.", ".input_layernorm."),
                (".attn.out_proj.", ".self_attn.o_proj."),
                (".attn.", ".self_attn."),
                (".mlp.fc_in.", ".mlp.up_proj."),
                (".mlp.fc_out.", ".mlp.down_proj."),
            ),
        ),
        # Falcon (7B layout): multi-query, attention and MLP side by side on one LayerNorm
        # (parallel_attn); new_decoder_architecture (40B, 180B): num_kv_heads, each group's q heads,
        # k and v in turn, attention on ln_attn and the MLP on ln_mlp (one input_layernorm when
        # num_ln_in_parallel_attn is 1: Falcon 2); alibi (Falcon-RW): BLOOM's biases rounded to
        # bfloat16, added before the scale
        Family(
            "falcon",
            kv_key="",
            norm="layer",
            eps_key="layer_norm_epsilon",
            parallel_key="parallel_attn",
            gated=False,
            acts=("gelu", "gelu_new", "gelu_pytorch_tanh", "relu"),
            act_keys=("activation",),
            mlp_bias_key="bias",
            fused_qkv="heads",
            multi_query_key="multi_query",
            intermediate_key="ffn_hidden_size",
            renames=(
                ("transformer.word_embeddings.", "model.embed_tokens."),
                (".ln_attn.", ".input_layernorm."),
                (".ln_mlp.", ".post_attention_layernorm."),
                ("transformer.ln_f.", "model.norm."),
                ("transformer.h.", "model.layers."),
                (".self_attention.query_key_value.", ".self_attn.qkv_proj."),
                (".self_attention.dense.", ".self_attn.o_proj."),
                (".mlp.dense_h_to_4h.", ".mlp.up_proj."),
                (".mlp.dense_4h_to_h.", ".mlp.down_proj."),
            ),
            variants=(
                Variant(
                    (("new_decoder_architecture", True),),
                    (
                        ("kv_key", "num_kv_heads"),
                        ("multi_query_key", ""),
                        ("parallel_key", ""),
                        ("layout", "parallel2"),
                        ("require", ("parallel_attn",)),
                    ),
                ),
                Variant(
                    (("new_decoder_architecture", True), ("num_ln_in_parallel_attn", 1)), (("layout", "parallel"),)
                ),
                Variant((("alibi", True),), (("positions", "alibi_bf16"),)),
            ),
        ),
        # Cohere (Command R): LayerNorm without bias, attention and MLP on one norm, interleaved
        # rotary, logits x logit_scale; use_qk_norm (Command R+): a LayerNorm of each head, one a head
        _COHERE,
        # Cohere 2 (Command R7B, Command A): Cohere's, with windows on layer_types' sliding
        # layers, the only ones that turn (the global layers have no rotary)
        replace(_COHERE, name="cohere2", windows="layer_types", nope_global=True, variants=()),
        # OLMo 1: LayerNorm without weight or bias, q/k/v clamped (clip_qkv)
        Family("olmo", norm="layer", norm_weights=False, eps_key="", clip_key="clip_qkv"),
        # GLM-4 (glm): interleaved partial rotary, fused gate_up_proj, q/k/v biases
        Family("glm", rotary_key="partial_rotary_factor", rotary_interleaved=True),
        # GLM-4-0414 (glm4): GLM with a norm after attention and after the MLP too (Gemma 2's sandwich)
        Family(
            "glm4",
            layout="sandwich",
            rotary_key="partial_rotary_factor",
            rotary_interleaved=True,
            renames=(  # its names for the sandwich's norms (the MLP's input norm first)
                (".post_attention_layernorm.", ".pre_feedforward_layernorm."),
                (".post_self_attn_layernorm.", ".post_attention_layernorm."),
                (".post_mlp_layernorm.", ".post_feedforward_layernorm."),
            ),
        ),
        # OLMo 3: OLMo 2 with windows on the layers layer_types marks, which turn unscaled
        Family("olmo3", layout="post", qk_norm="full", windows="layer_types", local_rope=True),
        # EXAONE 4: OLMo 2's norms after attention and the MLP, q/k norms per head, windows on
        # layer_types' sliding layers and no rotary on the others
        Family("exaone4", layout="post", qk_norm="head", windows="layer_types", nope_global=True),
        Family("arcee", gated=False, acts=("relu2",)),  # AFM: Llama with a plain relu^2 MLP
        Family("seed_oss"),  # Llama's graph (its o_proj bias: attention_out_bias)
        Family("helium", rotary_interleaved=True),  # Llama with GLM's interleaved rotary
        Family("ministral", windows="layer_types"),  # Llama with windows on the layers layer_types marks
        # ERNIE 4.5: Llama with GLM's interleaved rotary, biases on every projection (use_bias)
        Family("ernie4_5", rotary_interleaved=True, mlp_bias_key="use_bias"),
        # mixtures of experts (export.graph's MoE block)
        Family(
            "mixtral",
            windows="all",
            experts_key="num_local_experts",
            expert_width_key="intermediate_size",
            norm_topk="*",
            renames=(
                (".block_sparse_moe.", ".mlp."),
                (".w1.", ".gate_proj."),
                (".w3.", ".up_proj."),
                (".w2.", ".down_proj."),
            ),
        ),
        Family(
            "qwen2_moe",
            experts_key="num_experts",
            shared_expert_key="shared_expert_intermediate_size",
            sparse_step=True,
            refuse=("use_sliding_window",),  # its windows stop at max_window_layers
        ),
        # Qwen3-MoE: transformers slides every layer whenever sliding_window is set
        Family("qwen3_moe", qk_norm="head", windows="all", experts_key="num_experts", sparse_step=True),
        # OLMoE: Llama's layout, q/k norms over the whole projections (clip_qkv would clamp after them)
        Family(
            "olmoe",
            qk_norm="full",
            experts_key="num_experts",
            expert_width_key="intermediate_size",
            refuse=("clip_qkv",),
        ),
        # Granite-MoE: Granite's multipliers; experts stacked [E, 2 x width, H] (gate, then up)
        Family(
            "granitemoe",
            embed_scale="embedding_multiplier",
            attn_scale="attention_multiplier",
            residual_key="residual_multiplier",
            logits_key="logits_scaling",
            experts_key="num_local_experts",
            expert_width_key="intermediate_size",
            router="topk_softmax",
            norm_topk="",
            renames=(
                (".block_sparse_moe.router.layer.", ".mlp.gate."),
                (".block_sparse_moe.input_linear.", ".mlp.experts.gate_up_proj."),
                (".block_sparse_moe.output_linear.", ".mlp.experts.down_proj."),
            ),
        ),
        # ERNIE 4.5 MoE: the dense row's graph with experts (biases where use_bias, on the LM head
        # too) routed by softmax with a correction bias for the choice, ungated shared experts,
        # experts on the layers of moe_layer_start_index .. _end_index each moe_layer_interval-th
        Family(
            "ernie4_5_moe",
            rotary_interleaved=True,
            mlp_bias_key="use_bias",
            experts_key="moe_num_experts",
            router="softmax_biased",
            norm_topk="*",
            shared_count_key="moe_num_shared_experts",
            sparse_range=("moe_layer_start_index", "moe_layer_interval", "moe_layer_end_index"),
            renames=((".mlp.shared_experts.", ".mlp.shared_expert."),),
        ),
        # GPT-OSS: attention sinks, q/k/v/o biases, windows on layer_types' sliding layers (YaRN
        # through its own rotary tables); experts with biases, their gate and up columns
        # interleaved, the clamped SwiGLU (transformers' constants), softmax over the top k logits
        Family(
            "gpt_oss",
            windows="layer_types",
            experts_key="num_local_experts",
            expert_width_key="intermediate_size",
            router="topk_softmax",
            norm_topk="",
            swiglu=(1.702, 1.0, 7.0),
            sinks=True,
            renames=(
                (".mlp.router.", ".mlp.gate."),
                (".mlp.experts.gate_up_proj_bias", ".mlp.experts.fc1.bias"),
                (".mlp.experts.gate_up_proj", ".mlp.experts.fc1.weight"),
                (".mlp.experts.down_proj_bias", ".mlp.experts.fc2.bias"),
                (".mlp.experts.down_proj", ".mlp.experts.fc2.weight"),
            ),
        ),
        # DeepSeek-V3: multi-head latent attention, a grouped sigmoid router with routed_scaling_factor,
        # shared experts added as they are, the first first_k_dense_replace layers dense (export.mla)
        Family(
            "deepseek_v3",
            latent=True,
            experts_key="n_routed_experts",
            router="sigmoid_grouped",
            dense_first_key="first_k_dense_replace",
            shared_count_key="n_shared_experts",
            renames=((".mlp.shared_experts.", ".mlp.shared_expert."),),
        ),
        Family(
            "gpt_neox",
            kv_key="",
            norm="layer",
            eps_key="layer_norm_eps",
            parallel_key="use_parallel_residual",
            parallel_layout="parallel2",
            gated=False,
            acts=("gelu", "gelu_new", "gelu_pytorch_tanh", "relu"),
            mlp_bias_key="*",
            rotary_key="rotary_pct",
            fused_qkv="heads",
            renames=_NEOX_NAMES,
        ),
        # BLOOM: ALiBi, a LayerNorm of the embeddings, q/k/v fused per head, LayerNorms and biases
        # everywhere, its tanh GELU (no config key), an MLP of 4 x hidden, a tied LM head; the
        # residuals taken after the norms with apply_residual_connection_post_layernorm
        replace(
            _ALIBI_LAYER_NORM,
            name="bloom",
            acts=("gelu_pytorch_tanh",),
            act_default="gelu_pytorch_tanh",
            mlp_bias_key="*",
            fused_qkv="heads",
            positions="alibi",
            embed_norm=True,
            context_keys=("max_position_embeddings", "seq_length"),
            context_default=2048,  # its training context
            renames=_BLOOM_NAMES,
            variants=(Variant((("apply_residual_connection_post_layernorm", True),), (("layout", "pre_normed"),)),),
        ),
        # MPT as transformers builds it: ALiBi by the key's distance from the query (slopes with
        # alibi_bias_max 8; transformers' from the last key: a constant per row apart), LayerNorms without bias, q, k, v rows of Wqkv (clamped by
        # attn_config.clip_qkv), its softmax_scale, the exact GELU in an MLP of 4 x hidden, no
        # biases, a tied LM head (transformers ignores expansion_ratio, no_bias, qk_ln, logit_scale)
        replace(
            _ALIBI_LAYER_NORM,
            name="mpt",
            acts=("gelu",),
            act_default="gelu",
            mlp_bias_key="",
            fused_qkv="rows",
            clip_key="attn_config.clip_qkv",
            attn_scale="attn_config.softmax_scale",
            attn_scale_default=True,
            positions="alibi_relative",
            context_keys=("max_seq_len",),
            renames=_MPT_NAMES,
        ),
    )
}
