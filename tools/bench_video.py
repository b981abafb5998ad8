"""A video's preparation, file bytes to the tower's input, against transformers' on the same frames.

flared (flared.frontend.video): PyAV decodes up to the last sampled frame, converts and resizes only the sampled
ones as it goes, then normalizes and patches them. transformers: its PyAV loader (transformers.video_utils
.load_video, the same indices) converts every sampled frame at full size, then the model's video processor
(Qwen2VLVideoProcessor, cap_pixels_per_frame; InternVLVideoProcessor) resizes, normalizes and patches the stack.
The outputs are compared bit for bit (transformers' video processors need torchvision). Times are medians over
--repeats after a warm-up, on this machine's CPU.

    python3 tools/bench_video.py [--seconds 10,60] [--size 1280x720] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # (flared_testing's video writer)


def make_video(seconds: int, width: int, height: int, rate: int = 30) -> bytes:
    """H.264 in MP4: a moving gradient with noise (what a camera's stream costs to decode, roughly)."""
    from flared_testing.video import encode_frames

    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx % 256, yy % 256, (xx + yy) % 256], -1).astype(np.int16)
    frames = ((base + i * 3 + rng.integers(-8, 8, base.shape)).clip(0, 255).astype(np.uint8)
              for i in range(seconds * rate))
    return encode_frames(frames, (width, height), rate, codec="libx264", options={"preset": "veryfast", "crf": "23"})


def _median_ms(fn, repeats: int):
    out = fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000, out


def main() -> None:
    import transformers
    from transformers.video_utils import load_video

    from flared.frontend.video import FrameVideoProcessor, VideoProcessor, probe_video

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", default="10,60")
    ap.add_argument("--size", default="1280x720")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    width, height = (int(x) for x in args.size.split("x"))
    qwen = VideoProcessor.from_hf("qwen2", None, patch_size=14, temporal_patch_size=2, merge_size=2)
    internvl = FrameVideoProcessor(height=448, width=448, image_seq_len=256)
    refs = {"qwen2_vl": transformers.Qwen2VLVideoProcessor(
                size={"shortest_edge": qwen.min_pixels, "longest_edge": qwen.max_pixels}, do_sample_frames=False),
            "internvl": transformers.InternVLVideoProcessor(
                size={"height": 448, "width": 448}, do_sample_frames=False, image_mean=list(internvl.image_mean),
                image_std=list(internvl.image_std))}
    rows = []
    for seconds in (int(s) for s in args.seconds.split(",")):
        data = make_video(seconds, width, height)
        info = probe_video(data)
        with tempfile.NamedTemporaryFile(suffix=".mp4", delete=False) as f:
            f.write(data)
            path = f.name
        try:
            for name, ours in (("qwen2_vl", qwen), ("internvl", internvl)):
                indices = ours.sample(info)
                ours_ms, prepared = _median_ms(lambda: ours.prepare(data), args.repeats)

                def theirs():
                    frames, _ = load_video(path, backend="pyav", sample_indices_fn=lambda metadata, **kw: indices)
                    clip = torch.from_numpy(np.asarray(frames)).permute(0, 3, 1, 2)
                    kw = {"cap_pixels_per_frame": True} if name == "qwen2_vl" else {}
                    return refs[name](videos=[clip], return_tensors="pt", **kw)["pixel_values_videos"]

                theirs_ms, out = _median_ms(theirs, args.repeats)
                out = out.numpy() if name == "qwen2_vl" else out[0].numpy()
                rows.append(dict(model=name, seconds=seconds, size=f"{width}x{height}", frames=len(indices),
                                 tokens=prepared.num_image_tokens, flared_ms=round(ours_ms, 1),
                                 transformers_ms=round(theirs_ms, 1), speedup=round(theirs_ms / ours_ms, 2),
                                 equal=bool(np.array_equal(out, prepared.pixel_values))))
        finally:
            os.unlink(path)
    print(f"{'model':<10} {'video':>14} {'frames':>6} {'tokens':>7} {'flared ms':>10} {'transformers ms':>16} "
          f"{'x':>6} {'equal':>6}")
    for r in rows:
        print(f"{r['model']:<10} {str(r['seconds']) + ' s ' + r['size']:>14} {r['frames']:>6} {r['tokens']:>7} "
              f"{r['flared_ms']:>10} {r['transformers_ms']:>16} {r['speedup']:>6} {str(r['equal']):>6}")
    if args.json:
        print(json.dumps({"rows": rows, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
