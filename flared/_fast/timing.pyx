# cython: language_level=3
"""Per-shape graph duration estimates.

Rules:
- Every shape starts unmeasured (estimate 0). The first valid observation
  becomes the estimate; later fresh observations keep the median of the last
  nine.
- An estimate with no valid observation for ``freshness_ns`` is stale: still
  used for selection, but the next valid observation replaces it outright
  (old samples describe a machine state that may be gone).
- A tensor-parallel frame reports one interval per rank; the graph took as
  long as its slowest rank (the maximum positive interval), less any measured
  wait for embedding rows, which is not graph work.
- Only GPU intervals enter here; host delays and queue waits never do.
"""

from libc.stdint cimport int64_t

# Nine keeps the median robust to a couple of outliers (a clock bump, a
# preempted copy) while following a real change within a handful of steps.
MAX_OBSERVATIONS = 9
cdef Py_ssize_t _MAX_OBS = 9


cdef class ShapeTiming:
    def __cinit__(self):
        self.observations = []
        self.estimate_ns = 0
        self.last_observed_ns = -1
        self.last_attempt_ns = -1
        self.num_observations = 0

    cdef int state(self, int64_t now_ns, int64_t freshness_ns) noexcept:
        if self.num_observations == 0:
            return TIMING_UNMEASURED
        if now_ns - self.last_observed_ns > freshness_ns:
            return TIMING_STALE
        return TIMING_FRESH

    def __repr__(self):
        return f"ShapeTiming(estimate_ns={self.estimate_ns}, observations={self.observations})"


cdef class GraphTimings:
    def __cinit__(self, int64_t freshness_ns):
        if freshness_ns <= 0:
            raise ValueError("freshness_ns must be positive")
        self.freshness_ns = freshness_ns
        self._by_shape = {}

    cdef ShapeTiming get(self, tuple shape):
        t = self._by_shape.get(shape)
        if t is None:
            t = ShapeTiming()
            self._by_shape[shape] = t
        return <ShapeTiming>t

    def timing(self, tuple shape):
        return self.get(shape)

    def estimate(self, tuple shape, int64_t now_ns):
        """(estimate_ns, state) with state 'unmeasured' | 'fresh' | 'stale'."""
        cdef ShapeTiming t = self.get(shape)
        return t.estimate_ns, ("unmeasured", "fresh", "stale")[t.state(now_ns, self.freshness_ns)]

    def note_attempt(self, tuple shape, int64_t now_ns):
        self.get(shape).last_attempt_ns = now_ns

    cpdef int64_t observe(self, tuple shape, object duration_ns, int64_t now_ns, int64_t embedding_wait_ns=0) except -2:
        """Record one valid interval; returns the graph duration used (0 = ignored).

        ``duration_ns`` is an int or one int per tensor-parallel rank.
        """
        cdef int64_t d = 0, x
        if isinstance(duration_ns, int):
            d = duration_ns
        else:
            for v in duration_ns:
                x = v
                if x > d:
                    d = x
        if embedding_wait_ns > 0 and embedding_wait_ns < d:
            d -= embedding_wait_ns
        if d <= 0:
            return 0
        cdef ShapeTiming t = self.get(shape)
        if t.state(now_ns, self.freshness_ns) == TIMING_STALE:
            t.observations = []
        t.observations.append(d)
        if len(t.observations) > _MAX_OBS:
            del t.observations[0]
        ordered = sorted(t.observations)
        cdef Py_ssize_t n = len(ordered)
        if n % 2:
            t.estimate_ns = ordered[n // 2]
        else:
            t.estimate_ns = (ordered[n // 2 - 1] + ordered[n // 2]) // 2
        t.last_observed_ns = now_ns
        t.num_observations += 1
        return d
