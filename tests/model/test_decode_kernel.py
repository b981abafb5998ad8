"""The one-call bf16 decode step (flared/_fast/decode.pyx) against DecoderModel's per-op path."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flared.model.batch import ForwardBatch, SequenceChunk
from .conftest import build_hf_checkpoint

decode = pytest.importorskip("flared._fast.decode")
pytestmark = pytest.mark.skipif(not decode.SUPPORTED, reason="this CPU lacks AVX-512 BF16")

PAGE = 16


@pytest.fixture(scope="module", params=["llama3", "llama_tied", "mistral", "qwen2", "qwen3", "llama3:q4_1",
                                        "qwen2:q8_0"])
def model(request, tmp_path_factory):
    """A bf16 model of each family; "family:format": its weights kept quantised (--quantization), so that every
    check below (float8 caches, adapter rows) runs over the quantised products too."""
    from flared.model.decoder import DecoderModel
    from flared.model.loader import read_source

    family, _, quantization = request.param.partition(":")
    path = build_hf_checkpoint(family, tmp_path_factory.mktemp(family))
    source = read_source(path)
    m = DecoderModel(source.config, source.tensors, dtype=torch.bfloat16, quantization=quantization or None)
    assert m.fused_decode
    return m


def _decode_batch(model, rows: int, rng):
    """A KV cache holding ``rows`` sequences of different lengths (prefilled by the per-op path) and the
    decode step that follows them."""
    kv = model.make_kv_cache(num_pages=4 * rows, page_tokens=PAGE)
    pages = rng.permutation(4 * rows)
    chunks = []
    for r in range(rows):
        n = int(rng.integers(1, 60))  # past the mistral fixture's 16-token window for most rows
        table = pages[4 * r:4 * r + 4]
        model.forward(ForwardBatch.build([SequenceChunk(rng.integers(3, 500, n), 0, table)], page_tokens=PAGE), kv)
        chunks.append(SequenceChunk([int(rng.integers(3, 500))], n, table))
    return kv, ForwardBatch.build(chunks, page_tokens=PAGE, sliding_window=model.config.sliding_window)


def _per_op(model, kv, batch, before):
    """The batch through the per-op path from the KV cache ``before``: (logits, the K/V it leaves); the cache is
    put back to ``before``."""
    kv.keys.copy_(before[0])
    kv.values.copy_(before[1])
    model.fused_decode = False
    try:
        logits = model.forward(batch, kv)
    finally:
        model.fused_decode = True
    after = (kv.keys.clone(), kv.values.clone())
    kv.keys.copy_(before[0])
    kv.values.copy_(before[1])
    return logits, after


def _both_paths(model, kv, batch):
    """The batch through the one-call step, then through the per-op path from the same cache: (one-call
    logits, its K/V, per-op logits, its K/V, the cache before)."""
    before = (kv.keys.clone(), kv.values.clone())
    fused = model.forward(batch, kv)
    fused_kv = (kv.keys.clone(), kv.values.clone())
    plain, plain_kv = _per_op(model, kv, batch, before)
    return fused, fused_kv, plain, plain_kv, before


@pytest.mark.parametrize("rows", [1, 3, 8, 13])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_step_matches_the_per_op_path(model, rows, threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    kv, batch = _decode_batch(model, rows, np.random.default_rng(rows))
    fused, fused_kv, plain, plain_kv, _ = _both_paths(model, kv, batch)
    # The new K/V: rope and the copies round exactly as the torch ops do (Qwen3's per-head norm may differ by
    # an ulp where torch's rsqrt and ours round apart).
    exact = not model.config.qk_norm
    for got, want in zip(fused_kv, plain_kv):
        if exact:
            assert torch.equal(got, want)
        else:
            assert (got.float() - want.float()).abs().max().item() <= 2 ** -6 * want.float().abs().max().item()
    assert fused.shape == plain.shape == (rows, model.config.vocab_size)
    # Only silu's exp can round differently (an activation off by one bf16 ulp, rarely; on these models the
    # logits came out bit-identical): they agree to well under bf16's resolution of the largest logit.
    scale = plain.abs().max().item()
    assert (fused - plain).abs().max().item() <= 2e-3 * scale
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))


@pytest.mark.parametrize("rows, threads", [(1, 1), (8, 2)])
def test_fused_step_over_a_float8_cache_matches_the_other_paths(model, rows, threads, monkeypatch):
    """kv_cache_dtype fp8: the one-call step writes the new K/V as float8 (to nearest even, saturated) and attends
    over the widened cache. Against the per-op path with the Cython attention it writes the same bytes; against
    the torch path (gather, widen, bmm: no Cython kernel) the first layer's bytes are the same (later layers'
    inputs differ by the attentions' roundings) and the greedy tokens too."""
    from flared.model.kv_cache import FP8_KV

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    rng = np.random.default_rng(100 + rows)
    kv = model.make_kv_cache(num_pages=4 * rows, page_tokens=PAGE, storage_dtype=FP8_KV)
    pages = rng.permutation(4 * rows)
    chunks = []
    for r in range(rows):
        n = int(rng.integers(1, 60))
        table = pages[4 * r:4 * r + 4]
        model.forward(ForwardBatch.build([SequenceChunk(rng.integers(3, 500, n), 0, table)], page_tokens=PAGE), kv)
        chunks.append(SequenceChunk([int(rng.integers(3, 500))], n, table))
    batch = ForwardBatch.build(chunks, page_tokens=PAGE, sliding_window=model.config.sliding_window)
    caches = (kv.keys.view(torch.uint8), kv.values.view(torch.uint8))
    before = tuple(c.clone() for c in caches)

    def run(fused: bool, native: bool):
        for c, b in zip(caches, before):
            c.copy_(b)
        model.fused_decode, model.cpu_decode_attention = fused, native
        try:
            return model.forward(batch, kv), tuple(c.clone() for c in caches)
        finally:
            model.fused_decode, model.cpu_decode_attention = True, True

    fused, fused_kv = run(True, True)
    per_op, per_op_kv = run(False, True)
    torch_path, torch_kv = run(False, False)
    for got, same_inputs, other in zip(fused_kv, per_op_kv, torch_kv):
        if model.config.qk_norm:  # Qwen3's per-head norm may round a key apart by a bf16 ulp, then a float8 step
            assert (got != same_inputs).float().mean().item() < 0.01
        else:
            assert torch.equal(got, same_inputs)
            assert torch.equal(got[0], other[0])
    scale = per_op.abs().max().item()
    assert (fused - per_op).abs().max().item() <= 2e-3 * scale  # the same attention kernel
    # The torch path rounds the scores and the probabilities to bf16 (the kernel keeps them float32): with torch 2.13
    # that parts it from the kernels by up to ~3% of the largest logit on these random models at 8 rows.
    assert (fused - torch_path).abs().max().item() <= 5e-2 * scale
    assert torch.equal(fused.argmax(-1), per_op.argmax(-1))
    # Each row's top token is the torch path's, or one within the two paths' distance of it: a near-tie of these
    # random models, which Qwen3's keys (a float8 step apart, above) or the torch path's bf16 scores may flip
    # (llama3:q4_1 at one row: two logits equal in bf16 on the kernel's side, 0.09 apart on torch's)
    gap = torch_path.max(-1).values - torch_path.gather(-1, fused.argmax(-1)[:, None])[:, 0]
    assert (gap <= 2 * (fused - torch_path).abs().max()).all(), gap


