"""Videos for tests: small clips encoded with PyAV (FFmpeg's encoders), as data URLs and chat parts."""

from __future__ import annotations

import base64
import io

import numpy as np


def noise_video(frames: int = 25, size=(64, 48), rate: int = 10, *, seed: int = 0, codec: str = "mpeg4",
                container: str = "mp4", smooth: bool = False) -> bytes:
    """``frames`` frames of ``size`` (width, height) at ``rate`` a second: random noise each (``smooth``: a moving
    gradient, which lossy codecs keep nearly intact), encoded as ``codec`` in ``container``."""
    import av

    rng = np.random.default_rng(seed)
    width, height = size
    buf = io.BytesIO()
    out = av.open(buf, "w", format=container)
    stream = out.add_stream(codec, rate=rate)
    stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
    yy, xx = np.mgrid[0:height, 0:width]
    for i in range(frames):
        if smooth:
            img = np.stack([(xx * 3 + i * 9) % 256, (yy * 5 + i * 7) % 256, (xx + yy + i * 11) % 256], -1)
            img = img.astype(np.uint8)
        else:
            img = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)
    out.close()
    return buf.getvalue()


def video_url(data: bytes, media: str = "video/mp4") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def video_part(data: bytes, media: str = "video/mp4") -> dict:
    """vLLM's chat content part for a video."""
    return {"type": "video_url", "video_url": {"url": video_url(data, media)}}
