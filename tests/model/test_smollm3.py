"""SmolLM3 beyond the shared parity tests (test_parity_hf.py runs its logits, greedy tokens, embeddings and prompt
logprobs against transformers): its unrotated layers from a GGUF as llama.cpp writes one, and the config's round
trip through a core's manifest."""

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
    """general.architecture smollm3 (q/k rows permuted as for Llama, no key for the unrotated layers: llama.cpp
    takes every fourth): the checkpoint's logits."""
    hf_dir = build_hf_checkpoint("smollm3", tmp_path / "hf")
    write_gguf(hf_dir, tmp_path / "m.gguf", "smollm3", Q.F32)
    source = read_source(tmp_path / "m.gguf")
    assert source.config.nope_layers == read_source(hf_dir).config.nope_layers == (3,)
    prompt = torch.randint(0, source.config.vocab_size, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(hf_dir, prompt)).abs().max().item() < 1e-4


def test_config_round_trips(tmp_path):
    config = read_source(build_hf_checkpoint("smollm3", tmp_path)).config
    assert config.architecture == "llama" and config.nope_layers == (3,) and not config.graph_capable
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    for bad in ((4,), (2, 1), (1, 1)):
        with pytest.raises(Exception, match="nope_layers"):
            ModelConfig.from_dict({**config.to_dict(), "nope_layers": list(bad)})
