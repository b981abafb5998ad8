"""Absorbed latent attention (DeepSeek's MLA as ModelConfig.latent_kv serves it) over the paged pool, as Triton
kernels.

Each token keeps one row in a layer's pool, ``[slot, 1, latent + rope]``: its normed latent (kv_lora_rank wide) and
then the rotated key part all heads share. Every query head's absorbed query is as wide; its score against a token
is q . row, and the token's value is the row's latent part, so the attention's output per head is ``latent`` wide
(the decoder takes it through kv_b's value rows). This is multi-query attention with one key row per token for every
head: a program carries a block of 16 heads (BLOCK_H; tl.dot needs 16 rows), so the row it loads serves all of them.

- ``mla_decode_attention``: one query per sequence; grid (rows, head blocks), or (rows, head blocks, context
  shares) in half precision where the rows are few (flash-decoding: triton_attention's combine kernel merges the
  shares). A row of context length 0 (padding) writes zeros.
- ``mla_prefill_attention_varlen``: several sequences' chunks packed back to back, each over its cached prefix and
  its own rows (causal by absolute position), as ``triton_attention.paged_prefill_attention_varlen`` lays them out;
  a program takes BLOCK_M query rows of one sequence times a block of heads.

Rules (as the other paged kernels'): every length is read on the device, so one CUDA graph serves any batch that fits;
scores and the softmax's sums stay float32; float32 inputs use IEEE dots; a float8 pool's rows widen to float16 and
the dots run in float16. The latent and rope widths need not be powers of two (their lanes are padded and masked).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flared.model.triton_attention import (_check_split_scratch, _combine_splits, _dot, _lanes, _query_for,
                                           chunk_block, rescale)


@triton.jit
def _mla_tiles(q_lat, q_rope, K, block_table, m_i, l_i, acc, begin, end, q_pos, stride_kv_slot, qk_scale,
               PAGE_TOKENS: tl.constexpr, LATENT: tl.constexpr, LAT_PAD: tl.constexpr, ROPE: tl.constexpr,
               ROPE_PAD: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, EXP2: tl.constexpr):
    """Online softmax of the query rows (q_lat [R, LAT_PAD], q_rope [R, ROPE_PAD], each at position q_pos [R]) over
    the key positions [begin, end) they may see (a key after a row's own position is hidden): the running max, the sum
    of exponentials and the unnormalised weighted latents [R, LAT_PAD]."""
    offs_l = tl.arange(0, LAT_PAD)
    offs_r = tl.arange(0, ROPE_PAD)
    for start in range(begin, end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < end
        page = tl.load(block_table + pos // PAGE_TOKENS, mask=valid, other=0)
        slot = page.to(tl.int64) * PAGE_TOKENS + pos % PAGE_TOKENS
        row = K + slot[:, None] * stride_kv_slot
        latent = tl.load(row + offs_l[None, :], mask=_lanes(valid, offs_l, LATENT, LAT_PAD), other=0.0).to(q_lat.dtype)
        turned = tl.load(row + LATENT + offs_r[None, :], mask=_lanes(valid, offs_r, ROPE, ROPE_PAD),
                         other=0.0).to(q_lat.dtype)
        s = (_dot(q_lat, tl.trans(latent), IEEE) + _dot(q_rope, tl.trans(turned), IEEE)) * qk_scale
        s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # (a row that sees nothing yet keeps exp() finite)
        alpha, p = rescale(m_i, m_safe, s, EXP2)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(latent.dtype), latent, IEEE)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _load_queries(Q, rows, heads, ok, stride_q_row, stride_q_head, K, LATENT: tl.constexpr, LAT_PAD: tl.constexpr,
                  ROPE: tl.constexpr, ROPE_PAD: tl.constexpr):
    """The absorbed queries of (rows, heads) [R]: their latent part [R, LAT_PAD] and rotated part [R, ROPE_PAD], as
    the dots over pool K take them."""
    offs_l = tl.arange(0, LAT_PAD)
    offs_r = tl.arange(0, ROPE_PAD)
    base = Q + rows[:, None] * stride_q_row + heads[:, None] * stride_q_head
    q_lat = tl.load(base + offs_l[None, :], mask=_lanes(ok, offs_l, LATENT, LAT_PAD), other=0.0)
    q_rope = tl.load(base + LATENT + offs_r[None, :], mask=_lanes(ok, offs_r, ROPE, ROPE_PAD), other=0.0)
    return _query_for(q_lat, K), _query_for(q_rope, K)


@triton.jit
def _store_out(Out, rows, heads, ok, m_i, l_i, acc, stride_o_row, stride_o_head, LATENT: tl.constexpr,
               LAT_PAD: tl.constexpr):
    offs_l = tl.arange(0, LAT_PAD)
    # A row that saw no key (padding, context 0) has l_i == 0: zeros out, never NaN.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + rows[:, None] * stride_o_row + heads[:, None] * stride_o_head + offs_l[None, :],
             out.to(Out.dtype.element_ty), mask=_lanes(ok, offs_l, LATENT, LAT_PAD))


@triton.jit
def _mla_decode_kernel(Q, K, Out, PartAcc, PartM, PartL, BlockTables, ContextLens, stride_q_row, stride_q_head,
                       stride_kv_slot, stride_o_row, stride_o_head, stride_bt_row, scale, num_heads,
                       PAGE_TOKENS: tl.constexpr, LATENT: tl.constexpr, LAT_PAD: tl.constexpr, ROPE: tl.constexpr,
                       ROPE_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                       EXP2: tl.constexpr, NUM_SPLITS: tl.constexpr = 1):
    # Program (row, head block, split): with NUM_SPLITS > 1 each takes a share of the row's context, whole tiles, and
    # leaves its running max (natural units), sum and weighted latents for triton_attention's combine kernel.
    row = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = heads < num_heads
    context_len = tl.load(ContextLens + row)
    if NUM_SPLITS > 1:
        share = tl.cdiv(tl.cdiv(context_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        begin = tl.program_id(2) * share
        end = tl.minimum(begin + share, context_len)
    else:
        begin = context_len * 0
        end = context_len
    rows = tl.full([BLOCK_H], 0, tl.int64) + row
    q_lat, q_rope = _load_queries(Q, rows, heads, ok, stride_q_row, stride_q_head, K, LATENT, LAT_PAD, ROPE, ROPE_PAD)
    qk_scale = scale
    if EXP2:  # (scores in log2 units: exp2 is the GPU's native exp)
        qk_scale = scale * 1.4426950408889634
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, LAT_PAD], tl.float32)
    m_i, l_i, acc = _mla_tiles(q_lat, q_rope, K, BlockTables + row * stride_bt_row, m_i, l_i, acc, begin, end,
                               tl.full([BLOCK_H], 0, tl.int32) + context_len - 1, stride_kv_slot, qk_scale,
                               PAGE_TOKENS, LATENT, LAT_PAD, ROPE, ROPE_PAD, BLOCK_N, IEEE, EXP2)
    if NUM_SPLITS > 1:
        if EXP2:
            m_i = m_i * 0.6931471805599453
        base = (row * num_heads + heads) * NUM_SPLITS + tl.program_id(2)
        tl.store(PartM + base, m_i, mask=ok)
        tl.store(PartL + base, l_i, mask=ok)
        offs_l = tl.arange(0, LAT_PAD)
        tl.store(PartAcc + base[:, None] * LATENT + offs_l[None, :], acc, mask=_lanes(ok, offs_l, LATENT, LAT_PAD))
    else:
        _store_out(Out, rows, heads, ok, m_i, l_i, acc, stride_o_row, stride_o_head, LATENT, LAT_PAD)


@triton.jit
def _mla_prefill_kernel(Q, K, Out, BlockTables, ChunkMeta, stride_q_row, stride_q_head, stride_kv_slot,
                        stride_o_row, stride_o_head, stride_bt_row, scale, num_seqs, num_heads,
                        SEQS_PAD: tl.constexpr, PAGE_TOKENS: tl.constexpr, LATENT: tl.constexpr,
                        LAT_PAD: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, EXP2: tl.constexpr):
    # Program p of axis 1 is the p-th query block of the packed chunks (walked from the last, so the longest start
    # first), as in triton_attention._prefill_kernel; axis 0 the head blocks.
    pid = tl.num_programs(1) - 1 - tl.program_id(1)
    seq, num_cached, num_new, row_start, block = chunk_block(ChunkMeta, num_seqs, pid, SEQS_PAD, BLOCK_M)
    # Rows of the tile: BLOCK_M tokens times BLOCK_H heads, token-major.
    offs = tl.arange(0, BLOCK_M * BLOCK_H)
    offs_m = block * BLOCK_M + offs // BLOCK_H
    heads = tl.program_id(0) * BLOCK_H + offs % BLOCK_H
    ok = (offs_m < num_new) & (heads < num_heads)
    rows = (row_start + offs_m).to(tl.int64)
    q_lat, q_rope = _load_queries(Q, rows, heads, ok, stride_q_row, stride_q_head, K, LATENT, LAT_PAD, ROPE, ROPE_PAD)
    # Keys up to the block's last real query position, inclusive; none for a block past the chunk's end.
    key_end = tl.minimum(num_cached + (block + 1) * BLOCK_M, num_cached + num_new)
    key_end = tl.where(block * BLOCK_M < num_new, key_end, 0)
    qk_scale = scale
    if EXP2:
        qk_scale = scale * 1.4426950408889634
    m_i = tl.full([BLOCK_M * BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_H, LAT_PAD], tl.float32)
    m_i, l_i, acc = _mla_tiles(q_lat, q_rope, K, BlockTables + seq * stride_bt_row, m_i, l_i, acc, 0, key_end,
                               num_cached + offs_m, stride_kv_slot, qk_scale, PAGE_TOKENS, LATENT, LAT_PAD, ROPE,
                               ROPE_PAD, BLOCK_N, IEEE, EXP2)
    _store_out(Out, rows, heads, ok, m_i, l_i, acc, stride_o_row, stride_o_head, LATENT, LAT_PAD)


BLOCK_H = 16  # heads a program (tl.dot's least rows)


def _pads(q: torch.Tensor, latent_dim: int) -> tuple[int, int, int]:
    """(rope width, latent lanes, rope lanes) of absorbed queries q [T, nh, latent + rope]: powers of two, >= 16."""
    rope = q.shape[2] - latent_dim
    if latent_dim <= 0 or rope <= 0:
        raise ValueError(f"absorbed queries of width {q.shape[2]} hold no latent ({latent_dim}) and rope part")
    return rope, max(16, triton.next_power_of_2(latent_dim)), max(16, triton.next_power_of_2(rope))


def _check(q: torch.Tensor, k_pool: torch.Tensor, out: torch.Tensor, latent_dim: int) -> None:
    if k_pool.dim() != 3 or k_pool.shape[1] != 1 or k_pool.shape[2] != q.shape[2] or k_pool.stride(2) != 1:
        raise ValueError(f"a latent pool is [slots, 1, {q.shape[2]}] with unit stride rows, got {tuple(k_pool.shape)}")
    if out.shape != (q.shape[0], q.shape[1], latent_dim) or q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError(f"out must be [{q.shape[0]}, {q.shape[1]}, {latent_dim}] beside q {tuple(q.shape)}")
    # Triton takes each pool row's start as 16-byte aligned (it vectorises the row's loads up to 16 bytes; a float8
    # row of 56 values faulted on an H100 with a misaligned address). Every released latent row (576, 288, 704
    # values) is; a pool of other widths is refused here rather than faulting in a graph.
    if k_pool.stride(0) * k_pool.element_size() % 16:
        raise ValueError(f"a latent pool's rows must be a multiple of 16 bytes: {k_pool.stride(0)} values of "
                         f"{k_pool.dtype} are {k_pool.stride(0) * k_pool.element_size()}")


def mla_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, out: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, *, latent_dim: int, page_tokens: int, scale: float,
                         num_splits: int = 1, part_acc: torch.Tensor | None = None, part_m: torch.Tensor | None = None,
                         part_l: torch.Tensor | None = None) -> None:
    """q [B, nh, latent + rope] (absorbed queries); k_pool [slots, 1, latent + rope] (a layer's latent rows);
    out [B, nh, latent]; block_tables [B, max_pages] int32; context_lens [B] int32 (0 = padding row).
    ``num_splits`` > 1 (half precision): each row's context in that many shares, merged by a second launch
    (flash-decoding), with float32 scratch part_acc [>= B * nh * splits * latent], part_m / part_l
    [>= B * nh * splits]."""
    _check(q, k_pool, out, latent_dim)
    batch, num_heads, _ = q.shape
    rope, lat_pad, rope_pad = _pads(q, latent_dim)
    ieee = q.dtype == torch.float32
    if num_splits > 1:
        if ieee:
            raise ValueError("float32 decode runs one pass (its summation order is the parity one)")
        _check_split_scratch(batch, num_heads, num_splits, latent_dim, part_acc, part_m)
    else:
        part_acc = part_m = part_l = out
    _mla_decode_kernel[(batch, triton.cdiv(num_heads, BLOCK_H), num_splits)](
        q, k_pool, out, part_acc, part_m, part_l, block_tables, context_lens, q.stride(0), q.stride(1),
        k_pool.stride(0), out.stride(0), out.stride(1), block_tables.stride(0), scale, num_heads,
        PAGE_TOKENS=page_tokens, LATENT=latent_dim, LAT_PAD=lat_pad, ROPE=rope, ROPE_PAD=rope_pad, BLOCK_H=BLOCK_H,
        BLOCK_N=16 if ieee else 32, IEEE=ieee, EXP2=not ieee, NUM_SPLITS=num_splits, num_warps=4)
    if num_splits > 1:
        _combine_splits(part_acc, part_m, part_l, out, batch, num_heads, num_splits, latent_dim)


def decode_splits(batch: int, num_heads: int, num_sms: int, max_splits: int = 16) -> int:
    """Context shares a decode row's programs take: about two programs a multiprocessor over the rows' head blocks
    (1 = one pass)."""
    return max(1, min(max_splits, -(-2 * num_sms // (batch * triton.cdiv(num_heads, BLOCK_H)))))


def mla_prefill_attention_varlen(q: torch.Tensor, k_pool: torch.Tensor, out: torch.Tensor, block_tables: torch.Tensor,
                                 chunk_meta: torch.Tensor, *, latent_dim: int, page_tokens: int, scale: float,
                                 block_m: int = 2) -> None:
    """Several sequences' chunks packed back to back in the rows of q [T_cap, nh, latent + rope] (rows past the last
    chunk ignored and never written), their latent rows already in k_pool [slots, 1, latent + rope]; out
    [T_cap, nh, latent]; block_tables [B, max_pages] int32; chunk_meta [B, 2] int32 = (num_cached_tokens,
    num_new_tokens), (0, 0) = padding."""
    _check(q, k_pool, out, latent_dim)
    if chunk_meta.stride(0) != 2 or chunk_meta.stride(1) != 1:
        raise ValueError("chunk_meta must be a contiguous [B, 2] tensor")
    capacity, num_heads, _ = q.shape
    num_seqs = chunk_meta.shape[0]
    rope, lat_pad, rope_pad = _pads(q, latent_dim)
    ieee = q.dtype == torch.float32
    blocks = triton.cdiv(capacity, block_m) + num_seqs - 1  # (each sequence adds at most one partial block)
    _mla_prefill_kernel[(triton.cdiv(num_heads, BLOCK_H), blocks)](
        q, k_pool, out, block_tables, chunk_meta, q.stride(0), q.stride(1), k_pool.stride(0), out.stride(0),
        out.stride(1), block_tables.stride(0), scale, num_seqs, num_heads,
        SEQS_PAD=max(16, triton.next_power_of_2(num_seqs)), PAGE_TOKENS=page_tokens, LATENT=latent_dim,
        LAT_PAD=lat_pad, ROPE=rope, ROPE_PAD=rope_pad, BLOCK_H=BLOCK_H, BLOCK_M=block_m, BLOCK_N=16 if ieee else 32,
        IEEE=ieee, EXP2=not ieee, num_warps=8 if block_m > 1 else 4)
