"""llama.cpp server's own routes: POST /completion (also /completions), GET /props and GET /slots.

What llama.cpp's clients call outside its OpenAI-compatible API, translated onto the one generation path.

/completion takes ``prompt`` (text, with the model's BOS where it takes one; or a token-id array, where strings may
stand between the ids; or, as llama.cpp, several prompts: an array of strings, or an array whose items are strings
or token arrays, at most 16, each completed on its own, answered as an array in prompt order when there is more than
one, streamed with each chunk's ``index``; ``n_cmpl`` completions a prompt), ``n_predict`` (-1, the default: until
the context ends; 0: nothing generated), ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``typical_p``, ``seed``,
``repeat_penalty``, ``presence_penalty`` and ``frequency_penalty`` (over the last ``repeat_last_n`` tokens, default
64, prompt included, as llama.cpp), ``stop``, ``ignore_eos``, ``logit_bias`` (``[[id, bias], ...]``, ``false`` bans
a token, or ``{"id": bias}``), ``n_probs`` (alternatives per token, 0-20), ``grammar`` (GBNF) or ``json_schema``,
``return_tokens`` and ``stream``; ``mirostat`` (1, 2) with ``mirostat_tau`` and ``mirostat_eta``,
``xtc_probability`` and ``xtc_threshold``, ``dry_multiplier``, ``dry_base``, ``dry_allowed_length``,
``dry_penalty_last_n`` and ``dry_sequence_breakers``, ``top_n_sigma`` (flared.model.sampling); for code completion
``n_indent`` and ``t_max_predict_ms`` (_CodeLimits), the chain's ``infill`` stage and ``response_fields`` (only
those paths answered, as llama.vim asks). Omitted sampling fields take the model's defaults, as the OpenAI routes
do. The sampler runs llama.cpp's chain (SamplingParams.sampler_order): its default order, every filter at
temperature 1 and the temperature last, or the request's own ``samplers`` (names, or llama.cpp's letters such as
``"kypmxt"``); a chain without ``penalties`` or ``dry`` turns those off, and where they are listed they run first.
Fields for the slots (``id_slot``, ``cache_prompt``, ...) are accepted and ignored: the prefix cache is always on.

It answers llama.cpp's shape: ``content``, ``stop``, ``stop_type`` (``eos``, ``limit``, ``word`` with
``stopping_word``), ``tokens_predicted``, ``tokens_evaluated``, ``tokens_cached``, ``timings`` (ms and tokens
per second), ``generation_settings``, ``completion_probabilities`` when ``n_probs`` > 0. Streamed, SSE
``data:`` chunks carry ``content`` pieces with ``stop: false`` and the last one the whole summary with
``stop: true`` (no ``[DONE]``, as llama.cpp).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any

from flared.errors import AdmissionError, ErrorKind
from flared.model.sampling import LLAMA_CPP_ORDER, SAMPLER_STAGES, VLLM_ORDER
from flared.runtime.request import GenerateRequest, TokenLogprob
from flared.server.generation import Generation
from flared.server.http import Request, Response, ResponseWriter, Router, StreamingResponse
from flared.server.http.messages import ClientDisconnected, HttpError, error_response
from flared.server.openai_routes import _check_vocab, _stop_ids, prepare_samplers, sampling_params
from flared.server.openai_schema import (MAX_N, MAX_TOP_LOGPROBS, SamplingOptions, _bad, _boolean, _integer,
                                         _number, _string, _type, json_object, llama_penalties, llama_samplers)
from flared.server.structured import compile_grammar, parse_extra_constraints


# llama.cpp's names for the sampling settings, beside the attribute SamplingOptions and SamplingParams both give them
_SETTINGS = (("temperature", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"), ("min_p", "min_p"),
             ("typical_p", "typical_p"), ("repeat_penalty", "repetition_penalty"), ("repeat_last_n", "penalty_last_n"),
             ("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty"),
             ("mirostat", "mirostat"), ("mirostat_tau", "mirostat_tau"), ("mirostat_eta", "mirostat_eta"),
             ("xtc_probability", "xtc_probability"), ("xtc_threshold", "xtc_threshold"),
             ("dry_multiplier", "dry_multiplier"), ("dry_base", "dry_base"), ("dry_allowed_length", "dry_allowed_length"),
             ("top_n_sigma", "top_n_sigma"), ("dynatemp_range", "dynatemp_range"),
             ("dynatemp_exponent", "dynatemp_exponent"), ("adaptive_target", "adaptive_target"),
             ("adaptive_decay", "adaptive_decay"), ("seed", "seed"))


# llama.cpp's one-letter names (its ``samplers`` as a string) and the other name it takes
_SAMPLER_LETTERS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p", "p": "top_p",
                    "m": "min_p", "x": "xtc", "t": "temperature", "i": "infill", "a": "adaptive_p"}
# the other names llama.cpp takes: each name with "-" or nothing for its "_" ("top-k", "topk"), a few more, and
# any of them in capitals
_SAMPLER_ALIASES = {"typical_p": "typ_p", "nucleus": "top_p", "temp": "temperature", "typ": "typ_p",
                    **{n.replace("_", sep): n for n in SAMPLER_STAGES for sep in ("-", "") if "_" in n}}


def _settings(x) -> dict[str, Any]:
    """The sampling settings of ``x`` (a request's SamplingOptions, or a live request's SamplingParams) under
    llama.cpp's names, unset ones left out, and the order its sampler stages run in."""
    out = {name: getattr(x, attr) for name, attr in _SETTINGS if getattr(x, attr) is not None}
    out["samplers"] = list(x.sampler_order or VLLM_ORDER)  # the OpenAI routes' rows: vLLM's order
    return out


