"""Video decoding and the video preparations (flared.frontend.video: the Qwen families', InternVL's, LLaVA's and
Gemma 4's): the frames kept are the ones the sampling rule names, in order, from every container and codec FFmpeg
writes here; the frame sizes follow the per-video pixel budget; the patches are transformers' video processors'
output bit for bit (where torchvision is installed: their tensor backend needs it); and bad files are 400s that say
why."""

from __future__ import annotations

import base64

import numpy as np
import pytest

pytest.importorskip("av")

from flared.errors import FrontendError  # noqa: E402
from flared.frontend.images import CLIP_MEAN, CLIP_STD  # noqa: E402
from flared.frontend.video import (  # noqa: E402
    FrameVideoProcessor, VideoInfo, VideoProcessor, decode_video_source, probe_video, resize_frame,
    video_processor_from_dict,
)
from flared_testing.video import encode_frames, noise_video, video_url  # noqa: E402


def _processor(family: str = "qwen2", **kw) -> VideoProcessor:
    patch = 14 if family == "qwen2" else 16
    return VideoProcessor.from_hf(family, kw or None, patch_size=patch, temporal_patch_size=2, merge_size=2)


def _levels_video(frames: int, rate: int, *, codec="mpeg4", container="mp4", size=(64, 48), step=8) -> bytes:
    """Frame i is one flat gray level, step * i + 16: a kept frame tells its own index."""
    return encode_frames((np.full((size[1], size[0], 3), step * i + 16, np.uint8) for i in range(frames)), size,
                         rate, codec=codec, container=container)


def test_sampling_follows_the_authors_rules():
    qwen2, qwen3 = _processor("qwen2"), _processor("qwen3")
    # qwen-vl-utils: fps x seconds, at least 4, at most the frames, an even count, spread with linspace
    assert qwen2.sample(VideoInfo(25, 10.0, 64, 48)) == [0, 8, 16, 24]
    assert qwen2.sample(VideoInfo(300, 30.0, 64, 48)) == [round(i * 299 / 19) for i in range(20)]
    assert len(qwen2.sample(VideoInfo(3001, 25.0, 64, 48))) == 240  # 120 s at 2 a second
    assert qwen2.sample(VideoInfo(1, 25.0, 64, 48)) == [0, 0]  # a single frame fills the temporal patch
    assert qwen2.sample(VideoInfo(3, 25.0, 64, 48)) == [0, 2]
    # Qwen3VLVideoProcessor: int(seconds x fps), clamped to [4, frames], any count
    assert qwen3.sample(VideoInfo(25, 10.0, 64, 48)) == [0, 6, 12, 18, 24]
    assert qwen3.sample(VideoInfo(7, 3.0, 64, 48)) == [0, 2, 4, 6]
    assert qwen3.sample(VideoInfo(100_000, 30.0, 64, 48))[-1] == 99_999
    assert len(qwen3.sample(VideoInfo(100_000, 30.0, 64, 48))) == 768
    # num_frames (vLLM's mm_processor_kwargs): that many whatever the length (qwen2: an even count)
    assert _processor("qwen2", num_frames=6).sample(VideoInfo(300, 30.0, 64, 48)) == [0, 60, 120, 179, 239, 299]
    assert _processor("qwen2", num_frames=7).sample(VideoInfo(3, 30.0, 64, 48)) == [0, 1, 1, 2]
    assert _processor("qwen3", num_frames=5).sample(VideoInfo(300, 30.0, 64, 48)) == [0, 75, 150, 224, 299]


def test_frame_sizes_follow_the_video_budget():
    qwen2 = _processor("qwen2")  # frames between 128 and 768 merged blocks, 90% of 128000 tokens a video
    assert qwen2.frame_size(4, 240, 320) == (280, 392)  # scaled up to the minimum
    assert qwen2.frame_size(4, 1080, 1920) == (560, 1008)  # down to 768 blocks
    h, w = qwen2.frame_size(768, 1080, 1920)  # a long video: each frame gets its share
    assert h * w <= 128000 * 28 * 28 * 0.9 * 2 // 768 and (h, w) == (336, 644)
    qwen3 = _processor("qwen3", size={"shortest_edge": 4096, "longest_edge": 25165824})
    h, w = qwen3.frame_size(8, 1080, 1920)  # at most 768 tokens a frame
    assert h % 32 == 0 and w % 32 == 0 and h * w <= 768 * 32 * 32
    with pytest.raises(FrontendError, match="long edge"):
        qwen2.frame_size(4, 2, 1000)


