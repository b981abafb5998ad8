"""Matrix products for few rows (decode) with the ops around them fused in.

A decode step at small batch reads every weight once and does almost no
arithmetic, so the count of kernels, not their bytes, is what a small model
pays for inside a CUDA graph (SmolLM2-135M at batch 1: ~9 kernels per layer
at ~4 us each). These kernels fold a layer into five launches:

1. ``norm_qkv_rope``: RMSNorm of the residual (prologue), the joint QKV
   projection, rotary on q and k, q into the attention input, k and v into
   their KV slots (epilogue).
2. attention (``flared.model.triton_attention``, unchanged).
3. ``linear_residual``: the output projection added into the residual.
4. ``norm_gate_up_silu``: RMSNorm (prologue), gate and up projections, and
   silu(gate) * up (epilogue) into the MLP activation.
5. ``linear_residual``: the down projection added into the residual.

One kernel does all of it: each program owns a tile of output columns (for
the paired epilogues, a tile and its partner tile: rotary pairs column c
with c + head_dim/2, SwiGLU pairs gate column c with up column I + c), loops
over the input width with ``tl.dot`` on a 16-row tile (rows past the batch
are masked), and applies its epilogue.

Rules:
- Rounding follows the unfused half-precision path step for step: the norm
  output, the projection output and silu(gate) are rounded to the activation
  dtype before the next op uses them; statistics and accumulation in float32.
- Up to ``MAX_ROWS`` rows; larger batches use cuBLAS and ``fused``.
- Half precision only (float32 keeps the torch ops for exact parity).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flared.model.triton_attention import kv_value

MAX_ROWS = 16
_BLOCK_M = 16

_PLAIN, _RESIDUAL, _SILU_PAIR, _ROPE_QKV = 0, 1, 2, 3


@triton.jit
def _skinny_kernel(X, W, Bias, Out, NormW, Cos, Sin, Positions, Slots, KPool, VPool,
                   M, N, K, stride_x, stride_w, stride_out, stride_kv_slot, eps,
                   EPILOGUE: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr, PARTNER: tl.constexpr,
                   NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = tl.arange(0, BLOCK_N)
    if EPILOGUE == 3:
        # Tiles of half a head: columns lo and their rotary partners lo + HEAD_DIM/2.
        tiles_per_head: tl.constexpr = (HEAD_DIM // 2) // BLOCK_N
        head = pid // tiles_per_head
        in_head = (pid % tiles_per_head) * BLOCK_N + offs_n
        cols_a = head * HEAD_DIM + in_head
        n_mask = cols_a < N
    else:
        cols_a = pid * BLOCK_N + offs_n
        n_mask = cols_a < N
    cols_b = cols_a + PARTNER
    dt = X.dtype.element_ty

    if NORM:
        ss = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(X + offs_m[:, None] * stride_x + ks[None, :], mask=m_mask[:, None] & (ks < K)[None, :],
                         other=0.0).to(tl.float32)
            ss += tl.sum(xk * xk, 1)
        inv = tl.rsqrt(ss / K + eps)

    acc_a = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_b = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        xk = tl.load(X + offs_m[:, None] * stride_x + ks[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if NORM:
            nw = tl.load(NormW + ks, mask=k_mask, other=0.0).to(tl.float32)
            xn = (xk.to(tl.float32) * inv[:, None]).to(dt).to(tl.float32)
            xk = (xn * nw[None, :]).to(dt)
        wa = tl.load(W + cols_a[:, None] * stride_w + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc_a += tl.dot(xk, tl.trans(wa))
        if EPILOGUE >= 2:
            wb = tl.load(W + cols_b[:, None] * stride_w + ks[None, :], mask=n_mask[:, None] & k_mask[None, :],
                         other=0.0)
            acc_b += tl.dot(xk, tl.trans(wb))

    if HAS_BIAS:
        acc_a += tl.load(Bias + cols_a, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if EPILOGUE >= 2:
            acc_b += tl.load(Bias + cols_b, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    # The projection's own output, rounded as a separate matmul would store it.
    a = acc_a.to(W.dtype.element_ty).to(tl.float32)
    mask2 = m_mask[:, None] & n_mask[None, :]
    if EPILOGUE == 0:
        tl.store(Out + offs_m[:, None] * stride_out + cols_a[None, :], a.to(Out.dtype.element_ty), mask=mask2)
    elif EPILOGUE == 1:
        ptr = Out + offs_m[:, None] * stride_out + cols_a[None, :]
        r = tl.load(ptr, mask=mask2, other=0.0).to(tl.float32)
        tl.store(ptr, (r + a).to(Out.dtype.element_ty), mask=mask2)
    elif EPILOGUE == 2:
        b = acc_b.to(W.dtype.element_ty).to(tl.float32)
        s = (a * tl.sigmoid(a)).to(dt).to(tl.float32)
        tl.store(Out + offs_m[:, None] * stride_out + cols_a[None, :], (s * b).to(Out.dtype.element_ty), mask=mask2)
    else:
        b = acc_b.to(W.dtype.element_ty).to(tl.float32)
        half: tl.constexpr = HEAD_DIM // 2
        if head < NUM_HEADS + NUM_KV_HEADS:
            pos = tl.load(Positions + offs_m, mask=m_mask, other=0)
            t_lo = pos[:, None] * HEAD_DIM + in_head[None, :]
            cos_lo = tl.load(Cos + t_lo, mask=mask2, other=0.0).to(tl.float32)
            cos_hi = tl.load(Cos + t_lo + half, mask=mask2, other=0.0).to(tl.float32)
            sin_lo = tl.load(Sin + t_lo, mask=mask2, other=0.0).to(tl.float32)  # sign folded in: -sin
            sin_hi = tl.load(Sin + t_lo + half, mask=mask2, other=0.0).to(tl.float32)
            out_lo = a * cos_lo + b * sin_lo
            out_hi = b * cos_hi + a * sin_hi
            # (each branch's pointer has its own name: a float8 pool's pointers are not the activations' type)
            if head < NUM_HEADS:
                q_dst = Out + offs_m[:, None] * stride_out + head * HEAD_DIM + in_head[None, :]
                tl.store(q_dst, out_lo.to(Out.dtype.element_ty), mask=mask2)
                tl.store(q_dst + half, out_hi.to(Out.dtype.element_ty), mask=mask2)
            else:
                slot = tl.load(Slots + offs_m, mask=m_mask, other=0).to(tl.int64)
                k_dst = KPool + slot[:, None] * stride_kv_slot + (head - NUM_HEADS) * HEAD_DIM + in_head[None, :]
                tl.store(k_dst, kv_value(out_lo.to(Out.dtype.element_ty), KPool), mask=mask2)
                tl.store(k_dst + half, kv_value(out_hi.to(Out.dtype.element_ty), KPool), mask=mask2)
        else:
            slot = tl.load(Slots + offs_m, mask=m_mask, other=0).to(tl.int64)
            v_dst = VPool + slot[:, None] * stride_kv_slot + (head - NUM_HEADS - NUM_KV_HEADS) * HEAD_DIM + \
                in_head[None, :]
            tl.store(v_dst, kv_value(a.to(Out.dtype.element_ty), VPool), mask=mask2)
            tl.store(v_dst + half, kv_value(b.to(Out.dtype.element_ty), VPool), mask=mask2)


_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
    for bn, bk, w, s in ((16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 3), (16, 512, 4, 3),
                         (32, 512, 8, 3))
]


def _prune(configs, named_args, **kwargs):
    half = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM", 0)) // 2
    if kwargs.get("EPILOGUE", named_args.get("EPILOGUE")) == _ROPE_QKV:
        configs = [c for c in configs if half % c.kwargs["BLOCK_N"] == 0]
    return configs


# restore_value: the residual epilogue adds in place, so tuning runs must not compound.
_tuned = triton.autotune(_CONFIGS, key=["N", "K", "EPILOGUE", "NORM"], restore_value=["Out"],
                         prune_configs_by={"early_config_prune": _prune})(_skinny_kernel)


def _launch(x, w, bias, out, norm_weight, eps, *, epilogue, partner=0, n, cos=None, sin=None, positions=None,
            slots=None, k_pool=None, v_pool=None, num_heads=0, num_kv_heads=0, head_dim=0):
    rows, width = x.shape
    if rows > MAX_ROWS:
        raise ValueError(f"skinny kernels take at most {MAX_ROWS} rows, got {rows}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("skinny kernels need unit column strides")
    dummy = w
    args = (x, w, bias if bias is not None else dummy, out, norm_weight if norm_weight is not None else dummy,
            cos if cos is not None else dummy, sin if sin is not None else dummy,
            positions if positions is not None else dummy, slots if slots is not None else dummy,
            k_pool if k_pool is not None else dummy, v_pool if v_pool is not None else dummy,
            rows, n, width, x.stride(0), w.stride(0), out.stride(0), k_pool.stride(0) if k_pool is not None else 0,
            eps)
    meta = dict(EPILOGUE=epilogue, NORM=norm_weight is not None, HAS_BIAS=bias is not None, PARTNER=partner,
                NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=_BLOCK_M)

    def grid(m):
        if epilogue == _ROPE_QKV:
            return ((num_heads + 2 * num_kv_heads) * ((head_dim // 2) // m["BLOCK_N"]),)
        return (triton.cdiv(n, m["BLOCK_N"]),)

    _tuned[grid](*args, **meta)


def norm_qkv_rope(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, w_qkv: torch.Tensor,
                  bias: torch.Tensor | None, cos: torch.Tensor, sin_signed: torch.Tensor, positions: torch.Tensor,
                  slots: torch.Tensor, q_out: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, *,
                  num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """h [T, H] residual -> q_out [T, nh, d] (roped); k/v_pool [slots, nkv, d] written at ``slots``."""
    if head_dim % 32:
        raise ValueError(f"head_dim {head_dim} must be a multiple of 32")
    _launch(h, w_qkv, bias, q_out.view(q_out.shape[0], -1), norm_weight, eps, epilogue=_ROPE_QKV,
            partner=head_dim // 2, n=w_qkv.shape[0], cos=cos, sin=sin_signed, positions=positions, slots=slots,
            k_pool=k_pool, v_pool=v_pool, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)


def linear_residual(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor) -> None:
    """residual [T, N] += x [T, K] @ w [N, K]^T (+ bias)."""
    _launch(x, w, bias, residual, None, 0.0, epilogue=_RESIDUAL, n=w.shape[0])


def norm_gate_up_silu(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, w_gate_up: torch.Tensor,
                      out: torch.Tensor) -> None:
    """out [T, I] = silu(g) * u where [g | u] = rms_norm(h) @ w_gate_up [2I, H]^T."""
    inter = w_gate_up.shape[0] // 2
    _launch(h, w_gate_up, None, out, norm_weight, eps, epilogue=_SILU_PAIR, partner=inter, n=inter)


def norm_linear(h: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, w: torch.Tensor,
                out: torch.Tensor) -> None:
    """out [T, N] = rms_norm(h) @ w^T (rounded to w's dtype, stored as out's dtype)."""
    _launch(h, w, None, out, norm_weight, eps, epilogue=_PLAIN, n=w.shape[0])
