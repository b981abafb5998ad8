"""llama.cpp's image towers: an mmproj GGUF (``llama-server -m model.gguf --mmproj mmproj.gguf``) read beside the
model's own GGUF, as a vision tower of ours (``flared.model.vision``).

An mmproj file is what llama.cpp's converter (``convert_hf_to_gguf.py --mmproj``) writes of a vision-language
checkpoint's tower and projector: general.architecture "clip", the tower's sizes under ``clip.vision.*``, the
projector's kind in ``clip.projector_type`` and the tensors renamed (``v.blk.{i}.attn_q``, ``mm.0``, ...). Its model
GGUF holds the decoder and the tokenizer. This module undoes what the converter did, per projector:

- ``idefics3`` (SmolVLM, Idefics3): SigLIP layers, q/k/v apart; the pixel-shuffle projector ``mm.model.fc``.
- ``pixtral`` (Mistral Small 3.1 / 3.2, Mistral3; Pixtral 12B): q/k rows permuted for llama.cpp's interleaved rope,
  undone here as for a Llama GGUF's; the patch merger ``mm.patch_merger`` and the norm ``mm.input_norm`` (Mistral3's
  only), the MLP ``mm.1``/``mm.2``.
- ``qwen2vl_merger``, ``qwen2.5vl_merger`` (Qwen2-VL, Qwen2.5-VL): the Conv3D patch embedding split by time into
  ``v.patch_embd.weight`` and ``.weight.1``; q/k/v apart; the merger ``v.post_ln``, ``mm.0``, ``mm.2``;
  Qwen2.5-VL's full-attention layers as every ``clip.vision.n_wa_pattern``-th.
- ``qwen3vl_merger`` (Qwen3-VL, Qwen3.5): the same patch split (biased), fused qkv, the position table, and the
  DeepStack mergers ``v.deepstack.{layer}.*`` under their tower layer's index.
- ``internvl`` (InternVL2.5, InternVL3, InternVL3.5): InternViT's q/k/v apart (the converter splits the original
  checkpoints' fused qkv), its layer scales ``v.blk.{i}.ls1``/``ls2``, the class token ``v.class_embd``; the
  projector ``mm.model.mlp.0`` (LayerNorm), ``.1`` and ``.3``. Which layout (LayerNorm or RMSNorm layers, q/k norms,
  q/k/v biases, a post-LayerNorm) comes from the tensors present; the tiling bounds from
  ``clip.vision.preproc_min_tiles``/``max_tiles`` where written (the released 1 and 12 where not).
- ``gemma3`` (Gemma 3): SigLIP's layers as Idefics3's; the projector's RMSNorm ``mm.soft_emb_norm`` stored as 1 + w,
  its projection ``mm.input_projection`` as transformers holds it ([tower width, hidden]); the pooling
  (``projector.scale_factor``) written only where it is not 4.
- ``llama4`` (Llama 4 Scout, Maverick): the patches' linear ``v.patch_embd``, the class row ``v.class_embd``, the
  positions ``v.position_embd``, ``v.pre_ln``/``v.post_ln``, layers of q/k/v apart as released (the tower's rope
  turns interleaved pairs: nothing to undo), the adapter ``mm.model.mlp.1``/``.2`` and the projector
  ``mm.model.fc``; the pixel shuffle from ``clip.vision.projector.scale_factor``; rope theta and the canvas's 16 tiles
  the released config's.
- ``gemma4v`` (Gemma 4): the patches' linear stored as a convolution's [D, 3, p, p] (transformers' [D, p * p * 3]
  again here), the two position tables ``v.position_embd`` [2, positions, D], Gemma layers (``ln1``,
  ``attn_post_norm``, ``ln2``, ``ffn_post_norm``, q/k norms) with each product's clamp bounds beside it
  (``attn_q.input_min`` ...: use_clipped_linears), ``v.std_bias``/``v.std_scale`` where the tower standardizes, the
  projection ``mm.input_projection`` (a linear's weight). What the file does not say is the released configs': 3 x 3
  pooling, rope theta 100, 280 soft tokens an image; and whether images attend both ways on the windowed layers,
  which the released models do where they have no per-layer inputs (26B-A4B, 31B: the model GGUF's
  ``embedding_length_per_layer_input`` 0). An mmproj of E2B or E4B also holds their audio conformer (``a.*``,
  ``mm.a.*``, ``clip.audio.projector_type`` gemma4a), read as the core's second tower (``_read_gemma4_audio``).

An audio encoder's mmproj (``clip.has_audio_encoder``, its sizes under ``clip.audio.*``) is read the same way
(``_read_audio``): ``qwen3a`` (Qwen3-ASR: ``_read_qwen3_asr``), ``qwen2a`` (Qwen2-Audio) and ``musicflamingo`` (the
converter's type for Audio Flamingo 3):
Whisper's layers as ``a.blk.{i}.*`` with q/k/v apart, the two convolutions ``a.conv1d.1``/``.2`` (their biases
[D, 1]), ``a.position_embd``, ``a.post_ln``; the projector ``mm.a.fc`` (Qwen2-Audio) or ``mm.a.mlp.1``/``.2``
(Audio Flamingo 3). The feature extractor is Whisper's at the file's mel bins, as the released
preprocessor_config.json says it; Audio Flamingo 3's clips take its processor's ten minutes.

What the files do not record comes from elsewhere: the decoder's mRoPE split from the model GGUF's
``{arch}.rope.dimension_sections``; the image token's id from its vocabulary; image preparation settings the mmproj
lacks (resampling filter, Qwen's pixel bounds, SmolVLM's tiling) take the released processors' values, as
transformers would read them from the checkpoint's preprocessor_config.json.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import torch

from flared.errors import CoreError, ErrorKind
from flared.model.loader import _gguf_field as _field
from flared.model.loader import gguf_tensor_values, unpermute_qk
from flared.model.vision import INTERNVIT_GGUF, VisionConfig, clipped_products, internvit_to_serving

# clip.projector_type -> our vision family
PROJECTORS = {"idefics3": "idefics3", "pixtral": "pixtral", "qwen2vl_merger": "qwen2_vl",
              "qwen2.5vl_merger": "qwen2_5_vl", "qwen3vl_merger": "qwen3_vl", "gemma3": "gemma3",
              "internvl": "internvl", "gemma4v": "gemma4", "llama4": "llama4"}
# the prompt token an image's rows replace, by family (in the model GGUF's vocabulary)
IMAGE_TOKENS = {"idefics3": "<image>", "pixtral": "[IMG]", "qwen2_vl": "<|image_pad|>",
                "qwen2_5_vl": "<|image_pad|>", "qwen3_vl": "<|image_pad|>", "gemma3": "<image_soft_token>",
                "internvl": "<IMG_CONTEXT>", "gemma4": "<|image|>", "llama4": "<|patch|>"}
# Released processors' pixel bounds (preprocessor_config.json): Qwen2-VL's and Qwen2.5-VL's min_pixels /
# max_pixels, Qwen3-VL's size.shortest_edge / longest_edge
_QWEN_PIXELS = {"qwen2_vl": (3136, 12845056), "qwen2_5_vl": (3136, 12845056), "qwen3_vl": (65536, 16777216)}
_QWEN25_WINDOW = 112  # transformers' Qwen2.5-VL window_size (pixels): the converter does not write it
_ACTS = {"idefics3": "gelu_pytorch_tanh", "gemma3": "gelu_pytorch_tanh", "qwen2_vl": "quick_gelu", "qwen2_5_vl": "silu",
         "qwen3_vl": "gelu_pytorch_tanh"}


@dataclasses.dataclass
class MmprojTower:
    """An mmproj file read: the tower's config and serving-layout tensors, and its image preparation as a Hugging
    Face checkpoint's preprocessor_config.json and processor_config.json would say it."""

    config: VisionConfig
    tensors: dict[str, torch.Tensor]
    preprocessor: dict[str, Any]
    processor: dict[str, Any]
    # a second tower in the same file (Gemma 4 E2B's and E4B's audio beside their images), read the same way
    second: MmprojTower | None = None


