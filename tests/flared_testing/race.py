"""The samplers' race in torch, for tests on either device: the counter hash the GPU graphs' race and the CPU's
flared._fast.race compute (flared/model/kernels/sampling.py), and the race over it in float64."""

from __future__ import annotations

import torch

_M31 = 0x7FFFFFFF


def _mix(x, multiplier: int, shift: int):
    x = x ^ (x >> shift)
    return (x * multiplier) & _M31


def uniform_noise(seeds, steps, token_ids):
    """seeds, steps [B, 1] int64; token_ids [B, V] int64 -> [B, V] float32 in (0, 1]. 31-bit lanes times 31-bit
    constants stay below 2**62, so int64 never overflows."""
    x = (seeds & _M31) ^ ((seeds >> 31) & _M31)
    x = (x * 0x6C8E9CF5 + (steps & _M31)) & _M31
    x = _mix(x, 0x45D9F3B, 16)
    x = (x * 0x2C1B3C6D + token_ids) & _M31
    x = _mix(x, 0x297A2D39, 15)
    x = _mix(x, 0x5BD1E995, 13)
    x = x ^ (x >> 16)
    return (x.to(torch.float32) + 1.0) * (1.0 / 2147483648.0)


def reference_race(logits, temperature, seeds, steps):
    """The race in float64: argmax over x / T - log(max(-log u, 2^-24)), u from uniform_noise; the argmax of the
    logits where the temperature is 0."""
    ids = torch.arange(logits.shape[1], device=logits.device)[None, :].expand_as(logits)
    u = uniform_noise(seeds[:, None], steps[:, None], ids).double()
    score = logits.double() / temperature.double()[:, None] - torch.log((-torch.log(u)).clamp_min(2.0 ** -24))
    return torch.where(temperature == 0, logits.argmax(dim=-1), score.argmax(dim=-1))
