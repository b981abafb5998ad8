"""What streaming a decode step's weights costs with nothing else to do: a plain read kernel over the
Llama-3.1-8B layers' bytes, as one launch, one launch a layer, and one launch a product (as a 64-row step's
cuBLASLt products are launched), each chain captured in one graph.

The 64-row step's products stream at 3.7 TB/s and the megakernel's phases at 3.6; this probe says how much
of the gap to the H200's read rate is the launches and phase boundaries themselves (a ramp at each start,
a tail at each end), whatever the kernel computes. cuBLASLt's 64-row products over the same bytes are
timed in the same run for reference. Each product of each layer is its own region of one
large buffer (14 GB, nothing stays in L2). The kernel reads 16 bytes a load, ``UNROLL`` loads in flight
per thread, and folds them into a value it stores only if it matches a constant, so no load is dropped.

    python tools/probe_read_floor.py [--layers 32] [--json]

CUDA only; a probe, not a benchmark of anything flared runs.
"""

from __future__ import annotations

import ctypes
import json
import sys

import torch
from products64 import PRODUCTS, graph_us, launch, operands, probe_parser

SOURCE = r"""
extern "C" __global__ void read_region(const uint4* __restrict__ p, long long n, unsigned int* sink) {
    unsigned int acc = 0;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + (UNROLL - 1) * stride < n; i += UNROLL * stride) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) v[u] = __ldcs(p + i + u * stride);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < n; i += stride) { uint4 v = __ldcs(p + i); acc ^= v.x ^ v.y ^ v.z ^ v.w; }
    if (acc == 0x9e3779b9u) sink[0] = acc;
}
"""


class Reader:
    def __init__(self, unroll: int):
        from flared.execution.cuda import cupy

        self.fn = cupy.RawModule(code=SOURCE, options=(f"-DUNROLL={unroll}",)).get_function("read_region")
        self.sink = torch.zeros(1, dtype=torch.int32, device="cuda")

    def __call__(self, ptr: int, nbytes: int, blocks: int, threads: int) -> None:
        vals = [ctypes.c_uint64(ptr), ctypes.c_int64(nbytes // 16), ctypes.c_uint64(self.sink.data_ptr())]
        launch(self.fn, blocks, threads, 0, vals)


def main(argv=None) -> int:
    ap = probe_parser(rows=False)
    args = ap.parse_args(argv)
    L = args.layers
    sizes = [n * k * 2 for n, k in PRODUCTS.values()]  # bytes per product, a layer's order
    layer_bytes = sum(sizes)
    total = layer_bytes * L
    buf = torch.empty(total, dtype=torch.uint8, device="cuda")
    buf.random_(0, 255)
    base = buf.data_ptr()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    regions = {
        "one launch": [(base, total)],
        "a launch a layer": [(base + i * layer_bytes, layer_bytes) for i in range(L)],
        "a launch a product": [(base + i * layer_bytes + sum(sizes[:j]), s) for i in range(L)
                               for j, s in enumerate(sizes)],
    }
    res = {}
    for unroll in (4, 8):
        reader = Reader(unroll)
        for per_sm, threads in ((1, 1024), (2, 512), (4, 256)):
            for name, spans in regions.items():
                def fn(spans=spans, reader=reader, per_sm=per_sm, threads=threads):
                    for ptr, nbytes in spans:
                        reader(ptr, nbytes, sms * per_sm, threads)

                us = graph_us(fn, replays=5)
                res[(name, unroll, per_sm, threads)] = us
    # The reference: the same bytes as the 64-row step's cuBLASLt products (their own weights, same sizes).
    torch.backends.cuda.preferred_blas_library("cublaslt")
    del buf
    w, x, y = operands(64, L)

    def lt():
        for i in range(L):
            for p in PRODUCTS:
                torch.nn.functional.linear(x[p], w[p][i], out=y[p])

    res[("cuBLASLt products, 64 rows", 0, 0, 0)] = graph_us(lt, replays=5)
    print(f"{L} layers, {total / 1e9:.2f} GB: qkv / o / gate_up / down = "
          + " / ".join(f"{s / 1e6:.1f}" for s in sizes) + " MB a layer")
    print(f"{'launches':26} {'unroll':>6} {'blocks/SM x threads':>20} {'us':>9} {'TB/s':>6}")
    for (name, unroll, per_sm, threads), us in sorted(res.items(), key=lambda kv: (kv[0][0], kv[1])):
        print(f"{name:26} {unroll:6} {f'{per_sm} x {threads}':>20} {us:9.1f} {total / us / 1e6:6.2f}")
    if args.json:
        print(json.dumps({f"{n} u{u} {b}x{t}": round(us, 1) for (n, u, b, t), us in res.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
