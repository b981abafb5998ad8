"""The 8B decode step's products at 64 rows: cuBLASLt against a split-K Triton product built around the weight
stream: ``acc[BN, rows] = W_tile @ x^T`` (the weight rows on the matrix unit's M side), each output tile's K range
dealt over ``splits`` programs so the grid fills every multiprocessor whatever the product's shape; each program
streams its weight rows through a software pipeline (TMA block copies, or pointer loads) into a float32
accumulator; split, it writes its partial to a workspace and counts itself in the tile's counter, and the tile's
last program adds the partials in split order (deterministic), writes the bf16 tile and resets the counter for
the next launch (so a CUDA graph replays it as is).

Each product alone (32 layers of it, every layer its own weights, one graph), every candidate launch setting
checked against torch on fresh inputs (poisoned output, two launches), then the four products' chain with each
one's best setting against cuBLASLt's chain. For scale: a plain read of the same bytes over 128 launches takes
~3,340 us (tools/probe_read_floor.py).

    python tools/probe_splitk64.py [--rows 64] [--layers 32] [--configs quick|all] [--json]

CUDA only (TMA and wgmma: sm_90). Twenty-first session, H200: every product slower than cuBLASLt
(docs/benchmarks.md).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from products64 import (PRODUCTS, chain_gb, cublaslt_reference, graph_us, operands, print_rows,  # noqa: E402
                        probe_parser)


@triton.jit
def _splitk_kernel(x_in, w_in, Y, Work, Counts, N, K, stride_y,
                   ROWS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLITS: tl.constexpr,
                   STAGES: tl.constexpr, TMA: tl.constexpr, TILE_FAST: tl.constexpr):
    pid = tl.program_id(0)
    tiles = N // BN
    if TILE_FAST:  # neighbouring programs take neighbouring tiles of the same K share
        tile = pid % tiles
        split = pid // tiles
    else:  # neighbouring programs take the K shares of one tile
        tile = pid // SPLITS
        split = pid % SPLITS
    steps = K // BK
    k_begin = (split * steps) // SPLITS * BK
    k_end = ((split + 1) * steps) // SPLITS * BK
    offs_n = tile * BN + tl.arange(0, BN)
    offs_r = tl.arange(0, ROWS)
    acc = tl.zeros((BN, ROWS), dtype=tl.float32)
    if TMA:
        for k in tl.range(k_begin, k_end, BK, num_stages=STAGES):
            w = w_in.load([tile * BN, k])
            x = x_in.load([0, k])
            acc = tl.dot(w, tl.trans(x), acc)
    else:
        offs_k = tl.arange(0, BK)
        w_ptrs = w_in + offs_n[:, None].to(tl.int64) * K + (k_begin + offs_k)[None, :]
        x_ptrs = x_in + offs_r[None, :] * K + (k_begin + offs_k)[:, None]
        for _ in tl.range(k_begin, k_end, BK, num_stages=STAGES):
            acc = tl.dot(tl.load(w_ptrs), tl.load(x_ptrs), acc)
            w_ptrs += BK
            x_ptrs += BK
    y_ptrs = Y + offs_r[None, :] * stride_y + offs_n[:, None]
    if SPLITS == 1:
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty))
    else:
        part = offs_r[None, :] * N + offs_n[:, None]  # workspace [splits, rows, N] float32
        tl.store(Work + split * ROWS * N + part, acc)
        tl.debug_barrier()  # every thread's partial is written before the count says so
        arrived = tl.atomic_add(Counts + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            total = tl.zeros((BN, ROWS), dtype=tl.float32)
            for s in tl.static_range(SPLITS):
                total += tl.load(Work + s * ROWS * N + part, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(Y.dtype.element_ty))
            tl.atomic_xchg(Counts + tile, 0, sem="relaxed", scope="gpu")


@dataclass(frozen=True)
class ProductConfig:
    """One product's launch: ``bn`` weight rows a tile, ``bk`` columns a pipeline stage, ``splits`` programs
    per tile (each a contiguous share of K), ``stages`` in flight, ``warps`` per program, TMA copies or
    pointer loads, and whether neighbouring programs take neighbouring tiles (``tile_fast``)."""

    bn: int = 128
    bk: int = 64
    splits: int = 1
    stages: int = 4
    warps: int = 4
    tma: bool = True
    tile_fast: bool = True

    def fits(self, n: int, k: int) -> bool:
        return n % self.bn == 0 and k % self.bk == 0 and k // self.bk >= self.splits

    def __str__(self) -> str:
        return (f"bn {self.bn} bk {self.bk} splits {self.splits} stages {self.stages} warps {self.warps}"
                + ("" if self.tma else " ptr") + ("" if self.tile_fast else " split-fast"))


def _tma_descriptor(t: torch.Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block)


class SplitKProduct:
    """``y = x @ weight^T`` for ``rows`` rows of x with ``config``; owns the split workspace and tile counters
    (so one instance serves one weight at one row count, and may be captured into a CUDA graph)."""

    def __init__(self, weight: torch.Tensor, rows: int, config: ProductConfig):
        n, k = weight.shape
        if weight.dtype != torch.bfloat16 or not weight.is_cuda or not weight.is_contiguous():
            raise ValueError("SplitKProduct: a contiguous bf16 CUDA weight")
        if not config.fits(n, k) or rows not in (16, 32, 64, 128):
            raise ValueError(f"SplitKProduct: {config} does not fit [{n}, {k}] at {rows} rows")
        self.weight, self.rows, self.config = weight, rows, config
        self.n, self.k = n, k
        dev = weight.device
        split = config.splits > 1
        self.work = torch.empty((config.splits, rows, n) if split else (1,), dtype=torch.float32, device=dev)
        self.counts = torch.zeros(n // config.bn if split else 1, dtype=torch.int32, device=dev)
        self.w_in = _tma_descriptor(weight, [config.bn, config.bk]) if config.tma else weight
        self._x_key = None
        self._x_in = None

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        c = self.config
        if x.shape != (self.rows, self.k) or x.dtype != torch.bfloat16 or not x.is_contiguous():
            raise ValueError(f"SplitKProduct: x {tuple(x.shape)} {x.dtype}, expected contiguous "
                             f"[{self.rows}, {self.k}] bf16")
        if out is None:
            out = torch.empty((self.rows, self.n), dtype=torch.bfloat16, device=x.device)
        if c.tma:
            key = (x.data_ptr(), x.shape)
            if key != self._x_key:
                self._x_in, self._x_key = _tma_descriptor(x, [self.rows, c.bk]), key
            x_in = self._x_in
        else:
            x_in = x
        grid = (self.n // c.bn * c.splits,)
        _splitk_kernel[grid](x_in, self.w_in, out, self.work, self.counts, self.n, self.k, out.stride(0),
                             ROWS=self.rows, BN=c.bn, BK=c.bk, SPLITS=c.splits, STAGES=c.stages, TMA=c.tma,
                             TILE_FAST=c.tile_fast, num_warps=c.warps, num_stages=c.stages)
        return out


SMS = 132
# (bn, bk, stages, warps): 4 stages of 128 x 64 take 96 KB of shared memory (two programs a multiprocessor).
SHAPES = {"quick": [(128, 64, 4, 4), (128, 64, 6, 4), (256, 64, 3, 8), (64, 128, 4, 4)],
          "all": [(128, 64, 4, 4), (128, 64, 6, 4), (128, 128, 3, 4), (256, 64, 3, 8), (256, 64, 4, 8),
                  (64, 128, 4, 4), (64, 64, 8, 4)]}


def candidates(n: int, k: int, which: str) -> list[ProductConfig]:
    out = []
    for bn, bk, stages, warps in SHAPES[which]:
        tiles = n // bn
        splits = {max(1, round(w * SMS / tiles)) for w in (1, 2, 3)}
        for s in sorted(splits):
            c = ProductConfig(bn=bn, bk=bk, splits=s, stages=stages, warps=warps)
            if c.fits(n, k) and s <= 32:
                out.append(c)
    return out


def check(prod: SplitKProduct, m: int, k: int) -> float:
    """Relative error against torch on fresh inputs, the output poisoned first (NaN where unwritten)."""
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    out = torch.full((m, prod.n), float("nan"), device="cuda", dtype=torch.bfloat16)
    for _ in range(2):  # twice: the counters must come back to zero after a launch
        prod(x, out)
        ref = torch.nn.functional.linear(x.float(), prod.weight.float())
        err = ((out.float() - ref).norm() / ref.norm()).item()
        if not err < 2e-2:
            return float("nan")
    return err


def main(argv=None) -> int:
    ap = probe_parser(rows=True)
    ap.add_argument("--configs", choices=sorted(SHAPES), default="quick")
    args = ap.parse_args(argv)
    m, L = args.rows, args.layers
    torch.backends.cuda.preferred_blas_library("cublaslt")
    w, x, y = operands(m, L)
    out: dict = {"rows": m, "layers": L}
    rows, best, ok = [], {}, True
    def timed_config(p: str, cfg: ProductConfig):
        """(us a layer, relative error) of product ``p`` with ``cfg``; None where refused or wrong."""
        nonlocal ok
        try:
            prods = [SplitKProduct(w[p][i], m, cfg) for i in range(L)]
            err = check(prods[0], m, PRODUCTS[p][1])
            if err != err:
                print(f"{p} {cfg}: WRONG", file=sys.stderr)
                ok = False
                return None
            return graph_us(lambda: [f(x[p], y[p]) for f in prods]) / L, err
        except Exception as e:  # a setting the compiler or the hardware refuses
            print(f"{p} {cfg}: {type(e).__name__}: {str(e)[:160]}", file=sys.stderr)
            return None

    for p, (n, k) in PRODUCTS.items():
        mb, _, lt, row = cublaslt_reference(x, w, y, p)
        rows.append(row)
        timed = {}
        for cfg in candidates(n, k, args.configs):
            if (r := timed_config(p, cfg)) is not None:
                timed[cfg] = r
        if not timed:
            continue
        top = sorted(timed, key=lambda c: timed[c][0])
        # the best setting's neighbours: pointer loads, and the other program order
        for cfg in top[:3] + [replace(top[0], tma=False), replace(top[0], tile_fast=False)]:
            if cfg not in timed and (r := timed_config(p, cfg)) is not None:
                timed[cfg] = r
            if cfg in timed:
                us, err = timed[cfg]
                rows.append((p, "split-K", us, mb / us, f"{cfg} (err {err:.1e})"))
        best[p] = min(timed, key=lambda c: timed[c][0])
        out[p] = {"cublaslt": round(lt, 2), **{str(c): round(us, 2) for c, (us, _) in timed.items()}}

    gb = chain_gb(L)
    if len(best) == len(PRODUCTS):
        prods = {p: [SplitKProduct(w[p][i], m, best[p]) for i in range(L)] for p in PRODUCTS}
        lt_us = {p: out[p]["cublaslt"] for p in PRODUCTS}
        sk_us = {p: min(us for key, us in out[p].items() if key != "cublaslt") for p in PRODUCTS}

        def chain(use):  # use: product -> True for split-K
            def fn():
                for i in range(L):
                    for p in PRODUCTS:
                        if use[p]:
                            prods[p][i](x[p], y[p])
                        else:
                            torch.nn.functional.linear(x[p], w[p][i], out=y[p])
            return fn

        plans = {"cuBLASLt": {p: False for p in PRODUCTS}, "split-K": {p: True for p in PRODUCTS},
                 "faster of the two": {p: sk_us[p] < lt_us[p] for p in PRODUCTS}}
        plans["cuBLASLt (again)"] = plans["cuBLASLt"]
        plans["split-K (again)"] = plans["split-K"]
        for name, plan in plans.items():
            us = graph_us(chain(plan), replays=5)
            rows.append(("chain", name, us, gb / us * 1e3, f"{gb:.2f} GB"))
            out[f"chain {name}"] = round(us, 1)
        out["best"] = {p: str(c) for p, c in best.items()}
    print_rows(rows, what="kernel", width=8)
    if not ok:
        print("a split-K setting disagreed with torch")
    if args.json:
        print(json.dumps(out))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
