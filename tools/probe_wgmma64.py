"""The 8B decode step's products at 64 rows: cuBLASLt against flared's Hopper product kernel
(flared/model/kernels/products64.cu: one tile of weight rows per multiprocessor, TMA copies into a ring of
shared-memory stages, wgmma; gate_up optionally with the SwiGLU epilogue, against cuBLASLt plus the SiLU-mul
kernel; weights in place or laid out tile by tile).

Every build is first checked against torch on layer 0 in a child process (a build that hangs is cut off there
and left out), then each product is timed over 32 layers of distinct weights in one graph, and the four
products' chain with each product's fastest build against cuBLASLt's.

    python tools/probe_wgmma64.py [--layers 32] [--builds quick|all] [--json]

CUDA sm_90 only. Twenty-third session: the builds that led to the decoder's (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from products64 import (PRODUCTS, chain_gb, cublaslt_reference, graph_us, operands, print_rows,  # noqa: E402
                        probe_parser)

from flared.model.kernels import products64 as k64  # noqa: E402
from flared.model.kernels.fused import silu_mul  # noqa: E402

def builds(p: str, which: str) -> list[k64.Build]:
    """128 blocks for each product, tiles of 1/128 of its weight rows, 1-4 boxes a stage and the most stages that
    fit, 2 accumulators where the tile is small; weights in place or laid out tile by tile; gate_up with and
    without its SwiGLU epilogue (which reads its weights in place)."""
    n, k = PRODUCTS[p]
    bn = n // 128
    out = []
    for atoms in ((1, 2) if p == "gate_up" else (2, 4)):
        stages = min(16, (k64.SHARED_LIMIT - 1024) // k64.Build.stage_bytes(bn, atoms))
        nacc = 2 if bn <= 96 else 1
        for wtiled in (0, 1):
            for epi in ((1, 0) if p == "gate_up" and not wtiled else (0,)):
                out.append(k64.Build(bn, stages, atoms, nacc, epi=epi, wtiled=wtiled))
    return out if which == "all" else out[:1]


def name(b: k64.Build) -> str:
    return f"{b.bn}/{b.stages}x{b.atoms}/a{b.nacc}" + ("/swiglu" if b.epi else "") + ("/tiled" if b.wtiled else "")


def parse(s: str) -> k64.Build:
    parts = s.split("/")
    stages, atoms = parts[1].split("x")
    return k64.Build(int(parts[0]), int(stages), int(atoms), int(parts[2][1:]), epi=int("swiglu" in parts),
                     wtiled=int("tiled" in parts))


def check(p: str, b: k64.Build, w: dict, x: dict) -> float:
    """Relative error of layer 0 against torch (SiLU-mul of torch's gate_up for the SwiGLU epilogue), two
    launches into a poisoned output; nan where wrong."""
    n, k = PRODUCTS[p]
    prod = k64.Products64(n, k, b)
    ref = torch.nn.functional.linear(x[p], w[p][0])
    if b.epi:
        act = torch.empty(ref.shape[0], n // 2, device="cuda", dtype=ref.dtype)
        silu_mul(ref, act)
        ref = act
    ref = ref.float()
    wm = prod.weight_map(w[p][0])
    xm = prod.input_map(x[p])
    err = 0.0
    for _ in range(2):
        out = torch.full((x[p].shape[0], prod.out_cols), float("nan"), device="cuda", dtype=torch.bfloat16)
        prod(wm, xm, out)
        torch.cuda.synchronize()
        err = max(err, ((out.float() - ref).abs().max() / ref.abs().max()).item())
    if not err < 2e-2:
        print(f"WRONG {p}:{name(b)} error {err:.3e}; output {out.float()[:2, :8].tolist()}; "
              f"torch {ref[:2, :8].tolist()}", flush=True)
        return float("nan")
    return err


def child(args) -> int:
    """Check each named build in turn, printing 'OK name err' or 'BAD name ...' as it goes."""
    w, x, _ = operands(64, 1)
    for spec in args.child.split(","):
        p, bname = spec.split(":")
        print(f"START {spec}", flush=True)
        try:
            err = check(p, parse(bname), w, x)
            print(f"{'OK' if err == err else 'BAD'} {spec} {err:.2e}", flush=True)
        except Exception as e:  # a build the compiler or the hardware refuses; the context may be lost
            print(f"BAD {spec} {type(e).__name__}: {str(e)[:600]}", flush=True)
            return 1
    return 0


def checked(specs: list[str], timeout: float = 150.0) -> dict[str, float]:
    """spec -> error of the builds that passed, in child processes; a hung build is cut off and skipped."""
    good: dict[str, float] = {}
    left = list(specs)
    while left:
        proc = subprocess.Popen([sys.executable, __file__, "--child", ",".join(left)], stdout=subprocess.PIPE,
                                text=True)
        started, done = None, set()
        t0 = time.time()
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        for line in out.splitlines():
            word, _, rest = line.partition(" ")
            spec = rest.split(" ")[0]
            if word == "WRONG":
                print(line, file=sys.stderr)
            if word == "START":
                started = spec
            elif word in ("OK", "BAD"):
                done.add(spec)
                print(line, file=sys.stderr)
                if word == "OK":
                    good[spec] = float(rest.split(" ")[1])
        if started is not None and started not in done:
            print(f"HUNG {started} (cut off after {time.time() - t0:.0f} s)", file=sys.stderr)
            done.add(started)
        if not done:
            break
        left = [s for s in left if s not in done]
    return good


def main(argv=None) -> int:
    ap = probe_parser()
    ap.add_argument("--builds", choices=("quick", "all"), default="all")
    ap.add_argument("--child", default="")
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    torch.backends.cuda.preferred_blas_library("cublaslt")
    specs = [f"{p}:{name(b)}" for p in PRODUCTS for b in builds(p, args.builds)]
    good = checked(specs)
    L = args.layers
    w, x, y = operands(64, L)
    rows, out, best = [], {"layers": L}, {}
    for p, (n, k) in PRODUCTS.items():
        mb, _, lt, row = cublaslt_reference(x, w, y, p)
        rows.append(row)
        out[p] = {"cublaslt": round(lt, 2)}
        if p == "gate_up":
            act = torch.empty(64, n // 2, device="cuda", dtype=torch.bfloat16)

            def lt_silu():
                for i in range(L):
                    torch.nn.functional.linear(x[p], w[p][i], out=y[p])
                    silu_mul(y[p], act)
            lts = graph_us(lt_silu) / L
            rows.append((p, "cuBLASLt+silu", lts, mb / lts, ""))
            out[p]["cublaslt+silu"] = round(lts, 2)
        for spec, err in good.items():
            if not spec.startswith(p + ":"):
                continue
            b = parse(spec.split(":")[1])
            prod = k64.Products64(n, k, b)
            maps = [prod.weight_map(t) for t in w[p]]
            xm = prod.input_map(x[p])
            dst = act if b.epi else y[p]
            us = graph_us(lambda: [prod(m, xm, dst) for m in maps]) / L
            rows.append((p, name(b), us, mb / us, f"err {err:.1e}"))
            out[p][name(b)] = round(us, 2)
            key = p + ("+silu" if b.epi else "")
            if key not in best or us < best[key][1]:
                best[key] = (b, us)
    out["best"] = {key: [name(b), round(us, 2)] for key, (b, us) in best.items()}

    gb = chain_gb(L)
    if all(p in best for p in PRODUCTS):
        prods, maps, xms = {}, {}, {}
        act = torch.empty(64, PRODUCTS["gate_up"][0] // 2, device="cuda", dtype=torch.bfloat16)
        keys = {p: p for p in PRODUCTS}
        if "gate_up+silu" in best:
            keys["gate_up"] = "gate_up+silu"
        for p, key in keys.items():
            b = best[key][0]
            prods[p] = k64.Products64(*PRODUCTS[p], b)
            maps[p] = [prods[p].weight_map(t) for t in w[p]]
            xms[p] = prods[p].input_map(x[p])

        def lt_chain():
            for i in range(L):
                for p in PRODUCTS:
                    torch.nn.functional.linear(x[p], w[p][i], out=y[p])
                    if p == "gate_up":
                        silu_mul(y[p], act)

        def our_chain():
            for i in range(L):
                for p in PRODUCTS:
                    if prods[p].build.epi:
                        prods[p](maps[p][i], xms[p], act)
                    else:
                        prods[p](maps[p][i], xms[p], y[p])
                        if p == "gate_up":
                            silu_mul(y[p], act)

        for label, fn in (("cuBLASLt", lt_chain), ("products64", our_chain), ("cuBLASLt (again)", lt_chain),
                          ("products64 (again)", our_chain)):
            us = graph_us(fn, replays=5)
            rows.append(("chain", label, us, gb / us * 1e3, f"{gb:.2f} GB, with SiLU-mul"))
            out[f"chain {label}"] = round(us, 1)
    print_rows(rows, what="build", width=18)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
