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
    tl.store(KPool + dst, k_out.to(KPool.dtype.element_ty), mask=km[:, None])
    v = tl.load(kbase + NUM_KV_HEADS * HEAD_DIM + kh[:, None] * HEAD_DIM + d[None, :], mask=km[:, None])
    tl.store(VPool + dst, v, mask=km[:, None])


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
