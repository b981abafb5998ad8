"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions.

Handlers parse and validate (openai_schema), prepare the prompt on a frontend
worker, check the context, start a ``Generation`` and format its deltas as
OpenAI JSON or SSE chunks. Usage always carries
``prompt_tokens_details.cached_tokens`` (prefix-cache reuse).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import secrets
import time
from typing import Any

from flared.errors import AdmissionError, CoreError, ErrorKind
from flared.frontend.reasoning import opens_reasoning
from flared.frontend.toolcalls import OutputParser, ParsedDelta, ToolCall
from flared.model.sampling import VLLM_ORDER, SamplingParams
from flared.runtime.request import GenerateRequest, TokenLogprob
from flared.server.generation import Generation
from flared.server.http import Request, Response, ResponseWriter, Router, StreamingResponse
from flared.server.http.messages import ClientDisconnected, error_response
from flared.server.structured import compile_grammar, force_tool_call
from flared.server.openai_schema import (
    ChatRequest, CompletionRequest, SamplingOptions, _bad, _string, json_object, parse_chat, parse_completion,
)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions


def model_card(state) -> dict[str, Any]:
    m = state.manifest
    return {
        "id": m.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "flared",
        "root": m.checkpoint_id,
        "parent": None,
        "max_model_len": m.capacities.context_tokens,
        "aliases": [n for n in m.served_names if n and n != m.model_name],
        # (what this server does with the model: a parser named in the config gives it tools or reasoning that its
        # template alone would not)
        "capabilities": {**m.capabilities, "tools": state.tool_format() is not None,
                         "reasoning": state.reasoning_format() is not None, "vision": state.takes_images,
                         "audio": state.takes_audio, "video": state.takes_video},
    }


def lora_card(state, name: str) -> dict[str, Any]:
    """A per-request LoRA adapter's model card, as vLLM lists one: its root is the adapter's path, its parent the
    served model."""
    return {**model_card(state), "id": name, "root": state.lora_modules[name][1], "parent": state.manifest.model_name,
            "aliases": []}


def names_served_model(manifest, name: str) -> bool:
    """Whether ``name`` names the served model itself (its checkpoint id or a served name)."""
    return name == manifest.checkpoint_id or name in manifest.served_names


def check_model(state, name: str, *, lora_ok: bool = False) -> int:
    """The request's ``lora`` (0: the served model itself) for model ``name``: 404 for a name this server does not
    serve; a per-request LoRA adapter's name (ServerConfig.lora_modules) only where ``lora_ok`` (generation
    routes), else 400."""
    m = state.manifest
    if names_served_model(m, name):
        return 0
    adapter = state.lora_modules.get(name)
    if adapter is not None:
        if lora_ok:
            return adapter[0]
        err = AdmissionError(f"model {name!r} is a LoRA adapter, which serves the generation routes (chat, "
                             f"completions, responses, messages, Ollama's generate and chat); this route runs "
                             f"{m.model_name!r}", ErrorKind.VALIDATION)
    else:
        err = AdmissionError(f"model {name!r} does not exist; this server serves {m.model_name!r}",
                             ErrorKind.NOT_FOUND)
    err.param = "model"
    raise err


def _check_lora_scoring(lora: int, scoring: bool) -> None:
    """Prompt scoring (prompt_logprobs, echoed logprobs) runs the served weights alone: refused for an adapter."""
    if lora and scoring:
        err = AdmissionError("prompt_logprobs and echoed logprobs are not served for a LoRA adapter model yet",
                             ErrorKind.UNSUPPORTED)
        err.param = "prompt_logprobs"
        raise err


def model_body(state, request) -> dict:
    """A request's JSON object whose optional ``model`` must name the served model (404 otherwise)."""
    body = json_object(request)
    model = _string(body, "model")
    if model is not None:
        check_model(state, model)
    return body


