"""Model configuration: the architecture facts the runtime needs, nothing else.

``ModelConfig`` is the one description of a decoder that the loader, the
forward and the prepared core's manifest share. It is built from a Hugging Face
``config.json`` (``from_hf_config``) or from GGUF metadata (in ``loader``), and
round-trips through ``to_dict``/``from_dict`` for the manifest.

Rules:
- Every family we run is a decoder with RMSNorm (Cohere: LayerNorm), rotary
  embeddings (rotate-half layout; checkpoints that turn interleaved pairs are
  reordered to it on reading), grouped-query attention and a gated MLP (dense
  or routed experts). The differences between families are flags here
  (``attention_bias``, ``qk_norm``, ``sandwich_norm``, ``pre_norm``,
  ``num_experts``, ``nope_layers``, multipliers and soft caps...), never a
  branch on the family name inside the forward.
- Anything we cannot run exactly (another activation, a rope scaling type we do
  not implement, Qwen2's per-layer sliding windows) is refused with
  ``CoreError(kind=UNSUPPORTED_MODEL)`` at construction, never approximated.
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
from dataclasses import dataclass
from typing import Any

from flared.errors import CoreError, ErrorKind

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "olmo2", "gpt_oss", "deepseek2", "qwen3_next", "lfm2",
                 "gemma4")

# HF model_type -> our architecture. Mistral is Llama plus a sliding window;
# SmolLM2 ships as model_type "llama".
HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3",
                  "gemma2": "gemma2",
                  # Gemma 4 (31B; its vision-language checkpoints serve as their text model): Gemma 3's layer with
                  # global layers of their own geometry (wider heads, fewer KV heads, keys as values, proportional
                  # rope), value norms, a scalar a layer (_gemma4_from_hf)
                  "gemma4_text": "gemma4",
                  # OLMo 2 / OLMo 3: norms after attention and the MLP only, q/k norms over all heads (OLMo 3: three
                  # windowed layers in four, their own rope)
                  "olmo2": "olmo2", "olmo3": "olmo2",
                  # AllenAI FlexOlmo: OLMo 2's layer with OLMoE's experts (_olmo_from_hf)
                  "flex_olmo": "olmo2",
                  # mixture-of-experts decoders: the family's layer with a routed MLP (num_experts)
                  "mixtral": "llama", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3",
                  # JetBrains Mellum 2: Qwen3-MoE's layer with windowed layers (layer_types) at their own rope theta
                  # and dense MLPs where mlp_layer_types says
                  "mellum": "qwen3",
                  # SmolLM3: Llama with every fourth layer unrotated (nope_layers)
                  "smollm3": "llama",
                  # Phi-3 / Phi-4: Llama's layer with q/k/v and gate/up stored fused, a sliding window where set
                  "phi3": "llama",
                  # IBM Granite 3: Llama with scalar multipliers on the embeddings, the residual branches, the
                  # attention scores and the logits
                  "granite": "llama",
                  # IBM Granite 4.0 (micro): Granite 3 with its MLP named shared_mlp, rope or none on every layer; the
                  # hybrids' Mamba layers and its experts are refused
                  "granitemoehybrid": "llama",
                  # LG EXAONE 4.0: OLMo 2's norms after attention and the MLP with per-head q/k norms, three windowed
                  # layers in four, the global ones unrotated (_exaone_from_hf)
                  "exaone4": "llama",
                  # Cohere Command R / R7B / A, Aya: LayerNorm, attention and MLP in parallel, interleaved rope, scaled
                  # logits; cohere2's windowed layers rotated, its global ones not (_cohere_from_hf)
                  "cohere": "llama", "cohere2": "llama",
                  # Cohere2-MoE: Cohere2's layer with routed experts (the top logits softmaxed) beside shared ones, after
                  # dense first layers, its norms LayerNorms or RMSNorms
                  "cohere2_moe": "llama",
                  # gpt-oss: attention sinks, routed experts with biases and a clamped SwiGLU (_gpt_oss_from_hf)
                  "gpt_oss": "gpt_oss",
                  # ByteDance Seed-OSS: Llama with q/k/v biases (attention_bias) apart from o's (attention_out_bias)
                  "seed_oss": "llama",
                  # GLM-4 (0414): Llama with q/k/v biases, norms after attention and the MLP too, half of each head
                  # rotated by interleaved pairs (read permuted to rotate-half: rope_interleaved)
                  "glm4": "llama",
                  # GLM-4 (9B, the 2024 release as glm): GLM-4's attention without its norms after attention and the MLP
                  "glm": "llama",
                  # GLM-4.5 / 4.6 (Air): Llama with q/k/v biases (optional q/k norms), half of each head rotated,
                  # the first layer dense and the rest DeepSeek-V3-routed experts plus a shared expert
                  "glm4_moe": "llama",
                  # rednote dots.llm1: Qwen3's layer with GLM-4.5's (DeepSeek-V3's) routed experts
                  "dots1": "qwen3",
                  # DeepSeek V2 (Lite, Coder-V2-Lite) and V3 (R1, Moonlight, Kimi K2): multi-head latent attention and
                  # routed experts (_deepseek_from_hf)
                  "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2",
                  # DeepSeek V3.2: V3 with sparse attention's indexer in every layer
                  "deepseek_v32": "deepseek2",
                  # GLM-5: V3.2's layer, its indexer's rope in pairs, some layers reusing an earlier one's choice
                  "glm_moe_dsa": "deepseek2",
                  # GLM-4.7-Flash: DeepSeek-V3's layer (latent attention, grouped sigmoid routing) under its own name,
                  # its dense MLPs named by mlp_layer_types
                  "glm4_moe_lite": "deepseek2",
                  # Tencent Youtu-LLM: DeepSeek-V3's latent attention with a dense SwiGLU MLP on every layer
                  "youtu": "deepseek2",
                  # OpenBMB MiniCPM3: DeepSeek-V2's latent attention (rope turning halves) with dense MLPs and
                  # MiniCPM's scaled embeddings, residual branches and logits
                  "minicpm3": "deepseek2",
                  # MiniMax-M2: q/k normed over all heads, part of each head rotated, sigmoid-routed experts with
                  # correction biases
                  "minimax_m2": "llama",
                  # Baidu ERNIE 4.5 (dense): Llama with rope turning interleaved pairs (reordered on reading)
                  "ernie4_5": "llama",
                  # Baidu ERNIE 4.5 MoE (21B-A3B, 300B-A47B): ERNIE 4.5's layer with experts chosen by softmax score
                  # plus a correction bias (router_correction_bias) beside shared ones
                  "ernie4_5_moe": "llama",
                  # Qwen3-Next, Qwen3.5 (dense and MoE): three Gated DeltaNet layers (a recurrent state per sequence,
                  # no KV cache) to one gated attention layer; Gemma's (1 + w) norms (_qwen3_next_from_hf)
                  "qwen3_next": "qwen3_next", "qwen3_5_text": "qwen3_next", "qwen3_5_moe_text": "qwen3_next",
                  # Liquid LFM2 (dense, MoE): gated short convolutions (a convolution state per sequence) between
                  # attention layers with per-head q/k norms (_lfm2_from_hf)
                  "lfm2": "lfm2", "lfm2_moe": "lfm2",
                  # NVIDIA Nemotron-H (Nemotron-H, Nemotron Nano 2, Nemotron 3 Nano): blocks of one part each (a Mamba-2
                  # mixer, unrotated attention, a squared-ReLU MLP or sigmoid-routed squared-ReLU experts), paired
                  # into layers (_nemotron_h_from_hf)
                  "nemotron_h": "llama",
                  # TII Falcon-H1: every layer's attention and Mamba-2 mixer read the same normed input, their outputs
                  # added (parallel_mixers); muP multipliers folded into the weights on reading (_falcon_h1_from_hf)
                  "falcon_h1": "llama",
                  # IBM Bamba (9B): Granite 4.0-H's Mamba-2 layers beside attention layers (attn_layer_indices) with
                  # half of each head rotated, a SwiGLU MLP, no multipliers (_bamba_from_hf)
                  "bamba": "llama",
                  # AI21 Jamba (Reasoning 3B, Mini, Large): Mamba-1 layers (a state per channel, B / C / dt normed) beside
                  # unrotated attention layers, every other layer's MLP routed experts (_jamba_from_hf)
                  "jamba": "llama",
                  # state-spaces Mamba (Mamba-1) and Mamba-2 (Mamba-Codestral) language models: every layer a norm and
                  # a mixer alone, no attention at all (_mamba_lm_from_hf)
                  "mamba": "llama", "mamba2": "llama", "falcon_mamba": "llama",
                  # Moonshot Kimi Linear (48B-A3B): Kimi Delta Attention layers (the gated delta rule with a decay per
                  # key channel) beside DeepSeek's latent attention without rope, DeepSeek-V3's routed experts
                  # (_kimi_linear_from_hf)
                  "kimi_linear": "deepseek2",
                  # Swiss AI Apertus (8B, 70B): Qwen3's per-head q/k norms before Llama 3's rope, an ungated MLP through
                  # xIELU (each layer's own alpha_p, alpha_n: layers.i.xielu)
                  "apertus": "llama",
                  # Tencent Hunyuan (dense, 0.5B-7B): Llama with per-head q/k norms after rope (qk_norm_after_rope),
                  # NTK-alpha rope folded into its theta
                  "hunyuan_v1_dense": "llama",
                  # Hunyuan-A13B: the dense layer's attention, every layer's MLP softmax-routed experts (renormalised)
                  # beside a shared MLP of the experts' width
                  "hunyuan_v1_moe": "llama",
                  # Meta Llama 4 (Scout, Maverick): attention in 8192-token chunks on its rotated layers (weightless q/k
                  # norms after rope), every fourth layer unrotated over the whole context with temperature-tuned
                  # queries; experts chosen by sigmoid of the top logit scaling their input, beside a shared MLP
                  # (_llama4_from_hf)
                  "llama4_text": "llama",
                  # Arcee AFM-4.5B: Llama with an ungated ReLU-squared MLP (up, relu(x)^2, down)
                  "arcee": "llama",
                  # IBM Granite 3.x MoE (1B-A400M, 3B-A800M) and its shared-expert form: Granite's multipliers, every
                  # layer's experts chosen by the router's top logits softmaxed among themselves (and an ungated shared MLP)
                  "granitemoe": "llama", "granitemoeshared": "llama",
                  # ... and its sliding-window form: learned attention sinks, windows on the layer_types' sliding layers,
                  # layer_rope_theta's zeros unrotated
                  "granitemoe_swa": "llama",
                  # ... and the dense one (GraniteSWA, granite-swash): the same attention with Granite's dense MLP
                  "granite_swa": "llama",
                  # Ministral (8B 2410) and Meta CWM: Llama with a window on the layer_types' sliding_attention layers
                  "ministral": "llama", "cwm": "llama",
                  # Ministral 3 (3B, 8B, 14B; Mistral 3's text model): Mistral's layer at YaRN, each query scaled by its
                  # position as Llama 4's unrotated layers' are (llama_4_scaling_beta)
                  "ministral3": "llama",
                  # LG EXAONE 3.0 / 3.5, InternLM3, IQuest-Coder: Llama's layer (EXAONE's own names for its config
                  # keys and tensors; InternLM3's for its biases)
                  "exaone": "llama", "internlm3": "llama", "iquestcoder": "llama",
                  # InternLM2 / 2.5 (and InternVL2.5's decoders): Llama's layer under its own names, q/k/v fused in
                  # groups (the loader splits them)
                  "internlm2": "llama",
                  # Kyutai Helium: Llama's layer rotating interleaved pairs (GLM's rope)
                  "helium": "llama",
                  # Sarvam MoE (sarvam-30b), BharatGen Param2 MoE: GLM-4.5's layer over the whole head, under their names
                  "sarvam_moe": "llama", "param2moe": "llama",
                  # NAVER HyperCLOVA X SEED: Granite's multipliers with a norm after attention and after the MLP too
                  # (use_post_norm: "peri-layer" norms)
                  "hyperclovax": "llama",
                  # Karpathy's nanochat: weightless RMSNorms (the embeddings normed too), q/k normed after rope, an
                  # ungated ReLU-squared MLP, soft-capped logits
                  "nanochat": "llama",
                  # Microsoft Phi-3.5-MoE: biased LayerNorms and projections (its LM head's too), Mixtral's experts
                  # chosen by sparsemixer
                  "phimoe": "llama",
                  # AllenAI OLMo (1): Llama's layer between LayerNorms without weights, q/k/v clamped (clip_qkv)
                  "olmo": "llama",
                  # AllenAI OLMoE: Llama with q/k norms over the whole projections, every layer softmax-routed experts
                  "olmoe": "llama",
                  # Upstage Solar Open: Llama's attention, every layer's experts DeepSeek-V3-routed beside a shared one
                  "solar_open": "llama",
                  # LG K-EXAONE (exaone_moe): EXAONE 4.0's attention before Llama's pre-norms, DeepSeek-V3-routed experts
                  # after its dense layers (mlp_layer_types)
                  "exaone_moe": "llama",
                  # Tencent HY v3: Qwen3's layer (per-head q/k norms before rope), its sparse layers (mlp_layer_types)
                  # sigmoid-routed with correction biases (no groups), renormalised, times router_scaling_factor, beside
                  # an ungated shared expert
                  "hy_v3": "qwen3",
                  # Arcee AFMoE (Trinity): per-head q/k norms, the windowed layers rotated and the global ones not, an
                  # elementwise gate on attention's output, four norms a layer, sigmoid-routed experts (_afmoe_from_hf)
                  "afmoe": "llama",
                  # Liquid LFM3: LFM2's short convolutions between attention layers, windowed ones at plain rope and
                  # global ones at proportional rope, a sigmoid gate per head on attention's output, sandwich norms
                  "lfm3": "lfm2",
                  # AllenAI OLMo Hybrid: Gated DeltaNet layers (pre-norm, beta up to 2) beside OLMo 3's post-norm
                  # attention (q/k norms over the whole projections, unrotated where rope_theta is null)
                  "olmo_hybrid": "llama",
                  # BigCode StarCoder2: LayerNorms with biases, biased attention, an ungated tanh-GELU MLP with biases,
                  # one window on every layer
                  "starcoder2": "llama",
                  # Inception Jais 2 (8B): Llama's attention with biases on all four projections, biased LayerNorms,
                  # an ungated squared-ReLU MLP with biases
                  "jais2": "llama",
                  # NVIDIA Nemotron-4 / Minitron (nemotron): LayerNorm1P (1 + w, biased), half of each head rotated, an
                  # ungated squared-ReLU MLP
                  "nemotron": "llama",
                  # Google Gemma (1, 1.1, CodeGemma): Gemma 2's (1 + w) norms, scaled embeddings and tanh-GELU, none of
                  # its windows, caps or norms after attention and the MLP
                  "gemma": "gemma2",
                  # Google VaultGemma (1B, trained with differential privacy): Gemma 2 without its norms after
                  # attention and the MLP
                  "vaultgemma": "gemma2",
                  # Stability StableLM (2 1.6B, 3B-4E1T, Zephyr): LayerNorms with biases, a quarter of each head
                  # rotated, q/k/v biases where use_qkv_bias
                  "stablelm": "llama",
                  # Microsoft Phi-1, 1.5, 2: attention and an ungated tanh-GELU MLP side by side from one biased LayerNorm,
                  # part of each head rotated, biases everywhere, the LM head's too
                  "phi": "llama",
                  # EleutherAI GPT-NeoX (Pythia, GPT-NeoX-20B): attention and an ungated GELU MLP side by side, each from
                  # its own biased LayerNorm of the layer's input, a quarter of each head rotated
                  "gpt_neox": "llama",
                  # OpenAI GPT-2 and BigCode GPT-BigCode (StarCoder 1, SantaCoder, WizardCoder): learned position
                  # embeddings in place of rope, biased LayerNorms and projections, an ungated GELU MLP; BigCode's
                  # one KV head (multi_query)
                  "gpt2": "llama", "gpt_bigcode": "llama",
                  # EleutherAI GPT-Neo (125M-2.7B): GPT-2's learned positions and LayerNorms, every other layer
                  # windowed (attention_types), scores unscaled
                  "gpt_neo": "llama",
                  # EleutherAI GPT-J: Phi-2's parallel block without attention biases, the first rotary_dim of each
                  # head turned by interleaved pairs
                  "gptj": "llama",
                  # TII Falcon (7B, 40B, 180B; RefinedWeb): attention and an ungated GELU MLP side by side from one
                  # biased LayerNorm (40B and 180B: one each), multi-query or grouped KV heads in one fused projection
                  "falcon": "llama",
                  # BigScience BLOOM / BLOOMZ: ALiBi position biases in place of rope, the embeddings through a
                  # LayerNorm of their own, biased LayerNorms and projections, an ungated tanh-GELU MLP
                  "bloom": "llama",
                  # MosaicML MPT (7B, 30B): ALiBi (its own slopes), weight-only LayerNorms, no biases, an ungated GELU
                  # MLP, q/k/v optionally clamped
                  "mpt": "llama",
                  # Meta OPT (125M-66B): learned positions (offset by 2), biased LayerNorms and projections, an ungated
                  # ReLU MLP
                  "opt": "llama"}
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh", "relu2", "xielu", "gelu", "relu")
_LATER_FIELDS = {"embed_scale", "hidden_act", "sandwich_norm", "attention_scale", "layer_windows", "local_rope_theta",
                 "num_experts", "experts_per_token", "expert_intermediate_size", "norm_topk_prob",
                 "shared_expert_intermediate_size", "nope_layers", "embedding_multiplier", "residual_multiplier",
                 "logits_scaling", "attn_logit_softcapping", "final_logit_softcapping", "pre_norm", "qk_norm_whole",
                 "rotary_dim", "attention_sinks", "expert_bias", "router_topk_softmax", "swiglu_limit", "swiglu_alpha",
                 "rope_interleaved", "dense_layers", "router_sigmoid", "expert_groups", "expert_groups_per_token",
                 "routed_scaling", "shared_expert_gate", "layer_norm", "parallel_block", "kv_lora_rank", "q_lora_rank",
                 "v_head_dim", "linear_layers", "linear_key_heads", "linear_value_heads", "linear_key_dim",
                 "linear_value_dim", "linear_conv_kernel", "attn_output_gate", "linear_kind", "linear_conv_bias",
                 "mlp_gated", "mixerless_layers", "mlpless_layers", "parallel_mixers", "linear_norm",
                 "global_head_dim", "global_kv_heads", "value_from_key", "v_norm", "layer_scalars", "parallel_experts",
                 "per_layer_input_dim", "per_layer_vocab", "kv_shared_layers", "double_wide_mlp", "linear_dt_rank",
                 "linear_norm_eps", "router_correction_bias", "qk_norm_after_rope", "attention_chunk_size",
                 "chunked_layers", "qk_l2_norm", "nope_temperature_scale", "nope_temperature_floor",
                 "router_input_scale", "post_norm_layers", "linear_neg_eigval", "norm_bias", "mlp_bias",
                 "lm_head_bias", "parallel_norms", "query_position_scale", "query_position_floor",
                 "embedding_norm", "router_sparsemixer", "clip_qkv", "position_embeddings", "alibi_slopes",
                 "embedding_layer_norm", "qk_layer_norm_per_head", "index_topk", "index_heads", "index_head_dim",
                 "index_shared_layers", "index_rope_interleaved", "alibi_bf16_positions"}

# What a model's linear (KV-less) layers are: Qwen3-Next's Gated DeltaNet, LFM2's short convolutions, Mamba-2.
LINEAR_KINDS = ("gated_delta", "short_conv", "mamba2", "mamba1", "kda")

# Rope types we compute exactly. "default" is stored as rope_scaling=None.
ROPE_SCALING_TYPES = ("linear", "llama3", "yarn", "longrope", "factors", "proportional")
_ROPE_SCALING_KEYS = {
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    # YaRN (Qwen2.5/Qwen3 long context, DeepSeek): stored resolved, as transformers computes it: the correction
    # band's rotations (beta_fast, beta_slow), whether its bounds are rounded out (truncate) and the factor cos and
    # sin are scaled by (attention_factor).
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "truncate"},
    # LongRoPE (Phi-3.5, Phi-3 128k, Phi-4-mini): each frequency divided by a per-frequency factor, the short table
    # where the served context fits the original one, the long table where it does not (one table for a whole
    # context, as vLLM and llama.cpp choose it: cached keys never change tables); cos and sin scaled by
    # attention_factor, resolved as transformers resolves it.
    "longrope": {"short_factor", "long_factor", "original_max_position_embeddings", "attention_factor"},
    # Per-frequency divisors alone: llama.cpp's rope_freqs tensor (how its GGUFs carry Llama 3.1's rope scaling).
    "factors": {"factors"},
    # Gemma 4's global layers: the first partial_rotary_factor of each head's frequency pairs turn at theta's
    # frequencies over the whole head (base^(-2i / head_dim)), the rest not at all (transformers' "proportional").
    "proportional": {"partial_rotary_factor"},
}
_FACTOR_TABLES = ("short_factor", "long_factor", "factors")


def _unsupported(what: str) -> CoreError:
    return CoreError(what, ErrorKind.UNSUPPORTED_MODEL)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None = plain rope; else {"rope_type": "linear"|"llama3"|"yarn", ...params}
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q, k and v projections (Qwen2; Llama with attention_bias)
    qk_norm: bool  # per-head RMSNorm on q and k before rope (Qwen3)
    attention_out_bias: bool = False  # bias on the output projection (Llama with attention_bias)
    sliding_window: int | None = None  # every layer attends to at most this many keys (Mistral)
    # Gemma 3: the embedding rows scaled by sqrt(hidden) (the tied LM head stays unscaled), the MLP's
    # activation, a norm after attention and after the MLP as well ("sandwich"), the query scale
    # (query_pre_attn_scalar ** -0.5; None: head_dim ** -0.5), each layer's window (0: the whole context) and
    # the windowed layers' rope theta (plain rope; the global layers take rope_theta and rope_scaling).
    embed_scale: bool = False
    hidden_act: str = "silu"
    sandwich_norm: bool = False
    attention_scale: float | None = None
    layer_windows: tuple[int, ...] | None = None
    local_rope_theta: float | None = None
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): every layer's MLP is num_experts SwiGLU experts of
    # expert_intermediate_size, each token through the experts_per_token its router scores highest (softmax over
    # all experts, the chosen weights renormalised to sum 1 when norm_topk_prob), plus Qwen2-MoE's shared expert
    # (shared_expert_intermediate_size > 0) scaled by sigmoid(its gate). 0 experts: the dense MLP.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    # Layers of a mixture-of-experts model whose MLP is the dense one of intermediate_size (GLM-4.5's first, Qwen's
    # mlp_only_layers), in order.
    dense_layers: tuple[int, ...] = ()
    # DeepSeek-V3-style routing (GLM-4.5): sigmoid scores (the router in float32); each expert's correction bias
    # (layers.i.router.correction_bias) added for the choice only; the experts in expert_groups groups, a token choosing
    # among the expert_groups_per_token groups whose two best scores sum highest; the chosen scores (renormalised when
    # norm_topk_prob) times routed_scaling (None: 1). shared_expert_gate False: the shared expert is added ungated.
    router_sigmoid: bool = False
    # ERNIE 4.5 MoE: a softmax router (float32) whose experts are chosen by score plus a correction bias
    # (layers.i.router.correction_bias, for the choice only), their plain scores the weights.
    router_correction_bias: bool = False
    # Hunyuan: the per-head q/k norms applied after rope instead of before it.
    qk_norm_after_rope: bool = False
    expert_groups: int = 1
    expert_groups_per_token: int = 1
    routed_scaling: float | None = None
    shared_expert_gate: bool = True
    # Cohere: every norm a LayerNorm without bias (mean-centred, in float32: its weights kept float32); attention and
    # the MLP read the same normed input and both add to the residual (one norm a layer).
    layer_norm: bool = False
    parallel_block: bool = False
    # DeepSeek's multi-head latent attention (kv_lora_rank > 0): queries from the hidden state (or through a
    # q_lora_rank-wide normed bottleneck), keys and values from a kv_lora_rank-wide normed latent, each head's key
    # sharing one rotated part (the first rotary_dim of head_dim, as the loader orders them); values v_head_dim wide.
    # The cache holds each token's latent row (latent_kv) or, expanded, a key and a value padded to head_dim a head.
    # The serving layout's q/q_a/q_b, kv_a and kv_b replace qkv.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    v_head_dim: int = 0
    # Layers whose queries and keys are not rotated at all (SmolLM3's "NoPE" layers), in order.
    nope_layers: tuple[int, ...] = ()
    # Granite: the embedding rows times embedding_multiplier, each residual branch (attention's, the MLP's) times
    # residual_multiplier before it is added, the logits divided by logits_scaling (None: 1); its
    # attention_multiplier is attention_scale.
    embedding_multiplier: float | None = None
    residual_multiplier: float | None = None
    logits_scaling: float | None = None
    # Gemma 2: attention scores and final logits squashed to (-cap, cap) by cap * tanh(x / cap) (None: not).
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # OLMo 2: no norm before attention and the MLP (pre_norm False: only the sandwich's norms after them), and q/k
    # norms each over the whole projection, all heads at once ([nh * d], [nkv * d]) instead of per head.
    pre_norm: bool = True
    qk_norm_whole: bool = False
    # Partial rotary embeddings (Phi-4-mini): only each head's first rotary_dim dimensions are rotated (rotate-half
    # within them), the rest pass unrotated. None: the whole head.
    rotary_dim: int | None = None
    # gpt-oss: a learned logit per query head in every softmax of attention (a "sink" that takes weight and gives no
    # value: layers.i.sinks); biases on the router and the experts' two products; the router's top experts_per_token
    # logits softmaxed among themselves (instead of a softmax over all experts, then the top); the experts' clamped
    # SwiGLU, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit) (None: SiLU).
    # The checkpoint's q/k rows rotate interleaved pairs (GLM-4's GPT-J-style rope): the loader (and a LoRA adapter's
    # q/k terms) permute each head's rotated rows to the rotate-half order the forward uses.
    rope_interleaved: bool = False
    attention_sinks: bool = False
    expert_bias: bool = False
    router_topk_softmax: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None
    # Qwen3-Next / Qwen3.5's hybrid layers: linear_layers are Gated DeltaNet layers, which keep no keys and values
    # but a recurrent state per sequence (a [linear_value_heads, linear_key_dim, linear_value_dim] float32 matrix and
    # the last linear_conv_kernel - 1 inputs of a causal depthwise convolution over q, k and v): linear_key_heads
    # query/key heads of linear_key_dim, linear_value_heads value heads of linear_value_dim. attn_output_gate: the
    # other (attention) layers' q projection also gives a gate per query column, the attention's output times
    # sigmoid(gate) before o (the gate's rows follow q, k and v in the serving layout's qkv).
    linear_layers: tuple[int, ...] = ()
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0
    attn_output_gate: bool = False
    # What the linear layers are (LINEAR_KINDS; "" without them): "gated_delta" (above); "short_conv" (LFM2: the input
    # projection's B, C and x, hidden each, B * x through a causal depthwise convolution of linear_conv_kernel inputs,
    # times C, through o; the convolution's last linear_conv_kernel - 1 inputs are the sequence's state; no heads);
    # "mamba2" (Granite 4.0-H's Mamba-2 mixer: linear_value_heads heads of linear_value_dim channels, linear_key_heads
    # groups of B and C of linear_key_dim state each; a [heads, state, head channels] float32 state per sequence, decayed
    # by exp(dt A) and fed dt * x B^T every token, read by C; a D skip; a gated grouped RMSNorm before o).
    # linear_conv_bias: the convolution has a bias (Mamba-2's).
    linear_kind: str = ""
    linear_conv_bias: bool = False
    # Nemotron-H's blocks, each a norm and one part, paired into layers (a mixer block and the MLP block after it):
    # mixerless_layers are an MLP block alone (no attention or linear layer: mlp_norm, the MLP), mlpless_layers a mixer
    # block alone (no mlp_norm or MLP). mlp_gated False: the MLP (the experts and shared expert too) is up, activation,
    # down, its serving gate_up holding the up rows alone (hidden_act relu2: the squared ReLU).
    mlp_gated: bool = True
    mixerless_layers: tuple[int, ...] = ()
    mlpless_layers: tuple[int, ...] = ()
    # Falcon-H1: each linear layer attends too (its KV in the cache): attention and the Mamba-2 mixer read the same
    # normed input and both outputs are added to the residual (the mixer's output projection is linear_o). linear_norm
    # False: Mamba-2's output is y * SiLU(z) with no grouped RMSNorm.
    parallel_mixers: bool = False
    linear_norm: bool = True
    # Gemma 4: the global (unwindowed) layers attend with heads of global_head_dim and global_kv_heads KV heads (0:
    # the windowed layers' head_dim and num_kv_heads), their rope (rope_theta, rope_scaling) over the wider head; with
    # value_from_key their values are their keys' projection (before the key norm and rope); v_norm: every layer's
    # values RMS-normed without a weight; layer_scalars: each layer's output times its own scalar (layers.i.scalar).
    # The KV cache stores a global layer's wider heads as head_dim-wide pieces (kv_storage_heads rows a layer).
    global_head_dim: int = 0
    global_kv_heads: int = 0
    value_from_key: bool = False
    v_norm: bool = False
    layer_scalars: bool = False
    # Gemma 4 26B-A4B: every layer's experts beside its dense MLP (both outputs normed, added, normed again), routed
    # from the residual stream (RMS-normed without a weight, times router.scale and hidden^-0.5; a softmax, the top
    # experts_per_token renormalised, times each expert's router.expert_scale), fed the residual through their own norm.
    parallel_experts: bool = False
    # Gemma 4 E2B / E4B. Per-layer inputs (per_layer_input_dim > 0): each token's row of embed_per_layer (per_layer_vocab
    # rows of num_layers * per_layer_input_dim, scaled by sqrt(per_layer_input_dim)) plus the scaled embedding through
    # per_layer_proj (times hidden^-0.5, normed per layer by per_layer_proj_norm), the sum times 2^-0.5; layer i, after
    # its MLP, adds per_layer_norm(per_layer_out(GELU(per_layer_gate(h)) * its input)). The last kv_shared_layers
    # layers keep no keys or values: each attends to those of the last earlier layer of its kind (kv_source), and with
    # double_wide_mlp their MLPs are twice intermediate_size.
    per_layer_input_dim: int = 0
    per_layer_vocab: int = 0
    kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    # "kda" linear layers (Kimi Linear's Kimi Delta Attention): Gated DeltaNet's state and delta rule with a decay per
    # key channel (-exp(A_log) softplus(f_b(f_a(x)) + dt_bias)), q, k and v projected apart (the input projection's
    # first rows) through the causal convolution, beta = sigmoid(b(x)); the output RMS-normed per head times
    # sigmoid(g_b(g_a(x))), through o.
    # "mamba1" linear layers (Jamba's Mamba-1 mixers): linear_value_heads channels (the expanded width; key heads 1,
    # value dim 1), each with its own [linear_key_dim] state decayed per state by exp(dt A) and fed dt x B every token,
    # read by C; dt from a linear_dt_rank-wide projection; Jamba's RMSNorms on dt, B and C; a D skip; y * SiLU(z).
    linear_dt_rank: int = 0
    # Falcon-Mamba: the epsilon of its Mamba-1 mixers' dt / B / C norms (weightless: their weights ones), None:
    # rms_norm_eps (Jamba's).
    linear_norm_eps: float | None = None
    # Llama 4: the chunked_layers attend only to the keys of their own attention_chunk_size-token chunk (a query at
    # position p sees p - p % size .. p); qk_l2_norm: the rotated layers' q and k heads RMS-normed without a weight
    # after rope (float32, eps rms_norm_eps); the unrotated (nope) layers' queries times
    # 1 + nope_temperature_scale * log(1 + floor((p + 1) / nope_temperature_floor)) (floor 0: not);
    # router_input_scale: the router's top experts_per_token logits, each through a sigmoid, scale the row fed to
    # their expert (whose outputs add unweighted) instead of its output.
    attention_chunk_size: int = 0
    chunked_layers: tuple[int, ...] = ()
    qk_l2_norm: bool = False
    nope_temperature_scale: float = 0.0
    nope_temperature_floor: int = 0
    router_input_scale: bool = False
    # Ministral 3 (Llama 4's scaling on every layer): each query after rope times
    # 1 + query_position_scale * log(1 + floor(p / query_position_floor)), computed in float32 and rounded to the
    # activations' dtype first, as transformers does (floor 0: not).
    query_position_scale: float = 0.0
    query_position_floor: int = 0
    # nanochat: the embeddings RMS-normed (by the final norm's weights) before the first layer
    embedding_norm: bool = False
    # Phi-3.5-MoE's sparsemixer (0: not): two experts, the first the router's best, weighed by its softmax among the
    # logits within 2 * router_sparsemixer (relative) of the best, the second the best of the others, weighed
    # likewise among them; the weights as they are
    router_sparsemixer: float = 0.0
    # OLMo (1): every q, k and v value clamped to [-clip_qkv, clip_qkv] after its projection (0: not)
    clip_qkv: float = 0.0
    # GPT-2, GPT-BigCode: a learned row a position (pos_embed, max_position_embeddings rows) added to each token's
    # embedding; every layer unrotated (nope_layers)
    position_embeddings: bool = False
    # ALiBi (BLOOM): each query head's slope; a score gains slope * (key position - query position), unscaled, before
    # its softmax; every layer unrotated (nope_layers). (): none.
    alibi_slopes: tuple[float, ...] = ()
    # Falcon-RW: transformers forms each key's bias as bf16(bf16 slope * key position) and then divides it by
    # sqrt(head_dim) (alibi_slopes hold the slopes already divided): the bias is bf16(slope * sqrt(d) * position) /
    # sqrt(d), key positions absolute. With slopes that are not powers of two (Falcon-RW-1B's 32 heads) or positions
    # past 256 the rounding moves the logits by up to 0.2 on test models.
    alibi_bf16_positions: bool = False
    # BLOOM: the embeddings through a LayerNorm of their own (embed_norm, biased) before the first layer
    embedding_layer_norm: bool = False
    # StableLM 2 12B: each q and k head through a LayerNorm of its own (qk_norm; q_norm [heads, d], k_norm [kv heads,
    # d], no bias) in place of the shared RMSNorm
    qk_layer_norm_per_head: bool = False
    # DeepSeek V3.2's sparse attention (DSA): in each latent layer an indexer of index_heads heads of index_head_dim
    # (the first rotary_dim of each turned, halves) scores every visible key from the query bottleneck and its own
    # LayerNormed key (kept in the latent row's tail, ModelConfig.kv_row_dim), and a query attends only its
    # index_topk best keys (all of them up to that many). 0: dense attention.
    index_topk: int = 0
    index_heads: int = 0
    index_head_dim: int = 0
    # GLM-5: layers with no indexer of their own that reuse the choice of the last earlier layer with one; its
    # indexer's rope turns interleaved pairs (reordered on reading, as the latent attention's).
    index_shared_layers: tuple[int, ...] = ()
    index_rope_interleaved: bool = False
    # OLMo Hybrid: post_norm_layers take OLMo 2's norms (none before the mixer and the MLP, one after each) while the
    # others keep pre_norm's; linear_neg_eigval: the Gated DeltaNet's beta = 2 sigmoid(b) (eigenvalues to -1).
    post_norm_layers: tuple[int, ...] = ()
    linear_neg_eigval: bool = False
    # StarCoder2: its LayerNorms biased (layers.i.attn_norm.bias, mlp_norm.bias, final_norm.bias; needs layer_norm), its
    # MLP's two products too (layers.i.gate_up.bias, down.bias).
    norm_bias: bool = False
    mlp_bias: bool = False
    # Phi-2: the LM head's bias (lm_head.bias, added to the logits).
    lm_head_bias: bool = False
    # GPT-NeoX: the parallel block's MLP reads its own norm of the layer's input (layers.i.mlp_norm) instead of
    # attention's normed input (Cohere's).
    parallel_norms: bool = False

    def __post_init__(self) -> None:
        if self.layer_windows is not None:
            object.__setattr__(self, "layer_windows", tuple(self.layer_windows))
        for name in ("nope_layers", "dense_layers", "linear_layers", "mixerless_layers", "mlpless_layers",
                     "chunked_layers", "post_norm_layers", "index_shared_layers"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "alibi_slopes", tuple(float(x) for x in self.alibi_slopes))
        if self.alibi_slopes and len(self.alibi_slopes) != self.num_heads:
            raise CoreError(f"alibi_slopes needs one slope per query head ({self.num_heads}), got "
                            f"{len(self.alibi_slopes)}")
        if self.architecture not in ARCHITECTURES:
            raise _unsupported(f"architecture {self.architecture!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise CoreError(f"model config {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise CoreError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2 != 0:
            raise CoreError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
                raise CoreError(f"model config {name} must be a positive number, got {value!r}")
        for name in ("tie_word_embeddings", "attention_bias", "qk_norm", "attention_out_bias"):
            if not isinstance(getattr(self, name), bool):
                raise CoreError(f"model config {name} must be a boolean, got {getattr(self, name)!r}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise CoreError(f"sliding_window must be a positive integer or null, got {self.sliding_window!r}")
        if self.rotary_dim is not None and (not isinstance(self.rotary_dim, int) or isinstance(self.rotary_dim, bool)
                                            or self.rotary_dim % 2 or not 0 < self.rotary_dim < self.head_dim):
            raise CoreError(f"rotary_dim must be an even number below head_dim {self.head_dim} or null, got "
                            f"{self.rotary_dim!r}")
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling)
            for key in _FACTOR_TABLES:
                if key in self.rope_scaling and len(self.rope_scaling[key]) != self.rope_dim // 2:
                    raise CoreError(f"rope_scaling {key} needs one factor per rotated pair ({self.rope_dim // 2}), "
                                    f"got {len(self.rope_scaling[key])}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise _unsupported(f"hidden_act {self.hidden_act!r} is not supported (supported: {', '.join(HIDDEN_ACTS)})")
        if self.layer_windows is not None and (len(self.layer_windows) != self.num_layers or any(
                not isinstance(w, int) or isinstance(w, bool) or w < 0 for w in self.layer_windows)):
            raise CoreError(f"layer_windows must give each of the {self.num_layers} layers a window >= 0")
        for name in ("attention_scale", "local_rope_theta", "embedding_multiplier", "residual_multiplier",
                     "logits_scaling", "attn_logit_softcapping", "final_logit_softcapping", "swiglu_limit",
                     "swiglu_alpha", "routed_scaling", "linear_norm_eps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                      or not math.isfinite(value) or value <= 0):
                raise CoreError(f"model config {name} must be a positive number or null, got {value!r}")
        for name in ("embed_scale", "sandwich_norm", "norm_topk_prob", "pre_norm", "qk_norm_whole", "attention_sinks",
                     "expert_bias", "router_topk_softmax", "rope_interleaved", "router_sigmoid", "shared_expert_gate",
                     "layer_norm", "parallel_block", "attn_output_gate", "linear_conv_bias", "mlp_gated",
                     "parallel_mixers", "linear_norm", "value_from_key", "v_norm", "layer_scalars", "parallel_experts",
                     "double_wide_mlp", "router_correction_bias", "qk_norm_after_rope", "qk_l2_norm",
                     "router_input_scale", "linear_neg_eigval", "norm_bias", "mlp_bias", "lm_head_bias",
                     "parallel_norms"):
            if not isinstance(getattr(self, name), bool):
                raise CoreError(f"model config {name} must be a boolean, got {getattr(self, name)!r}")
        for name in ("num_experts", "experts_per_token", "expert_intermediate_size", "shared_expert_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise CoreError(f"model config {name} must be an integer >= 0, got {value!r}")
        if self.num_experts and not (0 < self.experts_per_token <= self.num_experts and self.expert_intermediate_size):
            raise CoreError(f"a mixture of {self.num_experts} experts needs 1 to {self.num_experts} experts a token "
                            f"(got {self.experts_per_token}) and an expert_intermediate_size (got "
                            f"{self.expert_intermediate_size})")
        for name in ("nope_layers", "dense_layers", "linear_layers", "mixerless_layers", "mlpless_layers",
                     "chunked_layers", "post_norm_layers", "index_shared_layers"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or list(value) != sorted(set(value)) or any(
                    not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.num_layers for i in value):
                raise CoreError(f"{name} must list layers of 0..{self.num_layers - 1} in order, got {value!r}")
        if self.dense_layers and not self.num_experts:
            raise CoreError("dense_layers needs num_experts > 0")
        for name in ("expert_groups", "expert_groups_per_token"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CoreError(f"model config {name} must be a positive integer, got {value!r}")
        if self.expert_groups > 1 and (not self.router_sigmoid or self.num_experts % self.expert_groups
                                       or self.num_experts // self.expert_groups < 2
                                       or self.expert_groups_per_token > self.expert_groups):
            raise CoreError(f"{self.expert_groups} expert groups ({self.expert_groups_per_token} a token) do not "
                            f"divide {self.num_experts} sigmoid-routed experts into groups of two or more")
        if self.qk_norm_after_rope and (not self.qk_norm or self.qk_norm_whole):
            raise CoreError("qk_norm_after_rope needs per-head q/k norms")
        if self.router_correction_bias and (not self.num_experts or self.router_sigmoid or self.router_topk_softmax):
            raise CoreError("router_correction_bias needs softmax-routed experts (router_sigmoid has its own)")
        if self.router_sigmoid and (not self.num_experts or self.router_topk_softmax):
            raise CoreError("router_sigmoid needs num_experts > 0 and excludes router_topk_softmax")
        if self.router_input_scale and (not self.num_experts or self.router_sigmoid or self.router_topk_softmax
                                        or self.router_correction_bias or self.norm_topk_prob):
            raise CoreError("router_input_scale needs experts routed by it alone (no other router, no renormalising)")
        for name in ("attention_chunk_size", "nope_temperature_floor"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise CoreError(f"model config {name} must be an integer >= 0, got {value!r}")
        if self.parallel_norms and not self.parallel_block:
            raise CoreError("parallel_norms needs parallel_block")
        if self.lm_head_bias and self.tie_word_embeddings:
            raise CoreError("lm_head_bias needs an LM head of its own (tie_word_embeddings false)")
        if self.norm_bias and not self.layer_norm:
            raise CoreError("norm_bias needs layer_norm (biased LayerNorms)")
        if self.mlp_bias and (self.num_experts or self.linear_layers):
            raise CoreError("mlp_bias is for dense MLPs")
        if bool(self.chunked_layers) != bool(self.attention_chunk_size):
            raise CoreError("chunked_layers and attention_chunk_size go together")
        if set(self.chunked_layers) & {i for i in range(self.num_layers) if self.window_of(i)}:
            raise CoreError("a layer is either windowed or chunked")
        scale = self.nope_temperature_scale
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale) or scale < 0 \
                or bool(scale) != bool(self.nope_temperature_floor):
            raise CoreError(f"nope_temperature_scale (got {scale!r}) and nope_temperature_floor (got "
                            f"{self.nope_temperature_floor!r}) go together, the scale a number >= 0")
        scale = self.query_position_scale
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale) or scale < 0 \
                or bool(scale) != bool(self.query_position_floor):
            raise CoreError(f"query_position_scale (got {scale!r}) and query_position_floor (got "
                            f"{self.query_position_floor!r}) go together, the scale a number >= 0")
        for name in ("kv_lora_rank", "q_lora_rank", "v_head_dim", "index_topk", "index_heads", "index_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise CoreError(f"model config {name} must be an integer >= 0, got {value!r}")
        if self.kv_lora_rank and not (self.rotary_dim and 0 < self.v_head_dim <= self.head_dim
                                      and self.num_kv_heads == self.num_heads and not self.attention_bias):
            raise CoreError("latent attention (kv_lora_rank) needs a rotated part (rotary_dim), values of 1 to "
                            "head_dim (v_head_dim), a key/value head per query head and no attention bias")
        if not self.kv_lora_rank and (self.q_lora_rank or self.v_head_dim):
            raise CoreError("q_lora_rank and v_head_dim need kv_lora_rank > 0")
        if (self.index_topk or self.index_heads or self.index_head_dim or self.index_rope_interleaved) and not (
                self.index_topk and self.index_heads and self.index_head_dim >= self.rope_dim and self.kv_lora_rank
                and self.q_lora_rank):
            raise CoreError("sparse attention's indexer (index_topk) needs index_heads, index_head_dim >= the rotated "
                            "part, and latent attention with a query bottleneck (kv_lora_rank, q_lora_rank)")
        if self.index_shared_layers and not (self.index_topk and self.index_shared_layers[0] > 0):
            raise CoreError(f"index_shared_layers {self.index_shared_layers!r} reuse an earlier layer's indexer: "
                            "after layer 0, with index_topk")
        if not self.num_experts and (self.experts_per_token or self.expert_intermediate_size
                                     or self.shared_expert_intermediate_size or self.expert_bias
                                     or self.router_topk_softmax or self.swiglu_limit is not None):
            raise CoreError("experts_per_token, expert_intermediate_size, shared_expert_intermediate_size, "
                            "expert_bias, router_topk_softmax and swiglu_limit need num_experts > 0")
        if (self.swiglu_limit is None) != (self.swiglu_alpha is None):
            raise CoreError("swiglu_limit and swiglu_alpha go together")
        linear_sizes = ("linear_key_heads", "linear_value_heads", "linear_key_dim", "linear_value_dim",
                        "linear_conv_kernel")
        for name in linear_sizes:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise CoreError(f"model config {name} must be an integer >= 0, got {value!r}")
        if self.linear_kind not in ("", *LINEAR_KINDS) or bool(self.linear_kind) != bool(self.linear_layers):
            raise CoreError(f"linear_kind must be one of {', '.join(LINEAR_KINDS)} for linear_layers (and empty "
                            f"without them), got {self.linear_kind!r}")
        if self.short_conv and (self.linear_conv_kernel < 2 or any(getattr(self, n) for n in linear_sizes[:4])):
            raise CoreError("short convolution layers need a convolution of 2 or more inputs, and no key or value "
                            "heads")
        if self.linear_conv_bias and self.linear_kind not in ("mamba2", "mamba1"):
            raise CoreError("linear_conv_bias needs Mamba layers")
        if self.linear_layers and not self.short_conv and (
                any(getattr(self, n) == 0 for n in linear_sizes) or self.linear_conv_kernel < 2
                or self.linear_value_heads % self.linear_key_heads):
            raise CoreError("Gated DeltaNet and Mamba-2 layers need key heads (groups) and value heads (the value "
                            "heads a multiple of the key heads), their sizes and a convolution of 2 or more inputs")
        if set(self.mixerless_layers) & (set(self.mlpless_layers) | set(self.linear_layers)):
            raise CoreError("a mixerless layer is neither a linear layer nor mlpless (a layer of nothing)")
        if set(self.mlpless_layers) & set(self.dense_layers):
            raise CoreError("an mlpless layer cannot be a dense_layers one")
        for name in ("global_head_dim", "global_kv_heads", "per_layer_input_dim", "per_layer_vocab", "kv_shared_layers",
                     "linear_dt_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise CoreError(f"model config {name} must be an integer >= 0, got {value!r}")
        if (self.global_head_dim or self.global_kv_heads or self.value_from_key) and (
                self.layer_windows is None or self.global_head_dim % self.head_dim
                or self.num_heads % (self.global_kv_heads or self.num_kv_heads)):
            raise CoreError("global_head_dim, global_kv_heads and value_from_key need windowed layers beside the "
                            "global ones (layer_windows), a global head of whole head_dims and query heads in whole "
                            "groups of the global KV heads")
        if (self.linear_kind == "mamba1") != bool(self.linear_dt_rank) or self.linear_kind == "mamba1" and (
                self.linear_value_dim != 1 or self.linear_key_heads != 1):
            raise CoreError("Mamba-1 layers (and only they) need a time-step rank, one channel a head and one group")
        if bool(self.per_layer_input_dim) != bool(self.per_layer_vocab):
            raise CoreError("per_layer_input_dim and per_layer_vocab go together")
        if self.kv_shared_layers and (self.kv_shared_layers >= self.num_layers or self.linear_layers or any(
                self.kv_source(i) is None for i in range(self.num_layers - self.kv_shared_layers, self.num_layers))):
            raise CoreError(f"the last {self.kv_shared_layers} layers share the keys and values of an earlier layer of "
                            "their window: each needs one, and no linear layers")
        if self.double_wide_mlp and not self.kv_shared_layers:
            raise CoreError("double_wide_mlp needs kv_shared_layers")
        if self.parallel_experts and (not self.num_experts or self.dense_layers or self.router_sigmoid
                                      or self.shared_expert_intermediate_size):
            raise CoreError("parallel_experts needs experts on every layer (no dense_layers), softmax-routed, without a "
                            "shared expert")
        if (self.parallel_mixers and self.linear_kind != "mamba2"
                or not self.linear_norm and self.linear_kind not in ("mamba2", "mamba1")):
            raise CoreError("parallel_mixers needs Mamba-2 layers, linear_norm false Mamba layers")
        if self.hidden_act in ("relu2", "xielu", "relu") and self.mlp_gated:
            raise _unsupported(f"{self.hidden_act} is supported only in ungated MLPs (mlp_gated false)")
        if not self.linear_layers and any(getattr(self, n) for n in linear_sizes):
            raise CoreError(f"{', '.join(linear_sizes)} need linear_layers")

    @property
    def graph_capable(self) -> bool:
        """The CUDA graphs' kernels run this model (graph_obstacle names what keeps them from it)."""
        return self.graph_obstacle is None

    @property
    def graph_obstacle(self) -> str | None:
        """What of this model the CUDA graphs' kernels do not run (they run the Llama/Qwen layer), or None."""
        if self.kv_lora_rank:
            return "multi-head latent attention"
        if self.linear_layers:
            return {"short_conv": "short convolution layers", "mamba2": "Mamba-2 layers", "mamba1": "Mamba layers",
                    "kda": "Kimi Delta Attention layers"}.get(
                self.linear_kind, "Gated DeltaNet (linear attention) layers")
        if self.mixerless_layers or self.mlpless_layers or not self.mlp_gated or self.post_norm_layers:
            return "layers of an MLP or a mixer alone, ungated MLPs"
        if self.qk_norm_after_rope or self.qk_l2_norm:
            return "q/k norms after rope"
        if self.chunked_layers or self.nope_temperature_floor:
            return "chunked attention, temperature-tuned queries"
        if self.query_position_floor:
            return "position-scaled queries"
        if self.embedding_norm:
            return "normed embeddings"
        if self.position_embeddings:
            return "learned position embeddings"
        if self.alibi_slopes or self.embedding_layer_norm:
            return "ALiBi position biases, a normed embedding"
        if self.clip_qkv:
            return "clamped q/k/v"
        if self.architecture not in ("llama", "qwen2", "qwen3"):
            return f"{self.architecture} layers"
        if self.num_experts:
            return "routed experts"
        if self.nope_layers:
            return "unrotated (NoPE) layers"
        if self.rotary_dim is not None:
            return "partial rotary embeddings"
        if self.sandwich_norm or not self.pre_norm:
            return "norms after attention and the MLP"
        if self.layer_norm or self.parallel_block:
            return "Cohere's LayerNorm and parallel attention and MLP"
        if any(m is not None for m in (self.embedding_multiplier, self.residual_multiplier, self.logits_scaling)):
            return "Granite's multipliers"
        if self.attention_scale is not None:
            return "a query scale of its own"
        if self.layer_windows is not None and len(set(self.layer_windows)) > 1:
            return "sliding windows on some layers only"
        if self.attn_output_gate:
            return "a gated attention output"
        return None

    @property
    def kernels_obstacle(self) -> str | None:
        """What keeps the CUDA graphs' Llama kernels (the fused forwards, megakernel, products64) from this model:
        graph_obstacle, or a head dim that is not a power of two (their tiles'); None: they run it. Otherwise the
        graphs capture the model's own torch layers where torch_graphs_obstacle allows."""
        if self.graph_obstacle is None and self.head_dim & (self.head_dim - 1):
            return f"head_dim {self.head_dim}, not a power of two"
        return self.graph_obstacle

    def torch_graphs_obstacle(self, dtype: str) -> str | None:
        """What keeps the CUDA graphs from capturing this model's own torch layers (DecoderModel._layer_stack with
        the paged Triton attention: kernels/paged_decoder.py's ``generic`` decoder) in ``dtype`` (a torch dtype's
        name), or None. Where kernels_obstacle is None the graphs run the Llama kernels instead."""
        if self.linear_layers:
            return self.graph_obstacle  # (a recurrent state a row: not in the graphs' inputs)
        if self.chunked_layers or self.nope_temperature_floor:
            return "chunked attention, temperature-tuned queries"
        if self.index_topk:
            return "sparse attention's indexer (DeepSeek V3.2, GLM-5)"
        if self.alibi_bf16_positions:
            return "Falcon-RW's ALiBi (biases rounded to bf16 at each key position)"
        if self.num_experts and dtype != "bfloat16":
            return f"routed experts in {dtype} (the graphs group experts' rows with bf16 grouped products)"
        return None

    def kv_source(self, layer: int) -> int | None:
        """The layer whose keys and values ``layer`` attends to instead of its own (Gemma 4's last kv_shared_layers:
        the last earlier layer of the same window), or None."""
        first = self.num_layers - self.kv_shared_layers
        if not self.kv_shared_layers or layer < first:
            return None
        window = self.window_of(layer)
        return next((i for i in range(first - 1, -1, -1) if self.window_of(i) == window), None)

    def mlp_width(self, layer: int) -> int:
        """``layer``'s dense MLP width: intermediate_size, twice it on Gemma 4's shared-KV layers with
        double_wide_mlp."""
        return self.intermediate_size * (2 if self.double_wide_mlp and self.kv_source(layer) is not None else 1)

    def layer_geometry(self, layer: int) -> tuple[int, int]:
        """(KV heads, head dim) of ``layer``'s attention: Gemma 4's global layers' own, else num_kv_heads, head_dim."""
        if self.global_head_dim and not self.window_of(layer):
            return self.global_kv_heads or self.num_kv_heads, self.global_head_dim
        return self.num_kv_heads, self.head_dim

    @property
    def latent_kv(self) -> bool:
        """Latent attention served absorbed (DeepSeek's MLA, as llama.cpp, vLLM and SGLang keep it): the KV cache
        holds each token's normed latent and shared rotated key part, kv_lora_rank + rotary_dim wide, once a layer
        instead of every head's expanded key and value; the queries are taken into the latent through kv_b's key
        rows and each head's output out of it through its value rows. FLARED_MLA_EXPANDED=1 keeps the expanded
        layout (the earlier one, for comparisons), except for sparse attention (index_topk), whose indexer keys the row
        holds."""
        return bool(self.kv_lora_rank) and (bool(self.index_topk) or os.environ.get("FLARED_MLA_EXPANDED") != "1")

    @property
    def kv_row_dim(self) -> int:
        """Width of a row of the KV cache: head_dim, or a latent token's kv_lora_rank + rotary_dim (latent_kv) and its
        indexer key (index_head_dim, sparse attention)."""
        return self.kv_lora_rank + self.rope_dim + self.index_head_dim if self.latent_kv else self.head_dim

    @property
    def kv_value_rows(self) -> int:
        """Rows of the value pool a slot holds: kv_storage_heads, or none where the values are the keys' latent part
        (latent_kv: the attention reads them from the key pool)."""
        return 0 if self.latent_kv else self.kv_storage_heads

    @property
    def kv_values_per_token(self) -> int:
        """Values a token of context holds in the KV cache across the layers that keep keys and values (its key and
        value rows; a latent row alone under latent_kv)."""
        return len(self.kv_layers) * (self.kv_storage_heads + self.kv_value_rows) * self.kv_row_dim

    @property
    def kv_storage_heads(self) -> int:
        """Rows of kv_row_dim a layer of the KV cache holds: num_kv_heads, a global layer's wider heads as pieces
        (Gemma 4), whichever is more; one latent row (latent_kv)."""
        if self.latent_kv:
            return 1
        if not self.global_head_dim:
            return self.num_kv_heads
        return max(self.num_kv_heads, (self.global_kv_heads or self.num_kv_heads) * self.global_head_dim // self.head_dim)

    def window_of(self, layer: int) -> int:
        """The keys layer ``layer`` attends to at most (0: all of them)."""
        if self.layer_windows is not None:
            return self.layer_windows[layer]
        return self.sliding_window or 0

    @property
    def float_norms(self) -> bool:
        """Norm weights kept in float32 whatever the model's dtype, scaling in float32 with one rounding: Gemma's
        (holding 1 + w, as its RMSNorm computes it) and gpt-oss' (transformers keeps them float32)."""
        return self.architecture in ("gemma2", "gemma3", "gemma4", "gpt_oss", "qwen3_next") or self.layer_norm

    @property
    def norm_plus_one(self) -> bool:
        """The checkpoint's norms scale by (1 + w), Gemma's and Qwen3-Next's RMSNorm: the serving norms hold 1 + w."""
        return self.architecture in ("gemma2", "gemma3", "qwen3_next")

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that keep keys and values in the KV cache (all but the linear and mixerless ones; with
        parallel_mixers the linear ones too), in order."""
        linear = (set() if self.parallel_mixers else set(self.linear_layers)) | set(self.mixerless_layers)
        linear |= set(range(self.num_layers - self.kv_shared_layers, self.num_layers))  # (Gemma 4's shared-KV layers)
        return tuple(i for i in range(self.num_layers) if i not in linear)

    @property
    def short_conv(self) -> bool:
        """The linear layers are LFM2's gated short convolutions."""
        return self.linear_kind == "short_conv"

    @property
    def linear_conv_dim(self) -> int:
        """A linear layer's convolved channels: a Gated DeltaNet layer's q, k and v columns, LFM2's hidden ones."""
        if self.short_conv:
            return self.hidden_size
        if self.linear_kind == "mamba1":  # (Mamba-1 convolves x alone)
            return self.linear_value_heads
        return 2 * self.linear_key_heads * self.linear_key_dim + self.linear_value_heads * self.linear_value_dim

    @property
    def router_float32(self) -> bool:
        """The router's weights and products kept float32, as transformers keeps DeepSeek's and GLM-4.5's."""
        return self.router_sigmoid or self.router_correction_bias or bool(self.kv_lora_rank)

    @property
    def rope_dim(self) -> int:
        """The dimensions of each head that rope turns (the whole head unless rotary_dim says fewer)."""
        return self.rotary_dim or self.head_dim

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if d["rope_scaling"] is not None:
            d["rope_scaling"] = {k: list(v) if k in _FACTOR_TABLES else v for k, v in d["rope_scaling"].items()}
        if d["layer_windows"] is not None:
            d["layer_windows"] = list(d["layer_windows"])
        d["nope_layers"] = list(d["nope_layers"])
        d["dense_layers"] = list(d["dense_layers"])
        d["linear_layers"] = list(d["linear_layers"])
        d["mixerless_layers"] = list(d["mixerless_layers"])
        d["mlpless_layers"] = list(d["mlpless_layers"])
        d["chunked_layers"] = list(d["chunked_layers"])
        d["post_norm_layers"] = list(d["post_norm_layers"])
        d["index_shared_layers"] = list(d["index_shared_layers"])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        if not isinstance(d, dict):
            raise CoreError(f"model config must be an object, got {type(d).__name__}")
        fields = dataclasses.fields(cls)
        names = {f.name for f in fields}
        unknown = sorted(set(d) - names)
        # the fields added with Gemma 3 may be absent (cores written before them): they take their defaults
        missing = sorted(names - _LATER_FIELDS - set(d))
        if unknown:
            raise CoreError(f"model config has unknown keys: {', '.join(unknown)}")
        if missing:
            raise CoreError(f"model config is missing keys: {', '.join(missing)}")
        values = dict(d)
        # JSON has one number type; accept 10000 for a float field but never 1.5 for an int one.
        for name in ("rms_norm_eps", "rope_theta", "attention_scale", "local_rope_theta", "embedding_multiplier",
                     "residual_multiplier", "logits_scaling", "attn_logit_softcapping", "final_logit_softcapping",
                     "swiglu_limit", "swiglu_alpha", "routed_scaling", "nope_temperature_scale",
                     "query_position_scale", "router_sparsemixer", "clip_qkv"):
            if isinstance(values.get(name), int) and not isinstance(values[name], bool):
                values[name] = float(values[name])
        return cls(**values)


def _check_rope_scaling(rope_scaling: dict) -> None:
    if not isinstance(rope_scaling, dict):
        raise CoreError(f"rope_scaling must be an object or null, got {rope_scaling!r}")
    rope_type = rope_scaling.get("rope_type")
    if rope_type not in ROPE_SCALING_TYPES:
        raise _unsupported(f"rope scaling type {rope_type!r} is not supported (supported: default, {', '.join(ROPE_SCALING_TYPES)})")
    expected = _ROPE_SCALING_KEYS[rope_type] | {"rope_type"}
    if set(rope_scaling) != expected:
        raise CoreError(f"rope_scaling {rope_type} needs exactly the keys {sorted(expected)}, got {sorted(rope_scaling)}")
    for key in expected - {"rope_type", "truncate"}:
        table = key in _FACTOR_TABLES
        values = rope_scaling[key] if table else [rope_scaling[key]]
        if not isinstance(values, (list, tuple)) or not values or any(
                not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0
                for v in values):
            what = "a list of positive numbers" if table else "a positive number"
            raise CoreError(f"rope_scaling {key} must be {what}, got {rope_scaling[key]!r}")
    if "truncate" in expected and not isinstance(rope_scaling["truncate"], bool):
        raise CoreError(f"rope_scaling truncate must be a boolean, got {rope_scaling['truncate']!r}")


def _rope_from_hf(hf: dict[str, Any], source: str) -> tuple[float, dict | None]:
    """Read rope theta and scaling from either the transformers 5 ``rope_parameters``
    or the older ``rope_theta`` + ``rope_scaling`` keys."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        scaling = dict(params)
        scaling.pop("partial_rotary_factor", None)  # (rotary_dim_from_hf reads it)
        theta = scaling.pop("rope_theta", hf.get("rope_theta", 10000.0))
    else:
        theta = hf.get("rope_theta", 10000.0)
        scaling = dict(hf["rope_scaling"]) if isinstance(hf.get("rope_scaling"), dict) else None
    if scaling is None:
        return float(theta), None
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None)
    scaling.pop("type", None)
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type == "dynamic" and not scaling.get("alpha"):
        # Dynamic NTK turns the frequencies only for a sequence past the original context, which flared never serves
        # (a core's context is at most max_position_embeddings): plain rope, unless the original context is shorter
        original = int(scaling.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 2048))
        if original < int(hf.get("max_position_embeddings", original)):
            raise _unsupported(f"{source}: dynamic NTK rope over an original context ({original}) shorter than "
                               f"max_position_embeddings is not supported")
        return float(theta), None
    if hf.get("model_type") == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # (Phi-3's older names, as transformers reads them)
    if rope_type not in ROPE_SCALING_TYPES or rope_type == "factors":
        raise _unsupported(f"{source}: rope scaling type {rope_type!r} is not supported "
                           f"(supported: default, linear, llama3, yarn, longrope)")
    if rope_type == "yarn":
        return float(theta), yarn_parameters(scaling, hf)
    if rope_type == "longrope":
        return float(theta), longrope_parameters(scaling, hf)
    keep = {k: float(scaling[k]) if k != "original_max_position_embeddings" else int(scaling[k])
            for k in _ROPE_SCALING_KEYS[rope_type] if k in scaling}
    return float(theta), {"rope_type": rope_type, **keep}


def rotary_dim_from_hf(hf: dict[str, Any], head_dim: int) -> int | None:
    """ModelConfig.rotary_dim from ``partial_rotary_factor`` (top level, in rope_parameters or in one of its layer
    types' entries), as transformers sizes it: int(head_dim * factor); None for the whole head."""
    params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    found = [p["partial_rotary_factor"] for p in (hf, params, *params.values())
             if isinstance(p, dict) and p.get("partial_rotary_factor") is not None]
    dim = int(head_dim * float(found[0])) if found else int(hf.get("rotary_dim") or head_dim)  # (MiniMax's key)
    return None if dim == head_dim else dim


def _partial_rotary(hf: dict[str, Any], head_dim: int, source: str, supported: bool) -> int | None:
    """rotary_dim for a family whose transformers model rotates part of the head (Phi-3's); refused for the others
    (their transformers models ignore the factor, so a checkpoint that sets it is one we would misread)."""
    dim = rotary_dim_from_hf(hf, head_dim)
    if dim is not None and not supported:
        raise _unsupported(f"{source}: partial rotary embeddings (rotary dimensions {dim} of {head_dim}) are not "
                           f"supported for model_type {hf.get('model_type')!r}")
    return dim


def longrope_parameters(scaling: dict[str, Any], hf: dict[str, Any]) -> dict:
    """LongRoPE's parameters resolved as transformers resolves them: the original context from the config's top level
    (Phi-3 keeps it there), the rope parameters or max_position_embeddings; a missing factor from the two contexts; the
    attention factor sqrt(1 + ln(factor) / ln(original)) when not given (1 for a factor <= 1)."""
    original = int(hf.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
                   or hf.get("max_position_embeddings", 4096))
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else int(hf.get("max_position_embeddings", original)) / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"rope_type": "longrope", "short_factor": [float(x) for x in scaling["short_factor"]],
            "long_factor": [float(x) for x in scaling["long_factor"]], "original_max_position_embeddings": original,
            "attention_factor": float(attention)}


def yarn_parameters(scaling: dict[str, Any], hf: dict[str, Any]) -> dict:
    """YaRN's parameters resolved as transformers resolves them: the original context from the config's top level,
    the rope parameters or max_position_embeddings; a missing factor from the two contexts (DeepSeek); the attention
    factor from the factor (and mscale / mscale_all_dim) when not given; beta_fast 32, beta_slow 1, truncate on."""
    original = int(hf.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
                   or hf.get("max_position_embeddings", 2048))
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else int(hf.get("max_position_embeddings", original)) / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    truncate = scaling.get("truncate", True)
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
            "beta_fast": float(scaling.get("beta_fast") or 32), "beta_slow": float(scaling.get("beta_slow") or 1),
            "attention_factor": float(attention), "truncate": truncate if isinstance(truncate, bool) else bool(truncate)}


