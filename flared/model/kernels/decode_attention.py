"""Decode attention at many rows in CUDA (decode_attention.cu): the rotary, the new token's KV write and the
paged attention of one decode step in one launch, a block per (row, kv head), with no context split, on the
tensor cores.

``decode_attention_rope`` takes the arguments of ``triton_attention.paged_decode_attention_rope`` (one share)
and gives the same results to rounding (the same roundings, another order of the sums). The decoder uses it
where ``decode_splits`` gives one share and ``unsupported`` says nothing against it (bf16, head dim 64 or 128,
at most 8 query heads a kv head, pages of a multiple of 16 tokens).

Needs CuPy's NVRTC and compute capability 9.0 (``griddepcontrol``); ``available()`` says whether this device has both.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("decode_attention.cu")
THREADS = 128
MAX_GROUP = 8  # query heads a kv head: the rows of the matrix unit's first 8 (the other 8 stay zero)


@dataclass(frozen=True)
class Build:
    """One compiled form: the model's ``group`` (query heads a kv head), ``head_dim`` and ``page_tokens``; the
    tuning knobs ``prefetch`` (a warp loads its next block of keys while it computes this one) and
    ``blocks_per_sm`` (the launch bound the registers are fitted to)."""
    group: int
    head_dim: int
    page_tokens: int
    prefetch: int = 0
    blocks_per_sm: int = 4

    def __post_init__(self):
        if self.head_dim not in (64, 128):
            raise ValueError(f"{self}: head dim 64 or 128")
        if not 1 <= self.group <= MAX_GROUP:
            raise ValueError(f"{self}: a query group of {self.group} (at most {MAX_GROUP})")
        if self.page_tokens < 16 or self.page_tokens % 16:
            raise ValueError(f"{self}: pages of a multiple of 16 tokens")
        if self.prefetch not in (0, 1) or self.blocks_per_sm < 1:
            raise ValueError(f"{self}: prefetch 0 or 1, blocks per SM positive")

    def defines(self) -> dict[str, int]:
        return {"GROUP": self.group, "D": self.head_dim, "PAGE": self.page_tokens, "PREFETCH": self.prefetch,
                "BLOCKS_PER_SM": self.blocks_per_sm}


def default_build(group: int, head_dim: int, page_tokens: int) -> Build:
    """The build the decoder runs: no prefetch and four blocks a multiprocessor (the fastest alone at 64 rows:
    20.55 us a layer at 8B and 256 tokens, docs/benchmarks.md, twenty-seventh session)."""
    return Build(group, head_dim, page_tokens)


def unsupported(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                page_tokens: int = 16) -> str | None:
    """Why the kernel cannot serve this attention shape and page size (None: it can)."""
    if dtype != torch.bfloat16:
        return f"{dtype} (the kernel is bf16)"
    if num_heads % num_kv_heads:
        return f"{num_heads} query heads over {num_kv_heads} kv heads"
    try:
        default_build(num_heads // num_kv_heads, head_dim, page_tokens)
    except ValueError as e:
        return str(e)
    return None


def available() -> bool:
    """The device and CuPy that products64 needs (compute capability 9.0): the only one this kernel was built and
    measured on."""
    from flared.model.kernels import products64

    return products64.available()


_kernels: dict[Build, tuple] = {}


def load(build: Build) -> int:
    """The loaded CUfunction for ``build``, compiled once a process (first outside any graph capture)."""
    if build not in _kernels:
        from flared.execution.cuda import cupy

        options = ("-std=c++17", "--use_fast_math") + tuple(f"-D{k}={v}" for k, v in build.defines().items())
        module = cupy.RawModule(code=SOURCE.read_text(), options=options)
        fn = module.get_function("flared_decode_attention")
        _kernels[build] = (module, fn)
    return _kernels[build][1].kernel.ptr


def decode_attention_rope(qkv: torch.Tensor, cos_table: torch.Tensor, sin_signed_table: torch.Tensor,
                          positions: torch.Tensor, slots: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                          out: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, *,
                          num_heads: int, page_tokens: int, scale: float, build: Build | None = None,
                          pdl: bool = False) -> None:
    """As ``paged_decode_attention_rope`` with one context share: qkv [B, (nh + 2 nkv) d] bf16 rows of the
    projection; tables [positions, d]; positions / slots [B] int64; pools [slots, nkv, d]; out [B, nh, d];
    block_tables [>= B, pages] int32; context_lens [>= B] int32 (0 = a padding row). Launches on torch's
    current stream; ``pdl`` as a programmatic dependent launch."""
    from flared.execution.cuda import launch_kernel

    batch = qkv.shape[0]
    num_kv_heads, head_dim = k_pool.shape[1], k_pool.shape[2]
    build = build or default_build(num_heads // num_kv_heads, head_dim, page_tokens)
    if (build.group * num_kv_heads, build.head_dim, build.page_tokens) != (num_heads, head_dim, page_tokens):
        raise ValueError(f"{build} does not match {num_heads} heads over {num_kv_heads}, head dim {head_dim}, "
                         f"pages of {page_tokens}")
    bf16 = torch.bfloat16
    if not (qkv.dtype == k_pool.dtype == v_pool.dtype == out.dtype == cos_table.dtype == sin_signed_table.dtype
            == bf16):
        raise ValueError("decode_attention_rope is bf16 throughout")
    if qkv.stride(1) != 1 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not [B, (nh + 2 nkv) d] with unit column stride")
    if k_pool.stride() != v_pool.stride() or k_pool.stride(1) != head_dim or k_pool.stride(2) != 1:
        raise ValueError("the K and V pools must share a [slots, nkv, d] layout with contiguous heads")
    if out.shape[0] < batch or out.stride(2) != 1:
        raise ValueError(f"out {tuple(out.shape)} cannot take {batch} rows")
    if not (cos_table.is_contiguous() and sin_signed_table.is_contiguous() and cos_table.shape[1] == head_dim):
        raise ValueError("the rotary tables must be contiguous [positions, head dim]")
    if positions.dtype != torch.int64 or slots.dtype != torch.int64 or block_tables.dtype != torch.int32 \
            or context_lens.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError("positions and slots int64; block_tables (unit column stride) and context_lens int32")
    fn = load(build)
    values = [ctypes.c_uint64(qkv.data_ptr()), ctypes.c_int32(qkv.stride(0)), ctypes.c_uint64(cos_table.data_ptr()),
              ctypes.c_uint64(sin_signed_table.data_ptr()), ctypes.c_uint64(positions.data_ptr()),
              ctypes.c_uint64(slots.data_ptr()), ctypes.c_uint64(k_pool.data_ptr()),
              ctypes.c_uint64(v_pool.data_ptr()), ctypes.c_int64(k_pool.stride(0)), ctypes.c_uint64(out.data_ptr()),
              ctypes.c_int32(out.stride(0)), ctypes.c_int32(out.stride(1)), ctypes.c_uint64(block_tables.data_ptr()),
              ctypes.c_int32(block_tables.stride(0)), ctypes.c_uint64(context_lens.data_ptr()),
              ctypes.c_int32(num_heads), ctypes.c_int32(num_kv_heads), ctypes.c_float(scale * math.log2(math.e))]
    launch_kernel(fn, batch * num_kv_heads, THREADS, 0, torch.cuda.current_stream().cuda_stream,
                  [ctypes.addressof(v) for v in values], pdl=pdl)