def sampling_params(state, opts: SamplingOptions, num_prompt_tokens: int, default_max_tokens: int | None,
                    seed_offset: int) -> SamplingParams:
    m = state.manifest
    context = m.capacities.context_tokens
    room = context - num_prompt_tokens
    if opts.max_tokens is not None:
        max_tokens = opts.max_tokens
        if num_prompt_tokens + max_tokens > context:
            raise AdmissionError(
                f"this model's maximum context length is {context} tokens, but {num_prompt_tokens + max_tokens} "
                f"were requested ({num_prompt_tokens} in the prompt, {max_tokens} for the completion)",
                ErrorKind.CONTEXT_LENGTH, hint=m.context_hint)
    else:
        if room < 1:
            raise AdmissionError(
                f"this model's maximum context length is {context} tokens, but the prompt has "
                f"{num_prompt_tokens} tokens, leaving no room for the completion",
                ErrorKind.CONTEXT_LENGTH, hint=m.context_hint)
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    d = m.generation_defaults
    temperature = opts.temperature if opts.temperature is not None else d.get("temperature", 1.0)
    return SamplingParams(
        temperature=float(temperature),
        top_k=opts.top_k if opts.top_k is not None else int(d.get("top_k", 0)),
        top_p=opts.top_p if opts.top_p is not None else float(d.get("top_p", 1.0)),
        min_p=opts.min_p if opts.min_p is not None else float(d.get("min_p", 0.0)),
        repetition_penalty=opts.repetition_penalty if opts.repetition_penalty is not None
        else float(d.get("repetition_penalty", 1.0)),
        presence_penalty=opts.presence_penalty,
        frequency_penalty=opts.frequency_penalty,
        logit_bias=opts.logit_bias,
        seed=None if opts.seed is None else opts.seed + seed_offset,
        max_tokens=max_tokens,
        logprobs=opts.logprobs,
        typical_p=opts.typical_p if opts.typical_p is not None else float(d.get("typical_p", 1.0)),
        penalty_last_n=opts.penalty_last_n,
        min_tokens=min(opts.min_tokens, max_tokens),
        min_tokens_banned=_stop_ids(state, opts) if opts.min_tokens else frozenset(),
        allowed_token_ids=opts.allowed_token_ids,
        bad_words=bad_word_sequences(state.frontend, opts.bad_words),
        **_thinking_budget(state, opts),
        mirostat=opts.mirostat, mirostat_tau=opts.mirostat_tau, mirostat_eta=opts.mirostat_eta,
        xtc_probability=opts.xtc_probability, xtc_threshold=opts.xtc_threshold,
        **_dry(state, opts, context),
        top_n_sigma=opts.top_n_sigma, dynatemp_range=opts.dynatemp_range, dynatemp_exponent=opts.dynatemp_exponent,
        adaptive_target=opts.adaptive_target, adaptive_decay=opts.adaptive_decay,
        post_sampling_probs=opts.post_sampling_probs,
        # a dynamic temperature runs in the chain: in vLLM's order where the request has no chain of its own
        sampler_order=opts.sampler_order or (VLLM_ORDER if opts.dynatemp_range > 0 else ()),
        **_infill(state, opts),
    )


def _infill(state, opts: SamplingOptions) -> dict[str, Any]:
    """llama.cpp's infill stage: its end-of-generation tokens (the model's end tokens and the request's stop
    tokens), the model's first end token as its end-of-text, and every token's text."""
    if "infill" not in opts.sampler_order:
        return {}
    eos = tuple(state.manifest.tokens.eos_token_ids)
    if not eos:
        raise _bad("samplers", "the infill sampler needs an end-of-text token, and this model has none")
    return {"infill_eog": frozenset(eos) | _stop_ids(state, opts, fim=True), "infill_eot": eos[0],
            "token_pieces": token_pieces(state.frontend, state.vocab_size)}


@functools.lru_cache(maxsize=4)
def token_pieces(fe, vocab_size: int) -> tuple[bytes, ...]:
    """Every token's text as llama.cpp's token_to_piece gives it without special tokens: the bytes it stands for
    (a byte-level BPE token through the byte alphabet; a SentencePiece one with its word marks as spaces and
    <0xNN> as that byte), b"" for special tokens and ids past the tokenizer."""
    spec = json.loads(fe.tokenizer.to_str())
    special = {e["id"] for e in spec.get("added_tokens", ()) if e.get("special")}
    table = fe.token_bytes
    out = []
    for t in range(vocab_size):
        if t in special:
            out.append(b"")
        elif table is not None:
            out.append(table.table[t] if t < len(table.table) else b"")
        else:
            piece = fe.tokenizer.id_to_token(t)
            if piece is None:
                out.append(b"")
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                out.append(bytes([int(piece[3:5], 16)]))
            else:
                out.append(piece.replace("\u2581", " ").encode("utf-8"))
    return tuple(out)


def _dry(state, opts: SamplingOptions, context: int) -> dict[str, Any]:
    if not opts.uses_dry:
        return {}
    return {"dry_multiplier": opts.dry_multiplier, "dry_base": opts.dry_base,
            "dry_allowed_length": opts.dry_allowed_length,
            "dry_penalty_last_n": 0 if opts.dry_penalty_last_n == -1 else min(opts.dry_penalty_last_n, context),
            **dry_sequences(state.frontend, state.vocab_size, opts.dry_sequence_breakers)}


async def prepare_samplers(state, opts: SamplingOptions) -> None:
    """Finding DRY's breaker tokens and the infill stage's token texts read every token's text (tens of
    milliseconds, once per breaker set or model): done on a frontend worker before sampling_params needs them, not on
    the event loop."""
    if opts.uses_dry:
        await state._in_pool(lambda: dry_sequences(state.frontend, state.vocab_size, opts.dry_sequence_breakers))
    if "infill" in opts.sampler_order:
        await state._in_pool(lambda: token_pieces(state.frontend, state.vocab_size))


@functools.lru_cache(maxsize=4)
def _token_texts(fe, vocab_size: int) -> tuple[str, ...]:
    """Every token's text (special tokens' too; '' past the tokenizer's ids), once per frontend (SmolLM2's 49k
    tokens: ~70 ms)."""
    return tuple(fe.tokenizer.decode_batch([[t] for t in range(vocab_size)], skip_special_tokens=False))


DRY_BREAKER_CHARS = 40  # llama.cpp's: longer breakers are cut to this many characters
DRY_TAIL_TOKENS = 20  # and a restart sequence's tail to this many tokens