def from_hf_config(hf: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
    """Translate a Hugging Face ``config.json`` dict; ``source`` names it in errors (a missing or malformed value is
    a SOURCE_FORMAT error naming it, a family or feature we do not run an UNSUPPORTED_MODEL one)."""
    try:
        return _from_hf(hf, source)
    except KeyError as exc:
        raise CoreError(f"{source}: missing key {exc.args[0]!r}", ErrorKind.SOURCE_FORMAT) from None
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        raise CoreError(f"{source}: bad value: {exc}", ErrorKind.SOURCE_FORMAT) from None


# Config keys some families spell their own way (transformers' attribute_map), as Llama's
_HF_KEY_ALIASES = {"exaone": {"num_layers": "num_hidden_layers", "layer_norm_epsilon": "rms_norm_eps",
                              "activation_function": "hidden_act"},
                   "internlm3": {"qkv_bias": "attention_bias", "bias": "mlp_bias"},
                   "internlm2": {"bias": "attention_bias"},
                   **dict.fromkeys(("sarvam_moe", "param2moe"), {
                       "num_local_experts": "n_routed_experts", "num_experts": "n_routed_experts",
                       "num_shared_experts": "n_shared_experts", "use_qkv_bias": "attention_bias",
                       "num_mtp_layers": "num_nextn_predict_layers"})}


def _from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    model_type = hf.get("model_type")
    aliases = _HF_KEY_ALIASES.get(model_type, {})
    hf = {aliases.get(k, k): v for k, v in hf.items()}
    if model_type == "exaone" and not (hf.get("rope_theta") or hf.get("rope_parameters")):
        hf = {**hf, "rope_theta": 500000.0}  # (transformers' default for EXAONE)
    if model_type in ("sarvam_moe", "param2moe"):  # GLM-4.5's model, its rope over the whole head unless it says
        params = dict(hf.get("rope_parameters") or {"rope_type": "default", "rope_theta": float(hf.get(
            "rope_theta", 8e6 if model_type == "sarvam_moe" else 5e5))})
        params.setdefault("partial_rotary_factor", float(hf.get("partial_rotary_factor", 1.0)))
        hf = {**hf, "rope_parameters": params, "model_type": "glm4_moe"}
        model_type = "glm4_moe"
    # the families with a reader of their own; the rest are Llama's layer with the differences read below
    readers = {
        **dict.fromkeys(("gemma3_text", "gemma2", "gemma", "vaultgemma"),
                        lambda: _gemma_from_hf(hf, source, model_type)),
        "gemma4_text": lambda: _gemma4_from_hf(hf, source),
        **dict.fromkeys(("olmo2", "olmo3", "flex_olmo"), lambda: _olmo_from_hf(hf, source, model_type)),
        "gpt_oss": lambda: _gpt_oss_from_hf(hf, source),
        **dict.fromkeys(("exaone4", "exaone_moe"), lambda: _exaone_from_hf(hf, source)),
        **dict.fromkeys(("cohere", "cohere2", "cohere2_moe"), lambda: _cohere_from_hf(hf, source, model_type)),
        **dict.fromkeys(("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "glm4_moe_lite", "youtu",
                         "minicpm3"),
                        lambda: _deepseek_from_hf(hf, source, model_type)),
        **{t: (lambda: _qwen3_next_from_hf(hf, source, model_type))
           for t, arch in HF_MODEL_TYPES.items() if arch == "qwen3_next"},
        **dict.fromkeys(("lfm2", "lfm2_moe"), lambda: _lfm2_from_hf(hf, source, model_type)),
        "lfm3": lambda: _lfm3_from_hf(hf, source),
        "olmo_hybrid": lambda: _olmo_hybrid_from_hf(hf, source),
        "nemotron_h": lambda: _nemotron_h_from_hf(hf, source),
        "falcon_h1": lambda: _falcon_h1_from_hf(hf, source),
        "bamba": lambda: _bamba_from_hf(hf, source),
        "jamba": lambda: _jamba_from_hf(hf, source),
        **dict.fromkeys(("mamba", "mamba2", "falcon_mamba"), lambda: _mamba_lm_from_hf(hf, source, model_type)),
        "kimi_linear": lambda: _kimi_linear_from_hf(hf, source),
        "apertus": lambda: _apertus_from_hf(hf, source),
        **dict.fromkeys(("hunyuan_v1_dense", "hunyuan_v1_moe"), lambda: _hunyuan_from_hf(hf, source)),
        "llama4_text": lambda: _llama4_from_hf(hf, source),
        "arcee": lambda: _arcee_from_hf(hf, source),
        "phimoe": lambda: _phimoe_from_hf(hf, source),
        "nanochat": lambda: _ungated_from_hf(
            hf, source, "nanochat", "relu2", **_sizes(hf), qk_norm=True, qk_norm_after_rope=True,
            embedding_norm=True, final_logit_softcapping=float(hf["final_logit_softcapping"])
            if hf.get("final_logit_softcapping", 15.0) else None),
        "afmoe": lambda: _afmoe_from_hf(hf, source),
        "starcoder2": lambda: _starcoder2_from_hf(hf, source),
        "jais2": lambda: _jais2_from_hf(hf, source),
        **dict.fromkeys(("gpt2", "gpt_bigcode"), lambda: _gpt2_from_hf(hf, source, model_type)),
        "bloom": lambda: _bloom_from_hf(hf, source),
        "gpt_neo": lambda: _gpt_neo_from_hf(hf, source),
        "mpt": lambda: _mpt_from_hf(hf, source),
        "opt": lambda: _opt_from_hf(hf, source),
        "nemotron": lambda: _nemotron_from_hf(hf, source),
        "stablelm": lambda: _stablelm_from_hf(hf, source),
        "phi": lambda: _phi_from_hf(hf, source),
        "gptj": lambda: _gptj_from_hf(hf, source),
        "falcon": lambda: _falcon_from_hf(hf, source),
        "gpt_neox": lambda: _gpt_neox_from_hf(hf, source),
    }
    if model_type in readers:
        return readers[model_type]()
    if model_type not in HF_MODEL_TYPES:
        raise _unsupported(f"{source}: model_type {model_type!r} is not supported "
                           f"(supported: {', '.join(sorted(HF_MODEL_TYPES))})")
    _check_silu(hf, source)
    granite_hybrid = {}
    if model_type in ("granitemoe", "granitemoeshared", "granitemoe_swa"):
        granite_hybrid = dict(num_experts=int(hf["num_local_experts"]), experts_per_token=int(hf["num_experts_per_tok"]),
                              expert_intermediate_size=int(hf["intermediate_size"]), router_topk_softmax=True,
                              shared_expert_intermediate_size=int(hf.get("shared_intermediate_size") or 0)
                              if model_type != "granitemoe" else 0, shared_expert_gate=False)
    if model_type in ("granitemoe_swa", "granite_swa"):  # (its sinks; layer_rope_theta: 0 unrotated, else the
        # model's theta)
        thetas = hf.get("layer_rope_theta")
        theta_all = float((hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0)))
        if thetas is not None and (len(thetas) != int(hf["num_hidden_layers"])
                                   or any(t and float(t) != theta_all for t in thetas)):
            raise _unsupported(f"{source}: layer_rope_theta other than 0 (unrotated) or the model's rope_theta "
                               f"({theta_all}) is not supported")
        granite_hybrid["attention_sinks"] = True
    if model_type == "granitemoehybrid":
        granite_hybrid = _granite_hybrid_from_hf(hf, source)
        # its dense MLP is the shared expert's, sized by shared_intermediate_size (beside the experts where it has
        # them: the experts' size is intermediate_size); rope unless it says none
        hf = {**hf, "intermediate_size": hf.get("shared_intermediate_size", 1024)}
    if hf.get("mlp_bias") or (model_type in ("ernie4_5", "ernie4_5_moe") and hf.get("use_bias")):
        raise _unsupported(f"{source}: {'mlp_bias' if hf.get('mlp_bias') else 'use_bias'} (biases on the MLP) "
                           "is not supported")
    windowed = model_type in ("ministral", "cwm", "granitemoe_swa", "granite_swa", "mellum") or (model_type == "mistral"
                                                                                  and hf.get("layer_types"))
    local_theta = None
    params = hf.get("rope_parameters")
    if model_type == "mellum" and isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        # (a rope a layer type: the global layers' the model's, the windowed ones' plain at their own theta)
        sliding = params.get("sliding_attention") or {}
        if sliding.get("rope_type", "default") != "default" or any(
                float(p.get("partial_rotary_factor", 1.0)) != 1.0 for p in (params["full_attention"], sliding)):
            raise _unsupported(f"{source}: Mellum's windowed layers with a scaled or partial rope are not supported")
        local_theta = float(sliding.get("rope_theta", 10000.0))
        hf = {**hf, "rope_parameters": dict(params["full_attention"])}
    if not windowed and (hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or ())):
        raise _unsupported(f"{source}: per-layer sliding windows (use_sliding_window) are not supported")
    if hf.get("clip_qkv") and model_type != "olmo":
        raise _unsupported(f"{source}: clip_qkv (q/k/v clamped) is not supported for model_type {model_type!r}")
    ernie = model_type in ("ernie4_5", "ernie4_5_moe")
    sizes = _sizes(hf, head_dim=128 if ernie or model_type in ("glm", "ministral3", "internlm3", "iquestcoder") else None,
                   tied=ernie)  # (transformers' defaults)
    architecture = HF_MODEL_TYPES[model_type]
    glm = model_type in ("glm", "glm4", "glm4_moe")
    if glm and rotary_dim_from_hf(hf, sizes["head_dim"]) is None and \
            "partial_rotary_factor" not in (hf.get("rope_parameters") or {}):
        hf = {**hf, "partial_rotary_factor": 0.5}  # GLM rotates half of each head unless it says otherwise
    position = {}
    if model_type == "ministral3":  # (transformers' default rope when the config names none)
        params = hf.get("rope_parameters") or {
            "rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 16384,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}
        hf = {**hf, "rope_parameters": params}
        if params.get("llama_4_scaling_beta"):
            position = dict(query_position_scale=float(params["llama_4_scaling_beta"]),
                            query_position_floor=int(params["original_max_position_embeddings"]))
    theta, scaling = _rope_from_hf(hf, source)
    attention_bias = bool(hf.get("attention_bias", model_type in ("glm", "glm4")))  # (transformers' defaults)
    if architecture == "qwen2":
        qkv_bias, out_bias = bool(hf.get("qkv_bias", True)), False  # (Qwen2-MoE names it; Qwen2 always has it)
    elif glm or model_type in ("seed_oss", "solar_open"):  # q/k/v biases apart from o's (Seed-OSS:
        # attention_out_bias; Solar Open's o never has one)
        qkv_bias, out_bias = attention_bias, bool(hf.get("attention_out_bias", False))
    else:
        # Llama's attention_bias puts a bias on all four projections; Qwen3's on q/k/v/o too.
        qkv_bias, out_bias = attention_bias, attention_bias
    sliding_window = hf.get("sliding_window") if model_type in ("mistral", "mixtral", "phi3", "ministral3") else None
    layer_windows = None
    if windowed:  # (Ministral: every layer sliding unless layer_types says; CWM: every fourth from the first full)
        window = int(hf.get("sliding_window") or 0)
        rule = ((lambda i: i % 4 != 0) if model_type in ("cwm", "granitemoe_swa", "granite_swa")
                else (lambda i: False) if model_type == "mellum" else (lambda i: bool(window)))
        layer_windows = _layer_windows(hf, sizes["num_layers"], source, window, rule) if window else None
        sliding_window = None
        if layer_windows is not None and len(set(layer_windows)) == 1:  # (one window everywhere: Mistral's)
            sliding_window, layer_windows = layer_windows[0] or None, None
        if model_type == "mellum" and layer_windows is None and sliding_window and local_theta is not None:
            theta, scaling = local_theta, None  # (every layer windowed: every layer the windowed layers' rope)
        if model_type == "cwm" and not (hf.get("rope_parameters") or hf.get("rope_scaling")):
            theta, scaling = _rope_from_hf({**hf, "rope_parameters": {
                "rope_type": "llama3", "rope_theta": 1e6, "factor": 16.0, "high_freq_factor": 4.0,
                "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}}, source)
    nope = ()
    if model_type in ("granitemoe_swa", "granite_swa"):
        nope = tuple(i for i, t in enumerate(hf.get("layer_rope_theta") or ()) if not t)
    if model_type == "granitemoehybrid" and hf.get("position_embedding_type") != "rope":
        nope = tuple(range(sizes["num_layers"]))
    if model_type == "smollm3":
        rope_on = hf.get("no_rope_layers")  # (transformers' name: 1 = rotated, 0 = not)
        if rope_on is None:
            interval = int(hf.get("no_rope_layer_interval") or 4)
            rope_on = [int((i + 1) % interval != 0) for i in range(sizes["num_layers"])]
        nope = tuple(i for i, on in enumerate(rope_on) if not on)
    return ModelConfig(
        architecture=architecture, **sizes,
        # (OLMo's LayerNorms: eps 1e-5 whatever the config says)
        rms_norm_eps=1e-5 if model_type == "olmo" else float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=qkv_bias,
        qk_norm=architecture == "qwen3" or bool(model_type == "glm4_moe" and hf.get("use_qk_norm"))
        or model_type in ("minimax_m2", "olmoe"), qk_norm_whole=model_type in ("minimax_m2", "olmoe"),
        attention_out_bias=out_bias,
        sliding_window=int(sliding_window) if sliding_window else None, layer_windows=layer_windows,
        local_rope_theta=local_theta if layer_windows is not None else None,
        nope_layers=nope,
        rotary_dim=_partial_rotary(hf, sizes["head_dim"], source,
                                   model_type in ("phi3", "glm", "glm4", "glm4_moe", "minimax_m2")),
        sandwich_norm=model_type == "glm4" or (model_type == "hyperclovax" and hf.get("use_post_norm", True)),
        rope_interleaved=model_type in ("glm", "glm4", "helium") or ernie,
        **_experts_from_hf(hf, model_type, source),
        **_granite_from_hf(hf, model_type),
        **granite_hybrid,
        **position,
        # OLMo (1): weightless LayerNorms at a fixed eps (the loader's ones), clamped q/k/v
        **(dict(layer_norm=True, clip_qkv=float(hf.get("clip_qkv") or 0.0)) if model_type == "olmo" else {}),
    )


_TANH_GELU = {"gelu_new": "gelu_pytorch_tanh", "gelu_pytorch_tanh": "gelu_pytorch_tanh", "gelu_fast": "gelu_pytorch_tanh"}


def _hf_act(hf: dict[str, Any], source: str, family: str, default: str, acts: dict[str, str],
            key: str = "hidden_act") -> str:
    """Our hidden_act for the config's ``key`` (hidden_act; GPT-2's and its kin's activation_function) or
    ``default`` where it names none, by ``acts`` (its name -> ours); any other refused, naming the family."""
    act = hf.get(key) or default
    if act not in acts:
        raise _unsupported(f"{source}: {family} with hidden_act {act!r} is not supported ({', '.join(acts)})")
    return acts[act]


def _check_silu(hf: dict[str, Any], source: str) -> None:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise _unsupported(f"{source}: hidden_act {act!r} is not supported (only silu)")


def _sizes(hf: dict[str, Any], *, head_dim: int | None = None, max_positions: int = 2048, tied: bool = False) -> dict:
    """ModelConfig's sizes from a config.json; ``head_dim``, ``max_positions``, ``tied``: the family's defaults where
    the file says nothing (head_dim: else hidden / heads)."""
    heads = int(hf["num_attention_heads"])
    return dict(vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
                intermediate_size=int(hf["intermediate_size"]), num_layers=int(hf["num_hidden_layers"]),
                num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or head_dim or int(hf["hidden_size"]) // heads),
                max_position_embeddings=int(hf.get("max_position_embeddings", max_positions)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", tied)))


def _layer_windows(hf: dict[str, Any], layers: int, source: str, window: int, sliding) -> tuple[int, ...]:
    """Each layer's window (0: global) from the config's layer_types (full_attention / sliding_attention) or, where it
    has none, the family's rule ``sliding(i)``."""
    types = hf.get("layer_types") or ["sliding_attention" if sliding(i) else "full_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"full_attention", "sliding_attention"}:
        raise CoreError(f"{source}: layer_types must name each of the {layers} layers full_attention or "
                        "sliding_attention", ErrorKind.SOURCE_FORMAT)
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def _granite_hybrid_from_hf(hf: dict[str, Any], source: str) -> dict:
    """Granite 4.0's layers (layer_types or layers_block_type: mamba / linear_attention, attention / full_attention):
    the Mamba-2 mixers' sizes (mamba_n_heads of mamba_d_head, "auto": the expanded width over the heads;
    mamba_n_groups groups of mamba_d_state), and its experts (the router's top logits softmaxed among themselves,
    intermediate_size wide, beside the ungated shared MLP)."""
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * layers
    mamba = {"mamba", "linear_attention"}
    if len(types) != layers or set(types) - mamba - {"attention", "full_attention"}:
        raise CoreError(f"{source}: layer_types must name each of the {layers} layers mamba or attention",
                        ErrorKind.SOURCE_FORMAT)
    out: dict[str, Any] = {}
    linear = tuple(i for i, t in enumerate(types) if t in mamba)
    if linear:
        if hf.get("mamba_proj_bias"):
            raise _unsupported(f"{source}: Granite 4.0 with mamba_proj_bias (biased Mamba projections) is not "
                               "supported")
        inner = int(hf.get("mamba_expand", 2)) * int(hf["hidden_size"])
        heads = int(hf.get("mamba_n_heads", 128))
        head = hf.get("mamba_d_head", "auto")
        out.update(linear_layers=linear, linear_kind="mamba2", linear_value_heads=heads,
                   linear_value_dim=inner // heads if head in (None, "auto") else int(head),
                   linear_key_heads=int(hf.get("mamba_n_groups", 1)), linear_key_dim=int(hf.get("mamba_d_state", 256)),
                   linear_conv_kernel=int(hf.get("mamba_d_conv", 4)),
                   linear_conv_bias=bool(hf.get("mamba_conv_bias", True)))
    if hf.get("num_local_experts"):
        out.update(num_experts=int(hf["num_local_experts"]), experts_per_token=int(hf["num_experts_per_tok"]),
                   expert_intermediate_size=int(hf["intermediate_size"]), router_topk_softmax=True,
                   shared_expert_intermediate_size=int(hf.get("shared_intermediate_size", 1024)),
                   shared_expert_gate=False)
    return out


NEMOTRON_BLOCKS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe",
                   "mamba": "linear_attention", "attention": "full_attention"}


def pair_blocks(kinds: list[str]) -> list[tuple[int | None, int | None]]:
    """Nemotron-H's blocks (linear_attention / full_attention mixers, mlp / moe MLPs) paired into layers: each mixer
    block with the MLP block right after it, (mixer, None) where a mixer follows it or nothing does, (None, mlp) for an
    MLP block no mixer precedes. Block indices."""
    pairs: list[tuple[int | None, int | None]] = []
    for b, kind in enumerate(kinds):
        mixer = kind in ("linear_attention", "full_attention")
        if not mixer and pairs and pairs[-1][0] is not None and pairs[-1][1] is None and pairs[-1][0] == b - 1:
            pairs[-1] = (b - 1, b)
        else:
            pairs.append((b, None) if mixer else (None, b))
    return pairs


def layer_blocks(config: ModelConfig) -> list[tuple[int | None, int | None]]:
    """pair_blocks' pairs again from a config (its mixerless and mlpless layers): each layer's (mixer block, MLP
    block), None where it has no such part."""
    mixerless, mlpless = set(config.mixerless_layers), set(config.mlpless_layers)
    out, b = [], 0
    for i in range(config.num_layers):
        mixer = None if i in mixerless else b
        b += mixer is not None
        mlp = None if i in mlpless else b
        b += mlp is not None
        out.append((mixer, mlp))
    return out


def _nemotron_h_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """Nemotron-H (config keys as transformers 5 and the released checkpoints name them: layers_block_type or
    hybrid_override_pattern's M * - E): its blocks paired into layers (pair_blocks); Mamba-2 mixers of mamba_num_heads
    heads of mamba_head_dim in n_groups groups of ssm_state_size; unrotated attention without biases; squared-ReLU
    MLPs; DeepSeek-V3-routed squared-ReLU experts beside an ungated shared expert."""
    kinds = hf.get("layers_block_type") or hf.get("layer_types")
    if kinds is None:
        kinds = [NEMOTRON_BLOCKS.get(ch, ch) for ch in hf["hybrid_override_pattern"]]
    kinds = [NEMOTRON_BLOCKS.get(k, k) for k in kinds]
    if not kinds or set(kinds) - {"linear_attention", "full_attention", "mlp", "moe"}:
        raise CoreError(f"{source}: layers_block_type must name each block linear_attention (M), full_attention (*), "
                        f"mlp (-) or moe (E), got {kinds!r}", ErrorKind.SOURCE_FORMAT)
    for key in ("mlp_hidden_act", "mamba_hidden_act"):
        act = hf.get(key, "relu2" if key == "mlp_hidden_act" else "silu")
        if act != ("relu2" if key == "mlp_hidden_act" else "silu"):
            raise _unsupported(f"{source}: {key} {act!r} is not supported")
    if hf.get("mlp_bias") or hf.get("use_bias") or hf.get("mamba_proj_bias"):
        raise _unsupported(f"{source}: Nemotron-H with biased MLP or Mamba projections is not supported")
    if hf.get("moe_latent_size"):
        raise _unsupported(f"{source}: Nemotron-H's latent experts (moe_latent_size) are not supported")
    limit = hf.get("time_step_limit", hf.get("mamba_dt_limit", (0.0, float("inf"))))
    # (transformers writes infinity as {"__float__": "Infinity"}, json's own as Infinity)
    limit = [float(x["__float__"]) if isinstance(x, dict) else float(x) for x in limit] if limit else [0.0, math.inf]
    if limit[0] > 0 or math.isfinite(limit[1]):
        raise _unsupported(f"{source}: Nemotron-H with a clamped Mamba time step (time_step_limit {list(limit)}) is "
                           "not supported")
    pairs = pair_blocks(kinds)
    heads = int(hf.get("mamba_num_heads", 128))
    experts: dict[str, Any] = {}
    if "moe" in kinds:
        experts = dict(num_experts=int(hf.get("n_routed_experts", 8)), experts_per_token=int(hf["num_experts_per_tok"]),
                       expert_intermediate_size=int(hf["moe_intermediate_size"]),
                       norm_topk_prob=bool(hf.get("norm_topk_prob", True)), router_sigmoid=True,
                       expert_groups=int(hf.get("n_group", 1)), expert_groups_per_token=int(hf.get("topk_group", 1)),
                       routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
                       shared_expert_intermediate_size=int(hf.get("moe_shared_expert_intermediate_size", 7688))
                       if int(hf.get("n_shared_experts", 1)) else 0, shared_expert_gate=False,
                       dense_layers=tuple(i for i, (_, m) in enumerate(pairs) if m is not None and kinds[m] == "mlp"))
    linear = tuple(i for i, (m, _) in enumerate(pairs) if m is not None and kinds[m] == "linear_attention")
    mamba = dict(linear_layers=linear, linear_kind="mamba2", linear_value_heads=heads,
                 linear_value_dim=int(hf.get("mamba_head_dim", 64)),
                 linear_key_heads=int(hf.get("n_groups", hf.get("mamba_n_groups", 8))),
                 linear_key_dim=int(hf.get("ssm_state_size", 128)),
                 linear_conv_kernel=int(hf.get("conv_kernel", hf.get("mamba_d_conv", 4))),
                 linear_conv_bias=bool(hf.get("use_conv_bias", hf.get("mamba_conv_bias", True)))) if linear else {}
    heads_attn = int(hf["num_attention_heads"])
    return ModelConfig(
        architecture="llama", vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf.get("intermediate_size", 21504)), num_layers=len(pairs), num_heads=heads_attn,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads_attn),
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads_attn),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rms_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), rope_theta=10000.0, rope_scaling=None,
        attention_bias=False, qk_norm=False, hidden_act="relu2", mlp_gated=False,
        nope_layers=tuple(i for i, (m, _) in enumerate(pairs) if m is not None and kinds[m] == "full_attention"),
        **mamba, mixerless_layers=tuple(i for i, (m, _) in enumerate(pairs) if m is None),
        mlpless_layers=tuple(i for i, (_, m) in enumerate(pairs) if m is None),
        **experts)


def _falcon_h1_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """Falcon-H1: every layer attention (rope) and a Mamba-2 mixer in parallel (parallel_mixers), then a SwiGLU MLP;
    Mamba-2's intermediate size mamba_d_ssm (or mamba_expand * hidden) over mamba_n_heads heads in mamba_n_groups groups,
    its grouped norm only with mamba_rms_norm (after the gate: mamba_norm_before_gate false); the embeddings times
    embedding_multiplier, the logits times lm_head_multiplier (logits_scaling its inverse); the other multipliers
    (ssm_in, ssm_multipliers, ssm_out, attention_in, key, attention_out, mlp) folded into the weights on reading
    (loader._hf_falcon_h1)."""
    _check_silu(hf, source)
    if hf.get("mamba_rms_norm") and hf.get("mamba_norm_before_gate", True):
        raise _unsupported(f"{source}: Falcon-H1's Mamba-2 norm before its gate (mamba_norm_before_gate) is not "
                           "supported")
    if hf.get("mamba_proj_bias") or hf.get("projectors_bias") or hf.get("attention_bias") or hf.get("mlp_bias"):
        raise _unsupported(f"{source}: Falcon-H1 with biased projections is not supported")
    limit = hf.get("time_step_limit") or [0.0, math.inf]
    limit = [float(x["__float__"]) if isinstance(x, dict) else float(x) for x in limit]
    if limit[0] > 0 or math.isfinite(limit[1]):
        raise _unsupported(f"{source}: Falcon-H1 with a clamped Mamba time step (time_step_limit {limit}) is not "
                           "supported")
    sizes = _sizes(hf, max_positions=8192)
    inner = int(hf.get("mamba_d_ssm") or int(hf.get("mamba_expand", 2)) * int(hf["hidden_size"]))
    heads = int(hf.get("mamba_n_heads", 128))
    head = hf.get("mamba_d_head", "auto")
    theta, scaling = _rope_from_hf(hf, source)
    return ModelConfig(
        architecture="llama", **sizes, rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)), rope_theta=theta,
        rope_scaling=scaling, attention_bias=False, qk_norm=False,
        linear_layers=tuple(range(sizes["num_layers"])), linear_kind="mamba2", parallel_mixers=True,
        linear_norm=bool(hf.get("mamba_rms_norm", False)), linear_value_heads=heads,
        linear_value_dim=inner // heads if head in (None, "auto") else int(head),
        linear_key_heads=int(hf.get("mamba_n_groups", 1)), linear_key_dim=int(hf.get("mamba_d_state", 256)),
        linear_conv_kernel=int(hf.get("mamba_d_conv", 4)), linear_conv_bias=bool(hf.get("mamba_conv_bias", True)),
        embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
        logits_scaling=1.0 / float(hf.get("lm_head_multiplier", 1.0)))


