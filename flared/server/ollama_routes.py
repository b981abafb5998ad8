"""Ollama-compatible routes: /api/version, /api/tags, /api/ps, /api/show, /api/chat, /api/generate, and the
model-management routes Ollama's clients call around them (/, /api/pull, /api/create, /api/copy, /api/push,
/api/delete).

What the ``ollama`` Python client and editors' Ollama providers call,
translated onto the one generation path.

Rules:
- ``stream`` defaults to true (Ollama's default): NDJSON, one object per
  line, the last with ``done: true``, ``done_reason`` and the counts and
  durations (nanoseconds). Non-streaming returns that last object with the
  whole message.
- Option names map onto ours: num_predict (-1: until the context ends, -2:
  fill the context), temperature, top_k, top_p, min_p, typical_p,
  repeat_penalty, presence_penalty and frequency_penalty over the last
  repeat_last_n tokens (default 64, prompt included, as Ollama), seed, stop,
  num_ctx (at most the core's context; a smaller value limits prompt +
  output; ``num_keep``: see below), mirostat (1, 2) with mirostat_tau and mirostat_eta, and
  llama.cpp's XTC and DRY options under their llama.cpp names. Options that only
  tune Ollama's own runtime (num_thread, num_gpu, ...) are ignored, as they
  are meaningless here.
- Tool calls arrive whole (Ollama's arguments are objects, not text), each
  in a message chunk as soon as it is complete; reasoning goes to ``thinking``;
  ``think: false`` turns thinking off in the template.
- ``format`` ("json" or a JSON schema) is enforced by the grammar engine.
- A prompt that does not fit num_ctx (else the core's context) is cut as
  Ollama cuts it, never refused, unless ``truncate`` is false (then a 400):
  a chat drops its oldest messages, keeping the system messages and the
  last message, while what is left does not fit (Ollama's chatPrompt); a
  prompt still too long keeps its first ``num_keep`` tokens (default 4)
  and its end, filling half the context so the answer has the other half
  (the runner's cut, logged as a warning).
- /api/generate answers Ollama's ``context`` (the exchange's token ids) and
  continues after one passed back.
- Errors are ``{"error": message}`` with the daemon's status codes.
- A model name may carry Ollama's ``:latest`` tag.
- The daemon serves one prepared core and downloads nothing: pulling the served model succeeds at once
  (clients pull before they use a model), pulling any other is a 404 that names the served one, and
  creating, copying, pushing or deleting a model is a 400 that says so. ``GET /`` answers "Ollama is
  running", the text that scripts and clients probe an Ollama server for.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from typing import Any

from flared.errors import AdmissionError, ErrorKind
from flared.frontend.toolcalls import ParsedDelta, ToolCall
from flared.runtime.request import GenerateRequest
from flared.server.generation import Generation
from flared.server.http import Request, Response, ResponseWriter, Router, StreamingResponse
from flared.server.http.messages import ClientDisconnected, error_response
from flared.server.openai_routes import (OutputShape, _stop_ids, check_model, prepare_samplers, sampling_params,
                                         token_logprobs)
from flared.server.openai_schema import (MAX_TOP_LOGPROBS, SamplingOptions, _bad, _boolean, _integer, _number, _type,
                                         json_object, llama_penalties, llama_samplers, parse_tools,
                                         reasoning_effort_kwargs)
from flared.server.structured import compile_grammar, parse_ollama_format

log = logging.getLogger("flared.server")

OLLAMA_VERSION = "0.12.0"  # the Ollama API generation whose fields we serve; clients gate features on it
_NDJSON = "application/x-ndjson"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _ollama_errors(handler):
    async def wrapped(request: Request):
        try:
            return await handler(request)
        except Exception as exc:
            resp = error_response(exc)
            try:
                message = json.loads(resp.body)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = "internal server error"
            return Response.json({"error": message}, status=resp.status)
    return wrapped


def _model(state, body: dict) -> str:
    return _model_and_lora(state, body, lora_ok=False)[0]


def _model_and_lora(state, body: dict, *, lora_ok: bool) -> tuple[str, int]:
    """The request's model name and the per-request LoRA adapter it picks (check_model; 0: the served model)."""
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name:
        raise _bad("model", "is required")
    return name, check_model(state, name.removesuffix(":latest"), lora_ok=lora_ok)


def _options_object(body: dict) -> dict:
    opts = body.get("options") or {}
    if not isinstance(opts, dict):
        raise _bad("options", f"must be an object, got {_type(opts)}")
    return opts


