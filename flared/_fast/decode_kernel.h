/* Every decoder layer of a bf16 decode step in one call, for up to 64 rows on a CPU with AVX-512 BF16.
 *
 * The torch forward runs a decode layer as ~15 ops and 4 kernel calls; at one row each op costs a few
 * microseconds of dispatch, ~4 ms of SmolLM2's ~12 ms step (at 32 rows the ops' own work, ~4 ms of 44).
 * Here one OpenMP team runs all layers, with a barrier between the phases that need one (4 per layer):
 *
 *   1. each thread: x = rms_norm(h) into its own buffer (cheaper than a barrier)
 *   2. qkv = x @ Wqkv^T (+ bias)                           groups of 64 output features, claimed dynamically
 *   3. per (row, kv head): rope its q heads and its k head (after the Qwen3 per-head norm), write k and v
 *      into the row's KV slot, then attend over the row's context (attention_kernel.h)
 *   4. h += attn @ Wo^T (+ bias)                            groups
 *   5. each thread: x = rms_norm(h)
 *   6. act = silu(x @ Wgate^T) * (x @ Wup^T)                groups (a gate group and its up group together)
 *   7. h += act @ Wdown^T                                   groups
 *
 * Rounding follows the unfused torch ops step by step (each op's output rounded to bf16, arithmetic in
 * float32), so logits equal the torch path's except where an exp in silu rounds differently (one bf16
 * ulp of one activation, rarely): the tests compare the two paths.
 *
 * Layouts: h [rows, hidden]; KV [layers, kv_heads, slots, head_dim]; rope tables [positions, head_dim]
 * with the rotate-half sign folded into sin (decoder.py's rope_sin_signed); gather slots [rows, stride]
 * int64. Per layer, 9 addresses (0 = absent): attn_norm, qkv, qkv_bias, qk_norm ([heads + kv_heads,
 * head_dim]), o, o_bias, mlp_norm, gate_up ([2 * intermediate, hidden]: gate rows then up rows), down; the
 * four weights packed as linear_kernel.h says; then the Q8_0 scales (or Q4_1 steps) of qkv, o, gate_up and down,
 * then the Q4_1 offsets of the four: where a weight's scales are non-zero it is quantised as qlinear_kernel.h
 * says, Q4_1 where its offsets are non-zero too, else Q8_0 (its products the bf16 kernel's over the dequantised
 * weight, bit for bit, or the integer dots as linear.pyx runs them). intermediate must be a multiple of 64.
 *
 * Per-request LoRA adapters (lora_rows non-null): a row of adapter slot s >= 0 adds (x A^T) B^T to each
 * product its adapter targets, rounded as DecoderModel._lora rounds it: low = bf16(x A^T) over the adapter's
 * stacked A (a phase of its own before the product, per row), then per output feature bf16(low B^T) added to the
 * product (after its bias, before a residual add). lora_table [slots, num_layers, 4, 4] int64: for qkv, o,
 * gate_up and down in that order, (A^T address [in, R] bf16, R, parts address, part count; 0 parts: the adapter
 * leaves the product alone); a part is 5 int64: (first output feature, feature count, first column of low, one
 * past its last, B^T address [columns, feature count] bf16). lora_low [rows, lora_rank] is scratch, lora_rank
 * >= every R (at most FL_LORA_MAX_RANK).
 */
#ifndef FLARED_DECODE_KERNEL_H
#define FLARED_DECODE_KERNEL_H

#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "attention_kernel.h"
#include "linear_kernel.h"
#include "norm_kernel.h"
#include "qlinear_kernel.h"

#define FL_DEC_MAX_ROWS 64
#define FL_DEC_PTRS 17
#define FL_LORA_MAX_RANK 1024