@functools.lru_cache(maxsize=16)
def dry_sequences(fe, vocab_size: int, breakers: tuple[str, ...]) -> dict[str, Any]:
    """DRY's sequence breakers in tokens, as llama.cpp finds them: every token whose text contains a breaker is
    one (``dry_breakers``); a token whose text ends with the start of a breaker heads a restart sequence, its
    tail the tokenization of the breaker's rest (``dry_restarts``: (head, tail) pairs, one per distinct tail)."""
    singles: set[int] = set()
    restarts: dict[tuple[int, tuple[int, ...]], None] = {}  # ordered, without duplicates
    tails: dict[str, tuple[int, ...]] = {}
    cut = [b[:DRY_BREAKER_CHARS] for b in breakers]
    for t, text in enumerate(_token_texts(fe, vocab_size)):
        for b in cut:
            if b in text:
                singles.add(t)
                continue
            pos = text.find(b[0])
            while pos != -1:  # the text's end from pos begins b (and is shorter: b is not in the text)
                if b.startswith(text[pos:]):
                    rest = b[len(text) - pos:]
                    if rest not in tails:
                        tails[rest] = tuple(fe.tokenizer.encode(rest, add_special_tokens=False).ids[:DRY_TAIL_TOKENS])
                    if tails[rest]:
                        restarts[(t, tails[rest])] = None
                    else:  # nothing to follow (llama.cpp: an empty tail makes the token a breaker)
                        singles.add(t)
                pos = text.find(b[0], pos + 1)
    return {"dry_breakers": frozenset(singles), "dry_restarts": tuple(restarts)}


def _thinking_budget(state, opts: SamplingOptions) -> dict[str, Any]:
    """A thinking budget needs the reasoning format's end marker as one token; where the template has no
    reasoning format, or spells its end in several tokens, there is nothing to enforce."""
    fmt = state.reasoning_format() if opts.thinking_budget is not None else None
    start, end = _marker_ids(state.frontend, fmt.start, fmt.end) if fmt is not None else (None, None)
    if end is None:
        return {}
    return {"thinking_budget": opts.thinking_budget, "thinking_end": end, "thinking_start": start}


@functools.lru_cache(maxsize=16)
def _marker_ids(fe, start: str, end: str) -> tuple[int | None, int | None]:
    """The reasoning markers' token ids, where each is one token."""
    ids = [fe.encode(marker) for marker in (start, end)]
    return tuple(t[0] if len(t) == 1 else None for t in ids)


@functools.lru_cache(maxsize=256)  # sampling_params runs once per choice: tokenize a request's words once
def bad_word_sequences(fe, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token sequences: each word as it would start the text, and as a new word after a
    space where the space joins the word's first token (vLLM takes that spelling only when it has as many
    tokens; here also when the space merges it into fewer, as " la" may be one token where "la" is two)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(fe.encode(word.lstrip()))
        spaced = tuple(fe.encode(" " + word.lstrip()))
        out.append(alone)
        if spaced and alone and spaced[0] != alone[0] and len(spaced) <= len(alone):
            out.append(spaced)
    return tuple(seq for seq in dict.fromkeys(out) if seq)


def _stop_ids(state, opts: SamplingOptions, fim: bool = False) -> frozenset[int]:
    """The request's stop tokens: its own, the model's end tokens (unless ignore_eos) and, for a fill in the middle
    (``fim``), the tokens that end a fill (FimTokens.ends)."""
    ids = set(opts.stop_token_ids)
    if not opts.ignore_eos:
        ids.update(state.manifest.tokens.eos_token_ids)
        if fim and state.fim is not None:
            ids.update(state.fim.ends)
    return frozenset(ids)


def _check_vocab(state, opts: SamplingOptions) -> None:
    vocab = state.vocab_size
    for field, ids in (("stop_token_ids", opts.stop_token_ids), ("logit_bias", tuple(opts.logit_bias or ())),
                       ("allowed_token_ids", opts.allowed_token_ids or ())):
        for t in ids:
            if not 0 <= t < vocab:
                err = AdmissionError(f"'{field}': token id {t} is outside the vocabulary of {vocab}")
                err.param = field
                raise err


def _audio_tokens(gen: Generation, audio_token: int) -> int | None:
    """The prompt's clip tokens (``audio_token``'s: an audio model's; -1: none), counted once a response: the
    choices share one prompt; its images' and videos' tokens are not counted. None: no audio model, or no media."""
    vision = gen.request(0).vision if audio_token >= 0 and gen.num_choices else None
    if vision is None:
        return None
    ids = gen.request(0).prompt_token_ids
    return sum(1 for p in vision.positions if ids[p] == audio_token)


