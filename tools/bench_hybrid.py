#!/usr/bin/env python
"""Hybrid models (recurrent layers beside attention): flared's runtime against transformers, decode and prefill.

Both sides build the same random-weight model of ``--family`` at a shape below: a Qwen3.5 text model (three Gated
DeltaNet layers to one gated attention layer), an LFM2 (gated short convolutions, a few attention layers), a Granite
4.0-H (Mamba-2 layers, a few unrotated attention layers), a Nemotron-H (Mamba-2 and squared-ReLU MLP blocks, an
attention block in eight), a Falcon-H1 (attention and Mamba-2 side by side in every layer), a Jamba (Mamba-1 layers,
attention, experts), a Kimi Linear (Kimi Delta Attention, latent attention, experts) or a Gemma 4 (no recurrent layers: windowed layers beside global ones of wider heads); and,
alternately in one process, run greedy decoding of the same prompts (decode tok/s over the decode phase only, each
batch's N-1 tokens: tools/bench_model.py's method, best of ``--repeats``) and one long prompt's prefill (seconds to
its first token's logits: flared's runner a chunk of --chunk tokens at a time, its state carried between chunks;
transformers one forward). flared's CPU forwards of such a model flush denormal floats to zero
(DecoderModel.flush_denormals); transformers is measured as it runs by default and, as "transformers (FTZ)", with
the same flush around its calls. ``--device cuda`` runs both sides on the GPU (flared's eager forward).

    .venv/bin/python tools/bench_hybrid.py [--family qwen3_5|lfm2|granite4_h|nemotron_h|falcon_h1|jamba|kimi_linear|gemma4]
        [--shape default|small] [--layers 8] [--dtype bfloat16] [--device cpu|cuda] [--json]

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

from flared._fast.linear import flush_denormals  # noqa: E402
from flared.model.config import from_hf_config  # noqa: E402
from flared.model.loader import _hf_to_serving  # noqa: E402
from flared.model.runner import ModelRunner  # noqa: E402
from flared.model.sampling import SamplingParams  # noqa: E402

# family -> shape -> the transformers config's sizes (the "default" shapes: Qwen3.5 of 0.75B parameters in the
# layout of the 0.8B model, tied embeddings of a 248k vocabulary; LFM2 of 1.17B in the layout of LFM2-1.2B, 6 of 16
# layers attending; Granite 4.0-H of 0.55B, 4 of 24 layers attending, 32 Mamba heads of 64 over a 128-wide state)
SHAPES = {
    "qwen3_5": {
        "default": dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                        linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320,
                        tie_word_embeddings=True),
        "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=64, linear_num_key_heads=8, linear_num_value_heads=16,
                      linear_key_head_dim=64, linear_value_head_dim=64, vocab_size=32000, tie_word_embeddings=False),
    },
    "lfm2": {
        "default": dict(hidden_size=2048, intermediate_size=12288, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=65536, full_attn_idxs=[2, 5, 8, 10, 12, 14]),
        "small": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=32000, full_attn_idxs=[2, 5]),
    },
    "granite4_h": {
        "default": dict(hidden_size=1024, intermediate_size=4096, shared_intermediate_size=4096, num_hidden_layers=24,
                        num_attention_heads=16, num_key_value_heads=4, vocab_size=100352, num_local_experts=0,
                        layer_types=["attention" if i % 6 == 5 else "mamba" for i in range(24)], mamba_n_heads=32,
                        mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, position_embedding_type="nope",
                        tie_word_embeddings=True),
        "small": dict(hidden_size=512, intermediate_size=1536, shared_intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=2, vocab_size=32000, num_local_experts=0,
                      layer_types=["attention" if i % 4 == 3 else "mamba" for i in range(8)], mamba_n_heads=16,
                      mamba_d_head=64, mamba_n_groups=1, mamba_d_state=64, position_embedding_type="nope"),
    },
    "nemotron_h": {  # Nemotron Nano 2's layout at 0.6B: Mamba-2 + squared-ReLU MLP pairs, an attention block in 8
        "default": dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=8, num_key_value_heads=2,
                        head_dim=128, mamba_num_heads=32, mamba_head_dim=64, n_groups=8, ssm_state_size=128,
                        vocab_size=131072, layers_block_type=list("M-M-M*-M-M-M-M*-M-M-M-M*-M-M-")),
        "small": dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=64, mamba_num_heads=16, mamba_head_dim=64, n_groups=2, ssm_state_size=64,
                      vocab_size=32000, layers_block_type=list("M-M*-M-M-")),
    },
    "falcon_h1": {  # Falcon-H1-0.5B's layout: attention and a Mamba-2 mixer side by side in each of 36 layers
        "default": dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=36, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=64, mamba_d_ssm=1536, mamba_n_heads=24, mamba_d_head=64,
                        mamba_n_groups=1, mamba_d_state=128, vocab_size=32784),
        "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=64, mamba_d_ssm=1024, mamba_n_heads=16, mamba_d_head=64,
                      mamba_n_groups=1, mamba_d_state=64, vocab_size=32000),
    },
    "gemma4": {  # Gemma 4 31B's layout at 0.8B: five windowed layers of 256-wide heads to one global of 512 (keys as values)
        "default": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=8,
                        num_key_value_heads=4, head_dim=256, global_head_dim=512, num_global_key_value_heads=2,
                        attention_k_eq_v=True, sliding_window=512, vocab_size=262144, hidden_size_per_layer_input=0,
                        final_logit_softcapping=30.0),
        "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=64, global_head_dim=128, num_global_key_value_heads=2,
                      attention_k_eq_v=True, sliding_window=128, vocab_size=32000, hidden_size_per_layer_input=0),
    },
    "jamba": {  # Jamba's layout at 0.6B: Mamba-1 layers (2048 channels of 16 states), one attention layer in eight,
        # every other layer's MLP four experts (two a token)
        "default": dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=16, num_attention_heads=16,
                        num_key_value_heads=4, num_experts=4, num_experts_per_tok=2, attn_layer_period=8,
                        attn_layer_offset=4, expert_layer_period=2, expert_layer_offset=1, mamba_d_state=16,
                        mamba_expand=2, vocab_size=65536),
        "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, attn_layer_period=4,
                      attn_layer_offset=2, expert_layer_period=2, expert_layer_offset=1, vocab_size=32000),
    },
    "kimi_linear": {  # Kimi Linear's layout at 0.5B: three Kimi Delta Attention layers (8 heads of 128) to one latent
        # attention layer, the MLPs after the first 16 sigmoid-routed experts (four a token) beside a shared one
        "default": dict(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512, num_hidden_layers=12,
                        num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=256, q_lora_rank=None,
                        qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, num_local_experts=16,
                        num_experts_per_tok=4, linear_head_dim=128, linear_num_heads=8, vocab_size=65536, pad_token_id=0,
                        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(12)],
                        mlp_layer_types=["dense"] + ["sparse"] * 11),
        "small": dict(hidden_size=512, intermediate_size=1536, moe_intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=128, q_lora_rank=None,
                      qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, num_local_experts=8,
                      num_experts_per_tok=2, linear_head_dim=64, linear_num_heads=8, vocab_size=32000, pad_token_id=0,
                      layer_types=["linear_attention"] * 3 + ["full_attention"],
                      mlp_layer_types=["dense"] + ["sparse"] * 3),
    },
}
CONFIGS = {"qwen3_5": "Qwen3_5TextConfig", "lfm2": "Lfm2Config", "granite4_h": "GraniteMoeHybridConfig",
           "nemotron_h": "NemotronHConfig", "falcon_h1": "FalconH1Config", "gemma4": "Gemma4TextConfig",
           "jamba": "JambaConfig", "kimi_linear": "KimiLinearConfig"}
BLOCKS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="qwen3_5", choices=sorted(SHAPES))
    ap.add_argument("--shape", default="default", choices=("default", "small"))
    ap.add_argument("--layers", type=int, default=0, help="only the shape's first layers (0: all)")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tokens", type=int, default=24, help="new tokens a sequence")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens a decoding sequence")
    ap.add_argument("--prefill", type=int, default=1024, help="tokens of the prefill timing's prompt (0: none)")
    ap.add_argument("--chunk", type=int, default=512, help="flared's prefill chunk")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: both sides on the GPU (flared's eager forward)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    import transformers

    shape = dict(SHAPES[args.family][args.shape])
    if "layers_block_type" in shape:  # (Nemotron-H: blocks, not layers; --layers keeps the first blocks)
        blocks = [BLOCKS[ch] for ch in shape["layers_block_type"]]
        shape["layers_block_type"] = blocks[:args.layers] if args.layers else blocks
    elif args.layers:
        shape["num_hidden_layers"] = args.layers
        for key in ("layer_types", "full_attn_idxs"):
            if key in shape:
                shape[key] = [x for x in shape[key] if key == "layer_types" or x < args.layers][:args.layers]
    dtype = getattr(torch, args.dtype)
    config = getattr(transformers, CONFIGS[args.family])(**shape, max_position_embeddings=8192)
    torch.manual_seed(0)
    started = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    ours_config = from_hf_config(config.to_dict())
    tensors = _hf_to_serving(hf.state_dict(), ours_config, source="bench", hf_config=config.to_dict())
    hf.to(args.device)
    batches = [int(b) for b in args.batches.split(",")]
    runner = ModelRunner(ours_config, tensors, dtype=dtype, device=args.device, num_pages=512, page_tokens=16,
                         max_batch=max(batches), prefill_chunk_tokens=max(args.chunk, args.prompt))
    del tensors
    params = sum(t.numel() for t in hf.parameters())
    layers = config.num_hidden_layers
    print(f"{args.family} {args.shape}, {layers} layers ({len(ours_config.linear_layers)} "
          f"{ours_config.graph_obstacle}): "
          f"{params / 1e9:.2f}B parameters, {args.dtype}, {args.device}, {args.threads} threads (built in "
          f"{time.perf_counter() - started:.0f} s)", file=sys.stderr)
    cuda = args.device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def flushed(fn):
        if cuda:  # the flush is a CPU thread's mode; on the GPU it is the same side again
            return fn

        def run(*a):
            before = flush_denormals(args.threads, True)
            try:
                return fn(*a)
            finally:
                if not before:
                    flush_denormals(args.threads, False)
        return run

    gen = torch.Generator().manual_seed(1)
    figures: dict = {}
    for batch in batches:
        prompts = [torch.randint(3, config.vocab_size, (args.prompt,), generator=gen).tolist() for _ in range(batch)]
        time_ours(runner, prompts, 2)
        time_hf(hf, prompts, 2, 0)
        tok_s = decode_tok_s({"flared": lambda n: time_ours(runner, prompts, n),
                              "transformers": lambda n: time_hf(hf, prompts, n, 0),
                              "transformers (FTZ)": flushed(lambda n: time_hf(hf, prompts, n, 0))},
                             batch, args.tokens, args.repeats)
        figures[f"decode batch {batch} tok/s"] = tok_s
        print(f"  decode batch {batch:3d}: " + "   ".join(f"{k} {v:8.1f} tok/s" for k, v in tok_s.items()),
              file=sys.stderr, flush=True)
    if args.prefill:
        prompt = torch.randint(3, config.vocab_size, (args.prefill,), generator=gen).tolist()
        runner.prefill_chunk_tokens = args.chunk

        def ours() -> float:
            sync()
            started = time.perf_counter()
            runner.generate([prompt], [SamplingParams(temperature=0, max_tokens=1)])
            sync()
            return time.perf_counter() - started

        def theirs() -> float:
            sync()
            started = time.perf_counter()
            with torch.inference_mode():
                hf(torch.tensor([prompt], device=args.device), logits_to_keep=1)
            sync()
            return time.perf_counter() - started

        sides = {"flared": ours, "transformers": theirs, "transformers (FTZ)": flushed(theirs)}
        best = {name: float("inf") for name in sides}
        for name, side in sides.items():
            side()
        for _ in range(args.repeats):
            for name, side in sides.items():
                best[name] = min(best[name], side())
        figures[f"prefill {args.prefill} s"] = best
        print(f"  prefill {args.prefill}: " + "   ".join(f"{k} {v:.3f} s" for k, v in best.items()),
              file=sys.stderr, flush=True)
    print(f"\n| {args.family} {args.shape} ({layers} layers), {args.dtype}, {args.device}, {args.threads} threads | flared | transformers "
          "| ratio | transformers (FTZ) | ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, f in figures.items():
        def ratio(theirs: float) -> float:
            return f["flared"] / theirs if "tok/s" in name else theirs / f["flared"]
        print(f"| {name} | {f['flared']:,.3f} | {f['transformers']:,.3f} | {ratio(f['transformers']):.2f} "
              f"| {f['transformers (FTZ)']:,.3f} | {ratio(f['transformers (FTZ)']):.2f} |")
    if args.json:
        print(json.dumps({"family": args.family, "shape": args.shape, "layers": layers, "dtype": args.dtype,
                          "device": args.device, "threads": args.threads,
                          "params_b": round(params / 1e9, 3),
                          **{name: {k: round(v, 4) for k, v in f.items()} for name, f in figures.items()}}))


if __name__ == "__main__":
    main()
