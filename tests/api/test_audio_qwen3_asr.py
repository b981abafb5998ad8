"""Qwen3-ASR end to end: a random-weight model exported and served by a real `flared run`, its greedy tokens checked
against transformers' Qwen3ASRForConditionalGeneration fed by Qwen3ASRProcessor on the same weights, samples and
prompt (one clip a turn, as its processor takes them; two clips against the model fed each clip's own features),
and OpenAI's /v1/audio/transcriptions asked as the model's own package asks it, through the openai SDK."""

from __future__ import annotations

import base64

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_asr")
openai = pytest.importorskip("openai")

from flared_testing.audio import tone, wav_bytes  # noqa: E402

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def daemon(tiny_qwen3_asr, tmp_path_factory):
    from flared_testing.daemon import Daemon

    d = Daemon(tiny_qwen3_asr[1], tmp_path_factory.mktemp("qwen3-asr-daemon"))
    yield d
    d.kill()


@pytest.fixture(scope="module")
def reference(tiny_qwen3_asr):
    """``run(clips, messages_before, text)`` -> (prompt tokens, greedy tokens) of transformers' model: one user
    turn of the clips then ``text``, the clips' features each made alone by Qwen3ASRFeatureExtractor (as
    Qwen3ASRProcessor makes one clip's), their audio tokens expanded as it expands them."""
    import json

    import torch
    from transformers import PreTrainedTokenizerFast, Qwen3ASRForConditionalGeneration, Qwen3ASRProcessor
    from transformers.models.qwen3_asr.feature_extraction_qwen3_asr import Qwen3ASRFeatureExtractor

    checkpoint = tiny_qwen3_asr[0]
    model = Qwen3ASRForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    template = json.loads((checkpoint / "tokenizer_config.json").read_text())["chat_template"]
    tok = PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"), eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>",
                                  extra_special_tokens={"audio_token": "<|audio_pad|>",
                                                        "audio_bos_token": "<|audio_start|>",
                                                        "audio_eos_token": "<|audio_end|>"})
    extractor = Qwen3ASRFeatureExtractor(feature_size=16)
    processor = Qwen3ASRProcessor(feature_extractor=extractor, tokenizer=tok, chat_template=template)

    def generate(inputs):
        with torch.no_grad():
            gen = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        n = inputs["input_ids"].shape[1]
        return n, gen[0, n:].tolist()

    def run(clips, text: str):
        content = [{"type": "audio", "audio": "clip"} for _ in clips] + [{"type": "text", "text": text}]
        prompt = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                               add_generation_prompt=True)
        samples = [c.astype(np.float32) / 32768 for c in clips]
        if len(clips) == 1:
            return generate(processor(text=prompt, audio=samples, sampling_rate=16000, return_tensors="pt"))
        parts = [extractor(s, sampling_rate=16000, padding=True, return_attention_mask=True, return_tensors="pt")
                 for s in samples]
        width = max(p["input_features"].shape[-1] for p in parts)
        features = torch.cat([torch.nn.functional.pad(p["input_features"], (0, width - p["input_features"].shape[-1]))
                              for p in parts])
        mask = torch.cat([torch.nn.functional.pad(p["attention_mask"], (0, width - p["attention_mask"].shape[-1]))
                          for p in parts])
        counts = processor._get_audio_token_length(mask.sum(-1), 50)
        for count in counts:  # (each placeholder in turn: its clip's tokens)
            prompt = prompt.replace("<|audio_pad|>", "\0" * int(count), 1)
        ids = tok(prompt.replace("\0", "<|audio_pad|>"), return_tensors="pt")
        return generate({**ids, "input_features": features, "input_features_mask": mask})

    return run


