"""A float8 KV cache (kv_cache_dtype "fp8", torch.float8_e4m3fn) on the GPU.

- Each Triton attention kernel reading a float8 pool gives what it gives reading a bf16 pool that holds the same
  values widened (float8 e4m3 values are all bf16 values), and matches the float64 reference on them.
- The kernels that write K/V (the fused rotary + attention kernel, rope_write_kv) and torch's write_kv store what
  torch's own conversion of the bf16 values gives, saturated at +-448 instead of NaN.
- The fused kernel's newest token joins its own step's attention as stored.
- A decoder refuses what it cannot run (the megakernel and the CUDA attention stay off), and the model thread
  serves a bf16 core with a float8 cache: prefix-cache hits (snapshots in float8) give the tokens a cold run
  gives, and greedy tokens follow the bf16 cache's.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gpu_models import attention_reference as reference  # noqa: E402

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
P = 16


@pytest.fixture(autouse=True)
def _needs_fp8():
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 e4m3 needs compute capability 8.9 or newer")


def pools(num_pages, nkv, d, seed=0):
    """(k8, v8) float8 pools of random values spread over e4m3's range, and (k16, v16): the same values in bf16."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = ((num_pages + 1) * P, nkv, d)
    k8 = (torch.randn(shape, device="cuda", generator=g) * 3).to(FP8)
    v8 = (torch.randn(shape, device="cuda", generator=g) * 3).to(FP8)
    return k8, v8, k8.to(BF16), v8.to(BF16)


