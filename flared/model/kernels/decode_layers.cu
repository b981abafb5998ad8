// Every decoder layer of a few-row bfloat16 decode step in ONE persistent kernel.
//
// A launch of the small kernels of a decode layer costs ~4.5 us inside a CUDA graph however little it
// reads (docs/benchmarks.md), so a 30-layer model at one row is launch-bound at ~5 kernels per layer.
// Here one block per multiprocessor walks every layer; the phases of a layer are separated by a
// grid-wide barrier (an atomic arrival counter) instead of kernel boundaries:
//
//   P1  RMSNorm (each block, redundantly) -> QKV rows, one warp per row; k rows in rotary pairs, roped
//       and written to the KV pool; v rows to the pool; q rows raw to `qkv`
//   P2  paged decode attention: each (row, q head) split over spare blocks on long contexts (SPLIT_KEYS);
//       rotary on q; each warp one slice of its block's keys in 32-key tiles (K rows to registers, V rows
//       to shared memory by cp.async), online softmax; the block's warps merged in shared memory, a split
//       head's partials merged by the last of its blocks to finish. RES (one row): one block per kv head (a group
//       of two or four on longer contexts) over keys it copied into shared memory a layer ahead, on the tensor
//       cores (explained where defined)
//   P3  o rows; residual += o
//   P4  RMSNorm -> gate and up rows in pairs -> act = silu(gate) * up
//   P5  down rows; residual += down
//
// and a final RMSNorm (with HEAD, the LM head and greedy argmax too). The rows' embeddings can be gathered
// by the kernel itself (`embed`). Weights never change during a launch, so each warp loads its next
// phase's first weight rows into registers before the barrier where a row is short: the product then
// waits only for its input vector. Longer rows stream after it (an L2 prefetch of their first lines,
// PF_LINES, measured slower and is off).
//
// Roundings follow the unfused ops (paged_decoder.py's fused path): projections rounded to bf16, the
// normed activations bf16(bf16(x * inv_rms) * w), rotary in fp32 from bf16 inputs, silu rounded before
// the product, the residual updated as bf16(h + bf16(y)). Summation order differs from cuBLAS.
//
// Compile-time constants (-D): H, NH, NKV, D, I, L, R (rows), KMAX = max(H, NH*D, I), PAGE (tokens per KV
// page), SPLITS, SPLIT_KEYS, THREADS, HAS_QKV_BIAS, HAS_O_BIAS, EPS, SCALE_LOG2 (softmax scale * log2 e),
// PF_LINES (128-byte lines prefetched per lane per row), HEAD, HEAD_ROWS, GEMV_BATCH, GEMV_BATCH_PAIR, SKIP
// (diagnosis only); P1_BALANCE=0 (P1's rows in order, explained where defined); RES, RES_CAP, RES_TAIL, RES_SPLIT,
// RES_SPLIT4, RES_PARTS (one row's attention from keys held in shared memory, explained where defined).
//
// Co-residency: the launcher gives one block per multiprocessor and checks that the block fits; a
// barrier that waits far too long traps (a launch error) rather than hanging the GPU.

typedef unsigned short bf16;

#define WARPS (THREADS / 32)
#define QKV_ROWS ((NH + 2 * NKV) * D)
#define HALF (D / 2)
#define DPL (D / 32)
#define NEG_INF (__uint_as_float(0xff800000u))
#ifndef HEAD
#define HEAD 0  // 1: the LM head, the logits writes and greedy argmax run in this kernel too
#endif
#ifndef SPLIT_KEYS
#define SPLIT_KEYS 128  // attention splits a (row, head) only into pieces of at least this many keys
#endif
#ifndef HEAD_ROWS
#define HEAD_ROWS 0  // LM-head rows a warp streams together (0: 4 for short-row models, else 2)
#endif
#ifndef GEMV_BATCH
#define GEMV_BATCH 8  // 16-byte weight loads per lane a streamed row issues together (tools/profile_megakernel.py)
#endif
#ifndef GEMV_BATCH_PAIR
#define GEMV_BATCH_PAIR GEMV_BATCH  // the same per row where a warp streams two rows together (k pairs, gate/up)
#endif

// ---- scalar helpers ----------------------------------------------------------------------------

__device__ __forceinline__ float bf2f(unsigned int bits16) { return __uint_as_float(bits16 << 16); }

__device__ __forceinline__ bf16 f2bf(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)0x7fc0;  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);                           // round to nearest even
    return (bf16)(u >> 16);
}

__device__ __forceinline__ float round_bf(float f) { return bf2f(f2bf(f)); }

// Weights: read-only for the whole launch. Data other blocks wrote during this launch is read with
// __ldcg (from L2: L1 is not coherent). Plain intrinsics, not volatile asm, so the compiler can issue
// independent loads back to back; the barriers are compiler memory barriers.
#ifndef LDW_NOALLOC
#define LDW_NOALLOC 1  // weight loads hint L1::no_allocate (0: plain __ldg, the A/B)
#endif
__device__ __forceinline__ uint4 ld_weight(const bf16* p) {
#if LDW_NOALLOC
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#else
    return __ldg((const uint4*)p);
#endif
}
__device__ __forceinline__ uint4 ld_shared_v4(const void* p) { return __ldcg((const uint4*)p); }
__device__ __forceinline__ float ld_shared_bf(const bf16* p) { return bf2f(__ldcg(p)); }
__device__ __forceinline__ float ld_shared_f32(const float* p) { return __ldcg(p); }
__device__ __forceinline__ unsigned int ld_shared_u32(const void* p) { return __ldcg((const unsigned int*)p); }

__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// The first PF_LINES * 32 lines (128 bytes each) of a weight row of `k` elements, spread over the warp.
__device__ __forceinline__ void prefetch_row(const bf16* row, int k, int lane) {
    const int lines = (k * 2 + 127) / 128;
    for (int i = lane; i < lines && i < 32 * PF_LINES; i += 32) prefetch_l2((const char*)row + i * 128);
}

__device__ __forceinline__ float dot8(uint4 w, uint4 x) {
    float s = bf2f(w.x & 0xffffu) * bf2f(x.x & 0xffffu);
    s = fmaf(__uint_as_float(w.x & 0xffff0000u), __uint_as_float(x.x & 0xffff0000u), s);
    s = fmaf(bf2f(w.y & 0xffffu), bf2f(x.y & 0xffffu), s);
    s = fmaf(__uint_as_float(w.y & 0xffff0000u), __uint_as_float(x.y & 0xffff0000u), s);
    s = fmaf(bf2f(w.z & 0xffffu), bf2f(x.z & 0xffffu), s);
    s = fmaf(__uint_as_float(w.z & 0xffff0000u), __uint_as_float(x.z & 0xffff0000u), s);
    s = fmaf(bf2f(w.w & 0xffffu), bf2f(x.w & 0xffffu), s);
    s = fmaf(__uint_as_float(w.w & 0xffff0000u), __uint_as_float(x.w & 0xffff0000u), s);
    return s;
}

__device__ __forceinline__ float sumsq8(uint4 x) {
    float a = bf2f(x.x & 0xffffu), b = __uint_as_float(x.x & 0xffff0000u);
    float c = bf2f(x.y & 0xffffu), d = __uint_as_float(x.y & 0xffff0000u);
    float e = bf2f(x.z & 0xffffu), f = __uint_as_float(x.z & 0xffff0000u);
    float g = bf2f(x.w & 0xffffu), h = __uint_as_float(x.w & 0xffff0000u);
    return a * a + b * b + c * c + d * d + e * e + f * f + g * g + h * h;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// ---- grid barrier ------------------------------------------------------------------------------

// Every block arrives (a release add: the block's writes, ordered before it by bar.sync, become visible
// at GPU scope first) and waits until the counter reaches `target` (an acquire load). The counter is never
// reset: it counts every arrival of every launch, and `target` is this launch's base plus its arrivals so
// far, compared modulo 2^32.
__device__ __forceinline__ void grid_barrier(unsigned int* counter, unsigned int target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
        unsigned int seen, spins = 0;
        while (true) {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
            if ((int)(seen - target) >= 0) break;
            if (++spins > (1u << 26)) __trap();  // a block that never arrived: fail the launch, never hang
        }
    }
    __syncthreads();
}

// Arrive without waiting (HX: a boundary whose data travels as tagged words still counts its arrivals, so every
// launch arrives the same number of times).
__device__ __forceinline__ void grid_arrive(unsigned int* counter) {
    __syncthreads();
    if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
}

// ---- low-latency (LL) exchange (LL=1) -------------------------------------------------------------
//
// With LL, no phase boundary is a grid barrier: every phase's inputs travel as 64-bit words, the value's float
// bits and a 32-bit tag naming (launch, layer, phase), written with one single-copy-atomic store. A consumer
// polls the words it needs until each carries the tag it expects: the poll is the load, so the barrier's
// round trip (arrive, then see the count) and the input load after it become one round trip.
// - Attention reads the step's own key and value from P1's words, not from the pool (where P1 also writes
//   them, for later steps): nothing in a launch reads a pool slot that launch writes.
// - No word is rewritten while a slow block may still wait for it: P3, P4, P5 and the next P1 each read
//   every word the phase before wrote, so a block can only start layer l + 1's P1 once every block has
//   finished layer l's P2, and so on round the layer.
// - The launch's epoch (sync[1], bumped by block 0 at the end, after every block has read it by the same
//   argument) keeps a word left from the previous launch from passing for this one's.
#ifndef LL
#define LL 0
#endif
#if LL && SKIP
#error "SKIP diagnostics leave LL inputs unwritten"
#endif
#ifndef LL_BATCH
#define LL_BATCH 4  // words a thread polls together
#endif

typedef unsigned long long u64;

__device__ __forceinline__ void st_ll(u64* p, float v, unsigned int tag) {
    const u64 word = ((u64)tag << 32) | (u64)__float_as_uint(v);
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(word) : "memory");
}

