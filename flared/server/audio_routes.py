"""OpenAI's audio routes, served by an audio-language model (Qwen2-Audio, Audio Flamingo 3, GLM-ASR, Gemma 4 E2B/E4B,
Qwen3-ASR):

    POST /v1/audio/transcriptions   multipart/form-data: file, model, language, prompt, response_format,
                                    temperature, stream (and vLLM's seed, max_completion_tokens) -> the text
    POST /v1/audio/translations     the same, the text in English

An audio-language model has no transcription head: the clip is asked about as a chat turn (the clip, then the
instruction "Transcribe the input speech." / "Translate the input speech into English.", the language where the
request names one, the request's ``prompt`` after it) through the model's own template, greedy unless a
``temperature`` is given, and the answer is the transcript. A recording longer than the model's clip (Qwen2-Audio:
30 s) is cut into pieces it takes, each cut at the quietest tenth of a second in the two seconds before the limit
(as vLLM cuts long audio for Whisper), the pieces asked at once and their transcripts joined in order.
A speech recogniser (Qwen3-ASR: its processor's kind ``qwen3_asr``) is asked as its own package asks it: the
request's ``prompt`` as the system turn (its context), the clip alone as the user turn, and a named language forced by
starting the answer with ``language <Name><asr_text>``; it answers ``language <Name><asr_text>`` then the transcript,
whose prefix is taken off (``AsrAnswer``; the language it heard goes into ``verbose_json``). It does not translate.
``response_format`` ``json`` (the default), ``text`` and ``verbose_json`` (task, language, duration, text; no
segments: the model gives no timestamps) are answered;
``srt`` and ``vtt``, and ``timestamp_granularities``, need timestamps and are a 400. ``stream=true`` answers
OpenAI's ``transcript.text.delta`` events, then ``transcript.text.done`` with the text and usage.
"""

from __future__ import annotations

import asyncio
from typing import Any

from flared.errors import ErrorKind, FrontendError
from flared.frontend.audio import DecodedAudio, decode_audio, resample, split_clip
from flared.runtime.request import GenerateRequest
from flared.server.batch_routes import parse_multipart
from flared.server.generation import Generation
from flared.server.http import Request, Response, ResponseWriter, Router, StreamingResponse
from flared.server.http.messages import ClientDisconnected
from flared.server.openai_routes import OutputShape, _send_stream_error, _stop_ids, check_model, sampling_params
from flared.server.openai_schema import SamplingOptions, _bad

AUDIO_FILE_LIMIT = 25 << 20  # OpenAI's: 25 MB a file
MAX_RECORDING_SECONDS = 3600  # a recording is decoded no further (25 MB of MP3 at 64 kbit/s: 52 minutes)
FORMATS = ("json", "text", "verbose_json")
TIMED_FORMATS = ("srt", "vtt")
INSTRUCTIONS = {"transcribe": "Transcribe the input speech.", "translate": "Translate the input speech into English."}
# ISO-639-1 codes -> the names the instruction uses (Whisper's languages most asked for; another code is named
# as sent)
LANGUAGES = {
    "en": "English", "zh": "Chinese", "de": "German", "es": "Spanish", "ru": "Russian", "ko": "Korean",
    "fr": "French", "ja": "Japanese", "pt": "Portuguese", "tr": "Turkish", "pl": "Polish", "ca": "Catalan",
    "nl": "Dutch", "ar": "Arabic", "sv": "Swedish", "it": "Italian", "id": "Indonesian", "hi": "Hindi",
    "fi": "Finnish", "vi": "Vietnamese", "he": "Hebrew", "uk": "Ukrainian", "el": "Greek", "ms": "Malay",
    "cs": "Czech", "ro": "Romanian", "da": "Danish", "hu": "Hungarian", "ta": "Tamil", "no": "Norwegian",
    "th": "Thai", "ur": "Urdu", "hr": "Croatian", "bg": "Bulgarian", "lt": "Lithuanian", "la": "Latin",
    "cy": "Welsh", "sk": "Slovak", "te": "Telugu", "fa": "Persian", "lv": "Latvian", "bn": "Bengali",
    "sr": "Serbian", "az": "Azerbaijani", "sl": "Slovenian", "kn": "Kannada", "et": "Estonian", "mk": "Macedonian",
    "eu": "Basque", "is": "Icelandic", "hy": "Armenian", "ne": "Nepali", "mn": "Mongolian", "bs": "Bosnian",
    "kk": "Kazakh", "sq": "Albanian", "sw": "Swahili", "gl": "Galician", "mr": "Marathi", "pa": "Punjabi",
    "af": "Afrikaans", "tl": "Tagalog", "yue": "Cantonese",
}


