/* Products over weights quantised in blocks of 32 inputs (llama.cpp's Q8_0 and Q4_1 formats, re-packed).
 *
 * y[rows, out] = x[rows, in] @ w[out, in]^T; x and y bfloat16, row-major; `in` a multiple of 32.
 * - Q8_0 (FL_QUANT_Q8_0): w = scale * q, q int8, a float32 scale per block: 1.125 bytes a weight against bf16's 2.
 * - Q4_1 (FL_QUANT_Q4_1): w = fma(step, q, offset), q in 0..15, a float16 step and offset per block: 0.625 bytes.
 *
 * Layouts (flared/model/quant.py's pack_q8_0 and pack_q4_1 make them), groups of FL_GROUP = 64 output features
 * (zero rows past `out`):
 * - Q8_0: the int8 values as pack_bf16 lays bf16 ones, each group [in / 2][64][2]; the scales [groups][in / 32][64]
 *   float32 (the 64 features' scales of each block of 32 inputs).
 * - Q4_1: each group's inputs in quads, 128 bytes a quad [in / 4][128]: of the quad's 256 values in the order
 *   (feature, its 4 inputs), byte j (j < 64) holds value j in its low half and value 64 + j in its high half, byte
 *   64 + j values 128 + j and 192 + j (so a 64-byte plane's low or high halves are 16 features' quads: one
 *   VPDPBUSD's worth); steps and offsets each [groups][in / 32][64] float16.
 *
 * Two ways to the sums:
 * - Integer dots (fl_quant_groups, AVX-512 VNNI; decode's few rows): each row's block of 32 inputs is quantised
 *   with a float32 scale of its own (fl_quant_rows), the dot products summed exactly in int32, and each block's sum
 *   joins a float32 total times both scales. Q8_0: the rows to int16 (15 bits against bf16's 8, so the activation
 *   loses nothing bf16 had above 1/32767 of its block's largest value), VPDPWSSD over int16 pairs. Q4_1: the rows
 *   to int8 (7 bits, as llama.cpp's Q8_1 rows against its Q4_1 weights), VPDPBUSD over quads of the unsigned 4-bit
 *   values (twice VPDPWSSD's products an instruction, and no widening), plus the offset times the block's sum of the
 *   quantised row. The weights stay int8 or 4-bit until the multiply, so a product of a few rows is bound by
 *   memory, not by widening.
 * - The same integer dots on AVX2 hosts (fl_quant_rows_scalar, fl_quant_groups_avx2; fewer than 16 rows): VPMADDWD
 *   for Q8_0, VPMADDUBSW then VPMADDWD for Q4_1, 8 features at a time.
 * - Widened (fl_quant_groups_widened: for many rows on AMX tiles, without VNNI, on AVX2 hosts past 16 rows): a
 *   group is widened into a per-thread scratch as the format's bf16 weight, rounded to nearest-even
 *   (VCVTNE2PS2BF16, which reads a denormal product as zero: one under 1.2e-38 never comes from a real weight; the
 *   AVX2 widening rounds with linear_kernel.h's integer rounding), and run by that path's bf16 kernel:
 *   bf16_linear's result over the dequantised weight, bit for bit.
 * The two agree to rounding, not bit for bit; linear.pyx picks one by row count, the same way for the per-op
 * products and the one-call decode step, so those two stay bit-equal to each other.
 * - Single-threaded, as linear_kernel.h's; linear.pyx spreads the groups over threads.
 */
#ifndef FLARED_QLINEAR_KERNEL_H
#define FLARED_QLINEAR_KERNEL_H

#include <math.h>

#include "linear_kernel.h"

#define FL_Q8_BLOCK 32
/* The formats (the `kind` arguments). */
#define FL_QUANT_Q8_0 0
#define FL_QUANT_Q4_1 1
/* The bf16 kernels a widened group runs on (fl_quant_groups_widened). */
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

/* ---- Integer dot products (AVX-512 VNNI): fl_quant_rows, then fl_quant_groups ------------------------------ */

#define FL_Q8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni")))

__attribute__((unused)) static int fl_q8_vnni_supported(void) {
    __builtin_cpu_init();
    return fl_bf16_supported() && __builtin_cpu_supports("avx512vnni");
}

/* x [rows, in] bf16 -> xq [rows, in] and xs [rows, in / 32] float32: each block of 32 inputs of a row as xs * xq,
 * xs = its largest magnitude / L, xq = its values / xs rounded to nearest-even (a zero block: 0); L = 32767 with xq
 * int16 (a Q8_0 product's rows) or 127 with xq int8 (Q4_1's). With xsum (else NULL), also each block's xs * (the sum
 * of its xq) [rows, in / 32] (Q4_1's offsets multiply it). */
