"""A 64-row product kernel built around the weight stream, against cuBLASLt in the same run (EXPERIMENT, lost:
first run in the thirteenth session, correct but at half cuBLASLt's speed, chain 7,431 us against 3,843;
docs/benchmarks.md says why).

cuBLASLt runs the 8B step's 64-row products on 86-128 blocks of 132 multiprocessors (tiles of 72x64, 48x64,
224x64 output elements), so a third of the chip streams nothing in qkv, o and down; a plain read over the
same 128 launches reaches 4.18 TB/s where cuBLASLt's products reach 3.60 (tools/probe_read_floor.py). Here:

- the weight rows are cut into 16-row tiles dealt evenly over one block per multiprocessor (tile t to block
  t % G), and where a block has few tiles each tile's K is split over up to 8 of its 16 warps, whose float32
  partials the block adds in a fixed order (deterministic);
- each warp streams its tile's rows straight into registers, 16-byte loads, ``PD`` k-blocks of 64 ahead;
- the block's 64 input rows come through shared memory (``cp.async``, ``STAGES`` k-blocks ahead, XOR-swizzled
  16-byte chunks) and feed ``mma.sync.m16n8k16`` (bf16 in, float32 accumulate): the weight tile is the MMA's
  16-row side, the 64 batch rows eight 8-wide column tiles;
- the k order inside each 64-wide block is permuted the same way for weights and inputs, so both fragments
  load as whole 16-byte vectors (a dot product's terms in another order).

    python tools/probe_mma64.py [--layers 32] [--json]

CUDA only (sm_80+ for the MMA); a probe for deciding whether to write the 64-row step's products ourselves.
"""

from __future__ import annotations

import ctypes
import sys

import torch
from products64 import PRODUCTS, chain_gb, cublaslt_reference, finish, graph_us, launch, operands, probe_parser

WARPS, KB, STAGES = 16, 64, 3  # PD (weight k-blocks in flight per warp) per build: 2 spills nothing

