"""GGUF files of each architecture, written here from random tiny checkpoints with
gguf's writer (F32 norms, Q8_0 / F16 matrices, llama.cpp's q/k row permutation
for llama), read by our loader and by transformers' GGUF loader: same config
and logits within 1e-4 through our paged forward."""

from __future__ import annotations

import dataclasses
import json
import math

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from flared.model.batch import ForwardBatch, SequenceChunk
from flared.model.decoder import DecoderModel
from flared.model.loader import read_source

from .conftest import build_hf_checkpoint

def f32_tensors(w):
    """add(name, array): the array as a float32 tensor of GGUF writer ``w`` (the F32 files the tests write)."""
    return lambda name, array: w.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))


def close_gguf(w) -> None:
    """Write the header, keys and tensors ``w`` holds, and close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


CASES = {
    # family in conftest.FAMILIES -> (GGUF architecture, matrix quantisation)
    "llama_tied": ("llama", Q.F32),  # lossless, so also compared with the original checkpoint
    "qwen2": ("qwen2", Q.F16),
    "qwen3_wide": ("qwen3", Q.Q8_0),
}


def permute_for_llama_cpp(rows: np.ndarray, num_heads: int) -> np.ndarray:
    # What llama.cpp's converter does to attn_q/attn_k rows (rotate-half -> interleaved pairs).
    return rows.reshape(num_heads, 2, rows.shape[0] // num_heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_gguf(hf_dir, path, arch: str, matrix_type, extra=None) -> None:
    """``matrix_type``: the matrices' ggml type, or a function of the tensor's GGUF name giving each its own;
    ``extra(w)``, where given, adds keys and tensors of its own before the file is written."""
    import json

    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    t = load_file(hf_dir / "model.safetensors")
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    theta = (rope.get("full_attention") or rope).get("rope_theta", 10000.0)  # (Gemma 3's per layer type)
    gemma = arch in ("gemma2", "gemma3")
    gated_delta = arch in ("qwen3next", "qwen35", "qwen35moe")  # (their converter also stores norms as 1 + w)
    w = gguf.GGUFWriter(str(path), arch)
    if gated_delta:
        write_gated_delta_keys(w, arch, cfg)
    w.add_uint32(f"{arch}.context_length", cfg["max_position_embeddings"])
    w.add_uint32(f"{arch}.embedding_length", cfg["hidden_size"])
    w.add_uint32(f"{arch}.block_count", cfg["num_hidden_layers"])
    w.add_uint32(f"{arch}.feed_forward_length", cfg["intermediate_size"])
    if arch in ("granite", "granitemoe"):  # llama.cpp's names for Granite's multipliers
        for ours, theirs in (("embedding_scale", "embedding_multiplier"), ("residual_scale", "residual_multiplier"),
                             ("logit_scale", "logits_scaling"), ("attention.scale", "attention_multiplier")):
            w.add_float32(f"{arch}.{ours}", cfg[theirs])
    if arch == "gemma2":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            w.add_float32(f"{arch}.{key}", cfg[key])
    if arch in ("gpt-oss", "arcee", "mistral3"):  # their converter's yarn keys
        w.add_string(f"{arch}.rope.scaling.type", "yarn")
        w.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", rope["original_max_position_embeddings"])
    if arch == "mistral3":  # Ministral 3's: the betas, mscale_all_dim as the log multiplier, its query temperature
        w.add_float32(f"{arch}.rope.scaling.yarn_beta_fast", rope["beta_fast"])
        w.add_float32(f"{arch}.rope.scaling.yarn_beta_slow", rope["beta_slow"])
        w.add_float32(f"{arch}.rope.scaling.yarn_log_multiplier", rope["mscale_all_dim"])
        w.add_float32(f"{arch}.attention.temperature_scale", rope["llama_4_scaling_beta"])
    if arch in ("phi3", "gemma2", "gemma3", "gpt-oss") and cfg.get("sliding_window"):
        w.add_uint32(f"{arch}.attention.sliding_window", cfg["sliding_window"])
    experts = (cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
               or cfg.get("moe_num_experts") or 0)
    if arch == "granitemoe" and cfg.get("shared_intermediate_size"):  # (Granite's shared MLP beside the experts)
        w.add_uint32(f"{arch}.expert_shared_feed_forward_length", cfg["shared_intermediate_size"])
    if arch == "hunyuan-moe":  # (its converter writes the shared MLP's width; ERNIE's derives it, our reader ignores it)
        w.add_uint32(f"{arch}.expert_shared_feed_forward_length", cfg["intermediate_size"])
    if arch == "ernie4_5-moe":
        w.add_uint32(f"{arch}.expert_shared_count", cfg["moe_num_shared_experts"])
        w.add_uint32(f"{arch}.leading_dense_block_count", cfg["moe_layer_start_index"])
        w.add_uint32(f"{arch}.interleave_moe_layer_step", cfg["moe_layer_interval"])
    if arch.startswith("hunyuan"):  # NTK-alpha folded into the base, as its converter does
        theta = theta * rope["alpha"] ** (head_dim / (head_dim - 2))
    if arch == "dots1":  # its converter's DeepSeek-V3 keys (no groups: the released model has one)
        w.add_uint32(f"{arch}.expert_gating_func", 2)
        w.add_float32(f"{arch}.expert_weights_scale", cfg["routed_scaling_factor"])
        w.add_bool(f"{arch}.expert_weights_norm", cfg["norm_topk_prob"])
        w.add_uint32(f"{arch}.expert_shared_count", cfg["n_shared_experts"])
        w.add_uint32(f"{arch}.leading_dense_block_count", cfg["first_k_dense_replace"])
    if arch == "glm4moe":  # DeepSeek-V3's routing, as its converter writes it
        w.add_uint32(f"{arch}.expert_gating_func", 2)
        w.add_float32(f"{arch}.expert_weights_scale", cfg["routed_scaling_factor"])
        w.add_bool(f"{arch}.expert_weights_norm", cfg["norm_topk_prob"])
        w.add_uint32(f"{arch}.expert_shared_count", cfg["n_shared_experts"])
        w.add_uint32(f"{arch}.leading_dense_block_count", cfg["first_k_dense_replace"])
        w.add_uint32(f"{arch}.expert_group_count", cfg["n_group"])
        w.add_uint32(f"{arch}.expert_group_used_count", cfg["topk_group"])
    if experts:  # llama.cpp's mixture-of-experts keys
        w.add_uint32(f"{arch}.expert_count", experts)
        w.add_uint32(f"{arch}.expert_used_count", cfg.get("num_experts_per_tok") or cfg.get("moe_k")
                     or cfg["moe_topk"])
        if cfg.get("moe_intermediate_size") or arch in ("gpt-oss", "hunyuan-moe"):
            w.add_uint32(f"{arch}.expert_feed_forward_length",
                         cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_uint32(f"{arch}.expert_shared_feed_forward_length", cfg["shared_expert_intermediate_size"])
    w.add_uint32(f"{arch}.attention.head_count", heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", kv_heads)
    w.add_uint32(f"{arch}.attention.key_length", head_dim)
    w.add_uint32(f"{arch}.attention.value_length", head_dim)
    rotated = int(head_dim * (rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0))
    w.add_uint32(f"{arch}.rope.dimension_count", rotated)
    w.add_float32(f"{arch}.rope.freq_base", theta)
    if arch == "starcoder2":  # (its LayerNorms' epsilon)
        w.add_float32(f"{arch}.attention.layer_norm_epsilon", cfg["norm_epsilon"])
    elif arch in ("command-r", "cohere2"):  # Cohere's LayerNorm epsilon, logit scale and window
        w.add_float32(f"{arch}.attention.layer_norm_epsilon", cfg["layer_norm_eps"])
        w.add_float32(f"{arch}.logit_scale", cfg["logit_scale"])
        if cfg.get("sliding_window"):
            w.add_uint32(f"{arch}.attention.sliding_window", cfg["sliding_window"])
    else:
        w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_uint32(f"{arch}.vocab_size", cfg["vocab_size"])

    def add(name: str, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array, dtype=np.float32)
        # (routers and biases stay F32, as llama.cpp keeps them)
        if array.ndim >= 2 and not name.endswith(("_inp.weight", ".bias")):
            qtype = matrix_type(name) if callable(matrix_type) else matrix_type  # (a type for each matrix: a mix)
            w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, array)

    for name, values in rope_factor_tensors(cfg, w, arch, theta, rotated).items():
        w.add_tensor(name, values)
    add("token_embd.weight", t["model.embed_tokens.weight"])
    # llama.cpp's converter stores Gemma's and Qwen3-Next's (1 + w) norms as 1 + w
    norm = (lambda name: t[name] + 1) if gemma or gated_delta else (lambda name: t[name])
    add("output_norm.weight", norm("model.norm.weight"))
    if "model.norm.bias" in t:
        add("output_norm.bias", t["model.norm.bias"])
    if "lm_head.weight" in t and not cfg.get("tie_word_embeddings"):
        add("output.weight", t["lm_head.weight"])
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if p + "linear_attn.conv1d.weight" in t:
            write_gated_delta(add, t, p + "linear_attn.", i, cfg, tiled=arch != "qwen3next")
        if p + "self_attn.qkv_proj.weight" in t:  # Phi-3's fused projections, as llama.cpp keeps them
            add(f"blk.{i}.attn_qkv.weight", t[p + "self_attn.qkv_proj.weight"])
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")):
            for kind in ("weight", "bias"):
                name = f"{p}self_attn.{theirs}.{kind}"
                if name not in t:
                    continue
                values = t[name]
                if arch in ("llama", "smollm3", "granite", "arcee", "granitemoe", "mistral3", "internlm2") and \
                        ours != "attn_v":
                    values = permute_for_llama_cpp(values, heads if ours == "attn_q" else kv_heads)
                add(f"blk.{i}.{ours}.{kind}", values)
        if p + "self_attn.o_proj.weight" in t:
            add(f"blk.{i}.attn_output.weight", t[p + "self_attn.o_proj.weight"])
        if p + "self_attn.o_proj.bias" in t:
            add(f"blk.{i}.attn_output.bias", t[p + "self_attn.o_proj.bias"])
        if p + "self_attn.sinks" in t:
            add(f"blk.{i}.attn_sinks.weight", t[p + "self_attn.sinks"])
        # the layer's norms: Llama's two before; Gemma's four (the pre-MLP one under its own name); OLMo 2's two after
        if arch != "olmo2":
            add(f"blk.{i}.attn_norm.weight", norm(p + "input_layernorm.weight"))
        if arch == "starcoder2":  # (its LayerNorms' biases)
            add(f"blk.{i}.attn_norm.bias", t[p + "input_layernorm.bias"])
            add(f"blk.{i}.ffn_norm.bias", t[p + "post_attention_layernorm.bias"])
        if gemma or arch == "olmo2":
            add(f"blk.{i}.post_attention_norm.weight", norm(p + "post_attention_layernorm.weight"))
            add(f"blk.{i}.post_ffw_norm.weight", norm(p + "post_feedforward_layernorm.weight"))
        if gemma:
            add(f"blk.{i}.ffn_norm.weight", norm(p + "pre_feedforward_layernorm.weight"))
        elif arch != "olmo2" and p + "post_attention_layernorm.weight" in t:  # (not Cohere's: one norm a layer)
            # (gpt-oss' and GLM-4.5's converters name the norm before the MLP post_attention_norm)
            add(f"blk.{i}.{'post_attention' if arch in ('gpt-oss', 'glm4moe') or gated_delta else 'ffn'}_norm.weight",
                norm(p + "post_attention_layernorm.weight"))
        if arch == "glm4":  # its norms after attention and the MLP
            add(f"blk.{i}.post_attention_norm.weight", t[p + "post_self_attn_layernorm.weight"])
            add(f"blk.{i}.post_ffw_norm.weight", t[p + "post_mlp_layernorm.weight"])
        routers = ("mlp.gate.weight", "mlp.router.weight", "block_sparse_moe.gate.weight", "mlp.gate.wg.weight",
                   "block_sparse_moe.router.layer.weight")
        if experts and any(p + name in t for name in routers):  # (GLM-4.5's dense first layers have none)
            write_experts(add, t, p, i, experts)
        elif p + "mlp.c_fc.weight" in t:  # StarCoder2's ungated MLP, biased
            for ours, theirs in (("ffn_up", "c_fc"), ("ffn_down", "c_proj")):
                add(f"blk.{i}.{ours}.weight", t[f"{p}mlp.{theirs}.weight"])
                add(f"blk.{i}.{ours}.bias", t[f"{p}mlp.{theirs}.bias"])
        elif p + "mlp.gate_up_proj.weight" in t or p + "mlp.gate_proj.weight" not in t:  # (Phi-3's; Arcee's ungated)
            add(f"blk.{i}.ffn_up.weight", t[p + ("mlp.gate_up_proj.weight" if p + "mlp.gate_up_proj.weight" in t
                                                 else "mlp.up_proj.weight")])
            add(f"blk.{i}.ffn_down.weight", t[p + "mlp.down_proj.weight"])
        else:
            add(f"blk.{i}.ffn_gate.weight", t[p + "mlp.gate_proj.weight"])
            add(f"blk.{i}.ffn_up.weight", t[p + "mlp.up_proj.weight"])
            add(f"blk.{i}.ffn_down.weight", t[p + "mlp.down_proj.weight"])
        if p + "self_attn.q_norm.weight" in t:
            add(f"blk.{i}.attn_q_norm.weight", norm(p + "self_attn.q_norm.weight"))
            add(f"blk.{i}.attn_k_norm.weight", norm(p + "self_attn.k_norm.weight"))
        if p + "self_attn.query_layernorm.weight" in t:  # (Hunyuan's)
            add(f"blk.{i}.attn_q_norm.weight", t[p + "self_attn.query_layernorm.weight"])
            add(f"blk.{i}.attn_k_norm.weight", t[p + "self_attn.key_layernorm.weight"])
    if extra is not None:
        extra(w)
    close_gguf(w)


def write_gated_delta_keys(w, arch: str, cfg: dict) -> None:
    """Qwen3-Next's and Qwen3.5's keys as llama.cpp's converter writes them: the key heads as the ssm group count, the
    value heads as its time step rank, the key head size as its state size; the attention layers' interval (the
    converter reads full_attention_interval; the tiny checkpoints give layer_types, each interval-th attention)."""
    types = cfg["layer_types"]
    interval = types.index("full_attention") + 1
    assert all((t == "full_attention") == ((i + 1) % interval == 0) for i, t in enumerate(types))
    w.add_uint32(f"{arch}.ssm.conv_kernel", cfg["linear_conv_kernel_dim"])
    w.add_uint32(f"{arch}.ssm.state_size", cfg["linear_key_head_dim"])
    w.add_uint32(f"{arch}.ssm.group_count", cfg["linear_num_key_heads"])
    w.add_uint32(f"{arch}.ssm.time_step_rank", cfg["linear_num_value_heads"])
    w.add_uint32(f"{arch}.ssm.inner_size", cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    w.add_uint32(f"{arch}.full_attention_interval", interval)


def write_gated_delta(add, t: dict, la: str, i: int, cfg: dict, *, tiled: bool) -> None:
    """A Gated DeltaNet layer as llama.cpp's converter writes it: Qwen3-Next's in_proj_qkvz regrouped into attn_qkv (all
    heads' q, then k, then v) and attn_gate (z), in_proj_ba as ssm_ba; Qwen3.5's in_proj_qkv / _z / _b / _a as attn_qkv,
    attn_gate, ssm_beta, ssm_alpha with every value-head axis reordered from grouped to tiled (head j of key head g to
    j * key_heads + g); conv1d squeezed; ssm_a = -exp(A_log); dt_bias as ssm_dt.bias; the gated norm as is."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    per_key = nv // nk

    def tile(a: np.ndarray, axis: int, width: int) -> np.ndarray:
        if not tiled:
            return a
        shape = a.shape
        a = a.reshape(*shape[:axis], nk, per_key, width, *shape[axis + 1:])
        return np.swapaxes(a, axis, axis + 1).reshape(shape)

    keys = 2 * nk * dk
    conv = t[la + "conv1d.weight"].squeeze(1)
    if la + "in_proj_qkvz.weight" in t:
        grouped = t[la + "in_proj_qkvz.weight"].reshape(nk, 2 * dk + 2 * per_key * dv, -1)
        q, k, v, z = np.split(grouped, np.cumsum([dk, dk, per_key * dv]), axis=1)
        qkv = np.concatenate([x.reshape(-1, x.shape[-1]) for x in (q, k, v)])
        add(f"blk.{i}.attn_gate.weight", z.reshape(-1, z.shape[-1]))
        add(f"blk.{i}.ssm_ba.weight", t[la + "in_proj_ba.weight"])
    else:
        qkv = t[la + "in_proj_qkv.weight"]
        qkv = np.concatenate([qkv[:keys], tile(qkv[keys:], 0, dv)])
        conv = np.concatenate([conv[:keys], tile(conv[keys:], 0, dv)])
        add(f"blk.{i}.attn_gate.weight", tile(t[la + "in_proj_z.weight"], 0, dv))
        add(f"blk.{i}.ssm_beta.weight", tile(t[la + "in_proj_b.weight"], 0, 1))
        add(f"blk.{i}.ssm_alpha.weight", tile(t[la + "in_proj_a.weight"], 0, 1))
    add(f"blk.{i}.attn_qkv.weight", qkv)
    add(f"blk.{i}.ssm_conv1d.weight", conv)
    add(f"blk.{i}.ssm_a", -np.exp(tile(t[la + "A_log"], 0, 1)))
    add(f"blk.{i}.ssm_dt.bias", tile(t[la + "dt_bias"], 0, 1))
    add(f"blk.{i}.ssm_norm.weight", t[la + "norm.weight"])
    add(f"blk.{i}.ssm_out.weight", tile(t[la + "out_proj.weight"], 1, dv))


def write_lfm2_gguf(hf_dir, path, arch: str) -> None:
    """An LFM2 / LFM2-MoE checkpoint as llama.cpp's converter writes it (F32): head_count_kv a list with 0 for each
    short convolution layer, shortconv.l_cache, the MLP's adjusted width, embedding_norm as token_embd_norm, the
    convolution squeezed to [hidden, kernel]; LFM2-MoE's sigmoid gating, leading dense layers, stacked experts and
    expert_bias as exp_probs_b."""
    import json

    from safetensors.numpy import load_file

    from flared.model.config import lfm2_feed_forward_size

    cfg = json.loads((hf_dir / "config.json").read_text())
    t = load_file(hf_dir / "model.safetensors")
    heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("context_length", cfg["max_position_embeddings"]), ("embedding_length", cfg["hidden_size"]),
                       ("block_count", layers), ("attention.head_count", heads), ("vocab_size", cfg["vocab_size"]),
                       ("shortconv.l_cache", cfg["conv_L_cache"])):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_array(f"{arch}.attention.head_count_kv",
                [cfg["num_key_value_heads"] if kind != "conv" else 0 for kind in cfg["layer_types"]])
    w.add_uint32(f"{arch}.feed_forward_length",
                 cfg["intermediate_size"] if arch == "lfm2moe" else lfm2_feed_forward_size(cfg))
    w.add_float32(f"{arch}.rope.freq_base", cfg["rope_parameters"]["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["norm_eps"])
    if arch == "lfm2moe":
        w.add_uint32(f"{arch}.expert_count", cfg["num_experts"])
        w.add_uint32(f"{arch}.expert_used_count", cfg["num_experts_per_tok"])
        w.add_uint32(f"{arch}.expert_feed_forward_length", cfg["moe_intermediate_size"])
        w.add_uint32(f"{arch}.leading_dense_block_count", cfg["num_dense_layers"])
        w.add_uint32(f"{arch}.expert_gating_func", 2)
    for name, value in (("token_embd.weight", t["model.embed_tokens.weight"]),
                        ("token_embd_norm.weight", t["model.embedding_norm.weight"]),
                        ("output.weight", t.get("lm_head.weight"))):
        if value is not None and not (name == "output.weight" and cfg.get("tie_word_embeddings")):
            w.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
    for i in range(layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        names = {"attn_norm.weight": "operator_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
                 "shortconv.in_proj.weight": "conv.in_proj.weight", "shortconv.out_proj.weight": "conv.out_proj.weight",
                 "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
                 "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.out_proj.weight",
                 "attn_q_norm.weight": "self_attn.q_layernorm.weight",
                 "attn_k_norm.weight": "self_attn.k_layernorm.weight", "ffn_gate.weight": "feed_forward.w1.weight",
                 "ffn_up.weight": "feed_forward.w3.weight", "ffn_down.weight": "feed_forward.w2.weight",
                 "ffn_gate_inp.weight": "feed_forward.gate.weight", "exp_probs_b.bias": "feed_forward.expert_bias"}
        for ours, theirs in names.items():
            if p + theirs in t:
                w.add_tensor(b + ours, np.ascontiguousarray(t[p + theirs], dtype=np.float32))
        if p + "conv.conv.weight" in t:
            w.add_tensor(b + "shortconv.conv.weight", np.ascontiguousarray(t[p + "conv.conv.weight"][:, 0]))
        if p + "feed_forward.gate.weight" in t:
            for ours, theirs in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
                w.add_tensor(f"{b}ffn_{ours}_exps.weight", np.ascontiguousarray(np.stack(
                    [t[f"{p}feed_forward.experts.{e}.{theirs}.weight"] for e in range(cfg["num_experts"])])))
    close_gguf(w)


@pytest.mark.parametrize("family, arch", [("lfm2", "lfm2"), ("lfm2_moe", "lfm2moe")])
def test_an_lfm2_gguf_reads_as_its_checkpoint(family, arch, tmp_path):
    """LFM2's GGUFs (its short convolution layers marked by a zero in head_count_kv) read to the checkpoint's config and
    logits."""
    from flared_testing.checkpoints import hf_last_logits, last_logits

    hf_dir = build_hf_checkpoint(family, tmp_path / "hf")
    write_lfm2_gguf(hf_dir, tmp_path / "m.gguf", arch)
    import dataclasses

    source, reference = read_source(tmp_path / "m.gguf"), read_source(hf_dir).config
    assert abs(source.config.rms_norm_eps - reference.rms_norm_eps) < 1e-12  # (a float32 key)
    assert dataclasses.replace(source.config, rms_norm_eps=reference.rms_norm_eps) == reference
    prompt = np.random.default_rng(6).integers(3, source.config.vocab_size, size=30).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(hf_dir, prompt)).abs().max().item() < 1e-4


def write_granite_hybrid_gguf(hf_dir, path) -> None:
    """A Granite 4.0-H checkpoint as llama.cpp's converter writes it (F32): head_count_kv a list with 0 for each Mamba
    layer, the ssm keys (inner size, state size, groups, heads as the time step rank, kernel), rope_scaling_finetuned
    false for "no rope", Granite's multipliers; the mixers' ssm_in / conv1d (squeezed, biased) / dt bias / A as -exp
    and D as [heads, 1] / the norm as [groups, inner / groups] / ssm_out; the attention's q/k rows permuted; the
    experts' input_linear split into gate and up stacks, the shared MLP as *_shexp (or the dense MLP)."""
    import json

    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    t = load_file(hf_dir / "model.safetensors")
    arch, layers, heads = "granitehybrid", cfg["num_hidden_layers"], cfg["num_attention_heads"]
    kv_heads, hidden = cfg["num_key_value_heads"], cfg["hidden_size"]
    inner, groups = cfg["mamba_expand"] * hidden, cfg["mamba_n_groups"]
    experts = cfg.get("num_local_experts") or 0
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("context_length", 2 ** 20), ("embedding_length", hidden), ("block_count", layers),
                       ("attention.head_count", heads), ("vocab_size", cfg["vocab_size"]),
                       ("feed_forward_length", cfg["shared_intermediate_size"]),
                       ("ssm.conv_kernel", cfg["mamba_d_conv"]), ("ssm.state_size", cfg["mamba_d_state"]),
                       ("ssm.group_count", groups), ("ssm.inner_size", inner),
                       ("ssm.time_step_rank", cfg["mamba_n_heads"])):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_array(f"{arch}.attention.head_count_kv", [kv_heads if k == "full_attention" else 0
                                                   for k in cfg["layer_types"]])
    w.add_bool(f"{arch}.rope.scaling.finetuned", False)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    for ours, theirs in (("embedding_scale", "embedding_multiplier"), ("residual_scale", "residual_multiplier"),
                         ("logit_scale", "logits_scaling"), ("attention.scale", "attention_multiplier")):
        w.add_float32(f"{arch}.{ours}", cfg[theirs])
    if experts:
        w.add_uint32(f"{arch}.expert_count", experts)
        w.add_uint32(f"{arch}.expert_used_count", cfg["num_experts_per_tok"])
        w.add_uint32(f"{arch}.expert_feed_forward_length", cfg["intermediate_size"])
        w.add_uint32(f"{arch}.expert_shared_feed_forward_length", cfg["shared_intermediate_size"])

    add = f32_tensors(w)

    add("token_embd.weight", t["model.embed_tokens.weight"])
    add("output_norm.weight", t["model.norm.weight"])
    if not cfg.get("tie_word_embeddings"):
        add("output.weight", t["lm_head.weight"])
    for i in range(layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", t[p + "input_layernorm.weight"])
        add(b + "ffn_norm.weight", t[p + "post_attention_layernorm.weight"])
        if p + "mamba.in_proj.weight" in t:
            m = p + "mamba."
            add(b + "ssm_in.weight", t[m + "in_proj.weight"])
            add(b + "ssm_conv1d.weight", t[m + "conv1d.weight"][:, 0])
            add(b + "ssm_conv1d.bias", t[m + "conv1d.bias"])
            add(b + "ssm_dt.bias", t[m + "dt_bias"])
            add(b + "ssm_a", -np.exp(t[m + "A_log"])[:, None])
            add(b + "ssm_d", t[m + "D"][:, None])
            add(b + "ssm_norm.weight", t[m + "norm.weight"].reshape(groups, inner // groups))
            add(b + "ssm_out.weight", t[m + "out_proj.weight"])
        else:
            a = p + "self_attn."
            add(b + "attn_q.weight", permute_for_llama_cpp(t[a + "q_proj.weight"], heads))
            add(b + "attn_k.weight", permute_for_llama_cpp(t[a + "k_proj.weight"], kv_heads))
            add(b + "attn_v.weight", t[a + "v_proj.weight"])
            add(b + "attn_output.weight", t[a + "o_proj.weight"])
        gate, up = np.split(t[p + "shared_mlp.input_linear.weight"], 2)
        suffix = "_shexp" if experts else ""
        add(f"{b}ffn_gate{suffix}.weight", gate)
        add(f"{b}ffn_up{suffix}.weight", up)
        add(f"{b}ffn_down{suffix}.weight", t[p + "shared_mlp.output_linear.weight"])
        if experts:
            e = p + "block_sparse_moe."
            add(b + "ffn_gate_inp.weight", t[e + "router.layer.weight"])
            gate_exps, up_exps = np.split(t[e + "input_linear.weight"], 2, axis=1)
            add(b + "ffn_gate_exps.weight", gate_exps)
            add(b + "ffn_up_exps.weight", up_exps)
            add(b + "ffn_down_exps.weight", t[e + "output_linear.weight"])
    close_gguf(w)


@pytest.mark.parametrize("family", ["granite4_h", "granite4_h_moe"])
def test_a_granite_4_h_gguf_reads_as_its_checkpoint(family, tmp_path):
    """Granite 4.0-H's GGUFs (Mamba-2 layers marked by a zero in head_count_kv, no rope flagged) read to the
    checkpoint's config (but the context, which llama.cpp writes as 2^20 for a model without rope) and logits."""
    import dataclasses

    from flared_testing.checkpoints import hf_last_logits, last_logits

    hf_dir = build_hf_checkpoint(family, tmp_path / "hf")
    write_granite_hybrid_gguf(hf_dir, tmp_path / "m.gguf")
    source, reference = read_source(tmp_path / "m.gguf"), read_source(hf_dir).config
    assert source.config.max_position_embeddings == 2 ** 20
    floats = ("rms_norm_eps", "embedding_multiplier", "residual_multiplier", "logits_scaling", "attention_scale")
    for name in floats:  # (float32 keys)
        assert abs(getattr(source.config, name) - getattr(reference, name)) < 1e-6 * getattr(reference, name)
    assert dataclasses.replace(source.config, max_position_embeddings=reference.max_position_embeddings,
                               **{name: getattr(reference, name) for name in floats}) == reference
    prompt = np.random.default_rng(6).integers(3, source.config.vocab_size, size=30).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(hf_dir, prompt)).abs().max().item() < 1e-4


def write_nemotron_h_gguf(hf_dir, path) -> None:
    """A Nemotron-H checkpoint as llama.cpp's converter writes it (F32; nemotron_h, or nemotron_h_moe with experts):
    one GGUF block a checkpoint block, its norm as attn_norm; head_count_kv and feed_forward_length lists with 0 where a
    block has no attention or MLP; the ssm keys; key_length; the experts' keys (count, used, sizes, sigmoid gating,
    groups, scale, norm); the mixers' tensors as Granite 4.0-H's; the MLP's ffn_up / ffn_down; the experts' router,
    exp_probs_b, stacked ffn_up_exps / ffn_down_exps and the shared expert's *_shexp."""
    import json

    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    t = load_file(hf_dir / "model.safetensors")
    kinds = cfg["layers_block_type"]
    moe = "moe" in kinds
    arch = "nemotron_h_moe" if moe else "nemotron_h"
    heads, kv_heads, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    inner, groups = cfg["mamba_num_heads"] * cfg["mamba_head_dim"], cfg["n_groups"]
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("context_length", cfg["max_position_embeddings"]), ("embedding_length", hidden),
                       ("block_count", len(kinds)), ("attention.head_count", heads), ("vocab_size", cfg["vocab_size"]),
                       ("attention.key_length", cfg["head_dim"]), ("attention.value_length", cfg["head_dim"]),
                       ("ssm.conv_kernel", cfg["conv_kernel"]), ("ssm.state_size", cfg["ssm_state_size"]),
                       ("ssm.group_count", groups), ("ssm.inner_size", inner),
                       ("ssm.time_step_rank", cfg["mamba_num_heads"])):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_array(f"{arch}.attention.head_count_kv", [kv_heads if k == "full_attention" else 0 for k in kinds])
    w.add_array(f"{arch}.feed_forward_length", [cfg["moe_intermediate_size"] if k == "moe" else
                                                cfg["intermediate_size"] if k == "mlp" else 0 for k in kinds])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["layer_norm_epsilon"])
    if moe:
        for key, value in (("expert_count", cfg["n_routed_experts"]), ("expert_used_count", cfg["num_experts_per_tok"]),
                           ("expert_feed_forward_length", cfg["moe_intermediate_size"]),
                           ("expert_shared_feed_forward_length", cfg["moe_shared_expert_intermediate_size"]),
                           ("expert_shared_count", cfg["n_shared_experts"]), ("expert_group_count", cfg["n_group"]),
                           ("expert_group_used_count", cfg["topk_group"]), ("expert_gating_func", 2)):
            w.add_uint32(f"{arch}.{key}", value)
        w.add_bool(f"{arch}.expert_weights_norm", cfg["norm_topk_prob"])
        w.add_float32(f"{arch}.expert_weights_scale", cfg["routed_scaling_factor"])

    add = f32_tensors(w)

    add("token_embd.weight", t["backbone.embeddings.weight"])
    add("output_norm.weight", t["backbone.norm_f.weight"])
    if not cfg.get("tie_word_embeddings"):
        add("output.weight", t["lm_head.weight"])
    for i, kind in enumerate(kinds):
        p, b = f"backbone.layers.{i}.mixer.", f"blk.{i}."
        add(b + "attn_norm.weight", t[f"backbone.layers.{i}.norm.weight"])
        if kind == "linear_attention":
            add(b + "ssm_in.weight", t[p + "in_proj.weight"])
            add(b + "ssm_conv1d.weight", t[p + "conv1d.weight"][:, 0])
            add(b + "ssm_conv1d.bias", t[p + "conv1d.bias"])
            add(b + "ssm_dt.bias", t[p + "dt_bias"])
            add(b + "ssm_a", -np.exp(t[p + "A_log"])[:, None])
            add(b + "ssm_d", t[p + "D"][:, None])
            add(b + "ssm_norm.weight", t[p + "norm.weight"].reshape(groups, inner // groups))
            add(b + "ssm_out.weight", t[p + "out_proj.weight"])
        elif kind == "full_attention":
            for x in "qkv":
                add(f"{b}attn_{x}.weight", t[f"{p}{x}_proj.weight"])
            add(b + "attn_output.weight", t[p + "o_proj.weight"])
        elif kind == "mlp":
            add(b + "ffn_up.weight", t[p + "up_proj.weight"])
            add(b + "ffn_down.weight", t[p + "down_proj.weight"])
        else:
            add(b + "ffn_gate_inp.weight", t[p + "gate.weight"])
            add(b + "exp_probs_b.bias", t[p + "gate.e_score_correction_bias"])
            for x in ("up", "down"):
                stacked = t.get(f"{p}experts.{x}_proj")
                if stacked is None:
                    stacked = np.stack([t[f"{p}experts.{e}.{x}_proj.weight"] for e in range(cfg["n_routed_experts"])])
                add(f"{b}ffn_{x}_exps.weight", stacked)
                add(f"{b}ffn_{x}_shexp.weight", t[f"{p}shared_experts.{x}_proj.weight"])
    close_gguf(w)


@pytest.mark.parametrize("family", ["nemotron_h", "nemotron_h_moe"])
def test_a_nemotron_h_gguf_reads_as_its_checkpoint(family, tmp_path):
    """Nemotron-H's GGUFs (a block a GGUF layer, its kind from its tensors) read to the checkpoint's config and
    logits."""
    import dataclasses

    from flared_testing.checkpoints import hf_last_logits, last_logits

    hf_dir = build_hf_checkpoint(family, tmp_path / "hf")
    write_nemotron_h_gguf(hf_dir, tmp_path / "m.gguf")
    source, reference = read_source(tmp_path / "m.gguf"), read_source(hf_dir).config
    floats = ("rms_norm_eps", "routed_scaling")  # (float32 keys)
    for name in floats:
        if getattr(reference, name) is not None:
            assert abs(getattr(source.config, name) - getattr(reference, name)) < 1e-6 * getattr(reference, name)
    assert dataclasses.replace(source.config, **{name: getattr(reference, name) for name in floats}) == reference
    prompt = np.random.default_rng(6).integers(3, source.config.vocab_size, size=30).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(hf_dir, prompt)).abs().max().item() < 1e-4


def write_falcon_h1_gguf(hf_dir, path) -> None:
    """A Falcon-H1 checkpoint as llama.cpp's converter writes it (F32): Mamba-2's ssm keys beside attention's; the muP
    multipliers folded into the weights (ssm_in and the five ssm_multipliers into ssm_in's rows, ssm_out, attention
    in / key / out, the MLP's gate and down, the embedding and the LM head); q/k rows permuted; the mixer's norm
    (ssm_norm, [groups, inner / groups]) only where it has one."""
    import json

    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    t = load_file(hf_dir / "model.safetensors")
    arch, layers, heads = "falcon-h1", cfg["num_hidden_layers"], cfg["num_attention_heads"]
    kv_heads, hidden, inner = cfg["num_key_value_heads"], cfg["hidden_size"], cfg["mamba_d_ssm"]
    groups, state = cfg["mamba_n_groups"], cfg["mamba_n_groups"] * cfg["mamba_d_state"]
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("context_length", cfg["max_position_embeddings"]), ("embedding_length", hidden),
                       ("block_count", layers), ("feed_forward_length", cfg["intermediate_size"]),
                       ("attention.head_count", heads), ("attention.head_count_kv", kv_heads),
                       ("attention.key_length", cfg["head_dim"]), ("attention.value_length", cfg["head_dim"]),
                       ("vocab_size", cfg["vocab_size"]), ("ssm.conv_kernel", cfg["mamba_d_conv"]),
                       ("ssm.state_size", cfg["mamba_d_state"]), ("ssm.group_count", groups),
                       ("ssm.inner_size", inner), ("ssm.time_step_rank", cfg["mamba_n_heads"])):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", cfg["rope_parameters"]["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])

    add = f32_tensors(w)

    attn_in = cfg["attention_in_multiplier"]
    mup = np.concatenate([np.full(n, f, dtype=np.float32) for n, f in zip(
        (inner, inner, state, state, cfg["mamba_n_heads"]), cfg["ssm_multipliers"])])
    add("token_embd.weight", t["model.embed_tokens.weight"] * cfg["embedding_multiplier"])
    add("output_norm.weight", t["model.final_layernorm.weight"])
    add("output.weight", t["lm_head.weight"] * cfg["lm_head_multiplier"])
    for i in range(layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", t[p + "input_layernorm.weight"])
        add(b + "ffn_norm.weight", t[p + "pre_ff_layernorm.weight"])
        m = p + "mamba."
        add(b + "ssm_in.weight", t[m + "in_proj.weight"] * cfg["ssm_in_multiplier"] * mup[:, None])
        add(b + "ssm_conv1d.weight", t[m + "conv1d.weight"][:, 0])
        add(b + "ssm_conv1d.bias", t[m + "conv1d.bias"])
        add(b + "ssm_dt.bias", t[m + "dt_bias"])
        add(b + "ssm_a", -np.exp(t[m + "A_log"])[:, None])
        add(b + "ssm_d", t[m + "D"][:, None])
        if m + "norm.weight" in t:
            add(b + "ssm_norm.weight", t[m + "norm.weight"].reshape(groups, inner // groups))
        add(b + "ssm_out.weight", t[m + "out_proj.weight"] * cfg["ssm_out_multiplier"])
        a = p + "self_attn."
        add(b + "attn_q.weight", permute_for_llama_cpp(t[a + "q_proj.weight"] * attn_in, heads))
        add(b + "attn_k.weight", permute_for_llama_cpp(t[a + "k_proj.weight"] * attn_in * cfg["key_multiplier"],
                                                       kv_heads))
        add(b + "attn_v.weight", t[a + "v_proj.weight"] * attn_in)
        add(b + "attn_output.weight", t[a + "o_proj.weight"] * cfg["attention_out_multiplier"])
        f = p + "feed_forward."
        add(b + "ffn_gate.weight", t[f + "gate_proj.weight"] * cfg["mlp_multipliers"][0])
        add(b + "ffn_up.weight", t[f + "up_proj.weight"])
        add(b + "ffn_down.weight", t[f + "down_proj.weight"] * cfg["mlp_multipliers"][1])
    close_gguf(w)


@pytest.mark.parametrize("family", ["falcon_h1", "falcon_h1_norm"])
def test_a_falcon_h1_gguf_reads_as_its_checkpoint(family, tmp_path):
    """Falcon-H1's GGUFs (the multipliers folded in by the converter: no embedding multiplier or logit scale left;
    the mixer's norm where ssm_norm is) read to the checkpoint's logits."""
    import dataclasses

    from flared_testing.checkpoints import hf_last_logits, last_logits

    hf_dir = build_hf_checkpoint(family, tmp_path / "hf")
    write_falcon_h1_gguf(hf_dir, tmp_path / "m.gguf")
    source, reference = read_source(tmp_path / "m.gguf"), read_source(hf_dir).config
    assert source.config.embedding_multiplier is None and source.config.logits_scaling is None
    assert dataclasses.replace(source.config, embedding_multiplier=reference.embedding_multiplier,
                               logits_scaling=reference.logits_scaling,
                               rms_norm_eps=reference.rms_norm_eps) == reference
    prompt = np.random.default_rng(6).integers(3, source.config.vocab_size, size=30).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(hf_dir, prompt)).abs().max().item() < 1e-4


def write_jamba_gguf(hf_dir, path) -> None:
    """A Jamba checkpoint as llama.cpp's converter writes it (F32): head_count_kv a list with 0 for each Mamba-1
    layer; the ssm keys (inner size, state size, time step rank, kernel); the mixers' ssm_in / conv1d (squeezed,
    biased) / ssm_x / ssm_dt (and its bias) / the dt, B and C norms / A as -exp(A_log) / D / ssm_out; the experts'
    router and stacked gate, up and down; no q/k permutation (no rope)."""
    import json

    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    t = load_file(hf_dir / "model.safetensors")
    arch, layers, hidden = "jamba", cfg["num_hidden_layers"], cfg["hidden_size"]
    attending = [i % cfg["attn_layer_period"] == cfg["attn_layer_offset"] for i in range(layers)]
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("context_length", cfg["max_position_embeddings"]), ("embedding_length", hidden),
                       ("block_count", layers), ("feed_forward_length", cfg["intermediate_size"]),
                       ("attention.head_count", cfg["num_attention_heads"]), ("vocab_size", cfg["vocab_size"]),
                       ("ssm.conv_kernel", cfg["mamba_d_conv"]), ("ssm.inner_size", cfg["mamba_expand"] * hidden),
                       ("ssm.state_size", cfg["mamba_d_state"]), ("ssm.time_step_rank", cfg["mamba_dt_rank"]),
                       ("expert_count", cfg["num_experts"]), ("expert_used_count", cfg["num_experts_per_tok"])):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_array(f"{arch}.attention.head_count_kv", [cfg["num_key_value_heads"] if a else 0 for a in attending])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])

    add = f32_tensors(w)

    add("token_embd.weight", t["model.embed_tokens.weight"])
    add("output_norm.weight", t["model.final_layernorm.weight"])
    add("output.weight", t["lm_head.weight"])
    for i in range(layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", t[p + "input_layernorm.weight"])
        add(b + "ffn_norm.weight", t[p + "pre_ff_layernorm.weight"])
        if attending[i]:
            for x, name in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
                add(f"{b}{name}.weight", t[f"{p}self_attn.{x}_proj.weight"])
        else:
            m = p + "mamba."
            add(b + "ssm_in.weight", t[m + "in_proj.weight"])
            add(b + "ssm_conv1d.weight", t[m + "conv1d.weight"][:, 0])
            add(b + "ssm_conv1d.bias", t[m + "conv1d.bias"])
            add(b + "ssm_x.weight", t[m + "x_proj.weight"])
            add(b + "ssm_dt.weight", t[m + "dt_proj.weight"])
            add(b + "ssm_dt.bias", t[m + "dt_proj.bias"])
            for x in ("dt", "b", "c"):
                add(f"{b}ssm_{x}_norm.weight", t[f"{m}{x}_layernorm.weight"])
            add(b + "ssm_a", -np.exp(t[m + "A_log"]))
            add(b + "ssm_d", t[m + "D"])
            add(b + "ssm_out.weight", t[m + "out_proj.weight"])
        f = p + "feed_forward."
        if f + "router.weight" in t:
            add(b + "ffn_gate_inp.weight", t[f + "router.weight"])
            for x in ("gate", "up", "down"):  # (the checkpoint's experts one by one, stacked as the converter merges)
                add(f"{b}ffn_{x}_exps.weight", np.stack([t[f"{f}experts.{e}.{x}_proj.weight"]
                                                         for e in range(cfg["num_experts"])]))
        else:
            for x in ("gate", "up", "down"):
                add(f"{b}ffn_{x}.weight", t[f"{f}{x}_proj.weight"])
    close_gguf(w)


def test_a_jamba_gguf_reads_as_its_checkpoint(tmp_path):
    """Jamba's GGUF (Mamba-1 layers marked by a zero in head_count_kv, the expert layers by their router) reads to the
    checkpoint's config and logits."""
    import dataclasses

    from flared_testing.checkpoints import hf_last_logits, last_logits

    hf_dir = build_hf_checkpoint("jamba", tmp_path / "hf")
    write_jamba_gguf(hf_dir, tmp_path / "m.gguf")
    source, reference = read_source(tmp_path / "m.gguf"), read_source(hf_dir).config
    assert dataclasses.replace(source.config, rms_norm_eps=reference.rms_norm_eps) == reference
    prompt = np.random.default_rng(6).integers(3, source.config.vocab_size, size=30).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(hf_dir, prompt)).abs().max().item() < 1e-4


