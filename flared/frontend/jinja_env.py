"""The jinja2 environment chat templates render in, and its two extensions.

Rules:
- Settings and globals are transformers' (``apply_chat_template``): immutable
  sandbox, ``trim_blocks`` + ``lstrip_blocks``, loop controls, its ``tojson``
  (``ensure_ascii=False``, no HTML escaping, json's separators),
  ``raise_exception``, ``strftime_now`` (local time), restricted ``dict`` and
  ``namespace``. Changing any of them changes output bytes.
- ``ChatSandbox`` may only add shortcuts that reach the stock sandbox's verdict
  faster; anything it does not recognise takes the stock path.
- ``{% mark %}`` yields a private sentinel object (found by identity after the
  render); ``{% generation %}`` reports its span through a ContextVar, because
  one compiled template renders in many threads at once.
"""

from __future__ import annotations

import contextvars
import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes as nodes
import jinja2.runtime
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from flared.frontend.codegen import ChatCodeGenerator

class _MarkSentinel(str):
    __slots__ = ()


# What a {% mark %} yields: an empty str of a private type, made at import time, so no template
# constant or rendered value can be this very object. The render loop recognises it by identity;
# being empty, it adds nothing to the joined text or to the lengths before later chunks.
MARK_SENTINEL = _MarkSentinel()


class RenderTrace:
    """Per-render bookkeeping read by {% generation %}."""

    __slots__ = ("chunks", "mark_chunks", "generation_chunks")

    def __init__(self) -> None:
        self.chunks: list[str] = []  # what the root render function has yielded so far, marks removed
        self.mark_chunks: list[int] = []  # len(chunks) at each {% mark %}
        self.generation_chunks: list[tuple[int, int]] = []  # (len(chunks), body length) per generation block


# A ContextVar, not an attribute: one compiled template renders in many worker threads at once.
RENDER_TRACE: contextvars.ContextVar[RenderTrace | None] = contextvars.ContextVar("flared_render_trace", default=None)


def mark_node(lineno: int) -> nodes.Output:
    # Compiles to `yield environment.flared_mark_sentinel` (ChatCodeGenerator.visit_Output): no
    # sandboxed call, no context lookup.
    return nodes.Output([nodes.EnvironmentAttribute("flared_mark_sentinel")]).set_lineno(lineno)


class MarkExtension(jinja2.ext.Extension):
    """``{% mark %}``: record the output position here, emit nothing."""

    tags = {"mark"}

    def __init__(self, environment):
        super().__init__(environment)
        environment.flared_mark_sentinel = MARK_SENTINEL

    def parse(self, parser):
        token = next(parser.stream)
        if parser.stream.current.type != "block_end":
            raise TemplateSyntaxError(
                "{% mark %} takes no argument (segment-count marks are not supported)",
                token.lineno, parser.name, parser.filename,
            )
        return mark_node(token.lineno)


class GenerationExtension(jinja2.ext.Extension):
    """``{% generation %}``: emit the body, record where it went (transformers' AssistantTracker)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

    def _generation(self, caller) -> str:
        text = caller()
        trace = RENDER_TRACE.get()
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
_DATA_TYPES = frozenset((str, int, float, bool, type(None), list, dict, tuple))
_object_getattribute = object.__getattribute__
_BUILTIN_METHOD = type("".strip)
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
    directly; loop properties and the methods in _SAFE_METHODS always pass the checks, and calling
    such a method needs neither the safe-callable check nor context injection. Everything else
    takes the stock path.
    """

    code_generator_class = ChatCodeGenerator

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
        elif kind is _TemplateNamespace:
            # Public namespace attributes are always safe; a missing one is undefined (a
            # Namespace has no items to fall back to). A stored str.format still gets wrapped.
            if not attribute.startswith("_"):
                # What Namespace.__getattribute__ does for such a name, without its Python frame.
                try:
                    value = _object_getattribute(obj, "_Namespace__attrs")[attribute]
                except KeyError:
                    return self.undefined(obj=obj, name=attribute)
                if type(value) in _DATA_TYPES:  # not a bound str.format: nothing to wrap
                    return value
                wrapped = self.wrap_str_format(value)
                return value if wrapped is None else wrapped
        elif attribute in _SAFE_METHODS.get(kind, ()):
            return getattr(obj, attribute)
        return super().getattr(obj, attribute)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's signature
        # A bound method in _SAFE_METHODS is safely callable and takes no context, so the stock
        # checks (two failing attribute lookups each) cannot change the outcome.
        if type(__obj) is _BUILTIN_METHOD and __obj.__name__ in _SAFE_METHODS.get(type(__obj.__self__), ()):
            return _call_direct(__context, __obj, args, kwargs)
        if type(__obj) is jinja2.runtime.Macro:
            # The stock path finds no unsafe_callable/alters_data on a Macro, and Macro.__call__ is
            # pass_eval_context: it gets the context's eval context first.
            return _call_direct(__context, __obj.__call__, (__context.eval_ctx, *args), kwargs)
        if _PLAIN_CALLABLES.get(id(__obj)) is __obj:
            # Our own globals: safe, and none takes a context, an eval context or an environment.
            return _call_direct(__context, __obj, args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)


def _call_direct(context, fn, args, kwargs):
    """Call ``fn`` as jinja2's Context.call would once its checks passed: without the internal
    _block_vars/_loop_vars keywords, a StopIteration turned into an undefined value."""
    kwargs.pop("_block_vars", None)
    kwargs.pop("_loop_vars", None)
    try:
        return fn(*args, **kwargs)
    except StopIteration:
        return context.environment.undefined(
            "value was undefined because a callable raised a StopIteration exception")


_TEMPLATE_DICT = _TemplateDict()
# The globals make_environment installs that ChatSandbox.call may call directly, by id (a template
# can pass any object to a call, hashable or not; id() and `is` never run its code).
_PLAIN_CALLABLES = {
    id(function): function
    for function in (_raise_exception, _strftime_now_local, _TEMPLATE_DICT, _TemplateNamespace)
}


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
    env.globals["dict"] = _TEMPLATE_DICT
    env.globals["namespace"] = _TemplateNamespace
    return env
