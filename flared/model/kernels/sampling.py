"""Sampling on the GPU inside a captured graph: no host sync, fixed shapes.

``sample_greedy`` is the argmax; ``sample_race`` draws each row at its
temperature from the whole vocabulary (no sort: one pass, the graphs of steps
whose sampled rows have no top-k or top-p); ``sample_full`` applies
temperature, top-k and top-p per row (a sort for the masks) and draws with
the same race, so a row draws the same token in either. Rows with
temperature 0 take the argmax in every one.

Graph variants (the fourth field of a graph key, kernels.GREEDY, FULL and
TEMPERATURE) pick among them.

Rules:
- A row's draw depends only on (seed, step, token id): the noise is a
  counter-based hash, not a stateful generator, so a replayed graph draws
  fresh numbers each step from the uploaded step counters, and a row's
  choice does not depend on its batch neighbours. Draws are reproducible on
  this backend; they are not the CPU sampler's draws (different RNG).
- The draw is the exponential-race form of categorical sampling:
  argmax(p_i / E_i) with E_i ~ Exp(1) picks i with probability p_i. In log
  space that is argmax(x_i / T - log E_i) over the kept tokens (the Gumbel-max
  trick), with no softmax: the Triton kernels below, in blocks of the
  vocabulary across programs, then one pick per row.
- Integer arithmetic stays below 2**62 (31-bit lanes times 31-bit
  constants) so int64 never overflows.
- Penalties, logit bias, min-p and log-probabilities are not here: the
  executor runs ``flared.model.sampling.Sampler`` on the graph's logits for
  rows that ask for them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flared.model.kernels.fused import lanes_first_max, lanes_take, parts_first_max

RACE_BLOCK = 2048  # logits per program iteration of the race
RACE_PROGRAMS = 264  # programs the race aims for (two per H200 multiprocessor)


@triton.jit
def _mix_tl(x, multiplier: tl.constexpr, shift: tl.constexpr):
    x = x ^ (x >> shift)
    return (x * multiplier) & 0x7FFFFFFF


@triton.jit
def _race_parts_kernel(Logits, Temperature, Seeds, Steps, PartVal, PartIdx, vocab, chunk, n_chunks, stride,
                       BLOCK: tl.constexpr):
    """Each program: one row's chunk of the vocabulary; its largest race score and the first index holding it.
    Score: x / T - log(-log u), u in (0, 1] from a counter hash of (seed, step, token id) (its torch form:
    tests/cuda/test_graph_sampler.py's uniform_noise); a row at temperature 0
    scores x itself (its argmax). -inf logits (masked) never win; NaN counts as the largest, as in torch.argmax."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    t = tl.load(Temperature + row)
    seed = tl.load(Seeds + row)
    step = tl.load(Steps + row)
    h = (seed & 0x7FFFFFFF) ^ ((seed >> 31) & 0x7FFFFFFF)
    h = (h * 0x6C8E9CF5 + (step & 0x7FFFFFFF)) & 0x7FFFFFFF
    h = _mix_tl(h, 0x45D9F3B, 16)
    start = part * chunk
    stop = tl.minimum(start + chunk, vocab)
    lane_v = tl.full((BLOCK,), float("-inf"), tl.float32)
    lane_i = tl.zeros((BLOCK,), tl.int32)
    for base in range(start, stop, BLOCK):
        cols = base + tl.arange(0, BLOCK)
        mask = cols < stop
        x = tl.load(Logits + row * stride + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if t > 0:
            z = (h * 0x2C1B3C6D + cols.to(tl.int64)) & 0x7FFFFFFF
            z = _mix_tl(z, 0x297A2D39, 15)
            z = _mix_tl(z, 0x5BD1E995, 13)
            z = z ^ (z >> 16)
            u = (z.to(tl.float32) + 1.0) * (1.0 / 2147483648.0)
            y = x / t - tl.log(-tl.log(u))
        else:
            y = x
        y = tl.where(x == x, y, float("inf"))
        lane_v, lane_i = lanes_take(y, cols, lane_v, lane_i)
    m, first = lanes_first_max(lane_v, lane_i, start)
    tl.store(PartVal + row * n_chunks + part, m)
    tl.store(PartIdx + row * n_chunks + part, first)


@triton.jit
def _race_pick_kernel(PartVal, PartIdx, Out, n_chunks, PARTS: tl.constexpr):
    row = tl.program_id(0)
    tl.store(Out + row, parts_first_max(PartVal, PartIdx, row, n_chunks, PARTS))


def sample_race(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                steps: torch.Tensor) -> torch.Tensor:
    """logits [B, V] float32 (-inf: a token the row may not draw); temperature [B] float32; seeds/steps [B]
    int64 -> [B] int64: each row's draw at its temperature from its logits (the argmax at temperature 0)."""
    batch, vocab = logits.shape
    blocks = triton.cdiv(vocab, RACE_BLOCK)
    per_row = max(1, min(blocks, triton.cdiv(RACE_PROGRAMS, batch)))
    chunk = triton.cdiv(blocks, per_row) * RACE_BLOCK
    n_chunks = triton.cdiv(vocab, chunk)
    part_val = torch.empty(batch, n_chunks, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(batch, n_chunks, dtype=torch.int32, device=logits.device)
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    _race_parts_kernel[(batch, n_chunks)](logits, temperature, seeds, steps, part_val, part_idx, vocab, chunk,
                                          n_chunks, logits.stride(0), BLOCK=RACE_BLOCK, num_warps=8)
    _race_pick_kernel[(batch,)](part_val, part_idx, out, n_chunks, PARTS=triton.next_power_of_2(n_chunks),
                                num_warps=1)
    return out


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
    kept = torch.zeros_like(keep).scatter_(1, sorted_ids, keep)  # back in vocabulary order
    drawn = sample_race(torch.where(kept, logits, float("-inf")), temperature, seeds, steps)
    return torch.where(temperature == 0, greedy, drawn)
