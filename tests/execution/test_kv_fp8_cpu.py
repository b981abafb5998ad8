"""A float8 KV cache (kv_cache_dtype "fp8") on the CPU eager executor.

The pool holds float8 e4m3, one byte a value: ``write`` saturates at +-448 and ``gather`` widens back exactly;
a forward that attends to its own fresh keys sees them as stored. The model thread serves with it: greedy tokens
follow the model-dtype cache's, a prompt served again over its cached prefix (a float8 snapshot restored) gives
the cold run's tokens, and the core's KV budget holds twice a bf16 core's pages (four times a float32 one's).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

FP8 = torch.float8_e4m3fn


def test_a_float8_pool_stores_saturated_and_gathers_what_it_stored():
    from flared.model.config import ModelConfig
    from flared.model.kv_cache import PagedKVCache, to_storage

    config = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                         rope_scaling=None, max_position_embeddings=128, tie_word_embeddings=False,
                         attention_bias=False, qk_norm=False)
    kv = PagedKVCache(config, num_pages=4, page_tokens=16, dtype=torch.bfloat16, storage_dtype=FP8)
    ref = PagedKVCache(config, num_pages=4, page_tokens=16, dtype=torch.bfloat16)
    assert kv.keys.dtype == FP8 and kv.num_bytes * 2 == ref.num_bytes
    g = torch.Generator().manual_seed(0)
    keys = (torch.randn(10, 2, 8, generator=g) * 50).to(torch.bfloat16)
    values = (torch.randn(10, 2, 8, generator=g) * 3).to(torch.bfloat16)
    keys[0, 0, 0], keys[1, 1, 1] = 1000.0, -5000.0
    slots = torch.tensor([3, 60, 7, 8, 9, 20, 21, 22, 40, 41])
    kv.write(1, slots, keys, values)
    got_k, got_v = kv.gather(1, slots)  # [kv_heads, N, d]
    assert got_k.dtype == torch.bfloat16
    assert torch.equal(got_k, to_storage(keys, FP8).to(torch.bfloat16).transpose(0, 1))
    assert torch.equal(got_v, kv.as_stored(values).transpose(0, 1))
    assert got_k[0, 0, 0].item() == 448.0 and got_k[1, 1, 1].item() == -448.0
    assert not torch.isnan(got_k).any()
    # what gather returns, written back, is stored unchanged (snapshots restore exactly)
    kv.write(0, slots, got_k.transpose(0, 1), got_v.transpose(0, 1))
    assert torch.equal(kv.keys[0].view(torch.uint8)[:, slots], kv.keys[1].view(torch.uint8)[:, slots])
    with pytest.raises(ValueError, match="stores"):
        PagedKVCache(config, num_pages=4, page_tokens=16, dtype=torch.bfloat16, storage_dtype=torch.float16)


def _serve(core, kv_cache_dtype, prompts, repeat_first=False):
    from flared.core.load import open_core
    from flared.model.sampling import SamplingParams
    from flared.runtime.request import ErrorEvent, FinishEvent, GenerateRequest, TokenEvent
    from flared.runtime.worker import ModelRuntime
    from flared_testing.runtime import run_requests

    rt = ModelRuntime(open_core(core), prefix_cache=True, kv_cache_dtype=kv_cache_dtype)
    rt.start(max_pending=16)
    try:
        runs = [prompts] + ([prompts[:1]] if repeat_first else [])
        tokens, cached = [], []
        for batch in runs:
            reqs = [GenerateRequest(tuple(p), (), SamplingParams(max_tokens=16, temperature=0.0), frozenset())
                    for p in batch]
            for events in run_requests(rt, reqs):
                assert not isinstance(events[-1], ErrorEvent), events[-1]
                assert isinstance(events[-1], FinishEvent)
                cached.append(events[-1].num_cached_tokens)
                tokens.append([t for e in events if isinstance(e, TokenEvent) for t in e.token_ids])
        info = rt.kv_cache_info()
        assert info["pages"] == rt.snapshot()["total_pages"]
        return tokens, cached, info
    finally:
        rt.stop()


def test_the_cpu_model_thread_serves_a_float8_cache(tiny_core):
    prompts = [[5 + i, 17, 40 + 3 * i, 9, 7] * (7 + i) for i in range(4)]  # 35-50 tokens: whole pages cached
    base, _, base_info = _serve(tiny_core, "auto", prompts)
    fp8, cached, info = _serve(tiny_core, "fp8", prompts, repeat_first=True)
    assert info["dtype"] == "float8_e4m3fn" and base_info["dtype"] in ("float32", "bfloat16")
    # the core's KV budget holds more float8 pages: as many bytes of pool (the snapshots shrink)
    widen = 4 if base_info["dtype"] == "float32" else 2
    assert info["pages"] == widen * base_info["pages"] and info["bytes"] <= base_info["bytes"]
    assert all(len(t) == 16 for t in fp8)
    # the warm run reused whole pages (and a float8 snapshot) and gave the cold run's tokens
    assert cached[-1] >= 32 and fp8[-1] == fp8[0]
    firsts = sum(a[0] == b[0] for a, b in zip(fp8[:4], base))
    assert firsts >= 3, (firsts, fp8[:4], base)
