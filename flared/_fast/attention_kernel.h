/* Paged decode attention on the CPU, reading keys and values in place.
 *
 * One task = one decode row and one kv head: the row's query-head group attends over the row's key
 * slots [begin, len) with an online softmax (running max, sum, weighted values in float32), tile by
 * tile, so no [rows, context] copy of the cache is ever made (the torch path gathers one; at 32 rows
 * of 600 tokens that copy is most of a decode step's attention time).
 *
 * Layouts (one layer): K, V [num_kv_heads, num_slots, head_dim]; q and out [rows, num_heads, head_dim];
 * slots [rows, stride_slots] int64 (a row's token t lives in slot slots[row * stride_slots + t]).
 * Element type float32 (bf16 == 0) or bfloat16 (bf16 == 1); bfloat16 output rounds to nearest-even.
 * K and V may instead be float8 e4m3 (kv_fp8 == 1: kv_cache_dtype fp8, one byte a value, no scale), widened
 * exactly as they are read (fl_fp8_values, fl_fp8x32_to_bf16); q and out keep their type.
 *
 * target_clones builds AVX-512, AVX2 and baseline copies; the loader picks one for this CPU.
 */
#ifndef FLARED_ATTENTION_KERNEL_H
#define FLARED_ATTENTION_KERNEL_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define FL_ATTN_MAX_GROUP 16
#define FL_ATTN_MAX_DIM 256
#define FL_ATTN_TILE 32

/* A row widened to float32 in a union (GNU C type punning: no memcpy call per row). */
typedef union {
    uint32_t bits[FL_ATTN_MAX_DIM];
    float values[FL_ATTN_MAX_DIM];
} fl_attn_row_t;

/* float32 to float8 e4m3 (fn), to nearest even, saturated at +-448 (as torch's path: clamp, then convert). */
static inline uint8_t fl_fp8_from_float(float x) {
    union { float f; uint32_t u; } v;
    v.f = x;
    uint8_t sign = (uint8_t)((v.u >> 24) & 0x80u);
    v.u &= 0x7FFFFFFFu;
    if (v.f != v.f) return sign | 0x7Fu;
    if (v.f >= 448.0f) return sign | 0x7Eu;
    if (v.f < 0.015625f) return sign | (uint8_t)nearbyintf(v.f * 512.0f); /* below 2^-6: steps of 2^-9 */
    uint32_t base = v.u >> 20, rest = v.u & 0xFFFFFu; /* exponent and 3 mantissa bits; the rest rounds */
    if (rest > 0x80000u || (rest == 0x80000u && (base & 1u))) base++;
    return sign | (uint8_t)(base - (120u << 3));
}

/* Row ``index`` of ``base`` as float32: float32 data in place, bfloat16 widened into ``buf``. */
static inline const float *fl_attn_row(const void *base, int64_t index, int head_dim, int bf16,
                                       fl_attn_row_t *buf) {
    if (!bf16) return (const float *)base + index * head_dim;
    const uint16_t *p = (const uint16_t *)base + index * head_dim;
    for (int i = 0; i < head_dim; i++) buf->bits[i] = (uint32_t)p[i] << 16;
    return buf->values;
}

/* Every float8 e4m3 byte's value, exactly (generated from torch's float8_e4m3fn: E >= 1 is 2^(E-7) (1 + M/8),
 * E == 0 is M * 2^-9; the NaN patterns 0x7f/0xff read as +-480, which no writer here or in torch's path
 * (kv_cache.to_storage) stores): the portable task widens a row by table, one load a value. */
