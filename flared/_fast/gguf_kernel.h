/* GGUF tensor blocks dequantised to float32 (flared/_fast/gguf.pyx; read by flared/model/loader.py).
 *
 * The formats are llama.cpp's (ggml-common.h): Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 in blocks of 32 values; the
 * k-quants Q2_K, Q3_K, Q4_K, Q5_K and Q6_K in super-blocks of 256; BF16. Each value is computed with the same
 * float32 operations, in the same order, as the `gguf` package's numpy dequantisers (gguf/quants.py), so the two
 * agree bit for bit (tests/model/test_gguf_dequantize.py holds them to it): a block's float16 scales widened
 * exactly, a sub-block's scale d * sc rounded once, then d * q rounded, then the offset added or taken away (never
 * fused into one rounding: the header is compiled without FMA). The loops are plain C over one block at a time;
 * gguf.pyx spreads runs of blocks over threads.
 */
#ifndef FLARED_GGUF_KERNEL_H
#define FLARED_GGUF_KERNEL_H

#include <stdint.h>
#include <string.h>

/* ggml's type ids */
#define FL_GGML_Q4_0 2
#define FL_GGML_Q4_1 3
#define FL_GGML_Q5_0 6
#define FL_GGML_Q5_1 7
#define FL_GGML_Q8_0 8
#define FL_GGML_Q2_K 10
#define FL_GGML_Q3_K 11
#define FL_GGML_Q4_K 12
#define FL_GGML_Q5_K 13
#define FL_GGML_Q6_K 14
#define FL_GGML_BF16 30

#define FL_QK_K 256

