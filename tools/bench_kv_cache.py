#!/usr/bin/env python
"""The KV cache's element type on the CPU: a float8 cache (``--kv-cache-dtype fp8``) against the model's dtype, in
one run.

The embedded SmolLM2-135M-Instruct (the GGUF, dequantised) in bf16 (or ``--dtype``) behind the scheduler and the eager executor
(what ``flared run`` serves on a CPU). Each stream gets its own random prompt of ``--prompt`` tokens and generates
``--tokens`` greedy tokens; decode tok/s counts the tokens after each stream's first over the decode phase (from
the last first token to the last token), so the prompts' prefill is left out. Each figure is the best of
``--repeats``, the two caches alternating. Also: the KV cache's bytes and how many streams' first tokens equal the
model-dtype cache's (later tokens part where float8's rounding flips a near-tie).

The Cython kernels (flared/_fast/attention.pyx, decode.pyx) read a float8 cache in place, widening each row as they
load it. ``--dtype float32`` runs the model in float32 (no one-call decode step; the portable attention task).

    .venv/bin/python tools/bench_kv_cache.py [--prompt 1024] [--tokens 64] [--streams 1,8] [--repeats 3]
                                             [--dtype bfloat16|float32] [--json]

Prints a table; with --json, one JSON object as the last line. The GPU's figures: tools/bench_gpu.py --ab-env
FLARED_BENCH_KV_CACHE_DTYPE=fp8 and tools/bench_decode_step.py --kv-cache-dtype fp8.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lora_cpu import CONTEXT, load_model, load_source  # noqa: E402  the embedded model, its GGUF


def run(model, prompts, tokens: int, kv_cache_dtype: str) -> dict:
    from flared.execution.eager import EagerExecutor
    from flared.execution.offline import drive
    from flared.model.sampling import SamplingParams
    from flared.scheduler import PolicyConfig, RequestScheduler, SchedulerConfig

    n = len(prompts)
    context = max(len(p) for p in prompts) + tokens + 16
    pages = n * -(-context // 16)
    sched = RequestScheduler(SchedulerConfig(
        model_identity=hashlib.sha256(b"bench-kv").digest(), max_live_requests=n, num_pages=pages,
        num_snapshots=4 * n, page_tokens=16, context_capacity=context, prefill_chunk_size=512), PolicyConfig())
    ex = EagerExecutor(model, num_pages=pages, page_tokens=16, num_state_rows=n + 1, num_snapshots=4 * n,
                       vocab_size=model.config.vocab_size, max_live=n, kv_cache_dtype=kv_cache_dtype)
    params = [SamplingParams(temperature=0.0, max_tokens=tokens)] * n  # drive() stops at max_tokens only
    r = drive(sched, ex, prompts, params)
    decode_ns = max(r.finish_ns) - max(r.first_token_ns)
    return {"tok_s": n * (tokens - 1) / (decode_ns / 1e9), "tokens": r.tokens, "kv_bytes": ex.kv_cache[1]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens a stream")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens a stream")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="the model's (float32: a CPU without AVX-512 BF16 serves the embedded model so)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.dtype == "bfloat16":
        model = load_model()
    else:
        from flared.model.decoder import DecoderModel

        source = load_source()
        model = DecoderModel(source.config, source.tensors, dtype=torch.float32, max_positions=CONTEXT)
    vocab = model.config.vocab_size
    out = {"prompt": args.prompt, "tokens": args.tokens, "threads": torch.get_num_threads(), "dtype": args.dtype}
    print(f"{'streams':>7} {'auto tok/s':>11} {'fp8 tok/s':>10} {'ratio':>6} {'auto KV MiB':>12} {'fp8 KV MiB':>11} "
          f"{'first tokens equal':>19}")
    for streams in (int(s) for s in args.streams.split(",")):
        g = torch.Generator().manual_seed(streams)
        prompts = torch.randint(3, vocab, (streams, args.prompt), generator=g).tolist()
        for kv in ("auto", "fp8"):
            run(model, prompts, 4, kv)  # warm both paths
        best: dict[str, dict] = {}
        for _ in range(args.repeats):
            for kv in ("auto", "fp8"):
                got = run(model, prompts, args.tokens, kv)
                if kv not in best or got["tok_s"] > best[kv]["tok_s"]:
                    best[kv] = got
        auto, fp8 = best["auto"], best["fp8"]
        firsts = sum(a[0] == b[0] for a, b in zip(auto["tokens"], fp8["tokens"]))
        ratio = fp8["tok_s"] / auto["tok_s"]
        print(f"{streams:>7} {auto['tok_s']:11.1f} {fp8['tok_s']:10.1f} {ratio:6.2f} {auto['kv_bytes'] / 2**20:12.1f} "
              f"{fp8['kv_bytes'] / 2**20:11.1f} {firsts:>15}/{streams}", flush=True)
        out[str(streams)] = {"auto_tok_s": round(auto["tok_s"], 1), "fp8_tok_s": round(fp8["tok_s"], 1),
                             "ratio": round(ratio, 3), "auto_kv_bytes": auto["kv_bytes"],
                             "fp8_kv_bytes": fp8["kv_bytes"], "first_tokens_equal": firsts}
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
