"""Mistral3 (Mistral-Small-3.1's architecture: Pixtral tower, patch merger, Mistral decoder) end to end: a
random-weight model exported and served by a real `flared run`, its greedy tokens checked against transformers'
Mistral3ForConditionalGeneration on the same weights, prompt and pixels (transformers' Pixtral image processor;
the image as rows of [IMG] tokens, each row ended by [IMG_BREAK], the last by [IMG_END])."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from flared_testing.vision import (  # noqa: E402
    ask_greedy, assert_cases_match, noise_image, processor_settings, reference_tokenizer,
)

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def daemon(tiny_mistral3, tmp_path_factory):
    from flared_testing.daemon import Daemon

    d = Daemon(tiny_mistral3[1], tmp_path_factory.mktemp("mistral3-daemon"))
    yield d
    d.kill()


@pytest.fixture(scope="module")
def reference(tiny_mistral3):
    import torch
    from transformers import Mistral3ForConditionalGeneration
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    checkpoint = tiny_mistral3[0]
    model = Mistral3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tok = reference_tokenizer(checkpoint, bos_token="<s>", eos_token="</s>")
    # transformers' PixtralProcessor (its module needs torchvision, not installed here) hands the image processor
    # patch x merge as its patch size, and writes each image as rows of [IMG] ended by [IMG_BREAK], the last by
    # [IMG_END] (tests/frontend/test_images_pixtral.py checks that rule against its own code)
    images = PixtralImageProcessorPil(**processor_settings(checkpoint, patch_size=8 * 2))

    def run(pictures, text: str):
        content = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": text}]
        prompt = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False)
        out = images(pictures, return_tensors="pt")
        pieces = prompt.split("[IMG]")
        expanded = pieces[0]
        for (h, w), piece in zip(out["image_sizes"].tolist(), pieces[1:]):
            rows = ["[IMG]" * (w // 16) + "[IMG_BREAK]"] * (h // 16)
            expanded += "".join(rows)[:-len("[IMG_BREAK]")] + "[IMG_END]" + piece
        ids = tok(expanded, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            gen = model.generate(input_ids=ids, pixel_values=out["pixel_values"], image_sizes=out["image_sizes"],
                                 max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        return ids.shape[1], gen[0, ids.shape[1]:].tolist()

    return run


def _ask(daemon, images, text, **kw):
    return ask_greedy(daemon, images, text, NEW_TOKENS, **kw)


def test_greedy_tokens_match_transformers(daemon, reference):
    wide, tall, small = noise_image(51, (90, 40)), noise_image(52, (30, 100)), noise_image(53, (20, 12))
    assert_cases_match(daemon, reference, (([wide], "What is in the picture?"), ([tall], "And this one?"),
                                           ([small], "Tiny."), ([wide, tall], "Compare them."),
                                           ([tall, wide], "Compare them.")), NEW_TOKENS)