def _sampler_order(body: dict) -> tuple[str, ...]:
    """``samplers``: llama.cpp's chain as names (``["top_k", "temperature"]``) or letters (``"kt"``); absent,
    llama.cpp's default chain."""
    value = body.get("samplers")
    if value is None:
        return LLAMA_CPP_ORDER
    if isinstance(value, str):
        unknown = [c for c in value if c not in _SAMPLER_LETTERS]
        if unknown:
            raise _bad("samplers", f"unknown sampler letter {unknown[0]!r}; the letters are "
                       + ", ".join(f"{c} ({n})" for c, n in _SAMPLER_LETTERS.items()))
        names = [_SAMPLER_LETTERS[c] for c in value]
    elif isinstance(value, list) and all(isinstance(n, str) for n in value):
        names = [_SAMPLER_ALIASES.get(n.lower(), n.lower()) for n in value]
        unknown = [n for n in names if n not in SAMPLER_STAGES]
        if unknown:
            raise _bad("samplers", f"unknown sampler {unknown[0]!r}; flared runs {', '.join(SAMPLER_STAGES)}")
    else:
        raise _bad("samplers", f"must be an array of sampler names or a string of their letters, got {_type(value)}")
    if not names:
        raise _bad("samplers", "must name at least one sampler")
    if len(names) > 4 * len(SAMPLER_STAGES):
        raise _bad("samplers", f"names {len(names)} samplers; at most {4 * len(SAMPLER_STAGES)}")
    return tuple(names)


def _logit_bias(value: Any) -> dict[int, float] | None:
    if value is None:
        return None
    pairs = value.items() if isinstance(value, dict) else value
    if not isinstance(value, (dict, list)):
        raise _bad("logit_bias", f"must be an array of [token id, bias] pairs or an object, got {_type(value)}")
    out = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise _bad("logit_bias", "each entry must be a [token id, bias] pair")
        tok, bias = pair
        try:
            tok = int(tok)
        except (TypeError, ValueError):
            raise _bad("logit_bias", f"{tok!r} is not a token id") from None
        if bias is False:
            bias = -100.0  # llama.cpp: the token is never sampled
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise _bad("logit_bias", f"the bias for token {tok} must be a number in [-100, 100] or false")
        out[tok] = float(bias)
    return out