FL_Q8_TARGET __attribute__((unused)) static void fl_quant_rows(int kind, const uint16_t *x, int rows, int in, void *xq,
                                                               float *xs, float *xsum) {
    const float limit = kind == FL_QUANT_Q4_1 ? 127.0f : 32767.0f;
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < in / FL_Q8_BLOCK; b++) {
            const uint16_t *src = x + (size_t)r * in + (size_t)b * FL_Q8_BLOCK;
            __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16));
            __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + 16))), 16));
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            float scale = amax / limit;
            __m512 inverse = _mm512_set1_ps(amax > 0.0f ? limit / amax : 0.0f);
            xs[(size_t)r * (in / FL_Q8_BLOCK) + b] = scale;
            const size_t at = (size_t)r * in + (size_t)b * FL_Q8_BLOCK;
            __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse));
            __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse));
            /* (|xq| <= L, so the saturating narrowing changes nothing) */
            if (kind == FL_QUANT_Q4_1) {
                _mm_storeu_si128((__m128i *)((int8_t *)xq + at), _mm512_cvtsepi32_epi8(qlo));
                _mm_storeu_si128((__m128i *)((int8_t *)xq + at + 16), _mm512_cvtsepi32_epi8(qhi));
            } else {
                _mm256_storeu_si256((__m256i *)((int16_t *)xq + at), _mm512_cvtsepi32_epi16(qlo));
                _mm256_storeu_si256((__m256i *)((int16_t *)xq + at + 16), _mm512_cvtsepi32_epi16(qhi));
            }
            if (xsum)
                xsum[(size_t)r * (in / FL_Q8_BLOCK) + b] =
                    scale * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        }
}

/* The float32 sums of rows [0, RB) rounded into y (row stride ldy, bf16), or its first n < 64 columns. */
FL_Q8_TARGET static inline __attribute__((always_inline)) void fl_quant_store(float sums[][FL_GROUP], uint16_t *y,
                                                                              int64_t ldy, int n, const int RB) {
    for (int r = 0; r < RB; r++) {
        uint16_t row[FL_GROUP];
        uint16_t *dst = n == FL_GROUP ? y + (size_t)r * ldy : row;
        for (int j = 0; j < 4; j++)
            _mm256_storeu_si256((__m256i *)(dst + 16 * j), fl_gemm_round(_mm512_loadu_ps(sums[r] + 16 * j)));
        if (n != FL_GROUP) memcpy(y + (size_t)r * ldy, row, (size_t)n * 2);
    }
}

/* A Q4_1 block's 64 float16 steps (or offsets) as float32. */
FL_TARGET static inline __attribute__((always_inline)) void fl_q4_params(const uint16_t *h, float *f) {
    for (int i = 0; i < 4; i++)
        _mm512_storeu_ps(f + 16 * i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + 16 * i))));
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
    fl_quant_store(sums, y, ldy, n, RB);
}

/* A Q4_1 quad row's four 64-byte planes of unsigned values (16 features' quads each, features 16c.. in plane c). */
FL_Q8_TARGET static inline __attribute__((always_inline)) void fl_q4_planes(const uint8_t *quad, __m512i planes[4]) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    __m512i b0 = _mm512_loadu_si512((const void *)quad), b1 = _mm512_loadu_si512((const void *)(quad + 64));
    planes[0] = _mm512_and_si512(b0, nibble);
    planes[1] = _mm512_and_si512(_mm512_srli_epi16(b0, 4), nibble);
    planes[2] = _mm512_and_si512(b1, nibble);
    planes[3] = _mm512_and_si512(_mm512_srli_epi16(b1, 4), nibble);
}

/* Rows [0, RB) of the int8 x (and each block's xsum) against one Q4_1 group, as fl_q8_dot_block (kept apart from
 * it: one function for both kinds, the kind a constant where inlined, ran 3-5% slower at 8 rows on both): per block,
 * VPDPBUSD sums q * xq exactly in int32 (at most 32 * 15 * 127), then the float32 sum gains that times the step times
 * the row's scale, plus the offset times the block's xsum. */
FL_Q8_TARGET static inline __attribute__((always_inline)) void fl_q4_dot_block(
        const uint8_t *group, const uint16_t *steps, const uint16_t *offsets, const int8_t *xq, const float *xs,
        const float *xsum, int in, uint16_t *y, int64_t ldy, int n, const int RB) {
    float sums[FL_GEMM_RB][FL_GROUP];
    for (int r = 0; r < RB; r++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(sums[r] + 16 * j, _mm512_setzero_ps());
    const int blocks = in / FL_Q8_BLOCK;
    for (int b = 0; b < blocks; b++) {
        __m512i acc[4][FL_GEMM_RB];
        for (int j = 0; j < 4; j++)
            for (int r = 0; r < RB; r++) acc[j][r] = _mm512_setzero_si512();
        for (int k = b * (FL_Q8_BLOCK / 4); k < (b + 1) * (FL_Q8_BLOCK / 4); k++) {
            __m512i w[4];
            fl_q4_planes(group + (size_t)k * (2 * FL_GROUP), w);
            for (int r = 0; r < RB; r++) {
                int32_t quad;
                memcpy(&quad, xq + (size_t)r * in + 4 * k, sizeof quad);
                __m512i xb = _mm512_set1_epi32(quad);
                acc[0][r] = _mm512_dpbusd_epi32(acc[0][r], w[0], xb);
                acc[1][r] = _mm512_dpbusd_epi32(acc[1][r], w[1], xb);
                acc[2][r] = _mm512_dpbusd_epi32(acc[2][r], w[2], xb);
                acc[3][r] = _mm512_dpbusd_epi32(acc[3][r], w[3], xb);
            }
        }
        float d[FL_GROUP], m[FL_GROUP];
        fl_q4_params(steps + (size_t)b * FL_GROUP, d);
        fl_q4_params(offsets + (size_t)b * FL_GROUP, m);
        for (int r = 0; r < RB; r++) {
            __m512 sx = _mm512_set1_ps(xs[(size_t)r * blocks + b]);
            __m512 sm = _mm512_set1_ps(xsum[(size_t)r * blocks + b]);
            for (int j = 0; j < 4; j++) {
                __m512 scale = _mm512_mul_ps(_mm512_loadu_ps(d + 16 * j), sx);
                __m512 total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[j][r]), scale, _mm512_loadu_ps(sums[r] + 16 * j));
                _mm512_storeu_ps(sums[r] + 16 * j, _mm512_fmadd_ps(_mm512_loadu_ps(m + 16 * j), sm, total));
            }
        }
    }
    fl_quant_store(sums, y, ldy, n, RB);
}

