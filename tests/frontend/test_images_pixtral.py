"""Pixtral-12B / Mistral3 image preparation (flared.frontend.images.PixtralProcessor) and the processor dispatch.

Parity: the same PIL image goes to transformers' ``PixtralImageProcessorPil`` -- driven by transformers' own
``PixtralProcessor._process_images`` (which hands the image processor ``patch_size * spatial_merge_size``) and
``replace_image_token`` on a processor made without a tokenizer -- and to ``PixtralProcessor.prepare`` (through
``DecodedImage.from_pil``). pixel_values must agree bit for bit, and the prompt string exactly.
"""

from __future__ import annotations

import importlib
import inspect
import io
import json
import sys
import types
from functools import lru_cache

import numpy as np
import pytest
from flared_testing.vision import gradient as _smooth
from flared_testing.vision import mode_images
from flared_testing.vision import noise_rgb as _rgb
from PIL import Image

from flared.errors import ErrorKind, FrontendError
from flared.frontend.images import (
    DecodedImage,
    PatchProcessor,
    PixtralProcessor,
    PreparedImage,
    TileProcessor,
    decode_image,
    image_processor_from_dict,
    image_processor_from_hf,
)

pytest.importorskip("transformers")

from transformers.image_utils import ChannelDimension  # noqa: E402
from transformers.models.pixtral import image_processing_pil_pixtral as hf_pil  # noqa: E402
from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil  # noqa: E402

# ----------------------------------------------------------------------------------------------- helpers


@lru_cache(maxsize=None)
def _hf_processor_class():
    """transformers' PixtralProcessor class. Its module imports ``get_resize_output_image_size`` from the
    torchvision image processor module; without torchvision, that one name is lent from the PIL module (the
    same function) for the import, and the two module entries this adds are taken out of sys.modules again."""
    name = "transformers.models.pixtral.processing_pixtral"
    try:
        return importlib.import_module(name).PixtralProcessor
    except ImportError:
        pass
    tv_name = "transformers.models.pixtral.image_processing_pixtral"
    stub = types.ModuleType(tv_name)
    stub.get_resize_output_image_size = hf_pil.get_resize_output_image_size
    saved = {k: sys.modules.get(k) for k in (name, tv_name)}
    sys.modules[tv_name] = stub
    try:
        sys.modules.pop(name, None)
        return importlib.import_module(name).PixtralProcessor
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def _hf_processor(cfg: dict, proc_cfg: dict | None):
    """transformers' PixtralProcessor without a tokenizer (its __init__ only wants one for token ids), holding
    the PIL image processor built the way from_pretrained builds it from the JSON."""
    cls = _hf_processor_class()
    proc_cfg = proc_cfg or {}
    sig = inspect.signature(cls.__init__).parameters
    p = cls.__new__(cls)
    p.image_processor = PixtralImageProcessorPil.from_dict(dict(cfg))
    p.patch_size = proc_cfg.get("patch_size", sig["patch_size"].default)
    p.spatial_merge_size = proc_cfg.get("spatial_merge_size", sig["spatial_merge_size"].default)
    p.image_token = proc_cfg.get("image_token", sig["image_token"].default)
    p.image_break_token = proc_cfg.get("image_break_token", sig["image_break_token"].default)
    p.image_end_token = proc_cfg.get("image_end_token", sig["image_end_token"].default)
    return p








# mistral-community/pixtral-12b preprocessor_config.json and processor_config.json
PIXTRAL_12B = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_processor_type": "PixtralImageProcessor",
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "patch_size": {"height": 16, "width": 16},
    "processor_class": "PixtralProcessor",
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "size": {"longest_edge": 1024},
}
PIXTRAL_12B_PROC = {"image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]", "image_token": "[IMG]",
                    "patch_size": 16, "processor_class": "PixtralProcessor"}
# mistralai/Mistral-Small-3.1-24B-Instruct-2503 (the fields that matter)
MISTRAL3 = dict(PIXTRAL_12B, image_processor_type="PixtralImageProcessorFast", patch_size=14,
                size={"longest_edge": 1540}, do_center_crop=None, crop_size=None)
