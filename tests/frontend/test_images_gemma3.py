"""Gemma 3 image preparation (flared.frontend.images.SquareProcessor) and its prompt.

Parity: the same PIL image goes to transformers' ``Gemma3ImageProcessorPil`` (built with ``from_dict`` as
from_pretrained builds it) and to ``SquareProcessor.prepare`` (through ``DecodedImage.from_pil``). pixel_values must
agree bit for bit; the prompt must be what transformers' ``Gemma3Processor`` makes of ``<start_of_image>``.
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from flared.errors import FrontendError
from flared.frontend.images import DecodedImage, SquareProcessor, image_processor_from_dict, image_processor_from_hf

from flared_testing.vision import mode_image

pytest.importorskip("transformers")

from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil  # noqa: E402

# google/gemma-3-4b-it's preprocessor_config.json
GEMMA3_CFG = {
    "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True, "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Gemma3ImageProcessor", "image_seq_length": 256,
    "image_std": [0.5, 0.5, 0.5], "pan_and_scan_max_num_crops": None, "pan_and_scan_min_crop_size": None,
    "pan_and_scan_min_ratio_to_activate": None, "processor_class": "Gemma3Processor", "resample": 2,
    "rescale_factor": 0.00392156862745098, "size": {"height": 896, "width": 896}}
GEOMETRIES = [(1, 1), (5, 3), (64, 64), (90, 40), (40, 90), (1000, 7), (7, 1000), (301, 300)]
MODES = ("RGB", "RGBA", "L", "P")


def _cfg(side: int = 64, **extra) -> dict:
    # (the released config's do_convert_rgb null leaves transformers' class default off; a DecodedImage is RGB,
    # transparency on white, as transformers' conversion makes it)
    return {**GEMMA3_CFG, "size": {"height": side, "width": side}, "image_seq_length": 16, "do_convert_rgb": True,
            **extra}


def _check(cfg: dict, image: Image.Image) -> None:
    hf = dict(cfg)
    for key in ("image_seq_length", "processor_class"):
        hf.pop(key, None)
    want = Gemma3ImageProcessorPil.from_dict(hf)(image, return_tensors="np")["pixel_values"]
    p = image_processor_from_hf(cfg, None, image_seq_len=cfg["image_seq_length"])
    assert isinstance(p, SquareProcessor)
    got = p.prepare(DecodedImage.from_pil(image))
    assert got.pixel_values.dtype == np.float32 and got.pixel_values.flags.c_contiguous
    assert want.shape[0] == 1 and got.pixel_values.shape == want.shape[1:]
    np.testing.assert_array_equal(got.pixel_values, want[0])


@pytest.mark.parametrize("width,height", GEOMETRIES)
@pytest.mark.parametrize("mode", MODES)
def test_pixels_match_transformers(width, height, mode):
    _check(_cfg(), mode_image(width, height, mode, width * 1000 + height))


@pytest.mark.parametrize("resample", [0, 1, 3])
def test_other_filters_and_a_rectangle_match_transformers(resample):
    _check(_cfg(resample=resample, size={"height": 48, "width": 80}), mode_image(90, 40, "RGB", resample))


def test_the_released_settings_match_transformers():
    _check(GEMMA3_CFG, mode_image(300, 200, "RGB", 7))
    _check(GEMMA3_CFG, mode_image(45, 700, "RGB", 8))


def test_prompt_is_gemma3_processors():
    p = image_processor_from_hf(GEMMA3_CFG, None, image_seq_len=256)
    got = p.prepare(DecodedImage.from_pil(mode_image(20, 10, "RGB", 1)))
    assert got.prompt == "\n\n<start_of_image>" + "<image_soft_token>" * 256 + "<end_of_image>\n\n"
    assert got.num_image_tokens == 256 and p.placeholder == "<start_of_image>"
    assert p.num_image_tokens_for(5, 900) == 256


def test_settings_round_trip_and_refusals():
    p = image_processor_from_hf(GEMMA3_CFG, {"image_seq_length": 256}, image_seq_len=256)
    d = p.to_dict()
    assert d["kind"] == "square" and image_processor_from_dict(d) == p == SquareProcessor.from_dict(d)
    with pytest.raises(FrontendError, match="pan-and-scan"):
        image_processor_from_hf({**GEMMA3_CFG, "do_pan_and_scan": True}, None, image_seq_len=256)
    with pytest.raises(FrontendError, match="image_seq_length"):
        image_processor_from_hf(GEMMA3_CFG, {"image_seq_length": 64}, image_seq_len=256)
    with pytest.raises(FrontendError, match="image_seq_length"):  # (the released preprocessor config says it too)
        image_processor_from_hf(GEMMA3_CFG, None, image_seq_len=64)
    with pytest.raises(FrontendError, match="image_seq_len"):
        image_processor_from_hf(GEMMA3_CFG, None, image_seq_len=None)
    assert image_processor_from_hf({"processor_class": "Gemma3Processor"}, None, image_seq_len=4).kind == "square"
