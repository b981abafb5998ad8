#!/usr/bin/env python
"""A long video's preparation: flared's frames read by seeking to each sampled frame's keyframe, against the same
preparation reading every frame in order (what it did before, and what transformers' PyAV loader does), in one run.

A video of ``--minutes`` at ``--fps`` and ``--size`` is encoded with PyAV (H.264, a keyframe every ``--gop``
frames, B-frames), then prepared by ``--processor``'s video processor: ``gemma4`` (32 frames evenly apart, as
Gemma4VideoProcessor; InternVL's, LLaVA-OneVision's and Qwen3-VL's sample a few frames alike) or ``qwen2`` (2 frames
a second up to 768, as qwen-vl-utils: most GOPs hold a sampled frame, so seeking gains little), both ways,
alternating, best of ``--repeats``; the two results must be equal.

    .venv/bin/python tools/bench_video.py [--minutes 5] [--fps 30] [--size 640x360] [--gop 60] [--processor gemma4]
        [--repeats 2] [--json]

Prints a table; with --json, one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def encode(minutes: float, fps: int, width: int, height: int, gop: int) -> bytes:
    """A moving gradient, H.264 (B-frames, a keyframe every ``gop`` frames) in MP4."""
    from flared_testing.video import encode_frames

    yy, xx = np.mgrid[0:height, 0:width]
    frames = (np.stack([(xx + 2 * i) % 256, (yy + 3 * i) % 256, (xx + yy + i) % 256], -1).astype(np.uint8)
              for i in range(int(minutes * 60 * fps)))
    return encode_frames(frames, (width, height), fps, codec="libx264",
                         options={"g": str(gop), "bf": "3", "preset": "ultrafast"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--fps", type=int, default=30)
    parser.add_argument("--size", default="640x360")
    parser.add_argument("--gop", type=int, default=60)
    parser.add_argument("--processor", default="gemma4", choices=("gemma4", "qwen2"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    width, height = (int(x) for x in args.size.split("x"))

    from flared.frontend import video

    data = encode(args.minutes, args.fps, width, height, args.gop)
    if args.processor == "qwen2":
        processor = video.VideoProcessor.from_hf("qwen2", None, patch_size=14, merge_size=2, temporal_patch_size=2)
    else:
        processor = video.PooledVideoProcessor.from_hf(None, patch_size=16, pooling_kernel_size=3)
    info = video.probe_video(data)
    sampled = len(processor.sample(info))
    best = {"in_order": float("inf"), "seeking": float("inf")}
    results = {}
    threshold = video.SEEK_MIN_FRAMES
    for _ in range(args.repeats):
        for way in best:
            video.SEEK_MIN_FRAMES = threshold if way == "seeking" else 10 ** 12
            started = time.perf_counter()
            results[way] = processor.prepare(data).pixel_values
            best[way] = min(best[way], time.perf_counter() - started)
    video.SEEK_MIN_FRAMES = threshold
    same = bool(np.array_equal(results["in_order"], results["seeking"]))
    row = {"processor": args.processor, "minutes": args.minutes, "frames": info.total_frames, "size": args.size,
           "gop": args.gop,
           "sampled": sampled, "in_order_s": best["in_order"], "seeking_s": best["seeking"],
           "speedup": best["in_order"] / best["seeking"], "equal": same}
    print(f"{'video':<36} {'sampled':>7} {'in order s':>10} {'seeking s':>9} {'ratio':>7} {'equal':>5}")
    what = f"{args.minutes:g} min {args.size} {info.total_frames} fr, GOP {args.gop}"
    print(f"{what:<36} {sampled:>7} {row['in_order_s']:>10.3f} {row['seeking_s']:>9.3f} {row['speedup']:>6.1f}x "
          f"{str(same):>5}")
    print(f"{args.processor} processor, best of {args.repeats}; PyAV's threaded decoding both ways")
    if args.json:
        print(json.dumps(row))
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
