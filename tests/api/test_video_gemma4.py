"""Gemma 4's videos end to end: the random-weight Gemma 4 models of test_vision_gemma4.py served by a real `flared
run`, a request's videos (vLLM's video_url parts) answered as transformers' Gemma4ForConditionalGeneration answers
the same frames: 4 frames evenly apart, each sized as an image at 70 soft tokens and run through the tower alone,
each frame's tokens after its mm:ss time (Gemma4Processor.replace_video_token); on the 26B-A4B-like model each
frame's tokens attend to each other both ways on the windowed layers (mm_token_type_ids 2).

transformers' Gemma4VideoProcessor needs torchvision, which this machine lacks: the frames fed to transformers here
are ours, and tests/frontend/test_video.py checks ours against its processor where torchvision is installed.

The random models may emit a media token (<|image|>, <|video|>, <|audio|>) as output, which transformers then feeds
as the pad token's embedding (its placeholder mask), and flared, as vLLM, as the token's own; no trained model
emits them, and the tests keep these from doing so (transformers' suppress_tokens, our logit_bias of -100)."""

from __future__ import annotations

import inspect
import re

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("av")

from flared_testing.video import ask_media, assert_media_cases_match, noise_video, video_part  # noqa: E402
from flared_testing.vision import metric, noise_image, user_turn  # noqa: E402

NEW_TOKENS = 8
MODELS = ("tiny_gemma4_vision", "tiny_gemma4_vision_both_ways")


@pytest.fixture(scope="module", params=MODELS)
def served(request, tmp_path_factory):
    import torch

    from flared.core.load import open_core
    from flared.frontend.video import probe_video
    from flared_testing.daemon import Daemon
    from flared_testing.vision import gemma4_reference

    checkpoint, core = request.getfixturevalue(request.param)
    model, tok, images, media_ids = gemma4_reference(checkpoint)
    videos = open_core(core).video_processor()
    assert videos is not None and videos.kind == "pooled_video"
    max_patches = videos.max_soft_tokens * videos.pooling_kernel_size ** 2
    config = model.config

    def run(media, text: str, both_ways: bool = True):
        """(prompt tokens, greedy tokens) of transformers for one user turn of ``media`` then ``text``."""
        prompt = user_turn(tok, [kind for kind, _ in media], text)
        kwargs, frames, positions, counts = {}, [], [], []
        pictures = [m for kind, m in media if kind == "image"]
        if pictures:
            prepared = images(pictures, return_tensors="pt")
            kwargs.update(pixel_values=prepared["pixel_values"], image_position_ids=prepared["image_position_ids"])
            sizes = iter(prepared["num_soft_tokens_per_image"])
        pieces = re.split(r"<\|image\|>|<\|video\|>", prompt)  # (the template's placeholders, in media order)
        assert len(pieces) == len(media) + 1
        prompt = pieces[0]
        for (kind, m), rest in zip(media, pieces[1:]):  # (each expanded in order, as Gemma4Processor does)
            if kind == "image":
                text_for = f"<|image>{'<|image|>' * next(sizes)}<image|>"
            else:
                info = probe_video(m)
                indices = videos.sample(info)
                ours = videos.prepare(m)
                t, gh, gw = ours.grid
                per_frame = gh * gw // videos.pooling_kernel_size ** 2
                stamps = [i / info.fps for i in indices]
                text_for = " ".join(f"{int(s // 60):02d}:{int(s % 60):02d} <|image>{'<|video|>' * per_frame}<image|>"
                                    for s in stamps)
                pv = torch.from_numpy(ours.pixel_values).view(t, gh * gw, -1)
                pos = torch.stack(torch.meshgrid(torch.arange(gw), torch.arange(gh), indexing="xy"), -1).reshape(-1, 2)
                frames.append(torch.nn.functional.pad(pv, (0, 0, 0, max_patches - gh * gw)))
                positions.append(torch.nn.functional.pad(pos.repeat(t, 1, 1), (0, 0, 0, max_patches - gh * gw),
                                                         value=-1))
                counts.append(t)
            prompt += text_for + rest
        if frames:
            kwargs.update(pixel_values_videos=torch.cat(frames), video_position_ids=torch.cat(positions))
            if "num_frames_per_video" in inspect.signature(model.model.forward).parameters:  # (transformers 5.25)
                kwargs["num_frames_per_video"] = torch.tensor(counts)
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        if media and both_ways:
            kwargs["mm_token_type_ids"] = ((ids == config.image_token_id).long()
                                           + 2 * (ids == config.video_token_id).long())
        with torch.no_grad():
            gen = model.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, suppress_tokens=media_ids, **kwargs)
        return ids.shape[1], gen[0, ids.shape[1]:].tolist()

    run.bias = {str(t): -100 for t in media_ids}  # (our side of suppress_tokens)

    d = Daemon(core, tmp_path_factory.mktemp(request.param + "-video"))
    yield d, run, request.param
    d.kill()


