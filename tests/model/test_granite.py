"""IBM Granite 3 and 4.0 beyond the shared parity tests (test_parity_hf.py runs the granite and granite4 families
against transformers): its multipliers from a GGUF as llama.cpp writes one, the config's round trip through a core's
manifest, Granite 4.0 without rope, and its hybrids refused."""

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

MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "logits_scaling", "attention_scale")


def test_a_gguf_reads_as_its_checkpoint(tmp_path):
    hf_dir = build_hf_checkpoint("granite", tmp_path / "hf")
    write_gguf(hf_dir, tmp_path / "m.gguf", "granite", Q.F32)
    source, reference = read_source(tmp_path / "m.gguf"), read_source(hf_dir)
    for name in MULTIPLIERS:
        assert getattr(source.config, name) == pytest.approx(getattr(reference.config, name)), name
    prompt = torch.randint(0, source.config.vocab_size, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(hf_dir, prompt)).abs().max().item() < 1e-4


def test_config_round_trips(tmp_path):
    config = read_source(build_hf_checkpoint("granite", tmp_path)).config
    assert (config.embedding_multiplier, config.residual_multiplier, config.logits_scaling,
            config.attention_scale) == (6.0, 0.4, 3.0, 0.09)
    assert not config.graph_capable  # the CUDA graphs' kernels have no multipliers: the eager executor serves it
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_granite_4_without_rope_turns_no_layer(tmp_path):
    """Granite 4.0's position_embedding_type other than rope: every layer unrotated, as transformers runs it (the
    granite4 family in test_parity_hf.py is the rope one)."""
    hf_dir = build_hf_checkpoint("granite4", tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    config["position_embedding_type"] = None
    (hf_dir / "config.json").write_text(json.dumps(config))
    source = read_source(hf_dir)
    assert source.config.nope_layers == (0, 1)
    prompt = torch.randint(3, 512, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(hf_dir, prompt)).abs().max().item() < 1e-4


@pytest.mark.parametrize("change, what, kind", [
    ({"layer_types": ["mamba", "attention"], "mamba_proj_bias": True}, "mamba_proj_bias", "UNSUPPORTED_MODEL"),
    ({"layer_types": ["mamba", "cross_attention"]}, "mamba or attention", "SOURCE_FORMAT")])
def test_granite_4_layers_it_cannot_serve_are_refused_by_name(tmp_path, change, what, kind):
    """Granite 4.0's hybrids (Mamba-2 layers, experts) serve (tests/model/test_parity_hf.py's granite4_h families);
    biased Mamba projections and unknown layer kinds are refused naming them."""
    from flared.errors import CoreError, ErrorKind

    hf_dir = build_hf_checkpoint("granite4", tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CoreError, match=what) as info:
        read_source(hf_dir)
    assert info.value.kind == getattr(ErrorKind, kind)
