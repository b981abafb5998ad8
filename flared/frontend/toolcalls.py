"""Tool calls out of generated text, incrementally, for the template families we serve.

A parser takes one choice's text in arbitrary chunks and returns content
deltas and tool-call deltas (the first delta of a call carries its id and
name; later ones carry the next piece of its JSON arguments text).

Rules:
- A marker, or any suffix of the text that could still become one, is held
  back: markers never reach the content, however the text is split.
- The arguments deltas of a call concatenate to exactly its final
  ``arguments`` string, which is a JSON object's text. JSON-bodied calls
  stream the raw text of the arguments object as it arrives (the raw
  substring is the final value, so what was streamed is never retracted).
- A call body that turns out not to be a valid call before anything of it
  was sent is returned as content, markers included (the model's text is
  not lost); once a call has been announced it stays a call.
- Whitespace around calls is not content; text before the first call and
  after the last one is.

Families (chosen from the chat template, overridable in ServerConfig):
``hermes`` (Hermes/Qwen2.5/Qwen3 ``<tool_call>{json}</tool_call>``),
``qwen3_coder`` (``<tool_call><function=name><parameter=x>v</parameter>…``),
``llama3_json`` (a leading ``{"name": …, "parameters": …}``, optionally after
``<|python_tag|>``, several joined by ``;``), ``mistral``
(``[TOOL_CALLS][{…}, …]`` or ``[TOOL_CALLS]name[ARGS]{…}``), ``deepseek``
(``<｜tool▁calls▁begin｜>…<｜tool▁sep｜>…``), ``functionary``
(``<function=name>{…}</function>``), ``glm45`` (``<tool_call>name<arg_key>k</arg_key>
<arg_value>v</arg_value></tool_call>``), ``seed_oss`` (Qwen3-Coder's tags in
``<seed:tool_call>…</seed:tool_call>``), ``cohere`` (Command A / R7B:
``<|START_ACTION|>[{"tool_name": …, "parameters": …}]<|END_ACTION|>``), ``lfm2`` (Liquid LFM2:
``<|tool_call_start|>[name(key=value, …), …]<|tool_call_end|>``, Python calls with literal keyword
arguments), ``harmony`` (gpt-oss: messages on
channels, ``<|channel|>analysis<|message|>…<|end|>`` reasoning,
``…final<|message|>…`` the answer, ``commentary to=functions.name …
<|message|>{…}<|call|>`` a call; the one family whose parser also splits out
the reasoning).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import secrets
from typing import Any

from flared.frontend.reasoning import HARMONY, ReasoningFormat, ReasoningParser, held_suffix, is_harmony_template


@dataclasses.dataclass
class ToolCallDelta:
    index: int  # the call's position among this choice's calls
    id: str | None  # set on the call's first delta only
    name: str | None  # set on the call's first delta only
    arguments: str  # next piece of the arguments JSON text (may be empty)


@dataclasses.dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON object text


@dataclasses.dataclass
class ParsedDelta:
    content: str = ""
    calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)
    reasoning: str = ""

    def __bool__(self) -> bool:
        return bool(self.content or self.calls or self.reasoning)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


# -- incremental JSON scanning ---------------------------------------------------------------------

_WS = " \t\r\n"


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _string_end(s: str, i: int) -> int | None:
    """Index after the JSON string starting at s[i] == '"', or None if it is not closed yet."""
    j = i + 1
    while j < len(s):
        c = s[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def value_end(s: str, i: int) -> int | None:
    """Index after the JSON value starting at s[i], or None if it may not be complete yet."""
    c = s[i]
    if c == '"':
        return _string_end(s, i)
    if c in "{[":
        depth = 0
        j = i
        while j < len(s):
            c = s[j]
            if c == '"':
                e = _string_end(s, j)
                if e is None:
                    return None
                j = e
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    m = re.compile(r"[^,}\]\s]*").match(s, i)
    return m.end() if m.end() < len(s) else None


_STRING_RUN = re.compile(r'[^"\\]+')
_OUTSIDE_RUN = re.compile(r'[^"{}\[\]]+')


class ValueScanner:
    """Where the JSON object, array or string starting at ``start`` ends, for text that only grows:
    each character is looked at once over all calls (re-scanning a long argument on every token
    would make a call quadratic in its length)."""

    __slots__ = ("start", "pos", "depth", "in_string", "escape", "end")

    def __init__(self, start: int = 0):
        self.start = start
        self.pos = start
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.end: int | None = None

    def scan(self, s: str) -> int | None:
        if self.end is not None:
            return self.end
        i, n = self.pos, len(s)
        depth, in_string, escape = self.depth, self.in_string, self.escape
        while i < n:
            if escape:
                escape = False
                i += 1
                continue
            c = s[i]
            if in_string:
                if c == "\\":
                    escape = True
                elif c == '"':
                    in_string = False
                    if depth == 0:
                        self.end = i + 1
                        break
                else:
                    i = _STRING_RUN.match(s, i).end()
                    continue
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth <= 0:
                    self.end = i + 1
                    break
            else:
                i = _OUTSIDE_RUN.match(s, i).end()
                continue
            i += 1
        self.pos, self.depth, self.in_string, self.escape = i, depth, in_string, escape
        return self.end


class _NotACall(ValueError):
    pass


def _scan_object(s: str) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """Top-level keys of the JSON object that ``s`` starts with: key -> (value start, value end or None),
    and the index after the object (None while incomplete). Raises _NotACall on a non-object."""
    keys: dict[str, tuple[int, int | None]] = {}
    i = _skip_ws(s, 0)
    if i >= len(s):
        return keys, None
    if s[i] != "{":
        raise _NotACall(s)
    i += 1
    while True:
        i = _skip_ws(s, i)
        if i >= len(s):
            return keys, None
        if s[i] == "}":
            return keys, i + 1
        if s[i] == ",":
            i += 1
            continue
        if s[i] != '"':
            raise _NotACall(s)
        k_end = _string_end(s, i)
        if k_end is None:
            return keys, None
        key = json.loads(s[i:k_end])
        i = _skip_ws(s, k_end)
        if i >= len(s):
            return keys, None
        if s[i] != ":":
            raise _NotACall(s)
        i = _skip_ws(s, i + 1)
        if i >= len(s):
            return keys, None
        v_end = value_end(s, i)
        keys[key] = (i, v_end)
        if v_end is None:
            return keys, None
        i = v_end


_ARGS_KEYS = ("arguments", "parameters")


class _JsonCall:
    """One ``{"name": …, "arguments": {…}}`` object arriving in pieces."""

    def __init__(self, parser: "ToolParser"):
        self.parser = parser
        self.index: int | None = None  # set once announced
        self.args_sent = 0  # characters of the raw arguments value already sent
        # Once the name is known and the arguments object has begun, only it is scanned further.
        self._args: ValueScanner | None = None

    def _args_span(self, keys) -> tuple[int, int | None] | None:
        for k in _ARGS_KEYS:
            if k in keys:
                return keys[k]
        return None

    def update(self, s: str) -> list[ToolCallDelta]:
        """``s``: the object's text so far (possibly incomplete). Returns the deltas it allows."""
        if self._args is not None:
            return self._stream_args(s)
        try:
            keys, _end = _scan_object(s)
        except (_NotACall, ValueError):
            return []
        out = []
        if self.index is None:
            span = keys.get(self.parser.NAME_KEY)
            if span is None or span[1] is None:
                return []
            name = json.loads(s[span[0]:span[1]])
            if not isinstance(name, str):
                return []
            d = self.parser._announce(name)
            self.index = d.index
            out.append(d)
        span = self._args_span(keys)
        if span is not None and s[span[0]] == "{":
            self._args = ValueScanner(span[0])
            out.extend(self._stream_args(s))
        return out

    def _stream_args(self, s: str) -> list[ToolCallDelta]:
        start = self._args.start
        end = self._args.scan(s)
        piece = s[start + self.args_sent:end if end is not None else len(s)]
        if not piece:
            return []
        self.args_sent += len(piece)
        return [ToolCallDelta(self.index, None, None, piece)]

    def finish(self, s: str) -> list[ToolCallDelta] | None:
        """The complete object's text; None when it is not a call and nothing was announced."""
        try:
            obj = json.loads(s)
            keys, _ = _scan_object(s)
        except (ValueError, _NotACall):
            obj = keys = None
        ok = isinstance(obj, dict) and isinstance(obj.get(self.parser.NAME_KEY), str)
        if not ok:
            if self.index is None:
                return None
            self.parser._close(self.index, "{}" if self.args_sent == 0 else None)
            return []
        out = self.update(s) if self.index is None else []
        span = self._args_span(keys)
        if span is not None and s[span[0]] == "{" and (self.args_sent or span[1] is not None):
            final = s[span[0]:span[1]]
            rest = final[self.args_sent:]
        else:
            args = next((obj[k] for k in _ARGS_KEYS if k in obj), {})
            final = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            rest = final
        if rest:
            out.append(ToolCallDelta(self.index, None, None, rest))
        self.parser._close(self.index, final)
        return out