def is_mmproj(reader) -> bool:
    """Whether a GGUF read with GGUFFile is an mmproj (an image tower), not a model."""
    arch = _field(reader, "general.architecture")
    return arch == "clip" or _field(reader, "general.type") == "mmproj"


def read_mmproj(path: str | Path, *, text_reader, text_hidden_size: int, text_eps: float,
                dtype: torch.dtype | None = None) -> MmprojTower:
    """The tower an mmproj GGUF at ``path`` holds, for the model whose GGUF ``text_reader`` (a GGUFFile) read:
    its hidden size ``text_hidden_size`` and RMSNorm epsilon ``text_eps`` (Pixtral's projector norm uses it).
    Matrices are kept in ``dtype`` (None: float32), vectors in float32. Every mismatch is a CoreError naming the
    file."""
    from flared.frontend.gguf_metadata import GGUFFile

    source = str(path)
    try:
        reader = GGUFFile(source)
    except Exception as exc:
        raise CoreError(f"{source} is not a readable GGUF file: {exc}", ErrorKind.SOURCE_FORMAT) from None
    if not is_mmproj(reader):
        raise CoreError(f"{source}: not an mmproj file (general.architecture is "
                        f"{_field(reader, 'general.architecture')!r}, an image tower's is 'clip')",
                        ErrorKind.SOURCE_FORMAT)
    if not _field(reader, "clip.has_vision_encoder", False):
        if _field(reader, "clip.has_audio_encoder", False):
            return _read_audio(reader, source, text_reader=text_reader, text_hidden_size=text_hidden_size,
                               dtype=dtype)
        raise CoreError(f"{source}: this mmproj has neither a vision nor an audio encoder",
                        ErrorKind.SOURCE_FORMAT)
    kind = _field(reader, "clip.vision.projector_type") or _field(reader, "clip.projector_type")
    family = PROJECTORS.get(kind)
    if family is None:
        raise CoreError(f"{source}: projector type {kind!r} is not supported (supported: {', '.join(PROJECTORS)})",
                        ErrorKind.UNSUPPORTED_MODEL)

    # (Pixtral's [IMG_BREAK] row, which the model GGUF's embedding holds too)
    files = _Contents(reader, source, dtype, "clip.vision", used={"v.token_embd.img_break"})
    raw, need, take = files.raw, files.need, files.take

    projection = int(need("projection_dim"))
    if projection != text_hidden_size:
        raise CoreError(f"{source}: this image tower feeds a model of hidden size {projection}, but the model's is "
                        f"{text_hidden_size}: it belongs to another model", ErrorKind.SOURCE_FORMAT)
    text_arch = _field(text_reader, "general.architecture")
    image_token = IMAGE_TOKENS[family]
    tokens = _field(text_reader, "tokenizer.ggml.tokens") or []
    try:
        image_token_id = list(tokens).index(image_token)
    except ValueError:
        raise CoreError(f"{source}: the model's vocabulary has no {image_token} token, which a {kind} tower's "
                        "images stand in for: this mmproj belongs to another model", ErrorKind.SOURCE_FORMAT) from None
    eps = _field(reader, "clip.vision.attention.layer_norm_epsilon",
                 1e-5 if family in ("idefics3", "pixtral") else 1e-6)
    eps = float(f"{eps:.7g}")  # (a float32 in the file: the decimal the checkpoint's config gave, its 7 digits)
    # (the MLP's width from its matrix: Qwen2-VL's converter writes the merger's output width as the feed-forward
    # length, 1536 where the MLP is 5120 wide)
    width = int(take("v.blk.0.ffn_up.weight").shape[0])
    common = dict(
        family=family, hidden_size=int(need("embedding_length")), intermediate_size=width,
        num_layers=int(need("block_count")), num_heads=int(need("attention.head_count")),
        patch_size=int(need("patch_size")), text_hidden_size=text_hidden_size, image_token_id=image_token_id,
        layer_norm_eps=eps)
    mean = [float(x) for x in need("image_mean")]
    std = [float(x) for x in need("image_std")]
    layers = common["num_layers"]
    second = None
    try:
        if family == "idefics3":
            config = VisionConfig(**common, image_size=int(need("image_size")), hidden_act=_ACTS[family],
                                  scale_factor=int(_field(reader, "clip.vision.projector.scale_factor", 2)))
            tensors = _idefics3(take, layers)
            tile = config.image_size
            preprocessor = {"image_processor_type": "Idefics3ImageProcessor",
                            "size": {"longest_edge": int(_field(reader, "clip.vision.preproc_image_size", 4 * tile))},
                            "max_image_size": {"longest_edge": tile}, "do_image_splitting": True,
                            "image_mean": mean, "image_std": std}
            processor = {"image_seq_len": config.image_seq_len}
        elif family == "gemma3":
            # (the converter writes the pooling only where it is not the released models' 4 x 4)
            config = VisionConfig(**common, image_size=int(need("image_size")), hidden_act=_ACTS[family],
                                  scale_factor=int(_field(reader, "clip.vision.projector.scale_factor", 4)),
                                  projector_eps=eps)
            tensors = _gemma3(take, layers)
            side = config.image_size
            preprocessor = {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": side, "width": side},
                            "image_mean": mean, "image_std": std}
            processor = {"image_seq_length": config.image_seq_len}
        elif family == "gemma4":
            per_layer = int(_field(text_reader, f"{text_arch}.embedding_length_per_layer_input", 0) or 0)
            config = VisionConfig(
                **common, image_size=0, hidden_act="gelu_pytorch_tanh",
                scale_factor=int(_field(reader, "clip.vision.projector.scale_factor", 3)),
                rope_theta=100.0, position_table=int(take("v.position_embd.weight").shape[1]), projector_eps=eps,
                clipped_linears="v.blk.0.attn_q.input_max" in raw, standardize="v.std_bias" in raw,
                windowed_image_blocks=per_layer == 0,
                pad_token_id=int(_field(text_reader, "tokenizer.ggml.padding_token_id", 0) or 0))
            tensors = _gemma4(take, config)
            preprocessor = {"image_processor_type": "Gemma4ImageProcessor", "patch_size": config.patch_size,
                            "max_soft_tokens": 280, "pooling_kernel_size": config.scale_factor,
                            "image_mean": mean, "image_std": std}
            processor = {}
            if _field(reader, "clip.has_audio_encoder", False):  # (E2B's, E4B's conformer beside the tower)
                second = _read_gemma4_audio(files, reader, source, text_reader, text_hidden_size, config.pad_token_id)
        elif family == "llama4":
            config = VisionConfig(
                **common, image_size=int(need("image_size")), hidden_act="gelu",
                scale_factor=int(_field(reader, "clip.vision.projector.scale_factor", 2)),
                rope_theta=10000.0, output_dims=int(take("mm.model.mlp.2.weight").shape[0]))
            tensors = _llama4(take, raw, config)
            side = config.image_size
            preprocessor = {"image_processor_type": "Llama4ImageProcessor", "size": {"height": side, "width": side},
                            "max_patches": 16, "image_mean": mean, "image_std": std}
            processor = {"patch_size": config.patch_size, "pixel_shuffle_ratio": 1 / config.scale_factor}
        elif family == "internvl":
            config = VisionConfig(
                **common, image_size=int(need("image_size")),
                hidden_act="silu" if _field(reader, "clip.use_silu", False) else "gelu",
                scale_factor=int(_field(reader, "clip.vision.projector.scale_factor", 2)),
                norm_kind="layer_norm" if "v.blk.0.ln1.bias" in raw else "rms_norm",
                qk_norm="v.blk.0.attn_q_norm.weight" in raw, qkv_bias="v.blk.0.attn_q.bias" in raw,
                post_norm="v.post_ln.weight" in raw)
            tensors = internvit_to_serving(take, config, INTERNVIT_GGUF)
            side = config.image_size
            preprocessor = {"image_processor_type": "GotOcr2ImageProcessor", "size": {"height": side, "width": side},
                            "min_patches": int(_field(reader, "clip.vision.preproc_min_tiles", 1)),
                            "max_patches": int(_field(reader, "clip.vision.preproc_max_tiles", 12)),
                            "image_mean": mean, "image_std": std}
            processor = {"image_seq_length": config.image_seq_len}
        elif family == "pixtral":
            merger = "mm.patch_merger.weight" in raw  # (Mistral Small 3.1's; Pixtral 12B's projector has none)
            config = VisionConfig(
                **common, image_size=0, hidden_act="silu" if _field(reader, "clip.use_silu", False) else "gelu",
                scale_factor=int(_field(reader, "clip.vision.spatial_merge_size", 2)) if merger else 1,
                patch_merger=merger,
                rope_theta=float(_field(reader, "clip.rope.freq_base", 10000.0)), feature_layer=-1,
                projector_bias="mm.1.bias" in raw, projector_eps=float(f"{text_eps:.7g}"))
            tensors = _pixtral(take, config)
            patch = config.patch_size
            preprocessor = {"image_processor_type": "PixtralImageProcessor", "patch_size": patch,
                            "size": {"longest_edge": int(need("image_size"))}, "image_mean": mean, "image_std": std}
            processor = {"patch_size": patch, "spatial_merge_size": config.scale_factor, "image_token": "[IMG]",
                         "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}
        else:
            config = _qwen_config(reader, family, common, text_reader, text_arch, take, source, need)
            tensors = _qwen(take, config)
            lo, hi = _QWEN_PIXELS[family]
            preprocessor = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": config.patch_size,
                            "temporal_patch_size": config.temporal_patch_size, "merge_size": config.scale_factor,
                            "min_pixels": int(_field(reader, "clip.vision.image_min_pixels", lo)),
                            "max_pixels": int(_field(reader, "clip.vision.image_max_pixels", hi)),
                            "image_mean": mean, "image_std": std}
            processor = {}
    except (TypeError, ValueError) as exc:
        raise CoreError(f"{source}: bad mmproj value: {exc}", ErrorKind.SOURCE_FORMAT) from None
    return MmprojTower(config=config, tensors=files.finish(tensors, config, f"{kind} tower"),
                       preprocessor=preprocessor, processor=processor, second=second)


