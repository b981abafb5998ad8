"""GPU time of one decode step, as a captured CUDA graph, under each launch variant (same run, same weights).

A decode step's graph (``PagedCudaDecoder.decode``: every layer, the LM head and greedy sampling) is
captured and replayed for each variant, all in one process on the same random weights of the
SmolLM2-135M and Llama-3.1-8B shapes, with every row at ``--context`` tokens of a filled KV cache (a comma
list times each context on the same build):

- ``cublas``: cuBLAS products + the small fused kernels (what batches over 16 rows run);
- ``skinny``: the five-kernel fused layer (kernels/skinny.py), where the batch fits it;
- ``lt``: the same products through cuBLASLt (``torch.backends.cuda.preferred_blas_library``);
- ``mega``: every layer in one persistent kernel (kernels/megakernel.py), where the batch fits it, with the
  LM head and greedy argmax inside it; ``mega nohead``: the same with the LM head and sampling after it;
- ``cuda``: the decode attention through the CUDA kernel (kernels/decode_attention.cu, FLARED_CUDA_ATTENTION=1)
  where it applies; every other variant runs the Triton one;
- ``attn=N``: decode attention over N context splits (1 = the one-pass kernel) instead of
  ``decode_splits``' choice; a products64 variant takes the word ``splits=N`` for the same
  ("products64 pdl norms attn splits=2": any mix of the products64 words names a variant).

Each row gives microseconds per step, the step's weight bytes over that time against the bandwidth floor
(weights / 4.25 TB/s, the H200's measured copy rate), and whether its greedy tokens and logits equal the
first variant's.

    python tools/bench_decode_step.py [--shapes 135m,8b] [--batches 1,4,16,64] [--context 512[,1024...]]
                                      [--pool-pages N] [--kv-cache-dtype auto|fp8] [--profile] [--json]

``--profile`` also replays each variant's graph under torch.profiler and prints where its GPU time goes, kernel
by kernel (products64 launches named qkv / o / gate_up / down by their order in a layer). With programmatic
dependent launches a kernel's span includes its early start, so the spans add up to more than the step.

CUDA only. Prints one table; with --json, one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

COPY_TB_S = 4.25
PAGE_TOKENS = 16
VARIANTS = {  # name: (skinny kernels, BLAS library, attention splits (None = decode_splits' choice))
    "cublas": (False, "cublas", None),
    "skinny": (True, "cublas", None),
    "mega": (False, "cublas", None),
    "mega nohead": (False, "cublas", None),
    "cublas lt": (False, "cublaslt", None),
    "products64": (False, "cublaslt", None),  # the four products per layer through kernels/products64.py
    "products64 tiled": (False, "cublaslt", None),  # the same, qkv, o and down from tile-by-tile weight copies
    # with the add_rms_norm launches folded into the products and/or programmatic dependent launches
    "products64 norms": (False, "cublaslt", None),
    "products64 pdl": (False, "cublaslt", None),
    "products64 pdl norms": (False, "cublaslt", None),
    "products64 tiled pdl norms": (False, "cublaslt", None),
    "products64 pdl norms attn": (False, "cublaslt", None),  # and the attention between qkv and o with PDL too
    # "cuda": the decode attention through kernels/decode_attention.cu where it applies (the others: Triton)
    "products64 pdl norms attn cuda": (False, "cublaslt", None),
    "cublas lt cuda": (False, "cublaslt", None),
    "cublas attn=1": (False, "cublas", 1),
    "cublas attn=2": (False, "cublas", 2),
    "cublas attn=4": (False, "cublas", 4),
    "cublas lt attn=2": (False, "cublaslt", 2),
    "mega hx0": (False, "cublas", None),
    "mega hx6": (False, "cublas", None),
    "mega no stage o": (False, "cublas", None),
    "mega splits 4": (False, "cublas", None),
    "mega res 256": (False, "cublas", None),
    "mega no pairs": (False, "cublas", None),
    "mega pairs 257": (False, "cublas", None),
    "mega pairs 129": (False, "cublas", None),
    "mega quads 129": (False, "cublas", None),
    "mega quads 257": (False, "cublas", None),
}
# megakernel variants built with replaced compile-time constants (megakernel.DecodeLayers' overrides)
MEGA_OVERRIDES = {
    "mega hx0": {"HX": 0},  # every phase boundary a grid barrier (before the sixteenth session)
    "mega hx6": {"HX": 6},  # P1 -> P2 -> P3 by grid barriers (past the resident keys: before the seventeenth)
    "mega no stage o": {"STAGE_O": 0},  # the first o rows prefetched into L2 during attention (before the eighteenth)
    "mega splits 4": {"SPLITS": 4},  # past the resident keys, each head's attention in up to 4 pieces (not 2)
    # 16 fewer resident keys at 8B (the build before the nineteenth session): resident up to 304 tokens, not 320
    "mega res 256": {"RES_CAP": 256},
    # past one block's resident keys (320 at 8B) the split path, as before the twenty-second session, not a pair of
    # resident blocks per kv head
    "mega no pairs": {"RES_SPLIT": 1 << 30, "RES_SPLIT4": 0},
    "mega pairs 257": {"RES_SPLIT": 257, "RES_SPLIT4": 0},  # pairs from 257 tokens, never four blocks
    "mega pairs 129": {"RES_SPLIT": 129, "RES_SPLIT4": 0},  # and from 129
    "mega quads 129": {"RES_SPLIT4": 129},  # four resident blocks a kv head from 129 tokens
    "mega quads 257": {"RES_SPLIT4": 257},  # and from 257
}


def build(shape: str, max_batch: int, context: int, pool_pages: int = 0, kv_cache_dtype: str = "auto"):
    from bench_gpu import make_hf, serving

    from flared.model.kernels.paged_decoder import PagedCudaDecoder, StaticInputs
    from flared.model.kv_cache import kv_pool_dtype

    hf = make_hf(shape, torch.bfloat16)
    model = serving(hf, torch.bfloat16)
    del hf
    torch.cuda.empty_cache()
    dev = model.device
    pages_per_row = -(-(context + 1) // PAGE_TOKENS)
    num_pages = max(max_batch * pages_per_row, pool_pages)  # a daemon's pool spreads each layer's keys wide
    b, t = max_batch, max_batch
    i64, i32, f32 = torch.int64, torch.int32, torch.float32
    inputs = StaticInputs(
        token_ids=torch.randint(3, model.config.vocab_size, (t,), device=dev),
        positions=torch.full((t,), context - 1, dtype=i64, device=dev),
        slot_ids=torch.empty(t, dtype=i64, device=dev),
        state_rows=torch.arange(1, b + 1, dtype=i64, device=dev),
        block_tables=torch.arange(b * pages_per_row, dtype=i32, device=dev).view(b, pages_per_row),
        context_lens=torch.full((b,), context, dtype=i32, device=dev),
        chunk_meta=torch.zeros(b, 2, dtype=i32, device=dev),
        logit_rows=torch.zeros(b, dtype=i64, device=dev),
        temperature=torch.zeros(b, dtype=f32, device=dev),
        top_k=torch.zeros(b, dtype=i32, device=dev),
        top_p=torch.ones(b, dtype=f32, device=dev),
        seeds=torch.zeros(b, dtype=i64, device=dev),
        steps=torch.zeros(b, dtype=i64, device=dev))
    set_context(inputs, context)
    dec = PagedCudaDecoder(model, inputs, num_pages=num_pages, page_tokens=PAGE_TOKENS, num_state_rows=b + 1,
                           max_batch=b, max_tokens=t, kv_dtype=kv_pool_dtype(kv_cache_dtype, model.dtype))
    # A filled cache: attention reads real-looking K/V at every position.
    g = torch.Generator(device=dev).manual_seed(0)
    for pool in (dec.k_pool, dec.v_pool):
        pool.copy_(torch.randn(pool.shape, device=dev, generator=g).to(pool.dtype))
    weight_bytes = sum(p.numel() * p.element_size() for layer in model.layers
                       for p in (layer.qkv.weight, layer.o.weight, layer.gate_up.weight, layer.down.weight))
    weight_bytes += model.lm_head.numel() * model.lm_head.element_size()
    return model, dec, weight_bytes


def set_context(inputs, context: int) -> None:
    """Every row at ``context`` tokens: its position, its length and the slot its new key goes to."""
    inputs.positions.fill_(context - 1)
    inputs.context_lens.fill_(context)
    inputs.slot_ids.copy_(inputs.block_tables[:, (context - 1) // PAGE_TOKENS].long() * PAGE_TOKENS
                          + (context - 1) % PAGE_TOKENS)


def profile_graph(dec, batch: int, stream, replays: int = 5) -> list[tuple[str, int, float]]:
    """(kernel, launches a step, us a step) of the decode step's graph, the costliest first."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        dec.decode(batch, False)  # warm (compiles) outside the capture
    stream.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        dec.decode(batch, False)
    graph.replay()
    torch.cuda.synchronize()
    products = ("qkv", "o", "gate_up", "down")
    seen = [0]

    def product_named(name: str) -> str:  # products64 launches by their order in a layer
        if "products64" not in name:
            return name
        seen[0] += 1
        return f"products64 {products[(seen[0] - 1) % 4]}"

    kernels = kernel_times(graph, replays, product_named)
    del graph
    return kernels


