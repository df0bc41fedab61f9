"""What the graph builder needs to know of a decoder (``ModelSpec``), read from a transformers
config, and the rejection of every config the graph cannot express (one UnsupportedModelError
naming the value)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from .errors import UnsupportedModelError
from .families import ACTIVATIONS, FAMILY_TABLE, Family
from .layout import graph_head_dim, head_fields
from .mla import GroupedRouting, LatentAttention, grouped_routing, latent_heads, latent_scale

__all__ = [
    "ModelSpec",
    "SUPPORTED_FAMILIES",
    "GGUF_FAMILIES",
    "MAX_POSITIONS_CAP",
    "MIN_POSITIONS",
    "unsupported_architecture",
    "refusal_reason",
]

# model_type of a checkpoint folder: a row of export.families.FAMILY_TABLE each
SUPPORTED_FAMILIES = tuple(FAMILY_TABLE)
GGUF_FAMILIES = (  # general.architecture of a GGUF (Mistral: llama; gemma3: Gemma 3's text model)
    *("llama", "qwen2", "qwen3", "phi3", "smollm3", "gemma2", "gemma3"),
    *("gemma", "phi2", "gpt2", "starcoder2", "olmo2", "granite", "gptneox", "falcon", "qwen2moe", "qwen3moe"),
    *("bloom", "mpt"),
)
MAX_POSITIONS_CAP = 32768
MIN_POSITIONS = 2  # a prompt token and one generated token
# families refused on purpose, with why (named in the refusal); the rest by what config.json shows
NOT_YET = {
    "gemma3": "Gemma 3 with its vision tower: multimodal; its text model (gemma3_text) exports",
    "gemma3n": "Gemma 3n: not yet; multimodal",
}
# (what, model_type fragments, config.json keys): every kind a refused config shows is named
_KINDS = (
    (
        "state-space layers",
        ("mamba", "jamba", "falcon_h1", "zamba", "bamba", "nemotron_h", "granitemoehybrid"),
        ("ssm_cfg", "mamba_d_state", "state_size", "layers_block_type", "mamba_n_heads"),
    ),
    ("convolution layers", ("lfm2", "hyena"), ("conv_L_cache",)),
    ("recurrent layers", ("rwkv", "xlstm", "recurrent_gemma"), ("lru_width",)),
    ("linear attention", ("qwen3_next",), ("linear_num_value_heads", "linear_conv_kernel_dim")),
    (
        "mixture of experts",
        ("moe", "mixtral", "dbrx", "deepseek", "jetmoe", "granitemoe", "olmoe"),
        ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size"),
    ),
    (
        "multimodal",
        ("vl", "vision", "llava", "mllama", "idefics", "multimodal", "smolvlm", "paligemma"),
        ("vision_config", "audio_config", "text_config"),
    ),
    ("encoder-decoder", ("bart", "pegasus", "marian", "blenderbot", "t5"), ()),
)


def refusal_reason(
    family: object, supported: tuple[str, ...] = SUPPORTED_FAMILIES, config: dict[str, Any] | None = None
) -> str | None:
    """Why a family no graph builder takes is refused, when that is known: ``NOT_YET``, else
    each kind of layer or model the runtime has no place for (state-space, convolution or
    recurrent layers, linear attention, experts, multimodal towers, encoder-decoders), from the
    model_type or ``config``, config.json's keys; None when nothing is known against it."""
    why = NOT_YET.get(family) if isinstance(family, str) else None
    if why is None and supported is GGUF_FAMILIES and family in SUPPORTED_FAMILIES:
        why = f"GGUF files of {family}: not yet; its checkpoint folders export"
    if why is not None:
        return why
    name = family.lower() if isinstance(family, str) else ""
    keys = config or {}
    kinds = [w for w, frags, ks in _KINDS if any(f in name for f in frags) or any(k in keys for k in ks)]
    return ", ".join(kinds) or None


def unsupported_architecture(
    family: object, supported: tuple[str, ...] = SUPPORTED_FAMILIES, config: dict[str, Any] | None = None
) -> UnsupportedModelError:
    """The one error for a model family the graph builder cannot emit (from a checkpoint folder,
    or from a GGUF file: ``supported=GGUF_FAMILIES``), one line naming the family, why when it is
    known (``NOT_YET``; else each kind of layer the graph has no block for: state-space,
    convolution or recurrent layers, linear attention, experts, multimodal towers, from the
    model_type or ``config``, config.json's keys), and the supported ones."""
    why = refusal_reason(family, supported, config)
    return UnsupportedModelError(
        f"unsupported architecture {family}{f' ({why})' if why else ''}; supported: {', '.join(supported)}"
    )


