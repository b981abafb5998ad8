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
    text model (the tower is not read), and its logits are transformers' on text, across chunk boundaries."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    text = dict(vocab_size=400, hidden_size=64, intermediate_size=32, intermediate_size_mlp=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.2,
                num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1, attention_chunk_size=6,
                floor_scale=5, attn_scale=0.3, rms_norm_eps=1e-6)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8, vision_output_dim=32, projector_input_dim=32, projector_output_dim=64)
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
    assert source.vision is None and not any("vision" in name for name in source.tensors)
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
