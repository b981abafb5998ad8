# cython: language_level=3
"""GGUF tensors dequantised to float32 in C (gguf_kernel.h): the `gguf` package's numpy dequantisers' values, bit
for bit, many times faster (docs/benchmarks.md, "GGUF export"). flared/model/loader.py takes these for the types in
``TYPES`` and the package's own for the rest (the IQ and ternary types, MXFP4).

``dequantize(type_id, data, values, threads, bf16=False)``: ``data`` the tensor's bytes (a C-contiguous numpy array,
such as GGUFReader's memory map), ``values`` how many values they hold; returns a new float32 array of that many
values, or with ``bf16`` a uint16 array of their bfloat16 bits (rounded as torch's .to(torch.bfloat16) rounds).
"""

import numpy as np

from cython.parallel cimport prange
from libc.stdint cimport int64_t, uint8_t

cdef extern from "gguf_kernel.h" nogil:
    int fl_gguf_block_values(int type)
    int fl_gguf_block_bytes(int type)
    void fl_gguf_dequantize(int type, const uint8_t *src, void *dst, int64_t b0, int64_t b1, int bf16)

# ggml type ids this module dequantises: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16
TYPES = frozenset((2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 30))
# blocks a task: small enough to spread a tensor over the threads, large enough to cost nothing to hand out
cdef int64_t _CHUNK = 256


def dequantize(int type_id, data, int64_t values, int threads=1, bint bf16=False):
    if type_id not in TYPES:
        raise ValueError(f"dequantize: ggml type {type_id} is not one this module takes")
    cdef int per_block = fl_gguf_block_values(type_id)
    cdef int block_bytes = fl_gguf_block_bytes(type_id)
    if values < 0 or values % per_block:
        raise ValueError(f"dequantize: {values} values are not whole blocks of {per_block}")
    cdef int64_t blocks = values // per_block
    cdef const uint8_t[::1] src = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if src.shape[0] != blocks * block_bytes:
        raise ValueError(f"dequantize: {src.shape[0]} bytes for {values} values of ggml type {type_id} "
                         f"(want {blocks * block_bytes})")
    out = np.empty(values, dtype=np.uint16 if bf16 else np.float32)
    if blocks == 0:
        return out
    cdef uint8_t[::1] dst_bytes = out.view(np.uint8)
    cdef void *dst = <void *>&dst_bytes[0]
    cdef int64_t chunks = (blocks + _CHUNK - 1) // _CHUNK, c, b0, b1
    if threads < 1:
        threads = 1
    for c in prange(chunks, nogil=True, num_threads=threads, schedule="dynamic"):
        b0 = c * _CHUNK
        b1 = b0 + _CHUNK
        if b1 > blocks:
            b1 = blocks
        fl_gguf_dequantize(type_id, &src[0], dst, b0, b1, bf16)
    return out
