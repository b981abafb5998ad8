"""Image decoding and SmolVLM / Idefics3 preprocessing (flared.frontend.images).

Parity: the same PIL image goes to transformers' PIL image processors and to ``TileProcessor.prepare`` (through
``DecodedImage.from_pil``, which does no EXIF work, like transformers), and pixel_values must be bit-identical.
"""

from __future__ import annotations

import base64
import functools
import io
import json
import struct
import warnings
import zlib

import numpy as np
import pytest
from flared_testing.vision import encode as _encode
from flared_testing.vision import gradient as _smooth
from flared_testing.vision import mode_images, noise_rgb, reopen
from PIL import Image

from flared.errors import ErrorKind, FrontendError
from flared.frontend.images import (
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DecodedImage,
    PreparedImage,
    TileProcessor,
    decode_image,
)

# ----------------------------------------------------------------------------------------------- helpers

RNG_SEED = 1234


_rgb = functools.partial(noise_rgb, seed=RNG_SEED)


def _data_url(data: bytes, media: str) -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height, with a tiny (truncated) pixel stream."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 64)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat)
            + _png_chunk(b"IEND", b""))


def _rejects(source, *fragments: str, kind: ErrorKind = ErrorKind.VALIDATION, **kw) -> str:
    with pytest.raises(FrontendError) as info:
        decode_image(source, **kw)
    err = info.value
    assert err.kind is kind, (err.kind, str(err))
    msg = str(err)
    for fragment in fragments:
        assert fragment.lower() in msg.lower(), msg
    return msg


SMALL_A = {  # SmolVLM-like, small: longest edge 128, tiles of 64, non-default mean/std and filter id as JSON
    "image_processor_type": "SmolVLMImageProcessor",
    "size": {"longest_edge": 128},
    "max_image_size": {"longest_edge": 64},
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "resample": 1,
    "rescale_factor": 0.00392156862745098,
}
SMALL_B = {"size": {"longest_edge": 96}, "max_image_size": {"longest_edge": 32}}  # everything else default
SMALL_C = {  # longest edge not a multiple of the tile, another filter
    "image_processor_type": "Idefics3ImageProcessor",
    "size": {"longest_edge": 100},
    "max_image_size": {"longest_edge": 32},
    "resample": 3,
}
# HuggingFaceTB/SmolVLM-256M-Instruct preprocessor_config.json (the fields that matter)
SMOLVLM_REAL = {
    "do_convert_rgb": True,
    "do_image_splitting": True,
    "do_normalize": True,
    "do_pad": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "Idefics3ImageProcessor",
    "image_std": [0.5, 0.5, 0.5],
    "max_image_size": {"longest_edge": 512},
    "processor_class": "Idefics3Processor",
    "resample": 1,
    "rescale_factor": 0.00392156862745098,
    "size": {"longest_edge": 2048},
}

GEOMETRIES = [
    (1, 1), (2, 1), (17, 5), (5, 17),  # tiny
    (48, 80), (80, 48), (50, 50),  # portrait, landscape, square
    (64, 64), (32, 32), (128, 128),  # exactly a tile / exactly longest_edge
    (300, 200), (129, 65),  # larger than longest_edge, just over
    (1000, 3), (3, 1000), (257, 9),  # extreme aspect ratios
]


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers")
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    return {"smolvlm": SmolVLMImageProcessorPil, "idefics3": Idefics3ImageProcessorPil}


def _hf_kwargs(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k not in ("image_processor_type", "processor_class")}