def _usage(gen: Generation, audio_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage of a response; ``audio_tokens`` (``_audio_tokens``): its prompt's clip tokens, as
    ``prompt_tokens_details.audio_tokens`` (as OpenAI's audio models report them; None: not reported)."""
    u = gen.usage()
    out = {
        "prompt_tokens": u.num_prompt_tokens,
        "completion_tokens": u.num_generated_tokens,
        "total_tokens": u.num_prompt_tokens + u.num_generated_tokens,
        "prompt_tokens_details": {"cached_tokens": u.num_cached_tokens},
    }
    if audio_tokens is not None:
        out["prompt_tokens_details"]["audio_tokens"] = audio_tokens
    if any(gen.request(i).prediction for i in range(gen.num_choices)):
        # a predicted output: the draft tokens speculative decoding took from it (looked up there first) and kept,
        # and those it computed and dropped (0 and 0 with speculation off: the prediction then changes nothing)
        out["completion_tokens_details"] = {"accepted_prediction_tokens": u.num_accepted_drafts,
                                            "rejected_prediction_tokens": u.num_drafted - u.num_accepted_drafts}
    return out


def token_logprobs(fe, lps: list[TokenLogprob], *, as_ids: bool = False) -> list[dict[str, Any]]:
    """Per token ``{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}``: chat completions'
    ``logprobs.content`` and Ollama's ``logprobs`` alike (``as_ids``: tokens named "token_id:N", vLLM's
    return_tokens_as_token_ids)."""
    out = []
    for lp in lps:
        tok = token_name(fe, lp.token_id, as_ids)
        out.append({
            "token": tok, "logprob": lp.logprob, "bytes": list(tok.encode("utf-8")),
            "top_logprobs": [{"token": (t := token_name(fe, tid, as_ids)), "logprob": v,
                              "bytes": list(t.encode("utf-8"))} for tid, v in lp.top],
        })
    return out


def token_name(fe, token_id: int, as_ids: bool = False) -> str:
    """How logprobs name a token: its text, or "token_id:N" (vLLM's return_tokens_as_token_ids, for tokens
    whose text alone is ambiguous or not valid UTF-8)."""
    return f"token_id:{token_id}" if as_ids else fe.decode([token_id])


def vllm_prompt_logprobs(fe, ids, scored, k: int, as_ids: bool = False) -> list:
    """vLLM's ``prompt_logprobs``: None for the first token, then per token ``{id: {logprob, rank,
    decoded_token}}`` for the token itself and the ``k`` most likely there."""
    out: list = [None]
    for token, (lp, top, rank) in zip(ids[1:], scored):
        entry = {str(token): {"logprob": lp, "rank": rank, "decoded_token": token_name(fe, token, as_ids)}}
        for r, (t, v) in enumerate(top[:k], start=1):
            entry.setdefault(str(t), {"logprob": v, "rank": r, "decoded_token": token_name(fe, t, as_ids)})
        out.append(entry)
    return out


def truncated(prompt: tuple[int, ...], opts: SamplingOptions, context: int) -> tuple[int, ...]:
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: as many as the context holds)."""
    k = opts.truncate_prompt_tokens
    if k is None:
        return prompt
    k = context if k == -1 else k
    return prompt[-k:] if len(prompt) > k else prompt


def check_prompt_fits(state, prompts) -> None:
    """A prompt that is only scored (echoed logprobs, prompt_logprobs) must still fit the context."""
    context = state.manifest.capacities.context_tokens
    for ids in prompts:
        if len(ids) > context:
            err = AdmissionError(f"'prompt': {len(ids)} tokens; this model's context holds {context}",
                                 ErrorKind.CONTEXT_LENGTH)
            err.param = "prompt"
            raise err


class OutputShape:
    """How a request's generated text splits into reasoning, content and tool calls.

    Chosen once per request from the chat template (or the config's override)
    and the rendered prompt (a prompt that ends inside ``<think>`` starts the
    output inside the reasoning). Every chat-shaped route (chat completions,
    Messages, Responses, Ollama, systemone) uses it, one ``OutputParser`` per
    choice."""

    def __init__(self, state, prompt_text: str, tools: list[dict] | None, *, field: str = "tools",
                 reasoning: bool = True, template=None):
        self.tools = tools
        self.tool_cls = state.tool_format(template) if tools else None
        if tools and self.tool_cls is None:
            err = AdmissionError(f"'{field}': this model's chat template has no tool-call format this server "
                                 "can parse (set tool_parser in the config to name one)", ErrorKind.UNSUPPORTED)
            err.param = field
            raise err
        self.reasoning = state.reasoning_format(template) if reasoning else None
        self.starts_inside = opens_reasoning(prompt_text, self.reasoning)

    @property
    def skip_special_tokens(self) -> bool:
        return not ((self.tool_cls is not None and self.tool_cls.needs_special_tokens)
                    or (self.reasoning is not None and self.reasoning.needs_special_tokens))

    @property
    def active(self) -> bool:
        return self.tool_cls is not None or self.reasoning is not None

    def parser(self) -> OutputParser:
        return OutputParser(self.tool_cls(self.tools) if self.tool_cls is not None else None, self.reasoning,
                            starts_inside=self.starts_inside)

    def parse(self, text: str) -> tuple[ParsedDelta, list[ToolCall]]:
        if not self.active:
            return ParsedDelta(text), []
        p = self.parser()
        return p.parse(text), p.calls


def _best(results: list, n: int) -> list:
    """best_of's choice: the n completions whose tokens have the highest mean logprob, best first (one without
    tokens last)."""
    def score(r) -> float:
        lps = r[2]
        return sum(lp.logprob for lp in lps) / len(lps) if lps else float("-inf")
    return sorted(results, key=score, reverse=True)[:n]


def finish_with_calls(finish: str | None, calls, legacy: bool = False) -> str | None:
    """OpenAI's finish reason: a choice that stopped after emitting tool calls ended for them ("function_call"
    where the request sent the deprecated ``functions``)."""
    return ("function_call" if legacy else "tool_calls") if calls and finish == "stop" else finish


def openai_tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


def _base_request_id(req, request: Request) -> str:
    """The answer's id after its prefix, as vLLM's: the body's ``request_id``, else the client's X-Request-Id
    header, else a random one."""
    if req.extras.request_id:
        return req.extras.request_id
    if request.request_id is not None:
        return request.request_id.decode("ascii")
    return secrets.token_hex(12)


class OpenAIRoutes:
    def __init__(self, state):
        self.state = state

    def register(self, router: Router) -> None:
        router.add("GET", "/v1/models", self.list_models)
        router.add("GET", "/v1/models/{model:path}", self.get_model)
        router.add("POST", "/v1/load_lora_adapter", self.load_lora_adapter)
        router.add("POST", "/v1/unload_lora_adapter", self.unload_lora_adapter)
        router.add("POST", "/v1/chat/completions", self.chat_completions, admit=True)
        router.add("POST", "/v1/completions", self.completions, admit=True)

    def _lora_updates(self, request: Request) -> tuple[dict, str]:
        """The body of a load or unload request and the adapter name it gives (400 while runtime updating is
        off)."""
        if not self.state.runtime_lora_updating:
            raise AdmissionError("loading and unloading LoRA adapters while serving is off: start the server with "
                                 "--allow-runtime-lora-updating (config runtime_lora_updating)", ErrorKind.VALIDATION)
        body = json_object(request)
        name = _string(body, "lora_name", required=True)
        if not name:
            raise _bad("lora_name", "must be a non-empty string")
        return body, name

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's runtime adapter loading: {lora_name, lora_path} becomes a model of that name (per request, as
        --lora-modules). The answer is vLLM's plain-text line."""
        body, name = self._lora_updates(request)
        path = _string(body, "lora_path", required=True)
        if name in self.state.lora_modules or names_served_model(self.state.manifest, name):
            raise _bad("lora_name", f"the name {name!r} is taken (a loaded adapter or the served model)")
        try:  # a path that is no adapter directory is a CoreError too (lora.read_adapter checks it first)
            index = await self.state._in_pool(lambda: self.state.runtime.add_lora_module(name, path))
        except (CoreError, OSError) as e:  # the adapter does not fit this model, or its files went: the client's
            raise _bad("lora_path", str(e)) from None
        self.state.lora_modules[name] = (index, path)
        return Response(f"Success: LoRA adapter '{name}' added successfully.".encode(), media_type="text/plain")

    async def unload_lora_adapter(self, request: Request) -> Response:
        _, name = self._lora_updates(request)
        entry = self.state.lora_modules.pop(name, None)
        if entry is None:
            err = AdmissionError(f"the LoRA adapter {name!r} cannot be found", ErrorKind.NOT_FOUND)
            err.param = "lora_name"
            raise err
        self.state.runtime.remove_lora_module(entry[0])
        return Response(f"Success: LoRA adapter '{name}' removed successfully.".encode(), media_type="text/plain")

    async def list_models(self, request: Request) -> Response:
        cards = [model_card(self.state)] + [lora_card(self.state, name) for name in self.state.lora_modules]
        return Response.json({"object": "list", "data": cards})

    async def get_model(self, request: Request) -> Response:
        name = request.params["model"]
        if check_model(self.state, name, lora_ok=True):
            return Response.json(lora_card(self.state, name))
        return Response.json(model_card(self.state))

    # -- chat ----------------------------------------------------------------------------------

    async def chat_completions(self, request: Request):
        req = parse_chat(request.json())
        lora = check_model(self.state, req.model, lora_ok=True)
        _check_vocab(self.state, req.options)
        _check_lora_scoring(lora, req.options.prompt_logprobs is not None)
        template = self.state.request_template(req.chat_template)
        rendered = await self.state.prepare_chat(
            req.messages, tools=req.tools, documents=req.documents, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, add_special_tokens=req.add_special_tokens,
            template=template, media_options=req.media_options, **req.template_kwargs)
        # A forced call needs no tool format in the template: the grammar produces it (force_tool_call).
        shape = OutputShape(self.state, rendered.text, None if req.forced_tool else req.tools, template=template,
                            field="functions" if req.legacy_functions else "tools")
        opts = req.options
        prompt = truncated(tuple(rendered.token_ids), opts, self.state.manifest.capacities.context_tokens)
        cut = len(rendered.token_ids) - len(prompt)
        endpoints = tuple(e - cut for e in rendered.message_endpoints if e > cut)
        if rendered.images and opts.prompt_logprobs is not None:
            raise _bad("prompt_logprobs", "is not supported for prompts with images")
        vision = await self.state.vision_input(rendered, cut=cut)
        prompt_lps = None
        if opts.prompt_logprobs is not None:
            check_prompt_fits(self.state, [prompt])
            scored = await self.state.prompt_logprobs(prompt, opts.prompt_logprobs)
            prompt_lps = await self.state._in_pool(lambda: vllm_prompt_logprobs(
                self.state.frontend, prompt, scored, opts.prompt_logprobs, opts.return_tokens_as_token_ids))
        spec = req.response_format
        if req.forced_tool is not None:
            spec = force_tool_call(shape, req.tools, req.forced_tool)
        grammar = await compile_grammar(self.state, spec)
        await prepare_samplers(self.state, opts)
        prediction = ()
        if req.prediction:
            text = req.prediction
            ids = await self.state._in_pool(lambda: self.state.frontend.encode(text))
            # (no answer outgrows the context: a longer prediction would only slow each step's lookup)
            prediction = tuple(ids[:self.state.manifest.capacities.context_tokens])
        requests = [
            GenerateRequest(prompt_token_ids=prompt, message_endpoints=endpoints,
                            params=sampling_params(self.state, opts, len(prompt), None, i),
                            stop_token_ids=_stop_ids(self.state, opts), grammar=grammar,
                            cache_salt=req.extras.cache_salt, priority=req.extras.priority, lora=lora,
                            prediction=prediction, vision=vision)
            for i in range(opts.n)]
        gen = self.state.start(requests, opts.stop, skip_special_tokens=shape.skip_special_tokens
                               and opts.skip_special_tokens, include_stop_str=opts.include_stop_str_in_output)
        request.disconnected.add_callback(gen.cancel)
        rid = "chatcmpl-" + _base_request_id(req, request)
        # vLLM's echo: an answer that continues the assistant's last message starts with it
        last = req.messages[-1]
        echo = (last.get("content") or "") if req.echo and last["role"] == "assistant" else ""
        if isinstance(echo, list):  # an assistant message with images: its text
            echo = "".join(p["text"] for p in echo if p.get("type") == "text")
        if req.stream:
            return StreamingResponse(lambda w: self._stream_chat(gen, w, req, rid, shape, prompt, echo),
                                     headers=[("cache-control", "no-cache")])
        results = await gen.collect()
        choices = []
        for i, (text, ids, lps, finish) in enumerate(results):
            parsed, calls = shape.parse(text)
            content = echo + parsed.content if echo else parsed.content
            message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
            if shape.reasoning is not None:
                # reasoning_content (vLLM, DeepSeek) and reasoning (newer clients) carry the same text
                message["reasoning_content"] = message["reasoning"] = parsed.reasoning or None
            if calls and req.legacy_functions:  # the deprecated shape: one call, no id
                message["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
            elif calls:
                message["tool_calls"] = openai_tool_calls(calls)
            choices.append({
                "index": i,
                "message": message,
                "logprobs": {"content": token_logprobs(self.state.frontend, lps,
                                                       as_ids=opts.return_tokens_as_token_ids)}
                if opts.logprobs is not None else None,
                "finish_reason": finish_with_calls(finish, calls, req.legacy_functions),
                **({"token_ids": ids} if req.extras.return_token_ids else {}),
            })
        body = {"id": rid, "object": "chat.completion", "created": gen.created, "model": req.model,
                "choices": choices,
                "usage": _usage(gen, _audio_tokens(gen, self.state.usage_audio_token))}
        if prompt_lps is not None:
            body["prompt_logprobs"] = prompt_lps
        if req.extras.return_token_ids:
            body["prompt_token_ids"] = list(prompt)
        return Response.json(body)

    async def _stream_chat(self, gen: Generation, w: ResponseWriter, req: ChatRequest, rid: str,
                           shape: OutputShape, prompt: tuple[int, ...], echo: str) -> None:
        base = {"id": rid, "object": "chat.completion.chunk", "created": gen.created, "model": req.model}
        extras = req.extras
        audio_tokens = _audio_tokens(gen, self.state.usage_audio_token)  # (once, not each chunk)
        usage = _chunk_usage(gen, req.include_usage, extras, audio_tokens)
        parsers = [shape.parser() for _ in range(gen.num_choices)] if shape.active else None
        try:
            for i in range(gen.num_choices):
                first = {**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": echo},
                                              "logprobs": None, "finish_reason": None}], **usage()}
                if extras.return_token_ids:
                    first["prompt_token_ids"] = list(prompt)
                await w.send_json_event(first)
            async for d in gen.deltas():
                if (not d.text and d.finish_reason is None and not d.logprobs
                        and not (extras.return_token_ids and d.token_ids)):
                    continue
                finish = d.finish_reason
                if parsers is None:
                    delta: dict[str, Any] = {"content": d.text} if d.text or d.finish_reason is None else {}
                else:
                    p = parsers[d.index]
                    parsed = p.push(d.text) if d.text else ParsedDelta()
                    if finish is not None:
                        tail = p.finish()
                        parsed = ParsedDelta(parsed.content + tail.content, parsed.calls + tail.calls,
                                             parsed.reasoning + tail.reasoning)
                        finish = finish_with_calls(finish, p.calls, req.legacy_functions)
                    delta = self._chat_delta(parsed, req.legacy_functions)
                    if (not delta and finish is None and not d.logprobs
                            and not (extras.return_token_ids and d.token_ids)):
                        continue
                choice = {"index": d.index, "delta": delta,
                          "logprobs": {"content": token_logprobs(self.state.frontend, d.logprobs,
                                                                 as_ids=req.options.return_tokens_as_token_ids)}
                          if req.options.logprobs is not None and d.logprobs else None,
                          "finish_reason": finish}
                if extras.return_token_ids:
                    choice["token_ids"] = d.token_ids
                await w.send_json_event({**base, "choices": [choice], **usage()})
            if req.include_usage:
                await w.send_json_event({**base, "choices": [], "usage": _usage(gen, audio_tokens)})
            await w.send_event("[DONE]")
        except ClientDisconnected:
            gen.cancel()
        except Exception as exc:  # the stream has started: report in-band, then end it
            gen.cancel()
            await _send_stream_error(w, exc)

    @staticmethod
    def _chat_delta(parsed: ParsedDelta, legacy: bool = False) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if parsed.reasoning:
            delta["reasoning_content"] = delta["reasoning"] = parsed.reasoning
        if parsed.content:
            delta["content"] = parsed.content
        if parsed.calls and legacy:  # the deprecated shape: the first call's name, then its arguments
            for c in parsed.calls:
                if c.index == 0:
                    fn = delta.setdefault("function_call", {})
                    if c.id is not None:
                        fn["name"] = c.name
                    fn["arguments"] = fn.get("arguments", "") + c.arguments
        elif parsed.calls:
            calls = []
            for c in parsed.calls:
                call: dict[str, Any] = {"index": c.index}
                fn: dict[str, Any] = {"arguments": c.arguments}
                if c.id is not None:
                    call["id"], call["type"] = c.id, "function"
                    fn["name"] = c.name
                call["function"] = fn
                calls.append(call)
            delta["tool_calls"] = calls
        return delta

    # -- completions ---------------------------------------------------------------------------

    async def completions(self, request: Request):
        req = parse_completion(request.json())
        lora = check_model(self.state, req.model, lora_ok=True)
        _check_vocab(self.state, req.options)
        _check_lora_scoring(lora, req.options.prompt_logprobs is not None
                            or (req.echo and req.options.logprobs is not None))
        opts = req.options
        prompts: list[tuple[int, ...]] = []
        texts: list[str] = []
        for p in req.prompts:
            if req.suffix is not None:  # fill in the middle: the model's FIM tokens around prefix and suffix
                ids = await self.state.fim_prompt(p, req.suffix)
                texts.append(p)
            elif isinstance(p, str):
                ids = await self.state.encode(p)
                texts.append(p)
            else:
                for t in p:
                    if not 0 <= t < self.state.vocab_size:
                        raise AdmissionError(f"'prompt': token id {t} is outside the vocabulary")
                ids = list(p)
                texts.append(self.state.frontend.decode(ids))
            if not ids:
                raise AdmissionError("'prompt': the prompt is empty")
            full = tuple(ids)
            ids = truncated(full, opts, self.state.manifest.capacities.context_tokens)
            if len(ids) < len(full) and req.echo:  # echo what the model saw
                texts[-1] = self.state.frontend.decode(list(ids))
            prompts.append(ids)
        n = opts.n
        rid = "cmpl-" + _base_request_id(req, request)
        echo = [texts[i // n] if req.echo else "" for i in range(len(prompts) * n)]
        # echo with logprobs: the prompt's own tokens lead the logprobs (the first without a value, as OpenAI's);
        # vLLM's prompt_logprobs: each choice carries its prompt's. One scoring pass serves both.
        echo_scored = req.echo and opts.logprobs is not None
        scored = [None] * len(prompts)
        if echo_scored or opts.prompt_logprobs is not None:
            check_prompt_fits(self.state, prompts)
            top = max(opts.logprobs or 0, opts.prompt_logprobs or 0)
            scored = await asyncio.gather(*(self.state.prompt_logprobs(ids, top) for ids in prompts))
        as_ids = opts.return_tokens_as_token_ids
        echo_part, vllm_part = [], []  # each prompt's token texts (thousands, for a long one) made on a worker
        for ids, s in zip(prompts, scored):
            echo_part.append(await self.state._in_pool(lambda ids=ids, s=s: self._prompt_logprobs(ids, s, opts))
                             if echo_scored else None)
            vllm_part.append(await self.state._in_pool(lambda ids=ids, s=s: vllm_prompt_logprobs(
                self.state.frontend, ids, s, opts.prompt_logprobs, as_ids)) if opts.prompt_logprobs is not None
                else None)
        prompt_lps = [echo_part[i // n] for i in range(len(prompts) * n)]
        vllm_lps = [vllm_part[i // n] for i in range(len(prompts) * n)]
        if req.score_only:
            return self._scored_only(req, rid, prompts, echo, prompt_lps, vllm_lps)
        grammar = await compile_grammar(self.state, req.response_format)
        await prepare_samplers(self.state, req.options)
        # best_of > n: best_of completions a prompt, ranked by their tokens' mean logprob (kept for that even where
        # the request asks for none)
        k = req.best_of
        made = req.options if k == n or opts.logprobs is not None else dataclasses.replace(req.options, logprobs=0)
        requests = []
        for pi, ids in enumerate(prompts):
            for j in range(k):
                requests.append(GenerateRequest(
                    ids, (), sampling_params(self.state, made, len(ids), COMPLETIONS_DEFAULT_MAX_TOKENS, pi * k + j),
                    _stop_ids(self.state, req.options, fim=req.suffix is not None), grammar=grammar,
                    cache_salt=req.extras.cache_salt,
                    priority=req.extras.priority, lora=lora))
        gen = self.state.start(requests, opts.stop, skip_special_tokens=opts.skip_special_tokens,
                               include_stop_str=opts.include_stop_str_in_output)
        request.disconnected.add_callback(gen.cancel)
        if req.stream:
            return StreamingResponse(lambda w: self._stream_completion(gen, w, req, rid, echo, prompt_lps),
                                     headers=[("cache-control", "no-cache")])
        results = await gen.collect()
        if k > n:
            results = [r for pi in range(len(prompts)) for r in _best(results[pi * k:(pi + 1) * k], n)]
        choices = []
        for i, (text, ids, lps, finish) in enumerate(results):
            logprobs = None
            if opts.logprobs is not None:
                logprobs = _joined(prompt_lps[i], self._completion_logprobs(lps, len(echo[i]), as_ids))
            choice = {"index": i, "text": echo[i] + text, "logprobs": logprobs, "finish_reason": finish}
            if vllm_lps[i] is not None:
                choice["prompt_logprobs"] = vllm_lps[i]
            if req.extras.return_token_ids:
                choice["prompt_token_ids"], choice["token_ids"] = list(prompts[i // n]), ids
            choices.append(choice)
        return Response.json({"id": rid, "object": "text_completion", "created": gen.created,
                              "model": req.model, "choices": choices, "usage": _usage(gen)})

    def _scored_only(self, req: CompletionRequest, rid: str, prompts, echo: list[str], prompt_lps,
                     vllm_lps) -> Response:
        """echo with max_tokens 0: the prompts back with their logprobs, nothing generated."""
        n = req.options.n
        choices = [{"index": i, "text": echo[i], "logprobs": prompt_lps[i], "finish_reason": "length",
                    **({"prompt_logprobs": vllm_lps[i]} if vllm_lps[i] is not None else {}),
                    **({"prompt_token_ids": list(prompts[i // n]), "token_ids": []}
                       if req.extras.return_token_ids else {})}
                   for i in range(len(echo))]
        prompt_tokens = sum(len(ids) for ids in prompts) * n
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        created = int(time.time())
        if not req.stream:
            return Response.json({"id": rid, "object": "text_completion", "created": created, "model": req.model,
                                  "choices": choices, "usage": usage})
        base = {"id": rid, "object": "text_completion", "created": created, "model": req.model}

        async def stream(w: ResponseWriter) -> None:
            for c in choices:
                await w.send_json_event({**base, "choices": [c], **({"usage": None} if req.include_usage else {})})
            if req.include_usage:
                await w.send_json_event({**base, "choices": [], "usage": usage})
            await w.send_event("[DONE]")
        return StreamingResponse(stream, headers=[("cache-control", "no-cache")])

    def _prompt_logprobs(self, ids, scored, opts: SamplingOptions) -> dict[str, Any]:
        """The prompt's part of a completion's legacy logprobs: every prompt token, the first with no value."""
        fe, as_ids, k = self.state.frontend, opts.return_tokens_as_token_ids, opts.logprobs
        tokens = [token_name(fe, t, as_ids) for t in ids]
        offsets, offset = [], 0
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": [None] + [lp for lp, _, _ in scored],
                "top_logprobs": [None] + [{token_name(fe, t, as_ids): v for t, v in top[:k]} if k else None
                                          for _, top, _ in scored],
                "text_offset": offsets}

    async def _stream_completion(self, gen: Generation, w: ResponseWriter, req: CompletionRequest, rid: str,
                                 echo: list[str], prompt_lps: list) -> None:
        base = {"id": rid, "object": "text_completion", "created": gen.created, "model": req.model}
        extras = req.extras
        usage = _chunk_usage(gen, req.include_usage, extras)
        offsets = [len(e) for e in echo]
        # return_token_ids: a choice's first chunk carries its prompt's ids, every chunk its new tokens' ids
        prompt_ids = ([list(gen.request(i).prompt_token_ids) for i in range(gen.num_choices)]
                      if extras.return_token_ids else None)
        try:
            for i, e in enumerate(echo):
                if e or prompt_ids is not None:
                    c = {"index": i, "text": e, "logprobs": prompt_lps[i], "finish_reason": None}
                    if prompt_ids is not None:
                        c["prompt_token_ids"], c["token_ids"] = prompt_ids[i], []
                    await w.send_json_event({**base, "choices": [c], **usage()})
            async for d in gen.deltas():
                if not d.text and d.finish_reason is None and not d.logprobs and not (prompt_ids and d.token_ids):
                    continue
                lp = None
                if req.options.logprobs is not None and d.logprobs:
                    lp = self._completion_logprobs(d.logprobs, offsets[d.index], req.options.return_tokens_as_token_ids)
                offsets[d.index] += len(d.text)
                c = {"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}
                if prompt_ids is not None:
                    c["token_ids"] = d.token_ids
                await w.send_json_event({**base, "choices": [c], **usage()})
            if req.include_usage:
                await w.send_json_event({**base, "choices": [], "usage": _usage(gen)})
            await w.send_event("[DONE]")
        except ClientDisconnected:
            gen.cancel()
        except Exception as exc:
            gen.cancel()
            await _send_stream_error(w, exc)

    def _completion_logprobs(self, lps: list[TokenLogprob], start_offset: int, as_ids: bool = False
                             ) -> dict[str, Any]:
        fe = self.state.frontend
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = start_offset
        for lp in lps:
            tok = token_name(fe, lp.token_id, as_ids)
            tokens.append(tok)
            token_lps.append(lp.logprob)
            tops.append({token_name(fe, tid, as_ids): v for tid, v in lp.top} if lp.top else None)
            offsets.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chunk_usage(gen: Generation, include_usage: bool, extras, audio_tokens: int | None = None):
    """A stream chunk's usage field: none, null (include_usage: the totals come last), or the counts so far
    (vLLM's continuous_usage_stats)."""
    if extras.continuous_usage:
        return lambda: {"usage": _usage(gen, audio_tokens)}
    null = {"usage": None} if include_usage else {}
    return lambda: null


def _joined(first: dict | None, second: dict) -> dict:
    """Two spans of legacy completion logprobs (the echoed prompt's, then the generated text's) as one."""
    if first is None:
        return second
    return {k: first[k] + second[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


async def _send_stream_error(w: ResponseWriter, exc: BaseException) -> None:
    """An SSE stream that fails after it started ends with an error event, then [DONE]."""
    resp = error_response(exc)
    try:
        await w.send_event(resp.body.decode())
        await w.send_event("[DONE]")
    except ClientDisconnected:
        pass

