# cython: language_level=3
"""RMSNorm of bfloat16 rows on the CPU in one pass (kernel in norm_kernel.h).

``bf16_rms_norm(x_ptr, weight_ptr, out_ptr, rows, width, eps)``: out[r] = rms_norm(x[r]) * weight, all
bfloat16, contiguous, from raw data pointers; statistics in float32, rounded like the unfused ops. The
caller owns every check on the tensors (dtype, contiguity, shapes, lifetime during the call).
"""

from libc.stdint cimport int64_t, uint16_t, uintptr_t

cdef extern from "norm_kernel.h" nogil:
    void fl_bf16_rms_norm(const uint16_t *x, const uint16_t *weight, uint16_t *y, int64_t rows, int64_t width,
                          float eps)


def bf16_rms_norm(uintptr_t x_ptr, uintptr_t weight_ptr, uintptr_t out_ptr, int64_t rows, int64_t width,
                  float eps):
    """See the module docstring."""
    if rows <= 0 or width <= 0:
        raise ValueError(f"bf16_rms_norm: empty shape rows={rows} width={width}")
    if x_ptr == 0 or weight_ptr == 0 or out_ptr == 0:
        raise ValueError("bf16_rms_norm: null data pointer")
    with nogil:
        fl_bf16_rms_norm(<const uint16_t *>x_ptr, <const uint16_t *>weight_ptr, <uint16_t *>out_ptr, rows, width,
                         eps)