def write_mamba_gguf(hf_dir, path, arch: str) -> None:
    """A Mamba (mamba) or Mamba-2 (mamba2) language model as llama.cpp's converter writes it (F32): the ssm keys
    (Mamba-2's heads as the time step rank, its groups), each layer's norm as attn_norm; Mamba's ssm_x / ssm_dt and
    A as -exp(A_log) [channels, states]; Mamba-2's as Granite 4.0-H's."""
    import json

    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    t = load_file(hf_dir / "model.safetensors")
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    inner = cfg["expand"] * hidden
    w = gguf.GGUFWriter(str(path), arch)
    keys = [("context_length", 2 ** 20), ("embedding_length", hidden), ("block_count", layers),
            ("vocab_size", cfg["vocab_size"]), ("ssm.conv_kernel", cfg["conv_kernel"]), ("ssm.inner_size", inner),
            ("ssm.state_size", cfg["state_size"]),
            ("ssm.time_step_rank", cfg["time_step_rank"] if arch == "mamba" else cfg["num_heads"])]
    if arch == "mamba2":
        keys.append(("ssm.group_count", cfg["n_groups"]))
    for key, value in keys:
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["layer_norm_epsilon"])
    if cfg["model_type"] == "falcon_mamba":  # (its converter's flag for the weightless dt / B / C norms)
        w.add_bool(f"{arch}.ssm.dt_b_c_rms", True)

    add = f32_tensors(w)

    add("token_embd.weight", t["backbone.embeddings.weight"])
    add("output_norm.weight", t["backbone.norm_f.weight"])
    if "lm_head.weight" in t and not cfg.get("tie_word_embeddings"):
        add("output.weight", t["lm_head.weight"])
    for i in range(layers):
        m, b = f"backbone.layers.{i}.mixer.", f"blk.{i}."
        add(b + "attn_norm.weight", t[f"backbone.layers.{i}.norm.weight"])
        add(b + "ssm_in.weight", t[m + "in_proj.weight"])
        add(b + "ssm_conv1d.weight", t[m + "conv1d.weight"][:, 0])
        add(b + "ssm_conv1d.bias", t[m + "conv1d.bias"])
        add(b + "ssm_out.weight", t[m + "out_proj.weight"])
        if arch == "mamba":
            add(b + "ssm_x.weight", t[m + "x_proj.weight"])
            add(b + "ssm_dt.weight", t[m + "dt_proj.weight"])
            add(b + "ssm_dt.bias", t[m + "dt_proj.bias"])
            add(b + "ssm_a", -np.exp(t[m + "A_log"]))
            add(b + "ssm_d", t[m + "D"])
        else:
            add(b + "ssm_dt.bias", t[m + "dt_bias"])
            add(b + "ssm_a", -np.exp(t[m + "A_log"])[:, None])
            add(b + "ssm_d", t[m + "D"][:, None])
            add(b + "ssm_norm.weight", t[m + "norm.weight"].reshape(cfg["n_groups"], inner // cfg["n_groups"]))
    close_gguf(w)


@pytest.mark.parametrize("family", ["mamba", "mamba2", "falcon_mamba"])
def test_a_mamba_gguf_reads_as_its_checkpoint(family, tmp_path):
    """Mamba's, Mamba-2's and Falcon-Mamba's GGUFs (no attention: the ssm keys alone; Falcon-Mamba's a mamba file with
    ssm.dt_b_c_rms) read to the checkpoint's config (but the context, which llama.cpp writes as 2^20) and logits."""
    import dataclasses

    from flared_testing.checkpoints import hf_last_logits, last_logits

    hf_dir = build_hf_checkpoint(family, tmp_path / "hf")
    if family == "falcon_mamba":  # (the released epsilon, which the file cannot carry; the fixture's is larger)
        config = json.loads((hf_dir / "config.json").read_text())
        (hf_dir / "config.json").write_text(json.dumps({**config, "mixer_rms_eps": 1e-6}))
    write_mamba_gguf(hf_dir, tmp_path / "m.gguf", "mamba2" if family == "mamba2" else "mamba")
    source, reference = read_source(tmp_path / "m.gguf"), read_source(hf_dir).config
    assert dataclasses.replace(source.config, rms_norm_eps=reference.rms_norm_eps,
                               max_position_embeddings=reference.max_position_embeddings) == reference
    prompt = np.random.default_rng(6).integers(3, source.config.vocab_size, size=30).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(hf_dir, prompt)).abs().max().item() < 1e-4


def rope_factor_tensors(cfg: dict, w, arch: str, theta: float, dim: int) -> dict[str, np.ndarray]:
    """Rope scaling as llama.cpp's converter writes it for Llama 3.1 (rope_freqs: each frequency's divisor) and Phi-3
    (LongRoPE's two tables, the attention factor from the two contexts, the original context)."""
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        divisors = []
        for freq in 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
            wavelen = 2 * math.pi / freq
            if wavelen < old / high:
                divisors.append(1.0)
            elif wavelen > old / low:
                divisors.append(factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                divisors.append(1 / ((1 - smooth) / factor + smooth))
        return {"rope_freqs.weight": np.array(divisors, dtype=np.float32)}
    if rope.get("rope_type") != "longrope":
        return {}
    original = cfg["original_max_position_embeddings"]
    scale = cfg["max_position_embeddings"] / original
    w.add_uint32(f"{arch}.rope.scaling.original_context_length", original)
    w.add_float32(f"{arch}.rope.scaling.attn_factor",
                  math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    return {"rope_factors_long.weight": np.array(rope["long_factor"], dtype=np.float32),
            "rope_factors_short.weight": np.array(rope["short_factor"], dtype=np.float32)}


def write_experts(add, t: dict, p: str, i: int, experts: int) -> None:
    """A mixture-of-experts layer as llama.cpp's converter writes it: the router, each projection's experts
    stacked [experts, out, in], Qwen2-MoE's shared expert and its gate."""
    if f"{p}mlp.router.weight" in t:  # gpt-oss: biased router and experts, gate and up columns interleaved
        block = p + "mlp."
        add(f"blk.{i}.ffn_gate_inp.weight", t[block + "router.weight"])
        add(f"blk.{i}.ffn_gate_inp.bias", t[block + "router.bias"])
        gate_up, bias = t[block + "experts.gate_up_proj"].transpose(0, 2, 1), t[block + "experts.gate_up_proj_bias"]
        for ours, columns in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
            add(f"blk.{i}.ffn_{ours}_exps.weight", gate_up[:, columns])
            add(f"blk.{i}.ffn_{ours}_exps.bias", bias[:, columns])
        add(f"blk.{i}.ffn_down_exps.weight", t[block + "experts.down_proj"].transpose(0, 2, 1))
        add(f"blk.{i}.ffn_down_exps.bias", t[block + "experts.down_proj_bias"])
        return
    if f"{p}block_sparse_moe.input_linear.weight" in t:  # Granite's: stacked [E, 2 I, H] split, its shared MLP too
        e = p + "block_sparse_moe."
        add(f"blk.{i}.ffn_gate_inp.weight", t[e + "router.layer.weight"])
        gate_exps, up_exps = np.split(t[e + "input_linear.weight"], 2, axis=1)
        add(f"blk.{i}.ffn_gate_exps.weight", gate_exps)
        add(f"blk.{i}.ffn_up_exps.weight", up_exps)
        add(f"blk.{i}.ffn_down_exps.weight", t[e + "output_linear.weight"])
        if f"{p}shared_mlp.input_linear.weight" in t:
            gate, up = np.split(t[p + "shared_mlp.input_linear.weight"], 2)
            add(f"blk.{i}.ffn_gate_shexp.weight", gate)
            add(f"blk.{i}.ffn_up_shexp.weight", up)
            add(f"blk.{i}.ffn_down_shexp.weight", t[p + "shared_mlp.output_linear.weight"])
        return
    mixtral = f"{p}block_sparse_moe.gate.weight" in t
    block = p + ("block_sparse_moe." if mixtral else "mlp.")
    add(f"blk.{i}.ffn_gate_inp.weight", t[block + ("gate.wg.weight" if block + "gate.wg.weight" in t else "gate.weight")])
    ernie = block + "moe_statics.e_score_correction_bias" in t
    if ernie or block + "shared_mlp.up_proj.weight" in t:  # ERNIE's shared experts, Hunyuan's shared MLP: ungated
        for x in ("gate", "up", "down"):
            add(f"blk.{i}.ffn_{x}_shexp.weight", t[f"{block}{'shared_experts' if ernie else 'shared_mlp'}.{x}_proj.weight"])
    if ernie:  # its router's correction bias
        add(f"blk.{i}.exp_probs_b.bias", t[block + "moe_statics.e_score_correction_bias"].reshape(-1))
    names = {"gate": "w1", "up": "w3", "down": "w2"} if mixtral else {x: f"{x}_proj" for x in ("gate", "up", "down")}
    for ours, theirs in names.items():
        add(f"blk.{i}.ffn_{ours}_exps.weight",
            np.stack([t[f"{block}experts.{e}.{theirs}.weight"] for e in range(experts)]))
    if block + "shared_expert_gate.weight" in t:
        add(f"blk.{i}.ffn_gate_inp_shexp.weight", t[block + "shared_expert_gate.weight"][0])
        for x in ("gate", "up", "down"):
            add(f"blk.{i}.ffn_{x}_shexp.weight", t[f"{block}shared_expert.{x}_proj.weight"])
    if block + "gate.e_score_correction_bias" in t:  # GLM-4.5: the router's correction bias, ungated shared experts
        add(f"blk.{i}.exp_probs_b.bias", t[block + "gate.e_score_correction_bias"])
        for x in ("gate", "up", "down"):
            add(f"blk.{i}.ffn_{x}_shexp.weight", t[f"{block}shared_experts.{x}_proj.weight"])


@pytest.mark.parametrize("family", sorted(CASES))
def test_gguf_family_matches_transformers(family, tmp_path):
    from transformers import AutoModelForCausalLM

    arch, matrix_type = CASES[family]
    hf_dir = build_hf_checkpoint(family, tmp_path / "hf")
    gguf_path = tmp_path / f"{family}.gguf"
    write_gguf(hf_dir, gguf_path, arch, matrix_type)

    source = read_source(gguf_path)
    assert source.source_kind == "gguf" and source.config.architecture == arch
    reference = read_source(hf_dir).config
    for field in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "tie_word_embeddings", "attention_bias",
                  "qk_norm", "vocab_size", "rope_theta"):
        assert getattr(source.config, field) == getattr(reference, field), field

    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf_path.name, dtype=torch.float32)
    hf_model.eval()
    model = DecoderModel(source.config, source.tensors)
    kv = model.make_kv_cache(num_pages=8, page_tokens=4)
    prompt = np.random.default_rng(3).integers(0, source.config.vocab_size, size=13).tolist()
    # Two chunks (the second sees the first through the paged cache), logits for the last token.
    model.forward(ForwardBatch.build([SequenceChunk(prompt[:6], 0, [6, 2, 0, 5], needs_logits=False)], page_tokens=4), kv)
    ours = model.forward(ForwardBatch.build([SequenceChunk(prompt[6:], 6, [6, 2, 0, 5])], page_tokens=4), kv)[0]
    with torch.no_grad():
        theirs = hf_model(torch.tensor([prompt])).logits[0, -1].float()
    assert (ours - theirs).abs().max().item() < 1e-4
    if matrix_type == Q.F32:
        # Both GGUF readers undo the q/k permutation; only the original checkpoint shows it is undone right.
        original = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        with torch.no_grad():
            expected = original(torch.tensor([prompt])).logits[0, -1].float()
        assert (ours - expected).abs().max().item() < 1e-4


def test_llama3_rope_scaling_as_llama_cpp_stores_it(tmp_path):
    """llama.cpp's GGUFs carry Llama 3.1's rope scaling as rope_freqs (a divisor per frequency): such a file reads to
    the checkpoint's rope tables (within float32 rounding: the divisors are 1 / blends) and logits."""
    from flared.model.rope import rope_tables
    from flared_testing.checkpoints import hf_last_logits, last_logits

    hf_dir = build_hf_checkpoint("llama3", tmp_path / "hf")
    write_gguf(hf_dir, tmp_path / "m.gguf", "llama", Q.F32)
    source = read_source(tmp_path / "m.gguf")
    assert source.config.rope_scaling["rope_type"] == "factors"
    reference = read_source(hf_dir).config
    for ours, theirs in zip(rope_tables(source.config, 512, dtype=torch.float32, device="cpu"),
                            rope_tables(reference, 512, dtype=torch.float32, device="cpu")):
        assert (ours - theirs).abs().max().item() < 1e-4
    prompt = np.random.default_rng(5).integers(0, source.config.vocab_size, size=90).tolist()  # past the original 64
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(hf_dir, prompt)).abs().max().item() < 1e-4


