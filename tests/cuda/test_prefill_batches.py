"""Multi-sequence prefill graphs on the GPU: the executor packs several prompts' chunks into one graph, and
the tokens equal one-sequence-at-a-time runs (float32 tiny model: exact)."""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).parent))

from gpu_models import make_executor, make_scheduler  # noqa: E402

BATCH_SHAPES = ((2, 64), (2, 128), (4, 128))
# 100 + 10 + 1 + 40 tokens: the first cohort fills (4, 128) with the last prompt's chunk cut at 17 tokens
# (no sample), which then continues over its cached prefix; 150 tokens take two chunks.
PROMPTS = [list(range(5, 105)), list(range(200, 210)), [7], list(range(300, 340))]
MORE = [list(range(5, 155)), list(range(400, 433)), list(range(100, 163)), [9, 8]]


def params(**kw):
    from flared.model.sampling import SamplingParams

    kw.setdefault("max_tokens", 16)
    kw.setdefault("temperature", 0.0)
    return SamplingParams(**kw)


def run(model, prompts, batch_shapes, plist=None):
    """drive() on a fresh executor with these prefill batch shapes; also returns each prefill plan's
    participant count (recorded by wrapping the executor's submit)."""
    from flared.execution.offline import drive

    ex = make_executor(model, prefill_batch_shapes=batch_shapes)
    prefills = []
    submit = ex.submit

    def recording_submit(plan, tables, states):
        if plan.kind_name == "PREFILL":
            prefills.append(plan.num_participants)
        return submit(plan, tables, states)

    ex.submit = recording_submit
    try:
        sched = make_scheduler(graph_shapes=ex.graph_shapes)
        result = drive(sched, ex, prompts, plist or [params()] * len(prompts))
    finally:
        del ex.submit  # no executor -> wrapper -> executor cycle left for the collector
        ex.close()
    return result, prefills


def test_executor_captures_and_exposes_the_batched_shapes(gpu_model):
    from flared.scheduler import GraphKind

    ex = make_executor(gpu_model, prefill_batch_shapes=BATCH_SHAPES)
    try:
        prefill_keys = sorted((b, t) for kind, b, t, _ in ex.graphs.graph_execs if kind == "prefill")
        assert prefill_keys == sorted([(1, 64), (1, 128), *BATCH_SHAPES])
        assert sorted((b, t) for k, b, t in ex.graph_shapes if k == GraphKind.PREFILL) == prefill_keys
        assert ex.graphs.pick("prefill", 100, batch=3) == ("prefill", 4, 128, True)
    finally:
        ex.close()


@pytest.mark.parametrize("prompts", [PROMPTS, MORE], ids=["cut-chunk", "two-chunks"])
def test_batched_prefill_tokens_equal_one_at_a_time(gpu_model, prompts):
    batched, sizes = run(gpu_model, prompts, BATCH_SHAPES)
    single, single_sizes = run(gpu_model, prompts, ())
    assert max(sizes) >= 2, sizes  # the executor ran multi-sequence prefill plans
    assert max(single_sizes) == 1
    assert len(sizes) < len(single_sizes)
    assert batched.tokens == single.tokens


def test_batched_prefill_matches_transformers(hf, gpu_model):
    result, sizes = run(gpu_model, PROMPTS, BATCH_SHAPES)
    assert max(sizes) >= 2
    for prompt, tokens in zip(PROMPTS, result.tokens):
        ids = torch.tensor([prompt], device="cuda")
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                          do_sample=False)
        assert out[0, len(prompt):].tolist() == tokens


def test_batched_prefill_samples_per_row(gpu_model):
    """Seeded sampling from a batched prefill: per-row seeds and parameters, reproducible, and the same
    tokens as one-at-a-time prefill."""
    plist = [params(temperature=0.9, top_k=40, top_p=0.9, seed=s) for s in (1, 2, 3, 4)]
    a, sizes = run(gpu_model, PROMPTS, BATCH_SHAPES, plist)
    b, _ = run(gpu_model, PROMPTS, BATCH_SHAPES, plist)
    c, _ = run(gpu_model, PROMPTS, (), plist)
    assert max(sizes) >= 2
    assert a.tokens == b.tokens == c.tokens


def test_eager_sampler_rows_in_a_batched_prefill(gpu_model):
    """A penalised / logprobs row inside a multi-sequence prefill uses the eager sampler on its own logits row."""
    plist = [params(), params(repetition_penalty=5.0, logprobs=2), params(), params()]
    a, sizes = run(gpu_model, PROMPTS, BATCH_SHAPES, plist)
    b, _ = run(gpu_model, PROMPTS, (), plist)
    assert max(sizes) >= 2
    assert a.tokens == b.tokens
