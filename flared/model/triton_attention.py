"""Paged attention on a CUDA GPU, as Triton kernels.

Two kernels over the same paged KV pool (``[slot, kv_head, head_dim]`` per
layer; a token at position ``p`` of a sequence lives in slot
``block_table[p // page_tokens] * page_tokens + p % page_tokens``):

- ``paged_decode_attention``: one query token per sequence, a batch of
  sequences; grid (batch rows, kv heads); each program carries the whole
  query-head group of its kv head so K/V are read once per group.
- ``paged_prefill_attention_varlen``: the chunks of new tokens of several
  sequences, packed back to back in the token rows, whose K/V are already
  written to the pool; each sequence has its own block-table row and
  ``(num_cached_tokens, num_new_tokens)``, its cached prefix visible (chunked
  prefill over a cached prefix); grid (query heads, packed query blocks), the
  blocks walked from the last so the longest start first; causal by absolute
  position, the mask applied only on the tiles that cross a block's diagonal.
  ``paged_prefill_attention`` is its one-sequence form.

Rules:
- Every length a kernel needs is read on the device (context lengths, the
  chunk's start and size), so a CUDA graph captured once serves any batch
  that fits its capacity. Rows beyond the real batch carry context length 0
  and write zeros; query blocks beyond the real chunks write nothing, and a
  prefill sequence with (0, 0) meta (padding) owns no rows.
- Scores, the running max and the softmax sum stay float32 for every dtype;
  float32 inputs use IEEE dots (not TF32) so float32 runs match the CPU path
  and transformers to rounding.
- A float8 pool (``kv_cache_dtype`` fp8: torch.float8_e4m3fn, one byte a value, no scale) holds what a
  half-precision one would, saturated at e4m3's largest finite value (448) where a plain conversion would
  overflow to NaN (``kv_value``); the kernels widen what they load to float16 and run their dots in float16
  (``_query_for``). A token's key is the stored one for every reader, its own step's included.
- Sliding windows (Mistral): ``window`` > 0 lets a query at position p see
  the keys at positions (p - window, p] only, as transformers' sliding-window
  mask does; 0 (the default) sees every earlier key. The window is a compile-
  time constant: models without one run the kernels as they were.
- Soft caps (Gemma 2): ``softcap`` > 0 puts each scaled score through
  cap * tanh(score / cap) before its softmax (every kernel but the rotary
  one); 0, the default, compiles the kernels as they were.
- Sinks (gpt-oss): ``sinks`` [nh], a logit per query head that joins each
  softmax's denominator and gives no value (the one-pass decode kernel and
  the prefill kernel; the split decode has none). Also a compile-time
  switch: without sinks the kernels are as they were.
- ALiBi (BLOOM): ``alibi`` [nh], a slope per query head; a score gains
  slope * (key position - query position) after its scale (the one-pass
  decode kernel and the prefill kernel). A compile-time switch, read
  through the sinks' pointer (no model has both).
- Head dims that are not powers of two (Phi-2's 80, DeepSeek's latent
  attention's 192): Triton's tiles are, so the plain decode, split decode
  and prefill kernels run a head in HEAD_PAD = next_power_of_2(d) lanes,
  the lanes past d masked on every load and store (zeros in the dots). A
  power-of-two head compiles the kernels as they were.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def kv_value(x, Pool):
    """``x`` as the KV pool ``Pool`` stores it: its element type; into a float8 pool saturated at +-448 (e4m3's
    largest finite value, kv_cache.FP8_MAX) where a plain conversion would overflow to NaN."""
    if Pool.dtype.element_ty == tl.float8e4nv:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
    return x.to(Pool.dtype.element_ty)


@triton.jit
def _query_for(q, K):
    """The query as the dots over pool ``K`` take it: as it is, or over a float8 pool in float16 (float8 e4m3
    widens to float16 exactly, a pair in one instruction on sm_89+, where bfloat16 takes three; float16's 10
    mantissa bits hold a bf16 query's 8, its range clamped at +-65504)."""
    if K.dtype.element_ty == tl.float8e4nv:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    return q


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b; IEEE float32 products (not TF32) where IEEE, so float32 runs keep the CPU path's roundings."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _window_start(end, WINDOW: tl.constexpr):
    """The first key position a query at position ``end`` - 1 sees: ``end`` - WINDOW (not below 0) with a sliding
    window, else 0."""
    if WINDOW > 0:
        return tl.maximum(end - WINDOW, 0)
    return end * 0


@triton.jit
def _soft_cap(x, CAP: tl.constexpr):
    """cap * tanh(x / cap) in float32 (Gemma 2's scores), as 1 - 2 / (exp(2y) + 1) with y clamped where tanh is
    already +-1."""
    y = tl.minimum(tl.maximum(x / CAP, -20.0), 20.0)
    return CAP * (1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))


@triton.jit
def _with_sinks(m_i, l_i, acc, sink):
    """The running (max, sum, weighted values) with one more softmax term of logit ``sink`` (in the units of
    m_i) and no value: the sum grows by exp(sink - max), the values only rescale."""
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp(m_i - m_new)
    return l_i * alpha + tl.exp(sink - m_new), acc * alpha[:, None]


