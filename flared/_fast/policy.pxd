from libc.stdint cimport int32_t, int64_t

from flared._fast.request cimport Request, ScheduledPlan
from flared._fast.timing cimport GraphTimings


# One (graph shape, cohort) alternative inside plan(); never escapes it.
cdef class _Candidate:
    cdef int kind
    cdef int32_t batch
    cdef int32_t tokens
    cdef list requests
    # Prompt tokens per cohort member (prefill kinds only).
    cdef list takes
    # Expected useful value (prompt-token units) and the summed waiting-cost
    # rate (value per ms) of decoding/terminal requests left out.
    cdef double value
    cdef double wait_rate
    cdef int64_t estimate_ns
    cdef int state
    cdef int64_t last_touch_ns
    cdef double score
    # Chosen by funded timing refresh rather than on score.
    cdef bint refresh



cdef class SelectionPolicy:
    """Value-per-duration selection, checkpoint choice and fairness prices."""
    cdef readonly GraphTimings timings
    # kind -> sorted [(batch_capacity, token_capacity)] of captured shapes
    cdef dict _capacities
    cdef int64_t prefill_chunk_size
    # Coefficients copied out of PolicyConfig for the hot loop.
    cdef double _output_value
    cdef double _token_fairness
    cdef double _delivery_fairness
    cdef double _decode_age_price
    cdef double _terminal_value
    cdef double _terminal_age_price
    cdef double _adaptation_ns
    cdef double _extra_work_fraction
    # Baseline first-come-first-served selection instead of value per duration.
    cdef readonly bint fcfs

    cdef _Candidate select(self, list slots, bint stacking, int64_t now_ns, double refresh_credit_ns, bint queue_empty)
    cdef list select_endpoints(self, message_boundaries, int64_t L, int64_t reused)
    cdef update_prices(self, list slots, ScheduledPlan plan, int64_t measured)
    cdef double _unlock_value(self, Request r) except? -1
    cdef double _path_value(self, Request r) except? -1
    cdef int64_t _path_after_ns(self, Request r, int64_t at, bint snapshot_due) except -2
    cdef double _step_path_value(self, Request r, int kind, int64_t take, double step_est, double step_value) except? -1
    cdef int64_t _prefill_ns(self, int64_t num_tokens, int kind) except -1
    cdef _batch_candidates(self, int kind, list pool, double total_wait, int64_t now_ns, list out)
    cdef _prefill_candidates(self, int kind, list pool, double total_wait, int64_t now_ns, list out)
    cdef _estimate(self, _Candidate c, int64_t now_ns)