def _context_limit(state, body: dict) -> int:
    """The request's context: options.num_ctx, else the core's (num_ctx above it is a 400)."""
    context = state.manifest.capacities.context_tokens
    num_ctx = _integer(_options_object(body), "num_ctx", 1, 1 << 31)
    if num_ctx is not None and num_ctx > context:
        raise _bad("options.num_ctx", f"is {num_ctx}, but this model's context is {context} tokens "
                   f"({state.manifest.context_hint})")
    return num_ctx or context


def _truncates(body: dict) -> bool:
    """Ollama's ``truncate`` (default true): cut a prompt that does not fit rather than refuse it."""
    return _boolean(body, "truncate", default=True)


def _answer_room(body: dict, limit: int) -> int:
    """What a chat cut to fit keeps free for the answer (Ollama would shift the context while generating; this
    server does not): num_predict where one is set, else half the context, at most half."""
    num_predict = _integer(_options_object(body), "num_predict", -2, 1 << 31)
    return min(num_predict if num_predict is not None and num_predict > 0 else limit, limit // 2)


def _cut_prompt(body: dict, ids: list[int], endpoints, limit: int) -> tuple[list[int], tuple[int, ...]]:
    """A prompt of ``limit`` tokens or more cut as Ollama's runner cuts it: its first num_keep tokens (options,
    default 4) and its end, num_keep + (limit - num_keep) // 2 tokens in all (half the context left for the
    answer); the message endpoints that survive, moved. Fitting prompts (or ``truncate`` false) pass as they are."""
    if len(ids) < limit or not _truncates(body):
        return ids, tuple(endpoints)
    keep = _integer(_options_object(body), "num_keep", 0, 1 << 31)
    keep = min(4 if keep is None or keep < 0 else keep, limit - 1)
    new = keep + (limit - keep) // 2
    discard = len(ids) - new
    log.warning("truncating input prompt: limit=%d prompt=%d keep=%d new=%d", limit, len(ids), keep, new)
    moved = tuple(e if e <= keep else e - discard for e in endpoints if e <= keep or e - discard > keep)
    return ids[:keep] + ids[keep + discard:], moved


def _options(state, body: dict, num_prompt_tokens: int) -> SamplingOptions:
    opts = _options_object(body)
    context = state.manifest.capacities.context_tokens
    limit = _context_limit(state, body)
    if num_prompt_tokens >= limit:
        raise AdmissionError(f"the prompt has {num_prompt_tokens} tokens, more than num_ctx {limit} allows",
                             ErrorKind.CONTEXT_LENGTH, hint=state.manifest.context_hint)
    num_predict = _integer(opts, "num_predict", -2, 1 << 31)
    room = limit - num_prompt_tokens
    max_tokens = room if num_predict in (None, -1, -2) else min(max(num_predict, 1), room)
    stop = opts.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _bad("options.stop", "must be an array of strings")
    seed = _integer(opts, "seed", -(1 << 63), (1 << 64) - 1)
    top_k = _integer(opts, "top_k", 0, 1 << 31)
    # logprobs / top_logprobs sit beside options, as in Ollama's API
    top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if _boolean(body, "logprobs"):
        logprobs = top or 0
    elif top:
        raise _bad("top_logprobs", "requires 'logprobs': true")
    else:
        logprobs = None
    penalties = llama_penalties(opts, context)
    return SamplingOptions(
        max_tokens=max_tokens, temperature=_number(opts, "temperature", 0.0, 2.0),
        top_p=_number(opts, "top_p", 0.0, 1.0, lo_open=True), top_k=top_k, min_p=_number(opts, "min_p", 0.0, 1.0),
        seed=seed, logit_bias=None, logprobs=logprobs, stop=tuple(s for s in stop if s), stop_token_ids=(),
        ignore_eos=False, n=1, **penalties, **llama_samplers(opts))


def _context(state, body: dict) -> list[int]:
    """/api/generate's context: token ids an earlier answer returned (its prompt and answer), to continue from."""
    context = body.get("context")
    if context is None:
        return []
    if (not isinstance(context, list)
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < state.vocab_size for t in context)):
        raise _bad("context", f"must be an array of token ids (0..{state.vocab_size - 1})")
    return list(context)


