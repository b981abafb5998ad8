/* Products over int8 weights in blocks of 32 with a float32 scale each (llama.cpp's Q8_0 layout, re-packed).
 *
 * y[rows, out] = x[rows, in] @ w[out, in]^T, w = scale * q; x and y bfloat16, row-major; `in` a multiple of 32.
 * Memory holds a byte a weight and a scale per 32 (1.125 bytes a weight against bf16's 2).
 *
 * Layout (flared/model/quant.py's pack_q8_0 makes it): the int8 values as pack_bf16 lays bf16 ones, groups of
 * FL_GROUP = 64 output features, each [in / 2][64][2] (zero rows past `out`); the scales as [groups][in / 32][64]
 * float32 (the 64 features' scales of each block of 32 inputs, zero past `out`).
 *
 * Two ways to the sums:
 * - Integer dots (fl_q8_groups, AVX-512 VNNI; decode's few rows): each row's block of 32 inputs is quantised to
 *   int16 with a float32 scale of its own (fl_q8_quantize_rows: 15 bits against bf16's 8, so the activation loses
 *   nothing bf16 had above 1/32767 of its block's largest value), VPDPWSSD sums q * xq in int32 exactly, and each
 *   block's sum joins a float32 total times both scales. The int8 values stay int8 until the multiply: the loop
 *   does two instructions a pair of 16 weights, so a product is bound by memory, not by widening.
 * - Widened (fl_q8_groups_widened: for many rows on AMX tiles, everywhere without VNNI, on AVX2 hosts): a
 *   group is widened into a per-thread scratch as bf16(scale * q), rounded to nearest-even (VCVTNE2PS2BF16, which
 *   reads a denormal product as zero: one under 1.2e-38 never comes from a real weight; the AVX2 widening rounds
 *   with linear_kernel.h's integer rounding), and run by that path's bf16 kernel: bf16_linear's result over the
 *   dequantised weight, bit for bit.
 * The two agree to rounding, not bit for bit; linear.pyx picks one by row count, the same way for the per-op
 * products and the one-call decode step, so those two stay bit-equal to each other.
 * - Single-threaded, as linear_kernel.h's; linear.pyx spreads the groups over threads.
 */
#ifndef FLARED_QLINEAR_KERNEL_H
#define FLARED_QLINEAR_KERNEL_H

#include "linear_kernel.h"

#define FL_Q8_BLOCK 32
/* The bf16 kernels a widened group runs on (fl_q8_groups_widened). */
#define FL_Q8_ON_AVX2 0
#define FL_Q8_ON_AVX512 1
#define FL_Q8_ON_AMX 2

#if FL_HAVE_X86

/* A thread's bf16 scratch for one widened group (`values` values; fl_thread_scratch), or NULL. */
static uint16_t *fl_q8_scratch(size_t values) {
    static __thread void *buffer = NULL;
    static __thread size_t size = 0;
    return (uint16_t *)fl_thread_scratch(&buffer, &size, sizeof(uint16_t) * values);
}


/* The eight scale vectors of one block (scales: its 64 features' float32 scales): vector j's lane l is feature
 * 8j + l / 2's scale, as the packed pairs lay the features out (two lanes a feature). */
FL_TARGET static inline __attribute__((always_inline)) void fl_q8_scales(const float *scales, __m512 sv[8]) {
    const __m512i lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i hi = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
    for (int i = 0; i < 4; i++) {
        __m512 s = _mm512_loadu_ps(scales + 16 * i);
        sv[2 * i] = _mm512_permutexvar_ps(lo, s);
        sv[2 * i + 1] = _mm512_permutexvar_ps(hi, s);
    }
}

/* 32 int8 (16 features' pairs) -> 32 bf16 weights: each times its lane's scale in float32, rounded to nearest-even. */
FL_TARGET static inline __attribute__((always_inline)) __m512bh fl_q8_widen(const int8_t *q, __m512 s_lo, __m512 s_hi) {
    __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))), s_lo);
    __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))),
                              s_hi);
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* ---- Integer dot products (AVX-512 VNNI): fl_q8_quantize_rows, then fl_q8_groups ---------------------------- */