def _check_parity(cls, cfg: dict, pil: Image.Image, seq_len: int = 3) -> PreparedImage:
    ref = cls(**_hf_kwargs(cfg))(pil, return_row_col_info=True)
    want = np.asarray(ref["pixel_values"])[0]  # [num_tiles, 3, tile, tile]
    tp = TileProcessor.from_hf(cfg, {"image_seq_len": seq_len}, image_seq_len=seq_len)
    got = tp.prepare(DecodedImage.from_pil(pil))
    assert got.pixel_values.dtype == np.float32 and got.pixel_values.flags.c_contiguous
    assert got.pixel_values.shape == want.shape, (pil.size, got.pixel_values.shape, want.shape)
    np.testing.assert_array_equal(got.pixel_values, want)
    assert (got.rows, got.cols) == (ref["rows"][0][0], ref["cols"][0][0])
    assert tp.num_tiles(*pil.size) == want.shape[0]
    assert got.num_image_tokens == want.shape[0] * seq_len == got.prompt.count(tp.image_token)
    assert got.grid is None  # patch processors only
    return got


# -------------------------------------------------------------------------------------- preprocessing parity

@pytest.mark.parametrize("split", [True, False], ids=["split", "nosplit"])
@pytest.mark.parametrize("cfg", [SMALL_A, SMALL_B, SMALL_C], ids=["le128t64", "le96t32", "le100t32"])
def test_geometries_match_transformers(hf, cfg, split):
    cfg = dict(cfg, do_image_splitting=split)
    for w, h in GEOMETRIES:
        _check_parity(hf["smolvlm"], cfg, _rgb(w, h))


def _mode_images() -> dict[str, Image.Image]:
    """flared_testing's modes, and 16-bit grey and CMYK (a JPEG) beside them."""
    rng = np.random.default_rng(7)
    u16 = Image.fromarray((np.arange(45 * 29, dtype=np.uint16).reshape(29, 45) * 40).astype(np.uint16))
    cmyk = reopen(Image.fromarray(rng.integers(0, 256, (29, 45, 4), dtype=np.uint8), mode="CMYK"), "JPEG")
    return {**mode_images(45, 29, seed=7, border=5), "I;16": reopen(u16, "PNG"), "CMYK-JPEG": cmyk}


def test_modes_match_transformers(hf):
    images = _mode_images()
    assert images["P+transparency"].mode == "P" and "transparency" in images["P+transparency"].info
    assert images["RGB+tRNS"].info.get("transparency") is not None
    assert images["I;16"].mode == "I;16" and images["CMYK-JPEG"].mode == "CMYK"
    for name, im in images.items():
        for cfg in (dict(SMALL_A, do_image_splitting=True), dict(SMALL_B, do_image_splitting=False)):
            _check_parity(hf["smolvlm"], cfg, im)


def test_transparency_composited_onto_white():
    im = Image.new("RGBA", (4, 2), (10, 20, 30, 255))
    im.putpixel((0, 0), (10, 20, 30, 0))
    im.putpixel((1, 0), (0, 0, 0, 128))
    px = np.asarray(DecodedImage.from_pil(im).image)
    assert tuple(px[0, 0]) == (255, 255, 255)
    assert tuple(px[1, 1]) == (10, 20, 30)
    assert all(120 <= v <= 135 for v in px[0, 1])  # half-transparent black over white: mid grey


def test_idefics3_processor_is_the_same(hf):
    for split in (True, False):
        cfg = dict(SMALL_C, do_image_splitting=split)
        for w, h in [(17, 5), (300, 200), (3, 100), (32, 32)]:
            _check_parity(hf["idefics3"], cfg, _rgb(w, h))


def test_real_smolvlm_settings_on_a_small_image(hf):
    got = _check_parity(hf["idefics3"], SMOLVLM_REAL, _rgb(40, 30), seq_len=64)
    assert got.pixel_values.shape == (13, 3, 512, 512) and (got.rows, got.cols) == (3, 4)
    tp = TileProcessor.from_hf(SMOLVLM_REAL, {"image_seq_len": 64, "processor_class": "Idefics3Processor"},
                               image_seq_len=64)
    assert tp.num_tiles(4000, 3000) == 13 and tp.num_tiles(1, 1) == 17 and tp.num_tiles(2048, 512) == 5