# -- parsers ---------------------------------------------------------------------------------------

class ToolParser:
    """Base: call bookkeeping; subclasses implement ``_step`` over ``self._buf``."""

    name = ""
    # True when the family's markers are special tokens the detokenizer would otherwise skip.
    needs_special_tokens = False
    NAME_KEY = "name"  # a JSON-bodied call's key for the function's name

    def __init__(self, tools: list[dict] | None = None):
        self.tools = tools or []
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._out: ParsedDelta = ParsedDelta()
        self._held_ws = ""  # trailing whitespace of content: dropped if a call follows
        self._after_call = False  # drop whitespace right after a call
        self.num_closed = 0  # calls[:num_closed] are complete (a route that sends whole calls sends these)

    # bookkeeping used by the families
    def _announce(self, name: str) -> ToolCallDelta:
        call = ToolCall(new_call_id(), name, "")
        self.calls.append(call)
        return ToolCallDelta(len(self.calls) - 1, call.id, name, "")

    def _close(self, index: int, final_arguments: str | None) -> None:
        if final_arguments is not None:
            self.calls[index].arguments = final_arguments
        self._after_call = True
        self.num_closed = max(self.num_closed, index + 1)

    def _emit_content(self, text: str) -> None:
        if not text:
            return
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._held_ws + text
        stripped = text.rstrip()
        self._held_ws = text[len(stripped):]
        self._out.content += stripped

    def _emit_calls(self, deltas: list[ToolCallDelta]) -> None:
        if deltas:
            self._held_ws = ""
            self._out.calls.extend(deltas)

    def _send_whole(self, calls: list[tuple[str, dict | str]]) -> None:
        """Calls parsed whole (name, arguments: an object, or its JSON text as the model wrote it): each announced,
        its arguments sent in one piece, closed."""
        for name, arguments in calls:
            announced = self._announce(name)
            text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
            self.calls[announced.index].arguments = text
            self._emit_calls([announced, ToolCallDelta(announced.index, None, None, text)])
            self._close(announced.index, None)

    def _announce_typed(self, name: str) -> int:
        """A key/value family's call of ``name`` announced (its parameters' schema types in ``self._types``); its
        index."""
        d = self._announce(name)
        self._types = _param_types(self.tools, name)
        self._emit_calls([d])
        return d.index

    def _typed_argument(self, index: int, count: int, key: str, value: str, kind: Any) -> None:
        """Call ``index``'s next key/value pair (its ``count``-th) as JSON text, the value typed by the tool's schema
        (``kind``), streamed as a delta."""
        piece = ("{" if count == 0 else ", ") + json.dumps(key, ensure_ascii=False) + ": " + \
            json.dumps(_convert_param(value, kind), ensure_ascii=False)
        self.calls[index].arguments += piece
        self._emit_calls([ToolCallDelta(index, None, None, piece)])

    def _close_arguments(self, index: int, count: int) -> None:
        """Call ``index``'s arguments object closed after ``count`` pairs, and the call with it."""
        piece = "{}" if count == 0 else "}"
        self.calls[index].arguments += piece
        self._emit_calls([ToolCallDelta(index, None, None, piece)])
        self._close(index, None)

    def _take(self) -> ParsedDelta:
        out, self._out = self._out, ParsedDelta()
        return out

    def push(self, text: str) -> ParsedDelta:
        self._buf += text
        while self._step(final=False):
            pass
        return self._take()

    def finish(self) -> ParsedDelta:
        while self._step(final=True):
            pass
        self._finish_rest()
        if self._held_ws and not self.calls:
            self._out.content += self._held_ws
        self._held_ws = ""
        return self._take()

    def parse(self, text: str) -> ParsedDelta:
        """The whole text at once."""
        a = self.push(text)
        b = self.finish()
        return ParsedDelta(a.content + b.content, a.calls + b.calls, a.reasoning + b.reasoning)

    def _step(self, final: bool) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def _finish_rest(self) -> None:
        """At the end: whatever is still buffered (an unfinished call) becomes content or a truncated call."""
        raise NotImplementedError

    def _text_until(self, marker: str, final: bool) -> bool:
        """In text: emit content up to ``marker``; True (marker consumed) when it was found."""
        i = self._buf.find(marker)
        if i >= 0:
            self._emit_content(self._buf[:i])
            self._buf = self._buf[i + len(marker):]
            return True
        keep = 0 if final else held_suffix(self._buf, marker)
        self._emit_content(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": …, "arguments": {…}}</tool_call>``, any number of them."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, tools=None):
        super().__init__(tools)
        self._call: _JsonCall | None = None
        self._body: ValueScanner | None = None  # the call body's JSON object, once it began

    def _body_end(self) -> int | None:
        """Where the call's JSON object ends (None: not yet); 0 for a body that is not an object."""
        if self._body is None:
            lead = len(self._buf) - len(self._buf.lstrip())
            if lead == len(self._buf):
                return None
            if self._buf[lead] != "{":
                return 0
            self._body = ValueScanner(lead)
        return self._body.scan(self._buf)

    def _step(self, final: bool) -> bool:
        if self._call is None:
            if not self._text_until(self.OPEN, final):
                return False
            self._call, self._body = _JsonCall(self), None
            return True
        # The closing marker counts only after the JSON object ends (it may occur inside a string);
        # a body that is not an object at all ends at the first closing marker.
        obj_end = self._body_end()
        i = -1 if obj_end is None else self._buf.find(self.CLOSE, obj_end)
        if i < 0:
            # every character inside the arguments object belongs to it, marker-like or not
            self._emit_calls(self._call.update(self._buf))
            return False
        body, self._buf = self._buf[:i], self._buf[i + len(self.CLOSE):]
        deltas = self._call.finish(body.strip())
        if deltas is None:
            self._emit_content(self.OPEN + body + self.CLOSE)
        else:
            self._emit_calls(deltas)
        self._call = None
        return True

    def _finish_rest(self) -> None:
        if self._call is not None:
            cut = self._buf.rfind(self.CLOSE)
            tail = ""
            if cut >= 0:
                self._buf, tail = self._buf[:cut], self._buf[cut + len(self.CLOSE):]
            body = self._buf.strip()
            deltas = self._call.finish(body) if body else None
            if deltas is None:
                if self._call.index is None:
                    self._emit_content(self.OPEN + self._buf)
                else:
                    self._close(self._call.index, "{}" if self._call.args_sent == 0 else None)
            else:
                self._emit_calls(deltas)
            self._call = None
            self._emit_content(tail)
        elif self._buf:
            self._emit_content(self._buf)
        self._buf = ""


