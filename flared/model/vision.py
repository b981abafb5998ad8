"""The vision tower of an Idefics3-family model (SmolVLM, Idefics3): image tiles in, text embeddings out.

A vision-language checkpoint of this family is a Llama decoder (``flared.model.decoder`` runs it unchanged) plus a
SigLIP-style encoder and a connector. Every image tile (``flared.frontend.images.TileProcessor``) runs through:

    patch embedding (conv, stride = patch) + learned position embedding
    layers x [x + attn(LN1(x)); x + fc2(gelu_tanh(fc1(LN2(x))))]   bidirectional attention over the tile's patches
    post LayerNorm
    pixel shuffle (scale s: each s x s block of patches becomes one row, s*s times wider)
    projection (no bias) to the decoder's hidden size

giving ``image_seq_len = (image_size / patch_size)^2 / s^2`` rows per tile. Those rows replace the embeddings of
the prompt's image tokens, in order (``ForwardBatch.embed_rows``).

Serving layout of the tower's tensors (``vision_tensor_shapes``), stored in the core's ``vision.safetensors``:

    patch_embed.weight  [D, 3, p, p]     patch_embed.bias [D]
    pos_embed.weight    [(S/p)^2, D]
    layers.{i}.norm1.weight / .bias [D]
    layers.{i}.qkv.weight [3D, D]   layers.{i}.qkv.bias [3D]   q, k, v rows fused
    layers.{i}.o.weight [D, D]      layers.{i}.o.bias [D]
    layers.{i}.norm2.weight / .bias [D]
    layers.{i}.fc1.weight [I, D]    layers.{i}.fc1.bias [I]
    layers.{i}.fc2.weight [D, I]    layers.{i}.fc2.bias [D]
    post_norm.weight / .bias [D]
    proj.weight [hidden, D * s^2]

Rules:
- Tiles are always whole (the processor resizes every tile to image_size square), so every patch attends to every
  other and position ids are the patch's own index; a tile of another size is refused, never padded.
- Anything we cannot run exactly (another activation, a tile size the tower does not take) is a ``CoreError``
  at export or load, never approximated.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from flared.errors import CoreError, ErrorKind

# model_type of the checkpoint's config.json -> our vision family
HF_VISION_MODEL_TYPES = {"idefics3": "idefics3", "smolvlm": "idefics3"}
_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class VisionConfig:
    family: str  # "idefics3"
    hidden_size: int  # D
    intermediate_size: int  # I
    num_layers: int
    num_heads: int
    patch_size: int  # p
    image_size: int  # S: a tile's side in pixels
    layer_norm_eps: float
    hidden_act: str  # "gelu_pytorch_tanh" | "gelu"
    scale_factor: int  # pixel shuffle s
    text_hidden_size: int  # the decoder's hidden size
    image_token_id: int  # the prompt token whose embeddings the tower's rows replace

    def __post_init__(self) -> None:
        if self.family not in set(HF_VISION_MODEL_TYPES.values()):
            raise CoreError(f"vision family {self.family!r} is not supported", ErrorKind.UNSUPPORTED_MODEL)
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "patch_size", "image_size",
                     "scale_factor", "text_hidden_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise CoreError(f"vision config {name} must be a positive integer, got {value!r}")
        if not isinstance(self.image_token_id, int) or self.image_token_id < 0:
            raise CoreError(f"vision config image_token_id must be a token id, got {self.image_token_id!r}")
        if self.hidden_act not in _ACTIVATIONS:
            raise CoreError(f"vision activation {self.hidden_act!r} is not supported "
                            f"(supported: {', '.join(_ACTIVATIONS)})", ErrorKind.UNSUPPORTED_MODEL)
        if self.hidden_size % self.num_heads:
            raise CoreError(f"vision hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        side = self.image_size // self.patch_size
        if self.image_size % self.patch_size or side % self.scale_factor:
            raise CoreError(f"vision image_size {self.image_size} must be a whole number of patches "
                            f"({self.patch_size}) in blocks of scale_factor {self.scale_factor}")
        if not (isinstance(self.layer_norm_eps, float) and math.isfinite(self.layer_norm_eps)
                and self.layer_norm_eps > 0):
            raise CoreError(f"vision layer_norm_eps must be a positive number, got {self.layer_norm_eps!r}")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def image_seq_len(self) -> int:
        """Text-embedding rows one tile becomes."""
        return self.patches_per_side ** 2 // self.scale_factor ** 2

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> VisionConfig:
        if not isinstance(d, dict):
            raise CoreError(f"vision config must be an object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        if set(d) != names:
            raise CoreError(f"vision config keys {sorted(d)} are not {sorted(names)}")
        values = dict(d)
        if isinstance(values["layer_norm_eps"], int) and not isinstance(values["layer_norm_eps"], bool):
            values["layer_norm_eps"] = float(values["layer_norm_eps"])
        return cls(**values)


def vision_from_hf(hf: dict[str, Any], *, source: str = "config.json") -> VisionConfig | None:
    """The vision tower a checkpoint's config.json describes; None for a text-only model."""
    family = HF_VISION_MODEL_TYPES.get(hf.get("model_type"))
    if family is None:
        return None
    v, t = hf.get("vision_config"), hf.get("text_config")
    if not isinstance(v, dict) or not isinstance(t, dict):
        raise CoreError(f"{source}: a {hf.get('model_type')} config needs vision_config and text_config objects",
                        ErrorKind.SOURCE_FORMAT)
    if v.get("num_channels", 3) != 3:
        raise CoreError(f"{source}: vision num_channels must be 3", ErrorKind.UNSUPPORTED_MODEL)
    try:
        return VisionConfig(
            family=family,
            hidden_size=int(v.get("hidden_size", 1152)),
            intermediate_size=int(v.get("intermediate_size", 3072)),
            num_layers=int(v.get("num_hidden_layers", 12)),
            num_heads=int(v.get("num_attention_heads", 16)),
            patch_size=int(v.get("patch_size", 32)),
            image_size=int(v.get("image_size", 224)),
            layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)),
            hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")),
            scale_factor=int(hf.get("scale_factor", 2)),
            text_hidden_size=int(t["hidden_size"]),
            image_token_id=int(hf.get("image_token_id", 128257)),
        )
    except KeyError as exc:
        raise CoreError(f"{source}: missing key {exc.args[0]!r}", ErrorKind.SOURCE_FORMAT) from None
    except (TypeError, ValueError) as exc:
        raise CoreError(f"{source}: bad vision value: {exc}", ErrorKind.SOURCE_FORMAT) from None


