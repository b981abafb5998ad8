"""Weight loading: Hugging Face directories, GGUF files, serving-layout files.

``read_source(path)`` turns an export source into a ``SourceModel``: a
``ModelConfig`` and CPU tensors already in the *serving layout*, the one
naming the forward reads (``serving_tensor_shapes`` lists it):

    embed.weight                  [vocab, hidden]
    lm_head.weight                [vocab, hidden]      only when embeddings are not tied
    final_norm.weight             [hidden]
    layers.{i}.attn_norm.weight   [hidden]
    layers.{i}.qkv.weight         [q_size + 2 * kv_size, hidden]   q, k, v rows fused
    layers.{i}.qkv.bias           [q_size + 2 * kv_size]           attention_bias only
    layers.{i}.q_norm.weight      [head_dim]                        qk_norm only
    layers.{i}.k_norm.weight      [head_dim]                        qk_norm only
    layers.{i}.o.weight           [hidden, q_size]
    layers.{i}.o.bias             [hidden]                          attention_out_bias only
    layers.{i}.mlp_norm.weight    [hidden]
    layers.{i}.gate_up.weight     [2 * intermediate, hidden]        gate rows, then up rows
    layers.{i}.down.weight        [hidden, intermediate]

A mixture-of-experts layer (``config.num_experts`` E, expert_intermediate_size I) has, for gate_up and down:

    layers.{i}.router.weight              [E, hidden]
    layers.{i}.experts.gate_up.weight     [E, 2 * I, hidden]     each expert's gate rows, then its up rows
    layers.{i}.experts.down.weight        [E, hidden, I]
    layers.{i}.shared.gate_up.weight      [2 * S, hidden]        shared_expert_intermediate_size S > 0 only
    layers.{i}.shared.down.weight         [hidden, S]
    layers.{i}.shared.gate.weight         [1, hidden]            the shared expert's sigmoid gate

Fusing q/k/v and gate/up turns three (two) small matmuls per layer into one,
which is what matters on a CPU at decode batch sizes.

Rules:
- Every problem with a source (missing file, truncated or corrupt tensor file,
  missing tensor, wrong shape, unsupported architecture) is a ``CoreError``
  whose message names the file; nothing is guessed or skipped.
- GGUF tensors are dequantised to float32 by flared/_fast/gguf.pyx (Q4_0 to Q8_0, the k-quants Q2_K to Q6_K,
  BF16: the values of ``gguf.quants.dequantize`` bit for bit) or, for other types, by that function; for
  the llama architecture llama.cpp stored attn_q/attn_k rows permuted for its
  interleaved rope, and we undo that permutation (as transformers' GGUF loader
  does) so the rotate-half rope of the forward applies.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flared.errors import CoreError, ErrorKind
from flared.model.checkpoint_quant import CheckpointQuantization
from flared.model.checkpoint_quant import dequantize as dequantize_checkpoint
from flared.model.checkpoint_quant import parse as parse_checkpoint_quantization
from flared.model.checkpoint_quant import quantization_config_of
from flared.model.config import ModelConfig, alibi_slopes, from_hf_config, yarn_parameters
from flared.model.vision import VisionConfig

try:
    from flared._fast import gguf as _fast_gguf
except ImportError:  # (not built: the gguf package's numpy dequantisers)
    _fast_gguf = None


@dataclass
class SourceModel:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]  # serving layout, CPU tensors
    source_kind: str  # "hf" | "gguf"
    # A vision-language checkpoint's image tower (flared.model.vision): its config and serving-layout tensors.
    vision: VisionConfig | None = None
    vision_tensors: dict[str, torch.Tensor] | None = None
    # A quantised checkpoint's quantization_config (flared.model.checkpoint_quant): its matrices are dequantised here.
    quantization: CheckpointQuantization | None = None
    # An mmproj's image preparation (flared.model.mmproj), as a checkpoint's preprocessor_config.json and
    # processor_config.json would say it; None: read them from the checkpoint directory.
    image_processor: tuple[dict, dict] | None = None
    # A second medium's tower beside the image tower (Gemma 4's audio: flared.model.audio), and its tensors; an
    # mmproj's settings for it as processor_config.json's "feature_extractor" and the processor would say them.
    audio: VisionConfig | None = None
    audio_tensors: dict[str, torch.Tensor] | None = None
    audio_processor: tuple[dict, dict] | None = None


def serving_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the serving layout for ``config`` and its shape."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {
        "embed.weight": (c.vocab_size, c.hidden_size),
        "final_norm.weight": (c.hidden_size,),
    }
    if c.norm_bias:  # (StarCoder2's LayerNorms)
        shapes["final_norm.bias"] = (c.hidden_size,)
    if c.position_embeddings:  # (GPT-2's learned row a position)
        shapes["pos_embed.weight"] = (c.max_position_embeddings, c.hidden_size)
    if c.embedding_layer_norm:  # (BLOOM's LayerNorm of the embeddings)
        shapes.update({"embed_norm.weight": (c.hidden_size,), "embed_norm.bias": (c.hidden_size,)})
    if c.lm_head_bias:  # (Phi-2's)
        shapes["lm_head.bias"] = (c.vocab_size,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    if c.per_layer_input_dim:  # Gemma 4 E2B / E4B: every layer's input from its own table and the embedding
        packed = c.num_layers * c.per_layer_input_dim
        shapes.update({"embed_per_layer.weight": (c.per_layer_vocab, packed),
                       "per_layer_proj.weight": (packed, c.hidden_size),
                       "per_layer_proj_norm.weight": (c.per_layer_input_dim,)})
    linear, mixerless, mlpless = set(c.linear_layers), set(c.mixerless_layers), set(c.mlpless_layers)
    gated = 2 if c.mlp_gated else 1  # (an ungated MLP's gate_up holds the up rows alone)
    for i in range(c.num_layers):
        p = f"layers.{i}."
        kv_heads, head_dim = c.layer_geometry(i)  # (Gemma 4's global layers have their own)
        values = 0 if c.value_from_key and head_dim == c.global_head_dim else kv_heads * head_dim  # (keys as values)
        keys = kv_heads * head_dim
        if c.kv_source(i) is not None:  # (Gemma 4's shared-KV layers: queries alone)
            keys = values = 0
        # q (the output gate's rows after v's), k, v
        qkv_rows = c.num_heads * head_dim * (2 if c.attn_output_gate else 1) + keys + values
        if c.layer_scalars:
            shapes[p + "scalar"] = (1,)
        if c.hidden_act == "xielu" and i not in mlpless:  # (Apertus: alpha_p, alpha_n, beta, eps as trained)
            shapes[p + "xielu"] = (4,)
        if c.per_layer_input_dim:
            shapes.update({p + "per_layer_gate.weight": (c.per_layer_input_dim, c.hidden_size),
                           p + "per_layer_out.weight": (c.hidden_size, c.per_layer_input_dim),
                           p + "per_layer_norm.weight": (c.hidden_size,)})
        post = i in c.post_norm_layers  # (OLMo Hybrid's attention layers: OLMo 2's norms)
        if c.pre_norm and i not in mixerless and not post:
            shapes[p + "attn_norm.weight"] = (c.hidden_size,)
        if i in linear:
            shapes.update(_gated_delta_shapes(c, p))
        if i not in mixerless and (i not in linear or c.parallel_mixers):  # (Falcon-H1's attend beside the mixer)
            if c.kv_lora_rank:  # DeepSeek's latent attention in place of the fused q/k/v
                shapes.update(_latent_attention_shapes(c, p, i))
            else:
                shapes[p + "qkv.weight"] = (qkv_rows, c.hidden_size)
            if c.attention_bias:
                shapes[p + "qkv.bias"] = (qkv_rows,)
            if c.qk_norm and c.qk_layer_norm_per_head:  # (StableLM 2 12B's: a LayerNorm a head)
                shapes[p + "q_norm.weight"] = (c.num_heads, head_dim)
                if keys:
                    shapes[p + "k_norm.weight"] = (c.num_kv_heads, head_dim)
            elif c.qk_norm:  # (OLMo 2's over all heads at once)
                shapes[p + "q_norm.weight"] = (c.q_size if c.qk_norm_whole else head_dim,)
                if keys:
                    shapes[p + "k_norm.weight"] = (c.kv_size if c.qk_norm_whole else head_dim,)
            shapes[p + "o.weight"] = (c.hidden_size, c.num_heads * (c.v_head_dim or head_dim))
            if c.attention_out_bias:
                shapes[p + "o.bias"] = (c.hidden_size,)
            if c.attention_sinks:
                shapes[p + "sinks"] = (c.num_heads,)
        if i in mlpless:
            continue
        if c.pre_norm and (not c.parallel_block or c.parallel_norms) and not post:  # (Cohere's MLP reads
            # attention's normed input; GPT-NeoX's its own norm of the layer's input)
            shapes[p + "mlp_norm.weight"] = (c.hidden_size,)
        if c.sandwich_norm or post:  # Gemma 3: norms after attention and after the MLP too
            shapes[p + "post_attn_norm.weight"] = (c.hidden_size,)
            shapes[p + "post_mlp_norm.weight"] = (c.hidden_size,)
        if c.parallel_experts:  # Gemma 4: the experts' router, scales and norms beside the dense MLP's
            shapes.update({p + "router.weight": (c.num_experts, c.hidden_size), p + "router.scale": (c.hidden_size,),
                           p + "router.expert_scale": (c.num_experts,),
                           p + "experts.gate_up.weight": (c.num_experts, 2 * c.expert_intermediate_size, c.hidden_size),
                           p + "experts.down.weight": (c.num_experts, c.hidden_size, c.expert_intermediate_size),
                           p + "post_mlp_norm_1.weight": (c.hidden_size,), p + "pre_mlp_norm_2.weight": (c.hidden_size,),
                           p + "post_mlp_norm_2.weight": (c.hidden_size,)})
        elif c.num_experts and i not in c.dense_layers:
            e, inter, shared = c.num_experts, c.expert_intermediate_size, c.shared_expert_intermediate_size
            shapes[p + "router.weight"] = (e, c.hidden_size)
            if c.router_sigmoid or c.router_correction_bias:
                shapes[p + "router.correction_bias"] = (e,)
            shapes[p + "experts.gate_up.weight"] = (e, gated * inter, c.hidden_size)
            shapes[p + "experts.down.weight"] = (e, c.hidden_size, inter)
            if c.expert_bias:
                shapes[p + "router.bias"] = (e,)
                shapes[p + "experts.gate_up.bias"] = (e, 2 * inter)
                shapes[p + "experts.down.bias"] = (e, c.hidden_size)
            if shared:
                shapes[p + "shared.gate_up.weight"] = (gated * shared, c.hidden_size)
                shapes[p + "shared.down.weight"] = (c.hidden_size, shared)
                if c.shared_expert_gate:
                    shapes[p + "shared.gate.weight"] = (1, c.hidden_size)
            continue
        shapes[p + "gate_up.weight"] = (gated * c.mlp_width(i), c.hidden_size)
        shapes[p + "down.weight"] = (c.hidden_size, c.mlp_width(i))
        if c.mlp_bias:
            shapes[p + "gate_up.bias"] = (gated * c.mlp_width(i),)
            shapes[p + "down.bias"] = (c.hidden_size,)
    if c.norm_bias:  # (each norm's bias beside its weight)
        shapes.update({name[:-len("weight")] + "bias": shape for name, shape in shapes.items()
                       if name.startswith("layers.") and name.endswith(("attn_norm.weight", "mlp_norm.weight"))
                       and ".post_" not in name})
    return shapes


def _gated_delta_shapes(c: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet layer's tensors: one input projection (q, k, v, the output gate z, the update strengths b and
    the decay inputs a, each head's in order), the causal convolution over q, k and v [channels, kernel], the decay's
    bias and log scale per value head, the gated output norm [value dim] and the output projection."""
    if c.short_conv:  # LFM2's: B, C and x from one projection, the convolution over B * x, o
        return {p + "linear_in.weight": (3 * c.hidden_size, c.hidden_size),
                p + "conv.weight": (c.hidden_size, c.linear_conv_kernel), p + "o.weight": (c.hidden_size, c.hidden_size)}
    value = c.linear_value_heads * c.linear_value_dim
    if c.linear_kind == "kda":  # q, k, v, then b, f_a, g_a in one projection; the convolution over q, k and v; f_b and
        # g_b from f_a's and g_a's head-wide rows; dt_bias, A_log, the gated output norm, o
        heads, head = c.linear_value_heads, c.linear_value_dim
        return {p + "linear_in.weight": (c.linear_conv_dim + heads + 2 * head, c.hidden_size),
                p + "conv.weight": (c.linear_conv_dim, c.linear_conv_kernel), p + "f_b.weight": (value, head),
                p + "g_b.weight": (value, head), p + "dt_bias": (value,), p + "a_log": (heads,),
                p + "linear_norm.weight": (head,), p + "o.weight": (c.hidden_size, value)}
    if c.linear_kind == "mamba1":  # x and z; the convolution over x; B, C and dt's input from x; dt's projection; Jamba's
        # norms on dt, B and C; A [channels, states], D, o
        channels, states, rank = c.linear_value_heads, c.linear_key_dim, c.linear_dt_rank
        shapes = {p + "linear_in.weight": (2 * channels, c.hidden_size), p + "conv.weight": (channels, c.linear_conv_kernel),
                  p + "x_proj.weight": (rank + 2 * states, channels), p + "dt_proj.weight": (channels, rank),
                  p + "dt_bias": (channels,), p + "a_log": (channels, states), p + "d": (channels,),
                  p + "o.weight": (c.hidden_size, channels)}
        if c.linear_norm:  # (Jamba's; Mamba's own mixer has none)
            shapes.update({p + "dt_norm.weight": (rank,), p + "b_norm.weight": (states,), p + "c_norm.weight": (states,)})
        if c.linear_conv_bias:
            shapes[p + "conv.bias"] = (channels,)
        return shapes
    if c.linear_kind == "mamba2":  # z, then x, B, C (convolved), then dt; D and the gated grouped norm
        # (Falcon-H1's mixer beside attention: its output projection linear_o; without linear_norm, no norm)
        shapes = {p + "linear_in.weight": (value + c.linear_conv_dim + c.linear_value_heads, c.hidden_size),
                  p + "conv.weight": (c.linear_conv_dim, c.linear_conv_kernel),
                  p + "dt_bias": (c.linear_value_heads,), p + "a_log": (c.linear_value_heads,),
                  p + "d": (c.linear_value_heads,),
                  p + ("linear_o.weight" if c.parallel_mixers else "o.weight"): (c.hidden_size, value)}
        if c.linear_norm:
            shapes[p + "linear_norm.weight"] = (value,)
        if c.linear_conv_bias:
            shapes[p + "conv.bias"] = (c.linear_conv_dim,)
        return shapes
    return {p + "linear_in.weight": (c.linear_conv_dim + value + 2 * c.linear_value_heads, c.hidden_size),
            p + "conv.weight": (c.linear_conv_dim, c.linear_conv_kernel),
            p + "dt_bias": (c.linear_value_heads,), p + "a_log": (c.linear_value_heads,),
            p + "linear_norm.weight": (c.linear_value_dim,), p + "o.weight": (c.hidden_size, value)}


def _latent_attention_shapes(c: ModelConfig, p: str, layer: int) -> dict[str, tuple[int, ...]]:
    """A latent-attention layer's projections: q (or q_a, its norm and q_b), kv_a (the latent and the shared rotated
    key part), its norm, kv_b (each head's unrotated key part and value from the latent)."""
    shapes = {p + "kv_a.weight": (c.kv_lora_rank + c.rope_dim, c.hidden_size),
              p + "kv_a_norm.weight": (c.kv_lora_rank,),
              p + "kv_b.weight": (c.num_heads * (c.head_dim - c.rope_dim + c.v_head_dim), c.kv_lora_rank)}
    if c.q_lora_rank:
        shapes.update({p + "q_a.weight": (c.q_lora_rank, c.hidden_size), p + "q_a_norm.weight": (c.q_lora_rank,),
                       p + "q_b.weight": (c.q_size, c.q_lora_rank)})
    else:
        shapes[p + "q.weight"] = (c.q_size, c.hidden_size)
    if c.index_topk and layer not in c.index_shared_layers:  # DeepSeek V3.2's indexer: its queries from the
        # bottleneck, its key (LayerNormed), its heads' weights (GLM-5's shared layers: none)
        shapes.update({p + "index_q.weight": (c.index_heads * c.index_head_dim, c.q_lora_rank),
                       p + "index_k.weight": (c.index_head_dim, c.hidden_size),
                       p + "index_k_norm.weight": (c.index_head_dim,), p + "index_k_norm.bias": (c.index_head_dim,),
                       p + "index_weights.weight": (c.index_heads, c.hidden_size)})
    return shapes


