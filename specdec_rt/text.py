"""Text in and out: the model's tokenizer, its chat template, and incremental detokenization."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Sequence

from .errors import InvalidInputError, ModelLoadError

__all__ = ["TextCodec", "IncrementalDecoder"]


class TextCodec:
    """Encodes prompts (plain text or chat messages) and decodes generated ids.

    ``tokenizer_file``: a ``tokenizer.json``; ``chat_template``: a Jinja template with the Hugging
    Face conventions (``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``).
    """

    def __init__(self, tokenizer_file: str | Path, *, add_bos: bool = False, bos_id: int | None = None,
                 chat_template: str | None = None) -> None:
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exceptions
            raise ModelLoadError(f"{tokenizer_file}: cannot load tokenizer: {exc}") from exc
        self.add_bos, self.bos_id, self.chat_template = add_bos, bos_id, chat_template
        self._template = None

    @classmethod
    def from_manifest(cls, m) -> "TextCodec":
        return cls(m.tokenizer_file, add_bos=m.add_bos, bos_id=m.bos_id, chat_template=m.chat_template)

    def token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.tokenizer.id_to_token(int(token_id)) or "")

    def encode(self, text: str) -> list[int]:
        """Plain text -> ids (with BOS in front when the model wants one)."""
        if not isinstance(text, str):
            raise InvalidInputError(f"prompt must be a string or a list of chat messages, got {type(text).__name__}")
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if self.add_bos and self.bos_id is not None else []) + ids

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """Chat messages -> the prompt text, through the model's chat template."""
        if self.chat_template is None:
            raise InvalidInputError("this model has no chat template; pass a plain string prompt")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidInputError("chat messages must be a non-empty list of {'role': ..., 'content': ...}")
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(msg.get("content"), str):
                raise InvalidInputError(f"chat message {i} must be a dict with string 'role' and 'content', got {msg!r}")
        try:
            return self._compiled().render(
                messages=list(messages), add_generation_prompt=add_generation_prompt,
                bos_token=self.token_text(self.bos_id), eos_token="",
            )
        except InvalidInputError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template error is the input's problem
            raise InvalidInputError(f"chat template failed on these messages: {exc}") from exc

    def encode_prompt(self, prompt: str | Sequence[dict]) -> list[int]:
        """A string is plain text; a list of messages goes through the chat template (which holds
        any special tokens itself, so no BOS is added)."""
        if isinstance(prompt, str):
            return self.encode(prompt)
        return self.tokenizer.encode(self.render_chat(prompt), add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def decoder(self) -> "IncrementalDecoder":
        return IncrementalDecoder(self)

    def _compiled(self):
        if self._template is None:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise InvalidInputError(f"chat template rejected the messages: {message}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._template = env.from_string(self.chat_template)
            except TemplateError as exc:
                raise ModelLoadError(f"the model's chat template does not compile: {exc}") from exc
        return self._template


class IncrementalDecoder:
    """Turns a growing list of ids into text deltas that never split a UTF-8 character.

    Byte-level tokenizers can end a token in the middle of a multi-byte character; the decoded
    text then ends in U+FFFD. Such a tail is held back until the next tokens complete it. Decoding
    restarts a few tokens back (``prefix_offset``) so that merges and leading spaces come out as
    in a full decode. The deltas concatenate to ``codec.decode(all ids)``.
    """

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self.ids: list[int] = []
        self._prefix = 0  # decode from here, so context-dependent spacing is right
        self._read = 0  # text up to here was already emitted

    def push(self, ids: Sequence[int]) -> str:
        """Add ids; return the newly final text (possibly empty)."""
        self.ids.extend(int(i) for i in ids)
        before = self.codec.decode(self.ids[self._prefix : self._read])
        after = self.codec.decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (at the end of generation)."""
        before = self.codec.decode(self.ids[self._prefix : self._read])
        after = self.codec.decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return after[len(before) :]