typedef struct {
    int rows, hidden, num_heads, num_kv_heads, head_dim, intermediate, num_layers, window, threads;
    float eps, scale;
    int64_t num_slots, stride_slots;
    const int64_t *layer_ptrs; /* [num_layers, FL_DEC_PTRS] */
    const uint16_t *cos, *sin;
    const int64_t *positions, *write_slots, *gather_slots, *lens;
    void *k_cache, *v_cache; /* bf16, or float8 e4m3 with kv_fp8 (written to nearest even, saturated) */
    int kv_fp8;
    uint16_t *h;    /* [rows, hidden], updated in place */
    uint16_t *x;    /* [threads, rows, hidden] scratch */
    uint16_t *qkv;  /* [rows, (heads + 2 * kv_heads) * head_dim] */
    uint16_t *q;    /* [rows, heads * head_dim] */
    uint16_t *attn; /* [rows, heads * head_dim] */
    uint16_t *act;  /* [rows, intermediate] */
    const int32_t *lora_rows;   /* [rows] adapter slot, -1 none; 0: no adapter rows */
    const int64_t *lora_table;  /* [slots, num_layers, 4, 4] */
    uint16_t *lora_low;         /* [rows, lora_rank] */
    int lora_rank;
    /* Rows may be consecutive positions of one sequence (a speculative step's last token and drafts): phase 3
     * writes every row's k and v before any row attends (one more barrier a layer), so a row sees the keys of the
     * rows before it. 0: each (row, kv head) writes then attends at once (rows are distinct sequences). */
    int shared_sequences;
    /* The products run on AMX tiles (linear_kernel.h's fl_amx_group) where their inputs are a multiple of 32 wide, as
     * bf16_linear runs them (the same sums in the same order: the per-op path's results bit for bit). */
    int amx;
    /* How quantised weights multiply (linear.pyx's q8_linear / q4_linear pick the same for the same rows): 0 integer
     * dots over quantised rows (VNNI), 1 widened onto the AMX tiles, 2 widened into the AVX-512 BF16 kernel; Q8_0's
     * and Q4_1's. */
    int q8_path, q4_path;
    /* A number this call alone carries (the quantised rows a thread keeps are reused within one product only). */
    int64_t serial;
    int *failed;  /* set to 1 where a quantised product found no memory for its scratch (its outputs are garbage) */
} fl_decode_args_t;

#if FL_HAVE_X86

/* The calling thread's copy of a product's input rows quantised for the integer dots of a `kind` weight
 * (fl_quant_rows, with each block's xsum), made once a product (key: the call's serial, layer and product) and
 * reused for its other groups; NULL when out of memory. */
static const void *fl_dec_quant_rows(const fl_decode_args_t *a, int layer, int target, int kind, const uint16_t *x,
                                     int rows, int in, const float **xs, const float **xsum) {
    static __thread int16_t *xq_buf = NULL;  /* (int16 room: an int8 copy takes half) */
    static __thread float *xs_buf = NULL, *xsum_buf = NULL;
    static __thread size_t size = 0;
    static __thread int64_t key[3] = {-1, -1, -1};
    size_t need = (size_t)FL_DEC_MAX_ROWS * in;
    if (need > size) {
        int16_t *q = (int16_t *)realloc(xq_buf, need * sizeof(int16_t));
        if (q == NULL) return NULL;
        xq_buf = q;
        float *f = (float *)realloc(xs_buf, need / FL_Q8_BLOCK * sizeof(float));
        if (f == NULL) return NULL;
        xs_buf = f;
        f = (float *)realloc(xsum_buf, need / FL_Q8_BLOCK * sizeof(float));
        if (f == NULL) return NULL;
        xsum_buf = f;
        size = need;
        key[0] = -1;
    }
    if (key[0] != a->serial || key[1] != layer || key[2] != target) {
        fl_quant_rows(kind, x, rows, in, xq_buf, xs_buf, xsum_buf);
        key[0] = a->serial;
        key[1] = layer;
        key[2] = target;
    }
    *xs = xs_buf;
    *xsum = xsum_buf;
    return xq_buf;
}

/* Group g of a quantised product (Q4_1 with offsets, else Q8_0; the path a->q4_path or q8_path names) into tile
 * [rows, 64]; 0, or -1 out of memory. */
FL_Q8_TARGET static int fl_dec_quant_group(const fl_decode_args_t *a, int layer, int target, const void *q,
                                           const void *scales, const void *offsets, int g, const uint16_t *x,
                                           int rows, int in, uint16_t *tile) {
    const int kind = offsets ? FL_QUANT_Q4_1 : FL_QUANT_Q8_0;
    const int path = kind == FL_QUANT_Q4_1 ? a->q4_path : a->q8_path;
    if (path == 0) {
        const float *xs, *xsum;
        const void *xq = fl_dec_quant_rows(a, layer, target, kind, x, rows, in, &xs, &xsum);
        if (xq == NULL) return -1;
        fl_quant_groups(kind, fl_quant_group(kind, q, in, g), fl_quant_params(kind, scales, in, g),
                        fl_quant_params(kind, offsets, in, g), xq, xs, xsum, tile, FL_GROUP, rows, FL_GROUP, in, 0, 1);
        return 0;
    }
    uint16_t *wide = fl_q8_scratch((size_t)in * FL_GROUP);
    if (wide == NULL) return -1;
    fl_quant_widen_one(kind, q, scales, offsets, wide, in, g, 1);
    if (path == 1) {
        fl_amx_group(wide, x, in, tile, FL_GROUP, rows, in / 2, FL_GROUP);
        return 0;
    }
    fl_gemm_groups(wide, x, tile, FL_GROUP, rows, FL_GROUP, in, 0, 1);
    return 0;
}

