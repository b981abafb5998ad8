from libc.stdint cimport int32_t, int64_t, uint8_t

from flared._fast.prefix cimport Checkpoint, PrefixHistory


# Handle layout: generation << SLOT_BITS | slot.
cdef enum:
    SLOT_BITS = 8
    SLOT_MASK = 0xFF
    MAX_SLOTS = 64


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
    PH_PREFILL = 2       # the prefill frame that reaches a selected endpoint also writes its checkpoint
    PH_RESUME = 3
    PH_DECODE = 4
    PH_TERMINAL = 5      # finished; terminal snapshot due
    PH_DRAINING = 6      # finished or cancelled; waiting for its final GPU use


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
    # vLLM's priority (lower runs sooner): the selection policy scales this request's value and waiting cost by
    # value_scale = 2 ** -priority (priority clamped to +-16); FCFS orders by (priority, arrival).
    cdef readonly int64_t priority
    cdef readonly double value_scale
    # Speculative decoding may feed this request drafts (a greedy request whose tokens nothing but the logits
    # decide: RequestScheduler.admit's ``speculate``).
    cdef readonly bint speculate
    # OpenAI's predicted output (token ids; empty: none): the lookup's first source of drafts
    cdef readonly object prediction
    cdef int32_t[::1] _prediction
    # Its drafts a step at most now (starts at 1; doubles after a round that kept every draft, up to
    # speculative_tokens; halves after one that kept none), and, once that reached 0, the generation rounds left
    # before it tries 1 again.
    cdef readonly int32_t spec_cap
    cdef readonly int32_t spec_cooldown
    # Prompt spans [start, end) that one prefill chunk feeds whole (Gemma 3's images: their tokens attend to each
    # other both ways), ascending; empty for most requests (RequestScheduler.admit's ``atomic_spans``).
    cdef readonly list atomic_spans
    # Its drafts kept and its rounds that rejected one, decayed (SPECULATIVE_DECAY a round): the chance that
    # its next draft is kept, spec_kept / (spec_kept + spec_rejected), prices each draft it is offered.
    cdef readonly double spec_kept
    cdef readonly double spec_rejected
    # With a draft model (SchedulerConfig.drafter), the same record for the drafts copied instead (prompt lookup,
    # a predicted output); spec_kept and spec_rejected then keep the draft model's. Copies do not move the cap.
    cdef readonly double copy_kept
    cdef readonly double copy_rejected
    # Generation rounds left before a step with this request in flight stops taking decode steps behind it so
    # that it can speculate: set after a round in which the lookup gave it no draft (or none worth its cost).
    cdef readonly int32_t spec_rest
    # Scratch used by plan(); never read across calls.
    cdef double _weight
    cdef double _wait_rate
    cdef int64_t _take
    cdef double _path_value

    cdef int64_t _next_stop(self)
    cdef int64_t _cut(self, int64_t take)


cdef class ScheduledPlan:
    cdef readonly int64_t scheduler_id
    cdef readonly int64_t plan_id
    cdef readonly int kind
    cdef readonly int32_t batch_capacity
    cdef readonly int32_t token_capacity
    cdef readonly int64_t planned_ns
    cdef readonly int64_t estimated_duration_ns
    # When it should finish, set at commit: queued behind the frame in flight before it, it starts when that
    # one is expected to finish.
    cdef readonly int64_t expected_finish_ns
    # Unmeasured or stale shape: must run alone, then be measured.
    cdef readonly bint exclusive
    # The plan looked up drafts (a decode cohort chosen with the window empty, speculation on).
    cdef readonly bint spec_tried
    # Drafts the lookup proposed and the plan left out as not worth their cost (counted when committed).
    cdef readonly int32_t priced_out
    # The draft model's forwards behind its drafts (SchedulerConfig.drafter; 0: none ran)
    cdef readonly int32_t drafter_steps
    # With a draft model, per participant whether its drafts were copied (prompt lookup, a predicted output) rather
    # than drafted (None: no draft model)
    cdef readonly object copied
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