def test_greedy_tokens_match_transformers(served):
    daemon, reference, name = served
    clip = noise_video(25, (64, 48), 10, seed=1)  # (2.5 s: frames 0, 6, 12, 18 at 00:00, 00:00, 00:01, 00:01)
    tall = noise_video(16, (40, 90), 8, seed=2, codec="libvpx-vp9", container="webm")
    picture = noise_image(71, (90, 40))
    assert_media_cases_match(daemon, reference, (
        ([("video", clip)], "What happens?"),
        ([("video", tall)], "And here?"),
        ([("image", picture), ("video", clip)], "Compare the picture and the video."),
        ([("video", tall), ("video", clip)], "Which is longer?"),
    ), NEW_TOKENS, label=(name,), logit_bias=reference.bias)
    assert metric(daemon, "flare_vision_videos") == 2  # (two videos; repeats come from the rows' cache)


def test_the_answer_depends_on_the_video(served):
    _, reference, _ = served
    one = reference([("video", noise_video(25, (64, 48), 10, seed=3))], "What happens?")
    other = reference([("video", noise_video(25, (64, 48), 10, seed=4))], "What happens?")
    assert one[0] == other[0] and one[1] != other[1]


def test_a_minute_long_video_gets_its_minutes(served):
    """Frames at a minute and past are stamped mm:ss as transformers stamps them: 80 frames at 1 a second, frames
    0, 20, 40, 60."""
    daemon, reference, _ = served
    clip = noise_video(80, (48, 48), 1, seed=5)
    body = ask_media(daemon, [("video", clip)], "When?", NEW_TOKENS, logit_bias=reference.bias)
    assert body["usage"]["prompt_tokens"] == reference([("video", clip)], "When?")[0]
    status, tokens = daemon.request("POST", "/tokenize", {"messages": [{"role": "user", "content": [
        video_part(clip), {"type": "text", "text": "When?"}]}], "return_token_strs": True})
    text = "".join(tokens["token_strs"])
    assert status == 200 and [s in text for s in ("00:00 ", "00:20 ", "00:40 ", "01:00 ")] == [True] * 4, text


def test_frames_and_soft_tokens_are_request_settings(served):
    """mm_processor_kwargs: num_frames (or fps) and max_soft_tokens set a request's frames; bad values are 400s."""
    daemon, _, _ = served
    clip = noise_video(25, (64, 48), 10, seed=6)
    sizes = {}
    for kwargs in ({}, {"num_frames": 2}, {"fps": 1}):
        body = ask_media(daemon, [("video", clip)], "Hi", 1, mm_processor_kwargs=kwargs)
        sizes[tuple(kwargs)] = body["usage"]["prompt_tokens"]
    # (two frames fewer: 63 tokens each (7 x 9 blocks), their <|image>, <image|> and time; 2.5 s at 1 a second)
    assert sizes[()] - sizes[("num_frames",)] >= 2 * (63 + 2) and sizes[("fps",)] == sizes[("num_frames",)]
    status, body = daemon.chat([{"role": "user", "content": [video_part(clip), {"type": "text", "text": "Hi"}]}],
                               max_tokens=1, mm_processor_kwargs={"max_soft_tokens": 7})
    assert status == 400 and "max_soft_tokens" in body["error"]["message"], body
