"""OLMo 2 and OLMo 3 beyond the shared parity tests (test_parity_hf.py runs both families' logits, greedy tokens,
embeddings and prompt logprobs against transformers): an OLMo 2 GGUF as llama.cpp writes one, and the config's
round trip."""

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


def test_an_olmo2_gguf_reads_as_its_checkpoint(tmp_path):
    """general.architecture olmo2: post_attention_norm and post_ffw_norm, no attn_norm / ffn_norm, q/k norms of
    [heads * head_dim], no q/k permutation."""
    hf_dir = build_hf_checkpoint("olmo2", tmp_path / "hf")
    write_gguf(hf_dir, tmp_path / "m.gguf", "olmo2", Q.F32)
    source = read_source(tmp_path / "m.gguf")
    reference = read_source(hf_dir).config
    for name in ("architecture", "pre_norm", "qk_norm", "qk_norm_whole", "sandwich_norm", "attention_bias"):
        assert getattr(source.config, name) == getattr(reference, name), name
    prompt = torch.randint(0, source.config.vocab_size, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(hf_dir, prompt)).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["olmo2", "olmo3"])
def test_config_round_trips(family, tmp_path):
    config = read_source(build_hf_checkpoint(family, tmp_path)).config
    assert config.architecture == "olmo2" and not config.pre_norm and config.qk_norm_whole and config.sandwich_norm
    assert not config.graph_capable
    if family == "olmo3":
        assert config.layer_windows == (8, 8, 8, 0) and config.rope_scaling["rope_type"] == "yarn"
        assert config.local_rope_theta == 10000.0 and config.rope_theta == 50000.0
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
