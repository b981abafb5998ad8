"""Qwen2-VL / Qwen2.5-VL image preparation (flared.frontend.images.PatchProcessor) and the processor dispatch.

Parity: the same PIL image goes to transformers' ``Qwen2VLImageProcessorPil`` and to ``PatchProcessor.prepare``
(through ``DecodedImage.from_pil``), and pixel_values, image_grid_thw and the expanded prompt must agree exactly
(pixel_values bit for bit).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from flared_testing.vision import mode_images
from flared_testing.vision import noise_rgb as _rgb
from PIL import Image

from flared.errors import ErrorKind, FrontendError
from flared.frontend.images import (
    DecodedImage,
    PatchProcessor,
    PreparedImage,
    TileProcessor,
    image_processor_from_dict,
    image_processor_from_hf,
)

pytest.importorskip("transformers")

from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (  # noqa: E402
    Qwen2VLImageProcessorPil,
    smart_resize,
)

# ----------------------------------------------------------------------------------------------- helpers








# Qwen/Qwen2-VL-2B-Instruct preprocessor_config.json (Qwen2.5-VL's differ only in processor_class)
QWEN2_VL_REAL = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
}
SMALL_A = dict(QWEN2_VL_REAL, min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)  # real patching, small budget
SMALL_B = {  # other patch geometry, settings through "size", LANCZOS, scalar mean/std
    "image_processor_type": "Qwen2VLImageProcessorPil",
    "size": {"shortest_edge": 16 * 16 * 3, "longest_edge": 16 * 16 * 40},
    "patch_size": 8,
    "merge_size": 2,
    "temporal_patch_size": 3,
    "resample": 1,
    "image_mean": 0.5,
    "image_std": 0.25,
}
SMALL_C = {  # merge_size 1, BILINEAR, "size" overridden by the top-level keys (those win)
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "size": {"shortest_edge": 10**6, "longest_edge": 10**7},
    "min_pixels": 20 * 20 * 2,
    "max_pixels": 20 * 20 * 30,
    "patch_size": 20,
    "merge_size": 1,
    "temporal_patch_size": 1,
    "resample": 2,
    "rescale_factor": 0.00392156862745098,
}
CONFIGS = {"a": SMALL_A, "b": SMALL_B, "c": SMALL_C}

GEOMETRIES = [
    (1, 1), (2, 1), (1, 2), (17, 5), (5, 17), (27, 27), (28, 28), (29, 29),  # tiny: scaled up to min_pixels
    (42, 42), (14, 70), (56, 28), (57, 29), (41, 83), (70, 98), (100, 100), (112, 112),  # rounding, odd sizes
    (300, 200), (200, 300), (333, 101), (999, 998),  # scaled down to max_pixels
    (200, 1), (1, 200), (400, 2), (599, 3), (1000, 5), (5, 1000), (700, 9), (31, 3100),  # aspect ratio <= 200
    (3000, 2000), (1234, 4321),  # large
]
TOO_LONG = [(201, 1), (1, 201), (401, 2), (1000, 3), (3, 1000), (20000, 99)]  # aspect ratio > 200


def _hf_processor(cfg: dict) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil.from_dict(dict(cfg))  # the way from_pretrained builds it from the JSON


def _replace_image_token(grid_thw: np.ndarray, merge_size: int, token: str = "<|image_pad|>") -> str:
    """transformers' Qwen2VLProcessor.replace_image_token on a stub (no tokenizer needed)."""
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor

    class Stub:
        image_token = token

        class image_processor:  # noqa: N801 - the attribute replace_image_token reads
            pass

    Stub.image_processor.merge_size = merge_size
    return Qwen2VLProcessor.replace_image_token(Stub(), {"image_grid_thw": grid_thw}, 0)


def _check_parity(cfg: dict, pil: Image.Image, ref=None) -> PreparedImage:
    ref = ref or _hf_processor(cfg)
    out = ref(pil)
    want = np.asarray(out["pixel_values"])
    want_grid = np.asarray(out["image_grid_thw"])
    pp = PatchProcessor.from_hf(cfg, None)
    got = pp.prepare(DecodedImage.from_pil(pil))
    assert got.pixel_values.dtype == np.float32 and got.pixel_values.flags.c_contiguous
    assert got.pixel_values.shape == want.shape, (pil.size, got.pixel_values.shape, want.shape)
    np.testing.assert_array_equal(got.pixel_values, want)
    assert want_grid.shape == (1, 3) and got.grid == tuple(int(v) for v in want_grid[0]), (pil.size, got.grid)
    assert got.prompt == _replace_image_token(want_grid, pp.merge_size)
    assert got.num_image_tokens == got.prompt.count("<|image_pad|>") == pp.num_image_tokens_for(*pil.size)
    assert got.num_image_tokens * pp.merge_size ** 2 == want.shape[0]
    assert (got.rows, got.cols) == (0, 0) and len(got.identity) == 32
    return got


