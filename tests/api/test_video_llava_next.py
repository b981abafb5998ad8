"""Video input on a LLaVA-NeXT-Video core end to end: a random-weight model exported and served by a real
`flared run`, asked with vLLM's video_url parts, its greedy tokens checked against transformers'
LlavaNextVideoForConditionalGeneration on the same weights, frames and prompt (LlavaNextVideoProcessor's expansion:
<video> once a pooled row of each frame; the tower's feature-layer rows average-pooled 2 x 2 before the projector).
Its images are LLaVA-NeXT's. The frames are our FrameVideoProcessor's (transformers' video processor needs
torchvision; tests/frontend/test_video.py checks ours against it where it is installed)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("av")

from flared_testing.video import assert_media_cases_match, noise_video  # noqa: E402
from flared_testing.vision import noise_image, processor_settings, reference_tokenizer  # noqa: E402

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def daemon(tiny_llava_next_video, tmp_path_factory):
    from flared_testing.daemon import Daemon

    d = Daemon(tiny_llava_next_video[1], tmp_path_factory.mktemp("llava-next-video-daemon"))
    yield d
    d.kill()


@pytest.fixture(scope="module")
def reference(tiny_llava_next_video):
    import torch
    from transformers import LlavaNextProcessor, LlavaNextVideoForConditionalGeneration
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    from flared.core.load import open_core

    checkpoint, core = tiny_llava_next_video
    model = LlavaNextVideoForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tok = reference_tokenizer(checkpoint, bos_token="<s>", eos_token="</s>")
    images = LlavaNextProcessor(image_processor=LlavaNextImageProcessorPil(**processor_settings(checkpoint)),
                                tokenizer=tok, patch_size=7, vision_feature_select_strategy="default",
                                num_additional_image_tokens=1, image_token="<image>")
    videos = open_core(core).video_processor()

    def run(media, text: str):
        content = [{"type": kind} for kind, _ in media] + [{"type": "text", "text": text}]
        prompt = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
        clips = [videos.prepare(m).pixel_values for kind, m in media if kind == "video"]
        inputs = {}
        if clips:
            assert len(clips) == 1  # (transformers stacks a batch's videos: one of equal frames)
            frames = torch.from_numpy(clips[0])[None]
            inputs["pixel_values_videos"] = frames
            prompt = prompt.replace("<video>", "<video>" * (frames.shape[1] * 4))  # (2 x 2 pooled rows a frame)
        pictures = [m for kind, m in media if kind == "image"]
        if pictures:
            out = images(images=pictures, text=[prompt], return_tensors="pt", add_special_tokens=False)
            ids = out["input_ids"]
            inputs.update(pixel_values=out["pixel_values"], image_sizes=out["image_sizes"])
        else:
            ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            gen = model.generate(input_ids=ids, **inputs, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        return ids.shape[1], gen[0, ids.shape[1]:].tolist()

    return run


def test_video_greedy_tokens_match_transformers(daemon, reference):
    wide = noise_video(30, (64, 40), 10, seed=31)  # resized by its short edge, cropped from the middle
    tall = noise_video(4, (36, 60), 5, seed=32)  # fewer frames than 6: each once
    cases = [([("video", wide)], "What happens?"), ([("video", tall)], "And here?"),
             ([("video", tall), ("image", noise_image(33, (90, 40)))], "The video, then the picture.")]
    assert_media_cases_match(daemon, reference, cases, NEW_TOKENS, label=())