#define FL_Q8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni")))

__attribute__((unused)) static int fl_q8_vnni_supported(void) {
    __builtin_cpu_init();
    return fl_bf16_supported() && __builtin_cpu_supports("avx512vnni");
}

/* x [rows, in] bf16 -> xq [rows, in] int16 and xs [rows, in / 32] float32: each block of 32 inputs of a row as
 * xs * xq, xs = its largest magnitude / 32767, xq = its values / xs rounded to nearest-even (a zero block: 0). */
FL_Q8_TARGET __attribute__((unused)) static void fl_q8_quantize_rows(const uint16_t *x, int rows, int in,
                                                                     int16_t *xq, float *xs) {
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < in / FL_Q8_BLOCK; b++) {
            const uint16_t *src = x + (size_t)r * in + (size_t)b * FL_Q8_BLOCK;
            __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16));
            __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + 16))), 16));
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            float scale = amax / 32767.0f;
            __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
            xs[(size_t)r * (in / FL_Q8_BLOCK) + b] = scale;
            int16_t *dst = xq + (size_t)r * in + (size_t)b * FL_Q8_BLOCK;
            _mm256_storeu_si256((__m256i *)dst, _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse))));
            _mm256_storeu_si256((__m256i *)(dst + 16),
                                _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse))));
        }
}

/* Rows [0, RB) of the quantised x against one int8 group, into y (row stride ldy, bf16) or, n < 64, its first n
 * columns: per block of 32 inputs, VPDPWSSD sums q * xq exactly in int32 (at most 32 * 127 * 32767 < 2^31), then
 * the float32 sum gains that times the weight's scale times the row's. */
FL_Q8_TARGET static inline __attribute__((always_inline)) void fl_q8_dot_block(
        const int8_t *group, const float *scales, const int16_t *xq, const float *xs, int in, uint16_t *y,
        int64_t ldy, int n, const int RB) {
    float sums[FL_GEMM_RB][FL_GROUP];
    for (int r = 0; r < RB; r++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(sums[r] + 16 * j, _mm512_setzero_ps());
    const int blocks = in / FL_Q8_BLOCK;
    for (int b = 0; b < blocks; b++) {
        __m512i acc[4][FL_GEMM_RB];
        for (int j = 0; j < 4; j++)
            for (int r = 0; r < RB; r++) acc[j][r] = _mm512_setzero_si512();
        for (int k = b * (FL_Q8_BLOCK / 2); k < (b + 1) * (FL_Q8_BLOCK / 2); k++) {
            const int8_t *qk = group + (size_t)k * (2 * FL_GROUP);
            __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)qk));
            __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(qk + 32)));
            __m512i w2 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(qk + 64)));
            __m512i w3 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(qk + 96)));
            for (int r = 0; r < RB; r++) {
                int32_t pair;
                memcpy(&pair, xq + (size_t)r * in + 2 * k, sizeof pair);
                __m512i xb = _mm512_set1_epi32(pair);
                acc[0][r] = _mm512_dpwssd_epi32(acc[0][r], w0, xb);
                acc[1][r] = _mm512_dpwssd_epi32(acc[1][r], w1, xb);
                acc[2][r] = _mm512_dpwssd_epi32(acc[2][r], w2, xb);
                acc[3][r] = _mm512_dpwssd_epi32(acc[3][r], w3, xb);
            }
        }
        const float *sb = scales + (size_t)b * FL_GROUP;
        for (int r = 0; r < RB; r++) {
            __m512 sx = _mm512_set1_ps(xs[(size_t)r * blocks + b]);
            for (int j = 0; j < 4; j++) {
                __m512 scale = _mm512_mul_ps(_mm512_loadu_ps(sb + 16 * j), sx);
                _mm512_storeu_ps(sums[r] + 16 * j, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[j][r]), scale,
                                                                    _mm512_loadu_ps(sums[r] + 16 * j)));
            }
        }
    }
    for (int r = 0; r < RB; r++) {
        uint16_t row[FL_GROUP];
        uint16_t *dst = n == FL_GROUP ? y + (size_t)r * ldy : row;
        for (int j = 0; j < 4; j++)
            _mm256_storeu_si256((__m256i *)(dst + 16 * j), fl_gemm_round(_mm512_loadu_ps(sums[r] + 16 * j)));
        if (n != FL_GROUP) memcpy(y + (size_t)r * ldy, row, (size_t)n * 2);
    }
}