# -------------------------------------------------------------------------------------- preprocessing parity

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_geometries_match_transformers(name):
    cfg = CONFIGS[name]
    ref = _hf_processor(cfg)
    for w, h in GEOMETRIES:
        _check_parity(cfg, _rgb(w, h), ref)


def test_grids_cover_up_and_down_scaling():
    pp = PatchProcessor.from_hf(SMALL_A, None)
    assert pp.grid(1, 1) == (1, 4, 4)  # scaled up to min_pixels (56 x 56)
    assert pp.grid(28, 28) == (1, 4, 4) and pp.grid(56, 56) == (1, 4, 4) and pp.grid(84, 56) == (1, 4, 6)
    assert pp.grid(3000, 2000) == (1, 6, 8)  # scaled down to max_pixels (16 blocks of 28 x 28 at most)
    assert all(pp.num_image_tokens_for(w, h) <= 16 for w, h in GEOMETRIES if max(w, h) <= 30 * min(w, h))
    # smart_resize does not hold thin images to max_pixels: scaled up to min_pixels without a second check, or
    # scaled down with the short edge kept at one block (transformers makes the same grids; see the parity test)
    assert pp.grid(200, 1) == (1, 2, 58) and pp.num_image_tokens_for(1, 200) == 29 > 16
    assert pp.grid(31, 3100) == (1, 80, 2) and pp.num_image_tokens_for(31, 3100) == 40 > 16




def test_modes_match_transformers():
    images = mode_images()
    assert images["P"].mode == "P" and "transparency" not in images["P"].info
    assert images["P+transparency"].mode == "P" and "transparency" in images["P+transparency"].info
    for cfg in (SMALL_A, SMALL_B):
        ref = _hf_processor(cfg)
        for name, im in images.items():
            assert im.mode == name.split("+")[0], name
            _check_parity(cfg, im, ref)


def test_aspect_ratio_over_200_refused_like_transformers():
    for cfg in (SMALL_A, SMALL_C):
        ref = _hf_processor(cfg)
        pp = PatchProcessor.from_hf(cfg, None)
        for w, h in TOO_LONG:
            with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
                smart_resize(h, w, pp.factor, pp.min_pixels, pp.max_pixels)
            if w * h < 10**6:
                with pytest.raises(ValueError, match="aspect ratio"):
                    ref(_rgb(w, h))
                with pytest.raises(FrontendError, match="200 times") as info:
                    pp.prepare(DecodedImage.from_pil(_rgb(w, h)))
                assert info.value.kind is ErrorKind.VALIDATION and f"{w}x{h}" in str(info.value)
            with pytest.raises(FrontendError, match="200 times"):
                pp.num_image_tokens_for(w, h)


def test_real_qwen2_vl_settings_on_small_images():
    ref = _hf_processor(QWEN2_VL_REAL)
    got = _check_parity(QWEN2_VL_REAL, _rgb(40, 30), ref)
    assert got.grid == (1, 4, 6) and got.pixel_values.shape == (24, 1176) and got.num_image_tokens == 6
    got = _check_parity(QWEN2_VL_REAL, _rgb(300, 200), ref)
    assert got.grid == (1, 14, 22) and got.num_image_tokens == 77
    # the class defaults (a config without any of these fields): max_pixels 28*28*1280
    _check_parity({}, _rgb(45, 70))
    pp = PatchProcessor.from_hf(QWEN2_VL_REAL, {"processor_class": "Qwen2VLProcessor"})
    assert pp.num_image_tokens_for(1, 1) == 4 and pp.num_image_tokens_for(4000, 3000) <= 12845056 // 784


