"""The CPU sampler's draw (flared._fast.race): the GPU graphs' race, token for token, over the same scores; its
noise a function of (seed, step, token id) alone; draws that follow the distribution."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flared._fast.race import race_draw
from flared_testing.race import reference_race


def _draw(scores, seeds, steps, ids=None):
    return torch.from_numpy(race_draw(scores.float().contiguous().numpy(), None if ids is None else ids.numpy(),
                                      seeds.numpy(), steps.numpy()))


@pytest.mark.parametrize("rows, vocab, spread", [(16, 3000, 0.5), (8, 49152, 8.0), (4, 128256, 3.0)])
def test_the_draw_is_the_reference_race_s(rows, vocab, spread):
    """Every row's token is the float64 race's over the hash the GPU kernels use, for flat rows (nothing pruned)
    and peaked ones (most of the row pruned), at several steps and seeds up to 63 bits."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=g) * spread
    temperature = torch.tensor([0.3 + 0.25 * (i % 5) for i in range(rows)])
    seeds = torch.tensor([(i * 0x9E3779B97F4A7C15) & ((1 << 63) - 1) for i in range(rows)], dtype=torch.int64)
    for step in (0, 1, 77, 1 << 40):
        steps = torch.full((rows,), step, dtype=torch.int64)
        got = _draw(logits / temperature[:, None], seeds, steps)
        assert torch.equal(got, reference_race(logits, temperature, seeds, steps)), step


def test_candidates_draw_as_the_masked_row():
    """Drawing among named candidates (in any order) gives the token the whole row gives with everything else
    masked: a token's noise does not depend on which others are candidates."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 5000, generator=g) * 2
    seeds = torch.arange(6, dtype=torch.int64) * 1009 + 5
    for step in range(5):
        steps = torch.full((6,), step, dtype=torch.int64)
        vals, ids = logits.topk(300, dim=-1)
        perm = torch.randperm(300, generator=g)
        masked = torch.full_like(logits, float("-inf")).scatter(1, ids, vals)
        assert torch.equal(_draw(vals[:, perm], seeds, steps, ids[:, perm].contiguous()),
                           _draw(masked, seeds, steps))


def test_nan_wins_and_a_row_without_finite_scores_gives_its_first_column():
    x = torch.full((3, 64), float("-inf"))
    x[0, 40] = float("nan")
    x[0, 50] = float("nan")
    x[0, 3] = 5.0
    x[2, 9] = 1.0
    got = _draw(x, torch.tensor([1, 2, 3]), torch.tensor([0, 0, 0]))
    assert got.tolist() == [40, 0, 9]
    ids = torch.tensor([[7, 3, 5]] * 3)
    assert _draw(torch.full((3, 3), float("-inf")), torch.tensor([1, 2, 3]), torch.tensor([0, 0, 0]),
                 ids).tolist() == [7, 7, 7]


def test_draws_follow_softmax():
    """Over 20,000 steps of one row, each token's frequency is within 4 standard errors of softmax(x)."""
    x = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -3.0, -8.0] + [-30.0] * 57])
    p = torch.softmax(x[0].double(), 0)
    n = 20000
    counts = np.zeros(64)
    for step in range(n):
        counts[int(_draw(x, torch.tensor([12345]), torch.tensor([step]))[0])] += 1
    for i in range(7):
        assert abs(counts[i] / n - p[i]) < 4 * math.sqrt(p[i] * (1 - p[i]) / n) + 1e-9, (i, counts[:7] / n, p[:7])
    assert counts[7:].sum() == 0


def test_shapes_are_checked():
    with pytest.raises(ValueError):
        race_draw(np.zeros((2, 4), np.float32), None, np.zeros(3, np.int64), np.zeros(2, np.int64))
    with pytest.raises(ValueError):
        race_draw(np.zeros((2, 4), np.float32), np.zeros((2, 3), np.int64), np.zeros(2, np.int64),
                  np.zeros(2, np.int64))


def _reference_top_p(scores, top_p, seeds, steps):
    """Top-p by a stable sort in float64 (larger score first, smaller id first among equal ones; shares of the
    finite scores' mass), then the float64 race over the kept tokens."""
    masked = torch.full_like(scores, float("-inf"))
    for r in range(scores.shape[0]):
        x = scores[r].double()
        order = torch.sort(x, descending=True, stable=True).indices
        probs = torch.softmax(x, 0)[order]
        keep = probs.cumsum(0) - probs < float(top_p[r])
        keep[0] = True
        masked[r, order[keep]] = scores[r, order[keep]]
    return reference_race(masked, torch.ones(scores.shape[0]), seeds, steps)


