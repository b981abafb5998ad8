"""Sampling on the GPU inside a captured graph: no host sync, fixed shapes.

``sample_greedy`` is the argmax; ``sample_race`` draws each row at its
temperature from the whole vocabulary (one pass, the graphs of steps whose
sampled rows have no top-k, top-p or min-p); ``sample_full`` applies
temperature, min-p, top-k and top-p per row with no sort and draws with the
same race, so a row draws the same token in either. Rows with temperature 0
take the argmax in every one.

Graph variants (the fourth field of a graph key, kernels.GREEDY, FULL and
TEMPERATURE) pick among them.

Rules:
- A row's draw depends only on (seed, step, token id): the noise is a
  counter-based hash, not a stateful generator, so a replayed graph draws
  fresh numbers each step from the uploaded step counters, and a row's
  choice does not depend on its batch neighbours. The CPU sampler draws
  with the same noise (flared._fast.race), so a seeded request draws the
  same tokens on either backend where the logits and the kept tokens agree.
- The draw is the exponential-race form of categorical sampling:
  argmax(p_i / E_i) with E_i ~ Exp(1) picks i with probability p_i. In log
  space that is argmax(x_i / T - log E_i) over the kept tokens (the Gumbel-max
  trick), with no softmax: the Triton kernels below, in blocks of the
  vocabulary across programs, then one pick per row.
- Min-p, top-k and top-p keep a prefix of the row in rank order (larger
  logit first, the smaller id first among equal logits, as a stable sort):
  token i is kept iff its probability is at least min_p times the largest
  (x_i / T >= max x / T + log min_p: a threshold in the row's scaled logits,
  its log handed in), fewer than k tokens rank before it and their
  probability mass is below p. That mass is a share of what the filters
  before top-p kept (renormalised, as the CPU sampler, vLLM and llama.cpp
  judge it): in vLLM's order of the tokens min-p and top-k keep, at
  temperature T; in llama.cpp's default chain (a row's ``chain``: top-k,
  top-p, min-p, then the temperature) of the k tokens at temperature 1. The
  k tokens' mass needs the row's k-th largest logit, found only for rows
  with both top-k and top-p (``_top_k_logit``): from the race's lane maxima
  a bound below it, one pass copying the logits above the bound, and a
  radix select over their bits.
  ``sample_full`` finds the race's winner among the kept tokens without
  sorting: the winner over all tokens is checked (a pass counting
  the tokens ranked before it and their mass); if it is not kept, nothing
  ranked after it is either, so the next candidate is the race's winner among
  the tokens ranked before it (same scores), and so on. The candidates climb
  the ranking, so the walk ends. The token is the masked race's exactly.
- The race's CANDIDATES best-scored tokens are checked in one pass, and the
  walk follows them while its next candidate is among them (every token
  scored above a candidate is one): a draw inside the nucleus, or a few
  tokens outside it, costs one pass whatever the row, so a step's time does
  not swing with its draws (the scheduler stops stacking a second step
  behind one that overruns its estimate). Past them the walk takes a pass a
  candidate: on flat rows with a small top-k about log(V / k) passes.
- Integer arithmetic stays below 2**62 (31-bit lanes times 31-bit
  constants) so int64 never overflows.
- Logit bias and repetition, frequency and presence penalties (vLLM's:
  repetition over the prompt and output, the other two over the output)
  come from the Sampler's slot tables (``ShapeTables``): a row naming a slot
  has its logits shaped by the race's first pass, bias first, as the
  Sampler shapes them, and written back, so that the walk and everything
  after read the shaped row; the pick then counts the drawn token in the
  slot's output counts. Rows naming no slot (-1) are read as they are.
  llama.cpp's penalties over a window (repeat_last_n) use the same tables:
  the counts then cover the window's tokens, prompt included, and the pick
  also takes the token N places back out of them, from the slot's ring.
- A request's allowed_token_ids and bad words of one token are bans for
  good: -inf in its slot's bias row, shaped with the bias. min_tokens' bans
  (EOS and the stop ids, up to GRAPH_BANS) hold while the row's step count
  is under it.
- A grammar-constrained request's mask for the step (llguidance's bitmask, written by the executor into the
  slot's row of the Sampler's ``masks``) is -inf for the ids it clears, shaped with the bias while the slot's
  ``grammar`` flag is set. The executor computes the masks while the step's graph runs and draws those rows
  behind it (``draw_rows``: their logits gathered from their state rows, the same kernels over them alone).
- Log-probabilities are taken by the executor beside the draw (``row_logprobs``: three small kernels behind
  the graph; the chunks' maxima and sums, a bound from their lane maxima, the copies above it ranked).
- DRY, longer bad words, a thinking budget and the rest are not here: the executor runs
  ``flared.model.sampling.Sampler`` on the graph's logits for rows that ask for them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flared.model.kernels.fused import lanes_first_max, lanes_take, parts_first_max
from flared.model.sampling import E_FLOOR as CPU_E_FLOOR
from flared.model.sampling import ShapeTables

# The least exponential the race's noise makes (the CPU sampler's); a constexpr, as a global a kernel reads must be
# (Triton refuses other globals when it compiles, which its interpreter does not check)
E_FLOOR = tl.constexpr(CPU_E_FLOOR)
RACE_BLOCK = 2048  # logits per program iteration of the race
RACE_PROGRAMS = 264  # programs the race aims for (two per H200 multiprocessor)
WALK_BLOCK = 8192  # logits per iteration of the top-k/top-p walk (one program a row; tools/bench_graph_sampler.py)
WALK_WARPS = 32
CANDIDATES = 4  # the race's best tokens a row's first walk pass checks at once
LIST_BLOCK = 2048  # logits per iteration of that pass
# A row with top-k and top-p: the race's lane maxima the walk's select starts from (about, over a row's chunks; at
# most 16 a chunk), and the logits it then selects among (at most; more, or a k above what the maxima hold: four
# passes over the row)
TOPS_AIM = 128
KEPT = 1024
# Log-probabilities (row_logprobs): the most top logprobs a row gets from the kernel (a request asking for more
# takes the torch ops), and the logits per iteration of its passes
GRAPH_LOGPROBS = 32
LOGPROB_BLOCK = 8192  # (the last stage's passes over a flat row: a program a row, many loads in flight)
LOGPROB_WARPS = 32
LOGPROB_RANKED = 64  # copies a row's top n are ranked among at once (more: one reduction a top logprob)
LOGPROB_CHUNK_BLOCKS = 2  # race blocks in a chunk of row_logprobs' first two kernels (12 chunks at 49,152 tokens)


@triton.jit
def _mix_tl(x, multiplier: tl.constexpr, shift: tl.constexpr):
    x = x ^ (x >> shift)
    return (x * multiplier) & 0x7FFFFFFF


@triton.jit
def _shaped(x, cols, mask, slot, step, vocab, Counts, Prompt, Bias, Params, Bans, Grammar, Masks,
            BANS: tl.constexpr):
    """A row's logits x (its columns cols) after its slot's logit bias (and bans), its grammar's mask for this
    step (a slot whose Grammar flag is set: -inf where its bit in Masks [S, ceil(V / 32)] int32 is clear, token
    32 w + b at bit b of word w), min_tokens' bans while the row has drawn fewer (``step`` so far) and then its
    penalties, as flared.model.sampling.Sampler.apply_bias_and_penalties and its grammar masks shape them."""
    at = slot.to(tl.int64) * vocab + cols
    x = x + tl.load(Bias + at, mask=mask, other=0.0)
    if tl.load(Grammar + slot) != 0:
        words = tl.load(Masks + slot.to(tl.int64) * ((vocab + 31) // 32) + cols // 32, mask=mask, other=0)
        x = tl.where(((words >> (cols % 32)) & 1) != 0, x, float("-inf"))
    if step.to(tl.float32) < tl.load(Params + slot * 4 + 3):
        for j in tl.static_range(BANS):
            x = tl.where(cols == tl.load(Bans + slot * BANS + j), float("-inf"), x)
    count = tl.load(Counts + at, mask=mask, other=0)
    in_output = count > 0
    seen = in_output | (tl.load(Prompt + at, mask=mask, other=0) != 0)
    rep = tl.load(Params + slot * 4)
    freq = tl.load(Params + slot * 4 + 1)
    pres = tl.load(Params + slot * 4 + 2)
    x = tl.where(seen, tl.where(x > 0, x / rep, x * rep), x)
    return x - freq * count.to(tl.float32) - pres * in_output.to(tl.float32)


@triton.jit
def _count_drawn(token, slot, vocab, Counts, Window, Ring, Lens, RING: tl.constexpr):
    """The drawn token counted in its row's slot (rows naming no slot: nothing); with a window of N tokens
    (llama.cpp's repeat_last_n) the token N places back leaves the counts once the window is full, and the new one
    takes its place in the ring (flared.model.sampling.Sampler._advance_ring)."""
    if slot >= 0:
        row_counts = Counts + slot.to(tl.int64) * vocab
        tl.atomic_add(row_counts + token, 1)
        n = tl.load(Window + slot)
        if n > 0:
            length = tl.load(Lens + slot)
            at = Ring + slot.to(tl.int64) * RING + length % n
            if length >= n:
                tl.atomic_add(row_counts + tl.load(at), -1)
            tl.store(at, token.to(tl.int32))
            tl.store(Lens + slot, length + 1)


@triton.jit
def _order_key(x):
    """x's float32 bits as an int64 in [0, 2**32) ordered as x is (-0 taken as +0, which it equals)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True).to(tl.int64)
    low = bits & 0xFFFFFFFF
    return tl.where(bits < 0, low ^ 0xFFFFFFFF, low | 0x80000000)


@triton.jit
def _next_byte(hist, need, prefix):
    """One round of a radix select: from the 256-bin counts of the next byte of the keys matching ``prefix``, the
    byte holding the ``need``-th largest (the largest whose keys, with those of every larger byte, number at least
    ``need``), ``need`` among that byte's keys, and the prefix with it."""
    bins = tl.arange(0, 256)
    at_or_above = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
    byte = tl.max(tl.where(at_or_above >= need, bins, 0), 0)
    return need - tl.sum(tl.where(bins > byte, hist, 0), 0), prefix * 256 + byte


@triton.jit
def _from_key(prefix):
    """The float32 whose _order_key is ``prefix``."""
    bits = tl.where(prefix >= 0x80000000, prefix ^ 0x80000000, prefix ^ 0xFFFFFFFF)
    return bits.to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _kth_of(x, k):
    """The k-th largest of a vector x (1 <= k <= its length; equal values counted one by one) and how many of the
    values equal to it are among its k largest: a radix select over ``_order_key``'s 32 bits, a byte a round."""
    key = _order_key(x)
    prefix = (k * 0).to(tl.int64)
    need = k
    for r in tl.static_range(4):
        match = (key >> (32 - 8 * r)) == prefix
        hist = tl.histogram(((key >> (24 - 8 * r)) & 255).to(tl.int32), 256, mask=match)
        need, prefix = _next_byte(hist, need, prefix)
    return _from_key(prefix), need


@triton.jit
def _kth_largest(Logits, row, stride, vocab, k, BLOCK: tl.constexpr):
    """``_kth_of`` over a whole row of Logits, a pass over the row a byte (the rows the compacted select below
    cannot take)."""
    prefix = (row * 0).to(tl.int64)
    need = k
    for r in tl.static_range(4):
        hist = tl.zeros((256,), tl.int32)
        for base in range(0, vocab, BLOCK):
            cols = base + tl.arange(0, BLOCK)
            valid = cols < vocab
            key = _order_key(tl.load(Logits + row * stride + cols, mask=valid, other=0.0))
            match = valid & ((key >> (32 - 8 * r)) == prefix)
            hist += tl.histogram(((key >> (24 - 8 * r)) & 255).to(tl.int32), 256, mask=match)
        need, prefix = _next_byte(hist, need, prefix)
    return _from_key(prefix), need


@triton.jit
def _top_k_logit(Logits, Tops, Kept, Taken, row, stride, vocab, k, n_tops, BLOCK: tl.constexpr,
                 TOPS: tl.constexpr, KEPT: tl.constexpr):
    """A row's k-th largest logit and how many of those equal to it are among its k largest. The race left each
    chunk's largest lane maxima in Tops (n_tops of them, distinct tokens): their k-th largest, low, is at most the
    row's k-th. One pass copies the row's logits >= low into Kept (KEPT of them at most: usually a few more than
    k; each takes a place by an atomic count in Taken[row], which the race zeroed), and the select runs on those
    alone; where more are >= low (or Tops holds fewer than k), four passes over the whole row (_kth_largest)."""
    lanes = tl.arange(0, TOPS)
    tops = tl.load(Tops + row * n_tops + lanes, mask=lanes < n_tops, other=float("-inf"))
    low, _ = _kth_of(tops, k)  # -inf (or NaN past TOPS) where the maxima hold fewer than k finite logits
    n = k * 0 + KEPT + 1
    if low > float("-inf"):
        n = k * 0
        for base in range(0, vocab, BLOCK):
            cols = base + tl.arange(0, BLOCK)
            x = tl.load(Logits + row * stride + cols, mask=cols < vocab, other=float("-inf"))
            take = (cols < vocab) & (x >= low)
            # (no more places taken once the copy overflows: a flat row would queue an atomic a logit)
            at = tl.atomic_add(Taken + row + cols * 0, 1, mask=take & (n <= KEPT))
            tl.store(Kept + row * KEPT + at, x, mask=take & (n <= KEPT) & (at < KEPT))
            n += tl.sum(take.to(tl.int32), 0)
    if n <= KEPT:
        tl.debug_barrier()  # the copies above, by other threads of the program, before the loads below
        slots = tl.arange(0, KEPT)
        xk, need = _kth_of(tl.load(Kept + row * KEPT + slots, mask=slots < n, other=float("-inf")), k)
    else:
        xk, need = _kth_largest(Logits, row, stride, vocab, k, BLOCK)
    return xk, need


@triton.jit
def _lanes_mass(lane_m, lane_s, v):
    """Each lane's running maximum and sum of exp(v - that maximum) with the values ``v`` taken in."""
    m = tl.maximum(lane_m, v)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    return m, lane_s * tl.exp(lane_m - m_safe) + tl.exp(v - m_safe)


@triton.jit
def _store_chunk_mass(PartMax, PartSum, at, lane_m, lane_s):
    """A chunk's largest value and its sum of exp(v - that), from its lanes' running maxima and sums."""
    top = tl.max(lane_m, 0)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    tl.store(PartMax + at, top)
    tl.store(PartSum + at, tl.sum(lane_s * tl.exp(lane_m - top_safe), 0))


@triton.jit
def _store_lane_maxima(Tops, at, lane_x, BLOCK: tl.constexpr, TOPS_PER: tl.constexpr):
    """The TOPS_PER largest of a chunk's lane maxima (a lane each: distinct tokens), largest first, at Tops + at."""
    lanes = tl.arange(0, BLOCK)
    for j in tl.static_range(TOPS_PER):
        m = tl.max(lane_x, 0)
        tl.store(Tops + at + j, m)
        lane_x = tl.where(lanes == tl.min(tl.where(lane_x == m, lanes, BLOCK), 0), float("-inf"), lane_x)


@triton.jit
def _race_parts_kernel(Logits, Temperature, Seeds, Steps, PartVal, PartIdx, TopK, TopP, MinP, Chain, Scores,
                       PartMax, PartSum, Tops, Taken, Slots, Counts, Prompt, Bias, Params, Bans, Grammar, Masks,
                       vocab, chunk,
                       n_chunks, stride, BLOCK: tl.constexpr, FULL: tl.constexpr, J: tl.constexpr,
                       SHAPE: tl.constexpr, CHAIN: tl.constexpr, TOPS_PER: tl.constexpr, BANS: tl.constexpr):
    """Each program: one row's chunk of the vocabulary; its largest race score and the first index holding it.
    Score: x / T - log(max(-log u, E_FLOOR)), u in (0, 1] from a counter hash of (seed, step, token id) (its
    torch form: tests/flared_testing/race.py's uniform_noise; on the CPU flared/_fast/race.pyx); a row at
    temperature 0
    scores x itself (its argmax). -inf logits (masked) never win; NaN counts as the largest, as in torch.argmax.
    FULL: the chunk's J largest scores (PartVal/PartIdx [B, n_chunks, J], largest first, the
    first index among equal ones); for a row with top-k, top-p or min-p also the scores into Scores [B, vocab] and
    the chunk's largest x / T and sum of exp(x / T - that) into PartMax/PartSum, for the walk (CHAIN: a row of
    llama.cpp's chain, Chain 1, judges at temperature 1: x for x / T); for a row with both top-k (under the
    vocabulary) and top-p also the chunk's TOPS_PER largest lane maxima of x into Tops [B, n_chunks, TOPS_PER] (the
    walk's ``_top_k_logit``, whose count in Taken [B] the row's first program zeroes). SHAPE: a row naming a slot
    (Slots) is shaped first (``_shaped``) and written back into Logits."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    t = tl.load(Temperature + row)
    slot = tl.load(Slots + row) if SHAPE else -1
    seed = tl.load(Seeds + row)
    step = tl.load(Steps + row)
    walks = False
    selects = False
    if FULL:
        k = tl.load(TopK + row)
        p = tl.load(TopP + row)
        walks = (t > 0) & ((k > 0) | (p < 1.0) | (tl.load(MinP + row) > float("-inf")))
        selects = walks & (k > 0) & (k < vocab) & (p < 1.0)
    h = (seed & 0x7FFFFFFF) ^ ((seed >> 31) & 0x7FFFFFFF)
    h = (h * 0x6C8E9CF5 + (step & 0x7FFFFFFF)) & 0x7FFFFFFF
    h = _mix_tl(h, 0x45D9F3B, 16)
    start = part * chunk
    stop = tl.minimum(start + chunk, vocab)
    # Per lane its largest scores, largest first (FULL: four; strict >: an earlier block keeps a tie).
    v0 = tl.full((BLOCK,), float("-inf"), tl.float32)
    i0 = tl.zeros((BLOCK,), tl.int32)
    v1, i1, v2, i2, v3, i3 = v0, i0, v0, i0, v0, i0
    lane_m = tl.full((BLOCK,), float("-inf"), tl.float32)
    lane_s = tl.zeros((BLOCK,), tl.float32)
    lane_x = tl.full((BLOCK,), float("-inf"), tl.float32)
    inv_judge = 1.0 / tl.where(t > 0, t, 1.0)  # the scale the walk's masses judge the logits at (_walk_kernel)
    if CHAIN:
        inv_judge = tl.where(tl.load(Chain + row) != 0, 1.0, inv_judge)
    for base in range(start, stop, BLOCK):
        cols = base + tl.arange(0, BLOCK)
        mask = cols < stop
        x = tl.load(Logits + row * stride + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if SHAPE:
            if slot >= 0:
                x = _shaped(x, cols, mask, slot, step, vocab, Counts, Prompt, Bias, Params, Bans, Grammar, Masks,
                            BANS)
                tl.store(Logits + row * stride + cols, x, mask=mask)
        if t > 0:
            z = (h * 0x2C1B3C6D + cols.to(tl.int64)) & 0x7FFFFFFF
            z = _mix_tl(z, 0x297A2D39, 15)
            z = _mix_tl(z, 0x5BD1E995, 13)
            z = z ^ (z >> 16)
            u = (z.to(tl.float32) + 1.0) * (1.0 / 2147483648.0)
            # u rounds to 1 for 64 of the 2**31 hashes, where -log(u) = 0 would score +inf: a token of any
            # probability would win (about one row-step in 260 at 128,256 tokens). E = -log(u) stops at the
            # least E of the u below 1, 2**-24.
            y = x / t - tl.log(tl.maximum(-tl.log(u), E_FLOOR))
        else:
            y = x
        y = tl.where(x == x, y, float("inf"))
        if FULL:
            g0 = y > v0
            g1 = y > v1
            g2 = y > v2
            g3 = y > v3
            v3 = tl.where(g2, v2, tl.where(g3, y, v3))
            i3 = tl.where(g2, i2, tl.where(g3, cols, i3))
            v2 = tl.where(g1, v1, tl.where(g2, y, v2))
            i2 = tl.where(g1, i1, tl.where(g2, cols, i2))
            v1 = tl.where(g0, v0, tl.where(g1, y, v1))
            i1 = tl.where(g0, i0, tl.where(g1, cols, i1))
            v0 = tl.where(g0, y, v0)
            i0 = tl.where(g0, cols, i0)
        else:
            v0, i0 = lanes_take(y, cols, v0, i0)
        if walks:
            tl.store(Scores + row * vocab + cols, y, mask=mask)
            lane_m, lane_s = _lanes_mass(lane_m, lane_s, x * inv_judge)
            lane_x = tl.maximum(lane_x, x)
    if FULL:
        # The chunk's four largest: each round takes the largest lane head (its first index) and pops that lane.
        out = (row * n_chunks + part) * J
        for j in tl.static_range(J):
            m, first = lanes_first_max(v0, i0, start)
            tl.store(PartVal + out + j, m)
            tl.store(PartIdx + out + j, first)
            hit = (i0 == first) & (v0 == m)
            v0, i0 = tl.where(hit, v1, v0), tl.where(hit, i1, i0)
            v1, i1 = tl.where(hit, v2, v1), tl.where(hit, i2, i1)
            v2, i2 = tl.where(hit, v3, v2), tl.where(hit, i3, i2)
            v3 = tl.where(hit, float("-inf"), v3)
    else:
        m, first = lanes_first_max(v0, i0, start)
        tl.store(PartVal + row * n_chunks + part, m)
        tl.store(PartIdx + row * n_chunks + part, first)
    if walks:
        _store_chunk_mass(PartMax, PartSum, row * n_chunks + part, lane_m, lane_s)
    if TOPS_PER > 0:
        if selects:  # the largest lane maxima, a lane each (distinct tokens)
            if part == 0:
                tl.store(Taken + row, 0)
            _store_lane_maxima(Tops, (row * n_chunks + part) * TOPS_PER, lane_x, BLOCK, TOPS_PER)


@triton.jit
def _race_pick_kernel(PartVal, PartIdx, Out, Slots, Counts, Window, Ring, Lens, vocab, n_chunks,
                      PARTS: tl.constexpr, SHAPE: tl.constexpr, RING: tl.constexpr):
    row = tl.program_id(0)
    token = parts_first_max(PartVal, PartIdx, row, n_chunks, PARTS)
    tl.store(Out + row, token)
    if SHAPE:
        _count_drawn(token, tl.load(Slots + row), vocab, Counts, Window, Ring, Lens, RING)


@triton.jit
def _extract(vec, lanes, j):
    """Element j of a small vector (a candidate's field)."""
    return tl.sum(tl.where(lanes == j, vec, 0), 0)


@triton.jit
def _walk_kernel(Logits, Scores, Temperature, TopK, TopP, MinP, Chain, PartVal, PartIdx, PartMax, PartSum, Tops,
                 Kept, Taken, Out, Passes, Slots, Counts, Window, Ring, Lens, vocab, n_chunks, n_tops, stride,
                 PARTS: tl.constexpr, BLOCK: tl.constexpr, LIST: tl.constexpr, J: tl.constexpr, SHAPE: tl.constexpr,
                 RING: tl.constexpr, CHAIN: tl.constexpr, TOPS: tl.constexpr, KEPT: tl.constexpr):
    """One program a row: the race's J best tokens from the parts' lists (its winner first), then (a row
    at temperature > 0 with top-k, top-p or min-p) one pass checking all of them: the walk follows them while its
    next candidate is among them (module docstring), and only past them goes on a pass a candidate. A row with both
    top-k (under the vocabulary) and top-p first finds its k-th largest logit (``_top_k_logit``: a pass, usually),
    so that top-p judges shares of the k tokens. Passes: the passes each row took (the select's not counted)."""
    row = tl.program_id(0)
    t = tl.load(Temperature + row)
    k = tl.load(TopK + row)
    p = tl.load(TopP + row)
    mp = tl.load(MinP + row)  # log min-p in the row's scaled logits; -inf: off
    # The row's J largest scores over all parts, largest first, the first index among equal ones.
    q = tl.arange(0, PARTS)
    qmask = q < n_chunks * J
    pv = tl.load(PartVal + row * n_chunks * J + q, mask=qmask, other=float("-inf"))
    pi = tl.load(PartIdx + row * n_chunks * J + q, mask=qmask, other=2147483647)
    lanes = tl.arange(0, J)
    cy = tl.full((J,), float("-inf"), tl.float32)
    ci = tl.zeros((J,), tl.int32)
    for j in tl.static_range(J):
        m = tl.max(pv, 0)
        first = tl.min(tl.where(pv == m, pi, 2147483647), 0)
        cy = tl.where(lanes == j, m, cy)
        ci = tl.where(lanes == j, first, ci)
        pv = tl.where((pi == first) & (pv == m), float("-inf"), pv)
    c = _extract(ci, lanes, 0).to(tl.int64)
    passes = row * 0
    if (t > 0) & ((k > 0) | (p < 1.0) | (mp > float("-inf"))):
        # Masses judge the logits at 1 / T (vLLM's order: the temperature first), or at 1 (llama.cpp's chain: its
        # filters before the temperature); the parts' maxima and sums are at that scale.
        chain = tl.load(Chain + row) != 0 if CHAIN else t < 0  # (t > 0 here: without CHAIN, never)
        inv_t = 1.0 / t
        inv_judge = tl.where(chain, 1.0, inv_t)
        pm = tl.load(PartMax + row * n_chunks + q, mask=q < n_chunks, other=float("-inf"))
        ps = tl.load(PartSum + row * n_chunks + q, mask=q < n_chunks, other=0.0)
        top = tl.max(pm, 0)
        top = tl.where(top == float("-inf"), 0.0, top)
        total = tl.sum(ps * tl.exp(pm - top), 0)
        # Min-p keeps the tokens whose logit at 1 / T is at least thr (the largest always; a chain row's threshold
        # is its min-p's at 1 / T: kernels.min_p_log_threshold). top * inv_t is max x / T exactly: the scaling keeps
        # the order of the row.
        thr = tl.where(chain, top * inv_t, top) + mp
        # Top-p's mass is a share of what the filters before it keep: with top-k under the vocabulary, the k
        # largest logits (their k-th, xk, and how many equal to it are among them: need); in vLLM's order also min-p
        # (its tokens and the k are both a prefix of the ranking, so the shorter's mass is theirs).
        select = (k > 0) & (k < vocab) & (p < 1.0)
        xk = top * 0.0 + float("inf")
        need = k * 0
        if select:
            xk, need = _top_k_logit(Logits, Tops, Kept, Taken, row, stride, vocab, k, n_tops, BLOCK, TOPS, KEPT)
        # A candidate is kept iff min-p keeps it, fewer than max_before tokens rank before it and their mass is
        # below max_mass (p times that share, which the first pass adds up).
        max_before = tl.where(k > 0, k, 2147483647)
        valid = cy > float("-inf")
        cx = tl.load(Logits + row * stride + ci, mask=valid, other=float("-inf"))
        # One pass: for every candidate the tokens ranked before it (a larger logit, or an equal one at a smaller
        # id) and their mass; and the masses of the tokens min-p keeps and of those above the k-th largest.
        lane_n = tl.zeros((LIST, J), tl.int32)
        lane_w = tl.zeros((LIST, J), tl.float32)
        lane_z = tl.zeros((LIST,), tl.float32)
        lane_k = tl.zeros((LIST,), tl.float32)
        for base in range(0, vocab, LIST):
            cols = base + tl.arange(0, LIST)
            x = tl.load(Logits + row * stride + cols, mask=cols < vocab, other=float("-inf"))
            ahead = ((cols < vocab)[:, None] & ((x[:, None] > cx[None, :])
                                                 | ((x[:, None] == cx[None, :]) & (cols[:, None] < ci[None, :]))))
            e = tl.exp(x * inv_judge - top)
            lane_n += ahead.to(tl.int32)
            lane_w += tl.where(ahead, e[:, None], 0.0)
            lane_z += tl.where(x * inv_t >= thr, e, 0.0)
            lane_k += tl.where(x > xk, e, 0.0)
        kept_mass = tl.where((mp > float("-inf")) & ~chain, tl.sum(lane_z, 0), total)
        top_k_mass = tl.sum(lane_k, 0) + need.to(tl.float32) * tl.exp(xk * inv_judge - top)
        kept_mass = tl.where(select, tl.minimum(kept_mass, top_k_mass), kept_mass)
        max_mass = tl.where(p < 1.0, p * kept_mass, float("inf"))
        kept = (((tl.sum(lane_n, 0) < max_before) & (tl.sum(lane_w, 0) < max_mass) & (cx * inv_t >= thr))
                | ~valid)
        passes += 1
        # Walk the candidates: after a rejected one the next is the best-scored candidate ranked before it, if
        # any (every token scored above a candidate is a candidate); past them, c is the last rejected one.
        cur = row * 0
        walking = t > 0
        listed = t > 0
        for _ in tl.static_range(J):
            if walking & listed:
                if _extract(kept.to(tl.int32), lanes, cur) > 0:
                    walking = t < 0
                else:
                    xcur = _extract(cx, lanes, cur)
                    icur = _extract(ci, lanes, cur)
                    before = valid & ((cx > xcur) | ((cx == xcur) & (ci < icur)))
                    nxt = tl.min(tl.where(before, lanes, J), 0)
                    listed = nxt < J
                    cur = tl.where(listed, nxt, cur)
        c = _extract(ci, lanes, cur).to(tl.int64)
        # Past the candidates: a pass a candidate, starting from the last rejected one (checked again: its pass
        # also finds the next candidate).
        walking = walking & ~listed
        while walking:
            xc = tl.load(Logits + row * stride + c)
            lane_n1 = tl.zeros((BLOCK,), tl.int32)
            lane_w1 = tl.zeros((BLOCK,), tl.float32)
            lane_v = tl.full((BLOCK,), float("-inf"), tl.float32)
            lane_i = tl.zeros((BLOCK,), tl.int32)
            for base in range(0, vocab, BLOCK):
                cols = base + tl.arange(0, BLOCK)
                x = tl.load(Logits + row * stride + cols, mask=cols < vocab, other=float("-inf"))
                ahead1 = (cols < vocab) & ((x > xc) | ((x == xc) & (cols < c)))
                lane_n1 += ahead1.to(tl.int32)
                lane_w1 += tl.where(ahead1, tl.exp(x * inv_judge - top), 0.0)
                y = tl.load(Scores + row * vocab + cols, mask=ahead1, other=float("-inf"))
                lane_v, lane_i = lanes_take(tl.where(ahead1, y, float("-inf")), cols, lane_v, lane_i)
            best, nxt1 = lanes_first_max(lane_v, lane_i, 0)
            passes += 1
            kept1 = (tl.sum(lane_n1, 0) < max_before) & (tl.sum(lane_w1, 0) < max_mass) & (xc * inv_t >= thr)
            # Nothing ranked before the candidate (or only NaN scores): it is the top-ranked token; keep it.
            walking = (best > float("-inf")) & ~kept1
            c = tl.where(walking, nxt1.to(tl.int64), c)
    tl.store(Out + row, c)
    tl.store(Passes + row, passes)
    if SHAPE:  # the race kernel shaped the row (before this kernel's reads) and leaves the count to the pick
        _count_drawn(c, tl.load(Slots + row), vocab, Counts, Window, Ring, Lens, RING)


@triton.jit
def _logprob_parts_kernel(Logits, Args, PartMax, PartSum, Tops, Taken, stride, vocab, chunk, n_chunks, cap,
                          BLOCK: tl.constexpr, TOPS_PER: tl.constexpr):
    """row_logprobs' first stage, a program a row's chunk: the chunk's largest logit and sum of exp(x - that), and
    its TOPS_PER largest lane maxima (distinct tokens) into Tops; the row's first program zeroes its count in
    Taken."""
    r = tl.program_id(0)
    part = tl.program_id(1)
    n = tl.load(Args + 2 * cap + r)
    if n >= 0:
        row = tl.load(Args + r)
        start = part * chunk
        stop = tl.minimum(start + chunk, vocab)
        lane_m = tl.full((BLOCK,), float("-inf"), tl.float32)
        lane_s = tl.zeros((BLOCK,), tl.float32)
        for base in range(start, stop, BLOCK):
            cols = base + tl.arange(0, BLOCK)
            x = tl.load(Logits + row * stride + cols, mask=cols < stop, other=float("-inf"))
            lane_m, lane_s = _lanes_mass(lane_m, lane_s, x)
        _store_chunk_mass(PartMax, PartSum, r * n_chunks + part, lane_m, lane_s)
        if part == 0:
            tl.store(Taken + r, 0)
        _store_lane_maxima(Tops, (r * n_chunks + part) * TOPS_PER, lane_m, BLOCK, TOPS_PER)


@triton.jit
def _logprob_copy_kernel(Logits, Args, Tops, Taken, KeptV, KeptI, stride, vocab, chunk, n_tops, cap,
                         BLOCK: tl.constexpr, TOPS: tl.constexpr, KEPT: tl.constexpr):
    """The second stage, a program a row's chunk (rows wanting a top n > 0): the n-th largest of the row's lane
    maxima, low, is at most its n-th largest logit; the chunk's logits >= low go to KeptV/KeptI (KEPT a row at
    most), each block's places taken by one atomic count in Taken. Fewer than n finite maxima: Taken past KEPT."""
    r = tl.program_id(0)
    part = tl.program_id(1)
    n = tl.load(Args + 2 * cap + r)
    if n > 0:
        row = tl.load(Args + r)
        t = tl.arange(0, TOPS)
        low, _ = _kth_of(tl.load(Tops + r * n_tops + t, mask=t < n_tops, other=float("-inf")), n)
        if low > float("-inf"):
            start = part * chunk
            stop = tl.minimum(start + chunk, vocab)
            for base in range(start, stop, BLOCK):
                cols = base + tl.arange(0, BLOCK)
                x = tl.load(Logits + row * stride + cols, mask=cols < stop, other=float("-inf"))
                take = (cols < stop) & (x >= low)
                count = tl.sum(take.to(tl.int32), 0)
                if count > 0:
                    first = tl.atomic_add(Taken + r, count)
                    at = first + tl.cumsum(take.to(tl.int32), 0) - 1
                    tl.store(KeptV + r * KEPT + at, x, mask=take & (at < KEPT))
                    tl.store(KeptI + r * KEPT + at, cols, mask=take & (at < KEPT))
        elif part == 0:
            tl.atomic_add(Taken + r, KEPT + 1)


@triton.jit
def _logprob_rank_kernel(Logits, Args, Sampled, PartMax, PartSum, Taken, KeptV, KeptI, OutF, OutI, stride, vocab,
                         n_chunks, cap, PARTS: tl.constexpr, BLOCK: tl.constexpr, KEPT: tl.constexpr,
                         MAXN: tl.constexpr, RANKED: tl.constexpr):
    """The last stage, a program a row: the log-normaliser from the chunks' maxima and sums, the drawn token's
    log-probability and (n > 0) the n largest of the copies, ranked against each other (up to RANKED copies at
    once; more: one reduction a top logprob). Where the copy overflowed KEPT (a flat row, many equal logits), the
    n-th largest from four passes over the row (``_kth_largest``) and exactly n tokens copied in id order."""
    r = tl.program_id(0)
    n = tl.load(Args + 2 * cap + r)
    if n >= 0:
        row = tl.load(Args + r)
        q = tl.arange(0, PARTS)
        pm = tl.load(PartMax + r * n_chunks + q, mask=q < n_chunks, other=float("-inf"))
        ps = tl.load(PartSum + r * n_chunks + q, mask=q < n_chunks, other=0.0)
        top = tl.max(pm, 0)
        top_safe = tl.where(top == float("-inf"), 0.0, top)
        log_z = top_safe + tl.log(tl.sum(ps * tl.exp(pm - top_safe), 0))
        out = r * (1 + 2 * MAXN)
        tl.store(OutF + out, tl.load(Logits + row * stride + tl.load(Sampled + tl.load(Args + cap + r))) - log_z)
        if n > 0:
            count = tl.load(Taken + r)
            if count > KEPT:  # the n-th largest exactly, then the n tokens in id order
                xn, need = _kth_largest(Logits, row, stride, vocab, n, BLOCK)
                count = count * 0
                equal = count * 0
                for base in range(0, vocab, BLOCK):
                    cols = base + tl.arange(0, BLOCK)
                    x = tl.load(Logits + row * stride + cols, mask=cols < vocab, other=float("-inf"))
                    tie = (cols < vocab) & (x == xn)
                    take = ((cols < vocab) & (x > xn)) | (tie & (equal + tl.cumsum(tie.to(tl.int32), 0) <= need))
                    at = count + tl.cumsum(take.to(tl.int32), 0) - 1
                    tl.store(KeptV + r * KEPT + at, x, mask=take)
                    tl.store(KeptI + r * KEPT + at, cols, mask=take)
                    count += tl.sum(take.to(tl.int32), 0)
                    equal += tl.sum(tie.to(tl.int32), 0)
                tl.debug_barrier()  # the copies above, by other threads of the program, before the loads below
            # one key a token, ordered as (logit, -id): distinct, so a token's rank is how many keys are larger
            if count <= RANKED:  # (usually a few more than n)
                slots = tl.arange(0, RANKED)
                held = slots < count
                kv = tl.load(KeptV + r * KEPT + slots, mask=held, other=0.0)
                ki = tl.load(KeptI + r * KEPT + slots, mask=held, other=0)
                key = tl.where(held, (_order_key(kv) << 31) | (0x7FFFFFFF - ki.to(tl.int64)), -1)
                rank = tl.sum((key[None, :] > key[:, None]).to(tl.int32), 1)
                place = held & (rank < n)
                tl.store(OutF + out + 1 + rank, kv - log_z, mask=place)
                tl.store(OutI + out + 1 + MAXN + rank, ki, mask=place)
            else:  # (names of their own: Triton types a name alike in both branches)
                every = tl.arange(0, KEPT)
                copied = every < count
                values = tl.load(KeptV + r * KEPT + every, mask=copied, other=0.0)
                ids = tl.load(KeptI + r * KEPT + every, mask=copied, other=0).to(tl.int64)
                keys = tl.where(copied, (_order_key(values) << 31) | (0x7FFFFFFF - ids), -1)
                for j in range(0, tl.minimum(n, MAXN)):
                    best = tl.max(keys, 0)
                    tl.store(OutF + out + 1 + j, _from_key(best >> 31) - log_z)
                    tl.store(OutI + out + 1 + MAXN + j, (0x7FFFFFFF - (best & 0x7FFFFFFF)).to(tl.int32))
                    keys = tl.where(keys == best, -1, keys)


def _logprob_parts(vocab: int) -> tuple[int, int, int]:
    """How row_logprobs cuts a row: (chunk, chunks, lane maxima a chunk leaves). Fixed by the vocabulary alone, not
    by the rows of a step, so that each kernel compiles once (GraphExecutor warms them at load) instead of once a
    new count of rows mid-serving. About TOPS_AIM maxima a row, at least GRAPH_LOGPROBS."""
    chunk = LOGPROB_CHUNK_BLOCKS * RACE_BLOCK
    n_chunks = triton.cdiv(vocab, chunk)
    return chunk, n_chunks, triton.next_power_of_2(triton.cdiv(max(TOPS_AIM, GRAPH_LOGPROBS), n_chunks))


class LogprobScratch:
    """row_logprobs' device scratch for up to ``rows`` rows of ``vocab`` logits (allocated once: a step allocates
    nothing)."""

    def __init__(self, rows: int, vocab: int, device):
        _, n_chunks, tops_per = _logprob_parts(vocab)
        self.parts = torch.empty(2, rows * n_chunks, dtype=torch.float32, device=device)
        self.tops = torch.empty(rows * n_chunks * tops_per, dtype=torch.float32, device=device)
        self.taken = torch.empty(rows, dtype=torch.int32, device=device)
        self.kept = torch.empty(2, rows * KEPT, dtype=torch.float32, device=device)


def row_logprobs(logits: torch.Tensor, args: torch.Tensor, sampled: torch.Tensor, out: torch.Tensor,
                 scratch: LogprobScratch, rows: int | None = None) -> None:
    """Log-probabilities of drawn tokens with no host sync: ``args`` [3, cap] int64 (per row its row of ``logits``
    [S, V] float32, its token's index in ``sampled`` [B] int64, and how many top logprobs it wants, at most
    GRAPH_LOGPROBS and V; -1: no row) -> ``out`` [cap, 1 + 2 * GRAPH_LOGPROBS] float32: the token's log-softmax,
    then the top ones, larger first (the smaller id first among equal logits), then their ids (those columns' bytes
    are int32). ``rows``: only the first ``rows`` (default: cap). Three kernels: each row's chunks' maxima, sums and
    lane maxima (_logprob_parts); their n-th largest, a bound below the row's n-th, and the logits above it copied;
    the copies ranked."""
    cap = args.shape[1]
    vocab = logits.shape[1]
    rows = cap if rows is None else rows
    chunk, n_chunks, tops_per = _logprob_parts(vocab)
    n_tops = n_chunks * tops_per
    part_max, part_sum = scratch.parts[0], scratch.parts[1]
    kept_v, kept_i = scratch.kept[0], scratch.kept[1].view(torch.int32)
    _logprob_parts_kernel[(rows, n_chunks)](logits, args, part_max, part_sum, scratch.tops, scratch.taken,
                                            logits.stride(0), vocab, chunk, n_chunks, cap, BLOCK=RACE_BLOCK,
                                            TOPS_PER=tops_per, num_warps=8)
    _logprob_copy_kernel[(rows, n_chunks)](logits, args, scratch.tops, scratch.taken, kept_v, kept_i,
                                           logits.stride(0), vocab, chunk, n_tops, cap, BLOCK=RACE_BLOCK,
                                           TOPS=triton.next_power_of_2(n_tops), KEPT=KEPT, num_warps=8)
    _logprob_rank_kernel[(rows,)](logits, args, sampled, part_max, part_sum, scratch.taken, kept_v, kept_i, out,
                                  out.view(torch.int32), logits.stride(0), vocab, n_chunks, cap,
                                  PARTS=triton.next_power_of_2(n_chunks), BLOCK=LOGPROB_BLOCK, KEPT=KEPT,
                                  MAXN=GRAPH_LOGPROBS, RANKED=LOGPROB_RANKED, num_warps=LOGPROB_WARPS)


class RowDraws:
    """``draw_rows``' arguments for up to ``cap`` rows, on the device in one block of ``nbytes`` (its host copy has
    the same layout: ``views`` of either, so one copy uploads them): ``i64`` [4, cap] per row its index in
    ``sampled`` (-1: no row), its state row, seed and step; ``i32`` [3, cap] its Sampler slot (-1: none), top-k and
    chain flag; ``f32`` [3, cap] its temperature, top-p and min-p threshold (kernels.min_p_log_threshold); and
    ``logits`` [cap, V] float32, the scratch its state row's logits are gathered into."""

    def __init__(self, cap: int, vocab: int, device):
        self.cap = cap
        self.nbytes = cap * (4 * 8 + 3 * 4 + 3 * 4)
        self.block = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        self.i64, self.i32, self.f32 = self.views(self.block)
        self.logits = torch.zeros(cap, vocab, dtype=torch.float32, device=device)

    def views(self, block):
        """(i64, i32, f32) over ``block``: this object's device bytes, or a host copy's (a numpy uint8 array)."""
        cap = self.cap
        a, b = 4 * 8 * cap, 4 * 8 * cap + 3 * 4 * cap
        if isinstance(block, torch.Tensor):
            return (block[:a].view(torch.int64).view(4, cap), block[a:b].view(torch.int32).view(3, cap),
                    block[b:].view(torch.float32).view(3, cap))
        import numpy as np

        return (block[:a].view(np.int64).reshape(4, cap), block[a:b].view(np.int32).reshape(3, cap),
                block[b:self.nbytes].view(np.float32).reshape(3, cap))


@triton.jit
def _place_drawn_kernel(Tokens, Args, Sampled, LastToken, cap):
    """Row k's token into ``Sampled`` at its index and ``LastToken`` at its state row (RowDraws.i64's first two
    rows); a row with index -1 is none."""
    k = tl.program_id(0)
    at = tl.load(Args + k)
    if at >= 0:
        token = tl.load(Tokens + k)
        tl.store(Sampled + at, token)
        tl.store(LastToken + tl.load(Args + cap + k), token)


def draw_rows(state_logits: torch.Tensor, draws: RowDraws, tables: ShapeTables, sampled: torch.Tensor,
              last_token: torch.Tensor, rows: int) -> None:
    """The first ``rows`` rows of ``draws`` drawn apart from a step's batch, after it: each row's logits gathered
    from ``state_logits`` [S, V] (the model's, unshaped), shaped by its slot's tables and drawn by ``sample_full``
    with its own parameters, the token written to ``sampled`` [B] and ``last_token`` [S] (int64) and counted in its
    slot. A row draws what it would have drawn in the batch (a draw depends on its seed, step and logits alone), so
    the executor draws a grammar's rows this way once their masks, computed while the step's graph ran, are staged
    (GraphExecutor.grammar_after). No host sync; captured as a graph a count of rows."""
    i64, i32, f32 = draws.i64, draws.i32, draws.f32
    logits = draws.logits[:rows]
    torch.index_select(state_logits, 0, i64[1, :rows], out=logits)
    tokens = sample_full(logits, f32[0, :rows], i32[1, :rows], f32[1, :rows], i64[2, :rows], i64[3, :rows],
                         min_p_log=f32[2, :rows], shape=(i32[0, :rows], tables), chain=i32[2, :rows])
    _place_drawn_kernel[(rows,)](tokens, i64, sampled, last_token, draws.cap, num_warps=1)


def _parts(batch: int, vocab: int) -> tuple[int, int]:
    blocks = triton.cdiv(vocab, RACE_BLOCK)
    per_row = max(1, min(blocks, triton.cdiv(RACE_PROGRAMS, batch)))
    chunk = triton.cdiv(blocks, per_row) * RACE_BLOCK
    return chunk, triton.cdiv(vocab, chunk)


def _shape_args(shape, like: torch.Tensor) -> tuple:
    """The kernels' Slots, Counts, Prompt, Bias, Params, Bans, Grammar, Masks, Window, Ring and Lens arguments
    (placeholders without ``shape``), the ring's length and the bans' count a slot."""
    if shape is None:
        return (like,) * 11, 1, 1
    slots, t = shape
    return (slots, t.counts, t.prompt, t.bias, t.params, t.bans, t.grammar, t.masks, t.window, t.ring, t.lens), \
        t.ring.shape[1], t.bans.shape[1]


def sample_race(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                steps: torch.Tensor, shape: tuple[torch.Tensor, ShapeTables] | None = None) -> torch.Tensor:
    """logits [B, V] float32 (-inf: a token the row may not draw); temperature [B] float32; seeds/steps [B]
    int64 -> [B] int64: each row's draw at its temperature from its logits (the argmax at temperature 0).
    ``shape``: (slots [B] int32, the Sampler's tables): rows naming a slot (not -1) are shaped by its bias and
    penalties first (written back into ``logits``) and their tokens counted in it."""
    batch, vocab = logits.shape
    chunk, n_chunks = _parts(batch, vocab)
    part_val = torch.empty(batch, n_chunks, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(batch, n_chunks, dtype=torch.int32, device=logits.device)
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    shaping, ring, bans = _shape_args(shape, logits)
    _race_parts_kernel[(batch, n_chunks)](logits, temperature, seeds, steps, part_val, part_idx, seeds, temperature,
                                          temperature, seeds, part_val, part_val, part_val, part_val, part_idx,
                                          *shaping[:8],
                                          vocab, chunk, n_chunks, logits.stride(0), BLOCK=RACE_BLOCK, FULL=False, J=1,
                                          SHAPE=shape is not None, CHAIN=False, TOPS_PER=0, BANS=bans, num_warps=8)
    _race_pick_kernel[(batch,)](part_val, part_idx, out, shaping[0], shaping[1], *shaping[8:], vocab, n_chunks,
                                PARTS=triton.next_power_of_2(n_chunks), SHAPE=shape is not None, RING=ring,
                                num_warps=1)
    return out


def sample_greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] float32 -> [B] int64."""
    return logits.argmax(dim=-1)


def sample_full(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                seeds: torch.Tensor, steps: torch.Tensor, passes: torch.Tensor | None = None,
                min_p_log: torch.Tensor | None = None,
                shape: tuple[torch.Tensor, ShapeTables] | None = None,
                chain: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] float32; temperature/top_p [B] float32; top_k [B] int32 (0 = off);
    seeds/steps [B] int64 -> [B] int64: the race's draw among each row's min-p/top-k/top-p tokens (the argmax at
    temperature 0). ``passes`` ([B] int32, optional): the walk's passes over each row (0: no walk).
    ``min_p_log`` ([B] float32, optional): each row's min-p as the log of the least probability ratio to the most
    likely token in its scaled logits (kernels.min_p_log_threshold; -inf or None: off). ``shape``: as
    ``sample_race``'s. ``chain`` ([B] int32, optional): 1 where a row follows llama.cpp's default sampler chain
    (SamplingParams.sampler_order LLAMA_CPP_ORDER: top-k, then top-p on the unscaled logits' shares of the k, then
    min-p, the temperature last); 0 or None: vLLM's order (the temperature, min-p, top-k, then top-p on shares of
    what those kept)."""
    batch, vocab = logits.shape
    chunk, n_chunks = _parts(batch, vocab)
    dev = logits.device
    part_val = torch.empty(batch, n_chunks, CANDIDATES, dtype=torch.float32, device=dev)
    part_idx = torch.empty(batch, n_chunks, CANDIDATES, dtype=torch.int32, device=dev)
    part_max = torch.empty(batch, n_chunks, dtype=torch.float32, device=dev)
    part_sum = torch.empty(batch, n_chunks, dtype=torch.float32, device=dev)
    scores = torch.empty(batch, vocab, dtype=torch.float32, device=dev)
    # Each chunk's largest lane maxima for the rows with top-k and top-p (_top_k_logit), at most TOPS_MAX a row
    tops_per = min(16, triton.next_power_of_2(triton.cdiv(TOPS_AIM, n_chunks)))
    tops = torch.empty(batch, n_chunks, tops_per, dtype=torch.float32, device=dev)
    kept = torch.empty(batch, KEPT, dtype=torch.float32, device=dev)
    taken = torch.empty(batch, dtype=torch.int32, device=dev)
    out = torch.empty(batch, dtype=torch.int64, device=dev)
    if passes is None:
        passes = torch.empty(batch, dtype=torch.int32, device=dev)
    if min_p_log is None:
        min_p_log = torch.full((batch,), float("-inf"), dtype=torch.float32, device=dev)
    shaping, ring, bans = _shape_args(shape, logits)
    chained = chain if chain is not None else top_k
    _race_parts_kernel[(batch, n_chunks)](logits, temperature, seeds, steps, part_val, part_idx, top_k, top_p,
                                          min_p_log, chained, scores, part_max, part_sum, tops, taken, *shaping[:8],
                                          vocab,
                                          chunk, n_chunks, logits.stride(0), BLOCK=RACE_BLOCK, FULL=True,
                                          J=CANDIDATES, SHAPE=shape is not None, CHAIN=chain is not None,
                                          TOPS_PER=tops_per, BANS=bans, num_warps=8)
    _walk_kernel[(batch,)](logits, scores, temperature, top_k, top_p, min_p_log, chained, part_val, part_idx,
                           part_max, part_sum, tops, kept, taken, out, passes, shaping[0], shaping[1], *shaping[8:],
                           vocab, n_chunks, n_chunks * tops_per, logits.stride(0),
                           PARTS=triton.next_power_of_2(n_chunks * CANDIDATES), BLOCK=WALK_BLOCK, LIST=LIST_BLOCK,
                           J=CANDIDATES, SHAPE=shape is not None, RING=ring, CHAIN=chain is not None,
                           TOPS=max(128, triton.next_power_of_2(n_chunks * tops_per)), KEPT=KEPT,
                           num_warps=WALK_WARPS)
    return out
