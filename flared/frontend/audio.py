"""Audio a client sends, decoded and turned into what an audio model's encoder reads (on a frontend worker).

    decode_audio(source)       a WAV file (a data URL, bare base64 as OpenAI's ``input_audio.data``, or bytes) ->
                               DecodedAudio: mono float32 samples at the file's rate
    resample(samples, a, b)    band-limited resampling (a Kaiser-windowed sinc, torchaudio's "kaiser_best")
    WhisperProcessor           Whisper's log-mel features (transformers' WhisperFeatureExtractor, its torch path,
                               bit for bit), in 30-second windows, and the clip's audio tokens (Qwen2-Audio's,
                               Audio Flamingo 3's): ``prepare`` -> PreparedImage
    Qwen3AsrProcessor          the same frames over a whole clip (Qwen3-ASR's extractor), in one-second chunks
    UsmProcessor               Gemma 4's audio frames

A prepared clip travels the path a prepared image does (flared.frontend.images.PreparedImage): its features in
``pixel_values``, the text that replaces its placeholder in ``prompt``, its tokens' count, and its identity (the
16 kHz samples' digest and the settings), so the tower's rows, the LRU of recent rows and the prefix cache treat a
clip as an image.

WAV (PCM 8/16/24/32-bit, IEEE float 32/64, WAVE_FORMAT_EXTENSIBLE of those) is read here, exactly; MP3, FLAC and
Ogg (Vorbis, Opus) through libsndfile (the ``soundfile`` package, which librosa, transformers and vLLM read audio
with too); anything else is a 400 that says what it is. Channels are averaged to mono (as librosa's
``load(mono=True)``). A clip longer than the encoder's window (30 s for Whisper) is a 400, never cut silently;
a compressed clip is decoded no further than ``max_seconds``.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
import json
import math
import struct
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from flared.errors import ErrorKind, FrontendError
from flared.frontend.images import PreparedImage, _error, _mib, source_bytes

DEFAULT_MAX_AUDIO_BYTES = 10 << 20

_WAVE_PCM, _WAVE_FLOAT, _WAVE_EXTENSIBLE = 0x0001, 0x0003, 0xFFFE
_WAV_MEDIA = {"audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave", "audio/x-pn-wav"}
_AUDIO_MEDIA = _WAV_MEDIA | {"audio/mpeg", "audio/mp3", "audio/mpeg3", "audio/x-mpeg-3", "audio/flac", "audio/x-flac",
                             "audio/ogg", "audio/opus", "application/ogg"}
# OpenAI's input_audio "format" ("wav", "mp3"), and the other containers libsndfile reads
FORMATS = ("wav", "mp3", "flac", "ogg", "opus")
_SNIFFED = ((b"ID3", "MP3"), (b"fLaC", "FLAC"), (b"OggS", "Ogg"))
_REFUSED = ((b"caff", "CAF"), (b"FORM", "AIFF"), (b"\x1aE\xdf\xa3", "WebM/Matroska"), (b"#!AMR", "AMR"))
DEFAULT_MAX_SECONDS = 60.0
MIN_RATE, MAX_RATE = 1000, 768000  # sample rates taken (Hz)
_MAX_KERNEL = 1 << 22  # the resampling filter's coefficients at most (16 MiB of float32)


@dataclass(frozen=True)
class DecodedAudio:
    samples: np.ndarray  # float32 [n], mono, in [-1, 1] for integer PCM
    sample_rate: int

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.sample_rate


def decode_audio(source: str | bytes | DecodedAudio, *, max_bytes: int = DEFAULT_MAX_AUDIO_BYTES,
                 format: str | None = None, max_seconds: float = DEFAULT_MAX_SECONDS) -> DecodedAudio:
    """Decode one clip a client sent: a data URL (``data:audio/wav;base64,...``), bare base64 (OpenAI's
    ``input_audio.data``, whose ``format`` names the container: the bytes decide, the name only has to be one
    of ``FORMATS``) or raw bytes; a clip already decoded (a route that read the file itself) as it is. Raises
    ``FrontendError`` with a message meant for the client."""
    if isinstance(source, DecodedAudio):
        return source
    if format is not None and format.lower() not in FORMATS:
        raise _error(f"audio format {format!r} is not supported (one of {', '.join(FORMATS)})")
    data = source_bytes(source, max_bytes, medium="audio", media_types=_AUDIO_MEDIA,
                        supported="send WAV, MP3, FLAC or Ogg", example="data:audio/wav;base64,...", typed=False)
    if not data:
        raise _error("audio data is empty")
    if len(data) > max_bytes:
        raise _error(f"audio is too large: {_mib(len(data))}; the limit is {_mib(max_bytes)}")
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return _read_wav(data)
    return _read_compressed(data, max_seconds)


_IMAGE_MAGIC = (b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"BM", b"II*\0", b"MM\0*")


def media_kind(source: str | bytes, default: str) -> str:
    """"audio" or "image": what base64 text (or bytes) starts as (llama.cpp's multimodal_data tells images and clips
    apart by their bytes); ``default`` where neither shows (the bytes are then decoded as that, to say what is
    wrong with them)."""
    head = source[:64] if isinstance(source, (bytes, bytearray)) else None
    if head is None:
        try:
            text = source.strip()[:64]
            head = base64.b64decode(text[:len(text) // 4 * 4], validate=False)
        except (ValueError, binascii.Error):
            return default
    head = bytes(head)
    if (head[:4] == b"RIFF" and head[8:12] == b"WAVE") or _sniff(head) is not None:
        return "audio"
    if head.startswith(_IMAGE_MAGIC) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP"):
        return "image"
    return default


def _sniff(data: bytes) -> str | None:
    """The container ``data`` starts as, among those libsndfile reads (MP3 with or without an ID3 tag)."""
    name = next((name for magic, name in _SNIFFED if data.startswith(magic)), None)
    if name is None and len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0:  # an MPEG audio frame
        name = "MP3"
    return name


def _read_compressed(data: bytes, max_seconds: float) -> DecodedAudio:
    """MP3, FLAC or Ogg through libsndfile: float32 samples, channels averaged, at most ``max_seconds`` (a small
    file may hold hours) plus one, so that what is too long is seen to be."""
    name = _sniff(data)
    if name is None:
        other = next((n for magic, n in _REFUSED if data.startswith(magic)), "this")
        raise _error(f"{other} audio is not supported: send WAV, MP3, FLAC or Ogg")
    try:
        import soundfile
    except ImportError:  # (a dependency; only a broken install lacks it)
        raise _error(f"{name} audio needs the soundfile package on the server; send WAV",
                     ErrorKind.UNSUPPORTED) from None
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            rate, channels = int(f.samplerate), int(f.channels)
            if rate < 1 or channels < 1:
                raise _error(f"the {name} audio declares {rate} Hz and {channels} channels")
            values = f.read(frames=int(rate * (max_seconds + 1)), dtype="float32", always_2d=True)
    except FrontendError:
        raise
    except Exception as exc:  # noqa: BLE001 - libsndfile's errors (LibsndfileError, RuntimeError, ...)
        raise _error(f"the {name} audio could not be decoded ({exc})") from None
    if len(values) == 0:
        raise _error(f"the {name} audio holds no samples")
    if not np.isfinite(values).all():
        raise _error(f"the {name} audio decodes to samples that are not finite numbers")
    mono = values.mean(axis=1, dtype=np.float64) if channels > 1 else values[:, 0]
    return DecodedAudio(np.ascontiguousarray(mono, dtype=np.float32), _rate(rate))


def _rate(rate: int) -> int:
    if not MIN_RATE <= rate <= MAX_RATE:
        raise _error(f"the audio's sample rate of {rate} Hz is not taken ({MIN_RATE} to {MAX_RATE} Hz)")
    return int(rate)


def _read_wav(data: bytes) -> DecodedAudio:
    fmt, payload, pos = None, None, 12
    while pos + 8 <= len(data):
        chunk, size = data[pos:pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        body = data[pos + 8:pos + 8 + size]
        if chunk == b"fmt ":
            fmt = body
        elif chunk == b"data":
            payload = body  # (a streamed WAV's size may run past the file: what is there is read)
            break
        pos += 8 + size + (size & 1)
    if fmt is None or len(fmt) < 16:
        raise _error("the WAV data has no 'fmt ' chunk")
    if payload is None:
        raise _error("the WAV data has no 'data' chunk")
    tag, channels, rate, _, align, bits = struct.unpack_from("<HHIIHH", fmt)
    if tag == _WAVE_EXTENSIBLE and len(fmt) >= 40:
        tag = struct.unpack_from("<H", fmt, 24)[0]  # the subformat GUID's first two bytes
    if channels < 1 or rate < 1 or align != channels * ((bits + 7) // 8):
        raise _error(f"the WAV header is inconsistent ({channels} channels, {rate} Hz, {bits} bits, block {align})")
    width = align // channels
    frames = len(payload) // align
    raw = payload[:frames * align]
    if tag == _WAVE_PCM and width in (1, 2, 3, 4):
        if width == 3:
            b = np.frombuffer(raw, np.uint8).reshape(-1, 3)
            ints = (b[:, 0].astype(np.int32) | (b[:, 1].astype(np.int32) << 8) | (b[:, 2].astype(np.int32) << 16))
            values = ((ints << 8) >> 8).astype(np.float64) / (1 << 23)  # sign-extend the 24 bits
        elif width == 1:  # 8-bit WAV is unsigned
            values = (np.frombuffer(raw, np.uint8).astype(np.float64) - 128.0) / 128.0
        else:
            kind = {2: "<i2", 4: "<i4"}[width]
            values = np.frombuffer(raw, kind).astype(np.float64) / float(1 << (8 * width - 1))
    elif tag == _WAVE_FLOAT and width in (4, 8):
        values = np.frombuffer(raw, "<f4" if width == 4 else "<f8").astype(np.float64)
        if not np.isfinite(values).all():
            raise _error("the WAV data holds samples that are not finite numbers")
    else:
        raise _error(f"WAV samples of format {tag:#06x} at {bits} bits are not supported "
                     "(PCM 8/16/24/32-bit or IEEE float 32/64)")
    if frames == 0:
        raise _error("the WAV data holds no samples")
    mono = values.reshape(frames, channels).mean(axis=1) if channels > 1 else values
    return DecodedAudio(mono.astype(np.float32), _rate(rate))


# ---------------------------------------------------------------------------------------------------- resampling

# torchaudio's "kaiser_best" (and librosa's former default, resampy's kaiser_best): 64 zero crossings a side
_LOWPASS_WIDTH, _ROLLOFF, _BETA = 64, 0.9475937167399596, 14.769656459379492


def resample(samples: np.ndarray, orig: int, new: int) -> np.ndarray:
    """``samples`` (float32 [n]) at ``orig`` Hz -> at ``new`` Hz: polyphase sinc interpolation under a Kaiser
    window, cut off at ``_ROLLOFF`` of the lower Nyquist frequency (torchaudio.functional.resample with
    ``resampling_method="sinc_interp_kaiser"``), ceil(n * new / orig) samples."""
    import torch

    if orig == new:
        return samples
    g = math.gcd(orig, new)
    up, down = new // g, orig // g
    base = min(up, down) * _ROLLOFF
    width = math.ceil(_LOWPASS_WIDTH * down / base)
    if up * (2 * width + down) > _MAX_KERNEL:  # (rates without a common factor, 44101 Hz to 16 kHz: 0.7 G taps)
        raise _error(f"resampling {orig} Hz to {new} Hz needs a filter of {up * (2 * width + down)} taps; send the "
                     "audio at a common rate (8, 11.025, 16, 22.05, 24, 32, 44.1, 48 kHz...)")
    idx = torch.arange(-width, width + down, dtype=torch.float64)[None, None] / down
    t = (torch.arange(0, -up, -1, dtype=torch.float64)[:, None, None] / up + idx) * base
    t = t.clamp(-_LOWPASS_WIDTH, _LOWPASS_WIDTH)
    window = torch.special.i0(_BETA * torch.sqrt(1 - (t / _LOWPASS_WIDTH) ** 2)) / torch.special.i0(
        torch.tensor(_BETA, dtype=torch.float64))
    t = t * math.pi
    kernel = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / torch.where(t == 0, torch.ones_like(t), t))
    kernel = (kernel * window * (base / down)).to(torch.float32)  # [up, 1, 2 width + down]
    x = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))[None, None]
    x = torch.nn.functional.pad(x, (width, width + down))
    out = torch.nn.functional.conv1d(x, kernel, stride=down)  # [1, up, frames]
    out = out.transpose(1, 2).reshape(-1)
    return out[:math.ceil(up * len(samples) / down)].numpy().copy()


def split_clip(samples: np.ndarray, rate: int, max_seconds: float, *, min_samples: int = 1,
               search_seconds: float = 2.0, block_seconds: float = 0.1) -> list[np.ndarray]:
    """A recording longer than ``max_seconds`` as pieces no longer, each cut at the middle of the quietest
    ``block_seconds`` (by mean square) in the ``search_seconds`` before the limit, so that a cut falls in a pause
    rather than a word; pieces shorter than ``min_samples`` (too short to hear) are left out."""
    limit = int(max_seconds * rate)
    block = max(1, int(block_seconds * rate))
    pieces, start = [], 0
    while len(samples) - start > limit:
        end = start + limit
        lo = max(start + 1, end - int(search_seconds * rate))
        blocks = (end - lo) // block
        cut = end
        if blocks >= 1:
            energy = (samples[lo:lo + blocks * block].astype(np.float64) ** 2).reshape(blocks, block).mean(axis=1)
            cut = lo + int(np.argmin(energy)) * block + block // 2
        pieces.append(samples[start:cut])
        start = cut
    pieces.append(samples[start:])
    return [p for p in pieces if len(p) >= min_samples]


# ------------------------------------------------------------------------------------------------ log-mel features

def _hertz_to_mel(freq: np.ndarray) -> np.ndarray:
    """Slaney's mel scale (linear below 1 kHz, logarithmic above), as transformers' ``hertz_to_mel``."""
    mels = 3.0 * freq / 200.0
    log_region = freq >= 1000.0
    mels[log_region] = 15.0 + np.log(freq[log_region] / 1000.0) * (27.0 / np.log(6.4))
    return mels


def _mel_to_hertz(mels: np.ndarray) -> np.ndarray:
    freq = 200.0 * mels / 3.0
    log_region = mels >= 15.0
    freq[log_region] = 1000.0 * np.exp(np.log(6.4) / 27.0 * (mels[log_region] - 15.0))
    return freq


def mel_filters(n_fft: int, n_mels: int, sampling_rate: int, max_frequency: float = 8000.0) -> np.ndarray:
    """Whisper's mel filter bank [n_fft / 2 + 1, n_mels]: triangles on Slaney's scale from 0 Hz to
    ``max_frequency``, each scaled to unit area (transformers' ``mel_filter_bank(..., norm="slaney",
    mel_scale="slaney")``, float64)."""
    mel_freqs = np.linspace(_hertz_to_mel(np.array([0.0]))[0], _hertz_to_mel(np.array([max_frequency]))[0],
                            n_mels + 2)
    filter_freqs = _mel_to_hertz(mel_freqs)
    filters = _triangles(filter_freqs, np.linspace(0, sampling_rate // 2, 1 + n_fft // 2))
    return filters * (2.0 / (filter_freqs[2:n_mels + 2] - filter_freqs[:n_mels]))[None, :]


def _triangles(edges: np.ndarray, fft_freqs: np.ndarray) -> np.ndarray:
    """[bins, len(edges) - 2] triangular filters, filter j rising from edges[j] to edges[j + 1] and falling to
    edges[j + 2] (transformers' ``_create_triangular_filter_bank``, float64)."""
    diff = np.diff(edges)
    slopes = edges[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    return np.maximum(np.zeros(1), np.minimum(down, up))


class _ClipSettings:
    """What the audio processors share: their settings read back from a to_dict (unknown ones refused), a clip's
    identity (the samples at the model's rate and the settings), and a clip prepared alike alone or among others."""

    @classmethod
    def from_dict(cls, d: dict):
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields - {"kind"})
        if unknown:
            raise _error(f"audio processor settings: unknown {unknown}")
        return cls(**{k: v for k, v in d.items() if k in fields})

    def _identity(self, samples: np.ndarray) -> bytes:
        return hashlib.sha256(b"flared-audio-v1\0" + np.ascontiguousarray(samples, np.float32).tobytes()
                              + json.dumps(self.to_dict(), sort_keys=True).encode()).digest()

    def prepare_in_request(self, audio: DecodedAudio, *, images: int) -> PreparedImage:
        return self.prepare(audio)


@dataclass(frozen=True, kw_only=True)
class _WhisperFrames(_ClipSettings):
    """What the processors of Whisper's log-mel frames share (WhisperProcessor's windows, Qwen3AsrProcessor's whole
    clips): the STFT's settings and the clip's audio token, their checks, their dict, and the extractor settings of
    a checkpoint read alike."""

    modality: ClassVar[str] = "audio"

    feature_size: int = 128  # mel bins
    sampling_rate: int = 16000
    hop_length: int = 160
    n_fft: int = 400
    audio_token: str = ""

    def _check(self, *more: str) -> None:
        for name in ("feature_size", "sampling_rate", "hop_length", "n_fft", *more):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise _error(f"audio processor setting {name!r} must be a positive integer, got {value!r}")
        if not isinstance(self.audio_token, str) or not self.audio_token:
            raise _error("audio processor setting 'audio_token' must be a non-empty string")

    @staticmethod
    def _extractor(cfg: dict, accepted: str, *, feature_size: int) -> dict:
        """The STFT settings of a feature extractor of type ``accepted`` (refusing what this one does not do:
        dither, padding with other than silence)."""
        kind = cfg.get("feature_extractor_type", accepted)
        if kind != accepted:
            raise _error(f"feature extractor {kind!r} is not supported ({accepted})")
        if float(cfg.get("dither", 0.0) or 0.0) != 0.0:
            raise _error("a feature extractor with dither (random noise) is not supported")
        if float(cfg.get("padding_value", 0.0)) != 0.0:
            raise _error("a feature extractor padding with other than silence is not supported")
        return dict(feature_size=int(cfg.get("feature_size", feature_size)),
                    sampling_rate=int(cfg.get("sampling_rate", 16000)), hop_length=int(cfg.get("hop_length", 160)),
                    n_fft=int(cfg.get("n_fft", 400)))

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "kind": self.kind}

    @property
    def placeholder(self) -> str:
        """What the chat template writes for a clip (Qwen2-Audio's ``<|audio_bos|><|AUDIO|><|audio_eos|>``,
        Qwen3-ASR's ``<|audio_start|><|audio_pad|><|audio_end|>``), of which ``prepare``'s prompt replaces the
        audio token."""
        return self.audio_token

    @property
    def text_placeholder(self) -> str:
        """What a part becomes in a template that reads content as a string: the placeholder."""
        return self.placeholder

    def _mel_filters(self):
        return _slaney_filters(self.n_fft, self.feature_size, self.sampling_rate)

    def _clip(self, audio: DecodedAudio) -> np.ndarray:
        """The clip's samples at ``sampling_rate``; one longer than the model's ``max_seconds`` is a 400."""
        samples = audio.samples
        if audio.sample_rate != self.sampling_rate:
            samples = resample(samples, audio.sample_rate, self.sampling_rate)
        if len(samples) > self.max_seconds * self.sampling_rate:
            raise _error(f"the audio is {audio.seconds:.2f} s long; this model takes clips of at most "
                         f"{self.max_seconds} s (send a longer recording as several clips)")
        return samples