class _Contents:
    """An mmproj's metadata under ``prefix`` (``need``: a key that must be there) and tensors (``take``: one that
    must be there), with the check that every tensor was read (``finish``: a variant of the tower this reader
    would misread without them is refused) and the result's against its config."""

    def __init__(self, reader, source: str, dtype, prefix: str, used: set[str] | None = None):
        self.reader, self.source, self.prefix = reader, source, prefix
        self.raw = {t.name: gguf_tensor_values(t, dtype, source) for t in reader.tensors}
        self.used = set(used or ())

    def need(self, key: str):
        value = _field(self.reader, f"{self.prefix}.{key}")
        if value is None:
            raise CoreError(f"{self.source}: mmproj metadata has no {self.prefix}.{key}", ErrorKind.SOURCE_FORMAT)
        return value

    def take(self, name: str) -> torch.Tensor:
        try:
            value = self.raw[name]
        except KeyError:
            raise CoreError(f"{self.source}: mmproj has no tensor {name}", ErrorKind.SOURCE_FORMAT) from None
        self.used.add(name)
        return value

    def finish(self, tensors: dict[str, torch.Tensor], config: VisionConfig, what: str) -> dict[str, torch.Tensor]:
        from flared.model.vision import check_vision_tensors

        unread = sorted(set(self.raw) - self.used)
        if unread:
            raise CoreError(f"{self.source}: mmproj tensors this {what} does not have: {', '.join(unread[:6])}",
                            ErrorKind.UNSUPPORTED_MODEL)
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        check_vision_tensors(tensors, config, source=self.source)
        return tensors