@dataclass(frozen=True)
class ModelSpec:
    """The architecture numbers the graph and the manifest need."""

    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # the graph's head size (its KV cache's): the model's, padded to HEAD_MULTIPLE
    intermediate_size: int
    vocab_size: int
    max_positions: int
    rms_eps: float
    model_head_dim: int = 0  # the model's own head size (0: head_dim, no padding)
    rotary_dim: int = 0  # the model's rotated dimensions of a head (0: all; Phi-3 partial_rotary_factor)
    qk_norm: bool = False  # a norm of each query and key head before rotary (Qwen3: RMSNorm)
    nope_layers: tuple[int, ...] = ()  # layers without rotary (SmolLM3's no_rope_layers 0s)
    # each layer's sliding window: it sees its last `window` positions, itself included (0: all of
    # them); () when no layer has a window shorter than max_positions
    windows: tuple[int, ...] = ()
    attn_scale: float = 0.0  # attention's scale (0: 1 / sqrt(own head size)); Gemma: query_pre_attn_scalar^-0.5
    attn_softcap: float = 0.0  # tanh soft-capping of attention scores (0: none; Gemma 2)
    final_softcap: float = 0.0  # tanh soft-capping of the logits (0: none; Gemma 2)
    # the layers that turn by their own rotary base (Gemma 3's sliding layers: rope_local_base_freq),
    # whether or not their window is shorter than max_positions
    local_rope_layers: tuple[int, ...] = ()
    # the building blocks (export.families): rms_eps is every norm's epsilon
    norm: str = "rms"  # "rms" | "layer" (LayerNorm)
    norm_offset: float = 0.0  # norms multiply by weight + offset (Gemma: 1)
    layout: str = "pre"  # export.families.LAYOUTS
    gated: bool = True  # MLP act(gate) * up, else act(up)
    act: str = "silu"  # the MLP's activation, as the graph emits it (export.families.ACTIVATIONS values)
    mlp_bias: bool = False  # the MLP's projections may have biases
    qk_norm_full: bool = False  # RMSNorm of the whole q and k projections before rotary (OLMo 2)
    # the q and k norms of each head are LayerNorms (StableLM's and Phi-2's qk_layernorm, Cohere's
    # use_qk_norm): weight (and bias) [own] shared by the heads, or [heads, own] one a head
    qk_layer_norm: bool = False
    embed_dim: int = 0  # the embeddings' width, projected in and out (0: hidden_size; OPT-350M)
    fused_qkv: str = ""  # "rows" | "heads": how a fused qkv_proj holds q, k and v
    embed_scale: float = 0.0  # the embeddings times it (0: none; Gemma sqrt(H), Granite's multiplier)
    residual_scale: float = 0.0  # each branch times it before its residual add (0: none; Granite)
    logits_divisor: float = 0.0  # the logits divided by it (0: none; Granite's logits_scaling)
    logits_scale: float = 0.0  # the logits times it (0: none; Cohere's logit_scale)
    renames: tuple[tuple[str, str], ...] = ()  # the checkpoint's tensor names as Llama's
    # -1: rotary positions; else learned absolute positions, row p + offset of model.embed_positions
    position_offset: int = -1
    rotary_interleaved: bool = False  # pairs 2i, 2i + 1 turn together (GPT-J)
    conv1d: bool = False  # the layers' weights stored [in, out] (GPT-2)
    norm_weights: bool = True  # norms have weights (OLMo 1's have none)
    clip_qkv: float = 0.0  # q, k and v clamped to +-it after their projection (0: none; OLMo)
    # mixture of experts (export.families): 0 experts: a dense model
    num_experts: int = 0
    experts_per_token: int = 0  # the router's top k
    expert_size: int = 0  # each expert's MLP width
    router: str = "softmax_topk"  # export.families.ROUTERS
    norm_topk: bool = False  # the top k weights renormalised to sum to 1
    shared_expert_size: int = 0  # a shared expert's width, behind a sigmoid gate (0: none; Qwen2-MoE)
    shared_gate: bool = True  # the shared expert behind a sigmoid gate; else always added (DeepSeek, ERNIE 4.5)
    moe_layers: tuple[int, ...] = ()  # the layers with experts (the others: a dense MLP)
    swiglu: tuple[float, ...] = ()  # the experts' clamped SwiGLU (alpha, beta, limit): GPT-OSS
    sinks: bool = False  # attention sinks: a learned logit per head in each softmax (GPT-OSS)
    latent: LatentAttention | None = None  # DeepSeek's multi-head latent attention (export.mla)
    grouped: GroupedRouting | None = None  # DeepSeek's grouped sigmoid router (export.mla)
    # ALiBi: no rotary; each head's slope x the key's cache slot ("absolute": BLOOM; "bfloat16":
    # rounded as Falcon-RW's, before the scale) or x the slot less the query's position
    # ("relative": MPT) added to its scores, so the model verifies chains only
    # (a tree's nodes sit in slots past their positions); "": none
    alibi: str = ""
    embed_norm: bool = False  # a LayerNorm of the embeddings (BLOOM's word_embeddings_layernorm)

    @property
    def learned_positions(self) -> bool:
        return self.position_offset >= 0

    @property
    def rotary_positions(self) -> bool:
        """q and k turn by rotary tables (neither learned positions nor ALiBi)."""
        return not self.learned_positions and not self.alibi

    @property
    def own_head_dim(self) -> int:
        return self.model_head_dim or self.head_dim

    @property
    def gemma(self) -> bool:
        """Gemma's norms (RMSNorm by 1 + w)."""
        return self.norm == "rms" and self.norm_offset == 1.0

    @property
    def local_rope(self) -> bool:
        """Some layers turn by a local rotary base (their own cos / sin tables)."""
        return bool(self.local_rope_layers)

    @property
    def sliding_window(self) -> int:
        """The longest window of a sliding layer (0: every layer sees all earlier positions)."""
        return max(self.windows, default=0)

    @property
    def rotary(self) -> int:
        """The model's rotated dimensions of each head (its first ones)."""
        return self.rotary_dim or self.own_head_dim

    @classmethod
    def from_config(cls, config: Any, max_positions: int | None = None) -> ModelSpec:
        """Read a transformers config; reject what the graph cannot express."""
        fam = _family_row(config)
        limit = _context(config, fam, max_positions)
        windows = _windows(config, fam, limit)
        eps = _positive_number(config, fam.eps_key) if fam.eps_key else 1e-5  # nn.LayerNorm's default
        _check_rope(config)
        heads = latent_heads(config) if fam.latent else _heads(config, fam)
        return cls(
            family=fam.name,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            intermediate_size=getattr(config, fam.intermediate_key, None) or 4 * config.hidden_size,
            vocab_size=config.vocab_size,
            max_positions=limit,
            rms_eps=eps,
            windows=windows,
            **heads,
            **_blocks(config, fam),
            **_multipliers(config, fam),
            **_experts(config, fam),
        )

    def manifest(self) -> dict[str, Any]:
        """The manifest's `architecture` record."""
        keep = (
            "family",
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
            "max_positions",
        )
        record = {k: v for k, v in asdict(self).items() if k in keep}
        if self.num_experts:
            record["num_experts"] = self.num_experts
            record["experts_per_token"] = self.experts_per_token
        if self.windows:  # sliding layers: the runtime verifies chains (see specdec_rt.ort.model)
            record["sliding_window"] = self.sliding_window
        if self.alibi:  # biases by cache slot: chains too
            record["alibi"] = True
        return record