def check_serving_tensors(tensors: dict[str, torch.Tensor], config: ModelConfig, *, source: str) -> None:
    """Every serving tensor of ``config`` present at its shape and a floating dtype, and no other; a layer matrix may be
    stored quantised instead (quant.pack_layer_matrices: its tensors at the format's shapes and dtypes)."""
    from flared.model.quant import PACKED_MATRIX, packed_format, packed_shapes

    expected = serving_tensor_shapes(config)
    stored = {}
    for name, shape in list(expected.items()):
        fmt = packed_format(tensors, name) if name not in tensors and PACKED_MATRIX.match(name) else None
        if fmt is None:
            continue
        del expected[name]
        stack, (out_features, in_features) = shape[:-2], shape[-2:]
        for suffix, (part, dtype) in packed_shapes(fmt, out_features, in_features).items():
            key = f"{name}.{suffix}"
            value = tensors.get(key)
            if value is None or tuple(value.shape) != (*stack, *part) or value.dtype != dtype:
                raise CoreError(f"{source}: {name} stored as {fmt} needs {key} {(*stack, *part)} {dtype}, found "
                                f"{'none' if value is None else f'{tuple(value.shape)} {value.dtype}'}")
            stored[key] = True
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected) - set(stored))
    if missing:
        raise CoreError(f"{source}: missing tensors: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    if extra:
        raise CoreError(f"{source}: unexpected tensors: {', '.join(extra[:8])}{' ...' if len(extra) > 8 else ''}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise CoreError(f"{source}: tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape}")
        if not tensors[name].is_floating_point():
            raise CoreError(f"{source}: tensor {name} has dtype {tensors[name].dtype}, expected a floating type")


def read_source(path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                mmproj: str | os.PathLike | None = None) -> SourceModel:
    """Read a Hugging Face checkpoint directory or a ``.gguf`` file. ``dtype``: the dtype the reader's caller will
    serve in; a GGUF's matrices, dequantized to float32 one at a time, are kept in it (an export to bfloat16 then holds
    the model at 2 bytes a weight, not 4), its vectors (norms, biases) in float32; so are a block-scaled fp8
    checkpoint's dequantized matrices (float32 when no dtype is given). ``mmproj``: llama.cpp's image tower for a
    GGUF model (flared.model.mmproj)."""
    p = Path(path)
    if mmproj is not None and not (p.is_file() and p.suffix.lower() == ".gguf"):
        raise CoreError(f"--mmproj goes with a GGUF model ({p} is not a .gguf file): a checkpoint directory holds "
                        "its own image tower", ErrorKind.VALIDATION)
    if p.is_dir():
        return _read_hf_dir(p, dtype)
    if p.is_file() and p.suffix.lower() == ".gguf":
        return _read_gguf(p, dtype, mmproj)
    if not p.exists():
        raise CoreError(f"model source {p} does not exist", ErrorKind.CORE_MISSING)
    raise CoreError(f"model source {p} is neither a checkpoint directory nor a .gguf file", ErrorKind.SOURCE_FORMAT)


def load_serving_tensors(path: str | os.PathLike, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Read a serving-layout safetensors file (``save_file(SourceModel.tensors)``)
    and check every name and shape against ``config``."""
    tensors = _load_safetensors_file(Path(path))
    check_serving_tensors(tensors, config, source=str(path))
    return tensors


# ---------------------------------------------------------------- Hugging Face


def _load_safetensors_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise CoreError(f"tensor file {path} does not exist", ErrorKind.CORE_MISSING)
    try:
        return load_file(str(path), device="cpu")
    except Exception as exc:  # safetensors raises its own error types and OSError/ValueError
        raise CoreError(f"tensor file {path} is not a readable safetensors file: {exc}", ErrorKind.SOURCE_FORMAT) from None


def _read_hf_dir(directory: Path, dtype: torch.dtype | None = None) -> SourceModel:
    config_path = directory / "config.json"
    try:
        hf_config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise CoreError(f"{config_path} does not exist", ErrorKind.CORE_MISSING) from None
    except (OSError, ValueError) as exc:
        raise CoreError(f"{config_path} is not valid JSON: {exc}", ErrorKind.SOURCE_FORMAT) from None
    if not isinstance(hf_config, dict):
        raise CoreError(f"{config_path} is not a JSON object", ErrorKind.SOURCE_FORMAT)
    from flared.model.vision import hf_vision_to_serving, text_config_of, vision_from_hf

    quantization = quantization_config_of(directory, hf_config)  # (or AutoGPTQ's / AutoAWQ's own file beside it)
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    fp8_block = quantization.get("weight_block_size") if method == "fp8" else None
    if fp8_block is not None and not (isinstance(fp8_block, list) and len(fp8_block) == 2 and all(
            isinstance(b, int) and b > 0 for b in fp8_block)):
        raise CoreError(f"{config_path}: quantization_config fp8's weight_block_size {fp8_block!r} is not two "
                        "positive integers", ErrorKind.SOURCE_FORMAT)
    checkpoint_quant = parse_checkpoint_quantization(quantization, str(config_path))  # (GPTQ, AWQ, ...)
    image_processor = None
    if hf_config.get("model_type") == "internvl_chat":  # (InternVL's original remote-code checkpoints)
        hf_config, image_processor = _internvl_chat(hf_config, directory, str(config_path))
    if hf_config.get("model_type") == "qwen3_asr" and "thinker_config" in hf_config:  # (Qwen3-ASR's releases)
        hf_config = _qwen3_asr_thinker(hf_config, str(config_path))
    vision = vision_from_hf(hf_config, source=str(config_path))
    # Gemma 3's vision-language checkpoints (4B and up) serve as their text model: its tower is not read yet
    text_of_multimodal = _TEXT_OF_MULTIMODAL.get(hf_config.get("model_type"))
    if vision is not None:  # the decoder of a vision-language checkpoint is its text config's model
        config = from_hf_config(text_config_of(hf_config), source=f"{config_path} (text_config)")
    elif text_of_multimodal:
        text = {**(hf_config.get("text_config") or {}), "model_type": text_of_multimodal}
        text.setdefault("tie_word_embeddings", bool(hf_config.get("tie_word_embeddings",
                                                                  text_of_multimodal in ("gemma3_text", "gemma4_text"))))
        config = from_hf_config(text, source=f"{config_path} (text_config)")
    else:
        config = from_hf_config(hf_config, source=str(config_path))

    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CoreError(f"{index_path} is not a valid safetensors index: {exc}", ErrorKind.SOURCE_FORMAT) from None
    else:
        files = sorted(f.name for f in directory.glob("*.safetensors"))
    if not files:
        raise CoreError(f"{directory} has no *.safetensors weights (only safetensors checkpoints are read)",
                        ErrorKind.CORE_MISSING)
    hf_tensors: dict[str, torch.Tensor] = {}
    for name in files:
        hf_tensors.update(_load_safetensors_file(directory / name))
    if fp8_block is not None:
        _dequantize_fp8_blocks(hf_tensors, tuple(fp8_block), dtype or torch.float32, source=str(directory))
    if checkpoint_quant is not None:
        dequantize_checkpoint(hf_tensors, checkpoint_quant, dtype or torch.float32, source=str(directory))
    vision_tensors = audio = audio_tensors = None
    if vision is not None and vision.family == "gemma4":  # (E2B's and E4B's audio tower beside the image tower)
        from flared.model.audio import gemma4_audio_from_hf

        audio = gemma4_audio_from_hf(hf_config, str(config_path))
    if vision is not None or text_of_multimodal:
        if vision is not None:
            vision_tensors = hf_vision_to_serving(hf_tensors, vision, source=str(directory))
        if audio is not None:
            audio_tensors = hf_vision_to_serving(hf_tensors, audio, source=str(directory))
        # its decoder's tensors under model.text_model.* (Idefics3) or model.language_model.* (transformers 5's
        # Qwen VL layout; older checkpoints keep model.*), the tower's elsewhere
        renames = {"model.text_model.": "model.", "model.language_model.": "model.",
                   # (transformers 5.17 saves Qwen2-Audio's decoder one model. deeper than the releases)
                   "language_model.model.model.": "model.",
                   "language_model.model.": "model.", "language_model.lm_head.": "lm_head.",  # (Mistral3's)
                   "thinker.model.": "model.", "thinker.lm_head.": "lm_head."}  # (Qwen3-ASR's releases)
        tower = ("model.vision_model.", "model.connector.", "visual.", "model.visual.", "vision_tower.",
                 "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
                 "model.embed_vision.", "model.audio_tower.", "model.embed_audio.",  # (Gemma 4's)
                 "audio_tower.",  # (Qwen2-Audio's, beside its multi_modal_projector.*)
                 "thinker.audio_tower.",  # (Qwen3-ASR's releases: the projector inside it)
                 "vision_model.",  # (Llama 4's; InternVL's original checkpoints' too, and their mlp1.*)
                 "mlp1.",
                 "image_newline", "model.image_newline")  # (LLaVA-NeXT's row-end embedding)
        hf_tensors = {next((new + k[len(old):] for old, new in renames.items() if k.startswith(old)), k): v
                      for k, v in hf_tensors.items() if not k.startswith(tower)}
        if not config.tie_word_embeddings and "lm_head.weight" not in hf_tensors:  # the composite config ties them
            import dataclasses

            config = dataclasses.replace(config, tie_word_embeddings=True)
    tensors = _hf_to_serving(hf_tensors, config, source=str(directory), hf_config=hf_config)
    check_serving_tensors(tensors, config, source=str(directory))
    return SourceModel(config=config, tensors=tensors, source_kind="hf", vision=vision, vision_tensors=vision_tensors,
                       quantization=checkpoint_quant, image_processor=image_processor, audio=audio,
                       audio_tensors=audio_tensors)


def _hf_internlm2_names(hf: dict[str, torch.Tensor], config: ModelConfig, source: str) -> dict[str, torch.Tensor]:
    """InternLM2's tensors under Llama's names: its wqkv split back into q, k and v (each kv head's group of q heads,
    then its k head, then its v head, as InternLM2's attention reads it), wo, w1 (gate), w3 (up), w2 (down), the
    attention_norm / ffn_norm, tok_embeddings and output."""
    if config.attention_bias:
        raise CoreError(f"{source}: InternLM2 with biases (bias: true) is not supported", ErrorKind.UNSUPPORTED_MODEL)
    renames = (("model.tok_embeddings.", "model.embed_tokens."), (".attention.wo.", ".self_attn.o_proj."),
               (".attention_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."),
               (".feed_forward.w1.", ".mlp.gate_proj."), (".feed_forward.w3.", ".mlp.up_proj."),
               (".feed_forward.w2.", ".mlp.down_proj."))
    group = config.num_heads // config.num_kv_heads
    out = {}
    for name, value in hf.items():
        if name == "output.weight":
            out["lm_head.weight"] = value
            continue
        if name.endswith(".attention.wqkv.weight"):
            prefix = name.removesuffix("attention.wqkv.weight") + "self_attn."
            rows = value.view(config.num_kv_heads, group + 2, config.head_dim, value.shape[-1])
            out[prefix + "q_proj.weight"] = rows[:, :group].reshape(-1, value.shape[-1])
            out[prefix + "k_proj.weight"] = rows[:, -2].reshape(-1, value.shape[-1])
            out[prefix + "v_proj.weight"] = rows[:, -1].reshape(-1, value.shape[-1])
            continue
        out[next((name.replace(old, new) for old, new in renames if old in name), name)] = value
    return out


def _qwen3_asr_thinker(hf: dict, source: str) -> dict:
    """A released Qwen3-ASR config (Qwen/Qwen3-ASR-1.7B, -0.6B: the qwen-asr package's, its model under
    ``thinker_config``) as transformers' qwen3_asr config says it: the thinker's audio and text configs at the
    top, the text model a Qwen3 whose multimodal rope is plain rope (an audio token's three positions are equal,
    as a text token's are; transformers' conversion drops it too). Its tensors are ``thinker.*``
    (``thinker.audio_tower.*`` with the projector as ``proj1`` / ``proj2``, ``thinker.model.*``,
    ``thinker.lm_head``)."""
    thinker = hf["thinker_config"]
    if not isinstance(thinker, dict) or not isinstance(thinker.get("text_config"), dict):
        raise CoreError(f"{source}: a qwen3_asr thinker_config needs a text_config object", ErrorKind.SOURCE_FORMAT)
    text = {**thinker["text_config"], "model_type": "qwen3"}
    for key in ("rope_parameters", "rope_scaling"):
        params = text.get(key)
        if isinstance(params, dict) and ("mrope_section" in params or params.get("type") == "mrope"
                                         or params.get("rope_type") == "mrope"):
            params = {k: v for k, v in params.items() if k not in ("mrope_section", "mrope_interleaved",
                                                                  "interleaved", "type")}
            params["rope_type"] = "default"
            text[key] = params
    tie = hf.get("tie_word_embeddings", thinker.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    text.setdefault("tie_word_embeddings", bool(tie))
    out = {k: v for k, v in thinker.items() if k not in ("text_config", "model_type")}
    return {**out, "model_type": "qwen3_asr", "text_config": text, "tie_word_embeddings": bool(tie)}


_IMAGENET_MEAN, _IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def _internvl_chat(hf: dict, directory: Path, source: str) -> tuple[dict, tuple[dict, dict]]:
    """An InternVL original checkpoint's config (model_type internvl_chat: vision_config, llm_config, the tiling
    settings at the top) as transformers' internvl config says it, and its image preparation as a GotOcr2
    preprocessor config would (its own code: 1 to max_dynamic_patch tiles of force_image_size pixels and a
    thumbnail, ImageNet's mean and std). The image token's id comes from its tokenizer (<IMG_CONTEXT>)."""
    v, t = hf.get("vision_config"), hf.get("llm_config")
    if not isinstance(v, dict) or not isinstance(t, dict):
        raise CoreError(f"{source}: an internvl_chat config needs vision_config and llm_config objects",
                        ErrorKind.SOURCE_FORMAT)
    if hf.get("ps_version", "v2") != "v2":
        raise CoreError(f"{source}: ps_version {hf.get('ps_version')!r} (InternVL 1.5's pixel shuffle) is not "
                        "supported (v2)", ErrorKind.UNSUPPORTED_MODEL)
    if v.get("model_type", "intern_vit_6b") != "intern_vit_6b":
        raise CoreError(f"{source}: an internvl_chat vision tower of type {v.get('model_type')!r} is not supported",
                        ErrorKind.UNSUPPORTED_MODEL)
    token = None
    try:
        added = json.loads((directory / "tokenizer.json").read_text()).get("added_tokens", [])
        token = next((a["id"] for a in added if a.get("content") == "<IMG_CONTEXT>"), None)
    except (OSError, ValueError, TypeError, KeyError):
        pass
    if token is None:
        raise CoreError(f"{directory / 'tokenizer.json'}: no <IMG_CONTEXT> token, which InternVL's images stand in "
                        "for", ErrorKind.SOURCE_FORMAT)
    side = int(hf.get("force_image_size") or v.get("image_size", 448))
    vision = {"model_type": "internvl_vision", "hidden_size": v.get("hidden_size", 3200),
              "intermediate_size": v.get("intermediate_size", 12800),
              "num_hidden_layers": v.get("num_hidden_layers", 48),
              "num_attention_heads": v.get("num_attention_heads", 25), "image_size": side,
              "patch_size": v.get("patch_size", 14), "layer_norm_eps": v.get("layer_norm_eps", 1e-6),
              "hidden_act": v.get("hidden_act", "gelu"), "norm_type": v.get("norm_type", "rms_norm"),
              "use_qk_norm": bool(v.get("qk_normalization", False)), "attention_bias": bool(v.get("qkv_bias", True)),
              "use_mean_pooling": True}
    config = {"model_type": "internvl_chat", "vision_config": vision, "text_config": t,
              "downsample_ratio": hf.get("downsample_ratio", 0.5), "image_token_id": token,
              "vision_feature_layer": hf.get("select_layer", -1), "vision_feature_select_strategy": "default",
              "tie_word_embeddings": bool(t.get("tie_word_embeddings", False))}
    dynamic = hf.get("dynamic_image_size", True)
    pre = {"image_processor_type": "GotOcr2ImageProcessor", "size": {"height": side, "width": side},
           "min_patches": int(hf.get("min_dynamic_patch", 1)) if dynamic else 1,
           "max_patches": int(hf.get("max_dynamic_patch", 12)) if dynamic else 1,
           "image_mean": _IMAGENET_MEAN, "image_std": _IMAGENET_STD,
           "use_thumbnail": bool(hf.get("use_thumbnail", True))}
    return config, (pre, {})


def _with_weightless_norms(hf: dict[str, torch.Tensor], config: ModelConfig, *, qk: bool = False) -> dict:
    """``hf`` with ones for the norms a checkpoint without norm weights has none of (OLMo's, nanochat's): the final
    norm, each layer's two, and with ``qk`` its per-head q and k norms; each a tensor of its own (a core's weight
    files hold no shared tensors)."""
    dtype = hf["model.embed_tokens.weight"].dtype
    out = {**hf, "model.norm.weight": torch.ones(config.hidden_size, dtype=dtype)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        for name in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}{name}.weight"] = torch.ones(config.hidden_size, dtype=dtype)
        if qk:
            for name in ("q_norm", "k_norm"):
                out[f"{p}self_attn.{name}.weight"] = torch.ones(config.head_dim, dtype=dtype)
    return out


def _hf_sarvam_names(hf: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Sarvam MoE's and Param2 MoE's tensor names (as their releases and transformers' save write them) as GLM-4.5's:
    word_embeddings, attention.dense, query_layernorm / key_layernorm, the router's expert_bias, and the fused
    query_key_value's rows (q, then k, then v) as q_proj, k_proj and v_proj."""
    out = {}
    q, kv = config.q_size, config.kv_size
    renames = (("model.word_embeddings.", "model.embed_tokens."), (".attention.dense.", ".self_attn.o_proj."),
               (".attention.query_layernorm.", ".self_attn.q_norm."), (".attention.key_layernorm.", ".self_attn.k_norm."),
               (".mlp.gate.expert_bias", ".mlp.gate.e_score_correction_bias"), (".attention.", ".self_attn."))
    for name, value in hf.items():
        if ".attention.query_key_value." in name:
            base, kind = name.split(".attention.query_key_value.")
            if value.shape[0] != q + 2 * kv:
                raise CoreError(f"{name} has {value.shape[0]} rows, not q, k and v's {q + 2 * kv}", ErrorKind.SOURCE_FORMAT)
            for proj, rows in zip(("q_proj", "k_proj", "v_proj"), value.split([q, kv, kv])):
                out[f"{base}.self_attn.{proj}.{kind}"] = rows
            continue
        for old, new in renames:
            if old in name:
                name = name.replace(old, new, 1)
                break
        out[name] = value
    return out


# model_type of a vision-language checkpoint served as its text model -> its text config's model_type
_TEXT_OF_MULTIMODAL = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}


def _dequantize_fp8_blocks(hf: dict[str, torch.Tensor], block: tuple[int, int], dtype: torch.dtype, *,
                           source: str) -> None:
    """A block-scaled fp8 checkpoint's matrices (Qwen3's, DeepSeek V3's, MiniMax-M2's *-FP8 releases: float8 weights,
    each [block] tile times its ``weight_scale_inv``) as ``dtype``, in place, a tensor at a time (the float8 copy
    dropped as its dequantized one lands); the matrices left unquantized pass unchanged."""
    rows_block, cols_block = block
    for name in [n for n in hf if n.endswith(".weight_scale_inv")]:
        scale = hf.pop(name).float()
        weight_name = name[:-len("_scale_inv")]
        weight = hf.get(weight_name)
        if weight is None or weight.dim() != 2 or weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise CoreError(f"{source}: {name} scales no float8 matrix {weight_name}", ErrorKind.SOURCE_FORMAT)
        rows, cols = weight.shape
        if scale.shape != (-(-rows // rows_block), -(-cols // cols_block)):
            raise CoreError(f"{source}: {name} is {tuple(scale.shape)}, not one scale per {list(block)} tile of "
                            f"{weight_name} {tuple(weight.shape)}", ErrorKind.SOURCE_FORMAT)
        tiles = scale.repeat_interleave(rows_block, 0)[:rows].repeat_interleave(cols_block, 1)[:, :cols]
        hf[weight_name] = (weight.float() * tiles).to(dtype)


# Gemma 4 26B-A4B's experts beside its dense MLP: the serving names, and a checkpoint's and llama.cpp's for them
_PARALLEL_EXPERTS = ("router.weight", "router.scale", "router.expert_scale", "experts.gate_up.weight",
                     "experts.down.weight", "post_mlp_norm_1.weight", "pre_mlp_norm_2.weight", "post_mlp_norm_2.weight")
_HF_PARALLEL_EXPERTS = ("router.proj.weight", "router.scale", "router.per_expert_scale", "experts.gate_up_proj",
                        "experts.down_proj", "post_feedforward_layernorm_1.weight",
                        "pre_feedforward_layernorm_2.weight", "post_feedforward_layernorm_2.weight")
_GGUF_PARALLEL_EXPERTS = ("ffn_gate_inp.weight", "ffn_gate_inp.scale", "ffn_down_exps.scale",
                          "ffn_gate_up_exps.weight", "ffn_down_exps.weight", "post_ffw_norm_1.weight",
                          "pre_ffw_norm_2.weight", "post_ffw_norm_2.weight")

# Older families' tensor names as Llama's, applied in order to every name (_hf_legacy_names).
_LEGACY_RENAMES = {
    "falcon": (("transformer.word_embeddings.", "model.embed_tokens."), ("transformer.ln_f.", "model.norm."),
               ("transformer.h.", "model.layers."), (".ln_attn.", ".input_layernorm."),
               (".ln_mlp.", ".post_attention_layernorm."), (".self_attention.dense.", ".self_attn.o_proj."),
               (".mlp.dense_h_to_4h.", ".mlp.up_proj."), (".mlp.dense_4h_to_h.", ".mlp.down_proj.")),
    "bloom": (("transformer.word_embeddings_layernorm.", "model.embed_norm."),
              ("transformer.word_embeddings.", "model.embed_tokens."), ("transformer.ln_f.", "model.norm."),
              ("transformer.h.", "model.layers."), (".self_attention.dense.", ".self_attn.o_proj."),
              (".mlp.dense_h_to_4h.", ".mlp.up_proj."), (".mlp.dense_4h_to_h.", ".mlp.down_proj.")),
    "mpt": (("transformer.wte.", "model.embed_tokens."), ("transformer.norm_f.", "model.norm."),
            ("transformer.blocks.", "model.layers."), (".norm_1.", ".input_layernorm."),
            (".norm_2.", ".post_attention_layernorm."), (".attn.out_proj.", ".self_attn.o_proj."),
            (".ffn.up_proj.", ".mlp.up_proj."), (".ffn.down_proj.", ".mlp.down_proj.")),
    "opt": (("model.decoder.final_layer_norm.", "model.norm."), ("model.decoder.embed_tokens.", "model.embed_tokens."),
            ("model.decoder.embed_positions.", "model.embed_positions."), ("model.decoder.layers.", "model.layers."),
            (".self_attn_layer_norm.", ".input_layernorm."), (".final_layer_norm.", ".post_attention_layernorm."),
            (".self_attn.out_proj.", ".self_attn.o_proj."), (".fc1.", ".mlp.up_proj."), (".fc2.", ".mlp.down_proj.")),
    "gptj": (("transformer.wte.", "model.embed_tokens."), ("transformer.ln_f.", "model.norm."),
             ("transformer.h.", "model.layers."), (".ln_1.", ".input_layernorm."), (".attn.", ".self_attn."),
             (".out_proj.", ".o_proj."), (".mlp.fc_in.", ".mlp.up_proj."), (".mlp.fc_out.", ".mlp.down_proj.")),
    "gpt2": (("transformer.wte.", "model.embed_tokens."), ("transformer.wpe.", "model.embed_positions."),
             ("transformer.ln_f.", "model.norm."), ("transformer.h.", "model.layers."), (".ln_1.", ".input_layernorm."),
             (".ln_2.", ".post_attention_layernorm."), (".attn.c_proj.", ".self_attn.o_proj."),
             (".mlp.c_fc.", ".mlp.up_proj."), (".mlp.c_proj.", ".mlp.down_proj.")),
}
_LEGACY_RENAMES["gpt_bigcode"] = _LEGACY_RENAMES["gpt2"]
_LEGACY_RENAMES["gpt_neo"] = ((".attn.attention.", ".self_attn."), (".self_attn.out_proj.", ".self_attn.o_proj."),
                              *_LEGACY_RENAMES["gpt2"])
# ... and the name of each one's fused q/k/v projection
_LEGACY_FUSED = {"falcon": ".self_attention.query_key_value.", "bloom": ".self_attention.query_key_value.",
                 "mpt": ".attn.Wqkv.", "gpt2": ".attn.c_attn.", "gpt_bigcode": ".attn.c_attn."}


def _hf_legacy_names(hf: dict[str, torch.Tensor], config: ModelConfig, model_type: str) -> dict[str, torch.Tensor]:
    """Falcon's, BLOOM's, MPT's, OPT's, GPT-J's, GPT-2's, GPT-BigCode's and GPT-Neo's tensors under Llama's names
    (_LEGACY_RENAMES), each fused q/k/v projection split into q, k and v by its layout: q, k and v blocks (MPT,
    GPT-2, a multi-query model's queries then one key and value), each head's q, k, v in turn (BLOOM, Falcon and
    BigCode without grouped or single KV heads), or Falcon's KV groups (new_decoder_architecture: each group's queries,
    then its key and value). GPT-2's Conv1D weights are stored [in, out] (transposed here to a Linear's) beside old
    files' causal-mask buffers (dropped); OPT's position table's first two rows, which no position reads, dropped."""
    nh, nkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    if model_type == "gpt2":
        hf = {k: v.t().contiguous() if v.dim() == 2 and (".attn." in k or ".mlp." in k) else v
              for k, v in hf.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    if model_type == "opt":
        hf = {k: v[2:] if k == "model.decoder.embed_positions.weight" else v for k, v in hf.items()}

    def split(value: torch.Tensor) -> list[torch.Tensor]:
        rest = value.shape[1:]
        if model_type == "falcon" and nkv not in (1, nh):  # [nkv, group + 2, d]
            grouped = value.reshape(nkv, nh // nkv + 2, d, *rest)
            return [grouped[:, :-2].reshape(nh * d, *rest), grouped[:, -2].reshape(nkv * d, *rest),
                    grouped[:, -1].reshape(nkv * d, *rest)]
        if model_type in ("mpt", "gpt2") or nkv == 1:
            return list(value.split([nh * d, nkv * d, nkv * d]))
        return [part.reshape(nh * d, *rest) for part in value.reshape(nh, 3, d, *rest).unbind(1)]

    fused = _LEGACY_FUSED.get(model_type)
    out = {}
    for key, value in hf.items():
        for old, new in _LEGACY_RENAMES[model_type]:
            key = key.replace(old, new)
        if fused is not None and fused in key:
            for name, part in zip("qkv", split(value)):
                out[key.replace(fused, f".self_attn.{name}_proj.")] = part.contiguous()
        else:
            out[key] = value
    return out


def _hf_to_serving(hf: dict[str, torch.Tensor], config: ModelConfig, *, source: str,
                   hf_config: dict | None = None) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors in the serving layout (``hf_config``: its config.json, for what the ModelConfig keeps
    none of: Falcon-H1's multipliers, folded into the weights)."""
    def take(name: str) -> torch.Tensor:
        try:
            return hf[name]
        except KeyError:
            raise CoreError(f"{source}: checkpoint has no tensor {name}", ErrorKind.SOURCE_FORMAT) from None

    if config.architecture == "lfm2":
        return _hf_lfm2(hf, config, take)
    if config.mixerless_layers or config.mlpless_layers or (config.hidden_act == "relu2" and (
            "backbone.embeddings.weight" in hf or "model.embeddings.weight" in hf)):  # (Nemotron-H's, not Arcee's)
        return _hf_nemotron_h(hf, config, take)
    if hf_config is not None and hf_config.get("model_type") == "kimi_linear":  # (its dense MLPs' name)
        hf = {k.replace(".block_sparse_moe.", ".mlp.") if k.split(".block_sparse_moe.")[-1].startswith(
            ("gate_proj", "up_proj", "down_proj")) else k: v for k, v in hf.items()}
    if hf_config is not None and hf_config.get("model_type") in ("apertus", "hunyuan_v1_dense", "hunyuan_v1_moe",
                                                                 "hy_v3"):
        # (their names for Llama's norms, Qwen3's q/k norms, Qwen's router and shared experts, HY v3's correction bias)
        renames = ((".attention_layernorm.", ".input_layernorm."), (".feedforward_layernorm.", ".post_attention_layernorm."),
                   (".query_layernorm.", ".q_norm."), (".key_layernorm.", ".k_norm."), (".mlp.gate.wg.", ".mlp.gate."),
                   (".mlp.shared_mlp.", ".mlp.shared_experts."), (".mlp.router.gate.", ".mlp.gate."),
                   (".mlp.expert_bias", ".mlp.e_score_correction_bias"))
        hf = {next((k.replace(old, new) for old, new in renames if old in k), k): v for k, v in hf.items()}
    if hf_config is not None and hf_config.get("model_type") == "stablelm" and config.qk_layer_norm_per_head:
        # (StableLM 2 12B: q_layernorm.norms.{h} a LayerNorm a head, stacked [heads, d] under Qwen3's names)
        hf = dict(hf)
        for i in range(config.num_layers):
            for x, heads in (("q", config.num_heads), ("k", config.num_kv_heads)):
                prefix = f"model.layers.{i}.self_attn.{x}_layernorm.norms."
                hf[f"model.layers.{i}.self_attn.{x}_norm.weight"] = torch.stack(
                    [hf.pop(f"{prefix}{h}.weight") for h in range(heads)])
    if (hf_config is not None and hf_config.get("model_type") == "cohere2_moe" and config.shared_expert_intermediate_size
            and hf_config.get("shared_expert_combination_strategy", "average") == "average"):
        # (the average of routed and shared: the shared output halved here, the routed weights by routed_scaling)
        hf = {k: v * 0.5 if k.endswith(".mlp.shared_experts.down_proj.weight") else v for k, v in hf.items()}
    if hf_config is not None and hf_config.get("model_type") in _LEGACY_RENAMES:
        hf = _hf_legacy_names(hf, config, hf_config["model_type"])
    if hf_config is not None and hf_config.get("model_type") == "nemotron":  # (LayerNorm1P: the norms hold 1 + w)
        hf = {k: v.float() + 1.0 if k.endswith("layernorm.weight") or k == "model.norm.weight" else v
              for k, v in hf.items()}
    if hf_config is not None and hf_config.get("model_type") == "gpt_neox":  # (its names for Llama's; query_key_value
        # each head's q, k and v rows in turn)
        heads, d = config.num_heads, config.head_dim
        renames = (("gpt_neox.embed_in.", "model.embed_tokens."), ("gpt_neox.final_layer_norm.", "model.norm."),
                   ("embed_out.", "lm_head."), (".attention.dense.", ".self_attn.o_proj."),
                   (".mlp.dense_h_to_4h.", ".mlp.up_proj."), (".mlp.dense_4h_to_h.", ".mlp.down_proj."))
        renamed = {}
        for k, v in hf.items():
            k = next((k.replace(old, new) for old, new in renames if old in k), k).replace("gpt_neox.layers.",
                                                                                          "model.layers.")
            if ".attention.query_key_value." in k:
                parts = v.reshape(heads, 3, d, *v.shape[1:])
                for j, x in enumerate("qkv"):
                    renamed[k.replace(".attention.query_key_value.", f".self_attn.{x}_proj.")] = \
                        parts[:, j].reshape(heads * d, *v.shape[1:])
            else:
                renamed[k] = v
        hf = renamed
    if hf_config is not None and hf_config.get("model_type") == "vaultgemma":  # (its pre-MLP norm under Gemma 2's
        # name; Gemma 1's, which it reads as, is Llama's)
        hf = {k.replace(".pre_feedforward_layernorm.", ".post_attention_layernorm."): v for k, v in hf.items()}
    if hf_config is not None and hf_config.get("model_type") == "phi":  # (its names for Llama's)
        renames = ((".self_attn.dense.", ".self_attn.o_proj."), (".mlp.fc1.", ".mlp.up_proj."),
                   (".mlp.fc2.", ".mlp.down_proj."), ("model.final_layernorm.", "model.norm."))
        hf = {next((k.replace(old, new) for old, new in renames if old in k), k): v for k, v in hf.items()}
    if hf_config is not None and hf_config.get("model_type") == "starcoder2":  # (its MLP's names: Llama's up, down)
        hf = {k.replace(".mlp.c_fc.", ".mlp.up_proj.").replace(".mlp.c_proj.", ".mlp.down_proj."): v
              for k, v in hf.items()}
    if hf_config is not None and hf_config.get("model_type") == "olmo_hybrid":  # (its checkpoints' names for them)
        renames = ((".attention_layer_norm.", ".input_layernorm."),
                   (".feedforward_layer_norm.", ".post_attention_layernorm."))
        hf = {next((k.replace(old, new) for old, new in renames if old in k), k): v for k, v in hf.items()}
    if hf_config is not None and hf_config.get("model_type") == "afmoe":  # (its four norms under GLM-4's names;
        # its router's and correction bias' as GLM-4.5's)
        renames = ((".post_attention_layernorm.", ".post_self_attn_layernorm."),
                   (".pre_mlp_layernorm.", ".post_attention_layernorm."), (".mlp.router.gate.", ".mlp.gate."),
                   (".mlp.expert_bias", ".mlp.e_score_correction_bias"))
        hf = {next((k.replace(old, new) for old, new in renames if old in k), k): v for k, v in hf.items()}
    if hf_config is not None and hf_config.get("model_type") == "olmo":  # its LayerNorms have no weights: ones
        hf = _with_weightless_norms(hf, config)
    if hf_config is not None and hf_config.get("model_type") == "nanochat":
        # its RMSNorms (the per-head q/k ones too) have no weights: ones; its MLP's fc1 / fc2 are an ungated up / down;
        # its rope turns the other way (rotate_half as (x2, -x1)): each q and k head's halves swapped turns it back to
        # ours (a swap of both q and k leaves their dot products as they were; its q/k norms see the same values)
        hf = {k.replace(".mlp.fc1.", ".mlp.up_proj.").replace(".mlp.fc2.", ".mlp.down_proj."): v for k, v in hf.items()}
        for name in [k for k in hf if k.endswith((".self_attn.q_proj.weight", ".self_attn.k_proj.weight"))]:
            rows = hf[name].view(-1, 2, config.head_dim // 2, hf[name].shape[-1])
            hf[name] = rows.flip(1).reshape(hf[name].shape)
        hf = _with_weightless_norms(hf, config, qk=True)
    if hf_config is not None and hf_config.get("model_type") in ("sarvam_moe", "param2moe"):
        hf = _hf_sarvam_names(hf, config)
    if hf_config is not None and hf_config.get("model_type") == "exaone":  # EXAONE 3's names for Llama's tensors
        renames = (("transformer.wte.", "model.embed_tokens."), ("transformer.h.", "model.layers."),
                   ("transformer.ln_f.", "model.norm."), (".attn.attention.out_proj.", ".self_attn.o_proj."),
                   (".attn.attention.", ".self_attn."), (".ln_1.", ".input_layernorm."),
                   (".ln_2.", ".post_attention_layernorm."), (".mlp.c_fc_0.", ".mlp.gate_proj."),
                   (".mlp.c_fc_1.", ".mlp.up_proj."), (".mlp.c_proj.", ".mlp.down_proj."))

        def renamed(name: str) -> str:
            for old, new in renames:  # (in order: out_proj's before the rest of attn.attention's)
                name = name.replace(old, new, 1)
            return name

        hf = {renamed(k): v for k, v in hf.items()}
    if hf_config is not None and hf_config.get("model_type") == "internlm2":
        hf = _hf_internlm2_names(hf, config, source)
    if hf_config is not None and hf_config.get("model_type") in ("bamba", "jamba"):  # (their names for Llama's)
        renames = ((".feed_forward.router.", ".mlp.gate."), (".feed_forward.", ".mlp."),
                   (".pre_ff_layernorm.", ".post_attention_layernorm."), ("model.final_layernorm.", "model.norm."))
        hf = {next((k.replace(old, new) for old, new in renames if old in k), k): v for k, v in hf.items()}
    if config.parallel_mixers:
        if hf_config is None:
            raise CoreError(f"{source}: Falcon-H1's tensors need its config.json (the multipliers folded into them)",
                            ErrorKind.SOURCE_FORMAT)
        return _hf_falcon_h1(hf_config, config, take)

    # Gemma 3's RMSNorms scale by (1 + weight): its serving norms hold 1 + weight (added in float32, as
    # transformers computes it), so the forward's norms are the usual ones. Its post_attention_layernorm follows
    # attention (Llama's name for the pre-MLP norm); pre_feedforward_layernorm is its pre-MLP norm.
    gemma = config.architecture in ("gemma2", "gemma3", "gemma4")
    norm = (lambda name: take(name).float() + 1.0) if config.norm_plus_one else take  # (Qwen3-Next's too)
    out = {"embed.weight": take("model.embed_tokens.weight"), "final_norm.weight": norm("model.norm.weight")}
    if config.position_embeddings:  # (GPT-2's wpe)
        out["pos_embed.weight"] = take("model.embed_positions.weight")
    if config.embedding_layer_norm:  # (BLOOM's word_embeddings_layernorm)
        out.update({"embed_norm.weight": take("model.embed_norm.weight"), "embed_norm.bias": take("model.embed_norm.bias")})
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = take("lm_head.weight")
    if config.per_layer_input_dim:  # Gemma 4 E2B / E4B
        out.update({"embed_per_layer.weight": take("model.embed_tokens_per_layer.weight"),
                    "per_layer_proj.weight": take("model.per_layer_model_projection.weight"),
                    "per_layer_proj_norm.weight": norm("model.per_layer_projection_norm.weight")})
    for i in range(config.num_layers):
        hp, sp = f"model.layers.{i}.", f"layers.{i}."
        attn = hp + "self_attn."
        if config.pre_norm and i not in config.post_norm_layers:
            out[sp + "attn_norm.weight"] = norm(hp + "input_layernorm.weight")

        def qkv(kind: str) -> list[torch.Tensor]:  # q, k, v (GLM-4's q and k rows turned to rotate-half order)
            q, k, v = (take(attn + f"{x}_proj.{kind}") for x in "qkv")
            if config.rope_interleaved:
                q = interleaved_rope_rows(q, config.num_heads, config)
                k = interleaved_rope_rows(k, config.num_kv_heads, config)
            return [q, k, v]

        if i in config.linear_layers and config.linear_kind == "kda":
            out.update(_hf_kda(hf, attn, sp, take))
        elif i in config.linear_layers and config.linear_kind == "mamba1":
            out.update(_hf_mamba1(hp + "mamba.", sp, config, take))
        elif i in config.linear_layers and config.linear_kind == "mamba2":
            out.update(_hf_mamba2(hp + "mamba.", sp, config, take))
        elif i in config.linear_layers:
            out.update(_hf_gated_delta(hp + "linear_attn.", sp, config, hf, take))
        elif config.kv_lora_rank:
            out.update(_hf_latent_attention(attn, sp, config, take, i))
        elif attn + "gate_proj.weight" in hf:  # AFMoE's gate apart: its rows after v's
            out[sp + "qkv.weight"] = torch.cat([*qkv("weight"), take(attn + "gate_proj.weight")])
        elif config.attn_output_gate:  # Qwen3-Next: each head's q rows, then its gate's: the gates' rows after v's
            q, k, v = qkv("weight")
            q = q.view(config.num_heads, 2, config.head_dim, -1)
            out[sp + "qkv.weight"] = torch.cat([q[:, 0].reshape(config.q_size, -1), k, v,
                                                q[:, 1].reshape(config.q_size, -1)])
        elif config.kv_source(i) is not None:  # Gemma 4's shared-KV layers: their queries alone
            out[sp + "qkv.weight"] = take(attn + "q_proj.weight")
        elif config.value_from_key and attn + "v_proj.weight" not in hf:  # Gemma 4's global layers: q, k (k as v)
            out[sp + "qkv.weight"] = torch.cat([take(attn + "q_proj.weight"), take(attn + "k_proj.weight")])
        elif attn + "qkv_proj.weight" in hf:  # Phi-3's fused projection: q, k, v rows already in our order
            out[sp + "qkv.weight"] = hf[attn + "qkv_proj.weight"]
        else:
            out[sp + "qkv.weight"] = torch.cat(qkv("weight"), dim=0)
        if config.attention_bias and i not in config.linear_layers:
            if config.attn_output_gate:
                raise CoreError(f"{source}: attention biases with an output gate are not supported",
                                ErrorKind.UNSUPPORTED_MODEL)
            out[sp + "qkv.bias"] = torch.cat(qkv("bias"), dim=0)
        if i in config.linear_layers:
            pass
        elif config.qk_norm:
            out[sp + "q_norm.weight"] = norm(attn + "q_norm.weight")
            if config.kv_source(i) is None:
                out[sp + "k_norm.weight"] = norm(attn + "k_norm.weight")
        if i not in config.linear_layers:
            out[sp + "o.weight"] = take(attn + "o_proj.weight")
        if config.attention_out_bias and i not in config.linear_layers:
            out[sp + "o.bias"] = take(attn + "o_proj.bias")
        if config.attention_sinks:
            out[sp + "sinks"] = take(attn + "sinks")
        if config.layer_scalars:  # (Gemma 4's layer_scalar)
            out[sp + "scalar"] = take(hp + "layer_scalar").reshape(1)
        if config.per_layer_input_dim:  # (Gemma 4 E2B / E4B: the layer's input's gate, projection and norm)
            out.update({sp + "per_layer_gate.weight": take(hp + "per_layer_input_gate.weight"),
                        sp + "per_layer_out.weight": take(hp + "per_layer_projection.weight"),
                        sp + "per_layer_norm.weight": norm(hp + "post_per_layer_input_norm.weight")})
        if hp + "post_self_attn_layernorm.weight" in hf:  # GLM-4's four norms (post_attention_layernorm: Llama's)
            out[sp + "post_attn_norm.weight"] = take(hp + "post_self_attn_layernorm.weight")
            out[sp + "mlp_norm.weight"] = take(hp + "post_attention_layernorm.weight")
            out[sp + "post_mlp_norm.weight"] = take(hp + "post_mlp_layernorm.weight")
        elif hp + "post_norm1.weight" in hf:  # HyperCLOVA X's norms after attention and the MLP beside Llama's two
            out[sp + "mlp_norm.weight"] = take(hp + "post_attention_layernorm.weight")
            out[sp + "post_attn_norm.weight"] = take(hp + "post_norm1.weight")
            out[sp + "post_mlp_norm.weight"] = take(hp + "post_norm2.weight")
        elif gemma and config.sandwich_norm:  # (Gemma 1's: Llama's two)
            out[sp + "post_attn_norm.weight"] = norm(hp + "post_attention_layernorm.weight")
            out[sp + "mlp_norm.weight"] = norm(hp + "pre_feedforward_layernorm.weight")
            out[sp + "post_mlp_norm.weight"] = norm(hp + "post_feedforward_layernorm.weight")
        elif not config.pre_norm or i in config.post_norm_layers:  # OLMo 2: its post_attention_layernorm follows
            # attention; no pre-MLP norm (OLMo Hybrid's attention layers likewise)
            out[sp + "post_attn_norm.weight"] = take(hp + "post_attention_layernorm.weight")
            out[sp + "post_mlp_norm.weight"] = take(hp + "post_feedforward_layernorm.weight")
        elif not config.parallel_block or config.parallel_norms:  # (Qwen3-Next's of 1 + w; GPT-NeoX's beside)
            out[sp + "mlp_norm.weight"] = norm(hp + "post_attention_layernorm.weight")
        if config.expert_bias:
            out.update(_hf_gpt_oss_experts(hf, hp + "mlp.", sp, take))
            continue
        if config.router_input_scale:  # Llama 4's feed_forward: its experts stacked [E, H, 2 I] and [E, I, H]
            ff = hp + "feed_forward."
            if i in config.dense_layers:
                out[sp + "gate_up.weight"] = torch.cat([take(ff + "gate_proj.weight"), take(ff + "up_proj.weight")])
                out[sp + "down.weight"] = take(ff + "down_proj.weight")
                continue
            shared = ff + "shared_expert."
            out.update({sp + "router.weight": take(ff + "router.weight"),
                        sp + "experts.gate_up.weight": take(ff + "experts.gate_up_proj").transpose(1, 2),
                        sp + "experts.down.weight": take(ff + "experts.down_proj").transpose(1, 2),
                        sp + "shared.gate_up.weight": torch.cat([take(shared + "gate_proj.weight"),
                                                                 take(shared + "up_proj.weight")]),
                        sp + "shared.down.weight": take(shared + "down_proj.weight")})
            continue
        if config.parallel_experts:  # Gemma 4 26B-A4B: experts beside the dense MLP
            out.update({sp + ours: take(hp + theirs) for ours, theirs in zip(_PARALLEL_EXPERTS, _HF_PARALLEL_EXPERTS)})
        elif config.num_experts and i not in config.dense_layers:
            out.update(_hf_experts(hf, hp, sp, config, take))
            if config.norm_bias:  # (Phi-3.5-MoE's biased LayerNorms)
                out[sp + "attn_norm.bias"] = take(hp + "input_layernorm.bias")
                out[sp + "mlp_norm.bias"] = take(hp + "post_attention_layernorm.bias")
            continue
        if not config.mlp_gated:  # Apertus, Arcee: up rows alone (and Apertus' xIELU's trained parameters)
            out[sp + "gate_up.weight"] = take(hp + "mlp.up_proj.weight")
            if config.hidden_act == "xielu":
                act = hp + "mlp.act_fn."
                out[sp + "xielu"] = torch.stack([take(act + x).float().reshape(())
                                                 for x in ("alpha_p", "alpha_n", "beta", "eps")])
        elif hp + "mlp.gate_up_proj.weight" in hf:  # Phi-3's: gate rows, then up rows
            out[sp + "gate_up.weight"] = hf[hp + "mlp.gate_up_proj.weight"]
        elif hp + "shared_mlp.input_linear.weight" in hf:  # Granite 4.0's: gate rows, then up rows
            out[sp + "gate_up.weight"] = hf[hp + "shared_mlp.input_linear.weight"]
            out[sp + "down.weight"] = take(hp + "shared_mlp.output_linear.weight")
            continue
        else:
            out[sp + "gate_up.weight"] = torch.cat([take(hp + "mlp.gate_proj.weight"), take(hp + "mlp.up_proj.weight")],
                                                   dim=0)
        out[sp + "down.weight"] = take(hp + "mlp.down_proj.weight")
        if config.mlp_bias:  # (StarCoder2's, its MLP ungated: up's bias alone)
            out[sp + "gate_up.bias"] = take(hp + "mlp.up_proj.bias")
            out[sp + "down.bias"] = take(hp + "mlp.down_proj.bias")
        if config.norm_bias:
            out[sp + "attn_norm.bias"] = take(hp + "input_layernorm.bias")
            if not config.parallel_block or config.parallel_norms:  # (Phi's one norm a layer)
                out[sp + "mlp_norm.bias"] = take(hp + "post_attention_layernorm.bias")
    if config.norm_bias:
        out["final_norm.bias"] = take("model.norm.bias")
    if config.lm_head_bias:
        out["lm_head.bias"] = take("lm_head.bias")
    return {k: v.contiguous() for k, v in out.items()}


def _hf_experts(hf: dict[str, torch.Tensor], hp: str, sp: str, config: ModelConfig, take) -> dict[str, torch.Tensor]:
    """One mixture-of-experts layer's serving tensors from a checkpoint's: each expert's own projections, as the
    released checkpoints store them (Qwen's mlp.experts.{e}.gate_proj / up_proj / down_proj, Mixtral's
    block_sparse_moe.experts.{e}.w1 / w3 / w2), or transformers 5's stacked mlp.experts.gate_up_proj / down_proj."""
    if hp + "block_sparse_moe.input_linear.weight" in hf:  # Granite's: stacked [E, 2 I, H] and [E, H, I], shared_mlp
        block = hp + "block_sparse_moe."
        out = {sp + "router.weight": take(block + "router.layer.weight"),
               sp + "experts.gate_up.weight": take(block + "input_linear.weight"),
               sp + "experts.down.weight": take(block + "output_linear.weight")}
        if config.shared_expert_intermediate_size:  # (Granite 3's MoE has none)
            out.update({sp + "shared.gate_up.weight": take(hp + "shared_mlp.input_linear.weight"),
                        sp + "shared.down.weight": take(hp + "shared_mlp.output_linear.weight")})
        return out
    if hp + "block_sparse_moe.router.weight" in hf:  # Granite's in transformers' names (granitemoe_swa saves them)
        block = hp + "block_sparse_moe."
        out = {sp + "router.weight": take(block + "router.weight"),
               sp + "experts.gate_up.weight": take(block + "experts.gate_up_proj"),
               sp + "experts.down.weight": take(block + "experts.down_proj")}
        if config.shared_expert_intermediate_size:
            out.update({sp + "shared.gate_up.weight": take(hp + "shared_mlp.input_linear.weight"),
                        sp + "shared.down.weight": take(hp + "shared_mlp.output_linear.weight")})
        return out
    mixtral = hp + "block_sparse_moe.gate.weight" in hf
    block = hp + ("block_sparse_moe." if mixtral else "mlp.")
    out = {sp + "router.weight": take(block + "gate.weight")}
    if config.router_sigmoid or config.router_correction_bias:  # (GLM-4.5's gate holds its correction bias,
        # MiniMax-M2's block, ERNIE 4.5's moe_statics [1, E])
        bias = next((b for b in (block + "gate.e_score_correction_bias", block + "moe_statics.e_score_correction_bias")
                     if b in hf), block + "e_score_correction_bias")
        out[sp + "router.correction_bias"] = take(bias).reshape(-1)
    if block + "experts.gate_up_proj" in hf:
        gate_up, down = take(block + "experts.gate_up_proj"), take(block + "experts.down_proj")
        hidden, inter = config.hidden_size, config.expert_intermediate_size
        if hidden != inter and tuple(down.shape[1:]) == (inter, hidden):
            # (Qwen3-VL-MoE's released stacks [E, H, 2 I] and [E, I, H], inputs first: transposed, as transformers
            # transposes them on loading)
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        out[sp + "experts.gate_up.weight"] = gate_up
        out[sp + "experts.down.weight"] = down
    else:
        gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        experts = [f"{block}experts.{e}." for e in range(config.num_experts)]
        out[sp + "experts.gate_up.weight"] = torch.stack([
            torch.cat([take(x + f"{gate}.weight"), take(x + f"{up}.weight")]) for x in experts])
        out[sp + "experts.down.weight"] = torch.stack([take(x + f"{down}.weight") for x in experts])
    if config.shared_expert_intermediate_size:
        shared = block + ("shared_expert." if config.shared_expert_gate else "shared_experts.")  # (Qwen's, GLM's)
        out[sp + "shared.gate_up.weight"] = torch.cat([take(shared + "gate_proj.weight"), take(shared + "up_proj.weight")])
        out[sp + "shared.down.weight"] = take(shared + "down_proj.weight")
        if config.shared_expert_gate:
            out[sp + "shared.gate.weight"] = take(block + "shared_expert_gate.weight")
    return out


def _hf_kda(hf: dict[str, torch.Tensor], ap: str, sp: str, take) -> dict[str, torch.Tensor]:
    """A Kimi Delta Attention layer (Kimi Linear's self_attn): q/k/v_proj, b_proj, f_a_proj and g_a_proj as one input
    projection; q/k/v_conv1d [channels, 1, kernel] as one convolution; f_b_proj, g_b_proj, dt_bias, A_log [1, 1,
    heads, 1], o_norm, o_proj (as released; transformers 5 holds the forget gate's under forget_gate. and the three
    convolutions stacked as conv1d)."""
    gate = ap + ("forget_gate." if ap + "forget_gate.dt_bias" in hf else "")
    conv = take(ap + "conv1d.weight") if ap + "conv1d.weight" in hf else \
        torch.cat([take(ap + f"{x}_conv1d.weight") for x in "qkv"])
    projections = [take(ap + f"{x}_proj.weight") for x in "qkvb"] + [take(gate + "f_a_proj.weight"),
                                                                     take(ap + "g_a_proj.weight")]
    return {sp + "linear_in.weight": torch.cat(projections), sp + "conv.weight": conv.reshape(conv.shape[0], -1),
            sp + "f_b.weight": take(gate + "f_b_proj.weight"), sp + "g_b.weight": take(ap + "g_b_proj.weight"),
            sp + "dt_bias": take(gate + "dt_bias"), sp + "a_log": take(gate + "A_log").reshape(-1),
            sp + "linear_norm.weight": take(ap + "o_norm.weight"), sp + "o.weight": take(ap + "o_proj.weight")}


def _hf_mamba1(mp: str, sp: str, config: ModelConfig, take) -> dict[str, torch.Tensor]:
    """A Mamba-1 mixer (Jamba's ``mamba``): in_proj (x, z), conv1d [channels, 1, kernel] and its bias, x_proj (dt's
    input, B, C), dt_proj and its bias, A_log [channels, states], D, dt / b / c_layernorm, out_proj."""
    conv = take(mp + "conv1d.weight")
    out = {sp + "linear_in.weight": take(mp + "in_proj.weight"), sp + "conv.weight": conv.reshape(conv.shape[0], -1),
           sp + "x_proj.weight": take(mp + "x_proj.weight"), sp + "dt_proj.weight": take(mp + "dt_proj.weight"),
           sp + "dt_bias": take(mp + "dt_proj.bias"), sp + "a_log": take(mp + "A_log"), sp + "d": take(mp + "D"),
           sp + "o.weight": take(mp + "out_proj.weight")}
    if config.linear_norm and config.linear_norm_eps is not None:  # (Falcon-Mamba's weightless norms: ones)
        size, rank = config.linear_key_dim, config.linear_dt_rank
        out.update({sp + "dt_norm.weight": torch.ones(rank), sp + "b_norm.weight": torch.ones(size),
                    sp + "c_norm.weight": torch.ones(size)})
    elif config.linear_norm:  # (Jamba's norms on dt, B and C)
        out.update({sp + "dt_norm.weight": take(mp + "dt_layernorm.weight"),
                    sp + "b_norm.weight": take(mp + "b_layernorm.weight"),
                    sp + "c_norm.weight": take(mp + "c_layernorm.weight")})
    if config.linear_conv_bias:
        out[sp + "conv.bias"] = take(mp + "conv1d.bias")
    return out


def _hf_mamba2(mp: str, sp: str, config: ModelConfig, take) -> dict[str, torch.Tensor]:
    """A Mamba-2 mixer (Granite 4.0-H's ``mamba``): in_proj (z, x B C, dt), conv1d [channels, 1, kernel] and its bias,
    dt_bias, A_log, D, the gated norm, out_proj."""
    conv = take(mp + "conv1d.weight")
    out = {sp + "linear_in.weight": take(mp + "in_proj.weight"), sp + "conv.weight": conv.reshape(conv.shape[0], -1),
           sp + "dt_bias": take(mp + "dt_bias"), sp + "a_log": take(mp + "A_log"), sp + "d": take(mp + "D"),
           sp + "o.weight": take(mp + "out_proj.weight")}
    if config.linear_norm:
        out[sp + "linear_norm.weight"] = take(mp + "norm.weight")
    if config.linear_conv_bias:
        out[sp + "conv.bias"] = take(mp + "conv1d.bias")
    return out


def _paired_blocks(config: ModelConfig, take, names: dict, mixers: dict, expert_stacks) -> dict[str, torch.Tensor]:
    """The serving tensors of a model whose blocks config.layer_blocks pairs into layers (Nemotron-H; a Mamba or
    Mamba-2 language model: a mixer block alone a layer), from a checkpoint's or a GGUF's names: ``names`` the format
    strings of the embedding, final norm, LM head and, of block {b}, its norm, attention's q/k/v ({x}) and o, the MLP's
    up / down ({x}), the router, its correction bias and the shared expert's up / down ({x}); ``mixers`` the reader of a
    linear layer's mixer by linear_kind ((block prefix, serving prefix, config, take) -> tensors), under
    names["mixer"]; ``expert_stacks(block, config)`` the experts' stacked [E, I, H] up and [E, H, I] down."""
    from flared.model.config import layer_blocks

    out = {"embed.weight": take(names["embed"]), "final_norm.weight": take(names["final_norm"])}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = take(names["lm_head"])
    for i, (mixer, mlp) in enumerate(layer_blocks(config)):
        sp = f"layers.{i}."
        if mixer is not None:
            out[sp + "attn_norm.weight"] = take(names["norm"].format(b=mixer))
            if i in config.linear_layers:
                out.update(mixers[config.linear_kind](names["mixer"].format(b=mixer), sp, config, take))
            else:
                out[sp + "qkv.weight"] = torch.cat([take(names["attn"].format(b=mixer, x=x)) for x in "qkv"])
                out[sp + "o.weight"] = take(names["o"].format(b=mixer))
        if mlp is None:
            continue
        out[sp + "mlp_norm.weight"] = take(names["norm"].format(b=mlp))
        if not config.num_experts or i in config.dense_layers:
            out[sp + "gate_up.weight"] = take(names["mlp"].format(b=mlp, x="up"))
            out[sp + "down.weight"] = take(names["mlp"].format(b=mlp, x="down"))
            continue
        out[sp + "router.weight"] = take(names["router"].format(b=mlp))
        out[sp + "router.correction_bias"] = take(names["correction_bias"].format(b=mlp))
        out[sp + "experts.gate_up.weight"], out[sp + "experts.down.weight"] = expert_stacks(mlp, config)
        if config.shared_expert_intermediate_size:
            out[sp + "shared.gate_up.weight"] = take(names["shared"].format(b=mlp, x="up"))
            out[sp + "shared.down.weight"] = take(names["shared"].format(b=mlp, x="down"))
    return {k: v.contiguous() for k, v in out.items()}


def _hf_nemotron_h(hf: dict[str, torch.Tensor], config: ModelConfig, take) -> dict[str, torch.Tensor]:
    """Nemotron-H's checkpoint (and a Mamba or Mamba-2 language model's: the same names, a mixer alone a layer;
    backbone.* as released, model.* as transformers 5 saves it): embeddings, norm_f, each block's norm and mixer (a
    Mamba mixer's, attention's q/k/v/o_proj, an MLP's up_proj / down_proj, the experts' gate (router,
    e_score_correction_bias), experts.{e} or stacked experts, shared_experts)."""
    root = "backbone." if "backbone.embeddings.weight" in hf else "model."
    block = root + "layers.{b}."

    def expert_stacks(b: int, config: ModelConfig):
        mp = block.format(b=b) + "mixer.experts."
        if mp + "up_proj" in hf:  # transformers 5's stacked [E, I, H] and [E, H, I]
            return take(mp + "up_proj"), take(mp + "down_proj")
        return tuple(torch.stack([take(f"{mp}{e}.{x}_proj.weight") for e in range(config.num_experts)])
                     for x in ("up", "down"))

    names = dict(embed=root + "embeddings.weight", final_norm=root + "norm_f.weight", lm_head="lm_head.weight",
                 norm=block + "norm.weight", mixer=block + "mixer.", attn=block + "mixer.{x}_proj.weight",
                 o=block + "mixer.o_proj.weight", mlp=block + "mixer.{x}_proj.weight", router=block + "mixer.gate.weight",
                 correction_bias=block + "mixer.gate.e_score_correction_bias",
                 shared=block + "mixer.shared_experts.{x}_proj.weight")
    return _paired_blocks(config, take, names, {"mamba1": _hf_mamba1, "mamba2": _hf_mamba2}, expert_stacks)


def _hf_falcon_h1(m: dict, config: ModelConfig, take) -> dict[str, torch.Tensor]:
    """Falcon-H1's checkpoint: embed_tokens, final_layernorm, each layer's input_layernorm, pre_ff_layernorm,
    self_attn's q/k/v/o_proj, mamba's (Granite 4.0-H's names; out_proj as linear_o), feed_forward's gate / up /
    down_proj; its muP multipliers (from its config.json ``m``) folded into the weights as llama.cpp's converter folds
    them: ssm_in_multiplier and ssm_multipliers (z, x, B, C, dt)
    into in_proj's rows, ssm_out_multiplier into out_proj, attention_in_multiplier into q/k/v (key_multiplier into k),
    attention_out_multiplier into o, mlp_multipliers into gate and down."""
    inner = config.linear_value_heads * config.linear_value_dim
    state = config.linear_key_heads * config.linear_key_dim
    zxbcdt = [float(x) for x in m.get("ssm_multipliers") or [1.0] * 5]
    mup = torch.cat([torch.full((n,), f) for n, f in zip(
        (inner, inner, state, state, config.linear_value_heads), zxbcdt)])
    gate_m, down_m = [float(x) for x in m.get("mlp_multipliers") or [1.0, 1.0]]
    attn_in = float(m.get("attention_in_multiplier", 1.0))

    def scaled(t: torch.Tensor, factor) -> torch.Tensor:
        return (t.float() * factor).to(t.dtype)

    out = {"embed.weight": take("model.embed_tokens.weight"), "final_norm.weight": take("model.final_layernorm.weight")}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = take("lm_head.weight")
    for i in range(config.num_layers):
        hp, sp = f"model.layers.{i}.", f"layers.{i}."
        out[sp + "attn_norm.weight"] = take(hp + "input_layernorm.weight")
        out[sp + "mlp_norm.weight"] = take(hp + "pre_ff_layernorm.weight")
        mamba = _hf_mamba2(hp + "mamba.", sp, config, take)
        mamba[sp + "linear_in.weight"] = scaled(mamba[sp + "linear_in.weight"],
                                                float(m.get("ssm_in_multiplier", 1.0)) * mup[:, None])
        mamba[sp + "linear_o.weight"] = scaled(mamba.pop(sp + "o.weight"), float(m.get("ssm_out_multiplier", 1.0)))
        out.update(mamba)
        a = hp + "self_attn."
        out[sp + "qkv.weight"] = torch.cat([scaled(take(a + "q_proj.weight"), attn_in),
                                            scaled(take(a + "k_proj.weight"),
                                                   attn_in * float(m.get("key_multiplier", 1.0))),
                                            scaled(take(a + "v_proj.weight"), attn_in)])
        out[sp + "o.weight"] = scaled(take(a + "o_proj.weight"), float(m.get("attention_out_multiplier", 1.0)))
        f = hp + "feed_forward."
        out[sp + "gate_up.weight"] = torch.cat([scaled(take(f + "gate_proj.weight"), gate_m), take(f + "up_proj.weight")])
        out[sp + "down.weight"] = scaled(take(f + "down_proj.weight"), down_m)
    return {k: v.contiguous() for k, v in out.items()}


def _hf_lfm2(hf: dict[str, torch.Tensor], config: ModelConfig, take) -> dict[str, torch.Tensor]:
    """LFM2's checkpoint: operator_norm / ffn_norm before the mixer and the MLP, attention's q/k_layernorm and
    out_proj, the short convolution's in_proj (B, C, x), conv [hidden, 1, kernel] and out_proj, the MLP's w1 (gate),
    w3 (up), w2 (down); the final norm is embedding_norm. LFM2-MoE's expert layers: feed_forward.gate (the router),
    its expert_bias (the correction biases), each expert's w1 / w3 / w2."""
    out = {"embed.weight": take("model.embed_tokens.weight"), "final_norm.weight": take("model.embedding_norm.weight")}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = take("lm_head.weight")
    for i in range(config.num_layers):
        hp, sp = f"model.layers.{i}.", f"layers.{i}."
        out[sp + "attn_norm.weight"] = take(hp + "operator_norm.weight")
        out[sp + "mlp_norm.weight"] = take(hp + "ffn_norm.weight")
        if config.sandwich_norm:  # (LFM3's norms after the mixer and the MLP)
            out[sp + "post_attn_norm.weight"] = take(hp + "post_operator_norm.weight")
            out[sp + "post_mlp_norm.weight"] = take(hp + "post_ffn_norm.weight")
        if i in config.linear_layers:
            conv = take(hp + "conv.conv.weight")
            out.update({sp + "linear_in.weight": take(hp + "conv.in_proj.weight"),
                        sp + "conv.weight": conv.reshape(conv.shape[0], -1),
                        sp + "o.weight": take(hp + "conv.out_proj.weight")})
        else:
            attn = hp + "self_attn."
            qkv = [take(attn + f"{x}_proj.weight") for x in "qkv"]
            if config.attn_output_gate:  # LFM3's gate, one row a head: repeated over its dims, after v's rows
                gate = take(attn + ("g_proj.weight" if attn + "g_proj.weight" in hf else "gate_proj.weight"))
                qkv.append(gate.repeat_interleave(config.head_dim, dim=0))
            out[sp + "qkv.weight"] = torch.cat(qkv)
            lfm3 = attn + "o_proj.weight" in hf  # (LFM3's names: Llama's o_proj, Qwen3's q_norm / k_norm)
            out[sp + "o.weight"] = take(attn + ("o_proj.weight" if lfm3 else "out_proj.weight"))
            out[sp + "q_norm.weight"] = take(attn + ("q_norm.weight" if lfm3 else "q_layernorm.weight"))
            out[sp + "k_norm.weight"] = take(attn + ("k_norm.weight" if lfm3 else "k_layernorm.weight"))
        ff = hp + "feed_forward."
        if config.num_experts and i not in config.dense_layers:
            out[sp + "router.weight"] = take(ff + "gate.weight")
            bias = hf.get(ff + "expert_bias")  # (use_expert_bias false: none, which is a zero correction)
            out[sp + "router.correction_bias"] = bias if bias is not None else torch.zeros(config.num_experts)
            if ff + "experts.gate_up_proj" in hf:
                out[sp + "experts.gate_up.weight"] = take(ff + "experts.gate_up_proj")
                out[sp + "experts.down.weight"] = take(ff + "experts.down_proj")
            else:
                experts = [f"{ff}experts.{e}." for e in range(config.num_experts)]
                out[sp + "experts.gate_up.weight"] = torch.stack([torch.cat([take(x + "w1.weight"),
                                                                             take(x + "w3.weight")]) for x in experts])
                out[sp + "experts.down.weight"] = torch.stack([take(x + "w2.weight") for x in experts])
        else:
            out[sp + "gate_up.weight"] = torch.cat([take(ff + "w1.weight"), take(ff + "w3.weight")])
            out[sp + "down.weight"] = take(ff + "w2.weight")
    return {k: v.contiguous() for k, v in out.items()}


def _hf_gated_delta(la: str, sp: str, config: ModelConfig, hf: dict[str, torch.Tensor], take) -> dict[str, torch.Tensor]:
    """A Gated DeltaNet layer from its checkpoint: Qwen3.5's separate in_proj_qkv / _z / _b / _a, or Qwen3-Next's
    in_proj_qkvz and in_proj_ba, which group each key head's q, k, its value heads' v and z (and b, a) together:
    regrouped to all heads' q, then k, v, z, b, a (value head g * r + j is key head g's j-th)."""
    nk, nv, dk, dv = config.linear_key_heads, config.linear_value_heads, config.linear_key_dim, config.linear_value_dim
    if la + "in_proj_qkv.weight" in hf:
        parts = [take(la + f"in_proj_{x}.weight") for x in ("qkv", "z", "b", "a")]
    elif la + "q_proj.weight" in hf:  # OLMo Hybrid's apart: q, k, v, the gate g (z), b, a; its own names for the rest
        conv = take(la + "conv1d.weight") if la + "conv1d.weight" in hf else \
            torch.cat([take(la + f"{x}_conv1d.weight") for x in "qkv"])
        return {sp + "linear_in.weight": torch.cat([take(la + f"{x}_proj.weight") for x in "qkvgba"]),
                sp + "conv.weight": conv.reshape(conv.shape[0], -1), sp + "dt_bias": take(la + "dt_bias"),
                sp + "a_log": take(la + "A_log"), sp + "linear_norm.weight": take(la + "o_norm.weight"),
                sp + "o.weight": take(la + "o_proj.weight")}
    else:
        r = nv // nk
        qkvz = take(la + "in_proj_qkvz.weight").reshape(nk, 2 * dk + 2 * r * dv, -1)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=1)
        b, a = take(la + "in_proj_ba.weight").reshape(nk, 2 * r, -1).split([r, r], dim=1)
        parts = [torch.cat([x.reshape(-1, x.shape[-1]) for x in (q, k, v)]), *(x.reshape(-1, x.shape[-1])
                                                                              for x in (z, b, a))]
    conv = take(la + "conv1d.weight")
    return {sp + "linear_in.weight": torch.cat(parts), sp + "conv.weight": conv.reshape(conv.shape[0], -1),
            sp + "dt_bias": take(la + "dt_bias"), sp + "a_log": take(la + "A_log"),
            sp + "linear_norm.weight": take(la + "norm.weight"), sp + "o.weight": take(la + "out_proj.weight")}


def _hf_latent_attention(attn: str, sp: str, config: ModelConfig, take, layer: int) -> dict[str, torch.Tensor]:
    """DeepSeek's latent attention from its checkpoint: each head's query rows (nope, then the rotated part) reordered
    to the rotated part first (its interleaved pairs to rotate-half), and the shared rotated key rows at kv_a's end
    likewise; kv_b as released (each head's unrotated key part, then its value)."""
    d, r = config.head_dim, config.rope_dim
    turned = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)]) if config.rope_interleaved else torch.arange(r)
    head = torch.cat([d - r + turned, torch.arange(d - r)])  # per head: the rotated part first, then the rest

    def queries(rows: torch.Tensor) -> torch.Tensor:
        return rows.reshape(config.num_heads, d, -1)[:, head].reshape(rows.shape)

    kv_a = take(attn + "kv_a_proj_with_mqa.weight")
    out = {sp + "kv_a.weight": torch.cat([kv_a[:config.kv_lora_rank], kv_a[config.kv_lora_rank:][turned]]),
           sp + "kv_a_norm.weight": take(attn + "kv_a_layernorm.weight"),
           sp + "kv_b.weight": take(attn + "kv_b_proj.weight")}
    if config.q_lora_rank:
        out.update({sp + "q_a.weight": take(attn + "q_a_proj.weight"),
                    sp + "q_a_norm.weight": take(attn + "q_a_layernorm.weight"),
                    sp + "q_b.weight": queries(take(attn + "q_b_proj.weight"))})
    else:
        out[sp + "q.weight"] = queries(take(attn + "q_proj.weight"))
    if config.index_topk and layer not in config.index_shared_layers:
        # (V3.2's indexer rope turns halves already; GLM-5's pairs, reordered here: its queries' first rope_dim of
        # each head, its key's and the key's LayerNorm's, which the order leaves as it was)
        ix = attn + "indexer."
        dim = config.index_head_dim
        order = torch.arange(dim)
        if config.index_rope_interleaved:
            order = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2), torch.arange(r, dim)])
        out.update({sp + "index_q.weight": take(ix + "wq_b.weight").reshape(config.index_heads, dim, -1)[:, order]
                    .reshape(config.index_heads * dim, -1),
                    sp + "index_k.weight": take(ix + "wk.weight")[order],
                    sp + "index_k_norm.weight": take(ix + "k_norm.weight")[order],
                    sp + "index_k_norm.bias": take(ix + "k_norm.bias")[order],
                    sp + "index_weights.weight": take(ix + "weights_proj.weight")})
    return out