static const float fl_fp8_values[256] = {
    0.0f, 0.001953125f, 0.00390625f, 0.005859375f, 0.0078125f, 0.009765625f, 0.01171875f, 0.013671875f,
    0.015625f, 0.017578125f, 0.01953125f, 0.021484375f, 0.0234375f, 0.025390625f, 0.02734375f, 0.029296875f,
    0.03125f, 0.03515625f, 0.0390625f, 0.04296875f, 0.046875f, 0.05078125f, 0.0546875f, 0.05859375f,
    0.0625f, 0.0703125f, 0.078125f, 0.0859375f, 0.09375f, 0.1015625f, 0.109375f, 0.1171875f,
    0.125f, 0.140625f, 0.15625f, 0.171875f, 0.1875f, 0.203125f, 0.21875f, 0.234375f,
    0.25f, 0.28125f, 0.3125f, 0.34375f, 0.375f, 0.40625f, 0.4375f, 0.46875f,
    0.5f, 0.5625f, 0.625f, 0.6875f, 0.75f, 0.8125f, 0.875f, 0.9375f,
    1.0f, 1.125f, 1.25f, 1.375f, 1.5f, 1.625f, 1.75f, 1.875f,
    2.0f, 2.25f, 2.5f, 2.75f, 3.0f, 3.25f, 3.5f, 3.75f,
    4.0f, 4.5f, 5.0f, 5.5f, 6.0f, 6.5f, 7.0f, 7.5f,
    8.0f, 9.0f, 10.0f, 11.0f, 12.0f, 13.0f, 14.0f, 15.0f,
    16.0f, 18.0f, 20.0f, 22.0f, 24.0f, 26.0f, 28.0f, 30.0f,
    32.0f, 36.0f, 40.0f, 44.0f, 48.0f, 52.0f, 56.0f, 60.0f,
    64.0f, 72.0f, 80.0f, 88.0f, 96.0f, 104.0f, 112.0f, 120.0f,
    128.0f, 144.0f, 160.0f, 176.0f, 192.0f, 208.0f, 224.0f, 240.0f,
    256.0f, 288.0f, 320.0f, 352.0f, 384.0f, 416.0f, 448.0f, 480.0f,
    -0.0f, -0.001953125f, -0.00390625f, -0.005859375f, -0.0078125f, -0.009765625f, -0.01171875f, -0.013671875f,
    -0.015625f, -0.017578125f, -0.01953125f, -0.021484375f, -0.0234375f, -0.025390625f, -0.02734375f, -0.029296875f,
    -0.03125f, -0.03515625f, -0.0390625f, -0.04296875f, -0.046875f, -0.05078125f, -0.0546875f, -0.05859375f,
    -0.0625f, -0.0703125f, -0.078125f, -0.0859375f, -0.09375f, -0.1015625f, -0.109375f, -0.1171875f,
    -0.125f, -0.140625f, -0.15625f, -0.171875f, -0.1875f, -0.203125f, -0.21875f, -0.234375f,
    -0.25f, -0.28125f, -0.3125f, -0.34375f, -0.375f, -0.40625f, -0.4375f, -0.46875f,
    -0.5f, -0.5625f, -0.625f, -0.6875f, -0.75f, -0.8125f, -0.875f, -0.9375f,
    -1.0f, -1.125f, -1.25f, -1.375f, -1.5f, -1.625f, -1.75f, -1.875f,
    -2.0f, -2.25f, -2.5f, -2.75f, -3.0f, -3.25f, -3.5f, -3.75f,
    -4.0f, -4.5f, -5.0f, -5.5f, -6.0f, -6.5f, -7.0f, -7.5f,
    -8.0f, -9.0f, -10.0f, -11.0f, -12.0f, -13.0f, -14.0f, -15.0f,
    -16.0f, -18.0f, -20.0f, -22.0f, -24.0f, -26.0f, -28.0f, -30.0f,
    -32.0f, -36.0f, -40.0f, -44.0f, -48.0f, -52.0f, -56.0f, -60.0f,
    -64.0f, -72.0f, -80.0f, -88.0f, -96.0f, -104.0f, -112.0f, -120.0f,
    -128.0f, -144.0f, -160.0f, -176.0f, -192.0f, -208.0f, -224.0f, -240.0f,
    -256.0f, -288.0f, -320.0f, -352.0f, -384.0f, -416.0f, -448.0f, -480.0f,
};

/* A K or V row as fl_attn_row gives it, or with ``fp8`` a float8 e4m3 row widened into ``buf``. */
static inline const float *fl_attn_kv_row(const void *base, int64_t index, int head_dim, int bf16, int fp8,
                                          fl_attn_row_t *buf) {
    if (!fp8) return fl_attn_row(base, index, head_dim, bf16, buf);
    const uint8_t *p = (const uint8_t *)base + index * head_dim;
    for (int i = 0; i < head_dim; i++) buf->values[i] = fl_fp8_values[p[i]];
    return buf->values;
}

/* e^x in float32 to ~2 ulp (Cody-Waite reduction, Cephes polynomial), in plain arithmetic (libm's expf
 * is a call per element: at 32 rows x 600 keys x 9 heads x 30 layers it was most of the kernel's time).
 * GCC does not vectorise loops of it (the clamps are control flow to it); the bf16 task has a 16-lane
 * form, fl_attn_exp16. Inputs below -87.3 give ~1e-38, not 0: every use multiplies a zero or a sum that
 * a real key dominates. */
