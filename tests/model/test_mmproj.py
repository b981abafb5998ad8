"""llama.cpp's image towers (mmproj GGUFs, `flared run model.gguf --mmproj mmproj.gguf`).

Each tiny random vision checkpoint of the vision tests is converted here as llama.cpp's converter
(convert_hf_to_gguf.py, `--mmproj`) converts its released counterpart: the model GGUF (decoder, tokenizer, chat
template, the Qwen VL decoders' mRoPE split) and the mmproj (tower and projector, renamed by the gguf package's own
tensor map, with the converter's splits and permutations). Read back, the two files must give the checkpoint's own
decoder and tower bit for bit, and a daemon serving them must answer an image as the checkpoint's core does."""

from __future__ import annotations

import dataclasses
import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from flared.errors import CoreError
from flared.model.loader import read_source

from ..conftest import build_tiny_qwen_vl
from .test_gguf_families import permute_for_llama_cpp, write_gguf

TEXT_ARCH = {"smolvlm": "llama", "gemma3": "gemma3", "mistral3": "llama", "pixtral": "llama", "qwen2_vl": "qwen2vl",
             "qwen2_5_vl": "qwen2vl", "qwen3_vl": "qwen3vl", "qwen3_5": "qwen35", "internvl": "qwen2",
             "qwen2_audio": "qwen2", "audioflamingo3": "qwen2", "gemma4": "gemma4", "gemma4_e2b": "gemma4",
             "llama4": "llama4", "qwen3_asr": "qwen3"}
# InternVL's projector as the converter renames it first (its original checkpoints' mlp1.*, which the gguf map knows)
INTERNVL_PROJECTOR = {"model.multi_modal_projector.layer_norm.": "mlp1.0.",
                      "model.multi_modal_projector.linear_1.": "mlp1.1.",
                      "model.multi_modal_projector.linear_2.": "mlp1.3."}


def _load(hf_dir) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(hf_dir / "model.safetensors")


def _tower(weights: dict, family: str) -> dict[str, np.ndarray]:
    """The checkpoint's tower tensors under the names released checkpoints give them (transformers 5 saves the
    Qwen VL and Mistral3 towers under model.*, the releases hold visual.*, vision_tower.*, ...)."""
    out = {}
    for name, value in weights.items():
        if family == "smolvlm":
            if name.startswith(("model.vision_model.", "model.connector.")):
                out[name] = value
        elif family == "gemma3":  # (released: vision_tower.vision_model.*; transformers saves the tower's own)
            name = name.removeprefix("model.")
            if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
                name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")
            if name.startswith(("vision_tower.", "multi_modal_projector.")):
                out[name] = value
        elif family == "llama4":  # (released, and as transformers saves them: vision_model.*, multi_modal_projector.*)
            if name.startswith(("vision_model.", "multi_modal_projector.")):
                out[name] = value
        elif family.startswith("gemma4"):  # (the image tower and its projection; E2B's audio tower is not written)
            if name.startswith(("model.vision_tower.", "model.embed_vision.")):
                out[name] = value
        elif family in ("mistral3", "pixtral"):
            if name.removeprefix("model.").startswith(("vision_tower.", "multi_modal_projector.")):
                out[name.removeprefix("model.")] = value
        elif family == "internvl":  # (the released -hf checkpoints' model.*; transformers 5 saves them without)
            if name.removeprefix("model.").startswith(("vision_tower.", "multi_modal_projector.")):
                out["model." + name.removeprefix("model.")] = value
        elif name.removeprefix("model.").startswith("visual."):
            out[name.removeprefix("model.")] = value
    return out


# the decoder's tensors in a vision checkpoint (transformers 5's layouts, Mistral3's released one) -> a text
# checkpoint's names; the tower's, which it leaves out
TEXT_RENAMES = {"model.language_model.": "model.", "model.text_model.": "model.", "language_model.model.": "model.",
                "language_model.lm_head.": "lm_head."}
TOWER = ("visual.", "model.visual.", "vision_tower.", "model.vision_tower.", "multi_modal_projector.",
         "model.multi_modal_projector.", "model.vision_model.", "model.connector.", "audio_tower.",
         "model.embed_vision.", "model.audio_tower.", "model.embed_audio.", "vision_model.")


def _text_weights(weights: dict) -> dict[str, np.ndarray]:
    return {next((new + k[len(old):] for old, new in TEXT_RENAMES.items() if k.startswith(old)), k): value
            for k, value in weights.items() if not k.startswith(TOWER)}


