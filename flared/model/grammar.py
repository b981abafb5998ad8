"""Grammar-constrained decoding over llguidance: compile once, match per request.

``GrammarCompiler`` turns a JSON schema (or a Lark grammar) into a
``CompiledGrammar`` once per distinct source (an LRU keyed by the canonical
source text); each constrained request takes a fresh ``GrammarMatcher`` from
it (a deep copy of a template matcher: microseconds, no recompilation).

Rules:
- JSON schemas are checked against the keywords we enforce before llguidance
  sees them: a keyword that would constrain the output but is not enforced is
  a ``GrammarError`` naming it (a 400 at the route), never silently dropped.
  Annotations (title, description, examples, ...) are accepted and ignored.
- An object schema that lists its properties and says nothing of others
  allows no others (``closed_objects``): the reading of vLLM's default
  grammar backend (xgrammar's strict mode) and llama.cpp's, where plain JSON
  Schema would let a model append keys nobody asked for. ``additionalProperties:
  true`` (or a schema) keeps them open. Properties keep the schema's order.
- A matcher never raises for a token the grammar rejects: it enters an error
  state and stays there; ``consume`` returns False and ``error`` says why.
  The model thread turns that into an ErrorEvent for that request only.
- Masks are bitmasks, one bit per vocabulary id, 32 ids per int32 word
  (llguidance's layout); the sampler expands and applies them.
- No torch import here: the server compiles grammars on frontend workers.
"""

from __future__ import annotations

import array
import collections
import ctypes
import json
import os
import threading
from typing import Any

import llguidance

from flared.errors import AdmissionError, ErrorKind

# Distinct schemas kept compiled; each holds one template matcher (kilobytes).
COMPILED_CACHE_ENTRIES = 64

# JSON-schema keywords whose constraint llguidance enforces.
_SCHEMA_MAP_KEYWORDS = ("properties", "$defs", "definitions")  # name -> subschema
_SCHEMA_ONE_KEYWORDS = ("additionalProperties", "items", "additionalItems")  # subschema (or bool)
_SCHEMA_LIST_KEYWORDS = ("anyOf", "oneOf", "allOf", "prefixItems")  # [subschema]
_VALUE_KEYWORDS = frozenset({
    "type", "enum", "const", "required", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "multipleOf", "minLength", "maxLength", "pattern", "format", "minItems", "maxItems", "$ref",
    "minProperties", "maxProperties",
})
# Accepted and ignored: they describe the output, they do not constrain it.
_ANNOTATION_KEYWORDS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "readOnly", "writeOnly",
    "deprecated", "strict", "nullable",
})
# String formats llguidance compiles to a regex; any other format would be ignored by it.
_FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid",
                      "unknown"})

# Compact JSON: a small model given free whitespace can spend its whole budget on newlines.
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(AdmissionError):
    """An invalid or unsupported grammar source: a 400 naming the problem."""

    def __init__(self, message: str, keyword: str | None = None):
        super().__init__(message, ErrorKind.UNSUPPORTED if keyword else ErrorKind.VALIDATION)
        self.keyword = keyword