def interleaved_rope_rows(rows: torch.Tensor, num_heads: int, config: ModelConfig) -> torch.Tensor:
    """q or k rows [num_heads * head_dim, ...] whose heads rotate interleaved pairs (x0, y0, x1, y1, ...: GLM-4's rope)
    reordered so each head's rotated rows read (x0, x1, ..., y0, y1, ...), the rotate-half order: the same turn, and
    q . k unchanged (q and k take the same order)."""
    d, r = config.head_dim, config.rope_dim
    order = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2), torch.arange(r, d)])
    return rows.reshape(num_heads, d, *rows.shape[1:])[:, order].reshape(rows.shape)


def _hf_gpt_oss_experts(hf: dict[str, torch.Tensor], block: str, sp: str, take) -> dict[str, torch.Tensor]:
    """gpt-oss' routed MLP: the biased router; the experts' products as transformers holds them ([E, H, 2 I] with
    gate and up columns interleaved, [E, I, H]) or as OpenAI released them (MXFP4: ``*_blocks`` and ``*_scales``, rows
    [E, 2 I, H] and [E, H, I]), with their biases, in our layout (gate rows, then up rows)."""

    def product(name: str) -> torch.Tensor:  # [E, out, in]
        if block + f"experts.{name}_blocks" in hf:
            return mxfp4_dequantize(take(block + f"experts.{name}_blocks"), take(block + f"experts.{name}_scales"))
        return take(block + f"experts.{name}").transpose(1, 2)

    def gate_then_up(rows: torch.Tensor) -> torch.Tensor:  # interleaved (gate, up) pairs along dim 1 -> gate, up
        return torch.cat([rows[:, 0::2], rows[:, 1::2]], dim=1)

    return {sp + "router.weight": take(block + "router.weight"), sp + "router.bias": take(block + "router.bias"),
            sp + "experts.gate_up.weight": gate_then_up(product("gate_up_proj")),
            sp + "experts.gate_up.bias": gate_then_up(take(block + "experts.gate_up_proj_bias")),
            sp + "experts.down.weight": product("down_proj"),
            sp + "experts.down.bias": take(block + "experts.down_proj_bias")}