/* Group g's weights and per-block parameters in a `kind` weight (q the packed values; s the scales or steps; m the
 * offsets, Q4_1 only). */
static inline const void *fl_quant_group(int kind, const void *q, int in, int g) {
    return (const uint8_t *)q + (size_t)g * FL_GROUP * (kind == FL_QUANT_Q4_1 ? in / 2 : in);
}
static inline const void *fl_quant_params(int kind, const void *s, int in, int g) {
    return s == NULL ? NULL
                     : (const uint8_t *)s + (size_t)g * FL_GROUP * (in / FL_Q8_BLOCK) * (kind == FL_QUANT_Q4_1 ? 2 : 4);
}

/* Groups [g0, g1) of y [rows, ldy] = x @ w^T over a `kind` weight (q, s, m as fl_quant_group), x given as
 * fl_quant_rows left it for that kind (xq, xs; xsum for Q4_1). */
FL_Q8_TARGET __attribute__((unused)) static void fl_quant_groups(int kind, const void *q, const void *s, const void *m,
                                                                 const void *xq, const float *xs, const float *xsum,
                                                                 uint16_t *y, int64_t ldy, int rows, int out, int in,
                                                                 int g0, int g1) {
    const int blocks = in / FL_Q8_BLOCK;
    for (int g = g0; g < g1; g++) {
        const void *group = fl_quant_group(kind, q, in, g), *scales = fl_quant_params(kind, s, in, g);
        const void *offsets = fl_quant_params(kind, m, in, g);
        int j0 = g * FL_GROUP, n = out - j0 < FL_GROUP ? out - j0 : FL_GROUP;
        for (int r = 0; r < rows; r += FL_GEMM_RB) {
            int rb = rows - r < FL_GEMM_RB ? rows - r : FL_GEMM_RB;
            const void *xr = (const uint8_t *)xq + (size_t)r * in * (kind == FL_QUANT_Q4_1 ? 1 : 2);
            const float *sr = xs + (size_t)r * blocks, *mr = xsum ? xsum + (size_t)r * blocks : NULL;
            uint16_t *yr = y + (size_t)r * ldy + j0;
#define FL_QUANT_DOT(RB)                                                                                         \
            (kind == FL_QUANT_Q4_1                                                                               \
                 ? fl_q4_dot_block((const uint8_t *)group, (const uint16_t *)scales, (const uint16_t *)offsets, \
                                   (const int8_t *)xr, sr, mr, in, yr, ldy, n, RB)                               \
                 : fl_q8_dot_block((const int8_t *)group, (const float *)scales, (const int16_t *)xr, sr, in, yr, ldy, \
                                   n, RB))
            switch (rb) {
                case 1: FL_QUANT_DOT(1); break;
                case 2: FL_QUANT_DOT(2); break;
                case 3: FL_QUANT_DOT(3); break;
                case 4: FL_QUANT_DOT(4); break;
                case 5: FL_QUANT_DOT(5); break;
                default: FL_QUANT_DOT(FL_GEMM_RB); break;
            }
#undef FL_QUANT_DOT
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

/* One Q4_1 group widened into bf16 pack_bf16's layout (dst: in * 64 values), AVX-512 BF16: each value
 * fma(step, q, offset) in float32, rounded to nearest-even. */
FL_Q8_TARGET static void fl_q4_widen_group(const uint8_t *group, const uint16_t *steps, const uint16_t *offsets,
                                           uint16_t *dst, int in) {
    for (int block = 0; block < in / FL_Q8_BLOCK; block++) {
        __m512 sv[8], mv[8];
        float d[FL_GROUP], m[FL_GROUP];
        fl_q4_params(steps + (size_t)block * FL_GROUP, d);
        fl_q4_params(offsets + (size_t)block * FL_GROUP, m);
        fl_q8_scales(d, sv);
        fl_q8_scales(m, mv);
        for (int k = block * (FL_Q8_BLOCK / 4); k < (block + 1) * (FL_Q8_BLOCK / 4); k++) {
            __m512i planes[4];
            fl_q4_planes(group + (size_t)k * (2 * FL_GROUP), planes);
            for (int h = 0; h < 2; h++) {  /* input pair 2k + h: each feature's values 2h and 2h + 1 of its quad */
                uint16_t *dk = dst + (size_t)(2 * k + h) * (2 * FL_GROUP);
                for (int c = 0; c < 4; c++) {
                    __m256i pairs = _mm512_cvtepi32_epi16(h ? _mm512_srli_epi32(planes[c], 16) : planes[c]);
                    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(pairs)));
                    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(pairs, 1)));
                    _mm512_storeu_si512((void *)(dk + 32 * c),
                                        (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, sv[2 * c + 1], mv[2 * c + 1]),
                                                                     _mm512_fmadd_ps(lo, sv[2 * c], mv[2 * c])));
                }
            }
        }
    }
}