# clip.audio.projector_type (or clip.projector_type) -> our audio family, and the token its clips stand in for
AUDIO_PROJECTORS = {"qwen2a": "qwen2_audio", "musicflamingo": "audioflamingo3", "qwen3a": "qwen3_asr"}
AUDIO_TOKENS = {"qwen2_audio": "<|AUDIO|>", "audioflamingo3": "<sound>", "qwen3_asr": "<|audio_pad|>"}
# Qwen3-ASR's encoder as the released config sets what its mmproj does not record (llama.cpp's qwen3a graph
# hardcodes the chunk too): one-second chunks of 100 frames, attention windows of 800 frames, 13 position rows
_QWEN3_ASR = dict(n_window=50, n_window_infer=800, max_position_embeddings=13)


def _read_audio(reader, source: str, *, text_reader, text_hidden_size: int, dtype) -> MmprojTower:
    """An audio encoder's mmproj (module docstring), as a VisionConfig of an audio family and its feature
    extractor's settings."""
    kind = _field(reader, "clip.audio.projector_type") or _field(reader, "clip.projector_type")
    family = AUDIO_PROJECTORS.get(kind)
    if family is None:
        raise CoreError(f"{source}: audio projector type {kind!r} is not supported (supported: "
                        f"{', '.join(AUDIO_PROJECTORS)})", ErrorKind.UNSUPPORTED_MODEL)

    files = _Contents(reader, source, dtype, "clip.audio")
    raw, need, take = files.raw, files.need, files.take

    projection = int(need("projection_dim"))
    if projection != text_hidden_size:
        raise CoreError(f"{source}: this audio encoder feeds a model of hidden size {projection}, but the model's is "
                        f"{text_hidden_size}: it belongs to another model", ErrorKind.SOURCE_FORMAT)
    token = AUDIO_TOKENS[family]
    tokens = list(_field(text_reader, "tokenizer.ggml.tokens") or [])
    if token not in tokens:
        raise CoreError(f"{source}: the model's vocabulary has no {token} token, which a {kind} encoder's clips "
                        "stand in for: this mmproj belongs to another model", ErrorKind.SOURCE_FORMAT)
    eps = float(f"{_field(reader, 'clip.audio.attention.layer_norm_epsilon', 1e-5):.7g}")
    if family == "qwen3_asr":
        return _read_qwen3_asr(files, source, text_hidden_size, tokens.index(token), eps)
    try:
        config = VisionConfig(
            family=family, hidden_size=int(need("embedding_length")),
            intermediate_size=int(take("a.blk.0.ffn_up.weight").shape[0]), num_layers=int(need("block_count")),
            num_heads=int(need("attention.head_count")), patch_size=1, image_size=0, layer_norm_eps=eps,
            hidden_act="gelu", scale_factor=2, text_hidden_size=text_hidden_size, image_token_id=tokens.index(token),
            projector_bias="mm.a.mlp.1.bias" in raw or family == "qwen2_audio",
            position_table=int(take("a.position_embd.weight").shape[0]), mel_bins=int(need("num_mel_bins")))
        tensors = _whisper(take, config)
    except (TypeError, ValueError) as exc:
        raise CoreError(f"{source}: bad mmproj value: {exc}", ErrorKind.SOURCE_FORMAT) from None
    tensors = files.finish(tensors, config, f"{kind} encoder")
    preprocessor = {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": config.mel_bins,
                    "sampling_rate": 16000, "hop_length": 160, "n_fft": 400, "chunk_length": 30}
    processor = {"audio_token": token, **({"max_audio_len": 600} if family == "audioflamingo3" else {})}
    return MmprojTower(config=config, tensors=tensors, preprocessor=preprocessor, processor=processor)