@pytest.mark.parametrize("codec,container", [("mpeg4", "mp4"), ("libx264", "mp4"), ("libvpx-vp9", "webm"),
                                             ("libx264", "matroska"), ("mjpeg", "avi"), ("gif", "gif")])
def test_every_container_decodes_to_the_sampled_frames(codec, container):
    data = _levels_video(25, 10, codec=codec, container=container)
    info = probe_video(data)
    assert (info.total_frames, info.width, info.height) == (25, 64, 48)
    processor = _processor("qwen2")
    prepared = processor.prepare(data)
    indices = processor.sample(info)
    assert prepared.grid == (2, 20, 28) and prepared.num_image_tokens == 2 * 20 * 28 // 4
    # each kept frame's gray level, through the normalization undone (channel 0, a patch row's first pixels)
    x = prepared.pixel_values.reshape(2, 10, 14, 2, 2, 3, 2, 14, 14)  # [t, bh, bw, m, m, c, tp, p, p]
    mean, std = processor.image_mean[0] * 255, processor.image_std[0] * 255
    levels = [float(x[t, :, :, :, :, 0, k].mean() * std + mean) for t in range(2) for k in range(2)]
    assert np.allclose(levels, [8 * i + 16 for i in indices], atol=4), (codec, levels, indices)
    assert prepared.modality == "video" and prepared.seconds_per_grid == pytest.approx(2 / (4 / 25 * 10))