def test_a_gguf_read_for_a_dtype_is_its_float32_read_cast(tmp_path):
    """read_source(dtype=...) keeps a GGUF's matrices in the serving dtype as it dequantizes them (export's peak
    memory: 2 bytes a weight for bfloat16): the same values as reading in float32 and casting, vectors float32."""
    hf_dir = build_hf_checkpoint("qwen2", tmp_path / "hf")
    write_gguf(hf_dir, tmp_path / "m.gguf", "qwen2", Q.Q8_0)
    wide, narrow = read_source(tmp_path / "m.gguf"), read_source(tmp_path / "m.gguf", dtype=torch.bfloat16)
    assert wide.tensors.keys() == narrow.tensors.keys()
    for name, value in wide.tensors.items():
        expected = value.to(torch.bfloat16) if value.dim() >= 2 else value
        assert narrow.tensors[name].dtype == expected.dtype and torch.equal(narrow.tensors[name], expected), name


@pytest.mark.parametrize("family, arch", [("seed_oss", "seed_oss"), ("glm4", "glm4"), ("glm4_moe", "glm4moe"),
                                          ("cohere", "command-r"), ("cohere2", "cohere2"), ("qwen3_next", "qwen3next"),
                                          ("qwen3_5", "qwen35"), ("qwen3_5_moe", "qwen35moe"), ("dots1", "dots1"),
                                          ("ernie4_5", "ernie4_5"), ("ernie4_5_moe", "ernie4_5-moe"),
                                          ("hunyuan", "hunyuan-dense"), ("hunyuan_moe", "hunyuan-moe"),
                                          ("arcee", "arcee"), ("granitemoe", "granitemoe"),
                                          ("granitemoeshared", "granitemoe"), ("olmoe", "olmoe"),
                                          ("starcoder2", "starcoder2"), ("ministral3", "mistral3"),
                                          ("llama_tied", "internlm2")])
