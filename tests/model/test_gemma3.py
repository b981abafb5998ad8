"""Gemma 3 (gemma3_text) beyond the shared parity tests (test_parity_hf.py runs the family's logits, greedy tokens,
embeddings and prompt logprobs against transformers): the torch decode-attention path's windows, bf16, the
config's round trip through a core's manifest, and a daemon serving an exported Gemma 3 core."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from .conftest import build_hf_checkpoint  # noqa: E402
from .test_parity_hf import make_prompts, run_paged_greedy  # noqa: E402


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    directory = build_hf_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3"))
    return directory, AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def test_torch_decode_path_keeps_each_layers_window(gemma3):
    """Decode rows through the gather + bmm path (another device's, or a pool the Cython kernel cannot read):
    the windowed layer's mask is its own, the global layer's the whole context."""
    from flared.model.decoder import DecoderModel
    from flared.model.loader import read_source

    directory, hf_model = gemma3
    source = read_source(directory)
    model = DecoderModel(source.config, source.tensors, dtype=torch.float32)
    model.cpu_decode_attention = False
    prompts = make_prompts(source.config.vocab_size, seed=3)
    for prompt, (out, logits) in zip(prompts, run_paged_greedy(model, prompts, num_new_tokens=20, page_tokens=4,
                                                               chunk_tokens=7)):
        with torch.no_grad():
            expected = hf_model(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1:]
        assert (expected - logits).abs().max().item() < 1e-4


def test_config_round_trips_and_old_manifests_still_load(gemma3):
    from flared.model.config import ModelConfig
    from flared.model.loader import read_source

    config = read_source(gemma3[0]).config
    assert config.architecture == "gemma3" and config.layer_windows == (8, 0) and not config.graph_capable
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    old = {k: v for k, v in config.to_dict().items() if k not in ("embed_scale", "hidden_act", "sandwich_norm",
                                                                   "attention_scale", "layer_windows",
                                                                   "local_rope_theta")}
    old["architecture"] = "llama"
    assert ModelConfig.from_dict(old).hidden_act == "silu"  # a core written before these fields


def test_a_gemma3_core_serves_transformers_tokens(gemma3, tmp_path):
    """Exported with a chat template and served by flared run: greedy chat tokens equal transformers'
    generate on the same prompt ids."""
    from flared_testing.served import assert_served_greedy_equals_transformers

    directory, hf_model = gemma3
    assert_served_greedy_equals_transformers(directory, hf_model, tmp_path)


def test_a_vision_checkpoint_serves_its_text_model(tmp_path):
    """Gemma 3 4B and up ship as gemma3 (vision-language) checkpoints: export reads their text model and their
    image tower (tests/api/test_vision_gemma3.py serves images), and the text model's logits are transformers' on
    text."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from flared.model.decoder import DecoderModel
    from flared.model.loader import read_source

    text = dict(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=8, initializer_range=0.2,
                layer_types=["sliding_attention", "full_attention"])
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=64,
                  patch_size=8)
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                                     image_token_index=300, boi_token_index=301,
                                                     eoi_token_index=302)).eval()
    hf.save_pretrained(tmp_path)
    source = read_source(tmp_path)
    assert source.config.architecture == "gemma3" and source.vision.family == "gemma3"
    assert source.vision.image_seq_len == 4 and source.vision.image_token_id == 300
    model = DecoderModel(source.config, source.tensors, dtype=torch.float32)
    prompts = make_prompts(400, seed=5)[:2]
    for prompt, (out, logits) in zip(prompts, run_paged_greedy(model, prompts, num_new_tokens=12, page_tokens=4,
                                                               chunk_tokens=5)):
        with torch.no_grad():
            expected = hf(input_ids=torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1:]
        assert (expected - logits).abs().max().item() < 1e-4


def test_a_gemma3_gguf_reads_as_llama_cpp_writes_it(tmp_path):
    """A Gemma 3 GGUF as llama.cpp's converter writes one (norms as 1 + w, post_attention_norm / post_ffw_norm,
    every sixth layer global, no q/k permutation): its logits are the original checkpoint's. The GGUF carries no
    query_pre_attn_scalar: llama.cpp takes head_dim (what the released models use, 27B aside), as the checkpoint
    here does."""
    from gguf import GGMLQuantizationType as Q
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from flared.model.decoder import DecoderModel
    from flared.model.loader import read_source

    from .test_gguf_families import write_gguf
    from flared_testing.checkpoints import hf_last_logits, last_logits

    config = Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                              initializer_range=0.2, max_position_embeddings=256, query_pre_attn_scalar=16)
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(tmp_path / "hf")
    write_gguf(tmp_path / "hf", tmp_path / "g.gguf", "gemma3", Q.F32)
    source = read_source(tmp_path / "g.gguf")
    assert source.config.layer_windows == (8, 8, 8, 8, 8, 0) and source.config.tie_word_embeddings
    prompt = np.random.default_rng(3).integers(0, 300, size=21).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(tmp_path / "hf", prompt)).abs().max().item() < 1e-4
