"""EXAONE 4.0 beyond the shared parity tests (test_parity_hf.py runs the exaone4 family: three windowed layers in
four, the global one unrotated): another sliding_window_pattern, and no window (every layer global and rotated), each
against transformers."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flared.model.decoder import DecoderModel  # noqa: E402
from flared.model.loader import read_source  # noqa: E402

from .conftest import build_hf_checkpoint  # noqa: E402
from flared_testing.checkpoints import hf_last_logits, last_logits  # noqa: E402


@pytest.mark.parametrize("change, windows, nope", [
    ({"layer_types": None, "sliding_window_pattern": 2}, (8, 0, 8, 0), (1, 3)),
    ({"layer_types": ["full_attention"] * 4, "sliding_window": None}, None, ()),
])
def test_layer_patterns(tmp_path, change, windows, nope):
    hf_dir = build_hf_checkpoint("exaone4", tmp_path / "hf")
    config = {**json.loads((hf_dir / "config.json").read_text()), **change}
    if config["layer_types"] is None:
        del config["layer_types"]
    (hf_dir / "config.json").write_text(json.dumps(config))
    source = read_source(hf_dir)
    assert (source.config.layer_windows, source.config.nope_layers) == (windows, nope)
    prompt = torch.randint(3, 512, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = last_logits(DecoderModel(source.config, source.tensors), prompt)
    assert (ours - hf_last_logits(hf_dir, prompt)).abs().max().item() < 1e-4
