"""Images for vision-language models: decoding what a client sends; SmolVLM / Idefics3 and Qwen2-VL preprocessing.

``decode_image`` turns a data URL, a bare base64 string (Ollama's ``images``) or raw bytes into an upright RGB
``PIL.Image`` (a ``DecodedImage``). Only PNG, JPEG and WebP stills are accepted, and the pixel count is checked
from the file header before any pixel data is decoded, so a small file that claims to be huge costs nothing.

``TileProcessor`` reproduces transformers' PIL image processors for SmolVLM and Idefics3 (the two are the same
code with the same defaults) number for number:

1. ``do_resize``: resize so the longest edge is ``size.longest_edge`` (smaller images are scaled *up*), the
   other edge truncated and rounded up to even, then scaled down below 4096 if it got larger than that.
2. ``do_image_splitting``: resize again to whole multiples of the tile (``max_image_size.longest_edge``); if
   that is bigger than one tile, cut it into tiles row by row and append the whole image resized to one tile
   (the "global" image). A result of one tile is used as it is, with rows = cols = 0.
   Without splitting the image is squashed to tile x tile.
3. Every resize is a Pillow resize of a uint8 RGB image (``resample``, LANCZOS by default); the crops are
   taken from uint8 pixels.
4. ``do_rescale``: uint8 -> float64 times ``rescale_factor``, then cast to float32. ``do_normalize``:
   ``(x - mean) / std`` in float32. Both act on uint8 inputs only, so they are applied through a 256-entry
   table per channel computed with the very same operations (bit-identical, much faster).

transformers converts a PIL image to RGB by compositing it onto white when it has an alpha band or a
``transparency`` entry, and with ``Image.convert("RGB")`` otherwise; it does not apply EXIF orientation to PIL
images it is given. ``decode_image`` applies EXIF orientation first (a phone photo must come out upright) and
then converts the same way (``DecodedImage.from_pil`` is that conversion alone).

``PatchProcessor`` reproduces transformers' ``Qwen2VLImageProcessorPil`` (Qwen2-VL; Qwen2.5-VL uses the same
image processor) number for number:

1. ``do_resize``: transformers' ``smart_resize``: both edges rounded (Python's round, half to even) to multiples
   of ``patch_size * merge_size``; if that holds more than ``max_pixels`` pixels, both edges are scaled by
   sqrt(pixels / max_pixels) and rounded *down* to multiples (at least one multiple); if fewer than
   ``min_pixels``, scaled by sqrt(min_pixels / pixels) and rounded *up*. An image whose aspect ratio is over
   200 is refused. One Pillow resize of the uint8 RGB image (``resample``, BICUBIC by default), always made.
2. ``do_rescale`` / ``do_normalize`` exactly as for the tiles (one 256-entry table per channel).
3. The image is cut into ``patch_size`` squares, ordered block by block: each ``merge_size`` x ``merge_size``
   block of patches (the patches one merged image token covers) in row-major order, blocks in row-major order.
   Each row of ``pixel_values`` is one patch flattened as [channel, temporal, y, x], the one image repeated
   over the ``temporal_patch_size`` frames. The grid (t, h, w) is (1, height / patch, width / patch), and the
   prompt holds ``h * w / merge_size**2`` image tokens.

``PixtralProcessor`` reproduces transformers' ``PixtralImageProcessorPil`` as ``PixtralProcessor`` (the processor
Pixtral-12B and Mistral3 / Mistral-Small-3.1 use) calls it, number for number:

1. ``do_resize``: the resize unit is ``patch_size * merge_size`` (the processor hands the image processor that as
   its patch size; merge_size is processor_config.json's ``spatial_merge_size``). An image whose long edge is over
   ``size.longest_edge`` is scaled down by ``long / longest_edge``, both edges rounded *down*; then both edges are
   rounded *up* to multiples of the unit, so small images are never scaled up beyond that rounding. One Pillow
   resize of the uint8 RGB image (``resample``, BICUBIC by default), always made. An image so thin that its short
   edge rounds down to 0 pixels is refused (transformers fails on it).
2. ``do_rescale`` / ``do_normalize`` exactly as for the tiles (one 256-entry table per channel).
3. ``pixel_values`` is the one image, [3, H, W] (transformers pads a batch to its largest image; one image is not
   padded). The grid is (1, H / patch_size, W / patch_size) patches; the prompt holds rows = H / unit lines of
   cols = W / unit ``[IMG]`` tokens, each line ended by ``[IMG_BREAK]``, the last one by ``[IMG_END]`` instead.

``CropProcessor`` reproduces transformers' ``CLIPImageProcessorPil`` and ``LlavaImageProcessorPil`` (LLaVA-1.5 and
other CLIP-tower models) number for number: (LLaVA's ``do_pad`` only) pad to a square of ``int(mean * 255)``,
resize so the short edge is ``size.shortest_edge`` (the long one truncated), center-crop to ``crop_size``, rescale
and normalize as above. ``pixel_values`` is [3, crop height, crop width]; the prompt is the image token repeated
as many times as the model makes image tokens of one image (``image_seq_len``, given by the caller).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
import json
import math
import re
import struct
import warnings
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from PIL import Image, ImageOps

from flared.errors import ErrorKind, FrontendError

DEFAULT_MAX_IMAGE_BYTES = 20 << 20  # encoded bytes after base64 decoding
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192  # width*height, checked before pixel data is decoded

# transformers' SmolVLM / Idefics3 constants and class defaults (identical for the two).
MAX_IMAGE_SIZE = 4096  # no edge grows past this after the first resize
MAX_CANVAS_TILES = 64  # a canvas processor's max_patches (InternVL's released configs: 12)
HF_DEFAULT_LONGEST_EDGE = 4 * 364
HF_DEFAULT_TILE = 364
HF_DEFAULT_IMAGE_SEQ_LEN = 169
HF_DEFAULT_MEAN = (0.5, 0.5, 0.5)  # IMAGENET_STANDARD_MEAN
HF_DEFAULT_STD = (0.5, 0.5, 0.5)  # IMAGENET_STANDARD_STD
LANCZOS = 1  # PIL.Image.Resampling.LANCZOS
RESAMPLE_NAMES = {0: "NEAREST", 1: "LANCZOS", 2: "BILINEAR", 3: "BICUBIC", 4: "BOX", 5: "HAMMING"}
PROCESSOR_TYPES = ("Idefics3ImageProcessor", "SmolVLMImageProcessor")  # with or without a Fast / Pil suffix

# transformers' Qwen2-VL image processor class defaults (Qwen2.5-VL uses the same processor).
QWEN_PATCH_SIZE = 14
QWEN_TEMPORAL_PATCH_SIZE = 2
QWEN_MERGE_SIZE = 2
QWEN_MIN_PIXELS = 56 * 56  # size.shortest_edge
QWEN_MAX_PIXELS = 28 * 28 * 1280  # size.longest_edge
QWEN_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OPENAI_CLIP_MEAN
QWEN_STD = (0.26862954, 0.26130258, 0.27577711)  # OPENAI_CLIP_STD
QWEN_IMAGE_TOKEN = "<|image_pad|>"
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC
MAX_ASPECT_RATIO = 200  # smart_resize refuses longer / shorter edge above this
PATCH_PROCESSOR_TYPES = ("Qwen2VLImageProcessor",)  # with or without a Fast / Pil suffix (Qwen2.5-VL's too)

# transformers' Pixtral image processor and PixtralProcessor class defaults (Pixtral-12B's values; Mistral3 /
# Mistral-Small-3.1 configs say patch 14, longest edge 1540, spatial_merge_size 2)
PIXTRAL_PATCH_SIZE = 16
PIXTRAL_LONGEST_EDGE = 1024
PIXTRAL_MERGE_SIZE = 1
PIXTRAL_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OPENAI_CLIP_MEAN
PIXTRAL_STD = (0.26862954, 0.26130258, 0.27577711)  # OPENAI_CLIP_STD
PIXTRAL_IMAGE_TOKEN = "[IMG]"
PIXTRAL_BREAK_TOKEN = "[IMG_BREAK]"
PIXTRAL_END_TOKEN = "[IMG_END]"
PIXTRAL_PROCESSOR_TYPES = ("PixtralImageProcessor",)  # with or without a Fast / Pil suffix
# transformers' CLIP / LLaVA image processor class defaults and LlavaProcessor's image token
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OPENAI_CLIP_MEAN
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)  # OPENAI_CLIP_STD
CLIP_IMAGE_TOKEN = "<image>"
CROP_PROCESSOR_TYPES = ("CLIPImageProcessor", "LlavaImageProcessor")  # with or without a Fast / Pil suffix
# transformers' Gemma 3 image processor defaults and Gemma3Processor's tokens (the released configs: 896 x 896, 256
# image tokens)
GEMMA3_IMAGE_TOKEN = "<image_soft_token>"
GEMMA3_BOI_TOKEN = "<start_of_image>"
GEMMA3_EOI_TOKEN = "<end_of_image>"
BILINEAR = 2  # PIL.Image.Resampling.BILINEAR
SQUARE_PROCESSOR_TYPES = ("Gemma3ImageProcessor",)  # with or without a Fast / Pil suffix
# transformers' GotOcr2 image processor defaults (InternVL's) and InternVLProcessor's tokens (the released configs:
# 448 x 448 tiles, 1-12 of them and a thumbnail, 256 image tokens a tile, ImageNet's mean and std)
CANVAS_IMAGE_TOKEN = "<IMG_CONTEXT>"
CANVAS_START_TOKEN = "<img>"
CANVAS_END_TOKEN = "</img>"
CANVAS_PROCESSOR_TYPES = ("GotOcr2ImageProcessor",)  # with or without a Fast / Pil suffix
ANYRES_PROCESSOR_TYPES = ("LlavaNextImageProcessor", "LlavaOnevisionImageProcessor")  # (or Fast / Pil)
# transformers' Gemma 4 image processor defaults and Gemma4Processor's tokens (the tokenizer's boi, image and eoi
# tokens); the soft-token budgets it accepts
POOLED_IMAGE_TOKEN = "<|image|>"
POOLED_BOI_TOKEN = "<|image>"
POOLED_EOI_TOKEN = "<image|>"
POOLED_SOFT_TOKENS = (70, 140, 280, 560, 1120)
POOLED_PROCESSOR_TYPES = ("Gemma4ImageProcessor",)  # with or without a Fast / Pil suffix
_LLAMA4_PROCESSOR_TYPES = ("Llama4ImageProcessor",)  # (flared.frontend.llama4's; with or without a Fast suffix)
# processor_class values that tell the family when a config has no image_processor_type
_TILE_PROCESSOR_CLASSES = ("Idefics3Processor", "SmolVLMProcessor")
_PATCH_PROCESSOR_CLASSES = ("Qwen2VLProcessor", "Qwen2_5_VLProcessor")
_PIXTRAL_PROCESSOR_CLASSES = ("PixtralProcessor",)  # Pixtral-12B and Mistral3 alike
_CROP_PROCESSOR_CLASSES = ("LlavaProcessor",)
_SQUARE_PROCESSOR_CLASSES = ("Gemma3Processor",)
_CANVAS_PROCESSOR_CLASSES = ("InternVLProcessor",)
_ANYRES_PROCESSOR_CLASSES = ("LlavaNextProcessor", "LlavaOnevisionProcessor")
_POOLED_PROCESSOR_CLASSES = ("Gemma4Processor",)

FORMATS = ("PNG", "JPEG", "WEBP")
_MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP"}
_SUPPORTED = "send a PNG, JPEG or WebP image"
_B64_CHARS = re.compile(rb"[A-Za-z0-9+/]*={0,2}")
_B64_WHITESPACE = re.compile(r"[ \t\r\n\f\v]+")
_URL_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*):")


def _error(message: str, kind: ErrorKind = ErrorKind.VALIDATION) -> FrontendError:
    return FrontendError(message, kind)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= (1 << 20) else f"{n} bytes"


# --------------------------------------------------------------------------------------------------- decoding

@dataclass(frozen=True)
class DecodedImage:
    image: Image.Image  # RGB, converted the way transformers' convert_to_rgb does
    digest: bytes  # 32-byte sha256 over (mode, size, RGB pixel bytes): identity of the pixels

    @property
    def width(self) -> int:
        return self.image.width

    @property
    def height(self) -> int:
        return self.image.height

    @classmethod
    def from_pil(cls, image: Image.Image) -> DecodedImage:
        """An already decoded PIL image, converted to RGB exactly as transformers' ``convert_to_rgb`` does for
        PIL input: onto opaque white when the image has an alpha band or a ``transparency`` entry (palette or
        colour key), a plain ``convert("RGB")`` otherwise. No EXIF orientation is applied here."""
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            rgb = Image.alpha_composite(white, rgba).convert("RGB")
        else:
            rgb = image.convert("RGB")
        rgb.info.pop("transparency", None)
        h = hashlib.sha256()
        h.update(b"RGB\0")
        h.update(struct.pack("<II", rgb.width, rgb.height))
        h.update(rgb.tobytes())
        return cls(rgb, h.digest())


def decode_image(source: str | bytes, *, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
                 max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> DecodedImage:
    """Decode one image a client sent: a data URL (``data:image/png;base64,...``; png, jpeg/jpg, webp), a bare
    base64 string (what Ollama sends) or raw bytes. Raises ``FrontendError`` (VALIDATION; UNSUPPORTED for
    http(s)/file URLs) with a message meant for the client."""
    data = source_bytes(source, max_bytes)
    if not data:
        raise _error("image data is empty")
    if len(data) > max_bytes:
        raise _error(f"image is too large: {_mib(len(data))}; the limit is {_mib(max_bytes)}")
    fmt = _sniff_format(data)
    dims = _header_size(fmt, data)
    if dims is not None:
        _check_pixels(dims[0], dims[1], max_pixels)
    im = _open(data, fmt, max_pixels)
    frames = getattr(im, "n_frames", 1)
    if im.format == "MPO":  # a JPEG carrying extra pictures (depth maps, previews): the first one is the photo
        im.seek(0)
    elif frames > 1 or getattr(im, "is_animated", False):
        raise _error(f"animated images are not supported (this {fmt} has {frames} frames); "
                     "send a single still image")
    _check_pixels(im.width, im.height, max_pixels)
    try:
        im.load()
    except Exception as e:  # Pillow's decoders raise OSError, ValueError, SyntaxError, EOFError, struct.error ...
        raise _error(f"the {fmt} image data is corrupt or truncated ({e})") from None
    try:
        im = ImageOps.exif_transpose(im)
    except Exception:  # noqa: BLE001 - unreadable EXIF is not worth failing over; keep the stored orientation
        pass
    im = _wide_grayscale_to_8bit(im)
    return DecodedImage.from_pil(im)


def source_bytes(source, max_bytes: int, *, medium: str = "image", media_types=_MEDIA_TYPES,
                 supported: str = _SUPPORTED, example: str = "data:image/png;base64,...",
                 typed: bool = True) -> bytes:
    """The bytes a client sent as ``medium`` ("image", "audio"): raw bytes, bare base64, or a base64 data URL whose
    media type is one of ``media_types`` (``typed``: it must name one; else it may be left out). Remote URLs are
    fetched before this (flared.server.media), so one here is refused."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if not isinstance(source, str):
        noun = "an image" if medium == "image" else medium
        raise _error(f"{noun} must be a base64 string or a data URL, got {type(source).__name__}")
    text = source.strip()
    m = _URL_SCHEME.match(text[:64])
    if m is None:
        return _b64decode(text, max_bytes, f"{medium} data", medium)
    scheme = m.group(1).lower()
    if scheme != "data":
        if scheme in ("http", "https", "file", "ftp") or text[m.end():].startswith("//"):
            raise _error(f"remote {medium} URLs are not fetched; send the {medium} as a base64 data URL",
                         ErrorKind.UNSUPPORTED)
        raise _error(f"unrecognized {medium} reference (a {scheme!r} URL); send the {medium} as a base64 data URL")
    header, comma, payload = text[m.end():].partition(",")
    if not comma:
        raise _error(f"malformed {medium} data URL: no ',' before the data")
    params = [p.strip().lower() for p in header.split(";")]
    media = params[0]
    if "base64" not in params[1:]:
        raise _error(f"{medium} data URLs must be base64-encoded ('{example}')")
    if not media and typed:
        raise _error(f"{medium} data URL has no media type; {supported} ('{example}')")
    if media and media not in media_types:
        raise _error(f"unsupported {medium} type {media!r}; {supported}")
    return _b64decode(payload, max_bytes, f"the {medium} data URL", medium)