def test_qwen3_prompt_has_a_timestamp_before_each_frame_pair():
    processor = _processor("qwen3")
    prepared = processor.prepare(_levels_video(25, 10))  # frames 0, 6, 12, 18, 24 (the last repeated)
    t, h, w = prepared.grid
    assert t == 3 and prepared.frames_apart
    frame = "<|vision_start|>" + "<|video_pad|>" * (h * w // 4) + "<|vision_end|>"
    assert prepared.prompt == "<0.3 seconds>" + frame + "<1.5 seconds>" + frame + "<2.4 seconds>" + frame
    assert processor.placeholder == "<|vision_start|><|video_pad|><|vision_end|>"


def test_a_video_past_max_tokens_is_refused_before_decoding():
    from flared.errors import ErrorKind

    data = _levels_video(25, 10)
    for processor, tokens in ((_processor("qwen2"), 280), (_frames_processor(), 32)):
        assert processor.prepare(data, max_tokens=tokens).num_image_tokens == tokens
        with pytest.raises(FrontendError, match=f"takes {tokens} tokens") as err:
            processor.prepare(data, max_tokens=tokens - 1)
        assert err.value.kind is ErrorKind.CONTEXT_LENGTH


def test_identity_follows_the_bytes_and_the_settings():
    a, b = noise_video(8, seed=1), noise_video(8, seed=2)
    qwen2 = _processor("qwen2")
    assert qwen2.prepare(a).identity == qwen2.prepare(a).identity != qwen2.prepare(b).identity
    assert _processor("qwen2", fps=1.0).prepare(a).identity != qwen2.prepare(a).identity


def test_settings_round_trip_and_bad_settings_are_refused():
    processor = _processor("qwen3", fps=1.5, max_frames=64)
    assert VideoProcessor.from_dict(processor.to_dict()) == processor
    with pytest.raises(FrontendError, match="fps"):
        _processor("qwen2", fps=0)
    with pytest.raises(FrontendError, match="min_frames"):
        _processor("qwen2", min_frames=10, max_frames=4)
    with pytest.raises(FrontendError, match="unknown video processor settings"):
        VideoProcessor.from_dict({**processor.to_dict(), "sharpen": True})


def test_bad_videos_are_refused_with_reasons():
    with pytest.raises(FrontendError, match="could not be read"):
        _processor().prepare(b"\x00\x01not a video at all" * 50)
    wav = b"RIFF" + (36 + 3200).to_bytes(4, "little") + b"WAVEfmt " + bytes.fromhex(
        "1000000001000100803e0000007d00000200100064617461") + (3200).to_bytes(4, "little") + bytes(3200)
    with pytest.raises(FrontendError, match="no video stream"):
        _processor().prepare(wav)
    with pytest.raises(FrontendError, match="empty"):
        decode_video_source("data:video/mp4;base64,")
    with pytest.raises(FrontendError, match="too large"):
        decode_video_source(video_url(bytes(3000)), max_bytes=1000)
    with pytest.raises(FrontendError, match="unsupported video type"):
        decode_video_source("data:text/plain;base64," + base64.b64encode(b"hello").decode())
    data = noise_video(8)
    assert decode_video_source(video_url(data)) == data == decode_video_source(base64.b64encode(data).decode())
    truncated = data[: len(data) // 3]
    try:  # a cut file decodes to fewer frames, or is refused: never anything else
        prepared = _processor().prepare(truncated)
        t, h, w = prepared.grid  # (its last frame repeated: as many patches as its grid holds)
        assert prepared.pixel_values.shape[0] == t * h * w and prepared.num_image_tokens == t * h * w // 4
    except FrontendError:
        pass


def test_mutated_videos_prepare_or_are_refused():
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import given, settings
    from hypothesis import strategies as st

    good = noise_video(10, (48, 32), seed=5)
    processor = _processor("qwen2")

    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(st.lists(st.tuples(st.integers(0, len(good) - 1), st.integers(0, 255)), max_size=6),
           st.integers(0, len(good)))
    def check(edits, cut):
        data = bytearray(good[:max(cut, 1)])
        for at, value in edits:
            if at < len(data):
                data[at] = value
        try:
            prepared = processor.prepare(bytes(data))
        except FrontendError:
            return
        assert prepared.pixel_values.shape[0] == prepared.grid[0] * prepared.grid[1] * prepared.grid[2]

    del hypothesis
    check()


def test_resize_is_torchvisions():
    """torchvision's tensor resize (transformers' video backend) on uint8 frames, where it is installed."""
    tvF = pytest.importorskip("torchvision.transforms.v2.functional")
    import torch

    frame = torch.from_numpy(np.random.default_rng(3).integers(0, 256, (3, 47, 71), dtype=np.uint8))
    for size in ((28, 56), (84, 112), (47, 71)):
        want = tvF.resize(frame, list(size), interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
        assert torch.equal(resize_frame(frame, size), want)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_patches_are_transformers_video_processors(family):
    """Our patches, grid and frames against transformers' own video processor on the same sampled frames, where
    torchvision is installed (its video processors need it)."""
    pytest.importorskip("torchvision")
    transformers = pytest.importorskip("transformers")
    import av
    import io
    import torch

    data = noise_video(25, (150, 100), 10, seed=7, smooth=True)
    ours = _processor(family)
    prepared = ours.prepare(data)
    info = probe_video(data)
    indices = ours.sample(info)
    container = av.open(io.BytesIO(data))
    frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    clip = torch.from_numpy(np.stack([frames[i] for i in indices])).permute(0, 3, 1, 2)
    if family == "qwen2":
        cls = transformers.Qwen2VLVideoProcessor
        theirs = cls(size={"shortest_edge": ours.min_pixels, "longest_edge": ours.max_pixels}, do_sample_frames=False)
    else:
        cls = transformers.Qwen3VLVideoProcessor
        theirs = cls(size={"shortest_edge": ours.min_pixels, "longest_edge": ours.max_pixels}, do_sample_frames=False)
    out = theirs(videos=[clip], return_tensors="pt", cap_pixels_per_frame=True)
    assert tuple(out["video_grid_thw"][0].tolist()) == prepared.grid
    assert np.array_equal(out["pixel_values_videos"].numpy(), prepared.pixel_values)


def _frames_processor(**kw):
    return FrameVideoProcessor(height=28, width=28, image_seq_len=4, **kw)


def test_internvl_frames_come_from_the_middles_of_equal_stretches():
    frames = _frames_processor()
    assert frames.sample(VideoInfo(80, 10.0, 64, 48)) == [5, 15, 25, 35, 45, 55, 65, 75]
    assert frames.sample(VideoInfo(5, 10.0, 64, 48)) == [0, 1, 2, 3, 4]  # fewer frames than 8: each once
    assert _frames_processor(fps=1.0).sample(VideoInfo(80, 10.0, 64, 48)) == [5, 15, 25, 35, 45, 55, 65, 75]
    assert _frames_processor(fps=0.5).sample(VideoInfo(80, 10.0, 64, 48)) == [10, 30, 50, 70]
    prepared = frames.prepare(_levels_video(80, 10, step=3, codec="png", container="avi"))  # (lossless)
    assert prepared.pixel_values.shape == (8, 3, 28, 28) and prepared.num_image_tokens == 32
    assert prepared.prompt.splitlines()[1] == "Frame2: <img>" + "<IMG_CONTEXT>" * 4 + "</img>"
    mean, std = CLIP_MEAN[0] * 255, CLIP_STD[0] * 255
    levels = prepared.pixel_values[:, 0].mean(axis=(1, 2)) * std + mean
    assert np.allclose(levels, [3 * i + 16 for i in (5, 15, 25, 35, 45, 55, 65, 75)], atol=1e-3), levels


def test_internvl_frames_are_transformers_video_processors():
    """Our frames against transformers' InternVLVideoProcessor on the same sampled frames, where torchvision is
    installed."""
    pytest.importorskip("torchvision")
    transformers = pytest.importorskip("transformers")
    import io

    import av
    import torch

    data = noise_video(30, (150, 100), 10, seed=9, smooth=True)
    ours = _frames_processor()
    info = probe_video(data)
    container = av.open(io.BytesIO(data))
    frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    clip = torch.from_numpy(np.stack([frames[i] for i in ours.sample(info)])).permute(0, 3, 1, 2)
    theirs = transformers.InternVLVideoProcessor(size={"height": 28, "width": 28}, do_sample_frames=False,
                                                 image_mean=list(ours.image_mean), image_std=list(ours.image_std))
    out = theirs(videos=[clip], return_tensors="pt")["pixel_values_videos"][0]
    assert np.array_equal(out.numpy(), ours.prepare(data).pixel_values)


def test_onevision_frames_are_evenly_apart_from_the_first():
    onevision = _frames_processor(family="onevision", num_frames=32)
    assert onevision.sample(VideoInfo(64, 10.0, 64, 48)) == list(range(0, 64, 2))
    assert onevision.sample(VideoInfo(5, 10.0, 64, 48)) == [0, 1, 2, 3, 4]
    prepared = onevision.prepare(_levels_video(6, 5))
    assert prepared.num_image_tokens == 6 * 4 + 1 and prepared.prompt == "<video>" * 25
    assert onevision.fills_video_token and not _frames_processor().fills_video_token


def test_onevision_frames_are_transformers_video_processors():
    """Our frames against transformers' LlavaOnevisionVideoProcessor, where torchvision is installed."""
    pytest.importorskip("torchvision")
    transformers = pytest.importorskip("transformers")
    import io

    import av
    import torch

    data = noise_video(30, (150, 100), 10, seed=10, smooth=True)
    ours = _frames_processor(family="onevision", image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))
    container = av.open(io.BytesIO(data))
    frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    clip = torch.from_numpy(np.stack([frames[i] for i in ours.sample(probe_video(data))])).permute(0, 3, 1, 2)
    theirs = transformers.LlavaOnevisionVideoProcessor(size={"height": 28, "width": 28}, do_sample_frames=False,
                                                       image_mean=[0.5] * 3, image_std=[0.5] * 3)
    out = theirs(videos=[clip], return_tensors="pt")["pixel_values_videos"][0]
    assert np.array_equal(out.numpy(), ours.prepare(data).pixel_values)


@pytest.mark.parametrize("degrees", [90, -90, 180])
def test_a_sideways_stored_video_is_turned_as_players_show_it(degrees):
    """A phone's portrait video stored sideways with a display matrix: its frames are turned as FFmpeg's players
    turn them (the size the budget sees too)."""
    img = np.zeros((32, 64, 3), np.uint8)
    img[:, :16] = 255  # a white band down the stored frame's left edge
    data = encode_frames([img] * 8, (64, 32), 10, codec="libx264", rotation=degrees)
    info = probe_video(data)
    assert (info.width, info.height) == ((32, 64) if degrees % 180 else (64, 32)), info
    frames = FrameVideoProcessor(family="onevision", num_frames=1, height=info.height, width=info.width,
                                 image_seq_len=1, do_normalize=False, do_rescale=False)
    shown = frames.prepare(data).pixel_values[0, 0]  # channel 0 of the one frame, as shown
    want = np.rot90(img[:, :, 0], degrees // 90)
    assert np.abs(shown - want).mean() < 8, (degrees, shown.mean(0), shown.mean(1))


def test_llava_next_video_frames_are_resized_by_the_short_edge_and_cropped_from_the_middle():
    processor = _frames_processor(family="llava_next_video", num_frames=4, shortest_edge=28)
    assert processor.fills_video_token and processor.prompt(3) == "<video>" * 12
    width, height = 70, 40  # -> 49 x 28, then columns 10..37 (torchvision rounds (49 - 28) / 2 = 10.5 to 10)
    img = np.zeros((height, width, 3), np.uint8)
    img[:, width // 2:] = 200  # the right half bright
    data = encode_frames([img] * 4, (width, height), 5, codec="png", container="avi")
    prepared = processor.prepare(data)
    assert prepared.pixel_values.shape == (4, 3, 28, 28) and prepared.num_image_tokens == 16
    mean, std = CLIP_MEAN[0] * 255, CLIP_STD[0] * 255
    row = prepared.pixel_values[0, 0, 14] * std + mean  # one row across the crop, channel 0
    edge = 49 * (width // 2) / width - 10  # where the bright half begins in the crop
    assert row[: int(edge) - 2].max() < 20 and row[int(edge) + 3:].min() > 180, row


def test_llava_next_video_frames_are_transformers_video_processors():
    """Our frames against transformers' LlavaNextVideoVideoProcessor (resized by the short edge, center-cropped),
    where torchvision is installed."""
    pytest.importorskip("torchvision")
    transformers = pytest.importorskip("transformers")
    import io

    import av
    import torch

    data = noise_video(12, (150, 100), 10, seed=13, smooth=True)
    ours = _frames_processor(family="llava_next_video", num_frames=4, shortest_edge=28)
    container = av.open(io.BytesIO(data))
    frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    clip = torch.from_numpy(np.stack([frames[i] for i in ours.sample(probe_video(data))])).permute(0, 3, 1, 2)
    theirs = transformers.LlavaNextVideoVideoProcessor(size={"shortest_edge": 28}, crop_size={"height": 28,
                                                                                              "width": 28},
                                                       do_sample_frames=False)
    out = theirs(videos=[clip], return_tensors="pt")["pixel_values_videos"][0]
    assert np.array_equal(out.numpy(), ours.prepare(data).pixel_values)


def _pooled_processor(**kw):
    from flared.frontend.video import PooledVideoProcessor

    return PooledVideoProcessor.from_hf(kw or None, patch_size=4, pooling_kernel_size=3)


def test_gemma4_frames_are_evenly_apart_from_the_first_and_stamped_mm_ss():
    """transformers' default sampling (frame k * total // n, 32 frames by default; at most the video's) and
    Gemma4Processor's prompt: each frame's time as mm:ss, a space, <|image>, its tokens, <image|>."""
    gemma = _pooled_processor()
    assert gemma.sample(VideoInfo(100, 10.0, 64, 48)) == [k * 100 // 32 for k in range(32)]
    assert gemma.sample(VideoInfo(5, 10.0, 64, 48)) == [0, 1, 2, 3, 4]
    assert _pooled_processor(fps=1.0).sample(VideoInfo(100, 10.0, 64, 48)) == [k * 10 for k in range(10)]
    assert gemma.prompt([0, 620, 3700], 10.0, 2) == ("00:00 <|image><|video|><|video|><image|> "
                                                      "01:02 <|image><|video|><|video|><image|> "
                                                      "06:10 <|image><|video|><|video|><image|>")
    prepared = _pooled_processor(num_frames=3).prepare(_levels_video(9, 3, size=(64, 48)))
    assert prepared.grid == (3, 21, 27) and prepared.num_image_tokens == 3 * 63 and prepared.modality == "video"
    assert prepared.pixel_values.shape == (3 * 21 * 27, 4 * 4 * 3)
    # (flat gray frames 0, 3 and 6 of levels 16 + 8i, each patch's values the frame's level / 255)
    levels = prepared.pixel_values.reshape(3, -1).mean(1) * 255
    assert np.allclose(levels, [16, 40, 64], atol=3), levels  # (within half a step of 8: the codec is lossy)
    d = _pooled_processor(num_frames=3).to_dict()
    assert d["kind"] == "pooled_video" and video_processor_from_dict(d) == _pooled_processor(num_frames=3)
    with pytest.raises(FrontendError, match="max_soft_tokens"):
        _pooled_processor(max_soft_tokens=100)
    with pytest.raises(FrontendError, match="patch_size"):
        _pooled_processor(patch_size=16)


def test_gemma4_frames_are_transformers_video_processors():
    """Our frames against transformers' Gemma4VideoProcessor (unpadded), where torchvision is installed."""
    pytest.importorskip("torchvision")
    transformers = pytest.importorskip("transformers")
    import io

    import av
    import torch

    data = noise_video(30, (150, 100), 10, seed=14, smooth=True)
    ours = _pooled_processor(num_frames=5)
    container = av.open(io.BytesIO(data))
    frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    clip = torch.from_numpy(np.stack([frames[i] for i in ours.sample(probe_video(data))])).permute(0, 3, 1, 2)
    theirs = transformers.Gemma4VideoProcessor(patch_size=4, pooling_kernel_size=3, max_soft_tokens=70,
                                               do_sample_frames=False)
    out = theirs(videos=[clip], return_tensors="pt")
    real = (out["video_position_ids"] != -1).all(-1)
    prepared = ours.prepare(data)
    assert out["num_soft_tokens_per_video"][0] * 5 == prepared.num_image_tokens
    assert np.array_equal(out["pixel_values_videos"][real].numpy(), prepared.pixel_values)


@pytest.mark.parametrize("codec, container, options", [
    ("libx264", "mp4", {"g": "60", "bf": "3"}),  # (B-frames: decode order is not presentation order)
    ("mpeg4", "mp4", {"g": "45"}), ("libvpx-vp9", "webm", {"g": "90"})])
def test_a_long_video_read_by_seeking_gives_the_frames_read_in_order(codec, container, options, monkeypatch):
    """A long video's sampled frames, read by seeking to each one's keyframe, are bit for bit the frames decoding
    the whole video in order gives (repeats and neighbouring frames too)."""
    import torch

    from flared.frontend import video
    from flared_testing.video import encode_frames

    rng = np.random.default_rng(5)
    yy, xx = np.mgrid[0:48, 0:64]
    frames = (np.stack([(xx * 3 + i * 9) % 256, (yy * 5 + i * 7) % 256, rng.integers(0, 256, (48, 64))], -1)
              .astype(np.uint8) for i in range(900))
    data = encode_frames(frames, (64, 48), 30, codec=codec, container=container, options=options)
    info = video.probe_video(data)
    assert info.total_frames == 900
    indices = sorted([0, 1, 1, 59, 60, 61, 450, 451, 899, 899] + rng.integers(0, 900, 14).tolist())
    box = video._container(data)
    plan = video._seek_plan(box, box.streams.video[0], info, sorted(set(indices)))
    assert plan is not None and len(plan) == len(set(indices))
    read, sought = video._frames_by_seeking, []

    def spy(*args):  # (its frames, had it given up and left them to reading in order, would not be counted)
        frames = read(*args)
        sought.append(len(frames))
        return frames

    monkeypatch.setattr(video, "_frames_by_seeking", spy)
    seeking = video._frames_at(box, info, indices, (24, 32))
    assert sought == [len(indices)]
    monkeypatch.setattr(video, "SEEK_MIN_FRAMES", 10 ** 9)
    in_order = video._frames_at(video._container(data), info, indices, (24, 32))
    assert seeking.shape == (len(indices), 3, 24, 32) and torch.equal(seeking, in_order)