def _with_images(text: str, images, where: str):
    """Ollama's ``images`` (base64 strings) beside a message's text: the content as parts, the images first (as
    Ollama's vision templates place them); the text alone when there are none."""
    if images is None or images == []:
        return text
    if not isinstance(images, list) or not all(isinstance(x, str) and x for x in images):
        raise _bad(where, "must be an array of base64-encoded images")
    parts: list[dict] = [{"type": "image", "image": x, "param": f"{where}[{k}]", "sent_as": "images"}
                         for k, x in enumerate(images)]
    return parts + [{"type": "text", "text": text}]


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty array of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise _bad(f"messages[{i}].role", "must be system, user, assistant or tool")
        content = m.get("content") or ""
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content", "must be a string")
        msg: dict[str, Any] = {"role": m["role"], "content": _with_images(content, m.get("images"),
                                                                           f"messages[{i}].images")}
        if m.get("tool_calls"):
            msg["tool_calls"] = [{"type": "function", "function": {
                "name": (c.get("function") or {}).get("name"),
                "arguments": (c.get("function") or {}).get("arguments") or {}}} for c in m["tool_calls"]
                if isinstance(c, dict)]
        if m.get("tool_name"):
            msg["name"] = m["tool_name"]
        out.append(msg)
    return out


def _template_kwargs(body: dict) -> dict[str, Any]:
    think = body.get("think")
    if think is None:
        return {}
    if isinstance(think, str) and think in ("low", "medium", "high"):
        return reasoning_effort_kwargs(think, "think")  # thinking on, and the effort for templates that take it
    if not isinstance(think, bool):
        raise _bad("think", "must be a boolean (or low, medium, high)")
    return {"enable_thinking": think}


def _ollama_calls(calls: list[ToolCall]) -> list[dict]:
    out = []
    for c in calls:
        try:
            args = json.loads(c.arguments or "{}")
        except ValueError:
            args = {}
        out.append({"function": {"name": c.name, "arguments": args if isinstance(args, dict) else {}}})
    return out