def _positive_number(config: Any, key: str, value: Any = None) -> float:
    """``config.<key>`` as a float that is finite and > 0, else UnsupportedModelError naming it
    (a NaN or negative epsilon, a zero rotary base, would only fail deep inside ONNX Runtime or
    give garbage tables)."""
    value = _lookup(config, key) if value is None else value
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        number = float("nan")
    if isinstance(value, bool) or not math.isfinite(number) or number <= 0:
        raise UnsupportedModelError(f"unsupported {key} {value!r}: need a finite number > 0")
    return number


def _lookup(config: Any, key: str) -> Any:
    """``config.<key>``, through sub-configs for a dotted key (MPT's ``attn_config.clip_qkv``:
    an object or a dict); None where any part is missing."""
    value = config
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else getattr(value, part, None)
        if value is None:
            return None
    return value


def _family_row(config: Any) -> Family:
    """The config's family row (``export.families``) with the variants its options select,
    after the checks of its activation and of the options the graph has no block for."""
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise unsupported_architecture(family)
    fam = FAMILY_TABLE[family].for_config(config)
    act = _activation(config, fam)
    if act not in fam.acts:
        raise UnsupportedModelError(f"unsupported activation {act}; need {' or '.join(fam.acts)}")
    for flag in (fam.causal_key, *fam.refuse):
        if flag and getattr(config, flag, False):
            extra = ": need causal attention" if flag == fam.causal_key else ""
            raise UnsupportedModelError(f"unsupported option {flag}=True{extra}")
    for flag in fam.require:
        if not getattr(config, flag, False):
            raise UnsupportedModelError(f"unsupported option {flag}={getattr(config, flag, None)!r}: need true")
    return fam


