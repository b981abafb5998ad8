"""Fused Triton kernels for the CUDA decoder's small per-layer ops.

Inside a CUDA graph a decode step of a small model is dominated by the count
of tiny kernels, not their bytes (measured on the H200: SmolLM2-135M at batch
1 spent ~1.5 ms per step in ~16 kernels x 30 layers). These fold the chains
between the matmuls into one kernel each:

- ``add_rms_norm``: residual += x; out = rms_norm(residual) * weight.
- ``rope_write_kv``: rotary on q and k (rotate-half layout, sign folded into
  the sin table), q written to an attention input, k and v written to their
  KV slots.
- ``silu_mul``: silu(gate) * up from the joint gate_up projection.
- ``head_epilogue``: the LM head's half-precision logits widened to float32
  into the step's logits and its state rows' logits, and (greedy) each row's
  argmax into ``sampled`` and its state row's ``last_token``: one pass over
  the logits where torch took a conversion, two copies and an argmax that
  each re-read them (Llama-3.1-8B at 64 rows: ~110 us of a 5.3 ms step).

Rules:
- Statistics (the RMS) in float32; outputs in the activation dtype.
- One program per token row; the row width is padded to a power of two and
  masked.
- Used only for bfloat16/float16 models: float32 keeps the torch ops so it
  matches transformers to rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flared.model.triton_attention import kv_value


@triton.jit
def _add_rms_norm_kernel(X, Residual, Weight, Out, stride_row, width, eps, HAS_X: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    r = tl.load(Residual + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_X:
        r += tl.load(X + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Residual + row * stride_row + cols, r.to(Residual.dtype.element_ty), mask=mask)
    # Round the residual to the activation dtype before the statistics, as the unfused ops do.
    r = r.to(Residual.dtype.element_ty).to(tl.float32)
    inv = tl.rsqrt(tl.sum(r * r, 0) / width + eps)
    w = tl.load(Weight + cols, mask=mask, other=0.0).to(tl.float32)
    y = (r * inv).to(Residual.dtype.element_ty).to(tl.float32) * w
    tl.store(Out + row * stride_row + cols, y.to(Out.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                 eps: float) -> None:
    """residual [T, H] (+= x [T, H] when given), out [T, H] = rms_norm(residual) * weight. Contiguous rows."""
    rows, width = residual.shape
    _add_rms_norm_kernel[(rows,)](x if x is not None else residual, residual, weight, out, residual.stride(0), width,
                                  eps, HAS_X=x is not None, BLOCK=triton.next_power_of_2(width), num_warps=4)


@triton.jit
def _rope_write_kernel(QKV, Cos, Sin, Positions, Slots, QOut, KPool, VPool,
                       stride_qkv, stride_q_row, stride_kv_slot,
                       NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       HEADS_PAD: tl.constexpr, KV_PAD: tl.constexpr):
    row = tl.program_id(0)
    half: tl.constexpr = HEAD_DIM // 2
    pos = tl.load(Positions + row)
    slot = tl.load(Slots + row)
    d = tl.arange(0, HEAD_DIM)
    rot = (d + half) % HEAD_DIM  # roll by half: rotate_half's partner lane
    cos = tl.load(Cos + pos * HEAD_DIM + d).to(tl.float32)
    sin = tl.load(Sin + pos * HEAD_DIM + d).to(tl.float32)
    base = QKV + row * stride_qkv
    # q heads
    h = tl.arange(0, HEADS_PAD)
    hm = h < NUM_HEADS
    q = tl.load(base + h[:, None] * HEAD_DIM + d[None, :], mask=hm[:, None], other=0.0).to(tl.float32)
    q_rot = tl.load(base + h[:, None] * HEAD_DIM + rot[None, :], mask=hm[:, None], other=0.0).to(tl.float32)
    q_out = q * cos[None, :] + q_rot * sin[None, :]
    tl.store(QOut + row * stride_q_row + h[:, None] * HEAD_DIM + d[None, :], q_out.to(QOut.dtype.element_ty),
             mask=hm[:, None])
    # k heads (roped) and v heads (as is) into the slot
    kh = tl.arange(0, KV_PAD)
    km = kh < NUM_KV_HEADS
    kbase = base + NUM_HEADS * HEAD_DIM
    k = tl.load(kbase + kh[:, None] * HEAD_DIM + d[None, :], mask=km[:, None], other=0.0).to(tl.float32)
    k_rot = tl.load(kbase + kh[:, None] * HEAD_DIM + rot[None, :], mask=km[:, None], other=0.0).to(tl.float32)
    k_out = k * cos[None, :] + k_rot * sin[None, :]
    dst = slot.to(tl.int64) * stride_kv_slot + kh[:, None] * HEAD_DIM + d[None, :]
    tl.store(KPool + dst, kv_value(k_out.to(QKV.dtype.element_ty), KPool), mask=km[:, None])
    v = tl.load(kbase + NUM_KV_HEADS * HEAD_DIM + kh[:, None] * HEAD_DIM + d[None, :], mask=km[:, None])
    tl.store(VPool + dst, kv_value(v, VPool), mask=km[:, None])


def rope_write_kv(qkv: torch.Tensor, cos_table: torch.Tensor, sin_signed_table: torch.Tensor,
                  positions: torch.Tensor, slots: torch.Tensor, q_out: torch.Tensor, k_pool: torch.Tensor,
                  v_pool: torch.Tensor, *, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """qkv [T, (nh + 2 nkv) d]; tables [positions, d]; q_out [T, nh, d]; k/v_pool [slots, nkv, d]."""
    rows = qkv.shape[0]
    _rope_write_kernel[(rows,)](qkv, cos_table, sin_signed_table, positions, slots, q_out, k_pool, v_pool,
                                qkv.stride(0), q_out.stride(0), k_pool.stride(0),
                                NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
                                HEADS_PAD=triton.next_power_of_2(num_heads),
                                KV_PAD=triton.next_power_of_2(num_kv_heads), num_warps=4)


@triton.jit
def _silu_mul_kernel(GateUp, Out, stride_in, stride_out, width, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    g = tl.load(GateUp + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GateUp + row * stride_in + width + cols, mask=mask, other=0.0)
    # Round silu(g) to the activation dtype before the product, as the unfused ops do.
    s = (g * tl.sigmoid(g)).to(u.dtype)
    tl.store(Out + row * stride_out + cols, (s * u).to(Out.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    """gate_up [T, 2 I] -> out [T, I] = silu(gate) * up."""
    rows, width = out.shape
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(width, block))](gate_up, out, gate_up.stride(0), out.stride(0), width,
                                                        BLOCK=block, num_warps=4)


HEAD_BLOCK = 2048  # logits per program iteration of the head epilogue
HEAD_PROGRAMS = 264  # programs the head epilogue aims for (two per H200 multiprocessor)


@triton.jit
def lanes_take(y, cols, lane_v, lane_i):
    """Lanes' running maxima and their first indices after one more block (strict >: an earlier block keeps a
    tie)."""
    take = y > lane_v
    return tl.where(take, y, lane_v), tl.where(take, cols, lane_i)


@triton.jit
def lanes_first_max(lane_v, lane_i, start):
    """The lanes' largest value and the first index holding it (``start`` where every lane is -inf)."""
    m = tl.max(lane_v, 0)
    first = tl.min(tl.where(lane_v == m, lane_i, 2147483647), 0)
    return m, tl.where(m == float("-inf"), start, first)


