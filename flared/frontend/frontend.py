"""The frontend of one served model: its tokenizer, chat template and token settings.

Rules:
- ``Frontend.load`` hashes each asset and parses it from the same bytes, so
  the fingerprint checked is the content used. Any mismatch or parse failure
  is a FrontendError naming the file; nothing is downloaded and transformers
  is never imported.
- ``render_chat`` renders with the chat template (transformers semantics, see
  template.py) and tokenizes the prompt without adding special tokens, as
  ``apply_chat_template(tokenize=True)`` does: the template writes BOS itself,
  so there is never a double BOS.
- Template kwargs: the template defaults given at load fill what a request
  leaves out; explicit request values win. Special tokens (bos_token, ...)
  come from TokenSettings.
- Template failures (``raise_exception``, undefined names, type errors) become
  FrontendError(TEMPLATE), a 400 carrying the template's own message.
- Every method is safe to call from several frontend worker threads at once;
  none of them may run on the event loop (``render_chat_async`` hops off it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import jinja2

from flared.errors import ErrorKind, FrontendError
from flared.frontend.detokenizer import Detokenizer, IncrementalDecoder, TokenBytes, WindowPieceIds
from flared.frontend.endpoints import char_to_byte_offsets, token_endpoints
from flared.frontend.template import ChatTemplate


@dataclasses.dataclass(frozen=True)
class TokenSettings:
    """Token facts a prepared core records for its tokenizer (see GGUFTokenizerAssets)."""

    bos_token: str | None = None
    eos_token: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    add_bos_token: bool = False  # what the tokenizer's post-processor does for plain encode
    add_eos_token: bool = False
    unk_token: str | None = None
    pad_token: str | None = None

    def __post_init__(self):
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise FrontendError(f"TokenSettings.{name} must be a non-negative int, got {value!r}",
                                    ErrorKind.TOKENIZER)
        for token, token_id, name in ((self.bos_token, self.bos_token_id, "bos"),
                                      (self.eos_token, self.eos_token_id, "eos")):
            if (token is None) != (token_id is None):
                raise FrontendError(f"TokenSettings: {name}_token and {name}_token_id must be given together",
                                    ErrorKind.TOKENIZER)
        if self.add_bos_token and self.bos_token is None:
            raise FrontendError("TokenSettings: add_bos_token without a bos_token", ErrorKind.TOKENIZER)
        if self.add_eos_token and self.eos_token is None:
            raise FrontendError("TokenSettings: add_eos_token without an eos_token", ErrorKind.TOKENIZER)

    @classmethod
    def from_gguf_assets(cls, assets) -> TokenSettings:
        return cls(bos_token=assets.bos_token, eos_token=assets.eos_token, bos_token_id=assets.bos_token_id,
                   eos_token_id=assets.eos_token_id, add_bos_token=assets.add_bos_token,
                   add_eos_token=assets.add_eos_token, unk_token=assets.unk_token, pad_token=assets.pad_token)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, for a core manifest."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any]) -> TokenSettings:
        """The inverse of to_dict; unknown keys are an error (a manifest from a newer format)."""
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise FrontendError(f"TokenSettings: unknown fields {unknown}", ErrorKind.TOKENIZER)
        return cls(**fields)

    def special_tokens_map(self) -> dict[str, str]:
        """The special-token variables a chat template sees."""
        names = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                 "unk_token": self.unk_token, "pad_token": self.pad_token}
        return {name: token for name, token in names.items() if token is not None}


class EndpointStrategy(enum.Enum):
    """How an unannotated template's message endpoints are found (a {% mark %} template uses its marks)."""

    # One render of a copy of the template with a mark at the end of every iteration of each loop
    # over the messages that emits output; falls back to PREFIX_RENDERS when there is no such loop.
    AUTO_MARKS = "auto_marks"
    # Render the conversation cut after each message; keep the ends that are exact byte prefixes
    # of the full prompt. One extra render per message.
    PREFIX_RENDERS = "prefix_renders"


@dataclasses.dataclass(frozen=True)
class RenderedChat:
    """A rendered, tokenized prompt and where its complete messages end."""

    text: str
    token_ids: list[int]
    # Token index at the end of every complete message (prefix-cache checkpoints): sorted,
    # unique, 0 < index < len(token_ids).
    message_endpoints: tuple[int, ...]
    # The byte endpoints they came from (UTF-8 offsets into text), including ones a token crosses.
    byte_endpoints: tuple[int, ...]
    # A vision model's images (flared.frontend.images.PreparedImage), in prompt order: each one's placeholder
    # was replaced by its prompt text before tokenizing; and where their tokens sit (flared.runtime.request's
    # VisionInput, its rows not yet made). Set by the caller that prepared them.
    images: tuple = ()
    vision: object = None
    # Where the template put the media: the index (in the parts' order) of the media item each placeholder in the
    # text stands for, in text order (a template may write a turn's images before its videos); None: in order.
    media_order: tuple[int, ...] | None = None

    @property
    def prompt_bytes(self) -> bytes:
        return self.text.encode("utf-8")