class OllamaRoutes:
    def __init__(self, state):
        self.state = state

    def register(self, router: Router) -> None:
        router.add("GET", "/api/version", _ollama_errors(self.version))
        router.add(("GET", "HEAD"), "/api/tags", _ollama_errors(self.tags))
        router.add("GET", "/api/ps", _ollama_errors(self.running))
        router.add("POST", "/api/show", _ollama_errors(self.show))
        router.add("POST", "/api/chat", _ollama_errors(self.chat), admit=True)
        router.add("POST", "/api/generate", _ollama_errors(self.generate), admit=True)
        router.add(("GET", "HEAD"), "/", self.root, public=True)  # a probe, and the browser's chat page
        router.add("POST", "/api/pull", _ollama_errors(self.pull))
        for path in ("/api/create", "/api/copy", "/api/push"):
            router.add("POST", path, _ollama_errors(self.manage))
        router.add("DELETE", "/api/delete", _ollama_errors(self.manage))

    async def root(self, request: Request) -> Response:
        # a browser (it asks for HTML) gets the chat page where one is served; Ollama's clients get its probe text
        if self.state.web_ui_page is not None and "text/html" in (request.header("accept") or ""):
            return await self.state.web_ui_page(request)
        return Response(b"Ollama is running", media_type="text/plain; charset=utf-8")

    async def pull(self, request: Request):
        """The served model is already here: success at once (streamed as one status line by default)."""
        body = json_object(request)
        _model(self.state, body)
        if _boolean(body, "stream", default=True):
            return Response(b'{"status":"success"}\n', media_type=_NDJSON)
        return Response.json({"status": "success"})

    async def manage(self, request: Request):
        what = request.path.rsplit("/", 1)[-1]
        raise AdmissionError(f"/api/{what} is not supported: this server serves one prepared model "
                             f"({self.state.manifest.model_name!r}) and does not create, copy, push or delete "
                             "models", ErrorKind.UNSUPPORTED)

    def _details(self) -> dict[str, Any]:
        m = self.state.manifest
        params = sum(a.size_bytes for name, a in m.assets.items() if name in m.weights)
        bytes_per = {"float32": 4, "bfloat16": 2, "float16": 2}.get(m.dtype, 2)
        weights = self.state.runtime.weights_info()
        level = (weights.get("quantization") or m.dtype).upper().replace("BFLOAT", "BF").replace("FLOAT", "F")
        return {"parent_model": "", "format": "flared-core", "family": m.architecture,
                "families": [m.architecture], "parameter_size": _human(params // bytes_per),
                "quantization_level": level}  # (--quantization q8_0: "Q8_0", as Ollama names a Q8_0 model; "Q4_1")

    async def version(self, request: Request) -> Response:
        return Response.json({"version": OLLAMA_VERSION})

    async def tags(self, request: Request) -> Response:
        m = self.state.manifest
        size = sum(a.size_bytes for a in m.assets.values())
        modified = datetime.datetime.fromtimestamp(self.state.created, datetime.timezone.utc).isoformat()
        models = [{"name": name, "model": name, "modified_at": modified, "size": size,
                   "digest": m.assets[m.tokenizer].sha256, "details": self._details()}
                  for name in dict.fromkeys((m.model_name, *m.served_names, *self.state.lora_modules)) if name]
        return Response.json({"models": models})

    async def running(self, request: Request) -> Response:
        """/api/ps: the served model is always loaded (its weights live as long as the daemon)."""
        m = self.state.manifest
        size = sum(a.size_bytes for a in m.assets.values())
        return Response.json({"models": [{
            "name": m.model_name, "model": m.model_name, "size": size, "digest": m.assets[m.tokenizer].sha256,
            "details": self._details(), "expires_at": "9999-12-31T23:59:59Z", "size_vram": 0,
            "context_length": m.capacities.context_tokens}]})

    def _capabilities(self) -> list[str]:
        caps = ["completion"]
        if self.state.tool_format() is not None:
            caps.append("tools")
        if self.state.reasoning_format() is not None:
            caps.append("thinking")
        if self.state.fim is not None:
            caps.append("insert")  # Ollama's name for models that take a suffix (fill in the middle)
        if self.state.takes_images:
            caps.append("vision")
        if self.state.takes_audio:
            caps.append("audio")  # (Ollama's name, for its audio models)
        return caps

    async def show(self, request: Request) -> Response:
        body = json_object(request)
        _model_and_lora(self.state, body, lora_ok=True)  # an adapter shows its base model's details
        m = self.state.manifest
        fe = self.state.frontend
        arch = m.architecture
        cfg = m.model
        info = {"general.architecture": arch, "general.name": m.model_name,
                f"{arch}.context_length": m.capacities.context_tokens}
        for ours, theirs in (("num_layers", "block_count"), ("hidden_size", "embedding_length"),
                             ("num_attention_heads", "attention.head_count"),
                             ("num_key_value_heads", "attention.head_count_kv"), ("vocab_size", "vocab_size")):
            if ours in cfg:
                info[f"{arch}.{theirs}"] = cfg[ours]
        if cfg.get("num_experts"):  # a mixture of experts: llama.cpp's keys for it
            info[f"{arch}.expert_count"] = cfg["num_experts"]
            info[f"{arch}.expert_used_count"] = cfg["experts_per_token"]
        d = m.generation_defaults
        params = "\n".join(f"{k} {v}" for k, v in (("temperature", d.get("temperature")), ("top_k", d.get("top_k")),
                                                     ("top_p", d.get("top_p"))) if v is not None)
        return Response.json({
            "license": "", "modelfile": f"FROM {m.model_name}\n", "parameters": params,
            "template": fe.chat_template.source if fe.chat_template is not None else "",
            "details": self._details(), "model_info": info, "capabilities": self._capabilities(),
            "modified_at": datetime.datetime.fromtimestamp(self.state.created, datetime.timezone.utc).isoformat()})

    # -- generation ----------------------------------------------------------------------------

    async def _start(self, body: dict, rendered_text: str, prompt: tuple[int, ...], endpoints, tools, lora: int,
                     fim: bool = False, vision=None):
        options = _options(self.state, body, len(prompt))
        grammar = await compile_grammar(self.state, parse_ollama_format(body.get("format")))
        await prepare_samplers(self.state, options)
        shape = OutputShape(self.state, rendered_text, tools)
        req = GenerateRequest(prompt_token_ids=prompt, message_endpoints=endpoints,
                              params=sampling_params(self.state, options, len(prompt), None, 0),
                              stop_token_ids=_stop_ids(self.state, options, fim=fim), grammar=grammar, lora=lora,
                              vision=vision)
        gen = self.state.start([req], options.stop, skip_special_tokens=shape.skip_special_tokens)
        return gen, shape, options.logprobs is not None

    async def chat(self, request: Request):
        body = json_object(request)
        model, lora = _model_and_lora(self.state, body, lora_ok=True)
        tools = parse_tools(body.get("tools"), "tools")
        t0 = time.monotonic_ns()
        messages = _messages(body)
        kwargs = _template_kwargs(body)
        rendered = await self.state.prepare_chat(messages, tools=tools, **kwargs)
        limit = _context_limit(self.state, body)
        if len(rendered.token_ids) >= limit and _truncates(body):
            rendered = await self._fit_messages(messages, limit - _answer_room(body, limit), tools, kwargs)
        ids, endpoints = _cut_prompt(body, list(rendered.token_ids), rendered.message_endpoints, limit)
        vision = None
        if rendered.images:
            if len(ids) != len(rendered.token_ids):  # the cut keeps the front and the end: images would move
                raise AdmissionError(f"the messages kept with their images take {len(rendered.token_ids)} tokens, "
                                     f"more than num_ctx {limit} allows", ErrorKind.CONTEXT_LENGTH)
            vision = await self.state.vision_input(rendered)
        gen, shape, lps = await self._start(body, rendered.text, tuple(ids), endpoints, tools, lora, vision=vision)
        return await self._respond(request, gen, shape, body, model, t0, chat=True, logprobs=lps)

    async def _fit_messages(self, messages: list[dict], limit: int, tools, kwargs):
        """Ollama's chatPrompt: the latest messages that fit in ``limit`` tokens (the context less _answer_room),
        the last one always, with the system messages before them."""
        best = None
        for start in range(len(messages) - 1, 0, -1):  # one more earlier message a round, while it fits
            kept = [m for m in messages[:start] if m["role"] == "system"] + messages[start:]
            candidate = await self.state.prepare_chat(kept, tools=tools, **kwargs)
            if len(candidate.token_ids) >= limit:
                break
            best = candidate
        if best is None:  # only the last message, with the system messages before it
            kept = [m for m in messages[:-1] if m["role"] == "system"] + messages[-1:]
            best = await self.state.prepare_chat(kept, tools=tools, **kwargs)
        log.warning("truncating input messages which exceed context length: kept the latest of %d messages",
                    len(messages))
        return best

    async def generate(self, request: Request):
        body = json_object(request)
        model, lora = _model_and_lora(self.state, body, lora_ok=True)
        prompt = body.get("prompt") or ""
        if not isinstance(prompt, str):
            raise _bad("prompt", "must be a string")
        if body.get("template"):
            raise _bad("template", "is not supported by this server", ErrorKind.UNSUPPORTED)
        images = body.get("images")
        if images and (body.get("suffix") or _boolean(body, "raw")):
            raise _bad("images", "images go with a templated prompt (not with 'raw' or 'suffix')",
                       ErrorKind.UNSUPPORTED)
        suffix = body.get("suffix")
        if suffix is not None and not isinstance(suffix, str):
            raise _bad("suffix", "must be a string")
        context = _context(self.state, body)
        if context and suffix:
            raise _bad("context", "cannot be combined with 'suffix'")
        if not prompt and not suffix:  # Ollama's "load the model" request: it is loaded
            return Response.json({"model": model, "created_at": _now(), "response": "", "done": True,
                                  "done_reason": "load"})
        t0 = time.monotonic_ns()
        if suffix:  # fill in the middle, as Ollama's code models do: the FIM tokens, no chat template
            ids = await self.state.fim_prompt(prompt, suffix)
            text, endpoints = prompt, ()
        elif _boolean(body, "raw"):
            ids = await self.state.encode(prompt)
            text, endpoints = prompt, ()
        else:
            system = body.get("system")
            messages = ([{"role": "system", "content": system}] if isinstance(system, str) and system else []) + \
                [{"role": "user", "content": _with_images(prompt, images, "images")}]
            rendered = await self.state.prepare_chat(messages, **_template_kwargs(body))
            ids, text, endpoints = rendered.token_ids, rendered.text, rendered.message_endpoints
        if context:  # the earlier exchange's tokens, then this prompt (where the context ends is a boundary)
            endpoints = (len(context), *(len(context) + e for e in endpoints))
            ids = context + list(ids)
        whole = len(ids)
        ids, endpoints = _cut_prompt(body, list(ids), endpoints, _context_limit(self.state, body))
        vision = None
        if images:
            if len(ids) != whole:
                raise AdmissionError(f"the prompt with its images takes {whole} tokens, more than num_ctx "
                                     f"{_context_limit(self.state, body)} allows", ErrorKind.CONTEXT_LENGTH)
            vision = await self.state.vision_input(rendered, cut=-len(context) if context else 0)
        gen, shape, lps = await self._start(body, text, tuple(ids), endpoints, None, lora, fim=bool(suffix),
                                            vision=vision)
        return await self._respond(request, gen, shape, body, model, t0, chat=False, logprobs=lps)

    async def _respond(self, request: Request, gen: Generation, shape: OutputShape, body: dict, model: str,
                       t0_ns: int, *, chat: bool, logprobs: bool):
        request.disconnected.add_callback(gen.cancel)
        stream = _boolean(body, "stream", default=True)
        if stream:
            return StreamingResponse(lambda w: self._stream(gen, w, shape, model, t0_ns, chat, logprobs),
                                     media_type=_NDJSON)
        ((text, ids, lps, finish),) = await gen.collect()
        parsed, calls = shape.parse(text)
        out = {"model": model, "created_at": _now(),
               **self._piece(parsed, calls, chat), **self._final(gen, finish, t0_ns, None if chat else ids)}
        if logprobs:
            out["logprobs"] = token_logprobs(self.state.frontend, lps)
        return Response.json(out)

    @staticmethod
    def _piece(parsed: ParsedDelta, calls: list[ToolCall], chat: bool) -> dict[str, Any]:
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
            if parsed.reasoning:
                message["thinking"] = parsed.reasoning
            if calls:
                message["tool_calls"] = _ollama_calls(calls)
            return {"message": message}
        piece: dict[str, Any] = {"response": parsed.content}
        if parsed.reasoning:
            piece["thinking"] = parsed.reasoning
        return piece

    def _final(self, gen: Generation, finish: str, t0_ns: int, generated: list[int] | None) -> dict[str, Any]:
        """The last object's counts; with ``generated`` (generate, not chat) also Ollama's ``context``: the
        exchange's tokens (prompt, then the answer without its stop token), which a next request may pass back
        to continue from them."""
        u = gen.usage()
        total = time.monotonic_ns() - t0_ns
        out = {"done": True, "done_reason": "length" if finish == "length" else "stop",
               "total_duration": total, "load_duration": 0, "prompt_eval_count": u.num_prompt_tokens,
               "prompt_eval_duration": 0, "eval_count": u.num_generated_tokens, "eval_duration": total}
        if generated is not None:
            request = gen.request(0)
            answer = list(generated)
            if answer and answer[-1] in request.stop_token_ids:
                answer.pop()
            out["context"] = list(request.prompt_token_ids) + answer
        return out

    async def _stream(self, gen: Generation, w: ResponseWriter, shape: OutputShape, model: str, t0_ns: int,
                      chat: bool, logprobs: bool) -> None:
        parser = shape.parser() if shape.active else None
        finish = "stop"
        num_calls_sent = 0
        generated: list[int] = []
        try:
            async for d in gen.deltas():
                generated.extend(d.token_ids)
                parsed = ParsedDelta(d.text) if parser is None else (parser.push(d.text) if d.text else ParsedDelta())
                if d.finish_reason is not None:
                    finish = d.finish_reason
                    if parser is not None:
                        tail = parser.finish()
                        parsed = ParsedDelta(parsed.content + tail.content, [], parsed.reasoning + tail.reasoning)
                lps = token_logprobs(self.state.frontend, d.logprobs) if logprobs and d.logprobs else None
                if parsed.content or parsed.reasoning or lps:
                    await w.send_ndjson({"model": model, "created_at": _now(), **self._piece(parsed, [], chat),
                                         **({"logprobs": lps} if lps else {}), "done": False})
                # a call goes out whole as soon as it is complete (Ollama's arguments are objects)
                done_calls = parser.calls[:len(parser.calls) if d.finish_reason is not None
                                          else parser.num_closed_calls] if parser is not None else []
                if len(done_calls) > num_calls_sent:
                    await w.send_ndjson({"model": model, "created_at": _now(), "done": False,
                                         **self._piece(ParsedDelta(), done_calls[num_calls_sent:], chat)})
                    num_calls_sent = len(done_calls)
            last = self._piece(ParsedDelta(), [], chat)
            await w.send_ndjson({"model": model, "created_at": _now(), **last,
                                 **self._final(gen, finish, t0_ns, None if chat else generated)})
        except ClientDisconnected:
            gen.cancel()
        except Exception as exc:  # the stream has started: the error is the last line
            gen.cancel()
            resp = error_response(exc)
            try:
                await w.send_ndjson({"error": json.loads(resp.body)["error"]["message"]})
            except ClientDisconnected:
                pass


def _human(n: int) -> str:
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)
