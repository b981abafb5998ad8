"""Random admit/plan/commit/complete/cancel/finish sequences.

The machine is the model thread plus a fake GPU with up to two frames in
flight. After every step check_integrity() must hold (no leak, no id owned
twice), and no page read by an in-flight frame may be handed to a new
request (no reuse before its fence). Teardown drains everything and checks
that only cached checkpoints still hold pages.
"""

import os

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from flared.errors import AdmissionError, ErrorKind
from flared.scheduler import GraphKind

from .helpers import MS, cost_ns, make_scheduler, records_for

_rng = np.random.default_rng(11)
# Conversations that share prefixes, so lookups, restores and duplicate
# publications all happen.
_system = _rng.integers(0, 1000, 70, dtype=np.int32)
FAMILIES = [np.concatenate([_system, _rng.integers(0, 1000, 60, dtype=np.int32)]) for _ in range(3)]
IMAGE = (56, 68)  # (across the first 64-token chunk's end, clear of the message boundaries)


class SchedulerMachine(RuleBasedStateMachine):
    initialize_state = False

    def __init__(self):
        super().__init__()
        self.s = make_scheduler(
            max_live_requests=4, num_pages=48, num_snapshots=6, page_tokens=16,
            context_capacity=512, prefill_chunk_size=64, initialize_state=self.initialize_state,
        )
        self.now_ns = 0
        self.fence = 0
        self.queue = []  # (fence, plan, block tables read by the frame)

    @rule(
        family=st.integers(0, 2),
        length=st.integers(1, 130),
        max_out=st.integers(1, 12),
        bounds=st.booleans(),
        score=st.sampled_from([False, False, False, True]),
        image=st.booleans(),
    )
    def admit(self, family, length, max_out, bounds, score, image):
        tokens = FAMILIES[family][:length]
        boundaries = [70, 100] if bounds else []
        # an image's tokens (Gemma 3's: one prefill chunk each) at 56..68, conditioned on the image as the worker
        # conditions them, in a prompt that holds all of them
        spans, conditioning = ((), ())
        if image and length >= IMAGE[1]:
            spans, conditioning = (IMAGE,), ((IMAGE[0], bytes([family]) * 32),)
        try:
            h = self.s.admit(tokens, max_out, self.now_ns, message_boundaries=boundaries, score_prompt=score,
                             atomic_spans=spans, conditioning=conditioning)
        except AdmissionError as e:
            assert e.kind is ErrorKind.MODEL_CAPACITY
            return
        r = self.s.request(h)
        fresh = set(self.s.block_table(h)[r.num_shared_pages :].tolist())
        for _, _, tables in self.queue:
            assert not fresh & tables, "page handed out while an in-flight frame reads it"

    @rule()
    def plan_and_commit(self):
        plan = self.s.plan(self.now_ns)
        if plan is None:
            return
        self.fence += 1
        tables = set()
        for i, h in enumerate(plan.handles):
            tables |= set(self.s.block_table(int(h)).tolist())
            if plan.kind in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL):  # (no chunk ends inside an image)
                end = int(plan.token_starts[i]) + int(plan.num_tokens[i])
                assert not any(a < end < b for a, b in self.s.request(int(h)).atomic_spans), (end, plan.kind)
        self.s.commit(plan, self.fence)
        self.queue.append((self.fence, plan, tables))

    @precondition(lambda self: self.queue)
    @rule()
    def complete_oldest(self):
        fence, plan, _ = self.queue.pop(0)
        d = cost_ns(plan)
        self.now_ns += d
        result = self.s.complete(fence, records_for(plan), d, self.now_ns)
        live = set(self.s.live_handles())
        assert not set(result.retired) & live

    @rule(frames=st.integers(1, 12))
    def run_frames(self, frames):
        """The steady loop: keep up to two frames queued, complete the oldest."""
        for _ in range(frames):
            self.plan_and_commit()
            if len(self.queue) == 2 or (self.queue and self.s.plan(self.now_ns) is None):
                self.complete_oldest()

    @rule(index=st.integers(0, 63), stop=st.booleans())
    def cancel_or_finish(self, index, stop):
        handles = self.s.live_handles()
        if not handles:
            return
        h = handles[index % len(handles)]
        released = self.s.finish(h, self.now_ns) if stop else self.s.cancel(h)
        for _, plan, _ in self.queue:
            assert not set(released) & set(plan.handles.tolist())

    @rule(ms=st.integers(0, 50))
    def advance_clock(self, ms):
        self.now_ns += ms * MS

    @invariant()
    def ledger_is_consistent(self):
        self.s.check_integrity()

    def teardown(self):
        while self.queue:
            self.complete_oldest()
        for h in self.s.live_handles():
            self.s.cancel(h)
        assert self.s.plan(self.now_ns) is None
        self.s.check_integrity()
        assert self.s.num_live == 0
        cache = self.s.cache
        assert self.s.pages.num_used == cache.num_cached_pages + cache.num_retired_pages
        assert self.s.snapshots.num_used == cache.num_cached_snapshots + cache.num_retired_snapshots


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestSchedulerMachine = SchedulerMachine.TestCase


class SlowSchedulerMachine(SchedulerMachine):
    pass


class InitializingSchedulerMachine(SchedulerMachine):
    initialize_state = True


SlowSchedulerMachine.TestCase.settings = settings(max_examples=3000, stateful_step_count=100, deadline=None)
TestSlowSchedulerMachine = pytest.mark.slow(SlowSchedulerMachine.TestCase)
InitializingSchedulerMachine.TestCase.settings = settings(max_examples=1000, stateful_step_count=100, deadline=None)
TestInitializingSchedulerMachine = pytest.mark.slow(InitializingSchedulerMachine.TestCase)
