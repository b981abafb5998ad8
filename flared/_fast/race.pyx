# cython: language_level=3
"""The sampler's draw on the CPU: the exponential race with the GPU graphs' noise.

``race_draw(scores, ids, seeds, steps)``: for each row r, the token i maximising
``scores[r, i] - log(max(-log u, E_FLOOR))``, u in (0, 1] from the counter hash of (seeds[r], steps[r], token id)
that flared/model/kernels/sampling.py's race computes on the GPU, in the same float32 operations. ``scores`` are
the row's logits after the temperature and its filters (float32, -inf where a token may not be drawn); ``ids``
(int64, same shape, or None: the column is the id) names each column's token, so a token's noise is a function of
(seed, step, id) alone, whatever the candidates. The argmax of a log-probability plus a Gumbel draw is a draw from
the distribution (the race argmax p / E, E ~ Exp(1), in log space). Equal scores go to the smaller id; a NaN score
wins (the smallest id among NaNs), as on the GPU; a row with nothing finite gives its first column.

The noise is bounded: E >= E_FLOOR makes -log E at most G_MAX, so once a row has a best score b, a token whose
score is below b - G_MAX cannot win and its noise is not computed. A trained model's next-token row has most of
its vocabulary that far below the top at usual temperatures, so most of the row is one comparison a token.

``race_top_p(scores, log_z, top_p, seeds, steps)``: the same race among each row's top-p tokens, found without
sorting, as the GPU graphs' walk finds them (kernels/sampling.py): rank is the larger score first, the smaller id
first among equal ones; a token is kept iff the probability mass ranked before it, exp(score - log_z) summed, is
below top_p (log_z: the row's log normaliser over its finite scores). The race's winner over the whole row is
checked; if it is not kept, nothing ranked after it is either, so the next candidate is the race's winner among
the tokens ranked before it, and so on up the ranking: one pass a candidate, and the first is nearly always kept.
For llama.cpp's chain (filters on the logits before the temperature, min-p after top-p) a row's ``judge`` takes
its scores back to those logits for the mass, and a ``floor`` on them keeps min-p's tokens too (both keep a prefix
of the ranking, so the walk is the same).
"""

from cython.parallel cimport prange
from libc.math cimport INFINITY, exp, logf
from libc.stdint cimport int64_t

import numpy as np

cdef int64_t M31 = 0x7FFFFFFF
cdef int64_t M63 = 0x7FFFFFFFFFFFFFFF
cdef float E_FLOOR = 5.9604644775390625e-08  # 2**-24: flared.model.sampling.E_FLOOR
# -log(E_FLOOR) (16.6355) plus a margin for the rounding of scores near the bound: what noise can add at most
cdef float G_SKIP = 16.65


cdef inline int64_t _mix(int64_t x, int64_t multiplier, int shift) noexcept nogil:
    x = x ^ (x >> shift)
    return (x * multiplier) & M31


cdef inline int64_t _row_hash(int64_t seed, int64_t step) noexcept nogil:
    cdef int64_t h = (seed & M31) ^ ((seed >> 31) & M31)
    h = (h * 0x6C8E9CF5 + (step & M31)) & M31
    return _mix(h, 0x45D9F3B, 16)


cdef inline float _noise(int64_t h, int64_t token) noexcept nogil:
    """-log(max(-log u, E_FLOOR)) for the token's u, as the GPU race computes it."""
    cdef int64_t z = (h * 0x2C1B3C6D + token) & M31
    z = _mix(z, 0x297A2D39, 15)
    z = _mix(z, 0x5BD1E995, 13)
    z = z ^ (z >> 16)
    # float32 throughout, as the kernel rounds: the hash to float, plus one, times 2**-31
    cdef float zf = <float>z
    cdef float u = (zf + <float>1.0) * <float>4.656612873077393e-10
    cdef float e = -logf(u)
    if e < E_FLOOR:
        e = E_FLOOR
    return -logf(e)


cdef int64_t _draw_row(const float* x, const int64_t* ids, Py_ssize_t n, int64_t h) noexcept nogil:
    """One row: n scores, their ids (NULL: the column is the id), the row's hash."""
    cdef Py_ssize_t i, top = 0
    cdef float v, best = -INFINITY, y
    cdef int64_t token, best_id = -1
    cdef bint found = False, named = ids != NULL
    # the largest score first: its noisy score is a high bar early, so most of the row skips the noise
    for i in range(n):
        v = x[i]
        if v != v:  # NaN wins, the smallest id among them
            token = ids[i] if named else i
            if not found or token < best_id:
                best_id = token
            found = True
        elif v > x[top] or x[top] != x[top]:
            top = i
    if found:
        return best_id
    if x[top] == -INFINITY:
        return ids[0] if named else 0
    best_id = ids[top] if named else top
    best = x[top] + _noise(h, best_id)
    for i in range(n):
        v = x[i]
        if v + G_SKIP < best:
            continue
        token = ids[i] if named else i
        if token == best_id:
            continue
        y = v + _noise(h, token)
        if y > best or (y == best and token < best_id):
            best = y
            best_id = token
    return best_id


