"""Triton paged attention against a float64 reference on random data (fresh inputs, scattered pages)."""

import pytest

torch = pytest.importorskip("torch")

from gpu_models import attention_reference as reference  # noqa: E402


def make_pool(num_pages, page_tokens, nkv, d, dtype):
    k = torch.randn((num_pages + 1) * page_tokens, nkv, d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    return k, v


def seq_kv(pool, table, length, page_tokens):
    pos = torch.arange(length, device="cuda")
    slots = table.long()[pos // page_tokens] * page_tokens + pos % page_tokens
    return pool[slots]


def check_decode(out, q, k_pool, v_pool, tables, lens, page_tokens, tol):
    """Every row of a decode attention output against the float64 reference; padding rows are zeros."""
    for b in range(q.shape[0]):
        n = int(lens[b])
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))
            continue
        ref = reference(q[b:b + 1], seq_kv(k_pool, tables[b], n, page_tokens),
                        seq_kv(v_pool, tables[b], n, page_tokens), torch.tensor([n - 1], device="cuda"))
        err = (out[b:b + 1].double() - ref).norm() / ref.norm()
        assert err < tol, (b, float(err))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("nh, nkv, d", [(9, 3, 64), (32, 8, 128), (4, 4, 64), (8, 2, 80), (4, 4, 192)])
