"""GGUF files of the families transformers 4.57's GGUF loader misreads or lacks.

transformers reads a GGUF's config through a fixed key table and its tensors through gguf-py's
name map. For the newer families that table is wrong or missing, and loading would not fail: it
would build a different model. What llama.cpp's converter writes, and what is done with it:

| GGUF arch | llama.cpp writes | transformers 4.57 | here |
|---|---|---|---|
| `qwen3` | `attention.key_length` (head size apart from hidden / heads) | ignores it (Qwen3Config's default 128) | `head_dim` from it |
| `phi3` | `rope.dimension_count` (rotated dims of a head), `attention.sliding_window` (0: none), `rope_factors_long/short` + `rope.scaling.attn_factor` (LongRoPE), fused `attn_qkv` / `ffn_up` | ignores all but the tensors | `partial_rotary_factor`, `sliding_window`, `rope_scaling` (longrope) from them |
| `smollm3` | a Llama file (q/k rows permuted); no list of NoPE layers: llama.cpp skips rotary on every 4th layer | no such architecture | registered as Llama's mapping, `no_rope_layers` by llama.cpp's rule |
| `gemma2` | norms as 1 + w (the converter adds 1), `attention.key_length`, `attention.sliding_window`, `attn_logit_softcapping`, `final_logit_softcapping`; no attention scale: llama.cpp takes 1/sqrt(head) (27B, 46 layers: 1/sqrt(hidden / heads)); sliding layers 0, 2, 4, ... | subtracts the 1, reads head size and window; soft-caps and scale left at Gemma2Config's defaults (50, 30, 256) | soft-caps from the file (llama.cpp's defaults 50 / 30 without them), `query_pre_attn_scalar` and `layer_types` by llama.cpp's rules |
| `gemma3` | as Gemma 2 plus q/k norms, no soft-caps, `rope.scaling.type` linear (global layers only); no layer pattern, local rotary base or scale: llama.cpp slides 5 layers of 6 (none without a window) at base 10000, scale as Gemma 2's (27B: 62 layers) | reads head size and window; no rope scaling; pattern, base, scale and final soft-cap left at Gemma3TextConfig's defaults | `layer_types`, `rope_local_base_freq`, `query_pre_attn_scalar`, `rope_scaling` (linear), `final_logit_softcapping` by llama.cpp's rules |

Every value is read from the header (`export.gguf_meta`) and bounded before anything is sized
from it; a rope scaling the mapping cannot express is refused. The loaded model must have every
parameter from the file (transformers would leave a missing one at its random initialization).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from .errors import CorruptSourceError, UnsupportedModelError
from .gguf_meta import GGUFInfo

__all__ = ["NEW_GGUF_FAMILIES", "gguf_config_overrides", "register_gguf_families"]

NEW_GGUF_FAMILIES = ("qwen3", "phi3", "smollm3", "gemma2", "gemma3")  # llama.cpp names Gemma 3's text model gemma3
UNKNOWN_TO_TRANSFORMERS = ("gemma", "phi2", "olmo2", "granite", "gptneox", "mpt")  # architectures its GGUF table lacks
SMOLLM3_NOPE_STEP = 4  # llama.cpp: hparams.n_no_rope_layer_step = 4 (layer i rotates iff (i + 1) % 4)
Config = dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class GemmaRules:
    """llama.cpp's Gemma rules (src/llama-model.cpp): every `pattern`-th layer is global
    (set_swa_pattern), the window and soft-caps without their keys, and the attention scale
    1/sqrt(hidden / heads) for the 27B models (`big`: their layer count), else 1/sqrt(head)."""

    pattern: int
    window: int
    attn_softcap: float | None
    final_softcap: float | None
    big: int


GEMMA_RULES = {
    "gemma2": GemmaRules(pattern=2, window=4096, attn_softcap=50.0, final_softcap=30.0, big=46),
    "gemma3": GemmaRules(pattern=6, window=0, attn_softcap=None, final_softcap=None, big=62),
}
GEMMA3_LOCAL_BASE = 10000.0  # llama.cpp's rotary base of Gemma 3's local layers
MAX_HEAD = 1024
MAX_WINDOW = 1 << 24
MAX_CONTEXT = 1 << 24
_F32 = 0


def _int(info: GGUFInfo, path: Path, key: str, *, bounds: tuple[int, int], default: int | None = None) -> int | None:
    """An optional integer key within ``bounds`` (inclusive); ``default`` without it."""
    arch = info.architecture
    value = info.metadata.get(f"{arch}.{key}")
    if value is None:
        return default
    low, high = bounds
    if type(value) is not int or not low <= value <= high:
        raise CorruptSourceError(f"GGUF {path}: {arch}.{key} = {value!r} is not an integer from {low} to {high}")
    return value


def _head(info: GGUFInfo) -> tuple[int, int, int]:
    """(embedding width, heads, KV heads): `check_model` has bounded them already."""
    arch = info.architecture
    meta = info.metadata
    heads = int(meta[f"{arch}.attention.head_count"])
    return int(meta[f"{arch}.embedding_length"]), heads, int(meta.get(f"{arch}.attention.head_count_kv") or heads)


def _refuse_scaling(info: GGUFInfo, path: Path) -> None:
    arch = info.architecture
    kind = info.metadata.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        raise UnsupportedModelError(
            f"GGUF {path}: {arch}.rope.scaling.type = {str(kind)[:40]!r} is not supported for {arch} GGUF files"
        )


def _expect(info: GGUFInfo, path: Path, name: str, dims: tuple[int, ...]) -> None:
    got = info.tensors.get(name)
    if got is not None and tuple(got[0]) != dims:
        raise CorruptSourceError(f"GGUF {path}: {name} is {list(got[0])}, the metadata implies {list(dims)}")


def _factors(info: GGUFInfo, path: Path, name: str, count: int) -> list[float]:
    """A small F32 tensor's values (LongRoPE factors), read at its offset after its extent and
    type are checked."""
    got = info.tensors.get(name)
    if got is None or tuple(got[0]) != (count,) or got[1] != _F32:
        raise CorruptSourceError(
            f"GGUF {path}: {name} is {list(got[0]) if got else 'missing'} (type {got[1] if got else '-'}), "
            f"LongRoPE needs {count} float32 values"
        )
    values = np.fromfile(path, dtype="<f4", count=count, offset=info.data_start + info.offsets[name])
    if len(values) != count or not np.all(np.isfinite(values)) or not np.all(values > 0):
        raise CorruptSourceError(f"GGUF {path}: {name} holds values that are not finite numbers > 0")
    return [float(v) for v in values]


def _float(info: GGUFInfo, key: str, path: Path, default: float | None) -> float | None:
    """An optional float key: finite and > 0 when present."""
    arch = info.architecture
    value = info.metadata.get(f"{arch}.{key}")
    if value is None:
        return default
    if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
        raise CorruptSourceError(f"GGUF {path}: {arch}.{key} = {value!r} is not a finite number > 0")
    return float(value)


def _check_gemma_tensors(info: GGUFInfo, path: Path, head: int) -> None:
    """q/k/v/o rows of ``head`` a head, the four norms of every Gemma layer (Gemma 3: q/k norms)."""
    arch = info.architecture
    embd, heads, kv = _head(info)
    for name, count in (("attn_q", heads), ("attn_k", kv), ("attn_v", kv)):
        _expect(info, path, f"blk.0.{name}.weight", (embd, count * head))
    _expect(info, path, "blk.0.attn_output.weight", (heads * head, embd))
    for name in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
        if f"blk.0.{name}.weight" not in info.tensors:
            raise CorruptSourceError(f"GGUF {path}: blk.0.{name}.weight is missing: every Gemma layer has it")
        _expect(info, path, f"blk.0.{name}.weight", (embd,))
    if arch == "gemma3":
        for name in ("attn_q_norm", "attn_k_norm"):
            _expect(info, path, f"blk.0.{name}.weight", (head,))


def _gemma(info: GGUFInfo, path: Path, key: int | None) -> Config:
    """Gemma 2 / Gemma 3 (text): what llama.cpp reads from the file or decides by its own rules."""
    arch = info.architecture
    rules = GEMMA_RULES[arch]
    embd, heads, _ = _head(info)
    layers = int(info.metadata[f"{arch}.block_count"])
    head = key or embd // heads
    if f"{arch}.attention.sliding_window_pattern" in info.metadata:
        raise UnsupportedModelError(
            f"GGUF {path}: {arch}.attention.sliding_window_pattern is not read for {arch} GGUF files "
            f"(llama.cpp's rule: every {rules.pattern}th layer global)"
        )
    _check_gemma_tensors(info, path, head)
    window = _int(info, path, "attention.sliding_window", bounds=(0, MAX_WINDOW), default=rules.window)
    pattern = rules.pattern
    out: Config = {
        "head_dim": head,
        "query_pre_attn_scalar": embd // heads if layers == rules.big else head,
        "sliding_window": window or None,
        "layer_types": [
            "sliding_attention" if window and i % pattern < pattern - 1 else "full_attention" for i in range(layers)
        ],
        "attn_logit_softcapping": _float(info, "attn_logit_softcapping", path, rules.attn_softcap),
        "final_logit_softcapping": _float(info, "final_logit_softcapping", path, rules.final_softcap),
    }
    if arch == "gemma2":
        _refuse_scaling(info, path)
        return out
    return {**out, **_gemma3_rotary(info, path, out)}


def _gemma3_rotary(info: GGUFInfo, path: Path, out: Config) -> Config:
    """Gemma 3: no attention soft-cap, the local rotary base, linear scaling of the global layers."""
    if out["attn_logit_softcapping"] is not None:  # llama.cpp's Gemma 3 graph has no attention soft-cap
        raise UnsupportedModelError(f"GGUF {path}: gemma3.attn_logit_softcapping is not Gemma 3's (none)")
    extra: Config = {"rope_local_base_freq": GEMMA3_LOCAL_BASE, "rope_scaling": None}
    if info.metadata.get("gemma3.rope.scaling.type") == "linear":  # llama.cpp: rope_freq_scale_train_swa = 1
        factor = _float(info, "rope.scaling.factor", path, None)
        if factor is None:
            raise CorruptSourceError(f"GGUF {path}: gemma3.rope.scaling.type linear without rope.scaling.factor")
        extra["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    else:
        _refuse_scaling(info, path)
    return extra


def _qwen3(info: GGUFInfo, path: Path, key: int | None) -> Config:
    """Qwen3: the head size from `attention.key_length`, checked against q/k/v and the q/k norms."""
    _refuse_scaling(info, path)
    embd, heads, kv = _head(info)
    head = key or embd // heads
    for name, count in (("attn_q", heads), ("attn_k", kv), ("attn_v", kv)):
        _expect(info, path, f"blk.0.{name}.weight", (embd, count * head))
    for name in ("attn_q_norm", "attn_k_norm"):
        _expect(info, path, f"blk.0.{name}.weight", (head,))
    return {"head_dim": head}


def _smollm3(info: GGUFInfo, path: Path, head: int, rope_dims: int | None) -> Config:
    """SmolLM3: every layer rotates but each 4th (llama.cpp's rule); no partial rotary."""
    _refuse_scaling(info, path)
    if rope_dims is not None and rope_dims != head:
        raise UnsupportedModelError(
            f"GGUF {path}: smollm3.rope.dimension_count = {rope_dims}: partial rotary is not SmolLM3's (head {head})"
        )
    layers = int(info.metadata["smollm3.block_count"])
    nope = [int((i + 1) % SMOLLM3_NOPE_STEP != 0) for i in range(layers)]
    return {"head_dim": head, "no_rope_layers": nope, "use_sliding_window": False}


def _longrope(info: GGUFInfo, path: Path, rope_dims: int, original: int | None) -> Config:
    """Phi-3's LongRoPE factors (tensors) and an attention factor transformers derives alike."""
    context = info.metadata.get("phi3.context_length")
    if original is None:
        raise CorruptSourceError(f"GGUF {path}: LongRoPE factors without phi3.rope.scaling.original_context_length")
    scaling = {  # Phi3Config takes these three fields only
        "type": "longrope",
        "long_factor": _factors(info, path, "rope_factors_long.weight", rope_dims // 2),
        "short_factor": _factors(info, path, "rope_factors_short.weight", rope_dims // 2),
    }
    # transformers derives the attention factor from the lengths, as llama.cpp's converter
    # did when it wrote it: a file whose factor differs cannot be expressed
    scale = (context or original) / original
    want = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    attn = info.metadata.get("phi3.rope.scaling.attn_factor", want)
    if type(attn) not in (int, float) or not math.isfinite(attn) or abs(attn - want) > 1e-5 * want:
        raise UnsupportedModelError(
            f"GGUF {path}: phi3.rope.scaling.attn_factor = {attn!r} is not LongRoPE's {want:.6f} "
            f"for context {context} over {original}"
        )
    return {"rope_scaling": scaling}


def _phi3(info: GGUFInfo, path: Path, head: int, rope_dims: int | None) -> Config:
    """Phi-3: fused q/k/v and gate/up, partial rotary, a window, LongRoPE."""
    embd, heads, kv = _head(info)
    rope_dims = rope_dims or head
    if rope_dims > head or rope_dims % 2:
        raise CorruptSourceError(
            f"GGUF {path}: phi3.rope.dimension_count = {rope_dims} is not an even number up to the head size {head}"
        )
    _expect(info, path, "blk.0.attn_qkv.weight", (embd, (heads + 2 * kv) * head))
    _expect(info, path, "blk.0.ffn_up.weight", (embd, 2 * int(info.metadata["phi3.feed_forward_length"])))
    context = info.metadata.get("phi3.context_length")
    original = _int(info, path, "rope.scaling.original_context_length", bounds=(2, MAX_CONTEXT), default=context)
    window = _int(info, path, "attention.sliding_window", bounds=(0, MAX_WINDOW), default=0)
    out: Config = {"partial_rotary_factor": rope_dims / head, "sliding_window": window or None}
    if original is not None:
        out["original_max_position_embeddings"] = original
    if "rope_factors_long.weight" in info.tensors or "rope_factors_short.weight" in info.tensors:
        return {**out, **_longrope(info, path, rope_dims, original)}
    _refuse_scaling(info, path)
    return out


def _key_length(info: GGUFInfo, path: Path) -> int | None:
    """`attention.key_length`, which must equal the value length when both are there."""
    key = _int(info, path, "attention.key_length", bounds=(1, MAX_HEAD))
    value = _int(info, path, "attention.value_length", bounds=(1, MAX_HEAD), default=key)
    if key is not None and value != key:
        raise UnsupportedModelError(f"GGUF {path}: key length {key} and value length {value} differ")
    return key


def gguf_config_overrides(info: GGUFInfo, path: str | os.PathLike[str]) -> Config:
    """The config values transformers' GGUF table misses for ``info``'s family, checked against
    the header (bounded integers, tensor shapes); {} for the families it reads right."""
    arch = info.architecture
    if arch not in NEW_GGUF_FAMILIES:
        return {}
    path = Path(path)
    key = _key_length(info, path)
    if arch in GEMMA_RULES:
        return _gemma(info, path, key)
    if arch == "qwen3":
        return _qwen3(info, path, key)
    embd, heads, _ = _head(info)
    if key is not None and key * heads != embd:
        raise UnsupportedModelError(
            f"GGUF {path}: {arch}.attention.key_length = {key} is not embedding length {embd} / {heads} heads"
        )
    rope_dims = _int(info, path, "rope.dimension_count", bounds=(1, MAX_HEAD))
    if arch == "smollm3":
        return _smollm3(info, path, embd // heads, rope_dims)
    return _phi3(info, path, embd // heads, rope_dims)


def _phi3_tokenizer(tokenizer_dict: dict[str, Any]) -> Any:
    """Phi-3 / 3.5 files carry a SentencePiece vocabulary (`llama`), Phi-4-mini's a byte-level
    BPE one (`gpt2`): transformers' table gives both the SentencePiece converter."""
    from transformers.integrations.ggml import GGUFPhi3Converter

    if tokenizer_dict.get("tokenizer_type") != "gpt2":
        return GGUFPhi3Converter(tokenizer_dict)  # type: ignore[no-untyped-call]  # transformers is untyped
    return _byte_level(tokenizer_dict)


QWEN2_CHAT_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _qwen2_tokenizer(tokenizer_dict: dict[str, Any]) -> Any:
    """transformers' Qwen2 converter, which adds Qwen's three chat specials by name, adding only
    those the file lists: a Qwen2 file without them (DeepSeek-R1-Distill-Qwen's `<｜User｜>`...)
    would get them as new ids past its embedding."""
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import Qwen2Converter
    from transformers.integrations.ggml import GGUFQwen2Converter

    class ListedSpecials(GGUFQwen2Converter):
        def converted(
            self, vocab: dict[str, int] | None = None, merges: list[tuple[str, str]] | None = None
        ) -> Any:  # (called without arguments: the file's vocabulary and merges)
            tokens = list(self.original_tokenizer.tokens)
            vocab = vocab or {word: i for i, word in enumerate(tokens)}
            tokenizer = Qwen2Converter.converted(self, vocab, merges or self.original_tokenizer.merges)
            listed = set(tokens)
            specials = [AddedToken(t, normalized=False, special=True) for t in QWEN2_CHAT_SPECIALS if t in listed]
            tokenizer.add_special_tokens(specials)
            return tokenizer

    converter = ListedSpecials(tokenizer_dict)  # type: ignore[no-untyped-call]  # transformers is untyped
    if QWEN2_CHAT_SPECIALS[0] not in set(tokenizer_dict.get("tokens") or ()):
        # Qwen2TokenizerFast's defaults name <|endoftext|> as unk, eos and pad: none (the file's
        # own eos / pad are set from its ids after loading)
        converter.additional_kwargs = {"unk_token": None, "eos_token": None, "pad_token": None}
    return converter


def _byte_level(tokenizer_dict: dict[str, Any]) -> Any:
    """GPT-2's converter with the file's own special tokens, none where it has none (a tokenizer
    class would otherwise add `<unk>`, `<s>`, `</s>` past the vocabulary)."""
    from transformers.integrations.ggml import GGUFGPTConverter

    converter = GGUFGPTConverter(tokenizer_dict)  # type: ignore[no-untyped-call]  # transformers is untyped
    tokens = tokenizer_dict.get("tokens") or []
    for attr in ("unk", "bos", "eos", "pad"):
        key = "unknown_token_id" if attr == "unk" else "padding_token_id" if attr == "pad" else f"{attr}_token_id"
        index = tokenizer_dict.get(key, tokenizer_dict.get(f"{attr}_token_id"))
        converter.additional_kwargs[f"{attr}_token"] = (
            tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None
        )
    return converter


def vocabulary_converter(tokenizer_dict: dict[str, Any]) -> Any:
    """A byte-level BPE vocabulary (`gpt2`) as GPT-2's converter builds it; a SentencePiece one
    (`llama`) as SentencePiece segments it (`GemmaSentencePiece`)."""
    if tokenizer_dict.get("tokenizer_type") == "gpt2":
        return _byte_level(tokenizer_dict)
    if tokenizer_dict.get("tokenizer_type") == "llama":
        return GemmaSentencePiece(tokenizer_dict)
    raise UnsupportedModelError(
        f"GGUF vocabulary type {str(tokenizer_dict.get('tokenizer_type'))[:40]!r} is not supported"
    )


def _smollm3_tokenizer(tokenizer_dict: dict[str, Any]) -> Any:
    """SmolLM3's byte-level BPE vocabulary (`gpt2`) as GPT-2's converter builds it (byte-level
    pre-tokenizer and decoder; the special tokens are registered from the token types after,
    `export.tokenizer`); a SentencePiece one as Llama's."""
    from transformers.integrations.ggml import GGUFGPTConverter, GGUFLlamaConverter

    if tokenizer_dict.get("tokenizer_type") == "gpt2":
        return GGUFGPTConverter(tokenizer_dict)  # type: ignore[no-untyped-call]  # transformers is untyped
    specials: dict[str, Any] = {"bos_token_id": None, "eos_token_id": None}
    return GGUFLlamaConverter({**specials, **tokenizer_dict})  # type: ignore[no-untyped-call]  # transformers is untyped


_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp's token types


class GemmaSentencePiece:
    """Gemma's SentencePiece BPE vocabulary as a `tokenizers` BPE, segmenting as SentencePiece and
    llama.cpp do: pieces merge by score (the merged piece's, highest first), characters outside
    the vocabulary fall back to byte tokens, spaces become `▁` (no dummy prefix unless the file's
    `add_space_prefix` says so), CONTROL tokens are special and USER_DEFINED ones (runs of
    newlines and spaces, HTML tags) are matched whole in the text and decode as text.

    transformers 4.57's GGUF converter makes a Unigram of the same scores, which splits
    "The capital" as `The ▁c ap it al`: BPE scores are merge ranks, not log probabilities.
    Called as the converters of transformers' table are: ``converted()``, ``additional_kwargs``."""

    def __init__(self, tokenizer_dict: dict[str, Any]) -> None:
        tokens, scores = tokenizer_dict.get("tokens"), tokenizer_dict.get("scores")
        types = tokenizer_dict.get("token_type")
        if not tokens or scores is None or types is None or not len(tokens) == len(scores) == len(types):
            raise CorruptSourceError("a SentencePiece vocabulary needs tokens, scores and token types of one length")
        self.tokens, self.scores, self.types = list(tokens), [float(x) for x in scores], list(types)
        self.add_prefix_space = bool(tokenizer_dict.get("add_prefix_space", False))
        self.additional_kwargs: dict[str, Any] = {}

    def merges(self) -> list[tuple[str, str]]:
        """Every split of a NORMAL piece into two pieces of the vocabulary, by the piece's score."""
        ids = {t: i for i, t in enumerate(self.tokens)}
        found = []
        for i, piece in enumerate(self.tokens):
            if self.types[i] != _NORMAL or len(piece) < 2:
                continue
            for cut in range(1, len(piece)):
                left, right = ids.get(piece[:cut]), ids.get(piece[cut:])
                if left is not None and right is not None:
                    found.append((-self.scores[i], i, left, right))
        found.sort()
        return [(self.tokens[left], self.tokens[right]) for _, _, left, right in found]

    def converted(self) -> Any:
        from tokenizers import AddedToken, Tokenizer, decoders, normalizers
        from tokenizers.models import BPE

        vocab = {t: i for i, t in enumerate(self.tokens)}
        unk = next((i for i, t in enumerate(self.types) if t == _UNKNOWN), None)
        model = BPE(
            vocab,
            self.merges(),
            unk_token=self.tokens[unk] if unk is not None else None,
            fuse_unk=True,
            byte_fallback=True,
            dropout=None,
        )
        tokenizer = Tokenizer(model)
        steps = [normalizers.Replace(" ", "▁")]
        if self.add_prefix_space:
            steps.insert(0, normalizers.Prepend("▁"))
        tokenizer.normalizer = normalizers.Sequence(steps)
        decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if self.add_prefix_space:
            decode.append(decoders.Strip(content=" ", left=1))
        tokenizer.decoder = decoders.Sequence(decode)
        special = [t for t, k in zip(self.tokens, self.types) if k in (_CONTROL, _UNKNOWN)]
        text = [t for t, k in zip(self.tokens, self.types) if k == _USER_DEFINED]
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in text])
        if tokenizer.get_vocab_size(with_added_tokens=True) != len(self.tokens):
            raise CorruptSourceError("the SentencePiece vocabulary's special tokens are not all in it")
        return tokenizer


def register_gguf_families() -> None:
    """Teach transformers' GGUF tables SmolLM3 (Llama's key mapping and q/k un-permuting, a
    byte-level tokenizer), Phi-4-mini's byte-level vocabulary and Gemma's SentencePiece BPE one.
    Idempotent."""
    from transformers import modeling_gguf_pytorch_utils as loader
    from transformers.integrations import ggml

    if "smollm3" not in ggml.GGUF_CONFIG_MAPPING:
        ggml.GGUF_CONFIG_MAPPING["smollm3"] = dict(cast(dict[str, Any], ggml.GGUF_CONFIG_MAPPING["llama"]))
    if "smollm3" not in loader.GGUF_SUPPORTED_ARCHITECTURES:
        loader.GGUF_SUPPORTED_ARCHITECTURES.append("smollm3")
    loader.TENSOR_PROCESSORS.setdefault("smollm3", loader.LlamaTensorProcessor)
    # the table holds converter classes; a function that returns a converter is called the same way
    ggml.GGUF_TO_FAST_CONVERTERS["smollm3"] = cast(Any, _smollm3_tokenizer)
    ggml.GGUF_TO_FAST_CONVERTERS["phi3"] = cast(Any, _phi3_tokenizer)
    ggml.GGUF_TO_FAST_CONVERTERS["qwen2"] = cast(Any, _qwen2_tokenizer)
    for family in ("gemma2", "gemma3_text"):  # SentencePiece BPE, not transformers' Unigram
        ggml.GGUF_TO_FAST_CONVERTERS[family] = cast(Any, GemmaSentencePiece)
    for arch in UNKNOWN_TO_TRANSFORMERS:  # read by export.gguf_import; transformers reads the vocabulary
        ggml.GGUF_CONFIG_MAPPING.setdefault(arch, {})
        if arch not in loader.GGUF_SUPPORTED_ARCHITECTURES:
            loader.GGUF_SUPPORTED_ARCHITECTURES.append(arch)