def _stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _bad("stop", "must be an array of strings")
    return tuple(s for s in value if s)


class LlamaCppRoutes:
    def __init__(self, state):
        self.state = state

    def register(self, router: Router) -> None:
        router.add("POST", "/completion", self.completion, admit=True)
        router.add("POST", "/completions", self.completion, admit=True)
        router.add("POST", "/infill", self.infill, admit=True)
        router.add("GET", "/props", self.props)
        router.add("GET", "/slots", self.slots)
        router.add("POST", "/slots/{slot}", self.slot_action)
        router.add("GET", "/lora-adapters", self.lora_adapters)
        router.add("POST", "/lora-adapters", self.set_lora_adapters)

    def _defaults(self) -> dict[str, Any]:
        d = self.state.manifest.generation_defaults
        return {"temperature": float(d.get("temperature", 1.0)), "top_k": int(d.get("top_k", 0)),
                "top_p": float(d.get("top_p", 1.0)), "min_p": float(d.get("min_p", 0.0)),
                "repeat_penalty": float(d.get("repetition_penalty", 1.0)), "n_predict": -1,
                "samplers": list(LLAMA_CPP_ORDER)}

    async def slots(self, request: Request) -> Response:
        """llama.cpp's slot monitor: one entry per request slot (the core's concurrency), busy where a live request
        holds it: its sampling settings and progress. Prompts are not shown (they may be another client's). With
        ``?fail_on_no_slot=1``, a 503 when every slot is busy, as llama.cpp."""
        m = self.state.manifest
        context = m.capacities.context_tokens
        if request.query.get("fail_on_no_slot", ["0"])[-1] not in ("", "0", "false") and \
                self.state.runtime.snapshot().get("live_slots", 0) >= m.capacities.concurrency:
            raise HttpError(503, "no slot available", type="unavailable_error", code="unavailable")
        live = {row["slot"]: row for row in self.state.runtime.request_rows()}
        speculative = bool(getattr(self.state.runtime, "spec_tokens", 0))  # prompt lookup on (--speculative-tokens)
        out = []
        for slot in range(m.capacities.concurrency):
            row = live.get(slot)
            entry: dict[str, Any] = {"id": slot, "id_task": -1, "n_ctx": context, "speculative": speculative,
                                     "is_processing": row is not None}
            if row is not None:
                p = row["params"]
                entry.update(
                    id_task=row["request_id"], n_prompt_tokens=row["prompt_len"],
                    # the scheduler's consumed count goes on through the output's tokens
                    n_prompt_tokens_processed=min(row["prompt_consumed"], row["prompt_len"]), phase=row["phase"],
                    params={**_settings(p), "n_predict": p.max_tokens, "seed": p.seed if p.seed is not None else -1,
                            "n_probs": p.logprobs or 0,
                            "dry_penalty_last_n": p.dry_penalty_last_n or -1},  # the sampler's 0 is llama.cpp's -1
                    next_token={"has_next_token": True, "has_new_line": False, "n_remain": p.max_tokens - row["output"],
                                "n_decoded": row["output"], "stopping_word": ""})
            out.append(entry)
        return Response.json(out)

    async def slot_action(self, request: Request) -> Response:
        """llama.cpp's slot save, restore and erase: not served (this server's prefix cache keeps and reuses prompt
        states itself)."""
        action = request.query.get("action", [""])[-1]
        raise HttpError(400, f"slot action {action!r} is not supported: the prefix cache keeps and reuses prompt "
                        "states by itself (nothing to save, restore or erase per slot)", type="not_supported_error",
                        param="action")

    async def lora_adapters(self, request: Request) -> Response:
        """llama.cpp's adapter list: the LoRA adapters merged into the weights at load (--lora, --lora-scaled)."""
        return Response.json([{"id": i, "path": path, "scale": scale}
                              for i, (path, scale) in enumerate(self.state.runtime.lora_adapters)])

    async def set_lora_adapters(self, request: Request) -> Response:
        raise HttpError(400, "LoRA adapters are merged into the weights at load: their scales cannot change while "
                        "serving (restart with --lora-scaled PATH SCALE)", type="not_supported_error")

    async def props(self, request: Request) -> Response:
        m = self.state.manifest
        template = self.state.frontend.chat_template
        return Response.json({
            "default_generation_settings": {"n_ctx": m.capacities.context_tokens, "params": self._defaults()},
            "total_slots": m.capacities.concurrency,
            "model_path": m.model_name,
            "model_alias": m.model_name,
            "chat_template": template.source if template is not None else "",
            "modalities": {"vision": self.state.takes_images, "audio": self.state.takes_audio},
            "build_info": "flared",
        })

    async def _prompts(self, body: dict) -> tuple[list[tuple[list[int], str]], list]:
        """The request's prompts as (ids, text), in order, and each one's media (a VisionInput, or None). llama.cpp's
        rule: a string, an object ``{"prompt_string", "multimodal_data"}``, or an array of token ids with strings
        between them, is one prompt; any other array (of strings, objects or token arrays) holds several."""
        prompt = body.get("prompt")
        one = isinstance(prompt, list) and any(_is_id(p) for p in prompt) and all(
            _is_id(p) or isinstance(p, str) for p in prompt)
        if isinstance(prompt, list) and prompt and not one:
            if len(prompt) > MAX_N:
                raise _bad("prompt", f"at most {MAX_N} prompts per request, got {len(prompt)}")
            each = [await self._prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        else:
            each = [await self._prompt(prompt, "prompt")]
        return [(ids, text) for ids, text, _ in each], [vision for _, _, vision in each]

    async def _prompt(self, prompt: Any, field: str) -> tuple[list[int], str, Any]:
        if isinstance(prompt, dict):  # llama.cpp's prompt object: its text, and media at <__media__> markers
            text, media = prompt.get("prompt_string"), prompt.get("multimodal_data", [])
            if not isinstance(text, str):
                raise _bad(f"{field}.prompt_string", f"must be a string, got {_type(text)}")
            if not isinstance(media, list):
                raise _bad(f"{field}.multimodal_data", f"must be an array of base64 strings, got {_type(media)}")
            ids, vision = await self.state.media_prompt(text, media, field)
            return ids, text, vision
        if isinstance(prompt, str):
            ids = await self.state.encode(prompt)
            return ids, prompt, None
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_id(p) for p in prompt):
            ids: list[int] = []
            for i, p in enumerate(prompt):
                if isinstance(p, str):
                    # the model's BOS only before a leading string, as a text prompt gets it
                    ids += await self.state.encode(p, add_special_tokens=None if i == 0 else False)
                else:
                    if not 0 <= p < self.state.vocab_size:
                        raise _bad(field, f"token id {p} is outside the vocabulary (0..{self.state.vocab_size - 1})")
                    ids.append(p)
            return ids, await self.state.decode(ids), None
        raise _bad(field, "must be a string, a {prompt_string, multimodal_data} object, or an array of token ids "
                   "(strings may stand between them)" + (", or an array of such prompts" if field == "prompt" else "")
                   + f", got {_type(prompt)}" + (" (empty)" if prompt == [] else ""))

    async def completion(self, request: Request):
        body = json_object(request)
        t0 = time.monotonic_ns()
        prompts, visions = await self._prompts(body)
        return await self._complete(request, body, prompts, t0, visions=visions)

    async def infill(self, request: Request):
        """Fill in the middle: ``input_prefix`` and ``input_suffix`` around the cursor, ``input_extra``
        ([{filename, text}]) as repository context before them, ``prompt`` after the middle token (the text
        already typed at the cursor); then as /completion."""
        body = json_object(request)
        t0 = time.monotonic_ns()
        prefix = _string(body, "input_prefix") or ""
        suffix = _string(body, "input_suffix") or ""
        extra_in = body.get("input_extra") or []
        if not isinstance(extra_in, list) or not all(isinstance(e, dict) for e in extra_in):
            raise _bad("input_extra", "must be an array of {filename, text} objects")
        extra = []
        for i, e in enumerate(extra_in):
            name, text = e.get("filename", ""), e.get("text", "")
            if not isinstance(name, str) or not isinstance(text, str):
                raise _bad(f"input_extra[{i}]", "'filename' and 'text' must be strings")
            extra.append((name, text))
        ids = await self.state.fim_prompt(prefix, suffix, field="input_prefix", extra=extra)
        typed = _string(body, "prompt")
        if typed:
            ids += await self.state.encode(typed, add_special_tokens=False)
        return await self._complete(request, body, [(ids, prefix + (typed or ""))], t0, fim=True)

    async def _complete(self, request: Request, body: dict, prompts: list[tuple[list[int], str]], t0: int,
                        fim: bool = False, visions: list | None = None):
        """Complete each prompt ``n_cmpl`` times (one generation request each, prompt-major; the copies of a
        prompt draw with seeds counting up from the request's); one answer, or an array where there are several."""
        context = self.state.manifest.capacities.context_tokens
        for k, (ids, _) in enumerate(prompts):
            field = "prompt" if len(prompts) == 1 else f"prompt[{k}]"
            if not ids:
                raise _bad(field, "has no tokens")
            if len(ids) >= context:
                err = AdmissionError(f"'{field}': {len(ids)} tokens; this model's context holds {context}, leaving "
                                     "no room to generate", ErrorKind.CONTEXT_LENGTH)
                err.param = field
                raise err
        copies = _integer(body, "n_cmpl", 1, MAX_N) or _integer(body, "n", 1, MAX_N) or 1  # llama.cpp: "n" too
        visions = [v for v in (visions or [None] * len(prompts)) for _ in range(copies)]
        prompts = [p for p in prompts for _ in range(copies)]
        n_predict = _integer(body, "n_predict", -1, 1 << 31)
        n_probs = _integer(body, "n_probs", 0, MAX_TOP_LOGPROBS) or 0
        top_k = _integer(body, "top_k", -1, 1 << 31)
        order = _sampler_order(body)
        penalties, samplers = llama_penalties(body, context), llama_samplers(body)
        if "penalties" not in order:  # a chain without them: llama.cpp applies none
            penalties.update(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
        if "dry" not in order:
            samplers["dry_multiplier"] = 0.0
        opts = SamplingOptions(
            max_tokens=None if n_predict in (None, -1, 0) else n_predict,
            temperature=_number(body, "temperature", 0.0, 2.0), top_p=_number(body, "top_p", 0.0, 1.0),
            top_k=None if top_k is None else max(top_k, 0), min_p=_number(body, "min_p", 0.0, 1.0),
            seed=_seed(body), logit_bias=_logit_bias(body.get("logit_bias")),
            logprobs=n_probs if n_probs else None, stop=_stops(body.get("stop")), stop_token_ids=(),
            ignore_eos=_boolean(body, "ignore_eos"), n=1, sampler_order=order, **penalties, **samplers,
            post_sampling_probs=bool(_boolean(body, "post_sampling_probs")))
        _check_vocab(self.state, opts)
        if opts.top_p == 0.0:
            raise _bad("top_p", "must be > 0")
        # each prompt's own n_predict: at most what its context leaves
        each = [opts if opts.max_tokens is None else dataclasses.replace(
            opts, max_tokens=min(opts.max_tokens, context - len(ids))) for ids, _ in prompts]
        grammar = await compile_grammar(self.state, parse_extra_constraints(body, None))
        stream = _boolean(body, "stream")
        shape = _Output(n_probs=n_probs, return_tokens=bool(_boolean(body, "return_tokens")),
                        fields=_response_fields(body.get("response_fields")),
                        n_indent=_integer(body, "n_indent", 0, 1 << 20) or 0,
                        t_max_predict_ms=_integer(body, "t_max_predict_ms", 0, 1 << 31) or 0,
                        timings_per_token=bool(_boolean(body, "timings_per_token")),
                        post_sampling_probs=opts.post_sampling_probs)
        _integer(body, "t_max_prompt_ms", -1, 1 << 31)  # llama.cpp's is not enforced either (validated only)
        if n_predict == 0:  # llama.cpp: the prompt is evaluated, nothing is generated
            summaries = [shape.pick(self._summary(k, text, ids, "", [], "limit", "", 0, 0, t0, t0, each[k]))
                         for k, (ids, text) in enumerate(prompts)]
            if not stream:
                return Response.json(summaries[0] if len(summaries) == 1 else summaries)

            async def only(w: ResponseWriter) -> None:
                for summary in summaries:
                    await w.send_json_event(summary)
            return StreamingResponse(only, headers=[("cache-control", "no-cache")])
        await prepare_samplers(self.state, opts)
        stop_ids = _stop_ids(self.state, opts, fim=fim)  # a fill also stops at the model's FIM end tokens
        reqs = [GenerateRequest(tuple(ids), (), sampling_params(self.state, each[k], len(ids), None, k % copies),
                                stop_ids, grammar=grammar, vision=visions[k]) for k, (ids, _) in enumerate(prompts)]
        gen = self.state.start(reqs, opts.stop)
        request.disconnected.add_callback(gen.cancel)
        if stream:
            return StreamingResponse(lambda w: self._stream(gen, w, prompts, t0, each, shape),
                                     headers=[("cache-control", "no-cache")])
        n = len(prompts)
        first_ns, finish = [0] * n, ["stop"] * n
        texts: list[list[str]] = [[] for _ in range(n)]
        tokens: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[TokenLogprob]] = [[] for _ in range(n)]
        limits = [_CodeLimits(shape.n_indent, shape.t_max_predict_ms) for _ in range(n)]
        async for d in gen.deltas():
            k = d.index
            now = time.monotonic_ns()
            first_ns[k] = first_ns[k] or now
            text, ended = limits[k].feed(d.text, now)
            if ended:  # n_indent or t_max_predict_ms: llama.cpp's stop by limit
                gen.end_choice(k, "length")
                finish[k] = "length"
            texts[k].append(text)
            tokens[k] += d.token_ids
            lps[k] += d.logprobs
            if d.finish_reason is not None:
                finish[k] = d.finish_reason
        outs = []
        for k, (ids, text) in enumerate(prompts):
            u = gen.choice_usage(k)
            out = self._summary(k, text, ids, "".join(texts[k]), lps[k] if n_probs else [],
                                *self._stop(gen, k, finish[k]), u.num_generated_tokens, u.num_cached_tokens, t0,
                                first_ns[k], each[k])
            if shape.return_tokens:
                out["tokens"] = tokens[k]
            outs.append(shape.pick(out))
        return Response.json(outs[0] if n == 1 else outs)

    @staticmethod
    def _stop(gen: Generation, index: int, finish: str) -> tuple[str, str]:
        if finish == "length":
            return "limit", ""
        word = gen.matched_stop(index)
        return ("word", word) if word else ("eos", "")

    def _probs(self, lps: list[TokenLogprob], post: bool = False) -> list[dict[str, Any]]:
        """completion_probabilities: each token's logprob and its alternatives' (``top_logprobs``); with
        post_sampling_probs, probabilities of the distribution the draw was made from (``prob``, ``top_probs``:
        its candidates only)."""
        fe = self.state.frontend

        def entry(tid: int, lp: float) -> dict[str, Any]:
            tok = fe.decode([tid])
            out = {"id": tid, "token": tok, "bytes": list(tok.encode("utf-8"))}
            if post:
                out["prob"] = math.exp(lp)
            else:
                out["logprob"] = lp
            return out
        top = "top_probs" if post else "top_logprobs"
        return [{**entry(lp.token_id, lp.logprob),
                 top: [entry(t, v) for t, v in lp.top if not post or (t >= 0 and v != float("-inf"))]}
                for lp in lps]

    def _summary(self, index: int, prompt_text: str, ids: list[int], content: str, lps: list[TokenLogprob],
                 stop_type: str, stopping_word: str, predicted: int, cached: int, t0_ns: int, first_ns: int,
                 opts: SamplingOptions) -> dict[str, Any]:
        out = {
            "index": index, "content": content, "tokens": [], "id_slot": 0, "stop": True,
            "model": self.state.manifest.model_name, "tokens_predicted": predicted, "tokens_evaluated": len(ids),
            "generation_settings": {
                **self._defaults(), **_settings(opts),
                **({"n_predict": opts.max_tokens} if opts.max_tokens is not None else {}), "stop": list(opts.stop),
                "n_probs": opts.logprobs or 0, "dry_penalty_last_n": opts.dry_penalty_last_n,
                "dry_sequence_breakers": list(opts.dry_sequence_breakers)},
            "prompt": prompt_text, "has_new_line": "\n" in content, "truncated": False,
            "stop_type": stop_type, "stopping_word": stopping_word, "tokens_cached": cached,
            "timings": _timings(len(ids) - cached, predicted, t0_ns, first_ns),
        }
        if opts.logprobs:
            out["completion_probabilities"] = self._probs(lps, opts.post_sampling_probs)
        return out

    async def _stream(self, gen: Generation, w: ResponseWriter, prompts: list[tuple[list[int], str]], t0_ns: int,
                      each: list[SamplingOptions], shape: _Output) -> None:
        """Every prompt's chunks as they come, each with its ``index``; a prompt's summary (``stop: true``) as
        soon as it ends."""
        first_ns = [0] * len(prompts)
        limits = [_CodeLimits(shape.n_indent, shape.t_max_predict_ms) for _ in prompts]
        try:
            async for d in gen.deltas():
                k = d.index
                ids, text = prompts[k]
                now = time.monotonic_ns()
                first_ns[k] = first_ns[k] or now
                content, ended = limits[k].feed(d.text, now)
                if ended:  # n_indent or t_max_predict_ms
                    gen.end_choice(k, "length")
                if content or d.logprobs or (shape.return_tokens and d.token_ids):
                    chunk: dict[str, Any] = {
                        "index": k, "content": content, "tokens": list(d.token_ids) if shape.return_tokens else [],
                        "stop": False, "id_slot": -1, "tokens_predicted": gen.choice_usage(k).num_generated_tokens,
                        "tokens_evaluated": len(ids)}
                    if shape.n_probs:
                        chunk["completion_probabilities"] = self._probs(d.logprobs, shape.post_sampling_probs)
                    if shape.timings_per_token:  # llama.cpp's: the speeds so far on every chunk
                        chunk["timings"] = _timings(len(ids), gen.choice_usage(k).num_generated_tokens, t0_ns,
                                                    first_ns[k])
                    await w.send_json_event(chunk)
                finish = "length" if ended else d.finish_reason
                if finish is not None:
                    u = gen.choice_usage(k)
                    await w.send_json_event(shape.pick(self._summary(
                        k, text, ids, "", [], *self._stop(gen, k, finish), u.num_generated_tokens,
                        u.num_cached_tokens, t0_ns, first_ns[k], each[k])))
        except ClientDisconnected:
            gen.cancel()
        except Exception as exc:  # the stream has started: llama.cpp ends it with an error object
            gen.cancel()
            try:
                await w.send_json_event(json.loads(error_response(exc).body))
            except ClientDisconnected:
                pass


