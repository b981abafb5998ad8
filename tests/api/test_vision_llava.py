"""LLaVA-1.5 (a CLIP tower, a two-linear projector, a Llama decoder) end to end: a random-weight model exported and
served by a real `flared run`, its greedy tokens checked against transformers' LlavaForConditionalGeneration on
the same weights, prompt and pixels (transformers' CLIP image processor; <image> expanded to the tower's rows)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from flared_testing.vision import (  # noqa: E402
    assert_cases_match, noise_image, processor_settings, reference_tokenizer,
)

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def daemon(tiny_llava, tmp_path_factory):
    from flared_testing.daemon import Daemon

    d = Daemon(tiny_llava[1], tmp_path_factory.mktemp("llava-daemon"))
    yield d
    d.kill()


@pytest.fixture(scope="module")
def reference(tiny_llava):
    import torch
    from transformers import LlavaForConditionalGeneration
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    checkpoint = tiny_llava[0]
    model = LlavaForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tok = reference_tokenizer(checkpoint, bos_token="<s>", eos_token="</s>")
    images = CLIPImageProcessorPil(**processor_settings(checkpoint))

    def run(pictures, text: str):
        content = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": text}]
        prompt = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
        ids = tok(prompt.replace("<image>", "<image>" * 16), add_special_tokens=False, return_tensors="pt")
        pixels = images(pictures, return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            gen = model.generate(input_ids=ids["input_ids"], pixel_values=pixels, max_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        return ids["input_ids"].shape[1], gen[0, ids["input_ids"].shape[1]:].tolist()

    return run


def test_greedy_tokens_match_transformers(daemon, reference):
    wide, tall = noise_image(71, (90, 40)), noise_image(72, (30, 100))
    assert_cases_match(daemon, reference, (([wide], "What is in the picture?"), ([tall], "And this one?"),
                                           ([wide, tall], "Compare them.")), NEW_TOKENS)
