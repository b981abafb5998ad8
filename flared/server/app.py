"""The daemon's application: routes, admission, the frontend pool, health.

``ServingState`` is what route handlers share: the core's manifest, the
frontend, the model runtime, and the bounded pool of frontend workers that
render and tokenize off the event loop.

Admission (the reference's two levels):
- HTTP: before a generation request's body is read, it takes one of
  ``queue_capacity + max_active`` permits or gets 429 with the capacity hint.
  The permit lives until its response is completely written, so a finished but
  unread response still counts against it.
- Model: the runtime refuses a request (503) when its own queue is full or the
  model thread is dead; while shutting down or paused, generation gets 503.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import jinja2
import numpy as np
import torch

from flared.errors import AdmissionError, ErrorKind, FrontendError
from flared.frontend import ChatTemplate
from flared.frontend.fim import fim_prompt, fim_tokens
from flared.frontend.audio import decode_audio, media_kind
from flared.frontend.images import decode_image, image_processor_from_dict
from flared.frontend.video import DEFAULT_MAX_VIDEO_BYTES, decode_video_source
from flared.frontend.reasoning import reasoning_format_for_template
from flared.frontend.toolcalls import tool_parser_for_template
from flared.model.vision import mrope_positions
from flared.server.media import MediaFetcher, is_media_url
from flared.server.generation import Generation
from flared.server.http import HttpConfig, Request, Response, Router
from flared.runtime.request import VisionInput
from flared.runtime.worker import EmbeddingJob, PromptLogprobsJob, VisionJob
from flared.server.anthropic_routes import AnthropicRoutes
from flared.server.embeddings import EmbeddingRoutes
from flared.server.rerank import RerankRoutes
from flared.server.llamacpp_routes import LlamaCppRoutes
from flared.server.tokenize_routes import TokenizeRoutes
from flared.server.ollama_routes import OllamaRoutes
from flared.server.openai_routes import OpenAIRoutes
from flared.server.responses_routes import ResponsesRoutes
from flared.server.systemone_routes import SystemOneRoutes
from flared.server.openai_schema import _bad
from flared.server.structured import StructuredOutput


# Images: at most this many a request (by default; ServerConfig.max_images_per_request), each at most this many
# bytes (decoded from base64, or fetched). The HTTP body limit of a vision core grows by their base64 size.
MAX_IMAGES_PER_REQUEST = 8
IMAGE_BYTES_LIMIT = 10 << 20
# Videos (a Qwen, InternVL or LLaVA core's): at most this many a request, each at most this many bytes; the body
# limit grows by one video's base64 (a larger one travels as a file:// or http URL: ServerConfig's media settings).
MAX_VIDEOS_PER_REQUEST = 2
VIDEO_BYTES_LIMIT = DEFAULT_MAX_VIDEO_BYTES
# Recent images' tower rows kept for later requests (a conversation about one image re-sends it every turn).
IMAGE_ROWS_CACHE_BYTES = 256 << 20


# llama.cpp's media marker (mtmd_default_marker): where a /completion prompt object's multimodal_data go
MEDIA_MARKER = "<__media__>"


@dataclasses.dataclass(frozen=True)
class _MediaPrompt:
    """A llama.cpp prompt object's tokens and media, shaped as a rendered chat for ``vision_input``."""
    token_ids: list
    images: tuple
    vision: object


def image_parts(messages) -> list[tuple[str, dict]]:
    """Every image, audio or video part of a parsed conversation, in order: (its request field, the part)."""
    found = []
    if isinstance(messages, list):
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                found += [(part.get("param", "messages"), part) for part in content
                          if isinstance(part, dict) and part.get("type") in ("image", "audio", "video")]
    return found


_MEDIA_FOR_TEMPLATE = {"image": {"type": "image"},
                       # (Qwen2-Audio's template asks whether 'audio' is among the part's keys)
                       "audio": {"type": "audio", "audio": ""},
                       "video": {"type": "video"}}


