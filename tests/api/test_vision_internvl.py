"""InternVL (an InternViT tower over GotOcr2's tiles, pixel-shuffled 2 x 2, a LayerNorm-and-two-linear projector, a
Qwen2 decoder) end to end: a random-weight model exported and served by a real `flared run`, its greedy tokens
checked against transformers' InternVLForConditionalGeneration on the same weights, prompt and pixels
(transformers' GotOcr2 image processor with crop_to_patches, as InternVLProcessor calls it; each image's context
token expanded to <img>, 4 tokens a tile, </img>). The tower's other layouts (InternViT-6B's RMSNorms and q/k
norms, a post-LayerNorm, an earlier feature layer) are checked against transformers' image features."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from flared_testing.vision import (  # noqa: E402
    assert_cases_match, noise_image, processor_settings, reference_tokenizer,
)

NEW_TOKENS = 12
TILE_TOKENS = 4


@pytest.fixture(scope="module")
def daemon(tiny_internvl, tmp_path_factory):
    from flared_testing.daemon import Daemon

    d = Daemon(tiny_internvl[1], tmp_path_factory.mktemp("internvl-daemon"))
    yield d
    d.kill()


def _image_processor(checkpoint):
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    return GotOcr2ImageProcessorPil(**processor_settings(checkpoint))


@pytest.fixture(scope="module")
def reference(tiny_internvl):
    import torch
    from transformers import InternVLForConditionalGeneration

    checkpoint = tiny_internvl[0]
    model = InternVLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tok = reference_tokenizer(checkpoint, eos_token="<|im_end|>")
    images = _image_processor(checkpoint)

    def run(pictures, text: str):
        content = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": text}]
        prompt = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
        prepared = images(pictures, crop_to_patches=True, return_tensors="pt")  # (InternVLProcessor's default)
        pieces = prompt.split("<IMG_CONTEXT>")
        assert len(pieces) == len(pictures) + 1
        expanded = pieces[0] + "".join(f"<img>{'<IMG_CONTEXT>' * TILE_TOKENS * int(n)}</img>{rest}"
                                       for n, rest in zip(prepared["num_patches"], pieces[1:]))
        ids = tok(expanded, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            gen = model.generate(input_ids=ids, pixel_values=prepared["pixel_values"], max_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        return ids.shape[1], gen[0, ids.shape[1]:].tolist()

    return run


def test_greedy_tokens_match_transformers(daemon, reference):
    """A wide image (2 tiles and a thumbnail), a tall one (three tiles and a thumbnail), a small square one (one
    tile, no thumbnail), and two images in one turn."""
    wide, tall, small = noise_image(81, (90, 40)), noise_image(82, (30, 100)), noise_image(83, (20, 20))
    assert_cases_match(daemon, reference, (([wide], "What is in the picture?"), ([tall], "And this one?"),
                                           ([small], "Describe it."), ([wide, tall], "Compare them.")), NEW_TOKENS)


def test_the_answer_depends_on_the_picture(daemon):
    from flared_testing.vision import ask_greedy, metric, token_ids

    tiles = metric(daemon, "flare_vision_tiles")
    answers = {tuple(token_ids(ask_greedy(daemon, [noise_image(seed, (60, 60))], "What?", NEW_TOKENS)))
               for seed in (91, 92, 93)}
    assert len(answers) > 1
    assert metric(daemon, "flare_vision_tiles") == tiles + 3 * 5  # (each: a 2 x 2 canvas and a thumbnail)


@pytest.mark.parametrize("tower", [
    dict(norm_type="rms_norm", use_qk_norm=True, use_mean_pooling=False, attention_bias=False),
    dict(use_mean_pooling=False),
    dict(feature_layer=-2),
])
def test_other_tower_layouts_match_transformers_image_features(tower, tmp_path):
    """InternViT-6B's layout (RMSNorms, q and k RMS-normed over all heads, no q/k/v biases), a tower with a
    post-LayerNorm (no mean pooling), and features from the layer before the last."""
    import json

    import torch
    from conftest import build_tiny_internvl
    from transformers import InternVLForConditionalGeneration

    from flared.frontend.images import DecodedImage, image_processor_from_hf
    from flared.model.loader import read_source
    from flared.model.vision import vision_encoder

    tower = dict(tower)
    layer = tower.pop("feature_layer", -1)
    checkpoint = build_tiny_internvl(tmp_path, **tower)
    if layer != -1:
        config = json.loads((checkpoint / "config.json").read_text())
        config["vision_feature_layer"] = layer
        (checkpoint / "config.json").write_text(json.dumps(config))
    model = InternVLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    source = read_source(checkpoint)
    assert source.vision.family == "internvl" and source.vision.feature_layer == layer
    encoder = vision_encoder(source.vision, source.vision_tensors)
    ours = image_processor_from_hf(json.loads((checkpoint / "preprocessor_config.json").read_text()),
                                   json.loads((checkpoint / "processor_config.json").read_text()),
                                   image_seq_len=TILE_TOKENS)
    picture = noise_image(7, (90, 40))
    theirs = _image_processor(checkpoint)([picture], crop_to_patches=True, return_tensors="pt")["pixel_values"]
    prepared = ours.prepare(DecodedImage.from_pil(picture))
    assert torch.equal(torch.as_tensor(prepared.pixel_values), theirs)
    with torch.no_grad():
        want = model.model.get_image_features(pixel_values=theirs, vision_feature_layer=layer,
                                              vision_feature_select_strategy="default").pooler_output
    got = encoder.encode(torch.as_tensor(prepared.pixel_values))
    assert len(prepared.pixel_values) == 3 and got.shape == (3 * TILE_TOKENS, 64)  # (two tiles and a thumbnail)
    assert torch.allclose(got, want.reshape(got.shape), atol=1e-5), (got - want.reshape(got.shape)).abs().max()


def test_a_template_that_reads_content_as_a_string_gets_the_placeholders(daemon, tiny_internvl, tmp_path,
                                                                        start_daemon):
    """A chat template that reads content as a string (ChatML's concatenation, as InternVL's original checkpoints and
    many GGUFs carry): each message's parts reach it as one string, an image part as <IMG_CONTEXT>, parts joined by
    newlines (vLLM's "string" content format). That prompt is the one the part-reading template writes, so the
    answers are the same."""
    from flared_testing.vision import ask_greedy, token_ids

    from flared.frontend.template import ChatTemplate

    chatml = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
              "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    assert not ChatTemplate(chatml).reads_content_parts
    (tmp_path / "chatml.jinja").write_text(chatml)
    strings = start_daemon(tiny_internvl[1], "--chat-template", str(tmp_path / "chatml.jinja"))
    picture = noise_image(71, (90, 40))
    for d in (daemon, strings):
        assert ask_greedy(d, [], "Hello there", 4)["usage"]["prompt_tokens"] > 0  # (text alone still renders)
    got, want = (ask_greedy(d, [picture], "What is in the picture?", NEW_TOKENS) for d in (strings, daemon))
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"] > 3 * TILE_TOKENS
    assert token_ids(got) == token_ids(want)
