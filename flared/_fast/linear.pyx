# cython: language_level=3
"""bf16 matrix products on x86-64 CPUs, over packed weights (kernels in linear_kernel.h): AVX-512 BF16's
VDPBF16PS where the CPU has it, else AVX2 with FMA (the pairs widened to float32 by a shift and a mask).

``bf16_linear(packed_ptr, x_ptr, out_ptr, rows, out_features, in_features, threads)`` computes
out[rows, out_features] = x[rows, in_features] @ weight[out_features, in_features]^T, where ``packed_ptr``
holds the weight in linear_kernel.h's packed layout (``flared.model.decoder.pack_bf16`` makes it), from raw
data pointers (``tensor.data_ptr()``), so a call costs about a microsecond. x and out are bfloat16,
row-major and contiguous; accumulation is float32 and the output is rounded to nearest-even.

Rules:
- The caller checks ``BF16_SUPPORTED`` first and owns every check on the tensors (dtype, device,
  contiguity, shapes, the packed layout, lifetime during the call): this module only sees addresses.
- Threads are OpenMP's, and on purpose the same runtime as torch's: the module links libgomp.so.1, which
  the loader resolves to the copy torch already loaded (import torch first, as flared.model does). A
  pthread pool of our own measured slower in decode (SmolLM2 bf16: 40 vs 57 tok/s), because its threads
  and torch's spinning OpenMP workers then fight over the same cores.
- Work is dealt out in groups of GROUP_FEATURES output features, claimed dynamically, so a thread that
  gets less CPU time (a shared machine) takes fewer groups.
"""

import os

from cython.parallel cimport prange
from libc.stdint cimport int8_t, int16_t, int64_t, uint16_t, uint32_t, uintptr_t
from libc.stdlib cimport free, malloc

cdef extern from "linear_kernel.h" nogil:
    int FL_GROUP
    int fl_bf16_supported()
    int fl_avx2_supported()
    int fl_flush_denormals(int flush)
    void fl_gemm_groups(const uint16_t *packed, const uint16_t *x, uint16_t *y, int64_t ldy, int rows, int out,
                        int inp, int g0, int g1)
    void fl_gemm_groups_avx2(const uint16_t *packed, const uint16_t *x, uint16_t *y, int64_t ldy, int rows,
                             int out, int inp, int g0, int g1)
    int fl_amx_cpu()
    int fl_amx_supported()
    void fl_gemm_groups_amx(const uint16_t *packed, const uint16_t *x, uint16_t *y, int64_t ldy, int rows,
                            int out, int inp, int g0, int g1)

cdef extern from "qlinear_kernel.h" nogil:
    int FL_Q8_BLOCK
    int fl_q8_vnni_supported()
    int FL_QUANT_Q8_0, FL_QUANT_Q4_1
    void fl_quant_rows(int kind, const uint16_t *x, int rows, int inp, void *xq, float *xs, float *xsum)
    void fl_quant_groups(int kind, const void *q, const void *s, const void *m, const void *xq, const float *xs,
                         const float *xsum, uint16_t *y, int64_t ldy, int rows, int out, int inp, int g0, int g1)
    int FL_Q8_ON_AVX2, FL_Q8_ON_AVX512, FL_Q8_ON_AMX
    int fl_quant_groups_widened(int kind, const void *q, const void *s, const void *m, const uint16_t *x, uint16_t *y,
                                int64_t ldy, int rows, int out, int inp, int g0, int g1, int kernel)
    void fl_quant_widen_groups(int kind, const void *q, const void *s, const void *m, uint16_t *dst, int inp, int g0,
                               int g1, int native)
    void fl_quant_rows_scalar(int kind, const uint16_t *x, int rows, int inp, void *xq, float *xs, float *xsum)
    void fl_quant_groups_avx2(int kind, const void *q, const void *s, const void *m, const void *xq, const float *xs,
                              const float *xsum, uint16_t *y, int64_t ldy, int rows, int out, int inp, int g0, int g1)
    int fl_quantiser_supported()
    int fl_quantise_group(int kind, const uint16_t *w, int out, int inp, int g, void *q, void *s, void *m,
                          int grids)

