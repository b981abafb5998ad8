from libc.stdint cimport int32_t, int64_t, uint8_t


cdef class PrefixHistory:
    # 32-byte model/recipe identity; mixed into the root and every block key.
    cdef readonly bytes identity
    # Token ids consumed so far: _tokens[0:num_tokens] (grows by doubling).
    cdef object _token_array
    cdef int32_t[::1] _tokens
    cdef readonly int64_t num_tokens
    # Key of the empty prefix.
    cdef readonly bytes root_key
    # _block_keys[i] is the key of the prefix ending at (i + 1) * 64 tokens.
    cdef list _block_keys
    # Conditioning events in append order (positions nondecreasing):
    # absolute token position and 32-byte identity.
    cdef list _event_positions
    cdef list _event_identities
    # blake2b(digest_size=16) already fed the identity; copied per key.
    cdef object _base_hasher

    cdef bytes _hash_span(self, bytes parent_key, int64_t start, int64_t end, bint partial)
    cdef int _hash_new_blocks(self) except -1
    cpdef bytes key_at(self, int64_t num_tokens)


cdef class Checkpoint:
    # Monotonic id within one cache; never reused after eviction.
    cdef readonly int64_t checkpoint_id
    # Exact prefix key (16 bytes) of the endpoint.
    cdef readonly bytes key
    # Parent checkpoint (None for a root child) and its endpoint in tokens.
    cdef readonly Checkpoint parent
    cdef readonly int64_t num_tokens
    # Complete pages owned privately: floor(T/P) - floor(S/P) of them.
    cdef readonly object page_ids
    # Snapshot row holding the complete state at num_tokens.
    cdef readonly int32_t snapshot_id
    # Fence after which the checkpoint's contents are written (readiness).
    cdef readonly int64_t ready_fence
    # Latest fence of any submitted GPU work that reads this checkpoint.
    cdef readonly int64_t last_use_fence
    cdef readonly bint ready
    # Pins taken on this checkpoint itself / on it or any descendant.
    cdef readonly int64_t direct_pins
    cdef readonly int64_t total_pins
    cdef readonly int64_t num_children
    # Logical LRU clock value of the last lookup hit or mark_used.
    cdef readonly int64_t last_used_tick
    cdef list children


cdef class PrefixCheckpointCache:
    cdef readonly int32_t num_pages
    cdef readonly int32_t num_snapshots
    cdef readonly int32_t page_tokens
    # Owner of each page / snapshot id: checkpoint id, -1 not the cache's,
    # -2 retired (evicted or cancelled, waiting for its final-use fence).
    cdef int64_t[::1] _page_owner
    cdef int64_t[::1] _snapshot_owner
    cdef readonly int64_t next_checkpoint_id
    cdef readonly int64_t completed_fence
    cdef int64_t _tick
    # checkpoint id -> Checkpoint, key -> Checkpoint (pending or ready).
    cdef dict _by_id
    cdef dict _by_key
    # Checkpoints whose parent is the root (the empty prefix).
    cdef list _roots
    # Created checkpoints waiting for their ready fence.
    cdef list _pending
    # RetiredResources waiting for their final-use fence.
    cdef list _retired
    cdef readonly int64_t num_cached_pages
    cdef readonly int64_t num_retired_pages
    cdef readonly int64_t num_retired_snapshots

    cdef void _touch(self, Checkpoint c)
    cdef object _retire(self, Checkpoint c)
    cdef bint _pages_above(self, Checkpoint c)
    cdef bint _has_pending_descendant(self, Checkpoint c)
