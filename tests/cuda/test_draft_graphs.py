"""A draft model's forwards as CUDA graphs (flared.execution.drafter.DraftGraphs) against the same draft model run
eagerly on the GPU: float32, so both draft the model's own greedy tokens exactly.

Each proposal's first forward is a speculative decode graph (a few unseen tokens a request) or a prefill graph (a
long catch-up); every further depth is a decode graph whose rows take the token drawn at the depth before on the
device, so the proposal reads its tokens back once.
"""

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).parent))

from gpu_models import tiny_hf, serving_model  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return serving_model(tiny_hf(seed=3), max_positions=256)


def _pair(model, **kw):
    from flared.execution.drafter import DraftModel

    args = dict(num_pages=40, page_tokens=16, max_context=256, vocab_limit=model.config.vocab_size)
    args.update(kw)
    graphs = DraftModel(model, graphs=True, max_rows=4, max_depth=4, **args)
    eager = DraftModel(model, graphs=False, **args)
    assert graphs.graphs is not None and eager.graphs is None
    return graphs, eager


def test_graph_drafts_equal_the_eager_draft_models_through_accepts_and_rejections(model):
    vocab = model.config.vocab_size
    graphs, eager = _pair(model)
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(3, vocab, n).tolist() for n in (37, 20, 3))
    # first proposal: long prompts (a prefill graph), caps 4, 2 and 1
    got = graphs.propose([1, 2, 3], [a, b, c], [4, 2, 1])
    assert got == eager.propose([1, 2, 3], [a, b, c], [4, 2, 1])
    drafts = got[0]
    assert got[1] == 4 and graphs.counters["forwards"] == 4 and [len(x) for x in drafts] == [4, 2, 1]
    assert graphs.counters["caught_up"] == eager.counters["caught_up"] == 36 + 19 + 2
    # a keeps two drafts and its next token differs; b keeps both and a new token; c keeps its one: short feeds
    # (a speculative decode graph first)
    a2 = a + list(drafts[0][:2]) + [(drafts[0][2] + 1) % vocab]
    b2 = b + list(drafts[1]) + [5]
    c2 = c + list(drafts[2]) + [7]
    for caps in ([3, 4, 2], [4, 1, 4], [0, 2, 3]):
        got = graphs.propose([1, 2, 3], [a2, b2, c2], caps)
        assert got == eager.propose([1, 2, 3], [a2, b2, c2], caps), caps
        assert [len(x) for x in got[0]] == caps
        for h in (1, 2, 3):  # what each has fed the draft model, the same both ways
            assert graphs._drafts[h].fed.tolist() == eager._drafts[h].fed.tolist()
        a2, b2, c2 = (s + list(x) + [int(rng.integers(3, vocab))] for s, x in zip((a2, b2, c2), got[0]))
    assert graphs.counters["caught_up"] == eager.counters["caught_up"]
    # a request new beside old ones: one long chunk among short ones takes the prefill graph
    d = rng.integers(3, vocab, 60).tolist()
    got = graphs.propose([2, 4], [b2, d], [3, 3])
    assert got == eager.propose([2, 4], [b2, d], [3, 3])
    assert graphs.num_bytes > 0


def test_a_long_catch_up_and_p_min_in_graphs(model):
    vocab = model.config.vocab_size
    graphs, eager = _pair(model, catch_up_tokens=50)
    seq = np.random.default_rng(2).integers(3, vocab, 120).tolist()
    for _ in range(3):
        got = graphs.propose([5], [seq], [3])
        assert got == eager.propose([5], [seq], [3])
    assert got[0][0] and graphs.counters["caught_up"] == eager.counters["caught_up"] == 119
    sure, _ = _pair(model, p_min=0.999)
    assert sure.propose([1], [seq], [4]) == ([()], 0)  # a random model is never that sure
    # p_min low enough to keep some: the same cut both ways (the graphs run every depth up to the cap, the eager
    # forwards stop at the cut, so only the drafts compare)
    low_g, low_e = _pair(model, p_min=0.02)
    assert low_g.propose([1], [seq], [4])[0] == low_e.propose([1], [seq], [4])[0]
    # warm-up times the graphs: a forward's cost is known before the first proposal
    graphs.warm_up(4)
    a, b = graphs.forward_cost()
    assert a > 0