def _timings(evaluated: int, predicted: int, t0_ns: int, first_ns: int) -> dict[str, Any]:
    """llama.cpp's ``timings`` until now: the prompt's (to the first token) and the generation's."""
    end = time.monotonic_ns()
    first_ns = first_ns or end
    prompt_ms = (first_ns - t0_ns) / 1e6
    predicted_ms = (end - first_ns) / 1e6
    return {"prompt_n": evaluated, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / evaluated if evaluated else 0.0,
            "prompt_per_second": evaluated / prompt_ms * 1e3 if prompt_ms > 0 else 0.0,
            "predicted_n": predicted, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / predicted if predicted else 0.0,
            "predicted_per_second": predicted / predicted_ms * 1e3 if predicted_ms > 0 else 0.0}


@dataclasses.dataclass(frozen=True)
class _Output:
    """What a /completion answer carries beyond the text, and llama.cpp's limits for code completion."""

    n_probs: int
    return_tokens: bool
    fields: tuple[str, ...] | None  # response_fields: only these (paths with "/"), named by their paths
    n_indent: int  # stop at a line indented less than this (0: off)
    t_max_predict_ms: int  # stop once past this long after the first token, if a newline came (0: off)
    timings_per_token: bool = False  # streamed chunks carry the timings so far
    post_sampling_probs: bool = False  # completion_probabilities as probabilities after the chain

    def pick(self, out: dict[str, Any]) -> dict[str, Any]:
        """llama.cpp's response_fields: each path that resolves, under its path as the key."""
        if self.fields is None:
            return out
        picked = {}
        for path in self.fields:
            value: Any = out
            for key in path.split("/"):
                if not isinstance(value, dict) or key not in value:
                    break
                value = value[key]
            else:
                picked[path] = value
        return picked


