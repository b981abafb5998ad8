"""Tiny random-weight Hugging Face checkpoints of every family flared runs (float32 safetensors), shared by the model
tests (tests/model/) and the GPU tests (tests/cuda/)."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_COMMON = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
    # Wider init than the default 0.02 so logits are spread out and greedy argmax has no near-ties.
    initializer_range=0.2, tie_word_embeddings=False,
)

_GATED_DELTA = dict(layer_types=["linear_attention", "full_attention"], head_dim=16, initializer_range=0.1, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=8, linear_value_head_dim=16)

_GRANITE_HYBRID = dict(layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2,
                       mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, shared_intermediate_size=96,
                       position_embedding_type="nope", embedding_multiplier=6.0, residual_multiplier=0.4,
                       attention_multiplier=0.09, logits_scaling=3.0, initializer_range=0.1, pad_token_id=0,
                       bos_token_id=1, eos_token_id=2)

_NEMOTRON_H = dict(mamba_num_heads=4, mamba_head_dim=32, n_groups=2, ssm_state_size=16, conv_kernel=4, head_dim=16,
                   layer_norm_epsilon=1e-5, initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2)

_FALCON_H1 = dict(head_dim=16, mamba_d_ssm=128, mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16,
                  mamba_d_conv=4, embedding_multiplier=2.0, lm_head_multiplier=0.5, mlp_multipliers=[0.8, 1.3],
                  key_multiplier=0.7, attention_in_multiplier=1.2, attention_out_multiplier=0.9,
                  ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.5], ssm_in_multiplier=1.3, ssm_out_multiplier=0.6,
                  initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2)

_GEMMA4 = dict(head_dim=16, global_head_dim=32, num_global_key_value_heads=1, sliding_window=8,
               layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0, attention_k_eq_v=True,
               final_logit_softcapping=30.0, pad_token_id=0, bos_token_id=2, eos_token_id=1)

FAMILIES = {
    "llama3": ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                             rope_theta=500000.0)),
    "llama_tied": ("llama", dict(tie_word_embeddings=True)),
    # A head dim that is not a power of two (Phi-2's and Pythia-2.8B's 80, latent attention's 192 in kind): the GPU
    # runs it through the generic graphs with the attention kernels' heads padded
    "llama_head24": ("llama", dict(head_dim=24)),
    "mistral": ("mistral", dict(sliding_window=16, head_dim=16)),
    "qwen2": ("qwen2", dict()),
    "qwen3": ("qwen3", dict(head_dim=32)),
    # YaRN (Qwen's long-context setting): positions past the original 64 are interpolated, cos/sin scaled
    "qwen3_yarn": ("qwen3", dict(head_dim=32, rope_scaling={"rope_type": "yarn", "factor": 8.0, "rope_theta": 10000.0,
                                                            "original_max_position_embeddings": 64})),
    # Gemma 2: every other layer windowed, soft-capped scores and logits (caps low enough to bite on these weights)
    "gemma2": ("gemma2", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                              final_logit_softcapping=8.0)),
    # AllenAI FlexOlmo: OLMo 2's layer (norms after attention and the MLP, q/k normed over all heads) with OLMoE's
    # experts (softmax over all, the top ones not renormalised)
    "flex_olmo": ("flex_olmo", dict(num_experts=8, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1,
                                    eos_token_id=2)),
    # JetBrains Mellum 2: Qwen3-MoE's layer, windowed layers at their own rope theta, a dense first layer
    "mellum": ("mellum", dict(num_hidden_layers=3, head_dim=16, sliding_window=8, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=32, layer_types=["sliding_attention", "full_attention",
                                                                     "sliding_attention"],
                              mlp_layer_types=["dense", "sparse", "sparse"], pad_token_id=0, bos_token_id=1,
                              eos_token_id=2)),
    # VaultGemma: Gemma 2 without the norms after attention and the MLP (windows and caps kept)
    "vaultgemma": ("vaultgemma", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                                      final_logit_softcapping=8.0)),
    # OLMo 2: norms after attention and the MLP only, q/k norms over all heads; OLMo 3 adds three windowed layers
    # in four with their own rope (4 layers: the last is global, with yarn)
    "olmo2": ("olmo2", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "olmo3": ("olmo3", dict(num_hidden_layers=4, sliding_window=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                             "full_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 50000.0,
                                                                "original_max_position_embeddings": 64}})),
    # Mixtures of experts: Mixtral (chosen weights renormalised), Qwen2-MoE (a gated shared expert, raw softmax
    # weights), Qwen3-MoE (q/k norms, renormalised)
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, norm_topk_prob=False)),
    "qwen3_moe": ("qwen3_moe", dict(head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                    norm_topk_prob=True)),
    # SmolLM3: Llama with every fourth layer unrotated (4 layers: the last is)
    "smollm3": ("smollm3", dict(num_hidden_layers=4, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1,
                                eos_token_id=2)),
    # Phi-3 / Phi-4: fused q/k/v and gate/up projections, a sliding window
    "phi3": ("phi3", dict(sliding_window=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Phi-4-mini: Phi-3's layer with half of each head rotated and LongRoPE (here its short factors, the served context
    # fitting the original one, and an attention factor), tied embeddings. Long factors: tests/model/test_phi3.py.
    "phi4_mini": ("phi3", dict(tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                               original_max_position_embeddings=512, rope_parameters={
                                   "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                   "short_factor": [1.0, 1.3, 2.1, 3.7], "long_factor": [1.2, 2.5, 4.0, 9.0],
                                   "attention_factor": 1.1})),
    # gpt-oss: attention sinks, a windowed then a global layer, YaRN (untruncated), four experts with biases, two a
    # token by a top-k-then-softmax router, the clamped SwiGLU (a limit low enough to clamp these weights)
    "gpt_oss": ("gpt_oss", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                                sliding_window=8, swiglu_limit=1.5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "truncate": False,
                                                 "original_max_position_embeddings": 64, "rope_theta": 150000.0})),
    # Seed-OSS: Llama with q/k/v biases and none on o, an explicit head_dim
    "seed_oss": ("seed_oss", dict(head_dim=32, attention_bias=True, attention_out_bias=False, pad_token_id=0,
                                  bos_token_id=1, eos_token_id=2)),
    # GLM-4 (0414): q/k/v biases, four norms a layer, half of each head rotated by interleaved pairs, fused gate_up
    "glm4": ("glm4", dict(head_dim=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # GLM-4.5: half-rotated heads with q/k norms, a dense first layer, then 8 experts in 4 groups (2 groups a token,
    # 3 experts a token by sigmoid scores plus correction biases, scaled by 2.5) beside a shared expert
    "glm4_moe": ("glm4_moe", dict(num_hidden_layers=3, head_dim=32, n_routed_experts=8, num_experts_per_tok=3,
                                  moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2,
                                  routed_scaling_factor=2.5, first_k_dense_replace=1, use_qk_norm=True,
                                  attention_bias=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # DeepSeek V2 (Lite): latent attention without a query bottleneck, YaRN with DeepSeek's mscales, a dense first
    # layer, softmax-routed experts scaled by routed_scaling_factor beside shared ones
    "deepseek_v2": ("deepseek_v2", dict(num_hidden_layers=3, num_key_value_heads=4, qk_nope_head_dim=16,
                                        qk_rope_head_dim=8, v_head_dim=12,
                                        kv_lora_rank=32, q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=32, n_shared_experts=2, first_k_dense_replace=1,
                                        routed_scaling_factor=1.5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                        rope_parameters={"rope_type": "yarn", "factor": 8.0, "rope_theta": 10000.0,
                                                         "original_max_position_embeddings": 64, "mscale": 0.707,
                                                         "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1})),
    # DeepSeek V3 (R1, Moonlight, Kimi K2): a query bottleneck, interleaved rope, grouped sigmoid routing
    "deepseek_v3": ("deepseek_v3", dict(num_hidden_layers=3, num_key_value_heads=4, qk_nope_head_dim=16,
                                        qk_rope_head_dim=8, v_head_dim=12,
                                        kv_lora_rank=32, q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                                        n_group=4, topk_group=2, routed_scaling_factor=2.5, pad_token_id=0,
                                        bos_token_id=1, eos_token_id=2)),
    # DeepSeek V3.2: V3 with sparse attention's indexer (index_topk small, so that the prompts' queries choose; 16
    # index heads, so that no two keys tie at a score of 0, every head's relu 0, where top-k's pick is arbitrary)
    "deepseek_v32": ("deepseek_v32", dict(num_hidden_layers=3, num_key_value_heads=4, qk_nope_head_dim=16,
                                          qk_rope_head_dim=8, v_head_dim=12, kv_lora_rank=32, q_lora_rank=24,
                                          n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                          n_shared_experts=1, mlp_layer_types=["dense", "sparse", "sparse"], n_group=4,
                                          topk_group=2, routed_scaling_factor=2.5, index_topk=6, index_n_heads=16,
                                          index_head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # GLM-5: V3.2's layer, its indexer's rope in pairs; the third layer reuses the second's choice
    "glm_moe_dsa": ("glm_moe_dsa", dict(num_hidden_layers=3, num_key_value_heads=4, qk_nope_head_dim=16,
                                        qk_rope_head_dim=8, v_head_dim=12, kv_lora_rank=32, q_lora_rank=24,
                                        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                                        routed_scaling_factor=2.5, index_topk=6, index_n_heads=16, index_head_dim=16,
                                        indexer_types=["full", "full", "shared"], pad_token_id=0, bos_token_id=1,
                                        eos_token_id=2)),
    # GLM-4.7-Flash: DeepSeek-V3's layer under its own name, the dense MLPs named by mlp_layer_types
    "glm4_moe_lite": ("glm4_moe_lite", dict(num_hidden_layers=3, num_key_value_heads=4, qk_nope_head_dim=16,
                                            qk_rope_head_dim=8, v_head_dim=12, kv_lora_rank=32, q_lora_rank=24,
                                            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                            n_shared_experts=1, mlp_layer_types=["dense", "sparse", "sparse"],
                                            n_group=4, topk_group=2, routed_scaling_factor=2.5, pad_token_id=0,
                                            bos_token_id=1, eos_token_id=2)),
    # Tencent Youtu-LLM: DeepSeek-V3's latent attention (a query bottleneck, interleaved rope) with dense MLPs only
    "youtu": ("youtu", dict(num_key_value_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                            kv_lora_rank=32, q_lora_rank=24, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # OpenBMB MiniCPM3: DeepSeek-V2's latent attention (rope turning halves) with muP scales (embeddings, residual
    # branches, logits)
    "minicpm3": ("minicpm3", dict(num_key_value_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=None,
                                  kv_lora_rank=32, q_lora_rank=24, scale_emb=3.0, scale_depth=1.4, dim_model_base=32,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # rednote dots.llm1: Qwen3's layer (q/k norms) with DeepSeek-V3-routed experts after a dense layer
    "dots1": ("dots1", dict(head_dim=16, num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                            norm_topk_prob=True, routed_scaling_factor=2.5, pad_token_id=0, bos_token_id=1,
                            eos_token_id=2)),
    # MiniMax-M2: q/k normed over all heads, half of each head rotated, sigmoid routing with correction biases
    "minimax_m2": ("minimax_m2", dict(head_dim=16, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.5})),
    # ERNIE 4.5 (0.3B): Llama with rope turning interleaved pairs over the whole head, tied embeddings
    "ernie4_5": ("ernie4_5", dict(head_dim=16, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2)),
    # ERNIE 4.5 MoE (21B-A3B): a dense layer, then experts chosen by softmax score plus a correction bias beside a
    # shared one
    "ernie4_5_moe": ("ernie4_5_moe", dict(head_dim=16, moe_intermediate_size=32, moe_k=2, moe_num_experts=8,
                                          moe_num_shared_experts=1, moe_layer_start_index=1, tie_word_embeddings=True,
                                          pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Qwen3.5 (dense) and Qwen3-Next / Qwen3.5-MoE: three Gated DeltaNet layers to one gated attention layer with a
    # quarter of each head rotated; two value heads a key head; Qwen3-Next's experts with a gated shared expert
    "qwen3_5": ("qwen3_5_text", dict(_GATED_DELTA, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "qwen3_next": ("qwen3_next", dict(_GATED_DELTA, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=48, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2)),
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(_GATED_DELTA, num_experts=8, num_experts_per_tok=2,
                                             moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                             pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Liquid LFM2: a gated short convolution layer then an attention layer with q/k norms (its MLP sized 2/3 of
    # intermediate_size rounded up to 256); LFM2-MoE: a dense layer, then sigmoid-routed experts with biases
    "lfm2": ("lfm2", dict(layer_types=["conv", "full_attention"], norm_eps=1e-5, pad_token_id=0, bos_token_id=1,
                          eos_token_id=2)),
    "lfm2_moe": ("lfm2_moe", dict(layer_types=["conv", "full_attention", "conv"], num_hidden_layers=3,
                                  num_dense_layers=1, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                  norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Granite 3: multipliers on the embeddings, residual branches, attention scores and logits
    "granite": ("granite", dict(embedding_multiplier=6.0, residual_multiplier=0.4, attention_multiplier=0.09,
                                logits_scaling=3.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Granite 4.0 micro: Granite's multipliers, the MLP named shared_mlp, attention layers only with rope
    "granite4": ("granitemoehybrid", dict(layer_types=["attention", "attention"], position_embedding_type="rope",
                                          num_local_experts=0, shared_intermediate_size=96, embedding_multiplier=6.0,
                                          residual_multiplier=0.4, attention_multiplier=0.09, logits_scaling=3.0,
                                          pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Granite 4.0-H: a Mamba-2 layer (4 heads of 32 in 2 groups of a 16-wide state, a biased convolution) then an
    # unrotated attention layer, Granite's multipliers; its MoE variant's experts (top logits softmaxed) and shared MLP
    "granite4_h": ("granitemoehybrid", dict(_GRANITE_HYBRID, num_local_experts=0)),
    "granite4_h_moe": ("granitemoehybrid", dict(_GRANITE_HYBRID, num_local_experts=8, num_experts_per_tok=2,
                                                intermediate_size=32)),
    # NVIDIA Nemotron-H: blocks of one part each, paired into layers: Mamba-2 + squared-ReLU MLP, unrotated attention
    # alone, Mamba-2 + MLP, an MLP alone; its MoE variant's DeepSeek-V3-routed squared-ReLU experts (two groups, one a
    # token) beside an ungated shared expert
    "nemotron_h": ("nemotron_h", dict(_NEMOTRON_H, layers_block_type=["linear_attention", "mlp", "full_attention",
                                                                      "linear_attention", "mlp", "mlp"])),
    "nemotron_h_moe": ("nemotron_h", dict(_NEMOTRON_H, layers_block_type=["linear_attention", "moe", "full_attention",
                                                                          "mlp"],
                                          n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                                          moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
                                          routed_scaling_factor=1.5)),
    # TII Falcon-H1: every layer's attention (rope) and Mamba-2 mixer side by side on one normed input, then SwiGLU;
    # muP multipliers everywhere (folded into the weights on reading); the mixer's output ungated-normed (y * SiLU(z)),
    # or, with mamba_rms_norm, normed in groups after the gate
    "falcon_h1": ("falcon_h1", dict(_FALCON_H1)),
    "falcon_h1_norm": ("falcon_h1", dict(_FALCON_H1, mamba_rms_norm=True, mamba_norm_before_gate=False)),
    # Gemma 4: Gemma 3's layer with a windowed layer (8 keys, heads of 16, its own rope theta) then a global one (one
    # KV head of 32, its keys as values, a quarter of its frequencies turning), value norms, a scalar a layer, soft-
    # capped logits; its variant with values of their own on the global layers
    "gemma4": ("gemma4_text", dict(_GEMMA4)),
    "gemma4_values": ("gemma4_text", dict(_GEMMA4, attention_k_eq_v=False, num_global_key_value_heads=2)),
    # Gemma 4 E2B / E4B: per-layer inputs, the last two layers attending to the keys and values of the last earlier
    # layer of their kind, their MLPs twice as wide
    "gemma4_e2b": ("gemma4_text", dict(_GEMMA4, num_hidden_layers=4, hidden_size_per_layer_input=8,
                                       vocab_size_per_layer_input=512, num_kv_shared_layers=2, use_double_wide_mlp=True,
                                       layer_types=["sliding_attention", "full_attention"] * 2)),
    # Gemma 4 26B-A4B's layer: experts beside the dense MLP, routed from the residual
    "gemma4_moe": ("gemma4_text", dict(_GEMMA4, enable_moe_block=True, num_experts=8, top_k_experts=2,
                                       moe_intermediate_size=32)),
    # IBM Bamba: Granite 4.0-H's Mamba-2 layer (without its multipliers), then an attention layer with half of each
    # head rotated, SwiGLU MLPs
    "bamba": ("bamba", dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2,
                            mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, head_dim=16, initializer_range=0.1,
                            pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # AI21 Jamba: a Mamba-1 layer with a dense MLP, an unrotated attention layer with experts (softmax top-2, weights
    # as they are), a Mamba-1 layer with a dense MLP
    "jamba": ("jamba", dict(num_hidden_layers=3, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                            expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8,
                            mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, initializer_range=0.1, pad_token_id=0,
                            bos_token_id=1, eos_token_id=2)),
    # state-spaces Mamba and Mamba-2 language models: a norm and a mixer a layer, no attention
    "mamba": ("mamba", dict(state_size=8, expand=2, conv_kernel=4, time_step_rank=8, initializer_range=0.1,
                            tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "falcon_mamba": ("falcon_mamba", dict(state_size=8, expand=2, conv_kernel=4, time_step_rank=8, initializer_range=0.1,
                                          mixer_rms_eps=1e-3, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                                          eos_token_id=2)),
    "mamba2": ("mamba2", dict(num_heads=4, head_dim=32, n_groups=2, state_size=16, conv_kernel=4, expand=2,
                              initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Moonshot Kimi Linear: a Kimi Delta Attention layer with a dense MLP, a latent attention layer without rope and a
    # KDA layer, each with DeepSeek-V3-routed experts (two groups) beside a shared one
    "kimi_linear": ("kimi_linear", dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                                        qk_nope_head_dim=16, v_head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                                        n_group=2, topk_group=1, moe_intermediate_size=32, linear_head_dim=16,
                                        linear_num_heads=4, linear_conv_kernel_dim=4, num_hidden_layers=3,
                                        layer_types=["linear_attention", "full_attention", "linear_attention"],
                                        mlp_layer_types=["dense", "sparse", "sparse"], initializer_range=0.1,
                                        pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Swiss AI Apertus: per-head q/k norms before Llama 3's rope, an ungated MLP through xIELU
    "apertus": ("apertus", dict(head_dim=16, rope_parameters={"rope_type": "llama3", "rope_theta": 12000000.0,
                                                              "factor": 8.0, "original_max_position_embeddings": 64,
                                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0},
                                pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Tencent Hunyuan (dense): per-head q/k norms after rope, NTK-alpha rope
    "hunyuan": ("hunyuan_v1_dense", dict(head_dim=16, rope_parameters={"rope_type": "dynamic", "alpha": 1000.0,
                                                                       "rope_theta": 10000.0, "factor": 1.0},
                                         pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "hunyuan_moe": ("hunyuan_v1_moe", dict(head_dim=16, intermediate_size=32, num_experts=8, moe_topk=2,
                                           rope_parameters={"rope_type": "dynamic", "alpha": 1000.0,
                                                            "rope_theta": 10000.0, "factor": 1.0},
                                           pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # IBM Granite 3.x MoE: Granite's multipliers, experts chosen by the top logits softmaxed among themselves (and a
    # shared MLP, granitemoeshared)
    "granitemoe": ("granitemoe", dict(head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                                      embedding_multiplier=3.0, residual_multiplier=0.5, logits_scaling=2.0,
                                      attention_multiplier=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "granitemoeshared": ("granitemoeshared", dict(head_dim=16, intermediate_size=32, num_local_experts=8,
                                                  num_experts_per_tok=2, shared_intermediate_size=48,
                                                  embedding_multiplier=3.0, residual_multiplier=0.5,
                                                  logits_scaling=2.0, attention_multiplier=0.2, pad_token_id=0,
                                                  bos_token_id=1, eos_token_id=2)),
    # Ministral 8B (2410) and Meta CWM: Llama with windows on their layer_types' sliding layers (8 tokens here)
    "ministral": ("ministral", dict(head_dim=16, num_hidden_layers=3, sliding_window=8,
                                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                    pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Ministral 3: Mistral's layer at YaRN, each query scaled by its position past every original_max_position_embeddings
    "ministral3": ("ministral3", dict(head_dim=16, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5})),
    # LG EXAONE 3.x, InternLM3 (its dynamic NTK rope: plain within the original context), IQuest-Coder: Llama's layer
    "exaone": ("exaone", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 64})),
    "internlm3": ("internlm3", dict(head_dim=16, rope_parameters={"rope_type": "dynamic", "factor": 6.0,
                                                                  "rope_theta": 50000000.0})),
    "iquestcoder": ("iquestcoder", dict(head_dim=16)),
    "helium": ("helium", dict(head_dim=16)),
    # OLMo (1): weightless LayerNorms, q/k/v clamped (tightly, so that the clamp bites)
    "olmo": ("olmo", dict(clip_qkv=0.6)),
    # Phi-3.5-MoE: biased LayerNorms, projections and LM head, two experts chosen by sparsemixer (a wide threshold
    # so that its masks bite)
    "phimoe": ("phimoe", dict(num_local_experts=4, attention_bias=True, lm_head_bias=True, router_jitter_noise=0.3)),
    # nanochat: weightless norms (the embeddings' too), q/k normed after rope, ReLU-squared MLP, soft-capped logits
    "nanochat": ("nanochat", dict(num_key_value_heads=4, final_logit_softcapping=15.0)),
    # HyperCLOVA X: Granite's multipliers with norms after attention and the MLP
    "hyperclovax": ("hyperclovax", dict(head_dim=16, embedding_multiplier=2.0, residual_multiplier=0.5,
                                        attention_multiplier=0.3, logits_scaling=1.5)),
    "hyperclovax_default": ("hyperclovax", dict(use_post_norm=False)),
    # Sarvam MoE and Param2 MoE: GLM-4.5's model (rope over the whole head), written under their own tensor names
    "sarvam_moe": ("sarvam_moe", dict(num_hidden_layers=3, head_dim=32, n_routed_experts=8, num_experts_per_tok=3,
                                      moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2,
                                      routed_scaling_factor=2.5, first_k_dense_replace=1, use_qk_norm=True,
                                      attention_bias=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "param2moe": ("param2moe", dict(num_hidden_layers=2, head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=0,
                                    use_qk_norm=True, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                                    eos_token_id=2)),
    "cwm": ("cwm", dict(head_dim=16, num_hidden_layers=4, sliding_window=8, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2)),
    # AllenAI OLMoE: q/k norms over the whole projections, every layer's experts softmax-routed, not renormalised
    "olmoe": ("olmoe", dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2, pad_token_id=0,
                            bos_token_id=1, eos_token_id=2)),
    # Upstage Solar Open: Llama's attention, every layer's experts DeepSeek-V3-routed beside a shared one
    "solar_open": ("solar_open", dict(head_dim=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                                      n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # LG K-EXAONE: EXAONE 4.0's attention (q/k norms, windowed layers rotated, the global one not) before pre-norms,
    # a dense first layer, then DeepSeek-V3-routed experts beside a shared one
    "exaone_moe": ("exaone_moe", dict(head_dim=16, num_hidden_layers=4, sliding_window=8,
                                      layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                      mlp_layer_types=["dense", "sparse", "sparse", "sparse"], num_experts=8,
                                      num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1,
                                      n_group=4, topk_group=2, routed_scaling_factor=2.5, pad_token_id=0,
                                      bos_token_id=1, eos_token_id=2)),
    # Tencent HY v3: Qwen3's layer, a dense first layer, then experts sigmoid-routed with correction biases beside a
    # shared one
    "hy_v3": ("hy_v3", dict(head_dim=16, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
                            moe_intermediate_size=32, router_scaling_factor=2.826, mlp_layer_types=["dense", "sparse"],
                            pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Arcee AFMoE (Trinity): q/k norms, windowed layers rotated and the global one not, a gated attention output, four
    # norms a layer, a dense first layer, then sigmoid-routed experts with correction biases beside shared ones
    "afmoe": ("afmoe", dict(head_dim=16, num_hidden_layers=4, sliding_window=8, global_attn_every_n_layers=4,
                            moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
                            route_scale=2.0, num_dense_layers=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Liquid LFM3: short convolutions, windowed attention at plain rope (8 tokens here), global attention at
    # proportional rope, a sigmoid gate per head, sandwich norms
    "lfm3": ("lfm3", dict(head_dim=16, num_hidden_layers=5, sliding_window=8, conv_L_cache=3,
                          layer_types=["conv", "sliding_attention", "full_attention", "conv", "sliding_attention"],
                          pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # AllenAI OLMo Hybrid: Gated DeltaNet layers (beta up to 2) beside OLMo 3's post-norm attention, rotated here
    "olmo_hybrid": ("olmo_hybrid", dict(num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                                        linear_key_head_dim=16, linear_value_head_dim=16, pad_token_id=0,
                                        bos_token_id=1, eos_token_id=2)),
    # BigCode StarCoder2: biased LayerNorms and projections, an ungated tanh-GELU MLP, one window on every layer
    "starcoder2": ("starcoder2", dict(sliding_window=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # NVIDIA Nemotron-4 / Minitron: LayerNorm1P (1 + w, biased), half of each head rotated, an ungated squared-ReLU
    # MLP
    "nemotron": ("nemotron", dict(head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Google Gemma (1, CodeGemma): (1 + w) norms, scaled embeddings, tanh-GELU, multi-query attention (2B's)
    "gemma": ("gemma", dict(head_dim=16, num_key_value_heads=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Stability StableLM 2: biased LayerNorms, a quarter of each head rotated, q/k/v biases
    "stablelm": ("stablelm", dict(use_qkv_bias=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # StableLM 2 12B: a LayerNorm of its own on each q and k head, attention and the MLP side by side
    "stablelm_12b": ("stablelm", dict(qk_layernorm=True, use_parallel_residual=True, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2)),
    # IBM Granite MoE with sliding windows: learned sinks, windows on three layers in four (8 tokens here), the
    # global one unrotated, a shared MLP
    "granitemoe_swa": ("granitemoe_swa", dict(head_dim=16, num_hidden_layers=4, intermediate_size=32,
                                              num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=48,
                                              sliding_window=8, layer_rope_theta=[0, 10000.0, 10000.0, 10000.0],
                                              embedding_multiplier=3.0, residual_multiplier=0.5, logits_scaling=2.0,
                                              attention_multiplier=0.2, pad_token_id=0, bos_token_id=1,
                                              eos_token_id=2)),
    # ... and GraniteSWA: the same attention with Granite's dense MLP
    "granite_swa": ("granite_swa", dict(head_dim=16, num_hidden_layers=4, sliding_window=8,
                                        layer_rope_theta=[0, 10000.0, 10000.0, 10000.0], embedding_multiplier=3.0,
                                        residual_multiplier=0.5, logits_scaling=2.0, attention_multiplier=0.2,
                                        pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Cohere2-MoE: Cohere2's layer (its LayerNorms: no rms_norm_eps), a dense first layer (global, rotated),
    # softmax-routed experts averaged with a shared one; and its RMSNorm form summing them
    "cohere2_moe": ("cohere2_moe", dict(num_hidden_layers=4, sliding_window=8, num_experts=8, num_experts_per_tok=2,
                                        num_shared_experts=1, prefix_dense_intermediate_size=96, rms_norm_eps=None,
                                        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                                        layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                                     "full_attention"], pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "cohere2_moe_rms": ("cohere2_moe", dict(num_hidden_layers=4, sliding_window=8, num_experts=8, num_experts_per_tok=2,
                                            num_shared_experts=2, shared_expert_combination_strategy="sum",
                                            rms_norm_eps=1e-6, prefix_dense_intermediate_size=96,
                                            prefix_dense_sliding_window_pattern=2,
                                            mlp_layer_types=["dense", "dense", "sparse", "sparse"],
                                            layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                         "full_attention"], pad_token_id=0, bos_token_id=1,
                                            eos_token_id=2)),
    # Microsoft Phi-2: a parallel block from one biased LayerNorm, part of each head rotated, biases everywhere (the LM
    # head's too), an ungated tanh-GELU MLP
    "phi": ("phi", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.4})),
    # GLM-4 9B (glm, 2024): q/k/v biases, half of each head rotated by interleaved pairs, a fused gate_up
    "glm": ("glm", dict(head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # EleutherAI GPT-NeoX (Pythia): attention and an exact-GELU MLP side by side from their own biased LayerNorms, a
    # quarter of each head rotated, query_key_value per head
    "gpt_neox": ("gpt_neox", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # OpenAI GPT-2: learned positions, Conv1D weights, q/k/v in one c_attn; GPT-BigCode: one KV head (multi_query), and
    # without it each head's q, k, v in turn
    "gpt2": ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, n_inner=None, vocab_size=512,
                          initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)),
    "gpt_bigcode": ("gpt_bigcode", dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, n_inner=128,
                                        vocab_size=512, initializer_range=0.2, bos_token_id=1, eos_token_id=2)),
    "gpt_bigcode_mha": ("gpt_bigcode", dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, n_inner=128,
                                            vocab_size=512, initializer_range=0.2, multi_query=False, bos_token_id=1,
                                            eos_token_id=2)),
    # EleutherAI GPT-J: Phi-2's parallel block without attention biases, a part of each head turned by interleaved pairs
    "gptj": ("gptj", dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, rotary_dim=8, vocab_size=512,
                          initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)),
    # TII Falcon: 7B's layout (one KV head, one LayerNorm, attention and MLP side by side), 40B's (grouped KV heads, a
    # LayerNorm each), and the sequential one with biases and a KV head a query head
    "falcon": ("falcon", dict(multi_query=True, parallel_attn=True, bos_token_id=1, eos_token_id=2)),
    "falcon_new": ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2, bos_token_id=1, eos_token_id=2)),
    "falcon_seq": ("falcon", dict(multi_query=False, parallel_attn=False, bias=True, bos_token_id=1, eos_token_id=2)),
    # Falcon-RW: the sequential layout with ALiBi (6 heads: slopes past the power of two, rounded to bfloat16)
    "falcon_rw": ("falcon", dict(hidden_size=96, num_attention_heads=6, alibi=True, multi_query=False,
                                 parallel_attn=False, bias=True, bos_token_id=1, eos_token_id=2)),
    # BigScience BLOOM: ALiBi, a LayerNorm of the embeddings, each head's q, k, v in turn; 6 heads (not a power of two:
    # the extra slopes)
    # (TINY_COMMON's names win over a config's own through its attribute_map: the sizes under those names)
    "bloom": ("bloom", dict(hidden_size=96, num_attention_heads=6, bos_token_id=1, eos_token_id=2)),
    # MosaicML MPT: ALiBi with its own slopes (6 heads: its reordering), weight-only LayerNorms, clamped q/k/v
    # (transformers' MPT is always 4 * d_model wide, whatever expansion_ratio says)
    "mpt": ("mpt", dict(hidden_size=96, num_attention_heads=6, attn_config={"clip_qkv": 0.6, "alibi_bias_max": 8},
                        bos_token_id=1, eos_token_id=2)),
    # EleutherAI GPT-Neo: learned positions, unscaled scores, its local layers windowed (8 tokens here)
    "gpt_neo": ("gpt_neo", dict(hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                                window_size=8, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)),
    # Meta OPT: learned positions offset by 2, biased LayerNorms and projections, an ungated ReLU MLP
    "opt": ("opt", dict(ffn_dim=128, word_embed_proj_dim=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Inception Jais 2: biased LayerNorms and projections, an ungated squared-ReLU MLP
    "jais2": ("jais2", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Arcee AFM-4.5B: Llama with an ungated ReLU-squared MLP, YaRN
    "arcee": ("arcee", dict(head_dim=16, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                          "original_max_position_embeddings": 64},
                            pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Llama 4 (Scout, Maverick): rotated layers attending in chunks (8 tokens here, so the prompts cross them) with
    # weightless q/k norms, every fourth layer unrotated over the whole context with temperature-tuned queries (from
    # position 3 here); every other layer's experts fed their rows times sigmoid(logit), beside a shared MLP
    "llama4": ("llama4_text", dict(head_dim=16, num_hidden_layers=4, intermediate_size=32, intermediate_size_mlp=64,
                                   num_local_experts=4, num_experts_per_tok=2, interleave_moe_layer_step=2,
                                   attention_chunk_size=8, floor_scale=4, attn_scale=0.5,
                                   rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # EXAONE 4.0: norms after attention and the MLP only, per-head q/k norms, three windowed layers in four with rope,
    # the fourth global and unrotated
    "exaone4": ("exaone4", dict(num_hidden_layers=4, head_dim=16, sliding_window=8, sliding_window_pattern=4,
                                pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Cohere (Command R, Aya): LayerNorm, attention and MLP in parallel, interleaved rope, scaled logits; Cohere2
    # (Command R7B / A): three windowed layers in four rotated, the fourth global and unrotated
    "cohere": ("cohere", dict(logit_scale=0.3, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "cohere2": ("cohere2", dict(num_hidden_layers=4, sliding_window=8, logit_scale=0.25, pad_token_id=0,
                                bos_token_id=1, eos_token_id=2)),
    # transformers' GGUF loader does not read head_dim for qwen3 and falls back to Qwen3Config's 128.
    "qwen3_wide": ("qwen3", dict(head_dim=128)),
    # Gemma 3: a windowed layer (8 keys, local rope) then a global one, its own query scale, linear rope scaling on
    # the global layers
    "gemma3": ("gemma3_text", dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                   query_pre_attn_scalar=24, rope_parameters={
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                       "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                          "rope_theta": 1000000.0}})),
}


def build_hf_checkpoint(family: str, directory: Path, *, seed: int = 0) -> Path:
    """Save a random-weight float32 model of ``family`` as safetensors under ``directory``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = FAMILIES[family]
    config = AutoConfig.for_model(model_type, **{**TINY_COMMON, **extra})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    with torch.no_grad():  # norms start as ones (or zeros, Gemma's 1 + w), biases as zeros: vary them, so each counts
        for name, param in model.named_parameters():
            if ("norm" in name and param.dim() == 1) or ("bias" in name and not param.any()) or \
                    name.endswith(("router.scale", "per_expert_scale", "alpha_p", "alpha_n")):  # (Gemma 4's router
                # scales start as ones; Apertus' xIELU parameters as initialised)
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)) * 0.2)
        for name, buffer in model.named_buffers():  # (GLM-4.5's and LFM2-MoE's router correction biases are buffers)
            if name.endswith(("correction_bias", "expert_bias")):
                buffer.add_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(seed)) * 0.2)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def last_logits(model, prompt: list[int]) -> torch.Tensor:
    """A DecoderModel's logits for the last token of ``prompt`` (at least 10 tokens), run as two chunks over
    scattered pages (the second sees the first through the cache)."""
    from flared.model.batch import ForwardBatch, SequenceChunk

    count = -(-len(prompt) // 4)
    kv = model.make_kv_cache(num_pages=count + 6, page_tokens=4, state_rows=1)
    pages = torch.randperm(count + 6, generator=torch.Generator().manual_seed(0))[:count].tolist()
    window = model.config.sliding_window
    model.forward(ForwardBatch.build([SequenceChunk(prompt[:9], 0, pages, needs_logits=False, state_row=0)],
                                     page_tokens=4, sliding_window=window), kv)
    return model.forward(ForwardBatch.build([SequenceChunk(prompt[9:], 9, pages, state_row=0)], page_tokens=4,
                                            sliding_window=window), kv)[0]


def hf_last_logits(directory, prompt: list[int]) -> torch.Tensor:
    """transformers' logits for the last token of ``prompt`` on the checkpoint in ``directory`` (float32)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, -1]


def retype_gguf(src, dst, type_of) -> None:
    """Write GGUF ``src`` again as ``dst`` with each tensor in ``type_of(name, its type)``'s ggml type (its values
    dequantised and quantised again where that changes; the same keys): a file of another mix of types, as
    llama.cpp's quantize makes them. ``type_of`` may give the types gguf's quantize writes (F16, BF16, Q4_0-Q8_0) or
    a function of its own, ``(values [rows, cols] float32) -> raw blocks``, with the type: ``(type, encode)``."""
    import gguf
    import numpy as np
    from gguf import GGUFValueType as V

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # (the header's own, which the writer writes)
        kind = field.types[0]
        writer.add_key_value(key, field.contents(), kind, sub_type=field.types[-1] if kind == V.ARRAY else None)
    for t in reader.tensors:
        new = type_of(t.name, t.tensor_type)
        new, encode = new if isinstance(new, tuple) else (new, None)
        if new == t.tensor_type:
            writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
            continue
        values = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        writer.add_tensor(t.name, encode(values) if encode else gguf.quants.quantize(values, new), raw_dtype=new)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def q4_k_blocks(values):
    """``values`` [rows, cols] (cols a multiple of 256) as Q4_K blocks [rows, cols / 256 * 144], in retype_gguf's
    (type, encode) form, set as llama.cpp's quantiser sets them: each 32-value sub-block's step and offset (at most
    0) chosen among 21 grids of 14 to 16 steps over its range, each refitted by least squares with the values
    weighted by their size (the nearest kept), then both as 6-bit multiples of the super-block's two float16 scales
    and the values placed on the rounded grid. Such blocks often span 14 of their steps, not 15."""
    import numpy as np

    rows, cols = values.shape
    x = np.asarray(values, dtype=np.float32).reshape(-1, 32)
    weight = np.sqrt((x * x).mean(1, keepdims=True)) + np.abs(x)
    low, high = np.minimum(x.min(1), 0.0), x.max(1)
    span = np.where(high > low, high - low, 1.0)
    sw, swx = weight.sum(1), (weight * x).sum(1)

    def distance(step, offset, q):
        return (weight * (step[:, None] * q + offset[:, None] - x) ** 2).sum(1)

    q = np.clip(np.rint((x - low[:, None]) * (15.0 / span)[:, None]), 0, 15)
    step, offset = span / 15.0, low
    best = distance(step, offset, q)
    for k in range(21):  # grids of 14 to 16 steps over the range
        lk = np.clip(np.rint((x - low[:, None]) * ((14.0 + 0.1 * k) / span)[:, None]), 0, 15)
        sl, sll, sxl = (weight * lk).sum(1), (weight * lk * lk).sum(1), (weight * lk * x).sum(1)
        det = sw * sll - sl * sl
        ok = det > 0
        det = np.where(ok, det, 1.0)
        fit_step, fit_offset = (sw * sxl - swx * sl) / det, (sll * swx - sl * sxl) / det
        positive = fit_offset > 0  # (the offset stays at most 0: the step alone, fitted through 0)
        fit_step = np.where(positive, sxl / np.where(sll > 0, sll, 1.0), fit_step)
        fit_offset = np.where(positive, 0.0, fit_offset)
        d = distance(fit_step, fit_offset, lk)
        take = ok & (d < best)
        best, step, offset = np.where(take, d, best), np.where(take, fit_step, step), np.where(take, fit_offset, offset)
    step = np.where(high > low, step, 0.0).reshape(-1, 8)
    least = (-offset).reshape(-1, 8)
    n = step.shape[0]
    d, dmin = (step.max(-1) / 63.0).astype(np.float16), (least.max(-1) / 63.0).astype(np.float16)

    def sixbits(v, unit):
        unit = unit.astype(np.float32)[:, None]
        return np.where(unit > 0, np.rint(v / np.where(unit > 0, unit, 1.0)), 0).clip(0, 63).astype(np.uint8)

    sc, mn = sixbits(step, d), sixbits(least, dmin)
    dj = (d.astype(np.float32)[:, None] * sc)[..., None]
    mj = (dmin.astype(np.float32)[:, None] * mn)[..., None]
    xs = x.reshape(n, 8, 32)
    q = np.where(dj > 0, np.rint((xs + mj) / np.where(dj > 0, dj, 1.0)), 0).clip(0, 15).astype(np.uint8)
    scales = np.empty((n, 12), np.uint8)
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(n, 128)
    out = np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), scales, qs], axis=1)
    return out.reshape(rows, cols // 256 * 144)


def q6_k_blocks(values):
    """``values`` [rows, cols] (cols a multiple of 256) as Q6_K blocks [rows, cols / 256 * 210]: each 16-value
    sub-block's step an 8-bit multiple of the super-block's float16 scale, its values 6 bits (-32..31). llama.cpp's
    layout; a plainer quantiser than its own (no search for the steps)."""
    import numpy as np

    rows, cols = values.shape
    x = np.asarray(values, dtype=np.float32).reshape(-1, 16, 16)
    n = x.shape[0]
    step = np.abs(x).max(-1) / 31.0
    d = (step.max(-1) / 127.0).astype(np.float16)
    unit = d.astype(np.float32)[:, None]
    sc = np.where(unit > 0, np.rint(step / np.where(unit > 0, unit, 1.0)), 0).clip(0, 127).astype(np.int8)
    dj = (unit * sc)[..., None]
    q = (np.where(dj > 0, np.rint(x / np.where(dj > 0, dj, 1.0)), 0).clip(-32, 31) + 32).astype(np.uint8)
    q = q.reshape(n, 2, 4, 32)  # (value e: half e // 128, quarter (e % 128) // 32, lane e % 32)
    ql = (q[:, :, 0:2] & 0x0F) | ((q[:, :, 2:4] & 0x0F) << 4)  # [n, half, 2, 32]: byte half * 64 + e % 64
    qh = sum(((q[:, :, k] >> 4) & 3) << (2 * k) for k in range(4)).astype(np.uint8)  # [n, half, 32]
    out = np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d.view(np.uint8).reshape(n, 2)],
                         axis=1)
    return out.reshape(rows, cols // 256 * 210)
