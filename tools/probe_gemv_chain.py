"""One-row decode products as separate plain kernels, built like probe_read_floor's read kernel: how close a
chain of 128 matrix-vector products (32 Llama-3.1-8B layers x qkv, o, gate_up, down) comes to the chain of
plain reads over the same bytes, against cuBLAS's products in the same run.

probe_read_floor measured 4.18 TB/s for 128 read launches over these bytes and 4.54 for one launch; the
megakernel's body streams at 3.6. Here each product is one launch: every block copies the input vector into
shared memory, then each warp takes weight rows in turn (grid-stride), loads ``UNROLL`` 16-byte chunks per
lane at a time with the streaming hint, dots them with the vector in float32 and reduces across the warp.
Inputs are random; the outputs of one product are checked against torch in float32.

    python tools/probe_gemv_chain.py [--layers 32] [--json]

CUDA only; a probe for deciding how the one-row step's products should be launched.
"""

from __future__ import annotations

import ctypes
import json
import sys

import torch
from products64 import PRODUCTS, graph_us, launch, operands, probe_parser

SOURCE = r"""
__device__ __forceinline__ float dot8(uint4 w, uint4 x) {
    float s = __uint_as_float(w.x << 16) * __uint_as_float(x.x << 16);
    s = fmaf(__uint_as_float(w.x & 0xffff0000u), __uint_as_float(x.x & 0xffff0000u), s);
    s = fmaf(__uint_as_float(w.y << 16), __uint_as_float(x.y << 16), s);
    s = fmaf(__uint_as_float(w.y & 0xffff0000u), __uint_as_float(x.y & 0xffff0000u), s);
    s = fmaf(__uint_as_float(w.z << 16), __uint_as_float(x.z << 16), s);
    s = fmaf(__uint_as_float(w.z & 0xffff0000u), __uint_as_float(x.z & 0xffff0000u), s);
    s = fmaf(__uint_as_float(w.w << 16), __uint_as_float(x.w << 16), s);
    s = fmaf(__uint_as_float(w.w & 0xffff0000u), __uint_as_float(x.w & 0xffff0000u), s);
    return s;
}

// y[r] = W[r, :] . x for r < n; k8 = K / 8 (16-byte chunks a row).
extern "C" __global__ void gemv_rows(const uint4* __restrict__ W, const uint4* __restrict__ x, float* __restrict__ y,
                                     int n, int k8) {
    extern __shared__ uint4 xs[];
    for (int i = threadIdx.x; i < k8; i += blockDim.x) xs[i] = x[i];
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int warps = (gridDim.x * blockDim.x) >> 5;
    for (int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < n; r += warps) {
        const uint4* row = W + (long long)r * k8;
        float acc = 0.f;
        for (int c = lane; c < k8; c += 32 * UNROLL) {
            uint4 w[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
                if (c + u * 32 < k8) w[u] = __ldcs(row + c + u * 32);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
                if (c + u * 32 < k8) acc += dot8(w[u], xs[c + u * 32]);
        }
#pragma unroll
        for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) y[r] = acc;
    }
}
"""


class Gemv:
    def __init__(self, unroll: int):
        from flared.execution.cuda import cupy

        self.fn = cupy.RawModule(code=SOURCE, options=(f"-DUNROLL={unroll}",)).get_function("gemv_rows")
        self.fn.max_dynamic_shared_size_bytes = 14336 * 2

    def __call__(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, blocks: int, threads: int) -> None:
        n, k = w.shape
        vals = [ctypes.c_uint64(w.data_ptr()), ctypes.c_uint64(x.data_ptr()), ctypes.c_uint64(y.data_ptr()),
                ctypes.c_int32(n), ctypes.c_int32(k // 8)]
        launch(self.fn, blocks, threads, k * 2, vals)


def main(argv=None) -> int:
    ap = probe_parser(rows=False)
    args = ap.parse_args(argv)
    L = args.layers
    w, x, y = operands(1, L)
    y32 = {p: torch.empty(n, device="cuda", dtype=torch.float32) for p, (n, k) in PRODUCTS.items()}
    gb = sum(n * k for n, k in PRODUCTS.values()) * L * 2 / 1e9
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {}

    def blas():
        for i in range(L):
            for p in PRODUCTS:
                torch.nn.functional.linear(x[p], w[p][i], out=y[p])

    res["cuBLAS (torch), 1 row"] = graph_us(blas, replays=5)
    for unroll in (4, 8, 16):
        g = Gemv(unroll)
        for per_sm, threads in ((4, 256), (2, 512), (8, 128), (1, 1024)):
            name = f"gemv, unroll {unroll}, {per_sm} x {threads}"
            try:
                g(w["down"][0], x["down"][0], y32["down"], sms * per_sm, threads)
                torch.cuda.synchronize()
            except Exception as e:  # e.g. too many registers for the block
                print(f"{name}: {type(e).__name__}: {str(e)[:100]}", file=sys.stderr)
                continue
            ref = torch.nn.functional.linear(x["down"].float(), w["down"][0].float())[0]
            err = ((y32["down"] - ref).abs().max() / ref.abs().max()).item()
            if err > 1e-3:
                print(f"{name}: wrong (rel err {err:.3g})", file=sys.stderr)
                continue

            def fn(g=g, per_sm=per_sm, threads=threads):
                for i in range(L):
                    for p in PRODUCTS:
                        g(w[p][i], x[p][0], y32[p], sms * per_sm, threads)

            res[name] = graph_us(fn, replays=5)
    print(f"{L} layers x 4 products, one row, {gb:.2f} GB")
    print(f"{'kernels':34} {'us':>9} {'TB/s':>6}")
    for name, us in sorted(res.items(), key=lambda kv: kv[1]):
        print(f"{name:34} {us:9.1f} {gb / us * 1e3:6.2f}")
    if args.json:
        print(json.dumps({k: round(v, 1) for k, v in res.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