def test_num_image_tokens_match_transformers_over_many_sizes():
    rng = np.random.default_rng(5)
    sizes = [(int(w), int(h)) for w, h in rng.integers(1, 9000, (400, 2)) if max(w, h) / min(w, h) <= 200]
    sizes += [(int(w), int(h)) for w, h in rng.integers(1, 300, (300, 2)) if max(w, h) / min(w, h) <= 200]
    sizes += [(k * 14 + d, j * 14 + e) for k in range(1, 12) for j in range(1, 12, 3)
              for d in (-1, 0, 7) for e in (0, 7)]  # around the rounding points (half-way: 7)
    for cfg in (QWEN2_VL_REAL, {}, SMALL_A, SMALL_B, SMALL_C):
        ref = _hf_processor(cfg)
        pp = PatchProcessor.from_hf(cfg, None)
        for w, h in sizes:
            patches = ref.get_number_of_image_patches(h, w)
            assert pp.num_image_tokens_for(w, h) == patches // pp.merge_size ** 2, (cfg, w, h)
            t, gh, gw = pp.grid(w, h)
            assert t == 1 and gh * gw == patches and gh % pp.merge_size == 0 == gw % pp.merge_size


def test_flags_off_match_transformers():
    im = _rgb(70, 40)
    for flags in ({"do_rescale": False}, {"do_normalize": False}, {"do_rescale": False, "do_normalize": False}):
        for cfg in (SMALL_A, SMALL_B):
            _check_parity(dict(cfg, **flags), im)


def test_without_resize_sizes_must_be_whole_blocks():
    cfg = dict(SMALL_A, do_resize=False)
    got = _check_parity(cfg, _rgb(84, 56))
    assert got.grid == (1, 4, 6)
    pp = PatchProcessor.from_hf(cfg, None)
    with pytest.raises(ValueError):  # transformers' reshape fails
        _hf_processor(cfg)(_rgb(85, 56))
    with pytest.raises(FrontendError, match="multiples of 28") as info:
        pp.prepare(DecodedImage.from_pil(_rgb(85, 56)))
    assert info.value.kind is ErrorKind.VALIDATION
    with pytest.raises(FrontendError, match="multiples of 28"):
        pp.num_image_tokens_for(56, 57)


def test_patch_layout():
    """Row r of pixel_values is patch r in merge-block order, channel-major, every temporal frame the same."""
    cfg = dict(SMALL_A, do_resize=False, do_rescale=False, do_normalize=False)
    pp = PatchProcessor.from_hf(cfg, None)
    arr = np.random.default_rng(3).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    got = pp.prepare(DecodedImage.from_pil(Image.fromarray(arr)))
    p = 14
    rows = got.pixel_values.reshape(-1, 3, 2, p, p)
    np.testing.assert_array_equal(rows[:, :, 0], rows[:, :, 1])
    order = [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3), (0, 4), (0, 5), (1, 4), (1, 5),
             (2, 0), (2, 1), (3, 0), (3, 1)]  # first 16 patches of the 4 x 6 grid: 2 x 2 blocks, row-major
    for i, (r, c) in enumerate(order):
        want = arr[r * p:(r + 1) * p, c * p:(c + 1) * p].transpose(2, 0, 1).astype(np.float32)
        np.testing.assert_array_equal(rows[i, :, 0], want)


# ------------------------------------------------------------------------------------------ configuration

def test_from_hf_defaults_are_transformers_defaults():
    ref = Qwen2VLImageProcessorPil()
    pp = PatchProcessor.from_hf({}, None)
    assert (pp.min_pixels, pp.max_pixels) == (ref.size.shortest_edge, ref.size.longest_edge) == (3136, 1003520)
    assert (pp.patch_size, pp.temporal_patch_size, pp.merge_size) == (
        ref.patch_size, ref.temporal_patch_size, ref.merge_size) == (14, 2, 2)
    assert pp.resample == int(ref.resample) == Image.Resampling.BICUBIC
    assert pp.image_mean == tuple(ref.image_mean) and pp.image_std == tuple(ref.image_std)
    assert pp.rescale_factor == ref.rescale_factor
    assert (pp.do_resize, pp.do_rescale, pp.do_normalize) == (ref.do_resize, ref.do_rescale, ref.do_normalize)
    assert pp.image_token == "<|image_pad|>" and PatchProcessor.kind == "patches"


