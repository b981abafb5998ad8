"""OpenAI request bodies -> validated generation options.

Pure functions over decoded JSON: every rejection is an ``AdmissionError``
(HTTP 400) whose message names the offending field, with ``param`` set so the
error body carries it too. Unknown fields are ignored, as OpenAI and vLLM do;
known features we do not serve yet are rejected by name rather than ignored.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from flared.errors import AdmissionError, ErrorKind
from flared.model.sampling import SamplingParams
from flared.server.structured import (
    ForcedToolChoice, GrammarSpec, parse_extra_constraints, parse_openai_forced_tool_choice, parse_response_format,
)

MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_BAD_WORDS = 64


def _bad(field: str, message: str, kind: ErrorKind = ErrorKind.VALIDATION) -> AdmissionError:
    err = AdmissionError(f"'{field}': {message}", kind)
    err.param = field
    return err


def json_object(request) -> dict:
    """A request's JSON body, which must be an object (a 400 naming 'body' otherwise)."""
    body = request.json()
    if not isinstance(body, dict):
        raise _bad("body", f"must be a JSON object, got {_type(body)}")
    return body


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """What a request asked of the sampler, before core defaults fill the gaps."""

    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float | None
    seed: int | None
    logit_bias: dict[int, float] | None
    logprobs: int | None  # top-n per token; None = no logprobs
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    n: int
    # vLLM's extra sampling parameters (chat and completions)
    min_tokens: int = 0  # EOS, stop ids and stop strings cannot end the output before this many tokens
    allowed_token_ids: tuple[int, ...] | None = None  # only these ids can be drawn
    include_stop_str_in_output: bool = False  # a matched stop string (or stop id's text) stays in the text
    skip_special_tokens: bool = True  # False: special tokens' text appears in the output
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens
    prompt_logprobs: int | None = None  # each prompt token's logprob and the top-k at its position
    return_tokens_as_token_ids: bool = False  # logprobs name tokens as "token_id:123"
    bad_words: tuple[str, ...] = ()  # words the output must not contain (vLLM's)
    thinking_budget: int | None = None  # Anthropic's budget_tokens: reasoning ends after this many tokens
    # llama.cpp's and Ollama's sampling (their routes)
    typical_p: float | None = None  # locally typical sampling
    penalty_last_n: int = 0  # repeat_last_n: the penalties' window (0 here: vLLM's whole-history penalties)
    # llama.cpp's mirostat, XTC and DRY, with SamplingParams' defaults (which says what each does)
    mirostat: int = SamplingParams.mirostat
    mirostat_tau: float = SamplingParams.mirostat_tau
    mirostat_eta: float = SamplingParams.mirostat_eta
    xtc_probability: float = SamplingParams.xtc_probability
    xtc_threshold: float = SamplingParams.xtc_threshold
    dry_multiplier: float = SamplingParams.dry_multiplier
    dry_base: float = SamplingParams.dry_base
    dry_allowed_length: int = SamplingParams.dry_allowed_length
    dry_penalty_last_n: int = -1  # llama.cpp's -1: the whole context (SamplingParams' 0); 0: DRY off
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", "\"", "*")  # llama.cpp's; SamplingParams takes token ids
    top_n_sigma: float = SamplingParams.top_n_sigma
    dynatemp_range: float = SamplingParams.dynatemp_range
    dynatemp_exponent: float = SamplingParams.dynatemp_exponent
    adaptive_target: float = SamplingParams.adaptive_target
    adaptive_decay: float = SamplingParams.adaptive_decay
    post_sampling_probs: bool = False  # llama.cpp's: logprobs of the distribution drawn from (its /completion)
    sampler_order: tuple[str, ...] = ()  # llama.cpp's chain (SamplingParams says what it does); () = vLLM's order

    @property
    def uses_dry(self) -> bool:
        return self.dry_multiplier > 0 and self.dry_penalty_last_n != 0


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[dict]
    options: SamplingOptions
    stream: bool
    include_usage: bool
    template_kwargs: dict[str, Any]
    add_generation_prompt: bool
    continue_final_message: bool
    user: str | None
    tools: list[dict] | None = None  # function tools as the template sees them; None: no tools
    tool_choice: str = "auto"  # "auto" | "none" (required/named need constrained decoding)
    response_format: GrammarSpec | None = None  # constrained output (flared.server.structured)
    forced_tool: ForcedToolChoice | None = None  # tool_choice "required" / named: a grammar forces the call
    # vLLM's chat fields
    documents: list[dict] | None = None  # passed to the chat template (RAG templates render them)
    echo: bool = False  # the answer starts with the last message's content when that is the assistant's
    add_special_tokens: bool = False  # the tokenizer's BOS etc. around the rendered prompt
    chat_template: str | None = None  # the request's own Jinja chat template (when the server trusts them)
    extras: ResponseExtras = dataclasses.field(default_factory=lambda: ResponseExtras())
    # OpenAI's deprecated ``functions``: the answer names its call ``message.function_call`` (one call), with
    # finish reason "function_call"
    legacy_functions: bool = False
    # OpenAI's predicted output (``prediction``: {"type": "content", "content": text or text parts}): where
    # speculative decoding looks up drafts first; None: none
    prediction: str | None = None
    # vLLM's mm_processor_kwargs: a request's own media settings (ServingState.media_processors); None: the model's
    media_options: dict | None = None