@triton.jit
def parts_first_max(PartVal, PartIdx, row, n_chunks, PARTS: tl.constexpr):
    """A row's index from its parts' maxima: the one the first part with the largest value holds (int64)."""
    p = tl.arange(0, PARTS)
    mask = p < n_chunks
    v = tl.load(PartVal + row * n_chunks + p, mask=mask, other=float("-inf"))
    m = tl.max(v, 0)
    j = tl.min(tl.where(mask & (v == m), p, PARTS), 0)
    return tl.load(PartIdx + row * n_chunks + j).to(tl.int64)


@triton.jit
def _head_widen_kernel(Logits, Out, StateOut, Rows, PartVal, PartIdx, vocab, chunk, n_chunks, stride_in,
                       stride_out, stride_state, GREEDY: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    srow = tl.load(Rows + row).to(tl.int64)
    start = part * chunk
    stop = tl.minimum(start + chunk, vocab)
    # Per lane, the largest value seen and its first index (strict >: an earlier block keeps a tie).
    lane_v = tl.full((BLOCK,), float("-inf"), tl.float32)
    lane_i = tl.zeros((BLOCK,), tl.int32)
    for base in range(start, stop, BLOCK):
        cols = base + tl.arange(0, BLOCK)
        mask = cols < stop
        x = tl.load(Logits + row * stride_in + cols, mask=mask, other=float("-inf")).to(tl.float32)
        tl.store(Out + row * stride_out + cols, x, mask=mask)
        tl.store(StateOut + srow * stride_state + cols, x, mask=mask)
        if GREEDY:
            y = tl.where(x == x, x, float("inf"))  # NaN counts as the largest, as torch.argmax has it
            lane_v, lane_i = lanes_take(y, cols, lane_v, lane_i)
    if GREEDY:
        m, first = lanes_first_max(lane_v, lane_i, start)
        tl.store(PartVal + row * n_chunks + part, m)
        tl.store(PartIdx + row * n_chunks + part, first)


@triton.jit
def _head_argmax_kernel(PartVal, PartIdx, Rows, Sampled, LastToken, n_chunks, PARTS: tl.constexpr):
    row = tl.program_id(0)
    token = parts_first_max(PartVal, PartIdx, row, n_chunks, PARTS)
    tl.store(Sampled + row, token)
    tl.store(LastToken + tl.load(Rows + row), token)


def head_parts(batch: int, vocab: int) -> tuple[int, int]:
    """(logits per program, programs per row) the head epilogue uses for ``batch`` rows of ``vocab``."""
    blocks = triton.cdiv(vocab, HEAD_BLOCK)
    per_row = max(1, min(blocks, triton.cdiv(HEAD_PROGRAMS, batch)))
    chunk = triton.cdiv(blocks, per_row) * HEAD_BLOCK
    return chunk, triton.cdiv(vocab, chunk)


def head_epilogue(logits: torch.Tensor, out: torch.Tensor, state_out: torch.Tensor, rows: torch.Tensor,
                  partials: tuple[torch.Tensor, torch.Tensor] | None = None, sampled: torch.Tensor | None = None,
                  last_token: torch.Tensor | None = None) -> None:
    """logits [B, V] (any float dtype) -> out[:B] and state_out[rows] as float32; with ``partials`` (float32
    and int32 scratch of at least B * head_parts(B, V)[1] elements), greedy: sampled[:B] = argmax (the first
    index of the maximum, as torch.argmax; NaN counts as +inf) and last_token[rows] = the same."""
    batch, vocab = logits.shape
    chunk, n_chunks = head_parts(batch, vocab)
    greedy = partials is not None
    part_val, part_idx = partials if greedy else (out, out)
    _head_widen_kernel[(batch, n_chunks)](logits, out, state_out, rows, part_val, part_idx, vocab, chunk, n_chunks,
                                          logits.stride(0), out.stride(0), state_out.stride(0), GREEDY=greedy,
                                          BLOCK=HEAD_BLOCK, num_warps=8)
    if greedy:
        _head_argmax_kernel[(batch,)](part_val, part_idx, rows, sampled, last_token, n_chunks,
                                      PARTS=triton.next_power_of_2(n_chunks), num_warps=1)


@triton.jit
def _lora_expand_kernel(Low, Mask, B, Y, rows, rank, n, stride_low, stride_mask, stride_b, stride_y,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rm < rows
    col_ok = rn < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        r_ok = rr < rank
        tile = row_ok[:, None] & r_ok[None, :]
        low = tl.load(Low + rm[:, None] * stride_low + rr[None, :], mask=tile, other=0.0)
        keep = tl.load(Mask + rm[:, None] * stride_mask + rr[None, :], mask=tile, other=0.0)
        b = tl.load(B + rr[:, None] * stride_b + rn[None, :], mask=r_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.dot(low * keep, b)  # the mask is 0/1: the product in the low-rank dtype is exact
    out = Y + rm[:, None] * stride_y + rn[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    y = tl.load(out, mask=ok, other=0.0).to(tl.float32)
    tl.store(out, (y + acc).to(Y.dtype.element_ty), mask=ok)


def lora_expand(low: torch.Tensor, mask: torch.Tensor, b: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y [M, N] += (low [M, R] * mask [M, R]) @ b [R, N], in place, in one launch (what ``mask.mul_`` then
    ``y.addmm_`` do in two): the back-up half of the per-request LoRA terms (kernels/lora_rows.StackedLora.add).
    Half precision, rows contiguous in their last dimension; the sum in float32, rounded once into y."""
    rows, rank = low.shape
    n = y.shape[1]
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n, 64))
    _lora_expand_kernel[grid](low, mask, b, y, rows, rank, n, low.stride(0), mask.stride(0), b.stride(0), y.stride(0),
                              BLOCK_M=block_m, BLOCK_R=32, BLOCK_N=64, num_warps=4)
    return y
