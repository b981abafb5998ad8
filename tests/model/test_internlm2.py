"""InternLM2 / 2.5 (and InternVL2.5's decoders) from their own checkpoints (InternLM2ForCausalLM: remote code, so no
transformers class to hold them to): a Llama checkpoint laid out as InternLM2's (tok_embeddings, q/k/v fused into
wqkv a kv head's group at a time, as InternLM2's attention and llama.cpp's converter read it, wo, w1/w3/w2,
attention_norm / ffn_norm, output) reads as that Llama and gives transformers' Llama logits."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flared.errors import CoreError  # noqa: E402
from flared.model.decoder import DecoderModel  # noqa: E402
from flared.model.loader import read_source  # noqa: E402

from flared_testing.checkpoints import TINY_COMMON, hf_last_logits, last_logits  # noqa: E402


def _llama(directory):
    """A random-weight plain Llama (grouped kv heads, norms varied so each counts)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY_COMMON), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.2)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def _internlm2_layout(llama_dir, out, *, heads: int, kv_heads: int, head_dim: int, bias: bool = False):
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (llama_dir / name).exists():
            (out / name).write_bytes((llama_dir / name).read_bytes())
    cfg = json.loads((llama_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({
        "architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2", "bias": bias,
        "auto_map": {"AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM"},
        **{k: cfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                               "rms_norm_eps", "hidden_act", "tie_word_embeddings")},
        "rope_theta": cfg.get("rope_theta", 10000.0), "rope_scaling": {"type": "dynamic", "factor": 2.0}}))
    weights = load_file(llama_dir / "model.safetensors")
    renames = (("model.embed_tokens.", "model.tok_embeddings."), (".self_attn.o_proj.", ".attention.wo."),
               (".input_layernorm.", ".attention_norm."), (".post_attention_layernorm.", ".ffn_norm."),
               (".mlp.gate_proj.", ".feed_forward.w1."), (".mlp.up_proj.", ".feed_forward.w3."),
               (".mlp.down_proj.", ".feed_forward.w2."), ("lm_head.", "output."))
    group = heads // kv_heads
    out_weights = {}
    for name, value in weights.items():
        if ".self_attn.q_proj." in name:
            prefix = name.split("self_attn.")[0]
            q = value.view(kv_heads, group, head_dim, -1)
            k = weights[prefix + "self_attn.k_proj.weight"].view(kv_heads, 1, head_dim, -1)
            v = weights[prefix + "self_attn.v_proj.weight"].view(kv_heads, 1, head_dim, -1)
            out_weights[prefix + "attention.wqkv.weight"] = torch.cat([q, k, v], 1).reshape(-1, value.shape[-1])
            continue
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        out_weights[next((name.replace(a, b) for a, b in renames if a in name), name)] = value
    save_file(out_weights, out / "model.safetensors")
    return out


def test_an_internlm2_checkpoint_reads_as_its_llama(tmp_path):
    llama = _llama(tmp_path / "llama")
    cfg = json.loads((llama / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    assert heads > kv_heads  # (grouped: the wqkv layout's groups matter)
    internlm2 = _internlm2_layout(llama, tmp_path / "internlm2", heads=heads, kv_heads=kv_heads,
                                  head_dim=cfg["hidden_size"] // heads)
    ours, theirs = read_source(internlm2), read_source(llama)
    assert sorted(ours.tensors) == sorted(theirs.tensors)
    assert all(torch.equal(ours.tensors[k], v) for k, v in theirs.tensors.items())
    prompt = torch.randint(3, 500, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    got = last_logits(DecoderModel(ours.config, ours.tensors), prompt)
    assert (got - hf_last_logits(llama, prompt)).abs().max().item() < 1e-4


def test_internlm2_with_biases_is_refused(tmp_path):
    llama = _llama(tmp_path / "llama")
    cfg = json.loads((llama / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    internlm2 = _internlm2_layout(llama, tmp_path / "internlm2", heads=heads, kv_heads=kv_heads,
                                  head_dim=cfg["hidden_size"] // heads, bias=True)
    with pytest.raises(CoreError, match="bias"):
        read_source(internlm2)
