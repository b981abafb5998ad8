"""Qwen2-Audio (a Whisper encoder's rows in place of the prompt's <|AUDIO|> tokens, a Qwen2 decoder) end to end: a
random-weight model exported and served by a real `flared run`, clips sent as OpenAI's ``input_audio`` parts (WAV)
and as vLLM's ``audio_url`` data URLs, its greedy tokens checked against transformers'
Qwen2AudioForConditionalGeneration fed by Qwen2AudioProcessor (WhisperFeatureExtractor's features, each
<|AUDIO|> expanded to the clip's tokens) on the same weights, samples and prompt."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from flared_testing.audio import ask as _ask  # noqa: E402
from flared_testing.audio import float_wav, input_audio, tone, wav_bytes  # noqa: E402
from flared_testing.vision import token_ids  # noqa: E402

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def daemon(tiny_qwen2_audio, tmp_path_factory):
    from flared_testing.daemon import Daemon

    d = Daemon(tiny_qwen2_audio[1], tmp_path_factory.mktemp("qwen2-audio-daemon"))
    yield d
    d.kill()


def ask(daemon, parts, text: str, **kw):
    return _ask(daemon, parts, text, NEW_TOKENS, **kw)


@pytest.fixture(scope="module")
def reference(tiny_qwen2_audio):
    from flared_testing.audio import transformers_reference
    from transformers import Qwen2AudioForConditionalGeneration, Qwen2AudioProcessor

    return transformers_reference(tiny_qwen2_audio[0], Qwen2AudioForConditionalGeneration, Qwen2AudioProcessor,
                                  NEW_TOKENS)


def test_greedy_tokens_match_transformers(daemon, reference):
    """A short clip, a longer one, a clip of 70 ms (two audio tokens; transformers' model cannot take a clip of one,
    which its merge mistakes for an unexpanded prompt), and two clips in one turn."""
    from flared_testing.audio import assert_clips_match

    a, b, c = tone(1, 1.3), tone(2, 4.25), tone(3, 0.07)
    assert_clips_match(daemon, reference, (([a], "What is that sound?"), ([b], "And this one?"), ([c], "Hm?"),
                                           ([a, b], "Compare.")), NEW_TOKENS)


def test_audio_url_data_urls_and_stereo_read_as_the_same_clip(daemon):
    """vLLM's audio_url part with a data URL answers as input_audio; a stereo WAV of the clip on both channels is
    that clip (channels averaged); a 32-bit float WAV of its values too."""
    x = tone(5, 1.0)
    _, want = ask(daemon, [input_audio(x)], "Listen.")
    url = "data:audio/wav;base64," + base64.b64encode(wav_bytes(x)).decode()
    stereo = np.repeat(x, 2)  # (interleaved frames: left, right)
    for part in ({"type": "audio_url", "audio_url": {"url": url}}, {"type": "audio_url", "audio_url": url},
                 input_audio(stereo, channels=2)):
        status, got = ask(daemon, [part], "Listen.")
        assert status == 200, got
        assert token_ids(got) == token_ids(want)
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]


def test_other_sample_rates_are_resampled_to_the_models(daemon):
    """A 44.1 kHz clip is resampled to 16 kHz: it answers as that clip resampled and sent at 16 kHz as float
    samples, and takes the tokens its 16 kHz length makes (2 s: 200 frames, 50 tokens)."""
    from flared.frontend.audio import resample

    x = tone(6, 2.0, rate=44100)
    status, got = ask(daemon, [input_audio(x, rate=44100)], "Listen.")
    assert status == 200, got
    down = resample(x.astype(np.float32) / 32768, 44100, 16000)
    assert len(down) == 32000
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(float_wav(down, 16000)).decode(),
                                                   "format": "wav"}}
    status, want = ask(daemon, [part], "Listen.")
    assert status == 200, want
    assert token_ids(got) == token_ids(want)
    _, short = ask(daemon, [input_audio(tone(6, 0.07))], "Listen.")  # (2 tokens)
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"] == short["usage"]["prompt_tokens"] + 48


def test_a_clip_of_one_audio_token_is_served(daemon):
    """30 ms: 3 frames, 2 rows after the strided conv, 1 after the pool."""
    _, two = ask(daemon, [input_audio(tone(3, 0.07))], "Hm?")
    status, one = ask(daemon, [input_audio(tone(3, 0.03))], "Hm?")
    assert status == 200, one
    assert one["usage"]["prompt_tokens"] == two["usage"]["prompt_tokens"] - 1


def test_bad_audio_is_a_400_naming_the_part(daemon):
    cases = [
        ({"type": "input_audio", "input_audio": {"data": base64.b64encode(b"ID3\x04" + bytes(64)).decode(),
                                                 "format": "aac"}}, "format 'aac' is not supported"),
        ({"type": "input_audio", "input_audio": {"data": base64.b64encode(b"ID3\x04" + bytes(64)).decode()}},
         "the MP3 audio could not be decoded"),
        (input_audio(tone(7, 31.0)), "at most 30 s"),
        (input_audio(tone(7, 0.01)), "too short"),
        ({"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}, "not valid base64"),
        ({"type": "input_audio", "input_audio": "abc"}, "must be an object"),
        ({"type": "input_audio", "input_audio": {"format": "wav"}}, "non-empty base64"),
        ({"type": "audio_url", "audio_url": {"url": "data:audio/webm;base64,AAAA"}}, "send WAV, MP3, FLAC or Ogg"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "takes text and audio"),
    ]
    for part, words in cases:
        status, body = ask(daemon, [part], "Hi")
        assert status == 400 and words in body["error"]["message"], (part, body)
        assert body["error"]["param"].startswith("messages[0].content[0]"), body
    status, body = ask(daemon, [input_audio(tone(8, 0.5))], "Still serving?")
    assert status == 200, body


def test_a_text_or_image_model_refuses_audio(tiny_core, tiny_vlm_core, start_daemon):
    for core, words in ((tiny_core, "this model takes text)"), (tiny_vlm_core, "takes text and images")):
        d = start_daemon(core)
        status, body = ask(d, [input_audio(tone(9, 0.5))], "Hi")
        assert status == 400 and words in body["error"]["message"], body
        assert body["error"]["param"] == "messages[0].content[0]", body


def test_the_encoder_runs_once_for_a_repeated_clip(daemon):
    from flared_testing.vision import metric

    x = tone(10, 0.8)
    before = metric(daemon, "flare_vision_images")
    for _ in range(3):
        status, _ = ask(daemon, [input_audio(x)], "Again.")
        assert status == 200
    assert metric(daemon, "flare_vision_images") == before + 1


def test_the_responses_api_and_the_openai_sdk_take_input_audio(daemon):
    """The openai SDK's own request shapes: chat.completions with an input_audio part, and responses.create with
    an input_audio item part (the Responses API's ResponseInputAudioParam); both answer as the raw request does."""
    openai = pytest.importorskip("openai")
    x = tone(11, 1.0)
    _, want = ask(daemon, [input_audio(x)], "Listen.")
    client = openai.OpenAI(base_url=f"{daemon.base}/v1", api_key="none")
    model = client.models.list().data[0]
    assert model.model_extra["capabilities"]["audio"] is True and model.model_extra["capabilities"]["vision"] is False
    chat = client.chat.completions.create(model=model.id, max_tokens=NEW_TOKENS, temperature=0,
                                          messages=[{"role": "user", "content": [
                                              input_audio(x), {"type": "text", "text": "Listen."}]}],
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == want["choices"][0]["message"]["content"]
    assert chat.usage.prompt_tokens == want["usage"]["prompt_tokens"]
    assert chat.usage.prompt_tokens_details.audio_tokens == 25  # (1 s: 100 frames, 50 rows, 25 tokens)
    streamed = list(client.chat.completions.create(
        model=model.id, max_tokens=NEW_TOKENS, temperature=0, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": [input_audio(x), {"type": "text", "text": "Listen."}]}],
        extra_body={"ignore_eos": True}))
    assert streamed[-1].usage.prompt_tokens_details.audio_tokens == 25
    resp = client.responses.create(model=model.id, max_output_tokens=NEW_TOKENS, temperature=0,
                                   input=[{"role": "user", "content": [
                                       input_audio(x), {"type": "input_text", "text": "Listen."}]}],
                                   extra_body={"ignore_eos": True})
    assert resp.output_text == want["choices"][0]["message"]["content"]


def test_an_mp3_clip_is_served(daemon):
    """OpenAI's other input_audio format: an MP3 (libsndfile's encoder) of a clip takes about the clip's tokens."""
    soundfile = pytest.importorskip("soundfile")
    x = tone(12, 2.0)
    buf = io.BytesIO()
    soundfile.write(buf, x.astype(np.float32) / 32768, 16000, format="MP3")
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(), "format": "mp3"}}
    status, got = ask(daemon, [part], "Listen.")
    assert status == 200, got
    _, wav = ask(daemon, [input_audio(x)], "Listen.")
    assert abs(got["usage"]["prompt_tokens"] - wav["usage"]["prompt_tokens"]) <= 2  # (MP3's padding frames)


def test_the_chat_page_sends_audio(daemon, tmp_path):
    """The chat page's request code (chat.js under Node) sends an attached clip's data URL as an input_audio part
    (its base64 and format), and gets the answer the API gives for it."""
    from flared_testing.webui import ask_through_chat_js

    x = tone(13, 0.9)
    url = "data:audio/wav;base64," + base64.b64encode(wav_bytes(x)).decode()
    out = ask_through_chat_js(daemon, url, "Listen.", tmp_path)
    status, want = daemon.chat([{"role": "user", "content": [input_audio(x), {"type": "text", "text": "Listen."}]}],
                               max_tokens=6, temperature=0)
    assert status == 200, want
    assert out["content"] == want["choices"][0]["message"]["content"]
    assert out["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert out["mp3"] == {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "mp3"}}


def test_a_message_that_spells_the_audio_token_is_a_400(daemon):
    status, body = daemon.chat([{"role": "user", "content": "Hear <|AUDIO|> this"}], max_tokens=2)
    assert status == 400 and "1 audio tokens where its clips make 0" in body["error"]["message"], body
