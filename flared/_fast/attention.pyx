# cython: language_level=3
"""Paged decode attention on the CPU over the KV cache in place (kernel in attention_kernel.h).

``decode_attention(q_ptr, k_ptr, v_ptr, out_ptr, slots_ptr, stride_slots, lens_ptr, rows, num_heads,
num_kv_heads, head_dim, num_slots, scale, window, bf16, threads)``: for each decode row r, its query
heads attend over the keys at slots[r, 0:lens[r]] (the last ``window`` of them when window > 0) of one
layer's K/V [num_kv_heads, num_slots, head_dim]; out [rows, num_heads, head_dim]. Raw data pointers
(``tensor.data_ptr()``), so a call costs about a microsecond.

Rules:
- The caller owns every check on the tensors (dtype float32 or bfloat16 throughout, contiguity, shapes,
  slots inside the cache, lifetime during the call); this module checks only the scalar arguments.
- Threads are OpenMP's over (row, kv head) tasks, the same runtime torch uses (see linear.pyx).
- A row with no visible key writes zeros.
- bfloat16 with head_dim a multiple of 32 on a CPU with AVX-512 BF16 (``BF16_FAST``) runs the VDPBF16PS task,
  which rounds the probabilities to bf16 before P @ V as torch's path does; otherwise the portable task.
"""

from cython.parallel cimport prange
from libc.stdint cimport int64_t, uint16_t, uintptr_t

cdef extern from "attention_kernel.h" nogil:
    int FL_ATTN_MAX_GROUP
    int FL_ATTN_MAX_DIM
    int FL_ATTN_HAVE_BF16
    void fl_decode_attention_task(const void *q, const void *k, const void *v, void *out, const int64_t *slots,
                                  int64_t stride_slots, int begin, int length, int row, int kv_head, int num_heads,
                                  int group, int head_dim, int64_t num_slots, float scale, int bf16, int kv_fp8)
    void fl_decode_attention_task_bf16(const uint16_t *q, const void *k, const void *v, uint16_t *out,
                                       const int64_t *slots, int64_t stride_slots, int begin, int length, int row,
                                       int kv_head, int num_heads, int group, int head_dim, int64_t num_slots,
                                       float scale, int kv_fp8)

cdef extern from "linear_kernel.h" nogil:
    int fl_bf16_supported()

MAX_GROUP = FL_ATTN_MAX_GROUP
MAX_HEAD_DIM = FL_ATTN_MAX_DIM
# bfloat16 with head_dim a multiple of 32 runs the AVX-512 BF16 task (attention_kernel.h) where the CPU has it.
BF16_FAST = bool(FL_ATTN_HAVE_BF16 and fl_bf16_supported())


def decode_attention(uintptr_t q_ptr, uintptr_t k_ptr, uintptr_t v_ptr, uintptr_t out_ptr, uintptr_t slots_ptr,
                     int64_t stride_slots, uintptr_t lens_ptr, int rows, int num_heads, int num_kv_heads,
                     int head_dim, int64_t num_slots, float scale, int window=0, bint bf16=False, int threads=1,
                     bint kv_fp8=False):
    """See the module docstring. ``lens_ptr`` points at int64 context lengths, one per row. ``kv_fp8``: K and V
    hold float8 e4m3 (kv_cache_dtype fp8), widened exactly as they are read; q and out stay float32 or bfloat16
    as ``bf16`` says."""
    if rows <= 0 or num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"decode_attention: bad shape rows={rows} heads={num_heads} kv_heads={num_kv_heads}")
    if num_heads // num_kv_heads > FL_ATTN_MAX_GROUP or not 0 < head_dim <= FL_ATTN_MAX_DIM:
        raise ValueError(f"decode_attention: group {num_heads // num_kv_heads} or head_dim {head_dim} too large")
    if 0 in (q_ptr, k_ptr, v_ptr, out_ptr, slots_ptr, lens_ptr):
        raise ValueError("decode_attention: null data pointer")
    cdef const int64_t *lens = <const int64_t *>lens_ptr
    cdef int group = num_heads // num_kv_heads
    cdef int num_tasks = rows * num_kv_heads
    cdef int task, row, length, begin
    cdef bint fast = bf16 and BF16_FAST and head_dim % 32 == 0
    if threads < 1:
        threads = 1
    for task in prange(num_tasks, nogil=True, num_threads=threads, schedule="dynamic"):
        row = task // num_kv_heads
        length = <int>lens[row]
        begin = 0
        if window > 0 and length > window:
            begin = length - window
        if fast:
            fl_decode_attention_task_bf16(<const uint16_t *>q_ptr, <const void *>k_ptr, <const void *>v_ptr,
                                          <uint16_t *>out_ptr, <const int64_t *>slots_ptr, stride_slots, begin,
                                          length, row, task % num_kv_heads, num_heads, group, head_dim, num_slots,
                                          scale, kv_fp8)
        else:
            fl_decode_attention_task(<const void *>q_ptr, <const void *>k_ptr, <const void *>v_ptr, <void *>out_ptr,
                                     <const int64_t *>slots_ptr, stride_slots, begin, length, row,
                                     task % num_kv_heads, num_heads, group, head_dim, num_slots, scale, bf16, kv_fp8)
