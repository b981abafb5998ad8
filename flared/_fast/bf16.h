/* bfloat16 <-> float32 for the CPU kernels (norm, attention, one-call decode), one copy.
 *
 * fl_bf16_widen is exact. fl_bf16_round rounds to nearest, ties to even, as torch converts; a NaN stays a
 * (quiet) NaN. Plain C on a union (GNU C type punning), so loops of it vectorise in any target. */
#ifndef FLARED_BF16_H
#define FLARED_BF16_H

#include <stdint.h>

typedef union {
    uint32_t bits;
    float value;
} fl_bf16_word_t;

static inline float fl_bf16_widen(uint16_t h) {
    fl_bf16_word_t w;
    w.bits = (uint32_t)h << 16;
    return w.value;
}

static inline uint16_t fl_bf16_round(float f) {
    fl_bf16_word_t w;
    w.value = f;
    if ((w.bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((w.bits >> 16) | 0x40u); /* quiet NaN */
    return (uint16_t)((w.bits + 0x7fffu + ((w.bits >> 16) & 1u)) >> 16);
}

#endif
