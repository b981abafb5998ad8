"""Decode attention at a large batch, as a step pays it: the separate rotary/KV-write kernel plus attention
against the fused kernel (paged_decode_attention_rope), the fused kernel's tile and warp choices, and the
same pool laid out head-major ([kv head, slot, d]: a program's keys of a page contiguous; the kernels take
the pool's strides, so only the layout changes); and the CUDA kernel (kernels/decode_attention.cu) in each of its
tuning builds, with its largest output difference from the Triton kernel; and the Triton kernels over float8
pools (kv_cache_dtype fp8; ``--fp8-grid``: their tile and warp choices).

Every layer gets its own KV pool region (as a step walks 32 layers' pools, nothing stays in L2), pages
scattered; every row at the same context. Each variant is captured for all layers into one graph.

    python tools/probe_decode_attention.py [--rows 64] [--context 256] [--quick] [--fp8-grid] [--json]

CUDA only; Llama-3.1-8B's attention shape (32 q heads, 8 kv heads, head dim 128), bf16.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def attention_operands(rows: int, context: int, layers: int, device: str = "cuda") -> SimpleNamespace:
    """Seeded operands of Llama-3.1-8B's decode attention (32 q heads, 8 kv heads, head dim 128, pages of 16
    tokens, bf16) for ``rows`` rows at ``context`` tokens: every layer's own K/V pool with the pages scattered,
    the rows' block tables, lengths, positions and new keys' slots, fused QKV rows and rotary tables."""
    nh, nkv, d, page, dt = 32, 8, 128, 16, torch.bfloat16
    pages_per_row = -(-(context + 1) // page)
    num_pages = rows * pages_per_row
    torch.manual_seed(0)
    k_pool = torch.randn(layers, (num_pages + 1) * page, nkv, d, device=device, dtype=dt)
    v_pool = torch.randn_like(k_pool)
    tables = torch.randperm(num_pages, device=device).view(rows, pages_per_row).to(torch.int32)
    lens = torch.full((rows,), context, dtype=torch.int32, device=device)
    positions = lens.long() - 1
    slots = tables.long()[torch.arange(rows, device=device), positions // page] * page + positions % page
    qkv = torch.randn(rows, (nh + 2 * nkv) * d, device=device, dtype=dt)
    cos = torch.randn(context + 1, d, device=device, dtype=dt)
    sin = torch.randn(context + 1, d, device=device, dtype=dt)
    return SimpleNamespace(nh=nh, nkv=nkv, d=d, page=page, dt=dt, num_pages=num_pages, k_pool=k_pool, v_pool=v_pool,
                           tables=tables, lens=lens, positions=positions, slots=slots, qkv=qkv, cos=cos, sin=sin)


def graph_us(fn, replays=10) -> float:
    from flared.execution.graphs import time_graph_us

    return time_graph_us(fn, torch.cuda.Stream(), replays=replays)


def main(argv=None) -> int:
    from flared.model.kernels.fused import rope_write_kv
    from flared.model.triton_attention import paged_decode_attention, paged_decode_attention_rope

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="leave out the tile/warp/stage grid")
    ap.add_argument("--fp8-grid", action="store_true", help="the fused kernel's tile and warp grid on float8 pools")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    B, ctx, L = args.rows, args.context, args.layers
    o = attention_operands(B, ctx, L)
    nh, nkv, d, P, dt, num_pages = o.nh, o.nkv, o.d, o.page, o.dt, o.num_pages
    k_pool, v_pool, tables, lens, positions, slots = o.k_pool, o.v_pool, o.tables, o.lens, o.positions, o.slots
    qkv, cos, sin = o.qkv, o.cos, o.sin
    q = torch.empty(B, nh, d, device="cuda", dtype=dt)
    out = torch.empty_like(q)
    kv_mb = B * ctx * nkv * d * 2 * 2 / 1e6
    scale = d ** -0.5

    def separate():
        for i in range(L):
            rope_write_kv(qkv, cos, sin, positions, slots, q, k_pool[i], v_pool[i], num_heads=nh, num_kv_heads=nkv,
                          head_dim=d)
            paged_decode_attention(q, k_pool[i], v_pool[i], out, tables, lens, page_tokens=P, scale=scale)

    def attention_only():
        for i in range(L):
            paged_decode_attention(q, k_pool[i], v_pool[i], out, tables, lens, page_tokens=P, scale=scale)

    # The same pool head-major ([kv head, slot, d] per layer): a program's keys of one page lie together.
    k_hm = torch.randn(L, nkv, (num_pages + 1) * P, d, device="cuda", dtype=dt).permute(0, 2, 1, 3)
    v_hm = torch.randn_like(k_hm)

    def fused(pools=(k_pool, v_pool), **kw):
        kp, vp = pools

        def fn():
            for i in range(L):
                paged_decode_attention_rope(qkv, cos, sin, positions, slots, kp[i], vp[i], out, tables, lens,
                                            num_heads=nh, page_tokens=P, scale=scale, **kw)
        return fn

    variants = [("rope_write_kv + attention (main before)", separate), ("attention alone", attention_only),
                ("fused, defaults (64 keys, 4 warps)", fused()),
                ("fused, head-major pool", fused(pools=(k_hm, v_hm))),
                ("fused, head-major pool, 2 warps, 4 stages", fused(pools=(k_hm, v_hm), num_warps=2, num_stages=4))]
    # The context split over 2 or 4 programs per (row, kv head), merged by the combine kernel.
    part_acc = torch.empty(B * nh * 4 * d, device="cuda", dtype=torch.float32)
    part_m = torch.empty(B * nh * 4, device="cuda", dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    for splits in (2, 4):
        variants.append((f"fused, split {splits} + combine", fused(num_splits=splits, part_acc=part_acc, part_m=part_m,
                                                                  part_l=part_l)))
    # The CUDA kernel (kernels/decode_attention.cu) in each tuning build, and its largest difference from the
    # Triton kernel's output on the same operands (layer 0).
    from flared.model.kernels import decode_attention as cuda_attention

    def cuda(build):
        def fn():
            for i in range(L):
                cuda_attention.decode_attention_rope(qkv, cos, sin, positions, slots, k_pool[i], v_pool[i], out, tables,
                                                     lens, num_heads=nh, page_tokens=P, scale=scale, build=build)
        return fn

    diffs = {}
    if cuda_attention.available():
        ref = torch.empty_like(out)
        paged_decode_attention_rope(qkv, cos, sin, positions, slots, k_pool[0], v_pool[0], ref, tables, lens,
                                    num_heads=nh, page_tokens=P, scale=scale)
        default = cuda_attention.default_build(nh // nkv, d, P)
        for prefetch, blocks in ((1, 2), (1, 3), (0, 3), (0, 4), (1, 1)):
            build = cuda_attention.Build(nh // nkv, d, P, prefetch=prefetch, blocks_per_sm=blocks)
            name = f"CUDA, prefetch {prefetch}, {blocks} blocks/SM" + (" (default)" * (build == default))
            mine = torch.empty_like(out)
            cuda_attention.decode_attention_rope(qkv, cos, sin, positions, slots, k_pool[0], v_pool[0], mine,
                                                 tables, lens, num_heads=nh, page_tokens=P, scale=scale, build=build)
            diffs[name] = float((mine.float() - ref.float()).abs().max())
            variants.append((name, cuda(build)))
    # The same operands in float8 pools (kv_cache_dtype fp8): half the bytes, widened in the kernel.
    k8, v8 = k_pool.to(torch.float8_e4m3fn), v_pool.to(torch.float8_e4m3fn)

    def attention_only_fp8():
        for i in range(L):
            paged_decode_attention(q, k8[i], v8[i], out, tables, lens, page_tokens=P, scale=scale)

    variants += [("float8 pool: attention alone", attention_only_fp8),
                 ("float8 pool: fused, defaults", fused(pools=(k8, v8)))]
    if args.fp8_grid:
        for bn in (32, 64, 128):
            for warps in (2, 4, 8):
                variants.append((f"float8 pool: fused, {bn} keys, {warps} warps",
                                 fused(pools=(k8, v8), block_n=bn, num_warps=warps)))
    for bn in () if args.quick else (32, 64, 128):
        for warps in (2, 4, 8):
            for stages in (2, 3, 4):
                variants.append((f"fused, {bn} keys, {warps} warps, {stages} stages",
                                 fused(block_n=bn, num_warps=warps, num_stages=stages)))
    res = {}
    for name, fn in variants:
        try:
            res[name] = graph_us(fn) / L
        except Exception as e:  # a configuration the compiler refuses
            print(f"{name}: {type(e).__name__}: {str(e)[:80]}", file=sys.stderr)
    base = res[variants[0][0]]
    print(f"{B} rows, context {ctx}, {kv_mb:.1f} MB of K/V per layer")
    print(f"{'variant':52} {'us/layer':>9} {'TB/s':>6} {'vs before':>9} {'max |diff| vs Triton':>20}")
    for name, us in sorted(res.items(), key=lambda kv: kv[1]):
        diff = f"{diffs[name]:20.4f}" if name in diffs else ""
        mb = kv_mb / 2 if name.startswith("float8") else kv_mb  # a float8 pool holds one byte a value
        print(f"{name:52} {us:9.2f} {mb / us:6.2f} {us - base:+9.2f} {diff}")
    if args.json:
        print(json.dumps({"rows": B, "context": ctx, "us_per_layer": res, "max_abs_diff_vs_triton": diffs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
