"""Qwen3-ASR's audio encoder (flared.model.audio.Qwen3AsrAudioEncoder, Qwen3-Omni's AuT) and feature extractor
against transformers' on the same weights and samples, and its checkpoints in both layouts: transformers' (as
save_pretrained writes it) and the released one (the qwen-asr package's: ``thinker_config``, ``thinker.*`` tensors,
the projector inside the tower)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_asr")

# samples: under the 0.5 s minimum, one chunk, a chunk and a frame, two attention windows (9.7 s: 126 rows against
# windows of 104), several windows and a partial chunk
LENGTHS = (1, 4321, 16000, 16161, 155200, 16000 * 21 + 777)


def test_features_and_token_counts_equal_transformers():
    import torch
    from transformers.models.qwen3_asr.feature_extraction_qwen3_asr import Qwen3ASRFeatureExtractor
    from transformers.models.qwen3_asr.processing_qwen3_asr import Qwen3ASRProcessor

    from flared.frontend.audio import DecodedAudio, Qwen3AsrProcessor

    extractor, ours = Qwen3ASRFeatureExtractor(), Qwen3AsrProcessor()
    rng = np.random.default_rng(5)
    for n in LENGTHS + (7999, 8000, 16159, 16160):
        x = (rng.standard_normal(n) * 0.1).astype(np.float32)
        want = extractor(x, sampling_rate=16000, padding=True, return_attention_mask=True)
        mask = want["attention_mask"]
        tokens = int(Qwen3ASRProcessor._get_audio_token_length(None, torch.as_tensor(mask).sum(-1), 50)[0])
        got = ours.prepare(DecodedAudio(x, 16000))
        assert np.array_equal(got.pixel_values, np.asarray(want["input_features"][0])), n
        assert got.num_image_tokens == tokens and got.prompt == "<|audio_pad|>" * tokens, n
        assert got.grid[:2] == (int(mask.sum()), got.pixel_values.shape[1] // 100), n


def test_a_clip_past_twenty_minutes_is_refused():
    from flared.errors import FrontendError
    from flared.frontend.audio import DecodedAudio, Qwen3AsrProcessor

    with pytest.raises(FrontendError, match="at most 1200 s"):
        Qwen3AsrProcessor().prepare(DecodedAudio(np.zeros(16000 * 1200 + 1, np.float32), 16000))


def _rows(model, extractor, x):
    import torch

    want = extractor(x, sampling_rate=16000, padding=True, return_attention_mask=True, return_tensors="pt")
    with torch.no_grad():
        return model.model.get_audio_features(want["input_features"], want["attention_mask"]).pooler_output


def test_encoder_rows_equal_transformers(tiny_qwen3_asr):
    """Bit for bit in float32, for one chunk to several attention windows; attending over the whole clip instead
    of its windows would not be."""
    import torch
    from transformers import Qwen3ASRForConditionalGeneration
    from transformers.models.qwen3_asr.feature_extraction_qwen3_asr import Qwen3ASRFeatureExtractor

    from flared.frontend.audio import DecodedAudio, Qwen3AsrProcessor
    from flared.model.loader import read_source
    from flared.model.vision import vision_encoder

    checkpoint = tiny_qwen3_asr[0]
    model = Qwen3ASRForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    source = read_source(checkpoint)
    c = source.vision
    assert (c.family, c.mel_bins, c.conv_channels, c.chunk_frames, c.window_chunks) == ("qwen3_asr", 16, (8,), 100, 8)
    encoder = vision_encoder(c, source.vision_tensors)
    extractor, ours = Qwen3ASRFeatureExtractor(feature_size=16), Qwen3AsrProcessor(feature_size=16)
    rng = np.random.default_rng(6)
    for n in LENGTHS:
        x = (rng.standard_normal(n) * 0.2).astype(np.float32)
        expected = _rows(model, extractor, x)
        prepared = ours.prepare(DecodedAudio(x, 16000))
        got = encoder.encode(torch.as_tensor(prepared.pixel_values), grid=prepared.grid)
        assert got.shape == expected.shape == (prepared.num_image_tokens, 64), n
        assert torch.equal(got, expected), (n, (got - expected).abs().max())
    whole = vision_encoder(dataclasses.replace(c, window_chunks=1000), source.vision_tensors)
    assert not torch.allclose(whole.encode(torch.as_tensor(prepared.pixel_values), grid=prepared.grid), expected,
                              atol=1e-6)


def released_layout(checkpoint, tmp_path):
    """The tiny checkpoint as the released Qwen3-ASR ships: config.json's model under ``thinker_config`` (its text
    model's rope the multimodal one, interleaved), the tensors under ``thinker.`` with the projector as the
    tower's proj1 / proj2."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "released"
    shutil.copytree(checkpoint, d)
    hf = json.loads((d / "config.json").read_text())
    text = {**hf["text_config"], "model_type": "qwen3_omni_moe_text",
            "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "interleaved": True,
                             "rope_theta": hf["text_config"].get("rope_parameters", {}).get("rope_theta", 1e6)}}
    text.pop("rope_parameters", None)
    thinker = {"audio_config": {**hf["audio_config"], "model_type": "qwen3_asr_audio_encoder"}, "text_config": text,
               "audio_token_id": hf["audio_token_id"], "model_type": "qwen3_asr_thinker"}
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_asr", "thinker_config": thinker,
                                               "architectures": ["Qwen3ASRForConditionalGeneration"],
                                               "support_languages": ["English"]}))
    renames = (("model.audio_tower.", "thinker.audio_tower."),
               ("model.multi_modal_projector.linear_1.", "thinker.audio_tower.proj1."),
               ("model.multi_modal_projector.linear_2.", "thinker.audio_tower.proj2."),
               ("model.language_model.", "thinker.model."), ("lm_head.", "thinker.lm_head."))
    weights = load_file(d / "model.safetensors")
    save_file({next((new + k[len(old):] for old, new in renames if k.startswith(old)), k): v
               for k, v in weights.items()}, d / "model.safetensors", metadata={"format": "pt"})
    assert all(k.startswith("thinker.") for k in load_file(d / "model.safetensors"))
    return d