def seq_kv(pool, table, length):
    pos = torch.arange(length, device="cuda")
    return pool[table.long()[pos // P] * P + pos % P]


def close_to_bf16_run(out8, out16):
    """The float8 pool's output against the widened bf16 pool's: the same up to a bf16 rounding or two (the float8
    pool's dots run in float16)."""
    assert not torch.isnan(out8).any()
    torch.testing.assert_close(out8.float(), out16.float(), atol=1 / 64, rtol=1 / 64)


@pytest.mark.parametrize("nh, nkv, d", [(9, 3, 64), (32, 8, 128)])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_reads_a_float8_pool(nh, nkv, d, splits):
    from flared.model.triton_attention import paged_decode_attention, paged_decode_attention_split

    num_pages, B = 64, 5
    k8, v8, k16, v16 = pools(num_pages, nkv, d)
    lens = torch.tensor([1, 17, 300, 0, 250], dtype=torch.int32, device="cuda")
    tables = torch.stack([torch.randperm(num_pages, device="cuda")[:20] for _ in range(B)]).to(torch.int32)
    q = torch.randn(B, nh, d, device="cuda", dtype=BF16)
    outs = []
    for k, v in ((k8, v8), (k16, v16)):
        out = torch.full_like(q, float("nan"))
        if splits == 1:
            paged_decode_attention(q, k, v, out, tables, lens, page_tokens=P, scale=d ** -0.5)
        else:
            scratch = B * nh * splits
            paged_decode_attention_split(q, k, v, out, tables, lens, torch.empty(scratch * d, device="cuda"),
                                         torch.empty(scratch, device="cuda"), torch.empty(scratch, device="cuda"),
                                         num_splits=splits, page_tokens=P, scale=d ** -0.5)
        outs.append(out)
    close_to_bf16_run(*outs)
    for b in range(B):
        n = int(lens[b])
        if n == 0:
            assert torch.equal(outs[0][b], torch.zeros_like(outs[0][b]))
            continue
        ref = reference(q[b:b + 1], seq_kv(k16, tables[b], n), seq_kv(v16, tables[b], n),
                        torch.tensor([n - 1], device="cuda"))
        assert ((outs[0][b:b + 1].double() - ref).norm() / ref.norm()).item() < 2e-2


def test_prefill_reads_a_float8_pool():
    from flared.model.triton_attention import paged_prefill_attention_varlen

    num_pages, nh, nkv, d = 128, 8, 2, 64
    k8, v8, k16, v16 = pools(num_pages, nkv, d, seed=1)
    metas = [(0, 70), (37, 1), (0, 0), (100, 129)]
    tables = torch.stack([torch.randperm(num_pages, device="cuda")[:24] for _ in metas]).to(torch.int32)
    q = torch.randn(256, nh, d, device="cuda", dtype=BF16)
    meta = torch.tensor(metas, dtype=torch.int32, device="cuda")
    outs = []
    for k, v in ((k8, v8), (k16, v16)):
        out = torch.full_like(q, float("nan"))
        paged_prefill_attention_varlen(q, k, v, out, tables, meta, page_tokens=P, scale=d ** -0.5)
        outs.append(out)
    rows = sum(n for _, n in metas)
    close_to_bf16_run(outs[0][:rows], outs[1][:rows])
    row = 0
    for b, (cached, new) in enumerate(metas):
        if new:
            L = cached + new
            ref = reference(q[row:row + new], seq_kv(k16, tables[b], L), seq_kv(v16, tables[b], L),
                            torch.arange(cached, L, device="cuda"))
            assert ((outs[0][row:row + new].double() - ref).norm() / ref.norm()).item() < 2e-2
        row += new


def roped(qkv, cos, sin, positions, nh, nkv, d):
    """(q [B, nh, d], k [B, nkv, d], v [B, nkv, d]) in bf16: the rotary in float32 from the tables, as the kernels."""
    B = qkv.shape[0]
    x = qkv.float()
    c, s = cos.float()[positions][:, None, :], sin.float()[positions][:, None, :]
    qk = x[:, :(nh + nkv) * d].view(B, nh + nkv, d)
    qk = (qk * c + qk.roll(d // 2, dims=-1) * s).to(BF16)
    return qk[:, :nh], qk[:, nh:], qkv[:, (nh + nkv) * d:].view(B, nkv, d)


def as_stored(x):
    """torch's float8 of bf16 values, saturated at +-448."""
    return x.float().clamp(-448, 448).to(FP8)


@pytest.mark.parametrize("splits", [1, 3])
def test_rope_attention_writes_float8_and_attends_to_what_it_stored(splits):
    """paged_decode_attention_rope over a float8 pool: the new token's K/V stored as torch converts them (values
    past 448 saturate), and the output equals the plain decode attention over the pool after the write (the newest
    key joins as stored, not in bf16)."""
    from flared.model.triton_attention import (paged_decode_attention, paged_decode_attention_rope,
                                               paged_decode_attention_split)

    nh, nkv, d, num_pages, B = 32, 8, 128, 128, 6
    k8, v8, _, _ = pools(num_pages, nkv, d, seed=2)
    lens = torch.tensor([1, 17, 100, 0, 250, 64], dtype=torch.int32, device="cuda")
    tables = torch.randperm(num_pages, device="cuda")[:B * 16].view(B, 16).to(torch.int32)
    positions = (lens.long() - 1).clamp_min(0)
    slots = tables.long()[torch.arange(B, device="cuda"), positions // P] * P + positions % P
    slots[3] = num_pages * P
    qkv = torch.randn(B, (nh + 2 * nkv) * d, device="cuda", dtype=BF16) * 4
    qkv[0, (nh + nkv) * d] = 1000.0  # a value past e4m3's range: saturates at 448
    qkv[1, (nh + nkv) * d + 1] = -3000.0
    cos = torch.randn(512, d, device="cuda", dtype=BF16)
    sin = torch.randn(512, d, device="cuda", dtype=BF16)
    scratch = dict(part_acc=torch.empty(B * nh * splits * d, device="cuda"),
                   part_m=torch.empty(B * nh * splits, device="cuda"),
                   part_l=torch.empty(B * nh * splits, device="cuda"))
    out = torch.full((B, nh, d), float("nan"), device="cuda", dtype=BF16)
    paged_decode_attention_rope(qkv, cos, sin, positions, slots, k8, v8, out, tables, lens, num_heads=nh,
                                page_tokens=P, scale=d ** -0.5, num_splits=splits, **scratch)
    q, k, v = roped(qkv, cos, sin, positions, nh, nkv, d)
    live = lens > 0
    assert torch.equal(k8[slots[live]].view(torch.uint8), as_stored(k[live]).view(torch.uint8))
    assert torch.equal(v8[slots[live]].view(torch.uint8), as_stored(v[live]).view(torch.uint8))
    assert v8[slots[0], 0, 0].float().item() == 448.0 and v8[slots[1], 0, 1].float().item() == -448.0
    ref = torch.full_like(out, float("nan"))
    if splits == 1:
        paged_decode_attention(q.contiguous(), k8, v8, ref, tables, lens, page_tokens=P, scale=d ** -0.5)
    else:
        paged_decode_attention_split(q.contiguous(), k8, v8, ref, tables, lens, scratch["part_acc"],
                                     scratch["part_m"], scratch["part_l"], num_splits=splits, page_tokens=P,
                                     scale=d ** -0.5)
    close_to_bf16_run(out, ref)


def test_rope_write_kv_and_write_kv_store_float8_as_torch_converts():
    from flared.model.kernels.fused import rope_write_kv
    from flared.model.kernels.paged_decoder import write_kv

    nh, nkv, d, T = 8, 2, 64, 40
    k8 = torch.zeros(64 * P, nkv, d, device="cuda", dtype=FP8)
    v8 = torch.zeros_like(k8)
    qkv = torch.randn(T, (nh + 2 * nkv) * d, device="cuda", dtype=BF16) * 4
    qkv[3, (nh + nkv) * d + 5] = 900.0
    positions = torch.arange(T, device="cuda") + 7
    slots = torch.randperm(64 * P, device="cuda")[:T]
    cos = torch.randn(512, d, device="cuda", dtype=BF16)
    sin = torch.randn(512, d, device="cuda", dtype=BF16)
    q_out = torch.empty(T, nh, d, device="cuda", dtype=BF16)
    rope_write_kv(qkv, cos, sin, positions, slots, q_out, k8, v8, num_heads=nh, num_kv_heads=nkv, head_dim=d)
    q, k, v = roped(qkv, cos, sin, positions, nh, nkv, d)
    assert torch.equal(q_out, q)
    assert torch.equal(k8[slots].view(torch.uint8), as_stored(k).view(torch.uint8))
    assert torch.equal(v8[slots].view(torch.uint8), as_stored(v).view(torch.uint8))
    assert v8[slots[3], 0, 5].float().item() == 448.0
    # torch's path (the layered float32 / qk-norm forward) stores the same bytes
    k_t, v_t = torch.zeros_like(k8), torch.zeros_like(v8)
    write_kv(k_t, slots, k)
    write_kv(v_t, slots, v)
    assert torch.equal(k_t.view(torch.uint8), k8.view(torch.uint8))
    assert torch.equal(v_t.view(torch.uint8), v8.view(torch.uint8))


def test_a_float8_decoder_turns_off_what_reads_bf16_pools():
    """The tiny model in bf16 with a float8 pool: no megakernel, no CUDA attention; a decode and a prefill step
    run (skinny kernels, the layered forward) and write only finite values."""
    from gpu_models import make_executor, make_scheduler, serving_model, tiny_hf

    from flared.execution.offline import drive
    from flared.model.sampling import SamplingParams

    model = serving_model(tiny_hf(), dtype=BF16)
    ex = make_executor(model)
    ex8 = make_executor(model, kv_cache_dtype="fp8")
    try:
        dec = ex8.decoder
        assert dec.k_pool.dtype == FP8 and ex8.snap_keys.dtype == FP8
        assert dec.mega_limit == 0 and dec.mega_max_rows == 0 and dec.cuda_attention_build() is None
        assert dec.kv_bytes * 2 == ex.decoder.kv_bytes
        prompts = [[5 + i, 17, 40 + 3 * i, 99, 7] * (3 + i) for i in range(4)]
        params = [SamplingParams(temperature=0.0, max_tokens=24)] * len(prompts)
        got = {}
        for name, e in (("bf16", ex), ("fp8", ex8)):
            got[name] = drive(make_scheduler(graph_shapes=e.graph_shapes), e, prompts, params).tokens
        assert all(len(t) == 24 for t in got["fp8"])
        assert torch.isfinite(dec.k_pool.float()).all() and torch.isfinite(dec.v_pool.float()).all()
        firsts = sum(a[0] == b[0] for a, b in zip(got["fp8"], got["bf16"]))
        print("first tokens equal to the bf16 cache's:", firsts, "of", len(prompts))
        assert firsts >= len(prompts) - 1
    finally:
        ex.close()
        ex8.close()


def test_the_model_thread_serves_a_float8_cache_with_prefix_hits(bf16_core):
    """ModelRuntime(kv_cache_dtype="fp8"): a prompt served cold, then again over its cached prefix (pages and a
    float8 snapshot restored), gives the same greedy tokens; a batch beside it completes."""
    from flared.core.load import open_core
    from flared.model.sampling import SamplingParams
    from flared.runtime.request import ErrorEvent, FinishEvent, GenerateRequest, TokenEvent
    from flared.runtime.worker import ModelRuntime
    from flared_testing.runtime import run_requests

    cached = []

    def tokens(rt, prompts, **kw):
        out = []
        for events in run_requests(rt, [GenerateRequest(tuple(p), (), SamplingParams(max_tokens=20, **kw),
                                                        frozenset()) for p in prompts]):
            assert not isinstance(events[-1], ErrorEvent), events[-1]
            assert isinstance(events[-1], FinishEvent)
            cached.append(events[-1].num_cached_tokens)
            out.append([t for e in events if isinstance(e, TokenEvent) for t in e.token_ids])
        return out

    rt = ModelRuntime(open_core(bf16_core), prefix_cache=True, kv_cache_dtype="fp8")
    rt.start(max_pending=16)
    try:
        assert rt.executor.decoder.k_pool.dtype == FP8
        info = rt.kv_cache_info()  # /admin/models and flare_kv_cache_bytes{dtype}
        assert info["dtype"] == "float8_e4m3fn" and info["bytes"] == rt.executor.num_bytes
        prompt = [5, 17, 40, 99, 7] * 9  # 45 tokens: two full pages cached
        cold = tokens(rt, [prompt], temperature=0.0)
        warm = tokens(rt, [prompt], temperature=0.0)
        assert warm == cold and len(cold[0]) == 20
        assert cached[0] == 0 and cached[1] >= 32, cached
        batch = tokens(rt, [[9 + i, 33, 2 + i] * (4 + i) for i in range(4)], temperature=0.8, seed=3)
        assert all(len(t) == 20 for t in batch)
    finally:
        rt.stop()