# MXFP4's 4-bit codes (e2m1): sign, then 0, 0.5, 1, 1.5, 2, 3, 4, 6
_FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OpenAI's MXFP4 tensors -> bfloat16 (which holds every value exactly): ``blocks`` [E, ..., G, 16] uint8 (two
    codes a byte, the low nibble first), ``scales`` [E, ..., G] uint8 (a power of two for each group of 32, biased by
    127) -> [E, ..., G * 32]. One expert at a time, to keep the index tensors small."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise CoreError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                        f"{scales.dtype} do not pair", ErrorKind.SOURCE_FORMAT)
    out = torch.empty(*scales.shape[:-1], scales.shape[-1] * 32, dtype=torch.bfloat16)
    for e in range(blocks.shape[0]):
        codes = torch.stack([blocks[e] & 0x0F, blocks[e] >> 4], dim=-1).flatten(-2).int()  # [..., G, 32]
        values = torch.ldexp(_FP4_VALUES[codes], (scales[e].int() - 127)[..., None].float())
        out[e] = values.flatten(-2)
    return out


# ---------------------------------------------------------------- GGUF


def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


# GGUF architecture -> ours; qwen2moe / qwen3moe are their families with routed experts (as is a llama file with
# llama.expert_count: Mixtral)
_GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3",
                       "qwen2moe": "qwen2",
                       "qwen3moe": "qwen3", "smollm3": "llama", "phi3": "llama", "granite": "llama", "olmo2": "olmo2",
                       "gpt-oss": "gpt_oss", "seed_oss": "llama", "glm4": "llama", "glm4moe": "llama",
                       "command-r": "llama", "cohere2": "llama", "qwen3next": "qwen3_next", "qwen35": "qwen3_next",
                       "qwen35moe": "qwen3_next", "lfm2": "lfm2", "lfm2moe": "lfm2", "granitehybrid": "llama",
                       "nemotron_h": "llama", "nemotron_h_moe": "llama", "falcon-h1": "llama", "jamba": "llama",
                       "mamba": "llama", "mamba2": "llama", "dots1": "qwen3", "deepseek2": "deepseek2",
                       # the Qwen VL decoders (their mRoPE split is the image tower's: flared.model.mmproj)
                       "qwen2vl": "qwen2", "qwen3vl": "qwen3", "qwen3vlmoe": "qwen3",
                       "ernie4_5": "llama", "ernie4_5-moe": "llama", "hunyuan-dense": "llama", "hunyuan-moe": "llama",
                       "llama4": "llama", "arcee": "llama", "granitemoe": "llama", "olmoe": "llama",
                       "starcoder2": "llama", "gemma4": "gemma4", "mistral3": "llama", "gpt2": "llama",
                       "starcoder": "llama", "falcon": "llama", "phi2": "llama", "bloom": "llama", "mpt": "llama",
                       "stablelm": "llama", "gptneox": "llama", "internlm2": "llama", "minicpm": "llama"}
