"""Pixtral 12B (LLaVA's layout: Pixtral tower, LLaVA's two linears over every patch, Mistral decoder) end to end:
a random-weight model exported and served by a real `flared run`, its greedy tokens checked against transformers'
LlavaForConditionalGeneration on the same weights, prompt and pixels (transformers' Pixtral image processor; the
image as rows of [IMG] tokens, a token a patch, each row ended by [IMG_BREAK], the last by [IMG_END])."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from flared_testing.vision import assert_cases_match, noise_image, processor_settings, reference_tokenizer  # noqa: E402

NEW_TOKENS = 12
PATCH = 8


@pytest.fixture(scope="module")
def daemon(tiny_pixtral, tmp_path_factory):
    from flared_testing.daemon import Daemon

    d = Daemon(tiny_pixtral[1], tmp_path_factory.mktemp("pixtral-daemon"))
    yield d
    d.kill()


@pytest.fixture(scope="module")
def reference(tiny_pixtral):
    import torch
    from transformers import LlavaForConditionalGeneration
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    checkpoint = tiny_pixtral[0]
    model = LlavaForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tok = reference_tokenizer(checkpoint, bos_token="<s>", eos_token="</s>")
    # (transformers' PixtralProcessor needs torchvision: its rule, a row of [IMG] a patch row ended by [IMG_BREAK],
    # the last by [IMG_END], written here as tests/api/test_vision_mistral3.py does with the merge of 1)
    images = PixtralImageProcessorPil(**processor_settings(checkpoint, patch_size=PATCH))

    def run(pictures, text: str):
        content = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": text}]
        prompt = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False)
        out = images(pictures, return_tensors="pt")
        pieces = prompt.split("[IMG]")
        expanded = pieces[0]
        for (h, w), piece in zip(out["image_sizes"].tolist(), pieces[1:]):
            rows = ["[IMG]" * (w // PATCH) + "[IMG_BREAK]"] * (h // PATCH)
            expanded += "".join(rows)[:-len("[IMG_BREAK]")] + "[IMG_END]" + piece
        ids = tok(expanded, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            gen = model.generate(input_ids=ids, pixel_values=out["pixel_values"], image_sizes=out["image_sizes"],
                                 max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        return ids.shape[1], gen[0, ids.shape[1]:].tolist()

    return run


def test_greedy_tokens_match_transformers(daemon, reference):
    wide, tall, small = noise_image(61, (90, 40)), noise_image(62, (30, 100)), noise_image(63, (20, 12))
    assert_cases_match(daemon, reference, (([wide], "What is in the picture?"), ([tall], "And this one?"),
                                           ([small], "Tiny."), ([wide, tall], "Compare them.")), NEW_TOKENS)


def test_the_model_card_says_vision(daemon):
    status, body = daemon.request("GET", "/v1/models")
    assert status == 200 and body["data"][0]["capabilities"]["vision"] is True


def test_the_answer_depends_on_the_picture(reference):
    """(the cases above would pass for a model that ignored its images only if transformers' did too)"""
    one = reference([noise_image(61, (90, 40))], "What is in the picture?")
    other = reference([noise_image(64, (90, 40))], "What is in the picture?")
    assert one[0] == other[0] and one[1] != other[1]
