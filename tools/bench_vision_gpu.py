#!/usr/bin/env python
"""Image requests on a GPU: the CUDA graph executor against the eager executor (what --enforce-eager serves), in
one run, on random weights of Qwen2-VL-2B's shape (its 32-layer tower of 1280 and its 1.5B Qwen2 decoder, 3D rope).

Each request is 16 text tokens, one image of --side pixels (a 448-pixel image is 256 image tokens), 16 text tokens,
then --new-tokens greedy tokens. Every image runs the tower first (VisionJob, timed alone: the same work on both
executors), then the requests are driven through the real scheduler (flared.execution.offline.drive). On the graph
executor a prefill that feeds image tokens runs the prefill graph's forward eagerly with the tower's rows in their
places, and every other step replays the graphs; the eager executor runs every step as torch's forward.

    python3 tools/bench_vision_gpu.py [--requests 1,16] [--side 448] [--new-tokens 128] [--rounds 2] [--json]

Prints a table; with --json, one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TEXT = dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
            num_attention_heads=12, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6,
            max_position_embeddings=32768, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
            pad_token_id=0)
IMAGE_TOKEN = 151655
CONTEXT = 4096


def build_model():
    """Qwen2-VL-2B's shape, random bf16 weights on the GPU: the decoder, and the tower (bench_vision's)."""
    from bench_vision import build

    from flared.model.config import from_hf_config
    from flared.model.decoder import DecoderModel
    from flared.model.loader import serving_tensor_shapes
    from flared.model.vision import vision_encoder

    hf, vision_config, vision_tensors = build("qwen2-vl-2b")
    del hf
    config = from_hf_config(TEXT)
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = {name: (torch.ones(dims, device="cuda") if name.endswith("norm.weight") else
                      torch.randn(dims, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
               for name, dims in serving_tensor_shapes(config).items()}
    model = DecoderModel(config, tensors, dtype=torch.bfloat16, device="cuda", max_positions=CONTEXT)
    model.vision = vision_encoder(vision_config, vision_tensors, dtype=torch.bfloat16, device="cuda")
    model.set_mrope(vision_config.mrope_section, interleaved=vision_config.mrope_interleaved)
    return model, vision_config


def tower_rows(model, vision_config, count: int, side: int):
    """(each request's own random image's rows through the tower, its patch grid, tower seconds an image)."""
    from flared.runtime.worker import VisionJob

    merge = vision_config.scale_factor
    grid_side = side // (vision_config.patch_size * merge) * merge
    grid = (1, grid_side, grid_side)
    width = 3 * vision_config.temporal_patch_size * vision_config.patch_size ** 2
    g = torch.Generator().manual_seed(7)
    images = [types.SimpleNamespace(pixel_values=torch.randn(grid_side * grid_side, width, generator=g).numpy(),
                                    grid=grid) for _ in range(count)]
    torch.cuda.synchronize()
    started = time.perf_counter()
    job = VisionJob(images, done=None)
    while not job.step(model, 0, collections.Counter()):
        pass
    rows = job.result()
    torch.cuda.synchronize()
    return rows, grid, (time.perf_counter() - started) / count


def requests(rows, grid, merge: int, seed: int):
    """(prompts, VisionInputs): 16 text tokens, the image, 16 text tokens; ``seed`` picks the text (a round of its
    own: no prefix of an earlier round's prompts in the cache)."""
    from flared.model.vision import mrope_positions
    from flared.runtime.request import VisionInput

    prompts, visions = [], []
    tokens = torch.Generator().manual_seed(seed)
    for features in rows:
        n = features.shape[0]
        before, after = (torch.randint(3, 150000, (16,), generator=tokens).tolist() for _ in range(2))
        ids = before + [IMAGE_TOKEN] * n + after
        mrope, delta = mrope_positions(ids, [(len(before), n, grid)], merge)
        prompts.append(ids)
        visions.append(VisionInput(np.arange(len(before), len(before) + n), features, (), mrope, delta))
    return prompts, visions


def executor(model, n: int, graphs: bool):
    """(scheduler, executor) for ``n`` live requests: the CUDA graphs (as bench_gpu builds them) or the eager one."""
    from bench_gpu import graph_executor, scheduler

    from flared.execution.eager import EagerExecutor

    n = max(2, n)
    if graphs:
        return graph_executor(model, concurrency=n)
    sched, pages = scheduler(n)
    return sched, EagerExecutor(model, num_pages=pages, page_tokens=16, num_state_rows=n + 1, num_snapshots=4 * n,
                                vocab_size=model.config.vocab_size, max_live=n)


def run(pair, prompts, visions, new_tokens: int) -> dict:
    from bench_gpu import greedy

    from flared.execution.offline import drive

    torch.cuda.synchronize()
    result = drive(*pair, prompts, [greedy(new_tokens)] * len(prompts), visions=visions)
    total = sum(len(t) for t in result.tokens)
    return {"tok_s": total / (result.wall_ns / 1e9), "wall_ms": result.wall_ns / 1e6,
            "ttft_ms": float(np.mean(result.first_token_ns)) / 1e6,
            "decode_step_ms": (result.decode_gpu_ns / max(1, len(result.decode_step_ns))) / 1e6,
            "tokens": result.tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", default="1,16")
    parser.add_argument("--side", type=int, default=448)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model, vision_config = build_model()
    out = {"device": torch.cuda.get_device_name(), "side": args.side, "new_tokens": args.new_tokens, "runs": []}
    print(f"Qwen2-VL-2B shape, random bf16 weights, {torch.cuda.get_device_name()}; {args.side}-px images, "
          f"{args.new_tokens} new tokens; best of {args.rounds}")
    print(f"{'requests':>8} {'executor':>8} {'tok/s':>9} {'wall ms':>9} {'TTFT ms':>9} {'step ms':>8} {'tower ms':>9}")
    for count in (int(c) for c in args.requests.split(",")):
        rows, grid, tower_s = tower_rows(model, vision_config, count, args.side)
        pairs = {"graphs": executor(model, count, True), "eager": executor(model, count, False)}
        best, firsts = {}, {}
        try:
            for round_ in range(args.rounds):
                prompts, visions = requests(rows, grid, vision_config.scale_factor, seed=3 + round_)
                for name, pair in pairs.items():
                    r = run(pair, prompts, visions, args.new_tokens)
                    firsts.setdefault(name, r["tokens"])  # (the first round's prompts, for the comparison)
                    if name not in best or r["wall_ms"] < best[name]["wall_ms"]:
                        best[name] = r
        finally:
            pairs["graphs"][1].close()
        same = sum(a == b for x, y in zip(firsts["graphs"], firsts["eager"]) for a, b in zip(x, y))
        for name, r in best.items():
            print(f"{count:>8} {name:>8} {r['tok_s']:>9.1f} {r['wall_ms']:>9.1f} {r['ttft_ms']:>9.1f} "
                  f"{r['decode_step_ms']:>8.2f} {tower_s * 1e3:>9.1f}")
        ratio = best["graphs"]["tok_s"] / best["eager"]["tok_s"]
        print(f"{'':>8} graphs / eager: {ratio:.2f}x tok/s; {same} of {count * args.new_tokens} tokens equal")
        out["runs"].append({"requests": count, "prompt_tokens": len(prompts[0]), "tower_ms": tower_s * 1e3,
                            "ratio": ratio, "equal_tokens": same,
                            **{name: {k: v for k, v in r.items() if k != "tokens"} for name, r in best.items()}})
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
