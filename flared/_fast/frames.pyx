# cython: language_level=3
"""Two-frame bookkeeping for the CUDA graph executor, and completion records.

``FrameRing`` decides which pinned frame a step may use and when:

- Two frames. A window step (an ordinary decode) may be submitted while one
  other window step is in flight; a third submission gets backpressure
  (``acquire`` returns -1) until the oldest is consumed.
- A draining step (prefill, snapshot, restore, ...) needs an empty window.
- An exclusive step (grammar-constrained) needs an empty window and, until it
  is consumed, every further acquire returns -1.
- Completions are consumed oldest first (fence order); ``release`` of any
  other frame is an error.
- ``poison(reason)`` (a failed submission) makes every later acquire raise;
  in-flight frames can still be consumed so close() can drain them.

``CompletionTable`` holds per frame one record per physical slot: 16 int64
metadata fields (see frames.pxd) then the token fields. ``write`` fills the
records of a step's participants at submission (what the host knows:
handles, cumulative consumed/generated counts); the device's sampled tokens
arrive in participant order and ``parse`` joins them into the scheduler's
CompletionRecords in participant order, checking each record's fence.

No CUDA here: the executor calls these around its CuPy calls, and the CPU
tests drive them directly.
"""

import numpy as np
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t

from flared.errors import ErrorKind, ExecutionError

cnp.import_array()

WINDOW = STEP_WINDOW
DRAINING = STEP_DRAINING
EXCLUSIVE = STEP_EXCLUSIVE
META_FIELDS = RECORD_META_FIELDS
FRAMES = NUM_FRAMES


cdef class FrameRing:
    def __cinit__(self):
        cdef int i
        for i in range(NUM_FRAMES):
            self._state[i] = FRAME_FREE
            self._fence[i] = -1
            self._klass[i] = STEP_WINDOW
        self.next_fence = 1
        self.last_consumed_fence = 0
        self.poisoned = False
        self.poison_reason = None

    @property
    def outstanding(self):
        """Frames acquired and not yet released."""
        cdef int i, n = 0
        for i in range(NUM_FRAMES):
            if self._state[i] != FRAME_FREE:
                n += 1
        return n

    def state(self, int frame):
        return self._state[frame]

    def fence(self, int frame):
        return self._fence[frame]

    def acquire(self, int klass):
        """A free frame index for a step of ``klass``, or -1 (backpressure: consume first)."""
        cdef int i, busy = 0, free = -1
        if self.poisoned:
            raise ExecutionError(f"the executor is poisoned: {self.poison_reason}", ErrorKind.POISONED)
        if klass < STEP_WINDOW or klass > STEP_EXCLUSIVE:
            raise ValueError(f"unknown step class {klass}")
        for i in range(NUM_FRAMES):
            if self._state[i] == FRAME_PACKING:
                raise ExecutionError("a frame is still being packed; finish or abandon it first")
            if self._state[i] != FRAME_FREE:
                busy += 1
                if self._klass[i] != STEP_WINDOW:
                    return -1  # a draining or exclusive step owns the window until consumed
            elif free < 0:
                free = i
        if klass != STEP_WINDOW and busy:
            return -1
        if free < 0:
            return -1
        self._state[free] = FRAME_PACKING
        self._klass[free] = klass
        self._fence[free] = -1
        return free

    def abandon(self, int frame):
        """Give back a frame acquired but never enqueued (packing failed before any CUDA call)."""
        if self._state[frame] != FRAME_PACKING:
            raise ExecutionError(f"frame {frame} is not being packed")
        self._state[frame] = FRAME_FREE

    def submitted(self, int frame):
        """The frame's work is enqueued: assign and return its fence."""
        if self._state[frame] != FRAME_PACKING:
            raise ExecutionError(f"frame {frame} was not acquired")
        self._state[frame] = FRAME_IN_FLIGHT
        self._fence[frame] = self.next_fence
        self.next_fence += 1
        return self._fence[frame]

    cdef int _oldest_in_flight(self):
        cdef int i, best = -1
        for i in range(NUM_FRAMES):
            if self._state[i] == FRAME_IN_FLIGHT and (best < 0 or self._fence[i] < self._fence[best]):
                best = i
        return best

    def oldest(self):
        """Frame index of the oldest in-flight step, or -1."""
        return self._oldest_in_flight()

    def release(self, int frame):
        """Consume the oldest in-flight frame's completion; returns its fence."""
        cdef int oldest = self._oldest_in_flight()
        if oldest < 0 or frame != oldest:
            raise ExecutionError(f"frame {frame} released out of order (oldest in flight: {oldest})")
        self._state[frame] = FRAME_FREE
        self.last_consumed_fence = self._fence[frame]
        return self._fence[frame]

    def poison(self, reason):
        """A submission failed: refuse all further steps; a packing frame is dropped (nothing was enqueued)."""
        cdef int i
        if not self.poisoned:
            self.poisoned = True
            self.poison_reason = str(reason)
        for i in range(NUM_FRAMES):
            if self._state[i] == FRAME_PACKING:
                self._state[i] = FRAME_FREE


