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


def test_the_released_checkpoints_layout_reads_as_the_saved_one(tiny_llava, tmp_path):
    """llava-hf's released checkpoints were saved by transformers 4: CLIP's tower under vision_tower.vision_model.*,
    the decoder under language_model.model.* and language_model.lm_head.*. They read as transformers 5's layout."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from flared.model.loader import read_source

    released = tmp_path / "released"
    shutil.copytree(tiny_llava[0], released)
    weights = load_file(released / "model.safetensors")
    renamed = {}
    for name, value in weights.items():
        if name.startswith("vision_tower."):
            name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")
        renamed[name] = value
    assert any(k.startswith("language_model.model.") for k in renamed)
    save_file(renamed, released / "model.safetensors")
    ours, theirs = read_source(released), read_source(tiny_llava[0])
    assert ours.vision == theirs.vision and sorted(ours.vision_tensors) == sorted(theirs.vision_tensors)
    assert all(torch.equal(ours.vision_tensors[k], v) for k, v in theirs.vision_tensors.items())
    assert sorted(ours.tensors) == sorted(theirs.tensors)
