"""Relevance scores: reranking (vLLM's and Jina's /v1/rerank and /v2/rerank, llama.cpp's /rerank, Cohere's
shape) and vLLM's /v1/score.

The served model is a decoder, so a (query, document) pair is scored the way decoder rerankers such as
Qwen3-Reranker are: the model is asked, through its own chat template, whether the document meets the query
(system: ``JUDGE``; user: ``<Instruct>: ...\\n<Query>: ...\\n<Document>: ...``; the generation prompt, with
thinking off where the template has a switch), and the score is P(yes) / (P(yes) + P(no)) of its next token:
the sigmoid of the two logits' difference. On a Qwen3-Reranker core that prompt is the model's own format,
token for token; on a chat model it is a pointwise relevance judgment. The logits come from a model job
between steps (``ServerState.next_token_logits``), on a scratch KV cache.

Rules:
- ``query`` is a non-empty string; ``documents`` a non-empty array (at most 2,048) of strings or objects with a
  ``text`` string (Cohere's and Jina's form). ``top_n`` (>= 1) keeps the best n; ``return_documents``
  (default true, as vLLM answers) puts each document's text in its result. ``instruction`` (flared's) replaces
  the task line, Qwen3-Reranker's "Instruct".
- Results are sorted by score, best first (ties in input order); ``index`` is the document's position.
- /v1/score takes ``text_1`` and ``text_2`` (vLLM): a string and a string, a string and an array (one query,
  many documents) or two arrays of the same length (pairs); ``data`` keeps the pairs' order.
- A pair whose prompt is longer than the context is a 400 (context_length_exceeded) naming it. A model whose
  vocabulary has no single token for "yes" or "no" cannot be asked: a 400 that says so.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

from flared.errors import AdmissionError, ErrorKind, FrontendError
from flared.server.http import Request, Response, Router
from flared.server.openai_routes import model_body
from flared.server.openai_schema import _bad, _boolean, _integer, _string, _type

MAX_DOCUMENTS = 2048
JUDGE = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
         'Note that the answer can only be "yes" or "no".')
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
ANSWERS = ("no", "yes")


def judgment_messages(instruction: str, query: str, document: str, *, system: bool = True) -> list[dict]:
    """The chat that asks whether ``document`` meets ``query``: the judgment as the system turn (``system``) or
    at the head of the user turn (templates that refuse a system turn)."""
    user = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
    if system:
        return [{"role": "system", "content": JUDGE}, {"role": "user", "content": user}]
    return [{"role": "user", "content": f"{JUDGE}\n\n{user}"}]


def _text(v: Any, where: str, field: str) -> str:
    """A document as a string: itself, or an object's ``text``."""
    if isinstance(v, dict):
        v = v.get("text")
    if not isinstance(v, str):
        raise _bad(field, f"{where} must be a string or an object with a 'text' string, got {_type(v)}")
    return v


def _string_field(body: dict, field: str) -> str:
    """A required, non-empty string."""
    v = body.get(field)
    if not isinstance(v, str) or not v:
        raise _bad(field, "is required" if v is None else f"must be a non-empty string, got {_type(v)}"
                   + (" (empty)" if v == "" else ""))
    return v


def _texts(body: dict, field: str, *, one: bool = False) -> list[str]:
    """A required, non-empty array of texts (strings or objects with a ``text``); with ``one``, a string alone
    is one text."""
    v = body.get(field)
    if one and isinstance(v, str):
        return [_string_field(body, field)]
    if v is None:
        raise _bad(field, "is required")
    if not isinstance(v, list) or not v:
        raise _bad(field, f"must be a{' string or a' if one else ''} non-empty array, got {_type(v)}"
                   + (" (empty)" if v == [] else ""))
    if len(v) > MAX_DOCUMENTS:
        raise _bad(field, f"at most {MAX_DOCUMENTS} per request, got {len(v)}")
    return [_text(item, f"{field}[{i}]", field) for i, item in enumerate(v)]


