"""Products over weights kept quantised on the GPU: Q4_1 and Q8_0 blocks of 32 inputs in quant.gpu_layout's layout.

A decode step streams every weight once, so at 4 bits (Q4_1: 5 bits a weight with its step and offset) it reads
0.31x a bf16 model's bytes, and a model that does not fit a card in bf16 (a 70B GPTQ checkpoint: 141 GB in bf16, 44
as Q4_1) fits. The weights the products use are the CPU kernels' (quant.dequantize_q4_1 / dequantize_q8_0: the same
quantisers, so a GPTQ, AWQ or GGUF model's own values), widened in registers, then summed on the tensor cores in
float32 (a bf16 model over those values differs only in the order of the sums).

- ``linear`` under ``WIDEN_MIN_ROWS`` rows (decode, small prefills): one kernel. Each program takes a tile of
  BLOCK_N output features and up to BLOCK_M rows and, a turn at a time (128 inputs of Q4_1, 64 of Q8_0), loads the
  turn's 16 rows of words once; value j of every word is input 16 j + its row (quant.gpu_layout), so each value
  position widened is the weight operand of one 16-input ``tl.dot`` as it stands, in the registers it was loaded
  into (no reshuffling through shared memory). A value is widened by setting its bits under a float's exponent (one
  lop3; ``_value``), not by converting an integer, a quarter-rate instruction. Where the tiles are too few to fill
  the multiprocessors (a 4096-feature product at one row: 16 tiles on 132), the inputs are split among programs
  too; each writes its float32 sums aside, and the tile's last program to finish adds them in a fixed order (the
  same bits whichever finishes last, as the graphs' replays need) and stores the rows: one launch a product.
- From ``WIDEN_MIN_ROWS`` rows (prefill chunks of 256 tokens and more): the weight widened to bf16 into scratch,
  then cuBLAS. Each 32-row tile widens the whole weight again, so past a few tiles widening it once wins.
Every shape is fixed for a capture: no host sync, no allocation but torch's (the graph pool's) scratch and each
device's tile counts (made before any capture).

On an H100 a Q4_1 product at one row runs 1.0-2.1x cuBLAS' bf16 one over the same matrix (1.7 TB/s of its bytes for
the 8B shape's gate_up and down, half the card's rate), 1.2-1.6x the earlier kernel that converted each value from
an integer and reshuffled the widened tile through shared memory (docs/benchmarks.md, fifty-fifth session).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from flared.model.quant import GPU_TURN, Q8_BLOCK

WIDEN_MIN_ROWS = 256
_MIN_SPLIT_INPUTS = 512  # (an input split never shorter: each program's loop keeps a few turns to pipeline)


@triton.jit
def _lop3(a, b, c, FOUR_BITS: tl.constexpr):
    """One lop3 a word: Q4_1 (a & b) | c; Q8_0 b ? a ^ c : c bit by bit (ptxas gives two or three instructions for
    the plain expressions)."""
    if FOUR_BITS:
        return tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)
    return tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0x6A;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _value(words, scale, offset, J: tl.constexpr, FOUR_BITS: tl.constexpr):
    """Value J of each word (the turn's inputs 16 J + its row), widened to float32: q * scale + offset (Q4_1), q *
    scale (Q8_0), as dequantize_q4_1 / dequantize_q8_0 round them. The value's bits are set into a float's mantissa
    under an exponent that makes its last bit weigh 1 (2^(23 - P) + q, P its place: one lop3, where converting an
    int costs a quarter-rate instruction), the high values brought down by one shift a word first; taking
    2^(23 - P) away again is exact."""
    if FOUR_BITS:
        HIGH: tl.constexpr = J >= 5
        P: tl.constexpr = 4 * J - 12 * HIGH
        MASK: tl.constexpr = 15 << P
        MAGIC: tl.constexpr = (150 - P) << 23
        BASE: tl.constexpr = 2.0 ** (23 - P)
        SHIFT: tl.constexpr = 12
    else:
        HIGH: tl.constexpr = J >= 2
        P: tl.constexpr = 8 * J - 16 * HIGH
        MASK: tl.constexpr = 255 << P
        MAGIC: tl.constexpr = (128 << P) | ((150 - P) << 23)  # (q's sign bit flipped: q + 128)
        BASE: tl.constexpr = 2.0 ** (23 - P) + 128.0
        SHIFT: tl.constexpr = 16
    if HIGH:
        words = (words.to(tl.uint32, bitcast=True) >> SHIFT).to(tl.int32, bitcast=True)
    bits = _lop3(words, tl.full(words.shape, MASK, tl.int32), tl.full(words.shape, MAGIC, tl.int32), FOUR_BITS)
    q = bits.to(tl.float32, bitcast=True) - BASE
    if FOUR_BITS:
        return q * scale[None, :] + offset[None, :]
    return q * scale[None, :]


@triton.jit
def _params(S, Z, group, offs_n, n_mask, N, FOUR_BITS: tl.constexpr):
    """Block ``group``'s scales (and Q4_1's offsets) of the tile's features, float32."""
    scale = tl.load(S + group * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    offset = tl.load(Z + group * N + offs_n, mask=n_mask, other=0.0).to(tl.float32) if FOUR_BITS else scale
    return scale, offset


@triton.jit
def _inputs(X, offs_m, m_mask, k, K, stride_x, EVEN_K: tl.constexpr):
    """The tile's rows of X at inputs ``k`` (zeros past K, the weight's padding)."""
    mask = m_mask[:, None] if EVEN_K else m_mask[:, None] & (k < K)[None, :]
    return tl.load(X + offs_m[:, None] * stride_x + k[None, :], mask=mask, other=0.0)


@triton.jit
def _product_kernel(X, Q, S, Z, Bias, Y, Part, Count, M, N, K, stride_x, inputs_per_split,
                    FOUR_BITS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLITS: tl.constexpr, EVEN_K: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Y [M, N] = X [M, K] times the weight, a tile of BLOCK_M rows by BLOCK_N features a program, the inputs in
    SPLITS parts: each part's float32 sums go to Part, and the tile's last program to finish (Count) adds them in
    order (the same bits whichever finishes last) and resets its count for the next launch."""
    TURN: tl.constexpr = 128 if FOUR_BITS else 64
    PER_WORD: tl.constexpr = 8 if FOUR_BITS else 4
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows = tl.arange(0, 16)
    start = split * inputs_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(start, start + inputs_per_split, TURN):
        words = tl.load(Q + (k0 // PER_WORD + rows)[:, None] * N + offs_n[None, :], mask=n_mask[None, :], other=0)
        for G in tl.static_range(TURN // 32):  # (a block of 32 inputs: one scale, two 16-input steps)
            scale, offset = _params(S, Z, k0 // 32 + G, offs_n, n_mask, N, FOUR_BITS)
            for H in tl.static_range(2):
                w = _value(words, scale, offset, 2 * G + H, FOUR_BITS)
                x = _inputs(X, offs_m, m_mask, k0 + 32 * G + 16 * H + rows, K, stride_x, EVEN_K)
                acc += tl.dot(x, w.to(x.dtype))
    out = offs_m[:, None] * N + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLITS > 1:
        tl.store(Part + split * M * N + out, acc, mask=mask, cache_modifier=".cg")
        tl.debug_barrier()
        count = Count + pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") != SPLITS - 1:
            return
        acc = tl.load(Part + out, mask=mask, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLITS):
            acc += tl.load(Part + s * M * N + out, mask=mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(count, 0, sem="relaxed", scope="gpu")
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + out, acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _widen_kernel(Q, S, Z, W, N, FOUR_BITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The weight widened, transposed: W [K', N] (the padded inputs too), a turn of BLOCK_N features a program."""
    TURN: tl.constexpr = 128 if FOUR_BITS else 64
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k0 = tl.program_id(1) * TURN
    rows = tl.arange(0, 16)
    words = tl.load(Q + (tl.program_id(1) * 16 + rows)[:, None] * N + offs_n[None, :], mask=n_mask[None, :], other=0)
    for G in tl.static_range(TURN // 32):
        scale, offset = _params(S, Z, k0 // 32 + G, offs_n, n_mask, N, FOUR_BITS)
        for H in tl.static_range(2):
            w = _value(words, scale, offset, 2 * G + H, FOUR_BITS)
            k = k0 + 32 * G + 16 * H + rows
            tl.store(W + k[:, None] * N + offs_n[None, :], w.to(W.dtype.element_ty), mask=n_mask[None, :])


_SMS: dict[int, int] = {}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _multiprocessors(device: torch.device) -> int:
    index = _index(device)
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


# Each device's tile counts for split products (zeros between launches: each tile's last program resets its own).
# A buffer is never freed: captured graphs keep its address. Grown only outside a capture (the eager warm-up runs
# every shape first).
_COUNTS: dict[int, list[torch.Tensor]] = {}


def _counts(device: torch.device, tiles: int) -> torch.Tensor:
    kept = _COUNTS.setdefault(_index(device), [])
    if not kept or kept[-1].numel() < tiles:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"wquant: a split product of {tiles} tiles first ran inside a CUDA graph capture; "
                               f"run it once before capturing")
        kept.append(torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device))
    return kept[-1]


class Launch(NamedTuple):
    """How one product launches: its tile, input splits, warps and pipeline stages."""
    block_m: int
    block_n: int
    splits: int
    warps: int
    stages: int


def plan(rows: int, out_features: int, in_features: int, multiprocessors: int, fmt: str = "q4_1", *,
         block_n: int | None = None, warps: int = 4, stages: int = 3) -> Launch:
    """The product's launch at ``rows`` rows (``in_features`` padded to whole turns, as the layout holds them):
    tiles of 16 rows, or of 32 above 16 rows, on the tensor cores (a row alone pads a 16-row tile: summing it in
    registers instead lost 13% of the 8B's one-row step; docs/benchmarks.md), 256 features wide to 16 rows (the
    wider, the more values a program widens for each input row it loads) and 64 above (measured best at 32 and 64
    rows). Two forms of a 64-row tile lost to two 32-row ones, 1.3-2.6x at 64 rows (a turn's values joined into one
    operand, or eight products 16 inputs deep: warpgroup products that wait on each other; fifty-fifth and
    fifty-sixth sessions). The inputs split while the tiles fill fewer than two programs a multiprocessor and each
    part keeps _MIN_SPLIT_INPUTS inputs and whole turns. The keywords are for tools/bench_wquant_gpu.py's sweep; the
    defaults its choice."""
    block_m = 16 if rows <= 16 else 32
    block_n = block_n or (256 if rows <= 16 else 64)
    turns = in_features // GPU_TURN[fmt]
    tiles = -(-rows // block_m) * -(-out_features // block_n)
    splits = 1
    while tiles * splits < 2 * multiprocessors and turns % (2 * splits) == 0 \
            and turns // (2 * splits) * GPU_TURN[fmt] >= _MIN_SPLIT_INPUTS:
        splits *= 2
    return Launch(block_m, block_n, splits, warps, stages)


def widen(fmt: str, parts: tuple[torch.Tensor, ...], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight as its products use it, transposed: [in', out] in ``dtype`` (in': the inputs padded to whole
    turns; the padding's rows are zeros)."""
    q, scales = parts[0], parts[1]
    offsets = parts[2] if fmt == "q4_1" else scales
    in_features, out_features = scales.shape[0] * Q8_BLOCK, scales.shape[1]
    out = torch.empty(in_features, out_features, dtype=dtype, device=q.device)
    grid = (triton.cdiv(out_features, 64), in_features // GPU_TURN[fmt])
    _widen_kernel[grid](q, scales, offsets, out, out_features, FOUR_BITS=fmt == "q4_1", BLOCK_N=64, num_warps=4)
    return out


def linear(x: torch.Tensor, fmt: str, parts: tuple[torch.Tensor, ...], bias: torch.Tensor | None = None,
           launch: Launch | None = None) -> torch.Tensor:
    """x [M, in] (bf16 or float16) times the quantised weight (``parts``: quant.gpu_layout's, ``fmt`` "q4_1" or
    "q8_0"), plus ``bias`` [out]: [M, out] in x's dtype. ``launch``: not plan's (the bench's sweep)."""
    q, scales = parts[0], parts[1]
    offsets = parts[2] if fmt == "q4_1" else scales
    padded, out_features = scales.shape[0] * Q8_BLOCK, scales.shape[1]
    in_features = x.shape[-1]
    turn = GPU_TURN[fmt]
    if x.dim() != 2 or -(-in_features // turn) * turn != padded or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"linear: input {tuple(x.shape)} {x.dtype} does not match {fmt.upper()} weight "
                         f"[{out_features}, {padded} (padded)] (bfloat16 or float16 rows)")
    rows = x.shape[0]
    if rows >= WIDEN_MIN_ROWS and launch is None:
        weight = widen(fmt, parts, x.dtype)[:in_features]
        return torch.matmul(x, weight) if bias is None else torch.addmm(bias, x, weight)
    y = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    if x.stride(1) != 1:
        x = x.contiguous()
    launch = launch or plan(rows, out_features, padded, _multiprocessors(x.device), fmt)
    turns = padded // turn
    if turns % launch.splits:
        raise ValueError(f"linear: {launch.splits} input splits do not divide the weight's {turns} turns")
    grid = (triton.cdiv(out_features, launch.block_n), triton.cdiv(rows, launch.block_m), launch.splits)
    if launch.splits > 1:
        part = torch.empty(launch.splits, rows, out_features, dtype=torch.float32, device=x.device)
        counts = _counts(x.device, grid[0] * grid[1])
    else:
        part = counts = y
    _product_kernel[grid](x, q, scales, offsets, bias if bias is not None else y, y, part, counts, rows,
                          out_features, in_features, x.stride(0), turns // launch.splits * turn,
                          FOUR_BITS=fmt == "q4_1", HAS_BIAS=bias is not None, SPLITS=launch.splits,
                          EVEN_K=in_features == padded, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
                          num_warps=launch.warps, num_stages=launch.stages)
    return y
