"""The 8B decode step's products at 64 rows: cuBLASLt against a Triton GEMM launched with programmatic
dependent launch (PDL) that loads the head of its weight tile before it waits on the previous kernel.

A 64-row step is ~130 dependent products; each starts with nothing of its weights on the chip and ends with
idle multiprocessors, so the small ones stream at ~3 TB/s (tools/probe_gemm64.py). Weights never depend on
the previous kernel. Here each product's program computes y^T = W x^T for its BN weight rows, and with PDL:

1. loads the first PRE columns of its weight rows into registers (before any dependency);
2. ``griddepcontrol.wait`` (the previous kernel done and flushed), then the matching x columns;
3. streams the rest of K through the pipelined loop;
4. ``griddepcontrol.launch_dependents`` after its loop (``trigger end``) or at its start (``trigger start``), so
   the next product's programs take the multiprocessors this one frees and load their weights meanwhile.

Every product of every layer has its own random weights (nothing stays in L2 between layers), each chain
of 32 layers x 4 products is captured into one graph and replayed; the LM head is left out.

    python tools/probe_pdl_gemm64.py [--rows 64] [--layers 32] [--json]

CUDA only (sm_90 for PDL); a probe for deciding whether to write the 64-row step's products ourselves.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from products64 import PRODUCTS, chain_gb, cublaslt_reference, graph_us, operands, print_rows, probe_parser  # noqa: E402

CONFIGS = {  # (BN, BK, stages, warps)
    "qkv": [(64, 128, 4, 4), (32, 128, 4, 4), (64, 256, 3, 4), (32, 256, 3, 4)],
    "o": [(32, 128, 4, 4), (32, 256, 3, 4), (64, 128, 4, 4), (16, 256, 4, 4)],
    "gate_up": [(64, 128, 4, 4), (128, 128, 4, 8), (64, 256, 3, 4), (128, 64, 6, 4)],
    "down": [(32, 128, 4, 4), (32, 256, 3, 4), (64, 128, 4, 4), (16, 256, 4, 4)],
}


@triton.jit
def _mm(x_ptr, w_ptr, y_ptr, K, stride_xm, stride_wn, stride_ym,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRE: tl.constexpr, PDL: tl.constexpr,
        TRIGGER_START: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    if PRE > 0:
        offs_p = tl.arange(0, PRE)
        w_pre = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_p[None, :])
    if PDL:
        if TRIGGER_START:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if PRE > 0:
        acc = tl.dot(w_pre, tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_p[:, None]), acc)
    offs_k = PRE + tl.arange(0, BK)
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]
    for _ in range(PRE, K, BK):
        acc = tl.dot(tl.load(w_ptrs), tl.load(x_ptrs), acc)
        w_ptrs += BK
        x_ptrs += BK
    if PDL:
        if not TRIGGER_START:
            tl.extra.cuda.gdc_launch_dependents()
    tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty))


def mm(x, w, y, cfg, pre=0, pdl=False, trigger_start=False):
    bn, bk, stages, warps = cfg
    n, k = w.shape
    extra = {"launch_pdl": True} if pdl else {}
    _mm[(n // bn,)](x, w, y, k, x.stride(0), w.stride(0), y.stride(0), BM=x.shape[0], BN=bn, BK=bk, PRE=pre,
                    PDL=pdl, TRIGGER_START=trigger_start, num_stages=stages, num_warps=warps, **extra)


def main(argv=None) -> int:
    ap = probe_parser(rows=True)
    args = ap.parse_args(argv)
    m, L = args.rows, args.layers
    torch.backends.cuda.preferred_blas_library("cublaslt")
    w, x, y = operands(m, L)
    out = {"rows": m, "layers": L}
    rows = []

    def chain_fn(plan):  # plan: product -> None (cuBLASLt) or (cfg, pre, pdl, trigger_start)
        def fn():
            for i in range(L):
                for p in PRODUCTS:
                    if plan[p] is None:
                        torch.nn.functional.linear(x[p], w[p][i], out=y[p])
                    else:
                        cfg, pre, pdl, start = plan[p]
                        mm(x[p], w[p][i], y[p], cfg, pre, pdl, start)
        return fn

    # Each product alone (32 layers of it), every config without PDL, then the best with PDL.
    best = {}
    for p, (n, k) in PRODUCTS.items():
        mb, ref, lt, row = cublaslt_reference(x, w, y, p)
        rows.append(row)
        timed = {}
        for cfg in CONFIGS[p]:
            for pre, pdl, start in ((0, False, False), (0, True, False), (2 * cfg[1], True, False),
                                    (2 * cfg[1], True, True)):
                if n % cfg[0] or (k - pre) % cfg[1]:
                    continue
                try:
                    mm(x[p], w[p][0], y[p], cfg, pre, pdl, start)
                    torch.cuda.synchronize()
                    err = (y[p].float() - ref).abs().max().item() / ref.abs().max().item()
                    if err > 2e-2:
                        print(f"{p} {cfg} pre {pre}: wrong (rel err {err:.3g})", file=sys.stderr)
                        continue
                    us = graph_us(lambda p=p, cfg=cfg, pre=pre, pdl=pdl, start=start:
                                  [mm(x[p], w[p][i], y[p], cfg, pre, pdl, start) for i in range(L)]) / L
                    timed[(cfg, pre, pdl, start)] = us
                except Exception as e:  # a config the compiler refuses, or no PDL in this Triton
                    print(f"{p} {cfg} pre {pre} pdl {pdl}: {type(e).__name__}: {str(e)[:100]}", file=sys.stderr)
        for label, keep in (("triton", lambda key: not key[2]), ("triton pdl", lambda key: key[2])):
            cand = {key: us for key, us in timed.items() if keep(key)}
            if cand:
                key = min(cand, key=cand.get)
                best[(p, label)] = key
                cfg, pre, pdl, start = key
                rows.append((p, label, cand[key], mb / cand[key],
                             f"{cfg} pre {pre}" + (" trigger start" if start else "")))
        top = sorted(timed.items(), key=lambda kv: kv[1])[:4]
        print(p, "top:", [(key, round(us, 2)) for key, us in top], file=sys.stderr)
        out[p] = {"cublaslt": round(lt, 2), **{f"{c} pre{pr} pdl{int(d)} start{int(s)}": round(us, 2)
                                                for (c, pr, d, s), us in timed.items()}}

    gb = chain_gb(L)
    plans = {"cuBLASLt": {p: None for p in PRODUCTS}}
    if all((p, "triton") in best for p in PRODUCTS):
        plans["triton"] = {p: best[(p, "triton")] for p in PRODUCTS}
    if all((p, "triton pdl") in best for p in PRODUCTS):
        plans["triton pdl"] = {p: best[(p, "triton pdl")] for p in PRODUCTS}
        plans["triton pdl, pre 0"] = {p: (best[(p, "triton pdl")][0], 0, True, False) for p in PRODUCTS}
        # the faster of the two per product (small ones may win with PDL, gate_up with cuBLASLt)
        pdl_us = {q: us for (q, lab, us, _, _) in rows if lab == "triton pdl"}
        plans["mixed"] = {p: best[(p, "triton pdl")] if pdl_us[p] < out[p]["cublaslt"] else None for p in PRODUCTS}
    plans["cuBLASLt (again)"] = plans["cuBLASLt"]
    for name, plan in plans.items():
        us = graph_us(chain_fn(plan), replays=5)
        rows.append(("chain", name, us, gb / us * 1e3, f"{gb:.2f} GB"))
        out[f"chain {name}"] = round(us, 1)

    print_rows(rows, width=18)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
