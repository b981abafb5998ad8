"""The absorbed latent attention kernels (flared/model/triton_mla.py) against a float64 reference, through Triton's
interpreter on the CPU (float32, scattered pages, cached prefixes, padding rows and sequences, heads past a block of
16 and widths that are not powers of two), and compiled for a Hopper target. tests/cuda/test_attention.py runs them on
a GPU. Skips where Triton is not installed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

PAGE = 4


def _reference(q, pool, table, positions, latent):
    """Row t (q [nh, latent + rope]) at position p attends the rows of positions 0..p of its table, in float64."""
    keys = pool[table[: positions + 1]].double()[:, 0]  # [L, latent + rope]
    probs = (q.double() @ keys.T * SCALE).softmax(-1)
    return probs @ keys[:, :latent]


SCALE = 0.3


def _setup(lengths, latent, rope, seed=0):
    g = torch.Generator().manual_seed(seed)
    pages_each = [-(-n // PAGE) for n in lengths]
    order = torch.randperm(sum(pages_each) + 3, generator=g)
    tables, at = [], 0
    for n in pages_each:
        tables.append(order[at:at + n])
        at += n
    num_slots = (len(order) + 1) * PAGE
    pool = torch.randn(num_slots, 1, latent + rope, generator=g)
    width = max(pages_each)
    block_tables = torch.zeros(len(lengths), width, dtype=torch.int32)
    slot_tables = []
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = t.to(torch.int32)
        slot_tables.append(torch.tensor([int(t[p // PAGE]) * PAGE + p % PAGE for p in range(lengths[i])]))
    return g, pool, block_tables, slot_tables


@pytest.fixture
def interpreted():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("run by test_the_kernels_match_float64_interpreted, under Triton's interpreter")


def test_the_kernels_match_float64_interpreted():
    """The float64 checks below in a process of their own: Triton picks its interpreter when a kernel is defined."""
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                             "matches_float64"], env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "8 passed" in result.stdout, result.stdout[-2000:]


@pytest.mark.parametrize("heads,latent,rope", [(4, 32, 8), (20, 48, 16), (16, 64, 32)])
def test_decode_matches_float64(interpreted, heads, latent, rope):
    from flared.model.triton_mla import mla_decode_attention

    lengths = [9, 1, 16, 0, 13]  # (0: a padding row)
    g, pool, block_tables, slot_tables = _setup(lengths, latent, rope)
    q = torch.randn(len(lengths), heads, latent + rope, generator=g)
    out = torch.full((len(lengths), heads, latent), 7.0)
    mla_decode_attention(q, pool, out, block_tables, torch.tensor(lengths, dtype=torch.int32), latent_dim=latent,
                         page_tokens=PAGE, scale=SCALE)
    for i, n in enumerate(lengths):
        if n == 0:
            assert torch.equal(out[i], torch.zeros(heads, latent))
            continue
        want = _reference(q[i], pool, slot_tables[i], n - 1, latent)
        torch.testing.assert_close(out[i].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [2, 3])
def test_split_decode_matches_float64(interpreted, splits):
    """Half precision (float16: the interpreter's): each row's context in shares, merged by the combine kernel."""
    from flared.model.triton_mla import mla_decode_attention

    heads, latent, rope = 20, 48, 16
    lengths = [70, 1, 0, 33, 5]
    g, pool, block_tables, slot_tables = _setup(lengths, latent, rope, seed=2)
    q = torch.randn(len(lengths), heads, latent + rope, generator=g)
    out = torch.full((len(lengths), heads, latent), 7.0, dtype=torch.float16)
    scratch = len(lengths) * heads * splits
    mla_decode_attention(q.half(), pool.half(), out, block_tables, torch.tensor(lengths, dtype=torch.int32),
                         latent_dim=latent, page_tokens=PAGE, scale=SCALE, num_splits=splits,
                         part_acc=torch.empty(scratch * latent), part_m=torch.empty(scratch),
                         part_l=torch.empty(scratch))
    for i, n in enumerate(lengths):
        if n == 0:
            assert torch.equal(out[i], torch.zeros(heads, latent, dtype=torch.float16))
            continue
        want = _reference(q[i].half().float(), pool.half().float(), slot_tables[i], n - 1, latent)
        torch.testing.assert_close(out[i].double(), want, atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("heads,latent,rope,block_m", [(4, 32, 8, 2), (20, 48, 16, 1), (16, 64, 32, 4)])
def test_prefill_matches_float64(interpreted, heads, latent, rope, block_m):
    from flared.model.triton_mla import mla_prefill_attention_varlen

    chunks = [(5, 6), (0, 7), (0, 0), (8, 1)]  # (cached, new) per sequence; (0, 0) pads
    lengths = [c + n for c, n in chunks]
    g, pool, block_tables, slot_tables = _setup(lengths, latent, rope, seed=1)
    capacity = sum(n for _, n in chunks) + 3  # (rows past the chunks: never written)
    q = torch.randn(capacity, heads, latent + rope, generator=g)
    out = torch.full((capacity, heads, latent), 7.0)
    meta = torch.tensor(chunks, dtype=torch.int32)
    mla_prefill_attention_varlen(q, pool, out, block_tables, meta, latent_dim=latent, page_tokens=PAGE, scale=SCALE,
                                 block_m=block_m)
    row = 0
    for i, (cached, new) in enumerate(chunks):
        for j in range(new):
            want = _reference(q[row], pool, slot_tables[i], cached + j, latent)
            torch.testing.assert_close(out[row].double(), want, atol=1e-5, rtol=1e-5)
            row += 1
    assert torch.equal(out[row:], torch.full_like(out[row:], 7.0))


SIGNATURE = ("Q:*{t} K:*{t} Out:*{t} {parts}BlockTables:*i32 {meta}:*i32 stride_q_row:i32 stride_q_head:i32 "
             "stride_kv_slot:i32 stride_o_row:i32 stride_o_head:i32 stride_bt_row:i32 scale:fp32{extra} "
             "num_heads:i32")


@pytest.mark.parametrize("dtype", ["bf16", "fp32", "fp8e4nv"])
def test_the_kernels_compile_for_hopper_at_deepseeks_widths(dtype):
    """DeepSeek's 512-wide latent and 64-wide rope; MiniCPM3's 256 and 32 compile alike."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flared.model import triton_mla as m

    ieee = dtype == "fp32"
    t = "bf16" if dtype == "fp8e4nv" else dtype
    common = dict(PAGE_TOKENS=16, LATENT=512, LAT_PAD=512, ROPE=64, ROPE_PAD=64, BLOCK_H=16,
                  BLOCK_N=16 if ieee else 32, IEEE=ieee, EXP2=not ieee)
    for fn, meta, extra, constexprs, warps in (
            (m._mla_decode_kernel, "ContextLens", "", dict(common, NUM_SPLITS=1), 4),
            (m._mla_decode_kernel, "ContextLens", "", dict(common, NUM_SPLITS=4), 4),
            (m._mla_prefill_kernel, "ChunkMeta", " num_seqs:i32", dict(common, SEQS_PAD=16, BLOCK_M=2), 8)):
        parts = "PartAcc:*fp32 PartM:*fp32 PartL:*fp32 " if fn is m._mla_decode_kernel else ""
        sig = dict(pair.split(":") for pair in SIGNATURE.format(t=t, meta=meta, extra=extra, parts=parts).split())
        if dtype == "fp8e4nv":
            sig["K"] = "*fp8e4nv"
        sig.update({name: "constexpr" for name in constexprs})
        kernel = triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=warps, num_stages=2))
        assert kernel.metadata.shared <= 227 * 1024, kernel.metadata.shared


def test_rows_that_are_not_16_byte_multiples_are_refused():
    """Triton vectorises a pool row's loads as if each row began 16-byte aligned: a float8 row of 56 values faulted on
    an H100 (misaligned address). Such a pool is refused before any launch; rows of 64 float8 values pass the check."""
    from flared.model.kv_cache import FP8_KV
    from flared.model.triton_mla import _check

    q = torch.zeros(2, 4, 56)
    out = torch.zeros(2, 4, 48)
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        _check(q, torch.zeros(32, 1, 56).to(FP8_KV), out, 48)
    _check(q, torch.zeros(32, 1, 56), out, 48)  # (float32: 224 bytes a row)
    _check(torch.zeros(2, 4, 64), torch.zeros(32, 1, 64).to(FP8_KV), torch.zeros(2, 4, 48), 48)
