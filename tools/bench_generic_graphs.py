"""Families outside the Llama layer on a GPU: the CUDA graphs over their own torch layers (kernels/paged_decoder.py's
generic decoder) against the eager executor they were served by before, and transformers' generate(), in one run.

    python3 tools/bench_generic_graphs.py [--shapes qwen3_moe,gemma3,phi4_mini] [--streams 1,64] [--json]

Random bf16 weights of each shape; each stream a 128-token prompt and --new-tokens greedy tokens (every one
generated: no end token), output tok/s over the whole run, prefill included, as bench_gpu.py counts them. The
"same" column: the streams whose tokens the graphs and the eager executor agree on from first to last (bf16:
near-ties may part them).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

# model_type, config fields, what it is
SHAPES = {
    "qwen3_moe": ("qwen3_moe", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                    moe_intermediate_size=768, num_hidden_layers=8, num_attention_heads=32,
                                    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                    norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False),
                  "Qwen3-30B-A3B, 8 of its 48 layers"),
    "gemma3": ("gemma3_text", dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                                   num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                                   query_pre_attn_scalar=256, max_position_embeddings=4096,
                                   tie_word_embeddings=True), "Gemma-3-1B"),
    "phi4_mini": ("phi3", dict(vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                               num_attention_heads=24, num_key_value_heads=8, partial_rotary_factor=0.75,
                               max_position_embeddings=4096, tie_word_embeddings=True), "Phi-4-mini (3.8B)"),
    "gpt_oss": ("gpt_oss", dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=8,
                                num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                                num_experts_per_tok=4, sliding_window=128, max_position_embeddings=4096,
                                layer_types=["sliding_attention", "full_attention"] * 4, tie_word_embeddings=False),
                "gpt-oss-20b in bf16, 8 of its 24 layers"),
    "gemma2": ("gemma2", dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                              num_attention_heads=8, num_key_value_heads=4, head_dim=256, sliding_window=4096,
                              query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                              max_position_embeddings=8192, tie_word_embeddings=True), "Gemma-2-2B"),
}
PROMPT = 128


def make_hf(shape: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields, _ = SHAPES[shape]
    cfg = AutoConfig.for_model(model_type, **fields, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            hf = AutoModelForCausalLM.from_config(cfg).eval()
    finally:
        torch.set_default_dtype(previous)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


def eager_executor(model, concurrency: int):
    from bench_gpu import CONTEXT_TOKENS, PAGE_TOKENS, scheduler

    from flared.execution.eager import EagerExecutor

    num_pages = max(64, concurrency * CONTEXT_TOKENS // PAGE_TOKENS // 4)
    ex = EagerExecutor(model, num_pages=num_pages, page_tokens=PAGE_TOKENS, num_state_rows=concurrency + 1,
                       num_snapshots=4 * concurrency, vocab_size=model.config.vocab_size, max_live=concurrency)
    sched, _ = scheduler(concurrency, num_pages)
    return sched, ex


def timed(make, prompts, new_tokens: int):
    """(tokens, tok/s, seconds to build) of a fresh scheduler and executor from ``make``, after a short warm run."""
    from bench_gpu import greedy

    from flared.execution.offline import drive

    t = time.perf_counter()
    sched, ex = make()
    build = time.perf_counter() - t
    try:
        drive(sched, ex, prompts[:2], [greedy(4)] * 2)
        torch.cuda.synchronize()
        t = time.perf_counter()
        result = drive(sched, ex, prompts, [greedy(new_tokens)] * len(prompts))
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t
    finally:
        close = getattr(ex, "close", None)
        if close is not None:
            close()
    return result.tokens, len(prompts) * new_tokens / elapsed, build


def bench_shape(shape: str, streams: list[int], new_tokens: int, rows: list, out: dict) -> None:
    from bench_gpu import graph_executor, hf_generate, prompts, serving

    hf = make_hf(shape)
    model = serving(hf, torch.bfloat16)
    c = model.config
    for n in streams:
        ps = prompts(c.vocab_size, n, PROMPT)
        row = {"shape": shape, "streams": n}
        try:
            graph_tokens, row["graphs"], row["capture_s"] = timed(lambda: graph_executor(model, concurrency=n), ps,
                                                                  new_tokens)
            eager_tokens, row["eager"], _ = timed(lambda: eager_executor(model, n), ps, new_tokens)
            row["same"] = sum(a == b for a, b in zip(graph_tokens, eager_tokens))
            hf_generate(hf, ps[:1], 4)
            _, seconds = hf_generate(hf, ps, new_tokens)
            row["hf"] = n * new_tokens / seconds
        except Exception as exc:  # noqa: BLE001 - one row's failure is reported, the others still run
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        out[f"{shape}_{n}"] = row
        print(json.dumps(row), flush=True)
    del model, hf
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3_moe,gemma3,phi4_mini")
    ap.add_argument("--streams", default="1,64")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows, out = [], {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for shape in args.shapes.split(","):
        bench_shape(shape, [int(s) for s in args.streams.split(",")], args.new_tokens, rows, out)
    print(f"\n{'shape':<34} {'streams':>7} {'graphs':>9} {'eager':>9} {'transformers':>12} {'g/eager':>8} "
          f"{'g/hf':>6} {'same':>5}")
    for r in rows:
        name = f"{r['shape']} ({SHAPES[r['shape']][2]})"
        if "error" in r:
            print(f"{name:<34} {r['streams']:>7} error: {r['error']}")
            continue
        print(f"{name:<34} {r['streams']:>7} {r['graphs']:>9.1f} {r['eager']:>9.1f} {r['hf']:>12.1f} "
              f"{r['graphs'] / r['eager']:>7.2f}x {r['graphs'] / r['hf']:>5.2f}x {r['same']:>3}/{r['streams']}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
