from libc.stdint cimport int32_t, int64_t, uint8_t

from flared._fast.pages cimport PageAllocator
from flared._fast.prefix cimport Checkpoint, PrefixCheckpointCache, PrefixHistory
from flared._fast.timing cimport GraphTimings


# Graph kinds; the Python IntEnum GraphKind mirrors these values.
cdef enum Kind:
    K_INITIALIZE = 0       # reset a slot's execution state row (no tokens)
    K_RESTORE = 1          # copy a checkpoint snapshot into a slot (state + partial page)
    K_SNAPSHOT = 2         # copy a slot's state + partial page into a snapshot row
    K_PREFILL = 3          # feed prompt tokens; logits only at the prompt end
    K_SCORED_PREFILL = 4   # feed prompt tokens with logits at every position
    K_RESUME_SAMPLING = 5  # sample from a restored hidden state (full prompt hit)
    K_DECODE = 6           # feed one token per request, sample one
    K_SPECULATIVE = 7      # reserved for the speculative-decoding issue
    K_VISION = 8           # reserved for the vision issue
    K_MIXED = 9            # reserved for mixed prefill/generation graphs
    NUM_KINDS = 10


# What a live request waits for next (state after its confirmed completions).
cdef enum Phase:
    PH_INITIALIZE = 0
    PH_RESTORE = 1
    PH_PREFILL = 2
    PH_SNAPSHOT = 3      # reached a selected endpoint; its snapshot is due
    PH_RESUME = 4
    PH_DECODE = 5
    PH_TERMINAL = 6      # finished; terminal snapshot due
    PH_DRAINING = 7      # finished or cancelled; waiting for its final GPU use


cdef class Request:
    cdef readonly int64_t handle
    cdef readonly int32_t slot
    cdef readonly int64_t generation
    # Execution-state row of the slot (row 0 is padding).
    cdef readonly int32_t state_row
    # Bumped by every mutation; plans record it to detect staleness.
    cdef readonly int64_t epoch
    cdef readonly int phase
    cdef readonly bint cancelled
    cdef readonly bint finished
    cdef readonly bint score_prompt
    # Prompt token ids (int32) and their exact-prefix keys (+ consumed output).
    cdef readonly object prompt
    cdef int32_t[::1] _prompt
    cdef readonly int64_t prompt_len
    cdef readonly PrefixHistory history
    cdef readonly int64_t max_output_tokens
    # Consumed tokens confirmed by completions / including in-flight steps.
    cdef readonly int64_t num_computed_tokens
    cdef readonly int64_t num_scheduled_tokens
    # Sampled tokens confirmed / including in-flight steps.
    cdef readonly int64_t num_generated_tokens
    cdef readonly int64_t num_scheduled_samples
    cdef readonly list output_tokens
    # Whole worst-case block table, allocated at admission (see docs).
    cdef readonly object block_table
    cdef int32_t[::1] _block_table
    # Leading block-table entries owned by the cache (the base chain).
    cdef readonly int64_t num_shared_pages
    # Pinned checkpoint whose chain the leading pages come from.
    cdef readonly Checkpoint base
    cdef readonly int64_t reused_tokens
    # Remaining selected checkpoint endpoints (ascending) and the snapshot
    # id reserved for each.
    cdef readonly list endpoints
    cdef readonly list endpoint_snapshots
    cdef readonly int32_t terminal_snapshot
    cdef readonly int64_t terminal_tokens
    # Submitted steps not yet completed, their last fence, and whether the
    # last submitted step was a decode (pipelining is decode-only).
    cdef readonly int32_t inflight
    cdef readonly int64_t last_use_fence
    cdef readonly bint last_inflight_decode
    cdef readonly int64_t arrival_ns
    cdef readonly int64_t last_progress_ns
    # Fairness: service prices and the rates that normalize them.
    cdef readonly double token_price
    cdef readonly double delivery_price
    cdef readonly double token_ns_per_token
    cdef readonly double delivery_interval_ns
    cdef readonly double terminal_credit_ns
    # Scratch used by plan(); never read across calls.
    cdef double _weight
    cdef double _wait_rate
    cdef int64_t _take
    cdef double _path_value

    cdef int64_t _next_stop(self)


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


cdef class ScheduledPlan:
    cdef readonly int64_t scheduler_id
    cdef readonly int64_t plan_id
    cdef readonly int kind
    cdef readonly int32_t batch_capacity
    cdef readonly int32_t token_capacity
    cdef readonly int64_t planned_ns
    cdef readonly int64_t estimated_duration_ns
    # Unmeasured or stale shape: must run alone, then be measured.
    cdef readonly bint exclusive
    cdef readonly bint refresh
    cdef readonly double value
    cdef readonly double score
    cdef readonly object handles
    cdef readonly object slots
    cdef readonly object state_rows
    cdef readonly object epochs
    cdef readonly object token_starts
    cdef readonly object num_tokens
    cdef readonly object token_offsets
    cdef readonly object token_ids
    cdef readonly object sample
    cdef readonly object generated_ends
    cdef readonly object first_blocks
    cdef readonly object page_offsets
    cdef readonly object page_ids
    cdef readonly object copies
    cdef bint _committed
    cdef list _requests


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
    cdef dict _capacities
    cdef readonly dict counters
    # Policy coefficients copied out of PolicyConfig for the hot loop.
    cdef double _output_value
    cdef double _token_fairness
    cdef double _delivery_fairness
    cdef double _decode_age_price
    cdef double _terminal_value
    cdef double _terminal_age_price
    cdef double _adaptation_ns
    cdef double _extra_work_fraction
    cdef bint _initialize_state
    # Baseline first-come-first-served selection instead of value per duration.
    cdef bint _fcfs

    cdef Request _get(self, int64_t handle)
    cdef bint _ensure_pages(self, int64_t n) except -1
    cdef int32_t _take_snapshot(self) except -2
    cdef _reclaim(self, list reusable)
    cdef list _select_endpoints(self, message_boundaries, int64_t L, int64_t reused, int64_t now_ns)
    cdef int64_t _measured_ns(self, tuple shape, int64_t now_ns)
    cdef double _unlock_value(self, Request r) except? -1
    cdef double _path_value(self, Request r) except? -1
    cdef int64_t _path_after_ns(self, Request r, int64_t at, bint snapshot_due) except -2
    cdef double _step_path_value(self, Request r, int kind, int64_t take, double step_est, double step_value) except? -1
    cdef int64_t _prefill_ns(self, int64_t num_tokens, int kind) except -1
    cdef _batch_candidates(self, int kind, list pool, double total_wait, int64_t now_ns, list out)
    cdef _prefill_candidates(self, int kind, list pool, double total_wait, int64_t now_ns, list out)
    cdef _estimate(self, _Candidate c, int64_t now_ns)
    cdef ScheduledPlan _build_plan(self, _Candidate c, int64_t now_ns, bint refresh)
    cdef tuple _copy_row(self, int32_t snapshot_id, Request r, int64_t endpoint)
    cdef _advance_phase(self, Request r, int kind)
    cdef int64_t _publish(self, Request r, int64_t fence) except -2
    cdef _update_prices(self, ScheduledPlan plan, int64_t measured)
    cdef _finish(self, Request r, int64_t now_ns)
    cdef list _retire_drained(self)
    cdef _release(self, Request r)
