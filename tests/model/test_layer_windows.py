"""Windows on some layers only (Ministral, CWM; Gemma's and Cohere2's families): neither the CUDA graphs' kernels nor
the CPU's one-call decode step take a window per layer, so such a model keeps off both; one window on every layer
stays the model's sliding_window, as Mistral's."""

from __future__ import annotations

import json

import pytest
import torch

from flared.model.decoder import DecoderModel
from flared.model.loader import read_source

from .conftest import build_hf_checkpoint


@pytest.mark.parametrize("family", ["ministral", "cwm"])
def test_mixed_windows_keep_off_the_graphs_and_the_one_call_step(family, tmp_path):
    source = read_source(build_hf_checkpoint(family, tmp_path))
    assert source.config.layer_windows is not None and len(set(source.config.layer_windows)) == 2
    assert source.config.graph_obstacle == "sliding windows on some layers only"
    assert not DecoderModel(source.config, source.tensors, dtype=torch.bfloat16).fused_decode


def test_one_window_everywhere_is_the_sliding_window(tmp_path):
    """A Ministral config whose layer_types slide everywhere reads as Mistral's: one sliding_window, graph capable."""
    directory = build_hf_checkpoint("ministral", tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "layer_types": ["sliding_attention"] * 3}))
    read = read_source(directory).config
    assert (read.sliding_window, read.layer_windows, read.graph_obstacle) == (8, None, None)
