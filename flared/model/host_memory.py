"""CPU memory for what a decode step streams: transparent huge pages where the kernel allows them.

A decode step on the CPU reads the model's weights once and every row's keys and values from scattered
pool pages; in 4 KiB pages each of those streams also pays TLB misses. With THP in "madvise" mode (the
common default) only memory advised MADV_HUGEPAGE gets 2 MiB pages, and torch's allocations are not
advised, so the KV pool (``kv_cache``) and the packed bf16 weights (``decoder``) are mapped here.

``FLARED_HUGEPAGES=0`` keeps plain ``torch.zeros`` memory (benchmarks compare both).
"""

from __future__ import annotations

import math
import mmap
import os

import torch


def huge_pages_wanted() -> bool:
    """Whether ``host_zeros`` maps and advises its memory here (Linux, not turned off by FLARED_HUGEPAGES=0)."""
    return (hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_ANONYMOUS")
            and os.environ.get("FLARED_HUGEPAGES", "1") != "0")


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype, *, prefault: bool = True) -> torch.Tensor:
    """A zeroed CPU tensor in its own anonymous mapping, advised MADV_HUGEPAGE before any page is touched
    (with THP in "madvise" mode, the common default, only advised memory gets huge pages), then written
    so every page is faulted in now rather than mid-request (``prefault=False``: left to the first write,
    for a caller about to fill it). Plain ``torch.zeros`` where the platform has no such advice."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0 or not huge_pages_wanted():
        return torch.zeros(shape, dtype=dtype)
    try:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # refused by the platform's mapping limits: torch's allocator may still find the memory
        return torch.zeros(shape, dtype=dtype)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP compiled out or disabled for this process: still a valid zeroed mapping
        pass
    tensor = torch.frombuffer(region, dtype=dtype).view(shape)  # keeps the mapping alive
    if prefault:
        tensor.zero_()
    return tensor