def parts_for_template(messages, placeholders: dict[str, str] | None = None):
    """A vision or audio model's templates read content as a list of parts: string contents as one text part, and
    image parts as {"type": "image"} alone, audio parts as {"type": "audio", "audio": ""}, video parts as
    {"type": "video"} (the source stays with the request). ``placeholders``: the template reads content as a
    string (ChatTemplate.reads_content_parts false): each list of parts becomes one string, its parts joined by
    newlines, a media part as its processor's placeholder (by part type; vLLM's "string" content format)."""
    def media(p) -> bool:
        return isinstance(p, dict) and p.get("type") in _MEDIA_FOR_TEMPLATE

    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if placeholders is not None:
            if isinstance(content, list):
                m = {**m, "content": "\n".join(
                    placeholders.get(p["type"], "") if media(p) else p.get("text", "") if isinstance(p, dict)
                    else str(p) for p in content)}
        elif isinstance(content, str):
            m = {**m, "content": [{"type": "text", "text": content}]}
        elif isinstance(content, list):
            m = {**m, "content": [dict(_MEDIA_FOR_TEMPLATE[p["type"]]) if media(p) else p for p in content]}
        out.append(m)
    return out


class ServingState:
    def __init__(self, manifest, frontend, runtime, *, frontend_workers: int, http_permits: int):
        self.manifest = manifest
        self.frontend = frontend
        self.runtime = runtime
        self.vocab_size = int(manifest.model["vocab_size"])
        self.created = int(time.time())
        self.pool = ThreadPoolExecutor(max_workers=frontend_workers, thread_name_prefix="flared-frontend")
        self.frontend_workers = frontend_workers
        self.http_permits = http_permits
        self.http_in_use = 0
        self.frontend_busy = 0
        self.paused = False  # pause_admission / shutdown: new generation requests get 503
        self.metrics = None  # flared.server.metrics.ServerMetrics, set by the serving session
        # Tool-call and reasoning parser families (ServerConfig.tool_parser / reasoning_parser):
        # "auto" picks them from the chat template, "none" turns parsing off.
        self.tool_parser = "auto"
        # ServerConfig.lora_modules: model name -> (GenerateRequest.lora, adapter path)
        self.lora_modules: dict[str, tuple[int, str]] = {}
        self.runtime_lora_updating = False  # ServerConfig.runtime_lora_updating
        self.reasoning_parser = "auto"
        self.embedding_pooling = "last"  # ServerConfig.embedding_pooling
        self.trust_request_chat_template = False  # ServerConfig.trust_request_chat_template
        # Futures resolved when the last admitted request's permit is released
        # (ServingSession.wait_for_requests waits on one instead of polling).
        self.idle_waiters: list[asyncio.Future] = []
        # Grammar compiler for structured output (flared.server.structured), built on first use.
        self.structured = StructuredOutput(frontend, vocab_size=self.vocab_size,
                                           eos_token_ids=manifest.tokens.eos_token_ids)
        # The model's fill-in-the-middle tokens (flared.frontend.fim), or None.
        self.fim = fim_tokens(frontend.tokenizer)
        # The Files and Batch APIs' store and running batches (flared.server.batch_routes), set by build_router.
        self.batches = None
        self.message_batches = None  # Anthropic's Message Batches (flared.server.message_batches)
        self.web_ui = True  # ServerConfig.web_ui: the chat page at / (for browsers) and /ui
        self.scheme = "http"  # "https" where the listener speaks TLS (absolute URLs in answers use it)
        self.web_ui_page = None  # its handler, once build_router has added it
        # A vision-language core's image preparation (flared.frontend.images: TileProcessor, PatchProcessor), or None.
        self.image_processor = None
        self.image_token_id = -1
        self.media = MediaFetcher()  # image URLs (ServerConfig's media settings, set by the serving session)
        self.max_images = MAX_IMAGES_PER_REQUEST  # ServerConfig.max_images_per_request
        self._image_rows: collections.OrderedDict = collections.OrderedDict()  # identity -> tower rows
        self._image_rows_bytes = 0
        self.mrope_merge = 0  # Qwen VL: the patch merge of its 3D rope positions (0: plain positions)
        # A video core's preparation (flared.frontend.video: VideoProcessor, FrameVideoProcessor), or None.
        self.video_processor = None
        self.video_token_id = -1
        self.tokens_per_second = 0.0  # Qwen2.5-VL: rope positions a second of video advances (0: one a patch)
        self.max_videos = MAX_VIDEOS_PER_REQUEST
        # An audio model's clip preparation (flared.frontend.audio): the core's processor where it is an audio
        # model's, a second tower's beside the images (Gemma 4's); else None. Its token is audio_token_id.
        self.audio_processor = None
        self.audio_token_id = -1
        if manifest.vision is not None:
            self.image_processor = image_processor_from_dict(manifest.vision["processor"])
            config = manifest.vision["config"]
            self.image_token_id = int(config["image_token_id"])
            if self.image_processor.modality == "audio":
                self.audio_processor, self.audio_token_id = self.image_processor, self.image_token_id
            elif "audio" in manifest.vision:
                self.audio_processor = image_processor_from_dict(manifest.vision["audio"]["processor"])
                self.audio_token_id = int(manifest.vision["audio"]["config"]["image_token_id"])
            if config.get("mrope_section"):
                self.mrope_merge = int(config["scale_factor"])
            if "video" in manifest.vision:
                from flared.frontend.video import video_processor_from_dict

                self.video_processor = video_processor_from_dict(manifest.vision["video"])
                # (Qwen's and LLaVA-OneVision's videos fill their own token; InternVL's frames are image tiles)
                self.video_token_id = (int(config["video_token_id"]) if self.video_processor.fills_video_token
                                       else self.image_token_id)
                self.tokens_per_second = float(config.get("tokens_per_second", 0.0))

    # -- admission -----------------------------------------------------------------------------

    def admit(self, request: Request):
        """HTTP admission hook: runs on the event loop before the body is read."""
        if self.paused:
            raise AdmissionError("the server is not accepting new requests (paused or shutting down)",
                                 ErrorKind.UNAVAILABLE)
        if self.http_in_use >= self.http_permits:
            raise AdmissionError(f"too many requests in flight ({self.http_permits} admitted)",
                                 ErrorKind.HTTP_CAPACITY, hint=self.manifest.capacity_hint)
        self.http_in_use += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.http_in_use -= 1
                if self.http_in_use == 0 and self.idle_waiters:
                    waiters, self.idle_waiters = self.idle_waiters, []
                    for f in waiters:
                        if not f.done():
                            f.set_result(None)
        return release

    # -- frontend work, off the event loop -----------------------------------------------------

    async def _in_pool(self, fn):
        loop = asyncio.get_running_loop()
        self.frontend_busy += 1
        try:
            return await loop.run_in_executor(self.pool, fn)
        finally:
            self.frontend_busy -= 1

    async def prepare_chat(self, messages, *, media_options: dict | None = None, **kwargs):
        """Render and tokenize a chat on a frontend worker. Image parts ({"type": "image", "image": source,
        "param": where}, as the API parsers write them) are decoded and prepared there too, and their
        placeholders expanded: the result's ``images`` holds them (``vision_input`` runs the tower on them).
        ``media_options``: vLLM's ``mm_processor_kwargs`` (``media_processors``)."""
        images = image_parts(messages)
        processors = self.media_processors(media_options)
        if images:
            self._check_images(images)
        if self.image_processor is not None:
            template = kwargs.get("template") or self.frontend.chat_template
            as_string = template is not None and not template.reads_content_parts
            messages = parts_for_template(messages, self._placeholders(as_text=True) if as_string else None)

        def render():
            prepared = self._prepare_images(images, processors) if images else ()
            if prepared:
                kwargs["image_prompts"] = tuple(p.prompt for p in prepared)
                kwargs["image_placeholder"] = tuple(self._placeholders()[p.modality] for p in prepared)
            rendered = self.frontend.render_chat(messages, **kwargs)
            if rendered.media_order is not None:  # (the template wrote them in another order than the parts')
                prepared = tuple(prepared[i] for i in rendered.media_order)
            if self.image_processor is not None:
                self._check_media_tokens(rendered.token_ids, prepared)
            if not prepared:
                return rendered
            return dataclasses.replace(rendered, images=prepared, vision=self._image_layout(rendered, prepared))

        try:
            return await self._in_pool(render)
        except FrontendError as exc:
            # A template without tools fails on a tool-call history in its own words ("'dict object' has no
            # attribute 'content'"); say what the request asked of it.
            if (exc.kind is ErrorKind.TEMPLATE and _has_tool_turns(messages)
                    and self.tool_format(kwargs.get("template")) is None):
                err = AdmissionError("'messages': the conversation holds tool calls or tool results, and this "
                                     f"model's chat template has no tool-call format to render them ({exc})",
                                     ErrorKind.UNSUPPORTED)
                err.param = "messages"
                raise err from None
            raise

    # -- images (a vision-language core) -------------------------------------------------------------

    def _placeholders(self, *, as_text: bool = False) -> dict[str, str]:
        """What the chat template writes for each kind of media part the model takes; ``as_text``: what a part
        becomes in a template that reads content as a string (a processor's ``text_placeholder``, where it puts
        more around the placeholder: Qwen3-ASR's start and end tokens)."""
        out = {}
        for kind, p in ((self.image_processor.modality, self.image_processor), ("video", self.video_processor),
                        ("audio", self.audio_processor)):
            if p is not None:
                out[kind] = getattr(p, "text_placeholder", p.placeholder) if as_text else p.placeholder
        return out

    @property
    def _media_tokens(self) -> list[int]:
        """The prompt tokens media rows take: the image (or audio) token's, the video's, a second tower's audio."""
        return list(dict.fromkeys(t for t in (self.image_token_id, self.video_token_id, self.audio_token_id)
                                  if t >= 0))

    def _check_media_tokens(self, token_ids, prepared) -> None:
        """Every image (audio, video) token of a prompt must be one of its media's (a text that spells the token,
        or a media part a route does not read, would run the token's own embedding where an image should be)."""
        kind = "audio" if self.image_processor.modality == "audio" else "image"
        kinds = {self.image_token_id: kind}
        expected = {self.image_token_id: 0}
        if self.video_processor is not None:
            kinds[self.video_token_id] = "image or video" if self.video_token_id == self.image_token_id else "video"
            expected[self.video_token_id] = 0
        if self.audio_token_id >= 0:
            kinds[self.audio_token_id], expected[self.audio_token_id] = "audio", 0
        token_of = {"video": self.video_token_id, "audio": self.audio_token_id}
        for p in prepared:
            expected[token_of.get(p.modality, self.image_token_id)] += p.num_image_tokens
        for token, kind in kinds.items():
            found = token_ids.count(token)
            if found != expected[token]:
                media = {"audio": "clips", "image": "images", "video": "videos"}.get(kind, "images and videos")
                raise FrontendError(f"the prompt holds {found} {kind} tokens where its {media} make "
                                    f"{expected[token]} (a message's text may not spell an {kind} token, and this "
                                    f"route reads {media} only as the API's {kind} parts)", ErrorKind.VALIDATION)

    @property
    def _tower_loaded(self) -> bool:
        """The core has an image tower or audio encoder and the model thread loaded it."""
        return (self.image_processor is not None
                and getattr(getattr(self.runtime, "model", None), "vision", None) is not None)

    @property
    def takes_images(self) -> bool:
        return self._tower_loaded and self.image_processor.modality == "image"

    @property
    def takes_video(self) -> bool:
        """A vision model with a video preparation (Qwen, InternVL, LLaVA-OneVision), its tower loaded."""
        return self._tower_loaded and self.video_processor is not None

    @property
    def takes_audio(self) -> bool:
        """An audio model (flared.frontend.audio's processor), or a model with an audio tower beside its image
        tower (Gemma 4), whose encoder the model thread loaded."""
        return self._tower_loaded and self.audio_processor is not None

    @property
    def usage_audio_token(self) -> int:
        """The clip token a response's usage counts as ``audio_tokens`` (-1: the model takes no audio)."""
        return self.audio_token_id if self.takes_audio else -1

    def _check_images(self, images) -> None:
        modality = getattr(self.image_processor, "modality", None)
        taken = tuple(dict.fromkeys((modality, *(("video",) if self.video_processor is not None else ()),
                                     *(("audio",) if self.audio_processor is not None else ()))))
        for param, part in images:
            if self._tower_loaded and part.get("type") in taken:
                continue
            if self.image_processor is None:
                why = "this model takes text"
            elif part.get("type") not in taken:
                names = {"image": "images", "video": "video", "audio": "audio"}
                why = "this model takes text and " + " and ".join(names[t] for t in taken)
            else:
                tower = "image tower" if modality == "image" else "audio encoder"
                why = f"this server did not load the model's {tower}"
            kind = part.get("sent_as", part.get("type"))  # as the request named it (image_url, input_audio...)
            raise _bad(param, f"content part of type {kind!r} is not supported ({why})", ErrorKind.UNSUPPORTED)
        videos = [param for param, part in images if part.get("type") == "video"]
        others = [param for param, part in images if part.get("type") != "video"]
        other = {("image",): "image", ("audio",): "audio clip"}.get(tuple(t for t in taken if t != "video"),
                                                                     "image or audio clip")
        for found, limit, noun in ((others, self.max_images, other),
                                   (videos, self.max_videos, "video")):
            if len(found) > limit:
                raise _bad(found[limit], f"at most {limit} {noun}{'s' if limit != 1 else ''} a request")

    def media_processors(self, options: dict | None) -> tuple:
        """(image processor, video processor) for one request: the server's, with vLLM's ``mm_processor_kwargs``
        applied to each that reads them (their ``options``: a Qwen model's ``fps``, ``num_frames``,
        ``min_frames``, ``max_frames``, ``min_pixels`` / ``max_pixels`` for its images too; InternVL's ``fps``,
        ``num_frames``, ``max_frames``; Gemma 4's ``max_soft_tokens``; Llama 4's ``max_patches``); a key neither
        reads is a 400."""
        image, video = self.image_processor, self.video_processor
        if not options:  # (an object: openai_schema checks it)
            return image, video
        image_reads = tuple(getattr(image, "options", ()))
        video_reads = tuple(video.options) if video is not None else ()
        known = video_reads + tuple(k for k in image_reads if k not in video_reads)
        for key in options:
            if key not in known:
                reads = f"this model reads {', '.join(known)}" if known else "this model reads none"
                raise _bad(f"mm_processor_kwargs.{key}", f"is not supported ({reads})", ErrorKind.UNSUPPORTED)
        try:
            settings = {k: v for k, v in options.items() if k in image_reads}
            if settings:
                image = dataclasses.replace(image, **settings)
            settings = {k: v for k, v in options.items() if k in video_reads}
            if settings:
                video = dataclasses.replace(video, **settings)
        except FrontendError as exc:
            raise _bad("mm_processor_kwargs", str(exc).replace("image processor setting", "setting")) from None
        return image, video

    def _prepare_images(self, images, processors=None) -> tuple:
        """Decode and tile every image (on a frontend worker); a bad one is a 400 naming its part."""
        image_processor, video_processor = processors or (self.image_processor, self.video_processor)
        prepared, tokens = [], 0
        context = self.manifest.capacities.context_tokens
        for param, part in images:
            try:
                kind = part.get("type")
                source = part.get(kind)
                limit = VIDEO_BYTES_LIMIT if kind == "video" else IMAGE_BYTES_LIMIT
                if is_media_url(source):  # fetched (http, https) or read (file) here, on the frontend worker
                    source = self.media.fetch(source, max_bytes=limit, what=kind)
                if kind == "video":
                    image = video_processor.prepare(decode_video_source(source, max_bytes=limit),
                                                    max_tokens=context - 1 - tokens)
                elif kind == "audio":
                    image = self.audio_processor.prepare_in_request(
                        decode_audio(source, max_bytes=limit, format=part.get("format"),
                                     max_seconds=self.audio_processor.max_seconds), images=1)
                else:
                    image = image_processor.prepare_in_request(
                        decode_image(source, max_bytes=limit),
                        images=sum(p.get("type") not in ("video", "audio") for _, p in images))
            except FrontendError as exc:
                raise _bad(param, str(exc), exc.kind) from None
            tokens += image.num_image_tokens
            if tokens >= context:
                raise _bad(param, f"the media take {tokens} tokens, more than the context of {context} tokens "
                                  f"({self.manifest.context_hint})", ErrorKind.CONTEXT_LENGTH)
            prepared.append(image)
        return tuple(prepared)

    def _image_layout(self, rendered, images) -> VisionInput:
        """Where a rendered chat's images (videos, clips) sit (on the frontend worker): their tokens' positions,
        each one's span and identity, and Qwen VL's 3D rope positions; the rows come later (``vision_input``)."""
        ids = np.asarray(rendered.token_ids, dtype=np.int64)
        positions = np.flatnonzero(np.isin(ids, self._media_tokens))  # as many as the media make (checked before)
        counts = [image.num_image_tokens for image in images]
        starts = np.cumsum([0] + counts[:-1])
        spans = tuple((int(positions[s]), image.identity) for s, image in zip(starts, images))
        mrope, delta = None, 0
        if self.mrope_merge:  # Qwen VL: 3D rope positions, each image's tokens a block of its merged grid
            blocks = []
            for s, count, image in zip(starts, counts, images):
                t, h, w = image.grid
                groups = t if image.frames_apart else 1  # (Qwen3-VL: each temporal patch a block of its own)
                per = count // groups
                interval = None
                if image.modality == "video" and self.tokens_per_second:
                    interval = float(np.float32(image.seconds_per_grid)) * self.tokens_per_second
                for g in range(groups):
                    first = int(positions[s + g * per])
                    if positions[s + (g + 1) * per - 1] - first != per - 1:
                        raise FrontendError("an image's tokens are not contiguous in the prompt", ErrorKind.VALIDATION)
                    grid = (1, h, w) if image.frames_apart else image.grid
                    blocks.append((first, per, grid) if interval is None else (first, per, grid, interval))
            mrope, delta = mrope_positions(rendered.token_ids, blocks, self.mrope_merge)
        return VisionInput(positions, None, spans, mrope, delta)

    async def media_prompt(self, text: str, media: list, where: str) -> tuple[list[int], VisionInput | None]:
        """llama.cpp's prompt object, ``{"prompt_string", "multimodal_data"}``: ``text`` with a ``<__media__>``
        marker for each base64 item of ``media`` (images, or an audio model's clips, told apart by their bytes),
        each marker replaced by its media's prompt text, tokenized as a text prompt (the model's BOS); and the
        media's rows (``vision_input``). A count that disagrees, or media the model does not take, is a 400."""
        markers = text.count(MEDIA_MARKER)
        if markers != len(media):
            raise _bad(f"{where}.prompt_string", f"holds {markers} {MEDIA_MARKER} markers for {len(media)} "
                                                 "multimodal_data items (one each, in order)")
        if not media:
            return await self.encode(text), None
        parts = []
        for i, item in enumerate(media):
            at = f"{where}.multimodal_data[{i}]"
            if not isinstance(item, str) or not item:
                raise _bad(at, "must be a non-empty base64 string")
            kind = media_kind(item, getattr(self.image_processor, "modality", None) or "image")
            parts.append((at, {"type": kind, kind: item, "param": at, "sent_as": f"multimodal_data ({kind})"}))
        self._check_images(parts)
        add_bos = self.manifest.tokens.add_bos_token

        def render():
            prepared = self._prepare_images(parts)
            pieces = text.split(MEDIA_MARKER)
            expanded = pieces[0] + "".join(p.prompt + rest for p, rest in zip(prepared, pieces[1:]))
            ids = self.frontend.encode(expanded, add_special_tokens=add_bos)
            expected = sum(p.num_image_tokens for p in prepared)
            found = sum(ids.count(token) for token in self._media_tokens)
            if found != expected:
                raise FrontendError(f"'{where}.prompt_string': its text spells a media token (the prompt holds "
                                    f"{found} where its media make {expected})", ErrorKind.VALIDATION)
            rendered = _MediaPrompt(ids, prepared, None)
            return dataclasses.replace(rendered, vision=self._image_layout(rendered, prepared))

        rendered = await self._in_pool(render)
        return list(rendered.token_ids), await self.vision_input(rendered)

    async def vision_input(self, rendered, cut: int = 0):
        """The images of a rendered chat through the image tower (on the model thread, between its steps), as the
        GenerateRequest's ``vision``; None for a chat without images. ``cut``: prompt tokens dropped from the
        front (truncation); a cut into an image is a 400."""
        if not rendered.images:
            return None
        rows = await self.image_rows(rendered.images)
        features = torch.cat(rows) if len(rows) > 1 else rows[0]
        vision = dataclasses.replace(rendered.vision, features=features).shifted(cut)
        if vision is None:
            raise _bad("truncate_prompt_tokens", "the cut would fall inside an image")
        return vision

    async def image_rows(self, images) -> list:
        """Each image's rows from the image tower, the same image's (by identity) from a bounded LRU cache of
        recent ones: a conversation about one image runs the tower once, not at every turn."""
        have = {image.identity: self._image_rows[image.identity] for image in images
                if image.identity in self._image_rows}
        unique = list({image.identity: image for image in images if image.identity not in have}.values())
        if unique:
            for image, rows in zip(unique, await self._run_job(lambda done: VisionJob(unique, done))):
                have[image.identity] = rows
                self._remember_rows(image.identity, rows)
        for identity in have:
            if identity in self._image_rows:
                self._image_rows.move_to_end(identity)
        return [have[image.identity] for image in images]

    def _remember_rows(self, identity: bytes, rows) -> None:
        if identity in self._image_rows:  # two requests ran one new image at once
            return
        nbytes = rows.numel() * rows.element_size()
        self._image_rows[identity] = rows
        self._image_rows_bytes += nbytes
        while self._image_rows_bytes > IMAGE_ROWS_CACHE_BYTES and len(self._image_rows) > 1:
            _, old = self._image_rows.popitem(last=False)
            self._image_rows_bytes -= old.numel() * old.element_size()

    def _template_source(self, template=None) -> str | None:
        template = template if template is not None else self.frontend.chat_template
        return template.source if template is not None else None

    def tool_format(self, template=None):
        """The tool-call parser class this model's template (or a request's own ``template``) implies, or the
        config's tool_parser names; None when it has no tool-call format."""
        return tool_parser_for_template(self._template_source(template), self.tool_parser)

    def reasoning_format(self, template=None):
        """The reasoning format this model's template (or a request's ``template``) implies (or the config's
        reasoning_parser names)."""
        return reasoning_format_for_template(self._template_source(template), self.reasoning_parser)

    def request_template(self, source: str | None):
        """A request's own chat template (vLLM's chat_template field), compiled; None when it brought none. A
        400 unless the config trusts request templates, or when it does not compile."""
        if source is None:
            return None
        if not self.trust_request_chat_template:
            err = AdmissionError("'chat_template': this server does not take chat templates in requests (its "
                                 "config's trust_request_chat_template is off)", ErrorKind.UNSUPPORTED)
            err.param = "chat_template"
            raise err
        try:
            return ChatTemplate(source)  # compiled once per distinct source (a bounded cache)
        except jinja2.TemplateError as exc:
            err = AdmissionError(f"'chat_template': does not compile: {exc}", ErrorKind.TEMPLATE)
            err.param = "chat_template"
            raise err from None

    async def encode(self, text: str, *, add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of a prompt; special tokens (the BOS) as the model's prompts take them unless told."""
        add = self.manifest.tokens.add_bos_token if add_special_tokens is None else add_special_tokens
        return await self._in_pool(lambda: self.frontend.encode(text, add_special_tokens=add))

    async def decode(self, token_ids: list[int]) -> str:
        return await self._in_pool(lambda: self.frontend.decode(token_ids))

    async def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token's own text, decoded on a frontend worker (a prompt may hold thousands)."""
        return await self._in_pool(lambda: [self.frontend.decode([t]) for t in token_ids])

    async def fim_prompt(self, prefix: str, suffix: str, *, field: str = "suffix",
                         extra: list[tuple[str, str]] = ()) -> list[int]:
        """Token ids that ask the model for the text between ``prefix`` and ``suffix``; a 400 naming ``field``
        when the model was not trained for it."""
        fim = self.fim
        if fim is None:
            err = AdmissionError(f"'{field}': this model has no fill-in-the-middle tokens (such as <|fim_prefix|>, "
                                 "<fim_prefix>), so it cannot complete between a prefix and a suffix",
                                 ErrorKind.UNSUPPORTED)
            err.param = field
            raise err
        t = self.manifest.tokens
        bos = [t.bos_token_id] if t.add_bos_token and t.bos_token_id is not None else []
        encode = lambda text: self.frontend.encode(text, add_special_tokens=False)  # noqa: E731
        return await self._in_pool(lambda: fim_prompt(fim, encode, prefix, suffix, extra=extra, bos=bos))

    async def embed(self, token_lists: list[list[int]], *, normalize: bool = True):
        """Pooled embeddings of token sequences (float32 [n, hidden], CPU), computed on the model thread
        between its steps. Every sequence must fit the context (the routes check and say which)."""
        return await self._run_job(lambda done: EmbeddingJob(token_lists, self.embedding_pooling, normalize, done))

    async def next_token_logits(self, token_lists: list[list[int]], token_ids: tuple[int, ...]):
        """The logits of ``token_ids`` for the token after each sequence (float32 [n, len(token_ids)], CPU),
        computed on the model thread between its steps as embeddings are (the final-normed last hidden state
        through those LM-head rows). Every sequence must fit the context."""
        return await self._run_job(lambda done: EmbeddingJob(token_lists, "last", False, done, project=token_ids,
                                                             counter="relevance"))

    async def prompt_logprobs(self, token_ids: list[int], top: int) -> list:
        """Each prompt token's logprob after the first, with ``top`` alternatives (DecoderModel.prompt_logprobs),
        computed on the model thread between its steps."""
        return await self._run_job(lambda done: PromptLogprobsJob(list(token_ids), top, done))

    async def _run_job(self, make):
        if self.paused:
            raise AdmissionError("the server is not accepting new requests (paused or shutting down)",
                                 ErrorKind.UNAVAILABLE)
        loop = asyncio.get_running_loop()
        result = loop.create_future()

        def settle(value, error) -> None:  # on the event loop
            if result.done():
                return
            if error is not None:
                result.set_exception(error)
            else:
                result.set_result(value)

        def done(value, error) -> None:  # on the model thread
            try:
                loop.call_soon_threadsafe(settle, value, error)
            except RuntimeError:  # the loop is closed: nobody is waiting
                pass

        self.runtime.submit_job(make(done))
        return await result

    def start(self, requests, stop_strings, *, skip_special_tokens: bool = True,
              include_stop_str: bool = False) -> Generation:
        if self.paused:
            raise AdmissionError("the server is not accepting new requests (paused or shutting down)",
                                 ErrorKind.UNAVAILABLE)
        return Generation(self.runtime, self.frontend, requests, stop_strings, metrics=self.metrics,
                          skip_special_tokens=skip_special_tokens, include_stop_str=include_stop_str)

    def close(self) -> None:
        for batches in (self.batches, self.message_batches):
            if batches is not None:
                batches.close()
        self.pool.shutdown(wait=False, cancel_futures=True)


def _has_tool_turns(messages) -> bool:
    return isinstance(messages, list) and any(
        isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool") for m in messages)


def build_router(state: ServingState) -> Router:
    router = Router()

    async def health(request: Request) -> Response:
        ok, why = state.runtime.health()
        if ok:
            return Response.json({"status": "ok"})
        return Response.json({"status": why}, status=503)

    router.add("GET", "/health", health, public=True)
    router.add(("GET", "POST"), "/ping", health, public=True)  # vLLM's (SageMaker's) name for the same check

    async def version(request: Request) -> Response:
        from flared import __version__

        return Response.json({"version": __version__})

    router.add("GET", "/version", version)
    if state.web_ui:
        state.web_ui_page = _add_web_ui(router)
    if state.metrics is not None:
        from flared.server.metrics import metrics_route

        router.add("GET", "/metrics", metrics_route(state.metrics), public=True)
    OpenAIRoutes(state).register(router)
    from flared.server.audio_routes import AudioRoutes

    AudioRoutes(state).register(router)
    AnthropicRoutes(state).register(router)
    OllamaRoutes(state).register(router)
    ResponsesRoutes(state).register(router)
    EmbeddingRoutes(state).register(router)
    RerankRoutes(state).register(router)
    TokenizeRoutes(state).register(router)
    LlamaCppRoutes(state).register(router)
    SystemOneRoutes(state).register(router)
    from flared.server.decisions_routes import DecisionsRoutes

    DecisionsRoutes(state).register(router)
    from flared.server.batch_routes import BatchRoutes

    state.batches = BatchRoutes(state, router)  # its lines run through the routes above
    state.batches.register(router)
    from flared.server.message_batches import MessageBatchRoutes

    state.message_batches = MessageBatchRoutes(state, router)
    state.message_batches.register(router)
    return router


def _add_web_ui(router: Router):
    """The chat page at / (flared.server.webui), public like /health: it holds nothing, and its API calls carry
    the key the user types in. Its policy lets it load only its own script and talk only to this server."""
    from importlib.resources import files

    ui = files("flared.server.webui")
    page = ui.joinpath("index.html").read_bytes()
    script = ui.joinpath("chat.js").read_bytes()
    guard = [("x-content-type-options", "nosniff"), ("cache-control", "no-cache"),
             ("content-security-policy", "default-src 'self'; style-src 'self' 'unsafe-inline'; "
                                         "img-src 'self' data:; media-src 'self' data:; frame-ancestors 'none'")]

    async def index(request: Request) -> Response:
        return Response(page, headers=guard, media_type="text/html; charset=utf-8")

    async def chat_js(request: Request) -> Response:
        return Response(script, headers=guard, media_type="text/javascript; charset=utf-8")

    # "/" itself is Ollama's "Ollama is running" (its clients probe it): a browser asking for HTML gets the page
    # there (ollama_routes.OllamaRoutes.root), and /ui always
    router.add("GET", "/ui", index, public=True)
    router.add("GET", "/ui/chat.js", chat_js, public=True)
    return index


def http_config(config, manifest) -> HttpConfig:
    body_limit = config.body_limit_bytes or (1 << 20) + 32 * manifest.capacities.context_tokens
    if manifest.vision is not None and not config.body_limit_bytes:  # base64 images
        body_limit += config.max_images_per_request * (IMAGE_BYTES_LIMIT * 4 // 3 + 1024)
        if "video" in manifest.vision:  # and one video's
            body_limit += VIDEO_BYTES_LIMIT * 4 // 3 + 1024
    return HttpConfig(
        host=config.host, port=config.port, body_limit_bytes=body_limit,
        header_timeout_s=config.header_timeout_s, keep_alive_timeout_s=config.keep_alive_timeout_s,
        max_connections=config.max_connections, shutdown_grace_s=config.shutdown_grace_s,
        api_key=config.api_key, cors_allow_origins=config.cors_allow_origins, ssl=config.ssl_context())
