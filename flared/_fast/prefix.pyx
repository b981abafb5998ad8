# cython: language_level=3
"""Exact prefix keys and the checkpoint cache's ownership ledger.

Rules of PrefixHistory (key stability is the whole point; tests check each):
- Keys are BLAKE2b-128. Every key hashes the 32-byte model/recipe identity
  first, so two models never share a key.
- A complete 64-token block's key hashes its parent block key, its 64 token
  ids and the conditioning events whose position lies inside the block.
  Complete-block keys never depend on partial endpoints.
- An exact partial endpoint T (not a multiple of 64) hashes the aligned
  parent block key, the count and ids of the remaining tokens, and the events
  with a position in [floor(T/64)*64, T).
- An event at position N is consumed by a prefix only when the prefix
  covers position N (T > N). Events are appended in order, never at a
  position already consumed, so appending tokens or events never changes a
  key that could have been computed before.

Rules of PrefixCheckpointCache (it owns metadata and ids, never storage):
- A checkpoint is an immutable exact endpoint. It privately owns the complete
  pages between its parent's endpoint S and its own T
  (floor(T/P) - floor(S/P) pages) and one snapshot row; ancestor pages are
  reached through parent links.
- A page or snapshot id is owned by at most one checkpoint, or retired, or
  not the cache's at all. Retired ids stay reserved until
  ``advance_completed`` reports their final-use fence; only its
  ``reusable`` list hands them back.
- Fences are one monotonic completion timeline supplied by the caller.
- A created checkpoint is invisible to lookup until its ready fence
  completes; lookup only walks through ready checkpoints.
- Pins count on the pinned checkpoint (direct) and on it and every ancestor
  (total). Only unpinned, ready leaves are evicted, least recently used first
  (ties: lower checkpoint id first).
- Checkpoint ids are monotonic and never reused.
"""

import enum
import hashlib
from collections import namedtuple

import numpy as np
cimport numpy as cnp
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdint cimport int32_t, int64_t, uint8_t

cnp.import_array()

# Tokens per hashed block: fixed by the key format, independent of the
# KV-cache page size so keys survive a change of page_tokens.
cdef enum:
    BLOCK_TOKENS = 64
BLOCK_TOKENS_PY = BLOCK_TOKENS
IDENTITY_BYTES = 32
KEY_BYTES = 16

cdef int64_t NOT_OWNED = -1
cdef int64_t RETIRED = -2

# Domain tags keep the three key shapes from ever colliding.
cdef bytes _TAG_ROOT = b"flared.prefix.root"
cdef bytes _TAG_BLOCK = b"B"
cdef bytes _TAG_PARTIAL = b"P"
cdef bytes _TAG_EVENT = b"E"


cdef inline bytes _check_identity(object identity, str what):
    cdef bytes b = bytes(identity)
    if len(b) != IDENTITY_BYTES:
        raise ValueError(f"{what} must be {IDENTITY_BYTES} bytes, got {len(b)}")
    return b