def test_a_gguf_transformers_cannot_read_reads_as_its_checkpoint(family, arch, tmp_path):
    """Architectures transformers' GGUF loader lacks, written as llama.cpp's converter writes them (Seed-OSS: no q/k
    permutation; GLM-4: q/k rows as released, interleaved pairs, four norms; GLM-4.5: sigmoid gating, its groups,
    scale, correction biases, shared experts and dense first layer; Cohere: LayerNorms, interleaved q/k rows, the logit
    scale, Cohere2's windows): the checkpoint's config and logits."""
    from flared_testing.checkpoints import hf_last_logits, last_logits

    hf_dir = build_hf_checkpoint(family, tmp_path / "hf")
    if family == "starcoder2":  # (its converter writes no window: llama.cpp attends over the whole context)
        config = json.loads((hf_dir / "config.json").read_text())
        (hf_dir / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    write_gguf(hf_dir, tmp_path / "m.gguf", arch, Q.F32)
    source, reference = read_source(tmp_path / "m.gguf"), read_source(hf_dir).config
    for field in ("attention_bias", "attention_out_bias", "head_dim", "num_heads", "num_kv_heads", "qk_norm",
                  "rotary_dim", "rope_interleaved", "sandwich_norm", "num_experts", "experts_per_token",
                  "dense_layers", "router_sigmoid", "expert_groups", "expert_groups_per_token", "routed_scaling",
                  "shared_expert_intermediate_size", "shared_expert_gate", "norm_topk_prob", "layer_norm",
                  "parallel_block", "layer_windows", "nope_layers", "linear_layers", "linear_key_heads",
                  "linear_value_heads", "linear_key_dim", "linear_value_dim", "linear_conv_kernel", "attn_output_gate",
                  "router_correction_bias", "qk_norm_after_rope", "expert_intermediate_size", "mlp_gated",
                  "hidden_act", "rope_scaling", "router_topk_softmax", "qk_norm_whole", "norm_bias", "mlp_bias",
                  "sliding_window", "query_position_scale", "query_position_floor"):  # (float32 multipliers: by the
        # logits)
        assert getattr(source.config, field) == getattr(reference, field), field
    prompt = np.random.default_rng(6).integers(3, source.config.vocab_size, size=30).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(hf_dir, prompt)).abs().max().item() < 1e-4