def write_mmproj(hf_dir, path, family: str, matrix_type=Q.F32, feed_forward: int | None = None) -> None:
    """An mmproj GGUF of ``hf_dir`` as llama.cpp's converter writes one (its MmprojModel subclasses for SmolVLM,
    Mistral3, Qwen2-VL / Qwen2.5-VL and Qwen3-VL); ``feed_forward``: the feed-forward length it writes instead
    of the config's."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    pre = json.loads((hf_dir / "preprocessor_config.json").read_text())
    v, t = dict(cfg["vision_config"]), cfg["text_config"]
    weights = _load(hf_dir)
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(t["hidden_size"])
    if family.startswith("qwen"):  # (the converter's renames of Qwen's vision config)
        v.setdefault("image_size", 560)
        if family in ("qwen3_vl", "qwen3_5"):
            v["image_size"] = int(v["num_position_embeddings"] ** 0.5 * v["patch_size"])
        v["num_attention_heads"], v["num_hidden_layers"] = v["num_heads"], v["depth"]
        if "embed_dim" in v:  # (Qwen2-VL's: the converter writes its hidden_size, the merger's output, as the
            # feed-forward length; the tower's MLP is embed_dim x mlp_ratio)
            v["intermediate_size"], v["hidden_size"] = v["hidden_size"], v["embed_dim"]
    if family.startswith("gemma4"):  # (Gemma4VisionAudioModel: "unused, but set to avoid error")
        v["image_size"] = 224
    for key in ("image_size", "patch_size"):  # (InternViT's [height, width]: the converter writes the first)
        if isinstance(v.get(key), list):
            v[key] = v[key][0]
    w.add_vision_image_size(v["image_size"])
    w.add_vision_patch_size(v["patch_size"])
    w.add_vision_embedding_length(v["hidden_size"])
    w.add_vision_feed_forward_length(feed_forward or v["intermediate_size"])
    w.add_vision_block_count(v["num_hidden_layers"])
    w.add_vision_head_count(v["num_attention_heads"])
    w.add_vision_image_mean(pre["image_mean"])
    w.add_vision_image_std(pre["image_std"])
    # (the converter's map numbers blocks up to the tower's depth; the projectors' mm.2 and InternVL's
    # mm.model.mlp.3 need four with these tiny towers of two layers)
    tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(v["num_hidden_layers"], 4))

    def mapped(name: str) -> str:
        new = tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        return new

    out: dict[str, np.ndarray] = {}
    tower = _tower(weights, family)
    if family == "smolvlm":
        w.add_clip_projector_type("idefics3")
        w.add_vision_attention_layernorm_eps(v.get("layer_norm_eps", 1e-5))
        w.add_vision_projector_scale_factor(cfg.get("scale_factor", 2))
        w.add_vision_use_gelu(True)
        w.add_vision_preproc_image_size(pre.get("size", {}).get("longest_edge", v["image_size"]))
        out = {mapped(name): value for name, value in tower.items()}
    elif family == "gemma3":  # (Gemma3VisionModel)
        w.add_clip_projector_type("gemma3")
        w.add_vision_attention_layernorm_eps(v.get("layer_norm_eps", 1e-6))
        w.add_vision_use_gelu(True)
        scale = (v["image_size"] // v["patch_size"]) // int(pre.get("image_seq_length", 256) ** 0.5)
        if scale > 0 and scale != 4:
            w.add_vision_projector_scale_factor(scale)
        for name, value in tower.items():
            if "vision_model.head." in name:
                continue
            name = name.replace("_weight", ".weight")
            if "soft_emb_norm.weight" in name:
                value = value + 1
            out[mapped(name)] = value
    elif family.startswith("gemma4"):  # (Gemma4VisionAudioModel: its vision side)
        w.add_clip_projector_type("gemma4v")
        w.add_vision_attention_layernorm_eps(v.get("rms_norm_eps", 1e-6))
        for name, value in tower.items():
            name = name.replace("model.vision_tower.encoder.", "vision_model.model.").replace(".linear.weight",
                                                                                               ".weight")
            if name.endswith("position_embedding_table"):
                name += ".weight"
            if name.endswith("patch_embedder.input_proj.weight"):  # (as a convolution's [D, 3, p, p])
                p = v["patch_size"]
                value = value.reshape(value.shape[0], p, p, 3).transpose(0, 3, 1, 2)
            if value.ndim == 0:  # (the clamp bounds: scalars as one-element vectors)
                value = value.reshape(1)
            new = tensor_map.get_name(name, try_suffixes=(".weight", ".bias", ".input_max", ".input_min",
                                                          ".output_max", ".output_min"))
            assert new is not None, name
            out[new] = value
        if cfg.get("audio_config"):  # (E2B, E4B: the conformer beside the tower, as the converter writes it)
            _gemma4_audio(w, weights, cfg["audio_config"], t, out)
    elif family == "llama4":  # (Llama4VisionModel: the projector's one linear as mm.model.fc)
        w.add_clip_projector_type("llama4")
        w.add_vision_attention_layernorm_eps(v["norm_eps"])
        w.add_vision_projector_scale_factor(int(1.0 / v["pixel_shuffle_ratio"]))
        w.add_vision_use_gelu(True)
        for name, value in tower.items():
            if "positional_embedding_vlm" in name and ".weight" not in name:
                name += ".weight"
            out["mm.model.fc.weight" if "multi_modal_projector.linear_1" in name else mapped(name)] = value
    elif family == "internvl":  # (InternVisionModel)
        w.add_clip_projector_type("internvl")
        w.add_vision_attention_layernorm_eps(v.get("layer_norm_eps", 1e-6))
        w.add_vision_use_gelu(True)
        w.add_vision_projector_scale_factor(round(1 / cfg.get("downsample_ratio", 0.5)))
        # (the original configs' min_dynamic_patch / max_dynamic_patch, which this -hf one keeps in its preprocessor
        # config)
        w.add_vision_preproc_min_tiles(pre["min_patches"])
        w.add_vision_preproc_max_tiles(pre["max_patches"])
        for name, value in tower.items():
            name = next((new + name[len(old):] for old, new in INTERNVL_PROJECTOR.items() if name.startswith(old)),
                        name)
            if (".lambda_" in name or "position_embedding" in name) and not name.endswith(".weight"):
                name += ".weight"
            out[mapped(name)] = value
    elif family in ("mistral3", "pixtral"):  # (LlavaVisionModel: Mistral3's, and Pixtral 12B's llava config)
        w.add_clip_projector_type("pixtral")
        w.add_vision_attention_layernorm_eps(v.get("layer_norm_eps", 1e-5))
        if v.get("hidden_act", "gelu") == "silu":
            w.add_vision_use_silu(True)
        else:
            w.add_vision_use_gelu(True)
        if "spatial_merge_size" in cfg:
            w.add_vision_spatial_merge_size(cfg["spatial_merge_size"])
        heads = v["num_attention_heads"]
        for name, value in tower.items():
            if name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
                value = permute_for_llama_cpp(value, heads)
            out[mapped(name)] = value
        tok = json.loads((hf_dir / "tokenizer.json").read_text())
        brk = next(a["id"] for a in tok["added_tokens"] if a["content"] == "[IMG_BREAK]")
        out["v.token_embd.img_break"] = _text_weights(weights)["model.embed_tokens.weight"][brk]
    elif family in ("qwen2_vl", "qwen2_5_vl"):  # (Qwen2VLVisionModel)
        w.add_clip_projector_type("qwen2vl_merger" if family == "qwen2_vl" else "qwen2.5vl_merger")
        if family == "qwen2_5_vl":
            w.add_vision_use_silu(True)
            full = v["fullatt_block_indexes"]
            w.add_vision_n_wa_pattern(full[0] + 1)
        w.add_vision_attention_layernorm_eps(cfg.get("rms_norm_eps", 1e-6))
        for name, value in tower.items():
            if ".qkv." in name:
                c = value.shape[0] // 3
                for j, x in enumerate("qkv"):
                    out[mapped(name.replace("qkv", x))] = value[j * c:(j + 1) * c]
            elif "patch_embed.proj.weight" in name:
                out["v.patch_embd.weight"], out["v.patch_embd.weight.1"] = value[:, :, 0], value[:, :, 1]
            else:
                out[mapped(name)] = value
    else:  # Qwen3-VL, Qwen3.5 (Qwen3VLVisionModel)
        w.add_clip_projector_type("qwen3vl_merger")
        w.add_vision_use_gelu(True)
        w.add_vision_spatial_merge_size(v["spatial_merge_size"])
        w.add_vision_attention_layernorm_eps(t.get("rms_norm_eps", 1e-6))
        deepstack = v.get("deepstack_visual_indexes", [])
        w.add_vision_is_deepstack_layers([i in deepstack for i in range(v["num_hidden_layers"])])
        for name, value in tower.items():
            if name.startswith("visual.deepstack_merger_list."):
                index, rest = name.split(".", 3)[2:]
                part, suffix = rest.split(".", 1)
                kind = {"norm": gguf.MODEL_TENSOR.V_DS_NORM, "linear_fc1": gguf.MODEL_TENSOR.V_DS_FC1,
                        "linear_fc2": gguf.MODEL_TENSOR.V_DS_FC2}[part]
                out[gguf.TENSOR_NAMES[kind].format(bid=deepstack[int(index)]) + "." + suffix] = value
            elif name.startswith("visual.merger."):
                part, suffix = name.split(".", 2)[2].split(".", 1)
                out[{"linear_fc1": "mm.0", "linear_fc2": "mm.2", "norm": "v.post_ln"}[part] + "." + suffix] = value
            elif name == "visual.patch_embed.proj.weight":
                out["v.patch_embd.weight"], out["v.patch_embd.weight.1"] = value[:, :, 0], value[:, :, 1]
            elif name == "visual.patch_embed.proj.bias":
                out["v.patch_embd.bias"] = value
            else:
                out[mapped(name)] = value
    _finish(w, out, matrix_type)


def _gemma4_audio(w, weights: dict, a: dict, t: dict, out: dict) -> None:
    """Gemma4VisionAudioModel's audio side: clip.audio.* (a layer norm epsilon of 1e-5 whatever the config says), the
    tower renamed conformer.*, the products' .linear dropped, per_dim_scale softplus'd, the depthwise convolution
    [D, k], scalars as one-value vectors; then the gguf map's names."""
    w.add_clip_has_audio_encoder(True)
    w.add_clip_audio_projector_type("gemma4a")
    w.add_audio_projection_dim(t["hidden_size"])
    w.add_audio_embedding_length(a["hidden_size"])
    w.add_audio_feed_forward_length(a["hidden_size"] * 4)
    w.add_audio_block_count(a["num_hidden_layers"])
    w.add_audio_head_count(a["num_attention_heads"])
    w.add_audio_num_mel_bins(a.get("input_feat_size", 128))
    w.add_audio_attention_layernorm_eps(1e-5)
    tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(a["num_hidden_layers"], 4))
    for name, value in weights.items():
        if not name.startswith(("model.audio_tower.", "model.embed_audio.")):
            continue
        name = name.replace("model.audio_tower.", "conformer.").replace(".linear.", ".")
        if name.endswith("per_dim_scale"):
            name += ".weight"
            value = np.log1p(np.exp(value.astype(np.float64))).astype(np.float32)  # (softplus)
        if "lconv1d.depthwise_conv1d" in name and name.endswith(".weight"):
            value = value.reshape(value.shape[0], value.shape[2])
        if value.ndim == 0:
            value = value.reshape(1)
        new = tensor_map.get_name(name, try_suffixes=(".weight", ".bias", ".input_max", ".input_min", ".output_max",
                                                      ".output_min"))
        assert new is not None, name
        out[new] = value


