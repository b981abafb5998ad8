"""Image towers (flared.model.vision) against transformers' on the same random weights, and Qwen VL's 3D rope
positions against transformers' get_rope_index."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

TEXT = dict(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024)
QWEN_TEXT = {**TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}


def _model(family: str):
    from transformers import (Mistral3Config, Mistral3ForConditionalGeneration, Qwen2_5_VLConfig,
                              Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig, Qwen2VLForConditionalGeneration,
                              Qwen3VLConfig, Qwen3VLForConditionalGeneration, SmolVLMConfig,
                              SmolVLMForConditionalGeneration)

    torch.manual_seed(0)
    if family.startswith("mistral3"):  # Pixtral's tower: gelu by transformers' default, silu on the releases
        act = family.split("-")[1]
        cfg = Mistral3Config(
            text_config={**TEXT, "model_type": "mistral", "sliding_window": None}, image_token_index=300,
            spatial_merge_size=2, vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=48,
                                                     num_hidden_layers=2, num_attention_heads=2, head_dim=16,
                                                     patch_size=8, hidden_act=act, initializer_range=0.2))
        return Mistral3ForConditionalGeneration(cfg).eval()
    if family == "smolvlm":
        cfg = SmolVLMConfig(text_config={**TEXT, "model_type": "llama"}, scale_factor=2, image_token_id=300,
                            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=2, image_size=64, patch_size=8,
                                               initializer_range=0.2))
        return SmolVLMForConditionalGeneration(cfg).eval()
    ids = dict(image_token_id=390, video_token_id=392, vision_start_token_id=391, vision_end_token_id=393)
    if family == "qwen2_vl":
        cfg = Qwen2VLConfig(text_config=QWEN_TEXT, **ids, vision_config=dict(
            depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, initializer_range=0.2))
        return Qwen2VLForConditionalGeneration(cfg).eval()
    if family == "qwen3_vl":
        rope = {**QWEN_TEXT["rope_parameters"], "mrope_interleaved": True}
        text = {**QWEN_TEXT, "head_dim": 16, "rope_parameters": rope}
        cfg = Qwen3VLConfig(text_config=text, **ids, vision_config=dict(
            depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2, patch_size=16,
            num_position_embeddings=64, deepstack_visual_indexes=[0, 2], initializer_range=0.2))
        return Qwen3VLForConditionalGeneration(cfg).eval()
    cfg = Qwen2_5_VLConfig(text_config=QWEN_TEXT, **ids, vision_config=dict(
        depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2, window_size=56,
        fullatt_block_indexes=[1], initializer_range=0.2))
    return Qwen2_5_VLForConditionalGeneration(cfg).eval()


def _ours(model, dtype=torch.float32):
    from flared.model.vision import hf_vision_to_serving, vision_encoder, vision_from_hf

    config = vision_from_hf(model.config.to_dict())
    tensors = hf_vision_to_serving({k: v.detach() for k, v in model.state_dict().items()}, config, source="test")
    return vision_encoder(config, tensors, dtype=dtype)


@pytest.mark.parametrize("family, grid", [
    ("smolvlm", None), ("qwen2_vl", (1, 6, 8)), ("qwen2_vl", (1, 2, 2)),
    # windows of 2 x 2 merged blocks: a 5 x 7 grid of blocks leaves ragged windows on two edges
    ("qwen2_5_vl", (1, 10, 14)), ("qwen2_5_vl", (1, 4, 4)), ("qwen2_5_vl", (1, 16, 6)),
    # a position table of 8 x 8 resampled to grids smaller and larger than it; DeepStack rows after the main ones
    ("qwen3_vl", (1, 6, 8)), ("qwen3_vl", (1, 2, 2)), ("qwen3_vl", (1, 12, 20)),
    ("mistral3-gelu", (1, 6, 8)), ("mistral3-silu", (1, 4, 12)), ("mistral3-silu", (1, 2, 2))])
def test_tower_rows_equal_transformers(family, grid):
    model = _model(family)
    ours = _ours(model)
    torch.manual_seed(1)
    with torch.no_grad():
        if grid is None:
            pixels = torch.randn(3, 3, 64, 64)
            expected = torch.cat(list(model.model.get_image_features(pixels[None]).pooler_output))
        elif family.startswith("mistral3"):
            pixels = torch.randn(3, grid[1] * 8, grid[2] * 8)
            sizes = torch.tensor([[grid[1] * 8, grid[2] * 8]])
            tower = model.model.vision_tower(pixels[None], image_sizes=sizes, output_hidden_states=True,
                                             return_dict=True)
            expected = model.model.multi_modal_projector(tower.hidden_states[-1].squeeze(0), sizes)
        else:
            patch = 16 if family == "qwen3_vl" else 14
            pixels = torch.randn(grid[0] * grid[1] * grid[2], 3 * 2 * patch * patch)
            out = model.model.get_image_features(pixels, torch.tensor([grid]))
            expected = out.pooler_output
            expected = torch.cat(list(expected)) if isinstance(expected, (list, tuple)) else expected
            if family == "qwen3_vl":
                expected = torch.cat([expected, *(torch.cat(list(f)) for f in out.deepstack_features)], dim=-1)
    got = ours.encode(pixels, grid=grid)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    # bf16 towers differ by bf16 rounding only
    torch.testing.assert_close(_ours(model, torch.bfloat16).encode(pixels, grid=grid).float(), expected,
                               rtol=0.05, atol=0.05 * expected.abs().max().item())


def test_tower_inputs_are_checked():
    ours = _ours(_model("qwen2_vl"))
    with pytest.raises(ValueError, match="patch grid"):
        ours.encode(torch.zeros(4, 1176))
    with pytest.raises(ValueError, match="patches must be"):
        ours.encode(torch.zeros(5, 1176), grid=(1, 2, 2))
    with pytest.raises(ValueError, match="tiles must be"):
        _ours(_model("smolvlm")).encode(torch.zeros(1, 3, 32, 32))


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_mrope_positions_equal_transformers(family):
    """Text, an image of 3 x 4 merged patches, text, an image of 2 x 1, text: positions and the delta."""
    from flared.model.vision import mrope_positions

    model = _model(family)
    grids = [(1, 6, 8), (1, 4, 2)]
    ids = [5, 6, 391] + [390] * 12 + [393, 7, 8, 9, 391] + [390] * 2 + [393, 10]
    starts = [3, 20]
    expected, expected_delta = model.model.get_rope_index(
        torch.tensor([ids]), mm_token_type_ids=(torch.tensor([ids]) == 390).int(),
        image_grid_thw=torch.tensor(grids))
    positions, delta = mrope_positions(ids, [(s, 12 if k == 0 else 2, g) for k, (s, g) in
                                             enumerate(zip(starts, grids))], 2)
    assert positions.tolist() == expected[:, 0].tolist()
    assert delta == int(expected_delta)
    with pytest.raises(ValueError):
        mrope_positions(ids, [(3, 11, grids[0])], 2)


@pytest.mark.parametrize("family", ["smolvlm", "qwen2_5_vl"])
def test_a_vision_job_runs_its_tower_a_layer_a_turn(family):
    """The model thread runs an image tower between other requests' steps: with no time budget a turn runs one
    layer, so a large image holds their tokens back by a layer, not by the whole tower; the rows are the same."""
    import collections
    import types

    import numpy as np

    from flared.runtime.worker import VisionJob

    ours = _ours(_model(family))
    rng = np.random.default_rng(0)
    if family == "smolvlm":
        images = [types.SimpleNamespace(pixel_values=rng.standard_normal((n, 3, 64, 64), dtype=np.float32), grid=None,
                                        modality="image") for n in (2, 1)]
    else:
        images = [types.SimpleNamespace(pixel_values=rng.standard_normal((n, 1176), dtype=np.float32), grid=g,
                                        modality="image") for n, g in ((140, (1, 10, 14)), (16, (1, 4, 4)))]
    job = VisionJob(images, done=None, turn_s=0.0)
    stats, turns = collections.Counter(), 1
    while not job.step(types.SimpleNamespace(vision=ours), 512, stats):
        turns += 1
    assert turns == 2 * ours.config.num_layers + 1  # a layer a turn, each image's rows made on the turn after
    for image, rows in zip(images, job.result()):
        torch.testing.assert_close(rows, ours.encode(torch.as_tensor(image.pixel_values), grid=image.grid),
                                   rtol=0, atol=0)
    assert stats["vision_images"] == 2
