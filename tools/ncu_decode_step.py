"""One eager decode step inside an NVTX range named ``step``, for Nsight Compute's hardware counters.

Builds the decoder as ``bench_decode_step.py`` does (random weights of the shape, every row at ``--context``
tokens of a filled KV cache), sets it up for one of that tool's variants, warms it, then runs one step eagerly
(the launches a captured graph replays) inside the range. Run it under ncu and keep to the range; skip the
first layers' launches to see a layer in the steady state, e.g. (the twenty-eighth session's call, one 8B
64-row step, kernels 11-22: layers 2 and 3's products and attention):

    ncu --clock-control none --nvtx --nvtx-include "step/" --launch-skip 10 --launch-count 12 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        --section SchedulerStats --section LaunchStats --section Occupancy \\
        --metrics dram__bytes_read.sum,lts__t_bytes.sum,gpu__time_duration.sum \\
        python3 tools/ncu_decode_step.py --shape 8b --batch 64 --context 256 --pool-pages 4096

ncu runs each kernel alone (programmatic dependent launches do not overlap under it) and flushes the caches
before each of its passes, so a kernel's duration there is its whole ramp and tail; the step's own time comes
from ``bench_decode_step.py``. CUDA only.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402


def main() -> int:
    from bench_decode_step import apply_variant, build

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8b", choices=("8b", "135m"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--pool-pages", type=int, default=4096)
    ap.add_argument("--variant", default="products64 pdl norms attn",
                    help="a bench_decode_step.py variant (the default is what the 8B 64-row step runs)")
    ap.add_argument("--warm", type=int, default=3, help="steps before the profiled one")
    args = ap.parse_args()
    t0 = time.perf_counter()
    _, dec, _ = build(args.shape, args.batch, args.context, args.pool_pages)
    applied = apply_variant(dec, args.batch, args.variant)
    if applied is None:
        print(f"{args.variant!r} does not run {args.batch} rows of {args.shape}", file=sys.stderr)
        return 2
    if applied[1] is not None:  # the variant's attention splits
        from flared.model.kernels import paged_decoder

        paged_decoder.decode_splits = lambda *a, splits=applied[1], **k: splits
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(args.warm):
            dec.decode(args.batch, False)
    stream.synchronize()
    print(f"built and warmed in {time.perf_counter() - t0:.0f} s", flush=True)
    torch.cuda.nvtx.range_push("step")
    with torch.cuda.stream(stream):
        dec.decode(args.batch, False)
    stream.synchronize()
    torch.cuda.nvtx.range_pop()
    print("profiled step done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
