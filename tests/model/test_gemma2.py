"""Gemma 2 beyond the shared parity tests (test_parity_hf.py runs the family's logits, greedy tokens, embeddings and
prompt logprobs against transformers, with caps low enough to bite): a GGUF as llama.cpp writes one, bf16, and the
config's round trip."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from flared.model.config import ModelConfig  # noqa: E402
from flared.model.decoder import DecoderModel  # noqa: E402
from flared.model.loader import read_source  # noqa: E402

from .conftest import build_hf_checkpoint  # noqa: E402
from .test_gguf_families import write_gguf  # noqa: E402
from flared_testing.checkpoints import hf_last_logits, last_logits  # noqa: E402


def test_a_gguf_reads_as_its_checkpoint(tmp_path):
    """general.architecture gemma2: norms as 1 + w, the even layers windowed, the soft caps from the file, no q/k
    permutation; query_pre_attn_scalar is not in the file (llama.cpp takes head_dim), so the checkpoint uses it."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    config = Gemma2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                          query_pre_attn_scalar=16, attn_logit_softcapping=5.0, final_logit_softcapping=8.0,
                          initializer_range=0.2, max_position_embeddings=256)
    torch.manual_seed(2)
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(tmp_path / "hf")
    write_gguf(tmp_path / "hf", tmp_path / "m.gguf", "gemma2", Q.F32)
    source, reference = read_source(tmp_path / "m.gguf"), read_source(tmp_path / "hf")
    for name in ("layer_windows", "attn_logit_softcapping", "final_logit_softcapping", "attention_scale", "qk_norm"):
        assert getattr(source.config, name) == getattr(reference.config, name), name
    assert source.config.layer_windows == (8, 0, 8, 0)
    prompt = torch.randint(0, 300, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(tmp_path / "hf", prompt)).abs().max().item() < 1e-4


def test_config_round_trips(tmp_path):
    config = read_source(build_hf_checkpoint("gemma2", tmp_path)).config
    assert config.architecture == "gemma2" and not config.qk_norm and config.local_rope_theta is None
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (5.0, 8.0)
    assert not config.graph_capable
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
