/* bf16 matrix products on x86-64 CPUs with AVX-512 BF16, over weights packed for the instruction.
 *
 * y[rows, out] = x[rows, in] @ w[out, in]^T; x and y are bfloat16 (raw uint16 bits), row-major. The weight
 * is packed once, at model load (decoder.py's pack_bf16), into groups of FL_GROUP = 64 output features:
 * group g holds w[64g .. 64g + 63, :] as [in / 2][64][2] (the pair of consecutive inputs 2k, 2k + 1 for
 * each of the 64 features; zero rows past `out`), so one 64-byte load gives VDPBF16PS an input pair for 16
 * features and a broadcast of x[r, 2k:2k + 2] multiplies it for row r. `in` must be even.
 *
 * Rules:
 * - A group is computed for up to FL_GEMM_RB rows at a time with 4 x FL_GEMM_RB float32 accumulators in
 *   registers: 4 weight loads and FL_GEMM_RB broadcasts feed 4 * FL_GEMM_RB multiply-adds, so the kernel is
 *   bound by the multiply-adds at many rows and by memory at one row (each group is one sequential stream);
 *   more rows re-read the group from L2. On SmolLM2's products (2 Zen 4 threads, weights not in cache) it
 *   ran a 1-row step as fast as the row-major matrix-vector kernel it replaced, 8 rows 1.75x faster, and
 *   beat torch's bf16 GEMM at every row count measured (32 rows 1.6x, 256 rows 1.1x): torch re-packs the
 *   weight on every call.
 * - Products accumulate in float32 (each output in one lane, input pairs in order) and y is rounded to
 *   nearest-even, NaN kept (quiet), as torch rounds.
 * - The AVX-512 code is compiled per function (target attribute), so this header builds with plain -O3 on
 *   any x86-64 gcc >= 10 / clang >= 9; fl_bf16_supported() says at run time whether it may be called.
 *   Elsewhere nothing here is compiled and fl_bf16_supported() is 0.
 * - Single-threaded: fl_gemm_groups computes a range of groups; linear.pyx spreads them over threads.
 */
#ifndef FLARED_LINEAR_KERNEL_H
#define FLARED_LINEAR_KERNEL_H

#include <stdint.h>
#include <string.h>

/* avx512bf16 intrinsics need gcc >= 10 or clang >= 9; older compilers build the fallback. */
#if defined(__x86_64__) && \
    ((defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10))
#define FL_HAVE_X86 1
#else
#define FL_HAVE_X86 0
#endif

#define FL_GROUP 64
#define FL_GEMM_RB 6

#if FL_HAVE_X86
#include <immintrin.h>

#define FL_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

static int fl_bf16_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

/* 16 float32 -> 16 bf16, round to nearest-even, NaN kept quiet. */
FL_TARGET static inline __m256i fl_gemm_round(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

/* Rows [0, RB) of x (row stride ldx) against one packed group: y[r * ldy + i] for i < 64. */
FL_TARGET static inline __attribute__((always_inline)) void fl_gemm_block(
        const uint16_t *group, const uint16_t *x, int64_t ldx, uint16_t *y, int64_t ldy, int pairs, const int RB) {
    __m512 acc[4][FL_GEMM_RB];
    for (int b = 0; b < 4; b++)
        for (int r = 0; r < RB; r++) acc[b][r] = _mm512_setzero_ps();
    for (int k = 0; k < pairs; k++) {
        const uint16_t *wk = group + (size_t)k * (2 * FL_GROUP);
        __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)wk);
        __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(wk + 32));
        __m512bh w2 = (__m512bh)_mm512_loadu_si512((const void *)(wk + 64));
        __m512bh w3 = (__m512bh)_mm512_loadu_si512((const void *)(wk + 96));
        for (int r = 0; r < RB; r++) {
            int32_t pair;
            memcpy(&pair, x + (size_t)r * ldx + 2 * k, sizeof pair);
            __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            acc[0][r] = _mm512_dpbf16_ps(acc[0][r], w0, xb);
            acc[1][r] = _mm512_dpbf16_ps(acc[1][r], w1, xb);
            acc[2][r] = _mm512_dpbf16_ps(acc[2][r], w2, xb);
            acc[3][r] = _mm512_dpbf16_ps(acc[3][r], w3, xb);
        }
    }
    for (int r = 0; r < RB; r++)
        for (int b = 0; b < 4; b++)
            _mm256_storeu_si256((__m256i *)(y + (size_t)r * ldy + 16 * b), fl_gemm_round(acc[b][r]));
}

/* Rows [0, rows) (rows <= FL_GEMM_RB) against group `group`, into y (row stride ldy): all 64 columns when
 * n == 64, else the first n through a tile on the stack. */
FL_TARGET static void fl_gemm_rows(const uint16_t *group, const uint16_t *x, int64_t ldx, uint16_t *y,
                                   int64_t ldy, int pairs, int rows, int n) {
    uint16_t tile[FL_GEMM_RB * FL_GROUP];
    uint16_t *dst = n == FL_GROUP ? y : tile;
    int64_t ld = n == FL_GROUP ? ldy : FL_GROUP;
    switch (rows) {
        case 1: fl_gemm_block(group, x, ldx, dst, ld, pairs, 1); break;
        case 2: fl_gemm_block(group, x, ldx, dst, ld, pairs, 2); break;
        case 3: fl_gemm_block(group, x, ldx, dst, ld, pairs, 3); break;
        case 4: fl_gemm_block(group, x, ldx, dst, ld, pairs, 4); break;
        case 5: fl_gemm_block(group, x, ldx, dst, ld, pairs, 5); break;
        default: fl_gemm_block(group, x, ldx, dst, ld, pairs, FL_GEMM_RB); break;
    }
    if (n != FL_GROUP)
        for (int r = 0; r < rows; r++) memcpy(y + (size_t)r * ldy, tile + (size_t)r * FL_GROUP, (size_t)n * 2);
}

/* Groups [g0, g1) of y [rows, ldy] = x [rows, in] @ w^T (y's columns 64g...; `out` bounds the last group). */
FL_TARGET static void fl_gemm_groups(const uint16_t *packed, const uint16_t *x, uint16_t *y, int64_t ldy, int rows,
                                     int out, int in, int g0, int g1) {
    for (int g = g0; g < g1; g++) {
        const uint16_t *group = packed + (size_t)g * FL_GROUP * in;
        int j0 = g * FL_GROUP, n = out - j0 < FL_GROUP ? out - j0 : FL_GROUP;
        for (int r = 0; r < rows; r += FL_GEMM_RB)
            fl_gemm_rows(group, x + (size_t)r * in, in, y + (size_t)r * ldy + j0, ldy, in / 2,
                         rows - r < FL_GEMM_RB ? rows - r : FL_GEMM_RB, n);
    }
}

#else  /* not x86-64 (or an old compiler): the caller keeps torch's path */

static int fl_bf16_supported(void) { return 0; }
static void fl_gemm_groups(const uint16_t *packed, const uint16_t *x, uint16_t *y, int64_t ldy, int rows,
                           int out, int in, int g0, int g1) {
    (void)packed; (void)x; (void)y; (void)ldy; (void)rows; (void)out; (void)in; (void)g0; (void)g1;
}

#endif
#endif
