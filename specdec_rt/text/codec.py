"""Text in and out: the model's tokenizer, its chat template, and incremental detokenization.

Two kinds of untrusted input pass through here (docs/security.md):

- The chat template comes from the model folder. It renders in a Jinja sandbox that is also
  bounded in size, steps and time (:mod:`specdec_rt.text.template_sandbox`). Going over any bound is
  an ``InvalidInputError`` naming the template.
- The tokenizer file comes from the model folder too: its size is bounded before it is parsed,
  and how much it can expand text is checked when it is loaded
  (:mod:`specdec_rt.text.tokenizer_checks`); each text's characters times that bound are checked
  before it is encoded. A failure inside the tokenizers library (a panic of its Rust code,
  raised as a ``BaseException``) is an :class:`~specdec_rt.errors.InferenceError`.
- Chat message content comes from users. By default the text of a special token in a message
  (``<|im_end|>``) is encoded as plain text, never as the control token; only the template
  itself writes control tokens. ``allow_special`` lets trusted callers opt out.
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterable, NoReturn, Sequence

from ..checks import brief_repr
from ..errors import InferenceError, InvalidInputError, ModelLoadError
from ..logs import get_logger
from ..manifest_schema import TEXT_TAGS
from .template_sandbox import (
    TEMPLATE_MAX_STEPS,
    TEMPLATE_MIN_CHARS,
    TEMPLATE_TIMEOUT_S,
    TemplateBudgetError,
    TemplateMethodError,
    compile_template,
    new_environment,
    render_bounded,
)
from .tokenizer_checks import MAX_ENCODE_TOKENS, PASS_THROUGH, check_tokenizer
from .tools import CALL_OPEN, nested_strings, supports_tools, template_messages

__all__ = ["TextCodec", "IncrementalDecoder", "TemplateLimitError", "TemplateMethodRefusedError", "MAX_TOKENIZER_BYTES"]

log = get_logger("specdec_rt.text.codec")

MAX_TOKENIZER_BYTES = 128 << 20  # a tokenizer.json larger than this is refused before it is parsed


class TemplateLimitError(InvalidInputError):
    """The chat template went over a bound of its rendering (time, size, steps, a method it may
    not call); the message names the template."""


class TemplateMethodRefusedError(TemplateLimitError):
    """The chat template called a method the sandbox does not offer (refused at once, at no cost)."""


# a short conversation that every chat template must render within its bounds when it is loaded
PROBE_CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello! What can you do?"},
    {"role": "assistant", "content": "I can answer questions."},
    {"role": "user", "content": "Tell me a short story."},
]


def _tags_as_text(tokenizer: Any) -> Any:
    """``tokenizer`` with :data:`TEXT_TAGS` no longer special (decoded as their text; still
    matched whole when encoding, as any added token)."""
    from tokenizers import Tokenizer

    doc = json.loads(tokenizer.to_str())
    for tok in doc.get("added_tokens", []):
        if tok.get("content") in TEXT_TAGS:
            tok["special"] = False
    return Tokenizer.from_str(json.dumps(doc))


def _structured_fields(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
) -> list[tuple[str, Any]]:
    """``(name, value)`` of what a template renders from structures rather than strings: the
    ``tools`` and each message's ``tool_calls``."""
    return [("tools", tools or [])] + [
        (f"messages[{i}].tool_calls", m["tool_calls"]) for i, m in enumerate(messages) if m.get("tool_calls")
    ]