@pytest.mark.parametrize("rows, vocab, spread", [(24, 3000, 0.5), (8, 49152, 4.0), (4, 128256, 2.0)])
def test_the_top_p_walk_draws_the_masked_race_s_token(rows, vocab, spread):
    """race_top_p's token is the float64 masked race's: top-p 0.01 to 1 (one keeps one token), flat and peaked rows,
    rows with masked (-inf) tokens, equal scores ranked by id, several steps."""
    from flared._fast.race import race_top_p

    g = torch.Generator().manual_seed(vocab + 7)
    scores = (torch.randn(rows, vocab, generator=g) * spread).bfloat16().float()  # many equal scores
    scores[1, ::3] = float("-inf")
    ps = [0.95, 0.01, 0.5, 0.9, 1.0, 0.99]
    top_p = torch.tensor([ps[i % len(ps)] for i in range(rows)], dtype=torch.float64)
    seeds = torch.arange(rows, dtype=torch.int64) * 104729 + (3 << 33)
    log_z = torch.logsumexp(scores, dim=-1).double()
    for step in range(3):
        steps = torch.full((rows,), step * 17, dtype=torch.int64)
        got = torch.from_numpy(race_top_p(scores.numpy(), log_z.numpy(), top_p.numpy(), seeds.numpy(), steps.numpy()))
        want = _reference_top_p(scores, top_p, seeds, steps)
        assert torch.equal(got, want), (step, (got != want).nonzero().flatten().tolist())


def test_the_top_p_walk_judges_llama_cpp_s_logits_and_its_min_p_after():
    """With a judge (the row's temperature: top-p judges the logits before it) and a floor (llama.cpp's min-p
    after top-p), race_top_p's token is the float64 reference's: top-p on shares of the judged logits, min-p's
    floor on them too, the race on the scores."""
    from flared._fast.race import race_top_p

    rows, vocab = 12, 4000
    g = torch.Generator().manual_seed(23)
    logits = torch.randn(rows, vocab, generator=g) * 2.0
    temps = [0.4, 1.0, 1.7, 0.8]
    ps = [0.9, 0.5, 1.0, 0.3, 0.95, 1.0]
    mps = [0.0, 0.05, 0.3, 0.0]
    t = torch.tensor([temps[i % 4] for i in range(rows)], dtype=torch.float64)
    scores = (logits / t.float()[:, None]).contiguous()
    top_p = torch.tensor([ps[i % 6] for i in range(rows)], dtype=torch.float64)
    floor = torch.tensor([float(logits[i].max()) + math.log(mps[i % 4]) if mps[i % 4] else -math.inf
                          for i in range(rows)], dtype=torch.float64)
    log_z = torch.logsumexp(logits.double(), dim=-1)
    seeds = torch.arange(rows, dtype=torch.int64) * 7 + 1
    for step in range(4):
        steps = torch.full((rows,), step, dtype=torch.int64)
        got = torch.from_numpy(race_top_p(scores.numpy(), log_z.numpy(), top_p.numpy(), seeds.numpy(),
                                          steps.numpy(), judge=t.numpy(), floor=floor.numpy()))
        masked = torch.full_like(scores, float("-inf"))
        for r in range(rows):
            x = logits[r].double()
            order = torch.sort(scores[r].double(), descending=True, stable=True).indices
            probs = torch.softmax(x, 0)[order]
            keep = (probs.cumsum(0) - probs < float(top_p[r])) | (top_p[r] >= 1.0)
            keep &= x[order] >= float(floor[r])
            keep[0] = True
            masked[r, order[keep]] = scores[r, order[keep]]
        want = reference_race(masked, torch.ones(rows), seeds, steps)
        assert torch.equal(got, want), (step, (got != want).nonzero().flatten().tolist())


def test_the_sampler_s_top_p_rows_draw_as_its_sorted_path():
    """Sampler rows with top-p (and min-p before it) and no top-k take the walk on the CPU; their tokens are the
    sorted path's (a top-k row in the batch sends every row there), step after step."""
    from flared.model.sampling import Sampler, SamplingParams

    g = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 5000, generator=g) * 3
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1), SamplingParams(temperature=1.2, top_p=0.5, seed=2),
              SamplingParams(temperature=0.7, top_p=0.95, min_p=0.05, seed=3),
              SamplingParams(temperature=0.9, seed=4), SamplingParams(temperature=0.6, top_p=0.3, seed=5),
              SamplingParams(temperature=1.0, top_p=0.99, seed=6)]
    walked, sampler = Sampler(5000), Sampler(5000)
    a = [walked.add_sequence(p, []) for p in params]
    b = [sampler.add_sequence(p, []) for p in params]
    with_k = sampler.add_sequence(SamplingParams(temperature=1.0, top_k=5000, seed=9), [])
    for _ in range(20):
        got = walked.sample(logits, a).token_ids
        sorted_path = sampler.sample(torch.cat([logits, logits[:1]]), b + [with_k]).token_ids[:6]
        assert torch.equal(got, sorted_path)