def _read_qwen3_asr(files, source: str, text_hidden_size: int, token_id: int, eps: float) -> MmprojTower:
    """Qwen3-ASR's (and Qwen3-Omni's) AuT encoder as the converter writes it (``qwen3a``): the three convolutions
    ``a.conv2d.{1,2,3}`` (their biases [C, 1, 1]), ``a.conv_out``, Whisper-style layers with q/k/v apart (k with its
    own bias), ``a.post_ln``, the projector ``mm.a.mlp.1``/``.2``; the sinusoid table the converter adds
    (``a.position_embd``, 1,500 rows) is the one the encoder computes, checked and not kept."""
    from flared.model.audio import _qwen3_asr_shape, sinusoid_positions

    need, take = files.need, files.take
    d = int(need("embedding_length"))
    try:
        shape = _qwen3_asr_shape({**_QWEN3_ASR, "downsample_hidden_size": int(take("a.conv2d.1.weight").shape[0])},
                                 text_hidden_size, source)
        config = VisionConfig(
            family="qwen3_asr", hidden_size=d, intermediate_size=int(take("a.blk.0.ffn_up.weight").shape[0]),
            num_layers=int(need("block_count")), num_heads=int(need("attention.head_count")), patch_size=1,
            image_size=0, layer_norm_eps=eps, hidden_act="gelu", text_hidden_size=text_hidden_size,
            image_token_id=token_id, mel_bins=int(need("num_mel_bins")), projector_bias=True, **shape)
    except (TypeError, ValueError) as exc:
        raise CoreError(f"{source}: bad mmproj value: {exc}", ErrorKind.SOURCE_FORMAT) from None
    table = take("a.position_embd.weight")
    if not torch.allclose(table[:config.position_table].float(), sinusoid_positions(config.position_table, d),
                          atol=1e-3):
        raise CoreError(f"{source}: its audio position table is not the sinusoid Qwen3-ASR's encoder computes",
                        ErrorKind.UNSUPPORTED_MODEL)
    out = {"conv_out.weight": take("a.conv_out.weight"), "post_norm.weight": take("a.post_ln.weight"),
           "post_norm.bias": take("a.post_ln.bias")}
    for n in range(3):
        out[f"conv{n}.weight"] = take(f"a.conv2d.{n + 1}.weight")
        out[f"conv{n}.bias"] = take(f"a.conv2d.{n + 1}.bias").reshape(-1)
    for ours, theirs in (("proj_fc1", "mm.a.mlp.1"), ("proj_fc2", "mm.a.mlp.2")):
        out[ours + ".weight"], out[ours + ".bias"] = _both(take, theirs)
    out.update(_idefics3_layers(take, config.num_layers, "a.blk."))
    tensors = files.finish(out, config, "qwen3a encoder")
    preprocessor = {"feature_extractor_type": "Qwen3ASRFeatureExtractor", "feature_size": config.mel_bins,
                    "n_window": config.chunk_frames // 2}
    return MmprojTower(config=config, tensors=tensors, preprocessor=preprocessor,
                       processor={"audio_token": AUDIO_TOKENS["qwen3_asr"]})


def _whisper(take, c: VisionConfig) -> dict[str, torch.Tensor]:
    """A Whisper-style encoder's tensors as the converter names them, in the serving layout (flared.model.audio):
    the convolutions' biases back to [D], q/k/v fused (k's bias zero), the projector by family."""
    out = {"conv1.weight": take("a.conv1d.1.weight"), "conv1.bias": take("a.conv1d.1.bias").reshape(-1),
           "conv2.weight": take("a.conv1d.2.weight"), "conv2.bias": take("a.conv1d.2.bias").reshape(-1),
           "pos_embed.weight": take("a.position_embd.weight"),
           "post_norm.weight": take("a.post_ln.weight"), "post_norm.bias": take("a.post_ln.bias")}
    for i in range(c.num_layers):
        p, s = f"a.blk.{i}.", f"layers.{i}."
        q_bias = take(p + "attn_q.bias")
        out[s + "qkv.weight"] = torch.cat([take(p + f"attn_{x}.weight") for x in "qkv"])
        out[s + "qkv.bias"] = torch.cat([q_bias, torch.zeros_like(q_bias), take(p + "attn_v.bias")])
        for ours, theirs in (("o", "attn_out"), ("norm1", "ln1"), ("norm2", "ln2"), ("fc1", "ffn_up"),
                             ("fc2", "ffn_down")):
            for kind in ("weight", "bias"):
                out[f"{s}{ours}.{kind}"] = take(f"{p}{theirs}.{kind}")
    if c.family == "qwen2_audio":
        out.update({"proj.weight": take("mm.a.fc.weight"), "proj.bias": take("mm.a.fc.bias")})
    else:
        for ours, theirs in (("proj_fc1", "mm.a.mlp.1"), ("proj_fc2", "mm.a.mlp.2")):
            out[ours + ".weight"] = take(theirs + ".weight")
            if c.projector_bias:
                out[ours + ".bias"] = take(theirs + ".bias")
    return out


def _qwen_config(reader, family: str, common: dict, text_reader, text_arch: str, take: Callable, source: str,
                 need: Callable) -> VisionConfig:
    sections = _field(text_reader, f"{text_arch}.rope.dimension_sections")
    if not sections or len(sections) < 3 or not all(int(x) > 0 for x in list(sections)[:3]):
        raise CoreError(f"{source}: a {family} tower needs its model's mRoPE split ({text_arch}.rope."
                        f"dimension_sections in the model GGUF, as a qwen2vl or qwen3vl GGUF holds it); the model "
                        f"GGUF has {list(sections) if sections else 'none'}", ErrorKind.SOURCE_FORMAT)
    extra: dict[str, Any] = {}
    if family == "qwen2_5_vl":
        pattern = int(need("n_wa_pattern"))
        if pattern <= 0:
            raise CoreError(f"{source}: clip.vision.n_wa_pattern must be positive, got {pattern}",
                            ErrorKind.SOURCE_FORMAT)
        extra = dict(window_size=int(_field(reader, "clip.vision.window_size", _QWEN25_WINDOW)),
                     full_attention_layers=tuple(i for i in range(common["num_layers"]) if (i + 1) % pattern == 0))
    elif family == "qwen3_vl":
        flags = _field(reader, "clip.vision.is_deepstack_layers") or []
        extra = dict(position_table=int(take("v.position_embd.weight").shape[0]),
                     deepstack_layers=tuple(i for i, on in enumerate(flags) if on), mrope_interleaved=True)
        declared = _field(text_reader, f"{text_arch}.n_deepstack_layers")
        if declared is not None and int(declared) != len(extra["deepstack_layers"]):
            raise CoreError(f"{source}: the tower has {len(extra['deepstack_layers'])} DeepStack layers, the model "
                            f"takes {declared}: this mmproj belongs to another model", ErrorKind.SOURCE_FORMAT)
    return VisionConfig(**common, image_size=0, hidden_act=_ACTS[family],
                        scale_factor=int(_field(reader, "clip.vision.spatial_merge_size", 2)), temporal_patch_size=2,
                        mrope_section=tuple(int(x) for x in list(sections)[:3]), **extra)


def _both(take, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    return take(name + ".weight"), take(name + ".bias")


def _idefics3(take, layers: int) -> dict[str, torch.Tensor]:
    out = {"patch_embed.weight": take("v.patch_embd.weight"), "patch_embed.bias": take("v.patch_embd.bias"),
           "pos_embed.weight": take("v.position_embd.weight"), "post_norm.weight": take("v.post_ln.weight"),
           "post_norm.bias": take("v.post_ln.bias"), "proj.weight": take("mm.model.fc.weight")}
    out.update(_idefics3_layers(take, layers))
    return out


def _idefics3_layers(take, layers: int, prefix: str = "v.blk.", post: str = "ln2") -> dict[str, torch.Tensor]:
    """SigLIP's layers (Idefics3's, Gemma 3's; and the like: Llama 4's, Qwen3-ASR's ``a.blk.``): q, k, v fused
    again (each with its own bias), the post-attention norm ``post``."""
    out = {}
    for n in range(layers):
        gp, sp = f"{prefix}{n}.", f"layers.{n}."
        for kind in ("weight", "bias"):
            out[f"{sp}qkv.{kind}"] = torch.cat([take(f"{gp}attn_{x}.{kind}") for x in "qkv"])
            for ours, theirs in (("o", "attn_out"), ("norm1", "ln1"), ("norm2", post), ("fc1", "ffn_up"),
                                 ("fc2", "ffn_down")):
                out[f"{sp}{ours}.{kind}"] = take(f"{gp}{theirs}.{kind}")
    return out


def _gemma3(take, layers: int) -> dict[str, torch.Tensor]:
    out = _idefics3_layers(take, layers)
    out.update({"patch_embed.weight": take("v.patch_embd.weight"), "patch_embed.bias": take("v.patch_embd.bias"),
                "pos_embed.weight": take("v.position_embd.weight"), "post_norm.weight": take("v.post_ln.weight"),
                "post_norm.bias": take("v.post_ln.bias"),
                # (the converter stores the Gemma RMSNorm's weight as 1 + w, and the projection as transformers
                # holds it, [D, hidden]: a linear's weight is its transpose)
                "proj_norm.weight": take("mm.soft_emb_norm.weight") - 1,
                "proj.weight": take("mm.input_projection.weight").T})
    return out


def _llama4(take, raw, c: VisionConfig) -> dict[str, torch.Tensor]:
    """Llama 4's tower as the converter writes it: the patches' linear ``v.patch_embd`` ([D, 3 p p], or as a
    convolution's [D, 3, p, p]), ``v.class_embd``, ``v.position_embd``, ``v.pre_ln``/``v.post_ln``, layers of
    q/k/v apart (no permutation: the tower's rope already turns interleaved pairs), the post-attention norm as
    ``ln2`` (or ``attn_post_norm``, where a newer gguf map names it so), the adapter ``mm.model.mlp.1``/``.2`` and
    the projector ``mm.model.fc``."""
    d = c.hidden_size
    out = {"patch_embed.weight": take("v.patch_embd.weight").reshape(d, -1),
           "class_embed": take("v.class_embd" if "v.class_embd" in raw else "v.class_embd.weight").reshape(d),
           "pos_embed.weight": take("v.position_embd.weight"), "adapter_fc1.weight": take("mm.model.mlp.1.weight"),
           "adapter_fc2.weight": take("mm.model.mlp.2.weight"), "proj.weight": take("mm.model.fc.weight")}
    for ours, theirs in (("pre_norm", "v.pre_ln"), ("post_norm", "v.post_ln")):
        out[ours + ".weight"], out[ours + ".bias"] = _both(take, theirs)
    post = "ln2" if "v.blk.0.ln2.weight" in raw else "attn_post_norm"
    return {**out, **_idefics3_layers(take, c.num_layers, post=post)}


def _gemma4(take, c: VisionConfig) -> dict[str, torch.Tensor]:
    patch = take("v.patch_embd.weight")  # [D, 3, p, p]: transformers' [D, p * p * 3] of (y, x, channel)
    out = {"patch_embed.weight": patch.permute(0, 2, 3, 1).reshape(patch.shape[0], -1),
           "pos_embed.weight": take("v.position_embd.weight"), "proj.weight": take("mm.input_projection.weight")}
    if c.standardize:
        out.update({"std_bias": take("v.std_bias"), "std_scale": take("v.std_scale")})
    products = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_out", "gate": "ffn_gate", "up": "ffn_up",
                "down": "ffn_down"}
    norms = {"norm1": "ln1", "post_attn_norm": "attn_post_norm", "norm2": "ln2", "post_mlp_norm": "ffn_post_norm",
             "q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}
    for i in range(c.num_layers):
        p, g = f"layers.{i}.", f"v.blk.{i}."
        clipped_products(take, out, p, g, products, weight=".weight", clipped=c.clipped_linears)
        for ours, theirs in norms.items():
            out[p + ours + ".weight"] = take(g + theirs + ".weight")
    return out


_GEMMA4A_PRODUCTS = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_out", "ff1_in": "ffn_up",
                     "ff1_out": "ffn_down", "ff2_in": "ffn_up_1", "ff2_out": "ffn_down_1", "conv_in": "conv_pw1",
                     "conv_out": "conv_pw2"}
_GEMMA4A_TENSORS = {"rel_k.weight": "attn_k_rel.weight", "scale": "per_dim_scale.weight",
                    "ff1_pre.weight": "ffn_norm.weight", "ff1_post.weight": "ffn_post_norm.weight",
                    "ff2_pre.weight": "ffn_norm_1.weight", "ff2_post.weight": "ffn_post_norm_1.weight",
                    "conv_pre.weight": "conv_norm.weight", "conv_norm.weight": "norm_conv.weight",
                    "attn_pre.weight": "attn_pre_norm.weight", "attn_post.weight": "attn_post_norm.weight",
                    "out_norm.weight": "ln2.weight"}


def _read_gemma4_audio(files, reader, source: str, text_reader, text_hidden_size: int, pad: int) -> MmprojTower:
    """Gemma 4's audio conformer in a gemma4v mmproj (``clip.audio.projector_type`` gemma4a): its ``a.*`` tensors
    as the converter names them (the subsampling ``a.conv1d.0``/``.1`` with their norms, ``a.input_projection``,
    the layers', ``a.pre_encode.out`` for the output projection, ``mm.a.input_projection``), the per-dim scale
    stored softplus'd (as flared keeps it), the depthwise convolution [D, k]; what the file does not say, the
    released config's (blocks of 12 rows seeing 12 back, logits capped at 50, half-step feed-forwards, its
    RMSNorms' 1e-6: the converter writes 1e-5 as the layer norm epsilon whatever the config says)."""
    kind = _field(reader, "clip.audio.projector_type")
    if kind != "gemma4a":
        raise CoreError(f"{source}: a gemma4v tower beside an audio encoder of type {kind!r} is not supported "
                        "(gemma4a)", ErrorKind.UNSUPPORTED_MODEL)
    take, raw = files.take, files.raw

    def need(key: str):
        value = _field(reader, f"clip.audio.{key}")
        if value is None:
            raise CoreError(f"{source}: mmproj metadata has no clip.audio.{key}", ErrorKind.SOURCE_FORMAT)
        return value

    tokens = list(_field(text_reader, "tokenizer.ggml.tokens") or [])
    if "<|audio|>" not in tokens:
        raise CoreError(f"{source}: the model's vocabulary has no <|audio|> token, which gemma4a clips stand in for",
                        ErrorKind.SOURCE_FORMAT)
    d, layers = int(need("embedding_length")), int(need("block_count"))
    dw = take("a.blk.0.conv_dw.weight")  # [D, kernel]
    out_proj = take("a.pre_encode.out.weight")
    config = VisionConfig(
        family="gemma4_audio", hidden_size=d, intermediate_size=4 * d, num_layers=layers,
        num_heads=int(need("attention.head_count")), patch_size=1, image_size=0, layer_norm_eps=1e-6, hidden_act="silu",
        scale_factor=4, text_hidden_size=text_hidden_size, image_token_id=tokens.index("<|audio|>"),
        mel_bins=int(need("num_mel_bins")),
        conv_channels=(int(take("a.conv1d.0.weight").shape[0]), int(take("a.conv1d.1.weight").shape[0])),
        conv_kernel=int(dw.shape[-1]), attention_chunk=12, context_left=13, context_right=0, logit_cap=50.0,
        residual_weight=0.5, clip_value=1e10, output_dims=int(out_proj.shape[0]),
        clipped_linears="a.blk.0.attn_q.input_max" in raw, projector_eps=1e-6, pad_token_id=pad)
    out = {"sub0.weight": take("a.conv1d.0.weight"), "sub0_norm.weight": take("a.conv1d.0.norm.weight"),
           "sub1.weight": take("a.conv1d.1.weight"), "sub1_norm.weight": take("a.conv1d.1.norm.weight"),
           "sub_proj.weight": take("a.input_projection.weight"), "out.weight": out_proj,
           "out.bias": take("a.pre_encode.out.bias"), "proj.weight": take("mm.a.input_projection.weight")}
    for i in range(layers):
        p, g = f"layers.{i}.", f"a.blk.{i}."
        clipped_products(take, out, p, g, _GEMMA4A_PRODUCTS, weight=".weight", clipped=config.clipped_linears)
        for ours, theirs in _GEMMA4A_TENSORS.items():
            out[p + ours] = take(g + theirs)
        out[p + "conv.weight"] = take(g + "conv_dw.weight").reshape(d, 1, -1)
    from flared.model.vision import check_vision_tensors

    out = {k: v.contiguous() for k, v in out.items()}
    check_vision_tensors(out, config, source=f"{source} (audio)")
    return MmprojTower(config=config, tensors=out,
                       preprocessor={"feature_extractor_type": "Gemma4AudioFeatureExtractor",
                                     "feature_size": config.mel_bins},
                       processor={"audio_seq_length": 750})


def _pixtral(take, c: VisionConfig) -> dict[str, torch.Tensor]:
    out = {"patch_embed.weight": take("v.patch_embd.weight"), "pre_norm.weight": take("v.pre_ln.weight"),
           "proj_fc1.weight": take("mm.1.weight"), "proj_fc2.weight": take("mm.2.weight")}
    if c.patch_merger:
        out.update({"proj_norm.weight": take("mm.input_norm.weight"), "merge.weight": take("mm.patch_merger.weight")})
    if c.projector_bias:
        out.update({"proj_fc1.bias": take("mm.1.bias"), "proj_fc2.bias": take("mm.2.bias")})
    for n in range(c.num_layers):
        gp, sp = f"v.blk.{n}.", f"layers.{n}."
        out.update({
            sp + "norm1.weight": take(gp + "ln1.weight"), sp + "norm2.weight": take(gp + "ln2.weight"),
            # (the converter permuted q and k for llama.cpp's interleaved 2D rope; ours rotates halves)
            sp + "qkv.weight": torch.cat([unpermute_qk(take(gp + "attn_q.weight"), c.num_heads),
                                          unpermute_qk(take(gp + "attn_k.weight"), c.num_heads),
                                          take(gp + "attn_v.weight")]),
            sp + "o.weight": take(gp + "attn_out.weight"),
            sp + "gate_up.weight": torch.cat([take(gp + "ffn_gate.weight"), take(gp + "ffn_up.weight")]),
            sp + "down.weight": take(gp + "ffn_down.weight")})
    return out


def _qwen(take, c: VisionConfig) -> dict[str, torch.Tensor]:
    # the Conv3D's two time slices, split by the converter, stacked back along time
    out = {"patch_embed.weight": torch.stack([take("v.patch_embd.weight"), take("v.patch_embd.weight.1")], dim=2)}
    rms = c.family == "qwen2_5_vl"
    out["merger_norm.weight"] = take("v.post_ln.weight")
    if not rms:
        out["merger_norm.bias"] = take("v.post_ln.bias")
    out["merger_fc1.weight"], out["merger_fc1.bias"] = _both(take, "mm.0")
    out["merger_fc2.weight"], out["merger_fc2.bias"] = _both(take, "mm.2")
    if c.family == "qwen3_vl":
        out.update({"patch_embed.bias": take("v.patch_embd.bias"), "pos_embed.weight": take("v.position_embd.weight")})
        for j, layer in enumerate(c.deepstack_layers):  # (stored under the tower layer each merger follows)
            for ours, theirs in (("norm", "norm"), ("fc1", "fc1"), ("fc2", "fc2")):
                out[f"deepstack.{j}.{ours}.weight"], out[f"deepstack.{j}.{ours}.bias"] = _both(
                    take, f"v.deepstack.{layer}.{theirs}")
    for n in range(c.num_layers):
        gp, sp = f"v.blk.{n}.", f"layers.{n}."
        for kind in ("weight", "bias"):
            fused = f"{gp}attn_qkv.{kind}"
            out[f"{sp}qkv.{kind}"] = take(fused) if c.family == "qwen3_vl" else torch.cat(
                [take(f"{gp}attn_{x}.{kind}") for x in "qkv"])
            out[f"{sp}o.{kind}"] = take(f"{gp}attn_out.{kind}")
            if rms:
                out[f"{sp}gate_up.{kind}"] = torch.cat([take(f"{gp}ffn_gate.{kind}"), take(f"{gp}ffn_up.{kind}")])
                out[f"{sp}down.{kind}"] = take(f"{gp}ffn_down.{kind}")
            else:
                out[f"{sp}fc1.{kind}"] = take(f"{gp}ffn_up.{kind}")
                out[f"{sp}fc2.{kind}"] = take(f"{gp}ffn_down.{kind}")
        out[sp + "norm1.weight"], out[sp + "norm2.weight"] = take(gp + "ln1.weight"), take(gp + "ln2.weight")
        if not rms:
            out[sp + "norm1.bias"], out[sp + "norm2.bias"] = take(gp + "ln1.bias"), take(gp + "ln2.bias")
    return out
