"""Structured output: request fields -> a grammar the model thread enforces.

Every API's way of asking for constrained output becomes one ``GrammarSpec``
(pure data, parsed and checked on the event loop without the tokenizer):

- OpenAI ``response_format``: ``{"type": "text"}`` (none), ``json_object``
  (any JSON object), ``json_schema`` (``json_schema.schema``; ``strict`` is
  accepted either way: the grammar is always enforced, never best effort).
- Ollama ``format``: ``"json"`` (any JSON object) or a JSON schema object.
- Anthropic ``output_config.format`` (and the beta's top-level
  ``output_format``): ``{"type": "json_schema", "schema": {...}}``.
- Forced tool calls (OpenAI ``tool_choice`` "required" / a named function,
  Anthropic ``tool_choice`` any / tool): the output is constrained to JSON
  the route turns into tool calls itself (``tool_call_schema``), so no tool
  parser has to find it in free text.

Rules:
- A schema keyword we would not enforce is a 400 naming the keyword (raised
  by ``flared.model.grammar.check_schema`` here, before any work), never a
  silent fallback to unconstrained text.
- ``StructuredOutput.compile`` runs on a frontend worker (the tokenizer
  description is built on first use, ~1 s; compiled grammars are cached per
  schema), never on the event loop.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any

from flared.errors import AdmissionError, ErrorKind
from flared.frontend.toolcalls import ToolCallDelta, ToolParser
from flared.model.grammar import CompiledGrammar, GrammarCompiler, GrammarError, check_schema


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    kind: str  # "json_schema" | "json_object" | "regex" | "lark" | "grammar" (GBNF or Lark)
    schema: Any = None  # the JSON schema for kind "json_schema"; the regex / grammar text for the others
    name: str | None = None  # OpenAI json_schema.name (for logs)


def _bad(field: str, message: str, kind: ErrorKind = ErrorKind.VALIDATION) -> AdmissionError:
    err = AdmissionError(f"'{field}': {message}", kind)
    err.param = field
    return err


def _checked(field: str, schema: Any) -> None:
    try:
        check_schema(schema)
    except GrammarError as exc:
        err = _bad(field, str(exc), exc.kind)
        err.keyword = exc.keyword
        raise err from None


def parse_response_format(value: Any, field: str = "response_format") -> GrammarSpec | None:
    """OpenAI ``response_format`` (chat and completions)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad(field, "must be an object with a 'type'")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise _bad(f"{field}.json_schema", "must be an object with a 'schema'")
        schema = spec.get("schema")
        if schema is None:
            raise _bad(f"{field}.json_schema.schema", "is required")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _bad(f"{field}.json_schema.strict", "must be a boolean")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise _bad(f"{field}.json_schema.name", "must be a string")
        _checked(f"{field}.json_schema.schema", schema)
        return GrammarSpec("json_schema", schema, name)
    raise _bad(f"{field}.type", f"must be 'text', 'json_object' or 'json_schema', got {kind!r}")


# vLLM's request fields (structured_outputs {json, regex, choice, grammar, json_object}; the older guided_*) and
# llama.cpp server's (grammar: GBNF, json_schema: a bare schema), each naming its kind of constraint.
_EXTRA_FIELDS = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                 ("guided_grammar", "grammar"), ("json_schema", "json"), ("grammar", "grammar"))
_STRUCTURED_OUTPUTS = ("json", "regex", "choice", "grammar", "json_object")
MAX_CHOICES = 1024


def parse_extra_constraints(body: dict, response_format: GrammarSpec | None) -> GrammarSpec | None:
    """The output constraint vLLM's or llama.cpp server's clients send beside (or instead of) OpenAI's
    ``response_format``: at most one per request, all named in the error otherwise."""
    found: list[tuple[str, str, Any]] = []
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("structured_outputs", f"must be an object, got {type(so).__name__}")
        for key in _STRUCTURED_OUTPUTS:
            if so.get(key) is not None and so.get(key) is not False:
                found.append((f"structured_outputs.{key}", key, so[key]))
    for field, kind in _EXTRA_FIELDS:
        if body.get(field) is not None:
            found.append((field, kind, body[field]))
    if not found:
        return None
    names = [f for f, _, _ in found] + (["response_format"] if response_format is not None else [])
    if len(names) > 1:
        raise _bad(found[0][0], f"one output constraint per request; this one has {', '.join(names)}")
    field, kind, value = found[0]
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise _bad(field, f"is not a JSON schema: {exc}") from None
        if not isinstance(value, (dict, bool)):
            raise _bad(field, "must be a JSON schema (an object)")
        _checked(field, value)
        return GrammarSpec("json_schema", value)
    if kind == "json_object":
        if value is not True:
            raise _bad(field, "must be true")
        return GrammarSpec("json_object")
    if kind == "choice":
        if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
                or not all(isinstance(c, str) and c for c in value)):
            raise _bad(field, f"must be an array of 1 to {MAX_CHOICES} non-empty strings")
        return GrammarSpec("lark", "start: " + " | ".join(json.dumps(c) for c in dict.fromkeys(value)))
    if not isinstance(value, str) or not value:
        raise _bad(field, "must be a non-empty string")
    return GrammarSpec(kind, value)


