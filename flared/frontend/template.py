"""Chat templates rendered the way transformers' ``apply_chat_template`` renders them.

Rules (every one of them changes output bytes; the goldens in
../shared/templates pin them down):

- Environment: sandboxed and immutable (``ImmutableSandboxedEnvironment``),
  ``trim_blocks`` + ``lstrip_blocks``, loop controls; ``tojson`` is
  ``json.dumps`` with ``ensure_ascii=False``, no HTML escaping and json's own
  separators; ``raise_exception`` raises ``jinja2.TemplateError``;
  ``strftime_now`` formats the local calendar time of the injected clock;
  ``dict`` and ``namespace`` are the restricted versions transformers exposes.
- Inputs first become plain JSON-like data (a fresh copy, so the caller's
  messages are never edited; request bodies from json.loads are shared
  instead, see normalize_messages); message keys whose value is None are
  dropped; a message's reasoning is visible as ``thinking`` and
  ``reasoning_content``.
- ``continue_final_message`` appends a tag to the final message's content,
  renders, and cuts at the tag (after trimming trailing space when the template
  trimmed it), exactly as transformers does, including its ValueErrors.
- ``{% generation %}…{% endgeneration %}`` emits its body and records the span.
- ``{% mark %}`` emits nothing and records the output position. It compiles to
  a yield of a private sentinel object that the render loop drops and counts,
  so a mark is only meaningful where output streams straight to the root:
  inside a macro, a call block (including ``{% generation %}``), a captured
  ``{% set %}``, a ``{% filter %}`` block or a recursive loop the output is
  buffered, and a mark there is a compile error.
- A template without marks also compiles to a copy marked around its message
  loops (see _auto_annotate) for automatic message endpoints.
- The template's own exceptions (jinja2's TemplateError family, TypeError,
  ValueError) propagate unchanged; wrapping them is the caller's business.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import hashlib
import itertools
import json
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes as nodes
import jinja2.runtime
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Appended to the continued message; the render is cut where it lands.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


# What a {% mark %} yields: a str object made at import time, so no template constant or
# rendered value can be this very object. The render loop recognises it by identity and drops it.
_MARK_SENTINEL = "".join(["\x00flared", "-mark\x00"])
_MARK_SENTINEL_LEN = len(_MARK_SENTINEL)


class _RenderTrace:
    """Per-render bookkeeping read by {% generation %}."""

    __slots__ = ("chunks", "mark_chunks", "generation_chunks")

    def __init__(self) -> None:
        self.chunks: list[str] = []  # what the root render function has yielded so far, marks removed
        self.mark_chunks: list[int] = []  # len(chunks) at each {% mark %}
        self.generation_chunks: list[tuple[int, int]] = []  # (len(chunks), body length) per generation block


# A ContextVar, not an attribute: one compiled template renders in many worker threads at once.
_TRACE: contextvars.ContextVar[_RenderTrace | None] = contextvars.ContextVar("flared_render_trace", default=None)


def _mark_node(lineno: int) -> nodes.Output:
    # Compiles to `yield str(environment.flared_mark_sentinel)`: no sandboxed call, no context
    # lookup, and str() of an exact str returns the object itself.
    return nodes.Output([nodes.EnvironmentAttribute("flared_mark_sentinel")]).set_lineno(lineno)


class MarkExtension(jinja2.ext.Extension):
    """``{% mark %}``: record the output position here, emit nothing."""

    tags = {"mark"}

    def __init__(self, environment):
        super().__init__(environment)
        environment.flared_mark_sentinel = _MARK_SENTINEL

    def parse(self, parser):
        token = next(parser.stream)
        if parser.stream.current.type != "block_end":
            raise TemplateSyntaxError(
                "{% mark %} takes no argument (segment-count marks are not supported)",
                token.lineno, parser.name, parser.filename,
            )
        return _mark_node(token.lineno)


class GenerationExtension(jinja2.ext.Extension):
    """``{% generation %}``: emit the body, record where it went (transformers' AssistantTracker)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

    def _generation(self, caller) -> str:
        text = caller()
        trace = _TRACE.get()
        if trace is not None:
            trace.generation_chunks.append((len(trace.chunks), len(text)))
        return text


class _TemplateDict:
    # `dict` in a template: construction and fromkeys only, no attribute access to the type.
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Underscore-prefixed names could reach CPython internals through the namespace.
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute."
            )


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now_local(fmt):
    return datetime.now().strftime(fmt)


