"""Embeddings: OpenAI's /v1/embeddings, Ollama's /api/embed and /api/embeddings, llama.cpp's /embedding.

The served model is a decoder; an input's embedding is its final-normed hidden state pooled over its tokens
(``ServerConfig.embedding_pooling``: the last token's, as embedding models built on decoders pool, or the mean),
computed on the model thread between steps (``ModelRuntime.submit_job``) on a scratch KV cache. OpenAI's
and /api/embed's vectors have unit length; the legacy /api/embeddings returns the pooled vector as it is, as
Ollama's does.

Rules:
- Inputs are texts (tokenized as prompts are: with the model's BOS where it takes one) or, on /v1/embeddings,
  token-id arrays. An empty input is a 400 naming it.
- An input longer than the context is a 400 (context_length_exceeded) on /v1/embeddings and on /api/embed with
  ``truncate: false``; /api/embed truncates it to the context by default, as Ollama does.
- ``dimensions`` other than the model's hidden size is a 400: these vectors cannot be shortened.
- ``encoding_format: base64`` returns each vector as the base64 of its little-endian float32 bytes (the
  OpenAI SDK asks for it whenever numpy is installed).
- llama.cpp's /embedding (also /embeddings) takes ``content`` (or ``input``) as /v1/embeddings takes ``input``
  and ``embd_normalize``: -1 none, 0 max-absolute scaled to int16's range (32760), 1 taxicab, 2 Euclidean (the
  default), p > 2 the p-norm. It answers ``[{"index": i, "embedding": [vector]}]``: one pooled vector per input,
  in a list (llama.cpp's shape; it lists every token's vector only without pooling, which this server always
  does).
"""

from __future__ import annotations

import base64
import time
from typing import Any

from flared.errors import AdmissionError, ErrorKind
from flared.server.http import Request, Response, Router
from flared.server.ollama_routes import _model, _ollama_errors
from flared.server.openai_routes import check_model
from flared.server.openai_schema import _bad, _boolean, _integer, _string, _type, json_object

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def parse_openai_input(body: dict, field: str = "input") -> list[str | list[int]]:
    """``field`` (``input``): a string, an array of strings, an array of token ids or an array of token-id arrays."""
    inp = body.get(field)
    if isinstance(inp, str):
        items: list[str | list[int]] = [inp]
    elif _is_ids(inp):
        items = [list(inp)]
    elif isinstance(inp, list) and inp and all(isinstance(v, str) for v in inp):
        items = list(inp)
    elif isinstance(inp, list) and inp and all(_is_ids(v) for v in inp):
        items = [list(v) for v in inp]
    else:
        raise _bad(field, "must be a string, an array of strings, an array of token ids or an array of "
                   f"token-id arrays (non-empty), got {_type(inp)}" + (" (empty)" if inp in ([], "") else ""))
    if len(items) > MAX_INPUTS:
        raise _bad(field, f"at most {MAX_INPUTS} inputs per request, got {len(items)}")
    return items


async def tokenize_inputs(state, items: list[str | list[int]], *, truncate: bool = False,
                          field: str = "input") -> list[list[int]]:
    """Token ids of every input, checked against the vocabulary and the context (or cut to it); errors name
    ``field``."""
    context = state.manifest.capacities.context_tokens
    out = []
    for i, item in enumerate(items):
        where = field if len(items) == 1 else f"{field}[{i}]"
        if isinstance(item, str):
            if not item:
                raise _bad(field, f"{where} is an empty string")
            ids = await state.encode(item)
        else:
            for t in item:
                if not 0 <= t < state.vocab_size:
                    raise _bad(field, f"{where}: token id {t} is outside the vocabulary (0..{state.vocab_size - 1})")
            ids = list(item)
        if not ids:
            raise _bad(field, f"{where} has no tokens")
        if len(ids) > context:
            if not truncate:
                err = AdmissionError(f"'{field}': {where} has {len(ids)} tokens; this model's context holds {context}",
                                     ErrorKind.CONTEXT_LENGTH)
                err.param = field
                raise err
            ids = ids[:context]
        out.append(ids)
    return out


def check_dimensions(state, body: dict) -> None:
    hidden = int(state.manifest.model["hidden_size"])
    dims = _integer(body, "dimensions", 1, 1 << 20)
    if dims is not None and dims != hidden:
        raise _bad("dimensions", f"this model's embeddings have {hidden} dimensions and cannot be shortened "
                   f"to {dims}", ErrorKind.UNSUPPORTED)