_GATED_DELTA_GGUF = ("qwen3next", "qwen35", "qwen35moe")


def _gguf_experts(reader, arch: str, source: str, need) -> dict:
    """ModelConfig's expert fields from llama.cpp's keys ({} for a dense model). Whether the chosen experts' weights
    are renormalised: expert_weights_norm where the file says it, else what llama.cpp does for the architecture
    (Mixtral and Qwen3-MoE yes, Qwen2-MoE no). Sigmoid gating is DeepSeek-V3's routing (GLM-4.5): its groups, scale,
    leading dense layers and ungated shared experts from their keys."""
    experts = int(_gguf_field(reader, f"{arch}.expert_count", 0) or 0)
    if not experts:
        return {}

    def field(key: str, default=None):
        return _gguf_field(reader, f"{arch}.{key}", default)

    gating = field("expert_gating_func")
    if gating is None and arch == "dots1":  # (its converter wrote no gating function at first: sigmoid, as it is)
        gating = 2
    if gating is None and arch == "deepseek2":
        # DeepSeek V2's files carry none: softmax, as llama.cpp reads them; a file with the routers' correction
        # biases routes by sigmoid whatever it says (the biases exist for nothing else)
        gating = 2 if "blk.{}.exp_probs_b.bias".format(int(field("leading_dense_block_count", 0) or 0)) in {
            t.name for t in reader.tensors} else 1
    if gating not in (None, 1, 2):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX, _SIGMOID
        raise CoreError(f"{source}: GGUF expert gating function {gating} is not supported (softmax, sigmoid)",
                        ErrorKind.UNSUPPORTED_MODEL)
    size = int(field("expert_feed_forward_length") or need("feed_forward_length"))
    norm = field("expert_weights_norm")
    out = dict(num_experts=experts, experts_per_token=int(need("expert_used_count")), expert_intermediate_size=size,
               norm_topk_prob=bool(arch not in ("qwen2moe", "deepseek2", "olmoe") if norm is None else norm),
               shared_expert_intermediate_size=int(field("expert_shared_feed_forward_length", 0) or 0))
    if arch == "deepseek2":  # (DeepSeek V2's softmax routing too: ungated shared experts, the scale on the chosen)
        out.update(shared_expert_gate=False, shared_expert_intermediate_size=size * int(field("expert_shared_count", 0)
                                                                                          or 0),
                   routed_scaling=float(field("expert_weights_scale", 1.0) or 1.0))
    if gating == 2:
        out.update(router_sigmoid=True, shared_expert_gate=False,
                   shared_expert_intermediate_size=size * int(field("expert_shared_count", 0) or 0),
                   expert_groups=int(field("expert_group_count", 1) or 1),
                   expert_groups_per_token=int(field("expert_group_used_count", 1) or 1),
                   routed_scaling=float(field("expert_weights_scale", 1.0) or 1.0))
    dense = int(field("leading_dense_block_count", 0) or 0)
    if dense:
        out["dense_layers"] = tuple(range(dense))
    names = {t.name: t for t in reader.tensors}
    if arch in ("ernie4_5-moe", "hunyuan-moe"):
        # ERNIE 4.5's experts chosen by softmax score plus a correction bias (exp_probs_b), its routed layers those
        # with a router (leading_dense_block_count and interleave_moe_layer_step leave the last one unsaid); both
        # families' shared MLPs ungated, their width read off ffn_up_shexp (ERNIE's converter derives the key)
        layers = int(need("block_count"))
        out.update(shared_expert_gate=False, dense_layers=tuple(
            i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names))
        shared = next((names[f"blk.{i}.ffn_up_shexp.weight"] for i in range(layers)
                       if f"blk.{i}.ffn_up_shexp.weight" in names), None)
        out["shared_expert_intermediate_size"] = int(shared.shape[1]) if shared is not None else 0
        if arch == "ernie4_5-moe":
            out["router_correction_bias"] = True
    return out


