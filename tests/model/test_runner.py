"""ModelRunner bookkeeping on a tiny model: pages, stop tokens, logprobs, limits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flared.errors import AdmissionError, ErrorKind
from flared.model.batch import ForwardBatch, SequenceChunk
from flared.model.loader import read_source
from flared.model.runner import ModelRunner
from flared.model.sampling import SamplingParams

from .conftest import build_hf_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return read_source(build_hf_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3")))


def make_runner(tiny, **kwargs):
    options = dict(num_pages=16, page_tokens=4, max_batch=4, prefill_chunk_tokens=8)
    options.update(kwargs)
    return ModelRunner(tiny.config, tiny.tensors, **options)


def test_forward_batch_slots_follow_block_tables():
    chunks = [SequenceChunk([7, 8, 9], 2, [5, 1]), SequenceChunk([4], 6, [2, 0])]
    batch = ForwardBatch.build(chunks, page_tokens=4)
    # seq 0: positions 2,3 in page 5, position 4 in page 1; seq 1: position 6 in page 0 (offset 2).
    assert batch.write_slot_ids.tolist() == [22, 23, 4, 2]
    assert batch.positions.tolist() == [2, 3, 4, 6]
    assert batch.logit_row_ids.tolist() == [2, 3]
    assert batch.decode_row_ids.tolist() == [3]
    assert batch.decode_gather_slot_ids.tolist() == [8, 9, 10, 11, 0, 1, 2]
    group = batch.prefill_groups[0]
    assert (group.row_start, group.row_end) == (0, 3)
    assert group.gather_slot_ids.tolist() == [20, 21, 22, 23, 4]
    assert group.attn_mask.tolist()[0] == [True, True, True, False, False]
    with pytest.raises(ValueError, match="block table"):
        ForwardBatch.build([SequenceChunk([1, 2], 3, [0])], page_tokens=4)


def test_pages_are_returned_and_more_prompts_than_rows_finish(tiny):
    runner = make_runner(tiny, max_batch=2)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, tiny.config.vocab_size, size=n).tolist() for n in (3, 9, 17, 5, 12)]
    params = [SamplingParams(temperature=0, max_tokens=6)] * 5
    results = runner.generate(prompts, params)
    assert [len(r.token_ids) for r in results] == [6] * 5
    assert all(r.finish_reason == "length" for r in results)
    assert runner.allocator.num_free == runner.num_pages
    runner.allocator.check_integrity()
    assert results[2].timings.num_prompt_tokens == 17 and results[2].timings.decode_s > 0
    # The same prompts again, now with room for all at once: identical tokens.
    wide = make_runner(tiny, max_batch=5, num_pages=32).generate(prompts, params)
    assert [r.token_ids for r in wide] == [r.token_ids for r in results]


def test_stop_token_ends_a_sequence(tiny):
    runner = make_runner(tiny)
    prompt = [1, 2, 3, 4]
    free_run = runner.generate([prompt], [SamplingParams(temperature=0, max_tokens=8)])[0].token_ids
    stop = free_run[3]
    first = free_run.index(stop)
    stopped = runner.generate([prompt], [SamplingParams(temperature=0, max_tokens=8)], stop_token_ids={stop})[0]
    assert stopped.token_ids == free_run[: first + 1]
    assert stopped.finish_reason == "stop"


def test_logprobs_per_token(tiny):
    runner = make_runner(tiny)
    result = runner.generate([[5, 6, 7]], [SamplingParams(temperature=0, max_tokens=4, logprobs=2)])[0]
    assert len(result.logprobs) == 4
    for entry, token in zip(result.logprobs, result.token_ids):
        assert entry.token_id == token and entry.rank == 1  # greedy picks the top token
        assert len(entry.top) == 2 and entry.top[0][0] == token
        assert entry.top[0][1] == pytest.approx(entry.logprob) and entry.logprob <= 0
    plain = runner.generate([[5, 6, 7]], [SamplingParams(temperature=0, max_tokens=4)])[0]
    assert plain.logprobs is None and plain.token_ids == result.token_ids


def test_limits_are_admission_errors(tiny):
    runner = make_runner(tiny, num_pages=4)  # 16 token slots
    with pytest.raises(AdmissionError) as info:
        runner.generate([[1] * 10], [SamplingParams(max_tokens=10)])
    assert info.value.kind == ErrorKind.CONTEXT_LENGTH
    with pytest.raises(AdmissionError):
        runner.generate([[]], [SamplingParams()])
    with pytest.raises(AdmissionError):
        runner.generate([[tiny.config.vocab_size]], [SamplingParams()])
    assert runner.allocator.num_free == 4


def test_bfloat16_runs_and_mostly_agrees(tiny):
    prompt = [9, 8, 7, 6, 5]
    fp32 = make_runner(tiny).generate([prompt], [SamplingParams(temperature=0, max_tokens=8)])[0]
    bf16 = make_runner(tiny, dtype=torch.bfloat16).generate([prompt], [SamplingParams(temperature=0, max_tokens=8)])[0]
    assert len(bf16.token_ids) == 8
    assert bf16.token_ids[0] == fp32.token_ids[0]


def test_bfloat16_prompts_longer_than_a_prefill_chunk(tiny):
    """A bf16 prompt of several prefill chunks: the chunks before its last keep no logits (a forward with no
    logit rows), which the bf16 norm kernel once refused ('empty shape rows=0'), failing `flarectl generate` on
    a bf16 core for any prompt over its chunk."""
    prompt = [(5 * i + 3) % 90 + 1 for i in range(21)]  # three chunks of 8
    params = [SamplingParams(temperature=0, max_tokens=4)]
    bf16 = make_runner(tiny, dtype=torch.bfloat16).generate([prompt], params)[0]
    fp32 = make_runner(tiny).generate([prompt], params)[0]
    assert len(bf16.token_ids) == 4 and bf16.token_ids[0] == fp32.token_ids[0]