cdef class CompletionTable:
    def __cinit__(self, int32_t num_slots, int32_t token_fields=1, records=None):
        if num_slots <= 0 or token_fields <= 0:
            raise ValueError("num_slots and token_fields must be positive")
        self.num_slots = num_slots
        self.token_fields = token_fields
        shape = (NUM_FRAMES, num_slots, RECORD_META_FIELDS + token_fields)
        if records is None:
            records = np.zeros(shape, dtype=np.int64)
        if records.shape != shape or records.dtype != np.int64 or not records.flags.c_contiguous:
            raise ValueError(f"records must be C-contiguous int64 {shape}")
        self.records = records
        self._records = records

    @staticmethod
    def nbytes_for(int32_t num_slots, int32_t token_fields=1):
        return NUM_FRAMES * num_slots * (RECORD_META_FIELDS + token_fields) * 8

    def write(self, int frame, int64_t fence, const int64_t[::1] slots, const int64_t[::1] handles,
              const int64_t[::1] consumed,
              const int64_t[::1] generated, const cnp.uint8_t[::1] sample):
        """Records for one step's participants (all other slots marked invalid)."""
        cdef Py_ssize_t i, n = handles.shape[0]
        cdef int64_t s
        cdef int32_t f
        if slots.shape[0] != n or consumed.shape[0] != n or generated.shape[0] != n or sample.shape[0] != n:
            raise ValueError("participant arrays differ in length")
        for s in range(self.num_slots):
            self._records[frame, s, R_VALID] = 0
        for i in range(n):
            s = slots[i]
            if s < 0 or s >= self.num_slots:
                raise ExecutionError(f"participant {i} has slot {s} outside 0..{self.num_slots - 1}")
            if self._records[frame, s, R_VALID]:
                raise ExecutionError(f"slot {s} appears twice in one step")
            self._records[frame, s, R_VALID] = 1
            self._records[frame, s, R_HANDLE] = handles[i]
            self._records[frame, s, R_FENCE] = fence
            self._records[frame, s, R_PARTICIPANT] = i
            self._records[frame, s, R_CONSUMED] = consumed[i]
            self._records[frame, s, R_GENERATED] = generated[i]
            self._records[frame, s, R_SAMPLES] = sample[i]
            self._records[frame, s, R_NUM_TOKENS] = 1 if sample[i] else 0
            for f in range(self.token_fields):
                self._records[frame, s, RECORD_META_FIELDS + f] = -1

    def set_fence(self, int frame, int64_t fence):
        cdef int64_t s
        for s in range(self.num_slots):
            if self._records[frame, s, R_VALID]:
                self._records[frame, s, R_FENCE] = fence

    def parse(self, int frame, int64_t fence, const int64_t[::1] tokens):
        """Join the device's tokens (participant order) into records; returns
        (handles, consumed, generated, token_ids) in participant order."""
        cdef int64_t s, n = 0, p
        for s in range(self.num_slots):
            if self._records[frame, s, R_VALID]:
                n += 1
        handles = np.empty(n, dtype=np.int64)
        consumed = np.empty(n, dtype=np.int64)
        generated = np.empty(n, dtype=np.int64)
        token_ids = np.full(n, -1, dtype=np.int64)
        cdef int64_t[::1] h = handles, c = consumed, g = generated, t = token_ids
        for s in range(self.num_slots):
            if not self._records[frame, s, R_VALID]:
                continue
            if self._records[frame, s, R_FENCE] != fence:
                raise ExecutionError(f"slot {s}'s record is for fence {self._records[frame, s, R_FENCE]}, "
                                     f"expected {fence}")
            p = self._records[frame, s, R_PARTICIPANT]
            if p < 0 or p >= n:
                raise ExecutionError(f"slot {s}'s record names participant {p} of {n}")
            h[p] = self._records[frame, s, R_HANDLE]
            c[p] = self._records[frame, s, R_CONSUMED]
            g[p] = self._records[frame, s, R_GENERATED]
            if self._records[frame, s, R_SAMPLES]:
                if p >= tokens.shape[0]:
                    raise ExecutionError(f"no token for participant {p}")
                self._records[frame, s, RECORD_META_FIELDS] = tokens[p]
                t[p] = tokens[p]
        return handles, consumed, generated, token_ids
