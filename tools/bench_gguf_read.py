#!/usr/bin/env python
"""Reading a GGUF (flared.model.loader.read_source, what `flarectl export model.gguf` and `flared run model.gguf`
spend most of their time on): flared's reader against the `gguf` package's, in one process.

For each shape and mix a GGUF of the llama architecture is written with random blocks (their float16 scales sane)
and a vocabulary of the shape's size (Llama 3's 128,256 tokens and 280,147 merges for llama1b and 8b). Then
read_source(path, dtype=bfloat16) is timed both ways, alternating, best of --repeats:
- "flared": flared/frontend/gguf_metadata.py's GGUFFile, the tensors dequantised by flared/_fast/gguf.pyx;
- "gguf": gguf.GGUFReader and gguf.quants.dequantize, as before them.
The two must give the same bf16 tensors (checked). "mix" q4_k_m is llama.cpp's Q4_K_M: Q4_K matrices, attn_v and
ffn_down Q6_K in every other layer (llama.cpp's own rule gives a few more), the output Q6_K; where a row is not
whole 256-value super-blocks (SmolLM2's 576), Q5_0 and Q8_0 in their place, as llama.cpp falls back.

    .venv/bin/python tools/bench_gguf_read.py [--shapes smollm2,llama1b] [--mixes q4_k_m,q8_0,q4_0]
                                              [--repeats 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {  # (label, hidden, intermediate, layers, heads, kv heads, vocab, merges)
    "smollm2": ("SmolLM2-135M", 576, 1536, 30, 9, 3, 49152, 48900),
    "llama1b": ("Llama-3.2-1B", 2048, 8192, 16, 32, 8, 128256, 280147),
    "8b": ("Llama-3.1-8B", 4096, 14336, 32, 32, 8, 128256, 280147),
}


def _types(mix: str, name: str, layer: int):
    from gguf.constants import GGMLQuantizationType as T

    if mix == "q4_k_m":
        if name == "output":
            return T.Q6_K
        if name in ("attn_v", "ffn_down") and layer % 2 == 0:
            return T.Q6_K
        return T.Q4_K
    return {"q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_1": T.Q4_1, "q5_k": T.Q5_K, "q6_k": T.Q6_K}[mix]


def _blocks(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """Random blocks of ``qtype`` for a [rows, cols] matrix, as bytes [rows, bytes a row], float16 scales sane."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    halves = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q8_0: [0], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}[qtype]
    for offset in halves:
        scale = (rng.standard_normal(raw.shape[0]) * 0.001).astype(np.float16)
        raw[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, cols // block * size)


def write_gguf(path: Path, shape: str, mix: str) -> int:
    """The GGUF file; returns the weights its matrices hold."""
    import gguf
    from gguf.constants import GGMLQuantizationType as T

    _, hidden, inter, layers, heads, kv, vocab, merges = SHAPES[shape]
    head_dim = hidden // heads
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("context_length", 8192), ("embedding_length", hidden), ("block_count", layers),
                       ("feed_forward_length", inter), ("attention.head_count", heads),
                       ("attention.head_count_kv", kv), ("vocab_size", vocab), ("rope.dimension_count", head_dim)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", 500000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(vocab)])
    w.add_array("tokenizer.ggml.token_type", [1] * vocab)
    w.add_array("tokenizer.ggml.merges", [f"t{i % 997} k{i}" for i in range(merges)])
    weights = 0

    def matrix(name: str, rows: int, cols: int, layer: int, kind: str) -> None:
        nonlocal weights
        qtype = _types(mix, kind, layer)
        if cols % 256 and qtype in (T.Q4_K, T.Q5_K, T.Q6_K):  # (llama.cpp's fallback where rows are not super-blocks)
            qtype = T.Q8_0 if qtype == T.Q6_K else T.Q5_0
        w.add_tensor(name, _blocks(qtype, rows, cols, rng), raw_dtype=qtype)
        weights += rows * cols

    matrix("token_embd.weight", vocab, hidden, 0, "token_embd")
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    matrix("output.weight", vocab, hidden, 0, "output")
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        for kind, rows, cols in (("attn_q", hidden, hidden), ("attn_k", kv * head_dim, hidden),
                                 ("attn_v", kv * head_dim, hidden), ("attn_output", hidden, hidden),
                                 ("ffn_gate", inter, hidden), ("ffn_up", inter, hidden), ("ffn_down", hidden, inter)):
            matrix(f"blk.{i}.{kind}.weight", rows, cols, i, kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


def read(path: Path, ours: bool):
    """read_source over flared's reader and dequantisers (ours) or over the gguf package's."""
    import gguf

    from flared.frontend import gguf_metadata
    from flared.model import loader

    saved = gguf_metadata.GGUFFile, loader._fast_gguf
    if not ours:
        gguf_metadata.GGUFFile, loader._fast_gguf = gguf.GGUFReader, None
    try:
        t = time.perf_counter()
        source = loader.read_source(path, dtype=torch.bfloat16)
        return time.perf_counter() - t, source
    finally:
        gguf_metadata.GGUFFile, loader._fast_gguf = saved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="smollm2,llama1b")
    ap.add_argument("--mixes", default="q4_k_m,q8_0,q4_0")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    result = {"threads": torch.get_num_threads()}
    print(f"read_source(model.gguf, dtype=bfloat16), {torch.get_num_threads()} threads, best of {args.repeats}")
    print(f"{'shape':>14} {'mix':>7} {'weights':>9} {'file MiB':>9} {'flared s':>9} {'gguf s':>8} {'gguf / flared':>14} "
          f"{'flared ns/w':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            for mix in args.mixes.split(","):
                path = Path(tmp) / f"{shape}-{mix}.gguf"
                weights = write_gguf(path, shape, mix)
                best = {True: float("inf"), False: float("inf")}
                reference = None
                for _ in range(args.repeats):
                    for ours in (True, False):
                        seconds, source = read(path, ours)
                        best[ours] = min(best[ours], seconds)
                        if reference is None:
                            reference = source.tensors
                        else:  # (the two readers give the same tensors)
                            assert all(torch.equal(reference[k], v) for k, v in source.tensors.items())
                        del source
                reference = None
                mib = path.stat().st_size / 2**20
                path.unlink()
                row = {"weights": weights, "file_mib": mib, "flared_s": best[True], "gguf_s": best[False],
                       "speedup": best[False] / best[True], "flared_ns_per_weight": best[True] / weights * 1e9}
                result[f"{shape}_{mix}"] = row
                print(f"{SHAPES[shape][0]:>14} {mix:>7} {weights / 1e6:>8.0f}M {mib:>9.0f} {best[True]:>9.2f} "
                      f"{best[False]:>8.2f} {row['speedup']:>13.1f}x {row['flared_ns_per_weight']:>12.2f}", flush=True)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
