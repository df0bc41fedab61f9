"""Tiny random Llama / Qwen2 / Mistral / Qwen3 / Phi-3 / SmolLM3 / Gemma 2 / Gemma 3 checkpoints
(and the families of ``AUTO_FAMILIES``: Gemma 1, Granite, OLMo 1 / 2, StableLM, Phi-2, ...)
(2 layers, hidden 64) with a real byte-level BPE tokenizer, built offline in seconds, plus a
one-call export.
Shared by the export and runtime tests:

    ckpt = build_tiny_checkpoint(tmp_path / "ckpt", family="qwen2", seed=0)
    out = export_tiny(tmp_path, "llama", draft="int4")   # validated; out/draft-q4 too

The llama flavour adds bos to plain text (like Llama tokenizers, Mistral's and Gemma's too); the
qwen2 flavour does not (like Qwen/SmolLM2 ChatML tokenizers; Qwen3, Phi-3 and SmolLM3 take it). Both carry a
ChatML chat template.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "build_tiny_tokenizer",
    "build_tiny_checkpoint",
    "build_tiny_gguf",
    "sentencepiece_vocab",
    "export_tiny",
    "plain_spec_together",
    "FAMILIES",
    "OPTIMUM_FAMILIES",
    "CHATML_TEMPLATE",
]

# built from transformers' auto classes, with the options that make each what it is: size options
# the family does not take (a head_dim for Gemma 1, whose default is 256)
AUTO_FAMILIES: dict[str, dict] = {
    "gemma": dict(hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True),
    "granite": dict(tie_word_embeddings=True),
    "olmo2": dict(tie_word_embeddings=False),
    "stablelm": dict(tie_word_embeddings=False),
    "phi": dict(tie_word_embeddings=False),
    "starcoder2": dict(tie_word_embeddings=True),
    "gpt_neox": dict(tie_word_embeddings=False),
    "nemotron": dict(tie_word_embeddings=False),
    "gpt_bigcode": dict(tie_word_embeddings=True),
    "opt": dict(tie_word_embeddings=True),
    "gptj": dict(tie_word_embeddings=False),
    "falcon": dict(tie_word_embeddings=True, new_decoder_architecture=False),
    "gpt2": dict(tie_word_embeddings=True),
    "cohere": dict(tie_word_embeddings=True),
    "cohere2": dict(tie_word_embeddings=True),
    "olmo": dict(tie_word_embeddings=False),
    "glm": dict(tie_word_embeddings=False),
    "olmo3": dict(tie_word_embeddings=False),
    "glm4": dict(tie_word_embeddings=False),
    "exaone4": dict(tie_word_embeddings=False),
    "arcee": dict(tie_word_embeddings=False),
    "seed_oss": dict(tie_word_embeddings=False),
    "helium": dict(tie_word_embeddings=False),
    "ministral": dict(tie_word_embeddings=False),
    "ernie4_5": dict(tie_word_embeddings=True),
    "bloom": dict(tie_word_embeddings=True),  # ALiBi; its MLP 4 x hidden whatever `intermediate` says
    "mpt": dict(tie_word_embeddings=True),  # ALiBi by distance; MLP 4 x hidden; context max_seq_len
    # mixtures of experts: 4 experts, top 2 (options set each family's own fields)
    "mixtral": dict(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48),
    "qwen3_moe": dict(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48),
    "olmoe": dict(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2),
    "granitemoe": dict(tie_word_embeddings=True, num_local_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2),
    # latent attention (q_lora_rank, kv_lora_rank, rope / nope / value head parts), grouped routing
    "deepseek_v3": dict(
        tie_word_embeddings=False,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        moe_intermediate_size=48,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
    ),
    "ernie4_5_moe": dict(tie_word_embeddings=True, moe_num_experts=4, moe_k=2, moe_intermediate_size=64),
}
FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "phi3", "smollm3", "gemma2", "gemma3_text", *AUTO_FAMILIES)
# families no native graph takes, built through optimum-onnx (export.optimum_path); their configs'
# own names for the sizes (GPT-Neo: every other layer local, a window of 8 the tests run past)
OPTIMUM_FAMILIES = ("gpt_neo", "codegen")


def _optimum_config(family: str, common: dict, layers: int, hidden: int, heads: int, intermediate: int) -> dict:
    """The config options of a tiny ``OPTIMUM_FAMILIES`` model, in the family's own names."""
    ids = {k: common[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range")}
    positions = common["max_position_embeddings"]
    if family == "gpt_neo":
        kinds = (["global", "local"] * layers)[:layers]
        return dict(
            ids,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            attention_types=[[[kind], 1] for kind in kinds],
            window_size=8,
            intermediate_size=intermediate,
            max_position_embeddings=positions,
            tie_word_embeddings=True,
        )
    return dict(  # codegen: partial rotary (8 of 16 dimensions)
        ids,
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        rotary_dim=8,
        n_inner=intermediate,
        n_positions=positions,
        n_ctx=positions,
        tie_word_embeddings=False,
    )


BOS_FAMILIES = ("llama", "mistral", "gemma2", "gemma3_text", "gemma")  # tokenizers that add bos to plain text
CHATML_TEMPLATE = (
    "{{ bos_token if add_bos_in_template else '' }}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "import numpy as np\nx = np.zeros((3, 4))\nprint(x.shape)\n",
    "Write a Python function that checks whether a number is prime.",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
    "Speculative decoding drafts tokens and verifies them with the target model.",
]


def build_tiny_tokenizer(family: str = "llama", vocab: int = 320, corpus_seed: int = 0):
    """A `PreTrainedTokenizerFast`: byte-level BPE trained on a fixed corpus (deterministic).

    `corpus_seed` != 0 shuffles/extends the corpus, giving a *different* tokenizer (for the
    tokenizer-mismatch tests).
    """
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    if family in BOS_FAMILIES:
        specials = ["<s>", "</s>"] + specials
    corpus = list(_CORPUS)
    if corpus_seed:
        rng = random.Random(corpus_seed)
        corpus = [" ".join(rng.sample(line.split(), len(line.split()))) for line in corpus] * 3
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(corpus, trainer)
    if family in BOS_FAMILIES:  # bos on plain text, as Llama tokenizers do
        tk.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tk.token_to_id("<s>"))]
        )
        kw = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<|endoftext|>"}
        template = CHATML_TEMPLATE.replace("add_bos_in_template", "true")
    else:
        tk.post_processor = processors.ByteLevel(trim_offsets=False)
        kw = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
        template = CHATML_TEMPLATE.replace("add_bos_in_template", "false")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, **kw)
    tok.chat_template = template
    return tok