def _b64decode(text: str, max_bytes: int, what: str, medium: str = "image") -> bytes:
    text = _B64_WHITESPACE.sub("", text)
    if not text:
        return b""
    try:
        raw = text.encode("ascii")
    except UnicodeEncodeError:
        raise _error(f"{what} is not valid base64 (it has non-ASCII characters)") from None
    if b"-" in raw or b"_" in raw:  # the URL-safe alphabet
        raw = raw.translate(bytes.maketrans(b"-_", b"+/"))
    if len(raw) % 4 == 1 or not _B64_CHARS.fullmatch(raw):
        raise _error(f"{what} is not valid base64")
    raw += b"=" * (-len(raw) % 4)  # some clients drop the padding
    if len(raw) // 4 * 3 - 2 > max_bytes:  # refuse before decoding it
        raise _error(f"{medium} is too large: about {_mib(len(raw) // 4 * 3)} after base64 decoding; "
                     f"the limit is {_mib(max_bytes)}")
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise _error(f"{what} is not valid base64") from None


def _sniff_format(data: bytes) -> str:
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    other = None
    if data[:6] in (b"GIF87a", b"GIF89a"):
        other = "GIF"
    elif data[:2] == b"BM":
        other = "BMP"
    elif data[:4] in (b"II*\0", b"MM\0*"):
        other = "TIFF"
    elif data[4:8] == b"ftyp" and data[8:12] in (b"avif", b"avis"):
        other = "AVIF"
    elif data[4:8] == b"ftyp" and data[8:12] in (b"heic", b"heix", b"hevc", b"heim", b"heis", b"mif1", b"msf1"):
        other = "HEIC"
    elif data[:4] == b"\0\0\1\0":
        other = "ICO"
    elif data[:4] == b"8BPS":
        other = "PSD"
    if other is not None:
        raise _error(f"{other} images are not supported; {_SUPPORTED}")
    raise _error(f"the image data is not a recognized image format; {_SUPPORTED}")


def _header_size(fmt: str, data: bytes) -> tuple[int, int] | None:
    """(width, height) read straight from the header, or None where it cannot be found cheaply (Pillow's own
    header parse, checked before load, then decides)."""
    try:
        if fmt == "PNG":
            if data[12:16] == b"IHDR":
                return struct.unpack(">II", data[16:24])
        elif fmt == "WEBP":
            chunk = data[12:16]
            if chunk == b"VP8X":
                w = int.from_bytes(data[24:27], "little") + 1
                h = int.from_bytes(data[27:30], "little") + 1
                return w, h
            if chunk == b"VP8L" and data[20] == 0x2F:
                bits = int.from_bytes(data[21:25], "little")
                return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
            if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
                w, h = struct.unpack("<HH", data[26:30])
                return w & 0x3FFF, h & 0x3FFF
        elif fmt == "JPEG":
            return _jpeg_size(data)
    except (struct.error, IndexError):
        return None
    return None


_JPEG_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            i += 2
            continue
        if marker in (0xD9, 0xDA):  # end of image, start of scan: no frame header before it
            return None
        (length,) = struct.unpack(">H", data[i + 2:i + 4])
        if marker in _JPEG_SOF:
            h, w = struct.unpack(">HH", data[i + 5:i + 9])
            return (w, h) if h else None  # height 0: defined later by a DNL marker
        i += 2 + length
    return None


def _check_pixels(width: int, height: int, max_pixels: int) -> None:
    if width <= 0 or height <= 0:
        raise _error(f"the image has no pixels ({width}x{height})")
    if width * height > max_pixels:
        raise _error(f"image is too large: {width}x{height} pixels ({width * height} in all); "
                     f"the limit is {max_pixels} pixels")


def _open(data: bytes, fmt: str, max_pixels: int) -> Image.Image:
    def open_():
        return Image.open(io.BytesIO(data), formats=[fmt])

    try:
        limit = Image.MAX_IMAGE_PIXELS
        if limit is not None and max_pixels > limit:
            # Pillow would warn (or raise) about a size our caller allows: keep that inside. (catch_warnings is
            # process-wide state; with the default max_pixels, below Pillow's limit, this path is never taken.)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                return open_()
        return open_()
    except Image.DecompressionBombError:
        raise _error(f"image is too large: its header declares more than the limit of {max_pixels} pixels") \
            from None
    except Exception as e:  # UnidentifiedImageError, OSError, SyntaxError, struct.error ... from a broken header
        raise _error(f"the {fmt} image data is corrupt or truncated ({e})") from None


def _wide_grayscale_to_8bit(im: Image.Image) -> Image.Image:
    """16-bit grayscale PNGs open as mode ``I;16``; Pillow's convert("RGB") (and so transformers) clips those
    at 255, which turns almost any such photo white. Scale them to 8 bits the way a viewer shows them."""
    if im.mode != "I" and not im.mode.startswith("I;16"):
        return im
    v = np.asarray(im).astype(np.int64)
    v8 = ((np.clip(v, 0, 65535) * 255 + 32767) // 65535).astype(np.uint8)
    gray = Image.fromarray(v8, mode="L")
    t = im.info.get("transparency")
    if isinstance(t, int):
        alpha = Image.fromarray(np.where(v == t, 0, 255).astype(np.uint8), mode="L")
        gray = Image.merge("LA", (gray, alpha))
    return gray


# --------------------------------------------------------------------------------------------- preprocessing

@dataclass(frozen=True)
class PreparedImage:
    # float32, C-contiguous. TileProcessor: [num_tiles, 3, tile, tile]. PatchProcessor: [t * h * w,
    # 3 * temporal_patch_size * patch_size**2], transformers' Qwen2-VL ``pixel_values`` for this one image.
    # PixtralProcessor: [3, H, W], transformers' Pixtral ``pixel_values[0]`` for this one image.
    # CropProcessor: [3, crop_height, crop_width], transformers' CLIP / LLaVA ``pixel_values[0]``.
    pixel_values: np.ndarray
    # tile rows (0 when the image was not split, and always 0 for a PatchProcessor); PixtralProcessor: lines of
    # image tokens in the prompt
    rows: int
    cols: int  # tile columns; PixtralProcessor: image tokens per line
    prompt: str  # the text that replaces one image placeholder in the rendered prompt
    # how many image tokens ``prompt`` holds (tiles * image_seq_len; t*h*w / merge**2; rows * cols)
    num_image_tokens: int
    identity: bytes  # 32-byte sha256 over the DecodedImage digest + the processor settings
    # PatchProcessor: (t, h, w) in patches (``image_grid_thw``); PixtralProcessor: (1, H / patch, W / patch)
    grid: tuple[int, int, int] | None = None
    # "image", "audio" (flared.frontend.audio) or "video" (flared.frontend.video: its tokens are the video token's)
    modality: str = "image"
    # a video: the seconds one temporal patch spans (Qwen2.5-VL's ``second_per_grid_ts``), and whether each
    # temporal patch's tokens stand apart in the prompt (Qwen3-VL: a timestamp between them)
    seconds_per_grid: float = 0.0
    frames_apart: bool = False


def _longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """(height, width) after transformers' SmolVLM resize to ``longest``: the long edge becomes ``longest``
    (up or down), the other follows the aspect ratio truncated and rounded up to even; then, if the long edge
    exceeds MAX_IMAGE_SIZE, both are scaled down below it (truncated)."""
    ratio = width / height
    if width >= height:
        width = longest
        height = int(width / ratio)
        height += height % 2
    else:
        height = longest
        width = int(height * ratio)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    ratio = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width = MAX_IMAGE_SIZE
        height = int(width / ratio)
    elif height > width and height > MAX_IMAGE_SIZE:
        height = MAX_IMAGE_SIZE
        width = int(height * ratio)
    return max(height, 1), max(width, 1)


def _tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """(height, width) rounded to whole tiles as transformers' resize_for_vision_encoder does: the long edge up
    to a multiple of ``tile``, the other from the aspect ratio (truncated), then up to a multiple as well."""
    ratio = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / ratio) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * ratio) / tile) * tile
    return height, width


