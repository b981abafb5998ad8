#!/usr/bin/env python
"""Image towers (and Gemma 4's audio conformer) on the CPU, or a GPU with ``--device cuda``: flared's
(flared.model.vision) against transformers' on the same random weights of real shapes, in one run.

For each shape, a transformers model of that vision config (with a one-layer text model beside it: only the
tower and connector run) is built with random weights; flared's tower is loaded from the same tensors
(hf_vision_to_serving). One image's worth of input runs through both: transformers' ``get_image_features`` and
flared's ``encode``, alternating, best of ``--repeats``; the rows of the two are compared (max abs difference).

Shapes (the towers of the released checkpoints):
  smolvlm-256m   SigLIP-B/16 at 512 px, 12 layers of 768, pixel shuffle 4 (SmolVLM-256M/500M): ``--tiles`` tiles
  qwen2-vl-2b    32 layers of 1280, 2D rope, whole-image attention (Qwen2-VL-2B/7B): a ``--side`` px image
  qwen2.5-vl-3b  32 layers of 1280, windows of 112 px, 4 full layers, SwiGLU (Qwen2.5-VL-3B/7B): the same image
  qwen3-vl-2b    24 layers of 1024, 16 px patches, resampled position table, 3 DeepStack mergers (Qwen3-VL-2B)
  mistral3-24b   Pixtral: 24 layers of 1024, 14 px patches, 2D rope, SwiGLU; projector to 5120 (Mistral-Small-3.1)
  gemma4-e2b     16 layers of 768, 16 px patches, 2D axial rope, clipped products, 3 x 3 pooling (Gemma 4 E2B/E4B):
                 a ``--side`` px image at 280 soft tokens (transformers pads it to 2,520 patches, as it runs)
  gemma4-31b     27 layers of 1152, standardized (Gemma 4 26B-A4B/31B): the same image
  llama4-scout   34 layers of 1408, 336 px tiles in 14 px patches, 2D complex rope, pixel shuffle, adapter and
                 projector of 4096 to 5120 (Llama 4 Scout/Maverick): ``--tiles`` tiles (144 rows each)
  gemma4-audio   Gemma 4 E2B/E4B's audio conformer: 12 layers of 1024, blocked local attention, light convolutions:
                 a ``--seconds`` clip (25 rows a second)
  qwen3-asr      Qwen3-ASR-1.7B's AuT encoder: 1 s chunks through three 480-channel 2D convolutions, 24 layers of
                 1024 attending within 8 s windows, projector to 2048: a ``--seconds`` clip (13 rows a second)

    .venv/bin/python tools/bench_vision.py [--shapes smolvlm-256m,qwen2-vl-2b,qwen2.5-vl-3b,qwen3-vl-2b,mistral3-24b,
        gemma4-e2b,gemma4-31b,llama4-scout,gemma4-audio,qwen3-asr] [--tiles 2] [--side 448] [--seconds 10]
        [--dtypes float32,bfloat16] [--repeats 2] [--device cpu] [--json]

Prints a table; with --json, one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TEXT = dict(vocab_size=512, hidden_size=0, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=2048)
SHAPES = {
    "smolvlm-256m": ("smolvlm", dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                     num_attention_heads=12, image_size=512, patch_size=16), 576, dict(scale_factor=4)),
    "qwen2-vl-2b": ("qwen2_vl", dict(depth=32, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4,
                                     patch_size=14, spatial_merge_size=2, temporal_patch_size=2), 1536, {}),
    "qwen2.5-vl-3b": ("qwen2_5_vl", dict(depth=32, hidden_size=1280, out_hidden_size=2048, intermediate_size=3420,
                                         num_heads=16, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                                         window_size=112, fullatt_block_indexes=[7, 15, 23, 31]), 2048, {}),
    "qwen3-vl-2b": ("qwen3_vl", dict(depth=24, hidden_size=1024, out_hidden_size=2048, intermediate_size=4096,
                                     num_heads=16, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                                     num_position_embeddings=2304, deepstack_visual_indexes=[5, 11, 17]), 2048, {}),
    "mistral3-24b": ("mistral3", dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096,
                                      num_hidden_layers=24, num_attention_heads=16, head_dim=64, patch_size=14,
                                      hidden_act="silu", image_size=1540), 5120, dict(spatial_merge_size=2)),
    "gemma4-e2b": ("gemma4", dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
                                  num_key_value_heads=12, head_dim=64, use_clipped_linears=True), 1536, {}),
    "llama4-scout": ("llama4", dict(hidden_size=1408, intermediate_size=5632, num_hidden_layers=34,
                                    num_attention_heads=16, image_size=336, patch_size=14, vision_output_dim=4096,
                                    projector_input_dim=4096, projector_output_dim=4096), 5120, {}),
    "gemma4-31b": ("gemma4", dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                                  num_attention_heads=16, num_key_value_heads=16, head_dim=72, standardize=True),
                   5376, {}),
}
GEMMA4_SOFT_TOKENS = 280
AUDIO_SHAPES = {"gemma4-audio": dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=8,
                                     subsampling_conv_channels=[128, 32], output_proj_dims=1536),
                "qwen3-asr": dict(d_model=1024, encoder_layers=24, encoder_attention_heads=16, encoder_ffn_dim=4096,
                                  num_mel_bins=128, downsample_hidden_size=480, output_dim=2048)}


def build_audio(shape: str):
    """(transformers model, flared VisionConfig, serving tensors) of an audio tower's random weights (Gemma 4's;
    Qwen3-ASR's with a one-layer Qwen3 beside it)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from flared.model.audio import gemma4_audio_from_hf
    from flared.model.vision import hf_vision_to_serving, vision_from_hf

    if shape == "qwen3-asr":
        from transformers import Qwen3ASRConfig, Qwen3ASRForConditionalGeneration

        cfg = Qwen3ASRConfig(audio_config=AUDIO_SHAPES[shape], text_config={**TEXT, "hidden_size": 2048,
                                                                            "head_dim": 128})
        torch.manual_seed(0)
        model = Qwen3ASRForConditionalGeneration(cfg).eval()
        config = vision_from_hf(cfg.to_dict())
        return model, config, hf_vision_to_serving({k: v.detach() for k, v in model.state_dict().items()}, config,
                                                   source=shape)

    text = {**TEXT, "hidden_size": 1536, "head_dim": 64, "global_head_dim": 64, "hidden_size_per_layer_input": 0,
            "layer_types": ["full_attention"]}
    vision = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16)
    cfg = Gemma4Config(text_config=text, vision_config=vision, audio_config=AUDIO_SHAPES[shape])
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith(("input_max", "output_max", "input_min", "output_min")):
                buf.fill_(-20.0 if name.endswith("min") else 20.0)
    config = gemma4_audio_from_hf(cfg.to_dict(), shape)
    tensors = hf_vision_to_serving({k: v.detach() for k, v in model.state_dict().items()}, config, source=shape)
    return model, config, tensors


