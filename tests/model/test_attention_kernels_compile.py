"""The paged attention kernels (flared/model/triton_attention.py) compile for a Hopper target at head dims that are
not powers of two (Phi-2's 80, latent attention's 192, the lanes past them masked) and at Gemma 4's 512-wide global
heads (their own tiles), without a GPU: Triton's interpreter runs what its code generator may refuse, so only a
compile shows that. tests/cuda/test_attention.py checks the outputs on a GPU. Skips where Triton is not installed."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

DECODE = ("Q:*{t} K:*{t} V:*{t} Out:*{t} BlockTables:*i32 ContextLens:*i32 Sinks:*fp32 stride_q_row:i32 "
          "stride_q_head:i32 stride_kv_slot:i32 stride_kv_head:i32 stride_o_row:i32 stride_o_head:i32 "
          "stride_bt_row:i32 scale:fp32")
SPLIT = ("Q:*{t} K:*{t} V:*{t} PartAcc:*fp32 PartM:*fp32 PartL:*fp32 BlockTables:*i32 ContextLens:*i32 "
         "stride_q_row:i32 stride_q_head:i32 stride_kv_slot:i32 stride_kv_head:i32 stride_bt_row:i32 scale:fp32")
COMBINE = "PartAcc:*fp32 PartM:*fp32 PartL:*fp32 Out:*{t} stride_o_row:i32 stride_o_head:i32"
PREFILL = ("Q:*{t} K:*{t} V:*{t} Out:*{t} BlockTables:*i32 ChunkMeta:*i32 Sinks:*fp32 stride_q_row:i32 "
           "stride_q_head:i32 stride_kv_slot:i32 stride_kv_head:i32 stride_o_row:i32 stride_o_head:i32 "
           "stride_bt_row:i32 scale:fp32 num_seqs:i32")


def _compile(fn, signature: str, dtype: str, constexprs: dict, num_warps: int = 4, num_stages: int = 3):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(pair.split(":") for pair in signature.format(t=dtype).split())
    sig.update({name: "constexpr" for name in constexprs})
    kernel = triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    assert "ptx" in kernel.asm
    # (what a Hopper multiprocessor gives one block: 227 KiB; a launch past it fails "out of resources")
    assert kernel.metadata.shared <= 227 * 1024, kernel.metadata.shared
    return kernel


@pytest.mark.parametrize("head_dim", [80, 192, 512])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_decode_kernels_compile(head_dim, dtype):
    from flared.model import triton_attention as ta

    lanes, block_n = ta._head_pad(head_dim), ta._decode_block_n(head_dim)
    common = dict(PAGE_TOKENS=16, GROUP=4, GROUP_PAD=16, HEAD_DIM=head_dim, BLOCK_N=block_n)
    _compile(ta._decode_kernel, DECODE, dtype, dict(common, IEEE=dtype == "fp32", WINDOW=0, SINKS=True, SOFTCAP=0.0,
                                                    HEAD_PAD=lanes))
    if dtype == "bf16":  # (the split kernels serve half precision)
        _compile(ta._decode_split_kernel, SPLIT, dtype, dict(common, NUM_HEADS=32, NUM_SPLITS=4, WINDOW=0,
                                                             SOFTCAP=0.0, HEAD_PAD=lanes))
        _compile(ta._decode_combine_kernel, COMBINE, dtype, dict(NUM_HEADS=32, NUM_SPLITS=4, SPLITS_PAD=4,
                                                                 HEAD_DIM=head_dim, HEAD_PAD=lanes))


@pytest.mark.parametrize("head_dim", [80, 192, 512])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_prefill_kernel_compiles(head_dim, dtype):
    from flared.model import triton_attention as ta

    ieee = dtype == "fp32"
    c = dict(ta.PREFILL_CONFIG_F32 if ieee else ta.PREFILL_CONFIG)
    if ta._head_pad(head_dim) >= 512:
        c.update(ta.PREFILL_WIDE_F32 if ieee else ta.PREFILL_WIDE)
    _compile(ta._prefill_kernel, PREFILL, dtype,
             dict(SEQS_PAD=16, PAGE_TOKENS=16, GROUP=8, HEAD_DIM=head_dim, BLOCK_M=c["block_m"], BLOCK_N=c["block_n"],
                  IEEE=ieee, HEADS_FAST=c["heads_fast"], HEAVY_FIRST=c["heavy_first"], SPLIT_MASK=c["split_mask"],
                  EXP2=c["exp2"], WINDOW=1024, SINKS=False, SOFTCAP=0.0, HEAD_PAD=ta._head_pad(head_dim)),
             num_warps=c["num_warps"], num_stages=c["num_stages"])


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_alibi_builds_compile(dtype):
    """BLOOM's ALiBi slopes (ALIBI, read through the sinks' pointer) in the one-pass decode and the prefill kernels."""
    from flared.model import triton_attention as ta

    ieee = dtype == "fp32"
    _compile(ta._decode_kernel, DECODE, dtype, dict(PAGE_TOKENS=16, GROUP=1, GROUP_PAD=16, HEAD_DIM=64, BLOCK_N=64,
                                                    IEEE=ieee, WINDOW=0, SINKS=False, SOFTCAP=0.0, HEAD_PAD=64,
                                                    ALIBI=True))
    c = dict(ta.PREFILL_CONFIG_F32 if ieee else ta.PREFILL_CONFIG)
    _compile(ta._prefill_kernel, PREFILL, dtype,
             dict(SEQS_PAD=16, PAGE_TOKENS=16, GROUP=1, HEAD_DIM=64, BLOCK_M=c["block_m"], BLOCK_N=c["block_n"],
                  IEEE=ieee, HEADS_FAST=c["heads_fast"], HEAVY_FIRST=c["heavy_first"], SPLIT_MASK=c["split_mask"],
                  EXP2=c["exp2"], WINDOW=0, SINKS=False, SOFTCAP=0.0, HEAD_PAD=64, ALIBI=True),
             num_warps=c["num_warps"], num_stages=c["num_stages"])