/* Group g (output features 64g..) of x [rows, in] @ w^T, w packed (linear_kernel.h), into tile [rows, 64]; with
 * scales, w is quantised (qlinear_kernel.h): Q4_1 with those steps and offsets, else Q8_0 with those scales. */
FL_TARGET static void fl_dec_group(const fl_decode_args_t *a, int layer, int target, const uint16_t *packed,
                                   const void *scales, const void *offsets, int g, const uint16_t *x, int rows, int in,
                                   uint16_t *tile) {
    int amx = a->amx;
    if (scales) {
        if (fl_dec_quant_group(a, layer, target, packed, scales, offsets, g, x, rows, in, tile) != 0)
            __atomic_store_n(a->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    const uint16_t *group = packed + (size_t)g * FL_GROUP * in;
    if (amx && in % 32 == 0) {
        fl_amx_group(group, x, in, tile, FL_GROUP, rows, in / 2, FL_GROUP);
        return;
    }
    for (int r = 0; r < rows; r += FL_GEMM_RB)
        fl_gemm_rows(group, x + (size_t)r * in, in, tile + (size_t)r * FL_GROUP, FL_GROUP, in / 2,
                     rows - r < FL_GEMM_RB ? rows - r : FL_GEMM_RB, FL_GROUP);
}

/* The LoRA table's entry for adapter slot `slot`, layer `layer`, product `target` (0 qkv, 1 o, 2 gate_up, 3 down). */
static inline const int64_t *fl_lora_entry(const fl_decode_args_t *a, int slot, int layer, int target) {
    return a->lora_table + (((size_t)slot * a->num_layers + layer) * 4 + target) * 4;
}

/* Row r's low = bf16(x[r] @ A^T) for `target`, where its adapter has a term there (float32 sums in input order). */
FL_TARGET static void fl_dec_lora_low(const fl_decode_args_t *a, int layer, int target, const uint16_t *x, int in,
                                      int r) {
    const int slot = a->lora_rows[r];
    if (slot < 0) return;
    const int64_t *e = fl_lora_entry(a, slot, layer, target);
    if (e[3] == 0) return;
    const uint16_t *at = (const uint16_t *)(uintptr_t)e[0];
    const int rank = (int)e[1];
    float acc[FL_LORA_MAX_RANK];
    for (int k = 0; k < rank; k++) acc[k] = 0.0f;
    const uint16_t *xr = x + (size_t)r * in;
    for (int i = 0; i < in; i++) {
        const float xi = fl_bf16_widen(xr[i]);
        const uint16_t *row = at + (size_t)i * rank;
        for (int k = 0; k < rank; k++) acc[k] += xi * fl_bf16_widen(row[k]);
    }
    uint16_t *low = a->lora_low + (size_t)r * a->lora_rank;
    for (int k = 0; k < rank; k++) low[k] = fl_bf16_round(acc[k]);
}

/* vals [rows, n] (row stride `stride`), output features col0.. of `target`: each adapter row's term added,
 * vals = bf16(vals + bf16(low B^T)), as the per-op path's y += term. */
FL_TARGET static void fl_dec_lora_add(const fl_decode_args_t *a, int layer, int target, int rows, int col0, int n,
                                      uint16_t *vals, size_t stride) {
    for (int r = 0; r < rows; r++) {
        const int slot = a->lora_rows[r];
        if (slot < 0) continue;
        const int64_t *e = fl_lora_entry(a, slot, layer, target);
        const int64_t *parts = (const int64_t *)(uintptr_t)e[2];
        const uint16_t *low = a->lora_low + (size_t)r * a->lora_rank;
        for (int64_t p = 0; p < e[3]; p++) {
            const int64_t *part = parts + 5 * p;
            const int first = (int)part[0], count = (int)part[1], begin = (int)part[2], end = (int)part[3];
            const uint16_t *bt = (const uint16_t *)(uintptr_t)part[4];
            const int lo = col0 > first ? col0 : first;
            const int hi = col0 + n < first + count ? col0 + n : first + count;
            if (lo >= hi) continue;
            float acc[FL_GROUP];
            for (int j = 0; j < hi - lo; j++) acc[j] = 0.0f;
            for (int k = 0; k < end - begin; k++) {
                const float lk = fl_bf16_widen(low[begin + k]);
                const uint16_t *brow = bt + (size_t)k * count + (lo - first);
                for (int j = 0; j < hi - lo; j++) acc[j] += lk * fl_bf16_widen(brow[j]);
            }
            uint16_t *v = vals + (size_t)r * stride + (lo - col0);
            for (int j = 0; j < hi - lo; j++)
                v[j] = fl_bf16_round(fl_bf16_widen(v[j]) + fl_bf16_widen(fl_bf16_round(acc[j])));
        }
    }
}

/* Group g of x @ w^T (+ bias, + each adapter row's LoRA term for `target`): into y [rows, out], or, with
 * residual, y += that (rounded as separate ops). */
FL_TARGET static void fl_dec_linear(const fl_decode_args_t *a, int layer, int target, const uint16_t *packed,
                                    const void *scales, const void *offsets, const uint16_t *bias, const uint16_t *x,
                                    uint16_t *y, int residual, int rows, int out, int in, int g) {
    uint16_t tile[FL_DEC_MAX_ROWS * FL_GROUP];
    fl_dec_group(a, layer, target, packed, scales, offsets, g, x, rows, in, tile);
    int j0 = g * FL_GROUP, n = out - j0 < FL_GROUP ? out - j0 : FL_GROUP;
    if (bias)
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < n; j++) {
                uint16_t *v = tile + (size_t)r * FL_GROUP + j;
                *v = fl_bf16_round(fl_bf16_widen(*v) + fl_bf16_widen(bias[j0 + j]));
            }
    if (a->lora_rows) fl_dec_lora_add(a, layer, target, rows, j0, n, tile, FL_GROUP);
    for (int r = 0; r < rows; r++) {
        uint16_t *dst = y + (size_t)r * out + j0;
        const uint16_t *src = tile + (size_t)r * FL_GROUP;
        for (int j = 0; j < n; j++) dst[j] = residual ? fl_bf16_round(fl_bf16_widen(dst[j]) + fl_bf16_widen(src[j]))
                                                      : src[j];
    }
}

/* act[:, 64g:64g + 64] = silu(gate) * up (intermediate is a multiple of 64, so up's group is
 * intermediate / 64 + g); silu as torch computes it on bf16: x / (1 + exp(-x)) in float32, rounded. */
FL_TARGET static void fl_dec_gate_up(const fl_decode_args_t *a, int layer, const uint16_t *packed, const void *scales,
                                     const void *offsets, const uint16_t *x, uint16_t *act, int rows, int inter, int in,
                                     int g) {
    uint16_t gate[FL_DEC_MAX_ROWS * FL_GROUP], up[FL_DEC_MAX_ROWS * FL_GROUP];
    fl_dec_group(a, layer, 2, packed, scales, offsets, g, x, rows, in, gate);
    fl_dec_group(a, layer, 2, packed, scales, offsets, inter / FL_GROUP + g, x, rows, in, up);
    if (a->lora_rows) {
        fl_dec_lora_add(a, layer, 2, rows, g * FL_GROUP, FL_GROUP, gate, FL_GROUP);
        fl_dec_lora_add(a, layer, 2, rows, inter + g * FL_GROUP, FL_GROUP, up, FL_GROUP);
    }
    for (int r = 0; r < rows; r++) {
        const uint16_t *gr = gate + (size_t)r * FL_GROUP, *ur = up + (size_t)r * FL_GROUP;
        uint16_t *dst = act + (size_t)r * inter + (size_t)g * FL_GROUP;
        float s[FL_GROUP];
        for (int j = 0; j < FL_GROUP; j++) { /* vectorises (fl_attn_exp is plain arithmetic) */
            float v = fl_bf16_widen(gr[j]);
            s[j] = v / (1.0f + fl_attn_exp(-v));
        }
        for (int j = 0; j < FL_GROUP; j++)
            dst[j] = fl_bf16_round(fl_bf16_widen(fl_bf16_round(s[j])) * fl_bf16_widen(ur[j]));
    }
}

/* One head: optional per-head RMSNorm (norm_w != 0), then rope: out = x * cos + roll(x, d/2) * sin_signed,
 * rounded as torch's `addcmul(x * cos, x.roll(d / 2), sin)` (both products are exact in float32). */
FL_TARGET static void fl_dec_rope_head(const uint16_t *src, const uint16_t *norm_w, float eps, const uint16_t *cos,
                                       const uint16_t *sin, uint16_t *dst, int d) {
    uint16_t normed[FL_ATTN_MAX_DIM];
    if (norm_w) {
        float ss = 0.0f;
        for (int i = 0; i < d; i++) ss += fl_bf16_widen(src[i]) * fl_bf16_widen(src[i]);
        float inv = 1.0f / sqrtf(ss / (float)d + eps);
        for (int i = 0; i < d; i++) {
            float scaled = fl_bf16_widen(fl_bf16_round(fl_bf16_widen(src[i]) * inv));
            normed[i] = fl_bf16_round(scaled * fl_bf16_widen(norm_w[i]));
        }
        src = normed;
    }
    int half = d / 2;
    for (int i = 0; i < d; i++) {
        float t1 = fl_bf16_widen(fl_bf16_round(fl_bf16_widen(src[i]) * fl_bf16_widen(cos[i])));
        float rolled = fl_bf16_widen(src[i < half ? i + half : i - half]);
        dst[i] = fl_bf16_round(t1 + rolled * fl_bf16_widen(sin[i]));
    }
}

/* Phase 3 for one (row, kv head) of layer `layer`: rope and the KV write (`write`), the attention (`attend`). */
FL_TARGET static void fl_dec_attend(const fl_decode_args_t *a, int layer, int row, int kv_head, int write,
                                    int attend) {
    const int d = a->head_dim, nh = a->num_heads, nkv = a->num_kv_heads, group = nh / nkv;
    const int64_t *p = a->layer_ptrs + (size_t)layer * FL_DEC_PTRS;
    const uint16_t *qk_norm = (const uint16_t *)(uintptr_t)p[3];
    const int qkv_width = (nh + 2 * nkv) * d;
    const uint16_t *src = a->qkv + (size_t)row * qkv_width;
    const int64_t pos = a->positions[row];
    const uint16_t *cos = a->cos + pos * d, *sin = a->sin + pos * d;
    const int64_t layer_base = (int64_t)layer * nkv * a->num_slots;
    if (write) {
        for (int g = 0; g < group; g++) {
            int head = kv_head * group + g;
            fl_dec_rope_head(src + (size_t)head * d, qk_norm ? qk_norm + (size_t)head * d : 0, a->eps, cos, sin,
                             a->q + ((size_t)row * nh + head) * d, d);
        }
        const int64_t slot = (layer_base + (int64_t)kv_head * a->num_slots + a->write_slots[row]) * d;
        const uint16_t *k_src = src + (size_t)(nh + kv_head) * d, *v_src = src + (size_t)(nh + nkv + kv_head) * d;
        const uint16_t *k_norm = qk_norm ? qk_norm + (size_t)(nh + kv_head) * d : 0;
        if (a->kv_fp8) {
            uint16_t k_row[FL_ATTN_MAX_DIM];
            fl_dec_rope_head(k_src, k_norm, a->eps, cos, sin, k_row, d);
            uint8_t *k_dst = (uint8_t *)a->k_cache + slot, *v_dst = (uint8_t *)a->v_cache + slot;
            for (int i = 0; i < d; i++) {
                k_dst[i] = fl_fp8_from_float(fl_bf16_widen(k_row[i]));
                v_dst[i] = fl_fp8_from_float(fl_bf16_widen(v_src[i]));
            }
        } else {
            fl_dec_rope_head(k_src, k_norm, a->eps, cos, sin, (uint16_t *)a->k_cache + slot, d);
            memcpy((uint16_t *)a->v_cache + slot, v_src, (size_t)d * sizeof(uint16_t));
        }
    }
    if (!attend) return;
    int len = (int)a->lens[row];
    int begin = a->window > 0 && len > a->window ? len - a->window : 0;
    const int64_t layer_bytes = layer_base * d * (a->kv_fp8 ? 1 : 2);
    const void *k_layer = (const uint8_t *)a->k_cache + layer_bytes;
    const void *v_layer = (const uint8_t *)a->v_cache + layer_bytes;
    if (FL_ATTN_HAVE_BF16 && d % 32 == 0)
        fl_decode_attention_task_bf16(a->q, k_layer, v_layer, a->attn, a->gather_slots, a->stride_slots, begin, len,
                                      row, kv_head, nh, group, d, a->num_slots, a->scale, a->kv_fp8);
    else
        fl_decode_attention_task(a->q, k_layer, v_layer, a->attn, a->gather_slots, a->stride_slots, begin, len, row,
                                 kv_head, nh, group, d, a->num_slots, a->scale, 1, a->kv_fp8);
}

static void fl_decode_layers(const fl_decode_args_t *a) {
    const int rows = a->rows, hidden = a->hidden, d = a->head_dim;
    const int q_width = a->num_heads * d, qkv_width = (a->num_heads + 2 * a->num_kv_heads) * d;
    const int inter = a->intermediate;
    const int qkv_groups = (qkv_width + FL_GROUP - 1) / FL_GROUP;
    const int hidden_groups = (hidden + FL_GROUP - 1) / FL_GROUP;
    const int mlp_groups = inter / FL_GROUP;
    const int tasks = rows * a->num_kv_heads;
    const int lora = a->lora_rows != 0;
#pragma omp parallel num_threads(a->threads)
    {
        uint16_t *x = a->x + (size_t)omp_get_thread_num() * rows * hidden;
        for (int layer = 0; layer < a->num_layers; layer++) {
            const int64_t *p = a->layer_ptrs + (size_t)layer * FL_DEC_PTRS;
#define FL_PTR(i) ((const uint16_t *)(uintptr_t)p[i])
/* product i's quantisation: its scales (or steps) and offsets, as two arguments */
#define FL_QUANT(i) ((const void *)(uintptr_t)p[9 + (i)]), ((const void *)(uintptr_t)p[13 + (i)])
            fl_bf16_rms_norm(a->h, FL_PTR(0), x, rows, hidden, a->eps);
            if (lora) {
#pragma omp for schedule(dynamic)
                for (int r = 0; r < rows; r++) fl_dec_lora_low(a, layer, 0, x, hidden, r);
            }
#pragma omp for schedule(dynamic)
            for (int g = 0; g < qkv_groups; g++)
                fl_dec_linear(a, layer, 0, FL_PTR(1), FL_QUANT(0), FL_PTR(2), x, a->qkv, 0, rows, qkv_width, hidden,
                              g);
            if (a->shared_sequences) {
#pragma omp for schedule(dynamic)
                for (int t = 0; t < tasks; t++) fl_dec_attend(a, layer, t / a->num_kv_heads, t % a->num_kv_heads, 1, 0);
#pragma omp for schedule(dynamic)
                for (int t = 0; t < tasks; t++) fl_dec_attend(a, layer, t / a->num_kv_heads, t % a->num_kv_heads, 0, 1);
            } else {
#pragma omp for schedule(dynamic)
                for (int t = 0; t < tasks; t++) fl_dec_attend(a, layer, t / a->num_kv_heads, t % a->num_kv_heads, 1, 1);
            }
            if (lora) {
#pragma omp for schedule(dynamic)
                for (int r = 0; r < rows; r++) fl_dec_lora_low(a, layer, 1, a->attn, q_width, r);
            }
#pragma omp for schedule(dynamic)
            for (int g = 0; g < hidden_groups; g++)
                fl_dec_linear(a, layer, 1, FL_PTR(4), FL_QUANT(1), FL_PTR(5), a->attn, a->h, 1, rows, hidden, q_width,
                              g);
            fl_bf16_rms_norm(a->h, FL_PTR(6), x, rows, hidden, a->eps);
            if (lora) {
#pragma omp for schedule(dynamic)
                for (int r = 0; r < rows; r++) fl_dec_lora_low(a, layer, 2, x, hidden, r);
            }
#pragma omp for schedule(dynamic)
            for (int g = 0; g < mlp_groups; g++)
                fl_dec_gate_up(a, layer, FL_PTR(7), FL_QUANT(2), x, a->act, rows, inter, hidden, g);
            if (lora) {
#pragma omp for schedule(dynamic)
                for (int r = 0; r < rows; r++) fl_dec_lora_low(a, layer, 3, a->act, inter, r);
            }
#pragma omp for schedule(dynamic)
            for (int g = 0; g < hidden_groups; g++)
                fl_dec_linear(a, layer, 3, FL_PTR(8), FL_QUANT(3), 0, a->act, a->h, 1, rows, hidden, inter, g);
#undef FL_PTR
#undef FL_QUANT
        }
        if (a->amx)
            fl_amx_release();
    }
}

static int fl_decode_supported(void) { return fl_bf16_supported(); }

#else

static void fl_decode_layers(const fl_decode_args_t *a) { (void)a; }
static int fl_decode_supported(void) { return 0; }

#endif
#endif
