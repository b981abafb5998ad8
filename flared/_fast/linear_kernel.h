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
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

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

/* ---- The same products on CPUs with AVX2 and FMA but no AVX-512 BF16 (fl_gemm_groups_avx2) ----------------
 *
 * Same packed layout and results within the same bounds: each 32-bit word of a group holds a feature's input pair
 * (2k in its low half, 2k + 1 in its high half), so one shift and one mask widen a load of 8 words into the
 * 8 features' float32 weights for input 2k and for 2k + 1, exactly; two FMAs per row add them in (odd input
 * first, as VDPBF16PS does; the products of two bf16 values are exact in float32). 32 features (half a group)
 * by up to FL_AVX2_RB rows at a time keep the accumulators in 16 registers. Rounding to bf16 as above. From
 * FL_AVX2_MANY rows on, a group is widened once into float32 scratch instead (fl_avx2_many). */
#define FL_AVX2_TARGET __attribute__((target("avx2,fma")))
#define FL_AVX2_RB 2

__attribute__((unused)) static int fl_avx2_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* 8 float32 -> 8 bf16, round to nearest-even, NaN kept quiet. */
FL_AVX2_TARGET static inline __m128i fl_avx2_round(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    __m256i nan = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7f800000));  /* signed compare: mag < 2^31 */
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    /* the 8 low halves, in order */
    __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
    return _mm_packus_epi32(lo, hi);
}

/* Rows [0, RB) of x against features [h * 32, h * 32 + 32) of one packed group: y[r * ldy + i] for i < 32. */
FL_AVX2_TARGET static inline __attribute__((always_inline)) void fl_avx2_block(
        const uint16_t *group, int h, const uint16_t *x, int64_t ldx, uint16_t *y, int64_t ldy, int pairs,
        const int RB) {
    __m256 acc[4][FL_AVX2_RB];
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (int b = 0; b < 4; b++)
        for (int r = 0; r < RB; r++) acc[b][r] = _mm256_setzero_ps();
    for (int k = 0; k < pairs; k++) {
        const uint16_t *wk = group + (size_t)k * (2 * FL_GROUP) + 64 * h;
        __m256 xe[FL_AVX2_RB], xo[FL_AVX2_RB];
        for (int r = 0; r < RB; r++) {
            uint32_t pair;
            memcpy(&pair, x + (size_t)r * ldx + 2 * k, sizeof pair);
            xe[r] = _mm256_castsi256_ps(_mm256_set1_epi32((int)(pair << 16)));
            xo[r] = _mm256_castsi256_ps(_mm256_set1_epi32((int)(pair & 0xffff0000u)));
        }
        for (int b = 0; b < 4; b++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(wk + 16 * b));
            __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, high));
            for (int r = 0; r < RB; r++) {
                acc[b][r] = _mm256_fmadd_ps(wo, xo[r], acc[b][r]);
                acc[b][r] = _mm256_fmadd_ps(we, xe[r], acc[b][r]);
            }
        }
    }
    for (int r = 0; r < RB; r++)
        for (int b = 0; b < 4; b++)
            _mm_storeu_si128((__m128i *)(y + (size_t)r * ldy + 8 * b), fl_avx2_round(acc[b][r]));
}

/* Many rows (FL_AVX2_MANY or more: prefill chunks, wide decode steps): the widening is paid once a group, not once a
 * row pair. The group is widened into float32 [in][64] (scratch wf), each block of up to 6 rows of x into float32
 * (xf), and 6 rows by 16 features at a time accumulate in 12 registers, one FMA a weight a row, the inputs in
 * order. */
#define FL_AVX2_MANY 8
#define FL_AVX2_MB 6