def write_deepseek2_gguf(hf_dir, path, *, split_kv_b: bool) -> None:
    """A DeepSeek V2 / V3 or GLM-4.7-Flash checkpoint as llama.cpp's converter writes it (F32; deepseek2): one kv head
    of kv_lora_rank + rope wide keys for its absorbed attention, the per-head sizes as the _mla keys, kv_b split into
    attn_k_b (each head's key rows transposed) and attn_v_b; or, as older converters did, the per-head sizes as
    key_length / value_length and kv_b whole. Rows as released (no permutation: llama.cpp turns interleaved pairs);
    YaRN's log multiplier 0.1 * mscale_all_dim; sigmoid gating, groups and dense layers from their keys."""
    import json

    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    t = load_file(hf_dir / "model.safetensors")
    arch, heads = "deepseek2", cfg["num_attention_heads"]
    nope, rope_dim, v_dim, kv_lora = (cfg[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                                         "kv_lora_rank"))
    rope = cfg.get("rope_parameters") or {}
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("context_length", cfg["max_position_embeddings"]), ("embedding_length", cfg["hidden_size"]),
                       ("block_count", cfg["num_hidden_layers"]), ("feed_forward_length", cfg["intermediate_size"]),
                       ("attention.head_count", heads), ("attention.head_count_kv", 1),
                       ("attention.kv_lora_rank", kv_lora), ("rope.dimension_count", rope_dim),
                       ("vocab_size", cfg["vocab_size"]), ("expert_count", cfg["n_routed_experts"]),
                       ("expert_used_count", cfg["num_experts_per_tok"]),
                       ("expert_feed_forward_length", cfg["moe_intermediate_size"]),
                       ("expert_shared_count", cfg["n_shared_experts"])):
        w.add_uint32(f"{arch}.{key}", value)
    if split_kv_b:
        for key, value in (("key_length", kv_lora + rope_dim), ("value_length", kv_lora),
                           ("key_length_mla", nope + rope_dim), ("value_length_mla", v_dim)):
            w.add_uint32(f"{arch}.attention.{key}", value)
    else:
        w.add_uint32(f"{arch}.attention.key_length", nope + rope_dim)
        w.add_uint32(f"{arch}.attention.value_length", v_dim)
    if cfg.get("q_lora_rank"):
        w.add_uint32(f"{arch}.attention.q_lora_rank", cfg["q_lora_rank"])
    dense = cfg.get("first_k_dense_replace")
    if dense is None:  # (GLM-4.7-Flash's config names its dense layers by mlp_layer_types)
        dense = cfg["mlp_layer_types"].index("sparse")
    w.add_uint32(f"{arch}.leading_dense_block_count", dense)
    w.add_float32(f"{arch}.expert_weights_scale", cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob") and cfg["model_type"] != "deepseek_v2":
        w.add_bool(f"{arch}.expert_weights_norm", True)
    if cfg["model_type"] != "deepseek_v2":  # (sigmoid scoring: V3's, GLM-4.7-Flash's)
        w.add_uint32(f"{arch}.expert_gating_func", 2)
        w.add_uint32(f"{arch}.expert_group_count", cfg["n_group"])
        w.add_uint32(f"{arch}.expert_group_used_count", cfg["topk_group"])
    w.add_float32(f"{arch}.rope.freq_base", rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope.get("rope_type") == "yarn":
        w.add_string(f"{arch}.rope.scaling.type", "yarn")
        w.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", rope["original_max_position_embeddings"])
        w.add_float32(f"{arch}.rope.scaling.yarn_log_multiplier", 0.1 * rope["mscale_all_dim"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])

    def add(name: str, array: np.ndarray) -> None:
        w.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))

    add("token_embd.weight", t["model.embed_tokens.weight"])
    add("output_norm.weight", t["model.norm.weight"])
    if not cfg.get("tie_word_embeddings"):
        add("output.weight", t["lm_head.weight"])
    for i in range(cfg["num_hidden_layers"]):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        add(f"blk.{i}.attn_norm.weight", t[p + "input_layernorm.weight"])
        add(f"blk.{i}.ffn_norm.weight", t[p + "post_attention_layernorm.weight"])
        add(f"blk.{i}.attn_output.weight", t[a + "o_proj.weight"])
        if a + "q_proj.weight" in t:
            add(f"blk.{i}.attn_q.weight", t[a + "q_proj.weight"])
        else:
            add(f"blk.{i}.attn_q_a.weight", t[a + "q_a_proj.weight"])
            add(f"blk.{i}.attn_q_a_norm.weight", t[a + "q_a_layernorm.weight"])
            add(f"blk.{i}.attn_q_b.weight", t[a + "q_b_proj.weight"])
        add(f"blk.{i}.attn_kv_a_mqa.weight", t[a + "kv_a_proj_with_mqa.weight"])
        add(f"blk.{i}.attn_kv_a_norm.weight", t[a + "kv_a_layernorm.weight"])
        kv_b = t[a + "kv_b_proj.weight"]
        if split_kv_b:
            k_b, v_b = np.split(kv_b.reshape(heads, nope + v_dim, kv_lora), [nope], axis=1)
            add(f"blk.{i}.attn_k_b.weight", k_b.transpose(0, 2, 1))
            add(f"blk.{i}.attn_v_b.weight", v_b)
        else:
            add(f"blk.{i}.attn_kv_b.weight", kv_b)
        if p + "mlp.gate.weight" in t:
            write_experts(add, t, p, i, cfg["n_routed_experts"])
            if p + "mlp.gate.e_score_correction_bias" not in t:  # (V2: the shared experts, no correction biases)
                for x in ("gate", "up", "down"):
                    add(f"blk.{i}.ffn_{x}_shexp.weight", t[f"{p}mlp.shared_experts.{x}_proj.weight"])
        else:
            for x in ("gate", "up", "down"):
                add(f"blk.{i}.ffn_{x}.weight", t[f"{p}mlp.{x}_proj.weight"])
    close_gguf(w)