SOURCE = r"""
typedef unsigned short bf16raw;

__device__ __forceinline__ void mma16816(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint4 ldg_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ unsigned short f2bf(float f) {  // round to nearest even
    unsigned u = __float_as_uint(f);
    if ((u & 0x7f800000u) == 0x7f800000u) return (unsigned short)((u >> 16) | ((u & 0xffffu) ? 0x40u : 0u));
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Y[64][N] = X[64][K] . W[N][K]^T, bf16, float32 accumulation. One block per multiprocessor (G blocks), WARPS
// warps; warp w works on tile slot i = w / S (tile t = blockIdx.x + i * G, 16 rows) over k split s = w % S.
// Shared memory: STAGES x S x [64 rows][KB] input k-blocks (16-byte chunks XOR-swizzled by row), reused
// after the loop for the split partials [WARPS][16][64] float32.
extern "C" __global__ void __launch_bounds__(WARPS * 32, 1)
mma64(const bf16raw* __restrict__ W, const bf16raw* __restrict__ X, bf16raw* __restrict__ Y, int N, int K, int S) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int G = gridDim.x, T = N / 16, slots = WARPS / S;
    const int slot = warp / S, s = warp % S;
    const int tile = blockIdx.x + slot * G;
    const bool active = slot < slots && tile < T;
    const int Ks = K / S, nkb = Ks / KB;          // this warp's k range: [s * Ks, (s + 1) * Ks)
    const int stage_bytes = S * 64 * KB * 2;      // every split's k-block c, one stage

    // Inputs: k-block c of every split into stage c % STAGES; chunk (split, row, ci) of 16 bytes at
    // [split][row][ci ^ (row & 7)].
    auto load_x = [&](int c) {
        unsigned char* st = smem + (c % STAGES) * stage_bytes;
        const int chunks = S * 64 * (KB / 8);
        for (int i = threadIdx.x; i < chunks; i += WARPS * 32) {
            const int ci = i % (KB / 8), row = (i / (KB / 8)) % 64, sp = i / (64 * (KB / 8));
            const bf16raw* src = X + (long long)row * K + sp * Ks + c * KB + ci * 8;
            const unsigned dst = (unsigned)__cvta_generic_to_shared(
                st + ((sp * 64 + row) * (KB / 8) + (ci ^ (row & 7))) * 16);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
        }
    };

    // Weights: k-block c of rows g and g + 8 of this warp's tile, lane (g, q) taking k = q * 16 .. + 15.
    const bf16raw* w0 = W + (long long)(tile * 16 + g) * K + s * Ks + q * 16;
    const bf16raw* w1 = w0 + 8LL * K;
    uint4 wa[PD][2], wb[PD][2];
    float acc[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    if (active) {
#pragma unroll
        for (int p = 0; p < PD; ++p) {
            wa[p][0] = ldg_stream((const uint4*)(w0 + p * KB)); wa[p][1] = ldg_stream((const uint4*)(w0 + p * KB + 8));
            wb[p][0] = ldg_stream((const uint4*)(w1 + p * KB)); wb[p][1] = ldg_stream((const uint4*)(w1 + p * KB + 8));
        }
    }
    for (int c = 0; c < STAGES - 1; ++c) {
        if (c < nkb) load_x(c);
        asm volatile("cp.async.commit_group;" ::: "memory");
    }

    for (int c0 = 0; c0 < nkb; c0 += PD) {
#pragma unroll
        for (int p = 0; p < PD; ++p) {
            const int c = c0 + p;
            asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 2) : "memory");
            __syncthreads();  // k-block c is in for every thread; stage (c - 1) % STAGES is free
            if (c + STAGES - 1 < nkb) load_x(c + STAGES - 1);
            asm volatile("cp.async.commit_group;" ::: "memory");
            if (active) {
                const unsigned char* xs = smem + (c % STAGES) * stage_bytes + s * 64 * KB * 2;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int n = j * 8 + g;
                    const uint4 x0 = *(const uint4*)(xs + (n * (KB / 8) + ((2 * q) ^ (n & 7))) * 16);
                    const uint4 x1 = *(const uint4*)(xs + (n * (KB / 8) + ((2 * q + 1) ^ (n & 7))) * 16);
                    mma16816(acc[j], wa[p][0].x, wb[p][0].x, wa[p][0].y, wb[p][0].y, x0.x, x0.y);
                    mma16816(acc[j], wa[p][0].z, wb[p][0].z, wa[p][0].w, wb[p][0].w, x0.z, x0.w);
                    mma16816(acc[j], wa[p][1].x, wb[p][1].x, wa[p][1].y, wb[p][1].y, x1.x, x1.y);
                    mma16816(acc[j], wa[p][1].z, wb[p][1].z, wa[p][1].w, wb[p][1].w, x1.z, x1.w);
                }
                if (c + PD < nkb) {
                    const int o = (c + PD) * KB;
                    wa[p][0] = ldg_stream((const uint4*)(w0 + o)); wa[p][1] = ldg_stream((const uint4*)(w0 + o + 8));
                    wb[p][0] = ldg_stream((const uint4*)(w1 + o)); wb[p][1] = ldg_stream((const uint4*)(w1 + o + 8));
                }
            }
        }
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");

    // acc[j]: rows g / g + 8 of the tile, batch rows j * 8 + 2q and + 1.
    if (S == 1) {
        if (active) {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int n = j * 8 + 2 * q, r = tile * 16 + g;
                Y[(long long)n * N + r] = f2bf(acc[j][0]);
                Y[(long long)(n + 1) * N + r] = f2bf(acc[j][1]);
                Y[(long long)n * N + r + 8] = f2bf(acc[j][2]);
                Y[(long long)(n + 1) * N + r + 8] = f2bf(acc[j][3]);
            }
        }
        return;
    }
    __syncthreads();  // the stages are free: partials [warp][16][64]
    float* red = (float*)smem;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int n = j * 8 + 2 * q;
        red[(warp * 16 + g) * 64 + n] = acc[j][0];
        red[(warp * 16 + g) * 64 + n + 1] = acc[j][1];
        red[(warp * 16 + g + 8) * 64 + n] = acc[j][2];
        red[(warp * 16 + g + 8) * 64 + n + 1] = acc[j][3];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < slots * 16 * 64; e += WARPS * 32) {
        const int sl = e / (16 * 64), rr = (e / 64) % 16, n = e % 64;
        const int t = blockIdx.x + sl * G;
        if (t >= T) continue;
        float v = 0.f;
        for (int sp = 0; sp < S; ++sp) v += red[((sl * S + sp) * 16 + rr) * 64 + n];
        Y[(long long)n * N + t * 16 + rr] = f2bf(v);
    }
}
"""


