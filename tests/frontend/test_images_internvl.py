"""InternVL image preparation (flared.frontend.images.CanvasProcessor) and its prompt.

Parity: the same PIL image goes to transformers' ``GotOcr2ImageProcessorPil`` (built with ``from_dict`` as
from_pretrained builds it, called with crop_to_patches as InternVLProcessor calls it) and to
``CanvasProcessor.prepare`` (through ``DecodedImage.from_pil``). pixel_values and the tile count must agree bit for
bit; the prompt must be what InternVLProcessor makes of its context token.
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from flared.errors import FrontendError
from flared.frontend.images import (
    CanvasProcessor, DecodedImage, canvas_grid, image_processor_from_dict, image_processor_from_hf,
)

pytest.importorskip("transformers")

from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (  # noqa: E402
    GotOcr2ImageProcessorPil, get_optimal_tiled_canvas,
)

# OpenGVLab/InternVL3-1B-hf's preprocessor_config.json (its size scaled down in _cfg)
INTERNVL_CFG = {
    "crop_size": None, "crop_to_patches": False, "data_format": "channels_first", "default_to_square": True,
    "do_center_crop": None, "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
    "image_mean": [0.485, 0.456, 0.406], "image_processor_type": "GotOcr2ImageProcessorFast",
    "image_std": [0.229, 0.224, 0.225], "max_patches": 12, "min_patches": 1, "processor_class": "InternVLProcessor",
    "resample": 3, "rescale_factor": 0.00392156862745098, "size": {"height": 448, "width": 448}}
GEOMETRIES = [(1, 1), (5, 3), (32, 32), (64, 32), (90, 40), (40, 90), (1000, 7), (7, 1000), (301, 300), (97, 33)]


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def _cfg(side: int = 32, **extra) -> dict:
    return {**INTERNVL_CFG, "size": {"height": side, "width": side}, **extra}


def _theirs(cfg: dict, image: Image.Image, crop: bool = True):
    hf = {k: v for k, v in cfg.items() if k not in ("image_processor_type", "processor_class")}
    out = GotOcr2ImageProcessorPil.from_dict(hf)(image, crop_to_patches=crop, return_tensors="np")
    return out["pixel_values"], int(out["num_patches"][0])


@pytest.mark.parametrize("size", GEOMETRIES)
@pytest.mark.parametrize("tiles", [(1, 12), (1, 4), (2, 6)])
def test_pixels_and_tiles_match_transformers(size, tiles):
    cfg = _cfg(min_patches=tiles[0], max_patches=tiles[1])
    image = _image(*size, seed=size[0] * 7 + size[1])
    want, patches = _theirs(cfg, image)
    p = image_processor_from_hf(cfg, {"processor_class": "InternVLProcessor", "image_seq_length": 16},
                                image_seq_len=16)
    assert isinstance(p, CanvasProcessor) and p.crop_to_patches  # (on, as InternVLProcessor calls it)
    got = p.prepare(DecodedImage.from_pil(image))
    assert got.pixel_values.dtype == np.float32 and got.pixel_values.shape == want.shape
    assert np.array_equal(got.pixel_values, want)
    assert len(got.pixel_values) == patches == p.num_tiles(*size)
    assert got.num_image_tokens == 16 * patches == p.num_image_tokens_for(*size)
    assert got.prompt == "<img>" + "<IMG_CONTEXT>" * (16 * patches) + "</img>"


def test_the_canvas_is_transformers_including_its_ties():
    """Every aspect ratio from 1:40 to 40:1 over several areas (ties between canvases of one aspect ratio go to the
    larger while the image covers more than half of it)."""
    for max_tiles in (1, 4, 6, 12):
        for min_tiles in range(1, max_tiles + 1, 3):
            for w in (1, 3, 10, 28, 56, 100, 448, 900, 1800):
                for h in (1, 3, 10, 28, 56, 100, 448, 900, 1800):
                    assert canvas_grid(h, w, 448, 448, min_tiles, max_tiles) == get_optimal_tiled_canvas(
                        (h, w), (448, 448), min_tiles, max_tiles), (w, h, min_tiles, max_tiles)


def test_one_tile_without_cropping_and_without_a_thumbnail():
    cfg = _cfg(max_patches=1)
    image = _image(90, 40, 3)
    want, patches = _theirs(cfg, image)
    got = image_processor_from_hf(cfg, None, image_seq_len=16).prepare(DecodedImage.from_pil(image))
    assert patches == 1 and np.array_equal(got.pixel_values, want)


def test_settings_round_trip_and_bad_settings_are_named():
    p = image_processor_from_hf(_cfg(), None, image_seq_len=16)
    assert image_processor_from_dict(p.to_dict()) == p
    with pytest.raises(FrontendError, match="min_patches"):
        image_processor_from_hf(_cfg(min_patches=5, max_patches=4), None, image_seq_len=16)
    with pytest.raises(FrontendError, match="max_patches"):
        image_processor_from_hf(_cfg(max_patches=500), None, image_seq_len=16)
    with pytest.raises(FrontendError, match="image_seq_length"):
        image_processor_from_hf(_cfg(), {"image_seq_length": 256}, image_seq_len=16)
    with pytest.raises(FrontendError, match="size"):
        image_processor_from_hf(_cfg(size={"shortest_edge": 448}), None, image_seq_len=16)


def test_without_a_thumbnail_the_tiles_are_the_canvas_alone():
    """use_thumbnail false (an original InternVL config's): the canvas's tiles, no whole-image tile after them."""
    import dataclasses

    p = image_processor_from_hf(_cfg(max_patches=4), None, image_seq_len=16)
    bare = dataclasses.replace(p, thumbnail=False)
    image = DecodedImage.from_pil(_image(90, 40, 5))
    with_thumb, without = p.prepare(image), bare.prepare(image)
    assert len(with_thumb.pixel_values) == 3 and np.array_equal(without.pixel_values, with_thumb.pixel_values[:2])
    assert without.num_image_tokens == 32 == bare.num_image_tokens_for(90, 40)
    assert bare.prepare(DecodedImage.from_pil(_image(20, 20, 6))).num_image_tokens == 16  # (one tile either way)
    assert without.identity != with_thumb.identity
