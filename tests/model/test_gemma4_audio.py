"""Gemma 4's audio tower (flared.model.audio.Gemma4AudioEncoder) against transformers' get_audio_features on the
same random weights: the rows of clips from two frames to over six seconds (more than one 12-row attention block,
the Transformer-XL shift at every offset) equal transformers' valid rows to float32's rounding."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_rows_match_transformers(tiny_gemma4_vision):
    from transformers import Gemma4ForConditionalGeneration
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    from flared.core.load import open_core
    from flared.frontend.audio import DecodedAudio
    from flared.model.vision import vision_encoder

    checkpoint, core_path = tiny_gemma4_vision
    core = open_core(core_path)
    assert core.audio_config.family == "gemma4_audio" and core.vision_config.family == "gemma4"
    tower = vision_encoder(core.audio_config, core.load_audio_tensors())
    processor = core.audio_processor()
    model = Gemma4ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    extractor = Gemma4AudioFeatureExtractor()
    rng = np.random.default_rng(1)
    for n in (400, 8000, 16000, 37000, 100000):
        x = (rng.standard_normal(n) * 0.1).astype(np.float32)
        ref = extractor([x], return_tensors="pt")
        with torch.no_grad():
            out = model.model.get_audio_features(ref["input_features"], ref["input_features_mask"])
        want = out.pooler_output[out.attention_mask]
        clip = processor.prepare(DecodedAudio(x, 16000))
        got = tower.encode(torch.from_numpy(clip.pixel_values), grid=clip.grid)
        assert got.shape == want.shape == (clip.num_image_tokens, core.config.hidden_size), n
        assert (got - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item()), n
