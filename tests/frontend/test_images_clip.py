"""CLIP / LLaVA-1.5 image preparation (flared.frontend.images.CropProcessor) and the processor dispatch.

Parity: the same PIL image goes to transformers' ``CLIPImageProcessorPil`` / ``LlavaImageProcessorPil`` (built
with ``from_dict`` as from_pretrained builds them) and to ``CropProcessor.prepare`` (through
``DecodedImage.from_pil``). pixel_values must agree bit for bit; the prompt must be what transformers'
``LlavaProcessor.replace_image_token`` makes of transformers' pixel_values.
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from flared.errors import FrontendError
from flared.frontend.images import (
    CropProcessor,
    DecodedImage,
    PixtralProcessor,
    TileProcessor,
    image_processor_from_dict,
    image_processor_from_hf,
)

pytest.importorskip("transformers")

from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil  # noqa: E402
from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil  # noqa: E402
from transformers.models.llava.processing_llava import LlavaProcessor  # noqa: E402

# llava-hf/llava-1.5-7b-hf's preprocessor_config.json and processor_config.json
LLAVA15_CFG = {
    "crop_size": {"height": 336, "width": 336},
    "do_center_crop": True,
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_processor_type": "CLIPImageProcessor",
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "processor_class": "LlavaProcessor",
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "size": {"shortest_edge": 336},
}
LLAVA15_PROC = {"image_token": "<image>", "num_additional_image_tokens": 1, "patch_size": 14,
                "processor_class": "LlavaProcessor", "vision_feature_select_strategy": "default"}

# (width, height): small, large, portrait, landscape, extreme ratios, odd sizes, exactly the crop size
GEOMETRIES = [(1, 1), (5, 3), (32, 32), (28, 36), (36, 28), (33, 97), (97, 33), (400, 300), (300, 400),
              (1000, 7), (7, 1000), (2, 500), (301, 300), (64, 63), (250, 250)]
MODES = ("RGB", "RGBA", "L", "P")


def _image(width: int, height: int, mode: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    rgb = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    # smooth gradients under the noise so resampling filters see structure, not only noise
    y, x = np.mgrid[0:height, 0:width]
    rgb[..., 0] = (rgb[..., 0] // 4 + (x * 191 // max(width - 1, 1))).astype(np.uint8)
    im = Image.fromarray(rgb, "RGB")
    if mode == "RGBA":
        alpha = rng.integers(0, 256, (height, width), dtype=np.uint8)
        im = Image.merge("RGBA", (*im.split(), Image.fromarray(alpha, "L")))
    elif mode == "L":
        im = im.convert("L")
    elif mode == "P":
        im = im.convert("P", palette=Image.Palette.ADAPTIVE, colors=37)
    return im


def _cfg(kind: str, *, shortest: int = 32, crop=(32, 32), **extra) -> dict:
    cfg = {"image_processor_type": kind, "size": {"shortest_edge": shortest},
           "crop_size": {"height": crop[0], "width": crop[1]}}
    cfg.update(extra)
    return cfg


def _hf_pixels(cfg: dict, image: Image.Image) -> np.ndarray:
    cls = LlavaImageProcessorPil if cfg["image_processor_type"].startswith("Llava") else CLIPImageProcessorPil
    out = cls.from_dict(dict(cfg))(image, return_tensors="np")["pixel_values"]
    assert out.shape[0] == 1
    return out[0]


def _ours(cfg: dict, image: Image.Image, seq: int = 9, proc: dict | None = None):
    p = image_processor_from_hf(cfg, proc, image_seq_len=seq)
    assert isinstance(p, CropProcessor)
    return p, p.prepare(DecodedImage.from_pil(image))


def _check(cfg: dict, image: Image.Image) -> None:
    want = _hf_pixels(cfg, image)
    p, got = _ours(cfg, image)
    assert got.pixel_values.dtype == np.float32 and got.pixel_values.flags.c_contiguous
    assert got.pixel_values.shape == want.shape == (3,) + p.output_size(image.width, image.height)
    np.testing.assert_array_equal(got.pixel_values, want)


# ------------------------------------------------------------------------------------------------ parity

@pytest.mark.parametrize("width,height", GEOMETRIES)
@pytest.mark.parametrize("mode", MODES)
def test_clip_parity(width, height, mode):
    _check(_cfg("CLIPImageProcessor"), _image(width, height, mode, width * 1000 + height))


@pytest.mark.parametrize("width,height", GEOMETRIES)
@pytest.mark.parametrize("mode", MODES)
def test_llava_pad_parity(width, height, mode):
    cfg = _cfg("LlavaImageProcessor", crop=(28, 36), do_pad=True)
    _check(cfg, _image(width, height, mode, width * 7 + height))


@pytest.mark.parametrize("width,height", [(5, 3), (97, 33), (33, 97), (1000, 7)])
@pytest.mark.parametrize("extra", [
    {"crop": (28, 36)},
    {"crop": (48, 40)},  # larger than the resized image: transformers zero-pads
    {"crop": (28, 36), "do_resize": False},
    {"do_center_crop": False},
    {"resample": 2, "do_normalize": False},
    {"do_rescale": False, "image_mean": [0.5, 0.25, 0.75], "image_std": [0.2, 0.3, 0.4]},
    {"size": 20, "crop_size": 16},  # old configs' plain numbers
])
@pytest.mark.parametrize("kind", ["CLIPImageProcessor", "LlavaImageProcessorPil"])
def test_settings_parity(width, height, extra, kind):
    extra = dict(extra)
    cfg = _cfg(kind, crop=extra.pop("crop", (32, 32)), **extra)
    if kind.startswith("Llava"):
        cfg["do_pad"] = True
    _check(cfg, _image(width, height, "RGB", width + height))


@pytest.mark.parametrize("width,height", [(50, 40), (40, 50), (336, 336), (17, 400)])
def test_llava15_real_settings(width, height):
    image = _image(width, height, "RGB", 5)
    want = _hf_pixels(LLAVA15_CFG, image)
    p, got = _ours(LLAVA15_CFG, image, seq=576, proc=LLAVA15_PROC)
    assert got.pixel_values.shape == (3, 336, 336)
    np.testing.assert_array_equal(got.pixel_values, want)
    # transformers' LlavaProcessor prompt, from transformers' own pixel_values (no tokenizer needed for this)
    hf = LlavaProcessor.__new__(LlavaProcessor)
    hf.patch_size, hf.num_additional_image_tokens = 14, 1
    hf.vision_feature_select_strategy, hf.image_token = "default", "<image>"
    assert got.prompt == hf.replace_image_token({"pixel_values": want[None]}, 0)
    assert got.num_image_tokens == 576 == p.num_image_tokens_for(width, height)
    assert (got.rows, got.cols, got.grid) == (0, 0, None)
    for cfg in (dict(LLAVA15_CFG, image_processor_type="LlavaImageProcessor", do_pad=True),):
        np.testing.assert_array_equal(_ours(cfg, image, 576, LLAVA15_PROC)[1].pixel_values, _hf_pixels(cfg, image))


# --------------------------------------------------------------------------------------- configuration

def test_prompt_and_tokens():
    p = image_processor_from_hf(LLAVA15_CFG, {"image_token": "<img>"}, image_seq_len=7)
    got = p.prepare(DecodedImage.from_pil(_image(9, 9, "RGB", 1)))
    assert got.prompt == "<img>" * 7 and got.num_image_tokens == 7
    assert p.pad_to_square is False  # CLIPImageProcessor has no do_pad


def test_round_trip_and_identity():
    p = image_processor_from_hf(_cfg("LlavaImageProcessorFast", crop=(28, 36), do_pad=True), None,
                                image_seq_len=12)
    d = p.to_dict()
    assert d["kind"] == "crop" and d["pad_to_square"] is True and (d["crop_height"], d["crop_width"]) == (28, 36)
    assert image_processor_from_dict(d) == p == CropProcessor.from_dict(d)
    img = DecodedImage.from_pil(_image(40, 30, "RGB", 2))
    a = p.prepare(img)
    assert a.identity == image_processor_from_dict(d).prepare(img).identity
    other = CropProcessor.from_dict(dict(d, pad_to_square=False))
    assert other.prepare(img).identity != a.identity
    with pytest.raises(FrontendError, match="crop processor"):
        image_processor_from_dict(dict(d, bogus=1))


@pytest.mark.parametrize("cfg,proc", [
    ({"image_processor_type": "CLIPImageProcessor"}, None),
    ({"image_processor_type": "CLIPImageProcessorFast"}, None),
    ({"image_processor_type": "LlavaImageProcessorPil"}, None),
    ({"processor_class": "LlavaProcessor"}, None),
    ({}, {"processor_class": "LlavaProcessor"}),
    ({}, {"processor_class": "LlavaProcessor", "image_processor": {"image_processor_type": "CLIPImageProcessor"}}),
])
def test_dispatch(cfg, proc):
    p = image_processor_from_hf(cfg, proc, image_seq_len=3)
    assert isinstance(p, CropProcessor)
    ref = CLIPImageProcessorPil()  # transformers' defaults for what the config leaves out
    assert (p.shortest_edge, p.crop_height, p.crop_width, p.resample) == (
        ref.size["shortest_edge"], ref.crop_size["height"], ref.crop_size["width"], ref.resample)
    assert image_processor_from_dict(p.to_dict()) == p


def test_dispatch_others_unchanged():
    assert isinstance(image_processor_from_hf({}, None, image_seq_len=64), TileProcessor)
    assert isinstance(image_processor_from_hf({}, {"processor_class": "PixtralProcessor"}, image_seq_len=None),
                      PixtralProcessor)


def test_llava_do_pad_read_only_for_llava():
    assert image_processor_from_hf({"processor_class": "LlavaProcessor", "do_pad": True}, None,
                                   image_seq_len=1).pad_to_square is True
    assert image_processor_from_hf({"image_processor_type": "CLIPImageProcessor", "do_pad": True}, None,
                                   image_seq_len=1).pad_to_square is False


@pytest.mark.parametrize("cfg,proc,seq,field", [
    (LLAVA15_CFG, None, None, "image_seq_len"),
    (LLAVA15_CFG, LLAVA15_PROC, 577, "577"),
    (dict(LLAVA15_CFG, size={"height": 336, "width": 336}), None, 576, "size"),
    (dict(LLAVA15_CFG, crop_size={"height": 0, "width": 336}), None, 576, "crop_size.height"),
    (dict(LLAVA15_CFG, do_center_crop="yes"), None, 576, "do_center_crop"),
    (dict(LLAVA15_CFG, image_processor_type="LlavaImageProcessor", do_pad=True, image_mean=[2, 0, 0]), None, 576,
     "image_mean"),
    (dict(LLAVA15_CFG, image_processor_type="SiglipImageProcessor"), None, 576, "image_processor_type"),
])
def test_config_errors(cfg, proc, seq, field):
    with pytest.raises(FrontendError, match=field):
        image_processor_from_hf(cfg, proc, image_seq_len=seq)
