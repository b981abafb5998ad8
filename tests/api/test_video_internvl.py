"""Video input on an InternVL core end to end: a random-weight model exported and served by a real `flared run`,
asked with vLLM's video_url parts, its greedy tokens checked against transformers' InternVLForConditionalGeneration
on the same weights, frames and prompt (InternVLProcessor's expansion: ``Frame1: <img>...</img>`` a line a frame,
each frame one tile's tokens). The frames are our FrameVideoProcessor's (transformers' video processor needs
torchvision; tests/frontend/test_video.py checks ours against it where it is installed)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("av")

from flared_testing.video import ask_media, assert_media_cases_match, noise_video, video_part  # noqa: E402
from flared_testing.vision import noise_image, reference_tokenizer  # noqa: E402

NEW_TOKENS = 10
TILE_TOKENS = 4


@pytest.fixture(scope="module")
def daemon(tiny_internvl, tmp_path_factory):
    from flared_testing.daemon import Daemon

    d = Daemon(tiny_internvl[1], tmp_path_factory.mktemp("internvl-video-daemon"))
    yield d
    d.kill()


@pytest.fixture(scope="module")
def reference(tiny_internvl):
    """Greedy tokens transformers makes for a user turn of media (("image", PIL) or ("video", bytes)) then text."""
    import torch
    from transformers import InternVLForConditionalGeneration
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    from flared.core.load import open_core
    from flared_testing.vision import processor_settings

    checkpoint, core = tiny_internvl
    model = InternVLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tok = reference_tokenizer(checkpoint, eos_token="<|im_end|>")
    images = GotOcr2ImageProcessorPil(**processor_settings(checkpoint))
    videos = open_core(core).video_processor()

    def run(media, text: str):
        content = [{"type": kind} for kind, _ in media] + [{"type": "text", "text": text}]
        prompt = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
        pixels, expanded, rest = [], "", prompt
        for kind, item in media:  # (InternVLProcessor: images' and videos' tiles in the prompt's order)
            marker = "<IMG_CONTEXT>" if kind == "image" else "<video>"
            before, rest = rest.split(marker, 1)
            if kind == "image":
                out = images([item], crop_to_patches=True, return_tensors="pt")
                pixels.append(out["pixel_values"])
                expanded += before + f"<img>{'<IMG_CONTEXT>' * TILE_TOKENS * int(out['num_patches'][0])}</img>"
            else:
                frames = torch.from_numpy(videos.prepare(item).pixel_values)
                pixels.append(frames)
                expanded += before + "\n".join(f"Frame{i + 1}: <img>{'<IMG_CONTEXT>' * TILE_TOKENS}</img>"
                                               for i in range(len(frames)))
        ids = tok(expanded + rest, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            gen = model.generate(input_ids=ids, pixel_values=torch.cat(pixels), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        return ids.shape[1], gen[0, ids.shape[1]:].tolist()

    return run


def test_video_greedy_tokens_match_transformers(daemon, reference):
    clip = noise_video(30, (64, 48), 10, seed=11)  # 8 frames from the middles of 8 stretches
    short = noise_video(5, (40, 60), 5, seed=12)  # fewer frames than 8: each once
    cases = [([("video", clip)], "What happens?"), ([("video", short)], "And here?"),
             ([("image", noise_image(13, (90, 40))), ("video", short)], "The picture, then the video.")]
    assert_media_cases_match(daemon, reference, cases, NEW_TOKENS, label=())


def test_frames_per_request(daemon):
    """mm_processor_kwargs' num_frames sets a request's frames (4 tokens each); an option InternVL's video
    preparation has not is a 400."""
    clip = noise_video(30, (64, 48), 10, seed=14)
    counts = [ask_media(daemon, [("video", clip)], "Hi.", NEW_TOKENS, mm_processor_kwargs={"num_frames": n})[
        "usage"]["prompt_tokens"] for n in (2, 6)]
    assert counts[1] - counts[0] > 4 * TILE_TOKENS, counts
    status, body = daemon.chat([{"role": "user", "content": [video_part(clip)]}], max_tokens=2,
                               mm_processor_kwargs={"min_pixels": 100})
    assert status == 400 and body["error"]["param"] == "mm_processor_kwargs.min_pixels", body
