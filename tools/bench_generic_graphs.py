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
    # (latent attention: keys 192 wide, padded to 256 in the attention kernels; values 128 in the same pool rows)
    "deepseek_v2_lite": ("deepseek_v2", dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                                             moe_intermediate_size=1408, num_hidden_layers=8, num_attention_heads=16,
                                             num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
                                             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                             n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
                                             first_k_dense_replace=1, max_position_embeddings=4096,
                                             tie_word_embeddings=False), "DeepSeek-V2-Lite, 8 of its 27 layers"),
    # (heads 80 wide, padded to 128 in the attention kernels)
    "phi2": ("phi", dict(vocab_size=51200, hidden_size=2560, intermediate_size=10240, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=32, partial_rotary_factor=0.4,
                         max_position_embeddings=2048, tie_word_embeddings=False), "Phi-2 (2.7B)"),
    # (global layers of 4 kv heads 512 wide, kept as 256-wide rows of the pool; flared's own random weights where
    # this machine's transformers has no Gemma 4: then no transformers column)
    "gemma4_31b": ("gemma4_text", dict(vocab_size=262144, hidden_size=5376, intermediate_size=21504,
                                       num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=16,
                                       head_dim=256, sliding_window=1024, attention_k_eq_v=True,
                                       layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 2,
                                       per_layer_config={str(i): {"head_dim": 512, "num_key_value_heads": 4}
                                                         for i in (3, 7)},
                                       rope_parameters={"full_attention": {"partial_rotary_factor": 0.25,
                                                                           "rope_theta": 1e6,
                                                                           "rope_type": "proportional"},
                                                        "sliding_attention": {"rope_theta": 1e4,
                                                                              "rope_type": "default"}},
                                       final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
                                       hidden_size_per_layer_input=0, max_position_embeddings=4096,
                                       rms_norm_eps=1e-6, tie_word_embeddings=True),
                   "Gemma-4-31B, 8 of its 60 layers"),
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


def own_model(shape: str):
    """flared's DecoderModel of the shape with random bf16 weights of its own (norms and scales 1, biases 0, the rest
    N(0, 0.02)), for a family this machine's transformers cannot build."""
    from bench_gpu import CONTEXT_TOKENS

    from flared.model.config import from_hf_config
    from flared.model.decoder import DecoderModel
    from flared.model.loader import serving_tensor_shapes

    model_type, fields, _ = SHAPES[shape]
    config = from_hf_config(dict(fields, model_type=model_type, bos_token_id=None, eos_token_id=None, pad_token_id=0))
    generator = torch.Generator(device="cuda").manual_seed(0)
    tensors = {}
    for name, dims in serving_tensor_shapes(config).items():
        if name.endswith("norm.weight") or name.endswith("scalar") or name.endswith("scale"):
            tensors[name] = torch.ones(dims, dtype=torch.bfloat16, device="cuda")
        elif name.endswith(".bias"):
            tensors[name] = torch.zeros(dims, dtype=torch.bfloat16, device="cuda")
        else:
            tensors[name] = (torch.randn(dims, generator=generator, device="cuda") * 0.02).to(torch.bfloat16)
    return DecoderModel(config, tensors, dtype=torch.bfloat16, device="cuda", max_positions=CONTEXT_TOKENS)


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

    try:
        hf = make_hf(shape)
    except (KeyError, ValueError) as exc:  # (a family newer than this machine's transformers)
        print(f"{shape}: transformers cannot build it ({exc}); flared's own random weights, no transformers column")
        hf = None
    model = serving(hf, torch.bfloat16) if hf is not None else own_model(shape)
    c = model.config
    for n in streams:
        ps = prompts(c.vocab_size, n, PROMPT)
        row = {"shape": shape, "streams": n}
        try:
            graph_tokens, row["graphs"], row["capture_s"] = timed(lambda: graph_executor(model, concurrency=n), ps,
                                                                  new_tokens)
            eager_tokens, row["eager"], _ = timed(lambda: eager_executor(model, n), ps, new_tokens)
            row["same"] = sum(a == b for a, b in zip(graph_tokens, eager_tokens))
            if hf is not None:
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
        hf, vs_hf = (f"{r['hf']:>12.1f}", f"{r['graphs'] / r['hf']:>5.2f}x") if "hf" in r else (f"{'-':>12}", f"{'-':>6}")
        print(f"{name:<34} {r['streams']:>7} {r['graphs']:>9.1f} {r['eager']:>9.1f} {hf} "
              f"{r['graphs'] / r['eager']:>7.2f}x {vs_hf} {r['same']:>3}/{r['streams']}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
