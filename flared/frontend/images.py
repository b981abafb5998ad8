"""Images for vision-language models: decoding what a client sends, and SmolVLM / Idefics3 preprocessing.

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

import numpy as np
from PIL import Image, ImageOps

from flared.errors import ErrorKind, FrontendError

DEFAULT_MAX_IMAGE_BYTES = 20 << 20  # encoded bytes after base64 decoding
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192  # width*height, checked before pixel data is decoded

# transformers' SmolVLM / Idefics3 constants and class defaults (identical for the two).
MAX_IMAGE_SIZE = 4096  # no edge grows past this after the first resize
HF_DEFAULT_LONGEST_EDGE = 4 * 364
HF_DEFAULT_TILE = 364
HF_DEFAULT_IMAGE_SEQ_LEN = 169
HF_DEFAULT_MEAN = (0.5, 0.5, 0.5)  # IMAGENET_STANDARD_MEAN
HF_DEFAULT_STD = (0.5, 0.5, 0.5)  # IMAGENET_STANDARD_STD
LANCZOS = 1  # PIL.Image.Resampling.LANCZOS
RESAMPLE_NAMES = {0: "NEAREST", 1: "LANCZOS", 2: "BILINEAR", 3: "BICUBIC", 4: "BOX", 5: "HAMMING"}
PROCESSOR_TYPES = ("Idefics3ImageProcessor", "SmolVLMImageProcessor")  # with or without a Fast / Pil suffix

FORMATS = ("PNG", "JPEG", "WEBP")
_MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP"}
_SUPPORTED = "send a PNG, JPEG or WebP image"
_REMOTE = "remote image URLs are not fetched; send the image as a base64 data URL"
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
    data = _source_bytes(source, max_bytes)
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


def _source_bytes(source, max_bytes: int) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if not isinstance(source, str):
        raise _error(f"an image must be a base64 string or a data URL, got {type(source).__name__}")
    text = source.strip()
    m = _URL_SCHEME.match(text[:64])
    if m is None:
        return _b64decode(text, max_bytes, "image data")
    scheme = m.group(1).lower()
    if scheme != "data":
        if scheme in ("http", "https", "file", "ftp") or text[m.end():].startswith("//"):
            raise _error(_REMOTE, ErrorKind.UNSUPPORTED)
        raise _error(f"unrecognized image reference (a {scheme!r} URL); send the image as a base64 data URL")
    header, comma, payload = text[m.end():].partition(",")
    if not comma:
        raise _error("malformed image data URL: no ',' before the data")
    params = [p.strip().lower() for p in header.split(";")]
    media = params[0]
    if "base64" not in params[1:]:
        raise _error("image data URLs must be base64-encoded ('data:image/png;base64,...')")
    if not media:
        raise _error(f"image data URL has no media type; {_SUPPORTED} ('data:image/png;base64,...')")
    if media not in _MEDIA_TYPES:
        raise _error(f"unsupported image type {media!r}; {_SUPPORTED}")
    return _b64decode(payload, max_bytes, "the image data URL")


def _b64decode(text: str, max_bytes: int, what: str) -> bytes:
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
        raise _error(f"image is too large: about {_mib(len(raw) // 4 * 3)} after base64 decoding; "
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
    pixel_values: np.ndarray  # float32 [num_tiles, 3, tile, tile], C-contiguous
    rows: int  # tile rows (0 when the image was not split)
    cols: int
    prompt: str  # the text that replaces one image placeholder in the rendered prompt
    num_image_tokens: int  # how many image tokens ``prompt`` holds (num_tiles * image_seq_len)
    identity: bytes  # 32-byte sha256 over the DecodedImage digest + the processor settings


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


def _edge(field: str, value) -> int:
    if isinstance(value, dict) and "longest_edge" in value:
        return _positive_int(f"{field}.longest_edge", value["longest_edge"])
    raise _field_error(field, value, 'an object with "longest_edge"')


@dataclass(frozen=True)
class TileProcessor:
    """SmolVLM / Idefics3 preprocessing (transformers' ``SmolVLMImageProcessorPil`` /
    ``Idefics3ImageProcessorPil``, which are the same) and the prompt text for one image."""

    longest_edge: int  # preprocessor_config "size": {"longest_edge": N}
    tile: int  # "max_image_size": {"longest_edge": N}
    split: bool  # "do_image_splitting"
    resample: int  # PIL resample filter id ("resample"; LANCZOS = 1)
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float
    image_seq_len: int  # image tokens per tile (processor_config.json "image_seq_len")
    image_token: str = "<image>"
    fake_token: str = "<fake_token_around_image>"
    global_token: str = "<global-img>"
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    def __post_init__(self):
        _positive_int("size.longest_edge", self.longest_edge)
        _positive_int("max_image_size.longest_edge", self.tile)
        if self.tile > MAX_IMAGE_SIZE:
            raise _field_error("max_image_size.longest_edge", self.tile, f"at most {MAX_IMAGE_SIZE}")
        _flag("do_image_splitting", self.split)
        if type(self.resample) is not int or self.resample not in RESAMPLE_NAMES:
            raise _field_error("resample", self.resample, "a PIL resampling filter id 0-5")
        object.__setattr__(self, "image_mean", _triple("image_mean", self.image_mean))
        std = _triple("image_std", self.image_std)
        if 0.0 in std:
            raise _field_error("image_std", self.image_std, "non-zero")
        object.__setattr__(self, "image_std", std)
        factor = _finite("rescale_factor", self.rescale_factor)
        if factor <= 0:
            raise _field_error("rescale_factor", self.rescale_factor, "positive")
        object.__setattr__(self, "rescale_factor", factor)
        _positive_int("image_seq_len", self.image_seq_len)
        for name in ("image_token", "fake_token", "global_token"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise _field_error(name, getattr(self, name), "a non-empty string")
        for name in ("do_resize", "do_rescale", "do_normalize"):
            _flag(name, getattr(self, name))

    # -- configuration ------------------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, preprocessor_config: dict, processor_config: dict | None, *,
                image_seq_len: int) -> TileProcessor:
        """From a Hugging Face ``preprocessor_config.json`` (and ``processor_config.json``), with transformers'
        defaults for missing fields. ``image_seq_len`` is the model's image tokens per tile; a
        ``processor_config`` that says otherwise is an error (the model would reject the prompt).
        ``do_convert_rgb`` is not read (a ``DecodedImage`` is RGB already; transformers with it off only works on
        RGB input anyway) and neither is ``do_pad`` (it only pads a batch to its largest image's tile count)."""
        processor_config = processor_config or {}
        nested = processor_config.get("image_processor")
        if not preprocessor_config and isinstance(nested, dict):
            preprocessor_config = nested  # newer transformers save everything in processor_config.json
        cfg = preprocessor_config or {}
        if not isinstance(cfg, dict):
            raise _error(f"the image processor config must be a JSON object, got {type(cfg).__name__}")
        kind = cfg.get("image_processor_type")
        if kind is not None:
            base = kind.removesuffix("Fast").removesuffix("Pil") if isinstance(kind, str) else kind
            if base not in PROCESSOR_TYPES:
                raise _field_error("image_processor_type", kind, " or ".join(PROCESSOR_TYPES))
        seq = processor_config.get("image_seq_len", image_seq_len)
        if seq != image_seq_len:
            raise _error(f"processor setting 'image_seq_len' is {seq!r} but the model takes {image_seq_len} "
                         "image tokens per tile")
        return cls(
            longest_edge=_edge("size", cfg.get("size", {"longest_edge": HF_DEFAULT_LONGEST_EDGE})),
            tile=_edge("max_image_size", cfg.get("max_image_size", {"longest_edge": HF_DEFAULT_TILE})),
            split=cfg.get("do_image_splitting", True),
            resample=cfg.get("resample", LANCZOS),
            image_mean=cfg.get("image_mean", HF_DEFAULT_MEAN),
            image_std=cfg.get("image_std", HF_DEFAULT_STD),
            rescale_factor=cfg.get("rescale_factor", 1 / 255),
            image_seq_len=image_seq_len,
            do_resize=cfg.get("do_resize", True),
            do_rescale=cfg.get("do_rescale", True),
            do_normalize=cfg.get("do_normalize", True),
        )

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["image_mean"], d["image_std"] = list(self.image_mean), list(self.image_std)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TileProcessor:
        if not isinstance(d, dict):
            raise _error(f"a tile processor must be a JSON object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise _error(f"unknown tile processor settings: {', '.join(unknown)}")
        try:
            return cls(**d)
        except TypeError as e:  # a required setting is missing
            raise _error(f"incomplete tile processor settings: {e}") from None

    def _settings_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

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

    def _lut(self) -> np.ndarray:
        """[3, 256] float32: what rescale then normalize make of each uint8 value in each channel, computed
        with transformers' operations and dtypes (float64 rescale cast to float32, float32 normalize)."""
        x = np.arange(256, dtype=np.uint8)
        x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32) if self.do_rescale \
            else x.astype(np.float32)
        if not self.do_normalize:
            return np.stack([x, x, x])
        mean = np.asarray(self.image_mean, dtype=np.float32)
        std = np.asarray(self.image_std, dtype=np.float32)
        return ((x[None, :] - mean[:, None]) / std[:, None]).astype(np.float32)

    def prepare(self, image: DecodedImage) -> PreparedImage:
        im = image.image
        if im.mode != "RGB":
            raise _error(f"internal: a decoded image must be RGB, got {im.mode}", ErrorKind.EXECUTION)
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
        chw = np.stack(tiles).transpose(0, 3, 1, 2)  # [N, 3, t, t] uint8
        lut = self._lut()
        out = np.empty(chw.shape, dtype=np.float32)
        for c in range(3):
            out[:, c] = lut[c][chw[:, c]]
        identity = hashlib.sha256(b"flared.tile-processor.v1\0" + image.digest + self._settings_bytes()).digest()
        return PreparedImage(
            pixel_values=out,
            rows=rows,
            cols=cols,
            prompt=self.prompt(rows, cols),
            num_image_tokens=len(tiles) * self.image_seq_len,
            identity=identity,
        )
