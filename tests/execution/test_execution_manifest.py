"""ExecutionManifest layout and validation, and the offline driver on the CPU executor."""

import dataclasses
import hashlib

import numpy as np
import pytest

from flared.errors import ExecutionError
from flared.execution.graphs import DECODE_FIELDS, INPUT_FIELDS, SPAN_ALIGN_BYTES, ExecutionManifest, Span


def build(**kw):
    args = dict(decode_batch_sizes=(1, 2, 4, 8), prefill_token_sizes=(64, 128), max_pages_per_sequence=16)
    args.update(kw)
    return ExecutionManifest.build(**args)


def test_layout_is_aligned_disjoint_and_sized():
    m = build()
    m.validate()
    assert [s.name for s in m.spans] == [f[0] for f in INPUT_FIELDS]
    assert m.span("token_ids").shape == (128,)
    assert m.span("block_tables").shape == (8, 16)
    assert all(s.offset_bytes % SPAN_ALIGN_BYTES == 0 for s in m.spans)
    ends = [s.offset_bytes + s.nbytes for s in m.spans]
    assert all(end <= nxt.offset_bytes for end, nxt in zip(ends, m.spans[1:]))
    buf = np.zeros(m.total_bytes, dtype=np.uint8)
    views = m.host_views(buf)
    views["context_lens"][:] = 7
    assert views["context_lens"].dtype == np.int32
    assert int(buf[m.span("context_lens").offset_bytes]) == 7


def test_one_copy_carries_a_decode_step():
    """The decode spans come last, block tables last of them: a step of capacity c uploads one byte range
    that holds every decode field and c block-table rows, and nothing a prefill graph reads."""
    m = build(decode_batch_sizes=(1, 2, 4, 8), prefill_token_sizes=(64, 128))
    assert m.span("decode_block_tables").shape == (8, 16)
    assert m.span("decode_token_ids").shape == (8,) and m.span("token_ids").shape == (128,)
    for cap in (1, 2, 8):
        offset, nbytes = m.decode_upload(cap)
        end = offset + nbytes
        for name in DECODE_FIELDS[:-1]:
            s = m.span(name)
            assert offset <= s.offset_bytes and s.offset_bytes + s.nbytes <= end
        tables = m.span("decode_block_tables")
        assert end == tables.offset_bytes + cap * 16 * 4
        for s in m.spans:
            if s.name not in DECODE_FIELDS:
                assert s.offset_bytes + s.nbytes <= offset
    # the bytes a decode step writes through the host views land inside that range
    buf = np.zeros(m.total_bytes, dtype=np.uint8)
    v = m.host_views(buf)
    v["decode_context_lens"][:2] = 9
    v["decode_block_tables"][:2] = 3
    offset, nbytes = m.decode_upload(2)
    assert int(np.count_nonzero(buf)) == int(np.count_nonzero(buf[offset:offset + nbytes]))


def test_validate_wants_the_decode_spans_last():
    m = build()  # a prefill span moved past the decode spans: the one decode copy would no longer be contiguous
    moved = tuple(dataclasses.replace(s, offset_bytes=m.total_bytes) if s.name == "steps" else s for s in m.spans)
    bad = dataclasses.replace(m, spans=moved, total_bytes=m.total_bytes + SPAN_ALIGN_BYTES * 4)
    with pytest.raises(ExecutionError, match="decode spans must come last"):
        bad.validate()


def test_decode_capacity_bounds_token_rows():
    m = build(decode_batch_sizes=(1, 256), prefill_token_sizes=(64,))
    assert m.max_tokens == 256


@pytest.mark.parametrize("change, message", [
    (lambda m: dataclasses.replace(m, decode_batch_sizes=()), "decode batch sizes"),
    (lambda m: dataclasses.replace(m, prefill_token_sizes=(64, 64)), "repeat"),
    (lambda m: dataclasses.replace(m, max_pages_per_sequence=0), "max_pages"),
    (lambda m: dataclasses.replace(m, spans=m.spans + (m.spans[0],)), "names repeat"),
    (lambda m: dataclasses.replace(m, spans=m.spans[1:]), "not the graph inputs"),
    (lambda m: dataclasses.replace(m, spans=(dataclasses.replace(m.spans[0], offset_bytes=8),) + m.spans[1:]),
     "aligned"),
    (lambda m: dataclasses.replace(m, spans=(m.spans[0], dataclasses.replace(m.spans[1], offset_bytes=0))
                                   + m.spans[2:]), "overlaps"),
    (lambda m: dataclasses.replace(m, spans=(dataclasses.replace(m.spans[0], nbytes=3),) + m.spans[1:]),
     "needs"),
    (lambda m: dataclasses.replace(m, total_bytes=64), "past the buffer"),
])
def test_validate_refuses_bad_manifests(change, message):
    with pytest.raises(ExecutionError, match=message):
        change(build()).validate()


