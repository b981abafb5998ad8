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


def _original_layout(hf_dir, out):
    """The checkpoint as InternVL's original (remote-code) releases lay it out: config.json of model_type
    internvl_chat (vision_config, llm_config, the tiling settings), the tower under vision_model.* with q, k and v
    fused, the projector as mlp1.*, a ChatML template that reads content as a string, a CLIP-style
    preprocessor_config.json its own code never reads."""
    import json
    import re
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for name in ("tokenizer.json",):
        shutil.copy(hf_dir / name, out / name)
    cfg = json.loads((hf_dir / "config.json").read_text())
    v = cfg["vision_config"]
    pre = json.loads((hf_dir / "preprocessor_config.json").read_text())
    (out / "config.json").write_text(json.dumps({
        "architectures": ["InternVLChatModel"], "model_type": "internvl_chat", "downsample_ratio": 0.5,
        "select_layer": -1, "ps_version": "v2", "template": "internvl2_5", "force_image_size": v["image_size"][0],
        "dynamic_image_size": True, "use_thumbnail": True, "min_dynamic_patch": pre["min_patches"],
        "max_dynamic_patch": pre["max_patches"],
        "vision_config": {"architectures": ["InternVisionModel"], "model_type": "intern_vit_6b",
                          "hidden_size": v["hidden_size"], "intermediate_size": v["intermediate_size"],
                          "num_hidden_layers": v["num_hidden_layers"], "num_attention_heads": v["num_attention_heads"],
                          "image_size": v["image_size"][0], "patch_size": v["patch_size"][0],
                          "qkv_bias": v["attention_bias"], "qk_normalization": v["use_qk_norm"],
                          "norm_type": v["norm_type"], "layer_norm_eps": v["layer_norm_eps"], "hidden_act": "gelu"},
        "llm_config": {**cfg["text_config"], "architectures": ["Qwen2ForCausalLM"]}}))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "chat_template": (
            "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
            "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")}))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "crop_size": 448, "do_center_crop": True, "do_normalize": True, "do_resize": True,
        "feature_extractor_type": "CLIPFeatureExtractor", "image_mean": [0.485, 0.456, 0.406],
        "image_std": [0.229, 0.224, 0.225], "resample": 3, "size": 448}))
    renames = [(r"^(model\.)?vision_tower\.embeddings\.cls_token$", "vision_model.embeddings.class_embedding"),
               (r"^(model\.)?vision_tower\.embeddings\.patch_embeddings\.projection\.",
                "vision_model.embeddings.patch_embedding."),
               (r"^(model\.)?vision_tower\.embeddings\.position_embeddings$", "vision_model.embeddings.position_embedding"),
               (r"^(model\.)?vision_tower\.encoder\.layer\.", "vision_model.encoder.layers."),
               (r"\.attention\.projection_layer\.", ".attn.proj."), (r"\.attention\.(q|k)_norm\.", r".attn.\1_norm."),
               (r"\.layernorm_before\.", ".norm1."), (r"\.layernorm_after\.", ".norm2."),
               (r"\.lambda_1$", ".ls1"), (r"\.lambda_2$", ".ls2"),
               (r"^(model\.)?multi_modal_projector\.layer_norm\.", "mlp1.0."),
               (r"^(model\.)?multi_modal_projector\.linear_1\.", "mlp1.1."),
               (r"^(model\.)?multi_modal_projector\.linear_2\.", "mlp1.3.")]
    weights, fused = {}, {}
    for name, value in load_file(hf_dir / "model.safetensors").items():
        for pattern, repl in renames:
            name = re.sub(pattern, repl, name)
        qkv = re.match(r"(vision_model\.encoder\.layers\.\d+\.)attention\.([qkv])_proj\.(weight|bias)$", name)
        if qkv:
            fused.setdefault((qkv[1], qkv[3]), {})[qkv[2]] = value
            continue
        weights[name] = value
    for (prefix, kind), parts in fused.items():
        weights[f"{prefix}attn.qkv.{kind}"] = torch.cat([parts[x] for x in "qkv"])
    save_file(weights, out / "model.safetensors")
    return out


def test_the_original_checkpoints_read_as_their_hf_conversions(daemon, tiny_internvl, tmp_path, start_daemon):
    """InternVL's original releases (InternVLChatModel) read as their -hf conversions: the same decoder, tower,
    image token and image preparation, and `flared run` over the original directory answers an image as the -hf
    core does (its ChatML template reads content as a string)."""
    import torch
    from flared_testing.vision import ask_greedy, token_ids

    from flared.core.export import ExportOptions, export_core
    from flared.model.loader import read_source

    original = _original_layout(tiny_internvl[0], tmp_path / "original")
    ours, theirs = read_source(original), read_source(tiny_internvl[0])
    assert ours.vision == theirs.vision and ours.config == theirs.config
    for name in ("tensors", "vision_tensors"):
        got, want = getattr(ours, name), getattr(theirs, name)
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), name
    options = dict(concurrency=2, context_tokens=512, prefill_chunk_tokens=128)
    exported = export_core(original, tmp_path / "core", ExportOptions(**options)).vision["processor"]
    assert exported == export_core(tiny_internvl[0], tmp_path / "hf-core", ExportOptions(**options)).vision["processor"]
    served = start_daemon(original, "--cache-dir", str(tmp_path / "cache"), "--context", "512", "--dtype", "float32")
    picture = noise_image(77, (90, 40))
    got, want = (ask_greedy(d, [picture], "What is in the picture?", NEW_TOKENS) for d in (served, daemon))
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert token_ids(got) == token_ids(want)


def test_an_original_internvit_6b_layout_reads_as_its_hf_conversion(tmp_path):
    """InternViT-6B's layout (RMSNorms, q/k norms, no q/k/v biases) in the original releases' names."""
    import torch
    from conftest import build_tiny_internvl

    from flared.model.loader import read_source

    (tmp_path / "hf").mkdir()
    hf_dir = build_tiny_internvl(tmp_path / "hf", norm_type="rms_norm", use_qk_norm=True, attention_bias=False)
    ours, theirs = read_source(_original_layout(hf_dir, tmp_path / "original")), read_source(hf_dir)
    assert ours.vision == theirs.vision and ours.vision.norm_kind == "rms_norm" and ours.vision.qk_norm
    assert all(torch.equal(ours.vision_tensors[k], v) for k, v in theirs.vision_tensors.items())
