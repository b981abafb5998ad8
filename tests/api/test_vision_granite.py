"""Granite Vision (LLaVA-NeXT over a SigLIP tower whose several layers feed the projector side by side, the
row-end embedding image_newline, a Granite decoder) end to end: a random-weight model exported and served by a
real `flared run`, its greedy tokens checked against transformers' LlavaNextForConditionalGeneration on the same
weights, prompt and pixels (transformers' LlavaNextImageProcessorPil and LlavaNextProcessor's expansion of <image>,
"full" features)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from flared_testing.vision import (  # noqa: E402
    assert_cases_match, noise_image, processor_settings, reference_tokenizer,
)

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def daemon(tiny_granite_vision, tmp_path_factory):
    from flared_testing.daemon import Daemon

    d = Daemon(tiny_granite_vision[1], tmp_path_factory.mktemp("granite-vision-daemon"))
    yield d
    d.kill()


@pytest.fixture(scope="module")
def reference(tiny_granite_vision):
    import torch
    from transformers import LlavaNextForConditionalGeneration, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    checkpoint = tiny_granite_vision[0]
    model = LlavaNextForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tok = reference_tokenizer(checkpoint, bos_token="<s>", eos_token="</s>")
    processor = LlavaNextProcessor(image_processor=LlavaNextImageProcessorPil(**processor_settings(checkpoint)),
                                   tokenizer=tok, patch_size=7, vision_feature_select_strategy="full",
                                   num_additional_image_tokens=0, image_token="<image>")

    def run(pictures, text: str):
        content = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": text}]
        prompt = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
        inputs = processor(images=pictures, text=[prompt], return_tensors="pt", add_special_tokens=False)
        ids = inputs["input_ids"]
        with torch.no_grad():
            gen = model.generate(input_ids=ids, pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"],
                                 max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        return ids.shape[1], gen[0, ids.shape[1]:].tolist()

    return run


def test_greedy_tokens_match_transformers(daemon, reference):
    """A wide image (a 1 x 2 canvas, the padding's rows cut), a tall one (3 x 1), a small square one (2 x 2), and
    two images in one turn."""
    wide, tall, small = noise_image(71, (90, 40)), noise_image(72, (30, 100)), noise_image(73, (20, 20))
    assert_cases_match(daemon, reference, (([wide], "What is in the picture?"), ([tall], "And this one?"),
                                           ([small], "Describe it."), ([wide, tall], "Compare them.")), NEW_TOKENS)


def test_the_tower_reads_every_feature_layer(tiny_granite_vision):
    """The tower's config names the three layers, and its rows are transformers' image features (the layers'
    hidden states side by side, projected), for a lone tile and a canvas."""
    import torch
    from transformers import LlavaNextForConditionalGeneration
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    from flared.core.load import open_core
    from flared.model.vision import vision_encoder

    checkpoint, core_path = tiny_granite_vision
    core = open_core(core_path)
    config = core.vision_config
    assert config.siglip_tower and config.feature_layers == (1, 2, -1) and config.feature_depth == 3
    ours = vision_encoder(config, core.load_vision_tensors())
    model = LlavaNextForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    images = LlavaNextImageProcessorPil(**processor_settings(checkpoint))
    for picture in (noise_image(74, (90, 40)), noise_image(75, (20, 20))):
        out = images([picture], return_tensors="pt")
        with torch.no_grad():
            theirs = model.model.get_image_features(
                pixel_values=out["pixel_values"], image_sizes=out["image_sizes"], vision_feature_layer=[1, 2, -1],
                vision_feature_select_strategy="full").pooler_output[0]
        prepared = core.image_processor().prepare_in_request(
            __import__("flared.frontend.images", fromlist=["DecodedImage"]).DecodedImage.from_pil(picture), images=1)
        rows = ours.encode(torch.as_tensor(prepared.pixel_values), grid=prepared.grid)
        assert rows.shape == theirs.shape and torch.allclose(rows, theirs, atol=1e-4), (rows - theirs).abs().max()
