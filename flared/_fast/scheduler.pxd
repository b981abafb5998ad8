from libc.stdint cimport int32_t, int64_t, uint8_t

from flared._fast.pages cimport PageAllocator
from flared._fast.policy cimport SelectionPolicy, _Candidate
from flared._fast.prefix cimport Checkpoint, PrefixCheckpointCache, PrefixHistory
from flared._fast.request cimport Request, ScheduledPlan
from flared._fast.timing cimport GraphTimings


cdef class RequestScheduler:
    cdef readonly int64_t scheduler_id
    cdef readonly object config
    cdef readonly object policy
    cdef readonly int32_t max_live_requests
    cdef readonly int32_t page_tokens
    cdef readonly int64_t context_capacity
    cdef readonly int64_t prefill_chunk_size
    cdef readonly bytes model_identity
    cdef readonly PrefixCheckpointCache cache
    cdef readonly PageAllocator pages
    cdef readonly PageAllocator snapshots
    cdef readonly GraphTimings timings
    cdef list _slots
    cdef int64_t _next_generation
    cdef int64_t _next_plan_id
    cdef readonly int64_t last_committed_fence
    cdef readonly int64_t completed_fence
    # Committed plans in fence order: list of (fence, plan).
    cdef list _inflight
    # Requests waiting for their final GPU use before release.
    cdef list _draining
    cdef readonly double refresh_credit_ns
    cdef readonly dict counters
    cdef readonly SelectionPolicy selection
    # Terminal captures are funded by this fraction of a request's measured decode time.
    cdef double _extra_work_fraction
    cdef bint _initialize_state
    # Speculative decoding by prompt lookup (SchedulerConfig.speculative_tokens; 0 = off)
    cdef int32_t _spec_tokens
    cdef int32_t _lookup_max
    cdef int32_t _lookup_min
    # Drafts from a draft model (SchedulerConfig.drafter), or None: prompt lookup's
    cdef object _drafter
    # A step's duration against the tokens it feeds (decode and speculative steps): what a draft costs.
    cdef readonly object row_cost
    # The most tokens a speculative step feeds in all (SchedulerConfig.speculative_max_rows, at most 64).
    cdef Py_ssize_t _spec_rows

    cdef Request _get(self, int64_t handle)
    cdef bint _ensure_pages(self, int64_t n) except -1
    cdef int32_t _take_snapshot(self) except -2
    cdef _reclaim(self, list reusable)
    cdef ScheduledPlan _build_plan(self, _Candidate c, int64_t now_ns, bint speculate=*)
    cdef int64_t _draft_cap(self, Request r)
    cdef object _sequence(self, Request r)
    cdef list _proposals(self, list requests, Py_ssize_t budget, ScheduledPlan p)
    cdef tuple _propose(self, Request r)
    cdef tuple _lookup(self, int32_t[::1] sv, int64_t cap, Py_ssize_t shortest)
    cdef tuple _predicted(self, Request r, int32_t[::1] sv, Py_ssize_t outputs, int64_t cap)
    cdef _adapt_drafts(self, Request r, int64_t offered, int64_t kept, bint copied=*)
    cdef list _priced_drafts(self, list requests, list drafts, ScheduledPlan p)
    cdef object _step_cost(self, ScheduledPlan p)
    cdef list _priced_counts(self, list requests, list counts, ScheduledPlan p, object drafting)
    cdef bint _drains_to_speculate(self, list requests)
    cdef tuple _copy_row(self, int32_t snapshot_id, Request r, int64_t endpoint)
    cdef _advance_phase(self, Request r, int kind)
    cdef int64_t _publish(self, Request r, int64_t fence) except -2
    cdef _finish(self, Request r, int64_t now_ns)
    cdef list _retire_drained(self)
    cdef _release(self, Request r)
