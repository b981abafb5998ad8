# cython: language_level=3
"""All decoder layers of a bf16 decode step in one call (kernel in decode_kernel.h).

``decode_layers(...)`` runs every layer for ``rows`` decode rows (one new token each) over the paged KV
cache: the hidden states ``h`` [rows, hidden] are updated in place, each row's new K/V is written to its
slot, and the caller then applies the final norm and the LM head. Raw data pointers
(``tensor.data_ptr()``); ``layer_ptrs`` is the address of an int64 [num_layers, PTRS] table of weight
addresses (see decode_kernel.h for its columns; the four matrices packed by
``flared.model.decoder.pack_bf16``, or quantised by ``flared.model.quant.pack_q8_0`` / ``pack_q4_1`` with their
scales' (and Q4_1's offsets') addresses).

Rules:
- The caller checks ``SUPPORTED`` and owns every check on the tensors: bfloat16 throughout (int64 index
  arrays), contiguous, shapes as decode_kernel.h says, slots inside the cache, rows at most MAX_ROWS,
  and everything alive during the call. This module checks only the scalar arguments.
- Threads are OpenMP's, the runtime torch uses (see linear.pyx).
"""

from libc.stdint cimport int32_t, int64_t, uint16_t, uintptr_t

from flared._fast.linear import KERNEL, amx_min_rows, quant_path

cdef int64_t _serial = 0
# linear.quant_path's names as decode_kernel.h's q8_path / q4_path (this kernel runs on AVX-512 BF16 hosts only)
_DECODE_PATHS = {"dots": 0, "amx": 1, "avx512": 2}

cdef extern from "decode_kernel.h" nogil:
    int FL_DEC_MAX_ROWS
    int FL_DEC_PTRS
    int FL_ATTN_MAX_GROUP
    int FL_ATTN_MAX_DIM
    int FL_LORA_MAX_RANK
    ctypedef struct fl_decode_args_t:
        int rows, hidden, num_heads, num_kv_heads, head_dim, intermediate, num_layers, window, threads
        float eps, scale
        int64_t num_slots, stride_slots
        const int64_t *layer_ptrs
        const uint16_t *cos
        const uint16_t *sin
        const int64_t *positions
        const int64_t *write_slots
        const int64_t *gather_slots
        const int64_t *lens
        void *k_cache
        void *v_cache
        int kv_fp8
        uint16_t *h
        uint16_t *x
        uint16_t *qkv
        uint16_t *q
        uint16_t *attn
        uint16_t *act
        const int32_t *lora_rows
        const int64_t *lora_table
        uint16_t *lora_low
        int lora_rank
        int shared_sequences
        int amx
        int q8_path, q4_path
        int64_t serial
        int *failed
    int fl_decode_supported()
    void fl_decode_layers(const fl_decode_args_t *a)

# (an AVX-512 BF16 kernel: off where linear.pyx runs the AVX2 kernels, FLARED_AVX512=0 included, so that such a
# run is an AVX2 host's throughout)
SUPPORTED = bool(fl_decode_supported()) and KERNEL == "avx512_bf16"
MAX_ROWS = FL_DEC_MAX_ROWS
PTRS = FL_DEC_PTRS  # columns of layer_ptrs: decode_kernel.h's 9 addresses, 4 scales (0: bf16), 4 Q4_1 offsets
LORA_MAX_RANK = FL_LORA_MAX_RANK  # the most low-rank columns (all of one product's stacked A) an adapter may have


