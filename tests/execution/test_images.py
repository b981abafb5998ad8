"""flared.execution.images: where a step's image rows go and which rope positions its rows take (what both
executors place; the CUDA graph executor writes the flat positions into its frame and runs a prefill that feeds
image tokens eagerly with the rows)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from flared.execution.images import flat_positions, image_rows, place_images, rope_positions, shifted_positions
from flared.model.batch import ForwardBatch, SequenceChunk
from flared.runtime.request import VisionInput


def _state(positions, features=None, mrope=None, delta=0):
    return types.SimpleNamespace(vision=VisionInput(np.asarray(positions, dtype=np.int64), features, (), mrope, delta))


def _qwen_prompt():
    """A prompt of 3 text tokens, a 2 x 2 image (4 tokens at its start position plus their row and column), 2 text
    tokens: the text after it starts past the image's longer side."""
    mrope = np.array([[0, 1, 2, 3, 3, 3, 3, 5, 6],
                      [0, 1, 2, 3, 3, 4, 4, 5, 6],
                      [0, 1, 2, 3, 4, 3, 4, 5, 6]], dtype=np.int64)
    return mrope, 7 - 9  # the delta: the next position (7) less the prompt's length (9)


def test_rows_of_image_tokens_the_step_feeds_take_the_towers_rows():
    features = torch.arange(4 * 3, dtype=torch.float32).view(4, 3)
    a = _state([3, 4, 5, 6], features)
    text = types.SimpleNamespace(vision=None)
    # participant 0: text (rows 0..4); participant 1: its prompt's tokens 5..9 (rows 5..9), image tokens 5 and 6
    placed = place_images([text, a], [0, 5], [5, 5], [0, 5, 10], np.arange(10), hidden=3, device="cpu")
    assert placed.rows.tolist() == [5, 6] and torch.equal(placed.values, features[2:4])
    assert placed.deepstack is None and placed.mrope is None
    rows, values = image_rows([text, a], [0, 5], [5, 5], [0, 5, 10])
    assert [r.tolist() for r in rows] == [[5, 6]] and torch.equal(values[0], features[2:4])
    assert image_rows([text, a], [0, 7], [5, 5], [0, 5, 10]) == ([], [])  # past the image
    assert place_images([text, a], [0, 7], [5, 2], [0, 5, 7], np.arange(7), hidden=3, device="cpu") is None
    # a chunk that ends inside the image takes the rows it feeds
    placed = place_images([a], [0], [5], [0, 5], np.arange(5), hidden=3, device="cpu")
    assert placed.rows.tolist() == [3, 4] and torch.equal(placed.values, features[:2])


def test_deepstack_rows_follow_the_embeddings():
    features = torch.randn(2, 3 * 4)  # the embedding's 4 columns, then 2 DeepStack layers' 4 each
    placed = place_images([_state([0, 1], features)], [0], [2], [0, 2], np.arange(2), hidden=4, device="cpu")
    assert torch.equal(placed.values, features[:, :4])
    assert len(placed.deepstack) == 2
    assert all(torch.equal(d, features[:, 4 * (j + 1):4 * (j + 2)]) for j, d in enumerate(placed.deepstack))


def test_3d_rope_positions_inside_and_past_the_prompt():
    mrope, delta = _qwen_prompt()
    qwen = _state([3, 4, 5, 6], torch.zeros(4, 2), mrope, delta)
    text = types.SimpleNamespace(vision=None)
    # a chunk of the prompt's tokens 2..8 beside a text participant's 3 rows at positions 40..42
    out = rope_positions([text, qwen], [40, 2], [3, 7], [0, 3, 10], np.r_[40:43, 2:9])
    assert out[:, :3].tolist() == [[40, 41, 42]] * 3
    assert np.array_equal(out[:, 3:], mrope[:, 2:9])
    assert flat_positions(out) is None  # the image's tokens: the 3D tables
    # decode rows past the prompt: index + delta on all three, which is plain rope there
    out = rope_positions([qwen, text], [9, 50], [1, 1], [0, 1, 2], np.array([9, 50]))
    assert out.tolist() == [[7, 50]] * 3 and flat_positions(out).tolist() == [7, 50]
    assert shifted_positions([qwen, text], [9, 50]).tolist() == [7, 50]  # (decode rows: the same, row by row)
    assert shifted_positions([qwen], [8]).tolist() == [6]  # (inside the prompt: its own, a text token's)
    # the text after the image inside the prompt is flat too
    assert flat_positions(rope_positions([qwen], [7], [2], [0, 2], np.array([7, 8]))).tolist() == [5, 6]
    assert rope_positions([text], [0], [3], [0, 3], np.arange(3)) is None


