"""Speculative decoding by prompt lookup on the CUDA graph executor (GraphExecutor(speculative=N)).

A speculative step runs as a decode graph with a row per fed token (every row writes its K/V before any row
attends); each row's token (the argmax, or a sampled request's draw at that position) verifies the draft after it,
and poll keeps the drafts those confirm.
float32: the tokens equal plain decoding's and the CPU path's, exactly, in fewer steps. The model thread
serves speculation on the GPU (bf16).
"""

import hashlib
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).parent))

from gpu_models import CONTEXT, PAGE_TOKENS, make_cpu_executor, make_executor, serving_model  # noqa: E402

# prompts that repeat themselves: the lookup finds drafts in them and in the output
PROMPTS = [[3, 4, 5, 6, 7, 8] * 8, list(range(100, 140)) * 2, [9, 10, 11] * 5, list(range(200, 210))]
BATCH_SHAPES = ((2, 64), (2, 128), (4, 128))


def _scheduler(graph_shapes=(), spec=4, max_rows=0, drafter=None):
    """``max_rows``: the executor's spec_max_rows (0: the CPU's); ``drafter``: a DraftModel (None: prompt lookup)."""
    from flared.scheduler import PolicyConfig, RequestScheduler, SchedulerConfig

    return RequestScheduler(SchedulerConfig(
        model_identity=hashlib.sha256(b"cuda-spec").digest(), max_live_requests=4, num_pages=128, num_snapshots=16,
        page_tokens=PAGE_TOKENS, context_capacity=CONTEXT, prefill_chunk_size=128, graph_shapes=tuple(graph_shapes),
        speculative_tokens=spec, speculative_max_rows=max_rows, drafter=drafter), PolicyConfig())


def _plain(gpu, prompts):
    """``prompts`` decoded plainly on a fresh executor."""
    ex = make_executor(gpu, prefill_batch_shapes=BATCH_SHAPES)
    try:
        return _drive(ex, _scheduler(ex.graph_shapes, spec=0), prompts, speculate=False)
    finally:
        ex.close()


def _drive(ex, sched, prompts, max_tokens=40, speculate=True):
    from flared.execution.offline import drive
    from flared.model.sampling import SamplingParams

    ticks = iter(range(1, 10**9))
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens)] * len(prompts)
    return drive(sched, ex, prompts, params, speculate=speculate, clock_ns=lambda: next(ticks))


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["one", "four"])
def test_float32_speculative_tokens_equal_plain_decoding(hf, prompts):
    gpu = serving_model(hf)
    plain = _plain(gpu, prompts)
    ex = make_executor(gpu, prefill_batch_shapes=BATCH_SHAPES, speculative=4)
    try:
        assert ex.spec_batch_sizes == (2, 4, 8, 16, 32) and ex.spec_max_rows == 32  # 4 requests x (1 + 4 drafts)
        sched = _scheduler(ex.graph_shapes, max_rows=ex.spec_max_rows)
        got = _drive(ex, sched, prompts)
        again = _drive(ex, _scheduler(ex.graph_shapes, max_rows=ex.spec_max_rows), prompts)
    finally:
        ex.close()
    assert got.tokens == plain.tokens == again.tokens
    assert got.steps_by_kind["SPECULATIVE"] > 0 and sched.counters["speculative_accepted"] > 0
    if len(prompts) == 1:
        # (with four requests the policy's cohorts and the draft pricing follow measured GPU times, and the step
        # count with them: 13 speculative + 41 decode steps against plain decoding's 41 once in six runs)
        assert got.steps_by_kind["SPECULATIVE"] + got.steps_by_kind["DECODE"] < plain.steps_by_kind["DECODE"]
    cpu = _drive(make_cpu_executor(serving_model(hf, "cpu")), _scheduler(), prompts)
    assert cpu.tokens == got.tokens


