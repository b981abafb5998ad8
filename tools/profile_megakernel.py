"""Where the decode megakernel's time goes: the kernel alone, captured in a graph, per compile-time variant.

No hardware counters on the lent machine, so time is placed by difference: each variant recompiles the
kernel (kernels/decode_layers.cu) with one phase's work left out (``SKIP``: its barrier stays), or with
every phase left out (the barriers alone), or with another thread count, L2 prefetch depth or number of
weight loads a streamed row issues together (``GEMV_BATCH``). Results of the variants
are wrong by construction; only their times matter. Random weights of the SmolLM2-135M and
Llama-3.1-8B shapes, every row at ``--context`` tokens of a filled KV cache (a comma list times each
variant at each context, one model build per shape).

    python tools/profile_megakernel.py [--shapes 135m,8b] [--rows 1] [--context 512[,256,...]] [--head] [--json]

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

VARIANTS = {  # names may not contain commas (--variants splits on them)
    "full": {},
    "no P1 (norm+qkv)": {"SKIP": 1},
    "no P2 (attention)": {"SKIP": 2},
    "no P3 (o)": {"SKIP": 4},
    "no P4 (norm+gate_up)": {"SKIP": 8},
    "no P5 (down)": {"SKIP": 16},
    "barriers only": {"SKIP": 31},
    "256 threads": {"THREADS": 256},
    "512 threads": {"THREADS": 512},
    "512 threads no P2": {"THREADS": 512, "SKIP": 2},
    "prefetch 2 lines": {"PF_LINES": 2},
    "gemv batch 4": {"GEMV_BATCH": 4},
    "gemv batch 16": {"GEMV_BATCH": 16},
    "256 threads gemv batch 16": {"THREADS": 256, "GEMV_BATCH": 16},
    "split keys 64": {"SPLIT_KEYS": 64},
    "split keys 256": {"SPLIT_KEYS": 256},
    "attention unsplit": {"SPLITS": 1},
    "attention splits 8": {"SPLITS": 8},
    "attention splits 4": {"SPLITS": 4},
    # long-row models' splits (megakernel.splits_for) spelled out: pieces of 64 / 32 keys
    "splits 4 keys 64": {"SPLITS": 4, "SPLIT_KEYS": 64},
    "splits 8 keys 32": {"SPLITS": 8, "SPLIT_KEYS": 32},
    "splits 16 keys 32": {"SPLITS": 16, "SPLIT_KEYS": 32},
    "splits 4 keys 32": {"SPLITS": 4, "SPLIT_KEYS": 32},
    "splits 2 keys 64": {"SPLITS": 2, "SPLIT_KEYS": 64},
    "splits 4 keys 64 no P2": {"SPLITS": 4, "SPLIT_KEYS": 64, "SKIP": 2},
    "splits 4 keys 64 no P3": {"SPLITS": 4, "SPLIT_KEYS": 64, "SKIP": 4},
    "head rows 2": {"HEAD_ROWS": 2},
    "head rows 4": {"HEAD_ROWS": 4},
    "head rows 8": {"HEAD_ROWS": 8},
    "ll": {"LL": 1},
    "no ll": {"LL": 0},
    "ll batch 8": {"LL": 1, "LL_BATCH": 8},
    "ll batch 16": {"LL": 1, "LL_BATCH": 16},
    "tile step 32": {"TILE_STEP": 32},
    "tile step 8": {"TILE_STEP": 8},
    # the tagged-word build with its attention split (keys per piece) and V tile step spelled out
    "ll s128 t32": {"LL": 1, "SPLIT_KEYS": 128, "TILE_STEP": 32},
    "ll s64 t32": {"LL": 1, "SPLIT_KEYS": 64, "TILE_STEP": 32},
    "ll s64 t8": {"LL": 1, "SPLIT_KEYS": 64, "TILE_STEP": 8},
    "ll s32 t8": {"LL": 1, "SPLIT_KEYS": 32, "TILE_STEP": 8},
    # P1's units in order (before the balanced slots)
    "p1 in order": {"P1_BALANCE": 0},
    # loads per lane per streamed row (long rows default to megakernel.LONG_ROW_GEMV_BATCH)
    "gemv batch 6": {"GEMV_BATCH": 6},
    "gemv batch 8": {"GEMV_BATCH": 8},
    "gemv batch 10": {"GEMV_BATCH": 10},
    "gemv batch 12": {"GEMV_BATCH": 12},
    "gemv batch 12 pair 8": {"GEMV_BATCH": 12, "GEMV_BATCH_PAIR": 8},
    # the same where a warp streams two rows together (k pairs, gate/up)
    "pair batch 4": {"GEMV_BATCH_PAIR": 4},
    "pair batch 6": {"GEMV_BATCH_PAIR": 6},
    "single batch 4": {"GEMV_BATCH": 4, "GEMV_BATCH_PAIR": 8},
    # one row's attention from resident keys (decode_layers.cu RES; on by default for long-row models at one row)
    "no res": {"RES": 0},
    "res": {"RES": 1},
    "res cap 128": {"RES": 1, "RES_CAP": 128},
    "res cap 192": {"RES": 1, "RES_CAP": 192},
    "res cap 256": {"RES": 1, "RES_CAP": 256},
    "res cap 320": {"RES": 1, "RES_CAP": 320},
    "ldw alloc": {"LDW_NOALLOC": 0},  # weight loads without the L1::no_allocate hint
    "ldw alloc no res": {"LDW_NOALLOC": 0, "RES": 0, "HX": 0},  # the thirteenth session's build
    "ll ldw alloc": {"LL": 1, "LDW_NOALLOC": 0},
    # HX (sixteenth session; the default is 7 with resident attention, else 6): boundaries by tagged words
    "no hx": {"HX": 0},  # a grid barrier at every phase boundary
    "hx1": {"HX": 1},  # with RES: P1 -> P2 -> P3 by words, not two grid barriers a layer
    "hx2": {"HX": 2},  # P3 -> P4 by words
    "hx4": {"HX": 4},  # P5 -> the next P1 by words
    "no stage o": {"STAGE_O": 0},  # the first o rows prefetched into L2, not copied into idle shared memory
    "hx6": {"HX": 6},  # P1 -> P2 -> P3 by grid barriers (past the resident keys, the split path before HX bit 0 took it)
    "res no P2": {"RES": 1, "SKIP": 2},
    "no res no P2": {"RES": 0, "SKIP": 2},
    # plain builds padded to the first resident build's shared memory (8B: 194,288 B, fifteenth session): what a
    # smaller L1 costs
    "no res pad": {"RES": 0, "SMEM_PAD": 194288 - 157412},
    "no res pad alloc": {"RES": 0, "SMEM_PAD": 194288 - 157412, "LDW_NOALLOC": 0},
}


def main() -> int:
    from bench_decode_step import PAGE_TOKENS, build

    from flared.execution.graphs import time_graph_us
    from flared.model.kernels.megakernel import DecodeLayers

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="135m,8b")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--context", default="512", help="tokens per row; a comma list times each")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--head", action="store_true", help="the LM head and greedy argmax inside the kernel too")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = args.rows
    contexts = [int(c) for c in args.context.split(",")]
    result = {"rows": rows, "context": args.context}
    stream = torch.cuda.Stream()
    print(f"{'shape':6} {'variant':22} {'context':>7} {'us/launch':>10} {'vs first':>9}")
    for shape in args.shapes.split(","):
        model, dec, _ = build(shape, rows, max(contexts))
        s = dec.inputs
        h = model.embed[:rows].clone()
        out = torch.empty_like(h)
        first = {}
        for name in args.variants.split(","):
            kernel = DecodeLayers(model, dec.k_pool, dec.v_pool, rows, overrides=VARIANTS[name], head=args.head)
            kernel.compile(PAGE_TOKENS)
            attrs = kernel.kernel.attributes
            print(f"# {name}: {kernel.shared_mem} B shared, {attrs.get('num_regs')} registers, "
                  f"{attrs.get('local_size_bytes')} B local", flush=True)
            head = ((dec.logits, dec.state_logits, s.state_rows[:rows], dec.sampled, dec.last_token, True)
                    if args.head else None)

            def launch():
                kernel(h, out, s.positions[:rows], s.slot_ids[:rows], s.block_tables[:rows], s.context_lens[:rows],
                       head)

            for context in contexts:
                # every row at `context` tokens: its newest position, that position's slot, the length
                s.positions.fill_(context - 1)
                s.context_lens.fill_(context)
                s.slot_ids.copy_(s.block_tables[:, (context - 1) // PAGE_TOKENS].long() * PAGE_TOKENS
                                 + (context - 1) % PAGE_TOKENS)
                us = time_graph_us(launch, stream, replays=30)
                base = first.setdefault(context, us)
                print(f"{shape:6} {name:22} {context:7} {us:10.1f} {us - base:+9.1f}", flush=True)
                key = f"{shape}|{name}" if len(contexts) == 1 else f"{shape}|{name}|{context}"
                result[key] = round(us, 1)
        del model, dec
        torch.cuda.empty_cache()
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
