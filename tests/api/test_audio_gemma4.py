"""Gemma 4's audio (E2B's and E4B's conformer beside their image tower) end to end: the random-weight Gemma 4 of
test_vision_gemma4.py (an audio tower of two conformer layers) served by a real `flared run`, clips sent as OpenAI's
``input_audio`` parts, its greedy tokens checked against transformers' Gemma4ForConditionalGeneration fed by
Gemma4AudioFeatureExtractor (each <|audio|> expanded to <|audio>, the clip's tokens, <audio|>, as Gemma4Processor
does) on the same weights, samples and prompt; images and clips in one turn; transcriptions on it.

The random models may emit a media token (<|image|>, <|video|>, <|audio|>) as output, which transformers then feeds
as the pad token's embedding (its placeholder mask), and flared, as vLLM, as the token's own; no trained model
emits them, and the tests keep these from doing so (transformers' suppress_tokens, our logit_bias of -100)."""

from __future__ import annotations

import re

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from flared_testing.audio import gemma4_clip_tokens, input_audio, tone, wav_bytes  # noqa: E402
from flared_testing.vision import ask_greedy, assert_greedy, metric, noise_image, token_ids, user_turn  # noqa: E402

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def daemon(tiny_gemma4_vision, tmp_path_factory):
    from flared_testing.daemon import Daemon

    d = Daemon(tiny_gemma4_vision[1], tmp_path_factory.mktemp("gemma4-audio-daemon"))
    yield d
    d.kill()


@pytest.fixture(scope="module")
def reference(tiny_gemma4_vision):
    import torch
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    from flared_testing.vision import gemma4_reference

    model, tok, images, media_ids = gemma4_reference(tiny_gemma4_vision[0])
    extractor = Gemma4AudioFeatureExtractor()

    def run(media, text: str):
        """(prompt tokens, greedy tokens) of transformers for one user turn of ``media`` (("audio", samples at 16
        kHz) or ("image", PIL image)) then ``text``."""
        prompt = user_turn(tok, [kind for kind, _ in media], text)
        kwargs = {}
        clips = [m.astype(np.float32) / 32768.0 for kind, m in media if kind == "audio"]  # (as the WAV decodes)
        pictures = [m for kind, m in media if kind == "image"]
        if clips:
            features = extractor(clips, return_tensors="pt")
            kwargs.update(input_features=features["input_features"],
                          input_features_mask=features["input_features_mask"])
            counts = iter([gemma4_clip_tokens(m) for m in features["input_features_mask"].numpy()])
        if pictures:
            prepared = images(pictures, return_tensors="pt")
            kwargs.update(pixel_values=prepared["pixel_values"], image_position_ids=prepared["image_position_ids"])
            sizes = iter(prepared["num_soft_tokens_per_image"])
        pieces = re.split(r"<\|image\|>|<\|audio\|>", prompt)
        prompt = pieces[0]
        for (kind, _), rest in zip(media, pieces[1:]):
            prompt += (f"<|audio>{'<|audio|>' * next(counts)}<audio|>" if kind == "audio"
                       else f"<|image>{'<|image|>' * next(sizes)}<image|>") + rest
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            gen = model.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, return_dict_in_generate=True, suppress_tokens=media_ids, **kwargs)
        return ids.shape[1], gen.sequences[0, ids.shape[1]:].tolist()

    run.bias = {str(t): -100 for t in media_ids}  # (our side of suppress_tokens)
    return run


def ask(daemon, media, text: str, **kw):
    return ask_greedy(daemon, [input_audio(m) if kind == "audio" else m for kind, m in media], text, NEW_TOKENS, **kw)


def test_greedy_tokens_match_transformers(daemon, reference):
    """Clips of 0.5, 1.3 and 4.25 s, two clips in a turn, and an image with a clip."""
    a, b, c = tone(1, 1.3), tone(2, 4.25), tone(3, 0.5)
    picture = noise_image(71, (90, 40))
    for media, text in (([("audio", a)], "What is that sound?"), ([("audio", b)], "And this one?"),
                        ([("audio", c)], "Hm?"), ([("audio", a), ("audio", b)], "Compare."),
                        ([("image", picture), ("audio", a)], "Does the picture make that sound?")):
        body = ask(daemon, media, text, logit_bias=reference.bias)
        num_prompt, expected = reference(media, text)
        assert body["usage"]["prompt_tokens"] == num_prompt, text
        assert_greedy(body, expected, text)
    assert metric(daemon, "flare_vision_images") >= 4  # (the clips' rows and the image's, each run once)


def test_the_answer_depends_on_the_clip(reference):
    one = reference([("audio", tone(4, 1.0))], "What is it?")
    other = reference([("audio", tone(5, 1.0))], "What is it?")
    assert one[0] == other[0] and one[1] != other[1]


def test_the_model_card_says_audio_and_images(daemon):
    status, models = daemon.request("GET", "/v1/models")
    assert status == 200
    caps = models["data"][0]["capabilities"]
    assert caps["audio"] is True and caps["vision"] is True and caps["video"] is True, caps


def test_a_transcription_is_the_models_answer_to_the_instruction(daemon):
    """/v1/audio/transcriptions on a model of images and audio: the chat answer to the transcription instruction."""
    import base64

    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{daemon.base}/v1", api_key="none", max_retries=0)
    wav = wav_bytes(tone(21, 1.5))
    got = client.audio.transcriptions.create(model="tiny", file=("clip.wav", wav, "audio/wav"),
                                             extra_body={"max_completion_tokens": 8})
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
    status, body = daemon.chat([{"role": "user", "content": [part, {"type": "text",
                                                                     "text": "Transcribe the input speech."}]}],
                               temperature=0, max_tokens=8)
    assert status == 200, body
    assert got.text == body["choices"][0]["message"]["content"].strip()
    assert got.usage.input_token_details.audio_tokens == 38  # (1.5 s: 149 frames, 75 rows, 38 tokens)


def test_bad_and_long_clips_are_400s(daemon):
    """A clip past 30 s (transformers would cut it: we refuse), a message that spells the audio token."""
    status, body = daemon.chat([{"role": "user", "content": [input_audio(tone(6, 31.0)),
                                                             {"type": "text", "text": "Hi"}]}], max_tokens=1)
    assert status == 400 and "at most 30 s" in body["error"]["message"], body
    status, body = daemon.chat([{"role": "user", "content": "Say <|audio|> please"}], max_tokens=1)
    assert status == 400 and "audio token" in body["error"]["message"], body


def test_a_repeated_clip_is_answered_from_the_prefix_cache_as_transformers(daemon, reference):
    clip = tone(7, 2.0)
    first = ask(daemon, [("audio", clip)], "Again?")
    again = ask(daemon, [("audio", clip)], "Again?")
    assert token_ids(first) == token_ids(again)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_usage_counts_the_clips_tokens_not_the_images(daemon):
    """prompt_tokens_details.audio_tokens: a 1.5 s clip's 38 tokens, beside an image's 60."""
    body = ask(daemon, [("image", noise_image(71, (90, 40))), ("audio", tone(8, 1.5))], "Both?")
    assert body["usage"]["prompt_tokens_details"]["audio_tokens"] == 38, body["usage"]
