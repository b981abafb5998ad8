"""Gemma 4's audio preparation (flared.frontend.audio.UsmProcessor): the log-mel frames equal transformers'
Gemma4AudioFeatureExtractor's bit for bit, for the clip's own frames (its input_features_mask), and the clip's
tokens are Gemma4Processor's count of that mask halved twice; settings round-trip and bad ones are refused."""

from __future__ import annotations

import numpy as np
import pytest

from flared.errors import FrontendError
from flared.frontend.audio import DecodedAudio, UsmProcessor
from flared.frontend.images import image_processor_from_dict
from flared_testing.audio import gemma4_clip_tokens

pytest.importorskip("transformers")

from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor  # noqa: E402

LENGTHS = [161, 321, 400, 1000, 8000, 16000, 16001, 23456, 160 * 77 + 5, 480000]


@pytest.mark.parametrize("settings", [{}, {"preemphasis": 0.97}, {"preemphasis": 0.9, "preemphasis_htk_flavor": False,
                                                                   "input_scale_factor": 2.0, "mel_floor": 1e-5,
                                                                   "min_frequency": 60.0, "max_frequency": 7600.0,
                                                                   "per_bin_mean": [0.1] * 128,
                                                                   "per_bin_stddev": [2.0] * 128}])
def test_frames_and_tokens_are_transformers(settings):
    theirs = Gemma4AudioFeatureExtractor(**settings)
    ours = UsmProcessor.from_hf({"feature_extractor_type": "Gemma4AudioFeatureExtractor", **settings})
    rng = np.random.default_rng(0)
    for n in LENGTHS:
        x = (rng.standard_normal(n) * 0.1).astype(np.float32)
        ref = theirs([x], return_tensors="np")  # (a list: a bare array trips its own squeeze)
        mask = ref["input_features_mask"][0]
        valid = int(mask.sum())
        assert mask[:valid].all() and not mask[valid:].any()
        got = ours.prepare(DecodedAudio(x, 16000))
        assert got.grid == (valid, 1, 1) and got.num_image_tokens == gemma4_clip_tokens(mask), n
        np.testing.assert_array_equal(got.pixel_values, ref["input_features"][0][:valid])
        assert got.prompt == "<|audio>" + "<|audio|>" * got.num_image_tokens + "<audio|>"


def test_settings_round_trip_and_refusals():
    p = UsmProcessor.from_hf({"feature_extractor_type": "Gemma4AudioFeatureExtractor", "frame_length": 320,
                              "hop_length": 160, "fft_length": 512}, {"audio_seq_length": 750})
    assert p == UsmProcessor() and image_processor_from_dict(p.to_dict()) == p and p.max_seconds == 30
    assert UsmProcessor.from_hf({"frame_length_ms": 32.0, "fft_overdrive": True}).fft_length == 1024
    for bad, match in (({"dither": 0.1}, "dither"), ({"fft_length": 1024}, "fft_length"),
                       ({"feature_extractor_type": "WhisperFeatureExtractor"}, "not supported"),
                       ({"per_bin_mean": [0.5]}, "per_bin_mean")):
        with pytest.raises(FrontendError, match=match):
            UsmProcessor.from_hf(bad)
    with pytest.raises(FrontendError, match="at most 30 s"):
        p.prepare(DecodedAudio(np.zeros(480001, np.float32), 16000))
    with pytest.raises(FrontendError, match="too short"):
        p.prepare(DecodedAudio(np.zeros(160, np.float32), 16000))
    # (another rate is resampled to 16 kHz first: 1 s at 8 kHz is 1 s at 16 kHz)
    assert p.prepare(DecodedAudio(np.zeros(8000, np.float32), 8000)).num_image_tokens == 25