def race_draw(scores, ids, seeds, steps):
    """See the module docstring. scores: float32 [rows, n] (C-contiguous); ids: int64 [rows, n] or None; seeds,
    steps: int64 [rows]. Returns int64 [rows]."""
    cdef const float[:, ::1] s = scores
    cdef const int64_t[:, ::1] named_ids
    cdef const int64_t[::1] se = seeds, st = steps
    cdef Py_ssize_t rows = s.shape[0], n = s.shape[1], r
    cdef bint named = ids is not None
    if se.shape[0] != rows or st.shape[0] != rows:
        raise ValueError(f"race_draw: {rows} rows of scores, {se.shape[0]} seeds, {st.shape[0]} steps")
    out = np.empty(rows, dtype=np.int64)
    if rows == 0:
        return out
    if n == 0:
        raise ValueError("race_draw: rows without scores")
    cdef const int64_t* id_base = NULL
    if named:
        named_ids = ids
        if named_ids.shape[0] != rows or named_ids.shape[1] != n:
            raise ValueError("race_draw: ids must have the scores' shape")
        id_base = &named_ids[0, 0]
    cdef int64_t[::1] o = out
    cdef const float* score_base = &s[0, 0]
    with nogil:
        for r in prange(rows, schedule="static"):  # rows apart on OpenMP's threads (torch's pool: libgomp)
            o[r] = _draw_row(score_base + r * n, id_base + r * n if named else NULL, n,
                             _row_hash(se[r] & M63, st[r]))
    return out


cdef int64_t _walk_row(const float* x, Py_ssize_t n, double log_z, double top_p, double judge, double floor,
                       int64_t h) noexcept nogil:
    """One row of race_top_p."""
    cdef int64_t c = _draw_row(x, NULL, n, h)
    cdef Py_ssize_t j
    cdef float xc, v, y, best
    cdef int64_t nxt
    cdef double mass
    if (top_p >= 1.0 and floor == -INFINITY) or x[c] != x[c]:
        return c
    while True:
        xc = x[c]
        mass = 0.0
        best = -INFINITY
        nxt = -1
        for j in range(n):
            v = x[j]
            if v > xc or (v == xc and j < c):  # ranked before c
                mass += exp(<double>v * judge - log_z)
                if v + G_SKIP < best:
                    continue
                y = v + _noise(h, j)
                if y > best or (y == best and j < nxt):
                    best = y
                    nxt = j
        # kept, or nothing ranks before it (the top token is always kept)
        if ((top_p >= 1.0 or mass < top_p) and <double>xc * judge >= floor) or nxt < 0:
            return c
        c = nxt


def race_top_p(scores, log_z, top_p, seeds, steps, judge=None, floor=None):
    """See the module docstring. scores: float32 [rows, n] (C-contiguous, the whole row: -inf where a token may
    not be drawn); log_z: float64 [rows]; top_p: float64 [rows] (1: no top-p); seeds, steps: int64 [rows]. judge
    (float64 [rows], or None: ones): what a score is multiplied by for the logit top-p judges (llama.cpp's chain
    judges the logits before the temperature: the row's T, log_z then their normaliser); floor (float64 [rows], or
    None: none): the least judged logit kept besides (llama.cpp's min-p after its top-p: -inf for none)."""
    rows_in = scores.shape[0]
    if judge is None:
        judge = np.ones(rows_in, dtype=np.float64)
    if floor is None:
        floor = np.full(rows_in, -np.inf, dtype=np.float64)
    cdef const float[:, ::1] s = scores
    cdef const double[::1] lz = log_z, tp = top_p, jd = judge, fl = floor
    cdef const int64_t[::1] se = seeds, st = steps
    cdef Py_ssize_t rows = s.shape[0], n = s.shape[1], r
    if (se.shape[0] != rows or st.shape[0] != rows or lz.shape[0] != rows or tp.shape[0] != rows
            or jd.shape[0] != rows or fl.shape[0] != rows):
        raise ValueError(f"race_top_p: {rows} rows of scores, but {lz.shape[0]} normalisers, {tp.shape[0]} "
                         f"top-p values, {jd.shape[0]} judges, {fl.shape[0]} floors, {se.shape[0]} seeds and "
                         f"{st.shape[0]} steps")
    out = np.empty(rows, dtype=np.int64)
    if rows == 0:
        return out
    if n == 0:
        raise ValueError("race_top_p: rows without scores")
    cdef int64_t[::1] o = out
    cdef const float* base = &s[0, 0]
    with nogil:
        for r in prange(rows, schedule="static"):
            o[r] = _walk_row(base + r * n, n, lz[r], tp[r], jd[r], fl[r], _row_hash(se[r] & M63, st[r]))
    return out