def _random_adapter(model, rank: int, seed: int, products=("qkv", "o", "down", "gate_up")) -> int:
    """A per-request adapter of random factors on ``products`` (tools/bench_lora_cpu.py's), sized so its terms
    move these small models' logits; returns its index (DecoderModel.add_lora_module)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from bench_lora_cpu import adapter_factors

    return model.add_lora_module(adapter_factors(model.config, rank, seed=seed, scale=0.5, products=products))


@pytest.mark.parametrize("rows, threads", [(1, 1), (5, 2), (13, 2)])
def test_fused_step_with_lora_rows_matches_the_per_op_path(model, rows, threads, monkeypatch):
    """Rows of two per-request adapters (one on every product, one on o and down only) beside base rows: the
    one-call step adds their terms where the per-op path (DecoderModel._lora) does, rounded the same way; only
    the low-rank sums' order differs."""
    from flared.model.decoder import FUSED_LORA

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    if not hasattr(model, "_test_adapters"):
        model._test_adapters = (_random_adapter(model, 8, 1), _random_adapter(model, 4, 2, ("o", "down")))
    first, second = model._test_adapters
    assert model.lora_modules[first - 1][FUSED_LORA] is not None
    kv, batch = _decode_batch(model, rows, np.random.default_rng(100 + rows))
    members = {first: [r for r in range(rows) if r % 3 == 0], second: [r for r in range(rows) if r % 3 == 1]}
    batch.lora_groups = [(a, torch.tensor(m, dtype=torch.int64)) for a, m in members.items() if m]
    fused, fused_kv, plain, plain_kv, before = _both_paths(model, kv, batch)
    batch.lora_groups = []
    base, _ = _per_op(model, kv, batch, before)
    scale = plain.abs().max().item()
    adapted = members[first]
    assert (plain[adapted] - base[adapted]).abs().max().item() > 0.05 * scale  # the adapter moves its rows
    assert (fused - plain).abs().max().item() <= 0.03 * scale
    assert torch.nn.functional.cosine_similarity(fused, plain, dim=-1).min().item() > 0.999
    base_rows = [r for r in range(rows) if r % 3 == 2]  # base rows beside adapter rows: untouched
    if base_rows:
        assert (fused[base_rows] - base[base_rows]).abs().max().item() <= 2e-3 * scale
    for got, want in zip(fused_kv, plain_kv):  # the K/V written, through the adapters' qkv terms
        assert (got.float() - want.float()).abs().max().item() <= 0.03 * want.float().abs().max().item()


