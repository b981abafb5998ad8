"""The windowed audio models end to end, each a random-weight model exported and served by a real `flared run`, its
greedy tokens checked against transformers' model fed by its own processor on the same weights, samples and prompt,
for clips of one 30-second window and of two, and their max_audio_len (60 s here) enforced:

- Audio Flamingo 3: Qwen2-Audio's Whisper encoder, a two-linear GELU projector, a Qwen2 decoder
  (AudioFlamingo3ForConditionalGeneration, AudioFlamingo3Processor);
- GLM-ASR: a Whisper-shaped encoder whose layers turn half of each head by a rope and attend over the whole window,
  its padding too; four rows merged a token; a Llama decoder (GlmAsrForConditionalGeneration, GlmAsrProcessor)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from flared_testing.audio import input_audio, tone  # noqa: E402

NEW_TOKENS = 10
# family -> (the model and processor classes' names, a seed offset, the frames past 30 s of a second window too short
# to make a token, the shortest clip that makes one)
FAMILIES = {"audioflamingo3": ("AudioFlamingo3ForConditionalGeneration", "AudioFlamingo3Processor", 0, 321, "20 ms"),
            "glmasr": ("GlmAsrForConditionalGeneration", "GlmAsrProcessor", 1, 481, "60 ms")}


def ask(daemon, parts, text: str):
    from flared_testing.audio import ask as _ask

    return _ask(daemon, parts, text, NEW_TOKENS)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, tmp_path_factory):
    """(family, checkpoint, daemon)."""
    from flared_testing.daemon import Daemon

    checkpoint, core = request.getfixturevalue(f"tiny_{request.param}")
    d = Daemon(core, tmp_path_factory.mktemp(f"{request.param}-daemon"))
    yield request.param, checkpoint, d
    d.kill()


def test_greedy_tokens_match_transformers(served):
    """A clip of one window, one of exactly 30 s, and two of two windows: 41.5 s, and 30 s and a few samples
    (whose second window makes no token)."""
    import transformers as tf
    from flared_testing.audio import assert_clips_match, transformers_reference

    family, checkpoint, daemon = served
    model, processor, seed, past, _ = FAMILIES[family]
    reference = transformers_reference(checkpoint, getattr(tf, model), getattr(tf, processor), NEW_TOKENS,
                                       max_audio_len=60)
    assert_clips_match(daemon, reference, [([tone(int(s * 10) + seed, s)], text) for s, text in (
        (3.2, "Describe the sound."), (30.0, "Whole window."), (41.5, "Two windows."),
        (30.0 + past / 16000, "Barely two."))], NEW_TOKENS)


def test_the_models_longest_and_shortest_clips(served):
    family, _, daemon = served
    status, body = ask(daemon, [input_audio(tone(1, 60.5))], "Too long.")
    assert status == 400 and "at most 60 s" in body["error"]["message"], body
    status, body = ask(daemon, [input_audio(tone(3, 0.015 if family == "audioflamingo3" else 0.055))], "Hm?")
    assert status == 400 and "too short" in body["error"]["message"], body
    assert FAMILIES[family][4] in body["error"]["message"], body
    status, body = ask(daemon, [input_audio(tone(3, 0.07))], "Still serving?")  # (70 ms: a token for both)
    assert status == 200, body
