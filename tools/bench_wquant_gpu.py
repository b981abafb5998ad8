"""Layer matrices kept quantised on the GPU (Q4_1, Q8_0: kernels/wquant.py) against bf16, in the same run.

1. Products: each of the Llama-3.1-8B shape's four layer products at 1 to 2,048 rows, bf16 through cuBLAS
   (torch.matmul) against kernels/wquant.py's over the same matrix quantised; GPU us a product (ten launches in a
   CUDA graph, replayed), and the weight bytes a second that makes (the rows' bytes aside).
2. Serving: the model built three ways from the same random weights (bf16, and each format), each driven through
   the GraphExecutor as the daemon captures it: one stream (a 128-token prompt, 256 new tokens: decode tok/s) and
   64 streams (128-token prompts, 256 new tokens each: output tok/s over the whole run, prefill included), with the
   layer products' bytes and the GPU memory the model holds. bf16 runs the fused Llama kernels (the megakernel,
   products64); the quantised models the model's torch layers with wquant's products (kernels/paged_decoder.py).

    python3 tools/bench_wquant_gpu.py [--shapes 8b] [--formats q4_1,q8_0] [--rows 1,16,64,256,2048]
                                      [--skip-products] [--skip-serving] [--json]

CUDA only. Prints one table; with --json, one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

LAUNCHES = 10


def time_us(fn, replays: int = 20) -> float:
    """GPU us of one ``fn()``: LAUNCHES calls captured in one graph, the graph replayed, the best of ``replays``."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(LAUNCHES):
            fn()
    best = float("inf")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / LAUNCHES)
    return best


def products(shape: str, formats: list[str], row_counts: list[int], rows: list, out: dict) -> None:
    from flared.model.kernels import wquant
    from flared.model.quant import gpu_quantize

    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in matrices(shape).items():
        weight = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        kept = {fmt: gpu_quantize(fmt, weight) for fmt in formats}
        for m in row_counts:
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            base = time_us(lambda: torch.matmul(x, weight.t()))
            cells = [f"{base:8.1f}"]
            out[f"{shape}|{name}|{m}|bf16_us"] = round(base, 1)
            for fmt in formats:
                us = time_us(lambda: wquant.linear(x, fmt, kept[fmt]))
                nbytes = sum(t.nbytes for t in kept[fmt])
                cells.append(f"{us:8.1f} ({base / us:4.2f}x, {nbytes / us / 1e6:5.2f} TB/s)")
                out[f"{shape}|{name}|{m}|{fmt}_us"] = round(us, 1)
            rows.append((f"{name} [{n}x{k}]", m, *cells))
            print(f"{shape} {name:8} {m:5}  " + "  ".join(cells), flush=True)
    torch.cuda.empty_cache()


