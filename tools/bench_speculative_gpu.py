"""Speculative decoding by prompt lookup on the GPU: greedy streams (or sampled ones, ``--temperature``, each
stream seeded with its index) through the CUDA graph executor with
``--draft`` drafts a step (each speculative step a decode graph, a row per fed token) against the same streams
without, in one run.

Random bf16 weights of each shape (bench_gpu's). Prompts: ``--prompt`` tokens, a random run of a quarter of that
repeated four times, so the lookup finds drafts; what the random model then keeps is what it keeps (reported).
tok/s = streams x tokens over the whole run (prefill included), best of ``--repeats``, the two alternating; "same"
counts the streams whose tokens equal plain decoding's (bf16: the verify step's graph rounds otherwise
than the decode graphs, so near-ties may part them; float32 equality is tests/cuda/test_speculative_gpu.py's).
A random model's logits are flat (135M: about 0.5 apart, so at temperature 0.7 its likeliest token has a chance
of 0.0002, where a trained model's on repeated text is near 1): sampled runs here use temperatures like 0.03
(likeliest token ~0.65) to stand for a trained model's draws.

    python3 tools/bench_speculative_gpu.py [--shapes 135m,8b] [--streams 1,4] [--draft 4] [--tokens 256]
        [--temperature 0.03 --top-p 0.9] [--json]

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

from bench_gpu import SHAPES, graph_executor, greedy, make_hf, serving  # noqa: E402


def repeating_prompts(vocab: int, streams: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(streams):
        run = torch.randint(3, vocab, (max(1, length // 4),), generator=g).tolist()
        out.append((run * 4)[:length])
    return out


def run(pair, prompts, tokens: int, speculate: bool, temperature: float = 0.0, top_p: float = 1.0) -> dict:
    from flared.execution.offline import drive
    from flared.model.sampling import SamplingParams

    sched, ex = pair
    before = dict(sched.counters)
    params = ([greedy(tokens)] * len(prompts) if temperature == 0 else
              [SamplingParams(temperature=temperature, top_p=top_p, seed=i, max_tokens=tokens)
               for i in range(len(prompts))])
    r = drive(sched, ex, prompts, params, speculate=speculate)
    return {"tok_s": len(prompts) * tokens / (r.wall_ns / 1e9), "tokens": r.tokens,
            "steps": r.steps_by_kind["DECODE"] + r.steps_by_kind["SPECULATIVE"],
            "spec_steps": r.steps_by_kind["SPECULATIVE"], "gpu_us": r.gpu_ns / 1e3, "host_us": r.host_ns / 1e3,
            "drafted": sched.counters["speculative_drafted"] - before.get("speculative_drafted", 0),
            "accepted": sched.counters["speculative_accepted"] - before.get("speculative_accepted", 0)}


@torch.inference_mode()
def bench_shape(shape: str, args, out: dict) -> list:
    hf = make_hf(shape, torch.bfloat16)
    model = serving(hf, torch.bfloat16)
    del hf
    torch.cuda.empty_cache()
    concurrency = max(args.streams)
    plain = graph_executor(model, concurrency)
    spec = graph_executor(model, concurrency, speculative_tokens=args.draft)
    vocab = SHAPES[shape]["vocab_size"]
    rows = []
    try:
        for streams in args.streams:
            p = repeating_prompts(vocab, streams, args.prompt, seed=7)
            run(plain, repeating_prompts(vocab, streams, args.prompt, seed=70), 8, False)
            run(spec, repeating_prompts(vocab, streams, args.prompt, seed=71), 8, True)
            best = {}
            for _ in range(args.repeats):
                for name, pair, on in (("plain", plain, False), ("spec", spec, True)):
                    r = run(pair, p, args.tokens, on, args.temperature, args.top_p)
                    if r["tok_s"] > best.get(name, {"tok_s": 0})["tok_s"]:
                        best[name] = r
            same = sum(a == b for a, b in zip(best["spec"]["tokens"], best["plain"]["tokens"]))
            row = {"plain_tok_s": round(best["plain"]["tok_s"], 1), "spec_tok_s": round(best["spec"]["tok_s"], 1),
                   "ratio": round(best["spec"]["tok_s"] / best["plain"]["tok_s"], 3),
                   "plain_steps": best["plain"]["steps"], "spec_steps": best["spec"]["steps"],
                   "speculative_steps": best["spec"]["spec_steps"], "drafted": best["spec"]["drafted"],
                   "accepted": best["spec"]["accepted"], "same_tokens": same,
                   # GPU and host time a step (drive's gpu_ns and host_ns over its steps)
                   **{f"{k}_{t}_us_per_step": round(best[k][f"{t}_us"] / best[k]["steps"], 1)
                      for k in ("plain", "spec") for t in ("gpu", "host")}}
            out[f"{shape}|{streams}"] = row
            rows.append((shape, streams, row))
    finally:
        plain[1].close()
        spec[1].close()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="135m,8b")
    ap.add_argument("--streams", default="1,4")
    ap.add_argument("--draft", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy streams")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.streams = [int(s) for s in args.streams.split(",")]
    out = {"device": torch.cuda.get_device_name(), "draft": args.draft, "prompt": args.prompt, "tokens": args.tokens,
           "temperature": args.temperature, "top_p": args.top_p}
    print(f"{'shape':6} {'streams':>7} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} {'steps':>12} "
          f"{'kept/fed':>10} same  {'GPU/host us a step, plain':>25} {'spec':>13}")
    for shape in args.shapes.split(","):
        for _, streams, r in bench_shape(shape, args, out):
            print(f"{shape:6} {streams:>7} {r['plain_tok_s']:11,.0f} {r['spec_tok_s']:10,.0f} {r['ratio']:6.2f} "
                  f"{r['plain_steps']:>5} -> {r['spec_steps']:<4} {r['accepted']:>4}/{r['drafted']:<5} "
                  f"{r['same_tokens']}/{streams}  {r['plain_gpu_us_per_step']:>12,.0f} / "
                  f"{r['plain_host_us_per_step']:<10,.0f}{r['spec_gpu_us_per_step']:>6,.0f} / "
                  f"{r['spec_host_us_per_step']:<6,.0f}", flush=True)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
