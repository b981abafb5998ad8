// A decode step's attention over the paged KV pool at many rows, with the step's rotary and KV write folded in
// (the CUDA counterpart of triton_attention.paged_decode_attention_rope at one context share).
//
// One block per (row, kv head), four warps. The block first ropes its query group and the new key from the QKV
// projection's row (float32 from the stored tables, rounded to bf16 as the separate kernels round), writes the
// new token's K and V to the pool and keeps them in shared memory. Then each warp takes blocks of 16 key
// positions (warp w the blocks w, w + 4, ...) and runs its own online softmax over them on the tensor cores:
// mma.m16n8k16. QK^T has the query group as the rows of A (rows past the group zero) and a block's two 8-key
// halves as two products; P V runs transposed, O^T += V^T P^T, head dimensions as the rows (16 a product) and
// heads as the columns, because the QK^T accumulators of the two halves, as bf16 pairs, are then its B operand
// as they stand. Keys and values go straight from the pool into the operand registers (16-byte loads, past L1),
// with no shared-memory staging, in an order of the head dimensions that the sums do not see:
//   - for QK^T, lane (g, t) (g = lane / 4, t = lane % 4) loads key g's dimensions [D/4 t, D/4 (t + 1)) and reads
//     the query words in the same order from shared memory at each step (held in registers they pushed the
//     four-blocks build past 128 registers, into spills);
//   - for V^T, lane (g, t) loads dimensions [D/8 g, D/8 (g + 1)) of keys 2t, 2t + 1, 2t + 8 and 2t + 9: rows g
//     and g + 8 of every product (dimensions D/8 g + 2r and + 1 of product r), so its outputs are those
//     dimensions of heads 2t and 2t + 1.
// With PREFETCH the next block's keys and values load while this one computes. The page numbers a warp walks
// are read 32 blocks at a time, one per lane, and passed round by shuffles. At the end the warps merge through
// shared memory.
//
// Roundings as the Triton kernel: scores in float32 from bf16 products, the softmax in base 2 with the scale
// folded into scale_log2 (the same exponentials), each probability rounded to bf16 before it weighs a value (as
// tl.dot(p.to(bf16), v) does), the sum of exponentials from the unrounded ones; out = acc / l in bf16, zeros for
// a padding row (context 0), which still writes its (scratch) slot.
//
// Programmatic dependent launch: the block reads the step's lengths, positions, slots and rotary rows first, then
// waits (griddepcontrol.wait) for the QKV projection; once its keys are read it lets the next kernel (the o
// product) launch. Without the launch attribute both instructions do nothing.
//
// Defines: GROUP (query heads a kv head, <= 8), D (head dim, 64 or 128), PAGE (tokens a page, a multiple of 16),
// PREFETCH (0 or 1), BLOCKS_PER_SM (the launch bound the registers are fitted to).

typedef unsigned int u32;
typedef unsigned short u16;

#define THREADS 128
#define WARPS 4
#define KB 16                   // key positions a warp's block
#define KW (D / 8)              // u32 words of one key a lane holds for QK^T (D / 4 dimensions)
#define KSTEPS (D / 16)         // k steps of a QK^T product
#define VW (D / 16)             // u32 words of one value a lane holds for P V (D / 8 dimensions)
#define MPROD (D / 16)          // 16-dimension products of O^T += V^T P^T
#define NEG_BIG (-1.0e30f)      // a running max before any key (exp2 of it less a real max is 0)
#define NEG_INF __int_as_float(0xff800000u)  // a masked key's score

