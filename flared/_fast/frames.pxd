from libc.stdint cimport int32_t, int64_t

# Frame states.
cdef enum FrameState:
    FRAME_FREE = 0       # no step uses it; its pinned bytes may be rewritten
    FRAME_PACKING = 1    # acquired by submit, inputs being written, nothing enqueued yet
    FRAME_IN_FLIGHT = 2  # uploads + launch + completion copy enqueued, fence not yet consumed

# Step classes for the two-frame window.
cdef enum StepClass:
    STEP_WINDOW = 0      # ordinary decode: may share the window with one other window step
    STEP_DRAINING = 1    # anything else: needs an empty window, others may follow after it is consumed
    STEP_EXCLUSIVE = 2   # grammar-constrained: needs an empty window and blocks all until consumed

# Completion record layout (int64 fields), one record per physical slot.
cdef enum:
    NUM_FRAMES = 2
    RECORD_META_FIELDS = 16
    R_VALID = 0          # 1 = this slot took part in the step
    R_HANDLE = 1
    R_FENCE = 2
    R_PARTICIPANT = 3    # index in the plan's participant order
    R_CONSUMED = 4       # cumulative consumed tokens after the step
    R_GENERATED = 5      # cumulative generated tokens after the step
    R_NUM_TOKENS = 6     # token fields in use (0 or 1 today; speculative steps will use more)
    R_SAMPLES = 7        # 1 = the step samples for this slot

cdef class FrameRing:
    # Per-frame state, fence and step class.
    cdef int32_t _state[NUM_FRAMES]
    cdef int64_t _fence[NUM_FRAMES]
    cdef int32_t _klass[NUM_FRAMES]
    # Fences are handed out in submission order; completions are consumed in the same order.
    cdef readonly int64_t next_fence
    cdef readonly int64_t last_consumed_fence
    cdef readonly bint poisoned
    cdef readonly object poison_reason
    cdef int _oldest_in_flight(self)

cdef class CompletionTable:
    cdef readonly int32_t num_slots
    cdef readonly int32_t token_fields
    cdef readonly object records      # int64 [NUM_FRAMES, num_slots, RECORD_META_FIELDS + token_fields]
    cdef int64_t[:, :, ::1] _records