def _text(fields: dict, name: str) -> str | None:
    if name not in fields:
        return None
    return fields[name][1].decode("utf-8", "replace").strip()


def _flag(fields: dict, name: str) -> bool:
    value = _text(fields, name)
    if value is None or value.lower() in ("false", "0", ""):
        return False
    if value.lower() in ("true", "1"):
        return True
    raise _bad(name, f"must be true or false, got {value!r}")


def _number(fields: dict, name: str, lo: float, hi: float, kind=float):
    value = _text(fields, name)
    if value is None or value == "":
        return None
    try:
        number = kind(value)
    except ValueError:
        raise _bad(name, f"must be {'an integer' if kind is int else 'a number'}, got {value!r}") from None
    if not lo <= number <= hi:
        raise _bad(name, f"must be between {lo} and {hi}, got {value}")
    return number


class AudioRoutes:
    def __init__(self, state):
        self.state = state

    def register(self, router: Router) -> None:
        for task, path in (("transcribe", "/v1/audio/transcriptions"), ("translate", "/v1/audio/translations")):
            async def handler(request: Request, task=task):
                return await self._answer(request, task)

            router.add("POST", path, handler, admit=True, body_limit=AUDIO_FILE_LIMIT + (1 << 20))

    async def _answer(self, request: Request, task: str):
        state = self.state
        loop = asyncio.get_running_loop()
        fields = await loop.run_in_executor(None, parse_multipart, request.header("content-type"),
                                            request.body or b"", "the 'file' and 'model' fields")
        model = _text(fields, "model")
        if not model:
            raise _bad("model", "is required")
        check_model(state, model)
        if "file" not in fields:
            raise _bad("file", "is required (a multipart field holding the audio file)")
        if not state.takes_audio:
            takes = "text and images" if state.takes_images else "text"
            raise _bad("file", f"this model takes {takes}, not audio: transcription needs an audio-language model",
                       ErrorKind.UNSUPPORTED)
        response_format = _text(fields, "response_format") or "json"
        if response_format in TIMED_FORMATS:
            raise _bad("response_format", f"{response_format!r} needs timestamps, which this model does not give "
                                          f"(one of {', '.join(FORMATS)})", ErrorKind.UNSUPPORTED)
        if response_format not in FORMATS:
            raise _bad("response_format", f"must be one of {', '.join(FORMATS)}, got {response_format!r}")
        for name in ("timestamp_granularities[]", "timestamp_granularities"):
            if _text(fields, name):
                raise _bad(name, "needs timestamps, which this model does not give", ErrorKind.UNSUPPORTED)
        language = _text(fields, "language") or None
        if language is not None and (not language.isalpha() or not 2 <= len(language) <= 3):
            raise _bad("language", f"must be an ISO-639-1 code such as 'en', got {language!r}")
        temperature = _number(fields, "temperature", 0.0, 2.0)
        seed = _number(fields, "seed", -(1 << 63), (1 << 64) - 1, int)
        max_tokens = _number(fields, "max_completion_tokens", 1, 1 << 31, int)
        stream = _flag(fields, "stream")
        hint = _text(fields, "prompt") or ""

        processor = state.audio_processor
        recogniser = processor.kind == "qwen3_asr"  # (a speech recogniser's own prompt: AsrAnswer)
        if recogniser and task == "translate":
            raise _bad("model", "this model transcribes speech in its own language; it does not translate it (ask "
                                "/v1/audio/transcriptions)", ErrorKind.UNSUPPORTED)
        _, data = fields["file"]

        def read():
            clip = decode_audio(data, max_bytes=AUDIO_FILE_LIMIT, max_seconds=MAX_RECORDING_SECONDS)
            if clip.seconds > MAX_RECORDING_SECONDS:
                raise FrontendError(f"the audio is {clip.seconds:.1f} s long; transcriptions take at most "
                                    f"{MAX_RECORDING_SECONDS // 60} minutes", ErrorKind.VALIDATION)
            samples = resample(clip.samples, clip.sample_rate, processor.sampling_rate)
            return clip, split_clip(samples, processor.sampling_rate, processor.max_seconds,
                                    min_samples=processor.min_samples)
        try:
            clip, pieces = await state._in_pool(read)
        except FrontendError as exc:
            raise _bad("file", str(exc), exc.kind) from None
        if not pieces:
            raise _bad("file", f"the audio is too short ({clip.seconds * 1000:.1f} ms) for this model to hear")
        instruction = INSTRUCTIONS[task]
        if language is not None and task == "transcribe":
            instruction += f" The speech is in {LANGUAGES.get(language.lower(), language)}."
        if hint:
            instruction += "\n" + hint

        def turns(piece) -> tuple[list, dict]:
            """The chat asking for one piece's transcript, and how it is rendered."""
            audio = {"type": "audio", "audio": DecodedAudio(piece, processor.sampling_rate), "format": None,
                     "param": "file", "sent_as": "file"}
            if not recogniser:
                return [{"role": "user", "content": [audio, {"type": "text", "text": instruction}]}], {
                    "add_generation_prompt": True}
            chat = [{"role": "system", "content": [{"type": "text", "text": hint}]},
                    {"role": "user", "content": [audio]}]
            if language is None:
                return chat, {"add_generation_prompt": True}
            forced = f"language {LANGUAGES.get(language.lower(), language)}{AsrAnswer.MARK}"
            return [*chat, {"role": "assistant", "content": [{"type": "text", "text": forced}]}], {
                "add_generation_prompt": False, "continue_final_message": True}
        opts = SamplingOptions(max_tokens=max_tokens, temperature=0.0 if temperature is None else temperature,
                               top_p=None, top_k=None, min_p=None, presence_penalty=0.0, frequency_penalty=0.0,
                               repetition_penalty=None, seed=seed, logit_bias=None, logprobs=None, stop=(),
                               stop_token_ids=(), ignore_eos=False, n=1)
        # (a recording longer than the model's clip: each piece asked alone, all prepared and through the encoder
        # at once)
        renders = await asyncio.gather(*(state.prepare_chat(chat, **how) for chat, how in map(turns, pieces)))
        visions = await asyncio.gather(*(state.vision_input(rendered) for rendered in renders))
        shape = OutputShape(state, renders[0].text, None)
        requests = [GenerateRequest(prompt_token_ids=tuple(r.token_ids), message_endpoints=r.message_endpoints,
                                    params=sampling_params(state, opts, len(r.token_ids), None, k),
                                    stop_token_ids=_stop_ids(state, opts), vision=vision)
                    for k, (r, vision) in enumerate(zip(renders, visions))]
        audio_tokens = sum(image.num_image_tokens for r in renders for image in r.images)
        gen = state.start(requests, ())
        request.disconnected.add_callback(gen.cancel)
        answers = [AsrAnswer(forced=language is not None) if recogniser else None for _ in pieces]
        if stream:
            return StreamingResponse(lambda w: self._stream(gen, w, shape, audio_tokens, answers),
                                     headers=[("cache-control", "no-cache")])
        texts = []
        for (text, _ids, _lps, _finish), answer in zip(await gen.collect(), answers):
            text = shape.parse(text)[0].content
            texts.append((answer.push(text) + answer.finish() if answer is not None else text).strip())
        text = " ".join(t for t in texts if t)
        heard = next((a.language for a in answers if a is not None and a.language), None)
        if response_format == "text":
            return Response((text + "\n").encode(), media_type="text/plain; charset=utf-8")
        body: dict[str, Any] = {"text": text, "usage": _usage(gen, audio_tokens)}
        if response_format == "verbose_json":
            body = {"task": "transcribe" if task == "transcribe" else "translate",
                    "language": LANGUAGES.get(language.lower(), language).lower() if language
                    else ("english" if task == "translate" else heard and heard.lower()),
                    "duration": round(clip.seconds, 3), **body}
        return Response.json(body)

    async def _stream(self, gen: Generation, w: ResponseWriter, shape: OutputShape, audio_tokens: int,
                      answers: list) -> None:
        """The pieces' transcripts in order: the first piece's as it comes, a later one's held until those before
        it end (they run at once), each after a space."""
        n = gen.num_choices
        parsers = [shape.parser() if shape.active else None for _ in range(n)]
        held: list[list[str]] = [[] for _ in range(n)]
        done = [False] * n
        said = [False] * n  # (a piece's text has begun: its leading space is out)
        pieces: list[str] = []
        current = 0

        async def say(k: int, text: str) -> None:
            if not said[k]:
                text = text.lstrip()
                if not text:
                    return
                if pieces:
                    text = " " + text
                said[k] = True
            pieces.append(text)
            await w.send_json_event({"type": "transcript.text.delta", "delta": text})

        try:
            async for d in gen.deltas():
                k, parser, text = d.index, parsers[d.index], d.text
                if parser is not None:
                    text = parser.push(text).content if text else ""
                    if d.finish_reason is not None:
                        text += parser.finish().content
                if answers[k] is not None:
                    text = answers[k].push(text) + (answers[k].finish() if d.finish_reason is not None else "")
                if k == current:
                    if text:
                        await say(k, text)
                elif text:
                    held[k].append(text)
                if d.finish_reason is not None:
                    done[k] = True
                while current < n and done[current]:  # the next piece's held text, then it goes on live
                    current += 1
                    if current < n:
                        for text in held[current]:
                            await say(current, text)
                        held[current] = []
            await w.send_json_event({"type": "transcript.text.done", "text": "".join(pieces).rstrip(),
                                     "usage": _usage(gen, audio_tokens)})
            await w.send_event("[DONE]")
        except ClientDisconnected:
            gen.cancel()
        except Exception as exc:  # the stream has started: report in-band, then end it
            gen.cancel()
            await _send_stream_error(w, exc)


