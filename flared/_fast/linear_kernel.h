/* Decode-sized bf16 matrix products on x86-64 CPUs with AVX-512 BF16.
 *
 * y[rows, out] = x[rows, in] @ w[out, in]^T; w, x and y are bfloat16 (raw uint16 bits), row-major and
 * contiguous; products accumulate in float32 (VDPBF16PS) and y is rounded to nearest-even, as torch does.
 *
 * Rules:
 * - Meant for few rows (decode): the step is bound by streaming w, so every weight row is read from
 *   memory once for all rows (8 rows per pass over a weight row; later passes find it in L1).
 * - The AVX-512 code is compiled per function (target attribute), so this header builds with plain -O3
 *   on any x86-64 gcc >= 10 / clang >= 9; fl_bf16_supported() says at run time whether it may be called.
 *   Elsewhere nothing here is compiled and fl_bf16_supported() is 0.
 * - Single-threaded: fl_bf16_range computes a range of output features; linear.pyx spreads ranges over
 *   threads (OpenMP).
 */
#ifndef FLARED_LINEAR_KERNEL_H
#define FLARED_LINEAR_KERNEL_H

#include <stdint.h>

/* avx512bf16 intrinsics need gcc >= 10 or clang >= 9; older compilers build the fallback. */
#if defined(__x86_64__) && \
    ((defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10))
#define FL_HAVE_X86 1
#else
#define FL_HAVE_X86 0
#endif

#if FL_HAVE_X86
#include <immintrin.h>
#include <string.h>

#define FL_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

static int fl_bf16_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

static inline uint16_t fl_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays a (quiet) NaN */
    u += 0x7fffu + ((u >> 16) & 1u);  /* round to nearest, ties to even */
    return (uint16_t)(u >> 16);
}

/* One weight row against NR (1..8) input rows, U partial sums per row (NR * U >= 4 independent
 * accumulator chains hide VDPBF16PS's latency). Inlined with constant NR and U so the accumulators live in
 * registers. One weight row at a time keeps the weight reads one sequential stream: interleaving 2 or 4
 * weight rows (to reuse each x load) halved the bandwidth the hardware prefetcher delivers here (Zen 4:
 * 22 -> 11 GB/s on one core), and x stays in L1 anyway. */
FL_TARGET static inline __attribute__((always_inline)) void fl_row(
        const uint16_t *w, const uint16_t *x, uint16_t *y, int in, int out, const int NR, const int U) {
    __m512 acc[8][4];
    for (int r = 0; r < NR; r++)
        for (int u = 0; u < U; u++) acc[r][u] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 32 * U <= in; k += 32 * U) {
        for (int u = 0; u < U; u++) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(w + k + 32 * u));
            for (int r = 0; r < NR; r++) {
                __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + (size_t)r * in + k + 32 * u));
                acc[r][u] = _mm512_dpbf16_ps(acc[r][u], wv, xv);
            }
        }
    }
    for (; k < in; k += 32) {  /* the rest, 32 at a time; the last one masked (zeroed lanes add 0 * 0) */
        __mmask32 m = in - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (in - k)) - 1);
        __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w + k);
        for (int r = 0; r < NR; r++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + (size_t)r * in + k);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], wv, xv);
        }
    }
    for (int r = 0; r < NR; r++) {
        for (int u = 1; u < U; u++) acc[r][0] = _mm512_add_ps(acc[r][0], acc[r][u]);
        y[(size_t)r * out] = fl_f32_to_bf16(_mm512_reduce_add_ps(acc[r][0]));
    }
}

/* Output features [j0, j1) of y for all rows. */
FL_TARGET static void fl_bf16_range(const uint16_t *w, const uint16_t *x, uint16_t *y, int rows, int out, int in,
                                    int j0, int j1) {
    for (int j = j0; j < j1; j++) {
        const uint16_t *wj = w + (size_t)j * in;
        for (int r = 0; r < rows; r += 8) {  /* beyond 8 rows the weight row is re-read from L1 */
            int nr = rows - r < 8 ? rows - r : 8;
            const uint16_t *xr = x + (size_t)r * in;
            uint16_t *yr = y + (size_t)r * out + j;
            switch (nr) {
                case 1: fl_row(wj, xr, yr, in, out, 1, 4); break;
                case 2: fl_row(wj, xr, yr, in, out, 2, 2); break;
                case 3: fl_row(wj, xr, yr, in, out, 3, 2); break;
                case 4: fl_row(wj, xr, yr, in, out, 4, 1); break;
                case 5: fl_row(wj, xr, yr, in, out, 5, 1); break;
                case 6: fl_row(wj, xr, yr, in, out, 6, 1); break;
                case 7: fl_row(wj, xr, yr, in, out, 7, 1); break;
                default: fl_row(wj, xr, yr, in, out, 8, 1); break;
            }
        }
    }
}

#else  /* not x86-64 (or an old compiler): the caller keeps torch's path */

static int fl_bf16_supported(void) { return 0; }
static void fl_bf16_range(const uint16_t *w, const uint16_t *x, uint16_t *y, int rows, int out, int in,
                          int j0, int j1) {
    (void)w; (void)x; (void)y; (void)rows; (void)out; (void)in; (void)j0; (void)j1;
}

#endif
#endif