MISTRAL3_PROC = dict(PIXTRAL_12B_PROC, patch_size=14, spatial_merge_size=2)

# small settings: (preprocessor_config, processor_config)
SMALL = {
    "a": (dict(PIXTRAL_12B, patch_size={"height": 8, "width": 8}, size={"longest_edge": 64}),
          {"patch_size": 8}),  # merge 1 (spatial_merge_size absent), BICUBIC
    "b": ({"image_processor_type": "PixtralImageProcessorPil", "patch_size": 8, "size": {"longest_edge": 96},
           "resample": 1, "image_mean": 0.5, "image_std": 0.25},
          {"patch_size": 8, "spatial_merge_size": 2, "image_token": "<i>", "image_break_token": "<b>",
           "image_end_token": "<e>"}),  # merge 2: unit 16, LANCZOS, scalar mean/std, other tokens
    "c": ({"image_processor_type": "PixtralImageProcessorFast", "patch_size": 16, "size": {"longest_edge": 96},
           "resample": 2}, None),  # no processor config: merge 1, the image processor's patch size, BILINEAR
    "d": (dict(MISTRAL3, size={"longest_edge": 100}), MISTRAL3_PROC),  # unit 28, longest edge not a multiple
}

GEOMETRIES = [
    (1, 1), (2, 1), (1, 2), (5, 3), (17, 9), (9, 17), (15, 16), (16, 16), (27, 29), (63, 63), (64, 64),  # small
    (64, 10), (65, 65), (96, 95), (97, 33), (100, 100), (101, 7),  # around the longest edges
    (200, 100), (100, 200), (333, 101), (1000, 999), (999, 1000), (640, 480), (1234, 4321),  # scaled down
    (500, 8), (8, 500), (300, 5), (700, 11), (96, 2), (1, 64),  # thin
]


