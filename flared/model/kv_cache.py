"""Paged KV cache storage.

The pool is preallocated: for every layer, keys and values for
``num_pages * page_tokens`` token *slots*. Token ``t`` of a sequence whose
block table is ``page_ids`` lives in slot ``page_ids[t // page_tokens] *
page_tokens + t % page_tokens``.

Rules:
- This class is storage only. Which pages a sequence owns is decided by the
  caller through ``flared._fast.pages.PageAllocator`` (the ledger); the cache
  never allocates or frees.
- A forward writes a token's K/V into its slot before any attention of that
  layer reads it, so a prefill chunk sees its own keys through the same gather
  as decode rows do.
- Slots of a freed page keep stale values; they are unreachable because a
  gather only covers positions below a sequence's context length.
- On a Linux CPU the pool sits in transparent huge pages where the kernel
  allows it (``host_memory.host_zeros``): decode attention reads every row's
  keys and values from scattered pages each step, and with 4 KiB pages each
  short stream also pays TLB misses (measured: attention 10-16% faster).
"""

from __future__ import annotations

import torch

from flared.model.config import ModelConfig
from flared.model.host_memory import host_zeros


FP8_KV = torch.float8_e4m3fn  # kv_cache_dtype "fp8": the CUDA pool's element type
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def kv_pool_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's element type for a ``kv_cache_dtype`` setting (vLLM's --kv-cache-dtype): "auto" keeps the
    model's; "fp8" or "fp8_e4m3" stores float8 e4m3 without a scale (values past +-448 saturate), which the CUDA
    pool alone holds (flared.model.kernels.paged_decoder)."""
    if name == "auto":
        return model_dtype
    if name in ("fp8", "fp8_e4m3"):
        return FP8_KV
    raise ValueError(f"kv_cache_dtype {name!r}: must be one of {', '.join(KV_CACHE_DTYPES)}")


class PagedKVCache:
    def __init__(self, config: ModelConfig, *, num_pages: int, page_tokens: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        if num_pages <= 0 or page_tokens <= 0:
            raise ValueError(f"num_pages ({num_pages}) and page_tokens ({page_tokens}) must be positive")
        self.num_pages = num_pages
        self.page_tokens = page_tokens
        self.num_slots = num_pages * page_tokens
        self.num_layers = config.num_layers
        self.dtype = dtype
        self.device = torch.device(device)
        # [layer, kv_head, slot, head_dim]: a gather along the slot axis yields [kv_head, tokens, head_dim],
        # which batched attention reads as [kv_head * sequences, context, head_dim] without another copy.
        shape = (config.num_layers, config.num_kv_heads, self.num_slots, config.head_dim)
        if self.device.type == "cpu":
            self.keys, self.values = host_zeros(shape, dtype), host_zeros(shape, dtype)
        else:
            self.keys = torch.zeros(shape, dtype=dtype, device=self.device)
            self.values = torch.zeros(shape, dtype=dtype, device=self.device)

    @property
    def num_bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def write(self, layer: int, slot_ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """slot_ids [T] int64; keys/values [T, kv_heads, head_dim]."""
        self.keys[layer].index_copy_(1, slot_ids, keys.transpose(0, 1))
        self.values[layer].index_copy_(1, slot_ids, values.transpose(0, 1))

    def gather(self, layer: int, slot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slot_ids [N] int64 -> (keys, values) [kv_heads, N, head_dim], contiguous copies."""
        return self.keys[layer].index_select(1, slot_ids), self.values[layer].index_select(1, slot_ids)