/* The same on AVX2 (with F16C for the parameters), 8 lanes at a time, rounded with linear_kernel.h's integer
 * rounding. */
__attribute__((target("avx2,fma,f16c"), unused)) static void fl_q4_widen_group_avx2(
        const uint8_t *group, const uint16_t *steps, const uint16_t *offsets, uint16_t *dst, int in) {
    const __m256i dup = _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0);
    const __m128i nibble = _mm_set1_epi8(0x0F);
    /* a quad row's 16 bytes for 4 features hold their 4 inputs each; pair h is bytes 4f + 2h, 4f + 2h + 1 */
    const __m128i pick[2] = {_mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1),
                             _mm_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1)};
    for (int k = 0; k < in / 4; k++) {
        const size_t b = (size_t)(k / (FL_Q8_BLOCK / 4)) * FL_GROUP;
        const uint8_t *qk = group + (size_t)k * (2 * FL_GROUP);
        for (int j = 0; j < 16; j++) {  /* features 4j .. 4j + 3: plane j / 4, its bytes 16 (j % 4) .. + 15 */
            const int plane = j / 4;
            __m128i bytes = _mm_loadu_si128((const __m128i *)(qk + 64 * (plane / 2) + 16 * (j % 4)));
            if (plane & 1) bytes = _mm_srli_epi16(bytes, 4);
            bytes = _mm_and_si128(bytes, nibble);
            __m256 d = _mm256_permutevar8x32_ps(
                _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(steps + b + 4 * j)))), dup);
            __m256 m = _mm256_permutevar8x32_ps(
                _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(offsets + b + 4 * j)))), dup);
            for (int h = 0; h < 2; h++) {
                __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_shuffle_epi8(bytes, pick[h])));
                _mm_storeu_si128((__m128i *)(dst + (size_t)(2 * k + h) * (2 * FL_GROUP) + 8 * j),
                                 fl_avx2_round(_mm256_fmadd_ps(v, d, m)));
            }
        }
    }
}

/* Group g of a `kind` weight (fl_quant_group's q, s, m) widened into bf16 pack_bf16's layout at dst (in * 64
 * values): AVX-512 BF16 (native) or AVX2. */
__attribute__((unused)) static void fl_quant_widen_one(int kind, const void *q, const void *s, const void *m,
                                                       uint16_t *dst, int in, int g, int native) {
    const void *group = fl_quant_group(kind, q, in, g), *scales = fl_quant_params(kind, s, in, g);
    if (kind == FL_QUANT_Q4_1) {
        const uint16_t *offsets = (const uint16_t *)fl_quant_params(kind, m, in, g);
        if (native)
            fl_q4_widen_group((const uint8_t *)group, (const uint16_t *)scales, offsets, dst, in);
        else
            fl_q4_widen_group_avx2((const uint8_t *)group, (const uint16_t *)scales, offsets, dst, in);
    } else if (native) {
        fl_q8_widen_group((const int8_t *)group, (const float *)scales, dst, in);
    } else {
        fl_q8_widen_group_avx2((const int8_t *)group, (const float *)scales, dst, in);
    }
}


/* Groups [g0, g1) of y [rows, ldy] = x @ w^T for a `kind` weight, each group widened into a per-thread scratch then
 * run by `kernel`'s bf16 kernel (the AMX tiles, linear_kernel.h's AVX-512 BF16 one, or its AVX2 one): that kernel's
 * result over the dequantised weight, bit for bit. Returns 0, or -1 without the scratch (nothing written). */