def test_min_max_pixels_win_over_size():
    for cfg, want in [
        (SMALL_C, (800, 12000)),
        ({"size": {"shortest_edge": 100, "longest_edge": 5000}}, (100, 5000)),
        ({"size": {"shortest_edge": 100, "longest_edge": 5000}, "max_pixels": 7000}, (100, 7000)),
        ({"size": {"longest_edge": 5000}, "min_pixels": 200}, (200, 5000)),
        ({"size": {"min_pixels": 1, "max_pixels": 2}, "min_pixels": 300, "max_pixels": 9000}, (300, 9000)),
        ({"min_pixels": 400}, (400, 28 * 28 * 1280)),
        (QWEN2_VL_REAL, (3136, 12845056)),
    ]:
        ref = _hf_processor(cfg)
        pp = PatchProcessor.from_hf(cfg, None)
        assert (pp.min_pixels, pp.max_pixels) == (ref.size.shortest_edge, ref.size.longest_edge) == want, cfg


def test_from_hf_reads_nested_processor_config():
    pp = PatchProcessor.from_hf({}, {"image_processor": SMALL_B, "processor_class": "Qwen2_5_VLProcessor"})
    assert (pp.patch_size, pp.temporal_patch_size, pp.min_pixels) == (8, 3, 768)


@pytest.mark.parametrize("patch, field", [
    ({"patch_size": 0}, "patch_size"),
    ({"merge_size": "2"}, "merge_size"),
    ({"temporal_patch_size": -1}, "temporal_patch_size"),
    ({"temporal_patch_size": True}, "temporal_patch_size"),
    ({"min_pixels": 0}, "min_pixels"),
    ({"max_pixels": 1.5}, "max_pixels"),
    ({"min_pixels": 5000, "max_pixels": 4000}, "min_pixels"),
    ({"min_pixels": None, "max_pixels": None, "size": {"shortest_edge": 0, "longest_edge": 9}},
     "size.shortest_edge"),
    ({"min_pixels": None, "max_pixels": None, "size": {"shortest_edge": 10}}, "size"),
    ({"min_pixels": None, "max_pixels": None, "size": {"height": 10, "width": 10}}, "size"),
    ({"min_pixels": None, "size": {"min_pixels": 10, "max_pixels": 900}}, "size"),
    ({"size": 512}, "size"),
    ({"image_std": [0.5, 0.0, 0.5]}, "image_std"),
    ({"image_mean": [0.5, 0.5]}, "image_mean"),
    ({"image_mean": [0.5, float("inf"), 0.5]}, "image_mean"),
    ({"resample": 9}, "resample"),
    ({"resample": "bicubic"}, "resample"),
    ({"do_resize": "yes"}, "do_resize"),
    ({"do_normalize": 0}, "do_normalize"),
    ({"rescale_factor": 0}, "rescale_factor"),
    ({"image_processor_type": "Idefics3ImageProcessor"}, "image_processor_type"),
    ({"image_processor_type": "Qwen2VLImageProcessorSlow"}, "image_processor_type"),
])
def test_from_hf_rejects_nonsense(patch, field):
    with pytest.raises(FrontendError) as info:
        PatchProcessor.from_hf(dict(SMALL_A, **patch), None)
    assert info.value.kind is ErrorKind.VALIDATION
    assert repr(field) in str(info.value), str(info.value)


def test_accepted_type_names():
    for name in ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil"):
        assert PatchProcessor.from_hf(dict(SMALL_A, image_processor_type=name), None) == \
            PatchProcessor.from_hf(SMALL_A, None)
    no_type = {k: v for k, v in SMALL_A.items() if k != "image_processor_type"}
    assert PatchProcessor.from_hf(no_type, None) == PatchProcessor.from_hf(SMALL_A, None)


