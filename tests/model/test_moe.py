"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE) beyond the shared parity tests (test_parity_hf.py runs
each family's logits, greedy tokens, embeddings and prompt logprobs against transformers): GGUF files as llama.cpp's
converter writes them, transformers 5's stacked expert layout, bf16, the manifest round trip, what adapters may
target, and a daemon serving an exported core."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from flared.errors import CoreError, ErrorKind  # noqa: E402
from flared.model.config import ModelConfig  # noqa: E402
from flared.model.decoder import DecoderModel  # noqa: E402
from flared.model.loader import read_source  # noqa: E402

from flared_testing.checkpoints import hf_last_logits, last_logits  # noqa: E402

from .conftest import build_hf_checkpoint  # noqa: E402
from .test_gguf_families import write_gguf  # noqa: E402
from .test_lora import write_adapter  # noqa: E402
from .test_parity_hf import make_prompts, run_paged_greedy  # noqa: E402

EXPERT_FIELDS = ("num_experts", "experts_per_token", "expert_intermediate_size", "norm_topk_prob",
                 "shared_expert_intermediate_size")


@pytest.mark.parametrize("family,arch,matrices", [("mixtral", "llama", Q.F32), ("qwen2_moe", "qwen2moe", Q.F32),
                                                  ("qwen3_moe", "qwen3moe", Q.F32), ("qwen3_moe", "qwen3moe", Q.Q8_0)])
def test_a_gguf_reads_as_its_checkpoint(family, arch, matrices, tmp_path):
    """llama.cpp's layout: the router (ffn_gate_inp), each projection's experts stacked (ffn_*_exps), Qwen2-MoE's
    shared expert and its gate (*_shexp), expert_count / expert_used_count / expert_feed_forward_length; Mixtral
    as a llama file (q/k rows permuted). Whether the chosen weights are renormalised follows llama.cpp's per-
    architecture rule. F32: the original checkpoint's logits; Q8_0 (quantised expert stacks): its greedy token."""
    hf_dir = build_hf_checkpoint(family, tmp_path / "hf")
    write_gguf(hf_dir, tmp_path / "m.gguf", arch, matrices)
    source, reference = read_source(tmp_path / "m.gguf"), read_source(hf_dir)
    for field in EXPERT_FIELDS + ("architecture", "attention_bias", "qk_norm"):
        assert getattr(source.config, field) == getattr(reference.config, field), field
    prompt = torch.randint(0, source.config.vocab_size, (20,), generator=torch.Generator().manual_seed(7)).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    expected = hf_last_logits(hf_dir, prompt)
    if matrices == Q.F32:
        assert (ours - expected).abs().max().item() < 1e-4
    else:
        assert ours.argmax() == expected.argmax() and (ours - expected).abs().max().item() < 0.1


def test_the_stacked_expert_layout_reads_as_the_per_expert_one(tmp_path):
    """transformers 5 holds each layer's experts as two stacked tensors (experts.gate_up_proj, experts.down_proj);
    a checkpoint written in that layout serves the same weights as the released per-expert one."""
    from safetensors.torch import save_file

    per_expert = build_hf_checkpoint("qwen2_moe", tmp_path / "a")
    hf = transformers.AutoModelForCausalLM.from_pretrained(per_expert, dtype=torch.float32)
    stacked = tmp_path / "b"
    stacked.mkdir()
    (stacked / "config.json").write_text((per_expert / "config.json").read_text())
    state = hf.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file({k: v.contiguous() for k, v in state.items()}, str(stacked / "model.safetensors"))
    a, b = read_source(per_expert), read_source(stacked)
    assert a.tensors.keys() == b.tensors.keys()
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


def test_config_round_trips_and_checks_its_experts(tmp_path):
    config = read_source(build_hf_checkpoint("qwen2_moe", tmp_path)).config
    assert (config.num_experts, config.experts_per_token, config.expert_intermediate_size,
            config.shared_expert_intermediate_size, config.norm_topk_prob) == (8, 2, 32, 48, False)
    assert not config.graph_capable  # the CUDA graphs' kernels have no routed MLP: a GPU host serves it on the CPU
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    old = {k: v for k, v in config.to_dict().items() if k not in EXPERT_FIELDS}
    assert ModelConfig.from_dict(old).num_experts == 0  # a core written before these fields
    for bad in (dict(experts_per_token=9), dict(experts_per_token=0), dict(expert_intermediate_size=0),
                dict(num_experts=-1)):
        with pytest.raises(CoreError):
            dataclasses.replace(config, **bad)
    with pytest.raises(CoreError, match="need num_experts"):
        dataclasses.replace(config, num_experts=0)