__attribute__((unused)) static int fl_quant_groups_widened(int kind, const void *q, const void *s, const void *m,
                                                           const uint16_t *x, uint16_t *y, int64_t ldy, int rows,
                                                           int out, int in, int g0, int g1, int kernel) {
    uint16_t *wide = fl_q8_scratch((size_t)in * FL_GROUP);
    if (wide == NULL) return -1;
    for (int g = g0; g < g1; g++) {
        int j0 = g * FL_GROUP, n = out - j0 < FL_GROUP ? out - j0 : FL_GROUP;
        fl_quant_widen_one(kind, q, s, m, wide, in, g, kernel != FL_Q8_ON_AVX2);
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

/* Groups [g0, g1) of a `kind` weight widened into pack_bf16's layout at dst (the whole packed bf16 weight), on
 * AVX-512 BF16 or AVX2. */
__attribute__((unused)) static void fl_quant_widen_groups(int kind, const void *q, const void *s, const void *m,
                                                          uint16_t *dst, int in, int g0, int g1, int native) {
    for (int g = g0; g < g1; g++) fl_quant_widen_one(kind, q, s, m, dst + (size_t)g * FL_GROUP * in, in, g, native);
}

/* ---- Integer dot products on AVX2 hosts (no AVX-512): fl_quant_rows_scalar, then fl_quant_groups_avx2 ------- */

/* fl_quant_rows in plain C (the same values: the scale and its inverse in float32, nearest-even rounding). */
__attribute__((unused)) static void fl_quant_rows_scalar(int kind, const uint16_t *x, int rows, int in, void *xq,
                                                         float *xs, float *xsum) {
    const float limit = kind == FL_QUANT_Q4_1 ? 127.0f : 32767.0f;
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < in / FL_Q8_BLOCK; b++) {
            const size_t at = (size_t)r * in + (size_t)b * FL_Q8_BLOCK;
            float v[FL_Q8_BLOCK], amax = 0.0f;
            for (int i = 0; i < FL_Q8_BLOCK; i++) {
                uint32_t bits = (uint32_t)x[at + i] << 16;
                memcpy(&v[i], &bits, sizeof bits);
                amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
            }
            const float scale = amax / limit, inverse = amax > 0.0f ? limit / amax : 0.0f;
            int32_t total = 0;
            for (int i = 0; i < FL_Q8_BLOCK; i++) {
                int32_t q = (int32_t)nearbyintf(v[i] * inverse);
                total += q;
                if (kind == FL_QUANT_Q4_1)
                    ((int8_t *)xq)[at + i] = (int8_t)q;
                else
                    ((int16_t *)xq)[at + i] = (int16_t)q;
            }
            xs[(size_t)r * (in / FL_Q8_BLOCK) + b] = scale;
            if (xsum) xsum[(size_t)r * (in / FL_Q8_BLOCK) + b] = scale * (float)total;
        }
}

/* rows at a time: two feature chunks' accumulators for 4 rows, and the operands, in 16 registers */
#define FL_AVX2_DOT_RB 4
#define FL_AVX2_DOT_TARGET __attribute__((target("avx2,fma,f16c")))

/* sums[r][f0 .. f0 + 7] += acc[r] * scales[f0 ..] * row scale + (Q4_1) offsets[f0 ..] * the row's xsum. */
FL_AVX2_DOT_TARGET static inline __attribute__((always_inline)) void fl_avx2_dot_scale(
        float sums[][FL_GROUP], const __m256i *acc, __m256 scale, __m256 offset, const float *xs, const float *xsum,
        int blocks, int b, int f0, const int RB) {
    for (int r = 0; r < RB; r++) {
        __m256 total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]),
                                       _mm256_mul_ps(scale, _mm256_set1_ps(xs[(size_t)r * blocks + b])),
                                       _mm256_loadu_ps(sums[r] + f0));
        if (xsum) total = _mm256_fmadd_ps(offset, _mm256_set1_ps(xsum[(size_t)r * blocks + b]), total);
        _mm256_storeu_ps(sums[r] + f0, total);
    }
}

/* Rows [0, RB) of the quantised x against one group of a `kind` weight on AVX2, as fl_q8_dot_block and
 * fl_q4_dot_block: the same exact int32 sums per block and the same scaling, 8 features at a time.
 * - Q8_0: 8 features' pairs of int8 weights widened to int16, times a pair of the int16 row (VPMADDWD).
 * - Q4_1: 8 features' quads of 4-bit weights (a 32-byte load's low halves, and its high halves 16 features on),
 *   times a quad of the int8 row: VPMADDUBSW (15 * 127 * 2 stays far from its int16 saturation), then VPMADDWD
 *   by ones into the quad's int32 sum. */
