"""LLaVA-OneVision (a SigLIP tower over any-resolution tiles, LLaVA's projector, image_newline, a Qwen2 decoder) end
to end: a random-weight model exported and served by a real `flared run`, its greedy tokens checked against
transformers' LlavaOnevisionForConditionalGeneration on the same weights, prompt and pixels (transformers'
LlavaOnevisionImageProcessorPil; each <image> expanded to the rows the model makes of it: a lone image's tiles,
their features scaled down past anyres_max, and row ends; each image of a turn with two, one padded tile)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from flared_testing.vision import (  # noqa: E402
    assert_cases_match, noise_image, processor_settings, reference_tokenizer,
)

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def daemon(tiny_llava_onevision, tmp_path_factory):
    from flared_testing.daemon import Daemon

    d = Daemon(tiny_llava_onevision[1], tmp_path_factory.mktemp("onevision-daemon"))
    yield d
    d.kill()


@pytest.fixture(scope="module")
def reference(tiny_llava_onevision):
    import torch
    from transformers import LlavaOnevisionForConditionalGeneration
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    checkpoint = tiny_llava_onevision[0]
    model = LlavaOnevisionForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tok = reference_tokenizer(checkpoint, eos_token="<|im_end|>")
    images = LlavaOnevisionImageProcessorPil(**processor_settings(checkpoint))

    def run(pictures, text: str):
        content = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": text}]
        prompt = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
        prepared = images([pictures], return_tensors="pt")
        with torch.no_grad():  # (the rows the model makes of each image: as many image tokens)
            rows = model.model.get_image_features(
                pixel_values=prepared["pixel_values"], image_sizes=prepared["image_sizes"],
                batch_num_images=prepared["batch_num_images"], vision_feature_layer=-1,
                vision_feature_select_strategy="full").pooler_output
        pieces = prompt.split("<image>")
        expanded = pieces[0] + "".join("<image>" * len(r) + rest for r, rest in zip(rows, pieces[1:]))
        ids = tok(expanded, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            gen = model.generate(input_ids=ids, pixel_values=prepared["pixel_values"],
                                 image_sizes=prepared["image_sizes"], batch_num_images=prepared["batch_num_images"],
                                 max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        return ids.shape[1], gen[0, ids.shape[1]:].tolist()

    return run


def test_greedy_tokens_match_transformers(daemon, reference):
    """A wide image (a 1 x 3 canvas), a tall one, a square one whose 3 x 3 canvas's features are scaled down, and two
    images in one turn (one padded tile each)."""
    wide, tall, square = noise_image(41, (90, 40)), noise_image(42, (30, 100)), noise_image(43, (80, 80))
    assert_cases_match(daemon, reference, (([wide], "What is in the picture?"), ([tall], "And this one?"),
                                           ([square], "Describe it."), ([wide, tall], "Compare them.")), NEW_TOKENS)


def test_the_image_processor_and_tower_match_transformers(tiny_llava_onevision):
    """Pixels bit for bit and the tower's rows (and so the image token count) for lone images of several shapes,
    the scaled-down grids among them, and for the images of a two-image request."""
    import json

    import torch
    from transformers import LlavaOnevisionForConditionalGeneration
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    from flared.frontend.images import DecodedImage, image_processor_from_hf
    from flared.model.loader import read_source
    from flared.model.vision import vision_encoder

    checkpoint = tiny_llava_onevision[0]
    model = LlavaOnevisionForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    theirs = LlavaOnevisionImageProcessorPil(**processor_settings(checkpoint))
    ours = image_processor_from_hf(json.loads((checkpoint / "preprocessor_config.json").read_text()),
                                   json.loads((checkpoint / "processor_config.json").read_text()), image_seq_len=16)
    source = read_source(checkpoint)
    tower = vision_encoder(source.vision, source.vision_tensors)
    for batch in ([(90, 40)], [(30, 100)], [(28, 28)], [(200, 50)], [(80, 80)], [(57, 29)], [(90, 40), (30, 60)]):
        pictures = [noise_image(w + h, (w, h)) for w, h in batch]
        want = theirs([pictures], return_tensors="pt")
        with torch.no_grad():
            rows = model.model.get_image_features(
                pixel_values=want["pixel_values"], image_sizes=want["image_sizes"],
                batch_num_images=want["batch_num_images"], vision_feature_layer=-1,
                vision_feature_select_strategy="full").pooler_output
        for k, picture in enumerate(pictures):
            got = ours.prepare(DecodedImage.from_pil(picture), alone=len(pictures) == 1)
            n = got.pixel_values.shape[0]
            assert torch.equal(torch.as_tensor(got.pixel_values), want["pixel_values"][k, :n]), batch
            assert got.num_image_tokens == len(rows[k]) == len(got.prompt) // len("<image>"), batch
            assert torch.allclose(tower.encode(torch.as_tensor(got.pixel_values), grid=got.grid), rows[k],
                                  atol=1e-5), batch