def _bamba_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """Bamba: the layers named in attn_layer_indices attend (half of each head rotated, as transformers hard-codes
    it), the others are Granite 4.0-H's Mamba-2 mixers (its mamba_* keys); a SwiGLU MLP (feed_forward) after each;
    norms input_layernorm, pre_ff_layernorm, final_layernorm (the loader's names)."""
    _check_silu(hf, source)
    if hf.get("mlp_bias") or hf.get("attention_bias"):
        raise _unsupported(f"{source}: Bamba with biased projections is not supported")
    layers = int(hf["num_hidden_layers"])
    attending = {int(i) for i in hf.get("attn_layer_indices") or ()}
    types = ["attention" if i in attending else "mamba" for i in range(layers)]
    sizes = _sizes(hf, max_positions=262144)
    theta, scaling = _rope_from_hf(hf, source)
    return ModelConfig(
        architecture="llama", **sizes, rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)), rope_theta=theta,
        rope_scaling=scaling, attention_bias=False, qk_norm=False, rotary_dim=sizes["head_dim"] // 2,
        **_granite_hybrid_from_hf({**hf, "layer_types": types}, source))


def _jamba_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """Jamba: layer i attends where i % attn_layer_period == attn_layer_offset (no positional embedding), the others
    are Mamba-1 mixers (mamba_expand * hidden channels, mamba_d_state states each, dt from a mamba_dt_rank-wide
    projection ("auto": hidden / 16, rounded up), dt / B / C RMS-normed); where i % expert_layer_period ==
    expert_layer_offset the MLP is num_experts SwiGLU experts (the router's softmax, its top num_experts_per_tok
    weights as they are), else a dense SwiGLU MLP."""
    _check_silu(hf, source)
    if hf.get("mamba_proj_bias") or hf.get("attention_bias"):
        raise _unsupported(f"{source}: Jamba with biased projections is not supported")
    sizes = _sizes(hf, max_positions=262144)
    layers = sizes["num_layers"]
    attn_period, attn_offset = int(hf.get("attn_layer_period", 8)), int(hf.get("attn_layer_offset", 4))
    expert_period, expert_offset = int(hf.get("expert_layer_period", 2)), int(hf.get("expert_layer_offset", 1))
    attending = tuple(i for i in range(layers) if i % attn_period == attn_offset)
    routed = [i for i in range(layers) if i % expert_period == expert_offset]
    experts: dict[str, Any] = {}
    if int(hf.get("num_experts", 16)) > 1 and routed:
        experts = dict(num_experts=int(hf.get("num_experts", 16)), experts_per_token=int(hf.get("num_experts_per_tok", 2)),
                       expert_intermediate_size=sizes["intermediate_size"],
                       dense_layers=tuple(i for i in range(layers) if i not in routed))
    rank = hf.get("mamba_dt_rank", "auto")
    return ModelConfig(
        architecture="llama", **sizes, rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=10000.0,
        rope_scaling=None, attention_bias=False, qk_norm=False, nope_layers=attending,
        linear_layers=tuple(i for i in range(layers) if i not in attending), linear_kind="mamba1",
        linear_value_heads=int(hf.get("mamba_expand", 2)) * sizes["hidden_size"], linear_value_dim=1,
        linear_key_heads=1, linear_key_dim=int(hf.get("mamba_d_state", 16)),
        linear_conv_kernel=int(hf.get("mamba_d_conv", 4)), linear_conv_bias=bool(hf.get("mamba_conv_bias", True)),
        linear_dt_rank=math.ceil(sizes["hidden_size"] / 16) if rank in (None, "auto") else int(rank), **experts)