def test_to_dict_round_trip_and_identity():
    pp = PatchProcessor.from_hf(QWEN2_VL_REAL, None)
    d = json.loads(json.dumps(pp.to_dict()))
    assert d["kind"] == "patches" and PatchProcessor.from_dict(d) == pp
    assert PatchProcessor.from_dict({k: v for k, v in d.items() if k != "kind"}) == pp
    with pytest.raises(FrontendError, match="bogus"):
        PatchProcessor.from_dict(dict(d, bogus=1))
    with pytest.raises(FrontendError, match="incomplete"):
        PatchProcessor.from_dict({k: v for k, v in d.items() if k != "merge_size"})
    with pytest.raises(FrontendError, match="kind"):
        PatchProcessor.from_dict(dict(d, kind="tiles"))
    with pytest.raises(FrontendError, match="'max_pixels'"):
        PatchProcessor.from_dict(dict(d, max_pixels=-5))

    small = PatchProcessor.from_hf(SMALL_A, None)
    a, b = DecodedImage.from_pil(_rgb(20, 10)), DecodedImage.from_pil(_rgb(20, 10, seed=9))
    ids = {small.prepare(a).identity, small.prepare(b).identity,
           PatchProcessor.from_dict(dict(small.to_dict(), resample=2)).prepare(a).identity,
           PatchProcessor.from_dict(dict(small.to_dict(), max_pixels=28 * 28 * 17)).prepare(a).identity,
           TileProcessor.from_hf({}, None, image_seq_len=4).prepare(a).identity}
    assert len(ids) == 5 and all(len(i) == 32 for i in ids)
    assert small.prepare(a).identity == PatchProcessor.from_dict(small.to_dict()).prepare(a).identity


# ------------------------------------------------------------------------------------------------ dispatch

TILE_CFG = {"image_processor_type": "Idefics3ImageProcessor", "size": {"longest_edge": 96},
            "max_image_size": {"longest_edge": 32}}


def test_image_processor_from_hf_dispatch():
    pp = image_processor_from_hf(QWEN2_VL_REAL, None, image_seq_len=None)
    assert isinstance(pp, PatchProcessor) and pp == PatchProcessor.from_hf(QWEN2_VL_REAL, None)
    assert image_processor_from_hf(QWEN2_VL_REAL, {}, image_seq_len=64) == pp  # ignored for patches
    tp = image_processor_from_hf(TILE_CFG, {"image_seq_len": 64}, image_seq_len=64)
    assert isinstance(tp, TileProcessor) and tp == TileProcessor.from_hf(TILE_CFG, None, image_seq_len=64)
    with pytest.raises(FrontendError, match="image_seq_len") as info:
        image_processor_from_hf(TILE_CFG, None, image_seq_len=None)
    assert info.value.kind is ErrorKind.VALIDATION
    with pytest.raises(FrontendError, match="'image_processor_type'") as info:
        image_processor_from_hf({"image_processor_type": "SiglipImageProcessor"}, None, image_seq_len=4)
    assert "Qwen2VLImageProcessor" in str(info.value) and "Idefics3ImageProcessor" in str(info.value)


def test_image_processor_from_hf_without_a_type():
    untyped = {k: v for k, v in QWEN2_VL_REAL.items() if k != "image_processor_type"}
    assert isinstance(image_processor_from_hf(untyped, None, image_seq_len=None), PatchProcessor)
    bare = {k: v for k, v in untyped.items() if k != "processor_class"}
    assert isinstance(image_processor_from_hf(bare, {"processor_class": "Qwen2_5_VLProcessor"},
                                              image_seq_len=None), PatchProcessor)
    assert isinstance(image_processor_from_hf({}, {"image_processor": QWEN2_VL_REAL}, image_seq_len=None),
                      PatchProcessor)
    assert isinstance(image_processor_from_hf({}, None, image_seq_len=9), TileProcessor)  # as before
    assert isinstance(image_processor_from_hf({"processor_class": "Idefics3Processor"}, None, image_seq_len=9),
                      TileProcessor)


def test_image_processor_from_dict_dispatch():
    tp = TileProcessor.from_hf(TILE_CFG, None, image_seq_len=64)
    pp = PatchProcessor.from_hf(SMALL_B, None)
    td, pd = json.loads(json.dumps(tp.to_dict())), json.loads(json.dumps(pp.to_dict()))
    assert td["kind"] == "tiles" and pd["kind"] == "patches"
    assert image_processor_from_dict(td) == tp and image_processor_from_dict(pd) == pp
    old = {k: v for k, v in td.items() if k != "kind"}  # what flared wrote before patch processors
    assert image_processor_from_dict(old) == tp and TileProcessor.from_dict(old) == tp
    with pytest.raises(FrontendError, match="kind"):
        TileProcessor.from_dict(pd)
    with pytest.raises(FrontendError, match="'video'"):
        image_processor_from_dict(dict(pd, kind="video"))
    with pytest.raises(FrontendError, match="JSON object"):
        image_processor_from_dict([pd])
