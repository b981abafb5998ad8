"""The 8B decode step's products at 64 rows (cuBLASLt), with and without an L2 prefetch of the next product's
weights on a parallel branch of the graph.

Each product of a 64-row step is its own kernel: it starts with nothing of its weights on the chip and ends
with a tail of idle multiprocessors, so the small ones stream at ~3 TB/s where the large ones reach ~4
(tools/probe_gemm64.py). Weights do not depend on activations, so a side branch that starts with product i
can pull the first bytes of product i+1's weights into L2 while product i streams and tails off. Here every
product of every layer has its own random weights (15 GB for the Llama-3.1-8B shape, nothing stays in L2
between steps); the chain of 32 layers x 4 products + the LM head is captured once per variant:

- ``rows F``: the first F of every weight row (the k-range each output tile reads first);
- ``first N MB``: the product's first N MB in memory order;
- ``bulk`` prefetches (``cp.async.bulk.prefetch.L2``, one per row or chunk) or ``lines`` (one
  ``prefetch.global.L2`` per 128-byte line, ``evict_last`` where named), from ``blocks`` blocks.

    python tools/probe_l2_sidecar.py [--rows 64] [--layers 32] [--json]

CUDA only; a probe for deciding whether the decode graph should carry such a branch.
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from products64 import H, PRODUCTS, V, chain_gb, graph_us, launch, operands, probe_parser, time_variants  # noqa: E402

SOURCE = r"""
extern "C" __global__ void l2_prefetch(const char* base, long long stride, int count, int bytes, int mode) {
    // `count` spans of `bytes` each, `stride` apart from `base`; mode 0: one bulk prefetch per span,
    // 1: one prefetch per 128-byte line, 2: the same with the evict_last priority.
    int t = blockIdx.x * blockDim.x + threadIdx.x, n = gridDim.x * blockDim.x;
    if (mode == 0) {
        for (int i = t; i < count; i += n) {
            const char* p = base + (long long)i * stride;
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes) : "memory");
        }
        return;
    }
    int lines = bytes / 128;
    long long total = (long long)count * lines;
    for (long long j = t; j < total; j += n) {
        const char* p = base + (j / lines) * stride + (j % lines) * 128;
        if (mode == 1) asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
        else asm volatile("prefetch.global.L2::evict_last [%0];" :: "l"(p));
    }
}
"""


class Prefetcher:
    def __init__(self):
        from flared.execution.cuda import cupy

        self.fn = cupy.RawModule(code=SOURCE).get_function("l2_prefetch")

    def __call__(self, w: torch.Tensor, spec: dict) -> None:
        n, k = w.shape
        row_bytes = k * w.element_size()
        if "rows" in spec:  # the head of every row
            count, stride, nbytes = n, row_bytes, int(row_bytes * spec["rows"]) // 128 * 128
        else:  # the first MB in 64 KB chunks
            chunk = 65536
            count, stride, nbytes = min(n * row_bytes, int(spec["mb"] * 1e6)) // chunk, chunk, chunk
        mode = {"bulk": 0, "lines": 1, "lines last": 2}[spec["how"]]
        vals = [ctypes.c_uint64(w.data_ptr()), ctypes.c_int64(stride), ctypes.c_int32(count), ctypes.c_int32(nbytes),
                ctypes.c_int32(mode)]
        launch(self.fn, spec.get("blocks", 16), 256, 0, vals)


VARIANTS = {
    "none": None,
    "rows 1/4 bulk": {"rows": 0.25, "how": "bulk"},
    "rows 1/8 bulk": {"rows": 0.125, "how": "bulk"},
    "rows 1/2 bulk": {"rows": 0.5, "how": "bulk"},
    "rows 1/4 bulk 132 blocks": {"rows": 0.25, "how": "bulk", "blocks": 132},
    "rows 1/4 lines": {"rows": 0.25, "how": "lines", "blocks": 64},
    "rows 1/4 lines last": {"rows": 0.25, "how": "lines last", "blocks": 64},
    "first 16 MB bulk": {"mb": 16, "how": "bulk"},
    "first 32 MB bulk": {"mb": 32, "how": "bulk"},
}


def main(argv=None) -> int:
    ap = probe_parser(rows=True)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args(argv)
    m, L, dev, dt = args.rows, args.layers, "cuda", torch.bfloat16
    torch.backends.cuda.preferred_blas_library("cublaslt")
    w, x, y = operands(m, L, dt)
    lm = (0.02 * torch.randn(V, H, device=dev)).to(dt)
    xl = torch.randn(m, H, device=dev).to(dt)
    yl = torch.empty(m, V, device=dev, dtype=dt)
    order = [(p, w[p][i], x[p], y[p]) for i in range(L) for p in PRODUCTS] + [("head", lm, xl, yl)]
    pre = Prefetcher()
    side = torch.cuda.Stream()

    def chain(spec):
        def fn():
            main = torch.cuda.current_stream()
            for j, (_, wj, xj, yj) in enumerate(order):
                if spec is not None and j + 1 < len(order):
                    side.wait_stream(main)  # the branch starts with product j
                    with torch.cuda.stream(side):
                        pre(order[j + 1][1], spec)
                torch.nn.functional.linear(xj, wj, out=yj)
            if spec is not None:
                main.wait_stream(side)
        return fn

    gb = chain_gb(L, head=True)
    res = time_variants(args.variants, lambda name: graph_us(chain(VARIANTS[name]), replays=5))
    ref = next(iter(res.values()))
    print(f"{m} rows, {L} layers, {gb:.2f} GB of weights a step")
    print(f"{'variant':30} {'us/step':>9} {'TB/s':>6} {'vs first':>9}")
    for name, us in res.items():
        print(f"{name:30} {us:9.1f} {gb / us * 1e3:6.2f} {us - ref:+9.1f}")
    if args.json:
        print(json.dumps({"rows": m, "layers": L, "us_per_step": {k: round(v, 1) for k, v in res.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
