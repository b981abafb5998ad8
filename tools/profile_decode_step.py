"""Kernel by kernel, where the real captured decode graph's GPU time goes at a given batch.

    python tools/profile_decode_step.py [--shapes 8b] [--rows 64] [--new-tokens 128] [--steps 20] [--json]
    python tools/profile_decode_step.py --prefill-tokens 2048 [--shapes 8b] [--steps 5]

Random weights (bench_gpu's shapes), the real GraphExecutor and scheduler: ``--rows`` streams of
128-token prompts decode ``--new-tokens`` tokens each, so the graph's inputs hold a real step at context
~128 + new tokens. The decode graph of that batch is then launched ``--steps`` times under torch's
profiler (CUPTI traces the kernels inside graph launches); kernels are summed by name per step, beside
the step's time from two events. With ``--prefill-tokens T`` the graph profiled is instead the one-sequence
prefill graph of T tokens, its inputs those of a fresh T-token prompt (the bench's TTFT case). CUDA only.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402


def main(argv=None) -> int:
    from bench_gpu import graph_executor, make_hf, prompts, run_flared, serving
    from flared.execution import cuda

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8b")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prefill-tokens", type=int, default=0, help="profile this prefill graph instead")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out: dict = {}
    for shape in args.shapes.split(","):
        hf = make_hf(shape, torch.bfloat16)
        model = serving(hf, torch.bfloat16)
        del hf
        torch.cuda.empty_cache()
        pair = graph_executor(model)
        sched, ex = pair
        vocab = model.config.vocab_size
        if args.prefill_tokens:
            run_flared(model, prompts(vocab, 1, args.prefill_tokens, seed=40), 1, ex_pair=pair)
            r = run_flared(model, prompts(vocab, 1, args.prefill_tokens, seed=4), 1, ex_pair=pair)
            drive_us = r.first_token_ns[0] / 1e3
            key = ex.graphs.pick("prefill", args.prefill_tokens, batch=1)
            what = f"one {args.prefill_tokens}-token prompt"
            drive_what = "drive's TTFT"
        else:
            run_flared(model, prompts(vocab, args.rows, 128, seed=40), 4, ex_pair=pair)
            r = run_flared(model, prompts(vocab, args.rows, 128, seed=4), args.new_tokens, ex_pair=pair)
            steps = r.steps_by_kind["DECODE"]
            drive_us = r.decode_gpu_ns / max(1, steps) / 1e3
            context = 128 + args.new_tokens
            key = ex.graphs.pick_decode(args.rows, False, context)
            what = f"{args.rows} rows, context ~{context}"
            drive_what = "drive's decode steps"
        gexec = ex.graphs.graph_execs[key]
        stream = ex._model_ptr
        a, b = cuda.Event(), cuda.Event()
        for _ in range(3):
            cuda.graph_launch(gexec, stream)
        cuda.stream_synchronize(stream)
        a.record(stream)
        for _ in range(args.steps):
            cuda.graph_launch(gexec, stream)
        b.record(stream)
        b.synchronize()
        step_us = b.elapsed_ns(a) / args.steps / 1e3
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                cuda.graph_launch(gexec, stream)
            cuda.stream_synchronize(stream)
        per_name: dict = defaultdict(lambda: [0, 0.0])
        first_ts = None
        last_end = None
        for ev in prof.events():
            if ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
            name = ev.name
            if "Memcpy" in name or "Memset" in name:
                continue
            per_name[name][0] += 1
            per_name[name][1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            s = ev.time_range.start
            e = ev.time_range.end
            first_ts = s if first_ts is None else min(first_ts, s)
            last_end = e if last_end is None else max(last_end, e)
        total_kernel_us = sum(v[1] for v in per_name.values()) / args.steps
        span_us = (last_end - first_ts) / args.steps if first_ts is not None else 0.0
        table = sorted(((n, c / args.steps, us / args.steps) for n, (c, us) in per_name.items()),
                       key=lambda t: -t[2])
        print(f"== {shape}, {what}: graph {key}, step {step_us:.0f} us by events "
              f"({drive_what} {drive_us:.0f} us); kernels sum {total_kernel_us:.0f} us, profiled span "
              f"{span_us:.0f} us per step")
        print(f"{'us/step':>9} {'calls':>6} {'us/call':>8}  kernel")
        for n, c, us in table:
            print(f"{us:9.1f} {c:6.0f} {us / max(c, 1e-9):8.2f}  {n[:110]}")
        out[shape] = {"graph": list(key), "step_us": step_us, "drive_us": drive_us,
                      "kernel_sum_us": total_kernel_us, "span_us": span_us,
                      "kernels": [[n[:120], c, round(us, 2)] for n, c, us in table]}
        a.destroy()
        b.destroy()
        ex.close()
        del pair, sched, ex, model
        torch.cuda.empty_cache()
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