def vision_tensor_shapes(c: VisionConfig) -> dict[str, tuple[int, ...]]:
    d, i = c.hidden_size, c.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.weight": (d, 3, c.patch_size, c.patch_size),
        "patch_embed.bias": (d,),
        "pos_embed.weight": (c.patches_per_side ** 2, d),
        "post_norm.weight": (d,),
        "post_norm.bias": (d,),
        "proj.weight": (c.text_hidden_size, d * c.scale_factor ** 2),
    }
    for n in range(c.num_layers):
        p = f"layers.{n}."
        shapes.update({p + "norm1.weight": (d,), p + "norm1.bias": (d,), p + "qkv.weight": (3 * d, d),
                       p + "qkv.bias": (3 * d,), p + "o.weight": (d, d), p + "o.bias": (d,),
                       p + "norm2.weight": (d,), p + "norm2.bias": (d,), p + "fc1.weight": (i, d),
                       p + "fc1.bias": (i,), p + "fc2.weight": (d, i), p + "fc2.bias": (d,)})
    return shapes


def check_vision_tensors(tensors: dict[str, torch.Tensor], c: VisionConfig, *, source: str) -> None:
    expected = vision_tensor_shapes(c)
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        what = f"missing {', '.join(missing[:6])}" if missing else f"unexpected {', '.join(extra[:6])}"
        raise CoreError(f"{source}: vision tensors: {what}", ErrorKind.CORE_FORMAT)
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise CoreError(f"{source}: vision tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape}",
                            ErrorKind.CORE_FORMAT)