def parse_responses_text_format(text: Any, field: str = "text.format") -> GrammarSpec | None:
    """Responses ``text``: ``{"format": {"type": "text" | "json_object" | "json_schema", name, schema, strict}}``
    (the json_schema fields sit beside ``type``, not under ``json_schema`` as on chat)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad("text", "must be an object")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad(field, "must be an object with a 'type'")
    if fmt.get("type") == "json_schema":
        if fmt.get("schema") is None:
            raise _bad(f"{field}.schema", "is required")
        if fmt.get("strict") is not None and not isinstance(fmt.get("strict"), bool):
            raise _bad(f"{field}.strict", "must be a boolean")
        _checked(f"{field}.schema", fmt["schema"])
        return GrammarSpec("json_schema", fmt["schema"], fmt.get("name"))
    return parse_response_format(fmt, field)


def parse_ollama_format(value: Any, field: str = "format") -> GrammarSpec | None:
    """Ollama ``format``: "json", "" (none) or a JSON schema object."""
    if value is None or value == "":
        return None
    if value == "json":
        return GrammarSpec("json_object")
    if isinstance(value, dict):
        _checked(field, value)
        return GrammarSpec("json_schema", value)
    raise _bad(field, f"must be \"json\" or a JSON schema object, got {value!r}")


ANTHROPIC_EFFORTS = ("low", "medium", "high", "xhigh", "max")


def parse_anthropic_output_format(body: dict) -> GrammarSpec | None:
    """Anthropic structured outputs: ``output_config.format`` or the structured-outputs beta's top-level
    ``output_format``, each ``{"type": "json_schema", "schema": {...}}``. ``output_config.effort`` is checked
    and accepted; no model served here has an effort setting, so it changes nothing."""
    config = body.get("output_config")
    fmt, field = None, "output_config.format"
    if config is not None:
        if not isinstance(config, dict):
            raise _bad("output_config", "must be an object")
        effort = config.get("effort")
        if effort is not None and effort not in ANTHROPIC_EFFORTS:
            raise _bad("output_config.effort", f"must be one of {', '.join(ANTHROPIC_EFFORTS)}, got {effort!r}")
        fmt = config.get("format")
    if body.get("output_format") is not None:
        if fmt is not None:
            raise _bad("output_format", "give the format once, as output_config.format")
        fmt, field = body["output_format"], "output_format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        got = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise _bad(f"{field}.type", f"must be 'json_schema', got {got!r}")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise _bad(f"{field}.schema", "must be a JSON schema object")
    _checked(f"{field}.schema", schema)
    return GrammarSpec("json_schema", schema)


def tool_call_schema(tools: list[dict], name: str | None, *, max_calls: int | None = None) -> dict:
    """The JSON a forced tool call must produce.

    ``tools``: [{"name", "parameters"}] (API-neutral: each route maps its own
    tool shape). With ``name``, the output is that function's arguments
    object; otherwise it is ``[{"name": ..., "arguments": {...}}, ...]`` with
    at least one call, each naming one of the tools with matching arguments.
    """
    by_name = {}
    for t in tools:
        params = t.get("parameters")
        if params is None:
            params = {"type": "object"}
        by_name[t["name"]] = params
    if name is not None:
        if name not in by_name:
            raise _bad("tool_choice", f"names the function {name!r}, which is not among 'tools'")
        _checked("tools", by_name[name])
        return by_name[name]
    if not by_name:
        raise _bad("tool_choice", "requires at least one tool in 'tools'")
    variants = []
    for fn, params in by_name.items():
        _checked("tools", params)
        variants.append({"type": "object", "properties": {"name": {"const": fn}, "arguments": params},
                         "required": ["name", "arguments"], "additionalProperties": False})
    item = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema = {"type": "array", "items": item, "minItems": 1}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    return schema


@dataclasses.dataclass(frozen=True)
class ForcedToolChoice:
    name: str | None  # the function the call must use; None: any of the tools, one or more calls
    parallel: bool = True  # False: exactly one call (OpenAI parallel_tool_calls, Anthropic disable_parallel_tool_use)


def parse_openai_forced_tool_choice(choice: Any, field: str = "tool_choice", *,
                                    parallel: bool = True) -> ForcedToolChoice | None:
    """OpenAI ``tool_choice``: "required" or ``{"type": "function", "function": {"name"}}``; else None."""
    if choice == "required":
        return ForcedToolChoice(None, parallel)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return ForcedToolChoice(choice["name"], parallel)  # the Responses API's flat shape
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(field, 'a named tool choice is {"type": "function", "function": {"name": ...}}')
        return ForcedToolChoice(fn["name"])
    return None


class ForcedToolParser(ToolParser):
    """The constrained output of ``tool_call_schema`` -> tool calls (same interface as the families).

    Named: the whole output is the arguments object, streamed as argument
    deltas as it arrives (the grammar guarantees it is that JSON). Any tool:
    the output is a JSON array of calls, each announced whole as soon as its
    object is complete (a stream shows the first call while the model writes
    the next). An output cut short by max_tokens stays a truncated call
    (named); any tool: the calls completed before the cut are calls, the
    unfinished rest is content (all of it, if no call was complete).
    """

    name = "forced"
    forced_name: str | None = None
    _decoder = json.JSONDecoder()

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self._announced = False
        self._opened = False  # any tool: the array's "[" read
        self._ended = False  # any tool: its "]" read
        self._raw = ""  # any tool: the whole output, content if no call parses

    def push(self, text: str):
        if self.forced_name is None:
            self._raw += text
        return super().push(text)

    def _step(self, final: bool) -> bool:
        if self.forced_name is None:
            return self._next_call()
        if self._buf:
            if not self._announced:
                self._announced = True
                self._emit_calls([self._announce(self.forced_name)])
            self.calls[0].arguments += self._buf
            self._emit_calls([ToolCallDelta(0, None, None, self._buf)])
            self._buf = ""
        return False

    def _next_call(self) -> bool:
        """Any tool: the array's next call out of the buffer once its object is complete; True when one was."""
        text = self._buf.lstrip()
        if self._ended or not text:
            return False
        if not self._opened:
            if text[0] != "[":
                return False
            self._opened = True
            text = text[1:].lstrip()
        if self.calls and text[:1] == ",":
            text = text[1:].lstrip()
        if text[:1] == "]":
            self._ended = True
            self._buf = ""
            return False
        try:
            value, end = self._decoder.raw_decode(text)
        except ValueError:  # not complete yet
            self._buf = text
            return False
        if not (isinstance(value, dict) and isinstance(value.get("name"), str) and "arguments" in value):
            self._buf = text
            return False
        delta = self._announce(value["name"])
        delta.arguments = json.dumps(value["arguments"], ensure_ascii=False)
        self.calls[delta.index].arguments = delta.arguments
        self._emit_calls([delta])
        self._close(delta.index, None)
        self._buf = text[end:]
        return True

    def _finish_rest(self) -> None:
        if self.forced_name is not None:
            if self._announced:
                self._close(0, None)
            return
        if not self.calls:
            self._emit_content(self._raw)
        elif not self._ended:
            self._emit_content(self._buf.lstrip().removeprefix(",").lstrip())
        self._buf = ""