def test_flags_off_match_transformers(hf):
    im = _rgb(70, 40)
    for flags in ({"do_resize": False}, {"do_rescale": False}, {"do_normalize": False},
                  {"do_rescale": False, "do_normalize": False}):
        for split in (True, False):
            _check_parity(hf["smolvlm"], dict(SMALL_A, do_image_splitting=split, **flags), im)


def test_transformers_ignores_exif_on_pil_input(hf):
    """Documents why decode_image transposes: transformers' processors take a PIL image as stored."""
    stored = _smooth(40, 24)
    exif = Image.Exif()
    exif[0x0112] = 6
    tagged = Image.open(io.BytesIO(_encode(stored, "PNG", exif=exif)))
    plain = Image.open(io.BytesIO(_encode(stored, "PNG")))
    proc = hf["smolvlm"](**_hf_kwargs(SMALL_B))
    np.testing.assert_array_equal(np.asarray(proc(tagged)["pixel_values"]), np.asarray(proc(plain)["pixel_values"]))
    upright = decode_image(_encode(stored, "PNG", exif=exif))
    assert upright.image.size == (24, 40)


def test_num_tiles_agrees_with_prepare():
    tps = [TileProcessor.from_hf(dict(c, do_image_splitting=s), None, image_seq_len=1)
           for c in (SMALL_A, SMALL_B, SMALL_C) for s in (True, False)]
    for w, h in GEOMETRIES + [(15, 12), (15, 56), (22, 23), (99, 100), (7, 300)]:
        d = DecodedImage.from_pil(_rgb(w, h))
        for tp in tps:
            p = tp.prepare(d)
            assert tp.num_tiles(w, h) == p.pixel_values.shape[0], (tp, w, h)
            assert p.pixel_values.shape[0] == (p.rows * p.cols + 1 if p.rows else 1)


# -------------------------------------------------------------------------------------------------- prompts

def test_prompt_matches_transformers():
    pytest.importorskip("transformers")
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    class Stub:  # the attributes Idefics3Processor.replace_image_token reads
        fake_image_token = "<fake_token_around_image>"
        image_token = "<image>"
        global_image_tag = "<global-img>"

    tp = TileProcessor.from_hf(SMALL_A, None, image_seq_len=5)
    Stub.image_seq_len = tp.image_seq_len
    for rows, cols in [(0, 0), (1, 2), (2, 1), (3, 4), (4, 4)]:
        want = get_image_prompt_string(rows, cols, 5, fake_token_around_image="<fake_token_around_image>",
                                       image_token="<image>", global_image_token="<global-img>")
        assert tp.prompt(rows, cols) == want
        assert Idefics3Processor.replace_image_token(Stub(), {"rows": [[rows]], "cols": [[cols]]}, 0) == want
    custom = TileProcessor.from_dict(dict(tp.to_dict(), image_token="<im>", fake_token="<f>", global_token="<g>"))
    assert custom.prompt(1, 1) == get_image_prompt_string(1, 1, 5, "<f>", "<im>", "<g>")


def test_prepared_prompt_shape():
    tp = TileProcessor.from_hf(SMALL_B, None, image_seq_len=2)
    p = tp.prepare(DecodedImage.from_pil(_rgb(96, 40)))
    assert (p.rows, p.cols) == (2, 3)
    assert p.prompt.startswith("<fake_token_around_image><row_1_col_1><image><image><fake_token_around_image>")
    assert "<row_2_col_3><image><image>\n\n<fake_token_around_image><global-img><image><image>" in p.prompt
    assert p.prompt.endswith("<fake_token_around_image>") and p.num_image_tokens == 7 * 2
    single = TileProcessor.from_hf(dict(SMALL_B, do_image_splitting=False), None, image_seq_len=2)
    q = single.prepare(DecodedImage.from_pil(_rgb(96, 40)))
    assert q.prompt == "<fake_token_around_image><global-img><image><image><fake_token_around_image>"
    assert (q.rows, q.cols, q.num_image_tokens) == (0, 0, 2)


