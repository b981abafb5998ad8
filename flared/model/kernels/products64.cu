// A decode step's products at up to 64 rows on Hopper: out[rows, N] = x[rows, K] @ W[N, K]^T, bf16 operands,
// float accumulation, bf16 results.
//
// cuBLASLt tiles these products so that a quarter to a third of the multiprocessors stream nothing
// (docs/benchmarks.md, twelfth session). Here the grid is chosen to cover the chip once: a block owns one
// tile of BN weight rows against all 64 input rows (the matrix unit's M side holds the rows, N the weight
// rows). A producer thread streams the tile's weight rows and the inputs (which every tile reads, from L2)
// through STAGES shared-memory stages of ATOMS 64-column boxes with TMA block copies (128-byte swizzle), each
// stage completing on its own mbarrier; one consumer warpgroup multiplies each stage with wgmma, NACC
// accumulators taking turns so that consecutive steps do not wait on each other, and hands a stage back once
// the next stage's products are issued. (Tried and slower: clusters sharing input stages by multicast, a
// separate shallower ring for the inputs, a tile's columns split over a cluster that adds its partial tiles
// through distributed shared memory: docs/benchmarks.md, twenty-third session.)
//
// EPI 1 is the SwiGLU epilogue for gate_up ([gate rows; up rows], n_out = I of each): a tile copies BN / 2
// gate rows and the matching BN / 2 up rows side by side, and the block writes silu(gate) * up, each rounded
// to bf16 first as the unfused path (fused.silu_mul) rounds them.
//
// EPI 2 is the residual epilogue for o and down: out is the residual stream h [rows, n_out], and the block adds
// its tile into it (h = bf16(h + bf16(acc)), as fused.add_rms_norm adds), writes xw_out = bf16(h * norm_w) (the
// next RMSNorm's weight) and each row's sum of squares over its tile to part_out[tile][row]. NORM 1 is the
// matching side for qkv and gate_up: the input is that xw, and the epilogue scales row r by inv[r] = rsqrt(mean
// square + eps) before anything else, inv from the nparts partial sums of the product before, added in a fixed
// order (a replay gives the same bits). So rms_norm(h) * w is rounded once, where fused.add_rms_norm rounds
// bf16(bf16(h * inv) * w), and the layer's two add_rms_norm launches go.
//
// Programmatic dependent launch (PDL): launched with the attribute, a block may start while the kernel before
// is still finishing. Its producer fills the ring's stages with weights (which no kernel writes) and then waits
// (griddepcontrol.wait) before it loads any input; the consumers wait before they read partial sums or write.
// Once the producer has issued its last copy it lets the next kernel launch (griddepcontrol.launch_dependents);
// that kernel's own wait still holds it until this grid has finished and its writes are visible. Launched
// without the attribute, both instructions do nothing.
//
// Defines: BN (weight rows a tile, a multiple of 8, <= 256), ATOMS, STAGES, EPI (0, 1 or 2), NORM (0 or 1),
// NACC (accumulators), WTILED (1: the weights come laid out tile by tile, [N / BN][K / 64][BN][64], so that a
// block's weight stream is one contiguous run).

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

struct __align__(64) TensorMap { u64 words[16]; };

#ifndef EPI
#define EPI 0
#endif
#ifndef WTILED
#define WTILED 0
#endif
#ifndef NORM
#define NORM 0
#endif

#ifndef ATOMS
#define ATOMS 1
#endif
#ifndef NACC
#define NACC 1
#endif

#define ROWS 64                        // the matrix unit's M
#define BK 64                          // one 128-byte swizzle span of bf16: a TMA box's columns
#define X_ATOM (ROWS * BK * 2)         // an input box
#define W_ATOM (BN * BK * 2)           // a weight box
#define STAGE_BYTES (ATOMS * (X_ATOM + W_ATOM))
#define CONSUMERS 128
#define THREADS (CONSUMERS + 32)       // the consumer warpgroup and the producer warp

__device__ __forceinline__ u32 shared_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ void bar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void bar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}

__device__ __forceinline__ void bar_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void tma_load(u32 dst, const TensorMap* map, u32 bar, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%3, %4}], [%2];" :: "r"(dst), "l"((u64)map), "r"(bar), "r"(c0), "r"(c1) : "memory");
}

// A weight box (or its two half boxes with the SwiGLU epilogue) for step kb's atom a into ws.
__device__ __forceinline__ void load_weights(u32 ws, const TensorMap* wmap, u32 bar, int kb, int a, int tile,
                                             int n_out, int k) {
    const int col = (kb * ATOMS + a) * BK;
#if EPI == 1  // the tile's gate rows, then its up rows (n_out further on), as two half boxes
    tma_load(ws + a * W_ATOM, wmap, bar, col, tile * (BN / 2));
    tma_load(ws + a * W_ATOM + (BN / 2) * BK * 2, wmap, bar, col, n_out + tile * (BN / 2));
#elif WTILED  // the weights laid out tile by tile, 64 columns a box: each block streams one contiguous run
    tma_load(ws + a * W_ATOM, wmap, bar, 0, (tile * (k / BK) + col / BK) * BN);
#else
    tma_load(ws + a * W_ATOM, wmap, bar, col, tile * BN);
#endif
}