FL_AVX2_TARGET static inline __attribute__((always_inline)) void fl_avx2_many_block(
        const float *wf, const float *xf, int in, uint16_t *tile, const int RB) {
    for (int s = 0; s < 4; s++) {
        __m256 acc[FL_AVX2_MB][2];
        for (int r = 0; r < RB; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        const float *w = wf + 16 * s;
        for (int i = 0; i < in; i++) {
            __m256 w0 = _mm256_loadu_ps(w + (size_t)i * FL_GROUP), w1 = _mm256_loadu_ps(w + (size_t)i * FL_GROUP + 8);
            for (int r = 0; r < RB; r++) {
                __m256 b = _mm256_broadcast_ss(xf + (size_t)r * in + i);
                acc[r][0] = _mm256_fmadd_ps(w0, b, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(w1, b, acc[r][1]);
            }
        }
        for (int r = 0; r < RB; r++) {
            _mm_storeu_si128((__m128i *)(tile + r * FL_GROUP + 16 * s), fl_avx2_round(acc[r][0]));
            _mm_storeu_si128((__m128i *)(tile + r * FL_GROUP + 16 * s + 8), fl_avx2_round(acc[r][1]));
        }
    }
}

/* One group against every row: y's columns [j0, j0 + n). wf: in * 64 floats, xf: 6 * in floats. */
FL_AVX2_TARGET static void fl_avx2_many(const uint16_t *group, const uint16_t *x, uint16_t *y, int64_t ldy,
                                        int rows, int in, int j0, int n, float *wf, float *xf) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (int k = 0; k < in / 2; k++)
        for (int b = 0; b < 8; b++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(group + (size_t)k * (2 * FL_GROUP) + 16 * b));
            _mm256_storeu_ps(wf + (size_t)(2 * k) * FL_GROUP + 8 * b, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
            _mm256_storeu_ps(wf + (size_t)(2 * k + 1) * FL_GROUP + 8 * b,
                             _mm256_castsi256_ps(_mm256_and_si256(v, high)));
        }
    uint16_t tile[FL_AVX2_MB * FL_GROUP];
    for (int r0 = 0; r0 < rows; r0 += FL_AVX2_MB) {
        int rb = rows - r0 < FL_AVX2_MB ? rows - r0 : FL_AVX2_MB;
        for (int r = 0; r < rb; r++)
            for (int i = 0; i < in; i++) xf[(size_t)r * in + i] = fl_bf16_widen(x[(size_t)(r0 + r) * in + i]);
        switch (rb) {
            case 1: fl_avx2_many_block(wf, xf, in, tile, 1); break;
            case 2: fl_avx2_many_block(wf, xf, in, tile, 2); break;
            case 3: fl_avx2_many_block(wf, xf, in, tile, 3); break;
            case 4: fl_avx2_many_block(wf, xf, in, tile, 4); break;
            case 5: fl_avx2_many_block(wf, xf, in, tile, 5); break;
            default: fl_avx2_many_block(wf, xf, in, tile, FL_AVX2_MB); break;
        }
        for (int r = 0; r < rb; r++)
            memcpy(y + (size_t)(r0 + r) * ldy + j0, tile + (size_t)r * FL_GROUP, (size_t)n * 2);
    }
}

/* A thread's scratch buffer (*buffer, *size bytes: the caller's thread-local pair) grown to at least `bytes` and
 * kept (the OpenMP threads live as long as the process; a call would otherwise pay a fresh mapping and its page
 * faults), or NULL when memory runs out. */
__attribute__((unused)) static void *fl_thread_scratch(void **buffer, size_t *size, size_t bytes) {
    if (bytes > *size) {
        void *grown = realloc(*buffer, bytes);
        if (grown == NULL) return NULL;
        *buffer = grown;
        *size = bytes;
    }
    return *buffer;
}

/* fl_avx2_many's scratch for `floats` floats, one a thread (fl_thread_scratch), or NULL. */
static float *fl_avx2_scratch(size_t floats) {
    static __thread void *buffer = NULL;
    static __thread size_t size = 0;
    return (float *)fl_thread_scratch(&buffer, &size, sizeof(float) * floats);
}

/* Groups [g0, g1) of y [rows, ldy] = x [rows, in] @ w^T, as fl_gemm_groups. */
FL_AVX2_TARGET __attribute__((unused)) static void fl_gemm_groups_avx2(const uint16_t *packed, const uint16_t *x, uint16_t *y, int64_t ldy,
                                               int rows, int out, int in, int g0, int g1) {
    if (rows >= FL_AVX2_MANY) {
        float *wf = fl_avx2_scratch((size_t)in * FL_GROUP + (size_t)FL_AVX2_MB * in);
        if (wf != NULL) {
            for (int g = g0; g < g1; g++) {
                int j0 = g * FL_GROUP, n = out - j0 < FL_GROUP ? out - j0 : FL_GROUP;
                fl_avx2_many(packed + (size_t)g * FL_GROUP * in, x, y, ldy, rows, in, j0, n, wf,
                             wf + (size_t)in * FL_GROUP);
            }
            return;
        }  /* out of memory: the pairs kernel below needs none */
    }
    uint16_t tile[FL_AVX2_RB * 32];
    for (int g = g0; g < g1; g++) {
        const uint16_t *group = packed + (size_t)g * FL_GROUP * in;
        for (int h = 0; h < 2; h++) {
            int j0 = g * FL_GROUP + 32 * h;
            if (j0 >= out) break;
            int n = out - j0 < 32 ? out - j0 : 32;
            for (int r = 0; r < rows; r += FL_AVX2_RB) {
                int rb = rows - r < FL_AVX2_RB ? rows - r : FL_AVX2_RB;
                uint16_t *dst = n == 32 ? y + (size_t)r * ldy + j0 : tile;
                int64_t ld = n == 32 ? ldy : 32;
                if (rb == 1)
                    fl_avx2_block(group, h, x + (size_t)r * in, in, dst, ld, in / 2, 1);
                else
                    fl_avx2_block(group, h, x + (size_t)r * in, in, dst, ld, in / 2, FL_AVX2_RB);
                if (n != 32)
                    for (int i = 0; i < rb; i++)
                        memcpy(y + (size_t)(r + i) * ldy + j0, tile + (size_t)i * 32, (size_t)n * 2);
            }
        }
    }
}

/* ---- The same products with AMX tiles (Intel Sapphire Rapids and later: fl_gemm_groups_amx) ----------------
 *
 * The packed layout is AMX's own for a TDPBF16PS B tile: 16 input pairs (rows, 256 bytes apart) by 16 features
 * (64 bytes: each feature's pair) is one tileloadd of a group's quarter. x rows load as an A tile (up to 16 rows of
 * 32 inputs), and four C tiles (16 features each) accumulate a group's 64 float32 columns for those rows, the inputs
 * 32 at a time; then each row is rounded to bf16 as above. Float32 sums of exact bf16 products, as VDPBF16PS's, in
 * another order (so the last bit may differ from fl_gemm_groups'). Needs `in` a multiple of 32, a CPU with AMX-TILE
 * and AMX-BF16, and the kernel's leave for this process to use the tiles' state (fl_amx_supported asks for it
 * once: arch_prctl ARCH_REQ_XCOMP_PERM). The tile configuration is the calling thread's: fl_gemm_groups_amx
 * loads it and releases the tiles before it returns. */
#include <sys/syscall.h>
#include <unistd.h>

#define FL_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
#define FL_AMX_ROWS 16

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} fl_amx_config;

