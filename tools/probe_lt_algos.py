"""The 8B decode step's products at 64 rows: every algorithm cuBLASLt's heuristic offers, timed as a step pays
them, against what torch picks.

torch asks cuBLASLt's heuristic for one algorithm per shape, under torch's workspace limit. The heuristic
ranks by a model, not by a run, and a 64-row product is a corner of its range (the small ones stream at
~3 TB/s, tools/probe_gemm64.py). Here cuBLASLt is called directly (ctypes, the library torch loaded) for
y = x W^T with bf16 data and float32 accumulation, as torch calls it; for each product shape and each
workspace limit the heuristic's candidates (up to 32) are checked against torch's result and timed over 32
layers of distinct weights in one graph. Last, the whole chain with each product's fastest candidate.

    python tools/probe_lt_algos.py [--rows 64] [--layers 32] [--json]

CUDA only; a probe for deciding whether the decode step should pick its cuBLASLt algorithms by timing.
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from products64 import PRODUCTS, chain_gb, graph_us, operands, print_rows, probe_parser, torch_layer_us  # noqa: E402

R_32F, R_16BF, COMPUTE_32F = 0, 14, 68
OP_N, OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB = 3, 4
PREF_MAX_WORKSPACE = 1
CFG = {"id": (0, 4), "tile": (1, 4), "splitk": (2, 4), "reduction": (3, 4), "swizzle": (4, 4), "custom": (5, 4),
       "stages": (6, 4), "cluster": (8, 2)}  # attribute, bytes


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int), ("waves", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


def load_lt():
    """The cuBLASLt library torch uses (loaded by a cuBLASLt product first)."""
    torch.nn.functional.linear(torch.zeros(64, 64, device="cuda", dtype=torch.bfloat16),
                               torch.zeros(64, 64, device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()
    with open("/proc/self/maps") as f:
        paths = sorted({line.split()[-1] for line in f if "libcublasLt" in line})
    if not paths:
        raise RuntimeError("libcublasLt is not loaded")
    return ctypes.CDLL(paths[0])


class LtProduct:
    """y[m, n] = x[m, k] W[n, k]^T through cublasLtMatmul with a chosen algorithm."""

    def __init__(self, lib, handle, m, n, k):
        self.lib, self.handle = lib, handle
        self.desc = ctypes.c_void_p()
        self._ok(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, R_32F), "desc")
        for attr, val in ((DESC_TRANSA, OP_T), (DESC_TRANSB, OP_N)):
            v = ctypes.c_int32(val)
            self._ok(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), ctypes.c_size_t(4)), "trans")
        self.a, self.b, self.c = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        # column-major views: W^T is [k, n] with ld k, x^T [k, m] ld k, y^T [n, m] ld n
        self._ok(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.a), R_16BF, ctypes.c_uint64(k), ctypes.c_uint64(n),
                                                ctypes.c_int64(k)), "A")
        self._ok(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.b), R_16BF, ctypes.c_uint64(k), ctypes.c_uint64(m),
                                                ctypes.c_int64(k)), "B")
        self._ok(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.c), R_16BF, ctypes.c_uint64(n), ctypes.c_uint64(m),
                                                ctypes.c_int64(n)), "C")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _ok(status, what):
        if status != 0:
            raise RuntimeError(f"cuBLASLt {what}: status {status}")

    def candidates(self, workspace_bytes, count=32):
        pref = ctypes.c_void_p()
        self._ok(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        ws = ctypes.c_uint64(workspace_bytes)
        self._ok(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE, ctypes.byref(ws),
                                                               ctypes.c_size_t(8)), "ws")
        res = (Heuristic * count)()
        got = ctypes.c_int(0)
        self._ok(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.a, self.b, self.c, self.c, pref,
                                                         count, res, ctypes.byref(got)), "heuristic")
        self.lib.cublasLtMatmulPreferenceDestroy(pref)
        return [res[i] for i in range(got.value) if res[i].state == 0]

    def label(self, algo: Algo) -> str:
        out = []
        for name, (attr, size) in CFG.items():
            v = ctypes.c_uint32(0) if size == 4 else ctypes.c_uint16(0)
            written = ctypes.c_size_t(0)
            if self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(v),
                                                             ctypes.c_size_t(size), ctypes.byref(written)) == 0:
                out.append(f"{name}={v.value}")
        return " ".join(out)

    def __call__(self, x, w, y, cand: Heuristic, workspace: torch.Tensor):
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._ok(self.lib.cublasLtMatmul(
            self.handle, self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(w.data_ptr()), self.a,
            ctypes.c_void_p(x.data_ptr()), self.b, ctypes.byref(self.beta), ctypes.c_void_p(y.data_ptr()), self.c,
            ctypes.c_void_p(y.data_ptr()), self.c, ctypes.byref(cand.algo), ctypes.c_void_p(workspace.data_ptr()),
            ctypes.c_size_t(cand.workspace), stream), "matmul")


def main(argv=None) -> int:
    ap = probe_parser(rows=True)
    ap.add_argument("--workspaces", default="1,32,256", help="workspace limits, MiB")
    args = ap.parse_args(argv)
    m, L, dev, dt = args.rows, args.layers, "cuda", torch.bfloat16
    torch.backends.cuda.preferred_blas_library("cublaslt")
    lib = load_lt()
    handle = ctypes.c_void_p()
    LtProduct._ok(lib.cublasLtCreate(ctypes.byref(handle)), "create")
    w, x, y = operands(m, L, dt)
    wss = [int(v) for v in args.workspaces.split(",")]
    workspace = torch.empty(max(wss) << 20, dtype=torch.uint8, device=dev)
    out = {"rows": m, "layers": L}
    rows, best = [], {}
    for p, (n, k) in PRODUCTS.items():
        mb = n * k * 2 / 1e6
        prod = LtProduct(lib, handle, m, n, k)
        ref = torch.nn.functional.linear(x[p], w[p][0])
        torch_us = torch_layer_us(x, w, y, p)
        rows.append((p, "torch (cuBLASLt)", torch_us, mb / torch_us, ""))
        seen, timed = set(), {}
        for ws in wss:
            for rank, cand in enumerate(prod.candidates(ws << 20)):
                label = prod.label(cand.algo)
                key = tuple(cand.algo.data)
                if key in seen:
                    continue
                seen.add(key)
                try:
                    prod(x[p], w[p][0], y[p], cand, workspace)
                    torch.cuda.synchronize()
                    err = (y[p].float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
                    if err > 1e-2:
                        print(f"{p} {label}: wrong (rel err {err:.3g})", file=sys.stderr)
                        continue
                    us = graph_us(lambda p=p, prod=prod, cand=cand:
                                  [prod(x[p], w[p][i], y[p], cand, workspace) for i in range(L)]) / L
                    timed[f"{label} #{len(timed)}"] = (us, cand, ws, rank, cand.workspace)
                except Exception as e:
                    print(f"{p} {label}: {type(e).__name__}: {str(e)[:100]}", file=sys.stderr)
        ranked = sorted(timed.items(), key=lambda kv: kv[1][0])
        for label, (us, cand, ws, rank, need) in ranked[:3]:
            rows.append((p, f"ws {ws} MiB, rank {rank}", us, mb / us, f"{label} (needs {need >> 10} KiB)"))
        if ranked:
            best[p] = (prod, ranked[0][1][1])
        first = {ws: None for ws in wss}
        for label, (us, cand, ws, rank, need) in timed.items():
            if rank == 0:
                first[ws] = round(us, 2)
        out[p] = {"torch": round(torch_us, 2), "best": round(ranked[0][1][0], 2) if ranked else None,
                  "best_config": ranked[0][0] if ranked else None, "heuristic_first": first,
                  "candidates": len(timed)}
        print(p, "all:", [(lab, round(v[0], 2)) for lab, v in ranked], file=sys.stderr)

    gb = chain_gb(L)

    def chain_torch():
        for i in range(L):
            for p in PRODUCTS:
                torch.nn.functional.linear(x[p], w[p][i], out=y[p])

    def chain_best():
        for i in range(L):
            for p in PRODUCTS:
                prod, cand = best[p]
                prod(x[p], w[p][i], y[p], cand, workspace)

    chains = [("torch (cuBLASLt)", chain_torch)]
    if len(best) == len(PRODUCTS):
        chains.append(("fastest per product", chain_best))
    chains.append(("torch (again)", chain_torch))
    for name, fn in chains:
        us = graph_us(fn, replays=5)
        rows.append(("chain", name, us, gb / us * 1e3, f"{gb:.2f} GB"))
        out[f"chain {name}"] = round(us, 1)

    print_rows(rows, "algorithm", width=22, digits=2)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