def _finish(w, out: dict, matrix_type, kept=()) -> None:
    """The converter's tensors written (matrices as ``matrix_type``, but position tables and those in ``kept``),
    and the file closed."""
    for name, value in out.items():
        if value.dtype != np.float16:
            value = np.ascontiguousarray(value, dtype=np.float32)
        if value.ndim == 2 and matrix_type != Q.F32 and "position_embd" not in name and name not in kept:
            w.add_tensor(name, gguf.quants.quantize(value, matrix_type), raw_dtype=matrix_type)
        else:
            w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_audio_mmproj(hf_dir, path, family: str, matrix_type=Q.F32) -> None:
    """An audio mmproj of ``hf_dir`` as llama.cpp's converter writes one (WhisperEncoderModel for Qwen2-Audio,
    AudioFlamingo3WhisperEncoderModel, Qwen3ASRMmprojModel): the encoder's sizes under clip.audio.*, the projector
    ``audio.``-prefixed before the gguf map renames it (Qwen3-ASR's as its released tower's proj1 / proj2), the
    convolutions' biases unsqueezed to [D, 1] ([C, 1, 1] for Qwen3-ASR's 2D ones), and Qwen3-ASR's sinusoid
    position table added (1,500 rows)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    a, t = cfg["audio_config"], cfg["text_config"]
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_has_audio_encoder(True)
    w.add_audio_projection_dim(t["hidden_size"])
    w.add_audio_embedding_length(a.get("hidden_size", a.get("d_model")))
    w.add_audio_feed_forward_length(a.get("intermediate_size", a.get("encoder_ffn_dim")))
    layers = a.get("num_hidden_layers", a.get("encoder_layers"))
    w.add_audio_block_count(layers)
    w.add_audio_head_count(a.get("num_attention_heads", a.get("encoder_attention_heads")))
    if family == "qwen3_asr":
        w.add_clip_audio_projector_type("qwen3a")
    else:
        w.add_clip_projector_type("qwen2a" if family == "qwen2_audio" else "musicflamingo")
    w.add_audio_num_mel_bins(a["num_mel_bins"])
    w.add_audio_attention_layernorm_eps(a.get("layer_norm_eps", 1e-5))
    tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(layers, 4))
    if family == "qwen3_asr":
        return _finish(w, _qwen3a_tensors(hf_dir, a, tensor_map), matrix_type)
    out = {}
    for name, value in _load(hf_dir).items():
        if not name.startswith(("audio_tower.", "multi_modal_projector.")):
            continue
        if name.startswith("multi_modal_projector"):
            name = "audio." + name
        if "conv1.bias" in name or "conv2.bias" in name:
            value = value[:, None]
        new = tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        if ".conv" in name and name.endswith(".weight") and family == "qwen2_audio" and matrix_type != Q.F32:
            value = value.astype(np.float16)  # (the converter keeps Qwen2-Audio's convolutions F16)
        out[new] = value
    _finish(w, out, matrix_type)


def _qwen3a_tensors(hf_dir, a: dict, tensor_map) -> dict[str, np.ndarray]:
    from flared.model.audio import sinusoid_positions

    out = {"a.position_embd.weight": sinusoid_positions(1500, a["d_model"]).numpy()}
    renames = {"model.audio_tower.": "audio_tower.", "model.multi_modal_projector.linear_1.": "audio_tower.proj1.",
               "model.multi_modal_projector.linear_2.": "audio_tower.proj2."}
    for name, value in _load(hf_dir).items():
        name = next((new + name[len(old):] for old, new in renames.items() if name.startswith(old)), None)
        if name is None:
            continue
        if "conv2d" in name and name.endswith(".bias"):
            value = value[:, None, None]
        new = tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        out[new] = value
    return out


@pytest.mark.parametrize("family", ["qwen2_audio", "audioflamingo3", "qwen3_asr"])
def test_an_audio_mmproj_reads_as_the_checkpoint_and_serves_its_clips(family, request, tmp_path, start_daemon):
    """Qwen2-Audio's and Audio Flamingo 3's encoders as llama.cpp's converter writes them: read back beside the
    model GGUF, the encoder's config and tensors are the checkpoint's bit for bit, the core keeps its feature
    extractor, and `flared run model.gguf --mmproj` answers a clip with the checkpoint's own core's greedy tokens
    (which are transformers', tests/api/test_audio_*.py)."""
    from flared_testing.audio import ask, input_audio, tone
    from flared_testing.vision import token_ids

    from flared.core.export import ExportOptions, export_core

    hf_dir, reference = request.getfixturevalue(f"tiny_{family}")
    write_model_gguf(hf_dir, tmp_path / "model.gguf", family, tmp_path)
    write_audio_mmproj(hf_dir, tmp_path / "mmproj.gguf", family)
    ours = read_source(tmp_path / "model.gguf", mmproj=tmp_path / "mmproj.gguf")
    theirs = read_source(hf_dir)
    assert ours.vision == theirs.vision
    assert sorted(ours.vision_tensors) == sorted(theirs.vision_tensors)
    for key, want in theirs.vision_tensors.items():
        assert torch.equal(ours.vision_tensors[key], want), key
    options = dict(concurrency=2, context_tokens=2048, prefill_chunk_tokens=256)
    core = export_core(tmp_path / "model.gguf", tmp_path / "core", ExportOptions(**options,
                                                                                  mmproj=str(tmp_path / "mmproj.gguf")))
    mine = dict(core.vision["processor"])
    want = json.loads((reference / "manifest.json").read_text())["vision"]["processor"]
    if family != "qwen3_asr":  # (the mmproj holds no clip length: AudioFlamingo3Processor's ten minutes; the tiny
        # checkpoint says one)
        assert mine.pop("max_windows") == (20 if family == "audioflamingo3" else 1)
        want.pop("max_windows")
    assert mine == want
    assert core.capabilities["audio"] and not core.capabilities["vision"]
    answers = []
    clip = tone(31, 35.0 if family == "audioflamingo3" else 2.5)  # (Audio Flamingo 3: two windows)
    for served, args in ((reference, ()), (tmp_path / "model.gguf", (
            "--mmproj", str(tmp_path / "mmproj.gguf"), "--dtype", "float32", "--context", "2048",
            "--concurrency", "2", "--prefill-chunk", "256", "--cache-dir", str(tmp_path / "cache")))):
        daemon = start_daemon(served, *args)
        status, body = ask(daemon, [input_audio(clip)], "What is it?", 8)
        assert status == 200, body
        answers.append((body["usage"]["prompt_tokens"], token_ids(body)))
        daemon.kill()
    assert answers[1] == answers[0]


# the chat template llama.cpp's converter writes into a Qwen3-ASR model GGUF: ChatML over string contents
CONVERTER_CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                    "{% endif %}")