__device__ __forceinline__ u64 ld_ll(const u64* p) {
    u64 v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// The value of word p once it carries `tag` (`first`: a load already issued).
__device__ __forceinline__ float wait_ll(const u64* p, u64 first, unsigned int tag) {
    unsigned int spins = 0;
    while ((unsigned int)(first >> 32) != tag) {
        if (++spins > (1u << 26)) __trap();  // a word never written: fail the launch, never hang
        first = ld_ll(p);
    }
    return __uint_as_float((unsigned int)first);
}

// put(i, value) for each of the n words of src (thread-strided), LL_BATCH polls in flight per thread.
template <typename F>
__device__ __forceinline__ void fetch_ll(const u64* src, int n, unsigned int tag, F put) {
    for (int i0 = threadIdx.x; i0 < n; i0 += THREADS * LL_BATCH) {
        u64 v[LL_BATCH];
#pragma unroll
        for (int k = 0; k < LL_BATCH; ++k)
            if (i0 + k * THREADS < n) v[k] = ld_ll(src + i0 + k * THREADS);
#pragma unroll
        for (int k = 0; k < LL_BATCH; ++k) {
            const int i = i0 + k * THREADS;
            if (i < n) put(i, wait_ll(src + i, v[k], tag));
        }
    }
}

// ---- shared memory ------------------------------------------------------------------------------

#ifndef RES
#define RES 0
#endif
#ifndef RES_CAP
#define RES_CAP 0  // keys of one kv head the resident region holds (a multiple of 16; megakernel.py sizes it)
#endif
#ifndef RES_TAIL
#define RES_TAIL 0  // keys past RES_CAP a resident launch stages in `vec` during P2 (a multiple of 16)
#endif
#ifndef RES_SPLIT
#define RES_SPLIT 0  // with HX bit 0: the shortest context whose kv heads take two resident blocks each (0: past
#endif               // RES_CAP + RES_TAIL, where one block's keys end), explained at res_attention
#ifndef RES_SPLIT4
#define RES_SPLIT4 0  // the same for four blocks each (0: never)
#endif
#ifndef RES_PARTS
#define RES_PARTS 4   // resident blocks a kv head at most (megakernel.RESIDENT_PARTS sizes the words for it)
#endif
#define RS (D + 8)  // the queries' row stride in elements (272 bytes at D = 128: ldmatrix without bank conflicts)
#define GQ (NH / NKV)
#ifndef HX
#define HX 0  // bit 0, with RES: P1 -> P2 -> P3 exchange tagged words (the resident blocks, or past the resident
#endif        // keys the split path's blocks, poll q, k, v; all poll attn); bit 1: P3 -> P4 too, bit 2: P5 -> the
              // next P1 (every block polls the residual's words)
#if (HX & 1) && (!RES || LL || SKIP)
#error "HX bit 0 needs the resident barrier build without SKIP"
#endif
#if (HX & 6) && (LL || SKIP)
#error "HX bits 1 and 2 need the barrier build without SKIP"
#endif
#if RES && RES_TAIL * 4 * D > R * KMAX * 2
#error "RES_TAIL keys do not fit the vector buffer"
#endif
#if RES && (R != 1 || LL || GQ > 16 || D % 16)
#error "resident attention: one row, barrier build, at most 16 query heads per kv head, D a multiple of 16"
#endif

// The input rows of a product phase, or during attention each warp's staged V tile [WARPS][32][D] (a RES build
// stages them in its resident region).
#define VEC_ELEMS (RES || R * KMAX > WARPS * 32 * D ? R * KMAX : WARPS * 32 * D)

struct Smem {
    bf16* vec;     // [VEC_ELEMS] the current phase's input rows [R][KMAX] / V tiles
    bf16* hs;      // [R][H] the residual as the last norm read it (the residual epilogues add to it)
    bf16* wn;      // [H] the norm weight
    float* red;    // [WARPS * R + R] reduction scratch, then 1/rms per row
    float* qs;     // [WARPS][D] each warp's attention accumulator
    float* qv;     // [D] the block's rotated, scaled query
    float* wml;    // [2 * WARPS] each warp's softmax max and sum
    float* cs;     // [R][D] cos at each row's position
    float* sn;     // [R][D] signed sin at each row's position
    long long* slot;  // [R]
    long long* tok;   // [R] each row's token (with `embed`)
    int* ctx;         // [R]
    bf16* kres;       // RES: [RES_CAP][D] resident keys, then [RES_CAP][D] values (16-byte aligned, swizzled)
};

// vec[r][0:K] = src[r][0:K] (bf16, rows of stride K in global memory).
template <int K>
__device__ __forceinline__ void load_rows(const bf16* src, bf16* vec) {
    for (int i = threadIdx.x; i < R * (K / 8); i += THREADS) {
        const int r = i / (K / 8), c = i % (K / 8);
        *(uint4*)(vec + r * KMAX + c * 8) = ld_shared_v4(src + (long long)r * K + c * 8);
    }
    __syncthreads();
}

// The same from LL words of `tag` (values that are bf16 already).
template <int K>
__device__ __forceinline__ void load_rows_ll(const u64* src, unsigned int tag, bf16* vec) {
    fetch_ll(src, R * K, tag, [&](int i, float v) { vec[(i / K) * KMAX + i % K] = f2bf(v); });
    __syncthreads();
}

// vec[r] = bf16(bf16(src[r] * inv_rms(src[r])) * w) for every row r of src [R][H]; hs = src.
// With emb: row r is emb's row sm.tok[r] instead of src's (the first layer, the kernel gathering embeddings).
// With llsrc: the rows are LL words of `tag` instead.
__device__ void load_norm(const bf16* src, const bf16* w, const Smem& sm, const bf16* emb = nullptr,
                          const u64* llsrc = nullptr, unsigned int tag = 0) {
    float ss[R];
#pragma unroll
    for (int r = 0; r < R; ++r) ss[r] = 0.f;
    for (int c = threadIdx.x; c < H / 8; c += THREADS)
        *(uint4*)(sm.wn + c * 8) = __ldg((const uint4*)(w + c * 8));
    if ((LL || HX) && llsrc != nullptr) {
        fetch_ll(llsrc, R * H, tag, [&](int i, float v) {
            const int r = i / H;
            sm.hs[i] = f2bf(v);
#pragma unroll
            for (int rr = 0; rr < R; ++rr)
                if (rr == r) ss[rr] += v * v;
        });
    }
    for (int i = threadIdx.x; !((LL || HX) && llsrc != nullptr) && i < R * (H / 8); i += THREADS) {
        const int r = i / (H / 8), c = i % (H / 8);
        const uint4 v = emb != nullptr ? ld_weight(emb + sm.tok[r] * H + c * 8)
                                       : ld_shared_v4(src + (long long)r * H + c * 8);
        *(uint4*)(sm.hs + r * H + c * 8) = v;
#pragma unroll
        for (int rr = 0; rr < R; ++rr)
            if (rr == r) ss[rr] += sumsq8(v);
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float s = warp_sum(ss[r]);
        if (lane == 0) sm.red[warp * R + r] = s;
    }
    __syncthreads();
    if (threadIdx.x < R) {
        float s = 0.f;
        for (int k = 0; k < WARPS; ++k) s += sm.red[k * R + threadIdx.x];
        sm.red[WARPS * R + threadIdx.x] = rsqrtf(s / (float)H + EPS);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < R * (H / 2); i += THREADS) {
        const int r = i / (H / 2), c = i % (H / 2);
        const float inv = sm.red[WARPS * R + r];
        const unsigned int x = *(const unsigned int*)(sm.hs + r * H + c * 2);
        const unsigned int wv = *(const unsigned int*)(sm.wn + c * 2);
        const float lo = round_bf(bf2f(x & 0xffffu) * inv) * bf2f(wv & 0xffffu);
        const float hi = round_bf(__uint_as_float(x & 0xffff0000u) * inv) * __uint_as_float(wv & 0xffff0000u);
        *(unsigned int*)(sm.vec + r * KMAX + c * 2) = (unsigned int)f2bf(lo) | ((unsigned int)f2bf(hi) << 16);
    }
    __syncthreads();
}

// ---- warp GEMV: NR weight rows of K elements against the R shared-memory vectors ------------------

// acc[n][r] += row n's chunk `b` (16 bytes, chunk index c of the row) . vec[r]'s chunk c
template <int NR, int WR, int N>
__device__ __forceinline__ void add_chunk(const uint4 (&w)[WR][N], int b, int c, const bf16* vec,
                                          float (&acc)[NR][R]) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const uint4 x = *(const uint4*)(vec + r * KMAX + c * 8);
#pragma unroll
        for (int n = 0; n < NR; ++n) acc[n][r] += dot8(w[n][b], x);
    }
}

template <int NR>
__device__ __forceinline__ void zero_acc(float (&acc)[NR][R]) {
#pragma unroll
    for (int n = 0; n < NR; ++n)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[n][r] = 0.f;
}

template <int NR>
__device__ __forceinline__ void reduce_acc(float (&acc)[NR][R]) {
#pragma unroll
    for (int n = 0; n < NR; ++n)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[n][r] = warp_sum(acc[n][r]);
}

template <int K, int NR>
__device__ __forceinline__ void warp_dot(const bf16* w0, const bf16* w1, const bf16* vec, float (&acc)[NR][R],
                                         int lane) {
    constexpr int CH = K / 8;              // 16-byte chunks per row
    constexpr int PER = (CH + 31) / 32;    // chunks per lane
    constexpr int GB = NR > 1 ? GEMV_BATCH_PAIR : GEMV_BATCH;
    constexpr int BATCH = PER < GB ? PER : GB;
    zero_acc<NR>(acc);
#pragma unroll
    for (int i0 = 0; i0 < PER; i0 += BATCH) {
        uint4 w[NR][BATCH];
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            const int c = lane + 32 * (i0 + b);
            if (i0 + b < PER && c < CH) {
                w[0][b] = ld_weight(w0 + c * 8);
                if (NR > 1) w[NR - 1][b] = ld_weight(w1 + c * 8);
            }
        }
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            const int c = lane + 32 * (i0 + b);
            if (i0 + b < PER && c < CH) add_chunk<NR>(w, b, c, vec, acc);
        }
    }
    reduce_acc<NR>(acc);
}

// The same for NR rows at any addresses (the LM head: more loads in flight per lane). warp_dot stays its
// own copy: written through this one, the 8B builds compiled to different spills (NVRTC 12.9), unmeasured.
template <int K, int NR>
__device__ __forceinline__ void warp_dot_rows(const bf16* const (&wr)[NR], const bf16* vec, float (&acc)[NR][R],
                                              int lane) {
    constexpr int CH = K / 8;
    constexpr int PER = (CH + 31) / 32;
    constexpr int BATCH = PER < GEMV_BATCH ? PER : GEMV_BATCH;
    zero_acc<NR>(acc);
#pragma unroll
    for (int i0 = 0; i0 < PER; i0 += BATCH) {
        uint4 w[NR][BATCH];
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            const int c = lane + 32 * (i0 + b);
            if (i0 + b < PER && c < CH) {
#pragma unroll
                for (int n = 0; n < NR; ++n) w[n][b] = ld_weight(wr[n] + c * 8);
            }
        }
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            const int c = lane + 32 * (i0 + b);
            if (i0 + b < PER && c < CH) add_chunk<NR>(w, b, c, vec, acc);
        }
    }
    reduce_acc<NR>(acc);
}

