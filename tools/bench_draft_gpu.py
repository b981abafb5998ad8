"""A draft model's proposals on a GPU: its forwards as CUDA graphs (DraftGraphs) against the same draft model run
eagerly (flared.execution.drafter.DraftModel, graphs=False), same weights, same requests, same run.

Random weights of a shape (SmolLM2-135M's by default, bf16). Each of ``rows`` requests gets a 128-token prompt (the
proposals that catch the draft model up are not timed); then every round each request takes its drafts and one more
token (as if the served model kept them all) and the draft model proposes ``depth`` more. Reported: milliseconds a
proposal (every depth, host to host), a forward, and eager / graphs.

    python3 tools/bench_draft_gpu.py [--shape 135m] [--rows 1,8,32,64] [--depth 4] [--rounds 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def proposals_ms(drafter, rows: int, depth: int, rounds: int, vocab: int, seed: int = 0) -> tuple[float, list]:
    """Mean ms a proposal over ``rounds`` (after the untimed catch-up), and every round's drafts."""
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(3, vocab, 128).tolist() for _ in range(rows)]
    handles = list(range(1, rows + 1))
    for _ in range(64):  # the catch-up goes in CATCH_UP_TOKENS a proposal
        drafts, _ = drafter.propose(handles, seqs, [depth] * rows)
        if all(drafts):
            break
    times, out = [], []
    for r in range(rounds + 1):
        seqs = [s + list(d) + [int(rng.integers(3, vocab))] for s, d in zip(seqs, drafts)]
        torch.cuda.synchronize()
        t = time.perf_counter()
        drafts, _ = drafter.propose(handles, seqs, [depth] * rows)
        if r:  # (the first short round compiles nothing, but warms the caches)
            times.append(time.perf_counter() - t)
        out.append(drafts)
    for h in handles:
        drafter.release(h)
    return 1e3 * float(np.mean(times)), out


def main(argv=None) -> int:
    from bench_gpu import make_hf, serving

    from flared.execution.drafter import DraftModel

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="135m")
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows_list = [int(x) for x in args.rows.split(",")]
    model = serving(make_hf(args.shape, torch.bfloat16), torch.bfloat16)
    vocab = model.config.vocab_size
    kw = dict(num_pages=max(rows_list) * 16 + 2, page_tokens=16, max_context=1024, vocab_limit=vocab)
    t = time.perf_counter()
    graphs = DraftModel(model, graphs=True, max_rows=max(rows_list), max_depth=args.depth, **kw)
    capture_s = time.perf_counter() - t
    eager = DraftModel(model, graphs=False, **kw)
    print(f"{args.shape} draft model, bf16, depth {args.depth}: graphs captured in {capture_s:.1f} s")
    print(f"{'rows':>5} {'eager ms':>9} {'graphs ms':>9} {'eager/graphs':>12} {'graphs ms a forward':>19} "
          f"{'same drafts':>11}")
    result = {"shape": args.shape, "depth": args.depth, "capture_s": round(capture_s, 2), "rows": {}}
    for rows in rows_list:
        e_ms, e_out = proposals_ms(eager, rows, args.depth, args.rounds, vocab)
        g_ms, g_out = proposals_ms(graphs, rows, args.depth, args.rounds, vocab)
        same = sum(a == b for ra, rb in zip(e_out, g_out) for a, b in zip(ra, rb))
        total = sum(len(r) for r in e_out)
        print(f"{rows:>5} {e_ms:9.2f} {g_ms:9.2f} {e_ms / g_ms:11.2f}x {g_ms / args.depth:19.3f} {same:>5}/{total:<5}",
              flush=True)
        result["rows"][rows] = {"eager_ms": round(e_ms, 3), "graphs_ms": round(g_ms, 3),
                                "ratio": round(e_ms / g_ms, 2), "same_drafts": same, "drafts": total}
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
