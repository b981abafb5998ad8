"""/v1/decisions: score fixed options as continuations of one prompt.

Body: ``{"model", "messages" | "prompt", "options": [2..64 strings]}``.
The prompt is rendered (chat template with the generation prompt for
``messages``; the raw text, tokenized as /v1/completions does, for
``prompt``); each option is tokenized on its own and appended. Each option
is one scoring request (``GenerateRequest.score_from`` = the prompt's
length): a teacher-forced prefill whose option tokens get their
log-probabilities. Nothing is sampled; the answer is deterministic.

Rules:
- The prompt is computed once: the first option runs alone and leaves a
  checkpoint at the prompt's end (its message boundary, the anchor the
  scheduler snapshots); the others run together and restore it. With the
  prefix cache off every option recomputes the prompt; the numbers are the
  same.
- Options with the same tokens are scored once and share the result.
- ``probability`` is the softmax of the options' total log-probabilities
  (a distribution over the options only); ``chosen`` is its argmax (the
  first on a tie).
- A disconnect cancels every scoring request still running.
"""

from __future__ import annotations

import asyncio
import math
import secrets
from typing import Any

from flared.errors import AdmissionError, ErrorKind
from flared.model.sampling import SamplingParams
from flared.runtime.request import ErrorEvent, EventSink, FinishEvent, GenerateRequest, ScoredEvent
from flared.server.http import Request, Response, Router
from flared.server.openai_routes import check_model

MIN_OPTIONS = 2
MAX_OPTIONS = 64


def _bad(field: str, message: str, kind: ErrorKind = ErrorKind.VALIDATION) -> AdmissionError:
    err = AdmissionError(f"'{field}': {message}", kind)
    err.param = field
    return err


