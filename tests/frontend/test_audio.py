"""Audio decoding and Whisper's features (flared.frontend.audio): WAV's sample formats read as their values, other
containers refused by name, the resampler against the sampled sine it should give, and the log-mel features
bit for bit as transformers' WhisperFeatureExtractor computes them (its torch path)."""

from __future__ import annotations

import base64
import io
import struct
import wave

import numpy as np
import pytest

from flared.errors import FrontendError
from flared.frontend.audio import (DecodedAudio, WhisperProcessor, decode_audio, mel_filters, resample)


def _wav(payload: bytes, *, tag: int, channels: int, rate: int, bits: int, extensible: bool = False,
         extra_chunks: bytes = b"") -> bytes:
    align = channels * bits // 8
    fmt = struct.pack("<HHIIHH", 0xFFFE if extensible else tag, channels, rate, rate * align, align, bits)
    if extensible:  # cbSize, valid bits, channel mask, the subformat GUID (its first two bytes the format tag)
        guid_rest = b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
        fmt += struct.pack("<HHI", 22, bits, 0) + struct.pack("<H", tag) + guid_rest
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + extra_chunks + b"data" + struct.pack(
        "<I", len(payload)) + payload + (b"\x00" if len(payload) & 1 else b"")
    return b"RIFF" + struct.pack("<I", len(body)) + body


def test_pcm_and_float_samples_read_as_their_values():
    values = np.array([0.0, 0.5, -0.5, 0.999, -1.0, 0.25], dtype=np.float64)
    i16 = np.round(values * 32767).astype("<i2")
    got = decode_audio(_wav(i16.tobytes(), tag=1, channels=1, rate=16000, bits=16))
    assert got.sample_rate == 16000 and got.samples.dtype == np.float32
    assert np.array_equal(got.samples, (i16 / 32768).astype(np.float32))
    i24 = np.round(values * 8388607).astype(np.int64)
    packed = b"".join(int(v & 0xFFFFFF).to_bytes(3, "little") for v in i24)
    got = decode_audio(_wav(packed, tag=1, channels=1, rate=8000, bits=24, extensible=True))
    assert np.allclose(got.samples, i24 / 8388608, atol=1e-7) and got.sample_rate == 8000
    i32 = np.round(values * 2147483647).astype("<i4")
    assert np.allclose(decode_audio(_wav(i32.tobytes(), tag=1, channels=1, rate=16000, bits=32)).samples,
                       i32 / 2147483648, atol=1e-7)
    u8 = np.round(values * 127 + 128).astype(np.uint8)
    assert np.allclose(decode_audio(_wav(u8.tobytes(), tag=1, channels=1, rate=16000, bits=8)).samples,
                       (u8.astype(np.float64) - 128) / 128)
    f64 = values.astype("<f8")
    got = decode_audio(_wav(f64.tobytes(), tag=3, channels=1, rate=22050, bits=64,
                            extra_chunks=b"LIST" + struct.pack("<I", 3) + b"abc\x00"))  # (an odd chunk, padded)
    assert np.array_equal(got.samples, values.astype(np.float32))