def _gguf_config(reader, source: str) -> ModelConfig:
    arch = _gguf_field(reader, "general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise CoreError(f"{source}: GGUF architecture {arch!r} is not supported (supported: "
                        f"{', '.join(_GGUF_ARCHITECTURES)})", ErrorKind.UNSUPPORTED_MODEL)
    tensor_names = {t.name for t in reader.tensors}

    def need(key: str):
        value = _gguf_field(reader, f"{arch}.{key}")
        if value is None:
            raise CoreError(f"{source}: GGUF metadata has no {arch}.{key}", ErrorKind.SOURCE_FORMAT)
        return value

    if arch in ("nemotron_h", "nemotron_h_moe"):
        return _gguf_nemotron_h_config(reader, arch, source, need, tensor_names)
    if arch in ("mamba", "mamba2"):
        return _gguf_mamba_lm_config(reader, arch, source, need, tensor_names)
    if arch == "deepseek2":
        return _gguf_deepseek2_config(reader, arch, source, need, tensor_names)
    if arch == "gemma4":
        return _gguf_gemma4_config(reader, arch, source, need, tensor_names)
    scaling_type = _gguf_field(reader, f"{arch}.rope.scaling.type", "none")
    rope_scaling = None
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(need("rope.scaling.factor"))}
    elif scaling_type == "yarn":
        rope_scaling = _gguf_yarn(reader, arch, source, need, log_multiplier=arch == "mistral3")
    elif scaling_type != "none":
        raise CoreError(f"{source}: GGUF rope scaling {scaling_type!r} is not supported", ErrorKind.UNSUPPORTED_MODEL)
    if "rope_factors_long.weight" in tensor_names or "rope_factors_short.weight" in tensor_names:
        if rope_scaling is not None:
            raise CoreError(f"{source}: GGUF rope scaling {scaling_type!r} beside long/short rope factors is not "
                            "supported", ErrorKind.UNSUPPORTED_MODEL)
        # Phi-3's LongRoPE, as llama.cpp's converter writes it: both tables as tensors, the attention factor and the
        # original context as keys
        rope_scaling = {"rope_type": "longrope",
                        "short_factor": _gguf_vector(reader, "rope_factors_short.weight", source),
                        "long_factor": _gguf_vector(reader, "rope_factors_long.weight", source),
                        "original_max_position_embeddings": int(need("rope.scaling.original_context_length")),
                        "attention_factor": float(_gguf_field(reader, f"{arch}.rope.scaling.attn_factor", 1.0))}
    if "rope_freqs.weight" in tensor_names:
        # Llama 3.1's rope scaling as llama.cpp stores it: a divisor per frequency
        if rope_scaling is not None:
            raise CoreError(f"{source}: GGUF rope scaling {rope_scaling['rope_type']!r} beside rope_freqs is not "
                            "supported", ErrorKind.UNSUPPORTED_MODEL)
        rope_scaling = {"rope_type": "factors", "factors": _gguf_vector(reader, "rope_freqs.weight", source)}
    num_heads = int(need("attention.head_count"))
    hidden_size = int(need("embedding_length"))
    vocab_size = _gguf_field(reader, f"{arch}.vocab_size")
    if vocab_size is None:
        tokens = _gguf_field(reader, "tokenizer.ggml.tokens")
        if tokens is None:
            raise CoreError(f"{source}: GGUF metadata has neither {arch}.vocab_size nor a token list", ErrorKind.SOURCE_FORMAT)
        vocab_size = len(tokens)
    head_dim = _gguf_field(reader, f"{arch}.attention.key_length") or hidden_size // num_heads
    rotated = _gguf_field(reader, f"{arch}.rope.dimension_count")
    rotary_dim = None
    if rotated is not None and int(rotated) != int(head_dim):
        if arch not in ("phi3", "phi2", "stablelm", "gptneox", "glm4", "glm4moe", *_GATED_DELTA_GGUF):  # (llama.cpp's converter permutes whole heads for the others)
            raise CoreError(f"{source}: partial rotary embeddings ({arch}.rope.dimension_count {rotated} of "
                            f"head_dim {head_dim}) are not supported", ErrorKind.UNSUPPORTED_MODEL)
        rotary_dim = int(rotated)
    has_bias = "blk.0.attn_q.bias" in tensor_names or "blk.0.attn_qkv.bias" in tensor_names
    layer_flags = {}  # how the family's layer differs from Llama's
    if arch == "gemma3":
        # What llama.cpp assumes of Gemma 3 GGUFs: every sixth layer global (unless the file says its pattern), the
        # others windowed with plain rope at theta 10000; 27B (62 layers) scales queries by (hidden / heads)^-0.5,
        # the others by head_dim^-0.5 (transformers' query_pre_attn_scalar). The norms hold 1 + w already.
        layers = int(need("block_count"))
        window = int(_gguf_field(reader, f"{arch}.attention.sliding_window", 4096))
        pattern = int(_gguf_field(reader, f"{arch}.attention.sliding_window_pattern", 6))
        layer_flags = dict(embed_scale=True, hidden_act="gelu_pytorch_tanh", sandwich_norm=True,
                           attention_scale=(hidden_size / num_heads if layers == 62 else int(head_dim)) ** -0.5,
                           layer_windows=tuple(0 if (i + 1) % pattern == 0 else window for i in range(layers)),
                           local_rope_theta=10000.0)
    elif arch == "gemma2":
        # llama.cpp's Gemma 2: every other layer windowed (the even ones), one rope, soft caps from the file; 27B (46
        # layers) scales queries by (hidden / heads)^-0.5, the others by head_dim^-0.5. Norms hold 1 + w.
        layers = int(need("block_count"))
        window = int(_gguf_field(reader, f"{arch}.attention.sliding_window", 4096))
        caps = {key: float(value) if (value := _gguf_field(reader, f"{arch}.{key}")) is not None else None
                for key in ("attn_logit_softcapping", "final_logit_softcapping")}
        layer_flags = dict(embed_scale=True, hidden_act="gelu_pytorch_tanh", sandwich_norm=True,
                           attention_scale=(hidden_size / num_heads if layers == 46 else int(head_dim)) ** -0.5,
                           layer_windows=tuple(window if i % 2 == 0 else 0 for i in range(layers)), **caps)
    elif arch == "olmo2":  # norms after attention and the MLP only, q/k norms over all heads
        layer_flags = dict(sandwich_norm=True, pre_norm=False, qk_norm_whole=True)
    elif arch in ("command-r", "cohere2"):
        # Cohere's: LayerNorms, parallel attention and MLP, q/k rows as released (interleaved pairs), scaled logits;
        # Cohere2's three windowed layers in four rotated, the fourth not, as llama.cpp assumes
        layer_flags = dict(layer_norm=True, parallel_block=True, rope_interleaved=True,
                           logits_scaling=1.0 / float(need("logit_scale")))
        if arch == "cohere2":
            layers, window = int(need("block_count")), int(need("attention.sliding_window"))
            layer_flags.update(layer_windows=tuple(window if i % 4 < 3 else 0 for i in range(layers)),
                               nope_layers=tuple(i for i in range(layers) if i % 4 == 3))
    elif arch == "glm4":  # four norms a layer; q/k rows as released: interleaved pairs (llama.cpp's "norm" rope)
        layer_flags = dict(sandwich_norm=True, rope_interleaved=True)
    elif arch == "starcoder2":  # biased LayerNorms (and MLP: ffn_up, ffn_down), tanh-GELU ungated
        layer_flags = dict(layer_norm=True, norm_bias=True, mlp_bias="blk.0.ffn_up.bias" in tensor_names,
                           mlp_gated=False, hidden_act="gelu_pytorch_tanh")
    elif arch in ("gpt2", "starcoder"):  # learned positions (position_embd), biased LayerNorms, projections and MLP,
        # tanh-GELU ungated, q/k/v in one attn_qkv
        layer_flags = dict(layer_norm=True, norm_bias=True, mlp_bias=True, mlp_gated=False,
                           hidden_act="gelu_pytorch_tanh", position_embeddings=True,
                           nope_layers=tuple(range(int(need("block_count")))))
    elif arch in ("bloom", "mpt"):  # ALiBi (llama.cpp's slopes, MPT's max_alibi_bias), q/k/v in one attn_qkv, LayerNorms
        # (BLOOM's biased, with the embeddings' own: token_embd_norm; MPT's weights alone), an ungated GELU MLP
        layers = int(need("block_count"))
        bloom = arch == "bloom"
        layer_flags = dict(layer_norm=True, norm_bias=bloom, mlp_bias=bloom, mlp_gated=False,
                           hidden_act="gelu_pytorch_tanh" if bloom else "gelu", embedding_layer_norm=bloom,
                           alibi_slopes=alibi_slopes(num_heads, float(_gguf_field(
                               reader, f"{arch}.attention.max_alibi_bias", 8.0))),
                           clip_qkv=float(_gguf_field(reader, f"{arch}.attention.clamp_kqv", 0.0) or 0.0),
                           nope_layers=tuple(range(layers)))
    elif arch == "stablelm":  # Llama's layer between biased LayerNorms, part of each head rotated (halves: no
        # permutation); 12B's parallel residual and a LayerNorm a q and k head (attn_q_norm / attn_k_norm [heads, d])
        layer_flags = dict(layer_norm=True, norm_bias=True,
                           parallel_block=bool(_gguf_field(reader, f"{arch}.use_parallel_residual", False)),
                           qk_layer_norm_per_head="blk.0.attn_q_norm.weight" in tensor_names)
    elif arch == "gptneox":  # biased LayerNorms, attention and an ungated exact-GELU MLP side by side (each from its own
        # norm) where use_parallel_residual, q/k/v in one attn_qkv (the converter's blocks), part of each head rotated
        parallel = bool(_gguf_field(reader, f"{arch}.use_parallel_residual", True))
        layer_flags = dict(layer_norm=True, norm_bias=True, parallel_block=parallel, parallel_norms=parallel,
                           mlp_bias=True, mlp_gated=False, hidden_act="gelu")
    elif arch == "phi2":  # one biased LayerNorm feeding attention and an ungated tanh-GELU MLP side by side, biases
        # everywhere (the LM head's too), part of each head rotated (rotate-half: no permutation)
        layer_flags = dict(layer_norm=True, norm_bias=True, parallel_block=True, mlp_bias=True, mlp_gated=False,
                           hidden_act="gelu_pytorch_tanh", lm_head_bias="output.bias" in tensor_names)
    elif arch == "falcon":  # attention and an ungated GELU MLP side by side from one LayerNorm (40B, 180B: one each,
        # attn_norm_2 the MLP's); q, k and v in one attn_qkv, reordered by the converter to the queries, keys, values
        layer_flags = dict(layer_norm=True, norm_bias=True, parallel_block=True,
                           parallel_norms="blk.0.attn_norm_2.weight" in tensor_names, mlp_gated=False,
                           hidden_act="gelu", mlp_bias="blk.0.ffn_up.bias" in tensor_names)
    elif arch == "olmoe":  # q/k norms over the whole projections
        layer_flags = dict(qk_norm_whole=True)
    elif arch == "arcee":  # an ungated ReLU-squared MLP (ffn_up, ffn_down)
        layer_flags = dict(hidden_act="relu2", mlp_gated=False)
    elif arch in ("ernie4_5", "ernie4_5-moe"):  # q/k rows as released: interleaved pairs over the whole head
        layer_flags = dict(rope_interleaved=True)
    elif arch in ("hunyuan-dense", "hunyuan-moe"):
        # Hunyuan's per-head q/k norms after rope; its NTK-alpha rope already folded into freq_base by the converter
        layer_flags = dict(qk_norm_after_rope=True)
    elif arch == "llama4":
        # What llama.cpp assumes of Llama 4 (its files carry none of it): q/k rows as released (interleaved pairs);
        # every fourth layer unrotated over the whole context, its queries temperature-tuned (0.1, 8192), the others
        # in 8192-token chunks with weightless q/k norms (but Maverick's, 128 experts); a sliding_window of 0 (MobileLLM)
        # turns chunks and unrotated layers off
        layers = int(need("block_count"))
        whole = _gguf_field(reader, f"{arch}.attention.sliding_window") == 0
        nope = () if whole else tuple(i for i in range(layers) if (i + 1) % 4 == 0)
        layer_flags = dict(rope_interleaved=True, nope_layers=nope,
                           qk_l2_norm=int(_gguf_field(reader, f"{arch}.expert_count", 0) or 0) != 128)
        if not whole:
            layer_flags.update(attention_chunk_size=8192, chunked_layers=tuple(i for i in range(layers) if i not in nope),
                               nope_temperature_scale=0.1, nope_temperature_floor=8192)
    elif arch == "gpt-oss":
        # What llama.cpp assumes of gpt-oss: the even layers windowed, attention sinks, biased experts softmaxed
        # among the chosen, the clamped SwiGLU at alpha 1.702, limit 7
        layers = int(need("block_count"))
        window = int(need("attention.sliding_window"))
        layer_flags = dict(layer_windows=tuple(window if i % 2 == 0 else 0 for i in range(layers)),
                           attention_sinks=True, expert_bias=True, router_topk_softmax=True, swiglu_limit=7.0,
                           swiglu_alpha=1.702)
    elif arch in ("lfm2", "lfm2moe", "granitehybrid"):
        # LFM2's and Granite 4.0-H's recurrent layers are those whose head_count_kv (a list, one a layer) is 0
        per_layer = _gguf_field(reader, f"{arch}.attention.head_count_kv")
        layers = int(need("block_count"))
        if not isinstance(per_layer, list) or len(per_layer) != layers:
            raise CoreError(f"{source}: GGUF {arch}.attention.head_count_kv must give each layer its kv heads",
                            ErrorKind.SOURCE_FORMAT)
        linear = tuple(i for i, n in enumerate(per_layer) if not n)
        layer_flags = dict(linear_layers=linear, num_kv_heads=max(per_layer))
        if arch != "granitehybrid":
            layer_flags.update(linear_kind="short_conv", linear_conv_kernel=int(need("shortconv.l_cache")))
        elif linear:  # Mamba-2 (the heads as the ssm time step rank, its groups' B and C state_size wide)
            heads = int(need("ssm.time_step_rank"))
            layer_flags.update(linear_kind="mamba2", linear_value_heads=heads,
                               linear_value_dim=int(need("ssm.inner_size")) // heads,
                               linear_key_heads=int(need("ssm.group_count")), linear_key_dim=int(need("ssm.state_size")),
                               linear_conv_kernel=int(need("ssm.conv_kernel")),
                               linear_conv_bias=f"blk.{linear[0]}.ssm_conv1d.bias" in tensor_names)
        if arch == "granitehybrid" and not _gguf_field(reader, f"{arch}.rope.scaling.finetuned", True):
            layer_flags["nope_layers"] = tuple(range(layers))  # (its converter's flag for "no rope": Granite 4.0-H)
    elif arch == "jamba":
        # Jamba as llama.cpp's converter writes it: a 0 in head_count_kv (a list) for each Mamba-1 layer, the others
        # unrotated attention; the ssm keys (inner size: the channels; time step rank: dt's)
        per_layer = _gguf_field(reader, f"{arch}.attention.head_count_kv")
        layers = int(need("block_count"))
        if not isinstance(per_layer, list) or len(per_layer) != layers:
            raise CoreError(f"{source}: GGUF {arch}.attention.head_count_kv must give each layer its kv heads",
                            ErrorKind.SOURCE_FORMAT)
        linear = tuple(i for i, n in enumerate(per_layer) if not n)
        layer_flags = dict(num_kv_heads=max(per_layer), nope_layers=tuple(i for i, n in enumerate(per_layer) if n))
        if linear:
            layer_flags.update(linear_layers=linear, linear_kind="mamba1",
                               linear_value_heads=int(need("ssm.inner_size")), linear_value_dim=1, linear_key_heads=1,
                               linear_key_dim=int(need("ssm.state_size")), linear_conv_kernel=int(need("ssm.conv_kernel")),
                               linear_conv_bias=f"blk.{linear[0]}.ssm_conv1d.bias" in tensor_names,
                               linear_dt_rank=int(need("ssm.time_step_rank")))
    elif arch == "falcon-h1":
        # Falcon-H1 as llama.cpp's converter writes it: every layer attention and a Mamba-2 mixer side by side (Mamba-2's
        # ssm keys), ssm_norm only where the mixer has its norm; the muP multipliers folded into the weights (the
        # embedding's and the LM head's too)
        heads = int(need("ssm.time_step_rank"))
        layers = int(need("block_count"))
        layer_flags = dict(linear_layers=tuple(range(layers)), linear_kind="mamba2", parallel_mixers=True,
                           linear_norm="blk.0.ssm_norm.weight" in tensor_names, linear_value_heads=heads,
                           linear_value_dim=int(need("ssm.inner_size")) // heads,
                           linear_key_heads=int(need("ssm.group_count")), linear_key_dim=int(need("ssm.state_size")),
                           linear_conv_kernel=int(need("ssm.conv_kernel")),
                           linear_conv_bias="blk.0.ssm_conv1d.bias" in tensor_names)
    elif arch in _GATED_DELTA_GGUF:
        # Qwen3-Next / Qwen3.5: every full_attention_interval-th layer gated attention, the rest Gated DeltaNet
        # (llama.cpp's ssm keys: the key heads as groups, the value heads as the time step rank)
        layers = int(need("block_count")) - int(_gguf_field(reader, f"{arch}.nextn_predict_layers", 0) or 0)
        interval = int(_gguf_field(reader, f"{arch}.full_attention_interval", 4))
        value_heads = int(need("ssm.time_step_rank"))
        layer_flags = dict(attn_output_gate=True, linear_kind="gated_delta",
                           linear_layers=tuple(i for i in range(layers) if (i + 1) % interval),
                           linear_key_heads=int(need("ssm.group_count")), linear_value_heads=value_heads,
                           linear_key_dim=int(need("ssm.state_size")),
                           linear_value_dim=int(need("ssm.inner_size")) // value_heads,
                           linear_conv_kernel=int(need("ssm.conv_kernel")))
    experts = _gguf_experts(reader, arch, source, need)
    if arch == "gpt-oss":
        experts["norm_topk_prob"] = False  # (the softmax over the chosen sums to 1 already)
    if arch == "jamba" and experts:  # Jamba's chosen weights as they are; the layers without a router dense
        experts.update(norm_topk_prob=False, dense_layers=tuple(
            i for i in range(int(need("block_count"))) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names))
    if arch == "llama4" and experts:  # (every interleave_moe_layer_step-th layer routed; its shared MLP ungated)
        step = int(_gguf_field(reader, f"{arch}.interleave_moe_layer_step", 1) or 1)
        experts.update(norm_topk_prob=False, router_input_scale=True, shared_expert_gate=False,
                       shared_expert_intermediate_size=experts["expert_intermediate_size"],
                       dense_layers=tuple(i for i in range(int(need("block_count"))) if (i + 1) % step))
    if arch in ("granitehybrid", "granitemoe") and experts:  # Granite's router: the top logits softmaxed, shared
        # MLP ungated
        experts.update(norm_topk_prob=False, router_topk_softmax=True, shared_expert_gate=False)
    granite = {}
    if arch in ("granite", "granitehybrid", "granitemoe"):  # its multipliers, under llama.cpp's names
        granite = dict(embedding_multiplier=float(need("embedding_scale")), residual_multiplier=float(need("residual_scale")),
                       logits_scaling=float(need("logit_scale")), attention_scale=float(need("attention.scale")))
    if arch == "minicpm":  # MiniCPM (1, 2, 4): Llama with muP scales as llama.cpp stores them, Granite's three
        # multipliers (the attention's scale its own: head_dim^-0.5)
        granite = dict(embedding_multiplier=float(need("embedding_scale")), residual_multiplier=float(need("residual_scale")),
                       logits_scaling=float(need("logit_scale")))
    if arch == "mistral3" and _gguf_field(reader, f"{arch}.attention.temperature_scale"):
        # Ministral 3's queries scaled by position: llama.cpp's temperature over the YaRN original context
        layer_flags.update(query_position_scale=float(need("attention.temperature_scale")),
                           query_position_floor=int(_gguf_field(reader, f"{arch}.attention.temperature_length")
                                                    or need("rope.scaling.original_context_length")))
    if arch == "smollm3":  # llama.cpp's rule for SmolLM3: every fourth layer unrotated
        layer_flags["nope_layers"] = tuple(i for i in range(int(need("block_count"))) if (i + 1) % 4 == 0)
    return ModelConfig(
        architecture=_GGUF_ARCHITECTURES[arch],
        vocab_size=int(vocab_size),
        hidden_size=hidden_size,
        intermediate_size=int(_gguf_field(reader, f"{arch}.feed_forward_length")
                              or experts.get("expert_intermediate_size") or need("feed_forward_length")),
        # (GLM-4.5's multi-token-prediction layers follow the model's in block_count)
        num_layers=int(need("block_count")) - int(_gguf_field(reader, f"{arch}.nextn_predict_layers", 0) or 0),
        num_heads=num_heads,
        **({} if "num_kv_heads" in layer_flags else
           {"num_kv_heads": int(_gguf_field(reader, f"{arch}.attention.head_count_kv", num_heads))}),
        head_dim=int(head_dim),
        rms_norm_eps=float(need("attention.layer_norm_epsilon" if layer_flags.get("layer_norm")
                                else "attention.layer_norm_rms_epsilon")),
        rope_theta=float(_gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=has_bias,
        qk_norm=any(n.endswith(".attn_q_norm.weight") for n in tensor_names),  # (a hybrid's first layer has none)
        attention_out_bias="blk.0.attn_output.bias" in tensor_names,
        rotary_dim=rotary_dim,
        sliding_window=int(_gguf_field(reader, f"{arch}.attention.sliding_window", 0) or 0) or None
        if arch == "phi3" else None,
        **layer_flags,
        **experts,
        **granite,
    )


def _gguf_gemma4_config(reader, arch: str, source: str, need, tensor_names: set[str]) -> ModelConfig:
    """Gemma 4 as llama.cpp's converter writes it: sliding_window_pattern (True: a windowed layer), the global
    layers' head dim as key_length and the windowed ones' as key_length_swa, head_count_kv a list where the global
    layers have kv heads of their own, freq_base for the global layers and freq_base_swa for the windowed, their
    proportional rope as rope_freqs (1 for each rotated frequency, 1e30 for the others), shared_kv_layers,
    embedding_length_per_layer_input (E2B / E4B), feed_forward_length a list where the shared layers' MLPs are
    twice as wide, and 26B-A4B's experts beside the MLP. What the converter does not write is Gemma 4's: queries
    unscaled, values normed, a scalar a layer, norms as they are. Keys as values (attention_k_eq_v) where a global
    layer has no attn_v."""
    layers = int(need("block_count"))
    pattern = _gguf_field(reader, f"{arch}.attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != layers:
        raise CoreError(f"{source}: GGUF {arch}.attention.sliding_window_pattern must mark each layer",
                        ErrorKind.SOURCE_FORMAT)
    window = int(need("attention.sliding_window"))
    windows = tuple(window if windowed else 0 for windowed in pattern)
    global_dim = int(need("attention.key_length"))
    head_dim = int(_gguf_field(reader, f"{arch}.attention.key_length_swa") or global_dim)
    rotated_swa = int(_gguf_field(reader, f"{arch}.rope.dimension_count_swa") or head_dim)
    if rotated_swa != head_dim:
        raise CoreError(f"{source}: partial rotary embeddings on Gemma 4's windowed layers ({rotated_swa} of {head_dim})"
                        " are not supported", ErrorKind.UNSUPPORTED_MODEL)
    kv = _gguf_field(reader, f"{arch}.attention.head_count_kv")
    kv = list(kv) if isinstance(kv, list) else [int(kv)] * layers
    local_kv = {int(n) for n, windowed in zip(kv, pattern) if windowed}
    global_kv = {int(n) for n, windowed in zip(kv, pattern) if not windowed}
    if len(local_kv) > 1 or len(global_kv) > 1:
        raise CoreError(f"{source}: Gemma 4 layers of other kv heads than their kind's are not supported",
                        ErrorKind.UNSUPPORTED_MODEL)
    num_kv = local_kv.pop() if local_kv else global_kv.copy().pop()
    scaling = None
    if "rope_freqs.weight" in tensor_names:  # the global layers' proportional rope: 1 where a frequency turns
        factors = _gguf_vector(reader, "rope_freqs.weight", source)
        turned = next((i for i, f in enumerate(factors) if f != 1.0), len(factors))
        if any(f < 1e29 for f in factors[turned:]):
            raise CoreError(f"{source}: Gemma 4 rope_freqs other than the proportional rope's are not supported",
                            ErrorKind.UNSUPPORTED_MODEL)
        if turned * 2 != global_dim:
            scaling = {"rope_type": "proportional", "partial_rotary_factor": 2 * turned / global_dim}
    widths = _gguf_field(reader, f"{arch}.feed_forward_length")
    widths = [int(w) for w in widths] if isinstance(widths, list) else [int(widths)] * layers
    shared = int(_gguf_field(reader, f"{arch}.attention.shared_kv_layers", 0) or 0)
    per_layer = int(_gguf_field(reader, f"{arch}.embedding_length_per_layer_input", 0) or 0)
    names = {t.name: t for t in reader.tensors}
    glob = [i for i, windowed in enumerate(pattern) if not windowed and i < layers - shared]
    experts = {}
    if int(_gguf_field(reader, f"{arch}.expert_count", 0) or 0):
        experts = dict(num_experts=int(need("expert_count")), experts_per_token=int(need("expert_used_count")),
                       expert_intermediate_size=int(need("expert_feed_forward_length")), norm_topk_prob=True,
                       parallel_experts=True)
    vocab_size = _gguf_field(reader, f"{arch}.vocab_size") or int(names["token_embd.weight"].shape[1])
    cap = _gguf_field(reader, f"{arch}.final_logit_softcapping")
    return ModelConfig(
        architecture="gemma4", vocab_size=int(vocab_size), hidden_size=int(need("embedding_length")),
        intermediate_size=widths[0], num_layers=layers, num_heads=int(need("attention.head_count")),
        num_kv_heads=num_kv, head_dim=head_dim, rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(_gguf_field(reader, f"{arch}.rope.freq_base", 1e6)), rope_scaling=scaling,
        max_position_embeddings=int(need("context_length")), tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=False, qk_norm=True, embed_scale=True, hidden_act="gelu_pytorch_tanh", sandwich_norm=True,
        attention_scale=1.0, layer_windows=windows,
        local_rope_theta=float(_gguf_field(reader, f"{arch}.rope.freq_base_swa", 10000.0)),
        final_logit_softcapping=float(cap) if cap else None,
        global_head_dim=0 if global_dim == head_dim else global_dim,
        global_kv_heads=global_kv.pop() if global_kv else 0,
        value_from_key=bool(glob) and all(f"blk.{i}.attn_v.weight" not in names for i in glob),
        v_norm=True, layer_scalars="blk.0.layer_output_scale.weight" in names, **experts,
        per_layer_input_dim=per_layer,
        per_layer_vocab=int(names["per_layer_token_embd.weight"].shape[1]) if per_layer else 0,
        kv_shared_layers=shared, double_wide_mlp=bool(shared) and widths[-1] == 2 * widths[0])


def _gguf_gemma4(config: ModelConfig, take, raw: dict) -> dict[str, torch.Tensor]:
    """Gemma 4's tensors under llama.cpp's names (gguf-py's tensor map), norms as they are."""
    out = {"embed.weight": take("token_embd.weight"), "final_norm.weight": take("output_norm.weight")}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = take("output.weight")
    if config.per_layer_input_dim:
        out.update({"embed_per_layer.weight": take("per_layer_token_embd.weight"),
                    "per_layer_proj.weight": take("per_layer_model_proj.weight"),
                    "per_layer_proj_norm.weight": take("per_layer_proj_norm.weight")})
    for i in range(config.num_layers):
        gp, sp = f"blk.{i}.", f"layers.{i}."
        if config.kv_source(i) is not None:  # (a shared-KV layer: its queries alone)
            out[sp + "qkv.weight"] = take(gp + "attn_q.weight")
        else:
            out[sp + "qkv.weight"] = torch.cat([take(gp + f"attn_{x}.weight") for x in "qkv"
                                                if x != "v" or gp + "attn_v.weight" in raw])
            out[sp + "k_norm.weight"] = take(gp + "attn_k_norm.weight")
        out.update({sp + "q_norm.weight": take(gp + "attn_q_norm.weight"), sp + "o.weight": take(gp + "attn_output.weight"),
                    sp + "attn_norm.weight": take(gp + "attn_norm.weight"),
                    sp + "post_attn_norm.weight": take(gp + "post_attention_norm.weight"),
                    sp + "mlp_norm.weight": take(gp + "ffn_norm.weight"),
                    sp + "post_mlp_norm.weight": take(gp + "post_ffw_norm.weight"),
                    sp + "gate_up.weight": torch.cat([take(gp + "ffn_gate.weight"), take(gp + "ffn_up.weight")]),
                    sp + "down.weight": take(gp + "ffn_down.weight")})
        if config.layer_scalars:
            out[sp + "scalar"] = take(gp + "layer_output_scale.weight").reshape(1)
        if config.per_layer_input_dim:
            out.update({sp + "per_layer_gate.weight": take(gp + "inp_gate.weight"),
                        sp + "per_layer_out.weight": take(gp + "proj.weight"),
                        sp + "per_layer_norm.weight": take(gp + "post_norm.weight")})
        if config.parallel_experts:
            out.update({sp + ours: take(gp + theirs) for ours, theirs in zip(_PARALLEL_EXPERTS, _GGUF_PARALLEL_EXPERTS)})
    return out


def _gguf_nemotron_h_config(reader, arch: str, source: str, need, tensor_names: set[str]) -> ModelConfig:
    """Nemotron-H's GGUF (llama.cpp's nemotron_h / nemotron_h_moe): each block's kind from its tensors (ssm_in: a
    Mamba-2 mixer, attn_q: attention, ffn_gate_inp: experts, ffn_up: an MLP), the sizes from the ssm, attention,
    feed-forward (per block: the largest) and expert keys, read as the checkpoint's config would be
    (config._nemotron_h_from_hf)."""
    from flared.model.config import _nemotron_h_from_hf

    blocks = int(need("block_count"))
    kinds = []
    for b in range(blocks):
        found = [kind for tensor, kind in (("ssm_in", "linear_attention"), ("attn_q", "full_attention"),
                                           ("ffn_gate_inp", "moe"), ("ffn_up", "mlp"))
                 if f"blk.{b}.{tensor}.weight" in tensor_names]
        if len(found) != 1:
            raise CoreError(f"{source}: GGUF block {b} must hold one of a Mamba-2 mixer, attention, experts or an MLP "
                            f"(found {found or 'none'})", ErrorKind.SOURCE_FORMAT)
        kinds.append(found[0])

    def one(value) -> int:  # a per-block list's largest entry, or the value
        return int(max(value)) if isinstance(value, list) else int(value)

    def field(key: str, default=None):
        return _gguf_field(reader, f"{arch}.{key}", default)

    heads = int(field("ssm.time_step_rank", 1) or 1)
    vocab_size = field("vocab_size") or len(_gguf_field(reader, "tokenizer.ggml.tokens") or ()) or None
    if vocab_size is None:
        raise CoreError(f"{source}: GGUF metadata has neither {arch}.vocab_size nor a token list",
                        ErrorKind.SOURCE_FORMAT)
    num_heads = need("attention.head_count")
    hf = dict(model_type="nemotron_h", layers_block_type=kinds, vocab_size=int(vocab_size),
              hidden_size=int(need("embedding_length")), num_attention_heads=one(num_heads),
              num_key_value_heads=one(field("attention.head_count_kv", num_heads)),
              head_dim=int(field("attention.key_length") or int(need("embedding_length")) // one(num_heads)),
              intermediate_size=one(field("feed_forward_length", 0) or 0) or 1,
              max_position_embeddings=int(need("context_length")),
              tie_word_embeddings="output.weight" not in tensor_names,
              layer_norm_epsilon=float(need("attention.layer_norm_rms_epsilon")),
              mamba_num_heads=heads, mamba_head_dim=int(field("ssm.inner_size", heads) or heads) // heads,
              n_groups=int(field("ssm.group_count", 1) or 1), ssm_state_size=int(field("ssm.state_size", 1) or 1),
              conv_kernel=int(field("ssm.conv_kernel", 4) or 4),
              use_conv_bias=any(n.endswith(".ssm_conv1d.bias") for n in tensor_names))
    if "moe" in kinds:
        size = int(need("expert_feed_forward_length"))
        shared = field("expert_shared_feed_forward_length")
        hf.update(n_routed_experts=int(need("expert_count")), num_experts_per_tok=int(need("expert_used_count")),
                  moe_intermediate_size=size,
                  moe_shared_expert_intermediate_size=int(shared) if shared else
                  size * int(field("expert_shared_count", 0) or 0),
                  n_shared_experts=int(any(n.endswith(".ffn_up_shexp.weight") for n in tensor_names)),
                  norm_topk_prob=bool(field("expert_weights_norm", True)),
                  routed_scaling_factor=float(field("expert_weights_scale", 1.0) or 1.0),
                  n_group=int(field("expert_group_count", 1) or 1),
                  topk_group=int(field("expert_group_used_count", 1) or 1))
    return _nemotron_h_from_hf(hf, source)


def _gguf_mamba_lm_config(reader, arch: str, source: str, need, tensor_names: set[str]) -> ModelConfig:
    """A Mamba or Mamba-2 language model's GGUF (llama.cpp's mamba / mamba2: the ssm keys, no attention), read as its
    checkpoint's config would be (config._mamba_lm_from_hf); a mamba file with ssm.dt_b_c_rms is Falcon-Mamba's (its
    weightless norms on dt, B and C at the released mixer_rms_eps, 1e-6: the file keeps no epsilon of theirs)."""
    from flared.model.config import _mamba_lm_from_hf

    falcon = bool(_gguf_field(reader, f"{arch}.ssm.dt_b_c_rms"))
    hidden, inner = int(need("embedding_length")), int(need("ssm.inner_size"))
    vocab_size = _gguf_field(reader, f"{arch}.vocab_size") or len(_gguf_field(reader, "tokenizer.ggml.tokens") or ())
    hf = dict(vocab_size=int(vocab_size), hidden_size=hidden, num_hidden_layers=int(need("block_count")),
              layer_norm_epsilon=float(need("attention.layer_norm_rms_epsilon")),
              max_position_embeddings=int(_gguf_field(reader, f"{arch}.context_length", 0) or 0) or None,
              tie_word_embeddings="output.weight" not in tensor_names, state_size=int(need("ssm.state_size")),
              conv_kernel=int(need("ssm.conv_kernel")), expand=inner // hidden,
              use_conv_bias="blk.0.ssm_conv1d.bias" in tensor_names)
    if arch == "mamba":
        hf["time_step_rank"] = int(need("ssm.time_step_rank"))
    else:
        heads = int(need("ssm.time_step_rank"))
        hf.update(num_heads=heads, head_dim=inner // heads, n_groups=int(need("ssm.group_count")))
    return _mamba_lm_from_hf(hf, source, "falcon_mamba" if falcon else arch)


def _gguf_deepseek2_config(reader, arch: str, source: str, need, tensor_names: set[str]) -> ModelConfig:
    """DeepSeek V2 / V3 (and GLM-4.7-Flash, Kimi K2, Moonlight: the files llama.cpp's converter writes as deepseek2)
    from llama.cpp's keys. Its converter writes the latent attention as one kv head of kv_lora_rank + rope wide keys
    (key_length) for its absorbed kernels and the per-head sizes as key_length_mla / value_length_mla; files from
    before that carry the per-head sizes as key_length / value_length. Rope turns interleaved pairs (rows as
    released); YaRN's log multiplier is 0.1 * mscale_all_dim, folded into the query scale as transformers folds it."""
    layers = int(need("block_count")) - int(_gguf_field(reader, f"{arch}.nextn_predict_layers", 0) or 0)
    heads, hidden = int(need("attention.head_count")), int(need("embedding_length"))
    absorbed = _gguf_field(reader, f"{arch}.attention.key_length_mla") is not None
    head_dim = int(need("attention.key_length_mla" if absorbed else "attention.key_length"))
    v_dim = int(need("attention.value_length_mla" if absorbed else "attention.value_length"))
    rotated = int(need("rope.dimension_count"))
    scaling_type = _gguf_field(reader, f"{arch}.rope.scaling.type", "none")
    rope_scaling, scale = None, None
    if scaling_type == "yarn":
        log_multiplier = float(_gguf_field(reader, f"{arch}.rope.scaling.yarn_log_multiplier", 0.0) or 0.0)
        factor = float(need("rope.scaling.factor"))
        scaling = {"factor": factor, "original_max_position_embeddings": int(need("rope.scaling.original_context_length"))}
        for key in ("beta_fast", "beta_slow"):
            value = _gguf_field(reader, f"{arch}.rope.scaling.yarn_{key}")
            if value is not None:
                scaling[key] = float(value)
        if log_multiplier:  # mscale_all_dim (and mscale: every release has them equal, the rope unscaled)
            scaling.update(mscale=log_multiplier / 0.1, mscale_all_dim=log_multiplier / 0.1)
            mscale = log_multiplier * math.log(factor) + 1.0 if factor > 1 else 1.0
            scale = head_dim ** -0.5 * mscale * mscale
        rope_scaling = yarn_parameters(scaling, {})
    elif scaling_type != "none":
        raise CoreError(f"{source}: GGUF rope scaling {scaling_type!r} is not supported", ErrorKind.UNSUPPORTED_MODEL)
    experts = _gguf_experts(reader, arch, source, need)
    dense = int(_gguf_field(reader, f"{arch}.leading_dense_block_count", 0) or 0)
    if not experts and dense < layers:
        raise CoreError(f"{source}: GGUF {arch} names no experts but {layers - dense} layers after its dense ones",
                        ErrorKind.SOURCE_FORMAT)
    vocab = _gguf_field(reader, f"{arch}.vocab_size") or len(_gguf_field(reader, "tokenizer.ggml.tokens") or ())
    return ModelConfig(
        architecture="deepseek2", vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")), num_layers=layers, num_heads=heads, num_kv_heads=heads,
        head_dim=head_dim, rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(_gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)), rope_scaling=rope_scaling,
        max_position_embeddings=int(need("context_length")), tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=False, qk_norm=False, attention_scale=scale, rotary_dim=rotated, rope_interleaved=True,
        kv_lora_rank=int(need("attention.kv_lora_rank")),
        q_lora_rank=int(_gguf_field(reader, f"{arch}.attention.q_lora_rank", 0) or 0), v_head_dim=v_dim, **experts)


def _gguf_latent_attention(gp: str, sp: str, config: ModelConfig, take, raw: dict) -> dict[str, torch.Tensor]:
    """DeepSeek's latent attention from llama.cpp's tensors, through the checkpoint reader (the same reordering of the
    rotated rows). kv_b as released (attn_kv_b), or as newer converters split it for absorbed attention: attn_k_b,
    each head's unrotated key rows transposed [heads, kv_lora_rank, nope], and attn_v_b [heads, v_head_dim,
    kv_lora_rank]."""
    if gp + "attn_kv_b.weight" in raw:
        kv_b = raw[gp + "attn_kv_b.weight"]
    else:
        k_b, v_b = take(gp + "attn_k_b.weight"), take(gp + "attn_v_b.weight")
        kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, config.kv_lora_rank)
    names = {"kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight", "kv_a_layernorm.weight": "attn_kv_a_norm.weight",
             "q_a_proj.weight": "attn_q_a.weight", "q_a_layernorm.weight": "attn_q_a_norm.weight",
             "q_b_proj.weight": "attn_q_b.weight", "q_proj.weight": "attn_q.weight"}
    return _hf_latent_attention("", sp, config, lambda name: kv_b if name == "kv_b_proj.weight"
                                else take(gp + names[name]), layer=-1)  # (no indexer in these files)


def _gguf_nemotron_h(config: ModelConfig, take) -> dict[str, torch.Tensor]:
    """Nemotron-H's tensors from its GGUF blocks (blk.{block}: attn_norm, the Mamba mixer's ssm_* or
    attn_q/k/v/output, ffn_up / ffn_down, or the experts' ffn_gate_inp, exp_probs_b, ffn_up_exps / ffn_down_exps and
    *_shexp; a Mamba or Mamba-2 language model's the same) into the layers config.layer_blocks pairs them into."""
    names = dict(embed="token_embd.weight", final_norm="output_norm.weight", lm_head="output.weight",
                 norm="blk.{b}.attn_norm.weight", mixer="blk.{b}.", attn="blk.{b}.attn_{x}.weight",
                 o="blk.{b}.attn_output.weight", mlp="blk.{b}.ffn_{x}.weight", router="blk.{b}.ffn_gate_inp.weight",
                 correction_bias="blk.{b}.exp_probs_b.bias", shared="blk.{b}.ffn_{x}_shexp.weight")

    def expert_stacks(b: int, config: ModelConfig):
        return take(f"blk.{b}.ffn_up_exps.weight"), take(f"blk.{b}.ffn_down_exps.weight")

    return _paired_blocks(config, take, names, {"mamba1": _gguf_mamba1, "mamba2": _gguf_mamba2}, expert_stacks)


def _gguf_vector(reader, name: str, source: str) -> list[float]:
    """A small F32 tensor's values (rope factor tables)."""
    tensor = next((t for t in reader.tensors if t.name == name), None)
    if tensor is None:
        raise CoreError(f"{source}: GGUF has no tensor {name}", ErrorKind.SOURCE_FORMAT)
    if tensor.tensor_type.name != "F32":
        raise CoreError(f"{source}: GGUF tensor {name} is {tensor.tensor_type.name}, expected F32",
                        ErrorKind.SOURCE_FORMAT)
    return [float(x) for x in np.asarray(tensor.data, dtype=np.float32).ravel()]


def _gguf_yarn(reader, arch: str, source: str, need, *, log_multiplier: bool = False) -> dict:
    """YaRN as llama.cpp's converter writes it (factor, original context, optional betas); a log multiplier or an
    extra attention factor (DeepSeek's, gpt-oss') is refused rather than guessed. ``log_multiplier``: Mistral 3's
    yarn_log_multiplier is its mscale_all_dim, the attention factor mscale(factor, 1) / mscale(factor, it), as
    llama.cpp and transformers compute it."""
    scaling = {}
    if log_multiplier and _gguf_field(reader, f"{arch}.rope.scaling.yarn_log_multiplier") is not None:
        scaling.update(mscale=1.0, mscale_all_dim=float(_gguf_field(reader, f"{arch}.rope.scaling.yarn_log_multiplier")))
    for key, plain in (("yarn_log_multiplier", (0.0,) if not scaling else None), ("attn_factor", (1.0,)),
                       ("yarn_attn_factor", (1.0,)), ("yarn_ext_factor", (-1.0, 1.0))):  # -1: "as the type says"
        if plain is None:
            continue
        value = _gguf_field(reader, f"{arch}.rope.scaling.{key}")
        if value is not None and float(value) not in plain:
            raise CoreError(f"{source}: GGUF YaRN with {arch}.rope.scaling.{key} = {value} is not supported",
                            ErrorKind.UNSUPPORTED_MODEL)
    scaling.update({"factor": float(need("rope.scaling.factor")),
                    "original_max_position_embeddings": int(need("rope.scaling.original_context_length"))})
    for key in ("beta_fast", "beta_slow"):
        value = _gguf_field(reader, f"{arch}.rope.scaling.yarn_{key}")
        if value is not None:
            scaling[key] = float(value)
    return yarn_parameters(scaling, {})


def unpermute_qk(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time permutation of q/k rows (per head: interleaved
    rope pairs -> rotate-half halves)."""
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, half, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm.weight",
    "attn_output.weight": "o.weight",
    "attn_output.bias": "o.bias",
    "ffn_norm.weight": "mlp_norm.weight",
    "ffn_down.weight": "down.weight",
    "attn_q_norm.weight": "q_norm.weight",
    "attn_k_norm.weight": "k_norm.weight",
    "post_attention_norm.weight": "post_attn_norm.weight",  # Gemma 3's norms after attention and the MLP
    "post_ffw_norm.weight": "post_mlp_norm.weight",
    "attn_norm.bias": "attn_norm.bias",  # (StarCoder2's biased LayerNorms and MLP)
    "ffn_norm.bias": "mlp_norm.bias",
    "ffn_up.bias": "gate_up.bias",
    "ffn_down.bias": "down.bias",
    "attn_norm_2.weight": "mlp_norm.weight",  # (Falcon 40B's and 180B's norm before the MLP, beside attention's)
    "attn_norm_2.bias": "mlp_norm.bias",
}


def gguf_tensor_values(t, dtype: torch.dtype | None, source: str) -> torch.Tensor:
    """A GGUF tensor (GGUFFile's) as a torch tensor of its shape: a matrix in ``dtype`` (None: float32), a vector in
    float32."""
    from gguf.quants import dequantize

    try:
        shape = tuple(int(d) for d in reversed(t.shape))
        if _fast_gguf is not None and int(t.tensor_type) in _fast_gguf.TYPES:  # (C: the same values, ~10-50x)
            # a matrix for a bf16 export straight to bf16, rounded as .to(torch.bfloat16) rounds
            direct = dtype == torch.bfloat16 and len(shape) >= 2
            values = torch.from_numpy(_fast_gguf.dequantize(int(t.tensor_type), t.data, math.prod(shape),
                                                            torch.get_num_threads(), direct)).reshape(shape)
            if direct:
                values = values.view(torch.bfloat16)
        else:
            # np.array copies: F32 tensors come back as read-only views of the file's memory map.
            values = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape))
    except Exception as exc:
        raise CoreError(f"{source}: tensor {t.name} ({t.tensor_type.name}) cannot be dequantised: {exc}",
                        ErrorKind.SOURCE_FORMAT) from None
    return values.to(dtype) if dtype is not None and values.dim() >= 2 else values


def _read_gguf(path: Path, dtype: torch.dtype | None = None, mmproj: str | os.PathLike | None = None) -> SourceModel:
    """A model GGUF, with the image tower of an mmproj GGUF beside it where ``mmproj`` names one
    (flared.model.mmproj)."""
    from flared.frontend.gguf_metadata import GGUFFile
    from flared.model.mmproj import is_mmproj, read_mmproj

    source = str(path)
    try:
        reader = GGUFFile(source)
    except Exception as exc:  # a truncated or foreign file fails inside numpy memmap/struct parsing
        raise CoreError(f"{source} is not a readable GGUF file: {exc}", ErrorKind.SOURCE_FORMAT) from None
    if is_mmproj(reader):
        raise CoreError(f"{source} is an mmproj file (a model's image tower), not a model: give the model's GGUF, and "
                        "this file with --mmproj", ErrorKind.SOURCE_FORMAT)
    model = _read_gguf_model(reader, source, dtype)
    if mmproj is not None:
        tower = read_mmproj(mmproj, text_reader=reader, text_hidden_size=model.config.hidden_size,
                            text_eps=model.config.rms_norm_eps, dtype=dtype)
        model.vision, model.vision_tensors = tower.config, tower.tensors
        model.image_processor = (tower.preprocessor, tower.processor)
        if tower.second is not None:  # (Gemma 4's audio beside its images)
            model.audio, model.audio_tensors = tower.second.config, tower.second.tensors
            model.audio_processor = (tower.second.preprocessor, tower.second.processor)
    return model


def _read_gguf_model(reader, source: str, dtype: torch.dtype | None) -> SourceModel:
    config = _gguf_config(reader, source)
    arch = _gguf_field(reader, "general.architecture")
    # llama.cpp's converter permutes q/k rows for its interleaved rope: Llama's (Mixtral's) and SmolLM3's, not Phi-3's
    permute = arch in ("llama", "smollm3", "granite", "granitehybrid", "falcon-h1", "arcee", "granitemoe", "mistral3",
                       "internlm2", "minicpm")  # (InternLM2's: its wqkv split into Llama's q, k, v by the converter)

    raw: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        values = gguf_tensor_values(t, dtype, source)
        if (permute or config.rope_interleaved and not config.kv_lora_rank) and (".attn_q." in t.name
                                                                                  or ".attn_k." in t.name):
            heads = config.num_heads if ".attn_q." in t.name else config.num_kv_heads
            if permute:
                values = unpermute_qk(values, heads)
            else:  # GLM-4's interleaved pairs, turned to rotate-half as from its checkpoint
                values = interleaved_rope_rows(values, heads, config)
        raw[t.name] = values.contiguous()
        del values

    def take(name: str) -> torch.Tensor:
        try:
            return raw[name]
        except KeyError:
            raise CoreError(f"{source}: GGUF has no tensor {name}", ErrorKind.SOURCE_FORMAT) from None

    if arch == "gemma4":
        out = _gguf_gemma4(config, take, raw)
        check_serving_tensors(out, config, source=source)
        return SourceModel(config=config, tensors=out, source_kind="gguf")
    if arch in ("nemotron_h", "nemotron_h_moe", "mamba", "mamba2"):  # (a mixer alone a layer: the same blocks)
        out = _gguf_nemotron_h(config, take)
        check_serving_tensors(out, config, source=source)
        return SourceModel(config=config, tensors=out, source_kind="gguf")
    # (LFM2's final norm is its embedding_norm: token_embd_norm)
    out = {"embed.weight": take("token_embd.weight"),
           "final_norm.weight": take("token_embd_norm.weight" if config.short_conv else "output_norm.weight")}
    if config.position_embeddings:  # (GPT-2's and StarCoder's learned rows)
        out["pos_embed.weight"] = take("position_embd.weight")
    if config.lm_head_bias:  # (Phi-2's)
        out["lm_head.bias"] = take("output.bias")
    if config.embedding_layer_norm:  # (BLOOM's LayerNorm of the embeddings)
        out.update({"embed_norm.weight": take("token_embd_norm.weight"), "embed_norm.bias": take("token_embd_norm.bias")})
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = take("output.weight")
    if config.norm_bias:
        out["final_norm.bias"] = take("output_norm.bias")
    for i in range(config.num_layers):
        gp, sp = f"blk.{i}.", f"layers.{i}."
        if i in config.linear_layers and config.short_conv:  # LFM2's shortconv.in_proj / conv / out_proj
            out.update({sp + "linear_in.weight": take(gp + "shortconv.in_proj.weight"),
                        sp + "conv.weight": take(gp + "shortconv.conv.weight"),
                        sp + "o.weight": take(gp + "shortconv.out_proj.weight")})
        elif i in config.linear_layers and config.linear_kind == "mamba1":
            out.update(_gguf_mamba1(gp, sp, config, take))
        elif i in config.linear_layers and config.linear_kind == "mamba2":
            out.update(_gguf_mamba2(gp, sp, config, take))
            if config.parallel_mixers:  # (Falcon-H1: attention beside the mixer, whose ssm_out is linear_o)
                out[sp + "linear_o.weight"] = out.pop(sp + "o.weight")
                out[sp + "qkv.weight"] = torch.cat([take(gp + f"attn_{x}.weight") for x in "qkv"], dim=0)
        elif i in config.linear_layers:
            out.update(_gguf_gated_delta(raw, gp, sp, config, tiled=arch != "qwen3next", take=take))
        elif config.kv_lora_rank:
            out.update(_gguf_latent_attention(gp, sp, config, take, raw))
        elif config.attn_output_gate:  # attn_q: each head's q rows, then its gate's (as transformers holds q_proj)
            q = take(gp + "attn_q.weight").view(config.num_heads, 2, config.head_dim, -1)
            out[sp + "qkv.weight"] = torch.cat([q[:, 0].reshape(config.q_size, -1), take(gp + "attn_k.weight"),
                                                take(gp + "attn_v.weight"), q[:, 1].reshape(config.q_size, -1)])
        elif gp + "attn_qkv.weight" in raw:  # Phi-3's fused projection
            out[sp + "qkv.weight"] = raw[gp + "attn_qkv.weight"]
        else:
            out[sp + "qkv.weight"] = torch.cat([take(gp + f"attn_{x}.weight") for x in "qkv"], dim=0)
        if config.attention_bias and gp + "attn_qkv.bias" in raw:  # (GPT-2's, StarCoder's, Falcon's fused bias)
            out[sp + "qkv.bias"] = raw[gp + "attn_qkv.bias"]
        elif config.attention_bias:
            out[sp + "qkv.bias"] = torch.cat([take(gp + f"attn_{x}.bias") for x in "qkv"], dim=0)
        if config.attention_sinks:
            out[sp + "sinks"] = take(gp + "attn_sinks.weight")
        if config.expert_bias:  # gpt-oss: a biased router and experts
            out[sp + "router.bias"] = take(gp + "ffn_gate_inp.bias")
            out[sp + "experts.gate_up.bias"] = torch.cat(
                [take(gp + "ffn_gate_exps.bias"), take(gp + "ffn_up_exps.bias")], dim=1)
            out[sp + "experts.down.bias"] = take(gp + "ffn_down_exps.bias")
        if (config.router_sigmoid or config.router_correction_bias) and i not in config.dense_layers:
            out[sp + "router.correction_bias"] = take(gp + "exp_probs_b.bias").reshape(-1)
        if config.num_experts and i not in config.dense_layers:
            out[sp + "router.weight"] = take(gp + "ffn_gate_inp.weight")
            out[sp + "experts.gate_up.weight"] = torch.cat([take(gp + "ffn_gate_exps.weight"),
                                                           take(gp + "ffn_up_exps.weight")], dim=1)
            out[sp + "experts.down.weight"] = take(gp + "ffn_down_exps.weight")
            if config.shared_expert_intermediate_size:
                out[sp + "shared.gate_up.weight"] = torch.cat([take(gp + "ffn_gate_shexp.weight"),
                                                              take(gp + "ffn_up_shexp.weight")])
                out[sp + "shared.down.weight"] = take(gp + "ffn_down_shexp.weight")
                if config.shared_expert_gate:
                    out[sp + "shared.gate.weight"] = take(gp + "ffn_gate_inp_shexp.weight").reshape(1, -1)
        elif gp + "ffn_gate.weight" not in raw and gp + "ffn_up.weight" in raw:  # Phi-3's ffn_up holds gate, then up
            out[sp + "gate_up.weight"] = raw[gp + "ffn_up.weight"]
        else:
            out[sp + "gate_up.weight"] = torch.cat([take(gp + "ffn_gate.weight"), take(gp + "ffn_up.weight")], dim=0)
        for gguf_name, serving_name in _GGUF_LAYER_NAMES.items():
            if gp + gguf_name in raw:
                out[sp + serving_name] = raw[gp + gguf_name]
        if not config.sandwich_norm and config.pre_norm and sp + "post_attn_norm.weight" in out:
            # (gpt-oss' and GLM-4.5's name for the norm before the MLP)
            out[sp + "mlp_norm.weight"] = out.pop(sp + "post_attn_norm.weight")
    check_serving_tensors(out, config, source=source)
    return SourceModel(config=config, tensors=out, source_kind="gguf")


def _gguf_mamba1(gp: str, sp: str, config: ModelConfig, take) -> dict:
    """A Mamba-1 mixer as llama.cpp's converter writes Jamba's: ssm_in, ssm_conv1d [C, K] (and its bias), ssm_x, ssm_dt
    and its bias, ssm_dt_norm / ssm_b_norm / ssm_c_norm, ssm_a = -exp(A_log) [C, N], ssm_d, ssm_out."""
    out = {sp + "linear_in.weight": take(gp + "ssm_in.weight"), sp + "conv.weight": take(gp + "ssm_conv1d.weight"),
           sp + "x_proj.weight": take(gp + "ssm_x.weight"), sp + "dt_proj.weight": take(gp + "ssm_dt.weight"),
           sp + "dt_bias": take(gp + "ssm_dt.bias"), sp + "a_log": (-take(gp + "ssm_a").float()).log(),
           sp + "d": take(gp + "ssm_d").reshape(-1), sp + "o.weight": take(gp + "ssm_out.weight")}
    if config.linear_norm and config.linear_norm_eps is not None:  # (Falcon-Mamba's: weightless)
        rank, states = config.linear_dt_rank, config.linear_key_dim
        out.update({sp + "dt_norm.weight": torch.ones(rank), sp + "b_norm.weight": torch.ones(states),
                    sp + "c_norm.weight": torch.ones(states)})
    elif config.linear_norm:  # (Jamba's)
        out.update({sp + "dt_norm.weight": take(gp + "ssm_dt_norm.weight"),
                    sp + "b_norm.weight": take(gp + "ssm_b_norm.weight"),
                    sp + "c_norm.weight": take(gp + "ssm_c_norm.weight")})
    if config.linear_conv_bias:
        out[sp + "conv.bias"] = take(gp + "ssm_conv1d.bias")
    return out


def _gguf_mamba2(gp: str, sp: str, config: ModelConfig, take) -> dict:
    """A Mamba-2 mixer as llama.cpp's converter writes it: ssm_in, ssm_conv1d [C, K] (and its bias), ssm_dt's bias,
    ssm_a = -exp(A_log) and ssm_d as [heads, 1], ssm_norm as [groups, inner / groups], ssm_out."""
    out = {sp + "linear_in.weight": take(gp + "ssm_in.weight"), sp + "conv.weight": take(gp + "ssm_conv1d.weight"),
           sp + "dt_bias": take(gp + "ssm_dt.bias"), sp + "a_log": (-take(gp + "ssm_a").float().reshape(-1)).log(),
           sp + "d": take(gp + "ssm_d").reshape(-1), sp + "o.weight": take(gp + "ssm_out.weight")}
    if config.linear_norm:
        out[sp + "linear_norm.weight"] = take(gp + "ssm_norm.weight").reshape(-1)
    if config.linear_conv_bias:
        out[sp + "conv.bias"] = take(gp + "ssm_conv1d.bias")
    return out


def _gguf_gated_delta(raw: dict, gp: str, sp: str, config: ModelConfig, *, tiled: bool, take) -> dict:
    """A Gated DeltaNet layer as llama.cpp's converter writes it: attn_qkv (q, k, v), attn_gate (z), Qwen3-Next's
    ssm_ba (each key head's b rows, then its a rows) or Qwen3.5's ssm_beta / ssm_alpha, ssm_conv1d [C, K], ssm_dt's
    bias, ssm_a = -exp(A_log), ssm_norm (its own weight, not 1 + w), ssm_out. Qwen3.5's files hold the value heads
    ``tiled`` (value head j of key head g at j * key_heads + g, for ggml's broadcast): put back in transformers' order
    (g * per_key + j), which the forward's repeat of q and k heads assumes."""
    nk, nv, dk, dv = config.linear_key_heads, config.linear_value_heads, config.linear_key_dim, config.linear_value_dim
    per_key = nv // nk

    def grouped(t: torch.Tensor, dim: int, width: int) -> torch.Tensor:  # tiled value heads -> grouped
        if not tiled or per_key == 1:
            return t
        shape = list(t.shape)
        t = t.reshape(*shape[:dim], per_key, nk, width, *shape[dim + 1:]).transpose(dim, dim + 1)
        return t.reshape(shape)

    qkv, conv = take(gp + "attn_qkv.weight"), take(gp + "ssm_conv1d.weight")
    keys = 2 * nk * dk
    qkv = torch.cat([qkv[:keys], grouped(qkv[keys:], 0, dv)])
    conv = torch.cat([conv[:keys], grouped(conv[keys:], 0, dv)])
    if gp + "ssm_ba.weight" in raw:
        b, a = take(gp + "ssm_ba.weight").reshape(nk, 2 * per_key, -1).split([per_key, per_key], dim=1)
        b, a = b.reshape(nv, -1), a.reshape(nv, -1)
    else:
        b, a = (grouped(take(gp + f"ssm_{x}.weight"), 0, 1) for x in ("beta", "alpha"))
    decay = grouped(take(gp + "ssm_a").float(), 0, 1)
    return {sp + "linear_in.weight": torch.cat([qkv, grouped(take(gp + "attn_gate.weight"), 0, dv), b, a]),
            sp + "conv.weight": conv.reshape(conv.shape[0], -1),
            sp + "dt_bias": grouped(take(gp + "ssm_dt.bias"), 0, 1), sp + "a_log": (-decay).log(),
            sp + "linear_norm.weight": take(gp + "ssm_norm.weight"),
            sp + "o.weight": grouped(take(gp + "ssm_out.weight"), 1, dv)}