/* IEEE half -> float, exactly (normals, subnormals, infinities, NaN payloads). */
static inline float fl_gguf_half(const uint8_t *p) {
    const uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    uint32_t bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else {  /* subnormal: normalise */
        int e = -1;
        uint32_t m = mantissa;
        do {
            e++;
            m <<= 1;
        } while ((m & 0x400) == 0);
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Values and bytes a block of each type; 0 for a type this header does not take. */
static inline int fl_gguf_block_values(int type) {
    switch (type) {
        case FL_GGML_Q4_0: case FL_GGML_Q4_1: case FL_GGML_Q5_0: case FL_GGML_Q5_1: case FL_GGML_Q8_0: return 32;
        case FL_GGML_Q2_K: case FL_GGML_Q3_K: case FL_GGML_Q4_K: case FL_GGML_Q5_K: case FL_GGML_Q6_K: return FL_QK_K;
        case FL_GGML_BF16: return 1;
        default: return 0;
    }
}

static inline int fl_gguf_block_bytes(int type) {
    switch (type) {
        case FL_GGML_Q4_0: return 18;
        case FL_GGML_Q4_1: return 20;
        case FL_GGML_Q5_0: return 22;
        case FL_GGML_Q5_1: return 24;
        case FL_GGML_Q8_0: return 34;
        case FL_GGML_Q2_K: return 84;
        case FL_GGML_Q3_K: return 110;
        case FL_GGML_Q4_K: return 144;
        case FL_GGML_Q5_K: return 176;
        case FL_GGML_Q6_K: return 210;
        case FL_GGML_BF16: return 2;
        default: return 0;
    }
}

/* Q4_K's and Q5_K's eight 6-bit scales and mins from their 12 bytes. */
static inline void fl_gguf_scale_min(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int i = 0; i < 4; i++) {
        sc[i] = s[i] & 63;
        mn[i] = s[4 + i] & 63;
        sc[4 + i] = (s[8 + i] & 0x0F) | ((s[i] >> 2) & 0x30);
        mn[4 + i] = (s[8 + i] >> 4) | ((s[4 + i] >> 2) & 0x30);
    }
}

/* One block of `type` at b into y (fl_gguf_block_values(type) floats). */
static inline void fl_gguf_block(int type, const uint8_t *b, float *y) {
    switch (type) {
        case FL_GGML_Q4_0: {
            const float d = fl_gguf_half(b);
            for (int j = 0; j < 16; j++) {
                y[j] = d * (float)((int)(b[2 + j] & 0x0F) - 8);
                y[j + 16] = d * (float)((int)(b[2 + j] >> 4) - 8);
            }
            break;
        }
        case FL_GGML_Q4_1: {
            const float d = fl_gguf_half(b), m = fl_gguf_half(b + 2);
            for (int j = 0; j < 16; j++) {
                const float lo = d * (float)(b[4 + j] & 0x0F), hi = d * (float)(b[4 + j] >> 4);
                y[j] = lo + m;
                y[j + 16] = hi + m;
            }
            break;
        }
        case FL_GGML_Q5_0: case FL_GGML_Q5_1: {
            const int one = type == FL_GGML_Q5_1;
            const float d = fl_gguf_half(b), m = one ? fl_gguf_half(b + 2) : 0.0f;
            const uint8_t *h = b + (one ? 4 : 2), *qs = h + 4;
            const uint32_t qh = (uint32_t)h[0] | ((uint32_t)h[1] << 8) | ((uint32_t)h[2] << 16) | ((uint32_t)h[3] << 24);
            for (int j = 0; j < 32; j++) {
                const int low = j < 16 ? (qs[j] & 0x0F) : (qs[j - 16] >> 4);
                const int q = low | (int)(((qh >> j) & 1) << 4);
                if (one) {
                    const float p = d * (float)q;
                    y[j] = p + m;
                } else {
                    y[j] = d * (float)(q - 16);
                }
            }
            break;
        }
        case FL_GGML_Q8_0: {
            const float d = fl_gguf_half(b);
            for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)b[2 + j] * d;
            break;
        }
        case FL_GGML_Q2_K: {
            const uint8_t *scales = b, *qs = b + 16;
            const float d = fl_gguf_half(b + 80), dmin = fl_gguf_half(b + 82);
            for (int e = 0; e < FL_QK_K; e++) {
                const int j = e / 16, half = e / 128, shift = 2 * ((e % 128) / 32), l = e % 32;
                const float dl = d * (float)(scales[j] & 0x0F), ml = dmin * (float)(scales[j] >> 4);
                const float p = dl * (float)((qs[half * 32 + l] >> shift) & 3);
                y[e] = p - ml;
            }
            break;
        }
        case FL_GGML_Q3_K: {
            const uint8_t *hmask = b, *qs = b + 32, *s = b + 96;
            const float d = fl_gguf_half(b + 108);
            float dl[16];
            for (int i = 0; i < 16; i++) {
                const int low = (s[i % 8] >> (4 * (i / 8))) & 0x0F, high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
                dl[i] = d * (float)((int)(int8_t)(uint8_t)(low | (high << 4)) - 32);
            }
            for (int e = 0; e < FL_QK_K; e++) {
                const int half = e / 128, shift = 2 * ((e % 128) / 32), l = e % 32;
                const int ql = (qs[half * 32 + l] >> shift) & 3;
                const int qh = ((hmask[l] >> (e / 32)) & 1) ^ 1;
                y[e] = dl[e / 16] * (float)(ql - (qh << 2));
            }
            break;
        }
        case FL_GGML_Q4_K: case FL_GGML_Q5_K: {
            const float d = fl_gguf_half(b), dmin = fl_gguf_half(b + 2);
            uint8_t sc[8], mn[8];
            fl_gguf_scale_min(b + 4, sc, mn);
            const int five = type == FL_GGML_Q5_K;
            const uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
            for (int j = 0; j < 8; j++) {
                const float dj = d * (float)sc[j], mj = dmin * (float)mn[j];
                for (int l = 0; l < 32; l++) {
                    int q = (qs[(j / 2) * 32 + l] >> (4 * (j % 2))) & 0x0F;
                    if (five) q |= ((qh[l] >> j) & 1) << 4;
                    const float p = dj * (float)q;
                    y[j * 32 + l] = p - mj;
                }
            }
            break;
        }
        case FL_GGML_Q6_K: {
            const uint8_t *ql = b, *qh = b + 128;
            const int8_t *scales = (const int8_t *)(b + 192);
            const float d = fl_gguf_half(b + 208);
            for (int e = 0; e < FL_QK_K; e++) {
                const int half = e / 128;
                const int low = (ql[half * 64 + e % 64] >> (4 * ((e % 128) / 64))) & 0x0F;
                const int high = (qh[half * 32 + e % 32] >> (2 * ((e % 128) / 32))) & 3;
                const float dj = d * (float)scales[e / 16];
                y[e] = dj * (float)((low | (high << 4)) - 32);
            }
            break;
        }
        case FL_GGML_BF16: {
            const uint32_t bits = ((uint32_t)b[0] | ((uint32_t)b[1] << 8)) << 16;
            memcpy(y, &bits, 4);
            break;
        }
        default:
            break;
    }
}

/* float32 -> bf16 bits as torch's .to(torch.bfloat16) rounds: to nearest-even, any NaN to 0x7FC0. */
static inline uint16_t fl_gguf_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1)) >> 16);
}

/* Blocks [b0, b1) of a tensor of `type` at src into dst (dst[b0 * values ...]): float32, or with `bf16` the same
 * values rounded to bfloat16 (dst then uint16_t), so a bf16 export skips the float32 copy and its cast. */
static void fl_gguf_dequantize(int type, const uint8_t *src, void *dst, int64_t b0, int64_t b1, int bf16) {
    const int values = fl_gguf_block_values(type), bytes = fl_gguf_block_bytes(type);
    float block[FL_QK_K];
    for (int64_t i = b0; i < b1; i++) {
        if (!bf16) {
            fl_gguf_block(type, src + i * bytes, (float *)dst + i * values);
            continue;
        }
        fl_gguf_block(type, src + i * bytes, block);
        uint16_t *out = (uint16_t *)dst + i * values;
        for (int j = 0; j < values; j++) out[j] = fl_gguf_bf16(block[j]);
    }
}

#endif