class AsrAnswer:
    """A speech recogniser's answer (Qwen3-ASR's): ``language <Name><asr_text>`` then the transcript, or the
    transcript alone where the prompt forced the language (``forced``). ``push`` passes the transcript's text on,
    holding back what may still be the prefix; ``language`` is the name the model heard (None for "None": no
    speech). A text that cannot begin that prefix goes through as it is."""

    MARK = "<asr_text>"
    _WORD = "language"

    def __init__(self, *, forced: bool):
        self.held: str | None = None if forced else ""  # (None: the prefix is past)
        self.language: str | None = None

    def push(self, text: str) -> str:
        if self.held is None:
            return text
        self.held += text
        at = self.held.find(self.MARK)
        if at >= 0:
            head, rest = self.held[:at].strip(), self.held[at + len(self.MARK):]
            self.held = None
            if head.startswith(self._WORD):
                name = head[len(self._WORD):].strip()
                self.language = name if name and name != "None" else None
                return rest
            return head + rest  # (a mark without the prefix: the text is the model's)
        if not self._may_be_prefix(self.held):
            text, self.held = self.held, None
            return text
        return ""

    def finish(self) -> str:
        """What is still held at the answer's end: nothing where it is an unfinished prefix."""
        held, self.held = self.held or "", None
        return "" if self._may_be_prefix(held) else held

    def _may_be_prefix(self, text: str) -> bool:
        """``text`` may still be ``language <Name>`` (a name is one word, short)."""
        start = text.lstrip()
        if len(start) <= len(self._WORD):
            return self._WORD.startswith(start)
        return start.startswith(self._WORD + " ") and len(start.split()) <= 2 and len(start) <= 40


def _usage(gen: Generation, audio_tokens: int) -> dict[str, Any]:
    """OpenAI's token usage of a transcription: the prompts' tokens (the clip's audio tokens among them) and the
    transcript's, over the recording's pieces."""
    prompt = sum(gen.choice_usage(k).num_prompt_tokens for k in range(gen.num_choices))
    output = sum(gen.choice_usage(k).num_generated_tokens for k in range(gen.num_choices))
    return {"type": "tokens", "input_tokens": prompt, "output_tokens": output, "total_tokens": prompt + output,
            "input_token_details": {"audio_tokens": audio_tokens, "text_tokens": prompt - audio_tokens}}

