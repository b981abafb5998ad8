"""Anthropic Messages API: /v1/messages and /v1/messages/count_tokens.

An adapter over the one generation path: the request's system prompt,
content blocks and tools are translated into the chat-template shape the
OpenAI routes use (tool_use -> assistant tool_calls, tool_result -> a tool
message), and the choice's parsed output (reasoning, text, tool calls) is
formatted as Messages content blocks.

Rules:
- Streams follow Anthropic's event order: message_start, ping, then per
  content block content_block_start, its deltas, content_block_stop (blocks
  in output order: thinking, text, tool_use), then message_delta (stop_reason,
  stop_sequence, usage), message_stop. A failure after the stream started is
  an ``error`` event.
- Errors are ``{"type": "error", "error": {"type", "message"}}`` with
  Anthropic's status codes (overloaded: 529). The transport's own 401/429
  (before a handler runs) keep the OpenAI shape.
- ``tool_choice`` any/tool (a forced call) is enforced by a grammar
  (flared.server.structured.force_tool_call), and so is
  ``output_config.format`` (JSON under a schema, returned as text; it cannot
  be combined with a forced call); ``thinking`` enabled/disabled sets the
  template's ``enable_thinking``, and enabled with ``budget_tokens`` ends the
  reasoning after that many tokens (its end marker forced, where the template's
  reasoning format spells it as one token).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from flared.errors import ErrorKind
from flared.frontend.toolcalls import ParsedDelta, ToolCall
from flared.runtime.request import GenerateRequest
from flared.server.generation import Generation
from flared.server.http import Request, Response, ResponseWriter, Router, StreamingResponse
from flared.server.http.messages import ClientDisconnected, error_response
from flared.server.openai_routes import OutputShape, _stop_ids, check_model, sampling_params
from flared.server.structured import (ForcedToolChoice, compile_grammar, force_tool_call,
                                      parse_anthropic_output_format)
from flared.server.openai_schema import (
    MAX_STOP_STRINGS,
    SamplingOptions,
    _bad,
    _boolean,
    _integer,
    _number,
    _string,
    _type,
    join_text_parts,
    parse_tools,
)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                529: "overloaded_error"}


def anthropic_error(exc: BaseException) -> Response:
    """Any exception on the request path as an Anthropic error body and status."""
    resp = error_response(exc)
    status = 529 if resp.status == 503 else resp.status
    try:
        message = json.loads(resp.body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = "internal server error"
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return Response.json({"type": "error", "error": {"type": kind, "message": message}}, status=status)


def _anthropic_errors(handler):
    async def wrapped(request: Request):
        try:
            return await handler(request)
        except Exception as exc:  # every failure before the response starts has Anthropic's shape
            return anthropic_error(exc)
    return wrapped


# -- request translation ---------------------------------------------------------------------------

def translate_messages(body: dict) -> list[dict]:
    """Anthropic system + messages -> chat-template messages (OpenAI shape)."""
    out: list[dict] = []
    system = body.get("system")
    if system is not None:
        text = join_text_parts(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty array of messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, f"must be an object, got {_type(m)}")
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise _bad(f"{where}.role", f"must be 'user' or 'assistant', got {role!r}")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise _bad(f"{where}.content", f"must be a string or an array of content blocks, got {_type(content)}")
        text: list[dict] = []  # text parts, and image parts of a user turn (one list: their order matters)
        calls: list[dict] = []
        for j, b in enumerate(content):
            bw = f"{where}.content[{j}]"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                if not isinstance(b.get("text"), str):
                    raise _bad(f"{bw}.text", "must be a string")
                text.append({"type": "text", "text": b["text"]})
            elif kind == "image" and role == "user":
                text.append({"type": "image", "image": _image_source(b, bw), "param": bw})
            elif kind == "document" and role == "user":
                text.append({"type": "text", "text": _document_text(b, bw)})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # earlier reasoning is not replayed into the prompt, as the templates do
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise _bad(bw, "tool_use needs a 'name' string and an 'input' object")
                calls.append({"id": b.get("id") or "", "type": "function",
                              "function": {"name": b["name"], "arguments": b.get("input", {})}})
            elif kind == "tool_result" and role == "user":
                if text:
                    out.append({"role": "user", "content": _joined(text)})
                    text = []
                result = b.get("content", "")
                out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                            "content": join_text_parts(result, f"{bw}.content")})
            else:
                raise _bad(bw, f"content block of type {kind!r} is not supported in a {role} message "
                           "(this model takes text)", ErrorKind.UNSUPPORTED)
        if calls:
            out.append({"role": "assistant", "content": _joined(text) or None, "tool_calls": calls})
        elif text or role == "assistant":
            out.append({"role": role, "content": _joined(text)})
    return out


def _joined(parts: list[dict]) -> str | list[dict]:
    """A turn's text, or its parts in order where it holds images."""
    if any(p["type"] == "image" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _document_text(block: dict, where: str) -> str:
    """A plain-text document block (source ``text``, or ``content``: a string or text blocks) as the prompt's text:
    its title, its context and its text, a blank line between. PDF sources (``base64``, ``url``, ``file``) are
    refused: nothing here reads PDFs."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise _bad(f"{where}.source", "must be an object")
    citations = block.get("citations")
    if isinstance(citations, dict) and citations.get("enabled"):
        raise _bad(f"{where}.citations", "citations are not supported", ErrorKind.UNSUPPORTED)
    kind = source.get("type")
    if kind == "text":
        if not isinstance(source.get("data"), str):
            raise _bad(f"{where}.source.data", "must be a string")
        body = source["data"]
    elif kind == "content":
        body = join_text_parts(source.get("content"), f"{where}.source.content")
    else:
        raise _bad(f"{where}.source", f"a document source of type {kind!r} is not supported (PDFs are not read "
                   "here): send the document's text as a 'text' or 'content' source", ErrorKind.UNSUPPORTED)
    parts = []
    for key in ("title", "context"):
        value = block.get(key)
        if value is not None and not isinstance(value, str):
            raise _bad(f"{where}.{key}", "must be a string")
        if value:
            parts.append(value)
    return "\n\n".join(parts + [body])


def _image_source(block: dict, where: str) -> str:
    """An image block's source as a data URL (``base64``) or its ``url`` (refused where images are read)."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise _bad(f"{where}.source", "must be an object")
    if source.get("type") == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not isinstance(data, str) or not data:
            raise _bad(f"{where}.source", "a base64 source needs 'media_type' and 'data' strings")
        return f"data:{media};base64,{data}"
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise _bad(f"{where}.source.type", "must be 'base64' (or 'url')")


def translate_tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools", f"must be an array, got {_type(tools)}")
    converted = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise _bad(f"tools[{i}]", "must be an object with a 'name'")
        if t.get("type") not in (None, "custom"):
            raise _bad(f"tools[{i}]", f"server tool {t.get('type')!r} is not supported", ErrorKind.UNSUPPORTED)
        converted.append({"type": "function", "function": {
            "name": t["name"], "description": t.get("description", ""),
            "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}})
    return parse_tools(converted, "tools")


def _tool_choice(body: dict) -> str:
    choice = body.get("tool_choice")
    if choice is None:
        return "auto"
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise _bad("tool_choice", "must be an object with type auto, any, tool or none")
    if choice["type"] == "tool" and not isinstance(choice.get("name"), str):
        raise _bad("tool_choice", "type 'tool' needs the tool's 'name'")
    return choice["type"]


def _forced_tool(body: dict) -> ForcedToolChoice | None:
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "any":
        return ForcedToolChoice(None, parallel=not choice.get("disable_parallel_tool_use", False))
    if isinstance(choice, dict) and choice.get("type") == "tool":
        return ForcedToolChoice(choice["name"])
    return None


def _template_kwargs(body: dict) -> dict[str, Any]:
    thinking = body.get("thinking")
    if thinking is None:
        return {}
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
        raise _bad("thinking", "must be an object with type 'enabled' or 'disabled'")
    return {"enable_thinking": thinking["type"] != "disabled"}


def _options(body: dict) -> SamplingOptions:
    max_tokens = _integer(body, "max_tokens", 1, 1 << 31)
    if max_tokens is None:
        raise _bad("max_tokens", "is required")
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop_sequences", "must be an array of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise _bad("stop_sequences", f"at most {MAX_STOP_STRINGS} stop sequences")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise _bad("metadata", "must be an object")
    top_k = _integer(body, "top_k", 0, 1 << 31)
    return SamplingOptions(
        max_tokens=max_tokens, temperature=_number(body, "temperature", 0.0, 1.0),
        top_p=_number(body, "top_p", 0.0, 1.0, lo_open=True), top_k=top_k, min_p=None,
        presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=None, seed=None, logit_bias=None,
        logprobs=None, stop=tuple(s for s in stops if s), stop_token_ids=(), ignore_eos=False, n=1,
        thinking_budget=_budget(body, max_tokens))


def _budget(body: dict, max_tokens: int) -> int | None:
    """thinking.budget_tokens (type enabled): at most that many tokens of reasoning, and fewer than max_tokens."""
    thinking = body.get("thinking")
    if not isinstance(thinking, dict) or thinking.get("type") != "enabled" or "budget_tokens" not in thinking:
        return None
    budget = _integer(thinking, "budget_tokens", 1, 1 << 31)
    if budget is not None and budget >= max_tokens:
        raise _bad("thinking.budget_tokens", f"must be less than max_tokens ({max_tokens}), got {budget}")
    return budget


# -- response shapes -------------------------------------------------------------------------------

def tool_use_id(call: ToolCall | str) -> str:
    cid = call.id if isinstance(call, ToolCall) else call
    return "toolu_" + cid.removeprefix("call_")


def _stop_reason(finish: str, calls: list, matched: str | None) -> tuple[str, str | None]:
    if finish == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if matched is not None:
        return "stop_sequence", matched
    return "end_turn", None


def _usage(gen: Generation) -> dict[str, int]:
    u = gen.usage()
    return {"input_tokens": u.num_prompt_tokens - u.num_cached_tokens, "output_tokens": u.num_generated_tokens,
            "cache_read_input_tokens": u.num_cached_tokens, "cache_creation_input_tokens": 0}


class AnthropicRoutes:
    def __init__(self, state):
        self.state = state

    def register(self, router: Router) -> None:
        router.add("POST", "/v1/messages", _anthropic_errors(self.messages), admit=True)
        router.add("POST", "/v1/messages/count_tokens", _anthropic_errors(self.count_tokens))

    async def _render(self, body: dict):
        """(rendered prompt, tools, the per-request LoRA adapter the model name picks)."""
        if not isinstance(body, dict):
            raise _bad("body", f"must be a JSON object, got {_type(body)}")
        lora = check_model(self.state, _string(body, "model", required=True), lora_ok=True)
        choice = _tool_choice(body)
        tools = translate_tools(body)
        if choice == "none":
            tools = None
        messages = translate_messages(body)
        # A final assistant turn is a prefill: the reply continues it rather than starting a new turn.
        prefill = messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")
        rendered = await self.state.prepare_chat(messages, tools=tools, add_generation_prompt=not prefill,
                                                 continue_final_message=prefill, **_template_kwargs(body))
        return rendered, tools, lora

    async def count_tokens(self, request: Request) -> Response:
        rendered, _, _ = await self._render(request.json())
        return Response.json({"input_tokens": len(rendered.token_ids)})

    async def messages(self, request: Request):
        body = request.json()
        rendered, tools, lora = await self._render(body)
        options = _options(body)
        stream = _boolean(body, "stream")
        forced = _forced_tool(body)
        output_format = parse_anthropic_output_format(body)
        if forced is not None and output_format is not None:
            raise _bad("output_config.format", "cannot be combined with a forced tool_choice (any or tool)")
        # A forced call needs no tool format in the template: the grammar produces it. Under an output format
        # the reply is the JSON itself, never parsed for calls.
        shape = OutputShape(self.state, rendered.text, None if forced or output_format else tools)
        grammar = await compile_grammar(self.state, force_tool_call(shape, tools, forced) if forced else output_format)
        prompt = tuple(rendered.token_ids)
        vision = await self.state.vision_input(rendered)
        req = GenerateRequest(prompt_token_ids=prompt, message_endpoints=rendered.message_endpoints,
                              params=sampling_params(self.state, options, len(prompt), None, 0),
                              stop_token_ids=_stop_ids(self.state, options), grammar=grammar, lora=lora,
                              vision=vision)
        gen = self.state.start([req], options.stop, skip_special_tokens=shape.skip_special_tokens)
        request.disconnected.add_callback(gen.cancel)
        mid = "msg_" + secrets.token_hex(12)
        model = body["model"]
        if stream:
            return StreamingResponse(lambda w: self._stream(gen, w, shape, mid, model, len(prompt)),
                                     headers=[("cache-control", "no-cache")])
        ((text, _ids, _lps, finish),) = await gen.collect()
        parsed, calls = shape.parse(text)
        content: list[dict[str, Any]] = []
        if parsed.reasoning:
            content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
        if parsed.content or not calls:
            content.append({"type": "text", "text": parsed.content})
        for c in calls:
            content.append({"type": "tool_use", "id": tool_use_id(c), "name": c.name, "input": _input(c)})
        reason, seq = _stop_reason(finish, calls, gen.matched_stop(0))
        return Response.json({"id": mid, "type": "message", "role": "assistant", "model": model,
                              "content": content, "stop_reason": reason, "stop_sequence": seq,
                              "usage": _usage(gen)})

    async def _stream(self, gen: Generation, w: ResponseWriter, shape: OutputShape, mid: str, model: str,
                      num_prompt_tokens: int) -> None:
        async def event(obj: dict) -> None:
            await w.send_json_event(obj, event=obj["type"])

        blocks = _BlockStream(event)
        parser = shape.parser() if shape.active else None
        finish = "stop"
        try:
            await event({"type": "message_start", "message": {
                "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": num_prompt_tokens, "output_tokens": 0}}})
            await event({"type": "ping"})
            async for d in gen.deltas():
                parsed = ParsedDelta(d.text) if parser is None else (parser.push(d.text) if d.text else ParsedDelta())
                if d.finish_reason is not None:
                    finish = d.finish_reason
                    if parser is not None:
                        tail = parser.finish()
                        parsed = ParsedDelta(parsed.content + tail.content, parsed.calls + tail.calls,
                                             parsed.reasoning + tail.reasoning)
                await blocks.feed(parsed)
            await blocks.close()
            calls = parser.calls if parser is not None else []
            reason, seq = _stop_reason(finish, calls, gen.matched_stop(0))
            await event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                         "usage": _usage(gen)})
            await event({"type": "message_stop"})
        except ClientDisconnected:
            gen.cancel()
        except Exception as exc:  # the stream has started: report in-band
            gen.cancel()
            err = json.loads(anthropic_error(exc).body)
            try:
                await event(err)
            except ClientDisconnected:
                pass


def _input(call: ToolCall) -> dict:
    try:
        value = json.loads(call.arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class _BlockStream:
    """Parsed deltas -> content_block_start/delta/stop events, one open block at a time."""

    def __init__(self, event):
        self._event = event
        self._index = -1
        self._open: str | None = None  # "thinking" | "text" | "tool_use"
        self._call_index: int | None = None

    async def _start(self, kind: str, block: dict, call_index: int | None = None) -> None:
        await self.close()
        self._index += 1
        self._open, self._call_index = kind, call_index
        await self._event({"type": "content_block_start", "index": self._index, "content_block": block})

    async def close(self) -> None:
        if self._open is None:
            return
        if self._open == "thinking":
            await self._event({"type": "content_block_delta", "index": self._index,
                               "delta": {"type": "signature_delta", "signature": ""}})
        await self._event({"type": "content_block_stop", "index": self._index})
        self._open = None

    async def feed(self, parsed: ParsedDelta) -> None:
        if parsed.reasoning:
            if self._open != "thinking":
                await self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            await self._event({"type": "content_block_delta", "index": self._index,
                               "delta": {"type": "thinking_delta", "thinking": parsed.reasoning}})
        if parsed.content:
            if self._open != "text":
                await self._start("text", {"type": "text", "text": ""})
            await self._event({"type": "content_block_delta", "index": self._index,
                               "delta": {"type": "text_delta", "text": parsed.content}})
        for c in parsed.calls:
            if c.id is not None:
                await self._start("tool_use", {"type": "tool_use", "id": tool_use_id(c.id), "name": c.name,
                                               "input": {}}, c.index)
            if c.arguments and self._open == "tool_use" and self._call_index == c.index:
                await self._event({"type": "content_block_delta", "index": self._index,
                                   "delta": {"type": "input_json_delta", "partial_json": c.arguments}})