__device__ __forceinline__ float bf2f(u32 bits16) { return __uint_as_float(bits16 << 16); }
__device__ __forceinline__ u16 f2bf(float f) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}
__device__ __forceinline__ float round_bf(float f) { return bf2f(f2bf(f)); }
__device__ __forceinline__ u32 pack_bf(float lo, float hi) {  // two floats as a bf16 pair, lo in the low half
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ uint4 ld_stream(const u16* p) {  // a pool word: read once, not kept in L1
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ void load_words(u32* dst, const u16* src, int words, bool valid) {
#pragma unroll
    for (int i = 0; i < words; i += 4) {
        const uint4 w = valid ? ld_stream(src + 2 * i) : make_uint4(0, 0, 0, 0);
        dst[i] = w.x;
        dst[i + 1] = w.y;
        dst[i + 2] = w.z;
        dst[i + 3] = w.w;
    }
}

__device__ __forceinline__ void mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One block of KB keys in registers: k[h] the QK^T words of key 8h + g, v[i] the P V words of key kv_key(i).
struct Block {
    u32 k[2][KW];
    u32 v[4][VW];
};

__device__ __forceinline__ int kv_key(int i, int t) { return 2 * t + (i & 1) + 8 * (i >> 1); }

// Block `first / KB` from the pool (keys first .. first + 15, those at or past `limit` zero).
__device__ __forceinline__ void load_pool(Block& b, const u16* kcol, const u16* vcol, long long slot0,
                                          long long stride_slot, int first, int limit, int g, int t) {
#pragma unroll
    for (int h = 0; h < 2; h++)
        load_words(b.k[h], kcol + (slot0 + 8 * h + g) * stride_slot, KW, first + 8 * h + g < limit);
#pragma unroll
    for (int i = 0; i < 4; i++)
        load_words(b.v[i], vcol + (slot0 + kv_key(i, t)) * stride_slot, VW, first + kv_key(i, t) < limit);
}

// The block's keys folded into the warp's softmax: m (uniform over a row's four lanes), l (this lane's share
// of row g's sum), o[r] the accumulators of output product r (O^T: rows dimensions, columns heads 2t and 2t + 1).
__device__ __forceinline__ void consume(const Block& b, const uint2* qa, int first, int limit,
                                        float scale_log2, float& m, float& l, float (&o)[MPROD][4], int t) {
    float s[2][2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < KSTEPS; j++) {
            const uint2 q = qa[j];  // from shared memory: the registers go to keys in flight
            mma(c, q.x, 0u, q.y, 0u, b.k[h][2 * j], b.k[h][2 * j + 1]);
        }
#pragma unroll
        for (int e = 0; e < 2; e++) s[h][e] = first + 8 * h + 2 * t + e < limit ? c[e] * scale_log2 : NEG_INF;
    }
    float mx = fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    mx = fmaxf(m, mx);
    const float alpha = exp2f(m - mx);
    m = mx;
    float p[2][2];
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int e = 0; e < 2; e++) p[h][e] = exp2f(s[h][e] - mx);
    l = l * alpha + ((p[0][0] + p[0][1]) + (p[1][0] + p[1][1]));
    // P (row g: keys 2t, 2t+1 | 2t+8, 2t+9) is the B operand of O^T += V^T P^T as it stands.
    const u32 pb0 = pack_bf(p[0][0], p[0][1]), pb1 = pack_bf(p[1][0], p[1][1]);
    // This lane's output columns are heads 2t and 2t + 1: their rescales from those rows' lanes.
    const float a_lo = __shfl_sync(0xffffffffu, alpha, 8 * t), a_hi = __shfl_sync(0xffffffffu, alpha, 8 * t + 4);
#pragma unroll
    for (int r = 0; r < MPROD; r++) {
        o[r][0] *= a_lo;
        o[r][1] *= a_hi;
        o[r][2] *= a_lo;
        o[r][3] *= a_hi;
        // V^T rows g and g + 8 of product r are dimensions D/8 g + 2r and + 1: the low and high halves.
        const u32 a0 = __byte_perm(b.v[0][r], b.v[1][r], 0x5410u), a1 = __byte_perm(b.v[0][r], b.v[1][r], 0x7632u);
        const u32 a2 = __byte_perm(b.v[2][r], b.v[3][r], 0x5410u), a3 = __byte_perm(b.v[2][r], b.v[3][r], 0x7632u);
        mma(o[r], a0, a1, a2, a3, pb0, pb1);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, BLOCKS_PER_SM)
flared_decode_attention(const u16* __restrict__ qkv, int stride_qkv, const u16* __restrict__ cos_t,
                        const u16* __restrict__ sin_t, const long long* __restrict__ positions,
                        const long long* __restrict__ slots, u16* k_pool, u16* v_pool, long long stride_slot,
                        u16* __restrict__ out, int stride_o_row, int stride_o_head,
                        const int* __restrict__ block_tables, int stride_bt, const int* __restrict__ context_lens,
                        int num_heads, int num_kv_heads, float scale_log2) {
    __shared__ __align__(16) u16 q_s[8][D];  // rows past the group stay zero: A's rows g >= GROUP
    __shared__ __align__(16) u16 knew_s[D];
    __shared__ __align__(16) u16 vnew_s[D];
    __shared__ float m_s[WARPS][GROUP], l_s[WARPS][GROUP];
    __shared__ float acc_s[WARPS][GROUP][D];

    const int row = blockIdx.x / num_kv_heads, kvh = blockIdx.x % num_kv_heads;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int ctx = context_lens[row];
    const long long pos = positions[row], slot = slots[row];
    const int* table = block_tables + (long long)row * stride_bt;
    const int older = ctx > 0 ? ctx - 1 : 0;  // positions read from the pool; the newest comes from registers
    const int nblocks = (older + KB - 1) / KB;
    // This warp's page numbers, 32 blocks at a time: lane i holds that of the warp's block 32 c + i.
    int pages = warp + WARPS * lane < nblocks ? table[(warp + WARPS * lane) * KB / PAGE] : 0;

    // The rotary and the new token's K and V (a thread a dimension).
    const bool mine = tid < D;
    const float cs = mine ? bf2f(cos_t[pos * D + tid]) : 0.f, sn = mine ? bf2f(sin_t[pos * D + tid]) : 0.f;
    for (int i = GROUP * D + tid; i < 8 * D; i += THREADS) q_s[i / D][i % D] = 0;
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (mine) {
        const int d = tid, partner = (tid + D / 2) % D;
        const u16* base = qkv + (long long)row * stride_qkv;
#pragma unroll
        for (int h = 0; h < GROUP; h++) {
            const u16* x = base + (kvh * GROUP + h) * D;
            q_s[h][d] = f2bf(bf2f(x[d]) * cs + bf2f(x[partner]) * sn);
        }
        const u16* kn = base + (num_heads + kvh) * D;
        const u16 k_new = f2bf(bf2f(kn[d]) * cs + bf2f(kn[partner]) * sn);
        const u16 v_new = base[(num_heads + num_kv_heads + kvh) * D + d];
        knew_s[d] = k_new;
        vnew_s[d] = v_new;
        k_pool[slot * stride_slot + kvh * D + d] = k_new;
        v_pool[slot * stride_slot + kvh * D + d] = v_new;
    }
    __syncthreads();

    // Lane (g, t)'s query words for k step j: qa[j] (dimensions D/4 t + 4j .. + 3, the order the keys load in).
    const uint2* qa = (const uint2*)q_s[g] + D / 16 * t;
    float m = NEG_BIG, l = 0.f, o[MPROD][4];
#pragma unroll
    for (int r = 0; r < MPROD; r++) o[r][0] = o[r][1] = o[r][2] = o[r][3] = 0.f;

    const u16* kcol = k_pool + kvh * D + D / 4 * t;
    const u16* vcol = v_pool + kvh * D + D / 8 * g;
    auto page_of = [&](int n) {  // the page of the warp's n-th block (n advancing: reloads every 32)
        if (n % 32 == 0 && n > 0) {
            const int kb = warp + WARPS * (n + lane);
            pages = kb < nblocks ? table[kb * KB / PAGE] : 0;
        }
        return __shfl_sync(0xffffffffu, pages, n % 32);
    };
    auto load = [&](Block& b, int n) {
        const int first = (warp + WARPS * n) * KB;
        const long long slot0 = (long long)page_of(n) * PAGE + first % PAGE;
        load_pool(b, kcol, vcol, slot0, stride_slot, first, older, g, t);
    };
    const int mine_blocks = warp < nblocks ? (nblocks - warp + WARPS - 1) / WARPS : 0;
#if PREFETCH
    Block a, b;
    if (mine_blocks > 0) load(a, 0);
    for (int n = 0; n < mine_blocks; n += 2) {
        if (n + 1 < mine_blocks) load(b, n + 1);
        consume(a, qa, (warp + WARPS * n) * KB, older, scale_log2, m, l, o, t);
        if (n + 1 >= mine_blocks) break;
        if (n + 2 < mine_blocks) load(a, n + 2);
        consume(b, qa, (warp + WARPS * (n + 1)) * KB, older, scale_log2, m, l, o, t);
    }
#else
    for (int n = 0; n < mine_blocks; n++) {
        Block a;
        load(a, n);
        consume(a, qa, (warp + WARPS * n) * KB, older, scale_log2, m, l, o, t);
    }
#endif
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (warp == 0 && ctx > 0) {  // the newest position, from shared memory: key 0 of a block of its own
        Block a;
        const u32* kw = (const u32*)knew_s + D / 8 * t;
        const u32* vw = (const u32*)vnew_s + D / 16 * g;
#pragma unroll
        for (int i = 0; i < KW; i++) {
            a.k[0][i] = g == 0 ? kw[i] : 0u;
            a.k[1][i] = 0u;
        }
#pragma unroll
        for (int i = 0; i < VW; i++) {
            a.v[0][i] = t == 0 ? vw[i] : 0u;
            a.v[1][i] = a.v[2][i] = a.v[3][i] = 0u;
        }
        consume(a, qa, 0, 1, scale_log2, m, l, o, t);
    }

    // The row sums over a row's four lanes, then every warp's partials to shared memory and merged.
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (g < GROUP && t == 0) {
        m_s[warp][g] = m;
        l_s[warp][g] = l;
    }
#pragma unroll
    for (int c = 0; c < 2; c++) {
        if (2 * t + c < GROUP) {
#pragma unroll
            for (int r = 0; r < MPROD; r++) {
                acc_s[warp][2 * t + c][D / 8 * g + 2 * r] = o[r][c];
                acc_s[warp][2 * t + c][D / 8 * g + 2 * r + 1] = o[r][2 + c];
            }
        }
    }
    __syncthreads();
    if (mine) {
        const int d = tid;
#pragma unroll
        for (int h = 0; h < GROUP; h++) {
            float mm = m_s[0][h];
#pragma unroll
            for (int w = 1; w < WARPS; w++) mm = fmaxf(mm, m_s[w][h]);
            float ll = 0.f, a = 0.f;
#pragma unroll
            for (int w = 0; w < WARPS; w++) {
                const float f = exp2f(m_s[w][h] - mm);
                ll += l_s[w][h] * f;
                a += acc_s[w][h][d] * f;
            }
            out[(long long)row * stride_o_row + (kvh * GROUP + h) * stride_o_head + d] = f2bf(ll > 0.f ? a / ll : 0.f);
        }
    }
}