def check_schema(schema: Any, path: str = "#") -> None:
    """Raise GrammarError for the first keyword we would not enforce (depth-first)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise GrammarError(f"JSON schema at {path} must be an object or a boolean, got {type(schema).__name__}")
    for key, value in schema.items():
        where = f"{path}/{key}"
        if key in _ANNOTATION_KEYWORDS:
            continue
        if key in _SCHEMA_MAP_KEYWORDS:
            if not isinstance(value, dict):
                raise GrammarError(f"JSON schema {where} must be an object")
            for name, sub in value.items():
                check_schema(sub, f"{where}/{name}")
        elif key in _SCHEMA_ONE_KEYWORDS:
            if key == "items" and isinstance(value, list):  # draft-04 tuple form
                for i, sub in enumerate(value):
                    check_schema(sub, f"{where}/{i}")
            else:
                check_schema(value, where)
        elif key in _SCHEMA_LIST_KEYWORDS:
            if not isinstance(value, list):
                raise GrammarError(f"JSON schema {where} must be an array of schemas")
            for i, sub in enumerate(value):
                check_schema(sub, f"{where}/{i}")
        elif key in _VALUE_KEYWORDS:
            if key == "format" and value not in _FORMATS:
                raise GrammarError(f"JSON schema keyword 'format' value {value!r} at {path} is not supported "
                                   f"(supported: {', '.join(sorted(_FORMATS - {'unknown'}))})", "format")
        else:
            raise GrammarError(f"JSON schema keyword {key!r} at {path} is not supported by constrained decoding",
                               key)


def closed_objects(schema: Any, *, merged: bool = False, open_defs: bool | None = None) -> Any:
    """A copy of ``schema`` (checked: check_schema's keywords) in which every object schema with ``properties``
    and no word on others (``additionalProperties``) allows no others. Left as they are: an object that combines
    subschemas (anyOf, oneOf, allOf, $ref: its properties come from them too) and an allOf member (``merged``:
    closed, it would forbid its siblings' properties); while the schema has an allOf anywhere, the $defs entries
    themselves (one may be an allOf member through a $ref)."""
    if not isinstance(schema, dict):
        return schema
    if open_defs is None:
        open_defs = '"allOf"' in json.dumps(schema)
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAP_KEYWORDS and isinstance(value, dict):
            defs = key != "properties"
            out[key] = {name: closed_objects(sub, merged=defs and open_defs, open_defs=open_defs)
                        for name, sub in value.items()}
        elif key in _SCHEMA_ONE_KEYWORDS:
            out[key] = ([closed_objects(sub, open_defs=open_defs) for sub in value] if isinstance(value, list)
                        else closed_objects(value, open_defs=open_defs))
        elif key in _SCHEMA_LIST_KEYWORDS and isinstance(value, list):
            out[key] = [closed_objects(sub, merged=key == "allOf", open_defs=open_defs) for sub in value]
        else:
            out[key] = value
    if ("properties" in schema and "additionalProperties" not in schema and not merged
            and not any(k in schema for k in ("anyOf", "oneOf", "allOf", "$ref"))):
        out["additionalProperties"] = False
    return out


class CompiledGrammar:
    """One validated grammar; ``matcher()`` gives each request its own state."""

    __slots__ = ("source", "_template", "_lock")

    def __init__(self, source: str, template: llguidance.LLMatcher):
        self.source = source  # llguidance's grammar text (for logs and cache keys)
        self._template = template
        self._lock = threading.Lock()  # deep_copy from several frontend workers

    def matcher(self) -> GrammarMatcher:
        with self._lock:
            return GrammarMatcher(self._template.deep_copy())


class GrammarMatcher:
    """A request's position in its grammar (model thread only)."""

    __slots__ = ("_m", "num_consumed")

    def __init__(self, matcher: llguidance.LLMatcher):
        self._m = matcher
        self.num_consumed = 0

    def fill_bitmask(self, words_ptr: int, num_bytes: int) -> None:
        """Write the allowed-token bitmask for the next token at ``words_ptr``."""
        self._m.unsafe_compute_mask_ptr(words_ptr, num_bytes)

    def consume(self, token_id: int) -> bool:
        ok = self._m.consume_token(token_id)
        if ok:
            self.num_consumed += 1
        return ok

    def ahead(self, tokens, num_words: int) -> AheadMask:
        """The allowed-token bitmask for the token after ``tokens`` (a speculative step's drafts, not drawn yet),
        ``num_words`` 32-bit words, with the matcher left where it was. Where the grammar does not allow every
        one of ``tokens``, the mask is the one before the first it refuses (no draw there is kept: that draft
        cannot equal a draw the grammar allows)."""
        words = array.array("I", bytes(4 * num_words))
        n = self._m.try_consume_tokens(list(tokens)) if tokens else 0
        try:
            self._m.unsafe_compute_mask_ptr(words.buffer_info()[0], 4 * num_words)
        finally:
            if n:
                self._m.rollback(n)
        return AheadMask(words)

    @property
    def failed(self) -> bool:
        return self._m.is_error()

    @property
    def error(self) -> str:
        """The first line of llguidance's error (the rest is a parser state dump)."""
        return self._m.get_error().split("\n", 1)[0]

    @property
    def accepting(self) -> bool:
        return self._m.is_accepting()

    @property
    def stopped(self) -> bool:
        return self._m.is_stopped()


_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def fill_bitmasks(targets, words_ptr: int, row_bytes: int, rows: int) -> None:
    """Each (GrammarMatcher, row) pair's mask for its next token at ``words_ptr + row * row_bytes`` (``rows`` rows
    of memory there). On a host of 8 or more CPUs the masks are computed on four of llguidance's threads (the GIL
    released): 64 masks of SmolLM2's vocabulary early in a JSON document took 0.48 ms on the H200 host's 16 cores
    against 1.03 one after another (its default of 12 threads: 0.92); on a 2-core box threads were slower over a
    whole run (docs/benchmarks.md, thirty-ninth session). A failed matcher's row allows every id (its request is
    ending); an AheadMask (a speculative copy's) is copied as it is."""
    global _executor
    live = []
    for m, row in targets:
        if not isinstance(m, GrammarMatcher):
            m.fill_bitmask(words_ptr + row * row_bytes, row_bytes)
        elif m.failed:
            ctypes.memset(words_ptr + row * row_bytes, 0xFF, row_bytes)
        else:
            live.append((m._m, row))
    if len(live) > 1 and (os.cpu_count() or 1) >= 8:
        with _executor_lock:
            if _executor is None:
                _executor = llguidance.LLExecutor(num_threads=4)
        _executor.unsafe_compute_mask_ptr(live, words_ptr, row_bytes, rows)
        return
    for m, row in live:
        m.unsafe_compute_mask_ptr(words_ptr + row * row_bytes, row_bytes)


class AheadMask:
    """A grammar position's bitmask computed ahead (GrammarMatcher.ahead), standing in for the matcher in a
    Sampler.at_position copy: fill_bitmask writes it, and it never fails."""

    __slots__ = ("_words",)
    failed = False

    def __init__(self, words: array.array):
        self._words = words

    def fill_bitmask(self, words_ptr: int, num_bytes: int) -> None:
        ctypes.memmove(words_ptr, self._words.buffer_info()[0], min(num_bytes, 4 * len(self._words)))


class GrammarCompiler:
    """Per-tokenizer compiler with a bounded cache of compiled grammars (thread-safe)."""

    def __init__(self, tokenizer_json: str, *, vocab_size: int, eos_token_ids,
                 limits: llguidance.LLParserLimits | None = None):
        # Parser limits bound one mask step's work; a grammar that outgrows them mid-generation puts its
        # matcher in the error state (that request fails, the model thread goes on). None: llguidance's.
        self.limits = limits
        eos = [int(t) for t in eos_token_ids]
        # The model's vocabulary may be wider than the tokenizer's (padding rows): masks cover the model's.
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos or None)
        self.vocab_size = vocab_size
        self.bitmask_words = (vocab_size + 31) // 32
        self._cache: collections.OrderedDict[str, CompiledGrammar] = collections.OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_frontend(cls, frontend, *, vocab_size: int, eos_token_ids) -> GrammarCompiler:
        return cls(frontend.tokenizer.to_str(), vocab_size=vocab_size, eos_token_ids=eos_token_ids)

    def json_schema(self, schema: Any) -> CompiledGrammar:
        """A grammar for JSON documents valid under ``schema`` (True or {} = any JSON value)."""
        check_schema(schema)
        # the schema's own key order (llguidance writes an object's properties in their order here, as OpenAI's
        # structured outputs promise: sorted keys would make a {"name", "arguments"} tool call write its arguments
        # first); the cache key is the same text, so schemas that differ only in order compile apart
        text = json.dumps(closed_objects(schema), separators=(",", ":"))
        return self._compile("json:" + text,
                             lambda: llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS))

    def json_object(self) -> CompiledGrammar:
        """Any JSON object (OpenAI json_object mode, Ollama format "json")."""
        return self.json_schema({"type": "object"})

    def lark(self, grammar: str) -> CompiledGrammar:
        return self._compile("lark:" + grammar, lambda: llguidance.LLMatcher.grammar_from_lark(grammar))

    def regex(self, pattern: str) -> CompiledGrammar:
        """Text that matches ``pattern`` whole (llguidance's regex syntax, Rust's regex crate)."""
        return self._compile("regex:" + pattern, lambda: llguidance.LLMatcher.grammar_from_regex(pattern))

    def any_grammar(self, grammar: str) -> CompiledGrammar:
        """A GBNF grammar (llama.cpp's, ``root ::= ...``) or a Lark one (llguidance's), told apart by syntax."""
        from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

        try:
            lark = any_to_lark(grammar)
        except (GbnfToLarkError, ValueError) as exc:
            raise GrammarError(f"invalid grammar: {exc}") from None
        return self.lark(lark)

    def _compile(self, key: str, build) -> CompiledGrammar:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        try:
            source = build()
        except ValueError as exc:
            raise GrammarError(f"invalid grammar: {exc}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, self.tokenizer,
                                                                                  limits=self.limits)
        if is_error:
            raise GrammarError(_explain(messages[0] if messages else "invalid grammar"), _keyword(messages))
        template = llguidance.LLMatcher(self.tokenizer, source, log_level=0, limits=self.limits)
        if template.is_error():
            raise GrammarError(_explain(template.get_error()))
        compiled = CompiledGrammar(source, template)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > COMPILED_CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled


def _keyword(messages: list[str]) -> str | None:
    # llguidance names unimplemented schema keys as: Unimplemented keys: ["not"]
    for m in messages:
        if "Unimplemented keys:" in m:
            try:
                keys = json.loads(m.split("Unimplemented keys:", 1)[1].strip())
                return str(keys[0]) if keys else None
            except (ValueError, IndexError):
                return None
    return None


def _explain(message: str) -> str:
    kw = _keyword([message])
    if kw is not None:
        return f"JSON schema keyword {kw!r} is not supported by constrained decoding ({message})"
    return f"invalid grammar: {message}"