# ------------------------------------------------------------------------------------------ configuration

def test_from_hf_defaults_are_transformers_defaults(hf):
    for cls in hf.values():
        ref = cls()
        tp = TileProcessor.from_hf({}, None, image_seq_len=169)
        assert tp.longest_edge == ref.size.longest_edge == 1456
        assert tp.tile == ref.max_image_size["longest_edge"] == 364
        assert tp.split is ref.do_image_splitting is True
        assert tp.resample == int(ref.resample) == Image.Resampling.LANCZOS
        assert tp.image_mean == tuple(ref.image_mean) and tp.image_std == tuple(ref.image_std)
        assert tp.rescale_factor == ref.rescale_factor
        assert (tp.do_resize, tp.do_rescale, tp.do_normalize) == (ref.do_resize, ref.do_rescale, ref.do_normalize)


def test_from_hf_reads_nested_processor_config():
    tp = TileProcessor.from_hf({}, {"image_seq_len": 64, "image_processor": SMOLVLM_REAL}, image_seq_len=64)
    assert (tp.longest_edge, tp.tile, tp.image_seq_len) == (2048, 512, 64)


@pytest.mark.parametrize("patch, field", [
    ({"size": {"longest_edge": 0}}, "size.longest_edge"),
    ({"size": {"height": 10, "width": 10}}, "size"),
    ({"size": 512}, "size"),
    ({"max_image_size": {}}, "max_image_size"),
    ({"max_image_size": {"longest_edge": 10**6}}, "max_image_size.longest_edge"),
    ({"max_image_size": {"longest_edge": "512"}}, "max_image_size.longest_edge"),
    ({"image_std": [0.5, 0.0, 0.5]}, "image_std"),
    ({"image_mean": [0.5, 0.5]}, "image_mean"),
    ({"image_mean": [0.5, float("nan"), 0.5]}, "image_mean"),
    ({"resample": 9}, "resample"),
    ({"resample": 1.0}, "resample"),
    ({"do_image_splitting": "yes"}, "do_image_splitting"),
    ({"do_normalize": 1}, "do_normalize"),
    ({"rescale_factor": -1}, "rescale_factor"),
    ({"image_processor_type": "CLIPImageProcessor"}, "image_processor_type"),
])
def test_from_hf_rejects_nonsense(patch, field):
    with pytest.raises(FrontendError) as info:
        TileProcessor.from_hf(dict(SMALL_A, **patch), None, image_seq_len=4)
    assert info.value.kind is ErrorKind.VALIDATION
    assert repr(field) in str(info.value), str(info.value)


def test_from_hf_image_seq_len_mismatch():
    with pytest.raises(FrontendError, match="image_seq_len") as info:
        TileProcessor.from_hf(SMALL_A, {"image_seq_len": 81}, image_seq_len=64)
    assert info.value.kind is ErrorKind.VALIDATION
    assert TileProcessor.from_hf(SMALL_A, {"image_seq_len": 64}, image_seq_len=64).image_seq_len == 64
    assert TileProcessor.from_hf(SMALL_A, {}, image_seq_len=81).image_seq_len == 81


def test_scalar_mean_std_like_transformers():
    tp = TileProcessor.from_hf(dict(SMALL_B, image_mean=0.5, image_std=0.25), None, image_seq_len=1)
    assert tp.image_mean == (0.5, 0.5, 0.5) and tp.image_std == (0.25, 0.25, 0.25)