def decode_layers(*, int rows, int hidden, int num_heads, int num_kv_heads, int head_dim, int intermediate,
                  int num_layers, float eps, float scale, int window, int64_t num_slots, int64_t stride_slots,
                  uintptr_t layer_ptrs, uintptr_t cos, uintptr_t sin, uintptr_t positions, uintptr_t write_slots,
                  uintptr_t gather_slots, uintptr_t lens, uintptr_t k_cache, uintptr_t v_cache, uintptr_t h,
                  uintptr_t x, uintptr_t qkv, uintptr_t q, uintptr_t attn, uintptr_t act, int threads=1,
                  uintptr_t lora_rows=0, uintptr_t lora_table=0, uintptr_t lora_low=0, int lora_rank=0,
                  bint shared_sequences=False, bint kv_fp8=False):
    """See the module docstring. ``x`` holds ``threads`` * rows * hidden elements (one norm buffer per thread).
    Per-request LoRA rows (decode_kernel.h): ``lora_rows`` int32 [rows] (each row's adapter slot, -1 none),
    ``lora_table`` int64 [slots, num_layers, 4, 4], ``lora_low`` bf16 [rows, lora_rank] scratch.
    ``shared_sequences``: rows may be consecutive positions of one sequence (every row's K/V is written before
    any row attends, so each sees the rows before it). ``kv_fp8``: the caches hold float8 e4m3 (kv_cache_dtype
    fp8), one byte a value, written to nearest even and saturated at +-448 as torch's path stores them."""
    if not SUPPORTED:
        raise RuntimeError("decode_layers: this CPU lacks AVX-512 BF16 (check SUPPORTED first)")
    if not 0 < rows <= FL_DEC_MAX_ROWS:
        raise ValueError(f"decode_layers: rows {rows} outside 1..{FL_DEC_MAX_ROWS}")
    if min(hidden, num_heads, num_kv_heads, head_dim, intermediate, num_layers, num_slots, stride_slots) <= 0:
        raise ValueError("decode_layers: every size must be positive")
    if num_heads % num_kv_heads or num_heads // num_kv_heads > FL_ATTN_MAX_GROUP:
        raise ValueError(f"decode_layers: {num_heads} heads over {num_kv_heads} kv heads is not supported")
    if head_dim > FL_ATTN_MAX_DIM or head_dim % 2:
        raise ValueError(f"decode_layers: head_dim {head_dim} is not supported")
    if intermediate % 64 or hidden % 2 or (num_heads * head_dim) % 2:
        raise ValueError(f"decode_layers: intermediate {intermediate} must be a multiple of 64, the inputs even")
    if 0 in (layer_ptrs, cos, sin, positions, write_slots, gather_slots, lens, k_cache, v_cache, h, x, qkv, q,
             attn, act):
        raise ValueError("decode_layers: null data pointer")
    if lora_rows and (not lora_table or not lora_low or not 0 < lora_rank <= FL_LORA_MAX_RANK):
        raise ValueError(f"decode_layers: LoRA rows need a table, scratch and a rank in 1..{FL_LORA_MAX_RANK}")
    cdef fl_decode_args_t a
    a.rows = rows
    a.hidden = hidden
    a.num_heads = num_heads
    a.num_kv_heads = num_kv_heads
    a.head_dim = head_dim
    a.intermediate = intermediate
    a.num_layers = num_layers
    a.window = window
    a.threads = threads if threads > 0 else 1
    a.eps = eps
    a.scale = scale
    a.num_slots = num_slots
    a.stride_slots = stride_slots
    a.layer_ptrs = <const int64_t *>layer_ptrs
    a.cos = <const uint16_t *>cos
    a.sin = <const uint16_t *>sin
    a.positions = <const int64_t *>positions
    a.write_slots = <const int64_t *>write_slots
    a.gather_slots = <const int64_t *>gather_slots
    a.lens = <const int64_t *>lens
    a.k_cache = <void *>k_cache
    a.v_cache = <void *>v_cache
    a.kv_fp8 = kv_fp8
    a.h = <uint16_t *>h
    a.x = <uint16_t *>x
    a.qkv = <uint16_t *>qkv
    a.q = <uint16_t *>q
    a.attn = <uint16_t *>attn
    a.act = <uint16_t *>act
    a.lora_rows = <const int32_t *>lora_rows
    a.lora_table = <const int64_t *>lora_table
    a.lora_low = <uint16_t *>lora_low
    a.lora_rank = lora_rank
    a.shared_sequences = shared_sequences
    fewest = amx_min_rows()  # (the AMX tiles where linear.pyx's products take them: the same results)
    a.amx = 1 if fewest and rows >= fewest else 0
    # Quantised products as linear.q8_linear / q4_linear run them for this many rows (the per-op path's results)
    a.q8_path = _DECODE_PATHS[quant_path("q8_0", rows)]
    a.q4_path = _DECODE_PATHS[quant_path("q4_1", rows)]
    global _serial
    _serial += 1
    a.serial = _serial
    cdef int failed = 0
    a.failed = &failed
    with nogil:
        fl_decode_layers(&a)
    if failed:
        raise MemoryError("decode_layers: no memory for a quantised product's scratch")
