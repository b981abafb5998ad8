"""Llama 4's image preparation (transformers' ``Llama4ImageProcessor`` as ``Llama4Processor`` calls it) and the
prompt text for one image.

The image goes onto a canvas of up to ``max_patches`` square tiles (16 of 336 pixels): among the canvases of 1 to
16 tiles (every rows x columns with that product), the one that needs the least upscaling, or failing any, the
least downscaling, of the whole image without distortion, the smallest of equals (``best_canvas``); the image is
resized keeping its aspect to fit it (never upscaled past one tile unless ``resize_to_max_canvas``), padded with
black to it on the right and bottom, and cut into its tiles row by row; more than one tile adds a global tile, the
whole image squashed to one. Resizing is torchvision's on uint8 tensors, which transformers' image processor runs:
an antialiased bilinear interpolation of the uint8 image itself (native uint8 resampling, as torchvision uses on
an AVX2 CPU); rescaling and normalizing are in bfloat16, as Meta's code does them. ``pixel_values`` is
[tiles, 3, 336, 336].

The chat template's ``<|image|>`` becomes ``<|image_start|>``, each tile's ``<|patch|>`` x 144 (the tower's rows
a tile) with ``<|tile_x_separator|>`` between a row's tiles and ``<|tile_y_separator|>`` after each row, then
``<|image|>`` and the global tile's 144, ``<|image_end|>``; one tile: ``<|image_start|><|image|>``, its 144,
``<|image_end|>``. The tower's rows replace the ``<|patch|>`` tokens in order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import numpy as np

from flared.frontend.images import (_LLAMA4_PROCESSOR_TYPES, BILINEAR, DecodedImage, PreparedImage,
                                    _check_pixel_settings, _check_type, _error, _field_error, _flag, _hf_config,
                                    _pixel_settings, _positive_int, _Processor)
MAX_TILES = 64  # max_patches at most (the released configs: 16)
_TOKENS = dict(image_token="<|image|>", start_token="<|image_start|>", end_token="<|image_end|>",
               patch_token="<|patch|>", tile_x_token="<|tile_x_separator|>", tile_y_token="<|tile_y_separator|>")


@lru_cache(maxsize=8)
def canvases(max_tiles: int, tile: int) -> tuple[tuple[int, int], ...]:
    """(height, width) in pixels of every canvas of 1 to ``max_tiles`` tiles, in transformers'
    find_supported_resolutions order (by aspect first seen, from the most tiles down)."""
    by_aspect: dict[float, list[tuple[int, int]]] = {}
    for count in range(max_tiles, 0, -1):
        factors = sorted({f for i in range(1, math.isqrt(count) + 1) if count % i == 0 for f in (i, count // i)})
        for rows in factors:
            by_aspect.setdefault(rows / (count // rows), []).append((rows, count // rows))
    return tuple((rows * tile, cols * tile) for pairs in by_aspect.values() for rows, cols in pairs)


def best_canvas(height: int, width: int, max_tiles: int, tile: int, to_max: bool = False):
    """transformers' get_best_fit: the canvas (a [height, width] int64 tensor) an image is fit onto. The scales are
    float32 tensors, as there: ties are decided as they decide them."""
    import torch

    options = torch.tensor(canvases(max_tiles, tile))
    scale_h, scale_w = options[:, 0] / height, options[:, 1] / width
    scales = torch.where(scale_h > scale_w, scale_w, scale_h)
    up = scales[scales >= 1]
    if len(up) > 0:
        chosen = torch.max(up) if to_max else torch.min(up)
    else:
        chosen = torch.max(scales[scales < 1])
    fits = options[scales == chosen]
    return fits[torch.argmin(fits[:, 0] * fits[:, 1])] if len(fits) > 1 else fits[0]


def _fit_without_distortion(size, target):
    """transformers' get_max_res_without_distortion, operand for operand (``target`` may hold 0-d tensors: the
    arithmetic then is theirs too)."""
    (height, width), (target_height, target_width) = size, target
    scale_w, scale_h = target_width / width, target_height / height
    if scale_w < scale_h:
        return min(math.floor(height * scale_w), target_height), target_width
    return target_height, min(math.floor(width * scale_h), target_width)


@dataclass(frozen=True, kw_only=True)
class Llama4TileProcessor(_Processor):
    kind: ClassVar[str] = "llama4_tiles"  # to_dict's "kind" (image_processor_from_dict dispatches on it)
    options: ClassVar[tuple[str, ...]] = ("max_patches",)  # (vLLM's mm_processor_kwargs it reads)
    label: ClassVar[str] = "Llama 4 tile processor"
    identity_tag: ClassVar[bytes] = b"flared.llama4-tile-processor.v1\0"

    tile: int  # size.height = size.width
    max_patches: int  # tiles a canvas holds at most
    patch_size: int  # the tower's patch, for the prompt's count
    downsample_ratio: int  # patches a row (1 / pixel_shuffle_ratio^2)
    resize_to_max_canvas: bool = False
    image_token: str = _TOKENS["image_token"]
    start_token: str = _TOKENS["start_token"]
    end_token: str = _TOKENS["end_token"]
    patch_token: str = _TOKENS["patch_token"]
    tile_x_token: str = _TOKENS["tile_x_token"]
    tile_y_token: str = _TOKENS["tile_y_token"]

    def __post_init__(self):
        for name in ("tile", "max_patches", "patch_size", "downsample_ratio"):
            _positive_int(name, getattr(self, name))
        if self.max_patches > MAX_TILES:
            raise _field_error("max_patches", self.max_patches, f"at most {MAX_TILES}")
        if self.tile % self.patch_size or (self.tile // self.patch_size) ** 2 % self.downsample_ratio:
            raise _field_error("patch_size", self.patch_size, f"a divisor of the {self.tile}-pixel tile whose patches "
                                                              f"the downsample ratio {self.downsample_ratio} divides")
        _flag("resize_to_max_canvas", self.resize_to_max_canvas)
        _check_pixel_settings(self)
        if not self.do_resize:
            raise _field_error("do_resize", self.do_resize, "true (Llama 4 always resizes onto its canvases)")
        for name in _TOKENS:
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise _field_error(name, getattr(self, name), "a non-empty string")

    @classmethod
    def from_hf(cls, preprocessor_config: dict, processor_config: dict | None) -> Llama4TileProcessor:
        """From a Hugging Face ``preprocessor_config.json`` (and ``processor_config.json``: its ``patch_size``,
        ``pixel_shuffle_ratio`` and tokens), with transformers' Llama 4 defaults for missing fields."""
        cfg, proc = _hf_config(preprocessor_config, processor_config)
        _check_type(cfg, _LLAMA4_PROCESSOR_TYPES)
        size = cfg.get("size", {"height": 336, "width": 336})
        if not isinstance(size, dict) or size.get("height") != size.get("width"):
            raise _field_error("size", size, "a square {\"height\", \"width\"}")
        ratio = proc.get("pixel_shuffle_ratio", 0.5)
        if not isinstance(ratio, (int, float)) or ratio <= 0:
            raise _field_error("pixel_shuffle_ratio", ratio, "a positive number")
        tokens = {name: proc.get(theirs, _TOKENS[name]) for name, theirs in (
            ("image_token", "fake_image_token"), ("start_token", "start_of_image_token"),
            ("end_token", "end_of_image_token"), ("patch_token", "patch_token"),
            ("tile_x_token", "tile_x_separator_token"), ("tile_y_token", "tile_y_separator_token"))}
        return cls(tile=size.get("height"), max_patches=cfg.get("max_patches", 16),
                   resize_to_max_canvas=cfg.get("resize_to_max_canvas", False),
                   patch_size=proc.get("patch_size", 14), downsample_ratio=int(round(1.0 / ratio ** 2)),
                   **_pixel_settings(cfg, BILINEAR, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)), **tokens)

    @property
    def tokens_per_tile(self) -> int:
        return (self.tile // self.patch_size) ** 2 // self.downsample_ratio

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, columns) of tiles a width x height image is cut into."""
        canvas = best_canvas(height, width, self.max_patches, self.tile, self.resize_to_max_canvas)
        return int(canvas[0]) // self.tile, int(canvas[1]) // self.tile

    def num_tiles(self, width: int, height: int) -> int:
        rows, cols = self.grid(width, height)
        return rows * cols + 1 if rows * cols > 1 else 1

    def num_image_tokens_for(self, width: int, height: int) -> int:
        return self.num_tiles(width, height) * self.tokens_per_tile

    def prompt(self, rows: int, cols: int) -> str:
        """The text for one image cut into rows x cols tiles (transformers' Llama4Processor._prompt_split_image)."""
        patches = self.patch_token * self.tokens_per_tile
        text = self.start_token
        if rows * cols > 1:
            line = self.tile_x_token.join([patches] * cols) + self.tile_y_token
            text += line * rows
        return f"{text}{self.image_token}{patches}{self.end_token}"

    def _resize(self, pixels, height: int, width: int):
        """[n, 3, H, W] uint8 -> [n, 3, height, width] uint8: torchvision's antialiased resize of a uint8 tensor."""
        import torch.nn.functional as F

        mode = {BILINEAR: "bilinear", 3: "bicubic"}.get(self.resample)
        if mode is None:
            raise _error("a Llama 4 image processor resamples BILINEAR or BICUBIC")
        return F.interpolate(pixels, size=[int(height), int(width)], mode=mode, align_corners=False, antialias=True)

    def _normalize(self, pixels):
        """uint8 -> bfloat16, rescaled and normalized in bfloat16 (transformers' Llama 4 rescale_and_normalize, and
        torchvision's normalize: mean and std as bfloat16 tensors)."""
        import torch

        x = pixels.to(torch.bfloat16)
        if self.do_rescale:
            x = x * self.rescale_factor
        if self.do_normalize:
            mean = torch.as_tensor(self.image_mean, dtype=x.dtype).view(-1, 1, 1)
            std = torch.as_tensor(self.image_std, dtype=x.dtype).view(-1, 1, 1)
            x = x.sub(mean).div_(std)
        return x

    def prepare(self, image: DecodedImage) -> PreparedImage:
        import torch
        import torch.nn.functional as F

        im = self._rgb(image)
        pixels = torch.from_numpy(np.array(im)).permute(2, 0, 1).contiguous()[None]  # [1, 3, H, W] uint8
        height, width = im.height, im.width
        canvas = best_canvas(height, width, self.max_patches, self.tile, self.resize_to_max_canvas)
        target = canvas
        if not self.resize_to_max_canvas:  # (upscaled no further than one tile)
            target = (min(max(height, self.tile), canvas[0]), min(max(width, self.tile), canvas[1]))
        new_height, new_width = _fit_without_distortion((height, width), target)
        resized = self._resize(pixels, max(new_height, 1), max(new_width, 1))
        padded = F.pad(resized, (0, int(canvas[1]) - resized.shape[-1], 0, int(canvas[0]) - resized.shape[-2]))
        rows, cols = int(canvas[0]) // self.tile, int(canvas[1]) // self.tile
        x = self._normalize(padded)[0]  # [3, rows t, cols t]
        t = self.tile
        tiles = x.view(3, rows, t, cols, t).permute(1, 3, 0, 2, 4).reshape(rows * cols, 3, t, t)
        if rows * cols > 1:
            tiles = torch.cat([tiles, self._normalize(self._resize(pixels, t, t))])
        n = rows * cols + (rows * cols > 1)
        return PreparedImage(pixel_values=np.ascontiguousarray(tiles.float().numpy()), rows=rows if n > 1 else 0,
                             cols=cols if n > 1 else 0, prompt=self.prompt(rows, cols),
                             num_image_tokens=n * self.tokens_per_tile, identity=self._identity(image))