/* Groups [g0, g1) of y [rows, ldy] = x @ w^T over the int8 groups q and their scales s, x given as
 * fl_q8_quantize_rows left it (xq, xs). */
FL_Q8_TARGET __attribute__((unused)) static void fl_q8_groups(const int8_t *q, const float *s, const int16_t *xq,
                                                              const float *xs, uint16_t *y, int64_t ldy, int rows,
                                                              int out, int in, int g0, int g1) {
    const int blocks = in / FL_Q8_BLOCK;
    for (int g = g0; g < g1; g++) {
        const int8_t *group = q + (size_t)g * FL_GROUP * in;
        const float *scales = s + (size_t)g * FL_GROUP * blocks;
        int j0 = g * FL_GROUP, n = out - j0 < FL_GROUP ? out - j0 : FL_GROUP;
        for (int r = 0; r < rows; r += FL_GEMM_RB) {
            int rb = rows - r < FL_GEMM_RB ? rows - r : FL_GEMM_RB;
            const int16_t *xr = xq + (size_t)r * in;
            const float *sr = xs + (size_t)r * blocks;
            uint16_t *yr = y + (size_t)r * ldy + j0;
            switch (rb) {
                case 1: fl_q8_dot_block(group, scales, xr, sr, in, yr, ldy, n, 1); break;
                case 2: fl_q8_dot_block(group, scales, xr, sr, in, yr, ldy, n, 2); break;
                case 3: fl_q8_dot_block(group, scales, xr, sr, in, yr, ldy, n, 3); break;
                case 4: fl_q8_dot_block(group, scales, xr, sr, in, yr, ldy, n, 4); break;
                case 5: fl_q8_dot_block(group, scales, xr, sr, in, yr, ldy, n, 5); break;
                default: fl_q8_dot_block(group, scales, xr, sr, in, yr, ldy, n, FL_GEMM_RB); break;
            }
        }
    }
}

/* One int8 group widened into bf16 pack_bf16's layout (dst: in * 64 values), AVX-512 BF16. */
FL_TARGET static void fl_q8_widen_group(const int8_t *group, const float *scales, uint16_t *dst, int in) {
    __m512 sv[8];
    for (int k = 0; k < in / 2; k++) {
        if ((k & (FL_Q8_BLOCK / 2 - 1)) == 0) fl_q8_scales(scales + (size_t)(k / (FL_Q8_BLOCK / 2)) * FL_GROUP, sv);
        const int8_t *qk = group + (size_t)k * (2 * FL_GROUP);
        uint16_t *dk = dst + (size_t)k * (2 * FL_GROUP);
        for (int b = 0; b < 4; b++)
            _mm512_storeu_si512((void *)(dk + 32 * b), (__m512i)fl_q8_widen(qk + 32 * b, sv[2 * b], sv[2 * b + 1]));
    }
}

/* One int8 group widened into bf16 pack_bf16's layout (dst: in * 64 values), AVX2: 8 lanes at a time, rounded
 * with linear_kernel.h's integer rounding. */
FL_AVX2_TARGET __attribute__((unused)) static void fl_q8_widen_group_avx2(const int8_t *group, const float *scales,
                                                                         uint16_t *dst, int in) {
    const __m256i dup = _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0);
    for (int k = 0; k < in / 2; k++) {
        const float *sb = scales + (size_t)(k / (FL_Q8_BLOCK / 2)) * FL_GROUP;
        const int8_t *qk = group + (size_t)k * (2 * FL_GROUP);
        uint16_t *dk = dst + (size_t)k * (2 * FL_GROUP);
        for (int j = 0; j < 16; j++) {  /* 8 values: features 4j .. 4j + 3, two lanes each */
            int64_t bits;
            memcpy(&bits, qk + 8 * j, sizeof bits);
            __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(bits)));
            __m256 sc = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(sb + 4 * j)), dup);
            _mm_storeu_si128((__m128i *)(dk + 8 * j), fl_avx2_round(_mm256_mul_ps(v, sc)));
        }
    }
}