def _param_types(tools: list[dict], function: str) -> dict[str, Any]:
    for t in tools:
        f = t.get("function", t) if isinstance(t, dict) else {}
        if isinstance(f, dict) and f.get("name") == function:
            props = (f.get("parameters") or f.get("input_schema") or {}).get("properties") or {}
            return {k: (v or {}).get("type") for k, v in props.items() if isinstance(v, dict)}
    return {}


def _convert_param(value: str, kind: Any) -> Any:
    if kind == "string" or kind is None:
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


class Qwen3CoderToolParser(ToolParser):
    """``<tool_call><function=name><parameter=x>value</parameter>…</function></tool_call>``.

    Arguments stream one parameter at a time (a value is only typed once it
    is complete: the tool's JSON schema says whether "7" is a string)."""

    name = "qwen3_coder"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    # the function's and a parameter's opening tags (their names captured), the tags that close them
    FUNC_OPEN, FUNC_END, PARAM_OPEN, PARAM_END = "<function=", "</function>", "<parameter=", "</parameter>"
    _FUNC = re.compile(r"\s*<function=([^>\n]+)>")
    _PARAM = re.compile(r"\s*<parameter=([^>\n]+)>")

    def __init__(self, tools=None):
        super().__init__(tools)
        self._state = "text"  # text | call | function | param
        self._index = -1
        self._nparams = 0
        self._param = ""
        self._types: dict[str, Any] = {}
        self._raw = ""  # the call's text as it came, for a body that is not a call
        self._searched = 0  # in a parameter value: no closing tag starts before this index

    def _step(self, final: bool) -> bool:
        if self._state == "text":
            if not self._text_until(self.OPEN, final):
                return False
            self._state, self._raw = "call", self.OPEN
            return True
        if self._state == "closing":
            lead = self._buf.lstrip()
            if lead.startswith(self.CLOSE):
                self._buf = lead[len(self.CLOSE):]
            elif self.CLOSE.startswith(lead) and not final:
                return False
            self._state = "text"
            return True
        if self._state == "call":
            m = self._FUNC.match(self._buf)
            if m is None:
                lead = self._buf.lstrip()
                undecided = not lead or self.FUNC_OPEN.startswith(lead) or (
                    lead.startswith(self.FUNC_OPEN) and ">" not in lead)
                if undecided and not final:
                    return False
                # not a call after all: give the text back as content
                self._state = "text"
                self._emit_content(self._raw)
                self._raw = ""
                return True
            name = m.group(1).strip()
            self._raw += self._buf[:m.end()]
            self._buf = self._buf[m.end():]
            self._index, self._nparams = self._announce_typed(name), 0
            self._state = "function"
            return True
        if self._state == "function":
            m = self._PARAM.match(self._buf)
            if m is not None:
                self._param = m.group(1).strip()
                self._buf = self._buf[m.end():]
                self._state = "param"
                return True
            lead = self._buf.lstrip()
            if lead.startswith(self.FUNC_END):
                self._buf = lead[len(self.FUNC_END):]
                self._end_call()
                return True
            if lead.startswith(self.CLOSE):
                self._buf = lead
                self._end_call()
                return True
            return False
        # param value, up to its closing tag; searched from where the last search stopped (a long
        # value is not re-searched on every token)
        start = self._searched
        i = self._buf.find(self.PARAM_END, start)
        if i < 0:
            j = self._buf.find(self.PARAM_OPEN, start)
            k = self._buf.find(self.FUNC_END, start)
            ends = [x for x in (j, k) if x >= 0]
            if not ends:
                self._searched = max(0, len(self._buf) - len(self.PARAM_END) + 1)
                return False
            i, skip = min(ends), 0  # an unclosed parameter: the next tag ends it
        else:
            skip = len(self.PARAM_END)
        self._searched = 0
        value = self._buf[:i]
        self._buf = self._buf[i + skip:]
        if value.startswith("\n"):
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        self._typed_argument(self._index, self._nparams, self._param, value, self._types.get(self._param))
        self._nparams += 1
        self._state = "function"
        return True

    def _end_call(self) -> None:
        self._close_arguments(self._index, self._nparams)
        lead = self._buf.lstrip()
        if lead.startswith(self.CLOSE):
            self._buf = lead[len(self.CLOSE):]
            self._state = "text"
        else:
            self._state = "closing"

    def _finish_rest(self) -> None:
        if self._state == "call":
            self._emit_content(self._raw + self._buf)
        elif self._state in ("function", "param"):
            if self._state == "param" and self._buf.strip():
                self._buf += self.PARAM_END
                self._step(final=True)
            self._end_call()
        elif self._buf and self._state == "text":
            self._emit_content(self._buf)
        self._buf = ""
        self._state = "text"


class SeedOssToolParser(Qwen3CoderToolParser):
    """Seed-OSS: Qwen3-Coder's function and parameter tags inside ``<seed:tool_call>…</seed:tool_call>``."""

    name = "seed_oss"
    needs_special_tokens = True  # (its markers are added tokens the detokenizer would skip)
    OPEN, CLOSE = "<seed:tool_call>", "</seed:tool_call>"


class Glm45ToolParser(ToolParser):
    """GLM-4.5 / 4.6 / 4.7: ``<tool_call>name\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>…</tool_call>``.

    Arguments stream one key/value pair at a time, each value typed by the tool's JSON schema as Qwen3-Coder's are
    (a string parameter keeps its text; others are read as JSON where they parse)."""

    name = "glm45"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _KEY, _KEY_END, _VALUE, _VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"

    def __init__(self, tools=None):
        super().__init__(tools)
        self._state = "text"  # text | name | args | key | value
        self._index = -1
        self._nargs = 0
        self._key = ""
        self._types: dict[str, Any] = {}

    def _step(self, final: bool) -> bool:
        if self._state == "text":
            if not self._text_until(self.OPEN, final):
                return False
            self._state = "name"
            return True
        if self._state == "name":  # the function's name: up to a newline, the first key or the end of the call
            ends = [i for i in (self._buf.find("\n"), self._buf.find(self._KEY), self._buf.find(self.CLOSE)) if i >= 0]
            if not ends:
                if final:  # the output ended inside the name: the text is the model's
                    self._emit_content(self.OPEN + self._buf)
                    self._buf, self._state = "", "text"
                return False
            name = self._buf[:min(ends)].strip()
            if not name or any(c in name for c in "<>{}\"'"):  # not a call after all: give the text back
                self._emit_content(self.OPEN)
                self._state = "text"
                return True
            self._buf = self._buf[min(ends):]
            self._index, self._nargs = self._announce_typed(name), 0
            self._state = "args"
            return True
        if self._state == "args":
            lead = self._buf.lstrip()
            for tag, state in ((self._KEY, "key"), (self.CLOSE, None)):
                if lead.startswith(tag):
                    self._buf = lead[len(tag):]
                    if state is None:
                        self._end_call()
                    else:
                        self._state = state
                    return True
            if final or not any(t.startswith(lead) for t in (self._KEY, self.CLOSE)):
                if final or lead:  # something else inside a call: it ends there
                    self._end_call()
                    self._buf = lead
                    return bool(lead)
            return False
        if self._state == "key":
            i = self._buf.find(self._KEY_END)
            if i < 0:
                return False
            self._key, self._buf = self._buf[:i].strip(), self._buf[i + len(self._KEY_END):]
            self._state = "value"
            return True
        # value: after its opening tag, up to its closing one
        lead = self._buf.lstrip()
        if not lead.startswith(self._VALUE):
            if not final and self._VALUE.startswith(lead):
                return False
            self._buf, value = lead, ""
        else:
            i = lead.find(self._VALUE_END, len(self._VALUE))
            if i < 0:
                if not final:
                    return False
                i = len(lead)
            value, self._buf = lead[len(self._VALUE):i], lead[i + len(self._VALUE_END):]
        self._typed_argument(self._index, self._nargs, self._key, value, self._types.get(self._key))
        self._nargs += 1
        self._state = "args"
        return True

    def _end_call(self) -> None:
        self._close_arguments(self._index, self._nargs)
        self._state = "text"

    def _finish_rest(self) -> None:
        if self._state in ("args", "key", "value"):
            self._end_call()
        elif self._buf and self._state == "text":
            self._emit_content(self._buf)
        self._buf = ""
        self._state = "text"


