"""Gemma 4 image preparation (flared.frontend.images.PooledPatchProcessor) and its prompt.

Parity: the same PIL image goes to transformers' ``Gemma4ImageProcessorPil`` (built with ``from_dict`` as
from_pretrained builds it) and to ``PooledPatchProcessor.prepare`` (through ``DecodedImage.from_pil``). Our patches
must be transformers' unpadded ones bit for bit, our grid its positions' and our token count its
``num_soft_tokens_per_image``; the prompt what transformers' ``Gemma4Processor`` makes of ``<|image|>``.
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from flared.errors import FrontendError
from flared.frontend.images import (DecodedImage, PooledPatchProcessor, image_processor_from_dict,
                                    image_processor_from_hf, pooled_size)

from flared_testing.vision import mode_image

pytest.importorskip("transformers")

from transformers.models.gemma4.image_processing_pil_gemma4 import (  # noqa: E402
    Gemma4ImageProcessorPil, get_aspect_ratio_preserving_size,
)

# google/gemma-4-E2B-it's preprocessor_config.json (as transformers saves Gemma4ImageProcessor's settings)
GEMMA4_CFG = {
    "do_convert_rgb": True, "do_normalize": False, "do_rescale": True, "do_resize": True,
    "image_mean": [0.0, 0.0, 0.0], "image_processor_type": "Gemma4ImageProcessor", "image_std": [1.0, 1.0, 1.0],
    "max_soft_tokens": 280, "patch_size": 16, "pooling_kernel_size": 3, "resample": 3,
    "rescale_factor": 0.00392156862745098}
GEOMETRIES = [(1, 1), (5, 3), (48, 48), (90, 40), (40, 90), (1000, 7), (7, 1000), (3000, 2), (301, 300), (640, 480)]
MODES = ("RGB", "RGBA", "L", "P")


def _check(cfg: dict, image: Image.Image) -> PooledPatchProcessor:
    hf = {k: v for k, v in cfg.items() if k != "image_processor_type"}
    want = Gemma4ImageProcessorPil.from_dict(hf)(image, return_tensors="np")
    p = image_processor_from_hf(cfg, None, image_seq_len=None)
    assert isinstance(p, PooledPatchProcessor)
    got = p.prepare(DecodedImage.from_pil(image))
    positions = want["image_position_ids"][0]
    real = (positions != -1).all(-1)
    assert got.pixel_values.dtype == np.float32 and got.pixel_values.flags.c_contiguous
    np.testing.assert_array_equal(got.pixel_values, want["pixel_values"][0][real])
    _, gh, gw = got.grid
    assert positions[real].max(0).tolist() == [gw - 1, gh - 1]
    assert got.num_image_tokens == want["num_soft_tokens_per_image"][0] == p.num_image_tokens_for(*image.size)
    return p


@pytest.mark.parametrize("width,height", GEOMETRIES)
@pytest.mark.parametrize("mode", MODES)
def test_pixels_match_transformers(width, height, mode):
    _check({**GEMMA4_CFG, "max_soft_tokens": 70}, mode_image(width, height, mode, width * 1000 + height))


@pytest.mark.parametrize("budget", [70, 140, 280, 560, 1120])
def test_every_soft_token_budget_matches_transformers(budget):
    _check({**GEMMA4_CFG, "max_soft_tokens": budget}, mode_image(777, 333, "RGB", budget))


@pytest.mark.parametrize("resample", [0, 1, 2])
def test_other_filters_and_normalization_match_transformers(resample):
    _check({**GEMMA4_CFG, "max_soft_tokens": 70, "resample": resample, "do_normalize": True,
            "image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.3, 0.4]}, mode_image(90, 40, "RGB", resample))


def test_sizes_are_transformers_for_every_aspect():
    for height in range(1, 400, 7):
        for width in (1, 2, 3, 50, 160, 999, 4000):
            for budget, patch, pool in ((70, 16, 3), (280, 16, 3), (1120, 14, 2)):
                want = get_aspect_ratio_preserving_size(height, width, patch, budget * pool * pool, pool)
                assert pooled_size(height, width, patch, budget, pool) == want, (height, width, budget)


def test_an_image_already_at_its_size_is_not_resized():
    """384 x 384 is the largest square of whole 48-pixel blocks within 70 of them: transformers keeps it as it is,
    its patches the image's own pixels / 255."""
    image = mode_image(384, 384, "RGB", 3)
    p = _check({**GEMMA4_CFG, "max_soft_tokens": 70}, image)
    got = p.prepare(DecodedImage.from_pil(image))
    raw = np.asarray(image).reshape(24, 16, 24, 16, 3).transpose(0, 2, 1, 3, 4).reshape(576, 768)
    assert got.grid == (1, 24, 24) and got.num_image_tokens == 64
    np.testing.assert_array_equal(got.pixel_values, (raw.astype(np.float64) / 255).astype(np.float32))


def test_prompt_is_gemma4_processors():
    p = image_processor_from_hf(GEMMA4_CFG, None, image_seq_len=None)
    got = p.prepare(DecodedImage.from_pil(mode_image(640, 480, "RGB", 1)))
    assert got.prompt == "<|image>" + "<|image|>" * got.num_image_tokens + "<image|>"
    assert p.placeholder == "<|image|>" and got.num_image_tokens <= 280 and got.grid[0] == 1


def test_settings_round_trip_and_refusals():
    p = image_processor_from_hf(GEMMA4_CFG, {"processor_class": "Gemma4Processor", "image_seq_length": 280},
                                image_seq_len=None)
    d = p.to_dict()
    assert d["kind"] == "pooled_patches" and image_processor_from_dict(d) == p == PooledPatchProcessor.from_dict(d)
    assert image_processor_from_hf({"processor_class": "Gemma4Processor"}, None, image_seq_len=None) == p
    with pytest.raises(FrontendError, match="max_soft_tokens"):
        image_processor_from_hf({**GEMMA4_CFG, "max_soft_tokens": 300}, None, image_seq_len=None)
    unresized = image_processor_from_hf({**GEMMA4_CFG, "do_resize": False, "max_soft_tokens": 70}, None,
                                        image_seq_len=None)
    assert unresized.prepare(DecodedImage.from_pil(mode_image(96, 48, "RGB", 2))).num_image_tokens == 2
    with pytest.raises(FrontendError, match="multiples of 48"):
        unresized.prepare(DecodedImage.from_pil(mode_image(50, 48, "RGB", 2)))
