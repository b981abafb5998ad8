"""Per-request LoRA on the GPU: output tok/s of streams under an adapter through the CUDA graph executor, beside
the same streams on an executor without adapters, all in one run.

Random bf16 weights of each shape (SmolLM2-135M, Llama-3.1-8B) and a random rank-``--rank`` adapter on every
product of every layer (q and v of qkv, o, gate and up, down), stacked for the graphs
(kernels/lora_rows.StackedLora). Three ways to run the same greedy streams (``--prompt``-token prompts,
``--tokens`` new tokens, admitted together after a warm-up):

- ``no adapters``: the executor the daemon builds without --lora-modules (its fastest paths: the megakernel,
  skinny kernels, products64, as calibrated);
- ``adapter loaded, base rows``: the executor with the adapter stacked, every stream on the base weights (what
  loading an adapter costs the streams that do not use it: the fast paths turn off, the masked low-rank
  products still run);
- ``adapter rows``: the same executor, every stream under the adapter.

With ``--slots N`` two more: the executor the daemon builds with --allow-runtime-lora-updating --max-loras N
--max-lora-rank RANK (N empty slots in every product of every layer, StackedLora's slots), the adapter written
into one after capture (GraphExecutor.install_lora, as POST /v1/load_lora_adapter does): ``slots, base rows``
and ``slots, adapter rows`` (what the room for adapters loaded while serving costs).

tok/s = streams x tokens over the whole run (prefill included), best of ``--repeats``, the variants alternating.
"tokens = no adapters" counts the streams whose tokens equal the first variant's: base rows on the adapter
executor run other kernels (bf16 near-ties may part them), adapter rows must differ.

    python3 tools/bench_lora_gpu.py [--shapes 135m,8b] [--rank 16] [--streams 1,64] [--tokens 256] [--slots 4]
                                    [--json]

CUDA only. Prints a table; with --json, one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import SHAPES, graph_executor, greedy, make_hf, prompts, serving  # noqa: E402
from bench_lora_cpu import adapter_factors  # noqa: E402


def run(pair, prompt_list, tokens: int, adapter: int):
    from flared.execution.offline import drive

    sched, ex = pair
    r = drive(sched, ex, prompt_list, [greedy(tokens)] * len(prompt_list), loras=[adapter] * len(prompt_list))
    return len(prompt_list) * tokens / (r.wall_ns / 1e9), r.tokens


@torch.inference_mode()
def bench_shape(shape: str, args, rows: list, out: dict) -> None:
    from flared.model.kernels.lora_rows import StackedLora

    hf = make_hf(shape, torch.bfloat16)
    model = serving(hf, torch.bfloat16)
    del hf
    torch.cuda.empty_cache()
    factors = adapter_factors(model.config, args.rank, seed=1, scale=0.1)
    stacked = StackedLora(model.config, [factors], dtype=torch.bfloat16, device=model.device)
    concurrency = max(args.streams)
    pairs = {"no adapters": graph_executor(model, concurrency),
             "with": graph_executor(model, concurrency, lora=stacked)}
    variants = (("no adapters", "no adapters", 0), ("adapter loaded, base rows", "with", 0),
                ("adapter rows", "with", 1))
    if args.slots:
        room = StackedLora(model.config, [], dtype=torch.bfloat16, device=model.device, slots=args.slots,
                           slot_width=3 * args.rank)
        pairs["slots"] = graph_executor(model, concurrency, lora=room)
        pairs["slots"][1].install_lora(factors, 1)
        torch.cuda.synchronize()
        out[f"{shape}_slots_mb"] = round(room.nbytes / 1e6, 1)
        variants += (("slots, base rows", "slots", 0), ("slots, adapter rows", "slots", 1))
    vocab = SHAPES[shape]["vocab_size"]
    try:
        for streams in args.streams:
            p = prompts(vocab, streams, args.prompt, seed=5)
            warm = prompts(vocab, streams, args.prompt, seed=50)
            for _, key, adapter in variants:
                run(pairs[key], warm, 4, adapter)
            best, toks = {}, {}
            for _ in range(args.repeats):
                for name, key, adapter in variants:
                    tok_s, tokens = run(pairs[key], p, args.tokens, adapter)
                    best[name] = max(best.get(name, 0.0), tok_s)
                    toks[name] = tokens
            ref = toks["no adapters"]
            for name, _, _ in variants:
                same = sum(a == b for a, b in zip(toks[name], ref))
                rows.append((shape, streams, name, best[name], best[name] / best["no adapters"], f"{same}/{streams}"))
                out[f"{shape}|{streams}|{name}"] = {"tok_s": round(best[name], 1), "same_tokens": same}
    finally:
        for _, ex in pairs.values():
            ex.close()
    out[f"{shape}_stacked_mb"] = round(stacked.nbytes / 1e6, 1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="135m,8b")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--streams", default="1,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--slots", type=int, default=0, help="also the executor with this many adapter slots")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.streams = [int(s) for s in args.streams.split(",")]
    rows: list = []
    out = {"device": torch.cuda.get_device_name(), "rank": args.rank, "prompt": args.prompt, "tokens": args.tokens,
           "slots": args.slots}
    print(f"{'shape':6} {'streams':>7}  {'variant':28} {'tok/s':>10} {'vs none':>8}  tokens = no adapters")
    for shape in args.shapes.split(","):
        rows.clear()
        bench_shape(shape, args, rows, out)
        for _, streams, name, tok_s, ratio, same in rows:
            print(f"{shape:6} {streams:>7}  {name:28} {tok_s:10,.0f} {ratio:8.2f}  {same}", flush=True)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
