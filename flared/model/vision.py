"""The vision tower of an Idefics3-family model (SmolVLM, Idefics3): image tiles in, text embeddings out.

A vision-language checkpoint of this family is a Llama decoder (``flared.model.decoder`` runs it unchanged) plus a
SigLIP-style encoder and a connector. Every image tile (``flared.frontend.images.TileProcessor``) runs through:

    patch embedding (conv, stride = patch) + learned position embedding
    layers x [x + attn(LN1(x)); x + fc2(gelu_tanh(fc1(LN2(x))))]   bidirectional attention over the tile's patches
    post LayerNorm
    pixel shuffle (scale s: each s x s block of patches becomes one row, s*s times wider)
    projection (no bias) to the decoder's hidden size

giving ``image_seq_len = (image_size / patch_size)^2 / s^2`` rows per tile. Those rows replace the embeddings of
the prompt's image tokens, in order (``ForwardBatch.embed_rows``).

Serving layout of the tower's tensors (``vision_tensor_shapes``), stored in the core's ``vision.safetensors``:

    patch_embed.weight  [D, 3, p, p]     patch_embed.bias [D]
    pos_embed.weight    [(S/p)^2, D]
    layers.{i}.norm1.weight / .bias [D]
    layers.{i}.qkv.weight [3D, D]   layers.{i}.qkv.bias [3D]   q, k, v rows fused
    layers.{i}.o.weight [D, D]      layers.{i}.o.bias [D]
    layers.{i}.norm2.weight / .bias [D]
    layers.{i}.fc1.weight [I, D]    layers.{i}.fc1.bias [I]
    layers.{i}.fc2.weight [D, I]    layers.{i}.fc2.bias [D]
    post_norm.weight / .bias [D]
    proj.weight [hidden, D * s^2]

Rules:
- Tiles are always whole (the processor resizes every tile to image_size square), so every patch attends to every
  other and position ids are the patch's own index; a tile of another size is refused, never padded.
- Anything we cannot run exactly (another activation, a tile size the tower does not take) is a ``CoreError``
  at export or load, never approximated.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from flared.errors import CoreError, ErrorKind
from flared.frontend.images import (LLAVA_NEXT_PINPOINTS, ONEVISION_PINPOINTS, anyres_scaled, best_resolution,
                                    unpadded_size)

# model_type of the checkpoint's config.json -> our vision family
HF_VISION_MODEL_TYPES = {"idefics3": "idefics3", "smolvlm": "idefics3", "qwen2_vl": "qwen2_vl",
                         "qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl", "mistral3": "pixtral", "llava": "llava",
                         # Qwen3.5: Qwen3-VL's tower without DeepStack before a Gated DeltaNet hybrid decoder
                         "qwen3_5": "qwen3_vl", "qwen3_5_moe": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl",
                         "gemma3": "gemma3", "internvl": "internvl", "llava_next": "llava_next",
                         "gemma4": "gemma4",
                         "llama4": "llama4",  # (Llama 4 Scout, Maverick: flared.model.llama4_vision)
                         "llava_next_video": "llava_next",  # (LLaVA-NeXT-Video: video_pool)
                         "llava_onevision": "llava_onevision",
                         # (InternVL's original checkpoints, as loader._internvl_chat says them)
                         "internvl_chat": "internvl",
                         # Qwen2-Audio, Audio Flamingo 3: a Whisper encoder's rows in place of their audio tokens
                         # (flared.model.audio)
                         "qwen2_audio": "qwen2_audio", "audioflamingo3": "audioflamingo3", "glmasr": "glmasr",
                         # Qwen3-ASR: Qwen3-Omni's audio encoder (AuT) before a Qwen3 decoder
                         "qwen3_asr": "qwen3_asr",
                         # Gemma 4's audio tower beside its image tower (a core's second medium: flared.model.audio)
                         "gemma4_audio": "gemma4_audio"}
AUDIO_FAMILIES = ("qwen2_audio", "audioflamingo3", "glmasr", "qwen3_asr", "gemma4_audio")
# a family's decoder where its text_config does not name one (the rest: Llama)
_TEXT_MODEL_TYPES = {"pixtral": "mistral", "qwen2_audio": "qwen2", "audioflamingo3": "qwen2", "qwen3_asr": "qwen3",
                     "llama4": "llama4_text"}
# a Qwen VL checkpoint's model_type -> its decoder's (text_config_of)
_QWEN_TEXT_MODEL_TYPES = {"qwen3_vl": "qwen3", "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text",
                          "qwen3_vl_moe": "qwen3_moe"}
_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none", "quick_gelu": "quick", "silu": "silu"}
QWEN_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
GRID_FAMILIES = (*QWEN_FAMILIES, "pixtral")  # images of any size as a grid of patches


@dataclass(frozen=True)
class VisionConfig:
    # "idefics3" | "qwen2_vl" | "qwen2_5_vl" | "qwen3_vl" | "pixtral" (Mistral3) | "llava" (CLIP) | "gemma3"
    # | "internvl" (InternViT) | "llava_next" (CLIP over LLaVA-NeXT's any-resolution tiles)
    # | "llava_onevision" (SigLIP over LLaVA-OneVision's tiles) | "qwen2_audio", "audioflamingo3" (audio encoders:
    # flared.model.audio)
    family: str
    hidden_size: int  # D
    intermediate_size: int  # I
    num_layers: int
    num_heads: int
    patch_size: int  # p
    image_size: int  # S: a tile's side in pixels (idefics3; 0 for the Qwen families' any-size images)
    layer_norm_eps: float
    hidden_act: str  # "gelu_pytorch_tanh" | "gelu" | "quick_gelu" (qwen2_vl) | "silu" (qwen2_5_vl's SwiGLU)
    scale_factor: int  # pixel shuffle s (idefics3), the patch merge (Qwen: merge_size), the average pool (gemma3)
    text_hidden_size: int  # the decoder's hidden size
    image_token_id: int  # the prompt token whose embeddings the tower's rows replace
    # Qwen families: frames per patch, rope theta of the tower's 2D rope, the window of windowed layers (pixels,
    # qwen2_5_vl) and the layers that attend over the whole image, and the decoder's mRoPE split of head_dim / 2
    # into (temporal, height, width) frequency slots.
    temporal_patch_size: int = 0
    rope_theta: float = 10000.0
    window_size: int = 0
    full_attention_layers: tuple[int, ...] = ()
    mrope_section: tuple[int, ...] = ()
    # qwen3_vl: a learned square table of position rows, resampled (bilinear) to each image's grid; the layers
    # whose output also feeds the decoder (DeepStack: each through its own merger, added to the image tokens'
    # hidden state after decoder layer 0, 1, ...); and the decoder's interleaved mRoPE (t, h, w slots alternate)
    position_table: int = 0
    deepstack_layers: tuple[int, ...] = ()
    mrope_interleaved: bool = False
    # pixtral (Mistral3): the layer whose output feeds the projector (-1: the last), the projector's biases and
    # its RMSNorm's epsilon
    feature_layer: int = -1
    projector_bias: bool = False
    projector_eps: float = 1e-5
    # llava (a CLIP tower): "default" drops the class token's row, "full" keeps it
    feature_select: str = "default"
    # pixtral: Mistral3's projector (RMSNorm, the s x s patch merger, two linears); False: LLaVA's (Pixtral 12B: the
    # two linears alone, each patch a row)
    patch_merger: bool = True
    # internvl (InternViT): the layers' norms ("layer_norm" or "rms_norm"), RMSNorms over all of q and of k, biases
    # on q, k and v, and a LayerNorm after the last layer (InternVisionModel without mean pooling)
    norm_kind: str = "layer_norm"
    qk_norm: bool = False
    qkv_bias: bool = True
    post_norm: bool = False
    # llava_next, llava_onevision: the canvases (height, width) in pixels an image is tiled on
    # (image_grid_pinpoints); llava_onevision: the tiles' worth of features kept before they are scaled down
    # (vision_aspect_ratio "anyres_max_N": N)
    grid_pinpoints: tuple[tuple[int, int], ...] = ()
    anyres_max: int = 0
    # audio families: the log-mel bins a frame has (its positions: position_table, max_source_positions); glmasr:
    # the leading dims of each head its rope turns (partial_rotary_factor x head_dim)
    mel_bins: int = 0
    rotary_dim: int = 0
    # llava_next over SigLIP (Granite Vision) rather than CLIP; and the layers whose hidden states, side by side, feed
    # the projector where there are several (vision_feature_layer as a list; (): feature_layer alone)
    siglip_tower: bool = False
    feature_layers: tuple[int, ...] = ()
    # llava_next (LLaVA-NeXT-Video): a video frame's features average-pooled this many to a side before the
    # projector (spatial_pool_stride; 0: the model takes no video)
    video_pool: int = 0
    # the prompt token a video's rows replace (-1: none; the Qwen families', LLaVA-OneVision's and LLaVA-NeXT-Video's),
    # and Qwen2.5-VL's rope positions a second of video advances (vision_config.tokens_per_second; 0: a video's
    # temporal patches count 0, 1, 2...)
    video_token_id: int = -1
    tokens_per_second: float = 0.0
    # gemma4: the tower's products clamp their inputs and outputs (use_clipped_linears: each product's four bounds
    # beside it), its pooled rows are standardized (standardize: std_bias, std_scale), its image tokens attend to
    # each other both ways on the decoder's windowed layers (text_config.use_bidirectional_attention "vision":
    # 26B-A4B, 31B), and the token whose per-layer input rows an image token takes (E2B, E4B: the pad token)
    clipped_linears: bool = False
    standardize: bool = False
    windowed_image_blocks: bool = False
    pad_token_id: int = 0
    # gemma4_audio (a conformer, flared.model.audio.Gemma4AudioEncoder): the two stride-2 convolutions' channels, the
    # light convolution's kernel, attention over blocks of attention_chunk rows seeing context_left - 1 rows back
    # and context_right ahead, its scores soft-capped at logit_cap, the feed-forward halves' residual_weight, the
    # clamp on its branches (gradient_clipping), and the width of its output projection (output_proj_dims)
    conv_channels: tuple[int, ...] = ()
    conv_kernel: int = 0
    attention_chunk: int = 0
    context_left: int = 0
    context_right: int = 0
    logit_cap: float = 0.0
    residual_weight: float = 0.0
    clip_value: float = 0.0
    output_dims: int = 0
    # qwen3_asr (flared.model.audio.Qwen3AsrAudioEncoder): the frames of a chunk its convolutions run over alone
    # (conv_channels: their one width; 2 n_window), and the chunks an attention window spans (n_window_infer over
    # the chunk)
    chunk_frames: int = 0
    window_chunks: int = 0

    def __post_init__(self) -> None:
        for name in ("full_attention_layers", "mrope_section", "deepstack_layers", "feature_layers", "conv_channels"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        try:
            object.__setattr__(self, "grid_pinpoints", tuple((int(h), int(w)) for h, w in self.grid_pinpoints))
        except (TypeError, ValueError):
            raise CoreError(f"vision grid_pinpoints must be [height, width] pairs, got {self.grid_pinpoints!r}"
                            ) from None
        if self.family not in set(HF_VISION_MODEL_TYPES.values()):
            raise CoreError(f"vision family {self.family!r} is not supported", ErrorKind.UNSUPPORTED_MODEL)
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "patch_size",
                     "scale_factor", "text_hidden_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise CoreError(f"vision config {name} must be a positive integer, got {value!r}")
        if not isinstance(self.image_token_id, int) or self.image_token_id < 0:
            raise CoreError(f"vision config image_token_id must be a token id, got {self.image_token_id!r}")
        if self.hidden_act not in _ACTIVATIONS:
            raise CoreError(f"vision activation {self.hidden_act!r} is not supported "
                            f"(supported: {', '.join(_ACTIVATIONS)})", ErrorKind.UNSUPPORTED_MODEL)
        if self.hidden_size % self.num_heads:
            raise CoreError(f"vision hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if not (isinstance(self.layer_norm_eps, float) and math.isfinite(self.layer_norm_eps)
                and self.layer_norm_eps > 0):
            raise CoreError(f"vision layer_norm_eps must be a positive number, got {self.layer_norm_eps!r}")
        if self.family == "gemma4_audio":
            if (self.mel_bins <= 0 or len(self.conv_channels) != 2 or min(self.conv_channels) <= 0
                    or self.conv_kernel <= 0 or self.attention_chunk <= 0 or self.context_left <= 0
                    or self.context_right < 0 or self.output_dims <= 0):
                raise CoreError("a Gemma 4 audio tower needs its mel bins, two convolutions' channels, its kernel, "
                                "its attention blocks and context, and its output width")
            return
        if self.is_audio:
            if self.mel_bins <= 0 or self.position_table <= 0:
                raise CoreError("an audio encoder needs its mel bins and position rows (mel_bins, position_table)")
            if self.family == "qwen3_asr" and (len(self.conv_channels) != 1 or self.conv_channels[0] <= 0
                                               or self.chunk_frames <= 0 or self.window_chunks <= 0):
                raise CoreError("a Qwen3-ASR encoder needs its convolutions' width, its chunk's frames and its "
                                "attention window's chunks")
            return
        if self.family == "llava_onevision" and (self.feature_select != "full" or self.anyres_max <= 0):
            raise CoreError("a LLaVA-OneVision tower selects its features \"full\" (SigLIP has no class row) and "
                            "caps its tiles' features (vision_aspect_ratio anyres_max_N)", ErrorKind.UNSUPPORTED_MODEL)
        if self.family in ("llava_next", "llava_onevision"):
            if self.family == "llava_next" and self.feature_select != ("full" if self.siglip_tower else "default"):
                raise CoreError("a LLaVA-NeXT tower must select its features \"default\" over CLIP, \"full\" over "
                                "SigLIP (its tiles' grids have no class row)", ErrorKind.UNSUPPORTED_MODEL)
            if not self.grid_pinpoints or any(h <= 0 or w <= 0 or h % self.image_size or w % self.image_size
                                              for h, w in self.grid_pinpoints):
                raise CoreError(f"vision grid_pinpoints {list(self.grid_pinpoints)} must be canvases of whole "
                                f"{self.image_size}-pixel tiles")
        if self.family in ("pixtral", "llava", "llava_next", "llava_onevision"):
            if self.family == "pixtral" and not self.patch_merger and self.scale_factor != 1:
                raise CoreError(f"a Pixtral tower without a patch merger takes scale_factor 1, got {self.scale_factor}")
            if self.feature_select not in ("default", "full"):
                raise CoreError(f"vision feature_select {self.feature_select!r} must be default or full")
            if self.family != "pixtral" and (self.image_size <= 0 or self.image_size % self.patch_size):
                raise CoreError(f"vision image_size {self.image_size} must be a whole number of patches")
            for layer in (self.feature_layer, *self.feature_layers):
                if not -self.num_layers - 1 <= layer <= self.num_layers:
                    raise CoreError(f"vision feature_layer {layer} is not a layer of {self.num_layers}")
            if self.feature_layers and self.family != "llava_next":
                raise CoreError("several vision feature layers are read for LLaVA-NeXT only",
                                ErrorKind.UNSUPPORTED_MODEL)
            return
        if self.family == "gemma4":
            if (self.hidden_size // self.num_heads) % 4 or self.position_table <= 0:
                raise CoreError("a Gemma 4 tower needs a head size divisible by 4 (its 2D rope) and a position table "
                                "(position_embedding_size)")
            return
        if self.family == "internvl":
            if self.norm_kind not in ("layer_norm", "rms_norm"):
                raise CoreError(f"vision norm_kind {self.norm_kind!r} must be layer_norm or rms_norm")
            if self.feature_select != "default":
                raise CoreError("an InternVL tower's class row cannot be pixel-shuffled (vision_feature_select_strategy "
                                "must be \"default\")", ErrorKind.UNSUPPORTED_MODEL)
            if not -self.num_layers - 1 <= self.feature_layer <= self.num_layers:
                raise CoreError(f"vision feature_layer {self.feature_layer} is not a layer of {self.num_layers}")
        if self.family in QWEN_FAMILIES:
            if self.family == "qwen3_vl" and (self.position_table <= 0 or math.isqrt(self.position_table) ** 2
                                              != self.position_table):
                raise CoreError(f"position_table {self.position_table} must be a square number of rows")
            if any(not 0 <= i < self.num_layers for i in self.deepstack_layers):
                raise CoreError(f"deepstack_layers {self.deepstack_layers} must be tower layers")
            if self.temporal_patch_size <= 0 or (self.hidden_size // self.num_heads) % 4:
                raise CoreError("a Qwen vision tower needs a temporal_patch_size and a head size divisible by 4")
            if len(self.mrope_section) != 3 or any(not isinstance(x, int) or x <= 0 for x in self.mrope_section):
                raise CoreError(f"mrope_section must be three positive integers, got {self.mrope_section!r}")
            if self.family == "qwen2_5_vl" and (self.window_size <= 0
                                                or self.window_size % (self.patch_size * self.scale_factor)):
                raise CoreError(f"window_size {self.window_size} must be a positive multiple of patch_size x "
                                "spatial_merge_size")
            return
        side = self.image_size // self.patch_size
        if self.image_size <= 0 or self.image_size % self.patch_size or side % self.scale_factor:
            raise CoreError(f"vision image_size {self.image_size} must be a whole number of patches "
                            f"({self.patch_size}) in blocks of scale_factor {self.scale_factor}")

    @property
    def feature_depth(self) -> int:
        """Tower layers run before the features are taken (feature_layer indexes the hidden states: 0 the patches'
        own, k after k layers, -1 after all)."""
        return max(layer if layer >= 0 else self.num_layers + 1 + layer
                   for layer in (self.feature_layers or (self.feature_layer,)))

    @property
    def is_audio(self) -> bool:
        """An audio encoder (flared.model.audio), whose processor is flared.frontend.audio's."""
        return self.family in AUDIO_FAMILIES

    @property
    def rows_width(self) -> int:
        """Features per image token the tower gives: the embedding, then each DeepStack layer's."""
        return self.text_hidden_size * (1 + len(self.deepstack_layers))

    @property
    def grid_based(self) -> bool:
        """Images of any size as a patch grid (the Qwen families, Pixtral), not whole tiles."""
        return self.family in GRID_FAMILIES

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def bidirectional_images(self) -> bool:
        """An image's tokens attend to each other both ways in the decoder (Gemma 3's: its whole image is one
        prefill chunk's; Gemma 4's 26B-A4B and 31B: on the windowed layers, windowed_image_blocks)."""
        return self.family == "gemma3" or self.windowed_image_blocks

    @property
    def image_seq_len(self) -> int:
        """Text-embedding rows one tile (llava, gemma3: one image) becomes."""
        if self.family in ("llava", "llava_next"):  # (llava_next: one tile's, the base image's)
            return self.patches_per_side ** 2 + (self.feature_select == "full" and not self.siglip_tower)
        if self.family == "llava_onevision":  # (one tile's)
            return self.patches_per_side ** 2
        return self.patches_per_side ** 2 // self.scale_factor ** 2

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for name in ("full_attention_layers", "mrope_section", "deepstack_layers", "feature_layers", "conv_channels"):
            d[name] = list(getattr(self, name))
        return d

    @classmethod
    def from_dict(cls, d: dict) -> VisionConfig:
        if not isinstance(d, dict):
            raise CoreError(f"vision config must be an object, got {type(d).__name__}")
        fields = dataclasses.fields(cls)
        required = {f.name for f in fields if f.default is dataclasses.MISSING}
        unknown = sorted(set(d) - {f.name for f in fields})
        if unknown or not required <= set(d):
            raise CoreError(f"vision config keys {sorted(d)}: unknown {unknown}, missing {sorted(required - set(d))}")
        values = dict(d)
        for name in ("layer_norm_eps", "rope_theta", "projector_eps", "tokens_per_second", "logit_cap",
                     "residual_weight", "clip_value"):
            if isinstance(values.get(name), int) and not isinstance(values[name], bool):
                values[name] = float(values[name])
        return cls(**values)