def _activation(config: Any, fam: Family) -> str | None:
    """The activation the config names (its first set ``act_keys``), else the family's own."""
    named = next((getattr(config, k) for k in fam.act_keys if getattr(config, k, None)), None)
    return named if named is not None else (fam.act_default or None)


def _context(config: Any, fam: Family, max_positions: int | None) -> int:
    """The exported positions: the model's (its first set ``context_keys``, else the family's
    default; at most ``MAX_POSITIONS_CAP``, LongRoPE's original length), capped by
    ``max_positions``; at least ``MIN_POSITIONS``."""
    key = next((k for k in fam.context_keys if getattr(config, k, None) is not None), None)
    model_limit = getattr(config, key) if key else fam.context_default
    if key is None and not model_limit:
        raise UnsupportedModelError(f"unsupported config without {' or '.join(fam.context_keys)}: need a context")
    limit = min(model_limit, MAX_POSITIONS_CAP)
    if max_positions:
        limit = min(limit, max_positions)
    limit = min(limit, _longrope_limit(config) or limit)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < MIN_POSITIONS:
        raise UnsupportedModelError(
            f"unsupported context of {limit!r} positions ({key or 'default'} "
            f"{model_limit!r}): need at least {MIN_POSITIONS}"
        )
    return limit


def _heads(config: Any, fam: Family) -> dict[str, Any]:
    """The attention heads' fields of ``ModelSpec``: the query and KV heads, how a fused q/k/v
    holds them, the model's head size, its rotated part and the graph's padded head size."""
    heads = config.num_attention_heads
    kv_heads = (getattr(config, fam.kv_key, None) if fam.kv_key else None) or heads
    fused = fam.fused_qkv
    if fam.multi_query_key and getattr(config, fam.multi_query_key, False):  # one KV head; q, k, v rows
        kv_heads, fused = 1, "rows"
    for key, value in (
        ("hidden_size", config.hidden_size),
        ("num_attention_heads", heads),
        ("num_key_value_heads", kv_heads),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UnsupportedModelError(f"unsupported {key} {value!r}: need a positive integer")
    if heads % kv_heads:
        raise UnsupportedModelError(
            f"unsupported num_attention_heads {heads} with num_key_value_heads {kv_heads}: need a multiple"
        )
    if not getattr(config, "head_dim", None) and config.hidden_size % heads:
        raise UnsupportedModelError(
            f"unsupported hidden_size {config.hidden_size} with num_attention_heads {heads}: need a multiple"
        )
    own = getattr(config, "head_dim", None) or config.hidden_size // heads
    if isinstance(own, bool) or not isinstance(own, int) or own < 1:
        raise UnsupportedModelError(f"unsupported head_dim {own!r}: need a positive integer")
    learned, turned = fam.positions == "learned", fam.positions == "rope"
    if own % 2 and turned:
        raise UnsupportedModelError(f"unsupported head size {own}: rotary embeddings need an even one")
    rotary = _rotary_dim(config, fam, own) if turned else own
    return head_fields(
        heads=heads,
        kv_heads=kv_heads,
        own=own,
        rotary=rotary,
        padded=graph_head_dim(own, rotary),
        fused=fused,
        position_offset=fam.position_offset if learned else -1,
    )


def _blocks(config: Any, fam: Family) -> dict[str, Any]:
    """The building blocks of ``ModelSpec`` the family's row and its config options choose."""
    mlp_bias = fam.mlp_bias_key == "*" or bool(fam.mlp_bias_key and getattr(config, fam.mlp_bias_key, False))
    layout = fam.parallel_layout if fam.parallel_key and getattr(config, fam.parallel_key, False) else fam.layout
    return {
        "qk_norm": fam.qk_norm in ("head", "layer"),
        "qk_layer_norm": fam.qk_norm == "layer",
        "qk_norm_full": fam.qk_norm == "full",
        "nope_layers": _nope_layers(config) if fam.nope_layers else _global_nope(config, fam),
        "local_rope_layers": _local_rope_layers(config) if fam.local_rope else (),
        "norm": fam.norm,
        "norm_offset": fam.norm_offset,
        "layout": layout,
        "gated": fam.gated,
        "act": ACTIVATIONS[str(_activation(config, fam))],
        "mlp_bias": mlp_bias,
        "rotary_interleaved": fam.rotary_interleaved,
        "conv1d": fam.conv1d,
        "norm_weights": fam.norm_weights,
        "clip_qkv": _clip(config, fam.clip_key),
        "renames": fam.renames,
        "embed_dim": _embed_dim(config, fam),
        "embed_norm": fam.embed_norm,
        "alibi": {"alibi": "absolute", "alibi_relative": "relative", "alibi_bf16": "bfloat16"}.get(fam.positions, ""),
    }


def _multipliers(config: Any, fam: Family) -> dict[str, Any]:
    """The scales of ``ModelSpec``: attention's scale and soft-cap, the embeddings', each
    branch's, the logits' (0: none)."""
    scale = 0.0
    if fam.attn_scale == "query_pre_attn_scalar":
        scale = _positive_number(config, fam.attn_scale) ** -0.5
    elif fam.attn_scale and not (fam.attn_scale_default and _lookup(config, fam.attn_scale) is None):
        scale = _positive_number(config, fam.attn_scale)
    elif fam.latent:
        scale = latent_scale(config)
    embed_scale = 0.0
    if fam.embed_scale == "sqrt_hidden":
        embed_scale = math.sqrt(config.hidden_size)
    elif fam.embed_scale:
        embed_scale = _positive_number(config, fam.embed_scale)
    return {
        "attn_scale": scale,
        "attn_softcap": _softcap(config, "attn_logit_softcapping") if fam.softcaps else 0.0,
        "final_softcap": _softcap(config, "final_logit_softcapping") if fam.softcaps else 0.0,
        "embed_scale": embed_scale,
        "residual_scale": _positive_number(config, fam.residual_key) if fam.residual_key else 0.0,
        "logits_divisor": _positive_number(config, fam.logits_key) if fam.logits_key else 0.0,
        "logits_scale": _positive_number(config, fam.logits_scale_key) if fam.logits_scale_key else 0.0,
    }


def _embed_dim(config: Any, fam: Family) -> int:
    """The embeddings' width when it is not the layers' (OPT-350M's ``word_embed_proj_dim``:
    projected in after the lookup and out before the LM head), else 0."""
    if not fam.embed_proj_key:
        return 0
    width = getattr(config, fam.embed_proj_key, None)
    if width is None or width == config.hidden_size:
        return 0
    return _count(config, fam.embed_proj_key)


def _count(config: Any, key: str, low: int = 1) -> int:
    """``config.<key>`` as an int >= ``low``, else UnsupportedModelError naming it."""
    value = getattr(config, key, None)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UnsupportedModelError(f"unsupported {key} {value!r}: need an integer >= {low}")
    return value


def _experts(config: Any, fam: Family) -> dict[str, Any]:
    """The mixture-of-experts fields of ``ModelSpec`` as transformers reads them: the expert
    count, the top k (at most the count), each expert's width, the router and whether its top k
    weights are renormalised, a shared expert (ERNIE 4.5's ungated: its count x the expert
    width), and the sparse layers (Qwen-MoE: layer i has experts when it is not in
    ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``; ERNIE 4.5: when
    ``start <= i <= end`` and ``(i + 1) % interval == 0``, ``fam.sparse_range``'s keys)."""
    if not fam.experts_key:
        return {}
    experts = _count(config, fam.experts_key)
    top = _count(config, "num_experts_per_tok")
    if top > experts:
        raise UnsupportedModelError(
            f"unsupported num_experts_per_tok {top}: more than the {experts} experts ({fam.experts_key})"
        )
    layers = range(config.num_hidden_layers)
    if fam.sparse_step:
        step = _count(config, "decoder_sparse_step")
        dense = getattr(config, "mlp_only_layers", None) or []
        if not isinstance(dense, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in dense):
            raise UnsupportedModelError(f"unsupported mlp_only_layers {dense!r}: need a list of layer numbers")
        sparse = tuple(i for i in layers if i not in dense and (i + 1) % step == 0)
    elif fam.dense_first_key:  # DeepSeek: the first first_k_dense_replace layers dense
        sparse = tuple(layers)[_count(config, fam.dense_first_key, low=0) :]
    elif fam.sparse_range:
        start, interval, end = fam.sparse_range
        low, every, high = _count(config, start, low=0), _count(config, interval), _count(config, end, low=-1)
        sparse = tuple(i for i in layers if low <= i <= high and (i + 1) % every == 0)
    else:
        sparse = tuple(layers)
    norm = fam.norm_topk == "*" or bool(fam.norm_topk and getattr(config, fam.norm_topk, False))
    width = _count(config, fam.expert_width_key)
    shared = _count(config, fam.shared_expert_key) if fam.shared_expert_key else 0
    if fam.shared_count_key:  # DeepSeek, ERNIE 4.5: that many experts' widths, one MLP without a gate
        shared = width * _count(config, fam.shared_count_key, low=0)
    return {
        "num_experts": experts,
        "experts_per_token": top,
        "expert_size": width,
        "router": fam.router,
        "norm_topk": norm,
        "shared_expert_size": shared,
        "shared_gate": not fam.shared_count_key,
        "moe_layers": sparse,
        "swiglu": fam.swiglu,
        "sinks": fam.sinks,
        "grouped": grouped_routing(config, experts, top) if fam.router == "sigmoid_grouped" else None,
    }


def _check_rope(config: Any) -> None:
    """The rotary base (``rope_theta``, or ``rope_parameters['rope_theta']``) and, with rope
    scaling, its ``factor``: finite and > 0."""
    theta = getattr(config, "rope_theta", None)
    params = getattr(config, "rope_parameters", None)
    if theta is None and isinstance(params, dict):
        theta = params.get("rope_theta")
    if theta is not None:
        _positive_number(config, "rope_theta", theta)
    if getattr(config, "rope_local_base_freq", None) is not None:  # Gemma 3's sliding layers
        _positive_number(config, "rope_local_base_freq")
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict) and scaling.get("factor") is not None:
        _positive_number(config, "rope_scaling.factor", scaling["factor"])


