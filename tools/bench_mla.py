"""Latent attention served absorbed (one latent row a token in the KV cache, ModelConfig.latent_kv) against the
expanded layout it replaced (a key and a value of head_dim per head, FLARED_MLA_EXPANDED=1), both through the CUDA
graphs, in one run.

    python3 tools/bench_mla.py [--shape deepseek_v2_lite] [--runs 1x128,64x128,16x2048,4x3968] [--json]
    python3 tools/bench_mla.py --device cpu [--runs 1x512,1x2048,8x512] [--layers 4] [--repeats 3] [--json]

GPU: random bf16 weights of the shape (tools/bench_generic_graphs.py's SHAPES); a run "NxP" is N streams of P-token
prompts, each generating --new-tokens greedy tokens (no end token); output tok/s over the whole run, prefill
included. "KV B/token" is what one token of context holds in the cache across the model's layers; "same" the streams
whose tokens both layouts agree on from first to last (bf16: near-ties may part them), "agree" the mean count of
leading tokens they share.

CPU: DeepSeek-V2-Lite's attention (16 heads, a 512-wide latent, 64-wide rope, 128-wide nope and values) in --layers
dense layers of a small MLP, random bf16 weights, through ModelRunner; each run's decode tok/s over the decode phase
(tools/bench_model.py's method: the layouts alternate, best of --repeats) and its prefill seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))


def run_layout(hf, expanded: bool, runs: list[tuple[int, int]], new_tokens: int) -> dict:
    """Every run of one layout: {run: (tokens, tok/s)}, and the cache's bytes a token."""
    from bench_gpu import CONTEXT_TOKENS, PAGE_TOKENS, graph_executor, greedy, prompts, serving

    from flared.execution.offline import drive

    if expanded:
        os.environ["FLARED_MLA_EXPANDED"] = "1"
    else:
        os.environ.pop("FLARED_MLA_EXPANDED", None)
    try:
        model = serving(hf, torch.bfloat16)
        c = model.config
        assert c.latent_kv != expanded
        result = {"kv_bytes_per_token": c.kv_values_per_token * 2}
        for streams, prompt_len in runs:
            ps = prompts(c.vocab_size, streams, prompt_len)
            num_pages = streams * CONTEXT_TOKENS // PAGE_TOKENS
            sched, ex = graph_executor(model, concurrency=streams, num_pages=num_pages)
            try:
                drive(sched, ex, ps[:1], [greedy(4)])
                torch.cuda.synchronize()
                t = time.perf_counter()
                out = drive(sched, ex, ps, [greedy(new_tokens)] * streams)
                torch.cuda.synchronize()
                elapsed = time.perf_counter() - t
                result[f"{streams}x{prompt_len}"] = (out.tokens, streams * new_tokens / elapsed)
                result[f"{streams}x{prompt_len}_pool_gib"] = ex.kv_cache[1] / 2**30
            finally:
                ex.close()
        del model
        torch.cuda.empty_cache()
        return result
    finally:
        os.environ.pop("FLARED_MLA_EXPANDED", None)


CPU_SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=2816, num_attention_heads=16,
                 num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                 v_head_dim=128, n_routed_experts=None, max_position_embeddings=4096, tie_word_embeddings=False)