@triton.jit
def rescale(m_i, m_new, s, EXP2: tl.constexpr):
    """An online softmax's step to the running max ``m_new`` from ``m_i``: (the factor the sums so far take, the new
    scores' exponentials [R, N]), exp2 where the scores are in log2 units (EXP2), else exp."""
    if EXP2:
        return tl.exp2(m_i - m_new), tl.exp2(s - m_new[:, None])
    return tl.exp(m_i - m_new), tl.exp(s - m_new[:, None])


@triton.jit
def _lanes(rows_ok, offs_d, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """``rows_ok`` [R] as the mask of an [R, HEAD_PAD] tile: the lanes past HEAD_DIM masked too where a head is
    padded to a power of two; a power-of-two head's mask the rows' alone (``& true`` folds away)."""
    if HEAD_PAD == HEAD_DIM:
        return rows_ok[:, None] & tl.full([1, HEAD_PAD], 1, tl.int1)
    return rows_ok[:, None] & (offs_d[None, :] < HEAD_DIM)


@triton.jit
def _decode_tiles(q, K, V, BlockTables, row, kv_head, begin, end, stride_kv_slot, stride_kv_head, stride_bt_row,
                  scale, PAGE_TOKENS: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_N: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr, HEAD_PAD: tl.constexpr,
                  slopes, q_pos, ALIBI: tl.constexpr):
    """Online softmax of one row's query-head group over its key positions [begin, end): the running max,
    the sum of exponentials and the unnormalised weighted values [GROUP_PAD, HEAD_PAD]. ALIBI: each head's score
    gains slopes [GROUP_PAD] * (key position - q_pos)."""
    offs_d = tl.arange(0, HEAD_PAD)
    q = _query_for(q, K)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    for start in range(begin, end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < end
        page = tl.load(BlockTables + row * stride_bt_row + pos // PAGE_TOKENS, mask=valid, other=0)
        slot = page.to(tl.int64) * PAGE_TOKENS + pos % PAGE_TOKENS
        kv_off = slot[:, None] * stride_kv_slot + kv_head * stride_kv_head + offs_d[None, :]
        k = tl.load(K + kv_off, mask=_lanes(valid, offs_d, HEAD_DIM, HEAD_PAD), other=0.0).to(q.dtype)
        s = _dot(q, tl.trans(k), IEEE) * scale
        if SOFTCAP > 0:
            s = _soft_cap(s, SOFTCAP)
        if ALIBI:
            s = s + slopes[:, None] * (pos - q_pos).to(tl.float32)[None, :]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kv_off, mask=_lanes(valid, offs_d, HEAD_DIM, HEAD_PAD), other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _decode_kernel(Q, K, V, Out, BlockTables, ContextLens, Sinks,
                   stride_q_row, stride_q_head, stride_kv_slot, stride_kv_head, stride_o_row, stride_o_head,
                   stride_bt_row, scale,
                   PAGE_TOKENS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_N: tl.constexpr, IEEE: tl.constexpr, WINDOW: tl.constexpr = 0, SINKS: tl.constexpr = False,
                   SOFTCAP: tl.constexpr = 0.0, HEAD_PAD: tl.constexpr = 0, ALIBI: tl.constexpr = False):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(ContextLens + row)
    first = _window_start(context_len, WINDOW)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    q = tl.load(Q + row * stride_q_row + heads[:, None] * stride_q_head + offs_d[None, :],
                mask=_lanes(g_mask, offs_d, HEAD_DIM, HEAD_PAD), other=0.0)
    if ALIBI:  # (the slopes through the sinks' pointer)
        slopes = tl.load(Sinks + heads, mask=g_mask, other=0.0).to(tl.float32)
    else:
        slopes = tl.zeros([GROUP_PAD], tl.float32)
    m_i, l_i, acc = _decode_tiles(q, K, V, BlockTables, row, kv_head, first, context_len, stride_kv_slot,
                                  stride_kv_head, stride_bt_row, scale, PAGE_TOKENS, GROUP_PAD, HEAD_DIM, BLOCK_N, IEEE,
                                  SOFTCAP, HEAD_PAD, slopes, context_len - 1, ALIBI)
    if SINKS:  # (a padding row's sum is then exp(0) and its values zero: zeros out)
        l_i, acc = _with_sinks(m_i, l_i, acc, tl.load(Sinks + heads, mask=g_mask, other=0.0).to(tl.float32))
    # Padding rows (context 0) have l_i == 0: write zeros, never NaN, so a later reduction stays clean.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + row * stride_o_row + heads[:, None] * stride_o_head + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=_lanes(g_mask, offs_d, HEAD_DIM, HEAD_PAD))


@triton.jit
def _prefill_tiles(q, K, V, block_table, m_i, l_i, acc, begin, end, q_pos, key_end, kv_head, stride_kv_slot,
                   stride_kv_head, qk_scale, PAGE_TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_N: tl.constexpr, IEEE: tl.constexpr, MASKED: tl.constexpr, EXP2: tl.constexpr,
                   WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HEAD_PAD: tl.constexpr, slope, ALIBI: tl.constexpr):
    """Online softmax of a query block over key positions [begin, end). MASKED: keys past ``key_end``, after a
    row's own position or (WINDOW > 0) WINDOW or more before it are hidden; otherwise every key of the range is
    visible to every row. ALIBI: each score gains ``slope`` * (key position - the row's position)."""
    offs_d = tl.arange(0, HEAD_PAD)
    all_keys = tl.full([BLOCK_N], 1, tl.int1)
    q = _query_for(q, K)
    for start in range(begin, end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        if MASKED:
            valid = (pos < key_end) & (pos < end)  # a range's last tile stops at its end (the window's edge)
            page = tl.load(block_table + pos // PAGE_TOKENS, mask=valid, other=0)
        else:
            page = tl.load(block_table + pos // PAGE_TOKENS)
        slot = page.to(tl.int64) * PAGE_TOKENS + pos % PAGE_TOKENS
        kv_off = slot[:, None] * stride_kv_slot + kv_head * stride_kv_head + offs_d[None, :]
        if MASKED:
            k = tl.load(K + kv_off, mask=_lanes(valid, offs_d, HEAD_DIM, HEAD_PAD), other=0.0).to(q.dtype)
        elif HEAD_PAD == HEAD_DIM:
            k = tl.load(K + kv_off).to(q.dtype)
        else:
            k = tl.load(K + kv_off, mask=_lanes(all_keys, offs_d, HEAD_DIM, HEAD_PAD), other=0.0).to(q.dtype)
        s = _dot(q, tl.trans(k), IEEE)
        s = s * qk_scale
        if SOFTCAP > 0:  # (capped in natural units; back to log2 ones with EXP2)
            if EXP2:
                s = _soft_cap(s * 0.6931471805599453, SOFTCAP) * 1.4426950408889634
            else:
                s = _soft_cap(s, SOFTCAP)
        if ALIBI:  # (in log2 units with EXP2)
            bias = slope * (pos[None, :] - q_pos[:, None]).to(tl.float32)
            if EXP2:
                bias = bias * 1.4426950408889634
            s = s + bias
        if MASKED:
            visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
            if WINDOW > 0:
                visible = visible & (pos[None, :] > q_pos[:, None] - WINDOW)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:
            # A row can see nothing in a tile (all -inf); keep exp() finite by subtracting 0 then.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_safe = m_new
        alpha, p = rescale(m_i, m_safe, s, EXP2)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(V + kv_off, mask=_lanes(valid, offs_d, HEAD_DIM, HEAD_PAD), other=0.0).to(q.dtype)
        elif HEAD_PAD == HEAD_DIM:
            v = tl.load(V + kv_off).to(q.dtype)
        else:
            v = tl.load(V + kv_off, mask=_lanes(all_keys, offs_d, HEAD_DIM, HEAD_PAD), other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def chunk_block(ChunkMeta, num_seqs, pid, SEQS_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Query block ``pid`` of the packed chunks that ChunkMeta [B, 2] (cached, new) describes: (its sequence, that
    sequence's cached and new tokens, its first row, the block's index within the sequence). Sequence s owns blocks
    [sum_{j<s} cdiv(new_j, BLOCK_M), sum_{j<=s} ...) and rows [sum_{j<s} new_j, sum_{j<=s} new_j); a block past the
    last finds no sequence and every field but the first is then 0."""
    offs_s = tl.arange(0, SEQS_PAD)
    s_mask = offs_s < num_seqs
    cached_all = tl.load(ChunkMeta + offs_s * 2, mask=s_mask, other=0)
    new_all = tl.load(ChunkMeta + offs_s * 2 + 1, mask=s_mask, other=0)
    blocks_all = (new_all + BLOCK_M - 1) // BLOCK_M
    blocks_end = tl.cumsum(blocks_all, 0)
    rows_end = tl.cumsum(new_all, 0)
    seq = tl.sum((blocks_end <= pid).to(tl.int32), 0)
    sel = offs_s == seq  # all false past the last sequence: every field below is then 0
    num_cached = tl.sum(tl.where(sel, cached_all, 0), 0)
    num_new = tl.sum(tl.where(sel, new_all, 0), 0)
    row_start = tl.sum(tl.where(sel, rows_end - new_all, 0), 0)
    block = pid - tl.sum(tl.where(sel, blocks_end - blocks_all, 0), 0)
    return seq, num_cached, num_new, row_start, block


@triton.jit
def _prefill_kernel(Q, K, V, Out, BlockTables, ChunkMeta, Sinks,
                    stride_q_row, stride_q_head, stride_kv_slot, stride_kv_head, stride_o_row, stride_o_head,
                    stride_bt_row, scale, num_seqs,
                    SEQS_PAD: tl.constexpr, PAGE_TOKENS: tl.constexpr, GROUP: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                    HEADS_FAST: tl.constexpr, HEAVY_FIRST: tl.constexpr, SPLIT_MASK: tl.constexpr,
                    EXP2: tl.constexpr, WINDOW: tl.constexpr = 0, SINKS: tl.constexpr = False,
                    SOFTCAP: tl.constexpr = 0.0, HEAD_PAD: tl.constexpr = 0, ALIBI: tl.constexpr = False):
    # Program p of the block axis is the p-th query block of the packed chunks: sequence s owns blocks
    # [sum_{j<s} cdiv(new_j, BLOCK_M), sum_{j<=s} ...) and rows [sum_{j<s} new_j, sum_{j<=s} new_j).
    # Both prefix sums come from ChunkMeta on the device; programs past the last block find no sequence.
    # HEADS_FAST puts the heads on grid axis 0, so the blocks the GPU starts first are one query block of
    # every head; HEAVY_FIRST walks the blocks from the last (a causal block's keys grow with its index),
    # so the longest programs start first and the short ones fill the tail.
    if HEADS_FAST:
        head = tl.program_id(0)
        pid = tl.program_id(1)
        num_blocks = tl.num_programs(1)
    else:
        pid = tl.program_id(0)
        head = tl.program_id(1)
        num_blocks = tl.num_programs(0)
    if HEAVY_FIRST:
        pid = num_blocks - 1 - pid
    kv_head = head // GROUP
    seq, num_cached, num_new, row_start, block = chunk_block(ChunkMeta, num_seqs, pid, SEQS_PAD, BLOCK_M)
    block_table = BlockTables + seq * stride_bt_row
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    m_mask = offs_m < num_new
    rows = (row_start + offs_m).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_q_row + head * stride_q_head + offs_d[None, :],
                mask=_lanes(m_mask, offs_d, HEAD_DIM, HEAD_PAD), other=0.0)
    q_pos = num_cached + offs_m
    # Keys up to this block's last real query position, inclusive; 0 for a block past the chunk's end.
    key_end = tl.minimum(num_cached + (block + 1) * BLOCK_M, num_cached + num_new)
    key_end = tl.where(block * BLOCK_M < num_new, key_end, 0)
    if EXP2:
        qk_scale = scale * 1.4426950408889634  # scores in log2 units: exp2 is the GPU's native exp
    else:
        qk_scale = scale
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    if ALIBI:  # (the head's slope through the sinks' pointer)
        slope = tl.load(Sinks + head).to(tl.float32)
    else:
        slope = 0.0
    first_q = num_cached + block * BLOCK_M
    # With a window, the block's first row sees no key before ``lo``; keys from ``all_lo`` on are inside every
    # row's window (its last row's, key_end - 1, starts latest). Without one both are 0.
    lo = _window_start(first_q + 1, WINDOW)
    all_lo = _window_start(key_end, WINDOW)
    if SPLIT_MASK:
        # Keys before the block's first query position that every row's window holds are visible to every row:
        # they run without masks; the tiles before them (the window's edge) and from the block's first position
        # to key_end (the diagonal) are masked.
        full_end = tl.minimum(first_q // BLOCK_N * BLOCK_N, key_end)
        if WINDOW > 0:
            # the unmasked tiles end at full_end and start at or after all_lo, in whole tiles (their last one must
            # not run past full_end); the masked edge takes the keys from lo up to them
            unmasked_from = tl.maximum(lo, tl.minimum(all_lo, full_end))
            full_end = tl.maximum(full_end, unmasked_from)
            edge_end = full_end - (full_end - unmasked_from) // BLOCK_N * BLOCK_N
            m_i, l_i, acc = _prefill_tiles(q, K, V, block_table, m_i, l_i, acc, lo, edge_end, q_pos, key_end,
                                           kv_head, stride_kv_slot, stride_kv_head, qk_scale, PAGE_TOKENS, HEAD_DIM,
                                           BLOCK_N, IEEE, True, EXP2, WINDOW, SOFTCAP, HEAD_PAD,
                                           slope, ALIBI)
        else:
            edge_end = 0
        m_i, l_i, acc = _prefill_tiles(q, K, V, block_table, m_i, l_i, acc, edge_end, full_end, q_pos, key_end,
                                       kv_head, stride_kv_slot, stride_kv_head, qk_scale, PAGE_TOKENS, HEAD_DIM,
                                       BLOCK_N, IEEE, False, EXP2, WINDOW, SOFTCAP, HEAD_PAD,
                                       slope, ALIBI)
    else:
        full_end = lo
    m_i, l_i, acc = _prefill_tiles(q, K, V, block_table, m_i, l_i, acc, full_end, key_end, q_pos, key_end, kv_head,
                                   stride_kv_slot, stride_kv_head, qk_scale, PAGE_TOKENS, HEAD_DIM, BLOCK_N, IEEE,
                                   True, EXP2, WINDOW, SOFTCAP, HEAD_PAD, slope, ALIBI)
    if SINKS:  # the head's sink in the scores' units (log2 ones with EXP2, where exp2 of them is exp)
        sink = tl.load(Sinks + head).to(tl.float32)
        if EXP2:
            l_i, acc = _with_sinks(m_i * 0.6931471805599453, l_i, acc, sink)
        else:
            l_i, acc = _with_sinks(m_i, l_i, acc, sink)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + rows[:, None] * stride_o_row + head * stride_o_head + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=_lanes(m_mask, offs_d, HEAD_DIM, HEAD_PAD))


def _decode_warps(k_pool: torch.Tensor) -> int:
    """Warps of a decode attention program: 2 over a float8 pool (8B shape, 64 rows at 256 tokens on the H200, the
    fused kernel: 18.9 us a layer against 26.5 with 4; tools/probe_decode_attention.py --fp8-grid), else 4."""
    return 2 if k_pool.dtype == torch.float8_e4m3fn else 4


def _per_head(q: torch.Tensor, sinks: torch.Tensor | None, alibi: torch.Tensor | None) -> torch.Tensor:
    """What the kernels' per-head pointer reads: the sinks, the ALiBi slopes (one pointer: no model has both), or q
    as a placeholder where neither is on."""
    if sinks is not None and alibi is not None:
        raise ValueError("attention sinks and ALiBi slopes together are not supported")
    return sinks if sinks is not None else alibi if alibi is not None else q


def _head_pad(head_dim: int) -> int:
    """The lanes a kernel runs a head in: head_dim up to the next power of two (Triton's tiles are)."""
    return triton.next_power_of_2(head_dim)


def _decode_block_n(head_dim: int) -> int:
    """Keys a decode tile: 64, 32 for heads wider than 128 lanes, 16 from 512 (their tiles' registers)."""
    lanes = _head_pad(head_dim)
    return 64 if lanes <= 128 else 32 if lanes < 512 else 16


def _group_pad(group: int) -> int:
    # tl.dot needs at least 16 rows.
    return max(16, triton.next_power_of_2(group))


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, *, page_tokens: int,
                           scale: float, window: int = 0, sinks: torch.Tensor | None = None,
                           softcap: float = 0.0, alibi: torch.Tensor | None = None) -> None:
    """q [B, nh, d]; k_pool/v_pool [slots, nkv, d]; out [B, nh, d];
    block_tables [B, max_pages] int32; context_lens [B] int32 (0 = padding row); ``window``: a sliding window's
    keys (0: none); ``sinks``: [nh] a logit per query head in each softmax (None: none); ``softcap``: Gemma 2's
    cap on the scaled scores (0: none); ``alibi``: [nh] float32 ALiBi slopes (None: none; not with sinks)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    group = num_heads // num_kv_heads
    _decode_kernel[(batch, num_kv_heads)](
        q, k_pool, v_pool, out, block_tables, context_lens, _per_head(q, sinks, alibi),
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), scale,
        PAGE_TOKENS=page_tokens, GROUP=group, GROUP_PAD=_group_pad(group), HEAD_DIM=head_dim,
        BLOCK_N=_decode_block_n(head_dim), IEEE=q.dtype == torch.float32, WINDOW=window,
        SINKS=sinks is not None, SOFTCAP=float(softcap or 0.0), HEAD_PAD=_head_pad(head_dim), ALIBI=alibi is not None,
        num_warps=_decode_warps(k_pool))


# The bf16 prefill kernel's launch: tiles, warps, pipeline stages and the schedule knobs of _prefill_kernel.
# tools/probe_prefill_attention.py times the alternatives; the knobs off with 128-row blocks of 8 warps are the
# third session's kernel. On an H200 (docs/benchmarks.md, twentieth session) this setting took a 2048-token
# 8B layer from 236 to 115 us, and 16 sequences of 128 tokens from 46 to 33 us.
PREFILL_CONFIG = dict(block_m=64, block_n=64, num_warps=4, num_stages=2, heads_fast=True, heavy_first=True,
                      split_mask=True, exp2=True)
# float32 tiles are twice the bytes: smaller blocks keep them in shared memory; exp, not exp2, keeps float32
# runs at the CPU path's roundings.
PREFILL_CONFIG_F32 = dict(block_m=64, block_n=32, num_warps=4, num_stages=2, heads_fast=True, heavy_first=True,
                          split_mask=True, exp2=False)
# Heads of 512 lanes (Gemma 4's global layers): tiles a quarter of the keys' and half the queries' rows, so that the
# query block, the stages of keys and values and the float32 accumulator still fit a multiprocessor.
PREFILL_WIDE = dict(block_m=32, block_n=32, num_warps=8, num_stages=2)
PREFILL_WIDE_F32 = dict(block_m=32, block_n=16, num_warps=8, num_stages=1)


def paged_prefill_attention_varlen(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor,
                                   block_tables: torch.Tensor, chunk_meta: torch.Tensor, *, page_tokens: int,
                                   scale: float, config: dict | None = None, window: int = 0,
                                   sinks: torch.Tensor | None = None, softcap: float = 0.0,
                                   alibi: torch.Tensor | None = None) -> None:
    """Several sequences' chunks packed back to back in the rows of q (sequence s's rows start after the
    new tokens of sequences 0..s-1; rows past the last chunk are ignored and never written); ``window``: a sliding
    window's keys (0: none); ``sinks``: [nh] a logit per query head in each softmax (None: none); ``softcap``:
    Gemma 2's cap on the scaled scores (0: none); ``alibi``: [nh] float32 ALiBi slopes (None: none).
    q [T_cap, nh, d]; out [T_cap, nh, d]; block_tables [B, max_pages] int32 (row s: sequence s);
    chunk_meta [B, 2] int32 = (num_cached_tokens, num_new_tokens) per sequence, (0, 0) = padding.
    ``config``: PREFILL_CONFIG's keys, to override (benchmarks)."""
    capacity, num_heads, head_dim = q.shape
    num_seqs = chunk_meta.shape[0]
    num_kv_heads = k_pool.shape[1]
    if chunk_meta.stride(0) != 2 or chunk_meta.stride(1) != 1:
        raise ValueError("chunk_meta must be a contiguous [B, 2] tensor")
    ieee = q.dtype == torch.float32
    wide = PREFILL_WIDE_F32 if ieee else PREFILL_WIDE
    c = dict(PREFILL_CONFIG_F32 if ieee else PREFILL_CONFIG, **(wide if _head_pad(head_dim) >= 512 else {}),
             **(config or {}))
    block_m = c["block_m"]
    # At most cdiv(T, BLOCK_M) + B - 1 query blocks hold rows (each sequence adds at most one partial block).
    blocks = triton.cdiv(capacity, block_m) + num_seqs - 1
    grid = (num_heads, blocks) if c["heads_fast"] else (blocks, num_heads)
    _prefill_kernel[grid](
        q, k_pool, v_pool, out, block_tables, chunk_meta, _per_head(q, sinks, alibi),
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), scale, num_seqs,
        # One compiled variant serves every batch up to 16 sequences (the lanes past num_seqs are masked).
        SEQS_PAD=max(16, triton.next_power_of_2(num_seqs)), PAGE_TOKENS=page_tokens,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=c["block_n"], IEEE=ieee,
        HEADS_FAST=c["heads_fast"], HEAVY_FIRST=c["heavy_first"], SPLIT_MASK=c["split_mask"], EXP2=c["exp2"],
        WINDOW=window, SINKS=sinks is not None, SOFTCAP=float(softcap or 0.0), HEAD_PAD=_head_pad(head_dim),
        ALIBI=alibi is not None, num_warps=c["num_warps"],
        num_stages=c["num_stages"])


def paged_prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor,
                            block_table: torch.Tensor, chunk_meta: torch.Tensor, *, page_tokens: int,
                            scale: float, window: int = 0) -> None:
    """One sequence (the varlen kernel with B = 1): q [T_cap, nh, d] (rows past the chunk ignored);
    out [T_cap, nh, d]; block_table [max_pages] int32; chunk_meta [2] int32 = (num_cached_tokens,
    num_new_tokens)."""
    paged_prefill_attention_varlen(q, k_pool, v_pool, out, block_table.view(1, -1), chunk_meta.view(1, 2),
                                   page_tokens=page_tokens, scale=scale, window=window)


# -- split-context decode (flash-decoding) -----------------------------------------------------------
#
# At small batch the decode kernel has batch x kv_heads programs (3 for SmolLM2 at batch 1), each walking
# its whole context one dependent tile after another: the step is latency-bound. The split form gives
# every (row, kv head) NUM_SPLITS programs, each over an equal share of the context (the share is
# computed on the device from the row's context length, so one captured graph serves every length),
# writing an unnormalised partial (running max, sum, weighted values); a second kernel combines them.


@triton.jit
def _split_share(context_len, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr):
    """Key positions [begin, end) of context share ``split`` of the keys the row's query sees (its last WINDOW
    with a sliding window): whole tiles, the last share shorter or empty."""
    first = _window_start(context_len, WINDOW)
    share = tl.cdiv(tl.cdiv(context_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    begin = first + split * share
    return begin, tl.minimum(begin + share, context_len)


@triton.jit
def _decode_split_kernel(Q, K, V, PartAcc, PartM, PartL, BlockTables, ContextLens,
                         stride_q_row, stride_q_head, stride_kv_slot, stride_kv_head, stride_bt_row, scale,
                         NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, PAGE_TOKENS: tl.constexpr,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_N: tl.constexpr, WINDOW: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0,
                         HEAD_PAD: tl.constexpr = 0):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(ContextLens + row)
    begin, end = _split_share(context_len, split, NUM_SPLITS, BLOCK_N, WINDOW)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    q = tl.load(Q + row * stride_q_row + heads[:, None] * stride_q_head + offs_d[None, :],
                mask=_lanes(g_mask, offs_d, HEAD_DIM, HEAD_PAD), other=0.0)
    m_i, l_i, acc = _decode_tiles(q, K, V, BlockTables, row, kv_head, begin, end, stride_kv_slot, stride_kv_head,
                                  stride_bt_row, scale, PAGE_TOKENS, GROUP_PAD, HEAD_DIM, BLOCK_N, False, SOFTCAP,
                                  HEAD_PAD, 0.0, 0, False)
    base = (row * NUM_HEADS + heads) * NUM_SPLITS + split  # [GROUP_PAD]
    tl.store(PartM + base, m_i, mask=g_mask)
    tl.store(PartL + base, l_i, mask=g_mask)
    tl.store(PartAcc + base[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=_lanes(g_mask, offs_d, HEAD_DIM, HEAD_PAD))


@triton.jit
def _decode_combine_kernel(PartAcc, PartM, PartL, Out, stride_o_row, stride_o_head,
                           NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                           HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    s_mask = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, HEAD_PAD)
    base = (row * NUM_HEADS + head) * NUM_SPLITS + offs_s
    m = tl.load(PartM + base, mask=s_mask, other=float("-inf"))
    l = tl.load(PartL + base, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)  # a padding row: every split empty
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_safe))
    total = tl.sum(w * l, 0)
    acc = tl.load(PartAcc + base[:, None] * HEAD_DIM + offs_d[None, :], mask=_lanes(s_mask, offs_d, HEAD_DIM, HEAD_PAD),
                  other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    if HEAD_PAD == HEAD_DIM:
        tl.store(Out + row * stride_o_row + head * stride_o_head + offs_d, out.to(Out.dtype.element_ty))
    else:
        tl.store(Out + row * stride_o_row + head * stride_o_head + offs_d, out.to(Out.dtype.element_ty),
                 mask=offs_d < HEAD_DIM)


def _check_split_scratch(batch, num_heads, num_splits, head_dim, part_acc, part_m) -> None:
    if (part_m is None or part_acc is None or part_m.numel() < batch * num_heads * num_splits
            or part_acc.numel() < batch * num_heads * num_splits * head_dim):
        raise ValueError("split-decode scratch is too small for this batch")


def _combine_splits(part_acc, part_m, part_l, out, batch, num_heads, num_splits, head_dim) -> None:
    """The second launch of a split decode: each (row, head)'s partials merged into ``out``."""
    _decode_combine_kernel[(batch, num_heads)](
        part_acc, part_m, part_l, out, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, NUM_SPLITS=num_splits, SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
        HEAD_DIM=head_dim, HEAD_PAD=_head_pad(head_dim), num_warps=4)


def supports_pdl() -> bool:
    """Whether this Triton has the programmatic-dependent-launch intrinsics (``paged_decode_attention_rope(pdl=)``)."""
    try:
        from triton.language.extra import cuda  # the kernels reach it as tl.extra.cuda
    except ImportError:
        return False
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


def decode_splits(batch: int, num_kv_heads: int, num_sms: int, max_splits: int = 16) -> int:
    """Context splits that give a decode step about two programs per SM (1 = the plain kernel)."""
    return max(1, min(max_splits, -(-2 * num_sms // (batch * num_kv_heads))))


def paged_decode_attention_split(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor,
                                 block_tables: torch.Tensor, context_lens: torch.Tensor, part_acc: torch.Tensor,
                                 part_m: torch.Tensor, part_l: torch.Tensor, *, num_splits: int, page_tokens: int,
                                 scale: float, window: int = 0, softcap: float = 0.0) -> None:
    """As ``paged_decode_attention`` (half precision, no sinks), over ``num_splits`` context shares per row and kv
    head.
    Scratch: part_acc [>= B * nh * num_splits * d], part_m / part_l [>= B * nh * num_splits], float32."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    group = num_heads // num_kv_heads
    _check_split_scratch(batch, num_heads, num_splits, head_dim, part_acc, part_m)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_pool, v_pool, part_acc, part_m, part_l, block_tables, context_lens,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), block_tables.stride(0), scale,
        NUM_HEADS=num_heads, NUM_SPLITS=num_splits, PAGE_TOKENS=page_tokens, GROUP=group,
        GROUP_PAD=_group_pad(group), HEAD_DIM=head_dim, BLOCK_N=_decode_block_n(head_dim), WINDOW=window,
        SOFTCAP=float(softcap or 0.0), HEAD_PAD=_head_pad(head_dim), num_warps=_decode_warps(k_pool))
    _combine_splits(part_acc, part_m, part_l, out, batch, num_heads, num_splits, head_dim)


# ---- decode attention with the step's rotary and KV write folded in ------------------------------------------
#
# The layered half-precision decode step ran a rotary + KV-write kernel between the QKV projection and the
# attention (Llama-3.1-8B at 64 rows: 32 x 3 us of a 5.3 ms step). Here each attention program (row, kv head,
# context share) takes its query group and its kv head straight from the projection's output: it applies the
# rotary, the share holding the newest position writes that token's K and V to the pool, and the newest token
# joins the online softmax from registers (the pool is read only for the older positions, so no program reads
# what another is writing). Roundings as the separate kernels: the roped q and k rounded to the activation
# dtype, rotary in float32 from the stored tables.


@triton.jit
def _decode_rope_kernel(QKV, Cos, Sin, Positions, Slots, K, V, Out, PartAcc, PartM, PartL, BlockTables, ContextLens,
                        stride_qkv, stride_kv_slot, stride_kv_head, stride_o_row, stride_o_head, stride_bt_row, scale,
                        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
                        PAGE_TOKENS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                        HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, USE_GDC: tl.constexpr = False,
                        WINDOW: tl.constexpr = 0):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(ContextLens + row)
    begin, end = _split_share(context_len, split, NUM_SPLITS, BLOCK_N, WINDOW)
    newest = (context_len > 0) & (begin < context_len) & (end == context_len)  # this share ends at the new token
    half: tl.constexpr = HEAD_DIM // 2
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    rot = (offs_d + half) % HEAD_DIM  # rotate_half's partner lane (the sign is in the sin table)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    pos = tl.load(Positions + row)
    cos = tl.load(Cos + pos * HEAD_DIM + offs_d).to(tl.float32)
    sin = tl.load(Sin + pos * HEAD_DIM + offs_d).to(tl.float32)
    if USE_GDC:  # a programmatic dependent launch: the projection's rows are ready once the kernel before is done
        tl.extra.cuda.gdc_wait()
    base = QKV + row * stride_qkv
    q = tl.load(base + heads[:, None] * HEAD_DIM + offs_d[None, :], mask=g_mask[:, None], other=0.0).to(tl.float32)
    q_rot = tl.load(base + heads[:, None] * HEAD_DIM + rot[None, :], mask=g_mask[:, None], other=0.0).to(tl.float32)
    q = (q * cos[None, :] + q_rot * sin[None, :]).to(QKV.dtype.element_ty)
    k_base = base + (NUM_HEADS + kv_head) * HEAD_DIM
    k_new = tl.load(k_base + offs_d).to(tl.float32) * cos + tl.load(k_base + rot).to(tl.float32) * sin
    k_stored = kv_value(k_new.to(QKV.dtype.element_ty), K)
    v_stored = kv_value(tl.load(base + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM + offs_d), V)
    # Padding rows (context 0) write their slot too (the scratch page), as the separate kernel did.
    writes = newest | ((context_len == 0) & (split == 0))
    slot = tl.load(Slots + row).to(tl.int64)
    dst = slot * stride_kv_slot + kv_head * stride_kv_head + offs_d
    tl.store(K + dst, k_stored, mask=(offs_d < HEAD_DIM) & writes)
    tl.store(V + dst, v_stored, mask=(offs_d < HEAD_DIM) & writes)
    # The newest token joins from registers as the pool holds it (a float8 pool's rounding included).
    k_new = k_stored.to(QKV.dtype.element_ty)
    v_new = v_stored.to(QKV.dtype.element_ty)
    # The older positions from the pool, then the newest from registers.
    m_i, l_i, acc = _decode_tiles(q, K, V, BlockTables, row, kv_head, begin, tl.minimum(end, context_len - 1),
                                  stride_kv_slot, stride_kv_head, stride_bt_row, scale, PAGE_TOKENS, GROUP_PAD,
                                  HEAD_DIM, BLOCK_N, False, 0.0, HEAD_DIM, 0.0, 0, False)
    s = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale
    m_new = tl.maximum(m_i, s)
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new)
    l_new = l_i * alpha + p
    acc_new = acc * alpha[:, None] + p.to(v_new.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)[None, :]
    m_i = tl.where(newest, m_new, m_i)
    l_i = tl.where(newest, l_new, l_i)
    acc = tl.where(newest, acc_new, acc)
    if USE_GDC:  # the next kernel (the o product) may launch and start streaming its weights
        tl.extra.cuda.gdc_launch_dependents()
    if NUM_SPLITS == 1:
        # Padding rows (context 0) have l_i == 0: write zeros, never NaN.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(Out + row * stride_o_row + heads[:, None] * stride_o_head + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=g_mask[:, None])
    else:
        part = (row * NUM_HEADS + heads) * NUM_SPLITS + split  # [GROUP_PAD]
        tl.store(PartM + part, m_i, mask=g_mask)
        tl.store(PartL + part, l_i, mask=g_mask)
        tl.store(PartAcc + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None])


def paged_decode_attention_rope(qkv: torch.Tensor, cos_table: torch.Tensor, sin_signed_table: torch.Tensor,
                                positions: torch.Tensor, slots: torch.Tensor, k_pool: torch.Tensor,
                                v_pool: torch.Tensor, out: torch.Tensor, block_tables: torch.Tensor,
                                context_lens: torch.Tensor, *, num_heads: int, page_tokens: int, scale: float,
                                num_splits: int = 1, part_acc: torch.Tensor | None = None,
                                part_m: torch.Tensor | None = None, part_l: torch.Tensor | None = None,
                                block_n: int | None = None, num_warps: int | None = None,
                                num_stages: int | None = None, pdl: bool = False, window: int = 0) -> None:
    """rope_write_kv followed by paged_decode_attention (or its split form with ``num_splits`` > 1 and the
    scratch), in one kernel (two when split), half precision. qkv [B, (nh + 2 nkv) d] rows of the projection;
    tables [positions, d]; positions / slots [B] int64 (the new token's); out [B, nh, d]; the rest as
    paged_decode_attention. Each row's newest position (context_len - 1) is the token being written.
    ``block_n`` (keys per tile), ``num_warps`` and ``num_stages`` are tuning knobs (tools/probe_decode_attention.py).
    ``pdl``: a programmatic dependent launch (Hopper): it reads the step's positions and tables while the kernel
    before it (the qkv product) finishes, and lets the next kernel launch before it writes its output."""
    batch = qkv.shape[0]
    num_kv_heads, head_dim = k_pool.shape[1], k_pool.shape[2]
    group = num_heads // num_kv_heads
    if num_splits > 1:
        _check_split_scratch(batch, num_heads, num_splits, head_dim, part_acc, part_m)
    else:
        part_acc = part_m = part_l = out
    _decode_rope_kernel[(batch, num_kv_heads, num_splits)](
        qkv, cos_table, sin_signed_table, positions, slots, k_pool, v_pool, out, part_acc, part_m, part_l,
        block_tables, context_lens, qkv.stride(0), k_pool.stride(0), k_pool.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), scale,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, NUM_SPLITS=num_splits, PAGE_TOKENS=page_tokens, GROUP=group,
        GROUP_PAD=_group_pad(group), HEAD_DIM=head_dim, BLOCK_N=block_n or (64 if head_dim <= 128 else 32),
        USE_GDC=pdl, WINDOW=window, num_warps=num_warps or _decode_warps(k_pool),
        **({} if num_stages is None else {"num_stages": num_stages}),
        **({"launch_pdl": True} if pdl else {}))
    if num_splits > 1:
        _combine_splits(part_acc, part_m, part_l, out, batch, num_heads, num_splits, head_dim)