def _rotary_dim(config: Any, fam: Family, own: int) -> int:
    """The rotated dimensions of each head: the family's fraction of it (``partial_rotary_factor``,
    GPT-NeoX's ``rotary_pct``), as transformers counts them (``int(head_dim * factor)``), or its
    count (GPT-J's ``rotary_dim``), else all."""
    if fam.rotary_dims_key:
        count = getattr(config, fam.rotary_dims_key, None)
        if count is None:
            return own
        if isinstance(count, bool) or not isinstance(count, int) or not 2 <= count <= own or count % 2:
            raise UnsupportedModelError(
                f"unsupported {fam.rotary_dims_key} {count!r} of head size {own}: need an even number 2..{own}"
            )
        return count
    if not fam.rotary_key:
        return own
    factor = getattr(config, fam.rotary_key, 1.0)
    if factor is None:
        return own
    _positive_number(config, fam.rotary_key, factor)
    rotary = int(own * float(factor))
    if rotary < 2 or rotary > own or rotary % 2:
        raise UnsupportedModelError(
            f"unsupported {fam.rotary_key} {factor!r} of head size {own}: "
            f"need an even number of rotated dimensions, 2..{own}"
        )
    return rotary


def _clip(config: Any, key: str) -> float:
    """OLMo's ``clip_qkv``: 0 when the family has none or it is unset (None), else a number > 0."""
    value = _lookup(config, key) if key else None
    return 0.0 if value is None else _positive_number(config, key, value)