def _mamba_lm_from_hf(hf: dict[str, Any], source: str, model_type: str) -> ModelConfig:
    """A Mamba (mamba: Mamba-1 mixers of expand * hidden channels, state_size states each, dt's rank time_step_rank,
    "auto": hidden / 16 rounded up, no dt / B / C norms; falcon_mamba: weightless ones of mixer_rms_eps) or Mamba-2
    (mamba2: num_heads of head_dim in n_groups groups, the gated grouped norm) language model: every layer an RMSNorm and its mixer alone (mlpless), no attention at all
    (a nominal head of 2 dimensions, no keys or values kept)."""
    if hf.get("use_bias"):
        raise _unsupported(f"{source}: {model_type} with biased projections (use_bias) is not supported")
    limit = hf.get("time_step_limit") or [0.0, math.inf]
    limit = [float(x["__float__"]) if isinstance(x, dict) else float(x) for x in limit]
    if limit[0] > 0 or math.isfinite(limit[1]):
        raise _unsupported(f"{source}: a clamped Mamba time step (time_step_limit {limit}) is not supported")
    hidden, layers = int(hf["hidden_size"]), int(hf["num_hidden_layers"])
    if model_type in ("mamba", "falcon_mamba"):  # (Falcon-Mamba: weightless norms on dt, B and C, its own epsilon)
        rank = hf.get("time_step_rank", "auto")
        falcon = model_type == "falcon_mamba"
        mixer = dict(linear_kind="mamba1", linear_value_heads=int(hf.get("expand", 2)) * hidden, linear_value_dim=1,
                     linear_key_heads=1, linear_dt_rank=math.ceil(hidden / 16) if rank in (None, "auto") else int(rank),
                     linear_norm=falcon, linear_norm_eps=float(hf.get("mixer_rms_eps", 1e-6)) if falcon else None)
    else:
        mixer = dict(linear_kind="mamba2", linear_value_heads=int(hf.get("num_heads", 128)),
                     linear_value_dim=int(hf.get("head_dim", 64)), linear_key_heads=int(hf.get("n_groups", 8)))
    return ModelConfig(
        architecture="llama", vocab_size=int(hf["vocab_size"]), hidden_size=hidden, intermediate_size=hidden,
        num_layers=layers, num_heads=1, num_kv_heads=1, head_dim=2,
        max_position_embeddings=int(hf.get("max_position_embeddings") or 262144),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", model_type != "mamba2")),
        rms_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), rope_theta=10000.0, rope_scaling=None,
        attention_bias=False, qk_norm=False, linear_layers=tuple(range(layers)), mlpless_layers=tuple(range(layers)),
        linear_key_dim=int(hf.get("state_size", 128 if model_type == "mamba2" else 16)),
        linear_conv_kernel=int(hf.get("conv_kernel", 4)), linear_conv_bias=bool(hf.get("use_conv_bias", True)), **mixer)


