"""POST /tokenize, POST /detokenize and POST /apply-template, as vLLM's and llama.cpp server's clients call them.

/tokenize takes one of:
- ``prompt`` (vLLM): text tokenized as /v1/completions tokenizes a prompt (``add_special_tokens``, default
  true: with the model's BOS where it takes one);
- ``content`` (llama.cpp): text, with special tokens only when ``add_special`` is true (default false);
- ``messages`` (vLLM): a chat rendered by the model's template exactly as /v1/chat/completions renders it
  (``tools``, ``documents``, ``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``,
  ``reasoning_effort``, ``add_special_tokens`` default false).
It answers ``{"tokens", "count", "max_model_len"}``; ``with_pieces`` (llama.cpp) makes each token
``{"id", "piece"}`` and ``return_token_strs`` (vLLM) adds ``token_strs``, each token's own text.

/detokenize takes ``tokens`` (ids in the vocabulary) and answers the text as both ``prompt`` (vLLM) and
``content`` (llama.cpp). /apply-template (llama.cpp) takes ``messages`` as /tokenize does and answers the
rendered text as ``{"prompt"}``. ``model``, where given, must name the served model. No route here touches the
model thread.
"""

from __future__ import annotations

from typing import Any

from flared.server.http import Request, Response, Router
from flared.server.openai_routes import model_body
from flared.server.openai_schema import _bad, _boolean, _string, _type, parse_chat


class TokenizeRoutes:
    def __init__(self, state):
        self.state = state

    def register(self, router: Router) -> None:
        router.add("POST", "/tokenize", self.tokenize)
        router.add("POST", "/detokenize", self.detokenize)
        router.add("POST", "/apply-template", self.apply_template)

    def _body(self, request: Request) -> dict:
        return model_body(self.state, request)

    async def _render(self, body: dict):
        """A chat rendered as chat completions renders it (tools, documents, template kwargs, reasoning effort,
        add_special_tokens)."""
        req = parse_chat({**body, "model": self.state.manifest.model_name})
        return await self.state.prepare_chat(
            req.messages, tools=req.tools, documents=req.documents, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, add_special_tokens=req.add_special_tokens,
            template=self.state.request_template(req.chat_template), media_options=req.media_options,
            **req.template_kwargs)

    async def apply_template(self, request: Request) -> Response:
        """llama.cpp server's /apply-template: the chat's rendered prompt text, for clients that then send it
        to /completion themselves."""
        body = self._body(request)
        if "messages" not in body:
            raise _bad("messages", "is required")
        return Response.json({"prompt": (await self._render(body)).text})

    async def tokenize(self, request: Request) -> Response:
        body = self._body(request)
        given = [k for k in ("prompt", "content", "messages") if k in body]
        if len(given) != 1:
            raise _bad("prompt", "give exactly one of 'prompt', 'content' or 'messages'"
                       + (f" (got {', '.join(given)})" if given else ""))
        if given[0] == "messages":
            ids = list((await self._render(body)).token_ids)
        else:
            field = given[0]
            text = _string(body, field)
            if text is None:
                raise _bad(field, "must be a string, got null")
            if field == "prompt":
                add = None if _boolean(body, "add_special_tokens", default=True) else False
            else:
                add = _boolean(body, "add_special")
            ids = await self.state.encode(text, add_special_tokens=add)
        pieces = (await self.state.token_texts(ids) if _boolean(body, "with_pieces")
                  or _boolean(body, "return_token_strs") else None)
        tokens: list[Any] = ([{"id": t, "piece": p} for t, p in zip(ids, pieces)] if _boolean(body, "with_pieces")
                             else ids)
        out: dict[str, Any] = {"tokens": tokens, "count": len(ids),
                               "max_model_len": self.state.manifest.capacities.context_tokens}
        if _boolean(body, "return_token_strs"):
            out["token_strs"] = pieces
        return Response.json(out)

    async def detokenize(self, request: Request) -> Response:
        body = self._body(request)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise _bad("tokens", f"must be an array of token ids, got {_type(ids)}")
        for t in ids:
            if not 0 <= t < self.state.vocab_size:
                raise _bad("tokens", f"token id {t} is outside the vocabulary (0..{self.state.vocab_size - 1})")
        text = await self.state.decode(ids)
        return Response.json({"prompt": text, "content": text})
