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
 *
 * target_clones builds AVX-512, AVX2 and baseline copies; the loader picks one for this CPU.
 */
#ifndef FLARED_ATTENTION_KERNEL_H
#define FLARED_ATTENTION_KERNEL_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define FL_ATTN_MAX_GROUP 16
#define FL_ATTN_MAX_DIM 256
#define FL_ATTN_TILE 32

static inline uint16_t fl_attn_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* A row widened to float32 in a union (GNU C type punning: no memcpy call per row). */
typedef union {
    uint32_t bits[FL_ATTN_MAX_DIM];
    float values[FL_ATTN_MAX_DIM];
} fl_attn_row_t;

/* Row ``index`` of ``base`` as float32: float32 data in place, bfloat16 widened into ``buf``. */
static inline const float *fl_attn_row(const void *base, int64_t index, int head_dim, int bf16,
                                       fl_attn_row_t *buf) {
    if (!bf16) return (const float *)base + index * head_dim;
    const uint16_t *p = (const uint16_t *)base + index * head_dim;
    for (int i = 0; i < head_dim; i++) buf->bits[i] = (uint32_t)p[i] << 16;
    return buf->values;
}

/* e^x in float32 to ~2 ulp (Cody-Waite reduction, Cephes polynomial), in plain arithmetic so loops of
 * it vectorise (libm's expf is a call per element: at 32 rows x 600 keys x 9 heads x 30 layers it was
 * most of the kernel's time). Inputs below -87.3 give ~1e-38, not 0: every use multiplies a zero or
 * a sum that a real key dominates. */
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
                              int group, int head_dim, int64_t num_slots, float scale, int bf16) {
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
            const float *krow = fl_attn_row(k, head_base + row_slots[t0 + j], head_dim, bf16, &row_buf);
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
            for (int j = 0; j < n; j++) s[g][j] = fl_attn_exp(s[g][j] - m_new); /* vectorises */
            float sum = 0.0f;
            for (int j = 0; j < n; j++) sum += s[g][j];
            l[g] = l[g] * alpha + sum;
            m[g] = m_new;
            for (int i = 0; i < head_dim; i++) acc[g][i] *= alpha;
        }
        for (int j = 0; j < n; j++) {
            const float *vrow = fl_attn_row(v, head_base + row_slots[t0 + j], head_dim, bf16, &row_buf);
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
            for (int i = 0; i < head_dim; i++) dst[i] = fl_attn_f32_to_bf16(acc[g][i] * inv);
        } else {
            float *dst = (float *)out + o;
            for (int i = 0; i < head_dim; i++) dst[i] = acc[g][i] * inv;
        }
    }
}

#endif
