"""OLMo Hybrid beyond the shared parity tests (test_parity_hf.py's "olmo_hybrid": Gated DeltaNet with beta up to 2
beside OLMo 3's post-norm attention, rotated): the released checkpoints' unrotated attention (rope_theta null), and a
served core's greedy tokens."""

from __future__ import annotations

import json

import numpy as np
import torch

from flared.model.decoder import DecoderModel
from flared.model.loader import read_source

from .conftest import build_hf_checkpoint


def test_a_null_rope_theta_leaves_attention_unrotated(tmp_path):
    from flared_testing.checkpoints import hf_last_logits, last_logits

    directory = build_hf_checkpoint("olmo_hybrid", tmp_path / "hf")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "rope_parameters": {"rope_type": "default",
                                                                                       "rope_theta": None}}))
    source = read_source(directory)
    assert source.config.nope_layers == source.config.post_norm_layers == (3,)
    assert source.config.linear_neg_eigval and source.config.linear_norm_eps == 1e-5
    prompt = np.random.default_rng(4).integers(3, source.config.vocab_size, size=40).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(directory, prompt)).abs().max().item() < 1e-4


def test_an_olmo_hybrid_core_serves_transformers_tokens(tmp_path):
    from transformers import AutoModelForCausalLM

    from flared_testing.served import assert_served_greedy_equals_transformers

    directory = build_hf_checkpoint("olmo_hybrid", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    assert_served_greedy_equals_transformers(directory, hf, tmp_path)
