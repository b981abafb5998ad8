"""Qwen2-Audio's encoder (Whisper-large-v3's shape, random weights) against transformers' on the same weights.

transformers runs the whole 30-second window (3,000 frames, 1,500 rows) with the padding's keys masked, as
Qwen2AudioForConditionalGeneration does; flared's WhisperAudioEncoder runs the clip's rows only. Both include the
projector (a linear to the decoder's 3,584). Times are medians over --repeats after a warm-up.

    python3 tools/bench_audio_encoder.py [--device cuda] [--dtype bfloat16] [--shape large|tiny] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

SHAPES = {"large": dict(d_model=1280, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120,
                        num_mel_bins=128, text=3584),
          "tiny": dict(d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128, num_mel_bins=16,
                       text=64)}


def _timed(fn, device, repeats: int) -> tuple[float, object]:
    out = fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000, out


def main() -> None:
    from transformers import Qwen2AudioEncoderConfig
    from transformers.masking_utils import create_bidirectional_mask
    from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder

    from flared.frontend.audio import DecodedAudio, WhisperProcessor
    from flared.model.vision import hf_vision_to_serving, vision_encoder, vision_from_hf

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="large" if torch.cuda.is_available() else "tiny")
    ap.add_argument("--seconds", default="5,30")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    shape = dict(SHAPES[args.shape])
    text = shape.pop("text")
    torch.manual_seed(0)
    config = Qwen2AudioEncoderConfig(**shape, max_source_positions=1500)
    config._attn_implementation = "sdpa"
    theirs = Qwen2AudioEncoder(config).eval().to(device, dtype)
    projector = torch.nn.Linear(shape["d_model"], text).eval().to(device, dtype)
    hf = {f"audio_tower.{k}": v for k, v in theirs.state_dict().items()}
    hf.update({"multi_modal_projector.linear.weight": projector.weight, "multi_modal_projector.linear.bias":
               projector.bias})
    vc = vision_from_hf({"model_type": "qwen2_audio", "audio_config": {**shape, "max_source_positions": 1500},
                         "text_config": {"hidden_size": text}, "audio_token_index": 1})
    ours = vision_encoder(vc, {k: v.float().cpu() for k, v in hf_vision_to_serving(hf, vc, source="bench").items()},
                          dtype=dtype, device=device)
    processor = WhisperProcessor(feature_size=shape["num_mel_bins"])
    rng = np.random.default_rng(0)
    rows = []
    for seconds in (float(s) for s in args.seconds.split(",")):
        x = (rng.standard_normal(int(seconds * 16000)) * 0.1).astype(np.float32)
        prepared = processor.prepare(DecodedAudio(x, 16000))
        full = torch.as_tensor(processor.features(x))[None].to(device, dtype)
        frames = processor.num_frames(len(x))
        conv, tokens = processor.encoder_lengths(frames)
        keys = (torch.arange(1500, device=device)[None] < conv).long()
        mask = create_bidirectional_mask(config=config, inputs_embeds=torch.zeros(1, 1500, 1, device=device,
                                                                                  dtype=dtype), attention_mask=keys)

        @torch.inference_mode()
        def transformers_rows():
            return projector(theirs(full, attention_mask=mask).last_hidden_state)[0, :tokens]

        features = torch.as_tensor(prepared.pixel_values)
        t_theirs, want = _timed(transformers_rows, device, args.repeats)
        t_ours, got = _timed(lambda: ours.encode(features, grid=prepared.grid), device, args.repeats)
        diff = (got.float() - want.float()).abs().max().item()
        scale = want.float().abs().max().item()
        rows.append({"seconds": seconds, "tokens": tokens, "transformers_ms": round(t_theirs, 2),
                     "flared_ms": round(t_ours, 2), "speedup": round(t_theirs / t_ours, 2),
                     "max_abs_diff": diff, "max_abs": scale})
    print(f"Qwen2-Audio encoder ({args.shape}, {args.dtype}, {device}): a clip's rows, median of {args.repeats}")
    print(f"{'clip s':>7} {'tokens':>6} {'transformers ms':>16} {'flared ms':>10} {'x':>6} {'max |diff|':>11}")
    for r in rows:
        print(f"{r['seconds']:>7.1f} {r['tokens']:>6} {r['transformers_ms']:>16.2f} {r['flared_ms']:>10.2f} "
              f"{r['speedup']:>6.2f} {r['max_abs_diff']:>11.3g}")
    if args.json:
        print(json.dumps({"shape": args.shape, "dtype": args.dtype, "device": str(device), "rows": rows}))


if __name__ == "__main__":
    main()