def _expand_images(text: str, char_endpoints, prompts: tuple[str, ...], placeholder):
    """``text`` with each media placeholder replaced by its item's prompt, the endpoints moved with it, and the
    items' order in the text. ``placeholder``: one for every prompt, or each prompt's own (images and videos: the
    template writes each kind's). The k-th placeholder of a kind stands for the k-th item of that kind (a template
    may write a turn's images before its videos)."""
    placeholders = (placeholder,) * len(prompts) if isinstance(placeholder, str) else tuple(placeholder)
    kinds = sorted(set(placeholders), key=len, reverse=True)
    found = list(re.finditer("|".join(re.escape(k) for k in kinds), text)) if kinds else []
    if sorted(m.group() for m in found) != sorted(placeholders):
        wrote = ", ".join(f"{sum(m.group() == k for m in found)} {k}" for k in kinds)
        wanted = ", ".join(f"{placeholders.count(k)} {k}" for k in kinds)
        raise FrontendError(f"the chat template wrote media placeholders ({wrote}) that do not match the request's "
                            f"media ({wanted}; a message's text may not spell a placeholder)", ErrorKind.VALIDATION)
    queues = {k: [i for i, p in enumerate(placeholders) if p == k] for k in kinds}
    order = [queues[m.group()].pop(0) for m in found]
    out, starts, at, growth = [], [], 0, 0  # starts: (old offset just past a placeholder, growth)
    for index, m in zip(order, found):
        out += (text[at:m.start()], prompts[index])
        growth += len(prompts[index]) - (m.end() - m.start())
        starts.append((m.end(), growth))
        at = m.end()
    out.append(text[at:])

    def moved(c: int) -> int:
        shift = 0
        for end, g in starts:
            if c >= end:
                shift = g
        return c + shift

    return "".join(out), [moved(c) for c in char_endpoints], tuple(order)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_asset(path: str | os.PathLike, what: str, expected_sha256: str | None) -> tuple[bytes, str]:
    path = os.fspath(path)
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as exc:
        raise FrontendError(f"{what} {path}: cannot read ({exc.strerror or exc})",
                            ErrorKind.TOKENIZER if what == "tokenizer" else ErrorKind.TEMPLATE) from None
    digest = _sha256(data)
    if expected_sha256 is not None and digest != expected_sha256.lower():
        raise FrontendError(f"{what} {path}: SHA-256 {digest} does not match the expected {expected_sha256}",
                            ErrorKind.FINGERPRINT)
    return data, digest


def _check_tool_calls(messages: list) -> list:
    """OpenAI-style tool-call history: string arguments must hold a JSON object; the template sees the object."""
    checked = []
    for index, message in enumerate(messages):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if not calls:
            checked.append(message)
            continue
        if not isinstance(calls, list):
            raise FrontendError(f"messages[{index}].tool_calls must be a list", ErrorKind.VALIDATION)
        new_calls = []
        for call_index, call in enumerate(calls):
            if not isinstance(call, dict):
                raise FrontendError(f"messages[{index}].tool_calls[{call_index}] must be an object",
                                    ErrorKind.VALIDATION)
            function = call.get("function")
            holder = function if isinstance(function, dict) else call
            arguments = holder.get("arguments")
            if isinstance(arguments, str):
                try:
                    # json.loads keeps the key order the client sent.
                    parsed = json.loads(arguments)
                except ValueError as exc:
                    raise FrontendError(
                        f"messages[{index}].tool_calls[{call_index}] arguments are not valid JSON ({exc})",
                        ErrorKind.VALIDATION) from None
                if not isinstance(parsed, dict):
                    raise FrontendError(
                        f"messages[{index}].tool_calls[{call_index}] arguments must be a JSON object, "
                        f"got {type(parsed).__name__}", ErrorKind.VALIDATION)
                if isinstance(function, dict):
                    call = {**call, "function": {**function, "arguments": parsed}}
                else:
                    call = {**call, "arguments": parsed}
            elif arguments is not None and not isinstance(arguments, dict):
                raise FrontendError(
                    f"messages[{index}].tool_calls[{call_index}] arguments must be a JSON object or a string "
                    f"holding one, got {type(arguments).__name__}", ErrorKind.VALIDATION)
            new_calls.append(call)
        checked.append({**message, "tool_calls": new_calls})
    return checked


# Names render_chat passes itself; a request's template kwargs cannot replace them.
_RESERVED_KWARGS = frozenset(
    ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "auto_marks",
     "inputs_are_json", "add_special_tokens", "template")
)
_TEMPLATE_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)