@dataclasses.dataclass(frozen=True)
class ResponseExtras:
    """vLLM's request and response options shared by chat and completions."""

    return_token_ids: bool = False  # prompt_token_ids and each choice's token_ids in the response
    request_id: str | None = None  # the response id is "chatcmpl-<request_id>" / "cmpl-<request_id>"
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
    cache_salt: str | None = None  # prefix-cache reuse only among requests with the same salt
    priority: int = 0  # lower runs sooner (flared.runtime.request.GenerateRequest.priority)


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompts: list[str | list[int]]  # each is text or token ids
    options: SamplingOptions
    stream: bool
    include_usage: bool
    echo: bool
    user: str | None
    response_format: GrammarSpec | None = None
    score_only: bool = False  # echo with max_tokens 0: the prompt's logprobs, nothing generated
    suffix: str | None = None  # fill in the middle: the text after the completion (prompts are the text before)
    extras: ResponseExtras = dataclasses.field(default_factory=lambda: ResponseExtras())
    best_of: int = 1  # completions made per prompt, of which the n likeliest (mean logprob per token) answer


# -- field readers ---------------------------------------------------------------------------------

def _number(body: dict, field: str, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
    v = body.get(field)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(field, f"must be a number, got {_type(v)}")
    if v < lo or v > hi or (lo_open and v == lo):
        raise _bad(field, f"must be {'>' if lo_open else '>='} {lo} and <= {hi}, got {v}")
    return float(v)


def _integer(body: dict, field: str, lo: int, hi: int) -> int | None:
    v = body.get(field)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise _bad(field, f"must be an integer, got {_type(v)}")
    if v < lo or v > hi:
        raise _bad(field, f"must be between {lo} and {hi}, got {v}")
    return v


def _boolean(body: dict, field: str, default: bool = False) -> bool:
    v = body.get(field)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(field, f"must be a boolean, got {_type(v)}")
    return v


def _string(body: dict, field: str, *, required: bool = False) -> str | None:
    v = body.get(field)
    if v is None:
        if required:
            raise _bad(field, "is required")
        return None
    if not isinstance(v, str):
        raise _bad(field, f"must be a string, got {_type(v)}")
    return v


def _type(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


def join_text_parts(content: Any, where: str, text_types: tuple[str, ...] = ("text",)) -> str:
    """A string, or an array of text parts joined: the one reader of text content
    for every API shape (OpenAI parts, Anthropic blocks, Responses items). Any
    other part is a 400 naming it; this model takes text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, f"must be a string or an array of content parts, got {_type(content)}")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in text_types:
            kind = part.get("type") if isinstance(part, dict) else _type(part)
            raise _bad(f"{where}[{j}]", f"content part of type {kind!r} is not supported (this model takes text)",
                       ErrorKind.UNSUPPORTED)
        if not isinstance(part.get("text"), str):
            raise _bad(f"{where}[{j}].text", "must be a string")
        parts.append(part["text"])
    return "".join(parts)


def image_source(part: dict, where: str) -> str:
    """The image an OpenAI image part carries: ``image_url`` as {"url": ...} or a bare string (vLLM's), or a
    Responses ``input_image``'s ``image_url``; a data URL (remote URLs are refused where the image is read)."""
    return _url_field(part, "image_url", where, "data:image/png;base64,...")


def _url_field(part: dict, key: str, where: str, example: str) -> str:
    """``part[key]`` as {"url": ...} or the URL as a bare string (vLLM's), checked non-empty."""
    url = part.get(key)
    if isinstance(url, dict):
        url = url.get("url")
        where += f".{key}.url"
    else:
        where += f".{key}"
    if not isinstance(url, str) or not url:
        raise _bad(where, f"must be a non-empty string (a data URL such as {example})")
    return url


def audio_source(part: dict, where: str) -> tuple[str, str | None]:
    """The clip an OpenAI audio part carries, and its declared format: ``input_audio`` as {"data": base64,
    "format": "wav"}, or vLLM's ``audio_url`` as {"url": ...} or a bare string (a data URL)."""
    if part.get("type") == "input_audio":
        audio = part.get("input_audio")
        if not isinstance(audio, dict):
            raise _bad(f"{where}.input_audio", "must be an object with 'data' (base64) and 'format' (\"wav\")")
        data, fmt = audio.get("data"), audio.get("format")
        if not isinstance(data, str) or not data:
            raise _bad(f"{where}.input_audio.data", "must be a non-empty base64 string")
        if fmt is not None and not isinstance(fmt, str):
            raise _bad(f"{where}.input_audio.format", f"must be a string such as \"wav\", got {_type(fmt)}")
        return data, fmt
    return _url_field(part, "audio_url", where, "data:audio/wav;base64,..."), None


AUDIO_PART_TYPES = ("input_audio", "audio_url")
VIDEO_PART_TYPES = ("video_url",)  # (vLLM's)


def content_with_images(content: Any, where: str, text_types: tuple[str, ...] = ("text",),
                        image_types: tuple[str, ...] = ("image_url",),
                        audio_types: tuple[str, ...] = (), video_types: tuple[str, ...] = ()) -> str | list:
    """``join_text_parts``' text, or, where the content holds images, audio or video, its parts in order: text
    parts as {"type": "text", "text"}, images as {"type": "image", "image": source, "param": field}, clips as
    {"type": "audio", "audio": source, "format": declared, "param": field} and videos as {"type": "video",
    "video": source, "param": field} (the serving state checks the model takes them, decodes them and renders the
    template with them)."""
    media = image_types + audio_types + video_types
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") in media for p in content):
        return join_text_parts(content, where, text_types)
    parts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if isinstance(part, dict) and part.get("type") in image_types:
            parts.append({"type": "image", "image": image_source(part, at), "param": at, "sent_as": part["type"]})
        elif isinstance(part, dict) and part.get("type") in audio_types:
            source, fmt = audio_source(part, at)
            parts.append({"type": "audio", "audio": source, "format": fmt, "param": at, "sent_as": part["type"]})
        elif isinstance(part, dict) and part.get("type") in video_types:
            source = _url_field(part, "video_url", at, "data:video/mp4;base64,...")
            parts.append({"type": "video", "video": source, "param": at, "sent_as": part["type"]})
        else:
            if not isinstance(part, dict) or part.get("type") not in text_types:
                kind = part.get("type") if isinstance(part, dict) else _type(part)
                raise _bad(at, f"content part of type {kind!r} is not supported", ErrorKind.UNSUPPORTED)
            if not isinstance(part.get("text"), str):
                raise _bad(f"{at}.text", "must be a string")
            parts.append({"type": "text", "text": part["text"]})
    return parts


def _reject_unsupported(body: dict, fields: tuple[str, ...]) -> None:
    for field in fields:
        if body.get(field) not in (None, [], False):
            raise _bad(field, "is not supported by this server yet", ErrorKind.UNSUPPORTED)


def _sampling(body: dict, *, max_tokens_fields: tuple[str, ...], logprobs: int | None) -> SamplingOptions:
    max_tokens = None
    for field in max_tokens_fields:
        v = _integer(body, field, 1, 1 << 31)
        if v is not None:
            max_tokens = v
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(s for s in stop if s)
    else:
        raise _bad("stop", "must be a string or an array of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise _bad("stop", f"at most {MAX_STOP_STRINGS} stop strings")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                 for t in stop_ids):
        raise _bad("stop_token_ids", "must be an array of non-negative integers")
    bias = body.get("logit_bias")
    logit_bias = None
    if bias is not None:
        if not isinstance(bias, dict):
            raise _bad("logit_bias", f"must be an object mapping token ids to numbers, got {_type(bias)}")
        logit_bias = {}
        for k, v in bias.items():
            try:
                token = int(k)
            except (TypeError, ValueError):
                raise _bad("logit_bias", f"key {k!r} is not a token id") from None
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
                raise _bad("logit_bias", f"value for token {k} must be a number in [-100, 100]")
            logit_bias[token] = float(v)
    top_k = _integer(body, "top_k", -1, 1 << 31)
    allowed = body.get("allowed_token_ids")
    if allowed is not None:
        if (not isinstance(allowed, list) or not allowed
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in allowed)):
            raise _bad("allowed_token_ids", "must be a non-empty array of non-negative integers")
        allowed = tuple(allowed)
    bad_words = body.get("bad_words")
    if bad_words is None:
        bad_words = []
    if (not isinstance(bad_words, list) or len(bad_words) > MAX_BAD_WORDS
            or not all(isinstance(w, str) and w.strip() for w in bad_words)):
        raise _bad("bad_words", f"must be an array of at most {MAX_BAD_WORDS} non-blank strings")
    min_tokens = _integer(body, "min_tokens", 0, 1 << 31) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise _bad("min_tokens", f"must be <= max_tokens ({max_tokens}), got {min_tokens}")
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0, lo_open=True),
        top_k=None if top_k is None else max(top_k, 0),  # -1 (vLLM) and 0 both mean off
        min_p=_number(body, "min_p", 0.0, 1.0),
        presence_penalty=_number(body, "presence_penalty", -2.0, 2.0) or 0.0,
        frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0) or 0.0,
        repetition_penalty=_number(body, "repetition_penalty", 0.0, 2.0, lo_open=True),
        seed=_integer(body, "seed", -(1 << 63), (1 << 64) - 1),
        logit_bias=logit_bias,
        logprobs=logprobs,
        stop=stops,
        stop_token_ids=tuple(stop_ids),
        ignore_eos=_boolean(body, "ignore_eos"),
        n=_integer(body, "n", 1, MAX_N) or 1,
        min_tokens=min_tokens,
        allowed_token_ids=allowed,
        include_stop_str_in_output=_boolean(body, "include_stop_str_in_output"),
        skip_special_tokens=_boolean(body, "skip_special_tokens", default=True),
        truncate_prompt_tokens=_truncation(body),
        prompt_logprobs=_prompt_logprobs(body),
        return_tokens_as_token_ids=_boolean(body, "return_tokens_as_token_ids"),
        bad_words=tuple(bad_words),
        **llama_samplers(body),
    )


