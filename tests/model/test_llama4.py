"""Llama 4 (Scout, Maverick) text model: chunked attention on the rotated layers, weightless q/k norms after rope,
temperature-tuned queries on the unrotated layers, and experts fed their rows times sigmoid(logit). The random-weight
checkpoint's paged forward and greedy tokens are in test_parity_hf (family "llama4"); here, what that leaves out."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from flared.errors import CoreError
from flared.model.decoder import DecoderModel
from flared.model.loader import read_source

from .test_parity_hf import make_prompts, run_paged_greedy


def test_a_vision_checkpoint_serves_its_text_model(tmp_path):
    """Llama 4 ships as llama4 (vision-language) checkpoints, the decoder under language_model.: export reads its
    text model apart from its tower (tests/api/test_vision_llama4.py serves its images), and its logits are
    transformers' on text, across chunk boundaries."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    text = dict(vocab_size=400, hidden_size=64, intermediate_size=32, intermediate_size_mlp=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.2,
                num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1, attention_chunk_size=6,
                floor_scale=5, attn_scale=0.3, rms_norm_eps=1e-6)
    vision = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8, vision_output_dim=64, projector_input_dim=64, projector_output_dim=64)
    torch.manual_seed(0)
    hf = Llama4ForConditionalGeneration(Llama4Config(text_config=text, vision_config=vision,
                                                     image_token_index=399)).eval()
    with torch.no_grad():  # (norms start as ones: vary them, so each counts)
        for name, param in hf.named_parameters():
            if "norm" in name and param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    hf.save_pretrained(tmp_path)
    source = read_source(tmp_path)
    c = source.config
    assert (c.chunked_layers, c.nope_layers, c.attention_chunk_size, c.dense_layers) == ((0, 1, 2), (3,), 6, ())
    assert c.router_input_scale and c.qk_l2_norm and (c.nope_temperature_scale, c.nope_temperature_floor) == (0.3, 5)
    assert source.vision.family == "llama4" and not any("vision" in name for name in source.tensors)
    model = DecoderModel(c, source.tensors, dtype=torch.float32)
    prompts = make_prompts(400, seed=5)[:3]
    for prompt, (out, logits) in zip(prompts, run_paged_greedy(model, prompts, num_new_tokens=12, page_tokens=4,
                                                               chunk_tokens=5)):
        with torch.no_grad():
            expected = hf(input_ids=torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1:]
        assert (expected - logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("change, message", [
    (dict(chunked_layers=(0,), attention_chunk_size=0), "go together"),
    (dict(nope_temperature_scale=0.5, nope_temperature_floor=0), "go together"),
    (dict(router_input_scale=True, num_experts=0, experts_per_token=0, expert_intermediate_size=0),
     "router_input_scale"),
])
def test_inconsistent_llama4_fields_are_refused(tmp_path, change, message):
    """A core's config with Llama 4's fields half set is refused by name, not run wrongly."""
    from flared_testing.checkpoints import build_hf_checkpoint

    config = read_source(build_hf_checkpoint("llama3", tmp_path)).config
    with pytest.raises(CoreError, match=message):
        dataclasses.replace(config, **change)


def test_the_config_round_trips_through_a_core(tmp_path):
    """The new fields survive to_dict / from_dict (a core's model config), tuples as lists."""
    from flared.model.config import ModelConfig
    from flared_testing.checkpoints import build_hf_checkpoint

    config = read_source(build_hf_checkpoint("llama4", tmp_path)).config
    assert ModelConfig.from_dict(config.to_dict()) == config
    assert config.to_dict()["chunked_layers"] == [0, 1, 2]


def test_decode_rows_see_only_their_chunk(tmp_path):
    """A decode row past a chunk boundary (position 18, chunks of 8) attends only to its chunk's keys on the chunked
    layers, through the paged cache: its logits equal the whole sequence's forward at once, and full attention's
    differ."""
    from flared.model.batch import ForwardBatch, SequenceChunk
    from flared_testing.checkpoints import build_hf_checkpoint, last_logits

    source = read_source(build_hf_checkpoint("llama4", tmp_path))
    model = DecoderModel(source.config, source.tensors)
    prompt = np.random.default_rng(2).integers(3, 512, size=19).tolist()
    pages = [5, 0, 3, 1, 4]
    kv = model.make_kv_cache(num_pages=8, page_tokens=4)
    model.forward(ForwardBatch.build([SequenceChunk(prompt[:18], 0, pages, needs_logits=False)], page_tokens=4), kv)
    batch = ForwardBatch.build([SequenceChunk(prompt[18:], 18, pages)], page_tokens=4)
    assert batch.decode_row_ids is not None  # (a decode row: the decode masks)
    decoded = model.forward(batch, kv)[0]
    assert (decoded - last_logits(model, prompt)).abs().max().item() < 1e-4
    unchunked = DecoderModel(dataclasses.replace(source.config, chunked_layers=(), attention_chunk_size=0),
                             source.tensors)
    assert (last_logits(unchunked, prompt) - decoded).abs().max().item() > 1e-2


def test_a_llama4_core_serves_transformers_tokens(tmp_path):
    """Exported and served by flared run: greedy chat tokens equal transformers' (the chat prompt crosses the chunk
    boundaries and the temperature floor of the fixture)."""
    from transformers import AutoModelForCausalLM

    from flared_testing.checkpoints import build_hf_checkpoint
    from flared_testing.served import assert_served_greedy_equals_transformers

    directory = build_hf_checkpoint("llama4", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    assert_served_greedy_equals_transformers(directory, hf, tmp_path)


def write_llama4_gguf(hf_dir, path, extra=None) -> None:
    """A Llama 4 checkpoint as llama.cpp's converter writes it (F32; llama4): feed_forward_length the dense MLP's
    (intermediate_size_mlp), expert_feed_forward_length and interleave_moe_layer_step; q/k rows as released; the
    experts' gate_up split and transposed to [E, I, H] stacks, down to [E, H, I]; the shared expert as *_shexp.
    ``extra(w)``, where given, adds keys of its own (a tokenizer)."""
    import json

    import gguf
    from safetensors.numpy import load_file

    from .test_gguf_families import close_gguf, f32_tensors

    cfg = json.loads((hf_dir / "config.json").read_text())
    t = load_file(hf_dir / "model.safetensors")
    arch, inter = "llama4", cfg["intermediate_size"]
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("context_length", cfg["max_position_embeddings"]), ("embedding_length", cfg["hidden_size"]),
                       ("block_count", cfg["num_hidden_layers"]), ("feed_forward_length", cfg["intermediate_size_mlp"]),
                       ("attention.head_count", cfg["num_attention_heads"]),
                       ("attention.head_count_kv", cfg["num_key_value_heads"]),
                       ("attention.key_length", cfg["head_dim"]), ("attention.value_length", cfg["head_dim"]),
                       ("rope.dimension_count", cfg["head_dim"]), ("vocab_size", cfg["vocab_size"]),
                       ("expert_count", cfg["num_local_experts"]), ("expert_used_count", cfg["num_experts_per_tok"]),
                       ("expert_feed_forward_length", inter),
                       ("interleave_moe_layer_step", cfg["interleave_moe_layer_step"])):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", cfg["rope_parameters"]["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])

    add = f32_tensors(w)

    add("token_embd.weight", t["model.embed_tokens.weight"])
    add("output_norm.weight", t["model.norm.weight"])
    add("output.weight", t["lm_head.weight"])
    for i in range(cfg["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
            add(f"{b}{ours}.weight", t[f"{p}self_attn.{theirs}.weight"])
        add(b + "attn_norm.weight", t[p + "input_layernorm.weight"])
        add(b + "ffn_norm.weight", t[p + "post_attention_layernorm.weight"])
        ff = p + "feed_forward."
        if ff + "router.weight" in t:
            add(b + "ffn_gate_inp.weight", t[ff + "router.weight"])
            gate_up = t[ff + "experts.gate_up_proj"].transpose(0, 2, 1)  # [E, 2 I, H]
            add(b + "ffn_gate_exps.weight", gate_up[:, :inter])
            add(b + "ffn_up_exps.weight", gate_up[:, inter:])
            add(b + "ffn_down_exps.weight", t[ff + "experts.down_proj"].transpose(0, 2, 1))
            for x in ("gate", "up", "down"):
                add(f"{b}ffn_{x}_shexp.weight", t[f"{ff}shared_expert.{x}_proj.weight"])
        else:
            for x in ("gate", "up", "down"):
                add(f"{b}ffn_{x}.weight", t[f"{ff}{x}_proj.weight"])
    if extra is not None:
        extra(w)
    close_gguf(w)


def test_a_llama4_gguf_reads_as_its_checkpoint(tmp_path):
    """A Llama 4 GGUF (llama4), which carries none of its chunking, unrotated layers or temperature: read with the
    values llama.cpp assumes (8192-token chunks, every fourth layer unrotated, 0.1 and 8192), the checkpoint of those
    values' config and logits."""
    import json

    from flared_testing.checkpoints import build_hf_checkpoint, hf_last_logits, last_logits

    hf_dir = build_hf_checkpoint("llama4", tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    config.update(attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1,
                  layer_types=["chunked_attention"] * 3 + ["full_attention"])
    (hf_dir / "config.json").write_text(json.dumps(config))
    write_llama4_gguf(hf_dir, tmp_path / "m.gguf")
    source, reference = read_source(tmp_path / "m.gguf"), read_source(hf_dir).config
    assert dataclasses.replace(source.config, rms_norm_eps=reference.rms_norm_eps,
                               max_position_embeddings=reference.max_position_embeddings) == reference
    prompt = np.random.default_rng(6).integers(3, source.config.vocab_size, size=30).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(hf_dir, prompt)).abs().max().item() < 1e-4