@pytest.mark.parametrize("family, split_kv_b", [("deepseek_v2", True), ("deepseek_v2", False), ("deepseek_v3", True),
                                                ("glm4_moe_lite", True)])
def test_a_deepseek2_gguf_reads_as_its_checkpoint(family, split_kv_b, tmp_path):
    """DeepSeek V2 (no query bottleneck, YaRN with its mscales, softmax routing scaled, shared experts), V3 (grouped
    sigmoid routing) and GLM-4.7-Flash as llama.cpp writes them (deepseek2), kv_b split for absorbed attention or
    whole as older files have it: the checkpoint's config and logits, past YaRN's original context."""
    import dataclasses

    from flared_testing.checkpoints import hf_last_logits, last_logits

    hf_dir = build_hf_checkpoint(family, tmp_path / "hf")
    write_deepseek2_gguf(hf_dir, tmp_path / "m.gguf", split_kv_b=split_kv_b)
    source, reference = read_source(tmp_path / "m.gguf"), read_source(hf_dir).config
    # (the file's float32 keys: epsilon, and the query scale from the log multiplier, within their rounding)
    assert math.isclose(source.config.rms_norm_eps, reference.rms_norm_eps, rel_tol=1e-6)
    assert math.isclose(source.config.attention_scale or 0, reference.attention_scale or 0, rel_tol=1e-6)
    assert dataclasses.replace(source.config, rms_norm_eps=reference.rms_norm_eps,
                               attention_scale=reference.attention_scale) == reference
    prompt = np.random.default_rng(6).integers(3, source.config.vocab_size, size=80).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(hf_dir, prompt)).abs().max().item() < 1e-4


