# cython: language_level=3
"""The sampler's repetition, frequency and presence penalties on the CPU, in one pass a row.

``apply_penalties(logits, counts, prompt, rows, slots, rep, freq, pres)``: for each k, row ``rows[k]`` of
``logits`` (float32, C-contiguous, changed in place) takes the penalties of slot ``slots[k]`` of the sampler's
tables: ``counts`` (int32 [slots, V], each token's count in the output, or over llama.cpp's window) and ``prompt``
(uint8 [slots, V], 1 where the token is in the prompt). A token seen (counted, or in the prompt) has its logit x
divided by ``rep[k]`` where x > 0 and multiplied by it otherwise; then every token loses ``freq[k]`` times its count
and ``pres[k]`` where it is counted. The float32 operations are torch's in Sampler._apply_penalties, in the same
order, so the rows come out the same bits; here the row is read once, where torch runs a dozen passes over copies
of it. Rows are spread over OpenMP's threads.
"""

from cython.parallel cimport prange
from libc.stdint cimport int32_t, int64_t, uint8_t


cdef void _penalise(float* x, const int32_t* count, const uint8_t* prompt, Py_ssize_t n, float rep, float freq,
                    float pres) noexcept nogil:
    cdef Py_ssize_t i
    cdef float v, fc, counted
    cdef int32_t c
    for i in range(n):
        v = x[i]
        c = count[i]
        if c > 0 or prompt[i] != 0:
            if v > 0:
                v = v / rep
            else:
                v = v * rep
        fc = <float>c
        counted = 1.0 if c > 0 else 0.0
        v = v - freq * fc
        x[i] = v - pres * counted


def apply_penalties(logits, counts, prompt, rows, slots, rep, freq, pres):
    """See the module docstring. logits: float32 [B, V]; counts: int32 [S, V]; prompt: uint8 [S, V]; rows, slots:
    int64 [P]; rep, freq, pres: float32 [P]."""
    cdef float[:, ::1] x = logits
    cdef const int32_t[:, ::1] c = counts
    cdef const uint8_t[:, ::1] p = prompt
    cdef const int64_t[::1] r = rows, s = slots
    cdef const float[::1] rp = rep, fq = freq, ps = pres
    cdef Py_ssize_t k, n = x.shape[1], count = r.shape[0], batch = x.shape[0], slot_count = c.shape[0]
    if c.shape[1] != n or p.shape[1] != n or p.shape[0] != slot_count:
        raise ValueError(f"apply_penalties: logits of {n} columns, counts {c.shape[1]}, prompt {p.shape[1]}")
    if s.shape[0] != count or rp.shape[0] != count or fq.shape[0] != count or ps.shape[0] != count:
        raise ValueError("apply_penalties: rows, slots and the penalties must be as long")
    for k in range(count):
        if not (0 <= r[k] < batch and 0 <= s[k] < slot_count):
            raise ValueError(f"apply_penalties: row {r[k]} or slot {s[k]} out of range")
    if count == 0 or n == 0:
        return
    with nogil:
        for k in prange(count, schedule="static"):
            _penalise(&x[r[k], 0], &c[s[k], 0], &p[s[k], 0], n, rp[k], fq[k], ps[k])