def _prompt_logprobs(body: dict) -> int | None:
    """vLLM's prompt_logprobs: how many alternatives beside each prompt token's own logprob (true: 1)."""
    v = body.get("prompt_logprobs")
    if isinstance(v, bool):
        v = int(v) if v else None
        body = {**body, "prompt_logprobs": v}
    k = _integer(body, "prompt_logprobs", 0, MAX_TOP_LOGPROBS)
    if k is not None and _boolean(body, "stream"):
        raise _bad("prompt_logprobs", "is not available when 'stream' is true")
    return k


def llama_penalties(body: dict, context: int) -> dict[str, Any]:
    """llama.cpp's and Ollama's penalty fields as SamplingOptions fields: repeat_penalty, presence_penalty and
    frequency_penalty over the last ``repeat_last_n`` tokens, prompt included (default 64, as both; -1: the
    whole context; 0: no penalties at all), and typical_p."""
    last_n = _integer(body, "repeat_last_n", -1, 1 << 31)
    last_n = 64 if last_n is None else (context if last_n == -1 else last_n)
    out: dict[str, Any] = {
        "repetition_penalty": _number(body, "repeat_penalty", 0.0, 2.0, lo_open=True),
        "presence_penalty": _number(body, "presence_penalty", -2.0, 2.0) or 0.0,
        "frequency_penalty": _number(body, "frequency_penalty", -2.0, 2.0) or 0.0,
        "penalty_last_n": min(last_n, context),
        "typical_p": _number(body, "typical_p", 0.0, 1.0, lo_open=True),
    }
    if last_n == 0:
        out.update(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    return out


MAX_DRY_BREAKERS = 16


def llama_samplers(body: dict) -> dict[str, Any]:
    """llama.cpp's mirostat, XTC, DRY, top-n-sigma, dynamic temperature and adaptive-p fields (its /completion and
    OpenAI-compatible routes, Ollama's options) as SamplingOptions fields; absent fields keep llama.cpp's defaults
    (all off)."""
    out: dict[str, Any] = {}
    for field, lo, hi in (("mirostat_tau", 0.0, 100.0), ("mirostat_eta", 0.0, 10.0), ("xtc_probability", 0.0, 1.0),
                          ("xtc_threshold", 0.0, 1.0), ("dry_multiplier", 0.0, 1e4), ("dry_base", 0.0, 100.0),
                          ("top_n_sigma", -1.0, 100.0), ("dynatemp_range", 0.0, 100.0),
                          ("dynatemp_exponent", 0.0, 100.0), ("adaptive_target", -1.0, 1.0),
                          ("adaptive_decay", 0.0, 1.0)):
        value = _number(body, field, lo, hi)
        if value is not None:
            out[field] = value
    for field, lo, hi in (("mirostat", 0, 2), ("dry_allowed_length", 0, 1 << 31), ("dry_penalty_last_n", -1, 1 << 31)):
        value = _integer(body, field, lo, hi)
        if value is not None:
            out[field] = value
    breakers = body.get("dry_sequence_breakers")
    if breakers is not None:
        if (not isinstance(breakers, list) or not breakers or len(breakers) > MAX_DRY_BREAKERS
                or not all(isinstance(b, str) and b for b in breakers)):
            raise _bad("dry_sequence_breakers", f"must be a non-empty array of at most {MAX_DRY_BREAKERS} "
                       "non-empty strings")
        out["dry_sequence_breakers"] = tuple(breakers)
    if out.get("dry_multiplier", 0.0) > 0 and out.get("dry_base", SamplingParams.dry_base) < 1:
        raise _bad("dry_base", f"must be >= 1 when dry_multiplier is set, got {out['dry_base']}")
    return out


def _truncation(body: dict) -> int | None:
    """vLLM's truncate_prompt_tokens: keep the prompt's last k tokens (-1: as many as the context holds)."""
    k = _integer(body, "truncate_prompt_tokens", -1, 1 << 31)
    if k == 0:
        raise _bad("truncate_prompt_tokens", "must be >= 1, or -1 for the model's context length")
    return k


def _stream_options(body: dict, stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise _bad("stream_options", f"must be an object, got {_type(opts)}")
    if not stream:
        raise _bad("stream_options", "is only allowed when 'stream' is true")
    return _boolean(opts, "include_usage")


_REQUEST_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:")


def _extras(body: dict, stream: bool) -> ResponseExtras:
    request_id = _string(body, "request_id")
    if request_id is not None and (not request_id or len(request_id) > 128
                                   or not set(request_id) <= _REQUEST_ID_CHARS):
        raise _bad("request_id", "must be 1-128 characters of letters, digits, '-', '_', '.' or ':'")
    continuous = False
    opts = body.get("stream_options")
    if isinstance(opts, dict) and stream:
        continuous = _boolean(opts, "continuous_usage_stats")
    salt = _string(body, "cache_salt")
    if salt is not None and not salt:
        raise _bad("cache_salt", "must be a non-empty string")
    return ResponseExtras(return_token_ids=_boolean(body, "return_token_ids"), request_id=request_id,
                          continuous_usage=continuous, cache_salt=salt,
                          priority=_integer(body, "priority", -(1 << 31), (1 << 31) - 1) or 0)


# -- chat ------------------------------------------------------------------------------------------

_ROLES = ("system", "developer", "user", "assistant", "tool")  # "function" messages become "tool" ones first


def parse_chat(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise _bad("body", f"must be a JSON object, got {_type(body)}")
    model = _string(body, "model", required=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty array of messages")
    legacy = body.get("functions") not in (None, []) or body.get("function_call") is not None
    if legacy:
        body = _from_legacy_functions(body)
    messages = _from_legacy_messages(messages)
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, f"must be an object, got {_type(m)}")
        role = m.get("role")
        if role not in _ROLES:
            raise _bad(f"{where}.role", f"must be one of {', '.join(_ROLES)}, got {role!r}")
        msg = dict(m)
        content = m.get("content")
        if isinstance(content, list):
            msg["content"] = content_with_images(content, f"{where}.content", ("text", "input_text"),
                                                 audio_types=AUDIO_PART_TYPES, video_types=VIDEO_PART_TYPES)
        elif content is not None and not isinstance(content, str):
            raise _bad(f"{where}.content", f"must be a string or an array of content parts, got {_type(content)}")
        elif content is None and role != "assistant":
            raise _bad(f"{where}.content", "is required")
        out.append(msg)
    _reject_unsupported(body, ("audio",))
    tools = parse_tools(body.get("tools"), "tools")
    forced_tool = parse_openai_forced_tool_choice(body.get("tool_choice"),
                                                  parallel=_boolean(body, "parallel_tool_calls", default=True))
    tool_choice = "required" if forced_tool else parse_tool_choice(body.get("tool_choice"), "tool_choice")
    constraint = _constraint(body)
    if forced_tool is not None and constraint is not None:
        raise _bad("tool_choice", "a forced tool call cannot be combined with 'response_format' (or another "
                   "output constraint)")
    if _boolean(body, "logprobs"):
        top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
        logprobs = top
    else:
        if body.get("top_logprobs") is not None:
            raise _bad("top_logprobs", "requires 'logprobs': true")
        logprobs = None
    stream = _boolean(body, "stream")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs", "must be an object")
    kwargs = {**reasoning_effort_kwargs(body.get("reasoning_effort"), "reasoning_effort"), **kwargs}
    cont = _boolean(body, "continue_final_message")
    documents = body.get("documents")
    if documents is not None and (not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents)):
        raise _bad("documents", "must be an array of objects")
    media_options = body.get("mm_processor_kwargs")
    if media_options is not None and not isinstance(media_options, dict):
        raise _bad("mm_processor_kwargs", "must be an object")
    return ChatRequest(
        model=model,
        messages=out,
        options=_sampling(body, max_tokens_fields=("max_tokens", "max_completion_tokens"), logprobs=logprobs),
        stream=stream,
        include_usage=_stream_options(body, stream),
        template_kwargs=dict(kwargs),
        add_generation_prompt=_boolean(body, "add_generation_prompt", default=not cont),
        continue_final_message=cont,
        response_format=constraint,
        user=_string(body, "user"),
        tools=tools if tools and tool_choice != "none" else None,
        tool_choice=tool_choice,
        forced_tool=forced_tool,
        documents=documents or None,
        echo=_boolean(body, "echo"),
        add_special_tokens=_boolean(body, "add_special_tokens"),
        chat_template=_string(body, "chat_template"),
        extras=_extras(body, stream),
        legacy_functions=legacy,
        prediction=_prediction(body.get("prediction")),
        media_options=media_options or None,
    )


def _prediction(value: Any) -> str | None:
    """OpenAI's ``prediction``: ``{"type": "content", "content": text or an array of text parts}`` -> the text."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "content":
        raise _bad("prediction", 'must be {"type": "content", "content": ...}')
    if "content" not in value:
        raise _bad("prediction.content", "is required")
    return join_text_parts(value["content"], "prediction.content")


def _from_legacy_functions(body: dict) -> dict:
    """OpenAI's deprecated function calling as tools: ``functions`` as function tools, ``function_call`` as
    ``tool_choice``."""
    for new, old in (("tools", "functions"), ("tool_choice", "function_call")):
        if body.get(new) is not None:
            raise _bad(old, f"is the deprecated form of '{new}': send one of them, not both")
    functions = body.get("functions")
    if functions is not None and (not isinstance(functions, list)
                                  or not all(isinstance(f, dict) for f in functions)):
        raise _bad("functions", f"must be an array of function objects, got {_type(functions)}")
    out = {k: v for k, v in body.items() if k not in ("functions", "function_call")}
    if functions:
        out["tools"] = [{"type": "function", "function": f} for f in functions]
    choice = body.get("function_call")
    if choice is not None:
        if choice in ("none", "auto"):
            out["tool_choice"] = choice
        elif isinstance(choice, dict) and isinstance(choice.get("name"), str) and set(choice) == {"name"}:
            out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            raise _bad("function_call", f"must be \"none\", \"auto\" or {{\"name\": ...}}, got {choice!r}")
    return out


def _from_legacy_messages(messages: list) -> list:
    """A history of OpenAI's deprecated function calling as tool calls: an assistant message's ``function_call``
    becomes its one tool call, and a ``function`` message the tool's answer to the call before it."""
    out, call_id = [], None
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "assistant" and m.get("function_call") is not None:
            fc = m["function_call"]
            if not isinstance(fc, dict) or not isinstance(fc.get("name"), str):
                raise _bad(f"messages[{i}].function_call", "must be an object with the function's 'name' and "
                           "'arguments'")
            call_id = f"call_{i}"
            m = {k: v for k, v in m.items() if k != "function_call"}
            m["tool_calls"] = [{"id": call_id, "type": "function",
                                "function": {"name": fc["name"], "arguments": fc.get("arguments") or "{}"}}]
        elif isinstance(m, dict) and m.get("role") == "function":
            m = {**m, "role": "tool", **({"tool_call_id": call_id} if call_id else {})}
        out.append(m)
    return out


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def reasoning_effort_kwargs(effort: Any, field: str) -> dict[str, Any]:
    """OpenAI's reasoning effort as chat-template variables: ``enable_thinking`` (false for "none"; Qwen3-style
    templates switch thinking on it) and ``reasoning_effort`` itself (gpt-oss-style templates write it), as
    vLLM passes it. Explicit chat_template_kwargs override both."""
    if effort is None:
        return {}
    if effort not in REASONING_EFFORTS:
        raise _bad(field, f"must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}")
    if effort == "none":
        return {"enable_thinking": False}
    return {"enable_thinking": True, "reasoning_effort": effort}


def parse_tools(tools: Any, field: str) -> list[dict] | None:
    """OpenAI function tools (``{"type": "function", "function": {"name", "description", "parameters"}}``)."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise _bad(field, f"must be an array of tools, got {_type(tools)}")
    out = []
    for i, t in enumerate(tools):
        where = f"{field}[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            kind = t.get("type") if isinstance(t, dict) else _type(t)
            raise _bad(where, f"tool of type {kind!r} is not supported (only function tools)", ErrorKind.UNSUPPORTED)
        f = t.get("function")
        if not isinstance(f, dict):
            raise _bad(f"{where}.function", "must be an object")
        name = f.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"{where}.function.name", "must be a nonempty string")
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _bad(f"{where}.function.parameters", "must be a JSON schema object")
        out.append({"type": "function", "function": f})
    return out


def parse_tool_choice(choice: Any, field: str) -> str:
    """"auto" or "none"; "required" and a named function need constrained decoding (not served yet)."""
    if choice is None or choice in ("auto", "none"):
        return choice or "auto"
    if choice == "required" or isinstance(choice, dict):
        raise _bad(field, "forcing a tool call ('required' or a named function) is not supported yet",
                   ErrorKind.UNSUPPORTED)
    raise _bad(field, f"must be 'none', 'auto', 'required' or a named function, got {choice!r}")


# -- completions -----------------------------------------------------------------------------------

def _constraint(body: dict) -> GrammarSpec | None:
    """OpenAI's response_format, or vLLM's / llama.cpp server's constraint fields (one of them)."""
    spec = parse_response_format(body.get("response_format"))
    return parse_extra_constraints(body, spec) or spec


def parse_completion(body: Any) -> CompletionRequest:
    if not isinstance(body, dict):
        raise _bad("body", f"must be a JSON object, got {_type(body)}")
    model = _string(body, "model", required=True)
    prompt = body.get("prompt")
    prompts: list[str | list[int]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [list(prompt)]
    elif (isinstance(prompt, list) and prompt and all(isinstance(p, list) and p for p in prompt)
          and all(isinstance(t, int) and not isinstance(t, bool) for p in prompt for t in p)):
        prompts = [list(p) for p in prompt]
    else:
        raise _bad("prompt", "must be a string, an array of strings, an array of token ids, "
                   "or an array of token-id arrays (non-empty)")
    if len(prompts) > MAX_N:
        raise _bad("prompt", f"at most {MAX_N} prompts per request")
    suffix = _string(body, "suffix")
    if suffix is not None and not all(isinstance(p, str) for p in prompts):
        raise _bad("suffix", "needs text prompts (the text before the completion), not token ids")
    n = _integer(body, "n", 1, MAX_N) or 1
    best_of = _integer(body, "best_of", 1, MAX_N) or n
    if best_of < n:
        raise _bad("best_of", f"must be at least n ({n}), got {best_of}")
    if best_of > n and _boolean(body, "stream"):
        raise _bad("best_of", "cannot be streamed: the best are known only at the end (as OpenAI's)")
    logprobs = _integer(body, "logprobs", 0, 5)
    stream = _boolean(body, "stream")
    echo = _boolean(body, "echo")
    # max_tokens 0 with echo scores the prompt (its logprobs with `logprobs`) and generates nothing.
    max_tokens = body.get("max_tokens")
    score_only = echo and isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens == 0
    if score_only:
        body = {k: v for k, v in body.items() if k != "max_tokens"}
    return CompletionRequest(
        model=model,
        prompts=prompts,
        options=_sampling(body, max_tokens_fields=("max_tokens",), logprobs=logprobs),
        stream=stream,
        include_usage=_stream_options(body, stream),
        echo=echo,
        response_format=_constraint(body),
        user=_string(body, "user"),
        score_only=score_only,
        suffix=suffix,
        extras=_extras(body, stream),
        best_of=best_of,
    )