def _response_fields(value: Any) -> tuple[str, ...] | None:
    if value is None or value == []:
        return None  # llama.cpp: an empty list leaves the answer whole
    if not isinstance(value, list) or not all(isinstance(f, str) for f in value):
        raise _bad("response_fields", f"must be an array of field names (paths such as \"timings/prompt_n\"), "
                   f"got {_type(value)}")
    return tuple(value)


class _CodeLimits:
    """llama.cpp's stops for code completion on one prompt's text as it comes: ``n_indent`` ends the output at the
    first line (after the first) whose text starts with fewer spaces or tabs, cut before that text; and
    ``t_max_predict_ms`` ends it once that long has passed since the first token and a newline was generated."""

    def __init__(self, n_indent: int, t_max_predict_ms: int):
        self.n_indent = n_indent
        self.t_max_ns = t_max_predict_ms * 1_000_000
        self.text = ""
        self.line = 0  # where the current line starts (0: still the first)
        self.start_ns = 0

    def feed(self, text: str, now_ns: int) -> tuple[str, bool]:
        """The part of ``text`` to keep, and whether the output ends with it."""
        if not (self.n_indent or self.t_max_ns):
            return text, False
        self.start_ns = self.start_ns or now_ns
        before = len(self.text)
        self.text += text
        while self.n_indent:
            if self.line:
                pos = self.line
                while pos < len(self.text) and self.text[pos] in " \t":
                    pos += 1
                if pos < len(self.text) and pos - self.line < self.n_indent:
                    self.text = self.text[:pos]
                    return self.text[before:], True
            newline = self.text.find("\n", self.line)
            if newline == -1:
                break
            self.line = newline + 1
        if self.t_max_ns and "\n" in self.text and now_ns - self.start_ns > self.t_max_ns:
            return text, True
        return text, False


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _seed(body: dict) -> int | None:
    seed = _integer(body, "seed", -(1 << 63), (1 << 64) - 1)
    return None if seed in (None, -1, 0xFFFFFFFF) else seed  # llama.cpp: -1 (LLAMA_DEFAULT_SEED) is random