class TextCodec:
    """Encodes prompts (plain text or chat messages) and decodes generated ids.

    ``tokenizer_file``: a ``tokenizer.json``; ``chat_template``: a Jinja template with the Hugging
    Face conventions (``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``).
    ``allow_special_in_content``: when False (the default), the text of a special token inside a
    chat message (``"<|im_end|>"``) is encoded as plain text; only the template writes control
    tokens. ``template_timeout_s`` / ``template_max_chars`` bound one rendering of the template
    (default output budget: 1 MiB plus 4 x the characters of the messages).
    """

    def __init__(
        self,
        tokenizer_file: str | Path,
        *,
        add_bos: bool = False,
        bos_id: int | None = None,
        chat_template: str | None = None,
        allow_special_in_content: bool = False,
        template_timeout_s: float = TEMPLATE_TIMEOUT_S,
        template_max_chars: int | None = None,
        template_source: str | None = None,
    ) -> None:
        self.tokenizer, data = _read_tokenizer(tokenizer_file)
        #: the sha256 of the tokenizer file as it was read (see :mod:`specdec_rt.text.encode_process`)
        self.tokenizer_sha256 = hashlib.sha256(data).hexdigest()
        if any(t.special and t.content in TEXT_TAGS for t in self.tokenizer.get_added_tokens_decoder().values()):
            self.tokenizer = _tags_as_text(self.tokenizer)
        #: how many tokens a character can become at most (checked: a tokenizer past the limits is refused)
        self.expansion = check_tokenizer(self.tokenizer, str(tokenizer_file))
        self.tokenizer_file = Path(tokenizer_file)
        self.add_bos, self.bos_id, self.chat_template = add_bos, bos_id, chat_template
        self.allow_special_in_content = allow_special_in_content
        self.template_timeout_s, self.template_max_chars = template_timeout_s, template_max_chars
        self.template_source = template_source or f"the chat template of {tokenizer_file}"
        self._template: tuple[str | None, Any] | None = None  # (the text, compiled)
        self._plain = None  # a copy of the tokenizer that encodes special tokens as plain text
        self._kinds: frozenset[str] | None = None  # the decoder's step types (token_bytes)
        self._byte_ids: frozenset[int] | None = None  # byte-fallback pieces (is_byte_piece)
        specials = {i: t for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special and t.content}
        self._special_ids = frozenset(specials)
        self._special_tokens = {i: t for i, t in specials.items()}
        texts = sorted({t.content for t in specials.values()}, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, texts))) if texts else None

    @classmethod
    def from_manifest(cls, m: Any, **options: Any) -> "TextCodec":
        """The codec of a model folder's manifest, its chat template checked (:meth:`check_template`)."""
        codec = cls(
            m.tokenizer_file,
            add_bos=m.add_bos,
            bos_id=m.bos_id,
            chat_template=m.chat_template,
            template_source=f"the chat template in {Path(m.folder) / 'manifest.json'}",
            **options,
        )
        codec.check_template()
        return codec

    def check_template(self) -> None:
        """:class:`ModelLoadError` naming the template when it does not compile, or goes over a
        bound of its time, size or steps on a short conversation (:data:`PROBE_CHAT`): every
        request would spend that budget before its refusal. A template that calls a method the
        sandbox does not offer is refused at once, at no cost, by each chat request (a 400
        naming the method): it loads, with a warning, so that its other requests (completions,
        token ids) are served. A template that refuses the conversation itself
        (``raise_exception``) is left to the requests."""
        if self.chat_template is None:
            return
        for chat in (PROBE_CHAT, PROBE_CHAT[1:]):  # (the second: for templates without a system role)
            try:
                self._render(list(chat), True, chars=TEMPLATE_MIN_CHARS)  # (the template's, whatever the budget)
                return
            except TemplateMethodRefusedError as exc:
                log.warning("template.refused", error=str(exc), effect="every chat request gets a 400")
                return
            except TemplateLimitError as exc:
                raise ModelLoadError(f"{exc} (on a short conversation of {len(chat)} messages)") from None
            except InvalidInputError:
                continue

    def token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.tokenizer.id_to_token(int(token_id)) or "")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, alone (a byte-level token may hold part of a UTF-8
        character; a special token: its text). For log-probabilities' ``token`` / ``bytes``."""
        token_id = int(token_id)
        if token_id in self._special_ids:
            content: str = self._special_tokens[token_id].content
            return content.encode()
        piece = self.tokenizer.id_to_token(token_id) or ""
        kinds = self._decoder_kinds()
        if "ByteLevel" in kinds and all(c in _UNICODE_BYTE for c in piece):
            return bytes(_UNICODE_BYTE[c] for c in piece)
        if "ByteFallback" in kinds and (m := _BYTE_PIECE.fullmatch(piece)):
            return bytes([int(m.group(1), 16)])
        if kinds & {"Metaspace", "Replace"}:
            piece = piece.replace("\u2581", " ")
        return piece.encode("utf-8", "replace")

    def is_byte_piece(self, token_id: int) -> bool:
        """Whether ``token_id`` is a byte-fallback piece (``<0xC3>``) of a tokenizer whose decoder
        reads a run of them as one byte string: such a run decodes as a whole (an invalid run
        becomes one U+FFFD per piece), so a decoder must not cut text inside it."""
        if self._byte_ids is None:
            ids = (self.tokenizer.token_to_id(f"<0x{b:02X}>") for b in range(256))
            fallback = "ByteFallback" in self._decoder_kinds()
            self._byte_ids = frozenset(i for i in ids if i is not None) if fallback else frozenset()
        return int(token_id) in self._byte_ids

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a special token (``decode`` leaves it out)."""
        return int(token_id) in self._special_ids

    def _decoder_kinds(self) -> frozenset[str]:
        """The types of the tokenizer's decoder steps (e.g. ``{"ByteLevel"}``), read once."""
        if self._kinds is None:

            def walk(d: Any) -> list[str]:
                if not isinstance(d, dict):
                    return []
                return [str(d.get("type"))] + [k for sub in d.get("decoders") or [] for k in walk(sub)]

            self._kinds = frozenset(walk(json.loads(self.tokenizer.to_str()).get("decoder")))
        return self._kinds

    def encode(self, text: str) -> list[int]:
        """Plain text -> ids (with BOS in front when the model wants one). The text is the raw
        prompt: special-token strings in it are the special tokens."""
        if not isinstance(text, str):
            raise InvalidInputError(f"prompt must be a string or a list of chat messages, got {type(text).__name__}")
        ids: list[int] = self._tokenize(self.tokenizer, text, lambda: [("prompt", text)]).ids
        return ([self.bos_id] if self.add_bos and self.bos_id is not None else []) + ids

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Chat messages -> the prompt text, through the model's chat template (bounded: see the
        module docstring). Any role string is passed to the template as it is."""
        return self._render(self._check_messages(messages), add_generation_prompt)

    def _check_messages(self, messages: Any) -> list[dict[str, Any]]:
        """The messages, checked; OpenAI-style content parts (``[{"type": "text", "text": ...}]``)
        are joined into one string (other parts are refused)."""
        if self.chat_template is None:
            raise InvalidInputError("this model has no chat template; pass a plain string prompt")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidInputError("chat messages must be a non-empty list of {'role': ..., 'content': ...}")
        out = []
        for i, msg in enumerate(messages):
            content = msg.get("content") if isinstance(msg, dict) else None
            if content is None and isinstance(msg, dict) and msg.get("tool_calls"):  # calls only
                msg, content = {**msg, "content": ""}, ""
            if isinstance(content, list):
                if not all(
                    isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str) for c in content
                ):
                    raise InvalidInputError(
                        f"messages[{i}].content: only text parts "
                        f"({{'type': 'text', 'text': ...}}) can be read, got {brief_repr(content)}"
                    )
                msg = {**msg, "content": "".join(c["text"] for c in content)}
            if (
                not isinstance(msg, dict)
                or not isinstance(msg.get("role"), str)
                or not isinstance(msg.get("content"), str)
            ):
                raise InvalidInputError(
                    f"messages[{i}] must be a dict with string 'role' and 'content', got {brief_repr(msg)}"
                )
            out.append(msg)
        return out

    def _tokenize(self, tokenizer: Any, text: str, fields: Callable[[], Iterable[tuple[str, str]]]) -> Any:
        """``tokenizer.encode(text)``; a failure is the input's: :class:`InvalidInputError` naming
        the field. ``fields()`` (called only on failure) yields ``(name, value)`` for the strings
        the text came from. The tokenizer raises ``TypeError`` for a lone surrogate
        (``"\\ud800"``): that is not Unicode text, and the error names the first such field.
        A text that could become more than :data:`MAX_ENCODE_TOKENS` tokens (its characters times
        :attr:`expansion`) is refused before it is encoded; a panic of the tokenizer is an
        :class:`InferenceError`."""
        bound = self.expansion
        if bound.tokens(len(text)) > MAX_ENCODE_TOKENS:
            raise InvalidInputError(
                f"the prompt has {len(text)} characters of text, which this model's tokenizer could turn "
                f"into up to {bound.tokens(len(text)):.0f} tokens ({bound.per_char:g} a character, "
                f"set by its {bound.by}), more than the {MAX_ENCODE_TOKENS} one text may"
            )
        if bound.normalizes and tokenizer.normalizer is not None:  # (Unicode writes up to 18 characters for one)
            try:
                normalized = len(tokenizer.normalizer.normalize_str(text))
            except PASS_THROUGH:
                raise
            except BaseException:  # (the encoding below says what is wrong with the text)
                normalized = 0
            if normalized * bound.per_normalized_char > MAX_ENCODE_TOKENS:
                raise InvalidInputError(
                    f"the prompt has {len(text)} characters of text, {normalized} once this model's tokenizer "
                    f"normalized them, which it could turn into up to {normalized * bound.per_normalized_char:.0f} "
                    f"tokens, more than the {MAX_ENCODE_TOKENS} one text may"
                )
        try:  # a batch of one: the same encoding, but the GIL is released while it runs (decision 0011)
            return tokenizer.encode_batch([text], add_special_tokens=False)[0]
        except PASS_THROUGH:
            raise
        except BaseException as exc:
            if not isinstance(exc, Exception):  # a panic in the tokenizers library (PanicException)
                raise _native_failure("encoding the prompt", exc) from exc
            for name, value in fields():
                at = _bad_unicode(value)
                if at:
                    raise InvalidInputError(
                        f"{name} is not valid Unicode text: a lone surrogate {value[at - 1]!r} at index {at - 1}"
                    ) from exc
            raise InvalidInputError(f"the prompt cannot be tokenized: {type(exc).__name__}: {exc}"[:300]) from exc

    @staticmethod
    def _message_fields(messages: Sequence[dict[str, Any]]) -> Callable[[], Iterable[tuple[str, str]]]:
        """``(messages[i].key, value)`` for the string fields of chat messages."""
        return lambda: (
            (f"messages[{i}].{k}", v) for i, msg in enumerate(messages) for k, v in msg.items() if isinstance(v, str)
        )

    def _render(
        self,
        messages: list[Any],
        add_generation_prompt: bool,
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        chars: int = 0,
    ) -> str:
        """The template rendered within its bounds; ``chars``: the output budget (0: the codec's)."""
        template = self._compiled()
        size = sum(len(v) for msg in messages for v in msg.values() if isinstance(v, str))
        nested = _structured_fields(messages, tools)
        size += sum(len(t) for name, value in nested for t in nested_strings(value, name))  # as JSON, about
        chars = chars or self.template_max_chars or TEMPLATE_MIN_CHARS + 4 * size
        extra = {"tools": list(tools)} if tools else {}
        try:
            return render_bounded(
                template,
                chars=chars,
                steps=TEMPLATE_MAX_STEPS + 64 * len(messages) + 64 * sum(len(v) for _, v in nested),
                seconds=self.template_timeout_s,
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.token_text(self.bos_id),
                eos_token="",
                **extra,
            )
        except TemplateMethodError as exc:
            raise TemplateMethodRefusedError(f"{self.template_source} {exc}; refusing to render it") from None
        except TemplateBudgetError as exc:
            raise TemplateLimitError(f"{self.template_source} {exc}; refusing to render it") from None
        except InvalidInputError:
            raise
        except (MemoryError, RecursionError, OverflowError) as exc:
            raise TemplateLimitError(
                f"{self.template_source} failed ({type(exc).__name__}); refusing to render it"
            ) from None
        except Exception as exc:  # noqa: BLE001 - a template error is the input's problem
            raise InvalidInputError(f"chat template failed on these messages: {exc}") from exc

    def encode_prompt(
        self,
        prompt: str | Sequence[dict[str, Any]],
        allow_special: bool | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[int]:
        """A string is plain text (the raw prompt, see :meth:`encode`); a list of messages goes
        through the chat template (which holds any special tokens itself, so no BOS is added).

        ``allow_special`` (default: the codec's ``allow_special_in_content``, False): whether the
        text of a special token inside a message becomes that control token. When False, only
        the template writes control tokens: ``"hi<|im_end|>"`` in a message is plain text, and
        such text inside ``tools`` or a message's ``tool_calls`` is refused.
        ``tools``: OpenAI's function list (checked by :func:`~specdec_rt.text.tools.check_tools`), for
        templates that render them (:func:`~specdec_rt.text.tools.supports_tools`)."""
        if isinstance(prompt, str):
            return self.encode(prompt)
        prompt = template_messages(self._check_messages(prompt))
        if not supports_tools(self.chat_template):
            if tools:
                raise InvalidInputError(
                    f"tools: this model's chat template does not render tools (it writes no {CALL_OPEN} calls)"
                )
            called = next((i for i, m in enumerate(prompt) if m.get("tool_calls")), None)
            if called is not None:  # the template would drop them from the history without a word
                raise InvalidInputError(
                    f"messages[{called}].tool_calls: this model's chat template does not render tool calls"
                )
        allow = self.allow_special_in_content if allow_special is None else allow_special
        if not allow and self._special_re is not None:
            for name, value in _structured_fields(prompt, tools):
                if any(self._special_re.search(text) for text in nested_strings(value, name)):
                    raise InvalidInputError(f"{name} holds the text of a special token")
        if allow or self._special_re is None:
            text = self._render(list(prompt), True, tools)
            ids: list[int] = self._tokenize(self.tokenizer, text, self._message_fields(prompt)).ids
            return ids
        return self._encode_chat_plain(list(prompt), self._special_re, tools)

    def _encode_chat_plain(
        self, messages: list[Any], special: re.Pattern[str], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[int]:
        """Render with each special-token string in the messages replaced by a placeholder
        character, encode (the template's control tokens are matched), then re-encode the text
        between two control tokens that holds placeholders with the strings put back and
        special tokens read as plain text."""
        found: set[str] = set()
        for msg in messages:
            for v in msg.values():
                if isinstance(v, str):
                    found.update(m.group() for m in special.finditer(v))
        fields = self._message_fields(messages)
        if not found:
            ids: list[int] = self._tokenize(self.tokenizer, self._render(messages, True, tools), fields).ids
            return ids
        holder = _placeholders(messages, found, self.chat_template or "")
        pattern = re.compile("|".join(map(re.escape, holder)))
        swapped = [
            {k: pattern.sub(lambda m: holder[m.group()], v) if isinstance(v, str) else v for k, v in msg.items()}
            for msg in messages
        ]
        text = self._render(swapped, True, tools)
        return self._reencode(text, self._tokenize(self.tokenizer, text, fields), holder, fields)

    def _reencode(
        self, text: str, enc: Any, holder: dict[str, str], fields: Callable[[], Iterable[tuple[str, str]]]
    ) -> list[int]:
        """``enc`` (the encoding of ``text``) with each stretch between two control tokens that
        holds a placeholder encoded again, the strings put back and read as plain text."""
        back = {ph: original for original, ph in holder.items()}
        ids = enc.ids
        cuts = [i for i, t in enumerate(ids) if t in self._special_ids]
        # the offsets of the cuts only: all of them, as Python tuples, hold the GIL ~0.3 us a token
        offsets = {i: enc.token_to_chars(i) for i in cuts}
        out: list[int] = []
        unplace = re.compile("|".join(map(re.escape, back)))
        bounds = [-1] + cuts + [len(ids)]
        for lo, hi in zip(bounds, bounds[1:]):  # special tokens at lo and hi (or the ends)
            start = offsets[lo][1] if lo >= 0 else 0
            end = offsets[hi][0] if hi < len(ids) else len(text)
            segment = text[start:end]
            if lo >= 0:
                out.append(ids[lo])
            if not any(ph in segment for ph in back):
                out.extend(ids[lo + 1 : hi])
                continue
            if lo >= 0 and self._special_tokens[ids[lo]].rstrip:
                segment = segment.lstrip()
            if hi < len(ids) and self._special_tokens[ids[hi]].lstrip:
                segment = segment.rstrip()
            out.extend(
                self._tokenize(self._plain_tokenizer(), unplace.sub(lambda m: back[m.group()], segment), fields).ids
            )
        return out

    def _plain_tokenizer(self) -> Any:
        if self._plain is None:
            from tokenizers import Tokenizer

            plain = Tokenizer.from_str(self.tokenizer.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    def decode(self, ids: Sequence[int]) -> str:
        try:
            text: str = self.tokenizer.decode(list(ids), skip_special_tokens=True)
            return text
        except PASS_THROUGH:
            raise
        except BaseException as exc:
            if isinstance(exc, Exception):
                raise
            raise _native_failure("decoding the answer", exc) from exc

    def decoder(self) -> "IncrementalDecoder":
        return IncrementalDecoder(self)

    def _compiled(self) -> Any:
        if self.chat_template is None:
            raise InvalidInputError("this model has no chat template; pass a plain string prompt")
        if self._template is None or self._template[0] != self.chat_template:
            from jinja2.exceptions import TemplateError

            def raise_exception(message: Any) -> NoReturn:
                raise InvalidInputError(f"chat template rejected the messages: {message}"[:500])

            env = new_environment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(str(fmt)[:64])
            try:
                self._template = (self.chat_template, compile_template(env, self.chat_template))
            except (TemplateError, RecursionError) as exc:
                raise ModelLoadError(f"{self.template_source} does not compile: {exc}") from exc
        return self._template[1]


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character that stands for each byte."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)}
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_UNICODE_BYTE = _byte_alphabet()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _native_failure(what: str, exc: BaseException) -> InferenceError:
    """The tokenizers library's panic (a ``BaseException``) while ``what``, as our error."""
    return InferenceError(f"the model's tokenizer failed while {what}: {type(exc).__name__}: {exc}"[:300])


def _bad_unicode(text: str) -> int:
    """0 if ``text`` is valid Unicode (encodable as UTF-8), else 1 + the index of a lone surrogate."""
    try:
        text.encode("utf-8")
        return 0
    except UnicodeEncodeError as exc:
        return exc.start + 1


class IncrementalDecoder:
    """Turns a growing list of ids into text deltas that never split a UTF-8 character.

    Byte-level tokenizers can end a token in the middle of a multi-byte character; the decoded
    text then ends in U+FFFD. Such a tail is held back until the next tokens complete it; so is a
    tail of byte-fallback pieces, whose run decodes as a whole (valid or not). Decoding
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
        held = after.endswith("\ufffd") or (bool(self.ids) and self.codec.is_byte_piece(self.ids[-1]))
        if len(after) > len(before) and not held:
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (at the end of generation)."""
        before = self.codec.decode(self.ids[self._prefix : self._read])
        after = self.codec.decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return after[len(before) :]


def _read_tokenizer(tokenizer_file: str | Path) -> tuple[Any, bytes]:
    """The parsed tokenizer and the file's bytes, read once (digested, so that a copy in
    another process can check it); sized before it is parsed: a hostile folder's 20 GB
    "tokenizer" must not be read. A ModelLoadError when it cannot be read or parsed."""
    from tokenizers import Tokenizer

    try:
        size = Path(tokenizer_file).stat().st_size
    except OSError as exc:
        raise ModelLoadError(f"{tokenizer_file}: cannot load tokenizer: {exc.strerror or exc}") from exc
    if size > MAX_TOKENIZER_BYTES:
        raise ModelLoadError(
            f"{tokenizer_file}: {size} bytes, more than the {MAX_TOKENIZER_BYTES} a "
            "tokenizer may have (the largest real ones are ~35 MB)"
        )
    try:
        with open(tokenizer_file, "rb") as f:
            data = f.read(MAX_TOKENIZER_BYTES + 1)
        if len(data) > MAX_TOKENIZER_BYTES:
            raise ValueError(f"it grew past {MAX_TOKENIZER_BYTES} bytes while it was read")
        return Tokenizer.from_str(data.decode("utf-8")), data
    except PASS_THROUGH:
        raise
    except BaseException as exc:  # plain Exceptions, or a panic of the tokenizers library
        raise ModelLoadError(f"{tokenizer_file}: cannot load tokenizer: {exc}") from exc


def _placeholders(messages: list[dict[str, Any]], found: set[str], template: str) -> dict[str, str]:
    """A private-use character for each string of ``found`` (longest first), one that neither
    the messages nor the chat ``template`` use."""
    used = set(template)
    for msg in messages:
        for v in msg.values():
            if isinstance(v, str):
                used.update(v)
    free = (chr(c) for c in range(0xF0000, 0x10FFFE) if chr(c) not in used)  # private use
    return {text: next(free) for text in sorted(found, key=len, reverse=True)}
