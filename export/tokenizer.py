"""Tokenizer loading, the GGUF special-token fix, saving, and the draft/target identity check.

The runtime never loads transformers: it calls `tokenizers.Tokenizer.from_file("tokenizer.json")
.encode(text, add_special_tokens=False)` and prepends `bos` when the manifest's `add_bos` is
true. `check_encoding` proves that this reproduces `AutoTokenizer` on plain text and on a
rendered chat template before a folder is published.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec_rt.manifest_schema import TEXT_TAGS
from specdec_rt.text.vocab_match import vocabulary_mismatch

from .errors import CorruptSourceError, TokenizerMismatchError, one_line
from .gguf_meta import read_gguf_info

__all__ = [
    "TOKENIZER_FILES",
    "TokenizerInfo",
    "load_tokenizer",
    "save_tokenizer",
    "compare_tokenizers",
    "check_encoding",
    "SAMPLE_TEXTS",
]

#: a model folder's tokenizer, copied as they are where a draft shares its target's
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")

SAMPLE_TEXTS = [
    "Hello world! Write a Python function that reverses a string.",
    "def add(a, b):\n    return a + b  # 123 4567\n\n\tprint(add(1, 2))",
    "  leading spaces, ÜNÏCÖDÉ, emoji 🙂 and 中文.",
]
_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hi in French."},
    {"role": "assistant", "content": "Salut !"},
    {"role": "user", "content": "And in German?"},
]


@dataclass(frozen=True)
class TokenizerInfo:
    """What the manifest and generation config record about the tokenizer."""

    bos: int | None
    eos: list[int]
    pad: int | None
    add_bos: bool
    chat_template: str | None


def load_tokenizer(folder: Path, gguf_file: str | None = None) -> Any:
    """A fast (`tokenizer.json`-backed) tokenizer from a checkpoint folder or a GGUF file.

    GGUF: transformers 4.57 ignores the file's own `tokenizer.ggml.eos_token_id` and
    `add_bos_token` (SmolLM2 gets eos `<|im_start|>` and add_bos on); the GGUF's values win.
    """
    from transformers import AutoTokenizer

    from .gguf_families import register_gguf_families
    from .gguf_import import IMPORTED_FAMILIES, load_imported_tokenizer

    try:
        if gguf_file:
            register_gguf_families()  # SmolLM3, Phi-4-mini's byte-level vocabulary
        if gguf_file and read_gguf_info(Path(folder) / gguf_file).architecture in IMPORTED_FAMILIES:
            tok = load_imported_tokenizer(Path(folder) / gguf_file)
        else:
            tok = AutoTokenizer.from_pretrained(  # type: ignore[no-untyped-call]  # transformers: unannotated
                str(folder), gguf_file=gguf_file
            )
    except Exception as exc:  # noqa: BLE001 - any loader failure is a source problem
        raise CorruptSourceError(f"cannot load the tokenizer from {folder}: {one_line(exc)}") from exc
    if not getattr(tok, "is_fast", False):
        raise CorruptSourceError(f"{folder} has no fast tokenizer (tokenizer.json)")
    if gguf_file:
        _apply_gguf_specials(tok, Path(folder) / gguf_file)
    return tok


def _apply_gguf_specials(tok: Any, path: Path) -> None:
    """Set eos/bos/pad and add_bos from the GGUF's tokenizer metadata, and register its
    CONTROL/USER_DEFINED tokens as special added tokens (transformers 4.57 registers only
    three for Qwen2, so `<|fim_prefix|>` was split into pieces)."""
    from tokenizers import AddedToken

    info = read_gguf_info(path)
    meta = info.metadata
    known = set(tok.get_added_vocab())
    extra = [t for t in info.special_tokens() if t not in known]
    # Tags a model writes as part of its answer (Qwen2.5's `<tool_call>`, `special: false` in its
    # own tokenizer) stay text: decoding must keep them. The runtime fixes older exports at load.
    for t in extra:  # one at a time, in the file's order (a token new to the vocabulary gets the next id)
        special = t not in TEXT_TAGS
        tok.add_tokens([AddedToken(t, special=special, normalized=False)], special_tokens=special)

    for attr, key in (("eos_token", "eos_token_id"), ("bos_token", "bos_token_id"), ("pad_token", "padding_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and token_id < len(tok):
            setattr(tok, attr, tok.convert_ids_to_tokens(int(token_id)))
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    _set_add_bos(tok, bool(add_bos) if add_bos is not None else _adds_bos(tok))


def _adds_bos(tok: Any) -> bool:
    """Whether `tok(text)` (special tokens on) starts with bos."""
    ids = tok("a")["input_ids"]
    return tok.bos_token_id is not None and bool(ids) and ids[0] == tok.bos_token_id


def _set_add_bos(tok: Any, flag: bool) -> None:
    """Make `tok(text)` prepend bos iff `flag` (class setter, else a template post-processor)."""
    if _adds_bos(tok) == flag:
        return
    if hasattr(type(tok), "add_bos_token") and hasattr(tok, "update_post_processor"):
        tok.add_bos_token = flag  # LlamaTokenizerFast: rebuilds its post-processor
    else:
        from tokenizers import processors

        bos = tok.bos_token
        tok.backend_tokenizer.post_processor = (
            processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.bos_token_id)]
            )
            if flag
            else processors.ByteLevel(trim_offsets=False)
        )
    if _adds_bos(tok) != flag:
        raise CorruptSourceError(f"cannot set add_bos={flag} on {type(tok).__name__}")


def tokenizer_info(tok: Any, generation_config: Any = None) -> TokenizerInfo:
    """Special ids for the manifest: eos is the tokenizer's plus the generation config's."""
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    gen_eos = getattr(generation_config, "eos_token_id", None) if generation_config else None
    for extra in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
        if extra is not None and extra not in eos:
            eos.append(int(extra))
    return TokenizerInfo(
        bos=tok.bos_token_id,
        eos=eos,
        pad=tok.pad_token_id,
        add_bos=_adds_bos(tok),
        chat_template=tok.chat_template or None,
    )


def save_tokenizer(tok: Any, out_dir: Path, generation_config: Any) -> TokenizerInfo:
    """Write tokenizer.json, tokenizer_config.json (chat template inside) and
    generation_config.json (eos list, bos, pad) into `out_dir`."""
    info = tokenizer_info(tok, generation_config)
    tok.save_pretrained(str(out_dir), save_jinja_files=False, legacy_format=False)
    generation_config.eos_token_id = info.eos if len(info.eos) > 1 else info.eos[0]
    generation_config.bos_token_id = info.bos
    generation_config.pad_token_id = info.pad
    generation_config.save_pretrained(str(out_dir))
    return info


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def compare_tokenizers(target: Any, draft: Any) -> None:
    """Raise `TokenizerMismatchError` naming the first id whose meaning differs between draft and
    target (`specdec_rt.text.vocab_match`: the same ordinary tokens and merges; special tokens,
    bos / eos and the chat template may differ, since the draft reads and proposes the target's
    ids and is given the target's tokenizer files)."""
    why = vocabulary_mismatch(target.backend_tokenizer.to_str(), draft.backend_tokenizer.to_str())
    if why is not None:
        raise TokenizerMismatchError(
            f"draft tokenizer differs from the target's ({why}); a draft must share the target's ordinary tokens"
        )


def check_encoding(out_dir: Path, info: TokenizerInfo) -> None:
    """Prove the runtime's `tokenizers` recipe reproduces `AutoTokenizer` on saved files."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    fast = Tokenizer.from_file(str(Path(out_dir) / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(str(out_dir))  # type: ignore[no-untyped-call]  # transformers: unannotated
    texts = list(SAMPLE_TEXTS)
    if info.chat_template:
        texts.append(hf.apply_chat_template(_CHAT, tokenize=False, add_generation_prompt=True))
    for i, text in enumerate(texts):
        ids = fast.encode(text, add_special_tokens=False).ids
        if info.add_bos and i < len(SAMPLE_TEXTS):  # plain text; templates carry their own bos
            ids = [info.bos] + ids
        want = hf(text)["input_ids"] if i < len(SAMPLE_TEXTS) else hf(text, add_special_tokens=False)["input_ids"]
        if ids != want:
            raise CorruptSourceError(f"saved tokenizer.json does not reproduce the tokenizer on sample {i}")
