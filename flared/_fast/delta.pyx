# cython: language_level=3
"""Recurrent layers' decode steps on the CPU, in place on the state rows: the gated delta rule (Qwen3-Next, Qwen3.5)
and, in ``decay_step``, linear attention with a decay (Mamba-2: Granite 4.0-H).

``gated_delta_step(ssm_ptr, rows_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, batch, heads, key_dim,
value_dim, threads)``: for each of ``batch`` sequences b and value head h, with S the float32 state
[key_dim, value_dim] at row ``rows[b]`` of the layer's state ``ssm`` [state rows, heads, key_dim, value_dim]:

    S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  out = S^T q

q, k [batch, heads, key_dim], v and out [batch, heads, value_dim], g and beta [batch, heads]: float32, row-major,
contiguous (q and k prepared: L2-normed, q scaled); rows int64. The state is read once to remember what k recalls and
once more (from cache: a head's state is 64 KiB at 128 x 128) to update it and read q, so a decode step touches each
state row's bytes about twice, where gathering the rows into a batch, the step's torch ops and the scatter back
touched them about eight times. Work is one (sequence, head) pair a task over ``threads`` OpenMP threads (the runtime
torch uses, as flared/_fast/linear.pyx explains). The caller owns every check on the tensors: this module sees
addresses.
"""

from cython.parallel cimport prange
from libc.math cimport expf
from libc.stdint cimport int64_t, uintptr_t

# The widest value head a step takes (Qwen3-Next's and Qwen3.5's are 128).
MAX_VALUE_DIM = 1024


def gated_delta_step(uintptr_t ssm_ptr, uintptr_t rows_ptr, uintptr_t q_ptr, uintptr_t k_ptr, uintptr_t v_ptr,
                     uintptr_t g_ptr, uintptr_t beta_ptr, uintptr_t out_ptr, int batch, int heads, int key_dim,
                     int value_dim, int threads=1):
    """See the module docstring."""
    if beta_ptr == 0:
        raise ValueError("gated_delta_step: null data pointer")
    _steps(ssm_ptr, rows_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, batch, heads, key_dim, value_dim,
           threads)


def decay_step(uintptr_t ssm_ptr, uintptr_t rows_ptr, uintptr_t q_ptr, uintptr_t k_ptr, uintptr_t v_ptr,
               uintptr_t g_ptr, uintptr_t out_ptr, int batch, int heads, int key_dim, int value_dim, int threads=1):
    """Linear attention's decode step with a decay and no delta rule (Mamba-2's scan: k = B, v = dt x, q = C), in
    place on the state rows, one pass over each: S <- exp(g) S + k v^T; out = S^T q. Arguments as gated_delta_step's
    (no beta)."""
    _steps(ssm_ptr, rows_ptr, q_ptr, k_ptr, v_ptr, g_ptr, 0, out_ptr, batch, heads, key_dim, value_dim, threads)


cdef _steps(uintptr_t ssm_ptr, uintptr_t rows_ptr, uintptr_t q_ptr, uintptr_t k_ptr, uintptr_t v_ptr,
            uintptr_t g_ptr, uintptr_t beta_ptr, uintptr_t out_ptr, int batch, int heads, int key_dim, int value_dim,
            int threads):
    """Every (sequence, head) pair's step, a task each: the gated delta rule's, or (beta_ptr 0) the decayed one."""
    if batch <= 0 or heads <= 0 or key_dim <= 0 or not 0 < value_dim <= MAX_VALUE_DIM:
        raise ValueError(f"recurrent step: bad sizes batch={batch} heads={heads} key_dim={key_dim} "
                         f"value_dim={value_dim}")
    if 0 in (ssm_ptr, rows_ptr, q_ptr, k_ptr, v_ptr, g_ptr, out_ptr):
        raise ValueError("recurrent step: null data pointer")
    cdef float *ssm = <float *>ssm_ptr
    cdef const int64_t *rows = <const int64_t *>rows_ptr
    cdef const float *q = <const float *>q_ptr
    cdef const float *k = <const float *>k_ptr
    cdef const float *v = <const float *>v_ptr
    cdef const float *g = <const float *>g_ptr
    cdef const float *beta = <const float *>beta_ptr
    cdef float *out = <float *>out_ptr
    cdef float *state
    cdef int task, tasks = batch * heads
    if threads < 1:
        threads = 1
    if threads > tasks:
        threads = tasks
    for task in prange(tasks, nogil=True, num_threads=threads, schedule="static"):
        state = ssm + (rows[task // heads] * heads + task % heads) * <int64_t>key_dim * value_dim
        if beta != NULL:
            _head_step(state, q + <int64_t>task * key_dim, k + <int64_t>task * key_dim, v + <int64_t>task * value_dim,
                       g[task], beta[task], out + <int64_t>task * value_dim, key_dim, value_dim)
        else:
            _head_decay(state, q + <int64_t>task * key_dim, k + <int64_t>task * key_dim,
                        v + <int64_t>task * value_dim, g[task], out + <int64_t>task * value_dim, key_dim, value_dim)


cdef void _head_step(float *state, const float *q, const float *k, const float *v, float g, float beta, float *out,
                     int key_dim, int value_dim) noexcept nogil:
    cdef float decay = expf(g)
    cdef float delta[1024]  # (MAX_VALUE_DIM)
    cdef float *row
    cdef float kk
    cdef int i, j
    for j in range(value_dim):
        delta[j] = 0.0
    for i in range(key_dim):  # what the decayed state recalls for k: decay * S^T k
        row = state + <int64_t>i * value_dim
        kk = k[i]
        for j in range(value_dim):
            delta[j] = delta[j] + row[j] * kk
    for j in range(value_dim):
        delta[j] = (v[j] - decay * delta[j]) * beta
    _head_decay(state, q, k, delta, g, out, key_dim, value_dim)  # S <- decay S + k delta^T, out = S^T q


cdef void _head_decay(float *state, const float *q, const float *k, const float *v, float g, float *out,
                      int key_dim, int value_dim) noexcept nogil:
    """S <- exp(g) S + k v^T, then out = S^T q, one pass over the state's rows."""
    cdef float decay = expf(g)
    cdef float *row
    cdef float kk, qk
    cdef int i, j
    for j in range(value_dim):
        out[j] = 0.0
    for i in range(key_dim):
        row = state + <int64_t>i * value_dim
        kk = k[i]
        qk = q[i]
        for j in range(value_dim):
            row[j] = decay * row[j] + kk * v[j]
            out[j] = out[j] + row[j] * qk