def _check_parity(cfg: dict, proc_cfg: dict | None, pil: Image.Image, ref=None) -> PreparedImage:
    ref = ref or _hf_processor(cfg, proc_cfg)
    out, replacements = ref._process_images([pil])
    want = np.asarray(out["pixel_values"])
    (want_h, want_w), = [tuple(int(v) for v in s) for s in out["image_sizes"]]
    pp = PixtralProcessor.from_hf(cfg, proc_cfg)
    got = pp.prepare(DecodedImage.from_pil(pil))
    assert got.pixel_values.dtype == np.float32 and got.pixel_values.flags.c_contiguous
    assert want.shape == (1, 3, want_h, want_w), (pil.size, want.shape)
    assert got.pixel_values.shape == want.shape[1:], (pil.size, got.pixel_values.shape, want.shape)
    np.testing.assert_array_equal(got.pixel_values, want[0])
    p, m = pp.patch_size, pp.merge_size
    assert got.grid == (1, want_h // p, want_w // p) == pp.grid(*pil.size)
    assert want_h % (p * m) == 0 == want_w % (p * m)
    assert got.prompt == replacements[0], (pil.size, got.prompt, replacements[0])
    assert (got.rows, got.cols) == (want_h // p // m, want_w // p // m) == pp.lines(*pil.size)
    assert got.num_image_tokens == got.rows * got.cols == got.prompt.count(pp.image_token)
    assert got.num_image_tokens == pp.num_image_tokens_for(*pil.size)
    assert got.prompt.count(pp.break_token) == got.rows - 1 and got.prompt.endswith(pp.end_token)
    assert len(got.identity) == 32
    return got


# -------------------------------------------------------------------------------------- preprocessing parity

@pytest.mark.parametrize("name", sorted(SMALL))
def test_geometries_match_transformers(name):
    cfg, proc_cfg = SMALL[name]
    ref = _hf_processor(cfg, proc_cfg)
    for w, h in GEOMETRIES:
        _check_parity(cfg, proc_cfg, _rgb(w, h), ref)


def test_resize_rule():
    pp = PixtralProcessor.from_hf(*SMALL["a"])  # unit 8, longest edge 64
    assert pp.grid(1, 1) == (1, 1, 1) and pp.grid(17, 9) == (1, 2, 3)  # small: only rounded up to the unit
    assert pp.grid(64, 64) == (1, 8, 8) and pp.grid(65, 65) == (1, 8, 8) and pp.grid(1000, 999) == (1, 8, 8)
    assert pp.grid(200, 100) == (1, 4, 8) and pp.grid(500, 8) == (1, 1, 8)
    pp = PixtralProcessor.from_hf(*SMALL["b"])  # patch 8, merge 2: unit 16, longest edge 96
    assert pp.grid(17, 9) == (1, 2, 4) and pp.lines(17, 9) == (1, 2)
    assert pp.grid(200, 100) == (1, 6, 12) and pp.lines(200, 100) == (3, 6)  # 96 x 48: whole units already
    assert pp.grid(333, 101) == (1, 4, 12) and pp.lines(333, 101) == (2, 6)  # 96 x 29 -> 96 x 32




def test_modes_match_transformers():
    images = mode_images()
    assert images["P"].mode == "P" and "transparency" not in images["P"].info
    assert images["P+transparency"].mode == "P" and "transparency" in images["P+transparency"].info
    for name in ("a", "b", "d"):
        cfg, proc_cfg = SMALL[name]
        ref = _hf_processor(cfg, proc_cfg)
        for mode, im in images.items():
            assert im.mode == mode.split("+")[0], mode
            _check_parity(cfg, proc_cfg, im, ref)


def test_decoded_png_and_jpeg_match_transformers():
    cfg, proc_cfg = SMALL["b"]
    pp = PixtralProcessor.from_hf(cfg, proc_cfg)
    ref = _hf_processor(cfg, proc_cfg)
    for fmt in ("PNG", "JPEG"):
        buf = io.BytesIO()
        _smooth(150, 70).save(buf, fmt)
        got = pp.prepare(decode_image(buf.getvalue()))
        out, replacements = ref._process_images([Image.open(io.BytesIO(buf.getvalue()))])
        np.testing.assert_array_equal(got.pixel_values, np.asarray(out["pixel_values"])[0])
        assert got.prompt == replacements[0] and got.num_image_tokens == 6 * 3


def test_real_pixtral_12b_settings_on_small_images():
    ref = _hf_processor(PIXTRAL_12B, PIXTRAL_12B_PROC)
    got = _check_parity(PIXTRAL_12B, PIXTRAL_12B_PROC, _rgb(40, 30), ref)
    assert got.pixel_values.shape == (3, 32, 48) and got.grid == (1, 2, 3) and (got.rows, got.cols) == (2, 3)
    assert got.prompt == "[IMG][IMG][IMG][IMG_BREAK][IMG][IMG][IMG][IMG_END]" and got.num_image_tokens == 6
    got = _check_parity(PIXTRAL_12B, PIXTRAL_12B_PROC, _rgb(130, 17), ref)
    assert got.grid == (1, 2, 9) and got.num_image_tokens == 18
    # the class defaults (configs without any of these fields) are Pixtral-12B's
    _check_parity({}, None, _rgb(45, 70))
    assert PixtralProcessor.from_hf({}, None) == PixtralProcessor.from_hf(PIXTRAL_12B, PIXTRAL_12B_PROC)


def test_real_mistral3_settings_on_small_images():
    ref = _hf_processor(MISTRAL3, MISTRAL3_PROC)
    got = _check_parity(MISTRAL3, MISTRAL3_PROC, _rgb(40, 30), ref)  # 56 x 56: 4 x 4 patches, 2 x 2 tokens
    assert got.pixel_values.shape == (3, 56, 56) and got.grid == (1, 4, 4) and (got.rows, got.cols) == (2, 2)
    assert got.prompt == "[IMG][IMG][IMG_BREAK][IMG][IMG][IMG_END]"
    got = _check_parity(MISTRAL3, MISTRAL3_PROC, _rgb(90, 29), ref)
    assert got.grid == (1, 4, 8) and (got.rows, got.cols) == (2, 4) and got.num_image_tokens == 8
    pp = PixtralProcessor.from_hf(MISTRAL3, MISTRAL3_PROC)
    assert (pp.patch_size, pp.merge_size, pp.longest_edge, pp.factor) == (14, 2, 1540, 28)
    assert pp.lines(4000, 3000) == (42, 55)  # 1540 x 1155 -> 1540 x 1176


def test_merge_sizes():
    cfg = dict(PIXTRAL_12B, patch_size=8, size={"longest_edge": 96})
    im = _rgb(77, 50)
    one = _check_parity(cfg, {"patch_size": 8}, im)
    two = _check_parity(cfg, {"patch_size": 8, "spatial_merge_size": 2}, im)
    three = _check_parity(cfg, {"patch_size": 8, "spatial_merge_size": 3}, im)
    assert one.pixel_values.shape == (3, 56, 80) and (one.rows, one.cols) == (7, 10) and one.grid == (1, 7, 10)
    assert two.pixel_values.shape == (3, 64, 80) and (two.rows, two.cols) == (4, 5) and two.grid == (1, 8, 10)
    assert three.pixel_values.shape == (3, 72, 96) and (three.rows, three.cols) == (3, 4)
    assert len({one.identity, two.identity, three.identity}) == 3


def _hf_resized(pp: PixtralProcessor, width: int, height: int) -> tuple[int, int]:
    """transformers' output size for a width x height image, from a zero-stride array (no pixels)."""
    fake = np.broadcast_to(np.zeros((), dtype=np.uint8), (height, width, 3))
    return hf_pil.get_resize_output_image_size(fake, size=(pp.longest_edge, pp.longest_edge),
                                               patch_size=(pp.factor, pp.factor),
                                               input_data_format=ChannelDimension.LAST)


def test_num_image_tokens_match_transformers_over_many_sizes():
    rng = np.random.default_rng(5)
    sizes = [(int(w), int(h)) for w, h in rng.integers(1, 9000, (400, 2))]
    sizes += [(int(w), int(h)) for w, h in rng.integers(1, 300, (300, 2))]
    sizes += [(k * 14 + d, j * 28 + e) for k in range(1, 130, 7) for j in range(1, 70, 5)
              for d in (-1, 0, 1) for e in (-1, 0, 1)]
    sizes += [(1540, 1), (1541, 1), (3080, 2), (3081, 2), (1024, 1), (1025, 1), (2049, 2), (9000, 5)]
    configs = [(PIXTRAL_12B, PIXTRAL_12B_PROC), (MISTRAL3, MISTRAL3_PROC), *SMALL.values()]
    thin = 0
    for cfg, proc_cfg in configs:
        pp = PixtralProcessor.from_hf(cfg, proc_cfg)
        for w, h in sizes:
            rh, rw = _hf_resized(pp, w, h)
            if rh == 0 or rw == 0:  # transformers' resize fails on these
                thin += 1
                with pytest.raises(FrontendError, match="less than one pixel"):
                    pp.num_image_tokens_for(w, h)
                continue
            assert pp.grid(w, h) == (1, rh // pp.patch_size, rw // pp.patch_size), (cfg, w, h)
            assert pp.lines(w, h) == (rh // pp.factor, rw // pp.factor), (cfg, w, h)
            assert pp.num_image_tokens_for(w, h) == (rh // pp.factor) * (rw // pp.factor)
            assert max(rh, rw) <= -(-pp.longest_edge // pp.factor) * pp.factor
    assert thin > 0


def test_too_thin_refused_like_transformers():
    for name in ("a", "c"):
        cfg, proc_cfg = SMALL[name]
        ref = _hf_processor(cfg, proc_cfg)
        pp = PixtralProcessor.from_hf(cfg, proc_cfg)
        for w, h in [(65, 1), (1, 97), (200, 1), (1000, 5), (3, 1000)]:
            if 0 not in _hf_resized(pp, w, h):
                continue
            with pytest.raises(ValueError):
                ref._process_images([_rgb(w, h)])
            with pytest.raises(FrontendError, match="less than one pixel") as info:
                pp.prepare(DecodedImage.from_pil(_rgb(w, h)))
            assert info.value.kind is ErrorKind.VALIDATION and f"{w}x{h}" in str(info.value)
    pp = PixtralProcessor.from_hf(*SMALL["a"])
    with pytest.raises(FrontendError):
        pp.grid(1000, 5)


def test_flags_off_match_transformers():
    im = _rgb(70, 40)
    for flags in ({"do_rescale": False}, {"do_normalize": False}, {"do_rescale": False, "do_normalize": False}):
        for name in ("a", "b"):
            cfg, proc_cfg = SMALL[name]
            _check_parity(dict(cfg, **flags), proc_cfg, im)


def test_without_resize_sizes_must_be_whole_units():
    cfg, proc_cfg = SMALL["b"]  # unit 16
    cfg = dict(cfg, do_resize=False)
    got = _check_parity(cfg, proc_cfg, _rgb(48, 32))
    assert got.grid == (1, 4, 6) and (got.rows, got.cols) == (2, 3)
    pp = PixtralProcessor.from_hf(cfg, proc_cfg)
    with pytest.raises(FrontendError, match="multiples of 16") as info:
        pp.prepare(DecodedImage.from_pil(_rgb(48, 40)))
    assert info.value.kind is ErrorKind.VALIDATION
    with pytest.raises(FrontendError, match="multiples of 16"):
        pp.num_image_tokens_for(8, 16)


def test_pixel_layout():
    """pixel_values is the image itself, channel first, when nothing is resized or scaled."""
    cfg = dict(SMALL["a"][0], do_resize=False, do_rescale=False, do_normalize=False)
    pp = PixtralProcessor.from_hf(cfg, {"patch_size": 8})
    arr = np.random.default_rng(3).integers(0, 256, (24, 40, 3), dtype=np.uint8)
    got = pp.prepare(DecodedImage.from_pil(Image.fromarray(arr)))
    np.testing.assert_array_equal(got.pixel_values, arr.transpose(2, 0, 1).astype(np.float32))
    assert got.grid == (1, 3, 5) and got.prompt == ("[IMG]" * 5 + "[IMG_BREAK]") * 2 + "[IMG]" * 5 + "[IMG_END]"


def test_prompt():
    pp = PixtralProcessor.from_hf(*SMALL["b"])
    assert pp.prompt(1, 1) == "<i><e>"
    assert pp.prompt(1, 3) == "<i><i><i><e>"
    assert pp.prompt(3, 1) == "<i><b><i><b><i><e>"
    assert pp.prompt(2, 2) == "<i><i><b><i><i><e>"


# ------------------------------------------------------------------------------------------ configuration

def test_from_hf_defaults_are_transformers_defaults():
    ref = PixtralImageProcessorPil()
    sig = inspect.signature(_hf_processor_class().__init__).parameters
    pp = PixtralProcessor.from_hf({}, None)
    assert pp.patch_size == ref.patch_size["height"] == ref.patch_size["width"] == sig["patch_size"].default == 16
    assert pp.longest_edge == ref.size["longest_edge"] == 1024
    assert pp.merge_size == sig["spatial_merge_size"].default == 1
    assert pp.resample == int(ref.resample) == Image.Resampling.BICUBIC
    assert pp.image_mean == tuple(ref.image_mean) and pp.image_std == tuple(ref.image_std)
    assert pp.rescale_factor == ref.rescale_factor
    assert (pp.do_resize, pp.do_rescale, pp.do_normalize) == (ref.do_resize, ref.do_rescale, ref.do_normalize)
    assert (pp.image_token, pp.break_token, pp.end_token) == (
        sig["image_token"].default, sig["image_break_token"].default, sig["image_end_token"].default)
    assert PixtralProcessor.kind == "pixtral"


def test_from_hf_reads_the_processor_config():
    cfg = dict(PIXTRAL_12B, patch_size=14)
    assert PixtralProcessor.from_hf(cfg, None).patch_size == 14  # no processor config: the image processor's
    assert PixtralProcessor.from_hf(cfg, {}).patch_size == 14
    pp = PixtralProcessor.from_hf(cfg, {"patch_size": 16, "spatial_merge_size": 2, "image_token": "<I>",
                                        "image_break_token": "<B>", "image_end_token": "<E>"})
    assert (pp.patch_size, pp.merge_size, pp.factor) == (16, 2, 32)  # the processor's wins, as in transformers
    assert (pp.image_token, pp.break_token, pp.end_token) == ("<I>", "<B>", "<E>")
    _check_parity(cfg, {"patch_size": 16, "spatial_merge_size": 2}, _rgb(50, 40))
    nested = PixtralProcessor.from_hf({}, dict(MISTRAL3_PROC, image_processor=MISTRAL3))
    assert nested == PixtralProcessor.from_hf(MISTRAL3, MISTRAL3_PROC)
    assert PixtralProcessor.from_hf(dict(MISTRAL3, do_center_crop=False), MISTRAL3_PROC) == nested


@pytest.mark.parametrize("patch, proc_patch, field", [
    ({"patch_size": 0}, {}, "patch_size"),
    ({"patch_size": {"height": 14, "width": 16}}, {}, "patch_size"),
    ({"patch_size": {"height": 14}}, {}, "patch_size"),
    ({"patch_size": "14"}, {}, "patch_size"),
    ({}, {"patch_size": -14}, "patch_size"),
    ({}, {"spatial_merge_size": 0}, "spatial_merge_size"),
    ({}, {"spatial_merge_size": 2.0}, "spatial_merge_size"),
    ({}, {"image_token": ""}, "image_token"),
    ({}, {"image_break_token": None}, "break_token"),
    ({}, {"image_end_token": "[IMG]"}, "end_token"),
    ({"size": {"height": 64, "width": 64}}, {}, "size"),
    ({"size": {"longest_edge": 0}}, {}, "size.longest_edge"),
    ({"size": 512}, {}, "size"),
    ({"image_std": [0.5, 0.0, 0.5]}, {}, "image_std"),
    ({"image_mean": [0.5, 0.5]}, {}, "image_mean"),
    ({"resample": 9}, {}, "resample"),
    ({"do_resize": "yes"}, {}, "do_resize"),
    ({"do_normalize": 0}, {}, "do_normalize"),
    ({"rescale_factor": -1}, {}, "rescale_factor"),
    ({"do_center_crop": True}, {}, "do_center_crop"),
    ({"image_processor_type": "Qwen2VLImageProcessor"}, {}, "image_processor_type"),
    ({"image_processor_type": "PixtralImageProcessorSlow"}, {}, "image_processor_type"),
])
def test_from_hf_rejects_nonsense(patch, proc_patch, field):
    with pytest.raises(FrontendError) as info:
        PixtralProcessor.from_hf(dict(MISTRAL3, **patch), dict(MISTRAL3_PROC, **proc_patch))
    assert info.value.kind is ErrorKind.VALIDATION
    assert repr(field) in str(info.value), str(info.value)


def test_accepted_type_names():
    want = PixtralProcessor.from_hf(PIXTRAL_12B, None)
    for name in ("PixtralImageProcessor", "PixtralImageProcessorFast", "PixtralImageProcessorPil"):
        assert PixtralProcessor.from_hf(dict(PIXTRAL_12B, image_processor_type=name), None) == want
    no_type = {k: v for k, v in PIXTRAL_12B.items() if k != "image_processor_type"}
    assert PixtralProcessor.from_hf(no_type, None) == want


def test_to_dict_round_trip_and_identity():
    pp = PixtralProcessor.from_hf(MISTRAL3, MISTRAL3_PROC)
    d = json.loads(json.dumps(pp.to_dict()))
    assert d["kind"] == "pixtral" and PixtralProcessor.from_dict(d) == pp
    assert d["merge_size"] == 2 and d["patch_size"] == 14 and d["break_token"] == "[IMG_BREAK]"
    assert PixtralProcessor.from_dict({k: v for k, v in d.items() if k != "kind"}) == pp
    with pytest.raises(FrontendError, match="bogus"):
        PixtralProcessor.from_dict(dict(d, bogus=1))
    with pytest.raises(FrontendError, match="incomplete"):
        PixtralProcessor.from_dict({k: v for k, v in d.items() if k != "merge_size"})
    with pytest.raises(FrontendError, match="kind"):
        PixtralProcessor.from_dict(dict(d, kind="patches"))
    with pytest.raises(FrontendError, match="'longest_edge'"):
        PixtralProcessor.from_dict(dict(d, longest_edge=-5))

    small = PixtralProcessor.from_hf(*SMALL["a"])
    a, b = DecodedImage.from_pil(_rgb(20, 10)), DecodedImage.from_pil(_rgb(20, 10, seed=9))
    ids = {small.prepare(a).identity, small.prepare(b).identity,
           PixtralProcessor.from_dict(dict(small.to_dict(), resample=2)).prepare(a).identity,
           PixtralProcessor.from_dict(dict(small.to_dict(), end_token="[END]")).prepare(a).identity,
           PatchProcessor.from_hf({}, None).prepare(a).identity,
           TileProcessor.from_hf({}, None, image_seq_len=4).prepare(a).identity}
    assert len(ids) == 6 and all(len(i) == 32 for i in ids)
    assert small.prepare(a).identity == PixtralProcessor.from_dict(small.to_dict()).prepare(a).identity


# ------------------------------------------------------------------------------------------------ dispatch

def test_image_processor_from_hf_dispatch():
    for cfg, proc_cfg in [(PIXTRAL_12B, PIXTRAL_12B_PROC), (MISTRAL3, MISTRAL3_PROC), *SMALL.values()]:
        want = PixtralProcessor.from_hf(cfg, proc_cfg)
        got = image_processor_from_hf(cfg, proc_cfg, image_seq_len=None)
        assert isinstance(got, PixtralProcessor) and got == want
        assert image_processor_from_hf(cfg, proc_cfg, image_seq_len=64) == want  # ignored
    untyped = {k: v for k, v in MISTRAL3.items() if k not in ("image_processor_type", "processor_class")}
    assert image_processor_from_hf(untyped, MISTRAL3_PROC, image_seq_len=None) == \
        PixtralProcessor.from_hf(MISTRAL3, MISTRAL3_PROC)  # by the processor config's processor_class
    assert isinstance(image_processor_from_hf({"processor_class": "PixtralProcessor"}, None, image_seq_len=None),
                      PixtralProcessor)
    assert image_processor_from_hf({}, dict(MISTRAL3_PROC, image_processor=MISTRAL3), image_seq_len=None) == \
        PixtralProcessor.from_hf(MISTRAL3, MISTRAL3_PROC)
    with pytest.raises(FrontendError, match="'image_processor_type'") as info:
        image_processor_from_hf({"image_processor_type": "SiglipImageProcessor"}, None, image_seq_len=4)
    assert "PixtralImageProcessor" in str(info.value) and "Qwen2VLImageProcessor" in str(info.value)


def test_image_processor_from_dict_dispatch():
    tp = TileProcessor.from_hf({}, None, image_seq_len=64)
    qp = PatchProcessor.from_hf({}, None)
    pp = PixtralProcessor.from_hf(MISTRAL3, MISTRAL3_PROC)
    for proc in (tp, qp, pp):
        assert image_processor_from_dict(json.loads(json.dumps(proc.to_dict()))) == proc
    pd = pp.to_dict()
    with pytest.raises(FrontendError, match="kind"):
        PatchProcessor.from_dict(pd)
    with pytest.raises(FrontendError, match="kind"):
        TileProcessor.from_dict(pd)
    with pytest.raises(FrontendError, match="'pixtral'"):
        image_processor_from_dict(dict(pd, kind="video"))
