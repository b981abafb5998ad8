"""The 8B decode step's products at 64 rows: cuBLAS, cuBLASLt and a Triton skinny GEMM, as a step pays them.

Every product of every layer gets its own random bf16 weights (15 GB for the Llama-3.1-8B shape, as a real
step streams them: nothing stays in L2 between layers). Each product is captured for all 32 layers into one
graph and replayed; microseconds per layer and the weight bytes' rate are printed per backend. The Triton
kernel computes y^T = W x^T (the weight rows fill the MMA's 64-row side, the batch rows the other), with
split-K through float32 atomics where one wave of output tiles would leave multiprocessors idle; its
configurations are tried per product and the fastest is kept. Last, the whole chain (32 layers x 4 products
+ the LM head) is captured once per backend.

    python tools/probe_gemm64.py [--rows 64] [--layers 32] [--json]

CUDA only; a probe for deciding whether batched-decode products are worth writing ourselves.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from products64 import H, PRODUCTS, V, chain_gb, graph_us, operands, print_rows, probe_parser  # noqa: E402
CONFIGS = [  # (BN, BK, stages, warps)
    (64, 128, 4, 4), (64, 128, 6, 4), (64, 256, 3, 4), (64, 256, 4, 4),
    (128, 128, 4, 4), (128, 128, 4, 8), (128, 64, 6, 4), (32, 256, 4, 4),
]
SPLITS = (1, 2, 4, 8)


@triton.jit
def _skinny_mm(x_ptr, w_ptr, y_ptr, K, k_per, stride_xm, stride_wn, stride_ym,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ATOMIC: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    offs_k = pid_k * k_per + tl.arange(0, BK)
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for _ in range(0, k_per, BK):
        acc = tl.dot(tl.load(w_ptrs), tl.load(x_ptrs), acc)
        w_ptrs += BK
        x_ptrs += BK
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    if ATOMIC:
        tl.atomic_add(y_ptrs, acc, sem="relaxed")
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty))


def triton_mm(x, w, y, cfg, split):
    bn, bk, stages, warps = cfg
    n, k = w.shape
    k_per = k // split
    if split > 1:
        y.zero_()
    _skinny_mm[(n // bn, split)](x, w, y, k, k_per, x.stride(0), w.stride(0), y.stride(0), BM=x.shape[0], BN=bn,
                                 BK=bk, ATOMIC=split > 1, num_stages=stages, num_warps=warps)


class Lt:
    def __enter__(self):
        self.prev = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")

    def __exit__(self, *exc):
        torch.backends.cuda.preferred_blas_library(self.prev)


def main(argv=None) -> int:
    ap = probe_parser(rows=True)
    args = ap.parse_args(argv)
    m, L, dev, dt = args.rows, args.layers, "cuda", torch.bfloat16
    w, x, y = operands(m, L, dt)
    lm = (0.02 * torch.randn(V, H, device=dev)).to(dt)
    y32 = {p: torch.empty(m, n, device=dev, dtype=torch.float32) for p, (n, k) in PRODUCTS.items()}
    out = {"rows": m, "layers": L}
    table = []
    best = {}
    for p, (n, k) in PRODUCTS.items():
        mb = n * k * 2 / 1e6
        ref = torch.nn.functional.linear(x[p], w[p][0]).float()

        def run_blas(p=p):
            for i in range(L):
                torch.nn.functional.linear(x[p], w[p][i], out=y[p])

        def run_lt(p=p):
            with Lt():
                run_blas(p)

        res = {"cublas": graph_us(run_blas) / L, "cublaslt": graph_us(run_lt) / L}
        tri = {}
        for cfg in CONFIGS:
            for split in SPLITS:
                if k % (split * cfg[1]) or n % cfg[0] or (n // cfg[0]) * split > 4 * 132:
                    continue
                dst = y32[p] if split > 1 else y[p]
                try:
                    triton_mm(x[p], w[p][0], dst, cfg, split)
                    torch.cuda.synchronize()
                    err = (dst.float() - ref).abs().max().item() / ref.abs().max().item()
                    if err > 2e-2:
                        print(f"{p} {cfg} split {split}: wrong (rel err {err:.3g})", file=sys.stderr)
                        continue

                    def run_tri(p=p, cfg=cfg, split=split, dst=dst):
                        for i in range(L):
                            triton_mm(x[p], w[p][i], dst, cfg, split)

                    tri[(cfg, split)] = graph_us(run_tri) / L
                except Exception as e:  # out of shared memory and the like: the config does not exist here
                    print(f"{p} {cfg} split {split}: {type(e).__name__}: {str(e)[:80]}", file=sys.stderr)
        if tri:
            bk = min(tri, key=tri.get)
            best[p] = bk
            res["triton"] = tri[bk]
            top = sorted(tri.items(), key=lambda kv: kv[1])[:3]
            print(p, "triton top:", [(c, s, round(t, 1)) for (c, s), t in top], file=sys.stderr)
        for name, us in res.items():
            table.append((p, name, us, mb / us, "" if name != "triton" else f"{best[p][0]} split {best[p][1]}"))
        out[p] = {kk: round(vv, 2) for kk, vv in res.items()}
        out[p]["triton_config"] = list(best[p][0]) + [best[p][1]] if p in best else None

    xl = torch.randn(m, H, device=dev).to(dt)
    yl = torch.empty(m, V, device=dev, dtype=dt)

    def chain(kind):
        def fn():
            for i in range(L):
                for p in PRODUCTS:
                    if kind == "triton" and p in best:
                        cfg, split = best[p]
                        triton_mm(x[p], w[p][i], y32[p] if split > 1 else y[p], cfg, split)
                    else:
                        torch.nn.functional.linear(x[p], w[p][i], out=y[p])
            torch.nn.functional.linear(xl, lm, out=yl)

        if kind == "cublaslt":
            def lt_fn():
                with Lt():
                    fn()
            return lt_fn
        return fn

    gb = chain_gb(L, head=True)
    for kind in ("cublas", "cublaslt", "triton"):
        us = graph_us(chain(kind), replays=5)
        table.append(("chain", kind, us, gb / us * 1e3, f"{gb:.1f} GB"))
        out[f"chain_{kind}_us"] = round(us, 1)

    print_rows(table)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
