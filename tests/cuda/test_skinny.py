"""Skinny fused decode kernels against the unfused ops they replace, step for step (same roundings)."""

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _norm(h, w, eps, dt):
    r = h.float()
    inv = torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps)
    return ((r * inv).to(dt).float() * w.float()).to(dt)


def _close(a, b, dt):
    # One rounding step of the dtype apart at most (accumulation order differs from cuBLAS).
    tol = 2 ** -7 if dt == torch.bfloat16 else 2 ** -10
    scale = b.float().abs().max().clamp_min(1.0)
    return (a.float() - b.float()).abs().max().item() <= 2 * tol * scale


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("H, nh, nkv, d, inter", [(576, 9, 3, 64, 1536), (512, 4, 2, 128, 1024)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_layer_ops(dt, rows, H, nh, nkv, d, inter, with_bias):
    from flared.model.kernels import skinny

    g = torch.Generator(device="cuda").manual_seed(rows * 7 + d)
    dev = "cuda"

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, device=dev, generator=g)).to(dt)

    eps = 1e-5
    h, nw = rnd(rows, H), (1 + rnd(H, scale=0.1).float()).to(dt)
    n_qkv = (nh + 2 * nkv) * d
    wqkv, bias = rnd(n_qkv, H, scale=0.05), (rnd(n_qkv, scale=0.1) if with_bias else None)
    cos, sin = rnd(256, d), rnd(256, d)
    pos = torch.randint(0, 256, (rows,), device=dev, generator=g)
    slots = torch.randperm(64, device=dev, generator=g)[:rows]
    q = torch.full((rows, nh, d), float("nan"), device=dev, dtype=dt)
    kp, vp = torch.zeros(64, nkv, d, device=dev, dtype=dt), torch.zeros(64, nkv, d, device=dev, dtype=dt)
    skinny.norm_qkv_rope(h, nw, eps, wqkv, bias, cos, sin, pos, slots, q, kp, vp, num_heads=nh, num_kv_heads=nkv,
                         head_dim=d)
    qkv = F.linear(_norm(h, nw, eps, dt), wqkv, bias)
    qk = qkv[:, :(nh + nkv) * d].reshape(rows, nh + nkv, d).float()
    c, s = cos[pos][:, None].float(), sin[pos][:, None].float()
    qk = (qk * c + qk.roll(d // 2, dims=-1) * s).to(dt)
    assert _close(q, qk[:, :nh], dt)
    assert _close(kp[slots], qk[:, nh:], dt)
    assert _close(vp[slots], qkv[:, (nh + nkv) * d:].view(rows, nkv, d), dt)
    untouched = torch.ones(64, dtype=torch.bool, device=dev)
    untouched[slots] = False
    assert not kp[untouched].any() and not vp[untouched].any()

    x, wo = rnd(rows, nh * d), rnd(H, nh * d, scale=0.05)
    res = h.clone()
    skinny.linear_residual(x, wo, None, res)
    assert _close(res, (h.float() + F.linear(x, wo).float()).to(dt), dt)

    wgu, act = rnd(2 * inter, H, scale=0.05), torch.full((rows, inter), float("nan"), device=dev, dtype=dt)
    skinny.norm_gate_up_silu(h, nw, eps, wgu, act)
    gu = F.linear(_norm(h, nw, eps, dt), wgu)
    assert _close(act, F.silu(gu[:, :inter]) * gu[:, inter:], dt)

    wl, logits = rnd(1000, H, scale=0.05), torch.zeros(rows, 1000, device=dev)
    skinny.norm_linear(h, nw, eps, wl, logits)
    assert _close(logits, F.linear(_norm(h, nw, eps, dt), wl).float(), dt)


def test_skinny_refuses_too_many_rows():
    from flared.model.kernels import skinny

    x = torch.zeros(skinny.MAX_ROWS + 1, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="at most"):
        skinny.linear_residual(x, torch.zeros(64, 64, device="cuda", dtype=torch.bfloat16), None, x)