class MiniMaxToolParser(Qwen3CoderToolParser):
    """MiniMax-M2: ``<minimax:tool_call><invoke name="f"><parameter name="x">v</parameter></invoke>
    </minimax:tool_call>``, one block holding any number of invocations (typed as Qwen3-Coder's parameters)."""

    name = "minimax_m2"
    needs_special_tokens = True  # (its markers are added tokens the detokenizer would skip)
    OPEN, CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
    FUNC_OPEN, FUNC_END, PARAM_OPEN, PARAM_END = '<invoke name="', "</invoke>", '<parameter name="', "</parameter>"
    _FUNC = re.compile(r'\s*<invoke name="([^"\n]+)">')
    _PARAM = re.compile(r'\s*<parameter name="([^"\n]+)">')

    def _end_call(self) -> None:  # (another invocation may follow inside the same block)
        self._close_arguments(self._index, self._nparams)
        self._state = "between"

    def _step(self, final: bool) -> bool:
        if self._state != "between":
            return super()._step(final)
        lead = self._buf.lstrip()
        if lead.startswith(self.CLOSE):
            self._buf, self._state = lead[len(self.CLOSE):], "text"
        elif lead.startswith(self.FUNC_OPEN):
            self._buf, self._state, self._raw = lead, "call", ""
        elif not final and (self.CLOSE.startswith(lead) or self.FUNC_OPEN.startswith(lead)):
            return False  # (undecided)
        else:
            self._state = "text"
        return True


class _LeadingCallsParser(ToolParser):
    """Families whose calls, if any, open the answer (after one of TAGS): the lead decides between calls and text
    (``_decide``: "calls", "text", or None while undecided); ``_calls_step`` reads the calls from ``self._buf``, the
    tag that opened them in ``self._tag``."""

    TAGS: tuple[str, ...] = ()

    def __init__(self, tools=None):
        super().__init__(tools)
        self._state = "start"  # start | text | (the family's own)
        self._tag = ""

    def _decide(self, lead: str) -> str | None:
        raise NotImplementedError

    def _calls_step(self, final: bool) -> bool:
        raise NotImplementedError

    def _step(self, final: bool) -> bool:
        if self._state == "start":
            lead = self._buf.lstrip()
            decision = self._decide(lead)
            if decision is None:
                if not final:
                    return False
                decision = "text"
            if decision == "calls":
                self._tag = next((tag for tag in self.TAGS if lead.startswith(tag)), "")
                self._buf = lead[len(self._tag):].lstrip()
            self._state = decision
            return True
        if self._state == "text":
            self._emit_content(self._buf)
            self._buf = ""
            return False
        return self._calls_step(final)