def _field_error(field: str, value, expected: str) -> FrontendError:
    return _error(f"image processor setting {field!r} must be {expected}, got {value!r}")


def _positive_int(field: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _field_error(field, value, "a positive integer")
    return value


def _flag(field: str, value) -> bool:
    if not isinstance(value, bool):
        raise _field_error(field, value, "true or false")
    return value


def _finite(field: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _field_error(field, value, "a finite number")
    return float(value)


def _triple(field: str, value) -> tuple[float, float, float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = (value,) * 3  # transformers repeats a single number over the channels
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise _field_error(field, value, "a list of 3 numbers (one per RGB channel)")
    return tuple(_finite(field, v) for v in value)


def _check_pixel_settings(proc) -> None:
    """Validate (and normalize in place) the settings TileProcessor and PatchProcessor share."""
    if type(proc.resample) is not int or proc.resample not in RESAMPLE_NAMES:
        raise _field_error("resample", proc.resample, "a PIL resampling filter id 0-5")
    object.__setattr__(proc, "image_mean", _triple("image_mean", proc.image_mean))
    std = _triple("image_std", proc.image_std)
    if 0.0 in std:
        raise _field_error("image_std", proc.image_std, "non-zero")
    object.__setattr__(proc, "image_std", std)
    factor = _finite("rescale_factor", proc.rescale_factor)
    if factor <= 0:
        raise _field_error("rescale_factor", proc.rescale_factor, "positive")
    object.__setattr__(proc, "rescale_factor", factor)
    for name in ("do_resize", "do_rescale", "do_normalize"):
        _flag(name, getattr(proc, name))


def _value_table(proc) -> np.ndarray:
    """[3, 256] float32: what rescale then normalize make of each uint8 value in each channel, computed with
    transformers' operations and dtypes (float64 rescale cast to float32, float32 normalize)."""
    x = np.arange(256, dtype=np.uint8)
    x = (x.astype(np.float64) * proc.rescale_factor).astype(np.float32) if proc.do_rescale \
        else x.astype(np.float32)
    if not proc.do_normalize:
        return np.stack([x, x, x])
    mean = np.asarray(proc.image_mean, dtype=np.float32)
    std = np.asarray(proc.image_std, dtype=np.float32)
    return ((x[None, :] - mean[:, None]) / std[:, None]).astype(np.float32)


def _hf_config(preprocessor_config, processor_config) -> tuple[dict, dict]:
    """(image processor settings, processor settings): newer transformers save the former nested in
    processor_config.json as "image_processor"."""
    if processor_config is not None and not isinstance(processor_config, dict):
        raise _error(f"the processor config must be a JSON object, got {type(processor_config).__name__}")
    processor_config = processor_config or {}
    nested = processor_config.get("image_processor")
    if not preprocessor_config and isinstance(nested, dict):
        preprocessor_config = nested
    cfg = preprocessor_config or {}
    if not isinstance(cfg, dict):
        raise _error(f"the image processor config must be a JSON object, got {type(cfg).__name__}")
    return cfg, processor_config


def _check_type(cfg: dict, accepted: tuple[str, ...]) -> None:
    kind = cfg.get("image_processor_type")
    if kind is not None:
        base = kind.removesuffix("Fast").removesuffix("Pil") if isinstance(kind, str) else kind
        if base not in accepted:
            raise _field_error("image_processor_type", kind, " or ".join(accepted))


def _pixel_settings(cfg: dict, resample: int, mean, std) -> dict:
    """The resize filter, rescale and normalize settings every processor reads, with transformers' defaults."""
    return dict(resample=cfg.get("resample", resample), image_mean=cfg.get("image_mean", mean),
                image_std=cfg.get("image_std", std), rescale_factor=cfg.get("rescale_factor", 1 / 255),
                do_resize=cfg.get("do_resize", True), do_rescale=cfg.get("do_rescale", True),
                do_normalize=cfg.get("do_normalize", True))


def _settings_from_dict(cls, d, kind: str, what: str):
    if not isinstance(d, dict):
        raise _error(f"a {what} must be a JSON object, got {type(d).__name__}")
    d = dict(d)
    got = d.pop("kind", kind)
    if got != kind:
        raise _error(f"these are not {what} settings (kind {got!r}, expected {kind!r})")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise _error(f"unknown {what} settings: {', '.join(unknown)}")
    try:
        return cls(**d)
    except TypeError as e:  # a required setting is missing
        raise _error(f"incomplete {what} settings: {e}") from None


def _whole_units(width: int, height: int, unit: int) -> tuple[int, int]:
    """(height, width) of an image a patch processor takes unresized: both must be multiples of its unit (patch x
    merge), or transformers' reshape would fail."""
    if height % unit or width % unit:
        raise _error(f"the image is {width}x{height} pixels; without resizing, this model takes images whose width "
                     f"and height are multiples of {unit}")
    return height, width


def _edge(field: str, value) -> int:
    if isinstance(value, dict) and "longest_edge" in value:
        return _positive_int(f"{field}.longest_edge", value["longest_edge"])
    raise _field_error(field, value, 'an object with "longest_edge"')


class _Settings:
    """A processor's settings as a JSON-able dict (``to_dict``/``from_dict``, with the "kind" the readers dispatch
    on): the image processors' here, the video processors' (flared.frontend.video)."""

    kind: ClassVar[str]
    label: ClassVar[str]  # how errors name it

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["image_mean"], d["image_std"] = list(self.image_mean), list(self.image_std)
        d["kind"] = self.kind
        return d

    @classmethod
    def from_dict(cls, d: dict):
        return _settings_from_dict(cls, d, cls.kind, cls.label)


@dataclass(frozen=True, kw_only=True)
class _Processor(_Settings):
    """What the processors share: the pixel settings every transformers image processor has (resample filter,
    mean/std, rescale, the do_* switches), their settings as a dict (_Settings), an image's identity (a versioned
    tag, the decoded pixels' digest and the settings), and the RGB check."""

    identity_tag: ClassVar[bytes]
    modality: ClassVar[str] = "image"  # (flared.frontend.audio's processors: "audio")

    resample: int  # PIL resample filter id (BICUBIC = 3, LANCZOS = 1)
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    def _settings_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    @property
    def placeholder(self) -> str:
        """What the chat template writes for an image, which ``prepare``'s prompt replaces: the image token (Gemma
        3: its start-of-image token)."""
        return self.image_token

    def _identity(self, image: DecodedImage) -> bytes:
        return hashlib.sha256(self.identity_tag + image.digest + self._settings_bytes()).digest()

    def prepare_in_request(self, image: DecodedImage, *, images: int) -> PreparedImage:
        """``prepare`` for one of a request's ``images`` images: as alone, unless the family prepares an image
        among several otherwise (LLaVA-OneVision: AnyresProcessor)."""
        return self.prepare(image)

    @staticmethod
    def _rgb(image: DecodedImage) -> Image.Image:
        if image.image.mode != "RGB":
            raise _error(f"internal: a decoded image must be RGB, got {image.image.mode}", ErrorKind.EXECUTION)
        return image.image

    def _normalized(self, values: np.ndarray, channel_axis: int) -> np.ndarray:
        """uint8 ``values`` -> float32 of the same shape: each channel (along ``channel_axis``) rescaled then
        normalized, through ``_value_table``."""
        lut = _value_table(self)
        out = np.empty(values.shape, dtype=np.float32)
        for c in range(3):
            at = (slice(None),) * channel_axis + (c,)
            out[at] = lut[c][values[at]]
        return out

    def _resized_pixels(self, image: DecodedImage) -> np.ndarray:
        """[H, W, 3] uint8 at the size ``_resized_size`` gives (processors of any-size images)."""
        im = self._rgb(image)
        height, width = self._resized_size(im.width, im.height)
        if self.do_resize:
            im = im.resize((width, height), resample=self.resample)
        pixels = np.asarray(im)
        if pixels.shape != (height, width, 3):  # cannot happen
            raise _error(f"internal: resized to {pixels.shape}, not {height}x{width}", ErrorKind.EXECUTION)
        return pixels


@dataclass(frozen=True, kw_only=True)
class TileProcessor(_Processor):
    """SmolVLM / Idefics3 preprocessing (transformers' ``SmolVLMImageProcessorPil`` /
    ``Idefics3ImageProcessorPil``, which are the same) and the prompt text for one image."""

    kind: ClassVar[str] = "tiles"  # to_dict's "kind" (image_processor_from_dict dispatches on it)
    label: ClassVar[str] = "tile processor"
    identity_tag: ClassVar[bytes] = b"flared.tile-processor.v1\0"

    longest_edge: int  # preprocessor_config "size": {"longest_edge": N}
    tile: int  # "max_image_size": {"longest_edge": N}
    split: bool  # "do_image_splitting"
    image_seq_len: int  # image tokens per tile (processor_config.json "image_seq_len")
    image_token: str = "<image>"
    fake_token: str = "<fake_token_around_image>"
    global_token: str = "<global-img>"

    def __post_init__(self):
        _positive_int("size.longest_edge", self.longest_edge)
        _positive_int("max_image_size.longest_edge", self.tile)
        if self.tile > MAX_IMAGE_SIZE:
            raise _field_error("max_image_size.longest_edge", self.tile, f"at most {MAX_IMAGE_SIZE}")
        _flag("do_image_splitting", self.split)
        _check_pixel_settings(self)
        _positive_int("image_seq_len", self.image_seq_len)
        for name in ("image_token", "fake_token", "global_token"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise _field_error(name, getattr(self, name), "a non-empty string")

    # -- configuration ------------------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, preprocessor_config: dict, processor_config: dict | None, *,
                image_seq_len: int) -> TileProcessor:
        """From a Hugging Face ``preprocessor_config.json`` (and ``processor_config.json``), with transformers'
        defaults for missing fields. ``image_seq_len`` is the model's image tokens per tile; a
        ``processor_config`` that says otherwise is an error (the model would reject the prompt).
        ``do_convert_rgb`` is not read (a ``DecodedImage`` is RGB already; transformers with it off only works on
        RGB input anyway) and neither is ``do_pad`` (it only pads a batch to its largest image's tile count)."""
        cfg, processor_config = _hf_config(preprocessor_config, processor_config)
        _check_type(cfg, PROCESSOR_TYPES)
        seq = processor_config.get("image_seq_len", image_seq_len)
        if seq != image_seq_len:
            raise _error(f"processor setting 'image_seq_len' is {seq!r} but the model takes {image_seq_len} "
                         "image tokens per tile")
        return cls(
            longest_edge=_edge("size", cfg.get("size", {"longest_edge": HF_DEFAULT_LONGEST_EDGE})),
            tile=_edge("max_image_size", cfg.get("max_image_size", {"longest_edge": HF_DEFAULT_TILE})),
            split=cfg.get("do_image_splitting", True),
            **_pixel_settings(cfg, LANCZOS, HF_DEFAULT_MEAN, HF_DEFAULT_STD),
            image_seq_len=image_seq_len,
        )

    def _settings_bytes(self) -> bytes:
        d = self.to_dict()
        del d["kind"]  # identities stay what they were before "kind" existed
        return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()

    # -- geometry -----------------------------------------------------------------------------------------

    def _resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) the image has when it is cut into tiles (or squashed to one)."""
        if self.do_resize:
            height, width = _longest_edge_size(height, width, self.longest_edge)
        if not self.split:
            return self.tile, self.tile
        return _tile_multiple_size(height, width, self.tile)

    def _grid(self, height: int, width: int) -> tuple[int, int]:
        t = self.tile
        if self.split and (height > t or width > t):
            return (height - t) // t + 1, (width - t) // t + 1
        return 0, 0

    def num_tiles(self, width: int, height: int) -> int:
        """How many tiles ``prepare`` makes of a width x height image, without resizing anything."""
        rows, cols = self._grid(*self._resized_size(width, height))
        return rows * cols + 1 if rows or cols else 1

    def prompt(self, rows: int, cols: int) -> str:
        """The text for one image (transformers' ``get_image_prompt_string``)."""
        seq = self.image_token * self.image_seq_len
        glob = f"{self.fake_token}{self.global_token}{seq}{self.fake_token}"
        if rows == 0 and cols == 0:
            return glob
        lines = ["".join(f"{self.fake_token}<row_{r + 1}_col_{c + 1}>{seq}" for c in range(cols)) + "\n"
                 for r in range(rows)]
        return "".join(lines) + "\n" + glob

    # -- pixels -------------------------------------------------------------------------------------------

    def prepare(self, image: DecodedImage) -> PreparedImage:
        im = self._rgb(image)
        if self.do_resize:
            h, w = _longest_edge_size(im.height, im.width, self.longest_edge)
            im = im.resize((w, h), resample=self.resample)
        t = self.tile
        if self.split:
            h, w = _tile_multiple_size(im.height, im.width, t)
            im = im.resize((w, h), resample=self.resample)
            rows, cols = self._grid(h, w)
        else:
            im = im.resize((t, t), resample=self.resample)
            rows, cols = 0, 0
        pixels = np.asarray(im)  # [H, W, 3] uint8
        if rows or cols:
            tiles = [pixels[r * t:(r + 1) * t, c * t:(c + 1) * t] for r in range(rows) for c in range(cols)]
            tiles.append(np.asarray(im.resize((t, t), resample=self.resample)))
        else:
            tiles = [pixels]
        if any(x.shape != (t, t, 3) for x in tiles):  # cannot happen: sizes are whole tiles by construction
            raise _error(f"internal: tile shapes {[x.shape for x in tiles]} are not {t}x{t}", ErrorKind.EXECUTION)
        out = self._normalized(np.stack(tiles).transpose(0, 3, 1, 2), 1)  # [N, 3, t, t]
        identity = self._identity(image)
        return PreparedImage(
            pixel_values=out,
            rows=rows,
            cols=cols,
            prompt=self.prompt(rows, cols),
            num_image_tokens=len(tiles) * self.image_seq_len,
            identity=identity,
        )


# ------------------------------------------------------------------------------------- Qwen2-VL patches

def _smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) after transformers' Qwen2-VL ``smart_resize``: multiples of ``factor`` near the
    original size, scaled down to at most ``max_pixels`` or up to at least ``min_pixels``. The float
    operations are the ones transformers makes, in the same order, so the rounding agrees."""
    long, short = max(height, width), min(height, width)
    if long / short > MAX_ASPECT_RATIO:
        raise _error(f"the image is {width}x{height} pixels: its long edge is more than {MAX_ASPECT_RATIO} times "
                     f"its short edge, which this model's image processor refuses")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def _pixel_range(cfg: dict) -> tuple[int, int]:
    """(min_pixels, max_pixels) as transformers' Qwen2-VL image processor reads them: ``size`` (the class
    default where absent) with "shortest_edge" / "longest_edge", each overridden by a top-level
    ``min_pixels`` / ``max_pixels`` (those win over ``size``)."""
    size = cfg.get("size")
    if size is None:
        size = {"shortest_edge": QWEN_MIN_PIXELS, "longest_edge": QWEN_MAX_PIXELS}
    if not isinstance(size, dict):
        raise _field_error("size", size, 'an object with "shortest_edge" and "longest_edge" (pixel counts)')
    size = dict(size)
    sources = {"shortest_edge": "size.shortest_edge", "longest_edge": "size.longest_edge"}
    for top, key in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        if cfg.get(top) is not None:
            size[key] = cfg[top]
            size.pop(top, None)
            sources[key] = top
    if set(size) != {"shortest_edge", "longest_edge"}:
        raise _field_error("size", cfg.get("size"), 'an object with "shortest_edge" and "longest_edge" (or '
                           'top-level "min_pixels" and "max_pixels")')
    lo = _positive_int(sources["shortest_edge"], size["shortest_edge"])
    hi = _positive_int(sources["longest_edge"], size["longest_edge"])
    return lo, hi


@dataclass(frozen=True, kw_only=True)
class PatchProcessor(_Processor):
    """Qwen2-VL / Qwen2.5-VL preprocessing (transformers' ``Qwen2VLImageProcessorPil``) and the prompt text for
    one image: the image token repeated once per merged patch block."""

    kind: ClassVar[str] = "patches"  # to_dict's "kind" (image_processor_from_dict dispatches on it)
    options: ClassVar[tuple[str, ...]] = ("min_pixels", "max_pixels")  # (vLLM's mm_processor_kwargs it reads)
    label: ClassVar[str] = "patch processor"
    identity_tag: ClassVar[bytes] = b"flared.patch-processor.v1\0"

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int  # size.shortest_edge (or "min_pixels"): a pixel count, not an edge
    max_pixels: int  # size.longest_edge (or "max_pixels")
    image_token: str = QWEN_IMAGE_TOKEN

    def __post_init__(self):
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            _positive_int(name, getattr(self, name))
        if self.min_pixels > self.max_pixels:
            raise _field_error("min_pixels", self.min_pixels, f"at most max_pixels ({self.max_pixels})")
        _check_pixel_settings(self)
        if not isinstance(self.image_token, str) or not self.image_token:
            raise _field_error("image_token", self.image_token, "a non-empty string")

    # -- configuration ------------------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, preprocessor_config: dict, processor_config: dict | None) -> PatchProcessor:
        """From a Hugging Face ``preprocessor_config.json`` (and ``processor_config.json``), with transformers'
        defaults for missing fields. ``do_convert_rgb`` is not read (a ``DecodedImage`` is RGB already)."""
        cfg, _ = _hf_config(preprocessor_config, processor_config)
        _check_type(cfg, PATCH_PROCESSOR_TYPES)
        min_pixels, max_pixels = _pixel_range(cfg)
        return cls(
            patch_size=cfg.get("patch_size", QWEN_PATCH_SIZE),
            temporal_patch_size=cfg.get("temporal_patch_size", QWEN_TEMPORAL_PATCH_SIZE),
            merge_size=cfg.get("merge_size", QWEN_MERGE_SIZE),
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            **_pixel_settings(cfg, BICUBIC, QWEN_MEAN, QWEN_STD),
        )

    # -- geometry -----------------------------------------------------------------------------------------

    @property
    def factor(self) -> int:
        """Edges are multiples of this many pixels: one merged block of patches."""
        return self.patch_size * self.merge_size

    def _resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) the image is patched at."""
        if self.do_resize:
            return _smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return _whole_units(width, height, self.factor)

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """(t, h, w) in patches for a width x height image (transformers' ``image_grid_thw`` row)."""
        h, w = self._resized_size(width, height)
        return 1, h // self.patch_size, w // self.patch_size

    def num_image_tokens_for(self, width: int, height: int) -> int:
        """How many image tokens ``prepare`` gives a width x height image, without resizing anything."""
        t, h, w = self.grid(width, height)
        return t * h * w // self.merge_size ** 2

    def prompt(self, num_image_tokens: int) -> str:
        """The text for one image (transformers' ``Qwen2VLProcessor.replace_image_token``)."""
        return self.image_token * num_image_tokens

    # -- pixels -------------------------------------------------------------------------------------------

    def prepare(self, image: DecodedImage) -> PreparedImage:
        pixels = self._resized_pixels(image)  # [H, W, 3] uint8
        height, width = pixels.shape[:2]
        p, m, frames = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = height // p, width // p
        # [block row, patch row in block, y, block col, patch col in block, x, channel]
        # -> [block row, block col, patch row in block, patch col in block, channel, y, x]
        blocks = pixels.reshape(gh // m, m, p, gw // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
        patches = blocks.reshape(gh * gw, 3, p * p)  # uint8 copy, in merge-block order
        # the same image in every temporal frame
        out = np.repeat(self._normalized(patches, 1)[:, :, None, :], frames, axis=2)
        out = out.reshape(gh * gw, 3 * frames * p * p)
        tokens = gh * gw // (m * m)
        identity = self._identity(image)
        return PreparedImage(
            pixel_values=out,
            rows=0,
            cols=0,
            prompt=self.prompt(tokens),
            num_image_tokens=tokens,
            identity=identity,
            grid=(1, gh, gw),
        )


# ------------------------------------------------------------------------------ Pixtral / Mistral3 lines

def _square_patch(field: str, value) -> int:
    """A patch size given as a number or as transformers' ``{"height": N, "width": N}`` (square only)."""
    if isinstance(value, dict):
        if set(value) != {"height", "width"} or value["height"] != value["width"]:
            raise _field_error(field, value, 'a positive integer or {"height": N, "width": N} with equal sides')
        value = value["height"]
    return _positive_int(field, value)


def _pixtral_size(height: int, width: int, longest: int, unit: int) -> tuple[int, int]:
    """(height, width) after transformers' Pixtral ``get_resize_output_image_size``: scaled down (rounded down)
    to fit ``longest`` x ``longest`` when larger, then rounded up to multiples of ``unit``. The float operations
    are the ones transformers makes, in the same order, so the rounding agrees. (0, n) or (n, 0) for an image
    too thin to keep a pixel of its short edge."""
    ratio = max(height / longest, width / longest)
    if ratio > 1:
        height = math.floor(height / ratio)
        width = math.floor(width / ratio)
    return (height + unit - 1) // unit * unit, (width + unit - 1) // unit * unit


@dataclass(frozen=True, kw_only=True)
class PixtralProcessor(_Processor):
    """Pixtral-12B / Mistral3 (Mistral-Small-3.1) preprocessing (transformers' ``PixtralImageProcessorPil`` as
    ``PixtralProcessor`` drives it) and the prompt text for one image: lines of ``[IMG]`` tokens, each ended by
    ``[IMG_BREAK]``, the last by ``[IMG_END]``."""

    kind: ClassVar[str] = "pixtral"  # to_dict's "kind" (image_processor_from_dict dispatches on it)
    label: ClassVar[str] = "pixtral processor"
    identity_tag: ClassVar[bytes] = b"flared.pixtral-processor.v1\0"

    patch_size: int  # the vision tower's patch edge (16 Pixtral-12B, 14 Mistral-Small-3.1)
    longest_edge: int  # size.longest_edge: larger images are scaled down to fit
    merge_size: int  # processor_config.json "spatial_merge_size": merge_size**2 patches make one image token
    image_token: str = PIXTRAL_IMAGE_TOKEN
    break_token: str = PIXTRAL_BREAK_TOKEN
    end_token: str = PIXTRAL_END_TOKEN

    def __post_init__(self):
        for name in ("patch_size", "longest_edge", "merge_size"):
            _positive_int(name, getattr(self, name))
        _check_pixel_settings(self)
        for name in ("image_token", "break_token", "end_token"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise _field_error(name, getattr(self, name), "a non-empty string")
        for name in ("break_token", "end_token"):
            if getattr(self, name) == self.image_token:
                raise _field_error(name, getattr(self, name), f"other than image_token {self.image_token!r}")

    # -- configuration ------------------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, preprocessor_config: dict, processor_config: dict | None) -> PixtralProcessor:
        """From a Hugging Face ``preprocessor_config.json`` and ``processor_config.json``, with transformers'
        defaults for missing fields. The processor config gives ``spatial_merge_size`` (default 1), the three
        tokens and the patch size: transformers' PixtralProcessor passes its own ``patch_size`` (times the merge
        size) to the image processor, so it wins over the image processor's; the latter (else 16) is used where
        the processor config has none. ``do_convert_rgb`` and ``do_pad`` are not read (a ``DecodedImage`` is RGB
        already; padding only evens out a batch)."""
        cfg, proc = _hf_config(preprocessor_config, processor_config)
        _check_type(cfg, PIXTRAL_PROCESSOR_TYPES)
        if cfg.get("do_center_crop"):
            raise _field_error("do_center_crop", cfg["do_center_crop"], "false (Pixtral images are not cropped)")
        patch = _square_patch("patch_size", cfg.get("patch_size", PIXTRAL_PATCH_SIZE))  # checked even if unused
        if proc.get("patch_size") is not None:
            patch = _square_patch("patch_size", proc["patch_size"])
        return cls(
            patch_size=patch,
            longest_edge=_edge("size", cfg.get("size", {"longest_edge": PIXTRAL_LONGEST_EDGE})),
            merge_size=_positive_int("spatial_merge_size", proc.get("spatial_merge_size", PIXTRAL_MERGE_SIZE)),
            **_pixel_settings(cfg, BICUBIC, PIXTRAL_MEAN, PIXTRAL_STD),
            image_token=proc.get("image_token", PIXTRAL_IMAGE_TOKEN),
            break_token=proc.get("image_break_token", PIXTRAL_BREAK_TOKEN),
            end_token=proc.get("image_end_token", PIXTRAL_END_TOKEN),
        )

    # -- geometry -----------------------------------------------------------------------------------------

    @property
    def factor(self) -> int:
        """Edges are multiples of this many pixels: the patches one image token covers."""
        return self.patch_size * self.merge_size

    def _resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) the image is patched at."""
        if not self.do_resize:
            return _whole_units(width, height, self.factor)
        h, w = _pixtral_size(height, width, self.longest_edge, self.factor)
        if h == 0 or w == 0:
            raise _error(f"the image is {width}x{height} pixels: scaled to fit {self.longest_edge} pixels, its "
                         f"short edge would be less than one pixel, which this model's image processor refuses")
        return h, w

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """(1, h, w) in patches (before merging) for a width x height image."""
        h, w = self._resized_size(width, height)
        return 1, h // self.patch_size, w // self.patch_size

    def lines(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) of image tokens in the prompt for a width x height image."""
        h, w = self._resized_size(width, height)
        return h // self.factor, w // self.factor

    def num_image_tokens_for(self, width: int, height: int) -> int:
        """How many image tokens ``prepare`` gives a width x height image, without resizing anything."""
        rows, cols = self.lines(width, height)
        return rows * cols

    def prompt(self, rows: int, cols: int) -> str:
        """The text for one image (transformers' ``PixtralProcessor.replace_image_token``)."""
        line = self.image_token * cols
        return (line + self.break_token) * (rows - 1) + line + self.end_token

    # -- pixels -------------------------------------------------------------------------------------------

    def prepare(self, image: DecodedImage) -> PreparedImage:
        pixels = self._resized_pixels(image)  # [H, W, 3] uint8
        height, width = pixels.shape[:2]
        out = self._normalized(pixels.transpose(2, 0, 1), 0)  # [3, H, W]
        rows, cols = height // self.factor, width // self.factor
        identity = self._identity(image)
        return PreparedImage(
            pixel_values=out,
            rows=rows,
            cols=cols,
            prompt=self.prompt(rows, cols),
            num_image_tokens=rows * cols,
            identity=identity,
            grid=(1, height // self.patch_size, width // self.patch_size),
        )


# ------------------------------------------------------------------------------ CLIP / LLaVA-1.5 crops

def _shortest_edge_size(height: int, width: int, shortest: int) -> tuple[int, int]:
    """(height, width) after transformers' ``get_resize_output_image_size(default_to_square=False)``: the short
    edge becomes ``shortest`` (up or down), the long one ``int(shortest * long / short)`` (truncated), the
    float operations in transformers' order."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = shortest, int(shortest * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def _center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """[height, width, C] from the middle of ``pixels`` ([H, W, C]) as transformers' ``center_crop`` takes it:
    offsets rounded down; an image smaller than the crop is first put on a black (zero) canvas, offsets there
    rounded up."""
    h, w = pixels.shape[:2]
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return pixels[top:top + height, left:left + width]
    nh, nw = max(height, h), max(width, w)
    top_pad, left_pad = math.ceil((nh - h) / 2), math.ceil((nw - w) / 2)
    canvas = np.zeros((nh, nw) + pixels.shape[2:], dtype=pixels.dtype)
    canvas[top_pad:top_pad + h, left_pad:left_pad + w] = pixels
    top, left = top + top_pad, left + left_pad
    return canvas[max(0, top):min(nh, top + height), max(0, left):min(nw, left + width)]


def _crop_size(field: str, value) -> tuple[int, int]:
    """(height, width) from transformers' ``crop_size``: ``{"height": H, "width": W}`` or one number (a square)."""
    if isinstance(value, dict):
        if set(value) != {"height", "width"}:
            raise _field_error(field, value, 'a positive integer or {"height": H, "width": W}')
        return _positive_int(f"{field}.height", value["height"]), _positive_int(f"{field}.width", value["width"])
    n = _positive_int(field, value)
    return n, n


def _shortest_edge(field: str, value) -> int:
    """``size`` as CLIP reads it: ``{"shortest_edge": N}`` or one number (transformers' default_to_square=False)."""
    if isinstance(value, dict):
        if set(value) != {"shortest_edge"}:
            raise _field_error(field, value, 'a positive integer or {"shortest_edge": N}')
        return _positive_int(f"{field}.shortest_edge", value["shortest_edge"])
    return _positive_int(field, value)


@dataclass(frozen=True, kw_only=True)
class CropProcessor(_Processor):
    """CLIP-tower models such as LLaVA-1.5 (transformers' ``CLIPImageProcessorPil``, and
    ``LlavaImageProcessorPil`` with its ``do_pad``) and the prompt text for one image: the image token repeated
    ``image_seq_len`` times, what ``LlavaProcessor`` expands ``<image>`` into.

    1. ``pad_to_square`` (LLaVA's ``do_pad``): the image is centred (offset rounded down) on a square of its long
       edge filled with ``int(mean * 255)`` per channel.
    2. ``do_resize``: the short edge becomes ``shortest_edge``, the long one follows the aspect ratio, truncated
       (``_shortest_edge_size``). One Pillow resize of the uint8 RGB image (``resample``, BICUBIC by default).
    3. ``do_center_crop``: the middle ``crop_height`` x ``crop_width`` (``_center_crop``; zero-padded where the
       image is smaller).
    4. ``do_rescale`` / ``do_normalize`` exactly as for the tiles (one 256-entry table per channel).
    ``pixel_values`` is [3, crop_height, crop_width] (without the crop, the resized image's size)."""

    kind: ClassVar[str] = "crop"  # to_dict's "kind" (image_processor_from_dict dispatches on it)
    label: ClassVar[str] = "crop processor"
    identity_tag: ClassVar[bytes] = b"flared.crop-processor.v1\0"

    shortest_edge: int  # size.shortest_edge
    crop_height: int  # crop_size.height
    crop_width: int  # crop_size.width
    image_seq_len: int  # image tokens the model makes of one image (from the vision tower)
    do_center_crop: bool = True
    pad_to_square: bool = False  # LlavaImageProcessor's do_pad (CLIP has none)
    image_token: str = CLIP_IMAGE_TOKEN

    def __post_init__(self):
        for name in ("shortest_edge", "crop_height", "crop_width", "image_seq_len"):
            _positive_int(name, getattr(self, name))
        _check_pixel_settings(self)
        for name in ("do_center_crop", "pad_to_square"):
            _flag(name, getattr(self, name))
        if self.pad_to_square:
            bad = [m for m in self.image_mean if not 0 <= int(m * 255) <= 255]
            if bad:  # transformers' uint8 canvas could not hold the colour
                raise _field_error("image_mean", list(self.image_mean), "within 0-1 to pad with it (do_pad)")
        if not isinstance(self.image_token, str) or not self.image_token:
            raise _field_error("image_token", self.image_token, "a non-empty string")

    # -- configuration ------------------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, preprocessor_config: dict, processor_config: dict | None, *,
                image_seq_len: int | None) -> CropProcessor:
        """From a Hugging Face ``preprocessor_config.json`` (and ``processor_config.json``), with transformers'
        defaults for missing fields. ``image_seq_len`` is the model's image tokens per image (from its vision
        tower); where the processor config has ``patch_size``, LlavaProcessor's count from it (patches of the
        crop, plus ``num_additional_image_tokens``, less one for the "default" feature strategy) must agree.
        ``do_pad`` is read for LLaVA only (CLIP's base class pads a batch, which one image never needs);
        ``do_convert_rgb`` is not read (a ``DecodedImage`` is RGB already)."""
        cfg, proc = _hf_config(preprocessor_config, processor_config)
        _check_type(cfg, CROP_PROCESSOR_TYPES)
        if image_seq_len is None:
            raise _error("image processor setting 'image_seq_len' is needed for a crop processor (CLIP / LLaVA)")
        crop_h, crop_w = _crop_size("crop_size", cfg.get("crop_size", {"height": 224, "width": 224}))
        kind = cfg.get("image_processor_type")
        if kind is not None:
            llava = kind.removesuffix("Fast").removesuffix("Pil") == "LlavaImageProcessor"
        else:
            llava = any(src.get("processor_class") in _CROP_PROCESSOR_CLASSES for src in (cfg, proc))
        pad = _flag("do_pad", cfg.get("do_pad", False)) if llava else False
        self = cls(
            shortest_edge=_shortest_edge("size", cfg.get("size", {"shortest_edge": 224})),
            crop_height=crop_h,
            crop_width=crop_w,
            do_center_crop=cfg.get("do_center_crop", True),
            pad_to_square=pad,
            **_pixel_settings(cfg, BICUBIC, CLIP_MEAN, CLIP_STD),
            image_seq_len=image_seq_len,
            image_token=proc.get("image_token", CLIP_IMAGE_TOKEN),
        )
        if proc.get("patch_size") is not None and self.do_center_crop:
            p = _positive_int("patch_size", proc["patch_size"])
            extra = proc.get("num_additional_image_tokens", 0)
            if isinstance(extra, bool) or not isinstance(extra, int) or extra < 0:
                raise _field_error("num_additional_image_tokens", extra, "a non-negative integer")
            n = (crop_h // p) * (crop_w // p) + extra - (proc.get("vision_feature_select_strategy") == "default")
            if n != image_seq_len:
                raise _error(f"the processor config makes {n} image tokens per image but the model takes "
                             f"{image_seq_len}")
        return self

    # -- geometry -----------------------------------------------------------------------------------------

    def output_size(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) of ``pixel_values`` for a width x height image."""
        if self.pad_to_square:
            height = width = max(height, width)
        if self.do_resize:
            height, width = _shortest_edge_size(height, width, self.shortest_edge)
        if self.do_center_crop:
            return self.crop_height, self.crop_width
        return height, width

    def num_image_tokens_for(self, width: int, height: int) -> int:
        """How many image tokens ``prepare`` gives an image: always ``image_seq_len``."""
        return self.image_seq_len

    def prompt(self) -> str:
        """The text for one image (transformers' ``LlavaProcessor.replace_image_token``)."""
        return self.image_token * self.image_seq_len

    # -- pixels -------------------------------------------------------------------------------------------

    def _padded(self, im: Image.Image) -> Image.Image:
        return _pad_square(im, self.image_mean) if self.pad_to_square else im

    def prepare(self, image: DecodedImage) -> PreparedImage:
        im = self._padded(self._rgb(image))
        if self.do_resize:
            h, w = _shortest_edge_size(im.height, im.width, self.shortest_edge)
            im = im.resize((w, h), resample=self.resample)
        pixels = np.asarray(im)  # [H, W, 3] uint8
        if self.do_center_crop:
            pixels = _center_crop(pixels, self.crop_height, self.crop_width)
        expected = self.output_size(image.width, image.height)
        if pixels.shape != expected + (3,):  # cannot happen
            raise _error(f"internal: cropped to {pixels.shape}, not {expected}", ErrorKind.EXECUTION)
        out = self._normalized(pixels.transpose(2, 0, 1), 0)  # [3, H, W]
        identity = self._identity(image)
        return PreparedImage(
            pixel_values=out,
            rows=0,
            cols=0,
            prompt=self.prompt(),
            num_image_tokens=self.image_seq_len,
            identity=identity,
        )


@dataclass(frozen=True, kw_only=True)
class SquareProcessor(_Processor):
    """Gemma 3 (transformers' ``Gemma3ImageProcessorPil`` without pan-and-scan) and the prompt text for one image:
    the image resized to ``height`` x ``width`` whatever its aspect (one Pillow resize of the uint8 RGB image,
    BILINEAR by default), rescaled and normalized; the chat template's start-of-image token becomes
    Gemma3Processor's "\n\n<start_of_image>", ``image_seq_len`` image tokens, "<end_of_image>\n\n".
    ``pixel_values`` is [3, height, width]."""

    kind: ClassVar[str] = "square"  # to_dict's "kind" (image_processor_from_dict dispatches on it)
    label: ClassVar[str] = "square processor"
    identity_tag: ClassVar[bytes] = b"flared.square-processor.v1\0"

    height: int  # size.height
    width: int  # size.width
    image_seq_len: int  # image tokens the model makes of one image (from the vision tower)
    image_token: str = GEMMA3_IMAGE_TOKEN
    boi_token: str = GEMMA3_BOI_TOKEN
    eoi_token: str = GEMMA3_EOI_TOKEN

    def __post_init__(self):
        for name in ("height", "width", "image_seq_len"):
            _positive_int(name, getattr(self, name))
        _check_pixel_settings(self)
        for name in ("image_token", "boi_token", "eoi_token"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise _field_error(name, getattr(self, name), "a non-empty string")

    @classmethod
    def from_hf(cls, preprocessor_config: dict, processor_config: dict | None, *,
                image_seq_len: int | None) -> SquareProcessor:
        """From a Hugging Face ``preprocessor_config.json`` (and ``processor_config.json``), with transformers'
        defaults for missing fields; ``image_seq_len``: the model's image tokens per image (its tower's), which a
        processor config's ``image_seq_length`` must agree with. Pan-and-scan (``do_pan_and_scan``, off in the
        released configs) is refused."""
        cfg, proc = _hf_config(preprocessor_config, processor_config)
        _check_type(cfg, SQUARE_PROCESSOR_TYPES)
        if image_seq_len is None:
            raise _error("image processor setting 'image_seq_len' is needed for a square processor (Gemma 3)")
        if cfg.get("do_pan_and_scan"):
            raise _field_error("do_pan_and_scan", cfg["do_pan_and_scan"], "false (pan-and-scan crops are not read)")
        declared = proc.get("image_seq_length", cfg.get("image_seq_length", image_seq_len))  # (either file says it)
        if declared != image_seq_len:
            raise _error(f"processor setting 'image_seq_length' is {declared!r} but the model takes {image_seq_len} "
                         "image tokens per image")
        height, width = _crop_size("size", cfg.get("size", {"height": 224, "width": 224}))
        return cls(height=height, width=width, **_pixel_settings(cfg, BILINEAR, HF_DEFAULT_MEAN, HF_DEFAULT_STD),
                   image_seq_len=image_seq_len)

    @property
    def placeholder(self) -> str:
        return self.boi_token

    def num_image_tokens_for(self, width: int, height: int) -> int:
        """How many image tokens ``prepare`` gives an image: always ``image_seq_len``."""
        return self.image_seq_len

    def prompt(self) -> str:
        """The text for one image (transformers' ``Gemma3Processor.full_image_sequence``)."""
        return f"\n\n{self.boi_token}{self.image_token * self.image_seq_len}{self.eoi_token}\n\n"

    def prepare(self, image: DecodedImage) -> PreparedImage:
        im = self._rgb(image)
        if self.do_resize:
            im = im.resize((self.width, self.height), resample=self.resample)
        pixels = np.asarray(im)  # [H, W, 3] uint8
        return PreparedImage(pixel_values=self._normalized(pixels.transpose(2, 0, 1), 0), rows=0, cols=0,
                             prompt=self.prompt(), num_image_tokens=self.image_seq_len,
                             identity=self._identity(image))


def pooled_size(height: int, width: int, patch_size: int, max_soft_tokens: int, pool: int) -> tuple[int, int]:
    """(height, width) transformers' Gemma 4 processors resize an image to (get_aspect_ratio_preserving_size): the
    largest of its aspect in whole pool x patch blocks with at most max_soft_tokens x pool^2 patches; a side that
    rounds to nothing is one block, the other its ratio's whole blocks up to the budget's side."""
    max_patches = max_soft_tokens * pool * pool
    target = max_patches * patch_size ** 2
    factor = math.sqrt(target / (height * width))
    unit = pool * patch_size
    new_h, new_w = int(math.floor(factor * height / unit)) * unit, int(math.floor(factor * width / unit)) * unit
    longest = (max_patches // pool ** 2) * unit
    if new_h == 0 and new_w == 0:  # (cannot happen: factor^2 x area is the budget)
        raise _error(f"a {width}x{height} image cannot be resized to whole {unit}-pixel blocks")
    if new_h == 0:
        new_h, new_w = unit, min(int(math.floor(width / height)) * unit, longest)
    elif new_w == 0:
        new_h, new_w = min(int(math.floor(height / width)) * unit, longest), unit
    if new_h * new_w > target:  # (transformers refuses these too)
        raise _error(f"a {width}x{height} image is too far from square for this model: it would take "
                     f"{new_w}x{new_h} pixels, past the {max_soft_tokens}-token budget")
    return new_h, new_w


def _soft_tokens(field: str, value) -> int:
    if value not in POOLED_SOFT_TOKENS or isinstance(value, bool):
        raise _field_error(field, value, "one of " + ", ".join(map(str, POOLED_SOFT_TOKENS)))
    return int(value)


@dataclass(frozen=True, kw_only=True)
class PooledPatchProcessor(_Processor):
    """Gemma 4 (transformers' ``Gemma4ImageProcessorPil``) and the prompt text for one image: the image resized,
    keeping its aspect, to the most whole pool x patch blocks within ``max_soft_tokens`` x pool^2 patches (one
    Pillow resize of the uint8 RGB image, BICUBIC by default), rescaled to [0, 1] (no normalization by default),
    cut into patches row-major, each [y, x, channel]; Gemma4Processor's "<|image>", one "<|image|>" a pooled
    block, "<image|>". ``pixel_values`` is [h * w, 3 * patch^2]; grid (1, h, w) in patches."""

    kind: ClassVar[str] = "pooled_patches"  # to_dict's "kind" (image_processor_from_dict dispatches on it)
    options: ClassVar[tuple[str, ...]] = ("max_soft_tokens",)  # (vLLM's mm_processor_kwargs it reads)
    label: ClassVar[str] = "pooled patch processor"
    identity_tag: ClassVar[bytes] = b"flared.pooled-patch-processor.v1\0"

    patch_size: int
    max_soft_tokens: int
    pooling_kernel_size: int
    image_token: str = POOLED_IMAGE_TOKEN
    boi_token: str = POOLED_BOI_TOKEN
    eoi_token: str = POOLED_EOI_TOKEN

    def __post_init__(self):
        for name in ("patch_size", "pooling_kernel_size"):
            _positive_int(name, getattr(self, name))
        _soft_tokens("max_soft_tokens", self.max_soft_tokens)
        _check_pixel_settings(self)
        for name in ("image_token", "boi_token", "eoi_token"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise _field_error(name, getattr(self, name), "a non-empty string")

    @classmethod
    def from_hf(cls, preprocessor_config: dict, processor_config: dict | None) -> PooledPatchProcessor:
        """From a Hugging Face ``preprocessor_config.json`` (and ``processor_config.json``), with transformers'
        Gemma 4 defaults for missing fields (16-pixel patches, 280 soft tokens, 3 x 3 pooling, BICUBIC, rescaled
        to [0, 1] and not normalized)."""
        cfg, _ = _hf_config(preprocessor_config, processor_config)
        _check_type(cfg, POOLED_PROCESSOR_TYPES)
        return cls(patch_size=cfg.get("patch_size", 16), max_soft_tokens=cfg.get("max_soft_tokens", 280),
                   pooling_kernel_size=cfg.get("pooling_kernel_size", 3),
                   **{**_pixel_settings(cfg, BICUBIC, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)),
                      "do_normalize": cfg.get("do_normalize", False)})

    def _resized_size(self, width: int, height: int) -> tuple[int, int]:
        if self.do_resize:
            return pooled_size(height, width, self.patch_size, self.max_soft_tokens, self.pooling_kernel_size)
        unit = self.patch_size * self.pooling_kernel_size
        height, width = _whole_units(width, height, unit)
        if height * width > self.max_soft_tokens * unit * unit:
            raise _error(f"the image is {width}x{height} pixels; without resizing, this model takes at most "
                         f"{self.max_soft_tokens} blocks of {unit}x{unit} pixels")
        return height, width

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        h, w = self._resized_size(width, height)
        return 1, h // self.patch_size, w // self.patch_size

    def num_image_tokens_for(self, width: int, height: int) -> int:
        """How many image tokens ``prepare`` gives a width x height image, without resizing anything."""
        _, h, w = self.grid(width, height)
        return h * w // self.pooling_kernel_size ** 2

    def prompt(self, num_image_tokens: int) -> str:
        """The text for one image (transformers' ``Gemma4Processor.replace_image_token``)."""
        return f"{self.boi_token}{self.image_token * num_image_tokens}{self.eoi_token}"

    def patches(self, pixels: np.ndarray) -> np.ndarray:
        """[H, W, 3] uint8 -> [H / p * W / p, p * p * 3] float32: patches row-major, each [y, x, channel]."""
        p = self.patch_size
        height, width = pixels.shape[:2]
        blocks = pixels.reshape(height // p, p, width // p, p, 3).transpose(0, 2, 1, 3, 4)
        return self._normalized(np.ascontiguousarray(blocks).reshape(-1, p * p, 3), 2).reshape(-1, p * p * 3)

    def prepare(self, image: DecodedImage) -> PreparedImage:
        pixels = self._resized_pixels(image)  # [H, W, 3] uint8
        height, width = pixels.shape[:2]
        gh, gw = height // self.patch_size, width // self.patch_size
        tokens = gh * gw // self.pooling_kernel_size ** 2
        return PreparedImage(pixel_values=self.patches(pixels), rows=0, cols=0, prompt=self.prompt(tokens),
                             num_image_tokens=tokens, identity=self._identity(image), grid=(1, gh, gw))


def _canvas_grids(min_tiles: int, max_tiles: int) -> list[tuple[int, int]]:
    """Every (columns, rows) of min_tiles to max_tiles tiles, fewer tiles first (transformers' order: by count,
    then columns, then rows)."""
    grids = [(c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1)
             if min_tiles <= c * r <= max_tiles]
    return sorted(grids, key=lambda g: g[0] * g[1])


def canvas_grid(height: int, width: int, tile_height: int, tile_width: int, min_tiles: int,
                max_tiles: int) -> tuple[int, int]:
    """(columns, rows) of the tile canvas whose aspect ratio is nearest the image's (GotOcr2's
    get_optimal_tiled_canvas): on a tie, the later (larger) canvas while the image's area exceeds half of it."""
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for grid in _canvas_grids(min_tiles, max_tiles):
        diff = abs(aspect - grid[0] / grid[1])
        if diff < best_diff:
            best, best_diff = grid, diff
        elif diff == best_diff and area > 0.5 * tile_height * tile_width * grid[0] * grid[1]:
            best = grid
    return best


@dataclass(frozen=True, kw_only=True)
class CanvasProcessor(_Processor):
    """InternVL (transformers' ``GotOcr2ImageProcessorPil`` as ``InternVLProcessor`` calls it, ``crop_to_patches``
    on) and the prompt text for one image. The image is resized (one Pillow resize of the uint8 RGB image, BICUBIC by
    default) onto the canvas of ``min_patches`` to ``max_patches`` tiles whose aspect is nearest its own
    (``canvas_grid``) and cut into its tiles, row by row; more than one tile adds a thumbnail, the whole image
    resized to one tile. Each tile is rescaled and normalized; ``pixel_values`` is [tiles, 3, height, width]. The
    chat template's image token becomes ``<img>``, ``image_seq_len`` image tokens a tile, ``</img>``."""

    kind: ClassVar[str] = "canvas"  # to_dict's "kind" (image_processor_from_dict dispatches on it)
    label: ClassVar[str] = "canvas processor"
    identity_tag: ClassVar[bytes] = b"flared.canvas-processor.v1\0"

    height: int  # size.height: a tile's
    width: int  # size.width
    min_patches: int
    max_patches: int
    crop_to_patches: bool  # False: the image resized to one tile
    image_seq_len: int  # image tokens the model makes of one tile (from the vision tower)
    thumbnail: bool = True  # several tiles add the whole image as one more (InternVL's use_thumbnail)
    image_token: str = CANVAS_IMAGE_TOKEN
    start_token: str = CANVAS_START_TOKEN
    end_token: str = CANVAS_END_TOKEN

    def __post_init__(self):
        for name in ("height", "width", "min_patches", "max_patches", "image_seq_len"):
            _positive_int(name, getattr(self, name))
        if self.min_patches > self.max_patches:
            raise _field_error("min_patches", self.min_patches, f"at most max_patches ({self.max_patches})")
        if self.max_patches > MAX_CANVAS_TILES:
            raise _field_error("max_patches", self.max_patches, f"at most {MAX_CANVAS_TILES}")
        _flag("crop_to_patches", self.crop_to_patches)
        _flag("thumbnail", self.thumbnail)
        _check_pixel_settings(self)
        for name in ("image_token", "start_token", "end_token"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise _field_error(name, getattr(self, name), "a non-empty string")

    @classmethod
    def from_hf(cls, preprocessor_config: dict, processor_config: dict | None, *,
                image_seq_len: int | None) -> CanvasProcessor:
        """From a Hugging Face ``preprocessor_config.json`` (and ``processor_config.json``), with transformers'
        defaults for missing fields; ``image_seq_len``: the model's image tokens per tile (its tower's), which a
        processor config's ``image_seq_length`` must agree with. ``crop_to_patches`` is on whatever the image
        processor's file says (the released ones say false): InternVLProcessor's defaults pass it on every call."""
        cfg, proc = _hf_config(preprocessor_config, processor_config)
        _check_type(cfg, CANVAS_PROCESSOR_TYPES)
        if image_seq_len is None:
            raise _error("image processor setting 'image_seq_len' is needed for a canvas processor (InternVL)")
        declared = proc.get("image_seq_length", image_seq_len)
        if declared != image_seq_len:
            raise _error(f"processor setting 'image_seq_length' is {declared!r} but the model takes {image_seq_len} "
                         "image tokens per tile")
        height, width = _crop_size("size", cfg.get("size", {"height": 384, "width": 384}))
        return cls(height=height, width=width, min_patches=cfg.get("min_patches", 1),
                   max_patches=cfg.get("max_patches", 12), crop_to_patches=True,
                   thumbnail=cfg.get("use_thumbnail", True),
                   **_pixel_settings(cfg, BICUBIC, CLIP_MEAN, CLIP_STD), image_seq_len=image_seq_len)

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(columns, rows) of tiles ``prepare`` cuts a width x height image into ((1, 1): one tile, no thumbnail)."""
        if not self.crop_to_patches or self.max_patches <= 1:
            return 1, 1
        return canvas_grid(height, width, self.height, self.width, self.min_patches, self.max_patches)

    def num_tiles(self, width: int, height: int) -> int:
        cols, rows = self.grid(width, height)
        return cols * rows + (cols * rows > 1 and self.thumbnail)

    def num_image_tokens_for(self, width: int, height: int) -> int:
        return self.num_tiles(width, height) * self.image_seq_len

    def prompt(self, tiles: int) -> str:
        """The text for one image of ``tiles`` tiles (InternVLProcessor's replacement of its image token)."""
        return f"{self.start_token}{self.image_token * (self.image_seq_len * tiles)}{self.end_token}"

    def prepare(self, image: DecodedImage) -> PreparedImage:
        im = self._rgb(image)
        th, tw = self.height, self.width
        cols, rows = self.grid(im.width, im.height)
        if cols * rows > 1:
            canvas = np.asarray(im.resize((tw * cols, th * rows), resample=self.resample))
            tiles = [canvas[r * th:(r + 1) * th, c * tw:(c + 1) * tw] for r in range(rows) for c in range(cols)]
            if self.thumbnail:
                tiles.append(np.asarray(im.resize((tw, th), resample=self.resample)))
        else:  # (a one-tile canvas is resized whatever do_resize says, as GotOcr2's cropping resizes)
            resize = self.do_resize or (self.crop_to_patches and self.max_patches > 1)
            tiles = [np.asarray(im.resize((tw, th), resample=self.resample) if resize else im)]
        if any(x.shape != (th, tw, 3) for x in tiles):
            raise _error(f"the image is {im.width}x{im.height} pixels; without resizing, this model takes "
                         f"{tw}x{th} images")
        pixels = self._normalized(np.stack(tiles).transpose(0, 3, 1, 2), 1)  # [N, 3, th, tw]
        return PreparedImage(pixel_values=pixels, rows=rows if len(tiles) > 1 else 0,
                             cols=cols if len(tiles) > 1 else 0, prompt=self.prompt(len(tiles)),
                             num_image_tokens=len(tiles) * self.image_seq_len, identity=self._identity(image))


# ------------------------------------------------------------------------------------- LLaVA-NeXT anyres

def best_resolution(height: int, width: int, canvases) -> tuple[int, int]:
    """The canvas (height, width) LLaVA-NeXT tiles a height x width image on (transformers'
    select_best_resolution): the most of the image's pixels kept once it is scaled to fit, then the least canvas
    wasted; the first such in order."""
    best, most, least = None, 0, float("inf")
    for h, w in canvases:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - kept
        if kept > most or (kept == most and wasted < least):
            best, most, least = (h, w), kept, wasted
    return best


def unpadded_size(height: int, width: int, rows: int, cols: int) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) of the part of a rows x cols feature grid that covers a height x width image
    scaled into it and centred (the rest is the processor's padding; transformers' unpad_image)."""
    if width / height > cols / rows:
        kept = int(round(height * (cols / width), 7))
        pad = (rows - kept) // 2
        return pad, rows - pad, 0, cols
    kept = int(round(width * (rows / height), 7))
    pad = (cols - kept) // 2
    return 0, rows, pad, cols - pad


def anyres_scaled(rows: int, cols: int, side: int, anyres_max: int) -> tuple[int, int]:
    """The (rows, cols) LLaVA-OneVision scales an unpadded rows x cols feature grid to: where it holds more than
    ``anyres_max`` tiles of side x side features by a tenth (ratio of the sides over 1.1), each side's float floor
    over the ratio (transformers' sizes); else as it is (``anyres_max`` 0: LLaVA-NeXT, never)."""
    if anyres_max:
        ratio = math.sqrt(rows * cols / (anyres_max * side ** 2))
        if ratio > 1.1:
            return int(rows // ratio), int(cols // ratio)
    return rows, cols


# transformers' default canvases: LlavaNextImageProcessor's (336-pixel tiles), LlavaOnevision's (384, up to 6 x 6)
LLAVA_NEXT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
ONEVISION_PINPOINTS = tuple((384 * r, 384 * c) for r in range(1, 7) for c in range(1, 7))


def _pad_square(im: Image.Image, mean) -> Image.Image:
    """``im`` centred (offsets rounded down) on a square of its long edge filled with ``int(mean * 255)`` a channel,
    as transformers pads (LLaVA's do_pad, OneVision's images among several)."""
    if im.width == im.height:
        return im
    side = max(im.width, im.height)
    canvas = Image.new("RGB", (side, side), tuple(int(m * 255) for m in mean))
    canvas.paste(im, ((side - im.width) // 2, (side - im.height) // 2))
    return canvas


def _pinpoints(value) -> tuple[tuple[int, int], ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise _field_error("image_grid_pinpoints", value, "a list of [height, width] canvases")
    out = []
    for pair in value:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise _field_error("image_grid_pinpoints", value, "a list of [height, width] canvases")
        out.append((_positive_int("image_grid_pinpoints", pair[0]), _positive_int("image_grid_pinpoints", pair[1])))
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class AnyresProcessor(_Processor):
    """LLaVA-NeXT and LLaVA-OneVision (transformers' ``LlavaNextImageProcessorPil``,
    ``LlavaOnevisionImageProcessorPil``) and the prompt text for one image. The image is scaled (one Pillow resize
    of the uint8 RGB image, BICUBIC by default) to fit the canvas of ``grid_pinpoints`` that keeps most of it
    (``best_resolution``), centred on it over black, and cut into ``tile`` x ``tile`` tiles row by row; before
    them, the whole image squashed to one tile. Each tile is rescaled and normalized; ``pixel_values`` is
    [1 + tiles, 3, tile, tile] and the tower takes the image's (height, width) as its ``grid``. The prompt is
    ``<image>`` once per row the model makes (``num_image_tokens_for``: the whole image's ``image_seq_len``, and
    the tiles' feature grid without the padding's rows and columns, scaled down to about ``anyres_max`` tiles'
    worth where it holds more by a tenth (OneVision), plus one row-end per grid row).

    ``multi_image`` (OneVision): an image of a request with several (``prepare(..., alone=False)``) is padded
    square with the mean colour and resized to one tile instead; its rows are the tile's and one row-end."""

    kind: ClassVar[str] = "anyres"  # to_dict's "kind" (image_processor_from_dict dispatches on it)
    label: ClassVar[str] = "anyres processor"
    identity_tag: ClassVar[bytes] = b"flared.anyres-processor.v1\0"

    tile: int  # crop_size (square), or size where there is no crop: the tower's image size
    grid_pinpoints: tuple[tuple[int, int], ...]
    image_seq_len: int  # image tokens of one tile (the tower's patches a tile; a square)
    image_token: str = CLIP_IMAGE_TOKEN
    anyres_max: int = 0  # OneVision's vision_aspect_ratio anyres_max_N (0: LLaVA-NeXT, no scaling down)
    multi_image: bool = False  # OneVision: the images of a request with several take one padded tile each

    def __post_init__(self):
        _positive_int("tile", self.tile)
        object.__setattr__(self, "grid_pinpoints", _pinpoints(self.grid_pinpoints))
        if any(h % self.tile or w % self.tile or h * w > MAX_CANVAS_TILES * self.tile ** 2
               for h, w in self.grid_pinpoints):
            raise _field_error("image_grid_pinpoints", [list(p) for p in self.grid_pinpoints],
                               f"canvases of whole {self.tile}-pixel tiles, at most {MAX_CANVAS_TILES} of them")
        _positive_int("image_seq_len", self.image_seq_len)
        if isinstance(self.anyres_max, bool) or not isinstance(self.anyres_max, int) or self.anyres_max < 0:
            raise _field_error("anyres_max", self.anyres_max, "a non-negative integer")
        _flag("multi_image", self.multi_image)
        if self.multi_image and not all(0 <= int(m * 255) <= 255 for m in self.image_mean):
            raise _field_error("image_mean", list(self.image_mean), "within 0-1 to pad with it")
        if math.isqrt(self.image_seq_len) ** 2 != self.image_seq_len:
            raise _field_error("image_seq_len", self.image_seq_len, "a square (a tile's grid of patches)")
        _check_pixel_settings(self)
        if not isinstance(self.image_token, str) or not self.image_token:
            raise _field_error("image_token", self.image_token, "a non-empty string")

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["grid_pinpoints"] = [list(p) for p in self.grid_pinpoints]
        return d

    @classmethod
    def from_hf(cls, preprocessor_config: dict, processor_config: dict | None, *,
                image_seq_len: int | None) -> AnyresProcessor:
        """From a Hugging Face ``preprocessor_config.json`` (and ``processor_config.json``), with transformers'
        defaults for missing fields; ``image_seq_len``: the model's image tokens per tile. The tiles must be
        squares the whole image is resized to as well (``size`` a shortest edge or a square equal to
        ``crop_size``); the "default" feature strategy (the class row dropped) is read, or "full" over a tower
        without one (SigLIP's: ``num_additional_image_tokens`` 0)."""
        cfg, proc = _hf_config(preprocessor_config, processor_config)
        _check_type(cfg, ANYRES_PROCESSOR_TYPES)
        if image_seq_len is None:
            raise _error("image processor setting 'image_seq_len' is needed for an anyres processor (LLaVA-NeXT)")
        kind = cfg.get("image_processor_type")
        onevision = (kind.removesuffix("Fast").removesuffix("Pil") == "LlavaOnevisionImageProcessor"
                     if isinstance(kind, str) else
                     any(src.get("processor_class") == "LlavaOnevisionProcessor" for src in (cfg, proc)))
        size = cfg.get("size", {"height": 384, "width": 384} if onevision else {"shortest_edge": 224})
        if isinstance(size, dict) and "height" in size:  # (a square the tiles are resized to, or not a square)
            h, w = _crop_size("size", size)
            side = h if h == w else None
        else:
            side = _shortest_edge("size", size)
        crop = cfg.get("crop_size", None if onevision else {"height": 224, "width": 224})
        crop_h, crop_w = _crop_size("crop_size", crop) if crop is not None else (side, side)
        if side is None or (crop_h, crop_w) != (side, side):
            raise _error(f"image processor sizes size={size!r}, crop_size={crop!r}: only square tiles the image is "
                         "resized to whole are read")
        strategy = proc.get("vision_feature_select_strategy", "full" if onevision else "default")
        # ("full" over a tower without a class row, SigLIP's: Granite Vision's, num_additional_image_tokens 0)
        classless = proc.get("num_additional_image_tokens", 1) == 0
        if strategy != ("full" if onevision else "default") and not (strategy == "full" and classless):
            raise _field_error("vision_feature_select_strategy", strategy, '"full"' if onevision else '"default"')
        anyres_max = 0
        if onevision:
            aspect = proc.get("vision_aspect_ratio", "anyres_max_9")
            if not isinstance(aspect, str) or not aspect.removeprefix("anyres_max_").isdigit():
                raise _field_error("vision_aspect_ratio", aspect, '"anyres_max_N"')
            anyres_max = int(aspect.removeprefix("anyres_max_"))
        default_pinpoints = ONEVISION_PINPOINTS if onevision else LLAVA_NEXT_PINPOINTS
        return cls(tile=crop_h, grid_pinpoints=cfg.get("image_grid_pinpoints", default_pinpoints),
                   **_pixel_settings(cfg, BICUBIC, CLIP_MEAN, CLIP_STD), image_seq_len=image_seq_len,
                   image_token=proc.get("image_token", CLIP_IMAGE_TOKEN), anyres_max=anyres_max,
                   multi_image=onevision)

    def canvas(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) of the canvas a width x height image is tiled on."""
        return best_resolution(height, width, self.grid_pinpoints)

    def num_tiles(self, width: int, height: int) -> int:
        h, w = self.canvas(width, height)
        return 1 + (h // self.tile) * (w // self.tile)

    def num_image_tokens_for(self, width: int, height: int) -> int:
        """The whole image's rows, the tiles' grid without the padding, and a row end a grid row (transformers'
        LlavaNextProcessor._get_number_of_features)."""
        side = math.isqrt(self.image_seq_len)
        h, w = self.canvas(width, height)
        top, bottom, left, right = unpadded_size(height, width, h // self.tile * side, w // self.tile * side)
        rows, cols = anyres_scaled(bottom - top, right - left, side, self.anyres_max)  # (OneVision's scaling)
        return self.image_seq_len + rows * cols + rows

    def _identity(self, image: DecodedImage, alone: bool = True) -> bytes:
        return super()._identity(image) if alone or not self.multi_image else hashlib.sha256(
            b"one tile\0" + super()._identity(image)).digest()

    def prepare_in_request(self, image: DecodedImage, *, images: int) -> PreparedImage:
        return self.prepare(image, alone=images == 1)

    def prepare(self, image: DecodedImage, *, alone: bool = True) -> PreparedImage:
        """``alone``: the request has no other image (a OneVision image among several takes one padded tile)."""
        im = self._rgb(image)
        t = self.tile
        if self.multi_image and not alone:
            square = _pad_square(im, self.image_mean).resize((t, t), resample=self.resample)
            pixels = self._normalized(np.asarray(square)[None].transpose(0, 3, 1, 2), 1)
            return PreparedImage(pixel_values=pixels, rows=0, cols=0, prompt=self.image_token * (
                self.image_seq_len + 1), num_image_tokens=self.image_seq_len + 1,
                identity=self._identity(image, alone=False), grid=(im.height, im.width))
        ch, cw = self.canvas(im.width, im.height)
        if cw / im.width < ch / im.height:  # (transformers' get_patch_output_size)
            nw, nh = cw, min(math.ceil(im.height * cw / im.width), ch)
        else:
            nh, nw = ch, min(math.ceil(im.width * ch / im.height), cw)
        canvas = np.zeros((ch, cw, 3), dtype=np.uint8)
        y, x = (ch - nh) // 2, (cw - nw) // 2
        canvas[y:y + nh, x:x + nw] = np.asarray(im.resize((nw, nh), resample=self.resample))
        tiles = [np.asarray(im.resize((t, t), resample=self.resample))]
        tiles += [canvas[r:r + t, c:c + t] for r in range(0, ch, t) for c in range(0, cw, t)]
        pixels = self._normalized(np.stack(tiles).transpose(0, 3, 1, 2), 1)  # [1 + N, 3, t, t]
        count = self.num_image_tokens_for(im.width, im.height)
        return PreparedImage(pixel_values=pixels, rows=ch // t, cols=cw // t, prompt=self.image_token * count,
                             num_image_tokens=count, identity=self._identity(image), grid=(im.height, im.width))


# -------------------------------------------------------------------------------------------- dispatch

def _family(cfg: dict, processor_config: dict) -> str:
    kind = cfg.get("image_processor_type")
    if kind is not None:
        base = kind.removesuffix("Fast").removesuffix("Pil") if isinstance(kind, str) else kind
        if base in PROCESSOR_TYPES:
            return TileProcessor.kind
        if base in PATCH_PROCESSOR_TYPES:
            return PatchProcessor.kind
        if base in PIXTRAL_PROCESSOR_TYPES:
            return PixtralProcessor.kind
        if base in CROP_PROCESSOR_TYPES:
            return CropProcessor.kind
        if base in SQUARE_PROCESSOR_TYPES:
            return SquareProcessor.kind
        if base in CANVAS_PROCESSOR_TYPES:
            return CanvasProcessor.kind
        if base in ANYRES_PROCESSOR_TYPES:
            return AnyresProcessor.kind
        if base in POOLED_PROCESSOR_TYPES:
            return PooledPatchProcessor.kind
        if base in _LLAMA4_PROCESSOR_TYPES:
            return "llama4_tiles"
        raise _field_error("image_processor_type", kind, " or ".join(
            PROCESSOR_TYPES + PATCH_PROCESSOR_TYPES + PIXTRAL_PROCESSOR_TYPES + CROP_PROCESSOR_TYPES
            + SQUARE_PROCESSOR_TYPES + CANVAS_PROCESSOR_TYPES + ANYRES_PROCESSOR_TYPES + POOLED_PROCESSOR_TYPES
            + _LLAMA4_PROCESSOR_TYPES))
    for source in (cfg, processor_config):
        cls_name = source.get("processor_class")
        if cls_name in _PATCH_PROCESSOR_CLASSES:
            return PatchProcessor.kind
        if cls_name in _PIXTRAL_PROCESSOR_CLASSES:
            return PixtralProcessor.kind
        if cls_name in _CROP_PROCESSOR_CLASSES:
            return CropProcessor.kind
        if cls_name in _SQUARE_PROCESSOR_CLASSES:
            return SquareProcessor.kind
        if cls_name in _CANVAS_PROCESSOR_CLASSES:
            return CanvasProcessor.kind
        if cls_name in _ANYRES_PROCESSOR_CLASSES:
            return AnyresProcessor.kind
        if cls_name in _POOLED_PROCESSOR_CLASSES:
            return PooledPatchProcessor.kind
        if cls_name == "Llama4Processor":
            return "llama4_tiles"
        if cls_name in _TILE_PROCESSOR_CLASSES:
            return TileProcessor.kind
    return TileProcessor.kind  # what flared read before it knew patch processors


ImageProcessor = (TileProcessor | PatchProcessor | PixtralProcessor | CropProcessor | SquareProcessor | CanvasProcessor
                  | AnyresProcessor | PooledPatchProcessor)


def image_processor_from_hf(preprocessor_config: dict, processor_config: dict | None, *,
                            image_seq_len: int | None) -> ImageProcessor:
    """The image processor a checkpoint's ``preprocessor_config.json`` (and ``processor_config.json``) describe,
    chosen by ``image_processor_type`` (else ``processor_class``; neither: tiles). A tile processor needs the
    model's ``image_seq_len`` (image tokens per tile), a crop processor too (image tokens per image); patch and
    Pixtral processors ignore it."""
    cfg, proc = _hf_config(preprocessor_config, processor_config)
    family = _family(cfg, proc)
    if family == PatchProcessor.kind:
        return PatchProcessor.from_hf(preprocessor_config, processor_config)
    if family == PixtralProcessor.kind:
        return PixtralProcessor.from_hf(preprocessor_config, processor_config)
    if family == CropProcessor.kind:
        return CropProcessor.from_hf(preprocessor_config, processor_config, image_seq_len=image_seq_len)
    if family == SquareProcessor.kind:
        return SquareProcessor.from_hf(preprocessor_config, processor_config, image_seq_len=image_seq_len)
    if family == CanvasProcessor.kind:
        return CanvasProcessor.from_hf(preprocessor_config, processor_config, image_seq_len=image_seq_len)
    if family == AnyresProcessor.kind:
        return AnyresProcessor.from_hf(preprocessor_config, processor_config, image_seq_len=image_seq_len)
    if family == PooledPatchProcessor.kind:
        return PooledPatchProcessor.from_hf(preprocessor_config, processor_config)
    if family == "llama4_tiles":  # (flared.frontend.llama4)
        from flared.frontend.llama4 import Llama4TileProcessor

        return Llama4TileProcessor.from_hf(preprocessor_config, processor_config)
    if image_seq_len is None:
        raise _error("image processor setting 'image_seq_len' is needed for a tile processor (SmolVLM / Idefics3)")
    return TileProcessor.from_hf(preprocessor_config, processor_config, image_seq_len=image_seq_len)


def image_processor_from_dict(d: dict) -> ImageProcessor:
    """The processor a ``to_dict`` wrote, by its "kind" ("tiles" where absent: written before patch processors); an
    audio model's (flared.frontend.audio.WhisperProcessor, kind "whisper") too."""
    if not isinstance(d, dict):
        raise _error(f"an image processor must be a JSON object, got {type(d).__name__}")
    kind = d.get("kind", TileProcessor.kind)
    if kind in ("whisper", "usm", "qwen3_asr"):
        from flared.frontend.audio import Qwen3AsrProcessor, UsmProcessor, WhisperProcessor

        return {"whisper": WhisperProcessor, "usm": UsmProcessor, "qwen3_asr": Qwen3AsrProcessor}[kind].from_dict(d)
    if kind == "llama4_tiles":
        from flared.frontend.llama4 import Llama4TileProcessor

        return Llama4TileProcessor.from_dict(d)
    classes = (TileProcessor, PatchProcessor, PixtralProcessor, CropProcessor, SquareProcessor, CanvasProcessor,
               AnyresProcessor, PooledPatchProcessor)
    for cls in classes:
        if kind == cls.kind:
            return cls.from_dict(d)
    raise _error(f"unknown image processor kind {kind!r}; expected " + " or ".join(repr(c.kind) for c in classes))
