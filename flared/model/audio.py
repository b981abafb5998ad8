"""Whisper-style audio encoders (Qwen2-Audio's, Audio Flamingo 3's, GLM-ASR's): a clip's log-mel frames in, decoder
rows out.

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
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from flared.errors import CoreError, ErrorKind
from flared.model.vision import AUDIO_FAMILIES, VisionConfig, _Tower, _vit_layer, _vit_layer_shapes


__all__ = ["AUDIO_FAMILIES", "WhisperAudioEncoder", "audio_from_hf", "audio_tensor_shapes", "audio_to_serving"]
# each family's encoder config: its model_type and its names for the sizes (Qwen2-Audio's are Whisper's)
_ENCODERS = {"qwen2_audio": ("qwen2_audio_encoder", "d_model", "encoder_ffn_dim", "encoder_layers",
                             "encoder_attention_heads"),
             "audioflamingo3": ("audioflamingo3_encoder", "hidden_size", "intermediate_size", "num_hidden_layers",
                                "num_attention_heads"),
             "glmasr": ("glmasr_encoder", "hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads")}
_DEFAULT_TOKENS = {"qwen2_audio": 151646, "audioflamingo3": 151669, "glmasr": 59260}


def audio_from_hf(hf: dict[str, Any], family: str, source: str) -> VisionConfig:
    """The audio encoder a ``qwen2_audio``, ``audioflamingo3`` or ``glmasr`` config.json describes (its
    ``audio_config``; transformers' defaults are Whisper-large-v3's: 128 mel bins, 32 layers of width 1280, 1,500
    positions), as a VisionConfig."""
    a, t = hf.get("audio_config"), hf.get("text_config")
    if not isinstance(a, dict) or not isinstance(t, dict):
        raise CoreError(f"{source}: a {family} config needs audio_config and text_config objects",
                        ErrorKind.SOURCE_FORMAT)
    kind, width, ffn, layers, heads = _ENCODERS[family]
    if a.get("model_type", kind) != kind:
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
    return VisionConfig(
        family=family, hidden_size=d, intermediate_size=int(a.get(ffn, 5120)),
        num_layers=int(a.get(layers, 32)), num_heads=heads_n,
        patch_size=1, image_size=0, layer_norm_eps=1e-5, hidden_act=act, text_hidden_size=int(t["hidden_size"]),
        image_token_id=int(token), projector_bias=bool(hf.get("projector_bias", True)),
        mel_bins=int(a.get("num_mel_bins", 128)), **shape)


def audio_tensor_shapes(c: VisionConfig) -> dict[str, tuple[int, ...]]:
    d, h = c.hidden_size, c.text_hidden_size
    shapes = {"conv1.weight": (d, c.mel_bins, 3), "conv1.bias": (d,), "conv2.weight": (d, d, 3), "conv2.bias": (d,),
              "pos_embed.weight": (c.position_table, d), "post_norm.weight": (d,), "post_norm.bias": (d,),
              **_vit_layer_shapes(c)}
    if c.family == "qwen2_audio":
        return {**shapes, "proj.weight": (h, d), "proj.bias": (h,)}
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
    too), or under ``model.``."""
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
