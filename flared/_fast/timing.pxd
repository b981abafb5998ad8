from libc.stdint cimport int64_t


# Measurement state of a graph shape's duration estimate.
cdef enum TimingState:
    TIMING_UNMEASURED = 0
    TIMING_FRESH = 1
    TIMING_STALE = 2


cdef class ShapeTiming:
    # Up to MAX_OBSERVATIONS most recent valid durations (ns), oldest first.
    cdef list observations
    # Median of observations; 0 while unmeasured.
    cdef readonly int64_t estimate_ns
    # Caller time of the last valid observation / last dispatch; -1 = never.
    cdef readonly int64_t last_observed_ns
    cdef readonly int64_t last_attempt_ns
    cdef readonly int64_t num_observations

    cdef int state(self, int64_t now_ns, int64_t freshness_ns) noexcept


cdef class GraphTimings:
    # Age after which an estimate is stale (still usable, refresh-eligible).
    cdef readonly int64_t freshness_ns
    # shape tuple (kind, batch_capacity, token_capacity) -> ShapeTiming
    cdef dict _by_shape

    cdef ShapeTiming get(self, tuple shape)
    cpdef int64_t observe(self, tuple shape, object duration_ns, int64_t now_ns, int64_t embedding_wait_ns=*) except -2
