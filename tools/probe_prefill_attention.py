"""Prefill attention as a prefill step pays it: paged_prefill_attention_varlen's launch settings and schedule knobs
beside torch's scaled_dot_product_attention (FlashAttention and cuDNN backends) on the same queries and keys.

Each case is one prefill chunk layout over a paged KV pool with its pages scattered; each variant is captured
for all layers into one graph and timed per layer. By default (``--l2 hot``) every layer reads the same queries
and pool, which then sit in L2 as they do in a prefill step, where the rotary kernel has just written them
(a 2048-token layer's K/V are 8 MB at 8B); ``--l2 cold`` gives every layer its own, so each reads DRAM.
Every variant's output is checked against a float32 reference, and the torch references run on the same K/V
made contiguous (their time excludes that copy; transformers' prefill pays it as its own layout).

    python tools/probe_prefill_attention.py [--shapes 8b,135m] [--variants "default;heads_fast=0 ..."]
        [--l2 hot|cold] [--json]

A variant is ``default`` (PREFILL_CONFIG) or space-separated PREFILL_CONFIG overrides (``key=value``); variants
are separated by ``;``. ``third`` is the third session's kernel (the schedule knobs off). CUDA only, bf16.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SHAPES = {"8b": dict(nh=32, nkv=8, d=128, layers=32), "135m": dict(nh=9, nkv=3, d=64, layers=30)}
# (name, [(cached, new) per sequence], token capacity)
CASES = [("2048 new", [(0, 2048)], 2048), ("1024 cached + 1024 new", [(1024, 1024)], 2048),
         ("16 x 128 new", [(0, 128)] * 16, 2048), ("4 x 512 new", [(0, 512)] * 4, 2048)]
THIRD = "heads_fast=0 heavy_first=0 split_mask=0 exp2=0"
DEFAULT_VARIANTS = ";".join(["default", "third", "heads_fast=0", "heavy_first=0", "split_mask=0", "exp2=0",
                             "num_stages=3", "num_stages=1", "block_n=32", "block_n=128", "block_m=64 num_warps=4",
                             "block_m=64 num_warps=4 num_stages=3", "default"])


def parse_variant(text: str) -> dict:
    text = text.strip()
    if text == "default":
        return {}
    if text == "third":
        text = THIRD
    out = {}
    for item in text.split():
        key, value = item.split("=")
        out[key] = int(value)
    return out


def causal_flops(metas, nh: int, d: int) -> float:
    """Multiply-adds x 2 of QK^T and PV over the visible (query, key) pairs."""
    pairs = sum(new * cached + new * (new + 1) // 2 for cached, new in metas)
    return 4.0 * pairs * nh * d


def operands(shape: dict, metas, capacity: int, page: int = 16, layers: int = 1):
    nh, nkv, d = shape["nh"], shape["nkv"], shape["d"]
    dt = torch.bfloat16
    pages_per_seq = max(-(-(c + n) // page) for c, n in metas)
    num_pages = len(metas) * pages_per_seq
    torch.manual_seed(0)
    k_pool = torch.randn(layers, num_pages * page, nkv, d, device="cuda", dtype=dt)
    v_pool = torch.randn_like(k_pool)
    tables = torch.randperm(num_pages, device="cuda").view(len(metas), pages_per_seq).to(torch.int32)
    q = torch.randn(layers, capacity, nh, d, device="cuda", dtype=dt)
    meta = torch.tensor(metas, dtype=torch.int32, device="cuda")
    return q, k_pool, v_pool, tables, meta


def seq_kv(pool_layer, table, length: int, page: int):
    pos = torch.arange(length, device="cuda")
    return pool_layer[table.long()[pos // page] * page + pos % page]  # [L, nkv, d]


def reference(q, k_pool, v_pool, tables, metas, page: int, scale: float, layer: int = 0):
    """float32 attention of every sequence of layer ``layer``: [rows, nh, d] in packed order."""
    outs = []
    row = 0
    for b, (cached, new) in enumerate(metas):
        L = cached + new
        k = seq_kv(k_pool[layer], tables[b], L, page).float()
        v = seq_kv(v_pool[layer], tables[b], L, page).float()
        qs = q[layer, row:row + new].float()
        group = qs.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", qs, k) * scale
        visible = torch.arange(L, device="cuda")[None, :] <= torch.arange(cached, L, device="cuda")[:, None]
        s = s.masked_fill(~visible[None], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v))
        row += new
    return torch.cat(outs)


def main(argv=None) -> int:
    from flared.execution.graphs import time_graph_us
    from flared.model.triton_attention import PREFILL_CONFIG, paged_prefill_attention_varlen

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8b,135m")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--cases", default="", help="comma-separated case numbers (default: all)")
    ap.add_argument("--l2", choices=("hot", "cold"), default="hot")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(";") if v.strip()]
    cases = CASES if not args.cases else [CASES[int(i)] for i in args.cases.split(",")]
    stream = torch.cuda.Stream()
    page = 16
    result: dict = {"config": PREFILL_CONFIG}
    print(f"PREFILL_CONFIG {PREFILL_CONFIG}", flush=True)
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        nh, nkv, d, layers = shape["nh"], shape["nkv"], shape["d"], shape["layers"]
        scale = d ** -0.5
        for case_name, metas, capacity in cases:
            regions = layers if args.l2 == "cold" else 1
            q, k_pool, v_pool, tables, meta = operands(shape, metas, capacity, page, regions)
            out = torch.empty(regions, capacity, nh, d, device="cuda", dtype=torch.bfloat16)
            ref = reference(q, k_pool, v_pool, tables, metas, page, scale)
            rows = ref.shape[0]
            flops = causal_flops(metas, nh, d)
            print(f"== {shape_name} {case_name} (capacity {capacity}, L2 {args.l2}): {flops / 1e9:.2f} GFLOP a layer",
                  flush=True)
            print(f"{'us/layer':>9} {'TFLOP/s':>8} {'rel err':>9}  variant", flush=True)
            key = f"{shape_name} {case_name}"
            result[key] = {}
            for text in variants:
                cfg = parse_variant(text)

                def run(cfg=cfg):
                    for layer in range(layers):
                        r = layer % regions
                        paged_prefill_attention_varlen(q[r], k_pool[r], v_pool[r], out[r], tables, meta,
                                                       page_tokens=page, scale=scale, config=cfg)

                try:
                    us = time_graph_us(run, stream, replays=5) / layers
                except Exception as exc:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
                    print(f"{'-':>9} {'-':>8} {'-':>9}  {text}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                err = float((out[0, :rows].float() - ref).norm() / ref.norm())
                print(f"{us:9.1f} {flops / us / 1e6:8.0f} {err:9.2e}  {text}", flush=True)
                result[key][text] = {"us": us, "tflops": flops / us / 1e6, "rel_err": err}
            # References: torch's fused attention over the same sequences, K/V contiguous and heads repeated
            # (transformers' layout), one sequence at a time; a cached prefix needs an explicit mask.
            seqs = []
            row = 0
            for b, (cached, new) in enumerate(metas):
                L = cached + new
                qs = q[0, row:row + new].transpose(0, 1).unsqueeze(0).contiguous()
                k = seq_kv(k_pool[0], tables[b], L, page).transpose(0, 1).unsqueeze(0).contiguous()
                v = seq_kv(v_pool[0], tables[b], L, page).transpose(0, 1).unsqueeze(0).contiguous()
                k = k.repeat_interleave(nh // nkv, dim=1)
                v = v.repeat_interleave(nh // nkv, dim=1)
                mask = None
                if cached:
                    mask = torch.arange(L, device="cuda")[None, :] <= torch.arange(cached, L, device="cuda")[:, None]
                seqs.append((qs, k, v, mask))
                row += new
            from torch.nn.attention import SDPBackend, sdpa_kernel

            for backend_name, backend in (("torch sdpa flash", SDPBackend.FLASH_ATTENTION),
                                          ("torch sdpa cudnn", SDPBackend.CUDNN_ATTENTION),
                                          ("torch sdpa efficient", SDPBackend.EFFICIENT_ATTENTION)):
                def ref_run(backend=backend):
                    with sdpa_kernel(backend):
                        for qs, k, v, mask in seqs:
                            if mask is None:
                                F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale)
                            else:
                                F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)

                try:
                    us = time_graph_us(ref_run, stream, calls_per_graph=layers, replays=5)
                except Exception as exc:  # noqa: BLE001 - a backend that refuses a case is reported
                    print(f"{'-':>9} {'-':>8} {'-':>9}  {backend_name}: {type(exc).__name__}: {str(exc)[:120]}",
                          flush=True)
                    continue
                print(f"{us:9.1f} {flops / us / 1e6:8.0f} {'':>9}  {backend_name} (reference)", flush=True)
                result[key][backend_name] = {"us": us, "tflops": flops / us / 1e6}
            torch.cuda.empty_cache()
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