# Attributes whose sandbox verdict is fixed: reading them needs no per-access safety check.
_LOOP_PROPERTIES = frozenset(
    ("index", "index0", "revindex", "revindex0", "first", "last", "length", "previtem", "nextitem", "depth", "depth0")
)
_DICT_ATTRIBUTES = frozenset(dir(dict))
# Methods the immutable sandbox always allows on these exact types (no underscore, no mutation,
# not str.format/format_map, which the sandbox wraps), so its per-access checks can be skipped.
_SAFE_METHODS = {
    str: frozenset(name for name in dir(str) if not name.startswith("_") and name not in ("format", "format_map")),
    dict: frozenset(("items", "keys", "values", "get", "copy")),
    list: frozenset(("index", "count", "copy")),
}


class ChatSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with shortcuts that give the same results faster.

    Chat templates read ``message.role``, ``loop.last`` and ``content.strip`` in every iteration;
    the stock sandbox pays an attribute lookup, often an exception, and three safety checks (two
    of them abstract-class isinstance tests) for each. For a plain dict and a name that is not a
    dict attribute, ``getattr`` fails and the sandbox falls back to the item, so we go to the item
    directly; loop properties and the methods in _SAFE_METHODS always pass the checks. Everything
    else takes the stock path.
    """

    def getattr(self, obj, attribute):
        kind = type(obj)
        if kind is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                return self.undefined(obj=obj, name=attribute)
        if kind is jinja2.runtime.LoopContext:
            if attribute in _LOOP_PROPERTIES:
                return getattr(obj, attribute)
        elif attribute in _SAFE_METHODS.get(kind, ()):
            return getattr(obj, attribute)
        return super().getattr(obj, attribute)


def make_environment(*, stock_sandbox: bool = False) -> ImmutableSandboxedEnvironment:
    """The jinja2 environment chat templates compile in.

    ``stock_sandbox``: jinja2's own ImmutableSandboxedEnvironment with the same settings, the
    benchmark's plain-jinja2 baseline (what transformers uses).
    """
    env_class = ImmutableSandboxedEnvironment if stock_sandbox else ChatSandbox
    env = env_class(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationExtension, MarkExtension, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now_local
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _is_call_to(node: nodes.Node, extension: type[jinja2.ext.Extension], method: str) -> bool:
    return (
        isinstance(node, nodes.Call)
        and isinstance(node.node, nodes.ExtensionAttribute)
        and node.node.identifier == extension.identifier
        and node.node.name == method
    )


def _is_mark(node: nodes.Node) -> bool:
    return (
        isinstance(node, nodes.Output)
        and len(node.nodes) == 1
        and isinstance(node.nodes[0], nodes.EnvironmentAttribute)
        and node.nodes[0].name == "flared_mark_sentinel"
    )


def _check_marks(node: nodes.Node, buffered_by: str | None, found: list[int]) -> None:
    """Collect the line of every {% mark %}; reject those whose output would be buffered."""
    if _is_mark(node):
        if buffered_by is not None:
            raise TemplateSyntaxError(f"{{% mark %}} is not allowed inside {buffered_by}", node.lineno)
        found.append(node.lineno)
        return
    if isinstance(node, nodes.Macro):
        buffered_by = buffered_by or "a macro"
    elif isinstance(node, nodes.CallBlock):
        buffered_by = buffered_by or (
            "{% generation %}" if _is_call_to(node.call, GenerationExtension, "_generation") else "a call block"
        )
    elif isinstance(node, nodes.AssignBlock):
        buffered_by = buffered_by or "a captured {% set %}"
    elif isinstance(node, nodes.FilterBlock):
        buffered_by = buffered_by or "a {% filter %} block"
    elif isinstance(node, nodes.For) and node.recursive:
        buffered_by = buffered_by or "a recursive loop"
    for child in node.iter_child_nodes():
        _check_marks(child, buffered_by, found)


def _names_messages(expression: nodes.Node) -> bool:
    """Whether a loop's iterable mentions the conversation (messages, loop_messages, ns.messages, ...)."""
    for node in (expression, *expression.find_all((nodes.Name, nodes.Getattr))):
        if not isinstance(node, (nodes.Name, nodes.Getattr)):
            continue
        name = node.name if isinstance(node, nodes.Name) else node.attr
        if "messages" in name:
            return True
    return False