# The kernel this CPU (and build) runs: "avx512_bf16", "avx2" or None (then bf16_linear must not be called).
# FLARED_AVX512=0 takes the AVX2 kernels on a CPU that has AVX-512 BF16 too (the tests of the AVX2 paths, the A/B).
KERNEL = ("avx512_bf16" if fl_bf16_supported() and os.environ.get("FLARED_AVX512", "1") != "0"
          else "avx2" if fl_avx2_supported() else None)
# True when some kernel runs here.
BF16_SUPPORTED = KERNEL is not None
cdef bint _native = KERNEL == "avx512_bf16"
# Output features per packed group (the packed weight's rows are padded to a multiple of this).
GROUP_FEATURES = FL_GROUP
# AMX tiles may run the products here (linear_kernel.h's fl_gemm_groups_amx: Sapphire Rapids and later, the tile
# state granted); products of at least amx_min_rows() rows (and inputs a multiple of 32) take them.
# FLARED_AMX=0 keeps the tiles off (the AVX-512 kernel everywhere) without asking for them. AMX_CPU: the CPU has
# them, whether or not they may be used here.
AMX_CPU = _native and bool(fl_amx_cpu())
AMX = AMX_CPU and os.environ.get("FLARED_AMX", "1") != "0" and bool(fl_amx_supported())
cdef int _amx_min_rows = 1 if AMX else 0  # (from one row: [16384, 2048] 1.3 ms against 2.3 for the AVX-512 kernel)


def amx_min_rows(int rows=-1):
    """The fewest rows a product takes the AMX tiles for (0: never); ``rows`` >= 0 sets it first (the A/B)."""
    global _amx_min_rows
    if rows >= 0:
        _amx_min_rows = rows if AMX else 0
    return _amx_min_rows


