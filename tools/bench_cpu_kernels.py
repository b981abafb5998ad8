#!/usr/bin/env python
"""flared's CPU bf16 kernels beside torch's ops, same process, same inputs.

- products: SmolLM2-135M's matrices (30 copies of each layer's qkv / o / gate_up / down, so weights
  stream from memory as in a decode step, plus the 49152 x 576 LM head) at several row counts: flared's
  packed kernel (flared/_fast/linear.pyx) against torch's bf16 ``F.linear``; one "step" is every product
  of the model once. The packed weights sit where DecoderModel puts them (one mapping in huge pages);
  "4 KiB pages" is the same kernel over plain copies; on a CPU with AMX the kernel runs on AMX tiles, and
  "AVX-512 kernel" is its VDPBF16PS path (linear.amx_min_rows(0)); "unpacked + torch" copies each packed weight back to
  [out, in] (decoder.unpack_bf16) and runs torch's product, DecoderModel's path for UNPACK_MIN_ROWS rows and more
  on a CPU with AMX.
- decode attention: SmolLM2's heads (9 query, 3 kv, head_dim 64) over paged slots, 30 layers: flared's
  kernel (flared/_fast/attention.pyx) against torch's path (gather the contexts, bmm, softmax, bmm), as
  DecoderModel runs it without the kernel. The K/V pool is allocated as PagedKVCache allocates it (huge
  pages where the kernel allows, ``host_memory.host_zeros``); "4 KiB pages" is the same kernel over a copy
  in plain ``torch.zeros`` memory.

Best of --repeats, the two sides alternating. Needs a CPU with AVX-512 BF16.

    .venv/bin/python tools/bench_cpu_kernels.py [--json] [--threads 2]

Prints a table; with --json the last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flared._fast import attention  # noqa: E402
from flared._fast.linear import AMX, BF16_SUPPORTED, amx_min_rows, bf16_linear  # noqa: E402
from flared.model.decoder import UNPACK_MIN_ROWS, _gather_packed, _Linear, pack_bf16, unpack_bf16  # noqa: E402
from flared.model.host_memory import host_zeros  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LM_HEAD = (49152, 576)
LAYERS = 30
FLOPS_PER_ROW = 2 * (LAYERS * sum(n * k for n, k in SHAPES.values()) + LM_HEAD[0] * LM_HEAD[1])


def alternate(steps: dict, repeats: int) -> dict:
    """Best seconds of each step over ``repeats`` rounds, the steps alternating within a round (after one
    warm-up call each), so a burst of load from elsewhere hits both sides."""
    for fn in steps.values():
        fn()
    best = {name: float("inf") for name in steps}
    for _ in range(repeats):
        for name, fn in steps.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def bench_products(rows_list, repeats: int, threads: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=g).to(torch.bfloat16)) for _ in range(LAYERS) for n, k in SHAPES.values()]
    weights.append(torch.randn(*LM_HEAD, generator=g).to(torch.bfloat16))
    # Packed and placed as DecoderModel places them (one mapping in huge pages), and a plain copy (4 KiB pages).
    linears = [_Linear(w, None) for w in weights]
    _gather_packed(linears)
    packed = [lin.packed for lin in linears]
    packed_4k = [pack_bf16(w) for w in weights]
    out = []
    for rows in rows_list:
        xs = {k: torch.randn(rows, k, generator=g).to(torch.bfloat16) for k in {w.shape[1] for w in weights}}

        def torch_step():
            for w in weights:
                F.linear(xs[w.shape[1]], w)

        def flared_over(matrices):
            def step():
                for w, p in zip(weights, matrices):
                    y = torch.empty(rows, w.shape[0], dtype=torch.bfloat16)
                    bf16_linear(p.data_ptr(), xs[w.shape[1]].data_ptr(), y.data_ptr(), rows, w.shape[0], w.shape[1],
                                threads)
            return step

        def unpacked_step():
            for w, p in zip(weights, packed):
                F.linear(xs[w.shape[1]], unpack_bf16(p, w.shape[0]))

        steps = {"flared": flared_over(packed), "flared_4k": flared_over(packed_4k), "torch": torch_step,
                 "unpacked": unpacked_step}
        if AMX:
            def avx512_step(step=flared_over(packed)):
                fewest = amx_min_rows()
                amx_min_rows(0)
                try:
                    step()
                finally:
                    amx_min_rows(fewest)
            steps["avx512"] = avx512_step
        times = alternate(steps, repeats)
        out.append({"rows": rows, "flared_ms": times["flared"] * 1e3, "flared_4k_pages_ms": times["flared_4k"] * 1e3,
                    "torch_ms": times["torch"] * 1e3, "unpacked_torch_ms": times["unpacked"] * 1e3,
                    "avx512_kernel_ms": times["avx512"] * 1e3 if AMX else None,
                    "flared_gflops": FLOPS_PER_ROW * rows / times["flared"] / 1e9,
                    "ratio": times["torch"] / times["flared"]})
    return out


def bench_attention(cases, repeats: int, threads: int) -> list[dict]:
    nh, nkv, d, page = 9, 3, 64, 64
    g = torch.Generator().manual_seed(1)
    out = []
    for rows, context in cases:
        pages_per_row = -(-context // page)
        num_slots = rows * pages_per_row * page
        # Allocated as PagedKVCache allocates its pool (huge pages where the kernel allows), and a copy in
        # plain torch.zeros memory (4 KiB pages) for the A/B.
        k = host_zeros((LAYERS, nkv, num_slots, d), torch.bfloat16)
        v = host_zeros((LAYERS, nkv, num_slots, d), torch.bfloat16)
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
        k4, v4 = torch.zeros_like(k).copy_(k), torch.zeros_like(v).copy_(v)
        order = torch.randperm(rows * pages_per_row, generator=g).view(rows, pages_per_row)
        slots = (order[:, :, None] * page + torch.arange(page)).reshape(rows, -1)[:, :context].contiguous()
        lens = torch.full((rows,), context, dtype=torch.int64)
        q = torch.randn(rows, nh, d, generator=g).to(torch.bfloat16)
        o = torch.empty(rows, nh, d, dtype=torch.bfloat16)
        flat = slots.reshape(-1)

        def flared_over(keys, values):
            def step():
                for layer in range(LAYERS):
                    attention.decode_attention(q.data_ptr(), keys[layer].data_ptr(), values[layer].data_ptr(),
                                               o.data_ptr(), slots.data_ptr(), context, lens.data_ptr(), rows, nh, nkv,
                                               d, num_slots, d ** -0.5, 0, True, threads)
            return step

        def torch_step():  # DecoderModel's path without the kernel (all rows the same length: no mask)
            qd = q.view(rows, nkv, nh // nkv, d).transpose(0, 1).reshape(nkv * rows, nh // nkv, d)
            for layer in range(LAYERS):
                keys = k[layer].index_select(1, flat).view(nkv * rows, context, d)
                values = v[layer].index_select(1, flat).view(nkv * rows, context, d)
                probs = torch.softmax(torch.bmm(qd, keys.transpose(1, 2)).float() * d ** -0.5, -1).to(q.dtype)
                torch.bmm(probs, values)

        times = alternate({"flared": flared_over(k, v), "flared_4k": flared_over(k4, v4), "torch": torch_step},
                          repeats)
        out.append({"rows": rows, "context": context, "flared_ms": times["flared"] * 1e3,
                    "flared_4k_pages_ms": times["flared_4k"] * 1e3, "torch_ms": times["torch"] * 1e3,
                    "ratio": times["torch"] / times["flared"]})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not BF16_SUPPORTED:
        print("this CPU lacks AVX-512 BF16: flared's kernels do not run here", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    products = bench_products([1, 8, 32, 64, 256, 512], args.repeats, args.threads)
    attn = bench_attention([(1, 2000), (8, 500), (32, 500)], args.repeats, args.threads)
    unpacks = f"DecoderModel unpacks from {UNPACK_MIN_ROWS} rows" if UNPACK_MIN_ROWS else "DecoderModel never unpacks"
    print(f"bf16 products, SmolLM2-135M (30 layers + LM head, weights from memory), {args.threads} threads ({unpacks})")
    print(f"flared's kernel: {'AMX tiles' if AMX else 'AVX-512 BF16 (or AVX2)'}")
    print(f"{'rows':>5} {'flared ms':>10} {'same, 4 KiB pages':>18} {'AVX-512 kernel ms':>18} {'torch ms':>9} "
          f"{'unpacked + torch ms':>20} {'flared GFLOP/s':>15} {'ratio':>6}")
    for r in products:
        avx512 = f"{r['avx512_kernel_ms']:18.2f}" if r["avx512_kernel_ms"] is not None else f"{'-':>18}"
        print(f"{r['rows']:5d} {r['flared_ms']:10.2f} {r['flared_4k_pages_ms']:18.2f} {avx512} {r['torch_ms']:9.2f} "
              f"{r['unpacked_torch_ms']:20.2f} {r['flared_gflops']:15.0f} {r['ratio']:5.2f}x")
    print("\nbf16 decode attention, 30 layers, 9/3 heads x 64")
    print(f"{'rows':>5} {'context':>8} {'flared ms':>10} {'same, 4 KiB pages':>18} {'torch ms':>9} {'ratio':>6}")
    for r in attn:
        print(f"{r['rows']:5d} {r['context']:8d} {r['flared_ms']:10.2f} {r['flared_4k_pages_ms']:18.2f} "
              f"{r['torch_ms']:9.2f} {r['ratio']:5.2f}x")
    if args.json:
        print(json.dumps({"threads": args.threads, "amx": AMX, "unpack_min_rows": UNPACK_MIN_ROWS, "products": products,
                          "decode_attention": attn}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