def cpu_main(args, runs: list[tuple[int, int]]) -> int:
    """Both layouts' ModelRunners on the CPU, alternating."""
    from bench_model import decode_tok_s, time_ours

    from flared.model.config import from_hf_config
    from flared.model.loader import serving_tensor_shapes
    from flared.model.runner import ModelRunner
    from flared.model.sampling import SamplingParams

    fields = dict(CPU_SHAPE, num_hidden_layers=args.layers, first_k_dense_replace=args.layers)
    config = from_hf_config(dict(fields, model_type="deepseek_v2", bos_token_id=None, eos_token_id=None,
                                 pad_token_id=0))
    g = torch.Generator().manual_seed(0)
    tensors = {name: (torch.ones(dims) if name.endswith("norm.weight") else torch.randn(dims, generator=g) * 0.02
                      ).to(torch.bfloat16) for name, dims in serving_tensor_shapes(config).items()}
    most = max(n for n, _ in runs)
    pages = most * (max(p for _, p in runs) + args.new_tokens) // 64 + 8
    runners, kv_bytes = {}, {}
    for layout in ("absorbed", "expanded"):
        if layout == "expanded":
            os.environ["FLARED_MLA_EXPANDED"] = "1"
        try:
            runners[layout] = ModelRunner(config, tensors, dtype=torch.bfloat16, num_pages=pages, page_tokens=64,
                                          max_batch=most, prefill_chunk_tokens=2048)
            kv_bytes[layout] = config.kv_values_per_token * 2
        finally:
            os.environ.pop("FLARED_MLA_EXPANDED", None)
    out = {"device": "cpu", "threads": torch.get_num_threads(), "layers": args.layers, "kv_bytes_per_token": kv_bytes}
    print(f"DeepSeek-V2-Lite attention, {args.layers} dense layers, bf16 on the CPU ({torch.get_num_threads()} "
          f"threads); KV bytes a token of context: absorbed {kv_bytes['absorbed']:,}, expanded "
          f"{kv_bytes['expanded']:,}")
    print(f"{'streams x prompt':>17} {'absorbed tok/s':>15} {'expanded tok/s':>15} {'ratio':>6} "
          f"{'prefill s a/e':>14}")
    g = torch.Generator().manual_seed(1)
    for streams, prompt_len in runs:
        prompts = torch.randint(3, config.vocab_size, (streams, prompt_len), generator=g).tolist()
        prefill = {}
        for name, runner in runners.items():
            time_ours(runner, prompts, 2)  # (warm)
            t = time.perf_counter()
            runner.generate(prompts, [SamplingParams(temperature=0, max_tokens=1)] * streams)
            prefill[name] = time.perf_counter() - t
        timers = {name: (lambda n, r=runner: time_ours(r, prompts, n)) for name, runner in runners.items()}
        tok_s = decode_tok_s(timers, streams, args.new_tokens, args.repeats)
        a, e = tok_s["absorbed"], tok_s["expanded"]
        key = f"{streams}x{prompt_len}"
        out[key] = {"absorbed": a, "expanded": e, "ratio": a / e, "prefill_s": prefill}
        print(f"{key:>17} {a:>15.1f} {e:>15.1f} {a / e:>5.2f}x {prefill['absorbed']:>6.2f}/{prefill['expanded']:<7.2f}",
              flush=True)
    if args.json:
        print(json.dumps(out))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--shape", default="deepseek_v2_lite")
    ap.add_argument("--runs", default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--layers", type=int, default=4, help="CPU: dense layers")
    ap.add_argument("--repeats", type=int, default=3, help="CPU: best of")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    args.runs = args.runs or ("1x512,1x2048,8x512" if cpu else "1x128,64x128,16x2048,4x3968")
    args.new_tokens = args.new_tokens or (32 if cpu else 128)
    runs = [tuple(int(x) for x in r.split("x")) for r in args.runs.split(",")]
    if cpu:
        return cpu_main(args, runs)
    from bench_generic_graphs import SHAPES, make_hf
    from bench_gpu import matched_prefix

    hf = make_hf(args.shape)
    absorbed = run_layout(hf, False, runs, args.new_tokens)
    expanded = run_layout(hf, True, runs, args.new_tokens)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": args.shape,
           "kv_bytes_per_token": {"absorbed": absorbed["kv_bytes_per_token"], "expanded": expanded["kv_bytes_per_token"]}}
    print(f"\n{SHAPES[args.shape][2]} on {out['device']}; KV bytes a token of context: absorbed "
          f"{absorbed['kv_bytes_per_token']:,}, expanded {expanded['kv_bytes_per_token']:,} "
          f"({expanded['kv_bytes_per_token'] / absorbed['kv_bytes_per_token']:.1f}x)")
    print(f"{'streams x prompt':>17} {'absorbed tok/s':>15} {'expanded tok/s':>15} {'ratio':>6} {'pool GiB a/e':>14} "
          f"{'same':>6} {'agree':>6}")
    for streams, prompt_len in runs:
        key = f"{streams}x{prompt_len}"
        (a_tokens, a), (e_tokens, e) = absorbed[key], expanded[key]
        same = sum(x == y for x, y in zip(a_tokens, e_tokens))
        agree = sum(matched_prefix(x, y) for x, y in zip(a_tokens, e_tokens)) / streams
        pools = (absorbed[key + "_pool_gib"], expanded[key + "_pool_gib"])
        out[key] = {"absorbed": a, "expanded": e, "ratio": a / e, "same": same, "agree": agree, "pool_gib": pools}
        print(f"{key:>17} {a:>15.1f} {e:>15.1f} {a / e:>5.2f}x {pools[0]:>6.2f}/{pools[1]:<7.2f} {same:>3}/{streams} "
              f"{agree:>6.1f}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