def test_an_adapter_the_one_call_step_cannot_take_keeps_the_per_op_path(model):
    from flared.model.decoder import FUSED_LORA

    c = model.config
    too_wide = model.add_lora_module({"layers.0.o.weight": [
        (0, c.hidden_size, torch.zeros(decode.LORA_MAX_RANK + 1, c.q_size), torch.zeros(c.hidden_size,
                                                                                     decode.LORA_MAX_RANK + 1))]})
    assert model.lora_modules[too_wide - 1][FUSED_LORA] is None
    kv, batch = _decode_batch(model, 2, np.random.default_rng(5))
    batch.lora_groups = [(too_wide, torch.tensor([0], dtype=torch.int64))]
    calls = []
    real = model._forward_fused_decode
    model._forward_fused_decode = lambda *a: calls.append(1) or real(*a)
    try:
        out = model.forward(batch, kv)
    finally:
        del model._forward_fused_decode
    assert calls == [] and out.shape == (2, c.vocab_size)


def test_greedy_tokens_match_on_smollm2(smollm2_source):
    from flared.model.runner import ModelRunner
    from flared.model.sampling import SamplingParams

    runner = ModelRunner(smollm2_source.config, smollm2_source.tensors, dtype=torch.bfloat16, num_pages=32,
                         page_tokens=64, max_batch=16)
    assert runner.model.fused_decode
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 9690, 253, 1345, 10848, 563, 260, 6879], [1, 2], [1, 7, 8, 9]]
    prompts = prompts + [p + [100 + i] for i, p in enumerate(prompts * 2)]  # 12 rows: two register blocks

    def run(fused: bool):
        runner.model.fused_decode = fused
        results = runner.generate(prompts, [SamplingParams(temperature=0, max_tokens=24)] * len(prompts))
        return [r.token_ids for r in results]

    assert run(True) == run(False)


def test_bad_arguments_are_refused():
    good = dict(rows=1, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate=128, num_layers=1,
                eps=1e-6, scale=0.25, window=0, num_slots=64, stride_slots=1, layer_ptrs=1, cos=1, sin=1,
                positions=1, write_slots=1, gather_slots=1, lens=1, k_cache=1, v_cache=1, h=1, x=1, qkv=1, q=1,
                attn=1, act=1)
    with pytest.raises(ValueError, match="rows"):
        decode.decode_layers(**{**good, "rows": decode.MAX_ROWS + 1})
    with pytest.raises(ValueError, match="kv heads"):
        decode.decode_layers(**{**good, "num_kv_heads": 3})
    with pytest.raises(ValueError, match="head_dim"):
        decode.decode_layers(**{**good, "head_dim": 15})
    with pytest.raises(ValueError, match="null"):
        decode.decode_layers(**{**good, "h": 0})
    with pytest.raises(ValueError, match="LoRA"):
        decode.decode_layers(**{**good, "lora_rows": 1, "lora_table": 1, "lora_low": 1, "lora_rank": 0})


def test_rows_of_one_sequence_see_each_other_with_shared_sequences(model):
    """A speculative step's rows (ForwardBatch.shared_sequences): two sequences each feeding three consecutive
    positions as decode rows of one call; every row's logits and the K/V left equal the same tokens fed one step at
    a time (each row sees the keys the rows before it wrote in the same call)."""
    rng = np.random.default_rng(7)
    kv = model.make_kv_cache(num_pages=8, page_tokens=PAGE)
    tables = [np.array([5, 1, 6, 2]), np.array([0, 7, 3, 4])]
    lengths = [21, 40]  # past the mistral fixture's 16-token window
    for table, n in zip(tables, lengths):
        model.forward(ForwardBatch.build([SequenceChunk(rng.integers(3, 500, n), 0, table)], page_tokens=PAGE), kv)
    fed = [rng.integers(3, 500, 3), rng.integers(3, 500, 3)]
    before = (kv.keys.clone(), kv.values.clone())
    window = model.config.sliding_window
    rows = [SequenceChunk(fed[s][j:j + 1], lengths[s] + j, tables[s]) for s in range(2) for j in range(3)]
    batch = ForwardBatch.build(rows, page_tokens=PAGE, sliding_window=window)
    batch.shared_sequences = True
    together = model.forward(batch, kv)
    after = (kv.keys.clone(), kv.values.clone())
    kv.keys.copy_(before[0])
    kv.values.copy_(before[1])
    one_by_one = []
    for j in range(3):
        step = ForwardBatch.build([SequenceChunk(fed[s][j:j + 1], lengths[s] + j, tables[s]) for s in range(2)],
                                  page_tokens=PAGE, sliding_window=window)
        one_by_one.append(model.forward(step, kv))
    want = torch.stack([one_by_one[j][s] for s in range(2) for j in range(3)])
    assert torch.equal(together, want)
    assert torch.equal(after[0], kv.keys) and torch.equal(after[1], kv.values)