class Mma64:
    def __init__(self, pd: int):
        from flared.execution.cuda import cupy

        self.pd = pd
        opts = tuple(f"-D{k}={v}" for k, v in (("WARPS", WARPS), ("KB", KB), ("PD", pd), ("STAGES", STAGES)))
        self.fn = cupy.RawModule(code=SOURCE, options=opts + ("--std=c++17",)).get_function("mma64")
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count

    def splits(self, n: int, k: int) -> int:
        """K splits per tile: as many as leave every block's tiles a warp each, within k's granularity."""
        per_block = -(-(n // 16) // self.sms)
        for s in (8, 4, 2, 1):
            if s * per_block <= WARPS and (k // s) % (KB * self.pd) == 0 and k % s == 0:
                return s
        raise ValueError(f"no split fits n={n}, k={k}")

    def shared(self, s: int) -> int:
        return max(STAGES * s * 64 * KB * 2, WARPS * 16 * 64 * 4 if s > 1 else 0)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, s: int) -> None:
        n, k = w.shape
        launch(self.fn, self.sms, WARPS * 32, self.shared(s),
               [ctypes.c_uint64(w.data_ptr()), ctypes.c_uint64(x.data_ptr()), ctypes.c_uint64(y.data_ptr()),
                ctypes.c_int32(n), ctypes.c_int32(k), ctypes.c_int32(s)])


def main(argv=None) -> int:
    ap = probe_parser(rows=False)
    ap.add_argument("--pd", default="2,4", help="builds: weight k-blocks in flight per warp")
    args = ap.parse_args(argv)
    L = args.layers
    torch.backends.cuda.preferred_blas_library("cublaslt")
    w, x, y = operands(64, L)
    mine = {p: torch.empty_like(y[p]) for p in PRODUCTS}
    rows, out, ok = [], {"layers": L}, True
    kerns = {}
    for p, (n, k) in PRODUCTS.items():
        mb, ref, lt, row = cublaslt_reference(x, w, y, p)
        rows.append(row)
        out[p] = {"cublaslt": round(lt, 2)}
        for pd in (int(v) for v in args.pd.split(",")):
            if pd not in kerns:
                kerns[pd] = Mma64(pd)
                kerns[pd].fn.max_dynamic_shared_size_bytes = max(kerns[pd].shared(s) for s in (1, 2, 4, 8))
            kern = kerns[pd]
            sp = kern.splits(n, k)
            kern(x[p], w[p][0], mine[p], sp)
            torch.cuda.synchronize()
            err = ((mine[p].float() - ref).abs().max() / ref.abs().max()).item()
            good = err < 1e-2
            ok &= good
            us = graph_us(lambda p=p, kern=kern, sp=sp: [kern(x[p], w[p][i], mine[p], sp) for i in range(L)]) / L
            note = f"splits {sp}, rel err {err:.1e}" + ("" if good else " WRONG")
            rows.append((p, f"mma64 pd {pd}", us, mb / us, note))
            out[p][f"mma64 pd{pd}"] = round(us, 2)
            out[p]["rel_err"] = max(err, out[p].get("rel_err", 0.0))
    gb = chain_gb(L)

    def chain(kern):
        def fn():
            for i in range(L):
                for p, (n, k) in PRODUCTS.items():
                    if kern is not None:
                        kern(x[p], w[p][i], mine[p], kern.splits(n, k))
                    else:
                        torch.nn.functional.linear(x[p], w[p][i], out=y[p])
        return fn

    chains = [("cuBLASLt", None)] + [(f"mma64 pd {pd}", k) for pd, k in kerns.items()] + [("cuBLASLt (again)", None)]
    for name, kern in chains:
        us = graph_us(chain(kern), replays=5)
        rows.append(("chain", name, us, gb / us * 1e3, f"{gb:.2f} GB"))
        out[f"chain {name}"] = round(us, 1)
    return finish(rows, out, ok, args.json, "mma64 disagrees with torch: its timings mean nothing until that is fixed",
                  width=16)


if __name__ == "__main__":
    sys.exit(main())