def build(shape: str):
    """(transformers model, flared VisionConfig, serving tensors) of random weights."""
    if shape in AUDIO_SHAPES:
        return build_audio(shape)
    from transformers import (Mistral3Config, Mistral3ForConditionalGeneration, Qwen2_5_VLConfig,
                              Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig, Qwen2VLForConditionalGeneration,
                              Qwen3VLConfig, Qwen3VLForConditionalGeneration, SmolVLMConfig,
                              SmolVLMForConditionalGeneration)

    from flared.model.vision import hf_vision_to_serving, vision_from_hf

    family, vision, text_hidden, extra = SHAPES[shape]
    text = {**TEXT, "hidden_size": text_hidden,
            "model_type": {"smolvlm": "llama", "mistral3": "mistral"}.get(family)}
    text = {k: v for k, v in text.items() if v is not None}
    if family == "smolvlm":
        cls, cfg = SmolVLMForConditionalGeneration, SmolVLMConfig(text_config=text, vision_config=vision, **extra)
    elif family == "gemma4":
        from transformers import Gemma4Config, Gemma4ForConditionalGeneration

        text.update(head_dim=64, global_head_dim=64, hidden_size_per_layer_input=0, layer_types=["full_attention"])
        cls, cfg = Gemma4ForConditionalGeneration, Gemma4Config(text_config=text, vision_config=vision,
                                                                audio_config=None)
    elif family == "llama4":  # (one small expert: only the tower runs)
        from transformers import Llama4Config, Llama4ForConditionalGeneration

        text.update(intermediate_size=256, intermediate_size_mlp=256, num_local_experts=1, head_dim=128)
        cls, cfg = Llama4ForConditionalGeneration, Llama4Config(text_config=text, vision_config=vision)
    elif family == "qwen2_vl":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
        cls, cfg = Qwen2VLForConditionalGeneration, Qwen2VLConfig(text_config=text, vision_config=vision)
    elif family == "mistral3":
        text["head_dim"] = 128
        cls, cfg = Mistral3ForConditionalGeneration, Mistral3Config(text_config=text, vision_config=vision, **extra)
    elif family == "qwen3_vl":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                                   "mrope_interleaved": True}
        text["head_dim"] = 128
        cls, cfg = Qwen3VLForConditionalGeneration, Qwen3VLConfig(text_config=text, vision_config=vision)
    else:
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
        cls, cfg = Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    if family == "gemma4":  # (its clip bounds and standardization as a checkpoint holds them, not the init's)
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if name.endswith(("input_max", "output_max", "input_min", "output_min")):
                    buf.fill_(-20.0 if name.endswith("min") else 20.0)
                elif name.endswith(("std_bias", "std_scale")):
                    buf.copy_(torch.rand_like(buf) * (0.1 if name.endswith("bias") else 1.0))
    hf_config = cfg.to_dict()
    config = vision_from_hf(hf_config)
    tensors = hf_vision_to_serving({k: v.detach() for k, v in model.state_dict().items()}, config, source=shape)
    return model, config, tensors


