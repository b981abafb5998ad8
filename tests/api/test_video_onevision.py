"""Video input on a LLaVA-OneVision core end to end: a random-weight model exported and served by a real
`flared run`, asked with vLLM's video_url parts, its greedy tokens checked against transformers'
LlavaOnevisionForConditionalGeneration on the same weights, frames and prompt (LlavaOnevisionProcessor's
expansion: <video> once a pooled row of each frame and once for the image_newline; the tower's rows pooled 2 x 2,
bilinear). Its template writes a turn's images before its videos: a video sent before an image still lands in
the template's place. The frames are our FrameVideoProcessor's (transformers' video processor needs torchvision;
tests/frontend/test_video.py checks ours against it where it is installed)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("av")

from flared_testing.video import assert_media_cases_match, noise_video  # noqa: E402
from flared_testing.vision import noise_image, processor_settings, reference_tokenizer  # noqa: E402

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def daemon(tiny_llava_onevision, tmp_path_factory):
    from flared_testing.daemon import Daemon

    d = Daemon(tiny_llava_onevision[1], tmp_path_factory.mktemp("onevision-video-daemon"))
    yield d
    d.kill()


@pytest.fixture(scope="module")
def reference(tiny_llava_onevision):
    import torch
    from transformers import LlavaOnevisionForConditionalGeneration
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    from flared.core.load import open_core

    checkpoint, core = tiny_llava_onevision
    model = LlavaOnevisionForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tok = reference_tokenizer(checkpoint, eos_token="<|im_end|>")
    images = LlavaOnevisionImageProcessorPil(**processor_settings(checkpoint))
    videos = open_core(core).video_processor()

    def run(media, text: str):
        content = [{"type": kind} for kind, _ in media] + [{"type": "text", "text": text}]
        prompt = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
        inputs = {}
        pictures = [m for kind, m in media if kind == "image"]
        if pictures:
            prepared = images([pictures], return_tensors="pt")
            with torch.no_grad():
                rows = model.model.get_image_features(
                    pixel_values=prepared["pixel_values"], image_sizes=prepared["image_sizes"],
                    batch_num_images=prepared["batch_num_images"], vision_feature_layer=-1,
                    vision_feature_select_strategy="full").pooler_output
            pieces = prompt.split("<image>")
            prompt = pieces[0] + "".join("<image>" * len(r) + rest for r, rest in zip(rows, pieces[1:]))
            inputs.update(pixel_values=prepared["pixel_values"], image_sizes=prepared["image_sizes"],
                          batch_num_images=prepared["batch_num_images"])
        clips = [videos.prepare(m).pixel_values for kind, m in media if kind == "video"]
        if clips:
            assert len(clips) == 1  # (transformers stacks a batch's videos: one of equal frames)
            frames = torch.from_numpy(clips[0])[None]
            inputs["pixel_values_videos"] = frames
            prompt = prompt.replace("<video>", "<video>" * (frames.shape[1] * 4 + 1))  # (2 x 2 pooled, a newline)
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            gen = model.generate(input_ids=ids, **inputs, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, vision_feature_layer=-1,
                                 vision_feature_select_strategy="full")
        return ids.shape[1], gen[0, ids.shape[1]:].tolist()

    return run


def test_video_greedy_tokens_match_transformers(daemon, reference):
    clip = noise_video(40, (64, 48), 10, seed=21)  # 32 frames, evenly apart from the first
    short = noise_video(6, (40, 60), 5, seed=22)  # fewer than 32: each once
    cases = [([("video", clip)], "What happens?"), ([("video", short)], "And here?"),
             ([("video", short), ("image", noise_image(23, (90, 40)))], "The video, then the picture.")]
    assert_media_cases_match(daemon, reference, cases, NEW_TOKENS, label=())
