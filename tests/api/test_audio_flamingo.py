"""Audio Flamingo 3 (Qwen2-Audio's Whisper encoder over 30-second windows, a two-linear GELU projector, a Qwen2
decoder) end to end: a random-weight model exported and served by a real `flared run`, its greedy tokens checked
against transformers' AudioFlamingo3ForConditionalGeneration fed by AudioFlamingo3Processor on the same weights,
samples and prompt, for clips of one window and of two (past 30 s), and its max_audio_len enforced."""

from __future__ import annotations

import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from flared_testing.audio import input_audio, tone  # noqa: E402
from flared_testing.vision import assert_greedy  # noqa: E402

NEW_TOKENS = 10


def ask(daemon, parts, text: str):
    from flared_testing.audio import ask as _ask

    return _ask(daemon, parts, text, NEW_TOKENS)


@pytest.fixture(scope="module")
def daemon(tiny_audioflamingo3, tmp_path_factory):
    from flared_testing.daemon import Daemon

    d = Daemon(tiny_audioflamingo3[1], tmp_path_factory.mktemp("af3-daemon"))
    yield d
    d.kill()


@pytest.fixture(scope="module")
def reference(tiny_audioflamingo3):
    import torch
    from transformers import (AudioFlamingo3ForConditionalGeneration, AudioFlamingo3Processor,
                              PreTrainedTokenizerFast, WhisperFeatureExtractor)

    checkpoint = tiny_audioflamingo3[0]
    model = AudioFlamingo3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    template = json.loads((checkpoint / "tokenizer_config.json").read_text())["chat_template"]
    tok = PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"), eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    settings = json.loads((checkpoint / "preprocessor_config.json").read_text())
    features = WhisperFeatureExtractor(**{k: v for k, v in settings.items()
                                          if k not in ("feature_extractor_type", "processor_class")})
    processor = AudioFlamingo3Processor(feature_extractor=features, tokenizer=tok, chat_template=template,
                                        max_audio_len=60)

    def run(clip, text: str):
        content = [{"type": "audio", "audio": "clip"}, {"type": "text", "text": text}]
        prompt = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                               add_generation_prompt=True)
        inputs = processor(text=prompt, audio=[clip.astype(np.float32) / 32768])
        with torch.no_grad():
            gen = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        n = inputs["input_ids"].shape[1]
        return n, gen[0, n:].tolist()

    return run


def test_greedy_tokens_match_transformers(daemon, reference):
    """A clip of one window, one of exactly 30 s, and two of two windows: 41.5 s, and 30 s and two frames (whose
    second window's frames make no token)."""
    for seconds, text in ((3.2, "Describe the sound."), (30.0, "Whole window."), (41.5, "Two windows."),
                          (30.0 + 321 / 16000, "Barely two.")):
        clip = tone(int(seconds * 10), seconds)
        status, body = ask(daemon, [input_audio(clip)], text)
        assert status == 200, body
        num_prompt, expected = reference(clip, text)
        assert body["usage"]["prompt_tokens"] == num_prompt, (seconds, text)
        assert_greedy(body, expected, (seconds, text))


def test_the_models_longest_clip_is_its_max_audio_len(daemon):
    status, body = ask(daemon, [input_audio(tone(1, 60.5))], "Too long.")
    assert status == 400 and "at most 60 s" in body["error"]["message"], body
    status, body = ask(daemon, [input_audio(tone(2, 1.0))], "Still serving?")
    assert status == 200, body