/* Group g of a Q8_0 weight widened into bf16 pack_bf16's layout at dst (in * 64 values): AVX-512 BF16 (native)
 * or AVX2. */
__attribute__((unused)) static void fl_q8_widen_one(const int8_t *q, const float *s, uint16_t *dst, int in, int g,
                                                    int native) {
    const int8_t *group = q + (size_t)g * FL_GROUP * in;
    const float *scales = s + (size_t)g * FL_GROUP * (in / FL_Q8_BLOCK);
    if (native)
        fl_q8_widen_group(group, scales, dst, in);
    else
        fl_q8_widen_group_avx2(group, scales, dst, in);
}


/* Groups [g0, g1) of y [rows, ldy] = x @ w^T, each group widened into a per-thread scratch then run by `kernel`'s
 * bf16 kernel (the AMX tiles, linear_kernel.h's AVX-512 BF16 one, or its AVX2 one): that kernel's result over the
 * dequantised weight, bit for bit. Returns 0, or -1 without the scratch (nothing written). */
__attribute__((unused)) static int fl_q8_groups_widened(const int8_t *q, const float *s, const uint16_t *x,
                                                        uint16_t *y, int64_t ldy, int rows, int out, int in, int g0,
                                                        int g1, int kernel) {
    uint16_t *wide = fl_q8_scratch((size_t)in * FL_GROUP);
    if (wide == NULL) return -1;
    for (int g = g0; g < g1; g++) {
        int j0 = g * FL_GROUP, n = out - j0 < FL_GROUP ? out - j0 : FL_GROUP;
        fl_q8_widen_one(q, s, wide, in, g, kernel != FL_Q8_ON_AVX2);
        if (kernel == FL_Q8_ON_AMX)
            fl_amx_group(wide, x, in, y + j0, ldy, rows, in / 2, n);
        else if (kernel == FL_Q8_ON_AVX512)
            fl_gemm_groups(wide, x, y + j0, ldy, rows, n, in, 0, 1);
        else
            fl_gemm_groups_avx2(wide, x, y + j0, ldy, rows, n, in, 0, 1);
    }
    if (kernel == FL_Q8_ON_AMX)
        fl_amx_release();
    return 0;
}

/* Groups [g0, g1) widened into pack_bf16's layout at dst (the whole packed bf16 weight), on AVX-512 BF16 or AVX2. */
__attribute__((unused)) static void fl_q8_widen_groups(const int8_t *q, const float *s, uint16_t *dst, int in,
                                                       int g0, int g1, int native) {
    for (int g = g0; g < g1; g++) fl_q8_widen_one(q, s, dst + (size_t)g * FL_GROUP * in, in, g, native);
}

#else

static int fl_q8_vnni_supported(void) { return 0; }
static void fl_q8_quantize_rows(const uint16_t *x, int rows, int in, int16_t *xq, float *xs) {
    (void)x; (void)rows; (void)in; (void)xq; (void)xs;
}
static void fl_q8_groups(const int8_t *q, const float *s, const int16_t *xq, const float *xs, uint16_t *y,
                         int64_t ldy, int rows, int out, int in, int g0, int g1) {
    (void)q; (void)s; (void)xq; (void)xs; (void)y; (void)ldy; (void)rows; (void)out; (void)in; (void)g0; (void)g1;
}
static int fl_q8_groups_widened(const int8_t *q, const float *s, const uint16_t *x, uint16_t *y, int64_t ldy,
                                int rows, int out, int in, int g0, int g1, int kernel) {
    (void)q; (void)s; (void)x; (void)y; (void)ldy; (void)rows; (void)out; (void)in; (void)g0; (void)g1; (void)kernel;
    return -1;
}
static void fl_q8_widen_groups(const int8_t *q, const float *s, uint16_t *dst, int in, int g0, int g1, int native) {
    (void)q; (void)s; (void)dst; (void)in; (void)g0; (void)g1; (void)native;
}

#endif

#endif