def test_to_dict_round_trip_and_identity():
    tp = TileProcessor.from_hf(SMOLVLM_REAL, {"image_seq_len": 64}, image_seq_len=64)
    d = json.loads(json.dumps(tp.to_dict()))
    assert TileProcessor.from_dict(d) == tp and d["kind"] == TileProcessor.kind == "tiles"
    assert TileProcessor.from_dict({k: v for k, v in d.items() if k != "kind"}) == tp  # written before "kind"
    with pytest.raises(FrontendError, match="kind"):
        TileProcessor.from_dict(dict(d, kind="patches"))
    with pytest.raises(FrontendError, match="bogus"):
        TileProcessor.from_dict(dict(d, bogus=1))
    with pytest.raises(FrontendError, match="incomplete"):
        TileProcessor.from_dict({k: v for k, v in d.items() if k != "tile"})

    small = TileProcessor.from_hf(SMALL_B, None, image_seq_len=1)
    a, b = DecodedImage.from_pil(_rgb(20, 10)), DecodedImage.from_pil(_rgb(20, 10, seed=9))
    assert a.digest == DecodedImage.from_pil(_rgb(20, 10)).digest and len(a.digest) == 32
    assert a.digest != b.digest
    ids = {small.prepare(a).identity, small.prepare(b).identity,
           TileProcessor.from_dict(dict(small.to_dict(), resample=2)).prepare(a).identity}
    assert len(ids) == 3 and all(len(i) == 32 for i in ids)
    assert small.prepare(a).identity == TileProcessor.from_dict(small.to_dict()).prepare(a).identity
    # the identity is what it was before to_dict had a "kind" (caches keyed on it stay valid)
    assert small.prepare(a).identity.hex()[:16] == "d7e2ecb76ee92713"


# ------------------------------------------------------------------------------------------------ decoding

def test_decode_png_jpeg_webp_data_urls():
    src = _smooth(37, 21)
    png = decode_image(_data_url(_encode(src, "PNG"), "image/png"))
    assert png.image.mode == "RGB" and png.image.size == (37, 21)
    np.testing.assert_array_equal(np.asarray(png.image), np.asarray(src))
    webp = decode_image(_data_url(_encode(src, "WEBP", lossless=True), "image/webp"))
    np.testing.assert_array_equal(np.asarray(webp.image), np.asarray(src))
    assert webp.digest == png.digest
    lossy = decode_image(_data_url(_encode(src, "WEBP", quality=90), "image/webp"))
    assert lossy.image.size == (37, 21)
    jpeg_bytes = _encode(src, "JPEG", quality=95)
    for media in ("image/jpeg", "image/jpg", "IMAGE/JPEG"):
        jpeg = decode_image(_data_url(jpeg_bytes, media))
        np.testing.assert_array_equal(np.asarray(jpeg.image), np.asarray(Image.open(io.BytesIO(jpeg_bytes))))


def test_decode_bare_base64_and_bytes():
    src = _smooth(16, 9)
    data = _encode(src, "PNG")
    want = np.asarray(src)
    b64 = base64.b64encode(data).decode()
    for source in (b64, data, bytearray(data), "  " + "\n".join(b64[i:i + 76] for i in range(0, len(b64), 76)),
                   b64.rstrip("="), base64.urlsafe_b64encode(data).decode(),
                   "data:image/png;name=x.png;base64," + b64):
        np.testing.assert_array_equal(np.asarray(decode_image(source).image), want)


def test_declared_type_may_differ_between_supported_formats():
    data = _encode(_smooth(8, 8), "PNG")
    assert decode_image(_data_url(data, "image/jpeg")).image.size == (8, 8)