def _kimi_linear_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """Kimi Linear: its full_attention layers DeepSeek's latent attention with no rope at all (the shared key part
    too), the others Kimi Delta Attention (linear_kind kda: linear_num_heads heads of linear_head_dim; the released
    configs' linear_attn_config: kda_layers / full_attn_layers numbered from 1, head_dim, num_heads,
    short_conv_kernel_size); its sparse MLPs DeepSeek-V3's routed experts (num_local_experts) beside a shared one, its
    dense ones (mlp_layer_types, or the first first_k_dense_replace) SwiGLU MLPs."""
    layers = int(hf["num_hidden_layers"])
    linear_cfg = hf.get("linear_attn_config") or {}
    types = hf.get("layer_types")
    if not types and "full_attn_layers" in linear_cfg:
        full = {int(i) - 1 for i in linear_cfg["full_attn_layers"]}
        types = ["full_attention" if i in full else "linear_attention" for i in range(layers)]
    if not types:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]
    mlp_types = hf.get("mlp_layer_types") or [
        "dense" if i < int(hf.get("first_k_dense_replace", 1)) else "sparse" for i in range(layers)]
    if len(types) != layers or len(mlp_types) != layers or set(types) - {"full_attention", "linear_attention"}:
        raise CoreError(f"{source}: layer_types / mlp_layer_types must name each of the {layers} layers",
                        ErrorKind.SOURCE_FORMAT)
    # (its own names for DeepSeek's keys, as its configs write them)
    names = {"model_max_length": "max_position_embeddings", "moe_renormalize": "norm_topk_prob",
             "num_expert_group": "n_group", "num_experts": "n_routed_experts", "num_local_experts": "n_routed_experts",
             "num_experts_per_token": "num_experts_per_tok", "num_shared_experts": "n_shared_experts"}
    deepseek = {**hf, **{ours: hf[theirs] for theirs, ours in names.items() if theirs in hf}}
    deepseek.setdefault("n_routed_experts", 256)
    latent = _deepseek_from_hf({**deepseek, "first_k_dense_replace": 0, "rope_interleave": False}, source,
                               "deepseek_v3")
    heads, head = int(linear_cfg.get("num_heads", hf.get("linear_num_heads", 32))), \
        int(linear_cfg.get("head_dim", hf.get("linear_head_dim", 128)))
    linear = tuple(i for i, t in enumerate(types) if t == "linear_attention")
    return dataclasses.replace(
        latent, nope_layers=tuple(i for i, t in enumerate(types) if t == "full_attention"),
        dense_layers=tuple(i for i, t in enumerate(mlp_types) if t != "sparse") if latent.num_experts else (),
        linear_layers=linear, linear_kind="kda" if linear else "", linear_key_heads=heads if linear else 0,
        linear_value_heads=heads if linear else 0, linear_key_dim=head if linear else 0,
        linear_value_dim=head if linear else 0,
        linear_conv_kernel=int(linear_cfg.get("short_conv_kernel_size", hf.get("linear_conv_kernel_dim", 4)))
        if linear else 0)


def _afmoe_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """Arcee AFMoE (Trinity): per-head q/k norms before rope; the sliding_attention layers (layer_types, or all but every
    global_attn_every_n_layers-th) windowed and rotated, the full ones unrotated; attention's output times
    sigmoid(gate_proj(x)) before o; norms before and after attention and the MLP; after num_dense_layers dense layers,
    experts chosen by sigmoid score plus a correction bias (no groups), renormalised, times route_scale, beside an
    ungated shared expert; with mup_enabled the embeddings times sqrt(hidden)."""
    _check_silu(hf, source)
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise _unsupported(f"{source}: AFMoE with biased projections is not supported")
    sizes = _sizes(hf, head_dim=128)
    layers = sizes["num_layers"]
    every = int(hf.get("global_attn_every_n_layers") or 4)
    windows = _layer_windows(hf, layers, source, int(hf.get("sliding_window") or 1024), lambda i: (i + 1) % every)
    theta, scaling = _rope_from_hf(hf, source)
    moe = int(hf.get("moe_intermediate_size", 1408))
    return ModelConfig(
        architecture="llama", **sizes, rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)), rope_theta=theta,
        rope_scaling=scaling, attention_bias=False, qk_norm=True, attn_output_gate=True, sandwich_norm=True,
        layer_windows=windows, nope_layers=tuple(i for i, w in enumerate(windows) if not w),
        embed_scale=bool(hf.get("mup_enabled")), num_experts=int(hf.get("num_experts", 64)),
        experts_per_token=int(hf.get("num_experts_per_tok", 6)), expert_intermediate_size=moe, norm_topk_prob=True,
        router_sigmoid=True, shared_expert_gate=False,
        shared_expert_intermediate_size=moe * int(hf.get("num_shared_experts", 2) or 0),
        routed_scaling=float(hf.get("route_scale", 1.0)),
        dense_layers=tuple(range(min(layers, int(hf.get("num_dense_layers", 1) or 0)))))


def _starcoder2_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """BigCode StarCoder2 (3B-15B): Llama's attention with biases on all four projections (use_bias) and one window on
    every layer (sliding_window); LayerNorms (norm_epsilon) with biases before attention and the MLP; an ungated MLP
    c_fc, tanh-GELU, c_proj, biased; tied embeddings by default."""
    act = _hf_act(hf, source, "StarCoder2", "gelu_pytorch_tanh", {"gelu_pytorch_tanh": "gelu_pytorch_tanh"})
    biased = bool(hf.get("use_bias", True))
    theta, scaling = _rope_from_hf(hf, source)
    window = hf.get("sliding_window")
    return ModelConfig(
        architecture="llama", **_sizes(hf, max_positions=4096, tied=True), rms_norm_eps=float(hf.get("norm_epsilon", 1e-5)),
        rope_theta=theta, rope_scaling=scaling, attention_bias=biased, attention_out_bias=biased, qk_norm=False,
        layer_norm=True, norm_bias=True, mlp_bias=biased, mlp_gated=False, hidden_act=act,
        sliding_window=int(window) if window else None)


def _jais2_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """Inception Jais 2: Llama's attention (biases on q, k, v and o where attention_bias), biased LayerNorms
    (layer_norm_eps) before attention and the MLP and at the end, an ungated MLP up, relu(x)^2, down (biased where
    mlp_bias)."""
    act = _hf_act(hf, source, "Jais 2", "relu2", {"relu2": "relu2"})
    theta, scaling = _rope_from_hf(hf, source)
    biased = bool(hf.get("attention_bias", True))
    return ModelConfig(
        architecture="llama", **_sizes(hf, max_positions=8192), rms_norm_eps=float(hf.get("layer_norm_eps", 1e-5)),
        rope_theta=theta, rope_scaling=scaling, attention_bias=biased, attention_out_bias=biased, qk_norm=False,
        layer_norm=True, norm_bias=True, mlp_bias=bool(hf.get("mlp_bias", True)), mlp_gated=False, hidden_act=act)


def _gpt2_from_hf(hf: dict[str, Any], source: str, model_type: str) -> ModelConfig:
    """OpenAI GPT-2 and BigCode GPT-BigCode: learned position embeddings (n_positions rows) added to the token's, no
    rope; biased LayerNorms (layer_norm_epsilon) before attention and the MLP and at the end; biased projections; an
    ungated MLP c_fc, GELU (GPT-2's tanh one), c_proj; tied embeddings; BigCode's multi_query one KV head. Scores
    scaled by head_dim^-0.5 only (scale_attn_by_inverse_layer_idx and unscaled attention refused)."""
    family = "GPT-2" if model_type == "gpt2" else "GPT-BigCode"
    if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True):
        raise _unsupported(f"{source}: {family} with scale_attn_by_inverse_layer_idx or without scale_attn_weights "
                           "is not supported")
    if hf.get("add_cross_attention"):
        raise _unsupported(f"{source}: {family} with cross-attention is not supported")
    act = _hf_act(hf, source, family, "gelu_new" if model_type == "gpt2" else "gelu_pytorch_tanh",
                  {**_TANH_GELU, "gelu": "gelu"}, key="activation_function")
    hidden, heads = int(hf["n_embd"]), int(hf["n_head"])
    sizes = _sizes({"vocab_size": hf["vocab_size"], "hidden_size": hidden,
                    "intermediate_size": int(hf.get("n_inner") or 4 * hidden), "num_hidden_layers": hf["n_layer"],
                    "num_attention_heads": heads,
                    "num_key_value_heads": 1 if model_type == "gpt_bigcode" and hf.get("multi_query", True) else heads,
                    "max_position_embeddings": hf.get("n_positions", 1024),
                    "tie_word_embeddings": hf.get("tie_word_embeddings", True)})
    return ModelConfig(
        architecture="llama", **sizes, rms_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), rope_theta=10000.0,
        rope_scaling=None, attention_bias=True, attention_out_bias=True, qk_norm=False, layer_norm=True,
        norm_bias=True, mlp_bias=True, mlp_gated=False, hidden_act=act, position_embeddings=True,
        nope_layers=tuple(range(sizes["num_layers"])))