// Rows short enough to sit in registers (<= 8 chunks per lane) are loaded before the barrier that precedes
// their phase, so the product waits only for its input vector. Longer rows stream (warp_dot); PF_LINES > 0
// would L2-prefetch their first lines instead (off: measured slower).
template <int K> struct Row {
    static constexpr int PER = (K / 8 + 31) / 32;
    static constexpr bool PRE = PER <= 8;
};

template <int K>
__device__ __forceinline__ void load_w(const bf16* w0, const bf16* w1, uint4 (&w)[2][Row<K>::PER], int lane) {
#pragma unroll
    for (int b = 0; b < Row<K>::PER; ++b) {
        const int c = lane + 32 * b;
        if (c < K / 8) {
            w[0][b] = ld_weight(w0 + c * 8);
            if (w1 != nullptr) w[1][b] = ld_weight(w1 + c * 8);
        }
    }
}

template <int K, int NR>
__device__ __forceinline__ void dot_w(const uint4 (&w)[2][Row<K>::PER], const bf16* vec, float (&acc)[NR][R],
                                      int lane) {
    zero_acc<NR>(acc);
#pragma unroll
    for (int b = 0; b < Row<K>::PER; ++b) {
        const int c = lane + 32 * b;
        if (c < K / 8) add_chunk<NR>(w, b, c, vec, acc);
    }
    reduce_acc<NR>(acc);
}

// STAGE_O (RES builds, on where the rows fit): while the resident blocks attend, DRAM idles and the other
// blocks only wait. Each of their warps copies its first o row (NH * D elements) into its block's resident region,
// unused outside the resident blocks, before P2, and P3 takes that row from shared memory. The sums run in
// warp_dot's order, so the results do not change. Past the resident keys the blocks without an attention piece
// do the same (8B, 344 tokens, 4,096-page pool: 4,024-4,025 vs 4,058 us a step). Llama-3.1-8B one row on the H200, the whole decode step against
// L2 prefetches of those rows (eighteenth session, two runs each): 3,880-3,884 vs 3,920-3,925 us at 192 tokens,
// 3,955-3,958 vs 3,985-3,987 at 280; the launch alone 3,636-3,640 vs 3,654-3,658 at 256.
#ifndef STAGE_O
#define STAGE_O (RES && WARPS * NH * D <= 2 * RES_CAP * D)
#endif
#if STAGE_O && RES && WARPS * NH * D > 2 * RES_CAP * D
#error "STAGE_O: the warps' first o rows do not fit the resident region"
#endif

// A weight row of K elements into shared memory `dst`, lane by lane (cp.async.cg, one group).
template <int K>
__device__ __forceinline__ void stage_row(const bf16* row, bf16* dst, int lane) {
    for (int c = lane; c < K / 8; c += 32) {
        const unsigned int d = (unsigned int)__cvta_generic_to_shared(dst + c * 8);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(row + c * 8) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// warp_dot of one row staged by stage_row (this lane's chunks: its own copies, waited for here), same sum order.
template <int K>
__device__ __forceinline__ void dot_staged(const bf16* row, const bf16* vec, float (&acc)[1][R], int lane) {
    asm volatile("cp.async.wait_all;" ::: "memory");
    zero_acc<1>(acc);
#pragma unroll 4
    for (int c = lane; c < K / 8; c += 32) {
        const uint4 w = *(const uint4*)(row + c * 8);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[0][r] += dot8(w, *(const uint4*)(vec + r * KMAX + c * 8));
    }
    reduce_acc<1>(acc);
}

// The weight rows of this warp's first P1 unit (q or v: one row; k pair: two).
__device__ __forceinline__ void qkv_rows(const bf16* wq, int u, const bf16** w0, const bf16** w1) {
    if (u < NH * D) {
        *w0 = wq + (long long)u * H;
        *w1 = nullptr;
    } else if (u < NH * D + NKV * HALF) {
        const int idx = u - NH * D, j0 = NH * D + (idx / HALF) * D + idx % HALF;
        *w0 = wq + (long long)j0 * H;
        *w1 = wq + (long long)(j0 + HALF) * H;
    } else {
        *w0 = wq + (long long)(NH * D + NKV * D + u - NH * D - NKV * HALF) * H;
        *w1 = nullptr;
    }
}

#ifndef P1_BALANCE
#define P1_BALANCE 1  // 0: P1's units in order, warp gw taking units gw, gw + tw, ... (diagnosis)
#endif

// P1's work as slots, `tw` (the grid's warps) a round; returns the slot's unit (q rows 0..NH*D-1, then the k
// pairs, then the v rows), -1 for none, -2 past the last. Long rows (8B): a k pair (two rows) takes its
// warp's first two rounds, so no warp streams more than ceil(QKV_ROWS / tw) rows; with units in order, 8B's
// first 384 warps streamed 4 of the 6,144 rows each over 2,112 warps (2-8 us a launch slower on the H200:
// memory latency, not a multiprocessor's share of the bytes, sets the phase's time).
// Short rows keep units in order (SmolLM2-135M's k pairs then sit past its attention blocks).
__device__ __forceinline__ int p1_unit(int s, int tw) {
    constexpr int NP = NKV * HALF, NS = NH * D + NKV * D;
    if (!P1_BALANCE || Row<H>::PRE || tw < NP) return s < NS + NP ? s : -2;
    const int it = s / tw, w = s - it * tw;
    int si;  // the slot's index among the single-row units (q rows, then v rows)
    if (w < NP) {
        if (it == 0) return NH * D + w;
        if (it == 1) return -1;
        si = s - 2 * NP;
    } else {
        si = s - NP * min(it + 1, 2);
    }
    if (si >= NS) return -2;
    return si < NH * D ? si : si + NP;
}

// acc[n][r] for r == lane (the epilogues run one row per lane).
template <int NR>
__device__ __forceinline__ float row_of(const float (&acc)[NR][R], int n, int lane) {
    float v = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r)
        if (r == lane) v = acc[n][r];
    return v;
}

// The blocks' attention partials: part[u * D + d] the unnormalised output of partial u = (r * NH + hq) *
// splits + s, and at ML_OFF + 2 * u its max (log2 domain) and sum.
#define ML_OFF (R * NH * SPLITS * D)
static_assert(SPLITS <= 2 * WARPS && SPLITS <= 32, "merge_head's weights live in sm.wml, made by one warp");

// f[u] = each partial's weight in its (row, head)'s merged output, from the partials' (max, sum) already in
// f[units + u] and f[2 * units + u] (units = R * NH * splits).
__device__ __forceinline__ void split_weights(int splits, float* f) {
    const int units = R * NH * splits;
    const float* ms = f + units;
    const float* ls = f + 2 * units;
    for (int u = threadIdx.x; u < units; u += THREADS) {
        const int g = u - u % splits;
        float mm = NEG_INF;
        for (int k = 0; k < splits; ++k) mm = fmaxf(mm, ms[g + k]);
        float ll = 0.f;
        for (int k = 0; k < splits; ++k) ll += ms[g + k] == NEG_INF ? 0.f : ls[g + k] * exp2f(ms[g + k] - mm);
        f[u] = (ms[u] == NEG_INF || !(ll > 0.f)) ? 0.f : exp2f(ms[u] - mm) / ll;
    }
    __syncthreads();
}

// out[d] = the merged attention output of one (row, head) from its `splits` partials from `first` on: warp 0
// turns the partials' (max, sum) into weights exp2(m - M) / L in `f` (shared, >= splits floats) while the
// threads of the outputs load their partial values: one L2 round trip. (One float per split held a thread:
// arrays of the (max, sum) too spilled the 8B build and slowed every launch.)
// HX: the output goes out as words of `tag` at xout instead.
__device__ void merge_head(const float* part, int first, int splits, bf16* out, float* f, u64* xout = nullptr,
                           unsigned int tag = 0) {
    if (threadIdx.x < 32) {
        const int k = threadIdx.x;
        const float2 ml = k < splits ? __ldcg((const float2*)(part + ML_OFF) + first + k) : make_float2(NEG_INF, 0.f);
        const float mm = warp_max(ml.x);
        const float ll = warp_sum(ml.x == NEG_INF ? 0.f : ml.y * exp2f(ml.x - mm));
        if (k < splits) f[k] = (ml.x == NEG_INF || !(ll > 0.f)) ? 0.f : exp2f(ml.x - mm) / ll;
    }
    for (int d0 = 0; d0 < D; d0 += THREADS) {
        const int d = d0 + threadIdx.x;
        float p[SPLITS];
#pragma unroll
        for (int k = 0; k < SPLITS; ++k) p[k] = (k < splits && d < D) ? __ldcg(part + (long long)(first + k) * D + d) : 0.f;
        __syncthreads();  // the weights
        float o = 0.f;
#pragma unroll
        for (int k = 0; k < SPLITS; ++k)
            if (k < splits) o = fmaf(f[k], p[k], o);
        if (d < D) {
            if (xout != nullptr) st_ll(xout + d, round_bf(o), tag);
            else out[d] = f2bf(o);
        }
    }
}

// merge_splits from LL words of `tag`: part [units][D] and ml [units][2] (max, sum).
__device__ void merge_splits_ll(const u64* part, const u64* ml, unsigned int tag, int splits, bf16* vec, float* f) {
    const int units = R * NH * splits;
    float* ms = f + units;
    float* ls = f + 2 * units;
    fetch_ll(ml, 2 * units, tag, [&](int i, float v) {
        if (i & 1) ls[i >> 1] = v;
        else ms[i >> 1] = v;
    });
    __syncthreads();
    split_weights(splits, f);
    for (int i = threadIdx.x; i < R * NH * D; i += THREADS) {
        const int g = i / D, d = i % D;  // g = r * NH + hq
        u64 pv[SPLITS];
#pragma unroll
        for (int k = 0; k < SPLITS; ++k)
            if (k < splits) pv[k] = ld_ll(part + (long long)(g * splits + k) * D + d);
        float o = 0.f;
#pragma unroll
        for (int k = 0; k < SPLITS; ++k)
            if (k < splits) o = fmaf(f[g * splits + k], wait_ll(part + (long long)(g * splits + k) * D + d, pv[k], tag), o);
        vec[(g / NH) * KMAX + (g % NH) * D + d] = f2bf(o);
    }
    __syncthreads();
}

#ifndef TILE_STEP
#define TILE_STEP 32  // keys of a V tile accumulated per unrolled group (32: the whole tile unrolled, however short)
#endif

#ifndef SKIP
#define SKIP 0  // diagnosis only: bit k skips phase k+1's work (not its barrier); results are then wrong
#endif

// ---- resident attention (RES) ----------------------------------------------------------------------
//
// At one row the split attention above is bound by how fast one multiprocessor pulls its unit's keys and values
// (~2.75 us a layer per 128 keys at Llama-3.1-8B), and those keys never change during a launch: only the step's
// own key is new. A RES build gives each kv head one block, the last NKV of the grid, and that block copies the
// head's keys and values of the NEXT layer into shared memory (cp.async, one group) while it streams its share
// of P4 and P5. On the H200 those blocks stream one row less than most in both phases (8B: 6 gate/up pairs of
// 7, one down row of 2 per warp), so the copies ride in slack. P2 then waits only for the query, the step's
// own key and value (written by P1, read from L2) and the tensor cores: S = Q K^T and O = P V by mma.sync over
// the group's query heads (rows of the 16-row operand; P rounded to bf16 as the fused Triton path's tl.dot
// takes it), an online softmax per warp over 16-key chunks, the warps merged through the resident region.
// Keys past RES_CAP (at most RES_TAIL more) are copied into `vec` (free during P2) at P2's start.
//
// Longer contexts give each kv head a GROUP of n blocks (2 from RES_SPLIT tokens, 4 from RES_SPLIT4; with HX bit 0;
// the last n * NKV blocks of the grid): part p holds keys [res_bound(p), res_bound(p + 1)), about a 1/n share, the
// last one the step's own key. Parts 1.. send their unnormalised outputs and (max, sum) per query head to part 0
// as tagged words; part 0 adds them to its own in part order and writes the head's outputs. A context no group
// holds takes the split path above.
//
// Rows are D elements, unpadded: a row's 16-byte chunk c sits at chunk c ^ (key & 7), so the 8 rows an ldmatrix
// reads at one logical chunk fall in 8 different bank groups.

__device__ __forceinline__ void mma_bf16(float (&c)[4], unsigned int a0, unsigned int a1, unsigned int a2,
                                         unsigned int a3, unsigned int b0, unsigned int b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldsm_x4(unsigned int addr, unsigned int& r0, unsigned int& r1, unsigned int& r2,
                                        unsigned int& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr) : "memory");
}