static inline float fl_attn_exp(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void fl_decode_attention_task(const void *q, const void *k, const void *v, void *out, const int64_t *slots,
                              int64_t stride_slots, int begin, int len, int row, int kv_head, int num_heads,
                              int group, int head_dim, int64_t num_slots, float scale, int bf16, int kv_fp8) {
    float qf[FL_ATTN_MAX_GROUP][FL_ATTN_MAX_DIM];
    float acc[FL_ATTN_MAX_GROUP][FL_ATTN_MAX_DIM];
    float s[FL_ATTN_MAX_GROUP][FL_ATTN_TILE];
    float m[FL_ATTN_MAX_GROUP], l[FL_ATTN_MAX_GROUP];
    fl_attn_row_t row_buf;
    float kt[FL_ATTN_MAX_DIM][FL_ATTN_TILE];
    const int64_t *row_slots = slots + (int64_t)row * stride_slots;
    const int64_t head_base = (int64_t)kv_head * num_slots;
    for (int g = 0; g < group; g++) {
        const int64_t q_index = (int64_t)row * num_heads + kv_head * group + g;
        const float *qrow = fl_attn_row(q, q_index, head_dim, bf16, &row_buf);
        for (int i = 0; i < head_dim; i++) qf[g][i] = qrow[i];
        for (int i = 0; i < head_dim; i++) {
            qf[g][i] *= scale;
            acc[g][i] = 0.0f;
        }
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    for (int t0 = begin; t0 < len; t0 += FL_ATTN_TILE) {
        int n = len - t0 < FL_ATTN_TILE ? len - t0 : FL_ATTN_TILE;
        /* Scores as [group, TILE] = q [group, d] x K^T [d, TILE]: K's tile is stored transposed so the
         * innermost loop runs along the tile's keys (constant length, contiguous: one vector FMA each). */
        for (int j = 0; j < n; j++) {
            const float *krow = fl_attn_kv_row(k, head_base + row_slots[t0 + j], head_dim, bf16, kv_fp8, &row_buf);
            for (int i = 0; i < head_dim; i++) kt[i][j] = krow[i];
        }
        for (int j = n; j < FL_ATTN_TILE; j++)
            for (int i = 0; i < head_dim; i++) kt[i][j] = 0.0f;
        for (int g = 0; g < group; g++) {
            float sg[FL_ATTN_TILE] = {0};
            for (int i = 0; i < head_dim; i++) {
                float qv = qf[g][i];
                for (int j = 0; j < FL_ATTN_TILE; j++) sg[j] += qv * kt[i][j];
            }
            for (int j = 0; j < n; j++) s[g][j] = sg[j];
        }
        for (int g = 0; g < group; g++) {
            float tile_max = s[g][0];
            for (int j = 1; j < n; j++) tile_max = s[g][j] > tile_max ? s[g][j] : tile_max;
            float m_new = tile_max > m[g] ? tile_max : m[g];
            float alpha = fl_attn_exp(m[g] - m_new); /* ~0 on the first tile (m = -inf), times zeros */
            for (int j = 0; j < n; j++) s[g][j] = fl_attn_exp(s[g][j] - m_new);
            float sum = 0.0f;
            for (int j = 0; j < n; j++) sum += s[g][j];
            l[g] = l[g] * alpha + sum;
            m[g] = m_new;
            for (int i = 0; i < head_dim; i++) acc[g][i] *= alpha;
        }
        for (int j = 0; j < n; j++) {
            const float *vrow = fl_attn_kv_row(v, head_base + row_slots[t0 + j], head_dim, bf16, kv_fp8, &row_buf);
            for (int g = 0; g < group; g++) {
                float p = s[g][j];
                for (int i = 0; i < head_dim; i++) acc[g][i] += p * vrow[i];
            }
        }
    }
    for (int g = 0; g < group; g++) {
        float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f; /* no keys: zeros, never NaN */
        int64_t o = ((int64_t)row * num_heads + kv_head * group + g) * head_dim;
        if (bf16) {
            uint16_t *dst = (uint16_t *)out + o;
            for (int i = 0; i < head_dim; i++) dst[i] = fl_bf16_round(acc[g][i] * inv);
        } else {
            float *dst = (float *)out + o;
            for (int i = 0; i < head_dim; i++) dst[i] = acc[g][i] * inv;
        }
    }
}

/* The bfloat16 task on CPUs with AVX-512 BF16, head_dim a multiple of 32: VDPBF16PS multiplies the bf16
 * rows in place (no widening, no transposed copy of the K tile). Scores for 16 keys at a time: each key's
 * q.k as 16 partial sums, 16 such vectors reduced together into one vector of 16 scores. P @ V takes the
 * keys in pairs: the two V rows interleaved (unpacklo/hi) and the two probabilities rounded to bf16 (as
 * torch's path rounds probs to the value dtype before its bmm), so one VDPBF16PS adds both keys' terms
 * for 16 dimensions; the accumulators hold the dimensions in the interleaved order, undone at the end.
 * Same contract as fl_decode_attention_task with bf16 == 1; ~4x faster at 32 rows x 500 keys. A float8 pool's
 * rows (kv_fp8) widen to bf16 in registers (fl_fp8x32_to_bf16), exactly, and then take the same products. */
#if defined(__x86_64__) && \
    ((defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10))
#include <immintrin.h>
#define FL_ATTN_HAVE_BF16 1
#define FL_ATTN_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

/* r[j] = sum of t[j]'s 16 lanes, j < 16. */
FL_ATTN_BF16_TARGET static inline __m512 fl_attn_hsum16(const __m512 *t) {
    __m512 w[8], z[4];
    for (int i = 0; i < 8; i++) /* w[i]: key 2i in 128-bit lanes 0-1, key 2i+1 in lanes 2-3 */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; i++) /* z[i]: keys 4i..4i+3, one per 128-bit lane */
        z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(z[0], z[1]), _mm512_unpackhi_ps(z[0], z[1]));
    __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(z[2], z[3]), _mm512_unpackhi_ps(z[2], z[3]));
    __m512 r = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
    /* lane 4L + m of r holds key 4m + L */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, r);
}