cdef class PrefixHistory:
    """Incremental exact-prefix keys over a growing token sequence."""

    def __cinit__(self, identity, *args, **kwargs):
        self.identity = _check_identity(identity, "model identity")
        self._token_array = np.empty(256, dtype=np.int32)
        self._tokens = self._token_array
        self.num_tokens = 0
        self._block_keys = []
        self._event_positions = []
        self._event_identities = []
        self._base_hasher = hashlib.blake2b(self.identity, digest_size=KEY_BYTES)
        h = self._base_hasher.copy()
        h.update(_TAG_ROOT)
        self.root_key = h.digest()

    def __init__(self, identity, tokens=None):
        if tokens is not None:
            self.append_tokens(tokens)

    @property
    def num_blocks(self):
        return len(self._block_keys)

    @property
    def num_events(self):
        return len(self._event_positions)

    def tokens(self):
        """A copy of the consumed token ids (int32)."""
        return np.array(self._token_array[: self.num_tokens], dtype=np.int32)

    def append_tokens(self, tokens):
        cdef int32_t[::1] src = np.ascontiguousarray(tokens, dtype=np.int32)
        cdef Py_ssize_t n = src.shape[0], i
        cdef int64_t need = self.num_tokens + n
        cdef int64_t cap = self._tokens.shape[0]
        if need > cap:
            while cap < need:
                cap *= 2
            grown = np.empty(cap, dtype=np.int32)
            grown[: self.num_tokens] = self._token_array[: self.num_tokens]
            self._token_array = grown
            self._tokens = grown
        for i in range(n):
            self._tokens[self.num_tokens + i] = src[i]
        self.num_tokens = need
        self._hash_new_blocks()

    def append_token(self, int32_t token):
        self.append_tokens(np.array([token], dtype=np.int32))

    def append_conditioning(self, int64_t position, identity):
        """Record a conditioning event (an image, ...) at an absolute position.

        The position may not be one already consumed, and events come in
        position order; events at one position keep their append order.
        """
        cdef bytes ident = _check_identity(identity, "conditioning identity")
        if position < self.num_tokens:
            raise ValueError(
                f"conditioning at position {position} would change consumed prefix of {self.num_tokens} tokens"
            )
        if self._event_positions and position < self._event_positions[len(self._event_positions) - 1]:
            raise ValueError(
                f"conditioning at position {position} precedes the last event at {self._event_positions[len(self._event_positions) - 1]}"
            )
        self._event_positions.append(position)
        self._event_identities.append(ident)

    cdef bytes _hash_span(self, bytes parent_key, int64_t start, int64_t end, bint partial):
        h = self._base_hasher.copy()
        h.update(parent_key)
        if partial:
            h.update(_TAG_PARTIAL)
            h.update(int(end - start).to_bytes(4, "little"))
        else:
            h.update(_TAG_BLOCK)
        h.update(PyBytes_FromStringAndSize(<char*>&self._tokens[start], (end - start) * 4))
        cdef Py_ssize_t i, n = len(self._event_positions)
        cdef int64_t pos
        # Events are sorted by position; a short scan from the first one in
        # range is enough (few events per prompt).
        for i in range(n):
            pos = self._event_positions[i]
            if pos >= end:
                break
            if pos >= start:
                h.update(_TAG_EVENT)
                h.update(int(pos).to_bytes(8, "little"))
                h.update(self._event_identities[i])
        return h.digest()

    cdef int _hash_new_blocks(self) except -1:
        cdef int64_t b = len(self._block_keys)
        cdef int64_t num_complete = self.num_tokens // BLOCK_TOKENS
        cdef bytes parent = self._block_keys[b - 1] if b > 0 else self.root_key
        cdef bint no_events = len(self._event_positions) == 0
        while b < num_complete:
            if no_events:
                # Hot path for long text prompts: no event scan.
                h = self._base_hasher.copy()
                h.update(parent)
                h.update(_TAG_BLOCK)
                h.update(PyBytes_FromStringAndSize(<char*>&self._tokens[b * BLOCK_TOKENS], BLOCK_TOKENS * 4))
                parent = h.digest()
            else:
                parent = self._hash_span(parent, b * BLOCK_TOKENS, (b + 1) * BLOCK_TOKENS, False)
            self._block_keys.append(parent)
            b += 1
        return 0

    cpdef bytes key_at(self, int64_t num_tokens):
        """Key of the exact prefix of ``num_tokens`` tokens (0 = root)."""
        if num_tokens < 0 or num_tokens > self.num_tokens:
            raise ValueError(f"endpoint {num_tokens} outside 0..{self.num_tokens}")
        cdef int64_t aligned = (num_tokens // BLOCK_TOKENS) * BLOCK_TOKENS
        cdef bytes parent = self.root_key if aligned == 0 else self._block_keys[aligned // BLOCK_TOKENS - 1]
        if aligned == num_tokens:
            return parent
        return self._hash_span(parent, aligned, num_tokens, True)

    def block_key(self, int64_t index):
        return self._block_keys[index]


# ---------------------------------------------------------------------------
# Checkpoint cache

class PublishOutcome(enum.IntEnum):
    # The proposal's pages and snapshot now belong to the cache.
    CREATED = 1
    # An identical checkpoint exists; the proposal's resources stay with the caller.
    EXISTING = 2


# outcome: PublishOutcome; checkpoint: the created or existing Checkpoint.
PublishResult = namedtuple("PublishResult", "outcome checkpoint")
# Ids taken from the cache by eviction or pending cancellation. They are
# reusable only once advance_completed reports final_use_fence.
RetiredResources = namedtuple("RetiredResources", "checkpoint_id page_ids snapshot_id final_use_fence")
# ready: checkpoint ids that became visible to lookup;
# reusable: RetiredResources whose final-use fence has completed.
AdvanceResult = namedtuple("AdvanceResult", "ready reusable")


cdef inline bint _older(Checkpoint a, Checkpoint b):
    """``a`` goes before ``b`` in eviction order: used longer ago, or as long ago and published first."""
    return a.last_used_tick < b.last_used_tick or (
        a.last_used_tick == b.last_used_tick and a.checkpoint_id < b.checkpoint_id)


cdef class Checkpoint:
    def __repr__(self):
        return (
            f"Checkpoint(id={self.checkpoint_id}, tokens={self.num_tokens}, "
            f"parent={None if self.parent is None else self.parent.checkpoint_id}, "
            f"pages={list(self.page_ids)}, snapshot={self.snapshot_id}, ready={self.ready}, "
            f"pins={self.direct_pins}/{self.total_pins})"
        )

    @property
    def parent_id(self):
        return -1 if self.parent is None else self.parent.checkpoint_id

    def block_table(self):
        """All complete page ids from the root to this checkpoint, in order."""
        chain = []
        cdef Checkpoint c = self
        while c is not None:
            chain.append(c.page_ids)
            c = c.parent
        chain.reverse()
        if not chain:
            return np.empty(0, dtype=np.int32)
        return np.concatenate(chain).astype(np.int32, copy=False)


cdef class PrefixCheckpointCache:
    """Metadata of immutable exact checkpoints; see the module rules."""

    def __cinit__(self, int32_t num_pages, int32_t num_snapshots, int32_t page_tokens):
        if num_pages <= 0 or num_snapshots <= 0 or page_tokens <= 0:
            raise ValueError("num_pages, num_snapshots and page_tokens must be positive")
        self.num_pages = num_pages
        self.num_snapshots = num_snapshots
        self.page_tokens = page_tokens
        self._page_owner = np.full(num_pages, NOT_OWNED, dtype=np.int64)
        self._snapshot_owner = np.full(num_snapshots, NOT_OWNED, dtype=np.int64)
        self.next_checkpoint_id = 0
        self.completed_fence = 0
        self._tick = 0
        self._by_id = {}
        self._by_key = {}
        self._roots = []
        self._pending = []
        self._retired = []
        self.num_cached_pages = 0
        self.num_retired_pages = 0
        self.num_retired_snapshots = 0

    # -- queries ---------------------------------------------------------

    @property
    def num_checkpoints(self):
        return len(self._by_id)

    @property
    def num_ready(self):
        return len(self._by_id) - len(self._pending)

    @property
    def num_cached_snapshots(self):
        return len(self._by_id)

    def get(self, int64_t checkpoint_id):
        """The live checkpoint with this id, or None once evicted."""
        return self._by_id.get(checkpoint_id)

    def owns_page(self, int32_t page_id):
        return self._page_owner[page_id] != NOT_OWNED

    def owns_snapshot(self, int32_t snapshot_id):
        return self._snapshot_owner[snapshot_id] != NOT_OWNED

    def lookup(self, PrefixHistory history, int64_t max_num_tokens=-1, bint touch=True):
        """Deepest ready checkpoint whose key is a prefix of ``history``.

        ``max_num_tokens`` bounds the endpoint (default: the whole history).
        A hit refreshes the LRU position of the path unless ``touch`` is off.
        """
        cdef int64_t limit = history.num_tokens if max_num_tokens < 0 else min(max_num_tokens, history.num_tokens)
        cdef Checkpoint best = None, c
        stack = [self._roots]
        keys = {}
        while stack:
            for c in stack.pop():
                if not c.ready or c.num_tokens > limit:
                    continue
                key = keys.get(c.num_tokens)
                if key is None:
                    key = history.key_at(c.num_tokens)
                    keys[c.num_tokens] = key
                if key != c.key:
                    continue
                if best is None or c.num_tokens > best.num_tokens:
                    best = c
                if c.children:
                    stack.append(c.children)
        if best is not None and touch:
            self._touch(best)
        return best

    cdef void _touch(self, Checkpoint c):
        self._tick += 1
        while c is not None:
            c.last_used_tick = self._tick
            c = c.parent

    # -- publication -----------------------------------------------------

    def publish(
        self,
        PrefixHistory history,
        int64_t num_tokens,
        Checkpoint parent,
        page_ids,
        int32_t snapshot_id,
        int64_t snapshot_num_tokens,
        int64_t ready_fence,
    ):
        """Propose an exact checkpoint at ``num_tokens`` of ``history``.

        Returns PublishResult. EXISTING leaves ``page_ids``/``snapshot_id``
        with the caller (its outstanding work on them must still complete
        before it reuses them).
        """
        if snapshot_num_tokens != num_tokens:
            raise ValueError(f"snapshot holds {snapshot_num_tokens} tokens, endpoint is {num_tokens}")
        if num_tokens <= 0 or num_tokens > history.num_tokens:
            raise ValueError(f"endpoint {num_tokens} outside 1..{history.num_tokens}")
        cdef int64_t parent_tokens = 0
        if parent is not None:
            if self._by_id.get(parent.checkpoint_id) is not parent:
                raise ValueError(f"parent checkpoint {parent.checkpoint_id} is not in this cache")
            parent_tokens = parent.num_tokens
            if parent_tokens >= num_tokens:
                raise ValueError(f"parent endpoint {parent_tokens} is not before {num_tokens}")
            if history.key_at(parent_tokens) != parent.key:
                raise ValueError(f"parent checkpoint {parent.checkpoint_id} does not match the history")
        cdef bytes key = history.key_at(num_tokens)
        existing = self._by_key.get(key)
        if existing is not None:
            return PublishResult(PublishOutcome.EXISTING, existing)

        cdef int32_t[::1] pages = np.ascontiguousarray(page_ids, dtype=np.int32)
        cdef int64_t expected = num_tokens // self.page_tokens - parent_tokens // self.page_tokens
        if pages.shape[0] != expected:
            raise ValueError(
                f"checkpoint {parent_tokens}->{num_tokens} must own {expected} complete pages, got {pages.shape[0]}"
            )
        cdef Py_ssize_t i, j
        for i in range(pages.shape[0]):
            if pages[i] < 0 or pages[i] >= self.num_pages:
                raise ValueError(f"page id {pages[i]} outside the pool of {self.num_pages}")
            if self._page_owner[pages[i]] != NOT_OWNED:
                raise ValueError(f"page {pages[i]} is already owned by the cache")
            for j in range(i):
                if pages[j] == pages[i]:
                    raise ValueError(f"page {pages[i]} appears twice")
        if snapshot_id < 0 or snapshot_id >= self.num_snapshots:
            raise ValueError(f"snapshot id {snapshot_id} outside 0..{self.num_snapshots - 1}")
        if self._snapshot_owner[snapshot_id] != NOT_OWNED:
            raise ValueError(f"snapshot {snapshot_id} is already owned by the cache")

        cdef Checkpoint c = Checkpoint.__new__(Checkpoint)
        c.checkpoint_id = self.next_checkpoint_id
        self.next_checkpoint_id += 1
        c.key = key
        c.parent = parent
        c.num_tokens = num_tokens
        c.page_ids = np.array(pages, dtype=np.int32)
        c.page_ids.setflags(write=False)
        c.snapshot_id = snapshot_id
        c.ready_fence = ready_fence
        c.last_use_fence = ready_fence
        c.ready = ready_fence <= self.completed_fence
        c.children = []
        self._tick += 1
        c.last_used_tick = self._tick
        for i in range(pages.shape[0]):
            self._page_owner[pages[i]] = c.checkpoint_id
        self._snapshot_owner[snapshot_id] = c.checkpoint_id
        self.num_cached_pages += pages.shape[0]
        self._by_id[c.checkpoint_id] = c
        self._by_key[key] = c
        if parent is None:
            self._roots.append(c)
        else:
            parent.children.append(c)
            parent.num_children += 1
        if not c.ready:
            self._pending.append(c)
        return PublishResult(PublishOutcome.CREATED, c)

    def cancel_pending(self, Checkpoint c):
        """Withdraw a created checkpoint whose ready fence has not completed.

        Its resources retire behind that fence. It must be an unpinned leaf.
        """
        if self._by_id.get(c.checkpoint_id) is not c or c.ready:
            raise ValueError(f"checkpoint {c.checkpoint_id} is not pending in this cache")
        if c.num_children or c.total_pins:
            raise ValueError(f"pending checkpoint {c.checkpoint_id} has children or pins")
        self._pending.remove(c)
        return self._retire(c)

    # -- pins and use ----------------------------------------------------

    def pin(self, Checkpoint c):
        if self._by_id.get(c.checkpoint_id) is not c:
            raise ValueError(f"checkpoint {c.checkpoint_id} is not in this cache")
        c.direct_pins += 1
        cdef Checkpoint a = c
        while a is not None:
            a.total_pins += 1
            a = a.parent

    def unpin(self, Checkpoint c):
        if self._by_id.get(c.checkpoint_id) is not c:
            raise ValueError(f"checkpoint {c.checkpoint_id} is not in this cache")
        if c.direct_pins <= 0:
            raise ValueError(f"checkpoint {c.checkpoint_id} has no direct pin to release")
        c.direct_pins -= 1
        cdef Checkpoint a = c
        while a is not None:
            a.total_pins -= 1
            a = a.parent

    def mark_used(self, Checkpoint c, int64_t fence):
        """Record GPU work (submitted at ``fence``) that reads ``c`` and its ancestors."""
        if self._by_id.get(c.checkpoint_id) is not c:
            raise ValueError(f"checkpoint {c.checkpoint_id} is not in this cache")
        self._tick += 1
        cdef Checkpoint a = c
        while a is not None:
            if fence > a.last_use_fence:
                a.last_use_fence = fence
            a.last_used_tick = self._tick
            a = a.parent

    # -- eviction and retirement -----------------------------------------

    cdef object _retire(self, Checkpoint c):
        cdef Py_ssize_t i
        cdef const int32_t[::1] pages = c.page_ids
        del self._by_id[c.checkpoint_id]
        del self._by_key[c.key]
        if c.parent is None:
            self._roots.remove(c)
        else:
            c.parent.children.remove(c)
            c.parent.num_children -= 1
        for i in range(pages.shape[0]):
            self._page_owner[pages[i]] = RETIRED
        self._snapshot_owner[c.snapshot_id] = RETIRED
        self.num_cached_pages -= pages.shape[0]
        self.num_retired_pages += pages.shape[0]
        self.num_retired_snapshots += 1
        r = RetiredResources(c.checkpoint_id, c.page_ids, c.snapshot_id, max(c.ready_fence, c.last_use_fence))
        self._retired.append(r)
        return r

    def evict(self, int64_t num_pages, int64_t num_snapshots):
        """Evict unpinned ready leaves, LRU first, until at least ``num_pages``
        pages and ``num_snapshots`` snapshots are retired (or nothing more can be).

        A leaf is taken only if it helps a target still unmet: with only page
        pressure left, a page-less leaf stays while a leaf holding pages is
        there to take, and is taken (LRU first) when none is but an ancestor of
        it holds pages (a request's last checkpoint, its tail in the snapshot,
        is such a leaf: its removal lets its parent's pages go). Returns the
        RetiredResources.
        """
        out = []
        cdef int64_t got_pages = 0, got_snapshots = 0
        cdef Checkpoint c, victim, bare
        cdef bint need_pages, need_snapshots
        while True:
            need_pages = got_pages < num_pages
            need_snapshots = got_snapshots < num_snapshots
            if not need_pages and not need_snapshots:
                break
            victim = None
            bare = None  # (the LRU page-less leaf above which pages lie)
            for c in self._by_id.values():
                if not c.ready or c.num_children or c.total_pins:
                    continue
                if not need_snapshots and len(c.page_ids) == 0:
                    if self._pages_above(c) and (bare is None or _older(c, bare)):
                        bare = c
                    continue
                if victim is None or _older(c, victim):
                    victim = c
            if victim is None:
                victim = bare
            if victim is None:
                break
            got_pages += len(victim.page_ids)
            got_snapshots += 1
            out.append(self._retire(victim))
        return out

    def evictable_resources(self):
        """(pages, snapshots) that evicting every unpinned subtree would retire."""
        cdef int64_t pages = 0, snapshots = 0
        cdef Checkpoint c
        for c in self._by_id.values():
            if c.ready and c.total_pins == 0 and not self._has_pending_descendant(c):
                pages += len(c.page_ids)
                snapshots += 1
        return pages, snapshots

    cdef bint _pages_above(self, Checkpoint c):
        """Whether an ancestor of ``c`` holds pages."""
        cdef Checkpoint p = c.parent
        while p is not None:
            if len(p.page_ids):
                return True
            p = p.parent
        return False

    cdef bint _has_pending_descendant(self, Checkpoint c):
        cdef Checkpoint d
        for d in c.children:
            if not d.ready or self._has_pending_descendant(d):
                return True
        return False

    def advance_completed(self, int64_t fence):
        """Report that every fence <= ``fence`` has completed."""
        if fence < self.completed_fence:
            raise ValueError(f"completed fence went backwards: {fence} < {self.completed_fence}")
        self.completed_fence = fence
        ready = []
        cdef Checkpoint c
        if self._pending:
            still = []
            for c in self._pending:
                if c.ready_fence <= fence:
                    c.ready = True
                    ready.append(c.checkpoint_id)
                else:
                    still.append(c)
            self._pending = still
        reusable = []
        cdef Py_ssize_t i
        cdef const int32_t[::1] pages
        if self._retired:
            keep = []
            for r in self._retired:
                if r.final_use_fence <= fence:
                    pages = r.page_ids
                    for i in range(pages.shape[0]):
                        self._page_owner[pages[i]] = NOT_OWNED
                    self._snapshot_owner[r.snapshot_id] = NOT_OWNED
                    self.num_retired_pages -= pages.shape[0]
                    self.num_retired_snapshots -= 1
                    reusable.append(r)
                else:
                    keep.append(r)
            self._retired = keep
        return AdvanceResult(ready, reusable)

    # -- integrity --------------------------------------------------------

    def check_integrity(self):
        """Recompute every derived count and ownership mark; raise on mismatch."""
        page_owner = np.full(self.num_pages, NOT_OWNED, dtype=np.int64)
        snap_owner = np.full(self.num_snapshots, NOT_OWNED, dtype=np.int64)
        cdef Checkpoint c, d
        cached_pages = 0
        for cid, c in self._by_id.items():
            if c.checkpoint_id != cid or c.checkpoint_id >= self.next_checkpoint_id:
                raise AssertionError(f"checkpoint id {cid} inconsistent")
            if self._by_key.get(c.key) is not c:
                raise AssertionError(f"checkpoint {cid} missing from the key index")
            if c.parent is not None and self._by_id.get(c.parent.checkpoint_id) is not c.parent:
                raise AssertionError(f"checkpoint {cid} has an evicted parent")
            parent_tokens = 0 if c.parent is None else c.parent.num_tokens
            if len(c.page_ids) != c.num_tokens // self.page_tokens - parent_tokens // self.page_tokens:
                raise AssertionError(f"checkpoint {cid} owns {len(c.page_ids)} pages")
            for p in c.page_ids:
                if page_owner[p] != NOT_OWNED:
                    raise AssertionError(f"page {p} owned twice")
                page_owner[p] = cid
            cached_pages += len(c.page_ids)
            if snap_owner[c.snapshot_id] != NOT_OWNED:
                raise AssertionError(f"snapshot {c.snapshot_id} owned twice")
            snap_owner[c.snapshot_id] = cid
            if c.num_children != len(c.children):
                raise AssertionError(f"checkpoint {cid} child count")
            subtree = c.direct_pins
            for d in c.children:
                if d.parent is not c:
                    raise AssertionError(f"checkpoint {d.checkpoint_id} child link")
                subtree += d.total_pins
            if subtree != c.total_pins or c.direct_pins < 0:
                raise AssertionError(f"checkpoint {cid} pins {c.direct_pins}/{c.total_pins} != subtree {subtree}")
            if c.ready != (c not in self._pending):
                raise AssertionError(f"checkpoint {cid} readiness vs pending list")
            if c.ready and c.ready_fence > self.completed_fence:
                raise AssertionError(f"checkpoint {cid} ready before its fence")
        if len(self._by_key) != len(self._by_id):
            raise AssertionError("key index size")
        for c in self._roots:
            if c.parent is not None or self._by_id.get(c.checkpoint_id) is not c:
                raise AssertionError("root list")
        retired_pages = 0
        for r in self._retired:
            for p in r.page_ids:
                if page_owner[p] != NOT_OWNED:
                    raise AssertionError(f"retired page {p} also owned")
                page_owner[p] = RETIRED
            retired_pages += len(r.page_ids)
            if snap_owner[r.snapshot_id] != NOT_OWNED:
                raise AssertionError(f"retired snapshot {r.snapshot_id} also owned")
            snap_owner[r.snapshot_id] = RETIRED
        if not np.array_equal(page_owner, np.asarray(self._page_owner)):
            raise AssertionError("page ownership marks disagree with checkpoints")
        if not np.array_equal(snap_owner, np.asarray(self._snapshot_owner)):
            raise AssertionError("snapshot ownership marks disagree with checkpoints")
        if cached_pages != self.num_cached_pages or retired_pages != self.num_retired_pages:
            raise AssertionError("page counters")
        if len(self._retired) != self.num_retired_snapshots:
            raise AssertionError("snapshot counters")
        return True
