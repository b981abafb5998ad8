"""Audio for the audio models' tests: deterministic clips, WAV files of them, and OpenAI's input_audio parts."""

from __future__ import annotations

import base64
import io
import struct
import wave

import numpy as np


def tone(seed: int, seconds: float, rate: int = 16000) -> np.ndarray:
    """A few random tones and some noise, as 16-bit samples' values (what a 16-bit WAV decodes to)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    x = sum(rng.uniform(0.1, 0.3) * np.sin(2 * np.pi * rng.uniform(100, 4000) * t) for _ in range(3))
    x = x + rng.normal(0, 0.02, len(t))
    return np.round(np.clip(x, -1, 1) * 32767).astype(np.int16)


def wav_bytes(samples: np.ndarray, rate: int = 16000, channels: int = 1) -> bytes:
    """A 16-bit PCM WAV of ``samples`` (interleaved frames where ``channels`` > 1), written by Python's wave."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.astype("<i2").tobytes())
    return buf.getvalue()


def float_wav(values: np.ndarray, rate: int) -> bytes:
    """A WAV of 32-bit IEEE float samples (format 3), mono."""
    data = values.astype("<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    return (b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data)) + b"WAVE" + b"fmt " +
            struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data)


def input_audio(samples, rate=16000, channels=1) -> dict:
    """OpenAI's input_audio content part of a 16-bit WAV of ``samples``."""
    data = base64.b64encode(wav_bytes(samples, rate, channels)).decode()
    return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}


def ask(daemon, parts, text: str, max_tokens: int, **kw):
    """One user turn of ``parts`` then text through /v1/chat/completions, greedy, ``max_tokens`` tokens (EOS
    ignored), with the token ids and three alternatives a step (flared_testing.vision.assert_greedy)."""
    return daemon.chat([{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
                       max_tokens=max_tokens, temperature=0, logprobs=True, top_logprobs=3,
                       return_tokens_as_token_ids=True, ignore_eos=True, **kw)


def transformers_reference(checkpoint, model_class, processor_class, new_tokens: int, **processor_kwargs):
    """``run(clips, text)`` -> (prompt tokens, greedy tokens) of transformers' ``model_class`` on a test checkpoint,
    fed by ``processor_class`` (its WhisperFeatureExtractor from preprocessor_config.json, the checkpoint's
    tokenizer and chat template) as its model card shows: one user turn of the clips (16-bit values) then text."""
    import json

    import torch
    from transformers import PreTrainedTokenizerFast, WhisperFeatureExtractor

    model = model_class.from_pretrained(checkpoint, dtype=torch.float32).eval()
    template = json.loads((checkpoint / "tokenizer_config.json").read_text())["chat_template"]
    tok = PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"), eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    settings = json.loads((checkpoint / "preprocessor_config.json").read_text())
    features = WhisperFeatureExtractor(**{k: v for k, v in settings.items()
                                          if k not in ("feature_extractor_type", "processor_class")})
    processor = processor_class(feature_extractor=features, tokenizer=tok, chat_template=template, **processor_kwargs)

    def run(clips, text: str):
        content = [{"type": "audio", "audio": "clip"} for _ in clips] + [{"type": "text", "text": text}]
        prompt = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                               add_generation_prompt=True)
        inputs = processor(text=prompt, audio=[c.astype(np.float32) / 32768 for c in clips], sampling_rate=16000,
                           return_tensors="pt")
        with torch.no_grad():
            gen = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        n = inputs["input_ids"].shape[1]
        return n, gen[0, n:].tolist()

    return run


def assert_clips_match(daemon, reference, cases, new_tokens: int) -> None:
    """Each (clips, text) user turn asked greedily of the daemon: its prompt length and tokens are what
    ``reference(clips, text)`` (transformers) gives."""
    from flared_testing.vision import assert_greedy

    for clips, text in cases:
        status, body = ask(daemon, [input_audio(c) for c in clips], text, new_tokens)
        assert status == 200, body
        num_prompt, expected = reference(clips, text)
        assert body["usage"]["prompt_tokens"] == num_prompt, ([len(c) for c in clips], text)
        assert_greedy(body, expected, ([len(c) for c in clips], text))


def gemma4_clip_tokens(mask) -> int:
    """transformers' Gemma4Processor.replace_audio_token count: the clip's frame mask halved twice, its ones."""
    t = len(mask)
    for _ in range(2):
        t_out = (t + 2 - 3) // 2 + 1
        mask = mask[::2][:t_out]
        t = len(mask)
    return int(mask.sum())
