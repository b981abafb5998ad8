"""Whisper-style audio encoders (Qwen2-Audio's, Audio Flamingo 3's, GLM-ASR's, Qwen3-ASR's) and Gemma 4's conformer:
a clip's log-mel frames in, decoder rows out.

Qwen2-Audio (transformers' ``qwen2_audio``) and Audio Flamingo 3 (``audioflamingo3``) are Qwen2 decoders behind
Whisper-large-v3's encoder. A clip (``flared.frontend.audio.WhisperProcessor``: log-mel frames [mel, F], in
30-second windows where it is longer: Audio Flamingo 3 takes up to 20) runs, window by window, through

    conv1 (k 3, pad 1) + GELU, conv2 (k 3, stride 2, pad 1) + GELU      [mel, F] -> [T, D]
    + the learned position rows 0..T-1
    layers x [x + attn(LN1(x)); x + fc2(gelu(fc1(LN2(x))))]           bidirectional over the clip's T rows
    average pool (2, stride 2), LayerNorm, the projector to the decoder's width (Qwen2-Audio: a biased linear;
    Audio Flamingo 3: two linears with GELU between)

giving (T - 2) // 2 + 1 rows a window, the windows' rows in order, which replace the prompt's audio tokens
(``<|AUDIO|>``, ``<sound>``) as an image's rows replace its image tokens (the pipeline is the image one:
``VisionConfig`` families ``qwen2_audio``, ``audioflamingo3`` and ``glmasr``, ``VisionJob``, ``embed_rows``).

GLM-ASR (``glmasr``) has no position rows: its layers turn the leading half of each head's q and k by a rope over
the row index (rotate-half), its attention is over the whole window, padding included (transformers passes no mask:
so do we, and the processor keeps the last window whole), a LayerNorm ends it, and its projector takes each four
rows side by side (T // 4 rows of 4 D) through two linears with GELU; a window gives (T - 4) // 4 + 1 tokens of
its valid rows.
Qwen3-ASR (``qwen3_asr``: Qwen3-Omni's AuT encoder before a Qwen3 decoder) has no 30-second window: each
one-second chunk of the clip's frames runs alone through three stride-2 2D convolutions (13 rows a chunk, sinusoid
positions restarting at each), and its layers attend within windows of eight chunks (``Qwen3AsrAudioEncoder``).
transformers runs the encoder over the whole 30-second window with the padding's keys masked out; only the clip's
T rows are run here, which gives the same rows, since a masked key changes nothing and the convolutions' last rows
read at most one frame of padding, which the processor keeps.

Serving layout (``audio_tensor_shapes``):

    conv1.weight [D, mel, 3]  conv1.bias [D]   conv2.weight [D, D, 3]  conv2.bias [D]
    pos_embed.weight [positions, D]
    layers.{i}.*      as the SigLIP / CLIP layers (norm1, qkv fused with k's zero bias, o, norm2, fc1, fc2)
    post_norm.weight / .bias [D]
    proj.weight [hidden, D]   proj.bias [hidden]                         qwen2_audio
    proj_fc1.weight [hidden, D]  proj_fc2.weight [hidden, hidden]  (.bias where projector_bias)   audioflamingo3
    proj_fc1.weight [2 hidden, 4 D]  proj_fc2.weight [hidden, 2 hidden]  (and biases)                 glmasr
                                                                         (glmasr: no pos_embed)
    conv0..2.weight [C, 1 | C, 3, 3] (.bias)  conv_out.weight [D, C x mel / 8]  proj_fc1 [D, D]  proj_fc2 [hidden, D]
                                                                         (qwen3_asr: no conv1d, no pos_embed)
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from flared.errors import CoreError, ErrorKind
from flared.model.vision import (AUDIO_FAMILIES, Gemma4Tower, VisionConfig, _Tower, _vit_layer, _vit_layer_shapes,
                                 clipped_product_shapes, clipped_products)


__all__ = ["AUDIO_FAMILIES", "Gemma4AudioEncoder", "Qwen3AsrAudioEncoder", "WhisperAudioEncoder", "audio_from_hf",
           "audio_tensor_shapes", "audio_to_serving", "gemma4_audio_from_hf", "sinusoid_positions"]
# each family's encoder config: its model_type and its names for the sizes (Qwen2-Audio's are Whisper's)
_ENCODERS = {"qwen2_audio": ("qwen2_audio_encoder", "d_model", "encoder_ffn_dim", "encoder_layers",
                             "encoder_attention_heads"),
             "audioflamingo3": ("audioflamingo3_encoder", "hidden_size", "intermediate_size", "num_hidden_layers",
                                "num_attention_heads"),
             "glmasr": ("glmasr_encoder", "hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads"),
             "qwen3_asr": ("qwen3_asr_encoder", "d_model", "encoder_ffn_dim", "encoder_layers",
                           "encoder_attention_heads")}
_DEFAULT_TOKENS = {"qwen2_audio": 151646, "audioflamingo3": 151669, "glmasr": 59260, "qwen3_asr": 151676}


def audio_from_hf(hf: dict[str, Any], family: str, source: str) -> VisionConfig:
    """The audio encoder a ``qwen2_audio``, ``audioflamingo3`` or ``glmasr`` config.json describes (its
    ``audio_config``; transformers' defaults are Whisper-large-v3's: 128 mel bins, 32 layers of width 1280, 1,500
    positions), as a VisionConfig."""
    a, t = hf.get("audio_config"), hf.get("text_config")
    if not isinstance(a, dict) or not isinstance(t, dict):
        raise CoreError(f"{source}: a {family} config needs audio_config and text_config objects",
                        ErrorKind.SOURCE_FORMAT)
    kind, width, ffn, layers, heads = _ENCODERS[family]
    # (the released Qwen3-ASR checkpoints name their encoder as Qwen3-Omni's or as their own audio encoder)
    also = ("qwen3_omni_moe_audio_encoder", "qwen3_asr_audio_encoder") if family == "qwen3_asr" else ()
    if a.get("model_type", kind) not in (kind, *also):
        raise CoreError(f"{source}: an audio encoder of type {a.get('model_type')!r} is not supported",
                        ErrorKind.UNSUPPORTED_MODEL)
    act = str(a.get("activation_function", a.get("hidden_act", "gelu")))
    if act != "gelu" or hf.get("projector_hidden_act", "gelu") != "gelu":
        raise CoreError(f"{source}: audio activation {act!r} / projector {hf.get('projector_hidden_act')!r} is not "
                        "supported (gelu)", ErrorKind.UNSUPPORTED_MODEL)
    token = hf.get("audio_token_index", hf.get("audio_token_id", _DEFAULT_TOKENS[family]))
    d, heads_n = int(a.get(width, 1280)), int(a.get(heads, 20))
    # Whisper's: an average pool of 2 rows a token, a table of max_source_positions rows
    shape: dict[str, Any] = dict(scale_factor=2, position_table=int(a.get("max_source_positions", 1500)))
    if family == "glmasr":
        ffn_width = int(a.get(ffn, 5120))
        if ffn_width % d or int(a.get("num_key_value_heads") or heads_n) != heads_n:
            raise CoreError(f"{source}: a GLM-ASR encoder needs intermediate_size a multiple of hidden_size (its "
                            "projector's merge) and as many key/value heads as heads", ErrorKind.UNSUPPORTED_MODEL)
        rope = a.get("rope_parameters") or a.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise CoreError(f"{source}: a GLM-ASR encoder rope of type {rope.get('rope_type')!r} is not supported",
                            ErrorKind.UNSUPPORTED_MODEL)
        head = d // heads_n
        theta = float(rope.get("rope_theta", a.get("rope_theta", 10000.0)))
        shape = dict(scale_factor=ffn_width // d, rope_theta=theta,
                     rotary_dim=int(head * float(rope.get("partial_rotary_factor",
                                                          a.get("partial_rotary_factor", 0.5)))),
                     position_table=int(a.get("max_position_embeddings", 1500)))
    if family == "qwen3_asr":
        shape = _qwen3_asr_shape(a, int(t["hidden_size"]), source)
    return VisionConfig(
        family=family, hidden_size=d, intermediate_size=int(a.get(ffn, 5120)),
        num_layers=int(a.get(layers, 32)), num_heads=heads_n,
        patch_size=1, image_size=0, layer_norm_eps=1e-5, hidden_act=act, text_hidden_size=int(t["hidden_size"]),
        image_token_id=int(token), projector_bias=bool(hf.get("projector_bias", True)),
        mel_bins=int(a.get("num_mel_bins", 128)), **shape)


def _qwen3_asr_shape(a: dict[str, Any], text_hidden: int, source: str) -> dict[str, Any]:
    """Qwen3-ASR's encoder settings beyond Whisper's: chunks of 2 n_window frames through three stride-2
    convolutions of downsample_hidden_size channels, each chunk's rows taking sinusoid positions 0, 1, ... (a table
    of max_position_embeddings rows), attention within windows of n_window_infer frames' rows, and the projector's
    output_dim (the decoder's width)."""
    chunk, window = 2 * int(a.get("n_window", 50)), int(a.get("n_window_infer", 800))
    positions, out = int(a.get("max_position_embeddings", 13)), int(a.get("output_dim", text_hidden))
    if chunk <= 0 or window <= 0 or window % chunk:
        raise CoreError(f"{source}: a Qwen3-ASR encoder's n_window_infer ({window}) must be a whole number of its "
                        f"chunks (2 x n_window: {chunk})", ErrorKind.UNSUPPORTED_MODEL)
    from flared.frontend.audio import Qwen3AsrProcessor

    rows = Qwen3AsrProcessor.chunk_rows(chunk)
    if positions < rows or out != text_hidden:
        raise CoreError(f"{source}: a Qwen3-ASR encoder needs a position row for each of a chunk's {rows} rows (it "
                        f"has {positions}) and an output_dim of the decoder's width {text_hidden} (it has {out})",
                        ErrorKind.UNSUPPORTED_MODEL)
    return dict(scale_factor=1, position_table=positions, conv_channels=(int(a.get("downsample_hidden_size", 480)),),
                chunk_frames=chunk, window_chunks=window // chunk)


def gemma4_audio_from_hf(hf: dict[str, Any], source: str) -> VisionConfig | None:
    """Gemma 4's audio tower (its ``audio_config``: transformers' defaults are E2B's, 12 conformer layers of 1024,
    two convolutions of 128 and 32 channels, attention in blocks of 12 rows seeing 12 back) and its projection, as a
    VisionConfig of family gemma4_audio; None for a checkpoint without one (26B-A4B, 31B)."""
    a, t = hf.get("audio_config"), hf.get("text_config")
    if a is None:
        return None
    if not isinstance(a, dict) or not isinstance(t, dict):
        raise CoreError(f"{source}: a gemma4 audio_config must be an object", ErrorKind.SOURCE_FORMAT)
    if a.get("model_type", "gemma4_audio") != "gemma4_audio":
        raise CoreError(f"{source}: an audio tower of type {a.get('model_type')!r} is not supported",
                        ErrorKind.UNSUPPORTED_MODEL)
    act = str(a.get("hidden_act", "silu"))
    if act != "silu":
        raise CoreError(f"{source}: Gemma 4 audio activation {act!r} is not supported (silu)",
                        ErrorKind.UNSUPPORTED_MODEL)
    d, heads = int(a.get("hidden_size", 1024)), int(a.get("num_attention_heads", 8))
    channels = tuple(int(x) for x in a.get("subsampling_conv_channels", (128, 32)))
    if len(channels) != 2 or d % heads:
        raise CoreError(f"{source}: a Gemma 4 audio tower needs two subsampling convolutions and a width that its "
                        "heads divide", ErrorKind.UNSUPPORTED_MODEL)
    try:
        return VisionConfig(
            family="gemma4_audio", hidden_size=d, intermediate_size=4 * d,
            num_layers=int(a.get("num_hidden_layers", 12)), num_heads=heads, patch_size=1, image_size=0,
            layer_norm_eps=float(a.get("rms_norm_eps", 1e-6)), hidden_act=act, scale_factor=4,
            text_hidden_size=int(t["hidden_size"]), image_token_id=int(hf.get("audio_token_id", 258881)),
            mel_bins=128, conv_channels=channels, conv_kernel=int(a.get("conv_kernel_size", 5)),
            attention_chunk=int(a.get("attention_chunk_size", 12)),
            context_left=int(a.get("attention_context_left", 13)),
            context_right=int(a.get("attention_context_right", 0)),
            logit_cap=float(a.get("attention_logit_cap", 50.0)), residual_weight=float(a.get("residual_weight", 0.5)),
            clip_value=float(a.get("gradient_clipping", 1e10)), output_dims=int(a.get("output_proj_dims", 1536)),
            clipped_linears=bool(a.get("use_clipped_linears", True)),
            projector_eps=float(a.get("rms_norm_eps", 1e-6)), pad_token_id=int(t.get("pad_token_id") or 0))
    except (KeyError, TypeError, ValueError) as exc:
        raise CoreError(f"{source}: bad gemma4 audio value: {exc}", ErrorKind.SOURCE_FORMAT) from None


_GEMMA4_AUDIO_PRODUCTS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                          "o": "self_attn.post", "ff1_in": "feed_forward1.ffw_layer_1",
                          "ff1_out": "feed_forward1.ffw_layer_2", "ff2_in": "feed_forward2.ffw_layer_1",
                          "ff2_out": "feed_forward2.ffw_layer_2", "conv_in": "lconv1d.linear_start",
                          "conv_out": "lconv1d.linear_end"}
_GEMMA4_AUDIO_TENSORS = {"rel_k.weight": "self_attn.relative_k_proj.weight", "scale": "self_attn.per_dim_scale",
                         "ff1_pre.weight": "feed_forward1.pre_layer_norm.weight",
                         "ff1_post.weight": "feed_forward1.post_layer_norm.weight",
                         "ff2_pre.weight": "feed_forward2.pre_layer_norm.weight",
                         "ff2_post.weight": "feed_forward2.post_layer_norm.weight",
                         "conv_pre.weight": "lconv1d.pre_layer_norm.weight",
                         "conv_norm.weight": "lconv1d.conv_norm.weight",
                         "conv.weight": "lconv1d.depthwise_conv1d.weight", "attn_pre.weight": "norm_pre_attn.weight",
                         "attn_post.weight": "norm_post_attn.weight", "out_norm.weight": "norm_out.weight"}


def _gemma4_audio_shapes(c: VisionConfig) -> dict[str, tuple[int, ...]]:
    d, (c0, c1) = c.hidden_size, c.conv_channels
    shapes = {"sub0.weight": (c0, 1, 3, 3), "sub0_norm.weight": (c0,), "sub1.weight": (c1, c0, 3, 3),
              "sub1_norm.weight": (c1,), "sub_proj.weight": (d, (c.mel_bins // 4) * c1),
              "out.weight": (c.output_dims, d), "out.bias": (c.output_dims,), "proj.weight": (c.text_hidden_size,
                                                                                              c.output_dims)}
    sizes = {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d), "ff1_in": (4 * d, d), "ff1_out": (d, 4 * d),
             "ff2_in": (4 * d, d), "ff2_out": (d, 4 * d), "conv_in": (2 * d, d), "conv_out": (d, d)}
    for n in range(c.num_layers):
        p = f"layers.{n}."
        clipped_product_shapes(shapes, p, sizes, clipped=c.clipped_linears)
        for name in _GEMMA4_AUDIO_TENSORS:
            shapes[p + name] = {"rel_k.weight": (d, d), "scale": (d // c.num_heads,),
                                "conv.weight": (d, 1, c.conv_kernel)}.get(name, (d,))
    return shapes


def audio_tensor_shapes(c: VisionConfig) -> dict[str, tuple[int, ...]]:
    if c.family == "gemma4_audio":
        return _gemma4_audio_shapes(c)
    d, h = c.hidden_size, c.text_hidden_size
    shapes = {"conv1.weight": (d, c.mel_bins, 3), "conv1.bias": (d,), "conv2.weight": (d, d, 3), "conv2.bias": (d,),
              "pos_embed.weight": (c.position_table, d), "post_norm.weight": (d,), "post_norm.bias": (d,),
              **_vit_layer_shapes(c)}
    if c.family == "qwen2_audio":
        return {**shapes, "proj.weight": (h, d), "proj.bias": (h,)}
    if c.family == "qwen3_asr":  # (three 2D convolutions, sinusoid positions; no pos_embed; a two-linear projector)
        (ch,) = c.conv_channels
        del shapes["pos_embed.weight"]
        for name in ("conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias"):
            del shapes[name]
        freq = c.mel_bins
        for _ in range(3):
            freq = (freq + 1) // 2
        return {**shapes, "conv0.weight": (ch, 1, 3, 3), "conv0.bias": (ch,), "conv1.weight": (ch, ch, 3, 3),
                "conv1.bias": (ch,), "conv2.weight": (ch, ch, 3, 3), "conv2.bias": (ch,),
                "conv_out.weight": (d, ch * freq), "proj_fc1.weight": (d, d), "proj_fc1.bias": (d,),
                "proj_fc2.weight": (h, d), "proj_fc2.bias": (h,)}
    if c.family == "glmasr":  # (no position rows; the projector over each scale_factor rows side by side)
        del shapes["pos_embed.weight"]
        return {**shapes, "proj_fc1.weight": (2 * h, d * c.scale_factor), "proj_fc1.bias": (2 * h,),
                "proj_fc2.weight": (h, 2 * h), "proj_fc2.bias": (h,)}
    shapes.update({"proj_fc1.weight": (h, d), "proj_fc2.weight": (h, h)})
    if c.projector_bias:
        shapes.update({"proj_fc1.bias": (h,), "proj_fc2.bias": (h,)})
    return shapes


def audio_to_serving(hf, c: VisionConfig, take) -> dict[str, torch.Tensor]:
    """The encoder's and projector's tensors out of a checkpoint: ``audio_tower.*`` and
    ``multi_modal_projector.*`` (``linear``; ``linear_1``, ``linear_2``) as released (transformers 5 saves them so
    too), or under ``model.``; Gemma 4's ``model.audio_tower.*`` and ``model.embed_audio.*``."""
    if c.family == "gemma4_audio":
        return _gemma4_audio_to_serving(hf, c, take)
    if c.family == "qwen3_asr":
        return _qwen3_asr_to_serving(hf, c, take)
    prefix = "model." if "model.audio_tower.conv1.weight" in hf else ""
    at, mp = prefix + "audio_tower.", prefix + "multi_modal_projector."
    out = {"conv1.weight": take(at + "conv1.weight"), "conv1.bias": take(at + "conv1.bias"),
           "conv2.weight": take(at + "conv2.weight"), "conv2.bias": take(at + "conv2.bias")}
    if c.family == "glmasr":
        out.update({"post_norm.weight": take(at + "norm.weight"), "post_norm.bias": take(at + "norm.bias")})
        names = (("o", "self_attn.o_proj"), ("norm1", "input_layernorm"), ("norm2", "post_attention_layernorm"),
                 ("fc1", "mlp.fc1"), ("fc2", "mlp.fc2"))
    else:
        out.update({"pos_embed.weight": take(at + "embed_positions.weight"),
                    "post_norm.weight": take(at + "layer_norm.weight"), "post_norm.bias": take(at + "layer_norm.bias")})
        names = (("o", "self_attn.out_proj"), ("norm1", "self_attn_layer_norm"), ("norm2", "final_layer_norm"),
                 ("fc1", "fc1"), ("fc2", "fc2"))
    if c.family == "qwen2_audio":
        out.update({"proj.weight": take(mp + "linear.weight"), "proj.bias": take(mp + "linear.bias")})
    else:
        for ours, theirs in (("proj_fc1", "linear_1"), ("proj_fc2", "linear_2")):
            out[ours + ".weight"] = take(f"{mp}{theirs}.weight")
            if c.projector_bias:
                out[ours + ".bias"] = take(f"{mp}{theirs}.bias")
    for n in range(c.num_layers):
        hp, sp = f"{at}layers.{n}.", f"layers.{n}."
        attn = hp + "self_attn."
        q_bias = take(attn + "q_proj.bias")
        out[sp + "qkv.weight"] = torch.cat([take(f"{attn}{x}_proj.weight") for x in "qkv"])
        out[sp + "qkv.bias"] = torch.cat([q_bias, torch.zeros_like(q_bias), take(attn + "v_proj.bias")])
        for ours, theirs in names:
            for kind in ("weight", "bias"):
                out[f"{sp}{ours}.{kind}"] = take(f"{hp}{theirs}.{kind}")
    return out


def _qwen3_asr_to_serving(hf, c: VisionConfig, take) -> dict[str, torch.Tensor]:
    """Qwen3-ASR's encoder and projector: transformers' (``audio_tower.*``, ``multi_modal_projector.linear_1/2``,
    under ``model.`` as transformers 5 saves them) or the released checkpoints' (``thinker.audio_tower.*`` with the
    projector inside it as ``proj1`` / ``proj2``)."""
    at = next((p for p in ("model.audio_tower.", "audio_tower.", "thinker.audio_tower.")
               if p + "conv_out.weight" in hf), "audio_tower.")
    if at.startswith("thinker."):
        projector = (at + "proj1", at + "proj2")
    else:
        mp = at.replace("audio_tower.", "multi_modal_projector.")
        projector = (mp + "linear_1", mp + "linear_2")
    out = {"conv_out.weight": take(at + "conv_out.weight"), "post_norm.weight": take(at + "ln_post.weight"),
           "post_norm.bias": take(at + "ln_post.bias")}
    for n in range(3):
        for kind in ("weight", "bias"):
            out[f"conv{n}.{kind}"] = take(f"{at}conv2d{n + 1}.{kind}")
    for ours, theirs in zip(("proj_fc1", "proj_fc2"), projector):
        for kind in ("weight", "bias"):
            out[f"{ours}.{kind}"] = take(f"{theirs}.{kind}")
    for n in range(c.num_layers):
        hp, sp = f"{at}layers.{n}.", f"layers.{n}."
        attn = hp + "self_attn."
        out[sp + "qkv.weight"] = torch.cat([take(f"{attn}{x}_proj.weight") for x in "qkv"])
        out[sp + "qkv.bias"] = torch.cat([take(f"{attn}{x}_proj.bias") for x in "qkv"])  # (k has its own)
        for ours, theirs in (("o", "self_attn.out_proj"), ("norm1", "self_attn_layer_norm"),
                             ("norm2", "final_layer_norm"), ("fc1", "fc1"), ("fc2", "fc2")):
            for kind in ("weight", "bias"):
                out[f"{sp}{ours}.{kind}"] = take(f"{hp}{theirs}.{kind}")
    return out


def _gemma4_audio_to_serving(hf, c: VisionConfig, take) -> dict[str, torch.Tensor]:
    at = "model.audio_tower." if "model.audio_tower.output_proj.weight" in hf else "audio_tower."
    ea = ("model." if at.startswith("model.") else "") + "embed_audio."
    sub = at + "subsample_conv_projection."
    out = {"sub0.weight": take(sub + "layer0.conv.weight"), "sub0_norm.weight": take(sub + "layer0.norm.weight"),
           "sub1.weight": take(sub + "layer1.conv.weight"), "sub1_norm.weight": take(sub + "layer1.norm.weight"),
           "sub_proj.weight": take(sub + "input_proj_linear.weight"), "out.weight": take(at + "output_proj.weight"),
           "out.bias": take(at + "output_proj.bias"), "proj.weight": take(ea + "embedding_projection.weight")}
    for n in range(c.num_layers):
        p, q = f"layers.{n}.", f"{at}layers.{n}."
        clipped_products(take, out, p, q, _GEMMA4_AUDIO_PRODUCTS, weight=".linear.weight", clipped=c.clipped_linears)
        for name, theirs in _GEMMA4_AUDIO_TENSORS.items():
            out[p + name] = take(q + theirs)
        # (kept as the attention uses it, softplus(per_dim_scale): llama.cpp's converter stores it so too)
        out[p + "scale"] = F.softplus(out[p + "scale"].float()).to(out[p + "scale"].dtype)
    return out


class WhisperAudioEncoder(_Tower):
    """A Whisper-style encoder and its projector on one device: ``stages(features [mel, F], grid=(T, W, 1))`` ->
    the clip's rows, a generator that yields after every layer. The features hold W windows: W - 1 whole ones
    (2 x positions frames each) and the last, whose T valid encoder rows give (T - k) // k + 1 of the clip's last
    rows, k the rows a token (``scale_factor``: Whisper's average pool of 2, GLM-ASR's merge of 4); none where
    T < k (a window of a few frames past the last whole one)."""

    @torch.inference_mode()
    def stages(self, pixel_values: torch.Tensor, *, grid=None):
        c = self.config
        if grid is None or pixel_values.ndim != 2 or pixel_values.shape[0] != c.mel_bins:
            raise ValueError(f"an audio encoder takes one clip's [{c.mel_bins}, frames] features and its length, got "
                             f"{tuple(pixel_values.shape)}")
        last, windows = int(grid[0]), int(grid[1])
        whole = 2 * c.position_table
        if (windows < 1 or not 1 <= last <= c.position_table
                or pixel_values.shape[1] < whole * (windows - 1) + min(2 * last, whole)):
            raise ValueError(f"{pixel_values.shape[1]} frames cannot give {windows} windows of encoder rows")
        parts = []
        for k in range(windows):
            rows = c.position_table if k < windows - 1 else last
            if rows >= c.scale_factor:  # (else the window's rows make no token)
                frames = pixel_values[:, k * whole:(k + 1) * whole]
                parts.append((yield from self._window(frames, rows)))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _window(self, features: torch.Tensor, rows: int):
        c, w = self.config, self.w
        x = features.to(self.device, self.dtype)[None]
        x = F.gelu(F.conv1d(x, w["conv1.weight"], w["conv1.bias"], padding=1))
        x = F.gelu(F.conv1d(x, w["conv2.weight"], w["conv2.bias"], stride=2, padding=1))
        if c.family == "glmasr":
            return (yield from self._glm_window(x[0].T, rows))
        h = (x[0, :, :rows].T + w["pos_embed.weight"][:rows])[None]  # [1, T, D]
        for i in range(c.num_layers):
            h = _vit_layer(h, w, f"layers.{i}.", c)
            yield
        h = F.avg_pool1d(h.transpose(1, 2), kernel_size=2, stride=2).transpose(1, 2)[0]  # [T // 2, D]
        h = F.layer_norm(h, (c.hidden_size,), w["post_norm.weight"], w["post_norm.bias"], c.layer_norm_eps)
        if c.family == "qwen2_audio":
            return F.linear(h, w["proj.weight"], w["proj.bias"])
        h = F.gelu(F.linear(h, w["proj_fc1.weight"], w.get("proj_fc1.bias")))
        return F.linear(h, w["proj_fc2.weight"], w.get("proj_fc2.bias"))

    def _glm_window(self, h: torch.Tensor, rows: int):
        """GLM-ASR's layers over a whole window's rows ``h`` [T, D] (its padding's too), its final norm, and each
        scale_factor rows side by side through the projector: the first (rows - k) // k + 1 of them."""
        c, w = self.config, self.w
        n, d = h.shape
        heads, head = c.num_heads, c.hidden_size // c.num_heads
        half = c.rotary_dim // 2
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.rotary_dim, 2, dtype=torch.int64, device=self.device).float()
                                      / c.rotary_dim))
        freqs = torch.arange(n, device=self.device, dtype=torch.float32)[:, None] * inv[None]
        cos, sin = (torch.cat([f, f], -1).to(self.dtype) for f in (freqs.cos(), freqs.sin()))  # [T, rotary_dim]

        def turn(x):  # [heads, T, head]: the leading rotary_dim dims turned (rotate-half), the rest as they are
            r, rest = x[..., :c.rotary_dim], x[..., c.rotary_dim:]
            rotated = torch.cat([-r[..., half:], r[..., :half]], -1)
            return torch.cat([r * cos + rotated * sin, rest], -1)

        for i in range(c.num_layers):
            p = f"layers.{i}."
            x1 = F.layer_norm(h, (d,), w[p + "norm1.weight"], w[p + "norm1.bias"], c.layer_norm_eps)
            q, k, v = F.linear(x1, w[p + "qkv.weight"], w[p + "qkv.bias"]).view(n, 3, heads, head).permute(1, 2, 0, 3)
            attn = F.scaled_dot_product_attention(turn(q)[None], turn(k)[None], v[None])[0]
            h = h + F.linear(attn.transpose(0, 1).reshape(n, d), w[p + "o.weight"], w[p + "o.bias"])
            x2 = F.layer_norm(h, (d,), w[p + "norm2.weight"], w[p + "norm2.bias"], c.layer_norm_eps)
            h = h + F.linear(F.gelu(F.linear(x2, w[p + "fc1.weight"], w[p + "fc1.bias"])), w[p + "fc2.weight"],
                             w[p + "fc2.bias"])
            yield
        h = F.layer_norm(h, (d,), w["post_norm.weight"], w["post_norm.bias"], c.layer_norm_eps)
        k = c.scale_factor
        tokens = (rows - k) // k + 1
        h = h[:n // k * k].reshape(n // k, k * d)[:tokens]
        h = F.gelu(F.linear(h, w["proj_fc1.weight"], w["proj_fc1.bias"]))
        return F.linear(h, w["proj_fc2.weight"], w["proj_fc2.bias"])


def sinusoid_positions(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """[length, channels] float32: Whisper's sinusoid position rows (sines, then cosines), computed as transformers'
    SinusoidsPositionEmbedding does (Qwen3-Omni's and Qwen3-ASR's audio encoders)."""
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-increment * torch.arange(channels // 2).float())
    scaled = torch.arange(length)[:, None] * inv[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)


class Qwen3AsrAudioEncoder(_Tower):
    """Qwen3-ASR's audio encoder (Qwen3-Omni's AuT) and its projector: ``stages(features [mel, chunks x C],
    grid=(frames, chunks, 1))`` -> the clip's rows.

    Each chunk of C frames (2 n_window, one second) runs alone through three 3 x 3 stride-2 convolutions over
    (mel, time) with GELU, its (channels x mel / 8) columns a row through conv_out, plus the sinusoid position rows
    0..R-1 (R = 13 for C = 100); the clip's valid rows (R a whole chunk, fewer for the last) in order run through
    Whisper-style layers whose attention stays within windows of window_chunks chunks' rows (n_window_infer
    frames: 104 rows, 8 s), then a LayerNorm and the projector (two linears, GELU between). The last chunk is
    zero-padded to C frames, as transformers pads it, so its convolutions read what transformers' read."""

    def __init__(self, config: VisionConfig, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        super().__init__(config, tensors, dtype=dtype, device=device)
        self.positions = sinusoid_positions(config.position_table, config.hidden_size).to(self.device, dtype)

    @torch.inference_mode()
    def stages(self, pixel_values: torch.Tensor, *, grid=None):
        from flared.frontend.audio import Qwen3AsrProcessor

        c, w = self.config, self.w
        chunk = c.chunk_frames
        if grid is None or pixel_values.ndim != 2 or pixel_values.shape[0] != c.mel_bins:
            raise ValueError(f"an audio encoder takes one clip's [{c.mel_bins}, frames] features and its length, got "
                             f"{tuple(pixel_values.shape)}")
        frames, chunks = int(grid[0]), int(grid[1])
        if chunks < 1 or pixel_values.shape[1] != chunks * chunk or not (chunks - 1) * chunk < frames <= chunks * chunk:
            raise ValueError(f"{pixel_values.shape[1]} feature frames cannot hold {frames} frames in {chunks} chunks")
        x = pixel_values.to(self.device, self.dtype).view(c.mel_bins, chunks, chunk).permute(1, 0, 2)[:, None]
        for n in range(3):
            x = F.gelu(F.conv2d(x, w[f"conv{n}.weight"], w[f"conv{n}.bias"], stride=2, padding=1))
        _, channels, freq, rows = x.shape  # [chunks, channels, mel / 8, R]
        # (made contiguous first: a linear over the permuted view would run as a batched matmul, copying the weight)
        x = F.linear(x.permute(0, 3, 1, 2).contiguous().view(chunks * rows, channels * freq), w["conv_out.weight"])
        x = x.view(chunks, rows, c.hidden_size)
        x = x + self.positions[:rows]
        last = Qwen3AsrProcessor.chunk_rows(frames - (chunks - 1) * chunk)
        h = torch.cat([x[:-1].reshape(-1, c.hidden_size), x[-1, :last]])  # [T, D]: the valid rows in order
        window = rows * c.window_chunks
        for i in range(c.num_layers):
            h = self._layer(h, f"layers.{i}.", window)
            yield
        h = F.layer_norm(h, (c.hidden_size,), w["post_norm.weight"], w["post_norm.bias"], c.layer_norm_eps)
        h = F.gelu(F.linear(h, w["proj_fc1.weight"], w["proj_fc1.bias"]))
        return F.linear(h, w["proj_fc2.weight"], w["proj_fc2.bias"])

    def _layer(self, h: torch.Tensor, p: str, window: int) -> torch.Tensor:
        """One pre-LayerNorm layer over the clip's rows [T, D], its attention within each ``window`` rows (the
        whole windows as one batch, the last partial one apart); the products run over all rows at once."""
        c, w = self.config, self.w
        n, d = h.shape
        heads = c.num_heads
        x1 = F.layer_norm(h, (d,), w[p + "norm1.weight"], w[p + "norm1.bias"], c.layer_norm_eps)
        qkv = F.linear(x1, w[p + "qkv.weight"], w[p + "qkv.bias"])  # [T, 3 D]
        whole = n // window * window
        parts = []
        for start, end, size in ((0, whole, window), (whole, n, n - whole)):
            if end > start:
                q, k, v = qkv[start:end].view(-1, size, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
                parts.append(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(end - start, d))
        attn = torch.cat(parts) if len(parts) > 1 else parts[0]
        h = h + F.linear(attn, w[p + "o.weight"], w[p + "o.bias"])
        x2 = F.layer_norm(h, (d,), w[p + "norm2.weight"], w[p + "norm2.bias"], c.layer_norm_eps)
        return h + F.linear(F.gelu(F.linear(x2, w[p + "fc1.weight"], w[p + "fc1.bias"])), w[p + "fc2.weight"],
                            w[p + "fc2.bias"])


class Gemma4AudioEncoder(Gemma4Tower):
    """Gemma 4's audio tower (Google's Universal Speech Model conformer) and its projection: a clip's log-mel
    frames [F, mel] -> its rows [ceil(ceil(F / 2) / 2), hidden]. Two 3 x 3 stride-2 convolutions over (time, mel),
    each LayerNormed (no bias) and ReLU'd, their channels x mel / 4 through a linear; then conformer layers:

        x = ff1(x)                 x + 0.5 * RMSNorm(W2 silu(W1 RMSNorm(x)))
        x = x + RMSNorm(attn(RMSNorm(x)))     blocks of ``attention_chunk`` rows, each row seeing itself and the
                                              context_left - 2 rows before it, with Transformer-XL relative
                                              positions (a sinusoid of distance through rel_k), q scaled by
                                              softplus(per_dim_scale) / (sqrt(d) ln 2), k by ln(1 + e) / ln 2,
                                              scores soft-capped, all in float32
        x = x + W_out silu(RMSNorm(causal depthwise conv(glu(W_in RMSNorm(x)))))
        x = ff2(x); x = RMSNorm(x)

    the output projection (biased), then a weightless RMSNorm and the projection into the decoder. Products clamp
    their inputs and outputs to the checkpoint's bounds (use_clipped_linears); the branches are clamped at
    gradient_clipping. RMSNorms are Gemma 4's (float32, the weight as it is). The clip's frames only: the padding
    transformers adds reads as zeros in the convolutions and is masked out of attention, which gives the same rows
    (``grid``: (frames, 1, 1))."""

    def __init__(self, config: VisionConfig, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        super().__init__(config, tensors, dtype=dtype, device=device)
        c = config
        context = c.attention_chunk + c.context_left - 1 + c.context_right
        half = c.hidden_size // 2
        inv = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000.0) / max(half - 1, 1)))
        distance = torch.arange(context // 2, -1, -1, dtype=torch.float32)[:, None] * inv[None]
        self.rel_pos = torch.cat([distance.sin(), distance.cos()], -1).to(self.device, self.dtype)  # [ctx/2 + 1, D]

    def _clamp(self, x: torch.Tensor) -> torch.Tensor:
        limit = min(self.config.clip_value, torch.finfo(x.dtype).max)
        return x.clamp(-limit, limit)

    @torch.inference_mode()
    def stages(self, pixel_values: torch.Tensor, *, grid=None):
        c, w = self.config, self.w
        if pixel_values.ndim != 2 or pixel_values.shape[1] != c.mel_bins or pixel_values.shape[0] < 1:
            raise ValueError(f"a Gemma 4 audio tower takes one clip's [frames, {c.mel_bins}] features, got "
                             f"{tuple(pixel_values.shape)}")
        x = pixel_values.to(self.device, self.dtype)[None, None]  # [1, 1, F, mel]
        for i in (0, 1):
            x = F.conv2d(x, w[f"sub{i}.weight"], stride=2, padding=1)
            x = F.layer_norm(x.permute(0, 2, 3, 1), (x.shape[1],), w[f"sub{i}_norm.weight"], None, c.layer_norm_eps)
            x = F.relu(x).permute(0, 3, 1, 2)
        h = F.linear(x.permute(0, 2, 3, 1).reshape(x.shape[2], -1), w["sub_proj.weight"])  # [T, D]
        allowed = self._blocked_mask(h.shape[0])
        for i in range(c.num_layers):
            h = self._layer(h, f"layers.{i}.", allowed)
            yield
        h = F.linear(h, w["out.weight"], w["out.bias"])
        return F.linear(self._norm(h, None, c.projector_eps), w["proj.weight"])

    def _feed_forward(self, h: torch.Tensor, p: str) -> torch.Tensor:
        w = self.w
        x = self._norm(self._clamp(h), w[p + "_pre.weight"], 1e-6)
        x = self._product(F.silu(self._product(x, p + "_in.weight")), p + "_out.weight")
        return h + self._norm(self._clamp(x), w[p + "_post.weight"], 1e-6) * self.config.residual_weight

    def _blocked_mask(self, n: int) -> torch.Tensor:
        """[blocks, chunk, context] True where a row (block b, row r) sees a key of its block's context: a key of
        the clip, itself or up to context_left - 2 rows before it, or fewer than context_right after it."""
        c = self.config
        chunk, back = c.attention_chunk, c.context_left - 1
        context = chunk + back + c.context_right
        blocks = -(-n // chunk)
        row = torch.arange(blocks * chunk, device=self.device).view(blocks, chunk, 1)
        key = (torch.arange(blocks, device=self.device) * chunk - back).view(blocks, 1, 1) + torch.arange(
            context, device=self.device).view(1, 1, context)
        distance = row - key
        return (key >= 0) & (key < n) & (((distance >= 0) & (distance < back))
                                         | ((distance < 0) & (-distance < c.context_right)))

    def _layer(self, h: torch.Tensor, p: str, allowed: torch.Tensor) -> torch.Tensor:
        c, w = self.config, self.w
        h = self._feed_forward(h, p + "ff1")
        x = self._norm(self._clamp(h), w[p + "attn_pre.weight"], 1e-6)
        h = h + self._norm(self._clamp(self._attention(x, p, allowed)), w[p + "attn_post.weight"], 1e-6)
        x = self._norm(h, w[p + "conv_pre.weight"], c.layer_norm_eps)
        x = F.glu(self._product(x, p + "conv_in.weight"), dim=-1)
        x = F.conv1d(F.pad(x.T[None], (c.conv_kernel - 1, 0)), w[p + "conv.weight"], groups=c.hidden_size)[0].T
        x = self._norm(self._clamp(x), w[p + "conv_norm.weight"], c.layer_norm_eps)
        h = h + self._product(F.silu(x), p + "conv_out.weight")
        h = self._feed_forward(h, p + "ff2")
        return self._norm(self._clamp(h), w[p + "out_norm.weight"], 1e-6)

    def _attention(self, x: torch.Tensor, p: str, allowed: torch.Tensor) -> torch.Tensor:
        """transformers' Gemma4AudioAttention over one clip's rows [T, D], in its blocks and float32 steps;
        ``allowed``: _blocked_mask's."""
        c, w = self.config, self.w
        n, d = x.shape
        heads, head = c.num_heads, d // c.num_heads
        chunk, back, ahead = c.attention_chunk, c.context_left - 1, c.context_right
        context = chunk + back + ahead
        q = self._product(x, p + "q.weight").float().view(n, heads, head)
        k = self._product(x, p + "k.weight").float().view(n, heads, head)
        v = self._product(x, p + "v.weight").float().view(n, heads, head)
        q = q * ((head ** -0.5) / math.log(2)) * w[p + "scale"].float()  # (softplus(per_dim_scale), stored)
        k = k * (math.log(1 + math.e) / math.log(2))
        blocks = -(-n // chunk)
        qb = F.pad(q, (0, 0, 0, 0, 0, blocks * chunk - n)).view(blocks, chunk, heads, head)

        def windows(t):  # [blocks, context, heads, head]: each block's keys, back rows before to ahead after
            padded = F.pad(t, (0, 0, 0, 0, back, ahead + chunk - 1))
            return padded.unfold(0, context, chunk)[:blocks].permute(0, 3, 1, 2)

        kb, vb = windows(k), windows(v)
        rel = F.linear(self.rel_pos, w[p + "rel_k.weight"]).view(-1, heads, head).float()  # [ctx/2 + 1, H, hd]
        queries = qb.permute(2, 0, 1, 3)  # [H, blocks, chunk, hd]
        ac = queries @ kb.permute(2, 0, 3, 1)  # [H, blocks, chunk, context]
        bd = (queries.reshape(heads, -1, head) @ rel.permute(1, 2, 0)).view(heads, blocks, chunk, -1)
        positions = bd.shape[-1]  # (Transformer-XL's shift: row r's distances to its block's context)
        bd = F.pad(bd, (0, context + 1 - positions)).view(heads, blocks, chunk * (context + 1))
        bd = bd[..., :chunk * context].view(heads, blocks, chunk, context)
        scores = torch.tanh((ac + bd) / c.logit_cap) * c.logit_cap
        scores = scores.masked_fill(~allowed, -1e9)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        out = (probs @ vb.permute(2, 0, 1, 3)).permute(1, 2, 0, 3).reshape(blocks * chunk, d)[:n]
        return self._product(out.to(x.dtype), p + "o.weight")
