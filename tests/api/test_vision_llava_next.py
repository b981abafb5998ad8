"""LLaVA-NeXT (a CLIP tower over any-resolution tiles, the two-linear projector, the row-end embedding
image_newline, a Llama decoder) and Granite Vision (LLaVA-NeXT over a SigLIP tower whose several layers feed the
projector side by side, "full" features, a Granite decoder) end to end: random-weight models exported and served by
a real `flared run`, their greedy tokens checked against transformers' LlavaNextForConditionalGeneration on the same
weights, prompt and pixels (transformers' LlavaNextImageProcessorPil and LlavaNextProcessor's expansion of
<image>)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from flared_testing.vision import (  # noqa: E402
    assert_cases_match, noise_image, processor_settings, reference_tokenizer,
)

NEW_TOKENS = 12


# the fixture, and how its processor selects features: CLIP's class row dropped, SigLIP's all
MODELS = {"llava_next": ("tiny_llava_next", "default", 1), "granite_vision": ("tiny_granite_vision", "full", 0)}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    fixture, strategy, extra = MODELS[request.param]
    checkpoint, core = request.getfixturevalue(fixture)
    return request.param, checkpoint, core, strategy, extra


@pytest.fixture(scope="module")
def daemon(model, tmp_path_factory):
    from flared_testing.daemon import Daemon

    d = Daemon(model[2], tmp_path_factory.mktemp(f"{model[0]}-daemon"))
    yield d
    d.kill()


@pytest.fixture(scope="module")
def reference(model):
    import torch
    from transformers import LlavaNextForConditionalGeneration, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    _, checkpoint, _, strategy, extra = model
    model = LlavaNextForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tok = reference_tokenizer(checkpoint, bos_token="<s>", eos_token="</s>")
    processor = LlavaNextProcessor(image_processor=LlavaNextImageProcessorPil(**processor_settings(checkpoint)),
                                   tokenizer=tok, patch_size=7, vision_feature_select_strategy=strategy,
                                   num_additional_image_tokens=extra, image_token="<image>")

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
    """A wide image (a 1 x 2 canvas, the padding's rows cut), a tall one (3 x 1, columns cut), a small square one
    (2 x 2), and two images in one turn."""
    wide, tall, small = noise_image(61, (90, 40)), noise_image(62, (30, 100)), noise_image(63, (20, 20))
    assert_cases_match(daemon, reference, (([wide], "What is in the picture?"), ([tall], "And this one?"),
                                           ([small], "Describe it."), ([wide, tall], "Compare them.")), NEW_TOKENS)


def test_the_answer_depends_on_the_picture(daemon):
    from flared_testing.vision import ask_greedy, token_ids

    answers = {tuple(token_ids(ask_greedy(daemon, [noise_image(seed, (60, 45))], "What?", NEW_TOKENS)))
               for seed in (91, 92, 93)}
    assert len(answers) > 1


def test_the_released_layout_reads_as_the_saved_one(tiny_llava_next, tmp_path):
    """llava-hf's LLaVA-NeXT checkpoints (saved by transformers 4): vision_tower.vision_model.*, language_model.*,
    and the top-level image_newline."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from flared.model.loader import read_source

    released = tmp_path / "released"
    shutil.copytree(tiny_llava_next[0], released)
    renamed = {}
    for name, value in load_file(released / "model.safetensors").items():
        if name.startswith("vision_tower."):
            name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")
        renamed[name.removeprefix("model.") if name == "model.image_newline" else name] = value
    assert "image_newline" in renamed
    save_file(renamed, released / "model.safetensors")
    ours, theirs = read_source(released), read_source(tiny_llava_next[0])
    assert ours.vision == theirs.vision and ours.vision.family == "llava_next"
    assert all(torch.equal(ours.vision_tensors[k], v) for k, v in theirs.vision_tensors.items())
    assert sorted(ours.tensors) == sorted(theirs.tensors) and "image_newline" not in ours.tensors


def test_granite_visions_tower_reads_every_feature_layer(tiny_granite_vision):
    """Granite Vision's config names its three layers, and the tower's rows are transformers' image features (the
    layers' hidden states side by side, projected), for a canvas and a lone tile."""
    import torch
    from transformers import LlavaNextForConditionalGeneration
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    from flared.core.load import open_core
    from flared.frontend.images import DecodedImage
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
        prepared = core.image_processor().prepare_in_request(DecodedImage.from_pil(picture), images=1)
        rows = ours.encode(torch.as_tensor(prepared.pixel_values), grid=prepared.grid)
        assert rows.shape == theirs.shape and torch.allclose(rows, theirs, atol=1e-4), (rows - theirs).abs().max()