def vision_from_hf(hf: dict[str, Any], *, source: str = "config.json") -> VisionConfig | None:
    """The vision tower a checkpoint's config.json describes; None for a text-only model."""
    family = HF_VISION_MODEL_TYPES.get(hf.get("model_type"))
    if family is None:
        return None
    if family in AUDIO_FAMILIES:
        from flared.model.audio import audio_from_hf

        try:
            return audio_from_hf(hf, family, source)
        except KeyError as exc:
            raise CoreError(f"{source}: missing key {exc.args[0]!r}", ErrorKind.SOURCE_FORMAT) from None
        except (TypeError, ValueError) as exc:
            raise CoreError(f"{source}: bad audio value: {exc}", ErrorKind.SOURCE_FORMAT) from None
    v, t = hf.get("vision_config"), hf.get("text_config", hf if family in QWEN_FAMILIES else None)
    llava_tower = (v.get("model_type", "clip_vision_model") if family in ("llava", "llava_next") and isinstance(v, dict)
                   else None)
    if family == "llava_next" and llava_tower not in ("clip_vision_model", "siglip_vision_model"):
        raise CoreError(f"{source}: a llava_next vision tower of type {llava_tower!r} is not supported (CLIP or "
                        "SigLIP)", ErrorKind.UNSUPPORTED_MODEL)
    if llava_tower not in (None, "clip_vision_model", "pixtral") and family != "llava_next":
        raise CoreError(f"{source}: a llava vision tower of type {llava_tower!r} is not supported (CLIP or "
                        "Pixtral)", ErrorKind.UNSUPPORTED_MODEL)
    if family == "pixtral" and isinstance(v, dict) and v.get("model_type", "pixtral") != "pixtral":
        raise CoreError(f"{source}: a mistral3 vision tower of type {v.get('model_type')!r} is not supported",
                        ErrorKind.UNSUPPORTED_MODEL)
    if not isinstance(v, dict) or not isinstance(t, dict):
        raise CoreError(f"{source}: a {hf.get('model_type')} config needs vision_config and text_config objects",
                        ErrorKind.SOURCE_FORMAT)
    if v.get("num_channels", v.get("in_channels", v.get("in_chans", 3))) != 3:
        raise CoreError(f"{source}: vision num_channels must be 3", ErrorKind.UNSUPPORTED_MODEL)
    try:
        if family in QWEN_FAMILIES:
            return _qwen_vision_from_hf(family, hf, v, t)
        if family == "pixtral":
            return _pixtral_vision_from_hf(hf, v, t)
        if llava_tower == "pixtral":  # Pixtral 12B: LLaVA's projector over a Pixtral tower
            return _pixtral_vision_from_hf(hf, v, t, patch_merger=False)
        if family == "gemma3":
            return _gemma3_vision_from_hf(hf, v, t)
        if family == "gemma4":
            return _gemma4_vision_from_hf(hf, v, t)
        if family == "llama4":
            from flared.model.llama4_vision import llama4_vision_from_hf

            return llama4_vision_from_hf(hf, v, t)
        if family in ("llava", "llava_next"):
            return _llava_vision_from_hf(hf, v, t, family=family)
        if family == "internvl":
            return _internvl_vision_from_hf(hf, v, t)
        if family == "llava_onevision":
            return _onevision_vision_from_hf(hf, v, t)
        return VisionConfig(
            family=family,
            hidden_size=int(v.get("hidden_size", 1152)),
            intermediate_size=int(v.get("intermediate_size", 3072)),
            num_layers=int(v.get("num_hidden_layers", 12)),
            num_heads=int(v.get("num_attention_heads", 16)),
            patch_size=int(v.get("patch_size", 32)),
            image_size=int(v.get("image_size", 224)),
            layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)),
            hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")),
            scale_factor=int(hf.get("scale_factor", 2)),
            text_hidden_size=int(t["hidden_size"]),
            image_token_id=int(hf.get("image_token_id", 128257)),
        )
    except KeyError as exc:
        raise CoreError(f"{source}: missing key {exc.args[0]!r}", ErrorKind.SOURCE_FORMAT) from None
    except (TypeError, ValueError) as exc:
        raise CoreError(f"{source}: bad vision value: {exc}", ErrorKind.SOURCE_FORMAT) from None


def text_config_of(hf: dict[str, Any]) -> dict[str, Any]:
    """A vision checkpoint's decoder config, as a text model's config.json would say it: Idefics3's Llama
    text_config; the Qwen VL families' Qwen2 (text_config, or the top level of older configs) with the mRoPE
    split taken out (a text token's three positions are equal, which is plain rope)."""
    family = HF_VISION_MODEL_TYPES[hf["model_type"]]
    if hf["model_type"] == "internvl_chat":  # (loader._internvl_chat: its llm_config as text_config)
        text = dict(hf["text_config"])
        text.setdefault("tie_word_embeddings", bool(hf.get("tie_word_embeddings", False)))
        return text
    if family in ("gemma3", "gemma4"):  # (Gemma ties its embeddings unless the config says otherwise)
        text = {**hf["text_config"], "model_type": f"{family}_text"}
        text.setdefault("tie_word_embeddings", bool(hf.get("tie_word_embeddings", True)))
    elif family not in QWEN_FAMILIES:
        text = dict(hf["text_config"])
        text.setdefault("model_type", _TEXT_MODEL_TYPES.get(family, "llama"))
    else:
        text = dict(hf["text_config"]) if isinstance(hf.get("text_config"), dict) else {
            k: v for k, v in hf.items() if k != "vision_config"}
        text["model_type"] = _QWEN_TEXT_MODEL_TYPES.get(hf["model_type"], "qwen2")
        if hf["model_type"] == "qwen3_vl_moe":  # (its router renormalises the chosen experts' weights, always)
            text["norm_topk_prob"] = True
        for key in ("rope_parameters", "rope_scaling"):
            params = text.get(key)
            if isinstance(params, dict) and "mrope_section" in params:
                params = {k: v for k, v in params.items() if k not in ("mrope_section", "mrope_interleaved")}
                if params.get("type") == "mrope" or params.get("rope_type") == "mrope":
                    params.pop("type", None)
                    params["rope_type"] = "default"
                text[key] = params
    text.setdefault("tie_word_embeddings", bool(hf.get("tie_word_embeddings", False)))
    return text


def mrope_section_of(text: dict[str, Any]) -> list[int] | None:
    """The mRoPE split a Qwen VL text config declares (transformers 5's rope_parameters, or rope_scaling)."""
    for key in ("rope_parameters", "rope_scaling"):
        params = text.get(key)
        if isinstance(params, dict) and params.get("mrope_section") is not None:
            return [int(x) for x in params["mrope_section"]]
    return None


def _feature_layer(hf: dict, default: int) -> int:
    """The tower layer a LLaVA-style model (LLaVA, Mistral3) takes its features from; its projector's activation
    must be gelu."""
    layer = hf.get("vision_feature_layer", default)
    if not isinstance(layer, int):
        raise CoreError("vision_feature_layer: only one feature layer is supported", ErrorKind.UNSUPPORTED_MODEL)
    if hf.get("projector_hidden_act", "gelu") != "gelu":
        raise CoreError(f"projector_hidden_act {hf.get('projector_hidden_act')!r} is not supported (only gelu)",
                        ErrorKind.UNSUPPORTED_MODEL)
    return layer