def _gpt_neox_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """EleutherAI GPT-NeoX (Pythia, GPT-NeoX-20B): biased LayerNorms; with use_parallel_residual (the released models)
    attention and the MLP side by side, each from its own norm of the layer's input (parallel_norms), else Llama's
    order; partial_rotary_factor (rotary_pct) of each head rotated; query_key_value each head's q, k, v (reordered on
    reading), biased as dense (o); an ungated MLP with exact GELU (or tanh's), biased."""
    act = _hf_act(hf, source, "GPT-NeoX", "gelu", {"gelu": "gelu", **_TANH_GELU})
    sizes = {**_sizes(hf, max_positions=2048), "num_kv_heads": int(hf["num_attention_heads"])}  # (no grouped queries)
    theta, scaling = _rope_from_hf(hf, source)
    params = hf.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", hf.get("rotary_pct") or hf.get("partial_rotary_factor"))
    rotated = int(sizes["head_dim"] * float(0.25 if factor is None else factor))
    biased = bool(hf.get("attention_bias", True))
    parallel = bool(hf.get("use_parallel_residual", True))
    return ModelConfig(
        architecture="llama", **sizes, rms_norm_eps=float(hf.get("layer_norm_eps", 1e-5)), rope_theta=theta,
        rope_scaling=scaling, attention_bias=biased, attention_out_bias=biased, qk_norm=False, layer_norm=True,
        norm_bias=True, parallel_block=parallel, parallel_norms=parallel, mlp_bias=True, mlp_gated=False,
        hidden_act=act, rotary_dim=rotated if rotated != sizes["head_dim"] else None)


def _phi_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """Microsoft Phi-1 / 1.5 / 2 (phi): one biased LayerNorm a layer feeding attention and the MLP side by side (Cohere's
    parallel block), partial_rotary_factor of each head rotated (rotate-half within), biases on q/k/v and dense (o), an
    ungated MLP fc1, tanh-GELU (gelu_new), fc2 with biases, a biased final LayerNorm and LM head. Per-head q/k
    LayerNorms (qk_layernorm) are refused by name."""
    act = _hf_act(hf, source, "Phi", "gelu_new", {k: v for k, v in _TANH_GELU.items() if k != "gelu_fast"})
    if hf.get("qk_layernorm"):
        raise _unsupported(f"{source}: Phi with qk_layernorm is not supported")
    sizes = _sizes(hf, max_positions=2048)
    theta, scaling = _rope_from_hf(hf, source)
    params = hf.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    rotated = int(sizes["head_dim"] * float(0.5 if factor is None else factor))
    return ModelConfig(
        architecture="llama", **sizes, rms_norm_eps=float(hf.get("layer_norm_eps", 1e-5)), rope_theta=theta,
        rope_scaling=scaling, attention_bias=True, attention_out_bias=True, qk_norm=False, layer_norm=True,
        norm_bias=True, parallel_block=True, mlp_bias=True, mlp_gated=False, hidden_act=act,
        lm_head_bias=not sizes["tie_word_embeddings"],
        rotary_dim=rotated if rotated != sizes["head_dim"] else None)


def alibi_slopes(num_heads: int, max_bias: float = 8.0) -> tuple[float, ...]:
    """ALiBi's slope for each of ``num_heads`` heads, as BLOOM (and llama.cpp, with its max_bias) computes them:
    2^(-max_bias i / n) for i = 1..n over the largest power of two n <= num_heads, then the odd steps of
    2^(-max_bias / 2 / n) for the heads past it."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-max_bias / closest)
    slopes = [base ** i for i in range(1, closest + 1)]
    if closest != num_heads:
        extra = 2.0 ** (-max_bias / 2 / closest)
        slopes += [extra ** i for i in range(1, 1 + 2 * min(closest, num_heads - closest), 2)]
    return tuple(map(_float32, slopes))  # (as BLOOM's float32 tensor holds them)


def mpt_alibi_slopes(num_heads: int, bias_max: float = 8.0) -> tuple[float, ...]:
    """ALiBi's slopes as MPT computes them: 2^(-bias_max * i / p) for i = 1..p over the power of two p >= num_heads,
    then (where p > num_heads) the odd-indexed ones before the even-indexed ones, the first num_heads kept."""
    p = 2 ** math.ceil(math.log2(num_heads))
    slopes = [1.0 / 2.0 ** (i * (bias_max / p)) for i in range(1, p + 1)]
    if p != num_heads:
        slopes = (slopes[1::2] + slopes[::2])[:num_heads]
    return tuple(map(_float32, slopes))


def _mpt_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """MosaicML MPT: ALiBi (its slopes, alibi_bias_max) in place of rope; LayerNorms with weights alone
    (layer_norm_epsilon) before attention and the MLP and at the end; Wqkv's q, k, v blocks and out_proj without
    biases, clamped to clip_qkv where it says; scores times softmax_scale (else head_dim^-0.5); an ungated MLP up,
    exact GELU, down of expansion_ratio * d_model; tied embeddings. Biases (no_bias false), q/k LayerNorms (qk_ln),
    learned positions without ALiBi and prefix-LM attention are refused by name."""
    attn = hf.get("attn_config") or {}
    for bad, why in ((not hf.get("no_bias", True), "biases (no_bias false)"), (attn.get("qk_ln"), "q/k LayerNorms (qk_ln)"),
                     (not attn.get("alibi", True), "learned positions without ALiBi"),
                     (attn.get("prefix_lm"), "prefix-LM attention")):
        if bad:
            raise _unsupported(f"{source}: MPT with {why} is not supported")
    hidden, heads, layers = int(hf["d_model"]), int(hf["n_heads"]), int(hf["n_layers"])
    sizes = _sizes({"vocab_size": hf["vocab_size"], "hidden_size": hidden,
                    "intermediate_size": int(hf.get("expansion_ratio", 4)) * hidden, "num_hidden_layers": layers,
                    "num_attention_heads": heads, "max_position_embeddings": hf.get("max_seq_len", 2048),
                    "tie_word_embeddings": hf.get("tie_word_embeddings", True)})
    scale = attn.get("softmax_scale")
    return ModelConfig(
        architecture="llama", **sizes, rms_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), rope_theta=10000.0,
        rope_scaling=None, attention_bias=False, attention_out_bias=False, qk_norm=False, layer_norm=True,
        mlp_gated=False, hidden_act="gelu", attention_scale=float(scale) if scale else None,
        clip_qkv=float(attn.get("clip_qkv") or 0.0),
        alibi_slopes=mpt_alibi_slopes(heads, float(attn.get("alibi_bias_max", 8))), nope_layers=tuple(range(layers)))


def _bloom_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """BigScience BLOOM (560M-176B, BLOOMZ): ALiBi position biases (alibi_slopes) in place of rope; the embeddings
    through a biased LayerNorm of their own (embedding_layer_norm); biased LayerNorms (layer_norm_epsilon) before
    attention and the MLP; query_key_value each head's q, k, v in turn, biased like dense; an ungated MLP
    dense_h_to_4h, tanh-GELU, dense_4h_to_h with biases; tied embeddings. The residual taken after the norm
    (apply_residual_connection_post_layernorm) is refused."""
    if hf.get("apply_residual_connection_post_layernorm"):
        raise _unsupported(f"{source}: BLOOM with apply_residual_connection_post_layernorm is not supported")
    hidden = int(hf.get("hidden_size") or hf["n_embed"])
    heads = int(hf.get("n_head") or hf["num_attention_heads"])
    layers = int(hf.get("n_layer") or hf["num_hidden_layers"])
    sizes = _sizes({"vocab_size": hf["vocab_size"], "hidden_size": hidden, "intermediate_size": 4 * hidden,
                    "num_hidden_layers": layers, "num_attention_heads": heads,
                    "max_position_embeddings": hf.get("seq_length") or hf.get("max_position_embeddings") or 2048,
                    "tie_word_embeddings": hf.get("tie_word_embeddings", True)})
    return ModelConfig(
        architecture="llama", **sizes, rms_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), rope_theta=10000.0,
        rope_scaling=None, attention_bias=True, attention_out_bias=True, qk_norm=False, layer_norm=True,
        norm_bias=True, mlp_bias=True, mlp_gated=False, hidden_act="gelu_pytorch_tanh", alibi_slopes=alibi_slopes(heads),
        embedding_layer_norm=True, nope_layers=tuple(range(layers)))


def _opt_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """Meta OPT: learned position embeddings (the table's first two rows unused: OPT offsets positions by 2) added to
    the token's, no rope; biased LayerNorms before attention and the MLP (do_layer_norm_before) and at the end;
    q, k, v and out_proj biased where enable_bias; an ungated MLP fc1, ReLU (activation_function), fc2; tied
    embeddings. The norms after (OPT-350M), a projection between the embeddings' and the model's widths
    (word_embed_proj_dim) and weightless LayerNorms are refused by name."""
    for bad, why in ((not hf.get("do_layer_norm_before", True), "norms after attention and the MLP "
                      "(do_layer_norm_before false)"),
                     (int(hf.get("word_embed_proj_dim") or hf["hidden_size"]) != int(hf["hidden_size"]),
                      "word_embed_proj_dim"), (not hf.get("layer_norm_elementwise_affine", True), "weightless LayerNorms"),
                     (hf.get("_remove_final_layer_norm"), "no final LayerNorm")):
        if bad:
            raise _unsupported(f"{source}: OPT with {why} is not supported")
    act = _hf_act(hf, source, "OPT", "relu", {"relu": "relu", "gelu": "gelu", **_TANH_GELU}, key="activation_function")
    sizes = _sizes({**hf, "intermediate_size": hf["ffn_dim"], "num_key_value_heads": None}, max_positions=2048,
                   tied=True)  # (no grouped queries)
    biased = bool(hf.get("enable_bias", True))
    return ModelConfig(
        architecture="llama", **sizes, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
        attention_bias=biased, attention_out_bias=biased, qk_norm=False, layer_norm=True, norm_bias=True,
        mlp_bias=biased, mlp_gated=False, hidden_act=act, position_embeddings=True,
        nope_layers=tuple(range(sizes["num_layers"])))


def _gpt_neo_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """EleutherAI GPT-Neo: learned position embeddings (max_position_embeddings rows) added to the token's, no rope;
    biased LayerNorms (layer_norm_epsilon) before attention and the MLP and at the end; q, k, v without biases and
    out_proj with one; scores not scaled (attention_scale 1); the local layers of attention_types each query's last
    window_size keys; an ungated MLP c_fc, GELU (activation_function, its tanh one by default), c_proj with biases;
    tied embeddings."""
    act = _hf_act(hf, source, "GPT-Neo", "gelu_new", {**_TANH_GELU, "gelu": "gelu"}, key="activation_function")
    hidden, heads, layers = int(hf["hidden_size"]), int(hf["num_heads"]), int(hf["num_layers"])
    kinds = hf.get("attention_layers") or [kind for pattern, repeat in hf["attention_types"]
                                           for _ in range(int(repeat)) for kind in pattern]
    if len(kinds) != layers or set(kinds) - {"global", "local"}:
        raise CoreError(f"{source}: attention_types must name each of the {layers} layers global or local",
                        ErrorKind.SOURCE_FORMAT)
    window = int(hf.get("window_size", 256))
    sizes = _sizes({"vocab_size": hf["vocab_size"], "hidden_size": hidden,
                    "intermediate_size": int(hf.get("intermediate_size") or 4 * hidden), "num_hidden_layers": layers,
                    "num_attention_heads": heads, "max_position_embeddings": hf.get("max_position_embeddings", 2048),
                    "tie_word_embeddings": hf.get("tie_word_embeddings", True)})
    windows = tuple(window if kind == "local" else 0 for kind in kinds)
    return ModelConfig(
        architecture="llama", **sizes, rms_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), rope_theta=10000.0,
        rope_scaling=None, attention_bias=False, attention_out_bias=True, qk_norm=False, layer_norm=True,
        norm_bias=True, mlp_bias=True, mlp_gated=False, hidden_act=act, position_embeddings=True,
        nope_layers=tuple(range(layers)), attention_scale=1.0,
        layer_windows=windows if len(set(windows)) > 1 else None,
        sliding_window=window if set(windows) == {window} else None)


def _gptj_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """EleutherAI GPT-J (6B; GPT-JT, Pygmalion): one biased LayerNorm a layer feeding attention and the MLP side by
    side (parallel_block), q/k/v and out_proj without biases, the first rotary_dim of each head turned by interleaved
    pairs at theta 10000 (reordered to rotate-half on reading: rope_interleaved), an ungated MLP fc_in, tanh-GELU,
    fc_out with biases, a biased final LayerNorm and LM head."""
    act = _hf_act(hf, source, "GPT-J", "gelu_new", {k: v for k, v in _TANH_GELU.items() if k != "gelu_fast"},
                  key="activation_function")
    hidden, heads = int(hf["n_embd"]), int(hf["n_head"])
    sizes = _sizes({"vocab_size": hf["vocab_size"], "hidden_size": hidden,
                    "intermediate_size": int(hf.get("n_inner") or 4 * hidden), "num_hidden_layers": hf["n_layer"],
                    "num_attention_heads": heads, "max_position_embeddings": hf.get("n_positions", 2048),
                    "tie_word_embeddings": hf.get("tie_word_embeddings", False)})
    rotated = int(hf.get("rotary_dim") or sizes["head_dim"])
    return ModelConfig(
        architecture="llama", **sizes, rms_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), rope_theta=10000.0,
        rope_scaling=None, attention_bias=False, attention_out_bias=False, qk_norm=False, layer_norm=True,
        norm_bias=True, parallel_block=True, mlp_bias=True, mlp_gated=False, hidden_act=act,
        lm_head_bias=not sizes["tie_word_embeddings"], rope_interleaved=True,
        rotary_dim=rotated if rotated != sizes["head_dim"] else None)


def _falcon_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """TII Falcon: with parallel_attn (the released models) attention and an ungated MLP (dense_h_to_4h, GELU,
    dense_4h_to_h) side by side, from one biased LayerNorm, or (new_decoder_architecture with two of them, 40B and
    180B) each from its own; else Llama's order. Rope over the whole head; one KV head (multi_query, 7B) or
    num_kv_heads (new_decoder_architecture), q, k and v in one query_key_value (split on reading); biases where bias
    says; tied embeddings. Falcon-RW's ALiBi (alibi) in place of rope: BLOOM's slopes rounded to bfloat16 and divided
    by sqrt(head_dim), as transformers biases its scores."""
    act = _hf_act(hf, source, "Falcon", "gelu", {"gelu": "gelu", **_TANH_GELU}, key="activation")
    heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    new = bool(hf.get("new_decoder_architecture", False))
    kv_heads = int(hf.get("num_kv_heads") or heads) if new or not hf.get("multi_query", True) else 1
    sizes = _sizes({**hf, "num_key_value_heads": kv_heads, "intermediate_size": int(hf.get("ffn_hidden_size")
                                                                                     or 4 * hidden)}, tied=True)
    parallel = bool(hf.get("parallel_attn", True)) or new
    two_norms = new and int(hf.get("num_ln_in_parallel_attn") or 2) == 2
    theta, scaling = _rope_from_hf(hf, source)
    biased = bool(hf.get("bias", False))
    alibi = {}
    if hf.get("alibi"):
        root = math.sqrt(sizes["head_dim"])
        alibi = dict(alibi_slopes=tuple(_bfloat16(s) / root for s in alibi_slopes(heads)),
                     nope_layers=tuple(range(sizes["num_layers"])), alibi_bf16_positions=True)
    return ModelConfig(
        architecture="llama", **sizes, rms_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), rope_theta=theta,
        rope_scaling=scaling, attention_bias=biased, attention_out_bias=biased, qk_norm=False, layer_norm=True,
        norm_bias=True, parallel_block=parallel, parallel_norms=two_norms, mlp_bias=biased, mlp_gated=False,
        hidden_act=act, **alibi)


def _float32(x: float) -> float:
    """``x`` rounded to float32, as a float."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _bfloat16(x: float) -> float:
    """``x`` rounded to bfloat16 (to nearest, ties to even), as a float."""
    bits = struct.unpack("I", struct.pack("f", x))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("f", struct.pack("I", bits))[0]


def _stablelm_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """Stability StableLM: Llama's layer with LayerNorms (biased, layer_norm_eps), partial_rotary_factor of each head
    rotated (rotate-half within), q/k/v biases where use_qkv_bias (never o's); StableLM 2 12B's per-head q/k
    LayerNorms (qk_layernorm: each head its own weights, no bias) and parallel residual (use_parallel_residual:
    attention and the MLP side by side from the one norm)."""
    _check_silu(hf, source)
    parallel = bool(hf.get("use_parallel_residual"))
    sizes = _sizes(hf, max_positions=4096)
    theta, scaling = _rope_from_hf(hf, source)
    params = hf.get("rope_parameters") or {}
    rotated = int(sizes["head_dim"] * float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))))
    return ModelConfig(
        architecture="llama", **sizes, rms_norm_eps=float(hf.get("layer_norm_eps", 1e-5)), rope_theta=theta,
        rope_scaling=scaling, attention_bias=bool(hf.get("use_qkv_bias")), attention_out_bias=False,
        qk_norm=bool(hf.get("qk_layernorm")), qk_layer_norm_per_head=bool(hf.get("qk_layernorm")), layer_norm=True,
        norm_bias=True, parallel_block=parallel, rotary_dim=rotated if rotated != sizes["head_dim"] else None)


def _nemotron_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """NVIDIA Nemotron-4 and its Minitron prunings (nemotron): LayerNorm1P (mean-centred, weight 1 + w, biased: the
    loader adds the 1) before attention and the MLP; partial_rotary_factor of each head rotated (rotate-half within);
    an ungated MLP up, relu(x)^2, down; biases where attention_bias / mlp_bias say."""
    act = _hf_act(hf, source, "Nemotron", "relu2", {"relu2": "relu2"})
    sizes = _sizes(hf, max_positions=4096)
    theta, scaling = _rope_from_hf(hf, source)
    params = hf.get("rope_parameters") or {}
    factor = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5)))
    rotated = int(sizes["head_dim"] * factor)
    biased = bool(hf.get("attention_bias"))
    return ModelConfig(
        architecture="llama", **sizes, rms_norm_eps=float(hf.get("norm_eps", 1e-5)), rope_theta=theta,
        rope_scaling=scaling, attention_bias=biased, attention_out_bias=biased, qk_norm=False, layer_norm=True,
        norm_bias=True, mlp_bias=bool(hf.get("mlp_bias")), mlp_gated=False, hidden_act=act,
        rotary_dim=rotated if rotated != sizes["head_dim"] else None)


def _ungated_from_hf(hf: dict[str, Any], source: str, family: str, act: str, **fields) -> ModelConfig:
    """Llama's attention (its rope scaling too) with an ungated MLP (up, act, down): Apertus' xIELU (with per-head
    q/k norms before rope), Arcee's ReLU squared."""
    if hf.get("hidden_act", act) != act:
        raise _unsupported(f"{source}: {family} with hidden_act {hf.get('hidden_act')!r} is not supported ({act})")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise _unsupported(f"{source}: {family} with biased projections is not supported")
    theta, scaling = _rope_from_hf(hf, source)
    return ModelConfig(
        architecture="llama", rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)), rope_theta=theta,
        rope_scaling=scaling, attention_bias=False, hidden_act=act, mlp_gated=False, **fields)


def _apertus_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """Apertus: Llama's attention with per-head q/k norms before rope (Llama 3's scaling), norms named
    attention_layernorm / feedforward_layernorm (the loader's), an ungated MLP (up, xIELU with the layer's own
    alpha_p / alpha_n / beta / eps, down)."""
    return _ungated_from_hf(hf, source, "Apertus", "xielu", **_sizes(hf, max_positions=65536), qk_norm=True)


def _phimoe_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """Phi-3.5-MoE: Llama's attention (biased where attention_bias; LongRoPE as Phi-3's) between biased LayerNorms
    (eps rms_norm_eps), every layer's MLP num_local_experts SwiGLU experts of intermediate_size (Mixtral's names)
    chosen two at a time by sparsemixer (router_jitter_noise its threshold), an LM head biased where lm_head_bias."""
    _check_silu(hf, source)
    if int(hf.get("num_experts_per_tok", 2)) != 2:
        raise _unsupported(f"{source}: Phi-3.5-MoE's sparsemixer with num_experts_per_tok "
                           f"{hf.get('num_experts_per_tok')} is not supported (2)")
    theta, scaling = _rope_from_hf({**hf, "model_type": "phi3"}, source)  # (Phi-3's names for LongRoPE)
    sizes = _sizes(hf)
    bias = bool(hf.get("attention_bias"))
    window = hf.get("sliding_window")
    return ModelConfig(
        architecture="llama", **sizes, rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)), rope_theta=theta,
        rope_scaling=scaling, attention_bias=bias, attention_out_bias=bias, qk_norm=False, layer_norm=True,
        norm_bias=True, lm_head_bias=bool(hf.get("lm_head_bias")),
        sliding_window=int(window) if window and int(window) < sizes["max_position_embeddings"] else None,
        num_experts=int(hf.get("num_local_experts", 16)), experts_per_token=2,
        expert_intermediate_size=sizes["intermediate_size"], norm_topk_prob=False,
        router_sparsemixer=float(hf.get("router_jitter_noise", 0.01)) or 1e-30)


def _arcee_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """Arcee (AFM-4.5B): Llama's attention (YaRN in the released config), an ungated MLP: up, relu(x)^2, down."""
    return _ungated_from_hf(hf, source, "Arcee", "relu2", **_sizes(hf, max_positions=4096), qk_norm=False)


