"""GLM-ASR (a Whisper-shaped encoder whose layers turn half of each head by a rope and attend over the whole window,
its padding too; four rows merged a token; a Llama decoder) end to end: a random-weight model exported and served by
a real `flared run`, its greedy tokens checked against transformers' GlmAsrForConditionalGeneration fed by
GlmAsrProcessor on the same weights, samples and prompt, for one window and for two."""

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
def daemon(tiny_glmasr, tmp_path_factory):
    from flared_testing.daemon import Daemon

    d = Daemon(tiny_glmasr[1], tmp_path_factory.mktemp("glmasr-daemon"))
    yield d
    d.kill()


@pytest.fixture(scope="module")
def reference(tiny_glmasr):
    import torch
    from transformers import (GlmAsrForConditionalGeneration, GlmAsrProcessor, PreTrainedTokenizerFast,
                              WhisperFeatureExtractor)

    checkpoint = tiny_glmasr[0]
    model = GlmAsrForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    template = json.loads((checkpoint / "tokenizer_config.json").read_text())["chat_template"]
    tok = PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"), eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    settings = json.loads((checkpoint / "preprocessor_config.json").read_text())
    features = WhisperFeatureExtractor(**{k: v for k, v in settings.items()
                                          if k not in ("feature_extractor_type", "processor_class")})
    processor = GlmAsrProcessor(feature_extractor=features, tokenizer=tok, chat_template=template, max_audio_len=60)

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
    """A clip of one window, one of exactly 30 s, two of two windows (41.5 s; 30 s and a few frames, whose second
    window makes no token)."""
    for seconds, text in ((3.2, "Transcribe it."), (30.0, "Whole window."), (41.5, "Two windows."),
                          (30.0 + 481 / 16000, "Barely two.")):
        clip = tone(int(seconds * 10) + 1, seconds)
        status, body = ask(daemon, [input_audio(clip)], text)
        assert status == 200, body
        num_prompt, expected = reference(clip, text)
        assert body["usage"]["prompt_tokens"] == num_prompt, (seconds, text)
        assert_greedy(body, expected, (seconds, text))


def test_a_clip_too_short_for_a_token_is_a_400(daemon):
    status, body = ask(daemon, [input_audio(tone(3, 0.055))], "Hm?")
    assert status == 400 and "too short" in body["error"]["message"] and "60 ms" in body["error"]["message"], body
    status, body = ask(daemon, [input_audio(tone(3, 0.07))], "Hm?")
    assert status == 200, body