class EmbeddingRoutes:
    def __init__(self, state):
        self.state = state

    def register(self, router: Router) -> None:
        router.add("POST", "/v1/embeddings", self.openai, admit=True)
        router.add("POST", "/api/embed", _ollama_errors(self.ollama_embed), admit=True)
        router.add("POST", "/api/embeddings", _ollama_errors(self.ollama_embeddings), admit=True)
        router.add("POST", "/embedding", self.llamacpp, admit=True)
        router.add("POST", "/embeddings", self.llamacpp, admit=True)

    async def openai(self, request: Request) -> Response:
        body = json_object(request)
        model = _string(body, "model", required=True)
        check_model(self.state, model)
        items = parse_openai_input(body)
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise _bad("encoding_format", f"must be 'float' or 'base64', got {fmt!r}")
        check_dimensions(self.state, body)
        _string(body, "user")
        ids = await tokenize_inputs(self.state, items)
        vectors = await self.state.embed(ids)
        tokens = sum(len(t) for t in ids)

        def respond() -> Response:  # thousands of vectors to JSON: on a frontend worker, not the event loop
            data = []
            for i, v in enumerate(vectors):
                emb: Any = (base64.b64encode(v.numpy().astype("<f4").tobytes()).decode("ascii") if fmt == "base64"
                            else v.tolist())
                data.append({"object": "embedding", "index": i, "embedding": emb})
            return Response.json({"object": "list", "data": data, "model": model,
                                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
        return await self.state._in_pool(respond)

    async def ollama_embed(self, request: Request) -> Response:
        t0 = time.monotonic_ns()
        body = json_object(request)
        model = _model(self.state, body)
        inp = body.get("input")
        if inp is None or inp == []:
            items: list[str | list[int]] = []  # Ollama: loads the model, embeds nothing
        elif isinstance(inp, str):
            items = [inp]
        elif isinstance(inp, list) and all(isinstance(v, str) for v in inp):
            items = list(inp)
        else:
            raise _bad("input", f"must be a string or an array of strings, got {_type(inp)}")
        if len(items) > MAX_INPUTS:
            raise _bad("input", f"at most {MAX_INPUTS} inputs per request, got {len(items)}")
        truncate = _boolean(body, "truncate", default=True)
        check_dimensions(self.state, body)
        ids = await tokenize_inputs(self.state, items, truncate=truncate)
        vectors = await self.state.embed(ids) if ids else None
        return await self.state._in_pool(lambda: Response.json({  # the vectors to JSON on a frontend worker
            "model": model, "embeddings": vectors.tolist() if vectors is not None else [],
            "total_duration": time.monotonic_ns() - t0, "load_duration": 0,
            "prompt_eval_count": sum(len(t) for t in ids)}))

    async def ollama_embeddings(self, request: Request) -> Response:
        """The legacy route: one ``prompt``, its pooled vector as it is (not scaled to unit length)."""
        body = json_object(request)
        _model(self.state, body)
        prompt = body.get("prompt", "")
        if not isinstance(prompt, str):
            raise _bad("prompt", f"must be a string, got {_type(prompt)}")
        if not prompt:
            return Response.json({"embedding": []})  # Ollama: loads the model, embeds nothing
        ids = await tokenize_inputs(self.state, [prompt], truncate=True)
        vectors = await self.state.embed(ids, normalize=False)
        return Response.json({"embedding": vectors[0].tolist()})

    async def llamacpp(self, request: Request) -> Response:
        body = json_object(request)
        field = "content" if "content" in body else "input"  # errors name the one the client sent
        items = parse_openai_input(body, field)
        norm = _integer(body, "embd_normalize", -1, 1 << 10)
        norm = 2 if norm is None else norm
        ids = await tokenize_inputs(self.state, items, field=field)
        vectors = await self.state.embed(ids, normalize=False)

        def respond() -> Response:
            v = vectors.float()
            if norm == 0:
                v = v * (32760.0 / v.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30))
            elif norm > 0:
                v = v / v.abs().pow(norm).sum(dim=-1, keepdim=True).pow(1.0 / norm).clamp_min(1e-30)
            return Response.json([{"index": i, "embedding": [row]} for i, row in enumerate(v.tolist())])
        return await self.state._in_pool(respond)