def _is_message_loop(node: nodes.Node) -> bool:
    return (
        isinstance(node, nodes.For)
        and not node.recursive
        and _names_messages(node.iter)
        and any(not _is_mark(output) for output in node.find_all(nodes.Output))
    )


def _auto_annotate(node: nodes.Node, buffered: bool, *, apply: bool = True) -> int:
    """Mark every streaming loop over the messages that emits output: before the loop (the end of
    the preamble: BOS, system prompt, tool list) and at the end of each iteration; count the loops.

    Loops that only compute (a reverse scan for the last user turn) emit nothing and get no mark;
    loops in macros, call blocks, captured sets and filter blocks are buffered and are skipped.
    """
    count = 0
    if isinstance(node, (nodes.Macro, nodes.CallBlock, nodes.AssignBlock, nodes.FilterBlock)):
        buffered = True
    for field in node.fields:
        statements = getattr(node, field)
        if not isinstance(statements, list):
            continue
        annotated = []
        for child in statements:
            if isinstance(child, nodes.Node) and not buffered and _is_message_loop(child):
                count += 1
                if apply:
                    annotated.append(_mark_node(child.lineno))
                    child.body.append(_mark_node(child.lineno))
            annotated.append(child)
        if len(annotated) != len(statements):
            setattr(node, field, annotated)
    for child in node.iter_child_nodes():
        count += _auto_annotate(child, buffered, apply=apply)
    return count


@dataclasses.dataclass(frozen=True)
class _Compiled:
    template: jinja2.Template
    num_marks: int  # {% mark %} statements in the source
    has_generation: bool
    # Message loops a template without marks has (0: no automatic marks; see _auto_annotate).
    num_message_loops: int


@functools.lru_cache(maxsize=128)
def _compile(source_sha256: str, source: str) -> _Compiled:
    # Keyed by the hash so a template shared by many ChatTemplate objects (one per request
    # in tools, one per model in the server) compiles once.
    env = make_environment()
    ast = env.parse(source)
    mark_lines: list[int] = []
    _check_marks(ast, None, mark_lines)
    has_generation = any(
        _is_call_to(block.call, GenerationExtension, "_generation") for block in ast.find_all(nodes.CallBlock)
    )
    num_message_loops = 0 if mark_lines else _auto_annotate(ast, False, apply=False)
    return _Compiled(env.from_string(ast), len(mark_lines), has_generation, num_message_loops)


@functools.lru_cache(maxsize=128)
def _compile_auto_marked(source_sha256: str, source: str) -> jinja2.Template:
    # Compiled on first use: a template rendered only through render() never pays for it.
    env = make_environment()
    ast = env.parse(source)
    _auto_annotate(ast, False)
    return env.from_string(ast)


def _plain(value: Any) -> Any:
    """A fresh copy of ``value`` made of JSON-like types only (what transformers lets templates see)."""
    kind = type(value)
    if value is None or kind is str or kind is int or kind is float or kind is bool:
        return value
    if kind is dict:
        return {key if type(key) is str else _plain(key): _plain(item) for key, item in value.items()}
    if kind is list:
        return [_plain(item) for item in value]
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    # Media and other rich objects: templates only test for their presence.
    return f"<{type(value).__name__}>"


