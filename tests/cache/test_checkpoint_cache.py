"""PrefixCheckpointCache: exact ids, fences, pins and eviction order."""

import numpy as np
import pytest

from flared.cache import PrefixCheckpointCache, PrefixHistory, PublishOutcome

MODEL = b"m" * 32
PAGE_TOKENS = 16


def make_cache(num_pages=32, num_snapshots=8):
    return PrefixCheckpointCache(num_pages, num_snapshots, PAGE_TOKENS)


def make_history(num_tokens, seed=0):
    return PrefixHistory(MODEL, np.random.default_rng(seed).integers(0, 1000, num_tokens, dtype=np.int32))


def publish(cache, history, num_tokens, parent, pages, snapshot, fence=0):
    result = cache.publish(history, num_tokens, parent, np.asarray(pages, dtype=np.int32), snapshot, num_tokens, fence)
    cache.check_integrity()
    return result


def test_publish_then_lookup_returns_the_deepest_ready_match():
    cache = make_cache()
    h = make_history(100)
    a = publish(cache, h, 40, None, [0, 1], 0).checkpoint  # floor(40/16) = 2 pages
    b = publish(cache, h, 70, a, [2, 3], 1).checkpoint  # floor(70/16) - 2 = 2 pages
    assert (a.checkpoint_id, b.checkpoint_id) == (0, 1)
    assert cache.lookup(h) is b
    assert list(b.block_table()) == [0, 1, 2, 3]
    assert cache.lookup(h, max_num_tokens=69) is a
    assert cache.lookup(make_history(100, seed=1)) is None
    # Same tokens to 40, different after: only the shared ancestor matches.
    other = PrefixHistory(MODEL, np.concatenate([h.tokens()[:45], np.full(30, 7, np.int32)]))
    assert cache.lookup(other) is a
    cache.check_integrity()


def test_publish_validates_pages_snapshot_and_parent():
    cache = make_cache()
    h = make_history(100)
    with pytest.raises(ValueError, match="must own 2 complete pages"):
        publish(cache, h, 40, None, [0], 0)
    with pytest.raises(ValueError, match="outside the pool"):
        publish(cache, h, 40, None, [0, 99], 0)
    with pytest.raises(ValueError, match="twice"):
        publish(cache, h, 40, None, [3, 3], 0)
    with pytest.raises(ValueError, match="snapshot holds"):
        cache.publish(h, 40, None, np.array([0, 1], np.int32), 0, 39, 0)
    a = publish(cache, h, 40, None, [0, 1], 0).checkpoint
    with pytest.raises(ValueError, match="already owned"):
        publish(cache, h, 70, a, [1, 2], 1)
    with pytest.raises(ValueError, match="snapshot 0 is already owned"):
        publish(cache, h, 70, a, [2, 3], 0)
    with pytest.raises(ValueError, match="does not match"):
        publish(cache, make_history(100, seed=5), 70, a, [2, 3], 1)
    assert cache.num_checkpoints == 1
    cache.check_integrity()


def test_existing_publication_leaves_resources_with_the_caller():
    cache = make_cache()
    h = make_history(50)
    first = publish(cache, h, 33, None, [0, 1], 0)
    again = publish(cache, PrefixHistory(MODEL, h.tokens()), 33, None, [5, 6], 3)
    assert first.outcome is PublishOutcome.CREATED
    assert again.outcome is PublishOutcome.EXISTING and again.checkpoint is first.checkpoint
    assert not cache.owns_page(5) and not cache.owns_snapshot(3)
    assert cache.num_cached_pages == 2 and cache.next_checkpoint_id == 1


def test_readiness_fence_hides_a_created_checkpoint_until_advance_completed():
    cache = make_cache()
    h = make_history(64)
    c = publish(cache, h, 32, None, [4, 5], 2, fence=7).checkpoint
    assert not c.ready and cache.lookup(h) is None
    assert cache.advance_completed(6).ready == []
    assert cache.lookup(h) is None
    assert cache.advance_completed(7).ready == [c.checkpoint_id]
    assert cache.lookup(h) is c
    with pytest.raises(ValueError, match="backwards"):
        cache.advance_completed(6)
    cache.check_integrity()


def test_pending_cancellation_retires_behind_the_ready_fence():
    cache = make_cache()
    h = make_history(64)
    c = publish(cache, h, 32, None, [4, 5], 2, fence=9).checkpoint
    retired = cache.cancel_pending(c)
    assert (list(retired.page_ids), retired.snapshot_id, retired.final_use_fence) == ([4, 5], 2, 9)
    assert cache.owns_page(4)  # still reserved: the snapshot copy may be running
    cache.check_integrity()
    assert cache.advance_completed(8).reusable == []
    reusable = cache.advance_completed(9).reusable
    assert [r.checkpoint_id for r in reusable] == [c.checkpoint_id]
    assert not cache.owns_page(4) and not cache.owns_snapshot(2)
    assert cache.lookup(h) is None
    cache.check_integrity()


