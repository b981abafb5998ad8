"""Where a decode step's GPU time goes besides its graph: the executor's per-step work on
the model stream (events, the input upload, the graph launch, the completion copy on the copy stream)
timed piece by piece around the real captured decode graph of ``--concurrency`` rows (default 1).

    python tools/probe_step_gaps.py [--shapes 135m,8b] [--concurrency 1] [--steps 200] [--json]

Random weights (bench_gpu's shapes), the real GraphExecutor and scheduler: one warm 256-token drive
first (so the graph's inputs hold a real step at context ~384), then each variant launches the same
decode graph ``--steps`` times back to back; microseconds per step from two events around the loop.
CUDA only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

UPLOAD_KERNEL = r"""
extern "C" __global__ void upload(const unsigned long long* __restrict__ src, unsigned long long* dst, int words) {
    for (int i = threadIdx.x; i < words; i += blockDim.x) dst[i] = src[i];
}
"""


def main(argv=None) -> int:
    import cupy

    from bench_gpu import graph_executor, make_hf, prompts, run_flared, serving
    from flared.execution import cuda

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="135m,8b")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=1, help="streams of the drive, rows of the timed graph")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out: dict = {}
    rows = []
    upload = cupy.RawKernel(UPLOAD_KERNEL, "upload")
    for shape in args.shapes.split(","):
        hf = make_hf(shape, torch.bfloat16)
        model = serving(hf, torch.bfloat16)
        del hf
        torch.cuda.empty_cache()
        streams = args.concurrency
        pair = graph_executor(model, concurrency=streams, num_pages=64 * streams)
        sched, ex = pair
        vocab = model.config.vocab_size
        run_flared(model, prompts(vocab, streams, 128, seed=40), 16, ex_pair=pair)
        r = run_flared(model, prompts(vocab, streams, 128, seed=4), 256, ex_pair=pair)
        tps = 255 * streams / ((max(r.finish_ns) - max(r.first_token_ns)) / 1e9)
        gpu_us = r.decode_gpu_ns / max(1, r.steps_by_kind["DECODE"]) / 1e3
        key = ex.graphs.pick_decode(streams, False, 384)
        gexec = ex.graphs.graph_execs[key]
        offset, nbytes = ex.manifest.decode_upload(key[1])
        stream = ex._model_ptr
        copy_stream = ex._copy_ptr
        host = ex._in_frames[0]
        dst = ex._input_ptr + offset
        src = host.ptr + offset
        tok_host = ex._token_frames[0].ptr
        sampled = ex._sampled_ptr
        ev = [cuda.Event() for _ in range(4)]
        a, b = cuda.Event(), cuda.Event()
        words = (nbytes + 7) // 8
        cp_stream = cupy.cuda.ExternalStream(stream)

        def timed(body) -> float:
            for _ in range(5):
                body()
            cuda.stream_synchronize(stream)
            a.record(stream)
            for _ in range(args.steps):
                body()
            b.record(stream)
            b.synchronize()
            cuda.stream_synchronize(copy_stream)
            return b.elapsed_ns(a) / args.steps / 1e3

        def graph_only():
            cuda.graph_launch(gexec, stream)

        def memcpy_graph():
            cuda.copy_h2d_async(dst, src, nbytes, stream)
            cuda.graph_launch(gexec, stream)

        def kernel_graph():
            with cp_stream:
                upload((1,), (128,), (cupy.uint64(src), cupy.uint64(dst), cupy.int32(words)))
            cuda.graph_launch(gexec, stream)

        def events_memcpy_graph():
            ev[0].record(stream)
            cuda.copy_h2d_async(dst, src, nbytes, stream)
            cuda.graph_launch(gexec, stream)
            ev[1].record(stream)

        def full_step():  # as GraphExecutor.submit: events, upload, launch, completion copy on the copy stream
            ev[0].record(stream)
            cuda.copy_h2d_async(dst, src, nbytes, stream)
            cuda.graph_launch(gexec, stream)
            ev[1].record(stream)
            cuda.stream_wait_event(copy_stream, ev[1])
            cuda.copy_d2h_async(tok_host, sampled, 8 * streams, copy_stream)
            ev[2].record(copy_stream)

        def full_step_kernel_upload():
            ev[0].record(stream)
            with cp_stream:
                upload((1,), (128,), (cupy.uint64(src), cupy.uint64(dst), cupy.int32(words)))
            cuda.graph_launch(gexec, stream)
            ev[1].record(stream)
            cuda.stream_wait_event(copy_stream, ev[1])
            cuda.copy_d2h_async(tok_host, sampled, 8 * streams, copy_stream)
            ev[2].record(copy_stream)

        variants = [("graph launches only", graph_only), ("+ H2D memcpy of the inputs", memcpy_graph),
                    ("inputs by a copy kernel from pinned memory instead", kernel_graph),
                    ("memcpy + two events", events_memcpy_graph), ("the executor's step (+ D2H on copy stream)", full_step),
                    ("the executor's step, copy-kernel upload", full_step_kernel_upload)]
        res = {}
        for name, body in variants:
            res[name] = timed(body)
        base = res["graph launches only"]
        rows.append((shape, f"drive: {tps:,.0f} tok/s, executor GPU us/step {gpu_us:.0f}, upload {nbytes} B", "", ""))
        for name, us in res.items():
            rows.append((shape, name, f"{us:.1f}", f"{us - base:+.1f}"))
        out[shape] = {"drive_tok_s": tps, "drive_gpu_us": gpu_us, "upload_bytes": nbytes, **res}
        for e in ev + [a, b]:
            e.destroy()
        ex.close()
        del pair, sched, ex, model
        torch.cuda.empty_cache()
    print(f"{'shape':6} {'variant':55} {'us/step':>9} {'vs graph':>9}")
    for shape, name, us, d in rows:
        print(f"{shape:6} {name:55} {us:>9} {d:>9}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