@dataclass(frozen=True, kw_only=True)
class WhisperProcessor(_WhisperFrames):
    """Whisper's feature extractor (transformers' WhisperFeatureExtractor as Qwen2AudioProcessor and
    AudioFlamingo3Processor call it: padded with silence to ``chunk_length`` seconds, an attention mask over the
    frames) and the audio tokens.

    ``prepare`` gives the clip's log-mel frames [n_mels, F]: the STFT (``n_fft``-point Hann window every
    ``hop_length`` samples, centred, reflect-padded) of each window of the clip (``chunk_length`` s; the last
    padded to it), power through the mel bank, log10 floored at 1e-10 and at the window's maximum - 8, then
    (x + 4) / 4. Whole windows keep their frames; the last is cut to the frames the encoder's valid outputs read
    (two convolutions, the second of stride 2), so the tower runs on the clip, not on the padding, unless
    ``pad_windows`` (an encoder that attends over its window's padding too, GLM-ASR's: the last window whole).
    Its tokens: L valid frames of a window -> (L - 1) // 2 + 1 after the strided conv -> (that - pool) // pool + 1
    after the encoder's pooling (``pool``: Whisper's average of 2, GLM-ASR's merge of 4), summed over the
    windows. ``max_windows``: 1 (Qwen2-Audio) or the model's ``max_audio_len`` over the chunk (Audio Flamingo 3:
    20, ten minutes; GLM-ASR: 21)."""

    kind: ClassVar[str] = "whisper"

    chunk_length: int = 30  # seconds the encoder's window holds
    audio_token: str = "<|AUDIO|>"
    max_windows: int = 1  # windows of chunk_length a clip may fill
    pool: int = 2  # encoder rows a token
    pad_windows: bool = False  # the last window runs whole, its padding included

    def __post_init__(self):
        self._check("chunk_length", "max_windows", "pool")

    @classmethod
    def from_hf(cls, preprocessor_config: dict, *, audio_token: str = "<|AUDIO|>",
                max_windows: int = 1, pool: int = 2, pad_windows: bool = False) -> WhisperProcessor:
        """From a checkpoint's ``preprocessor_config.json`` (a WhisperFeatureExtractor's settings)."""
        cfg = preprocessor_config or {}
        if cfg.get("do_normalize"):
            raise _error("a Whisper feature extractor with do_normalize is not supported")
        try:
            return cls(**cls._extractor(cfg, "WhisperFeatureExtractor", feature_size=80),
                       chunk_length=int(cfg.get("chunk_length", 30)), audio_token=audio_token,
                       max_windows=max_windows, pool=pool, pad_windows=pad_windows)
        except (TypeError, ValueError) as exc:
            raise _error(f"bad feature extractor setting: {exc}") from None

    @property
    def n_samples(self) -> int:
        return self.chunk_length * self.sampling_rate

    def num_frames(self, samples: int) -> int:
        """Valid feature frames of a clip of ``samples`` samples (the attention mask's sum)."""
        return -(-samples // self.hop_length)

    def encoder_lengths(self, frames: int) -> tuple[int, int]:
        """(rows after the encoder's strided conv, rows after its pooling: the audio tokens)."""
        conv = (frames - 1) // 2 + 1
        return conv, (conv - self.pool) // self.pool + 1

    def features(self, samples: np.ndarray) -> np.ndarray:
        """[feature_size, chunk frames] log-mel features of a clip at ``sampling_rate`` (``samples`` at most the
        chunk), padded with silence to the chunk: WhisperFeatureExtractor's torch path."""
        padded = np.zeros(self.n_samples, dtype=np.float32)
        padded[:len(samples)] = samples
        return whisper_log_mel(padded, self.n_fft, self.hop_length, self._mel_filters())

    @property
    def max_seconds(self) -> int:
        return self.chunk_length * self.max_windows

    @property
    def min_samples(self) -> int:
        """The shortest clip (at ``sampling_rate``) that makes an audio token."""
        return (2 * self.pool - 2) * self.hop_length + 1

    def prepare(self, audio: DecodedAudio) -> PreparedImage:
        """The clip's features (its windows' frames along one axis), its prompt and its identity; ``grid`` is
        (the last window's encoder rows, windows, 1)."""
        samples = self._clip(audio)
        windows = max(1, -(-len(samples) // self.n_samples))
        tail = len(samples) - (windows - 1) * self.n_samples
        conv, tokens = self.encoder_lengths(self.num_frames(tail))
        whole = self.encoder_lengths(self.n_samples // self.hop_length)[1]
        tokens = max(tokens, 0) + whole * (windows - 1)
        if tokens < 1:
            raise _error(f"the audio is too short ({audio.seconds * 1000:.1f} ms): this model needs at least "
                         f"{self.min_samples * 1000 / self.sampling_rate:.0f} ms")
        parts = [self.features(samples[k * self.n_samples:(k + 1) * self.n_samples]) for k in range(windows)]
        if not self.pad_windows:  # (what the last window's rows read)
            parts[-1] = parts[-1][:, :min(parts[-1].shape[1], 2 * conv + 1)]
        digest = self._identity(samples)
        return PreparedImage(pixel_values=np.ascontiguousarray(np.concatenate(parts, axis=1)), rows=0, cols=0,
                             prompt=self.audio_token * tokens, num_image_tokens=tokens, identity=digest,
                             grid=(conv, windows, 1), modality="audio")


@dataclass(frozen=True, kw_only=True)
class Qwen3AsrProcessor(_WhisperFrames):
    """Qwen3-ASR's feature extractor (transformers' Qwen3ASRFeatureExtractor as Qwen3ASRProcessor calls it) and
    its audio tokens.

    The clip is not cut into 30-second windows: a clip shorter than ``min_length`` samples (0.5 s) is padded with
    silence to it (the Qwen3-ASR package's rule, the padding counted as the clip's own), then Whisper's log-mel
    frames of the whole clip (``whisper_log_mel``: len // hop frames, floored at the clip's maximum - 8), padded
    with zeros to whole chunks of ``2 n_window`` frames (100: one second). The encoder runs each chunk through
    three stride-2 convolutions, a chunk of L frames giving c(L) = three halvings of L, rounding up (13 for a
    whole one); the clip's tokens are 13 a whole chunk plus c of the last one's frames. ``max_seconds``: the
    Qwen3-ASR package's longest clip (MAX_ASR_INPUT_SECONDS, 20 minutes); a longer one is a 400."""

    kind: ClassVar[str] = "qwen3_asr"

    n_window: int = 50  # half the frames of an encoder chunk
    min_length: int = 8000  # samples a clip is padded to
    audio_token: str = "<|audio_pad|>"
    max_seconds: int = 1200
    # what a template that reads content as a string gets around the audio token ("": nothing), as llama.cpp's
    # mtmd puts them around a qwen3a clip's rows: its checkpoints' own template writes them
    start_token: str = "<|audio_start|>"
    end_token: str = "<|audio_end|>"

    def __post_init__(self):
        self._check("n_window", "max_seconds")
        if not isinstance(self.min_length, int) or isinstance(self.min_length, bool) or self.min_length < 0:
            raise _error(f"audio processor setting 'min_length' must be a whole number, got {self.min_length!r}")

    @classmethod
    def from_hf(cls, extractor: dict | None, *, audio_token: str = "<|audio_pad|>") -> Qwen3AsrProcessor:
        """From a Qwen3ASRFeatureExtractor's settings (preprocessor_config.json, or processor_config.json's
        ``feature_extractor``)."""
        cfg = extractor or {}
        try:
            return cls(**cls._extractor(cfg, "Qwen3ASRFeatureExtractor", feature_size=128),
                       n_window=int(cfg.get("n_window", 50)), min_length=int(cfg.get("min_length", 8000)),
                       audio_token=audio_token)
        except (TypeError, ValueError) as exc:
            raise _error(f"bad feature extractor setting: {exc}") from None

    @property
    def text_placeholder(self) -> str:
        return f"{self.start_token}{self.audio_token}{self.end_token}"

    @property
    def chunk_frames(self) -> int:
        return 2 * self.n_window

    @property
    def min_samples(self) -> int:
        return 1  # (a shorter clip is padded to min_length)

    @staticmethod
    def chunk_rows(frames: int) -> int:
        """The encoder rows of a chunk of ``frames`` frames: three (k 3, stride 2, pad 1) convolutions."""
        for _ in range(3):
            frames = (frames - 1) // 2 + 1 if frames > 0 else 0
        return frames

    def tokens(self, frames: int) -> int:
        whole, rest = divmod(frames, self.chunk_frames)
        return whole * self.chunk_rows(self.chunk_frames) + self.chunk_rows(rest)

    def features(self, samples: np.ndarray) -> np.ndarray:
        """[feature_size, whole chunks' frames]: the clip's log-mel frames (len // hop_length of them, the clip
        padded to min_length), then zeros to whole chunks."""
        wave = np.asarray(samples, dtype=np.float32)
        if len(wave) < self.min_length:
            wave = np.concatenate([wave, np.zeros(self.min_length - len(wave), np.float32)])
        # (as a batch of one, as the extractor runs it)
        frames = whisper_log_mel(wave[None], self.n_fft, self.hop_length, self._mel_filters())[0]
        pad = -frames.shape[1] % self.chunk_frames
        return np.ascontiguousarray(np.pad(frames, ((0, 0), (0, pad))) if pad else frames)

    def prepare(self, audio: DecodedAudio) -> PreparedImage:
        """The clip's features, its prompt and its identity; ``grid`` is (the clip's frames, chunks, 1)."""
        samples = self._clip(audio)
        frames = max(len(samples), self.min_length) // self.hop_length
        tokens = self.tokens(frames)
        if tokens < 1:
            raise _error(f"the audio is too short ({audio.seconds * 1000:.1f} ms) for this model to hear")
        features = self.features(samples)
        return PreparedImage(pixel_values=features, rows=0, cols=0, prompt=self.audio_token * tokens,
                             num_image_tokens=tokens, identity=self._identity(samples),
                             grid=(frames, features.shape[1] // self.chunk_frames, 1), modality="audio")


_FILTERS: dict = {}


def _slaney_filters(n_fft: int, n_mels: int, sampling_rate: int):
    """Whisper's Slaney mel bank as a float32 tensor [n_fft // 2 + 1, n_mels], made once a shape."""
    import torch

    key = (n_fft, n_mels, sampling_rate)
    table = _FILTERS.get(key)
    if table is None:
        table = _FILTERS[key] = torch.from_numpy(mel_filters(n_fft, n_mels, sampling_rate)).to(torch.float32)
    return table


def whisper_log_mel(wave: np.ndarray, n_fft: int, hop_length: int, filters) -> np.ndarray:
    """[mels, len(wave) // hop_length] float32: Whisper's log-mel frames of ``wave`` (float32 samples), as
    transformers' WhisperFeatureExtractor computes them on torch (a centred, reflect-padded STFT of an ``n_fft``
    Hann window, its last frame dropped, power through the mel bank, log10 floored at 1e-10 and at the maximum
    - 8, then (x + 4) / 4). Qwen3-ASR's extractor is this over the clip itself, not a padded window."""
    import torch

    stft = torch.stft(torch.from_numpy(wave), n_fft, hop_length, window=torch.hann_window(n_fft),
                      return_complex=True)
    magnitudes = (stft[..., :-1].abs() ** 2).contiguous()
    log_spec = torch.clamp(filters.T @ magnitudes, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).numpy()


def htk_mel_filters(n_bins: int, n_mels: int, sampling_rate: int, min_frequency: float,
                    max_frequency: float) -> np.ndarray:
    """[n_bins, n_mels] triangles on the HTK mel scale, unnormalised (transformers' ``mel_filter_bank(...,
    norm=None, mel_scale="htk")``, float64)."""
    def to_mel(f):
        return 2595.0 * np.log10(1.0 + np.asarray(f, dtype=np.float64) / 700.0)

    mels = np.linspace(to_mel(min_frequency), to_mel(max_frequency), n_mels + 2)
    return _triangles(700.0 * (10.0 ** (mels / 2595.0) - 1.0), np.linspace(0, sampling_rate // 2, n_bins))


@dataclass(frozen=True, kw_only=True)
class UsmProcessor(_ClipSettings):
    """Gemma 4's audio preparation (transformers' Gemma4AudioFeatureExtractor and Gemma4Processor's prompt): a clip
    at ``sampling_rate``, padded with silence to a multiple of 128 samples (at most ``max_samples``: 30 s; a
    longer clip is a 400, never cut), ``frame_length // 2`` zeros before it (semicausal), frames of
    ``frame_length`` every ``hop_length`` samples through a periodic Hann window, ``fft_length``-point magnitudes
    through HTK mel triangles, log(x + mel_floor) (float64, then float32). A frame is the clip's while its window
    ends inside the clip; only those frames are kept (the encoder reads the padding's as zeros: the same rows).
    Tokens: the frames halved twice by the encoder's two stride-2 convolutions, ``ceil(ceil(F / 2) / 2)``, at
    most ``audio_seq_length``; the prompt ``<|audio>``, one ``<|audio|>`` a token, ``<audio|>``. ``grid`` is
    (frames, 1, 1)."""

    kind: ClassVar[str] = "usm"
    modality: ClassVar[str] = "audio"

    feature_size: int = 128
    sampling_rate: int = 16000
    frame_length: int = 320
    hop_length: int = 160
    fft_length: int = 512
    min_frequency: float = 0.0
    max_frequency: float = 8000.0
    mel_floor: float = 1e-3
    preemphasis: float = 0.0
    preemphasis_htk_flavor: bool = True
    input_scale_factor: float = 1.0
    per_bin_mean: tuple[float, ...] | None = None
    per_bin_stddev: tuple[float, ...] | None = None
    max_samples: int = 480_000
    pad_to_multiple_of: int = 128
    audio_seq_length: int = 750
    audio_token: str = "<|audio|>"
    boa_token: str = "<|audio>"
    eoa_token: str = "<audio|>"

    def __post_init__(self):
        for name in ("feature_size", "sampling_rate", "frame_length", "hop_length", "fft_length", "max_samples",
                     "pad_to_multiple_of", "audio_seq_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise _error(f"audio processor setting {name!r} must be a positive integer, got {value!r}")
        if self.fft_length < self.frame_length:
            raise _error(f"audio processor setting 'fft_length' ({self.fft_length}) is shorter than a frame "
                         f"({self.frame_length})")
        for name in ("per_bin_mean", "per_bin_stddev"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, (list, tuple)) or len(value) != self.feature_size:
                    raise _error(f"audio processor setting {name!r} must be {self.feature_size} numbers")
                object.__setattr__(self, name, tuple(float(x) for x in value))
        for name in ("audio_token", "boa_token", "eoa_token"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise _error(f"audio processor setting {name!r} must be a non-empty string")

    @classmethod
    def from_hf(cls, extractor: dict | None, processor_config: dict | None = None) -> UsmProcessor:
        """From a checkpoint's feature extractor settings (processor_config.json's "feature_extractor", or a
        preprocessor_config.json of them; transformers' defaults where absent: frames of 20 ms every 10 ms, 512-point
        FFT, 128 HTK mel bins to 8 kHz); ``processor_config``'s ``audio_seq_length`` caps a clip's tokens."""
        cfg = dict(extractor or {})
        kind = cfg.get("feature_extractor_type", cfg.get("audio_processor_type", "Gemma4AudioFeatureExtractor"))
        if kind not in ("Gemma4AudioFeatureExtractor", "Gemma4AudioProcessor"):
            raise _error(f"feature extractor {kind!r} is not supported (Gemma4AudioFeatureExtractor)")
        if float(cfg.get("dither", 0.0) or 0.0) != 0.0:
            raise _error("a feature extractor with dither (random noise) is not supported")
        if float(cfg.get("padding_value", 0.0) or 0.0) != 0.0:
            raise _error("an audio feature extractor padding with other than silence is not supported")
        rate = int(cfg.get("sampling_rate", 16000))
        frame = (int(round(rate * float(cfg["frame_length_ms"]) / 1000.0)) if "frame_length_ms" in cfg
                 else int(cfg.get("frame_length", round(rate * 0.02))))
        hop = (int(round(rate * float(cfg["hop_length_ms"]) / 1000.0)) if "hop_length_ms" in cfg
               else int(cfg.get("hop_length", round(rate * 0.01))))
        fft = 2 ** math.ceil(math.log2(frame)) * (2 if cfg.get("fft_overdrive") else 1)
        if cfg.get("fft_length") not in (None, fft):
            raise _error(f"feature extractor fft_length {cfg['fft_length']!r} disagrees with its frames ({fft})")
        try:
            return cls(feature_size=int(cfg.get("feature_size", 128)), sampling_rate=rate, frame_length=frame,
                       hop_length=hop, fft_length=fft, min_frequency=float(cfg.get("min_frequency", 0.0)),
                       max_frequency=float(cfg.get("max_frequency", 8000.0)),
                       mel_floor=float(cfg.get("mel_floor", 1e-3)), preemphasis=float(cfg.get("preemphasis", 0.0)),
                       preemphasis_htk_flavor=bool(cfg.get("preemphasis_htk_flavor", True)),
                       input_scale_factor=float(cfg.get("input_scale_factor", 1.0)),
                       per_bin_mean=cfg.get("per_bin_mean"), per_bin_stddev=cfg.get("per_bin_stddev"),
                       audio_seq_length=int((processor_config or {}).get("audio_seq_length", 750)))
        except (TypeError, ValueError) as exc:
            raise _error(f"bad feature extractor setting: {exc}") from None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for name in ("per_bin_mean", "per_bin_stddev"):
            d[name] = None if d[name] is None else list(d[name])
        return {**d, "kind": self.kind}

    @property
    def placeholder(self) -> str:
        return self.audio_token

    @property
    def max_seconds(self) -> float:
        return self.max_samples / self.sampling_rate

    def frames(self, samples: int) -> int:
        """The clip's own frames (transformers' input_features_mask's sum) for ``samples`` samples."""
        padded = -(-samples // self.pad_to_multiple_of) * self.pad_to_multiple_of
        total = (padded + self.frame_length // 2 - (self.frame_length + 1)) // self.hop_length + 1
        # (frame i's window ends at sample i * hop + frame_length of the padded clip, valid while inside the clip)
        valid = (samples + self.frame_length // 2 - self.frame_length - 1) // self.hop_length + 1
        return max(0, min(total, valid))

    def tokens(self, frames: int) -> int:
        """The encoder's rows of ``frames`` frames (two stride-2 convolutions halve them, rounding up), capped."""
        halved = -(-frames // 2)
        return min(-(-halved // 2), self.audio_seq_length)

    def _tables(self):
        key = (self.frame_length, self.fft_length, self.feature_size, self.sampling_rate, self.min_frequency,
               self.max_frequency)
        got = _FILTERS.get(key)
        if got is None:
            window = np.hanning(self.frame_length + 1)[:-1].astype(np.float32)  # (periodic)
            filters = htk_mel_filters(self.fft_length // 2 + 1, self.feature_size, self.sampling_rate,
                                      self.min_frequency, self.max_frequency)
            got = _FILTERS[key] = (window, filters)
        return got

    def features(self, samples: np.ndarray, frames: int) -> np.ndarray:
        """[frames, feature_size] float32: the clip's first ``frames`` log-mel frames, as
        Gemma4AudioFeatureExtractor computes them."""
        window, filters = self._tables()
        wave = np.asarray(samples, dtype=np.float32)
        if self.input_scale_factor != 1.0:
            wave = wave * self.input_scale_factor
        need = (frames - 1) * self.hop_length + self.frame_length + 1
        wave = np.concatenate([np.zeros(self.frame_length // 2, wave.dtype), wave])
        if len(wave) < need:
            wave = np.concatenate([wave, np.zeros(need - len(wave), wave.dtype)])
        unfolded = np.lib.stride_tricks.sliding_window_view(wave, self.frame_length + 1)[::self.hop_length][:frames]
        if self.preemphasis > 0.0:
            if self.preemphasis_htk_flavor:
                first = unfolded[..., :1] * (1.0 - self.preemphasis)
                rest = unfolded[..., 1:-1] - self.preemphasis * unfolded[..., :-2]
                cut = np.concatenate([first, rest], axis=-1)
            else:
                cut = unfolded[..., 1:] - self.preemphasis * unfolded[..., :-1]
        else:
            cut = unfolded[..., :-1]
        spectrum = np.abs(np.fft.rfft(cut * window, n=self.fft_length, axis=-1))
        log_mel = np.log(np.matmul(spectrum, filters) + np.float64(self.mel_floor))
        if self.per_bin_mean is not None:
            log_mel = log_mel - np.asarray(self.per_bin_mean)
        if self.per_bin_stddev is not None:
            log_mel = log_mel / np.asarray(self.per_bin_stddev)
        return np.ascontiguousarray(log_mel.astype(np.float32))

    @property
    def min_samples(self) -> int:
        """The shortest clip that makes a frame (and so a token)."""
        return self.frame_length + 1 - self.frame_length // 2

    def prepare(self, audio: DecodedAudio) -> PreparedImage:
        samples = audio.samples
        if audio.sample_rate != self.sampling_rate:
            samples = resample(samples, audio.sample_rate, self.sampling_rate)
        if len(samples) > self.max_samples:
            raise _error(f"the audio is {audio.seconds:.2f} s long; this model takes clips of at most "
                         f"{self.max_seconds:g} s (send a longer recording as several clips)")
        frames = self.frames(len(samples))
        if frames < 1:
            raise _error(f"the audio is too short ({audio.seconds * 1000:.1f} ms): this model needs at least "
                         f"{self.min_samples * 1000 / self.sampling_rate:.0f} ms")
        tokens = self.tokens(frames)
        digest = self._identity(samples)
        return PreparedImage(pixel_values=self.features(samples, frames), rows=0, cols=0,
                             prompt=f"{self.boa_token}{self.audio_token * tokens}{self.eoa_token}",
                             num_image_tokens=tokens, identity=digest, grid=(frames, 1, 1), modality="audio")