def test_direct_pin_accounting_keeps_ancestor_unpins_from_eating_descendant_pins():
    cache = make_cache()
    h = make_history(100)
    a = publish(cache, h, 20, None, [0], 0).checkpoint
    b = publish(cache, h, 40, a, [1], 1).checkpoint
    cache.pin(b)
    assert (a.direct_pins, a.total_pins, b.direct_pins, b.total_pins) == (0, 1, 1, 1)
    with pytest.raises(ValueError, match="no direct pin"):
        cache.unpin(a)
    cache.pin(a)
    cache.unpin(a)
    assert (a.total_pins, b.total_pins) == (1, 1)
    assert cache.evict(10, 10) == []  # pinned leaf and its ancestor stay
    cache.unpin(b)
    assert a.total_pins == 0
    cache.check_integrity()


def test_leaf_lru_eviction_order_and_final_use_fences():
    cache = make_cache()
    h1, h2 = make_history(100, seed=1), make_history(100, seed=2)
    a = publish(cache, h1, 32, None, [0, 1], 0).checkpoint  # id 0
    b = publish(cache, h1, 64, a, [2, 3], 1).checkpoint  # id 1, child of a
    c = publish(cache, h2, 16, None, [4], 2).checkpoint  # id 2
    d = publish(cache, h2, 20, c, [], 3).checkpoint  # id 3: partial tail lives in the snapshot
    cache.mark_used(b, 11)  # b and a touched after c, d; a and b now read by fence 11
    # Page pressure only: d has no pages, so c cannot become a leaf; b goes first.
    retired = cache.evict(2, 0)
    assert [(r.checkpoint_id, list(r.page_ids), r.snapshot_id, r.final_use_fence) for r in retired] == [
        (1, [2, 3], 1, 11)
    ]
    cache.check_integrity()
    # Snapshot pressure: LRU leaves are d (oldest), then c (its parent became a leaf), then a.
    retired = cache.evict(0, 2)
    assert [r.checkpoint_id for r in retired] == [3, 2]
    assert cache.num_checkpoints == 1 and cache.get(0) is a
    # Retired ids stay reserved until their fence: d/c fence 0 is already complete.
    reusable = cache.advance_completed(10).reusable
    assert sorted(r.checkpoint_id for r in reusable) == [2, 3]
    assert cache.owns_page(2)  # b waits for fence 11
    assert [r.checkpoint_id for r in cache.advance_completed(11).reusable] == [1]
    cache.check_integrity()
    # Ids are never reused after eviction.
    e = publish(cache, h2, 16, None, [4], 2).checkpoint
    assert e.checkpoint_id == 4
    cache.check_integrity()


def test_eviction_skips_pending_checkpoints_and_stops_when_nothing_is_evictable():
    cache = make_cache()
    h = make_history(64)
    a = publish(cache, h, 16, None, [0], 0).checkpoint
    publish(cache, h, 32, a, [1], 1, fence=5)
    assert cache.evictable_resources() == (0, 0)
    assert cache.evict(1, 1) == []
    cache.advance_completed(5)
    assert cache.evictable_resources() == (2, 2)
    assert [r.checkpoint_id for r in cache.evict(1, 2)] == [1, 0]
    cache.check_integrity()


def test_page_pressure_takes_a_page_less_leaf_that_alone_stands_over_pages():
    """A finished request's last checkpoint often holds no page of its own (its tail is in its snapshot) and keeps
    its parent, which holds the pages, from being a leaf. Under page pressure with no leaf holding pages, such a
    leaf goes (LRU first), and then its parent; a page-less leaf with no pages above it stays."""
    cache = make_cache()
    h1, h2 = make_history(100, seed=1), make_history(100, seed=2)
    a = publish(cache, h1, 32, None, [0, 1], 0).checkpoint  # id 0
    publish(cache, h1, 40, a, [], 1)  # id 1: its tail in snapshot 1
    c = publish(cache, h2, 16, None, [2], 2).checkpoint  # id 2
    publish(cache, h2, 20, c, [], 3)  # id 3
    publish(cache, make_history(10, seed=3), 10, None, [], 4)  # id 4: nothing above it
    assert [r.checkpoint_id for r in cache.evict(2, 0)] == [1, 0]
    cache.check_integrity()
    assert [r.checkpoint_id for r in cache.evict(1, 0)] == [3, 2]
    assert cache.evict(1, 0) == [] and cache.num_checkpoints == 1
    cache.check_integrity()
