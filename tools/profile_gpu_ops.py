"""GPU time of each op of a decode layer, as it runs inside a CUDA graph.

Each op is captured 50 times back to back into one graph; a replay's time over 50 is the op's cost
in a graph (launch gap included), which is what a decode step pays. Random bf16 weights of the
SmolLM2-135M and Llama-3.1-8B shapes; context 256 and 2048 for attention.

    python tools/profile_gpu_ops.py [--shapes 135m,8b] [--batches 1,64] [--json]

CUDA only. Prints one table; with --json the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

SHAPES = {"135m": dict(H=576, I=1536, nh=9, nkv=3, d=64, V=49152),
          "8b": dict(H=4096, I=14336, nh=32, nkv=8, d=128, V=128256)}
REPS = 50


def graph_us(fn) -> float:
    from flared.execution.graphs import time_graph_us

    return time_graph_us(fn, torch.cuda.Stream(), calls_per_graph=REPS, replays=5)


def profile(shape: str, batch: int) -> list[tuple[str, float, str]]:
    from flared.model.kernels import fused, skinny
    from flared.model.triton_attention import decode_splits, paged_decode_attention, paged_decode_attention_split

    s = SHAPES[shape]
    H, I, nh, nkv, d, V = s["H"], s["I"], s["nh"], s["nkv"], s["d"], s["V"]
    dt, dev = torch.bfloat16, "cuda"
    n_qkv = (nh + 2 * nkv) * d
    w = {k: (0.02 * torch.randn(*sh, device=dev)).to(dt) for k, sh in
         dict(qkv=(n_qkv, H), o=(H, nh * d), gu=(2 * I, H), down=(H, I), lm=(V, H)).items()}
    h = torch.randn(batch, H, device=dev).to(dt)
    x = torch.empty_like(h)
    nw = torch.ones(H, device=dev, dtype=dt)
    qkv = torch.empty(batch, n_qkv, device=dev, dtype=dt)
    q = torch.empty(batch, nh, d, device=dev, dtype=dt)
    attn = torch.empty_like(q)
    act = torch.empty(batch, I, device=dev, dtype=dt)
    gu = torch.empty(batch, 2 * I, device=dev, dtype=dt)
    P = 16
    pages = batch * 2048 // P + 1
    k_pool = torch.randn(pages * P, nkv, d, device=dev).to(dt)
    v_pool = torch.randn_like(k_pool)
    cos = torch.randn(4096, d, device=dev).to(dt)
    sin = torch.randn(4096, d, device=dev).to(dt)
    pos = torch.full((batch,), 100, device=dev, dtype=torch.int64)
    slots = torch.arange(batch, device=dev, dtype=torch.int64)
    tables = torch.arange(batch * (2048 // P), device=dev, dtype=torch.int32).view(batch, -1)
    out = []

    def add(name, fn, note=""):
        out.append((name, graph_us(fn), note))

    add("rms_norm (fused add_rms_norm)", lambda: fused.add_rms_norm(None, h, nw, x, 1e-5))
    add("qkv cuBLAS", lambda: torch.matmul(x, w["qkv"].t(), out=qkv), f"{w['qkv'].numel() * 2 / 1e6:.1f} MB")
    add("rope + kv write (fused)", lambda: fused.rope_write_kv(qkv, cos, sin, pos, slots, q, k_pool, v_pool,
                                                               num_heads=nh, num_kv_heads=nkv, head_dim=d))
    add("o cuBLAS", lambda: torch.matmul(attn.view(batch, -1), w["o"].t(), out=x))
    add("gate_up cuBLAS", lambda: torch.matmul(x, w["gu"].t(), out=gu), f"{w['gu'].numel() * 2 / 1e6:.1f} MB")
    add("silu_mul (fused)", lambda: fused.silu_mul(gu, act))
    add("down cuBLAS", lambda: torch.matmul(act, w["down"].t(), out=x))
    add("lm_head cuBLAS", lambda: torch.matmul(x, w["lm"].t()), f"{w['lm'].numel() * 2 / 1e6:.0f} MB")
    if batch <= skinny.MAX_ROWS:
        add("skinny norm_qkv_rope", lambda: skinny.norm_qkv_rope(h, nw, 1e-5, w["qkv"], None, cos, sin, pos, slots, q,
                                                                 k_pool, v_pool, num_heads=nh, num_kv_heads=nkv,
                                                                 head_dim=d))
        add("skinny o + residual", lambda: skinny.linear_residual(attn.view(batch, -1), w["o"], None, h))
        add("skinny norm_gate_up_silu", lambda: skinny.norm_gate_up_silu(h, nw, 1e-5, w["gu"], act))
        add("skinny down + residual", lambda: skinny.linear_residual(act, w["down"], None, h))
    splits = decode_splits(batch, nkv, torch.cuda.get_device_properties(0).multi_processor_count)
    scratch = batch * nh * 16
    pm, pl, pa = (torch.empty(scratch, device=dev), torch.empty(scratch, device=dev),
                  torch.empty(scratch * d, device=dev))
    for ctx in (256, 2048):
        lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
        add(f"attention ctx {ctx}, one pass", lambda: paged_decode_attention(
            q, k_pool, v_pool, attn, tables, lens, page_tokens=P, scale=d ** -0.5))
        if splits > 1:
            add(f"attention ctx {ctx}, {splits} splits", lambda: paged_decode_attention_split(
                q, k_pool, v_pool, attn, tables, lens, pa, pm, pl, num_splits=splits, page_tokens=P,
                scale=d ** -0.5))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="135m,8b")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result = {}
    print(f"{'shape':6} {'batch':>5}  {'op':40} {'us':>8}  note")
    for shape in args.shapes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for name, us, note in profile(shape, batch):
                print(f"{shape:6} {batch:>5}  {name:40} {us:8.1f}  {note}", flush=True)
                result[f"{shape}|{batch}|{name}"] = round(us, 2)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
