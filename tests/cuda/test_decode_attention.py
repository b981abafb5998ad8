"""The CUDA decode attention (kernels/decode_attention.cu) against the Triton kernel it stands in for and a
float64 reference: the same K/V written, the same outputs to rounding, padding rows zero, every tuning build."""

import pytest

torch = pytest.importorskip("torch")

from test_attention import check_decode, make_pool  # noqa: E402


def operands(nh, nkv, d, lens, P=16, pages_per_row=64):
    """Random bf16 pools, disjoint scattered pages per row, and a step's QKV rows, positions, slots, tables."""
    B = len(lens)
    num_pages = B * pages_per_row
    k_pool, v_pool = make_pool(num_pages, P, nkv, d, torch.bfloat16)
    lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    tables = torch.randperm(num_pages, device="cuda").view(B, pages_per_row).to(torch.int32)
    positions = (lens.long() - 1).clamp_min(0)
    slots = tables.long()[torch.arange(B, device="cuda"), positions // P] * P + positions % P
    slots[lens == 0] = num_pages * P  # padding rows write the scratch page
    qkv = torch.randn(B, (nh + 2 * nkv) * d, device="cuda", dtype=torch.bfloat16)
    cos = torch.randn(P * pages_per_row, d, device="cuda", dtype=torch.bfloat16)
    sin = torch.randn(P * pages_per_row, d, device="cuda", dtype=torch.bfloat16)
    return dict(qkv=qkv, cos_table=cos, sin_signed_table=sin, positions=positions, slots=slots, k_pool=k_pool,
                v_pool=v_pool, block_tables=tables, context_lens=lens)


def run_both(nh, d, o, build=None):
    """The Triton kernel on copies of the pools, then the CUDA one: (triton out, cuda out, triton pools)."""
    from flared.model.kernels.decode_attention import decode_attention_rope
    from flared.model.triton_attention import paged_decode_attention_rope

    B = o["qkv"].shape[0]
    ref_pools = o["k_pool"].clone(), o["v_pool"].clone()
    ref = torch.full((B, nh, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    tri = dict(o, k_pool=ref_pools[0], v_pool=ref_pools[1])
    paged_decode_attention_rope(out=ref, num_heads=nh, page_tokens=16, scale=d ** -0.5, **tri)
    out = torch.full_like(ref, float("nan"))
    decode_attention_rope(out=out, num_heads=nh, page_tokens=16, scale=d ** -0.5, build=build, **o)
    torch.cuda.synchronize()
    return ref, out, ref_pools


@pytest.fixture(autouse=True)
def _needs_kernel():
    from flared.model.kernels import decode_attention

    if not decode_attention.available():
        pytest.skip("needs compute capability 9.0 and CuPy")


@pytest.mark.parametrize("nh, nkv, d", [(32, 8, 128), (9, 3, 64), (28, 4, 128), (16, 16, 128)])
def test_matches_the_triton_kernel_and_the_reference(nh, nkv, d):
    lens = [1, 2, 15, 16, 17, 0, 100, 255, 256, 257, 1000, 63, 64, 65, 129, 384]
    torch.manual_seed(0)
    o = operands(nh, nkv, d, lens)
    ref, out, (k_ref, v_ref) = run_both(nh, d, o)
    assert torch.equal(o["v_pool"], v_ref)
    # The roped new k: the same float32 expression (a contraction into FMA may move a last bit).
    assert (o["k_pool"] != k_ref).float().mean() < 1e-3
    assert torch.allclose(o["k_pool"].float(), k_ref.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(out[5], torch.zeros_like(out[5]))  # the padding row
    assert not out.isnan().any()
    err = (out.float() - ref.float()).norm() / ref.float().norm()
    assert err < 1e-2, float(err)
    # Against float64 with the q that the kernel ropes (the Triton kernel's rounding of it).
    from flared.model.kernels.fused import rope_write_kv

    q = torch.empty(len(lens), nh, d, device="cuda", dtype=torch.bfloat16)
    k2, v2 = k_ref.clone(), v_ref.clone()
    rope_write_kv(o["qkv"], o["cos_table"], o["sin_signed_table"], o["positions"], o["slots"], q, k2, v2,
                  num_heads=nh, num_kv_heads=nkv, head_dim=d)
    check_decode(out, q, o["k_pool"], o["v_pool"], o["block_tables"], o["context_lens"], 16, 2e-2)


@pytest.mark.parametrize("prefetch, blocks", [(1, 2), (1, 3), (0, 3), (0, 4), (1, 1)])
def test_every_tuning_build_gives_the_same_attention(prefetch, blocks):
    from flared.model.kernels.decode_attention import Build

    torch.manual_seed(1)
    o = operands(32, 8, 128, [300, 1, 0, 47, 512, 33])
    ref, out, _ = run_both(32, 128, o, Build(4, 128, 16, prefetch=prefetch, blocks_per_sm=blocks))
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    err = (out.float() - ref.float()).norm() / ref.float().norm()
    assert err < 1e-2, float(err)


def test_a_captured_graph_reads_lengths_and_tables_on_the_device():
    """Captured once, replayed after the rows' contexts and pages change in place: the results follow."""
    from flared.model.kernels.decode_attention import decode_attention_rope

    torch.manual_seed(2)
    o = operands(32, 8, 128, [10, 20, 30, 40])
    out = torch.zeros(4, 32, 128, device="cuda", dtype=torch.bfloat16)
    decode_attention_rope(out=out, num_heads=32, page_tokens=16, scale=128 ** -0.5, **o)  # loads the kernel
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        decode_attention_rope(out=out, num_heads=32, page_tokens=16, scale=128 ** -0.5, **o)
    fresh = operands(32, 8, 128, [200, 0, 77, 5])
    for name in ("qkv", "positions", "slots", "block_tables", "context_lens", "k_pool", "v_pool"):
        o[name].copy_(fresh[name])
    # The tables rows index the same pool size; cos/sin stay (both runs read the same ones).
    graph.replay()
    torch.cuda.synchronize()
    ref, _, _ = run_both(32, 128, dict(o, k_pool=o["k_pool"].clone(), v_pool=o["v_pool"].clone()))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    err = (out.float() - ref.float()).norm() / ref.float().norm()
    assert err < 1e-2, float(err)


def test_wrong_operands_are_refused():
    from flared.model.kernels.decode_attention import Build, decode_attention_rope, unsupported

    assert unsupported(32, 8, 128, torch.bfloat16) is None
    assert "bf16" in unsupported(32, 8, 128, torch.float16)
    assert unsupported(128, 8, 128, torch.bfloat16) is not None  # a group of 16: past the matrix unit's 8 rows
    with pytest.raises(ValueError):
        Build(4, 96, 16)
    o = operands(32, 8, 128, [5])
    out = torch.empty(1, 32, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="int32"):
        decode_attention_rope(out=out, num_heads=32, page_tokens=16, scale=0.1,
                              **dict(o, context_lens=o["context_lens"].long()))
    with pytest.raises(ValueError, match="does not match"):
        decode_attention_rope(out=out, num_heads=32, page_tokens=16, scale=0.1, build=Build(4, 128, 32), **o)


def test_a_decode_step_through_it_matches_the_triton_step(monkeypatch):
    """PagedCudaDecoder with the CUDA attention (FLARED_CUDA_ATTENTION=1's build) against the same step through
    the Triton kernel, both at one context share: logits and written K/V to rounding; a replay is exact."""
    from test_blas_lt import _decoder
    from test_megakernel import _step

    from flared.execution.graphs import time_graph_us
    from flared.model.kernels import paged_decoder

    monkeypatch.setattr(paged_decoder, "decode_splits", lambda *args, **kwargs: 1)
    g = torch.Generator().manual_seed(7)
    contexts = torch.randint(1, 400, (24,), generator=g).tolist()
    contexts[5] = 0  # a padding row
    model, dec = _decoder(24, contexts)
    assert dec.attn_build is None  # off unless FLARED_CUDA_ATTENTION=1
    ref, ref_k, ref_v = _step(dec, 24, mega=False)
    dec.attn_build = dec.cuda_attention_build()
    assert dec.attn_build is not None
    got, k, v = _step(dec, 24, mega=False)
    live = [r for r, c in enumerate(contexts) if c > 0]
    scale = ref[live].abs().max().item()
    assert (got[live] - ref[live]).abs().max().item() <= 0.03 * scale
    assert torch.nn.functional.cosine_similarity(got[live], ref[live], dim=-1).min().item() > 0.999
    # Layer 0's K/V come before any attention: the same bits; later layers' follow its rounding.
    assert torch.equal(v[0], ref_v[0]) and (k[0] != ref_k[0]).float().mean() < 1e-3
    assert (k.float() - ref_k.float()).abs().max().item() < 0.05
    assert (v.float() - ref_v.float()).abs().max().item() < 0.05
    time_graph_us(lambda: dec.decode(24, False), torch.cuda.Stream(), replays=3)
    torch.cuda.synchronize()
    assert torch.equal(dec.logits[live], got[live])