def _alias_reasoning(message: dict) -> dict:
    if message.keys().isdisjoint(_REASONING_FIELDS):
        return message
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is not None:
        return {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def normalize_messages(messages: Any, *, inputs_are_json: bool = False) -> list[dict]:
    """Messages as the template sees them: None-valued keys dropped, reasoning aliased.

    With ``inputs_are_json`` (values straight from json.loads: dicts, lists, str, numbers, bools,
    None) the caller's objects are shared, not copied, unless a key must be dropped or aliased: the
    immutable sandbox cannot modify them, and a deep copy would only cost time. Otherwise every
    message is rebuilt from plain types, as transformers does.
    """
    messages = getattr(messages, "messages", messages)
    if inputs_are_json:
        return _normalize_json_messages(messages)
    normalized = []
    for message in messages:
        if not inputs_are_json and (dataclasses.is_dataclass(message)
                                    or callable(getattr(message, "model_dump", None))):
            message = _plain(message)
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
        if inputs_are_json:
            # Shared as is when nothing needs dropping: the immutable sandbox cannot modify it.
            if None in message.values():
                message = {key: value for key, value in message.items() if value is not None}
        else:
            message = _plain({key: value for key, value in message.items() if value is not None})
        normalized.append(_alias_reasoning(message))
    return normalized


def _normalize_json_messages(messages) -> list[dict]:
    # The hot path of render_chat: one C-level membership test per key kind and message.
    normalized = []
    append = normalized.append
    for message in messages:
        if type(message) is not dict:
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
        if None in message.values():
            message = {key: value for key, value in message.items() if value is not None}
        if "reasoning_content" in message or "thinking" in message or "reasoning" in message:
            message = _alias_reasoning(message)
        append(message)
    return normalized


@dataclasses.dataclass(frozen=True)
class RenderedTemplate:
    """A render with the positions its annotations recorded."""

    text: str
    # Code-point offset into text of every {% mark %} that ran, in output order, clipped to the text.
    mark_offsets: tuple[int, ...]
    # [start, end) code-point spans of every {% generation %} block, as transformers reports them.
    generation_spans: tuple[tuple[int, int], ...]

    @property
    def mark_offsets_utf8(self) -> tuple[int, ...]:
        """The marks as UTF-8 byte offsets into ``text.encode()``."""
        if self.text.isascii():
            return self.mark_offsets
        result, position_bytes, position_chars = [], 0, 0
        for offset in self.mark_offsets:
            position_bytes += len(self.text[position_chars:offset].encode("utf-8"))
            position_chars = offset
            result.append(position_bytes)
        return tuple(result)


class ChatTemplate:
    """A compiled chat template. Rendering is thread-safe and never touches the event loop."""

    def __init__(self, source: str, *, clock: Callable[[], datetime] | None = None):
        """Compile ``source``; a template that does not compile raises jinja2's TemplateSyntaxError.

        ``clock`` replaces ``datetime.now`` for ``strftime_now`` (tests pin it).
        """
        if not isinstance(source, str):
            raise TypeError(f"chat template source must be str, got {type(source).__name__}")
        self.source = source
        self.sha256 = hashlib.sha256(source.encode("utf-8")).hexdigest()
        self._compiled = _compile(self.sha256, source)
        self._clock = clock

    @property
    def num_marks(self) -> int:
        """How many {% mark %} statements the template has (0: an ordinary, unannotated template)."""
        return self._compiled.num_marks

    @property
    def has_auto_marks(self) -> bool:
        """Whether an unannotated template had a message loop to mark automatically."""
        return self._compiled.num_message_loops > 0

    def compile_auto_marks(self) -> None:
        """Compile the automatically marked copy now rather than at the first render that needs it."""
        if self.has_auto_marks:
            _compile_auto_marked(self.sha256, self.source)

    @property
    def has_generation_blocks(self) -> bool:
        return self._compiled.has_generation

    @property
    def jinja_template(self) -> jinja2.Template:
        """The compiled source as written (for comparisons; render through this class)."""
        return self._compiled.template

    def render(self, messages, *, tools=None, documents=None, add_generation_prompt: bool = False,
               continue_final_message: bool | str = False, bos_token: str | None = None,
               eos_token: str | None = None, **template_kwargs) -> str:
        """Render like transformers' ``apply_chat_template(tokenize=False)``."""
        return self.render_traced(
            messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, bos_token=bos_token, eos_token=eos_token,
            **template_kwargs,
        ).text

    def render_traced(self, messages, *, tools=None, documents=None, add_generation_prompt: bool = False,
                      continue_final_message: bool | str = False, bos_token: str | None = None,
                      eos_token: str | None = None, auto_marks: bool = False, inputs_are_json: bool = False,
                      **template_kwargs) -> RenderedTemplate:
        """Render, and report mark positions and generation spans.

        ``auto_marks``: for an unannotated template, render its automatically marked copy (same
        output bytes, marks at the end of every message-loop iteration).
        ``inputs_are_json``: messages, tools, documents and kwargs hold only JSON types (see
        normalize_messages); skips the defensive deep copies.
        """
        variables, final_message = self.prepare_variables(
            messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, bos_token=bos_token, eos_token=eos_token,
            inputs_are_json=inputs_are_json, **template_kwargs)
        template = self._compiled.template
        if auto_marks and self._compiled.num_message_loops:
            template = _compile_auto_marked(self.sha256, self.source)
        if self._compiled.has_generation:
            trace = self._run_traced(template, variables)
            text = "".join(trace.chunks)
            mark_offsets = self._mark_offsets(trace)
            generation_spans = self._generation_spans(trace)
        else:
            text, mark_offsets = self._run(template, variables)
            generation_spans = ()
        if continue_final_message:
            text = self._cut_at_tag(text, final_message)
            mark_offsets = tuple(offset for offset in mark_offsets if offset <= len(text))
            generation_spans = ()
        return RenderedTemplate(text=text, mark_offsets=mark_offsets, generation_spans=generation_spans)

    def prepare_variables(self, messages, *, tools=None, documents=None, add_generation_prompt: bool = False,
                          continue_final_message: bool | str = False, bos_token: str | None = None,
                          eos_token: str | None = None, inputs_are_json: bool = False,
                          **template_kwargs) -> tuple[dict[str, Any], str | None]:
        """The variables a render sees, and the final message's text when continuing it."""
        chat = normalize_messages(messages, inputs_are_json=inputs_are_json)
        if tools is not None:
            for tool in tools:
                if not isinstance(tool, dict):
                    raise ValueError(
                        "Tools should either be a JSON schema, or a callable function with type hints "
                        "and a docstring suitable for auto-conversion to a schema."
                    )
            if not inputs_are_json:
                tools = _plain(tools)
        if documents is not None:
            for document in documents:
                if not isinstance(document, dict):
                    raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
            if not inputs_are_json:
                documents = _plain(documents)
        # Special tokens first: explicit template kwargs win, as in apply_chat_template.
        variables: dict[str, Any] = {}
        if bos_token is not None:
            variables["bos_token"] = bos_token
        if eos_token is not None:
            variables["eos_token"] = eos_token
        variables.update(template_kwargs if inputs_are_json else _plain(template_kwargs))
        if self._clock is not None and "strftime_now" not in variables:
            clock = self._clock
            variables["strftime_now"] = lambda fmt: clock().strftime(fmt)
        final_message = None
        if continue_final_message:
            if inputs_are_json and chat:
                chat[-1] = _plain(chat[-1])  # the tag is written into it: never into the caller's data
            final_message = self._tag_final_message(chat, continue_final_message)
        variables.update(messages=chat, tools=tools, documents=documents,
                         add_generation_prompt=add_generation_prompt)
        return variables, final_message

    def _tag_final_message(self, chat: list[dict], continue_final_message: bool | str) -> str:
        if not chat:
            raise ValueError("continue_final_message is set but the conversation is empty!")
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final_message = chat[-1].get(field)
        if final_message is None:
            raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue!')
        fields = [field]
        if field in _REASONING_FIELDS:
            fields = [name for name in _REASONING_FIELDS if chat[-1].get(name) == final_message]
        if not any(name in self.source for name in fields):
            raise ValueError(
                f'continue_final_message is set to "{field}" but this is not an accepted field in the chat_template'
            )
        if isinstance(final_message, (list, tuple)):
            for block in reversed(final_message):
                if "text" in block:
                    final_message = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
            else:
                raise ValueError(
                    "continue_final_message is set but we could not find any text to continue in the final message!"
                )
        else:
            for name in fields:
                chat[-1][name] = chat[-1][name] + _CONTINUE_TAG
        return final_message

    @staticmethod
    def _cut_at_tag(text: str, final_message: str) -> str:
        if final_message.strip() not in text or _CONTINUE_TAG.strip() not in text:
            raise ValueError(
                "continue_final_message is set but the final message does not appear in the chat after "
                "applying the chat template! This can happen if the chat template deletes portions of "
                "the final message. Please verify the chat template and final message in your chat to "
                "ensure they are compatible."
                f"Final message to continue: {final_message.strip()}\nRendered chat:\n{text}"
            )
        tag_at = text.rindex(_CONTINUE_TAG.strip())
        if text[tag_at:tag_at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return text[:tag_at]
        return text[:tag_at].rstrip()

    @staticmethod
    def _run(template: jinja2.Template, variables: dict) -> tuple[str, tuple[int, ...]]:
        """Render; return the text and the code-point offset of every mark.

        The generator is drained by list(), sentinels are found with list.index and lengths summed
        with map(len), all in C, so tracking costs a Python step per mark, not per chunk; the text
        is joined once.
        """
        try:
            chunks = list(template.root_render_func(template.new_context(variables)))
        except Exception:
            template.environment.handle_exception()
        sentinel = _MARK_SENTINEL
        try:
            at = chunks.index(sentinel)
        except ValueError:
            return "".join(chunks), ()
        # starts[i]: code points before chunks[i], sentinels included (subtracted per mark below).
        starts = list(itertools.accumulate(map(len, chunks), initial=0))
        offsets: list[int] = []
        while True:
            if chunks[at] is sentinel:  # not rendered text that merely equals the sentinel's value
                offsets.append(starts[at] - len(offsets) * _MARK_SENTINEL_LEN)
                chunks[at] = ""
            try:
                at = chunks.index(sentinel, at + 1)
            except ValueError:
                break
        return "".join(chunks), tuple(offsets)

    @staticmethod
    def _run_traced(template: jinja2.Template, variables: dict) -> _RenderTrace:
        """Render chunk by chunk so {% generation %} blocks can see how much was emitted before them."""
        trace = _RenderTrace()
        chunks = trace.chunks
        append = chunks.append
        mark_chunks = trace.mark_chunks
        sentinel = _MARK_SENTINEL
        token = _TRACE.set(trace)
        try:
            # Chunks are appended before the generator resumes, so a generation block sees
            # everything emitted before it.
            for chunk in template.root_render_func(template.new_context(variables)):
                if chunk is sentinel:
                    mark_chunks.append(len(chunks))
                else:
                    append(chunk)
        except Exception:
            template.environment.handle_exception()
        finally:
            _TRACE.reset(token)
        return trace

    @staticmethod
    def _mark_offsets(trace: _RenderTrace) -> tuple[int, ...]:
        offsets = []
        position, consumed = 0, 0
        chunks = trace.chunks
        for chunk_index in trace.mark_chunks:
            while consumed < chunk_index:
                position += len(chunks[consumed])
                consumed += 1
            offsets.append(position)
        return tuple(offsets)

    @staticmethod
    def _generation_spans(trace: _RenderTrace) -> tuple[tuple[int, int], ...]:
        spans = []
        position, consumed = 0, 0
        for chunk_index, length in trace.generation_chunks:
            while consumed < chunk_index:
                position += len(trace.chunks[consumed])
                consumed += 1
            spans.append((position, position + length))
        return tuple(spans)
