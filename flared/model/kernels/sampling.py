"""Sampling on the GPU inside a captured graph: no host sync, fixed shapes.

``sample_greedy`` is the argmax; ``sample_full`` applies temperature, top-k
and top-p per row and draws with per-row seeded noise. Rows with
temperature 0 take the argmax in either.

Rules:
- A row's draw depends only on (seed, step, token id): the noise is a
  counter-based hash, not a stateful generator, so a replayed graph draws
  fresh numbers each step from the uploaded step counters, and a row's
  choice does not depend on its batch neighbours. Draws are reproducible on
  this backend; they are not the CPU sampler's draws (different RNG).
- The draw is the exponential-race form of categorical sampling:
  argmax(p_i / E_i) with E_i ~ Exp(1) picks i with probability p_i.
- Integer arithmetic stays below 2**62 (31-bit lanes times 31-bit
  constants) so int64 never overflows.
- Penalties, logit bias, min-p and log-probabilities are not here: the
  executor runs ``flared.model.sampling.Sampler`` on the graph's logits for
  rows that ask for them.
"""

from __future__ import annotations

import torch

_M31 = 0x7FFFFFFF


def _mix(x: torch.Tensor, multiplier: int, shift: int) -> torch.Tensor:
    x = x ^ (x >> shift)
    return (x * multiplier) & _M31


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """seeds, steps [B, 1] int64; token_ids [B, V] int64 -> [B, V] float32 in (0, 1]."""
    x = (seeds & _M31) ^ ((seeds >> 31) & _M31)
    x = (x * 0x6C8E9CF5 + (steps & _M31)) & _M31
    x = _mix(x, 0x45D9F3B, 16)
    x = (x * 0x2C1B3C6D + token_ids) & _M31
    x = _mix(x, 0x297A2D39, 15)
    x = _mix(x, 0x5BD1E995, 13)
    x = x ^ (x >> 16)
    return (x.to(torch.float32) + 1.0) * (1.0 / 2147483648.0)


def sample_greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] float32 -> [B] int64."""
    return logits.argmax(dim=-1)


def sample_full(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """logits [B, V] float32; temperature/top_p [B] float32; top_k [B] int32 (0 = off);
    seeds/steps [B] int64 -> [B] int64."""
    vocab = logits.shape[-1]
    greedy = logits.argmax(dim=-1)
    scaled = logits / temperature.clamp_min(1e-5)[:, None]
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab).to(torch.int64)
    # The first token is always kept: its mass_before is 0 < top_p and rank 0 < k.
    keep = (ranks[None, :] < k[:, None]) & (mass_before < top_p[:, None])
    noise = -torch.log(uniform_noise(seeds[:, None], steps[:, None], sorted_ids))
    choice = torch.where(keep, probs / noise, -1.0).argmax(dim=-1, keepdim=True)
    drawn = sorted_ids.gather(1, choice).squeeze(1)
    return torch.where(temperature == 0, greedy, drawn)