def _gemma3_vision_from_hf(hf: dict, v: dict, t: dict) -> VisionConfig:
    """Gemma 3's SigLIP tower (transformers' defaults: 896-pixel images in 14-pixel patches, 27 layers) and its
    projector: the patches averaged in k x k blocks to ``mm_tokens_per_image`` rows (256), each through a Gemma
    RMSNorm (the tower's epsilon) and a projection."""
    if v.get("model_type", "siglip_vision_model") != "siglip_vision_model":
        raise CoreError(f"a gemma3 vision tower of type {v.get('model_type')!r} is not supported (SigLIP only)",
                        ErrorKind.UNSUPPORTED_MODEL)
    image, patch = int(v.get("image_size", 896)), int(v.get("patch_size", 14))
    tokens = int(hf.get("mm_tokens_per_image", 256))
    per_side = math.isqrt(tokens)
    if per_side ** 2 != tokens or image % patch or (image // patch) % per_side:
        raise CoreError(f"mm_tokens_per_image {tokens} must be a square whose side divides the {image // patch} "
                        "patches a side", ErrorKind.UNSUPPORTED_MODEL)
    eps = float(v.get("layer_norm_eps", 1e-6))
    return VisionConfig(
        family="gemma3", hidden_size=int(v.get("hidden_size", 1152)), intermediate_size=int(v.get("intermediate_size",
                                                                                                  4304)),
        num_layers=int(v.get("num_hidden_layers", 27)), num_heads=int(v.get("num_attention_heads", 16)),
        patch_size=patch, image_size=image, layer_norm_eps=eps, hidden_act=str(v.get("hidden_act",
                                                                                      "gelu_pytorch_tanh")),
        scale_factor=image // patch // per_side, text_hidden_size=int(t["hidden_size"]),
        image_token_id=int(hf.get("image_token_index", hf.get("image_token_id", 262144))), projector_eps=eps)


def _gemma4_vision_from_hf(hf: dict, v: dict, t: dict) -> VisionConfig:
    """Gemma 4's tower (transformers' defaults: 16-pixel patches, 16 layers, a 2D axial rope of theta 100, 3 x 3
    pooling) and its projection (a weightless RMSNorm at the tower's epsilon, then a linear), for images of any
    size; the image and video tokens the config names; whether images attend both ways on the windowed layers."""
    if v.get("model_type", "gemma4_vision") != "gemma4_vision":
        raise CoreError(f"a gemma4 vision tower of type {v.get('model_type')!r} is not supported",
                        ErrorKind.UNSUPPORTED_MODEL)
    d, heads = int(v.get("hidden_size", 768)), int(v.get("num_attention_heads", 12))
    head_dim, kv_heads = int(v.get("head_dim") or d // heads), int(v.get("num_key_value_heads") or heads)
    if head_dim * heads != d or kv_heads != heads:
        raise CoreError(f"a Gemma 4 tower of head_dim {head_dim} x {heads} heads ({kv_heads} key-value heads) over "
                        f"hidden_size {d} is not supported (hidden_size / heads, every head its own keys)",
                        ErrorKind.UNSUPPORTED_MODEL)
    rope = v.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") not in ("axial", "default"):
        raise CoreError(f"a Gemma 4 tower's rope_type {rope.get('rope_type')!r} is not supported (axial)",
                        ErrorKind.UNSUPPORTED_MODEL)
    if v.get("attention_bias"):
        raise CoreError("a Gemma 4 tower with attention biases is not supported", ErrorKind.UNSUPPORTED_MODEL)
    both_ways = t.get("use_bidirectional_attention")
    if both_ways not in (None, "vision"):
        raise CoreError(f"use_bidirectional_attention {both_ways!r} is not supported (only \"vision\")",
                        ErrorKind.UNSUPPORTED_MODEL)
    eps = float(v.get("rms_norm_eps", 1e-6))
    return VisionConfig(
        family="gemma4", hidden_size=d, intermediate_size=int(v.get("intermediate_size", 3072)),
        num_layers=int(v.get("num_hidden_layers", 16)), num_heads=heads, patch_size=int(v.get("patch_size", 16)),
        image_size=0, layer_norm_eps=eps, hidden_act=str(v.get("hidden_activation", v.get("hidden_act",
                                                                                         "gelu_pytorch_tanh"))),
        scale_factor=int(v.get("pooling_kernel_size", 3)), text_hidden_size=int(t["hidden_size"]),
        image_token_id=int(hf.get("image_token_id", 258880)), video_token_id=int(hf.get("video_token_id", -1) or -1),
        rope_theta=float(rope.get("rope_theta", 100.0)), position_table=int(v.get("position_embedding_size", 10240)),
        projector_eps=eps, clipped_linears=bool(v.get("use_clipped_linears")), standardize=bool(v.get("standardize")),
        windowed_image_blocks=both_ways == "vision", pad_token_id=int(t.get("pad_token_id") or 0))


def _llava_vision_from_hf(hf: dict, v: dict, t: dict, family: str = "llava") -> VisionConfig:
    extra = {}
    layers = hf.get("vision_feature_layer", -2)
    if family == "llava_next" and isinstance(layers, list) and len(layers) > 1:  # (Granite Vision's four)
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in layers):
            raise CoreError(f"vision_feature_layer {layers!r} must be layer indices", ErrorKind.SOURCE_FORMAT)
        extra["feature_layers"] = tuple(layers)
        hf = {**hf, "vision_feature_layer": layers[-1]}
    elif isinstance(layers, list) and len(layers) == 1:
        hf = {**hf, "vision_feature_layer": layers[0]}
    layer = _feature_layer(hf, -2)
    if family == "llava_next":
        extra["grid_pinpoints"] = tuple(tuple(p) for p in hf.get("image_grid_pinpoints", LLAVA_NEXT_PINPOINTS))
        if hf.get("model_type") == "llava_next_video":
            if hf.get("spatial_pool_mode", "average") != "average":
                raise CoreError(f"spatial_pool_mode {hf.get('spatial_pool_mode')!r} is not supported (average)",
                                ErrorKind.UNSUPPORTED_MODEL)
            extra.update(video_pool=int(hf.get("spatial_pool_stride", 2)),
                         video_token_id=int(hf.get("video_token_index", 32000)))
        if v.get("model_type") == "siglip_vision_model":  # (Granite Vision: SigLIP's defaults)
            extra["siglip_tower"] = True
            v = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
                 "image_size": 384, "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh", **v}
    return VisionConfig(
        family=family, **extra, hidden_size=int(v.get("hidden_size", 1024)),
        intermediate_size=int(v.get("intermediate_size", 4096)),
        num_layers=int(v.get("num_hidden_layers", 24)), num_heads=int(v.get("num_attention_heads", 16)),
        patch_size=int(v.get("patch_size", 14)), image_size=int(v.get("image_size", 336)),
        layer_norm_eps=float(v.get("layer_norm_eps", 1e-5)), hidden_act=str(v.get("hidden_act", "quick_gelu")),
        scale_factor=1, text_hidden_size=int(t["hidden_size"]),
        image_token_id=int(hf.get("image_token_index", hf.get("image_token_id", 32000))), feature_layer=layer,
        projector_bias=bool(hf.get("multimodal_projector_bias", True)),
        feature_select=str(hf.get("vision_feature_select_strategy", "default")))


def _onevision_vision_from_hf(hf: dict, v: dict, t: dict) -> VisionConfig:
    """LLaVA-OneVision's SigLIP tower (transformers' defaults: 384-pixel tiles in 14-pixel patches, 26 layers), its
    features from vision_feature_layer (-1: the last layer's, before the post-LayerNorm), LLaVA's projector, and
    the any-resolution canvases."""
    if v.get("model_type", "siglip_vision_model") != "siglip_vision_model":
        raise CoreError(f"a llava_onevision vision tower of type {v.get('model_type')!r} is not supported (SigLIP "
                        "only)", ErrorKind.UNSUPPORTED_MODEL)
    aspect = str(hf.get("vision_aspect_ratio", "anyres_max_9"))
    if not aspect.startswith("anyres_max_") or not aspect.removeprefix("anyres_max_").isdigit():
        raise CoreError(f"vision_aspect_ratio {aspect!r} is not supported (anyres_max_N)", ErrorKind.UNSUPPORTED_MODEL)
    pinpoints = hf.get("image_grid_pinpoints") or ONEVISION_PINPOINTS
    return VisionConfig(
        family="llava_onevision", hidden_size=int(v.get("hidden_size", 1152)),
        intermediate_size=int(v.get("intermediate_size", 4304)), num_layers=int(v.get("num_hidden_layers", 26)),
        num_heads=int(v.get("num_attention_heads", 16)), patch_size=int(v.get("patch_size", 14)),
        image_size=int(v.get("image_size", 384)), layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)),
        hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")), scale_factor=1,
        text_hidden_size=int(t["hidden_size"]), image_token_id=int(hf.get("image_token_index", 151646)),
        video_token_id=int(hf.get("video_token_index", 151647)),
        feature_layer=_feature_layer(hf, -1), feature_select=str(hf.get("vision_feature_select_strategy", "full")),
        projector_bias=bool(hf.get("multimodal_projector_bias", True)),
        grid_pinpoints=tuple(tuple(p) for p in pinpoints), anyres_max=int(aspect.removeprefix("anyres_max_")))


def _square_side(value, name: str) -> int:
    """An InternViT size (an int, or [height, width] as transformers writes it), which must be square."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise CoreError(f"vision {name} {list(value)} must be square", ErrorKind.UNSUPPORTED_MODEL)
        value = value[0]
    return int(value)


def _internvl_vision_from_hf(hf: dict, v: dict, t: dict) -> VisionConfig:
    """InternVL's InternViT tower (transformers' defaults: 448-pixel tiles in 14-pixel patches, 24 layers) and its
    projector: the patches pixel-shuffled in s x s blocks (s = 1 / downsample_ratio), a LayerNorm and two linears
    with GELU."""
    if v.get("model_type", "internvl_vision") != "internvl_vision":
        raise CoreError(f"an internvl vision tower of type {v.get('model_type')!r} is not supported",
                        ErrorKind.UNSUPPORTED_MODEL)
    ratio = float(hf.get("downsample_ratio", 0.5))
    scale = round(1 / ratio) if ratio > 0 else 0
    if scale <= 0 or abs(scale * ratio - 1) > 1e-9:
        raise CoreError(f"downsample_ratio {ratio} must be 1 / a whole number", ErrorKind.UNSUPPORTED_MODEL)
    if not v.get("use_absolute_position_embeddings", True) or v.get("use_mask_token", False):
        raise CoreError("an InternViT tower without absolute position embeddings, or with a mask token, is not "
                        "supported", ErrorKind.UNSUPPORTED_MODEL)
    return VisionConfig(
        family="internvl", hidden_size=int(v.get("hidden_size", 1024)),
        intermediate_size=int(v.get("intermediate_size", 4096)), num_layers=int(v.get("num_hidden_layers", 24)),
        num_heads=int(v.get("num_attention_heads", 16)), patch_size=_square_side(v.get("patch_size", 14), "patch_size"),
        image_size=_square_side(v.get("image_size", 448), "image_size"),
        layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)), hidden_act=str(v.get("hidden_act", "gelu")),
        scale_factor=scale, text_hidden_size=int(t["hidden_size"]),
        image_token_id=int(hf.get("image_token_id", 151667)),
        feature_layer=_feature_layer(hf, -1), feature_select=str(hf.get("vision_feature_select_strategy", "default")),
        norm_kind=str(v.get("norm_type", "layer_norm")), qk_norm=bool(v.get("use_qk_norm", False)),
        qkv_bias=bool(v.get("attention_bias", False)), post_norm=not v.get("use_mean_pooling", True))


def _pixtral_vision_from_hf(hf: dict, v: dict, t: dict, *, patch_merger: bool = True) -> VisionConfig:
    """Mistral3's Pixtral tower and projector; ``patch_merger`` False: a llava config's (Pixtral 12B), whose
    projector is LLaVA's two linears with biases over every patch ("full": no class row to drop)."""
    layer = _feature_layer(hf, -1)
    if not patch_merger and hf.get("vision_feature_select_strategy", "default") != "full":
        raise CoreError("a llava config with a Pixtral tower must select its features \"full\" (it has no class "
                        f"token), got {hf.get('vision_feature_select_strategy', 'default')!r}",
                        ErrorKind.UNSUPPORTED_MODEL)
    hidden, heads = int(v.get("hidden_size", 1024)), int(v.get("num_attention_heads", 16))
    if int(v.get("head_dim") or hidden // heads) != hidden // heads:
        raise CoreError("a pixtral head_dim other than hidden_size / heads is not supported",
                        ErrorKind.UNSUPPORTED_MODEL)
    rope = v.get("rope_parameters") if isinstance(v.get("rope_parameters"), dict) else {}
    return VisionConfig(
        family="pixtral", hidden_size=hidden, intermediate_size=int(v.get("intermediate_size", 4096)),
        num_layers=int(v.get("num_hidden_layers", 24)), num_heads=heads, patch_size=int(v.get("patch_size", 16)),
        image_size=0, layer_norm_eps=1e-5, hidden_act=str(v.get("hidden_act", "gelu")),
        scale_factor=int(hf.get("spatial_merge_size", 2)) if patch_merger else 1,
        text_hidden_size=int(t["hidden_size"]), image_token_id=int(hf.get("image_token_index", 10)),
        rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))), feature_layer=layer,
        projector_bias=bool(hf.get("multimodal_projector_bias", not patch_merger)),
        projector_eps=float(t.get("rms_norm_eps", 1e-5)), patch_merger=patch_merger)


def _qwen_vision_from_hf(family: str, hf: dict, v: dict, t: dict) -> VisionConfig:
    rope = v.get("rope_parameters") if isinstance(v.get("rope_parameters"), dict) else {}
    extra = {}
    if family == "qwen2_vl":
        embed = int(v.get("embed_dim", 1280))
        hidden, intermediate = embed, int(embed * float(v.get("mlp_ratio", 4)))
        out, act = int(v.get("hidden_size", t["hidden_size"])), str(v.get("hidden_act", "quick_gelu"))
    elif family == "qwen3_vl":
        hidden, intermediate = int(v.get("hidden_size", 1152)), int(v.get("intermediate_size", 4304))
        out, act = int(v.get("out_hidden_size", t["hidden_size"])), str(v.get("hidden_act", "gelu_pytorch_tanh"))
        params = t.get("rope_parameters") or t.get("rope_scaling") or {}
        extra = dict(position_table=int(v.get("num_position_embeddings", 2304)),
                     deepstack_layers=tuple(int(x) for x in v.get(  # (Qwen3.5's tower has none)
                         "deepstack_visual_indexes", (8, 16, 24) if hf.get("model_type") == "qwen3_vl" else ())),
                     mrope_interleaved=bool(params.get("mrope_interleaved", True)))
    else:
        hidden, intermediate = int(v.get("hidden_size", 1280)), int(v.get("intermediate_size", 3420))
        out, act = int(v.get("out_hidden_size", t["hidden_size"])), str(v.get("hidden_act", "silu"))
    # (transformers' defaults: Qwen3.5 splits its 64 rotated dimensions' 32 slots)
    section = mrope_section_of(t) or ([11, 11, 10] if hf.get("model_type") in ("qwen3_5", "qwen3_5_moe") else
                                      [24, 20, 20] if family == "qwen3_vl" else [16, 24, 24])
    return VisionConfig(
        family=family, hidden_size=hidden, intermediate_size=intermediate,
        num_layers=int(v.get("depth", 32)), num_heads=int(v.get("num_heads", 16)),
        patch_size=int(v.get("patch_size", 14)), image_size=0, layer_norm_eps=1e-6, hidden_act=act,
        scale_factor=int(v.get("spatial_merge_size", 2)), text_hidden_size=out,
        image_token_id=int(hf.get("image_token_id", 151655)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        window_size=int(v.get("window_size", 0)) if family == "qwen2_5_vl" else 0,
        full_attention_layers=tuple(int(x) for x in v.get("fullatt_block_indexes", ()))
        if family == "qwen2_5_vl" else (),
        mrope_section=tuple(section), video_token_id=int(hf.get("video_token_id", 151656)),
        tokens_per_second=float(v.get("tokens_per_second", 4)) if family == "qwen2_5_vl" else 0.0, **extra,
    )


def vision_tensor_shapes(c: VisionConfig) -> dict[str, tuple[int, ...]]:
    d = c.hidden_size
    if c.is_audio:
        from flared.model.audio import audio_tensor_shapes

        return audio_tensor_shapes(c)
    if c.family == "pixtral":
        return _pixtral_tensor_shapes(c)
    if c.family == "llama4":
        from flared.model.llama4_vision import llama4_tensor_shapes

        return llama4_tensor_shapes(c)
    if c.family == "gemma3":  # SigLIP's layers; projector: a Gemma RMSNorm [D] (1 + w) and proj [hidden, D]
        return {"patch_embed.weight": (d, 3, c.patch_size, c.patch_size), "patch_embed.bias": (d,),
                "pos_embed.weight": (c.patches_per_side ** 2, d), "post_norm.weight": (d,), "post_norm.bias": (d,),
                "proj_norm.weight": (d,), "proj.weight": (c.text_hidden_size, d), **_vit_layer_shapes(c)}
    if c.family == "llava":
        return _llava_tensor_shapes(c)
    if c.family == "gemma4":
        return _gemma4_tensor_shapes(c)
    if c.family == "llava_next" and not c.siglip_tower:  # (LLaVA's, and the row-end embedding the tiles' rows take)
        return {**_llava_tensor_shapes(c), "image_newline": (c.text_hidden_size,)}
    if c.family in ("llava_onevision", "llava_next"):  # SigLIP's embeddings and layers (no post-norm read), LLaVA's
        # projector (over the feature layers side by side: Granite Vision's)
        h = c.text_hidden_size
        shapes = {"patch_embed.weight": (d, 3, c.patch_size, c.patch_size), "patch_embed.bias": (d,),
                  "pos_embed.weight": (c.patches_per_side ** 2, d),
                  "proj_fc1.weight": (h, d * max(1, len(c.feature_layers))),
                  "proj_fc2.weight": (h, h), "image_newline": (h,), **_vit_layer_shapes(c)}
        if c.projector_bias:
            shapes.update({"proj_fc1.bias": (h,), "proj_fc2.bias": (h,)})
        return shapes
    if c.family == "internvl":
        return _internvl_tensor_shapes(c)
    if c.grid_based:
        return _qwen_tensor_shapes(c)
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.weight": (d, 3, c.patch_size, c.patch_size),
        "patch_embed.bias": (d,),
        "pos_embed.weight": (c.patches_per_side ** 2, d),
        "post_norm.weight": (d,),
        "post_norm.bias": (d,),
        "proj.weight": (c.text_hidden_size, d * c.scale_factor ** 2),
    }
    return {**shapes, **_vit_layer_shapes(c)}