def write_gemma4_gguf(hf_dir, path, extra=None) -> None:
    """A Gemma 4 checkpoint as llama.cpp's converter writes it (F32; gemma4): Gemma 3's keys with the global layers'
    head dim as key_length, the windowed ones' as key_length_swa, the window pattern a list of flags, kv heads a list
    where the global layers have their own, both rope bases, the proportional rope as rope_freqs, shared KV layers,
    per-layer input width and double-wide MLP widths; norms as they are; router.scale and per_expert_scale as the
    router's and the down experts' .scale."""
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    t = load_file(hf_dir / "model.safetensors")
    arch, layers = "gemma4", cfg["num_hidden_layers"]
    for overrides in (cfg.get("per_layer_config") or {}).values():  # (transformers' newer spelling of the released
        # checkpoints' global_head_dim and num_global_key_value_heads)
        cfg.setdefault("global_head_dim", overrides["head_dim"])
        cfg.setdefault("num_global_key_value_heads", overrides.get("num_key_value_heads", cfg["num_key_value_heads"]))
    swa = [kind == "sliding_attention" for kind in cfg["layer_types"]]
    rope = cfg["rope_parameters"]
    shared = cfg.get("num_kv_shared_layers") or 0
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", layers)
    w.add_uint32(f"{arch}.context_length", cfg["max_position_embeddings"])
    w.add_uint32(f"{arch}.embedding_length", cfg["hidden_size"])
    w.add_uint32(f"{arch}.attention.head_count", cfg["num_attention_heads"])
    w.add_float32(f"{arch}.rope.freq_base", rope["full_attention"]["rope_theta"])
    w.add_float32(f"{arch}.rope.freq_base_swa", rope["sliding_attention"]["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    if cfg.get("enable_moe_block"):
        w.add_uint32(f"{arch}.expert_count", cfg["num_experts"])
        w.add_uint32(f"{arch}.expert_used_count", cfg["top_k_experts"])
        w.add_uint32(f"{arch}.expert_feed_forward_length", cfg["moe_intermediate_size"])
    w.add_float32(f"{arch}.final_logit_softcapping", cfg["final_logit_softcapping"])
    w.add_uint32(f"{arch}.attention.sliding_window", cfg["sliding_window"])
    w.add_uint32(f"{arch}.attention.shared_kv_layers", shared)
    w.add_uint32(f"{arch}.embedding_length_per_layer_input", cfg.get("hidden_size_per_layer_input") or 0)
    w.add_array(f"{arch}.attention.sliding_window_pattern", swa)
    w.add_uint32(f"{arch}.attention.key_length", cfg["global_head_dim"])
    w.add_uint32(f"{arch}.attention.value_length", cfg["global_head_dim"])
    w.add_uint32(f"{arch}.attention.key_length_swa", cfg["head_dim"])
    w.add_uint32(f"{arch}.attention.value_length_swa", cfg["head_dim"])
    width = cfg["intermediate_size"]
    if cfg.get("use_double_wide_mlp"):
        w.add_array(f"{arch}.feed_forward_length", [width if i < layers - shared else 2 * width for i in range(layers)])
    else:
        w.add_uint32(f"{arch}.feed_forward_length", width)
    w.add_array(f"{arch}.attention.head_count_kv", [cfg["num_key_value_heads"] if s else
                                                    cfg["num_global_key_value_heads"] for s in swa])
    w.add_uint32(f"{arch}.rope.dimension_count", cfg["global_head_dim"])
    w.add_uint32(f"{arch}.rope.dimension_count_swa", int(cfg["head_dim"] * cfg.get("partial_rotary_factor", 1.0)))
    turned = int(cfg["global_head_dim"] * rope["full_attention"]["partial_rotary_factor"] / 2)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * turned + [1e30] * (cfg["global_head_dim"] // 2 - turned),
                                               dtype=np.float32))
    w.add_uint32(f"{arch}.vocab_size", cfg["vocab_size"])
    mapping = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, layers)
    for name, values in t.items():
        if name.endswith("router.scale"):
            out = name.replace("model.layers.", "blk.").replace(".router.scale", ".ffn_gate_inp.scale")
        elif name.endswith("router.per_expert_scale"):
            out = name.replace("model.layers.", "blk.").replace(".router.per_expert_scale", ".ffn_down_exps.scale")
        else:
            if name.endswith(("layer_scalar", "experts.gate_up_proj", "experts.down_proj")):
                name += ".weight"
            out = mapping.get_name(name, try_suffixes=(".weight", ".bias"))
        assert out is not None, name
        f32_tensors(w)(out, values)
    if extra is not None:  # (more keys: a tokenizer)
        extra(w)
    close_gguf(w)


@pytest.mark.parametrize("family", ["gemma4", "gemma4_values", "gemma4_e2b", "gemma4_moe"])
def test_a_gemma4_gguf_reads_as_its_checkpoint(family, tmp_path):
    """Gemma 4 (global layers of their own head geometry with keys as values or their own values, proportional rope,
    E2B's per-layer inputs, shared KV layers and double-wide MLPs, 26B-A4B's experts beside the MLP) as llama.cpp's
    converter writes it: the checkpoint's config and logits."""
    from flared_testing.checkpoints import hf_last_logits, last_logits

    hf_dir = build_hf_checkpoint(family, tmp_path / "hf")
    write_gemma4_gguf(hf_dir, tmp_path / "m.gguf")
    source, reference = read_source(tmp_path / "m.gguf"), read_source(hf_dir).config
    assert math.isclose(source.config.rms_norm_eps, reference.rms_norm_eps, rel_tol=1e-6)  # (a float32 key)
    assert dataclasses.replace(source.config, rms_norm_eps=reference.rms_norm_eps) == reference
    prompt = np.random.default_rng(8).integers(3, source.config.vocab_size, size=30).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(hf_dir, prompt)).abs().max().item() < 1e-4


