"""Llama 4's image preparation (flared.frontend.llama4) against transformers': its canvas choice, resize target and
prompt for images of every aspect, against transformers' own functions; and the pixels bit for bit against
transformers' Llama4ImageProcessor where torchvision is installed (its tensor backend needs it: the lent GPU
machine has it, this one does not)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

# (width, height): tiny, one tile, wide, tall, a ratio no canvas has, big enough to be scaled down
SIZES = [(5, 3), (64, 64), (63, 65), (200, 40), (40, 200), (129, 64), (97, 211), (1000, 700), (301, 299), (64, 448)]


def _transformers_llama4():
    """transformers' llama4 image processing module: imported as it is where torchvision is installed, else with a
    stand-in for torchvision's functional module (which its canvas functions do not use)."""
    name = "transformers.models.llama4.image_processing_llama4"
    if importlib.util.find_spec("torchvision") is None:
        stubs = {}
        for mod in ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
                    "torchvision.transforms.v2.functional"):
            stubs[mod] = sys.modules.get(mod)
            sys.modules[mod] = types.ModuleType(mod)
        sys.modules["torchvision.transforms.v2"].functional = sys.modules["torchvision.transforms.v2.functional"]
        try:
            return importlib.import_module(name)
        except Exception as exc:  # (a transformers whose module needs more of torchvision)
            pytest.skip(f"transformers' llama4 image module needs torchvision here: {exc}")
        finally:
            for mod, was in stubs.items():
                if was is None:
                    sys.modules.pop(mod, None)
                else:
                    sys.modules[mod] = was
            sys.modules.pop(name, None)
    return importlib.import_module(name)


def _processor(**kw):
    from flared.frontend.llama4 import Llama4TileProcessor

    settings = dict(tile=336, max_patches=16, patch_size=14, downsample_ratio=4, resample=2,
                    image_mean=(0.5,) * 3, image_std=(0.5,) * 3, rescale_factor=1 / 255)
    return Llama4TileProcessor(**{**settings, **kw})


@pytest.mark.parametrize("max_patches, tile", [(16, 336), (6, 64), (1, 64)])
def test_the_canvas_and_resize_are_transformers(max_patches, tile):
    import torch

    from flared.frontend.llama4 import _fit_without_distortion, best_canvas, canvases

    theirs = _transformers_llama4()
    from transformers.image_utils import SizeDict

    size = SizeDict(height=tile, width=tile)
    options = theirs.find_supported_resolutions(max_num_chunks=max_patches, patch_size=size)
    assert list(canvases(max_patches, tile)) == [tuple(o) for o in options]
    rng = np.random.default_rng(3)
    sizes = SIZES + [tuple(int(v) for v in rng.integers(1, 3000, 2)) for _ in range(300)]
    for to_max in (False, True):
        for width, height in sizes:
            want = theirs.get_best_fit((height, width), torch.tensor(options), resize_to_max_canvas=to_max)
            got = best_canvas(height, width, max_patches, tile, to_max)
            assert got.tolist() == want.tolist(), (width, height)
            target = want if to_max else (min(max(height, tile), want[0]), min(max(width, tile), want[1]))
            assert (tuple(int(v) for v in _fit_without_distortion((height, width), target))
                    == tuple(int(v) for v in theirs.get_max_res_without_distortion((height, width), target)))


def test_the_prompt_is_llama4_processors():
    from transformers.models.llama4.processing_llama4 import Llama4Processor

    p = _processor()
    for rows, cols in ((1, 1), (1, 3), (2, 2), (4, 1)):
        assert p.prompt(rows, cols) == Llama4Processor._prompt_split_image(None, (rows, cols), 144)
    assert p.tokens_per_tile == 144 and p.grid(1000, 700) == (3, 3)
    assert p.num_image_tokens_for(1000, 700) == (9 + 1) * 144


def test_pixels_equal_transformers():
    """Bit for bit (bfloat16 values), tiles and global tile, for each size; where torchvision is installed."""
    pytest.importorskip("torchvision")
    import torch

    from flared.frontend.images import DecodedImage
    from flared_testing.vision import noise_rgb

    theirs = _transformers_llama4().Llama4ImageProcessor(size={"height": 64, "width": 64}, max_patches=6)
    ours = _processor(tile=64, max_patches=6, patch_size=8)
    for width, height in SIZES:
        im = noise_rgb(width, height)
        want = theirs(im, return_tensors="pt")
        got = ours.prepare(DecodedImage.from_pil(im))
        assert torch.equal(torch.from_numpy(got.pixel_values), want["pixel_values"].float()), (width, height)
        rows, cols = want["aspect_ratios"][0].tolist()
        assert (got.rows, got.cols) == ((rows, cols) if rows * cols > 1 else (0, 0))


def test_settings_round_trip_and_bad_ones_are_refused():
    from flared.errors import FrontendError
    from flared.frontend.images import image_processor_from_dict, image_processor_from_hf

    p = image_processor_from_hf({"image_processor_type": "Llama4ImageProcessorFast", "max_patches": 9},
                                {"processor_class": "Llama4Processor", "patch_size": 14, "pixel_shuffle_ratio": 0.5},
                                image_seq_len=None)
    assert p == _processor(max_patches=9) and image_processor_from_dict(p.to_dict()) == p
    for bad in (dict(max_patches=0), dict(max_patches=65), dict(patch_size=15), dict(do_resize=False)):
        with pytest.raises(FrontendError):
            _processor(**bad)