/* fl_attn_exp on 16 lanes: the same reduction and polynomial, the power of two by VSCALEFPS. GCC did not
 * vectorise the scalar loop over a tile's 16 probabilities (16 scalar calls per query head and tile were
 * most of the task's instructions). */
FL_ATTN_BF16_TARGET static inline __m512 fl_attn_exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
    __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* 32 float8 e4m3 values at ``p`` as 32 bf16 (exact): E >= 1 by moving the exponent field (bias 7 -> 127),
 * zero and the subnormals (M * 2^-9) from a table, then the sign. */
FL_ATTN_BF16_TARGET static inline __m512i fl_fp8x32_to_bf16(const uint8_t *p) {
    static const uint16_t small[32] __attribute__((aligned(64))) = {
        0x0000, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};
    __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    __m512i mag = _mm512_and_si512(w, _mm512_set1_epi16(0x7F));
    __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
    __m512i sub = _mm512_permutexvar_epi16(mag, _mm512_load_si512((const void *)small));
    __m512i r = _mm512_mask_blend_epi16(_mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)), normal, sub);
    return _mm512_or_si512(r, _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8));
}

/* 32 values of a K or V row from element ``i``: bf16 as they are, float8 widened. */
FL_ATTN_BF16_TARGET static inline __m512i fl_attn_kv32(const void *row, int i, int kv_fp8) {
    if (kv_fp8) return fl_fp8x32_to_bf16((const uint8_t *)row + i);
    return _mm512_loadu_si512((const void *)((const uint16_t *)row + i));
}

