# cython: language_level=3
"""bf16 matrix products for decode-sized batches on CPUs with AVX-512 BF16 (kernel in linear_kernel.h).

``bf16_linear(weight_ptr, x_ptr, out_ptr, rows, out_features, in_features, threads)`` computes
out[rows, out_features] = x[rows, in_features] @ weight[out_features, in_features]^T from raw data
pointers (``tensor.data_ptr()``), so a call costs about a microsecond. All three arrays are bfloat16,
row-major and contiguous; accumulation is float32 and the output is rounded to nearest-even.

Rules:
- The caller checks ``BF16_SUPPORTED`` first and owns every check on the tensors (dtype, device,
  contiguity, shapes, lifetime during the call): this module only sees addresses.
- Threads are OpenMP's, and on purpose the same runtime as torch's: the module links libgomp.so.1, which
  the loader resolves to the copy torch already loaded (import torch first, as flared.model does). A
  pthread pool of our own measured slower in decode (SmolLM2 bf16: 40 vs 57 tok/s), because its threads
  and torch's spinning OpenMP workers then fight over the same cores.
- Output features are dealt out in chunks of CHUNK_FEATURES, claimed dynamically, so a thread that
  gets less CPU time (a shared machine) takes fewer chunks.
"""

from cython.parallel cimport prange
from libc.stdint cimport uint16_t, uintptr_t

cdef extern from "linear_kernel.h" nogil:
    int fl_bf16_supported()
    void fl_bf16_range(const uint16_t *w, const uint16_t *x, uint16_t *y, int rows, int out, int inp,
                       int j0, int j1)

# True when this CPU (and build) can run the kernel; when False, bf16_linear must not be called.
BF16_SUPPORTED = bool(fl_bf16_supported())
# 64 rows of a 576-wide bf16 weight are 72 KiB, ~3 us of streaming: fine enough to balance two
# threads on SmolLM2's smallest product (576 outputs, 9 chunks), coarse enough that claiming is free.
cdef enum:
    CHUNK_FEATURES = 64


def bf16_linear(uintptr_t weight_ptr, uintptr_t x_ptr, uintptr_t out_ptr, int rows, int out_features,
                int in_features, int threads=1):
    """out = x @ weight^T over ``threads`` threads (the calling one included); see the module docstring."""
    if not BF16_SUPPORTED:
        raise RuntimeError("bf16_linear: this CPU lacks AVX-512 BF16 (check BF16_SUPPORTED first)")
    if rows <= 0 or out_features <= 0 or in_features <= 0:
        raise ValueError(f"bf16_linear: empty shape rows={rows} out={out_features} in={in_features}")
    if weight_ptr == 0 or x_ptr == 0 or out_ptr == 0:
        raise ValueError("bf16_linear: null data pointer")
    cdef const uint16_t *w = <const uint16_t *>weight_ptr
    cdef const uint16_t *x = <const uint16_t *>x_ptr
    cdef uint16_t *y = <uint16_t *>out_ptr
    cdef int num_chunks = (out_features + CHUNK_FEATURES - 1) // CHUNK_FEATURES
    cdef int chunk
    if threads <= 1 or num_chunks == 1:
        with nogil:
            fl_bf16_range(w, x, y, rows, out_features, in_features, 0, out_features)
        return
    if threads > num_chunks:
        threads = num_chunks
    for chunk in prange(num_chunks, nogil=True, num_threads=threads, schedule="dynamic"):
        fl_bf16_range(w, x, y, rows, out_features, in_features, chunk * CHUNK_FEATURES,
                      min(chunk * CHUNK_FEATURES + CHUNK_FEATURES, out_features))
