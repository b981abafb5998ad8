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


FP8_KV = torch.float8_e4m3fn  # kv_cache_dtype "fp8": the pool's element type
FP8_MAX = 448.0  # float8 e4m3 (fn)'s largest finite value
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def kv_pool_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's element type for a ``kv_cache_dtype`` setting (vLLM's --kv-cache-dtype): "auto" keeps the
    model's; "fp8" or "fp8_e4m3" stores float8 e4m3 without a scale (values past +-448 saturate)."""
    if name == "auto":
        return model_dtype
    if name in ("fp8", "fp8_e4m3"):
        return FP8_KV
    raise ValueError(f"kv_cache_dtype {name!r}: must be one of {', '.join(KV_CACHE_DTYPES)}")


def to_storage(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a pool of element type ``dtype`` stores it: itself, or float8 saturated at +-448 (torch's own
    conversion gives NaN past it), as the Triton kernels store (flared.model.triton_attention.kv_value)."""
    if x.dtype == dtype:
        return x
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(dtype)


class PagedKVCache:
    def __init__(self, config: ModelConfig, *, num_pages: int, page_tokens: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", storage_dtype: torch.dtype | None = None, state_rows: int = 0):
        """``dtype``: the keys and values a forward writes and reads (the model's); ``storage_dtype``: what the
        pool holds, ``dtype`` (None) or float8 e4m3 (kv_cache_dtype fp8: half the bytes of bf16; ``write``
        stores through ``to_storage`` and ``gather`` widens back to ``dtype``). Only the layers that attend
        (``config.kv_layers``) have keys and values here: a model with recurrent layers keeps their
        state in ``states`` instead (flared.model.recurrent), ``state_rows`` rows of it (at least one needed)."""
        if num_pages <= 0 or page_tokens <= 0:
            raise ValueError(f"num_pages ({num_pages}) and page_tokens ({page_tokens}) must be positive")
        storage_dtype = dtype if storage_dtype is None else storage_dtype
        if storage_dtype not in (dtype, FP8_KV):
            raise ValueError(f"a KV cache of {dtype} stores {dtype} or {FP8_KV}, not {storage_dtype}")
        self.num_pages = num_pages
        self.page_tokens = page_tokens
        self.num_slots = num_pages * page_tokens
        self.num_layers = len(config.kv_layers)
        self.dtype = dtype
        self.storage_dtype = storage_dtype
        self.device = torch.device(device)
        # [layer, kv_head, slot, head_dim]: a gather along the slot axis yields [kv_head, tokens, head_dim],
        # which batched attention reads as [kv_head * sequences, context, head_dim] without another copy.
        # (Gemma 4's global layers keep their wider heads as head_dim-wide rows: kv_storage_heads rows a layer)
        # (latent attention served absorbed, ModelConfig.latent_kv: one latent row a slot and no value rows; the
        # values are the keys' latent part)
        self.head_dim = config.kv_row_dim
        shape = (self.num_layers, config.kv_storage_heads, self.num_slots, config.kv_row_dim)
        value_shape = (self.num_layers, config.kv_value_rows, self.num_slots, config.kv_row_dim)
        if self.device.type == "cpu":
            self.keys, self.values = host_zeros(shape, storage_dtype), host_zeros(value_shape, storage_dtype)
        else:
            self.keys = torch.zeros(shape, dtype=storage_dtype, device=self.device)
            self.values = torch.zeros(value_shape, dtype=storage_dtype, device=self.device)
        self.has_values = config.kv_value_rows > 0
        # A float8 pool is indexed through byte views (torch's index kernels take no float8 on the CPU).
        self._narrow = storage_dtype != dtype
        self._key_bytes = self.keys.view(torch.uint8) if self._narrow else self.keys
        self._value_bytes = self.values.view(torch.uint8) if self._narrow else self.values
        self.states = None
        if config.linear_layers:
            if state_rows <= 0:
                raise ValueError("a model with recurrent layers needs state rows beside its KV cache")
            from flared.model.recurrent import RecurrentState

            self.states = RecurrentState(config, state_rows, dtype=dtype, device=self.device)

    @property
    def num_bytes(self) -> int:
        """The pool's bytes (the recurrent states' apart: ``states.num_bytes``)."""
        return (self.keys.numel() + self.values.numel()) * self.keys.element_size()

    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (keys or values in ``dtype``) as a later ``gather`` returns them: itself, or through float8 and
        back (a forward that attends to its own fresh keys uses these, so every reader sees the same key)."""
        return x if not self._narrow else to_storage(x, self.storage_dtype).to(self.dtype)

    def write(self, layer: int, slot_ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None) -> None:
        """slot_ids [T] int64; keys/values [T, kv_heads, head_dim] (a Gemma 4 global layer's [T, heads, wider]: its
        first rows, each head as consecutive head_dim-wide pieces); values None where the cache keeps none
        (latent_kv)."""
        if (values is None) == self.has_values:
            raise ValueError("values go with keys exactly where the cache keeps value rows (not latent_kv)")
        for pool, x in ((self._key_bytes, keys), (self._value_bytes, values)):
            if x is None:
                continue
            if x.shape[-1] != self.head_dim:
                x = x.reshape(x.shape[0], -1, self.head_dim)
            x = x.transpose(0, 1)
            if self._narrow:
                x = to_storage(x, self.storage_dtype).view(torch.uint8)
            rows = pool[layer] if x.shape[0] == pool.shape[1] else pool[layer, :x.shape[0]]
            rows.index_copy_(1, slot_ids, x)

    def gather(self, layer: int, slot_ids: torch.Tensor, geometry: tuple[int, int] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """slot_ids [N] int64 -> (keys, values) [kv_heads, N, head_dim] in ``dtype``, contiguous copies (every row the
        layer stores; ``geometry`` (heads, head dim): the layer's own, Gemma 4's wider heads put back together);
        values None where the cache keeps none (latent_kv)."""
        heads, dim = geometry or (self.keys.shape[1], self.head_dim)
        rows = heads * dim // self.head_dim
        out = [None, None]
        for i, pool in enumerate((self._key_bytes, self._value_bytes) if self.has_values else (self._key_bytes,)):
            x = (pool[layer] if rows == pool.shape[1] else pool[layer, :rows]).index_select(1, slot_ids)
            if self._narrow:
                x = x.view(self.storage_dtype).to(self.dtype)
            if dim != self.head_dim:  # [heads * pieces, N, head_dim] -> [heads, N, dim]
                x = x.view(heads, dim // self.head_dim, -1, self.head_dim).transpose(1, 2).reshape(heads, -1, dim)
            out[i] = x
        return out[0], out[1]