__device__ __forceinline__ void ldsm_x4_t(unsigned int addr, unsigned int& r0, unsigned int& r1, unsigned int& r2,
                                          unsigned int& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr) : "memory");
}

__device__ __forceinline__ unsigned int pack_bf(float lo, float hi) {
    return (unsigned int)f2bf(lo) | ((unsigned int)f2bf(hi) << 16);
}

// Key t's K row (V: add `rows` * D) in the resident region or, past RES_CAP, in the tail rows in `vec`; and the
// shared address of its logical 16-byte chunk c. A block holds keys from `lo` on (the second block of a pair: sp).
struct ResRows {
    bf16* kres;  // [RES_CAP][D] keys, then [RES_CAP][D] values
    bf16* tail;  // [RES_TAIL][D] keys, then [RES_TAIL][D] values
    int lo;      // the first key held
    __device__ __forceinline__ bf16* k(int t) const {
        t -= lo;
        return t < RES_CAP ? kres + t * D : tail + (t - RES_CAP) * D;
    }
    __device__ __forceinline__ bf16* v(int t) const {
        t -= lo;
        return t < RES_CAP ? kres + (RES_CAP + t) * D : tail + (RES_TAIL + t - RES_CAP) * D;
    }
};

// The end of the keys a block holding [lo, hi) of a `ctx`-key context copies a layer ahead: every key before the
// step's own that its resident region holds.
__device__ __forceinline__ int res_ahead(int lo, int hi, int ctx) { return min(min(ctx - 1, hi), lo + RES_CAP); }

// The first key of part p of an n-block group over a ctx-key context: p/n of it, rounded up to 16 keys (ctx at p = n).
__device__ __forceinline__ int res_bound(int p, int n, int ctx) {
    return p >= n ? ctx : ((p * ctx + n - 1) / n + 15) / 16 * 16;
}

// Whether an n-block group takes a ctx-key context: every part's keys fit RES_CAP, and every part has keys (with
// the rounding to 16, from 32 tokens for a pair and 32 n for more).
__device__ __forceinline__ bool res_group_fits(int n, int ctx) {
    return n == 2 ? ctx >= 32 && ctx <= 2 * RES_CAP : ctx >= 32 * n && (ctx + n - 1) / n + 16 <= RES_CAP;
}

__device__ __forceinline__ bf16* chunk_at(bf16* row, int t, int c) { return row + ((c ^ (t & 7)) * 8); }

// Keys [lo, hi) of kv head g (one layer's pools kl, vl; row 0's block table) into their rows: one cp.async group,
// waited for in P2. RESIDENT: every key is below rr.lo + RES_CAP (the copies a layer ahead).
template <bool RESIDENT>
__device__ __forceinline__ void res_copy(const bf16* kl, const bf16* vl, const int* __restrict__ bt, int g, int lo,
                                         int hi, const ResRows& rr) {
    constexpr int CPR = D / 8;  // 16-byte chunks a row
    for (int i = threadIdx.x; i < (hi - lo) * CPR; i += THREADS) {
        const int t = lo + i / CPR, c = i % CPR;
        const long long off = (((long long)bt[t / PAGE] * PAGE + t % PAGE) * NKV + g) * D + c * 8;
        bf16* kr = RESIDENT ? rr.kres + (t - rr.lo) * D : rr.k(t);
        bf16* vr = RESIDENT ? rr.kres + (RES_CAP + t - rr.lo) * D : rr.v(t);
        const unsigned int dk = (unsigned int)__cvta_generic_to_shared(chunk_at(kr, t, c));
        const unsigned int dv = (unsigned int)__cvta_generic_to_shared(chunk_at(vr, t, c));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dk), "l"(kl + off) : "memory");
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dv), "l"(vl + off) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// One row's attention for kv head g's GQ query heads over keys [lo, hi) of the context's ctx: q rows raw in qkv
// (rotary applied here), keys [lo, res_ahead) copied a layer ahead; the rest, the step's own key among them where
// hi = ctx, copied now. The GQ heads' outputs to attn. Every thread of the block calls it.
// HX (xq != nullptr): no grid barrier after P1 here. The queries and the step's own key and value come from P1's
// tagged words of `tag_in` (the pool has the step's key too, but unordered with this read), and the outputs go out
// as words of `tag_out` for P3 to poll.
// A group of `parts` blocks (HX only; 1: a whole head): part 0 adds the partials of parts 1.. to its own; part p
// >= 1 sends its partial (unnormalised outputs to xpart [p - 1][NH * D], (max, sum) to xml [p - 1][NH][2]) as
// words of `tag_part`.
__device__ void res_attention(const Smem& sm, const bf16* qkv, const bf16* kl, const bf16* vl,
                              const int* __restrict__ bt, int g, bf16* attn, const u64* xq, const u64* xk,
                              const u64* xv, u64* xattn, unsigned int tag_in, unsigned int tag_out, int lo, int hi,
                              int part, int parts, u64* xpart, u64* xml, unsigned int tag_part) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int gi = lane / 4, tig = lane % 4;  // the mma fragments' row group and thread in group
    const int ctx = sm.ctx[0], cur = ctx - 1, last = hi - 1;
    const ResRows rr{sm.kres, sm.vec, lo};
    const bool hx = (HX & 1) && xq != nullptr;
    // the keys past the resident ones and (without HX) the step's own key (cp.async.cg reads L2, where P1's
    // writes are)
    res_copy<false>(kl, vl, bt, g, res_ahead(lo, hi, ctx), hi == ctx && hx ? cur : hi, rr);
    bf16* qb = (bf16*)sm.qs;  // [16][RS]: the group's roped queries in rows [0, GQ), zeros below (set at launch)
    for (int i = threadIdx.x; i < GQ * HALF; i += THREADS) {
        const int hh = i / HALF, d = i % HALF;
        float x0, x1;
        if (hx) {
            const u64* qw = xq + (g * GQ + hh) * D + d;
            const u64 a = ld_ll(qw), b = ld_ll(qw + HALF);
            x0 = wait_ll(qw, a, tag_in);
            x1 = wait_ll(qw + HALF, b, tag_in);
        } else {
            const bf16* q = qkv + (g * GQ + hh) * D;
            x0 = ld_shared_bf(q + d);
            x1 = ld_shared_bf(q + d + HALF);
        }
        qb[hh * RS + d] = f2bf(x0 * sm.cs[d] + x1 * sm.sn[d]);
        qb[hh * RS + d + HALF] = f2bf(x1 * sm.cs[d + HALF] + x0 * sm.sn[d + HALF]);
    }
    if (hx && hi == ctx) {  // the step's own key and value into their rows, from the words
        for (int i = threadIdx.x; i < 2 * D; i += THREADS) {
            const bool isv = i >= D;
            const int d = i % D;
            const u64* w = (isv ? xv : xk) + g * D + d;
            const float x = wait_ll(w, ld_ll(w), tag_in);
            chunk_at(isv ? rr.v(cur) : rr.k(cur), cur, d / 8)[d % 8] = f2bf(x);
        }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();

    const unsigned int qaddr =
        (unsigned int)__cvta_generic_to_shared(qb + ((lane / 8) % 2 * 8 + lane % 8) * RS + lane / 16 * 8);
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;  // rows gi and gi + 8 (query heads of the group)
    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    const int chunks = (hi - lo + 15) / 16;
    for (int ch = warp; ch < chunks; ch += WARPS) {
        const int k0 = lo + ch * 16;
        float s[2][4];
#pragma unroll
        for (int t = 0; t < 2; ++t) s[t][0] = s[t][1] = s[t][2] = s[t][3] = 0.f;
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            const int key = min(k0 + t * 8 + lane % 8, last);  // past the block's keys: a real row, masked below
            const unsigned int krow = (unsigned int)__cvta_generic_to_shared(rr.k(key));
            const int sw = key & 7;
#pragma unroll
            for (int ks = 0; ks < D / 16; ks += 2) {
                unsigned int a[2][4], b[4];
                ldsm_x4(qaddr + ks * 32, a[0][0], a[0][1], a[0][2], a[0][3]);
                ldsm_x4(qaddr + ks * 32 + 32, a[1][0], a[1][1], a[1][2], a[1][3]);
                ldsm_x4(krow + (((ks * 2 + lane / 8) ^ sw) << 4), b[0], b[1], b[2], b[3]);
                mma_bf16(s[t], a[0][0], a[0][1], a[0][2], a[0][3], b[0], b[1]);
                mma_bf16(s[t], a[1][0], a[1][1], a[1][2], a[1][3], b[2], b[3]);
            }
        }
        // online softmax over the chunk (log2 domain); keys past the block's weigh nothing
        float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const bool valid = k0 + t * 8 + 2 * tig + (j & 1) < hi;
                s[t][j] = valid ? s[t][j] * SCALE_LOG2 : NEG_INF;
                if (j < 2) mx0 = fmaxf(mx0, s[t][j]);
                else mx1 = fmaxf(mx1, s[t][j]);
            }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);  // finite: the chunk has a key of the context
        const float al0 = exp2f(m0 - n0), al1 = exp2f(m1 - n1);
        m0 = n0;
        m1 = n1;
        float p[2][4];
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
            for (int j = 0; j < 4; ++j) p[t][j] = exp2f(s[t][j] - (j < 2 ? n0 : n1));
        l0 = l0 * al0 + p[0][0] + p[0][1] + p[1][0] + p[1][1];
        l1 = l1 * al1 + p[0][2] + p[0][3] + p[1][2] + p[1][3];
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            o[n][0] *= al0;
            o[n][1] *= al0;
            o[n][2] *= al1;
            o[n][3] *= al1;
        }
        // P as the A operand (its C layout is the A layout: rows gi, gi + 8; keys 2 tig.. of each 8)
        const unsigned int pa0 = pack_bf(p[0][0], p[0][1]), pa1 = pack_bf(p[0][2], p[0][3]);
        const unsigned int pa2 = pack_bf(p[1][0], p[1][1]), pa3 = pack_bf(p[1][2], p[1][3]);
        const int key = min(k0 + (lane / 8) % 2 * 8 + lane % 8, last);
        const unsigned int vrow = (unsigned int)__cvta_generic_to_shared(rr.v(key));
        const int sw = key & 7;
