"""Audio Flamingo 3 (Qwen2-Audio's Whisper encoder over 30-second windows, a two-linear GELU projector, a Qwen2
decoder) end to end: a random-weight model exported and served by a real `flared run`, its greedy tokens checked
against transformers' AudioFlamingo3ForConditionalGeneration fed by AudioFlamingo3Processor on the same weights,
samples and prompt, for clips of one window and of two (past 30 s), and its max_audio_len enforced."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from flared_testing.audio import input_audio, tone  # noqa: E402

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
    from flared_testing.audio import transformers_reference
    from transformers import AudioFlamingo3ForConditionalGeneration, AudioFlamingo3Processor

    return transformers_reference(tiny_audioflamingo3[0], AudioFlamingo3ForConditionalGeneration,
                                  AudioFlamingo3Processor, NEW_TOKENS, max_audio_len=60)


def test_greedy_tokens_match_transformers(daemon, reference):
    """A clip of one window, one of exactly 30 s, and two of two windows: 41.5 s, and 30 s and two frames (whose
    second window's frames make no token)."""
    from flared_testing.audio import assert_clips_match

    assert_clips_match(daemon, reference, [([tone(int(s * 10), s)], text) for s, text in (
        (3.2, "Describe the sound."), (30.0, "Whole window."), (41.5, "Two windows."),
        (30.0 + 321 / 16000, "Barely two."))], NEW_TOKENS)


def test_the_models_longest_clip_is_its_max_audio_len(daemon):
    status, body = ask(daemon, [input_audio(tone(1, 60.5))], "Too long.")
    assert status == 400 and "at most 60 s" in body["error"]["message"], body
    status, body = ask(daemon, [input_audio(tone(2, 1.0))], "Still serving?")
    assert status == 200, body