__device__ __forceinline__ float bf16_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(u32 v) { return __uint_as_float(v & 0xFFFF0000u); }

// A K-major operand in 128-byte-swizzled shared memory (8-row groups 1,024 bytes apart).
__device__ __forceinline__ u64 smem_desc(u32 addr) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float bf16_round(float v) {
    u16 b;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(v));
    return __uint_as_float(((u32)b) << 16);
}

// The host writes wgmma_n(float* d, u64 a, u64 b), the m64nBNk16 step, in place of the next line.
//@WGMMA@

extern "C" __global__ void __launch_bounds__(THREADS, 1)
flared_products64(const __grid_constant__ TensorMap wmap, const __grid_constant__ TensorMap xmap, u16* __restrict__ out,
                  int n_out, int rows, int k, float* __restrict__ part_out, const float* __restrict__ part_in,
                  int nparts, const u16* __restrict__ norm_w, float eps, u16* __restrict__ xw_out)
{
    extern __shared__ __align__(1024) unsigned char dyn[];
    // stages 1,024-aligned: the swizzle works on shared-address bits
    unsigned char* base = (unsigned char*)(((unsigned long long)dyn + 1023) & ~1023ull);
    __shared__ __align__(8) u64 full[STAGES], empty[STAGES];
    const u32 tid = threadIdx.x;
    const int tile = blockIdx.x;
    const int steps = k / (BK * ATOMS);
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            bar_init(shared_addr(&full[s]), 1);
            bar_init(shared_addr(&empty[s]), 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (tid == CONSUMERS) {  // the producer
        asm volatile("prefetch.tensormap [%0];" :: "l"((u64)&wmap) : "memory");
        asm volatile("prefetch.tensormap [%0];" :: "l"((u64)&xmap) : "memory");
        // the first stages' weights before the kernel before has finished: no kernel writes them
        const int head = steps < STAGES ? steps : STAGES;
        for (int kb = 0; kb < head; ++kb) {
            const u32 ws = shared_addr(base + kb * STAGE_BYTES) + ATOMS * X_ATOM, fb = shared_addr(&full[kb]);
            bar_expect(fb, STAGE_BYTES);
#pragma unroll
            for (int a = 0; a < ATOMS; ++a) load_weights(ws, &wmap, fb, kb, a, tile, n_out, k);
        }
        asm volatile("griddepcontrol.wait;" ::: "memory");
        for (int kb = 0; kb < steps; ++kb) {
            const int s = kb % STAGES;
            const u32 xs = shared_addr(base + s * STAGE_BYTES), ws = xs + ATOMS * X_ATOM;
            const u32 fb = shared_addr(&full[s]);
            if (kb >= head) {
                bar_wait(shared_addr(&empty[s]), ((kb / STAGES) & 1) ^ 1);
                bar_expect(fb, STAGE_BYTES);
#pragma unroll
                for (int a = 0; a < ATOMS; ++a) load_weights(ws, &wmap, fb, kb, a, tile, n_out, k);
            }
#pragma unroll
            for (int a = 0; a < ATOMS; ++a) tma_load(xs + a * X_ATOM, &xmap, fb, (kb * ATOMS + a) * BK, 0);
        }
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
    if (tid < CONSUMERS) {  // the consumer warpgroup
        asm volatile("griddepcontrol.wait;" ::: "memory");  // before reading partial sums or writing anything
#if NORM
        // inv[row] = rsqrt(mean square + eps) from the partial sums, in a fixed order: the first half of the
        // parts by threads 0-63, the second by 64-127, then their sum
        __shared__ float inv_s[ROWS], half_s[ROWS];
        {
            const int r = tid % ROWS, second = tid / ROWS;
            const int lo = second ? nparts / 2 : 0, hi = second ? nparts : nparts / 2;
            float sum = 0.f;
#pragma unroll 32  // the loads in flight together: one or two round trips to L2, not eight
            for (int b = lo; b < hi; ++b) sum += part_in[b * ROWS + r];
            if (second) half_s[r] = sum;
            asm volatile("bar.sync 1, 128;" ::: "memory");
            if (!second) inv_s[r] = rsqrtf((sum + half_s[r]) / (float)k + eps);
            asm volatile("bar.sync 1, 128;" ::: "memory");
        }
        const float inv0 = inv_s[16 * (tid / 32) + (tid % 32) / 4];  // the epilogue's rows r0 and r0 + 8
        const float inv1 = inv_s[16 * (tid / 32) + (tid % 32) / 4 + 8];
#endif
#if EPI == 2
        // this thread's h values of the tile (rows r0 and r0 + 8), read now, while the weights stream
        const int r0_ = 16 * (tid / 32) + (tid % 32) / 4;
        u32 hpre[BN / 8][2];
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const int n = tile * BN + 8 * j + 2 * (tid % 4);
            hpre[j][0] = (n < n_out && r0_ < rows) ? *(const u32*)(out + (u64)r0_ * n_out + n) : 0u;
            hpre[j][1] = (n < n_out && r0_ + 8 < rows) ? *(const u32*)(out + (u64)(r0_ + 8) * n_out + n) : 0u;
        }
#endif
        float accs[NACC][BN / 2];
#pragma unroll
        for (int c = 0; c < NACC; ++c)
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) accs[c][i] = 0.f;
        // Each stage's products are issued as one group; once the next stage's group is issued, the previous
        // group is waited for and its stage handed back, so the tensor cores always have a group queued.
        for (int kb = 0; kb < steps; ++kb) {
            const int s = kb % STAGES;
            bar_wait(shared_addr(&full[s]), (kb / STAGES) & 1);
            const u32 xs = shared_addr(base + s * STAGE_BYTES), ws = xs + ATOMS * X_ATOM;
            asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
            for (int j = 0; j < BK / 16; ++j)  // 16 columns (32 bytes) a step
#pragma unroll
                for (int a = 0; a < ATOMS; ++a)
                    wgmma_n(accs[(j * ATOMS + a) % NACC], smem_desc(xs + a * X_ATOM) + 2 * j,
                            smem_desc(ws + a * W_ATOM) + 2 * j);
            asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
            if (kb > 0 && tid == 0)
                asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];"
                             :: "r"(shared_addr(&empty[(kb - 1) % STAGES])) : "memory");
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
        for (int c = 1; c < NACC; ++c)
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) accs[0][i] += accs[c][i];

        // accs[0][4j + {0,1}]: row 16 w + l / 4, weight rows 8 j + 2 (l % 4) + {0,1}; [4j + {2,3}]: row + 8
        const int w = tid / 32, l = tid % 32;
        const int r0 = 16 * w + l / 4;
        float* acc = accs[0];
