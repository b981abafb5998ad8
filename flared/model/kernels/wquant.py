"""Products over weights kept quantised on the GPU: Q4_1 and Q8_0 blocks of 32 inputs in quant.gpu_layout's layout.

A decode step streams every weight once, so at 4 bits (Q4_1: 5 bits a weight with its step and offset) it reads
0.31x a bf16 model's bytes, and a model that does not fit a card in bf16 (a 70B GPTQ checkpoint: 141 GB in bf16, 44
as Q4_1) fits. The weights the products use are the CPU kernels' (quant.dequantize_q4_1 / dequantize_q8_0: the same
quantisers, so a GPTQ, AWQ or GGUF model's own values), widened in registers, then summed on the tensor cores in
float32 (a bf16 model over those values differs only in the order of the sums).

- ``linear`` under ``WIDEN_MIN_ROWS`` rows (decode, small prefills): one kernel. Each program takes a tile of
  BLOCK_N output features and up to BLOCK_M rows, loads BLOCK_K inputs' packed words and block parameters a turn
  (the words once, their nibbles split in registers), widens them to bf16 and feeds ``tl.dot``. Where the tiles
  are too few to fill the multiprocessors (a 4096-feature product at one row: 64 tiles on 132), the inputs are split
  among programs too, whose float32 partial sums one sum adds in a fixed order (no atomics: the same bits every
  run, as the graphs' replays need).
- From ``WIDEN_MIN_ROWS`` rows (prefill chunks of 256 tokens and more): the weight widened to bf16 into scratch,
  then cuBLAS. Each 64-row tile widens the whole weight again, so past a few tiles widening it once wins.
Every shape is fixed for a capture: no host sync, no allocation but torch's (the graph pool's) scratch.

The widening, not the memory, bounds these products: on an H100 they take in about 1.7-2e12 weights a second
(tools/bench_wquant_gpu.py; docs/benchmarks.md), 1.1 TB/s at Q4_1's 5 bits against the card's 3.35, so a quantised
8B model serves in 0.31x the memory at 0.76-0.89x the bf16 model's speed (which the fused Llama kernels run), not
faster.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from flared.model.quant import Q8_BLOCK

WIDEN_MIN_ROWS = 256
_MIN_SPLIT_INPUTS = 512  # (an input split never shorter: each program's loop keeps a few turns to pipeline)


@triton.jit
def _widened(Q, S, Z, k0, offs_n, n_mask, N, FOUR_BITS: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr):
    """Inputs k0 .. k0 + BLOCK_K of the tile's features, widened: [BLOCK_K, BLOCK_N] float32. Each word and block
    parameter is loaded once and spread by reshapes (loading each where its inputs sit, 8 and 32 times over from L1,
    was 3-4x slower; docs/benchmarks.md)."""
    groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    params = groups[:, None] * N + offs_n[None, :]
    scale = tl.load(S + params, mask=n_mask[None, :], other=0.0).to(tl.float32)  # [BLOCK_K / 32, BLOCK_N]
    scale = tl.reshape(tl.broadcast_to(scale[:, None, :], (BLOCK_K // 32, 32, BLOCK_N)), (BLOCK_K, BLOCK_N))
    if FOUR_BITS:
        words = tl.load(Q + (k0 // 8 + tl.arange(0, BLOCK_K // 8))[:, None] * N + offs_n[None, :],
                        mask=n_mask[None, :], other=0)  # [BLOCK_K / 8, BLOCK_N] int32
        shifts = 4 * tl.arange(0, 8)
        q = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & 15, (BLOCK_K, BLOCK_N))
        offset = tl.load(Z + params, mask=n_mask[None, :], other=0.0).to(tl.float32)
        offset = tl.reshape(tl.broadcast_to(offset[:, None, :], (BLOCK_K // 32, 32, BLOCK_N)), (BLOCK_K, BLOCK_N))
        # (a float16 step times 0..15 is exact in float32: one rounding, as dequantize_q4_1's fma)
        return q.to(tl.float32) * scale + offset
    q = tl.load(Q + (k0 + tl.arange(0, BLOCK_K))[:, None] * N + offs_n[None, :], mask=n_mask[None, :], other=0)
    return q.to(tl.float32) * scale


@triton.jit
def _product_kernel(X, Q, S, Z, Bias, Y, M, N, K, stride_x, inputs_per_split,
                    FOUR_BITS: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    start = split * inputs_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(start, start + inputs_per_split, BLOCK_K):
        w = _widened(Q, S, Z, k0, offs_n, n_mask, N, FOUR_BITS, BLOCK_N, BLOCK_K)
        x = tl.load(X + offs_m[:, None] * stride_x + (k0 + offs_k)[None, :], mask=m_mask[:, None], other=0.0)
        acc += tl.dot(x, w.to(x.dtype))
    out = offs_m[:, None] * N + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if PARTIAL:  # (float32 partial sums [splits, M, N]; the caller adds them)
        tl.store(Y + split * M * N + out, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + out, acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _widen_kernel(Q, S, Z, W, N, FOUR_BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight widened, transposed: W [K, N]."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k0 = tl.program_id(1) * BLOCK_K
    w = _widened(Q, S, Z, k0, offs_n, n_mask, N, FOUR_BITS, BLOCK_N, BLOCK_K)
    tl.store(W + (k0 + tl.arange(0, BLOCK_K))[:, None] * N + offs_n[None, :], w.to(W.dtype.element_ty),
             mask=n_mask[None, :])


def _block_k(in_features: int, wanted: int | None = None) -> int:
    """Inputs a turn: the most of ``wanted`` (default 128), 128, 64 and 32 that divides the inputs."""
    return next(b for b in (wanted or 128, 128, 64, 32) if in_features % b == 0)


_SMS: dict[int, int] = {}


def _multiprocessors(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


class Launch(NamedTuple):
    """How one product launches: its tile (BLOCK_K: inputs a turn), input splits, warps and pipeline stages."""
    block_m: int
    block_n: int
    block_k: int
    splits: int
    warps: int
    stages: int


def plan(rows: int, out_features: int, in_features: int, multiprocessors: int, *, block_n: int = 64,
         block_k: int | None = None, warps: int = 4, stages: int = 3) -> Launch:
    """The product's launch at ``rows`` rows: tiles of 16 to 64 rows on the tensor cores (a row alone pads a
    16-row tile: summing it in registers instead lost 13% of the 8B's one-row step; docs/benchmarks.md); the inputs
    split in two while the tiles fill fewer than two programs a multiprocessor and each part keeps
    _MIN_SPLIT_INPUTS inputs and whole turns. The keywords are for tools/bench_wquant_gpu.py's sweep; the defaults
    its choice."""
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    block_k = _block_k(in_features, block_k)
    turns = in_features // block_k
    tiles = -(-rows // block_m) * -(-out_features // block_n)
    splits = 1
    while tiles * splits < 2 * multiprocessors and turns % (2 * splits) == 0 \
            and turns // (2 * splits) * block_k >= _MIN_SPLIT_INPUTS:
        splits *= 2
    return Launch(block_m, block_n, block_k, splits, warps, stages)


def widen(fmt: str, parts: tuple[torch.Tensor, ...], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight as its products use it, transposed: [in, out] in ``dtype``."""
    q, scales = parts[0], parts[1]
    offsets = parts[2] if fmt == "q4_1" else scales
    in_features, out_features = scales.shape[0] * Q8_BLOCK, scales.shape[1]
    out = torch.empty(in_features, out_features, dtype=dtype, device=q.device)
    block_k = _block_k(in_features)
    grid = (triton.cdiv(out_features, 64), in_features // block_k)
    _widen_kernel[grid](q, scales, offsets, out, out_features, FOUR_BITS=fmt == "q4_1", BLOCK_N=64, BLOCK_K=block_k,
                        num_warps=4)
    return out


def linear(x: torch.Tensor, fmt: str, parts: tuple[torch.Tensor, ...], bias: torch.Tensor | None = None,
           launch: Launch | None = None) -> torch.Tensor:
    """x [M, in] (bf16 or float16) times the quantised weight (``parts``: quant.gpu_layout's, ``fmt`` "q4_1" or
    "q8_0"), plus ``bias`` [out]: [M, out] in x's dtype. ``launch``: not plan's (the bench's sweep)."""
    q, scales = parts[0], parts[1]
    offsets = parts[2] if fmt == "q4_1" else scales
    in_features, out_features = scales.shape[0] * Q8_BLOCK, scales.shape[1]
    if x.dim() != 2 or x.shape[1] != in_features or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"linear: input {tuple(x.shape)} {x.dtype} does not match {fmt.upper()} weight "
                         f"[{out_features}, {in_features}] (bfloat16 or float16 rows)")
    rows = x.shape[0]
    if rows >= WIDEN_MIN_ROWS and launch is None:
        weight = widen(fmt, parts, x.dtype)
        return torch.matmul(x, weight) if bias is None else torch.addmm(bias, x, weight)
    y = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    if x.stride(1) != 1:
        x = x.contiguous()
    launch = launch or plan(rows, out_features, in_features, _multiprocessors(x.device))
    grid = (triton.cdiv(out_features, launch.block_n), triton.cdiv(rows, launch.block_m), launch.splits)
    partial = launch.splits > 1
    target = torch.empty(launch.splits, rows, out_features, dtype=torch.float32, device=x.device) if partial else y
    turns = in_features // launch.block_k
    _product_kernel[grid](x, q, scales, offsets, bias if bias is not None else y, target, rows, out_features,
                          in_features, x.stride(0), turns // launch.splits * launch.block_k, FOUR_BITS=fmt == "q4_1",
                          HAS_BIAS=bias is not None, PARTIAL=partial, BLOCK_M=launch.block_m,
                          BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, num_warps=launch.warps,
                          num_stages=launch.stages)
    if partial:
        total = target.sum(dim=0)
        if bias is not None:
            total += bias.float()
        y.copy_(total)
    return y