def test_float32_a_sampled_request_rides_along_and_a_small_cap_still_verifies(hf):
    """A cohort of greedy requests with drafts and a sampled one (its lone row samples as a decode row does,
    seeded): the greedy tokens equal plain decoding's and the sampled stream equals its own plain run's; with the
    scheduler's cap at 2 rows (one draft for a lone request) the greedy tokens still equal plain decoding's."""
    from flared.execution.offline import drive
    from flared.model.sampling import SamplingParams

    gpu = serving_model(hf)
    prompts = PROMPTS[:3]
    params = [SamplingParams(temperature=0.0, max_tokens=32), SamplingParams(temperature=0.9, seed=11, max_tokens=32),
              SamplingParams(temperature=0.0, max_tokens=32)]

    def run(ex, sched, speculate):
        ticks = iter(range(1, 10**9))
        return drive(sched, ex, prompts, params, speculate=speculate, clock_ns=lambda: next(ticks))

    ex = make_executor(gpu, prefill_batch_shapes=BATCH_SHAPES)
    try:
        plain = run(ex, _scheduler(ex.graph_shapes, spec=0), False)
    finally:
        ex.close()
    ex = make_executor(gpu, prefill_batch_shapes=BATCH_SHAPES, speculative=4)
    try:
        sched = _scheduler(ex.graph_shapes, max_rows=ex.spec_max_rows)
        got = run(ex, sched, True)
        capped_sched = _scheduler(ex.graph_shapes, max_rows=2)
        capped = _drive(ex, capped_sched, PROMPTS[:1])
    finally:
        ex.close()
    assert got.steps_by_kind["SPECULATIVE"] > 0 and sched.counters["speculative_accepted"] > 0
    assert got.tokens == plain.tokens
    assert capped_sched.counters["speculative_accepted"] > 0
    assert capped_sched.counters["speculative_drafted"] == capped.steps_by_kind["SPECULATIVE"]  # one draft a step
    ex = make_executor(gpu, prefill_batch_shapes=BATCH_SHAPES)
    try:
        alone = _drive(ex, _scheduler(ex.graph_shapes, spec=0), PROMPTS[:1], speculate=False)
    finally:
        ex.close()
    assert capped.tokens == alone.tokens


def test_float32_sampled_requests_speculate_and_draw_what_plain_decoding_draws(hf):
    """Seeded sampled requests (temperature, top-k, top-p, min-p) feed drafts too: the graph draws row j of a
    request at its draw count plus j, a draft is kept where the draw equals it, and the tokens are plain decoding's,
    draw for draw. A typical-p request is not the graph sampler's: it would ride along without drafts. (The tiny random model's
    logits spread about 0.2: its temperatures are scaled down to where its draws mostly follow the loops its
    argmax makes, as a trained model's draws follow a passage it copies, or the lookup would find no draft.)"""
    import dataclasses

    from flared.execution.offline import drive
    from flared.model.sampling import SamplingParams

    gpu = serving_model(hf)
    prompts = PROMPTS[:3]
    params = [SamplingParams(temperature=0.003, seed=3, max_tokens=48),
              SamplingParams(temperature=0.01, top_k=4, top_p=0.95, seed=8, max_tokens=48),
              SamplingParams(temperature=0.006, min_p=0.1, seed=1, max_tokens=48)]

    def run(ex, sched, params, speculate):
        ticks = iter(range(1, 10**9))
        return drive(sched, ex, prompts, params, speculate=speculate, clock_ns=lambda: next(ticks))

    ex = make_executor(gpu, prefill_batch_shapes=BATCH_SHAPES)
    try:
        plain = run(ex, _scheduler(ex.graph_shapes, spec=0), params, False)
        greedy = run(ex, _scheduler(ex.graph_shapes, spec=0),
                     [dataclasses.replace(p, temperature=0.0) for p in params], False)
    finally:
        ex.close()
    ex = make_executor(gpu, prefill_batch_shapes=BATCH_SHAPES, speculative=4)
    try:
        assert all(ex.speculates(p) for p in params)
        assert not ex.speculates(SamplingParams(temperature=0.02, typical_p=0.9))
        sched = _scheduler(ex.graph_shapes, max_rows=ex.spec_max_rows)
        got = run(ex, sched, params, True)
    finally:
        ex.close()
    # (how many drafts are fed follows the scheduler's pricing over measured GPU times, so whether one is
    # rejected varies from run to run: the CPU's case holds that)
    assert got.tokens == plain.tokens
    assert sched.counters["speculative_accepted"] > 0
    assert greedy.tokens != plain.tokens


