/* RMSNorm of bfloat16 rows on the CPU, rounding like the unfused ops (transformers' LlamaRMSNorm):
 * statistics in float32, x * rsqrt(mean(x^2) + eps) rounded to bf16, times the bf16 weight, rounded.
 * torch runs this as ~10 ops on bf16 tensors (conversions, pow, mean, rsqrt, muls): ~35 us per call, 61
 * calls per SmolLM2 decode step; this is one pass. */
#ifndef FLARED_NORM_KERNEL_H
#define FLARED_NORM_KERNEL_H

#include <math.h>
#include <stdint.h>

#include "bf16.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FL_NORM_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FL_NORM_CLONES
#endif

FL_NORM_CLONES
void fl_bf16_rms_norm(const uint16_t *x, const uint16_t *weight, uint16_t *y, int64_t rows, int64_t width,
                      float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * width;
        uint16_t *yr = y + r * width;
        float part[16] = {0};
        int64_t i = 0;
        for (; i + 16 <= width; i += 16)
            for (int u = 0; u < 16; u++) {
                float v = fl_bf16_widen(xr[i + u]);
                part[u] += v * v;
            }
        for (int u = 0; u < 8; u++) part[u] += part[u + 8];
        for (int u = 0; u < 4; u++) part[u] += part[u + 4];
        float ss = (part[0] + part[2]) + (part[1] + part[3]);
        for (; i < width; i++) {
            float v = fl_bf16_widen(xr[i]);
            ss += v * v;
        }
        float inv = 1.0f / sqrtf(ss / (float)width + eps);
        for (i = 0; i < width; i++) {
            float normed = fl_bf16_widen(fl_bf16_round(fl_bf16_widen(xr[i]) * inv));
            yr[i] = fl_bf16_round(normed * fl_bf16_widen(weight[i]));
        }
    }
}

#endif
