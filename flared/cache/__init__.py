"""Exact prefix keys and the prefix checkpoint cache.

The implementation is Cython (``flared._fast.prefix``); this facade names the
public surface the scheduler and the model thread use:

- ``PrefixHistory(identity, tokens=None)``: BLAKE2b-128 keys of exact token
  prefixes. ``append_tokens``, ``append_conditioning(position, identity)``,
  ``key_at(num_tokens)``, ``num_tokens``, ``root_key``.
- ``PrefixCheckpointCache(num_pages, num_snapshots, page_tokens)``: ownership
  ledger of immutable checkpoints. ``lookup``, ``publish`` (PublishResult with
  PublishOutcome CREATED/EXISTING), ``cancel_pending``, ``pin``/``unpin``,
  ``mark_used``, ``evict`` (RetiredResources), ``advance_completed``
  (AdvanceResult: ready ids, reusable RetiredResources), ``check_integrity``.

The module docstring of ``flared._fast.prefix`` states the key and ownership
rules; docs/scheduling.md explains how the scheduler uses them.
"""

from flared._fast.prefix import (
    BLOCK_TOKENS_PY as BLOCK_TOKENS,
    IDENTITY_BYTES,
    KEY_BYTES,
    AdvanceResult,
    Checkpoint,
    PrefixCheckpointCache,
    PrefixHistory,
    PublishOutcome,
    PublishResult,
    RetiredResources,
)

__all__ = [
    "BLOCK_TOKENS",
    "IDENTITY_BYTES",
    "KEY_BYTES",
    "AdvanceResult",
    "Checkpoint",
    "PrefixCheckpointCache",
    "PrefixHistory",
    "PublishOutcome",
    "PublishResult",
    "RetiredResources",
]