def test_a_qwen3a_model_gguf_with_the_converters_chatml_template_wraps_each_clip(request, tmp_path, start_daemon):
    """The converter writes Qwen3-ASR's model GGUF a ChatML template over string contents, which cannot write its
    audio tokens: a clip's part becomes <|audio_start|><|audio_pad|><|audio_end|> in the text (as llama.cpp's mtmd
    puts those two around a qwen3a clip), its pad then the clip's tokens."""
    import shutil

    from tokenizers import Tokenizer

    from flared.frontend.audio import DecodedAudio, Qwen3AsrProcessor
    from flared_testing.audio import ask, input_audio, tone

    hf_dir = tmp_path / "hf"
    shutil.copytree(request.getfixturevalue("tiny_qwen3_asr")[0], hf_dir)
    tcfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({**tcfg, "chat_template": CONVERTER_CHATML}))
    write_model_gguf(hf_dir, tmp_path / "model.gguf", "qwen3_asr", tmp_path)
    write_audio_mmproj(hf_dir, tmp_path / "mmproj.gguf", "qwen3_asr")
    daemon = start_daemon(tmp_path / "model.gguf", "--mmproj", str(tmp_path / "mmproj.gguf"), "--dtype", "float32",
                          "--context", "1024", "--concurrency", "2", "--cache-dir", str(tmp_path / "cache"))
    clip = tone(32, 2.3)
    status, body = ask(daemon, [input_audio(clip)], "What is it?", 4)
    assert status == 200, body
    clip_tokens = Qwen3AsrProcessor(feature_size=16).prepare(DecodedAudio(clip.astype(np.float32) / 32768,
                                                                          16000)).num_image_tokens
    text = ("<|im_start|>user\n<|audio_start|><|audio_pad|><|audio_end|>\nWhat is it?<|im_end|>\n"
            "<|im_start|>assistant\n")
    rendered = Tokenizer.from_file(str(hf_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert body["usage"]["prompt_tokens"] == len(rendered) - 1 + clip_tokens == len(rendered) + 29
    # a transcription forcing its language: the ChatML system turn, the wrapped clip, and the answer begun with
    # "language English<asr_text>", <asr_text> one token (the GGUF's USER_DEFINED added token)
    openai = pytest.importorskip("openai")
    from flared_testing.audio import wav_bytes

    client = openai.OpenAI(base_url=f"{daemon.base}/v1", api_key="none", max_retries=0)
    got = client.audio.transcriptions.create(model="tiny", file=("clip.wav", wav_bytes(clip), "audio/wav"),
                                             language="en", extra_body={"max_completion_tokens": 3})
    text = ("<|im_start|>system\n<|im_end|>\n<|im_start|>user\n<|audio_start|><|audio_pad|><|audio_end|><|im_end|>\n"
            "<|im_start|>assistant\nlanguage English<asr_text>")
    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    assert tok.encode("language English<asr_text>", add_special_tokens=False).tokens[-1] == "<asr_text>"
    assert got.usage.input_tokens == len(tok.encode(text, add_special_tokens=False).ids) - 1 + clip_tokens


def test_a_qwen3a_mmproj_beside_a_qwen3vl_model_gguf_answers_as_the_checkpoint(request, tmp_path, start_daemon):
    """The converter writes Qwen3-ASR's decoder as llama.cpp's qwen3vl (the released text config's multimodal rope
    split as its dimension sections): a clip's tokens, and the text's, take plain positions there, as they do in the
    checkpoint (an audio token's three positions are equal), so the answer is the checkpoint core's."""
    import shutil

    from flared_testing.audio import ask, input_audio, tone
    from flared_testing.vision import token_ids

    hf_dir, reference = request.getfixturevalue("tiny_qwen3_asr")
    d = tmp_path / "hf"
    shutil.copytree(hf_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    rope = cfg["text_config"].get("rope_parameters") or {"rope_type": "default", "rope_theta": 1e6}
    cfg["text_config"]["rope_parameters"] = {**rope, "mrope_section": [2, 3, 3], "mrope_interleaved": True}
    (d / "config.json").write_text(json.dumps(cfg))
    write_model_gguf(d, tmp_path / "model.gguf", "qwen3_asr", tmp_path, arch="qwen3vl")
    write_audio_mmproj(hf_dir, tmp_path / "mmproj.gguf", "qwen3_asr")
    answers = []
    for served, args in ((reference, ()), (tmp_path / "model.gguf", (
            "--mmproj", str(tmp_path / "mmproj.gguf"), "--dtype", "float32", "--context", "2048",
            "--concurrency", "2", "--prefill-chunk", "256", "--cache-dir", str(tmp_path / "cache")))):
        daemon = start_daemon(served, *args)
        status, body = ask(daemon, [input_audio(tone(33, 3.4))], "What is it?", 8)
        assert status == 200, body
        answers.append((body["usage"]["prompt_tokens"], token_ids(body)))
        daemon.kill()
    assert answers[1] == answers[0]


def test_an_audio_mmproj_of_another_model_is_refused(request, tmp_path):
    hf_dir = request.getfixturevalue("tiny_qwen2_audio")[0]
    other = request.getfixturevalue("tiny_hf_smolvlm")
    write_model_gguf(other, tmp_path / "model.gguf", "smolvlm", tmp_path)
    write_audio_mmproj(hf_dir, tmp_path / "mmproj.gguf", "qwen2_audio")
    with pytest.raises(CoreError, match="no <\\|AUDIO\\|> token|belongs to another model"):
        read_source(tmp_path / "model.gguf", mmproj=tmp_path / "mmproj.gguf")


def add_tokenizer(w, hf_dir) -> None:
    """The checkpoint's byte-level BPE tokenizer and chat template as a GGUF holds them (tokenizer.ggml.*): its
    special added tokens CONTROL, the others USER_DEFINED, as the converter types them."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tcfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    added = {a["content"] for a in tok["added_tokens"]} - special  # (Qwen3-ASR's <asr_text>: USER_DEFINED)
    vocab.update({a["content"]: a["id"] for a in tok["added_tokens"]})
    tokens = [""] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if text in special else 4 if text in added else 1 for text in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    for key, add in (("bos_token", w.add_bos_token_id), ("eos_token", w.add_eos_token_id),
                     ("pad_token", w.add_pad_token_id)):
        if tcfg.get(key):
            add(vocab[tcfg[key]])
    w.add_add_bos_token(False)
    w.add_chat_template(tcfg["chat_template"])


def write_model_gguf(hf_dir, path, family: str, tmp_path, matrix_type=Q.F32, arch: str | None = None) -> None:
    """The checkpoint's decoder and tokenizer as llama.cpp's converter writes its model GGUF (its matrices
    ``matrix_type``); ``arch``: another GGUF architecture than the family's (TEXT_ARCH)."""
    from safetensors.numpy import save_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    text = dict(cfg["text_config"])
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    weights = _text_weights(_load(hf_dir))
    arch = arch or TEXT_ARCH[family]
    d = tmp_path / f"text-{family}-{arch}-{matrix_type.name}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(text))
    save_file(weights, d / "model.safetensors")

    def extra(w):
        add_tokenizer(w, hf_dir)
        if arch in ("qwen2vl", "qwen3vl", "qwen35"):  # (the converter's mRoPE split, padded to four)
            rope = text.get("rope_parameters") or text.get("rope_scaling")
            w.add_rope_dimension_sections([*rope["mrope_section"], 0])
        if arch == "qwen3vl":
            w.add_uint32(f"{arch}.n_deepstack_layers",
                         len(cfg.get("vision_config", {}).get("deepstack_visual_indexes", [])))
        if arch == "gemma3":  # (the tiny model's every-other-layer window; llama.cpp assumes every sixth global)
            w.add_uint32(f"{arch}.attention.sliding_window_pattern", 2)

    if arch == "llama4":  # (its converter's own keys: test_llama4.write_llama4_gguf)
        from .test_llama4 import write_llama4_gguf

        write_llama4_gguf(d, path, extra)
        return
    if arch == "gemma4":  # (its converter's own keys: test_gguf_families.write_gemma4_gguf)
        from .test_gguf_families import write_gemma4_gguf

        if not text.get("per_layer_config"):  # (global layers of the windowed ones' geometry)
            text.setdefault("global_head_dim", text["head_dim"])
            text.setdefault("num_global_key_value_heads", text["num_key_value_heads"])
        (d / "config.json").write_text(json.dumps(text))
        write_gemma4_gguf(d, path, extra)
        return
    write_gguf(d, path, arch, matrix_type, extra)


def _checkpoint(family, tmp_path_factory, request):
    if family == "gemma4":  # (26B-A4B-like: images both ways on the windowed layers; no audio tower)
        return request.getfixturevalue("tiny_gemma4_vision_both_ways")[0]
    if family == "gemma4_e2b":  # (per-layer inputs; its audio tower left out of the mmproj)
        return request.getfixturevalue("tiny_gemma4_vision")[0]
    if family == "smolvlm":
        return request.getfixturevalue("tiny_hf_smolvlm")
    if family in ("mistral3", "pixtral", "gemma3", "internvl"):
        return request.getfixturevalue(f"tiny_{family}")[0]
    if family == "llama4":
        return request.getfixturevalue("tiny_llama4_vision")[0]
    return build_tiny_qwen_vl(tmp_path_factory.mktemp(f"hf-{family}"), family)


@pytest.fixture(scope="module", params=["smolvlm", "mistral3", "pixtral", "gemma3", "qwen2_vl", "qwen2_5_vl",
                                        "qwen3_vl", "qwen3_5", "internvl", "gemma4", "gemma4_e2b", "llama4"])
def converted(request, tmp_path_factory):
    """(family, checkpoint, model GGUF, mmproj GGUF)."""
    family = request.param
    hf_dir = _checkpoint(family, tmp_path_factory, request)
    out = tmp_path_factory.mktemp(f"gguf-{family}")
    write_model_gguf(hf_dir, out / "model.gguf", family, out)
    write_mmproj(hf_dir, out / "mmproj.gguf", family)
    return family, hf_dir, out / "model.gguf", out / "mmproj.gguf"


def _images_only(config):
    """A checkpoint's vision config as an mmproj says it: llama.cpp has no video, so an mmproj core takes images
    alone and its config names no video token or rate."""
    return dataclasses.replace(config, video_token_id=-1, tokens_per_second=0.0)


def test_a_model_gguf_and_its_mmproj_read_as_the_checkpoint(converted):
    family, hf_dir, model, mmproj = converted
    ours = read_source(model, mmproj=mmproj)
    theirs = read_source(hf_dir)
    expected = _images_only(theirs.vision)
    if family == "qwen2_5_vl":  # (the converter does not write the window: transformers' default, 112 pixels)
        assert ours.vision.window_size == 112
        expected = dataclasses.replace(expected, window_size=112)
    assert ours.vision == expected
    assert ours.config.rms_norm_eps == pytest.approx(theirs.config.rms_norm_eps, rel=1e-6)  # (a float32 there)
    assert dataclasses.replace(ours.config, rms_norm_eps=theirs.config.rms_norm_eps) == theirs.config
    for name in ("vision_tensors", "tensors"):
        got, want = getattr(ours, name), getattr(theirs, name)
        assert sorted(got) == sorted(want)
        for key in want:
            if family == "gemma3" and key == "proj_norm.weight":  # (stored as 1 + w: w again within float32's step)
                assert torch.allclose(got[key], want[key], atol=1e-6), key
                continue
            assert torch.equal(got[key], want[key]), (name, key)
    assert (ours.audio is None) == (theirs.audio is None)
    if theirs.audio is not None:  # (Gemma 4 E2B's conformer, in the same mmproj)
        assert ours.audio == theirs.audio
        assert sorted(ours.audio_tensors) == sorted(theirs.audio_tensors)
        for key, want in theirs.audio_tensors.items():  # (the scale softplus'd in float64 there, float32 here)
            assert torch.allclose(ours.audio_tensors[key], want, atol=1e-6, rtol=1e-6), key


def test_the_tower_width_comes_from_its_matrices(tmp_path, tmp_path_factory):
    """Qwen2-VL's converter writes the merger's output width (its vision config's hidden_size, 1536 for the 2B)
    as clip.vision.feed_forward_length; the MLP is embed_dim x mlp_ratio (5120) wide. The reader takes the
    width from the MLP's matrices."""
    hf_dir = build_tiny_qwen_vl(tmp_path_factory.mktemp("hf-qwen2_vl"), "qwen2_vl")
    write_model_gguf(hf_dir, tmp_path / "model.gguf", "qwen2_vl", tmp_path)
    write_mmproj(hf_dir, tmp_path / "mmproj.gguf", "qwen2_vl", feed_forward=1536)
    ours = read_source(tmp_path / "model.gguf", mmproj=tmp_path / "mmproj.gguf").vision
    assert ours == _images_only(read_source(hf_dir).vision)


@pytest.mark.parametrize("family", ["smolvlm", "qwen2_vl"])  # (a tiled and a patch tower)
def test_an_mmproj_of_f16_and_q8_0_matrices_reads_near_its_values(family, request, tmp_path_factory, tmp_path):
    hf_dir = _checkpoint(family, tmp_path_factory, request)
    model = tmp_path / "model.gguf"
    write_model_gguf(hf_dir, model, family, tmp_path)
    theirs = read_source(hf_dir).vision_tensors
    for qtype, tol in ((Q.F16, 1e-3), (Q.Q8_0, 2e-2)):
        path = tmp_path / f"mmproj-{qtype.name}.gguf"
        write_mmproj(hf_dir, path, family, matrix_type=qtype)
        got = read_source(model, mmproj=path, dtype=torch.bfloat16).vision_tensors
        for key, want in theirs.items():
            assert got[key].dtype == (torch.bfloat16 if want.dim() >= 2 else torch.float32), key
            scale = want.abs().max().item() or 1.0
            assert (got[key].float() - want).abs().max().item() <= tol * scale + 1e-2, (qtype, key)


def test_an_exported_core_keeps_the_tower_and_its_image_preparation(converted, tmp_path):
    from flared.core.export import ExportOptions, export_core

    family, hf_dir, model, mmproj = converted
    options = dict(concurrency=2, context_tokens=256, prefill_chunk_tokens=64)
    ours = export_core(model, tmp_path / "ours", ExportOptions(**options, mmproj=str(mmproj))).vision
    theirs = export_core(hf_dir, tmp_path / "theirs", ExportOptions(**options)).vision
    assert ours["processor"]["kind"] == theirs["processor"]["kind"]
    mine, want = dict(ours["processor"]), dict(theirs["processor"])
    if family.startswith("qwen"):  # (the mmproj holds no pixel bounds: the released processors')
        bounds = (65536, 16777216) if family in ("qwen3_vl", "qwen3_5") else (3136, 12845056)
        assert (mine.pop("min_pixels"), mine.pop("max_pixels")) == bounds
        want.pop("min_pixels"), want.pop("max_pixels")
        if family == "qwen2_5_vl":
            ours["config"]["window_size"] = theirs["config"]["window_size"]
    if family.startswith("gemma4"):  # (the mmproj holds no budget: the released processor's 280 soft tokens)
        assert mine.pop("max_soft_tokens") == 280 and want.pop("max_soft_tokens") == 70
    if family == "llama4":  # (nor the canvas's tiles: the released 16)
        assert mine.pop("max_patches") == 16 and want.pop("max_patches") == 6
    for key in ("image_mean", "image_std"):  # (float32s in the file: the same values in the float32 arithmetic)
        assert np.array_equal(np.float32(mine.pop(key)), np.float32(want.pop(key))), key
    assert mine == want
    assert "video" not in ours  # (llama.cpp has no video: an mmproj core takes images alone)
    assert ours["config"] == {**theirs["config"], "video_token_id": -1, "tokens_per_second": 0.0}


@pytest.mark.parametrize("family", ["smolvlm", "qwen2_vl", "gemma3", "internvl", "gemma4", "gemma4_e2b", "llama4"])
def test_flared_run_with_mmproj_answers_an_image_as_the_checkpoint(family, request, tmp_path_factory, tmp_path,
                                                                   start_daemon):
    """`flared run model.gguf --mmproj mmproj.gguf` (exported once into the cache) answers an image with the
    greedy tokens the checkpoint's own core gives (that core's answers are transformers', tests/api)."""
    from flared.core.export import ExportOptions, export_core
    from flared_testing.vision import ask_greedy, noise_image, token_ids

    hf_dir = _checkpoint(family, tmp_path_factory, request)
    write_model_gguf(hf_dir, tmp_path / "model.gguf", family, tmp_path)
    write_mmproj(hf_dir, tmp_path / "mmproj.gguf", family)
    reference = tmp_path / "reference"
    export_core(hf_dir, reference, ExportOptions(concurrency=2, context_tokens=512, prefill_chunk_tokens=128))
    image = noise_image(7, (70, 50))
    answers = []
    for core, args in ((reference, ()), (tmp_path / "model.gguf", (
            "--mmproj", str(tmp_path / "mmproj.gguf"), "--dtype", "float32", "--context", "512",
            "--concurrency", "2", "--prefill-chunk", "128", "--cache-dir", str(tmp_path / "cache")))):
        daemon = start_daemon(core, *args)
        # (Gemma 4: the checkpoint's 70-token budget, which the mmproj cannot say)
        # (Llama 4: the checkpoint's canvases of 6 tiles at most, where the mmproj's are the released 16)
        kw = ({"mm_processor_kwargs": {"max_soft_tokens": 70}} if family.startswith("gemma4") else
              {"mm_processor_kwargs": {"max_patches": 6}} if family == "llama4" else {})
        body = ask_greedy(daemon, [image], "What is in the picture?", 8, **kw)
        answers.append((body["usage"]["prompt_tokens"], token_ids(body)))
        if family == "gemma4_e2b":  # (a clip through the conformer the mmproj holds too)
            from flared_testing.audio import ask, input_audio, tone

            status, body = ask(daemon, [input_audio(tone(3, 1.2))], "And this?", 6)
            assert status == 200, body
            answers.append((body["usage"]["prompt_tokens"], token_ids(body)))
        status, models = daemon.request("GET", "/v1/models")
        assert status == 200 and models["data"][0]["capabilities"]["vision"] is True, models
        daemon.kill()
    half = len(answers) // 2
    assert answers[half:] == answers[:half]
    assert answers[0][0] > 20  # (the image's tokens are in the prompt)


def test_a_quantised_gguf_with_an_f16_mmproj_serves_images_at_the_default_dtype(tmp_path, request,
                                                                                  start_daemon):
    """As llama.cpp's files come (Q8_0 layers, an F16 tower), served as `flared run` picks: on a CPU with the
    bfloat16 kernels, the layers kept at their bits (-q gguf) and the tower in bfloat16."""
    from flared_testing.vision import ask_greedy, noise_image

    hf_dir = request.getfixturevalue("tiny_hf_smolvlm")
    write_model_gguf(hf_dir, tmp_path / "model.gguf", "smolvlm", tmp_path, matrix_type=Q.Q8_0)
    write_mmproj(hf_dir, tmp_path / "mmproj.gguf", "smolvlm", matrix_type=Q.F16)
    daemon = start_daemon(tmp_path / "model.gguf", "--mmproj", str(tmp_path / "mmproj.gguf"), "--context", "512",
                          "--concurrency", "2", "--prefill-chunk", "128", "--cache-dir", str(tmp_path / "cache"))
    body = ask_greedy(daemon, [noise_image(7, (70, 50))], "What is in the picture?", 8)
    assert body["usage"]["prompt_tokens"] > 20 and body["usage"]["completion_tokens"] == 8
    status, props = daemon.request("GET", "/props")
    assert status == 200 and props["modalities"]["vision"] is True, props


def test_mmproj_mistakes_are_clear_errors(tmp_path, tmp_path_factory):
    hf_dir = build_tiny_qwen_vl(tmp_path_factory.mktemp("hf-qwen2_vl"), "qwen2_vl")
    model, mmproj = tmp_path / "model.gguf", tmp_path / "mmproj.gguf"
    write_model_gguf(hf_dir, model, "qwen2_vl", tmp_path)
    write_mmproj(hf_dir, mmproj, "qwen2_vl")
    with pytest.raises(CoreError, match="is an mmproj file"):  # the tower given as the model
        read_source(mmproj)
    with pytest.raises(CoreError, match="not an mmproj file"):  # a model given as the tower
        read_source(model, mmproj=model)
    with pytest.raises(CoreError, match="goes with a GGUF model"):
        read_source(hf_dir, mmproj=mmproj)
    write_model_gguf(hf_dir, tmp_path / "qwen2.gguf", "qwen2_vl", tmp_path, arch="qwen2")
    with pytest.raises(CoreError, match="mRoPE split"):  # a decoder without its mRoPE sections: plain qwen2
        read_source(tmp_path / "qwen2.gguf", mmproj=mmproj)
    # another model's tower: its projection is another width
    other = build_tiny_qwen_vl(tmp_path_factory.mktemp("hf-qwen3_vl"), "qwen3_vl")
    cfg = json.loads((other / "config.json").read_text())
    cfg["text_config"]["hidden_size"] = 48
    (tmp_path / "wide").mkdir()
    for f in ("preprocessor_config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / "wide" / f).write_bytes((other / f).read_bytes())
    (tmp_path / "wide" / "config.json").write_text(json.dumps(cfg))
    write_mmproj(tmp_path / "wide", tmp_path / "wide.gguf", "qwen3_vl")
    with pytest.raises(CoreError, match="hidden size 48"):
        read_source(model, mmproj=tmp_path / "wide.gguf")
    # a projector this reader does not know
    w = gguf.GGUFWriter(str(tmp_path / "mlp.gguf"), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type("mlp")
    w.add_tensor("mm.0.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CoreError, match="projector type 'mlp' is not supported.*idefics3"):
        read_source(model, mmproj=tmp_path / "mlp.gguf")


def test_the_cached_core_of_a_gguf_and_its_mmproj(tmp_path, tmp_path_factory):
    """ensure_source_core: the tower's file is part of the cached core's name and stamp (a new mmproj, or one
    changed, exports again), and --mmproj beside a checkpoint directory or a core is refused."""
    from flared.cli.ctl import resolve_core
    from flared.core.sources import ensure_source_core, fingerprint, source_core_dir

    hf_dir = build_tiny_qwen_vl(tmp_path_factory.mktemp("hf-qwen2_vl"), "qwen2_vl")
    model, mmproj = tmp_path / "model.gguf", tmp_path / "mmproj.gguf"
    write_model_gguf(hf_dir, model, "qwen2_vl", tmp_path)
    write_mmproj(hf_dir, mmproj, "qwen2_vl")
    cache = tmp_path / "cache"
    plain = source_core_dir(model, cache, "float32")
    assert source_core_dir(model, cache, "float32", mmproj=mmproj) != plain
    assert "mmproj" in fingerprint(model, mmproj) and "mmproj" not in fingerprint(model)
    core = ensure_source_core(model, cache, "float32", capacities={"context": 256, "concurrency": 2},
                              mmproj=mmproj)
    manifest = json.loads((core / "manifest.json").read_text())
    assert manifest["capabilities"]["vision"] and manifest["source"]["mmproj"]["name"] == "mmproj.gguf"
    with pytest.raises(CoreError, match="goes with a GGUF model"):
        ensure_source_core(hf_dir, cache, "float32", mmproj=mmproj)
    with pytest.raises(CoreError, match="is a core"):
        resolve_core(str(core), cache, mmproj=str(mmproj))
    with pytest.raises(CoreError, match="not the embedded model"):
        resolve_core("default", cache, mmproj=str(mmproj))


def test_flared_run_batch_with_mmproj_answers_an_image_line(request, tmp_path):
    """`flared run-batch --mmproj` (vLLM's offline batch over a GGUF pair): an image line's answer is the checkpoint
    core's."""
    import subprocess
    import sys

    from flared.core.export import ExportOptions, export_core
    from flared_testing.vision import data_url, noise_image

    hf_dir = request.getfixturevalue("tiny_hf_smolvlm")
    write_model_gguf(hf_dir, tmp_path / "model.gguf", "smolvlm", tmp_path)
    write_mmproj(hf_dir, tmp_path / "mmproj.gguf", "smolvlm")
    reference = tmp_path / "reference"
    export_core(hf_dir, reference, ExportOptions(concurrency=2, context_tokens=512, prefill_chunk_tokens=128))
    content = [{"type": "image_url", "image_url": {"url": data_url(noise_image(7, (70, 50)))}},
               {"type": "text", "text": "What is in the picture?"}]
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 8,
                     "temperature": 0}}
    (tmp_path / "in.jsonl").write_text(json.dumps(line) + "\n")
    answers = []
    for core, args in ((reference, ()), (tmp_path / "model.gguf", (
            "--mmproj", str(tmp_path / "mmproj.gguf"), "--dtype", "float32", "--context", "512", "--concurrency",
            "2", "--prefill-chunk", "128", "--cache-dir", str(tmp_path / "cache")))):
        out = tmp_path / f"out-{len(answers)}.jsonl"
        cmd = [sys.executable, "-m", "flared.cli.daemon", "run-batch", "-i", str(tmp_path / "in.jsonl"), "-o",
               str(out), "--served-name", "tiny", str(core), *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        result = json.loads(out.read_text().splitlines()[0])
        assert result["response"]["status_code"] == 200, result
        body = result["response"]["body"]
        answers.append((body["usage"]["prompt_tokens"], body["choices"][0]["message"]["content"]))
    assert answers[1] == answers[0] and answers[0][0] > 20


def test_an_internvit_6b_layout_reads_from_its_tensors(tmp_path, tmp_path_factory):
    """InternViT-6B's layout (RMSNorm layers, q and k RMS-normed, no q/k/v biases) is told apart by the tensors the
    mmproj holds: it reads as the checkpoint's tower."""
    from ..conftest import build_tiny_internvl

    hf_dir = build_tiny_internvl(tmp_path_factory.mktemp("hf-internvit6b"), norm_type="rms_norm", use_qk_norm=True,
                                 attention_bias=False)
    write_model_gguf(hf_dir, tmp_path / "model.gguf", "internvl", tmp_path)
    write_mmproj(hf_dir, tmp_path / "mmproj.gguf", "internvl")
    ours, theirs = read_source(tmp_path / "model.gguf", mmproj=tmp_path / "mmproj.gguf"), read_source(hf_dir)
    assert ours.vision == theirs.vision and (ours.vision.norm_kind, ours.vision.qk_norm) == ("rms_norm", True)
    assert sorted(ours.vision_tensors) == sorted(theirs.vision_tensors)
    assert all(torch.equal(ours.vision_tensors[k], v) for k, v in theirs.vision_tensors.items())
