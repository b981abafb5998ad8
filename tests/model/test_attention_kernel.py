"""CPU paged decode attention (flared/_fast/attention.pyx) against a float64 reference and the torch path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flared.model.batch import ForwardBatch, SequenceChunk

attention = pytest.importorskip("flared._fast.attention")


def _reference(q, k_layer, v_layer, slots, length, begin):
    """q [nh, d]; k/v_layer [nkv, S, d]; the row's slots -> [nh, d] float64."""
    nh, nkv = q.shape[0], k_layer.shape[0]
    idx = torch.as_tensor(slots[begin:length])
    k = k_layer[:, idx].double().repeat_interleave(nh // nkv, 0)  # [nh, L, d]
    v = v_layer[:, idx].double().repeat_interleave(nh // nkv, 0)
    scores = torch.einsum("hd,hld->hl", q.double(), k) / q.shape[-1] ** 0.5
    return torch.einsum("hl,hld->hd", torch.softmax(scores, -1), v)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
# head_dim 48 (not a multiple of 32) keeps bf16 on the portable task where the AVX-512 BF16 one would run.
@pytest.mark.parametrize("nh, nkv, d", [(9, 3, 64), (4, 4, 32), (16, 2, 128), (6, 2, 48)])
@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_attention_matches_reference(dtype, tol, nh, nkv, d, window, threads):
    g = torch.Generator().manual_seed(nh * d + window)
    num_slots = 1024
    k_layer = torch.randn(nkv, num_slots, d, generator=g).to(dtype)
    v_layer = torch.randn(nkv, num_slots, d, generator=g).to(dtype)
    lens = np.array([1, 33, 300, 5], dtype=np.int64)
    width = int(lens.max())
    slots = np.zeros((len(lens), width), dtype=np.int64)
    for r, n in enumerate(lens):
        slots[r, :n] = np.random.default_rng(r).permutation(num_slots)[:n]  # scattered, as pages are
    q = torch.randn(len(lens), nh, d, generator=g).to(dtype)
    out = torch.full((len(lens), nh, d), float("nan"), dtype=dtype)
    slots_t, lens_t = torch.as_tensor(slots), torch.as_tensor(lens)
    attention.decode_attention(q.data_ptr(), k_layer.data_ptr(), v_layer.data_ptr(), out.data_ptr(),
                               slots_t.data_ptr(), width, lens_t.data_ptr(), len(lens), nh, nkv, d, num_slots,
                               d ** -0.5, window, dtype == torch.bfloat16, threads)
    for r, n in enumerate(lens):
        begin = max(0, int(n) - window) if window else 0
        ref = _reference(q[r], k_layer, v_layer, slots[r], int(n), begin)
        err = (out[r].double() - ref).abs().max().item()
        assert err < tol * max(1.0, ref.abs().max().item()), (r, err)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("nh, nkv, d", [(9, 3, 64), (16, 2, 128), (6, 2, 48)])  # 48: the portable task
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_attention_reads_a_float8_cache(dtype, tol, nh, nkv, d, threads):
    """kv_cache_dtype fp8: K/V of float8 e4m3 under float32 or bf16 queries, widened exactly as they are read: the
    output matches the reference over the widened values as closely as a cache of the queries' dtype does."""
    g = torch.Generator().manual_seed(nh * d)
    num_slots = 1024
    k8 = (torch.randn(nkv, num_slots, d, generator=g) * 4).to(torch.float8_e4m3fn)
    v8 = (torch.randn(nkv, num_slots, d, generator=g) * 4).to(torch.float8_e4m3fn)
    k8[0, :8, 0] = torch.tensor([0.0, -0.0, 2 ** -9, -3 * 2 ** -9, 2 ** -6, 448.0, -448.0, 7 * 2 ** -9])
    lens = np.array([1, 33, 300, 5], dtype=np.int64)
    width = int(lens.max())
    slots = np.zeros((len(lens), width), dtype=np.int64)
    for r, n in enumerate(lens):
        slots[r, :n] = np.random.default_rng(r).permutation(num_slots)[:n]
    slots[1, :8] = np.arange(8)  # the hand-picked keys: zeros, subnormals, the extremes
    q = torch.randn(len(lens), nh, d, generator=g).to(dtype)
    out = torch.full((len(lens), nh, d), float("nan"), dtype=dtype)
    slots_t, lens_t = torch.as_tensor(slots), torch.as_tensor(lens)
    attention.decode_attention(q.data_ptr(), k8.data_ptr(), v8.data_ptr(), out.data_ptr(), slots_t.data_ptr(),
                               width, lens_t.data_ptr(), len(lens), nh, nkv, d, num_slots, d ** -0.5, 0,
                               dtype == torch.bfloat16, threads, True)
    for r, n in enumerate(lens):
        ref = _reference(q[r], k8.float(), v8.float(), slots[r], int(n), 0)
        err = (out[r].double() - ref).abs().max().item()
        assert err < tol * max(1.0, ref.abs().max().item()), (r, err)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="bad shape"):
        attention.decode_attention(1, 1, 1, 1, 1, 1, 1, 1, 9, 2, 64, 16, 0.1)
    with pytest.raises(ValueError, match="too large"):
        attention.decode_attention(1, 1, 1, 1, 1, 1, 1, 1, 64, 2, 64, 16, 0.1)
    with pytest.raises(ValueError, match="null"):
        attention.decode_attention(0, 1, 1, 1, 1, 1, 1, 1, 4, 2, 64, 16, 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_kernel_path_matches_the_gather_path(tiny_hf_llama, dtype):
    """A mixed batch (two decode rows of different lengths and a prefill chunk) through DecoderModel with the
    kernel and with the torch gather path: same logits to rounding."""
    from flared.model.decoder import DecoderModel
    from flared.model.loader import read_source

    source = read_source(tiny_hf_llama)
    model = DecoderModel(source.config, source.tensors, dtype=dtype)
    assert model.cpu_decode_attention
    kv = model.make_kv_cache(num_pages=16, page_tokens=16)
    rng = np.random.default_rng(0)
    tables = [np.array([3, 7, 1]), np.array([5, 2]), np.array([9, 11, 12])]
    # Fill the cache for the two decode rows' earlier tokens with one prefill forward each.
    for table, n in ((tables[0], 40), (tables[1], 20)):
        model.forward(ForwardBatch.build([SequenceChunk(rng.integers(3, 300, n), 0, table)], page_tokens=16), kv)
    chunks = [SequenceChunk([17], 40, tables[0]), SequenceChunk(rng.integers(3, 300, 30), 0, tables[2]),
              SequenceChunk([29], 20, tables[1])]
    batch = ForwardBatch.build(chunks, page_tokens=16)
    snapshot = (kv.keys.clone(), kv.values.clone())
    with_kernel = model.forward(batch, kv)
    kv.keys.copy_(snapshot[0])
    kv.values.copy_(snapshot[1])
    model.cpu_decode_attention = False
    without = model.forward(batch, kv)
    tol = 1e-4 if dtype == torch.float32 else 5e-2 * without.abs().max().item()
    assert (with_kernel - without).abs().max().item() < tol