FL_AVX2_DOT_TARGET static inline __attribute__((always_inline)) void fl_avx2_dot_block(
        const int kind, const void *group, const void *scales, const uint16_t *offsets, const void *xq,
        const float *xs, const float *xsum, int in, uint16_t *y, int64_t ldy, int n, const int RB) {
    float sums[FL_AVX2_DOT_RB][FL_GROUP];
    for (int r = 0; r < RB; r++)
        for (int j = 0; j < FL_GROUP; j++) sums[r][j] = 0.0f;
    const int blocks = in / FL_Q8_BLOCK;
    const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(0x0F);
    for (int b = 0; b < blocks; b++)
        for (int s = 0; s < 4; s++) {
            /* Q4_1: load s of each quad row holds features fa .. fa + 7 low, fa + 16 .. high; Q8_0: chunks s, s + 4 */
            const int fa = kind == FL_QUANT_Q4_1 ? (s % 2) * 8 + (s / 2) * 32 : 8 * s;
            const int fb = kind == FL_QUANT_Q4_1 ? fa + 16 : 8 * s + 32;
            __m256i acc_a[FL_AVX2_DOT_RB], acc_b[FL_AVX2_DOT_RB];
            for (int r = 0; r < RB; r++) acc_a[r] = acc_b[r] = _mm256_setzero_si256();
            if (kind == FL_QUANT_Q4_1) {
                for (int k = b * (FL_Q8_BLOCK / 4); k < (b + 1) * (FL_Q8_BLOCK / 4); k++) {
                    const uint8_t *qk = (const uint8_t *)group + (size_t)k * 128;
                    __m256i w = _mm256_loadu_si256((const __m256i *)(qk + 32 * s));
                    __m256i lo = _mm256_and_si256(w, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
                    for (int r = 0; r < RB; r++) {
                        int32_t quad;
                        memcpy(&quad, (const int8_t *)xq + (size_t)r * in + 4 * k, sizeof quad);
                        __m256i xb = _mm256_set1_epi32(quad);
                        acc_a[r] = _mm256_add_epi32(acc_a[r], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xb), ones));
                        acc_b[r] = _mm256_add_epi32(acc_b[r], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xb), ones));
                    }
                }
            } else {
                for (int k = b * (FL_Q8_BLOCK / 2); k < (b + 1) * (FL_Q8_BLOCK / 2); k++) {
                    const int8_t *qk = (const int8_t *)group + (size_t)k * 128;
                    __m256i wa = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qk + 2 * fa)));
                    __m256i wb = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qk + 2 * fb)));
                    for (int r = 0; r < RB; r++) {
                        int32_t pair;
                        memcpy(&pair, (const int16_t *)xq + (size_t)r * in + 2 * k, sizeof pair);
                        __m256i xb = _mm256_set1_epi32(pair);
                        acc_a[r] = _mm256_add_epi32(acc_a[r], _mm256_madd_epi16(wa, xb));
                        acc_b[r] = _mm256_add_epi32(acc_b[r], _mm256_madd_epi16(wb, xb));
                    }
                }
            }
            __m256 sa, sb, ma = _mm256_setzero_ps(), mb = _mm256_setzero_ps();
            const size_t at = (size_t)b * FL_GROUP;
            if (kind == FL_QUANT_Q4_1) {
                const uint16_t *st = (const uint16_t *)scales + at;
                sa = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(st + fa)));
                sb = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(st + fb)));
                ma = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(offsets + at + fa)));
                mb = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(offsets + at + fb)));
            } else {
                sa = _mm256_loadu_ps((const float *)scales + at + fa);
                sb = _mm256_loadu_ps((const float *)scales + at + fb);
            }
            const float *sum_rows = kind == FL_QUANT_Q4_1 ? xsum : NULL;
            fl_avx2_dot_scale(sums, acc_a, sa, ma, xs, sum_rows, blocks, b, fa, RB);
            fl_avx2_dot_scale(sums, acc_b, sb, mb, xs, sum_rows, blocks, b, fb, RB);
        }
    for (int r = 0; r < RB; r++) {
        uint16_t row[FL_GROUP];
        for (int j = 0; j < FL_GROUP; j += 8)
            _mm_storeu_si128((__m128i *)(row + j), fl_avx2_round(_mm256_loadu_ps(sums[r] + j)));
        memcpy(y + (size_t)r * ldy, row, (size_t)n * 2);
    }
}

/* Groups [g0, g1) of y [rows, ldy] = x @ w^T over a `kind` weight on AVX2, x as fl_quant_rows_scalar left it. */
FL_AVX2_DOT_TARGET __attribute__((unused)) static void fl_quant_groups_avx2(
        int kind, const void *q, const void *s, const void *m, const void *xq, const float *xs, const float *xsum,
        uint16_t *y, int64_t ldy, int rows, int out, int in, int g0, int g1) {
    const int blocks = in / FL_Q8_BLOCK, width = kind == FL_QUANT_Q4_1 ? 1 : 2;
    for (int g = g0; g < g1; g++) {
        const void *group = fl_quant_group(kind, q, in, g), *scales = fl_quant_params(kind, s, in, g);
        const uint16_t *offsets = (const uint16_t *)fl_quant_params(kind, m, in, g);
        int j0 = g * FL_GROUP, n = out - j0 < FL_GROUP ? out - j0 : FL_GROUP;
        for (int r = 0; r < rows; r += FL_AVX2_DOT_RB) {
            int rb = rows - r < FL_AVX2_DOT_RB ? rows - r : FL_AVX2_DOT_RB;
            const void *xr = (const uint8_t *)xq + (size_t)r * in * width;
            const float *sr = xs + (size_t)r * blocks, *mr = xsum ? xsum + (size_t)r * blocks : NULL;
            uint16_t *yr = y + (size_t)r * ldy + j0;
#define FL_AVX2_DOT(RB)                                                                                         \
            (kind == FL_QUANT_Q4_1                                                                              \
                 ? fl_avx2_dot_block(FL_QUANT_Q4_1, group, scales, offsets, xr, sr, mr, in, yr, ldy, n, RB)     \
                 : fl_avx2_dot_block(FL_QUANT_Q8_0, group, scales, NULL, xr, sr, NULL, in, yr, ldy, n, RB))
            switch (rb) {
                case 1: FL_AVX2_DOT(1); break;
                case 2: FL_AVX2_DOT(2); break;
                case 3: FL_AVX2_DOT(3); break;
                default: FL_AVX2_DOT(FL_AVX2_DOT_RB); break;
            }
#undef FL_AVX2_DOT
        }
    }
}

/* ---- Quantising a bf16 weight at load: quant.py's quantize_q8_0 / quantize_q4_1 and pack_*, in one pass ------- */

/* One group of FL_GROUP output features of w [out, in] bf16 (row-major; rows past `out` are zero) quantised and
 * written in the kernels' layouts (the header above): Q8_0's values q (the group's [in / 2][64][2] int8) and
 * float32 scales s; Q4_1's values q (the group's [in / 4][128] bytes, which must start zeroed: the halves are
 * OR-ed in), float16 steps s and offsets m; s and m the group's [in / 32][64]. Each block's arithmetic is
 * quant.py's, operation for operation and in float32, so the result is the torch quantiser's bit for bit (a
 * tied least value of -0 and +0 may give either offset; the weights they mean are equal): Q8_0's scale
 * max|w| / 127, q = round(w * (1 / scale)) clamped to +-127; Q4_1's step (max - min) / 15 and offset min, each
 * rounded to float16, q = round((w - offset) * (1 / step)) clamped to 0..15 (a zero scale or step: q = 0).
 * Rounding is to nearest-even; no FMA (the target holds none), so no product is fused with a sum.
 * Returns 1 if a Q4_1 step or offset is past float16's range (the caller raises), else 0. */