def test_channels_are_averaged_and_python_wave_files_read():
    left, right = np.array([1000, -2000, 300], "<i2"), np.array([3000, 0, -300], "<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(2), w.setsampwidth(2), w.setframerate(44100)
        w.writeframes(np.stack([left, right], 1).tobytes())
    got = decode_audio("data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode())
    assert got.sample_rate == 44100
    assert np.allclose(got.samples, (left / 32768 + right / 32768) / 2)
    assert np.array_equal(decode_audio(base64.b64encode(buf.getvalue()).decode(), format="wav").samples, got.samples)


@pytest.mark.parametrize("data, words", [
    (b"ID3\x04\x00" + bytes(40), "the MP3 audio could not be decoded"),
    (b"fLaC" + bytes(40), "the FLAC audio could not be decoded"),
    (b"OggS" + bytes(40), "the Ogg audio could not be decoded"),
    (b"caff" + bytes(40), "CAF audio is not supported: send WAV, MP3, FLAC or Ogg"),
    (b"hello there, not audio", "this audio is not supported"),
    (b"RIFF\x10\x00\x00\x00WAVEdata\x00\x00\x00\x00", "no 'fmt ' chunk"),
    (_wav(b"", tag=1, channels=1, rate=16000, bits=16), "holds no samples"),
    (_wav(b"\x00\x00" * 4, tag=2, channels=1, rate=16000, bits=16), "format 0x0002"),
    (_wav(np.array([0.0, np.nan], "<f4").tobytes(), tag=3, channels=1, rate=16000, bits=32), "not finite"),
])
def test_what_is_not_wav_is_refused_by_name(data, words):
    with pytest.raises(FrontendError, match=words):
        decode_audio(data)


def _compressed(fmt: str, samples: np.ndarray, rate: int, **kw) -> bytes:
    soundfile = pytest.importorskip("soundfile")
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("fmt, kw, tolerance", [("MP3", {}, 0.02), ("FLAC", {"subtype": "PCM_16"}, 1e-4),
                                                 ("OGG", {"subtype": "VORBIS"}, 0.02)])
def test_compressed_clips_decode_to_their_sound(fmt, kw, tolerance):
    """MP3 (as OpenAI's input_audio sends it), FLAC and Ogg Vorbis, written by libsndfile: a chirp (200 Hz to 2 kHz)
    comes back at its rate and length (MP3's encoder delay aside) as that chirp; stereo is averaged."""
    rate = 22050
    t = np.arange(rate) / rate
    tone = (0.4 * np.sin(2 * np.pi * (200 * t + 900 * t * t))).astype(np.float32)
    stereo = np.stack([tone, tone], 1)
    got = decode_audio(base64.b64encode(_compressed(fmt, stereo, rate, **kw)).decode(), format="mp3")
    assert got.sample_rate == rate and abs(len(got.samples) - rate) < 0.1 * rate
    # (the lag that lines them up best: MP3's decoder delay)
    lag = max(range(0, 3000), key=lambda k: float(np.dot(got.samples[k:k + 4000], tone[:4000])))
    n = min(len(got.samples) - lag, rate) - 2000
    assert np.abs(got.samples[lag + 1000:lag + n] - tone[1000:n]).max() < tolerance * 10
    assert np.sqrt(np.mean((got.samples[lag + 1000:lag + n] - tone[1000:n]) ** 2)) < tolerance


def test_a_compressed_clip_is_decoded_no_further_than_the_limit():
    rate = 8000
    long = np.zeros(rate * 12, np.float32)
    got = decode_audio(_compressed("FLAC", long, rate), max_seconds=5.0)
    assert len(got.samples) == 6 * rate  # (one second more than the limit: enough to see it is too long)


def test_sources_and_formats_that_are_refused():
    for source, words in (("data:audio/webm;base64,AAAA", "send WAV, MP3"), ("https://example.com/a.wav", "data URL"),
                          ("data:audio/wav,abc", "base64-encoded"), ("%%%", "not valid base64"), ("", "empty")):
        with pytest.raises(FrontendError, match=words):
            decode_audio(source)
    with pytest.raises(FrontendError, match="format 'aac' is not supported"):
        decode_audio("AAAA", format="aac")
    big = base64.b64encode(bytes(2048)).decode()
    with pytest.raises(FrontendError, match="audio is too large"):
        decode_audio(big, max_bytes=1024)


@pytest.mark.parametrize("orig, new", [(44100, 16000), (48000, 16000), (8000, 16000), (22050, 16000)])
def test_resampling_keeps_a_sine_in_band(orig, new):
    t = np.arange(orig) / orig  # one second
    x = (0.5 * np.sin(2 * np.pi * 440 * t) + 0.25 * np.sin(2 * np.pi * 3000 * t)).astype(np.float32)
    y = resample(x, orig, new)
    assert len(y) == new
    ty = np.arange(new) / new
    want = 0.5 * np.sin(2 * np.pi * 440 * ty) + 0.25 * np.sin(2 * np.pi * 3000 * ty)
    inner = slice(new // 10, -new // 10)  # (the edges see the zero padding)
    assert np.abs(y[inner] - want[inner]).max() < 2e-3


def test_rates_out_of_range_or_without_a_small_filter_are_refused():
    quiet = np.zeros(10, "<i2").tobytes()
    for rate in (999, 800000):
        with pytest.raises(FrontendError, match="sample rate"):
            decode_audio(_wav(quiet, tag=1, channels=1, rate=rate, bits=16))
    with pytest.raises(FrontendError, match="needs a filter of"):
        resample(np.zeros(44101, np.float32), 44101, 16000)
    for rate in (8000, 11025, 22050, 24000, 32000, 44100, 48000, 88200, 96000, 192000):  # (common rates: quick)
        assert len(resample(np.zeros(rate // 10, np.float32), rate, 16000)) == 1600


def test_resampling_removes_what_the_new_rate_cannot_hold():
    orig = 48000
    t = np.arange(orig) / orig
    y = resample(np.sin(2 * np.pi * 12000 * t).astype(np.float32), orig, 16000)  # (above 8 kHz: aliasing if kept)
    assert np.abs(y[1600:-1600]).max() < 1e-3


def test_mel_filters_and_features_equal_whisper_feature_extractors():
    from transformers import WhisperFeatureExtractor
    from transformers.audio_utils import mel_filter_bank

    for n_mels in (80, 128):
        assert np.array_equal(mel_filters(400, n_mels, 16000), mel_filter_bank(
            num_frequency_bins=201, num_mel_filters=n_mels, min_frequency=0.0, max_frequency=8000.0,
            sampling_rate=16000, norm="slaney", mel_scale="slaney"))
    rng = np.random.default_rng(0)
    extractor, ours = WhisperFeatureExtractor(feature_size=128), WhisperProcessor(feature_size=128)
    for n in (321, 16001, 480000):
        x = (rng.standard_normal(n) * 0.1).astype(np.float32)
        want = extractor(x, sampling_rate=16000, return_attention_mask=True, padding="max_length", return_tensors="np")
        assert np.array_equal(ours.features(x), want["input_features"][0])
        assert ours.num_frames(n) == int(want["attention_mask"].sum())
        prepared = ours.prepare(DecodedAudio(x, 16000))
        conv, tokens = ours.encoder_lengths(ours.num_frames(n))
        assert prepared.num_image_tokens == tokens == (((ours.num_frames(n) - 1) // 2 + 1) - 2) // 2 + 1
        assert prepared.prompt == "<|AUDIO|>" * tokens and prepared.grid == (conv, 1, 1)
        assert np.array_equal(prepared.pixel_values, want["input_features"][0][:, :min(3000, 2 * conv + 1)])


def test_clip_limits_and_identity():
    p = WhisperProcessor(feature_size=16)
    with pytest.raises(FrontendError, match="at most 30 s"):
        p.prepare(DecodedAudio(np.zeros(480001, np.float32), 16000))
    with pytest.raises(FrontendError, match="too short"):
        p.prepare(DecodedAudio(np.zeros(320, np.float32), 16000))
    assert p.prepare(DecodedAudio(np.zeros(321, np.float32), 16000)).num_image_tokens == 1
    x = np.linspace(-0.5, 0.5, 8000, dtype=np.float32)
    a, b = p.prepare(DecodedAudio(x, 16000)), p.prepare(DecodedAudio(x.copy(), 16000))
    assert a.identity == b.identity
    assert p.prepare(DecodedAudio(x[::-1].copy(), 16000)).identity != a.identity
    assert WhisperProcessor(feature_size=80).prepare(DecodedAudio(x, 16000)).identity != a.identity


def test_settings_round_trip_and_bad_extractors():
    from flared.frontend.images import image_processor_from_dict

    p = WhisperProcessor.from_hf({"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128})
    assert image_processor_from_dict(p.to_dict()) == p and p.modality == "audio" and p.placeholder == "<|AUDIO|>"
    for cfg, words in (({"feature_extractor_type": "SeamlessM4TFeatureExtractor"}, "not supported"),
                       ({"dither": 1e-4}, "dither"), ({"do_normalize": True}, "do_normalize"),
                       ({"feature_size": 0}, "positive integer")):
        with pytest.raises(FrontendError, match=words):
            WhisperProcessor.from_hf(cfg)


def test_a_long_recording_is_cut_in_its_pauses():
    from flared.frontend.audio import split_clip

    rate = 1000
    rng = np.random.default_rng(5)
    x = rng.uniform(-0.5, 0.5, 75 * rate).astype(np.float32)
    x[int(28.6 * rate):int(28.9 * rate)] = 0  # (a pause in the two seconds before 30 s)
    x[int(57.2 * rate):int(57.5 * rate)] = 0
    pieces = split_clip(x, rate, 30.0, min_samples=50)
    assert [len(p) for p in pieces] == [28650, 28650, 75000 - 57300]  # (cut at each pause's quietest block's middle)
    assert np.array_equal(np.concatenate(pieces), x)
    assert all(len(p) <= 30 * rate for p in pieces)
    loud = rng.uniform(-0.5, 0.5, 61 * rate).astype(np.float32)
    pieces = split_clip(loud, rate, 30.0)
    assert len(pieces) == 3 and np.array_equal(np.concatenate(pieces), loud)
    assert all(28 * rate <= len(p) <= 30 * rate for p in pieces[:2])  # (no pause: the quietest block still)
    tail = np.concatenate([loud[:30 * rate], loud[:20]])  # (a last piece too short to hear is left out)
    assert [len(p) for p in split_clip(tail, rate, 30.0, search_seconds=0.0, min_samples=50)] == [30 * rate]


def test_hostile_wav_bytes_are_a_clear_error_or_a_clip():
    """Mutated WAV files (sizes, tags, channel counts, truncations, random bytes after the header) decode to a clip
    or raise FrontendError; nothing else escapes (a 400, and the daemon keeps serving)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    good = _wav(np.arange(-40, 40, dtype="<i2").tobytes(), tag=1, channels=2, rate=16000, bits=16)

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(st.lists(st.tuples(st.integers(0, len(good) - 1), st.integers(0, 255)), max_size=6),
           st.integers(0, len(good)), st.binary(max_size=64))
    def check(flips, cut, tail):
        data = bytearray(good[:cut]) + tail
        for at, value in flips:
            if at < len(data):
                data[at] = value
        try:
            clip = decode_audio(bytes(data))
        except FrontendError:
            return
        assert clip.samples.dtype == np.float32 and clip.samples.ndim == 1 and len(clip.samples) > 0
        assert np.isfinite(clip.samples).all() and 1000 <= clip.sample_rate <= 768000

    check()