def test_the_model_thread_speculates_on_the_gpu(tiny_hf_llama, tmp_path):
    """ModelRuntime(speculative=...) on a bf16 core: the GraphExecutor takes SPECULATIVE steps, greedy requests
    get the same tokens each time, a sampled one rides along, and the counters count the drafts."""
    from flared.core.export import ExportOptions, export_core
    from flared.core.load import open_core
    from flared.model.sampling import SamplingParams
    from flared.runtime.request import ErrorEvent, GenerateRequest, TokenEvent
    from flared.runtime.worker import ModelRuntime
    from flared_testing.runtime import run_requests

    core = tmp_path / "tiny-bf16"
    export_core(tiny_hf_llama, core, ExportOptions(dtype="bfloat16", concurrency=4, context_tokens=256,
                                                   prefill_chunk_tokens=128))
    rt = ModelRuntime(open_core(core), prefix_cache=False, speculative=(4, 4, 2))
    rt.start(max_pending=16)
    try:
        assert type(rt.executor).__name__ == "GraphExecutor" and rt.executor.speculative and rt.spec_tokens == 4
        prompt = tuple([5, 17, 40, 99, 7] * 6)

        def run():
            reqs = [GenerateRequest(prompt, (), SamplingParams(max_tokens=24, temperature=0.0), frozenset()),
                    GenerateRequest(prompt, (), SamplingParams(max_tokens=24, temperature=0.8, seed=3), frozenset())]
            out = []
            for events in run_requests(rt, reqs):
                assert not isinstance(events[-1], ErrorEvent), events[-1]
                out.append([t for e in events if isinstance(e, TokenEvent) for t in e.token_ids])
            return out

        first, second = run(), run()
        assert first[0] == second[0] and len(first[0]) == 24 and len(first[1]) == 24
        assert rt.scheduler.counters["speculative_drafted"] > 0
        assert rt.scheduler.counters["launches_speculative"] > 0
    finally:
        rt.stop()


@pytest.mark.parametrize("graphs", [True, False])
def test_float32_drafts_from_a_draft_model_on_the_gpu_equal_plain_decoding(hf, graphs):
    """SchedulerConfig(drafter=DraftModel) with the GraphExecutor: the served model drafting for itself (its draft
    model's forwards as CUDA graphs, or eager as under --enforce-eager; not warmed up, so its first drafts run before
    anything prices them) gives plain decoding's tokens, and the speculative graphs keep the drafts."""
    from flared.execution.drafter import DraftModel

    gpu = serving_model(hf)
    plain = _plain(gpu, PROMPTS)
    drafter = DraftModel(serving_model(hf), num_pages=64, page_tokens=PAGE_TOKENS, max_context=CONTEXT,
                         vocab_limit=gpu.config.vocab_size, graphs=graphs, max_rows=4, max_depth=4)
    ex = make_executor(gpu, prefill_batch_shapes=BATCH_SHAPES, speculative=4)
    try:
        sched = _scheduler(ex.graph_shapes, max_rows=ex.spec_max_rows, drafter=drafter)
        got = _drive(ex, sched, PROMPTS)
    finally:
        ex.close()
    assert got.tokens == plain.tokens
    assert got.steps_by_kind["SPECULATIVE"] > 0 and sched.counters["drafter_steps"] > 0
    assert sched.counters["speculative_accepted"] == sched.counters["speculative_drafted"]  # its own greedy tokens
    assert not drafter._drafts  # every retired request's pages went back


def test_the_model_thread_serves_a_draft_model_on_the_gpu(tiny_hf_llama, tmp_path):
    """ModelRuntime(draft_core=...) on the GraphExecutor (bf16): the draft model loads on the GPU, timed at load,
    and the greedy tokens are plain decoding's on the same executor (whether the pricing lets it draft follows
    the measured costs: an eager draft of the served model's own size seldom pays there)."""
    from flared.core.export import ExportOptions, export_core
    from flared.core.load import open_core
    from flared.model.sampling import SamplingParams
    from flared.runtime.request import ErrorEvent, GenerateRequest, TokenEvent
    from flared.runtime.worker import ModelRuntime
    from flared_testing.runtime import run_requests

    core = tmp_path / "tiny-bf16"
    export_core(tiny_hf_llama, core, ExportOptions(dtype="bfloat16", concurrency=4, context_tokens=256,
                                                   prefill_chunk_tokens=128))
    prompt = tuple(range(60, 100))

    def serve(speculative, draft):
        rt = ModelRuntime(open_core(core), prefix_cache=False, speculative=speculative,
                          draft_core=open_core(core) if draft else None)
        rt.start(max_pending=16)
        try:
            assert type(rt.executor).__name__ == "GraphExecutor"
            if draft:
                assert rt.drafter.model.device.type == "cuda" and rt.drafter.forward_cost()[0] > 0
                assert rt.drafter.graphs is not None  # its forwards as CUDA graphs, as the served model's
            reqs = [GenerateRequest(prompt, (), SamplingParams(max_tokens=32, temperature=0.0), frozenset()),
                    GenerateRequest(prompt[3:], (), SamplingParams(max_tokens=32, temperature=0.7, seed=2),
                                    frozenset())]
            out = []
            for events in run_requests(rt, reqs):
                assert not isinstance(events[-1], ErrorEvent), events[-1]
                out.append([t for e in events if isinstance(e, TokenEvent) for t in e.token_ids])
            return out
        finally:
            rt.stop()

    plain = serve((0, 4, 2), False)
    drafted = serve((4, 4, 2), True)
    assert drafted[0] == plain[0] and len(drafted[1]) == 32
