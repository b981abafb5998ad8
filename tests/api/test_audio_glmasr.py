"""GLM-ASR (a Whisper-shaped encoder whose layers turn half of each head by a rope and attend over the whole window,
its padding too; four rows merged a token; a Llama decoder) end to end: a random-weight model exported and served by
a real `flared run`, its greedy tokens checked against transformers' GlmAsrForConditionalGeneration fed by
GlmAsrProcessor on the same weights, samples and prompt, for one window and for two."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from flared_testing.audio import input_audio, tone  # noqa: E402

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
    from flared_testing.audio import transformers_reference
    from transformers import GlmAsrForConditionalGeneration, GlmAsrProcessor

    return transformers_reference(tiny_glmasr[0], GlmAsrForConditionalGeneration, GlmAsrProcessor, NEW_TOKENS,
                                  max_audio_len=60)


def test_greedy_tokens_match_transformers(daemon, reference):
    """A clip of one window, one of exactly 30 s, two of two windows (41.5 s; 30 s and a few frames, whose second
    window makes no token)."""
    from flared_testing.audio import assert_clips_match

    assert_clips_match(daemon, reference, [([tone(int(s * 10) + 1, s)], text) for s, text in (
        (3.2, "Transcribe it."), (30.0, "Whole window."), (41.5, "Two windows."),
        (30.0 + 481 / 16000, "Barely two."))], NEW_TOKENS)


def test_a_clip_too_short_for_a_token_is_a_400(daemon):
    status, body = ask(daemon, [input_audio(tone(3, 0.055))], "Hm?")
    assert status == 400 and "too short" in body["error"]["message"] and "60 ms" in body["error"]["message"], body
    status, body = ask(daemon, [input_audio(tone(3, 0.07))], "Hm?")
    assert status == 200, body