class RerankRoutes:
    def __init__(self, state):
        self.state = state
        self._answers: tuple[int, int] | None = None

    def register(self, router: Router) -> None:
        for path in ("/v1/rerank", "/v2/rerank", "/rerank", "/reranking", "/v1/reranking"):
            router.add("POST", path, self.rerank, admit=True)
        for path in ("/v1/score", "/score"):
            router.add("POST", path, self.score, admit=True)

    def _body(self, request: Request) -> dict:
        return model_body(self.state, request)

    async def _answer_ids(self) -> tuple[int, int]:
        """The single tokens the model answers "no" and "yes" with."""
        if self._answers is None:
            ids = [await self.state.encode(word, add_special_tokens=False) for word in ANSWERS]
            if any(len(t) != 1 for t in ids):
                spelled = ", ".join(f"{w!r} -> {t}" for w, t in zip(ANSWERS, ids))
                raise AdmissionError(f"this model's vocabulary has no single token for 'yes' and 'no' ({spelled}): "
                                     "it cannot be asked for a relevance judgment", ErrorKind.UNSUPPORTED)
            self._answers = (ids[0][0], ids[1][0])
        return self._answers

    async def _prompt(self, instruction: str, query: str, document: str) -> list[int]:
        try:
            rendered = await self.state.prepare_chat(judgment_messages(instruction, query, document),
                                                     add_generation_prompt=True, enable_thinking=False)
        except FrontendError as exc:
            if exc.kind is not ErrorKind.TEMPLATE:
                raise
            # templates without a system turn (Gemma's raise on one): the judgment leads the user turn
            rendered = await self.state.prepare_chat(judgment_messages(instruction, query, document, system=False),
                                                     add_generation_prompt=True, enable_thinking=False)
        return list(rendered.token_ids)

    async def _scores(self, pairs: list[tuple[str, str]], instruction: str, field: str) -> tuple[list[float], int]:
        """Each (query, document) pair's relevance in [0, 1] and the prompt tokens run."""
        answers = await self._answer_ids()
        context = self.state.manifest.capacities.context_tokens
        prompts = await asyncio.gather(*(self._prompt(instruction, q, d) for q, d in pairs))  # frontend workers
        for i, ids in enumerate(prompts):
            if len(ids) > context:
                where = field if len(pairs) == 1 else f"{field}[{i}]"
                err = AdmissionError(f"'{field}': {where} makes a prompt of {len(ids)} tokens with the query; this "
                                     f"model's context holds {context}", ErrorKind.CONTEXT_LENGTH)
                err.param = field
                raise err
        logits = await self.state.next_token_logits(prompts, answers)
        scores = (logits[:, 1] - logits[:, 0]).double().sigmoid().tolist()  # P(yes) / (P(yes) + P(no))
        return scores, sum(len(p) for p in prompts)

    async def rerank(self, request: Request) -> Response:
        body = self._body(request)
        query = _string_field(body, "query")
        documents = _texts(body, "documents")
        top_n = _integer(body, "top_n", 1, 1 << 30)
        keep_text = _boolean(body, "return_documents", default=True)
        instruction = _string(body, "instruction") or DEFAULT_INSTRUCTION
        scores, tokens = await self._scores([(query, d) for d in documents], instruction, "documents")
        order = sorted(range(len(documents)), key=lambda i: (-scores[i], i))[:top_n]
        results = []
        for i in order:
            item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if keep_text:
                item["document"] = {"text": documents[i]}
            results.append(item)
        return Response.json({"id": f"rerank-{secrets.token_hex(12)}", "object": "list",
                              "model": self.state.manifest.model_name, "results": results,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def score(self, request: Request) -> Response:
        body = self._body(request)
        queries, documents = _texts(body, "text_1", one=True), _texts(body, "text_2", one=True)
        if len(queries) == 1:
            pairs = [(queries[0], d) for d in documents]
        elif len(queries) == len(documents):
            pairs = list(zip(queries, documents))
        else:
            raise _bad("text_2", f"text_1 has {len(queries)} texts and text_2 has {len(documents)}: give one text_1, "
                       "or as many as text_2")
        instruction = _string(body, "instruction") or DEFAULT_INSTRUCTION
        scores, tokens = await self._scores(pairs, instruction, "text_2")
        return Response.json({
            "id": f"score-{secrets.token_hex(12)}", "object": "list", "created": int(time.time()),
            "model": self.state.manifest.model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}})