class Llama3JsonToolParser(_LeadingCallsParser):
    """Llama 3.x JSON calls: the output starts with ``{"name": …, "parameters": {…}}`` (or
    ``<|python_tag|>``, Llama 4's ``<|python_start|>``, whose ``<|python_end|>`` closes the calls); several calls
    are joined by ``;``. Anything else is plain content."""

    name = "llama3_json"
    needs_special_tokens = True
    TAG = "<|python_tag|>"
    TAGS = (TAG, "<|python_start|>")
    END = "<|python_end|>"

    def __init__(self, tools=None):
        super().__init__(tools)
        self._call: _JsonCall | None = None

    def _decide(self, lead: str) -> str | None:
        t = lead
        if any(tag.startswith(t) for tag in self.TAGS):
            return None  # empty, or a prefix of a tag: undecided
        tag = next((tag for tag in self.TAGS if t.startswith(tag)), None)
        if tag is not None:
            t = t[len(tag):].lstrip()
            if not t:
                return None
        if t[0] != "{":
            return "text"
        rest = t[1:].lstrip()
        if not rest:
            return None
        if rest[0] != '"':
            return "text"
        key = rest[1:]
        for k in ('name"', 'type"'):
            if key.startswith(k):
                return "calls"
            if k.startswith(key):
                return None
        return "text"

    def _calls_step(self, final: bool) -> bool:
        self._buf = self._buf.lstrip(_WS + ";")
        if self._buf.startswith(self.END):  # (Llama 4's: the calls end; what follows is content)
            self._buf = self._buf[len(self.END):]
            self._state = "text"
            return True
        if not self._buf or self.END.startswith(self._buf):
            return False
        if self._buf[0] != "{":
            self._state = "text"
            return True
        if self._call is None:
            self._call, self._body = _JsonCall(self), ValueScanner(0)
        end = self._body.scan(self._buf)
        if end is None:
            self._emit_calls(self._call.update(self._buf))
            return False
        body, self._buf = self._buf[:end], self._buf[end:]
        deltas = self._call.finish(body)
        self._call = None
        if deltas is None:
            self._emit_content(body)
            self._state = "text"
        else:
            self._emit_calls(deltas)
        return True

    def _finish_rest(self) -> None:
        if self._call is not None:
            if self._call.index is None:
                self._emit_content(self._buf)
            else:
                self._close(self._call.index, "{}" if self._call.args_sent == 0 else None)
            self._call = None
        elif self._buf:
            self._emit_content(self._buf)
        self._buf = ""


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS][{"name": …, "arguments": {…}}, …]`` (v3) or ``[TOOL_CALLS]name[ARGS]{…}`` (v11+)."""

    name = "mistral"
    needs_special_tokens = True
    OPEN, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self, tools=None):
        super().__init__(tools)
        self._state = "text"  # text | head | array | named_name | named_args
        self._call: _JsonCall | None = None
        self._index = -1
        self._sent = 0

    def _step(self, final: bool) -> bool:
        if self._state == "text":
            if not self._text_until(self.OPEN, final):
                return False
            self._state = "head"
            return True
        if self._state == "head":
            lead = self._buf.lstrip()
            if not lead:
                return False
            if lead[0] == "[":
                self._buf = lead[1:]
                self._state = "array"
            else:
                self._buf = lead
                self._state = "named_name"
            return True
        if self._state == "array":
            self._buf = self._buf.lstrip(_WS + ",")
            if not self._buf:
                return False
            if self._buf[0] == "]":
                self._buf = self._buf[1:]
                self._state = "text"
                self._after_call = True
                return True
            if self._buf[0] != "{":
                self._state = "text"  # malformed: the rest is content
                return True
            if self._call is None:
                self._call, self._body = _JsonCall(self), ValueScanner(0)
            end = self._body.scan(self._buf)
            if end is None:
                self._emit_calls(self._call.update(self._buf))
                return False
            body, self._buf = self._buf[:end], self._buf[end:]
            deltas = self._call.finish(body)
            self._call = None
            self._emit_calls(deltas or [])
            return True
        if self._state == "named_name":
            i = self._buf.find(self.ARGS)
            if i < 0:
                return False
            d = self._announce(self._buf[:i].strip())
            self._index, self._sent = d.index, 0
            self._emit_calls([d])
            self._buf = self._buf[i + len(self.ARGS):].lstrip()
            self._state = "named_args"
            return True
        # named_args: one JSON object
        if not self._buf:
            return False
        if self._sent == 0:
            self._body = ValueScanner(0)
        end = self._body.scan(self._buf)
        stop = end if end is not None else len(self._buf)
        piece = self._buf[self._sent:stop]
        if piece:
            self._sent += len(piece)
            self.calls[self._index].arguments += piece
            self._emit_calls([ToolCallDelta(self._index, None, None, piece)])
        if end is None:
            return False
        self._buf = self._buf[end:]
        self._close(self._index, None)
        lead = self._buf.lstrip()
        if lead.startswith(self.OPEN):
            self._buf = lead[len(self.OPEN):]
            self._state = "head"
        else:
            self._state = "text"
        return True

    def _finish_rest(self) -> None:
        if self._call is not None and self._call.index is not None:
            self._close(self._call.index, "{}" if self._call.args_sent == 0 else None)
        elif self._state == "named_name":
            self._emit_content(self.OPEN + self._buf)
        elif self._state == "named_args":
            if not self.calls[self._index].arguments:
                self.calls[self._index].arguments = "{}"
            self._close(self._index, None)
        elif self._state == "text" and self._buf:
            self._emit_content(self._buf)
        self._call = None
        self._buf = ""


class NemotronToolParser(MistralToolParser):
    """NVIDIA Nemotron Nano 2: ``<TOOLCALL>[{"name": …, "arguments": {…}}, …]</TOOLCALL>``, Mistral v3's array
    between a marker pair (the closing one consumed with the array; text after <TOOLCALL> that is no array is the
    model's text, the marker included)."""

    name = "nemotron"
    OPEN, CLOSE = "<TOOLCALL>", "</TOOLCALL>"

    def _step(self, final: bool) -> bool:
        if self._state == "head":
            lead = self._buf.lstrip()
            if not lead:
                return False
            if lead[0] != "[":  # not a call list: the marker and what follows are content
                self._emit_content(self.OPEN + self._buf)
                self._buf, self._state = "", "text"
                return True
            self._buf, self._state = lead[1:], "array"
            return True
        if self._state == "close":  # after the array's "]": its closing marker, if it comes
            lead = self._buf.lstrip()
            if lead.startswith(self.CLOSE):
                self._buf, self._state = lead[len(self.CLOSE):], "text"
                return True
            if not final and self.CLOSE.startswith(lead):
                return False
            self._state = "text"
            return True
        before = self._state
        progressed = super()._step(final)
        if before == "array" and self._state == "text" and self._after_call:
            self._state = "close"
        return progressed

    def _finish_rest(self) -> None:
        if self._state == "close":
            self._state, self._buf = "text", ""
        super()._finish_rest()


class ApertusToolParser(ToolParser):
    """Apertus: ``<|tools_prefix|>[{"name": {arguments}}, …]<|tools_suffix|>``: a JSON list whose objects each name a
    function by their one key, its value the arguments; the calls are sent whole when the list closes. A block that is
    no such list stays content, markers included."""

    name = "apertus"
    needs_special_tokens = True
    OPEN, CLOSE = "<|tools_prefix|>", "<|tools_suffix|>"

    def __init__(self, tools=None):
        super().__init__(tools)
        self._inside = False

    def _step(self, final: bool) -> bool:
        if not self._inside:
            if not self._text_until(self.OPEN, final):
                return False
            self._inside = True
            return True
        lead = _skip_ws(self._buf, 0)
        if lead >= len(self._buf):
            return False
        if self._buf[lead] != "[":  # not a call list: the marker is the model's text, and what follows
            self._emit_content(self.OPEN)
            self._inside = False
            return True
        end = value_end(self._buf, lead)  # (the list, strings holding the marker included)
        if end is None:
            return False
        after = self._buf[end:]
        rest = after.lstrip()
        closed = rest.startswith(self.CLOSE)
        if not closed and not final and self.CLOSE.startswith(rest):
            return False
        body, self._buf = self._buf[:end], rest[len(self.CLOSE):] if closed else after
        self._inside = False
        self._send(body, self.CLOSE if closed else "")
        return True

    def _send(self, body: str, close: str) -> None:
        try:
            calls = json.loads(body)
        except ValueError:
            calls = None
        if not isinstance(calls, list) or not all(isinstance(c, dict) and len(c) == 1 and isinstance(
                next(iter(c.values())), (dict, str)) for c in calls):
            self._emit_content(self.OPEN + body + close)
            return
        self._send_whole([next(iter(call.items())) for call in calls])

    def _finish_rest(self) -> None:
        if self._inside:  # cut off (max_tokens) inside its list: the model's text, the marker included
            self._inside = False
            self._emit_content(self.OPEN + self._buf)
        elif self._buf:
            self._emit_content(self._buf)
        self._buf = ""


class FireFunctionToolParser(NemotronToolParser):
    """FireFunction v2: ``functools[{"name": …, "arguments": {…}}, …]``, the array after a plain-text marker and no
    closing one."""

    name = "firefunction"
    needs_special_tokens = False
    OPEN, CLOSE = "functools", ""


class CohereToolParser(MistralToolParser):
    """Command A / Command R7B: ``<|START_ACTION|>[{"tool_call_id": …, "tool_name": …, "parameters": {…}}, …]
    <|END_ACTION|>``; the answer's ``<|START_RESPONSE|>`` / ``<|END_RESPONSE|>`` markers are not content."""

    name = "cohere"
    OPEN, ARGS = "<|START_ACTION|>", "\x00"  # (no named form)
    NAME_KEY = "tool_name"
    _DROPPED = ("<|END_ACTION|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>")

    def _step(self, final: bool) -> bool:
        if self._state != "text":
            return super()._step(final)
        found = [(i, m) for m in (self.OPEN, *self._DROPPED) if (i := self._buf.find(m)) >= 0]
        if found:
            i, marker = min(found)
            self._emit_content(self._buf[:i])
            self._buf = self._buf[i + len(marker):]
            if marker == self.OPEN:
                self._state = "head"
            return True
        keep = 0 if final else max(held_suffix(self._buf, m) for m in (self.OPEN, *self._DROPPED))
        self._emit_content(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False


class DeepSeekToolParser(ToolParser):
    """DeepSeek V3/R1 (``<｜tool▁call▁begin｜>function<｜tool▁sep｜>name\\n```json\\n{…}\\n```<｜tool▁call▁end｜>``)
    and V3.1 (``<｜tool▁call▁begin｜>name<｜tool▁sep｜>{…}<｜tool▁call▁end｜>``)."""

    name = "deepseek"
    needs_special_tokens = True
    CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"

    def __init__(self, tools=None):
        super().__init__(tools)
        self._state = "text"  # text | calls | header | name | fence | args
        self._index = -1
        self._sent = 0
        self._terminator = self.CALL_END

    def _step(self, final: bool) -> bool:
        if self._state == "text":
            if not self._text_until(self.CALLS_BEGIN, final):
                return False
            self._state = "calls"
            return True
        if self._state == "calls":
            lead = self._buf.lstrip()
            if lead.startswith(self.CALL_BEGIN):
                self._buf = lead[len(self.CALL_BEGIN):]
                self._state = "header"
                return True
            if lead.startswith(self.CALLS_END):
                self._buf = lead[len(self.CALLS_END):]
                self._state = "text"
                self._after_call = True
                return True
            if not lead or self.CALL_BEGIN.startswith(lead) or self.CALLS_END.startswith(lead):
                return False
            self._buf = lead
            self._state = "text"
            return True
        if self._state == "header":
            i = self._buf.find(self.SEP)
            if i < 0:
                return False
            header, self._buf = self._buf[:i].strip(), self._buf[i + len(self.SEP):]
            if header == "function":
                self._state = "name"
            else:
                self._open(header, self.CALL_END)
            return True
        if self._state == "name":
            i = self._buf.find("\n")
            if i < 0:
                return False
            name, self._buf = self._buf[:i].strip(), self._buf[i + 1:]
            self._open(name, "\n```")
            self._state = "fence"
            return True
        if self._state == "fence":
            lead = self._buf.lstrip()
            if lead.startswith("```json"):
                self._buf = lead[len("```json"):]
                self._state = "args"
                return True
            if not lead or "```json".startswith(lead):
                return False
            self._buf, self._terminator, self._state = lead, self.CALL_END, "args"
            return True
        # args, up to the terminator; leading and trailing whitespace is not part of them
        if self._sent == 0:
            self._buf = self._buf.lstrip()
        i = self._buf.find(self._terminator)
        if i < 0:
            end = len(self._buf) - held_suffix(self._buf, self._terminator)
            body = self._buf[:end]
            end = len(body.rstrip())
            if end > self._sent:
                self._send(self._buf[self._sent:end])
            return False
        body = self._buf[:i].rstrip()
        if len(body) > self._sent:
            self._send(body[self._sent:])
        if not self.calls[self._index].arguments:
            self._send("{}")
        self._buf = self._buf[i + len(self._terminator):]
        if self._terminator != self.CALL_END:
            j = self._buf.find(self.CALL_END)
            if j < 0:
                self._terminator = self.CALL_END
                self._state = "drain"
                return False
            self._buf = self._buf[j + len(self.CALL_END):]
        self._close(self._index, None)
        self._state = "calls"
        return True

    def _open(self, name: str, terminator: str) -> None:
        d = self._announce(name)
        self._index, self._sent, self._terminator = d.index, 0, terminator
        self._emit_calls([d])
        self._state = "args"

    def _send(self, piece: str) -> None:
        self._sent += len(piece)
        self.calls[self._index].arguments += piece
        self._emit_calls([ToolCallDelta(self._index, None, None, piece)])

    def push(self, text: str) -> ParsedDelta:
        self._buf += text
        while True:
            if self._state == "drain":
                j = self._buf.find(self.CALL_END)
                if j < 0:
                    self._buf = self._buf[len(self._buf) - held_suffix(self._buf, self.CALL_END):]
                    break
                self._buf = self._buf[j + len(self.CALL_END):]
                self._close(self._index, None)
                self._state = "calls"
                continue
            if not self._step(final=False):
                break
        return self._take()

    def _finish_rest(self) -> None:
        if self._state in ("args", "fence", "name", "drain") and self._index >= 0 and \
                self._state != "name":
            if self._state == "args":
                body = self._buf.strip()
                if body.endswith("```"):
                    body = body[:-3].rstrip()
                if len(body) > self._sent:
                    self._send(body[self._sent:])
            if not self.calls[self._index].arguments:
                self._send("{}")
            self._close(self._index, None)
        elif self._state == "text" and self._buf:
            self._emit_content(self._buf)
        self._buf = ""
        self._state = "text"


class FunctionaryToolParser(ToolParser):
    """Functionary v3.1 (Llama 3.1 based): ``<function=name>{…}</function>``, any number of them."""

    name = "functionary"
    OPEN, CLOSE = "<function=", "</function>"

    def __init__(self, tools=None):
        super().__init__(tools)
        self._state = "text"  # text | name | args | close
        self._index = -1
        self._sent = 0

    def _step(self, final: bool) -> bool:
        if self._state == "text":
            if not self._text_until(self.OPEN, final):
                return False
            self._state = "name"
            return True
        if self._state == "name":
            i = self._buf.find(">")
            if i < 0:
                return False
            d = self._announce(self._buf[:i].strip())
            self._index, self._sent = d.index, 0
            self._emit_calls([d])
            self._buf = self._buf[i + 1:]
            self._state = "args"
            return True
        if self._state == "args":
            if self._sent == 0:
                self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            if self._sent == 0 and self._buf[0] != "{":
                self._state = "close"  # no arguments object
                return True
            if self._sent == 0:
                self._body = ValueScanner(0)
            end = self._body.scan(self._buf)
            stop = end if end is not None else len(self._buf)
            if stop > self._sent:
                piece = self._buf[self._sent:stop]
                self._sent = stop
                self.calls[self._index].arguments += piece
                self._emit_calls([ToolCallDelta(self._index, None, None, piece)])
            if end is None:
                return False
            self._buf = self._buf[end:]
            self._state = "close"
            return True
        # close: the closing tag, if the model wrote it
        lead = self._buf.lstrip()
        if lead.startswith(self.CLOSE):
            self._buf = lead[len(self.CLOSE):]
        elif self.CLOSE.startswith(lead) and not final:
            return False
        self._end_call()
        return True

    def _end_call(self) -> None:
        if not self.calls[self._index].arguments:
            self.calls[self._index].arguments = "{}"
            self._emit_calls([ToolCallDelta(self._index, None, None, "{}")])
        self._close(self._index, None)
        self._state = "text"

    def _finish_rest(self) -> None:
        if self._state == "name":
            self._emit_content(self.OPEN + self._buf)
        elif self._state in ("args", "close"):
            self._end_call()
        elif self._buf:
            self._emit_content(self._buf)
        self._buf = ""
        self._state = "text"


def pythonic_calls(text: str) -> list[tuple[str, dict]] | None:
    """A Python list of calls (or one call) with literal keyword arguments -> [(name, arguments)], as vLLM's pythonic
    parser reads them: the name a (dotted) identifier, each argument a Python literal (strings, numbers, lists,
    dicts, True / False / None, and JSON's true / false / null); None where the text is anything else (positional
    arguments, expressions, a syntax error)."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return None
    calls = []
    for item in node.elts if isinstance(node, ast.List) else [node]:
        if not isinstance(item, ast.Call) or item.args:
            return None
        name = _dotted_name(item.func)
        if name is None:
            return None
        arguments = {}
        for keyword in item.keywords:
            if keyword.arg is None:  # (**spread)
                return None
            try:
                arguments[keyword.arg] = _literal(keyword.value)
            except ValueError:
                return None
        calls.append((name, arguments))
    return calls


def _dotted_name(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted_name(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node) -> Any:
    """A call argument's value: a Python literal, JSON's bare true / false / null inside it too."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(x) for x in node.elts]
    if isinstance(node, ast.Tuple):
        return [_literal(x) for x in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("a ** inside a dict is not a literal")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    value = ast.literal_eval(node)  # (strings, numbers, True / False / None; raises ValueError otherwise)
    if isinstance(value, (set, frozenset, bytes, complex)):
        raise ValueError("not JSON")
    return value


class Lfm2ToolParser(ToolParser):
    """Liquid LFM2's ``<|tool_call_start|>[get_weather(city="Paris"), ...]<|tool_call_end|>``: each block a Python
    list of calls (pythonic_calls), its calls sent whole when the block closes; a block that is no such list stays
    content, markers included."""

    name = "lfm2"
    needs_special_tokens = True
    OPEN, CLOSE = "<|tool_call_start|>", "<|tool_call_end|>"

    def __init__(self, tools=None):
        super().__init__(tools)
        self._inside = False

    def _step(self, final: bool) -> bool:
        if not self._inside:
            if not self._text_until(self.OPEN, final):
                return False
            self._inside = True
            return True
        i = self._buf.find(self.CLOSE)
        if i < 0:
            return False
        body, self._buf = self._buf[:i], self._buf[i + len(self.CLOSE):]
        self._inside = False
        self._send(body, self.CLOSE)
        return True

    def _send(self, body: str, close: str) -> None:
        calls = pythonic_calls(body)
        if calls is None:
            self._emit_content(self.OPEN + body + close)
            return
        self._send_whole(calls)

    def _finish_rest(self) -> None:
        if self._inside:  # a block cut off (max_tokens): a whole list in it is still its calls
            self._inside = False
            self._send(self._buf, "")
        elif self._buf:
            self._emit_content(self._buf)
        self._buf = ""


class PythonicToolParser(_LeadingCallsParser):
    """Calls written as a Python list, the whole answer (vLLM's pythonic / llama4_pythonic: Llama 3.2's and Llama 4's
    pythonic templates, ToolACE): ``[get_weather(city="Paris"), ...]``, optionally between Llama 4's
    ``<|python_start|>`` and ``<|python_end|>``; the calls sent whole when the list closes (pythonic_calls). An answer
    that does not open with such a list is content; so is a list that turns out not to be calls."""

    name = "pythonic"
    needs_special_tokens = True
    START, END = "<|python_start|>", "<|python_end|>"
    TAGS = (START,)

    def _decide(self, lead: str) -> str | None:
        if self.START.startswith(lead):
            return None
        t = lead[len(self.START):].lstrip() if lead.startswith(self.START) else lead
        if not t:
            return None
        if t[0] != "[":
            return "text"
        name = t[1:].lstrip()
        i = 0
        while i < len(name) and (name[i].isalnum() or name[i] in "_."):
            i += 1
        if i == len(name):
            return None  # (the name, maybe more of it to come)
        return "calls" if i and name[i] == "(" else "text"

    def _calls_step(self, final: bool) -> bool:
        if self._state == "after":  # (the list closed: Llama 4's <|python_end|> dropped, the rest content)
            lead = self._buf.lstrip()
            if not final and self.END.startswith(lead):
                return False
            self._buf = lead[len(self.END):] if lead.startswith(self.END) else lead
            self._state = "text"
            return True
        # calls: the list ends at a ] after which it parses
        end = self._buf.find("]")
        while end >= 0:
            calls = pythonic_calls(self._buf[:end + 1])
            if calls is not None:
                self._send_whole(calls)
                self._buf = self._buf[end + 1:]
                self._state = "after"
                return True
            end = self._buf.find("]", end + 1)
        return False

    def _finish_rest(self) -> None:
        if self._state == "calls" and self._buf:  # never closed into calls: it was text after all
            self._emit_content(self._tag + self._buf)
        elif self._buf:
            self._emit_content(self._buf)
        self._buf = ""


_GEMMA4_QUOTE = '<|"|>'


def gemma4_value(text: str, i: int) -> tuple[Any, int]:
    """One value of Gemma 4's call syntax at ``text[i]`` -> (the JSON value, the index after it): a string between
    <|"|> marks, an object {key:value,...} (keys bare or quoted the same way), a list [value,...], true / false /
    null, a number, else the bare text up to the next , } or ] as a string. ValueError where it is cut off."""
    if text.startswith(_GEMMA4_QUOTE, i):
        end = text.find(_GEMMA4_QUOTE, i + len(_GEMMA4_QUOTE))
        if end < 0:
            raise ValueError("an unclosed string")
        return text[i + len(_GEMMA4_QUOTE):end], end + len(_GEMMA4_QUOTE)
    if i < len(text) and text[i] in "{[":
        obj, close = text[i] == "{", "}" if text[i] == "{" else "]"
        out: Any = {} if obj else []
        i += 1
        while True:
            i = _skip_ws(text, i)
            if i >= len(text):
                raise ValueError("an unclosed " + ("object" if obj else "list"))
            if text[i] == close:
                return out, i + 1
            if obj:
                if text.startswith(_GEMMA4_QUOTE, i):
                    key, i = gemma4_value(text, i)
                    i = _skip_ws(text, i)
                else:
                    colon = text.find(":", i)
                    if colon < 0:
                        raise ValueError("a key without a value")
                    key, i = text[i:colon].strip(), colon
                if not text.startswith(":", i):
                    raise ValueError("a key without a value")
                value, i = gemma4_value(text, _skip_ws(text, i + 1))
                out[key] = value
            else:
                value, i = gemma4_value(text, i)
                out.append(value)
            i = _skip_ws(text, i)
            if i < len(text) and text[i] == ",":
                i += 1
            elif i < len(text) and text[i] != close:
                raise ValueError(f"{text[i]!r} between values")
    end = i
    while end < len(text) and text[end] not in ",}]":
        end += 1
    if end >= len(text):
        raise ValueError("a value cut off")
    word = text[i:end].strip()
    literal = {"true": True, "false": False, "null": None, "none": None}
    if word.lower() in literal:
        return literal[word.lower()], end
    try:
        number = float(word)
    except ValueError:
        return word, end
    return (int(word) if word.lstrip("+-").isdigit() else number), end


class Gemma4ToolParser(ToolParser):
    """Gemma 4's ``<|tool_call>call:NAME{key:value,...}<tool_call|>``: its arguments in the template's own syntax
    (strings between <|"|> marks, bare keys: gemma4_value) as a JSON object; the name is sent once it is known, the
    arguments when the call closes; a <|tool_response> the model writes after its calls is dropped. A block that is no
    such call stays content, markers included."""

    name = "gemma4"
    needs_special_tokens = True
    OPEN, CLOSE, RESPONSE = "<|tool_call>", "<tool_call|>", "<|tool_response>"

    def __init__(self, tools=None):
        super().__init__(tools)
        self._inside = False
        self._index: int | None = None  # the call being read, once its name is announced

    def _step(self, final: bool) -> bool:
        if not self._inside:
            if self._after_call:  # (the end of the model's turn after its calls)
                lead = self._buf.lstrip()
                if lead.startswith(self.RESPONSE):
                    self._buf = lead[len(self.RESPONSE):]
                    return True
                if lead and self.RESPONSE.startswith(lead) and not final:
                    return False
            if not self._text_until(self.OPEN, final):
                return False
            self._inside, self._index = True, None
            return True
        if self._index is None:
            brace = self._buf.find("{")
            if brace < 0 or not self._buf.startswith("call:"):
                if (not self._buf.startswith("call:") and not "call:".startswith(self._buf)) or final:
                    return self._not_a_call(final)
                return False
            name = self._buf[len("call:"):brace].strip()
            if not name:
                return self._not_a_call(final)
            self._index = self._announce(name).index
            self._emit_calls([ToolCallDelta(self._index, self.calls[self._index].id, name, "")])
            self._buf = self._buf[brace:]
        try:
            arguments, end = gemma4_value(self._buf, 0)
        except ValueError:
            if final:
                self._close_call("{}")
            return False
        rest = self._buf[end:].lstrip()
        if not rest.startswith(self.CLOSE) and (final or not self.CLOSE.startswith(rest)):
            self._close_call(json.dumps(arguments, ensure_ascii=False))
            self._buf = rest
            return True
        if not rest.startswith(self.CLOSE):
            return False
        self._close_call(json.dumps(arguments, ensure_ascii=False))
        self._buf = rest[len(self.CLOSE):]
        return True

    def _close_call(self, arguments: str) -> None:
        self.calls[self._index].arguments = arguments
        self._emit_calls([ToolCallDelta(self._index, None, None, arguments)])
        self._close(self._index, None)
        self._inside, self._index = False, None

    def _not_a_call(self, final: bool) -> bool:
        self._emit_content(self.OPEN + self._buf)
        self._buf, self._inside = "", False
        return True

    def _finish_rest(self) -> None:
        if self._inside and self._index is not None:  # cut off (max_tokens): what arrived of its arguments is lost
            self._close_call("{}")
        elif self._inside:
            self._emit_content(self.OPEN + self._buf)
        elif self._buf:
            self._emit_content(self._buf)
        self._buf, self._inside = "", False


class HarmonyToolParser(ToolParser):
    """gpt-oss' harmony format: the output is messages, each ``[<|start|>assistant]<|channel|>C[ to=R][
    <|constrain|>json]<|message|>BODY`` ended by ``<|end|>`` (or the stop tokens ``<|return|>`` / ``<|call|>``, or
    the next ``<|start|>``). The analysis channel's bodies are reasoning; a message to ``functions.NAME`` (when the
    request has tools) is a call of NAME with BODY as its arguments; the others' bodies (final, commentary
    preambles) are content. Output that does not open with a header is content as it came."""

    name = "harmony"
    needs_special_tokens = True
    _MESSAGE = "<|message|>"
    _ENDS = ("<|end|>", "<|return|>", "<|call|>", "<|start|>")
    _START, _HEADER, _BODY, _PLAIN = range(4)

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self._state = self._START
        self._kind = "content"  # the open message's body: content, reasoning or call
        self._call = -1

    def _step(self, final: bool) -> bool:
        if self._state == self._START:
            lead = self._buf.lstrip()
            if not lead or (not final and "<|".startswith(lead)):
                return False
            self._state = self._HEADER if lead.startswith("<|") else self._PLAIN
            return True
        if self._state == self._PLAIN:
            self._out.content += self._buf
            self._buf = ""
            return False
        if self._state == self._HEADER:
            i = self._buf.find(self._MESSAGE)
            if i < 0:
                if final:
                    self._buf = ""  # a header the output ended inside: nothing of a message
                return False
            self._open(self._buf[:i])
            self._buf = self._buf[i + len(self._MESSAGE):]
            self._state = self._BODY
            return True
        found = [(i, m) for m in self._ENDS if (i := self._buf.find(m)) >= 0]
        if found:
            i, marker = min(found)
            self._body(self._buf[:i])
            self._buf = self._buf[i + (0 if marker == "<|start|>" else len(marker)):]  # (a start opens the next)
            self._close_message()
            self._state = self._HEADER
            return True
        keep = 0 if final else max(held_suffix(self._buf, m) for m in self._ENDS)
        self._body(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _open(self, header: str) -> None:
        """A message's header (role, channel, recipient, constraint) decides where its body goes."""
        channel = re.search(r"<\|channel\|>\s*(\w+)", header)
        recipient = re.search(r"\bto=([^\s<]+)", header)
        if recipient and recipient.group(1).startswith("functions.") and self.tools:
            self._kind = "call"
            self._emit_calls([self._announce(recipient.group(1)[len("functions."):])])
            self._call = len(self.calls) - 1
        else:
            self._kind = "reasoning" if channel and channel.group(1) == "analysis" else "content"

    def _body(self, text: str) -> None:
        if not text:
            return
        if self._kind == "reasoning":
            self._out.reasoning += text
        elif self._kind == "content":
            self._out.content += text
        else:
            self.calls[self._call].arguments += text
            self._out.calls.append(ToolCallDelta(self._call, None, None, text))

    def _close_message(self) -> None:
        if self._kind == "call":
            self._close(self._call, None)
        self._kind = "content"

    def _finish_rest(self) -> None:
        if self._state == self._BODY:
            self._close_message()


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Qwen3CoderToolParser, Llama3JsonToolParser, MistralToolParser,
                        DeepSeekToolParser, FunctionaryToolParser, HarmonyToolParser, SeedOssToolParser,
                        Glm45ToolParser, CohereToolParser, MiniMaxToolParser, Lfm2ToolParser, NemotronToolParser,
                        Gemma4ToolParser, ApertusToolParser, FireFunctionToolParser, PythonicToolParser)
}
# vLLM's names for Llama 4's: its JSON calls (Llama 3's, between <|python_start|> and <|python_end|>), its pythonic ones
PARSERS.update(llama4_json=Llama3JsonToolParser, llama4_pythonic=PythonicToolParser)
# vLLM's --tool-call-parser names for the families above: gpt-oss' (openai), DeepSeek V3's
PARSERS.update(openai=HarmonyToolParser, deepseek_v3=DeepSeekToolParser)


def tool_parser_for_template(source: str | None, override: str = "auto") -> type[ToolParser] | None:
    """The parser a chat template implies (``override``: "auto", "none" or a family name)."""
    if override == "none":
        return None
    if override != "auto":
        return PARSERS[override]
    if not source:
        return None
    if is_harmony_template(source):
        return HarmonyToolParser
    if "<seed:tool_call>" in source:
        return SeedOssToolParser
    if "<minimax:tool_call>" in source:
        return MiniMaxToolParser
    if "<arg_key>" in source:
        return Glm45ToolParser
    if "<|START_ACTION|>" in source:
        return CohereToolParser
    if "<|tool_call_start|>" in source:
        return Lfm2ToolParser
    if "<TOOLCALL>" in source:
        return NemotronToolParser
    if "<|tool_call>" in source and "<tool_call|>" in source:
        return Gemma4ToolParser
    if "<|tools_prefix|>" in source:
        return ApertusToolParser
    if "functools[" in source:
        return FireFunctionToolParser
    if "<tool_call>" in source:
        return Qwen3CoderToolParser if "<function=" in source else HermesToolParser
    if "[TOOL_CALLS]" in source:
        return MistralToolParser
    if "tool▁calls▁begin" in source:
        return DeepSeekToolParser
    if "<function=" in source:
        return FunctionaryToolParser
    if "func_name1(" in source:  # (the pythonic templates' instruction: [func_name1(params_name1=...), ...])
        return PythonicToolParser
    if "<|python_tag|>" in source or (("<|start_header_id|>" in source or "<|header_start|>" in source)
                                      and '"parameters"' in source):  # (Llama 4's headers too)
        return Llama3JsonToolParser
    return None


class OutputParser:
    """One choice's text -> reasoning, content and tool calls (reasoning first, tools in the answer; harmony's
    channels carry all three, so its parser reads the whole text)."""

    def __init__(self, tool_parser: ToolParser | None, reasoning: ReasoningFormat | None = None, *,
                 starts_inside: bool = False):
        if reasoning is HARMONY:
            tool_parser = tool_parser if isinstance(tool_parser, HarmonyToolParser) else HarmonyToolParser()
            reasoning = None
        self.tools = tool_parser
        self.reasoning = ReasoningParser(reasoning, starts_inside=starts_inside) if reasoning else None

    @property
    def calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools is not None else []

    @property
    def num_closed_calls(self) -> int:
        return self.tools.num_closed if self.tools is not None else 0

    def _content(self, reasoning: str, content: str, final: bool) -> ParsedDelta:
        if self.tools is None:
            return ParsedDelta(content, [], reasoning)
        d = self.tools.push(content) if content else ParsedDelta()
        if final:
            e = self.tools.finish()
            d = ParsedDelta(d.content + e.content, d.calls + e.calls, d.reasoning + e.reasoning)
        d.reasoning = reasoning + d.reasoning
        return d

    def push(self, text: str) -> ParsedDelta:
        if self.reasoning is not None:
            r, c = self.reasoning.push(text)
        else:
            r, c = "", text
        return self._content(r, c, final=False)

    def finish(self) -> ParsedDelta:
        r, c = self.reasoning.finish() if self.reasoning is not None else ("", "")
        return self._content(r, c, final=True)

    def parse(self, text: str) -> ParsedDelta:
        a = self.push(text)
        b = self.finish()
        return ParsedDelta(a.content + b.content, a.calls + b.calls, a.reasoning + b.reasoning)


def merge_call_deltas(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """Tool calls assembled from their deltas (what a streaming client does)."""
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        if d.index not in calls:
            calls[d.index] = ToolCall(d.id or "", d.name or "", "")
        calls[d.index].arguments += d.arguments
    return [calls[i] for i in sorted(calls)]