#pragma unroll
        for (int j = 0; j < D / 16; ++j) {
            unsigned int b0, b1, b2, b3;
            ldsm_x4_t(vrow + (((j * 2 + lane / 16) ^ sw) << 4), b0, b1, b2, b3);
            mma_bf16(o[2 * j], pa0, pa1, pa2, pa3, b0, b1);
            mma_bf16(o[2 * j + 1], pa0, pa1, pa2, pa3, b2, b3);
        }
    }
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    // the warps merged through the resident region (its rows are read)
    __syncthreads();
    float* so = (float*)sm.kres;       // [WARPS][GQ][D] each warp's unnormalised outputs
    float* sml = so + WARPS * GQ * D;  // [WARPS][16][2] its (max, sum) per query row
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        if (gi < GQ) *(float2*)(so + (warp * GQ + gi) * D + n * 8 + 2 * tig) = make_float2(o[n][0], o[n][1]);
        if (gi + 8 < GQ) *(float2*)(so + (warp * GQ + gi + 8) * D + n * 8 + 2 * tig) = make_float2(o[n][2], o[n][3]);
    }
    if (tig == 0) {
        *(float2*)(sml + (warp * 16 + gi) * 2) = make_float2(m0, l0);
        *(float2*)(sml + (warp * 16 + gi + 8) * 2) = make_float2(m1, l1);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < GQ * D; i += THREADS) {
        const int hh = i / D, d = i % D;
        const int word = (g * GQ + hh) * D + d, mword = (g * GQ + hh) * 2;
        float mm = NEG_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mm = fmaxf(mm, sml[(w * 16 + hh) * 2]);
        float ll = 0.f, acc = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float mw = sml[(w * 16 + hh) * 2];
            const float f = mw == NEG_INF ? 0.f : exp2f(mw - mm);
            ll += sml[(w * 16 + hh) * 2 + 1] * f;
            acc += so[(w * GQ + hh) * D + d] * f;
        }
        if (part > 0) {  // a share for part 0 (every part has keys of the context: mm is finite)
            const int q = part - 1;
            st_ll(xpart + q * NH * D + word, acc, tag_part);
            if (d == 0) {
                st_ll(xml + q * NH * 2 + mword, mm, tag_part);
                st_ll(xml + q * NH * 2 + mword + 1, ll, tag_part);
            }
            continue;
        }
        if (parts > 1) {  // the other parts' shares in part order, each against the larger max so far
            u64 w[3 * (RES_PARTS - 1)];  // every word requested before the first is waited for
#pragma unroll
            for (int q = 0; q < RES_PARTS - 1; ++q) {
                if (q + 1 < parts) {
                    w[3 * q] = ld_ll(xml + q * NH * 2 + mword);
                    w[3 * q + 1] = ld_ll(xml + q * NH * 2 + mword + 1);
                    w[3 * q + 2] = ld_ll(xpart + q * NH * D + word);
                }
            }
#pragma unroll
            for (int q = 0; q < RES_PARTS - 1; ++q) {
                if (q + 1 >= parts) break;
                const float mq = wait_ll(xml + q * NH * 2 + mword, w[3 * q], tag_part);
                const float lq = wait_ll(xml + q * NH * 2 + mword + 1, w[3 * q + 1], tag_part);
                const float aq = wait_ll(xpart + q * NH * D + word, w[3 * q + 2], tag_part);
                const float top = fmaxf(mm, mq), f = exp2f(mm - top), fq = exp2f(mq - top);
                acc = acc * f + aq * fq;
                ll = ll * f + lq * fq;
                mm = top;
            }
        }
        const float out = ll > 0.f ? acc / ll : 0.f;
        if (hx) st_ll(xattn + (g * GQ + hh) * D + d, round_bf(out), tag_out);
        else attn[(g * GQ + hh) * D + d] = f2bf(out);
    }
}

// ---- the kernel ---------------------------------------------------------------------------------

// Per layer, 8 pointers: attn_norm, qkv weight, qkv bias (or 0), o weight, o bias (or 0), mlp_norm,
// gate_up weight ([2I, H]: gate rows then up rows), down weight.
#define LP(layer, k) ((const bf16*)layers[(layer) * 8 + (k)])