SP_SPECIALS = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 2), ("<start_of_turn>", 3), ("<end_of_turn>", 3)]
SP_TEXT_TOKENS = ["\n", "\n\n", "  ", "<table>"]  # USER_DEFINED, as Gemma's runs of spaces and HTML tags


def sentencepiece_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """A Gemma-style SentencePiece BPE vocabulary of ``size`` pieces as llama.cpp writes one
    (tokens, scores, llama.cpp token types): <pad> <eos> <bos> <unk> and two turn markers
    (CONTROL; UNKNOWN for <unk>), four USER_DEFINED text tokens, the 256 byte tokens, then the
    corpus's characters and word prefixes (spaces as `▁`) scored by rank, so every piece can be
    merged from two others."""
    tokens = [t for t, _ in SP_SPECIALS] + SP_TEXT_TOKENS + [f"<0x{b:02X}>" for b in range(256)]
    types = [k for _, k in SP_SPECIALS] + [4] * len(SP_TEXT_TOKENS) + [6] * 256
    scores = [0.0] * len(tokens)
    text = " ".join(_CORPUS).replace("\n", " ").replace(" ", "▁")
    pieces: list[str] = []
    for ch in sorted(set(text)):
        pieces.append(ch)
    words: dict[str, int] = {}
    for word in ("▁" + w for w in text.split("▁") if w):
        words[word] = words.get(word, 0) + 1
    for word, _ in sorted(words.items(), key=lambda kv: (-kv[1], kv[0])):
        for end in range(2, len(word) + 1):
            if word[:end] not in pieces:
                pieces.append(word[:end])
    pieces = pieces[: size - len(tokens)]
    if len(tokens) + len(pieces) < size:
        raise ValueError(f"the corpus gives {len(tokens) + len(pieces)} pieces, not {size}")
    scores += [-float(i) for i in range(len(pieces))]
    return tokens + pieces, scores, types + [1] * len(pieces)


