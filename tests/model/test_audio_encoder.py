"""Qwen2-Audio's encoder (flared.model.audio) against transformers' on the same weights: transformers runs the
whole 30-second window with the padding's keys masked; we run the clip's rows alone. The rows must agree for
clips from one audio token to the full window, and a checkpoint whose pieces disagree is refused at export."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")


def _transformers_rows(model, features, mask):
    import torch
    from transformers.masking_utils import create_bidirectional_mask

    tower = model.model.audio_tower
    conv, tokens = tower._get_feat_extract_output_lengths(mask.sum(-1))
    keys = (torch.arange(1500)[None] < conv[:, None]).long()
    attention = create_bidirectional_mask(config=tower.config, inputs_embeds=torch.zeros(1, 1500, 1),
                                          attention_mask=keys)
    with torch.no_grad():
        rows = model.model.multi_modal_projector(tower(features, attention_mask=attention).last_hidden_state)
    return rows[0, :int(tokens)]


def test_encoder_rows_equal_transformers_masked_window(tiny_qwen2_audio):
    import torch
    from transformers import Qwen2AudioForConditionalGeneration, WhisperFeatureExtractor

    from flared.frontend.audio import DecodedAudio, WhisperProcessor
    from flared.model.loader import read_source
    from flared.model.vision import vision_encoder

    checkpoint = tiny_qwen2_audio[0]
    model = Qwen2AudioForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    source = read_source(checkpoint)
    assert source.vision.family == "qwen2_audio" and source.vision.mel_bins == 16
    encoder = vision_encoder(source.vision, source.vision_tensors)
    extractor, ours = WhisperFeatureExtractor(feature_size=16), WhisperProcessor(feature_size=16)
    rng = np.random.default_rng(3)
    for n in (321, 4999, 16000, 123457, 480000):  # (1, 7, 25, 192 and 750 audio tokens)
        x = (rng.standard_normal(n) * 0.2).astype(np.float32)
        want = extractor(x, sampling_rate=16000, return_attention_mask=True, padding="max_length", return_tensors="pt")
        expected = _transformers_rows(model, want["input_features"], want["attention_mask"])
        prepared = ours.prepare(DecodedAudio(x, 16000))
        got = encoder.encode(torch.as_tensor(prepared.pixel_values), grid=prepared.grid)
        assert got.shape == expected.shape == (prepared.num_image_tokens, 64)
        assert torch.allclose(got, expected, atol=2e-5), (n, (got - expected).abs().max())


def _copy(checkpoint, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(checkpoint, d)
    return d


def test_a_checkpoint_whose_parts_disagree_is_refused(tiny_qwen2_audio, tmp_path):
    from flared.core.export import ExportOptions, export_core
    from flared.errors import CoreError

    d = _copy(tiny_qwen2_audio[0], tmp_path)
    pre = json.loads((d / "preprocessor_config.json").read_text())
    (d / "preprocessor_config.json").write_text(json.dumps({**pre, "feature_size": 128}))
    with pytest.raises(CoreError, match="128 mel bins, but the audio encoder takes 16"):
        export_core(d, tmp_path / "a.core", ExportOptions(concurrency=2, context_tokens=256))
    (d / "preprocessor_config.json").write_text(json.dumps(pre))
    (d / "processor_config.json").write_text(json.dumps({"audio_token": "<|audio_eos|>"}))
    with pytest.raises(CoreError, match="the config's audio token is"):
        export_core(d, tmp_path / "b.core", ExportOptions(concurrency=2, context_tokens=256))


def test_an_exported_core_keeps_the_feature_extractor(tiny_qwen2_audio):
    from flared.core.load import open_core
    from flared.frontend.audio import WhisperProcessor

    core = open_core(tiny_qwen2_audio[1])
    assert core.image_processor() == WhisperProcessor(feature_size=16)
    assert core.manifest.capabilities["audio"] and not core.manifest.capabilities["vision"]


def test_transformers_5_17s_deeper_decoder_layout_reads_the_same(tiny_qwen2_audio, tmp_path):
    """transformers 5.17 saves Qwen2-Audio's decoder as language_model.model.model.* (the releases, and 5.25:
    language_model.model.*); both read as the same checkpoint."""
    import torch
    from safetensors.torch import load_file, save_file

    from flared.model.loader import read_source

    d = _copy(tiny_qwen2_audio[0], tmp_path)
    weights = load_file(d / "model.safetensors")
    save_file({("language_model.model.model." + k.removeprefix("language_model.model.")
                if k.startswith("language_model.model.") else k): v
               for k, v in weights.items()}, d / "model.safetensors", metadata={"format": "pt"})
    assert any(k.startswith("language_model.model.model.") for k in load_file(d / "model.safetensors"))
    ours, theirs = read_source(d), read_source(tiny_qwen2_audio[0])
    assert sorted(ours.tensors) == sorted(theirs.tensors)
    assert all(torch.equal(ours.tensors[k], theirs.tensors[k]) for k in theirs.tensors)