extern "C" __global__ void __launch_bounds__(THREADS, 1)
flared_decode_layers(const long long* __restrict__ layers, bf16* k_pool, bf16* v_pool, long long pool_layer_stride,
                     bf16* h, bf16* out, const bf16* __restrict__ final_norm, bf16* qkv, bf16* attn, bf16* act,
                     float* part, unsigned int* sync, const bf16* __restrict__ cos_t, const bf16* __restrict__ sin_t,
                     const long long* __restrict__ positions, const long long* __restrict__ slots,
                     const int* __restrict__ block_tables, int bt_stride, const int* __restrict__ context_lens,
                     const bf16* __restrict__ lm_head, int vocab, float* logits, float* state_logits,
                     const long long* __restrict__ state_rows, long long* sampled, long long* last_token,
                     float* cand_val, int* cand_idx, int greedy, const bf16* __restrict__ embed,
                     const long long* __restrict__ token_ids, const long long* __restrict__ tok_rows,
                     const long long* tok_last, u64* llbuf) {
    extern __shared__ uint4 smem_raw[];
    Smem sm;
    sm.vec = (bf16*)smem_raw;
    sm.hs = sm.vec + VEC_ELEMS;
    sm.wn = sm.hs + R * H;
    sm.red = (float*)(sm.wn + ((H + 7) / 8) * 8);
    sm.qs = sm.red + ((WARPS * R + R + 3) / 4) * 4;
    sm.qv = sm.qs + WARPS * D;
    sm.wml = sm.qv + D;
    sm.cs = sm.wml + 2 * WARPS;
    sm.sn = sm.cs + R * D;
    sm.slot = (long long*)(sm.sn + R * D);
    sm.tok = sm.slot + R;
    sm.ctx = (int*)(sm.tok + R);
    sm.kres = (bf16*)(((unsigned long long)(sm.ctx + R) + 15) & ~15ull);

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int gw = blockIdx.x * WARPS + warp;                     // global warp
    const int tw = gridDim.x * WARPS;
    unsigned int* barrier = sync;
    unsigned int* heads = sync + 2;  // [R * NH] arrivals of the blocks of each split (row, head)
    __shared__ bool last_split;
    unsigned int phase = 0;
    // The launch's epoch (sync[1]): block 0 bumps it at the end. Each launch arrives NB times per block at the
    // never-reset counter sync[0] (every grid barrier, then the LM head's candidates), so this launch's
    // barriers count on from epoch * NB * blocks.
    const unsigned int epoch = *(volatile unsigned int*)(sync + 1);
    constexpr unsigned int NB = (LL ? 0u : 5u * L) + (HEAD ? 1u : 0u);
    const unsigned int base = epoch * NB * gridDim.x;
#define SYNC_GRID() grid_barrier(barrier, base + (++phase) * gridDim.x)
#define ARRIVE_GRID() (++phase, grid_arrive(barrier))
    // LL: the exchange buffers and this launch's tags
    u64* ll_ha = llbuf;                          // [R][H] the residual after P3
    u64* ll_hb = ll_ha + R * H;                  // [R][H] the residual after P5
    u64* ll_attn = ll_hb + R * H;                // [R][NH * D] unsplit attention outputs
    u64* ll_act = ll_attn + R * NH * D;          // [R][I]
    u64* ll_part = ll_act + R * I;               // [R * NH * SPLITS][D] split partials
    u64* ll_ml = ll_part + R * NH * SPLITS * D;  // [R * NH * SPLITS][2] their (max, sum)
    u64* ll_q = ll_ml + 2 * R * NH * SPLITS;     // [R][NH * D] q before the rotary
    u64* ll_k = ll_q + R * NH * D;               // [R][NKV * D] the step's keys (after the rotary)
    u64* ll_v = ll_k + R * NKV * D;              // [R][NKV * D] and values
    u64* ll_rpart = ll_v + R * NKV * D;          // [RES_PARTS - 1][NH * D] resident groups' partials (RES: R = 1)
    u64* ll_rml = ll_rpart + (RES_PARTS - 1) * NH * D;  // [RES_PARTS - 1][NH][2] their (max, sum)
    const unsigned int tag_base = ((epoch % 0xFFFFFu) + 1u) << 12;
#define TAG(layer, ph) (tag_base | ((unsigned int)(layer) << 3) | (unsigned int)(ph))

    // Per-row constants for the whole launch: slot, context length, the rotary rows.
    for (int i = threadIdx.x; i < R * D; i += THREADS) {
        const int r = i / D, d = i % D;
        const long long pos = positions[r];
        sm.cs[i] = bf2f(cos_t[pos * D + d]);
        sm.sn[i] = bf2f(sin_t[pos * D + d]);
    }
    if (threadIdx.x < R) {
        sm.slot[threadIdx.x] = slots[threadIdx.x];
        sm.ctx[threadIdx.x] = context_lens[threadIdx.x];
        // with `embed`: the row's token; -1 means the last token sampled for its state row (a pipelined step)
        long long t = 0;
        if (embed != nullptr) {
            t = token_ids[threadIdx.x];
            if (t < 0) t = tok_last[tok_rows[threadIdx.x]];
        }
        sm.tok[threadIdx.x] = t;
    }
    __syncthreads();
    // With `embed`, every block's first norm reads the embedding rows from the table, and layer 0's o
    // epilogue writes h = hs + o in full, so no later phase reads this store; block 0 still writes the rows
    // into h so that h holds the step's input as it does without `embed` (the SKIP diagnostics read it).
    // Dropping the store moved the 8B build from 32 to 52 bytes of register spills under NVRTC 12.9.
    if (embed != nullptr && blockIdx.x == 0) {
        for (int i = threadIdx.x; i < R * (H / 8); i += THREADS) {
            const int r = i / (H / 8), c = i % (H / 8);
            *(uint4*)(h + (long long)r * H + c * 8) = ld_weight(embed + sm.tok[r] * H + c * 8);
        }
    }
    // Attention splits each (row, q head) over the grid's spare blocks once the longest context reaches
    // 3 * SPLIT_KEYS: at most SPLITS pieces of at least SPLIT_KEYS keys each (the merge costs an arrival
    // and an L2 round trip per layer; on the H200 at 135M, 256 keys ran faster unsplit, 512 in 4 pieces and
    // 1,024 in 8 were 78 and 212 us faster per launch). LL's merge scratch (3 floats per partial) must fit
    // sm.qs. Every block derives the same count from the same context lengths.
    int splits = 1;
    {
        int longest = 0;
        for (int r = 0; r < R; ++r) longest = max(longest, sm.ctx[r]);
        splits = min((int)gridDim.x / (R * NH), SPLITS);
        if (LL) splits = min(splits, (WARPS * D) / (3 * R * NH));
        splits = longest < 3 * SPLIT_KEYS ? 1 : min(splits, longest / SPLIT_KEYS);
        splits = max(splits, 1);
    }

    // P1 -> P2 -> P3 by tagged words, around resident attention or past it around the split path
    constexpr bool hx = (HX & 1) != 0;
    constexpr bool hx2 = (HX & 2) != 0;  // P3 -> P4 by tagged words
    constexpr bool hx4 = (HX & 4) != 0;  // P5 -> the next P1 (and the final norm) by tagged words
    // RES: this launch's attention from resident keys (every block derives the same answer); the last res_n * NKV
    // blocks hold a kv head's keys each (res_n > 1: groups, with HX) and copy layer 0's keys now: part res_part of
    // kv head res_g's group, part 0 in the last NKV blocks.
    const int res_ctx = sm.ctx[0];
    int res_n = 1;
    if (RES && hx && RES_SPLIT4 && res_ctx >= RES_SPLIT4 && (int)gridDim.x >= 4 * NKV && res_group_fits(4, res_ctx))
        res_n = 4;
    else if (RES && hx && res_ctx >= (RES_SPLIT ? RES_SPLIT : RES_CAP + RES_TAIL + 1) && (int)gridDim.x >= 2 * NKV
             && res_group_fits(2, res_ctx))
        res_n = 2;
    const bool res = RES && (int)gridDim.x >= NKV && res_ctx >= 1 && (res_ctx <= RES_CAP + RES_TAIL || res_n > 1);
    const int res_i = (int)blockIdx.x - ((int)gridDim.x - res_n * NKV);  // >= 0: a resident block
    const int res_g = res_i >= 0 ? res_i % NKV : -1;                     // its kv head
    const int res_part = res_i >= 0 ? res_n - 1 - res_i / NKV : 0;
    const int res_lo = res_bound(res_part, res_n, res_ctx);  // its keys [res_lo, res_hi)
    const int res_hi = res_bound(res_part + 1, res_n, res_ctx);
    // this block stages its warps' first o rows (STAGE_O): past the resident keys, the blocks without attention
    const bool stage_o = STAGE_O && RES && (res ? res_g < 0 : (int)blockIdx.x >= R * NH * splits);
    if (RES && res) {
        bf16* qb = (bf16*)sm.qs;
        for (int i = GQ * RS + threadIdx.x; i < 16 * RS; i += THREADS) qb[i] = 0;
        if (res_g >= 0)
            res_copy<true>(k_pool, v_pool, block_tables, res_g, res_lo, res_ahead(res_lo, res_hi, res_ctx),
                           ResRows{sm.kres, sm.vec, res_lo});
    }

    constexpr bool PRE_H = Row<H>::PRE, PRE_O = Row<NH * D>::PRE, PRE_I = Row<I>::PRE;
    uint4 w1[2][Row<H>::PER], w3[2][Row<NH * D>::PER], w4[2][Row<H>::PER], w5[2][Row<I>::PER];
    const int u_first = p1_unit(gw, tw);  // this warp's first P1 unit (< 0: none)
    if constexpr (PRE_H) {
        if (u_first >= 0) {
            const bf16 *a, *b;
            qkv_rows(LP(0, 1), u_first, &a, &b);
            load_w<H>(a, b, w1, lane);
        }
    }

    for (int layer = 0; layer < L; ++layer) {
        bf16* kl = k_pool + layer * pool_layer_stride;
        bf16* vl = v_pool + layer * pool_layer_stride;

        // ---------------- P1: norm, QKV, rotary on k, K/V into the pool ----------------
        if (!(SKIP & 1)) {
            load_norm(h, LP(layer, 0), sm, layer == 0 ? embed : nullptr, (LL || hx4) && layer > 0 ? ll_hb : nullptr,
                      TAG(layer - 1, 5));
            const bf16* wq = LP(layer, 1);
            const bf16* bq = LP(layer, 2);
            for (int sl = gw;; sl += tw) {
                const int u = p1_unit(sl, tw);
                if (u == -2) break;
                if (u < 0) continue;
                bool pre = false;
                if constexpr (PRE_H) pre = sl == gw;
                if (u < NH * D) {
                    float acc[1][R];
                    if constexpr (PRE_H) { if (pre) dot_w<H, 1>(w1, sm.vec, acc, lane); }
                    if (!pre) warp_dot<H, 1>(wq + (long long)u * H, nullptr, sm.vec, acc, lane);
                    if (lane < R) {
                        const float b = HAS_QKV_BIAS ? bf2f(bq[u]) : 0.f;
                        if (LL || hx) st_ll(ll_q + lane * (NH * D) + u, round_bf(row_of<1>(acc, 0, lane) + b), TAG(layer, 1));
                        else qkv[lane * QKV_ROWS + u] = f2bf(row_of<1>(acc, 0, lane) + b);
                    }
                } else if (u < NH * D + NKV * HALF) {
                    const int idx = u - NH * D, g = idx / HALF, i = idx % HALF;
                    const int j0 = NH * D + g * D + i, j1 = j0 + HALF;
                    float acc[2][R];
                    if constexpr (PRE_H) { if (pre) dot_w<H, 2>(w1, sm.vec, acc, lane); }
                    if (!pre) warp_dot<H, 2>(wq + (long long)j0 * H, wq + (long long)j1 * H, sm.vec, acc, lane);
                    if (lane < R) {
                        const int r = lane;
                        float k0 = row_of<2>(acc, 0, lane), k1 = row_of<2>(acc, 1, lane);
                        if (HAS_QKV_BIAS) { k0 += bf2f(bq[j0]); k1 += bf2f(bq[j1]); }
                        k0 = round_bf(k0);
                        k1 = round_bf(k1);
                        bf16* dst = kl + (sm.slot[r] * NKV + g) * D;
                        const float r0 = round_bf(k0 * sm.cs[r * D + i] + k1 * sm.sn[r * D + i]);
                        const float r1 = round_bf(k1 * sm.cs[r * D + i + HALF] + k0 * sm.sn[r * D + i + HALF]);
                        dst[i] = f2bf(r0);
                        dst[i + HALF] = f2bf(r1);
                        if (LL || hx) {
                            st_ll(ll_k + (r * NKV + g) * D + i, r0, TAG(layer, 1));
                            st_ll(ll_k + (r * NKV + g) * D + i + HALF, r1, TAG(layer, 1));
                        }
                    }
                } else {
                    const int idx = u - NH * D - NKV * HALF, g = idx / D, i = idx % D;
                    const int j = NH * D + NKV * D + idx;
                    float acc[1][R];
                    if constexpr (PRE_H) { if (pre) dot_w<H, 1>(w1, sm.vec, acc, lane); }
                    if (!pre) warp_dot<H, 1>(wq + (long long)j * H, nullptr, sm.vec, acc, lane);
                    if (lane < R) {
                        float v = row_of<1>(acc, 0, lane);
                        if (HAS_QKV_BIAS) v += bf2f(bq[j]);
                        vl[(sm.slot[lane] * NKV + g) * D + i] = f2bf(v);
                        if (LL || hx) st_ll(ll_v + (lane * NKV + g) * D + i, round_bf(v), TAG(layer, 1));
                    }
                }
            }
        }
        // Attention is short: the first o rows now (registers or L2), before the two barriers.
        if (gw < H) {
            if constexpr (PRE_O) load_w<NH * D>(LP(layer, 3) + (long long)gw * (NH * D), nullptr, w3, lane);
            else if (stage_o) stage_row<NH * D>(LP(layer, 3) + (long long)gw * (NH * D), sm.kres + warp * (NH * D), lane);
            else prefetch_row(LP(layer, 3) + (long long)gw * (NH * D), NH * D, lane);
        }
        if (LL) __syncthreads();
        else if (hx) ARRIVE_GRID();
        else SYNC_GRID();

        // ---------------- P2: attention, one block per (row, q head) ----------------
        // Each warp takes a contiguous 1/WARPS of the context in 32-key tiles: its lanes read one key's
        // K row each (registers) and copy its V row into the warp's shared tile (cp.async), then the
        // lanes accumulate softmax-weighted V over their own dims. Warps merge through shared memory.
        if (RES && res && !(SKIP & 2)) {
            if (res_g >= 0)
                res_attention(sm, qkv, kl, vl, block_tables, res_g, attn, hx ? ll_q : nullptr, ll_k, ll_v, ll_attn,
                              TAG(layer, 1), TAG(layer, 2), res_lo, res_hi, res_part, res_n, ll_rpart, ll_rml,
                              TAG(layer, 6));
        } else if (!(SKIP & 2)) {
            bf16* vst = (RES ? sm.kres : sm.vec) + warp * 32 * D;
            for (int unit = blockIdx.x; unit < R * NH * splits; unit += gridDim.x) {
                const int r = unit / (NH * splits), hq = (unit / splits) % NH, sp = unit % splits;
                const int kvh = hq / (NH / NKV);
                const int ctx_all = sm.ctx[r];
                const int chunk = (ctx_all + splits - 1) / splits;
                const int lo = min(ctx_all, sp * chunk);
                const int ctx = min(ctx_all, lo + chunk);  // this block's keys: [lo, ctx)
                // rotary on q (fp32 from bf16, rounded to bf16 as the unfused kernel stores it), then the scale
                for (int i = threadIdx.x; i < HALF; i += THREADS) {
                    float x0, x1;
                    if (LL || hx) {
                        const u64* qw = ll_q + r * (NH * D) + hq * D + i;
                        const u64 a = ld_ll(qw), b = ld_ll(qw + HALF);
                        x0 = wait_ll(qw, a, TAG(layer, 1));
                        x1 = wait_ll(qw + HALF, b, TAG(layer, 1));
                    } else {
                        x0 = ld_shared_bf(qkv + r * QKV_ROWS + hq * D + i);
                        x1 = ld_shared_bf(qkv + r * QKV_ROWS + hq * D + i + HALF);
                    }
                    sm.qv[i] = round_bf(x0 * sm.cs[r * D + i] + x1 * sm.sn[r * D + i]) * SCALE_LOG2;
                    sm.qv[i + HALF] = round_bf(x1 * sm.cs[r * D + i + HALF] + x0 * sm.sn[r * D + i + HALF]) * SCALE_LOG2;
                }
                __syncthreads();
                const int per = (ctx - lo + WARPS - 1) / WARPS;
                const int start = lo + warp * per;
                const int end = min(ctx, start + per);
                // LL and HX: the step's own key (the last of the context) comes from P1's words; the warp that
                // owns it (LL: loads its lanes' dims of K and V now and) waits for them at that key's tile.
                const int cur = ctx_all - 1;
                const bool owns = (LL || hx) && start <= cur && cur < end;
                u64 kw[DPL], vw[DPL];
                if (LL && owns) {
#pragma unroll
                    for (int k = 0; k < DPL; ++k) {
                        kw[k] = ld_ll(ll_k + (r * NKV + kvh) * D + lane * DPL + k);
                        vw[k] = ld_ll(ll_v + (r * NKV + kvh) * D + lane * DPL + k);
                    }
                }
                float m = NEG_INF, l = 0.f, acc[DPL];
#pragma unroll
                for (int k = 0; k < DPL; ++k) acc[k] = 0.f;
                const int* bt = block_tables + (long long)r * bt_stride;
                for (int t = start; t < end; t += 32) {
                    const int kk = t + lane;
                    const bool valid = kk < end;
                    float score = NEG_INF;
                    const bool cur_tile = owns && cur < t + 32;  // warp-uniform
                    float vcur[DPL];
                    // HX: the step's K row goes to the warp's accumulator row (free until after its last tile) and
                    // its V row to its place in the V tile, which no copy writes; the key's lane then sums its
                    // score from that K row in the order every other key's lane does (as the barrier build).
                    bf16* kst = (bf16*)(sm.qs + warp * D);
                    if (LL && cur_tile) {
                        float sc = 0.f;
#pragma unroll
                        for (int k = 0; k < DPL; ++k) {
                            const u64* base_k = ll_k + (r * NKV + kvh) * D + lane * DPL + k;
                            const u64* base_v = ll_v + (r * NKV + kvh) * D + lane * DPL + k;
                            sc = fmaf(sm.qv[lane * DPL + k], wait_ll(base_k, kw[k], TAG(layer, 1)), sc);
                            vcur[k] = wait_ll(base_v, vw[k], TAG(layer, 1));
                        }
                        sc = warp_sum(sc);
                        if (kk == cur) score = sc;
                    } else if (cur_tile) {
                        const u64* base_k = ll_k + (r * NKV + kvh) * D + lane * DPL;
                        const u64* base_v = ll_v + (r * NKV + kvh) * D + lane * DPL;
#pragma unroll
                        for (int k = 0; k < DPL; ++k) {
                            kw[k] = ld_ll(base_k + k);
                            vw[k] = ld_ll(base_v + k);
                        }
#pragma unroll
                        for (int k = 0; k < DPL; ++k) {
                            kst[lane * DPL + k] = f2bf(wait_ll(base_k + k, kw[k], TAG(layer, 1)));
                            vst[(cur - t) * D + lane * DPL + k] = f2bf(wait_ll(base_v + k, vw[k], TAG(layer, 1)));
                        }
                        __syncwarp();
                    }
                    const bool mine = !LL && cur_tile && kk == cur;
                    if (valid && !(LL && cur_tile && kk == cur)) {
                        const long long slot = (long long)bt[kk / PAGE] * PAGE + kk % PAGE;
                        const bf16* krow = kl + (slot * NKV + kvh) * D;
                        const bf16* vrow = vl + (slot * NKV + kvh) * D;
                        const unsigned int dst = (unsigned int)__cvta_generic_to_shared(vst + lane * D);
                        if (!mine) {
#pragma unroll
                            for (int c = 0; c < D / 8; ++c)
                                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + c * 16),
                                             "l"(vrow + c * 8) : "memory");
                        }
                        // (HX reads the pool through L1: no key it reads there was written during this launch)
                        const bf16* kp = mine ? kst : krow;
                        uint4 kv[D / 8];
#pragma unroll
                        for (int c = 0; c < D / 8; ++c) kv[c] = hx ? *(const uint4*)(kp + c * 8) : ld_shared_v4(krow + c * 8);
                        float sc = 0.f;
#pragma unroll
                        for (int c = 0; c < D / 8; ++c) {
                            const float* qc = sm.qv + c * 8;
                            sc = fmaf(qc[0], bf2f(kv[c].x & 0xffffu), sc);
                            sc = fmaf(qc[1], __uint_as_float(kv[c].x & 0xffff0000u), sc);
                            sc = fmaf(qc[2], bf2f(kv[c].y & 0xffffu), sc);
                            sc = fmaf(qc[3], __uint_as_float(kv[c].y & 0xffff0000u), sc);
                            sc = fmaf(qc[4], bf2f(kv[c].z & 0xffffu), sc);
                            sc = fmaf(qc[5], __uint_as_float(kv[c].z & 0xffff0000u), sc);
                            sc = fmaf(qc[6], bf2f(kv[c].w & 0xffffu), sc);
                            sc = fmaf(qc[7], __uint_as_float(kv[c].w & 0xffff0000u), sc);
                        }
                        score = sc;
                    }
                    asm volatile("cp.async.commit_group;" ::: "memory");
                    const float m_new = fmaxf(m, warp_max(score));
                    const float alpha = exp2f(m - m_new);          // m = -inf on the first tile: 0
                    const float p = valid ? exp2f(score - m_new) : 0.f;
                    l = l * alpha + warp_sum(p);
#pragma unroll
                    for (int k = 0; k < DPL; ++k) acc[k] *= alpha;
                    m = m_new;
                    asm volatile("cp.async.wait_all;" ::: "memory");
                    if (LL && cur_tile) {
#pragma unroll
                        for (int k = 0; k < DPL; ++k) vst[(cur - t) * D + lane * DPL + k] = f2bf(vcur[k]);
                    }
                    __syncwarp();
                    const int n = min(end - t, 32);  // keys in this tile (a short one stops after its keys' groups)
                    for (int j0 = 0; j0 < (TILE_STEP == 32 ? 1 : n); j0 += TILE_STEP) {
#pragma unroll
                        for (int jj = 0; jj < TILE_STEP; ++jj) {
                            const int j = j0 + jj;  // < 32: j0 < n <= 32 and TILE_STEP divides 32
                            const float pj = __shfl_sync(0xffffffffu, p, j);
                            if (j < n) {
                                const bf16* vr = vst + j * D + lane * DPL;
#pragma unroll
                                for (int k = 0; k < DPL; k += 2) {
                                    const unsigned int v2 = *(const unsigned int*)(vr + k);
                                    acc[k] = fmaf(pj, bf2f(v2 & 0xffffu), acc[k]);
                                    acc[k + 1] = fmaf(pj, __uint_as_float(v2 & 0xffff0000u), acc[k + 1]);
                                }
                            }
                        }
                    }
                    __syncwarp();  // the next tile overwrites the staged V
                }
#pragma unroll
                for (int k = 0; k < DPL; ++k) sm.qs[warp * D + lane * DPL + k] = acc[k];
                if (lane == 0) { sm.wml[warp] = m; sm.wml[WARPS + warp] = l; }
                __syncthreads();
                const int pu = (r * NH + hq) * splits + sp;  // this block's partial
                for (int d = threadIdx.x; d < D; d += THREADS) {
                    float mm = NEG_INF;
#pragma unroll
                    for (int w = 0; w < WARPS; ++w) mm = fmaxf(mm, sm.wml[w]);
                    float ll = 0.f, o = 0.f;
#pragma unroll
                    for (int w = 0; w < WARPS; ++w) {
                        const float mw = sm.wml[w];
                        const float f = mw == NEG_INF ? 0.f : exp2f(mw - mm);
                        ll += sm.wml[WARPS + w] * f;
                        o += sm.qs[w * D + d] * f;
                    }
                    if (splits == 1) {
                        if (LL || hx) st_ll(ll_attn + r * (NH * D) + hq * D + d, round_bf(ll > 0.f ? o / ll : 0.f), TAG(layer, 2));
                        else attn[r * (NH * D) + hq * D + d] = f2bf(ll > 0.f ? o / ll : 0.f);
                    } else if (LL) {
                        st_ll(ll_part + (long long)pu * D + d, o, TAG(layer, 2));
                        if (d == 0) {
                            st_ll(ll_ml + 2 * pu, mm, TAG(layer, 2));
                            st_ll(ll_ml + 2 * pu + 1, ll, TAG(layer, 2));
                        }
                    } else {  // the block's partial, merged below by the head's last block
                        part[(long long)pu * D + d] = o;
                        if (d == 0) *((float2*)(part + ML_OFF) + pu) = make_float2(mm, ll);
                    }
                }
                if (!LL && splits > 1) {
                    // The (row, head)'s last block to finish merges its partials into attn: one block's merge
                    // per head before the barrier. (Every block merging every head in P3's prologue, two L2
                    // round trips on lines that every multiprocessor read, cost Llama-3.1-8B ~9 us a layer.)
                    __syncthreads();  // the block's partial is written
                    if (threadIdx.x == 0) {
                        unsigned int old;  // release: the partial before the arrival; acquire: the others' after
                        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                                     : "=r"(old) : "l"(heads + r * NH + hq) : "memory");
                        last_split = old == (unsigned int)(splits - 1);
                        if (last_split) heads[r * NH + hq] = 0u;  // read again after this layer's barrier only
                    }
                    __syncthreads();
                    if (last_split)
                        merge_head(part, (r * NH + hq) * splits, splits, attn + r * (NH * D) + hq * D, sm.wml,
                                   hx ? ll_attn + r * (NH * D) + hq * D : nullptr, TAG(layer, 2));
                }
                __syncthreads();  // qv, qs and wml are rewritten by the next unit
            }
        }
        if (LL) __syncthreads();  // (every phase boundary: the next phase rewrites this one's shared inputs)
        else if (hx) ARRIVE_GRID();
        else SYNC_GRID();

        // ---------------- P3: o projection, residual ----------------
        if (!(SKIP & 4)) {
            if (hx) {
                load_rows_ll<NH * D>(ll_attn, TAG(layer, 2), sm.vec);  // the resident blocks' words
            } else if (LL) {
                if (splits == 1) load_rows_ll<NH * D>(ll_attn, TAG(layer, 2), sm.vec);
                else merge_splits_ll(ll_part, ll_ml, TAG(layer, 2), splits, sm.vec, sm.qs);
            } else {
                load_rows<NH * D>(attn, sm.vec);  // split heads were merged into attn by their last block
            }
            const bf16* wo = LP(layer, 3);
            const bf16* bo = LP(layer, 4);
            for (int j = gw; j < H; j += tw) {
                float acc[1][R];
                bool pre = false;
                if constexpr (PRE_O) { if ((pre = j == gw)) dot_w<NH * D, 1>(w3, sm.vec, acc, lane); }
                else if (STAGE_O && stage_o && (pre = j == gw)) dot_staged<NH * D>(sm.kres + warp * (NH * D), sm.vec, acc, lane);
                if (!pre) warp_dot<NH * D, 1>(wo + (long long)j * (NH * D), nullptr, sm.vec, acc, lane);
                if (lane < R) {
                    float y = row_of<1>(acc, 0, lane);
                    if (HAS_O_BIAS) y += bf2f(bo[j]);
                    const float x = round_bf(bf2f(sm.hs[lane * H + j]) + round_bf(y));
                    if (LL || hx2) st_ll(ll_ha + lane * H + j, x, TAG(layer, 3));
                    else h[lane * H + j] = f2bf(x);
                }
            }
        }
        if (gw < I) {
            const bf16* a = LP(layer, 6) + (long long)gw * H;
            const bf16* b = LP(layer, 6) + (long long)(I + gw) * H;
            if constexpr (PRE_H) {
                load_w<H>(a, b, w4, lane);
            } else {
                prefetch_row(a, H, lane);
                prefetch_row(b, H, lane);
            }
        }
        if (LL) __syncthreads();
        else if (hx2) ARRIVE_GRID();
        else SYNC_GRID();

        // ---------------- P4: norm, gate/up, silu ----------------
        if (!(SKIP & 8)) {
            load_norm(h, LP(layer, 5), sm, nullptr, (LL || hx2) ? ll_ha : nullptr, TAG(layer, 3));
            // the next layer's resident keys, copied during P4 and P5 (from P5 on: 9-21 us a launch slower at 8B)
            if (RES && res && res_g >= 0 && layer + 1 < L)
                res_copy<true>(kl + pool_layer_stride, vl + pool_layer_stride, block_tables, res_g, res_lo,
                               res_ahead(res_lo, res_hi, res_ctx), ResRows{sm.kres, sm.vec, res_lo});
            const bf16* wgu = LP(layer, 6);
            for (int j = gw; j < I; j += tw) {
                float acc[2][R];
                bool pre = false;
                if constexpr (PRE_H) { if ((pre = j == gw)) dot_w<H, 2>(w4, sm.vec, acc, lane); }
                if (!pre) warp_dot<H, 2>(wgu + (long long)j * H, wgu + (long long)(I + j) * H, sm.vec, acc, lane);
                if (lane < R) {
                    const float g = round_bf(row_of<2>(acc, 0, lane));
                    const float u = round_bf(row_of<2>(acc, 1, lane));
                    const float sg = round_bf(g / (1.f + __expf(-g)));
                    if (LL) st_ll(ll_act + lane * I + j, round_bf(sg * u), TAG(layer, 4));
                    else act[lane * I + j] = f2bf(sg * u);
                }
            }
        }
        if (gw < H) {
            if constexpr (PRE_I) load_w<I>(LP(layer, 7) + (long long)gw * I, nullptr, w5, lane);
            else prefetch_row(LP(layer, 7) + (long long)gw * I, I, lane);
        }
        if (LL) __syncthreads();
        else SYNC_GRID();

        // ---------------- P5: down projection, residual ----------------
        if (!(SKIP & 16)) {
            if (LL) load_rows_ll<I>(ll_act, TAG(layer, 4), sm.vec);
            else load_rows<I>(act, sm.vec);
            const bf16* wd = LP(layer, 7);
            for (int j = gw; j < H; j += tw) {
                float acc[1][R];
                bool pre = false;
                if constexpr (PRE_I) { if ((pre = j == gw)) dot_w<I, 1>(w5, sm.vec, acc, lane); }
                if (!pre) warp_dot<I, 1>(wd + (long long)j * I, nullptr, sm.vec, acc, lane);
                if (lane < R) {
                    const float x = round_bf(bf2f(sm.hs[lane * H + j]) + round_bf(row_of<1>(acc, 0, lane)));
                    if (LL || hx4) st_ll(ll_hb + lane * H + j, x, TAG(layer, 5));
                    else h[lane * H + j] = f2bf(x);
                }
            }
        }
        if (layer + 1 < L && u_first >= 0) {
            // The next layer's first QKV unit of this warp.
            const bf16 *a, *b;
            qkv_rows(LP(layer + 1, 1), u_first, &a, &b);
            if constexpr (PRE_H) {
                load_w<H>(a, b, w1, lane);
            } else {
                prefetch_row(a, H, lane);
                if (b != nullptr) prefetch_row(b, H, lane);
            }
        }
        if (LL) __syncthreads();
        else if (hx4) ARRIVE_GRID();
        else SYNC_GRID();
    }

    // ---------------- final norm ----------------