def test_decode_matches_reference(dtype, tol, nh, nkv, d):
    from flared.model.triton_attention import paged_decode_attention

    P, num_pages, B = 16, 64, 5
    k_pool, v_pool = make_pool(num_pages, P, nkv, d, dtype)
    lens = torch.tensor([1, 17, 100, 0, 250], dtype=torch.int32, device="cuda")  # row 3 is padding
    tables = torch.stack([torch.randperm(num_pages, device="cuda")[:16] for _ in range(B)]).to(torch.int32)
    q = torch.randn(B, nh, d, device="cuda", dtype=dtype)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k_pool, v_pool, out, tables, lens, page_tokens=P, scale=d ** -0.5)
    check_decode(out, q, k_pool, v_pool, tables, lens, P, tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nh, nkv, d", [(9, 3, 64), (32, 8, 128), (8, 2, 80), (4, 4, 192)])
@pytest.mark.parametrize("splits", [2, 5, 16])
def test_split_decode_matches_reference(dtype, nh, nkv, d, splits):
    from flared.model.triton_attention import paged_decode_attention_split

    P, num_pages, B = 16, 64, 5
    k_pool, v_pool = make_pool(num_pages, P, nkv, d, dtype)
    # More splits than tiles (1, 17), a padding row (0), many tiles per split (1000).
    lens = torch.tensor([1, 17, 1000, 0, 250], dtype=torch.int32, device="cuda")
    tables = torch.stack([torch.randperm(num_pages, device="cuda") for _ in range(B)]).to(torch.int32)
    q = torch.randn(B, nh, d, device="cuda", dtype=dtype)
    out = torch.full_like(q, float("nan"))
    scratch = B * nh * splits
    part_m, part_l = torch.empty(scratch, device="cuda"), torch.empty(scratch, device="cuda")
    part_acc = torch.empty(scratch * d, device="cuda")
    paged_decode_attention_split(q, k_pool, v_pool, out, tables, lens, part_acc, part_m, part_l, num_splits=splits,
                                 page_tokens=P, scale=d ** -0.5)
    check_decode(out, q, k_pool, v_pool, tables, lens, P, 2e-2)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("cached, new, capacity", [(0, 200, 256), (37, 64, 64), (100, 150, 512), (0, 1, 64)])
def test_prefill_with_cached_prefix_matches_reference(dtype, tol, cached, new, capacity):
    from flared.model.triton_attention import paged_prefill_attention

    P, num_pages, nh, nkv, d = 16, 64, 8, 2, 64
    k_pool, v_pool = make_pool(num_pages, P, nkv, d, dtype)
    table = torch.randperm(num_pages, device="cuda")[:32].to(torch.int32)
    q = torch.randn(capacity, nh, d, device="cuda", dtype=dtype)
    out = torch.full_like(q, float("nan"))
    meta = torch.tensor([cached, new], dtype=torch.int32, device="cuda")
    paged_prefill_attention(q, k_pool, v_pool, out, table, meta, page_tokens=P, scale=d ** -0.5)
    L = cached + new
    ref = reference(q[:new], seq_kv(k_pool, table, L, P), seq_kv(v_pool, table, L, P),
                    torch.arange(cached, L, device="cuda"))
    err = (out[:new].double() - ref).norm() / ref.norm()
    assert err < tol, float(err)
    assert torch.isnan(out[new:]).all()  # rows past the chunk are never written


def check_varlen(out, q, k_pool, v_pool, tables, metas, page_tokens, tol):
    """Each packed sequence's rows of ``out`` against the float64 reference; returns the first row past them."""
    row = 0
    for b, (cached, new) in enumerate(metas):
        if new:
            L = cached + new
            ref = reference(q[row:row + new], seq_kv(k_pool, tables[b], L, page_tokens),
                            seq_kv(v_pool, tables[b], L, page_tokens), torch.arange(cached, L, device="cuda"))
            err = (out[row:row + new].double() - ref).norm() / ref.norm()
            assert err < tol, (b, float(err))
        row += new
    return row


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("nh, nkv, d", [(8, 2, 64), (32, 8, 128), (9, 3, 64), (8, 2, 80), (4, 4, 192)])
@pytest.mark.parametrize("metas, capacity", [
    # (cached, new) per sequence, (0, 0) = padding: odd lengths, cached prefixes, partial query blocks.
    ([(0, 70), (37, 1), (0, 0), (100, 129), (5, 3), (0, 0)], 256),
    ([(0, 128), (0, 128)], 256),  # full capacity, block-aligned
    ([(3, 1)] * 16, 64),  # many one-token chunks: every sequence adds a partial block to the grid
    ([(0, 0), (0, 0), (250, 7)], 64),  # only the last sequence is real
])
def test_varlen_prefill_matches_reference(dtype, tol, nh, nkv, d, metas, capacity):
    """Several sequences packed back to back, each with its own block table and cached prefix (GQA):
    each one's rows against the float64 reference; rows past the last chunk are never written."""
    from flared.model.triton_attention import paged_prefill_attention_varlen

    P, num_pages = 16, 128
    k_pool, v_pool = make_pool(num_pages, P, nkv, d, dtype)
    B = len(metas)
    tables = torch.stack([torch.randperm(num_pages, device="cuda")[:24] for _ in range(B)]).to(torch.int32)
    q = torch.randn(capacity, nh, d, device="cuda", dtype=dtype)
    out = torch.full_like(q, float("nan"))
    meta = torch.tensor(metas, dtype=torch.int32, device="cuda")
    paged_prefill_attention_varlen(q, k_pool, v_pool, out, tables, meta, page_tokens=P, scale=d ** -0.5)
    row = check_varlen(out, q, k_pool, v_pool, tables, metas, P, tol)
    assert torch.isnan(out[row:]).all()


def test_varlen_prefill_is_capturable_and_reads_lengths_on_the_device():
    """Captured once, replayed with different packings written into the same meta tensor."""
    from flared.model.triton_attention import paged_prefill_attention_varlen

    P, num_pages, nh, nkv, d, cap = 16, 64, 8, 2, 64, 128
    k_pool, v_pool = make_pool(num_pages, P, nkv, d, torch.bfloat16)
    tables = torch.stack([torch.randperm(num_pages, device="cuda")[:16] for _ in range(4)]).to(torch.int32)
    q = torch.randn(cap, nh, d, device="cuda", dtype=torch.bfloat16)
    out = torch.zeros_like(q)
    meta = torch.zeros(4, 2, dtype=torch.int32, device="cuda")

    def run():
        paged_prefill_attention_varlen(q, k_pool, v_pool, out, tables, meta, page_tokens=P, scale=d ** -0.5)

    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    for metas in ([(0, 50), (10, 60), (0, 0), (0, 0)], [(7, 1), (0, 2), (30, 100), (0, 25)]):
        meta.copy_(torch.tensor(metas, dtype=torch.int32))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check_varlen(out, q, k_pool, v_pool, tables, metas, P, 2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nh, nkv, d", [(9, 3, 64), (32, 8, 128)])
@pytest.mark.parametrize("splits", [1, 3, 16])
def test_decode_with_rope_matches_the_separate_kernels(dtype, nh, nkv, d, splits):
    """paged_decode_attention_rope against rope_write_kv followed by the plain (or split) decode attention:
    the same K/V in the pool bit for bit, the same output to the float32 order of one extra key."""
    from flared.model.kernels.fused import rope_write_kv
    from flared.model.triton_attention import (paged_decode_attention, paged_decode_attention_rope,
                                               paged_decode_attention_split)

    P, num_pages, B = 16, 128, 6
    k_pool, v_pool = make_pool(num_pages, P, nkv, d, dtype)
    lens = torch.tensor([1, 17, 100, 0, 250, 64], dtype=torch.int32, device="cuda")  # row 3 is padding
    # Disjoint pages: no row reads the page another row's new token goes to (as in serving).
    tables = torch.randperm(num_pages, device="cuda")[:B * 16].view(B, 16).to(torch.int32)
    positions = (lens.long() - 1).clamp_min(0)
    slots = tables.long()[torch.arange(B, device="cuda"), positions // P] * P + positions % P
    slots[3] = num_pages * P  # the padding row writes the scratch page
    qkv = torch.randn(B, (nh + 2 * nkv) * d, device="cuda", dtype=dtype)
    cos = torch.randn(512, d, device="cuda", dtype=dtype)
    sin = torch.randn(512, d, device="cuda", dtype=dtype)
    scratch = dict(part_acc=torch.empty(B * nh * splits * d, device="cuda"),
                   part_m=torch.empty(B * nh * splits, device="cuda"),
                   part_l=torch.empty(B * nh * splits, device="cuda"))

    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    q = torch.empty(B, nh, d, device="cuda", dtype=dtype)
    rope_write_kv(qkv, cos, sin, positions, slots, q, k_ref, v_ref, num_heads=nh, num_kv_heads=nkv, head_dim=d)
    ref = torch.full_like(q, float("nan"))
    if splits > 1:
        paged_decode_attention_split(q, k_ref, v_ref, ref, tables, lens, scratch["part_acc"], scratch["part_m"],
                                     scratch["part_l"], num_splits=splits, page_tokens=P, scale=d ** -0.5)
    else:
        paged_decode_attention(q, k_ref, v_ref, ref, tables, lens, page_tokens=P, scale=d ** -0.5)

    out = torch.full_like(q, float("nan"))
    paged_decode_attention_rope(qkv, cos, sin, positions, slots, k_pool, v_pool, out, tables, lens, num_heads=nh,
                                page_tokens=P, scale=d ** -0.5, num_splits=splits, **scratch)
    assert torch.equal(v_pool, v_ref)
    # The roped k: the same float32 expression as rope_write_kv (a contraction into FMA may move a last bit).
    assert (k_pool != k_ref).float().mean() < 1e-3
    assert torch.allclose(k_pool.float(), k_ref.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    err = (out.float() - ref.float()).norm() / ref.float().norm()
    assert err < 1e-2, float(err)
    check_decode(out, q, k_pool, v_pool, tables, lens, P, 2e-2)


# -- absorbed latent attention (flared/model/triton_mla.py) ---------------------------------------------------------

def _mla_reference(q, rows, latent, scale):
    """q [nh, latent + rope] over one sequence's latent rows [L, latent + rope] (all visible), float64."""
    rows = rows.double()
    return (q.double() @ rows.T * scale).softmax(-1) @ rows[:, :latent]


@pytest.mark.parametrize("pool_dtype", ["model", "fp8"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("nh, latent, rope", [(16, 512, 64), (128, 512, 64), (40, 256, 32), (4, 48, 8)])
def test_mla_kernels_match_reference(pool_dtype, dtype, tol, nh, latent, rope):
    """Decode rows (one a padding row) and packed prefill chunks over cached prefixes, DeepSeek's and MiniCPM3's
    widths, 128 heads in blocks of 16, a float8 pool (its stored values are the reference's)."""
    from flared.model.kv_cache import FP8_KV
    from flared.model.triton_mla import mla_decode_attention, mla_prefill_attention_varlen

    if pool_dtype == "fp8" and dtype == torch.float32:
        pytest.skip("a float8 pool serves half-precision models")
    P, num_pages = 16, 96
    g = torch.Generator(device="cuda").manual_seed(nh + latent)
    pool = torch.randn((num_pages + 1) * P, 1, latent + rope, device="cuda", generator=g).to(dtype)
    if pool_dtype == "fp8":
        pool = pool.to(FP8_KV)
    stored = pool.to(dtype)
    lens = [300, 1, 0, 77, 129]
    if (latent + rope) * pool.element_size() % 16:  # (a float8 row of 56 bytes: refused, not a misaligned fault)
        q = torch.zeros(5, nh, latent + rope, device="cuda", dtype=dtype)
        with pytest.raises(ValueError, match="multiple of 16 bytes"):
            mla_decode_attention(q, pool, torch.zeros(5, nh, latent, device="cuda", dtype=dtype),
                                 torch.zeros(5, 19, device="cuda", dtype=torch.int32),
                                 torch.ones(5, device="cuda", dtype=torch.int32), latent_dim=latent, page_tokens=P,
                                 scale=1.0)
        return
    tables = torch.randperm(num_pages, device="cuda", generator=g)[:5 * 19].view(5, 19).to(torch.int32)
    scale = (latent + rope) ** -0.5
    q = torch.randn(5, nh, latent + rope, device="cuda", generator=g).to(dtype)
    out = torch.full((5, nh, latent), 3.0, device="cuda", dtype=dtype)
    mla_decode_attention(q, pool, out, tables, torch.tensor(lens, device="cuda", dtype=torch.int32), latent_dim=latent,
                         page_tokens=P, scale=scale)
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))
            continue
        ref = _mla_reference(q[b], seq_kv(stored, tables[b], n, P)[:, 0], latent, scale)
        assert ((out[b].double() - ref).norm() / ref.norm()) < tol, b
    if dtype != torch.float32:  # the context in shares (flash-decoding), merged by the combine kernel
        scratch = 5 * nh * 3
        split = torch.full_like(out, 3.0)
        mla_decode_attention(q, pool, split, tables, torch.tensor(lens, device="cuda", dtype=torch.int32),
                             latent_dim=latent, page_tokens=P, scale=scale, num_splits=3,
                             part_acc=torch.empty(scratch * latent, device="cuda"),
                             part_m=torch.empty(scratch, device="cuda"), part_l=torch.empty(scratch, device="cuda"))
        assert torch.equal(split[2], torch.zeros_like(split[2]))
        assert ((split.double() - out.double()).norm() / out.double().norm()) < tol
    chunks = [(200, 100), (0, 1), (0, 0), (60, 17), (0, 129)]  # (cached, new)
    capacity = sum(n for _, n in chunks) + 5
    q = torch.randn(capacity, nh, latent + rope, device="cuda", generator=g).to(dtype)
    out = torch.full((capacity, nh, latent), 3.0, device="cuda", dtype=dtype)
    mla_prefill_attention_varlen(q, pool, out, tables, torch.tensor(chunks, device="cuda", dtype=torch.int32),
                                 latent_dim=latent, page_tokens=P, scale=scale)
    row = 0
    for b, (cached, new) in enumerate(chunks):
        keys = seq_kv(stored, tables[b], cached + new, P)[:, 0]
        for j in list(range(min(new, 3))) + list(range(max(3, new - 3), new)):  # (each chunk's first and last rows)
            ref = _mla_reference(q[row + j], keys[:cached + j + 1], latent, scale)
            assert ((out[row + j].double() - ref).norm() / ref.norm()) < tol, (b, j)
        row += new
    assert torch.equal(out[row:], torch.full_like(out[row:], 3.0))