def bf16_linear(uintptr_t packed_ptr, uintptr_t x_ptr, uintptr_t out_ptr, int rows, int out_features,
                int in_features, int threads=1):
    """out = x @ weight^T over ``threads`` threads (the calling one included); see the module docstring."""
    if not BF16_SUPPORTED:
        raise RuntimeError("bf16_linear: this CPU has neither AVX-512 BF16 nor AVX2 (check BF16_SUPPORTED first)")
    if rows <= 0 or out_features <= 0 or in_features <= 0 or in_features % 2:
        raise ValueError(f"bf16_linear: bad shape rows={rows} out={out_features} in={in_features} (in must be even)")
    if packed_ptr == 0 or x_ptr == 0 or out_ptr == 0:
        raise ValueError("bf16_linear: null data pointer")
    cdef const uint16_t *w = <const uint16_t *>packed_ptr
    cdef const uint16_t *x = <const uint16_t *>x_ptr
    cdef uint16_t *y = <uint16_t *>out_ptr
    cdef int groups = (out_features + FL_GROUP - 1) // FL_GROUP
    cdef int g, t
    if _amx_min_rows and rows >= _amx_min_rows and in_features % 32 == 0:
        # each thread a contiguous run of groups (one tile configuration a thread)
        if threads > groups:
            threads = groups
        if threads <= 1:
            with nogil:
                fl_gemm_groups_amx(w, x, y, out_features, rows, out_features, in_features, 0, groups)
            return
        for t in prange(threads, nogil=True, num_threads=threads, schedule="static", chunksize=1):
            fl_gemm_groups_amx(w, x, y, out_features, rows, out_features, in_features, t * groups // threads,
                               (t + 1) * groups // threads)
        return
    if threads <= 1 or groups == 1:
        with nogil:
            if _native:
                fl_gemm_groups(w, x, y, out_features, rows, out_features, in_features, 0, groups)
            else:
                fl_gemm_groups_avx2(w, x, y, out_features, rows, out_features, in_features, 0, groups)
        return
    if threads > groups:
        threads = groups
    for g in prange(groups, nogil=True, num_threads=threads, schedule="dynamic"):
        if _native:
            fl_gemm_groups(w, x, y, out_features, rows, out_features, in_features, g, g + 1)
        else:
            fl_gemm_groups_avx2(w, x, y, out_features, rows, out_features, in_features, g, g + 1)


# Inputs a block of a quantised weight spans (Q8_0: one float32 scale a block; Q4_1: a float16 step and offset).
Q8_BLOCK = FL_Q8_BLOCK
# The quantised products' integer-dot kernels run here (AVX-512 VNNI beside AVX-512 BF16); else they widen the
# weights, or on an AVX2 host take its own integer dots (INTEGER_DOTS).
Q8_VNNI = _native and bool(fl_q8_vnni_supported())
# Which integer dots a quantised product of few rows takes: "vnni", "avx2" (VPMADDWD, and VPMADDUBSW for Q4_1's
# int8 rows: 3 instructions where VNNI takes 1, still bound by memory at a few rows), or None (widened always).
INTEGER_DOTS = "vnni" if Q8_VNNI else "avx2" if KERNEL == "avx2" else None
cdef bint _q8_dots = INTEGER_DOTS is not None
# On AVX2 hosts products of fewer rows than this take the dots, the rest the widened AVX2 bf16 kernel (whose cost a
# row is about the dots', and which widens a group once for all of a prefill chunk's rows).
cdef int _avx2_dot_rows = 16


def q8_vnni(int on=-1):
    """Whether quantised products of few rows take the integer dots (INTEGER_DOTS: fewer than q8_amx_min_rows() or,
    Q4_1, q4_amx_min_rows() rows with VNNI; fewer than 16 on AVX2 hosts), else they widen the weights into the bf16
    kernel; ``on`` 0 / 1 sets it first, where the CPU has them (the A/B and the tests)."""
    global _q8_dots
    if on >= 0:
        _q8_dots = INTEGER_DOTS is not None and on
    return bool(_q8_dots)


# The paths a quantised product takes (quant_path): the integer dots, or the weights widened for a bf16 kernel.
cdef int _DOTS = -1
_PATH_NAMES = {_DOTS: "dots", FL_Q8_ON_AMX: "amx", FL_Q8_ON_AVX512: "avx512", FL_Q8_ON_AVX2: "avx2"}


def quant_path(str fmt, int rows):
    """The path a product of ``rows`` rows over a ``fmt`` ("q8_0" or "q4_1") weight takes now: "dots" (the integer
    dots), or its weights widened for the bf16 kernel on "amx", "avx512" or "avx2". q8_linear / q4_linear and the
    one-call decode step (decode.pyx) all go by it, so that their results agree bit for bit."""
    return _PATH_NAMES[_path(FL_QUANT_Q4_1 if fmt == "q4_1" else FL_QUANT_Q8_0, rows)]


cdef int _path(int kind, int rows) noexcept:
    cdef int fewest = _q4_amx_min_rows if kind == FL_QUANT_Q4_1 else _q8_amx_min_rows
    cdef bint amx = fewest and rows >= fewest
    if _q8_dots and (rows < _avx2_dot_rows if not _native else not amx):
        return _DOTS
    if amx:
        return FL_Q8_ON_AMX
    return FL_Q8_ON_AVX512 if _native else FL_Q8_ON_AVX2
# Products of at least this many rows widen a Q8_0 weight onto the AMX tiles where the CPU has them (0: never): the
# integer dots stream the int8 weights at memory speed for a few rows, but their cost grows with each row as the bf16
# AVX-512 kernel's does; the tiles' does not. On 2 threads of an Intel Xeon with AMX (a [5632, 2048] matrix out of
# cache): dots 0.74 / 1.06 / 1.34 ms at 4 / 8 / 12 rows against the tiles' 1.16 / 1.23 / 1.27.
cdef int _q8_amx_min_rows = 10 if AMX else 0
# The same for Q4_1, whose dots (VPDPBUSD over int8 rows) take half the instructions: [14336, 4096] out of cache,
# dots 0.94 / 1.72 / 2.69 / 3.47 ms at 4 / 8 / 12 / 16 rows against the widened tiles' 3.13 / 3.09 / 3.31 / 3.33;
# [5632, 2048] in cache, 0.50 / 0.64 against 0.63 / 0.65 at 12 / 16 (q4_linear alone, 2 threads of an Intel Xeon).
cdef int _q4_amx_min_rows = 16 if AMX else 0


def q8_amx_min_rows(int rows=-1):
    """The fewest rows a Q8_0 product takes the AMX tiles for (0: never); ``rows`` >= 0 sets it first (the A/B)."""
    global _q8_amx_min_rows
    if rows >= 0:
        _q8_amx_min_rows = rows if AMX else 0
    return _q8_amx_min_rows


def q4_amx_min_rows(int rows=-1):
    """The fewest rows a Q4_1 product takes the AMX tiles for (0: never); ``rows`` >= 0 sets it first (the A/B)."""
    global _q4_amx_min_rows
    if rows >= 0:
        _q4_amx_min_rows = rows if AMX else 0
    return _q4_amx_min_rows


def q8_linear(uintptr_t q_ptr, uintptr_t scales_ptr, uintptr_t x_ptr, uintptr_t out_ptr, int rows,
              int out_features, int in_features, int threads=1):
    """out = x @ weight^T for an int8 weight in blocks of Q8_BLOCK inputs with a float32 scale each, packed by
    ``flared.model.quant.pack_q8_0`` (qlinear_kernel.h's layout, and how each path sums). x and out are bfloat16,
    row-major; ``in_features`` a multiple of Q8_BLOCK."""
    _quant_linear(FL_QUANT_Q8_0, "q8_linear", q_ptr, scales_ptr, 1, x_ptr, out_ptr, rows, out_features, in_features,
                  threads)


def q4_linear(uintptr_t q_ptr, uintptr_t steps_ptr, uintptr_t offsets_ptr, uintptr_t x_ptr, uintptr_t out_ptr,
              int rows, int out_features, int in_features, int threads=1):
    """out = x @ weight^T for a Q4_1 weight (4-bit values in blocks of Q8_BLOCK inputs, a float16 step and offset
    each) packed by ``flared.model.quant.pack_q4_1``; otherwise as q8_linear."""
    _quant_linear(FL_QUANT_Q4_1, "q4_linear", q_ptr, steps_ptr, offsets_ptr, x_ptr, out_ptr, rows, out_features,
                  in_features, threads)


cdef _quant_linear(int kind, str name, uintptr_t q_ptr, uintptr_t scales_ptr, uintptr_t offsets_ptr,
                   uintptr_t x_ptr, uintptr_t out_ptr, int rows, int out_features, int in_features, int threads):
    """A `kind` product (qlinear_kernel.h), by the path this row count takes; offsets_ptr is only read for Q4_1."""
    if not BF16_SUPPORTED:
        raise RuntimeError(f"{name}: this CPU has neither AVX-512 BF16 nor AVX2 (check BF16_SUPPORTED first)")
    if rows <= 0 or out_features <= 0 or in_features <= 0 or in_features % FL_Q8_BLOCK:
        raise ValueError(f"{name}: bad shape rows={rows} out={out_features} in={in_features} (in must be a "
                         f"multiple of {FL_Q8_BLOCK})")
    if q_ptr == 0 or scales_ptr == 0 or offsets_ptr == 0 or x_ptr == 0 or out_ptr == 0:
        raise ValueError(f"{name}: null data pointer")
    cdef const void *q = <const void *>q_ptr
    cdef const void *sc = <const void *>scales_ptr
    cdef const void *mn = <const void *>offsets_ptr if kind == FL_QUANT_Q4_1 else NULL
    cdef const uint16_t *x = <const uint16_t *>x_ptr
    cdef uint16_t *y = <uint16_t *>out_ptr
    cdef int groups = (out_features + FL_GROUP - 1) // FL_GROUP
    cdef int g, t, failed = 0
    cdef int path = _path(kind, rows)
    cdef bint native = _native
    cdef int16_t *xq
    cdef float *xs
    cdef float *xsum = NULL
    if threads > groups:
        threads = groups
    if threads < 1:
        threads = 1
    if path == _DOTS:
        xq = <int16_t *>malloc(<size_t>rows * in_features * sizeof(int16_t))
        xs = <float *>malloc(<size_t>rows * (in_features // FL_Q8_BLOCK) * sizeof(float))
        if kind == FL_QUANT_Q4_1:
            xsum = <float *>malloc(<size_t>rows * (in_features // FL_Q8_BLOCK) * sizeof(float))
        if xq == NULL or xs == NULL or (kind == FL_QUANT_Q4_1 and xsum == NULL):
            free(xq)
            free(xs)
            free(xsum)
            raise MemoryError(f"{name}: no memory for {rows} quantised rows of {in_features}")
        with nogil:
            if native:
                fl_quant_rows(kind, x, rows, in_features, xq, xs, xsum)
            else:
                fl_quant_rows_scalar(kind, x, rows, in_features, xq, xs, xsum)
        try:
            if threads == 1:
                with nogil:
                    _dot_groups(native, kind, q, sc, mn, xq, xs, xsum, y, rows, out_features, in_features, 0, groups)
            else:
                for g in prange(groups, nogil=True, num_threads=threads, schedule="dynamic"):
                    _dot_groups(native, kind, q, sc, mn, xq, xs, xsum, y, rows, out_features, in_features, g, g + 1)
        finally:
            free(xq)
            free(xs)
            free(xsum)
        return
    # Widened: onto the AMX tiles (each thread a contiguous run of groups: one tile configuration a thread), else
    # into this CPU's bf16 kernel, a group a task
    if threads == 1:
        with nogil:
            failed = fl_quant_groups_widened(kind, q, sc, mn, x, y, out_features, rows, out_features, in_features, 0,
                                             groups, path) != 0
    elif path == FL_Q8_ON_AMX:
        for t in prange(threads, nogil=True, num_threads=threads, schedule="static", chunksize=1):
            failed += fl_quant_groups_widened(kind, q, sc, mn, x, y, out_features, rows, out_features, in_features,
                                              t * groups // threads, (t + 1) * groups // threads, path) != 0
    else:
        for g in prange(groups, nogil=True, num_threads=threads, schedule="dynamic"):
            failed += fl_quant_groups_widened(kind, q, sc, mn, x, y, out_features, rows, out_features, in_features,
                                              g, g + 1, path) != 0
    if failed:
        raise MemoryError(f"{name}: no memory for a widened group of {in_features} inputs")


cdef void _dot_groups(bint native, int kind, const void *q, const void *sc, const void *mn, const void *xq,
                     const float *xs, const float *xsum, uint16_t *y, int rows, int out_features, int in_features,
                     int g0, int g1) noexcept nogil:
    """Groups [g0, g1) by this host's integer dots (AVX-512 VNNI, else AVX2's), x quantised for them."""
    if native:
        fl_quant_groups(kind, q, sc, mn, xq, xs, xsum, y, out_features, rows, out_features, in_features, g0, g1)
    else:
        fl_quant_groups_avx2(kind, q, sc, mn, xq, xs, xsum, y, out_features, rows, out_features, in_features, g0, g1)


def q8_widen(uintptr_t q_ptr, uintptr_t scales_ptr, uintptr_t out_ptr, int out_features, int in_features,
             int threads=1):
    """A Q8_0 weight (pack_q8_0's layout) widened to bf16(d * q) in pack_bf16's layout at ``out_ptr`` (groups of
    FL_GROUP features, padded), a group a task: what bf16_unpack then takes to [out, in] for torch's products. The
    caller owns every check (as for q8_linear)."""
    _quant_widen(FL_QUANT_Q8_0, "q8_widen", q_ptr, scales_ptr, 1, out_ptr, out_features, in_features, threads)


def q4_widen(uintptr_t q_ptr, uintptr_t steps_ptr, uintptr_t offsets_ptr, uintptr_t out_ptr, int out_features,
             int in_features, int threads=1):
    """A Q4_1 weight (pack_q4_1's layout) widened to bf16(fma(d, q, m)) in pack_bf16's layout, as q8_widen."""
    _quant_widen(FL_QUANT_Q4_1, "q4_widen", q_ptr, steps_ptr, offsets_ptr, out_ptr, out_features, in_features,
                 threads)


cdef _quant_widen(int kind, str name, uintptr_t q_ptr, uintptr_t scales_ptr, uintptr_t offsets_ptr,
                  uintptr_t out_ptr, int out_features, int in_features, int threads):
    if not BF16_SUPPORTED:
        raise RuntimeError(f"{name}: this CPU has neither AVX-512 BF16 nor AVX2 (check BF16_SUPPORTED first)")
    if out_features <= 0 or in_features <= 0 or in_features % FL_Q8_BLOCK:
        raise ValueError(f"{name}: bad shape out={out_features} in={in_features}")
    if q_ptr == 0 or scales_ptr == 0 or offsets_ptr == 0 or out_ptr == 0:
        raise ValueError(f"{name}: null data pointer")
    cdef const void *q = <const void *>q_ptr
    cdef const void *sc = <const void *>scales_ptr
    cdef const void *mn = <const void *>offsets_ptr if kind == FL_QUANT_Q4_1 else NULL
    cdef uint16_t *dst = <uint16_t *>out_ptr
    cdef int groups = (out_features + FL_GROUP - 1) // FL_GROUP
    cdef int g
    cdef int native = _native
    if threads < 1:
        threads = 1
    for g in prange(groups, nogil=True, num_threads=threads, schedule="static"):
        fl_quant_widen_groups(kind, q, sc, mn, dst, in_features, g, g + 1, native)


# The C quantiser runs here (AVX2 with F16C; every CPU with the kernels has them): quantise_weight.
QUANTISER = bool(fl_quantiser_supported())


def quantise_weight(str fmt, uintptr_t w_ptr, uintptr_t q_ptr, uintptr_t scales_ptr, uintptr_t offsets_ptr,
                    int out_features, int in_features, int threads=1, bint grids=False):
    """A bf16 weight [out_features, in_features] (row-major) quantised straight into the kernels' layout
    (quant.py's quantize_packed, bit for bit, in one pass a group; qlinear_kernel.h's fl_quantise_group): "q8_0"
    into q int8 [groups, in / 2, 64, 2] and scales float32 [groups, in / 32, 64]; "q4_1" into q uint8
    [groups, in / 4, 128], which must come zeroed, with steps and offsets float16 [groups, in / 32, 64]; with
    ``grids``, each Q4_1 block tries the grids of 13 down to 1 steps too (quant.quantize_q4_1). Returns False if a
    Q4_1 step or offset fell past float16's range (the caller raises), else True."""
    if not QUANTISER:
        raise RuntimeError("quantise_weight: this CPU lacks AVX2 with F16C (check QUANTISER first)")
    if fmt not in ("q8_0", "q4_1"):
        raise ValueError(f"quantise_weight: unknown format {fmt!r}")
    cdef int kind = FL_QUANT_Q4_1 if fmt == "q4_1" else FL_QUANT_Q8_0
    if out_features <= 0 or in_features <= 0 or in_features % FL_Q8_BLOCK:
        raise ValueError(f"quantise_weight: bad shape out={out_features} in={in_features}")
    if w_ptr == 0 or q_ptr == 0 or scales_ptr == 0 or (kind == FL_QUANT_Q4_1 and offsets_ptr == 0):
        raise ValueError("quantise_weight: null data pointer")
    cdef const uint16_t *w = <const uint16_t *>w_ptr
    cdef void *q = <void *>q_ptr
    cdef void *sc = <void *>scales_ptr
    cdef void *mn = <void *>offsets_ptr
    cdef int groups = (out_features + FL_GROUP - 1) // FL_GROUP
    cdef int g
    cdef int overflow = 0
    if threads < 1:
        threads = 1
    for g in prange(groups, nogil=True, num_threads=threads, schedule="static"):
        overflow |= fl_quantise_group(kind, w, out_features, in_features, g, q, sc, mn, grids)
    return not overflow


def flush_denormals(int threads=1, bint flush=True):
    """Denormal floats flushed to zero (x86's FTZ and DAZ; ``flush`` False: not) on the calling thread and on every
    thread of its OpenMP team of ``threads`` (torch's intra-op workers, which libgomp keeps for later parallel regions
    of this thread), where x86 would otherwise take dozens of times longer over them. Returns whether the calling
    thread flushed them before; None off x86-64 (nothing changed)."""
    cdef int t
    cdef int before = fl_flush_denormals(flush)
    if not before & 2:
        return None
    if threads > 1:
        for t in prange(threads, nogil=True, num_threads=threads, schedule="static", chunksize=1):
            fl_flush_denormals(flush)
    return bool(before & 1)


def bf16_unpack(uintptr_t packed_ptr, uintptr_t out_ptr, int out_features, int in_features, int threads=1):
    """The packed layout back to the weight: out[out_features, in_features] (bfloat16, row-major) from
    ``packed_ptr`` (flared.model.decoder.pack_bf16's layout), a group of FL_GROUP output features a task. Within a
    group the packed [in / 2, FL_GROUP] pairs are transposed as 32-bit words. The caller owns every check (as for
    bf16_linear)."""
    _pack_groups(False, "bf16_unpack", packed_ptr, out_ptr, out_features, in_features, threads)


cdef _pack_groups(bint pack, str name, uintptr_t src_ptr, uintptr_t dst_ptr, int out_features, int in_features,
                  int threads):
    """bf16_pack (pack) or bf16_unpack over ``threads``, a group a task."""
    if out_features <= 0 or in_features <= 0 or in_features % 2:
        raise ValueError(f"{name}: bad shape out={out_features} in={in_features} (in must be even)")
    if src_ptr == 0 or dst_ptr == 0:
        raise ValueError(f"{name}: null data pointer")
    cdef const uint32_t *src = <const uint32_t *>src_ptr
    cdef uint32_t *dst = <uint32_t *>dst_ptr
    cdef int half = in_features // 2
    cdef int groups = (out_features + FL_GROUP - 1) // FL_GROUP
    cdef int g
    if threads < 1:
        threads = 1
    for g in prange(groups, nogil=True, num_threads=threads, schedule="static"):
        if pack:
            _pack_group(src, dst, g, half, out_features)
        else:
            _unpack_group(src, dst, g, half, out_features)


cdef void _unpack_group(const uint32_t *src, uint32_t *dst, int g, int half, int out_features) noexcept nogil:
    """One group: its output rows written start to end, 8 at a time (each packed row's 8 words for them one read;
    a group's [half, FL_GROUP] words stay in cache across the blocks). Writing 16-word runs of all 64 rows instead
    was 3.6x slower on a [16384, 2048] matrix: its rows 4 KiB apart share cache sets."""
    cdef const uint32_t *block = src + <int64_t>g * half * FL_GROUP
    cdef uint32_t *out = dst + <int64_t>g * FL_GROUP * half
    cdef int rows = out_features - g * FL_GROUP
    cdef int o0, o, i, end
    if rows > FL_GROUP:
        rows = FL_GROUP
    for o0 in range(0, rows, 8):
        end = o0 + 8
        if end > rows:
            end = rows
        for i in range(half):
            for o in range(o0, end):
                out[<int64_t>o * half + i] = block[<int64_t>i * FL_GROUP + o]


def bf16_pack(uintptr_t weight_ptr, uintptr_t packed_ptr, int out_features, int in_features, int threads=1):
    """A weight [out_features, in_features] (bfloat16, row-major) into the packed layout (flared.model.decoder's
    pack_bf16, bit for bit: groups of FL_GROUP output features, each [in / 2, FL_GROUP, 2], zero rows past
    ``out_features``), a group a task: bf16_unpack the other way. The caller owns every check (as for
    bf16_linear)."""
    _pack_groups(True, "bf16_pack", weight_ptr, packed_ptr, out_features, in_features, threads)


cdef void _pack_group(const uint32_t *src, uint32_t *dst, int g, int half, int out_features) noexcept nogil:
    """One group: 8 weight rows at a time, each read start to end, their words for each pair written side by side
    (_unpack_group's order, reversed); the rows past out_features written as zeros."""
    cdef const uint32_t *rows_in = src + <int64_t>g * FL_GROUP * half
    cdef uint32_t *block = dst + <int64_t>g * half * FL_GROUP
    cdef int rows = out_features - g * FL_GROUP
    cdef int o0, o, i, end
    if rows > FL_GROUP:
        rows = FL_GROUP
    for o0 in range(0, FL_GROUP, 8):
        end = o0 + 8
        for i in range(half):
            for o in range(o0, end):
                block[<int64_t>i * FL_GROUP + o] = rows_in[<int64_t>o * half + i] if o < rows else 0
