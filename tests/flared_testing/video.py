"""Videos for tests: clips encoded with PyAV (FFmpeg's encoders), as data URLs and chat parts, and a user turn of
images and videos asked of a daemon."""

from __future__ import annotations

import base64
import io

import numpy as np


def encode_frames(frames, size, rate: int, *, codec: str = "mpeg4", container: str = "mp4", pix_fmt: str | None = None,
                  options: dict | None = None, rotation: int = 0) -> bytes:
    """``frames`` (an iterable of [height, width, 3] uint8 RGB arrays of ``size`` (width, height)) at ``rate`` a
    second, encoded as ``codec`` in ``container`` (``rotation``: a display matrix turning them, degrees)."""
    import av

    buf = io.BytesIO()
    out = av.open(buf, "w", format=container)
    stream = out.add_stream(codec, rate=rate, options=options or {})
    stream.width, stream.height = size
    stream.pix_fmt = pix_fmt or {"gif": "rgb8", "mjpeg": "yuvj420p", "png": "rgb24"}.get(codec, "yuv420p")
    if rotation:
        stream.set_display_rotation(rotation)
    for img in frames:
        for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)
    out.close()
    return buf.getvalue()


def noise_video(frames: int = 25, size=(64, 48), rate: int = 10, *, seed: int = 0, codec: str = "mpeg4",
                container: str = "mp4", smooth: bool = False) -> bytes:
    """``frames`` frames of ``size`` (width, height) at ``rate`` a second: random noise each (``smooth``: a moving
    gradient, which lossy codecs keep nearly intact), encoded as ``codec`` in ``container``."""
    rng = np.random.default_rng(seed)
    width, height = size
    yy, xx = np.mgrid[0:height, 0:width]

    def frame(i: int) -> np.ndarray:
        if smooth:
            img = np.stack([(xx * 3 + i * 9) % 256, (yy * 5 + i * 7) % 256, (xx + yy + i * 11) % 256], -1)
            return img.astype(np.uint8)
        return rng.integers(0, 256, (height, width, 3), dtype=np.uint8)

    return encode_frames((frame(i) for i in range(frames)), size, rate, codec=codec, container=container)


def video_url(data: bytes, media: str = "video/mp4") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def video_part(data: bytes, media: str = "video/mp4") -> dict:
    """vLLM's chat content part for a video."""
    return {"type": "video_url", "video_url": {"url": video_url(data, media)}}


def ask_media(daemon, media, text: str, max_tokens: int, **kw) -> dict:
    """One user turn of ``media`` (("image", PIL image) or ("video", bytes), in order) then ``text`` through
    flared_testing.vision's ``ask_greedy``."""
    from flared_testing.vision import ask_greedy

    return ask_greedy(daemon, [video_part(m) if kind == "video" else m for kind, m in media], text, max_tokens, **kw)


def assert_media_cases_match(daemon, reference, cases, max_tokens: int, label=(), **kw) -> None:
    """Each (media, text) user turn asked greedily of the daemon (``ask_media``; ``kw``: more request fields): its
    prompt length and tokens are what ``reference(media, text)`` (transformers) gives."""
    from flared_testing.vision import assert_greedy

    for media, text in cases:
        body = ask_media(daemon, media, text, max_tokens, **kw)
        num_prompt, expected = reference(media, text)
        assert body["usage"]["prompt_tokens"] == num_prompt, (*label, text)
        assert_greedy(body, expected, (*label, text))