def write_fused_qkv_gguf(hf_dir, path, arch: str) -> None:
    """GPT-2, StarCoder (GPT-BigCode with one KV head) and Falcon as llama.cpp's converter writes them: one attn_qkv
    (GPT-2's Conv1D weights transposed to a Linear's; Falcon's KV groups reordered to all queries, then the keys, then
    the values), GPT-2's and StarCoder's learned positions as position_embd, GPT-2's tied embeddings written out as
    output; F32 throughout."""
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    t = load_file(hf_dir / "model.safetensors")
    falcon = arch == "falcon"
    hidden = cfg.get("n_embd") or cfg["hidden_size"]
    heads = cfg.get("n_head") or cfg["num_attention_heads"]
    layers = cfg.get("n_layer") or cfg["num_hidden_layers"]
    d = hidden // heads
    if falcon:
        kv_heads = cfg["num_kv_heads"] if cfg.get("new_decoder_architecture") or not cfg.get("multi_query") else 1
        ffn = cfg.get("ffn_hidden_size") or 4 * hidden
    else:
        kv_heads = 1 if arch == "starcoder" else heads
        ffn = cfg.get("n_inner") or 4 * hidden
    w = gguf.GGUFWriter(str(path), arch)
    add = f32_tensors(w)
    w.add_uint32(f"{arch}.context_length", cfg.get("n_positions") or cfg["max_position_embeddings"])
    w.add_uint32(f"{arch}.embedding_length", hidden)
    w.add_uint32(f"{arch}.feed_forward_length", ffn)
    w.add_uint32(f"{arch}.block_count", layers)
    w.add_uint32(f"{arch}.attention.head_count", heads)
    if arch != "gpt2":
        w.add_uint32(f"{arch}.attention.head_count_kv", kv_heads)
    w.add_float32(f"{arch}.attention.layer_norm_epsilon", cfg["layer_norm_epsilon"])
    w.add_uint32(f"{arch}.vocab_size", cfg["vocab_size"])
    if falcon:
        w.add_float32(f"{arch}.rope.freq_base", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    top = "transformer."
    add("token_embd.weight", t[top + ("word_embeddings" if falcon else "wte") + ".weight"])
    if not falcon:
        add("position_embd.weight", t[top + "wpe.weight"])

    def linear(name):  # GPT-2's Conv1D [in, out] as a Linear's [out, in]
        return t[name].T if arch == "gpt2" and t[name].ndim == 2 else t[name]

    for i in range(layers):
        b, g = f"{top}h.{i}.", f"blk.{i}."
        if falcon:
            norms = {"attn_norm": "ln_attn" if b + "ln_attn.weight" in t else "input_layernorm", "attn_norm_2": "ln_mlp"}
            parts = {"attn_qkv": "self_attention.query_key_value", "attn_output": "self_attention.dense",
                     "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"}
        else:
            norms = {"attn_norm": "ln_1", "ffn_norm": "ln_2"}
            parts = {"attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_up": "mlp.c_fc",
                     "ffn_down": "mlp.c_proj"}
        for ours, theirs in norms.items():
            for x in ("weight", "bias"):
                if f"{b}{theirs}.{x}" in t:
                    add(f"{g}{ours}.{x}", t[f"{b}{theirs}.{x}"])
        for ours, theirs in parts.items():
            for x in ("weight", "bias"):
                if f"{b}{theirs}.{x}" not in t:
                    continue
                value = linear(f"{b}{theirs}.{x}")
                if falcon and ours == "attn_qkv":  # (llama.cpp: the groups' queries, then keys, then values)
                    groups = value.reshape(kv_heads, heads // kv_heads + 2, d, *value.shape[1:])
                    value = np.concatenate([groups[:, :-2].reshape(heads * d, *value.shape[1:]),
                                            groups[:, -2].reshape(kv_heads * d, *value.shape[1:]),
                                            groups[:, -1].reshape(kv_heads * d, *value.shape[1:])])
                add(f"{g}{ours}.{x}", value)
    for x in ("weight", "bias"):
        add(f"output_norm.{x}", t[f"{top}ln_f.{x}"])
    if "lm_head.weight" in t:
        add("output.weight", t["lm_head.weight"])
    elif arch == "gpt2":  # (its converter writes the tied embedding out)
        add("output.weight", t[top + "wte.weight"])
    close_gguf(w)


@pytest.mark.parametrize("family, arch", [("gpt2", "gpt2"), ("gpt_bigcode", "starcoder"), ("falcon", "falcon"),
                                          ("falcon_new", "falcon")])
def test_fused_qkv_ggufs_read_as_their_checkpoints(family, arch, tmp_path):
    """GPT-2, StarCoder and Falcon (7B's and 40B's layouts) GGUFs as llama.cpp's converter writes them: the
    checkpoint's logits; Falcon 7B's also as transformers' GGUF loader reads the same file (its GPT-2 reader sizes the
    vocabulary from a tokenizer these files do not carry)."""
    from flared_testing.checkpoints import hf_last_logits, last_logits
    from transformers import AutoModelForCausalLM

    hf_dir = build_hf_checkpoint(family, tmp_path / "hf")
    gguf_path = tmp_path / "m.gguf"
    write_fused_qkv_gguf(hf_dir, gguf_path, arch)
    source, reference = read_source(gguf_path), read_source(hf_dir).config
    for field in ("num_heads", "num_kv_heads", "head_dim", "attention_bias", "attention_out_bias", "layer_norm",
                  "norm_bias", "parallel_block", "parallel_norms", "mlp_gated", "mlp_bias", "hidden_act",
                  "position_embeddings", "nope_layers", "max_position_embeddings"):
        assert getattr(source.config, field) == getattr(reference, field), field
    prompt = np.random.default_rng(7).integers(3, source.config.vocab_size, size=30).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(hf_dir, prompt)).abs().max().item() < 1e-4
    if family == "falcon":
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf_path.name, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = theirs(torch.tensor([prompt])).logits[0, -1].float()
        assert (ours - logits).abs().max().item() < 1e-4


def test_a_phi2_gguf_reads_as_its_checkpoint(tmp_path):
    """Phi-2 as llama.cpp's converter writes it (phi2: q, k and v apart with their biases, rope.dimension_count the
    rotated part of a head, rows as released: its rope turns halves, no permutation; ffn_up / ffn_down, the LM head's
    bias as output.bias; no ffn_norm: one LayerNorm a layer): the checkpoint's config and logits."""
    from safetensors.numpy import load_file

    from flared_testing.checkpoints import hf_last_logits, last_logits

    hf_dir = build_hf_checkpoint("phi", tmp_path / "hf")
    cfg = json.loads((hf_dir / "config.json").read_text())
    t = load_file(hf_dir / "model.safetensors")
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    factor = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "phi2")
    add = f32_tensors(w)
    for key, value in (("context_length", cfg["max_position_embeddings"]), ("embedding_length", hidden),
                       ("feed_forward_length", cfg["intermediate_size"]), ("block_count", cfg["num_hidden_layers"]),
                       ("attention.head_count", heads), ("attention.head_count_kv", cfg["num_key_value_heads"]),
                       ("rope.dimension_count", int(factor * hidden) // heads), ("vocab_size", cfg["vocab_size"])):
        w.add_uint32(f"phi2.{key}", value)
    w.add_float32("phi2.attention.layer_norm_epsilon", cfg["layer_norm_eps"])
    add("token_embd.weight", t["model.embed_tokens.weight"])
    for i in range(cfg["num_hidden_layers"]):
        b, g = f"model.layers.{i}.", f"blk.{i}."
        for ours, theirs in (("attn_norm", "input_layernorm"), ("attn_q", "self_attn.q_proj"),
                             ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
                             ("attn_output", "self_attn.dense"), ("ffn_up", "mlp.fc1"), ("ffn_down", "mlp.fc2")):
            for x in ("weight", "bias"):
                add(f"{g}{ours}.{x}", t[f"{b}{theirs}.{x}"])
    for x in ("weight", "bias"):
        add(f"output_norm.{x}", t[f"model.final_layernorm.{x}"])
        add(f"output.{x}", t[f"lm_head.{x}"])
    close_gguf(w)
    source, reference = read_source(tmp_path / "m.gguf"), read_source(hf_dir).config
    for field in ("rotary_dim", "parallel_block", "layer_norm", "norm_bias", "mlp_bias", "mlp_gated", "hidden_act",
                  "lm_head_bias", "attention_bias", "attention_out_bias", "num_kv_heads"):
        assert getattr(source.config, field) == getattr(reference, field), field
    prompt = np.random.default_rng(8).integers(3, source.config.vocab_size, size=30).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(hf_dir, prompt)).abs().max().item() < 1e-4


def add_layer_tensors(add, t, block: str, gguf_block: str, names: dict, qkv_per_head=None) -> None:
    """Each (GGUF name, checkpoint name) of ``names`` the checkpoint ``t`` holds under ``block``, weight and bias, as
    ``gguf_block``'s; a fused attn_qkv of each head's q, k, v in turn (``qkv_per_head``: (heads, d)) reordered to
    the queries, then the keys, then the values, as llama.cpp's converter reorders BLOOM's and GPT-NeoX's."""
    for ours, theirs in names.items():
        for x in ("weight", "bias"):
            if f"{block}{theirs}.{x}" not in t:
                continue
            value = t[f"{block}{theirs}.{x}"]
            if ours == "attn_qkv" and qkv_per_head is not None:
                heads, d = qkv_per_head
                per_head = value.reshape(heads, 3, d, *value.shape[1:])
                value = np.concatenate([per_head[:, j].reshape(heads * d, *value.shape[1:]) for j in range(3)])
            add(f"{gguf_block}{ours}.{x}", value)


@pytest.mark.parametrize("family", ["bloom", "mpt"])
def test_alibi_ggufs_read_as_their_checkpoints(family, tmp_path):
    """BLOOM and MPT as llama.cpp's converter writes them: q, k and v as one attn_qkv (BLOOM's each head's q, k, v
    reordered to the queries, then the keys, then the values), BLOOM's embedding LayerNorm as token_embd_norm and its
    embeddings written out as output, MPT's clip_qkv and alibi_bias_max as clamp_kqv and max_alibi_bias: the
    checkpoint's config and logits; BLOOM's also as transformers' GGUF loader reads the file."""
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from flared_testing.checkpoints import hf_last_logits, last_logits

    hf_dir = build_hf_checkpoint(family, tmp_path / "hf")
    cfg = json.loads((hf_dir / "config.json").read_text())
    t = load_file(hf_dir / "model.safetensors")
    bloom = family == "bloom"
    hidden = cfg["hidden_size"] if bloom else cfg["d_model"]
    heads = cfg["n_head"] if bloom else cfg["n_heads"]
    layers = cfg["n_layer"] if bloom else cfg["n_layers"]
    d = hidden // heads
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), family)
    add = f32_tensors(w)
    for key, value in (("context_length", 2048 if bloom else cfg["max_seq_len"]), ("embedding_length", hidden),
                       ("feed_forward_length", 4 * hidden), ("block_count", layers), ("attention.head_count", heads),
                       ("attention.head_count_kv", heads), ("vocab_size", cfg["vocab_size"])):
        w.add_uint32(f"{family}.{key}", value)
    w.add_float32(f"{family}.attention.layer_norm_epsilon", cfg["layer_norm_epsilon"])
    if not bloom:
        w.add_float32("mpt.attention.clamp_kqv", cfg["attn_config"]["clip_qkv"])
        w.add_float32("mpt.attention.max_alibi_bias", cfg["attn_config"]["alibi_bias_max"])
    top = "transformer."
    add("token_embd.weight", t[top + ("word_embeddings" if bloom else "wte") + ".weight"])
    if bloom:
        for x in ("weight", "bias"):
            add(f"token_embd_norm.{x}", t[f"{top}word_embeddings_layernorm.{x}"])
    names = ({"attn_norm": "input_layernorm", "attn_qkv": "self_attention.query_key_value",
              "attn_output": "self_attention.dense", "ffn_norm": "post_attention_layernorm",
              "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"} if bloom else
             {"attn_norm": "norm_1", "attn_qkv": "attn.Wqkv", "attn_output": "attn.out_proj", "ffn_norm": "norm_2",
              "ffn_up": "ffn.up_proj", "ffn_down": "ffn.down_proj"})
    for i in range(layers):
        add_layer_tensors(add, t, f"{top}{'h' if bloom else 'blocks'}.{i}.", f"blk.{i}.", names,
                          (heads, d) if bloom else None)
    for x in ("weight", "bias"):
        if f"{top}{'ln_f' if bloom else 'norm_f'}.{x}" in t:
            add(f"output_norm.{x}", t[f"{top}{'ln_f' if bloom else 'norm_f'}.{x}"])
    if "lm_head.weight" in t:
        add("output.weight", t["lm_head.weight"])
    elif bloom:  # (its converter writes tied embeddings out)
        add("output.weight", t[top + "word_embeddings.weight"])
    close_gguf(w)
    source, reference = read_source(tmp_path / "m.gguf"), read_source(hf_dir).config
    for field in ("alibi_slopes", "embedding_layer_norm", "layer_norm", "norm_bias", "mlp_bias", "mlp_gated",
                  "hidden_act", "nope_layers", "attention_bias", "attention_out_bias", "num_heads"):
        assert getattr(source.config, field) == getattr(reference, field), field
    assert source.config.clip_qkv == pytest.approx(reference.clip_qkv, rel=1e-6)  # (a float32 key)
    prompt = np.random.default_rng(9).integers(3, source.config.vocab_size, size=30).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(hf_dir, prompt)).abs().max().item() < 1e-4
    if bloom:
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
        with torch.no_grad():
            logits = theirs(torch.tensor([prompt])).logits[0, -1].float()
        assert (ours - logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("family, arch", [("stablelm", "stablelm"), ("stablelm_12b", "stablelm"),
                                          ("gpt_neox", "gptneox")])
def test_partial_rotary_layer_norm_ggufs_read_as_their_checkpoints(family, arch, tmp_path):
    """StableLM and GPT-NeoX (Pythia) as llama.cpp's converter writes them: rope.dimension_count the rotated part of
    each head (halves: no permutation), biased LayerNorms; StableLM's q, k, v apart with their biases and a SwiGLU
    MLP; GPT-NeoX's query_key_value reordered from each head's q, k, v to the queries, keys, values (attn_qkv) and
    its parallel residual (use_parallel_residual); StableLM 2 12B's per-head q/k LayerNorms stacked [heads, d] as
    attn_q_norm / attn_k_norm and its parallel residual: the checkpoint's config and logits; StableLM's also as
    transformers' GGUF loader reads the file."""
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from flared_testing.checkpoints import hf_last_logits, last_logits

    hf_dir = build_hf_checkpoint(family, tmp_path / "hf")
    cfg = json.loads((hf_dir / "config.json").read_text())
    t = load_file(hf_dir / "model.safetensors")
    reference = read_source(hf_dir).config
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    d = hidden // heads
    neox = arch == "gptneox"
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch)
    add = f32_tensors(w)
    for key, value in (("context_length", cfg["max_position_embeddings"]), ("embedding_length", hidden),
                       ("feed_forward_length", cfg["intermediate_size"]), ("block_count", cfg["num_hidden_layers"]),
                       ("attention.head_count", heads), ("rope.dimension_count", reference.rotary_dim),
                       ("vocab_size", cfg["vocab_size"])):
        w.add_uint32(f"{arch}.{key}", value)
    if not neox:
        w.add_uint32(f"{arch}.attention.head_count_kv", cfg["num_key_value_heads"])
    w.add_float32(f"{arch}.attention.layer_norm_epsilon", cfg["layer_norm_eps"])
    w.add_bool(f"{arch}.use_parallel_residual", bool(cfg.get("use_parallel_residual", neox)))
    top = "gpt_neox." if neox else "model."
    add("token_embd.weight", t[top + ("embed_in" if neox else "embed_tokens") + ".weight"])
    names = ({"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
              "attn_qkv": "attention.query_key_value", "attn_output": "attention.dense", "ffn_up": "mlp.dense_h_to_4h",
              "ffn_down": "mlp.dense_4h_to_h"} if neox else
             {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
              "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
              "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"})
    for i in range(cfg["num_hidden_layers"]):
        b = f"{top}layers.{i}."
        add_layer_tensors(add, t, b, f"blk.{i}.", names, (heads, d) if neox else None)
        for x, count in (("q", heads), ("k", cfg["num_key_value_heads"])):  # (StableLM 2 12B's, stacked)
            if f"{b}self_attn.{x}_layernorm.norms.0.weight" in t:
                add(f"blk.{i}.attn_{x}_norm.weight",
                    np.stack([t[f"{b}self_attn.{x}_layernorm.norms.{h}.weight"] for h in range(count)]))
    final = "gpt_neox.final_layer_norm" if neox else "model.norm"
    for x in ("weight", "bias"):
        add(f"output_norm.{x}", t[f"{final}.{x}"])
    add("output.weight", t["embed_out.weight" if neox else "lm_head.weight"])
    close_gguf(w)
    source = read_source(tmp_path / "m.gguf")
    for field in ("rotary_dim", "layer_norm", "norm_bias", "parallel_block", "parallel_norms", "mlp_gated",
                  "mlp_bias", "hidden_act", "attention_bias", "attention_out_bias", "num_kv_heads", "qk_norm",
                  "qk_layer_norm_per_head"):
        assert getattr(source.config, field) == getattr(reference, field), field
    prompt = np.random.default_rng(10).integers(3, source.config.vocab_size, size=30).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(hf_dir, prompt)).abs().max().item() < 1e-4
    if family == "stablelm":
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
        with torch.no_grad():
            logits = theirs(torch.tensor([prompt])).logits[0, -1].float()
        assert (ours - logits).abs().max().item() < 1e-4


def test_a_minicpm_gguf_reads_as_llama_with_its_scales(tmp_path):
    """MiniCPM (1, 2, 4) as llama.cpp's converter writes it: Llama's tensors (q/k permuted) under the minicpm
    architecture, its muP scales as embedding_scale, residual_scale (scale_depth / sqrt(layers)) and logit_scale
    (hidden / dim_model_base, the logits divided by it): the Llama checkpoint's logits with those scales applied
    (Granite's multipliers, which tests/model/test_parity_hf.py holds to transformers)."""
    hf_dir = build_hf_checkpoint("llama_tied", tmp_path / "hf")
    write_gguf(hf_dir, tmp_path / "base.gguf", "llama", Q.F32)
    reader = gguf.GGUFReader(str(tmp_path / "base.gguf"))
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "minicpm")
    for field in reader.fields.values():
        if field.name.startswith("llama."):
            value = field.parts[field.data[0]]
            name = "minicpm." + field.name[len("llama."):]
            if field.types[0] == gguf.GGUFValueType.UINT32:
                w.add_uint32(name, int(value[0]))
            elif field.types[0] == gguf.GGUFValueType.FLOAT32:
                w.add_float32(name, float(value[0]))
    for key, value in (("embedding_scale", 3.0), ("residual_scale", 0.5), ("logit_scale", 2.0)):
        w.add_float32(f"minicpm.{key}", value)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data).reshape(tuple(int(d) for d in reversed(t.shape))), raw_dtype=t.tensor_type)
    close_gguf(w)
    source = read_source(tmp_path / "m.gguf")
    assert (source.config.embedding_multiplier, source.config.residual_multiplier, source.config.logits_scaling) == \
        (3.0, 0.5, 2.0) and source.config.attention_scale is None
    reference = read_source(hf_dir)
    expected = DecoderModel(dataclasses.replace(reference.config, embedding_multiplier=3.0, residual_multiplier=0.5,
                                                logits_scaling=2.0), reference.tensors)
    from flared_testing.checkpoints import last_logits

    prompt = np.random.default_rng(11).integers(3, source.config.vocab_size, size=30).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - last_logits(expected, prompt)).abs().max().item() < 1e-4