def force_tool_call(shape, tools: list[dict], forced: ForcedToolChoice) -> GrammarSpec:
    """Make ``shape`` (a route's OutputShape) parse forced calls; the grammar that forces them.

    ``tools`` are OpenAI function tools (``{"type": "function", "function": {...}}``)."""
    neutral = [{"name": t["function"]["name"], "parameters": t["function"].get("parameters")} for t in tools or ()]
    schema = tool_call_schema(neutral, forced.name, max_calls=None if forced.parallel else 1)
    shape.tools = tools
    shape.tool_cls = type("ForcedToolCalls", (ForcedToolParser,), {"forced_name": forced.name})
    # The JSON starts at the first token: nothing is reasoning.
    shape.reasoning = None
    shape.starts_inside = False
    return GrammarSpec("json_schema", schema, "tool_call")


class StructuredOutput:
    """The serving state's grammar compiler, built on first use (thread-safe)."""

    def __init__(self, frontend, *, vocab_size: int, eos_token_ids):
        self._frontend = frontend
        self._vocab_size = vocab_size
        self._eos = tuple(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler.from_frontend(self._frontend, vocab_size=self._vocab_size,
                                                               eos_token_ids=self._eos)
            return self._compiler

    def compile_now(self, spec: GrammarSpec) -> CompiledGrammar:
        """On a frontend worker: GrammarSpec -> CompiledGrammar (400 on an invalid schema)."""
        c = self.compiler()
        if spec.kind == "json_object":
            return c.json_object()
        if spec.kind == "regex":
            return c.regex(spec.schema)
        if spec.kind == "lark":
            return c.lark(spec.schema)
        if spec.kind == "grammar":
            return c.any_grammar(spec.schema)
        return c.json_schema(spec.schema)


async def compile_grammar(state, spec: GrammarSpec | None) -> CompiledGrammar | None:
    """Compile ``spec`` off the event loop (None stays None)."""
    if spec is None:
        return None
    return await state._in_pool(lambda: state.structured.compile_now(spec))
