"""Random publish/pin/use/evict/advance sequences against the cache ledger.

The machine plays the caller: it owns the free page and snapshot ids, hands
them to the cache on CREATED, and takes them back only from
``advance_completed(...).reusable``. Invariants: no id is in two places, no
id comes back before its final-use fence, check_integrity holds every step.
"""

import os

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from flared.cache import PrefixCheckpointCache, PrefixHistory, PublishOutcome

MODEL = b"s" * 32
PAGE_TOKENS = 8
NUM_PAGES = 24
NUM_SNAPSHOTS = 6
# Four conversations sharing their first 20 tokens; lookups and publications
# therefore meet on common ancestors.
_rng = np.random.default_rng(7)
_shared = _rng.integers(0, 100, 20, dtype=np.int32)
HISTORIES = [PrefixHistory(MODEL, np.concatenate([_shared, _rng.integers(0, 100, 40, dtype=np.int32)])) for _ in range(4)]


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = PrefixCheckpointCache(NUM_PAGES, NUM_SNAPSHOTS, PAGE_TOKENS)
        self.free_pages = set(range(NUM_PAGES))
        self.free_snapshots = set(range(NUM_SNAPSHOTS))
        self.fence = 0  # last fence handed out
        self.completed = 0
        self.pins = []  # checkpoints we pinned, one entry per pin
        self.retired = {}  # checkpoint id -> RetiredResources
        self.last_id = -1

    @rule(which=st.integers(0, 3), endpoint=st.integers(1, 60), delay=st.integers(0, 2))
    def publish(self, which, endpoint, delay):
        h = HISTORIES[which]
        parent = self.cache.lookup(h, max_num_tokens=endpoint - 1)
        start = 0 if parent is None else parent.num_tokens
        num_pages = endpoint // PAGE_TOKENS - start // PAGE_TOKENS
        if num_pages > len(self.free_pages) or not self.free_snapshots:
            return
        pages = sorted(self.free_pages)[:num_pages]
        snapshot = min(self.free_snapshots)
        self.fence += 1
        ready_fence = self.completed + delay
        result = self.cache.publish(h, endpoint, parent, np.array(pages, np.int32), snapshot, endpoint, ready_fence)
        if result.outcome is PublishOutcome.CREATED:
            assert result.checkpoint.checkpoint_id == self.last_id + 1
            self.last_id += 1
            self.free_pages -= set(pages)
            self.free_snapshots.discard(snapshot)
        else:
            assert result.checkpoint.key == h.key_at(endpoint)

    @rule(which=st.integers(0, 3))
    def pin_hit(self, which):
        c = self.cache.lookup(HISTORIES[which])
        if c is not None:
            assert c.ready
            self.cache.pin(c)
            self.pins.append(c)

    @precondition(lambda self: self.pins)
    @rule(index=st.integers(0, 100))
    def unpin(self, index):
        c = self.pins.pop(index % len(self.pins))
        self.fence += 1
        self.cache.mark_used(c, self.fence)  # the pinned reader ran at this fence
        self.cache.unpin(c)

    @rule(pages=st.integers(0, 6), snapshots=st.integers(0, 3))
    def evict(self, pages, snapshots):
        for r in self.cache.evict(pages, snapshots):
            assert r.checkpoint_id not in self.retired
            assert all(c.checkpoint_id != r.checkpoint_id for c in self.pins)
            self.retired[r.checkpoint_id] = r

    @rule()
    def cancel_a_pending_leaf(self):
        for cid in range(self.last_id + 1):
            c = self.cache.get(cid)
            if c is not None and not c.ready and c.num_children == 0 and c.total_pins == 0:
                self.retired[cid] = self.cache.cancel_pending(c)
                return

    @rule(step=st.integers(0, 3))
    def advance(self, step):
        self.completed = min(self.fence, self.completed + step) if self.fence else self.completed
        result = self.cache.advance_completed(self.completed)
        for r in result.reusable:
            assert r.final_use_fence <= self.completed
            assert self.retired.pop(r.checkpoint_id) is r
            assert not (set(r.page_ids.tolist()) & self.free_pages)
            assert r.snapshot_id not in self.free_snapshots
            self.free_pages |= set(r.page_ids.tolist())
            self.free_snapshots.add(r.snapshot_id)

    @invariant()
    def ledger_is_consistent(self):
        self.cache.check_integrity()
        owned = {p for p in range(NUM_PAGES) if self.cache.owns_page(p)}
        assert not owned & self.free_pages
        assert len(owned) + len(self.free_pages) == NUM_PAGES
        owned_snapshots = {s for s in range(NUM_SNAPSHOTS) if self.cache.owns_snapshot(s)}
        assert len(owned_snapshots) + len(self.free_snapshots) == NUM_SNAPSHOTS
        for r in self.retired.values():
            assert r.final_use_fence > self.completed or self.cache.owns_snapshot(r.snapshot_id)


CacheMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("FLARED_CACHE_EXAMPLES", "60")),
    stateful_step_count=40,
    deadline=None,
)
TestCacheMachine = CacheMachine.TestCase