def build_tiny_checkpoint(
    path: Path,
    family: str = "llama",
    seed: int = 0,
    vocab: int = 384,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    max_positions: int = 512,
    tokenizer_seed: int = 0,
    window: int | None = None,
    **config,
) -> Path:
    """Save a random-weight `family` model + tokenizer to `path` (`save_pretrained`).
    ``config``: more options for the transformers config (e.g. ``attention_bias=True``)."""
    import torch
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    path = Path(path)
    tok = build_tiny_tokenizer(family, corpus_seed=tokenizer_seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        initializer_range=0.08,
        rms_norm_eps=1e-5,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        **config,
    )
    torch.manual_seed(seed)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True))
    elif family == "mistral":  # a window longer than the model's positions unless `window` says
        model = MistralForCausalLM(
            MistralConfig(**common, tie_word_embeddings=False, sliding_window=window or 4 * max_positions)
        )
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False, rope_theta=1e6))
    elif family == "qwen3":  # head_dim apart from hidden / heads (Qwen3's default: 128)
        from transformers import Qwen3Config, Qwen3ForCausalLM

        common.setdefault("head_dim", 32)
        model = Qwen3ForCausalLM(Qwen3Config(**common, tie_word_embeddings=True, rope_theta=1e6))
    elif family == "phi3":  # fused qkv / gate_up; Phi-4-mini's partial rotary unless told
        from transformers import Phi3Config, Phi3ForCausalLM

        common.setdefault("partial_rotary_factor", 0.75)
        common.setdefault("original_max_position_embeddings", max_positions)
        model = Phi3ForCausalLM(Phi3Config(**common, tie_word_embeddings=False))
    elif family == "smollm3":  # layers without rotary (released: every 4th; here every 2nd unless told)
        from transformers import SmolLM3Config, SmolLM3ForCausalLM

        common.setdefault("no_rope_layers", [1, 0, 1, 0][:layers] + [1] * (layers - 4))
        model = SmolLM3ForCausalLM(SmolLM3Config(**common, tie_word_embeddings=True, rope_theta=2e6))
    elif family == "gemma2":  # sliding window on every other layer (`window`: 4096 unless told)
        from transformers import Gemma2Config, Gemma2ForCausalLM

        common.setdefault("head_dim", hidden // heads)
        common.setdefault("query_pre_attn_scalar", 24)  # not head_dim: the scale must come from it
        if window:
            common["sliding_window"] = window
        model = Gemma2ForCausalLM(Gemma2Config(**common, tie_word_embeddings=True, attn_implementation="eager"))
    elif family == "gemma3_text":  # layer_types: local (own rotary base, window) and global layers
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        common.setdefault("head_dim", hidden // heads)
        common.setdefault("query_pre_attn_scalar", 24)
        common.setdefault("layer_types", (["sliding_attention"] * (layers - 1) + ["full_attention"])[:layers])
        if window:
            common["sliding_window"] = window
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, tie_word_embeddings=True))
    elif family in OPTIMUM_FAMILIES:
        from transformers import AutoConfig, AutoModelForCausalLM

        options = _optimum_config(family, common, layers, hidden, heads, intermediate)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **options))
    elif family in AUTO_FAMILIES:
        from transformers import AutoConfig, AutoModelForCausalLM

        options = {**AUTO_FAMILIES[family], **common}
        if family == "opt":  # its MLP width's own name
            options.setdefault("ffn_dim", intermediate)
        if family == "falcon":
            options.setdefault("ffn_hidden_size", intermediate)
        if family == "mpt":
            options.setdefault("max_seq_len", max_positions)
        if family in ("gpt_bigcode", "gptj", "gpt2"):
            options.setdefault("n_inner", intermediate)
        if family in (
            "gemma",
            "glm",
            "glm4",
            "seed_oss",
            "helium",
            "ministral",
            "exaone4",
            "ernie4_5",
        ):  # default heads of 256, 128
            options.setdefault("head_dim", hidden // heads)
        if window:
            options["sliding_window"] = window
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **options), attn_implementation="eager")
    else:
        raise ValueError(f"family must be one of {FAMILIES + OPTIMUM_FAMILIES}")
    with torch.no_grad():  # norms and biases away from their 1/0 init, so they matter
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def build_tiny_gguf(path: Path, family: str = "qwen2", seed: int = 0, quantized: bool = False, **kw) -> Path:
    """Write a tiny random checkpoint as an F32 GGUF file (what llama.cpp's converter would
    write: its tensor names and keys, q/k rows permuted for llama and smollm3, BPE tokens + merges + token types),
    so the GGUF path (transformers' loader, special-token fixes) runs offline in seconds.
    ``quantized``: the layers' matrices as Q4_1 and the embedding / LM head as Q8_0 (the mix
    SmolLM2's packaged file has). Gemma 2 / 3 (``gemma2``, ``gemma3_text``): llama.cpp's names
    and keys, norms written as 1 + w, no LM head (tied), a SentencePiece-style vocabulary
    (`sentencepiece_vocab`) and no chat template, as the real Gemma 3 270M file. Returns the
    .gguf path; the checkpoint it came from is saved beside it (`<stem>-hf`)."""
    import json
    import math

    import gguf
    import numpy as np
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    ckpt = build_tiny_checkpoint(path.with_name(path.stem + "-hf"), family, seed=seed, **kw)
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    cfg = model.config
    spec = json.loads((ckpt / "tokenizer.json").read_text())
    gemma = family in ("gemma2", "gemma3_text")
    writer = gguf.GGUFWriter(str(path), "gemma3" if family == "gemma3_text" else family)
    writer.add_name(f"tiny-{family}")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if family == "qwen3":  # what llama.cpp's converter writes for each family (see export.gguf_families)
        writer.add_key_length(head)
        writer.add_value_length(head)
    if family == "smollm3":  # llama.cpp keeps no list of NoPE layers: every 4th has no rotary
        writer.add_rope_dimension_count(head)
        if list(cfg.no_rope_layers) != [int((i + 1) % 4 != 0) for i in range(cfg.num_hidden_layers)]:
            raise ValueError(f"a smollm3 GGUF cannot hold no_rope_layers {cfg.no_rope_layers}")
    if family == "phi3":
        writer.add_rope_dimension_count(int(cfg.partial_rotary_factor * cfg.hidden_size) // cfg.num_attention_heads)
        writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        writer.add_sliding_window(cfg.sliding_window or 0)
        scaling = cfg.rope_scaling or {}
        if "longrope" in (scaling.get("rope_type"), scaling.get("type")):
            scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
            attn = math.sqrt(1 + math.log(scale) / math.log(cfg.original_max_position_embeddings))
            writer.add_rope_scaling_attn_factors(attn if scale > 1 else 1.0)
    if gemma:  # what llama.cpp's Gemma converters write, and its rules for what they do not
        writer.add_key_length(head)
        writer.add_value_length(head)
        writer.add_sliding_window(cfg.sliding_window)
        if cfg.query_pre_attn_scalar != head:
            raise ValueError(f"a {family} GGUF implies query_pre_attn_scalar = head_dim {head}")
        pattern = 2 if family == "gemma2" else 6
        want = [
            "sliding_attention" if i % pattern < pattern - 1 else "full_attention" for i in range(len(cfg.layer_types))
        ]
        if list(cfg.layer_types) != want:
            raise ValueError(f"a {family} GGUF implies layer_types {want}")
        if family == "gemma2":
            writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        elif cfg.rope_scaling:
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(cfg.rope_scaling["factor"])
        sp_tokens, sp_scores, sp_types = sentencepiece_vocab(cfg.vocab_size)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(sp_tokens)
        writer.add_token_scores(sp_scores)
        writer.add_token_types(sp_types)
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(False)
    vocab = spec["model"]["vocab"]
    tokens = [None] * cfg.vocab_size
    for text, i in vocab.items():
        tokens[i] = text
    specials = {t["content"] for t in spec["added_tokens"]}
    tokens = [t if t is not None else f"<unused{i}>" for i, t in enumerate(tokens)]
    if not gemma:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types([3 if t in specials else 1 for t in tokens])  # 3 = CONTROL
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
        template = AutoTokenizer.from_pretrained(ckpt).chat_template
        writer.add_eos_token_id(vocab["<|im_end|>"])  # the GGUF's own choice, as in SmolLM2's
        if family == "llama":
            writer.add_bos_token_id(vocab["<s>"])
        if family == "phi3":  # Phi-4-mini's file names a bos (<|endoftext|>) and does not add it
            writer.add_bos_token_id(vocab["<|endoftext|>"])
        writer.add_pad_token_id(vocab["<|endoftext|>"])
        writer.add_add_bos_token(family == "llama")
        writer.add_chat_template(template)

    def permute(w, heads):  # HF rotary halves -> llama.cpp's interleaved rows (llama only)
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "self_attn.q_norm": "attn_q_norm",  # Qwen3
        "self_attn.k_norm": "attn_k_norm",
        "self_attn.qkv_proj": "attn_qkv",  # Phi-3: fused, as llama.cpp keeps them
        "mlp.gate_up_proj": "ffn_up",
    }
    if gemma:  # norms before and after attention and the MLP
        names.update(
            post_attention_layernorm="post_attention_norm",
            pre_feedforward_layernorm="ffn_norm",
            post_feedforward_layernorm="post_ffw_norm",
        )
    tensors = {
        "token_embd.weight": sd["model.embed_tokens.weight"],
        "output_norm.weight": sd["model.norm.weight"],
        "output.weight": sd.get("lm_head.weight", sd["model.embed_tokens.weight"]),
    }
    if gemma:
        del tensors["output.weight"]  # tied: llama.cpp writes no LM head
    scaling = getattr(cfg, "rope_scaling", None) or {}
    if family == "phi3" and "longrope" in (scaling.get("rope_type"), scaling.get("type")):
        tensors["rope_factors_long.weight"] = np.array(scaling["long_factor"], dtype=np.float32)
        tensors["rope_factors_short.weight"] = np.array(scaling["short_factor"], dtype=np.float32)
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            for kind in ("weight", "bias"):
                key = f"model.layers.{i}.{hf}.{kind}"
                if key not in sd:
                    continue
                w = sd[key]
                if family in ("llama", "smollm3") and gg in ("attn_q", "attn_k"):
                    w = permute(w, cfg.num_attention_heads if gg == "attn_q" else cfg.num_key_value_heads)
                tensors[f"blk.{i}.{gg}.{kind}"] = w
    if gemma:  # llama.cpp's converter folds Gemma's (1 + w) into every norm weight
        tensors = {k: v + 1 if k.endswith("norm.weight") else v for k, v in tensors.items()}
    for name, w in tensors.items():
        w = np.ascontiguousarray(w, dtype=np.float32)
        if quantized and w.ndim == 2:
            kind = (
                gguf.GGMLQuantizationType.Q8_0
                if name in ("token_embd.weight", "output.weight")
                else gguf.GGMLQuantizationType.Q4_1
            )
            writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def export_tiny(
    tmp_path: Path, family: str = "llama", draft: str | None = None, validate: bool = True, seed: int = 0, **request
) -> Path:
    """Build a tiny checkpoint under `tmp_path` and export it (validated) to
    `tmp_path/<family>-onnx`. `draft`: None, "int4"/"int8" (quantized copy of the target), or
    "tiny" (a second random model of the same family and tokenizer, seed + 1)."""
    from export.pipeline import Request, run
    from export.ui import Reporter

    tmp_path = Path(tmp_path)
    ckpt = build_tiny_checkpoint(tmp_path / f"{family}-ckpt", family, seed=seed)
    if draft == "tiny":
        request["draft"] = str(build_tiny_checkpoint(tmp_path / f"{family}-draft", family, seed=seed + 1, layers=1))
    elif draft is not None:
        request["draft_quant"] = draft
    out = Path(request.pop("out", tmp_path / f"{family}-onnx"))
    run(Request(src=str(ckpt), out=out, validate=validate, threads=1, **request), Reporter(quiet=True))
    return out


def with_chat_template(src: Path, dst: Path, template: str) -> Path:
    """A copy of the export folder `src` at `dst` whose manifest carries chat `template`."""
    import json
    import shutil

    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["tokenizer"]["chat_template"] = template
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def plain_spec_together(folder: Path, draft: str, config, prompts: list[str], n: int, slots: int):
    """Greedy token ids of ``prompts`` through an Engine on ``folder``: ``(plain, spec one at a
    time, spec all at once)``, for exactness checks."""
    import asyncio

    from specdec_rt import Engine

    async def go():
        async with await Engine.load(folder, draft=draft, slots=slots, spec_config=config) as engine:
            plain = [(await engine.generate(p, n, mode="ar")).token_ids for p in prompts]
            spec = [(await engine.generate(p, n, mode="spec")).token_ids for p in prompts]
            together = await asyncio.gather(*[engine.generate(p, n, mode="spec") for p in prompts])
            return plain, spec, [r.token_ids for r in together]

    return asyncio.run(go())
