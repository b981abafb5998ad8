"""LLaVA-NeXT image preparation (flared.frontend.images.AnyresProcessor) and its prompt.

Parity: the same PIL image goes to transformers' ``LlavaNextImageProcessorPil`` (built with ``from_dict``) and to
``AnyresProcessor.prepare`` (through ``DecodedImage.from_pil``). pixel_values must agree bit for bit, and the image
token count must be LlavaNextProcessor's.
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from flared.errors import FrontendError
from flared.frontend.images import (
    AnyresProcessor, DecodedImage, best_resolution, image_processor_from_dict, image_processor_from_hf,
)

pytest.importorskip("transformers")

from transformers import LlavaNextProcessor, PreTrainedTokenizerFast  # noqa: E402
from transformers.image_processing_utils import select_best_resolution  # noqa: E402
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil  # noqa: E402

# llava-hf/llava-v1.6-mistral-7b-hf's preprocessor_config.json (scaled to 28-pixel tiles in _cfg)
RELEASED = {
    "aspect_ratio_setting": "anyres", "crop_size": {"height": 336, "width": 336}, "do_center_crop": True,
    "do_convert_rgb": True, "do_normalize": True, "do_pad": True, "do_rescale": True, "do_resize": True,
    "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_processor_type": "LlavaNextImageProcessor",
    "image_std": [0.26862954, 0.26130258, 0.27577711], "processor_class": "LlavaNextProcessor", "resample": 3,
    "rescale_factor": 0.00392156862745098, "size": {"shortest_edge": 336}}
GEOMETRIES = [(1, 1), (5, 3), (28, 28), (56, 28), (90, 40), (40, 90), (1000, 7), (7, 1000), (301, 300), (57, 29)]


def _cfg(tile: int = 28) -> dict:
    k = tile / 336
    return {**RELEASED, "crop_size": {"height": tile, "width": tile}, "size": {"shortest_edge": tile},
            "image_grid_pinpoints": [[int(h * k), int(w * k)] for h, w in RELEASED["image_grid_pinpoints"]]}


def _image(width: int, height: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def _theirs(cfg):
    hf = {k: v for k, v in cfg.items() if k not in ("image_processor_type", "processor_class",
                                                      "aspect_ratio_setting")}
    images = LlavaNextImageProcessorPil.from_dict(hf)
    tok = PreTrainedTokenizerFast(tokenizer_object=_tokenizer())
    return images, LlavaNextProcessor(image_processor=images, tokenizer=tok, patch_size=7,
                                      vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                      image_token="<image>")


def _tokenizer():
    from tokenizers import AddedToken, Tokenizer, models

    tok = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    tok.add_special_tokens([AddedToken("<image>", special=True)])
    return tok


@pytest.mark.parametrize("size", GEOMETRIES)
def test_pixels_and_token_counts_match_transformers(size):
    cfg = _cfg()
    images, processor = _theirs(cfg)
    picture = _image(*size, seed=size[0] * 5 + size[1])
    want = images(picture, return_tensors="np")
    p = image_processor_from_hf(cfg, {"processor_class": "LlavaNextProcessor", "patch_size": 7,
                                      "vision_feature_select_strategy": "default"}, image_seq_len=16)
    assert isinstance(p, AnyresProcessor)
    got = p.prepare(DecodedImage.from_pil(picture))
    n = got.pixel_values.shape[0]
    assert n == p.num_tiles(*size) and np.array_equal(got.pixel_values, want["pixel_values"][0, :n])
    assert want["pixel_values"].shape[1] == n  # (one image: its batch holds no padding tiles)
    assert got.grid == tuple(want["image_sizes"][0])
    count = list(processor(images=[picture], text=["<image>"])["input_ids"][0]).count(1)
    assert got.num_image_tokens == count == p.num_image_tokens_for(*size)
    assert got.prompt == "<image>" * count


def test_the_canvas_is_transformers():
    canvases = [tuple(c) for c in RELEASED["image_grid_pinpoints"]]
    for w in (1, 3, 10, 100, 336, 500, 672, 700, 1008, 2000):
        for h in (1, 3, 10, 100, 336, 500, 672, 700, 1008, 2000):
            assert best_resolution(h, w, canvases) == select_best_resolution((h, w), canvases), (w, h)


def test_settings_round_trip_and_bad_settings_are_named():
    p = image_processor_from_hf(_cfg(), None, image_seq_len=16)
    assert image_processor_from_dict(p.to_dict()) == p
    with pytest.raises(FrontendError, match="image_grid_pinpoints"):
        image_processor_from_hf({**_cfg(), "image_grid_pinpoints": [[30, 56]]}, None, image_seq_len=16)
    with pytest.raises(FrontendError, match="only square tiles"):
        image_processor_from_hf({**_cfg(), "size": {"shortest_edge": 40}}, None, image_seq_len=16)
    with pytest.raises(FrontendError, match="vision_feature_select_strategy"):
        image_processor_from_hf(_cfg(), {"vision_feature_select_strategy": "full"}, image_seq_len=16)
    with pytest.raises(FrontendError, match="image_seq_len"):
        image_processor_from_hf(_cfg(), None, image_seq_len=15)