def _vit_layer_shapes(c: VisionConfig) -> dict[str, tuple[int, ...]]:
    """The SigLIP / CLIP layers of Idefics3's and LLaVA's towers: LayerNorms, fused biased qkv, o, fc1, fc2."""
    d, i = c.hidden_size, c.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {}
    for n in range(c.num_layers):
        p = f"layers.{n}."
        shapes.update({p + "norm1.weight": (d,), p + "norm1.bias": (d,), p + "qkv.weight": (3 * d, d),
                       p + "qkv.bias": (3 * d,), p + "o.weight": (d, d), p + "o.bias": (d,),
                       p + "norm2.weight": (d,), p + "norm2.bias": (d,), p + "fc1.weight": (i, d),
                       p + "fc1.bias": (i,), p + "fc2.weight": (d, i), p + "fc2.bias": (d,)})
    return shapes


_GEMMA4_PRODUCTS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                    "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
_GEMMA4_NORMS = {"norm1": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
                 "norm2": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm",
                 "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}


def clipped_products(take, out: dict, ours: str, theirs: str, names: dict[str, str], *, weight: str,
                     clipped: bool) -> None:
    """One Gemma 4 layer's products into ``out``: each of ``names`` (ours: theirs) as ``{ours}{name}.weight`` from
    ``{theirs}{their name}{weight}`` and, where ``clipped``, its four clamp bounds (input min, max, output min,
    max: ``{theirs}{their name}.input_min`` ...) as ``{ours}{name}.clip``."""
    for mine, name in names.items():
        out[f"{ours}{mine}.weight"] = take(f"{theirs}{name}{weight}")
        if clipped:
            out[f"{ours}{mine}.clip"] = torch.stack([take(f"{theirs}{name}.{bound}").float().reshape(())
                                                     for bound in ("input_min", "input_max", "output_min",
                                                                   "output_max")])


def clipped_product_shapes(shapes: dict, prefix: str, sizes: dict[str, tuple[int, int]], *, clipped: bool) -> None:
    """One Gemma 4 layer's products' shapes into ``shapes`` (``clipped_products``' tensors): each weight, and where
    ``clipped`` its four bounds."""
    for name, shape in sizes.items():
        shapes[prefix + name + ".weight"] = shape
        if clipped:
            shapes[prefix + name + ".clip"] = (4,)


def _gemma4_tensor_shapes(c: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Gemma 4's tower: the patches' projection (no bias), the (column, row) position tables, Gemma layers of four
    norms, q/k norms and a gated MLP (with use_clipped_linears each product's [input min, max, output min, max]),
    the standardization, and the projection into the decoder."""
    d, i, hd = c.hidden_size, c.intermediate_size, c.hidden_size // c.num_heads
    shapes = {"patch_embed.weight": (d, 3 * c.patch_size ** 2), "pos_embed.weight": (2, c.position_table, d),
              "proj.weight": (c.text_hidden_size, d)}
    if c.standardize:
        shapes.update({"std_bias": (d,), "std_scale": (d,)})
    sizes = {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d), "gate": (i, d), "up": (i, d), "down": (d, i)}
    for n in range(c.num_layers):
        p = f"layers.{n}."
        clipped_product_shapes(shapes, p, sizes, clipped=c.clipped_linears)
        for name in _GEMMA4_NORMS:
            shapes[p + name + ".weight"] = (hd,) if name in ("q_norm", "k_norm") else (d,)
    return shapes


def _llava_tensor_shapes(c: VisionConfig) -> dict[str, tuple[int, ...]]:
    """LLaVA's CLIP tower: patch_embed.weight (no bias), class_embed [D], pos_embed [1 + P, D], pre_norm (weight and
    bias), layers as Idefics3's (LayerNorms, fused biased qkv, o, fc1, fc2); projector proj_fc1 [hidden, D],
    proj_fc2 [hidden, hidden] (biases where projector_bias)."""
    d, h = c.hidden_size, c.text_hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.weight": (d, 3, c.patch_size, c.patch_size), "class_embed": (d,),
        "pos_embed.weight": (c.patches_per_side ** 2 + 1, d), "pre_norm.weight": (d,), "pre_norm.bias": (d,),
        "proj_fc1.weight": (h, d), "proj_fc2.weight": (h, h)}
    if c.projector_bias:
        shapes.update({"proj_fc1.bias": (h,), "proj_fc2.bias": (h,)})
    return {**shapes, **_vit_layer_shapes(c)}


def _internvl_tensor_shapes(c: VisionConfig) -> dict[str, tuple[int, ...]]:
    """InternViT: patch_embed (biased conv), class_embed [D], pos_embed [1 + P, D]; per layer norm1/norm2 (bias
    for LayerNorms), qkv [3D, D] (bias where qkv_bias), q_norm/k_norm [D] (qk_norm), o (biased), fc1/fc2 (biased),
    ls1/ls2 [D] (the layer scales); post_norm (post_norm); projector: proj_norm [D s^2] (weight and bias),
    proj_fc1 [hidden, D s^2], proj_fc2 [hidden, hidden], biased."""
    d, i, h, wide = c.hidden_size, c.intermediate_size, c.text_hidden_size, c.hidden_size * c.scale_factor ** 2
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.weight": (d, 3, c.patch_size, c.patch_size), "patch_embed.bias": (d,), "class_embed": (d,),
        "pos_embed.weight": (c.patches_per_side ** 2 + 1, d), "proj_norm.weight": (wide,), "proj_norm.bias": (wide,),
        "proj_fc1.weight": (h, wide), "proj_fc1.bias": (h,), "proj_fc2.weight": (h, h), "proj_fc2.bias": (h,)}
    if c.post_norm:
        shapes.update({"post_norm.weight": (d,), "post_norm.bias": (d,)})
    for n in range(c.num_layers):
        p = f"layers.{n}."
        shapes.update({p + "norm1.weight": (d,), p + "norm2.weight": (d,), p + "qkv.weight": (3 * d, d),
                       p + "o.weight": (d, d), p + "o.bias": (d,), p + "fc1.weight": (i, d), p + "fc1.bias": (i,),
                       p + "fc2.weight": (d, i), p + "fc2.bias": (d,), p + "ls1": (d,), p + "ls2": (d,)})
        if c.norm_kind == "layer_norm":
            shapes.update({p + "norm1.bias": (d,), p + "norm2.bias": (d,)})
        if c.qkv_bias:
            shapes[p + "qkv.bias"] = (3 * d,)
        if c.qk_norm:
            shapes.update({p + "q_norm.weight": (d,), p + "k_norm.weight": (d,)})
    return shapes


def _pixtral_tensor_shapes(c: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Pixtral (Mistral3): patch_embed.weight [D, 3, p, p] (no bias), pre_norm; per layer norm1, qkv (fused, no
    bias), o, norm2, gate_up [2I, D], down (RMSNorms, no biases); projector: proj_norm [D], merge
    [D, D * s^2] (patch_merger only), proj_fc1 [hidden, D], proj_fc2 [hidden, hidden] (biases where
    projector_bias)."""
    d, i, h = c.hidden_size, c.intermediate_size, c.text_hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.weight": (d, 3, c.patch_size, c.patch_size), "pre_norm.weight": (d,),
        "proj_fc1.weight": (h, d), "proj_fc2.weight": (h, h)}
    if c.patch_merger:
        shapes.update({"proj_norm.weight": (d,), "merge.weight": (d, d * c.scale_factor ** 2)})
    if c.projector_bias:
        shapes.update({"proj_fc1.bias": (h,), "proj_fc2.bias": (h,)})
    for n in range(c.num_layers):
        p = f"layers.{n}."
        shapes.update({p + "norm1.weight": (d,), p + "qkv.weight": (3 * d, d), p + "o.weight": (d, d),
                       p + "norm2.weight": (d,), p + "gate_up.weight": (2 * i, d), p + "down.weight": (d, i)})
    return shapes


def _qwen_tensor_shapes(c: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Qwen towers: patch_embed.weight [D, 3, T, p, p] (no bias); per layer norm1/norm2 (LayerNorm weight and
    bias; RMSNorm weight only on qwen2_5_vl), qkv, o, and fc1/fc2 (qwen2_vl) or gate_up [2I, D] + down (qwen2_5_vl,
    with biases); merger: merger_norm, merger_fc1 [4D, 4D], merger_fc2 [hidden, 4D], with biases."""
    d, i, m2 = c.hidden_size, c.intermediate_size, c.scale_factor ** 2
    rms = c.family == "qwen2_5_vl"
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.weight": (d, 3, c.temporal_patch_size, c.patch_size, c.patch_size),
        "merger_norm.weight": (d,), "merger_fc1.weight": (d * m2, d * m2), "merger_fc1.bias": (d * m2,),
        "merger_fc2.weight": (c.text_hidden_size, d * m2), "merger_fc2.bias": (c.text_hidden_size,),
    }
    if not rms:
        shapes["merger_norm.bias"] = (d,)
    if c.family == "qwen3_vl":  # a biased patch conv, the position table, and a merger per DeepStack layer
        shapes.update({"patch_embed.bias": (d,), "pos_embed.weight": (c.position_table, d)})
        for j in range(len(c.deepstack_layers)):
            p = f"deepstack.{j}."
            shapes.update({p + "norm.weight": (d * m2,), p + "norm.bias": (d * m2,),
                           p + "fc1.weight": (d * m2, d * m2), p + "fc1.bias": (d * m2,),
                           p + "fc2.weight": (c.text_hidden_size, d * m2), p + "fc2.bias": (c.text_hidden_size,)})
    for n in range(c.num_layers):
        p = f"layers.{n}."
        shapes.update({p + "norm1.weight": (d,), p + "norm2.weight": (d,), p + "qkv.weight": (3 * d, d),
                       p + "qkv.bias": (3 * d,), p + "o.weight": (d, d), p + "o.bias": (d,)})
        if rms:
            shapes.update({p + "gate_up.weight": (2 * i, d), p + "gate_up.bias": (2 * i,),
                           p + "down.weight": (d, i), p + "down.bias": (d,)})
        else:
            shapes.update({p + "norm1.bias": (d,), p + "norm2.bias": (d,), p + "fc1.weight": (i, d),
                           p + "fc1.bias": (i,), p + "fc2.weight": (d, i), p + "fc2.bias": (d,)})
    return shapes


def check_vision_tensors(tensors: dict[str, torch.Tensor], c: VisionConfig, *, source: str) -> None:
    expected = vision_tensor_shapes(c)
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        what = f"missing {', '.join(missing[:6])}" if missing else f"unexpected {', '.join(extra[:6])}"
        raise CoreError(f"{source}: vision tensors: {what}", ErrorKind.CORE_FORMAT)
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise CoreError(f"{source}: vision tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape}",
                            ErrorKind.CORE_FORMAT)


def hf_vision_to_serving(hf: dict[str, torch.Tensor], c: VisionConfig, *, source: str) -> dict[str, torch.Tensor]:
    """The tower's tensors out of a checkpoint's (``model.vision_model.*``, ``model.connector.*``)."""
    def take(name: str) -> torch.Tensor:
        try:
            return hf[name]
        except KeyError:
            raise CoreError(f"{source}: checkpoint has no tensor {name}", ErrorKind.SOURCE_FORMAT) from None

    from flared.model.audio import audio_to_serving
    from flared.model.llama4_vision import llama4_vision_to_serving

    to_serving = {"llama4": llama4_vision_to_serving,"qwen2_audio": audio_to_serving, "audioflamingo3": audio_to_serving, "glmasr": audio_to_serving,
                  "qwen3_asr": audio_to_serving, "gemma4_audio": audio_to_serving,
                  "pixtral": _pixtral_vision_to_serving,
                  "llava": _llava_vision_to_serving,
                  "llava_next": _llava_next_vision_to_serving, "llava_onevision": _onevision_vision_to_serving,
                  "gemma3": _gemma3_vision_to_serving, "internvl": _internvl_vision_to_serving,
                  "gemma4": _gemma4_vision_to_serving}.get(
        c.family, _qwen_vision_to_serving if c.grid_based else _idefics3_vision_to_serving)
    out = {k: v.contiguous() for k, v in to_serving(hf, c, take).items()}
    check_vision_tensors(out, c, source=source)
    return out


def _siglip_to_serving(take, vm: str, num_layers: int) -> dict[str, torch.Tensor]:
    """A SigLIP tower's tensors (transformers' names under ``vm``: Idefics3's, Gemma 3's) in the serving layout."""
    out = {
        "patch_embed.weight": take(vm + "embeddings.patch_embedding.weight"),
        "patch_embed.bias": take(vm + "embeddings.patch_embedding.bias"),
        "pos_embed.weight": take(vm + "embeddings.position_embedding.weight"),
        "post_norm.weight": take(vm + "post_layernorm.weight"),
        "post_norm.bias": take(vm + "post_layernorm.bias"),
    }
    out.update(_vit_layers_to_serving(take, vm + "encoder.layers.", num_layers))
    return out


def _idefics3_vision_to_serving(hf, c: VisionConfig, take) -> dict[str, torch.Tensor]:
    out = _siglip_to_serving(take, "model.vision_model.", c.num_layers)
    out["proj.weight"] = take("model.connector.modality_projection.proj.weight")
    return out


def _gemma3_vision_to_serving(hf, c: VisionConfig, take) -> dict[str, torch.Tensor]:
    # (released checkpoints: vision_tower.vision_model.*; transformers saves its SigLIP tower's own names too)
    vm = next((p for p in ("vision_tower.vision_model.", "model.vision_tower.vision_model.", "vision_tower.",
                           "model.vision_tower.") if p + "embeddings.patch_embedding.weight" in hf),
              "vision_tower.vision_model.")
    mp = ("model." if vm.startswith("model.") else "") + "multi_modal_projector."
    out = _siglip_to_serving(take, vm, c.num_layers)
    out["proj_norm.weight"] = take(mp + "mm_soft_emb_norm.weight")
    # (a parameter the projector multiplies by from the right, [D, hidden]: as a linear's weight, transposed)
    out["proj.weight"] = take(mp + "mm_input_projection_weight").T
    return out


def _gemma4_vision_to_serving(hf, c: VisionConfig, take) -> dict[str, torch.Tensor]:
    vm = "model.vision_tower." if "model.vision_tower.patch_embedder.input_proj.weight" in hf else "vision_tower."
    ev = ("model." if vm.startswith("model.") else "") + "embed_vision."
    out = {"patch_embed.weight": take(vm + "patch_embedder.input_proj.weight"),
           "pos_embed.weight": take(vm + "patch_embedder.position_embedding_table"),
           "proj.weight": take(ev + "embedding_projection.weight")}
    if c.standardize:
        out.update({"std_bias": take(vm + "std_bias"), "std_scale": take(vm + "std_scale")})
    for n in range(c.num_layers):
        p, q = f"layers.{n}.", f"{vm}encoder.layers.{n}."
        clipped_products(take, out, p, q, _GEMMA4_PRODUCTS, weight=".linear.weight", clipped=c.clipped_linears)
        for name, hf_name in _GEMMA4_NORMS.items():
            out[p + name + ".weight"] = take(q + hf_name + ".weight")
    return out


def _qwen_vision_to_serving(hf, c: VisionConfig, take) -> dict[str, torch.Tensor]:
    vm = "visual." if "visual.patch_embed.proj.weight" in hf else "model.visual."
    out = {"patch_embed.weight": take(vm + "patch_embed.proj.weight")}
    rms = c.family == "qwen2_5_vl"
    if c.family == "qwen3_vl":
        out.update({"patch_embed.bias": take(vm + "patch_embed.proj.bias"),
                    "pos_embed.weight": take(vm + "pos_embed.weight")})
        mergers = [("merger_", vm + "merger.")] + [(f"deepstack.{j}.", f"{vm}deepstack_merger_list.{j}.")
                                                    for j in range(len(c.deepstack_layers))]
        for ours, theirs in mergers:
            for kind in ("weight", "bias"):
                out[f"{ours}norm.{kind}"] = take(f"{theirs}norm.{kind}")
                out[f"{ours}fc1.{kind}"] = take(f"{theirs}linear_fc1.{kind}")
                out[f"{ours}fc2.{kind}"] = take(f"{theirs}linear_fc2.{kind}")
    else:
        out.update({"merger_norm.weight": take(vm + "merger.ln_q.weight"),
                    "merger_fc1.weight": take(vm + "merger.mlp.0.weight"),
                    "merger_fc1.bias": take(vm + "merger.mlp.0.bias"),
                    "merger_fc2.weight": take(vm + "merger.mlp.2.weight"),
                    "merger_fc2.bias": take(vm + "merger.mlp.2.bias")})
        if not rms:
            out["merger_norm.bias"] = take(vm + "merger.ln_q.bias")
    for n in range(c.num_layers):
        hp, sp = f"{vm}blocks.{n}.", f"layers.{n}."
        out.update({sp + "qkv.weight": take(hp + "attn.qkv.weight"), sp + "qkv.bias": take(hp + "attn.qkv.bias"),
                    sp + "o.weight": take(hp + "attn.proj.weight"), sp + "o.bias": take(hp + "attn.proj.bias"),
                    sp + "norm1.weight": take(hp + "norm1.weight"), sp + "norm2.weight": take(hp + "norm2.weight")})
        if rms:
            for kind in ("weight", "bias"):
                out[f"{sp}gate_up.{kind}"] = torch.cat([take(f"{hp}mlp.gate_proj.{kind}"),
                                                        take(f"{hp}mlp.up_proj.{kind}")])
                out[f"{sp}down.{kind}"] = take(f"{hp}mlp.down_proj.{kind}")
        else:
            mlp = "mlp.linear_" if c.family == "qwen3_vl" else "mlp."
            for ours in ("norm1.bias", "norm2.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
                out[sp + ours] = take(hp + ours if ours.startswith("norm") else hp + mlp + ours)
    return out


def _vit_layers_to_serving(take, prefix: str, num_layers: int) -> dict[str, torch.Tensor]:
    """SigLIP / CLIP encoder layers (transformers' names under ``prefix``) in the serving layout."""
    out = {}
    for n in range(num_layers):
        hp, sp = f"{prefix}{n}.", f"layers.{n}."
        attn = hp + "self_attn."
        for kind in ("weight", "bias"):
            out[f"{sp}qkv.{kind}"] = torch.cat([take(f"{attn}{x}_proj.{kind}") for x in "qkv"])
            for ours, theirs in (("o", "self_attn.out_proj"), ("norm1", "layer_norm1"), ("norm2", "layer_norm2"),
                                 ("fc1", "mlp.fc1"), ("fc2", "mlp.fc2")):
                out[f"{sp}{ours}.{kind}"] = take(f"{hp}{theirs}.{kind}")
    return out


def _llava_parts(hf, c: VisionConfig, take) -> tuple[str, dict[str, torch.Tensor]]:
    """A LLaVA-style checkpoint's tower prefix and its tower's layers and projector (two linears, biased where
    projector_bias) in the serving layout. The released checkpoints, saved by transformers 4, hold the CLIP or
    SigLIP tower's vision_tower.vision_model.*; transformers 5 saves vision_tower.* or model.vision_tower.*."""
    vt = next((p for p in ("vision_tower.vision_model.", "model.vision_tower.vision_model.", "model.vision_tower.")
               if p + "embeddings.patch_embedding.weight" in hf), "vision_tower.")
    mp = ("model." if vt.startswith("model.") else "") + "multi_modal_projector."
    out = {"patch_embed.weight": take(vt + "embeddings.patch_embedding.weight"),
           "pos_embed.weight": take(vt + "embeddings.position_embedding.weight"),
           "proj_fc1.weight": take(mp + "linear_1.weight"), "proj_fc2.weight": take(mp + "linear_2.weight")}
    if c.projector_bias:
        out.update({"proj_fc1.bias": take(mp + "linear_1.bias"), "proj_fc2.bias": take(mp + "linear_2.bias")})
    out.update(_vit_layers_to_serving(take, vt + "encoder.layers.", c.num_layers))
    return vt, out


def _llava_vision_to_serving(hf, c: VisionConfig, take) -> dict[str, torch.Tensor]:
    vt, out = _llava_parts(hf, c, take)
    out.update({"class_embed": take(vt + "embeddings.class_embedding"),
                "pre_norm.weight": take(vt + "pre_layrnorm.weight"), "pre_norm.bias": take(vt + "pre_layrnorm.bias")})
    return out


def _image_newline(hf, take) -> torch.Tensor:
    return take("model.image_newline" if "model.image_newline" in hf else "image_newline")


def _llava_next_vision_to_serving(hf, c: VisionConfig, take) -> dict[str, torch.Tensor]:
    if c.siglip_tower:  # (Granite Vision: OneVision's parts)
        return _onevision_vision_to_serving(hf, c, take)
    return {**_llava_vision_to_serving(hf, c, take), "image_newline": _image_newline(hf, take)}


def _onevision_vision_to_serving(hf, c: VisionConfig, take) -> dict[str, torch.Tensor]:
    vt, out = _llava_parts(hf, c, take)  # (SigLIP: a biased patch conv, no class token or pre-norm)
    return {**out, "patch_embed.bias": take(vt + "embeddings.patch_embedding.bias"),
            "image_newline": _image_newline(hf, take)}


@dataclass(frozen=True)
class InternViTNames:
    """Where an InternViT tower's tensors sit in one layout: whole names for the embeddings and the class and
    position rows; the three projector modules (LayerNorm, first and second linear) and the post-norm as modules
    whose ``.weight`` / ``.bias`` are read; ``layer`` the prefix of layer {n}; under it q/k/v as one module
    (``qkv``) or three (``q`` formatted with x in "qkv"), the q/k norms (``q_norm`` formatted with x in "qk"), o,
    the MLP's two linears, the norms, and the layer scales (whole names under the layer)."""

    patch: str
    cls: str
    pos: str
    projector: tuple[str, str, str]
    post_norm: str
    layer: str
    qkv: str | None
    q: str
    q_norm: str
    o: str
    fc1: str
    fc2: str
    norm1: str
    norm2: str
    ls1: str
    ls2: str


# transformers' -hf checkpoints (prefix added), the original releases, llama.cpp's mmproj (flared.model.mmproj)
INTERNVIT_HF = InternViTNames(
    patch="{p}vision_tower.embeddings.patch_embeddings.projection", cls="{p}vision_tower.embeddings.cls_token",
    pos="{p}vision_tower.embeddings.position_embeddings",
    projector=("{p}multi_modal_projector.layer_norm", "{p}multi_modal_projector.linear_1",
               "{p}multi_modal_projector.linear_2"),
    post_norm="{p}vision_tower.layernorm", layer="{p}vision_tower.encoder.layer.{n}.", qkv=None,
    q="attention.{x}_proj", q_norm="attention.{x}_norm", o="attention.projection_layer", fc1="mlp.fc1",
    fc2="mlp.fc2", norm1="layernorm_before", norm2="layernorm_after", ls1="lambda_1", ls2="lambda_2")
INTERNVIT_ORIGINAL = InternViTNames(
    patch="vision_model.embeddings.patch_embedding", cls="vision_model.embeddings.class_embedding",
    pos="vision_model.embeddings.position_embedding", projector=("mlp1.0", "mlp1.1", "mlp1.3"),
    post_norm="vision_model.post_layernorm", layer="vision_model.encoder.layers.{n}.", qkv="attn.qkv", q="",
    q_norm="attn.{x}_norm", o="attn.proj", fc1="mlp.fc1", fc2="mlp.fc2", norm1="norm1", norm2="norm2", ls1="ls1",
    ls2="ls2")
INTERNVIT_GGUF = InternViTNames(
    patch="v.patch_embd", cls="v.class_embd", pos="v.position_embd.weight",
    projector=("mm.model.mlp.0", "mm.model.mlp.1", "mm.model.mlp.3"), post_norm="v.post_ln", layer="v.blk.{n}.",
    qkv=None, q="attn_{x}", q_norm="attn_{x}_norm", o="attn_out", fc1="ffn_up", fc2="ffn_down", norm1="ln1",
    norm2="ln2", ls1="ls1.weight", ls2="ls2.weight")


def internvit_to_serving(take, c: VisionConfig, names: InternViTNames) -> dict[str, torch.Tensor]:
    """An InternViT tower and InternVL's projector (``names``' layout) in the serving layout: q, k and v fused, the
    class and position rows as [D] and [1 + P, D]."""
    d = c.hidden_size
    out = {"patch_embed.weight": take(names.patch + ".weight"), "patch_embed.bias": take(names.patch + ".bias"),
           "class_embed": take(names.cls).reshape(d), "pos_embed.weight": take(names.pos).reshape(-1, d)}
    modules = [(ours, theirs) for ours, theirs in zip(("proj_norm", "proj_fc1", "proj_fc2"), names.projector)]
    if c.post_norm:
        modules.append(("post_norm", names.post_norm))
    for n in range(c.num_layers):
        hp, sp = names.layer.format(n=n), f"layers.{n}."
        kinds = ("weight", "bias") if c.qkv_bias else ("weight",)
        for kind in kinds:
            out[f"{sp}qkv.{kind}"] = (take(f"{hp}{names.qkv}.{kind}") if names.qkv else
                                      torch.cat([take(f"{hp}{names.q.format(x=x)}.{kind}") for x in "qkv"]))
        if c.qk_norm:
            for x in "qk":
                out[f"{sp}{x}_norm.weight"] = take(f"{hp}{names.q_norm.format(x=x)}.weight")
        modules += [(sp + "o", hp + names.o), (sp + "fc1", hp + names.fc1), (sp + "fc2", hp + names.fc2)]
        if c.norm_kind == "layer_norm":
            modules += [(sp + "norm1", hp + names.norm1), (sp + "norm2", hp + names.norm2)]
        else:
            out.update({sp + "norm1.weight": take(f"{hp}{names.norm1}.weight"),
                        sp + "norm2.weight": take(f"{hp}{names.norm2}.weight")})
        out.update({sp + "ls1": take(hp + names.ls1), sp + "ls2": take(hp + names.ls2)})
    for ours, theirs in modules:
        out[ours + ".weight"], out[ours + ".bias"] = take(theirs + ".weight"), take(theirs + ".bias")
    return out


def _internvl_vision_to_serving(hf, c: VisionConfig, take) -> dict[str, torch.Tensor]:
    if INTERNVIT_ORIGINAL.cls in hf:
        return internvit_to_serving(take, c, INTERNVIT_ORIGINAL)
    prefix = "model." if "model.vision_tower.embeddings.cls_token" in hf else ""
    names = InternViTNames(**{k: (tuple(x.replace("{p}", prefix) for x in v) if isinstance(v, tuple) else
                                  v.replace("{p}", prefix) if isinstance(v, str) else v)
                              for k, v in dataclasses.asdict(INTERNVIT_HF).items()})
    return internvit_to_serving(take, c, names)


def _pixtral_vision_to_serving(hf, c: VisionConfig, take) -> dict[str, torch.Tensor]:
    prefix = "model." if "model.vision_tower.patch_conv.weight" in hf else ""
    vt, mp = prefix + "vision_tower.", prefix + "multi_modal_projector."
    out = {"patch_embed.weight": take(vt + "patch_conv.weight"), "pre_norm.weight": take(vt + "ln_pre.weight"),
           "proj_fc1.weight": take(mp + "linear_1.weight"), "proj_fc2.weight": take(mp + "linear_2.weight")}
    if c.patch_merger:
        out.update({"proj_norm.weight": take(mp + "norm.weight"),
                    "merge.weight": take(mp + "patch_merger.merging_layer.weight")})
    if c.projector_bias:
        out.update({"proj_fc1.bias": take(mp + "linear_1.bias"), "proj_fc2.bias": take(mp + "linear_2.bias")})
    for n in range(c.num_layers):
        hp, sp = f"{vt}transformer.layers.{n}.", f"layers.{n}."
        out.update({
            sp + "norm1.weight": take(hp + "attention_norm.weight"), sp + "norm2.weight": take(hp + "ffn_norm.weight"),
            sp + "qkv.weight": torch.cat([take(f"{hp}attention.{x}_proj.weight") for x in "qkv"]),
            sp + "o.weight": take(hp + "attention.o_proj.weight"),
            sp + "gate_up.weight": torch.cat([take(hp + "feed_forward.gate_proj.weight"),
                                              take(hp + "feed_forward.up_proj.weight")]),
            sp + "down.weight": take(hp + "feed_forward.down_proj.weight")})
    return out


def vision_encoder(config: VisionConfig, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu"):
    """The tower of ``config``'s family (``encode(pixel_values, grid=...)`` -> rows)."""
    from flared.model.audio import Gemma4AudioEncoder, Qwen3AsrAudioEncoder, WhisperAudioEncoder
    from flared.model.llama4_vision import Llama4VisionEncoder

    cls = {"llama4": Llama4VisionEncoder,"qwen2_audio": WhisperAudioEncoder, "audioflamingo3": WhisperAudioEncoder, "glmasr": WhisperAudioEncoder,
           "qwen3_asr": Qwen3AsrAudioEncoder, "gemma4_audio": Gemma4AudioEncoder,
           "pixtral": PixtralVisionEncoder, "llava": LlavaVisionEncoder,
           "gemma3": Gemma3VisionEncoder, "gemma4": Gemma4VisionEncoder,
           "internvl": InternVLVisionEncoder,
           "llava_next": LlavaNextSiglipVisionEncoder if config.siglip_tower else LlavaNextVisionEncoder,
           "llava_onevision": OnevisionVisionEncoder}.get(
        config.family, QwenVisionEncoder if config.grid_based else VisionEncoder)
    return cls(config, tensors, dtype=dtype, device=device)


def attach_tower(model, config: VisionConfig, tower, audio=None) -> None:
    """Give a DecoderModel its image tower and what the family's images need of the decoder: Qwen VL's 3D rope
    sections; images that attend to each other both ways (Gemma 3; Gemma 4's 26B-A4B and 31B on their windowed
    layers, each video frame a block too); Gemma 4 E2B's and E4B's pad-token per-layer rows for image tokens.
    ``audio``: a second tower for audio clips (Gemma 4's), which VisionJob runs a clip through."""
    model.vision = tower
    model.audio = audio
    if config.mrope_section:
        model.set_mrope(config.mrope_section, interleaved=config.mrope_interleaved)
    if config.bidirectional_images:
        model.set_image_blocks([config.image_token_id] + ([config.video_token_id] if config.video_token_id >= 0
                                                          else []), windowed_only=config.windowed_image_blocks)
    if config.family == "gemma4":  # (read only by a model with per-layer inputs)
        model.set_image_identity(config.pad_token_id)


class _Tower:
    """A tower's weights on one device, checked against its config (the three towers' common part)."""

    def __init__(self, config: VisionConfig, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        check_vision_tensors(tensors, config, source="vision tensors")
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.w = {k: v.to(device=self.device, dtype=dtype).contiguous() for k, v in tensors.items()}

    def encode(self, pixel_values: torch.Tensor, *, grid=None) -> torch.Tensor:
        """The image's rows (``stages`` run through at once)."""
        stages = self.stages(pixel_values, grid=grid)
        while True:
            try:
                next(stages)
            except StopIteration as done:
                return done.value

    def stages(self, pixel_values: torch.Tensor, *, grid=None):
        """A generator over the tower's layers: it yields after each and returns the rows, so the model thread
        can run a large image a few layers a turn between other requests' steps."""
        raise NotImplementedError

    def _tile_batches(self, pixel_values: torch.Tensor, max_tiles: int):
        """``_tiles`` over tiles [n, 3, S, S], ``max_tiles`` at a time (bounds the activations' memory and a
        layer's time): their rows concatenated along the first axis (a generator, as ``stages``)."""
        parts = []
        for i in range(0, pixel_values.shape[0], max_tiles):
            parts.append((yield from self._tiles(pixel_values[i:i + max_tiles].to(self.device, self.dtype))))
        return torch.cat(parts) if len(parts) > 1 else parts[0]


class VisionEncoder(_Tower):
    """The Idefics3 tower on one device; ``encode`` turns tiles into decoder embedding rows."""

    def __init__(self, config: VisionConfig, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        super().__init__(config, tensors, dtype=dtype, device=device)

    @torch.inference_mode()
    def stages(self, pixel_values: torch.Tensor, *, grid=None, max_tiles: int = 2):
        """``pixel_values`` [tiles, 3, S, S] -> [tiles * image_seq_len, text_hidden] in the model's dtype, the
        tiles' rows in order; ``max_tiles`` tiles run at a time (bounds the activations' memory and a layer's
        time). A generator that yields after every layer and returns the rows (``encode`` runs it through)."""
        c = self.config
        if grid is not None:
            raise ValueError("Idefics3 towers take whole tiles, not a patch grid")
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != (3, c.image_size, c.image_size):
            raise ValueError(f"tiles must be [n, 3, {c.image_size}, {c.image_size}], got {tuple(pixel_values.shape)}")
        return (yield from self._tile_batches(pixel_values, max_tiles))

    def _tiles(self, x: torch.Tensor):
        c, w = self.config, self.w
        n, d = x.shape[0], c.hidden_size
        h = F.conv2d(x, w["patch_embed.weight"], w["patch_embed.bias"], stride=c.patch_size)  # [n, D, side, side]
        h = h.flatten(2).transpose(1, 2) + w["pos_embed.weight"]  # [n, P, D]: whole tiles, position = patch index
        for i in range(c.num_layers):
            h = _vit_layer(h, w, f"layers.{i}.", c)
            yield
        h = F.layer_norm(h, (d,), w["post_norm.weight"], w["post_norm.bias"], c.layer_norm_eps)
        # Pixel shuffle: each s x s block of patches (row-major blocks) becomes one row of its patches' features,
        # in the order Idefics3's connector lays them out.
        s, side = c.scale_factor, c.patches_per_side
        h = h.view(n, side, side // s, d * s)  # [n, row, col block, s columns' features]
        h = h.permute(0, 2, 1, 3).reshape(n, side // s, side // s, d * s * s)  # [n, col block, row block, ...]
        h = h.permute(0, 2, 1, 3).reshape(n * (side // s) ** 2, d * s * s)
        return F.linear(h, w["proj.weight"])


class Gemma3VisionEncoder(_Tower):
    """Gemma 3's SigLIP tower and projector: one image [3, S, S] -> its rows [(S / p / k)^2, hidden]. Patch conv,
    learned positions, LayerNorm layers with tanh-GELU MLPs, the post-LayerNorm; then each k x k block of patches
    averaged (k = scale_factor), a Gemma RMSNorm (times 1 + w, in float32) and the projection."""

    @torch.inference_mode()
    def stages(self, pixel_values: torch.Tensor, *, grid=None):
        c, w = self.config, self.w
        if grid is not None or tuple(pixel_values.shape) != (3, c.image_size, c.image_size):
            raise ValueError(f"a Gemma 3 tower takes one [3, {c.image_size}, {c.image_size}] image, got "
                             f"{tuple(pixel_values.shape)}")
        d, side = c.hidden_size, c.patches_per_side
        x = F.conv2d(pixel_values.to(self.device, self.dtype)[None], w["patch_embed.weight"], w["patch_embed.bias"],
                     stride=c.patch_size)
        x = x.flatten(2).transpose(1, 2) + w["pos_embed.weight"]  # [1, P, D]
        for i in range(c.num_layers):
            x = _vit_layer(x, w, f"layers.{i}.", c)
            yield
        x = F.layer_norm(x, (d,), w["post_norm.weight"], w["post_norm.bias"], c.layer_norm_eps)
        x = F.avg_pool2d(x[0].T.reshape(1, d, side, side), kernel_size=c.scale_factor, stride=c.scale_factor)
        x = x.flatten(2)[0].T  # [(side / k)^2, D], pooled blocks row-major
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + c.projector_eps)
        x = (normed * (1.0 + w["proj_norm.weight"].float())).to(x.dtype)
        return F.linear(x, w["proj.weight"])


class Gemma4Tower(_Tower):
    """What Gemma 4's towers share (its image tower, its audio conformer: flared.model.audio): transformers'
    Gemma4RMSNorm (float32, the weight as it is, or none) and its clippable products, each clamping its input and
    output to the checkpoint's bounds (``{name}.clip``: input min, max, output min, max) where it has them."""

    def __init__(self, config: VisionConfig, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        clips = {k: v for k, v in tensors.items() if k.endswith(".clip")}
        super().__init__(config, tensors, dtype=dtype, device=device)
        self.clips = {k: [float(x) for x in v.float().tolist()] for k, v in clips.items()}  # (bounds as Python floats)

    @staticmethod
    def _norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        y = x.float()
        y = y * torch.pow(y.pow(2).mean(-1, keepdim=True) + eps, -0.5)
        return (y if weight is None else y * weight.float()).to(x.dtype)

    def _product(self, x: torch.Tensor, name: str) -> torch.Tensor:
        bounds = self.clips.get(name[:-len("weight")] + "clip")
        if bounds is not None:
            x = x.clamp(bounds[0], bounds[1])
        y = F.linear(x, self.w[name])
        return y.clamp(bounds[2], bounds[3]) if bounds is not None else y


class Gemma4VisionEncoder(Gemma4Tower):
    """Gemma 4's tower and projection: an image's (or each video frame's) patches, a grid of h x w, -> its rows
    [(h / k) * (w / k), hidden], the k x k pooled blocks row-major. Each patch's pixels (in [0, 1]) as 2x - 1
    through a linear, plus its column's and its row's position rows; Gemma layers (norms before and after
    attention and the MLP, q/k RMSNorms, weightless v RMSNorm, unscaled scores, a 2D rope: the first half of each
    head turned by the column, the second by the row) attending over the whole frame; then each k x k block
    averaged, times sqrt(D), standardized (float32), a weightless RMSNorm and the projection. The RMSNorms are
    transformers' Gemma4RMSNorm (float32, the weight as it is). ``pixel_values``: [frames * h * w, 3 * p * p]."""

    def __init__(self, config: VisionConfig, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        super().__init__(config, tensors, dtype=dtype, device=device)
        hd = config.hidden_size // config.num_heads
        quarter = hd // 2
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter))

    def _rope(self, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [h * w, 1, head_dim] in the tower's dtype: (column, column, row, row) frequency quarters."""
        cols = torch.arange(w, dtype=torch.float32).repeat(h)
        rows = torch.arange(h, dtype=torch.float32).repeat_interleave(w)
        fx, fy = cols[:, None] * self.inv_freq, rows[:, None] * self.inv_freq
        freqs = torch.cat((fx, fx, fy, fy), dim=-1)[:, None, :]
        return freqs.cos().to(self.device, self.dtype), freqs.sin().to(self.device, self.dtype)

    @staticmethod
    def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        parts = []
        for a, b in ((0, half), (half, 2 * half)):
            part = x[..., a:b]
            parts.append(part * cos[..., a:b] + _rotate_half(part) * sin[..., a:b])
        return torch.cat(parts, dim=-1)

    @torch.inference_mode()
    def stages(self, pixel_values: torch.Tensor, *, grid=None, max_frames: int = 8):
        c, w = self.config, self.w
        if grid is None or len(grid) != 3:
            raise ValueError("a Gemma 4 tower takes an image's patch grid (frames, rows, columns)")
        t, gh, gw = (int(x) for x in grid)
        k = c.scale_factor
        if gh % k or gw % k or tuple(pixel_values.shape) != (t * gh * gw, 3 * c.patch_size ** 2):
            raise ValueError(f"a Gemma 4 tower takes [frames * rows * columns, 3 * patch^2] patches in whole "
                             f"{k} x {k} blocks, got {tuple(pixel_values.shape)} for grid {grid}")
        if gh > c.position_table or gw > c.position_table:
            raise ValueError(f"a {gh} x {gw} patch grid is past the tower's {c.position_table} positions")
        d, heads = c.hidden_size, c.num_heads
        hd = d // heads
        eps = c.layer_norm_eps
        cos, sin = self._rope(gh, gw)
        cols = torch.arange(gw, device=self.device).repeat(gh)
        rows = torch.arange(gh, device=self.device).repeat_interleave(gw)
        positions = w["pos_embed.weight"][0].index_select(0, cols) + w["pos_embed.weight"][1].index_select(0, rows)
        frames = pixel_values.view(t, gh * gw, -1)
        out = []
        for f0 in range(0, t, max_frames):
            x = 2 * (frames[f0:f0 + max_frames].to(self.device, torch.float32) - 0.5)
            h = F.linear(x.to(self.dtype), w["patch_embed.weight"]) + positions  # [n, P, D]
            n, patches = h.shape[:2]
            for i in range(c.num_layers):
                p = f"layers.{i}."
                x = self._norm(h, w[p + "norm1.weight"], eps)
                shape = (n, patches, heads, hd)
                q = self._norm(self._product(x, p + "q.weight").view(shape), w[p + "q_norm.weight"], eps)
                kk = self._norm(self._product(x, p + "k.weight").view(shape), w[p + "k_norm.weight"], eps)
                v = self._norm(self._product(x, p + "v.weight").view(shape), None, eps)
                q, kk = self._turn(q, cos, sin), self._turn(kk, cos, sin)
                attn = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2), v.transpose(1, 2),
                                                      scale=1.0).transpose(1, 2).reshape(n, patches, d)
                h = h + self._norm(self._product(attn, p + "o.weight"), w[p + "post_attn_norm.weight"], eps)
                x = self._norm(h, w[p + "norm2.weight"], eps)
                mid = _activation(self._product(x, p + "gate.weight"), c.hidden_act) * self._product(x, p + "up.weight")
                h = h + self._norm(self._product(mid, p + "down.weight"), w[p + "post_mlp_norm.weight"], eps)
                yield
            # each k x k block's mean (float32, then the tower's dtype), times sqrt(D) in float32
            pooled = h.float().view(n, gh // k, k, gw // k, k, d).mean(dim=(2, 4)).reshape(n * (gh // k) * (gw // k), d)
            pooled = pooled.to(self.dtype).float() * d ** 0.5
            if c.standardize:
                pooled = (pooled - w["std_bias"].float()) * w["std_scale"].float()
            pooled = self._norm(pooled.to(self.dtype), None, c.projector_eps)
            out.append(F.linear(pooled, w["proj.weight"]))
        return torch.cat(out) if len(out) > 1 else out[0]


def _activation(x: torch.Tensor, hidden_act: str) -> torch.Tensor:
    kind = _ACTIVATIONS[hidden_act]
    if kind == "silu":
        return F.silu(x)
    return x * torch.sigmoid(1.702 * x) if kind == "quick" else F.gelu(x, approximate=kind)


def _vit_layer(h: torch.Tensor, w: dict, p: str, c: VisionConfig) -> torch.Tensor:
    """One SigLIP / CLIP encoder layer over [n, P, D] (every patch attends to every other of its image)."""
    n, patches, d = h.shape
    heads = c.num_heads
    x1 = F.layer_norm(h, (d,), w[p + "norm1.weight"], w[p + "norm1.bias"], c.layer_norm_eps)
    q, k, v = F.linear(x1, w[p + "qkv.weight"], w[p + "qkv.bias"]).view(n, patches, 3, heads, d // heads).permute(
        2, 0, 3, 1, 4)  # each [n, heads, P, head_dim]
    attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, patches, d)
    h = h + F.linear(attn, w[p + "o.weight"], w[p + "o.bias"])
    x2 = F.layer_norm(h, (d,), w[p + "norm2.weight"], w[p + "norm2.bias"], c.layer_norm_eps)
    mid = _activation(F.linear(x2, w[p + "fc1.weight"], w[p + "fc1.bias"]), c.hidden_act)
    return h + F.linear(mid, w[p + "fc2.weight"], w[p + "fc2.bias"])


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen2.5-VL's RMSNorm: float32 statistics, the weight applied in the input's dtype."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def grid_position_ids(grid: tuple[int, int, int], merge: int) -> torch.Tensor:
    """[t*h*w, 2] (row, column) of every patch, in the tower's order: merge x merge blocks row-major, the
    patches of a block row-major within it, each frame alike."""
    t, h, w = grid
    rows = torch.arange(h)[:, None].expand(h, w)
    cols = torch.arange(w)[None, :].expand(h, w)
    shape = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(shape).transpose(1, 2).flatten()
    cols = cols.reshape(shape).transpose(1, 2).flatten()
    return torch.stack([rows, cols], dim=-1).repeat(t, 1)


def window_order(grid: tuple[int, int, int], merge: int, window_merged: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows: the order of the merged blocks (window by window, row-major within one) and each
    window's length in patches. ``window_merged``: a window's side in merged blocks."""
    t, h, w = grid
    gh, gw = h // merge, w // merge
    index = torch.arange(t * gh * gw).reshape(t, gh, gw)
    pad_h, pad_w = -gh % window_merged, -gw % window_merged
    padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
    nh, nw = (gh + pad_h) // window_merged, (gw + pad_w) // window_merged
    padded = padded.reshape(t, nh, window_merged, nw, window_merged).permute(0, 1, 3, 2, 4)
    padded = padded.reshape(t * nh * nw, window_merged * window_merged)
    lengths = [int(n) * merge * merge for n in (padded >= 0).sum(1).tolist() if n]
    return padded[padded >= 0], lengths


class QwenVisionEncoder(_Tower):
    """Qwen2-VL and Qwen2.5-VL towers: one image's patches (any size, a grid of t x h x w patches) -> its rows
    [t*h*w / merge^2, hidden]. Conv3d patch embedding, layers with a 2D rope over (row, column) and bidirectional
    attention over the whole image (qwen2_vl; qwen2_5_vl's full_attention_layers) or within windows of
    window_size pixels (qwen2_5_vl's other layers), then the merger (norm, merge^2 patches a row, two linears
    with GELU)."""

    def __init__(self, config: VisionConfig, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        super().__init__(config, tensors, dtype=dtype, device=device)
        half = config.hidden_size // config.num_heads // 2  # rows and columns share the head's rotation
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if self.config.family == "qwen2_5_vl":
            return _rms(x, self.w[name + ".weight"], 1e-6)
        return F.layer_norm(x, (x.shape[-1],), self.w[name + ".weight"], self.w[name + ".bias"], 1e-6)

    def _mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        w = self.w
        if self.config.family == "qwen2_5_vl":
            gate, up = F.linear(x, w[p + "gate_up.weight"], w[p + "gate_up.bias"]).chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, w[p + "down.weight"], w[p + "down.bias"])
        mid = _activation(F.linear(x, w[p + "fc1.weight"], w[p + "fc1.bias"]), self.config.hidden_act)
        return F.linear(mid, w[p + "fc2.weight"], w[p + "fc2.bias"])

    def _merge(self, x: torch.Tensor, prefix: str, *, norm_after_shuffle: bool) -> torch.Tensor:
        """merge^2 patches a row, through a merger's norm (before the shuffle, or after it for DeepStack's) and
        its two linears with GELU between."""
        w, width = self.w, x.shape[-1] * self.config.scale_factor ** 2
        rows = (self._norm(x.reshape(-1, width), prefix + "norm") if norm_after_shuffle
                else self._norm(x, prefix + "norm").reshape(-1, width))
        return F.linear(F.gelu(F.linear(rows, w[prefix + "fc1.weight"], w[prefix + "fc1.bias"])),
                        w[prefix + "fc2.weight"], w[prefix + "fc2.bias"])

    def _table_positions(self, grid: tuple[int, int, int], order: torch.Tensor) -> torch.Tensor:
        """qwen3_vl: the learned square position table resampled bilinearly (corners aligned) to the image's
        grid, a row per patch in the tower's order (``order``: each patch's (row, column))."""
        side = math.isqrt(self.config.position_table)
        _, h, w = grid
        taps, weights = [], []
        for index, size in ((order[:, 0], h), (order[:, 1], w)):
            src = index.float() * (side - 1) / max(size - 1, 1)
            floor = torch.floor(src)
            offsets = torch.arange(2)
            taps.append((floor.long()[:, None] + offsets).clamp(0, side - 1))
            weights.append((1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0))
        index = (taps[0][:, :, None] * side + taps[1][:, None, :]).reshape(-1, 4).to(self.device)
        weight = (weights[0][:, :, None] * weights[1][:, None, :]).reshape(-1, 4).to(self.device)
        return (self.w["pos_embed.weight"][index].float() * weight[:, :, None]).sum(1).to(self.dtype)

    @torch.inference_mode()
    def stages(self, pixel_values: torch.Tensor, *, grid=None):
        c, w = self.config, self.w
        if grid is None:
            raise ValueError("a Qwen vision tower needs the image's patch grid (t, h, w)")
        t, h, wd = (int(x) for x in grid)
        n = t * h * wd
        width = 3 * c.temporal_patch_size * c.patch_size ** 2
        if tuple(pixel_values.shape) != (n, width) or h % c.scale_factor or wd % c.scale_factor:
            raise ValueError(f"patches must be [{n}, {width}] for grid {grid}, got {tuple(pixel_values.shape)}")
        x = pixel_values.to(self.device, self.dtype).view(n, 3, c.temporal_patch_size, c.patch_size, c.patch_size)
        x = F.conv3d(x, w["patch_embed.weight"], w.get("patch_embed.bias"),
                     stride=w["patch_embed.weight"].shape[2:]).view(n, c.hidden_size)
        order = grid_position_ids((t, h, wd), c.scale_factor)
        if c.position_table:
            x = x + self._table_positions((t, h, wd), order)
        angles = order.float()[..., None] * self.inv_freq  # [n, 2, d/4]
        angles = angles.flatten(1)
        angles = torch.cat((angles, angles), dim=-1).to(self.device)  # [n, head_dim]
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]
        unit = c.scale_factor ** 2
        frames = [h * wd] * t  # whole-image attention: each frame its own segment
        window = None  # qwen2_5_vl: the merged blocks' order, window by window
        windows = frames
        if c.family == "qwen2_5_vl":
            window, windows = window_order((t, h, wd), c.scale_factor, c.window_size // c.scale_factor // c.patch_size)
            rows = (window[:, None] * unit + torch.arange(unit)).flatten().to(self.device)
            x, cos, sin = x[rows], cos[rows], sin[rows]
        heads, d = c.num_heads, c.hidden_size
        deepstack = []
        for i in range(c.num_layers):
            p = f"layers.{i}."
            full = c.family == "qwen2_vl" or i in c.full_attention_layers
            qkv = F.linear(self._norm(x, p + "norm1"), w[p + "qkv.weight"], w[p + "qkv.bias"])
            q, k, v = qkv.view(n, 3, heads, d // heads).unbind(1)  # each [n, heads, head_dim]
            q32, k32 = q.float(), k.float()
            q = (q32 * cos + _rotate_half(q32) * sin).to(x.dtype)
            k = (k32 * cos + _rotate_half(k32) * sin).to(x.dtype)
            attn = _segments_attention(q, k, v, frames if full else windows)
            x = x + F.linear(attn.reshape(n, d), w[p + "o.weight"], w[p + "o.bias"])
            x = x + self._mlp(self._norm(x, p + "norm2"), p)
            if i in c.deepstack_layers:
                j = c.deepstack_layers.index(i)
                deepstack.append(self._merge(x, f"deepstack.{j}.", norm_after_shuffle=True))
            yield
        out = self._merge(x, "merger_", norm_after_shuffle=False)
        if deepstack:  # [rows, (1 + k) * hidden]: the embedding, then each DeepStack layer's rows
            out = torch.cat([out, *deepstack], dim=-1)
        if window is not None:  # back to the image's own order of merged blocks
            out = out[torch.argsort(window.to(self.device))]
        return out


def _segments_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Bidirectional attention within consecutive segments of the rows ([n, heads, head_dim] each; the result
    likewise). SDPA takes 4D inputs (its CPU flash kernel; 3D ones fall back to a path ~3.5x slower) and one
    call per run of equal segments, without a mask (a block mask would cost the whole square)."""
    out, at = [], 0
    for length, run in itertools.groupby(lengths):
        count = len(list(run))
        rows = slice(at, at + length * count)
        q_, k_, v_ = (x[rows].view(count, length, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        out.append(F.scaled_dot_product_attention(q_, k_, v_).transpose(1, 2).reshape(length * count,
                                                                                      *q.shape[1:]))
        at += length * count
    return torch.cat(out) if len(out) > 1 else out[0]


def mrope_positions(token_ids, image_spans: list[tuple], merge: int):
    """Qwen VL's 3D positions of a prompt (temporal, row, column) [3, L] int64 and the delta that later tokens
    add to their index. ``image_spans``: (first index, token count, patch grid[, time interval]) of each image's
    or video's tokens. Text counts one position a token on all three rows; an image's tokens sit at its start
    position plus their merged (row, column), a video's temporal patches at its start plus k, or k times its time
    interval truncated (Qwen2.5-VL: tokens_per_second x second_per_grid_t, in float32 as transformers multiplies
    them); the text after them starts one past their largest position (the Qwen authors' get_rope_index, and
    vLLM's: transformers 5 starts it past the longer side alone, which differs only where a video's time outruns
    its frame's sides)."""
    import numpy as np

    length = len(token_ids)
    pos = np.empty((3, length), dtype=np.int64)
    cur = at = 0
    for span in image_spans:
        start, count, (t, h, w) = span[:3]
        interval = span[3] if len(span) > 3 else None
        gh, gw = h // merge, w // merge
        if start < at or count != t * gh * gw or start + count > length:
            raise ValueError("image spans must be in order, inside the prompt, one token per merged patch")
        pos[:, at:start] = cur + np.arange(start - at)
        cur += start - at
        times = np.arange(t) if interval is None else (
            torch.arange(t) * torch.tensor(interval, dtype=torch.float32)).long().numpy()
        tt, hh, ww = np.meshgrid(times, np.arange(gh), np.arange(gw), indexing="ij")
        pos[:, start:start + count] = cur + np.stack([tt.ravel(), hh.ravel(), ww.ravel()])
        cur += max(int(times[-1]), gh - 1, gw - 1) + 1
        at = start + count
    pos[:, at:] = cur + np.arange(length - at)
    return pos, int(pos.max()) + 1 - length if length else 0


class PixtralVisionEncoder(_Tower):
    """Pixtral's tower with Mistral3's projector: one image (any size in whole patches) -> its rows
    [(h / s) * (w / s), hidden], merged blocks row-major (the order of the prompt's [IMG] tokens). Patch conv,
    RMSNorm, layers with a 2D rope (rows turn by the even frequencies, columns by the odd) and bidirectional
    attention over the image, gated MLPs; then RMSNorm, the s x s patch merger, two linears with GELU (Pixtral
    12B: the two linears alone, a row a patch)."""

    def __init__(self, config: VisionConfig, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        super().__init__(config, tensors, dtype=dtype, device=device)
        head = config.hidden_size // config.num_heads
        inv = 1.0 / (config.rope_theta ** (torch.arange(0, head, 2, dtype=torch.float) / head))
        self.inv_rows, self.inv_cols = inv[0::2], inv[1::2]

    @torch.inference_mode()
    def stages(self, pixel_values: torch.Tensor, *, grid=None):
        c, w = self.config, self.w
        if grid is None:
            raise ValueError("a Pixtral tower needs the image's patch grid (1, h, w)")
        _, h, wd = (int(x) for x in grid)
        s = c.scale_factor
        if tuple(pixel_values.shape) != (3, h * c.patch_size, wd * c.patch_size) or h % s or wd % s:
            raise ValueError(f"pixels must be [3, {h * c.patch_size}, {wd * c.patch_size}] for grid {grid} in "
                             f"whole {s} x {s} blocks, got {tuple(pixel_values.shape)}")
        x = F.conv2d(pixel_values.to(self.device, self.dtype)[None], w["patch_embed.weight"], stride=c.patch_size)
        x = _rms(x[0].flatten(1).T, w["pre_norm.weight"], c.layer_norm_eps)  # [h*w, D], patches row-major
        n, d, heads = h * wd, c.hidden_size, c.num_heads
        rows = torch.arange(h).repeat_interleave(wd).float()
        cols = torch.arange(wd).repeat(h).float()
        angles = torch.cat((rows[:, None] * self.inv_rows, cols[:, None] * self.inv_cols), dim=-1)
        angles = torch.cat((angles, angles), dim=-1).to(self.device)
        cos, sin = angles.cos().to(self.dtype)[:, None], angles.sin().to(self.dtype)[:, None]
        layers = c.feature_depth
        for i in range(layers):
            p = f"layers.{i}."
            q, k, v = F.linear(_rms(x, w[p + "norm1.weight"], c.layer_norm_eps), w[p + "qkv.weight"]).view(
                n, 3, heads, d // heads).unbind(1)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            attn = _segments_attention(q, k, v, [n])
            x = x + F.linear(attn.reshape(n, d), w[p + "o.weight"])
            gate, up = F.linear(_rms(x, w[p + "norm2.weight"], c.layer_norm_eps), w[p + "gate_up.weight"]).chunk(2, -1)
            # the gated MLP's activation: Pixtral's config names it (silu on the released models, gelu by default)
            x = x + F.linear(_activation(gate, c.hidden_act) * up, w[p + "down.weight"])
            yield
        if c.patch_merger:  # (Mistral3's; Pixtral 12B's LLaVA projector takes every patch as it is)
            x = _rms(x, w["proj_norm.weight"], c.projector_eps)
            blocks = F.unfold(x.view(h, wd, d).permute(2, 0, 1)[None], kernel_size=s, stride=s)  # [1, D*s*s, n]
            x = F.linear(blocks[0].T, w["merge.weight"])
        x = F.gelu(F.linear(x, w["proj_fc1.weight"], w.get("proj_fc1.bias")))
        return F.linear(x, w["proj_fc2.weight"], w.get("proj_fc2.bias"))


class LlavaVisionEncoder(_Tower):
    """LLaVA-1.5's CLIP tower and projector: one image [3, S, S] -> its rows [(S / p)^2 (+1), hidden]. Patch conv,
    the class token before the patches, learned positions, a pre-LayerNorm, the layers up to feature_layer (CLIP's
    hidden states: 0 the embeddings, -2 before the last layer), the class row dropped ("default"), then two
    linears with GELU."""

    @torch.inference_mode()
    def stages(self, pixel_values: torch.Tensor, *, grid=None):
        c = self.config
        if grid is not None or tuple(pixel_values.shape) != (3, c.image_size, c.image_size):
            raise ValueError(f"a CLIP tower takes one [3, {c.image_size}, {c.image_size}] image, got "
                             f"{tuple(pixel_values.shape)}")
        rows = yield from self._tiles(pixel_values[None].to(self.device, self.dtype))
        return rows[0]

    def _tiles(self, x: torch.Tensor):
        """Tiles [n, 3, S, S] -> their projected rows [n, P (+1), hidden]; yields after each layer."""
        return self._project((yield from self._features(x)))

    def _features(self, x: torch.Tensor):
        """Tiles [n, 3, S, S] -> the feature layer's rows [n, P (+1), D], the class row dropped ("default")."""
        c, w = self.config, self.w
        d = c.hidden_size
        x = F.conv2d(x, w["patch_embed.weight"], stride=c.patch_size).flatten(2).transpose(1, 2)  # [n, P, D]
        x = torch.cat([w["class_embed"].expand(x.shape[0], 1, d), x], 1) + w["pos_embed.weight"]  # [n, 1 + P, D]
        x = F.layer_norm(x, (d,), w["pre_norm.weight"], w["pre_norm.bias"], c.layer_norm_eps)
        for i in range(c.feature_depth):
            x = _vit_layer(x, w, f"layers.{i}.", c)
            yield
        return x[:, 1:] if c.feature_select == "default" else x

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        x = F.gelu(F.linear(x, w["proj_fc1.weight"], w.get("proj_fc1.bias")))
        return F.linear(x, w["proj_fc2.weight"], w.get("proj_fc2.bias"))


class _Anyres:
    """What LLaVA-NeXT's and LLaVA-OneVision's towers share: tiles [1 + n, 3, S, S] (the whole image squashed to one
    tile, then the canvas's tiles row by row) and ``grid`` = the image's (height, width) in pixels -> the whole
    image's rows, then the tiles' rows laid out as the canvas's feature grid, the padding's rows and columns cut
    away, scaled down (bilinear) to about anyres_max tiles' worth where it holds more by a tenth (OneVision's; 0:
    never), each grid row ended by the image_newline embedding. One tile alone (OneVision's image among several)
    -> its rows and one image_newline. ``_tiles`` runs the tower and projector over a batch of tiles."""

    label: str

    @torch.inference_mode()
    def stages(self, pixel_values: torch.Tensor, *, grid=None, max_tiles: int = 2):
        c = self.config
        if grid is None or len(grid) != 2 or pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != (
                3, c.image_size, c.image_size):
            raise ValueError(f"a {self.label} tower takes tiles [n, 3, {c.image_size}, {c.image_size}] and the "
                             f"image's (height, width), got {tuple(pixel_values.shape)} and {grid!r}")
        height, width = (int(x) for x in grid)
        canvas_h, canvas_w = best_resolution(height, width, c.grid_pinpoints)
        rows, cols = canvas_h // c.image_size, canvas_w // c.image_size
        if pixel_values.shape[0] != 1 + rows * cols and not (pixel_values.shape[0] == 1 and c.anyres_max):
            raise ValueError(f"a {width}x{height} image takes 1 + {rows} x {cols} tiles, got {pixel_values.shape[0]}")
        x = yield from self._tile_batches(pixel_values, max_tiles)  # [tiles, side * side, hidden]
        hidden = x.shape[-1]
        newline = self.w["image_newline"].to(x.dtype)
        if x.shape[0] == 1:
            return torch.cat([x[0], newline[None]])
        side = c.patches_per_side
        tiles = x[1:].view(rows, cols, side, side, hidden).permute(0, 2, 1, 3, 4).reshape(rows * side, cols * side,
                                                                                          hidden)
        top, bottom, left, right = unpadded_size(height, width, rows * side, cols * side)
        tiles = tiles[top:bottom, left:right]
        size = anyres_scaled(*tiles.shape[:2], side, c.anyres_max)
        if size != tiles.shape[:2]:
            tiles = F.interpolate(tiles.permute(2, 0, 1)[None], list(size), mode="bilinear")[0].permute(1, 2, 0)
        newlines = newline.expand(tiles.shape[0], 1, hidden)
        return torch.cat([x[0], torch.cat([tiles, newlines], 1).reshape(-1, hidden)])


class LlavaNextVisionEncoder(_Anyres, LlavaVisionEncoder):
    """LLaVA-NeXT: LLaVA-1.5's CLIP tower and projector over each tile (_Anyres); LLaVA-NeXT-Video's frames as tiles
    whose features are average-pooled before the projector (``video_stages``)."""

    label = "LLaVA-NeXT"

    @torch.inference_mode()
    def video_stages(self, pixel_values: torch.Tensor, *, max_tiles: int = 2):
        """A video's frames [n, 3, S, S] -> their rows [n * (side / pool)^2, hidden]: each frame's feature-layer rows
        average-pooled ``video_pool`` to a side (LlavaNextVideoPooler), then projected, the frames in order."""
        c = self.config
        if not c.video_pool or pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != (
                3, c.image_size, c.image_size):
            raise ValueError(f"a {self.label} tower with video takes frames [n, 3, {c.image_size}, {c.image_size}], "
                             f"got {tuple(pixel_values.shape)}")
        x = pixel_values.to(self.device, self.dtype)
        parts = []
        for at in range(0, x.shape[0], max_tiles):
            h = yield from self._features(x[at:at + max_tiles])
            n, side, d = h.shape[0], c.patches_per_side, h.shape[-1]
            pooled = F.avg_pool2d(h.view(n, side, side, d).permute(0, 3, 1, 2), c.video_pool, c.video_pool)
            parts.append(self._project(pooled.flatten(2).transpose(1, 2)).reshape(-1, c.text_hidden_size))
        return torch.cat(parts)


class InternVLVisionEncoder(_Tower):
    """InternVL's InternViT tower and projector: tiles [n, 3, S, S] -> their rows [n * (S / p / s)^2, hidden]. Patch
    conv, the class token before the patches, learned positions; layers of pre-norm attention (q and k RMS-normed
    over all heads where qk_norm) and MLP, each branch scaled by its layer scale; the post-LayerNorm where the
    tower has one; the class row dropped, each s x s block of patches pixel-shuffled into one row, then a LayerNorm
    and two linears with GELU."""

    @torch.inference_mode()
    def stages(self, pixel_values: torch.Tensor, *, grid=None, max_tiles: int = 2):
        c = self.config
        if grid is not None or pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != (3, c.image_size,
                                                                                             c.image_size):
            raise ValueError(f"an InternViT tower takes tiles [n, 3, {c.image_size}, {c.image_size}], got "
                             f"{tuple(pixel_values.shape)}")
        return (yield from self._tile_batches(pixel_values, max_tiles))

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        c, w = self.config, self.w
        if c.norm_kind == "rms_norm":
            return _rms(x, w[name + ".weight"], c.layer_norm_eps)
        return F.layer_norm(x, (x.shape[-1],), w[name + ".weight"], w[name + ".bias"], c.layer_norm_eps)

    def _layer(self, h: torch.Tensor, p: str) -> torch.Tensor:
        c, w = self.config, self.w
        n, rows, d = h.shape
        heads = c.num_heads
        qkv = F.linear(self._norm(h, p + "norm1"), w[p + "qkv.weight"], w.get(p + "qkv.bias"))
        q, k, v = qkv.split(d, dim=-1)
        if c.qk_norm:  # (over the whole of q and of k, before the heads split)
            q, k = _rms(q, w[p + "q_norm.weight"], c.layer_norm_eps), _rms(k, w[p + "k_norm.weight"], c.layer_norm_eps)
        q, k, v = (x.view(n, rows, heads, d // heads).transpose(1, 2) for x in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, rows, d)
        h = h + w[p + "ls1"] * F.linear(attn, w[p + "o.weight"], w[p + "o.bias"])
        mid = _activation(F.linear(self._norm(h, p + "norm2"), w[p + "fc1.weight"], w[p + "fc1.bias"]), c.hidden_act)
        return h + w[p + "ls2"] * F.linear(mid, w[p + "fc2.weight"], w[p + "fc2.bias"])

    def _tiles(self, x: torch.Tensor):
        c, w = self.config, self.w
        n, d = x.shape[0], c.hidden_size
        h = F.conv2d(x, w["patch_embed.weight"], w["patch_embed.bias"], stride=c.patch_size).flatten(2).transpose(1, 2)
        h = torch.cat([w["class_embed"].expand(n, 1, d), h], 1) + w["pos_embed.weight"]  # [n, 1 + P, D]
        layers = c.feature_depth  # (the last layer's features after the post-norm, as transformers takes them)
        for i in range(layers):
            h = self._layer(h, f"layers.{i}.")
            yield
        if c.feature_layer == -1 and c.post_norm:
            h = F.layer_norm(h, (d,), w["post_norm.weight"], w["post_norm.bias"], c.layer_norm_eps)
        side, s = c.patches_per_side, c.scale_factor
        # Pixel shuffle as InternVL's: the patches [n, row, column, D]; each s adjacent columns joined, then each s
        # adjacent rows of those; the blocks row-major, a block's features (row offset, column offset, D)
        h = h[:, 1:].reshape(n, side, side // s, d * s).permute(0, 2, 1, 3).reshape(n, side // s, side // s,
                                                                                    d * s * s)
        h = h.permute(0, 2, 1, 3).reshape(n * (side // s) ** 2, d * s * s)
        h = F.layer_norm(h, (d * s * s,), w["proj_norm.weight"], w["proj_norm.bias"], 1e-5)
        h = F.gelu(F.linear(h, w["proj_fc1.weight"], w["proj_fc1.bias"]))
        return F.linear(h, w["proj_fc2.weight"], w["proj_fc2.bias"])


class _SiglipTiles:
    """SigLIP's layers up to the feature layer (no post-norm) and LLaVA's projector over a batch of tiles; where
    several feature layers are read (Granite Vision), their hidden states side by side."""

    def _tiles(self, x: torch.Tensor):
        """Tiles [n, 3, S, S] -> their projected rows [n, P, hidden] (SigLIP: patch conv and positions, the layers up
        to the deepest feature layer, no post-norm); yields after each layer."""
        c, w = self.config, self.w
        h = F.conv2d(x, w["patch_embed.weight"], w["patch_embed.bias"], stride=c.patch_size).flatten(2).transpose(1, 2)
        h = h + w["pos_embed.weight"]
        wanted = [layer if layer >= 0 else c.num_layers + 1 + layer for layer in c.feature_layers]
        states = {0: h} if 0 in wanted else {}
        for i in range(c.feature_depth):
            h = _vit_layer(h, w, f"layers.{i}.", c)
            if i + 1 in wanted:
                states[i + 1] = h
            yield
        if wanted:
            h = torch.cat([states[layer] for layer in wanted], dim=-1)
        h = F.gelu(F.linear(h, w["proj_fc1.weight"], w.get("proj_fc1.bias")))
        return F.linear(h, w["proj_fc2.weight"], w.get("proj_fc2.bias"))


class LlavaNextSiglipVisionEncoder(_Anyres, _SiglipTiles, _Tower):
    """LLaVA-NeXT over SigLIP (Granite Vision): SigLIP's tiles (_SiglipTiles, its feature layers side by side)
    packed as LLaVA-NeXT's (_Anyres, no scaling down)."""

    label = "LLaVA-NeXT"


class OnevisionVisionEncoder(_Anyres, _SiglipTiles, _Tower):
    """LLaVA-OneVision: SigLIP's layers up to feature_layer (no post-norm) and LLaVA's projector over each tile
    (_SiglipTiles, _Anyres); an image of a request with several comes as one padded tile; a video's frames as tiles
    pooled 2 x 2 (``video_stages``)."""

    label = "LLaVA-OneVision"

    @torch.inference_mode()
    def video_stages(self, pixel_values: torch.Tensor, *, max_tiles: int = 2):
        """A video's frames [n, 3, S, S] -> their rows [n * ceil(side / 2)^2 + 1, hidden]: each frame's projected
        rows scaled to half the side (bilinear, as LlavaOnevisionModel.apply_pooling), the frames in order, then one
        image_newline."""
        c = self.config
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != (3, c.image_size, c.image_size):
            raise ValueError(f"a {self.label} tower takes frames [n, 3, {c.image_size}, {c.image_size}], got "
                             f"{tuple(pixel_values.shape)}")
        x = yield from self._tile_batches(pixel_values, max_tiles)  # [frames, side * side, hidden]
        n, side, hidden = x.shape[0], c.patches_per_side, x.shape[-1]
        grid = x.view(n, side, side, hidden).permute(0, 3, 1, 2)
        pooled = F.interpolate(grid, size=[math.ceil(side / 2)] * 2, mode="bilinear")
        rows = pooled.permute(0, 2, 3, 1).reshape(-1, hidden)
        return torch.cat([rows, self.w["image_newline"].to(rows.dtype)[None]])