def test_host_views_refuse_a_short_frame():
    m = build()
    with pytest.raises(ExecutionError, match="smaller"):
        m.host_views(np.zeros(m.total_bytes - 1, dtype=np.uint8))


def test_offline_driver_runs_the_scheduler_and_eager_executor_like_transformers(tiny_hf_llama):
    """The driver the GPU qualification uses, on the CPU executor: same greedy tokens as transformers."""
    import torch
    from transformers import LlamaForCausalLM

    from flared.execution.eager import EagerExecutor
    from flared.execution.offline import drive
    from flared.model.decoder import DecoderModel
    from flared.model.loader import read_source
    from flared.model.sampling import SamplingParams
    from flared.scheduler import PolicyConfig, RequestScheduler, SchedulerConfig

    src = read_source(tiny_hf_llama)
    model = DecoderModel(src.config, src.tensors, dtype=torch.float32, device="cpu", max_positions=256)
    sched = RequestScheduler(SchedulerConfig(model_identity=hashlib.sha256(b"t").digest(), max_live_requests=4,
                                             num_pages=64, num_snapshots=16, page_tokens=16, context_capacity=256,
                                             prefill_chunk_size=64), PolicyConfig())
    ex = EagerExecutor(model, num_pages=64, page_tokens=16, num_state_rows=5, num_snapshots=16,
                       vocab_size=src.config.vocab_size, max_live=4)
    prompts = [list(range(3, 80)), list(range(50, 60)), [7]]
    result = drive(sched, ex, prompts, [SamplingParams(temperature=0, max_tokens=12)] * 3)
    assert result.steps_by_kind["PREFILL"] >= 4  # the 77-token prompt takes two 64-token chunks
    assert result.wall_ns > 0 and all(result.finish_ns)
    hf = LlamaForCausalLM.from_pretrained(tiny_hf_llama, torch_dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, result.tokens):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == tokens


def test_pick_decode_takes_the_megakernel_graphs_only_for_short_contexts():
    m = build()  # decode capacities 1, 2, 4, 8
    pick = m.pick_decode
    assert pick(3, False, 100, mega_rows=4, mega_max_context=1024) == ("decode_mega", 4, 4, False)
    assert pick(1, True, 1024, mega_rows=4, mega_max_context=1024) == ("decode_mega", 1, 1, True)
    # one token past the limit, or a capacity past the megakernel's rows: the plain graph
    assert pick(1, True, 1025, mega_rows=4, mega_max_context=1024) == ("decode", 1, 1, True)
    assert pick(5, False, 10, mega_rows=4, mega_max_context=1024) == ("decode", 8, 8, False)
    # off (no megakernel rows)
    assert pick(1, False, 10, mega_rows=0, mega_max_context=1024) == ("decode", 1, 1, False)
    with pytest.raises(ExecutionError, match="no decode graph holds 9"):
        pick(9, False, 10, mega_rows=8, mega_max_context=1024)
    # a step with a LoRA adapter row: the graph that adds the adapters' terms, never the megakernel's
    assert pick(3, False, 100, mega_rows=4, mega_max_context=1024, adapters=True) == ("decode_lora", 4, 4, False)
    assert pick(5, True, 2000, mega_rows=0, mega_max_context=1024, adapters=True) == ("decode_lora", 8, 8, True)


def test_the_collector_is_off_during_captures_and_restored_after():
    """collector_paused (around every CUDA graph capture) turns the cyclic collector off inside, and back on only
    where it was on, also when the captures raise."""
    import gc

    from flared.execution.graphs import collector_paused

    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with collector_paused():
            assert not gc.isenabled()
            raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
