# cython: language_level=3
"""Plain data shared by the scheduler and its policy: a live request's
scheduler-side state and the immutable ScheduledPlan handed to the model
thread. Neither has behaviour beyond reading itself; the rules that change
them live in flared._fast.scheduler.
"""

import enum

import numpy as np
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint8_t

cnp.import_array()

MAX_LIVE_REQUESTS = MAX_SLOTS


class GraphKind(enum.IntEnum):
    INITIALIZE = K_INITIALIZE
    RESTORE = K_RESTORE
    SNAPSHOT = K_SNAPSHOT
    PREFILL = K_PREFILL
    SCORED_PREFILL = K_SCORED_PREFILL
    RESUME_SAMPLING = K_RESUME_SAMPLING
    DECODE = K_DECODE
    SPECULATIVE = K_SPECULATIVE
    VISION = K_VISION
    MIXED = K_MIXED


class RequestPhase(enum.IntEnum):
    INITIALIZE = PH_INITIALIZE
    RESTORE = PH_RESTORE
    PREFILL = PH_PREFILL
    RESUME = PH_RESUME
    DECODE = PH_DECODE
    TERMINAL = PH_TERMINAL
    DRAINING = PH_DRAINING


def handle_slot(int64_t handle):
    return handle & SLOT_MASK


def handle_generation(int64_t handle):
    return handle >> SLOT_BITS


cdef class Request:
    """Scheduler-side state of one live request (read-only from Python)."""

    @property
    def phase_name(self):
        return RequestPhase(self.phase).name

    @property
    def next_stop(self):
        return self._next_stop()

    cdef int64_t _next_stop(self):
        if self.endpoints:
            return self.endpoints[0]
        return self.prompt_len

    def cut(self, int64_t take):
        return self._cut(take)

    cdef int64_t _cut(self, int64_t take):
        """The most of ``take`` prompt tokens from num_scheduled_tokens on that one chunk may feed: it may not end
        inside an atomic span (0: a span that began before the chunk would be cut, so this chunk cannot take it)."""
        cdef int64_t start = self.num_scheduled_tokens, end = start + take, a, b
        if not self.atomic_spans:
            return take
        for a, b in self.atomic_spans:
            if a >= end:
                break
            if a < end < b:
                return a - start if a > start else 0
        return take

    @property
    def num_private_pages(self):
        return self._block_table.shape[0] - self.num_shared_pages

    def __repr__(self):
        return (
            f"Request(handle={self.handle}, slot={self.slot}, phase={self.phase_name}, "
            f"computed={self.num_computed_tokens}/{self.prompt_len}, generated={self.num_generated_tokens})"
        )


cdef class ScheduledPlan:
    """One graph submission: plain arrays indexed by participant.

    kind, batch_capacity, token_capacity: the graph shape to launch.
    handles/slots/state_rows/epochs: who runs (int64/int32/int32/int64).
    token_starts, num_tokens: first absolute position and number of tokens
        fed per participant; token_offsets[i]:token_offsets[i+1] slices the
        flat token_ids (-1 = the token sampled by the previous, still
        in-flight decode step of that request).
    sample: 1 where the step produces logits and samples a token;
        generated_ends: the participant's cumulative sampled count after it.
    first_blocks, page_offsets, page_ids: block-table entries the step
        touches: page_ids[page_offsets[i]:page_offsets[i+1]] are entries
        first_blocks[i], first_blocks[i]+1, ... of participant i's table.
    copies: int32 [m, 4] rows (snapshot_id, state_row, page_id or -1,
        tokens in that partial page): restore copies snapshot -> slot,
        snapshot copies slot -> snapshot, and a prefill copies slot ->
        snapshot after its forward for each participant whose chunk ends
        at that participant's next checkpoint endpoint.
    """

    @property
    def num_participants(self):
        return len(self._requests)

    @property
    def shape(self):
        return (self.kind, self.batch_capacity, self.token_capacity)

    @property
    def kind_name(self):
        return GraphKind(self.kind).name

    def positions(self, Py_ssize_t i):
        cdef int64_t s = self.token_starts[i]
        return np.arange(s, s + self.num_tokens[i], dtype=np.int32)

    def tokens(self, Py_ssize_t i):
        return self.token_ids[self.token_offsets[i] : self.token_offsets[i + 1]]

    def pages(self, Py_ssize_t i):
        return self.page_ids[self.page_offsets[i] : self.page_offsets[i + 1]]

    def __repr__(self):
        return (
            f"ScheduledPlan({self.kind_name}, b={self.batch_capacity}, t={self.token_capacity}, "
            f"n={len(self._requests)}, est={self.estimated_duration_ns}ns)"
        )
