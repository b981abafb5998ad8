#!/usr/bin/env python
"""Per-request LoRA on the CPU: decode tok/s of streams under an adapter through the one-call bf16 decode step
(its LoRA terms, flared/_fast/decode_kernel.h) against the same streams on the per-op path (how adapter rows ran
before), with the base model's streams as the reference, all in one run.

The embedded SmolLM2-135M-Instruct (the GGUF, dequantised) in bf16 behind the scheduler and the eager executor
(what ``flared run`` serves on a CPU), a random rank-``--rank`` adapter on every product of every layer (q and v
of qkv, o, gate and up, down), registered as a per-request adapter (DecoderModel.add_lora_module). Greedy decode
of ``--tokens`` tokens from 8-token prompts; decode tok/s = streams x (tokens - 1) over the time from the first
stream's first token to the last token. Each figure is the best of ``--repeats``, the variants alternating (the
machine may be shared). The adapter's tokens from both paths are compared position by position: both are bf16
and sum the low-rank products in different orders, so a stream's tokens part at the first near-tie and differ
after it (the same holds between any two bf16 summation orders; only float32 is held to token parity). Then the
two paths' logits on the same tokens (teacher-forced, 8 rows x 64 steps), against each other and against a
float32 copy of the weights and adapter.

    .venv/bin/python tools/bench_lora_cpu.py [--rank 16] [--tokens 64] [--streams 1,8] [--repeats 3] [--json]

Prints a table; with --json, one JSON object as the last line. Needs AVX-512 BF16 (the one-call step).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import CONTEXT_TOKENS as CONTEXT, PAGE_TOKENS, scheduler  # noqa: E402  the benchmarks' scheduler


def load_source():
    from bench_model import gguf_path  # the embedded GGUF's path (this directory)

    from flared.model.loader import read_source

    return read_source(gguf_path())


def load_model():
    from flared.model.decoder import DecoderModel

    source = load_source()
    model = DecoderModel(source.config, source.tensors, dtype=torch.bfloat16, max_positions=CONTEXT)
    if not model.fused_decode:
        raise SystemExit("the one-call bf16 decode step does not run here (no AVX-512 BF16)")
    return model


def adapter_factors(config, rank: int, *, seed: int | None = None, scale: float = 0.05,
                    products=("qkv", "o", "down", "gate_up")) -> dict:
    """A random adapter on ``products`` of every layer (qkv: its q and v parts; gate_up: both), as lora_factors
    gives one: A scaled to unit-size outputs, B by ``scale`` (0.05 changes the text; tests/model use larger)."""
    c = config
    g = torch.Generator().manual_seed(rank if seed is None else seed)
    spans = {"qkv": [(0, c.q_size, c.hidden_size), (c.q_size + c.kv_size, c.kv_size, c.hidden_size)],
             "o": [(0, c.hidden_size, c.q_size)], "down": [(0, c.hidden_size, c.intermediate_size)],
             "gate_up": [(0, c.intermediate_size, c.hidden_size),
                         (c.intermediate_size, c.intermediate_size, c.hidden_size)]}
    return {f"layers.{layer}.{product}.weight": [
        (row, count, torch.randn(rank, width, generator=g) / width ** 0.5,
         torch.randn(count, rank, generator=g) * scale) for row, count, width in spans[product]]
        for layer in range(c.num_layers) for product in products}


def agreement(model, adapter: int, reference, ref_adapter: int, rows: int = 8, steps: int = 64) -> dict:
    """The two paths' logits on the same tokens: ``rows`` adapter rows prefilled, then ``steps`` decode steps
    fed the one-call path's greedy tokens, each step run by both paths and by ``reference`` (a float32 copy of
    the weights and adapter), each with a KV cache of its own. Gives the largest difference between the two
    paths over the steps and each path's largest difference from the reference (over the largest logit), and
    the argmax flips between the two paths."""
    from flared.model.batch import ForwardBatch, SequenceChunk
    from flared.model.decoder import FUSED_LORA

    entry = model.lora_modules[adapter - 1]
    table = entry[FUSED_LORA]
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, model.config.vocab_size, (8,), generator=g).tolist() for _ in range(rows)]
    tables = [list(range(8 * r, 8 * r + 8)) for r in range(rows)]
    paths = {"one_call": (model, adapter, table), "per_op": (model, adapter, None), "fp32": (reference, ref_adapter,
                                                                                            None)}
    kvs = {name: m.make_kv_cache(num_pages=8 * rows, page_tokens=PAGE_TOKENS) for name, (m, _, _) in paths.items()}

    def forward(name, chunks, group_rows):
        m, a, fused = paths[name]
        if m is model:
            entry[FUSED_LORA] = fused
        batch = ForwardBatch.build(chunks, page_tokens=PAGE_TOKENS)
        batch.lora_groups = [(a, torch.arange(group_rows))]
        try:
            return m.forward(batch, kvs[name]).double()
        finally:
            entry[FUSED_LORA] = table

    for name in paths:
        last = forward(name, [SequenceChunk(p, 0, t) for p, t in zip(prompts, tables)], 8 * rows)
    tokens, lens = last.argmax(-1).tolist(), [len(p) for p in prompts]
    worst = {"one_call_vs_per_op": 0.0, "one_call_vs_fp32": 0.0, "per_op_vs_fp32": 0.0}
    flips = 0
    for step in range(steps):
        chunks = [SequenceChunk([t], n, tb) for t, n, tb in zip(tokens, lens, tables)]
        out = {name: forward(name, chunks, rows) for name in paths}
        scale = out["fp32"].abs().max().item()
        for pair in worst:
            a, b = pair.split("_vs_")
            worst[pair] = max(worst[pair], (out[a] - out[b]).abs().max().item() / scale)
        flips += int((out["one_call"].argmax(-1) != out["per_op"].argmax(-1)).sum())
        tokens, lens = out["one_call"].argmax(-1).tolist(), [n + 1 for n in lens]
    return {"rows": rows, "steps": steps, "argmax_flips": flips, **worst}


def executor(model, streams: int):
    from flared.execution.eager import EagerExecutor

    sched, num_pages = scheduler(streams, streams * 1024 // PAGE_TOKENS)  # 1,024 tokens a stream
    ex = EagerExecutor(model, num_pages=num_pages, page_tokens=PAGE_TOKENS, num_state_rows=streams + 1,
                       num_snapshots=4 * streams, vocab_size=model.config.vocab_size, max_live=streams)
    return sched, ex


def run(model, pair, streams: int, tokens: int, adapter: int, seed: int):
    """(decode tok/s, token lists) for ``streams`` fresh prompts (a new seed each run: no prefix-cache hits)."""
    from flared.execution.offline import drive
    from flared.model.sampling import SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, model.config.vocab_size, (8,), generator=g).tolist() for _ in range(streams)]
    params = [SamplingParams(temperature=0, max_tokens=tokens)] * streams
    r = drive(*pair, prompts, params, loras=[adapter] * streams)
    span = (max(r.finish_ns) - min(r.first_token_ns)) / 1e9
    return streams * (tokens - 1) / span, r.tokens


def main(argv=None) -> int:
    from flared.model.decoder import FUSED_LORA

    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = load_model()
    factors = adapter_factors(model.config, args.rank)
    adapter = model.add_lora_module(factors)
    entry = model.lora_modules[adapter - 1]
    table = entry[FUSED_LORA]
    out = {"rank": args.rank, "tokens": args.tokens, "threads": torch.get_num_threads(), "streams": {}}
    print(f"SmolLM2-135M bf16, {torch.get_num_threads()} threads, a rank-{args.rank} adapter on every product, "
          f"{args.tokens} tokens a stream; decode tok/s, best of {args.repeats}")
    print(f"{'streams':>7} {'base':>9} {'adapter, one-call step':>23} {'adapter, per-op path':>21} {'ratio':>7}"
          f" {'same tokens':>13}")
    for streams in (int(s) for s in args.streams.split(",")):
        pair = executor(model, streams)
        run(model, pair, streams, 8, adapter, seed=999)  # warm-up: buffers for this row count
        best = {"base": 0.0, "fused": 0.0, "per_op": 0.0}
        same = []
        for rep in range(args.repeats):
            for name in best:
                entry[FUSED_LORA] = None if name == "per_op" else table
                tps, toks = run(model, pair, streams, args.tokens, 0 if name == "base" else adapter, seed=rep)
                best[name] = max(best[name], tps)
                if name == "fused":
                    fused_tokens = toks
                elif name == "per_op":
                    same.append(sum(a == b for x, y in zip(fused_tokens, toks) for a, b in zip(x, y)))
        entry[FUSED_LORA] = table
        ratio = best["fused"] / best["per_op"]
        print(f"{streams:7d} {best['base']:9.1f} {best['fused']:23.1f} {best['per_op']:21.1f} {ratio:6.2f}x"
              f" {min(same):>6}/{streams * args.tokens}")
        out["streams"][streams] = {"base_tok_s": best["base"], "lora_fused_tok_s": best["fused"],
                                   "lora_per_op_tok_s": best["per_op"], "fused_over_per_op": ratio,
                                   "tokens_equal": min(same), "tokens": streams * args.tokens}
    from flared.model.decoder import DecoderModel

    reference = DecoderModel(model.config, load_source().tensors, dtype=torch.float32, max_positions=CONTEXT)
    agree = agreement(model, adapter, reference, reference.add_lora_module(factors))
    out["agreement"] = agree
    print(f"logits, teacher-forced, {agree['rows']} adapter rows x {agree['steps']} steps, the largest difference "
          f"over the largest logit: one-call vs per-op {agree['one_call_vs_per_op']:.2%} "
          f"({agree['argmax_flips']} argmax flips of {agree['rows'] * agree['steps']}); against a float32 copy: "
          f"one-call {agree['one_call_vs_fp32']:.2%}, per-op {agree['per_op_vs_fp32']:.2%}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
