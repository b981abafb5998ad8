"""OpenAI Responses API: POST /v1/responses, GET/DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel,
GET /v1/responses/{id}/input_items.

An adapter over the one generation path: input items (messages,
function_call, function_call_output) become chat-template messages; the
parsed output becomes output items in order (reasoning, message,
function_call).

Rules:
- ``store`` (default true) keeps the response and the conversation that led
  to it in a bounded in-memory LRU (``MAX_STORED_RESPONSES``); the oldest is
  dropped first. ``previous_response_id`` prepends that stored conversation
  (its input and output, not its ``instructions``) to the new input; an id
  that is not stored (never, evicted, or stored with ``store: false``) is 404.
- Stream events carry a ``sequence_number`` that rises by one, in this order:
  response.created, response.in_progress, then per output item
  output_item.added, its part/deltas/done events, output_item.done, and
  last response.completed (response.incomplete when max_output_tokens cut it).
- ``tool_choice`` "required" or a named function, and ``text.format``
  json_object / json_schema, are enforced by a grammar (flared.server.structured).
- ``reasoning.effort: "none"`` turns thinking off in the template.
- ``background: true`` (with ``store``) generates in the background, holding an admission permit until it
  ends: answered at once with status ``queued``, or with ``stream`` as a stream that the generation outlives.
  GET polls it (``in_progress``, then ``completed``, ``incomplete`` or ``failed``); GET with ``stream=true``
  replays its events after ``starting_after`` and follows them live; ``POST /v1/responses/{id}/cancel`` ends
  it (``cancelled``, with what it had generated). Only background responses can be cancelled or re-streamed.
- ``GET /v1/responses/{id}/input_items`` lists the request's own input items (a string input as one user
  message), each with an id, newest first by default (``order``, ``limit`` 1-100, ``after``).
- ``include: ["message.output_text.logprobs"]`` fills output_text's ``logprobs`` (with ``top_logprobs``
  alternatives, 0-20) for every generated token, as chat completions' logprobs cover them; a stream's
  output_text deltas carry the logprobs of the tokens since the previous one, output_text.done all of them.
  The other ``include`` values OpenAI defines name outputs this server never makes and are accepted.
"""

from __future__ import annotations

import asyncio
import collections
import json
import secrets
import time
from typing import Any

from flared.errors import AdmissionError, ErrorKind
from flared.frontend.toolcalls import ParsedDelta
from flared.runtime.request import GenerateRequest
from flared.server.generation import Generation
from flared.server.http import Request, Response, ResponseWriter, Router, StreamingResponse
from flared.server.http.messages import ClientDisconnected, error_response
from flared.server.http.sse import encode_json_event
from flared.server.openai_routes import OutputShape, _stop_ids, check_model, sampling_params, token_logprobs
from flared.server.structured import (
    GrammarSpec, compile_grammar, force_tool_call, parse_openai_forced_tool_choice, parse_responses_text_format,
)
from flared.server.openai_schema import (
    MAX_TOP_LOGPROBS,
    SamplingOptions,
    _bad,
    _boolean,
    _integer,
    _number,
    _string,
    _type,
    content_with_images,
    join_text_parts,
    json_object,
    parse_tool_choice,
    parse_tools,
    reasoning_effort_kwargs,
)

MAX_STORED_RESPONSES = 1024  # a bounded memory cost: each holds its conversation's text