/* 1 when AMX tiles may be used here (CPUID: AMX-TILE and AMX-BF16; the kernel granted the tile data state), else 0;
   asked once a process (the grant is process-wide). */
/* 1 when the CPU has AMX-TILE and AMX-BF16 (CPUID leaf 7, EDX bits 24 and 22) beside AVX-512 BF16, else 0. */
__attribute__((unused)) static int fl_amx_cpu(void) {
    unsigned int eax, ebx, ecx, edx;
    __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    return ((edx >> 24) & 1) && ((edx >> 22) & 1) && fl_bf16_supported();
}

__attribute__((unused)) static int fl_amx_supported(void) {
    static int known = -1;
    if (known < 0)
        known = fl_amx_cpu() &&
                syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    return known;
}

FL_AMX_TARGET static void fl_amx_configure(int rows) {
    fl_amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 4; t++) {  /* C: rows x 16 float32 */
        cfg.rows[t] = (uint8_t)rows;
        cfg.colsb[t] = 64;
    }
    cfg.rows[4] = (uint8_t)rows;  /* A: rows x 32 bf16 */
    cfg.colsb[4] = 64;
    cfg.rows[5] = 16;  /* B: 16 input pairs x 16 features */
    cfg.colsb[5] = 64;
    _tile_loadconfig(&cfg);
}

/* Rows [0, rows) (rows <= FL_AMX_ROWS, the configured count) of x against one group: c[r][0..63] float32. */
FL_AMX_TARGET static void fl_amx_block(const uint16_t *group, const uint16_t *x, int64_t ldx, float *c, int pairs) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int k = 0; k < pairs; k += 16) {
        const uint16_t *wk = group + (size_t)k * (2 * FL_GROUP);
        _tile_loadd(4, x + 2 * k, ldx * 2);
        _tile_loadd(5, wk, 4 * FL_GROUP);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(5, wk + 32, 4 * FL_GROUP);
        _tile_dpbf16ps(1, 4, 5);
        _tile_loadd(5, wk + 64, 4 * FL_GROUP);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(5, wk + 96, 4 * FL_GROUP);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, c, FL_GROUP * 4);
    _tile_stored(1, c + 16, FL_GROUP * 4);
    _tile_stored(2, c + 32, FL_GROUP * 4);
    _tile_stored(3, c + 48, FL_GROUP * 4);
}

/* The row count the calling thread's tiles are configured for (0: released). */
static __thread int fl_amx_rows;

