"""Where a batch-1 decode step's GPU time goes between the captured graph and the executor's own step.

``bench_gpu.py``'s drive times each decode step with the executor's two events (start, the one input upload,
the graph launch, end), and at Llama-3.1-8B it reads ~45 us a step more than ``bench_decode_step.py`` times
the same megakernel graph replayed back to back. This probe builds the executor as the bench does, drives one
128-token prompt for 256 tokens (the executor's step times), then, on the executor's own decode graph and
inputs with the context rewritten, times per step at each ``--context``:

- ``graph``: the graph launched back to back, one event pair around all of them;
- ``upload+graph``: the executor's upload (``ExecutionManifest.decode_upload``) before every launch;
- ``events``: upload and launch between a start and end event per step, as the executor times a step;
- ``drive``: the executor's own step times from the drive at that context (+-8 tokens);
- ``graph`` again with the sequence's page table replaced (``--tables``): ``ascending`` (pages 0, 1, 2, ...:
  what ``bench_decode_step.py`` gives its rows), ``descending``, ``random`` (a fixed shuffle of the pool),
  ``far`` (ascending from the pool's last pages). The pages hold other keys then; the times do not depend on them.

    python tools/probe_step_overhead.py [--shape 8b] [--context 192,280,344] [--json]

CUDA only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def main(argv=None) -> int:
    from bench_gpu import PAGE_TOKENS, SHAPES, graph_executor, make_hf, prompts, run_flared, serving

    from flared.execution import cuda

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--context", default="192,280,344")
    ap.add_argument("--launches", type=int, default=60)
    ap.add_argument("--tables", default="ascending,descending,random,far")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    contexts = [int(c) for c in args.context.split(",")]
    prompt_len, new_tokens = 128, 256

    hf = make_hf(args.shape, torch.bfloat16)
    model = serving(hf, torch.bfloat16)
    del hf
    torch.cuda.empty_cache()
    with torch.inference_mode():
        sched, ex = graph_executor(model)
        vocab = SHAPES[args.shape]["vocab_size"]
        run_flared(model, prompts(vocab, 1, prompt_len, seed=40), 16, ex_pair=(sched, ex))
        r = run_flared(model, prompts(vocab, 1, prompt_len, seed=4), new_tokens, ex_pair=(sched, ex))
    steps = r.decode_step_ns  # step i attends over prompt_len + i + 1 tokens

    key = ex.graphs.pick_decode(1, False, max(contexts))
    exec_ptr = ex.graphs.graph_execs[key]
    cap = key[1]
    stream = ex._model_ptr
    P = PAGE_TOKENS
    offset, nbytes = ex.manifest.decode_upload(cap)
    frame = 0
    v = ex._in_views[frame]
    src = ex._in_frames[frame].ptr + offset
    dst = ex._input_ptr + offset
    table = np.array(v["decode_block_tables"][0])
    start, end = cuda.Event(), cuda.Event()
    pairs = [(cuda.Event(), cuda.Event()) for _ in range(args.launches)]

    def set_context(c: int, pages=table) -> None:
        v["decode_block_tables"][0, :len(pages)] = pages
        v["decode_positions"][0] = c - 1
        v["decode_context_lens"][0] = c
        v["decode_slot_ids"][0] = int(pages[(c - 1) // P]) * P + (c - 1) % P
        v["decode_temperature"][0] = 0.0
        cuda.copy_h2d_async(dst, src, nbytes, stream)
        cuda.stream_synchronize(stream)

    def timed(upload: bool) -> float:
        for _ in range(3):
            cuda.graph_launch(exec_ptr, stream)
        start.record(stream)
        for _ in range(args.launches):
            if upload:
                cuda.copy_h2d_async(dst, src, nbytes, stream)
            cuda.graph_launch(exec_ptr, stream)
        end.record(stream)
        end.synchronize()
        return end.elapsed_ns(start) / args.launches / 1e3

    def per_step_events() -> float:
        for a, b in pairs:
            a.record(stream)
            cuda.copy_h2d_async(dst, src, nbytes, stream)
            cuda.graph_launch(exec_ptr, stream)
            b.record(stream)
        pairs[-1][1].synchronize()
        return sum(b.elapsed_ns(a) for a, b in pairs) / len(pairs) / 1e3

    used = -(-(prompt_len + new_tokens) // P)
    num_pages = ex.decoder.num_pages
    rng = np.random.default_rng(0)
    tables = {"ascending": np.arange(used), "descending": np.arange(used)[::-1].copy(),
              "random": rng.permutation(num_pages)[:used], "far": np.arange(num_pages - used, num_pages)}
    names = [t for t in args.tables.split(",") if t]
    out = {"key": list(key), "upload_bytes": nbytes, "drive_table": table[:used].tolist(), "pool_pages": num_pages,
           "rows": []}
    print(f"graph {key}, upload {nbytes} bytes, {len(steps)} drive steps, pool {num_pages} pages")
    print(f"the drive's page table: {table[:used].tolist()}")
    print(f"{'context':>7} {'graph':>9} {'upload+graph':>13} {'events':>9} {'drive':>9}"
          + "".join(f" {n:>10}" for n in names))
    for c in contexts:
        set_context(c)
        g = timed(False)
        ug = timed(True)
        ev = per_step_events()
        near = [d for i, d in enumerate(steps) if abs(prompt_len + i + 1 - c) <= 8]
        drive = sum(near) / len(near) / 1e3 if near else float("nan")
        row = {"context": c, "graph_us": g, "upload_graph_us": ug, "events_us": ev, "drive_us": drive}
        for n in names:
            set_context(c, tables[n])
            row[n] = timed(False)
        set_context(c)
        print(f"{c:7d} {g:9.1f} {ug:13.1f} {ev:9.1f} {drive:9.1f}" + "".join(f" {row[n]:10.1f}" for n in names))
        out["rows"].append(row)
    ex.close()
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