FL_ATTN_BF16_TARGET
static void fl_decode_attention_task_bf16(const uint16_t *q, const void *k, const void *v, uint16_t *out,
                                          const int64_t *slots, int64_t stride_slots, int begin, int len, int row,
                                          int kv_head, int num_heads, int group, int head_dim, int64_t num_slots,
                                          float scale, int kv_fp8) {
    const int64_t kv_size = kv_fp8 ? 1 : 2; /* bytes a K/V element */
    const int chunks = head_dim / 32;
    const int64_t *row_slots = slots + (int64_t)row * stride_slots;
    const int64_t head_base = (int64_t)kv_head * num_slots;
    __m512bh qv[FL_ATTN_MAX_GROUP][FL_ATTN_MAX_DIM / 32];
    float acc[FL_ATTN_MAX_GROUP][FL_ATTN_MAX_DIM] __attribute__((aligned(64)));
    float m[FL_ATTN_MAX_GROUP], l[FL_ATTN_MAX_GROUP];
    uint32_t pairs[FL_ATTN_MAX_GROUP][8];
    __m512i kwide[16][FL_ATTN_MAX_DIM / 32]; /* kv_fp8: a tile's keys as bf16 */
    for (int g = 0; g < group; g++) {
        const uint16_t *qrow = q + ((int64_t)row * num_heads + kv_head * group + g) * head_dim;
        for (int c = 0; c < chunks; c++) qv[g][c] = (__m512bh)_mm512_loadu_si512((const void *)(qrow + 32 * c));
        for (int i = 0; i < head_dim; i++) acc[g][i] = 0.0f;
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (int t0 = begin; t0 < len; t0 += 16) {
        const int n = len - t0 < 16 ? len - t0 : 16;
        const __mmask16 valid = (__mmask16)((1u << n) - 1u);
        const uint8_t *krow[16], *vrow[16];
        for (int j = 0; j < 16; j++) { /* past the end: the last key again, masked out below */
            int64_t slot = row_slots[t0 + (j < n ? j : n - 1)];
            krow[j] = (const uint8_t *)k + (head_base + slot) * head_dim * kv_size;
            vrow[j] = (const uint8_t *)v + (head_base + slot) * head_dim * kv_size;
        }
        if (kv_fp8) /* the tile's keys widened once, not once per query head of the group */
            for (int j = 0; j < 16; j++)
                for (int c = 0; c < chunks; c++) kwide[j][c] = fl_fp8x32_to_bf16(krow[j] + 32 * c);
        for (int g = 0; g < group; g++) {
            __m512 t[16];
            for (int j = 0; j < 16; j++) {
                __m512 dot = _mm512_setzero_ps();
                for (int c = 0; c < chunks; c++)
                    dot = _mm512_dpbf16_ps(dot, (__m512bh)(kv_fp8 ? kwide[j][c] : fl_attn_kv32(krow[j], 32 * c, 0)),
                                           qv[g][c]);
                t[j] = dot;
            }
            __m512 scores = _mm512_mul_ps(fl_attn_hsum16(t), scale_v);
            scores = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), scores);
            float tile_max = _mm512_reduce_max_ps(scores);
            float m_new = tile_max > m[g] ? tile_max : m[g];
            float alpha = fl_attn_exp(m[g] - m_new); /* ~0 on the first tile (m = -inf), times zeros */
            __m512 pv = _mm512_maskz_mov_ps(valid, fl_attn_exp16(_mm512_sub_ps(scores, _mm512_set1_ps(m_new))));
            l[g] = l[g] * alpha + _mm512_reduce_add_ps(pv);
            m[g] = m_new;
            if (alpha != 1.0f)
                for (int i = 0; i < head_dim; i++) acc[g][i] *= alpha;
            _mm256_storeu_si256((__m256i *)pairs[g], (__m256i)_mm512_cvtneps_pbh(pv));
        }
        for (int jp = 0; 2 * jp < n; jp++) {
            const uint8_t *va = vrow[2 * jp], *vb = vrow[2 * jp + 1];
            for (int c = 0; c < chunks; c++) {
                __m512i a = fl_attn_kv32(va, 32 * c, kv_fp8);
                __m512i b = fl_attn_kv32(vb, 32 * c, kv_fp8);
                __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
                for (int g = 0; g < group; g++) {
                    __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pairs[g][jp]);
                    float *dst = acc[g] + 32 * c;
                    _mm512_store_ps(dst, _mm512_dpbf16_ps(_mm512_load_ps(dst), lo, pp));
                    _mm512_store_ps(dst + 16, _mm512_dpbf16_ps(_mm512_load_ps(dst + 16), hi, pp));
                }
            }
        }
    }
    for (int g = 0; g < group; g++) {
        float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f; /* no keys: zeros, never NaN */
        uint16_t *dst = out + ((int64_t)row * num_heads + kv_head * group + g) * head_dim;
        for (int c = 0; c < chunks; c++)
            for (int lane = 0; lane < 4; lane++)
                for (int i = 0; i < 4; i++) { /* accumulator lane 4L + i holds dimension 8L + i (+ 4: the hi half) */
                    dst[32 * c + 8 * lane + i] = fl_bf16_round(acc[g][32 * c + 4 * lane + i] * inv);
                    dst[32 * c + 8 * lane + 4 + i] = fl_bf16_round(acc[g][32 * c + 16 + 4 * lane + i] * inv);
                }
    }
}
#else
#define FL_ATTN_HAVE_BF16 0
#endif

#endif