/* Rows [0, rows) of x (row stride ldx) against one group, rounded to bf16 into y (row stride ldy), its first n
   columns: 16-row blocks, the tiles reconfigured when a block's row count changes (kept until fl_amx_release). */
FL_AMX_TARGET __attribute__((unused)) static void fl_amx_group(const uint16_t *group, const uint16_t *x, int64_t ldx,
                                                               uint16_t *y, int64_t ldy, int rows, int pairs, int n) {
    float c[FL_AMX_ROWS * FL_GROUP];
    for (int r = 0; r < rows; r += FL_AMX_ROWS) {
        int m = rows - r < FL_AMX_ROWS ? rows - r : FL_AMX_ROWS;
        if (m != fl_amx_rows) {
            fl_amx_configure(m);
            fl_amx_rows = m;
        }
        fl_amx_block(group, x + (size_t)r * ldx, ldx, c, pairs);
        for (int i = 0; i < m; i++) {
            uint16_t *yr = y + (size_t)(r + i) * ldy;
            uint16_t tail[FL_GROUP];
            uint16_t *dst = n == FL_GROUP ? yr : tail;
            for (int b = 0; b < 4; b++)
                _mm256_storeu_si256((__m256i *)(dst + 16 * b), fl_gemm_round(_mm512_loadu_ps(c + i * FL_GROUP + 16 * b)));
            if (n != FL_GROUP)
                memcpy(yr, tail, (size_t)n * 2);
        }
    }
}

/* The calling thread's tiles released (before it returns to code that does not use them). */
FL_AMX_TARGET __attribute__((unused)) static void fl_amx_release(void) {
    if (fl_amx_rows) {
        _tile_release();
        fl_amx_rows = 0;
    }
}

/* Groups [g0, g1) of y [rows, ldy] = x [rows, in] @ w^T, as fl_gemm_groups (in % 32 == 0; fl_amx_supported()): each
   group over all its row blocks in turn, so its weights stay in cache across them. */
FL_AMX_TARGET __attribute__((unused)) static void fl_gemm_groups_amx(const uint16_t *packed, const uint16_t *x,
                                                                     uint16_t *y, int64_t ldy, int rows, int out,
                                                                     int in, int g0, int g1) {
    for (int g = g0; g < g1; g++) {
        int j0 = g * FL_GROUP, n = out - j0 < FL_GROUP ? out - j0 : FL_GROUP;
        fl_amx_group(packed + (size_t)g * FL_GROUP * in, x, in, y + j0, ldy, rows, in / 2, n);
    }
    fl_amx_release();
}

/* The calling thread's SSE/AVX arithmetic flushes denormal results to zero (FTZ) and reads denormal inputs as
   zero (DAZ), bits 15 and 6 of MXCSR, or (flush 0) does not: x86 handles denormals in microcode, dozens of times
   slower. Returns 2 | whether both bits were set before (2: supported here). */
__attribute__((unused)) static int fl_flush_denormals(int flush) {
    unsigned int csr = _mm_getcsr();
    _mm_setcsr(flush ? (csr | 0x8040u) : (csr & ~0x8040u));
    return 2 | ((csr & 0x8040u) == 0x8040u);
}

#else  /* not x86-64 (or an old compiler): the caller keeps torch's path */

static int fl_flush_denormals(int flush) { (void)flush; return 0; }
static int fl_bf16_supported(void) { return 0; }
static int fl_amx_cpu(void) { return 0; }
static int fl_amx_supported(void) { return 0; }
static void fl_gemm_groups_amx(const uint16_t *packed, const uint16_t *x, uint16_t *y, int64_t ldy, int rows,
                               int out, int in, int g0, int g1) {
    (void)packed; (void)x; (void)y; (void)ldy; (void)rows; (void)out; (void)in; (void)g0; (void)g1;
}
static void fl_amx_release(void) {}
static int fl_avx2_supported(void) { return 0; }
static void fl_gemm_groups(const uint16_t *packed, const uint16_t *x, uint16_t *y, int64_t ldy, int rows,
                           int out, int in, int g0, int g1) {
    (void)packed; (void)x; (void)y; (void)ldy; (void)rows; (void)out; (void)in; (void)g0; (void)g1;
}
static void fl_gemm_groups_avx2(const uint16_t *packed, const uint16_t *x, uint16_t *y, int64_t ldy, int rows,
                                int out, int in, int g0, int g1) {
    (void)packed; (void)x; (void)y; (void)ldy; (void)rows; (void)out; (void)in; (void)g0; (void)g1;
}

#endif
#endif