def _quadrants(width: int = 40, height: int = 24) -> Image.Image:
    im = Image.new("RGB", (width, height), (255, 0, 0))  # top-left red
    im.paste((0, 255, 0), (width // 2, 0, width, height // 2))  # top-right green
    im.paste((0, 0, 255), (0, height // 2, width // 2, height))  # bottom-left blue
    im.paste((255, 255, 255), (width // 2, height // 2, width, height))  # bottom-right white
    return im


def _corner_colors(im: Image.Image) -> tuple:
    px = np.asarray(im).astype(int)
    h, w = px.shape[:2]

    def name(v):
        return min(("red", (255, 0, 0)), ("green", (0, 255, 0)), ("blue", (0, 0, 255)), ("white", (255, 255, 255)),
                   key=lambda c: sum(abs(a - b) for a, b in zip(v, c[1])))[0]

    return name(px[2, 2]), name(px[2, w - 3]), name(px[h - 3, 2]), name(px[h - 3, w - 3])


@pytest.mark.parametrize("orientation, size, corners", [
    (1, (40, 24), ("red", "green", "blue", "white")),
    (6, (24, 40), ("blue", "red", "white", "green")),  # stored rotated 90 ccw: display rotates 90 cw
    (2, (40, 24), ("green", "red", "white", "blue")),  # mirrored
    (5, (24, 40), ("red", "blue", "green", "white")),  # mirrored and rotated (transpose)
])
def test_exif_orientation_applied(orientation, size, corners):
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = _encode(_quadrants(), "JPEG", quality=95, exif=exif)
    decoded = decode_image(_data_url(data, "image/jpeg"))
    assert decoded.image.size == size
    assert _corner_colors(decoded.image) == corners


def test_rejects_remote_urls():
    for url in ("http://example.com/cat.png", "https://example.com/cat.png", "HTTPS://EXAMPLE.COM/x.jpg",
                "file:///etc/passwd", "ftp://host/x.png"):
        _rejects(url, "remote image URLs are not fetched", "base64 data URL", kind=ErrorKind.UNSUPPORTED)


def test_rejects_bad_base64_and_data_urls():
    _rejects("not base64 at all!!", "not valid base64")
    _rejects("QUJD" + "é", "not valid base64")
    _rejects("A", "not valid base64")
    _rejects("data:image/png;base64,@@@@", "not valid base64")
    _rejects("data:image/gif;base64,R0lGODlh", "unsupported image type", "image/gif", "PNG, JPEG or WebP")
    _rejects("data:text/plain;base64,aGVsbG8=", "unsupported image type", "text/plain")
    _rejects("data:image/png,%89PNG", "base64")
    _rejects("data:image/png;base64", "malformed")
    _rejects("data:;base64,aGVsbG8=", "no media type")
    _rejects("", "empty")
    _rejects(b"", "empty")
    _rejects("   ", "empty")
    _rejects(12345, "base64 string or a data URL")
    _rejects("urn:isbn:0451450523", "unrecognized image reference")


def test_rejects_other_formats():
    gif = _encode(_smooth(10, 10).convert("P"), "GIF")
    _rejects(gif, "GIF images are not supported", "PNG, JPEG or WebP")
    _rejects(_data_url(gif, "image/png"), "GIF images are not supported")  # the bytes decide, not the label
    _rejects(_encode(_smooth(10, 10), "BMP"), "BMP images are not supported")
    _rejects(_encode(_smooth(10, 10), "TIFF"), "TIFF images are not supported")
    _rejects(b"hello world, this is not an image", "not a recognized image format")


def test_rejects_animations():
    a, b = _smooth(20, 10), _quadrants(20, 10)
    _rejects(_encode(a, "GIF", save_all=True, append_images=[b]), "GIF images are not supported")
    _rejects(_encode(a, "WEBP", save_all=True, append_images=[b]), "animated", "2 frames", "single still image")
    _rejects(_encode(a, "PNG", save_all=True, append_images=[b]), "animated", "PNG")


def test_mpo_uses_the_first_picture():
    a, b = _quadrants(20, 10), Image.new("RGB", (20, 10), (0, 0, 0))
    decoded = decode_image(_encode(a, "MPO", save_all=True, append_images=[b], quality=95))
    assert _corner_colors(decoded.image) == ("red", "green", "blue", "white")


def test_rejects_too_many_bytes():
    data = _encode(_rgb(64, 64), "PNG")
    msg = _rejects(data, "too large", max_bytes=len(data) - 1)
    assert str(len(data) - 1) in msg
    assert decode_image(data, max_bytes=len(data)).image.size == (64, 64)
    _rejects(base64.b64encode(data).decode(), "too large", max_bytes=100)
    huge = "A" * (4 * (DEFAULT_MAX_IMAGE_BYTES // 3 + 8))  # refused from its length, before decoding
    _rejects(huge, "too large", "after base64 decoding", "20.0 MiB")


def test_rejects_too_many_pixels_without_decoding(monkeypatch):
    header = _png_header_only(100_000, 100_000)

    def no_open(*a, **k):
        raise AssertionError("Pillow must not see an image whose header is over the limit")

    with monkeypatch.context() as m:
        m.setattr(Image, "open", no_open)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _rejects(header, "too large", "100000x100000", str(DEFAULT_MAX_IMAGE_PIXELS))
            _rejects(_data_url(header, "image/png"), "too large", "100000x100000")
            # JPEG and WebP headers are read the same way
            jpeg = bytearray(_encode(_smooth(30, 20), "JPEG"))
            sof = jpeg.index(b"\xff\xc0")
            jpeg[sof + 5:sof + 9] = struct.pack(">HH", 50_000, 60_000)
            _rejects(bytes(jpeg), "too large", "60000x50000")
            for kw in ({"lossless": True}, {"quality": 80}, {"exif": b"Exif\0\0MM\0*\0\0\0\x08\0\0"}):
                webp = _encode(_smooth(30, 20), "WEBP", **kw)
                _rejects(webp, "too large", "30x20", max_pixels=599)
    for fmt in ("PNG", "JPEG", "WEBP"):
        data = _encode(_smooth(30, 20), fmt)
        _rejects(data, "too large", "30x20 pixels", max_pixels=599)
        assert decode_image(data, max_pixels=600).image.size == (30, 20)


def test_pillow_bomb_checks_never_escape():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # a caller allowing more than Pillow does: Pillow's error becomes ours ...
        _rejects(_png_header_only(100_000, 100_000), "too large", max_pixels=10**12)
        # ... and Pillow's warning stays inside (the data is then truncated)
        _rejects(_png_header_only(10_000, 10_000), "corrupt or truncated", max_pixels=2 * 10**8)


def test_rejects_truncated_and_corrupt():
    data = _encode(_rgb(64, 64), "PNG")
    _rejects(data[: len(data) // 2], "PNG", "corrupt or truncated")
    _rejects(data[:30], "corrupt or truncated")
    jpeg = _encode(_rgb(64, 64), "JPEG")
    _rejects(jpeg[:200], "JPEG", "corrupt or truncated")
    webp = _encode(_rgb(64, 64), "WEBP")
    _rejects(webp[: len(webp) // 2], "corrupt or truncated")


def test_decoded_modes():
    rgba = Image.new("RGBA", (6, 4), (0, 0, 255, 0))
    assert np.asarray(decode_image(_encode(rgba, "PNG")).image).min() == 255  # transparent -> white
    pal = Image.new("P", (6, 4), 1)
    pal.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    pal.putpixel((0, 0), 0)
    px = np.asarray(decode_image(_encode(pal, "PNG", transparency=0)).image)
    assert tuple(px[0, 0]) == (255, 255, 255) and tuple(px[1, 1]) == (255, 0, 0)
    cmyk = decode_image(_encode(Image.new("CMYK", (8, 8), (0, 255, 255, 0)), "JPEG", quality=95))
    assert cmyk.image.mode == "RGB" and np.abs(np.asarray(cmyk.image).astype(int) - (255, 0, 0)).max() < 8


def test_sixteen_bit_grayscale_is_scaled_not_clipped():
    values = np.array([[0, 257, 32896, 65535]], dtype=np.uint16)
    decoded = decode_image(_encode(Image.fromarray(values), "PNG"))
    np.testing.assert_array_equal(np.asarray(decoded.image)[0, :, 0], [0, 1, 128, 255])
    trns = decode_image(_encode(Image.fromarray(values), "PNG", transparency=257))
    np.testing.assert_array_equal(np.asarray(trns.image)[0, :, 0], [0, 255, 128, 255])