def inputs(config, args):
    """(transformers' args, flared's args, description) of one image."""
    if config.family == "qwen3_asr":
        from transformers.models.qwen3_asr.feature_extraction_qwen3_asr import Qwen3ASRFeatureExtractor

        from flared.frontend.audio import DecodedAudio, Qwen3AsrProcessor

        samples = (torch.randn(int(args.seconds * 16000), generator=torch.Generator().manual_seed(0)) * 0.1).numpy()
        ref = Qwen3ASRFeatureExtractor()(samples, sampling_rate=16000, padding=True, return_attention_mask=True,
                                         return_tensors="pt")
        clip = Qwen3AsrProcessor().prepare(DecodedAudio(samples, 16000))
        return ((ref["input_features"], ref["attention_mask"]), (torch.from_numpy(clip.pixel_values), clip.grid),
                f"{args.seconds:g} s clip: {clip.num_image_tokens} rows")
    if config.family == "gemma4_audio":
        from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

        from flared.frontend.audio import DecodedAudio, UsmProcessor

        samples = (torch.randn(int(args.seconds * 16000), generator=torch.Generator().manual_seed(0)) * 0.1).numpy()
        ref = Gemma4AudioFeatureExtractor()([samples], return_tensors="pt")
        clip = UsmProcessor().prepare(DecodedAudio(samples, 16000))
        return ((ref["input_features"], ref["input_features_mask"]), (torch.from_numpy(clip.pixel_values), clip.grid),
                f"{args.seconds:g} s clip: {clip.num_image_tokens} rows")
    if config.family == "gemma4":
        from flared.frontend.images import pooled_size

        height, width = pooled_size(args.side, args.side, config.patch_size, GEMMA4_SOFT_TOKENS, config.scale_factor)
        gh, gw = height // config.patch_size, width // config.patch_size
        patches = torch.rand(gh * gw, 3 * config.patch_size ** 2)
        padded = GEMMA4_SOFT_TOKENS * config.scale_factor ** 2
        positions = torch.stack(torch.meshgrid(torch.arange(gw), torch.arange(gh), indexing="xy"), -1).reshape(-1, 2)
        hf = (torch.nn.functional.pad(patches, (0, 0, 0, padded - gh * gw))[None],
              torch.nn.functional.pad(positions, (0, 0, 0, padded - gh * gw), value=-1)[None])
        return hf, (patches, (1, gh, gw)), f"{width}x{height} px: {gh * gw} patches, {gh * gw // 9} rows"
    if config.family == "pixtral":
        unit = config.patch_size * config.scale_factor
        side = args.side // unit * unit
        pixels = torch.randn(3, side, side)
        grid = (1, side // config.patch_size, side // config.patch_size)
        return ((pixels[None], torch.tensor([[side, side]])), (pixels, grid),
                f"{side} px: {grid[1] * grid[2]} patches, {grid[1] * grid[2] // 4} rows")
    if config.grid_based:
        side = args.side // (config.patch_size * config.scale_factor) * config.scale_factor
        grid = (1, side, side)
        patches = torch.randn(side * side, 3 * config.temporal_patch_size * config.patch_size ** 2)
        return ((patches, torch.tensor([grid])), (patches, grid),
                f"{args.side} px: {side * side} patches, {side * side // 4} rows")
    tiles = torch.randn(args.tiles, 3, config.image_size, config.image_size)
    return ((tiles if config.family == "llama4" else tiles[None],), (tiles, None),
            f"{args.tiles} tiles: {args.tiles * config.image_seq_len} rows")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="smolvlm-256m,qwen2-vl-2b,qwen2.5-vl-3b,qwen3-vl-2b,mistral3-24b,"
                                            "gemma4-e2b,gemma4-31b,llama4-scout,gemma4-audio,qwen3-asr")
    parser.add_argument("--tiles", type=int, default=2)
    parser.add_argument("--side", type=int, default=448)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (both sides on the GPU, synchronized)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
    from flared.model.vision import vision_encoder

    rows = []
    for shape in args.shapes.split(","):
        model, config, tensors = build(shape)
        hf_args, our_args, what = inputs(config, args)
        hf_args = tuple(x.to(device) for x in hf_args)
        our_args = (our_args[0].to(device), our_args[1])
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            complex_buffers = {name: buf for name, buf in model.named_buffers() if buf.is_complex()}
            model.to(device=device, dtype=dtype)  # (which would drop a complex buffer's imaginary part: Llama 4's rope)
            for name, buf in complex_buffers.items():
                owner, _, attr = name.rpartition(".")
                setattr(model.get_submodule(owner), attr, buf.to(device))
            ours = vision_encoder(config, tensors, dtype=dtype, device=device)
            best = {"transformers": float("inf"), "flared": float("inf")}
            out = {}
            for _ in range(args.repeats):
                for name in best:
                    sync()
                    started = time.perf_counter()
                    with torch.inference_mode():
                        if name == "transformers":
                            a = [x.to(dtype) if x.is_floating_point() and config.family not in ("gemma4",
                                                                                                  "gemma4_audio") else x
                                 for x in hf_args]  # (Gemma 4 casts its pixels after scaling them)
                            if config.family == "qwen3_asr":
                                features = model.model.get_audio_features(*a)
                                result = features.pooler_output
                            elif config.family == "pixtral":  # its get_image_features fails here; what it runs:
                                tower = model.model.vision_tower(a[0], image_sizes=a[1], output_hidden_states=True,
                                                                 return_dict=True)
                                result = model.model.multi_modal_projector(tower.hidden_states[-1].squeeze(0),
                                                                           a[1])
                                features = None
                            elif config.family == "gemma4_audio":
                                features = model.model.get_audio_features(*a)
                                result = features.pooler_output[features.attention_mask]
                            else:
                                features = (model if config.family == "llama4" else model.model).get_image_features(*a)
                                result = features.pooler_output
                            result = torch.cat(list(result)) if isinstance(result, (list, tuple)) else result
                            if config.family == "llama4":  # ([tiles, rows, hidden]: flared's rows a tile in order)
                                result = result.reshape(-1, result.shape[-1])
                            stack = getattr(features, "deepstack_features", None) if features is not None else None
                            if stack:  # Qwen3-VL: flared's rows carry them after the embedding's
                                result = torch.cat([result, *(torch.cat(list(f)) for f in stack)], dim=-1)
                        else:
                            result = ours.encode(our_args[0], grid=our_args[1])
                    sync()
                    best[name] = min(best[name], time.perf_counter() - started)
                    out[name] = result.float()
            diff = (out["transformers"] - out["flared"]).abs().max().item()
            rows.append({"shape": shape, "dtype": dtype_name, "input": what, "transformers_s": best["transformers"],
                         "flared_s": best["flared"], "speedup": best["transformers"] / best["flared"],
                         "max_abs_diff": diff})
        del model, tensors
    print(f"{'shape':<14} {'dtype':<9} {'input':<34} {'transformers s':>14} {'flared s':>9} {'ratio':>6} "
          f"{'max |diff|':>10}")
    for r in rows:
        print(f"{r['shape']:<14} {r['dtype']:<9} {r['input']:<34} {r['transformers_s']:>14.3f} {r['flared_s']:>9.3f} "
              f"{r['speedup']:>5.2f}x {r['max_abs_diff']:>10.2e}")
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"threads: {torch.get_num_threads()}"
    print(f"{where}, best of {args.repeats}")
    if args.json:
        print(json.dumps({"rows": rows, "device": where, "repeats": args.repeats}))


if __name__ == "__main__":
    main()
