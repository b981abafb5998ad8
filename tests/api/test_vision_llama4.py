"""Llama 4 with images end to end: a random-weight Llama4ForConditionalGeneration exported and served by a real
`flared run`, its greedy tokens checked against transformers' on the same weights, pixels and prompt (one image of
one tile, of several tiles and a global tile, two images, an image after the text), and the tower's rows against
get_image_features. transformers' Llama4ImageProcessor needs torchvision, which this machine lacks: the pixels fed
to transformers here are ours, and tests/frontend/test_images_llama4.py checks ours against its processor where
torchvision is installed; the prompt's expansion is transformers' Llama4Processor's."""

from __future__ import annotations

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from flared_testing.vision import assert_greedy, ask_greedy, noise_rgb, reference_tokenizer, user_turn  # noqa: E402

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def served(tiny_llama4_vision, tmp_path_factory):
    from flared_testing.daemon import Daemon

    checkpoint, core = tiny_llama4_vision
    d = Daemon(core, tmp_path_factory.mktemp("llama4-vision-daemon"))
    yield checkpoint, core, d
    d.kill()


@pytest.fixture(scope="module")
def reference(tiny_llama4_vision):
    """``run(images, text, text_first=False)`` -> (prompt tokens, greedy tokens) of transformers' model."""
    import torch
    from transformers import Llama4ForConditionalGeneration
    from transformers.models.llama4.processing_llama4 import Llama4Processor

    from flared.core.load import open_core
    from flared.frontend.images import DecodedImage

    checkpoint, core = tiny_llama4_vision
    model = Llama4ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tok = reference_tokenizer(checkpoint, bos_token="<|begin_of_text|>", eos_token="<|eot|>")
    ours = open_core(core).image_processor()

    def run(images, text: str, text_first: bool = False):
        prompt = user_turn(tok, ["image"] * len(images), text, text_first=text_first)
        prepared = [ours.prepare(DecodedImage.from_pil(im)) for im in images]
        pieces = prompt.split("<|image|>")
        expanded = pieces[0]
        for p, piece in zip(prepared, pieces[1:]):
            aspect = (p.rows, p.cols) if p.rows else (1, 1)
            expanded += Llama4Processor._prompt_split_image(None, aspect, ours.tokens_per_tile) + piece
        ids = tok(expanded, add_special_tokens=False, return_tensors="pt")["input_ids"]
        pixels = torch.cat([torch.from_numpy(p.pixel_values) for p in prepared])
        with torch.no_grad():
            gen = model.generate(input_ids=ids, pixel_values=pixels, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        return ids.shape[1], gen[0, ids.shape[1]:].tolist()

    return run


def test_greedy_tokens_match_transformers(served, reference):
    from flared_testing.vision import assert_cases_match, data_url

    _, _, daemon = served
    assert_cases_match(daemon, reference, [
        ([noise_rgb(50, 40, 1)], "One tile."), ([noise_rgb(150, 60, 2)], "Three tiles and a global one."),
        ([noise_rgb(70, 130, 3), noise_rgb(64, 64, 4)], "Two images.")], NEW_TOKENS)

    image = noise_rgb(120, 120, 5)
    status, body = daemon.chat([{"role": "user", "content": [
        {"type": "text", "text": "Text first."}, {"type": "image_url", "image_url": {"url": data_url(image)}}]}],
        max_tokens=NEW_TOKENS, temperature=0, logprobs=True, top_logprobs=3, return_tokens_as_token_ids=True,
        ignore_eos=True)
    assert status == 200, body
    num_prompt, expected = reference([image], "Text first.", text_first=True)
    assert body["usage"]["prompt_tokens"] == num_prompt
    assert_greedy(body, expected, "text first")


def test_the_towers_rows_equal_transformers(tiny_llama4_vision):
    import torch
    from transformers import Llama4ForConditionalGeneration

    from flared.model.loader import read_source
    from flared.model.vision import vision_encoder

    checkpoint, _ = tiny_llama4_vision
    model = Llama4ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    source = read_source(checkpoint)
    c = source.vision
    assert (c.family, c.image_seq_len, c.scale_factor, c.output_dims) == ("llama4", 16, 2, 48)
    assert not any(k.startswith(("vision", "multi_modal")) for k in source.tensors)
    tiles = torch.from_numpy(np.random.default_rng(0).standard_normal((5, 3, 64, 64)).astype(np.float32))
    with torch.no_grad():
        want = model.get_image_features(tiles).pooler_output.reshape(-1, 64)
    got = vision_encoder(c, source.vision_tensors).encode(tiles)
    assert torch.equal(got, want), (got - want).abs().max()


def test_max_patches_per_request_and_limits(served):
    """vLLM's mm_processor_kwargs.max_patches caps one request's tiles; a bad value is a 400 naming it."""
    _, _, daemon = served
    image = noise_rgb(300, 70, 6)
    wide = ask_greedy(daemon, [image], "Wide.", 2)
    one = ask_greedy(daemon, [image], "Wide.", 2, mm_processor_kwargs={"max_patches": 1})
    assert wide["usage"]["prompt_tokens"] - one["usage"]["prompt_tokens"] >= 4 * 16
    status, body = daemon.chat([{"role": "user", "content": "hi"}], max_tokens=1,
                               mm_processor_kwargs={"max_patches": 0})
    assert status == 400 and "max_patches" in body["error"]["message"], body