__attribute__((unused)) static int fl_quantiser_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}

__attribute__((target("avx2,f16c"))) static inline float fl_hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

__attribute__((target("avx2,f16c"))) static inline float fl_hmin8(__m256 v) {
    __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_min_ps(m, _mm_movehl_ps(m, m));
    m = _mm_min_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

/* 32 int32 in four vectors (each within int8's range) -> their 32 bytes in order. */
__attribute__((target("avx2,f16c"))) static inline __m256i fl_pack_bytes(const __m256i v[4]) {
    const __m256i words = _mm256_packs_epi32(v[0], v[1]), words2 = _mm256_packs_epi32(v[2], v[3]);
    /* lanes: [v0 0-3, v1 0-3, v2 0-3, v3 0-3 | v0 4-7, v1 4-7, v2 4-7, v3 4-7] as 4-byte runs */
    const __m256i bytes = _mm256_packs_epi16(words, words2);
    return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* A Q4_1 block's values placed on the grid of float16 step step_h from offset (0..15 steps): into qi, and the squared
 * distance of the block from the grid's values. In float32, each operation rounded on its own (no fused
 * multiply-add: this function's target has none) and summed in a fixed order, so that quant.py's torch ops, which
 * repeat them, get the same bits. */
__attribute__((target("avx2,f16c"))) static inline float fl_q4_place(const __m256 v[4], unsigned short step_h,
                                                                      float offset, __m256i qi[4]) {
    const float step = _cvtsh_ss(step_h);
    const __m256 inverse = _mm256_set1_ps(step > 0.0f ? 1.0f / step : 0.0f), off = _mm256_set1_ps(offset);
    const __m256 steps = _mm256_set1_ps(step);
    __m256 sum = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(v[i], off), inverse),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm256_min_ps(_mm256_max_ps(r, _mm256_setzero_ps()), _mm256_set1_ps(15.0f));
        qi[i] = _mm256_cvtps_epi32(r);
        const __m256 d = _mm256_sub_ps(v[i], _mm256_add_ps(_mm256_mul_ps(steps, r), off));
        sum = _mm256_add_ps(sum, _mm256_mul_ps(d, d));
    }
    float l[8];
    _mm256_storeu_ps(l, sum);
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

__attribute__((target("avx2,f16c"), unused)) static int fl_quantise_group(int kind, const uint16_t *w, int out,
                                                                          int in, int g, void *q, void *s, void *m,
                                                                          int grids) {
    const int blocks = in / FL_Q8_BLOCK;
    int overflow = 0;
    for (int b = 0; b < blocks; b++) {
        for (int f = 0; f < FL_GROUP; f++) {
            const int row = g * FL_GROUP + f;
            const size_t param = ((size_t)g * blocks + b) * FL_GROUP + f;
            __m256 v[4];
            if (row < out) {
                const uint16_t *src = w + (size_t)row * in + (size_t)b * FL_Q8_BLOCK;
                for (int i = 0; i < 4; i++)
                    v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(
                        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + 8 * i))), 16));
            } else {
                for (int i = 0; i < 4; i++) v[i] = _mm256_setzero_ps();
            }
            __m256i qi[4];
            if (kind == FL_QUANT_Q8_0) {
                const __m256 sign = _mm256_set1_ps(-0.0f);
                __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                         _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
                const float scale = fl_hmax8(a) / 127.0f;
                const __m256 inverse = _mm256_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
                ((float *)s)[param] = scale;
                for (int i = 0; i < 4; i++) {
                    __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                    r = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
                    qi[i] = _mm256_cvtps_epi32(r);
                }
                uint16_t pairs[FL_Q8_BLOCK / 2];
                _mm256_storeu_si256((__m256i *)pairs, fl_pack_bytes(qi));
                /* pair p of the block (inputs 2p, 2p + 1) of feature f: [in / 2][64][2] */
                uint16_t *dst = (uint16_t *)q + (size_t)g * FL_GROUP * in / 2 + (size_t)b * (FL_Q8_BLOCK / 2) * FL_GROUP + f;
                for (int p = 0; p < FL_Q8_BLOCK / 2; p++) dst[(size_t)p * FL_GROUP] = pairs[p];
            } else {
                const float low = fl_hmin8(_mm256_min_ps(_mm256_min_ps(v[0], v[1]), _mm256_min_ps(v[2], v[3])));
                const float high = fl_hmax8(_mm256_max_ps(_mm256_max_ps(v[0], v[1]), _mm256_max_ps(v[2], v[3])));
                /* Grids from the least value: the range in 15 steps, then in 14 (a Q4_K block often spans 14 of
                 * its steps, as llama.cpp's search sets them: on its own grid its values come back as they were)
                 * and, with ``grids`` (values known to lie on integer grids: a GPTQ, AWQ or compressed-tensors
                 * checkpoint's), in 13 down to 1, until a block is on one: each grid where it lies nearer the
                 * values by more than 1/1024 than the nearest before (quant.quantize_q4_1) */
                unsigned short step_h = _cvtss_sh((high - low) / 15.0f, _MM_FROUND_TO_NEAREST_INT);
                const unsigned short offset_h = _cvtss_sh(low, _MM_FROUND_TO_NEAREST_INT);
                if ((step_h & 0x7C00) == 0x7C00 || (offset_h & 0x7C00) == 0x7C00) overflow = 1;
                const float offset = _cvtsh_ss(offset_h);
                float best = fl_q4_place(v, step_h, offset, qi);
                /* (a block on a grid, but for bf16's rounding of its values, needs no other: a Q4_1 GGUF's, most of
                 * a Q4_K's; off it, the distance is some hundredth of the range squared) */
                const float on_grid = (high - low) * (high - low) * (1.0f / 4096.0f);
                for (int k = 14; k >= (grids ? 1 : 14) && best > on_grid; k--) {
                    const unsigned short step_k = _cvtss_sh((high - low) / (float)k, _MM_FROUND_TO_NEAREST_INT);
                    if ((step_k & 0x7C00) == 0x7C00) continue;
                    __m256i qk[4];
                    const float d = fl_q4_place(v, step_k, offset, qk);
                    if (d < best * (1.0f - 1.0f / 1024.0f)) {
                        best = d;
                        step_h = step_k;
                        for (int i = 0; i < 4; i++) qi[i] = qk[i];
                    }
                }
                ((uint16_t *)s)[param] = step_h;
                ((uint16_t *)m)[param] = offset_h;
                /* quad c (inputs 4c..4c + 3): its 256 values in the order (feature, input); value k goes to byte
                 * k % 64 (+ 64 from k = 128), its high half when k % 128 >= 64: feature f's four values to the
                 * four bytes from (4f) % 64 (+ 64), in one half */
                __m256i bytes = fl_pack_bytes(qi);
                if ((4 * f) % 128 >= 64) bytes = _mm256_slli_epi16(bytes, 4);  /* (values < 16: no bit crosses a byte) */
                uint32_t quads[FL_Q8_BLOCK / 4];
                _mm256_storeu_si256((__m256i *)quads, bytes);
                uint8_t *dst = (uint8_t *)q + (size_t)g * (in / 4) * 128 + (size_t)b * (FL_Q8_BLOCK / 4) * 128
                               + (4 * f) % 64 + (4 * f >= 128 ? 64 : 0);
                for (int c = 0; c < FL_Q8_BLOCK / 4; c++) {
                    uint32_t word;
                    memcpy(&word, dst + c * 128, 4);
                    word |= quads[c];
                    memcpy(dst + c * 128, &word, 4);
                }
            }
        }
    }
    return overflow;
}