class ResponseStore:
    """Stored responses by id, least recently used dropped first."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES):
        self.capacity = capacity
        # id -> (response, conversation so far, the request's own input items)
        self._items: collections.OrderedDict[str, tuple[dict, list[dict], list[dict]]] = collections.OrderedDict()

    def put(self, response: dict, conversation: list[dict], input_items: list[dict] | None = None) -> None:
        if input_items is None:
            old = self._items.get(response["id"])
            input_items = old[2] if old is not None else []
        self._items[response["id"]] = (response, conversation, input_items)
        self._items.move_to_end(response["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, rid: str) -> tuple[dict, list[dict], list[dict]] | None:
        item = self._items.get(rid)
        if item is not None:
            self._items.move_to_end(rid)
        return item

    def delete(self, rid: str) -> bool:
        return self._items.pop(rid, None) is not None

    def __contains__(self, rid: str) -> bool:  # unlike get, leaves the order of use alone
        return rid in self._items

    def __len__(self) -> int:
        return len(self._items)


class _EventLog:
    """A background response's stream events as they are made (``send_json_event``, the writer calls _stream
    makes), encoded once; any number of readers follow it from a sequence number (``follow``)."""

    def __init__(self):
        self.events: list[bytes] = []  # index = sequence_number
        self.done = False
        self._changed = asyncio.Event()

    async def send_json_event(self, obj: object, event: str | None = None) -> None:
        self.events.append(encode_json_event(obj, event=event))
        self._wake()

    def finish(self) -> None:
        self.done = True
        self._wake()

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def follow(self, w: ResponseWriter, after: int) -> None:
        """Write the events after sequence number ``after``, then each as it comes, until the last."""
        i = max(after + 1, 0)
        while True:
            changed = self._changed
            while i < len(self.events):
                await w.write(self.events[i])
                i += 1
            if self.done:
                return
            await changed.wait()


def _not_found(rid: str, field: str | None = None) -> AdmissionError:
    err = AdmissionError(f"response {rid!r} is not stored on this server", ErrorKind.NOT_FOUND)
    err.param = field
    return err


# Responses items carry text as input_text / output_text parts (plain text too).
_TEXT_PARTS = ("input_text", "output_text", "text")


def translate_input(value: Any) -> list[dict]:
    """Responses input (a string or items) -> chat-template messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _bad("input", "must be a string or a non-empty array of input items")
    out: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(where, f"must be an object, got {_type(item)}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role", f"must be user, system, developer or assistant, got {role!r}")
            out.append({"role": "system" if role == "developer" else role,
                        "content": content_with_images(item.get("content"), f"{where}.content", _TEXT_PARTS,
                                                       ("input_image",), ("input_audio",))})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str):
                raise _bad(where, "a function_call needs 'name' and 'arguments' strings")
            call = {"id": item.get("call_id", ""), "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)  # parallel calls of one turn stay one message
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": join_text_parts(output, f"{where}.output", _TEXT_PARTS)})
        elif kind == "reasoning":
            continue  # earlier reasoning is not replayed into the prompt, as the templates do
        else:
            raise _bad(f"{where}.type", f"input item of type {kind!r} is not supported", ErrorKind.UNSUPPORTED)
    return out


def input_items(value: Any) -> list[dict]:
    """The request's input as the items GET /v1/responses/{id}/input_items lists: a string as one user message of
    input_text, each item with an id (its own where it had one)."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    items = []
    for item in value:
        item = dict(item)
        kind = item.setdefault("type", "message")
        if kind == "message":
            if isinstance(item.get("content"), str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": item["content"]}]
            item.setdefault("status", "completed")
        item.setdefault("id", _item_id({"message": "msg", "function_call": "fc", "function_call_output": "fco",
                                        "reasoning": "rs"}.get(kind, "item")))
        items.append(item)
    return items


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools", f"must be an array, got {_type(tools)}")
    converted = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else _type(t)
            raise _bad(f"tools[{i}]", f"tool of type {kind!r} is not supported (only function tools)",
                       ErrorKind.UNSUPPORTED)
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        converted.append({"type": "function", "function": fn})
    return parse_tools(converted, "tools")


LOGPROBS_INCLUDE = "message.output_text.logprobs"
# What else OpenAI's `include` may name: outputs of hosted tools, images and encrypted reasoning, none of which
# this server produces, so asking for them changes nothing.
_OTHER_INCLUDES = frozenset({
    "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
    "web_search_call.action.sources", "message.input_image.image_url", "computer_call_output.output.image_url",
    "code_interpreter_call.outputs"})


def _logprobs(body: dict) -> int | None:
    """Alternatives per token when ``include`` asks for output logprobs (``top_logprobs``, default 0); else None."""
    include = body.get("include")
    if include is None:
        include = []
    if not isinstance(include, list) or not all(isinstance(v, str) for v in include):
        raise _bad("include", f"must be an array of strings, got {_type(include)}")
    for v in include:
        if v != LOGPROBS_INCLUDE and v not in _OTHER_INCLUDES:
            raise _bad("include", f"unknown value {v!r}")
    top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    return (top or 0) if LOGPROBS_INCLUDE in include else None


def _options(body: dict) -> SamplingOptions:
    return SamplingOptions(
        max_tokens=_integer(body, "max_output_tokens", 1, 1 << 31), temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0, lo_open=True), top_k=None, min_p=None, presence_penalty=0.0,
        frequency_penalty=0.0, repetition_penalty=None, seed=None, logit_bias=None, logprobs=_logprobs(body), stop=(),
        stop_token_ids=(), ignore_eos=False, n=1)


def _template_kwargs(body: dict) -> dict[str, Any]:
    reasoning = body.get("reasoning")
    if reasoning is None:
        return {}
    if not isinstance(reasoning, dict):
        raise _bad("reasoning", f"must be an object, got {_type(reasoning)}")
    return reasoning_effort_kwargs(reasoning.get("effort"), "reasoning.effort")


def _text_format(body: dict) -> GrammarSpec | None:
    return parse_responses_text_format(body.get("text"))


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class _Output:
    """A response's output items as they form: reasoning, message, function calls."""

    def __init__(self):
        self.items: list[dict] = []
        self.reasoning: dict | None = None
        self.message: dict | None = None
        self.calls: dict[int, dict] = {}  # parser call index -> function_call item

    def reasoning_item(self) -> dict:
        self.reasoning = {"type": "reasoning", "id": _item_id("rs"), "summary": [],
                          "content": [{"type": "reasoning_text", "text": ""}]}
        self.items.append(self.reasoning)
        return self.reasoning

    def message_item(self) -> dict:
        self.message = {"type": "message", "id": _item_id("msg"), "status": "in_progress", "role": "assistant",
                        "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        self.items.append(self.message)
        return self.message

    def call_item(self, index: int, call_id: str, name: str) -> dict:
        item = {"type": "function_call", "id": _item_id("fc"), "call_id": call_id, "name": name, "arguments": "",
                "status": "in_progress"}
        self.calls[index] = item
        self.items.append(item)
        return item


def _usage(gen: Generation) -> dict[str, Any]:
    u = gen.usage()
    return {"input_tokens": u.num_prompt_tokens, "input_tokens_details": {"cached_tokens": u.num_cached_tokens},
            "output_tokens": u.num_generated_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.num_prompt_tokens + u.num_generated_tokens}


def _conversation_out(items: list[dict]) -> list[dict]:
    """A response's output items as the assistant turn they form (for previous_response_id)."""
    content = None
    calls = []
    for item in items:
        if item["type"] == "message":
            content = item["content"][0]["text"]
        elif item["type"] == "function_call":
            try:
                arguments = json.loads(item["arguments"] or "{}")
            except ValueError:
                arguments = {}  # a call cut short by max_output_tokens: its name is all that is known
            calls.append({"id": item["call_id"], "type": "function",
                          "function": {"name": item["name"], "arguments": arguments}})
    if content is None and not calls:
        return []
    return [{"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}]


class ResponsesRoutes:
    def __init__(self, state, store: ResponseStore | None = None):
        self.state = state
        self.store = store or ResponseStore()
        self.running: dict[str, tuple[Generation, asyncio.Task]] = {}  # background responses still generating
        self.logs: dict[str, _EventLog] = {}  # background responses' stream events, while they are stored

    def register(self, router: Router) -> None:
        router.add("POST", "/v1/responses", self.create, admit=True)
        router.add("GET", "/v1/responses/{response_id}", self.retrieve)
        router.add("DELETE", "/v1/responses/{response_id}", self.delete)
        router.add("POST", "/v1/responses/{response_id}/cancel", self.cancel)
        router.add("GET", "/v1/responses/{response_id}/input_items", self.list_input_items)

    async def retrieve(self, request: Request):
        rid = request.params["response_id"]
        item = self.store.get(rid)
        if item is None:
            raise _not_found(rid)
        if request.query.get("stream", ["false"])[0].lower() not in ("true", "1"):
            return Response.json(item[0])
        # a background response's events again, from after ``starting_after``, then live until it ends
        log = self.logs.get(rid)
        if log is None:
            raise _bad("stream", "only a background response's events can be streamed again")
        raw = request.query.get("starting_after", ["-1"])[0]
        try:
            after = int(raw)
        except ValueError:
            raise _bad("starting_after", f"must be an integer, got {raw!r}") from None
        return StreamingResponse(lambda w: self._follow(log, w, after), headers=[("cache-control", "no-cache")])

    @staticmethod
    async def _follow(log: _EventLog, w: ResponseWriter, after: int) -> None:
        try:
            await log.follow(w, after)
        except ClientDisconnected:
            pass  # the response goes on generating; a later GET can pick the stream up again

    async def delete(self, request: Request) -> Response:
        rid = request.params["response_id"]
        item = self.store.get(rid)
        if item is not None and rid in self.running:  # a background response deleted while it runs stops, unstored
            item[0]["store"] = False
            self.running[rid][0].cancel()
        self.logs.pop(rid, None)
        if not self.store.delete(rid):
            raise _not_found(rid)
        return Response.json({"id": rid, "object": "response", "deleted": True})

    async def cancel(self, request: Request) -> Response:
        rid = request.params["response_id"]
        item = self.store.get(rid)
        if item is None:
            raise _not_found(rid)
        resp = item[0]
        if not resp.get("background"):
            raise _bad("response_id", "only a background response can be cancelled")
        running = self.running.get(rid)
        if running is not None:
            gen, task = running
            resp["status"] = "cancelled"
            gen.cancel()
            # The model request ends at its next step; the answer then holds what it had generated.
            await asyncio.wait([task], timeout=30.0)
        elif resp["status"] != "cancelled":
            raise _bad("response_id", f"the response has ended ({resp['status']}); it cannot be cancelled")
        return Response.json(resp)

    async def list_input_items(self, request: Request) -> Response:
        rid = request.params["response_id"]
        item = self.store.get(rid)
        if item is None:
            raise _not_found(rid)
        q = request.query
        order = q.get("order", ["desc"])[0]
        if order not in ("asc", "desc"):
            raise _bad("order", "must be 'asc' or 'desc'")
        try:
            limit = int(q.get("limit", ["20"])[0])
        except ValueError:
            raise _bad("limit", "must be an integer") from None
        if not 1 <= limit <= 100:
            raise _bad("limit", "must be between 1 and 100")
        items = list(item[2]) if order == "asc" else list(reversed(item[2]))
        after = q.get("after", [None])[0]
        if after:
            ids = [i["id"] for i in items]
            if after not in ids:
                raise _bad("after", f"names no input item of this response ({after!r})")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return Response.json({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})

    async def create(self, request: Request):
        body = json_object(request)
        model = _string(body, "model", required=True)
        lora = check_model(self.state, model, lora_ok=True)
        history: list[dict] = []
        prev = _string(body, "previous_response_id")
        if prev is not None:
            stored = self.store.get(prev)
            if stored is None:
                raise _not_found(prev, "previous_response_id")
            history = list(stored[1])
        conversation = history + translate_input(body.get("input"))
        instructions = _string(body, "instructions")
        messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
        parallel = _boolean(body, "parallel_tool_calls", default=True)
        forced = parse_openai_forced_tool_choice(body.get("tool_choice"), parallel=parallel)
        choice = "required" if forced else parse_tool_choice(body.get("tool_choice"), "tool_choice")
        tools = _tools(body)
        text_format = _text_format(body)
        if forced is not None and text_format is not None:
            raise _bad("tool_choice", "a forced tool call cannot be combined with 'text.format'")
        store = _boolean(body, "store", default=True)
        stream = _boolean(body, "stream")
        background = _boolean(body, "background")
        if background and not store:
            raise _bad("background", "needs 'store' true: a background response is fetched by its id")
        items = input_items(body.get("input"))
        offered = tools if choice != "none" else None
        rendered = await self.state.prepare_chat(messages, tools=offered, **_template_kwargs(body))
        # A forced call needs no tool format in the template: the grammar produces it.
        shape = OutputShape(self.state, rendered.text, None if forced else offered)
        grammar = await compile_grammar(
            self.state, force_tool_call(shape, offered, forced) if forced else text_format)
        options = _options(body)
        prompt = tuple(rendered.token_ids)
        vision = await self.state.vision_input(rendered)
        req = GenerateRequest(prompt_token_ids=prompt, message_endpoints=rendered.message_endpoints,
                              params=sampling_params(self.state, options, len(prompt), None, 0),
                              stop_token_ids=_stop_ids(self.state, options), grammar=grammar, lora=lora,
                              vision=vision)
        # A background response holds a permit of its own until it ends (this request's goes with its answer).
        release = self.state.admit(request) if background else None
        try:
            gen = self.state.start([req], (), skip_special_tokens=shape.skip_special_tokens)
        except BaseException:
            if release is not None:
                release()
            raise
        if not background:
            request.disconnected.add_callback(gen.cancel)
        resp = {
            "id": _item_id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": instructions,
            "max_output_tokens": options.max_tokens, "model": model, "output": [],
            "parallel_tool_calls": _boolean(body, "parallel_tool_calls", default=True),
            "previous_response_id": prev, "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
            "store": store, "temperature": options.temperature,
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "tool_choice": choice, "tools": body.get("tools") or [], "top_p": options.top_p,
            "truncation": "disabled", "usage": None, "user": body.get("user"), "metadata": body.get("metadata") or {},
            "background": background,
        }
        logprobs = options.logprobs is not None
        if store:
            self.store.put(resp, conversation, items)  # found by id while it runs (background) or streams
        if background:
            # its events go to a log that any number of streams follow (this one, if it streams, and later GETs
            # with stream=true); the generation goes on when a reader leaves
            resp["status"] = "queued"
            answer = json.loads(json.dumps(resp))  # as it stands now; the task goes on changing resp
            log = self.logs[resp["id"]] = _EventLog()
            for old_id in [k for k in self.logs if k not in self.store]:
                del self.logs[old_id]  # responses the store dropped
            task = asyncio.get_running_loop().create_task(
                self._background(gen, log, shape, resp, conversation, logprobs, release))
            self.running[resp["id"]] = (gen, task)
            if stream:
                return StreamingResponse(lambda w: self._follow(log, w, -1), headers=[("cache-control", "no-cache")])
            return Response.json(answer)
        if stream:
            return StreamingResponse(lambda w: self._stream(gen, w, shape, resp, conversation, logprobs),
                                     headers=[("cache-control", "no-cache")])
        out, finish = await self._collect(gen, shape, logprobs)
        self._finish(resp, out, gen, finish, conversation)
        return Response.json(resp)

    async def _collect(self, gen: Generation, shape: OutputShape, logprobs: bool) -> tuple[_Output, str]:
        ((text, _ids, lps, finish),) = await gen.collect()
        parsed, calls = shape.parse(text)
        out = _Output()
        if parsed.reasoning:
            out.reasoning_item()["content"][0]["text"] = parsed.reasoning
        if parsed.content or not calls:
            part = out.message_item()["content"][0]
            part["text"] = parsed.content
            if logprobs:
                part["logprobs"] = token_logprobs(self.state.frontend, lps)
        for i, c in enumerate(calls):
            out.call_item(i, c.id, c.name)["arguments"] = c.arguments
        return out, finish

    async def _background(self, gen: Generation, log: _EventLog, shape: OutputShape, resp: dict,
                          conversation: list[dict], logprobs: bool, release) -> None:
        """A background response's generation: its stream's events into ``log``, its result stored as it ends
        (_stream's own handling: a failure is the response's result)."""
        try:
            if resp["status"] == "queued":
                resp["status"] = "in_progress"
            await self._stream(gen, log, shape, resp, conversation, logprobs)
        finally:
            log.finish()
            self.running.pop(resp["id"], None)
            release()

    def _finish(self, resp: dict, out: _Output, gen: Generation, finish: str, conversation: list[dict]) -> None:
        for item in out.items:
            if "status" in item:
                item["status"] = "completed" if finish not in ("length", "cancelled") else "incomplete"
        resp["output"] = out.items
        resp["usage"] = _usage(gen)
        if finish == "cancelled":
            resp["status"] = "cancelled"
        elif finish == "length":
            resp["status"] = "incomplete"
            resp["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            resp["status"] = "completed"
        if resp["store"]:
            self.store.put(resp, conversation + _conversation_out(out.items))

    async def _stream(self, gen: Generation, w: ResponseWriter, shape: OutputShape, resp: dict,
                      conversation: list[dict], logprobs: bool = False) -> None:
        seq = 0
        pending: list = []  # logprobs of the tokens since the last output_text delta (when asked)

        async def event(kind: str, **fields) -> None:
            nonlocal seq
            await w.send_json_event({"type": kind, "sequence_number": seq, **fields}, event=kind)
            seq += 1

        out = _Output()
        parser = shape.parser() if shape.active else None
        open_kind: str | None = None  # the output item receiving deltas

        async def close_open() -> None:
            nonlocal open_kind
            if open_kind is None:
                return
            index = len(out.items) - 1
            item = out.items[index]
            if open_kind == "reasoning":
                text = item["content"][0]["text"]
                await event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                            content_index=0, text=text)
            elif open_kind == "message":
                part = item["content"][0]
                await event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=part["text"], logprobs=part["logprobs"])
                await event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=part)
                item["status"] = "completed"
            else:
                await event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=item["name"], arguments=item["arguments"])
                item["status"] = "completed"
            await event("response.output_item.done", output_index=index, item=item)
            open_kind = None

        async def feed(parsed: ParsedDelta) -> None:
            nonlocal open_kind
            if parsed.reasoning:
                if open_kind != "reasoning":
                    await close_open()
                    item = out.reasoning_item()
                    open_kind = "reasoning"
                    await event("response.output_item.added", output_index=len(out.items) - 1,
                                item={**item, "content": []})
                item = out.reasoning
                item["content"][0]["text"] += parsed.reasoning
                await event("response.reasoning_text.delta", item_id=item["id"], output_index=len(out.items) - 1,
                            content_index=0, delta=parsed.reasoning)
            if parsed.content:
                if open_kind != "message":
                    await close_open()
                    item = out.message_item()
                    open_kind = "message"
                    index = len(out.items) - 1
                    await event("response.output_item.added", output_index=index, item={**item, "content": []})
                    await event("response.content_part.added", item_id=item["id"], output_index=index,
                                content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                       "logprobs": []})
                item = out.message
                item["content"][0]["text"] += parsed.content
                lps = token_logprobs(self.state.frontend, pending)
                pending.clear()
                item["content"][0]["logprobs"].extend(lps)
                await event("response.output_text.delta", item_id=item["id"], output_index=len(out.items) - 1,
                            content_index=0, delta=parsed.content, logprobs=lps)
            for c in parsed.calls:
                if c.id is not None:
                    await close_open()
                    item = out.call_item(c.index, c.id, c.name)
                    open_kind = "function_call"
                    await event("response.output_item.added", output_index=len(out.items) - 1, item=dict(item))
                item = out.calls[c.index]
                if c.arguments:
                    item["arguments"] += c.arguments
                    await event("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=out.items.index(item), delta=c.arguments)

        finish = "stop"
        try:
            await event("response.created", response=dict(resp))
            await event("response.in_progress", response=dict(resp))
            async for d in gen.deltas():
                if logprobs:
                    pending.extend(d.logprobs)
                parsed = ParsedDelta(d.text) if parser is None else (parser.push(d.text) if d.text else ParsedDelta())
                if d.finish_reason is not None:
                    finish = d.finish_reason
                    if parser is not None:
                        tail = parser.finish()
                        parsed = ParsedDelta(parsed.content + tail.content, parsed.calls + tail.calls,
                                             parsed.reasoning + tail.reasoning)
                await feed(parsed)
            if not out.items:
                await feed(ParsedDelta(""))
                if out.message is None:  # an empty answer is still one (empty) message
                    item = out.message_item()
                    index = len(out.items) - 1
                    await event("response.output_item.added", output_index=index, item={**item, "content": []})
                    await event("response.content_part.added", item_id=item["id"], output_index=index,
                                content_index=0, part=item["content"][0])
                    open_kind = "message"
            await close_open()
            if resp["status"] == "cancelled":  # POST .../cancel ended it (a background response)
                finish = "cancelled"
            self._finish(resp, out, gen, finish, conversation)
            await event("response.completed" if resp["status"] == "completed" else "response.incomplete",
                        response=resp)
        except ClientDisconnected:
            gen.cancel()
            if resp["status"] == "in_progress":
                resp["status"] = "cancelled"  # as stored: the client went away before it ended
        except Exception as exc:  # the stream has started: a response.failed event ends it
            gen.cancel()
            err = json.loads(error_response(exc).body)["error"]
            resp["status"] = "failed"
            resp["error"] = {"code": err.get("code") or "server_error", "message": err["message"]}
            try:
                await event("error", code=resp["error"]["code"], message=err["message"], param=None)
                await event("response.failed", response=resp)
            except ClientDisconnected:
                pass
