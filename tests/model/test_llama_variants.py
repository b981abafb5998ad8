"""Llama's layer under other families' names: EXAONE 3's config keys as its releases spell them (its tensor names are
the parity fixture's, test_parity_hf.py), and dynamic NTK rope read as plain rope only where flared never passes the
original context."""

from __future__ import annotations

import json

import pytest
import torch

from flared.errors import CoreError
from flared.model.config import from_hf_config

from .conftest import build_hf_checkpoint


def test_exaone3_config_keys_as_released(tmp_path):
    config = json.loads((build_hf_checkpoint("exaone", tmp_path / "hf") / "config.json").read_text())
    released = {{"num_hidden_layers": "num_layers", "rms_norm_eps": "layer_norm_epsilon",
                 "hidden_act": "activation_function"}.get(k, k): v for k, v in config.items()}
    assert "num_layers" in released and "num_hidden_layers" not in released
    assert from_hf_config(released) == from_hf_config(config)
    no_theta = {k: v for k, v in released.items() if k != "rope_parameters"}
    assert from_hf_config(no_theta).rope_theta == 500000.0  # (transformers' default for EXAONE)


def test_dynamic_ntk_rope_is_plain_within_the_original_context(tmp_path):
    config = json.loads((build_hf_checkpoint("internlm3", tmp_path / "hf") / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "dynamic"
    ours = from_hf_config(config)
    assert ours.rope_scaling is None and ours.rope_theta == 50000000.0
    shorter = dict(config, rope_parameters=dict(config["rope_parameters"], original_max_position_embeddings=64))
    with pytest.raises(CoreError, match="dynamic NTK"):
        from_hf_config(shorter)


@pytest.mark.parametrize("family", ["nanochat", "sarvam_moe", "hyperclovax", "exaone", "olmo"])
def test_a_core_exported_from_a_renamed_or_weightless_checkpoint_loads_as_read(family, tmp_path):
    """Export writes what the loader made of such a checkpoint (nanochat's synthesized norms each a tensor of its own,
    Sarvam's split q/k/v, EXAONE's renamed tensors), and the core loads back to the same tensors."""
    from flared.core.export import ExportOptions, export_core
    from flared.core.load import open_core
    from flared.model.loader import read_source
    from flared_testing.served import write_char_tokenizer

    directory = build_hf_checkpoint(family, tmp_path / "hf")
    write_char_tokenizer(directory, 512)
    export_core(directory, tmp_path / "core", ExportOptions(concurrency=2, context_tokens=256,
                                                            prefill_chunk_tokens=128))
    core = open_core(tmp_path / "core")
    source = read_source(directory)
    assert core.config == source.config
    loaded = core.load_tensors()
    assert loaded.keys() == source.tensors.keys()
    assert all(torch.equal(loaded[k].float(), source.tensors[k].float()) for k in loaded)