def hf_vision_to_serving(hf: dict[str, torch.Tensor], c: VisionConfig, *, source: str) -> dict[str, torch.Tensor]:
    """The tower's tensors out of a checkpoint's (``model.vision_model.*``, ``model.connector.*``)."""
    def take(name: str) -> torch.Tensor:
        try:
            return hf[name]
        except KeyError:
            raise CoreError(f"{source}: checkpoint has no tensor {name}", ErrorKind.SOURCE_FORMAT) from None

    vm = "model.vision_model."
    out = {
        "patch_embed.weight": take(vm + "embeddings.patch_embedding.weight"),
        "patch_embed.bias": take(vm + "embeddings.patch_embedding.bias"),
        "pos_embed.weight": take(vm + "embeddings.position_embedding.weight"),
        "post_norm.weight": take(vm + "post_layernorm.weight"),
        "post_norm.bias": take(vm + "post_layernorm.bias"),
        "proj.weight": take("model.connector.modality_projection.proj.weight"),
    }
    for n in range(c.num_layers):
        hp, sp = f"{vm}encoder.layers.{n}.", f"layers.{n}."
        attn = hp + "self_attn."
        out[sp + "qkv.weight"] = torch.cat([take(f"{attn}{x}_proj.weight") for x in "qkv"], dim=0)
        out[sp + "qkv.bias"] = torch.cat([take(f"{attn}{x}_proj.bias") for x in "qkv"], dim=0)
        out[sp + "o.weight"] = take(attn + "out_proj.weight")
        out[sp + "o.bias"] = take(attn + "out_proj.bias")
        for ours, theirs in (("norm1", "layer_norm1"), ("norm2", "layer_norm2"), ("fc1", "mlp.fc1"),
                             ("fc2", "mlp.fc2")):
            out[f"{sp}{ours}.weight"] = take(f"{hp}{theirs}.weight")
            out[f"{sp}{ours}.bias"] = take(f"{hp}{theirs}.bias")
    out = {k: v.contiguous() for k, v in out.items()}
    check_vision_tensors(out, c, source=source)
    return out


class VisionEncoder:
    """The tower on one device; ``encode`` turns tiles into decoder embedding rows."""

    def __init__(self, config: VisionConfig, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        check_vision_tensors(tensors, config, source="vision tensors")
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.w = {k: v.to(device=self.device, dtype=dtype).contiguous() for k, v in tensors.items()}
        self._approximate = _ACTIVATIONS[config.hidden_act]

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, *, max_tiles: int = 8) -> torch.Tensor:
        """``pixel_values`` [tiles, 3, S, S] -> [tiles * image_seq_len, text_hidden] in the model's dtype, the
        tiles' rows in order; ``max_tiles`` tiles run at a time (bounds the activations' memory)."""
        c = self.config
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != (3, c.image_size, c.image_size):
            raise ValueError(f"tiles must be [n, 3, {c.image_size}, {c.image_size}], got {tuple(pixel_values.shape)}")
        parts = [self._tiles(pixel_values[i:i + max_tiles].to(self.device, self.dtype))
                 for i in range(0, pixel_values.shape[0], max_tiles)]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _tiles(self, x: torch.Tensor) -> torch.Tensor:
        c, w = self.config, self.w
        n = x.shape[0]
        d, heads = c.hidden_size, c.num_heads
        h = F.conv2d(x, w["patch_embed.weight"], w["patch_embed.bias"], stride=c.patch_size)  # [n, D, side, side]
        h = h.flatten(2).transpose(1, 2) + w["pos_embed.weight"]  # [n, P, D]: whole tiles, position = patch index
        patches = h.shape[1]
        for i in range(c.num_layers):
            p = f"layers.{i}."
            x1 = F.layer_norm(h, (d,), w[p + "norm1.weight"], w[p + "norm1.bias"], c.layer_norm_eps)
            qkv = F.linear(x1, w[p + "qkv.weight"], w[p + "qkv.bias"]).view(n, patches, 3, heads, d // heads)
            q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [n, heads, P, head_dim]
            attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, patches, d)
            h = h + F.linear(attn, w[p + "o.weight"], w[p + "o.bias"])
            x2 = F.layer_norm(h, (d,), w[p + "norm2.weight"], w[p + "norm2.bias"], c.layer_norm_eps)
            mid = F.gelu(F.linear(x2, w[p + "fc1.weight"], w[p + "fc1.bias"]), approximate=self._approximate)
            h = h + F.linear(mid, w[p + "fc2.weight"], w[p + "fc2.bias"])
        h = F.layer_norm(h, (d,), w["post_norm.weight"], w["post_norm.bias"], c.layer_norm_eps)
        # Pixel shuffle: each s x s block of patches (row-major blocks) becomes one row of its patches' features,
        # in the order Idefics3's connector lays them out.
        s, side = c.scale_factor, c.patches_per_side
        h = h.view(n, side, side // s, d * s)  # [n, row, col block, s columns' features]
        h = h.permute(0, 2, 1, 3).reshape(n, side // s, side // s, d * s * s)  # [n, col block, row block, ...]
        h = h.permute(0, 2, 1, 3).reshape(n * (side // s) ** 2, d * s * s)
        return F.linear(h, w["proj.weight"])