def _hunyuan_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """Hunyuan (dense; MoE: every layer's MLP softmax-routed experts, renormalised, beside a shared MLP of their width):
    Llama's layer with per-head q/k norms (query_layernorm / key_layernorm, the loader's names) after rope; its "dynamic" rope with a fixed alpha is NTK-alpha, a static theta of theta * alpha ^ (d / (d - 2)),
    as transformers computes it."""
    _check_silu(hf, source)
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise _unsupported(f"{source}: Hunyuan with biased projections is not supported")
    sizes = _sizes(hf)
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = params.get("rope_type") or params.get("type")
    if rope_type == "dynamic" and params.get("alpha"):
        dim = sizes["head_dim"]
        theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0))) * float(params["alpha"]) ** (dim / (dim - 2))
        scaling = None
    else:
        theta, scaling = _rope_from_hf(hf, source)
    experts = {}
    if hf.get("model_type") == "hunyuan_v1_moe" and hf.get("num_experts", 1) != 1:
        if not isinstance(hf.get("num_experts"), int) or not isinstance(hf.get("moe_topk", 1), int):
            raise _unsupported(f"{source}: Hunyuan with per-layer num_experts / moe_topk lists is not supported")
        experts = dict(num_experts=int(hf["num_experts"]), experts_per_token=int(hf.get("moe_topk", 1)),
                       expert_intermediate_size=sizes["intermediate_size"], norm_topk_prob=True,
                       shared_expert_intermediate_size=sizes["intermediate_size"], shared_expert_gate=False)
    return ModelConfig(
        architecture="llama", **sizes, rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)), rope_theta=theta,
        rope_scaling=scaling, attention_bias=False, qk_norm=True, qk_norm_after_rope=True, **experts)


def _llama4_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """Llama 4's text model (llama4_text; a llama4 checkpoint's text_config): no_rope_layers (1: rotated) names the
    rotated layers, which attend in attention_chunk_size chunks (transformers' chunked_attention layer type) and, with
    use_qk_norm, norm q and k without a weight after rope; the others attend over the whole context, unrotated, their
    queries temperature-tuned (attn_temperature_tuning: attn_scale, floor_scale). Rope turns interleaved pairs
    (reordered on reading), Llama 3's scaling where the config has it. The layers of moe_layers (or every
    interleave_moe_layer_step-th) route each token to its top num_experts_per_tok experts of intermediate_size, each fed
    the row times sigmoid(its logit), beside an ungated shared MLP of that width; the others a dense MLP of
    intermediate_size_mlp."""
    _check_silu(hf, source)
    if hf.get("attention_bias"):
        raise _unsupported(f"{source}: Llama 4 with biased projections is not supported")
    sizes = _sizes({**hf, "intermediate_size": hf.get("intermediate_size_mlp", 16384)})
    layers = sizes["num_layers"]
    rope_on = hf.get("no_rope_layers")
    if not rope_on:  # (transformers' default: every fourth layer unrotated)
        step = int(hf.get("no_rope_layer_interval", 4))
        rope_on = [int((i + 1) % step != 0) for i in range(layers)]
    if len(rope_on) != layers:
        raise CoreError(f"{source}: no_rope_layers must give each of the {layers} layers", ErrorKind.SOURCE_FORMAT)
    nope = tuple(i for i, on in enumerate(rope_on) if not on)
    chunk = int(hf.get("attention_chunk_size", 8192) or 0)
    types = hf.get("layer_types")
    chunked = (tuple(i for i, t in enumerate(types) if t == "chunked_attention") if types and chunk
               else tuple(i for i in range(layers) if i not in nope) if chunk else ())
    theta, scaling = _rope_from_hf(hf, source)
    experts = int(hf.get("num_local_experts") or 0)
    moe = {}
    if experts:
        routed = hf.get("moe_layers")
        if routed is None:
            step = int(hf.get("interleave_moe_layer_step", 1))
            routed = list(range(step - 1, layers, step))
        moe = dict(num_experts=experts, experts_per_token=int(hf.get("num_experts_per_tok", 1)),
                   expert_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=False,
                   shared_expert_intermediate_size=int(hf["intermediate_size"]), shared_expert_gate=False,
                   router_input_scale=True, dense_layers=tuple(i for i in range(layers) if i not in set(routed)))
    temperature = {}
    if hf.get("attn_temperature_tuning", True) and nope:
        temperature = dict(nope_temperature_scale=float(hf.get("attn_scale", 0.1)),
                           nope_temperature_floor=int(hf.get("floor_scale", 8192)))
    return ModelConfig(
        architecture="llama", **sizes, rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)), rope_theta=theta,
        rope_scaling=scaling, attention_bias=False, qk_norm=False, rope_interleaved=True, nope_layers=nope,
        attention_chunk_size=chunk if chunked else 0, chunked_layers=chunked,
        qk_l2_norm=bool(hf.get("use_qk_norm", True)), **temperature, **moe)


def _granite_from_hf(hf: dict[str, Any], model_type: str) -> dict:
    """Granite's multipliers ({} for other families)."""
    if model_type not in ("granite", "granitemoehybrid", "granitemoe", "granitemoeshared", "granitemoe_swa",
                          "granite_swa", "hyperclovax"):
        return {}
    attention = hf.get("attention_multiplier")
    if attention is None:  # (HyperCLOVA X's default: head_dim^-0.5; Granite's 1)
        head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))
        attention = head_dim ** -0.5 if model_type == "hyperclovax" else 1.0
    logits = float(hf.get("logits_scaling") or 1.0)
    return dict(embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
                residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
                # (Granite divides its logits by logits_scaling; HyperCLOVA X multiplies them)
                logits_scaling=1.0 / logits if model_type == "hyperclovax" else logits,
                attention_scale=float(attention))


def _experts_from_hf(hf: dict[str, Any], model_type: str, source: str) -> dict:
    """ModelConfig's expert fields for a mixture-of-experts config ({} for a dense one)."""
    if model_type == "mixtral":  # Mixtral always renormalises the chosen experts' weights
        return dict(num_experts=int(hf["num_local_experts"]), experts_per_token=int(hf["num_experts_per_tok"]),
                    expert_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True)
    if model_type == "minimax_m2":  # every layer's experts sigmoid-routed, their chosen scores renormalised
        return dict(num_experts=int(hf["num_local_experts"]), experts_per_token=int(hf["num_experts_per_tok"]),
                    expert_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True, router_sigmoid=True)
    if model_type == "ernie4_5_moe":  # every moe_layer_interval-th layer from moe_layer_start_index to moe_layer_end_index
        layers = int(hf["num_hidden_layers"])
        start, end = int(hf.get("moe_layer_start_index", 1)), int(hf.get("moe_layer_end_index", -1))
        end = layers - 1 if end < 0 else end
        interval = int(hf.get("moe_layer_interval", 1))
        routed = {i for i in range(layers) if (i + 1) % interval == 0 and start <= i <= end}
        return dict(num_experts=int(hf["moe_num_experts"]), experts_per_token=int(hf["moe_k"]),
                    expert_intermediate_size=int(hf["moe_intermediate_size"]), norm_topk_prob=True,
                    router_correction_bias=True, shared_expert_gate=False,
                    shared_expert_intermediate_size=int(hf["moe_intermediate_size"])
                    * int(hf.get("moe_num_shared_experts") or 0),
                    dense_layers=tuple(i for i in range(layers) if i not in routed))
    if model_type == "olmoe":  # every layer's experts: softmax over all, the top ones (renormalised when it says)
        return dict(num_experts=int(hf.get("num_experts") or hf["num_local_experts"]),
                    experts_per_token=int(hf["num_experts_per_tok"]), expert_intermediate_size=int(hf["intermediate_size"]),
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
    if model_type == "hy_v3":
        layers = int(hf["num_hidden_layers"])
        types = hf.get("mlp_layer_types") or ["dense" if i < int(hf.get("first_k_dense_replace", 1)) else "sparse"
                                              for i in range(layers)]
        if len(types) != layers:
            raise CoreError(f"{source}: mlp_layer_types must name each of the {layers} layers", ErrorKind.SOURCE_FORMAT)
        return dict(num_experts=int(hf["num_experts"]), experts_per_token=int(hf["num_experts_per_tok"]),
                    expert_intermediate_size=int(hf["moe_intermediate_size"]), norm_topk_prob=True,
                    router_sigmoid=True, shared_expert_gate=False,
                    shared_expert_intermediate_size=int(hf["moe_intermediate_size"])
                    * int(hf.get("num_shared_experts") or 0),
                    routed_scaling=float(hf.get("router_scaling_factor", 1.0)),
                    dense_layers=tuple(i for i, t in enumerate(types) if t != "sparse"))
    if model_type not in ("qwen2_moe", "qwen3_moe", "glm4_moe", "dots1", "solar_open", "mellum"):
        return {}
    layers = int(hf["num_hidden_layers"])
    if model_type in ("glm4_moe", "dots1", "solar_open"):
        # the first first_k_dense_replace layers dense (Solar Open: none); DeepSeek-V3's routing
        experts = hf.get("n_routed_experts") or hf["num_local_experts"]
        return dict(num_experts=int(experts), experts_per_token=int(hf.get("num_experts_per_tok", 8)),
                    expert_intermediate_size=int(hf["moe_intermediate_size"]),
                    norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                    shared_expert_intermediate_size=int(hf["moe_intermediate_size"])
                    * int(hf.get("n_shared_experts", 1)),
                    shared_expert_gate=False, router_sigmoid=True, expert_groups=int(hf.get("n_group") or 1),
                    expert_groups_per_token=int(hf.get("topk_group") or 1),
                    routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
                    dense_layers=tuple(range(min(layers, int(hf.get("first_k_dense_replace",
                                                                    0 if model_type == "solar_open" else 1))))))
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = tuple(i for i in range(layers) if i in (hf.get("mlp_only_layers") or []) or (i + 1) % step)
    if hf.get("mlp_layer_types"):  # (Mellum: "dense" or "sparse" a layer)
        dense = tuple(i for i, t in enumerate(hf["mlp_layer_types"]) if t != "sparse")
    shared = int(hf.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
    experts = hf.get("num_experts") or hf["num_local_experts"]  # (transformers 5 saves Qwen3-MoE's under this name)
    return dict(num_experts=int(experts), experts_per_token=int(hf["num_experts_per_tok"]),
                expert_intermediate_size=int(hf["moe_intermediate_size"]),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)), shared_expert_intermediate_size=shared,
                dense_layers=dense)


def _qwen3_next_from_hf(hf: dict[str, Any], source: str, model_type: str) -> ModelConfig:
    """Qwen3-Next and Qwen3.5 (text; dense or MoE): layer_types (or every full_attention_interval-th layer) attention,
    the rest Gated DeltaNet; the attention layers' queries with an output gate, per-head q/k norms, a quarter of each
    head rotated; Qwen2-MoE's routed experts and gated shared expert (Qwen3.5-MoE always renormalises the chosen)."""
    _check_silu(hf, source)
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if types is None:
        interval = int(hf.get("full_attention_interval") or 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"linear_attention", "full_attention"}:
        raise CoreError(f"{source}: layer_types must name each of the {layers} layers linear_attention or "
                        "full_attention", ErrorKind.SOURCE_FORMAT)
    sizes = _sizes(hf, head_dim=256, max_positions=32768)
    if not hf.get("rotary_dim") and "partial_rotary_factor" not in hf and \
            "partial_rotary_factor" not in (hf.get("rope_parameters") or {}):
        hf = {**hf, "partial_rotary_factor": 0.25}  # (transformers' default for the family)
    theta, scaling = _rope_from_hf(hf, source)
    experts = {}
    if hf.get("num_experts"):
        step = int(hf.get("decoder_sparse_step") or 1)
        experts = dict(num_experts=int(hf["num_experts"]), experts_per_token=int(hf["num_experts_per_tok"]),
                       expert_intermediate_size=int(hf["moe_intermediate_size"]),
                       norm_topk_prob=model_type == "qwen3_5_moe_text" or bool(hf.get("norm_topk_prob", True)),
                       shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
                       dense_layers=tuple(i for i in range(layers)
                                          if i in (hf.get("mlp_only_layers") or []) or (i + 1) % step))
    return ModelConfig(
        architecture="qwen3_next", **sizes, rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        rope_scaling=scaling, attention_bias=bool(hf.get("attention_bias", False)),
        attention_out_bias=bool(hf.get("attention_bias", False)), qk_norm=True,
        rotary_dim=rotary_dim_from_hf(hf, sizes["head_dim"]), attn_output_gate=True,
        linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        linear_key_heads=int(hf.get("linear_num_key_heads", 16)),
        linear_value_heads=int(hf.get("linear_num_value_heads", 32)),
        linear_key_dim=int(hf.get("linear_key_head_dim", 128)),
        linear_value_dim=int(hf.get("linear_value_head_dim", 128)),
        linear_conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)), linear_kind="gated_delta", **experts)


def lfm2_feed_forward_size(hf: dict[str, Any]) -> int:
    """LFM2's MLP width as transformers (and llama.cpp's converter) size it: block_ff_dim (or intermediate_size), taken
    to two thirds, times block_ffn_dim_multiplier, rounded up to block_multiple_of, when block_auto_adjust_ff_dim."""
    size = int(hf.get("block_ff_dim") or hf["intermediate_size"])
    if hf.get("block_auto_adjust_ff_dim", True):
        size = int(2 * size / 3)
        if hf.get("block_ffn_dim_multiplier") is not None:
            size = int(float(hf["block_ffn_dim_multiplier"]) * size)
        multiple = int(hf.get("block_multiple_of", 256))
        size = multiple * ((size + multiple - 1) // multiple)
    return size


def _lfm2_from_hf(hf: dict[str, Any], source: str, model_type: str) -> ModelConfig:
    """Liquid LFM2 and LFM2-MoE: layer_types (or full_attn_idxs) name the attention layers, the rest gated short
    convolutions; per-head q/k RMSNorms; rope theta 1e6 unless said; LFM2's MLP width adjusted (lfm2_feed_forward_size);
    LFM2-MoE's first num_dense_layers dense, the rest sigmoid-routed experts with correction biases (expert_bias)."""
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if types is None:
        attends = hf.get("full_attn_idxs")
        attends = set(range(layers)) if attends is None else set(attends)
        types = ["full_attention" if i in attends else "conv" for i in range(layers)]
    if len(types) != layers or set(types) - {"conv", "full_attention"}:
        raise CoreError(f"{source}: layer_types must name each of the {layers} layers conv or full_attention",
                        ErrorKind.SOURCE_FORMAT)
    if hf.get("conv_bias"):
        raise _unsupported(f"{source}: LFM2 with conv_bias (biases on the short convolution's projections) is not "
                           "supported")
    moe = model_type == "lfm2_moe"
    hf = {**hf, "intermediate_size": int(hf["intermediate_size"]) if moe else lfm2_feed_forward_size(hf),
          "rms_norm_eps": hf.get("norm_eps", 1e-5), "rope_theta": hf.get("rope_theta", 1e6),
          "tie_word_embeddings": hf.get("tie_word_embeddings", hf.get("tie_embedding", True))}
    theta, scaling = _rope_from_hf(hf, source)
    experts = {}
    if moe:
        experts = dict(num_experts=int(hf["num_experts"]), experts_per_token=int(hf["num_experts_per_tok"]),
                       expert_intermediate_size=int(hf["moe_intermediate_size"]),
                       norm_topk_prob=bool(hf.get("norm_topk_prob", True)), router_sigmoid=True,
                       shared_expert_gate=False, routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
                       dense_layers=tuple(range(min(layers, int(hf.get("num_dense_layers", 2))))))
    return ModelConfig(
        architecture="lfm2", **_sizes(hf, max_positions=128000, tied=True), rms_norm_eps=float(hf["rms_norm_eps"]),
        rope_theta=theta, rope_scaling=scaling, attention_bias=False, qk_norm=True,
        linear_layers=tuple(i for i, t in enumerate(types) if t == "conv"), linear_kind="short_conv",
        linear_conv_kernel=int(hf.get("conv_L_cache", 3)), **experts)


def _olmo_hybrid_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """AllenAI OLMo Hybrid: layer_types' linear_attention layers Gated DeltaNet (Qwen3-Next's rule: q, k, v through
    the convolution and SiLU, q and k L2-normed, the output RMS-normed (eps 1e-5, FLA's) times SiLU of its gate) with
    pre-norms and, with linear_allow_neg_eigval, beta = 2 sigmoid(b); its full_attention layers OLMo 3's (q/k norms over
    the whole projections, no norm before attention or the MLP, one after each), rotated unless rope_theta is null."""
    _check_silu(hf, source)
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise _unsupported(f"{source}: OLMo Hybrid with biased projections is not supported")
    sizes = _sizes(hf)
    layers = sizes["num_layers"]
    types = hf.get("layer_types") or ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"linear_attention", "full_attention"}:
        raise CoreError(f"{source}: layer_types must name each of the {layers} layers linear_attention or "
                        "full_attention", ErrorKind.SOURCE_FORMAT)
    attends = tuple(i for i, t in enumerate(types) if t == "full_attention")
    params = hf.get("rope_parameters") or {"rope_theta": 10000.0}
    rotated = params.get("rope_theta") is not None
    theta, scaling = _rope_from_hf(hf, source) if rotated else (10000.0, None)
    heads = int(hf["num_attention_heads"])
    nk = int(hf.get("linear_num_key_heads") or heads)
    dk = int(hf.get("linear_key_head_dim") or int(0.75 * sizes["hidden_size"] / nk))
    return ModelConfig(
        architecture="llama", **sizes, rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        rope_scaling=scaling, attention_bias=False, qk_norm=True, qk_norm_whole=True,
        nope_layers=() if rotated else attends, post_norm_layers=attends,
        linear_layers=tuple(i for i in range(layers) if i not in attends), linear_kind="gated_delta",
        linear_key_heads=nk, linear_value_heads=int(hf.get("linear_num_value_heads") or heads), linear_key_dim=dk,
        linear_value_dim=int(hf.get("linear_value_head_dim") or 2 * dk),
        linear_conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)), linear_norm_eps=1e-5,
        linear_neg_eigval=bool(hf.get("linear_allow_neg_eigval", True)))


_LFM3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
              "full_attention": {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.5}}


def _lfm3_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """Liquid LFM3: layer_types' conv layers LFM2's gated short convolutions (conv_L_cache inputs), its
    sliding_attention layers windowed at their own plain rope (local_rope_theta), its full_attention ones global at
    proportional rope (a partial_rotary_factor of the pairs turning, the frequencies over the whole head); per-head
    q/k norms before rope; with use_attention_gate each head's output times sigmoid(g_proj x) (one per head: its row
    repeated over the head's dims, an elementwise gate); with use_sandwich_norm norms after the mixer and the MLP too."""
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types") or ["full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i
                                      else "conv" for i in range(layers)]
    if len(types) != layers or set(types) - {"conv", "sliding_attention", "full_attention"}:
        raise CoreError(f"{source}: layer_types must name each of the {layers} layers conv, sliding_attention or "
                        "full_attention", ErrorKind.SOURCE_FORMAT)
    if hf.get("conv_bias") or hf.get("attention_bias"):
        raise _unsupported(f"{source}: LFM3 with biased projections is not supported")
    params = {**_LFM3_ROPE, **(hf.get("rope_parameters") or {})}
    sliding, full = params["sliding_attention"], params["full_attention"]
    if sliding.get("rope_type", "default") != "default" or full.get("rope_type", "default") not in ("default",
                                                                                                    "proportional"):
        raise _unsupported(f"{source}: LFM3 rope types {sliding.get('rope_type')!r} / {full.get('rope_type')!r} are "
                           "not supported (default on the windowed layers, proportional or default on the global)")
    factor = float(full.get("partial_rotary_factor", 1.0))
    scaling = {"rope_type": "proportional", "partial_rotary_factor": factor} if factor != 1.0 else None
    window = int(hf.get("sliding_window") or 0)
    windows = tuple(window if t == "sliding_attention" else 0 for t in types) if window else None
    return ModelConfig(
        architecture="lfm2", **_sizes({**hf, "head_dim": hf.get("head_dim", 128)}, max_positions=128000, tied=True),
        rms_norm_eps=float(hf.get("norm_eps", 1e-5)), rope_theta=float(full.get("rope_theta", 1e6)),
        rope_scaling=scaling, attention_bias=False, qk_norm=True,
        linear_layers=tuple(i for i, t in enumerate(types) if t == "conv"), linear_kind="short_conv",
        linear_conv_kernel=int(hf.get("conv_L_cache", 7)), layer_windows=windows,
        local_rope_theta=float(sliding.get("rope_theta", 10000.0)) if windows and any(windows) else None,
        attn_output_gate=bool(hf.get("use_attention_gate", True)),
        sandwich_norm=bool(hf.get("use_sandwich_norm", True)))