def _softcap(config: Any, key: str) -> float:
    """Gemma's ``attn_logit_softcapping`` / ``final_logit_softcapping``: 0 when unset (None),
    else a finite number > 0."""
    value = getattr(config, key, None)
    return 0.0 if value is None else _positive_number(config, key, value)


def _windows(config: Any, fam: Family, limit: int) -> tuple[int, ...]:
    """Each layer's sliding window as transformers reads it (0: full attention), or () when no
    layer's window is shorter than ``limit`` positions. By the family's rule
    (``export.families.WINDOW_RULES``): Mistral, Phi-3 and Starcoder2 slide every layer when
    ``sliding_window`` is set; Qwen2, Qwen3 and SmolLM3 with ``use_sliding_window`` the layers
    their ``layer_types`` mark ``sliding_attention``; Gemma 2 and 3 the layers their
    ``layer_types`` mark (Gemma 2: every other, Gemma 3: 5 of 6 in released models). A window of
    w lets a position see the last w positions, itself included (transformers'
    ``sliding_window_overlay``: key > query - w)."""
    window = getattr(config, "sliding_window", None)
    if fam.windows == "opt_in" and not getattr(config, "use_sliding_window", False):
        return ()
    if window is None or not fam.windows:
        return ()
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise UnsupportedModelError(f"unsupported sliding_window {window!r}")
    sliding = [True] * config.num_hidden_layers if fam.windows == "all" else _layer_types(config)
    if window >= limit or not any(sliding):  # no position can see past the window: full attention
        return ()
    return tuple(window if s else 0 for s in sliding)