@pytest.mark.parametrize("change", [{"mlp_only_layers": [1]}, {"decoder_sparse_step": 2}])
def test_dense_layers_among_expert_layers_are_served(change, tmp_path):
    """Qwen-MoE's mlp_only_layers and decoder_sparse_step make some layers dense (intermediate_size): those layers take
    the dense MLP, the others their experts, as transformers computes them."""
    import json

    from flared_testing.checkpoints import FAMILIES, build_hf_checkpoint, hf_last_logits, last_logits

    model_type, extra = FAMILIES["qwen3_moe"]
    FAMILIES["qwen3_moe_dense"] = (model_type, {**extra, "num_hidden_layers": 4, **change})
    try:
        directory = build_hf_checkpoint("qwen3_moe_dense", tmp_path / "hf")
    finally:
        del FAMILIES["qwen3_moe_dense"]
    source = read_source(directory)
    assert source.config.dense_layers == ((1,) if "mlp_only_layers" in change else (0, 2))
    dense = source.config.dense_layers[0]
    assert f"layers.{dense}.gate_up.weight" in source.tensors and f"layers.{dense}.router.weight" not in source.tensors
    assert json.loads(json.dumps(source.config.to_dict()))["dense_layers"] == list(source.config.dense_layers)
    prompt = torch.randint(3, 500, (24,), generator=torch.Generator().manual_seed(7)).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(directory, prompt)).abs().max().item() < 1e-4


def test_adapters_reach_attention_not_experts(tmp_path):
    from flared.model.lora import LoraAdapter, merge_adapters

    directory = build_hf_checkpoint("mixtral", tmp_path / "hf")
    source = read_source(directory)
    q = ("model.layers.0.self_attn.q_proj", (64, 64, False))
    write_adapter(tmp_path / "attn", dict([q]))
    tensors = dict(source.tensors)
    before = tensors["layers.0.qkv.weight"].clone()
    merge_adapters(tensors, source.config, [LoraAdapter(tmp_path / "attn")])
    assert not torch.equal(tensors["layers.0.qkv.weight"][:64], before[:64])
    assert torch.equal(tensors["layers.0.qkv.weight"][64:], before[64:])
    write_adapter(tmp_path / "expert", {"model.layers.0.block_sparse_moe.experts.1.w1": (64, 48, False)})
    with pytest.raises(CoreError, match="mixture-of-experts MLP") as info:
        merge_adapters(dict(source.tensors), source.config, [LoraAdapter(tmp_path / "expert")])
    assert info.value.kind == ErrorKind.UNSUPPORTED_MODEL


def test_chunked_batches_route_each_row_alone(tmp_path):
    """Rows of different sequences, prefill chunks and decode rows in one batch: each token's experts are its own,
    so the batch's logits are each sequence's run alone (the routing groups rows by expert across the batch)."""
    source = read_source(build_hf_checkpoint("qwen3_moe", tmp_path))
    model = DecoderModel(source.config, source.tensors)
    prompts = make_prompts(source.config.vocab_size, seed=9)
    together = run_paged_greedy(model, prompts, num_new_tokens=6, page_tokens=4, chunk_tokens=5)
    for prompt, (out, logits) in zip(prompts, together):
        alone_out, alone_logits = run_paged_greedy(model, [prompt], num_new_tokens=6, page_tokens=4, chunk_tokens=5)[0]
        assert out == alone_out and (logits - alone_logits).abs().max().item() < 1e-5


def test_a_moe_core_serves_transformers_tokens(tmp_path):
    """Qwen2-MoE (routed experts and the gated shared expert) exported and served by flared run: greedy chat tokens
    equal transformers' generate on the same prompt ids."""
    from flared_testing.served import assert_served_greedy_equals_transformers

    directory = build_hf_checkpoint("qwen2_moe", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()

    def shows_its_experts(daemon):  # Ollama's /api/show names them as llama.cpp does
        status, body = daemon.request("POST", "/api/show", {"model": "tiny"})
        assert status == 200, body
        assert body["model_info"]["qwen2.expert_count"] == 8 and body["model_info"]["qwen2.expert_used_count"] == 2

    assert_served_greedy_equals_transformers(directory, hf, tmp_path, also=shows_its_experts)


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "gpt_oss", "glm4_moe", "deepseek_v2", "minimax_m2"])
def test_grouped_expert_products_equal_the_loop(family, tmp_path):
    """The grouped path (every expert's rows in two grouped products, no host sync: a GPU's in bf16, the CPU's in
    float32) against the loop over experts: the same logits, prefill chunks and decode rows mixed."""
    from flared.model import decoder

    if not decoder._CPU_GROUPED_MM:
        pytest.skip("this torch has no grouped_mm on the CPU")
    source = read_source(build_hf_checkpoint(family, tmp_path))
    model = DecoderModel(source.config, source.tensors)
    assert model.grouped_experts  # (float32 on the CPU)
    assert not DecoderModel(source.config, source.tensors, dtype=torch.bfloat16).grouped_experts  # (packed kernels)
    prompts = make_prompts(source.config.vocab_size, seed=11)
    grouped = run_paged_greedy(model, prompts, num_new_tokens=8, page_tokens=4, chunk_tokens=5)
    model.grouped_experts = False
    loop = run_paged_greedy(model, prompts, num_new_tokens=8, page_tokens=4, chunk_tokens=5)
    for (out_a, logits_a), (out_b, logits_b) in zip(loop, grouped):
        assert out_a == out_b and (logits_a - logits_b).abs().max().item() < 1e-4