#if NORM
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            acc[4 * j] *= inv0;
            acc[4 * j + 1] *= inv0;
            acc[4 * j + 2] *= inv1;
            acc[4 * j + 3] *= inv1;
        }
#endif
#if EPI == 0
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const int n = tile * BN + 8 * j + 2 * (l % 4);
            if (n < n_out) {
                if (r0 < rows) *(u32*)(out + (u64)r0 * n_out + n) = pack_bf16(acc[4 * j], acc[4 * j + 1]);
                if (r0 + 8 < rows) *(u32*)(out + (u64)(r0 + 8) * n_out + n) = pack_bf16(acc[4 * j + 2], acc[4 * j + 3]);
            }
        }
#elif EPI == 2
        // h += the tile (rounded as fused.add_rms_norm rounds), xw = h * the next norm's weight, and each row's
        // sum of squares over the tile
        float ss0 = 0.f, ss1 = 0.f;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const int n = tile * BN + 8 * j + 2 * (l % 4);
            if (n < n_out) {
                const u32 wn = *(const u32*)(norm_w + n);
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int r = r0 + 8 * half;
                    if (r < rows) {
                        const u32 hv = hpre[j][half];
                        const float a = bf16_round(bf16_lo(hv) + bf16_round(acc[4 * j + 2 * half]));
                        const float b = bf16_round(bf16_hi(hv) + bf16_round(acc[4 * j + 2 * half + 1]));
                        *(u32*)(out + (u64)r * n_out + n) = pack_bf16(a, b);
                        *(u32*)(xw_out + (u64)r * n_out + n) = pack_bf16(a * bf16_lo(wn), b * bf16_hi(wn));
                        if (half) ss1 += a * a + b * b; else ss0 += a * a + b * b;
                    }
                }
            }
        }
        // the four lanes of a quad hold the same two rows
        ss0 += __shfl_xor_sync(0xFFFFFFFFu, ss0, 1);
        ss0 += __shfl_xor_sync(0xFFFFFFFFu, ss0, 2);
        ss1 += __shfl_xor_sync(0xFFFFFFFFu, ss1, 1);
        ss1 += __shfl_xor_sync(0xFFFFFFFFu, ss1, 2);
        if (l % 4 == 0) {
            part_out[tile * ROWS + r0] = ss0;
            part_out[tile * ROWS + r0 + 8] = ss1;
        }
#else
#define HALF (BN / 2)
#pragma unroll
        for (int j = 0; j < HALF / 8; ++j) {
            const int n = tile * HALF + 8 * j + 2 * (l % 4);
            float v[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float g = bf16_round(acc[4 * j + e]), u = bf16_round(acc[4 * (j + HALF / 8) + e]);
                v[e] = bf16_round(g / (1.f + __expf(-g))) * u;  // silu rounded first, as silu_mul does
            }
            if (n < n_out) {
                if (r0 < rows) *(u32*)(out + (u64)r0 * n_out + n) = pack_bf16(v[0], v[1]);
                if (r0 + 8 < rows) *(u32*)(out + (u64)(r0 + 8) * n_out + n) = pack_bf16(v[2], v[3]);
            }
        }
#endif
    }
}
