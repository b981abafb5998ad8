"""/v1/systemone: the low-latency answer route (our definition of the reference's route).

A chat-completions body in, an answer out: thinking is turned off through
the template (``enable_thinking=false``, whatever the request's
``chat_template_kwargs`` say) and any reasoning the model emits anyway is
removed, so the reply is only the answer. Non-streaming unless ``stream`` is
true; ``max_tokens`` defaults to 256 (a short answer, not the rest of the
context). Tools are not offered here (use /v1/chat/completions). The reply
has the chat-completion shape (``object: "chat.completion"``, or
``chat.completion.chunk`` events and ``[DONE]`` when streaming).
"""

from __future__ import annotations

import secrets
from typing import Any

from flared.errors import ErrorKind
from flared.runtime.request import GenerateRequest
from flared.server.generation import Generation
from flared.server.http import Request, Response, ResponseWriter, Router, StreamingResponse
from flared.server.http.messages import ClientDisconnected
from flared.server.openai_routes import (
    OutputShape,
    _check_vocab,
    _send_stream_error,
    _stop_ids,
    _usage,
    check_model,
    sampling_params,
)
from flared.server.openai_schema import _bad, parse_chat

SYSTEMONE_DEFAULT_MAX_TOKENS = 256


class SystemOneRoutes:
    def __init__(self, state):
        self.state = state

    def register(self, router: Router) -> None:
        router.add("POST", "/v1/systemone", self.systemone, admit=True)

    async def systemone(self, request: Request):
        body = request.json()
        req = parse_chat(body)
        if req.tools:
            raise _bad("tools", "are not offered on /v1/systemone (use /v1/chat/completions)", ErrorKind.UNSUPPORTED)
        check_model(self.state, req.model)
        _check_vocab(self.state, req.options)
        kwargs = {**req.template_kwargs, "enable_thinking": False}
        rendered = await self.state.prepare_chat(req.messages, add_generation_prompt=req.add_generation_prompt,
                                                 continue_final_message=req.continue_final_message, **kwargs)
        shape = OutputShape(self.state, rendered.text, None)
        prompt = tuple(rendered.token_ids)
        vision = await self.state.vision_input(rendered)
        requests = [
            GenerateRequest(prompt_token_ids=prompt, message_endpoints=rendered.message_endpoints,
                            params=sampling_params(self.state, req.options, len(prompt),
                                                   SYSTEMONE_DEFAULT_MAX_TOKENS, i),
                            stop_token_ids=_stop_ids(self.state, req.options), vision=vision)
            for i in range(req.options.n)]
        gen = self.state.start(requests, req.options.stop)
        request.disconnected.add_callback(gen.cancel)
        rid = "chatcmpl-" + secrets.token_hex(12)
        if req.stream:
            return StreamingResponse(lambda w: self._stream(gen, w, shape, req.model, rid, req.include_usage),
                                     headers=[("cache-control", "no-cache")])
        results = await gen.collect()
        choices = [{"index": i, "message": {"role": "assistant", "content": shape.parse(text)[0].content},
                    "logprobs": None, "finish_reason": finish}
                   for i, (text, _ids, _lps, finish) in enumerate(results)]
        return Response.json({"id": rid, "object": "chat.completion", "created": gen.created, "model": req.model,
                              "choices": choices, "usage": _usage(gen)})

    async def _stream(self, gen: Generation, w: ResponseWriter, shape: OutputShape, model: str, rid: str,
                      include_usage: bool) -> None:
        base = {"id": rid, "object": "chat.completion.chunk", "created": gen.created, "model": model}
        parsers = [shape.parser() for _ in range(gen.num_choices)] if shape.active else None
        try:
            for i in range(gen.num_choices):
                await w.send_json_event({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                              "finish_reason": None}]})
            async for d in gen.deltas():
                text = d.text
                if parsers is not None:
                    text = parsers[d.index].push(text).content if text else ""
                    if d.finish_reason is not None:
                        text += parsers[d.index].finish().content
                if not text and d.finish_reason is None:
                    continue
                delta: dict[str, Any] = {"content": text} if text else {}
                await w.send_json_event({**base, "choices": [{"index": d.index, "delta": delta,
                                                              "finish_reason": d.finish_reason}]})
            if include_usage:
                await w.send_json_event({**base, "choices": [], "usage": _usage(gen)})
            await w.send_event("[DONE]")
        except ClientDisconnected:
            gen.cancel()
        except Exception as exc:
            gen.cancel()
            await _send_stream_error(w, exc)