def _deepseek_from_hf(hf: dict[str, Any], source: str, model_type: str) -> ModelConfig:
    """DeepSeek V2 and V3 (and their kin: Moonlight, Kimi K2, GLM-4.7-Flash): multi-head latent attention (its rotated
    part turning interleaved pairs, reordered on reading; YaRN's mscale_all_dim folded into the query scale, as
    transformers folds it) and routed experts beside a shared one after the first_k_dense_replace dense layers: V2's
    softmax scores (the chosen ones times routed_scaling_factor, never renormalised, as transformers computes them),
    V3's grouped sigmoid routing. V2's group-limited routing (DeepSeek-V2 236B) is refused by name. V3.2 and GLM-5:
    V3's layer with sparse attention's indexer (_sparse_attention). Youtu-LLM: V3's
    attention with a dense MLP on every layer (no experts) and tied embeddings by default. MiniCPM3: V2's attention
    with rope turning halves (not pairs), dense MLPs, values hidden / heads wide unless it says, embeddings times
    scale_emb, each residual branch times scale_depth / sqrt(layers), logits divided by hidden / dim_model_base."""
    _check_silu(hf, source)
    if hf.get("attention_bias"):
        raise _unsupported(f"{source}: attention_bias on latent attention is not supported")
    minicpm = model_type == "minicpm3"
    heads = int(hf["num_attention_heads"])
    nope, rope = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
    v_dim = int(hf.get("v_head_dim") or (int(hf["hidden_size"]) // heads if minicpm else hf["v_head_dim"]))
    sizes = {**_sizes({**hf, "head_dim": nope + rope}, tied=model_type in ("youtu", "minicpm3")),
             "num_kv_heads": heads}
    v3 = model_type not in ("deepseek_v2", "minicpm3")
    if not v3 and hf.get("topk_method", "greedy") != "greedy":
        raise _unsupported(f"{source}: DeepSeek-V2's topk_method {hf.get('topk_method')!r} is not supported (greedy)")
    theta, scaling = _rope_from_hf(hf, source)
    scale = None
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if scaling is not None and scaling["rope_type"] == "yarn" and params.get("mscale_all_dim"):
        mscale = 0.1 * float(params["mscale_all_dim"]) * math.log(scaling["factor"]) + 1.0 \
            if scaling["factor"] > 1 else 1.0
        scale = (nope + rope) ** -0.5 * mscale * mscale
    experts = int(hf.get("n_routed_experts") or 0)
    moe = {}
    if experts:
        layers = sizes["num_layers"]
        moe = dict(num_experts=experts, experts_per_token=int(hf["num_experts_per_tok"]),
                   expert_intermediate_size=int(hf["moe_intermediate_size"]),
                   shared_expert_intermediate_size=int(hf["moe_intermediate_size"]) * int(hf.get("n_shared_experts")
                                                                                         or 0),
                   shared_expert_gate=False, routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
                   dense_layers=tuple(i for i, t in enumerate(hf["mlp_layer_types"]) if t != "sparse")
                   if hf.get("mlp_layer_types") else tuple(range(min(layers, int(hf.get("first_k_dense_replace") or 0)))),
                   norm_topk_prob=bool(hf.get("norm_topk_prob", True)) if v3 else False)
        if v3:
            moe.update(router_sigmoid=True, expert_groups=int(hf.get("n_group") or 1),
                       expert_groups_per_token=int(hf.get("topk_group") or 1))
    return ModelConfig(
        architecture="deepseek2", **sizes, rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        rope_scaling=scaling, attention_bias=False, qk_norm=False, attention_scale=scale, rotary_dim=rope,
        rope_interleaved=False if minicpm else bool(hf.get("rope_interleave", True)) if v3 else True,
        kv_lora_rank=int(hf["kv_lora_rank"]), q_lora_rank=int(hf.get("q_lora_rank") or 0), v_head_dim=v_dim, **moe,
        **(_minicpm_scales(hf, sizes) if minicpm else {}),
        **(_sparse_attention(hf, model_type, sizes["num_layers"]) if model_type in ("deepseek_v32", "glm_moe_dsa")
           else {}))


def _sparse_attention(hf: dict[str, Any], model_type: str, layers: int) -> dict:
    """DeepSeek V3.2's and GLM-5's indexer sizes (their defaults where the config leaves them out); GLM-5's layers
    that reuse an earlier layer's choice (indexer_types "shared", or transformers' pattern, frequency and offset)."""
    glm = model_type == "glm_moe_dsa"
    kinds = hf.get("indexer_types")
    if kinds is None and glm:
        pattern = hf.get("index_topk_pattern")
        if pattern is not None:
            kinds = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        else:
            freq, offset = max(int(hf.get("index_topk_freq", 1)), 1), int(hf.get("index_skip_topk_offset", 2))
            kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    if kinds is not None and (len(kinds) != layers or set(kinds) - {"full", "shared"} or kinds[0] != "full"):
        raise CoreError(f"indexer_types {kinds!r}: one of full or shared a layer, the first full", ErrorKind.SOURCE_FORMAT)
    return dict(index_topk=int(hf.get("index_topk", 2048)), index_heads=int(hf.get("index_n_heads", 32 if glm else 64)),
                index_head_dim=int(hf.get("index_head_dim", 128)), index_rope_interleaved=glm,
                index_shared_layers=tuple(i for i, kind in enumerate(kinds or ()) if kind == "shared"))


def _minicpm_scales(hf: dict[str, Any], sizes: dict) -> dict:
    """MiniCPM's muP scales as Granite's multipliers: embeddings times scale_emb, each residual branch times
    scale_depth / sqrt(layers), logits divided by hidden / dim_model_base (transformers divides the final hidden
    state; the logits are the same but for rounding)."""
    layers = sizes["num_layers"]
    depth = hf.get("scale_depth")
    base = hf.get("dim_model_base") or sizes["hidden_size"]
    return dict(embedding_multiplier=float(hf.get("scale_emb", 1.0)),
                residual_multiplier=float(depth) / math.sqrt(layers) if depth is not None else 1.0,
                logits_scaling=sizes["hidden_size"] / float(base))


def _cohere_from_hf(hf: dict[str, Any], source: str, model_type: str) -> ModelConfig:
    """Cohere (Command R, Aya Expanse) and Cohere2 (Command R7B, Command A): one LayerNorm a layer, attention and the
    MLP in parallel, rope turning interleaved pairs (reordered on reading: rope_interleaved), logits times logit_scale;
    Cohere2's windowed layers (three in four) rotated and its global ones not. Per-head q/k LayerNorms are refused.
    Cohere2-MoE: Cohere2's layer with RMSNorms where rms_norm_eps says; its sparse layers (mlp_layer_types) route to
    experts by the top logits softmaxed among themselves, beside num_shared_experts shared ones (a SwiGLU
    num_shared_experts times as wide), their sum or average (shared_expert_combination_strategy: the average as the
    routed weights and the shared output each halved); its dense layers' MLP prefix_dense_intermediate_size wide and,
    with prefix_dense_sliding_window_pattern 1, global and rotated. Sigmoid routing is refused by name."""
    _check_silu(hf, source)
    if hf.get("use_qk_norm"):
        raise _unsupported(f"{source}: Cohere's q/k LayerNorms (use_qk_norm) are not supported")
    moe = model_type == "cohere2_moe"
    experts = {}
    if moe:
        if hf.get("expert_selection_fn", "softmax") != "softmax":
            raise _unsupported(f"{source}: Cohere2-MoE with expert_selection_fn {hf['expert_selection_fn']!r} is not "
                               "supported (softmax)")
        width = int(hf["intermediate_size"])
        shared = int(hf.get("num_shared_experts") or 0)
        average = shared and hf.get("shared_expert_combination_strategy", "average") == "average"
        types = hf.get("mlp_layer_types") or ["sparse"] * int(hf["num_hidden_layers"])
        experts = dict(num_experts=int(hf["num_experts"]), experts_per_token=int(hf["num_experts_per_tok"]),
                       expert_intermediate_size=width, router_topk_softmax=True, norm_topk_prob=False,
                       shared_expert_intermediate_size=width * shared, shared_expert_gate=False,
                       routed_scaling=0.5 if average else None,
                       dense_layers=tuple(i for i, t in enumerate(types) if t == "dense"))
        hf = {**hf, "intermediate_size": hf.get("prefix_dense_intermediate_size") or width}
    sizes = _sizes(hf, max_positions=8192, tied=True)
    _partial_rotary(hf, sizes["head_dim"], source, False)
    windows = None
    if model_type in ("cohere2", "cohere2_moe"):
        pattern = int(hf.get("sliding_window_pattern") or 4)
        windows = _layer_windows(hf, sizes["num_layers"], source, int(hf.get("sliding_window") or 4096),
                                 lambda i: (i + 1) % pattern)
    forced = experts.get("dense_layers", ()) if int(hf.get("prefix_dense_sliding_window_pattern", 1)) == 1 else ()
    theta, scaling = _rope_from_hf(hf, source)
    bias = bool(hf.get("attention_bias", False))
    rms = moe and hf.get("rms_norm_eps") is not None
    return ModelConfig(
        architecture="llama", **sizes, rms_norm_eps=float(hf["rms_norm_eps"] if rms else hf.get("layer_norm_eps", 1e-5)),
        rope_theta=theta, rope_scaling=scaling, attention_bias=bias, qk_norm=False, attention_out_bias=bias,
        layer_windows=windows, nope_layers=tuple(i for i, w in enumerate(windows or ()) if not w and i not in forced),
        rope_interleaved=True, layer_norm=not rms, parallel_block=True,
        logits_scaling=1.0 / float(hf.get("logit_scale", 0.0625)), **experts)


def _exaone_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """EXAONE 4.0: Llama's projections with a norm after attention and after the MLP and none before, per-head q/k
    norms; with a sliding window, the windowed layers (layer_types, or sliding_window_pattern: every n-th global, or a
    string of L and G repeated) turn by rope and the global ones not at all. K-EXAONE (exaone_moe): that attention
    with Llama's pre-norms, its sparse layers (mlp_layer_types, else after first_k_dense_replace) DeepSeek-V3-routed
    experts (GLM-4.5's router, its groups) beside ungated shared ones."""
    _check_silu(hf, source)
    sizes = _sizes(hf)
    _partial_rotary(hf, sizes["head_dim"], source, False)
    window = hf.get("sliding_window", 4096)  # (transformers' default; null: every layer global and rotated)
    windows = None
    if window:
        pattern = hf.get("sliding_window_pattern") or 4
        sliding = (lambda i: pattern[i % len(pattern)] == "L") if isinstance(pattern, str) else \
            (lambda i: (i + 1) % int(pattern))
        windows = _layer_windows(hf, sizes["num_layers"], source, int(window), sliding)
    theta, scaling = _rope_from_hf(hf, source)
    moe = {}
    if hf.get("model_type") == "exaone_moe":
        layers = sizes["num_layers"]
        types = hf.get("mlp_layer_types") or ["dense" if i < int(hf.get("first_k_dense_replace", 1)) else "sparse"
                                              for i in range(layers)]
        if len(types) != layers:
            raise CoreError(f"{source}: mlp_layer_types must name each of the {layers} layers", ErrorKind.SOURCE_FORMAT)
        moe = dict(num_experts=int(hf["num_experts"]), experts_per_token=int(hf["num_experts_per_tok"]),
                   expert_intermediate_size=int(hf["moe_intermediate_size"]),
                   norm_topk_prob=bool(hf.get("norm_topk_prob", True)), router_sigmoid=True,
                   shared_expert_intermediate_size=int(hf["moe_intermediate_size"]) * int(hf.get("num_shared_experts")
                                                                                         or 0),
                   shared_expert_gate=False, expert_groups=int(hf.get("n_group") or 1),
                   expert_groups_per_token=int(hf.get("topk_group") or 1),
                   routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
                   dense_layers=tuple(i for i, t in enumerate(types) if t != "sparse"))
    return ModelConfig(
        architecture="llama", **sizes, rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)), rope_theta=theta,
        rope_scaling=scaling, attention_bias=False, qk_norm=True, sandwich_norm=not moe, pre_norm=bool(moe),
        layer_windows=windows, nope_layers=tuple(i for i, w in enumerate(windows or ()) if not w), **moe)


# transformers' GptOssConfig defaults where a config.json leaves them out
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}


def _gpt_oss_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """gpt-oss: Llama's layer (biased projections) with attention sinks, every other layer windowed (layer_types), YaRN,
    and routed experts with biases, a top-k-then-softmax router and a clamped SwiGLU."""
    sizes = _sizes(hf, max_positions=131072)
    _partial_rotary(hf, sizes["head_dim"], source, False)
    windows = _layer_windows(hf, sizes["num_layers"], source, int(hf.get("sliding_window") or 128),
                             lambda i: (i + 1) % 2)
    if not isinstance(hf.get("rope_parameters") or hf.get("rope_scaling"), dict):
        hf = {**hf, "rope_parameters": {**_GPT_OSS_ROPE, "rope_theta": float(hf.get("rope_theta", 150000.0))}}
    theta, scaling = _rope_from_hf(hf, source)
    bias = bool(hf.get("attention_bias", True))
    return ModelConfig(
        architecture="gpt_oss", **sizes, rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)), rope_theta=theta,
        rope_scaling=scaling, attention_bias=bias, qk_norm=False, attention_out_bias=bias, layer_windows=windows,
        num_experts=int(hf.get("num_local_experts") or hf["num_experts"]),
        experts_per_token=int(hf.get("num_experts_per_tok", 4)), expert_intermediate_size=sizes["intermediate_size"],
        attention_sinks=True, expert_bias=True, router_topk_softmax=True,
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)), swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)))


def _olmo_from_hf(hf: dict[str, Any], source: str, model_type: str) -> ModelConfig:
    """OLMo 2 and OLMo 3: Llama's projections; a norm after attention and after the MLP (none before); q and k
    normed over all heads; OLMo 3's windowed layers (layer_types) turn by their own plain rope. FlexOlmo: OLMo 2's
    layer with OLMoE's experts in place of the MLP."""
    _check_silu(hf, source)
    sizes = _sizes(hf, max_positions=4096)
    _partial_rotary(hf, sizes["head_dim"], source, False)
    windows = None
    if model_type == "olmo3":
        windows = _layer_windows(hf, sizes["num_layers"], source, int(hf.get("sliding_window") or 4096),
                                 lambda i: (i + 1) % 4)
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):  # per layer type
        theta, scaling = _rope_from_hf({"rope_parameters": dict(params["full_attention"])}, source)
        sliding = params.get("sliding_attention") or {}
        if sliding.get("rope_type", "default") != "default":
            raise _unsupported(f"{source}: scaled rope on the windowed layers is not supported")
        local_theta = float(sliding.get("rope_theta", theta))
    else:
        theta, scaling = _rope_from_hf(hf, source)
        local_theta = theta
    bias = bool(hf.get("attention_bias", False))
    experts = _experts_from_hf(hf, "olmoe", source) if model_type == "flex_olmo" else {}
    return ModelConfig(
        architecture="olmo2", **sizes, rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        rope_scaling=scaling, attention_bias=bias, qk_norm=True, attention_out_bias=bias, sandwich_norm=True,
        pre_norm=False, qk_norm_whole=True, layer_windows=windows, local_rope_theta=local_theta if windows else None,
        **experts)


def _gemma4_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """Gemma 4's text model (gemma4_text; a gemma4 checkpoint's text_config): Gemma 3's layer (tanh-GELU MLP, four
    norms, q/k norms, scaled embeddings) with its norms' weights as they are (not 1 + w), queries unscaled (the q norm
    scales them), values RMS-normed, a scalar a layer, final logits soft-capped; windowed layers (layer_types) of
    head_dim at their own rope theta, global layers of global_head_dim and num_global_key_value_heads (or the
    per_layer_config transformers writes) with keys as values (attention_k_eq_v) and proportional rope; 26B-A4B's
    experts beside the dense MLP (enable_moe_block: parallel_experts); E2B's and E4B's per-layer inputs
    (hidden_size_per_layer_input), shared KV layers (num_kv_shared_layers) and double-wide MLPs."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise _unsupported(f"{source}: hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)")
    # (26B-A4B's and 31B's "vision": an image's tokens attend to each other both ways on the windowed layers, which
    # the image tower's config carries (VisionConfig.image_blocks); text alone is causal. "all" is an encoder's.)
    if hf.get("use_bidirectional_attention") not in (None, "vision"):
        raise _unsupported(f"{source}: use_bidirectional_attention {hf['use_bidirectional_attention']!r} is not "
                           "supported (only \"vision\": images both ways)")
    if hf.get("attention_bias"):
        raise _unsupported(f"{source}: attention biases (attention_bias) are not supported yet")
    sizes = _sizes(hf, head_dim=256, max_positions=131072, tied=True)
    layers = sizes["num_layers"]
    windows = _layer_windows(hf, layers, source, int(hf.get("sliding_window") or 512), lambda i: (i + 1) % 6)
    overrides = {int(k): v for k, v in (hf.get("per_layer_config") or {}).items()}
    glob = [i for i, w in enumerate(windows) if not w]
    head_dims = {int(overrides.get(i, {}).get("head_dim") or hf.get("global_head_dim") or sizes["head_dim"])
                 for i in glob}
    kv_heads = {int(overrides.get(i, {}).get("num_key_value_heads") or hf.get("num_global_key_value_heads")
                    or sizes["num_kv_heads"]) for i in glob}
    if len(head_dims) > 1 or len(kv_heads) > 1 or any(int(i) in set(range(layers)) - set(glob) for i in overrides):
        raise _unsupported(f"{source}: Gemma 4 layers of other geometries than the global layers' one are not "
                           "supported")
    params = hf.get("rope_parameters") or {}
    full, sliding = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    rope_type = full.get("rope_type", "default")
    if rope_type not in ("default", "proportional") or sliding.get("rope_type", "default") != "default":
        raise _unsupported(f"{source}: Gemma 4 rope types {rope_type!r} / {sliding.get('rope_type')!r} are not "
                           "supported (proportional or default on the global layers, default on the windowed)")
    scaling = None
    if rope_type == "proportional" and float(full.get("partial_rotary_factor", 1.0)) != 1.0:
        scaling = {"rope_type": "proportional", "partial_rotary_factor": float(full["partial_rotary_factor"])}
    global_dim = head_dims.pop() if head_dims else 0
    cap = hf.get("final_logit_softcapping")
    experts = {}
    if hf.get("enable_moe_block"):
        experts = dict(num_experts=int(hf["num_experts"]), experts_per_token=int(hf["top_k_experts"]),
                       expert_intermediate_size=int(hf["moe_intermediate_size"]), norm_topk_prob=True,
                       parallel_experts=True)
    return ModelConfig(
        architecture="gemma4", **sizes, rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(full.get("rope_theta", 1e6)), rope_scaling=scaling, attention_bias=False, qk_norm=True,
        embed_scale=True, hidden_act="gelu_pytorch_tanh", sandwich_norm=True, attention_scale=1.0,
        layer_windows=windows, local_rope_theta=float(sliding.get("rope_theta", 10000.0)),
        final_logit_softcapping=float(cap) if cap else None,
        global_head_dim=0 if global_dim == sizes["head_dim"] else global_dim,
        global_kv_heads=kv_heads.pop() if kv_heads else 0, value_from_key=bool(hf.get("attention_k_eq_v")) and bool(glob),
        v_norm=True, layer_scalars=True, **experts,
        per_layer_input_dim=int(hf.get("hidden_size_per_layer_input") or 0),
        per_layer_vocab=int(hf.get("vocab_size_per_layer_input") or 0) if hf.get("hidden_size_per_layer_input") else 0,
        kv_shared_layers=int(hf.get("num_kv_shared_layers") or 0),
        double_wide_mlp=bool(hf.get("use_double_wide_mlp")) and bool(hf.get("num_kv_shared_layers")))


def _gemma_from_hf(hf: dict[str, Any], source: str, model_type: str) -> ModelConfig:
    """Gemma 3's text model (gemma3_text; a gemma3 checkpoint's text_config) or Gemma 2 (gemma2: no q/k norms, one
    rope for every layer, every other layer windowed, soft-capped attention scores and logits); Gemma 1 (gemma) as
    Gemma 2 without windows, caps or norms after attention and the MLP (its legacy hidden_act "gelu" the tanh one,
    as transformers reads it); VaultGemma (vaultgemma) as Gemma 2 without its norms after attention and the MLP."""
    if model_type == "gemma":
        config = _gemma_from_hf({**hf, "layer_types": ["full_attention"] * int(hf["num_hidden_layers"]),
                                 "hidden_activation": "gelu_pytorch_tanh" if (hf.get("hidden_activation") or hf.get(
                                     "hidden_act", "gelu")) in ("gelu", "gelu_pytorch_tanh") else hf.get("hidden_act"),
                                 "attn_logit_softcapping": None, "final_logit_softcapping": None}, source, "gemma2")
        return dataclasses.replace(config, sandwich_norm=False, layer_windows=None)
    if model_type == "vaultgemma":  # (its windows and caps Gemma 2's; the loader reads its pre-MLP norm as Gemma 1's)
        return dataclasses.replace(_gemma_from_hf(hf, source, "gemma2"), sandwich_norm=False)
    gemma2 = model_type == "gemma2"
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise _unsupported(f"{source}: hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)")
    if not gemma2:
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if hf.get(key) is not None:
                raise _unsupported(f"{source}: {key} is not supported for Gemma 3")
    if hf.get("use_bidirectional_attention"):
        raise _unsupported(f"{source}: use_bidirectional_attention is not supported")
    sizes = _sizes(hf, head_dim=256, max_positions=8192 if gemma2 else 131072, tied=True)
    # older configs without layer_types: every sliding_window_pattern-th layer is global (Gemma 2: every other)
    pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or (2 if gemma2 else 6))
    windows = _layer_windows(hf, sizes["num_layers"], source, int(hf.get("sliding_window") or 4096),
                             lambda i: (i + 1) % pattern)
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):  # transformers 5
        theta, scaling = _rope_from_hf({"rope_parameters": dict(params["full_attention"])}, source)
        local_theta = float(params.get("sliding_attention", {}).get("rope_theta", 10000.0))
    else:
        theta, scaling = _rope_from_hf(hf, source)
        local_theta = None if gemma2 else float(hf.get("rope_local_base_freq", 10000.0))
    _partial_rotary(hf, sizes["head_dim"], source, False)
    bias = bool(hf.get("attention_bias", False))
    caps = {}
    if gemma2:
        caps = {key: float(hf[key]) if hf.get(key) is not None else None
                for key in ("attn_logit_softcapping", "final_logit_softcapping")}
    return ModelConfig(
        architecture="gemma2" if gemma2 else "gemma3", **sizes, rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, rope_scaling=scaling, attention_bias=bias, qk_norm=not gemma2, attention_out_bias=bias,
        embed_scale=True, hidden_act="gelu_pytorch_tanh", sandwich_norm=True,
        attention_scale=float(hf.get("query_pre_attn_scalar") or sizes["head_dim"]) ** -0.5, layer_windows=windows,
        local_rope_theta=local_theta, **caps)