def _layer_types(config: Any) -> list[bool]:
    """``layer_types`` as one flag a layer, True for ``sliding_attention``."""
    layers = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    kinds = ("sliding_attention", "full_attention")
    if not isinstance(types, (list, tuple)) or len(types) != layers or any(t not in kinds for t in types):
        raise UnsupportedModelError(
            f"unsupported layer_types {types!r}: need sliding_attention or full_attention for each of the "
            f"{layers} layers"
        )
    return [t == "sliding_attention" for t in types]


def _local_rope_layers(config: Any) -> tuple[int, ...]:
    """The layers that turn by their own rotary module (Gemma 3's ``rope_local_base_freq``, OLMo
    3's unscaled one): transformers picks the rotary module by ``layer_types`` (a ``sliding_attention`` layer turns by the local base), not by
    whether the window is shorter than the context, so a window that covers every exported
    position drops the mask but keeps the local base."""
    return tuple(i for i, sliding in enumerate(_layer_types(config)) if sliding)


def _global_nope(config: Any, fam: Family) -> tuple[int, ...]:
    """EXAONE 4's layers without rotary: with a ``sliding_window`` set, transformers turns only
    the layers ``layer_types`` marks sliding (whether or not the window covers the context)."""
    if not fam.nope_global or getattr(config, "sliding_window", None) is None:
        return ()
    return tuple(i for i, sliding in enumerate(_layer_types(config)) if not sliding)


def _nope_layers(config: Any) -> tuple[int, ...]:
    """SmolLM3's layers without rotary: transformers rotates layer i when ``no_rope_layers[i]``
    is 1 (a NoPE layer every ``no_rope_layer_interval`` when the config has no list)."""
    flags = getattr(config, "no_rope_layers", None)
    if (
        not isinstance(flags, (list, tuple))
        or len(flags) != config.num_hidden_layers
        or any(f not in (0, 1) for f in flags)
    ):
        raise UnsupportedModelError(
            f"unsupported no_rope_layers {flags!r}: need a 0 or 1 for each of the {config.num_hidden_layers} layers"
        )
    return tuple(i for i, use_rope in enumerate(flags) if not use_rope)


def _longrope_limit(config: Any) -> int | None:
    """LongRoPE switches every position to its long factors once a sequence passes the original
    length (transformers recomputes the whole table), which a cache of rotated keys cannot follow:
    such a model is capped at its original length, where the short factors hold throughout."""
    scaling = getattr(config, "rope_scaling", None) or {}
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind != "longrope":
        return None
    original = scaling.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None
    )
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise UnsupportedModelError(
            f"unsupported longrope scaling without a valid original_max_position_embeddings (got {original!r})"
        )
    return original
