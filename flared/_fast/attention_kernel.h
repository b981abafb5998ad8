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

static inline void fl_attn_load_row(const void *base, int64_t index, int head_dim, int bf16, float *dst) {
    if (bf16) {
        /* Widen into integer lanes, then one copy: a per-element memcpy bit cast does not vectorise. */
        const uint16_t *p = (const uint16_t *)base + index * head_dim;
        uint32_t bits[FL_ATTN_MAX_DIM];
        for (int i = 0; i < head_dim; i++) bits[i] = (uint32_t)p[i] << 16;
        memcpy(dst, bits, (size_t)head_dim * sizeof(float));
    } else {
        memcpy(dst, (const float *)base + index * head_dim, (size_t)head_dim * sizeof(float));
    }
}

/* Sixteen independent partial sums: a plain `dot += a[i] * b[i]` is one serial chain of adds that the
 * compiler may not reorder (no -ffast-math), so it never vectorises; lanes of `part` do. */
static inline float fl_attn_dot(const float *a, const float *b, int n) {
    float part[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int u = 0; u < 16; u++) part[u] += a[i + u] * b[i + u];
    /* Pairwise lane folding: four dependent steps instead of a chain of sixteen adds. */
    for (int u = 0; u < 8; u++) part[u] += part[u + 8];
    for (int u = 0; u < 4; u++) part[u] += part[u + 4];
    float dot = (part[0] + part[2]) + (part[1] + part[3]);
    for (; i < n; i++) dot += a[i] * b[i];
    return dot;
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void fl_decode_attention_task(const void *q, const void *k, const void *v, void *out, const int64_t *slots,
                              int64_t stride_slots, int begin, int len, int row, int kv_head, int num_heads,
                              int group, int head_dim, int64_t num_slots, float scale, int bf16) {
    float qf[FL_ATTN_MAX_GROUP][FL_ATTN_MAX_DIM];
    float acc[FL_ATTN_MAX_GROUP][FL_ATTN_MAX_DIM];
    float s[FL_ATTN_MAX_GROUP][FL_ATTN_TILE];
    float m[FL_ATTN_MAX_GROUP], l[FL_ATTN_MAX_GROUP];
    float row_buf[FL_ATTN_MAX_DIM];
    const int64_t *row_slots = slots + (int64_t)row * stride_slots;
    const int64_t head_base = (int64_t)kv_head * num_slots;
    for (int g = 0; g < group; g++) {
        fl_attn_load_row(q, (int64_t)row * num_heads + kv_head * group + g, head_dim, bf16, qf[g]);
        for (int i = 0; i < head_dim; i++) {
            qf[g][i] *= scale;
            acc[g][i] = 0.0f;
        }
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    for (int t0 = begin; t0 < len; t0 += FL_ATTN_TILE) {
        int n = len - t0 < FL_ATTN_TILE ? len - t0 : FL_ATTN_TILE;
        for (int j = 0; j < n; j++) {
            fl_attn_load_row(k, head_base + row_slots[t0 + j], head_dim, bf16, row_buf);
            for (int g = 0; g < group; g++) s[g][j] = fl_attn_dot(qf[g], row_buf, head_dim);
        }
        for (int g = 0; g < group; g++) {
            float tile_max = s[g][0];
            for (int j = 1; j < n; j++) tile_max = s[g][j] > tile_max ? s[g][j] : tile_max;
            float m_new = tile_max > m[g] ? tile_max : m[g];
            float alpha = expf(m[g] - m_new); /* 0 on the first tile (m = -inf) */
            float sum = 0.0f;
            for (int j = 0; j < n; j++) {
                s[g][j] = expf(s[g][j] - m_new);
                sum += s[g][j];
            }
            l[g] = l[g] * alpha + sum;
            m[g] = m_new;
            for (int i = 0; i < head_dim; i++) acc[g][i] *= alpha;
        }
        for (int j = 0; j < n; j++) {
            fl_attn_load_row(v, head_base + row_slots[t0 + j], head_dim, bf16, row_buf);
            for (int g = 0; g < group; g++) {
                float p = s[g][j];
                for (int i = 0; i < head_dim; i++) acc[g][i] += p * row_buf[i];
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