def kernel_times(graph, replays: int = 5, rename=None) -> list[tuple[str, int, float]]:
    """(kernel, launches a replay, us a replay) of a captured graph under torch.profiler, the costliest first;
    ``rename`` maps each launch's kernel name, in launch order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    totals: dict[str, list] = {}
    for e in kernels:
        name = rename(e.name) if rename else e.name
        if len(name) > 60:
            name = name[:57] + "..."
        t = totals.setdefault(name, [0, 0.0])
        t[0] += 1
        t[1] += e.time_range.end - e.time_range.start
    return sorted(((n, c // replays, us / replays) for n, (c, us) in totals.items()), key=lambda r: -r[2])


def apply_variant(dec, batch: int, variant: str) -> tuple[str, int | None] | None:
    """Set ``dec`` up to run ``variant`` at ``batch`` rows (None where it cannot): returns the BLAS library it
    selected and the attention splits it asks for (None: decode_splits' choice)."""
    from flared.model.kernels import skinny

    # a products64 variant may also be named by its words in any mix ("products64 pdl norms attn splits=2")
    use_skinny, blas, splits = VARIANTS.get(variant) or VARIANTS[variant.split()[0]]
    if use_skinny and batch > skinny.MAX_ROWS:
        return None
    mega = variant.startswith("mega")
    if mega and batch > dec.mega_limit:
        return None
    if variant.startswith("products64") and batch not in dec.p64_candidates:
        return None
    dec.p64_batches = {batch} if variant.startswith("products64") else set()
    words = set(variant.split()[1:]) if variant.startswith("products64") else set()
    setup = ("tiled" in words, "norms" in words, "pdl" in words)
    if (dec.p64_tiled, dec.p64_fold, dec.p64_pdl) != setup:  # other builds (or the other weight layout's maps)
        (dec.p64_tiled, dec.p64_fold, dec.p64_pdl), dec._p64 = setup, None
    dec.attn_pdl = "attn" in words
    dec.attn_build = dec.cuda_attention_build() if "cuda" in variant.split() else None
    dec.skinny_max_rows = skinny.MAX_ROWS if use_skinny else 0
    dec.mega_max_rows = batch if mega else 0
    dec.mega_head = variant != "mega nohead"
    torch.backends.cuda.preferred_blas_library(blas)
    splits = next((int(w[7:]) for w in words if w.startswith("splits=")), splits)
    return blas, splits


def run_variant(dec, batch: int, variant: str, stream, profile: bool = False):
    from flared.execution.graphs import time_graph_us
    from flared.model.kernels import paged_decoder

    applied = apply_variant(dec, batch, variant)
    if applied is None:
        return None
    _, splits = applied
    key, replaced = (batch, dec.mega_head), None
    if variant in MEGA_OVERRIDES:
        from flared.model.kernels import megakernel

        replaced = dec.mega.pop(key, None)
        dec.mega[key] = megakernel.DecodeLayers(dec.model, dec.k_pool, dec.v_pool, batch, head=dec.mega_head,
                                                overrides=MEGA_OVERRIDES[variant])
        dec.mega[key].compile(dec.page_tokens)
    chosen = paged_decoder.decode_splits
    if splits is not None:
        paged_decoder.decode_splits = lambda *args, **kwargs: splits
    try:
        us = time_graph_us(lambda: dec.decode(batch, False), stream, replays=30)
        kernels = profile_graph(dec, batch, stream) if profile else None
        with torch.cuda.stream(stream):
            dec.decode(batch, False)
        stream.synchronize()
    finally:
        paged_decoder.decode_splits = chosen
        dec.p64_batches = set()
        torch.backends.cuda.preferred_blas_library("cublas")
        if variant in MEGA_OVERRIDES:
            dec.mega.pop(key, None)
            if replaced is not None:
                dec.mega[key] = replaced
    return us, dec.sampled[:batch].tolist(), dec.logits[:batch].clone(), kernels


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="135m,8b")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--context", default="512", help="tokens per row; a comma list times each")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--pool-pages", type=int, default=0,
                    help="KV pool pages (default: the rows' own); bench_gpu's executor has 4,096 (134 MB a layer at 8B)")
    ap.add_argument("--profile", action="store_true", help="each variant's GPU time kernel by kernel")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                    help="the KV pool's element type (fp8: float8 e4m3; the megakernel and CUDA attention skip it)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.context.split(",")]
    result = {"context": contexts[0] if len(contexts) == 1 else contexts, "copy_tb_s": COPY_TB_S,
              "kv_cache_dtype": args.kv_cache_dtype}
    print(f"{'shape':6} {'batch':>5} {'context':>7}  {'variant':18} {'us/step':>9} {'% of floor':>10}"
          f"  {'tokens = first':>14}  {'max |logit diff|':>16}")
    stream = torch.cuda.Stream()
    for shape in args.shapes.split(","):
        model, dec, weight_bytes = build(shape, max(batches), max(contexts), args.pool_pages, args.kv_cache_dtype)
        floor_us = weight_bytes / (COPY_TB_S * 1e12) * 1e6
        result[f"{shape}_floor_us"] = round(floor_us, 1)
        for context in contexts:
            set_context(dec.decode_inputs, context)
            for batch in batches:
                ref = None
                for variant in args.variants.split(","):
                    got = run_variant(dec, batch, variant, stream, args.profile)
                    if got is None:
                        continue
                    us, tokens, logits, kernels = got
                    if ref is None:
                        ref = (tokens, logits)
                    same = sum(a == b for a, b in zip(tokens, ref[0]))
                    diff = (logits - ref[1]).abs().max().item()
                    print(f"{shape:6} {batch:>5} {context:>7}  {variant:18} {us:9.1f} {floor_us / us:10.0%}"
                          f"  {same:>6}/{batch:<7}  {diff:16.4f}", flush=True)
                    key = f"{shape}|{batch}|{variant}" if len(contexts) == 1 else f"{shape}|{batch}|{context}|{variant}"
                    result[key] = {"us": round(us, 1), "tokens_same": same, "logit_diff": round(diff, 4)}
                    if kernels is not None:
                        for name, count, kus in kernels[:14]:
                            print(f"{'':22} {kus:9.1f} us  {count:4d} x  {name}", flush=True)
                        print(f"{'':22} {sum(r[2] for r in kernels):9.1f} us  in all (spans)", flush=True)
                        result[key]["profile"] = {name: round(kus, 1) for name, _, kus in kernels}
        del model, dec
        torch.cuda.empty_cache()
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
