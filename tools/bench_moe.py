#!/usr/bin/env python
"""Decode throughput of a mixture-of-experts model: flared's runtime against transformers' ``generate``.

Both sides build the same random-weight Qwen3-MoE (or, with ``--family``, a gpt-oss, GLM-4.5 or Llama 4 of the same
sizes: their routers, biases, activations and shared expert; Llama 4 routes a token to one expert, as released, its
chunked attention, q/k norms and unrotated layers included; a shape below, fewer layers with ``--layers``) and run greedy
decoding of the same token ids in the same dtype, on the CPU or on the GPU (``--device cuda``: flared's eager
executor path, the one a GPU machine serves experts with; there also "flared (expert loop)", the same runner with
DecoderModel.grouped_experts off), alternately in one process. Decode tok/s counts each
batch's N-1 decode tokens over the decode phase only (tools/bench_model.py's method), best of ``--repeats``.

    .venv/bin/python tools/bench_moe.py [--shape small] [--batches 1,8] [--json]           (the CPU figures)
    python3 tools/bench_moe.py --device cuda --shape 30b-a3b --layers 12 --dtype bfloat16 --json   (on the GPU)

Prints a table; with ``--json`` the last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_model import decode_tok_s, time_hf, time_ours  # noqa: E402

from flared.model.loader import _hf_to_serving  # noqa: E402
from flared.model.config import from_hf_config  # noqa: E402
from flared.model.runner import ModelRunner  # noqa: E402

SHAPES = {
    # a Qwen3-MoE of a few hundred million parameters: the CPU's
    "small": dict(hidden_size=768, num_hidden_layers=6, num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                  num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256, vocab_size=32000),
    # Qwen3-30B-A3B's layer (48 of them in the model)
    "30b-a3b": dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                    head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                    vocab_size=151936),
}


def hf_config(family: str, shape: dict):
    """The transformers config of ``family`` at ``shape``'s sizes: (config, experts, experts a token, expert size)."""
    import transformers

    e, k, inter = shape["num_experts"], shape["num_experts_per_tok"], shape["moe_intermediate_size"]
    common = {key: shape[key] for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                          "num_key_value_heads", "head_dim", "vocab_size")}
    common.update(max_position_embeddings=4096, tie_word_embeddings=False)
    if family == "gpt_oss":  # (its experts are intermediate_size wide; every other layer windowed)
        config = transformers.GptOssConfig(**common, num_local_experts=e, num_experts_per_tok=k,
                                           intermediate_size=inter, sliding_window=128)
    elif family == "glm4_moe":  # (a dense first layer, sigmoid routing, a shared expert)
        config = transformers.Glm4MoeConfig(**common, n_routed_experts=e, num_experts_per_tok=k,
                                            moe_intermediate_size=inter, intermediate_size=4 * shape["hidden_size"],
                                            n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5)
    elif family == "llama4":  # (one expert a token, fed its row times sigmoid(logit), beside a shared MLP)
        k = 1
        config = transformers.Llama4TextConfig(**common, num_local_experts=e, num_experts_per_tok=k,
                                               intermediate_size=inter, intermediate_size_mlp=4 * shape["hidden_size"],
                                               interleave_moe_layer_step=1)
    else:
        config = transformers.Qwen3MoeConfig(**common, num_experts=e, num_experts_per_tok=k,
                                             moe_intermediate_size=inter, intermediate_size=4 * shape["hidden_size"],
                                             norm_topk_prob=True)
    return config, e, k, inter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
    ap.add_argument("--family", default="qwen3_moe", choices=("qwen3_moe", "gpt_oss", "glm4_moe", "llama4"))
    ap.add_argument("--layers", type=int, default=0, help="fewer layers than the shape's (0: all)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens a sequence")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens a sequence")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    shape = dict(SHAPES[args.shape])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    dtype = getattr(torch, args.dtype)
    config, experts, per_token, expert_size = hf_config(args.family, shape)
    torch.manual_seed(0)
    started = time.perf_counter()
    with torch.device(args.device):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    # the same weights in flared's layout, as the loader reads a per-expert checkpoint
    state = hf.state_dict()  # (transformers 5's stacked experts, which the loader reads too; shared, not copied)
    ours_config = from_hf_config(config.to_dict())
    tensors = _hf_to_serving(state, ours_config, source="bench")
    batches = [int(b) for b in args.batches.split(",")]
    runner = ModelRunner(ours_config, tensors, dtype=dtype, device=args.device, num_pages=512, page_tokens=16,
                         max_batch=max(batches), prefill_chunk_tokens=4096)
    del tensors, state
    params = sum(t.numel() for t in hf.parameters())
    moe_layers = config.num_hidden_layers - len(ours_config.dense_layers)
    active = params - moe_layers * (experts - per_token) * 3 * config.hidden_size * expert_size
    print(f"{args.family} {args.shape}, {config.num_hidden_layers} layers: {params / 1e9:.2f}B parameters, "
          f"{active / 1e9:.2f}B active, {args.dtype} on {args.device} (built in {time.perf_counter() - started:.0f} s)",
          file=sys.stderr)
    grouped = runner.model.grouped_experts

    def looped(n: int, prompts) -> float:
        runner.model.grouped_experts = False
        try:
            return time_ours(runner, prompts, n)
        finally:
            runner.model.grouped_experts = grouped

    gen = torch.Generator().manual_seed(1)
    figures = {}
    for batch in batches:
        prompts = [torch.randint(3, config.vocab_size, (args.prompt,), generator=gen).tolist() for _ in range(batch)]
        time_ours(runner, prompts, 2)
        time_hf(hf, prompts, 2, 0)
        timers = {"flared": lambda n: time_ours(runner, prompts, n), "transformers": lambda n: time_hf(hf, prompts, n, 0)}
        if grouped:  # the A/B: the same runner with the loop over experts
            timers["flared (expert loop)"] = lambda n: looped(n, prompts)
        tok_s = decode_tok_s(timers, batch, args.tokens, args.repeats)
        figures[batch] = tok_s
        print(f"  batch {batch:3d}: " + "   ".join(f"{k} {v:9.1f} tok/s" for k, v in tok_s.items()),
              file=sys.stderr, flush=True)
    variants = [v for v in figures[batches[0]] if v != "transformers"]
    print("\n| family | shape | device | dtype | batch | " + " | ".join(f"{v} tok/s, ratio" for v in variants)
          + " | transformers tok/s |")
    print("| --- | --- | --- | --- | ---: | " + " | ".join("---:" for _ in variants) + " | ---: |")
    for batch, f in figures.items():
        print(f"| {args.family} | {args.shape} ({config.num_hidden_layers} layers) | {args.device} | {args.dtype} "
              f"| {batch} | "
              + " | ".join(f"{f[v]:,.1f}, {f[v] / f['transformers']:.2f}" for v in variants)
              + f" | {f['transformers']:,.1f} |")
    if args.json:
        print(json.dumps({"family": args.family, "shape": args.shape, "layers": config.num_hidden_layers, "device": args.device,
                          "dtype": args.dtype, "params_b": round(params / 1e9, 3), "active_b": round(active / 1e9, 3),
                          "grouped_experts": grouped,
                          **{f"batch{b}|{v}": {"tok_s": round(f[v], 1), "ratio": round(f[v] / f["transformers"], 3)}
                             for b, f in figures.items() for v in f}}))


if __name__ == "__main__":
    main()
