"""Fused Triton kernels against the torch ops they replace (bfloat16 and float32, fresh random inputs)."""

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_add_rms_norm(dtype, tol):
    from flared.model.kernels.fused import add_rms_norm

    h = torch.randn(7, 576, device="cuda", dtype=dtype)
    x = torch.randn_like(h)
    w = torch.randn(576, device="cuda", dtype=dtype)
    res, out = h.clone(), torch.full_like(h, float("nan"))
    add_rms_norm(x, res, w, out, 1e-5)
    ref = F.rms_norm((h + x).float(), (576,), w.float(), 1e-5)
    assert torch.allclose(res.float(), (h.float() + x.float()), atol=tol * 4, rtol=tol)
    assert ((out.float() - ref).norm() / ref.norm()) < tol


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("nh, nkv, d", [(9, 3, 64), (32, 8, 128)])
def test_rope_write_kv(dtype, tol, nh, nkv, d):
    from flared.model.kernels.fused import rope_write_kv

    T = 5
    qkv = torch.randn(T, (nh + 2 * nkv) * d, device="cuda", dtype=dtype)
    cos = torch.randn(64, d, device="cuda", dtype=dtype)
    sin = torch.randn(64, d, device="cuda", dtype=dtype)
    pos = torch.tensor([0, 5, 63, 17, 2], device="cuda")
    slots = torch.tensor([9, 0, 31, 4, 22], device="cuda")
    q = torch.full((T, nh, d), float("nan"), device="cuda", dtype=dtype)
    kp = torch.zeros(32, nkv, d, device="cuda", dtype=dtype)
    vp = torch.zeros_like(kp)
    rope_write_kv(qkv, cos, sin, pos, slots, q, kp, vp, num_heads=nh, num_kv_heads=nkv, head_dim=d)
    qk = qkv[:, :(nh + nkv) * d].reshape(T, nh + nkv, d).float()
    ref = qk * cos[pos].float()[:, None] + qk.roll(d // 2, dims=-1) * sin[pos].float()[:, None]
    assert ((q.float() - ref[:, :nh]).norm() / ref[:, :nh].norm()) < tol
    assert ((kp[slots].float() - ref[:, nh:]).norm() / ref[:, nh:].norm()) < tol
    assert torch.equal(vp[slots], qkv[:, (nh + nkv) * d:].view(T, nkv, d))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_silu_mul(dtype, tol):
    from flared.model.kernels.fused import silu_mul

    gu = torch.randn(3, 2 * 1536, device="cuda", dtype=dtype)
    out = torch.full((3, 1536), float("nan"), device="cuda", dtype=dtype)
    silu_mul(gu, out)
    ref = F.silu(gu[:, :1536].float()) * gu[:, 1536:].float()
    assert ((out.float() - ref).norm() / ref.norm()) < tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch, vocab", [(1, 49152), (3, 1000), (64, 128256), (5, 2049)])
def test_head_epilogue_matches_torch(dtype, batch, vocab):
    from flared.model.kernels.fused import head_epilogue, head_parts

    g = torch.Generator(device="cuda").manual_seed(batch)
    logits = torch.randn(batch, vocab, device="cuda", generator=g).to(dtype)
    # Ties across programs and inside one block: the first index must win, as torch.argmax has it.
    _, n_chunks = head_parts(batch, vocab)
    logits[0, vocab - 1] = 50.0
    logits[0, vocab // 2] = 50.0
    if batch > 1:
        logits[1, 7] = 60.0
        logits[1, 9] = 60.0
    logits[-1] = float("-inf")  # no finite logit: token 0, as torch
    rows = torch.randperm(batch + 3, device="cuda", generator=g)[:batch]
    out = torch.full((batch + 2, vocab), float("nan"), device="cuda")
    state = torch.full((batch + 3, vocab), float("nan"), device="cuda")
    parts = (torch.empty(batch * n_chunks, device="cuda"),
             torch.empty(batch * n_chunks, device="cuda", dtype=torch.int32))
    sampled = torch.full((batch + 2,), -1, device="cuda", dtype=torch.int64)
    last = torch.full((batch + 3,), -1, device="cuda", dtype=torch.int64)
    head_epilogue(logits, out, state, rows, parts, sampled, last)
    wide = logits.float()
    assert torch.equal(out[:batch], wide)
    assert out[batch:].isnan().all()
    assert torch.equal(state[rows], wide)
    untouched = torch.ones(batch + 3, dtype=torch.bool, device="cuda")
    untouched[rows] = False
    assert state[untouched].isnan().all()
    assert torch.equal(sampled[:batch], wide.argmax(dim=-1))
    assert (sampled[batch:] == -1).all()
    assert torch.equal(last[rows], wide.argmax(dim=-1))
    assert (last[untouched] == -1).all()
    # Without partials: the widening only.
    out2 = torch.zeros_like(out)
    head_epilogue(logits, out2, state, rows)
    assert torch.equal(out2[:batch], wide)
