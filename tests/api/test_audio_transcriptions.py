"""OpenAI's /v1/audio/transcriptions and /v1/audio/translations on an audio-language model (a random-weight
Qwen2-Audio through a real `flared run`), driven by the openai SDK as a user would: the transcript is the model's
greedy answer to the clip and the route's instruction (the same turn asked through /v1/chat/completions gives the
same text), in OpenAI's json, text, verbose_json and streamed shapes; what needs timestamps is a 400."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from flared_testing.audio import tone, wav_bytes  # noqa: E402


@pytest.fixture(scope="module")
def daemon(tiny_qwen2_audio, tmp_path_factory):
    from flared_testing.daemon import Daemon

    d = Daemon(tiny_qwen2_audio[1], tmp_path_factory.mktemp("transcribe-daemon"))
    yield d
    d.kill()


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=f"{daemon.base}/v1", api_key="none", max_retries=0)


def chat_answer(daemon, wav: bytes, instruction: str, max_tokens: int) -> tuple[str, dict]:
    import base64

    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
    status, body = daemon.chat([{"role": "user", "content": [part, {"type": "text", "text": instruction}]}],
                               temperature=0, max_tokens=max_tokens)
    assert status == 200, body
    return body["choices"][0]["message"]["content"].strip(), body["usage"]


def test_a_transcript_is_the_models_answer_to_the_instruction(daemon, client):
    wav = wav_bytes(tone(21, 1.5))
    got = client.audio.transcriptions.create(model="tiny", file=("clip.wav", wav, "audio/wav"),
                                             extra_body={"max_completion_tokens": 12})
    want, usage = chat_answer(daemon, wav, "Transcribe the input speech.", 12)
    assert got.text == want and want
    assert got.usage.type == "tokens" and got.usage.input_tokens == usage["prompt_tokens"]
    assert got.usage.output_tokens == usage["completion_tokens"]
    assert got.usage.input_token_details.audio_tokens == 37  # (150 frames: 75 rows, 37 tokens)
    in_french = client.audio.transcriptions.create(model="tiny", file=("clip.wav", wav, "audio/wav"), language="fr",
                                                   prompt="Bonjour.", extra_body={"max_completion_tokens": 12})
    want, _ = chat_answer(daemon, wav, "Transcribe the input speech. The speech is in French.\nBonjour.", 12)
    assert in_french.text == want
    english = client.audio.translations.create(model="tiny", file=("clip.wav", wav, "audio/wav"),
                                               extra_body={"max_completion_tokens": 12})
    want, _ = chat_answer(daemon, wav, "Translate the input speech into English.", 12)
    assert english.text == want


def test_text_and_verbose_json_and_the_stream(daemon, client):
    wav = wav_bytes(tone(22, 2.0))
    kw = dict(model="tiny", file=("clip.wav", wav, "audio/wav"), extra_body={"max_completion_tokens": 10})
    plain = client.audio.transcriptions.create(response_format="json", **kw).text
    text = client.audio.transcriptions.create(response_format="text", **kw)
    assert isinstance(text, str) and text.strip() == plain
    verbose = client.audio.transcriptions.create(response_format="verbose_json", language="en", **kw)
    assert verbose.text == client.audio.transcriptions.create(language="en", **kw).text
    assert verbose.duration == 2.0 and verbose.language == "english" and verbose.task == "transcribe"
    events = list(client.audio.transcriptions.create(stream=True, **kw))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    done = [e for e in events if e.type == "transcript.text.done"]
    assert len(done) == 1 and done[0].text == "".join(deltas).strip() == plain
    assert done[0].usage.output_tokens == 10


def test_what_the_routes_cannot_do_is_a_400(daemon, client):
    wav = wav_bytes(tone(23, 0.5))
    for kw, words in ((dict(response_format="srt"), "needs timestamps"),
                      (dict(response_format="verbose_json", timestamp_granularities=["word"]), "needs timestamps"),
                      (dict(language="english!"), "ISO-639-1"), (dict(temperature=5), "between")):
        with pytest.raises(openai.BadRequestError) as e:
            client.audio.transcriptions.create(model="tiny", file=("clip.wav", wav, "audio/wav"), **kw)
        assert words in e.value.body["message"], e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.transcriptions.create(model="tiny", file=("clip.aac", b"\x00\x01" * 100, "audio/aac"))
    assert e.value.body["param"] == "file" and "not supported" in e.value.body["message"]
    status, body = daemon.request("POST", "/v1/audio/transcriptions", {"model": "tiny"})
    assert status == 400 and "multipart/form-data" in body["error"]["message"], body
    with pytest.raises(openai.NotFoundError):
        client.audio.transcriptions.create(model="whisper-1", file=("clip.wav", wav, "audio/wav"))
    assert client.audio.transcriptions.create(model="tiny", file=("clip.wav", wav, "audio/wav"),
                                              extra_body={"max_completion_tokens": 3}).text is not None


def test_a_text_model_has_no_transcriptions(tiny_core, start_daemon):
    d = start_daemon(tiny_core)
    client = openai.OpenAI(base_url=f"{d.base}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.transcriptions.create(model="tiny", file=("clip.wav", wav_bytes(tone(24, 0.5)), "audio/wav"))
    assert "this model takes text, not audio" in e.value.body["message"]


def test_a_recording_longer_than_the_models_clip_is_transcribed_in_pieces(daemon, client):
    """Qwen2-Audio hears 30 s at most: a 63.5-second recording is cut in its two pauses (split_clip) and each piece
    asked alone, at once; the transcript is the pieces' answers joined in order, streamed in that order too."""
    import numpy as np

    from flared.frontend.audio import split_clip

    x = np.concatenate([tone(31, 28.7), np.zeros(4000, np.int16), tone(32, 29.0), np.zeros(4000, np.int16),
                        tone(33, 5.3)])
    wav = wav_bytes(x)
    kw = dict(model="tiny", file=("long.wav", wav, "audio/wav"), extra_body={"max_completion_tokens": 6})
    got = client.audio.transcriptions.create(**kw)
    pieces = split_clip(x.astype(np.float32) / 32768, 16000, 30)
    assert [round(len(p) / 16000, 2) for p in pieces] == [28.75, 29.25, 5.5]  # (each cut 50 ms into a pause)
    answers = []
    for piece in pieces:
        text, _ = chat_answer(daemon, wav_bytes(np.round(piece * 32768).astype(np.int16)),
                              "Transcribe the input speech.", 6)
        answers.append(text)
    assert got.text == " ".join(a for a in answers if a)
    assert got.usage.input_token_details.audio_tokens == sum((((len(p) + 159) // 160 - 1) // 2 + 1 - 2) // 2 + 1
                                                             for p in pieces)
    events = list(client.audio.transcriptions.create(stream=True, **kw))
    assert [e for e in events if e.type == "transcript.text.done"][0].text == got.text
    assert "".join(e.delta for e in events if e.type == "transcript.text.delta") == got.text
