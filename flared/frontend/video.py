"""Video a client sends, decoded and turned into what a vision tower reads (on a frontend worker).

    VideoProcessor         the Qwen families' video preparation: frames sampled at ``fps`` a second, resized
                           (transformers' Qwen2VLVideoProcessor / Qwen3VLVideoProcessor, pixel for pixel: torch's
                           antialiased bicubic on uint8 frames, the fused rescale-normalize), patched as the
                           tower reads them, and the prompt text (Qwen3-VL: a timestamp before each frame pair)
    FrameVideoProcessor    InternVL's and LLaVA-OneVision's: a few frames, each one tile of the tower
                           (InternVLVideoProcessor, LlavaOnevisionVideoProcessor), and their prompt text
    PooledVideoProcessor   Gemma 4's: frames evenly apart, each sized as its images are at a smaller budget and
                           patched as they are (Gemma4VideoProcessor), a timestamp before each frame's tokens
    probe_video(data)      a container's first video stream: frames, rate, shown size and rotation (its first
                           frame decoded for the display matrix, no more)

A prepared video travels the path a prepared image does (flared.frontend.images.PreparedImage): its patches or
tiles in ``pixel_values``, the text that replaces its placeholder, its tokens' count and its identity (the file's
digest and the settings), so the tower, the LRU of recent rows and the prefix cache treat a video as a tall image
whose frames attend apart.

Frames are sampled as the model authors' own preparation does: Qwen2-VL and Qwen2.5-VL as qwen-vl-utils
(``fps`` frames a second, 4 to 768, an even count, evenly spread over the whole video), Qwen3-VL, InternVL and
LLaVA-OneVision as transformers' video processors. A Qwen frame's size follows the per-video pixel budget
(``cap_pixels_per_frame``, the qwen-vl-utils behaviour transformers makes its default): a long video gets smaller
frames, not more tokens than a context holds. A video stored sideways (a display matrix) is turned as players show
it. Only the sampled frames are converted and each is resized as it is decoded.

Containers and codecs are FFmpeg's, through PyAV (MP4/MOV, WebM/Matroska, AVI, MPEG-TS, Ogg, GIF; H.264, HEVC,
VP8/9, AV1, MPEG-4...). Anything it cannot read is a 400 that says so.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from flared.errors import ErrorKind, FrontendError
from flared.frontend.images import (
    BICUBIC,
    CANVAS_END_TOKEN,
    CANVAS_IMAGE_TOKEN,
    CANVAS_START_TOKEN,
    CLIP_MEAN,
    CLIP_STD,
    MAX_ASPECT_RATIO,
    POOLED_BOI_TOKEN,
    POOLED_EOI_TOKEN,
    QWEN_MEAN,
    QWEN_STD,
    PreparedImage,
    _check_pixel_settings,
    _error,
    _field_error,
    _finite,
    _hf_config,
    _mib,
    _pixel_settings,
    _positive_int,
    _Settings,
    _shortest_edge_size,
    _soft_tokens,
    pooled_size,
    source_bytes,
)

DEFAULT_MAX_VIDEO_BYTES = 32 << 20  # a video's file (the server's limit: flared.server.app)
MAX_FRAME_PIXELS = 8192 * 8192  # a frame larger than this is refused before decoding
MAX_VIDEO_FRAMES = 108_000  # frames a video may hold (an hour at 30 frames a second): all are demuxed, some decoded
DEFAULT_VIDEO_FPS = 24.0  # a stream that states no rate (transformers' default too)
_VIDEO_MEDIA = {"video/mp4", "video/quicktime", "video/webm", "video/x-matroska", "video/matroska", "video/avi",
                "video/x-msvideo", "video/mpeg", "video/mp2t", "video/ogg", "video/3gpp", "video/x-flv", "image/gif",
                "application/octet-stream"}
_SUPPORTED = "send an MP4, MOV, WebM, MKV, AVI or GIF video"

# transformers' class defaults where a checkpoint ships no video_preprocessor_config.json (qwen-vl-utils' constants)
QWEN2_VIDEO_PIXELS = (128 * 28 * 28, 768 * 28 * 28)
QWEN3_VIDEO_PIXELS = (128 * 32 * 32, 768 * 32 * 32)
QWEN2_VIDEO_TOKENS = 128000  # the whole video's token budget (Qwen2/2.5: 90% of it, in pixels, spread over frames)
QWEN3_VIDEO_TOKENS = 768  # one frame's token ceiling (Qwen3-VL)


@dataclass(frozen=True)
class VideoInfo:
    total_frames: int
    fps: float  # the stream's average rate (frames a second)
    width: int  # as shown: a frame's, turned by ``rotation``
    height: int
    # quarter turns counterclockwise the frames are shown with (the stream's display matrix: a phone's portrait
    # video stored sideways), as FFmpeg's players turn them
    rotation: int = 0


def _container(data: bytes):
    try:
        import av
    except ImportError:  # pragma: no cover - a dependency
        raise _error("this server cannot decode video (the PyAV package is missing)", ErrorKind.UNSUPPORTED) from None
    try:
        container = av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except Exception as exc:  # noqa: BLE001 - FFmpeg's errors (av.error.*), whatever the bytes were
        raise _error(f"the video could not be read ({_reason(exc)}); {_SUPPORTED}") from None
    if not container.streams.video:
        container.close()
        raise _error("the file holds no video stream")
    container.streams.video[0].thread_type = "AUTO"  # (FFmpeg's threaded decoding: the same frames, on every core)
    return container


def _reason(exc: Exception) -> str:
    """FFmpeg's words for what failed, without PyAV's errno and file name around them."""
    text = getattr(exc, "strerror", None) or str(exc).strip() or type(exc).__name__
    return text if len(text) < 200 else text[:200] + "..."


def probe_video(data: bytes) -> VideoInfo:
    """The first video stream's frame count, rate, shown size and rotation; the frames are counted by demuxing where
    the container does not say (WebM, MKV). A 400 for a file that is not a video this server reads."""
    container = _container(data)
    try:
        return _probe(container)
    finally:
        container.close()


def _probe(container) -> VideoInfo:
    try:
        return _read_info(container)
    except FrontendError:
        raise
    except Exception as exc:  # noqa: BLE001 - FFmpeg's errors while demuxing or rewinding
        raise _error(f"the video could not be read ({_reason(exc)})") from None


def _read_info(container) -> VideoInfo:
    stream = container.streams.video[0]
    width, height = int(stream.codec_context.width or 0), int(stream.codec_context.height or 0)
    if width <= 0 or height <= 0:
        raise _error("the video stream states no frame size")
    if width * height > MAX_FRAME_PIXELS:
        raise _error(f"the video's frames are {width}x{height} pixels; the limit is {MAX_FRAME_PIXELS} pixels a frame")
    rate = stream.average_rate or stream.guessed_rate
    fps = float(rate) if rate else 0.0
    total = int(stream.frames or 0)
    if total <= 0:
        total = 0
        for packet in container.demux(stream):
            if packet.size:
                total += 1
                if total > MAX_VIDEO_FRAMES:
                    break
        container.seek(0)
    if total <= 0:
        raise _error("the video holds no frames")
    if total > MAX_VIDEO_FRAMES:
        raise _error(f"the video holds more than {MAX_VIDEO_FRAMES} frames; send a shorter one")
    turns = _first_rotation(container) // 90 % 4
    if turns % 2:
        width, height = height, width
    return VideoInfo(total, fps if math.isfinite(fps) and fps > 0 else DEFAULT_VIDEO_FPS, width, height, turns)


def _first_rotation(container) -> int:
    """The first frame's display rotation (degrees counterclockwise, a multiple of 90; 0 where it states none or
    does not decode), the container rewound after it."""
    try:
        frame = next(container.decode(container.streams.video[0]), None)
        degrees = int(round((getattr(frame, "rotation", 0) or 0) / 90)) * 90 if frame is not None else 0
    except Exception:  # noqa: BLE001 - a first frame that does not decode: the decode proper will say so
        degrees = 0
    container.seek(0)  # (an error here is the caller's: _probe)
    return degrees


# A video of at least this many frames, of which the sampled frames are a small part, is read by seeking to the
# keyframe before each sampled frame rather than decoding every frame before the last one (a ten-minute video's
# 18,000 frames for its 32 samples)
SEEK_MIN_FRAMES = 600


class _NoSeeking(Exception):
    """The stream does not keep what seeking needs (a frame a packet, distinct presentation times, decoded frames
    carrying their packets' times): its frames are read in order instead."""


def _frames_at(container, info: VideoInfo, indices: list[int], size: tuple[int, int]) -> torch.Tensor:
    """[n, 3, h, w] uint8: the frames at ``indices`` (ascending, repeats allowed) in decode order, each resized to
    ``size`` as it is decoded (only the kept frames are ever held). A long video whose sampled frames are few is read
    by seeking (``_seek_plan``): the same frames, far fewer decoded."""
    stream = container.streams.video[0]
    wanted: dict[int, int] = {}
    for i in indices:
        wanted[i] = wanted.get(i, 0) + 1

    def keep(frame, i: int) -> list:
        rgb = frame.to_ndarray(format="rgb24")
        if info.rotation:
            rgb = np.ascontiguousarray(np.rot90(rgb, info.rotation))
        if rgb.shape != (info.height, info.width, 3):
            raise _error(f"the video's frames change size ({info.width}x{info.height}, then "
                         f"{rgb.shape[1]}x{rgb.shape[0]}); send one whose frames keep theirs")
        return [resize_frame(torch.from_numpy(rgb).permute(2, 0, 1), size)] * wanted[i]

    out = []
    try:
        plan = _seek_plan(container, stream, info, sorted(wanted)) if info.total_frames >= SEEK_MIN_FRAMES else None
        if plan is not None:
            try:
                out = _frames_by_seeking(container, stream, plan, keep)
            except _NoSeeking:
                out = []
                container.seek(0)
        if not out:
            last = max(indices)
            for i, frame in enumerate(container.decode(stream)):
                if i > last:
                    break
                if i in wanted:
                    out += keep(frame, i)
    except Exception as exc:  # noqa: BLE001 - a corrupt stream (av.error.InvalidDataError, ...)
        if isinstance(exc, FrontendError):
            raise
        raise _error(f"the video data is corrupt ({_reason(exc)})") from None
    if len(out) < len(indices):  # the container said more frames than it decodes to: keep the last one
        if not out:
            raise _error("the video decodes to no frames")
        out += [out[-1]] * (len(indices) - len(out))
    return torch.stack(out)


def _seek_plan(container, stream, info: VideoInfo, wanted: list[int]):
    """[(frame index, its presentation time, the time of the keyframe at or before it)] for the ``wanted`` frames
    (ascending), from the stream's packets (demuxed, not decoded: the i-th frame in decode order is the one with the
    i-th presentation time); None where seeking would not pay (few frames skipped) or the packets do not say it (a
    packet without a time, repeated times, more or fewer packets than frames). The container is rewound."""
    if len(wanted) * 8 > info.total_frames:
        return None
    times, keys = [], []
    for packet in container.demux(stream):
        if not packet.size:
            continue
        if packet.pts is None:
            container.seek(0)
            return None
        times.append(packet.pts)
        if packet.is_keyframe:
            keys.append(packet.pts)
    container.seek(0)
    times.sort()
    keys.sort()
    if len(times) != info.total_frames or len(set(times)) != len(times) or not keys or keys[0] != times[0]:
        return None
    import bisect

    return [(i, times[i], keys[bisect.bisect_right(keys, times[i]) - 1]) for i in wanted if i < len(times)]


def _frames_by_seeking(container, stream, plan, keep) -> list:
    """The planned frames: for each, decoding goes on from where it is when no keyframe lies between there and the
    frame, else seeks to the frame's keyframe first; a decoded frame is known by its presentation time."""
    out, frames, at = [], None, None  # (the decoder's frames, and the time of the last it gave)
    for i, target, key in plan:
        if frames is None or at is None or key > at:
            container.seek(key, stream=stream, backward=True, any_frame=False)
            frames, at = container.decode(stream), None
        while True:
            frame = next(frames, None)
            if frame is None or frame.pts is None:
                raise _NoSeeking
            if at is not None and frame.pts <= at:  # (out of order: not a stream to seek in)
                raise _NoSeeking
            at = frame.pts
            if at == target:
                out += keep(frame, i)
                break
            if at > target:
                raise _NoSeeking
    return out


def resize_frame(frame: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """[3, H, W] uint8 -> [3, h, w] uint8, as transformers' video processors resize (torchvision's tensor resize:
    torch's antialiased bicubic on the uint8 frame itself, on a CPU; the frame as it is at its own size)."""
    if tuple(frame.shape[-2:]) == tuple(size):
        return frame
    return F.interpolate(frame[None], size=list(size), mode="bicubic", align_corners=False,
                         antialias=True)[0]


def _even(n: float, factor: int, rounding) -> int:
    return int(rounding(n / factor) * factor)


def _normalized(proc, x: torch.Tensor) -> torch.Tensor:
    """uint8 values [..., channels, k] -> float32, rescaled and normalized per channel as transformers'
    rescale_and_normalize does (the two fused: mean and std scaled by 1 / rescale_factor in float32)."""
    x = x.to(torch.float32)
    if proc.do_rescale and proc.do_normalize:
        mean = torch.tensor(proc.image_mean) * (1.0 / proc.rescale_factor)
        std = torch.tensor(proc.image_std) * (1.0 / proc.rescale_factor)
        return x.sub_(mean[:, None]).div_(std[:, None])
    if proc.do_normalize:
        return x.sub_(torch.tensor(proc.image_mean)[:, None]).div_(torch.tensor(proc.image_std)[:, None])
    return x * proc.rescale_factor if proc.do_rescale else x


@dataclass(frozen=True, kw_only=True)
class _VideoSettings(_Settings):
    """The pixel settings the video processors share with transformers' (the resample filter is always torch's
    antialiased bicubic on a CPU: video processors resize tensors), their check, and a video's identity."""

    modality: ClassVar[str] = "video"
    identity_tag: ClassVar[bytes]

    resample: int = BICUBIC
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    def _check_settings(self, tokens: tuple[str, ...], *, fps_zero_ok: bool) -> None:
        """The checks every video processor makes: its ``fps`` finite and positive (or 0 where ``fps_zero_ok``:
        num_frames frames instead), its ``tokens`` settings non-empty strings, its pixel settings valid and its
        frames resized."""
        fps = _finite("fps", self.fps)
        if fps < 0 or (fps == 0 and not fps_zero_ok):
            raise _field_error("fps", self.fps, "positive (or 0: num_frames frames)" if fps_zero_ok else "positive")
        object.__setattr__(self, "fps", fps)
        for name in tokens:
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise _field_error(name, getattr(self, name), "a non-empty string")
        _check_pixel_settings(self)
        if not self.do_resize:
            raise _field_error("do_resize", self.do_resize, "true (video frames are always resized)")

    def _identity(self, data: bytes) -> bytes:
        """The processor's tag, the file's digest and the settings."""
        return hashlib.sha256(self.identity_tag + hashlib.sha256(data).digest()
                              + json.dumps(self.to_dict(), sort_keys=True).encode()).digest()


@dataclass(frozen=True, kw_only=True)
class VideoProcessor(_VideoSettings):
    """A Qwen vision-language model's video preparation (``family`` "qwen2": Qwen2-VL and Qwen2.5-VL; "qwen3":
    Qwen3-VL and Qwen3.5), its settings as a JSON-able dict (``to_dict`` / ``from_dict``)."""

    kind: ClassVar[str] = "qwen_video"
    label: ClassVar[str] = "video processor"
    fills_video_token: ClassVar[bool] = True
    identity_tag: ClassVar[bytes] = b"flared.qwen-video.v1\0"
    # vLLM's mm_processor_kwargs a request may set (flared.server.app.ServingState.media_processors)
    options: ClassVar[tuple[str, ...]] = ("fps", "num_frames", "min_frames", "max_frames", "min_pixels", "max_pixels")

    family: str
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int  # size.shortest_edge: qwen2, a frame's; qwen3, the whole video's
    max_pixels: int  # size.longest_edge: likewise
    fps: float = 2.0  # frames sampled a second of video
    num_frames: int = 0  # frames sampled whatever the video's length (0: by fps)
    min_frames: int = 4
    max_frames: int = 768
    max_video_tokens: int = QWEN2_VIDEO_TOKENS  # qwen2: the video's token budget; qwen3: a frame's token ceiling
    video_token: str = "<|video_pad|>"
    vision_start: str = "<|vision_start|>"
    vision_end: str = "<|vision_end|>"

    def __post_init__(self):
        if self.family not in ("qwen2", "qwen3"):
            raise _field_error("family", self.family, '"qwen2" or "qwen3"')
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels", "min_frames",
                     "max_frames", "max_video_tokens"):
            _positive_int(name, getattr(self, name))
        if self.min_pixels > self.max_pixels:
            raise _field_error("min_pixels", self.min_pixels, f"at most max_pixels ({self.max_pixels})")
        if self.min_frames > self.max_frames:
            raise _field_error("min_frames", self.min_frames, f"at most max_frames ({self.max_frames})")
        if isinstance(self.num_frames, bool) or not isinstance(self.num_frames, int) or self.num_frames < 0:
            raise _field_error("num_frames", self.num_frames, "a non-negative integer (0: by fps)")
        self._check_settings(("video_token", "vision_start", "vision_end"), fps_zero_ok=False)

    # -- configuration ------------------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, family: str, video_config: dict | None, processor_config: dict | None = None, *,
                patch_size: int, temporal_patch_size: int, merge_size: int) -> VideoProcessor:
        """From a checkpoint's ``video_preprocessor_config.json`` (or processor_config.json's "video_processor"),
        with the transformers class's defaults where it ships none; the patch geometry is the tower's."""
        nested = (processor_config or {}).get("video_processor") if isinstance(processor_config, dict) else None
        cfg, _ = _hf_config(video_config or (nested if isinstance(nested, dict) else None), None)
        lo, hi = QWEN3_VIDEO_PIXELS if family == "qwen3" else QWEN2_VIDEO_PIXELS
        size = cfg.get("size") if isinstance(cfg.get("size"), dict) else {}
        lo = cfg.get("min_pixels", size.get("shortest_edge", lo))
        hi = cfg.get("max_pixels", size.get("longest_edge", hi))
        settings = _pixel_settings(cfg, BICUBIC, QWEN_MEAN, QWEN_STD)
        if family == "qwen3":
            settings["image_mean"] = cfg.get("image_mean", (0.5, 0.5, 0.5))
            settings["image_std"] = cfg.get("image_std", (0.5, 0.5, 0.5))
        fps = cfg.get("fps")
        return cls(family=family, patch_size=patch_size, temporal_patch_size=temporal_patch_size,
                   merge_size=merge_size, min_pixels=lo, max_pixels=hi, fps=2.0 if fps is None else fps,
                   num_frames=cfg.get("num_frames") or 0,
                   min_frames=cfg.get("min_frames", 4), max_frames=cfg.get("max_frames", 768),
                   max_video_tokens=cfg.get("max_video_tokens",
                                            QWEN3_VIDEO_TOKENS if family == "qwen3" else QWEN2_VIDEO_TOKENS),
                   **settings)

    @property
    def placeholder(self) -> str:
        """What the chat template writes for a video, which ``prepare``'s prompt replaces (Qwen3-VL's processor
        replaces the vision markers around it too: each frame pair gets its own)."""
        if self.family == "qwen3":
            return self.vision_start + self.video_token + self.vision_end
        return self.video_token

    # -- sampling and geometry ----------------------------------------------------------------------------

    def sample(self, info: VideoInfo) -> list[int]:
        """The indices of the frames kept (ascending; a video of fewer frames than the temporal patch repeats
        them). qwen2: qwen-vl-utils' ``smart_nframes`` and ``torch.linspace(...).round()``; qwen3: transformers'
        Qwen3VLVideoProcessor.sample_frames."""
        total, tp = info.total_frames, self.temporal_patch_size
        if self.num_frames:  # (qwen-vl-utils' nframes, rounded to the temporal patch; Qwen3-VL's as asked)
            n = min(self.num_frames, total)
            n = max(_even(n, tp, round) if self.family != "qwen3" else n, tp)
            if self.family == "qwen3":
                return [int(i) for i in np.linspace(0, total - 1, n).round().astype(int)]
            return torch.linspace(0, total - 1, n).round().long().tolist()
        if self.family == "qwen3":
            n = int(total / info.fps * self.fps)
            n = min(max(n, self.min_frames), self.max_frames, total)
            n = max(n, tp)
            return [int(i) for i in np.linspace(0, total - 1, n).round().astype(int)]
        lo = _even(self.min_frames, tp, math.ceil)
        hi = _even(min(self.max_frames, total), tp, math.floor)
        n = total / info.fps * self.fps
        n = _even(min(min(max(n, lo), hi), total), tp, math.floor)
        n = max(n, tp)
        return torch.linspace(0, total - 1, n).round().long().tolist()

    def frame_size(self, frames: int, height: int, width: int) -> tuple[int, int]:
        """(height, width) each of ``frames`` sampled frames is resized to (the per-video pixel budget)."""
        factor = self.patch_size * self.merge_size
        if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
            raise _error(f"the video is {width}x{height} pixels: its long edge is more than {MAX_ASPECT_RATIO} "
                         f"times its short edge, which this model's video processor refuses")
        if self.family == "qwen3":  # (Qwen3VLVideoProcessor.resize, its smart_resize over all the frames)
            per_frame = max(min(self.max_video_tokens * factor * factor, self.max_pixels // frames),
                            int(self.min_pixels * 1.05))
            max_pixels, tf = per_frame * frames, self.temporal_patch_size
            if height < factor or width < factor:
                scale = max(factor / height, factor / width)
                height, width = int(height * scale), int(width * scale)
            h, w = round(height / factor) * factor, round(width / factor) * factor
            t = round(frames / tf) * tf
            if t * h * w > max_pixels:
                beta = math.sqrt(frames * height * width / max_pixels)
                h = max(factor, math.floor(height / beta / factor) * factor)
                w = max(factor, math.floor(width / beta / factor) * factor)
            elif t * h * w < self.min_pixels:
                beta = math.sqrt(self.min_pixels / (frames * height * width))
                h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
            return h, w
        # Qwen2VLVideoProcessor.resize with cap_pixels_per_frame, then its smart_resize
        total_pixels = int(self.max_video_tokens * factor * factor * 0.9)
        max_pixels = max(min(self.max_pixels, total_pixels * self.temporal_patch_size // frames),
                         int(self.min_pixels * 1.05))
        h, w = round(height / factor) * factor, round(width / factor) * factor
        if h * w > max_pixels:
            beta = math.sqrt(height * width / max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return h, w

    def layout(self, info: VideoInfo) -> tuple[list[int], tuple[int, int, int]]:
        """(the sampled frames' indices, the video's (t, h, w) patch grid), without decoding a frame."""
        indices = self.sample(info)
        h, w = self.frame_size(len(indices), info.height, info.width)
        t = -(-len(indices) // self.temporal_patch_size)
        return indices, (t, h // self.patch_size, w // self.patch_size)

    def timestamps(self, indices: list[int], fps: float) -> list[float]:
        """Qwen3-VL: the time (seconds) of each temporal patch, the mean of its first and last frame's
        (transformers' Qwen3VLProcessor._calculate_timestamps)."""
        tp = self.temporal_patch_size
        indices = list(indices) + [indices[-1]] * (-len(indices) % tp)
        seconds = [i / fps for i in indices]
        return [(seconds[i] + seconds[i + tp - 1]) / 2 for i in range(0, len(seconds), tp)]

    def prompt(self, grid: tuple[int, int, int], indices: list[int], fps: float) -> str:
        """The text for one video (transformers' ``replace_video_token``): qwen2, the video token once per merged
        patch block; qwen3, before each temporal patch its time, then that frame pair's tokens in vision
        markers."""
        t, h, w = grid
        per_frame = h * w // self.merge_size ** 2
        if self.family != "qwen3":
            return self.video_token * (t * per_frame)
        frame = self.vision_start + self.video_token * per_frame + self.vision_end
        return "".join(f"<{s:.1f} seconds>" + frame for s in self.timestamps(indices, fps))

    # -- pixels -------------------------------------------------------------------------------------------

    def patches(self, frames: torch.Tensor) -> np.ndarray:
        """[n, 3, h, w] uint8 resized frames -> [t * gh * gw, 3 * tp * p * p] float32, transformers'
        ``pixel_values_videos`` rows for this video (its rescale_and_normalize, fused as it fuses them; the last
        frame repeated to a whole temporal patch; patchify's order). The bytes are put in patch order first, then
        converted: the same values through the same float32 operations, a quarter of the data moved."""
        n, c, height, width = frames.shape
        tp, p, m = self.temporal_patch_size, self.patch_size, self.merge_size
        if pad := -n % tp:
            frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
            n += pad
        gt, gh, gw = n // tp, height // p, width // p
        x = frames.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        x = _normalized(self, x.reshape(gt * gh * gw, c, tp * p * p))  # (each row: a channel's values together)
        return np.ascontiguousarray(x.reshape(gt * gh * gw, c * tp * p * p).numpy())

    def prepare(self, data: bytes, *, max_tokens: int | None = None) -> PreparedImage:
        """A video file's bytes -> its patches, grid, prompt and identity. ``max_tokens``: a video that would
        take more is refused before a frame is decoded (a 400 of kind CONTEXT_LENGTH)."""
        container = _container(data)
        try:
            info = _probe(container)
            indices, grid = self.layout(info)
            tokens = grid[0] * grid[1] * grid[2] // self.merge_size ** 2
            _check_tokens(tokens, max_tokens, len(indices))
            size = (grid[1] * self.patch_size, grid[2] * self.patch_size)
            frames = _frames_at(container, info, indices, size)
        finally:
            container.close()
        prompt = self.prompt(grid, indices, info.fps)
        identity = self._identity(data)
        seconds = self.temporal_patch_size / (len(indices) / info.total_frames * info.fps)
        return PreparedImage(pixel_values=self.patches(frames), rows=0, cols=0, prompt=prompt,
                             num_image_tokens=tokens, identity=identity, grid=grid, modality="video",
                             seconds_per_grid=seconds, frames_apart=self.family == "qwen3")


@dataclass(frozen=True, kw_only=True)
class FrameVideoProcessor(_VideoSettings):
    """Videos as the tower's tiles, a frame each. ``family`` "internvl": InternVL's preparation (transformers'
    InternVLVideoProcessor, and InternVLProcessor's prompt): ``num_frames`` frames, one from the middle of each of
    as many equal stretches of the video (InternVL's own ``get_index``; transformers' ``initial_shift``), the
    prompt ``Frame1: <img><IMG_CONTEXT>...</img>``, a line a frame, in place of the template's ``<video>``, the
    frames' rows filling the image token. "onevision": LLaVA-OneVision's (LlavaOnevisionVideoProcessor and
    LlavaOnevisionProcessor): frames from the first on, evenly apart (transformers' ``sample_frames``), the
    template's ``<video>`` repeated once a pooled row of each frame and once for the closing image_newline, those
    tokens filled by the tower's ``video_stages``. "llava_next_video": LLaVA-NeXT-Video's
    (LlavaNextVideoVideoProcessor, LlavaNextVideoProcessor): OneVision's frames, each resized by its short edge to
    ``shortest_edge`` and cropped from the middle (torchvision's rounding), ``<video>`` once a pooled row of each
    frame, no row end. Each frame is resized to one tile (torch's antialiased bicubic on the uint8 frame; squashed,
    or by its short edge then cropped), rescaled and normalized ([frames, 3, height, width]), or ``fps`` a second
    are taken where set."""

    kind: ClassVar[str] = "frames_video"
    label: ClassVar[str] = "video processor"
    identity_tag: ClassVar[bytes] = b"flared.frames-video.v1\0"
    options: ClassVar[tuple[str, ...]] = ("fps", "num_frames", "max_frames")

    height: int
    width: int
    image_seq_len: int  # tokens a frame (internvl: a tile's image tokens; onevision: its pooled rows)
    family: str = "internvl"
    shortest_edge: int = 0  # llava_next_video: the short edge a frame is resized to before the crop (0: squashed)
    num_frames: int = 8  # (InternVL's examples' num_segments)
    fps: float = 0.0  # > 0: this many frames a second of video instead, at most max_frames
    max_frames: int = 64
    video_token: str = "<video>"
    image_token: str = CANVAS_IMAGE_TOKEN
    start_token: str = CANVAS_START_TOKEN
    end_token: str = CANVAS_END_TOKEN

    def __post_init__(self):
        for name in ("height", "width", "image_seq_len", "num_frames", "max_frames"):
            _positive_int(name, getattr(self, name))
        if self.family not in ("internvl", "onevision", "llava_next_video"):
            raise _field_error("family", self.family, '"internvl", "onevision" or "llava_next_video"')
        if isinstance(self.shortest_edge, bool) or not isinstance(self.shortest_edge, int) or (
                self.shortest_edge and self.shortest_edge < max(self.height, self.width)):
            raise _field_error("shortest_edge", self.shortest_edge, "0, or at least the crop's side")
        self._check_settings(("video_token", "image_token", "start_token", "end_token"), fps_zero_ok=True)

    @classmethod
    def from_hf(cls, video_config: dict | None, *, height: int, width: int, image_seq_len: int,
                image_mean, image_std, family: str = "internvl") -> FrameVideoProcessor:
        """From a checkpoint's ``video_preprocessor_config.json`` where it ships one; the tile size is the tower's
        (a config naming another is refused), the mean and std the image processor's where it names none;
        llava_next_video's short edge its ``size.shortest_edge`` (the tile's side where it names none)."""
        cfg = video_config or {}
        size = cfg.get("size") if isinstance(cfg.get("size"), dict) else {}
        crop = cfg.get("crop_size") if family == "llava_next_video" else size  # (the tile the tower takes)
        if isinstance(crop, dict) and (crop.get("height"), crop.get("width")) not in ((None, None), (height, width)):
            raise _error(f"the video processor's frames of {crop.get('width')}x{crop.get('height')} pixels do not "
                         f"fit the tower's {width}x{height} tiles")
        shortest_edge = int(size.get("shortest_edge", height)) if family == "llava_next_video" else 0
        return cls(height=height, width=width, image_seq_len=image_seq_len, family=family, shortest_edge=shortest_edge,
                   num_frames=cfg.get("num_frames") or (8 if family == "internvl" else 32), fps=cfg.get("fps") or 0.0,
                   **_pixel_settings(cfg, BICUBIC, image_mean, image_std))

    @property
    def placeholder(self) -> str:
        return self.video_token

    @property
    def fills_video_token(self) -> bool:
        """The rows fill the video token (LLaVA-OneVision's, LLaVA-NeXT-Video's); else the image token (InternVL's
        frames)."""
        return self.family != "internvl"

    def sample(self, info: VideoInfo) -> list[int]:
        """transformers' sample_frames: ``torch.arange(shift, total, total / n).int()``, shift half a stretch
        (InternVL's ``initial_shift``) or none (OneVision's); n at most the video's frames."""
        total = info.total_frames
        n = _frame_count(self, info)
        shift = total / n / 2 if self.family == "internvl" else 0
        return torch.arange(shift, total, total / n).int().tolist()[:n]

    def prompt(self, frames: int) -> str:
        if self.family != "internvl":  # (a pooled row a frame's each; OneVision's image_newline after them all)
            return self.video_token * self.tokens(frames)
        tile = f"{self.start_token}{self.image_token * self.image_seq_len}{self.end_token}"
        return "\n".join(f"Frame{i + 1}: {tile}" for i in range(frames))

    def tokens(self, frames: int) -> int:
        return frames * self.image_seq_len + (self.family == "onevision")

    def pixels(self, frames: torch.Tensor) -> np.ndarray:
        """[n, 3, height, width] uint8 -> float32, rescaled and normalized as transformers fuses the two."""
        n, c, height, width = frames.shape
        return np.ascontiguousarray(_normalized(self, frames.reshape(n, c, height * width)).view(
            n, c, height, width).numpy())

    def prepare(self, data: bytes, *, max_tokens: int | None = None) -> PreparedImage:
        """As VideoProcessor.prepare."""
        container = _container(data)
        try:
            info = _probe(container)
            indices = self.sample(info)
            _check_tokens(self.tokens(len(indices)), max_tokens, len(indices))
            if self.shortest_edge:  # (LLaVA-NeXT-Video: by the short edge, then the middle)
                resized = _shortest_edge_size(info.height, info.width, self.shortest_edge)
                frames = _center_crops(_frames_at(container, info, indices, resized), self.height, self.width)
            else:
                frames = _frames_at(container, info, indices, (self.height, self.width))
        finally:
            container.close()
        identity = self._identity(data)
        n = len(indices)
        return PreparedImage(pixel_values=self.pixels(frames), rows=0, cols=0, prompt=self.prompt(n),
                             num_image_tokens=self.tokens(n), identity=identity, modality="video")


@dataclass(frozen=True, kw_only=True)
class PooledVideoProcessor(_VideoSettings):
    """Gemma 4's videos (transformers' Gemma4VideoProcessor and Gemma4Processor's prompt): ``num_frames`` frames
    evenly apart from the first (transformers' default sampling: frame k * total // n), or ``fps`` a second where
    set; every frame resized as the model's images are (the most whole pool x patch blocks within
    ``max_soft_tokens`` x pool^2 patches, keeping the aspect; torch's antialiased bicubic on the uint8 frame),
    rescaled and normalized (fused, as transformers fuses them), cut into patches row-major, each [y, x, channel];
    the prompt a frame at a time, "mm:ss <|image>" then one ``video_token`` a pooled block then "<image|>", the
    frames joined by spaces. ``pixel_values`` is [frames * h * w, 3 * patch^2]; grid (frames, h, w)."""

    kind: ClassVar[str] = "pooled_video"
    label: ClassVar[str] = "video processor"
    fills_video_token: ClassVar[bool] = True
    identity_tag: ClassVar[bytes] = b"flared.pooled-video.v1\0"
    options: ClassVar[tuple[str, ...]] = ("fps", "num_frames", "max_frames", "max_soft_tokens")

    patch_size: int
    pooling_kernel_size: int
    max_soft_tokens: int = 70
    num_frames: int = 32
    fps: float = 0.0  # > 0: this many frames a second of video instead, at most max_frames
    max_frames: int = 64
    video_token: str = "<|video|>"
    start_token: str = POOLED_BOI_TOKEN
    end_token: str = POOLED_EOI_TOKEN

    def __post_init__(self):
        for name in ("patch_size", "pooling_kernel_size", "num_frames", "max_frames"):
            _positive_int(name, getattr(self, name))
        _soft_tokens("max_soft_tokens", self.max_soft_tokens)
        self._check_settings(("video_token", "start_token", "end_token"), fps_zero_ok=True)

    @classmethod
    def from_hf(cls, video_config: dict | None, *, patch_size: int, pooling_kernel_size: int) -> PooledVideoProcessor:
        """From a checkpoint's ``video_preprocessor_config.json``, transformers' Gemma4VideoProcessor defaults
        where it ships none (32 frames, 70 soft tokens a frame, mean 0 and std 1); the patch and pool the
        tower's (a config naming others is refused)."""
        cfg = video_config or {}
        for name, want in (("patch_size", patch_size), ("pooling_kernel_size", pooling_kernel_size)):
            if cfg.get(name, want) != want:
                raise _error(f"the video processor's {name} {cfg[name]!r} does not fit the tower's {want}")
        return cls(patch_size=patch_size, pooling_kernel_size=pooling_kernel_size,
                   max_soft_tokens=cfg.get("max_soft_tokens", 70), num_frames=cfg.get("num_frames") or 32,
                   fps=cfg.get("fps") or 0.0, **_pixel_settings(cfg, BICUBIC, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)))

    @property
    def placeholder(self) -> str:
        return self.video_token

    def sample(self, info: VideoInfo) -> list[int]:
        """transformers' default_sample_indices_fn: n = num_frames (or int(seconds x fps), at least 1, at most
        max_frames), at most the video's frames; frame k * total // n."""
        total = info.total_frames
        n = _frame_count(self, info)
        return [k * total // n for k in range(n)]

    def frame_size(self, height: int, width: int) -> tuple[int, int]:
        return pooled_size(height, width, self.patch_size, self.max_soft_tokens, self.pooling_kernel_size)

    def prompt(self, indices: list[int], fps: float, per_frame: int) -> str:
        """transformers' Gemma4Processor.replace_video_token: each frame's time as mm:ss, a space, its tokens."""
        frame = f"{self.start_token}{self.video_token * per_frame}{self.end_token}"
        stamps = (i / fps for i in indices)
        return " ".join(f"{int(t // 60):02d}:{int(t % 60):02d} {frame}" for t in stamps)

    def patches(self, frames: torch.Tensor) -> np.ndarray:
        """[n, 3, h, w] uint8 -> [n * h / p * w / p, p * p * 3] float32: transformers' ``pixel_values_videos`` rows
        for this video's frames, unpadded (the bytes put in patch order first: a channel's values together)."""
        n, c, height, width = frames.shape
        p = self.patch_size
        gh, gw = height // p, width // p
        x = frames.reshape(n, c, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5).reshape(n * gh * gw, c, p * p)
        x = _normalized(self, x).transpose(1, 2)  # [rows, p * p, c]
        return np.ascontiguousarray(x.reshape(n * gh * gw, p * p * c).numpy())

    def prepare(self, data: bytes, *, max_tokens: int | None = None) -> PreparedImage:
        """As VideoProcessor.prepare."""
        container = _container(data)
        try:
            info = _probe(container)
            indices = self.sample(info)
            size = self.frame_size(info.height, info.width)
            per_frame = (size[0] // self.patch_size) * (size[1] // self.patch_size) // self.pooling_kernel_size ** 2
            _check_tokens(per_frame * len(indices), max_tokens, len(indices))
            frames = _frames_at(container, info, indices, size)
        finally:
            container.close()
        p = self.patch_size
        return PreparedImage(pixel_values=self.patches(frames), rows=0, cols=0,
                             prompt=self.prompt(indices, info.fps, per_frame),
                             num_image_tokens=per_frame * len(indices),
                             identity=self._identity(data), grid=(len(indices), size[0] // p, size[1] // p),
                             modality="video")


def _frame_count(proc, info: VideoInfo) -> int:
    """Frames a video gives ``proc`` (its ``num_frames``, or ``fps`` a second where set, at least one and at most
    ``max_frames``), at most the video's own."""
    n = max(1, min(int(info.total_frames / info.fps * proc.fps), proc.max_frames)) if proc.fps else proc.num_frames
    return min(n, info.total_frames)


def _center_crops(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[n, 3, h, w] -> [n, 3, height, width] from the middle, as torchvision's center_crop takes it (offsets
    rounded to nearest). The frames are never smaller than the crop (resized by their short edge to at least its
    side: FrameVideoProcessor.shortest_edge)."""
    h, w = frames.shape[-2:]
    top, left = int(round((h - height) / 2.0)), int(round((w - width) / 2.0))
    return frames[..., top:top + height, left:left + width]


def _check_tokens(tokens: int, max_tokens: int | None, frames: int) -> None:
    if max_tokens is not None and tokens > max_tokens:
        raise _error(f"the video takes {tokens} tokens ({frames} frames), more than the {max_tokens} the context has "
                     "room for (send a shorter video, or fewer frames: mm_processor_kwargs' fps or num_frames)",
                     ErrorKind.CONTEXT_LENGTH)


def video_processor_from_dict(d: dict):
    """The video processor a ``to_dict`` wrote, by its "kind"."""
    if not isinstance(d, dict):
        raise _error(f"a video processor must be a JSON object, got {type(d).__name__}")
    kind = d.get("kind")
    for cls in (VideoProcessor, FrameVideoProcessor, PooledVideoProcessor):
        if kind == cls.kind:
            return cls.from_dict(d)
    raise _error(f"unknown video processor kind {kind!r}")


def decode_video_source(source, *, max_bytes: int = DEFAULT_MAX_VIDEO_BYTES) -> bytes:
    """A video a client sent (a data URL, bare base64, or bytes) -> its bytes; a 400 when empty or too large."""
    data = source_bytes(source, max_bytes, medium="video", media_types=_VIDEO_MEDIA, supported=_SUPPORTED,
                        example="data:video/mp4;base64,...")
    if not data:
        raise _error("video data is empty")
    if len(data) > max_bytes:
        raise _error(f"video is too large: {_mib(len(data))}; the limit is {_mib(max_bytes)}")
    return data