#if HEAD
    // Every block norms the final hidden states itself (block 0 also writes them out), then the LM head:
    // logits rounded to bf16 as F.linear(...).float() gives them, written to the step's logits and the
    // state rows' logits; with `greedy`, the argmax (first maximal index, as torch's) as the sampled token.
    load_norm(h, final_norm, sm, nullptr, (LL || hx4) ? ll_hb : nullptr, TAG(L - 1, 5));
    if (blockIdx.x == 0) {
        for (int i = threadIdx.x; i < R * (H / 8); i += THREADS) {
            const int r = i / (H / 8), c = i % (H / 8);
            *(uint4*)(out + (long long)r * H + c * 8) = *(const uint4*)(sm.vec + r * KMAX + c * 8);
        }
    }
    float best = NEG_INF;
    int best_j = 0x7fffffff;
    const long long srow = lane < R ? state_rows[lane] : 0;
    // Each warp takes HR rows tw apart per round (rows past the vocabulary re-read row j0 and are not written).
    constexpr int HR = HEAD_ROWS > 0 ? HEAD_ROWS : (Row<H>::PRE ? 4 : 2);
    for (int j0 = gw; j0 < vocab; j0 += HR * tw) {
        const bf16* wr[HR];
#pragma unroll
        for (int n = 0; n < HR; ++n) wr[n] = lm_head + (long long)(j0 + n * tw < vocab ? j0 + n * tw : j0) * H;
        float acc[HR][R];
        warp_dot_rows<H, HR>(wr, sm.vec, acc, lane);
        if (lane < R) {
#pragma unroll
            for (int n = 0; n < HR; ++n) {
                const int j = j0 + n * tw;
                if (j >= vocab) break;
                const float v = round_bf(row_of<HR>(acc, n, lane));
                logits[(long long)lane * vocab + j] = v;
                state_logits[srow * vocab + j] = v;
                if (v > best || (v == best && j < best_j)) { best = v; best_j = j; }
            }
        }
    }
    float* wv = sm.qs;                          // [WARPS][R] each warp's best value per row, then [WARPS]
    int* wj = (int*)(sm.qs + WARPS * R + WARPS);  // and its index
    if (greedy) {
        if (lane < R) { wv[warp * R + lane] = best; wj[warp * R + lane] = best_j; }
        __syncthreads();
        if (threadIdx.x < R) {
            const int r = threadIdx.x;
            float bv = NEG_INF;
            int bj = 0x7fffffff;
            for (int w = 0; w < WARPS; ++w) {
                const float v = wv[w * R + r];
                const int j = wj[w * R + r];
                if (v > bv || (v == bv && j < bj)) { bv = v; bj = j; }
            }
            cand_val[blockIdx.x * R + r] = bv;
            cand_idx[blockIdx.x * R + r] = bj;
        }
    }
    // Every block arrives once (greedy or not: NB counts it) and does not wait: the last to arrive (an acq_rel
    // add, so it sees every block's candidates) reduces them.
    __shared__ int last_block;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int old;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(barrier) : "memory");
        last_block = old == base + (phase + 1) * gridDim.x - 1;
    }
    __syncthreads();
    if (greedy) {
        if (last_block) {
            // The blocks' candidates, one per thread (independent loads), reduced per row through the warps.
            for (int r = 0; r < R; ++r) {
                float bv = NEG_INF;
                int bj = 0x7fffffff;
                for (int b = threadIdx.x; b < (int)gridDim.x; b += THREADS) {
                    const float v = ld_shared_f32(cand_val + b * R + r);
                    const int j = (int)ld_shared_u32(cand_idx + b * R + r);
                    if (v > bv || (v == bv && j < bj)) { bv = v; bj = j; }
                }
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) {
                    const float v = __shfl_xor_sync(0xffffffffu, bv, o);
                    const int j = __shfl_xor_sync(0xffffffffu, bj, o);
                    if (v > bv || (v == bv && j < bj)) { bv = v; bj = j; }
                }
                if (lane == 0) { wv[WARPS * R + warp] = bv; wj[WARPS * R + warp] = bj; }
                __syncthreads();
                if (threadIdx.x == 0) {
                    for (int w = 0; w < WARPS; ++w) {
                        const float v = wv[WARPS * R + w];
                        const int j = wj[WARPS * R + w];
                        if (v > bv || (v == bv && j < bj)) { bv = v; bj = j; }
                    }
                    if (bj == 0x7fffffff) bj = 0;  // every logit NaN: token 0
                    sampled[r] = bj;
                    last_token[state_rows[r]] = bj;
                }
                __syncthreads();
            }
        }
    }
#else
    if (blockIdx.x == 0) {
        load_norm(h, final_norm, sm, nullptr, (LL || hx4) ? ll_hb : nullptr, TAG(L - 1, 5));
        for (int i = threadIdx.x; i < R * (H / 8); i += THREADS) {
            const int r = i / (H / 8), c = i % (H / 8);
            *(uint4*)(out + (long long)r * H + c * 8) = *(const uint4*)(sm.vec + r * KMAX + c * 8);
        }
    }
#endif
    // Every block has read this launch's epoch: without LL every block arrived at the last layer's barriers,
    // which block 0 has passed; with LL block 0's last phase read words every block wrote after reading it.
    if (blockIdx.x == 0 && threadIdx.x == 0) *(volatile unsigned int*)(sync + 1) = epoch + 1u;
}