def test_the_released_layout_reads_as_transformers_layout(tiny_qwen3_asr, tmp_path):
    import torch

    from flared.model.loader import read_source

    ours, theirs = read_source(released_layout(tiny_qwen3_asr[0], tmp_path)), read_source(tiny_qwen3_asr[0])
    assert ours.vision == theirs.vision and ours.config == theirs.config
    for mine, other in ((ours.tensors, theirs.tensors), (ours.vision_tensors, theirs.vision_tensors)):
        assert sorted(mine) == sorted(other)
        assert all(torch.equal(mine[k], other[k]) for k in other)


def test_an_exported_core_keeps_the_extractor_and_a_mismatch_is_refused(tiny_qwen3_asr, tmp_path):
    from flared.core.export import ExportOptions, export_core
    from flared.core.load import open_core
    from flared.errors import CoreError
    from flared.frontend.audio import Qwen3AsrProcessor

    core = open_core(tiny_qwen3_asr[1])
    assert core.image_processor() == Qwen3AsrProcessor(feature_size=16)
    assert core.manifest.capabilities["audio"] and not core.manifest.capabilities["vision"]
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_qwen3_asr[0], d)
    pre = json.loads((d / "preprocessor_config.json").read_text())
    (d / "preprocessor_config.json").write_text(json.dumps({**pre, "n_window": 25}))
    with pytest.raises(CoreError, match="chunks of 50 frames, but the audio encoder takes 16 and 100"):
        export_core(d, tmp_path / "a.core", ExportOptions(concurrency=2, context_tokens=256))
    # (transformers 5 nests the extractor in processor_config.json: read the same)
    (d / "preprocessor_config.json").unlink()
    (d / "processor_config.json").write_text(json.dumps({"feature_extractor": pre}))
    export_core(d, tmp_path / "b.core", ExportOptions(concurrency=2, context_tokens=256))
    assert open_core(tmp_path / "b.core").image_processor() == Qwen3AsrProcessor(feature_size=16)