class Frontend:
    """Tokenizer + chat template + token settings of one model."""

    def __init__(self, tokenizer, chat_template: ChatTemplate | None, settings: TokenSettings, *,
                 tokenizer_sha256: str | None = None, template_defaults: Mapping[str, Any] | None = None,
                 endpoint_strategy: EndpointStrategy = EndpointStrategy.AUTO_MARKS, source: str = "<memory>"):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.settings = settings
        self.tokenizer_sha256 = tokenizer_sha256
        self.template_defaults = dict(template_defaults or {})
        self.endpoint_strategy = EndpointStrategy(endpoint_strategy)
        self._token_bytes = TokenBytes.from_tokenizer(tokenizer)  # None unless a byte-level BPE (see token_bytes)
        self._piece_ids = WindowPieceIds.from_tokenizer(tokenizer) if self._token_bytes is None else None
        self._check_settings(source)
        if chat_template is not None and self.endpoint_strategy is EndpointStrategy.AUTO_MARKS:
            chat_template.compile_auto_marks()  # at load, not on the first request

    @property
    def token_bytes(self) -> TokenBytes | None:
        """Each token's bytes, where the tokenizer is a byte-level BPE (else None)."""
        return self._token_bytes

    @classmethod
    def load(cls, tokenizer_path: str | os.PathLike, chat_template: str | os.PathLike | None, *,
             tokenizer_sha256: str | None = None, template_sha256: str | None = None,
             settings: TokenSettings, template_defaults: Mapping[str, Any] | None = None,
             endpoint_strategy: EndpointStrategy = EndpointStrategy.AUTO_MARKS,
             clock: Callable[[], datetime] | None = None) -> Frontend:
        """Load a tokenizer.json and a chat template file, checking their SHA-256 when given."""
        from tokenizers import Tokenizer

        tokenizer_bytes, tokenizer_digest = _read_asset(tokenizer_path, "tokenizer", tokenizer_sha256)
        try:
            tokenizer = Tokenizer.from_str(tokenizer_bytes.decode("utf-8"))
        except (UnicodeDecodeError, Exception) as exc:  # tokenizers raises plain Exception on bad JSON
            raise FrontendError(f"tokenizer {os.fspath(tokenizer_path)}: cannot parse ({exc})",
                                ErrorKind.TOKENIZER) from None
        template = None
        if chat_template is not None:
            template_bytes, template_digest = _read_asset(chat_template, "chat template", template_sha256)
            try:
                source = template_bytes.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise FrontendError(f"chat template {os.fspath(chat_template)}: not UTF-8 ({exc})",
                                    ErrorKind.TEMPLATE) from None
            try:
                template = ChatTemplate(source, clock=clock)
            except jinja2.TemplateSyntaxError as exc:
                raise FrontendError(
                    f"chat template {os.fspath(chat_template)}: does not compile: line {exc.lineno}: {exc.message}",
                    ErrorKind.TEMPLATE) from None
            assert template.sha256 == template_digest
        elif template_sha256 is not None:
            raise FrontendError("a template SHA-256 was given without a chat template", ErrorKind.TEMPLATE)
        return cls(tokenizer, template, settings, tokenizer_sha256=tokenizer_digest,
                   template_defaults=template_defaults, endpoint_strategy=endpoint_strategy,
                   source=os.fspath(tokenizer_path))

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, *, template_defaults: Mapping[str, Any] | None = None,
                  endpoint_strategy: EndpointStrategy = EndpointStrategy.AUTO_MARKS) -> Frontend:
        """The frontend a GGUF file describes (its tokenizer, chat template and special tokens)."""
        from tokenizers import Tokenizer

        from flared.frontend.gguf_tokenizer import tokenizer_from_gguf

        assets = tokenizer_from_gguf(path)
        template = None
        if assets.chat_template is not None:
            try:
                template = ChatTemplate(assets.chat_template)
            except jinja2.TemplateSyntaxError as exc:
                raise FrontendError(f"{os.fspath(path)}: chat template does not compile: line {exc.lineno}: "
                                    f"{exc.message}", ErrorKind.TEMPLATE) from None
        return cls(Tokenizer.from_str(assets.tokenizer_json), template, TokenSettings.from_gguf_assets(assets),
                   template_defaults=template_defaults, endpoint_strategy=endpoint_strategy,
                   source=os.fspath(path))

    def _check_settings(self, source: str) -> None:
        for token, token_id, name in ((self.settings.bos_token, self.settings.bos_token_id, "bos"),
                                      (self.settings.eos_token, self.settings.eos_token_id, "eos")):
            if token is None:
                continue
            actual = self.tokenizer.token_to_id(token)
            if actual != token_id:
                raise FrontendError(
                    f"tokenizer {source}: {name}_token {token!r} has id {actual}, settings say {token_id}",
                    ErrorKind.TOKENIZER)

    # -- tokens ---------------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, *, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def incremental_decoder(self, *, skip_special_tokens: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(self.tokenizer, skip_special_tokens=skip_special_tokens,
                                  token_bytes=self._token_bytes, piece_ids=self._piece_ids)

    def detokenizer(self, stop_strings=(), *, skip_special_tokens: bool = True,
                    include_stop_str: bool = False) -> Detokenizer:
        """Incremental decoding with stop strings, for one generation stream (``include_stop_str``: a
        matched stop string stays in the text)."""
        return Detokenizer(self.incremental_decoder(skip_special_tokens=skip_special_tokens), stop_strings,
                           include_stop_str=include_stop_str)

    # -- chat -----------------------------------------------------------------------------------

    def render_chat(self, messages, *, tools=None, documents=None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, inputs_are_json: bool = True,
                    add_special_tokens: bool = False, template: ChatTemplate | None = None,
                    image_prompts: tuple[str, ...] = (), image_placeholder: str = "<image>",
                    **template_kwargs) -> RenderedChat:
        """Render and tokenize a chat; find the token index where each complete message ends.

        ``inputs_are_json``: messages, tools and kwargs are as json.loads made them (a request
        body); pass False for arbitrary Python objects, which are then copied into plain types.
        ``add_special_tokens``: the tokenizer's own special tokens (a BOS) around the rendered text, which
        templates usually write themselves (vLLM's chat field of that name, default false).
        ``template``: a request's own template in place of the model's (vLLM's chat_template field).
        ``image_prompts``: one text per image part of the messages, in order; each ``image_placeholder`` the
        template writes becomes the next one (a vision model's image tokens), before tokenizing.
        """
        template = template if template is not None else self.chat_template
        if template is None:
            raise FrontendError("this model has no chat template", ErrorKind.UNSUPPORTED)
        if not isinstance(messages, list) or not messages:
            raise FrontendError("messages must be a non-empty list", ErrorKind.VALIDATION)
        if continue_final_message and add_generation_prompt:
            raise FrontendError("continue_final_message and add_generation_prompt are not compatible",
                                ErrorKind.VALIDATION)
        reserved = _RESERVED_KWARGS.intersection(template_kwargs)
        if reserved:
            raise FrontendError(f"template kwargs may not set {', '.join(sorted(reserved))}", ErrorKind.VALIDATION)
        messages = _check_tool_calls(messages)
        kwargs = {**self.settings.special_tokens_map(), **self.template_defaults, **template_kwargs}
        use_marks = bool(template.num_marks) or (
            self.endpoint_strategy is EndpointStrategy.AUTO_MARKS and template.has_auto_marks)
        try:
            rendered = template.render_traced(
                messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, auto_marks=use_marks,
                inputs_are_json=inputs_are_json, **kwargs)
        except _TEMPLATE_ERRORS as exc:
            raise FrontendError(f"chat template error: {exc}", ErrorKind.TEMPLATE) from None
        text = rendered.text
        if use_marks:
            char_endpoints = rendered.mark_offsets
        else:
            char_endpoints = self._prefix_endpoints(template, messages, text, tools, documents, kwargs,
                                                    inputs_are_json)
        order = None
        if image_prompts:
            text, char_endpoints, order = _expand_images(text, char_endpoints, image_prompts, image_placeholder)
            order = None if order == tuple(range(len(order))) else order
        char_endpoints = sorted({c for c in char_endpoints if 0 < c < len(text)})
        encoding = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return RenderedChat(
            text=text,
            token_ids=encoding.ids,
            message_endpoints=token_endpoints(encoding.offsets, char_endpoints),
            byte_endpoints=tuple(char_to_byte_offsets(text, char_endpoints)),
            media_order=order,
        )

    async def render_chat_async(self, messages, *, executor=None, **kwargs) -> RenderedChat:
        """``render_chat`` on a worker thread (``executor``: the frontend worker pool)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(executor, lambda: self.render_chat(messages, **kwargs))

    def _prefix_endpoints(self, template: ChatTemplate, messages: list, text: str, tools, documents, kwargs,
                          inputs_are_json: bool) -> list[int]:
        """Endpoints of an unannotated template: prefix renders that are exact prefixes of the prompt."""
        char_ends = []
        for count in range(1, len(messages) + 1):
            try:
                prefix = template.render_traced(
                    messages[:count], tools=tools, documents=documents, add_generation_prompt=False,
                    inputs_are_json=inputs_are_json, **kwargs).text
            except _TEMPLATE_ERRORS:
                # Templates may refuse a partial conversation (e.g. one that must end on a user turn).
                continue
            if 0 < len(prefix) < len(text) and text.startswith(prefix):
                char_ends.append(len(prefix))
        return char_ends