def test_a_step_with_3d_positions_but_no_image_rows_places_only_positions():
    mrope, delta = _qwen_prompt()
    placed = place_images([_state([3, 4, 5, 6], torch.zeros(4, 2), mrope, delta)], [9], [1], [0, 1], np.array([9]),
                          hidden=2, device="cpu")
    assert placed.rows.numel() == 0 and placed.mrope.tolist() == [[7]] * 3


@pytest.mark.parametrize("with_images", [True, False])
def test_apply_fills_the_forward_batch(with_images):
    mrope, delta = _qwen_prompt()
    features = torch.randn(4, 2)
    chunk = SequenceChunk(list(range(9)), 0, [0])
    batch = ForwardBatch.build([chunk], page_tokens=16)
    state = _state([3, 4, 5, 6], features if with_images else None, mrope, delta)
    place_images([state], [0], [9], [0, 9], np.arange(9), hidden=2, device="cpu").apply(batch)
    assert batch.mrope_positions.tolist() == mrope.tolist()
    if with_images:
        assert batch.embed_rows.tolist() == [3, 4, 5, 6] and torch.equal(batch.embed_values, features)
    else:  # (rows not made yet: nothing placed but the positions)
        assert batch.embed_rows is None


def test_atomic_spans_are_each_images_tokens_where_images_attend_both_ways():
    from flared.execution.images import atomic_spans

    vision = VisionInput(np.array([3, 4, 5, 9, 10, 11, 12]), None, (), None, 0)
    both_ways = types.SimpleNamespace(image_block_tokens=(7,))
    assert atomic_spans(both_ways, vision) == ((3, 6), (9, 13))
    assert atomic_spans(types.SimpleNamespace(image_block_tokens=()), vision) == ()  # (causal images: any cut)
    assert atomic_spans(both_ways, None) == ()
    assert atomic_spans(None, vision) == ()


def test_drive_feeds_a_gemma3_image_whole_as_the_worker_does(tiny_gemma3):
    """An image the 64-token chunk would cut is fed by the next chunk whole: the greedy tokens and logits equal
    those of a chunk that holds the whole prompt, on the eager executor (the graph executor's: tests/cuda/test_vision_gpu.py)."""
    import collections
    import hashlib

    from flared_testing.vision import noise_image

    from flared.core.load import open_core
    from flared.execution.eager import EagerExecutor
    from flared.execution.offline import drive
    from flared.frontend.images import DecodedImage, image_processor_from_dict
    from flared.model.decoder import DecoderModel
    from flared.model.sampling import SamplingParams
    from flared.model.vision import attach_tower, vision_encoder
    from flared.runtime.worker import VisionJob
    from flared.scheduler import PolicyConfig, RequestScheduler, SchedulerConfig

    core = open_core(tiny_gemma3[1])
    config = core.vision_config
    model = DecoderModel(core.config, core.load_tensors(), dtype=torch.float32, device="cpu", max_positions=256)
    attach_tower(model, config, vision_encoder(config, core.load_vision_tensors(), dtype=torch.float32, device="cpu"))
    image = image_processor_from_dict(core.manifest.vision["processor"]).prepare(
        DecodedImage.from_pil(noise_image(5, (40, 30))))
    job = VisionJob([image], done=None)
    while not job.step(model, 0, collections.Counter()):
        pass
    n = image.num_image_tokens
    prompt = list(range(20, 75)) + [config.image_token_id] * n + list(range(80, 90))  # (the image at 55..71)
    vision = VisionInput(np.arange(55, 55 + n), job.result()[0], (), None, 0)

    def tokens(chunk):
        sched = RequestScheduler(SchedulerConfig(
            model_identity=hashlib.sha256(b"drive").digest(), max_live_requests=2, num_pages=64, num_snapshots=8,
            page_tokens=16, context_capacity=256, prefill_chunk_size=chunk), PolicyConfig())
        ex = EagerExecutor(model, num_pages=64, page_tokens=16, num_state_rows=3, num_snapshots=8,
                           vocab_size=model.config.vocab_size, max_live=2)
        result = drive(sched, ex, [prompt], [SamplingParams(max_tokens=6, temperature=0.0)], visions=[vision])
        return result.tokens, result.steps_by_kind, ex.state_logits[1].clone()  # (the last token's logits)

    whole, _, whole_logits = tokens(128)
    cut, steps, cut_logits = tokens(64)
    assert steps["PREFILL"] >= 2
    assert cut == whole
    # (an image cut by the chunk moves these logits by ~1e-3: its first rows' keys miss its later rows)
    assert (cut_logits - whole_logits).abs().max().item() < 1e-5
