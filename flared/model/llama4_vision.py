"""Llama 4's image tower (Scout, Maverick: transformers' ``Llama4VisionModel`` and ``Llama4MultiModalProjector``):
tiles of pixels in, decoder rows out.

Each 336-pixel tile (``flared.frontend.llama4.Llama4TileProcessor``: a canvas of up to 16 tiles and, with more
than one, a global tile of the whole image) runs alone:

    unfold into 14-pixel patches (channel-major: c, y, x), a linear (no bias)       [P, 3 p p] -> [P, D]
    the class row appended last, the learned position rows 0..P added, a LayerNorm
    layers x [x + attn(LN1(x)); x + fc2(gelu(fc1(LN2(x))))]   biased products; q and k turned by a 2D rope over
                                                             interleaved pairs (the first half by the patch's
                                                             column + 1, the second by its row + 1; the class
                                                             row unturned), theta rope_theta
    a LayerNorm, the class row dropped, the patches pixel-shuffled (ratio 0.5: each 2 x 2 block of patches a row
    of 4 D, as transformers' pixel_shuffle orders them), gelu(fc2(gelu(fc1(.)))) (no biases), then the projector
    to the decoder's width (no bias)

giving (S / p)^2 / 4 rows a tile (144), the tiles' rows in order; they replace the prompt's ``<|patch|>`` tokens.

Serving layout (``llama4_tensor_shapes``):

    patch_embed.weight [D, 3 p p]   class_embed [D]   pos_embed.weight [P + 1, D]
    pre_norm.weight / .bias [D]     post_norm.weight / .bias [D]
    layers.{i}.*   as the SigLIP / CLIP layers (norm1, qkv fused with biases, o, norm2, fc1, fc2)
    adapter_fc1.weight [O, 4 D]     adapter_fc2.weight [O, O]      proj.weight [hidden, O]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from flared.errors import CoreError, ErrorKind
from flared.model.vision import VisionConfig, _Tower, _vit_layer_shapes


def llama4_vision_from_hf(hf: dict[str, Any], v: dict[str, Any], t: dict[str, Any]):
    """Llama 4's tower (transformers' defaults are Scout's: 336-pixel tiles in 14-pixel patches, 34 layers of
    1408, pixel shuffle 0.5, adapter and projector of 4096) as a VisionConfig of family llama4."""
    if v.get("model_type", "llama4_vision_model") != "llama4_vision_model":
        raise CoreError(f"a llama4 vision tower of type {v.get('model_type')!r} is not supported",
                        ErrorKind.UNSUPPORTED_MODEL)
    d, inner = int(v.get("hidden_size", 768)), int(v.get("intermediate_size", 5632))
    ratio = float(v.get("pixel_shuffle_ratio", 0.5))
    scale = round(1 / ratio) if ratio > 0 else 0
    image, patch = int(v.get("image_size", 448)), int(v.get("patch_size", 14))
    side = image // patch if patch else 0
    dims = {int(v.get(k, 4096)) for k in ("projector_input_dim", "projector_output_dim", "vision_output_dim")}
    if scale <= 0 or abs(scale * ratio - 1) > 1e-9 or not side or image % patch or side % scale:
        raise CoreError(f"a Llama 4 tower needs pixel_shuffle_ratio 1 / a whole number dividing its {side} patches "
                        f"a side (got {ratio}, tiles of {image} in patches of {patch})", ErrorKind.UNSUPPORTED_MODEL)
    if inner != d * scale ** 2 or len(dims) != 1:
        raise CoreError(f"a Llama 4 tower needs intermediate_size {inner} = hidden_size x {scale ** 2} (its adapter "
                        "reads the shuffled patches) and one width for projector_input_dim, projector_output_dim and "
                        "vision_output_dim", ErrorKind.UNSUPPORTED_MODEL)
    if hf.get("multi_modal_projector_bias", v.get("multi_modal_projector_bias", False)):
        raise CoreError("a Llama 4 projector with a bias is not supported", ErrorKind.UNSUPPORTED_MODEL)
    if str(v.get("vision_feature_select_strategy", "default")) != "default":
        raise CoreError("a Llama 4 tower selecting its features otherwise than \"default\" is not supported",
                        ErrorKind.UNSUPPORTED_MODEL)
    rope = v.get("rope_parameters") or v.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default":
        raise CoreError(f"a Llama 4 tower's rope_type {rope.get('rope_type')!r} is not supported",
                        ErrorKind.UNSUPPORTED_MODEL)
    return VisionConfig(
        family="llama4", hidden_size=d, intermediate_size=inner, num_layers=int(v.get("num_hidden_layers", 34)),
        num_heads=int(v.get("num_attention_heads", 16)), patch_size=patch, image_size=image,
        layer_norm_eps=1e-5,  # (nn.LayerNorm's default: the tower's norms are built without norm_eps)
        hidden_act=str(v.get("hidden_act", "gelu")), scale_factor=scale, text_hidden_size=int(t["hidden_size"]),
        image_token_id=int(hf.get("image_token_index", hf.get("image_token_id", 200092))),
        rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))), output_dims=dims.pop())


def llama4_tensor_shapes(c: VisionConfig) -> dict[str, tuple[int, ...]]:
    d, p, o = c.hidden_size, c.patch_size, c.output_dims
    return {"patch_embed.weight": (d, 3 * p * p), "class_embed": (d,),
            "pos_embed.weight": (c.patches_per_side ** 2 + 1, d),
            "pre_norm.weight": (d,), "pre_norm.bias": (d,), "post_norm.weight": (d,), "post_norm.bias": (d,),
            "adapter_fc1.weight": (o, c.intermediate_size), "adapter_fc2.weight": (o, o),
            "proj.weight": (c.text_hidden_size, o), **_vit_layer_shapes(c)}


def llama4_vision_to_serving(hf, c: VisionConfig, take) -> dict[str, torch.Tensor]:
    """The tower's tensors out of a checkpoint's (``vision_model.*``, ``multi_modal_projector.linear_1``; under
    ``model.`` where transformers saves them so)."""
    vm = "model.vision_model." if "model.vision_model.class_embedding" in hf else "vision_model."
    mp = vm.replace("vision_model.", "multi_modal_projector.")
    out = {"patch_embed.weight": take(vm + "patch_embedding.linear.weight"),
           "class_embed": take(vm + "class_embedding"), "pos_embed.weight": take(vm + "positional_embedding_vlm"),
           "adapter_fc1.weight": take(vm + "vision_adapter.mlp.fc1.weight"),
           "adapter_fc2.weight": take(vm + "vision_adapter.mlp.fc2.weight"),
           "proj.weight": take(mp + "linear_1.weight")}
    for ours, theirs in (("pre_norm", "layernorm_pre"), ("post_norm", "layernorm_post")):
        for kind in ("weight", "bias"):
            out[f"{ours}.{kind}"] = take(f"{vm}{theirs}.{kind}")
    for n in range(c.num_layers):
        hp, sp = f"{vm}model.layers.{n}.", f"layers.{n}."
        for kind in ("weight", "bias"):
            out[f"{sp}qkv.{kind}"] = torch.cat([take(f"{hp}self_attn.{x}_proj.{kind}") for x in "qkv"])
            for ours, theirs in (("o", "self_attn.o_proj"), ("norm1", "input_layernorm"),
                                 ("norm2", "post_attention_layernorm"), ("fc1", "mlp.fc1"), ("fc2", "mlp.fc2")):
                out[f"{sp}{ours}.{kind}"] = take(f"{hp}{theirs}.{kind}")
    return out


def llama4_rope(c: VisionConfig) -> torch.Tensor:
    """[P + 1, head_dim / 2] complex64: each row's turn of each interleaved pair, as transformers'
    Llama4VisionRotaryEmbedding computes it (the patches row-major, the class row last and unturned)."""
    side = c.patches_per_side
    idx = torch.arange(side ** 2, dtype=torch.int32).reshape(side ** 2, 1)
    idx = torch.cat([idx, idx[:1]], dim=0)
    idx[-1, -1] = -2  # (the class row)
    x, y = idx % side, idx // side
    freq_dim = c.hidden_size // c.num_heads // 2
    freqs = 1.0 / (c.rope_theta ** (torch.arange(0, freq_dim, 2)[:freq_dim // 2].float() / freq_dim))
    fx = ((x + 1)[..., None] * freqs[None, None, :]).repeat_interleave(2, dim=-1)
    fy = ((y + 1)[..., None] * freqs[None, None, :]).repeat_interleave(2, dim=-1)
    angles = torch.cat([fx, fy], dim=-1).float().contiguous()[..., ::2]
    angles = angles.masked_fill(idx.reshape(-1, 1, 1) < 0, 0)
    return torch.view_as_complex(torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1))[:, 0]


def pixel_shuffle(x: torch.Tensor, ratio: int) -> torch.Tensor:
    """[n, P, C] patches (row-major on a square grid) -> [n, P / ratio^2, C ratio^2], as transformers'
    pixel_shuffle orders them (its shuffle ratio is 1 / ``ratio``)."""
    n, patches, channels = x.shape
    side = int(round(patches ** 0.5))
    x = x.view(n, side, side, channels).view(n, side, side // ratio, channels * ratio)
    x = x.permute(0, 2, 1, 3).contiguous().view(n, side // ratio, side // ratio, channels * ratio * ratio)
    return x.permute(0, 2, 1, 3).contiguous().view(n, -1, channels * ratio * ratio)


class Llama4VisionEncoder(_Tower):
    """Llama 4's tower on one device: ``stages(tiles [n, 3, S, S])`` -> [n x rows a tile, hidden]."""

    def __init__(self, config: VisionConfig, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        super().__init__(config, tensors, dtype=dtype, device=device)
        self.rope = llama4_rope(config).to(self.device)  # [P + 1, head_dim / 2]

    @torch.inference_mode()
    def stages(self, pixel_values: torch.Tensor, *, grid=None):
        c = self.config
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != (3, c.image_size, c.image_size):
            raise ValueError(f"a Llama 4 tower takes tiles [n, 3, {c.image_size}, {c.image_size}], got "
                             f"{tuple(pixel_values.shape)}")
        return (yield from self._tile_batches(pixel_values, 16))

    def _tiles(self, tiles: torch.Tensor):
        c, w = self.config, self.w
        n, d, p = tiles.shape[0], c.hidden_size, c.patch_size
        x = F.linear(F.unfold(tiles, kernel_size=p, stride=p).transpose(1, 2), w["patch_embed.weight"])  # [n, P, D]
        x = torch.cat([x, w["class_embed"].expand(n, 1, d)], dim=1) + w["pos_embed.weight"]
        h = F.layer_norm(x, (d,), w["pre_norm.weight"], w["pre_norm.bias"], c.layer_norm_eps)
        for i in range(c.num_layers):
            h = self._layer(h, f"layers.{i}.")
            yield
        h = F.layer_norm(h, (d,), w["post_norm.weight"], w["post_norm.bias"], c.layer_norm_eps)[:, :-1]
        h = pixel_shuffle(h, c.scale_factor)
        h = F.gelu(F.linear(F.gelu(F.linear(h, w["adapter_fc1.weight"])), w["adapter_fc2.weight"]))
        return F.linear(h, w["proj.weight"]).reshape(-1, c.text_hidden_size)

    def _layer(self, h: torch.Tensor, p: str) -> torch.Tensor:
        c, w = self.config, self.w
        n, rows, d = h.shape
        heads = c.num_heads
        x1 = F.layer_norm(h, (d,), w[p + "norm1.weight"], w[p + "norm1.bias"], c.layer_norm_eps)
        q, k, v = F.linear(x1, w[p + "qkv.weight"], w[p + "qkv.bias"]).view(n, rows, 3, heads, d // heads).unbind(2)
        q, k = (self._turn(t) for t in (q, k))  # [n, rows, heads, head_dim]
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        h = h + F.linear(attn.transpose(1, 2).reshape(n, rows, d), w[p + "o.weight"], w[p + "o.bias"])
        x2 = F.layer_norm(h, (d,), w[p + "norm2.weight"], w[p + "norm2.bias"], c.layer_norm_eps)
        return h + F.linear(F.gelu(F.linear(x2, w[p + "fc1.weight"], w[p + "fc1.bias"])), w[p + "fc2.weight"],
                            w[p + "fc2.bias"])

    def _turn(self, x: torch.Tensor) -> torch.Tensor:
        """Each interleaved pair of ``x`` [n, rows, heads, head_dim] turned by its row's angle (float32, as
        transformers' vision_apply_rotary_emb turns it)."""
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * self.rope[None, :, None, :]).flatten(3).type_as(x)