def test_greedy_tokens_match_transformers(daemon, reference):
    from flared_testing.audio import assert_clips_match

    assert_clips_match(daemon, reference, [
        ([tone(31, 0.2)], "Short."), ([tone(32, 1.0)], "One second."), ([tone(33, 9.7)], "Two windows."),
        ([tone(34, 23.45)], "Longer than a window."), ([tone(35, 1.3), tone(36, 2.6)], "Two clips.")], NEW_TOKENS)


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=f"{daemon.base}/v1", api_key="none", max_retries=0)


def _answer(daemon, wav: bytes, messages_after: list, max_tokens: int, **kw) -> tuple[str, dict]:
    """The chat the transcription route renders, asked through /v1/chat/completions."""
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
    status, body = daemon.chat([*messages_after[:1], {"role": "user", "content": [part]}, *messages_after[1:]],
                               temperature=0, max_tokens=max_tokens, **kw)
    assert status == 200, body
    return body["choices"][0]["message"]["content"], body["usage"]


def test_a_transcription_is_asked_as_the_models_own_package_asks(daemon, client):
    """The context as the system turn, the clip alone, the language forced by starting the answer with
    ``language <Name><asr_text>``; the answer's own prefix is taken off (none here: random weights)."""
    wav = wav_bytes(tone(41, 1.7))
    got = client.audio.transcriptions.create(model="tiny", file=("clip.wav", wav, "audio/wav"),
                                             extra_body={"max_completion_tokens": 8})
    want, usage = _answer(daemon, wav, [{"role": "system", "content": ""}], 8)
    assert got.text == want.strip() and want
    assert got.usage.input_tokens == usage["prompt_tokens"] and got.usage.output_tokens == usage["completion_tokens"]
    assert got.usage.input_token_details.audio_tokens == 22  # (170 frames: 13 + 9 rows)
    forced = client.audio.transcriptions.create(model="tiny", file=("clip.wav", wav, "audio/wav"), language="de",
                                                prompt="Kontext.", extra_body={"max_completion_tokens": 8})
    want, _ = _answer(daemon, wav, [{"role": "system", "content": "Kontext."},
                                    {"role": "assistant", "content": "language German<asr_text>"}], 8,
                      continue_final_message=True, add_generation_prompt=False)
    assert forced.text == want.strip()
    verbose = client.audio.transcriptions.create(model="tiny", file=("clip.wav", wav, "audio/wav"), language="de",
                                                 response_format="verbose_json", prompt="Kontext.",
                                                 extra_body={"max_completion_tokens": 8})
    assert verbose.text == forced.text and verbose.language == "german"
    events = list(client.audio.transcriptions.create(model="tiny", file=("clip.wav", wav, "audio/wav"), stream=True,
                                                     extra_body={"max_completion_tokens": 8}))
    done = [e for e in events if e.type == "transcript.text.done"]
    assert done[0].text == "".join(e.delta for e in events if e.type == "transcript.text.delta").strip() == got.text


def test_it_does_not_translate(client):
    with pytest.raises(openai.BadRequestError, match="does not translate"):
        client.audio.translations.create(model="tiny", file=("clip.wav", wav_bytes(tone(42, 0.5)), "audio/wav"))


@pytest.mark.parametrize("chunks, forced, text, language", [
    (["language", " English", "<asr_text>", "Hello", " world"], False, "Hello world", "English"),
    (["language None<asr_text>"], False, "", None),
    (["Hello", " there"], False, "Hello there", None),
    (["language is", " a tool", " of thought"], False, "language is a tool of thought", None),
    (["language Eng"], False, "", None),  # (cut off inside the prefix: no transcript yet)
    (["Hallo", " Welt"], True, "Hallo Welt", None),
    (["language German<asr_text>x"], True, "language German<asr_text>x", None),  # (forced: the text is the text)
])
def test_the_answers_prefix_is_taken_off(chunks, forced, text, language):
    from flared.server.audio_routes import AsrAnswer

    answer = AsrAnswer(forced=forced)
    assert "".join(answer.push(c) for c in chunks) + answer.finish() == text
    assert answer.language == language
