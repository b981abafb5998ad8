"""Weights kept quantised in memory on the CPU: Q8_0, llama.cpp's 8-bit format.

A weight row is cut into blocks of 32 inputs; each block keeps one float32 scale d = max|w| / 127 and its 32 values
as int8 q = round(w / d). That is 1.125 bytes a weight against bfloat16's 2, so a decode step, which streams every
weight once, reads 44% fewer bytes. The products (flared/_fast/qlinear_kernel.h) widen each weight to
bf16(d * q) on the fly and then sum exactly as the bf16 kernels do: a quantised model's logits equal, bit for bit,
those of the bf16 model whose weights are the dequantised ones (the tests hold them to that).

``quantize_q8_0`` / ``dequantize_q8_0`` are the format; ``pack_q8_0`` lays it out for the kernels (groups of 64
output features, as ``decoder.pack_bf16`` lays bf16 weights). ``DecoderModel(..., quantization="q8_0")`` quantises
the products of every layer (routed experts included) and the LM head at load (not the embedding rows or routers).
"""

from __future__ import annotations

import torch

QUANTIZATIONS = ("q8_0",)
Q8_BLOCK = 32
GROUP_FEATURES = 64  # (linear_kernel.h's FL_GROUP)


def check_quantization(name: str | None) -> str | None:
    """The quantization's canonical name, or a ValueError that lists the known ones; None stays None."""
    if name is None or name == "none":
        return None
    key = name.lower()
    if key not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {name!r}: flared keeps weights as {', '.join(QUANTIZATIONS)} (or none)")
    return key


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] (in a multiple of 32) -> (q int8 [out, in], scales float32 [out, in / 32]): each block's
    scale is its largest magnitude / 127 and its values round to the nearest step (an all-zero block: scale 0)."""
    out_features, in_features = weight.shape
    if in_features % Q8_BLOCK:
        raise ValueError(f"Q8_0 needs a multiple of {Q8_BLOCK} inputs, got {in_features}")
    blocks = weight.detach().float().reshape(out_features, in_features // Q8_BLOCK, Q8_BLOCK)
    scales = blocks.abs().amax(dim=-1) / 127.0
    inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    q = torch.round(blocks * inverse[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(out_features, in_features), scales.contiguous()


def dequantize_q8_0(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight the kernels compute with: each value times its block's scale in float32, then rounded to dtype."""
    out_features, in_features = q.shape
    blocks = q.float().reshape(out_features, in_features // Q8_BLOCK, Q8_BLOCK) * scales[..., None]
    return blocks.reshape(out_features, in_features).to(dtype)


def pack_q8_0(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [out, in], scales [out, in / 32]) -> the kernels' layout: q as pack_bf16 lays a weight out, groups of 64
    output features each [in / 2, 64, 2]; scales [groups, in / 32, 64]. Rows past ``out`` are zero."""
    out_features, in_features = q.shape
    padded = -(-out_features // GROUP_FEATURES) * GROUP_FEATURES
    if padded != out_features:
        q = torch.cat([q, q.new_zeros(padded - out_features, in_features)])
        scales = torch.cat([scales, scales.new_zeros(padded - out_features, scales.shape[1])])
    groups = padded // GROUP_FEATURES
    packed = q.reshape(groups, GROUP_FEATURES, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()
    packed_scales = scales.reshape(groups, GROUP_FEATURES, -1).permute(0, 2, 1).contiguous()
    return packed, packed_scales


def q8_0_rows(packed: torch.Tensor, packed_scales: torch.Tensor, rows: list[int],
              dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rows ``rows`` of pack_q8_0's weight, dequantised as the kernels use them (dequantize_q8_0): [len(rows), in].
    (The whole weight goes back to bf16 through the C kernels: decoder.widen_q8_0.)"""
    index = torch.tensor(rows, dtype=torch.long)
    groups, features = index // GROUP_FEATURES, index % GROUP_FEATURES
    q = packed[groups, :, features, :].reshape(len(rows), -1)  # [rows, in / 2, 2] -> [rows, in]
    return dequantize_q8_0(q, packed_scales[groups, :, features], dtype)