def parse_decision(body: Any) -> tuple[str, list[dict] | None, str | None, list[str]]:
    if not isinstance(body, dict):
        raise _bad("body", "must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("model", "is required (a string)")
    messages, prompt = body.get("messages"), body.get("prompt")
    if (messages is None) == (prompt is None):
        raise _bad("messages", "give exactly one of 'messages' or 'prompt'")
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise _bad("messages", "must be a non-empty array of messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _bad(f"messages[{i}]", "must be an object with a 'role'")
            if not isinstance(m.get("content"), str):
                raise _bad(f"messages[{i}].content", "must be a string")
    elif not isinstance(prompt, str) or not prompt:
        raise _bad("prompt", "must be a non-empty string")
    options = body.get("options")
    if not isinstance(options, list) or not MIN_OPTIONS <= len(options) <= MAX_OPTIONS:
        raise _bad("options", f"must be an array of {MIN_OPTIONS} to {MAX_OPTIONS} strings")
    for i, o in enumerate(options):
        if not isinstance(o, str) or not o:
            raise _bad(f"options[{i}]", "must be a non-empty string")
    return model, messages, prompt, list(options)


class DecisionsRoutes:
    def __init__(self, state):
        self.state = state

    def register(self, router: Router) -> None:
        router.add("POST", "/v1/decisions", self.decisions, admit=True)

    async def decisions(self, request: Request) -> Response:
        state = self.state
        model, messages, prompt_text, options = parse_decision(request.json())
        check_model(state, model)
        if messages is not None:
            rendered = await state.prepare_chat(messages, add_generation_prompt=True)
            if rendered.images:
                raise _bad("messages", "images are not taken by /v1/decisions", ErrorKind.UNSUPPORTED)
            prompt = tuple(rendered.token_ids)
            endpoints = tuple(rendered.message_endpoints)
        else:
            prompt = tuple(await state.encode(prompt_text))
            endpoints = ()
        if not prompt:
            raise _bad("prompt", "renders to no tokens")
        fe = state.frontend
        option_ids = await state._in_pool(lambda: [tuple(fe.encode(o)) for o in options])
        context = state.manifest.capacities.context_tokens
        for i, ids in enumerate(option_ids):
            if not ids:
                raise _bad(f"options[{i}]", "tokenizes to nothing")
            # +1: the scheduler reserves room for the one (unpublished) sample at the prompt's end.
            if len(prompt) + len(ids) + 1 > context:
                raise AdmissionError(
                    f"this model's maximum context length is {context} tokens; the prompt ({len(prompt)}) "
                    f"plus options[{i}] ({len(ids)}) does not fit", ErrorKind.CONTEXT_LENGTH,
                    hint=state.manifest.context_hint)
        if state.paused:
            raise AdmissionError("the server is not accepting new requests (paused or shutting down)",
                                 ErrorKind.UNAVAILABLE)
        unique = list(dict.fromkeys(option_ids))
        scorer = _Scorer(state.runtime, prompt, endpoints)
        request.disconnected.add_callback(scorer.cancel)
        try:
            # The first option alone leaves the prompt's checkpoint; the rest restore it.
            results = await scorer.score(unique[:1])
            results.update(await scorer.score(unique[1:]))
        finally:
            scorer.cancel()
        return Response.json(self._body(model, options, option_ids, results, len(prompt), scorer))

    def _body(self, model, options, option_ids, results, num_prompt_tokens, scorer) -> dict:
        fe = self.state.frontend
        totals = [math.fsum(results[ids]) for ids in option_ids]
        top = max(totals)
        weights = [math.exp(t - top) for t in totals]
        norm = math.fsum(weights)
        chosen = totals.index(top)
        out = []
        for i, (text, ids) in enumerate(zip(options, option_ids)):
            out.append({"index": i, "text": text, "tokens": [fe.decode([t]) for t in ids], "token_ids": list(ids),
                        "logprobs": list(results[ids]), "total_logprob": totals[i],
                        "probability": weights[i] / norm})
        return {"id": "dec-" + secrets.token_hex(12), "object": "decision", "model": model, "chosen": chosen,
                "options": out,
                "usage": {"prompt_tokens": num_prompt_tokens, "option_tokens": sum(len(i) for i in option_ids),
                          "cached_tokens": scorer.num_cached_tokens}}


class _Scorer:
    """Scoring requests for one decision, over one event queue."""

    def __init__(self, runtime, prompt: tuple[int, ...], endpoints: tuple[int, ...]):
        self._runtime = runtime
        self._prompt = prompt
        # The prompt's end is the anchor checkpoint: the last boundary before each option.
        self._endpoints = tuple(sorted({*endpoints, len(prompt)}))
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._running: dict[int, int] = {}  # sink index -> request id, until its terminal event
        self._next_index = 0
        self.num_cached_tokens = 0  # prompt tokens the options took from the prefix cache, summed

    async def score(self, options: list[tuple[int, ...]]) -> dict[tuple[int, ...], tuple[float, ...]]:
        params = SamplingParams(temperature=0.0, max_tokens=1)
        by_index: dict[int, tuple[int, ...]] = {}
        for ids in options:
            req = GenerateRequest(self._prompt + ids, self._endpoints, params, frozenset(),
                                  score_from=len(self._prompt))
            index = self._next_index
            self._next_index += 1
            self._runtime.submit(req, EventSink(self._loop, self._queue, index))
            self._running[index] = req.request_id
            by_index[index] = ids
        out: dict[tuple[int, ...], tuple[float, ...]] = {}
        while any(i in self._running for i in by_index):
            index, event = await self._queue.get()
            if isinstance(event, ScoredEvent):
                out[by_index[index]] = event.logprobs
            elif isinstance(event, FinishEvent):
                self._running.pop(index, None)
                self.num_cached_tokens += event.num_cached_tokens
                if event.reason == "cancelled":
                    raise AdmissionError("the decision was cancelled", ErrorKind.UNAVAILABLE)
            elif isinstance(event, ErrorEvent):
                self._running.pop(index, None)
                raise event.error
        return out

    def cancel(self) -> None:
        for rid in self._running.values():
            self._runtime.cancel(rid)
        self._running.clear()
