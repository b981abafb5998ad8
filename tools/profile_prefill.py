"""Where a multi-sequence prefill step's GPU time goes, beside cuBLAS alone on the same products.

The step bench_gpu's 64 streams begin with: 16 prompts of 128 tokens in one 2,048-token graph (random bf16
weights of the Llama-3.1-8B or SmolLM2-135M shape). It prints the graph's time, the TFLOP/s that makes of the
layers' products, the kernels by GPU time (torch.profiler over graph replays), and the four products alone
through torch.matmul at the same rows (and an 8,192-square product, the card's matmul rate) for reference.

    python tools/profile_prefill.py [--shape 8b] [--seqs 16] [--tokens 128] [--json]

CUDA only. With --json the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

PAGE_TOKENS = 16


def build(shape: str, seqs: int, tokens: int):
    from bench_gpu import make_hf, serving

    from flared.model.kernels.paged_decoder import PagedCudaDecoder, StaticInputs

    hf = make_hf(shape, torch.bfloat16)
    model = serving(hf, torch.bfloat16)
    del hf
    torch.cuda.empty_cache()
    dev = model.device
    t = seqs * tokens
    pages = -(-tokens // PAGE_TOKENS)
    i64, i32, f32 = torch.int64, torch.int32, torch.float32
    within = torch.arange(tokens, device=dev).repeat(seqs)
    seq = torch.arange(seqs, device=dev).repeat_interleave(tokens)
    tables = torch.arange(seqs * pages, dtype=i32, device=dev).view(seqs, pages)
    inputs = StaticInputs(
        token_ids=torch.randint(3, model.config.vocab_size, (t,), device=dev),
        positions=within.to(i64),
        slot_ids=(tables[seq, within // PAGE_TOKENS].long() * PAGE_TOKENS + within % PAGE_TOKENS),
        state_rows=torch.arange(1, seqs + 1, dtype=i64, device=dev),
        block_tables=tables,
        context_lens=torch.full((seqs,), tokens, dtype=i32, device=dev),
        chunk_meta=torch.tensor([[0, tokens]] * seqs, dtype=i32, device=dev),
        logit_rows=torch.arange(seqs, device=dev) * tokens + tokens - 1,
        temperature=torch.zeros(seqs, dtype=f32, device=dev),
        top_k=torch.zeros(seqs, dtype=i32, device=dev),
        top_p=torch.ones(seqs, dtype=f32, device=dev),
        seeds=torch.zeros(seqs, dtype=i64, device=dev),
        steps=torch.zeros(seqs, dtype=i64, device=dev))
    dec = PagedCudaDecoder(model, inputs, num_pages=max(seqs * pages, 64), page_tokens=PAGE_TOKENS,
                           num_state_rows=seqs + 1, max_batch=seqs, max_tokens=t)
    return model, dec


def main() -> int:
    from bench_decode_step import kernel_times

    from flared.execution.graphs import time_graph_us

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    model, dec = build(args.shape, args.seqs, args.tokens)
    rows = args.seqs * args.tokens
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dec.prefill(args.seqs, rows)  # compiles the Triton kernels outside the capture
    stream.synchronize()
    step_us = time_graph_us(lambda: dec.prefill(args.seqs, rows), stream, replays=10)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        dec.prefill(args.seqs, rows)
    kernels = kernel_times(graph)
    del graph

    c = model.config
    layer = model.layers[0]
    shapes = {name: tuple(getattr(layer, name).weight.shape) for name in ("qkv", "o", "gate_up", "down")}
    flop = 2 * rows * sum(n * k for n, k in shapes.values()) * c.num_layers
    x = {k: torch.randn(rows, k, dtype=torch.bfloat16, device="cuda") for _, k in shapes.values()}
    alone = {}
    for name, (n, k) in shapes.items():
        w = getattr(layer, name).weight
        alone[name] = time_graph_us(lambda: torch.matmul(x[k], w.t()), stream, replays=20)
    square = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    square_us = time_graph_us(lambda: torch.matmul(square, square), stream, replays=10)
    peak = 2 * 8192 ** 3 / square_us / 1e6
    products_us = sum(alone.values()) * c.num_layers

    print(f"{args.shape}: {args.seqs} prompts x {args.tokens} tokens in one prefill graph ({rows} rows)")
    print(f"  the graph: {step_us:,.0f} us, {flop / step_us / 1e6:,.0f} TFLOP/s of its layers' products")
    print(f"  the products alone through torch.matmul: {products_us:,.0f} us for {c.num_layers} layers "
          f"({flop / products_us / 1e6:,.0f} TFLOP/s); 8192-square: {peak:,.0f} TFLOP/s")
    for name, us in alone.items():
        n, k = shapes[name]
        print(f"    {name:8} [{rows} x {k}] x [{k} x {n}]: {us:7.1f} us  {2 * rows * n * k / us / 1e6:5.0f} TFLOP/s")
    print("  kernels, us a step:")
    for name, count, us in kernels[:16]:
        print(f"    {us:9.1f}  {us / step_us:5.1%}  {count:4d} x  {name}")
    if args.json:
        print(json.dumps({"shape": args.shape, "rows": rows, "step_us": round(step_us, 1),
                          "products_alone_us": round(products_us, 1), "square_tflops": round(peak),
                          "alone_us": {k: round(v, 1) for k, v in alone.items()},
                          "kernels": {n: round(us, 1) for n, _, us in kernels}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