def matrices(shape: str) -> dict[str, tuple[int, int]]:
    """The shape's four layer products: name -> (out, in)."""
    from bench_gpu import SHAPES

    s = SHAPES[shape]
    hidden, inter = s["hidden_size"], s["intermediate_size"]
    qkv = (s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * (hidden // s["num_attention_heads"])
    return {"qkv": (qkv, hidden), "o": (hidden, hidden), "gate_up": (2 * inter, hidden), "down": (hidden, inter)}


SWEEP = [dict(block_n=n, stages=stages, warps=warps) for n in (64, 128, 256) for stages in (2, 3, 4)
         for warps in (4, 8)]


def sweep(shape: str, formats: list[str], row_counts: list[int], out: dict) -> None:
    """Every launch of SWEEP for each product, format and row count (each with plan()'s input splits, and with half
    and twice as many), beside the widened weight through cuBLAS; prints the fastest few and plan()'s."""
    from flared.model.kernels import wquant
    from flared.model.quant import GPU_TURN, gpu_quantize

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in matrices(shape).items():
        weight = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        for fmt in formats:
            parts = gpu_quantize(fmt, weight)
            padded = -(-k // GPU_TURN[fmt]) * GPU_TURN[fmt]  # (the layout's inputs: whole turns)
            for m in row_counts:
                x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
                timings = {"widen + cuBLAS": time_us(lambda: torch.matmul(x, wquant.widen(fmt, parts)[:k]))}
                if m < wquant.WIDEN_MIN_ROWS:
                    timings["plan"] = time_us(lambda: wquant.linear(x, fmt, parts,
                                                                    launch=wquant.plan(m, n, padded, sms, fmt)))
                turns = padded // GPU_TURN[fmt]
                for kw in SWEEP:
                    base = wquant.plan(m, n, padded, sms, fmt, **kw)
                    for splits in {base.splits, max(1, base.splits // 2), 2 * base.splits}:
                        launch = base._replace(splits=splits)
                        if turns % splits:
                            continue
                        try:
                            timings[str(tuple(launch))] = time_us(lambda: wquant.linear(x, fmt, parts,
                                                                                        launch=launch))
                        except Exception as error:  # (a tile too large for the multiprocessor's memory)
                            print(f"  {launch}: {type(error).__name__}", flush=True)
                best = sorted(timings.items(), key=lambda kv: kv[1])
                print(f"{name:8} {fmt} {m:4} rows: plan {timings.get('plan', float('nan')):.1f} us; best "
                      + "; ".join(f"{key} {us:.1f}" for key, us in best[:4]), flush=True)
                out[f"sweep|{name}|{fmt}|{m}"] = {key: round(us, 1) for key, us in best}


def serving_runs(shape: str, formats: list[str], rows: list, out: dict, new_tokens: int = 256,
                 prompt_len: int = 128) -> None:
    from bench_gpu import CONCURRENCY, SHAPES, graph_executor, make_hf, prompts, run_flared, serving

    vocab = SHAPES[shape]["vocab_size"]
    hf = make_hf(shape, torch.bfloat16)
    for fmt in ["bf16", *formats]:
        before = torch.cuda.memory_allocated()
        model = serving(hf, torch.bfloat16, quantization=None if fmt == "bf16" else fmt)
        held = torch.cuda.memory_allocated() - before  # (bf16 shares the unfused matrices with transformers')
        products_bytes = sum(lin.nbytes for layer in model.layers for lin in model._linears(layer))
        pair = graph_executor(model)
        try:
            run_flared(model, prompts(vocab, 1, prompt_len, seed=40), 16, ex_pair=pair)  # (warm-up)
            r = run_flared(model, prompts(vocab, 1, prompt_len, seed=4), new_tokens, ex_pair=pair)
            one = (new_tokens - 1) / ((r.finish_ns[0] - r.first_token_ns[0]) / 1e9)
            one_gpu = r.decode_gpu_ns / max(1, r.steps_by_kind["DECODE"]) / 1e3
            run_flared(model, prompts(vocab, CONCURRENCY, prompt_len, seed=50), 4, ex_pair=pair)
            r = run_flared(model, prompts(vocab, CONCURRENCY, prompt_len, seed=5), new_tokens, ex_pair=pair)
            many = CONCURRENCY * new_tokens / (r.wall_ns / 1e9)
            many_gpu = r.decode_gpu_ns / max(1, r.steps_by_kind["DECODE"]) / 1e3
            prefill_ms = (r.gpu_ns - r.decode_gpu_ns) / 1e6
        finally:
            pair[1].close()
        rows.append((shape, fmt, f"{products_bytes / 2**30:.2f}", f"{one:,.0f} ({one_gpu:,.0f} us)",
                     f"{many:,.0f} ({many_gpu:,.0f} us, prefill {prefill_ms:.0f} ms)", f"{held / 2**30:.2f}"))
        print(f"{shape} {fmt}: layer products {products_bytes / 2**30:.2f} GiB; 1 stream {one:,.0f} tok/s "
              f"({one_gpu:,.0f} us/step); 64 streams {many:,.0f} tok/s ({many_gpu:,.0f} us/step, prefill "
              f"{prefill_ms:.0f} ms)", flush=True)
        out[f"{shape}|{fmt}"] = {"products_gib": round(products_bytes / 2**30, 3), "b1_tok_s": round(one, 1),
                                 "b1_step_us": round(one_gpu, 1), "b64_tok_s": round(many, 1),
                                 "b64_step_us": round(many_gpu, 1), "b64_prefill_ms": round(prefill_ms, 1),
                                 "model_gib": round(held / 2**30, 3)}
        del model, pair
        gc.collect()
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8b")
    ap.add_argument("--formats", default="q4_1,q8_0")
    ap.add_argument("--rows", default="1,16,64,256,2048")
    ap.add_argument("--sweep", action="store_true", help="time every launch of SWEEP instead (then exit)")
    ap.add_argument("--skip-products", action="store_true")
    ap.add_argument("--skip-serving", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    formats = args.formats.split(",")
    out: dict = {"device": torch.cuda.get_device_name()}
    product_rows: list = []
    serving_rows: list = []
    for shape in args.shapes.split(","):
        if args.sweep:
            sweep(shape, formats, [int(r) for r in args.rows.split(",")], out)
            continue
        if not args.skip_products:
            products(shape, formats, [int(r) for r in args.rows.split(",")], product_rows, out)
        if not args.skip_serving:
            serving_runs(shape, formats, serving_rows, out)
    print(f"\n{out['device']}")
    if product_rows:
        print("| product | rows | bf16 us | " + " | ".join(f"{f} us (speed-up, weight TB/s)" for f in formats) + " |")
        print("| --- | ---: | ---: | " + " | ".join("---:" for _ in formats) + " |")
        for row in product_rows:
            print("| " + " | ".join(str(c).strip() for c in row) + " |")
    if serving_rows:
        print("\n| shape | weights | layer products GiB | 1 stream tok/s (GPU us a step) | 64 streams tok/s "
              "(GPU us a step, prefill) | model GiB on the GPU |")
        print("| --- | --- | ---: | ---: | ---: | ---: |")
        for row in serving_rows:
            print("| " + " | ".join(row) + " |")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