#else

static int fl_q8_vnni_supported(void) { return 0; }
static void fl_quant_rows(int kind, const uint16_t *x, int rows, int in, void *xq, float *xs, float *xsum) {
    (void)kind; (void)x; (void)rows; (void)in; (void)xq; (void)xs; (void)xsum;
}
static void fl_quant_groups(int kind, const void *q, const void *s, const void *m, const void *xq, const float *xs,
                            const float *xsum, uint16_t *y, int64_t ldy, int rows, int out, int in, int g0, int g1) {
    (void)kind; (void)q; (void)s; (void)m; (void)xq; (void)xs; (void)xsum; (void)y; (void)ldy; (void)rows;
    (void)out; (void)in; (void)g0; (void)g1;
}
static int fl_quant_groups_widened(int kind, const void *q, const void *s, const void *m, const uint16_t *x,
                                   uint16_t *y, int64_t ldy, int rows, int out, int in, int g0, int g1, int kernel) {
    (void)kind; (void)q; (void)s; (void)m; (void)x; (void)y; (void)ldy; (void)rows; (void)out; (void)in; (void)g0;
    (void)g1; (void)kernel;
    return -1;
}
static void fl_quant_widen_groups(int kind, const void *q, const void *s, const void *m, uint16_t *dst, int in,
                                  int g0, int g1, int native) {
    (void)kind; (void)q; (void)s; (void)m; (void)dst; (void)in; (void)g0; (void)g1; (void)native;
}
static void fl_quant_rows_scalar(int kind, const uint16_t *x, int rows, int in, void *xq, float *xs, float *xsum) {
    (void)kind; (void)x; (void)rows; (void)in; (void)xq; (void)xs; (void)xsum;
}
static void fl_quant_groups_avx2(int kind, const void *q, const void *s, const void *m, const void *xq,
                                 const float *xs, const float *xsum, uint16_t *y, int64_t ldy, int rows, int out,
                                 int in, int g0, int g1) {
    (void)kind; (void)q; (void)s; (void)m; (void)xq; (void)xs; (void)xsum; (void)y; (void)ldy; (void)rows;
    (void)out; (void)in; (void)g0; (void)g1;
}
static int fl_quantiser_supported(void) { return 0; }
static int fl_quantise_group(int kind, const uint16_t *w, int out, int in, int g, void *q, void *s, void *m,
                             int grids) {
    (void)kind; (void)w; (void)out; (void)in; (void)g; (void)q; (void)s; (void)m; (void)grids;
    return 0;
}

#endif

#endif
